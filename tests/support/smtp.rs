//! The SMTP servers the daemon sends to: the aiosmtpd server of
//! `smtp_server.py` (`SmtpServer`, with what it `Received` and the AUTH it
//! saw), Postfix's `smtp-sink` for volume and faults (`SmtpSink`,
//! `SinkMail`), `message_id_counts` over what a sink captured, and a
//! self-signed certificate for TLS.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use super::{eventually, free_port, running_as_root, TempDir};

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
    /// With `--xoauth2`: its token endpoint.
    pub token_url: Option<String>,
    child: Child,
    out: PathBuf,
    _dir: TempDir,
}

impl SmtpServer {
    pub fn start(extra: &[&str]) -> SmtpServer {
        Self::start_under(&[], extra)
    }

    /// Starts the server under `prefix` (`ip netns exec NS`: in a network
    /// namespace), with `extra` options.
    pub fn start_under(prefix: &[&str], extra: &[&str]) -> SmtpServer {
        let dir = TempDir::new();
        let out = dir.path().join("mails.jsonl");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/smtp_server.py");
        let mut cmd = match prefix.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg("python3");
                cmd
            }
            None => Command::new("python3"),
        };
        let mut child = cmd
            .arg(script)
            .arg("--out")
            .arg(&out)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 with aiosmtpd (scripts/test installs it)");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut token_url = None;
        let port = loop {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("read port");
            if let Some(url) = line.trim().strip_prefix("TOKEN_URL ") {
                token_url = Some(url.to_string());
                continue;
            }
            break line
                .trim()
                .strip_prefix("PORT ")
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("SMTP server did not start: {line:?}"));
        };
        SmtpServer {
            port,
            token_url,
            child,
            out,
            _dir: dir,
        }
    }

    pub fn url(&self) -> String {
        format!("smtp://127.0.0.1:{}", self.port)
    }

    /// The tokens its endpoint issued (with `--xoauth2`), oldest first.
    pub fn tokens_issued(&self) -> Vec<TokenIssued> {
        records(&self.out.with_extension("jsonl.tokens"))
    }

    fn read(path: &Path) -> Vec<Received> {
        records(path)
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
        records(&self.out.with_extension("jsonl.auth"))
    }
}

/// The complete records of a JSON-lines file the server appends to. A test
/// polls while the server writes, so a last line without its newline is a
/// record still being written: it is left for the next read.
fn records<T: serde::de::DeserializeOwned>(path: &Path) -> Vec<T> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("server record {l:?}: {e}")))
        .collect()
}

/// An AUTH command the SMTP server received (never its password).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct AuthSeen {
    pub mechanism: String,
    pub login: Option<String>,
    /// Whether the connection had TLS by then.
    pub tls: bool,
    /// XOAUTH2: the digest of the token (never the token).
    #[serde(default)]
    pub token: Option<String>,
    /// XOAUTH2: whether the server accepted it.
    #[serde(default)]
    pub ok: Option<bool>,
}

/// A token the `--xoauth2` server's endpoint issued.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct TokenIssued {
    /// Unix time.
    pub issued_at: f64,
    /// Its digest, as `AuthSeen::token` names it.
    pub token: String,
    /// The token itself: for looking for it where it must never be.
    pub value: String,
}

impl Drop for SmtpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

/// A certificate authority of the test's own (openssl), issuing server
/// certificates; a client trusts it through `SSL_CERT_FILE=<cert>` (read by
/// rustls-native-certs).
pub struct TestCa {
    pub cert: PathBuf,
    key: PathBuf,
    dir: PathBuf,
}

impl TestCa {
    /// A new CA named `name`, its files in `dir`.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        let (cert, key) = (
            dir.join(format!("{name}-ca.pem")),
            dir.join(format!("{name}-ca.key")),
        );
        openssl(
            Command::new("openssl")
                .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
                .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"])
                .args(["-subj", &format!("/CN=tablemail test CA {name}")])
                .args(["-addext", "basicConstraints=critical,CA:TRUE"])
                .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"])
                .arg("-keyout")
                .arg(&key)
                .arg("-out")
                .arg(&cert),
        );
        TestCa {
            cert,
            key,
            dir: dir.to_path_buf(),
        }
    }

    /// A server certificate (cert, key) for `san` (as openssl writes a
    /// subjectAltName: `IP:10.0.0.2`, `DNS:localhost`), issued by this CA.
    pub fn issue(&self, name: &str, san: &str) -> (PathBuf, PathBuf) {
        let (cert, key, csr) = (
            self.dir.join(format!("{name}.pem")),
            self.dir.join(format!("{name}.key")),
            self.dir.join(format!("{name}.csr")),
        );
        openssl(
            Command::new("openssl")
                .args(["req", "-new", "-newkey", "ec", "-pkeyopt"])
                .args(["ec_paramgen_curve:prime256v1", "-nodes"])
                .args(["-subj", &format!("/CN={name}")])
                .arg("-keyout")
                .arg(&key)
                .arg("-out")
                .arg(&csr),
        );
        let ext = self.dir.join(format!("{name}.ext"));
        std::fs::write(
            &ext,
            format!(
                "subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n\
                 keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
            ),
        )
        .unwrap();
        openssl(
            Command::new("openssl")
                .args(["x509", "-req", "-days", "2", "-in"])
                .arg(&csr)
                .arg("-CA")
                .arg(&self.cert)
                .arg("-CAkey")
                .arg(&self.key)
                .arg("-CAcreateserial")
                .arg("-extfile")
                .arg(&ext)
                .arg("-out")
                .arg(&cert),
        );
        (cert, key)
    }
}

fn openssl(cmd: &mut Command) {
    let out = cmd.output().expect("openssl");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
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
