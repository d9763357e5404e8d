//! tablemail's benchmark: `cargo bench --bench throughput [-- OPTIONS]`.
//!
//! On a fresh PostgreSQL database it measures
//! - the ceiling of the SMTP sink: Postfix's `smtp-source -d -s 16` into
//!   `smtp-sink`, same message size, same run;
//! - end-to-end throughput: N mails (~2 KB bodies) inserted in one statement
//!   into an idle daemon, drained into `smtp-sink`; every row must end `sent`
//!   and the sink must count exactly N; with the daemon's CPU per mail and
//!   peak RSS;
//! - pickup latency: one insert at a time into an idle daemon, until the SMTP
//!   server (aiosmtpd, which timestamps each mail) has it; with NOTIFY, then
//!   by polling alone;
//! - claim cost with 10k due rows, 1M due rows, and 10k due beside 1M
//!   finished rows;
//! - with `--soak 30m`: throughput per minute under constant load.
//!
//! Options: `--mails N` (50000), `--samples N` (200), `--soak DURATION`,
//! `--skip-claim-cost`, `--skip-latency`.

use std::{
    io::{BufRead, BufReader, Read, Seek, SeekFrom},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use sqlx::{postgres::PgPoolOptions, AssertSqlSafe, PgPool};
use tablemail::store::{self, BatchLock, Claim, FinalAction, Finalize, Store};

const BODY_BYTES: usize = 2048;

struct Options {
    mails: usize,
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

/// `smtp-sink -c`, counting messages into a file.
struct Sink {
    port: u16,
    child: Child,
    counters: PathBuf,
}

impl Sink {
    fn start(dir: &Path, name: &str) -> Sink {
        let port = free_port();
        let counters = dir.join(format!("{name}.counters"));
        let mut cmd = Command::new(sbin("smtp-sink"));
        if as_root() {
            cmd.args(["-u", "nobody"]);
        }
        let child = cmd
            .arg("-c")
            .arg(format!("127.0.0.1:{port}"))
            .arg("1024")
            .stdout(std::fs::File::create(&counters).unwrap())
            .spawn()
            .expect("smtp-sink");
        wait_listening(port);
        Sink {
            port,
            child,
            counters,
        }
    }

    /// Messages received so far (the last `mesg=` counter it printed).
    fn messages(&self) -> u64 {
        let mut f = std::fs::File::open(&self.counters).unwrap();
        let len = f.metadata().unwrap().len();
        f.seek(SeekFrom::Start(len.saturating_sub(512))).unwrap();
        let mut tail = String::new();
        f.read_to_string(&mut tail).unwrap();
        tail.rsplit("mesg=")
            .next()
            .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
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
    /// bodies are lines of 78 characters, like a real text mail.
    async fn load(&self, n: usize, body_bytes: usize, status: &str) {
        let lines = body_bytes.div_ceil(80);
        self.exec(&format!(
            "INSERT INTO mail_queue (to_address, subject, body, status, processed_at) \
             SELECT 'user' || g || '@example.com', 'Bench mail ' || g, \
                    repeat(repeat('x', 78) || E'\\r\\n', {lines}), \
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
fn ceiling(dir: &Path, mails: usize) -> f64 {
    let sink = Sink::start(dir, "ceiling");
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
    peak_rss_mib: f64,
    sink_count: u64,
}

async fn drain(tablemail: &Path, dir: &Path, mails: usize) -> Drain {
    let db = BenchDb::create(tablemail).await;
    let sink = Sink::start(dir, "drain");
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
    let (cpu_before, _) = daemon.usage();
    // One statement: every row becomes visible at one commit, like a burst.
    db.load(mails, BODY_BYTES, "queued").await;
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
    let (cpu_after, peak_rss_kib) = daemon.usage();
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
    // Database clock: from the insert's commit to the last finalize.
    let seconds = db
        .f64("SELECT EXTRACT(EPOCH FROM max(processed_at) - min(created_at))::float8 FROM mail_queue")
        .await;
    daemon.stop();
    std::thread::sleep(Duration::from_millis(200));
    let sink_count = sink.messages();
    assert_eq!(
        sink_count, mails as u64,
        "the sink must count every mail exactly once"
    );
    db.drop_db().await;
    Drain {
        rate: mails as f64 / seconds,
        cpu_us_per_mail: (cpu_after - cpu_before) * 1e6 / mails as f64,
        peak_rss_mib: peak_rss_kib as f64 / 1024.0,
        sink_count,
    }
}

/// aiosmtpd from the test suite, which records when each mail arrived.
struct Receiver {
    child: Child,
    port: u16,
    out: PathBuf,
}

impl Receiver {
    fn start(dir: &Path) -> Receiver {
        let out = dir.join("latency.jsonl");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/smtp_server.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg("--out")
            .arg(&out)
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 with aiosmtpd");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .expect("port");
        Receiver { child, port, out }
    }

    /// Arrival times of the mails received so far, in order.
    fn arrivals(&self) -> Vec<f64> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["received_at"].as_f64())
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Inserts one mail at a time into an idle daemon; milliseconds until the
/// SMTP server has it, sorted.
async fn pickup(db: &BenchDb, receiver: &Receiver, samples: usize) -> Vec<f64> {
    let mut latencies = Vec::with_capacity(samples);
    let already = receiver.arrivals().len();
    for i in 0..samples {
        // Let the daemon go idle between samples.
        tokio::time::sleep(Duration::from_millis(15 + (i % 7) as u64)).await;
        let t0 = unix_now();
        db.exec(&format!(
            "INSERT INTO mail_queue (to_address, subject, body) VALUES ('lat{i}@example.com', 'latency {i}', 'x')"
        ))
        .await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let arrived = loop {
            let arrivals = receiver.arrivals();
            if arrivals.len() > already + i {
                break arrivals[already + i];
            }
            assert!(Instant::now() < deadline, "sample {i} never arrived");
            tokio::time::sleep(Duration::from_micros(500)).await;
        };
        latencies.push((arrived - t0) * 1000.0);
    }
    latencies.sort_by(|a, b| a.partial_cmp(b).unwrap());
    latencies
}

async fn latency(tablemail: &Path, dir: &Path, samples: usize) -> (Vec<f64>, Vec<f64>) {
    let db = BenchDb::create(tablemail).await;
    let receiver = Receiver::start(dir);
    let daemon = Daemon::start(
        tablemail,
        dir,
        "latency",
        &[
            ("TABLEMAIL__DATABASE__URL", db.url.clone()),
            (
                "TABLEMAIL__TRANSPORT__URL",
                format!("smtp://127.0.0.1:{}", receiver.port),
            ),
        ],
    );
    // Warm the connection pool and the SMTP connection.
    pickup(&db, &receiver, 5).await;
    let notify = pickup(&db, &receiver, samples).await;
    // Without the trigger, only worker.poll_interval (1s) finds new rows.
    db.exec("DROP TRIGGER mail_queue_notify ON mail_queue")
        .await;
    let polled = pickup(&db, &receiver, 30).await;
    daemon.stop();
    db.drop_db().await;
    (notify, polled)
}

/// Median milliseconds of a 100-row claim over `rounds` claims.
async fn claim_ms(store: &Arc<dyn Store>, rounds: usize) -> f64 {
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let claim = Claim {
            lock: BatchLock::new(),
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
    let sink = Sink::start(dir, "soak");
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
        "mails: {} with {} byte bodies; PostgreSQL at {}",
        opts.mails,
        BODY_BYTES,
        admin_url()
    );

    let ceiling = ceiling(&dir, opts.mails);
    let d = drain(&tablemail, &dir, opts.mails).await;
    println!();
    println!(
        "{:<44} {:>12}",
        "smtp-source -d -s 16 into smtp-sink",
        format!("{ceiling:.0}/s")
    );
    println!(
        "{:<44} {:>12}",
        "tablemail end to end (PostgreSQL -> smtp-sink)",
        format!("{:.0}/s", d.rate)
    );
    println!(
        "{:<44} {:>12}",
        "ratio to the ceiling",
        format!("{:.0}%", 100.0 * d.rate / ceiling)
    );
    println!(
        "{:<44} {:>12}",
        "daemon CPU per mail",
        format!("{:.1} µs", d.cpu_us_per_mail)
    );
    println!(
        "{:<44} {:>12}",
        "daemon peak RSS",
        format!("{:.1} MiB", d.peak_rss_mib)
    );
    println!("{:<44} {:>12}", "mails the sink counted", d.sink_count);

    if opts.latency {
        let (notify, polled) = latency(&tablemail, &dir, opts.samples).await;
        println!(
            "{:<44} {:>12}",
            format!("pickup p50 / p99, NOTIFY ({} samples)", notify.len()),
            format!(
                "{:.2} / {:.2} ms",
                percentile(&notify, 0.5),
                percentile(&notify, 0.99)
            )
        );
        println!(
            "{:<44} {:>12}",
            format!("pickup p50 / p99, polling 1s ({} samples)", polled.len()),
            format!(
                "{:.0} / {:.0} ms",
                percentile(&polled, 0.5),
                percentile(&polled, 0.99)
            )
        );
    }
    if opts.claim_cost {
        let (small, large, finished) = claim_cost(&tablemail).await;
        println!(
            "{:<44} {:>12}",
            "claim of 100, 10k due rows (median)",
            format!("{small:.2} ms")
        );
        println!(
            "{:<44} {:>12}",
            "claim of 100, 1M due rows (median)",
            format!("{large:.2} ms")
        );
        println!(
            "{:<44} {:>12}",
            "claim of 100, 10k due + 1M sent (median)",
            format!("{finished:.2} ms")
        );
        println!(
            "{:<44} {:>12}",
            "1M due / 10k due",
            format!("{:.2}x", large / small)
        );
    }
    if let Some(duration) = opts.soak {
        let (per_minute, rss) = soak(&tablemail, &dir, duration).await;
        if let (Some(first), Some(last)) = (per_minute.first(), per_minute.last()) {
            println!(
                "{:<44} {:>12}",
                "soak: first minute",
                format!("{first:.0}/s")
            );
            println!("{:<44} {:>12}", "soak: last minute", format!("{last:.0}/s"));
            println!(
                "{:<44} {:>12}",
                "soak: last / first",
                format!("{:.0}%", 100.0 * last / first)
            );
            println!(
                "{:<44} {:>12}",
                "soak: daemon peak RSS",
                format!("{rss:.1} MiB")
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
