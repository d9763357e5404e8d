//! The database: every operation tablemail performs on `mail_queue`, one
//! interface ([`Store`]) and one file per backend. SQL lives only in the
//! backend files; what is the same on every database is written once in
//! [`shared`].
//!
//! The row life cycle (`queued -> sending -> sent | failed | unknown`) is
//! enforced here: claims spend an attempt, and every later write to a claimed
//! row is fenced by `id`, `thread_lock` and `status = 'sending'`, so a worker
//! whose lock was taken away cannot overwrite the new owner's state. Every call
//! has a deadline (`database.statement_timeout`): a connection whose packets
//! vanish is dropped, not waited on.
//!
//! Longer than 500 lines on purpose: the trait and every type it speaks are
//! the whole contract between the worker and the databases, read in one place.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

mod migrations;
pub mod mysql;
pub mod postgres;
mod records;
mod shared;
pub mod sqlite;

pub use records::{
    AttachmentInfo, DaemonBeat, DaemonRow, EventRow, FailureGroup, MailFilter, MailLookup,
    MailRecord, MailSummary, MinuteCount, NewAttachment, RecordContent, DEFAULT_CONTENT_TYPE,
    SILENT_AFTER_SECONDS,
};
pub use shared::Common;

/// What went wrong with the database, by what an operator does about it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or dropped the connection: wait and retry.
    #[error("database unavailable: {0}")]
    Unavailable(sqlx::Error),
    /// A call outlived `database.statement_timeout`; its connection was dropped.
    #[error("database did not answer within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    /// The table is missing or lacks a column: run `tablemail migrate`.
    #[error("database schema: {0} (run `tablemail migrate`)")]
    Schema(sqlx::Error),
    /// A unique or check constraint refused the write.
    #[error("database refused the write: {0}")]
    Conflict(sqlx::Error),
    #[error("database: {0}")]
    Database(sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("{0}")]
    Unsupported(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        use sqlx::Error as E;
        match &e {
            E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed => {
                StoreError::Unavailable(e)
            }
            E::Protocol(_) => StoreError::Unavailable(e),
            E::ColumnNotFound(_) => StoreError::Schema(e),
            E::Database(db) => {
                let code = db.code().unwrap_or_default();
                let message = db.message();
                if db.is_unique_violation() || db.is_check_violation() {
                    StoreError::Conflict(e)
                } else if matches!(code.as_ref(), "42P01" | "42703" | "1146" | "1054")
                    || message.starts_with("no such table")
                    || message.starts_with("no such column")
                    || message.contains("has no column named")
                {
                    StoreError::Schema(e)
                } else if matches!(
                    code.as_ref(),
                    "57P01" | "57P02" | "57P03" | "08006" | "08003"
                ) {
                    // Server shutting down, crashed or restarting.
                    StoreError::Unavailable(e)
                } else {
                    StoreError::Database(e)
                }
            }
            _ => StoreError::Database(e),
        }
    }
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchLock(pub Uuid);

impl BatchLock {
    /// A fresh v4 GUID: every claim takes a new one.
    /// A fresh random lock (deliberately not `Default`: a lock made by
    /// accident would fence nothing).
    pub fn generate() -> Self {
        BatchLock(Uuid::new_v4())
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
    /// Rows created (or retried by an operator) longer ago than this come
    /// back with `expired` set.
    pub max_age: Duration,
    /// Right-hand side of Message-IDs the daemon assigns.
    pub message_id_domain: &'a str,
    /// Rows whose text columns together are at most this many octets come
    /// with them; larger ones are loaded when they are sent
    /// ([`Store::load_content`]), so that what a daemon holds claimed is
    /// bounded whatever the rows carry.
    pub inline_limit: usize,
}

/// What every backend's claim statement binds, owned so that it moves into
/// the statement's future.
pub(crate) struct ClaimBinds {
    /// Makes the assigned Message-IDs unique across claims.
    pub nonce: String,
    pub lock: BatchLock,
    pub limit: i64,
    pub domain: String,
    /// `max_age` in the backend's unit.
    pub max_age: i64,
    pub inline_limit: i64,
}

impl Claim<'_> {
    pub(crate) fn binds(&self, unit: fn(Duration) -> i64) -> ClaimBinds {
        ClaimBinds {
            nonce: uuid::Uuid::new_v4().simple().to_string(),
            lock: self.lock,
            limit: self.limit as i64,
            domain: self.message_id_domain.to_string(),
            max_age: unit(self.max_age),
            inline_limit: self.inline_limit as i64,
        }
    }
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
    /// Relay-down outcomes this row drew in a row while other mails went
    /// through (`worker.relay_down_limit`).
    pub relay_down_count: i32,
    pub message_id: String,
    /// `created_at` (or the last operator retry) is older than
    /// `worker.max_age` (by the database clock).
    pub expired: bool,
    /// How large the row is, counted by the database.
    pub sizes: MailSizes,
    /// The text columns, when the claim brought them (`sizes.content` within
    /// the claim's `inline_limit`); otherwise [`Store::load_content`] reads
    /// them when the mail is sent.
    pub content: Option<MailContent>,
}

/// A mail's size in octets as stored, known from the claim before any of
/// it is loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MailSizes {
    /// The text columns together: addresses, subject, bodies, headers.
    pub content: u64,
    /// The bodies alone (`body`, `body_html`).
    pub bodies: u64,
    pub attachments: u32,
    /// The attachments' bytes together, before encoding.
    pub attachment_bytes: u64,
}

/// The columns a message is built from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MailContent {
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
}

/// One row of `mail_attachment`, as loaded to be sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub filename: String,
    pub content_type: String,
    pub content: Vec<u8>,
    /// Set: an inline part, referenced from `body_html` as `cid:…`.
    pub content_id: Option<String>,
}

/// The final write for one claimed row.
#[derive(Debug, Clone)]
pub struct Finalize {
    pub id: i64,
    pub lock: BatchLock,
    pub action: FinalAction,
    /// The relay's reply to "." when the mail was sent (`relay_reply`).
    pub relay_reply: Option<String>,
    /// The history row written with the outcome, if it gets one: every
    /// attempt that did not end in `sent` (DESIGN §8).
    pub event: Option<Event>,
}

/// A row of a mail's history (`mail_event`) as the worker writes it; `at`
/// is the database's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub attempt: i32,
    pub outcome: EventOutcome,
    /// How far the attempt got ([`crate::smtp::Stage::key`]) or what stopped
    /// it before the relay (`message`, `config`, `throttle`, `queue`).
    pub stage: Option<&'static str>,
    pub smtp_code: Option<u16>,
    /// The relay's reply or the error; `None`: the outcome's `last_error`.
    pub detail: Option<String>,
}

/// What a history row records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventOutcome {
    /// A failed try, to be tried again.
    Retry,
    Failed,
    /// The relay may have it (`unknown`).
    Unknown,
    /// Put off without spending the try (relay-down outcome of this row
    /// alone, a throttled domain, no sender configured).
    Deferred,
    /// The relay was down: back to queued, the try refunded.
    Released,
    /// The lock went stale: the worker stopped during the try.
    Stale,
    /// An operator's `tablemail retry`.
    Retried,
    /// An operator's `tablemail cancel`.
    Cancelled,
}

impl EventOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            EventOutcome::Retry => "retry",
            EventOutcome::Failed => "failed",
            EventOutcome::Unknown => "unknown",
            EventOutcome::Deferred => "deferred",
            EventOutcome::Released => "released",
            EventOutcome::Stale => "stale",
            EventOutcome::Retried => "retried",
            EventOutcome::Cancelled => "cancelled",
        }
    }
}

/// What becomes of a claimed row. Every variant clears the lock.
#[derive(Debug, Clone, PartialEq)]
pub enum FinalAction {
    /// `sent`.
    Sent,
    /// Back to `queued`, `send_at = now() + delay`, the attempt stays spent.
    /// `relay_down`: the failure was a relay-down outcome past
    /// `worker.relay_down_limit` (the row's count goes on).
    Retry {
        delay: Duration,
        error: String,
        relay_down: bool,
    },
    /// `failed` for good.
    Failed { error: String, relay_down: bool },
    /// `unknown`: the relay may have the mail; an operator decides.
    Unknown { error: String },
    /// Back to `queued` as it was, the attempt refunded: never tried (relay
    /// unavailable, shutdown before ".").
    Release,
    /// Back to `queued` with the attempt refunded, but later:
    /// `send_at = now() + delay`, `last_error` says why. `counted`: a
    /// relay-down outcome that only this row drew (`relay_down_count + 1`).
    Defer {
        delay: Duration,
        error: String,
        counted: bool,
    },
}

/// What happens to `relay_down_count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountWrite {
    Reset = 0,
    Increment = 1,
    Keep = 2,
}

/// The columns a finalize writes, the same on every backend.
#[derive(Debug, Clone, Copy)]
pub struct FinalColumns<'a> {
    pub status: &'static str,
    /// `send_at = now() + delay_ms`; negative: `send_at` stays.
    pub delay_ms: i64,
    /// New `last_error`; `None` keeps the old one.
    pub error: Option<&'a str>,
    /// Give the attempt back.
    pub refund: bool,
    /// `processed_at = now()`.
    pub processed: bool,
    pub relay_down: CountWrite,
}

impl FinalAction {
    pub fn columns(&self) -> FinalColumns<'_> {
        let spent = |relay_down: bool| {
            if relay_down {
                CountWrite::Increment
            } else {
                CountWrite::Reset
            }
        };
        let (status, delay_ms, error, refund, processed, relay_down) = match self {
            FinalAction::Sent => ("sent", -1, None, false, true, CountWrite::Reset),
            FinalAction::Retry {
                delay,
                error,
                relay_down,
            } => (
                "queued",
                shared::millis(*delay),
                Some(error.as_str()),
                false,
                true,
                spent(*relay_down),
            ),
            FinalAction::Failed { error, relay_down } => (
                "failed",
                -1,
                Some(error.as_str()),
                false,
                true,
                spent(*relay_down),
            ),
            FinalAction::Unknown { error } => (
                "unknown",
                -1,
                Some(error.as_str()),
                false,
                true,
                CountWrite::Reset,
            ),
            FinalAction::Release => ("queued", -1, None, true, false, CountWrite::Keep),
            FinalAction::Defer {
                delay,
                error,
                counted,
            } => (
                "queued",
                shared::millis(*delay),
                Some(error.as_str()),
                true,
                true,
                if *counted {
                    CountWrite::Increment
                } else {
                    CountWrite::Keep
                },
            ),
        };
        FinalColumns {
            status,
            delay_ms,
            error,
            refund,
            processed,
            relay_down,
        }
    }
}

/// The history row a [`Finalize`] writes, as the backends bind it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EventColumns<'a> {
    pub attempt: i32,
    pub outcome: &'static str,
    pub stage: Option<&'static str>,
    pub smtp_code: Option<i32>,
    pub detail: Option<&'a str>,
}

impl Finalize {
    /// Its history row, if it gets one; the detail defaults to the new
    /// `last_error`.
    pub(crate) fn event_columns(&self) -> Option<EventColumns<'_>> {
        let event = self.event.as_ref()?;
        Some(EventColumns {
            attempt: event.attempt,
            outcome: event.outcome.as_str(),
            stage: event.stage,
            smtp_code: event.smtp_code.map(i32::from),
            detail: event.detail.as_deref().or(self.action.columns().error),
        })
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
#[derive(Debug, Clone, Default, Deserialize)]
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
    /// Inserted with the mail, in the same transaction, in this order.
    #[serde(default)]
    pub attachments: Vec<NewAttachment>,
}

/// The result of inserting one [`NewMail`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

#[derive(Debug, Clone, Default)]
pub struct StatusCount {
    pub status: String,
    pub count: i64,
}

/// Serialized as is into `status --json`'s `recent_failures`.
#[derive(Debug, Clone, Serialize)]
pub struct RecentFailure {
    pub id: i64,
    pub status: String,
    pub processed_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

/// What `tablemail status` shows.
#[derive(Debug, Clone, Default)]
pub struct QueueStats {
    pub counts: Vec<StatusCount>,
    /// Seconds since the oldest due `queued` row became due.
    pub oldest_due_age_seconds: Option<f64>,
    /// `sending` rows whose lock is older than the lock timeout.
    pub stale_locks: i64,
    /// Mails the daemons sent in the last minute, five minutes, fifteen
    /// minutes (from their per-minute counts: retention may already have
    /// deleted the rows).
    pub sent_last_1m: i64,
    pub sent_last_5m: i64,
    pub sent_last_15m: i64,
    pub recent_failures: Vec<RecentFailure>,
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

/// How to connect: `database.*`.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub max_connections: u32,
    /// Deadline of every call (`database.statement_timeout`).
    pub statement_timeout: Duration,
    /// Overrides the URL's password (`database.password_file`).
    pub password: Option<secrecy::SecretString>,
}

impl ConnectOptions {
    pub fn new(max_connections: u32) -> Self {
        ConnectOptions {
            max_connections,
            statement_timeout: Duration::from_secs(30),
            password: None,
        }
    }
}

/// One database. The operations that differ per backend are this trait's;
/// those that are the same everywhere come from [`Common`], written once.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    fn backend(&self) -> Backend;

    /// The operations every backend shares (counts, retry, cancel, purge…).
    fn common(&self) -> &dyn Common;

    /// Takes up to `claim.limit` due rows, highest priority first, then oldest
    /// `send_at`, then `id`, skipping rows other workers hold. Marks them
    /// `sending` under `claim.lock` and spends one attempt each.
    async fn claim_batch(&self, claim: &Claim<'_>) -> Result<Vec<QueuedMail>>;

    /// Writes the outcomes, each fenced by id + lock + `sending`, with their
    /// history rows in the same statement or transaction. Returns the ids
    /// that were written; the others had been taken away from this worker.
    async fn finalize(&self, writes: &[Finalize]) -> Result<Vec<i64>>;

    /// Moves `locked_at` of these held rows to now, taking row locks in id
    /// order (as finalize does), so two daemons never deadlock.
    async fn renew_locks(&self, held: &[(i64, BatchLock)]) -> Result<u64>;

    /// Takes back `sending` rows whose `locked_at` is older than `older_than`
    /// and whose lock is not one of `spare` (this process's own):
    /// `queued` (the attempt stays spent), or `failed` when none remains;
    /// each with a `stale` history row.
    async fn release_stale_locks(
        &self,
        older_than: Duration,
        spare: &[BatchLock],
    ) -> Result<Vec<StaleRow>>;

    /// Inserts mails and their attachments in one transaction; a taken
    /// `dedupe_key` inserts nothing and reports the existing row.
    async fn enqueue(&self, mails: &[NewMail]) -> Result<Vec<Enqueued>>;

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

    /// Applies pending migrations (safe to run from several daemons at once).
    async fn migrate(&self) -> Result<()> {
        self.common().migrate().await
    }

    /// One round-trip to the database.
    async fn ping(&self) -> Result<()> {
        self.common().ping().await
    }

    /// The text columns of a claimed row too large to come with its claim;
    /// `None` when this lock no longer holds it.
    async fn load_content(&self, id: i64, lock: BatchLock) -> Result<Option<MailContent>> {
        self.common().load_content(id, lock).await
    }

    /// A mail's attachments, in id order, to be sent now.
    async fn load_attachments(&self, id: i64) -> Result<Vec<Attachment>> {
        self.common().load_attachments(id).await
    }

    /// Counts and ages for `tablemail status`.
    async fn stats(&self, lock_timeout: Duration) -> Result<QueueStats> {
        self.common().stats(lock_timeout).await
    }

    /// The history rows of attempts that did not end in `sent` within
    /// `within`, by outcome, stage and reply code, most frequent first.
    async fn failure_groups(&self, within: Duration) -> Result<Vec<FailureGroup>> {
        self.common().failure_groups(within).await
    }

    /// `failed`/`unknown` rows back to `queued` with `attempts` fresh tries,
    /// each with a `retried` history row; `created_at` stays, expiry counts
    /// from now on.
    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64> {
        self.common().retry(which, attempts).await
    }

    /// A `queued` row to `cancelled`, with a `cancelled` history row.
    async fn cancel(&self, id: i64) -> Result<u64> {
        self.common().cancel(id).await
    }

    /// Deletes up to `limit` finished rows past their retention, oldest
    /// first; their attachments and history go with them.
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
            deleted += self
                .common()
                .purge_finished(kind, age, left as usize)
                .await?;
        }
        Ok(deleted)
    }

    /// One mail with its attachments and history; its content (addresses,
    /// bodies) only when `content` is asked for.
    async fn find_mail(&self, lookup: &MailLookup, content: bool) -> Result<Option<MailRecord>> {
        self.common().find_mail(lookup, content).await
    }

    /// Mails matching `filter`, newest first, at most `limit`.
    async fn list_mails(&self, filter: &MailFilter, limit: usize) -> Result<Vec<MailSummary>> {
        self.common().list_mails(filter, limit).await
    }

    /// Records that this daemon is alive, what it holds and what it did
    /// since the last report; drops daemons silent for a day.
    async fn heartbeat(&self, beat: &DaemonBeat) -> Result<()> {
        self.common().heartbeat(beat).await
    }

    /// A daemon stopped cleanly: its row goes.
    async fn daemon_stopped(&self, id: uuid::Uuid) -> Result<()> {
        self.common().daemon_stopped(id).await
    }

    /// The daemons that reported within the last day, oldest first.
    async fn daemons(&self) -> Result<Vec<DaemonRow>> {
        self.common().daemons().await
    }

    /// Sent and failed per minute over the last `minutes` minutes, oldest
    /// first (minutes without any are left out).
    async fn minutes(&self, minutes: u32) -> Result<Vec<MinuteCount>> {
        self.common().minutes(minutes).await
    }
}

/// Connects to the database named by `url` (the pool connects lazily).
pub async fn connect(url: &str, max_connections: u32) -> Result<Arc<dyn Store>> {
    connect_with(url, ConnectOptions::new(max_connections)).await
}

/// Connects with every option of `database.*`.
pub async fn connect_with(url: &str, options: ConnectOptions) -> Result<Arc<dyn Store>> {
    match Backend::from_url(url).map_err(StoreError::Unsupported)? {
        Backend::Postgres => Ok(Arc::new(postgres::PgStore::connect(url, options)?)),
        Backend::Sqlite => Ok(Arc::new(sqlite::SqliteStore::connect(url, options)?)),
        Backend::Mysql => Ok(Arc::new(mysql::MySqlStore::connect(url, options)?)),
    }
}
