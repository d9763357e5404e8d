//! Relay operations: the relay probed before a mail finds it down, a fallback
//! relay, the staging redirect, a missing sender that never burns mail, and a
//! mail that needs SMTPUTF8 on a relay that does not offer it.
//! Each test runs the daemon binary against real SMTP servers (aiosmtpd,
//! smtp-sink) and PostgreSQL, and checks the rows and what the relays received.

mod support;

use std::{io::Write, time::Duration};

use support::*;
use tablemail::store::NewMail;

fn sender(mut m: NewMail) -> NewMail {
    m.from_address = Some("shop@example.com".into());
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_down_at_start_is_known_before_any_mail() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let relay_port = free_port();
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{metrics_port}");
    let daemon = Daemon::start(daemon_env(
        &db,
        &format!("smtp://127.0.0.1:{relay_port}"),
        &[
            ("TABLEMAIL__METRICS__LISTEN", &listen),
            ("TABLEMAIL__TRANSPORT__PROBE_INTERVAL", "1s"),
            ("TABLEMAIL__TRANSPORT__TIMEOUT", "2s"),
        ],
    ));
    let said = daemon
        .wait_for_log("relay unreachable at start", Duration::from_secs(20))
        .await;
    assert_eq!(said["level"], "ERROR");
    eventually("/healthz says 503", Duration::from_secs(5), || async {
        http::try_get(metrics_port, "/healthz", None).is_ok_and(|r| r.status == 503)
    })
    .await;
    // The relay comes up: the next probe finds it, with no mail sent.
    let sink = SmtpSink::start_on(relay_port, &[]);
    eventually("/healthz says 200", Duration::from_secs(30), || async {
        http::try_get(metrics_port, "/healthz", None).is_ok_and(|r| r.status == 200)
    })
    .await;
    assert!(sink.mails().is_empty());
    assert_eq!(db.count("true").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fallback_takes_the_mail_while_the_primary_is_down() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let primary_port = free_port();
    // The fallback is another provider: its own login, from its own
    // credential file (on a trusted network here: no TLS).
    let fallback = SmtpServer::start(&["--auth", "backup-user:backup pw 7"]);
    let secrets = TempDir::new();
    let password_file = secrets.path().join("smtp-fallback-password");
    std::fs::write(&password_file, "backup pw 7\n").unwrap();
    let mails: Vec<NewMail> = (0..20)
        .map(|i| mail(&format!("u{i}@example.com"), &format!("m{i}")))
        .collect();
    let first = db.store.enqueue(&mails).await.unwrap();
    let env = daemon_env(
        &db,
        &format!("smtp://127.0.0.1:{primary_port}"),
        &[
            ("TABLEMAIL__TRANSPORT__FALLBACK_URL", &fallback.url()),
            ("TABLEMAIL__TRANSPORT__FALLBACK_USERNAME", "backup-user"),
            (
                "TABLEMAIL__TRANSPORT__FALLBACK_PASSWORD_FILE",
                password_file.to_str().unwrap(),
            ),
            ("TABLEMAIL__TRANSPORT__PROBE_INTERVAL", "1s"),
            ("TABLEMAIL__TRANSPORT__TIMEOUT", "2s"),
        ],
    );
    // Without allow_plaintext_auth the fallback's password would go in
    // clear: check refuses the configuration, naming the key and the relay.
    let (code, out, err) = output(tablemail().envs(env.clone()).arg("check"));
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("transport.allow_plaintext_auth: false, and transport.fallback_url"),
        "{out}"
    );
    assert!(fallback.auths().is_empty(), "a password went out in clear");
    let mut env = env;
    env.push((
        "TABLEMAIL__TRANSPORT__ALLOW_PLAINTEXT_AUTH".into(),
        "true".into(),
    ));
    let mut daemon = Daemon::start(env);
    eventually("20 mails sent", Duration::from_secs(30), || async {
        db.count("status = 'sent'").await == 20
    })
    .await;
    assert_eq!(fallback.received().len(), 20);
    let auths = fallback.auths();
    assert!(!auths.is_empty());
    assert!(
        auths
            .iter()
            .all(|a| a.login.as_deref() == Some("backup-user")),
        "{auths:?}"
    );
    assert!(!daemon.output().contains("backup pw 7"), "password logged");
    for e in &first {
        let row = db.row(e.id).await;
        assert_eq!(
            (row.attempts, row.attempts_remaining),
            (1, 4),
            "one try spent, the primary's refusal refunded: {row:?}"
        );
    }
    let sent = daemon.logged("mail sent");
    assert!(sent.iter().all(|l| l["relay"] == "fallback"), "{sent:?}");

    // The primary opens: the next probe takes it back.
    let primary = SmtpSink::start_on(primary_port, &[]);
    daemon
        .wait_for_log(
            "primary relay available again: leaving the fallback",
            Duration::from_secs(30),
        )
        .await;
    let more: Vec<NewMail> = (0..5)
        .map(|i| mail(&format!("v{i}@example.com"), &format!("n{i}")))
        .collect();
    db.store.enqueue(&more).await.unwrap();
    eventually(
        "5 more through the primary",
        Duration::from_secs(30),
        || async { primary.mails().len() == 5 },
    )
    .await;
    assert_eq!(
        fallback.received().len(),
        20,
        "none more through the fallback"
    );
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_staging_redirect_changes_the_envelope_only() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let mut m = mail("customer@example.com", "your order");
    m.cc = Some("partner@example.org".into());
    m.bcc = Some("audit@example.net".into());
    db.enqueue(m).await;
    let mut daemon = Daemon::start(daemon_env(
        &db,
        &smtp.url(),
        &[("TABLEMAIL__TRANSPORT__REDIRECT_TO", "qa@staging.example")],
    ));
    let said = daemon
        .wait_for_log(
            "staging redirect: every mail goes to transport.redirect_to",
            Duration::from_secs(20),
        )
        .await;
    assert_eq!(said["redirect_to"], "***@staging.example");
    eventually("the mail sent", Duration::from_secs(20), || async {
        smtp.received().len() == 1
    })
    .await;
    let got = &smtp.received()[0];
    assert_eq!(got.rcpt_tos, ["qa@staging.example"]);
    assert_eq!(got.mail_from, "shop@example.com");
    assert_eq!(got.header("To").as_deref(), Some("customer@example.com"));
    assert_eq!(got.header("Cc").as_deref(), Some("partner@example.org"));
    let (code, out, _) = output(
        tablemail()
            .envs(daemon_env(
                &db,
                &smtp.url(),
                &[("TABLEMAIL__TRANSPORT__REDIRECT_TO", "qa@staging.example")],
            ))
            .arg("check"),
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("transport.redirect_to: every mail goes to ***@staging.example (staging)"),
        "{out}"
    );
    // `status`, for people and for scripts, says so too.
    let redirected = daemon_env(
        &db,
        &smtp.url(),
        &[("TABLEMAIL__TRANSPORT__REDIRECT_TO", "qa@staging.example")],
    );
    let (code, out, err) = output(tablemail().envs(redirected.clone()).arg("status"));
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("staging redirect: every mail goes to ***@staging.example"),
        "{out}"
    );
    let (code, out, err) = output(tablemail().envs(redirected).args(["status", "--json"]));
    assert_eq!(code, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["redirect_to"], "***@staging.example", "{out}");
    // Without the redirect, neither says anything of it.
    let (_, out, _) = output(
        tablemail()
            .envs(daemon_env(&db, &smtp.url(), &[]))
            .arg("status"),
    );
    assert!(!out.contains("staging redirect"), "{out}");
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_sender_waits_for_the_operator_and_burns_nothing() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let smtp = SmtpServer::start(&[]);
    let orphan = db.enqueue(mail("a@example.com", "no sender")).await;
    let fine = db
        .enqueue(sender(mail("b@example.com", "has a sender")))
        .await;
    let metrics_port = free_port();
    let mut env = db.env();
    env.push(("TABLEMAIL__TRANSPORT__URL".into(), smtp.url()));
    env.push(("TABLEMAIL__WORKER__POLL_INTERVAL".into(), "200ms".into()));
    env.push(("TABLEMAIL__WORKER__RETRY_BASE".into(), "1s".into()));
    env.push((
        "TABLEMAIL__METRICS__LISTEN".into(),
        format!("127.0.0.1:{metrics_port}"),
    ));
    let mut daemon = Daemon::start(env.clone());
    let said = daemon
        .wait_for_log(
            "configuration fault: defaults.from_address is not set: rows without a sender wait until it is",
            Duration::from_secs(20),
        )
        .await;
    assert_eq!(said["level"], "ERROR");
    eventually(
        "the mail with a sender sent",
        Duration::from_secs(20),
        || async { db.row(fine).await.status == "sent" },
    )
    .await;
    // Tried and deferred again and again: never spent, never failed.
    daemon
        .wait_for_log(
            "configuration fault: mail waits until defaults.from_address is set",
            Duration::from_secs(20),
        )
        .await;
    let row = db.row(orphan).await;
    assert_eq!(row.status, "queued", "{row:?}");
    assert_eq!((row.attempts, row.attempts_remaining), (0, 5), "{row:?}");
    assert_eq!(smtp.received().len(), 1);
    // The relay and the database are fine, yet mail waits: /healthz says
    // 503 and why, while mail with a sender goes through.
    let http::Response { status, body, .. } = http::get(metrics_port, "/healthz", None);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("relay: ok"), "{body}");
    assert!(
        body.contains("configuration: defaults.from_address is not set"),
        "{body}"
    );
    let (code, out, _) = output(tablemail().envs(env).arg("check"));
    assert_ne!(code, 0);
    assert!(out.contains("defaults.from_address: not set"), "{out}");
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

/// A key made by openssl in `dir`, and its DNS TXT record (`p=` as RFC 6376
/// and RFC 8463 want it: the SubjectPublicKeyInfo for RSA, the raw 32-byte key
/// for Ed25519).
fn dkim_key(dir: &std::path::Path, kind: &str) -> (std::path::PathBuf, String) {
    let key = dir.join(format!("{kind}.pem"));
    let made = match kind {
        "rsa" => std::process::Command::new("openssl")
            .args(["genrsa", "-out"])
            .arg(&key)
            .arg("2048")
            .output(),
        _ => std::process::Command::new("openssl")
            .args(["genpkey", "-algorithm", "ed25519", "-out"])
            .arg(&key)
            .output(),
    }
    .expect("openssl");
    assert!(made.status.success(), "{made:?}");
    let public = std::process::Command::new("openssl")
        .args(["pkey", "-pubout", "-outform", "DER", "-in"])
        .arg(&key)
        .output()
        .expect("openssl");
    assert!(public.status.success());
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let txt = match kind {
        "rsa" => format!("v=DKIM1; k=rsa; p={}", b64.encode(&public.stdout)),
        _ => format!(
            "v=DKIM1; k=ed25519; p={}",
            b64.encode(&public.stdout[public.stdout.len() - 32..])
        ),
    };
    (key, txt)
}

/// dkimpy's verdict on `message`: "pass" or "fail: …".
fn dkim_verdict(message: &str, record: &str) -> String {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/dkim_verify.py");
    let mut child = std::process::Command::new("python3")
        .arg(script)
        .arg("s2026._domainkey.example.com")
        .arg(record)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 with dkimpy (scripts/test installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(message.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "dkim_verify.py failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dkim_signatures_verify_at_the_receiver() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let dir = TempDir::new();
    for kind in ["rsa", "ed25519"] {
        let (key, record) = dkim_key(dir.path(), kind);
        let smtp = SmtpServer::start(&[]);
        db.exec("DELETE FROM mail_queue").await;
        let mut order = mail("kunde@example.net", "Ihre Bestellung, Frau Müller");
        order.from_name = Some("Müller & Söhne".into());
        order.body = Some("Grüße\n.\nEine Zeile mit Leerzeichen am Ende   \n".repeat(40));
        order.body_html = Some(format!("<p>{}</p>", "Bestätigung für Sie. ".repeat(300)));
        order.headers = Some(
            serde_json::json!({
                "List-Unsubscribe": "<https://example.com/u/1>",
                "List-Unsubscribe-Post": "List-Unsubscribe=One-Click"
            })
            .as_object()
            .unwrap()
            .clone(),
        );
        db.enqueue(order).await;
        let mut sub = mail("a@example.net", "from a subdomain");
        sub.from_address = Some("news@mail.example.com".into());
        db.enqueue(sub).await;
        let mut other = mail("b@example.net", "not ours to sign");
        other.from_address = Some("someone@example.org".into());
        db.enqueue(other).await;

        let env = daemon_env(
            &db,
            &smtp.url(),
            &[
                ("TABLEMAIL__DKIM__DOMAIN", "example.com"),
                ("TABLEMAIL__DKIM__SELECTOR", "s2026"),
                ("TABLEMAIL__DKIM__PRIVATE_KEY_FILE", key.to_str().unwrap()),
            ],
        );
        let (code, out, _) = output(tablemail().envs(env.clone()).arg("check"));
        assert_eq!(code, 0, "{out}");
        assert!(
            out.contains("dkim: signs mail from example.com and its subdomains, selector s2026"),
            "{out}"
        );
        let mut daemon = Daemon::start(env);
        eventually("three mails sent", Duration::from_secs(20), || async {
            smtp.received().len() == 3
        })
        .await;
        let said = daemon
            .wait_for_log(
                "DKIM signing mails from the domain and its subdomains",
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(said["dkim_domain"], "example.com");
        daemon.signal("TERM");
        assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);

        let got = smtp.received();
        let by_to = |to: &str| got.iter().find(|m| m.rcpt_tos == [to]).unwrap();
        let signed = by_to("kunde@example.net");
        let signature = signed.header("DKIM-Signature").expect("signed");
        assert!(signature.contains("d=example.com"), "{signature}");
        assert!(signature.contains("c=relaxed/relaxed"), "{signature}");
        let signed_names: Vec<String> = signature
            .split(';')
            .filter_map(|tag| tag.trim().strip_prefix("h="))
            .flat_map(|names| names.split(':'))
            .map(|n| n.trim().to_ascii_lowercase())
            .collect();
        for name in ["list-unsubscribe", "list-unsubscribe-post"] {
            assert!(
                signed_names.iter().any(|n| n == name),
                "{name} not in h=: {signature}"
            );
        }
        assert_eq!(dkim_verdict(&signed.data, &record), "pass", "{kind}");
        assert_eq!(
            signed.header("List-Unsubscribe").as_deref(),
            Some("<https://example.com/u/1>")
        );
        assert_eq!(
            dkim_verdict(&by_to("a@example.net").data, &record),
            "pass",
            "{kind}: a subdomain's mail"
        );
        assert_eq!(by_to("b@example.net").header("DKIM-Signature"), None);
        // The verifier is not a rubber stamp: a changed subject or an added
        // Reply-To breaks the signature.
        let tampered = signed.data.replacen("Subject: ", "Subject: Re: ", 1);
        assert_ne!(dkim_verdict(&tampered, &record), "pass");
        let added = format!("Reply-To: thief@example.org\r\n{}", signed.data);
        assert_ne!(dkim_verdict(&added, &record), "pass");
        let retyped = signed
            .data
            .replacen("multipart/alternative", "multipart/mixed", 1);
        assert_ne!(dkim_verdict(&retyped, &record), "pass");
        // The unsubscribe link is signed: pointed elsewhere, or its one-click
        // header dropped, the mail no longer verifies.
        let relinked = signed.data.replacen(
            "<https://example.com/u/1>",
            "<https://attacker.example/u/1>",
            1,
        );
        assert_ne!(relinked, signed.data);
        assert_ne!(dkim_verdict(&relinked, &record), "pass", "{kind}");
        let unposted = signed.data.replacen(
            "List-Unsubscribe-Post: List-Unsubscribe=One-Click\r\n",
            "",
            1,
        );
        assert_ne!(unposted, signed.data);
        assert_ne!(dkim_verdict(&unposted, &record), "pass", "{kind}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_dkim_key_stops_the_start_with_a_clear_error() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let dir = TempDir::new();
    let weak = dir.path().join("weak.pem");
    let made = std::process::Command::new("openssl")
        .args(["genrsa", "-out"])
        .arg(&weak)
        .arg("1024")
        .output()
        .expect("openssl");
    assert!(made.status.success());
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a key\n").unwrap();
    let missing = dir.path().join("missing.pem");
    for (file, says) in [
        (&weak, "under 2048 bits is too weak"),
        (&junk, "not a PEM private key"),
        (&missing, "dkim.private_key_file"),
    ] {
        let (code, out, err) = output(
            tablemail()
                .envs(daemon_env(
                    &db,
                    "smtp://127.0.0.1:1",
                    &[
                        ("TABLEMAIL__DKIM__DOMAIN", "example.com"),
                        ("TABLEMAIL__DKIM__SELECTOR", "s2026"),
                        ("TABLEMAIL__DKIM__PRIVATE_KEY_FILE", file.to_str().unwrap()),
                    ],
                ))
                .arg("run"),
        );
        assert_eq!(code, 2, "{out}{err}");
        assert!(err.contains(says), "{err}");
    }
    let (code, _, err) = output(
        tablemail()
            .envs(daemon_env(
                &db,
                "smtp://127.0.0.1:1",
                &[("TABLEMAIL__DKIM__DOMAIN", "example.com")],
            ))
            .arg("run"),
    );
    assert_eq!(code, 2);
    assert!(err.contains("together"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_ascii_mailbox_needs_a_relay_that_offers_smtputf8() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let plain = SmtpServer::start(&["--no-smtputf8"]);
    let without = worker(&db, &settings(&db, &plain.url()));
    let utf8 = db.enqueue(sender(mail("jörg@example.de", "Grüße"))).await;
    // An internationalized domain goes as A-labels: no SMTPUTF8 needed.
    let idn = db
        .enqueue(sender(mail("Jörg <joerg@bücher.example>", "IDN")))
        .await;
    let report = without.process_batch().await.unwrap();
    assert_eq!((report.sent, report.failed), (1, 1));
    let row = db.row(utf8).await;
    assert_eq!(row.status, "failed", "permanent, at once");
    let error = row.last_error.unwrap();
    assert!(
        error.starts_with("MAIL FROM: refused by tablemail, not by the relay")
            && error.contains("SMTPUTF8"),
        "{error}"
    );
    assert_eq!(db.row(idn).await.status, "sent");
    let attempts = plain.attempts();
    assert_eq!(
        attempts.len(),
        1,
        "nothing of the refused mail reached DATA"
    );
    assert_eq!(attempts[0].rcpt_tos, ["joerg@xn--bcher-kva.example"]);
    assert_eq!(
        attempts[0].header("To").as_deref(),
        Some("=?utf-8?b?SsO2cmc=?= <joerg@xn--bcher-kva.example>")
    );

    // A relay that offers SMTPUTF8 takes it.
    let relay = SmtpServer::start(&[]);
    let with = worker(&db, &settings(&db, &relay.url()));
    db.enqueue(sender(mail("jörg@example.de", "Grüße"))).await;
    assert_eq!(with.process_batch().await.unwrap().sent, 1);
    let got = relay.received();
    assert_eq!(got[0].rcpt_tos, ["jörg@example.de"]);
    assert_eq!(got[0].header("To").as_deref(), Some("jörg@example.de"));
}
