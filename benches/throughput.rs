//! tablemail's benchmark: `cargo bench --bench throughput [-- OPTIONS]`.
//!
//! On a fresh PostgreSQL database it measures
//! - the ceiling of the SMTP sink: Postfix's `smtp-source -d -s 16` into
//!   `smtp-sink`, same message size, same run;
//! - end-to-end throughput: N mails (~2 KB text bodies) loaded, then
//!   `tablemail run` until the queue is empty, into `smtp-sink`; every row must
//!   end `sent` and the sink must count exactly N; with the CPU per mail of
//!   the daemon and of PostgreSQL, and the daemon's peak RSS;
//! - pickup latency: one insert at a time into an idle daemon, from its
//!   commit until `smtp-sink` has the mail (it prints its counter the moment
//!   "." arrives); with NOTIFY, then by polling alone;
//! - claim cost with 10k due rows, 1M due rows, and 10k due beside 1M
//!   finished rows;
//! - with `--soak 30m`: throughput per minute under constant load.
//!
//! The ceiling and the drain are measured `--runs` times (3) and reported as
//! median (lowest–highest): this machine's speed wanders by ±15% from minute
//! to minute.
//!
//! Options: `--mails N` (50000), `--runs N` (3), `--samples N` (200),
//! `--soak DURATION`, `--skip-claim-cost`, `--skip-latency`.

use std::{
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use sqlx::{postgres::PgPoolOptions, AssertSqlSafe, PgPool};
use tablemail::store::{self, BatchLock, Claim, FinalAction, Finalize, Store};

const BODY_BYTES: usize = 2048;

struct Options {
    mails: usize,
    runs: usize,
    samples: usize,
    soak: Option<Duration>,
    claim_cost: bool,
    latency: bool,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    Options {
        mails: value("--mails").map_or(50_000, |v| v.parse().expect("--mails N")),
        runs: value("--runs").map_or(3, |v| v.parse().expect("--runs N")),
        samples: value("--samples").map_or(200, |v| v.parse().expect("--samples N")),
        soak: value("--soak").map(|v| humantime::parse_duration(&v).expect("--soak DURATION")),
        claim_cost: !args.iter().any(|a| a == "--skip-claim-cost"),
        latency: !args.iter().any(|a| a == "--skip-latency"),
    }
}

fn admin_url() -> String {
    std::env::var("TABLEMAIL_BENCH_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

fn sbin(name: &str) -> PathBuf {
    ["/usr/sbin", "/usr/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{name} not found: install Debian's postfix (scripts/test does)"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A scratch directory for the run.
fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tablemail-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _ = Command::new("chmod").arg("777").arg(&dir).status();
    dir
}

/// `smtp-sink -c`: a thread reads its counter line, which it prints the moment
/// it receives a message's final ".", and notes when each message arrived.
struct Sink {
    port: u16,
    child: Child,
    arrivals: Arc<Mutex<Vec<f64>>>,
}

impl Sink {
    fn start() -> Sink {
        let port = free_port();
        let mut cmd = Command::new(sbin("smtp-sink"));
        if as_root() {
            cmd.args(["-u", "nobody"]);
        }
        let mut child = cmd
            .arg("-c")
            .arg(format!("127.0.0.1:{port}"))
            .arg("1024")
            .stdout(Stdio::piped())
            .spawn()
            .expect("smtp-sink");
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let mut out = child.stdout.take().unwrap();
        let seen = arrivals.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            let mut text = String::new();
            while let Ok(n) = out.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let now = unix_now();
                text.push_str(&String::from_utf8_lossy(&buf[..n]));
                // Lines look like "sess=1 quit=0 mesg=42\r".
                let last = text
                    .rsplit("mesg=")
                    .next()
                    .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
                    .and_then(|n| n.parse::<usize>().ok());
                if let Some(count) = last {
                    let mut seen = seen.lock().unwrap();
                    while seen.len() < count {
                        seen.push(now);
                    }
                }
                let keep = text.len().saturating_sub(64);
                text.drain(..keep);
            }
        });
        wait_listening(port);
        Sink {
            port,
            child,
            arrivals,
        }
    }

    /// Messages received so far.
    fn messages(&self) -> usize {
        self.arrivals.lock().unwrap().len()
    }

    /// When message `i` (0-based) arrived, if it has.
    fn arrival(&self, i: usize) -> Option<f64> {
        self.arrivals.lock().unwrap().get(i).copied()
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh database, dropped at the end.
struct BenchDb {
    name: String,
    url: String,
    pool: PgPool,
}

impl BenchDb {
    async fn create(tablemail: &Path) -> BenchDb {
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&admin_url())
            .await
            .expect("PostgreSQL (TABLEMAIL_BENCH_POSTGRES)");
        let name = format!("tm_bench_{}", uuid::Uuid::new_v4().simple());
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await
            .unwrap();
        let url = format!("{}/{name}", admin_url().rsplit_once('/').unwrap().0);
        let status = Command::new(tablemail)
            .arg("migrate")
            .env("TABLEMAIL__DATABASE__URL", &url)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "tablemail migrate");
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await
            .unwrap();
        BenchDb { name, url, pool }
    }

    async fn exec(&self, sql: &str) {
        sqlx::query(AssertSqlSafe(sql.to_string()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn i64(&self, sql: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql.to_string()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    async fn f64(&self, sql: &str) -> f64 {
        sqlx::query_scalar(AssertSqlSafe(sql.to_string()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Inserts `n` mails in one statement, as an application's bulk insert;
    /// bodies are lines of 70 characters, as mail clients wrap text.
    async fn load(&self, n: usize, body_bytes: usize, status: &str) {
        let lines = body_bytes.div_ceil(72);
        self.exec(&format!(
            "INSERT INTO mail_queue (to_address, subject, body, status, processed_at) \
             SELECT 'user' || g || '@example.com', 'Bench mail ' || g, \
                    repeat(repeat('x', 70) || E'\\r\\n', {lines}), \
                    '{status}', CASE WHEN '{status}' = 'queued' THEN NULL ELSE now() END \
             FROM generate_series(1, {n}) AS g"
        ))
        .await;
    }

    async fn drop_db(self) {
        self.pool.close().await;
        if let Ok(admin) = PgPoolOptions::new()
            .max_connections(1)
            .connect(&admin_url())
            .await
        {
            let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
            let _ = sqlx::query(AssertSqlSafe(sql)).execute(&admin).await;
        }
    }
}

/// `tablemail run` with its logs in a file.
struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    fn start(tablemail: &Path, dir: &Path, name: &str, env: &[(&str, String)]) -> Daemon {
        let log = dir.join(format!("{name}.log"));
        let mut cmd = Command::new(tablemail);
        cmd.arg("run")
            .env("TABLEMAIL__DEFAULTS__FROM_ADDRESS", "bench@example.com")
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("tablemail run");
        let d = Daemon { child, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !d.logged("worker started") {
            assert!(Instant::now() < deadline, "the daemon did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    fn logged(&self, message: &str) -> bool {
        let f = std::fs::File::open(&self.log).unwrap();
        BufReader::new(f)
            .lines()
            .map_while(Result::ok)
            .any(|l| l.contains(&format!("\"message\":\"{message}")))
    }

    fn errors(&self) -> usize {
        let f = std::fs::File::open(&self.log).unwrap();
        BufReader::new(f)
            .lines()
            .map_while(Result::ok)
            .filter(|l| l.contains("\"level\":\"ERROR\""))
            .count()
    }

    /// (user + system CPU seconds, peak RSS in KiB) from /proc.
    fn usage(&self) -> (f64, u64) {
        let pid = self.child.id();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let hwm = status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        (ticks / clock_ticks(), hwm)
    }

    fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kib| kib / 1024 / 1024);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    format!(
        "{cores} cores ({cpu}), {mem} GiB RAM, load average {}",
        load.join(" ")
    )
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// smtp-source's rate into a fresh sink: what the SMTP side can take.
fn ceiling(mails: usize) -> f64 {
    let sink = Sink::start();
    let started = Instant::now();
    let status = Command::new(sbin("smtp-source"))
        .args([
            "-d",
            "-s",
            "16",
            "-m",
            &mails.to_string(),
            "-l",
            &BODY_BYTES.to_string(),
        ])
        .args(["-f", "bench@example.com", "-t", "user@example.com"])
        .arg(format!("127.0.0.1:{}", sink.port))
        .stdout(Stdio::null())
        .status()
        .expect("smtp-source");
    let elapsed = started.elapsed().as_secs_f64();
    assert!(status.success(), "smtp-source failed");
    mails as f64 / elapsed
}

struct Drain {
    rate: f64,
    cpu_us_per_mail: f64,
    db_cpu_us_per_mail: f64,
    peak_rss_mib: f64,
    sink_count: usize,
}

async fn drain(tablemail: &Path, dir: &Path, mails: usize) -> Drain {
    let db = BenchDb::create(tablemail).await;
    let sink = Sink::start();
    // The backlog is there before the daemon starts, as after an outage.
    db.load(mails, BODY_BYTES, "queued").await;
    db.exec("VACUUM ANALYZE mail_queue").await;
    let db_cpu_before = postgres_cpu();
    let daemon = Daemon::start(
        tablemail,
        dir,
        "drain",
        &[
            ("TABLEMAIL__DATABASE__URL", db.url.clone()),
            (
                "TABLEMAIL__TRANSPORT__URL",
                format!("smtp://127.0.0.1:{}", sink.port),
            ),
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let left = db
            .i64("SELECT count(*) FROM mail_queue WHERE status IN ('queued', 'sending')")
            .await;
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the drain did not finish: {left} left"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (cpu, peak_rss_kib) = daemon.usage();
    let db_cpu = postgres_cpu() - db_cpu_before;
    assert_eq!(
        daemon.errors(),
        0,
        "the daemon logged errors: see {}",
        daemon.log.display()
    );
    let sent = db
        .i64("SELECT count(*) FROM mail_queue WHERE status = 'sent'")
        .await;
    assert_eq!(sent, mails as i64, "every row must end sent");
    // Database clock, from the first mail written as sent to the last.
    let seconds = db
        .f64("SELECT EXTRACT(EPOCH FROM max(processed_at) - min(processed_at))::float8 FROM mail_queue")
        .await;
    daemon.stop();
    std::thread::sleep(Duration::from_millis(200));
    let sink_count = sink.messages();
    assert_eq!(
        sink_count, mails,
        "the sink must count every mail exactly once"
    );
    db.drop_db().await;
    Drain {
        rate: mails as f64 / seconds,
        cpu_us_per_mail: cpu * 1e6 / mails as f64,
        db_cpu_us_per_mail: db_cpu * 1e6 / mails as f64,
        peak_rss_mib: peak_rss_kib as f64 / 1024.0,
        sink_count,
    }
}

/// CPU seconds used so far by the PostgreSQL server's processes on this
/// host (processes that ended in between are not counted).
fn postgres_cpu() -> f64 {
    let mut ticks = 0.0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((head, tail)) = stat.rsplit_once(')') else {
            continue;
        };
        if !head.ends_with("(postgres") {
            continue;
        }
        let f: Vec<&str> = tail.split_whitespace().collect();
        ticks += f[11].parse::<f64>().unwrap_or(0.0) + f[12].parse::<f64>().unwrap_or(0.0);
    }
    ticks / clock_ticks()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Inserts one mail at a time into an idle daemon; milliseconds from the
/// INSERT's commit until the SMTP server has the mail, sorted, and the
/// median time the INSERT itself took.
async fn pickup(db: &BenchDb, sink: &Sink, samples: usize) -> (Vec<f64>, f64) {
    let mut latencies = Vec::with_capacity(samples);
    let mut inserts = Vec::with_capacity(samples);
    let already = sink.messages();
    for i in 0..samples {
        // Let the daemon go idle between samples.
        tokio::time::sleep(Duration::from_millis(15 + (i % 7) as u64)).await;
        let before = unix_now();
        db.exec(&format!(
            "INSERT INTO mail_queue (to_address, subject, body) VALUES ('lat{i}@example.com', 'latency {i}', 'x')"
        ))
        .await;
        let committed = unix_now();
        inserts.push((committed - before) * 1000.0);
        let deadline = Instant::now() + Duration::from_secs(30);
        let arrived = loop {
            if let Some(t) = sink.arrival(already + i) {
                break t;
            }
            assert!(Instant::now() < deadline, "sample {i} never arrived");
            tokio::time::sleep(Duration::from_micros(200)).await;
        };
        latencies.push((arrived - committed) * 1000.0);
    }
    latencies.sort_by(|a, b| a.partial_cmp(b).unwrap());
    inserts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (latencies, percentile(&inserts, 0.5))
}

struct Latency {
    notify: Vec<f64>,
    insert_ms: f64,
    polled: Vec<f64>,
}

async fn latency(tablemail: &Path, dir: &Path, samples: usize) -> Latency {
    let db = BenchDb::create(tablemail).await;
    let sink = Sink::start();
    let daemon = Daemon::start(
        tablemail,
        dir,
        "latency",
        &[
            ("TABLEMAIL__DATABASE__URL", db.url.clone()),
            (
                "TABLEMAIL__TRANSPORT__URL",
                format!("smtp://127.0.0.1:{}", sink.port),
            ),
        ],
    );
    // Warm the connection pools on both sides.
    pickup(&db, &sink, 5).await;
    let (notify, insert_ms) = pickup(&db, &sink, samples).await;
    // Without the trigger, only worker.poll_interval (1s) finds new rows.
    db.exec("DROP TRIGGER mail_queue_notify ON mail_queue")
        .await;
    let (polled, _) = pickup(&db, &sink, 30).await;
    daemon.stop();
    db.drop_db().await;
    Latency {
        notify,
        insert_ms,
        polled,
    }
}

/// Median milliseconds of a 100-row claim over `rounds` claims.
async fn claim_ms(store: &Arc<dyn Store>, rounds: usize) -> f64 {
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let claim = Claim {
            lock: BatchLock::generate(),
            limit: 100,
            max_age: Duration::from_secs(5 * 86400),
            message_id_domain: "bench.example",
        };
        let started = Instant::now();
        let mails = store.claim_batch(&claim).await.unwrap();
        times.push(started.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(mails.len(), 100);
        let writes: Vec<Finalize> = mails
            .iter()
            .map(|m| Finalize {
                id: m.id,
                lock: m.lock,
                action: FinalAction::Sent,
            })
            .collect();
        store.finalize(&writes).await.unwrap();
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    percentile(&times, 0.5)
}

async fn claim_cost(tablemail: &Path) -> (f64, f64, f64) {
    let db = BenchDb::create(tablemail).await;
    let store = store::connect(&db.url, 4).await.unwrap();
    db.load(10_000, 200, "queued").await;
    db.exec("VACUUM ANALYZE mail_queue").await;
    let small = claim_ms(&store, 30).await;
    db.load(990_000, 200, "queued").await;
    db.exec("VACUUM ANALYZE mail_queue").await;
    let large = claim_ms(&store, 30).await;
    db.drop_db().await;

    let db = BenchDb::create(tablemail).await;
    let store = store::connect(&db.url, 4).await.unwrap();
    db.load(1_000_000, 200, "sent").await;
    db.load(10_000, 200, "queued").await;
    db.exec("VACUUM ANALYZE mail_queue").await;
    let beside_finished = claim_ms(&store, 30).await;
    db.drop_db().await;
    (small, large, beside_finished)
}

/// Constant load for `duration`: a feeder keeps a backlog, the daemon drains
/// it, retention deletes sent rows after a minute. Mails per second, per minute.
async fn soak(tablemail: &Path, dir: &Path, duration: Duration) -> (Vec<f64>, f64) {
    let db = BenchDb::create(tablemail).await;
    let sink = Sink::start();
    let daemon = Daemon::start(
        tablemail,
        dir,
        "soak",
        &[
            ("TABLEMAIL__DATABASE__URL", db.url.clone()),
            (
                "TABLEMAIL__TRANSPORT__URL",
                format!("smtp://127.0.0.1:{}", sink.port),
            ),
            ("TABLEMAIL__RETENTION__SENT", "1m".to_string()),
        ],
    );
    let started = Instant::now();
    let mut per_minute = Vec::new();
    let mut minute_start = (Instant::now(), sink.messages());
    while started.elapsed() < duration {
        let backlog = db
            .i64("SELECT count(*) FROM mail_queue WHERE status = 'queued'")
            .await;
        if backlog < 30_000 {
            db.load(20_000, BODY_BYTES, "queued").await;
        }
        if minute_start.0.elapsed() >= Duration::from_secs(60) {
            let now = (Instant::now(), sink.messages());
            let rate = (now.1 - minute_start.1) as f64 / (now.0 - minute_start.0).as_secs_f64();
            eprintln!("soak minute {}: {rate:.0} mails/s", per_minute.len() + 1);
            per_minute.push(rate);
            minute_start = now;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, rss_kib) = daemon.usage();
    daemon.stop();
    db.drop_db().await;
    (per_minute, rss_kib as f64 / 1024.0)
}

/// One line of the report.
fn line(label: impl std::fmt::Display, value: impl std::fmt::Display) {
    println!("{:<46} {:>26}", label.to_string(), value.to_string());
}

#[tokio::main]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        // `cargo test --all-targets` builds and runs this too: do nothing there.
        println!("run with `cargo bench --bench throughput`");
        return;
    }
    let opts = options();
    let tablemail = PathBuf::from(env!("CARGO_BIN_EXE_tablemail"));
    let dir = scratch();
    println!("tablemail benchmark — {}", machine());
    println!(
        "{} mails with {} byte text bodies; PostgreSQL at {}",
        opts.mails,
        BODY_BYTES,
        admin_url()
    );
    println!();

    let mut runs = Vec::with_capacity(opts.runs);
    for run in 1..=opts.runs.max(1) {
        let ceiling = ceiling(opts.mails);
        let d = drain(&tablemail, &dir, opts.mails).await;
        eprintln!(
            "run {run}: ceiling {ceiling:.0}/s, tablemail {:.0}/s, daemon {:.1} µs/mail",
            d.rate, d.cpu_us_per_mail
        );
        runs.push((ceiling, d));
    }
    let spread = |f: &dyn Fn(&(f64, Drain)) -> f64, unit: &str, digits: usize| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        format!(
            "{:.*}{unit} ({:.*}–{:.*})",
            digits,
            percentile(&v, 0.5),
            digits,
            v[0],
            digits,
            v[v.len() - 1]
        )
    };
    line(
        "smtp-source -d -s 16 into smtp-sink",
        spread(&|r| r.0, "/s", 0),
    );
    line(
        "tablemail end to end (PostgreSQL -> smtp-sink)",
        spread(&|r| r.1.rate, "/s", 0),
    );
    line(
        "ratio to the ceiling",
        spread(&|r| 100.0 * r.1.rate / r.0, "%", 0),
    );
    line(
        "daemon CPU per mail",
        spread(&|r| r.1.cpu_us_per_mail, " µs", 1),
    );
    line(
        "PostgreSQL CPU per mail (same host)",
        spread(&|r| r.1.db_cpu_us_per_mail, " µs", 1),
    );
    line("daemon peak RSS", spread(&|r| r.1.peak_rss_mib, " MiB", 1));
    line(
        "mails the sink counted, every run",
        runs.iter().map(|r| r.1.sink_count).min().unwrap_or(0),
    );

    if opts.latency {
        let l = latency(&tablemail, &dir, opts.samples).await;
        let ms = |v: &[f64]| format!("{:.2} / {:.2} ms", percentile(v, 0.5), percentile(v, 0.99));
        line(
            format!("pickup p50 / p99, NOTIFY ({} samples)", l.notify.len()),
            ms(&l.notify),
        );
        line(
            "  the INSERT's own commit (median)",
            format!("{:.2} ms", l.insert_ms),
        );
        line(
            format!("pickup p50 / p99, polling 1s ({} samples)", l.polled.len()),
            ms(&l.polled),
        );
    }
    if opts.claim_cost {
        let (small, large, finished) = claim_cost(&tablemail).await;
        line(
            "claim of 100, 10k due rows (median)",
            format!("{small:.2} ms"),
        );
        line(
            "claim of 100, 1M due rows (median)",
            format!("{large:.2} ms"),
        );
        line(
            "claim of 100, 10k due + 1M sent (median)",
            format!("{finished:.2} ms"),
        );
        line("1M due / 10k due", format!("{:.2}x", large / small));
    }
    if let Some(duration) = opts.soak {
        let (per_minute, rss) = soak(&tablemail, &dir, duration).await;
        if let (Some(first), Some(last)) = (per_minute.first(), per_minute.last()) {
            line("soak: first minute", format!("{first:.0}/s"));
            line("soak: last minute", format!("{last:.0}/s"));
            line(
                "soak: last / first",
                format!("{:.0}%", 100.0 * last / first),
            );
            // A minute's rate wanders by ±10% here: five minutes say more.
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
            let five = per_minute.len().min(5);
            let head = mean(&per_minute[..five]);
            let tail = mean(&per_minute[per_minute.len() - five..]);
            line(
                format!("soak: last {five} minutes / first {five}"),
                format!("{tail:.0} / {head:.0} = {:.0}%", 100.0 * tail / head),
            );
            line("soak: daemon peak RSS", format!("{rss:.1} MiB"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
