//! The client packages of DESIGN §17, each tested by its own ecosystem's
//! runner against the daemon built here: `clients/python` (Django's email
//! backend) with pytest, `clients/node` (the Nodemailer transport) with
//! `node --test`. Both compare what the framework's own SMTP backend sends
//! with what arrives through a row and the daemon, on real databases.
//!
//! A missing runner or package fails under CI=true (scripts/test installs
//! them) and is skipped, saying so, elsewhere; the runners' own tests fail
//! on an unreachable database just as the Rust tests do.

mod support;

use std::{path::Path, process::Command};

use support::tool;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `found`, and when not, a skip outside CI and a test failure under
/// CI=true.
fn present(what: &str, found: bool) -> bool {
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{what} is missing under CI=true (scripts/test installs it)"
        );
        eprintln!("SKIPPED: {what} not installed (scripts/test installs it)");
    }
    found
}

/// Runs a test runner to its end with the daemon built here (or the one
/// `TABLEMAIL_TEST_BIN` names), failing the test with the runner's output
/// when it fails. The daemons it starts get no configuration from this
/// environment, as in `support::tablemail`.
fn run(mut command: Command) {
    command.current_dir(repo()).env_remove("RUST_LOG");
    if std::env::var_os("TABLEMAIL_TEST_BIN").is_none() {
        command.env("TABLEMAIL_TEST_BIN", env!("CARGO_BIN_EXE_tablemail"));
    }
    for (k, _) in std::env::vars() {
        if k.starts_with("TABLEMAIL__") {
            command.env_remove(k);
        }
    }
    let output = command.output().expect("start the test runner");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}\n{stderr}");
    assert!(
        output.status.success(),
        "{command:?} failed with {}:\n{stdout}\n{stderr}",
        output.status
    );
}

#[test]
fn django_email_backend() {
    let Some(python) = tool("python3") else {
        return;
    };
    let imports = Command::new(&python)
        .args(["-c", "import django, pytest, psycopg, MySQLdb, aiosmtpd"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !present(
        "Django, pytest, psycopg, mysqlclient or aiosmtpd for python3",
        imports,
    ) {
        return;
    }
    let mut pytest = Command::new(python);
    pytest.args([
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "clients/python/tests",
    ]);
    run(pytest);
}

#[test]
fn nodemailer_transport() {
    let (Some(node), Some(_)) = (tool("node"), tool("npm")) else {
        return;
    };
    let modules = repo().join("clients/node/node_modules");
    if !present(
        "clients/node's packages (npm ci in clients/node)",
        modules.join("nodemailer").is_dir() && modules.join("pg").is_dir(),
    ) {
        return;
    }
    let mut node_test = Command::new(node);
    node_test.args(["--test", "clients/node/test/transport.test.js"]);
    run(node_test);
}
