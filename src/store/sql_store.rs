//! The one [`Store`], written once over any [`Dialect`]: every operation
//! runs under the deadline on a pooled connection; the claim, the group
//! commit, lock renewal and release and the insert are the dialect's, the rest
//! binds the dialect's SQL ([`Queries`](super::shared::Queries)) here.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{
    migrate::Migrate, AssertSqlSafe, ColumnIndex, Database, Decode, Executor, FromRow, Row, Type,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{
    conns::within,
    dialect::{Dialect, SqlStore},
    rows::{bind_all, list_conditions, lookup_condition, Bind, RowsAffected, SummaryRow},
    Attachment, Backend, BatchLock, Claim, DaemonBeat, DaemonRow, Enqueued, EventOutcome,
    FailureGroup, Finalize, Finished, MailContent, MailFilter, MailLookup, MailRecord, MailSummary,
    Maintenance, MinuteCount, NewMail, QueueStats, QueuedMail, Result, RetrySelection, StaleRow,
    Store, UnlockedRow, SILENT_AFTER_SECONDS,
};
use super::{room, Budget, CapAnswer, CapRequest, CapSettle, CapUse};
use super::{
    FeedbackCount, FeedbackKind, FeedbackRecord, FeedbackRecorded, FeedbackTarget, NewSuppression,
    RecipientEvent, Suppressed, SuppressionEntry, SuppressionFilter,
};
use super::{NewTemplate, TemplateRow, TemplateVersion};

#[async_trait]
impl<D: Dialect> Store for SqlStore<D>
where
    <D::DB as Database>::Connection: Migrate,
    <D::DB as Database>::QueryResult: RowsAffected,
    <D::DB as Database>::Arguments: sqlx::IntoArguments<D::DB>,
    for<'c> &'c mut <D::DB as Database>::Connection: Executor<'c, Database = D::DB>,
    for<'r> &'r str: ColumnIndex<<D::DB as Database>::Row>,
    usize: ColumnIndex<<D::DB as Database>::Row>,
    i64: Bind<D::DB>,
    i32: Bind<D::DB>,
    Option<i64>: Bind<D::DB>,
    String: Bind<D::DB>,
    Option<String>: Bind<D::DB>,
    Vec<u8>: Bind<D::DB>,
    bool: Bind<D::DB>,
    Option<i32>: Bind<D::DB>,
    Option<Vec<u8>>: Bind<D::DB>,
    for<'r> i64: Decode<'r, D::DB>,
    for<'r> i32: Decode<'r, D::DB>,
    for<'r> bool: Decode<'r, D::DB> + Type<D::DB>,
    for<'r> f64: Decode<'r, D::DB> + Type<D::DB>,
    for<'r> String: Decode<'r, D::DB> + Type<D::DB>,
    for<'r> Vec<u8>: Decode<'r, D::DB> + Type<D::DB>,
    for<'r> &'r [u8]: Decode<'r, D::DB>,
    for<'r> DateTime<Utc>: Decode<'r, D::DB> + Type<D::DB>,
    for<'r> Option<String>: Decode<'r, D::DB>,
{
    fn backend(&self) -> Backend {
        D::BACKEND
    }

    async fn claim_batch(&self, claim: &Claim<'_>) -> Result<Vec<QueuedMail>> {
        let binds = claim.binds(D::UNIT);
        let pool = self.dialect.claim_pool(&self.shared);
        within(pool, self.shared.deadline, move |c| {
            Box::pin(D::claim(c, binds))
        })
        .await
    }

    async fn finalize(&self, writes: &[Finalize]) -> Result<Vec<i64>> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let writes = writes.to_vec();
        self.shared
            .run(move |c| Box::pin(D::finalize(c, writes)))
            .await
    }

    async fn renew_locks(&self, held: &[(i64, BatchLock)]) -> Result<u64> {
        if held.is_empty() {
            return Ok(0);
        }
        let mut held = held.to_vec();
        held.sort_unstable_by_key(|(id, _)| *id);
        self.shared
            .run(move |c| Box::pin(D::renew_locks(c, held)))
            .await
    }

    async fn release_stale_locks(
        &self,
        older_than: Duration,
        spare: &[BatchLock],
    ) -> Result<Vec<StaleRow>> {
        let (older_than, spare) = ((D::UNIT)(older_than), spare.to_vec());
        self.shared
            .run(move |c| Box::pin(D::release_stale_locks(c, older_than, spare)))
            .await
    }

    async fn enqueue(&self, mails: &[NewMail]) -> Result<Vec<Enqueued>> {
        let mails = mails.to_vec();
        self.shared
            .run(move |c| Box::pin(D::enqueue(c, mails)))
            .await
    }

    async fn maintain(&self) -> Result<Option<Maintenance>> {
        self.dialect.maintain(&self.shared).await
    }

    fn spawn_wakeup_listener(
        &self,
        wake: Arc<Notify>,
        cancel: CancellationToken,
    ) -> Option<&'static str> {
        self.dialect
            .spawn_wakeup_listener(&self.shared, wake, cancel)
    }

    async fn migrate(&self) -> Result<()> {
        // No deadline: a migration may rewrite a large table; sqlx holds a
        // lock so that daemons starting together apply it once.
        let pool = self.shared.pool.one_off(self.shared.deadline);
        let applied = self.shared.migrator.run(&pool).await;
        let _ = tokio::time::timeout(self.shared.deadline, pool.close()).await;
        Ok(applied?)
    }

    async fn close(&self) {
        // The claims' pool may be the same pool: closing it twice is harmless.
        let claims = self.dialect.claim_pool(&self.shared);
        futures_util::future::join(self.shared.pool.close(), claims.close()).await;
    }

    async fn ping(&self) -> Result<()> {
        self.shared
            .run(|c| Box::pin(async move { c.execute("SELECT 1").await.map(|_| ()) }))
            .await
    }

    async fn release_claim(&self, lock: BatchLock) -> Result<u64> {
        let sql = self.shared.queries.release_claim;
        let released = self
            .shared
            .run(|c| {
                Box::pin(async move {
                    let done = sqlx::query(sql)
                        .bind(lock.to_string())
                        .execute(&mut *c)
                        .await?;
                    Ok(done.count())
                })
            })
            .await?;
        if released > 0 {
            self.shared.run(|c| Box::pin(D::rows_due_now(c))).await?;
        }
        Ok(released)
    }

    async fn unlocked_rows(&self, ids: &[i64]) -> Result<Vec<UnlockedRow>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        // A list of few lengths (`id_list_len`: why).
        let (ids, places) =
            super::shared::padded_list(ids.to_vec(), self.shared.queries.placeholder);
        let sql = format!(
            "SELECT id, status FROM mail_queue WHERE thread_lock IS NULL AND id IN ({places})"
        );
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql));
                    for id in ids {
                        query = query.bind(id);
                    }
                    query.fetch_all(&mut *c).await
                })
            })
            .await
    }

    async fn load_content(&self, id: i64, lock: BatchLock) -> Result<Option<MailContent>> {
        let sql = self.shared.queries.load_content;
        self.shared
            .run(|c| {
                Box::pin(async move {
                    sqlx::query_as(sql)
                        .bind(id)
                        .bind(lock.to_string())
                        .fetch_optional(&mut *c)
                        .await
                })
            })
            .await
    }

    async fn load_attachments(&self, id: i64) -> Result<Vec<Attachment>> {
        let sql = self.shared.queries.load_attachments;
        self.shared
            .run(|c| Box::pin(async move { sqlx::query_as(sql).bind(id).fetch_all(&mut *c).await }))
            .await
    }

    async fn stats(&self, lock_timeout: Duration) -> Result<QueueStats> {
        let (q, lock_timeout) = (self.shared.queries, (self.shared.unit)(lock_timeout));
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let counts = sqlx::query_as(q.status_counts).fetch_all(&mut *c).await?;
                    let ages = sqlx::query(q.status_ages)
                        .bind(lock_timeout)
                        .fetch_one(&mut *c)
                        .await?;
                    let rates = sqlx::query(q.status_rates).fetch_one(&mut *c).await?;
                    let recent_failures =
                        sqlx::query_as(q.recent_failures).fetch_all(&mut *c).await?;
                    Ok(QueueStats {
                        counts,
                        oldest_due_age_seconds: ages.try_get("oldest_due")?,
                        stale_locks: ages.try_get("stale")?,
                        sent_last_1m: rates.try_get("sent_1m")?,
                        sent_last_5m: rates.try_get("sent_5m")?,
                        sent_last_15m: rates.try_get("sent_15m")?,
                        attachment_bytes_last_15m: rates.try_get("attachment_bytes_15m")?,
                        recent_failures,
                    })
                })
            })
            .await
    }

    async fn failure_groups(&self, within: Duration) -> Result<Vec<FailureGroup>> {
        let (sql, within) = (
            self.shared.queries.failure_groups,
            (self.shared.unit)(within),
        );
        self.shared
            .run(|c| {
                Box::pin(async move { sqlx::query_as(sql).bind(within).fetch_all(&mut *c).await })
            })
            .await
    }

    async fn retry(&self, which: RetrySelection, attempts: i32) -> Result<u64> {
        let (q, begin) = (self.shared.queries, self.shared.begin_write);
        let done = self
            .shared
            .run(|c| {
                Box::pin(async move {
                    let mut tx = sqlx::Connection::begin_with(&mut *c, begin).await?;
                    // The history first, then the rows it speaks of, in one
                    // transaction.
                    sqlx::query(q.retry_events)
                        .bind(EventOutcome::Retried.as_str().to_string())
                        .bind(format!(
                            "queued again by tablemail retry with {attempts} attempts"
                        ))
                        .bind(which.id())
                        .execute(&mut *tx)
                        .await?;
                    let done = sqlx::query(q.retry)
                        .bind(attempts)
                        .bind(which.id())
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(done.count())
                })
            })
            .await?;
        if done > 0 {
            self.shared.run(|c| Box::pin(D::rows_due_now(c))).await?;
        }
        Ok(done)
    }

    async fn cancel(&self, id: i64) -> Result<u64> {
        let (q, begin) = (self.shared.queries, self.shared.begin_write);
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let mut tx = sqlx::Connection::begin_with(&mut *c, begin).await?;
                    sqlx::query(q.cancel_event)
                        .bind(EventOutcome::Cancelled.as_str().to_string())
                        .bind("cancelled by tablemail cancel".to_string())
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                    let done = sqlx::query(q.cancel).bind(id).execute(&mut *tx).await?;
                    tx.commit().await?;
                    Ok(done.count())
                })
            })
            .await
    }

    async fn purge(&self, sent: Duration, failed: Duration, limit: usize) -> Result<u64> {
        let mut deleted = 0;
        for (kind, age) in [
            (Finished::Sent, sent),
            (Finished::FailedOrCancelled, failed),
            (Finished::BouncedOrSuppressed, failed),
        ] {
            let left = limit as u64 - deleted;
            if left == 0 {
                break;
            }
            let sql = match kind {
                Finished::Sent => self.shared.queries.purge_sent,
                Finished::FailedOrCancelled => self.shared.queries.purge_failed,
                Finished::BouncedOrSuppressed => self.shared.queries.purge_bounced,
            };
            let older_than = (self.shared.unit)(age);
            deleted += self
                .shared
                .run(|c| {
                    Box::pin(async move {
                        if let Some(n) = D::purge(c, kind, older_than, left as i64).await? {
                            return Ok(n);
                        }
                        let done = sqlx::query(sql)
                            .bind(older_than)
                            .bind(left as i64)
                            .execute(&mut *c)
                            .await?;
                        Ok(done.count())
                    })
                })
                .await?;
        }
        Ok(deleted)
    }

    async fn find_mail(&self, lookup: &MailLookup, content: bool) -> Result<Option<MailRecord>> {
        let q = self.shared.queries;
        let (condition, params) = lookup_condition(lookup, q.placeholder);
        let sql = format!("{}{condition}", q.mail_columns);
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let query = bind_all(sqlx::query(sqlx::AssertSqlSafe(sql)), params);
                    let record = query
                        .try_map(|r: <D::DB as Database>::Row| MailRecord::from_row(&r))
                        .fetch_optional(&mut *c)
                        .await?;
                    let Some(mut record) = record else {
                        return Ok(None);
                    };
                    if !content {
                        record.content = None;
                    }
                    record.attachments = sqlx::query_as(q.attachments_of)
                        .bind(record.id)
                        .fetch_all(&mut *c)
                        .await?;
                    record.events = sqlx::query_as(q.events_of)
                        .bind(record.id)
                        .fetch_all(&mut *c)
                        .await?;
                    Ok(Some(record))
                })
            })
            .await
    }

    async fn list_mails(&self, filter: &MailFilter, limit: usize) -> Result<Vec<MailSummary>> {
        let q = self.shared.queries;
        let (condition, params) = list_conditions(filter, q.placeholder);
        let sql = format!(
            "{}{condition} ORDER BY id DESC LIMIT {}",
            q.summary_columns,
            limit.min(1000)
        );
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let query = bind_all(sqlx::query(sqlx::AssertSqlSafe(sql)), params);
                    let rows = query
                        .try_map(|r: <D::DB as Database>::Row| SummaryRow::from_row(&r))
                        .fetch_all(&mut *c)
                        .await?;
                    Ok(rows.into_iter().map(MailSummary::from).collect())
                })
            })
            .await
    }

    async fn heartbeat(&self, beat: &DaemonBeat) -> Result<()> {
        let q = self.shared.queries;
        let beat = beat.clone();
        self.shared
            .run(|c| {
                Box::pin(async move {
                    sqlx::query(q.daemon_upsert)
                        .bind(beat.id.to_string())
                        .bind(beat.host)
                        .bind(beat.pid)
                        .bind(beat.version)
                        .bind(beat.in_flight)
                        .bind(beat.sent_total)
                        .execute(&mut *c)
                        .await?;
                    if beat.sent_since > 0 || beat.failed_since > 0 {
                        sqlx::query(q.minute_upsert)
                            .bind(beat.id.to_string())
                            .bind(beat.sent_since)
                            .bind(beat.failed_since)
                            .bind(beat.attachment_bytes_since)
                            .execute(&mut *c)
                            .await?;
                    }
                    // Small tables (a row per daemon, a row per daemon-minute):
                    // forgetting what is a day old costs next to nothing.
                    sqlx::query(q.daemons_forget).execute(&mut *c).await?;
                    sqlx::query(q.minutes_forget).execute(&mut *c).await?;
                    Ok(())
                })
            })
            .await
    }

    async fn daemon_stopped(&self, id: uuid::Uuid) -> Result<()> {
        let sql = self.shared.queries.daemon_delete;
        self.shared
            .run(|c| {
                Box::pin(async move {
                    sqlx::query(sql)
                        .bind(id.to_string())
                        .execute(&mut *c)
                        .await
                        .map(|_| ())
                })
            })
            .await
    }

    async fn daemons(&self) -> Result<Vec<DaemonRow>> {
        let sql = self.shared.queries.daemons;
        self.shared
            .run(|c| {
                Box::pin(async move {
                    sqlx::query_as(sql)
                        .bind(SILENT_AFTER_SECONDS)
                        .fetch_all(&mut *c)
                        .await
                })
            })
            .await
    }

    async fn minutes(&self, minutes: u32) -> Result<Vec<MinuteCount>> {
        let sql = self.shared.queries.minutes;
        self.shared
            .run(|c| {
                Box::pin(async move {
                    sqlx::query_as(sql)
                        .bind(i64::from(minutes))
                        .fetch_all(&mut *c)
                        .await
                })
            })
            .await
    }

    async fn suppressed_among(&self, addresses: &[String]) -> Result<Vec<Suppressed>> {
        if addresses.is_empty() {
            return Ok(Vec::new());
        }
        let (sql, addresses) = (self.shared.feedback.suppressed_among, addresses.to_vec());
        self.shared
            .run(move |c| Box::pin(D::suppressed_among(c, sql, addresses)))
            .await
    }

    async fn queued_routes(&self) -> Result<Vec<String>> {
        self.shared
            .run(|c| {
                Box::pin(async move {
                    sqlx::query_scalar(super::shared::portable::QUEUED_ROUTES)
                        .fetch_all(&mut *c)
                        .await
                })
            })
            .await
    }

    async fn bypassing_suppression(&self, ids: &[i64]) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let (ids, places) =
            super::shared::padded_list(ids.to_vec(), self.shared.queries.placeholder);
        let sql =
            format!("SELECT id FROM mail_queue WHERE bypass_suppression AND id IN ({places})");
        self.shared
            .run(|c| {
                Box::pin(async move {
                    let mut query = sqlx::query_scalar(sqlx::AssertSqlSafe(sql));
                    for id in ids {
                        query = query.bind(id);
                    }
                    let mut found: Vec<i64> = query.fetch_all(&mut *c).await?;
                    found.dedup();
                    Ok(found)
                })
            })
            .await
    }

    async fn add_recipient_events(&self, events: &[RecipientEvent]) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let (sql, begin, events) = (
            self.shared.feedback.insert_recipient_event,
            self.shared.begin_write,
            events.to_vec(),
        );
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let mut tx = sqlx::Connection::begin_with(&mut *c, begin).await?;
                    for e in events {
                        sqlx::query(sql)
                            .bind(e.mail_id)
                            .bind(e.attempt)
                            .bind(e.outcome.to_string())
                            .bind(e.recipient)
                            .bind(e.detail)
                            .execute(&mut *tx)
                            .await?;
                    }
                    tx.commit().await
                })
            })
            .await
    }

    async fn feedback_target(&self, id: i64) -> Result<Option<FeedbackTarget>> {
        let f = self.shared.feedback;
        let sql = format!(
            "{}id = {}",
            f.target_columns,
            (self.shared.queries.placeholder)(1)
        );
        self.target(sql, Bound::Id(id)).await
    }

    async fn feedback_target_by_queue_id(&self, queue_id: &str) -> Result<Option<FeedbackTarget>> {
        let f = self.shared.feedback;
        // Two mails with one queue id (two relays, or ids reused over the
        // years) prove nothing: only a single match counts.
        let sql = format!(
            "{}relay_queue_id = {} LIMIT 2",
            f.target_columns,
            (self.shared.queries.placeholder)(1)
        );
        self.target(sql, Bound::Text(queue_id.to_string())).await
    }

    async fn record_feedback(&self, record: &FeedbackRecord) -> Result<FeedbackRecorded> {
        let (f, begin, unit) = (
            self.shared.feedback,
            self.shared.begin_write,
            self.shared.unit,
        );
        let record = record.clone();
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let mut tx = sqlx::Connection::begin_with(&mut *c, begin).await?;
                    let mut recorded = FeedbackRecorded::default();
                    let keys: Vec<Option<String>> = (0..record.items.len())
                        .map(|i| record.item_key(i))
                        .collect();
                    let mut raw = record.raw;
                    let mut hard_bounced_mail = None;
                    for (index, item) in record.items.iter().enumerate() {
                        let key = keys[index].clone();
                        let keyed = key.is_some();
                        let inserted = sqlx::query(f.insert_feedback)
                            .bind(record.source.as_str().to_string())
                            .bind(item.mail_id)
                            .bind(item.recipient.clone())
                            .bind(item.kind.as_str().to_string())
                            .bind(item.status.clone())
                            .bind(item.diagnostic.clone())
                            .bind(item.matched)
                            .bind(record.size.min(i32::MAX as usize) as i32)
                            // The report once, with its first recipient.
                            .bind(raw.take())
                            .bind(key)
                            .execute(&mut *tx)
                            .await;
                        // A taken event key: the provider's retry of an
                        // event already kept, which does nothing again.
                        let inserted = match inserted {
                            Ok(done) => done.count() > 0,
                            Err(sqlx::Error::Database(e)) if keyed && e.is_unique_violation() => {
                                false
                            }
                            Err(e) => return Err(e),
                        };
                        if !inserted {
                            recorded.repeated.push(index);
                            continue;
                        }
                        let (true, Some(mail_id), Some(recipient)) =
                            (item.matched, item.mail_id, item.recipient.clone())
                        else {
                            continue;
                        };
                        let detail = item.event_detail();
                        if let Some(outcome) = item.kind.event_outcome() {
                            sqlx::query(f.insert_report_event)
                                .bind(outcome.to_string())
                                .bind(item.smtp_code.map(i32::from))
                                .bind(detail.clone())
                                .bind(recipient.clone())
                                .bind(mail_id)
                                .execute(&mut *tx)
                                .await?;
                        }
                        let suppress = match item.kind {
                            FeedbackKind::HardBounce => {
                                hard_bounced_mail = Some(mail_id);
                                Some((f.suppress_permanent, "hard_bounce", None))
                            }
                            FeedbackKind::Complaint if record.policy.complaints => {
                                Some((f.suppress_permanent, "complaint", None))
                            }
                            FeedbackKind::SoftBounce if record.policy.soft_bounce_limit > 0 => {
                                let count: i64 = sqlx::query(f.soft_bounces)
                                    .bind(recipient.clone())
                                    .bind(unit(record.policy.soft_bounce_window))
                                    .fetch_one(&mut *tx)
                                    .await?
                                    .try_get("count")?;
                                (count >= i64::from(record.policy.soft_bounce_limit)).then_some((
                                    f.suppress_until,
                                    "soft_bounce",
                                    Some(unit(record.policy.soft_bounce_ttl)),
                                ))
                            }
                            _ => None,
                        };
                        if let Some((sql, reason, ttl)) = suppress {
                            let mut query = sqlx::query(sql)
                                .bind(recipient.clone())
                                .bind(reason.to_string())
                                .bind(detail)
                                .bind(Some(mail_id));
                            if let Some(ttl) = ttl {
                                query = query.bind(ttl);
                            }
                            if query.execute(&mut *tx).await?.count() > 0 {
                                recorded.suppressed.push(recipient);
                            }
                        }
                    }
                    if let (Some(mail_id), false) = (hard_bounced_mail, record.sent_to.is_empty()) {
                        let rows = sqlx::query(f.hard_bounced)
                            .bind(mail_id)
                            .fetch_all(&mut *tx)
                            .await?;
                        let bounced: std::collections::HashSet<String> = rows
                            .iter()
                            .map(|r| r.try_get::<String, _>("recipient"))
                            .collect::<Result<_, _>>()?;
                        if record.sent_to.iter().all(|r| bounced.contains(r)) {
                            let done = sqlx::query(f.mark_bounced)
                                .bind(mail_id)
                                .execute(&mut *tx)
                                .await?;
                            if done.count() > 0 {
                                recorded.bounced = Some(mail_id);
                            }
                        }
                    }
                    tx.commit().await?;
                    Ok(recorded)
                })
            })
            .await
    }

    async fn suppression_list(
        &self,
        filter: &SuppressionFilter,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<SuppressionEntry>> {
        let (f, placeholder) = (self.shared.feedback, self.shared.queries.placeholder);
        let mut sql = f.suppression_columns.to_string();
        let mut params: Vec<String> = Vec::new();
        if !filter.include_expired {
            sql.push_str(" AND ");
            sql.push_str(f.in_force);
        }
        if let Some(reason) = filter.reason {
            params.push(reason.as_str().to_string());
            sql.push_str(&format!(" AND reason = {}", placeholder(params.len())));
        }
        if let Some(search) = filter.search.as_deref().filter(|s| !s.is_empty()) {
            // A plain substring: the operator's text is no pattern. `!`
            // escapes, the same on every database (MySQL reads a backslash
            // in a literal as an escape of its own).
            let escaped = super::feedback::search_key(search)
                .replace('!', "!!")
                .replace('%', "!%")
                .replace('_', "!_");
            params.push(format!("%{escaped}%"));
            sql.push_str(&format!(
                " AND address LIKE {} ESCAPE '!'",
                placeholder(params.len())
            ));
        }
        if let Some(after) = after {
            params.push(after.to_string());
            sql.push_str(&format!(" AND address > {}", placeholder(params.len())));
        }
        sql.push_str(&format!(
            " ORDER BY address LIMIT {}",
            limit.clamp(1, 10_000)
        ));
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql));
                    for p in params {
                        query = query.bind(p);
                    }
                    query.fetch_all(&mut *c).await
                })
            })
            .await
    }

    async fn suppress(&self, entries: &[NewSuppression]) -> Result<u64> {
        let (f, begin, unit) = (
            self.shared.feedback,
            self.shared.begin_write,
            self.shared.unit,
        );
        let entries = entries.to_vec();
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let mut tx = sqlx::Connection::begin_with(&mut *c, begin).await?;
                    for e in &entries {
                        sqlx::query(f.suppress_manual)
                            .bind(e.address.clone())
                            .bind(e.reason.as_str().to_string())
                            .bind(e.detail.clone())
                            .bind(e.expires_in.map(unit))
                            .execute(&mut *tx)
                            .await?;
                    }
                    tx.commit().await?;
                    Ok(entries.len() as u64)
                })
            })
            .await
    }

    async fn unsuppress(&self, addresses: &[String]) -> Result<u64> {
        let (f, begin, addresses) = (
            self.shared.feedback,
            self.shared.begin_write,
            addresses.to_vec(),
        );
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let mut tx = sqlx::Connection::begin_with(&mut *c, begin).await?;
                    let mut removed = 0;
                    for address in addresses {
                        removed += sqlx::query(f.unsuppress)
                            .bind(address)
                            .execute(&mut *tx)
                            .await?
                            .count();
                    }
                    tx.commit().await?;
                    Ok(removed)
                })
            })
            .await
    }

    async fn feedback_counts(&self, within: Duration) -> Result<Vec<FeedbackCount>> {
        let (sql, within) = (
            self.shared.feedback.feedback_counts,
            (self.shared.unit)(within),
        );
        self.shared
            .run(move |c| {
                Box::pin(async move { sqlx::query_as(sql).bind(within).fetch_all(&mut *c).await })
            })
            .await
    }

    async fn purge_feedback(&self, older_than: Duration, limit: usize) -> Result<u64> {
        let (f, older_than) = (self.shared.feedback, (self.shared.unit)(older_than));
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let reports = sqlx::query(f.purge_feedback)
                        .bind(older_than)
                        .bind(limit as i64)
                        .execute(&mut *c)
                        .await?
                        .count();
                    let entries = sqlx::query(f.purge_suppression)
                        .execute(&mut *c)
                        .await?
                        .count();
                    Ok(reports + entries)
                })
            })
            .await
    }

    async fn reserve_caps(&self, lock: BatchLock, caps: &[CapRequest]) -> Result<Vec<CapAnswer>> {
        if caps.is_empty() {
            return Ok(Vec::new());
        }
        if let (Some(fast), [cap]) = (self.shared.limits.reserve_within_bound, caps) {
            if cap.warmup.is_none() && !cap.mails.is_empty() {
                let (name, lock, g) = (cap.name.clone(), lock.to_string(), cap.mails.len());
                let max = cap.max.min(i64::MAX as u64) as i64;
                let row = self
                    .shared
                    .run(move |c| {
                        Box::pin(
                            sqlx::query(fast)
                                .bind(name)
                                .bind(lock)
                                .bind(g as i64)
                                .bind(max)
                                .fetch_optional(c),
                        )
                    })
                    .await?;
                if let Some(row) = row {
                    let used: i64 = row.try_get("bound")?;
                    return Ok(vec![CapAnswer {
                        name: cap.name.clone(),
                        granted: cap.mails.clone(),
                        turned_away: Vec::new(),
                        counted: false,
                        used: used.max(0) as u64,
                        max: cap.max,
                        frees_in: Duration::ZERO,
                    }]);
                }
            }
        }
        let sql = LimitSql::new(self.shared.limits, self.shared.queries.placeholder);
        let begin = self.shared.begin_write;
        let mut caps = caps.to_vec();
        caps.sort_by(|a, b| a.name.cmp(&b.name));
        let lock = lock.to_string();
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let mut tx = sqlx::Connection::begin_with(&mut *c, begin).await?;
                    let mut answers = Vec::with_capacity(caps.len());
                    // Per cap: its clock, what it counted (before this
                    // claim), its oldest settled reservation and what its
                    // day counted.
                    let mut counts = Vec::with_capacity(caps.len());
                    let mut turned_away: std::collections::HashSet<i64> = Default::default();
                    for cap in &caps {
                        let locked = sqlx::query(AssertSqlSafe(sql.lock.clone()))
                            .bind(cap.name.clone())
                            .fetch_optional(&mut *tx)
                            .await?;
                        let locked = match locked {
                            Some(row) => row,
                            None => {
                                sqlx::query(sql.ensure)
                                    .bind(cap.name.clone())
                                    .execute(&mut *tx)
                                    .await?;
                                sqlx::query(AssertSqlSafe(sql.lock.clone()))
                                    .bind(cap.name.clone())
                                    .fetch_one(&mut *tx)
                                    .await?
                            }
                        };
                        let now: i64 = locked.try_get("now_ms")?;
                        let bound = locked.try_get::<i64, _>("bound")?.max(0) as u64;
                        let budget = cap.budget(now);
                        let asked = cap
                            .mails
                            .iter()
                            .filter(|m| !turned_away.contains(m))
                            .count() as u64;
                        // `bound` is never below what the cap counts: while
                        // the claim fits under it, nothing needs counting.
                        let counted = budget.day.is_some() || bound + asked > budget.max;
                        let (used, oldest, day_used) = if counted {
                            sqlx::query(AssertSqlSafe(sql.sweep.clone()))
                                .bind(cap.name.clone())
                                .execute(&mut *tx)
                                .await?;
                            let (_, used, oldest, day_used) =
                                sql.count::<D::DB>(&mut tx, cap, now).await?;
                            (used, oldest, day_used)
                        } else {
                            (bound, None, 0)
                        };
                        let (space, _) = room(&budget, now, used, oldest, day_used);
                        let granted: Vec<i64> = cap
                            .mails
                            .iter()
                            .copied()
                            .filter(|m| !turned_away.contains(m))
                            .take(space as usize)
                            .collect();
                        let refused: Vec<i64> = cap
                            .mails
                            .iter()
                            .copied()
                            .filter(|m| !turned_away.contains(m) && !granted.contains(m))
                            .collect();
                        turned_away.extend(cap.mails.iter().filter(|m| !granted.contains(m)));
                        counts.push((now, budget, used, oldest, day_used));
                        answers.push(CapAnswer {
                            name: cap.name.clone(),
                            granted,
                            turned_away: refused,
                            counted,
                            used: 0,
                            max: 0,
                            frees_in: Duration::ZERO,
                        });
                    }
                    // A mail one cap turned away takes no room under the
                    // caps before it either: it is not sent now. Then each
                    // cap's reservation is one row for the claim.
                    for (answer, (now, budget, used, oldest, day_used)) in
                        answers.iter_mut().zip(counts)
                    {
                        answer.granted.retain(|m| !turned_away.contains(m));
                        let g = answer.granted.len() as u64;
                        if g > 0 {
                            sqlx::query(sql.add)
                                .bind(answer.name.clone())
                                .bind(lock.clone())
                                .bind(g as i64)
                                .bind(g as i64)
                                .bind(now)
                                .execute(&mut *tx)
                                .await?;
                        }
                        sqlx::query(AssertSqlSafe(sql.set_bound.clone()))
                            .bind((used + g) as i64)
                            .bind(answer.name.clone())
                            .execute(&mut *tx)
                            .await?;
                        let (_, frees_at) = room(&budget, now, used + g, oldest, day_used + g);
                        (answer.used, answer.max) = match budget.day {
                            Some((_, day_max)) if day_max < budget.max => (day_used + g, day_max),
                            _ => (used + g, budget.max),
                        };
                        answer.frees_in = Duration::from_millis((frees_at - now).max(0) as u64);
                    }
                    tx.commit().await?;
                    Ok(answers)
                })
            })
            .await
    }

    async fn settle_caps(&self, settles: &[CapSettle]) -> Result<()> {
        if settles.is_empty() {
            return Ok(());
        }
        let sql = LimitSql::new(self.shared.limits, self.shared.queries.placeholder);
        let begin = self.shared.begin_write;
        // In (name, lock) order: reservations are updated in one order.
        let mut settles = settles.to_vec();
        settles.sort_by(|a, b| (&a.name, a.lock).cmp(&(&b.name, b.lock)));
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let settle = |s: &CapSettle| {
                        let (sent, unsent) = (s.sent as i64, s.unsent as i64);
                        sqlx::query(AssertSqlSafe(sql.settle.clone()))
                            .bind(sent + unsent)
                            .bind(unsent)
                            .bind(unsent)
                            .bind(sent + unsent)
                            .bind(sent + unsent)
                            .bind(s.name.clone())
                            .bind(s.lock.to_string())
                    };
                    if let [one] = settles.as_slice() {
                        // One statement: no transaction needed.
                        settle(one).execute(&mut *c).await?;
                        return Ok(());
                    }
                    let mut tx = sqlx::Connection::begin_with(&mut *c, begin).await?;
                    for s in &settles {
                        settle(s).execute(&mut *tx).await?;
                    }
                    tx.commit().await
                })
            })
            .await
    }

    async fn cap_uses(&self, caps: &[CapRequest]) -> Result<Vec<CapUse>> {
        if caps.is_empty() {
            return Ok(Vec::new());
        }
        let sql = LimitSql::new(self.shared.limits, self.shared.queries.placeholder);
        let caps = caps.to_vec();
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let now: i64 = sqlx::query(AssertSqlSafe(sql.now.clone()))
                        .fetch_one(&mut *c)
                        .await?
                        .try_get("now_ms")?;
                    let mut uses = Vec::with_capacity(caps.len());
                    for cap in &caps {
                        let (budget, used, _, day_used) =
                            sql.count::<D::DB>(&mut *c, cap, now).await?;
                        let (used, max) = match budget.day {
                            Some((_, day_max)) if day_max < budget.max => (day_used, day_max),
                            _ => (used, budget.max),
                        };
                        uses.push(CapUse {
                            name: cap.name.clone(),
                            used,
                            max,
                        });
                    }
                    Ok(uses)
                })
            })
            .await
    }

    async fn purge_cap_uses(&self, older_than: Duration) -> Result<u64> {
        let sql = LimitSql::new(self.shared.limits, self.shared.queries.placeholder);
        let older_than = super::shared::millis(older_than);
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let done = sqlx::query(AssertSqlSafe(sql.purge))
                        .bind(older_than)
                        .execute(&mut *c)
                        .await?;
                    Ok(done.count())
                })
            })
            .await
    }

    async fn template_versions(&self) -> Result<Vec<TemplateVersion>> {
        let sql = self.shared.templates.versions;
        self.shared
            .run(move |c| Box::pin(async move { sqlx::query_as(sql).fetch_all(&mut *c).await }))
            .await
    }

    async fn templates(&self) -> Result<Vec<TemplateRow>> {
        let sql = self.shared.templates.all;
        self.shared
            .run(move |c| Box::pin(async move { sqlx::query_as(sql).fetch_all(&mut *c).await }))
            .await
    }

    async fn put_template(&self, template: &NewTemplate) -> Result<()> {
        let (sql, t) = (self.shared.templates.put, template.clone());
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    sqlx::query(sql)
                        .bind(t.name)
                        .bind(t.locale)
                        .bind(t.subject)
                        .bind(t.body)
                        .bind(t.body_html)
                        .execute(&mut *c)
                        .await
                        .map(|_| ())
                })
            })
            .await
    }
}

/// A single value bound to a statement built at run time.
enum Bound {
    Id(i64),
    Text(String),
}

impl<D: Dialect> SqlStore<D>
where
    <D::DB as Database>::Arguments: sqlx::IntoArguments<D::DB>,
    for<'c> &'c mut <D::DB as Database>::Connection: Executor<'c, Database = D::DB>,
    for<'r> &'r str: ColumnIndex<<D::DB as Database>::Row>,
    i64: Bind<D::DB>,
    String: Bind<D::DB>,
    for<'r> i64: Decode<'r, D::DB> + Type<D::DB>,
    for<'r> String: Decode<'r, D::DB> + Type<D::DB>,
    for<'r> Option<String>: Decode<'r, D::DB>,
{
    /// The mail a report may be about, found by `sql` (one of
    /// `target_columns`' statements), with the recipients its current
    /// attempt left out; `None` unless exactly one row matches.
    async fn target(&self, sql: String, value: Bound) -> Result<Option<FeedbackTarget>> {
        let left_out = self.shared.feedback.left_out;
        self.shared
            .run(move |c| {
                Box::pin(async move {
                    let query = sqlx::query(sqlx::AssertSqlSafe(sql));
                    let query = match value {
                        Bound::Id(id) => query.bind(id),
                        Bound::Text(text) => query.bind(text),
                    };
                    let rows = query.fetch_all(&mut *c).await?;
                    let [row] = rows.as_slice() else {
                        return Ok(None);
                    };
                    let id: i64 = row.try_get("id")?;
                    let left_out = sqlx::query(left_out)
                        .bind(id)
                        .fetch_all(&mut *c)
                        .await?
                        .iter()
                        .map(|r| r.try_get::<String, _>("recipient"))
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok(Some(FeedbackTarget {
                        id,
                        status: row.try_get("status")?,
                        message_id: row.try_get("message_id")?,
                        to_address: row.try_get("to_address")?,
                        cc: row.try_get("cc")?,
                        bcc: row.try_get("bcc")?,
                        left_out,
                    }))
                })
            })
            .await
    }
}

/// The send caps' statements (DESIGN §16), built from a dialect's
/// [`LimitQueries`](super::shared::LimitQueries) and placeholders.
struct LimitSql {
    /// -> `now_ms`.
    now: String,
    ensure: &'static str,
    /// ($1 name) -> `name`, `now_ms`: the cap's row, locked.
    lock: String,
    /// ($1 name): pending reservations no longer held are counted from now.
    sweep: String,
    /// ($1 settled, $2 and $3 unsent, $4 and $5 settled, $6 name, $7 lock):
    /// a claim's reservation once outcomes are written.
    settle: String,
    add: &'static str,
    /// ($1 bound, $2 name).
    set_bound: String,
    /// ($1 name, $2 after) -> `used`, `oldest` (-1: none settled).
    window: String,
    /// ($1 name, $2 day start) -> `used`.
    day: String,
    /// ($1 older than, ms).
    purge: String,
}

impl LimitSql {
    fn new(q: &'static super::shared::LimitQueries, placeholder: fn(usize) -> String) -> Self {
        let (p1, p2) = (placeholder(1), placeholder(2));
        let now = q.now;
        LimitSql {
            now: format!("SELECT {now} AS now_ms"),
            ensure: q.ensure,
            lock: format!(
                "SELECT name, bound, {now} AS now_ms FROM mail_limit WHERE name = {p1}{}",
                q.lock_suffix
            ),
            sweep: format!(
                "UPDATE mail_limit_use SET sent_ms = {now}, pending = 0 \
                 WHERE limit_name = {p1} AND sent_ms IS NULL AND NOT EXISTS (\
                 SELECT 1 FROM mail_queue AS q WHERE q.status = 'sending' AND {})",
                q.held_by
            ),
            settle: {
                let p = |i| placeholder(i);
                // MariaDB assigns left to right and a later assignment sees
                // the earlier ones: `sent_ms` comes first, from `pending` as
                // it was, and each other assignment reads only its own column.
                format!(
                    "UPDATE mail_limit_use SET \
                     sent_ms = CASE WHEN pending <= {} THEN {now} ELSE NULL END, \
                     mails = CASE WHEN mails <= {} THEN 0 ELSE mails - {} END, \
                     pending = CASE WHEN pending <= {} THEN 0 ELSE pending - {} END \
                     WHERE limit_name = {} AND thread_lock = {} AND sent_ms IS NULL",
                    p(1),
                    p(2),
                    p(3),
                    p(4),
                    p(5),
                    p(6),
                    p(7)
                )
            },
            add: q.add,
            set_bound: format!("UPDATE mail_limit SET bound = {p1} WHERE name = {p2}"),
            window: format!(
                "SELECT {} AS used, COALESCE(MIN(sent_ms), -1) AS oldest \
                 FROM mail_limit_use WHERE limit_name = {p1} AND (sent_ms IS NULL OR sent_ms > {p2})",
                q.sum_mails
            ),
            day: format!(
                "SELECT {} AS used FROM mail_limit_use \
                 WHERE limit_name = {p1} AND (sent_ms IS NULL OR sent_ms >= {p2})",
                q.sum_mails
            ),
            purge: format!(
                "DELETE FROM mail_limit_use WHERE sent_ms IS NOT NULL AND sent_ms < {now} - {p1}"
            ),
        }
    }

    /// The cap's budget at `now`, what its window counts and its oldest
    /// settled reservation there, and what its warm-up day counts.
    async fn count<DB: Database>(
        &self,
        c: &mut DB::Connection,
        cap: &CapRequest,
        now: i64,
    ) -> Result<(Budget, u64, Option<i64>, u64), sqlx::Error>
    where
        DB::Arguments: sqlx::IntoArguments<DB>,
        for<'e> &'e mut DB::Connection: Executor<'e, Database = DB>,
        for<'r> &'r str: ColumnIndex<DB::Row>,
        i64: Bind<DB>,
        String: Bind<DB>,
        for<'r> i64: Decode<'r, DB> + Type<DB>,
    {
        let budget = cap.budget(now);
        let row = sqlx::query(AssertSqlSafe(self.window.clone()))
            .bind(cap.name.clone())
            .bind(now - budget.per_ms)
            .fetch_one(&mut *c)
            .await?;
        let used: i64 = row.try_get("used")?;
        let oldest: i64 = row.try_get("oldest")?;
        let day_used: i64 = match budget.day {
            Some((start, _)) => sqlx::query(AssertSqlSafe(self.day.clone()))
                .bind(cap.name.clone())
                .bind(start)
                .fetch_one(&mut *c)
                .await?
                .try_get("used")?,
            None => 0,
        };
        Ok((
            budget,
            used.max(0) as u64,
            (oldest >= 0).then_some(oldest),
            day_used.max(0) as u64,
        ))
    }
}
