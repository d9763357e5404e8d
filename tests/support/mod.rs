//! Test support: a fresh database per test, real SMTP servers, the daemon as
//! a process or its worker in process, an HTTP client, and polling with a
//! deadline. Each concern has its module (below); their items are
//! re-exported here, so a test says `use support::*`. What stays here is
//! generic: logs, polling, a temporary directory, a free port, the tools on
//! the machine, a mail for tests that do not care about its content.
#![allow(dead_code)]

pub mod daemon;
pub mod db;
pub mod dkim;
pub mod http;
pub mod netns;
pub mod postfix;
pub mod proxy;
pub mod smtp;
pub mod webdriver;

// Each test file uses some of these only.
#[allow(unused_imports)]
pub use daemon::*;
#[allow(unused_imports)]
pub use db::*;
#[allow(unused_imports)]
pub use smtp::*;

use std::{
    future::Future,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use tablemail::store::NewMail;

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
