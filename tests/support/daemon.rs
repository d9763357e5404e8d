//! The daemon under test: the `tablemail` binary (`tablemail()`), `tablemail
//! run` as a process whose log lines the test reads (`Daemon`), the
//! environment it runs with (`daemon_env`, `daemon_env_at`), one-shot
//! commands run to their end (`output`, `run_ok`), and the same worker in
//! process (`settings`, `long_backoff`, `worker`).

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use tablemail::{commands, config::Settings, worker::Worker};

use super::{eventually, TestDb};

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
        Self::start_with(dir, &[], env)
    }

    /// Starts `tablemail --config FILE run`: what a configuration file says
    /// more simply than variables (`[[routes]]`, `transport.oauth2`), the
    /// environment still winning.
    pub fn start_config(config: &Path, env: Vec<(String, String)>) -> Daemon {
        let config = config.to_str().expect("a UTF-8 path");
        Self::start_with(&std::env::temp_dir(), &["--config", config], env)
    }

    fn start_with(dir: &Path, args: &[&str], env: Vec<(String, String)>) -> Daemon {
        let (mut daemon, stdout) = Self::spawn(dir, args, env);
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
        Self::spawn(&std::env::temp_dir(), &[], env)
    }

    fn spawn(
        dir: &Path,
        args: &[&str],
        env: Vec<(String, String)>,
    ) -> (Daemon, std::process::ChildStdout) {
        let mut child = tablemail()
            .args(args)
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
