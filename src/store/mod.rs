//! The database: every operation tablemail performs on its tables, behind
//! one interface ([`Store`]), implemented once (`sql_store`) over what each
//! database does its own way (`dialect::Dialect`: the claim, the
//! group commit, lock renewal and release, the insert's conflict handling,
//! wake-up and maintenance, in one file per database). SQL lives in the
//! backend files; the shared code binds it.
//!
//! The row life cycle (`queued -> sending -> sent | failed | unknown`) is
//! enforced here: claims spend an attempt, and every later write to a claimed
//! row is fenced by `id`, `thread_lock` and `status = 'sending'`, so a worker
//! whose lock was taken away cannot overwrite the new owner's state. Every call
//! has a deadline (`database.statement_timeout`): a connection whose packets
//! vanish is dropped, not waited on.
//!
//! - [`claim`]: what a claim asks for and brings.
//! - [`finalize`]: what becomes of a claimed row, and its history row.
//! - [`new_mail`]: what applications insert.
//! - [`records`]: what operators read back and do.
//! - [`feedback`]: reports, their history rows, the suppression list.
//! - [`limits`]: send caps: reservations, their settling, their use.
//! - `templates`: the rows of `mail_template` (DESIGN §15).
//! - [`error`]: [`StoreError`], by what to do about it.
//! - `dialect`: what each database does its own way.
//! - `sql_store`: the one `Store`, written once over any dialect.
//! - `conns`: the pool, with the deadline on every call.
//! - `shared`: a dialect's pool and SQL.
//! - `rows`: decoding rows, encoding batches; `insert`: a new mail's INSERT.
//! - `postgres`, `sqlite`, `mysql`: each database's SQL.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

mod claim;
mod conns;
mod dialect;
mod error;
mod feedback;
mod finalize;
mod insert;
mod limits;
mod migrations;
mod mysql;
mod new_mail;
mod postgres;
mod records;
mod rows;
mod shared;
mod sql_store;
mod sqlite;
mod templates;

pub(crate) use claim::ClaimBinds;
pub use claim::{
    Attachment, BatchLock, CapCheck, Claim, MailContent, MailSizes, QueuedMail, SuppressionCheck,
};
pub use error::{Result, StoreError};
pub use feedback::{
    relay_queue_id, FeedbackCount, FeedbackItem, FeedbackKind, FeedbackRecord, FeedbackRecorded,
    FeedbackSource, FeedbackTarget, NewSuppression, RecipientEvent, Suppressed, SuppressionEntry,
    SuppressionFilter, SuppressionPolicy, SuppressionReason,
};
pub use finalize::{
    CountWrite, Event, EventOutcome, FinalAction, FinalColumns, Finalize, StaleRow, UnlockedRow,
};
pub use limits::{budget, room, Budget, CapAnswer, CapRequest, CapSettle, CapUse, DAY_MS};
pub use new_mail::{Enqueued, NewAttachment, NewMail, DEFAULT_CONTENT_TYPE};
pub use records::{
    AttachmentInfo, DaemonBeat, DaemonRow, EventRow, FailureGroup, Finished, MailFilter,
    MailLookup, MailRecord, MailSummary, Maintenance, MinuteCount, QueueStats, RecentFailure,
    RetrySelection, StatusCount, RETRY_ATTEMPTS, SILENT_AFTER_SECONDS, STATUSES,
};
pub use templates::{NewTemplate, TemplateRow, TemplateVersion};

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

/// How to connect: `database.*`.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub max_connections: u32,
    /// Deadline of every call (`database.statement_timeout`).
    pub statement_timeout: Duration,
    /// Overrides the URL's password (`database.password_file`).
    pub password: Option<secrecy::SecretString>,
    /// MySQL/MariaDB: how often an idle daemon looks for new rows
    /// (`database.look_interval`); the other backends are told at once.
    pub look_interval: Duration,
}

/// `database.look_interval` unless set. A look is one index dive, cheap on
/// both sides: at this interval an idle daemon costs the server and itself
/// well under 1% of a core each and picks a mail up within about that long.
/// Looking every few milliseconds picks mail up sooner for several times
/// that CPU, idle or under a trickle of single inserts, so it is left to
/// the operator who needs it.
pub const DEFAULT_LOOK_INTERVAL: Duration = Duration::from_millis(100);

impl ConnectOptions {
    pub fn new(max_connections: u32) -> Self {
        ConnectOptions {
            max_connections,
            statement_timeout: Duration::from_secs(30),
            password: None,
            look_interval: DEFAULT_LOOK_INTERVAL,
        }
    }
}

/// One database: everything the worker, the commands and the console do
/// with it.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    fn backend(&self) -> Backend;

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
    async fn maintain(&self) -> Result<Option<Maintenance>>;

    /// Starts a task that calls `wake.notify_one()` when new rows may be due,
    /// and names the mechanism; `None`: the backend is only polled.
    fn spawn_wakeup_listener(
        &self,
        wake: Arc<Notify>,
        cancel: CancellationToken,
    ) -> Option<&'static str>;

    /// Applies pending migrations (safe to run from several daemons at once).
    async fn migrate(&self) -> Result<()>;

    /// One round-trip to the database.
    async fn ping(&self) -> Result<()>;

    /// Closes the idle connections politely, within a few seconds: at the
    /// end of a command, so that the server does not count lost clients.
    async fn close(&self);

    /// Puts the rows claimed under `lock` back to `queued`, their attempt
    /// refunded: a claim whose answer never came (the call timed out or the
    /// connection broke) may have committed, and nothing of it was sent.
    /// Returns how many rows it found.
    async fn release_claim(&self, lock: BatchLock) -> Result<u64>;

    /// Those of `ids` that no lock holds, with their status. After a group
    /// commit whose answer was lost, the retry finds the rows it wrote the
    /// first time finished and unlocked: not a lock taken away.
    async fn unlocked_rows(&self, ids: &[i64]) -> Result<Vec<UnlockedRow>>;

    /// The text columns of a claimed row too large to come with its claim;
    /// `None` when this lock no longer holds it.
    async fn load_content(&self, id: i64, lock: BatchLock) -> Result<Option<MailContent>>;

    /// A mail's attachments, in id order, to be sent now.
    async fn load_attachments(&self, id: i64) -> Result<Vec<Attachment>>;

    /// Counts and ages for `tablemail status`.
    async fn stats(&self, lock_timeout: Duration) -> Result<QueueStats>;

    /// The history rows of attempts that did not end in `sent` within
    /// `within`, by outcome, stage and reply code, most frequent first.
    async fn failure_groups(&self, within: Duration) -> Result<Vec<FailureGroup>>;

    /// `failed`/`unknown` rows back to `queued` with `attempts` fresh tries,
    /// each with a `retried` history row; `created_at` stays, expiry counts
    /// from now on.
    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64>;

    /// A `queued` row to `cancelled`, with a `cancelled` history row.
    async fn cancel(&self, id: i64) -> Result<u64>;

    /// Deletes up to `limit` finished rows past their retention, oldest
    /// first; their attachments and history go with them.
    async fn purge(&self, sent: Duration, failed: Duration, limit: usize) -> Result<u64>;

    /// One mail with its attachments and history; its content (addresses,
    /// bodies) only when `content` is asked for.
    async fn find_mail(&self, lookup: &MailLookup, content: bool) -> Result<Option<MailRecord>>;

    /// Mails matching `filter`, newest first, at most `limit`.
    async fn list_mails(&self, filter: &MailFilter, limit: usize) -> Result<Vec<MailSummary>>;

    /// Records that this daemon is alive, what it holds and what it did
    /// since the last report; drops daemons silent for a day.
    async fn heartbeat(&self, beat: &DaemonBeat) -> Result<()>;

    /// A daemon stopped cleanly: its row goes.
    async fn daemon_stopped(&self, id: uuid::Uuid) -> Result<()>;

    /// The daemons that reported within the last day, oldest first.
    async fn daemons(&self) -> Result<Vec<DaemonRow>>;

    /// Sent and failed per minute over the last `minutes` minutes, oldest
    /// first (minutes without any are left out).
    async fn minutes(&self, minutes: u32) -> Result<Vec<MinuteCount>>;

    /// The entries in force among `addresses` (normalised): one indexed
    /// lookup for a whole claim.
    async fn suppressed_among(&self, addresses: &[String]) -> Result<Vec<Suppressed>>;

    /// The route names queued rows give (`check` and `status` name those no
    /// configuration has).
    async fn queued_routes(&self) -> Result<Vec<String>>;

    /// Those of `ids` whose row says `bypass_suppression`.
    async fn bypassing_suppression(&self, ids: &[i64]) -> Result<Vec<i64>>;

    /// History rows about single recipients (those left out as suppressed).
    async fn add_recipient_events(&self, events: &[RecipientEvent]) -> Result<()>;

    /// The mail with this id, as a report may speak of it.
    async fn feedback_target(&self, id: i64) -> Result<Option<FeedbackTarget>>;

    /// The one mail whose relay queue id this is; `None` for none or several.
    async fn feedback_target_by_queue_id(&self, queue_id: &str) -> Result<Option<FeedbackTarget>>;

    /// Records a report in one transaction: its rows in `mail_feedback`,
    /// and for what it proved, the history rows, the suppression list and
    /// the mail's `bounced` status.
    async fn record_feedback(&self, record: &FeedbackRecord) -> Result<FeedbackRecorded>;

    /// The suppression list in address order, after `after`, at most `limit`.
    async fn suppression_list(
        &self,
        filter: &SuppressionFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<SuppressionEntry>>;

    /// An operator's entries, each replacing what the address had.
    async fn suppress(&self, entries: &[NewSuppression]) -> Result<u64>;

    /// Removes these addresses; returns how many were there.
    async fn unsuppress(&self, addresses: &[String]) -> Result<u64>;

    /// Reports received within `within`, by kind.
    async fn feedback_counts(&self, within: Duration) -> Result<Vec<FeedbackCount>>;

    /// Deletes up to `limit` reports older than `older_than`, and the
    /// suppression entries that have expired.
    async fn purge_feedback(&self, older_than: Duration, limit: usize) -> Result<u64>;

    /// Reserves each cap's capacity for the mails it counts among those
    /// claimed under `lock`, in one transaction that holds every cap's row
    /// (taken in name order). A mail one cap turns away holds no
    /// reservation of any other. DESIGN §16.
    async fn reserve_caps(&self, lock: BatchLock, caps: &[CapRequest]) -> Result<Vec<CapAnswer>>;

    /// After their outcomes are written: mails that may have gone out are
    /// no longer pending in their claim's reservation, which counts one
    /// window from now once none is; mails that surely did not (the send
    /// never reached ".") are given back.
    async fn settle_caps(&self, settles: &[CapSettle]) -> Result<()>;

    /// What each cap counts now (its `mails` are not read).
    async fn cap_uses(&self, caps: &[CapRequest]) -> Result<Vec<CapUse>>;

    /// Deletes reservations counted from longer ago than `older_than`.
    async fn purge_cap_uses(&self, older_than: Duration) -> Result<u64>;
    /// The key and last change of every template (DESIGN §15): what the
    /// daemon reads once per claim batch that names a template.
    async fn template_versions(&self) -> Result<Vec<TemplateVersion>>;

    /// Every template, by name and locale.
    async fn templates(&self) -> Result<Vec<TemplateRow>>;

    /// Inserts or replaces a template; its `updated_at` becomes now.
    async fn put_template(&self, template: &NewTemplate) -> Result<()>;
}

/// Connects to the database named by `url` (the pool connects lazily).
pub async fn connect(url: &str, max_connections: u32) -> Result<Arc<dyn Store>> {
    connect_with(url, ConnectOptions::new(max_connections)).await
}

/// Connects with every option of `database.*`.
pub async fn connect_with(url: &str, options: ConnectOptions) -> Result<Arc<dyn Store>> {
    match Backend::from_url(url).map_err(StoreError::Unsupported)? {
        Backend::Postgres => Ok(Arc::new(postgres::connect(url, options)?)),
        Backend::Sqlite => Ok(Arc::new(sqlite::connect(url, options)?)),
        Backend::Mysql => Ok(Arc::new(mysql::connect(url, options)?)),
    }
}
