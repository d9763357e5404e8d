//! The binary as a user runs it: exit codes, printed ids, status, the daemon's
//! JSON logs and its shutdown on SIGTERM.

mod support;

use std::{io::Write, process::Stdio, time::Duration};

use support::*;

#[test]
fn bad_configuration_exits_2_naming_the_key() {
    let dir = TempDir::new();
    let file = dir.path().join("tablemail.toml");
    std::fs::write(&file, "[worker]\nconcurrency = 4\nbogus = true\n").unwrap();
    let file = file.to_str().unwrap();
    // (arguments, environment, what the message must name)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: [Case; 7] = [
        (
            &["status"],
            &[("TABLEMAIL__WORKER__CONCURENCY", "4")],
            &["concurency"],
        ),
        (
            &["status"],
            &[("TABLEMAIL__WORKER__BATCH_SIZE", "lots")],
            &["batch_size"],
        ),
        (
            &["check"],
            &[("TABLEMAIL__DATABASE__URL", "redis://localhost")],
            &["database.url", "redis"],
        ),
        (
            &["status"],
            &[("TABLEMAIL__TRANSPORT__URL", "smtp://relay:twentyfive")],
            &["transport.url"],
        ),
        (&["--config", file, "status"], &[], &["bogus"]),
        (
            &["--config", "/nonexistent/tablemail.toml", "status"],
            &[],
            &["does not exist"],
        ),
        (&["frobnicate"], &[], &["frobnicate"]),
    ];
    for (args, env, named) in cases {
        let (code, _, err) = output(tablemail().args(args).envs(env.iter().copied()));
        assert_eq!(code, 2, "{args:?} {env:?}: {err}");
        for word in named {
            assert!(err.contains(word), "{args:?} {env:?}: {err}");
        }
    }
}

#[test]
fn unreachable_database_is_a_clear_runtime_error() {
    let (code, _, err) = output(tablemail().arg("status").env(
        "TABLEMAIL__DATABASE__URL",
        "postgres://postgres@127.0.0.1:1/nothing",
    ));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("database"), "{err}");
}

#[tokio::test]
async fn migrate_is_idempotent_and_creates_the_contract_table() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    // TestDb migrated already; a second and third run change nothing.
    for _ in 0..2 {
        let (code, out, err) = output(tablemail().arg("migrate").envs(db.env()));
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("migrations applied"), "{out}");
    }
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns WHERE table_name = 'mail_queue' ORDER BY ordinal_position",
    )
    .fetch_all(db.pool())
    .await
    .unwrap();
    assert_eq!(
        columns,
        [
            "id",
            "created_at",
            "send_at",
            "priority",
            "status",
            "attempts_remaining",
            "attempts",
            "thread_lock",
            "locked_at",
            "processed_at",
            "from_name",
            "from_address",
            "to_address",
            "cc",
            "bcc",
            "reply_to",
            "subject",
            "body",
            "body_html",
            "headers",
            "message_id",
            "dedupe_key",
            "last_error",
            "relay_down_count",
            "relay_reply",
            "retried_at",
            "bounced_at",
            "bypass_suppression",
            "relay_queue_id",
            "route",
            "template",
            "template_data",
            "locale"
        ]
    );
    // The history, attachments and daemons live in tables of their own.
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = 'public' ORDER BY table_name",
    )
    .fetch_all(db.pool())
    .await
    .unwrap();
    assert_eq!(
        tables,
        [
            "mail_attachment",
            "mail_event",
            "mail_feedback",
            "mail_limit",
            "mail_limit_use",
            "mail_queue",
            "mail_suppression",
            "mail_template",
            "tablemail_daemon",
            "tablemail_migrations",
            "tablemail_minute"
        ]
    );
    // The checks refuse what the life cycle never produces.
    let bad =
        sqlx::query("INSERT INTO mail_queue (to_address, status) VALUES ('a@example.com', 'lost')")
            .execute(db.pool())
            .await;
    assert!(bad.is_err());
    let bad = sqlx::query(
        "INSERT INTO mail_queue (to_address, attempts_remaining) VALUES ('a@example.com', 0)",
    )
    .execute(db.pool())
    .await;
    assert!(bad.is_err());
}

/// `tablemail enqueue --jsonl` with `input` on stdin.
fn enqueue_jsonl(env: &[(String, String)], input: &str) -> std::process::Output {
    let mut child = tablemail()
        .envs(env.iter().cloned())
        .args(["enqueue", "--jsonl"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[tokio::test]
async fn enqueue_prints_ids_and_status_counts_them() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let env = || {
        let mut e = db.env();
        e.push((
            "TABLEMAIL__DEFAULTS__FROM_ADDRESS".into(),
            "shop@example.com".into(),
        ));
        e
    };
    let (code, out, err) = output(tablemail().envs(env()).args([
        "enqueue",
        "--to",
        "a@example.com",
        "--subject",
        "Hi",
        "--body",
        "Hello",
        "--priority",
        "-3",
        "--header",
        "X-Campaign: spring",
        "--send-at",
        "1h",
        "--dedupe-key",
        "k1",
    ]));
    assert_eq!(code, 0, "{err}");
    let first: i64 = out.trim().parse().expect("an id");

    let out = enqueue_jsonl(
        &env(),
        concat!(
            r#"{"to_address": "b@example.com", "subject": "one"}"#,
            "\n",
            r#"{"to_address": "c@example.com", "subject": "two", "headers": {"X-A": "1"}, "priority": 2}"#,
            "\n",
            "\n",
            r#"{"to_address": "d@example.com", "subject": "dup", "dedupe_key": "k1"}"#,
            "\n",
        ),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: Vec<i64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(ids.len(), 3);
    assert_eq!(ids[2], first, "a taken dedupe_key reports the existing row");
    assert!(String::from_utf8_lossy(&out.stderr).contains("exists already"));

    // Bad input: exit 2, nothing inserted (the whole batch is refused).
    let out = enqueue_jsonl(
        &env(),
        "{\"to_address\": \"ok@example.com\"}\n{\"to_address\": \"not an address\"}\n",
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
    for bad in [
        vec!["enqueue", "--to", "a@example.com", "--subject", "x\r\ny"],
        vec!["enqueue", "--to", "", "--subject", "nobody"],
        vec!["enqueue", "--to", "a@example.com", "--header", "NoColon"],
        vec!["enqueue", "--to", "a@example.com", "--send-at", "whenever"],
    ] {
        let (code, _, err) = output(tablemail().envs(env()).args(&bad));
        assert_eq!(code, 2, "{bad:?}: {err}");
    }
    // With a relay and no sender anywhere (the file transport of the
    // embedded defaults would use its development sender).
    let (code, _, err) = output(
        tablemail()
            .envs(db.env())
            .env("TABLEMAIL__TRANSPORT__URL", "smtp://127.0.0.1:25")
            .args(["enqueue", "--to", "a@example.com"]),
    );
    assert_eq!(code, 2, "no sender anywhere: {err}");
    assert!(err.contains("no sender"), "{err}");

    assert_eq!(db.scalar_i64("SELECT count(*) FROM mail_queue").await, 3);
    let row = sqlx::query_as::<_, (i32, Option<String>, bool)>(
        "SELECT priority, headers->>'X-Campaign', send_at > now() + interval '50 minutes' FROM mail_queue WHERE id = $1",
    )
    .bind(first)
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(row, (-3, Some("spring".into()), true));

    let (code, out, err) = output(tablemail().envs(db.env()).args(["status", "--json"]));
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["counts"]["queued"], 3);
    assert!(status["oldest_due_age_seconds"].as_f64().unwrap() >= 0.0);
    assert_eq!(status["stale_locks"], 0);

    let (code, out, _) = output(tablemail().envs(db.env()).arg("status"));
    assert_eq!(code, 0);
    let queued: Vec<&str> = out
        .lines()
        .find(|l| l.trim_start().starts_with("queued"))
        .map(|l| l.split_whitespace().take(2).collect())
        .unwrap_or_default();
    assert_eq!(queued, ["queued", "3"], "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_sends_logs_json_and_exits_0_on_sigterm() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let mut daemon = Daemon::start(daemon_env(&db, &smtp.url(), &[]));
    daemon
        .wait_for_log("worker started", Duration::from_secs(10))
        .await;
    let mails: Vec<_> = (0..20)
        .map(|i| mail(&format!("secret.person{i}@example.org"), &format!("m{i}")))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    eventually("20 mails sent", Duration::from_secs(10), || async {
        db.scalar_i64("SELECT count(*) FROM mail_queue WHERE status = 'sent'")
            .await
            == 20
    })
    .await;
    assert_eq!(smtp.received().len(), 20);

    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);

    let sent = daemon.logged("mail sent");
    assert_eq!(sent.len(), 20);
    for l in &sent {
        for field in [
            "timestamp",
            "level",
            "mail_id",
            "lock",
            "attempt",
            "outcome",
            "smtp_code",
            "elapsed_ms",
        ] {
            assert!(!l[field].is_null(), "{field} missing in {l}");
        }
        assert_eq!(l["outcome"], "sent");
        assert_eq!(l["smtp_code"], 250);
        assert_eq!(l["domain"], "example.org");
    }
    let all = daemon.output();
    assert!(
        !all.contains("secret.person"),
        "a full recipient address was logged"
    );
    assert!(!all.contains("Body of"), "a body was logged");
    assert!(!daemon.logged("worker stopped").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_mail_in_flight_finish() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&["--slow", "1.5"]);
    let mut daemon = Daemon::start(daemon_env(&db, &smtp.url(), &[]));
    let id = db.enqueue(mail("slow-1@example.com", "slow one")).await;
    eventually(
        "the mail to be in flight",
        Duration::from_secs(10),
        || async { db.row(id).await.status == "sending" },
    )
    .await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    let row = db.row(id).await;
    assert_eq!(row.status, "sent", "{row:?}");
    assert_eq!(smtp.received().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_defaults_write_eml_files_and_wake_at_once() {
    // The README's first command, on a machine with nothing else installed:
    // SQLite in ./tablemail.db, mails as .eml files in ./outbox.
    let dir = TempDir::new();
    let mut daemon = Daemon::start_in(
        dir.path(),
        vec![
            // Polling alone would take a minute: the wake-up must do it.
            (
                "TABLEMAIL__WORKER__POLL_INTERVAL".to_string(),
                "60s".to_string(),
            ),
        ],
    );
    daemon
        .wait_for_log("worker started", Duration::from_secs(20))
        .await;
    let warning = daemon
        .logs()
        .into_iter()
        .find(|l| l["level"] == "WARN" && l["message"].as_str().unwrap().contains("file transport"))
        .expect("a warning that no mail leaves the machine");
    assert!(warning["message"]
        .as_str()
        .unwrap()
        .contains("do not leave this machine"));
    assert!(dir.path().join("tablemail.db").exists());

    let (code, out, err) = output(tablemail().current_dir(dir.path()).args([
        "enqueue",
        "--from",
        "me@example.com",
        "--to",
        "you@example.com",
        "--subject",
        "Hi",
        "--body",
        "Hello",
    ]));
    assert_eq!(code, 0, "{err}");
    let id: i64 = out.trim().parse().unwrap();
    let eml = dir.path().join("outbox").join(format!("{id}.eml"));
    eventually("the .eml file", Duration::from_secs(10), || async {
        eml.exists()
    })
    .await;
    let text = std::fs::read_to_string(&eml).unwrap();
    assert!(text.contains("Subject: Hi\r\n"), "{text}");
    assert!(text.contains("To: you@example.com\r\n"), "{text}");
    assert!(text.contains("Hello"), "{text}");

    // The README's smallest insert, as written there: no sender, none
    // configured. On the embedded defaults it still becomes a .eml file.
    let readme = include_str!("../README.md");
    let smallest = readme
        .lines()
        .find(|l| l.starts_with("INSERT INTO mail_queue (to_address, subject, body)"))
        .expect("the README shows its smallest insert");
    let pool = sqlx::SqlitePool::connect(&format!(
        "sqlite://{}",
        dir.path().join("tablemail.db").display()
    ))
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(smallest.to_string()))
        .execute(&pool)
        .await
        .unwrap();
    let id: i64 = sqlx::query_scalar("SELECT max(id) FROM mail_queue")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    let eml = dir.path().join("outbox").join(format!("{id}.eml"));
    eventually(
        "the smallest insert's .eml",
        Duration::from_secs(10),
        || async { eml.exists() },
    )
    .await;
    let text = std::fs::read_to_string(&eml).unwrap();
    assert!(text.contains("From: tablemail@localhost\r\n"), "{text}");

    // The .eml is written before the outcome is committed: wait for both.
    let status = || {
        let (code, out, err) = output(
            tablemail()
                .current_dir(dir.path())
                .args(["status", "--json"]),
        );
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    eventually(
        "both mails written as sent",
        Duration::from_secs(10),
        || async { status()["counts"]["sent"] == 2 },
    )
    .await;
    let status = status();
    assert_eq!(status["backend"], "sqlite");
    assert_eq!(status["relays"][0]["reachable"], true);

    daemon.signal("INT");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}
