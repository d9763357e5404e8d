//! The least-privilege roles of the README, granted as written there: the
//! application inserts a mail and its attachments in one transaction (the
//! README's insert), the daemon's role claims, sends, writes history,
//! reports itself, reserves room under the send caps, retries, cancels and
//! purges; neither needs more.

mod support;

use std::time::Duration;

use support::*;
use tablemail::store::{
    BatchLock, CapRequest, CapSettle, Claim, DaemonBeat, Event, EventOutcome, FeedbackItem,
    FeedbackKind, FeedbackRecord, FeedbackSource, FinalAction, Finalize, MailLookup,
    NewSuppression, RetrySelection, SuppressionFilter, SuppressionPolicy, SuppressionReason,
};

/// The SQL block of the README that follows `<!-- marker -->`.
pub fn readme_sql(marker: &str) -> String {
    let readme = include_str!("../README.md");
    let tag = format!("<!-- {marker} -->");
    let start = readme
        .find(&tag)
        .unwrap_or_else(|| panic!("{tag} in the README"));
    let block = &readme[start..];
    let open = block.find("```sql\n").expect("a SQL block") + "```sql\n".len();
    let close = block[open..].find("```").expect("its end") + open;
    block[open..close].to_string()
}

/// The README's grants, role names made unique per test.
fn grants(sender: &str, app: &str) -> Vec<String> {
    let readme = include_str!("../README.md");
    let start = readme
        .find("-- run the migrations once as the owner")
        .expect("the README's grants");
    let block = &readme[start..readme[start..].find("```").unwrap() + start];
    block
        .lines()
        .filter(|l| !l.trim_start().starts_with("--") && !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("\n")
        .split(';')
        .map(|s| {
            s.trim()
                .replace("tablemail_sender", sender)
                .replace("app_mailer", app)
        })
        .map(|s| s.replace("PASSWORD '…'", ""))
        .filter(|s| !s.is_empty())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_roles_are_enough_for_the_application_and_the_daemon() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let (sender, app) = (format!("tm_sender_{suffix}"), format!("tm_app_{suffix}"));
    for statement in grants(&sender, &app) {
        db.exec(&statement).await;
    }
    db.exec(&format!("ALTER ROLE {app} LOGIN")).await;
    let connect_as = |role: &str| db.url.replacen("postgres@", &format!("{role}@"), 1);

    // The application: the README's insert of a mail with an attachment.
    let app_pool = sqlx::PgPool::connect(&connect_as(&app)).await.unwrap();
    let insert = readme_sql("attachments:postgres");
    let inserted = sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
        .execute(&app_pool)
        .await
        .unwrap_or_else(|e| panic!("{insert}: {e}"))
        .rows_affected();
    assert_eq!(inserted, 1, "one attachment row");
    // Again: the dedupe key makes it a no-op.
    let again = sqlx::query(sqlx::AssertSqlSafe(insert))
        .execute(&app_pool)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(again, 0);
    app_pool.close().await;

    // The daemon's role: everything the daemon and the operator commands do.
    let store = tablemail::store::connect(&connect_as(&sender), 2)
        .await
        .unwrap();
    let batch = store
        .claim_batch(&Claim {
            lock: BatchLock::generate(),
            limit: 10,
            max_age: Duration::from_secs(86400),
            message_id_domain: "test.example",
            inline_limit: 32 * 1024,
        })
        .await
        .unwrap();
    assert_eq!(batch.len(), 1);
    let m = &batch[0];
    assert_eq!(m.sizes.attachments, 1);
    let parts = store.load_attachments(m.id).await.unwrap();
    assert_eq!(parts[0].filename, "invoice-42.pdf");
    // Send caps (DESIGN §16): room reserved under the claim's lock.
    let caps = [CapRequest {
        name: "quota".into(),
        max: 10,
        per: Duration::from_secs(60),
        warmup: None,
        mails: vec![m.id],
    }];
    let answers = store.reserve_caps(m.lock, &caps).await.unwrap();
    assert_eq!(answers[0].granted, [m.id]);
    store
        .finalize(&[Finalize {
            id: m.id,
            lock: m.lock,
            action: FinalAction::Failed {
                error: "RCPT TO: 550 no such user".into(),
                relay_down: false,
            },
            relay_reply: None,
            event: Some(Event {
                attempt: m.attempts,
                outcome: EventOutcome::Failed,
                stage: Some("rcpt"),
                smtp_code: Some(550),
                detail: None,
            }),
        }])
        .await
        .unwrap();
    store
        .settle_caps(&[CapSettle {
            name: "quota".into(),
            lock: m.lock,
            sent: 1,
            unsent: 0,
        }])
        .await
        .unwrap();
    assert_eq!(store.cap_uses(&caps).await.unwrap()[0].used, 1);
    store
        .purge_cap_uses(Duration::from_secs(3600))
        .await
        .unwrap();
    store
        .heartbeat(&DaemonBeat {
            id: uuid::Uuid::new_v4(),
            host: "h".into(),
            pid: 1,
            version: "0".into(),
            in_flight: 0,
            sent_total: 0,
            sent_since: 0,
            failed_since: 1,
            attachment_bytes_since: 0,
        })
        .await
        .unwrap();
    store
        .release_stale_locks(Duration::from_secs(300), &[])
        .await
        .unwrap();
    assert_eq!(store.retry(RetrySelection::Id(m.id), 5).await.unwrap(), 1);
    assert_eq!(store.cancel(m.id).await.unwrap(), 1);
    let record = store
        .find_mail(&MailLookup::Id(m.id), true)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.events.len(), 3);
    store.stats(Duration::from_secs(300)).await.unwrap();
    store
        .failure_groups(Duration::from_secs(3600))
        .await
        .unwrap();
    store.daemons().await.unwrap();
    // The delivery loop (DESIGN §12): the list read at every claim, written
    // by reports and by `suppress`; reports counted and purged.
    store
        .suppressed_among(&["ann@example.org".into()])
        .await
        .unwrap();
    let entry = NewSuppression {
        address: "gone@example.org".into(),
        reason: SuppressionReason::Manual,
        detail: None,
        expires_in: None,
    };
    assert_eq!(store.suppress(&[entry]).await.unwrap(), 1);
    let listed = store
        .suppression_list(&SuppressionFilter::default(), None, 10)
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        store
            .unsuppress(&["gone@example.org".into()])
            .await
            .unwrap(),
        1
    );
    store
        .record_feedback(&FeedbackRecord {
            source: FeedbackSource::Ingest,
            size: 100,
            raw: None,
            items: vec![FeedbackItem {
                mail_id: Some(m.id),
                recipient: Some("ann@example.org".into()),
                kind: FeedbackKind::HardBounce,
                status: Some("5.1.1".into()),
                diagnostic: None,
                matched: true,
                smtp_code: Some(550),
            }],
            sent_to: vec!["ann@example.org".into()],
            policy: SuppressionPolicy::default(),
            event_key: Some(format!("roles-{suffix}")),
        })
        .await
        .unwrap();
    assert_eq!(
        store
            .suppressed_among(&["ann@example.org".into()])
            .await
            .unwrap()
            .len(),
        1,
        "the hard bounce suppressed its address"
    );
    store
        .feedback_counts(Duration::from_secs(3600))
        .await
        .unwrap();
    db.exec("UPDATE mail_feedback SET received_at = now() - interval '1 minute'")
        .await;
    assert_eq!(store.purge_feedback(Duration::ZERO, 100).await.unwrap(), 1);
    // Retention deletes the mail with its attachments and history.
    db.exec("UPDATE mail_queue SET processed_at = now() - interval '1 minute'")
        .await;
    assert_eq!(
        store
            .purge(Duration::ZERO, Duration::ZERO, 100)
            .await
            .unwrap(),
        1
    );
    drop(store);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM mail_attachment").await,
        0
    );
    assert_eq!(db.scalar_i64("SELECT count(*) FROM mail_event").await, 0);

    for role in [&sender, &app] {
        db.exec(&format!("DROP OWNED BY {role}")).await;
        db.exec(&format!("DROP ROLE {role}")).await;
    }
}

/// The README's attachment inserts for MySQL and SQLite, run as an
/// application would, give a mail the daemon claims with its attachment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_attachment_inserts_work_on_mysql_and_sqlite() {
    for db in [TestDb::mysql().await, TestDb::sqlite().await]
        .into_iter()
        .flatten()
    {
        let marker = format!("attachments:{}", db.backend);
        db.exec_script(&readme_sql(&marker)).await;
        let batch = db
            .store
            .claim_batch(&Claim {
                lock: BatchLock::generate(),
                limit: 10,
                max_age: Duration::from_secs(86400),
                message_id_domain: "test.example",
                inline_limit: 32 * 1024,
            })
            .await
            .unwrap();
        assert_eq!(batch.len(), 1, "{marker}");
        let parts = db.store.load_attachments(batch[0].id).await.unwrap();
        assert_eq!(parts.len(), 1, "{marker}");
        assert_eq!(parts[0].content_type, "application/pdf");
        assert_eq!(
            parts[0].content,
            b"%PDF-1.4\n%\xc3\xa4\xc3\xbc\xc3\xb6\xc3\x9f\n"
        );
    }
}
