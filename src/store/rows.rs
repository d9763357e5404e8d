//! Rows in and out of the databases, written once: decoding rows by column
//! name ([`sqlx::FromRow`] for each record), the statements built at run time
//! for the mail list's filters and a lookup, and batches encoded as JSON for
//! the databases that take them that way.
//!
//! One record's decoding, its filters and its JSON encoding are kept side
//! by side, so a new column is added in one file.

use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Database, Decode, Encode, Row, Type};

use super::{
    Attachment, AttachmentInfo, BatchLock, DaemonRow, EventRow, FailureGroup, FeedbackCount,
    MailContent, MailFilter, MailLookup, MailRecord, MailSizes, MailSummary, MinuteCount,
    QueuedMail, RecentFailure, StaleRow, StatusCount, Suppressed, SuppressionEntry, TemplateRow,
    TemplateVersion, UnlockedRow,
};

/// The text columns a claim returns, each NULL unless the row fits the
/// inline limit: `$fits` is the SQL condition that says so, `$p` the prefix
/// of the columns (`"c."` or `""`), `$headers` and `$template_data` how the
/// database reads those JSON columns as text.
macro_rules! inline_columns {
    ($fits:expr, $p:literal, $headers:literal, $template_data:literal) => {
        concat!(
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "from_name END AS from_name, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "from_address END AS from_address, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "to_address END AS to_address, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "cc END AS cc, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "bcc END AS bcc, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "reply_to END AS reply_to, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "subject END AS subject, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "body END AS body, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "body_html END AS body_html, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $headers,
            " END AS headers, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "route END AS route, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "template END AS template, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $template_data,
            " END AS template_data, ",
            "CASE WHEN ",
            $fits,
            " THEN ",
            $p,
            "locale END AS locale"
        )
    };
}
pub(crate) use inline_columns;

/// A value every statement here can bind on `DB`.
pub(crate) trait Bind<DB: Database>: for<'q> Encode<'q, DB> + Type<DB> {}

impl<DB: Database, T> Bind<DB> for T where T: for<'q> Encode<'q, DB> + Type<DB> {}

/// Implements [`sqlx::FromRow`] for a struct whose fields are columns of the
/// same names, on every backend.
macro_rules! from_row {
    ($ty:ident { $($field:ident),* $(,)? }) => {
        from_row!($ty, |row| Ok($ty { $($field: row.try_get(stringify!($field))?),* }));
    };
    ($ty:ident, |$row:ident| $body:expr) => {
        impl<'r, R> sqlx::FromRow<'r, R> for $ty
        where
            R: Row,
            &'r str: ColumnIndex<R>,
            usize: ColumnIndex<R>,
            i64: Decode<'r, R::Database> + Type<R::Database>,
            i32: Decode<'r, R::Database> + Type<R::Database>,
            bool: Decode<'r, R::Database> + Type<R::Database>,
            String: Decode<'r, R::Database> + Type<R::Database>,
            Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
            &'r [u8]: Decode<'r, R::Database>,
            DateTime<Utc>: Decode<'r, R::Database> + Type<R::Database>,
        {
            fn from_row($row: &'r R) -> Result<Self, sqlx::Error> {
                $body
            }
        }
    };
}

from_row!(StatusCount { status, count });
from_row!(TemplateVersion {
    name,
    locale,
    updated_at
});
from_row!(TemplateRow {
    name,
    locale,
    subject,
    body,
    body_html,
    updated_at
});
from_row!(FeedbackCount {
    source,
    kind,
    count
});
from_row!(Suppressed { address, reason });
from_row!(SuppressionEntry {
    address,
    reason,
    detail,
    mail_id,
    created_at,
    expires_at,
});
from_row!(RecentFailure {
    id,
    status,
    processed_at,
    last_error
});
from_row!(StaleRow { id, requeued });
from_row!(UnlockedRow { id, status });
from_row!(MailContent, |row| ContentColumns::of(row)?.decode(row));

/// The names of a mail's content columns, in [`ContentColumns`] order.
const CONTENT_COLUMNS: [&str; 14] = [
    "from_name",
    "from_address",
    "to_address",
    "cc",
    "bcc",
    "reply_to",
    "subject",
    "body",
    "body_html",
    "headers",
    "route",
    "template",
    "template_data",
    "locale",
];

/// Where a result's content columns are, found by name once: a claim
/// decodes a hundred rows of the same shape, and sqlx finds a column by name
/// through a hash of the name for every value, a cost a claim would pay
/// for every column of every row.
#[derive(Clone, Copy)]
struct ContentColumns([usize; 14]);

impl ContentColumns {
    fn of<'r, R: Row>(row: &'r R) -> Result<Self, sqlx::Error>
    where
        &'r str: ColumnIndex<R>,
    {
        let mut at = [0; 14];
        for (at, name) in at.iter_mut().zip(CONTENT_COLUMNS) {
            *at = name.index(row)?;
        }
        Ok(Self(at))
    }

    fn decode<'r, R>(self, row: &'r R) -> Result<MailContent, sqlx::Error>
    where
        R: Row,
        usize: ColumnIndex<R>,
        &'r [u8]: Decode<'r, R::Database>,
    {
        let mut not_utf8 = None;
        let mut text = |i: usize| text(row, self.0[i], CONTENT_COLUMNS[i], &mut not_utf8);
        let mut content = MailContent {
            from_name: text(0)?,
            from_address: text(1)?,
            to_address: required("to_address", text(2)?)?,
            cc: text(3)?,
            bcc: text(4)?,
            reply_to: text(5)?,
            subject: required("subject", text(6)?)?,
            body: text(7)?,
            body_html: text(8)?,
            headers: text(9)?,
            route: text(10)?,
            template: text(11)?,
            template_data: text(12)?,
            locale: text(13)?,
            not_utf8: None,
        };
        content.not_utf8 = not_utf8;
        Ok(content)
    }
}

/// A text column of a mail's content, its UTF-8 checked by `simdutf8` at
/// vector speed: sqlx checks a `String` an octet at a time wherever a text
/// is not plain ASCII (for German text, about a fifteenth of the daemon's
/// work per mail). The columns are text in every schema, so the raw octets
/// are taken without sqlx's type check. Text that is not UTF-8 (SQLite
/// keeps what it is given) reads as empty and is noted in `not_utf8`: one
/// such row must not fail the claim of the rows beside it.
fn text<'r, R>(
    row: &'r R,
    at: usize,
    column: &'static str,
    not_utf8: &mut Option<(&'static str, usize)>,
) -> Result<Option<String>, sqlx::Error>
where
    R: Row,
    usize: ColumnIndex<R>,
    &'r [u8]: Decode<'r, R::Database>,
{
    let Some(octets) = row.try_get_unchecked::<Option<&'r [u8]>, _>(at)? else {
        return Ok(None);
    };
    if let Ok(text) = simdutf8::basic::from_utf8(octets) {
        return Ok(Some(text.to_owned()));
    }
    // The slow check again, for where the text goes wrong.
    let at = std::str::from_utf8(octets).map_or_else(|e| e.valid_up_to(), |_| 0);
    not_utf8.get_or_insert((column, at));
    Ok(Some(String::new()))
}

/// A column that is never NULL.
fn required(column: &'static str, value: Option<String>) -> Result<String, sqlx::Error> {
    value.ok_or_else(|| sqlx::Error::ColumnDecode {
        index: column.into(),
        source: Box::new(sqlx::error::UnexpectedNullError),
    })
}

from_row!(Attachment {
    filename,
    content_type,
    content,
    content_id
});
from_row!(AttachmentInfo {
    filename,
    content_type,
    size,
    content_id
});
from_row!(EventRow {
    at,
    attempt,
    outcome,
    stage,
    smtp_code,
    detail,
    recipient,
});
from_row!(FailureGroup {
    outcome,
    stage,
    smtp_code,
    count,
    example
});
from_row!(DaemonRow {
    id,
    host,
    pid,
    version,
    started_at,
    last_seen,
    in_flight,
    sent,
    silent
});
from_row!(MinuteCount {
    minute,
    sent,
    failed
});

// A mail's row, content included; `find_mail` drops the content unless it
// was asked for. Attachments and history are read by their own statements.
from_row!(MailRecord, |row| Ok(MailRecord {
    id: row.try_get("id")?,
    status: row.try_get("status")?,
    attempts: row.try_get("attempts")?,
    attempts_remaining: row.try_get("attempts_remaining")?,
    priority: row.try_get("priority")?,
    created_at: row.try_get("created_at")?,
    send_at: row.try_get("send_at")?,
    processed_at: row.try_get("processed_at")?,
    retried_at: row.try_get("retried_at")?,
    bounced_at: row.try_get("bounced_at")?,
    message_id: row.try_get("message_id")?,
    dedupe_key: row.try_get("dedupe_key")?,
    last_error: row.try_get("last_error")?,
    relay_reply: row.try_get("relay_reply")?,
    subject: row.try_get("subject")?,
    template: row.try_get("template")?,
    locale: row.try_get("locale")?,
    template_locale: None,
    content: Some(MailContent::from_row(row)?),
    attachments: Vec::new(),
    events: Vec::new(),
}));

/// A line of the mail list as the database returns it: the recipients are
/// reduced to their domains before they leave the store.
pub(crate) struct SummaryRow {
    id: i64,
    status: String,
    priority: i32,
    attempts: i32,
    created_at: DateTime<Utc>,
    send_at: DateTime<Utc>,
    processed_at: Option<DateTime<Utc>>,
    to_address: String,
    cc: Option<String>,
    bcc: Option<String>,
    subject: String,
    last_error: Option<String>,
}

from_row!(SummaryRow {
    id,
    status,
    priority,
    attempts,
    created_at,
    send_at,
    processed_at,
    to_address,
    cc,
    bcc,
    subject,
    last_error
});

impl From<SummaryRow> for MailSummary {
    fn from(r: SummaryRow) -> Self {
        let lists = [
            Some(r.to_address.as_str()),
            r.cc.as_deref(),
            r.bcc.as_deref(),
        ];
        MailSummary {
            id: r.id,
            status: r.status,
            priority: r.priority,
            attempts: r.attempts,
            created_at: r.created_at,
            send_at: r.send_at,
            processed_at: r.processed_at,
            domains: recipient_domains(lists.into_iter().flatten()),
            subject: r.subject,
            last_error: r.last_error,
        }
    }
}

/// The distinct domains of comma-separated address lists, sorted: what may
/// be shown of recipients without asking.
pub(crate) fn recipient_domains<'a>(lists: impl Iterator<Item = &'a str>) -> String {
    let mut domains: Vec<String> = lists
        .flat_map(|list| list.split(','))
        .filter_map(|entry| {
            let (_, domain) = entry.rsplit_once('@')?;
            let domain: String = domain
                .chars()
                .take_while(|c| !matches!(c, '>' | '"' | ' ' | ')' | '('))
                .collect();
            (!domain.is_empty()).then(|| domain.to_lowercase())
        })
        .collect();
    domains.sort();
    domains.dedup();
    domains.join(",")
}

/// Where the WHERE of a mail list comes from: conditions and their values.
pub(crate) fn list_conditions(
    filter: &MailFilter,
    p: fn(usize) -> String,
) -> (String, Vec<ListParam>) {
    let mut conditions = Vec::new();
    let mut params = Vec::new();
    let mut add = |sql: &dyn Fn(&dyn Fn() -> String) -> String, param: Vec<ListParam>| {
        let start = params.len();
        let next = std::cell::Cell::new(start);
        let mark = || {
            next.set(next.get() + 1);
            p(next.get())
        };
        conditions.push(sql(&mark));
        params.extend(param);
    };
    if let Some(status) = &filter.status {
        add(
            &|m| format!("status = {}", m()),
            vec![ListParam::Text(status.clone())],
        );
    }
    if let Some(domain) = &filter.domain {
        let pattern = format!("%@{}%", domain.to_lowercase());
        add(
            &|m| {
                format!(
                    "(LOWER(to_address) LIKE {} OR LOWER(cc) LIKE {} OR LOWER(bcc) LIKE {})",
                    m(),
                    m(),
                    m()
                )
            },
            vec![
                ListParam::Text(pattern.clone()),
                ListParam::Text(pattern.clone()),
                ListParam::Text(pattern),
            ],
        );
    }
    if let Some(id) = filter.id {
        add(&|m| format!("id = {}", m()), vec![ListParam::Int(id)]);
    }
    if let Some(message_id) = &filter.message_id {
        match MailLookup::assigned_id(message_id) {
            Some(id) => add(
                &|m| format!("id = {} AND message_id = {}", m(), m()),
                vec![ListParam::Int(id), ListParam::Text(message_id.clone())],
            ),
            None => add(
                &|m| format!("message_id = {}", m()),
                vec![ListParam::Text(message_id.clone())],
            ),
        }
    }
    if let Some(key) = &filter.dedupe_key {
        add(
            &|m| format!("dedupe_key = {}", m()),
            vec![ListParam::Text(key.clone())],
        );
    }
    if let Some(before) = filter.before_id {
        add(&|m| format!("id < {}", m()), vec![ListParam::Int(before)]);
    }
    let sql = if conditions.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", conditions.join(" AND "))
    };
    (sql, params)
}

/// A value bound into a statement built at run time.
#[derive(Debug, Clone)]
pub(crate) enum ListParam {
    Text(String),
    Int(i64),
}

pub(crate) fn bind_all<'q, DB>(
    mut query: sqlx::query::Query<'q, DB, DB::Arguments>,
    params: Vec<ListParam>,
) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Database,
    i64: Bind<DB>,
    String: Bind<DB>,
{
    for param in params {
        query = match param {
            ListParam::Text(t) => query.bind(t),
            ListParam::Int(i) => query.bind(i),
        };
    }
    query
}

/// How `find_mail` finds its row: the condition, and its values.
pub(crate) fn lookup_condition(
    lookup: &MailLookup,
    p: fn(usize) -> String,
) -> (String, Vec<ListParam>) {
    match lookup {
        MailLookup::Id(id) => (format!("WHERE id = {}", p(1)), vec![ListParam::Int(*id)]),
        MailLookup::MessageId(mid) => match MailLookup::assigned_id(mid) {
            Some(id) => (
                format!("WHERE id = {} AND message_id = {}", p(1), p(2)),
                vec![ListParam::Int(id), ListParam::Text(mid.clone())],
            ),
            None => (
                format!("WHERE message_id = {}", p(1)),
                vec![ListParam::Text(mid.clone())],
            ),
        },
        MailLookup::DedupeKey(key) => (
            format!("WHERE dedupe_key = {}", p(1)),
            vec![ListParam::Text(key.clone())],
        ),
    }
}

/// The row count of a statement's result: every backend's result type has
/// one, but `sqlx::Database` does not promise it.
pub(crate) trait RowsAffected {
    fn count(&self) -> u64;
}

impl RowsAffected for sqlx::postgres::PgQueryResult {
    fn count(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsAffected for sqlx::sqlite::SqliteQueryResult {
    fn count(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsAffected for sqlx::mysql::MySqlQueryResult {
    fn count(&self) -> u64 {
        self.rows_affected()
    }
}

/// The columns of a claimed row as the claim of every backend returns it:
/// the row's counters, its sizes and `inline`, then the text columns (NULL
/// unless `inline`; SQLite's claim brings neither `inline` nor the text,
/// see [`contents`]). The batch's lock is the claim's, not a column.
const CLAIM_COLUMNS: [&str; 12] = [
    "id",
    "priority",
    "attempts",
    "attempts_remaining",
    "relay_down_count",
    "message_id",
    "expired",
    "content_bytes",
    "body_bytes",
    "attachment_count",
    "attachment_bytes",
    "inline",
];

/// Rows of `id` and the content columns, decoded by position.
pub(crate) fn contents<'r, R>(rows: &'r [R]) -> Result<Vec<(i64, MailContent)>, sqlx::Error>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    usize: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    &'r [u8]: Decode<'r, R::Database>,
{
    let Some(first) = rows.first() else {
        return Ok(Vec::new());
    };
    let id = "id".index(first)?;
    let content = ContentColumns::of(first)?;
    rows.iter()
        .map(|row| Ok((row.try_get(id)?, content.decode(row)?)))
        .collect()
}

/// Where a claim's text columns are.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClaimedText {
    /// In the claim's rows, with `inline` (NULL unless `inline`).
    Inline,
    /// Not in the claim's rows, nor `inline`: read apart (see [`contents`]).
    Apart,
}

/// Decodes the rows of a claim under `lock`, the columns found by name in
/// the first row only (see [`ContentColumns`]).
pub(crate) fn claimed<'r, R>(
    rows: &'r [R],
    lock: BatchLock,
    text: ClaimedText,
) -> Result<Vec<QueuedMail>, sqlx::Error>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    usize: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    i32: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    &'r [u8]: Decode<'r, R::Database>,
{
    let Some(first) = rows.first() else {
        return Ok(Vec::new());
    };
    let with_text = text == ClaimedText::Inline;
    let mut at = [0; 12];
    // `inline` is the last of CLAIM_COLUMNS, absent when the text is apart.
    let named = if with_text { 12 } else { 11 };
    for (at, name) in at.iter_mut().zip(CLAIM_COLUMNS).take(named) {
        *at = name.index(first)?;
    }
    let content = with_text.then(|| ContentColumns::of(first)).transpose()?;
    let [id, priority, attempts, attempts_remaining, relay_down_count, message_id, expired, content_bytes, body_bytes, attachment_count, attachment_bytes, inline] =
        at;
    rows.iter()
        .map(|row| {
            let size = |at: usize| -> Result<u64, sqlx::Error> {
                Ok(row.try_get::<Option<i64>, _>(at)?.unwrap_or(0).max(0) as u64)
            };
            Ok(QueuedMail {
                id: row.try_get(id)?,
                lock,
                priority: row.try_get(priority)?,
                attempts: row.try_get(attempts)?,
                attempts_remaining: row.try_get(attempts_remaining)?,
                relay_down_count: row.try_get(relay_down_count)?,
                message_id: row.try_get(message_id)?,
                expired: row.try_get(expired)?,
                sizes: MailSizes {
                    content: size(content_bytes)?,
                    bodies: size(body_bytes)?,
                    attachments: size(attachment_count)? as u32,
                    attachment_bytes: size(attachment_bytes)?,
                },
                content: match content {
                    Some(content) if row.try_get(inline)? => Some(content.decode(row)?),
                    _ => None,
                },
                suppression: super::SuppressionCheck::Unchecked,
                caps: super::CapCheck::Unchecked,
            })
        })
        .collect()
}

/// Outcomes as one JSON array of objects, for SQLite's `json_each`, with
/// their history rows (`ev_*` fields, absent where none is written).
/// Written straight from borrowed fields, not built as `serde_json::Value`
/// objects first: those cost a map and a string per field of every
/// outcome.
pub(crate) fn finalize_json(writes: &[super::Finalize]) -> String {
    let items: Vec<OutcomeJson<'_>> = writes.iter().map(OutcomeJson::of).collect();
    serde_json::to_string(&items).expect("outcomes serialize to JSON")
}

/// Outcomes as one JSON array of arrays, for MySQL's `JSON_TABLE` (paths
/// `$[0]` to `$[14]`, in [`OutcomeJson`]'s order; the five history fields
/// only where a history row is written, a missing element reading as
/// NULL; the history row's detail NULL where it is the error). MariaDB
/// finds an object's member by comparing names one after another, for
/// every column of every outcome; arrays are also half the octets, so a
/// hundred outcomes fit one statement, not two, and the server spends a
/// little less CPU per mail.
pub(crate) fn finalize_rows_json(writes: &[super::Finalize]) -> String {
    let items: Vec<OutcomeRow<'_>> = writes
        .iter()
        .map(|w| OutcomeRow {
            fields: OutcomeJson::of(w),
            own_detail: w.event.as_ref().and_then(|e| e.detail.as_deref()),
        })
        .collect();
    serde_json::to_string(&items).expect("outcomes serialize to JSON")
}

/// One outcome of [`finalize_json`]. The history fields are absent rather
/// than null where there is nothing.
#[derive(serde::Serialize)]
struct OutcomeJson<'a> {
    id: i64,
    lock: Displayed<BatchLock>,
    status: &'static str,
    delay_ms: i64,
    error: Option<&'a str>,
    refund: i32,
    processed: i32,
    relay_down: i32,
    relay_reply: Option<&'a str>,
    relay_queue_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ev_attempt: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ev_outcome: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ev_stage: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ev_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ev_detail: Option<&'a str>,
}

impl<'a> OutcomeJson<'a> {
    fn of(w: &'a super::Finalize) -> Self {
        let c = w.action.columns();
        let event = w.event_columns();
        OutcomeJson {
            id: w.id,
            lock: Displayed(w.lock),
            status: c.status,
            delay_ms: c.delay_ms,
            error: c.error,
            refund: c.refund as i32,
            processed: c.processed as i32,
            relay_down: c.relay_down as i32,
            relay_reply: w.relay_reply.as_deref(),
            relay_queue_id: w.relay_queue_id(),
            ev_attempt: event.as_ref().map(|e| e.attempt),
            ev_outcome: event.as_ref().map(|e| e.outcome),
            ev_stage: event.as_ref().and_then(|e| e.stage),
            ev_code: event.as_ref().and_then(|e| e.smtp_code),
            ev_detail: event.as_ref().and_then(|e| e.detail),
        }
    }
}

/// One outcome of [`finalize_rows_json`]: its fields as an array. The
/// history row's detail only where it is not the outcome's error (the
/// statement falls back to that), so that no text goes twice.
struct OutcomeRow<'a> {
    fields: OutcomeJson<'a>,
    own_detail: Option<&'a str>,
}

impl serde::Serialize for OutcomeRow<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let o = &self.fields;
        let with_event = o.ev_outcome.is_some();
        let mut row = serializer.serialize_tuple(if with_event { 15 } else { 10 })?;
        row.serialize_element(&o.id)?;
        row.serialize_element(&o.lock)?;
        row.serialize_element(o.status)?;
        row.serialize_element(&o.delay_ms)?;
        row.serialize_element(&o.error)?;
        row.serialize_element(&o.refund)?;
        row.serialize_element(&o.processed)?;
        row.serialize_element(&o.relay_down)?;
        row.serialize_element(&o.relay_reply)?;
        row.serialize_element(&o.relay_queue_id)?;
        if with_event {
            row.serialize_element(&o.ev_attempt)?;
            row.serialize_element(&o.ev_outcome)?;
            row.serialize_element(&o.ev_stage)?;
            row.serialize_element(&o.ev_code)?;
            row.serialize_element(&self.own_detail)?;
        }
        row.end()
    }
}

/// A value serialized as the string its `Display` writes.
struct Displayed<T>(T);

impl<T: std::fmt::Display> serde::Serialize for Displayed<T> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&self.0)
    }
}

/// `(id, lock)` pairs as one JSON array, sorted by id (the order in which
/// rows are locked).
pub(crate) fn held_json(held: &[(i64, BatchLock)]) -> String {
    let mut held = held.to_vec();
    held.sort_unstable_by_key(|(id, _)| *id);
    let items: Vec<serde_json::Value> = held
        .iter()
        .map(|(id, lock)| serde_json::json!({"id": id, "lock": lock.to_string()}))
        .collect();
    serde_json::Value::Array(items).to_string()
}

/// Lock GUIDs as one JSON array of strings.
pub(crate) fn locks_json(locks: &[BatchLock]) -> String {
    serde_json::Value::Array(
        locks
            .iter()
            .map(|l| serde_json::Value::String(l.to_string()))
            .collect(),
    )
    .to_string()
}
