//! Rows with attacker-influenced text (DESIGN §11), against the real daemon
//! and a real relay: none may change the envelope, inject a header or an
//! SMTP command, or cost more than linear time and memory; each gets a clear
//! error and the other mails go on.

mod support;

use std::time::{Duration, Instant};

use support::*;
use tablemail::store::NewMail;

/// The daemon's peak resident memory, in MiB.
fn peak_rss_mib(daemon: &Daemon) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.child.id())).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kib / 1024.0
}

/// A bare CR or LF: one that is not part of a CRLF.
fn has_bare_line_break(data: &str) -> bool {
    let bytes = data.as_bytes();
    bytes.iter().enumerate().any(|(i, &b)| match b {
        b'\r' => bytes.get(i + 1) != Some(&b'\n'),
        b'\n' => i == 0 || bytes[i - 1] != b'\r',
        _ => false,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_of_line_breaks_costs_linear_time_and_holds_nobody_up() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    // The body that took 9.5 s of CPU through a quadratic line-ending pass.
    let hostile = db.enqueue(mail("victim@example.org", "lines")).await;
    db.exec(&format!(
        "UPDATE mail_queue SET body = repeat('x', 80) || repeat(E'\\n', 800000), priority = 5 \
         WHERE id = {hostile}"
    ))
    .await;
    let ordinary = db.enqueue(mail("ann@example.org", "ordinary")).await;
    let started = Instant::now();
    let mut daemon = Daemon::start(daemon_env(&db, &smtp.url(), &[]));
    eventually("both final", Duration::from_secs(30), || async {
        db.count("status = 'sent'").await == 2
    })
    .await;
    eprintln!(
        "800,000 line breaks: both sent {:.2}s after the start",
        started.elapsed().as_secs_f64()
    );
    let received = smtp.received();
    assert_eq!(received.len(), 2);
    let big = received
        .iter()
        .find(|m| m.header("Subject").as_deref() == Some("lines"))
        .unwrap();
    assert!(
        !has_bare_line_break(&big.data),
        "a bare CR or LF reached the relay"
    );
    assert!(big.data.len() > 800_000, "the body arrived whole");
    let _ = (hostile, ordinary);
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_row_fails_unread_beside_twenty_ordinary_ones() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let huge = db.enqueue(mail("victim@example.org", "huge")).await;
    db.exec(&format!(
        "UPDATE mail_queue SET body = repeat('x', 100000000), priority = 5 WHERE id = {huge}"
    ))
    .await;
    let mails: Vec<NewMail> = (0..20)
        .map(|i| mail(&format!("u{i}@example.org"), "ordinary"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    let mut daemon = Daemon::start(daemon_env(&db, &smtp.url(), &[]));
    eventually("all 21 final", Duration::from_secs(30), || async {
        db.count("status IN ('sent', 'failed')").await == 21
    })
    .await;
    let rss = peak_rss_mib(&daemon);
    eprintln!("a 100 MB row beside 20: daemon peak RSS {rss:.1} MiB");
    assert!(rss < 100.0, "peak RSS {rss:.1} MiB: the body was loaded");
    let row = db.row(huge).await;
    assert_eq!(row.status, "failed");
    let error = row.last_error.unwrap();
    assert!(error.contains("over transport.max_message_size"), "{error}");
    assert_eq!(row.attempts, 1, "no SMTP attempt beyond the claim's");
    assert_eq!(db.count("status = 'sent'").await, 20);
    assert_eq!(smtp.received().len(), 20);
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

/// SQLite keeps the octets it is given in a text column, UTF-8 or not. Such
/// a row used to fail the decoding of its whole claim, and each claim
/// after it: no mail of the queue went out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_that_is_not_utf8_fails_its_own_row_only() {
    let Some(db) = TestDb::sqlite().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let mails: Vec<NewMail> = (0..10)
        .map(|i| mail(&format!("u{i}@example.org"), "ordinary"))
        .collect();
    db.store.enqueue(&mails).await.unwrap();
    // One brought by the claim itself, one too large for that (its text
    // read when it is sent), both ahead of the others.
    let subject = db.enqueue(mail("a@example.org", "x")).await;
    let body = db.enqueue(mail("b@example.org", "x")).await;
    db.exec(&format!(
        "UPDATE mail_queue SET subject = CAST(x'4fc3' AS TEXT), priority = 5 WHERE id = {subject}"
    ))
    .await;
    db.exec(&format!(
        "UPDATE mail_queue SET body = CAST(printf('%.*c', 40000, 'x') || x'ff' AS TEXT), \
         priority = 5 WHERE id = {body}"
    ))
    .await;
    let mut daemon = Daemon::start(daemon_env(&db, &smtp.url(), &[]));
    eventually("all 12 final", Duration::from_secs(30), || async {
        db.count("status IN ('sent', 'failed')").await == 12
    })
    .await;
    for (id, column, at) in [(subject, "subject", 1), (body, "body", 40000)] {
        let row = db.row(id).await;
        assert_eq!(row.status, "failed", "{column}");
        assert_eq!(
            row.last_error.as_deref(),
            Some(format!("{column} is not UTF-8 text (a bad octet at offset {at})").as_str())
        );
    }
    assert_eq!(db.count("status = 'sent'").await, 10);
    let received = smtp.received();
    assert_eq!(received.len(), 10);
    assert!(received
        .iter()
        .all(|m| m.header("Subject").as_deref() == Some("ordinary")));
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_cannot_change_the_envelope_or_the_trace() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let s = settings(&db, &smtp.url());
    let worker = worker(&db, &s);
    let mut ids = Vec::new();
    for name in [
        "Sender",
        "Return-Path",
        "Resent-From",
        "resent-to",
        "Received",
        "DKIM-Signature",
    ] {
        let mut m = mail("victim@example.org", name);
        m.headers = Some(
            serde_json::json!({ name: "bounce@attacker.example" })
                .as_object()
                .unwrap()
                .clone(),
        );
        ids.push(db.enqueue(m).await);
    }
    let fine = db.enqueue(mail("ann@example.org", "fine")).await;
    worker.process_batch().await.unwrap();
    for id in ids {
        let row = db.row(id).await;
        assert_eq!(row.status, "failed", "{:?}", row.last_error);
        assert!(
            row.last_error.as_deref().unwrap().contains("reserved"),
            "{:?}",
            row.last_error
        );
    }
    assert_eq!(db.row(fine).await.status, "sent");
    let received = smtp.received();
    assert_eq!(
        received.len(),
        1,
        "only the ordinary mail reached the relay"
    );
    assert_eq!(received[0].mail_from, "shop@example.com");
    assert!(!received[0].data.contains("attacker.example"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_carriage_return_never_reaches_the_relay() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let s = settings(&db, &smtp.url());
    let worker = worker(&db, &s);
    let mut m = mail("ann@example.org", "smuggle");
    m.body = Some("a\r.\rMAIL FROM:<x@attacker.example>\r\nb".into());
    m.body_html = Some("<p>a\r.\r</p>\r.\r\n<p>b</p>".into());
    let id = db.enqueue(m).await;
    worker.process_batch().await.unwrap();
    assert_eq!(db.row(id).await.status, "sent");
    let received = smtp.received();
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].rcpt_tos, ["ann@example.org"]);
    assert!(
        !has_bare_line_break(&received[0].data),
        "a bare CR reached the relay: {:?}",
        received[0].data
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_recipients_and_a_hundred_thousand_headers_fail_clearly() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let s = settings(&db, &smtp.url());
    let worker = worker(&db, &s);
    let recipients = db.enqueue(mail("a@example.org", "many recipients")).await;
    db.exec(&format!(
        "UPDATE mail_queue SET to_address = (SELECT string_agg('u' || i || '@example.org', ', ') \
         FROM generate_series(1, 10000) AS i) WHERE id = {recipients}"
    ))
    .await;
    let headers = db.enqueue(mail("b@example.org", "many headers")).await;
    db.exec(&format!(
        "UPDATE mail_queue SET headers = (SELECT jsonb_object_agg('X-H' || i, 'v') \
         FROM generate_series(1, 100000) AS i) WHERE id = {headers}"
    ))
    .await;
    let fine = db.enqueue(mail("c@example.org", "fine")).await;
    let started = Instant::now();
    worker.process_batch().await.unwrap();
    eprintln!(
        "10,000 recipients and 100,000 headers: the batch took {:.2}s",
        started.elapsed().as_secs_f64()
    );
    let row = db.row(recipients).await;
    assert_eq!(row.status, "failed");
    let error = row.last_error.unwrap();
    assert!(error.contains("transport.max_recipients"), "{error}");
    let row = db.row(headers).await;
    assert_eq!(row.status, "failed");
    assert!(row.last_error.unwrap().contains("header"));
    assert_eq!(db.row(fine).await.status, "sent");
    assert_eq!(smtp.received().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_subjects_and_header_values_reach_the_relay_within_998_octets() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let s = settings(&db, &smtp.url());
    let worker = worker(&db, &s);
    // 1,500 characters each: words with non-ASCII, plain words, and one word
    // as long as the whole value (it can only be encoded, not folded).
    let subject = "Ihre Bestellbestätigung ".repeat(63);
    let subject = subject.trim_end();
    let note = "word ".repeat(300);
    let note = note.trim_end();
    let token = "x".repeat(1500);
    let mut m = mail("ann@example.org", subject);
    m.headers = Some(
        serde_json::json!({ "X-Note": note, "X-Campaign": token })
            .as_object()
            .unwrap()
            .clone(),
    );
    let id = db.enqueue(m).await;
    worker.process_batch().await.unwrap();
    assert_eq!(db.row(id).await.status, "sent");
    let received = smtp.received();
    assert_eq!(received.len(), 1);
    let data = &received[0].data;
    let longest = data.split("\r\n").map(str::len).max().unwrap();
    assert!(
        longest <= 998,
        "a line of {longest} octets reached the relay"
    );
    assert!(!has_bare_line_break(data));
    // A mail reader gets the values back as they were written.
    let parsed = mail_parser::MessageParser::default()
        .parse(data.as_bytes())
        .expect("a message");
    assert_eq!(parsed.subject(), Some(subject));
    for (name, value) in [("X-Note", note), ("X-Campaign", token.as_str())] {
        // The parser leaves unknown fields raw: read the value as a reader
        // reads unstructured text (unfolded, RFC 2047 words decoded).
        let raw = parsed.header_raw(name).expect(name);
        let field = format!("Subject:{raw}\r\n\r\n");
        let again = mail_parser::MessageParser::default()
            .parse(field.as_bytes())
            .expect("a field");
        assert_eq!(again.subject(), Some(value), "{name}");
    }
}
