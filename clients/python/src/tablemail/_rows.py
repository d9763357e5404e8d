"""A mail as the columns of one ``mail_queue`` row and its ``mail_attachment``
rows (DESIGN §1, §7), checked the way the daemon checks them (§11), so that
what the daemon would refuse at send time is refused here, before anything is
written. Framework-neutral: the Django backend builds a :class:`Row` from an
``EmailMessage`` and writes it with :func:`insert_sql`.

Column names come from fixed lists here, never from the caller; every value
goes into the statement as a parameter.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import uuid
from dataclasses import dataclass, field
from email import _header_value_parser as _parser
from email.errors import HeaderParseError
from email.headerregistry import Address
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

# The daemon's list (src/mail/header.rs RESERVED_HEADERS), plus every
# Resent-*: headers that come from columns, or would change the envelope,
# the trace or the signature.
RESERVED_HEADERS = frozenset(
    {
        "from",
        "to",
        "cc",
        "bcc",
        "reply-to",
        "subject",
        "message-id",
        "date",
        "mime-version",
        "content-type",
        "content-transfer-encoding",
        "sender",
        "return-path",
        "received",
        "dkim-signature",
    }
)

# Headers the daemon writes as they are (never encoded): printable ASCII only.
STRUCTURED_HEADERS = frozenset(
    {
        "in-reply-to",
        "references",
        "auto-submitted",
        "archived-at",
        "content-language",
        "content-disposition",
        "content-id",
        "precedence",
        "feedback-id",
        "autocrypt",
    }
)

MAX_EXTRA_HEADERS = 100
MAX_HEADERS_JSON = 64 * 1024
MAX_HEADER_NAME = 76
MAX_MESSAGE_ID = 250
MAX_CONTENT_ID = 250
MAX_FILENAME = 1024
DEFAULT_CONTENT_TYPE = "application/octet-stream"

# What ``message.tablemail`` may set, and the type each key takes. `route`,
# `template`, `template_data` and `locale` are columns of DESIGN §13 and §15:
# written only when the caller sets them.
OPTION_TYPES: Dict[str, Tuple[type, ...]] = {
    "priority": (int,),
    "send_at": (_dt.datetime,),
    "dedupe_key": (str,),
    "bypass_suppression": (bool,),
    "route": (str,),
    "template": (str,),
    "template_data": (dict,),
    "locale": (str,),
}

_ATEXT = re.compile(r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+$")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\x80-\x9f]")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def _dot_atom(text: str) -> bool:
    return bool(text) and all(_ATEXT.match(atom) for atom in text.split("."))


def check_text(what: str, value: str) -> None:
    """Refuses CR, LF and NUL (a header or command injection) and the other
    control characters but TAB, as the daemon does in headers."""
    if "\r" in value or "\n" in value or "\x00" in value:
        raise ValueError(f"{what} may not contain CR, LF or NUL (a header injection)")
    if _CONTROL.search(value):
        raise ValueError(f"{what} may not contain control characters")


def check_message_id(value: str) -> None:
    """``<id@domain>`` as the daemon accepts it (src/mail/mod.rs)."""
    check_text("Message-ID", value)
    if len(value) > MAX_MESSAGE_ID or not value.isascii():
        raise ValueError(f"Message-ID {value!r} is over {MAX_MESSAGE_ID} characters or not ASCII")
    inner = value[1:-1] if value.startswith("<") and value.endswith(">") else None
    if inner is None or "@" not in inner:
        raise ValueError(f"Message-ID {value!r} is not <id@domain>")
    left, right = inner.split("@", 1)
    literal = right.startswith("[") and right.endswith("]") and len(right) > 2
    if not _dot_atom(left) or not (literal or _dot_atom(right)):
        raise ValueError(f"Message-ID {value!r} is not <id@domain>")


def new_message_id(from_address: Optional[str]) -> str:
    """A fresh ``<random@domain>``, the domain the sender's (as A-labels) when
    it is a plain host name, else ``localhost``."""
    domain = "localhost"
    if from_address and "@" in from_address:
        candidate = from_address.rsplit("@", 1)[1]
        try:
            candidate = candidate.encode("idna").decode("ascii")
        except UnicodeError:
            candidate = ""
        if _dot_atom(candidate):
            domain = candidate
    return f"<{uuid.uuid4().hex}@{domain}>"


def _quote_phrase(name: str) -> str:
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def mailbox(value: Union[str, Sequence[str]], what: str) -> Tuple[str, str]:
    """One address as ``(display name, addr-spec)``: a string
    ``Name <a@example.com>`` or ``a@example.com``, or a ``(name, address)``
    pair, parsed as Django's SMTP backend parses it."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{what}: an address pair is (name, address), not {value!r}")
        name, address = (str(v) for v in value)
        check_text(what, name + address)
        if "@" not in address:
            raise ValueError(f'{what}: invalid address "{address}"')
        local, domain = address.rsplit("@", 1)
    else:
        text = str(value)
        check_text(what, text)
        try:
            token, rest = _parser.get_mailbox(text.strip())
        except (HeaderParseError, ValueError, IndexError):
            raise ValueError(f'{what}: invalid address "{text}"') from None
        if rest or not token.domain:
            raise ValueError(f'{what}: invalid address "{text}"')
        name = token.display_name or ""
        local, domain = token.local_part, token.domain
    if not local or not domain:
        raise ValueError(f"{what}: invalid address {value!r}")
    addr_spec = Address(username=local, domain=domain).addr_spec
    return name.strip(), addr_spec


def format_mailbox(name: str, addr_spec: str) -> str:
    """An entry of a comma-separated address column: the name always quoted,
    so commas and other specials in it stay inside it."""
    return f"{_quote_phrase(name)} <{addr_spec}>" if name else addr_spec


def address_list(values: Optional[Sequence[Any]], what: str) -> Optional[str]:
    """A column of comma-separated addresses, or None for an empty list.
    Empty entries are skipped, as Django's SMTP backend skips them."""
    if not values:
        return None
    if isinstance(values, str):
        raise ValueError(f"{what} must be a list or tuple of addresses, not a string")
    entries = [format_mailbox(*mailbox(v, what)) for v in values if v]
    return ", ".join(entries) or None


def check_headers(headers: Dict[str, Any]) -> Optional[str]:
    """Extra headers as the ``headers`` column (a JSON object), or None.
    Refuses, naming the header, what the daemon would refuse."""
    if not headers:
        return None
    if len(headers) > MAX_EXTRA_HEADERS:
        raise ValueError(f"at most {MAX_EXTRA_HEADERS} extra headers, not {len(headers)}")
    out: Dict[str, str] = {}
    seen = set()
    for name, value in headers.items():
        name = str(name)
        if not name or len(name) > MAX_HEADER_NAME:
            raise ValueError(f'header "{name[:80]}": a name is 1 to {MAX_HEADER_NAME} characters')
        if not all(33 <= ord(c) <= 126 and c != ":" for c in name):
            raise ValueError(
                f"header {name!r}: a name is printable ASCII without ':', spaces or line breaks"
            )
        lower = name.lower()
        if lower in RESERVED_HEADERS or lower.startswith("resent-"):
            hint = {
                "from": " (use from_email)",
                "to": " (use to)",
                "cc": " (use cc)",
                "bcc": " (use bcc)",
                "reply-to": " (use reply_to)",
            }.get(lower, "")
            raise ValueError(
                f'header "{name}" is reserved by tablemail: it is set from the mail\'s '
                f"fields or would change the envelope or the trace{hint}"
            )
        if lower in seen:
            raise ValueError(f'header "{name}" is given twice')
        seen.add(lower)
        text = str(value)
        check_text(f'header "{name}"', text)
        if (lower.startswith("list-") or lower in STRUCTURED_HEADERS) and not all(
            32 <= ord(c) <= 126 or c == "\t" for c in text
        ):
            raise ValueError(f'header "{name}" is structured: printable ASCII only')
        out[name] = text
    encoded = json.dumps(out, ensure_ascii=False)
    if len(encoded.encode("utf-8")) > MAX_HEADERS_JSON:
        raise ValueError(f"the extra headers are over {MAX_HEADERS_JSON} octets as JSON")
    return encoded


def check_content_id(value: str) -> str:
    """A Content-ID without its angle brackets: dot-atom text with at most
    one '@', as the daemon accepts it."""
    cid = value.strip()
    if cid.startswith("<") and cid.endswith(">"):
        cid = cid[1:-1]
    halves = cid.split("@")
    if not cid or len(cid) > MAX_CONTENT_ID or len(halves) > 2 or not all(_dot_atom(h) for h in halves):
        raise ValueError(f"Content-ID {value!r} is not a valid id (letters, digits, dots, one '@')")
    return cid


def content_type(essence: str, params: Sequence[Tuple[str, str]] = ()) -> str:
    """``type/subtype`` with parameters, as the ``content_type`` column: the
    daemon writes the ``name`` parameter from the filename itself."""
    essence = essence.strip().lower()
    kind, _, subtype = essence.partition("/")
    if not _TOKEN.match(kind or "") or not _TOKEN.match(subtype or ""):
        raise ValueError(f"{essence!r} is not a content type (type/subtype)")
    if kind in ("multipart", "message"):
        raise ValueError(
            f"tablemail cannot attach {essence} (it may not be base64-encoded); "
            "attach it as application/octet-stream"
        )
    out = essence
    for key, value in params:
        if key.lower() == "name" or key.lower().startswith("name*"):
            continue
        if not _TOKEN.match(key) or not all(32 <= ord(c) <= 126 for c in value):
            raise ValueError(f"content type parameter {key}={value!r} is not printable ASCII")
        if _TOKEN.match(value):
            out += f"; {key}={value}"
        else:
            out += '; %s="%s"' % (key, value.replace("\\", "\\\\").replace('"', '\\"'))
    return out


@dataclass
class Attachment:
    filename: str
    content_type: str
    content: bytes
    content_id: Optional[str] = None

    def check(self, number: int) -> None:
        check_text(f"attachment {number} filename", self.filename)
        if not self.filename.strip() or len(self.filename.encode("utf-8")) > MAX_FILENAME:
            raise ValueError(f"attachment {number}: a filename is 1 to {MAX_FILENAME} octets")


@dataclass
class Row:
    """The columns of one mail, None where the table's default applies."""

    to_address: str
    subject: str
    message_id: str
    cc: Optional[str] = None
    bcc: Optional[str] = None
    reply_to: Optional[str] = None
    from_name: Optional[str] = None
    from_address: Optional[str] = None
    body: Optional[str] = None
    body_html: Optional[str] = None
    headers: Optional[str] = None
    options: Dict[str, Any] = field(default_factory=dict)
    attachments: List[Attachment] = field(default_factory=list)

    def columns(self) -> List[Tuple[str, Any]]:
        """``(column, value)`` for what this mail sets, in a fixed order; the
        keys of ``options`` were checked against :data:`OPTION_TYPES`."""
        cols: List[Tuple[str, Any]] = [
            ("to_address", self.to_address),
            ("subject", self.subject),
            ("message_id", self.message_id),
        ]
        for name in ("cc", "bcc", "reply_to", "from_name", "from_address", "body", "body_html", "headers"):
            value = getattr(self, name)
            if value is not None:
                cols.append((name, value))
        for name in OPTION_TYPES:
            if name in self.options:
                value = self.options[name]
                if name == "template_data":
                    value = json.dumps(value, ensure_ascii=False)
                cols.append((name, value))
        return cols


def check_options(options: Any) -> Dict[str, Any]:
    """``message.tablemail``: a dict of the keys of :data:`OPTION_TYPES`."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError("message.tablemail must be a dict")
    out = {}
    for key, value in options.items():
        if key not in OPTION_TYPES:
            raise ValueError(
                f"message.tablemail has an unknown key {key!r} (known: {', '.join(OPTION_TYPES)})"
            )
        if value is None:
            continue
        types = OPTION_TYPES[key]
        if not isinstance(value, types) or (key == "priority" and isinstance(value, bool)):
            raise ValueError(f"message.tablemail[{key!r}] must be {types[0].__name__}, not {type(value).__name__}")
        if key == "template_data":
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"message.tablemail['template_data'] is not JSON: {e}") from None
        if key == "priority" and not -(2**31) <= value < 2**31:
            raise ValueError("message.tablemail['priority'] is out of range")
        out[key] = value
    return out


def check_row(row: Row) -> None:
    """What the daemon checks in every row, here before anything is written."""
    if not any((row.to_address, row.cc, row.bcc)):
        raise ValueError("the message has no recipients (to, cc or bcc)")
    check_text("subject", row.subject)
    if row.from_name:
        check_text("from name", row.from_name)
    check_message_id(row.message_id)
    for number, attachment in enumerate(row.attachments, 1):
        attachment.check(number)
