//! Test support: a fresh database per test, a real SMTP server, a worker wired
//! to both, and polling with a deadline.
#![allow(dead_code)]

pub mod http;
pub mod proxy;
pub mod webdriver;

use std::{
    future::Future,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    str::FromStr,
    sync::{Arc, Mutex},
    time::Duration,
};

use sqlx::{
    mysql::MySqlPoolOptions,
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqlitePoolOptions},
    MySqlPool, PgPool, Row, SqlitePool,
};
use tablemail::{
    commands,
    config::Settings,
    store::{self, Backend, NewMail, Store},
    worker::Worker,
};

/// Logs are silent unless TEST_LOG=1.
pub fn init_logs() {
    if std::env::var("TEST_LOG").as_deref() == Ok("1") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("tablemail=debug")
            .with_test_writer()
            .try_init();
    }
}

fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// An unreachable backend fails the test: a suite that passes without its
/// databases proves nothing. `TABLEMAIL_TEST_SKIP_UNREACHABLE=1` turns that
/// into a skip, said on stderr, for a machine that lacks one on purpose
/// (never under CI=true).
pub fn unreachable(backend: Backend, why: impl std::fmt::Display) -> Option<TestDb> {
    let skip = std::env::var("TABLEMAIL_TEST_SKIP_UNREACHABLE").as_deref() == Ok("1");
    if in_ci() || !skip {
        panic!(
            "{backend} is unreachable: {why} (scripts/test starts the servers; \
             TABLEMAIL_TEST_SKIP_UNREACHABLE=1 skips instead, outside CI)"
        );
    }
    eprintln!("SKIPPED: {backend} unreachable: {why}");
    None
}

pub fn postgres_admin_url() -> String {
    std::env::var("TABLEMAIL_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

pub fn mysql_admin_url() -> String {
    std::env::var("TABLEMAIL_TEST_MYSQL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// The test's own connection to its database, for looking at rows.
pub enum Pool {
    Pg(PgPool),
    Sqlite(SqlitePool),
    My(MySqlPool),
}

/// Runs `$body` with `$p` bound to whichever pool the database has.
macro_rules! on_pool {
    ($db:expr, $p:ident => $body:expr) => {
        match &$db.pool {
            Pool::Pg($p) => $body,
            Pool::Sqlite($p) => $body,
            Pool::My($p) => $body,
        }
    };
}

/// A database of its own for one test, dropped afterwards.
pub struct TestDb {
    pub backend: Backend,
    pub url: String,
    pub store: Arc<dyn Store>,
    pool: Pool,
    name: String,
    _dir: Option<TempDir>,
}

/// One row of `mail_queue` as the tests look at it.
#[derive(Debug, Clone)]
pub struct RowState {
    pub id: i64,
    pub status: String,
    pub attempts: i32,
    pub attempts_remaining: i32,
    pub locked: bool,
    pub message_id: Option<String>,
    pub last_error: Option<String>,
    pub relay_down_count: i32,
    /// `send_at` is in the future (by the database clock).
    pub scheduled: bool,
    pub processed: bool,
}

fn db_name() -> String {
    format!("tm_test_{}", uuid::Uuid::new_v4().simple())
}

fn with_database(admin_url: &str, name: &str) -> String {
    match admin_url.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{name}"),
        None => panic!("{admin_url} names no database"),
    }
}

async fn open_store(url: &str) -> Arc<dyn Store> {
    let store = store::connect(url, 8).await.expect("connect");
    store.migrate().await.expect("migrate");
    store
}

impl TestDb {
    pub async fn postgres() -> Option<TestDb> {
        Self::on_server(Backend::Postgres, &postgres_admin_url()).await
    }

    pub async fn mysql() -> Option<TestDb> {
        Self::on_server(Backend::Mysql, &mysql_admin_url()).await
    }

    /// A new database on the server that `admin_url` reaches.
    async fn on_server(backend: Backend, admin_url: &str) -> Option<TestDb> {
        init_logs();
        let name = db_name();
        if let Err(e) =
            Self::run_admin(backend, admin_url, &format!("CREATE DATABASE {name}")).await
        {
            return unreachable(backend, e);
        }
        let url = with_database(admin_url, &name);
        let store = open_store(&url).await;
        let pool = match backend {
            Backend::Postgres => Pool::Pg(
                PgPoolOptions::new()
                    .max_connections(2)
                    .connect(&url)
                    .await
                    .expect("connect"),
            ),
            Backend::Mysql => Pool::My(
                MySqlPoolOptions::new()
                    .max_connections(2)
                    .connect(&url)
                    .await
                    .expect("connect"),
            ),
            Backend::Sqlite => unreachable!("SQLite needs no server"),
        };
        Some(TestDb {
            backend,
            url,
            store,
            pool,
            name,
            _dir: None,
        })
    }

    /// Runs one statement on the server's administrative database.
    async fn run_admin(backend: Backend, admin_url: &str, sql: &str) -> Result<(), sqlx::Error> {
        let sql = sqlx::AssertSqlSafe(sql.to_string());
        let timeout = Duration::from_secs(5);
        match backend {
            Backend::Postgres => {
                let admin = PgPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(timeout)
                    .connect(admin_url)
                    .await?;
                sqlx::query(sql).execute(&admin).await?;
                admin.close().await;
            }
            Backend::Mysql => {
                let admin = MySqlPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(timeout)
                    .connect(admin_url)
                    .await?;
                sqlx::query(sql).execute(&admin).await?;
                admin.close().await;
            }
            Backend::Sqlite => unreachable!("SQLite needs no server"),
        }
        Ok(())
    }

    pub async fn sqlite() -> Option<TestDb> {
        init_logs();
        let dir = TempDir::new();
        let url = format!("sqlite://{}", dir.path().join("tablemail.db").display());
        let store = open_store(&url).await;
        let options = SqliteConnectOptions::from_str(&url)
            .unwrap()
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await
            .expect("connect");
        Some(TestDb {
            backend: Backend::Sqlite,
            url,
            store,
            pool: Pool::Sqlite(pool),
            name: String::new(),
            _dir: Some(dir),
        })
    }

    /// The pool of a PostgreSQL test database (for PostgreSQL-only tests).
    pub fn pool(&self) -> &PgPool {
        match &self.pool {
            Pool::Pg(p) => p,
            _ => panic!("not a PostgreSQL test database"),
        }
    }

    /// Runs SQL as an application would.
    pub async fn exec(&self, sql: &str) -> u64 {
        let q = sqlx::AssertSqlSafe(sql.to_string());
        on_pool!(self, p => sqlx::query(q).execute(p).await.map(|d| d.rows_affected()))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Runs SQL that may fail (a KILL of a connection that just ended).
    pub async fn try_exec(&self, sql: &str) -> Result<u64, sqlx::Error> {
        let q = sqlx::AssertSqlSafe(sql.to_string());
        on_pool!(self, p => sqlx::query(q).execute(p).await.map(|d| d.rows_affected()))
    }

    /// Runs several statements as one script, as an application's client
    /// would send them (not prepared).
    pub async fn exec_script(&self, sql: &str) {
        let q = sqlx::AssertSqlSafe(sql.to_string());
        on_pool!(self, p => sqlx::raw_sql(q).execute(p).await.map(|_| ()))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    pub async fn scalar_i64(&self, sql: &str) -> i64 {
        let q = sqlx::AssertSqlSafe(sql.to_string());
        on_pool!(self, p => sqlx::query_scalar::<_, i64>(q).fetch_one(p).await)
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    pub async fn strings(&self, sql: &str) -> Vec<String> {
        let q = sqlx::AssertSqlSafe(sql.to_string());
        on_pool!(self, p => sqlx::query_scalar::<_, String>(q).fetch_all(p).await)
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Counts rows of `mail_queue` that match `condition`.
    pub async fn count(&self, condition: &str) -> i64 {
        self.scalar_i64(&format!(
            "SELECT count(*) FROM mail_queue WHERE {condition}"
        ))
        .await
    }

    pub async fn enqueue(&self, mail: NewMail) -> i64 {
        self.store.enqueue(&[mail]).await.expect("enqueue")[0].id
    }

    /// The database clock, as SQL.
    pub fn now(&self) -> &'static str {
        match self.backend {
            Backend::Postgres => "now()",
            Backend::Sqlite => "strftime('%Y-%m-%d %H:%M:%f', 'now')",
            Backend::Mysql => "UTC_TIMESTAMP(6)",
        }
    }

    /// `expr` moved `seconds` into the past, as SQL.
    pub fn minus(&self, expr: &str, seconds: i64) -> String {
        match self.backend {
            Backend::Postgres => format!("({expr} - interval '{seconds} seconds')"),
            Backend::Sqlite => {
                format!("strftime('%Y-%m-%d %H:%M:%f', {expr}, '-{seconds} seconds')")
            }
            Backend::Mysql => format!("({expr} - INTERVAL {seconds} SECOND)"),
        }
    }

    /// A string literal, quoted for this backend.
    pub fn literal(&self, s: &str) -> String {
        let s = s.replace('\'', "''");
        match self.backend {
            Backend::Mysql => format!("'{}'", s.replace('\\', "\\\\")),
            _ => format!("'{s}'"),
        }
    }

    /// A string literal holding `a`, CR, LF, `b`.
    pub fn with_crlf(&self, a: &str, b: &str) -> String {
        let (a, b) = (self.literal(a), self.literal(b));
        match self.backend {
            Backend::Postgres => format!("{a} || E'\\r\\n' || {b}"),
            Backend::Sqlite => format!("{a} || char(13, 10) || {b}"),
            Backend::Mysql => format!("CONCAT({a}, CHAR(13, 10), {b})"),
        }
    }

    /// An INSERT that a taken `dedupe_key` turns into nothing.
    pub fn insert_unless_duplicate(&self, columns: &str, values: &str) -> String {
        match self.backend {
            Backend::Mysql => format!("INSERT IGNORE INTO mail_queue ({columns}) VALUES ({values})"),
            _ => format!(
                "INSERT INTO mail_queue ({columns}) VALUES ({values}) ON CONFLICT (dedupe_key) DO NOTHING"
            ),
        }
    }

    /// `(id, thread_lock)` of every `sending` row.
    pub async fn sending_locks(&self) -> Vec<(i64, String)> {
        let sql = match self.backend {
            Backend::Postgres => {
                "SELECT id, thread_lock::text FROM mail_queue WHERE status = 'sending'"
            }
            _ => "SELECT id, thread_lock FROM mail_queue WHERE status = 'sending'",
        };
        on_pool!(self, p => sqlx::query_as::<_, (i64, String)>(sql).fetch_all(p).await).unwrap()
    }

    pub async fn rows(&self) -> Vec<RowState> {
        let future = match self.backend {
            Backend::Postgres => "send_at > now()",
            Backend::Sqlite => "julianday(send_at) > julianday('now')",
            Backend::Mysql => "send_at > UTC_TIMESTAMP(6)",
        };
        let sql = format!(
            "SELECT id, status, attempts, attempts_remaining, thread_lock IS NOT NULL AS locked, \
             message_id, last_error, relay_down_count, {future} AS scheduled, \
             processed_at IS NOT NULL AS processed \
             FROM mail_queue ORDER BY id"
        );
        let q = sqlx::AssertSqlSafe(sql);
        on_pool!(self, p => {
            let rows = sqlx::query(q).fetch_all(p).await.expect("read rows");
            rows.iter()
                .map(|r| RowState {
                    id: r.get("id"),
                    status: r.get("status"),
                    attempts: r.get("attempts"),
                    attempts_remaining: r.get("attempts_remaining"),
                    locked: r.get("locked"),
                    message_id: r.get("message_id"),
                    last_error: r.get("last_error"),
                    relay_down_count: r.get("relay_down_count"),
                    scheduled: r.get("scheduled"),
                    processed: r.get("processed"),
                })
                .collect()
        })
    }

    pub async fn row(&self, id: i64) -> RowState {
        self.rows()
            .await
            .into_iter()
            .find(|r| r.id == id)
            .unwrap_or_else(|| panic!("no row {id}"))
    }

    /// Makes every queued row due now (instead of waiting out a backoff).
    pub async fn make_due(&self) {
        self.exec(&format!(
            "UPDATE mail_queue SET send_at = {} WHERE status = 'queued'",
            self.now()
        ))
        .await;
    }

    /// The database's name on its server.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Environment for the binary to use this database.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![("TABLEMAIL__DATABASE__URL".into(), self.url.clone())]
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let (backend, name) = (self.backend, self.name.clone());
        let (admin_url, sql) = match backend {
            Backend::Postgres => (
                postgres_admin_url(),
                format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            ),
            Backend::Mysql => (mysql_admin_url(), format!("DROP DATABASE IF EXISTS {name}")),
            Backend::Sqlite => return, // the directory goes with `_dir`
        };
        // Drop runs outside any runtime guarantee: use a thread with its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let _ = rt.block_on(Self::run_admin(backend, &admin_url, &sql));
        })
        .join();
    }
}

/// Instantiates test cases `async fn case(db: TestDb)` once per backend, in
/// modules `postgres`, `sqlite` and `mysql`.
#[macro_export]
macro_rules! for_each_backend {
    ($($case:ident),* $(,)?) => {
        $crate::for_each_backend!(@backend postgres, postgres, $($case),*);
        $crate::for_each_backend!(@backend sqlite, sqlite, $($case),*);
        $crate::for_each_backend!(@backend mysql, mysql, $($case),*);
    };
    (@backend $module:ident, $open:ident, $($case:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    if let Some(db) = $crate::support::TestDb::$open().await {
                        super::$case(db).await;
                    }
                }
            )*
        }
    };
}

/// A mail the SMTP server accepted (or, in `attempts`, saw end of data of).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Received {
    /// When the server had the whole mail (unix time).
    #[serde(default)]
    pub received_at: Option<f64>,
    pub mail_from: String,
    pub rcpt_tos: Vec<String>,
    pub data: String,
}

impl Received {
    /// The unfolded value of the first header `name`.
    pub fn header(&self, name: &str) -> Option<String> {
        let head = self.data.split("\r\n\r\n").next().unwrap_or("");
        let mut found: Option<String> = None;
        for line in head.split("\r\n") {
            let continuation = line.starts_with([' ', '\t']);
            match (&mut found, continuation) {
                (Some(v), true) => {
                    v.push(' ');
                    v.push_str(line.trim());
                }
                (Some(_), false) => break,
                (None, false) => {
                    if let Some((n, v)) = line.split_once(':') {
                        if n.eq_ignore_ascii_case(name) {
                            found = Some(v.trim().to_string());
                        }
                    }
                }
                (None, true) => {}
            }
        }
        found
    }
}

/// The aiosmtpd server of `tests/support/smtp_server.py`.
pub struct SmtpServer {
    pub port: u16,
    child: Child,
    out: PathBuf,
    _dir: TempDir,
}

impl SmtpServer {
    pub fn start(extra: &[&str]) -> SmtpServer {
        let dir = TempDir::new();
        let out = dir.path().join("mails.jsonl");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/smtp_server.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg("--out")
            .arg(&out)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 with aiosmtpd (scripts/test installs it)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("read port");
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("SMTP server did not start: {line:?}"));
        SmtpServer {
            port,
            child,
            out,
            _dir: dir,
        }
    }

    pub fn url(&self) -> String {
        format!("smtp://127.0.0.1:{}", self.port)
    }

    fn read(path: &Path) -> Vec<Received> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_str(l).expect("server record"))
            .collect()
    }

    /// Mails the server accepted.
    pub fn received(&self) -> Vec<Received> {
        Self::read(&self.out)
    }

    /// Every transaction that reached end of data, accepted or not.
    pub fn attempts(&self) -> Vec<Received> {
        Self::read(&self.out.with_extension("jsonl.attempts"))
    }

    /// Every AUTH the server received (with `--auth`).
    pub fn auths(&self) -> Vec<AuthSeen> {
        std::fs::read_to_string(self.out.with_extension("jsonl.auth"))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_str(l).expect("server record"))
            .collect()
    }
}

/// An AUTH command the SMTP server received (never its password).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct AuthSeen {
    pub mechanism: String,
    pub login: Option<String>,
    /// Whether the connection had TLS by then.
    pub tls: bool,
}

impl Drop for SmtpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        let path =
            std::env::temp_dir().join(format!("tablemail-test-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Settings for a test worker: this database, this relay, short timings.
pub fn settings(db: &TestDb, transport_url: &str) -> Settings {
    let mut env = db.env();
    env.push(("TABLEMAIL__TRANSPORT__URL".into(), transport_url.into()));
    env.push((
        "TABLEMAIL__DEFAULTS__FROM_ADDRESS".into(),
        "shop@example.com".into(),
    ));
    env.push(("TABLEMAIL__WORKER__RETRY_BASE".into(), "50ms".into()));
    env.push(("TABLEMAIL__WORKER__RETRY_MAX".into(), "200ms".into()));
    env.push(("TABLEMAIL__TRANSPORT__TIMEOUT".into(), "5s".into()));
    env.push(("TABLEMAIL__TRANSPORT__DATA_TIMEOUT".into(), "5s".into()));
    Settings::load_from(None, env).expect("test settings")
}

/// `settings` whose retries wait a minute: a test that checks a row is
/// scheduled for later reads it long before it is due again, however loaded
/// the machine (it moves the row along with `make_due`).
pub fn long_backoff(mut settings: Settings) -> Settings {
    settings.worker.retry_base = Duration::from_secs(60);
    settings.worker.retry_max = Duration::from_secs(60);
    settings
}

pub fn worker(db: &TestDb, settings: &Settings) -> Arc<Worker> {
    let transport = commands::build_transport(settings).expect("transport");
    Worker::new(
        db.store.clone(),
        Arc::new(transport),
        settings.worker.clone(),
        settings.retention.clone(),
        commands::message_defaults(settings).expect("defaults"),
        "test.example".into(),
    )
}

/// Polls `check` until it returns true, failing the test after `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {limit:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A mail to `to` with a subject, for tests that do not care about the rest.
pub fn mail(to: &str, subject: &str) -> NewMail {
    NewMail {
        to_address: to.into(),
        subject: Some(subject.into()),
        body: Some(format!("Body of {subject}")),
        ..NewMail::default()
    }
}

/// The daemon's stdout, collected line by line in the background.
pub struct Daemon {
    pub child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    /// The thread that reads its stdout into `lines` (none when unread).
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Daemon {
    pub fn start(env: Vec<(String, String)>) -> Daemon {
        Self::start_in(&std::env::temp_dir(), env)
    }

    /// Starts `tablemail run` in `dir` (where relative paths resolve).
    pub fn start_in(dir: &Path, env: Vec<(String, String)>) -> Daemon {
        let (mut daemon, stdout) = Self::spawn(dir, env);
        let sink = daemon.lines.clone();
        daemon.reader = Some(std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        }));
        daemon
    }

    /// Starts `tablemail run` with its stdout a pipe the caller holds and
    /// nobody reads until the caller does.
    pub fn start_unread(env: Vec<(String, String)>) -> (Daemon, std::process::ChildStdout) {
        Self::spawn(&std::env::temp_dir(), env)
    }

    fn spawn(dir: &Path, env: Vec<(String, String)>) -> (Daemon, std::process::ChildStdout) {
        let mut child = tablemail()
            .arg("run")
            .current_dir(dir)
            .envs(env)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        (
            Daemon {
                child,
                lines,
                reader: None,
            },
            stdout,
        )
    }

    /// Everything the daemon printed so far.
    pub fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    pub fn logs(&self) -> Vec<serde_json::Value> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|_| panic!("not JSON: {l}")))
            .collect()
    }

    /// The last `n` log lines as written, oldest first: what a failing test
    /// shows of the daemon.
    pub fn tail(&self, n: usize) -> String {
        let lines = self.lines.lock().unwrap();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The log lines with this message.
    pub fn logged(&self, message: &str) -> Vec<serde_json::Value> {
        self.logs()
            .into_iter()
            .filter(|l| l["message"] == message)
            .collect()
    }

    /// Whether a log line's message starts with `prefix` (messages that
    /// carry a cause after a colon, as `database unavailable: …`).
    pub fn logged_starting(&self, prefix: &str) -> bool {
        self.logs()
            .iter()
            .any(|l| l["message"].as_str().unwrap_or("").starts_with(prefix))
    }

    /// Waits for the first log line with this message, and returns it.
    pub async fn wait_for_log(&self, message: &str, limit: Duration) -> serde_json::Value {
        eventually(&format!("the log line {message:?}"), limit, || async {
            !self.logged(message).is_empty()
        })
        .await;
        self.logged(message).remove(0)
    }

    pub fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    pub async fn wait_exit(&mut self, limit: Duration) -> i32 {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Its last lines may still be in the pipe: read to the end
                // before anyone looks at them.
                while self.reader.as_ref().is_some_and(|r| !r.is_finished())
                    && tokio::time::Instant::now() < deadline
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                return status.code().unwrap_or(-1);
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "daemon did not exit within {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Environment for `tablemail run` on this database and relay, with a sender,
/// a short poll interval and `extra` settings (later ones win).
pub fn daemon_env(
    db: &TestDb,
    transport_url: &str,
    extra: &[(&str, &str)],
) -> Vec<(String, String)> {
    daemon_env_at(&db.url, transport_url, extra)
}

/// `daemon_env` for a database the test reaches by URL (a server of its own).
pub fn daemon_env_at(
    database_url: &str,
    transport_url: &str,
    extra: &[(&str, &str)],
) -> Vec<(String, String)> {
    let mut env = vec![("TABLEMAIL__DATABASE__URL".into(), database_url.into())];
    env.push(("TABLEMAIL__TRANSPORT__URL".into(), transport_url.into()));
    env.push((
        "TABLEMAIL__DEFAULTS__FROM_ADDRESS".into(),
        "shop@example.com".into(),
    ));
    env.push(("TABLEMAIL__WORKER__POLL_INTERVAL".into(), "200ms".into()));
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env
}

/// How often each Message-ID reached the server.
pub fn message_id_counts(mails: &[SinkMail]) -> std::collections::HashMap<String, usize> {
    let mut seen = std::collections::HashMap::new();
    for m in mails {
        *seen
            .entry(m.message_id.clone().expect("a Message-ID"))
            .or_default() += 1;
    }
    seen
}

/// Runs a command to its end: (exit code, stdout, stderr).
pub fn output(cmd: &mut Command) -> (i32, String, String) {
    let out = cmd.output().expect("run tablemail");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The binary under test: this build's, or the one `TABLEMAIL_TEST_BIN`
/// names (a release build, for the figures a test prints).
pub fn tablemail() -> Command {
    let bin = std::env::var_os("TABLEMAIL_TEST_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_tablemail").into());
    let mut cmd = Command::new(bin);
    cmd.env_remove("RUST_LOG");
    for (k, _) in std::env::vars() {
        if k.starts_with("TABLEMAIL__") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// A TCP port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn smtp_sink_path() -> PathBuf {
    ["/usr/sbin/smtp-sink", "/usr/bin/smtp-sink"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("smtp-sink (Debian package postfix; scripts/test installs it)")
}

/// A mail that Postfix's smtp-sink captured.
#[derive(Debug, Clone)]
pub struct SinkMail {
    pub mail_from: String,
    pub rcpt_tos: Vec<String>,
    pub message_id: Option<String>,
    pub subject: Option<String>,
}

/// Postfix's `smtp-sink`, capturing every transaction to one dump file.
/// Its fault flags (`-r -f -q -Q -W …`) are passed through.
pub struct SmtpSink {
    pub port: u16,
    child: Child,
    dump: PathBuf,
    _dir: TempDir,
}

const SINK_MARK: &str = "==tablemail-sink==";

impl SmtpSink {
    pub fn start(flags: &[&str]) -> SmtpSink {
        Self::start_on(free_port(), flags)
    }

    pub fn start_on(port: u16, flags: &[&str]) -> SmtpSink {
        let dir = TempDir::new();
        let dump = dir.path().join("dump");
        let mut cmd = Command::new(smtp_sink_path());
        if running_as_root() {
            // smtp-sink drops privileges; let it write the dump.
            let _ = Command::new("chmod").arg("777").arg(dir.path()).status();
            cmd.args(["-u", "nobody"]);
        }
        let child = cmd
            .arg("-D")
            .arg(&dump)
            .args(["-S", &format!("{SINK_MARK}\\n")])
            .args(flags)
            .arg(format!("127.0.0.1:{port}"))
            .arg("256")
            .stdout(Stdio::null())
            .spawn()
            .expect("start smtp-sink");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "smtp-sink did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        SmtpSink {
            port,
            child,
            dump,
            _dir: dir,
        }
    }

    pub fn url(&self) -> String {
        format!("smtp://127.0.0.1:{}", self.port)
    }

    /// Every transaction captured (smtp-sink writes it as it receives it).
    pub fn mails(&self) -> Vec<SinkMail> {
        self.mails_with_ends().into_iter().map(|(_, m)| m).collect()
    }

    /// Every transaction captured, with where it ends in the capture (compare
    /// with `captured_bytes` sampled over time to tell when it arrived).
    pub fn mails_with_ends(&self) -> Vec<(u64, SinkMail)> {
        let text = std::fs::read_to_string(&self.dump).unwrap_or_default();
        let mut end = 0u64;
        text.split(SINK_MARK)
            .map(|chunk| {
                end += (chunk.len() + SINK_MARK.len()) as u64;
                (end - SINK_MARK.len() as u64, chunk)
            })
            .filter(|(_, chunk)| chunk.contains("X-Mail-Args:"))
            .map(|(end, chunk)| {
                let mut mail = SinkMail {
                    mail_from: String::new(),
                    rcpt_tos: Vec::new(),
                    message_id: None,
                    subject: None,
                };
                for line in chunk.trim_start().lines() {
                    if line.is_empty() {
                        break;
                    }
                    let value = |prefix: &str| {
                        line.strip_prefix(prefix).map(|v| {
                            v.trim()
                                .trim_start_matches('<')
                                .trim_end_matches('>')
                                .to_string()
                        })
                    };
                    if let Some(v) = value("X-Mail-Args:") {
                        mail.mail_from = v
                            .split_whitespace()
                            .next()
                            .unwrap_or("")
                            .trim_end_matches('>')
                            .to_string();
                    } else if let Some(v) = value("X-Rcpt-Args:") {
                        mail.rcpt_tos.push(v);
                    } else if let Some(v) = line.strip_prefix("Message-ID:") {
                        mail.message_id = Some(v.trim().to_string());
                    } else if let Some(v) = line.strip_prefix("Subject:") {
                        mail.subject = Some(v.trim().to_string());
                    }
                }
                (end, mail)
            })
            .collect()
    }

    /// Waits until at least `n` mails have been captured.
    pub async fn wait_for_mails(&self, n: usize, limit: Duration) {
        eventually(&format!("{n} mails at the sink"), limit, || async {
            self.mails().len() >= n
        })
        .await;
    }

    /// Bytes captured so far: grows with every mail, and is cheap to read
    /// while `mails()` parses the whole capture.
    pub fn captured_bytes(&self) -> u64 {
        std::fs::metadata(&self.dump).map(|m| m.len()).unwrap_or(0)
    }

    /// Stops the sink (the port closes).
    pub fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for SmtpSink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A self-signed certificate for `localhost` (cert, key), made with openssl.
pub fn self_signed_cert(dir: &Path) -> (PathBuf, PathBuf) {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let status = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
        ])
        .args([
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl");
    assert!(status.success(), "openssl could not make a certificate");
    (cert, key)
}

/// Runs a command to success and returns its stdout; fails the test with
/// its output otherwise.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} exited with {}: {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The newest PostgreSQL version with clusters under /etc/postgresql
/// (Debian's layout), e.g. "15".
pub fn postgres_version() -> Option<String> {
    std::fs::read_dir("/etc/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|v| v.parse::<u32>().is_ok())
        .max_by_key(|v| v.parse::<u32>().unwrap_or(0))
}

/// The packaging tools: present on the machine, or the test is skipped
/// (a failure under CI=true, where scripts/test installs them).
pub fn tool(name: &str) -> Option<String> {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{name} is missing under CI=true"
        );
        eprintln!("SKIPPED: {name} not installed");
    }
    found
}
