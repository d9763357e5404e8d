//! MySQL 8 and MariaDB 10.6+: claims read the head of the pending index, lock
//! its rows by id `FOR UPDATE SKIP LOCKED` (never walking the index locking)
//! in a short READ COMMITTED transaction (no gap locks in the way of
//! applications' INSERTs), stamp them with the batch GUID and read them
//! back, since MariaDB has no `UPDATE … RETURNING`. Finalize joins
//! `JSON_TABLE` of the outcomes (arrays) to their rows by id, in that order.
//! Rows are always locked in id order (finalize and lock renewal alike), so
//! two daemons never deadlock. Times are UTC `DATETIME(6)`; there is no
//! NOTIFY, so an idle daemon looks for a new newest id every
//! `database.look_interval` (100 ms unless set).
//! Retention picks the rows it deletes by a plain read of its index, which
//! holds finished rows only (keyed on a generated column, NULL before a row
//! is finished, in place of a partial index), and deletes them by id.
//! Most of this file is its SQL, each statement with its reason.

use std::{str::FromStr, sync::Arc, time::Duration};

use secrecy::ExposeSecret;
use sqlx::{
    mysql::{MySqlConnectOptions, MySqlConnection},
    AssertSqlSafe, ConnectOptions as _, Connection, Executor, FromRow, Row,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{
    conns::{Conns, Reach, Setup},
    dialect::{Dialect, SqlStore},
    finalize::{wire_chunks, STATEMENT_BUDGET},
    insert::{insert_attachments, insert_columns, insert_query},
    migrations::MYSQL,
    rows::{self, finalize_rows_json, held_json, locks_json},
    shared::{self, id_list_len, portable, FeedbackQueries, LimitQueries, Queries, Shared},
    templates::{self, TemplateQueries},
    Backend, BatchLock, ClaimBinds, ConnectOptions, Enqueued, Finalize, Finished, NewMail,
    QueuedMail, Result, StaleRow,
};

/// MySQL's and MariaDB's own ways; it keeps the connect options for the
/// wake-up's own connection, and how often it looks.
pub(crate) struct MySql {
    options: MySqlConnectOptions,
    look_every: Duration,
}

pub(crate) fn connect(url: &str, options: ConnectOptions) -> Result<SqlStore<MySql>> {
    let mut connect = MySqlConnectOptions::from_str(url)?;
    if let Some(password) = &options.password {
        connect = connect.password(password.expose_secret());
    }
    let connect = connect
        .timezone(Some("+00:00".to_string()))
        .log_statements(tracing::log::LevelFilter::Trace)
        .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(1));
    // sqlx sets no TCP keepalive on its socket, and MySQL has no
    // server-side keepalive setting per session: a daemon that vanished in
    // the middle of a claim transaction (a lost NAT entry, a failed-over
    // address) would leave its row locks held for `wait_timeout`, eight
    // hours by default. The session's `wait_timeout` bounds that to four
    // deadlines (the daemon never leaves a session idle inside a transaction
    // longer than one); idle connections leave the pool before the server
    // closes them.
    let wait = options
        .statement_timeout
        .as_secs()
        .saturating_mul(4)
        .max(10);
    let session = format!("SET SESSION wait_timeout = {wait}");
    let setup: Setup<sqlx::MySql> = Arc::new(move |conn| {
        let session = session.clone();
        Box::pin(async move {
            conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                .await?;
            conn.execute(AssertSqlSafe(session)).await?;
            Ok(())
        })
    });
    let pool = Conns::new(
        connect.clone(),
        Reach::Network,
        options.max_connections,
        Duration::from_secs(wait / 2),
        Some(setup),
    );
    Ok(SqlStore {
        shared: Shared::new::<MySql>(pool, options.statement_timeout, MYSQL, "BEGIN"),
        dialect: MySql {
            options: connect,
            look_every: options.look_interval,
        },
    })
}

/// `(?, ?, …)` for an IN list of `n` ids, with [`id_list_len`]`(n)` places:
/// few texts for lists of any length (why: there).
fn in_list(n: usize) -> String {
    format!("({})", vec!["?"; id_list_len(n)].join(", "))
}

/// Binds the ids of an IN list written by [`in_list`]`(ids.len())`, the
/// last id again in the places beyond them.
fn bind_ids<'q>(
    mut query: sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    ids: &[i64],
) -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments> {
    for id in ids {
        query = query.bind(*id);
    }
    if let Some(&last) = ids.last() {
        for _ in ids.len()..id_list_len(ids.len()) {
            query = query.bind(last);
        }
    }
    query
}

// The head of the pending index in claim order, read without locks: a plain
// read of the index alone passes over the entries of rows claimed a moment
// ago (left behind until InnoDB's purge removes them) without looking at
// their rows. A locking read looks up the row of each such entry, and a
// busy queue keeps thousands of them at the head, so a locking claim reads
// many times the pages the batch needs. FORCE INDEX: the walk stops after
// the batch whatever InnoDB's sampled statistics say about the backlog.
const HEAD: &str = r#"
SELECT id FROM mail_queue FORCE INDEX (mail_queue_claim_idx)
WHERE status = 'queued' AND send_at <= UTC_TIMESTAMP(6)
ORDER BY priority DESC, send_at, id
LIMIT ?
"#;

// Locks the rows of the head that are still queued and due, through the
// primary key in id order, passing over those another claim holds.
const LOCK_HEAD: &str = r#"
SELECT id FROM mail_queue FORCE INDEX (PRIMARY)
WHERE status = 'queued' AND send_at <= UTC_TIMESTAMP(6) AND id IN "#;

// The Message-ID, given at the first claim, is derived from the row alone
// (as PostgreSQL's, see there): a claim lost in a failover gives it again.
const STAMP: &str = r#"
UPDATE mail_queue
SET status = 'sending',
    thread_lock = ?,
    locked_at = UTC_TIMESTAMP(6),
    attempts = attempts + 1,
    attempts_remaining = attempts_remaining - 1,
    message_id = COALESCE(message_id, CONCAT('<', LEFT(MD5(CONCAT(id, '.', DATE_FORMAT(created_at,
        '%Y%m%d%H%i%s%f'), '.', ?)), 20), '.', id, '@', ?, '>'))
WHERE id IN
"#;

/// The octets of a row's text columns together.
macro_rules! content_bytes {
    () => {
        "(COALESCE(LENGTH(m.body), 0) + COALESCE(LENGTH(m.body_html), 0) \
         + COALESCE(LENGTH(m.from_name), 0) + COALESCE(LENGTH(m.from_address), 0) \
         + LENGTH(m.to_address) + COALESCE(LENGTH(m.cc), 0) + COALESCE(LENGTH(m.bcc), 0) \
         + COALESCE(LENGTH(m.reply_to), 0) + LENGTH(m.subject) + COALESCE(LENGTH(m.headers), 0) \
         + COALESCE(LENGTH(m.template_data), 0))"
    };
}

// The claimed rows with their sizes; the text columns only of rows within
// the inline limit (the first parameter), from the row joined to itself on
// that condition: MariaDB has no common subexpressions, and a test of the
// size in each column's CASE summed the ten lengths a dozen times a row (a
// third of the statement's time). Attachments are probed only for rows no
// newer than the newest mail with attachments, as on PostgreSQL (where the
// reasons are).
const READ_BACK: &str = concat!(
    r#"
SELECT m.id, m.priority, m.attempts, m.attempts_remaining, m.relay_down_count, m.message_id,
       GREATEST(m.created_at, COALESCE(m.retried_at, m.created_at))
           < UTC_TIMESTAMP(6) - INTERVAL p.max_age MICROSECOND AS expired,
       COALESCE(LENGTH(m.body), 0) + COALESCE(LENGTH(m.body_html), 0) AS body_bytes,
       "#,
    content_bytes!(),
    r#" AS content_bytes,
       CASE WHEN m.id <= p.attached
            THEN (SELECT COUNT(*) FROM mail_attachment AS x WHERE x.mail_id = m.id)
            ELSE 0 END AS attachment_count,
       CASE WHEN m.id <= p.attached
            THEN (SELECT CAST(COALESCE(SUM(LENGTH(x.content)), 0) AS SIGNED)
                  FROM mail_attachment AS x WHERE x.mail_id = m.id)
            ELSE 0 END AS attachment_bytes,
       t.id IS NOT NULL AS inline,
       t.from_name, t.from_address, t.to_address, t.cc, t.bcc, t.reply_to, t.subject,
       t.body, t.body_html, CAST(t.headers AS CHAR) AS headers, t.route, t.template,
       CAST(t.template_data AS CHAR) AS template_data, t.locale
FROM mail_queue AS m
CROSS JOIN (SELECT ? AS lim, ? AS max_age,
                   (SELECT MAX(y.mail_id) FROM mail_attachment AS y) AS attached) AS p
LEFT JOIN mail_queue AS t ON t.id = m.id AND "#,
    content_bytes!(),
    r#" <= p.lim
WHERE m.id IN "#
);

/// Locks rows through the primary key only, in id order: a secondary index
/// (say `status, locked_at`) would lock its own entries first, in its own
/// order, and deadlock with a statement that holds the rows.
const LOCK_BY_ID: &str = r#"
SELECT id, status, thread_lock FROM mail_queue FORCE INDEX (PRIMARY) WHERE id IN
"#;

/// The outcomes joined to their rows by id: the JSON first (`STRAIGHT_JOIN`),
/// then each row through the primary key, so that rows are locked one by one
/// in the outcomes' order (by id) and no other row is read. Left to choose,
/// MariaDB read the rows in flight first, through the `status` prefix of
/// the pending index, whenever it guessed fewer of them than the forty it
/// guesses for a JSON_TABLE (as in a quiet queue, with few rows in flight
/// among many sent ones); a multi-table UPDATE locks each row it reads, so
/// an outcome waited for every other batch's rows in flight, and two
/// daemons finalizing at once, each holding its own rows, could wait for
/// each other.
const FINALIZE: &str = r#"
UPDATE JSON_TABLE(?, '$[*]' COLUMNS (
        id BIGINT PATH '$[0]',
        lk VARCHAR(36) PATH '$[1]',
        st VARCHAR(16) PATH '$[2]',
        delay_ms BIGINT PATH '$[3]',
        err TEXT PATH '$[4]',
        refund INT PATH '$[5]',
        processed INT PATH '$[6]',
        relay_down INT PATH '$[7]',
        reply TEXT PATH '$[8]',
        qid VARCHAR(255) PATH '$[9]'
    )) AS f
STRAIGHT_JOIN mail_queue AS m FORCE INDEX (PRIMARY)
  ON m.id = f.id AND m.thread_lock = f.lk AND m.status = 'sending'
SET m.send_at = CASE WHEN f.delay_ms >= 0
                     THEN UTC_TIMESTAMP(6) + INTERVAL (f.delay_ms * 1000) MICROSECOND
                     ELSE m.send_at END,
    m.attempts = m.attempts - f.refund,
    m.attempts_remaining = m.attempts_remaining + f.refund,
    m.processed_at = CASE WHEN f.processed = 1 THEN UTC_TIMESTAMP(6) ELSE m.processed_at END,
    m.relay_down_count = CASE f.relay_down WHEN 0 THEN 0
                                           WHEN 1 THEN m.relay_down_count + 1
                                           ELSE m.relay_down_count END,
    m.last_error = COALESCE(f.err, m.last_error),
    m.relay_reply = COALESCE(f.reply, m.relay_reply),
    m.relay_queue_id = COALESCE(f.qid, m.relay_queue_id),
    m.thread_lock = NULL,
    m.locked_at = NULL,
    m.status = f.st
"#;

/// The history rows of the outcomes FINALIZE wrote (an IN list of their ids
/// follows), in the same transaction; a row's detail is the outcome's error
/// unless it has one of its own.
const FINALIZE_EVENTS: &str = r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, smtp_code, detail)
SELECT f.id, f.attempt, f.outcome, f.stage, f.code, COALESCE(f.detail, f.err)
FROM JSON_TABLE(?, '$[*]' COLUMNS (
        id BIGINT PATH '$[0]',
        err TEXT PATH '$[4]',
        attempt INT PATH '$[10]',
        outcome VARCHAR(16) PATH '$[11]',
        stage VARCHAR(16) PATH '$[12]',
        code INT PATH '$[13]',
        detail TEXT PATH '$[14]'
    )) AS f
WHERE f.outcome IS NOT NULL AND f.id IN "#;

/// Renewal by id, in id order, joined as [`FINALIZE`] is: the rows' primary
/// key is the only index it walks, so it never waits on rows another daemon
/// holds.
const RENEW: &str = r#"
UPDATE JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$.id', lk VARCHAR(36) PATH '$.lock')) AS h
STRAIGHT_JOIN mail_queue AS m FORCE INDEX (PRIMARY)
  ON m.id = h.id AND m.thread_lock = h.lk AND m.status = 'sending'
SET m.locked_at = UTC_TIMESTAMP(6)
"#;

const PICK_STALE: &str = r#"
SELECT id, attempts_remaining > 0 AS requeued FROM mail_queue
WHERE status = 'sending' AND locked_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
  AND NOT JSON_CONTAINS(?, JSON_QUOTE(thread_lock))
ORDER BY id
FOR UPDATE SKIP LOCKED
"#;

const RELEASE_STALE: &str = r#"
UPDATE mail_queue
SET processed_at = CASE WHEN attempts_remaining > 0 THEN processed_at ELSE UTC_TIMESTAMP(6) END,
    last_error = CASE WHEN attempts_remaining > 0 THEN last_error
                      ELSE 'lock expired: the worker stopped during the last attempt' END,
    thread_lock = NULL,
    locked_at = NULL,
    status = CASE WHEN attempts_remaining > 0 THEN 'queued' ELSE 'failed' END
WHERE status = 'sending' AND id IN
"#;

/// Deletes finished rows picked by id (an IN list of their ids follows),
/// each still of its kind and age: through the primary key, so that it
/// locks the rows it deletes and no others.
const PURGE_SENT_BY_ID: &str = r#"
DELETE m FROM mail_queue AS m FORCE INDEX (PRIMARY)
WHERE m.status = 'sent' AND m.processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
  AND m.id IN "#;

const PURGE_FAILED_BY_ID: &str = r#"
DELETE m FROM mail_queue AS m FORCE INDEX (PRIMARY)
WHERE m.status IN ('failed', 'cancelled')
  AND m.processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
  AND m.id IN "#;

const PURGE_BOUNCED_BY_ID: &str = r#"
DELETE m FROM mail_queue AS m FORCE INDEX (PRIMARY)
WHERE m.status IN ('bounced', 'suppressed')
  AND m.processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
  AND m.id IN "#;

/// The history rows of rows RELEASE_STALE just released (an IN list of
/// their ids follows).
const STALE_EVENTS: &str = r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, detail)
SELECT id, attempts, 'stale', 'lock',
       CASE WHEN status = 'queued' THEN 'lock expired: the worker stopped during this attempt'
            ELSE 'lock expired: the worker stopped during the last attempt' END
FROM mail_queue WHERE id IN "#;

/// The delivery loop's SQL (DESIGN §12). In the upserts every column is
/// assigned from what the row held before `expires_at`, which comes last:
/// MySQL assigns left to right, each assignment seeing the ones before it.
static TEMPLATES: TemplateQueries = TemplateQueries {
    versions: templates::portable::VERSIONS,
    all: templates::portable::ALL,
    put: r#"
INSERT INTO mail_template (name, locale, subject, body, body_html, updated_at)
VALUES (?, ?, ?, ?, ?, UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE
    subject = VALUES(subject), body = VALUES(body), body_html = VALUES(body_html),
    updated_at = UTC_TIMESTAMP(6)
"#,
};

static FEEDBACK: FeedbackQueries = FeedbackQueries {
    insert_feedback: r#"
INSERT INTO mail_feedback
    (source, mail_id, recipient, kind, status, diagnostic, matched, size, raw, event_key)
SELECT ?, (SELECT id FROM mail_queue WHERE id = ?), ?, ?, ?, ?, ?, ?, ?, ?
"#,
    insert_report_event: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, smtp_code, detail, recipient)
SELECT id, attempts, ?, 'report', ?, ?, ? FROM mail_queue WHERE id = ?
"#,
    insert_recipient_event: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, recipient, detail)
VALUES (?, ?, ?, 'suppression', ?, ?)
"#,
    suppress_permanent: r#"
INSERT INTO mail_suppression (address, reason, detail, mail_id) VALUES (?, ?, ?, ?)
ON DUPLICATE KEY UPDATE
    reason = IF(expires_at IS NULL, reason, VALUES(reason)),
    detail = IF(expires_at IS NULL, detail, VALUES(detail)),
    mail_id = IF(expires_at IS NULL, mail_id, VALUES(mail_id)),
    created_at = IF(expires_at IS NULL, created_at, UTC_TIMESTAMP(6)),
    expires_at = NULL
"#,
    suppress_until: r#"
INSERT INTO mail_suppression (address, reason, detail, mail_id, expires_at)
VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
ON DUPLICATE KEY UPDATE
    reason = IF(expires_at IS NULL, reason, VALUES(reason)),
    detail = IF(expires_at IS NULL, detail, VALUES(detail)),
    mail_id = IF(expires_at IS NULL, mail_id, VALUES(mail_id)),
    created_at = IF(expires_at IS NULL, created_at, UTC_TIMESTAMP(6)),
    expires_at = IF(expires_at IS NULL, NULL, GREATEST(expires_at, VALUES(expires_at)))
"#,
    suppress_manual: r#"
INSERT INTO mail_suppression (address, reason, detail, expires_at)
VALUES (?, ?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
ON DUPLICATE KEY UPDATE
    reason = VALUES(reason), detail = VALUES(detail), mail_id = NULL,
    created_at = UTC_TIMESTAMP(6), expires_at = VALUES(expires_at)
"#,
    unsuppress: "DELETE FROM mail_suppression WHERE address = ?",
    soft_bounces: r#"
SELECT COUNT(*) AS count FROM mail_feedback
WHERE recipient = ? AND matched AND kind = 'soft_bounce'
  AND received_at > UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
"#,
    hard_bounced: r#"
SELECT DISTINCT recipient FROM mail_feedback
WHERE mail_id = ? AND matched AND kind = 'hard_bounce' AND recipient IS NOT NULL
"#,
    mark_bounced: r#"
UPDATE mail_queue SET status = 'bounced', bounced_at = UTC_TIMESTAMP(6)
WHERE id = ? AND status IN ('sent', 'unknown')
"#,
    target_columns: "SELECT id, status, message_id, to_address, cc, bcc FROM mail_queue WHERE ",
    left_out: r#"
SELECT DISTINCT e.recipient FROM mail_event AS e
JOIN mail_queue AS m ON m.id = e.mail_id AND e.attempt = m.attempts
WHERE e.mail_id = ? AND e.outcome = 'suppressed' AND e.recipient IS NOT NULL
"#,
    suppressed_among: r#"
SELECT address, reason FROM mail_suppression
WHERE (expires_at IS NULL OR expires_at > UTC_TIMESTAMP(6)) AND address IN ("#,
    suppression_columns: r#"
SELECT address, reason, detail, mail_id, created_at, expires_at FROM mail_suppression WHERE 1 = 1"#,
    in_force: "(expires_at IS NULL OR expires_at > UTC_TIMESTAMP(6))",
    feedback_counts: r#"
SELECT source, kind, COUNT(*) AS count FROM mail_feedback
WHERE received_at > UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
GROUP BY source, kind
"#,
    purge_feedback: r#"
DELETE FROM mail_feedback
WHERE received_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY received_at
LIMIT ?
"#,
    purge_suppression: "DELETE FROM mail_suppression WHERE expires_at < UTC_TIMESTAMP(6)",
};

static LIMITS: LimitQueries = LimitQueries {
    now: "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000 AS SIGNED)",
    ensure: "INSERT IGNORE INTO mail_limit (name) VALUES (?)",
    lock_suffix: " FOR UPDATE",
    held_by: "q.thread_lock = mail_limit_use.thread_lock",
    add: "INSERT INTO mail_limit_use (limit_name, thread_lock, mails, pending, reserved_ms, sent_ms) \
          VALUES (?, ?, ?, ?, ?, NULL) ON DUPLICATE KEY UPDATE \
          mails = mails + VALUES(mails), pending = pending + VALUES(pending), sent_ms = NULL",
    sum_mails: "CAST(COALESCE(SUM(mails), 0) AS SIGNED)",
    reserve_within_bound: None,
};

static QUERIES: Queries = Queries {
    placeholder: |_| "?".to_string(),
    status_counts: portable::STATUS_COUNTS,
    status_ages: r#"
SELECT
    (SELECT TIMESTAMPDIFF(MICROSECOND, MIN(send_at), UTC_TIMESTAMP(6)) / 1e6 FROM mail_queue
      WHERE status = 'queued' AND send_at <= UTC_TIMESTAMP(6)) AS oldest_due,
    (SELECT COUNT(*) FROM mail_queue
      WHERE status = 'sending' AND locked_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) AS stale
"#,
    status_rates: r#"
SELECT
    CAST(COALESCE(SUM(CASE WHEN minute >= DATE_FORMAT(UTC_TIMESTAMP(6), '%Y-%m-%d %H:%i:00') - INTERVAL 1 MINUTE
                           THEN sent END), 0) AS SIGNED) AS sent_1m,
    CAST(COALESCE(SUM(CASE WHEN minute >= DATE_FORMAT(UTC_TIMESTAMP(6), '%Y-%m-%d %H:%i:00') - INTERVAL 5 MINUTE
                           THEN sent END), 0) AS SIGNED) AS sent_5m,
    CAST(COALESCE(SUM(sent), 0) AS SIGNED) AS sent_15m,
    CAST(COALESCE(SUM(attachment_bytes), 0) AS SIGNED) AS attachment_bytes_15m
FROM tablemail_minute
WHERE minute >= DATE_FORMAT(UTC_TIMESTAMP(6), '%Y-%m-%d %H:%i:00') - INTERVAL 15 MINUTE
"#,
    recent_failures: portable::RECENT_FAILURES,
    failure_groups: r#"
SELECT outcome, stage, smtp_code, COUNT(*) AS count, MAX(detail) AS example
FROM mail_event
WHERE at > UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND outcome IN ('retry', 'failed', 'unknown', 'deferred', 'released', 'stale')
GROUP BY outcome, stage, smtp_code
ORDER BY COUNT(*) DESC, outcome, stage, smtp_code
"#,
    load_content: r#"
SELECT from_name, from_address, to_address, cc, bcc, reply_to, subject, body, body_html,
       CAST(headers AS CHAR) AS headers, route, template,
       CAST(template_data AS CHAR) AS template_data, locale
FROM mail_queue WHERE id = ? AND thread_lock = ? AND status = 'sending'
"#,
    load_attachments: r#"
SELECT filename, content_type, content, content_id FROM mail_attachment
WHERE mail_id = ? ORDER BY id
"#,
    existing_dedupe: "SELECT id FROM mail_queue WHERE dedupe_key = ?",
    insert_attachment: r#"
INSERT INTO mail_attachment (mail_id, filename, content_type, content, content_id)
VALUES (?, ?, ?, ?, ?)
"#,
    retry_events: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, detail)
SELECT id, attempts, ?, 'operator', ? FROM mail_queue
WHERE status IN ('failed', 'unknown') AND id = COALESCE(?, id)
"#,
    retry: r#"
UPDATE mail_queue
SET status = 'queued', attempts_remaining = ?, send_at = UTC_TIMESTAMP(6),
    retried_at = UTC_TIMESTAMP(6), relay_down_count = 0, thread_lock = NULL, locked_at = NULL
WHERE status IN ('failed', 'unknown') AND id = COALESCE(?, id)
"#,
    cancel_event: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, detail)
SELECT id, attempts, ?, 'operator', ? FROM mail_queue WHERE id = ? AND status = 'queued'
"#,
    cancel: r#"
UPDATE mail_queue SET status = 'cancelled', processed_at = UTC_TIMESTAMP(6)
WHERE id = ? AND status = 'queued'
"#,
    release_claim: r#"
UPDATE mail_queue
SET status = 'queued', thread_lock = NULL, locked_at = NULL,
    attempts = attempts - 1, attempts_remaining = attempts_remaining + 1
WHERE thread_lock = ? AND status = 'sending'
"#,
    // Ids only: `MySql::purge` deletes them by id. The retention index is
    // keyed on `finished_status`, the row's status once it is finished and
    // NULL before (migration 0007): a claim and a retry leave its entry alone.
    purge_sent: r#"
SELECT id FROM mail_queue
WHERE finished_status = 'sent' AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY processed_at
LIMIT ?
"#,
    purge_failed: r#"
SELECT id FROM mail_queue
WHERE finished_status IN ('failed', 'cancelled')
  AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY processed_at
LIMIT ?
"#,
    purge_bounced: r#"
SELECT id FROM mail_queue
WHERE finished_status IN ('bounced', 'suppressed')
  AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY processed_at
LIMIT ?
"#,
    mail_columns: r#"
SELECT id, status, attempts, attempts_remaining, priority, created_at, send_at, processed_at,
       retried_at, bounced_at, message_id, dedupe_key, last_error, relay_reply, subject, from_name,
       from_address, to_address, cc, bcc, reply_to, body, body_html,
       CAST(headers AS CHAR) AS headers, route, template,
       CAST(template_data AS CHAR) AS template_data, locale
FROM mail_queue "#,
    attachments_of: r#"
SELECT filename, content_type, LENGTH(content) AS size, content_id
FROM mail_attachment WHERE mail_id = ? ORDER BY id
"#,
    events_of: r#"
SELECT at, attempt, outcome, stage, smtp_code, detail, recipient FROM mail_event
WHERE mail_id = ? ORDER BY id
"#,
    summary_columns: r#"
SELECT id, status, priority, attempts, created_at, send_at, processed_at, to_address, cc, bcc,
       subject, last_error
FROM mail_queue "#,
    daemon_upsert: r#"
INSERT INTO tablemail_daemon (id, host, pid, version, in_flight, sent)
VALUES (?, ?, ?, ?, ?, ?)
ON DUPLICATE KEY UPDATE
    last_seen = UTC_TIMESTAMP(6), in_flight = VALUES(in_flight), sent = VALUES(sent)
"#,
    minute_upsert: r#"
INSERT INTO tablemail_minute (minute, daemon_id, sent, failed, attachment_bytes)
VALUES (DATE_FORMAT(UTC_TIMESTAMP(6), '%Y-%m-%d %H:%i:00'), ?, ?, ?, ?)
ON DUPLICATE KEY UPDATE sent = sent + VALUES(sent), failed = failed + VALUES(failed),
    attachment_bytes = attachment_bytes + VALUES(attachment_bytes)
"#,
    daemons_forget:
        "DELETE FROM tablemail_daemon WHERE last_seen < UTC_TIMESTAMP(6) - INTERVAL 1 DAY",
    minutes_forget: "DELETE FROM tablemail_minute WHERE minute < UTC_TIMESTAMP(6) - INTERVAL 1 DAY",
    daemon_delete: "DELETE FROM tablemail_daemon WHERE id = ?",
    daemons: r#"
SELECT id, host, pid, version, started_at, last_seen, in_flight, sent,
       last_seen < UTC_TIMESTAMP(6) - INTERVAL ? SECOND AS silent
FROM tablemail_daemon ORDER BY started_at, id
"#,
    minutes: r#"
SELECT minute, CAST(SUM(sent) AS SIGNED) AS sent, CAST(SUM(failed) AS SIGNED) AS failed
FROM tablemail_minute
WHERE minute > DATE_FORMAT(UTC_TIMESTAMP(6), '%Y-%m-%d %H:%i:00') - INTERVAL ? MINUTE
GROUP BY minute ORDER BY minute
"#,
};

/// Locks these rows (sorted ids) in id order through the primary key, and
/// reads their id, status and lock.
async fn lock_by_id(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    ids: &[i64],
) -> Result<Vec<sqlx::mysql::MySqlRow>, sqlx::Error> {
    let sql = format!("{LOCK_BY_ID}{} ORDER BY id FOR UPDATE", in_list(ids.len()));
    bind_ids(sqlx::query(AssertSqlSafe(sql)), ids)
        .fetch_all(&mut **tx)
        .await
}

/// Writes the outcomes (chunks in id order) and their history rows. With
/// `whole`, stops at the first chunk whose rows are not all still the
/// batch's own and says so (false): the caller rolls back.
async fn write_outcomes(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    chunks: &[Vec<Finalize>],
    whole: bool,
) -> Result<bool, sqlx::Error> {
    for chunk in chunks {
        let json = finalize_rows_json(chunk);
        let done = sqlx::query(FINALIZE)
            .bind(json.clone())
            .execute(&mut **tx)
            .await?;
        // sqlx asks for rows matched (CLIENT_FOUND_ROWS), not rows changed.
        if whole && done.rows_affected() != chunk.len() as u64 {
            return Ok(false);
        }
        let with_history: Vec<i64> = chunk
            .iter()
            .filter(|w| w.event.is_some())
            .map(|w| w.id)
            .collect();
        if !with_history.is_empty() {
            let sql = format!("{FINALIZE_EVENTS}{}", in_list(with_history.len()));
            let insert = sqlx::query(AssertSqlSafe(sql)).bind(json);
            bind_ids(insert, &with_history).execute(&mut **tx).await?;
        }
    }
    Ok(true)
}

// The wake-up of an idle daemon (MariaDB has no NOTIFY): the newest row's
// id, read from the end of the primary key, changes with every INSERT that
// commits. A look costs the server one index dive whatever the table holds
// (a look for due rows in the pending index would pass over every
// scheduled row ahead of them). An insert that commits after a newer one
// that was already seen, and a retry whose time comes, are found by the
// claims of `worker.poll_interval`, as before.
const NEWEST: &str = "SELECT MAX(id) FROM mail_queue";

/// How deep a claim looks past rows other claims hold, in batches.
const HEAD_DEPTH: i64 = 64;

/// Locks up to `limit` due rows in claim order and returns their ids. The
/// head of the pending index is read without locks and its rows are locked
/// by id; rows other claims hold meanwhile (they look queued until those
/// commit) are passed over by reading a window twice as long, up to
/// [`HEAD_DEPTH`] batches.
///
/// No claim walks the index locking: such a walk locks the index entry of
/// every row it passes, also of rows it skips because another claim holds
/// them by id, and that claim's stamp then waits for it (a build that fell
/// back to the walk under contention drew deadlocks between two claims
/// that way, with four daemons on one table).
async fn pick(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    limit: i64,
) -> Result<Vec<i64>, sqlx::Error> {
    let wanted = usize::try_from(limit).unwrap_or(usize::MAX);
    let mut locked: Vec<i64> = Vec::new();
    let mut window = limit;
    let mut tried = std::collections::HashSet::new();
    loop {
        let head: Vec<i64> = sqlx::query_scalar(HEAD)
            .bind(window)
            .fetch_all(&mut **tx)
            .await?;
        // The rows not tried before, in claim order, locked a batch's
        // remainder at a time: no row is locked that the claim will not take.
        let mut fresh = head.iter().copied();
        while locked.len() < wanted {
            let chunk: Vec<i64> = fresh
                .by_ref()
                .filter(|id| tried.insert(*id))
                .take(wanted - locked.len())
                .collect();
            if chunk.is_empty() {
                break;
            }
            let sql = format!(
                "{LOCK_HEAD}{} ORDER BY id FOR UPDATE SKIP LOCKED",
                in_list(chunk.len())
            );
            for row in bind_ids(sqlx::query(AssertSqlSafe(sql)), &chunk)
                .fetch_all(&mut **tx)
                .await?
            {
                locked.push(row.try_get::<i64, _>(0)?);
            }
        }
        let deeper = window.saturating_mul(2);
        if locked.len() >= wanted
            || (head.len() as i64) < window
            || deeper > limit.saturating_mul(HEAD_DEPTH)
        {
            break;
        }
        window = deeper;
    }
    Ok(locked)
}

impl Dialect for MySql {
    type DB = sqlx::MySql;
    const BACKEND: Backend = Backend::Mysql;

    const QUERIES: &'static Queries = &QUERIES;
    const FEEDBACK: &'static FeedbackQueries = &FEEDBACK;
    const LIMITS: &'static LimitQueries = &LIMITS;
    const TEMPLATES: &'static TemplateQueries = &TEMPLATES;
    const UNIT: fn(Duration) -> i64 = shared::micros;

    async fn claim(c: &mut MySqlConnection, b: ClaimBinds) -> Result<Vec<QueuedMail>, sqlx::Error> {
        let mut tx = c.begin().await?;
        let ids = pick(&mut tx, b.limit).await?;
        if ids.is_empty() {
            tx.commit().await?;
            return Ok(Vec::new());
        }
        let list = in_list(ids.len());
        let stamp = sqlx::query(AssertSqlSafe(format!("{STAMP}{list}")))
            .bind(b.lock.to_string())
            .bind(b.domain.clone())
            .bind(b.domain);
        bind_ids(stamp, &ids).execute(&mut *tx).await?;
        let read = sqlx::query(AssertSqlSafe(format!("{READ_BACK}{list}")))
            .bind(b.inline_limit)
            .bind(b.max_age);
        let rows = bind_ids(read, &ids).fetch_all(&mut *tx).await?;
        let mails = rows::claimed(&rows, b.lock, rows::ClaimedText::Inline)?;
        // Nothing is sent unless this commit succeeds.
        tx.commit().await?;
        Ok(mails)
    }

    /// Most often every row is still the batch's own: the outcomes are
    /// written at once, each chunk's count of rows matched telling whether
    /// it found them all. When one did not (a lock was taken away), the
    /// transaction is rolled back and done again the careful way: the rows
    /// locked first, in id order, to see which are still ours (MariaDB's
    /// UPDATE reports no row ids), and only their outcomes written.
    async fn suppressed_among(
        c: &mut MySqlConnection,
        sql: &'static str,
        addresses: Vec<String>,
    ) -> Result<Vec<super::Suppressed>, sqlx::Error> {
        // A list of few lengths (`id_list_len`: why).
        let (addresses, places) = shared::padded_list(addresses, QUERIES.placeholder);
        let sql = format!("{sql}{places})");
        let mut query = sqlx::query_as(AssertSqlSafe(sql));
        for address in addresses {
            query = query.bind(address);
        }
        query.fetch_all(c).await
    }

    async fn finalize(
        c: &mut MySqlConnection,
        writes: Vec<Finalize>,
    ) -> Result<Vec<i64>, sqlx::Error> {
        let mut ids: Vec<i64> = writes.iter().map(|w| w.id).collect();
        ids.sort_unstable();
        // One statement per chunk of JSON small enough for the wire (each
        // outcome an array of about 70 bytes besides its texts, counted as
        // 85 for longer ids, statuses and delays; a history row's fields
        // about 30 more), in id order.
        let chunks = wire_chunks(writes, STATEMENT_BUDGET, 85, 40);
        let mut tx = c.begin().await?;
        if write_outcomes(&mut tx, &chunks, true).await? {
            tx.commit().await?;
            return Ok(ids);
        }
        tx.rollback().await?;

        let expected: std::collections::HashMap<i64, String> = chunks
            .iter()
            .flatten()
            .map(|w| (w.id, w.lock.to_string()))
            .collect();
        let mut tx = c.begin().await?;
        let mut written = Vec::with_capacity(ids.len());
        for row in lock_by_id(&mut tx, &ids).await? {
            let (id, status, lock): (i64, String, Option<String>) = (
                row.try_get("id")?,
                row.try_get("status")?,
                row.try_get("thread_lock")?,
            );
            if status == "sending" && lock.is_some_and(|l| expected.get(&id) == Some(&l)) {
                written.push(id);
            }
        }
        let ours: std::collections::HashSet<i64> = written.iter().copied().collect();
        let chunks: Vec<Vec<Finalize>> = chunks
            .into_iter()
            .map(|chunk| chunk.into_iter().filter(|w| ours.contains(&w.id)).collect())
            .filter(|chunk: &Vec<Finalize>| !chunk.is_empty())
            .collect();
        write_outcomes(&mut tx, &chunks, false).await?;
        tx.commit().await?;
        Ok(written)
    }

    async fn renew_locks(
        c: &mut MySqlConnection,
        held: Vec<(i64, BatchLock)>,
    ) -> Result<u64, sqlx::Error> {
        // One statement, in id order through the primary key (as the
        // outcomes are written), in a transaction of its own.
        let done = sqlx::query(RENEW).bind(held_json(&held)).execute(c).await?;
        Ok(done.rows_affected())
    }

    async fn release_stale_locks(
        c: &mut MySqlConnection,
        older_than: i64,
        spare: Vec<BatchLock>,
    ) -> Result<Vec<StaleRow>, sqlx::Error> {
        let mut tx = c.begin().await?;
        let picked = sqlx::query(PICK_STALE)
            .bind(older_than)
            .bind(locks_json(&spare))
            .fetch_all(&mut *tx)
            .await?;
        let stale = picked
            .iter()
            .map(StaleRow::from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let ids: Vec<i64> = stale.iter().map(|r| r.id).collect();
        // In pieces: a statement takes at most 65,535 parameters, and the
        // rows of many daemons gone at once could be more.
        for ids in ids.chunks(4096) {
            for sql in [RELEASE_STALE, STALE_EVENTS] {
                let statement = sqlx::query(AssertSqlSafe(format!("{sql}{}", in_list(ids.len()))));
                bind_ids(statement, ids).execute(&mut *tx).await?;
            }
        }
        tx.commit().await?;
        Ok(stale)
    }

    /// In two steps: the ids by a plain read, then the rows by id. A
    /// `DELETE … ORDER BY processed_at LIMIT n` walks the retention index
    /// locking, and the entry that ends its walk may be a row's that a claim
    /// is stamping at that moment: the claim, holding that row, waits for the
    /// entry, and the purge, holding the entry, for the row (an InnoDB
    /// deadlock seen with two daemons, when status led that index and the
    /// walk over failed rows ended at the first queued one).
    async fn purge(
        c: &mut MySqlConnection,
        kind: Finished,
        older_than: i64,
        limit: i64,
    ) -> Result<Option<u64>, sqlx::Error> {
        let (pick, delete) = match kind {
            Finished::Sent => (QUERIES.purge_sent, PURGE_SENT_BY_ID),
            Finished::FailedOrCancelled => (QUERIES.purge_failed, PURGE_FAILED_BY_ID),
            Finished::BouncedOrSuppressed => (QUERIES.purge_bounced, PURGE_BOUNCED_BY_ID),
        };
        let mut ids: Vec<i64> = sqlx::query_scalar(pick)
            .bind(older_than)
            .bind(limit)
            .fetch_all(&mut *c)
            .await?;
        if ids.is_empty() {
            return Ok(Some(0));
        }
        ids.sort_unstable();
        let sql = format!("{delete}{}", in_list(ids.len()));
        let statement = sqlx::query(AssertSqlSafe(sql)).bind(older_than);
        let done = bind_ids(statement, &ids).execute(&mut *c).await?;
        Ok(Some(done.rows_affected()))
    }

    async fn enqueue(
        c: &mut MySqlConnection,
        mails: Vec<NewMail>,
    ) -> Result<Vec<Enqueued>, sqlx::Error> {
        let mut tx = c.begin().await?;
        let mut out = Vec::with_capacity(mails.len());
        for mail in &mails {
            let query = insert_query(insert_columns(mail), |_, _| "?".into(), "");
            // MySQL has no ON CONFLICT DO NOTHING; a failed statement leaves
            // the transaction usable, so a taken key is looked up instead.
            let enqueued = match query.execute(&mut *tx).await {
                Ok(done) => {
                    let id = done.last_insert_id() as i64;
                    insert_attachments::<sqlx::MySql>(
                        &mut tx,
                        QUERIES.insert_attachment,
                        id,
                        &mail.attachments,
                    )
                    .await?;
                    Enqueued {
                        id,
                        duplicate: false,
                    }
                }
                Err(sqlx::Error::Database(e))
                    if e.is_unique_violation() && mail.dedupe_key.is_some() =>
                {
                    Enqueued {
                        id: sqlx::query_scalar(QUERIES.existing_dedupe)
                            .bind(mail.dedupe_key.as_deref())
                            .fetch_one(&mut *tx)
                            .await?,
                        duplicate: true,
                    }
                }
                Err(e) => return Err(e),
            };
            out.push(enqueued);
        }
        tx.commit().await?;
        Ok(out)
    }

    fn spawn_wakeup_listener(
        &self,
        shared: &Shared<sqlx::MySql>,
        wake: Arc<Notify>,
        cancel: CancellationToken,
    ) -> Option<&'static str> {
        let (options, deadline) = (self.options.clone(), shared.deadline);
        let every = self.look_every;
        tokio::spawn(async move {
            let mut looks = tokio::time::interval(every);
            looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // A connection of its own: a look is one round trip, without a
            // place to wait for in the pool nor a test on its way back.
            let mut conn: Option<MySqlConnection> = None;
            let mut last: Option<Option<i64>> = None;
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = looks.tick() => {}
                }
                let newest = tokio::time::timeout(deadline, async {
                    if conn.is_none() {
                        conn = Some(options.connect().await?);
                    }
                    let c = conn.as_mut().expect("connected");
                    sqlx::query_scalar::<_, Option<i64>>(NEWEST)
                        .fetch_one(c)
                        .await
                })
                .await;
                match newest {
                    Ok(Ok(newest)) => {
                        // The first reading wakes too: rows may have come
                        // before the watcher was watching.
                        if last != Some(newest) {
                            wake.notify_one();
                        }
                        last = Some(newest);
                    }
                    // The claim loop says what is wrong with the database;
                    // here, a new connection a second later, not ten.
                    Ok(Err(_)) | Err(_) => {
                        conn = None;
                        tokio::select! {
                            _ = cancel.cancelled() => break,
                            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        }
                    }
                }
            }
            // Said goodbye to, so that the server does not count (and log)
            // an aborted connection at every stop.
            if let Some(c) = conn {
                let _ = tokio::time::timeout(Duration::from_secs(1), c.close()).await;
            }
        });
        Some("newest_id")
    }
}
