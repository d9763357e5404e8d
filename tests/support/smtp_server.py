"""A real SMTP server (aiosmtpd) for tablemail's tests.

Every accepted mail is appended as one JSON line to --out:
{"received_at": unix time, "mail_from": ..., "rcpt_tos": [...], "data": "..."};
every transaction that reached the end of data, accepted or not, is appended
to --out + ".attempts"; every AUTH the server received, as
{"mechanism": ..., "login": ..., "tls": whether the connection had TLS}
(never the password), to --out + ".auth".

Faults are chosen per mail by the local part of a recipient, so one server
serves every case of a test:
  rcpt451-*   RCPT is answered 451        rcpt550-*   RCPT is answered 550
  rcpt421-*   RCPT is answered 421 4.7.0 (this recipient only: a relay-down
              outcome that one row keeps drawing)
  throttle-*  RCPT is answered 451 4.7.1 (the relay's rate limit)
  data451-*   end of data answered 451    data554-*   end of data answered 554
  flaky-*     end of data answered 451 the first time a Message-ID is seen
  twice451-*  end of data answered 451 the first two times a Message-ID is seen
  dropdot-*   the connection is closed after end of data, with no reply
              (the mail is recorded as received: the relay "has" it)
  slow-*      the reply to end of data waits --slow seconds
  slowonce-*  as slow-*, but only the first time a Message-ID is seen (a
              resend is answered at once)
Server-wide options: --auth USER:PASS (AUTH required), --tls CERT KEY (offer
STARTTLS), --implicit-tls CERT KEY (TLS from the first byte), --throttle-file
PATH (while PATH exists, every RCPT is answered 421 4.7.0: the whole relay
throttles), --no-smtputf8 (SMTPUTF8 not offered in the EHLO reply),
--reply-like PROVIDER (end of data answered as that provider's SMTP server
answers, with a fresh id per mail: ses "250 Ok <id>", sendgrid "250 Ok:
queued as <id>", postmark "250 2.0.0 OK: queued as <uuid>", mailgun "250
Great success").

Prints "PORT <n>" on stdout once it listens.
"""

import argparse
import asyncio
import json
import logging
import os
import ssl
import sys
import time
import uuid
import warnings

from aiosmtpd.smtp import SMTP, AuthResult, LoginPassword


def rule_of(rcpts):
    for r in rcpts:
        local = r.split("@", 1)[0].lower()
        for prefix in ("rcpt451", "rcpt550", "data451", "data554", "flaky", "twice451", "dropdot",
                       "slowonce", "slow"):
            if local.startswith(prefix):
                return prefix
    return None


def provider_reply(provider):
    """The 250 reply to end of data of a provider's SMTP server."""
    if provider == "ses":
        return "250 Ok %016x-%s-000000" % (int(time.time() * 1000) << 8, uuid.uuid4())
    if provider == "sendgrid":
        return "250 Ok: queued as %s" % uuid.uuid4().hex[:22]
    if provider == "postmark":
        return "250 2.0.0 OK: queued as %s" % uuid.uuid4()
    if provider == "mailgun":
        return "250 Great success"
    return "250 2.0.0 Ok: queued"


class Recorder:
    def __init__(self, out, slow, throttle_file, reply_like=None):
        self.reply_like = reply_like
        self.out = out
        self.slow = slow
        self.throttle_file = throttle_file
        self.seen_ids = set()
        self.seen_count = {}

    def append(self, path, envelope):
        record = {
            "received_at": time.time(),
            "mail_from": envelope.mail_from,
            "rcpt_tos": list(envelope.rcpt_tos),
            "data": envelope.original_content.decode("utf-8", "replace"),
        }
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        local = address.split("@", 1)[0].lower()
        if self.throttle_file and os.path.exists(self.throttle_file):
            return "421 4.7.0 Too many messages, slow down"
        if local.startswith("rcpt421"):
            return "421 4.7.0 Try again later"
        if local.startswith("rcpt451"):
            return "451 4.3.0 Mailbox busy, try later"
        if local.startswith("throttle"):
            return "451 4.7.1 Rate limit exceeded, slow down"
        if local.startswith("rcpt550"):
            return "550 5.1.1 <%s>: Recipient address rejected: User unknown" % address
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        self.append(self.out + ".attempts", envelope)
        rule = rule_of(envelope.rcpt_tos)
        if rule == "data451":
            return "451 4.3.0 Queue full, try later"
        if rule == "data554":
            return "554 5.7.1 Message rejected as spam"
        if rule == "flaky":
            mid = message_id(envelope.original_content)
            if mid not in self.seen_ids:
                self.seen_ids.add(mid)
                return "451 4.3.0 Greylisted, come back later"
        if rule == "twice451":
            mid = message_id(envelope.original_content)
            self.seen_count[mid] = self.seen_count.get(mid, 0) + 1
            if self.seen_count[mid] <= 2:
                return "451 4.3.0 Greylisted, come back later"
        if rule == "slow":
            await asyncio.sleep(self.slow)
        if rule == "slowonce":
            mid = message_id(envelope.original_content)
            if mid not in self.seen_ids:
                self.seen_ids.add(mid)
                await asyncio.sleep(self.slow)
        self.append(self.out, envelope)
        if rule == "dropdot":
            server.transport.close()
            return None
        return provider_reply(self.reply_like)


def message_id(content):
    for line in content.decode("utf-8", "replace").split("\r\n"):
        if line.lower().startswith("message-id:"):
            return line.split(":", 1)[1].strip()
    return None


class DroppingSMTP(SMTP):
    """Lets a handler close the connection without a reply (None)."""

    async def push(self, status):
        if status is None:
            return
        await super().push(status)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--slow", type=float, default=5.0)
    p.add_argument("--auth")
    p.add_argument("--tls", nargs=2)
    p.add_argument("--implicit-tls", nargs=2)
    p.add_argument("--throttle-file")
    p.add_argument("--no-smtputf8", action="store_true")
    p.add_argument("--reply-like", choices=["ses", "sendgrid", "postmark", "mailgun"])
    args = p.parse_args()
    # Failed handshakes and rejected logins are what the tests provoke.
    logging.getLogger("mail.log").setLevel(logging.CRITICAL)
    warnings.simplefilter("ignore")

    recorder = Recorder(args.out, args.slow, args.throttle_file, args.reply_like)
    open(args.out, "a").close()
    open(args.out + ".attempts", "a").close()
    open(args.out + ".auth", "a").close()

    kwargs = {"hostname": "testrelay.example", "enable_SMTPUTF8": not args.no_smtputf8}
    if args.tls:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(*args.tls)
        kwargs["tls_context"] = ctx
        kwargs["require_starttls"] = True
    if args.auth:
        user, password = args.auth.split(":", 1)

        def check(server, session, envelope, mechanism, auth_data):
            login = auth_data.login.decode() if isinstance(auth_data, LoginPassword) else None
            with open(args.out + ".auth", "a") as f:
                f.write(json.dumps({
                    "mechanism": mechanism,
                    "login": login,
                    "tls": session.ssl is not None
                    or server.transport.get_extra_info("sslcontext") is not None,
                }) + "\n")
            ok = isinstance(auth_data, LoginPassword) and (
                login == user and auth_data.password.decode() == password
            )
            return AuthResult(success=ok, handled=False)

        kwargs["authenticator"] = check
        kwargs["auth_required"] = True
        kwargs["auth_require_tls"] = bool(args.tls or args.implicit_tls)

    server_ssl = None
    if args.implicit_tls:
        server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ssl.load_cert_chain(*args.implicit_tls)

    async def serve():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: DroppingSMTP(recorder, **kwargs), "127.0.0.1", args.port, ssl=server_ssl
        )
        port = server.sockets[0].getsockname()[1]
        print("PORT %d" % port, flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
