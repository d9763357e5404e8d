//! PostgreSQL failover in the middle of a drain: the primary is killed, its
//! streaming standby promoted, and the address the daemon connects to (a
//! proxy standing in for a virtual IP) moved to it. The daemon goes on by
//! itself: every row ends `sent` on the new primary, no mail is lost, and an
//! idle daemon is woken by LISTEN/NOTIFY on the new primary. Run once with
//! synchronous and once with asynchronous replication; what each promises
//! about duplicates differs, see the two tests.
//!
//! The clusters are the test's own (`pg_createcluster` on free ports, only on
//! 127.0.0.1) and are dropped afterwards, also when the test fails; the
//! machine's main cluster is never touched. That needs root: without it the
//! tests are skipped, saying so on stderr (a failure under CI=true). A test
//! binary of its own: a failover takes much of a small machine for seconds.

mod support;

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use sqlx::{postgres::PgPoolOptions, PgPool};
use support::{proxy::Proxy, *};
use tablemail::store::NewMail;

const MAILS: usize = 20_000;
/// Lanes of the daemon (`worker.concurrency`) and rows per claim.
const CONCURRENCY: usize = 4;
const BATCH_SIZE: usize = 100;
/// The most rows the daemon holds claimed at once (`claim_ahead` in
/// src/worker/mod.rs: two per lane plus four batches).
const CLAIM_AHEAD: usize = 2 * CONCURRENCY + 4 * BATCH_SIZE;
/// The standby's `application_name`, which `synchronous_standby_names` names.
const STANDBY_NAME: &str = "tablemail_standby";
const DATABASE: &str = "tablemail";
/// Mails inserted one at a time into the idle daemon after the failover.
const PICKUPS: usize = 100;

/// Each test makes two clusters and drains 20,000 mails: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Clone, Copy, PartialEq)]
enum Replication {
    Synchronous,
    Asynchronous,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_a_synchronous_standby_loses_nothing() {
    let Some(version) = prerequisites() else {
        return;
    };
    let f = failover_during_a_drain(&version, Replication::Synchronous).await;
    // A claim is acknowledged only once the standby has it, and tablemail
    // sends only after its claim is acknowledged: every mail sent before the
    // kill has its claim, and so its Message-ID, on the new primary. A mail
    // can go out twice only if its `sent` outcome was not acknowledged before
    // the kill, so its row was still `sending` at the promotion; tablemail
    // then retries only the commit, under the same lock (which its own
    // stale-lock sweep spares), so in practice none is resent. Either way the
    // duplicates are at most the rows `sending` at the promotion, which are
    // at most what the daemon holds claimed: 2 per lane plus 4 batches.
    assert!(
        f.duplicates <= f.sending_at_promotion,
        "{} duplicates, but only {} rows were in flight at the promotion",
        f.duplicates,
        f.sending_at_promotion
    );
    assert!(f.sending_at_promotion <= CLAIM_AHEAD);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_an_asynchronous_standby_loses_no_row() {
    let Some(version) = prerequisites() else {
        return;
    };
    // With asynchronous replication the last commits of the old primary may
    // never reach the standby: a claim (then the new primary has the row
    // `queued` and, if that was the first claim, no Message-ID; claimed
    // anew, it gets the same one, derived from the row) or a `sent` outcome
    // (the row is `sending`, released after worker.lock_timeout and sent
    // again under the same Message-ID). How many depends on the replication
    // lag at the kill, so only what holds whatever the lag is asserted, in
    // the common part: no row lost once its insert reached the standby,
    // every row `sent`, every Message-ID of the new primary received, no
    // mail more than twice (one failover can undo at most one send of a
    // row), and never under two Message-IDs.
    failover_during_a_drain(&version, Replication::Asynchronous).await;
}

/// What one failover did.
struct Figures {
    duplicates: usize,
    sending_at_promotion: usize,
}

async fn failover_during_a_drain(version: &str, replication: Replication) -> Figures {
    let _one = ONE_AT_A_TIME.lock().await;
    init_logs();
    let case = match replication {
        Replication::Synchronous => "sync",
        Replication::Asynchronous => "async",
    };
    let tag = format!("{}_{case}", std::process::id());

    let primary = Cluster::create(version, &format!("tmfo_primary_{tag}"));
    primary.start();
    let standby = Cluster::create(version, &format!("tmfo_standby_{tag}"));
    standby.follow(&primary, STANDBY_NAME);
    standby.start();

    let admin = connect(&primary.url("postgres")).await;
    if replication == Replication::Synchronous {
        // Set on the primary after the base backup: the standby must not
        // inherit it, or its own commits would wait for a standby it lacks
        // once promoted.
        exec(
            &admin,
            &format!("ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'"),
        )
        .await;
        exec(&admin, "SELECT pg_reload_conf()").await;
    }
    let expected = match replication {
        Replication::Synchronous => "sync",
        Replication::Asynchronous => "async",
    };
    eventually(
        &format!("the standby streaming, {expected}"),
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, String>(
                "SELECT sync_state FROM pg_stat_replication \
                 WHERE application_name = $1 AND state = 'streaming'",
            )
            .bind(STANDBY_NAME)
            .fetch_optional(&admin)
            .await
            .unwrap()
            .as_deref()
                == Some(expected)
        },
    )
    .await;
    exec(&admin, &format!("CREATE DATABASE {DATABASE}")).await;

    let store = tablemail::store::connect(&primary.url(DATABASE), 4)
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let mails: Vec<NewMail> = (0..MAILS)
        .map(|i| mail(&format!("u{i}@example.com"), &format!("m{i}")))
        .collect();
    for chunk in mails.chunks(5000) {
        store.enqueue(chunk).await.unwrap();
    }
    drop(store);
    // The application's inserts are on the standby before the failover: a
    // row whose insert is lost with the old primary is the application's
    // loss, which no daemon can make up for.
    let written: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&admin)
        .await
        .unwrap();
    admin.close().await;
    let standby_db = connect(&standby.url(DATABASE)).await;
    eventually(
        "the standby to replay the inserts",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, bool>("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
                .bind(&written)
                .fetch_one(&standby_db)
                .await
                .unwrap()
        },
    )
    .await;

    // The virtual address: the daemon and the application know only this.
    let address = Proxy::start(primary.port).await;
    let address_url = format!("postgres://postgres@127.0.0.1:{}/{DATABASE}", address.port);
    let sink = SmtpSink::start(&[]);
    let (concurrency, batch) = (CONCURRENCY.to_string(), BATCH_SIZE.to_string());
    let env = daemon_env_at(
        &address_url,
        &sink.url(),
        &[
            ("TABLEMAIL__WORKER__CONCURRENCY", concurrency.as_str()),
            ("TABLEMAIL__WORKER__BATCH_SIZE", batch.as_str()),
            // A claim whose reply was lost leaves rows locked: let them go
            // stale quickly.
            ("TABLEMAIL__WORKER__LOCK_TIMEOUT", "3s"),
            // Connections to the dead primary are given up quickly.
            ("TABLEMAIL__DATABASE__STATEMENT_TIMEOUT", "5s"),
            // Long, so that the last mail of the test is picked up only by
            // a wake-up.
            ("TABLEMAIL__WORKER__POLL_INTERVAL", "60s"),
        ],
    );
    let mut daemon = Daemon::start(env);
    // The drain under way.
    sink.wait_for_mails(1000, Duration::from_secs(60)).await;

    let received_at_kill = sink.mails().len();
    let killed = Instant::now();
    primary.stop_immediately();
    standby.promote();
    let promoted_after = killed.elapsed();
    // What the new primary holds before the daemon can reach it, read in one
    // snapshot taken now; the addresses are read after the switch, so that
    // reading them does not delay it.
    let mut at_promotion = standby_db.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *at_promotion)
        .await
        .unwrap();
    let state_at_promotion: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM mail_queue GROUP BY status ORDER BY status")
            .fetch_all(&mut *at_promotion)
            .await
            .unwrap();
    address.set_upstream(standby.port);
    address.close_all();
    let switched_after = killed.elapsed();
    let bytes_at_switch = sink.captured_bytes();
    let queued_at_promotion: HashSet<String> =
        sqlx::query_scalar("SELECT to_address FROM mail_queue WHERE status = 'queued'")
            .fetch_all(&mut *at_promotion)
            .await
            .unwrap()
            .into_iter()
            .collect();
    at_promotion.commit().await.unwrap();
    assert!(
        received_at_kill < MAILS,
        "the drain finished before the failover"
    );
    let count_of = |status: &str| {
        state_at_promotion
            .iter()
            .find(|(s, _)| s == status)
            .map_or(0, |(_, n)| *n as usize)
    };
    let sending_at_promotion = count_of("sending");

    // Until every row is sent, how much the sink has captured over time:
    // where a mail ends in the capture then tells when it arrived.
    let mut captured: Vec<(Duration, u64)> = vec![(switched_after, bytes_at_switch)];
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last_check = Instant::now();
    loop {
        let bytes = sink.captured_bytes();
        if bytes > captured.last().unwrap().1 {
            captured.push((killed.elapsed(), bytes));
        }
        if last_check.elapsed() >= Duration::from_millis(250) {
            last_check = Instant::now();
            let sent: i64 =
                sqlx::query_scalar("SELECT count(*) FROM mail_queue WHERE status = 'sent'")
                    .fetch_one(&standby_db)
                    .await
                    .unwrap();
            if sent == MAILS as i64 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{sent} of {MAILS} rows sent two minutes after the failover"
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let drained_after = killed.elapsed();
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "the daemon died"
    );

    // The daemon is idle now, and polls only once a minute: a mail inserted
    // through the moved address is picked up at once only if its wake-up
    // listens on the new primary.
    // One at a time, idle between them, PICKUPS times: the figure is the
    // pickup's p50 and p99 (printed; the time it may take is the
    // benchmark's business, that it is NOTIFY's and not the poll's is ours).
    let application = connect(&address_url).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut pickups = Vec::with_capacity(PICKUPS);
    for i in 0..PICKUPS {
        tokio::time::sleep(Duration::from_millis(15 + (i % 7) as u64)).await;
        let before = sink.captured_bytes();
        exec(
            &application,
            &format!(
                "INSERT INTO mail_queue (to_address, subject, body) \
                 VALUES ('after-failover{i}@example.com', 'After', 'Hello')"
            ),
        )
        .await;
        let inserted = Instant::now();
        // Polled every half millisecond (`eventually` polls every 20, too
        // coarse for the figure).
        let deadline = inserted + Duration::from_secs(5);
        while sink.captured_bytes() == before {
            assert!(
                Instant::now() < deadline,
                "mail {i} inserted after the failover not picked up within 5 s: \
                 not woken by NOTIFY"
            );
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        pickups.push(inserted.elapsed());
    }
    pickups.sort();
    let pickup_p50 = pickups[PICKUPS / 2];
    let pickup_p99 = pickups[PICKUPS * 99 / 100];

    let logs = daemon.logs();
    assert!(
        daemon.logged_starting("database unavailable"),
        "the outage was logged"
    );
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(30)).await, 0);

    // Every row on the new primary, against every mail the sink received.
    let rows: Vec<(String, String, Option<String>)> =
        sqlx::query_as("SELECT to_address, status, message_id FROM mail_queue")
            .fetch_all(&standby_db)
            .await
            .unwrap();
    let got_with_ends = sink.mails_with_ends();
    // Mail flows again with the first mail, after the switch, whose row was
    // `queued` at the promotion: a row the daemon claimed on the new primary
    // (with asynchronous replication it may also be one whose claim on the
    // old primary was lost, sent a moment late by a lane).
    let flowing_after = got_with_ends
        .iter()
        .find(|(end, m)| {
            *end > bytes_at_switch && m.rcpt_tos.iter().any(|r| queued_at_promotion.contains(r))
        })
        .and_then(|(end, _)| captured.iter().find(|(_, bytes)| bytes >= end))
        .map(|(at, _)| *at);
    let got: Vec<SinkMail> = got_with_ends.into_iter().map(|(_, m)| m).collect();
    let mut by_recipient: HashMap<&str, Vec<Option<&str>>> = HashMap::new();
    for m in &got {
        for rcpt in &m.rcpt_tos {
            by_recipient
                .entry(rcpt.as_str())
                .or_default()
                .push(m.message_id.as_deref());
        }
    }
    let received_ids: HashSet<&str> = got.iter().filter_map(|m| m.message_id.as_deref()).collect();
    let not_sent = rows.iter().filter(|(_, s, _)| s != "sent").count();
    let lost = rows
        .iter()
        .filter(|(to, _, _)| !by_recipient.contains_key(to.as_str()))
        .count();
    let ids_not_received = rows
        .iter()
        .filter(|(_, _, id)| !id.as_deref().is_some_and(|id| received_ids.contains(id)))
        .count();
    let duplicates: usize = by_recipient.values().map(|v| v.len() - 1).sum();
    let most_receipts = by_recipient.values().map(Vec::len).max().unwrap_or(0);
    let resent_under_new_id = by_recipient
        .values()
        .filter(|ids| ids.iter().collect::<HashSet<_>>().len() > 1)
        .count();
    let mut complaints: Vec<(String, usize)> = Vec::new();
    for line in &logs {
        if matches!(line["level"].as_str(), Some("WARN" | "ERROR")) {
            let message = line["message"].as_str().unwrap_or("").to_string();
            match complaints.iter_mut().find(|(m, _)| *m == message) {
                Some((_, n)) => *n += 1,
                None => complaints.push((message, 1)),
            }
        }
    }
    let secs = |d: Duration| format!("{:.2} s", d.as_secs_f64());
    eprintln!(
        "failover ({case} replication) after {received_at_kill} of {MAILS} mails: \
         promoted and switched {} / {} after the kill; at promotion {state_at_promotion:?}; \
         mail flowing again {} after the kill; all sent {} after the kill; \
         lost {lost}, duplicates {duplicates} ({resent_under_new_id} under a new Message-ID); \
         pickup after the failover p50 {:.1} / p99 {:.1} ms over {PICKUPS} mails \
         (poll interval 60 s); \
         the daemon's warnings and errors: {complaints:?}",
        secs(promoted_after),
        secs(switched_after),
        flowing_after.map_or("never".into(), secs),
        secs(drained_after),
        pickup_p50.as_secs_f64() * 1000.0,
        pickup_p99.as_secs_f64() * 1000.0,
    );

    assert_eq!(
        rows.len(),
        MAILS + PICKUPS,
        "a row is missing on the new primary"
    );
    assert_eq!(not_sent, 0, "rows not sent on the new primary");
    assert_eq!(lost, 0, "mails the sink never received");
    assert_eq!(
        ids_not_received, 0,
        "rows whose Message-ID the sink never received"
    );
    assert!(
        most_receipts <= 2,
        "a mail was received {most_receipts} times"
    );
    assert_eq!(
        resent_under_new_id, 0,
        "a mail went out under two Message-IDs"
    );
    Figures {
        duplicates,
        sending_at_promotion,
    }
}

/// The newest PostgreSQL version with Debian's cluster tools, or `None`
/// (skipped, said on stderr) where the test cannot run: it makes clusters of
/// its own, which needs root. Under CI=true it fails instead.
fn prerequisites() -> Option<String> {
    let ci = std::env::var("CI").as_deref() == Ok("true");
    if !running_as_root() {
        assert!(
            !ci,
            "the failover test makes PostgreSQL clusters of its own: it needs root"
        );
        eprintln!("SKIPPED: not root (the failover test makes PostgreSQL clusters of its own)");
        return None;
    }
    for name in [
        "pg_createcluster",
        "pg_ctlcluster",
        "pg_dropcluster",
        "pg_basebackup",
    ] {
        tool(name)?;
    }
    let version = postgres_version();
    if version.is_none() {
        assert!(!ci, "no PostgreSQL version in /etc/postgresql");
        eprintln!("SKIPPED: no PostgreSQL version in /etc/postgresql");
    }
    version
}

/// A PostgreSQL cluster of the test's own. Dropped, stopped first, with its
/// data and configuration when this goes away, also when the test fails.
struct Cluster {
    version: String,
    name: String,
    port: u16,
}

impl Cluster {
    /// A new cluster (not started) on a free port, listening on 127.0.0.1
    /// only, trusting connections from there, replication included.
    fn create(version: &str, name: &str) -> Cluster {
        let port = free_port();
        run_ok(
            Command::new("pg_createcluster")
                .args([version, name, "--start-conf=manual", "-p"])
                .arg(port.to_string()),
        );
        let cluster = Cluster {
            version: version.into(),
            name: name.into(),
            port,
        };
        let config = cluster.config_dir();
        std::fs::write(
            config.join("conf.d/tablemail-failover.conf"),
            "listen_addresses = '127.0.0.1'\nwal_level = replica\nmax_wal_senders = 4\n",
        )
        .unwrap();
        std::fs::write(
            config.join("pg_hba.conf"),
            "local all postgres peer\n\
             host all all 127.0.0.1/32 trust\n\
             host replication all 127.0.0.1/32 trust\n",
        )
        .unwrap();
        cluster
    }

    fn config_dir(&self) -> PathBuf {
        PathBuf::from(format!("/etc/postgresql/{}/{}", self.version, self.name))
    }

    /// The data directory, as the cluster tools list it.
    fn data_dir(&self) -> PathBuf {
        let listing = run_ok(Command::new("pg_lsclusters").arg("-h"));
        listing
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() >= 6 && f[0] == self.version && f[1] == self.name)
            .map(|f| PathBuf::from(f[5]))
            .unwrap_or_else(|| panic!("{} is not in pg_lsclusters: {listing}", self.name))
    }

    fn ctl(&self, action: &[&str]) {
        run_ok(
            Command::new("pg_ctlcluster")
                .args(["--skip-systemctl-redirect", &self.version, &self.name])
                .args(action),
        );
    }

    fn start(&self) {
        self.ctl(&["start"]);
    }

    /// Stops the server without a shutdown checkpoint, as a crash would.
    fn stop_immediately(&self) {
        self.ctl(&["stop", "-m", "immediate"]);
    }

    /// Ends recovery: a standby becomes a primary (waits until it is one).
    fn promote(&self) {
        self.ctl(&["promote"]);
    }

    fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Makes this new, stopped cluster a streaming standby of `primary`,
    /// known to it as `application_name`: a base backup of the primary
    /// (`-R` writes `primary_conninfo`, with that name, and `standby.signal`).
    fn follow(&self, primary: &Cluster, application_name: &str) {
        let dir = self.data_dir();
        // pg_basebackup wants an empty directory, and the directory above it
        // is root's: empty it rather than remove it.
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                std::fs::remove_dir_all(&path).unwrap();
            } else {
                std::fs::remove_file(&path).unwrap();
            }
        }
        run_ok(
            Command::new("runuser")
                .args(["-u", "postgres", "--", "pg_basebackup", "-h", "127.0.0.1"])
                .args(["-p", &primary.port.to_string(), "-U", "postgres", "-D"])
                .arg(&dir)
                .args(["-R", "-X", "stream", "--checkpoint=fast", "-d"])
                .arg(format!("application_name={application_name}")),
        );
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Its data is thrown away: no need for a clean shutdown.
        let _ = Command::new("pg_ctlcluster")
            .args(["--skip-systemctl-redirect", &self.version, &self.name])
            .args(["stop", "-m", "immediate"])
            .output();
        let dropped = Command::new("pg_dropcluster")
            .args(["--stop", &self.version, &self.name])
            .output();
        match dropped {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "pg_dropcluster {} {}: {}",
                self.version,
                self.name,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("pg_dropcluster: {e}"),
        }
        // What pg_dropcluster leaves: the file the test added.
        let _ = std::fs::remove_dir_all(self.config_dir());
    }
}

async fn connect(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"))
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::query(sqlx::AssertSqlSafe(sql.to_string()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}
