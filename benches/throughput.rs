//! tablemail's benchmark: `cargo bench --bench throughput [-- OPTIONS]`.
//!
//! On a fresh database of `--database URL` (PostgreSQL by default; a
//! `mysql://` server URL or `sqlite://` for the others) it measures
//! - the ceiling of the SMTP sink: Postfix's `smtp-source -d -s 16` into
//!   `smtp-sink`, same message size, same run;
//! - end-to-end throughput under real conditions: N mails loaded in one burst
//!   before the daemon starts, statistics not refreshed (as after an outage or
//!   a bulk campaign, before autoanalyze), bodies like a German order
//!   confirmation (non-ASCII text with long lines, an HTML alternative, a
//!   non-ASCII subject), timed from the daemon's start until `smtp-sink` has
//!   them all; every row must end `sent` and the sink must count exactly N;
//!   with the CPU per mail of the daemon and of the database server, and the
//!   daemon's peak RSS;
//! - the best case beside it: ASCII bodies of 2 KB, statistics fresh;
//! - the bodies alone: the real mix with statistics fresh, set against the
//!   best case run by run (its mails per second and the daemon's CPU per
//!   mail as ratios; `--skip-bodies` leaves it out);
//! - pickup latency: one insert at a time into an idle daemon, from its
//!   commit until `smtp-sink` has the mail (it prints its counter the moment
//!   "." arrives); with the backend's wake-up, then (PostgreSQL) by polling,
//!   (MariaDB) looking every 2 ms, with an idle daemon's CPU a second;
//! - claim cost: 10k due rows; 50k rows of 2 KB and 1M rows of 200 bytes from
//!   a burst, before and after ANALYZE; 10k due beside 1M finished rows;
//! - with `--templates`: order confirmations rendered at send time from
//!   `mail_template` against the same mails pre-rendered, in pairs
//!   (`throughput/templates.rs`);
//! - with `--soak 30m`: throughput per minute under constant load;
//! - with `--daemons 1,2,4,8`: one burst drained by that many daemons at
//!   once, against one daemon (`throughput/scale.rs`);
//! - with `--soak 14m --chaos`: the soak drained by two daemons while faults
//!   hit them one at a time, every `--chaos-every` (2m): a daemon killed, the
//!   database restarted, the relay down, the relay answering 421, the
//!   database's and the relay's connections blackholed; then what was lost or
//!   sent twice (`throughput/chaos.rs`);
//! - with `--limit-unreached`: drains under one send cap never reached
//!   against drains without caps, in pairs (`throughput/limits.rs`).
//!
//! The ceiling and the drains are measured `--runs` times (3) and reported as
//! median (lowest–highest): this machine's speed wanders by ±15% from minute
//! to minute, so compare ratios to the ceiling, not absolute rates.
//!
//! Options: see [`USAGE`] (`cargo bench --bench throughput -- --help`).

use std::{
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use std::str::FromStr;

use sqlx::{
    mysql::{MySqlPool, MySqlPoolOptions},
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions},
    AssertSqlSafe, PgPool,
};
use tablemail::store::{self, BatchLock, Claim, FinalAction, Finalize, Store};

#[path = "throughput/chaos.rs"]
mod chaos;
#[path = "throughput/feedback.rs"]
mod feedback;
#[path = "throughput/limits.rs"]
mod limits;
#[allow(dead_code)]
#[path = "../tests/support/proxy.rs"]
mod proxy;
#[path = "throughput/routes.rs"]
mod routes;
#[path = "throughput/scale.rs"]
mod scale;
#[path = "throughput/templates.rs"]
mod templates;

const BODY_BYTES: usize = 2048;
/// In a drain's environment, not a variable: the daemon's `--config FILE`.
const CONFIG_ARG: &str = "--config";

struct Options {
    database: String,
    tablemail: PathBuf,
    /// `rsa` or `ed25519`: sign every mail with a fresh key of that kind.
    dkim: Option<&'static str>,
    mails: usize,
    runs: usize,
    samples: usize,
    soak: Option<Duration>,
    claim_cost: bool,
    latency: bool,
    drain: bool,
    /// A third drain per run: the real mix with statistics fresh.
    bodies: bool,
    /// Every drained mail carries one PDF-like attachment of this many KB.
    attachment_kb: usize,
    /// `--daemons 1,2,4,8`: drains of one burst by this many daemons at once.
    daemons: Vec<usize>,
    /// `--chaos` (with `--soak`): one fault every `chaos_every`.
    chaos: Option<Duration>,
    /// `--suppressed N`: paired drains with N addresses suppressed and none.
    suppressed: Option<usize>,
    /// `--reports N`: reports recorded per second, by the listener and by
    /// `ingest`.
    reports: Option<usize>,
    /// `--routes`: paired drains through two routes and through one.
    routes: bool,
    /// `--limit-unreached`: paired drains under one send cap never reached
    /// and without caps.
    limit_unreached: bool,
    /// `--templates`: paired drains of order confirmations, templated and
    /// pre-rendered.
    templates: bool,
}

const USAGE: &str = "\
cargo bench --bench throughput [-- OPTIONS]

  --database URL          postgres://… (default), mysql://… or sqlite://…
  --mails N               mails per drain (50000)
  --runs N                runs of the ceiling and of each drain (3)
  --samples N             pickup-latency samples (200)
  --skip-drain            no drains of the real mix and the best case
  --skip-bodies           no drain of the real mix with statistics fresh
  --skip-latency          no pickup latency
  --skip-claim-cost       no claim cost on large backlogs
  --dkim, --dkim-ed25519  sign every mail with a fresh RSA-2048 / Ed25519 key
  --attachment-kb N       one PDF-like attachment of N KB on every mail
  --bin PATH              another build of the daemon, for before/after figures
  --daemons N,N,...       one burst drained by that many daemons at once
  --suppressed N          drains with N suppressed addresses against none
  --reports N             reports recorded per second by the listener and by ingest
  --routes                drains through two routes against one
  --limit-unreached       drains under a send cap never reached against none
  --templates             templated drains against pre-rendered ones
  --soak DURATION         constant load for DURATION (30m)
  --chaos                 with --soak: two daemons and a fault every --chaos-every
  --chaos-every DURATION  (2m)
";

/// Options that take a value, and those that do not.
const VALUED: &[&str] = &[
    "--database",
    "--mails",
    "--runs",
    "--samples",
    "--attachment-kb",
    "--bin",
    "--daemons",
    "--suppressed",
    "--reports",
    "--soak",
    "--chaos-every",
];
const FLAGS: &[&str] = &[
    "--skip-drain",
    "--skip-bodies",
    "--skip-latency",
    "--skip-claim-cost",
    "--dkim",
    "--dkim-ed25519",
    "--routes",
    "--limit-unreached",
    "--templates",
    "--chaos",
    // What `cargo bench` passes itself.
    "--bench",
];

fn options() -> Options {
    let args: Vec<String> = std::env::args().collect();
    let mut rest = args.iter().skip(1);
    while let Some(arg) = rest.next() {
        if arg == "--help" || arg == "-h" {
            print!("{USAGE}");
            std::process::exit(0);
        }
        if VALUED.contains(&arg.as_str()) {
            if rest.next().is_none() {
                eprint!("{arg} needs a value\n\n{USAGE}");
                std::process::exit(2);
            }
        } else if !FLAGS.contains(&arg.as_str()) {
            eprint!("unknown option {arg:?}\n\n{USAGE}");
            std::process::exit(2);
        }
    }
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    Options {
        database: value("--database").unwrap_or_else(|| {
            std::env::var("TABLEMAIL_BENCH_POSTGRES")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
        }),
        tablemail: value("--bin").map_or_else(
            || PathBuf::from(env!("CARGO_BIN_EXE_tablemail")),
            PathBuf::from,
        ),
        dkim: if args.iter().any(|a| a == "--dkim-ed25519") {
            Some("ed25519")
        } else if args.iter().any(|a| a == "--dkim") {
            Some("rsa")
        } else {
            None
        },
        mails: value("--mails").map_or(50_000, |v| v.parse().expect("--mails N")),
        runs: value("--runs").map_or(3, |v| v.parse().expect("--runs N")),
        samples: value("--samples").map_or(200, |v| v.parse().expect("--samples N")),
        soak: value("--soak").map(|v| humantime::parse_duration(&v).expect("--soak DURATION")),
        claim_cost: !args.iter().any(|a| a == "--skip-claim-cost"),
        latency: !args.iter().any(|a| a == "--skip-latency"),
        drain: !args.iter().any(|a| a == "--skip-drain"),
        bodies: !args.iter().any(|a| a == "--skip-bodies"),
        attachment_kb: value("--attachment-kb")
            .map_or(0, |v| v.parse().expect("--attachment-kb N")),
        daemons: value("--daemons").map_or_else(Vec::new, |v| {
            v.split(',')
                .map(|n| match n.trim().parse() {
                    Ok(n) if n > 0 => n,
                    _ => panic!("--daemons N,N,…: counts of 1 or more"),
                })
                .collect()
        }),
        suppressed: value("--suppressed").map(|v| v.parse().expect("--suppressed N")),
        reports: value("--reports").map(|v| v.parse().expect("--reports N")),
        routes: args.iter().any(|a| a == "--routes"),
        limit_unreached: args.iter().any(|a| a == "--limit-unreached"),
        templates: args.iter().any(|a| a == "--templates"),
        chaos: args.iter().any(|a| a == "--chaos").then(|| {
            value("--chaos-every").map_or(Duration::from_secs(120), |v| {
                humantime::parse_duration(&v).expect("--chaos-every DURATION")
            })
        }),
    }
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
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Sink {
    fn start() -> Sink {
        Sink::start_on(free_port(), &[])
    }

    /// A sink on `port` (again, after another one stopped there), with
    /// `smtp-sink`'s fault flags in `flags` (`-Q MAIL`: 421 to every MAIL).
    fn start_on(port: u16, flags: &[&str]) -> Sink {
        let mut cmd = Command::new(sbin("smtp-sink"));
        if as_root() {
            cmd.args(["-u", "nobody"]);
        }
        let mut child = cmd
            .args(flags)
            .arg("-c")
            .arg(format!("127.0.0.1:{port}"))
            .arg("1024")
            .stdout(Stdio::piped())
            .spawn()
            .expect("smtp-sink");
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let mut out = child.stdout.take().unwrap();
        let seen = arrivals.clone();
        let reader = std::thread::spawn(move || {
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
            reader: Some(reader),
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

    /// Kills the sink (its port refuses connections from now on) and
    /// returns the messages it received, its last counter line read.
    fn stop(mut self) -> usize {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        self.messages()
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Which database the benchmark runs on, from `--database URL`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Backend {
    Postgres,
    Mysql,
    Sqlite,
}

impl Backend {
    fn of(url: &str) -> Backend {
        if url.starts_with("postgres") {
            Backend::Postgres
        } else if url.starts_with("mysql") || url.starts_with("mariadb") {
            Backend::Mysql
        } else if url.starts_with("sqlite") {
            Backend::Sqlite
        } else {
            panic!("--database: postgres://…, mysql://… or sqlite://")
        }
    }

    fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "PostgreSQL",
            Backend::Mysql => "MariaDB",
            Backend::Sqlite => "SQLite",
        }
    }

    /// The server's process name in /proc, for its CPU time.
    fn process(self) -> Option<&'static str> {
        match self {
            Backend::Postgres => Some("(postgres"),
            Backend::Mysql => Some("(mariadbd"),
            Backend::Sqlite => None,
        }
    }
}

/// A connection to the bench database, whatever the backend.
enum Pool {
    Pg(PgPool),
    My(MySqlPool),
    Lite(SqlitePool),
}

macro_rules! on_pool {
    ($pool:expr, $p:ident => $e:expr) => {
        match $pool {
            Pool::Pg($p) => $e,
            Pool::My($p) => $e,
            Pool::Lite($p) => $e,
        }
    };
}

/// A fresh database, dropped at the end.
struct BenchDb {
    backend: Backend,
    admin: String,
    name: String,
    url: String,
    pool: Pool,
}

impl BenchDb {
    async fn create(target: &str, tablemail: &Path, dir: &Path) -> BenchDb {
        let backend = Backend::of(target);
        let name = format!("tm_bench_{}", uuid::Uuid::new_v4().simple());
        let url = match backend {
            Backend::Sqlite => format!("sqlite://{}", dir.join(format!("{name}.db")).display()),
            _ => {
                let sql = format!("CREATE DATABASE {name}");
                admin(backend, target, &sql).await;
                format!("{}/{name}", target.rsplit_once('/').unwrap().0)
            }
        };
        let status = Command::new(tablemail)
            .arg("migrate")
            .env("TABLEMAIL__DATABASE__URL", &url)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "tablemail migrate");
        // One connection: MariaDB's session settings below hold for it.
        let pool = match backend {
            Backend::Postgres => Pool::Pg(
                PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .unwrap(),
            ),
            Backend::Mysql => Pool::My(
                MySqlPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .unwrap(),
            ),
            Backend::Sqlite => Pool::Lite(
                SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect_with(
                        SqliteConnectOptions::from_str(&url)
                            .unwrap()
                            .busy_timeout(Duration::from_secs(30)),
                    )
                    .await
                    .unwrap(),
            ),
        };
        let db = BenchDb {
            backend,
            admin: target.to_string(),
            name,
            url,
            pool,
        };
        if backend == Backend::Mysql {
            db.exec("SET SESSION max_recursive_iterations = 100000000")
                .await;
        }
        db
    }

    /// Runs `sql` as text, not prepared: the inserts of the latency
    /// figures are each a statement of their own, and sqlx keeps 100
    /// prepared; on MariaDB each one past those closes an older one, and
    /// the next command waits for the server's delayed acknowledgement
    /// (40 ms; `store::shared::id_list_len` says why).
    async fn exec(&self, sql: &str) {
        let sql = AssertSqlSafe(sql.to_string());
        on_pool!(&self.pool, p => sqlx::raw_sql(sql).execute(p).await.map(|_| ()))
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// `sql` and the rows it changed, or the error (a server restart).
    async fn try_exec(&self, sql: &str) -> Result<u64, String> {
        let sql = AssertSqlSafe(sql.to_string());
        on_pool!(&self.pool, p => sqlx::query(sql).execute(p).await.map(|r| r.rows_affected()))
            .map_err(|e| e.to_string())
    }

    async fn try_i64(&self, sql: &str) -> Result<i64, String> {
        let sql = AssertSqlSafe(sql.to_string());
        on_pool!(&self.pool, p => sqlx::query_scalar::<_, i64>(sql).fetch_one(p).await)
            .map_err(|e| e.to_string())
    }

    /// Rows of (text, count), e.g. a GROUP BY.
    async fn counts(&self, sql: &str) -> Vec<(String, i64)> {
        let sql = AssertSqlSafe(sql.to_string());
        on_pool!(&self.pool, p => sqlx::query_as::<_, (String, i64)>(sql).fetch_all(p).await)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    async fn text(&self, sql: &str) -> String {
        let sql = AssertSqlSafe(sql.to_string());
        on_pool!(&self.pool, p => sqlx::query_scalar::<_, String>(sql).fetch_one(p).await)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The database's clock, as the daemon's statements read it.
    fn now(&self) -> &'static str {
        match self.backend {
            Backend::Postgres => "now()",
            Backend::Mysql => "UTC_TIMESTAMP(6)",
            Backend::Sqlite => "strftime('%Y-%m-%d %H:%M:%f', 'now')",
        }
    }

    async fn i64(&self, sql: &str) -> i64 {
        let sql = AssertSqlSafe(sql.to_string());
        on_pool!(&self.pool, p => sqlx::query_scalar::<_, i64>(sql).fetch_one(p).await)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// PostgreSQL's write-ahead log position in bytes (the whole
    /// cluster's: nothing else writes while a drain runs); `None` elsewhere.
    async fn wal_position(&self) -> Option<i64> {
        if self.backend != Backend::Postgres {
            return None;
        }
        Some(
            self.i64("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8")
                .await,
        )
    }

    /// Rows not yet finished.
    async fn pending(&self) -> i64 {
        self.i64("SELECT count(*) FROM mail_queue WHERE status IN ('queued', 'sending')")
            .await
    }

    /// Fresh statistics, as after autovacuum caught up.
    async fn analyze(&self) {
        self.exec(match self.backend {
            Backend::Postgres => "VACUUM ANALYZE mail_queue",
            Backend::Mysql => "ANALYZE TABLE mail_queue",
            Backend::Sqlite => "ANALYZE",
        })
        .await;
    }

    /// Fresh statistics and nothing else (PostgreSQL's ANALYZE without the
    /// VACUUM, which would also set the hint bits of every row): the burst
    /// claims compare statistics, not the first touch of fresh rows.
    async fn statistics(&self) {
        match self.backend {
            Backend::Postgres => self.exec("ANALYZE mail_queue").await,
            _ => self.analyze().await,
        }
    }

    /// Inserts `n` mails of `shape` in statements of up to 100,000 rows, as an
    /// application's bulk insert; the bodies are bound once per statement.
    async fn load(&self, n: usize, shape: Shape, status: &str) {
        let mut done = 0;
        while done < n {
            let chunk = (n - done).min(100_000);
            self.load_chunk(done, chunk, shape, status)
                .await
                .unwrap_or_else(|e| panic!("load: {e}"));
            done += chunk;
        }
    }

    /// One INSERT of `n` rows: all of them or, on an error, none.
    async fn load_chunk(
        &self,
        offset: usize,
        n: usize,
        shape: Shape,
        status: &str,
    ) -> Result<(), String> {
        let (subject, body, html, from_name) = shape.content();
        let (first, last) = (offset + 1, offset + n);
        let cat = |parts: &[&str]| match self.backend {
            Backend::Mysql => format!("CONCAT({})", parts.join(", ")),
            _ => parts.join(" || "),
        };
        let numbers = match self.backend {
            Backend::Postgres => format!("generate_series({first}, {last}) AS g(n)"),
            _ => format!(
                "(WITH RECURSIVE s(n) AS (SELECT {first} UNION ALL SELECT n + 1 FROM s WHERE n < {last}) \
                 SELECT n FROM s) AS g"
            ),
        };
        let number = match self.backend {
            Backend::Postgres => "g.n::text",
            Backend::Mysql => "CAST(g.n AS CHAR)",
            Backend::Sqlite => "CAST(g.n AS TEXT)",
        };
        let processed = if status == "queued" {
            "NULL"
        } else {
            "CURRENT_TIMESTAMP"
        };
        let (p1, p2, p3, p4) = match self.backend {
            Backend::Postgres => ("$1", "$2", "$3", "$4"),
            _ => ("?", "?", "?", "?"),
        };
        if shape == Shape::OrderTemplated {
            // The row names the template; its data differs by the number.
            let rest = templates::data_rest().replace('\'', "''");
            let data = cat(&["'{\"number\": '", number, &format!("', {rest}'")]);
            let data = match self.backend {
                Backend::Postgres => format!("({data})::jsonb"),
                _ => data,
            };
            let sql = format!(
                "INSERT INTO mail_queue (to_address, template, template_data, from_name, status, processed_at) \
                 SELECT {to}, 'order', {data}, {p1}, '{status}', {processed} FROM {numbers}",
                to = cat(&["'user'", number, "'@example.com'"]),
            );
            let sql = AssertSqlSafe(sql);
            return on_pool!(&self.pool, p => sqlx::query(sql)
                .bind(from_name.clone())
                .execute(p)
                .await
                .map(|_| ()))
            .map_err(|e| e.to_string());
        }
        let sql = format!(
            "INSERT INTO mail_queue (to_address, subject, body, body_html, from_name, status, processed_at) \
             SELECT {to}, {subj}, {p2}, {p3}, {p4}, '{status}', {processed} FROM {numbers}",
            to = cat(&["'user'", number, "'@example.com'"]),
            subj = cat(&[p1, "' '", number]),
        );
        let sql = AssertSqlSafe(sql);
        on_pool!(&self.pool, p => sqlx::query(sql)
            .bind(subject)
            .bind(body)
            .bind(html)
            .bind(from_name)
            .execute(p)
            .await
            .map(|_| ()))
        .map_err(|e| e.to_string())
    }

    /// A template in `mail_template`, as `tablemail template put` writes it.
    async fn put_template(&self, t: &tablemail::store::TemplateRow) {
        let sql = match self.backend {
            Backend::Postgres => "INSERT INTO mail_template (name, locale, subject, body, body_html) VALUES ($1, $2, $3, $4, $5)",
            _ => "INSERT INTO mail_template (name, locale, subject, body, body_html) VALUES (?, ?, ?, ?, ?)",
        };
        on_pool!(&self.pool, p => sqlx::query(sql)
            .bind(t.name.clone())
            .bind(t.locale.clone())
            .bind(t.subject.clone())
            .bind(t.body.clone())
            .bind(t.body_html.clone())
            .execute(p)
            .await
            .map(|_| ()))
        .unwrap_or_else(|e| panic!("the template: {e}"));
    }

    /// `n` addresses on the suppression list, none of them a recipient of
    /// the loaded mails (`…@suppressed.example`).
    async fn load_suppressed(&self, n: usize) {
        let numbers = match self.backend {
            Backend::Postgres => format!("generate_series(1, {n}) AS g(n)"),
            _ => format!(
                "(WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM s WHERE n < {n}) \
                 SELECT n FROM s) AS g"
            ),
        };
        let address = match self.backend {
            Backend::Postgres => "'gone' || g.n || '@suppressed.example'",
            Backend::Mysql => "CONCAT('gone', g.n, '@suppressed.example')",
            Backend::Sqlite => "'gone' || g.n || '@suppressed.example'",
        };
        self.exec(&format!(
            "INSERT INTO mail_suppression (address, reason) SELECT {address}, 'hard_bounce' FROM {numbers}"
        ))
        .await;
        if self.backend == Backend::Postgres {
            self.exec("VACUUM ANALYZE mail_suppression").await;
        }
    }

    /// One attachment for every mail, inserted as an application would
    /// (its bytes bound once).
    async fn attach_to_all(&self, content: &[u8]) {
        let bytes = match self.backend {
            Backend::Postgres => "$1",
            _ => "?",
        };
        let sql = AssertSqlSafe(format!(
            "INSERT INTO mail_attachment (mail_id, filename, content_type, content) \
             SELECT id, 'Rechnung.pdf', 'application/pdf', {bytes} FROM mail_queue"
        ));
        on_pool!(&self.pool, p => sqlx::query(sql).bind(content.to_vec()).execute(p).await.map(|_| ()))
            .unwrap_or_else(|e| panic!("attachments: {e}"));
    }

    async fn drop_db(self) {
        on_pool!(&self.pool, p => p.close().await);
        match self.backend {
            Backend::Sqlite => {
                let path = self.url.trim_start_matches("sqlite://");
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{path}{suffix}"));
                }
            }
            Backend::Postgres => {
                let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
                admin(self.backend, &self.admin, &sql).await;
            }
            Backend::Mysql => {
                let sql = format!("DROP DATABASE IF EXISTS {}", self.name);
                admin(self.backend, &self.admin, &sql).await;
            }
        }
    }
}

/// Runs `sql` on the server of `target` (PostgreSQL or MariaDB).
async fn admin(backend: Backend, target: &str, sql: &str) {
    let sql = AssertSqlSafe(sql.to_string());
    let done = match backend {
        Backend::Postgres => {
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .connect(target)
                .await
                .expect("PostgreSQL (--database)");
            sqlx::query(sql).execute(&pool).await.map(|_| ())
        }
        _ => {
            let pool = MySqlPoolOptions::new()
                .max_connections(1)
                .connect(target)
                .await
                .expect("MariaDB (--database)");
            sqlx::query(sql).execute(&pool).await.map(|_| ())
        }
    };
    done.unwrap_or_else(|e| panic!("{e}"));
}

/// What the mails look like.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// ASCII text of ~2 KB in lines of 70 characters: the best case.
    Ascii,
    /// ASCII text of 200 bytes: for the claim-cost tables of a million rows.
    Small,
    /// A German order confirmation: text with non-ASCII and long lines, an
    /// HTML alternative on long lines, a non-ASCII subject and sender name.
    Real,
    /// An order confirmation of ten items as the `--templates` template
    /// renders it, inserted pre-rendered.
    Order,
    /// The same mail as a row naming the template, with its data.
    OrderTemplated,
}

impl Shape {
    /// (subject prefix, text body, HTML body, from_name)
    fn content(self) -> (String, String, Option<String>, Option<String>) {
        match self {
            Shape::Ascii => (
                "Bench mail".into(),
                format!("{}\r\n", "x".repeat(70)).repeat(BODY_BYTES.div_ceil(72)),
                None,
                None,
            ),
            Shape::Small => ("Bench mail".into(), "x".repeat(200), None, None),
            Shape::Real => {
                let text = format!(
                    "Sehr geehrte Frau Müller,\n\nvielen Dank für Ihre Bestellung bei Bäckerei Größenwahn & Söhne. \
                     Wir haben Ihre Zahlung erhalten und bereiten den Versand Ihrer Artikel vor; sobald das Paket \
                     unser Lager verlässt, erhalten Sie eine weitere Nachricht mit der Sendungsnummer.\n\n{}\n\
                     Mit freundlichen Grüßen\nIhr Kundenservice\n",
                    "1 × Roggenbrot „Schwarzwälder“ (750 g) ............ 4,95 €\n".repeat(6)
                );
                let html = format!(
                    "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Bestellbestätigung</title></head>\
                     <body style=\"font-family: Helvetica, Arial, sans-serif; color: #222; background: #fff\">\
                     <table width=\"100%\" cellpadding=\"0\" cellspacing=\"0\"><tr><td>\
                     <p>Sehr geehrte Frau Müller,</p><p>vielen Dank für Ihre Bestellung bei Bäckerei Größenwahn &amp; Söhne. \
                     Wir haben Ihre Zahlung erhalten und bereiten den Versand Ihrer Artikel vor.</p>{}\
                     <p>Mit freundlichen Grüßen<br>Ihr Kundenservice</p></td></tr></table></body></html>",
                    "<tr><td style=\"padding: 4px 8px\">1 × Roggenbrot „Schwarzwälder“ (750 g)</td><td align=\"right\">4,95 €</td></tr>"
                        .repeat(6)
                );
                (
                    "Ihre Bestellung wurde bestätigt – Nr.".into(),
                    text,
                    Some(html),
                    Some("Bäckerei Größenwahn".into()),
                )
            }
            Shape::Order | Shape::OrderTemplated => {
                let (subject, text, html) = templates::rendered();
                (
                    subject,
                    text,
                    Some(html),
                    Some("Bäckerei Größenwahn".into()),
                )
            }
        }
    }

    /// Bytes of one mail of this shape as it goes out (built by the daemon's
    /// own message writer, with its attachment): what smtp-source sends for
    /// the ceiling of the same run.
    fn wire_bytes(self, attachment: &[u8]) -> usize {
        let (subject, body, html, from_name) = self.content();
        let part = [tablemail::mail::Attachment {
            filename: "Rechnung.pdf",
            content_type: "application/pdf",
            content: attachment,
            content_id: None,
        }];
        let draft = tablemail::mail::Draft {
            from_name: from_name.as_deref(),
            from_address: Some("bench@example.com"),
            to_address: "user1@example.com",
            subject: &format!("{subject} 1"),
            body: Some(&body),
            body_html: html.as_deref(),
            message_id: Some("<0123456789abcdef0123456789abcdef.1@bench.example>"),
            attachments: if attachment.is_empty() { &[] } else { &part },
            ..tablemail::mail::Draft::default()
        };
        let defaults = tablemail::mail::MessageDefaults {
            from_address: None,
            from_name: None,
            max_message_size: u64::MAX,
            max_recipients: 1000,
            dkim: None,
            bounce: None,
        };
        tablemail::mail::prepare(&draft, &defaults)
            .expect("the bench mail builds")
            .bytes
            .len()
    }
}

/// `tablemail run` with its logs in a file.
struct Daemon {
    child: Child,
    log: PathBuf,
    /// When it was spawned.
    started: Instant,
}

impl Daemon {
    fn start(tablemail: &Path, dir: &Path, name: &str, env: &[(&str, String)]) -> Daemon {
        let d = Daemon::spawn(tablemail, dir, name, env);
        d.wait_started();
        d
    }

    /// Starts `tablemail run` without waiting for it to be ready.
    fn spawn(tablemail: &Path, dir: &Path, name: &str, env: &[(&str, String)]) -> Daemon {
        let log = dir.join(format!("{name}.log"));
        let mut cmd = Command::new(tablemail);
        if let Some((_, config)) = env.iter().find(|(k, _)| *k == CONFIG_ARG) {
            cmd.args([CONFIG_ARG, config]);
        }
        cmd.arg("run")
            .env("TABLEMAIL__DEFAULTS__FROM_ADDRESS", "bench@example.com")
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(Stdio::inherit());
        for (k, v) in env.iter().filter(|(k, _)| *k != CONFIG_ARG) {
            cmd.env(k, v);
        }
        let started = Instant::now();
        let child = cmd.spawn().expect("tablemail run");
        Daemon {
            child,
            log,
            started,
        }
    }

    fn wait_started(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.logged("worker started") {
            assert!(Instant::now() < deadline, "the daemon did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How the daemon said it notices new rows (`wakeup` of its `worker
    /// started` line: `notify`, `data_version`, `newest_id`, `poll`).
    fn wakeup(&self) -> String {
        let f = std::fs::File::open(&self.log).unwrap();
        BufReader::new(f)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(&l).ok())
            .find(|l| l["message"] == "worker started")
            .and_then(|l| l["wakeup"].as_str().map(str::to_string))
            .unwrap_or_else(|| "?".into())
    }

    /// Log lines whose message starts with `message`.
    fn count(&self, message: &str) -> usize {
        let f = std::fs::File::open(&self.log).unwrap();
        let needle = format!("\"message\":\"{message}");
        BufReader::new(f)
            .lines()
            .map_while(Result::ok)
            .filter(|l| l.contains(&needle))
            .count()
    }

    /// Resident memory now, in KiB.
    fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// `kill -9`: no shutdown, its rows stay `sending` under its locks.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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
fn ceiling(mails: usize, bytes: usize) -> f64 {
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
            &bytes.to_string(),
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
    /// PostgreSQL's write-ahead log written during the drain (0 elsewhere):
    /// what the claims and outcomes write, free of the machine's noise.
    wal_bytes_per_mail: f64,
    peak_rss_mib: f64,
    sink_count: usize,
}

/// How a drain runs.
#[derive(Clone, Copy)]
struct Setup<'a> {
    target: &'a str,
    tablemail: &'a Path,
    dir: &'a Path,
    /// Environment every daemon gets besides the database and the relay.
    env: &'a [(&'a str, String)],
    /// The attachment each drained mail carries (empty: none).
    attachment: &'a [u8],
    /// Addresses on the suppression list before the daemon starts, none of
    /// them a recipient.
    suppressed: usize,
    /// Half the mails from `shop.example`, half from `support.example`.
    split_from: bool,
    /// Two routes, one per domain of `split_from`, both to the drain's sink.
    two_routes: bool,
}

/// `mails` rows of `shape` loaded before the daemon starts (as after an
/// outage or a bulk campaign), then `tablemail run` until the sink has them
/// all: mails per second from the daemon's start. `analyzed` refreshes the
/// statistics first (the best case); without it the backlog is a burst the
/// statistics have not seen.
/// Waits until the sink has `mails` and then, within `settle`, no row is
/// left pending (the last outcomes written); returns the seconds from
/// `started` until the sink had them all.
async fn until_drained(
    sink: &Sink,
    db: &BenchDb,
    mails: usize,
    started: Instant,
    settle: Duration,
    who: &str,
) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(900);
    while sink.messages() < mails {
        assert!(
            Instant::now() < deadline,
            "{who} did not finish: the sink has {} of {mails}",
            sink.messages()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let deadline = Instant::now() + settle;
    while db.pending().await > 0 {
        assert!(Instant::now() < deadline, "rows left unfinished");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    seconds
}

async fn drain(setup: &Setup<'_>, mails: usize, shape: Shape, analyzed: bool) -> Drain {
    let db = BenchDb::create(setup.target, setup.tablemail, setup.dir).await;
    let sink = Sink::start();
    db.load(mails, shape, "queued").await;
    if shape == Shape::OrderTemplated {
        db.put_template(&templates::row()).await;
    }
    if !setup.attachment.is_empty() {
        db.attach_to_all(setup.attachment).await;
    }
    if setup.suppressed > 0 {
        db.load_suppressed(setup.suppressed).await;
    }
    if setup.split_from {
        db.exec(
            "UPDATE mail_queue SET from_address = CASE WHEN id % 2 = 0 \
             THEN 'bench@shop.example' ELSE 'bench@support.example' END",
        )
        .await;
    }
    if analyzed {
        db.analyze().await;
    }
    let db_cpu_before = server_cpu(db.backend);
    let wal_before = db.wal_position().await;
    let mut env = vec![
        ("TABLEMAIL__DATABASE__URL", db.url.clone()),
        (
            "TABLEMAIL__TRANSPORT__URL",
            format!("smtp://127.0.0.1:{}", sink.port),
        ),
    ];
    env.extend(setup.env.iter().cloned());
    if setup.two_routes {
        let config = setup.dir.join("routes.toml");
        let url = format!("smtp://127.0.0.1:{}", sink.port);
        std::fs::write(
            &config,
            format!(
                "[[routes]]\nname = \"shop\"\nfrom_domains = [\"shop.example\"]\nurl = \"{url}\"\n\
                 [[routes]]\nname = \"support\"\nfrom_domains = [\"support.example\"]\nurl = \"{url}\"\n"
            ),
        )
        .unwrap();
        env.push((CONFIG_ARG, config.display().to_string()));
    }
    let daemon = Daemon::start(setup.tablemail, setup.dir, "drain", &env);
    let settle = Duration::from_secs(30);
    let seconds = until_drained(&sink, &db, mails, daemon.started, settle, "the drain").await;
    let (cpu, peak_rss_kib) = daemon.usage();
    let db_cpu = server_cpu(db.backend) - db_cpu_before;
    let wal_bytes = match (wal_before, db.wal_position().await) {
        (Some(before), Some(after)) => (after - before) as f64,
        _ => 0.0,
    };
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
        wal_bytes_per_mail: wal_bytes / mails as f64,
        peak_rss_mib: peak_rss_kib as f64 / 1024.0,
        sink_count,
    }
}

/// CPU seconds used so far by the database server's processes on this host
/// (processes that ended in between are not counted); 0 for SQLite, whose
/// work is the daemon's own.
fn server_cpu(backend: Backend) -> f64 {
    let Some(name) = backend.process() else {
        return 0.0;
    };
    let mut ticks = 0.0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((head, tail)) = stat.rsplit_once(')') else {
            continue;
        };
        if !head.ends_with(name) {
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

/// The pauses between the latency figures' inserts: 15 to 115 ms, drawn
/// anew each time (a fixed sequence of numbers, the same in every run).
/// Each insert follows the last one's arrival, which a daemon that looks
/// for new rows every 100 ms (MariaDB's) sends just after a look: pauses
/// shorter than that interval, or in a rhythm, put every insert at the same
/// few places in it, and the figures said the wait for the next look was
/// 52–82 ms where it is anything from 0 to 100.
struct Gaps(u64);

impl Gaps {
    fn new(seed: i64) -> Gaps {
        Gaps(0x9E37_79B9_7F4A_7C15 ^ seed as u64)
    }

    fn next(&mut self) -> Duration {
        // xorshift64
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        Duration::from_micros(15_000 + self.0 % 100_000)
    }
}

/// Inserts one mail at a time into an idle daemon; milliseconds from the
/// INSERT's commit until the SMTP server has the mail, sorted, and the
/// median time the INSERT itself took.
async fn pickup(db: &BenchDb, sink: &Sink, samples: usize) -> (Vec<f64>, f64) {
    let mut latencies = Vec::with_capacity(samples);
    let mut inserts = Vec::with_capacity(samples);
    let already = sink.messages();
    let mut gaps = Gaps::new(i64::try_from(samples).unwrap_or(0));
    for i in 0..samples {
        tokio::time::sleep(gaps.next()).await;
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
    /// The daemon's `wakeup`.
    how: String,
    notify: Vec<f64>,
    insert_ms: f64,
    /// [`batches`].
    batches: Vec<f64>,
    polled: Vec<f64>,
    /// MariaDB: pickups with looks every [`FAST_LOOK`].
    fast_look: Vec<f64>,
    /// MariaDB: what an idle daemon costs, in CPU milliseconds a second
    /// (the daemon's, the server's), looking every 100 ms (the default) and
    /// every [`FAST_LOOK`].
    idle: Vec<(String, f64, f64)>,
}

/// The look interval set beside MariaDB's default (`database.look_interval`).
const FAST_LOOK: &str = "2ms";

/// CPU milliseconds a second of an idle `daemon` and of the database server
/// over five seconds.
async fn idle_cost(daemon: &Daemon, backend: Backend) -> (f64, f64) {
    let window = Duration::from_secs(5);
    let (d0, s0) = (daemon.usage().0, server_cpu(backend));
    tokio::time::sleep(window).await;
    let (d1, s1) = (daemon.usage().0, server_cpu(backend));
    let per_second = |cpu: f64| cpu * 1000.0 / window.as_secs_f64();
    (per_second(d1 - d0), per_second(s1 - s0))
}

/// Pickup latency into an idle daemon: with its wake-up (NOTIFY on
/// PostgreSQL, `data_version` on SQLite, the newest id on MariaDB), then, on
/// PostgreSQL, by polling alone, and on MariaDB looking every [`FAST_LOOK`],
/// with what an idle daemon costs looking each way.
async fn latency(setup: &Setup<'_>, samples: usize) -> Latency {
    let db = BenchDb::create(setup.target, setup.tablemail, setup.dir).await;
    let sink = Sink::start();
    let mut env = vec![
        ("TABLEMAIL__DATABASE__URL", db.url.clone()),
        (
            "TABLEMAIL__TRANSPORT__URL",
            format!("smtp://127.0.0.1:{}", sink.port),
        ),
    ];
    env.extend(setup.env.iter().cloned());
    let daemon = Daemon::start(setup.tablemail, setup.dir, "latency", &env);
    let how = daemon.wakeup();
    // Warm the connection pools on both sides.
    pickup(&db, &sink, 5).await;
    let (notify, insert_ms) = pickup(&db, &sink, samples).await;
    let batches = batches(&db, &sink, 100).await;
    let (mut polled, mut fast_look, mut idle) = (Vec::new(), Vec::new(), Vec::new());
    if db.backend == Backend::Postgres {
        // Without the trigger, only worker.poll_interval (1s) finds new rows.
        db.exec("DROP TRIGGER mail_queue_notify ON mail_queue")
            .await;
        polled = pickup(&db, &sink, 30).await.0;
    }
    if db.backend == Backend::Mysql {
        let (d, s) = idle_cost(&daemon, db.backend).await;
        let default = humantime::format_duration(tablemail::store::DEFAULT_LOOK_INTERVAL);
        idle.push((default.to_string(), d, s));
    }
    daemon.stop();
    if db.backend == Backend::Mysql {
        // No NOTIFY: the pickup is the look's to make, and the look costs
        // the more the more often it looks.
        let mut env = env.clone();
        env.push(("TABLEMAIL__DATABASE__LOOK_INTERVAL", FAST_LOOK.into()));
        let fast = Daemon::start(setup.tablemail, setup.dir, "latency-fast-look", &env);
        pickup(&db, &sink, 5).await;
        fast_look = pickup(&db, &sink, samples).await.0;
        let (d, s) = idle_cost(&fast, db.backend).await;
        idle.push((FAST_LOOK.to_string(), d, s));
        fast.stop();
    }
    db.drop_db().await;
    Latency {
        how,
        notify,
        insert_ms,
        batches,
        polled,
        fast_look,
        idle,
    }
}

/// Batches of 1 to `largest` rows, each inserted in one statement into an
/// idle daemon once the one before was sent: milliseconds from a batch's
/// commit until the SMTP server has all its mails, sorted. Claims and
/// outcomes of every size, as a queue fed by many applications sees them
/// (a drain's claims are all of one size, a pickup's of one row).
async fn batches(db: &BenchDb, sink: &Sink, largest: usize) -> Vec<f64> {
    let mut latencies = Vec::with_capacity(largest);
    let mut gaps = Gaps::new(-1);
    for k in 1..=largest {
        tokio::time::sleep(gaps.next()).await;
        let already = sink.messages();
        let values: Vec<String> = (0..k)
            .map(|i| format!("('b{k}.{i}@example.com', 'batch {k}', 'x')"))
            .collect();
        db.exec(&format!(
            "INSERT INTO mail_queue (to_address, subject, body) VALUES {}",
            values.join(", ")
        ))
        .await;
        let committed = unix_now();
        let deadline = Instant::now() + Duration::from_secs(30);
        let arrived = loop {
            if let Some(t) = sink.arrival(already + k - 1) {
                break t;
            }
            assert!(Instant::now() < deadline, "batch {k} never arrived whole");
            tokio::time::sleep(Duration::from_micros(200)).await;
        };
        latencies.push((arrived - committed) * 1000.0);
    }
    latencies.sort_by(|a, b| a.partial_cmp(b).unwrap());
    latencies
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
            inline_limit: 32 * 1024,
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
                relay_reply: Some("250 2.0.0 Ok: queued".into()),
                event: None,
            })
            .collect();
        store.finalize(&writes).await.unwrap();
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    percentile(&times, 0.5)
}

/// Claim medians in ms.
struct ClaimCost {
    /// 10k due rows, statistics fresh.
    small: f64,
    /// 50k due rows of 2 KB that arrived in one burst, statistics never
    /// taken, then the same after ANALYZE.
    burst_50k: (f64, f64),
    /// 1M due rows of 200 bytes from one burst, then after ANALYZE.
    burst_1m: (f64, f64),
    /// 10k due rows beside 1M finished ones.
    beside_finished: f64,
}

/// Claim medians on a burst of `n` rows of `shape`: before and after ANALYZE.
async fn burst_claims(setup: &Setup<'_>, n: usize, shape: Shape) -> (f64, f64) {
    let db = BenchDb::create(setup.target, setup.tablemail, setup.dir).await;
    let store = store::connect(&db.url, 4).await.unwrap();
    db.load(n, shape, "queued").await;
    let fresh = claim_ms(&store, 30).await;
    db.statistics().await;
    let analyzed = claim_ms(&store, 30).await;
    drop(store);
    db.drop_db().await;
    (fresh, analyzed)
}

async fn claim_cost(setup: &Setup<'_>) -> ClaimCost {
    let db = BenchDb::create(setup.target, setup.tablemail, setup.dir).await;
    let store = store::connect(&db.url, 4).await.unwrap();
    db.load(10_000, Shape::Small, "queued").await;
    db.analyze().await;
    let small = claim_ms(&store, 30).await;
    drop(store);
    db.drop_db().await;

    let burst_50k = burst_claims(setup, 50_000, Shape::Ascii).await;
    let burst_1m = burst_claims(setup, 1_000_000, Shape::Small).await;

    let db = BenchDb::create(setup.target, setup.tablemail, setup.dir).await;
    let store = store::connect(&db.url, 4).await.unwrap();
    db.load(1_000_000, Shape::Small, "sent").await;
    db.load(10_000, Shape::Small, "queued").await;
    db.analyze().await;
    let beside_finished = claim_ms(&store, 30).await;
    drop(store);
    db.drop_db().await;
    ClaimCost {
        small,
        burst_50k,
        burst_1m,
        beside_finished,
    }
}

/// Constant load for `duration`: a feeder keeps a backlog, the daemon drains
/// it, retention deletes sent rows after a minute. Mails per second, per minute.
async fn soak(setup: &Setup<'_>, duration: Duration) -> (Vec<f64>, f64) {
    let db = BenchDb::create(setup.target, setup.tablemail, setup.dir).await;
    let sink = Sink::start();
    let mut env = vec![
        ("TABLEMAIL__DATABASE__URL", db.url.clone()),
        (
            "TABLEMAIL__TRANSPORT__URL",
            format!("smtp://127.0.0.1:{}", sink.port),
        ),
        ("TABLEMAIL__RETENTION__SENT", "1m".to_string()),
    ];
    env.extend(setup.env.iter().cloned());
    let daemon = Daemon::start(setup.tablemail, setup.dir, "soak", &env);
    let started = Instant::now();
    let mut per_minute = Vec::new();
    let mut minute_start = (Instant::now(), sink.messages());
    while started.elapsed() < duration {
        let backlog = db
            .i64("SELECT count(*) FROM mail_queue WHERE status = 'queued'")
            .await;
        if backlog < 30_000 {
            db.load(20_000, Shape::Real, "queued").await;
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

/// One side of a paired measurement: its name, its setup, its mails.
struct Side<'a, 's> {
    name: &'a str,
    setup: &'a Setup<'s>,
    shape: Shape,
}

/// Drains of `a` and `b`, one pair per run, the order alternating from run
/// to run so that the machine's drift hits both alike: (a, b) per run.
async fn paired(
    a: Side<'_, '_>,
    b: Side<'_, '_>,
    mails: usize,
    runs: usize,
) -> Vec<(Drain, Drain)> {
    let mut pairs = Vec::new();
    for run in 1..=runs.max(1) {
        let (x, y) = if run % 2 == 1 {
            let x = drain(a.setup, mails, a.shape, false).await;
            (x, drain(b.setup, mails, b.shape, false).await)
        } else {
            let y = drain(b.setup, mails, b.shape, false).await;
            (drain(a.setup, mails, a.shape, false).await, y)
        };
        eprintln!(
            "run {run}: {} {:.0}/s ({:.1} µs/mail), {} {:.0}/s ({:.1} µs/mail)",
            a.name, x.rate, x.cpu_us_per_mail, b.name, y.rate, y.cpu_us_per_mail
        );
        pairs.push((x, y));
    }
    pairs
}

/// The report of a paired measurement: mails per second and CPU per mail,
/// each pair's second against its first (`ratio`: "with / without").
fn paired_report(title: &str, ratio: &str, pairs: &[(Drain, Drain)]) {
    println!("{title}");
    let of = |f: &dyn Fn(&(Drain, Drain)) -> f64| pairs.iter().map(f).collect::<Vec<f64>>();
    line(
        format!("  mails/s, {ratio}"),
        spread(of(&|p| p.1.rate / p.0.rate), "x", 3),
    );
    line(
        format!("  daemon CPU per mail, {ratio}"),
        spread(of(&|p| p.1.cpu_us_per_mail / p.0.cpu_us_per_mail), "x", 3),
    );
    line(
        format!("  database CPU per mail, {ratio}"),
        spread(
            of(&|p| p.1.db_cpu_us_per_mail / p.0.db_cpu_us_per_mail.max(1e-9)),
            "x",
            3,
        ),
    );
}

/// One line of the report.
fn line(label: impl std::fmt::Display, value: impl std::fmt::Display) {
    println!("{:<50} {:>26}", label.to_string(), value.to_string());
}

/// A DKIM key made by openssl for the run (`--dkim`, `--dkim-ed25519`).
fn dkim_env(dir: &Path, kind: &str) -> Vec<(&'static str, String)> {
    let key = dir.join("dkim.pem");
    let mut openssl = Command::new("openssl");
    match kind {
        "rsa" => openssl.args(["genrsa", "-out"]).arg(&key).arg("2048"),
        _ => openssl
            .args(["genpkey", "-algorithm", "ed25519", "-out"])
            .arg(&key),
    };
    let made = openssl.output().expect("openssl");
    assert!(made.status.success(), "openssl: {made:?}");
    vec![
        ("TABLEMAIL__DKIM__DOMAIN", "example.com".into()),
        ("TABLEMAIL__DKIM__SELECTOR", "bench".into()),
        (
            "TABLEMAIL__DKIM__PRIVATE_KEY_FILE",
            key.display().to_string(),
        ),
    ]
}

/// "median (lowest–highest)" of `v`.
fn spread(mut v: Vec<f64>, unit: &str, digits: usize) -> String {
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
}

/// Prints the figures of one condition's drains against their ceilings.
fn report(title: &str, backend: Backend, runs: &[(f64, Drain)]) {
    println!("{title}");
    let of = |f: &dyn Fn(&(f64, Drain)) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
    line(
        "  smtp-source -d -s 16 into smtp-sink",
        spread(of(&|r| r.0), "/s", 0),
    );
    line(
        format!("  tablemail end to end ({} -> smtp-sink)", backend.name()),
        spread(of(&|r| r.1.rate), "/s", 0),
    );
    line(
        "  ratio to the ceiling",
        spread(of(&|r| 100.0 * r.1.rate / r.0), "%", 0),
    );
    line(
        "  daemon CPU per mail",
        spread(of(&|r| r.1.cpu_us_per_mail), " µs", 1),
    );
    if backend.process().is_some() {
        line(
            format!("  {} CPU per mail (same host)", backend.name()),
            spread(of(&|r| r.1.db_cpu_us_per_mail), " µs", 1),
        );
    }
    if backend == Backend::Postgres {
        line(
            "  PostgreSQL WAL per mail",
            spread(of(&|r| r.1.wal_bytes_per_mail), " B", 0),
        );
    }
    line(
        "  daemon peak RSS",
        spread(of(&|r| r.1.peak_rss_mib), " MiB", 1),
    );
    line(
        "  mails the sink counted, every run",
        runs.iter().map(|r| r.1.sink_count).min().unwrap_or(0),
    );
}

#[tokio::main]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        // `cargo test --all-targets` builds and runs this too: do nothing there.
        println!("run with `cargo bench --bench throughput`");
        return;
    }
    let opts = options();
    assert!(
        opts.chaos.is_none() || opts.soak.is_some(),
        "--chaos goes with --soak DURATION"
    );
    let dir = scratch();
    let backend = Backend::of(&opts.database);
    let mut env = opts.dkim.map_or_else(Vec::new, |kind| dkim_env(&dir, kind));
    let attachment = pdf_like(opts.attachment_kb * 1024);
    if !attachment.is_empty() {
        // Room for the attachment: the default limit is 25 MB.
        env.push(("TABLEMAIL__TRANSPORT__MAX_MESSAGE_SIZE", "100MB".into()));
    }
    let setup = Setup {
        target: &opts.database,
        tablemail: &opts.tablemail,
        dir: &dir,
        env: &env,
        attachment: &attachment,
        suppressed: 0,
        split_from: false,
        two_routes: false,
    };
    println!("tablemail benchmark — {}", machine());
    println!(
        "{} mails per drain on {} ({}), daemon {}{}",
        opts.mails,
        backend.name(),
        redact(&opts.database),
        opts.tablemail.display(),
        match opts.dkim {
            Some("rsa") => ", DKIM signing with RSA-2048",
            Some(_) => ", DKIM signing with Ed25519",
            None => "",
        }
    );
    println!();

    let mut real = Vec::with_capacity(opts.runs);
    let mut best = Vec::with_capacity(opts.runs);
    let mut bodies = Vec::with_capacity(opts.runs);
    for run in (1..=opts.runs.max(1)).filter(|_| opts.drain) {
        let ceiling_real = ceiling(opts.mails, Shape::Real.wire_bytes(&attachment));
        let d = drain(&setup, opts.mails, Shape::Real, false).await;
        eprintln!(
            "run {run}, real: ceiling {ceiling_real:.0}/s, tablemail {:.0}/s, daemon {:.1} µs/mail",
            d.rate, d.cpu_us_per_mail
        );
        real.push((ceiling_real, d));
        let ceiling_best = ceiling(opts.mails, Shape::Ascii.wire_bytes(&attachment));
        let d = drain(&setup, opts.mails, Shape::Ascii, true).await;
        eprintln!(
            "run {run}, best case: ceiling {ceiling_best:.0}/s, tablemail {:.0}/s, daemon {:.1} µs/mail",
            d.rate, d.cpu_us_per_mail
        );
        best.push((ceiling_best, d));
        if opts.bodies {
            // The same ceiling as the real drain's: messages of that size.
            let d = drain(&setup, opts.mails, Shape::Real, true).await;
            eprintln!(
                "run {run}, real mix analyzed: tablemail {:.0}/s, daemon {:.1} µs/mail",
                d.rate, d.cpu_us_per_mail
            );
            bodies.push((ceiling_real, d));
        }
    }
    if opts.drain {
        report(
        "real: a burst backlog, statistics not taken, German text + HTML, from the daemon's start",
        backend,
        &real,
    );
        report(
            "best case: ASCII text of 2 KB, statistics fresh, from the daemon's start",
            backend,
            &best,
        );
    }
    if opts.drain && opts.bodies {
        report(
            "the bodies alone: German text + HTML, statistics fresh, from the daemon's start",
            backend,
            &bodies,
        );
        // Run by run against the best case of the same run (the machine's
        // speed moves less within a run than between runs).
        let ratio = |f: &dyn Fn(&Drain) -> f64| {
            bodies
                .iter()
                .zip(&best)
                .map(|(b, a)| f(&b.1) / f(&a.1))
                .collect::<Vec<f64>>()
        };
        line(
            "  mails/s, real mix / ASCII",
            spread(ratio(&|d| d.rate), "x", 2),
        );
        line(
            "  daemon CPU per mail, real mix / ASCII",
            spread(ratio(&|d| d.cpu_us_per_mail), "x", 2),
        );
    }

    if opts.latency {
        let l = latency(&setup, opts.samples).await;
        let ms = |v: &[f64]| format!("{:.2} / {:.2} ms", percentile(v, 0.5), percentile(v, 0.99));
        let how = match l.how.as_str() {
            "poll" => "polling 1s, no wake-up".to_string(),
            how => format!("wake-up: {how}"),
        };
        line(
            format!("pickup p50 / p99, {how} ({} samples)", l.notify.len()),
            ms(&l.notify),
        );
        line(
            "  the INSERT's own commit (median)",
            format!("{:.2} ms", l.insert_ms),
        );
        line(
            format!(
                "batches of 1 to {} rows, to the last one sent",
                l.batches.len()
            ),
            ms(&l.batches),
        );
        if !l.polled.is_empty() {
            line(
                format!("pickup p50 / p99, polling 1s ({} samples)", l.polled.len()),
                ms(&l.polled),
            );
        }
        if !l.fast_look.is_empty() {
            line(
                format!(
                    "pickup p50 / p99, looking every {FAST_LOOK} ({} samples)",
                    l.fast_look.len()
                ),
                ms(&l.fast_look),
            );
        }
        for (every, daemon, server) in &l.idle {
            line(
                format!("  idle, looking every {every}: daemon / server CPU a second"),
                format!("{daemon:.1} / {server:.1} ms"),
            );
        }
    }
    if opts.claim_cost {
        let c = claim_cost(&setup).await;
        let ms = |v: f64| format!("{v:.2} ms");
        line("claim of 100 (medians): 10k due, analyzed", ms(c.small));
        for (label, (fresh, analyzed)) in [
            ("50k due of 2 KB", c.burst_50k),
            ("1M due of 200 B", c.burst_1m),
        ] {
            line(format!("  {label}, a burst, not analyzed"), ms(fresh));
            line(format!("  {label}, after ANALYZE"), ms(analyzed));
            line(
                "    not analyzed / analyzed",
                format!("{:.2}x", fresh / analyzed),
            );
        }
        line("  10k due beside 1M sent", ms(c.beside_finished));
        line(
            "  1M due / 10k due, analyzed",
            format!("{:.2}x", c.burst_1m.1 / c.small),
        );
    }
    if let Some(n) = opts.suppressed {
        let pairs = feedback::suppression_cost(&setup, opts.mails, opts.runs, n).await;
        feedback::suppression_report(n, &pairs);
    }
    if opts.routes {
        let pairs = routes::route_cost(&setup, opts.mails, opts.runs).await;
        routes::report(&pairs);
    }
    if opts.limit_unreached {
        let pairs = limits::limit_cost(&setup, opts.mails, opts.runs).await;
        limits::limit_report(&pairs);
    }
    if opts.templates {
        let pairs = templates::cost(&setup, opts.mails, opts.runs).await;
        templates::report(&pairs);
    }
    if let Some(n) = opts.reports {
        let rates = feedback::report_rates(&setup, n).await;
        feedback::rates_report(backend, n, rates);
    }
    if !opts.daemons.is_empty() {
        let mut runs = Vec::new();
        // Runs interleaved, so that the machine's drift hits every count alike.
        for run in 1..=opts.runs.max(1) {
            for &n in &opts.daemons {
                let r = scale::drain(&setup, opts.mails, n).await;
                eprintln!("run {run}, {n} daemons: {:.0}/s", r.rate);
                runs.push(r);
            }
        }
        scale::report(backend, &runs);
    }
    if let (Some(duration), Some(every)) = (opts.soak, opts.chaos) {
        let r = chaos::soak(&setup, duration, every).await;
        chaos::report(&r);
        println!("daemon logs: {}", dir.display());
        return;
    }
    if let Some(duration) = opts.soak {
        let (per_minute, rss) = soak(&setup, duration).await;
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

/// `len` bytes that look like a compressed PDF: a header, then bytes no text
/// encoding carries unharmed (base64 in the message).
fn pdf_like(len: usize) -> Vec<u8> {
    if len == 0 {
        return Vec::new();
    }
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut out = b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n".to_vec();
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push((x >> 32) as u8);
    }
    out.truncate(len);
    out
}

/// The URL without a password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => match url[scheme + 3..at].split_once(':') {
            Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
            None => url.to_string(),
        },
        _ => url.to_string(),
    }
}
