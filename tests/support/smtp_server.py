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
Great success"), --host ADDRESS (listen there rather than on 127.0.0.1: an
address in a network namespace of the test's own).

--xoauth2 SECONDS: an OAuth2 relay, as Microsoft 365 or Google Workspace are.
The same process serves a token endpoint on 127.0.0.1 (printed as
"TOKEN_URL <url>" before "PORT"): a POST of a client-credentials form
(grant_type=client_credentials, client_id, client_secret, scope) is answered
{"access_token": <random>, "token_type": "Bearer", "expires_in": SECONDS};
while --token-refuse-file PATH exists it answers HTTP 400 {"error":
"invalid_client", ...} instead. --xoauth2-client ID:SECRET is the only client
it serves. The SMTP side offers AUTH XOAUTH2 alone (RFC: base64 of "user="
USER "\x01auth=Bearer " TOKEN "\x01\x01"; the user is --auth's) and accepts
only a token it issued that has not expired; a session whose token expired
since is answered 421 at its next MAIL and closed, so a long drain must log
in again with a renewed token. Every token issued is appended to --out +
".tokens" as {"issued_at", "token": a digest, "value"}; every XOAUTH2 AUTH
to --out + ".auth" with the digest of its token and whether it was accepted.
While --token-revoke-file PATH exists, the tokens issued before it was made
are refused at AUTH, and their sessions are answered 421 at their next
MAIL and closed (revoked, as an administrator or a password change does),
though they have not expired.

Prints "PORT <n>" on stdout once it listens.
"""

import argparse
import asyncio
import base64
import hashlib
import http.server
import json
import logging
import os
import secrets
import ssl
import sys
import threading
import time
import urllib.parse
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


def digest(token):
    """What the records say of a token: never the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


class TokenIssuer:
    """The token endpoint's state, shared with the SMTP side: which tokens
    were issued and until when."""

    def __init__(self, lifetime, client, refuse_file, revoke_file, log_path):
        self.revoke_file = revoke_file
        self.issued = {}
        self.lifetime = lifetime
        self.client = client
        self.refuse_file = refuse_file
        self.log_path = log_path
        self.lock = threading.Lock()
        self.expiry = {}

    def issue(self, form):
        """(HTTP status, JSON answer) for a POSTed form."""
        if self.refuse_file and os.path.exists(self.refuse_file):
            return 400, {
                "error": "invalid_client",
                "error_description": "AADSTS7000215: Invalid client secret provided.",
            }
        if form.get("grant_type") != "client_credentials":
            return 400, {"error": "unsupported_grant_type"}
        if self.client and [form.get("client_id"), form.get("client_secret")] != self.client:
            return 401, {"error": "invalid_client", "error_description": "unknown client"}
        token = secrets.token_urlsafe(24)
        now = time.time()
        with self.lock:
            self.expiry[token] = now + self.lifetime
            self.issued[token] = now
        with open(self.log_path, "a") as f:
            # The value too: the tests look for it where it must never be
            # (the daemon's logs, `check`'s output).
            f.write(json.dumps({"issued_at": now, "token": digest(token), "value": token}) + "\n")
        return 200, {"access_token": token, "token_type": "Bearer", "expires_in": self.lifetime}

    def revoked(self, token):
        """Whether the token was issued before --token-revoke-file was made."""
        try:
            made = os.stat(self.revoke_file).st_mtime if self.revoke_file else None
        except FileNotFoundError:
            made = None
        with self.lock:
            issued = self.issued.get(token)
        return made is not None and issued is not None and issued < made

    def expires(self, token):
        """When an issued token expires; None for a token never issued."""
        with self.lock:
            return self.expiry.get(token)

    def serve(self):
        """Serves the endpoint on a thread; returns its URL."""
        issuer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode("utf-8", "replace")
                form = {k: v[0] for k, v in urllib.parse.parse_qs(body).items()}
                status, answer = issuer.issue(form)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return "http://127.0.0.1:%d/token" % httpd.server_address[1]


class Recorder:
    def __init__(self, out, slow, throttle_file, reply_like=None, tokens=None, user=None):
        self.tokens = tokens
        self.user = user
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

    async def auth_XOAUTH2(self, server, args):
        """SASL XOAUTH2 with an initial response: a token this process
        issued and that has not expired, for --auth's user."""
        user, token = None, None
        try:
            text = base64.b64decode(args[1], validate=True).decode()
            fields = dict(f.split("=", 1) for f in text.split("\x01") if f)
            user = fields.get("user")
            bearer = fields.get("auth", "")
            if bearer.startswith("Bearer "):
                token = bearer[len("Bearer "):]
        except (IndexError, ValueError, UnicodeDecodeError):
            pass
        expires = self.tokens.expires(token) if token else None
        ok = user == self.user and expires is not None and expires > time.time()
        if ok and self.tokens.revoked(token):
            ok = False
        with open(self.out + ".auth", "a") as f:
            f.write(json.dumps({
                "mechanism": "XOAUTH2",
                "login": user,
                "tls": server._tls_protocol is not None,
                "token": digest(token) if token else None,
                "ok": ok,
            }) + "\n")
        if not ok:
            return AuthResult(success=False, handled=False,
                              message="535 5.7.3 Authentication unsuccessful")
        server.session.xoauth2_token = token
        return AuthResult(success=True, auth_data=user)

    async def handle_MAIL(self, server, session, envelope, address, mail_options):
        token = getattr(session, "xoauth2_token", None)
        if token is not None and (
            self.tokens.expires(token) <= time.time() or self.tokens.revoked(token)
        ):
            # The session's token has expired (or was revoked): log in again
            # with a new one.
            await server.push("421 4.7.0 Authentication token expired, closing connection")
            server.transport.close()
            return None
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 OK"

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
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--xoauth2", type=int)
    p.add_argument("--xoauth2-client")
    p.add_argument("--token-refuse-file")
    p.add_argument("--token-revoke-file")
    args = p.parse_args()
    # Failed handshakes and rejected logins are what the tests provoke.
    logging.getLogger("mail.log").setLevel(logging.CRITICAL)
    warnings.simplefilter("ignore")

    tokens = None
    if args.xoauth2:
        client = args.xoauth2_client.split(":", 1) if args.xoauth2_client else None
        tokens = TokenIssuer(args.xoauth2, client, args.token_refuse_file,
                             args.token_revoke_file, args.out + ".tokens")
        open(args.out + ".tokens", "a").close()
        print("TOKEN_URL %s" % tokens.serve(), flush=True)
    user = args.auth.split(":", 1)[0] if args.auth else None
    recorder = Recorder(args.out, args.slow, args.throttle_file, args.reply_like, tokens, user)
    open(args.out, "a").close()
    open(args.out + ".attempts", "a").close()
    open(args.out + ".auth", "a").close()

    kwargs = {"hostname": "testrelay.example", "enable_SMTPUTF8": not args.no_smtputf8,
              # Offered by --xoauth2 alone (Recorder.auth_XOAUTH2).
              "auth_exclude_mechanism": ["XOAUTH2"]}
    if args.tls:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(*args.tls)
        kwargs["tls_context"] = ctx
        kwargs["require_starttls"] = True
    if args.xoauth2:
        # XOAUTH2 alone (Recorder.auth_XOAUTH2): no password mechanism.
        kwargs["auth_exclude_mechanism"] = ["LOGIN", "PLAIN"]
        kwargs["auth_required"] = True
        kwargs["auth_require_tls"] = bool(args.tls or args.implicit_tls)
    elif args.auth:
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
            lambda: DroppingSMTP(recorder, **kwargs), args.host, args.port, ssl=server_ssl
        )
        port = server.sockets[0].getsockname()[1]
        print("PORT %d" % port, flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
