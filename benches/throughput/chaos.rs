//! `--soak DURATION --chaos [--chaos-every 2m]`: the soak's constant load,
//! drained by two daemons while one fault after another hits them.
//!
//! The daemons reach the database and the relay through TCP proxies (the
//! tests' own, `tests/support/proxy.rs`), so that a connection can be
//! blackholed. Every `--chaos-every` the next fault of the cycle:
//! 1. `kill -9` of the second daemon, started again 5 s later (its rows stay
//!    `sending` until `worker.lock_timeout`, set to 1 minute here, lets the
//!    other daemon release them);
//! 2. a PostgreSQL restart (`pg_ctlcluster … restart`; skipped on MariaDB);
//! 3. the relay down for a minute: `smtp-sink` stopped, then started again on
//!    the same port;
//! 4. the relay answering 421 to every MAIL for a minute (`smtp-sink -Q MAIL`);
//! 5. every open database connection blackholed: the proxy stops forwarding
//!    them (no reset, no close), new connections work;
//! 6. the same for the relay's connections.
//!
//! The first and the last five minutes of an hour (a twelfth of a shorter soak)
//! are left without faults: the first fault comes after them, and none starts
//! unless its minute of outage ends before them. Then the feeder stops and the
//! daemons get up to four minutes to finish every due row. The bench itself
//! deletes `sent` rows a minute old every 10 s, counting them (the daemons'
//! retention would delete them uncounted), so the table stays small and every
//! row is accounted for: inserted = sent (deleted or not) + the rest, by
//! status. Printed: lost (rows neither finished nor queued for a reason, rows
//! missing, mails marked sent the sink never got), duplicates (the sink's count
//! minus the rows sent, against their bound: the mails that may have been past
//! "." when a daemon was killed or the relay cut off, `worker.concurrency` per
//! daemon hit), the first daemon's RSS at the end of every minute (the second
//! is restarted), and the last five minutes' throughput against the first five
//! (both without faults).

use std::{
    process::Command,
    time::{Duration, Instant},
};

use super::{free_port, line, proxy::Proxy, Backend, BenchDb, Daemon, Setup, Shape, Sink};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    KillDaemon,
    DatabaseRestart,
    RelayDown,
    RelayRefuses,
    DatabaseBlackhole,
    RelayBlackhole,
}

impl Fault {
    const CYCLE: [Fault; 6] = [
        Fault::KillDaemon,
        Fault::DatabaseRestart,
        Fault::RelayDown,
        Fault::RelayRefuses,
        Fault::DatabaseBlackhole,
        Fault::RelayBlackhole,
    ];

    fn describe(self) -> &'static str {
        match self {
            Fault::KillDaemon => "kill -9 of daemon 2, started again after 5 s",
            Fault::DatabaseRestart => "database server restart",
            Fault::RelayDown => "relay down for a minute",
            Fault::RelayRefuses => "relay answers 421 to every MAIL for a minute",
            Fault::DatabaseBlackhole => "the daemons' database connections blackholed",
            Fault::RelayBlackhole => "the daemons' relay connections blackholed",
        }
    }
}

/// How long the relay stays down or refusing.
const OUTAGE: Duration = Duration::from_secs(60);
/// A killed daemon is started again after this (systemd's `RestartSec=`).
const RESTART_AFTER: Duration = Duration::from_secs(5);
/// Daemons draining the table.
const DAEMONS: usize = 2;
/// `worker.concurrency`'s default: the mails one daemon may have past ".".
const IN_FLIGHT: usize = 16;

/// The fault-free stretch at each end of the soak: five minutes of an hour
/// (a twelfth of a shorter soak). The throughput of the last five minutes
/// against the first five then says whether an hour of faults left the
/// daemons slower, not which faults fell into which window.
fn quiet_span(duration: Duration) -> Duration {
    (duration / 12).min(Duration::from_secs(300))
}

/// What undoes the fault in progress.
enum Undo {
    StartDaemon,
    RelayUp,
}

/// The relay: `smtp-sink` on one port, started there again after each stop;
/// counts the mails of every sink that ran there.
struct Relay {
    port: u16,
    sink: Option<Sink>,
    earlier: usize,
}

impl Relay {
    fn start() -> Relay {
        let port = free_port();
        Relay {
            port,
            sink: Some(Sink::start_on(port, &[])),
            earlier: 0,
        }
    }

    fn messages(&self) -> usize {
        self.earlier + self.sink.as_ref().map_or(0, Sink::messages)
    }

    fn stop(&mut self) {
        if let Some(sink) = self.sink.take() {
            self.earlier += sink.stop();
        }
    }

    /// A new sink on the same port, with `smtp-sink`'s fault `flags`.
    fn restart(&mut self, flags: &[&str]) {
        self.stop();
        self.sink = Some(Sink::start_on(self.port, flags));
    }
}

/// `url` with its host and port replaced by 127.0.0.1:`port`, and the port
/// it named (`default` if none).
fn through(url: &str, port: u16, default: u16) -> (String, u16) {
    let scheme_end = url.find("://").expect("a database URL") + 3;
    let rest = &url[scheme_end..];
    let end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..end];
    let host = authority.rfind('@').map_or(0, |i| i + 1);
    let named = authority[host..]
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(default);
    let url = format!(
        "{}{}127.0.0.1:{port}{}",
        &url[..scheme_end],
        &authority[..host],
        &rest[end..]
    );
    (url, named)
}

pub(super) struct ChaosReport {
    per_minute: Vec<f64>,
    faults: Vec<String>,
    inserted: i64,
    rows_sent: i64,
    sink: usize,
    /// Rows left by status (sent rows past a minute already deleted).
    by_status: Vec<(String, i64)>,
    queued_with_reason: i64,
    queued_without_reason: i64,
    sending: i64,
    /// Inserted rows found neither deleted as sent nor in the table.
    missing: i64,
    /// Mails that may have been past "." at a fault: duplicates' bound.
    bound: usize,
    settle_seconds: f64,
    peak_rss_kib: u64,
    /// Daemon 1's RSS at the end of each minute (the first and the last are
    /// the growth): a level reached early tells apart from a slow climb.
    rss_per_minute_kib: Vec<u64>,
    log_counts: Vec<(&'static str, usize)>,
    feeder_errors: usize,
}

/// Every daemon started with `env`, its log as `chaos-<name>`.
fn start_daemon(setup: &Setup<'_>, name: &str, env: &[(&str, String)]) -> Daemon {
    Daemon::start(setup.tablemail, setup.dir, &format!("chaos-{name}"), env)
}

/// `pg_ctlcluster VERSION NAME restart` for the cluster named `cluster`
/// ("15/main"); how long it took.
fn restart_postgres(cluster: &str) -> Result<Duration, String> {
    let (version, name) = cluster
        .split_once('/')
        .ok_or_else(|| format!("cluster_name {cluster:?} is not VERSION/NAME"))?;
    let started = Instant::now();
    let out = Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", version, name, "restart"])
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(started.elapsed())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

pub(super) async fn soak(setup: &Setup<'_>, duration: Duration, every: Duration) -> ChaosReport {
    let db = BenchDb::create(setup.target, setup.tablemail, setup.dir).await;
    assert!(
        db.backend != Backend::Sqlite,
        "--chaos needs a database server (PostgreSQL or MariaDB): SQLite has no connection to cut"
    );
    let cluster = if db.backend == Backend::Postgres {
        Some(db.text("SHOW cluster_name").await)
    } else {
        None
    };
    let mut relay = Relay::start();
    let relay_proxy = Proxy::start(relay.port).await;
    let default_port = if db.backend == Backend::Postgres {
        5432
    } else {
        3306
    };
    let (_, db_port) = through(&db.url, 0, default_port);
    let db_proxy = Proxy::start(db_port).await;
    let (db_url, _) = through(&db.url, db_proxy.port, default_port);
    let mut env = vec![
        ("TABLEMAIL__DATABASE__URL", db_url),
        (
            "TABLEMAIL__TRANSPORT__URL",
            format!("smtp://127.0.0.1:{}", relay_proxy.port),
        ),
        ("TABLEMAIL__WORKER__LOCK_TIMEOUT", "1m".to_string()),
    ];
    env.extend(setup.env.iter().cloned());
    let mut daemons: Vec<Daemon> = (1..=DAEMONS)
        .map(|i| start_daemon(setup, &i.to_string(), &env))
        .collect();
    // Killed daemons, kept for their logs.
    let mut killed: Vec<Daemon> = Vec::new();

    let minute_ago = match db.backend {
        Backend::Postgres => "now() - interval '1 minute'",
        _ => "UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE",
    };
    let count_purge =
        format!("DELETE FROM mail_queue WHERE status = 'sent' AND processed_at < {minute_ago}");
    let started = Instant::now();
    let (mut inserted, mut sent_deleted, mut feeder_errors) = (0i64, 0i64, 0usize);
    let mut per_minute = Vec::new();
    let mut minute_start = (Instant::now(), relay.messages());
    let mut rss_per_minute_kib = Vec::new();
    let mut faults = Vec::new();
    // The first and the last minutes are left without faults, so that the
    // throughput before the faults and after them compare like with like.
    let quiet = quiet_span(duration);
    let mut next_fault = started + quiet;
    let mut cycle = Fault::CYCLE.iter().cycle();
    let mut undo: Option<(Instant, Undo)> = None;
    let mut restarts = 0;
    let mut bound = 0;
    let mut last_purge = Instant::now();
    while started.elapsed() < duration {
        match db
            .try_i64("SELECT count(*) FROM mail_queue WHERE status = 'queued'")
            .await
        {
            Ok(backlog) if backlog < 30_000 => {
                match db.load_chunk(0, 20_000, Shape::Real, "queued").await {
                    Ok(()) => inserted += 20_000,
                    Err(_) => feeder_errors += 1,
                }
            }
            Ok(_) => {}
            Err(_) => feeder_errors += 1,
        }
        if last_purge.elapsed() >= Duration::from_secs(10) {
            match db.try_exec(&count_purge).await {
                Ok(n) => sent_deleted += n as i64,
                Err(_) => feeder_errors += 1,
            }
            last_purge = Instant::now();
        }
        if minute_start.0.elapsed() >= Duration::from_secs(60) {
            let now = (Instant::now(), relay.messages());
            let rate = (now.1 - minute_start.1) as f64 / (now.0 - minute_start.0).as_secs_f64();
            eprintln!(
                "chaos soak minute {}: {rate:.0} mails/s",
                per_minute.len() + 1
            );
            per_minute.push(rate);
            minute_start = now;
            rss_per_minute_kib.push(daemons[0].rss_kib());
        }
        if let Some((at, _)) = &undo {
            if Instant::now() >= *at {
                match undo.take().unwrap().1 {
                    Undo::StartDaemon => {
                        restarts += 1;
                        daemons.push(start_daemon(setup, &format!("2-restart{restarts}"), &env));
                    }
                    Undo::RelayUp => relay.restart(&[]),
                }
            }
        }
        let room = started.elapsed() + OUTAGE + quiet <= duration;
        if undo.is_none() && Instant::now() >= next_fault && room {
            next_fault += every;
            let fault = *cycle.next().unwrap();
            let at = started.elapsed().as_secs_f64() / 60.0;
            let mut note = String::new();
            match fault {
                Fault::KillDaemon => {
                    let mut victim = daemons.remove(1);
                    victim.kill();
                    killed.push(victim);
                    undo = Some((Instant::now() + RESTART_AFTER, Undo::StartDaemon));
                    bound += IN_FLIGHT;
                }
                Fault::DatabaseRestart => match &cluster {
                    Some(cluster) => {
                        let cluster = cluster.clone();
                        let took = tokio::task::spawn_blocking(move || restart_postgres(&cluster))
                            .await
                            .unwrap();
                        note = match took {
                            Ok(t) => format!(" ({:.1} s)", t.as_secs_f64()),
                            Err(e) => format!(" FAILED: {e}"),
                        };
                    }
                    None => note = " skipped: not PostgreSQL".into(),
                },
                Fault::RelayDown => {
                    relay.stop();
                    undo = Some((Instant::now() + OUTAGE, Undo::RelayUp));
                    bound += IN_FLIGHT * DAEMONS;
                }
                Fault::RelayRefuses => {
                    relay.restart(&["-Q", "MAIL"]);
                    undo = Some((Instant::now() + OUTAGE, Undo::RelayUp));
                    bound += IN_FLIGHT * DAEMONS;
                }
                Fault::DatabaseBlackhole => db_proxy.blackhole(),
                Fault::RelayBlackhole => {
                    relay_proxy.blackhole();
                    bound += IN_FLIGHT * DAEMONS;
                }
            }
            eprintln!("chaos at minute {at:.1}: {}{note}", fault.describe());
            faults.push(format!("minute {at:.1}: {}{note}", fault.describe()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    match undo.take() {
        Some((_, Undo::StartDaemon)) => daemons.push(start_daemon(setup, "2-last", &env)),
        Some((_, Undo::RelayUp)) => relay.restart(&[]),
        None => {}
    }

    // No more inserts: every due row must get sent, or wait for a reason.
    let open = format!(
        "SELECT count(*) FROM mail_queue WHERE status = 'sending' \
         OR (status = 'queued' AND send_at <= {})",
        db.now()
    );
    let settling = Instant::now();
    while settling.elapsed() < Duration::from_secs(240) {
        if db.try_i64(&open).await == Ok(0) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let settle_seconds = settling.elapsed().as_secs_f64();
    let peak_rss_kib = daemons[0].usage().1;
    for d in &daemons {
        let _ = Command::new("kill")
            .args(["-TERM", &d.child.id().to_string()])
            .status();
    }
    for d in &mut daemons {
        let _ = d.child.wait();
    }
    std::thread::sleep(Duration::from_millis(200));
    relay.stop();
    let sink = relay.messages();

    let by_status = db
        .counts("SELECT status, count(*) FROM mail_queue GROUP BY status ORDER BY status")
        .await;
    let of = |status: &str| {
        by_status
            .iter()
            .find(|(s, _)| s == status)
            .map_or(0, |(_, n)| *n)
    };
    let left: i64 = by_status.iter().map(|(_, n)| n).sum();
    let rows_sent = sent_deleted + of("sent");
    let queued_with_reason = db
        .i64(
            "SELECT count(*) FROM mail_queue q WHERE status = 'queued' AND (last_error IS NOT NULL \
             OR EXISTS (SELECT 1 FROM mail_event e WHERE e.mail_id = q.id))",
        )
        .await;
    let all: Vec<&Daemon> = daemons.iter().chain(killed.iter()).collect();
    let log_counts = [
        "stale locks released",
        "mail lock lost",
        "lock renewal failed",
        "relay unavailable",
        "mail retry scheduled",
        "mail failed",
    ]
    .into_iter()
    .map(|m| (m, all.iter().map(|d| d.count(m)).sum()))
    .chain(std::iter::once((
        "lines at ERROR level",
        all.iter().map(|d| d.errors()).sum(),
    )))
    .collect();
    drop(relay_proxy);
    drop(db_proxy);
    db.drop_db().await;
    ChaosReport {
        per_minute,
        faults,
        inserted,
        rows_sent,
        sink,
        queued_with_reason,
        queued_without_reason: of("queued") - queued_with_reason,
        sending: of("sending"),
        missing: inserted - sent_deleted - left,
        by_status,
        bound,
        settle_seconds,
        peak_rss_kib,
        rss_per_minute_kib,
        log_counts,
        feeder_errors,
    }
}

pub(super) fn report(r: &ChaosReport) {
    println!("chaos soak: {DAEMONS} daemons through TCP proxies, one fault at a time");
    for fault in &r.faults {
        println!("  {fault}");
    }
    line("rows inserted", r.inserted);
    line("rows sent", r.rows_sent);
    line("mails the sink counted", r.sink);
    line(
        "left in the table (sent rows a minute old deleted)",
        r.by_status
            .iter()
            .map(|(s, n)| format!("{s} {n}"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    line(
        "  queued with a reason (an error or an event)",
        r.queued_with_reason,
    );
    let never_arrived = (r.rows_sent - r.sink as i64).max(0);
    let lost = r.queued_without_reason + r.sending + r.missing + never_arrived;
    line(
        "lost",
        format!(
            "{lost} ({} queued without a reason, {} sending, {} rows missing, {} sent but not at the sink)",
            r.queued_without_reason, r.sending, r.missing, never_arrived
        ),
    );
    line(
        "duplicates (sink − rows sent)",
        format!(
            "{} (bound: {} past \".\" at the faults)",
            r.sink as i64 - r.rows_sent,
            r.bound
        ),
    );
    line(
        "settled after the load stopped",
        format!("{:.0} s", r.settle_seconds),
    );
    line(
        "daemon 1 RSS, first minute → last",
        format!(
            "{:.1} → {:.1} MiB (peak {:.1})",
            r.rss_per_minute_kib.first().copied().unwrap_or(0) as f64 / 1024.0,
            r.rss_per_minute_kib.last().copied().unwrap_or(0) as f64 / 1024.0,
            r.peak_rss_kib as f64 / 1024.0
        ),
    );
    line(
        "daemon 1 RSS per minute (MiB)",
        r.rss_per_minute_kib
            .iter()
            .map(|k| format!("{:.1}", *k as f64 / 1024.0))
            .collect::<Vec<_>>()
            .join(" "),
    );
    if !r.per_minute.is_empty() {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let five = r.per_minute.len().min(5);
        let head = mean(&r.per_minute[..five]);
        let tail = mean(&r.per_minute[r.per_minute.len() - five..]);
        line(
            format!("last {five} minutes / first {five}"),
            format!("{tail:.0} / {head:.0} = {:.0}%", 100.0 * tail / head),
        );
        line(
            "per minute",
            r.per_minute
                .iter()
                .map(|m| format!("{m:.0}"))
                .collect::<Vec<_>>()
                .join(" "),
        );
    }
    for (message, n) in &r.log_counts {
        line(format!("log: {message}"), n);
    }
    line(
        "feeder's failed statements (server restarts)",
        r.feeder_errors,
    );
}
