//! A mail's history and what operators read back, the same on every
//! backend: history rows written with the outcome they record (none for a
//! mail sent at once), the relay's reply, stale-lock releases and operator
//! actions in the history, `created_at` kept by `retry`, lookups by id,
//! Message-ID and dedupe key, the mail list's filters, failures grouped by
//! stage and reply, and the daemons' reports.

mod support;

use std::time::Duration;

use support::*;
use tablemail::store::{
    BatchLock, Claim, DaemonBeat, Event, EventOutcome, FinalAction, Finalize, MailFilter,
    MailLookup, QueuedMail, RetrySelection,
};

for_each_backend!(
    outcomes_write_their_history_in_the_same_commit,
    stale_releases_and_operator_actions_are_history,
    mails_are_found_by_id_message_id_and_dedupe_key,
    the_mail_list_filters_and_pages,
    failures_are_grouped_by_stage_and_reply,
    daemons_report_themselves_and_go_silent,
);

async fn claim(db: &TestDb, limit: usize) -> Vec<QueuedMail> {
    let claim = Claim {
        lock: BatchLock::generate(),
        limit,
        max_age: Duration::from_secs(86400),
        message_id_domain: "test.example",
        inline_limit: 32 * 1024,
    };
    db.store.claim_batch(&claim).await.unwrap()
}

fn write(m: &QueuedMail, action: FinalAction, event: Option<Event>) -> Finalize {
    Finalize {
        id: m.id,
        lock: m.lock,
        relay_reply: matches!(action, FinalAction::Sent)
            .then(|| "250 2.0.0 Ok: queued as 4XyZ".into()),
        action,
        event,
    }
}

fn event(m: &QueuedMail, outcome: EventOutcome, stage: &'static str, code: Option<u16>) -> Event {
    Event {
        attempt: m.attempts,
        outcome,
        stage: Some(stage),
        smtp_code: code,
        detail: None,
    }
}

async fn history_of(
    db: &TestDb,
    id: i64,
) -> Vec<(String, Option<String>, Option<i32>, Option<String>)> {
    let record = db
        .store
        .find_mail(&MailLookup::Id(id), false)
        .await
        .unwrap()
        .expect("the mail");
    record
        .events
        .into_iter()
        .map(|e| (e.outcome, e.stage, e.smtp_code, e.detail))
        .collect()
}

async fn outcomes_write_their_history_in_the_same_commit(db: TestDb) {
    let sent = db.enqueue(mail("a@example.com", "sent")).await;
    let retried = db.enqueue(mail("b@example.com", "retry")).await;
    let refused = db.enqueue(mail("c@example.com", "relay down")).await;
    let batch = claim(&db, 3).await;
    let of = |id| batch.iter().find(|m| m.id == id).unwrap();
    let mut refused_event = event(of(refused), EventOutcome::Released, "connect", None);
    refused_event.detail = Some("connect: connection refused".into());
    let written = db
        .store
        .finalize(&[
            write(of(sent), FinalAction::Sent, None),
            write(
                of(retried),
                FinalAction::Retry {
                    delay: Duration::from_secs(60),
                    error: "RCPT TO: 451 4.3.0 try later".into(),
                    relay_down: false,
                },
                Some(event(of(retried), EventOutcome::Retry, "rcpt", Some(451))),
            ),
            write(of(refused), FinalAction::Release, Some(refused_event)),
        ])
        .await
        .unwrap();
    assert_eq!(written.len(), 3);
    // Sent at the first try: the relay's reply, and no history at all.
    let record = db
        .store
        .find_mail(&MailLookup::Id(sent), false)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.status, "sent");
    assert_eq!(
        record.relay_reply.as_deref(),
        Some("250 2.0.0 Ok: queued as 4XyZ")
    );
    assert!(record.events.is_empty(), "{:?}", record.events);
    // The retry's history row carries the stage, the code and last_error.
    assert_eq!(
        history_of(&db, retried).await,
        [(
            "retry".into(),
            Some("rcpt".into()),
            Some(451),
            Some("RCPT TO: 451 4.3.0 try later".into())
        )]
    );
    // A refunded try keeps last_error as it was, and its own detail.
    assert_eq!(db.row(refused).await.last_error, None);
    assert_eq!(
        history_of(&db, refused).await,
        [(
            "released".into(),
            Some("connect".into()),
            None,
            Some("connect: connection refused".into())
        )]
    );
    // A write fenced out (the lock was taken away) writes no history either.
    db.make_due().await;
    let again = claim(&db, 10).await;
    let stolen = again.iter().find(|m| m.id == retried).unwrap();
    let mut fenced = write(
        stolen,
        FinalAction::Failed {
            error: "RCPT TO: 550 no".into(),
            relay_down: false,
        },
        Some(event(stolen, EventOutcome::Failed, "rcpt", Some(550))),
    );
    fenced.lock = BatchLock::generate();
    assert!(db.store.finalize(&[fenced]).await.unwrap().is_empty());
    assert_eq!(history_of(&db, retried).await.len(), 1);
}

async fn stale_releases_and_operator_actions_are_history(db: TestDb) {
    let stale = db.enqueue(mail("a@example.com", "stale")).await;
    let failed = db.enqueue(mail("b@example.com", "failed")).await;
    let queued = db.enqueue(mail("c@example.com", "queued")).await;
    let batch = claim(&db, 2).await;
    let f = batch.iter().find(|m| m.id == failed).unwrap();
    db.store
        .finalize(&[write(
            f,
            FinalAction::Failed {
                error: "RCPT TO: 550 unknown user".into(),
                relay_down: false,
            },
            Some(event(f, EventOutcome::Failed, "rcpt", Some(550))),
        )])
        .await
        .unwrap();
    db.exec(&format!(
        "UPDATE mail_queue SET locked_at = {} WHERE status = 'sending'",
        db.minus(db.now(), 600)
    ))
    .await;
    let released = db
        .store
        .release_stale_locks(Duration::from_secs(300), &[])
        .await
        .unwrap();
    assert_eq!(released.len(), 1);
    let history = history_of(&db, stale).await;
    assert_eq!(history.len(), 1);
    assert_eq!(
        (history[0].0.as_str(), history[0].1.as_deref()),
        ("stale", Some("lock"))
    );

    let created_before = db
        .store
        .find_mail(&MailLookup::Id(failed), false)
        .await
        .unwrap()
        .unwrap()
        .created_at;
    assert_eq!(
        db.store.retry(RetrySelection::Id(failed), 5).await.unwrap(),
        1
    );
    let record = db
        .store
        .find_mail(&MailLookup::Id(failed), false)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.status, "queued");
    assert_eq!(record.created_at, created_before, "retry keeps created_at");
    assert!(record.retried_at.is_some());
    let outcomes: Vec<&str> = record.events.iter().map(|e| e.outcome.as_str()).collect();
    assert_eq!(outcomes, ["failed", "retried"]);
    assert_eq!(record.events[1].stage.as_deref(), Some("operator"));

    assert_eq!(db.store.cancel(queued).await.unwrap(), 1);
    let history = history_of(&db, queued).await;
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].0, "cancelled");
    // Nothing to cancel: no history either.
    assert_eq!(db.store.cancel(queued).await.unwrap(), 0);
    assert_eq!(history_of(&db, queued).await.len(), 1);
}

async fn mails_are_found_by_id_message_id_and_dedupe_key(db: TestDb) {
    let mut keyed = mail("someone@example.org", "keyed");
    keyed.dedupe_key = Some("order-42".into());
    keyed.body = Some("the body".into());
    let keyed = db.enqueue(keyed).await;
    let mut own = mail("b@example.org", "own id");
    own.message_id = Some("<order-43@shop.example>".into());
    let own = db.enqueue(own).await;
    claim(&db, 10).await;
    let assigned = db.row(keyed).await.message_id.unwrap();
    for (lookup, id) in [
        (MailLookup::Id(keyed), keyed),
        (MailLookup::MessageId(assigned.clone()), keyed),
        (MailLookup::MessageId("<order-43@shop.example>".into()), own),
        (MailLookup::DedupeKey("order-42".into()), keyed),
    ] {
        let found = db.store.find_mail(&lookup, false).await.unwrap();
        assert_eq!(found.map(|r| r.id), Some(id), "{lookup:?}");
    }
    // An assigned-looking Message-ID that is not the row's finds nothing.
    let forged = assigned.replace('@', ".0@");
    assert!(db
        .store
        .find_mail(&MailLookup::MessageId(forged), false)
        .await
        .unwrap()
        .is_none());
    assert!(db
        .store
        .find_mail(&MailLookup::Id(keyed + 1000), false)
        .await
        .unwrap()
        .is_none());
    // The content only when asked for.
    let plain = db
        .store
        .find_mail(&MailLookup::Id(keyed), false)
        .await
        .unwrap()
        .unwrap();
    assert!(plain.content.is_none());
    let json = serde_json::to_string(&plain).unwrap();
    assert!(!json.contains("someone@"), "{json}");
    assert!(!json.contains("the body"), "{json}");
    let full = db
        .store
        .find_mail(&MailLookup::Id(keyed), true)
        .await
        .unwrap()
        .unwrap();
    let content = full.content.unwrap();
    assert_eq!(content.to_address, "someone@example.org");
    assert_eq!(content.body.as_deref(), Some("the body"));
}

async fn the_mail_list_filters_and_pages(db: TestDb) {
    let mut ids = Vec::new();
    for i in 0..5 {
        let to = if i % 2 == 0 {
            "Ann <ann@Example.ORG>"
        } else {
            "bob@other.net"
        };
        let mut m = mail(to, &format!("mail {i}"));
        m.dedupe_key = Some(format!("key-{i}"));
        ids.push(db.enqueue(m).await);
    }
    let list = |filter: MailFilter| {
        let store = db.store.clone();
        async move { store.list_mails(&filter, 100).await.unwrap() }
    };
    let all = list(MailFilter::default()).await;
    assert_eq!(
        all.iter().map(|m| m.id).collect::<Vec<_>>(),
        ids.iter().rev().copied().collect::<Vec<_>>()
    );
    assert_eq!(all[0].domains, "example.org");
    assert!(
        !serde_json::to_string(&all).unwrap().contains("ann@"),
        "no full address"
    );
    let example = list(MailFilter {
        domain: Some("example.org".into()),
        ..MailFilter::default()
    })
    .await;
    assert_eq!(example.len(), 3);
    let page = db
        .store
        .list_mails(&MailFilter::default(), 2)
        .await
        .unwrap();
    let next = list(MailFilter {
        before_id: Some(page[1].id),
        ..MailFilter::default()
    })
    .await;
    assert_eq!(next.len(), 3);
    assert!(next.iter().all(|m| m.id < page[1].id));
    assert_eq!(
        list(MailFilter {
            dedupe_key: Some("key-3".into()),
            ..MailFilter::default()
        })
        .await
        .len(),
        1
    );
    db.store.cancel(ids[0]).await.unwrap();
    let cancelled = list(MailFilter {
        status: Some("cancelled".into()),
        ..MailFilter::default()
    })
    .await;
    assert_eq!(cancelled.iter().map(|m| m.id).collect::<Vec<_>>(), [ids[0]]);
    let by_id = list(MailFilter {
        id: Some(ids[2]),
        status: Some("queued".into()),
        ..MailFilter::default()
    })
    .await;
    assert_eq!(by_id.len(), 1);
}

async fn failures_are_grouped_by_stage_and_reply(db: TestDb) {
    for i in 0..3 {
        db.enqueue(mail(&format!("u{i}@example.com"), "x")).await;
    }
    let batch = claim(&db, 3).await;
    let failed = |m: &QueuedMail, code| {
        write(
            m,
            FinalAction::Failed {
                error: format!("RCPT TO: {code} no"),
                relay_down: false,
            },
            Some(event(m, EventOutcome::Failed, "rcpt", Some(code))),
        )
    };
    db.store
        .finalize(&[
            failed(&batch[0], 550),
            failed(&batch[1], 550),
            write(
                &batch[2],
                FinalAction::Unknown {
                    error: "no reply after end of data: timed out".into(),
                },
                Some(event(&batch[2], EventOutcome::Unknown, "dot", None)),
            ),
        ])
        .await
        .unwrap();
    let groups = db
        .store
        .failure_groups(Duration::from_secs(3600))
        .await
        .unwrap();
    let found: Vec<(&str, Option<&str>, Option<i32>, i64)> = groups
        .iter()
        .map(|g| (g.outcome.as_str(), g.stage.as_deref(), g.smtp_code, g.count))
        .collect();
    assert_eq!(
        found,
        [
            ("failed", Some("rcpt"), Some(550), 2),
            ("unknown", Some("dot"), None, 1)
        ]
    );
}

async fn daemons_report_themselves_and_go_silent(db: TestDb) {
    let beat = |id, sent_since| DaemonBeat {
        id,
        host: "worker-1.example".into(),
        pid: 4242,
        version: "1.2.3".into(),
        in_flight: 7,
        sent_total: 100,
        sent_since,
        failed_since: 2,
        attachment_bytes_since: 0,
    };
    let (one, two) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    db.store.heartbeat(&beat(one, 60)).await.unwrap();
    db.store.heartbeat(&beat(one, 40)).await.unwrap();
    db.store.heartbeat(&beat(two, 5)).await.unwrap();
    let daemons = db.store.daemons().await.unwrap();
    assert_eq!(daemons.len(), 2);
    let first = daemons.iter().find(|d| d.id == one.to_string()).unwrap();
    assert_eq!(
        (
            first.host.as_str(),
            first.pid,
            first.version.as_str(),
            first.in_flight,
            first.sent
        ),
        ("worker-1.example", 4242, "1.2.3", 7, 100)
    );
    assert!(daemons.iter().all(|d| !d.silent));
    // A daemon that stopped reporting half a minute ago is silent.
    db.exec(&format!(
        "UPDATE tablemail_daemon SET last_seen = {} WHERE id = '{two}'",
        db.minus(db.now(), 45)
    ))
    .await;
    let daemons = db.store.daemons().await.unwrap();
    let silent: Vec<bool> = daemons.iter().map(|d| d.silent).collect();
    assert_eq!(silent.iter().filter(|s| **s).count(), 1, "{daemons:?}");
    // The minutes add up every daemon's reports.
    let minutes = db.store.minutes(60).await.unwrap();
    let (sent, failed) = minutes
        .iter()
        .fold((0, 0), |(s, f), m| (s + m.sent, f + m.failed));
    assert_eq!((sent, failed), (105, 6));
    // A clean stop removes the daemon's row.
    db.store.daemon_stopped(one).await.unwrap();
    assert_eq!(db.store.daemons().await.unwrap().len(), 1);
}
