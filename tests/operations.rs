//! Running tablemail in production: /metrics and /healthz over HTTP (the
//! console and the scrape storm are in tests/console.rs), the
//! systemd notify protocol, the operator's commands, the sending pace, and
//! the packaging (systemd unit, Dockerfile) checked with the real tools.

mod support;

use std::{os::unix::net::UnixDatagram, path::Path, process::Command, time::Duration};

use support::*;
use tablemail::store::NewMail;

/// The value of a Prometheus sample line `name{labels} value`.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// `tablemail run` on `db` and the relay with its metrics endpoint on a
/// free port, once the endpoint answers: the daemon, the port, and the
/// environment it runs with.
async fn start_with_metrics(db: &TestDb, relay_url: &str) -> (Daemon, u16, Vec<(String, String)>) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let env = daemon_env(db, relay_url, &[("TABLEMAIL__METRICS__LISTEN", &listen)]);
    let daemon = Daemon::start(env.clone());
    eventually("the metrics endpoint", Duration::from_secs(10), || async {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    })
    .await;
    (daemon, port, env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_health_over_http() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let (mut daemon, port, _) = start_with_metrics(&db, &smtp.url()).await;
    let http::Response { status, body, .. } = http::get(port, "/healthz", None);
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("database: ok") && body.contains("relay: ok"),
        "{body}"
    );

    let mails: Vec<NewMail> = (0..5)
        .map(|i| mail(&format!("u{i}@example.com"), "m"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    db.enqueue(mail("rcpt550-x@example.com", "bounce")).await;
    let mut later = mail("later@example.com", "later");
    later.send_at = Some(chrono::Utc::now() + chrono::Duration::hours(1));
    db.enqueue(later).await;
    eventually("6 mails done", Duration::from_secs(10), || async {
        db.count("status IN ('sent', 'failed')").await == 6
    })
    .await;

    // The queue's figures come from a snapshot read every few seconds.
    eventually(
        "the snapshot to see the rows",
        Duration::from_secs(15),
        || async {
            let metrics = http::get(port, "/metrics", None).body;
            sample(&metrics, r#"tablemail_queue_rows{status="sent"}"#) == Some(5.0)
        },
    )
    .await;
    let metrics = http::get(port, "/metrics", None);
    assert_eq!(metrics.status, 200);
    let metrics = metrics.body;
    let age = sample(&metrics, "tablemail_snapshot_age_seconds").unwrap();
    assert!((0.0..=15.0).contains(&age), "{metrics}");
    assert_eq!(
        sample(&metrics, r#"tablemail_mails_total{outcome="sent"}"#),
        Some(5.0),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, r#"tablemail_mails_total{outcome="failed"}"#),
        Some(1.0)
    );
    assert_eq!(
        sample(&metrics, r#"tablemail_queue_rows{status="sent"}"#),
        Some(5.0)
    );
    assert_eq!(
        sample(&metrics, r#"tablemail_queue_rows{status="queued"}"#),
        Some(1.0)
    );
    assert_eq!(
        sample(&metrics, "tablemail_send_duration_seconds_count"),
        Some(6.0)
    );
    assert_eq!(
        sample(
            &metrics,
            r#"tablemail_send_duration_seconds_bucket{le="+Inf"}"#
        ),
        Some(6.0)
    );
    assert_eq!(
        sample(&metrics, r#"tablemail_relay_up{route="default"}"#),
        Some(1.0)
    );
    assert_eq!(sample(&metrics, "tablemail_database_up"), Some(1.0));
    assert_eq!(
        sample(&metrics, "tablemail_oldest_due_age_seconds"),
        Some(0.0)
    );
    assert!(metrics.contains("# TYPE tablemail_send_duration_seconds histogram"));
    assert_eq!(http::get(port, "/nothing", None).status, 404);

    // The relay goes away: health says so, and so does the gauge.
    drop(smtp);
    db.enqueue(mail("a@example.com", "into the void")).await;
    eventually(
        "health to notice the relay is gone",
        Duration::from_secs(10),
        || async { http::get(port, "/healthz", None).status == 503 },
    )
    .await;
    let body = http::get(port, "/healthz", None).body;
    assert!(body.contains("relay: unavailable"), "{body}");
    assert_eq!(
        sample(
            &http::get(port, "/metrics", None).body,
            r#"tablemail_relay_up{route="default"}"#
        ),
        Some(0.0)
    );

    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

/// A daemon that stops and a command that ends close their database
/// connections politely (the claims', the others', the wake-up listener's,
/// the metrics endpoint's): the server counts no lost client. PostgreSQL
/// counts them in `sessions_abandoned`; MariaDB in `Aborted_clients`, with a
/// line in its error log for each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_daemon_and_an_ended_command_abandon_no_session() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let (mut daemon, port, env) = start_with_metrics(&db, &smtp.url()).await;
    db.exec(
        "INSERT INTO mail_queue (to_address, subject, body) VALUES ('u@example.com', 'm', 'b')",
    )
    .await;
    eventually("the mail sent", Duration::from_secs(10), || async {
        db.count("status = 'sent'").await == 1
    })
    .await;
    assert_eq!(http::get(port, "/healthz", None).status, 200);
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    let (code, _, stderr) = output(tablemail().envs(env).arg("status"));
    assert_eq!(code, 0, "{stderr}");

    // This test's own store (it migrated the database) closes too; a
    // session's statistics are in once its server process has gone.
    db.store.close().await;
    eventually("the sessions to end", Duration::from_secs(10), || async {
        db.scalar_i64(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'tablemail'",
        )
        .await
            == 0
    })
    .await;
    let counted = "SELECT sessions, sessions_abandoned FROM pg_stat_database \
                   WHERE datname = current_database()";
    let (sessions, abandoned): (i64, i64) =
        sqlx::query_as(counted).fetch_one(db.pool()).await.unwrap();
    assert!(
        sessions >= 5,
        "precondition: the daemon's and the command's sessions are counted ({sessions})"
    );
    assert_eq!(abandoned, 0, "of {sessions} sessions");
}

/// `/healthz` answers from the snapshot: a database that stops answering
/// (its connections silent, no reset, new ones never answered) turns it to
/// 503 within seconds, and it comes back when the database answers again,
/// though the connections that went silent never do; the probe never waits
/// for the database itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_follows_a_database_that_goes_silent() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let authority = db
        .url
        .split("://")
        .nth(1)
        .unwrap()
        .split('/')
        .next()
        .unwrap();
    let pg_port: u16 = authority.rsplit(':').next().unwrap().parse().unwrap();
    let proxy = support::proxy::Proxy::start(pg_port).await;
    let proxied = db
        .url
        .replacen(&format!(":{pg_port}/"), &format!(":{}/", proxy.port), 1);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut env = daemon_env(
        &db,
        &smtp.url(),
        &[
            ("TABLEMAIL__METRICS__LISTEN", &listen),
            // Short enough to see the silence soon, long enough that a
            // busy machine's refreshes do not time out on their own.
            ("TABLEMAIL__DATABASE__STATEMENT_TIMEOUT", "4s"),
        ],
    );
    env.push(("TABLEMAIL__DATABASE__URL".into(), proxied));
    let mut daemon = Daemon::start(env);
    eventually("healthy", Duration::from_secs(20), || async {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            && http::get(port, "/healthz", None).status == 200
    })
    .await;
    proxy.set_silent(true);
    eventually(
        "503: database unreachable",
        Duration::from_secs(25),
        || async {
            let started = std::time::Instant::now();
            let http::Response { status, body, .. } = http::get(port, "/healthz", None);
            // Answered from the snapshot, not after a query's deadline.
            assert!(
                started.elapsed() < Duration::from_secs(4),
                "{:?}",
                started.elapsed()
            );
            status == 503 && body.contains("database: unreachable")
        },
    )
    .await;
    assert_eq!(
        sample(
            &http::get(port, "/metrics", None).body,
            "tablemail_database_up"
        ),
        Some(0.0)
    );
    // The database answers again on new connections; the old ones stay
    // silent for good.
    proxy.set_silent(false);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let http::Response { status, body, .. } = http::get(port, "/healthz", None);
        if status == 200 {
            break;
        }
        if std::time::Instant::now() >= deadline {
            panic!(
                "not healthy again 60 s after the database answered again: {status} {body}\nthe daemon said:\n{}",
                daemon.tail(60)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(20)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_hears_ready_watchdog_and_stopping() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let dir = TempDir::new();
    let socket_path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let socket_name = socket_path.display().to_string();
    let env = daemon_env(
        &db,
        &smtp.url(),
        &[("NOTIFY_SOCKET", &socket_name), ("WATCHDOG_USEC", "600000")],
    );
    let mut daemon = Daemon::start(env);
    let mut heard = Vec::new();
    let mut buf = [0u8; 256];
    while heard
        .iter()
        .filter(|m: &&String| *m == "WATCHDOG=1")
        .count()
        < 2
    {
        let n = socket.recv(&mut buf).expect("a notification in time");
        heard.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    assert_eq!(heard[0], "READY=1", "{heard:?}");
    daemon.signal("TERM");
    loop {
        let n = socket.recv(&mut buf).expect("STOPPING=1 in time");
        if &buf[..n] == b"STOPPING=1" {
            break;
        }
    }
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_retry_cancel_purge_check_and_read_status() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let s = settings(&db, &smtp.url());
    let worker = worker(&db, &s);
    let failed = db.enqueue(mail("rcpt550-gone@example.com", "bounce")).await;
    let sent = db.enqueue(mail("ok@example.com", "fine")).await;
    worker.process_batch().await.unwrap();
    let mut later = mail("later@example.com", "later");
    later.send_at = Some(chrono::Utc::now() + chrono::Duration::hours(1));
    let queued = db.enqueue(later).await;
    let smtp_url = smtp.url();
    let run = |args: &[&str]| {
        let out = tablemail()
            .envs(daemon_env(&db, &smtp_url, &[]))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    let (code, out, err) = run(&["status"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("failures in the last hour:"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.trim_start().starts_with("RCPT TO 550") && l.trim_end().ends_with(" 1")),
        "{out}"
    );
    assert!(out.contains("sent per second"), "{out}");
    assert!(
        !out.contains("rcpt550-gone@"),
        "a full address on screen: {out}"
    );
    let (_, out, _) = run(&["status", "--json"]);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["failures_last_hour"]["RCPT TO 550"], 1);
    assert_eq!(json["counts"]["sent"], 1);

    let (code, _, err) = run(&["retry", "--id", &sent.to_string()]);
    assert_eq!(code, 1, "only failed or unknown rows: {err}");
    let (code, out, _) = run(&["retry", "--id", &failed.to_string()]);
    assert_eq!(code, 0);
    assert!(out.contains("1 mails queued again"), "{out}");
    let row = db.row(failed).await;
    assert_eq!((row.status.as_str(), row.attempts_remaining), ("queued", 5));
    let (code, _, _) = run(&["retry"]);
    assert_eq!(code, 2, "retry needs --id or --all-failed");

    let (code, _, _) = run(&["cancel", "--id", &queued.to_string()]);
    assert_eq!(code, 0);
    assert_eq!(db.row(queued).await.status, "cancelled");
    let (code, _, err) = run(&["cancel", "--id", &sent.to_string()]);
    assert_eq!(code, 1, "{err}");

    db.exec(&format!(
        "UPDATE mail_queue SET processed_at = {} WHERE status IN ('sent', 'cancelled')",
        db.minus(db.now(), 40 * 86400)
    ))
    .await;
    let (code, out, _) = run(&["purge"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("2 finished mails deleted"), "{out}");
    assert_eq!(db.count("true").await, 1);

    let (code, out, err) = run(&["check"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("database: postgres reachable"), "{out}");
    assert!(out.contains("relay (transport.url): ok"), "{out}");
    drop(smtp);
    let (code, out, _) = run(&["check"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("unavailable"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_and_throttling_slow_the_daemon() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let env = daemon_env(&db, &smtp.url(), &[("TABLEMAIL__WORKER__RATE_LIMIT", "20")]);
    let mails: Vec<NewMail> = (0..41)
        .map(|i| mail(&format!("u{i}@example.com"), "m"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let mut daemon = Daemon::start(env);
    eventually("41 sent", Duration::from_secs(30), || async {
        db.count("status = 'sent'").await == 41
    })
    .await;
    let arrivals: Vec<f64> = smtp
        .received()
        .iter()
        .map(|m| m.received_at.unwrap())
        .collect();
    let span = arrivals.last().unwrap() - arrivals.first().unwrap();
    // 41 mails at 20 per second start at least 2 s apart, first to last.
    // The relay has each a transaction later, and the first one's (a new
    // connection) can take longer than the last's on a loaded machine: it
    // was seen 70 ms longer, hence the tenth of a second.
    assert!(span >= 1.9, "41 mails in {span:.2}s at rate_limit = 20");

    // "Slow down" (4.7.1) for one recipient domain pauses that domain only.
    db.enqueue(mail("throttle-1@slow.example", "too fast"))
        .await;
    let line = daemon
        .wait_for_log("domain throttling: pausing it", Duration::from_secs(10))
        .await;
    assert_eq!(line["domain"], "slow.example", "{line}");
    assert!(
        daemon.logged("relay throttling: slowing down").is_empty(),
        "one domain's throttling slowed the whole daemon"
    );
    // Throttling for every domain, nothing going through between: the relay
    // itself throttles, and the daemon's pace halves (20/s -> 10/s).
    let mails: Vec<NewMail> = (0..3)
        .map(|i| mail(&format!("throttle-{i}@d{i}.example"), "too fast"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    eventually("the slow-down", Duration::from_secs(10), || async {
        daemon.logs().iter().any(|l| {
            l["message"] == "relay throttling: slowing down" && l["rate_per_second"] == 10.0
        })
    })
    .await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

#[test]
fn the_systemd_unit_verifies_and_is_hardened() {
    let Some(analyze) = tool("systemd-analyze") else {
        return;
    };
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/tablemail.service");
    let text = std::fs::read_to_string(&unit).unwrap();
    assert!(text.contains("Type=notify"));
    // Bounds on memory and threads (a runaway is stopped, not the host).
    // TasksMax leaves room for the runtime's capped thread pools.
    let value = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key}= in the unit"))
            .to_string()
    };
    assert_eq!(value("MemoryMax"), "512M");
    let tasks: usize = value("TasksMax").parse().unwrap();
    let threads =
        1 + tablemail::commands::MAX_WORKER_THREADS + tablemail::commands::MAX_BLOCKING_THREADS + 1;
    // SQLite: a thread for each of its 8 pooled connections, one for the
    // wake-up watcher's connection and one for its file watch.
    assert!(
        tasks >= threads + 8 + 2,
        "TasksMax={tasks} leaves no room for {threads} threads and SQLite's 10"
    );
    // The unit as shipped, with ExecStart at the binary under test.
    let dir = TempDir::new();
    let copy = dir.path().join("tablemail.service");
    std::fs::write(
        &copy,
        text.replace("/usr/bin/tablemail", env!("CARGO_BIN_EXE_tablemail")),
    )
    .unwrap();
    let verify = Command::new(&analyze)
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .unwrap();
    let complaints = String::from_utf8_lossy(&verify.stderr);
    assert!(
        verify.status.success() && complaints.trim().is_empty(),
        "{complaints}"
    );

    let security = Command::new(&analyze)
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&copy)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&security.stdout);
    let exposure: f64 = report
        .lines()
        .find_map(|l| {
            l.split_once("Overall exposure level for")?
                .1
                .split(':')
                .nth(1)
        })
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in {report}"));
    assert!(
        exposure <= 2.0,
        "systemd-analyze security rates the unit {exposure}"
    );
}

#[test]
fn the_dockerfile_passes_hadolint() {
    let Some(hadolint) = tool("hadolint") else {
        return;
    };
    let dockerfile = Path::new(env!("CARGO_MANIFEST_DIR")).join("Dockerfile");
    let lint = Command::new(hadolint).arg(&dockerfile).output().unwrap();
    assert!(
        lint.status.success(),
        "{}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
}

/// journald or a pipe that stops reading must not stop the mail: log lines are
/// dropped and counted, lock renewal and commits go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stdout_nobody_reads_never_stops_the_mail() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    // More "mail sent" lines than the log queue and the pipe hold together.
    const MAILS: i64 = 20_000;
    db.exec(&format!(
        "INSERT INTO mail_queue (to_address, from_address, subject, body) \
         SELECT 'u' || g || '@example.com', 'shop@example.com', 'order ' || g, 'hello' \
         FROM generate_series(1, {MAILS}) g"
    ))
    .await;
    let sink = SmtpSink::start(&[]);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let (mut daemon, stdout) = Daemon::start_unread(daemon_env(
        &db,
        &sink.url(),
        &[
            ("TABLEMAIL__METRICS__LISTEN", &listen),
            ("TABLEMAIL__WORKER__LOCK_TIMEOUT", "10s"),
        ],
    ));
    eventually("every mail sent", Duration::from_secs(120), || async {
        db.count("status = 'sent'").await == MAILS
    })
    .await;
    let metrics = http::get(port, "/metrics", None);
    assert_eq!(metrics.status, 200);
    let metrics = metrics.body;
    let dropped = sample(&metrics, "tablemail_log_lines_dropped_total").unwrap();
    assert!(dropped > 0.0, "nothing dropped: the test proved nothing");
    assert_eq!(db.count("status <> 'sent'").await, 0);
    // Once stdout reads again, the daemon says how much it dropped.
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut { stdout }, &mut text);
        text
    });
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(20)).await, 0);
    let text = reader.join().unwrap();
    let notice = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["message"] == "log lines dropped: stdout did not keep up")
        .expect("the dropped lines are reported");
    assert!(notice["dropped"].as_u64().unwrap() > 0);
}

/// The Dockerfile's lines of `instruction` (continuations joined).
fn dockerfile_lines(instruction: &str) -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Dockerfile"))
        .unwrap()
        .replace("\\\n", " ");
    text.lines()
        .filter_map(|l| {
            l.strip_prefix(instruction)
                .map(|rest| rest.trim().to_string())
        })
        .collect()
}

/// The build stage's COPY lines give cargo all it builds from: the files they
/// copy, and nothing else of the repository, compile (`cargo check --locked
/// --offline` in a directory holding just them).
#[test]
fn the_docker_build_stage_copies_what_cargo_needs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let context = TempDir::new();
    let mut copied = 0;
    for line in dockerfile_lines("COPY ") {
        if line.starts_with("--from") {
            continue;
        }
        let mut parts: Vec<&str> = line.split_whitespace().collect();
        let dest = parts.pop().unwrap();
        for src in parts {
            let target = if dest.ends_with('/') && dest != "./" {
                context.path().join(dest.trim_start_matches("./"))
            } else if dest == "./" {
                context.path().to_path_buf()
            } else {
                context
                    .path()
                    .join(dest.trim_start_matches("./"))
                    .parent()
                    .unwrap()
                    .to_path_buf()
            };
            let status = Command::new("cp")
                .arg("-r")
                .arg(root.join(src))
                .arg(&target)
                .status()
                .unwrap();
            assert!(status.success(), "COPY {src} {dest}");
            copied += 1;
        }
    }
    assert!(copied > 0, "the Dockerfile copies nothing");
    // A target directory kept between runs, so that only the first check
    // compiles the dependencies.
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("docker-context");
    // A clean environment: cargo test's own (OUT_DIR among it) would stand in
    // for what the context lacks.
    let mut check = Command::new(env!("CARGO"));
    check.env_clear();
    for keep in [
        "PATH",
        "HOME",
        "CARGO_HOME",
        "RUSTUP_HOME",
        "RUSTUP_TOOLCHAIN",
    ] {
        if let Some(value) = std::env::var_os(keep) {
            check.env(keep, value);
        }
    }
    let check = check
        .args(["check", "--locked", "--offline", "--bin", "tablemail"])
        .current_dir(context.path())
        .env("CARGO_TARGET_DIR", target)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "the build stage's files do not compile:\n{}",
        String::from_utf8_lossy(&check.stderr)
    );
}

/// The container's HEALTHCHECK, run as Docker runs it (against a daemon whose
/// `/healthz` is on the port the Dockerfile exposes, here moved to a free
/// one): healthy while the relay answers, unhealthy once it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_container_healthcheck_follows_healthz() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let cmd = dockerfile_lines("HEALTHCHECK ")
        .pop()
        .expect("a HEALTHCHECK");
    let exposed = dockerfile_lines("EXPOSE ").pop().expect("an EXPOSE");
    let json = &cmd[cmd.find("CMD [").expect("CMD in exec form") + 4..];
    let argv: Vec<String> = serde_json::from_str(json).expect("CMD is a JSON array");
    let port = free_port();
    let argv: Vec<String> = argv
        .iter()
        .map(|a| a.replace(&exposed, &port.to_string()))
        .collect();
    let probe = || {
        Command::new(&argv[0])
            .args(&argv[1..])
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };

    let sink = SmtpSink::start(&[]);
    let listen = format!("127.0.0.1:{port}");
    let mut daemon = Daemon::start(daemon_env(
        &db,
        &sink.url(),
        &[
            ("TABLEMAIL__METRICS__LISTEN", &listen),
            ("TABLEMAIL__TRANSPORT__PROBE_INTERVAL", "1s"),
            ("TABLEMAIL__TRANSPORT__TIMEOUT", "2s"),
        ],
    ));
    eventually(
        "the health check passes",
        Duration::from_secs(20),
        || async { probe() },
    )
    .await;
    drop(sink);
    eventually(
        "the health check fails",
        Duration::from_secs(20),
        || async { !probe() },
    )
    .await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}
