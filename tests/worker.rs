//! The worker against a real SMTP server (aiosmtpd), one fresh database per
//! test, run for every backend: what the relay receives and what each row
//! ends as.

mod support;

use std::time::Duration;

use support::*;
use tablemail::store::NewMail;

for_each_backend!(
    delivers_one_correct_message,
    smallest_sql_insert_is_sent,
    message_id_is_stable_across_a_retry,
    priority_order_holds,
    scheduled_mail_waits_until_due,
    transient_reply_backs_off_then_fails_when_exhausted,
    permanent_replies_fail_at_once,
    dedupe_key_inserts_once,
    bad_input_fails_without_an_smtp_session,
    many_mails_each_received_exactly_once,
    an_idle_daemon_wakes_for_an_insert,
);

async fn delivers_one_correct_message(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let worker = worker(&db, &settings(&db, &smtp.url()));
    let mut headers = serde_json::Map::new();
    headers.insert("X-Campaign".into(), "spring".into());
    let id = db
        .enqueue(NewMail {
            to_address: "Ann <ann@example.org>, bob@example.net".into(),
            cc: Some("carl@example.com".into()),
            bcc: Some("hidden@example.com".into()),
            reply_to: Some("help@example.com".into()),
            from_name: Some("The Shop".into()),
            from_address: Some("orders@shop.example".into()),
            subject: Some("Your order 42".into()),
            body: Some("Thanks for your order.\n.\nMAIL FROM:<evil@example.com>\n".into()),
            body_html: Some("<p>Thanks for your order.</p>".into()),
            headers: Some(headers),
            ..NewMail::default()
        })
        .await;

    let report = worker.process_batch().await.unwrap();
    assert_eq!((report.claimed, report.sent), (1, 1));

    let got = smtp.received();
    assert_eq!(got.len(), 1, "exactly one message");
    let m = &got[0];
    assert_eq!(m.mail_from, "orders@shop.example");
    let mut rcpts = m.rcpt_tos.clone();
    rcpts.sort();
    assert_eq!(
        rcpts,
        [
            "ann@example.org",
            "bob@example.net",
            "carl@example.com",
            "hidden@example.com"
        ]
    );
    assert_eq!(
        m.header("From").unwrap(),
        "\"The Shop\" <orders@shop.example>"
    );
    assert_eq!(
        m.header("To").unwrap(),
        "Ann <ann@example.org>, bob@example.net"
    );
    assert_eq!(m.header("Cc").unwrap(), "carl@example.com");
    assert_eq!(m.header("Bcc"), None, "Bcc must not be a header");
    assert!(
        !m.data.contains("hidden@"),
        "Bcc address leaked into the message"
    );
    assert_eq!(m.header("Reply-To").unwrap(), "help@example.com");
    assert_eq!(m.header("Subject").unwrap(), "Your order 42");
    assert_eq!(m.header("X-Campaign").unwrap(), "spring");
    assert!(m
        .header("Content-Type")
        .unwrap()
        .starts_with("multipart/alternative"));
    assert!(m.data.contains("text/plain") && m.data.contains("text/html"));
    // The dot line of the body is escaped: it stays inside this one message.
    assert!(m.data.contains("MAIL FROM:<evil@example.com>"));

    let row = db.row(id).await;
    assert_eq!(row.status, "sent");
    assert_eq!((row.attempts, row.attempts_remaining), (1, 4));
    assert!(!row.locked && row.processed);
    assert_eq!(m.header("Message-ID"), row.message_id);
    let mid = row.message_id.unwrap();
    assert!(
        mid.starts_with('<') && mid.ends_with("@test.example>"),
        "{mid}"
    );
}

async fn smallest_sql_insert_is_sent(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let worker = worker(&db, &settings(&db, &smtp.url()));
    db.exec("INSERT INTO mail_queue (to_address, subject, body) VALUES ('a@example.com', 'Hi', 'Hello')")
        .await;
    let report = worker.process_batch().await.unwrap();
    assert_eq!(report.sent, 1);
    let got = smtp.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].rcpt_tos, ["a@example.com"]);
    assert_eq!(
        got[0].mail_from, "shop@example.com",
        "defaults.from_address"
    );
    assert!(got[0].data.contains("Hello"));
    assert_eq!(
        got[0].header("Content-Type").unwrap(),
        "text/plain; charset=utf-8"
    );
}

async fn message_id_is_stable_across_a_retry(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let worker = worker(&db, &long_backoff(settings(&db, &smtp.url())));
    let id = db.enqueue(mail("flaky-1@example.com", "greylisted")).await;

    let first = worker.process_batch().await.unwrap();
    assert_eq!(first.retried, 1);
    let row = db.row(id).await;
    assert_eq!(row.status, "queued");
    assert!(row.scheduled, "backoff puts send_at in the future");
    assert_eq!((row.attempts, row.attempts_remaining), (1, 4));
    assert!(
        row.last_error.as_deref().unwrap().contains("451"),
        "{row:?}"
    );
    let mid = row.message_id.clone().unwrap();

    assert_eq!(
        worker.process_batch().await.unwrap().claimed,
        0,
        "backing off"
    );
    db.make_due().await;
    assert_eq!(worker.process_batch().await.unwrap().sent, 1);
    let row = db.row(id).await;
    assert_eq!(row.status, "sent");
    assert_eq!(row.attempts, 2);
    assert_eq!(row.message_id.as_deref(), Some(mid.as_str()));
    let attempts = smtp.attempts();
    assert_eq!(attempts.len(), 2);
    for a in &attempts {
        assert_eq!(a.header("Message-ID").as_deref(), Some(mid.as_str()));
    }
    assert_eq!(smtp.received().len(), 1);
}

async fn priority_order_holds(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let mut s = settings(&db, &smtp.url());
    s.worker.batch_size = 1;
    s.worker.concurrency = 1;
    let worker = worker(&db, &s);
    for (subject, priority) in [
        ("p0", 0),
        ("p5a", 5),
        ("pminus", -1),
        ("p10", 10),
        ("p5b", 5),
    ] {
        let mut m = mail("x@example.com", subject);
        m.priority = Some(priority);
        db.enqueue(m).await;
    }
    while worker.process_batch().await.unwrap().claimed > 0 {}
    let order: Vec<String> = smtp
        .received()
        .iter()
        .map(|m| m.header("Subject").unwrap())
        .collect();
    assert_eq!(order, ["p10", "p5a", "p5b", "p0", "pminus"]);
}

async fn scheduled_mail_waits_until_due(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let worker = worker(&db, &settings(&db, &smtp.url()));
    let mut later = mail("later@example.com", "later");
    later.send_at = Some(chrono::Utc::now() + chrono::Duration::hours(1));
    let later = db.enqueue(later).await;
    db.enqueue(mail("now@example.com", "now")).await;

    let report = worker.process_batch().await.unwrap();
    assert_eq!(report.sent, 1);
    let row = db.row(later).await;
    assert_eq!((row.status.as_str(), row.attempts), ("queued", 0));
    assert_eq!(smtp.received().len(), 1);

    db.exec(&format!(
        "UPDATE mail_queue SET send_at = {} WHERE id = {later}",
        db.now()
    ))
    .await;
    assert_eq!(worker.process_batch().await.unwrap().sent, 1);
    assert_eq!(db.row(later).await.status, "sent");
}

async fn transient_reply_backs_off_then_fails_when_exhausted(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let worker = worker(&db, &long_backoff(settings(&db, &smtp.url())));
    let mut m = mail("rcpt451-x@example.com", "busy");
    m.attempts_remaining = Some(2);
    let id = db.enqueue(m).await;

    assert_eq!(worker.process_batch().await.unwrap().retried, 1);
    let row = db.row(id).await;
    assert_eq!(row.status, "queued");
    assert!(row.scheduled);
    assert_eq!((row.attempts, row.attempts_remaining), (1, 1));
    assert!(
        row.last_error
            .as_deref()
            .unwrap()
            .starts_with("RCPT TO: 451"),
        "{row:?}"
    );

    db.make_due().await;
    assert_eq!(worker.process_batch().await.unwrap().failed, 1);
    let row = db.row(id).await;
    assert_eq!(row.status, "failed");
    assert_eq!((row.attempts, row.attempts_remaining), (2, 0));
    assert!(!row.locked && row.processed);
    assert!(smtp.received().is_empty());
}

async fn permanent_replies_fail_at_once(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let worker = worker(&db, &settings(&db, &smtp.url()));
    let rcpt = db
        .enqueue(mail("rcpt550-nobody@example.com", "unknown user"))
        .await;
    let data = db.enqueue(mail("data554-x@example.com", "spam")).await;

    let report = worker.process_batch().await.unwrap();
    assert_eq!(report.failed, 2);
    let row = db.row(rcpt).await;
    assert_eq!(
        (row.status.as_str(), row.attempts, row.attempts_remaining),
        ("failed", 1, 4)
    );
    let error = row.last_error.unwrap();
    assert!(error.starts_with("RCPT TO: 550 5.1.1"), "{error}");
    let row = db.row(data).await;
    assert_eq!(row.status, "failed");
    let error = row.last_error.unwrap();
    assert!(error.starts_with("end of data: 554 5.7.1"), "{error}");
    assert!(smtp.received().is_empty());
}

async fn dedupe_key_inserts_once(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let worker = worker(&db, &settings(&db, &smtp.url()));
    let mut m = mail("a@example.com", "welcome");
    m.dedupe_key = Some("welcome:user:1".into());
    let first = db.store.enqueue(&[m.clone()]).await.unwrap()[0];
    let second = db.store.enqueue(&[m]).await.unwrap()[0];
    assert!(!first.duplicate);
    assert!(second.duplicate);
    assert_eq!(first.id, second.id);
    let inserted = db
        .exec(&db.insert_unless_duplicate(
            "to_address, subject, body, dedupe_key",
            "'a@example.com', 'welcome', 'x', 'welcome:user:1'",
        ))
        .await;
    assert_eq!(inserted, 0);
    assert_eq!(db.scalar_i64("SELECT count(*) FROM mail_queue").await, 1);
    worker.process_batch().await.unwrap();
    assert_eq!(smtp.received().len(), 1);
}

async fn bad_input_fails_without_an_smtp_session(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let mut s = settings(&db, &smtp.url());
    s.transport.max_message_size = tablemail::config::ByteSize(10_000);
    let worker = worker(&db, &s);
    let quote = |s: &str| db.literal(s);
    let cases = [
        (
            quote("not an address"),
            quote("x"),
            "NULL".to_string(),
            "invalid address in to_address",
        ),
        (quote(""), quote("x"), "NULL".to_string(), "no recipient"),
        (
            quote("a@example.com"),
            db.with_crlf("Hi", "Bcc: victim@example.com"),
            "NULL".to_string(),
            "CR, LF or NUL in subject",
        ),
        (
            quote("a@example.com"),
            quote("x"),
            quote(r#"{"Bad Name": "v"}"#),
            "invalid header \"Bad Name\"",
        ),
        (
            quote("a@example.com"),
            quote("x"),
            quote(r#"{"X-Ok": "v\r\nBcc: b@example.com"}"#),
            "CR, LF or NUL in header X-Ok",
        ),
        (
            quote("a@example.com"),
            quote("x"),
            quote(r#"{"From": "boss@example.com"}"#),
            "invalid header \"From\"",
        ),
        (
            quote("a@example.com, @@"),
            quote("x"),
            "NULL".to_string(),
            "invalid address in to_address",
        ),
        (
            db.with_crlf("a@example.com", "b@example.com"),
            quote("x"),
            "NULL".to_string(),
            "CR, LF or NUL in to_address",
        ),
    ];
    for (to, subject, headers, _) in &cases {
        db.exec(&format!(
            "INSERT INTO mail_queue (to_address, subject, body, headers) VALUES ({to}, {subject}, 'b', {headers})"
        ))
        .await;
    }
    db.exec(&format!(
        "INSERT INTO mail_queue (to_address, subject, body) VALUES ('a@example.com', 'big', '{}')",
        "x".repeat(20_000)
    ))
    .await;

    let report = worker.process_batch().await.unwrap();
    assert_eq!(report.failed, cases.len() + 1);
    let rows = db.rows().await;
    for (row, (_, _, _, expected)) in rows.iter().zip(&cases) {
        assert_eq!(row.status, "failed");
        let error = row.last_error.as_deref().unwrap();
        assert!(
            error.starts_with(expected),
            "{error:?} should start with {expected:?}"
        );
    }
    let big = rows.last().unwrap();
    assert!(
        big.last_error
            .as_deref()
            .unwrap()
            .contains("over transport.max_message_size"),
        "{big:?}"
    );
    assert!(
        smtp.attempts().is_empty(),
        "no SMTP transaction for bad input"
    );
}

async fn many_mails_each_received_exactly_once(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let mut s = settings(&db, &smtp.url());
    s.worker.batch_size = 50;
    s.worker.concurrency = 8;
    let worker = worker(&db, &s);
    let mails: Vec<NewMail> = (0..300)
        .map(|i| mail(&format!("user{i}@example.com"), &format!("mail {i}")))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    while worker.process_batch().await.unwrap().claimed > 0 {}
    let mut subjects: Vec<String> = smtp
        .received()
        .iter()
        .map(|m| m.header("Subject").unwrap())
        .collect();
    subjects.sort();
    let mut expected: Vec<String> = (0..300).map(|i| format!("mail {i}")).collect();
    expected.sort();
    assert_eq!(subjects, expected);
    assert_eq!(db.count("status = 'sent' AND attempts = 1").await, 300);
}

/// The application's own INSERT of mail `i`, as SQL.
fn insert(i: usize) -> String {
    format!("INSERT INTO mail_queue (to_address, subject, body) VALUES ('a{i}@example.com', 'mail {i}', 'Hello')")
}

/// An idle daemon notices a new row at once (NOTIFY on PostgreSQL, a write
/// to the file on SQLite, a new newest id on MariaDB), not at its next poll:
/// with a poll interval of a minute, a mail inserted into an idle daemon is
/// still sent within seconds, and the daemon says how it notices new rows.
async fn an_idle_daemon_wakes_for_an_insert(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let mut daemon = Daemon::start(daemon_env(
        &db,
        &smtp.url(),
        &[("TABLEMAIL__WORKER__POLL_INTERVAL", "60s")],
    ));
    let started = daemon
        .wait_for_log("worker started", Duration::from_secs(20))
        .await;
    assert_ne!(started["wakeup"], "poll", "{started}");
    // The first may come before the daemon's first claim; once it is sent,
    // the daemon is idle and only its wake-up can find the next ones.
    for i in 0..3 {
        db.exec(&insert(i)).await;
        eventually(
            &format!("mail {i} sent by an idle daemon polling once a minute"),
            Duration::from_secs(10),
            || async { smtp.received().len() > i },
        )
        .await;
    }
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(20)).await, 0);
    assert_eq!(db.count("status = 'sent'").await, 3);
}

/// MariaDB has no NOTIFY: an idle daemon looks for a new newest row every
/// `database.look_interval`, and that is the operator's to set. Looking
/// once an hour (and polling once a minute), an idle daemon leaves a new
/// mail waiting; started again looking every 10 ms, it sends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_an_idle_daemon_looks_as_often_as_it_is_told() {
    let Some(db) = TestDb::mysql().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let rarely = [
        ("TABLEMAIL__WORKER__POLL_INTERVAL", "60s"),
        ("TABLEMAIL__DATABASE__LOOK_INTERVAL", "1h"),
    ];
    db.exec(&insert(0)).await;
    let mut daemon = Daemon::start(daemon_env(&db, &smtp.url(), &rarely));
    // Sent by the claim at start; the first look (at start too) is long
    // done a second later, and the next is an hour away.
    eventually("mail 0 sent at start", Duration::from_secs(20), || async {
        smtp.received().len() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    db.exec(&insert(1)).await;
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < until {
        assert_eq!(smtp.received().len(), 1, "mail 1 sent without a look");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(20)).await, 0);
    assert_eq!(db.count("status = 'queued'").await, 1);

    // Looking every 10 ms, the mail inserted after the start is found.
    let often = [
        ("TABLEMAIL__WORKER__POLL_INTERVAL", "60s"),
        ("TABLEMAIL__DATABASE__LOOK_INTERVAL", "10ms"),
    ];
    let mut daemon = Daemon::start(daemon_env(&db, &smtp.url(), &often));
    daemon
        .wait_for_log("worker started", Duration::from_secs(20))
        .await;
    db.exec(&insert(2)).await;
    eventually(
        "mails 1 and 2 sent by a daemon looking every 10 ms",
        Duration::from_secs(10),
        || async { smtp.received().len() == 3 },
    )
    .await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(20)).await, 0);
    assert_eq!(db.count("status = 'sent'").await, 3);
}
