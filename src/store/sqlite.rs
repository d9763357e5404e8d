//! SQLite, the embedded default for one host: WAL mode, a busy timeout, and a
//! claim that is a single `UPDATE … WHERE id IN (SELECT … LIMIT n) RETURNING`
//! statement, followed by a read of the text columns of the rows it took.
//! SQLite runs one writer at a time, so two daemons on one file can never
//! claim the same row. There is no NOTIFY: a watcher reads
//! `PRAGMA data_version`, which changes when any other connection commits,
//! whenever the kernel reports a write to the file or its WAL, and every
//! 25 ms in any case.

use std::{
    path::Path,
    str::FromStr,
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
    time::Duration,
};

use sqlx::{
    sqlite::{SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqliteSynchronous},
    ConnectOptions as _, Connection, FromRow, Row,
};
use tokio::{sync::Notify, time::Instant};
use tokio_util::sync::CancellationToken;

use super::{
    conns::{Conns, Reach, IDLE_TIMEOUT},
    dialect::{Dialect, SqlStore},
    insert::{self, Param},
    migrations::SQLITE,
    rows::{self, finalize_json, held_json, locks_json},
    shared::{self, portable, FeedbackQueries, LimitQueries, Queries, Shared},
    templates::{self, TemplateQueries},
    Backend, BatchLock, ClaimBinds, ConnectOptions, Enqueued, Finalize, MailContent, NewMail,
    QueuedMail, Result, StaleRow,
};

/// How often the watcher looks for commits of other connections when the
/// kernel has reported no write.
const WATCH_EVERY: Duration = Duration::from_millis(25);

/// How many more looks, a millisecond apart, the watcher takes after the
/// kernel reports a write to the file, until it sees a commit.
const LOOKS_AFTER_A_WRITE: u32 = 5;

/// The watcher's wake-ups of the daemon: eight at once, then one more every
/// 10 ms, so that an application that commits to its own tables in the same
/// file thousands of times a second costs the daemon at most a hundred
/// (empty) claims a second. Each mail inserted one at a time takes three
/// (the insert, and the daemon's own claim and outcome that follow it), so
/// inserts a few tens of milliseconds apart each still wake it at once. A
/// commit seen with none left wakes the daemon when the next comes back.
struct WakeBudget {
    left: u32,
    /// When the last one came back (or the budget was last full).
    since: Instant,
}

const WAKE_BURST: u32 = 8;
const WAKE_REFILL: Duration = Duration::from_millis(10);

impl WakeBudget {
    fn new(now: Instant) -> WakeBudget {
        WakeBudget {
            left: WAKE_BURST,
            since: now,
        }
    }

    /// Takes a wake-up, or says when the next one comes back.
    fn take(&mut self, now: Instant) -> Result<(), Instant> {
        while self.left < WAKE_BURST && now >= self.since + WAKE_REFILL {
            self.left += 1;
            self.since += WAKE_REFILL;
        }
        if self.left == WAKE_BURST {
            self.since = now;
        }
        if self.left == 0 {
            return Err(self.since + WAKE_REFILL);
        }
        self.left -= 1;
        Ok(())
    }
}

/// SQLite's own ways; it keeps the connect options for the watcher's
/// connection.
pub(crate) struct Sqlite {
    options: SqliteConnectOptions,
}

pub(crate) fn connect(url: &str, options: ConnectOptions) -> Result<SqlStore<Sqlite>> {
    let connect = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(10).min(options.statement_timeout))
        // Attachments and history go with their mail.
        .foreign_keys(true)
        .log_statements(tracing::log::LevelFilter::Trace)
        .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(1));
    let pool = Conns::new(
        connect.clone(),
        Reach::InProcess,
        options.max_connections,
        IDLE_TIMEOUT,
        None,
    );
    // IMMEDIATE: a transaction that writes takes the write lock first, so it
    // never has to upgrade a read snapshot (which SQLite refuses when busy).
    Ok(SqlStore {
        shared: Shared::new::<Sqlite>(pool, options.statement_timeout, SQLITE, IMMEDIATE),
        dialect: Sqlite { options: connect },
    })
}

const IMMEDIATE: &str = "BEGIN IMMEDIATE";

/// The octets of a row's text columns together (`octet_length` reads a
/// value's size, not the value).
macro_rules! content_bytes {
    () => {
        "(coalesce(octet_length(body), 0) + coalesce(octet_length(body_html), 0) \
         + coalesce(octet_length(from_name), 0) + coalesce(octet_length(from_address), 0) \
         + octet_length(to_address) + coalesce(octet_length(cc), 0) \
         + coalesce(octet_length(bcc), 0) + coalesce(octet_length(reply_to), 0) \
         + octet_length(subject) + coalesce(octet_length(headers), 0) \
         + coalesce(octet_length(template_data), 0))"
    };
}

// INDEXED BY: the claim walks the pending index in claim order and stops after
// the batch, whatever `ANALYZE` found (with statistics that saw few queued rows
// SQLite would rather scan and sort). `LIMIT CAST(?1 AS INTEGER)`, not
// `LIMIT ?1`: SQLite reads a bare parameter in LIMIT as a constant for its
// plan, so binding it (at every claim) expired the prepared statement and
// each claim compiled it again, a sizeable share of the daemon's work per
// mail with SQLite.
const CLAIM: &str = concat!(
    r#"
UPDATE mail_queue
SET status = 'sending',
    thread_lock = ?2,
    locked_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    attempts = attempts + 1,
    attempts_remaining = attempts_remaining - 1,
    message_id = COALESCE(message_id, '<' || ?3 || '.' || id || '@' || ?4 || '>')
WHERE id IN (
    SELECT id FROM mail_queue INDEXED BY mail_queue_claim_idx
    WHERE status = 'queued' AND julianday(send_at) <= julianday('now')
    ORDER BY priority DESC, send_at, id
    LIMIT CAST(?1 AS INTEGER)
)
RETURNING id, priority, attempts, attempts_remaining, relay_down_count, message_id,
    julianday(max(created_at, coalesce(retried_at, created_at))) < julianday('now') - ?5 / 86400000.0
        AS expired,
    coalesce(octet_length(body), 0) + coalesce(octet_length(body_html), 0) AS body_bytes,
    "#,
    content_bytes!(),
    r#" AS content_bytes,
    (SELECT count(*) FROM mail_attachment WHERE mail_id = mail_queue.id) AS attachment_count,
    (SELECT coalesce(sum(octet_length(content)), 0) FROM mail_attachment
      WHERE mail_id = mail_queue.id) AS attachment_bytes
"#,
);

/// The text columns of the rows a claim just took (a JSON array of ids)
/// that fit the inline limit, read by the claim's next statement. In the
/// claim's RETURNING each column was `CASE WHEN <the ten sizes summed> <=
/// limit`: SQLite has no common subexpressions and summed them eleven more
/// times a row (about a tenth of the daemon's instructions per mail). The
/// lock and status are checked as `load_content` checks them.
const CLAIM_CONTENT: &str = r#"
SELECT id, from_name, from_address, to_address, cc, bcc, reply_to, subject, body, body_html,
       headers, route, template, template_data, locale
FROM mail_queue
WHERE id IN (SELECT value FROM json_each(?1)) AND thread_lock = ?2 AND status = 'sending'
"#;

// NOT INDEXED (here and in RENEW): the rows are found through their rowid, one
// per outcome. With statistics taken while no row was sending, SQLite would
// rather walk the sending index and parse the JSON array again for each row
// it finds there: a group commit then cost the square of the rows in flight
// (a drain at a fifth of its speed after ANALYZE).
const FINALIZE: &str = r#"
UPDATE mail_queue NOT INDEXED
SET status = f.status,
    send_at = CASE WHEN f.delay_ms >= 0
                   THEN strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || (f.delay_ms / 1000.0) || ' seconds')
                   ELSE mail_queue.send_at END,
    attempts = mail_queue.attempts - f.refund,
    attempts_remaining = mail_queue.attempts_remaining + f.refund,
    processed_at = CASE WHEN f.processed THEN strftime('%Y-%m-%d %H:%M:%f', 'now')
                        ELSE mail_queue.processed_at END,
    relay_down_count = CASE f.relay_down WHEN 0 THEN 0
                                         WHEN 1 THEN mail_queue.relay_down_count + 1
                                         ELSE mail_queue.relay_down_count END,
    thread_lock = NULL,
    locked_at = NULL,
    last_error = COALESCE(f.last_error, mail_queue.last_error),
    relay_reply = COALESCE(f.relay_reply, mail_queue.relay_reply),
    relay_queue_id = COALESCE(f.relay_queue_id, mail_queue.relay_queue_id)
FROM (
    SELECT value ->> '$.id' AS id, value ->> '$.lock' AS lock, value ->> '$.status' AS status,
           value ->> '$.delay_ms' AS delay_ms, value ->> '$.error' AS last_error,
           value ->> '$.refund' AS refund, value ->> '$.processed' AS processed,
           value ->> '$.relay_down' AS relay_down, value ->> '$.relay_reply' AS relay_reply,
           value ->> '$.relay_queue_id' AS relay_queue_id
    FROM jsonb_each(?1)
) AS f
WHERE mail_queue.id = f.id AND mail_queue.thread_lock = f.lock AND mail_queue.status = 'sending'
RETURNING mail_queue.id
"#;

// The history rows of the outcomes FINALIZE wrote (?2: their ids), in the
// same transaction.
const FINALIZE_EVENTS: &str = r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, smtp_code, detail)
SELECT value ->> '$.id', value ->> '$.ev_attempt', value ->> '$.ev_outcome',
       value ->> '$.ev_stage', value ->> '$.ev_code', value ->> '$.ev_detail'
FROM jsonb_each(?1)
WHERE value ->> '$.ev_outcome' IS NOT NULL
  AND value ->> '$.id' IN (SELECT value FROM json_each(?2))
"#;

const RENEW: &str = r#"
UPDATE mail_queue NOT INDEXED SET locked_at = strftime('%Y-%m-%d %H:%M:%f', 'now')
FROM (SELECT value ->> '$.id' AS id, value ->> '$.lock' AS lock FROM jsonb_each(?1)) AS h
WHERE mail_queue.id = h.id AND mail_queue.thread_lock = h.lock AND mail_queue.status = 'sending'
"#;

const RELEASE_STALE: &str = r#"
UPDATE mail_queue
SET status = CASE WHEN attempts_remaining > 0 THEN 'queued' ELSE 'failed' END,
    processed_at = CASE WHEN attempts_remaining > 0 THEN processed_at
                        ELSE strftime('%Y-%m-%d %H:%M:%f', 'now') END,
    last_error = CASE WHEN attempts_remaining > 0 THEN last_error
                      ELSE 'lock expired: the worker stopped during the last attempt' END,
    thread_lock = NULL,
    locked_at = NULL
WHERE status = 'sending' AND julianday(locked_at) < julianday('now') - ?1 / 86400000.0
  AND thread_lock NOT IN (SELECT value FROM json_each(?2))
RETURNING id, attempts, status = 'queued' AS requeued
"#;

// The history rows of the released rows (?1: a JSON array of [id, attempts,
// requeued]), in the same transaction.
const STALE_EVENTS: &str = r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, detail)
SELECT value ->> '$[0]', value ->> '$[1]', 'stale', 'lock',
       CASE WHEN value ->> '$[2]' THEN 'lock expired: the worker stopped during this attempt'
            ELSE 'lock expired: the worker stopped during the last attempt' END
FROM jsonb_each(?1)
"#;

/// The delivery loop's SQL (DESIGN §12). Times are compared as text in
/// SQLite's own format, so that the indexes on `received_at` serve them.
static TEMPLATES: TemplateQueries = TemplateQueries {
    versions: templates::portable::VERSIONS,
    all: templates::portable::ALL,
    put: r#"
INSERT INTO mail_template (name, locale, subject, body, body_html, updated_at)
VALUES (?1, ?2, ?3, ?4, ?5, strftime('%Y-%m-%d %H:%M:%f', 'now'))
ON CONFLICT (name, locale) DO UPDATE
SET subject = excluded.subject, body = excluded.body, body_html = excluded.body_html,
    updated_at = strftime('%Y-%m-%d %H:%M:%f', 'now')
"#,
};

static FEEDBACK: FeedbackQueries = FeedbackQueries {
    insert_feedback: r#"
INSERT INTO mail_feedback
    (source, mail_id, recipient, kind, status, diagnostic, matched, size, raw, event_key)
VALUES (?1, (SELECT id FROM mail_queue WHERE id = ?2), ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
ON CONFLICT (event_key) WHERE event_key IS NOT NULL DO NOTHING
"#,
    insert_report_event: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, smtp_code, detail, recipient)
SELECT id, attempts, ?1, 'report', ?2, ?3, ?4 FROM mail_queue WHERE id = ?5
"#,
    insert_recipient_event: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, recipient, detail)
VALUES (?1, ?2, ?3, 'suppression', ?4, ?5)
"#,
    suppress_permanent: r#"
INSERT INTO mail_suppression (address, reason, detail, mail_id) VALUES (?1, ?2, ?3, ?4)
ON CONFLICT (address) DO UPDATE
SET reason = excluded.reason, detail = excluded.detail, mail_id = excluded.mail_id,
    created_at = strftime('%Y-%m-%d %H:%M:%f', 'now'), expires_at = NULL
WHERE mail_suppression.expires_at IS NOT NULL
"#,
    suppress_until: r#"
INSERT INTO mail_suppression (address, reason, detail, mail_id, expires_at)
VALUES (?1, ?2, ?3, ?4, strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || (?5 / 1000.0) || ' seconds'))
ON CONFLICT (address) DO UPDATE
SET reason = excluded.reason, detail = excluded.detail, mail_id = excluded.mail_id,
    created_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    expires_at = max(mail_suppression.expires_at, excluded.expires_at)
WHERE mail_suppression.expires_at IS NOT NULL
"#,
    suppress_manual: r#"
INSERT INTO mail_suppression (address, reason, detail, expires_at)
VALUES (?1, ?2, ?3, strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || (?4 / 1000.0) || ' seconds'))
ON CONFLICT (address) DO UPDATE
SET reason = excluded.reason, detail = excluded.detail, mail_id = NULL,
    created_at = strftime('%Y-%m-%d %H:%M:%f', 'now'), expires_at = excluded.expires_at
"#,
    unsuppress: "DELETE FROM mail_suppression WHERE address = ?1",
    soft_bounces: r#"
SELECT count(*) AS count FROM mail_feedback
WHERE recipient = ?1 AND matched AND kind = 'soft_bounce'
  AND received_at > strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || (?2 / 1000.0) || ' seconds')
"#,
    hard_bounced: r#"
SELECT DISTINCT recipient FROM mail_feedback
WHERE mail_id = ?1 AND matched AND kind = 'hard_bounce' AND recipient IS NOT NULL
"#,
    mark_bounced: r#"
UPDATE mail_queue SET status = 'bounced', bounced_at = strftime('%Y-%m-%d %H:%M:%f', 'now')
WHERE id = ?1 AND status IN ('sent', 'unknown')
"#,
    target_columns: "SELECT id, status, message_id, to_address, cc, bcc FROM mail_queue WHERE ",
    left_out: r#"
SELECT DISTINCT e.recipient FROM mail_event AS e
JOIN mail_queue AS m ON m.id = e.mail_id AND e.attempt = m.attempts
WHERE e.mail_id = ?1 AND e.outcome = 'suppressed' AND e.recipient IS NOT NULL
"#,
    suppressed_among: r#"
SELECT address, reason FROM mail_suppression
WHERE (expires_at IS NULL OR expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now'))
  AND address IN ("#,
    suppression_columns: r#"
SELECT address, reason, detail, mail_id, created_at, expires_at FROM mail_suppression WHERE 1 = 1"#,
    in_force: "(expires_at IS NULL OR expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now'))",
    feedback_counts: r#"
SELECT source, kind, count(*) AS count FROM mail_feedback
WHERE received_at > strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || (?1 / 1000.0) || ' seconds')
GROUP BY source, kind
"#,
    purge_feedback: r#"
DELETE FROM mail_feedback WHERE id IN (
    SELECT id FROM mail_feedback
    WHERE received_at < strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || (?1 / 1000.0) || ' seconds')
    ORDER BY received_at
    LIMIT ?2
)
"#,
    purge_suppression: r#"
DELETE FROM mail_suppression WHERE expires_at < strftime('%Y-%m-%d %H:%M:%f', 'now')
"#,
};

static LIMITS: LimitQueries = LimitQueries {
    now: "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    ensure: "INSERT OR IGNORE INTO mail_limit (name) VALUES (?1)",
    lock_suffix: "",
    held_by: "q.thread_lock = mail_limit_use.thread_lock",
    add: "INSERT INTO mail_limit_use (limit_name, thread_lock, mails, pending, reserved_ms, sent_ms) \
          VALUES (?1, ?2, ?3, ?4, ?5, NULL) ON CONFLICT (limit_name, thread_lock) DO UPDATE \
          SET mails = mails + excluded.mails, pending = pending + excluded.pending, sent_ms = NULL",
    sum_mails: "COALESCE(SUM(mails), 0)",
    reserve_within_bound: None,
};

static QUERIES: Queries = Queries {
    placeholder: |i| format!("?{i}"),
    status_counts: portable::STATUS_COUNTS,
    status_ages: r#"
SELECT
    (SELECT (julianday('now') - julianday(min(send_at))) * 86400.0 FROM mail_queue
      WHERE status = 'queued' AND julianday(send_at) <= julianday('now')) AS oldest_due,
    (SELECT count(*) FROM mail_queue
      WHERE status = 'sending' AND julianday(locked_at) < julianday('now') - ?1 / 86400000.0) AS stale
"#,
    status_rates: r#"
SELECT
    coalesce(sum(CASE WHEN minute >= strftime('%Y-%m-%d %H:%M:00.000', 'now', '-1 minutes')
                      THEN sent END), 0) AS sent_1m,
    coalesce(sum(CASE WHEN minute >= strftime('%Y-%m-%d %H:%M:00.000', 'now', '-5 minutes')
                      THEN sent END), 0) AS sent_5m,
    coalesce(sum(sent), 0) AS sent_15m,
    coalesce(sum(attachment_bytes), 0) AS attachment_bytes_15m
FROM tablemail_minute WHERE minute >= strftime('%Y-%m-%d %H:%M:00.000', 'now', '-15 minutes')
"#,
    recent_failures: portable::RECENT_FAILURES,
    failure_groups: r#"
SELECT outcome, stage, smtp_code, count(*) AS count, max(detail) AS example
FROM mail_event
WHERE julianday(at) > julianday('now') - ?1 / 86400000.0 AND outcome IN ('retry', 'failed', 'unknown', 'deferred', 'released', 'stale')
GROUP BY outcome, stage, smtp_code
ORDER BY count(*) DESC, outcome, stage, smtp_code
"#,
    load_content: r#"
SELECT from_name, from_address, to_address, cc, bcc, reply_to, subject, body, body_html, headers,
       route, template, template_data, locale
FROM mail_queue WHERE id = ?1 AND thread_lock = ?2 AND status = 'sending'
"#,
    load_attachments: r#"
SELECT filename, content_type, content, content_id FROM mail_attachment
WHERE mail_id = ?1 ORDER BY id
"#,
    existing_dedupe: "SELECT id FROM mail_queue WHERE dedupe_key = ?1",
    insert_attachment: r#"
INSERT INTO mail_attachment (mail_id, filename, content_type, content, content_id)
VALUES (?1, ?2, ?3, ?4, ?5)
"#,
    retry_events: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, detail)
SELECT id, attempts, ?1, 'operator', ?2 FROM mail_queue
WHERE status IN ('failed', 'unknown') AND id = COALESCE(?3, id)
"#,
    retry: r#"
UPDATE mail_queue
SET status = 'queued', attempts_remaining = ?1,
    send_at = strftime('%Y-%m-%d %H:%M:%f', 'now'), retried_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    relay_down_count = 0, thread_lock = NULL, locked_at = NULL
WHERE status IN ('failed', 'unknown') AND id = COALESCE(?2, id)
"#,
    cancel_event: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, detail)
SELECT id, attempts, ?1, 'operator', ?2 FROM mail_queue WHERE id = ?3 AND status = 'queued'
"#,
    cancel: r#"
UPDATE mail_queue SET status = 'cancelled', processed_at = strftime('%Y-%m-%d %H:%M:%f', 'now')
WHERE id = ?1 AND status = 'queued'
"#,
    release_claim: r#"
UPDATE mail_queue
SET status = 'queued', thread_lock = NULL, locked_at = NULL,
    attempts = attempts - 1, attempts_remaining = attempts_remaining + 1
WHERE thread_lock = ?1 AND status = 'sending'
"#,
    purge_sent: r#"
DELETE FROM mail_queue WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status = 'sent' AND julianday(processed_at) < julianday('now') - ?1 / 86400000.0
    ORDER BY processed_at
    LIMIT ?2
)
"#,
    purge_failed: r#"
DELETE FROM mail_queue WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status IN ('failed', 'cancelled')
      AND julianday(processed_at) < julianday('now') - ?1 / 86400000.0
    ORDER BY processed_at
    LIMIT ?2
)
"#,
    purge_bounced: r#"
DELETE FROM mail_queue WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status IN ('bounced', 'suppressed')
      AND julianday(processed_at) < julianday('now') - ?1 / 86400000.0
    ORDER BY processed_at
    LIMIT ?2
)
"#,
    mail_columns: r#"
SELECT id, status, attempts, attempts_remaining, priority, created_at, send_at, processed_at,
       retried_at, bounced_at, message_id, dedupe_key, last_error, relay_reply, subject, from_name,
       from_address, to_address, cc, bcc, reply_to, body, body_html, headers, route, template,
       template_data, locale
FROM mail_queue "#,
    attachments_of: r#"
SELECT filename, content_type, octet_length(content) AS size, content_id
FROM mail_attachment WHERE mail_id = ?1 ORDER BY id
"#,
    events_of: r#"
SELECT at, attempt, outcome, stage, smtp_code, detail, recipient FROM mail_event
WHERE mail_id = ?1 ORDER BY id
"#,
    summary_columns: r#"
SELECT id, status, priority, attempts, created_at, send_at, processed_at, to_address, cc, bcc,
       subject, last_error
FROM mail_queue "#,
    daemon_upsert: r#"
INSERT INTO tablemail_daemon (id, host, pid, version, in_flight, sent)
VALUES (?1, ?2, ?3, ?4, ?5, ?6)
ON CONFLICT (id) DO UPDATE
SET last_seen = strftime('%Y-%m-%d %H:%M:%f', 'now'), in_flight = excluded.in_flight,
    sent = excluded.sent
"#,
    minute_upsert: r#"
INSERT INTO tablemail_minute (minute, daemon_id, sent, failed, attachment_bytes)
VALUES (strftime('%Y-%m-%d %H:%M:00.000', 'now'), ?1, ?2, ?3, ?4)
ON CONFLICT (minute, daemon_id) DO UPDATE
SET sent = tablemail_minute.sent + excluded.sent, failed = tablemail_minute.failed + excluded.failed,
    attachment_bytes = tablemail_minute.attachment_bytes + excluded.attachment_bytes
"#,
    daemons_forget:
        "DELETE FROM tablemail_daemon WHERE julianday(last_seen) < julianday('now') - 1",
    minutes_forget: "DELETE FROM tablemail_minute WHERE julianday(minute) < julianday('now') - 1",
    daemon_delete: "DELETE FROM tablemail_daemon WHERE id = ?1",
    daemons: r#"
SELECT id, host, pid, version, started_at, last_seen, in_flight, sent,
       julianday(last_seen) < julianday('now') - ?1 / 86400.0 AS silent
FROM tablemail_daemon ORDER BY started_at, id
"#,
    minutes: r#"
SELECT minute, sum(sent) AS sent, sum(failed) AS failed FROM tablemail_minute
WHERE julianday(minute) > julianday(strftime('%Y-%m-%d %H:%M:00.000', 'now')) - ?1 / 1440.0
GROUP BY minute ORDER BY minute
"#,
};

impl Dialect for Sqlite {
    type DB = sqlx::Sqlite;
    const BACKEND: Backend = Backend::Sqlite;

    const QUERIES: &'static Queries = &QUERIES;
    const FEEDBACK: &'static FeedbackQueries = &FEEDBACK;
    const LIMITS: &'static LimitQueries = &LIMITS;
    const TEMPLATES: &'static TemplateQueries = &TEMPLATES;
    const UNIT: fn(Duration) -> i64 = shared::millis;

    async fn claim(
        c: &mut SqliteConnection,
        b: ClaimBinds,
    ) -> Result<Vec<QueuedMail>, sqlx::Error> {
        let (lock, inline_limit) = (b.lock, b.inline_limit.max(0) as u64);
        let rows = b
            .bind_but_inline_limit(sqlx::query(CLAIM))
            .fetch_all(&mut *c)
            .await?;
        let mut mails = rows::claimed(&rows, lock, rows::ClaimedText::Apart)?;
        let inline: Vec<i64> = mails
            .iter()
            .filter(|m| m.sizes.content <= inline_limit)
            .map(|m| m.id)
            .collect();
        if inline.is_empty() {
            return Ok(mails);
        }
        // The claim is committed already. A row this read misses (gone or
        // released in between) is read when sent, like a row over the
        // limit, and found gone then; if the read fails, the claim fails,
        // and the worker releases its lock as it does for a claim whose
        // answer was lost (attempts refunded).
        let rows = sqlx::query(CLAIM_CONTENT)
            .bind(serde_json::to_string(&inline).expect("ids serialize to JSON"))
            .bind(lock.to_string())
            .fetch_all(&mut *c)
            .await?;
        let mut contents: std::collections::HashMap<i64, MailContent> =
            rows::contents(&rows)?.into_iter().collect();
        for mail in &mut mails {
            mail.content = contents.remove(&mail.id);
        }
        Ok(mails)
    }

    async fn suppressed_among(
        c: &mut SqliteConnection,
        sql: &'static str,
        addresses: Vec<String>,
    ) -> Result<Vec<super::Suppressed>, sqlx::Error> {
        // A list of few lengths (`id_list_len`: why).
        let (addresses, places) = shared::padded_list(addresses, QUERIES.placeholder);
        let sql = format!("{sql}{places})");
        let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql));
        for address in addresses {
            query = query.bind(address);
        }
        query.fetch_all(c).await
    }

    async fn finalize(
        c: &mut SqliteConnection,
        writes: Vec<Finalize>,
    ) -> Result<Vec<i64>, sqlx::Error> {
        let json = finalize_json(&writes);
        if writes.iter().all(|w| w.event.is_none()) {
            let rows = sqlx::query(FINALIZE).bind(json).fetch_all(c).await?;
            return rows.iter().map(|r| r.try_get::<i64, _>(0)).collect();
        }
        let mut tx = c.begin_with(IMMEDIATE).await?;
        let rows = sqlx::query(FINALIZE)
            .bind(json.clone())
            .fetch_all(&mut *tx)
            .await?;
        let written = rows
            .iter()
            .map(|r| r.try_get::<i64, _>(0))
            .collect::<Result<Vec<i64>, _>>()?;
        sqlx::query(FINALIZE_EVENTS)
            .bind(json)
            .bind(serde_json::Value::from(written.clone()).to_string())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(written)
    }

    async fn renew_locks(
        c: &mut SqliteConnection,
        held: Vec<(i64, BatchLock)>,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(RENEW).bind(held_json(&held)).execute(c).await?;
        Ok(done.rows_affected())
    }

    async fn release_stale_locks(
        c: &mut SqliteConnection,
        older_than: i64,
        spare: Vec<BatchLock>,
    ) -> Result<Vec<StaleRow>, sqlx::Error> {
        let mut tx = c.begin_with(IMMEDIATE).await?;
        let rows = sqlx::query(RELEASE_STALE)
            .bind(older_than)
            .bind(locks_json(&spare))
            .fetch_all(&mut *tx)
            .await?;
        let mut released = Vec::with_capacity(rows.len());
        let mut history = Vec::with_capacity(rows.len());
        for row in &rows {
            let stale = StaleRow::from_row(row)?;
            let attempts: i64 = row.try_get("attempts")?;
            history.push(serde_json::json!([stale.id, attempts, stale.requeued]));
            released.push(stale);
        }
        if !released.is_empty() {
            sqlx::query(STALE_EVENTS)
                .bind(serde_json::Value::Array(history).to_string())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(released)
    }

    async fn enqueue(
        c: &mut SqliteConnection,
        mails: Vec<NewMail>,
    ) -> Result<Vec<Enqueued>, sqlx::Error> {
        // Times in the column's own text format, so that they sort with the
        // defaults.
        let placeholder = |i, p: &Param<'_>| match p {
            Param::Time(_) => format!("strftime('%Y-%m-%d %H:%M:%f', ?{i})"),
            _ => format!("?{i}"),
        };
        insert::insert_returning::<sqlx::Sqlite>(c, IMMEDIATE, mails, placeholder, &QUERIES).await
    }

    fn spawn_wakeup_listener(
        &self,
        _shared: &Shared<sqlx::Sqlite>,
        wake: Arc<Notify>,
        cancel: CancellationToken,
    ) -> Option<&'static str> {
        tokio::spawn(watch_commits(
            self.options.clone(),
            WATCH_EVERY,
            wake,
            cancel,
        ));
        Some("data_version")
    }
}

/// Wakes `wake` whenever another connection (another process's, or this
/// daemon's own pool's) has committed to the file: it reads `PRAGMA
/// data_version` every `every`, and, when the kernel reports a write to the
/// file or its WAL, at once and then every millisecond for a few
/// milliseconds after the last write (a commit becomes visible a moment
/// after its last write to the WAL, when the writer updates the WAL's shared
/// index, which the kernel does not report). A file system whose writes the
/// kernel does not report (a network or shared-folder mount) is still looked
/// at every `every`.
async fn watch_commits(
    options: SqliteConnectOptions,
    every: Duration,
    wake: Arc<Notify>,
    cancel: CancellationToken,
) {
    let written = Arc::new(Notify::new());
    // Kept for as long as the loop runs: dropping it stops the watch.
    let mut watch = FileWatch::start(options.get_filename(), written.clone());
    // Not reset by reports of writes: a look every `every` whatever happens.
    let mut looks = tokio::time::interval(every);
    looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut conn: Option<SqliteConnection> = None;
    let mut last: Option<i64> = None;
    let mut at_last_tick: Option<i64> = None;
    let mut soon = 0u32;
    let mut budget = WakeBudget::new(Instant::now());
    // When to wake the daemon for a commit seen with no wake-up left.
    let mut deferred: Option<Instant> = None;
    loop {
        let mut ticked = false;
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = written.notified() => soon = LOOKS_AFTER_A_WRITE,
            _ = looks.tick() => ticked = true,
            _ = tokio::time::sleep(Duration::from_millis(1)), if soon > 0 => soon -= 1,
            _ = tokio::time::sleep_until(deferred.unwrap_or_else(Instant::now)), if deferred.is_some() => {
                deferred = None;
            }
        }
        if conn.is_none() {
            conn = options.connect().await.ok();
        }
        let Some(c) = conn.as_mut() else { continue };
        match sqlx::query_scalar::<_, i64>("PRAGMA data_version")
            .fetch_one(&mut *c)
            .await
        {
            Ok(version) => {
                // The first reading wakes too: anything may have been
                // committed before the watcher was watching. Every commit
                // to the file counts, the application's to its own tables
                // too, and each wake-up is a claim: see `WakeBudget`.
                if last != Some(version) {
                    match budget.take(Instant::now()) {
                        Ok(()) => {
                            wake.notify_one();
                            last = Some(version);
                        }
                        Err(next) => deferred = Some(next),
                    }
                    soon = 0;
                }
                if ticked {
                    if let Some(w) = watch.as_mut() {
                        w.pace(at_last_tick == Some(version));
                    }
                    at_last_tick = Some(version);
                }
            }
            Err(_) => conn = None,
        }
    }
}

/// The kernel's reports of writes to the database file and its WAL (a
/// commit appends to the WAL in WAL mode, writes the file itself otherwise),
/// each one notifying `written`. The directory is watched, not the files, so
/// that a WAL made again after the last connection removed it is still seen.
///
/// While the file is written fast (the daemon draining a backlog writes
/// thousands of pages a second, and each write would be a report to read),
/// the watch is stopped: the claim loop is busy then and the watcher's
/// interval is enough. It starts again once an interval passes with no
/// commit.
struct FileWatch {
    watcher: notify::RecommendedWatcher,
    dir: std::path::PathBuf,
    /// Reports since the last interval.
    reports: Arc<AtomicU32>,
    on: bool,
}

/// More reports than this in one interval stop the watch.
const BUSY_REPORTS: u32 = 200;

impl FileWatch {
    /// None when the file system or the process's limits allow no watch
    /// (said in a warning): the caller still looks at its interval.
    fn start(db: &Path, written: Arc<Notify>) -> Option<FileWatch> {
        use notify::{EventKind, RecursiveMode, Watcher as _};
        let db = std::fs::canonicalize(db).ok()?;
        let dir = db.parent()?.to_path_buf();
        let name = db.file_name()?.to_os_string();
        let mut wal = name.clone();
        wal.push("-wal");
        let reports = Arc::new(AtomicU32::new(0));
        let counted = reports.clone();
        let started = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let Ok(event) = event else { return };
            if !matches!(event.kind, EventKind::Modify(_) | EventKind::Create(_)) {
                return;
            }
            let ours = event
                .paths
                .iter()
                .any(|p| p.file_name().is_some_and(|n| n == name || n == wal));
            if ours {
                counted.fetch_add(1, Ordering::Relaxed);
                written.notify_one();
            }
        })
        .and_then(|mut watcher| {
            watcher.watch(&dir, RecursiveMode::NonRecursive)?;
            Ok(watcher)
        });
        match started {
            Ok(watcher) => Some(FileWatch {
                watcher,
                dir,
                reports,
                on: true,
            }),
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    every_ms = WATCH_EVERY.as_millis() as u64,
                    "cannot watch the database file for commits; looking for them at an interval"
                );
                None
            }
        }
    }

    /// At each interval: stops the watch when the file was written fast,
    /// starts it again when no commit came in the interval (`quiet`). Each
    /// is a short call to the watch's own thread (microseconds), at most once
    /// an interval.
    fn pace(&mut self, quiet: bool) {
        use notify::{RecursiveMode, Watcher as _};
        let reports = self.reports.swap(0, Ordering::Relaxed);
        if self.on && reports > BUSY_REPORTS {
            self.on = self.watcher.unwatch(&self.dir).is_err();
        } else if !self.on && quiet {
            self.on = self
                .watcher
                .watch(&self.dir, RecursiveMode::NonRecursive)
                .is_ok();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    /// A migrated SQLite file in a directory of its own, removed on drop.
    struct Scratch {
        dir: std::path::PathBuf,
        store: SqlStore<Sqlite>,
    }

    impl Scratch {
        async fn new(name: &str) -> Scratch {
            let dir =
                std::env::temp_dir().join(format!("tablemail-{name}-{}", Uuid::new_v4().simple()));
            std::fs::create_dir_all(&dir).unwrap();
            let url = format!("sqlite://{}", dir.join(format!("{name}.db")).display());
            let store = connect(&url, ConnectOptions::new(1)).unwrap();
            crate::store::Store::migrate(&store).await.unwrap();
            Scratch { dir, store }
        }

        /// Another connection to the file, as an application's.
        async fn connection(&self) -> SqliteConnection {
            self.store.dialect.options.connect().await.unwrap()
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// The watcher on `scratch`, looking only once an hour, once its first
    /// reading has woken the daemon: what wakes it next is a reported write.
    async fn watching(
        scratch: &Scratch,
    ) -> (Arc<Notify>, CancellationToken, tokio::task::JoinHandle<()>) {
        let wake = Arc::new(Notify::new());
        let cancel = CancellationToken::new();
        let watcher = tokio::spawn(watch_commits(
            scratch.store.dialect.options.clone(),
            Duration::from_secs(3600),
            wake.clone(),
            cancel.clone(),
        ));
        // The first reading wakes: rows may have come before the watch.
        tokio::time::timeout(Duration::from_secs(10), wake.notified())
            .await
            .expect("the watcher's first reading wakes the daemon");
        (wake, cancel, watcher)
    }

    /// Group commits and lock renewals find their rows by rowid even when the
    /// statistics say no row is sending (ANALYZE taken on an idle queue).
    #[tokio::test]
    async fn outcomes_find_their_rows_by_rowid_whatever_the_statistics() {
        let scratch = Scratch::new("plan").await;
        let mut conn = scratch.connection().await;
        for sql in [
            "ANALYZE",
            "DELETE FROM sqlite_stat1 WHERE tbl = 'mail_queue'",
            "INSERT INTO sqlite_stat1 VALUES ('mail_queue', 'mail_queue_claim_idx', '50000 50000 50000 1'), \
             ('mail_queue', 'mail_queue_sending_idx', '0 0 0')",
            // Loads the statistics into this connection's planner.
            "ANALYZE sqlite_schema",
        ] {
            sqlx::query(sql).execute(&mut conn).await.unwrap();
        }
        for (name, sql) in [("FINALIZE", FINALIZE), ("RENEW", RENEW)] {
            let explain = format!("EXPLAIN QUERY PLAN {sql}");
            let plan: Vec<String> = sqlx::query(sqlx::AssertSqlSafe(explain))
                .bind("[]")
                .fetch_all(&mut conn)
                .await
                .unwrap()
                .iter()
                .map(|row| row.get::<String, _>(3))
                .collect();
            assert!(plan[0].starts_with("SCAN jsonb_each"), "{name}: {plan:?}");
            assert!(
                plan.iter()
                    .any(|step| step.contains("SEARCH mail_queue USING INTEGER PRIMARY KEY")),
                "{name}: {plan:?}"
            );
        }
    }
    /// A commit of another process wakes the daemon when the kernel reports
    /// the write, not at the watcher's next look: with a look only every
    /// hour, an insert must still wake it.
    #[tokio::test]
    async fn a_commit_to_the_file_wakes_the_daemon_without_waiting_for_a_look() {
        let scratch = Scratch::new("watch").await;
        let (wake, cancel, watcher) = watching(&scratch).await;
        let deadline = Duration::from_secs(10);
        let mut other = scratch.connection().await;
        for i in 0..3 {
            let armed = wake.notified();
            tokio::pin!(armed);
            armed.as_mut().enable();
            sqlx::query(
                "INSERT INTO mail_queue (to_address, subject, body) VALUES ('a@example.com', 'Hi', 'Hello')",
            )
            .execute(&mut other)
            .await
            .unwrap();
            tokio::time::timeout(deadline, armed)
                .await
                .unwrap_or_else(|_| {
                    panic!("insert {i} did not wake the daemon within {deadline:?}")
                });
        }
        cancel.cancel();
        watcher.await.unwrap();
    }

    /// A burst of writes stops the watch (the daemon draining a backlog would
    /// otherwise read a report for every page it writes); an interval
    /// without commits starts it again, and a commit is reported at once.
    #[tokio::test]
    async fn the_watch_stops_while_the_file_is_written_fast_and_starts_again_when_quiet() {
        let scratch = Scratch::new("busy").await;
        let written = Arc::new(Notify::new());
        let mut watch = FileWatch::start(
            scratch.store.dialect.options.get_filename(),
            written.clone(),
        )
        .expect("the file can be watched here");
        let mut other = scratch.connection().await;
        let insert =
            "INSERT INTO mail_queue (to_address, subject, body) VALUES ('a@example.com', 'Hi', ?)";
        let body = "x".repeat(3000);
        // A backlog of 2,000 mails arriving one commit at a time.
        for _ in 0..2000 {
            sqlx::query(insert)
                .bind(&body)
                .execute(&mut other)
                .await
                .unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while watch.reports.load(Ordering::Relaxed) <= BUSY_REPORTS {
            assert!(
                std::time::Instant::now() < deadline,
                "only {} reports of 2,000 commits",
                watch.reports.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        watch.pace(false);
        assert!(!watch.on, "a burst of writes stops the watch");
        watch.pace(false);
        assert!(!watch.on, "an interval with commits keeps it stopped");
        watch.pace(true);
        assert!(watch.on, "an interval without commits starts it again");
        // A report of the burst left waiting is not the one looked for.
        let _ = tokio::time::timeout(Duration::ZERO, written.notified()).await;
        let armed = written.notified();
        tokio::pin!(armed);
        armed.as_mut().enable();
        sqlx::query(insert)
            .bind("one more")
            .execute(&mut other)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), armed)
            .await
            .expect("a commit after the quiet interval is reported");
    }

    /// An application that commits to the file many times a second (to its
    /// own tables too) wakes the daemon, each wake-up a claim, a few times
    /// and then at most every 10 ms, and its last commit still wakes it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_of_commits_wakes_the_daemon_at_most_every_10_ms() {
        let scratch = Scratch::new("stream").await;
        let mut other = scratch.connection().await;
        sqlx::query("CREATE TABLE app_events (id INTEGER PRIMARY KEY, what TEXT)")
            .execute(&mut other)
            .await
            .unwrap();
        let (wake, cancel, watcher) = watching(&scratch).await;
        let deadline = Duration::from_secs(10);
        let wakes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let counter = tokio::spawn({
            let (wake, wakes) = (wake.clone(), wakes.clone());
            async move {
                loop {
                    wake.notified().await;
                    wakes.lock().unwrap().push(std::time::Instant::now());
                }
            }
        });
        let began = std::time::Instant::now();
        for i in 0..300 {
            sqlx::query("INSERT INTO app_events (what) VALUES (?)")
                .bind(format!("event {i}"))
                .execute(&mut other)
                .await
                .unwrap();
        }
        let last_commit = std::time::Instant::now();
        // The last commit wakes the daemon, at the latest when the next
        // wake-up comes back.
        let until = last_commit + deadline;
        while !wakes.lock().unwrap().iter().any(|&t| t >= last_commit) {
            assert!(
                std::time::Instant::now() < until,
                "the last commit woke nobody"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let window = began.elapsed();
        let woken = wakes.lock().unwrap().len() as u128;
        let most = window.as_millis() / WAKE_REFILL.as_millis() + WAKE_BURST as u128 + 1;
        assert!(
            woken <= most,
            "{woken} wake-ups for 300 commits in {window:?}: at most {most}"
        );
        counter.abort();
        cancel.cancel();
        watcher.await.unwrap();
    }

    /// Eight wake-ups at once, then one every 10 ms; an hour's rest gives
    /// back eight, not more.
    #[test]
    fn the_wake_budget_gives_a_few_at_once_then_one_every_10_ms() {
        let t0 = Instant::now();
        let mut budget = WakeBudget::new(t0);
        for _ in 0..WAKE_BURST {
            assert_eq!(budget.take(t0), Ok(()));
        }
        assert_eq!(budget.take(t0), Err(t0 + WAKE_REFILL));
        let ms = Duration::from_millis;
        assert_eq!(budget.take(t0 + ms(9)), Err(t0 + WAKE_REFILL));
        assert_eq!(budget.take(t0 + ms(10)), Ok(()));
        assert_eq!(budget.take(t0 + ms(11)), Err(t0 + ms(20)));
        let later = t0 + Duration::from_secs(3600);
        for _ in 0..WAKE_BURST {
            assert_eq!(budget.take(later), Ok(()));
        }
        assert_eq!(budget.take(later), Err(later + WAKE_REFILL));
    }
}
