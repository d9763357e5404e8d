"""tablemail.django.EmailBackend against Django from PyPI, real databases and
the real daemon (DESIGN §17): what arrives at the SMTP server through
tablemail is what Django's own SMTP backend sends for the same message; the
mail is part of the caller's transaction; what tablemail would refuse is
refused before anything is written."""

import datetime as dt
import os
import shutil
import subprocess
import sys
import zipfile
from email.mime.image import MIMEImage

import pytest
from conftest import REPO, Database, eventually
from django.core.mail import EmailMessage, EmailMultiAlternatives, get_connection, send_mail
from django.db import transaction
from django.test import override_settings
from mail_compare import by_subject, differences, summary_of_record

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000")
PDF = b"%PDF-1.4\n%\xc3\xa4\xc3\xbc\n" + bytes(range(256))


def full_message():
    """Every field Django has: names with commas and umlauts, cc, bcc,
    reply-to, a non-ASCII subject, text and HTML, files (bytes, text, a
    non-ASCII name, one from disk), an inline image, extra headers."""
    m = EmailMultiAlternatives(
        subject="Grüße: your order 42",
        body="Hello Ann,\n\nyour order 42 is on its way.\nÄrger? Reply.\n",
        from_email='"Shop, Inc." <orders@shop.example>',
        to=["Ann Example <ann@example.org>", '"Doe, John" <john@example.net>'],
        # A display name that tries to smuggle in a recipient.
        cc=["Jörg <joerg@example.com>", '"Eve\\" <x@evil.example>, \\"" <eve@example.com>'],
        bcc=["audit@example.com"],
        reply_to=["help@shop.example"],
        headers={
            "X-Campaign": "spring",
            "List-Unsubscribe": "<https://shop.example/u/42>",
            "X-Note": "Grüße aus Köln",
        },
    )
    m.attach_alternative('<p>Hello <b>Ann</b></p><img src="cid:logo@shop.example">', "text/html")
    m.attach("invoice-42.pdf", PDF, "application/pdf")
    m.attach("notes.txt", "line one\nline two: é\n")
    m.attach("résumé 2024.bin", b"\x00\x01\x02\xff")
    m.attach_file(str(REPO / "LICENSE-MIT"))
    logo = MIMEImage(PNG, "png")
    logo.add_header("Content-ID", "<logo@shop.example>")
    logo.add_header("Content-Disposition", "inline", filename="logo.png")
    m.attach(logo)
    return m


def html_only_message():
    m = EmailMessage(
        "HTML only",
        "<h1>Hi</h1><p>Only HTML here.</p>",
        "Shop <orders@shop.example>",
        ["ann@example.org"],
    )
    m.content_subtype = "html"
    return m


def plain_message():
    return EmailMessage("Plain", "Just text.", "orders@shop.example", ["bob@example.net"])


def build_all():
    return [full_message(), html_only_message(), plain_message()]


def test_delivery_matches_djangos_own_smtp_backend(db, smtp_server, daemon):
    direct, relayed = smtp_server(), smtp_server()
    smtp = get_connection(
        "django.core.mail.backends.smtp.EmailBackend", host="127.0.0.1", port=direct.port, timeout=10
    )
    assert smtp.send_messages(build_all()) == 3

    messages = build_all()
    with transaction.atomic():
        assert get_connection().send_messages(messages) == 3
    ids = [m.tablemail_id for m in messages]
    assert len(set(ids)) == 3 and all(isinstance(i, int) for i in ids)
    assert db.count("mail_attachment") == 5

    running = daemon(db.url, relayed.port)
    expected = by_subject(direct.wait_for(3))
    try:
        actual = by_subject(relayed.wait_for(3))
    except BaseException:
        print(running.output())
        raise
    assert sorted(expected) == sorted(actual) == sorted(m.subject for m in messages)
    for message in messages:
        found = differences(expected[message.subject], actual[message.subject])
        assert found == [], f"{message.subject!r}: " + "\n".join(found)
        received = summary_of_record(actual[message.subject])
        stored = db.rows("SELECT message_id FROM mail_queue WHERE id = %s", [message.tablemail_id])
        assert received["message_id"] == stored[0][0] == message.tablemail_message_id

    full = summary_of_record(actual["Grüße: your order 42"])
    assert [a["filename"] for a in full["attachments"]] == [
        "invoice-42.pdf",
        "notes.txt",
        "résumé 2024.bin",
        "LICENSE-MIT",
    ]
    assert full["attachments"][0]["content"] == PDF
    assert [(i["content_id"], i["content"]) for i in full["inline"]] == [("logo@shop.example", PNG)]
    assert full["recipients"] == sorted(
        ["ann@example.org", "john@example.net", "joerg@example.com", "eve@example.com", "audit@example.com"]
    )
    eventually(
        "every row sent",
        lambda: db.rows("SELECT count(*) FROM mail_queue WHERE status = 'sent'")[0][0] == 3,
    )


def test_a_rolled_back_transaction_leaves_no_row(db):
    class Abort(Exception):
        pass

    with pytest.raises(Abort):
        with transaction.atomic():
            message = full_message()
            message.send()
            assert message.tablemail_id
            assert db.count("mail_queue") == 1
            raise Abort()
    assert db.count("mail_queue") == 0
    assert db.count("mail_attachment") == 0

    # A savepoint rolled back inside a transaction that commits.
    with transaction.atomic():
        send_mail("Kept", "Kept.", None, ["ann@example.org"])
        with pytest.raises(Abort):
            with transaction.atomic():
                send_mail("Dropped", "Dropped.", None, ["ann@example.org"])
                raise Abort()
    assert db.rows("SELECT subject, from_address FROM mail_queue") == [("Kept", "webmaster@shop.example")]


# Changes that make a message one tablemail refuses, and what the error names.
REFUSED = [
    (lambda m: m.extra_headers.update({"Sender": "ceo@shop.example"}), '"Sender"'),
    (lambda m: m.extra_headers.update({"Received": "from evil"}), '"Received"'),
    (lambda m: m.extra_headers.update({"Resent-To": "x@evil.example"}), '"Resent-To"'),
    (lambda m: m.extra_headers.update({"reply-to": "x@evil.example"}), '"reply-to"'),
    (lambda m: m.extra_headers.update({"Message-ID": "<a@b>"}), '"Message-ID"'),
    (lambda m: m.extra_headers.update({"DKIM-Signature": "v=1"}), '"DKIM-Signature"'),
    (lambda m: m.extra_headers.update({"X-Ok": "fine\r\nBcc: x@evil.example"}), '"X-Ok"'),
    (lambda m: m.extra_headers.update({"X-Bad\nBcc": "x"}), "X-Bad"),
    (lambda m: setattr(m, "subject", "Hi\r\nBcc: x@evil.example"), "subject"),
    (lambda m: m.to.append("x@evil.example\r\nBcc: y@evil.example"), "to"),
    (lambda m: (m.to.clear(), m.cc.clear(), m.bcc.clear()), "no recipients"),
    (lambda m: setattr(m, "tablemail", {"sent_at": dt.datetime.now()}), "unknown key"),
    (lambda m: setattr(m, "tablemail", {"priority": "high"}), "priority"),
    (lambda m: m.attach_alternative("BEGIN:VCALENDAR", "text/calendar"), "text/calendar"),
    (lambda m: m.attach("fwd.eml", b"Subject: x\r\n\r\nx", "message/rfc822"), "message/rfc822"),
]


def test_what_tablemail_would_refuse_is_refused_and_writes_nothing(db):
    for change, named in REFUSED:
        bad = full_message()
        change(bad)
        with pytest.raises(ValueError) as refused:
            get_connection().send_messages([plain_message(), bad])
        assert named in str(refused.value)
        assert not hasattr(bad, "tablemail_id")
    assert db.count("mail_queue") == 0
    assert db.count("mail_attachment") == 0


def test_message_tablemail_sets_the_other_columns(db):
    send_at = dt.datetime(2031, 5, 6, 7, 8, 9, 250000, tzinfo=dt.timezone(dt.timedelta(hours=2)))

    def message():
        m = full_message()
        m.tablemail = {
            "priority": 10,
            "send_at": send_at,
            "dedupe_key": "order-42-confirmation",
            "bypass_suppression": True,
        }
        return m

    first, again = message(), message()
    assert first.send() == 1
    assert again.send() == 1
    assert again.tablemail_id == first.tablemail_id
    assert db.count("mail_queue") == 1
    assert db.count("mail_attachment") == 5

    [(priority, stored, key, bypass, from_name, to, headers)] = db.rows(
        "SELECT priority, send_at, dedupe_key, bypass_suppression, from_name, to_address, headers "
        "FROM mail_queue"
    )
    assert (priority, key, bool(bypass), from_name) == (10, "order-42-confirmation", True, "Shop, Inc.")
    assert to == '"Ann Example" <ann@example.org>, "Doe, John" <john@example.net>'
    assert "List-Unsubscribe" in str(headers)
    if isinstance(stored, str):  # SQLite: UTC text with milliseconds
        stored = dt.datetime.fromisoformat(stored).replace(tzinfo=dt.timezone.utc)
    elif stored.tzinfo is None:  # MySQL: a UTC DATETIME
        stored = stored.replace(tzinfo=dt.timezone.utc)
    assert abs(stored - send_at) < dt.timedelta(milliseconds=1)

    [(filename, content_type, content, content_id)] = db.rows(
        "SELECT filename, content_type, content, content_id FROM mail_attachment "
        "WHERE content_id IS NOT NULL"
    )
    assert (filename, content_type, bytes(content), content_id) == (
        "logo.png",
        "image/png",
        PNG,
        "logo@shop.example",
    )
    [(text_type,)] = db.rows("SELECT content_type FROM mail_attachment WHERE filename = 'notes.txt'")
    assert text_type == "text/plain; charset=utf-8"


def test_tablemail_database_names_the_connection():
    queue = Database("sqlite", alias="queue")
    app = Database("sqlite", alias="default")
    try:
        with override_settings(TABLEMAIL_DATABASE="queue"):
            with transaction.atomic(using="queue"):
                message = plain_message()
                message.send()
        assert queue.count("mail_queue") == 1
        assert app.count("mail_queue") == 0
        assert get_connection(using="default").send_messages([plain_message()]) == 1
        assert app.count("mail_queue") == 1
    finally:
        queue.drop()
        app.drop()


def test_pip_builds_and_installs_the_distribution(workdir):
    # A copy: pip builds in the source tree, and leaves build/ and *.egg-info there.
    source = os.path.join(workdir, "source")
    shutil.copytree(
        REPO / "clients" / "python",
        source,
        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"),
    )
    wheels = os.path.join(workdir, "wheels")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", wheels, source],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = os.listdir(wheels)
    assert wheel.startswith("tablemail_client-") and wheel.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(os.path.join(wheels, wheel)) as z:
        assert {"tablemail/__init__.py", "tablemail/django.py", "tablemail/_rows.py"} <= set(z.namelist())
    site = os.path.join(workdir, "site")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site, os.path.join(wheels, wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    imported = subprocess.run(
        [sys.executable, "-c", "import tablemail.django as t; print(t.__file__, t.EmailBackend.__name__)"],
        env={**os.environ, "PYTHONPATH": site},
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith(site) and "EmailBackend" in imported.stdout
