//! A private Postfix instance for one test: its own configuration and queue
//! directory, started with `postfix -c DIR start` and stopped on drop. It
//! accepts mail on a port of its own, delivers `deadend.test` locally to
//! users that do not exist (so it accepts a mail, then bounces it with a real
//! delivery status notification), and routes other domains by
//! `transport_maps`. Starting Postfix needs root: without it the test is
//! skipped, saying so, and fails under `CI=true`.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use super::{free_port, running_as_root, tool, TempDir};

/// A domain whose users do not exist: mail to it is accepted, then bounced.
pub const DEADEND: &str = "deadend.test";

pub struct Postfix {
    dir: TempDir,
    /// Where it accepts mail (smtpd), on 127.0.0.1.
    pub port: u16,
}

impl Postfix {
    /// Starts an instance routing each `(domain, transport)` of `routes`
    /// (e.g. `("bounce.test", "smtp:[127.0.0.1]:2525")`), with `master`
    /// appended to its master.cf (services such as a pipe transport).
    pub fn start(routes: &[(&str, String)], master: &str) -> Option<Postfix> {
        tool("postfix")?;
        if !running_as_root() {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "starting Postfix needs root, under CI=true"
            );
            eprintln!("SKIPPED: starting Postfix needs root");
            return None;
        }
        let dir = TempDir::new();
        let root = dir.path();
        // Its daemons run as the postfix user: they must reach the queue.
        chmod(root, 0o755);
        let conf = root.join("conf");
        let data = root.join("data");
        for d in [&conf, &data, &root.join("queue")] {
            std::fs::create_dir_all(d).unwrap();
        }
        let status = Command::new("chown")
            .args(["postfix"])
            .arg(&data)
            .status()
            .unwrap();
        assert!(status.success(), "chown postfix {}", data.display());
        let port = free_port();
        let mut master_cf = std::fs::read_to_string("/etc/postfix/master.cf")
            .expect("Debian's /etc/postfix/master.cf");
        master_cf = master_cf.replacen("smtp      inet", &format!("127.0.0.1:{port} inet"), 1);
        master_cf.push_str(master);
        std::fs::write(conf.join("master.cf"), master_cf).unwrap();
        let transports: Vec<String> = routes
            .iter()
            .map(|(domain, transport)| format!("{domain}={transport}"))
            .collect();
        let main_cf = format!(
            "compatibility_level = 3.6\n\
             queue_directory = {queue}\n\
             data_directory = {data}\n\
             mail_owner = postfix\n\
             setgid_group = postdrop\n\
             myhostname = relay.test\n\
             mydomain = relay.test\n\
             myorigin = relay.test\n\
             mydestination = {DEADEND}\n\
             inet_interfaces = 127.0.0.1\n\
             inet_protocols = ipv4\n\
             mynetworks = 127.0.0.0/8\n\
             local_recipient_maps =\n\
             alias_maps =\n\
             alias_database =\n\
             transport_maps = inline:{{ {transports} }}\n\
             smtp_dns_support_level = disabled\n\
             maillog_file_prefixes = {root}\n\
             maillog_file = {root}/maillog\n\
             biff = no\n\
             smtputf8_enable = no\n",
            queue = root.join("queue").display(),
            data = data.display(),
            transports = transports.join(", "),
            root = root.display(),
        );
        std::fs::write(conf.join("main.cf"), main_cf).unwrap();
        let started = Command::new("postfix")
            .arg("-c")
            .arg(&conf)
            .arg("start")
            .output()
            .unwrap();
        let postfix = Postfix { dir, port };
        assert!(
            started.status.success(),
            "postfix start: {}{}\n{}",
            String::from_utf8_lossy(&started.stdout),
            String::from_utf8_lossy(&started.stderr),
            postfix.log()
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "Postfix did not listen on {port}: {}",
                postfix.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(postfix)
    }

    /// `smtp://127.0.0.1:PORT`: plain, as for a relay on loopback.
    pub fn url(&self) -> String {
        format!("smtp://127.0.0.1:{}", self.port)
    }

    pub fn conf(&self) -> PathBuf {
        self.dir.path().join("conf")
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("maillog")).unwrap_or_default()
    }

    /// The log lines of deliveries to `address` (`to=<address>`).
    pub fn deliveries_to(&self, address: &str) -> Vec<String> {
        let needle = format!("to=<{address}>");
        self.log()
            .lines()
            .filter(|l| l.contains(&needle))
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Postfix {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(self.dir.path().join("queue/pid/master.pid"))
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok());
        let _ = Command::new("postfix")
            .arg("-c")
            .arg(self.conf())
            .arg("stop")
            .output();
        // Its daemons leave before the directory goes.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while let Some(pid) = pid {
            if !Path::new(&format!("/proc/{pid}")).exists() || std::time::Instant::now() > deadline
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}
