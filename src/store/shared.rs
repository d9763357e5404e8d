//! What every backend does the same way, written once: the deadline around
//! every call, migrations, the status counts, retry, cancel and purge, the
//! dynamic INSERT of `enqueue`, and decoding rows by column name. Each
//! backend supplies its SQL ([`Queries`]) and the unit its SQL counts
//! durations in. Long because it is the code the three backends no longer
//! repeat.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::{
    migrate::{Migrate, Migrator},
    pool::PoolConnection,
    ColumnIndex, Database, Decode, Encode, Executor, FromRow, Pool, Row, Type,
};

use super::{
    Attachment, AttachmentInfo, BatchLock, DaemonBeat, DaemonRow, Enqueued, EventOutcome, EventRow,
    FailureGroup, Finished, MailContent, MailFilter, MailLookup, MailRecord, MailSizes,
    MailSummary, MinuteCount, NewMail, QueueStats, QueuedMail, RecentFailure, RecordContent,
    Result, RetrySelection, StaleRow, StatusCount, StoreError, SILENT_AFTER_SECONDS,
};

/// Milliseconds, for SQL interval arithmetic.
pub(crate) fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

/// Microseconds, for MySQL's `INTERVAL … MICROSECOND`.
pub(crate) fn micros(d: Duration) -> i64 {
    d.as_micros().min(i64::MAX as u128) as i64
}

/// Runs `work` on a pooled connection, all of it (waiting for a connection
/// included) within `limit`. On timeout the connection is closed, not given
/// back: sqlx would test it on its way back to the pool with a round-trip of
/// its own, and on a silent network (packets dropped, no reset) that test
/// never ends and holds a place in the pool for good.
pub(crate) async fn within<DB, T>(
    pool: &Pool<DB>,
    limit: Duration,
    work: impl for<'c> FnOnce(&'c mut DB::Connection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
) -> Result<T>
where
    DB: Database,
{
    let deadline = tokio::time::Instant::now() + limit;
    let mut conn: PoolConnection<DB> = tokio::time::timeout_at(deadline, pool.acquire())
        .await
        .map_err(|_| StoreError::Timeout(limit))??;
    match tokio::time::timeout_at(deadline, work(&mut conn)).await {
        Ok(result) => Ok(result?),
        Err(_) => {
            conn.close_on_drop();
            Err(StoreError::Timeout(limit))
        }
    }
}

/// The SQL of the operations every backend shares. Parameters come in the
/// order given, each used once; durations in the backend's unit, lock GUIDs
/// and daemon ids as text.
pub(crate) struct Queries {
    /// `$n` or `?`: the backend's placeholder for the n-th parameter, for
    /// the statements built at run time.
    pub placeholder: fn(usize) -> String,
    /// Rows by status: `status`, `count`.
    pub status_counts: &'static str,
    /// ($1 lock timeout) -> `oldest_due`, `stale`.
    pub status_ages: &'static str,
    /// -> `sent_1m`, `sent_5m`, `sent_15m` from the daemons' minute counts.
    pub status_rates: &'static str,
    /// The ten newest failed or unknown rows: `id`, `status`, `processed_at`, `last_error`.
    pub recent_failures: &'static str,
    /// ($1 within) -> `outcome`, `stage`, `smtp_code`, `count`, `example`.
    pub failure_groups: &'static str,
    /// ($1 id, $2 lock) -> the [`MailContent`] columns of a row this lock holds.
    pub load_content: &'static str,
    /// ($1 mail id) -> `filename`, `content_type`, `content`, `content_id`.
    pub load_attachments: &'static str,
    /// ($1 mail id, $2 filename, $3 content type, $4 content, $5 content id).
    pub insert_attachment: &'static str,
    /// ($1 outcome, $2 detail, $3 id or NULL for all): a history row for each
    /// failed or unknown row (those `retry` takes).
    pub retry_events: &'static str,
    /// ($1 attempts, $2 id or NULL for all).
    pub retry: &'static str,
    /// ($1 outcome, $2 detail, $3 id): a history row for a queued row.
    pub cancel_event: &'static str,
    /// ($1 id).
    pub cancel: &'static str,
    /// ($1 older than, $2 limit), for each kind of finished row.
    pub purge_sent: &'static str,
    pub purge_failed: &'static str,
    /// The columns of a [`MailRecord`] (without content), then ` FROM mail_queue `.
    pub mail_columns: &'static str,
    /// ($1 mail id) -> [`AttachmentInfo`] columns.
    pub attachments_of: &'static str,
    /// ($1 mail id) -> [`EventRow`] columns, oldest first.
    pub events_of: &'static str,
    /// The columns of a [`MailSummary`] (with `to_address`, `cc`, `bcc` for
    /// the domains), then ` FROM mail_queue `.
    pub summary_columns: &'static str,
    /// ($1 id, $2 host, $3 pid, $4 version, $5 in flight, $6 sent).
    pub daemon_upsert: &'static str,
    /// ($1 daemon id, $2 sent, $3 failed), into the current minute.
    pub minute_upsert: &'static str,
    /// Daemons and minutes not heard of for a day.
    pub daemons_forget: &'static str,
    pub minutes_forget: &'static str,
    /// ($1 id).
    pub daemon_delete: &'static str,
    /// ($1 silent after, in seconds) -> [`DaemonRow`] columns.
    pub daemons: &'static str,
    /// ($1 minutes) -> `minute`, `sent`, `failed`.
    pub minutes: &'static str,
}

/// The operations every backend shares.
#[async_trait]
pub trait Common: Send + Sync {
    async fn migrate(&self) -> Result<()>;
    async fn ping(&self) -> Result<()>;
    async fn load_content(&self, id: i64, lock: BatchLock) -> Result<Option<MailContent>>;
    async fn load_attachments(&self, id: i64) -> Result<Vec<Attachment>>;
    async fn stats(&self, lock_timeout: Duration) -> Result<QueueStats>;
    async fn failure_groups(&self, within: Duration) -> Result<Vec<FailureGroup>>;
    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64>;
    async fn cancel(&self, id: i64) -> Result<u64>;
    async fn purge_finished(
        &self,
        kind: Finished,
        older_than: Duration,
        limit: usize,
    ) -> Result<u64>;
    async fn find_mail(&self, lookup: &MailLookup, content: bool) -> Result<Option<MailRecord>>;
    async fn list_mails(&self, filter: &MailFilter, limit: usize) -> Result<Vec<MailSummary>>;
    async fn heartbeat(&self, beat: &DaemonBeat) -> Result<()>;
    async fn daemon_stopped(&self, id: uuid::Uuid) -> Result<()>;
    async fn daemons(&self) -> Result<Vec<DaemonRow>>;
    async fn minutes(&self, minutes: u32) -> Result<Vec<MinuteCount>>;
}

/// A backend's pool with what the shared operations need to know of it.
pub(crate) struct Shared<DB: Database> {
    pub pool: Pool<DB>,
    /// `database.statement_timeout`.
    pub deadline: Duration,
    pub queries: &'static Queries,
    /// Durations as the backend's SQL counts them.
    pub unit: fn(Duration) -> i64,
    pub migrator: Migrator,
    /// How a transaction that writes begins (SQLite takes the write lock at
    /// once: `BEGIN IMMEDIATE`).
    pub begin_write: &'static str,
}

impl<DB: Database> Shared<DB> {
    /// Runs `work` under the deadline (see [`within`]).
    pub async fn run<T>(
        &self,
        work: impl for<'c> FnOnce(&'c mut DB::Connection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    ) -> Result<T> {
        within(&self.pool, self.deadline, work).await
    }
}

/// Implements [`sqlx::FromRow`] for a struct whose fields are columns of the
/// same names, on every backend.
macro_rules! from_row {
    ($ty:ident { $($field:ident),* $(,)? }) => {
        impl<'r, R> sqlx::FromRow<'r, R> for $ty
        where
            R: Row,
            &'r str: ColumnIndex<R>,
            i64: Decode<'r, R::Database> + Type<R::Database>,
            i32: Decode<'r, R::Database> + Type<R::Database>,
            bool: Decode<'r, R::Database> + Type<R::Database>,
            String: Decode<'r, R::Database> + Type<R::Database>,
            Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
            DateTime<Utc>: Decode<'r, R::Database> + Type<R::Database>,
        {
            fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
                Ok($ty { $($field: row.try_get(stringify!($field))?),* })
            }
        }
    };
}

from_row!(StatusCount { status, count });
from_row!(RecentFailure {
    id,
    status,
    processed_at,
    last_error
});
from_row!(StaleRow { id, requeued });
from_row!(MailContent {
    from_name,
    from_address,
    to_address,
    cc,
    bcc,
    reply_to,
    subject,
    body,
    body_html,
    headers
});
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
    detail
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

/// The columns of `mail_queue` a [`MailRecord`] shows (content aside).
struct MailRow {
    id: i64,
    status: String,
    attempts: i32,
    attempts_remaining: i32,
    priority: i32,
    created_at: DateTime<Utc>,
    send_at: DateTime<Utc>,
    processed_at: Option<DateTime<Utc>>,
    retried_at: Option<DateTime<Utc>>,
    message_id: Option<String>,
    dedupe_key: Option<String>,
    last_error: Option<String>,
    relay_reply: Option<String>,
    subject: String,
    from_name: Option<String>,
    from_address: Option<String>,
    to_address: String,
    cc: Option<String>,
    bcc: Option<String>,
    reply_to: Option<String>,
    body: Option<String>,
    body_html: Option<String>,
    headers: Option<String>,
}

from_row!(MailRow {
    id,
    status,
    attempts,
    attempts_remaining,
    priority,
    created_at,
    send_at,
    processed_at,
    retried_at,
    message_id,
    dedupe_key,
    last_error,
    relay_reply,
    subject,
    from_name,
    from_address,
    to_address,
    cc,
    bcc,
    reply_to,
    body,
    body_html,
    headers
});

impl MailRow {
    fn record(self, content: bool) -> MailRecord {
        MailRecord {
            id: self.id,
            status: self.status,
            attempts: self.attempts,
            attempts_remaining: self.attempts_remaining,
            priority: self.priority,
            created_at: self.created_at,
            send_at: self.send_at,
            processed_at: self.processed_at,
            retried_at: self.retried_at,
            message_id: self.message_id,
            dedupe_key: self.dedupe_key,
            last_error: self.last_error,
            relay_reply: self.relay_reply,
            subject: self.subject,
            content: content.then_some(RecordContent {
                from_name: self.from_name,
                from_address: self.from_address,
                to_address: self.to_address,
                cc: self.cc,
                bcc: self.bcc,
                reply_to: self.reply_to,
                body: self.body,
                body_html: self.body_html,
                headers: self.headers,
            }),
            attachments: Vec::new(),
            events: Vec::new(),
        }
    }
}

/// A line of the mail list as the database returns it: the recipients are
/// reduced to their domains before they leave the store.
struct SummaryRow {
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
fn list_conditions(filter: &MailFilter, p: fn(usize) -> String) -> (String, Vec<ListParam>) {
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
enum ListParam {
    Text(String),
    Int(i64),
}

fn bind_all<'q, DB>(
    mut query: sqlx::query::Query<'q, DB, DB::Arguments>,
    params: Vec<ListParam>,
) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Database,
    for<'a> i64: Encode<'a, DB> + Type<DB>,
    for<'a> String: Encode<'a, DB> + Type<DB>,
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
fn lookup_condition(lookup: &MailLookup, p: fn(usize) -> String) -> (String, Vec<ListParam>) {
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

#[async_trait]
impl<DB> Common for Shared<DB>
where
    DB: Database,
    DB::Connection: Migrate,
    DB::QueryResult: RowsAffected,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'r> &'r str: ColumnIndex<DB::Row>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> i32: Encode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
    for<'r> i64: Decode<'r, DB>,
    for<'r> i32: Decode<'r, DB>,
    for<'r> bool: Decode<'r, DB> + Type<DB>,
    for<'r> f64: Decode<'r, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> Vec<u8>: Decode<'r, DB> + Type<DB>,
    for<'r> DateTime<Utc>: Decode<'r, DB> + Type<DB>,
    for<'r> Option<String>: Decode<'r, DB>,
{
    async fn migrate(&self) -> Result<()> {
        // No deadline: a migration may rewrite a large table; sqlx holds a
        // lock so that daemons starting together apply it once.
        self.migrator.run(&self.pool).await?;
        Ok(())
    }

    async fn ping(&self) -> Result<()> {
        self.run(|c| Box::pin(async move { c.execute("SELECT 1").await.map(|_| ()) }))
            .await
    }

    async fn load_content(&self, id: i64, lock: BatchLock) -> Result<Option<MailContent>> {
        let sql = self.queries.load_content;
        self.run(|c| {
            Box::pin(async move {
                sqlx::query_as(sql)
                    .bind(id)
                    .bind(lock.to_string())
                    .fetch_optional(&mut *c)
                    .await
            })
        })
        .await
    }

    async fn load_attachments(&self, id: i64) -> Result<Vec<Attachment>> {
        let sql = self.queries.load_attachments;
        self.run(|c| Box::pin(async move { sqlx::query_as(sql).bind(id).fetch_all(&mut *c).await }))
            .await
    }

    async fn stats(&self, lock_timeout: Duration) -> Result<QueueStats> {
        let (q, lock_timeout) = (self.queries, (self.unit)(lock_timeout));
        self.run(|c| {
            Box::pin(async move {
                let counts = sqlx::query_as(q.status_counts).fetch_all(&mut *c).await?;
                let ages = sqlx::query(q.status_ages)
                    .bind(lock_timeout)
                    .fetch_one(&mut *c)
                    .await?;
                let rates = sqlx::query(q.status_rates).fetch_one(&mut *c).await?;
                let recent_failures = sqlx::query_as(q.recent_failures).fetch_all(&mut *c).await?;
                Ok(QueueStats {
                    counts,
                    oldest_due_age_seconds: ages.try_get("oldest_due")?,
                    stale_locks: ages.try_get("stale")?,
                    sent_last_1m: rates.try_get("sent_1m")?,
                    sent_last_5m: rates.try_get("sent_5m")?,
                    sent_last_15m: rates.try_get("sent_15m")?,
                    recent_failures,
                })
            })
        })
        .await
    }

    async fn failure_groups(&self, within: Duration) -> Result<Vec<FailureGroup>> {
        let (sql, within) = (self.queries.failure_groups, (self.unit)(within));
        self.run(|c| {
            Box::pin(async move { sqlx::query_as(sql).bind(within).fetch_all(&mut *c).await })
        })
        .await
    }

    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64> {
        let (q, begin) = (self.queries, self.begin_write);
        self.run(|c| {
            Box::pin(async move {
                let mut tx = sqlx::Connection::begin_with(&mut *c, begin).await?;
                // The history first, then the rows it speaks of, in one
                // transaction.
                sqlx::query(q.retry_events)
                    .bind(EventOutcome::Retried.as_str().to_string())
                    .bind(format!(
                        "queued again by tablemail retry with {attempts} attempts"
                    ))
                    .bind(which.id())
                    .execute(&mut *tx)
                    .await?;
                let done = sqlx::query(q.retry)
                    .bind(attempts)
                    .bind(which.id())
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(done.count())
            })
        })
        .await
    }

    async fn cancel(&self, id: i64) -> Result<u64> {
        let (q, begin) = (self.queries, self.begin_write);
        self.run(|c| {
            Box::pin(async move {
                let mut tx = sqlx::Connection::begin_with(&mut *c, begin).await?;
                sqlx::query(q.cancel_event)
                    .bind(EventOutcome::Cancelled.as_str().to_string())
                    .bind("cancelled by tablemail cancel".to_string())
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                let done = sqlx::query(q.cancel).bind(id).execute(&mut *tx).await?;
                tx.commit().await?;
                Ok(done.count())
            })
        })
        .await
    }

    async fn purge_finished(
        &self,
        kind: Finished,
        older_than: Duration,
        limit: usize,
    ) -> Result<u64> {
        let sql = match kind {
            Finished::Sent => self.queries.purge_sent,
            Finished::FailedOrCancelled => self.queries.purge_failed,
        };
        let older_than = (self.unit)(older_than);
        self.run(|c| {
            Box::pin(async move {
                let done = sqlx::query(sql)
                    .bind(older_than)
                    .bind(limit as i64)
                    .execute(&mut *c)
                    .await?;
                Ok(done.count())
            })
        })
        .await
    }

    async fn find_mail(&self, lookup: &MailLookup, content: bool) -> Result<Option<MailRecord>> {
        let q = self.queries;
        let (condition, params) = lookup_condition(lookup, q.placeholder);
        let sql = format!("{}{condition}", q.mail_columns);
        self.run(|c| {
            Box::pin(async move {
                let query = bind_all(sqlx::query(sqlx::AssertSqlSafe(sql)), params);
                let row = query
                    .try_map(|r: DB::Row| MailRow::from_row(&r))
                    .fetch_optional(&mut *c)
                    .await?;
                let Some(row) = row else {
                    return Ok(None);
                };
                let mut record = row.record(content);
                record.attachments = sqlx::query_as(q.attachments_of)
                    .bind(record.id)
                    .fetch_all(&mut *c)
                    .await?;
                record.events = sqlx::query_as(q.events_of)
                    .bind(record.id)
                    .fetch_all(&mut *c)
                    .await?;
                Ok(Some(record))
            })
        })
        .await
    }

    async fn list_mails(&self, filter: &MailFilter, limit: usize) -> Result<Vec<MailSummary>> {
        let q = self.queries;
        let (condition, params) = list_conditions(filter, q.placeholder);
        let sql = format!(
            "{}{condition} ORDER BY id DESC LIMIT {}",
            q.summary_columns,
            limit.min(1000)
        );
        self.run(|c| {
            Box::pin(async move {
                let query = bind_all(sqlx::query(sqlx::AssertSqlSafe(sql)), params);
                let rows = query
                    .try_map(|r: DB::Row| SummaryRow::from_row(&r))
                    .fetch_all(&mut *c)
                    .await?;
                Ok(rows.into_iter().map(MailSummary::from).collect())
            })
        })
        .await
    }

    async fn heartbeat(&self, beat: &DaemonBeat) -> Result<()> {
        let q = self.queries;
        let beat = beat.clone();
        self.run(|c| {
            Box::pin(async move {
                sqlx::query(q.daemon_upsert)
                    .bind(beat.id.to_string())
                    .bind(beat.host)
                    .bind(beat.pid)
                    .bind(beat.version)
                    .bind(beat.in_flight)
                    .bind(beat.sent_total)
                    .execute(&mut *c)
                    .await?;
                if beat.sent_since > 0 || beat.failed_since > 0 {
                    sqlx::query(q.minute_upsert)
                        .bind(beat.id.to_string())
                        .bind(beat.sent_since)
                        .bind(beat.failed_since)
                        .execute(&mut *c)
                        .await?;
                }
                // Small tables (a row per daemon, a row per daemon-minute):
                // forgetting what is a day old costs next to nothing.
                sqlx::query(q.daemons_forget).execute(&mut *c).await?;
                sqlx::query(q.minutes_forget).execute(&mut *c).await?;
                Ok(())
            })
        })
        .await
    }

    async fn daemon_stopped(&self, id: uuid::Uuid) -> Result<()> {
        let sql = self.queries.daemon_delete;
        self.run(|c| {
            Box::pin(async move {
                sqlx::query(sql)
                    .bind(id.to_string())
                    .execute(&mut *c)
                    .await
                    .map(|_| ())
            })
        })
        .await
    }

    async fn daemons(&self) -> Result<Vec<DaemonRow>> {
        let sql = self.queries.daemons;
        self.run(|c| {
            Box::pin(async move {
                sqlx::query_as(sql)
                    .bind(SILENT_AFTER_SECONDS)
                    .fetch_all(&mut *c)
                    .await
            })
        })
        .await
    }

    async fn minutes(&self, minutes: u32) -> Result<Vec<MinuteCount>> {
        let sql = self.queries.minutes;
        self.run(|c| {
            Box::pin(async move {
                sqlx::query_as(sql)
                    .bind(i64::from(minutes))
                    .fetch_all(&mut *c)
                    .await
            })
        })
        .await
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

/// A value bound into an INSERT.
#[derive(Debug, Clone)]
pub(crate) enum Param<'a> {
    Text(&'a str),
    Int(i32),
    Time(DateTime<Utc>),
    Json(String),
}

/// The columns a new mail sets; absent ones take the table's defaults.
pub(crate) fn insert_columns(mail: &NewMail) -> Vec<(&'static str, Param<'_>)> {
    let mut cols = vec![("to_address", Param::Text(&mail.to_address))];
    let texts = [
        ("subject", &mail.subject),
        ("body", &mail.body),
        ("body_html", &mail.body_html),
        ("cc", &mail.cc),
        ("bcc", &mail.bcc),
        ("reply_to", &mail.reply_to),
        ("from_name", &mail.from_name),
        ("from_address", &mail.from_address),
        ("dedupe_key", &mail.dedupe_key),
        ("message_id", &mail.message_id),
    ];
    for (name, value) in texts {
        if let Some(v) = value {
            cols.push((name, Param::Text(v)));
        }
    }
    if let Some(p) = mail.priority {
        cols.push(("priority", Param::Int(p)));
    }
    if let Some(a) = mail.attempts_remaining {
        cols.push(("attempts_remaining", Param::Int(a)));
    }
    if let Some(t) = mail.send_at {
        cols.push(("send_at", Param::Time(t)));
    }
    if let Some(h) = &mail.headers {
        cols.push((
            "headers",
            Param::Json(serde_json::Value::Object(h.clone()).to_string()),
        ));
    }
    cols
}

/// `INSERT INTO mail_queue (…) VALUES (…)<tail>` for these columns, each
/// value written by `placeholder(position from 1, value)`, and the query with
/// the values bound in order.
pub(crate) fn insert_query<'a, DB>(
    cols: Vec<(&'static str, Param<'a>)>,
    placeholder: impl Fn(usize, &Param<'_>) -> String,
    tail: &str,
) -> sqlx::query::Query<'a, DB, DB::Arguments>
where
    DB: Database,
    for<'q> i32: Encode<'q, DB> + Type<DB>,
    for<'q> DateTime<Utc>: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
{
    let names: Vec<&str> = cols.iter().map(|(name, _)| *name).collect();
    let marks: Vec<String> = cols
        .iter()
        .enumerate()
        .map(|(i, (_, p))| placeholder(i + 1, p))
        .collect();
    let sql = format!(
        "INSERT INTO mail_queue ({}) VALUES ({}){tail}",
        names.join(", "),
        marks.join(", ")
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for (_, param) in cols {
        query = match param {
            // Owned: a borrowed `&str` here would tie the generic callers to
            // `'static` (a limit of higher-ranked bounds in async code).
            Param::Text(t) => query.bind(t.to_string()),
            Param::Int(i) => query.bind(i),
            Param::Time(t) => query.bind(t),
            Param::Json(j) => query.bind(j),
        };
    }
    query
}

/// `enqueue` where the database has `ON CONFLICT (dedupe_key) DO NOTHING
/// RETURNING id` (PostgreSQL, SQLite): each mail inserted in turn on `conn`
/// (the caller's transaction); a taken dedupe key returns no row, and the
/// existing row's id is looked up with `existing` instead.
pub(crate) async fn insert_returning<DB>(
    conn: &mut DB::Connection,
    mails: &[NewMail],
    placeholder: impl Fn(usize, &Param<'_>) -> String,
    existing: &'static str,
    attachment: &'static str,
) -> Result<Vec<Enqueued>, sqlx::Error>
where
    DB: Database,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
    for<'q> i32: Encode<'q, DB> + Type<DB>,
    for<'q> DateTime<Utc>: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'r> i64: Decode<'r, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
{
    let mut out = Vec::with_capacity(mails.len());
    for mail in mails {
        let query = insert_query::<DB>(
            insert_columns(mail),
            &placeholder,
            " ON CONFLICT (dedupe_key) DO NOTHING RETURNING id",
        );
        let enqueued = match query.fetch_optional(&mut *conn).await? {
            Some(row) => {
                let id = row.try_get(0)?;
                insert_attachments::<DB>(&mut *conn, attachment, id, &mail.attachments).await?;
                Enqueued {
                    id,
                    duplicate: false,
                }
            }
            None => Enqueued {
                id: sqlx::query_scalar(existing)
                    .bind(mail.dedupe_key.clone())
                    .fetch_one(&mut *conn)
                    .await?,
                duplicate: true,
            },
        };
        out.push(enqueued);
    }
    Ok(out)
}

/// Decodes a claimed row; the claim of every backend returns these columns:
/// the row's counters, its sizes, `inline`, and the text columns (NULL unless
/// `inline`).
pub(crate) fn queued_mail<'r, R>(row: &'r R, lock: BatchLock) -> Result<QueuedMail, sqlx::Error>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    i32: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    DateTime<Utc>: Decode<'r, R::Database> + Type<R::Database>,
{
    let size = |column: &'r str| -> Result<u64, sqlx::Error> {
        Ok(row.try_get::<Option<i64>, _>(column)?.unwrap_or(0).max(0) as u64)
    };
    let inline: bool = row.try_get("inline")?;
    Ok(QueuedMail {
        id: row.try_get("id")?,
        lock,
        priority: row.try_get("priority")?,
        attempts: row.try_get("attempts")?,
        attempts_remaining: row.try_get("attempts_remaining")?,
        relay_down_count: row.try_get("relay_down_count")?,
        message_id: row.try_get("message_id")?,
        expired: row.try_get("expired")?,
        sizes: MailSizes {
            content: size("content_bytes")?,
            bodies: size("body_bytes")?,
            attachments: size("attachment_count")? as u32,
            attachment_bytes: size("attachment_bytes")?,
        },
        content: if inline {
            Some(MailContent::from_row(row)?)
        } else {
            None
        },
    })
}

/// Outcomes as one JSON array, for backends that take a batch as JSON
/// (SQLite's `json_each`, MySQL's `JSON_TABLE`), with their history rows
/// (`ev_*` fields, absent where none is written).
pub(crate) fn finalize_json(writes: &[super::Finalize]) -> String {
    let items: Vec<serde_json::Value> = writes
        .iter()
        .map(|w| {
            let c = w.action.columns();
            let mut item = serde_json::json!({
                "id": w.id,
                "lock": w.lock.to_string(),
                "status": c.status,
                "delay_ms": c.delay_ms,
                "error": c.error,
                "refund": c.refund as i32,
                "processed": c.processed as i32,
                "relay_down": c.relay_down as i32,
                "relay_reply": w.relay_reply,
            });
            if let Some(e) = w.event_columns() {
                // Absent rather than null where there is nothing: JSON_TABLE
                // reads a missing path as SQL NULL on every MySQL and MariaDB.
                let fields = item.as_object_mut().expect("an object");
                fields.insert("ev_attempt".into(), e.attempt.into());
                fields.insert("ev_outcome".into(), e.outcome.into());
                if let Some(stage) = e.stage {
                    fields.insert("ev_stage".into(), stage.into());
                }
                if let Some(code) = e.smtp_code {
                    fields.insert("ev_code".into(), code.into());
                }
                if let Some(detail) = e.detail {
                    fields.insert("ev_detail".into(), detail.into());
                }
            }
            item
        })
        .collect();
    serde_json::Value::Array(items).to_string()
}

/// Inserts a new mail's attachments, in order, on `conn` (the transaction
/// that inserted the mail).
pub(crate) async fn insert_attachments<DB>(
    conn: &mut DB::Connection,
    sql: &'static str,
    mail_id: i64,
    attachments: &[super::NewAttachment],
) -> Result<(), sqlx::Error>
where
    DB: Database,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
{
    for a in attachments {
        let content_type = a
            .content_type
            .clone()
            .unwrap_or_else(|| super::DEFAULT_CONTENT_TYPE.to_string());
        sqlx::query(sql)
            .bind(mail_id)
            .bind(a.filename.clone())
            .bind(content_type)
            .bind(a.content.clone())
            .bind(a.content_id.clone())
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
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
