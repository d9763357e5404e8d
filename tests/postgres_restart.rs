//! PostgreSQL restarted in the middle of a drain: the daemon survives and no
//! row is lost. A test binary of its own, because the restart cuts every
//! connection of the server, and cargo runs test binaries one at a time.

mod support;

use std::{process::Command, time::Duration};

use support::*;
use tablemail::store::NewMail;

/// Restarts the local cluster the way the machine's service scripts do.
fn restart_postgres() -> Result<(), String> {
    let version = postgres_version().ok_or("no cluster in /etc/postgresql")?;
    let status = Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", "restart"])
        .status()
        .map_err(|e| format!("pg_ctlcluster: {e}"))?;
    status
        .success()
        .then_some(())
        .ok_or_else(|| format!("pg_ctlcluster restart exited with {status}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_during_a_drain_loses_nothing() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    const MAILS: usize = 20_000;
    let sink = SmtpSink::start(&[]);
    let mails: Vec<NewMail> = (0..MAILS)
        .map(|i| mail(&format!("u{i}@example.com"), &format!("m{i}")))
        .collect();
    for chunk in mails.chunks(5000) {
        db.store.enqueue(chunk).await.unwrap();
    }
    // A claim whose reply was lost in the restart leaves rows locked: let
    // them go stale quickly.
    let env = daemon_env(
        &db,
        &sink.url(),
        &[
            ("TABLEMAIL__WORKER__LOCK_TIMEOUT", "3s"),
            ("TABLEMAIL__WORKER__CONCURRENCY", "4"),
        ],
    );
    let mut daemon = Daemon::start(env);
    // The drain under way.
    sink.wait_for_mails(1000, Duration::from_secs(30)).await;

    if let Err(e) = restart_postgres() {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("cannot restart PostgreSQL under CI=true: {e}");
        }
        eprintln!("SKIPPED: cannot restart PostgreSQL: {e}");
        return;
    }
    let sent_at_restart = sink.mails().len();
    assert!(
        sent_at_restart < MAILS,
        "the drain finished before the restart"
    );

    eventually(
        "every row sent after the restart",
        Duration::from_secs(180),
        || async {
            // The test's own pool reconnects on its own after the restart.
            match sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM mail_queue WHERE status = 'sent'",
            )
            .fetch_one(db.pool())
            .await
            {
                Ok(n) => n == MAILS as i64,
                Err(_) => false,
            }
        },
    )
    .await;
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "the daemon died"
    );
    assert!(
        daemon.logged_starting("database unavailable"),
        "the outage was logged"
    );
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(30)).await, 0);

    let got = sink.mails();
    let seen = message_id_counts(&got);
    let ids = db.strings("SELECT message_id FROM mail_queue").await;
    let lost = ids.iter().filter(|id| !seen.contains_key(*id)).count();
    eprintln!(
        "postgres restart after {sent_at_restart} of {MAILS} mails: lost {lost}, duplicates {}",
        got.len() - seen.len()
    );
    assert_eq!(lost, 0);
    assert_eq!(seen.len(), MAILS);
}
