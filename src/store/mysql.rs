//! MySQL 8 and MariaDB 10.6+: claims select ids `FOR UPDATE SKIP LOCKED` in a
//! short READ COMMITTED transaction (no gap locks in the way of applications'
//! INSERTs), stamp them with the batch GUID and read them back, since MariaDB
//! has no `UPDATE … RETURNING`. Finalize joins `JSON_TABLE` of the outcomes.
//! Times are UTC `DATETIME(6)`; there is no NOTIFY, so idle daemons poll.

use std::{borrow::Cow, str::FromStr, time::Duration};

use async_trait::async_trait;
use sqlx::{
    migrate::{Migration, MigrationType, Migrator},
    mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions},
    AssertSqlSafe, ConnectOptions, Executor, Row, SqlStr,
};
use uuid::Uuid;

use super::{
    finalize_json, millis, queue_stats, queued_mail_from_row, stale_rows, Backend, BatchLock,
    Claim, Enqueued, Finalize, Finished, NewMail, Param, QueueStats, QueuedMail, Result,
    RetrySelection, StaleRow, Store,
};

pub struct MySqlStore {
    pool: MySqlPool,
}

impl MySqlStore {
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self> {
        let options = MySqlConnectOptions::from_str(url)?
            .timezone(Some("+00:00".to_string()))
            .log_statements(tracing::log::LevelFilter::Trace)
            .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(1));
        let pool = MySqlPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(5))
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .await?;
                    Ok(())
                })
            })
            .connect_lazy_with(options);
        Ok(MySqlStore { pool })
    }

    fn migrator() -> Migrator {
        let migrations = vec![Migration::new(
            1,
            Cow::Borrowed("mail_queue"),
            MigrationType::Simple,
            SqlStr::from_static(include_str!("../../migrations/mysql/0001_mail_queue.sql")),
            false,
        )];
        let mut migrator = Migrator::with_migrations(migrations);
        migrator.dangerous_set_table_name("tablemail_migrations");
        migrator
    }
}

/// `?, ?, …` for an IN list of `n` values.
fn marks(n: usize) -> String {
    vec!["?"; n].join(", ")
}

const PICK_DUE: &str = r#"
SELECT id FROM mail_queue
WHERE status = 'queued' AND send_at <= UTC_TIMESTAMP(6)
ORDER BY priority DESC, send_at, id
LIMIT ?
FOR UPDATE SKIP LOCKED
"#;

const STAMP: &str = r#"
UPDATE mail_queue
SET status = 'sending',
    thread_lock = ?,
    locked_at = UTC_TIMESTAMP(6),
    attempts = attempts + 1,
    attempts_remaining = attempts_remaining - 1,
    message_id = COALESCE(message_id, CONCAT('<', ?, '.', id, '@', ?, '>'))
WHERE id IN
"#;

const READ_BACK: &str = r#"
SELECT id, priority, attempts, attempts_remaining, from_name, from_address, to_address,
       cc, bcc, reply_to, subject, body, body_html, CAST(headers AS CHAR) AS headers, message_id,
       created_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AS expired
FROM mail_queue WHERE id IN
"#;

const OWNED: &str = r#"
SELECT id, thread_lock FROM mail_queue WHERE status = 'sending' AND id IN
"#;

const FINALIZE: &str = r#"
UPDATE mail_queue AS m
JOIN JSON_TABLE(?, '$[*]' COLUMNS (
        id BIGINT PATH '$.id',
        lk VARCHAR(36) PATH '$.lock',
        st VARCHAR(16) PATH '$.status',
        delay_ms BIGINT PATH '$.delay_ms',
        err TEXT PATH '$.error',
        refund INT PATH '$.refund'
    )) AS f
  ON m.id = f.id AND m.thread_lock = f.lk AND m.status = 'sending'
SET m.send_at = CASE WHEN f.st = 'queued' AND f.refund = 0
                     THEN UTC_TIMESTAMP(6) + INTERVAL (f.delay_ms * 1000) MICROSECOND
                     ELSE m.send_at END,
    m.attempts = m.attempts - f.refund,
    m.attempts_remaining = m.attempts_remaining + f.refund,
    m.processed_at = CASE WHEN f.refund = 1 THEN m.processed_at ELSE UTC_TIMESTAMP(6) END,
    m.last_error = COALESCE(f.err, m.last_error),
    m.thread_lock = NULL,
    m.locked_at = NULL,
    m.status = f.st
"#;

const RENEW: &str = r#"
UPDATE mail_queue SET locked_at = UTC_TIMESTAMP(6)
WHERE status = 'sending' AND thread_lock IN
"#;

const PICK_STALE: &str = r#"
SELECT id, attempts_remaining > 0 AS requeued FROM mail_queue
WHERE status = 'sending' AND locked_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
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

const STATUS_COUNTS: &str = r#"
SELECT status, COUNT(*) AS count FROM mail_queue GROUP BY status ORDER BY status
"#;

const STATUS_AGES: &str = r#"
SELECT
    (SELECT TIMESTAMPDIFF(MICROSECOND, MIN(send_at), UTC_TIMESTAMP(6)) / 1e6 FROM mail_queue
      WHERE status = 'queued' AND send_at <= UTC_TIMESTAMP(6)) AS oldest_due,
    (SELECT COUNT(*) FROM mail_queue
      WHERE status = 'sending' AND locked_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) AS stale,
    (SELECT COUNT(*) FROM mail_queue
      WHERE status = 'sent' AND processed_at > UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE) AS sent_1m,
    (SELECT COUNT(*) FROM mail_queue
      WHERE status = 'sent' AND processed_at > UTC_TIMESTAMP(6) - INTERVAL 5 MINUTE) AS sent_5m,
    (SELECT COUNT(*) FROM mail_queue
      WHERE status = 'sent' AND processed_at > UTC_TIMESTAMP(6) - INTERVAL 15 MINUTE) AS sent_15m
"#;

const FAILURE_REASONS: &str = r#"
SELECT COALESCE(last_error, '') FROM mail_queue
WHERE status IN ('failed', 'unknown')
  AND processed_at > UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY processed_at DESC
LIMIT ?
"#;

const RECENT_FAILURES: &str = r#"
SELECT id, status, processed_at, last_error FROM mail_queue
WHERE status IN ('failed', 'unknown')
ORDER BY processed_at IS NULL, processed_at DESC, id DESC
LIMIT 10
"#;

const RETRY: &str = r#"
UPDATE mail_queue
SET status = 'queued', attempts_remaining = ?, send_at = UTC_TIMESTAMP(6),
    created_at = UTC_TIMESTAMP(6), thread_lock = NULL, locked_at = NULL
WHERE status IN ('failed', 'unknown') AND (? IS NULL OR id = ?)
"#;

const CANCEL: &str = r#"
UPDATE mail_queue SET status = 'cancelled', processed_at = UTC_TIMESTAMP(6)
WHERE id = ? AND status = 'queued'
"#;

const PURGE_SENT: &str = r#"
DELETE FROM mail_queue
WHERE status = 'sent' AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY processed_at
LIMIT ?
"#;

const PURGE_FAILED: &str = r#"
DELETE FROM mail_queue
WHERE status IN ('failed', 'cancelled') AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY processed_at
LIMIT ?
"#;

const EXISTING_DEDUPE: &str = "SELECT id FROM mail_queue WHERE dedupe_key = ?";

fn micros(d: Duration) -> i64 {
    millis(d).saturating_mul(1000)
}

#[async_trait]
impl Store for MySqlStore {
    fn backend(&self) -> Backend {
        Backend::Mysql
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
        let mut tx = self.pool.begin().await?;
        let ids: Vec<i64> = sqlx::query_scalar(PICK_DUE)
            .bind(claim.limit as i64)
            .fetch_all(&mut *tx)
            .await?;
        if ids.is_empty() {
            tx.commit().await?;
            return Ok(Vec::new());
        }
        let in_list = format!("({})", marks(ids.len()));
        let nonce = Uuid::new_v4().simple().to_string();
        let mut stamp = sqlx::query(AssertSqlSafe(format!("{STAMP}{in_list}")))
            .bind(claim.lock.to_string())
            .bind(nonce)
            .bind(claim.message_id_domain);
        for id in &ids {
            stamp = stamp.bind(*id);
        }
        stamp.execute(&mut *tx).await?;
        let mut read =
            sqlx::query(AssertSqlSafe(format!("{READ_BACK}{in_list}"))).bind(micros(claim.max_age));
        for id in &ids {
            read = read.bind(*id);
        }
        let rows = read.fetch_all(&mut *tx).await?;
        let mails = rows
            .iter()
            .map(|row| queued_mail_from_row(row, claim.lock))
            .collect::<Result<Vec<_>>>()?;
        // Nothing is sent unless this commit succeeds.
        tx.commit().await?;
        Ok(mails)
    }

    async fn finalize(&self, writes: &[Finalize]) -> Result<Vec<i64>> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.pool.begin().await?;
        let mut owned = sqlx::query(AssertSqlSafe(format!(
            "{OWNED}({}) FOR UPDATE",
            marks(writes.len())
        )));
        for w in writes {
            owned = owned.bind(w.id);
        }
        let held: std::collections::HashMap<i64, String> = owned
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| Ok((r.try_get("id")?, r.try_get("thread_lock")?)))
            .collect::<Result<_>>()?;
        let written: Vec<i64> = writes
            .iter()
            .filter(|w| held.get(&w.id).is_some_and(|l| *l == w.lock.to_string()))
            .map(|w| w.id)
            .collect();
        if !written.is_empty() {
            sqlx::query(FINALIZE)
                .bind(finalize_json(writes))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(written)
    }

    async fn renew_locks(&self, locks: &[BatchLock]) -> Result<u64> {
        if locks.is_empty() {
            return Ok(0);
        }
        let mut query = sqlx::query(AssertSqlSafe(format!("{RENEW}({})", marks(locks.len()))));
        for l in locks {
            query = query.bind(l.to_string());
        }
        Ok(query.execute(&self.pool).await?.rows_affected())
    }

    async fn release_stale_locks(&self, older_than: Duration) -> Result<Vec<StaleRow>> {
        let mut tx = self.pool.begin().await?;
        let picked = sqlx::query(PICK_STALE)
            .bind(micros(older_than))
            .fetch_all(&mut *tx)
            .await?;
        let stale = stale_rows(&picked)?;
        if !stale.is_empty() {
            let mut release = sqlx::query(AssertSqlSafe(format!(
                "{RELEASE_STALE}({})",
                marks(stale.len())
            )));
            for r in &stale {
                release = release.bind(r.id);
            }
            release.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(stale)
    }

    async fn enqueue(&self, mails: &[NewMail]) -> Result<Vec<Enqueued>> {
        let mut tx = self.pool.begin().await?;
        let mut out = Vec::with_capacity(mails.len());
        for mail in mails {
            let cols = mail.columns();
            let names: Vec<&str> = cols.iter().map(|(name, _)| *name).collect();
            let sql = format!(
                "INSERT INTO mail_queue ({}) VALUES ({})",
                names.join(", "),
                marks(cols.len())
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
            // MySQL has no ON CONFLICT DO NOTHING; a failed statement leaves
            // the transaction usable, so a taken key is looked up instead.
            let enqueued = match query.execute(&mut *tx).await {
                Ok(done) => Enqueued {
                    id: done.last_insert_id() as i64,
                    duplicate: false,
                },
                Err(sqlx::Error::Database(e))
                    if e.is_unique_violation() && mail.dedupe_key.is_some() =>
                {
                    Enqueued {
                        id: sqlx::query_scalar(EXISTING_DEDUPE)
                            .bind(mail.dedupe_key.as_deref())
                            .fetch_one(&mut *tx)
                            .await?,
                        duplicate: true,
                    }
                }
                Err(e) => return Err(e.into()),
            };
            out.push(enqueued);
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn stats(&self, lock_timeout: Duration) -> Result<QueueStats> {
        let counts = sqlx::query(STATUS_COUNTS).fetch_all(&self.pool).await?;
        let ages = sqlx::query(STATUS_AGES)
            .bind(micros(lock_timeout))
            .fetch_one(&self.pool)
            .await?;
        let failures = sqlx::query(RECENT_FAILURES).fetch_all(&self.pool).await?;
        queue_stats(&counts, &ages, &failures)
    }

    async fn failure_reasons(&self, within: Duration, limit: usize) -> Result<Vec<String>> {
        Ok(sqlx::query_scalar(FAILURE_REASONS)
            .bind(micros(within))
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64> {
        let id = which.id();
        let done = sqlx::query(RETRY)
            .bind(attempts)
            .bind(id)
            .bind(id)
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
            .bind(micros(older_than))
            .bind(limit as i64)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}
