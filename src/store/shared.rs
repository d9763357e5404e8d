//! What every database shares: a dialect's pool with its migrations and SQL
//! ([`Shared`]), and the list of that SQL ([`Queries`]), which `sql_store`
//! binds and runs.

use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::{migrate::Migrator, Database};

use super::{
    conns::{within, Conns},
    Result,
};

/// Milliseconds, for SQL interval arithmetic.
pub(crate) fn millis(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

/// Microseconds, for MySQL's `INTERVAL … MICROSECOND`.
pub(crate) fn micros(d: Duration) -> i64 {
    d.as_micros().min(i64::MAX as u128) as i64
}

/// How many ids an IN list of `n` ids is written with: `n` rounded up to a
/// power of two, the places beyond `n` taken by the last id again (an id
/// twice in an IN list matches its row once). A statement's text is the key
/// of the prepared statements each connection keeps (sqlx keeps 100): with
/// lists of every length, claims and outcomes of varied sizes made a new
/// statement nearly every time, each one prepared in a round trip of its
/// own, and once the cache was full each one closed an older one. On
/// MariaDB that close (`COM_STMT_CLOSE`) has no reply, and sqlx's sockets
/// send with Nagle's algorithm, so the next command waited for the
/// server's delayed acknowledgement: 40 ms, several times in every claim
/// and outcome. With these lengths a batch size of up to 10,000 makes at
/// most 15 texts of each statement.
pub(crate) fn id_list_len(n: usize) -> usize {
    n.max(1).next_power_of_two()
}

/// `values` (one or more) padded to [`id_list_len`] places with its last
/// value, and the placeholders of as many parameters from the first,
/// comma separated, for an IN list.
pub(crate) fn padded_list<T: Clone>(
    mut values: Vec<T>,
    placeholder: fn(usize) -> String,
) -> (Vec<T>, String) {
    if let Some(last) = values.last().cloned() {
        values.resize(id_list_len(values.len()), last);
    }
    let places: Vec<String> = (1..=values.len()).map(placeholder).collect();
    (values, places.join(", "))
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
    /// -> `sent_1m`, `sent_5m`, `sent_15m`, `attachment_bytes_15m` from the
    /// daemons' minute counts.
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
    /// ($1 dedupe key) -> `id` of the mail that has it.
    pub existing_dedupe: &'static str,
    /// ($1 outcome, $2 detail, $3 id or NULL for all): a history row for each
    /// failed or unknown row (those `retry` takes).
    pub retry_events: &'static str,
    /// ($1 attempts, $2 id or NULL for all).
    pub retry: &'static str,
    /// ($1 outcome, $2 detail, $3 id): a history row for a queued row.
    pub cancel_event: &'static str,
    /// ($1 id).
    pub cancel: &'static str,
    /// ($1 lock): the rows of a claim whose answer never came, back to
    /// `queued` with their attempt refunded.
    pub release_claim: &'static str,
    /// ($1 older than, $2 limit), for each kind of finished row: deletes
    /// them, or, where the dialect deletes them its own way
    /// ([`super::dialect::Dialect::purge`]), picks their ids.
    pub purge_sent: &'static str,
    pub purge_failed: &'static str,
    pub purge_bounced: &'static str,
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
    /// ($1 daemon id, $2 sent, $3 failed, $4 attachment bytes), into the
    /// current minute.
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

/// The SQL of the delivery loop (DESIGN §12), bound by `sql_store` like
/// [`Queries`]: parameters in the order given, each used once, durations in
/// the backend's unit.
pub(crate) struct FeedbackQueries {
    /// ($1 source, $2 mail id or NULL, $3 recipient, $4 kind, $5 status,
    /// $6 diagnostic, $7 matched, $8 size, $9 raw, $10 event key or NULL):
    /// a mail id that no row has any more is written as NULL; a row whose
    /// event key is taken is not written (no row affected, or on MySQL a
    /// unique violation, which leaves the transaction usable).
    pub insert_feedback: &'static str,
    /// ($1 outcome, $2 smtp code, $3 detail, $4 recipient, $5 mail id): a
    /// history row at the mail's current attempt.
    pub insert_report_event: &'static str,
    /// ($1 mail id, $2 attempt, $3 outcome, $4 recipient, $5 detail).
    pub insert_recipient_event: &'static str,
    /// ($1 address, $2 reason, $3 detail, $4 mail id): suppressed until
    /// removed; an entry that expires becomes permanent, a permanent one is
    /// left as it is.
    pub suppress_permanent: &'static str,
    /// ($1 address, $2 reason, $3 detail, $4 mail id, $5 ttl): suppressed
    /// until now + ttl; an expiring entry is extended, never shortened, a
    /// permanent one is left as it is.
    pub suppress_until: &'static str,
    /// ($1 address, $2 reason, $3 detail, $4 ttl or NULL): an operator's
    /// entry, replacing whatever was there.
    pub suppress_manual: &'static str,
    /// ($1 address).
    pub unsuppress: &'static str,
    /// ($1 recipient, $2 window) -> `count`: matched soft bounces.
    pub soft_bounces: &'static str,
    /// ($1 mail id) -> `recipient`: the distinct recipients of matched hard
    /// bounces of that mail.
    pub hard_bounced: &'static str,
    /// ($1 mail id): `bounced` once sent (or `unknown`).
    pub mark_bounced: &'static str,
    /// The columns of a [`super::FeedbackTarget`] without `left_out`, then
    /// ` FROM mail_queue WHERE `.
    pub target_columns: &'static str,
    /// ($1 mail id, $2 mail id) -> `recipient`: those left out as
    /// suppressed at its current attempt.
    pub left_out: &'static str,
    /// `address`, `reason` of the entries in force, then ` AND address IN (`
    /// follows with the addresses' placeholders (PostgreSQL: one array).
    pub suppressed_among: &'static str,
    /// The columns of a [`super::SuppressionEntry`], then ` FROM
    /// mail_suppression WHERE 1 = 1`, to which filters are appended.
    pub suppression_columns: &'static str,
    /// The condition "in force" (not expired), for filters.
    pub in_force: &'static str,
    /// ($1 within) -> `source`, `kind`, `count`.
    pub feedback_counts: &'static str,
    /// ($1 older than, $2 limit): reports past retention.
    pub purge_feedback: &'static str,
    /// Suppression entries that have expired.
    pub purge_suppression: &'static str,
}

/// What the send caps' SQL (DESIGN §16) says its own way on each database;
/// `sql_store` builds the rest with the placeholders.
pub(crate) struct LimitQueries {
    /// The database clock in milliseconds since the epoch, as an
    /// expression read when the statement runs.
    pub now: &'static str,
    /// ($1 name): the cap's row, unless it is there.
    pub ensure: &'static str,
    /// What locks a cap's row until the transaction ends, after `SELECT …
    /// WHERE name = $1` (SQLite: nothing; `BEGIN IMMEDIATE` took the write
    /// lock already).
    pub lock_suffix: &'static str,
    /// The condition that `q`, a `mail_queue` row, is held by the claim
    /// that made the reservation `mail_limit_use`.
    pub held_by: &'static str,
    /// ($1 name, $2 lock, $3 mails, $4 the same again as pending, $5
    /// reserved at): a claim's reservation under a cap, added to the one it
    /// made before (a large row reserves on its own, after its claim),
    /// which then counts as pending again.
    pub add: &'static str,
    /// The sum of `mails` over the rows read, 0 for none, as a 64-bit
    /// integer.
    pub sum_mails: &'static str,
    /// ($1 name, $2 lock, $3 mails, $4 max) -> `bound`, or no
    /// row: where one statement can do it, a reservation under one cap
    /// without a warm-up that fits under `bound`, atomically (the cap's row
    /// stays locked until the reservation is written). No row: the cap's
    /// row is missing or the mails do not fit; the whole transaction
    /// decides.
    pub reserve_within_bound: Option<&'static str>,
}

/// Statements that read the same on every database.
pub(crate) mod portable {
    /// Rows by status.
    pub const STATUS_COUNTS: &str =
        "SELECT status, count(*) AS count FROM mail_queue GROUP BY status ORDER BY status";

    /// The routes queued rows name (DESIGN §13).
    pub const QUEUED_ROUTES: &str =
        "SELECT DISTINCT route FROM mail_queue WHERE status = 'queued' AND route IS NOT NULL";

    /// The ten newest failed or unknown rows (`IS NULL` sorts rows never
    /// processed last, where `NULLS LAST` is not everywhere).
    pub const RECENT_FAILURES: &str = r#"
SELECT id, status, processed_at, last_error FROM mail_queue
WHERE status IN ('failed', 'unknown')
ORDER BY processed_at IS NULL, processed_at DESC, id DESC
LIMIT 10
"#;
}

/// A backend's pool with what the shared operations need to know of it.
pub(crate) struct Shared<DB: Database> {
    pub pool: Conns<DB>,
    /// `database.statement_timeout`.
    pub deadline: Duration,
    pub queries: &'static Queries,
    pub feedback: &'static FeedbackQueries,
    pub limits: &'static LimitQueries,
    pub templates: &'static super::templates::TemplateQueries,
    /// Durations as the backend's SQL counts them.
    pub unit: fn(Duration) -> i64,
    pub migrator: Migrator,
    /// How a transaction that writes begins (SQLite takes the write lock at
    /// once: `BEGIN IMMEDIATE`).
    pub begin_write: &'static str,
}

impl<DB: Database> Shared<DB> {
    /// A dialect's pool, with its SQL and its migrations.
    pub fn new<D: super::dialect::Dialect<DB = DB>>(
        pool: Conns<DB>,
        deadline: Duration,
        migrations: &'static [(i64, &'static str, &'static str)],
        begin_write: &'static str,
    ) -> Self {
        Shared {
            pool,
            deadline,
            queries: D::QUERIES,
            feedback: D::FEEDBACK,
            limits: D::LIMITS,
            templates: D::TEMPLATES,
            unit: D::UNIT,
            migrator: super::migrations::migrator(migrations),
            begin_write,
        }
    }

    /// Runs `work` under the deadline (see [`within`]).
    pub async fn run<T>(
        &self,
        work: impl for<'c> FnOnce(&'c mut DB::Connection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    ) -> Result<T> {
        within(&self.pool, self.deadline, work).await
    }
}

#[cfg(test)]
mod tests {
    use super::id_list_len;

    #[test]
    fn id_lists_come_in_few_lengths_each_with_room_for_its_ids() {
        let lengths: std::collections::BTreeSet<usize> = (1..=10_000).map(id_list_len).collect();
        assert!(
            lengths.len() <= 15,
            "{} lengths: {lengths:?}",
            lengths.len()
        );
        for n in 1..=10_000 {
            let len = id_list_len(n);
            // Room for every id, and never twice the ids or more.
            assert!(
                len >= n && (n == 1 || len < 2 * n),
                "{n} ids in a list of {len}"
            );
        }
    }
}
