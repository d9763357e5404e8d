//! `--daemons 1,2,4,8`: one burst drained by N daemons at once.
//!
//! For each N the same burst (`--mails` rows like the real drain's: German
//! text and HTML, statistics not taken) goes into a fresh table; N `tablemail
//! run` processes start together on it and drain into one `smtp-sink`. Timed
//! from the first daemon's start until the sink has every mail. Then, per N:
//! - duplicates: the sink's count minus the rows `sent` (must be 0), and the
//!   sent rows claimed more than once (`attempts` over 1: a second claim of a
//!   row is the only way one daemon can send another's mail);
//! - claim conflicts, as far as they show: the history's events (a first-try
//!   `sent` writes none; a stale-lock release writes `stale`), and the
//!   daemons' log lines `mail lock lost` (an outcome not written because the
//!   row's lock was taken away), `lock renewal failed`, `stale locks released`;
//! - the daemons' CPU and the database server's per mail, and each daemon's
//!   share of the mails (its `mail sent` lines);
//! - the rate against one daemon's.
//!
//! Each daemon's pool is `32 / N` connections, between 2 and 8 (the default),
//! so 8 daemons stay within PostgreSQL's default `max_connections` of 100.

use std::time::Duration;

use super::{server_cpu, spread, until_drained, Backend, BenchDb, Daemon, Setup, Shape, Sink};

/// One drain by `daemons` processes.
pub(super) struct ScaleRun {
    daemons: usize,
    pool: usize,
    pub(super) rate: f64,
    cpu_us_per_mail: f64,
    db_cpu_us_per_mail: f64,
    /// The sink's count minus the rows `sent`.
    duplicates: i64,
    /// Sent rows claimed more than once.
    claimed_twice: i64,
    /// The history's events by outcome, "none" if there are none.
    events: String,
    lock_lost: usize,
    renewal_failed: usize,
    stale_sweeps: usize,
    errors: usize,
    /// The lowest and highest share of the mails one daemon sent, in %.
    share: (f64, f64),
}

/// The pool of each of `daemons` daemons.
fn pool_size(daemons: usize) -> usize {
    (32 / daemons).clamp(2, 8)
}

pub(super) async fn drain(setup: &Setup<'_>, mails: usize, daemons: usize) -> ScaleRun {
    let db = BenchDb::create(setup.target, setup.tablemail, setup.dir).await;
    let sink = Sink::start();
    db.load(mails, Shape::Real, "queued").await;
    let db_cpu_before = server_cpu(db.backend);
    let pool = pool_size(daemons);
    let mut env = vec![
        ("TABLEMAIL__DATABASE__URL", db.url.clone()),
        (
            "TABLEMAIL__TRANSPORT__URL",
            format!("smtp://127.0.0.1:{}", sink.port),
        ),
        ("TABLEMAIL__DATABASE__MAX_CONNECTIONS", pool.to_string()),
    ];
    env.extend(setup.env.iter().cloned());
    // All spawned before any is waited for: they start together.
    let mut running: Vec<Daemon> = (1..=daemons)
        .map(|i| {
            Daemon::spawn(
                setup.tablemail,
                setup.dir,
                &format!("scale-{daemons}-{i}"),
                &env,
            )
        })
        .collect();
    for d in &running {
        d.wait_started();
    }
    let who = format!("{daemons} daemons");
    let settle = Duration::from_secs(60);
    let seconds = until_drained(&sink, &db, mails, running[0].started, settle, &who).await;
    let cpu: f64 = running.iter().map(|d| d.usage().0).sum();
    let db_cpu = server_cpu(db.backend) - db_cpu_before;
    let sent = db
        .i64("SELECT count(*) FROM mail_queue WHERE status = 'sent'")
        .await;
    let claimed_twice = db
        .i64("SELECT count(*) FROM mail_queue WHERE status = 'sent' AND attempts > 1")
        .await;
    let events = db
        .counts("SELECT outcome, count(*) FROM mail_event GROUP BY outcome ORDER BY outcome")
        .await;
    let events = if events.is_empty() {
        "none".to_string()
    } else {
        events
            .iter()
            .map(|(outcome, n)| format!("{outcome} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    // Stopped together, and counted once their logs are complete.
    for d in &running {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &d.child.id().to_string()])
            .status();
    }
    for d in &mut running {
        let _ = d.child.wait();
    }
    let shares: Vec<f64> = running
        .iter()
        .map(|d| 100.0 * d.count("mail sent") as f64 / mails as f64)
        .collect();
    let sum = |message: &str| running.iter().map(|d| d.count(message)).sum::<usize>();
    let (lock_lost, renewal_failed, stale_sweeps) = (
        sum("mail lock lost"),
        sum("lock renewal failed"),
        sum("stale locks released"),
    );
    let errors = running.iter().map(Daemon::errors).sum();
    std::thread::sleep(Duration::from_millis(200));
    let duplicates = sink.messages() as i64 - sent;
    db.drop_db().await;
    ScaleRun {
        daemons,
        pool,
        rate: mails as f64 / seconds,
        cpu_us_per_mail: cpu * 1e6 / mails as f64,
        db_cpu_us_per_mail: db_cpu * 1e6 / mails as f64,
        duplicates,
        claimed_twice,
        events,
        lock_lost,
        renewal_failed,
        stale_sweeps,
        errors,
        share: (
            shares.iter().copied().fold(f64::INFINITY, f64::min),
            shares.iter().copied().fold(0.0, f64::max),
        ),
    }
}

/// One row per daemon count: medians over the runs for rates and CPU, sums
/// for what must be zero.
pub(super) fn report(backend: Backend, runs: &[ScaleRun]) {
    let db_name = backend.name();
    let mut counts: Vec<usize> = runs.iter().map(|r| r.daemons).collect();
    counts.sort_unstable();
    counts.dedup();
    let of = |n: usize| runs.iter().filter(move |r| r.daemons == n);
    let median_rate = |n: usize| {
        let mut v: Vec<f64> = of(n).map(|r| r.rate).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let base = median_rate(counts[0]);
    println!(
        "{} daemons draining one burst ({db_name}, one smtp-sink; medians over the runs)",
        counts
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join("/")
    );
    println!(
        "  {:>7} {:>4} {:>22} {:>7} {:>10} {:>10} {:>4} {:>6} {:>5} {:>6} {:>6} {:>11}  events",
        "daemons",
        "pool",
        "mails/s",
        format!("vs {}", counts[0]),
        "µs/mail",
        "DB µs/mail",
        "dup",
        "twice",
        "lost",
        "renew",
        "errors",
        "share %"
    );
    for &n in &counts {
        let runs: Vec<&ScaleRun> = of(n).collect();
        let rate = spread(runs.iter().map(|r| r.rate).collect(), "/s", 0);
        let median = |f: &dyn Fn(&ScaleRun) -> f64| {
            let mut v: Vec<f64> = runs.iter().map(|r| f(r)).collect();
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            v[v.len() / 2]
        };
        let total = |f: &dyn Fn(&ScaleRun) -> i64| runs.iter().map(|r| f(r)).sum::<i64>();
        let share = (
            runs.iter().map(|r| r.share.0).fold(f64::INFINITY, f64::min),
            runs.iter().map(|r| r.share.1).fold(0.0, f64::max),
        );
        println!(
            "  {:>7} {:>4} {:>22} {:>6.0}% {:>10.1} {:>10} {:>4} {:>6} {:>5} {:>6} {:>6} {:>11}  {}{}",
            n,
            runs[0].pool,
            rate,
            100.0 * median_rate(n) / base,
            median(&|r| r.cpu_us_per_mail),
            match backend.process() {
                Some(_) => format!("{:.1}", median(&|r| r.db_cpu_us_per_mail)),
                None => "–".to_string(),
            },
            total(&|r| r.duplicates),
            total(&|r| r.claimed_twice),
            total(&|r| r.lock_lost as i64),
            total(&|r| r.renewal_failed as i64),
            total(&|r| r.errors as i64),
            format!("{:.0}–{:.0}", share.0, share.1),
            runs.iter()
                .map(|r| r.events.as_str())
                .collect::<Vec<_>>()
                .join(" / "),
            match total(&|r| r.stale_sweeps as i64) {
                0 => String::new(),
                s => format!("; {s} stale-lock sweeps"),
            }
        );
    }
    println!(
        "  dup: sink count − rows sent; twice: sent rows claimed more than once; lost: \
         `mail lock lost` log lines; renew: `lock renewal failed`; µs/mail: all daemons' CPU; \
         DB: the server's CPU on this host; share: one daemon's part of the mails, lowest–highest"
    );
}
