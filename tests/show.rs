//! `tablemail show`: what happened to one mail, as an operator asks it —
//! its attempts and the relay's answers, the reply that took it, its
//! attachments; no body and no full address unless `--body`.

mod support;

use support::*;
use tablemail::store::NewAttachment;

fn show(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    output(tablemail().envs(db.env()).arg("show").args(args))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_greylistings_then_a_send_are_the_mails_history() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let s = settings(&db, &smtp.url());
    let worker = worker(&db, &s);
    let mut m = mail("twice451-ann@example.org", "Your order 42");
    m.body = Some("Secret body text".into());
    m.dedupe_key = Some("order-42".into());
    m.attachments = vec![NewAttachment {
        filename: "invoice.pdf".into(),
        content_type: Some("application/pdf".into()),
        content: b"%PDF-1.4 not really".to_vec(),
        content_id: None,
    }];
    let id = db.enqueue(m).await;
    for _ in 0..3 {
        db.make_due().await;
        worker.process_batch().await.unwrap();
    }
    assert_eq!(db.row(id).await.status, "sent");

    let (code, out, err) = show(&db, &[&id.to_string(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let record: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(record["status"], "sent");
    assert_eq!(record["attempts"], 3);
    assert!(
        record["relay_reply"].as_str().unwrap().starts_with("250"),
        "{record}"
    );
    let events = record["events"].as_array().unwrap();
    assert_eq!(events.len(), 2, "{record}");
    for (n, e) in events.iter().enumerate() {
        assert_eq!(e["outcome"], "retry");
        assert_eq!(e["attempt"], n + 1);
        assert_eq!(e["smtp_code"], 451);
        assert_eq!(e["stage"], "dot");
        assert!(e["detail"].as_str().unwrap().contains("Greylisted"), "{e}");
        assert!(e["at"].is_string());
    }
    assert_eq!(record["attachments"][0]["filename"], "invoice.pdf");
    assert_eq!(record["attachments"][0]["size"], 19);
    // The keys of DESIGN §8, and no content.
    for key in [
        "status",
        "attempts",
        "attempts_remaining",
        "priority",
        "created_at",
        "send_at",
        "processed_at",
        "message_id",
        "dedupe_key",
        "last_error",
        "relay_reply",
        "attachments",
        "events",
    ] {
        assert!(record.get(key).is_some(), "{key} missing: {record}");
    }
    assert!(!out.contains("Secret body text"), "{out}");
    assert!(!out.contains("twice451-ann@"), "{out}");

    // The same mail by its Message-ID and by its dedupe key, as text.
    let message_id = record["message_id"].as_str().unwrap();
    for args in [
        vec!["--message-id", message_id],
        vec!["--dedupe-key", "order-42"],
    ] {
        let (code, out, err) = show(&db, &args);
        assert_eq!(code, 0, "{err}");
        assert!(out.starts_with(&format!("mail {id}: sent")), "{out}");
        assert!(out.contains("retry"), "{out}");
        assert!(!out.contains("Secret body text"), "{out}");
    }
    // --body shows the content.
    let (code, out, _) = show(&db, &[&id.to_string(), "--body"]);
    assert_eq!(code, 0);
    assert!(out.contains("Secret body text"), "{out}");
    assert!(out.contains("twice451-ann@example.org"), "{out}");

    // An unknown mail is an error that says so.
    let (code, _, err) = show(&db, &[&(id + 1000).to_string()]);
    assert_eq!(code, 1);
    assert!(err.contains(&format!("no mail {}", id + 1000)), "{err}");
    let (code, _, _) = show(&db, &[]);
    assert_eq!(code, 2, "show needs a mail");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_mail_keeps_its_created_at_and_expires_from_the_retry() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let s = settings(&db, &smtp.url());
    let worker = worker(&db, &s);
    let id = db.enqueue(mail("rcpt550-gone@example.com", "bounce")).await;
    worker.process_batch().await.unwrap();
    assert_eq!(db.row(id).await.status, "failed");
    // Written by the application six days ago: past worker.max_age (5d).
    db.exec(&format!(
        "UPDATE mail_queue SET created_at = {} WHERE id = {id}",
        db.minus(db.now(), 6 * 86400)
    ))
    .await;
    let (code, _, err) =
        output(
            tablemail()
                .envs(db.env())
                .args(["retry", "--id", &id.to_string()]),
        );
    assert_eq!(code, 0, "{err}");
    let (_, out, _) = show(&db, &[&id.to_string(), "--json"]);
    let record: serde_json::Value = serde_json::from_str(&out).unwrap();
    let created = record["created_at"].as_str().unwrap();
    assert!(record["retried_at"].is_string(), "{record}");
    let outcomes: Vec<&str> = record["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["failed", "retried"]);
    // Not expired: expiry counts from the retry. The relay still refuses
    // the address, so the attempt fails on its own reply, not as "expired".
    worker.process_batch().await.unwrap();
    let row = db.row(id).await;
    assert_eq!(row.status, "failed");
    assert!(
        row.last_error.as_deref().unwrap().contains("550"),
        "{:?}",
        row.last_error
    );
    let (_, out, _) = show(&db, &[&id.to_string(), "--json"]);
    let after: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        after["created_at"].as_str().unwrap(),
        created,
        "retry kept created_at"
    );
    // Without the retry, the same row would have expired: put it back six
    // days, retry time and all, and it fails as expired without a session.
    db.exec(&format!(
        "UPDATE mail_queue SET status = 'queued', attempts_remaining = 1, retried_at = {} WHERE id = {id}",
        db.minus(db.now(), 6 * 86400)
    ))
    .await;
    worker.process_batch().await.unwrap();
    let row = db.row(id).await;
    assert_eq!(
        (row.status.as_str(), row.last_error.as_deref()),
        ("failed", Some("expired"))
    );
}
