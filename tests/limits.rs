//! Send caps shared by every daemon (DESIGN §16), against the daemon binary,
//! each database and a real SMTP server: several daemons against one cap,
//! counted in every sliding window by when the server received each mail; a
//! daemon killed while it holds room under a cap; a warm-up day; mails a cap
//! does not count never delayed by it; room given back by mails the relay
//! refused before ".". Windows are a few seconds long, or an hour where
//! nothing may wait for one.

mod support;

use std::time::Duration;

use support::*;
use tablemail::store::NewMail;

for_each_backend!(
    two_daemons_never_send_more_than_the_cap_in_any_window,
    four_daemons_never_send_more_than_the_cap_in_any_window,
    a_daemon_killed_holding_room_neither_leaks_it_nor_lets_others_overshoot,
    a_warm_up_day_holds_the_cap_to_the_days_maximum,
    mails_a_cap_does_not_count_are_never_delayed_by_it,
    room_is_given_back_when_the_relay_refused_before_the_dot,
);

/// A configuration file with these `[[limits]]` tables.
fn config(dir: &TempDir, limits: &str) -> std::path::PathBuf {
    let path = dir.path().join("tablemail.toml");
    std::fs::write(&path, limits).unwrap();
    path
}

/// The most receipts any window of `per` holds, by the server's clock.
fn busiest_window(received: &[Received], per: Duration) -> usize {
    let mut times: Vec<f64> = received
        .iter()
        .map(|r| r.received_at.expect("a receipt time"))
        .collect();
    times.sort_by(f64::total_cmp);
    (0..times.len())
        .map(|i| {
            times[i..]
                .iter()
                .take_while(|t| **t - times[i] < per.as_secs_f64())
                .count()
        })
        .max()
        .unwrap_or(0)
}

fn env(db: &TestDb, smtp: &SmtpServer, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut all = vec![
        ("TABLEMAIL__WORKER__LOCK_TIMEOUT", "3s"),
        ("TABLEMAIL__WORKER__POLL_INTERVAL", "100ms"),
        ("TABLEMAIL__DATABASE__LOOK_INTERVAL", "50ms"),
    ];
    all.extend_from_slice(extra);
    daemon_env(db, &smtp.url(), &all)
}

async fn daemons_against_one_cap(db: TestDb, daemons: usize) {
    const MAX: usize = 4;
    const PER: Duration = Duration::from_secs(2);
    const MAILS: usize = 12;
    let smtp = SmtpServer::start(&[]);
    let dir = TempDir::new();
    let path = config(
        &dir,
        r#"
[[limits]]
name = "ses-quota"
from_domain = ["example.com"]
max = 4
per = "2s"
"#,
    );
    for i in 0..MAILS {
        db.enqueue(mail(&format!("user{i}@example.org"), &format!("m{i}")))
            .await;
    }
    let running: Vec<Daemon> = (0..daemons)
        .map(|_| Daemon::start_config(&path, env(&db, &smtp, &[])))
        .collect();
    eventually("every mail sent", Duration::from_secs(60), || async {
        db.count("status = 'sent'").await == MAILS as i64
    })
    .await;
    let received = smtp.received();
    assert_eq!(received.len(), MAILS, "each mail once");
    let busiest = busiest_window(&received, PER);
    assert!(
        busiest <= MAX,
        "{busiest} mails within {PER:?} (cap {MAX}) with {daemons} daemons"
    );
    // The mails that waited spent no attempt, and their history names the cap.
    for row in db.rows().await {
        assert_eq!(row.attempts, 1, "{row:?}");
    }
    let waited = db
        .count_in(
            "mail_event",
            "outcome = 'deferred' AND stage = 'limit' AND detail LIKE '%ses-quota%'",
        )
        .await;
    assert!(waited >= (MAILS - MAX) as i64, "{waited} deferrals");
    let reached: usize = running
        .iter()
        .map(|d| d.logged("send cap reached: mails it counts wait").len())
        .sum();
    assert!(reached >= 1, "a log line when the cap is reached");
}

async fn two_daemons_never_send_more_than_the_cap_in_any_window(db: TestDb) {
    daemons_against_one_cap(db, 2).await;
}

async fn four_daemons_never_send_more_than_the_cap_in_any_window(db: TestDb) {
    daemons_against_one_cap(db, 4).await;
}

async fn a_daemon_killed_holding_room_neither_leaks_it_nor_lets_others_overshoot(db: TestDb) {
    const MAX: usize = 3;
    const PER: Duration = Duration::from_secs(3);
    // Its DATA answered after 1.5 s: the first daemon dies while the relay
    // holds its mails, which may or may not arrive.
    let smtp = SmtpServer::start(&["--slow", "1.5"]);
    let dir = TempDir::new();
    let path = config(
        &dir,
        r#"
[[limits]]
name = "daily"
from_domain = ["example.com"]
max = 3
per = "3s"
"#,
    );
    for i in 0..3 {
        db.enqueue(NewMail {
            priority: Some(10),
            ..mail(&format!("slow-{i}@example.org"), &format!("slow {i}"))
        })
        .await;
    }
    for i in 0..5 {
        db.enqueue(mail(&format!("user{i}@example.org"), &format!("m{i}")))
            .await;
    }
    let mut first = Daemon::start_config(&path, env(&db, &smtp, &[]));
    eventually(
        "the first daemon's sends under way",
        Duration::from_secs(20),
        || async { smtp.attempts().len() >= MAX },
    )
    .await;
    first.signal("KILL");
    first.wait_exit(Duration::from_secs(10)).await;
    let others: Vec<Daemon> = (0..2)
        .map(|_| Daemon::start_config(&path, env(&db, &smtp, &[])))
        .collect();
    // Not leaked: the dead daemon's room comes back, and every mail goes.
    eventually("every mail sent", Duration::from_secs(60), || async {
        db.count("status = 'sent'").await == 8
    })
    .await;
    let received = smtp.received();
    let busiest = busiest_window(&received, PER);
    assert!(
        busiest <= MAX,
        "{busiest} of {} mails within {PER:?} (cap {MAX}); the second daemons logged:\n{}",
        received.len(),
        others[0].tail(30)
    );
}

async fn a_warm_up_day_holds_the_cap_to_the_days_maximum(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let dir = TempDir::new();
    let today = chrono::Utc::now().date_naive().format("%Y-%m-%d");
    let path = config(
        &dir,
        &format!(
            r#"
[[limits]]
name = "new-domain"
from_domain = ["example.com"]
max = 1000
per = "1h"
warmup = [3, 100]
warmup_start = "{today}"
"#
        ),
    );
    let (port, console_port) = (free_port(), free_port());
    let (listen, console) = (
        format!("127.0.0.1:{port}"),
        format!("127.0.0.1:{console_port}"),
    );
    for i in 0..6 {
        db.enqueue(mail(&format!("user{i}@example.org"), &format!("m{i}")))
            .await;
    }
    let daemon = Daemon::start_config(
        &path,
        env(
            &db,
            &smtp,
            &[
                ("TABLEMAIL__METRICS__LISTEN", listen.as_str()),
                ("TABLEMAIL__CONSOLE__LISTEN", console.as_str()),
            ],
        ),
    );
    eventually(
        "the day's three sent, the others put off to tomorrow",
        Duration::from_secs(30),
        || async {
            db.count("status = 'sent'").await == 3
                && db
                    .count("status = 'queued' AND attempts = 0 AND last_error LIKE '%new-domain%'")
                    .await
                    == 3
        },
    )
    .await;
    // Put off to the next day (UTC midnight), not claimed again meanwhile.
    let tomorrow = match db.backend {
        tablemail::store::Backend::Postgres => "date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + interval '1 day' - interval '1 second'",
        tablemail::store::Backend::Sqlite => "strftime('%Y-%m-%d %H:%M:%f', 'now', 'start of day', '+1 day', '-1 second')",
        tablemail::store::Backend::Mysql => "(TIMESTAMP(UTC_DATE()) + INTERVAL 1 DAY - INTERVAL 1 SECOND)",
    };
    assert_eq!(
        db.count(&format!("status = 'queued' AND send_at > {tomorrow}"))
            .await,
        3
    );
    assert_eq!(smtp.received().len(), 3);
    let metrics = http::get(port, "/metrics", None).body;
    assert!(
        metrics.contains("tablemail_limit_used{limit=\"new-domain\"} 3")
            && metrics.contains("tablemail_limit_max{limit=\"new-domain\"} 3"),
        "{metrics}"
    );
    let overview = http::get(console_port, "/", None).body;
    assert!(
        overview.contains("data-field=\"limit-new-domain\"") && overview.contains("3 of 3"),
        "{overview}"
    );
    let reached = daemon.logged("send cap reached: mails it counts wait");
    assert_eq!(reached.len(), 1, "once per crossing");
    assert_eq!(reached[0]["limit"], "new-domain");
    let status = run_ok(
        tablemail()
            .args(["--config", path.to_str().unwrap(), "status"])
            .envs(db.env()),
    );
    assert!(
        status.contains("new-domain") && status.contains("3 of 3"),
        "{status}"
    );
}

async fn mails_a_cap_does_not_count_are_never_delayed_by_it(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let dir = TempDir::new();
    let path = config(
        &dir,
        r#"
[[limits]]
name = "news"
from_domain = ["news.example"]
max = 2
per = "1h"
"#,
    );
    for i in 0..5 {
        db.enqueue(NewMail {
            from_address: Some("letters@news.example".into()),
            priority: Some(5),
            ..mail(&format!("reader{i}@example.org"), &format!("news {i}"))
        })
        .await;
    }
    for i in 0..10 {
        db.enqueue(mail(&format!("user{i}@example.org"), &format!("order {i}")))
            .await;
    }
    let _daemon = Daemon::start_config(&path, env(&db, &smtp, &[]));
    eventually(
        "the others sent, the news over its cap waiting",
        Duration::from_secs(30),
        || async {
            db.count("status = 'sent'").await == 12
                && db.count("status = 'queued' AND attempts = 0").await == 3
        },
    )
    .await;
    let received = smtp.received();
    let news = received
        .iter()
        .filter(|r| r.mail_from.ends_with("@news.example"))
        .count();
    assert_eq!((news, received.len()), (2, 12));
    // The others waited for nothing: one attempt each, no deferral.
    assert_eq!(
        db.count("from_address IS NULL AND status = 'sent' AND attempts = 1")
            .await,
        10
    );
    assert_eq!(
        db.count_in(
            "mail_event",
            "mail_id IN (SELECT id FROM mail_queue WHERE from_address IS NULL)"
        )
        .await,
        0
    );
}

async fn room_is_given_back_when_the_relay_refused_before_the_dot(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let dir = TempDir::new();
    let path = config(
        &dir,
        r#"
[[limits]]
name = "quota"
from_domain = ["example.com"]
max = 3
per = "1h"
"#,
    );
    // Refused at RCPT: nothing went out, so nothing is counted.
    for i in 0..3 {
        db.enqueue(mail(
            &format!("rcpt550-{i}@example.org"),
            &format!("refused {i}"),
        ))
        .await;
    }
    let daemon = Daemon::start_config(&path, env(&db, &smtp, &[]));
    eventually(
        "the refused mails failed",
        Duration::from_secs(30),
        || async { db.count("status = 'failed'").await == 3 },
    )
    .await;
    // Three mails in one claim, two of them large enough that their content,
    // and so their reservation, comes after the claim: all fit.
    let large = "x".repeat(40 * 1024);
    db.exec(&format!(
        "INSERT INTO mail_queue (to_address, subject, body) VALUES \
         ('ann@example.org', 'small', 'a small one'), \
         ('bob@example.org', 'large 1', '{large}'), \
         ('cy@example.org', 'large 2', '{large}')"
    ))
    .await;
    eventually(
        "the three sent within the hour's cap",
        Duration::from_secs(30),
        || async { db.count("status = 'sent'").await == 3 },
    )
    .await;
    // They are counted: a fourth waits for the window, its attempt unspent.
    let fourth = db.enqueue(mail("dee@example.org", "fourth")).await;
    eventually(
        "the fourth deferred by the cap",
        Duration::from_secs(30),
        || async {
            db.count_in(
                "mail_event",
                &format!("mail_id = {fourth} AND outcome = 'deferred' AND stage = 'limit'"),
            )
            .await
                == 1
        },
    )
    .await;
    let row = db.row(fourth).await;
    assert_eq!(
        (row.status.as_str(), row.attempts),
        ("queued", 0),
        "{row:?}"
    );
    assert!(
        row.scheduled,
        "it waits until the window frees room: {row:?}"
    );
    assert!(
        row.last_error.as_deref().unwrap_or("").contains("quota"),
        "{row:?}"
    );
    let received: Vec<String> = smtp
        .received()
        .iter()
        .flat_map(|r| r.rcpt_tos.clone())
        .collect();
    assert_eq!(received.len(), 3, "{received:?}");
    assert!(
        received.iter().all(|r| !r.starts_with("rcpt550")),
        "{received:?}"
    );
    drop(daemon);
}
