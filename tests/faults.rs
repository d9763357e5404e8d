//! Every row of the failure table of DESIGN §2, proven against real servers:
//! Postfix's smtp-sink with its fault flags, aiosmtpd with AUTH and TLS, a
//! closed port, stale locks, shutdown, crashes and concurrent daemons.

mod support;

use std::time::Duration;

use support::*;
use tablemail::{config::Ambiguous, store::NewMail};

for_each_backend!(
    soft_rejects_are_transient,
    hard_rejects_are_permanent,
    relay_unavailable_refunds_the_attempt,
    drop_after_dot_is_ambiguous,
    drop_or_timeout_before_dot_is_transient,
    timeout_after_dot_is_ambiguous,
    closed_port_that_later_opens_spends_no_attempts,
    auth_rejected_needs_an_operator,
    starttls_is_required_and_verified,
    implicit_tls_is_verified,
    old_mails_expire,
    slow_relay_never_makes_a_live_batch_stale,
    sigterm_mid_drain_leaves_nothing_sending,
    two_daemons_send_each_mail_once,
    sigkill_loses_nothing,
);

async fn one(db: &TestDb, to: &str) -> i64 {
    db.enqueue(mail(to, "fault")).await
}

async fn soft_rejects_are_transient(db: TestDb) {
    for (flag, stage) in [
        ("MAIL", "MAIL FROM: 450"),
        ("RCPT", "RCPT TO: 450"),
        ("DATA", "DATA: 450"),
        (".", "end of data: 450"),
    ] {
        let sink = SmtpSink::start(&["-r", flag]);
        let worker = worker(&db, &long_backoff(settings(&db, &sink.url())));
        let id = one(&db, "a@example.com").await;
        let report = worker.process_batch().await.unwrap();
        assert_eq!(report.retried, 1, "-r {flag}");
        let row = db.row(id).await;
        assert_eq!(row.status, "queued", "-r {flag}");
        assert!(row.scheduled, "-r {flag}: backoff");
        assert_eq!((row.attempts, row.attempts_remaining), (1, 4), "-r {flag}");
        let error = row.last_error.unwrap();
        assert!(error.starts_with(stage), "-r {flag}: {error}");
        db.exec(&format!(
            "UPDATE mail_queue SET status = 'cancelled' WHERE id = {id}"
        ))
        .await;
    }
}

async fn hard_rejects_are_permanent(db: TestDb) {
    for (flag, stage) in [
        ("RCPT", "RCPT TO: 500 5.3.0"),
        (".", "end of data: 500 5.3.0"),
        ("MAIL", "MAIL FROM: 500"),
    ] {
        let sink = SmtpSink::start(&["-f", flag]);
        let worker = worker(&db, &settings(&db, &sink.url()));
        let id = one(&db, "a@example.com").await;
        assert_eq!(worker.process_batch().await.unwrap().failed, 1, "-f {flag}");
        let row = db.row(id).await;
        assert_eq!(
            (row.status.as_str(), row.attempts, row.attempts_remaining),
            ("failed", 1, 4)
        );
        let error = row.last_error.unwrap();
        assert!(error.starts_with(stage), "-f {flag}: {error}");
        assert!(!row.locked && row.processed);
    }
}

async fn relay_unavailable_refunds_the_attempt(db: TestDb) {
    // A 421 to MAIL, RCPT or ".", or a 4xx greeting, for two mails to two
    // domains (a 421 to RCPT or "." slows its own domain first), while
    // nothing goes through.
    for (flags, mid_transaction) in [
        (["-Q", "MAIL"], true),
        (["-Q", "RCPT"], true),
        (["-Q", "."], true),
        (["-r", "CONNECT"], false),
    ] {
        let sink = SmtpSink::start(&flags);
        let worker = worker(&db, &settings(&db, &sink.url()));
        let ids = [
            one(&db, "a@example.com").await,
            one(&db, "b@example.org").await,
        ];
        let report = worker.process_batch().await.unwrap();
        let mut scheduled = 0;
        for id in ids {
            let row = db.row(id).await;
            assert_eq!(row.status, "queued", "{flags:?}");
            assert!(!row.locked, "{flags:?}");
            assert_eq!(
                (row.attempts, row.attempts_remaining, row.relay_down_count),
                (0, 5, 0),
                "{flags:?}: refunded, and not blamed on the row"
            );
            scheduled += usize::from(row.scheduled);
        }
        if mid_transaction {
            // The first refusal moves its row out of the way; the second,
            // with nothing gone through between, is the relay's: pause.
            assert_eq!((report.deferred, report.released), (1, 1), "{flags:?}");
            assert_eq!(scheduled, 1, "{flags:?}");
        } else {
            // A relay that refuses the connection is never one row's fault.
            assert_eq!((report.deferred, report.released), (0, 2), "{flags:?}");
            assert_eq!(scheduled, 0, "{flags:?}: due again at once");
        }
        assert!(
            worker.relay().paused_for().is_some(),
            "{flags:?}: the worker pauses"
        );
        // While paused, nothing is claimed, attempted or spent.
        db.make_due().await;
        assert_eq!(worker.process_batch().await.unwrap().claimed, 0);
        for id in ids {
            let row = db.row(id).await;
            assert_eq!(
                (row.status.as_str(), row.attempts, row.attempts_remaining),
                ("queued", 0, 5),
                "{flags:?}: claimed once, refunded, then left alone"
            );
        }
        db.exec("UPDATE mail_queue SET status = 'cancelled'").await;
    }
}

async fn drop_after_dot_is_ambiguous(db: TestDb) {
    let sink = SmtpSink::start(&["-q", "."]);
    let resend = worker(&db, &settings(&db, &sink.url()));
    let id = one(&db, "a@example.com").await;
    let report = resend.process_batch().await.unwrap();
    assert_eq!(report.retried, 1);
    let row = db.row(id).await;
    assert_eq!((row.status.as_str(), row.attempts), ("queued", 1));
    assert!(row
        .last_error
        .as_deref()
        .unwrap()
        .starts_with("no reply after end of data"));
    let mid = row.message_id.clone();
    // The relay may have it: it does (smtp-sink captured it), with our Message-ID.
    let got = sink.mails();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].message_id, mid);

    let mut s = settings(&db, &sink.url());
    s.worker.ambiguous = Ambiguous::Hold;
    let hold = worker(&db, &s);
    let held = one(&db, "b@example.com").await;
    db.exec(&format!(
        "UPDATE mail_queue SET status = 'cancelled' WHERE id = {id}"
    ))
    .await;
    assert_eq!(hold.process_batch().await.unwrap().unknown, 1);
    let row = db.row(held).await;
    assert_eq!((row.status.as_str(), row.attempts), ("unknown", 1));
    assert!(!row.locked);
}

async fn drop_or_timeout_before_dot_is_transient(db: TestDb) {
    // With -W, smtp-sink answers pipelined commands out of order, so the
    // timeout cases turn pipelining off (-p).
    for flags in [
        vec!["-q", "RCPT"],
        vec!["-q", "DATA"],
        vec!["-p", "-W", "MAIL:3"],
        vec!["-p", "-W", "DATA:3"],
    ] {
        let sink = SmtpSink::start(&flags);
        let mut s = settings(&db, &sink.url());
        s.transport.timeout = Duration::from_secs(1);
        let worker = worker(&db, &s);
        let id = one(&db, "a@example.com").await;
        let report = worker.process_batch().await.unwrap();
        assert_eq!(
            report.retried,
            1,
            "{flags:?}: {report:?} {:?}",
            db.row(id).await
        );
        let row = db.row(id).await;
        assert_eq!(
            (row.status.as_str(), row.attempts),
            ("queued", 1),
            "{flags:?}"
        );
        let error = row.last_error.unwrap();
        assert!(error.contains("before end of data"), "{flags:?}: {error}");
        assert!(
            sink.mails().iter().all(|m| m.message_id.is_none()),
            "no message went out"
        );
        db.exec(&format!(
            "UPDATE mail_queue SET status = 'cancelled' WHERE id = {id}"
        ))
        .await;
    }
}

async fn timeout_after_dot_is_ambiguous(db: TestDb) {
    let sink = SmtpSink::start(&["-W", ".:4"]);
    let mut s = settings(&db, &sink.url());
    s.transport.data_timeout = Duration::from_secs(1);
    s.worker.ambiguous = Ambiguous::Hold;
    let worker = worker(&db, &s);
    let id = one(&db, "a@example.com").await;
    assert_eq!(worker.process_batch().await.unwrap().unknown, 1);
    let row = db.row(id).await;
    assert_eq!(row.status, "unknown");
    let error = row.last_error.unwrap();
    assert!(error.contains("timed out"), "{error}");
}

async fn closed_port_that_later_opens_spends_no_attempts(db: TestDb) {
    let port = free_port();
    let env = daemon_env(
        &db,
        &format!("smtp://127.0.0.1:{port}"),
        &[("TABLEMAIL__WORKER__POLL_INTERVAL", "100ms")],
    );
    let mails: Vec<NewMail> = (0..30)
        .map(|i| mail(&format!("u{i}@example.com"), "x"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let mut daemon = Daemon::start(env);
    let first = daemon
        .wait_for_log("relay unavailable", Duration::from_secs(10))
        .await;
    // An outage of any length spends nothing.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM mail_queue WHERE attempts > 0")
            .await,
        0
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM mail_queue WHERE status = 'queued'")
            .await,
        30
    );

    let sink = SmtpSink::start_on(port, &[]);
    eventually(
        "all sent once the relay is back",
        Duration::from_secs(120),
        || async {
            db.scalar_i64("SELECT count(*) FROM mail_queue WHERE status = 'sent' AND attempts = 1")
                .await
                == 30
        },
    )
    .await;
    assert_eq!(sink.mails().len(), 30);
    let line = first;
    assert_eq!(line["level"], "WARN", "{line}");
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

/// A relay that answers 421 to every MAIL FROM (Postfix's client message
/// rate limit says so, before any recipient is named) is throttling as a
/// whole: the relay gate pauses and probes, the pace slows, and no recipient
/// domain is paused for it — a paused domain had every mail claimed after
/// each relay pause deferred unsent, hundreds of rows a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_refusing_every_mail_from_pauses_no_recipient_domain() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let port = free_port();
    let refusing = SmtpSink::start_on(port, &["-Q", "MAIL"]);
    let mails: Vec<NewMail> = (0..300)
        .map(|i| mail(&format!("u{i}@example.com"), "x"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let env = daemon_env(
        &db,
        &format!("smtp://127.0.0.1:{port}"),
        &[("TABLEMAIL__WORKER__POLL_INTERVAL", "100ms")],
    );
    let mut daemon = Daemon::start(env);
    // A few rounds of pause, probe (EHLO is answered) and refusal.
    eventually("three relay pauses", Duration::from_secs(60), || async {
        daemon.logged("relay unavailable").len() >= 3
    })
    .await;
    assert!(
        daemon.logged("domain throttling: pausing it").is_empty(),
        "a refused MAIL paused a recipient domain:\n{}",
        daemon.output()
    );
    let slowed_down = daemon
        .logged("mail deferred")
        .into_iter()
        .filter(|l| {
            l["error"]
                .as_str()
                .unwrap_or("")
                .contains("asked to slow down")
        })
        .count();
    assert_eq!(slowed_down, 0, "mails deferred for a domain pause");

    drop(refusing);
    let sink = SmtpSink::start_on(port, &[]);
    eventually(
        "all sent once the relay takes mail again",
        Duration::from_secs(120),
        || async {
            db.scalar_i64("SELECT count(*) FROM mail_queue WHERE status = 'sent' AND attempts = 1")
                .await
                == 300
        },
    )
    .await;
    // One attempt each: the refusals spent nothing.
    assert_eq!(sink.mails().len(), 300, "each mail once");
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

async fn auth_rejected_needs_an_operator(db: TestDb) {
    let smtp = SmtpServer::start(&["--auth", "mailer:right"]);
    let id = one(&db, "a@example.com").await;
    let env = daemon_env(
        &db,
        &smtp.url(),
        &[
            ("TABLEMAIL__TRANSPORT__USERNAME", "mailer"),
            ("TABLEMAIL__TRANSPORT__PASSWORD", "wrong-secret-pw"),
            // A test relay without TLS.
            ("TABLEMAIL__TRANSPORT__ALLOW_PLAINTEXT_AUTH", "true"),
        ],
    );
    let mut daemon = Daemon::start(env);
    let first = daemon
        .wait_for_log("relay unavailable", Duration::from_secs(10))
        .await;
    let line = first;
    assert_eq!(line["level"], "ERROR", "AUTH needs an operator: {line}");
    assert!(line["error"].as_str().unwrap().contains("AUTH"), "{line}");
    assert!(
        !daemon.output().contains("wrong-secret-pw"),
        "password logged"
    );
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    let row = db.row(id).await;
    assert_eq!(
        (row.status.as_str(), row.attempts, row.attempts_remaining),
        ("queued", 0, 5)
    );
    assert!(smtp.received().is_empty());
    // Tried, not merely left alone: a step with the wrong password claims
    // the row, the relay refuses AUTH, the attempt comes back, and the
    // history says so.
    let mut s = settings(&db, &smtp.url());
    s.transport.username = Some("mailer".into());
    s.transport.password = Some(secrecy::SecretString::from("wrong-secret-pw"));
    s.transport.allow_plaintext_auth = true;
    let report = worker(&db, &s).process_batch().await.unwrap();
    assert_eq!((report.claimed, report.released), (1, 1), "{report:?}");
    refunded(&db, id).await;
    let record = db
        .store
        .find_mail(&tablemail::store::MailLookup::Id(id), false)
        .await
        .unwrap()
        .unwrap();
    let last = record
        .events
        .last()
        .expect("a history row for the refused try");
    assert_eq!(
        (last.outcome.as_str(), last.stage.as_deref()),
        ("released", Some("auth"))
    );

    // The right password, from a credentials file, goes through.
    let dir = TempDir::new();
    std::fs::write(dir.path().join("smtp-password"), "right\n").unwrap();
    let mut s = settings(&db, &smtp.url());
    s.transport.username = Some("mailer".into());
    s.transport.password_file = Some(dir.path().join("smtp-password"));
    s.transport.allow_plaintext_auth = true;
    assert_eq!(worker(&db, &s).process_batch().await.unwrap().sent, 1);
    assert_eq!(smtp.received().len(), 1);
}

async fn starttls_is_required_and_verified(db: TestDb) {
    let dir = TempDir::new();
    let (cert, key) = self_signed_cert(dir.path());
    let (cert, key) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let tls = SmtpServer::start(&["--tls", cert, key]);
    let url = format!("smtp://localhost:{}?tls=required", tls.port);
    let id = one(&db, "a@example.com").await;

    // A certificate nobody vouches for: relay unavailable, nothing spent.
    let worker_strict = worker(&db, &settings(&db, &url));
    assert_eq!(worker_strict.process_batch().await.unwrap().released, 1);
    refunded(&db, id).await;
    assert!(tls.attempts().is_empty());

    // A server without STARTTLS: never falls back to plain text.
    let plain = SmtpServer::start(&[]);
    let worker_plain = worker(
        &db,
        &settings(
            &db,
            &format!("smtp://127.0.0.1:{}?tls=required", plain.port),
        ),
    );
    assert_eq!(worker_plain.process_batch().await.unwrap().released, 1);
    assert!(plain.attempts().is_empty(), "a mail went out in plain text");
    refunded(&db, id).await;

    // Trusting the test certificate: delivered over TLS (the server refuses
    // MAIL before STARTTLS).
    let mut s = settings(&db, &url);
    s.transport.accept_invalid_certs = true;
    assert_eq!(worker(&db, &s).process_batch().await.unwrap().sent, 1);
    assert_eq!(tls.received().len(), 1);
    assert_eq!(db.row(id).await.status, "sent");
}

async fn implicit_tls_is_verified(db: TestDb) {
    let dir = TempDir::new();
    let (cert, key) = self_signed_cert(dir.path());
    let smtps = SmtpServer::start(&[
        "--implicit-tls",
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
    ]);
    let url = format!("smtps://localhost:{}", smtps.port);
    let id = one(&db, "a@example.com").await;
    assert_eq!(
        worker(&db, &settings(&db, &url))
            .process_batch()
            .await
            .unwrap()
            .released,
        1
    );
    refunded(&db, id).await;
    let mut s = settings(&db, &url);
    s.transport.accept_invalid_certs = true;
    assert_eq!(worker(&db, &s).process_batch().await.unwrap().sent, 1);
    assert_eq!(smtps.received().len(), 1);
}

async fn old_mails_expire(db: TestDb) {
    let sink = SmtpSink::start(&[]);
    let worker = worker(&db, &settings(&db, &sink.url()));
    let id = one(&db, "a@example.com").await;
    db.exec(&format!(
        "UPDATE mail_queue SET created_at = {} WHERE id = {id}",
        db.minus(db.now(), 6 * 86400)
    ))
    .await;
    assert_eq!(worker.process_batch().await.unwrap().failed, 1);
    let row = db.row(id).await;
    assert_eq!(row.status, "failed");
    assert_eq!(row.last_error.as_deref(), Some("expired"));
    assert!(sink.mails().is_empty());
}

async fn slow_relay_never_makes_a_live_batch_stale(db: TestDb) {
    let smtp = SmtpServer::start(&["--slow", "6"]);
    let mut s = settings(&db, &smtp.url());
    s.worker.lock_timeout = Duration::from_secs(3);
    s.transport.data_timeout = Duration::from_secs(20);
    let worker = worker(&db, &s);
    let id = one(&db, "slow-1@example.com").await;
    let cancel = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(worker.clone().run(cancel.clone()));
    // Another daemon's sweep, again and again, while the relay takes 6s.
    let sweeper = db.store.clone();
    let mut released = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while db.row(id).await.status != "sent" {
        assert!(tokio::time::Instant::now() < deadline, "never sent");
        released += sweeper
            .release_stale_locks(Duration::from_secs(3), &[])
            .await
            .unwrap()
            .len();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(released, 0, "a live batch was taken for stale");
    let row = db.row(id).await;
    assert_eq!(row.attempts, 1);
    assert_eq!(smtp.received().len(), 1);
    cancel.cancel();
    running.await.unwrap();
}

async fn sigterm_mid_drain_leaves_nothing_sending(db: TestDb) {
    // Each reply to "." takes 1s: the drain is slow enough to interrupt.
    let sink = SmtpSink::start(&["-W", ".:1"]);
    let mails: Vec<NewMail> = (0..400)
        .map(|i| mail(&format!("u{i}@example.com"), "x"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let env = daemon_env(&db, &sink.url(), &[("TABLEMAIL__WORKER__CONCURRENCY", "8")]);
    let mut daemon = Daemon::start(env);
    eventually("some mails sent", Duration::from_secs(20), || async {
        db.scalar_i64("SELECT count(*) FROM mail_queue WHERE status = 'sent'")
            .await
            >= 8
    })
    .await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(30)).await, 0);
    let count = |sql: &'static str| db.scalar_i64(sql);
    assert_eq!(
        count("SELECT count(*) FROM mail_queue WHERE status = 'sending'").await,
        0
    );
    assert_eq!(
        count("SELECT count(*) FROM mail_queue WHERE thread_lock IS NOT NULL").await,
        0
    );
    let sent =
        count("SELECT count(*) FROM mail_queue WHERE status = 'sent' AND attempts = 1").await;
    let queued = count(
        "SELECT count(*) FROM mail_queue WHERE status = 'queued' AND attempts = 0 AND attempts_remaining = 5",
    )
    .await;
    assert!(queued > 0, "the drain was interrupted");
    assert_eq!(sent + queued, 400, "every row is sent, or queued untouched");
    assert_eq!(
        sink.mails().len() as i64,
        sent,
        "nothing sent twice or unrecorded"
    );
}

async fn two_daemons_send_each_mail_once(db: TestDb) {
    let sink = SmtpSink::start(&[]);
    let mails: Vec<NewMail> = (0..2000)
        .map(|i| mail(&format!("u{i}@example.com"), &format!("m{i}")))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let env = daemon_env(&db, &sink.url(), &[("TABLEMAIL__WORKER__BATCH_SIZE", "20")]);
    let mut a = Daemon::start(env.clone());
    let mut b = Daemon::start(env);
    eventually("2000 sent", Duration::from_secs(60), || async {
        db.scalar_i64("SELECT count(*) FROM mail_queue WHERE status = 'sent'")
            .await
            == 2000
    })
    .await;
    for d in [&a, &b] {
        d.signal("TERM");
    }
    assert_eq!(a.wait_exit(Duration::from_secs(10)).await, 0);
    assert_eq!(b.wait_exit(Duration::from_secs(10)).await, 0);
    let by_a = a.logged("mail sent").len();
    let by_b = b.logged("mail sent").len();
    assert_eq!(by_a + by_b, 2000);
    assert!(by_a > 0 && by_b > 0, "both daemons worked: {by_a} + {by_b}");
    let got = sink.mails();
    let seen = message_id_counts(&got);
    assert_eq!(seen.len(), 2000, "every mail arrived");
    assert_eq!(got.len(), 2000, "duplicates: {}", got.len() - seen.len());
}

async fn sigkill_loses_nothing(db: TestDb) {
    const MAILS: usize = 5000;
    let sink = SmtpSink::start(&[]);
    let mails: Vec<NewMail> = (0..MAILS)
        .map(|i| mail(&format!("u{i}@example.com"), &format!("m{i}")))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let env = daemon_env(
        &db,
        &sink.url(),
        &[
            ("TABLEMAIL__WORKER__LOCK_TIMEOUT", "3s"),
            ("TABLEMAIL__WORKER__BATCH_SIZE", "25"),
            ("TABLEMAIL__WORKER__CONCURRENCY", "4"),
            ("TABLEMAIL__WORKER__POLL_INTERVAL", "100ms"),
        ],
    );
    let mut in_flight_at_kills = 0;
    let mut kills = 0;
    while kills < 10 {
        // Rows still held by daemons killed earlier (their locks not yet stale).
        let earlier: std::collections::HashSet<String> = db
            .sending_locks()
            .await
            .into_iter()
            .map(|(_, lock)| lock)
            .collect();
        let mut daemon = Daemon::start(env.clone());
        let before = db
            .scalar_i64("SELECT count(*) FROM mail_queue WHERE status = 'sent'")
            .await;
        eventually(
            "progress before the kill",
            Duration::from_secs(30),
            || async {
                db.scalar_i64("SELECT count(*) FROM mail_queue WHERE status = 'sent'")
                    .await
                    > before + 50
            },
        )
        .await;
        daemon.signal("KILL");
        daemon.wait_exit(Duration::from_secs(10)).await;
        kills += 1;
        // Rows this daemon held when it died: claimed, maybe sent, not written.
        let held = db
            .sending_locks()
            .await
            .iter()
            .filter(|(_, lock)| !earlier.contains(lock))
            .count() as i64;
        in_flight_at_kills += held;
        if db
            .scalar_i64("SELECT count(*) FROM mail_queue WHERE status <> 'sent'")
            .await
            < 400
        {
            // Keep enough work for the remaining kills.
            let more: Vec<NewMail> = (0..500)
                .map(|i| mail(&format!("v{kills}x{i}@example.com"), "more"))
                .collect();
            db.store.enqueue(&more).await.unwrap();
        }
    }
    let mut daemon = Daemon::start(env);
    let total = db.scalar_i64("SELECT count(*) FROM mail_queue").await;
    eventually("every row terminal", Duration::from_secs(120), || async {
        db.scalar_i64("SELECT count(*) FROM mail_queue WHERE status = 'sent'")
            .await
            == total
    })
    .await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);

    let got = sink.mails();
    let seen = message_id_counts(&got);
    let ids = db.strings("SELECT message_id FROM mail_queue").await;
    let lost = ids.iter().filter(|id| !seen.contains_key(*id)).count();
    let duplicates = got.len() - seen.len();
    eprintln!(
        "sigkill ({}): {kills} kills, {total} mails, lost {lost}, duplicates {duplicates}, in flight at the kills {in_flight_at_kills}",
        db.backend
    );
    assert_eq!(lost, 0);
    assert!(
        duplicates as i64 <= in_flight_at_kills,
        "duplicates {duplicates} > mails in flight at the kills {in_flight_at_kills}"
    );
}

/// A row the relay never took: claimed (an attempt spent), then given back
/// with the attempt refunded, due again.
async fn refunded(db: &TestDb, id: i64) {
    let row = db.row(id).await;
    assert_eq!(
        (row.status.as_str(), row.attempts, row.attempts_remaining),
        ("queued", 0, 5)
    );
}
