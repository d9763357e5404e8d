"""A Django email backend that writes rows for tablemail (DESIGN §17).

``EMAIL_BACKEND = "tablemail.django.EmailBackend"``: every ``EmailMessage``
sent becomes one ``mail_queue`` row and its ``mail_attachment`` rows, written
on the Django connection named by ``TABLEMAIL_DATABASE`` (default
``"default"``) inside ``transaction.atomic()``: within the caller's own
transaction the mail commits or rolls back with it; outside one, the mail and
its attachments still commit together. Nothing is sent from here; the
tablemail daemon sends what committed.
"""

from __future__ import annotations

import datetime as _dt
import email.message
import mimetypes
import os
from typing import Any, List, Optional, Sequence, Tuple

from django.conf import settings
from django.core.mail.backends.base import BaseEmailBackend
from django.db import DatabaseError, IntegrityError, connections, transaction
from django.utils import timezone

from . import _rows
from ._rows import Attachment, Row

__all__ = ["EmailBackend", "message_row"]


class EmailBackend(BaseEmailBackend):
    """Writes each message as a row. ``using`` names the database connection
    (default: the ``TABLEMAIL_DATABASE`` setting, else ``"default"``)."""

    def __init__(self, fail_silently: bool = False, using: Optional[str] = None, **kwargs: Any):
        super().__init__(fail_silently=fail_silently, **kwargs)
        self.using = using or getattr(settings, "TABLEMAIL_DATABASE", "default")

    def send_messages(self, email_messages) -> int:
        """Writes every message in one atomic block and returns their count.
        Each is checked first: an invalid one (a reserved header, no
        recipient) raises ``ValueError`` and nothing is written. With
        ``fail_silently``, a database error returns 0 instead of raising
        (nothing is written then either)."""
        messages = list(email_messages or [])
        if not messages:
            return 0
        rows = [message_row(m) for m in messages]
        try:
            with transaction.atomic(using=self.using):
                connection = connections[self.using]
                ids = [_insert(connection, row) for row in rows]
        except DatabaseError:
            if not self.fail_silently:
                raise
            return 0
        for message, row, mail_id in zip(messages, rows, ids):
            message.tablemail_id = mail_id
            message.tablemail_message_id = row.message_id
        return len(messages)


def message_row(message) -> Row:
    """The row for an ``EmailMessage`` (or ``EmailMultiAlternatives``),
    checked; raises ``ValueError`` for what tablemail would refuse."""
    from_email = message.from_email or settings.DEFAULT_FROM_EMAIL
    from_name, from_address = _rows.mailbox(from_email, "from_email")
    text, html = _bodies(message)
    row = Row(
        to_address=_rows.address_list(message.to, "to") or "",
        cc=_rows.address_list(message.cc, "cc"),
        bcc=_rows.address_list(message.bcc, "bcc"),
        reply_to=_rows.address_list(message.reply_to, "reply_to"),
        # An empty name, not NULL: the daemon's defaults.from_name would fill NULL.
        from_name=from_name,
        from_address=from_address,
        subject=str(message.subject or ""),
        body=text,
        body_html=html,
        headers=_rows.check_headers(dict(message.extra_headers or {})),
        message_id=_rows.new_message_id(from_address),
        options=_rows.check_options(getattr(message, "tablemail", None)),
        attachments=[
            _attachment(a, number, message) for number, a in enumerate(message.attachments or [], 1)
        ],
    )
    _rows.check_row(row)
    return row


def _bodies(message) -> Tuple[Optional[str], Optional[str]]:
    """``body`` and ``body_html``: the message's own body by its
    ``content_subtype``, and the alternatives of ``EmailMultiAlternatives``."""
    slots = {"plain": None, "html": None}

    def put(content: Any, subtype: str, what: str) -> None:
        if subtype not in slots:
            raise ValueError(
                f"tablemail sends text/plain and text/html bodies only, not text/{subtype} ({what})"
            )
        if slots[subtype] is not None:
            raise ValueError(f"the message has two text/{subtype} bodies ({what})")
        slots[subtype] = str(content)

    put(message.body or "", getattr(message, "content_subtype", "plain"), "content_subtype")
    for alternative in getattr(message, "alternatives", None) or []:
        content, mimetype = alternative[0], alternative[1]
        kind, _, subtype = str(mimetype).lower().partition("/")
        if kind != "text":
            raise ValueError(f"tablemail cannot send an alternative of type {mimetype}")
        put(content, subtype, "an alternative")
    return slots["plain"], slots["html"]


def _attachment(item: Any, number: int, message) -> Attachment:
    """One of ``message.attachments``: a MIME part (``MIMEBase``,
    ``MIMEImage``, ``MIMEPart``) or a ``(filename, content, mimetype)``."""
    if isinstance(item, email.message.Message):
        if item.is_multipart():
            raise ValueError(f"attachment {number}: tablemail cannot attach a multipart part")
        essence = item.get_content_type()
        params = [(k, v) for k, v in item.get_params(header="content-type")[1:] if isinstance(v, str)]
        content = item.get_payload(decode=True)
        if content is None:
            content = b""
        cid = item.get("Content-ID")
        content_id = _rows.check_content_id(str(cid)) if cid is not None else None
        filename = item.get_filename()
        if not filename:
            # The daemon needs a name for every part: one from the Content-ID.
            stem = content_id.split("@", 1)[0] if content_id else f"attachment-{number}"
            filename = stem + (mimetypes.guess_extension(essence) or ".bin")
        return Attachment(filename, _rows.content_type(essence, params), content, content_id)

    filename, content, mimetype = item[0], item[1], item[2] if len(item) > 2 else None
    filename = os.path.basename(str(filename)) if filename else None
    mimetype = mimetype or (mimetypes.guess_type(filename)[0] if filename else None) or _rows.DEFAULT_CONTENT_TYPE
    kind = mimetype.split("/", 1)[0].lower()
    params: List[Tuple[str, str]] = []
    if isinstance(content, str):
        # Django sends a text attachment in the message's charset.
        charset = message.encoding or settings.DEFAULT_CHARSET
        content = content.encode(charset)
        if kind == "text":
            params.append(("charset", charset))
    elif not isinstance(content, (bytes, bytearray, memoryview)):
        raise ValueError(f"attachment {number}: content must be bytes or str")
    if not filename:
        filename = f"attachment-{number}" + (mimetypes.guess_extension(mimetype) or ".bin")
    return Attachment(filename, _rows.content_type(mimetype, params), bytes(content))


def _insert(connection, row: Row) -> int:
    """Inserts the row and its attachments on ``connection`` (inside the
    caller's atomic block) and returns the mail's id: an existing row's id
    when its ``dedupe_key`` is already taken (nothing is written then)."""
    vendor = connection.vendor
    cols = row.columns()
    names: List[str] = []
    marks: List[str] = []
    params: List[Any] = []
    for name, value in cols:
        names.append(name)
        mark = "%s"
        if name == "send_at":
            value, mark = _send_at(vendor, value)
        elif name in ("headers", "template_data") and vendor == "postgresql":
            mark = "%s::jsonb"
        elif name == "bypass_suppression" and vendor == "sqlite":
            value = int(value)
        marks.append(mark)
        params.append(value)
    sql = "INSERT INTO mail_queue (%s) VALUES (%s)" % (", ".join(names), ", ".join(marks))
    returning = connection.features.can_return_columns_from_insert
    if returning:
        sql += " RETURNING id"

    dedupe_key = row.options.get("dedupe_key")
    with connection.cursor() as cursor:
        if dedupe_key is not None:
            existing = _existing(cursor, dedupe_key)
            if existing is not None:
                return existing
            try:
                # A savepoint: a concurrent insert of the same key fails this
                # statement only, and the row that won is returned.
                with transaction.atomic(using=connection.alias):
                    mail_id = _execute_insert(cursor, sql, params, returning)
            except IntegrityError:
                existing = _existing(cursor, dedupe_key)
                if existing is None:
                    raise
                return existing
        else:
            mail_id = _execute_insert(cursor, sql, params, returning)
        for a in row.attachments:
            cursor.execute(
                "INSERT INTO mail_attachment (mail_id, filename, content_type, content, content_id) "
                "VALUES (%s, %s, %s, %s, %s)",
                [mail_id, a.filename, a.content_type, a.content, a.content_id],
            )
    return mail_id


def _execute_insert(cursor, sql: str, params: Sequence[Any], returning: bool) -> int:
    cursor.execute(sql, params)
    if returning:
        return int(cursor.fetchone()[0])
    return int(cursor.lastrowid)


def _existing(cursor, dedupe_key: str) -> Optional[int]:
    cursor.execute("SELECT id FROM mail_queue WHERE dedupe_key = %s", [dedupe_key])
    found = cursor.fetchone()
    return int(found[0]) if found else None


def _send_at(vendor: str, value: _dt.datetime) -> Tuple[Any, str]:
    """``send_at`` as each backend stores it: timestamptz on PostgreSQL, UTC
    text in SQLite's own format, a UTC DATETIME on MySQL. A naive datetime
    is taken in Django's default time zone, as model fields take it."""
    if timezone.is_naive(value):
        value = timezone.make_aware(value, timezone.get_default_timezone())
    utc = value.astimezone(_dt.timezone.utc)
    if vendor == "postgresql":
        return utc, "%s"
    if vendor == "sqlite":
        return utc.strftime("%Y-%m-%d %H:%M:%S.%f"), "strftime('%%Y-%%m-%%d %%H:%%M:%%f', %s)"
    return utc.replace(tzinfo=None), "%s"
