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
    ColumnIndex, Database, Decode, Encode, Executor, Pool, Row, Type,
};

use super::{
    BatchLock, Enqueued, FailureReason, Finished, NewMail, QueueStats, QueuedMail, RecentFailure,
    Result, RetrySelection, StaleRow, StatusCount, StoreError,
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
/// order given, each used once; durations in the backend's unit.
pub(crate) struct Queries {
    /// Rows by status: `status`, `count`.
    pub status_counts: &'static str,
    /// ($1 lock timeout) -> `oldest_due`, `stale`, `sent_1m`, `sent_5m`, `sent_15m`.
    pub status_ages: &'static str,
    /// The ten newest failed or unknown rows: `id`, `status`, `processed_at`, `last_error`.
    pub recent_failures: &'static str,
    /// ($1 within, $2 limit) -> `status`, `last_error` of failed, unknown and
    /// deferred rows processed within the window, newest first.
    pub failure_reasons: &'static str,
    /// ($1 attempts, $2 id or NULL for all).
    pub retry: &'static str,
    /// ($1 id).
    pub cancel: &'static str,
    /// ($1 older than, $2 limit), for each kind of finished row.
    pub purge_sent: &'static str,
    pub purge_failed: &'static str,
}

/// The operations every backend shares.
#[async_trait]
pub trait Common: Send + Sync {
    async fn migrate(&self) -> Result<()>;
    async fn ping(&self) -> Result<()>;
    async fn stats(&self, lock_timeout: Duration) -> Result<QueueStats>;
    async fn failure_reasons(&self, within: Duration, limit: usize) -> Result<Vec<FailureReason>>;
    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64>;
    async fn cancel(&self, id: i64) -> Result<u64>;
    async fn purge_finished(
        &self,
        kind: Finished,
        older_than: Duration,
        limit: usize,
    ) -> Result<u64>;
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
    for<'r> i64: Decode<'r, DB>,
    for<'r> f64: Decode<'r, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
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

    async fn stats(&self, lock_timeout: Duration) -> Result<QueueStats> {
        let (q, lock_timeout) = (self.queries, (self.unit)(lock_timeout));
        self.run(|c| {
            Box::pin(async move {
                let counts = sqlx::query(q.status_counts).fetch_all(&mut *c).await?;
                let ages = sqlx::query(q.status_ages)
                    .bind(lock_timeout)
                    .fetch_one(&mut *c)
                    .await?;
                let failures = sqlx::query(q.recent_failures).fetch_all(&mut *c).await?;
                let counts = counts
                    .iter()
                    .map(|r| {
                        Ok(StatusCount {
                            status: r.try_get("status")?,
                            count: r.try_get("count")?,
                        })
                    })
                    .collect::<Result<Vec<_>, sqlx::Error>>()?;
                let recent_failures = failures
                    .iter()
                    .map(|r| {
                        Ok(RecentFailure {
                            id: r.try_get("id")?,
                            status: r.try_get("status")?,
                            processed_at: r.try_get("processed_at")?,
                            last_error: r.try_get("last_error")?,
                        })
                    })
                    .collect::<Result<Vec<_>, sqlx::Error>>()?;
                Ok(QueueStats {
                    counts,
                    oldest_due_age_seconds: ages.try_get("oldest_due")?,
                    stale_locks: ages.try_get("stale")?,
                    sent_last_1m: ages.try_get("sent_1m")?,
                    sent_last_5m: ages.try_get("sent_5m")?,
                    sent_last_15m: ages.try_get("sent_15m")?,
                    recent_failures,
                })
            })
        })
        .await
    }

    async fn failure_reasons(&self, within: Duration, limit: usize) -> Result<Vec<FailureReason>> {
        let (sql, within) = (self.queries.failure_reasons, (self.unit)(within));
        self.run(|c| {
            Box::pin(async move {
                sqlx::query(sql)
                    .bind(within)
                    .bind(limit as i64)
                    .fetch_all(&mut *c)
                    .await?
                    .iter()
                    .map(|r| {
                        Ok(FailureReason {
                            status: r.try_get("status")?,
                            last_error: r.try_get("last_error")?,
                        })
                    })
                    .collect()
            })
        })
        .await
    }

    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64> {
        let sql = self.queries.retry;
        self.run(|c| {
            Box::pin(async move {
                let done = sqlx::query(sql)
                    .bind(attempts)
                    .bind(which.id())
                    .execute(&mut *c)
                    .await?;
                Ok(done.count())
            })
        })
        .await
    }

    async fn cancel(&self, id: i64) -> Result<u64> {
        let sql = self.queries.cancel;
        self.run(|c| {
            Box::pin(async move {
                let done = sqlx::query(sql).bind(id).execute(&mut *c).await?;
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
) -> Result<Vec<Enqueued>, sqlx::Error>
where
    DB: Database,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
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
            Some(row) => Enqueued {
                id: row.try_get(0)?,
                duplicate: false,
            },
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

/// Decodes a claimed row; the claim of every backend returns these columns.
pub(crate) fn queued_mail<'r, R>(row: &'r R, lock: BatchLock) -> Result<QueuedMail, sqlx::Error>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    i32: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(QueuedMail {
        id: row.try_get("id")?,
        lock,
        priority: row.try_get("priority")?,
        attempts: row.try_get("attempts")?,
        attempts_remaining: row.try_get("attempts_remaining")?,
        relay_down_count: row.try_get("relay_down_count")?,
        from_name: row.try_get("from_name")?,
        from_address: row.try_get("from_address")?,
        to_address: row.try_get("to_address")?,
        cc: row.try_get("cc")?,
        bcc: row.try_get("bcc")?,
        reply_to: row.try_get("reply_to")?,
        subject: row.try_get("subject")?,
        body: row.try_get("body")?,
        body_html: row.try_get("body_html")?,
        headers: row.try_get("headers")?,
        message_id: row.try_get("message_id")?,
        expired: row.try_get("expired")?,
    })
}

/// Decodes the rows `release_stale_locks` reports (`id`, `requeued`).
pub(crate) fn stale_rows<'r, R>(rows: &'r [R]) -> Result<Vec<StaleRow>, sqlx::Error>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
{
    rows.iter()
        .map(|r| {
            Ok(StaleRow {
                id: r.try_get("id")?,
                requeued: r.try_get("requeued")?,
            })
        })
        .collect()
}

/// Outcomes as one JSON array, for backends that take a batch as JSON
/// (SQLite's `json_each`, MySQL's `JSON_TABLE`).
pub(crate) fn finalize_json(writes: &[super::Finalize]) -> String {
    let items: Vec<serde_json::Value> = writes
        .iter()
        .map(|w| {
            let c = w.action.columns();
            serde_json::json!({
                "id": w.id,
                "lock": w.lock.to_string(),
                "status": c.status,
                "delay_ms": c.delay_ms,
                "error": c.error,
                "refund": c.refund as i32,
                "processed": c.processed as i32,
                "relay_down": c.relay_down as i32,
            })
        })
        .collect();
    serde_json::Value::Array(items).to_string()
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
