//! The databases under test: a fresh database of its own per test on
//! PostgreSQL, MariaDB or SQLite (`TestDb`), the rows as tests look at them
//! (`RowState`), the servers' administrative URLs, what an unreachable server
//! does to a test (`unreachable`), `for_each_backend!` and
//! `postgres_version`.

use std::{str::FromStr, sync::Arc, time::Duration};

use sqlx::{
    mysql::MySqlPoolOptions,
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqlitePoolOptions},
    MySqlPool, PgPool, Row, SqlitePool,
};
use tablemail::store::{self, Backend, NewMail, Store};

use super::{in_ci, init_logs, TempDir};

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

    /// Counts rows of `table` that match `condition`.
    pub async fn count_in(&self, table: &str, condition: &str) -> i64 {
        self.scalar_i64(&format!("SELECT count(*) FROM {table} WHERE {condition}"))
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
/// modules `postgres`, `sqlite` and `mysql`:
///
/// - `for_each_backend!(case_a, case_b)`: on every backend;
/// - `for_each_backend!(postgres, mysql; case_a, case_b)`: on the backends
///   named (each the name of a `TestDb` constructor), in that order.
///
/// Each invocation writes those modules, so a second one in the same module
/// goes into a module of its own (`mod servers { use super::*; … }`).
#[macro_export]
macro_rules! for_each_backend {
    (@backend $backend:ident; $($case:ident),*) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    if let Some(db) = $crate::support::TestDb::$backend().await {
                        super::$case(db).await;
                    }
                }
            )*
        }
    };
    (; $($case:ident),* $(,)?) => {};
    ($backend:ident $(, $rest:ident)*; $($case:ident),* $(,)?) => {
        $crate::for_each_backend!(@backend $backend; $($case),*);
        $crate::for_each_backend!($($rest),*; $($case),*);
    };
    ($($case:ident),* $(,)?) => {
        $crate::for_each_backend!(postgres, sqlite, mysql; $($case),*);
    };
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
