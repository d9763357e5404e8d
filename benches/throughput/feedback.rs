//! The delivery loop's costs (DESIGN §12).
//!
//! `--suppressed N`: the real-mix drain (a burst, statistics not taken) with
//! an empty suppression list against the same drain with `N` addresses on
//! it (none of them a recipient: the lookup finds nothing, as for nearly
//! every mail in practice), in pairs, the order alternating from run to
//! run: what the per-claim lookup costs.
//!
//! `--reports N`: how fast reports are recorded, on `N` sent mails: the
//! daemon's inbound listener fed by 8 SMTP connections at once, each sending
//! its reports one after another in one session as a mail server does;
//! then `tablemail ingest`, one process per report as a Postfix `pipe`
//! transport runs it, 8 at a time. Every report is a genuine hard bounce
//! (its VERP tag verifies, its recipient is the mail's), so each one writes
//! its whole path: the report, the history row, the suppression entry, the
//! mail's `bounced` status.

use std::{
    io::Write as _,
    process::{Command, Stdio},
    sync::Arc,
    time::Instant,
};

use tablemail::feedback::verp::Verp;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::{line, paired, paired_report, Backend, BenchDb, Daemon, Drain, Setup, Shape, Side};

const BOUNCE_DOMAIN: &str = "bounce.bench";
const SECRET: &str = "the benchmark's bounce secret, long enough";

/// (without, with) suppressed addresses, one pair per run.
pub(super) async fn suppression_cost(
    setup: &Setup<'_>,
    mails: usize,
    runs: usize,
    suppressed: usize,
) -> Vec<(Drain, Drain)> {
    let with = Setup {
        suppressed,
        ..*setup
    };
    let without = Setup {
        suppressed: 0,
        ..*setup
    };
    let with_name = format!("with {suppressed} suppressed");
    paired(
        Side {
            name: "without",
            setup: &without,
            shape: Shape::Real,
        },
        Side {
            name: &with_name,
            setup: &with,
            shape: Shape::Real,
        },
        mails,
        runs,
    )
    .await
}

pub(super) fn suppression_report(suppressed: usize, pairs: &[(Drain, Drain)]) {
    paired_report(
        &format!(
            "the suppression lookup: real-mix drains, {suppressed} addresses suppressed against none"
        ),
        "with / without",
        pairs,
    );
}

/// A hard bounce of mail `id` to `user{id}@example.com`, as Postfix writes
/// one.
fn report(id: i64, to: &str) -> Vec<u8> {
    format!(
        "From: Mail Delivery System <MAILER-DAEMON@relay.bench>\r\n\
         To: {to}\r\n\
         Subject: Undelivered Mail Returned to Sender\r\n\
         Auto-Submitted: auto-replied\r\n\
         MIME-Version: 1.0\r\n\
         Content-Type: multipart/report; report-type=delivery-status; boundary=\"b{id}\"\r\n\
         \r\n\
         --b{id}\r\n\
         Content-Type: text/plain; charset=us-ascii\r\n\
         \r\n\
         <user{id}@example.com>: host mx.example.com said: 550 5.1.1 no such user\r\n\
         \r\n\
         --b{id}\r\n\
         Content-Type: message/delivery-status\r\n\
         \r\n\
         Reporting-MTA: dns; relay.bench\r\n\
         X-Postfix-Queue-ID: Q{id}\r\n\
         \r\n\
         Final-Recipient: rfc822; user{id}@example.com\r\n\
         Original-Recipient: rfc822;user{id}@example.com\r\n\
         Action: failed\r\n\
         Status: 5.1.1\r\n\
         Diagnostic-Code: smtp; 550 5.1.1 <user{id}@example.com>: no such user\r\n\
         \r\n\
         --b{id}\r\n\
         Content-Type: text/rfc822-headers\r\n\
         \r\n\
         From: bench@example.com\r\n\
         To: user{id}@example.com\r\n\
         Subject: Bench mail {id}\r\n\
         \r\n\
         --b{id}--\r\n"
    )
    .into_bytes()
}

/// Reports recorded per second: (listener, ingest).
pub(super) async fn report_rates(setup: &Setup<'_>, reports: usize) -> (f64, f64) {
    let verp = Verp::new(BOUNCE_DOMAIN, SECRET.as_bytes());
    let secret = setup.dir.join("bounce-secret");
    std::fs::write(&secret, SECRET).unwrap();
    let listener_rate = listener_rate(setup, &verp, &secret, reports).await;
    // Processes are dearer: fewer of them.
    let ingest_rate = ingest_rate(setup, &verp, &secret, (reports / 5).max(100)).await;
    (listener_rate, ingest_rate)
}

async fn sent_mails(setup: &Setup<'_>, n: usize) -> BenchDb {
    let db = BenchDb::create(setup.target, setup.tablemail, setup.dir).await;
    db.load(n, Shape::Small, "sent").await;
    db
}

async fn listener_rate(
    setup: &Setup<'_>,
    verp: &Verp,
    secret: &std::path::Path,
    reports: usize,
) -> f64 {
    const CONNECTIONS: usize = 8;
    let db = sent_mails(setup, reports).await;
    let port = super::free_port();
    let env = [
        ("TABLEMAIL__DATABASE__URL", db.url.clone()),
        (
            "TABLEMAIL__TRANSPORT__URL",
            format!("file://{}", setup.dir.join("outbox").display()),
        ),
        ("TABLEMAIL__BOUNCE__DOMAIN", BOUNCE_DOMAIN.into()),
        (
            "TABLEMAIL__BOUNCE__SECRET_FILE",
            secret.display().to_string(),
        ),
        ("TABLEMAIL__INBOUND__LISTEN", format!("127.0.0.1:{port}")),
    ];
    let daemon = Daemon::start(setup.tablemail, setup.dir, "listener", &env);
    super::wait_listening(port);
    let ids: Vec<i64> = (1..=reports as i64).collect();
    let verp = Arc::new(verp.clone());
    let started = Instant::now();
    let mut sessions = tokio::task::JoinSet::new();
    for chunk in ids.chunks(reports.div_ceil(CONNECTIONS)) {
        let (chunk, verp) = (chunk.to_vec(), verp.clone());
        sessions.spawn(async move { send_reports(port, &verp, &chunk).await });
    }
    while let Some(done) = sessions.join_next().await {
        done.expect("a session").expect("reports accepted");
    }
    let seconds = started.elapsed().as_secs_f64();
    let recorded = db
        .i64("SELECT count(*) FROM mail_feedback WHERE matched")
        .await;
    assert_eq!(recorded, reports as i64, "every report recorded, matched");
    let bounced = db
        .i64("SELECT count(*) FROM mail_queue WHERE status = 'bounced'")
        .await;
    assert_eq!(bounced, reports as i64, "every mail bounced");
    daemon.stop();
    db.drop_db().await;
    reports as f64 / seconds
}

/// One SMTP session delivering a report for each of `ids`, each answered
/// 250 only once it is committed.
async fn send_reports(port: u16, verp: &Verp, ids: &[i64]) -> std::io::Result<()> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let (read, mut write) = stream.into_split();
    let mut replies = Replies(BufReader::new(read), String::new());
    replies.expect("220").await?;
    write.write_all(b"EHLO relay.bench\r\n").await?;
    replies.expect("250").await?;
    for &id in ids {
        let to = verp.address(id);
        write
            .write_all(format!("MAIL FROM:<>\r\nRCPT TO:<{to}>\r\nDATA\r\n").as_bytes())
            .await?;
        replies.expect("250").await?;
        replies.expect("250").await?;
        replies.expect("354").await?;
        let mut data = report(id, &to);
        data.extend_from_slice(b".\r\n");
        write.write_all(&data).await?;
        replies.expect("250").await?;
    }
    write.write_all(b"QUIT\r\n").await?;
    Ok(())
}

/// The server's replies, read one (multi-line) reply at a time.
struct Replies(BufReader<tokio::net::tcp::OwnedReadHalf>, String);

impl Replies {
    async fn expect(&mut self, code: &str) -> std::io::Result<()> {
        loop {
            self.1.clear();
            self.0.read_line(&mut self.1).await?;
            let reply = &self.1;
            if reply.len() < 4 || !reply.starts_with(code) {
                return Err(std::io::Error::other(format!("expected {code}: {reply}")));
            }
            if reply.as_bytes()[3] == b' ' {
                return Ok(());
            }
        }
    }
}

async fn ingest_rate(
    setup: &Setup<'_>,
    verp: &Verp,
    secret: &std::path::Path,
    reports: usize,
) -> f64 {
    const PARALLEL: usize = 8;
    let db = sent_mails(setup, reports).await;
    let started = Instant::now();
    let mut next = 1i64;
    let mut running: Vec<std::process::Child> = Vec::new();
    while next <= reports as i64 || !running.is_empty() {
        while running.len() < PARALLEL && next <= reports as i64 {
            let to = verp.address(next);
            let mut child = Command::new(setup.tablemail)
                .args(["ingest", "--rcpt", &to])
                .env("TABLEMAIL__DATABASE__URL", &db.url)
                .env("TABLEMAIL__BOUNCE__DOMAIN", BOUNCE_DOMAIN)
                .env("TABLEMAIL__BOUNCE__SECRET_FILE", secret)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .expect("tablemail ingest");
            child
                .stdin
                .take()
                .unwrap()
                .write_all(&report(next, &to))
                .unwrap();
            running.push(child);
            next += 1;
        }
        let child = running.remove(0);
        let status = child.wait_with_output().unwrap().status;
        assert!(status.success(), "tablemail ingest: {status}");
    }
    let seconds = started.elapsed().as_secs_f64();
    let recorded = db
        .i64("SELECT count(*) FROM mail_feedback WHERE matched")
        .await;
    assert_eq!(recorded, reports as i64, "every report recorded, matched");
    db.drop_db().await;
    reports as f64 / seconds
}

pub(super) fn rates_report(backend: Backend, reports: usize, rates: (f64, f64)) {
    println!(
        "reports recorded ({}), each a matched hard bounce",
        backend.name()
    );
    line(
        format!("  inbound listener, 8 SMTP sessions, {reports} reports"),
        format!("{:.0}/s", rates.0),
    );
    line(
        "  tablemail ingest, a process per report, 8 at a time",
        format!("{:.0}/s", rates.1),
    );
}
