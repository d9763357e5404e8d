//! The delivery promise at its edges: no mail lost, a duplicate only when the
//! relay's reply to "." was truly lost, and one bad row never holds up the
//! others. Each test runs the daemon binary against real servers (aiosmtpd,
//! smtp-sink, PostgreSQL, SQLite, MariaDB) and checks the rows and what the
//! relay received.

mod support;

use std::time::{Duration, Instant};

use support::{proxy::Proxy, *};
use tablemail::store::NewMail;

for_each_backend!(
    sigterm_while_the_reply_to_the_dot_is_late,
    one_refused_recipient_never_slows_the_others,
);

/// Messages the relay saw reach their end of data, by Message-ID.
fn attempt_ids(smtp: &SmtpServer) -> Vec<String> {
    smtp.attempts()
        .iter()
        .filter_map(|m| m.header("Message-ID"))
        .collect()
}

async fn sigterm_while_the_reply_to_the_dot_is_late(db: TestDb) {
    for ambiguous in ["hold", "resend"] {
        // The relay has each mail once "." arrives, but holds its first
        // reply far longer than the test runs: all three are in flight at
        // the shutdown however slowly a loaded machine hands them over. A
        // resend (same Message-ID) is answered at once.
        let smtp = SmtpServer::start(&["--slow", "300"]);
        let env = daemon_env(
            &db,
            &smtp.url(),
            &[
                ("TABLEMAIL__WORKER__SHUTDOWN_TIMEOUT", "1s"),
                ("TABLEMAIL__WORKER__AMBIGUOUS", ambiguous),
                // One row per claim: each mail on a lane of its own, all
                // three in flight at once.
                ("TABLEMAIL__WORKER__BATCH_SIZE", "1"),
                // Long enough that the restarted daemon sends its marker
                // first on a loaded machine.
                ("TABLEMAIL__WORKER__RETRY_BASE", "15s"),
                ("TABLEMAIL__WORKER__RETRY_MAX", "15s"),
                ("TABLEMAIL__TRANSPORT__DATA_TIMEOUT", "10m"),
            ],
        );
        let mut daemon = Daemon::start(env.clone());
        // One mail at a time, each once the one before is past the dot: a
        // lane takes the mail queued behind its own as the next it sends
        // (its envelope rides along), so three mails queued at once could
        // end up two on one lane, the second waiting for the held reply.
        let mut ids = Vec::new();
        for i in 0..3 {
            let late = mail(&format!("slowonce-{ambiguous}{i}@example.com"), "late");
            ids.push(db.enqueue(late).await);
            eventually(
                &format!("{ambiguous}: mail {} past the dot", i + 1),
                Duration::from_secs(30),
                || async { smtp.attempts().len() > i },
            )
            .await;
        }
        assert!(
            daemon.logged("mail sent").is_empty(),
            "{ambiguous}: the relay answered before the shutdown\n{}",
            daemon.output()
        );
        daemon.signal("TERM");
        assert_eq!(daemon.wait_exit(Duration::from_secs(15)).await, 0);
        assert!(
            !daemon
                .logged("shutdown timeout: interrupting sends")
                .is_empty(),
            "{ambiguous}: the sends were cut off"
        );
        assert_eq!(db.count("status = 'sending'").await, 0, "{ambiguous}");
        let mut message_ids = Vec::new();
        for id in &ids {
            let row = db.row(*id).await;
            assert_eq!(row.attempts, 1, "{ambiguous}: the attempt stays spent");
            assert!(!row.locked);
            let error = row.last_error.clone().unwrap_or_default();
            assert!(
                error.contains("interrupted by shutdown"),
                "{error}: {row:?}\n{}",
                daemon.output()
            );
            match ambiguous {
                "hold" => assert_eq!(row.status, "unknown", "{row:?}"),
                _ => {
                    assert_eq!(row.status, "queued", "{row:?}");
                    assert!(row.scheduled, "resent only after the backoff: {row:?}");
                }
            }
            message_ids.push(row.message_id.unwrap());
        }

        // Start again, with one ordinary mail as a marker: once it is sent,
        // the daemon has claimed whatever was due.
        let mut daemon = Daemon::start(env);
        let marker = db.enqueue(mail("marker@example.com", "marker")).await;
        eventually("the marker sent", Duration::from_secs(15), || async {
            db.row(marker).await.status == "sent"
        })
        .await;
        assert_eq!(
            attempt_ids(&smtp)
                .iter()
                .filter(|id| message_ids.contains(id))
                .count(),
            3,
            "{ambiguous}: nothing was sent again at once"
        );
        if ambiguous == "resend" {
            eventually(
                "the resend after the backoff",
                Duration::from_secs(45),
                || async { db.count("status = 'sent'").await == 4 },
            )
            .await;
            let seen = attempt_ids(&smtp);
            for id in &message_ids {
                assert_eq!(
                    seen.iter().filter(|s| *s == id).count(),
                    2,
                    "resent once, with the same Message-ID"
                );
            }
        } else {
            for id in &ids {
                assert_eq!(db.row(*id).await.status, "unknown", "held, never resent");
            }
        }
        daemon.signal("TERM");
        daemon.wait_exit(Duration::from_secs(15)).await;
        db.exec("DELETE FROM mail_queue").await;
    }
}

async fn one_refused_recipient_never_slows_the_others(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    // Ahead of everything: a row whose recipient always draws 421 at RCPT.
    let mut bad = mail("rcpt421-x@throttled.example", "refused");
    bad.priority = Some(10);
    let bad = db.enqueue(bad).await;
    let mails: Vec<NewMail> = (0..300)
        .map(|i| mail(&format!("u{i}@example.com"), "ordinary"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let mut daemon = Daemon::start(daemon_env(&db, &smtp.url(), &[]));
    let started = Instant::now();
    eventually(
        "300 ordinary mails sent",
        Duration::from_secs(30),
        || async { db.count("status = 'sent'").await == 300 },
    )
    .await;
    eprintln!(
        "one 421 ahead of 300 ({}): all 300 sent in {:.2}s",
        db.backend,
        started.elapsed().as_secs_f64()
    );
    // Stopped first: its next try cannot come between the reads below.
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    let row = db.row(bad).await;
    assert_eq!(row.status, "queued");
    assert_eq!(
        (row.attempts, row.attempts_remaining),
        (0, 5),
        "deferred, not spent"
    );
    // Moved out of the way: its send_at is later than when it was queued
    // (whether or not that time has come yet: the first move is a second).
    let moved = match db.backend {
        tablemail::store::Backend::Sqlite => "julianday(send_at) > julianday(created_at)",
        _ => "send_at > created_at",
    };
    assert_eq!(
        db.scalar_i64(&format!(
            "SELECT count(*) FROM mail_queue WHERE id = {bad} AND {moved}"
        ))
        .await,
        1,
        "its send_at moved out of the way"
    );
    let error = row.last_error.unwrap_or_default();
    assert!(error.starts_with("RCPT TO: 421 4.7.0"), "{error}");
    assert!(
        daemon.logged("relay unavailable").is_empty(),
        "one row's 421 paused the whole relay"
    );
    assert!(daemon.logged("relay throttling: slowing down").is_empty());
    // The operator sees why it waits.
    let out = tablemail()
        .args(["status", "--json"])
        .envs(db.env())
        .output()
        .unwrap();
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Each try of the row is one: once, or twice when the drain outlasted
    // its first, one-second deferral (a loaded machine).
    let tries = db
        .scalar_i64(&format!(
            "SELECT count(*) FROM mail_event WHERE mail_id = {bad}"
        ))
        .await;
    assert!(tries >= 1, "the refusal is in the mail's history");
    assert_eq!(
        status["retrying_last_hour"]["RCPT TO 421"], tries,
        "{status}"
    );
}

/// Kills every connection the daemon has to its database (on the server's
/// side, as a failover or an operator would), returning how many.
async fn kill_daemon_connections(db: &TestDb) -> i64 {
    match db.backend {
        tablemail::store::Backend::Postgres => {
            db.scalar_i64(&format!(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = '{}' AND application_name = 'tablemail'",
                db.name()
            ))
            .await
        }
        tablemail::store::Backend::Mysql => {
            // The test's own pool is on the same database: kill only the
            // connections that are not the test's (the daemon runs its own
            // READ COMMITTED sessions; the test's pool never claims).
            let ids = db
                .strings(&format!(
                    "SELECT CAST(ID AS CHAR) FROM information_schema.PROCESSLIST \
                     WHERE DB = '{}' AND ID <> CONNECTION_ID()",
                    db.name()
                ))
                .await;
            for id in &ids {
                let _ = db.try_exec(&format!("KILL {id}")).await;
            }
            ids.len() as i64
        }
        tablemail::store::Backend::Sqlite => unreachable!("a file has no connections to kill"),
    }
}

async fn a_database_connection_killed_between_send_and_commit(db: TestDb) {
    let smtp = SmtpServer::start(&["--slow", "3"]);
    let mails: Vec<NewMail> = (0..5)
        .map(|i| mail(&format!("slow-{i}@example.com"), "x"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let mut daemon = Daemon::start(daemon_env(&db, &smtp.url(), &[]));
    eventually(
        "five mails past the dot",
        Duration::from_secs(15),
        || async { smtp.attempts().len() == 5 },
    )
    .await;
    // While the relay thinks: every connection of the daemon is killed.
    let killed = kill_daemon_connections(&db).await;
    assert!(killed > 0, "the daemon had connections");
    eventually("five sent", Duration::from_secs(30), || async {
        db.count("status = 'sent' AND attempts = 1").await == 5
    })
    .await;
    assert_eq!(smtp.attempts().len(), 5, "nothing sent twice");
    assert_eq!(smtp.received().len(), 5);
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_connection_killed_between_send_and_commit_sends_nothing_twice() {
    if let Some(db) = TestDb::postgres().await {
        a_database_connection_killed_between_send_and_commit(db).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_connection_killed_between_send_and_commit_sends_nothing_twice() {
    if let Some(db) = TestDb::mysql().await {
        a_database_connection_killed_between_send_and_commit(db).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_to_the_database_and_the_relay_lose_nothing() {
    if let Some(db) = TestDb::postgres().await {
        silent_connections(db).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_to_mariadb_and_the_relay_lose_nothing() {
    if let Some(db) = TestDb::mysql().await {
        silent_connections(db).await;
    }
}

/// A proxy blackholes every open connection to the database and to the
/// relay in the middle of a drain (packets vanish, no reset): the daemon
/// notices within its deadlines, opens new connections, loses nothing.
async fn silent_connections(db: TestDb) {
    const MAILS: i64 = 2000;
    let sink = SmtpSink::start(&[]);
    let pg_port = url_port(&db.url);
    let db_proxy = Proxy::start(pg_port).await;
    let smtp_proxy = Proxy::start(sink.port).await;
    let proxied = db
        .url
        .replacen(&format!(":{pg_port}/"), &format!(":{}/", db_proxy.port), 1);
    let mails: Vec<NewMail> = (0..MAILS)
        .map(|i| mail(&format!("u{i}@example.com"), &format!("m{i}")))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let env = vec![
        ("TABLEMAIL__DATABASE__URL".to_string(), proxied),
        (
            "TABLEMAIL__TRANSPORT__URL".to_string(),
            format!("smtp://127.0.0.1:{}", smtp_proxy.port),
        ),
        (
            "TABLEMAIL__DEFAULTS__FROM_ADDRESS".to_string(),
            "shop@example.com".to_string(),
        ),
        ("TABLEMAIL__DATABASE__STATEMENT_TIMEOUT".into(), "3s".into()),
        // A claim that committed while its reply was lost in the silence
        // leaves rows no live daemon knows it holds: released once stale.
        ("TABLEMAIL__WORKER__LOCK_TIMEOUT".into(), "5s".into()),
        ("TABLEMAIL__TRANSPORT__TIMEOUT".into(), "3s".into()),
        ("TABLEMAIL__TRANSPORT__DATA_TIMEOUT".into(), "3s".into()),
        ("TABLEMAIL__WORKER__RETRY_BASE".into(), "1s".into()),
        ("TABLEMAIL__WORKER__RETRY_MAX".into(), "2s".into()),
        ("TABLEMAIL__WORKER__CONCURRENCY".into(), "8".into()),
        // Slow enough that the silence falls in the middle of the drain.
        ("TABLEMAIL__WORKER__RATE_LIMIT".into(), "100".into()),
    ];
    let mut daemon = Daemon::start(env);
    eventually("a quarter sent", Duration::from_secs(30), || async {
        db.count("status = 'sent'").await >= MAILS / 4
    })
    .await;
    db_proxy.blackhole();
    smtp_proxy.blackhole();
    let silenced_at = Instant::now();
    let left = MAILS - db.count("status = 'sent'").await;
    assert!(
        left > 400,
        "only {left} mails left when the silence began: it fell after the drain"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while db.count("status = 'sent'").await < MAILS {
        if Instant::now() >= deadline {
            let states = db
                .strings("SELECT CONCAT(status, ' ', count(*)) FROM mail_queue GROUP BY status")
                .await;
            panic!(
                "not every mail sent 60 s after the silence: {states:?}; the daemon said:\n{}",
                daemon.tail(80)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "silent connections: the rest sent {:.1}s after the silence began",
        silenced_at.elapsed().as_secs_f64()
    );
    // Whichever call met the silence first (a claim, a commit, a lock
    // renewal, the wake-up listener, a chore) says its deadline passed.
    let deadline_fired = daemon.logs().iter().any(|l| {
        l["error"]
            .as_str()
            .is_some_and(|e| e.contains("did not answer within") || e.contains("timed out"))
    });
    assert!(
        deadline_fired,
        "the deadline never fired: the test did not silence the database"
    );
    let got = sink.mails();
    let seen = message_id_counts(&got);
    let ids = db.strings("SELECT message_id FROM mail_queue").await;
    let lost = ids.iter().filter(|id| !seen.contains_key(*id)).count();
    let duplicates = got.len() - seen.len();
    eprintln!("silent connections: lost {lost}, duplicates {duplicates}");
    assert_eq!(lost, 0);
    // Only a mail whose "." went out just before the silence can come twice.
    assert!(duplicates <= 8, "duplicates {duplicates} > mails in flight");
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(20)).await, 0);
}

/// The port of a database URL.
/// SIGTERM while the relay thinks about a mail, and the database goes away
/// until after the shutdown deadline: the mail the relay took is written as
/// sent once the database is back, never released to be sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sent_mail_stays_sent_when_the_database_is_away_at_shutdown() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&["--slow", "2"]);
    let pg_port = url_port(&db.url);
    let db_proxy = Proxy::start(pg_port).await;
    let proxied = db
        .url
        .replacen(&format!(":{pg_port}/"), &format!(":{}/", db_proxy.port), 1);
    let id = db.enqueue(mail("slow-1@example.com", "late reply")).await;
    let mut env = daemon_env(&db, &smtp.url(), &[]);
    env.retain(|(k, _)| k != "TABLEMAIL__DATABASE__URL");
    env.extend([
        ("TABLEMAIL__DATABASE__URL".to_string(), proxied),
        ("TABLEMAIL__DATABASE__STATEMENT_TIMEOUT".into(), "1s".into()),
        ("TABLEMAIL__WORKER__SHUTDOWN_TIMEOUT".into(), "5s".into()),
    ]);
    let mut daemon = Daemon::start(env);
    eventually("the dot sent", Duration::from_secs(15), || async {
        smtp.attempts().len() == 1
    })
    .await;
    db_proxy.set_down(true);
    daemon.signal("TERM");
    // The finalizer gives up at the deadline; the last writes are tried again.
    daemon
        .wait_for_log("could not write the last outcomes", Duration::from_secs(40))
        .await;
    db_proxy.set_down(false);
    assert_eq!(daemon.wait_exit(Duration::from_secs(30)).await, 0);
    let row = db.row(id).await;
    assert_eq!(
        (row.status.as_str(), row.attempts, row.locked),
        ("sent", 1, false),
        "{}",
        daemon.output()
    );
    assert_eq!(smtp.received().len(), 1);
}

fn url_port(url: &str) -> u16 {
    let authority = url.split("://").nth(1).unwrap().split('/').next().unwrap();
    authority.rsplit(':').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_reach_the_relay_as_written() {
    let Some(db) = TestDb::sqlite().await else {
        return;
    };
    let smtp = SmtpServer::start(&["--auth", "007:00042"]);
    let env = daemon_env(
        &db,
        &smtp.url(),
        &[
            ("TABLEMAIL__TRANSPORT__USERNAME", "007"),
            ("TABLEMAIL__TRANSPORT__PASSWORD", "00042"),
            ("TABLEMAIL__TRANSPORT__ALLOW_PLAINTEXT_AUTH", "true"),
        ],
    );
    let id = db.enqueue(mail("a@example.com", "auth")).await;
    let mut daemon = Daemon::start(env);
    eventually("sent after AUTH", Duration::from_secs(15), || async {
        db.row(id).await.status == "sent"
    })
    .await;
    assert_eq!(smtp.received().len(), 1);
    assert!(smtp
        .auths()
        .iter()
        .any(|a| a.login.as_deref() == Some("007")));
    assert!(daemon.logged("relay unavailable").is_empty());
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

/// `smtp://` with a username: the password would cross the network in
/// clear. Refused (a configuration fault: `check` fails naming the key, an
/// error at start, `/healthz` 503, the mail waits unspent and the relay never
/// sees AUTH) until `transport.allow_plaintext_auth = true` says the network
/// is trusted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_without_tls_waits_for_the_operator_to_allow_it() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&["--auth", "mailer:clear text pw"]);
    let secrets = TempDir::new();
    let password_file = secrets.path().join("smtp-password");
    std::fs::write(&password_file, "clear text pw\n").unwrap();
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let env = daemon_env(
        &db,
        &smtp.url(),
        &[
            ("TABLEMAIL__TRANSPORT__USERNAME", "mailer"),
            (
                "TABLEMAIL__TRANSPORT__PASSWORD_FILE",
                password_file.to_str().unwrap(),
            ),
            ("TABLEMAIL__METRICS__LISTEN", &listen),
        ],
    );
    let (code, out, err) = output(tablemail().envs(env.clone()).arg("check"));
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains(
            "transport.allow_plaintext_auth: false, and transport.url has a username but no TLS"
        ),
        "{out}"
    );
    assert!(err.contains("transport.allow_plaintext_auth"), "{err}");

    let id = db.enqueue(mail("a@example.com", "waits")).await;
    let mut daemon = Daemon::start(env.clone());
    let said = daemon
        .wait_for_log(
            "configuration fault: AUTH without TLS refused (transport.allow_plaintext_auth is false): this relay gets no mail",
            Duration::from_secs(20),
        )
        .await;
    assert_eq!(said["level"], "ERROR");
    assert_eq!(said["relay"], "transport.url");
    // Found at the start probe, then again by the probe that ends the
    // first pause: the claimer had its chance, and claimed nothing.
    eventually("a second refusal", Duration::from_secs(20), || async {
        daemon.logged("relay unavailable").len() >= 2
    })
    .await;
    let refused = daemon.logged("relay unavailable").remove(1);
    assert_eq!(refused["level"], "ERROR", "{refused}");
    assert!(
        refused["error"]
            .as_str()
            .unwrap()
            .contains("transport.allow_plaintext_auth is false"),
        "{refused}"
    );
    eventually("/healthz answers", Duration::from_secs(10), || async {
        http::try_get(metrics_port, "/healthz", None).is_ok()
    })
    .await;
    let health = http::get(metrics_port, "/healthz", None);
    assert_eq!(health.status, 503, "{}", health.body);
    assert!(
        health.body.contains("transport.allow_plaintext_auth"),
        "{}",
        health.body
    );
    let row = db.row(id).await;
    assert_eq!(
        (row.status.as_str(), row.attempts, row.attempts_remaining),
        ("queued", 0, 5),
        "{row:?}"
    );
    assert!(smtp.auths().is_empty(), "the relay saw AUTH in clear");
    assert!(smtp.received().is_empty());
    assert!(
        !daemon.output().contains("clear text pw"),
        "password logged"
    );
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);

    // The operator says the network is trusted: the same mail goes, once.
    let mut allowed = env;
    allowed.push((
        "TABLEMAIL__TRANSPORT__ALLOW_PLAINTEXT_AUTH".into(),
        "true".into(),
    ));
    let (code, out, err) = output(tablemail().envs(allowed.clone()).arg("check"));
    assert_eq!(code, 0, "{out}{err}");
    let mut daemon = Daemon::start(allowed);
    eventually("sent after AUTH", Duration::from_secs(20), || async {
        db.row(id).await.status == "sent"
    })
    .await;
    let row = db.row(id).await;
    assert_eq!((row.attempts, row.attempts_remaining), (1, 4), "{row:?}");
    let auths = smtp.auths();
    assert!(
        auths
            .iter()
            .any(|a| a.login.as_deref() == Some("mailer") && !a.tls),
        "{auths:?}"
    );
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_on_mariadb_with_a_slow_relay_never_deadlock() {
    let Some(db) = TestDb::mysql().await else {
        return;
    };
    const MAILS: usize = 2000;
    // Every reply to "." takes 0.2 s; locks go stale after 3 s, so renewal
    // (every second) runs beside the group commits all the time.
    let smtp = SmtpServer::start(&["--slow", "0.2"]);
    let mails: Vec<NewMail> = (0..MAILS)
        .map(|i| mail(&format!("slow-{i}@example.com"), "x"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let env = daemon_env(
        &db,
        &smtp.url(),
        &[
            ("TABLEMAIL__WORKER__LOCK_TIMEOUT", "3s"),
            ("TABLEMAIL__WORKER__BATCH_SIZE", "20"),
        ],
    );
    let mut a = Daemon::start(env.clone());
    let mut b = Daemon::start(env);
    eventually("every mail sent", Duration::from_secs(90), || async {
        db.count("status = 'sent'").await == MAILS as i64
    })
    .await;
    for d in [&a, &b] {
        d.signal("TERM");
    }
    assert_eq!(a.wait_exit(Duration::from_secs(15)).await, 0);
    assert_eq!(b.wait_exit(Duration::from_secs(15)).await, 0);
    for d in [&a, &b] {
        let trouble: Vec<_> = d
            .logs()
            .into_iter()
            .filter(|l| {
                let error = l["error"].as_str().unwrap_or_default();
                error.contains("Deadlock")
                    || error.contains("(40001)")
                    || l["message"] == "lock renewal failed"
            })
            .collect();
        assert!(trouble.is_empty(), "{trouble:?}");
    }
    let received = smtp.received();
    let mut ids: Vec<String> = received
        .iter()
        .map(|m| m.header("Message-ID").unwrap())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), MAILS, "every mail arrived");
    assert_eq!(received.len(), MAILS, "no mail twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_wide_throttling_recovers_within_seconds_of_its_end() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let dir = TempDir::new();
    let throttle = dir.path().join("throttle");
    let smtp = SmtpServer::start(&["--throttle-file", throttle.to_str().unwrap()]);
    let env = daemon_env(
        &db,
        &smtp.url(),
        &[
            ("TABLEMAIL__WORKER__RETRY_BASE", "2s"),
            ("TABLEMAIL__WORKER__RETRY_MAX", "5s"),
        ],
    );
    let mut daemon = Daemon::start(env);
    // A steady 200 mails a second, to many domains.
    let feeding = tokio_util::sync::CancellationToken::new();
    let feeder = {
        let (store, stop) = (db.store.clone(), feeding.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            while !stop.is_cancelled() {
                tick.tick().await;
                let mails: Vec<NewMail> = (0..20)
                    .map(|i| mail(&format!("u{n}x{i}@d{}.example", (n + i) % 50), "steady"))
                    .collect();
                store.enqueue(&mails).await.unwrap();
                n += 1;
            }
        })
    };
    let sent = || db.count("status = 'sent'");
    eventually("the steady flow", Duration::from_secs(20), || async {
        sent().await >= 1000
    })
    .await;
    std::fs::write(&throttle, "").unwrap();
    tokio::time::sleep(Duration::from_secs(30)).await;
    let backlog_at_end = db.count("status <> 'sent'").await;
    std::fs::remove_file(&throttle).unwrap();
    let ended = Instant::now();
    eprintln!("throttling ended at {:?}", std::time::SystemTime::now());
    // Every mail queued before the throttling ended is sent within 30 s (at
    // the offered 200/s, only the mail of the last moment would be waiting).
    let created_before = db
        .scalar_i64("SELECT coalesce(max(id), 0) FROM mail_queue")
        .await;
    eventually(
        "the backlog of the throttled half minute drained",
        Duration::from_secs(30),
        || async {
            db.count(&format!("id <= {created_before} AND status <> 'sent'"))
                .await
                == 0
        },
    )
    .await;
    eprintln!(
        "relay-wide 421 for 30 s: {backlog_at_end} mails waiting at its end, all sent {:.1}s later",
        ended.elapsed().as_secs_f64()
    );
    if std::env::var("TEST_DEBUG").is_ok() {
        for l in daemon.logs() {
            let m = l["message"].as_str().unwrap_or_default();
            if m.contains("relay") || m.contains("throttling") {
                eprintln!("{} {m} {}", l["timestamp"], l["rate_per_second"]);
            }
        }
    }
    feeding.cancel();
    feeder.await.unwrap();
    assert_eq!(db.count("status = 'failed'").await, 0, "no mail burned");
    assert!(!daemon.logged("relay throttling: slowing down").is_empty());
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(15)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_daemon_holds_about_two_seconds_of_mail() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let sink = SmtpSink::start(&[]);
    let mails: Vec<NewMail> = (0..300)
        .map(|i| mail(&format!("u{i}@example.com"), "paced"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let env = daemon_env(&db, &sink.url(), &[("TABLEMAIL__WORKER__RATE_LIMIT", "10")]);
    let mut daemon = Daemon::start(env);
    eventually("the first mails", Duration::from_secs(10), || async {
        db.count("status = 'sent'").await >= 5
    })
    .await;
    // Other daemons can take everything this one has not claimed: at 10
    // mails a second it holds no more than 20, never whole batches of 100.
    let mut most = 0;
    for _ in 0..30 {
        most = most.max(db.count("status = 'sending'").await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!((1..=20).contains(&most), "held {most} rows at 10 mails/s");
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    assert_eq!(db.count("status = 'sending'").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_step_renews_its_locks_and_retries_its_commit() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    // The relay answers "." after 5 s; locks go stale after 3 s; the step
    // reaches the database through a proxy that will go silent.
    let smtp = SmtpServer::start(&["--slow", "5"]);
    let mut s = settings(&db, &smtp.url());
    s.worker.lock_timeout = Duration::from_secs(3);
    s.transport.data_timeout = Duration::from_secs(20);
    let pg_port = url_port(&db.url);
    let db_proxy = Proxy::start(pg_port).await;
    let proxied = db
        .url
        .replacen(&format!(":{pg_port}/"), &format!(":{}/", db_proxy.port), 1);
    let options = tablemail::store::ConnectOptions {
        statement_timeout: Duration::from_secs(2),
        ..tablemail::store::ConnectOptions::new(4)
    };
    let store = tablemail::store::connect_with(&proxied, options)
        .await
        .unwrap();
    let worker = tablemail::worker::Worker::new(
        store,
        std::sync::Arc::new(tablemail::commands::build_transport(&s).unwrap()),
        s.worker.clone(),
        s.retention.clone(),
        tablemail::commands::message_defaults(&s).unwrap(),
        "test.example".into(),
    );
    let id = db.enqueue(mail("slow-1@example.com", "step")).await;
    let step = tokio::spawn({
        let worker = worker.clone();
        async move { worker.process_batch().await }
    });
    eventually("the mail past the dot", Duration::from_secs(10), || async {
        smtp.attempts().len() == 1
    })
    .await;
    // Another daemon sweeps for stale locks while the relay thinks...
    let mut released = 0;
    for _ in 0..15 {
        released += db
            .store
            .release_stale_locks(Duration::from_secs(3), &[])
            .await
            .unwrap()
            .len();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // ...and the step's connections to the database go silent before its
    // commit: the commit times out and is retried on a new connection.
    let before = db_proxy.connections();
    db_proxy.blackhole();
    let report = step.await.unwrap().unwrap();
    assert_eq!(released, 0, "a live batch was taken for stale");
    assert_eq!(report.sent, 1, "{report:?}");
    assert!(
        db_proxy.connections() > before,
        "the commit found a new connection"
    );
    let row = db.row(id).await;
    assert_eq!((row.status.as_str(), row.attempts), ("sent", 1));
    assert_eq!(smtp.attempts().len(), 1, "sent once");
}

/// Makes the next transaction that leaves a row of `mail_queue` in `status`
/// hold its commit 3 s (once; a deferred trigger runs at COMMIT): the
/// daemon, whose deadline is 2 s, stops waiting for an answer while the
/// server goes on and commits.
async fn hold_the_next_update_to(db: &TestDb, status: &str) {
    db.exec_script(&format!(
        r#"
CREATE TABLE hold_armed (armed boolean);
INSERT INTO hold_armed VALUES (true);
CREATE FUNCTION hold_the_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = '{status}' THEN
        DELETE FROM hold_armed;
        IF FOUND THEN
            PERFORM pg_sleep(3);
        END IF;
    END IF;
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER hold_the_update AFTER UPDATE ON mail_queue
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hold_the_update();
"#
    ))
    .await;
}

/// `n` mails queued, then a daemon with a 2 s deadline on every database
/// call (and `extra` settings) sending them into a fresh sink.
async fn drain_with_short_deadlines(
    db: &TestDb,
    n: usize,
    extra: &[(&str, &str)],
) -> (SmtpSink, Daemon) {
    let mails: Vec<NewMail> = (0..n)
        .map(|i| mail(&format!("held{i}@example.com"), "an answer lost"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let sink = SmtpSink::start(&[]);
    let mut settings = vec![("TABLEMAIL__DATABASE__STATEMENT_TIMEOUT", "2s")];
    settings.extend_from_slice(extra);
    let daemon = Daemon::start(daemon_env(db, &sink.url(), &settings));
    (sink, daemon)
}

/// A claim that commits on the server while its answer never reaches the
/// daemon leaves rows `sending` under a lock no daemon holds. The daemon puts
/// them back, their attempt refunded, as soon as the database answers, not
/// after `worker.lock_timeout` (10 minutes here), and each mail goes out once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_answer_is_lost_gives_its_rows_back_unspent() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    const MAILS: usize = 20;
    hold_the_next_update_to(&db, "sending").await;
    let (sink, daemon) =
        drain_with_short_deadlines(&db, MAILS, &[("TABLEMAIL__WORKER__LOCK_TIMEOUT", "10m")]).await;
    // Well within worker.lock_timeout: the sweep cannot be what frees them.
    eventually("every mail sent", Duration::from_secs(60), || async {
        db.count("status = 'sent'").await == MAILS as i64
    })
    .await;
    daemon
        .wait_for_log(
            "claim whose answer was lost: its rows are queued again, attempt refunded",
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(
        db.count("attempts = 1 AND attempts_remaining = 4").await,
        MAILS as i64,
        "the lost claim's attempt was not refunded"
    );
    sink.wait_for_mails(MAILS, Duration::from_secs(10)).await;
    let seen = message_id_counts(&sink.mails());
    assert_eq!(seen.len(), MAILS);
    assert!(
        seen.values().all(|n| *n == 1),
        "a mail went out twice: {seen:?}"
    );
}

/// A group commit that commits on the server while its answer never
/// reaches the daemon is tried again; the retry finds the rows already
/// written by the first try and counts them as sent, not as locks lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_is_lost_is_not_taken_for_a_lost_lock() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    const MAILS: usize = 20;
    hold_the_next_update_to(&db, "sent").await;
    let (sink, daemon) = drain_with_short_deadlines(&db, MAILS, &[]).await;
    eventually("every mail sent", Duration::from_secs(60), || async {
        db.count("status = 'sent'").await == MAILS as i64
    })
    .await;
    // The first try timed out, and the retry found its rows written.
    daemon
        .wait_for_log(
            "outcomes already written by the try whose answer was lost",
            Duration::from_secs(30),
        )
        .await;
    eventually(
        "a `mail sent` line per mail",
        Duration::from_secs(10),
        || async { daemon.logged("mail sent").len() == MAILS },
    )
    .await;
    assert!(
        daemon
            .logged("mail lock lost: outcome not written")
            .is_empty(),
        "{}",
        daemon.tail(40)
    );
    sink.wait_for_mails(MAILS, Duration::from_secs(10)).await;
    assert!(message_id_counts(&sink.mails()).values().all(|n| *n == 1));
}
