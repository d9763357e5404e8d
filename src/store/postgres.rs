//! PostgreSQL, the reference backend: claims with `FOR UPDATE SKIP LOCKED` in
//! one statement, finalizes many rows in one fenced statement, wakes idle
//! daemons with LISTEN/NOTIFY, and vacuums the table when autovacuum does not.
//! Its SQL is most of its length.

use std::{str::FromStr, sync::Arc, time::Duration};

use async_trait::async_trait;
use secrecy::ExposeSecret;
use sqlx::{
    postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions},
    ConnectOptions as _, Executor, Row,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{
    migrations::{self, POSTGRES},
    shared::{self, queued_mail, stale_rows, Common, Param, Queries, Shared},
    Backend, BatchLock, Claim, ConnectOptions, Enqueued, Finalize, Maintenance, NewMail,
    QueuedMail, Result, RetrySelection, StaleRow, Store, StoreError,
};

/// The NOTIFY channel the insert trigger of the migration signals.
const CHANNEL: &str = "tablemail";

pub struct PgStore {
    shared: Shared<sqlx::Postgres>,
    options: PgConnectOptions,
}

impl PgStore {
    /// Builds the pool without connecting; the first query connects.
    pub fn connect(url: &str, options: ConnectOptions) -> Result<Self> {
        let mut connect = PgConnectOptions::from_str(url)?;
        if let Some(password) = &options.password {
            connect = connect.password(password.expose_secret());
        }
        let connect = connect
            .application_name("tablemail")
            // Our statements work on batches whose size is a parameter
            // (LIMIT $1, arrays of outcomes). A generic plan guesses that size
            // and turned the claim into a hash join over a sequential scan of
            // the whole table; a plan made for the real values costs a
            // fraction of a millisecond per batch and stays on the indexes.
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
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.statement_timeout)
            .connect_lazy_with(connect.clone());
        Ok(PgStore {
            shared: Shared {
                pool,
                deadline: options.statement_timeout,
                queries: &QUERIES,
                unit: shared::millis,
                migrator: migrations::migrator(POSTGRES),
            },
            options: connect,
        })
    }
}

// `tablemail_due` (migration 0003) picks the rows in index order whatever the
// statistics say; the rows are then updated through the primary key.
const CLAIM: &str = r#"
UPDATE mail_queue AS m
SET status = 'sending',
    thread_lock = $2,
    locked_at = now(),
    attempts = m.attempts + 1,
    attempts_remaining = m.attempts_remaining - 1,
    message_id = COALESCE(m.message_id, '<' || $3::text || '.' || m.id || '@' || $4::text || '>')
WHERE m.id = ANY(ARRAY(SELECT tablemail_due($1::int)))
RETURNING m.id, m.priority, m.attempts, m.attempts_remaining, m.relay_down_count,
          m.from_name, m.from_address, m.to_address, m.cc, m.bcc, m.reply_to, m.subject,
          m.body, m.body_html, m.headers::text AS headers, m.message_id,
          m.created_at < now() - $5 * interval '1 millisecond' AS expired
"#;

// The outcomes come sorted by id: rows are locked in the same order as lock
// renewal locks them.
const FINALIZE: &str = r#"
UPDATE mail_queue AS m
SET status = f.status,
    send_at = CASE WHEN f.delay_ms >= 0 THEN now() + f.delay_ms * interval '1 millisecond'
                   ELSE m.send_at END,
    attempts = m.attempts - f.refund::int,
    attempts_remaining = m.attempts_remaining + f.refund::int,
    processed_at = CASE WHEN f.processed THEN now() ELSE m.processed_at END,
    relay_down_count = CASE f.relay_down WHEN 0 THEN 0
                                         WHEN 1 THEN m.relay_down_count + 1
                                         ELSE m.relay_down_count END,
    thread_lock = NULL,
    locked_at = NULL,
    last_error = COALESCE(f.last_error, m.last_error)
FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::bigint[], $5::text[], $6::bool[],
            $7::bool[], $8::int2[])
     AS f(id, lock, status, delay_ms, last_error, refund, processed, relay_down)
WHERE m.id = f.id AND m.thread_lock = f.lock AND m.status = 'sending'
RETURNING m.id
"#;

const RENEW: &str = r#"
UPDATE mail_queue AS m SET locked_at = now()
FROM unnest($1::bigint[], $2::uuid[]) AS h(id, lock)
WHERE m.id = h.id AND m.thread_lock = h.lock AND m.status = 'sending'
"#;

const RELEASE_STALE: &str = r#"
UPDATE mail_queue
SET status = CASE WHEN attempts_remaining > 0 THEN 'queued' ELSE 'failed' END,
    processed_at = CASE WHEN attempts_remaining > 0 THEN processed_at ELSE now() END,
    last_error = CASE WHEN attempts_remaining > 0 THEN last_error
                      ELSE 'lock expired: the worker stopped during the last attempt' END,
    thread_lock = NULL,
    locked_at = NULL
WHERE status = 'sending' AND locked_at < now() - $1 * interval '1 millisecond'
  AND thread_lock <> ALL($2::uuid[])
RETURNING id, status = 'queued' AS requeued
"#;

static QUERIES: Queries = Queries {
    status_counts: r#"
SELECT status, count(*) AS count FROM mail_queue GROUP BY status ORDER BY status
"#,
    status_ages: r#"
SELECT
    (SELECT EXTRACT(EPOCH FROM now() - min(send_at))::float8 FROM mail_queue
      WHERE status = 'queued' AND send_at <= now()) AS oldest_due,
    (SELECT count(*) FROM mail_queue
      WHERE status = 'sending' AND locked_at < now() - $1 * interval '1 millisecond') AS stale,
    (SELECT count(*) FROM mail_queue
      WHERE status = 'sent' AND processed_at > now() - interval '1 minute') AS sent_1m,
    (SELECT count(*) FROM mail_queue
      WHERE status = 'sent' AND processed_at > now() - interval '5 minutes') AS sent_5m,
    (SELECT count(*) FROM mail_queue
      WHERE status = 'sent' AND processed_at > now() - interval '15 minutes') AS sent_15m
"#,
    recent_failures: r#"
SELECT id, status, processed_at, last_error FROM mail_queue
WHERE status IN ('failed', 'unknown')
ORDER BY processed_at DESC NULLS LAST, id DESC
LIMIT 10
"#,
    failure_reasons: r#"
SELECT status, last_error FROM mail_queue
WHERE status IN ('failed', 'unknown', 'queued') AND last_error IS NOT NULL
  AND processed_at > now() - $1 * interval '1 millisecond'
ORDER BY processed_at DESC
LIMIT $2
"#,
    retry: r#"
UPDATE mail_queue
SET status = 'queued', attempts_remaining = $1, send_at = now(), created_at = now(),
    relay_down_count = 0, thread_lock = NULL, locked_at = NULL
WHERE status IN ('failed', 'unknown') AND id = COALESCE($2, id)
"#,
    cancel: r#"
UPDATE mail_queue SET status = 'cancelled', processed_at = now()
WHERE id = $1 AND status = 'queued'
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

const EXISTING_DEDUPE: &str = "SELECT id FROM mail_queue WHERE dedupe_key = $1";

const NOTIFY: &str = "SELECT pg_notify($1, '')";

#[async_trait]
impl Store for PgStore {
    fn backend(&self) -> Backend {
        Backend::Postgres
    }

    fn common(&self) -> &dyn Common {
        &self.shared
    }

    async fn claim_batch(&self, claim: &Claim<'_>) -> Result<Vec<QueuedMail>> {
        let b = claim.binds(shared::millis);
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let rows = sqlx::query(CLAIM)
                        .bind(b.limit)
                        .bind(b.lock.0)
                        .bind(b.nonce)
                        .bind(b.domain)
                        .bind(b.max_age)
                        .fetch_all(&mut *c)
                        .await?;
                    rows.iter().map(|row| queued_mail(row, b.lock)).collect()
                })
            })
            .await
    }

    async fn finalize(&self, writes: &[Finalize]) -> Result<Vec<i64>> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let mut sorted: Vec<&Finalize> = writes.iter().collect();
        sorted.sort_unstable_by_key(|w| w.id);
        let n = sorted.len();
        let mut cols = FinalizeArrays::with_capacity(n);
        for w in sorted {
            let c = w.action.columns();
            cols.ids.push(w.id);
            cols.locks.push(w.lock.0);
            cols.statuses.push(c.status);
            cols.delays.push(c.delay_ms);
            cols.errors.push(c.error.map(str::to_string));
            cols.refunds.push(c.refund);
            cols.processed.push(c.processed);
            cols.relay_down.push(c.relay_down as i16);
        }
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let rows = sqlx::query(FINALIZE)
                        .bind(cols.ids)
                        .bind(cols.locks)
                        .bind(cols.statuses)
                        .bind(cols.delays)
                        .bind(cols.errors)
                        .bind(cols.refunds)
                        .bind(cols.processed)
                        .bind(cols.relay_down)
                        .fetch_all(&mut *c)
                        .await?;
                    rows.iter().map(|r| r.try_get::<i64, _>(0)).collect()
                })
            })
            .await
    }

    async fn renew_locks(&self, held: &[(i64, BatchLock)]) -> Result<u64> {
        if held.is_empty() {
            return Ok(0);
        }
        let mut held = held.to_vec();
        held.sort_unstable_by_key(|(id, _)| *id);
        let ids: Vec<i64> = held.iter().map(|(id, _)| *id).collect();
        let locks: Vec<Uuid> = held.iter().map(|(_, lock)| lock.0).collect();
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let done = sqlx::query(RENEW)
                        .bind(ids)
                        .bind(locks)
                        .execute(&mut *c)
                        .await?;
                    Ok(done.rows_affected())
                })
            })
            .await
    }

    async fn release_stale_locks(
        &self,
        older_than: Duration,
        spare: &[BatchLock],
    ) -> Result<Vec<StaleRow>> {
        let older_than = shared::millis(older_than);
        let spare: Vec<Uuid> = spare.iter().map(|l| l.0).collect();
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let rows = sqlx::query(RELEASE_STALE)
                        .bind(older_than)
                        .bind(spare)
                        .fetch_all(&mut *c)
                        .await?;
                    stale_rows(&rows)
                })
            })
            .await
    }

    async fn enqueue(&self, mails: &[NewMail]) -> Result<Vec<Enqueued>> {
        let mails = mails.to_vec();
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let mut tx = sqlx::Connection::begin(&mut *c).await?;
                    let out = shared::insert_returning::<sqlx::Postgres>(
                        &mut tx,
                        &mails,
                        |i, p| match p {
                            Param::Json(_) => format!("${i}::jsonb"),
                            _ => format!("${i}"),
                        },
                        EXISTING_DEDUPE,
                    )
                    .await?;
                    tx.commit().await?;
                    Ok(out)
                })
            })
            .await
    }

    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64> {
        let done = self.shared.retry(which, attempts).await?;
        if done > 0 {
            // The rows are due now: wake the daemons as an INSERT would.
            self.shared
                .run(|c| {
                    Box::pin(async move {
                        sqlx::query(NOTIFY)
                            .bind(CHANNEL)
                            .execute(&mut *c)
                            .await
                            .map(|_| ())
                    })
                })
                .await?;
        }
        Ok(done)
    }

    async fn maintain(&self) -> Result<Option<Maintenance>> {
        // VACUUM of a large table takes its time: a deadline of its own.
        let limit = self.shared.deadline.max(Duration::from_secs(600));
        shared::within(&self.shared.pool, limit, |c| Box::pin(vacuum_if_needed(c))).await
    }

    fn spawn_wakeup_listener(
        &self,
        wake: Arc<Notify>,
        cancel: CancellationToken,
    ) -> Option<&'static str> {
        let (options, deadline) = (self.options.clone(), self.shared.deadline);
        let pool = self.shared.pool.clone();
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

/// The arrays FINALIZE unnests.
struct FinalizeArrays {
    ids: Vec<i64>,
    locks: Vec<Uuid>,
    statuses: Vec<&'static str>,
    delays: Vec<i64>,
    errors: Vec<Option<String>>,
    refunds: Vec<bool>,
    processed: Vec<bool>,
    relay_down: Vec<i16>,
}

impl FinalizeArrays {
    fn with_capacity(n: usize) -> Self {
        FinalizeArrays {
            ids: Vec::with_capacity(n),
            locks: Vec::with_capacity(n),
            statuses: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            errors: Vec::with_capacity(n),
            refunds: Vec::with_capacity(n),
            processed: Vec::with_capacity(n),
            relay_down: Vec::with_capacity(n),
        }
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
    pool: &PgPool,
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
            _ = cancel.cancelled() => return Ok(()),
            // `None` means the connection dropped and was re-established: a
            // notification may have been missed, so wake up either way.
            received = listener.try_recv() => match received? {
                Some(n) if n.channel() == heartbeat => beat_sent = None,
                _ => wake.notify_one(),
            },
            _ = tokio::time::sleep_until(next_beat), if beat_sent.is_none() => {
                next_beat = tokio::time::Instant::now() + every;
                let channel = heartbeat.clone();
                shared::within(pool, deadline, |c| {
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
