//! The Debian package, as an operator installs it and as systemd runs it: built
//! with cargo-deb from the test build, unpacked with `dpkg-deb`, checked with
//! lintian, and its unit's `ExecStart` run the way systemd would — as an
//! unprivileged user with no supplementary groups, the credentials in
//! `$CREDENTIALS_DIRECTORY`, the state directory as working directory, the
//! unit's environment and nothing else — against a fresh MariaDB database
//! it must migrate itself, as a database user whose password it has only from
//! its credential, and an SMTP relay that demands STARTTLS and AUTH. No
//! systemd as PID 1 is needed.

mod support;

use std::{
    io::{BufRead, BufReader},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use sqlx::{mysql::MySqlPoolOptions, MySqlPool};
use support::*;
use tablemail::store::Backend;

/// The uid and gid the service runs as (a DynamicUser is some such number).
const SERVICE_ID: u32 = 61_234;

/// A MariaDB database, empty (not migrated), and a user of its own with a
/// password made up for this run; both dropped afterwards.
struct MariaDb {
    admin: MySqlPool,
    name: String,
    user: String,
    password: String,
    /// `host:port` of the server.
    server: String,
}

impl MariaDb {
    async fn create() -> Option<MariaDb> {
        let admin_url = mysql_admin_url();
        let admin = match MySqlPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&admin_url)
            .await
        {
            Ok(pool) => pool,
            Err(e) => {
                unreachable(Backend::Mysql, e);
                return None;
            }
        };
        let id = uuid::Uuid::new_v4().simple().to_string();
        let db = MariaDb {
            admin,
            name: format!("tm_pkg_{id}"),
            user: format!("tm{}", &id[..16]),
            password: uuid::Uuid::new_v4().simple().to_string(),
            server: admin_url
                .rsplit_once('@')
                .and_then(|(_, rest)| rest.split('/').next())
                .expect("host:port in the MySQL admin URL")
                .to_string(),
        };
        for sql in [
            format!("CREATE DATABASE {}", db.name),
            format!(
                "CREATE USER '{}'@'%' IDENTIFIED BY '{}'",
                db.user, db.password
            ),
            format!("GRANT ALL PRIVILEGES ON {}.* TO '{}'@'%'", db.name, db.user),
        ] {
            db.exec(&sql).await;
        }
        Some(db)
    }

    async fn exec(&self, sql: &str) {
        sqlx::query(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&self.admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// The daemon's URL: its user, no password.
    fn url(&self) -> String {
        format!("mysql://{}@{}/{}", self.user, self.server, self.name)
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.replace("{db}", &self.name)))
            .fetch_one(&self.admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    async fn tables(&self) -> i64 {
        self.scalar(
            "SELECT count(*) FROM information_schema.tables \
             WHERE table_schema = '{db}' AND table_name = 'mail_queue'",
        )
        .await
    }
}

impl Drop for MariaDb {
    fn drop(&mut self) {
        let (url, name, user) = (mysql_admin_url(), self.name.clone(), self.user.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(admin) = MySqlPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                {
                    for sql in [
                        format!("DROP DATABASE IF EXISTS {name}"),
                        format!("DROP USER IF EXISTS '{user}'@'%'"),
                    ] {
                        let _ = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&admin).await;
                    }
                }
            });
        })
        .join();
    }
}

/// Builds the package from the test build's binary into `out`.
fn build_deb(cargo_deb: &str, out: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let built = Command::new(cargo_deb)
        .args(["--no-build", "--profile", "dev", "--fast", "--output"])
        .arg(out)
        .current_dir(root)
        .output()
        .expect("cargo-deb");
    assert!(
        built.status.success(),
        "cargo deb failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .expect("a .deb")
}

/// The values of `key=` lines in the unit's text.
fn unit_values(unit: &str, key: &str) -> Vec<String> {
    unit.lines()
        .filter_map(|l| l.strip_prefix(&format!("{key}=")))
        .map(str::to_string)
        .collect()
}

/// Gives `path` (and what it holds) to the service's user.
fn chown_to_service(path: &Path) {
    run_ok(
        Command::new("chown")
            .arg("-R")
            .arg(format!("{SERVICE_ID}:{SERVICE_ID}"))
            .arg(path),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_package_installs_and_its_unit_runs_the_daemon() {
    let (Some(cargo_deb), Some(lintian)) = (tool("cargo-deb"), tool("lintian")) else {
        return;
    };
    if !running_as_root() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the package test runs the service as another user: it needs root"
        );
        eprintln!("SKIPPED: not root");
        return;
    }
    let Some(db) = MariaDb::create().await else {
        return;
    };
    // The password is needed: the URL alone is refused.
    let without = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&db.url())
        .await;
    assert!(
        without.is_err(),
        "MariaDB let the user in without a password"
    );
    assert_eq!(db.tables().await, 0, "the database starts empty");
    let work = TempDir::new();
    let deb = build_deb(&cargo_deb, &work.path().join("out"));

    // What dpkg installs: the files, their modes, the conffile, the scripts.
    let root = work.path().join("root");
    let control = work.path().join("control");
    run_ok(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root));
    run_ok(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&control));
    let conffiles = std::fs::read_to_string(control.join("conffiles")).unwrap();
    assert!(
        conffiles
            .lines()
            .any(|l| l == "/etc/tablemail/tablemail.toml"),
        "{conffiles}"
    );
    let config = root.join("etc/tablemail/tablemail.toml");
    let mode = std::fs::metadata(&config).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode, 0o644,
        "the service's user must read its configuration"
    );
    assert!(root.join("usr/bin/tablemail").exists());
    assert!(root.join("usr/share/man/man1").read_dir().unwrap().count() > 0);
    assert!(root
        .join("usr/share/doc/tablemail/examples/production.toml")
        .exists());
    let postinst = std::fs::read_to_string(control.join("postinst")).unwrap();
    let prerm = std::fs::read_to_string(control.join("prerm")).unwrap();
    let postrm = std::fs::read_to_string(control.join("postrm")).unwrap();
    // Enabled on install but not started (the configuration needs editing
    // first); restarted on upgrade if it runs; stopped on removal.
    assert!(postinst.contains("deb-systemd-helper enable"), "{postinst}");
    assert!(!postinst.contains("invoke start"), "{postinst}");
    assert!(
        postinst.contains("try-restart tablemail.service"),
        "{postinst}"
    );
    assert!(
        postinst.contains("for credential in smtp-password database-password"),
        "postinst creates the credential files: {postinst}"
    );
    assert!(prerm.contains("deb-systemd-invoke stop"), "{prerm}");
    assert!(postrm.contains("daemon-reload"), "{postrm}");
    for script in ["postinst", "prerm", "postrm"] {
        run_ok(Command::new("sh").arg("-n").arg(control.join(script)));
    }
    run_ok(
        Command::new(&lintian)
            .args(["--fail-on", "error"])
            .arg(&deb),
    );

    // The unit as installed, read as systemd reads it.
    let unit_path = ["lib/systemd/system", "usr/lib/systemd/system"]
        .iter()
        .map(|d| root.join(d).join("tablemail.service"))
        .find(|p| p.exists())
        .expect("the unit in the package");
    let unit = std::fs::read_to_string(unit_path).unwrap();
    let exec = unit_values(&unit, "ExecStart").pop().expect("ExecStart");
    let in_root = |p: &str| match p.strip_prefix('/') {
        Some(rest) => root.join(rest).display().to_string(),
        None => p.to_string(),
    };
    let argv: Vec<String> = exec.split_whitespace().map(in_root).collect();
    assert_eq!(unit_values(&unit, "StateDirectory"), ["tablemail"]);
    assert_eq!(unit_values(&unit, "WorkingDirectory"), ["%S/tablemail"]);

    // The operator's part: one file edited (the database, the relay, the
    // commented password_file line taken in as written), the passwords in
    // one file each. The relay requires STARTTLS, then AUTH.
    let certs = TempDir::new();
    let (cert, key) = self_signed_cert(certs.path());
    let smtp = SmtpServer::start(&[
        "--auth",
        "tablemail:s3cret 00042",
        "--tls",
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
    ]);
    let metrics_port = free_port();
    let text = std::fs::read_to_string(&config).unwrap();
    let edits = [
        (
            "url = \"postgres://tablemail@db.internal:5432/app\"".to_string(),
            format!("url = \"{}\"", db.url()),
        ),
        (
            "# password_file = \"database-password\"".into(),
            "password_file = \"database-password\"".into(),
        ),
        (
            "url = \"smtp://relay.internal:587?tls=required\"".into(),
            format!(
                "url = \"smtp://localhost:{}?tls=required\"\naccept_invalid_certs = true",
                smtp.port
            ),
        ),
        (
            "listen = \"127.0.0.1:9898\"".into(),
            format!("listen = \"127.0.0.1:{metrics_port}\""),
        ),
    ];
    let mut edited = text.clone();
    for (from, to) in &edits {
        assert!(
            edited.contains(from.as_str()),
            "no `{from}` in the conffile"
        );
        edited = edited.replacen(from.as_str(), to, 1);
    }
    std::fs::write(&config, edited).unwrap();
    let credentials = work.path().join("credentials");
    std::fs::create_dir(&credentials).unwrap();
    for credential in unit_values(&unit, "LoadCredential") {
        let (id, source) = credential.split_once(':').unwrap();
        assert!(source.starts_with("/etc/tablemail/"), "{source}");
        let secret = match id {
            "smtp-password" => "s3cret 00042\n".to_string(),
            "database-password" => format!("{}\n", db.password),
            other => panic!("a credential the test does not know: {other}"),
        };
        let file = credentials.join(id);
        std::fs::write(&file, secret).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o400)).unwrap();
    }
    chown_to_service(&credentials);
    std::fs::set_permissions(&credentials, std::fs::Permissions::from_mode(0o500)).unwrap();
    let state = work.path().join("state");
    std::fs::create_dir(&state).unwrap();
    chown_to_service(&state);
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();

    let service = |argv: &[String], log: &Path| {
        let mut cmd = Command::new("setpriv");
        cmd.arg(format!("--reuid={SERVICE_ID}"))
            .arg(format!("--regid={SERVICE_ID}"))
            .args(["--clear-groups", "--no-new-privs", "--"])
            .args(argv)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("CREDENTIALS_DIRECTORY", &credentials)
            .env("STATE_DIRECTORY", &state)
            .current_dir(&state)
            .stdout(std::fs::File::create(log).unwrap())
            .stderr(Stdio::piped());
        for assignment in unit_values(&unit, "Environment") {
            let (k, v) = assignment.split_once('=').unwrap();
            cmd.env(k, v);
        }
        cmd
    };
    let log = work.path().join("service.log");
    let mut child = service(&argv, &log).spawn().unwrap();
    let logged = |message: &str| {
        std::fs::File::open(&log)
            .map(|f| {
                BufReader::new(f)
                    .lines()
                    .map_while(Result::ok)
                    .any(|l| l.contains(&format!("\"message\":\"{message}\"")))
            })
            .unwrap_or(false)
    };
    eventually("the service started", Duration::from_secs(30), || async {
        logged("worker started")
    })
    .await;
    // It migrated the database itself, as its own user.
    assert_eq!(db.tables().await, 1, "the daemon did not migrate");
    // The README's smallest insert, the sender from the conffile.
    db.exec(&format!(
        "INSERT INTO {}.mail_queue (to_address, subject, body) \
         VALUES ('customer@example.org', 'packaged', 'Hello')",
        db.name
    ))
    .await;
    eventually(
        "the relay has the mail",
        Duration::from_secs(30),
        || async { smtp.received().len() == 1 },
    )
    .await;
    let got = &smtp.received()[0];
    assert_eq!(got.rcpt_tos, ["customer@example.org"]);
    assert_eq!(got.mail_from, "noreply@example.com");
    eventually("the row is sent", Duration::from_secs(10), || async {
        db.scalar("SELECT count(*) FROM {db}.mail_queue WHERE status = 'sent'")
            .await
            == 1
    })
    .await;
    // Its threads stay well inside the unit's TasksMax=.
    let tasks_max: usize = unit_values(&unit, "TasksMax")[0].parse().unwrap();
    let proc_status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let threads: usize = proc_status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("Threads: in /proc/PID/status");
    assert!(
        threads < tasks_max / 2,
        "{threads} threads, TasksMax={tasks_max}"
    );
    run_ok(Command::new("kill").args(["-TERM", &child.id().to_string()]));
    let status = child.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    assert!(logged("worker stopped"));

    // The path the unit's old comment described: the configuration 0640 and
    // root's. The service's user cannot read it: exit 2, saying why.
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o640)).unwrap();
    let out = service(&argv, &work.path().join("refused.log"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let said = format!(
        "cannot read {} (mode 0640, owner root:root; tablemail runs as uid {SERVICE_ID} gid {SERVICE_ID}): Permission denied",
        config.display()
    );
    assert!(err.contains(&said), "{err}");
}
