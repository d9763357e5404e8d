"""Two deliveries of the same message compared part by part, as a reader
sees them: the envelope's recipients, the address headers, the subject, the
text and HTML bodies, the attachments (file names, types and bytes), the
inline parts' Content-IDs and the extra headers. Message-ID, Date, the MIME
structure and its boundaries, and transfer encodings are not compared.

The clients' tests use it to hold a mail sent through tablemail (client ->
row -> daemon -> SMTP) to what the framework's own SMTP backend sent for the
same message (DESIGN §17). As a module: `differences(expected, actual)` on
two records of tests/support/smtp_server.py. From the command line (the Node
tests): `mail_compare.py EXPECTED.jsonl ACTUAL.jsonl`, two outputs of
smtp_server.py, pairs their mails by subject, prints the differences and exits
1 when there are any.
"""

import json
import sys
from email import policy
from email.header import decode_header, make_header
from email.parser import BytesParser

# Headers that are the message's fields, its structure, or the trace: read
# through their own fields below, or not compared at all.
STANDARD_HEADERS = {
    "from",
    "to",
    "cc",
    "reply-to",
    "subject",
    "date",
    "message-id",
    "mime-version",
    "content-type",
    "content-transfer-encoding",
    "received",
}


def _addresses(message, name):
    header = message.get(name)
    if header is None:
        return []
    return [(a.display_name, a.addr_spec.lower()) for a in header.addresses]


def _text(part):
    """A text body as a reader has it: decoded, line endings as LF (the wire
    form is CRLF whatever the sender held)."""
    return part.get_content().replace("\r\n", "\n")


def _is_body(part):
    return (
        part.get_content_type() in ("text/plain", "text/html")
        and part.get_filename() is None
        and part.get_content_disposition() != "attachment"
        and part.get("Content-ID") is None
    )


def _filename(legacy_part):
    """A part's file name: read by the compat32 parser, which takes a token
    as RFC 2045 defines it (the default policy's parser reads
    `filename=a.*` as `a.`), then any RFC 2047 words decoded."""
    name = legacy_part.get_filename()
    if name is None:
        return None
    return str(make_header(decode_header(name)))


def summary(raw, rcpt_tos=()):
    """What a reader of one received message sees, as plain data."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")
    message = BytesParser(policy=policy.default).parsebytes(raw)
    legacy = BytesParser(policy=policy.compat32).parsebytes(raw)
    bodies = []
    files = []
    inline = []
    for part, legacy_part in zip(message.walk(), legacy.walk()):
        if part.is_multipart():
            continue
        if _is_body(part):
            bodies.append((part.get_content_type(), _text(part)))
            continue
        content = part.get_payload(decode=True) or b""
        if part.get_content_maintype() == "text":
            # MIME's canonical form of text has CRLF line ends (RFC 2046
            # §4.1.1): a text file may arrive with either.
            content = content.replace(b"\r\n", b"\n")
        cid = part.get("Content-ID")
        entry = {
            "filename": _filename(legacy_part),
            "content_type": part.get_content_type(),
            "content": content,
        }
        if cid is not None:
            entry["content_id"] = str(cid).strip().strip("<>")
            inline.append(entry)
        else:
            files.append(entry)
    extra = {}
    for name, value in message.items():
        if name.lower() not in STANDARD_HEADERS:
            extra.setdefault(name.lower(), []).append(" ".join(str(value).split()))
    return {
        "recipients": sorted(r.lower() for r in rcpt_tos),
        "from": _addresses(message, "From"),
        "to": _addresses(message, "To"),
        "cc": _addresses(message, "Cc"),
        "reply_to": _addresses(message, "Reply-To"),
        "subject": str(message.get("Subject", "")),
        "bodies": sorted(bodies),
        "attachments": files,
        "inline": inline,
        "headers": extra,
        "message_id": str(message.get("Message-ID", "")).strip(),
    }


def summary_of_record(record):
    return summary(record["data"], record["rcpt_tos"])


def differences(expected, actual):
    """What differs between two smtp_server.py records, one line each."""
    a, b = summary_of_record(expected), summary_of_record(actual)
    out = []
    for key in ("recipients", "from", "to", "cc", "reply_to", "subject", "bodies", "headers"):
        if a[key] != b[key]:
            out.append(f"{key}: expected {a[key]!r}, got {b[key]!r}")
    for key in ("attachments", "inline"):
        if len(a[key]) != len(b[key]):
            out.append(f"{key}: expected {len(a[key])} parts, got {len(b[key])}")
            continue
        for n, (x, y) in enumerate(zip(a[key], b[key]), 1):
            for field in x.keys() | y.keys():
                if x.get(field) != y.get(field):
                    shown = (
                        (len(x.get(field) or b""), len(y.get(field) or b""))
                        if field == "content"
                        else (x.get(field), y.get(field))
                    )
                    out.append(f"{key} {n} {field}: expected {shown[0]!r}, got {shown[1]!r}")
    return out


def by_subject(records):
    return {summary_of_record(r)["subject"]: r for r in records}


def main(argv):
    """Pairs the mails of two smtp_server.py outputs by subject."""
    files = []
    for path in argv[1:3]:
        with open(path) as f:
            files.append(by_subject(json.loads(line) for line in f if line.strip()))
    expected, actual = files
    found = []
    if sorted(expected) != sorted(actual):
        found.append(f"subjects: expected {sorted(expected)!r}, got {sorted(actual)!r}")
    for subject in sorted(expected.keys() & actual.keys()):
        found += [f"{subject!r}: {d}" for d in differences(expected[subject], actual[subject])]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
