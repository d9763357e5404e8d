//! PostgreSQL, the reference backend: claims with `FOR UPDATE SKIP LOCKED` in one
//! statement, finalizes many rows in one fenced statement, and wakes idle
//! daemons with LISTEN/NOTIFY.

use std::{borrow::Cow, str::FromStr, sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::{
    migrate::{Migration, MigrationType, Migrator},
    postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions},
    AssertSqlSafe, ConnectOptions, Row, SqlStr,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{
    millis, queue_stats, queued_mail_from_row, stale_rows, Backend, BatchLock, Claim, Enqueued,
    Finalize, Finished, Maintenance, NewMail, Param, QueueStats, QueuedMail, Result,
    RetrySelection, StaleRow, Store,
};

/// The NOTIFY channel the insert trigger of the migration signals.
const CHANNEL: &str = "tablemail";

pub struct PgStore {
    pool: PgPool,
}

impl PgStore {
    /// Builds the pool without connecting; the first query connects.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self> {
        let options = PgConnectOptions::from_str(url)?
            .application_name("tablemail")
            // Our statements work on batches whose size is a parameter
            // (LIMIT $1, arrays of outcomes). A generic plan guesses that size
            // and turned the claim into a hash join over a sequential scan of
            // the whole table; a plan made for the real values costs a
            // fraction of a millisecond per batch and stays on the indexes.
            .options([("plan_cache_mode", "force_custom_plan")])
            .log_statements(tracing::log::LevelFilter::Trace)
            .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(1));
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(options);
        Ok(PgStore { pool })
    }

    fn migrator() -> Migrator {
        let migrations = vec![Migration::new(
            1,
            Cow::Borrowed("mail_queue"),
            MigrationType::Simple,
            SqlStr::from_static(include_str!(
                "../../migrations/postgres/0001_mail_queue.sql"
            )),
            false,
        )];
        let mut migrator = Migrator::with_migrations(migrations);
        // Our own bookkeeping table, so an application's sqlx migrations in the
        // same schema never collide with ours.
        migrator.dangerous_set_table_name("tablemail_migrations");
        migrator
    }
}

const CLAIM: &str = r#"
WITH picked AS MATERIALIZED (
    SELECT id FROM mail_queue
    WHERE status = 'queued' AND send_at <= now()
    ORDER BY priority DESC, send_at, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE mail_queue AS m
SET status = 'sending',
    thread_lock = $2,
    locked_at = now(),
    attempts = m.attempts + 1,
    attempts_remaining = m.attempts_remaining - 1,
    message_id = COALESCE(m.message_id, '<' || $3::text || '.' || m.id || '@' || $4::text || '>')
FROM picked
WHERE m.id = picked.id
RETURNING m.id, m.priority, m.attempts, m.attempts_remaining, m.from_name, m.from_address,
          m.to_address, m.cc, m.bcc, m.reply_to, m.subject, m.body, m.body_html,
          m.headers::text AS headers, m.message_id,
          m.created_at < now() - $5 * interval '1 millisecond' AS expired
"#;

const FINALIZE: &str = r#"
UPDATE mail_queue AS m
SET status = f.status,
    send_at = CASE WHEN f.status = 'queued' AND NOT f.refund
                   THEN now() + f.delay_ms * interval '1 millisecond'
                   ELSE m.send_at END,
    attempts = m.attempts - f.refund::int,
    attempts_remaining = m.attempts_remaining + f.refund::int,
    processed_at = CASE WHEN f.refund THEN m.processed_at ELSE now() END,
    thread_lock = NULL,
    locked_at = NULL,
    last_error = COALESCE(f.last_error, m.last_error)
FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::bigint[], $5::text[], $6::bool[])
     AS f(id, lock, status, delay_ms, last_error, refund)
WHERE m.id = f.id AND m.thread_lock = f.lock AND m.status = 'sending'
RETURNING m.id
"#;

const RENEW: &str = r#"
UPDATE mail_queue SET locked_at = now()
WHERE status = 'sending' AND thread_lock = ANY($1)
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
RETURNING id, status = 'queued' AS requeued
"#;

const STATUS_COUNTS: &str = r#"
SELECT status, count(*) AS count FROM mail_queue GROUP BY status ORDER BY status
"#;

const STATUS_AGES: &str = r#"
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
"#;

const FAILURE_REASONS: &str = r#"
SELECT coalesce(last_error, '') FROM mail_queue
WHERE status IN ('failed', 'unknown') AND processed_at > now() - $1 * interval '1 millisecond'
ORDER BY processed_at DESC
LIMIT $2
"#;

const RECENT_FAILURES: &str = r#"
SELECT id, status, processed_at, last_error FROM mail_queue
WHERE status IN ('failed', 'unknown')
ORDER BY processed_at DESC NULLS LAST, id DESC
LIMIT 10
"#;

const RETRY: &str = r#"
UPDATE mail_queue
SET status = 'queued', attempts_remaining = $2, send_at = now(), created_at = now(),
    thread_lock = NULL, locked_at = NULL
WHERE status IN ('failed', 'unknown') AND ($1::bigint IS NULL OR id = $1)
"#;

const CANCEL: &str = r#"
UPDATE mail_queue SET status = 'cancelled', processed_at = now()
WHERE id = $1 AND status = 'queued'
"#;

// Two statements, each walking the retention index in order: an OR of the
// two conditions made the planner scan the whole table.
const PURGE_SENT: &str = r#"
DELETE FROM mail_queue WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status = 'sent' AND processed_at < now() - $1 * interval '1 millisecond'
    ORDER BY processed_at
    LIMIT $2
)
"#;

const PURGE_FAILED: &str = r#"
DELETE FROM mail_queue WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status IN ('failed', 'cancelled') AND processed_at < now() - $1 * interval '1 millisecond'
    ORDER BY processed_at
    LIMIT $2
)
"#;

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

const NOTIFY: &str = "SELECT pg_notify('tablemail', '')";

#[async_trait]
impl Store for PgStore {
    fn backend(&self) -> Backend {
        Backend::Postgres
    }

    async fn migrate(&self) -> Result<()> {
        Self::migrator().run(&self.pool).await?;
        Ok(())
    }

    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn claim_batch(&self, claim: &Claim<'_>) -> Result<Vec<QueuedMail>> {
        let nonce = Uuid::new_v4().simple().to_string();
        let rows = sqlx::query(CLAIM)
            .bind(claim.limit as i64)
            .bind(claim.lock.0)
            .bind(nonce)
            .bind(claim.message_id_domain)
            .bind(millis(claim.max_age))
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| queued_mail_from_row(row, claim.lock))
            .collect()
    }

    async fn finalize(&self, writes: &[Finalize]) -> Result<Vec<i64>> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let n = writes.len();
        let (mut ids, mut locks, mut statuses) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut delays, mut errors, mut refunds) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for w in writes {
            let (status, delay_ms, error, refund) = w.action.columns();
            ids.push(w.id);
            locks.push(w.lock.0);
            statuses.push(status);
            delays.push(delay_ms);
            errors.push(error);
            refunds.push(refund);
        }
        let rows = sqlx::query(FINALIZE)
            .bind(ids)
            .bind(locks)
            .bind(statuses)
            .bind(delays)
            .bind(errors)
            .bind(refunds)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| r.try_get::<i64, _>(0).map_err(Into::into))
            .collect()
    }

    async fn renew_locks(&self, locks: &[BatchLock]) -> Result<u64> {
        if locks.is_empty() {
            return Ok(0);
        }
        let locks: Vec<Uuid> = locks.iter().map(|l| l.0).collect();
        let done = sqlx::query(RENEW).bind(locks).execute(&self.pool).await?;
        Ok(done.rows_affected())
    }

    async fn release_stale_locks(&self, older_than: Duration) -> Result<Vec<StaleRow>> {
        let rows = sqlx::query(RELEASE_STALE)
            .bind(millis(older_than))
            .fetch_all(&self.pool)
            .await?;
        stale_rows(&rows)
    }

    async fn enqueue(&self, mails: &[NewMail]) -> Result<Vec<Enqueued>> {
        let mut tx = self.pool.begin().await?;
        let mut out = Vec::with_capacity(mails.len());
        for mail in mails {
            let cols = mail.columns();
            let names: Vec<&str> = cols.iter().map(|(name, _)| *name).collect();
            let placeholders: Vec<String> = cols
                .iter()
                .enumerate()
                .map(|(i, (_, p))| match p {
                    Param::Json(_) => format!("${}::jsonb", i + 1),
                    _ => format!("${}", i + 1),
                })
                .collect();
            let sql = format!(
                "INSERT INTO mail_queue ({}) VALUES ({}) \
                 ON CONFLICT (dedupe_key) DO NOTHING RETURNING id",
                names.join(", "),
                placeholders.join(", ")
            );
            let mut query = sqlx::query(AssertSqlSafe(sql));
            for (_, param) in cols {
                query = match param {
                    Param::Text(t) => query.bind(t.to_string()),
                    Param::Int(i) => query.bind(i),
                    Param::Time(t) => query.bind(t),
                    Param::Json(j) => query.bind(j),
                };
            }
            let inserted = query.fetch_optional(&mut *tx).await?;
            let enqueued = match inserted {
                Some(row) => Enqueued {
                    id: row.try_get(0)?,
                    duplicate: false,
                },
                None => {
                    let id: i64 = sqlx::query_scalar(EXISTING_DEDUPE)
                        .bind(mail.dedupe_key.as_deref())
                        .fetch_one(&mut *tx)
                        .await?;
                    Enqueued {
                        id,
                        duplicate: true,
                    }
                }
            };
            out.push(enqueued);
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn stats(&self, lock_timeout: Duration) -> Result<QueueStats> {
        let counts = sqlx::query(STATUS_COUNTS).fetch_all(&self.pool).await?;
        let ages = sqlx::query(STATUS_AGES)
            .bind(millis(lock_timeout))
            .fetch_one(&self.pool)
            .await?;
        let failures = sqlx::query(RECENT_FAILURES).fetch_all(&self.pool).await?;
        queue_stats(&counts, &ages, &failures)
    }

    async fn failure_reasons(&self, within: Duration, limit: usize) -> Result<Vec<String>> {
        Ok(sqlx::query_scalar(FAILURE_REASONS)
            .bind(millis(within))
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64> {
        let id = which.id();
        let done = sqlx::query(RETRY)
            .bind(id)
            .bind(attempts)
            .execute(&self.pool)
            .await?;
        if done.rows_affected() > 0 {
            sqlx::query(NOTIFY).execute(&self.pool).await?;
        }
        Ok(done.rows_affected())
    }

    async fn cancel(&self, id: i64) -> Result<u64> {
        let done = sqlx::query(CANCEL).bind(id).execute(&self.pool).await?;
        Ok(done.rows_affected())
    }

    async fn purge_finished(
        &self,
        kind: Finished,
        older_than: Duration,
        limit: usize,
    ) -> Result<u64> {
        let sql = match kind {
            Finished::Sent => PURGE_SENT,
            Finished::FailedOrCancelled => PURGE_FAILED,
        };
        let done = sqlx::query(sql)
            .bind(millis(older_than))
            .bind(limit as i64)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn maintain(&self) -> Result<Option<Maintenance>> {
        let stats = sqlx::query(DEAD_ROWS).fetch_optional(&self.pool).await?;
        let Some(stats) = stats else {
            return Ok(None);
        };
        let dead: i64 = stats.try_get("n_dead_tup")?;
        let live: i64 = stats.try_get("n_live_tup")?;
        let autovacuum: bool = stats.try_get("autovacuum")?;
        let since: Option<f64> = stats.try_get("since_vacuum")?;
        let owner: bool = stats.try_get("owner")?;
        // Autovacuum normally keeps up; step in when it is off, or when it
        // has left a large share of dead rows for ten minutes.
        let behind = !autovacuum || since.is_none_or(|s| s > 600.0);
        if dead < 10_000 || dead < live / 5 || !behind {
            return Ok(None);
        }
        if !owner {
            // PostgreSQL would only warn and skip the table.
            return Ok(Some(Maintenance::CannotVacuum { dead_rows: dead }));
        }
        let mut conn = self.pool.acquire().await?;
        let locked: bool = sqlx::query_scalar(VACUUM_LOCK)
            .fetch_one(&mut *conn)
            .await?;
        if !locked {
            return Ok(None); // another daemon is at it
        }
        let vacuumed = sqlx::query("VACUUM (ANALYZE) mail_queue")
            .execute(&mut *conn)
            .await;
        sqlx::query(VACUUM_UNLOCK).execute(&mut *conn).await?;
        vacuumed?;
        Ok(Some(Maintenance::Vacuumed {
            dead_rows: dead,
            autovacuum,
        }))
    }

    fn spawn_wakeup_listener(
        &self,
        wake: Arc<Notify>,
        cancel: CancellationToken,
    ) -> Option<&'static str> {
        let pool = self.pool.clone();
        tokio::spawn(async move {
            loop {
                if let Err(e) = listen(&pool, &wake, &cancel).await {
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

/// Listens until cancelled (Ok) or the listener fails (Err).
async fn listen(pool: &PgPool, wake: &Notify, cancel: &CancellationToken) -> Result<()> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(CHANNEL).await?;
    wake.notify_one();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            // `None` means the connection dropped and was re-established: a
            // notification may have been missed, so wake up either way.
            received = listener.try_recv() => {
                received?;
                wake.notify_one();
            }
        }
    }
}
