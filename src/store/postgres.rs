//! PostgreSQL, the reference backend: claims with `FOR UPDATE SKIP LOCKED` in
//! one statement, finalizes many rows (and their history) in one fenced
//! statement, wakes idle daemons with LISTEN/NOTIFY, and vacuums the table
//! when autovacuum does not. Its SQL is most of its length: the statements
//! of every operation, each with its reason.

use std::{str::FromStr, sync::Arc, time::Duration};

use secrecy::ExposeSecret;
use sqlx::{
    postgres::{PgConnectOptions, PgConnection, PgListener, PgPoolOptions},
    ConnectOptions as _, Executor, Row,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{
    conns::{within, Conns, Reach, IDLE_TIMEOUT},
    dialect::{Dialect, SqlStore},
    finalize::{wire_chunks, FinalColumns, STATEMENT_BUDGET},
    insert::{self, Param},
    migrations::POSTGRES,
    rows::{self, inline_columns},
    shared::{self, portable, FeedbackQueries, LimitQueries, Queries, Shared},
    templates::{self, TemplateQueries},
    Backend, BatchLock, ClaimBinds, ConnectOptions, Enqueued, Finalize, Maintenance, NewMail,
    QueuedMail, Result, StaleRow, StoreError,
};

/// The NOTIFY channel the insert trigger of the migration signals.
const CHANNEL: &str = "tablemail";

/// PostgreSQL's own ways; it keeps the connect options for the wake-up
/// listener's connection, and the connection claims run on.
pub(crate) struct Postgres {
    options: PgConnectOptions,
    /// One connection, taken from `database.max_connections`, whose session
    /// plans once and without sorting or scanning a table whole (see
    /// [`CLAIM`]).
    claims: Conns<sqlx::Postgres>,
}

/// Builds the pool without connecting; the first query connects.
/// A server on this host (`localhost`, a loopback address or a Unix socket
/// directory), reached by a URL that does not say `sslmode`.
fn loopback_without_sslmode(url: &str, host: &str) -> bool {
    let named = url
        .split_once('?')
        .is_some_and(|(_, query)| query.split('&').any(|p| p.starts_with("sslmode=")));
    let host = host.trim_start_matches('[').trim_end_matches(']');
    !named
        && (host.eq_ignore_ascii_case("localhost")
            || host.starts_with('/')
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback()))
}

pub(crate) fn connect(url: &str, options: ConnectOptions) -> Result<SqlStore<Postgres>> {
    let mut connect = PgConnectOptions::from_str(url)?;
    if loopback_without_sslmode(url, connect.get_host()) {
        // No wire to protect, and TLS costs every connection two of the
        // server's delayed acknowledgements (sqlx's socket sends its
        // handshake with Nagle's algorithm on): about 80 ms for each
        // `tablemail ingest`, `status` or reconnect. A URL that names
        // `sslmode` is followed as written.
        connect = connect.ssl_mode(sqlx::postgres::PgSslMode::Disable);
    }
    if let Some(password) = &options.password {
        connect = connect.password(password.expose_secret());
    }
    let connect = connect
        .application_name("tablemail")
        // Our statements work on batches whose size is a parameter
        // (arrays of outcomes). A generic plan guesses that size and can
        // join a batch to the table by a sequential scan of the whole
        // table; a plan made for the real values costs a fraction of a
        // millisecond per batch and stays on the indexes.
        // (The claim is planned once, on a connection of its own: see
        // [`CLAIM`].)
        .options([("plan_cache_mode", "force_custom_plan")])
        // sqlx cannot set keepalive on its own socket; the server's side
        // of each connection can: a tablemail that vanished (a lost NAT
        // entry, a failed-over address) has its session, and any claim
        // transaction still open in it, ended within seconds instead of
        // the kernel's two hours. Our side is covered by the deadline on
        // every call.
        .options([
            ("tcp_keepalives_idle", "10"),
            ("tcp_keepalives_interval", "5"),
            ("tcp_keepalives_count", "3"),
        ])
        .log_statements(tracing::log::LevelFilter::Trace)
        .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(1));
    // Claims come one at a time from a daemon's claim loop: one connection
    // of the pool's number is theirs.
    let pool = Conns::new(
        connect.clone(),
        Reach::Network,
        options.max_connections.saturating_sub(1),
        IDLE_TIMEOUT,
        None,
    );
    // The claim's settings follow the shared ones in the startup options:
    // PostgreSQL applies them in order, so its `plan_cache_mode` wins.
    let claims = Conns::new(
        connect.clone().options([
            ("plan_cache_mode", "force_generic_plan"),
            ("enable_sort", "off"),
            ("enable_seqscan", "off"),
        ]),
        Reach::Network,
        1,
        IDLE_TIMEOUT,
        None,
    );
    Ok(SqlStore {
        shared: Shared::new::<Postgres>(pool, options.statement_timeout, POSTGRES, "BEGIN"),
        dialect: Postgres {
            options: connect,
            claims,
        },
    })
}

// The claim walks the pending index in claim order and stops after $1 rows,
// whatever the planner believes about the table, and it is planned once per
// connection. It runs on a connection of its own whose session (startup
// parameters) keeps one plan per statement (`plan_cache_mode =
// force_generic_plan`) and cannot sort or scan a table whole (`enable_sort`,
// `enable_seqscan` off). The statement is shaped so that the plan left is the
// one wanted for any table, a plan made while the table was empty or never
// analyzed included: the pending index read in order up to the batch, the
// rows it picked locked and then updated through the primary key (`id =
// ANY`, not a join: a join planned on a table of a few rows would scan the
// whole table for each picked row once it had grown). Without this, a
// backlog that arrived in a burst (before autoanalyze saw it: a few dozen
// queued rows by the statistics) would be fetched whole and sorted on every
// claim; a plan made anew for each claim would be a sizeable share of the
// claim's time. The claim is one statement, one round trip: as a
// transaction that set `enable_sort` locally (three round trips) it cost the
// server more CPU per mail. The other connections plan every statement for
// its values (see `connect`) and may sort and scan as the planner likes.
// Each row's text sizes are read once, by the update that claims it; the
// text columns come along only for rows within the inline limit ($6).
//
// (Migration 0003's `tablemail_due()` did the same inside a SQL function
// with `SET enable_sort = off`: planned anew in every claim and run through
// a tuplestore, a noticeable part of each claim's cost. It stays in the
// schema for daemons of earlier versions during a rolling upgrade.)
//
// A Message-ID is given at the first claim and derived from the row alone
// (a 64-bit hash of its id and its created_at, then the id and the domain;
// the claim's nonce $3 is not used): a claim lost with an asynchronous
// primary's last commits gives the mail the same Message-ID again when it is
// claimed anew, so a copy sent under the lost claim can still be matched to
// the new one. The hash is PostgreSQL's own for hash partitioning, of
// created_at as microseconds since the epoch (the session's TimeZone plays
// no part), cheaper than md5, whose cost per row was a noticeable part of
// a mail's database time.
//
// Attachments: their count and octets are probed per row, and not at all
// for a row newer than the newest mail with attachments (looked up once per
// claim, at the end of the attachment index): most queues carry none, and
// the probes were a tenth of the claim's cost. The probes are subqueries
// run only when that test passes (a row with attachments is probed twice,
// for the count and for the octets: rare, and cheaper than an aggregate for
// every row); a LATERAL join costs the server more per claim (an aggregate
// begun for every row, and one more join to plan).
const CLAIM: &str = concat!(
    r#"
WITH u AS (
    UPDATE mail_queue AS m
    SET status = 'sending',
        thread_lock = $2::uuid,
        locked_at = now(),
        attempts = m.attempts + 1,
        attempts_remaining = m.attempts_remaining - 1,
        message_id = COALESCE(m.message_id,
            '<' || lpad(to_hex(hashint8extended(m.id, interval_hash_extended(
                                    m.created_at - timestamptz 'epoch', 0))), 16, '0')
                || '.' || m.id || '@' || $4::text || '>')
    WHERE m.id = ANY (ARRAY(
        SELECT id FROM mail_queue
        WHERE status = 'queued' AND send_at <= now()
        ORDER BY priority DESC, send_at, id
        LIMIT $1
        FOR UPDATE SKIP LOCKED))
    RETURNING m.id, m.priority, m.attempts, m.attempts_remaining, m.relay_down_count,
        m.message_id,
        GREATEST(m.created_at, m.retried_at) < now() - $5 * interval '1 millisecond' AS expired,
        (COALESCE(octet_length(m.body), 0) + COALESCE(octet_length(m.body_html), 0)
         + COALESCE(octet_length(m.from_name), 0) + COALESCE(octet_length(m.from_address), 0)
         + octet_length(m.to_address) + COALESCE(octet_length(m.cc), 0)
         + COALESCE(octet_length(m.bcc), 0) + COALESCE(octet_length(m.reply_to), 0)
         + octet_length(m.subject) + COALESCE(pg_column_size(m.headers), 0)
         + COALESCE(pg_column_size(m.template_data), 0))::int8
            AS content_bytes,
        (COALESCE(octet_length(m.body), 0) + COALESCE(octet_length(m.body_html), 0))::int8
            AS body_bytes,
        m.id <= (SELECT max(y.mail_id) FROM mail_attachment AS y) AS may_have_attachments,
        m.from_name, m.from_address, m.to_address, m.cc, m.bcc, m.reply_to, m.subject,
        m.body, m.body_html, m.headers, m.route, m.template, m.template_data, m.locale
)
SELECT u.id, u.priority, u.attempts, u.attempts_remaining, u.relay_down_count, u.message_id,
    u.expired, u.content_bytes, u.body_bytes,
    CASE WHEN u.may_have_attachments
         THEN (SELECT count(*) FROM mail_attachment AS x WHERE x.mail_id = u.id)
         ELSE 0 END AS attachment_count,
    CASE WHEN u.may_have_attachments
         THEN (SELECT COALESCE(sum(octet_length(x.content)), 0)::int8
               FROM mail_attachment AS x WHERE x.mail_id = u.id)
         ELSE 0 END AS attachment_bytes,
    u.content_bytes <= $6 AS inline,
    "#,
    inline_columns!(
        "u.content_bytes <= $6",
        "u.",
        "u.headers::text",
        "u.template_data::text"
    ),
    "\nFROM u",
);

/// The group commit's UPDATE. The outcomes come sorted by id: rows are
/// locked in the same order as lock renewal locks them. The small columns
/// travel packed in `flags` (see [`flags`]): a group of a hundred outcomes
/// then fits one statement within [`STATEMENT_BUDGET`].
macro_rules! finalize {
    () => {
        r#"
UPDATE mail_queue AS m
SET status = f.status,
    send_at = CASE WHEN f.delay_ms >= 0 THEN now() + f.delay_ms * interval '1 millisecond'
                   ELSE m.send_at END,
    attempts = m.attempts - (f.flags & 1),
    attempts_remaining = m.attempts_remaining + (f.flags & 1),
    processed_at = CASE WHEN f.flags & 2 <> 0 THEN now() ELSE m.processed_at END,
    relay_down_count = CASE f.flags >> 2 WHEN 0 THEN 0
                                         WHEN 1 THEN m.relay_down_count + 1
                                         ELSE m.relay_down_count END,
    thread_lock = NULL,
    locked_at = NULL,
    last_error = COALESCE(f.last_error, m.last_error),
    relay_reply = COALESCE(f.relay_reply, m.relay_reply),
    relay_queue_id = COALESCE(f.relay_queue_id, m.relay_queue_id)
FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::bigint[], $5::text[], $6::int2[],
            $7::text[], $8::text[])
     AS f(id, lock, status, delay_ms, last_error, flags, relay_reply, relay_queue_id)
WHERE m.id = f.id AND m.thread_lock = f.lock AND m.status = 'sending'
RETURNING m.id
"#
    };
}

const FINALIZE: &str = finalize!();

// FINALIZE with the history rows of the group, written by the same
// statement for the rows it updated: a group that has none (every mail sent)
// keeps to the plain statement.
const FINALIZE_WITH_EVENTS: &str = concat!(
    "WITH done AS (",
    finalize!(),
    r#"), history AS (
    INSERT INTO mail_event (mail_id, attempt, outcome, stage, smtp_code, detail)
    SELECT e.id, e.attempt, e.outcome, e.stage, e.smtp_code, e.detail
    FROM unnest($9::bigint[], $10::int[], $11::text[], $12::text[], $13::int[], $14::text[])
         AS e(id, attempt, outcome, stage, smtp_code, detail)
    JOIN done ON done.id = e.id
)
SELECT id FROM done
"#
);

/// On the wire, per outcome of FINALIZE (binary arrays: a length word and
/// the value per element): id 12, lock 20, status up to 13, delay 12, flags
/// 6, and the length words of the three texts, 12.
const FINALIZE_FIXED: usize = 75;
/// And per history row: id 12, attempt 8, outcome up to 13, stage up to 14,
/// code 8, the detail's length word 4.
const FINALIZE_EVENT: usize = 59;

/// `refund` (bit 0), `processed` (bit 1) and what becomes of
/// `relay_down_count` (bits 2–3: reset, increment, keep) in one value.
fn flags(c: &FinalColumns<'_>) -> i16 {
    i16::from(c.refund) | i16::from(c.processed) << 1 | (c.relay_down as i16) << 2
}

const RENEW: &str = r#"
UPDATE mail_queue AS m SET locked_at = now()
FROM unnest($1::bigint[], $2::uuid[]) AS h(id, lock)
WHERE m.id = h.id AND m.thread_lock = h.lock AND m.status = 'sending'
"#;

const RELEASE_STALE: &str = r#"
WITH released AS (
    UPDATE mail_queue
    SET status = CASE WHEN attempts_remaining > 0 THEN 'queued' ELSE 'failed' END,
        processed_at = CASE WHEN attempts_remaining > 0 THEN processed_at ELSE now() END,
        last_error = CASE WHEN attempts_remaining > 0 THEN last_error
                          ELSE 'lock expired: the worker stopped during the last attempt' END,
        thread_lock = NULL,
        locked_at = NULL
    WHERE status = 'sending' AND locked_at < now() - $1 * interval '1 millisecond'
      AND thread_lock <> ALL($2::uuid[])
    RETURNING id, attempts, status = 'queued' AS requeued
), history AS (
    INSERT INTO mail_event (mail_id, attempt, outcome, stage, detail)
    SELECT id, attempts, 'stale', 'lock',
           CASE WHEN requeued THEN 'lock expired: the worker stopped during this attempt'
                ELSE 'lock expired: the worker stopped during the last attempt' END
    FROM released
)
SELECT id, requeued FROM released
"#;

/// The delivery loop's SQL (DESIGN §12).
static TEMPLATES: TemplateQueries = TemplateQueries {
    versions: templates::portable::VERSIONS,
    all: templates::portable::ALL,
    put: r#"
INSERT INTO mail_template (name, locale, subject, body, body_html, updated_at)
VALUES ($1, $2, $3, $4, $5, now())
ON CONFLICT (name, locale) DO UPDATE
SET subject = excluded.subject, body = excluded.body, body_html = excluded.body_html,
    updated_at = now()
"#,
};

static FEEDBACK: FeedbackQueries = FeedbackQueries {
    insert_feedback: r#"
INSERT INTO mail_feedback
    (source, mail_id, recipient, kind, status, diagnostic, matched, size, raw, event_key)
VALUES ($1, (SELECT id FROM mail_queue WHERE id = $2), $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (event_key) WHERE event_key IS NOT NULL DO NOTHING
"#,
    insert_report_event: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, smtp_code, detail, recipient)
SELECT id, attempts, $1, 'report', $2, $3, $4 FROM mail_queue WHERE id = $5
"#,
    insert_recipient_event: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, recipient, detail)
VALUES ($1, $2, $3, 'suppression', $4, $5)
"#,
    suppress_permanent: r#"
INSERT INTO mail_suppression (address, reason, detail, mail_id) VALUES ($1, $2, $3, $4)
ON CONFLICT (address) DO UPDATE
SET reason = excluded.reason, detail = excluded.detail, mail_id = excluded.mail_id,
    created_at = now(), expires_at = NULL
WHERE mail_suppression.expires_at IS NOT NULL
"#,
    suppress_until: r#"
INSERT INTO mail_suppression (address, reason, detail, mail_id, expires_at)
VALUES ($1, $2, $3, $4, now() + $5 * interval '1 millisecond')
ON CONFLICT (address) DO UPDATE
SET reason = excluded.reason, detail = excluded.detail, mail_id = excluded.mail_id,
    created_at = now(), expires_at = greatest(mail_suppression.expires_at, excluded.expires_at)
WHERE mail_suppression.expires_at IS NOT NULL
"#,
    suppress_manual: r#"
INSERT INTO mail_suppression (address, reason, detail, expires_at)
VALUES ($1, $2, $3, now() + $4 * interval '1 millisecond')
ON CONFLICT (address) DO UPDATE
SET reason = excluded.reason, detail = excluded.detail, mail_id = NULL,
    created_at = now(), expires_at = excluded.expires_at
"#,
    unsuppress: "DELETE FROM mail_suppression WHERE address = $1",
    soft_bounces: r#"
SELECT count(*) AS count FROM mail_feedback
WHERE recipient = $1 AND matched AND kind = 'soft_bounce'
  AND received_at > now() - $2 * interval '1 millisecond'
"#,
    hard_bounced: r#"
SELECT DISTINCT recipient FROM mail_feedback
WHERE mail_id = $1 AND matched AND kind = 'hard_bounce' AND recipient IS NOT NULL
"#,
    mark_bounced: r#"
UPDATE mail_queue SET status = 'bounced', bounced_at = now()
WHERE id = $1 AND status IN ('sent', 'unknown')
"#,
    target_columns: "SELECT id, status, message_id, to_address, cc, bcc FROM mail_queue WHERE ",
    left_out: r#"
SELECT DISTINCT e.recipient FROM mail_event AS e
JOIN mail_queue AS m ON m.id = e.mail_id AND e.attempt = m.attempts
WHERE e.mail_id = $1 AND e.outcome = 'suppressed' AND e.recipient IS NOT NULL
"#,
    // A join with the array, not `address = ANY ($1)`: each connection
    // plans every statement for its values (`plan_cache_mode`), and the
    // planner weighs each element of an `ANY` list on its own, which cost
    // more than the lookup.
    suppressed_among: r#"
SELECT s.address, s.reason FROM unnest($1::text[]) AS a(address)
JOIN mail_suppression AS s ON s.address = a.address
WHERE s.expires_at IS NULL OR s.expires_at > now()
"#,
    suppression_columns: r#"
SELECT address, reason, detail, mail_id, created_at, expires_at FROM mail_suppression WHERE 1 = 1"#,
    in_force: "(expires_at IS NULL OR expires_at > now())",
    feedback_counts: r#"
SELECT source, kind, count(*) AS count FROM mail_feedback
WHERE received_at > now() - $1 * interval '1 millisecond'
GROUP BY source, kind
"#,
    purge_feedback: r#"
DELETE FROM mail_feedback WHERE id IN (
    SELECT id FROM mail_feedback
    WHERE received_at < now() - $1 * interval '1 millisecond'
    ORDER BY received_at
    LIMIT $2
)
"#,
    purge_suppression: "DELETE FROM mail_suppression WHERE expires_at < now()",
};

static LIMITS: LimitQueries = LimitQueries {
    now: "(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
    ensure: "INSERT INTO mail_limit (name) VALUES ($1) ON CONFLICT DO NOTHING",
    lock_suffix: " FOR UPDATE",
    held_by: "q.thread_lock::text = mail_limit_use.thread_lock",
    add: "INSERT INTO mail_limit_use (limit_name, thread_lock, mails, pending, reserved_ms, sent_ms) \
          VALUES ($1, $2, $3, $4, $5, NULL) ON CONFLICT (limit_name, thread_lock) DO UPDATE \
          SET mails = mail_limit_use.mails + EXCLUDED.mails, \
          pending = mail_limit_use.pending + EXCLUDED.pending, sent_ms = NULL",
    sum_mails: "COALESCE(SUM(mails), 0)::bigint",
    reserve_within_bound: Some(
        "WITH b AS (UPDATE mail_limit SET bound = bound + $3 \
         WHERE name = $1 AND bound + $3 <= $4 \
         RETURNING bound, (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms), \
         i AS (INSERT INTO mail_limit_use (limit_name, thread_lock, mails, pending, reserved_ms, sent_ms) \
         SELECT $1, $2, $3, $3, now_ms, NULL FROM b \
         ON CONFLICT (limit_name, thread_lock) DO UPDATE \
         SET mails = mail_limit_use.mails + EXCLUDED.mails, \
         pending = mail_limit_use.pending + EXCLUDED.pending, sent_ms = NULL) \
         SELECT bound FROM b",
    ),
};

static QUERIES: Queries = Queries {
    placeholder: |i| format!("${i}"),
    status_counts: portable::STATUS_COUNTS,
    status_ages: r#"
SELECT
    (SELECT EXTRACT(EPOCH FROM now() - min(send_at))::float8 FROM mail_queue
      WHERE status = 'queued' AND send_at <= now()) AS oldest_due,
    (SELECT count(*) FROM mail_queue
      WHERE status = 'sending' AND locked_at < now() - $1 * interval '1 millisecond') AS stale
"#,
    status_rates: r#"
SELECT
    COALESCE(sum(sent) FILTER (WHERE minute >= date_trunc('minute', now()) - interval '1 minute'), 0)::int8 AS sent_1m,
    COALESCE(sum(sent) FILTER (WHERE minute >= date_trunc('minute', now()) - interval '5 minutes'), 0)::int8 AS sent_5m,
    COALESCE(sum(sent), 0)::int8 AS sent_15m,
    COALESCE(sum(attachment_bytes), 0)::int8 AS attachment_bytes_15m
FROM tablemail_minute WHERE minute >= date_trunc('minute', now()) - interval '15 minutes'
"#,
    recent_failures: portable::RECENT_FAILURES,
    failure_groups: r#"
SELECT outcome, stage, smtp_code, count(*) AS count, max(detail) AS example
FROM mail_event
WHERE at > now() - $1 * interval '1 millisecond' AND outcome IN ('retry', 'failed', 'unknown', 'deferred', 'released', 'stale')
GROUP BY outcome, stage, smtp_code
ORDER BY count(*) DESC, outcome, stage, smtp_code
"#,
    load_content: r#"
SELECT from_name, from_address, to_address, cc, bcc, reply_to, subject, body, body_html,
       headers::text AS headers, route, template, template_data::text AS template_data, locale
FROM mail_queue WHERE id = $1 AND thread_lock = $2::uuid AND status = 'sending'
"#,
    load_attachments: r#"
SELECT filename, content_type, content, content_id FROM mail_attachment
WHERE mail_id = $1 ORDER BY id
"#,
    existing_dedupe: "SELECT id FROM mail_queue WHERE dedupe_key = $1",
    insert_attachment: r#"
INSERT INTO mail_attachment (mail_id, filename, content_type, content, content_id)
VALUES ($1, $2, $3, $4, $5)
"#,
    retry_events: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, detail)
SELECT id, attempts, $1, 'operator', $2 FROM mail_queue
WHERE status IN ('failed', 'unknown') AND id = COALESCE($3, id)
"#,
    retry: r#"
UPDATE mail_queue
SET status = 'queued', attempts_remaining = $1, send_at = now(), retried_at = now(),
    relay_down_count = 0, thread_lock = NULL, locked_at = NULL
WHERE status IN ('failed', 'unknown') AND id = COALESCE($2, id)
"#,
    cancel_event: r#"
INSERT INTO mail_event (mail_id, attempt, outcome, stage, detail)
SELECT id, attempts, $1, 'operator', $2 FROM mail_queue WHERE id = $3 AND status = 'queued'
"#,
    cancel: r#"
UPDATE mail_queue SET status = 'cancelled', processed_at = now()
WHERE id = $1 AND status = 'queued'
"#,
    release_claim: r#"
UPDATE mail_queue
SET status = 'queued', thread_lock = NULL, locked_at = NULL,
    attempts = attempts - 1, attempts_remaining = attempts_remaining + 1
WHERE thread_lock = $1::uuid AND status = 'sending'
"#,
    // Two statements, each walking the retention index in order: an OR of the
    // two conditions made the planner scan the whole table.
    purge_sent: r#"
DELETE FROM mail_queue WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status = 'sent' AND processed_at < now() - $1 * interval '1 millisecond'
    ORDER BY processed_at
    LIMIT $2
)
"#,
    purge_failed: r#"
DELETE FROM mail_queue WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status IN ('failed', 'cancelled') AND processed_at < now() - $1 * interval '1 millisecond'
    ORDER BY processed_at
    LIMIT $2
)
"#,
    purge_bounced: r#"
DELETE FROM mail_queue WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status IN ('bounced', 'suppressed')
      AND processed_at < now() - $1 * interval '1 millisecond'
    ORDER BY processed_at
    LIMIT $2
)
"#,
    mail_columns: r#"
SELECT id, status, attempts, attempts_remaining, priority, created_at, send_at, processed_at,
       retried_at, bounced_at, message_id, dedupe_key, last_error, relay_reply, subject, from_name,
       from_address, to_address, cc, bcc, reply_to, body, body_html, headers::text AS headers,
       route, template, template_data::text AS template_data, locale
FROM mail_queue "#,
    attachments_of: r#"
SELECT filename, content_type, octet_length(content)::int8 AS size, content_id
FROM mail_attachment WHERE mail_id = $1 ORDER BY id
"#,
    events_of: r#"
SELECT at, attempt, outcome, stage, smtp_code, detail, recipient FROM mail_event
WHERE mail_id = $1 ORDER BY id
"#,
    summary_columns: r#"
SELECT id, status, priority, attempts, created_at, send_at, processed_at, to_address, cc, bcc,
       subject, last_error
FROM mail_queue "#,
    daemon_upsert: r#"
INSERT INTO tablemail_daemon (id, host, pid, version, in_flight, sent)
VALUES ($1::uuid, $2, $3, $4, $5, $6)
ON CONFLICT (id) DO UPDATE
SET last_seen = now(), in_flight = excluded.in_flight, sent = excluded.sent
"#,
    minute_upsert: r#"
INSERT INTO tablemail_minute (minute, daemon_id, sent, failed, attachment_bytes)
VALUES (date_trunc('minute', now()), $1::uuid, $2, $3, $4)
ON CONFLICT (minute, daemon_id) DO UPDATE
SET sent = tablemail_minute.sent + excluded.sent, failed = tablemail_minute.failed + excluded.failed,
    attachment_bytes = tablemail_minute.attachment_bytes + excluded.attachment_bytes
"#,
    daemons_forget: "DELETE FROM tablemail_daemon WHERE last_seen < now() - interval '1 day'",
    minutes_forget: "DELETE FROM tablemail_minute WHERE minute < now() - interval '1 day'",
    daemon_delete: "DELETE FROM tablemail_daemon WHERE id = $1::uuid",
    daemons: r#"
SELECT id::text AS id, host, pid, version, started_at, last_seen, in_flight, sent,
       last_seen < now() - $1 * interval '1 second' AS silent
FROM tablemail_daemon ORDER BY started_at, id
"#,
    minutes: r#"
SELECT minute, sum(sent)::int8 AS sent, sum(failed)::int8 AS failed FROM tablemail_minute
WHERE minute > date_trunc('minute', now()) - $1 * interval '1 minute'
GROUP BY minute ORDER BY minute
"#,
};

const DEAD_ROWS: &str = r#"
SELECT s.n_dead_tup, s.n_live_tup, current_setting('autovacuum') = 'on' AS autovacuum,
       EXTRACT(EPOCH FROM now() - GREATEST(s.last_autovacuum, s.last_vacuum))::float8 AS since_vacuum,
       pg_has_role(current_user, c.relowner, 'MEMBER') AS owner
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.relid = 'mail_queue'::regclass
"#;

/// One vacuum at a time across daemons (a session-level advisory lock).
const VACUUM_LOCK: &str = "SELECT pg_try_advisory_lock(7261736877)";
const VACUUM_UNLOCK: &str = "SELECT pg_advisory_unlock(7261736877)";

const NOTIFY: &str = "SELECT pg_notify($1, '')";

impl Dialect for Postgres {
    type DB = sqlx::Postgres;
    const BACKEND: Backend = Backend::Postgres;

    const QUERIES: &'static Queries = &QUERIES;
    const FEEDBACK: &'static FeedbackQueries = &FEEDBACK;
    const LIMITS: &'static LimitQueries = &LIMITS;
    const TEMPLATES: &'static TemplateQueries = &TEMPLATES;
    const UNIT: fn(Duration) -> i64 = shared::millis;

    async fn claim(c: &mut PgConnection, b: ClaimBinds) -> Result<Vec<QueuedMail>, sqlx::Error> {
        let lock = b.lock;
        let rows = b.bind(sqlx::query(CLAIM)).fetch_all(&mut *c).await?;
        rows::claimed(&rows, lock, rows::ClaimedText::Inline)
    }

    fn claim_pool<'a>(&'a self, _: &'a Shared<sqlx::Postgres>) -> &'a Conns<sqlx::Postgres> {
        &self.claims
    }

    async fn suppressed_among(
        c: &mut PgConnection,
        sql: &'static str,
        addresses: Vec<String>,
    ) -> Result<Vec<super::Suppressed>, sqlx::Error> {
        sqlx::query_as(sql).bind(addresses).fetch_all(c).await
    }

    async fn finalize(
        c: &mut PgConnection,
        writes: Vec<Finalize>,
    ) -> Result<Vec<i64>, sqlx::Error> {
        // A little room for the message's own words and the arrays'
        // headers.
        let mut chunks = wire_chunks(
            writes,
            STATEMENT_BUDGET - 512,
            FINALIZE_FIXED,
            FINALIZE_EVENT,
        );
        if chunks.len() == 1 {
            return finalize_chunk(c, chunks.pop().expect("one chunk")).await;
        }
        // In id order, chunk after chunk: rows are locked in one order.
        let mut tx = sqlx::Connection::begin(c).await?;
        let mut written = Vec::new();
        for chunk in chunks {
            written.extend(finalize_chunk(&mut tx, chunk).await?);
        }
        tx.commit().await?;
        Ok(written)
    }

    async fn renew_locks(
        c: &mut PgConnection,
        held: Vec<(i64, BatchLock)>,
    ) -> Result<u64, sqlx::Error> {
        let (ids, locks): (Vec<i64>, Vec<Uuid>) =
            held.iter().map(|(id, lock)| (*id, lock.0)).unzip();
        let done = sqlx::query(RENEW).bind(ids).bind(locks).execute(c).await?;
        Ok(done.rows_affected())
    }

    async fn release_stale_locks(
        c: &mut PgConnection,
        older_than: i64,
        spare: Vec<BatchLock>,
    ) -> Result<Vec<StaleRow>, sqlx::Error> {
        let spare: Vec<Uuid> = spare.iter().map(|l| l.0).collect();
        sqlx::query_as(RELEASE_STALE)
            .bind(older_than)
            .bind(spare)
            .fetch_all(c)
            .await
    }

    async fn enqueue(
        c: &mut PgConnection,
        mails: Vec<NewMail>,
    ) -> Result<Vec<Enqueued>, sqlx::Error> {
        let placeholder = |i, p: &Param<'_>| match p {
            Param::Json(_) => format!("${i}::jsonb"),
            _ => format!("${i}"),
        };
        insert::insert_returning::<sqlx::Postgres>(c, "BEGIN", mails, placeholder, &QUERIES).await
    }

    /// The rows are due now: wake the daemons as an INSERT would.
    async fn rows_due_now(c: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query(NOTIFY)
            .bind(CHANNEL)
            .execute(c)
            .await
            .map(|_| ())
    }

    async fn maintain(&self, shared: &Shared<sqlx::Postgres>) -> Result<Option<Maintenance>> {
        // VACUUM of a large table takes its time: a deadline of its own.
        let limit = shared.deadline.max(Duration::from_secs(600));
        within(&shared.pool, limit, |c| Box::pin(vacuum_if_needed(c))).await
    }

    fn spawn_wakeup_listener(
        &self,
        shared: &Shared<sqlx::Postgres>,
        wake: Arc<Notify>,
        cancel: CancellationToken,
    ) -> Option<&'static str> {
        let (options, deadline) = (self.options.clone(), shared.deadline);
        let pool = shared.pool.clone();
        tokio::spawn(async move {
            loop {
                if let Err(e) = listen(&options, &pool, deadline, &wake, &cancel).await {
                    tracing::warn!(error = %e, "wake-up listener lost, polling until it is back");
                }
                // Anything may have been inserted while we were not listening.
                wake.notify_one();
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        });
        Some("notify")
    }
}

/// One statement of outcomes (`writes` in id order).
async fn finalize_chunk(
    c: &mut PgConnection,
    writes: Vec<Finalize>,
) -> Result<Vec<i64>, sqlx::Error> {
    let cols = FinalizeArrays::of(&writes);
    let has_events = !cols.events.ids.is_empty();
    let sql = if has_events {
        FINALIZE_WITH_EVENTS
    } else {
        FINALIZE
    };
    let mut query = sqlx::query(sql)
        .bind(cols.ids)
        .bind(cols.locks)
        .bind(cols.statuses)
        .bind(cols.delays)
        .bind(cols.errors)
        .bind(cols.flags)
        .bind(cols.relay_replies)
        .bind(cols.relay_queue_ids);
    if has_events {
        let e = cols.events;
        query = query
            .bind(e.ids)
            .bind(e.attempts)
            .bind(e.outcomes)
            .bind(e.stages)
            .bind(e.codes)
            .bind(e.details);
    }
    let rows = query.fetch_all(c).await?;
    rows.iter().map(|r| r.try_get::<i64, _>(0)).collect()
}

struct FinalizeArrays<'a> {
    ids: Vec<i64>,
    locks: Vec<Uuid>,
    statuses: Vec<&'static str>,
    delays: Vec<i64>,
    errors: Vec<Option<&'a str>>,
    flags: Vec<i16>,
    relay_replies: Vec<Option<&'a str>>,
    relay_queue_ids: Vec<Option<&'a str>>,
    events: EventArrays<'a>,
}

/// The history rows FINALIZE_WITH_EVENTS unnests.
#[derive(Default)]
struct EventArrays<'a> {
    ids: Vec<i64>,
    attempts: Vec<i32>,
    outcomes: Vec<&'static str>,
    stages: Vec<Option<&'static str>>,
    codes: Vec<Option<i32>>,
    details: Vec<Option<&'a str>>,
}

impl<'a> FinalizeArrays<'a> {
    fn of(writes: &'a [Finalize]) -> Self {
        let n = writes.len();
        let mut a = FinalizeArrays {
            ids: Vec::with_capacity(n),
            locks: Vec::with_capacity(n),
            statuses: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            errors: Vec::with_capacity(n),
            flags: Vec::with_capacity(n),
            relay_replies: Vec::with_capacity(n),
            relay_queue_ids: Vec::with_capacity(n),
            events: EventArrays::default(),
        };
        for w in writes {
            let c = w.action.columns();
            a.ids.push(w.id);
            a.locks.push(w.lock.0);
            a.statuses.push(c.status);
            a.delays.push(c.delay_ms);
            a.errors.push(c.error);
            a.flags.push(flags(&c));
            a.relay_replies.push(w.relay_reply.as_deref());
            a.relay_queue_ids.push(w.relay_queue_id());
            if let Some(e) = w.event_columns() {
                a.events.ids.push(w.id);
                a.events.attempts.push(e.attempt);
                a.events.outcomes.push(e.outcome);
                a.events.stages.push(e.stage);
                a.events.codes.push(e.smtp_code);
                a.events.details.push(e.detail);
            }
        }
        a
    }
}

/// Vacuums `mail_queue` when dead rows pile up and autovacuum is off or far
/// behind, if this role owns the table, one daemon at a time.
async fn vacuum_if_needed(
    conn: &mut sqlx::PgConnection,
) -> Result<Option<Maintenance>, sqlx::Error> {
    let Some(stats) = sqlx::query(DEAD_ROWS).fetch_optional(&mut *conn).await? else {
        return Ok(None);
    };
    let dead: i64 = stats.try_get("n_dead_tup")?;
    let live: i64 = stats.try_get("n_live_tup")?;
    let autovacuum: bool = stats.try_get("autovacuum")?;
    let since: Option<f64> = stats.try_get("since_vacuum")?;
    let owner: bool = stats.try_get("owner")?;
    // Autovacuum normally keeps up; step in when it is off, or when it has
    // left a large share of dead rows for ten minutes.
    let behind = !autovacuum || since.is_none_or(|s| s > 600.0);
    if dead < 10_000 || dead < live / 5 || !behind {
        return Ok(None);
    }
    if !owner {
        // PostgreSQL would only warn and skip the table.
        return Ok(Some(Maintenance::CannotVacuum { dead_rows: dead }));
    }
    let locked: bool = sqlx::query_scalar(VACUUM_LOCK)
        .fetch_one(&mut *conn)
        .await?;
    if !locked {
        return Ok(None); // another daemon is at it
    }
    let vacuumed = conn.execute("VACUUM (ANALYZE) mail_queue").await;
    sqlx::query(VACUUM_UNLOCK).execute(&mut *conn).await?;
    vacuumed?;
    Ok(Some(Maintenance::Vacuumed {
        dead_rows: dead,
        autovacuum,
    }))
}

/// Listens until cancelled (Ok) or the listener fails (Err).
///
/// The listener has a connection of its own, outside the pool: when it breaks
/// on a silent network, sqlx's attempt to hand it back would hang. A heartbeat
/// (a NOTIFY on a channel of this listener's own, sent through the pool) proves
/// every few seconds that notifications still arrive; when one does not come
/// back within `deadline`, the listener is replaced.
async fn listen(
    options: &PgConnectOptions,
    pool: &Conns<sqlx::Postgres>,
    deadline: Duration,
    wake: &Notify,
    cancel: &CancellationToken,
) -> Result<()> {
    let own = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(deadline)
        .connect_lazy_with(options.clone());
    let mut listener = tokio::time::timeout(deadline, PgListener::connect_with(&own))
        .await
        .map_err(|_| StoreError::Timeout(deadline))??;
    let heartbeat = format!("tablemail_hb_{}", Uuid::new_v4().simple());
    tokio::time::timeout(deadline, listener.listen_all([CHANNEL, heartbeat.as_str()]))
        .await
        .map_err(|_| StoreError::Timeout(deadline))??;
    wake.notify_one();
    let every = (deadline / 2).clamp(Duration::from_secs(1), Duration::from_secs(15));
    let mut beat_sent: Option<tokio::time::Instant> = None;
    let mut next_beat = tokio::time::Instant::now() + every;
    loop {
        let overdue = beat_sent.map(|t| t + deadline);
        tokio::select! {
            _ = cancel.cancelled() => {
                // Its connection back to its pool (sqlx does that in a task
                // of its own) and closed politely, so that the server does
                // not count a lost client at every stop.
                drop(listener);
                let _ = tokio::time::timeout(Duration::from_secs(1), own.close()).await;
                return Ok(());
            }
            // `None` means the connection dropped and was re-established: a
            // notification may have been missed, so wake up either way.
            received = listener.try_recv() => match received? {
                Some(n) if n.channel() == heartbeat => beat_sent = None,
                _ => wake.notify_one(),
            },
            _ = tokio::time::sleep_until(next_beat), if beat_sent.is_none() => {
                next_beat = tokio::time::Instant::now() + every;
                let channel = heartbeat.clone();
                within(pool, deadline, |c| {
                    Box::pin(async move { sqlx::query(NOTIFY).bind(channel).execute(&mut *c).await.map(|_| ()) })
                })
                .await?;
                beat_sent = Some(tokio::time::Instant::now());
            }
            _ = tokio::time::sleep_until(overdue.unwrap_or(next_beat)), if overdue.is_some() => {
                return Err(StoreError::Timeout(deadline));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::loopback_without_sslmode;

    #[test]
    fn tls_is_left_out_only_on_this_host_and_only_when_the_url_is_silent() {
        for (url, host, expected) in [
            ("postgres://u@127.0.0.1/db", "127.0.0.1", true),
            ("postgres://u@localhost/db", "localhost", true),
            ("postgres://u@[::1]:5432/db", "[::1]", true),
            (
                "postgres://u@%2Frun%2Fpostgresql/db",
                "/run/postgresql",
                true,
            ),
            (
                "postgres://u@127.0.0.1/db?sslmode=require",
                "127.0.0.1",
                false,
            ),
            (
                "postgres://u@127.0.0.1/db?application_name=x&sslmode=prefer",
                "127.0.0.1",
                false,
            ),
            ("postgres://u@db.internal/db", "db.internal", false),
            ("postgres://u@10.0.0.5/db", "10.0.0.5", false),
        ] {
            assert_eq!(loopback_without_sslmode(url, host), expected, "{url}");
        }
    }
}
