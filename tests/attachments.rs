//! Attachments and inline images end to end, on every backend: inserted with
//! their mail, loaded when it is sent, received by a real SMTP server and
//! read back with a MIME parser; too large is a clear failure before any
//! byte is loaded; `enqueue --attach`, `--inline` and `--jsonl` attachments.

mod support;

use mail_parser::{MessageParser, MimeHeaders};
use support::*;
use tablemail::store::NewAttachment;

for_each_backend!(
    random_binary_parts_arrive_byte_identical,
    a_mail_over_the_limit_by_its_attachments_fails_unread,
);

/// Bytes no text encoding would carry unharmed, from a seed.
fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn part(filename: &str, content_type: &str, content: Vec<u8>, cid: Option<&str>) -> NewAttachment {
    NewAttachment {
        filename: filename.into(),
        content_type: Some(content_type.into()),
        content,
        content_id: cid.map(str::to_string),
    }
}

async fn random_binary_parts_arrive_byte_identical(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let s = settings(&db, &smtp.url());
    let worker = worker(&db, &s);
    let pdf = random_bytes(1, 150_000);
    let png = random_bytes(2, 3_000);
    let empty = Vec::new();
    let mut m = mail("ann@example.org", "Ihre Rechnung");
    m.body = Some("Die Rechnung liegt bei.".into());
    m.body_html = Some(r#"<p>Die Rechnung liegt bei. <img src="cid:logo@shop"></p>"#.into());
    m.attachments = vec![
        part(
            "Rechnung März 2026.pdf",
            "application/pdf",
            pdf.clone(),
            None,
        ),
        part("logo.png", "image/png", png.clone(), Some("logo@shop")),
        part("leer.txt", "text/plain", empty.clone(), None),
    ];
    let id = db.enqueue(m).await;
    worker.process_batch().await.unwrap();
    let row = db.row(id).await;
    assert_eq!(row.status, "sent", "{:?}", row.last_error);
    let received = smtp.received();
    assert_eq!(received.len(), 1);
    let message = MessageParser::default()
        .parse(received[0].data.as_bytes())
        .expect("a MIME message");
    let root = message.part(0).unwrap().content_type().unwrap();
    assert_eq!((root.ctype(), root.subtype()), ("multipart", Some("mixed")));
    let found: Vec<(String, Vec<u8>, Option<String>)> = message
        .attachments()
        .map(|a| {
            (
                a.attachment_name().unwrap_or_default().to_string(),
                a.contents().to_vec(),
                a.content_id().map(str::to_string),
            )
        })
        .collect();
    let by_name = |name: &str| found.iter().find(|(n, _, _)| n == name).unwrap();
    assert_eq!(by_name("Rechnung März 2026.pdf").1, pdf, "the PDF's bytes");
    let logo = by_name("logo.png");
    assert_eq!(logo.1, png, "the image's bytes");
    assert_eq!(logo.2.as_deref(), Some("logo@shop"));
    assert_eq!(by_name("leer.txt").1, empty);
    // The image sits with the HTML that shows it.
    assert!(
        received[0].data.contains("multipart/related"),
        "no multipart/related: {}",
        &received[0].data[..2000.min(received[0].data.len())]
    );
    assert_eq!(
        message
            .body_html(0)
            .as_deref()
            .map(|h| h.contains("cid:logo@shop")),
        Some(true)
    );
}

async fn a_mail_over_the_limit_by_its_attachments_fails_unread(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let mut s = settings(&db, &smtp.url());
    s.transport.max_message_size = tablemail::config::ByteSize(100_000);
    let worker = worker(&db, &s);
    // 90 kB, 120 kB once in base64: over 100 kB.
    let mut big = mail("ann@example.org", "too large");
    big.attachments = vec![part(
        "big.bin",
        "application/octet-stream",
        random_bytes(3, 90_000),
        None,
    )];
    let big = db.enqueue(big).await;
    let fine = db.enqueue(mail("bob@example.org", "fine")).await;
    worker.process_batch().await.unwrap();
    let row = db.row(big).await;
    assert_eq!(row.status, "failed");
    let error = row.last_error.unwrap();
    assert!(error.contains("over transport.max_message_size"), "{error}");
    assert_eq!(db.row(fine).await.status, "sent");
    let received = smtp.received();
    assert_eq!(received.len(), 1, "only the mail within the limit");
    assert_eq!(received[0].rcpt_tos, ["bob@example.org"]);
}

/// An attachment inserted in a later transaction than its mail: what the
/// README says happens (the mail may go without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attachment_inserted_after_its_mail_went_stays_behind() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let s = settings(&db, &smtp.url());
    let worker = worker(&db, &s);
    let id = db
        .enqueue(mail("ann@example.org", "no attachment yet"))
        .await;
    worker.process_batch().await.unwrap();
    assert_eq!(db.row(id).await.status, "sent");
    db.exec(&format!(
        "INSERT INTO mail_attachment (mail_id, filename, content) VALUES ({id}, 'late.pdf', '\\x00')"
    ))
    .await;
    let received = smtp.received();
    assert_eq!(received.len(), 1);
    let message = MessageParser::default()
        .parse(received[0].data.as_bytes())
        .unwrap();
    assert_eq!(message.attachments().count(), 0, "it went without");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_attaches_files_inline_images_and_json_parts() {
    let Some(db) = TestDb::sqlite().await else {
        return;
    };
    let dir = TempDir::new();
    let pdf = dir.path().join("Angebot Müller.pdf");
    std::fs::write(&pdf, b"%PDF-1.4\n").unwrap();
    let logo = dir.path().join("logo.png");
    std::fs::write(&logo, random_bytes(4, 500)).unwrap();
    let data = dir.path().join("export.bin");
    std::fs::write(&data, b"PK\x03\x04").unwrap();
    let (code, out, err) = output(tablemail().envs(db.env()).args([
        "enqueue",
        "--from",
        "shop@example.com",
        "--to",
        "ann@example.org",
        "--subject",
        "files",
        "--body",
        "see attached",
        "--html",
        "<img src=\"cid:logo\">",
        "--attach",
        pdf.to_str().unwrap(),
        "--attach",
        &format!("{};type=application/zip", data.display()),
        "--inline",
        &format!("logo={}", logo.display()),
    ]));
    assert_eq!(code, 0, "{err}");
    let id: i64 = out.trim().parse().unwrap();
    let (code, out, _) =
        output(
            tablemail()
                .envs(db.env())
                .args(["show", &id.to_string(), "--json"]),
        );
    assert_eq!(code, 0);
    let record: serde_json::Value = serde_json::from_str(&out).unwrap();
    let parts: Vec<(String, String, Option<String>)> = record["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["filename"].as_str().unwrap().to_string(),
                a["content_type"].as_str().unwrap().to_string(),
                a["content_id"].as_str().map(str::to_string),
            )
        })
        .collect();
    assert_eq!(
        parts,
        [
            ("Angebot Müller.pdf".into(), "application/pdf".into(), None),
            ("export.bin".into(), "application/zip".into(), None),
            ("logo.png".into(), "image/png".into(), Some("logo".into())),
        ]
    );
    // JSON lines carry them as base64; a bad content type is refused before
    // anything is inserted.
    let line = r#"{"to_address": "bob@example.org", "subject": "json", "attachments": [{"filename": "a.txt", "content_type": "text/plain", "content_base64": "aGVsbG8="}]}"#;
    let run = |input: &str| {
        use std::io::Write;
        let mut child = tablemail()
            .envs(db.env())
            .args(["enqueue", "--jsonl"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let done = run(line);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let json_id: i64 = String::from_utf8_lossy(&done.stdout)
        .trim()
        .parse()
        .unwrap();
    let parts = db.store.load_attachments(json_id).await.unwrap();
    assert_eq!(parts[0].content, b"hello");
    let before = db.count("true").await;
    let bad = run(&line.replace("text/plain", "not a type"));
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("content"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert_eq!(db.count("true").await, before, "nothing inserted");
}
