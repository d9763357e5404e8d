//! SQLite, the embedded default for one host: WAL mode, a busy timeout, and a
//! claim that is a single `UPDATE … WHERE id IN (SELECT … LIMIT n) RETURNING`
//! statement. SQLite runs one writer at a time, so two daemons on one file
//! can never claim the same row. There is no NOTIFY: a watcher polls
//! `PRAGMA data_version`, which changes when any other connection commits.

use std::{borrow::Cow, str::FromStr, sync::Arc, time::Duration};

use async_trait::async_trait;
use sqlx::{
    migrate::{Migration, MigrationType, Migrator},
    sqlite::{
        SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
        SqliteSynchronous,
    },
    AssertSqlSafe, ConnectOptions, Connection, Row, SqlStr,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{
    finalize_json, locks_json, millis, queue_stats, queued_mail_from_row, stale_rows, Backend,
    BatchLock, Claim, Enqueued, Finalize, Finished, NewMail, Param, QueueStats, QueuedMail, Result,
    RetrySelection, StaleRow, Store,
};

/// How often the watcher looks for commits of other connections.
const WATCH_EVERY: Duration = Duration::from_millis(25);

pub struct SqliteStore {
    pool: SqlitePool,
    options: SqliteConnectOptions,
}

impl SqliteStore {
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true)
            .log_statements(tracing::log::LevelFilter::Trace)
            .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(1));
        let pool = SqlitePoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(options.clone());
        Ok(SqliteStore { pool, options })
    }

    fn migrator() -> Migrator {
        let migrations = vec![Migration::new(
            1,
            Cow::Borrowed("mail_queue"),
            MigrationType::Simple,
            SqlStr::from_static(include_str!("../../migrations/sqlite/0001_mail_queue.sql")),
            false,
        )];
        let mut migrator = Migrator::with_migrations(migrations);
        migrator.dangerous_set_table_name("tablemail_migrations");
        migrator
    }
}

const CLAIM: &str = r#"
UPDATE mail_queue
SET status = 'sending',
    thread_lock = ?1,
    locked_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    attempts = attempts + 1,
    attempts_remaining = attempts_remaining - 1,
    message_id = COALESCE(message_id, '<' || ?2 || '.' || id || '@' || ?3 || '>')
WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status = 'queued' AND julianday(send_at) <= julianday('now')
    ORDER BY priority DESC, send_at, id
    LIMIT ?4
)
RETURNING id, priority, attempts, attempts_remaining, from_name, from_address, to_address,
          cc, bcc, reply_to, subject, body, body_html, headers, message_id,
          julianday(created_at) < julianday('now') - ?5 / 86400000.0 AS expired
"#;

const FINALIZE: &str = r#"
UPDATE mail_queue
SET status = f.status,
    send_at = CASE WHEN f.status = 'queued' AND NOT f.refund
                   THEN strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || (f.delay_ms / 1000.0) || ' seconds')
                   ELSE mail_queue.send_at END,
    attempts = mail_queue.attempts - f.refund,
    attempts_remaining = mail_queue.attempts_remaining + f.refund,
    processed_at = CASE WHEN f.refund THEN mail_queue.processed_at
                        ELSE strftime('%Y-%m-%d %H:%M:%f', 'now') END,
    thread_lock = NULL,
    locked_at = NULL,
    last_error = COALESCE(f.last_error, mail_queue.last_error)
FROM (
    SELECT value ->> '$.id' AS id, value ->> '$.lock' AS lock, value ->> '$.status' AS status,
           value ->> '$.delay_ms' AS delay_ms, value ->> '$.error' AS last_error,
           value ->> '$.refund' AS refund
    FROM json_each(?1)
) AS f
WHERE mail_queue.id = f.id AND mail_queue.thread_lock = f.lock AND mail_queue.status = 'sending'
RETURNING mail_queue.id
"#;

const RENEW: &str = r#"
UPDATE mail_queue SET locked_at = strftime('%Y-%m-%d %H:%M:%f', 'now')
WHERE status = 'sending' AND thread_lock IN (SELECT value FROM json_each(?1))
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
RETURNING id, status = 'queued' AS requeued
"#;

const STATUS_COUNTS: &str = r#"
SELECT status, count(*) AS count FROM mail_queue GROUP BY status ORDER BY status
"#;

const STATUS_AGES: &str = r#"
SELECT
    (SELECT (julianday('now') - julianday(min(send_at))) * 86400.0 FROM mail_queue
      WHERE status = 'queued' AND julianday(send_at) <= julianday('now')) AS oldest_due,
    (SELECT count(*) FROM mail_queue
      WHERE status = 'sending' AND julianday(locked_at) < julianday('now') - ?1 / 86400000.0) AS stale,
    (SELECT count(*) FROM mail_queue
      WHERE status = 'sent' AND julianday(processed_at) > julianday('now', '-1 minutes')) AS sent_1m,
    (SELECT count(*) FROM mail_queue
      WHERE status = 'sent' AND julianday(processed_at) > julianday('now', '-5 minutes')) AS sent_5m,
    (SELECT count(*) FROM mail_queue
      WHERE status = 'sent' AND julianday(processed_at) > julianday('now', '-15 minutes')) AS sent_15m
"#;

const FAILURE_REASONS: &str = r#"
SELECT coalesce(last_error, '') FROM mail_queue
WHERE status IN ('failed', 'unknown')
  AND julianday(processed_at) > julianday('now') - ?1 / 86400000.0
ORDER BY processed_at DESC
LIMIT ?2
"#;

const RECENT_FAILURES: &str = r#"
SELECT id, status, processed_at, last_error FROM mail_queue
WHERE status IN ('failed', 'unknown')
ORDER BY processed_at IS NULL, processed_at DESC, id DESC
LIMIT 10
"#;

const RETRY: &str = r#"
UPDATE mail_queue
SET status = 'queued', attempts_remaining = ?2,
    send_at = strftime('%Y-%m-%d %H:%M:%f', 'now'), created_at = strftime('%Y-%m-%d %H:%M:%f', 'now'),
    thread_lock = NULL, locked_at = NULL
WHERE status IN ('failed', 'unknown') AND (?1 IS NULL OR id = ?1)
"#;

const CANCEL: &str = r#"
UPDATE mail_queue SET status = 'cancelled', processed_at = strftime('%Y-%m-%d %H:%M:%f', 'now')
WHERE id = ?1 AND status = 'queued'
"#;

const PURGE_SENT: &str = r#"
DELETE FROM mail_queue WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status = 'sent' AND julianday(processed_at) < julianday('now') - ?1 / 86400000.0
    ORDER BY processed_at
    LIMIT ?2
)
"#;

const PURGE_FAILED: &str = r#"
DELETE FROM mail_queue WHERE id IN (
    SELECT id FROM mail_queue
    WHERE status IN ('failed', 'cancelled')
      AND julianday(processed_at) < julianday('now') - ?1 / 86400000.0
    ORDER BY processed_at
    LIMIT ?2
)
"#;

const EXISTING_DEDUPE: &str = "SELECT id FROM mail_queue WHERE dedupe_key = ?1";

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> Backend {
        Backend::Sqlite
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
            .bind(claim.lock.to_string())
            .bind(nonce)
            .bind(claim.message_id_domain)
            .bind(claim.limit as i64)
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
        let rows = sqlx::query(FINALIZE)
            .bind(finalize_json(writes))
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
        let done = sqlx::query(RENEW)
            .bind(locks_json(locks))
            .execute(&self.pool)
            .await?;
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
        // IMMEDIATE: take the write lock first, so the transaction never has
        // to upgrade a read snapshot (which SQLite refuses when busy).
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        let mut out = Vec::with_capacity(mails.len());
        for mail in mails {
            let cols = mail.columns();
            let names: Vec<&str> = cols.iter().map(|(name, _)| *name).collect();
            let placeholders: Vec<String> = cols
                .iter()
                .enumerate()
                .map(|(i, (_, p))| match p {
                    Param::Time(_) => format!("strftime('%Y-%m-%d %H:%M:%f', ?{})", i + 1),
                    _ => format!("?{}", i + 1),
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
                    Param::Time(t) => query.bind(t.format("%Y-%m-%d %H:%M:%S%.3f").to_string()),
                    Param::Json(j) => query.bind(j),
                };
            }
            let inserted = query.fetch_optional(&mut *tx).await?;
            let enqueued = match inserted {
                Some(row) => Enqueued {
                    id: row.try_get(0)?,
                    duplicate: false,
                },
                None => Enqueued {
                    id: sqlx::query_scalar(EXISTING_DEDUPE)
                        .bind(mail.dedupe_key.as_deref())
                        .fetch_one(&mut *tx)
                        .await?,
                    duplicate: true,
                },
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

    fn spawn_wakeup_listener(
        &self,
        wake: Arc<Notify>,
        cancel: CancellationToken,
    ) -> Option<&'static str> {
        let options = self.options.clone();
        tokio::spawn(async move {
            let mut conn: Option<SqliteConnection> = None;
            let mut last: Option<i64> = None;
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(WATCH_EVERY) => {}
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
                        // committed before the watcher was watching.
                        if last != Some(version) {
                            wake.notify_one();
                        }
                        last = Some(version);
                    }
                    Err(_) => conn = None,
                }
            }
        });
        Some("data_version")
    }
}
