//! The Debian package, as an operator installs it and as systemd runs it: built
//! with cargo-deb from the test build, unpacked with `dpkg-deb`, checked with
//! lintian, and its unit's `ExecStart` run the way systemd would — as an
//! unprivileged user with no supplementary groups, the credentials in
//! `$CREDENTIALS_DIRECTORY`, the state directory as working directory, the
//! unit's environment and nothing else — against PostgreSQL and an SMTP relay
//! that demands AUTH. No systemd as PID 1 is needed.

mod support;

use std::{
    io::{BufRead, BufReader},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use support::*;

/// The uid and gid the service runs as (a DynamicUser is some such number).
const SERVICE_ID: u32 = 61_234;

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

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
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

fn as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_package_installs_and_its_unit_runs_the_daemon() {
    let (Some(cargo_deb), Some(lintian)) = (tool("cargo-deb"), tool("lintian")) else {
        return;
    };
    if !as_root() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the package test runs the service as another user: it needs root"
        );
        eprintln!("SKIPPED: not root");
        return;
    }
    let Some(db) = TestDb::postgres().await else {
        return;
    };
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

    // The operator's part: one file edited, the password in one file.
    let smtp = SmtpServer::start(&["--auth", "tablemail:s3cret 00042"]);
    let metrics_port = free_port();
    let text = std::fs::read_to_string(&config).unwrap();
    let edited = text
        .replace(
            "url = \"postgres://tablemail@db.internal:5432/app\"",
            &format!(
                "url = \"{}\"\npassword_file = \"database-password\"",
                db.url
            ),
        )
        .replace(
            "url = \"smtp://relay.internal:587?tls=required\"",
            &format!("url = \"{}\"", smtp.url()),
        )
        .replace(
            "listen = \"127.0.0.1:9898\"",
            &format!("listen = \"127.0.0.1:{metrics_port}\""),
        );
    assert_ne!(edited, text);
    std::fs::write(&config, edited).unwrap();
    let credentials = work.path().join("credentials");
    std::fs::create_dir(&credentials).unwrap();
    for credential in unit_values(&unit, "LoadCredential") {
        let (id, source) = credential.split_once(':').unwrap();
        assert!(source.starts_with("/etc/tablemail/"), "{source}");
        let secret = match id {
            "smtp-password" => "s3cret 00042\n",
            _ => "only-read-with-trust-auth\n",
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
    db.enqueue(mail("customer@example.org", "packaged")).await;
    eventually(
        "the relay has the mail",
        Duration::from_secs(30),
        || async { smtp.received().len() == 1 },
    )
    .await;
    assert_eq!(smtp.received()[0].rcpt_tos, ["customer@example.org"]);
    assert_eq!(db.rows().await[0].status, "sent");
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
    assert!(err.contains("ermission denied"), "{err}");
}
