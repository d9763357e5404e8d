//! The `Store` trait: every database operation tablemail performs, one
//! implementation per backend. SQL lives only in the backend files.
//!
//! The row life cycle (`queued -> sending -> sent | failed | unknown`) is enforced
//! here: claims spend an attempt, and every later write to a claimed row is fenced
//! by `id`, `thread_lock` and `status = 'sending'`, so a worker whose lock was
//! taken away cannot overwrite the new owner's state.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{ColumnIndex, Decode, Row, Type};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub mod mysql;
pub mod postgres;
pub mod sqlite;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("{0}")]
    Unsupported(String),
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// The database a `database.url` points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
    Mysql,
}

impl Backend {
    pub fn from_url(url: &str) -> Result<Backend, String> {
        let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
        match scheme {
            "postgres" | "postgresql" => Ok(Backend::Postgres),
            "sqlite" => Ok(Backend::Sqlite),
            "mysql" | "mariadb" => Ok(Backend::Mysql),
            _ => Err(format!(
                "unsupported scheme `{scheme}`: use postgres://, mysql:// or sqlite://"
            )),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
            Backend::Mysql => "mysql",
        })
    }
}

/// The GUID that one claimed batch holds in `thread_lock`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchLock(pub Uuid);

impl BatchLock {
    pub fn new() -> Self {
        BatchLock(Uuid::new_v4())
    }
}

impl Default for BatchLock {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for BatchLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What a claim asks for.
#[derive(Debug, Clone)]
pub struct Claim<'a> {
    pub lock: BatchLock,
    pub limit: usize,
    /// Rows created longer ago than this come back with `expired` set.
    pub max_age: Duration,
    /// Right-hand side of Message-IDs the daemon assigns.
    pub message_id_domain: &'a str,
}

/// A claimed row: status `sending`, held by `lock`, attempt already spent.
#[derive(Debug, Clone)]
pub struct QueuedMail {
    pub id: i64,
    pub lock: BatchLock,
    pub priority: i32,
    /// Tries made, this one included.
    pub attempts: i32,
    /// Tries left after this one.
    pub attempts_remaining: i32,
    pub from_name: Option<String>,
    pub from_address: Option<String>,
    pub to_address: String,
    pub cc: Option<String>,
    pub bcc: Option<String>,
    pub reply_to: Option<String>,
    pub subject: String,
    pub body: Option<String>,
    pub body_html: Option<String>,
    /// The `headers` column as JSON text.
    pub headers: Option<String>,
    pub message_id: String,
    /// `created_at` is older than `worker.max_age` (by the database clock).
    pub expired: bool,
}

/// The final write for one claimed row.
#[derive(Debug, Clone)]
pub struct Finalize {
    pub id: i64,
    pub lock: BatchLock,
    pub action: FinalAction,
}

#[derive(Debug, Clone, PartialEq)]
pub enum FinalAction {
    /// `sent`, lock cleared.
    Sent,
    /// Back to `queued`, `send_at = now() + delay`, the attempt stays spent.
    Retry { delay: Duration, error: String },
    /// `failed` for good.
    Failed { error: String },
    /// `unknown`: the relay may have the mail; an operator decides.
    Unknown { error: String },
    /// Back to `queued` untouched, the attempt refunded (relay down, shutdown).
    Release,
}

impl FinalAction {
    /// The columns a backend writes: status, delay in ms, last_error, refund.
    pub fn columns(&self) -> (&'static str, i64, Option<&str>, bool) {
        match self {
            FinalAction::Sent => ("sent", 0, None, false),
            FinalAction::Retry { delay, error } => {
                ("queued", delay.as_millis() as i64, Some(error), false)
            }
            FinalAction::Failed { error } => ("failed", 0, Some(error), false),
            FinalAction::Unknown { error } => ("unknown", 0, Some(error), false),
            FinalAction::Release => ("queued", 0, None, true),
        }
    }
}

/// A row that `release_stale_locks` took back from a dead or stuck worker.
#[derive(Debug, Clone, PartialEq)]
pub struct StaleRow {
    pub id: i64,
    /// `true`: back to `queued`; `false`: no attempt remained, now `failed`.
    pub requeued: bool,
}

/// One mail to insert, with the column names of `mail_queue`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NewMail {
    pub to_address: String,
    #[serde(default)]
    pub subject: Option<String>,
    #[serde(default)]
    pub body: Option<String>,
    #[serde(default)]
    pub body_html: Option<String>,
    #[serde(default)]
    pub cc: Option<String>,
    #[serde(default)]
    pub bcc: Option<String>,
    #[serde(default)]
    pub reply_to: Option<String>,
    #[serde(default)]
    pub from_name: Option<String>,
    #[serde(default)]
    pub from_address: Option<String>,
    #[serde(default)]
    pub priority: Option<i32>,
    #[serde(default)]
    pub send_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub attempts_remaining: Option<i32>,
    #[serde(default)]
    pub dedupe_key: Option<String>,
    #[serde(default)]
    pub headers: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub message_id: Option<String>,
}

/// A value bound into an INSERT.
#[derive(Debug, Clone)]
pub enum Param<'a> {
    Text(&'a str),
    Int(i32),
    Time(DateTime<Utc>),
    Json(String),
}

impl NewMail {
    /// The columns this mail sets; absent ones take the table's defaults.
    pub fn columns(&self) -> Vec<(&'static str, Param<'_>)> {
        let mut cols = vec![("to_address", Param::Text(&self.to_address))];
        let texts = [
            ("subject", &self.subject),
            ("body", &self.body),
            ("body_html", &self.body_html),
            ("cc", &self.cc),
            ("bcc", &self.bcc),
            ("reply_to", &self.reply_to),
            ("from_name", &self.from_name),
            ("from_address", &self.from_address),
            ("dedupe_key", &self.dedupe_key),
            ("message_id", &self.message_id),
        ];
        for (name, value) in texts {
            if let Some(v) = value {
                cols.push((name, Param::Text(v)));
            }
        }
        if let Some(p) = self.priority {
            cols.push(("priority", Param::Int(p)));
        }
        if let Some(a) = self.attempts_remaining {
            cols.push(("attempts_remaining", Param::Int(a)));
        }
        if let Some(t) = self.send_at {
            cols.push(("send_at", Param::Time(t)));
        }
        if let Some(h) = &self.headers {
            cols.push((
                "headers",
                Param::Json(serde_json::Value::Object(h.clone()).to_string()),
            ));
        }
        cols
    }
}

/// The result of inserting one [`NewMail`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Enqueued {
    pub id: i64,
    /// Its `dedupe_key` was already taken; `id` is the existing row.
    pub duplicate: bool,
}

/// Which rows `retry` puts back to `queued`.
#[derive(Debug, Clone, Copy)]
pub enum RetrySelection {
    Id(i64),
    AllFailed,
}

impl RetrySelection {
    /// The one row, or `None` for all of them (a NULL parameter in SQL).
    pub fn id(self) -> Option<i64> {
        match self {
            RetrySelection::Id(id) => Some(id),
            RetrySelection::AllFailed => None,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct StatusCount {
    pub status: String,
    pub count: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RecentFailure {
    pub id: i64,
    pub status: String,
    pub processed_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

impl QueueStats {
    /// Rows with this status.
    pub fn count(&self, status: &str) -> i64 {
        self.counts
            .iter()
            .find(|c| c.status == status)
            .map_or(0, |c| c.count)
    }
}

/// Finished rows that retention deletes, each kind with its own age.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    Sent,
    FailedOrCancelled,
}

/// What [`Store::maintain`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Maintenance {
    /// The table was vacuumed: it held this many dead rows.
    Vacuumed { dead_rows: i64, autovacuum: bool },
    /// Dead rows pile up, and this role may not vacuum (it does not own the table).
    CannotVacuum { dead_rows: i64 },
}

/// What `tablemail status` shows.
#[derive(Debug, Clone, Default, Serialize)]
pub struct QueueStats {
    pub counts: Vec<StatusCount>,
    /// Seconds since the oldest due `queued` row became due.
    pub oldest_due_age_seconds: Option<f64>,
    /// `sending` rows whose lock is older than the lock timeout.
    pub stale_locks: i64,
    /// Rows sent in the last minute, five minutes, fifteen minutes.
    pub sent_last_1m: i64,
    pub sent_last_5m: i64,
    pub sent_last_15m: i64,
    pub recent_failures: Vec<RecentFailure>,
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    fn backend(&self) -> Backend;

    /// Applies pending migrations (safe to run from several daemons at once).
    async fn migrate(&self) -> Result<()>;

    /// One round-trip to the database.
    async fn ping(&self) -> Result<()>;

    /// Takes up to `claim.limit` due rows, highest priority first, then oldest
    /// `send_at`, then `id`, skipping rows other workers hold. Marks them
    /// `sending` under `claim.lock` and spends one attempt each.
    async fn claim_batch(&self, claim: &Claim<'_>) -> Result<Vec<QueuedMail>>;

    /// Writes the outcomes, each fenced by id + lock + `sending`. Returns the ids
    /// that were written; the others had been taken away from this worker.
    async fn finalize(&self, writes: &[Finalize]) -> Result<Vec<i64>>;

    /// Moves `locked_at` of rows still held under `locks` to now.
    async fn renew_locks(&self, locks: &[BatchLock]) -> Result<u64>;

    /// Takes back `sending` rows whose `locked_at` is older than `older_than`:
    /// `queued` (the attempt stays spent), or `failed` when none remains.
    async fn release_stale_locks(&self, older_than: Duration) -> Result<Vec<StaleRow>>;

    /// Inserts mails in one transaction; a taken `dedupe_key` inserts nothing
    /// and reports the existing row.
    async fn enqueue(&self, mails: &[NewMail]) -> Result<Vec<Enqueued>>;

    /// Counts and ages for `tablemail status`.
    async fn stats(&self, lock_timeout: Duration) -> Result<QueueStats>;

    /// `last_error` of up to `limit` rows that ended `failed` or `unknown`
    /// within `within`, newest first.
    async fn failure_reasons(&self, within: Duration, limit: usize) -> Result<Vec<String>>;

    /// `failed`/`unknown` rows back to `queued` with `attempts` fresh tries.
    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64>;

    /// A `queued` row to `cancelled`.
    async fn cancel(&self, id: i64) -> Result<u64>;

    /// Deletes up to `limit` rows of one kind finished longer than
    /// `older_than` ago, oldest first.
    async fn purge_finished(
        &self,
        kind: Finished,
        older_than: Duration,
        limit: usize,
    ) -> Result<u64>;

    /// Deletes up to `limit` finished rows past their retention.
    async fn purge(&self, sent: Duration, failed: Duration, limit: usize) -> Result<u64> {
        let mut deleted = 0;
        for (kind, age) in [
            (Finished::Sent, sent),
            (Finished::FailedOrCancelled, failed),
        ] {
            let left = limit as u64 - deleted;
            if left == 0 {
                break;
            }
            deleted += self.purge_finished(kind, age, left as usize).await?;
        }
        Ok(deleted)
    }

    /// Housekeeping the database may need from us: PostgreSQL with
    /// autovacuum off (or far behind) gets its dead rows vacuumed, since they
    /// slow every claim. Returns what was found or done, if anything.
    async fn maintain(&self) -> Result<Option<Maintenance>> {
        Ok(None)
    }

    /// Starts a task that calls `wake.notify_one()` when new rows may be due,
    /// and names the mechanism; `None`: the backend is only polled.
    fn spawn_wakeup_listener(
        &self,
        _wake: Arc<Notify>,
        _cancel: CancellationToken,
    ) -> Option<&'static str> {
        None
    }
}

/// Connects to the database named by `url`.
pub async fn connect(url: &str, max_connections: u32) -> Result<Arc<dyn Store>> {
    match Backend::from_url(url).map_err(StoreError::Unsupported)? {
        Backend::Postgres => Ok(Arc::new(
            postgres::PgStore::connect(url, max_connections).await?,
        )),
        Backend::Sqlite => Ok(Arc::new(
            sqlite::SqliteStore::connect(url, max_connections).await?,
        )),
        Backend::Mysql => Ok(Arc::new(
            mysql::MySqlStore::connect(url, max_connections).await?,
        )),
    }
}

/// Decodes a claimed row; the SQL of every backend returns these column names.
pub(crate) fn queued_mail_from_row<'r, R>(row: &'r R, lock: BatchLock) -> Result<QueuedMail>
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

/// Builds [`QueueStats`] from the rows of the three status queries, whose
/// column names every backend shares.
pub(crate) fn queue_stats<'r, R>(
    counts: &'r [R],
    ages: &'r R,
    failures: &'r [R],
) -> Result<QueueStats>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    f64: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    DateTime<Utc>: Decode<'r, R::Database> + Type<R::Database>,
{
    let counts = counts
        .iter()
        .map(|r| {
            Ok(StatusCount {
                status: r.try_get("status")?,
                count: r.try_get("count")?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
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
        .collect::<Result<Vec<_>>>()?;
    Ok(QueueStats {
        counts,
        oldest_due_age_seconds: ages.try_get("oldest_due")?,
        stale_locks: ages.try_get("stale")?,
        sent_last_1m: ages.try_get("sent_1m")?,
        sent_last_5m: ages.try_get("sent_5m")?,
        sent_last_15m: ages.try_get("sent_15m")?,
        recent_failures,
    })
}

/// Decodes the rows `release_stale_locks` reports (`id`, `requeued`).
pub(crate) fn stale_rows<'r, R>(rows: &'r [R]) -> Result<Vec<StaleRow>>
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

/// Milliseconds for SQL interval arithmetic.
pub(crate) fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

/// The outcomes as one JSON array, for backends without array parameters.
pub(crate) fn finalize_json(writes: &[Finalize]) -> String {
    let items: Vec<serde_json::Value> = writes
        .iter()
        .map(|w| {
            let (status, delay_ms, error, refund) = w.action.columns();
            serde_json::json!({
                "id": w.id,
                "lock": w.lock.to_string(),
                "status": status,
                "delay_ms": delay_ms,
                "error": error,
                "refund": refund as i32,
            })
        })
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
