//! Providers' webhooks (DESIGN §14) against the daemon: real mails sent
//! through a relay that answers "." as each provider's SMTP server does
//! (`smtp_server.py --reply-like`), then the provider's reports about them
//! posted to `webhooks.listen`, signed with keys this file makes: an HMAC
//! key for Mailgun, an ECDSA P-256 pair for SendGrid, basic credentials for
//! Postmark, and for Amazon SES a certificate authority of its own whose
//! certificate a small HTTPS server here serves as SNS would (accepted
//! through the debug builds' test override only).
//!
//! What is proved, on every backend:
//! - a verified event acts as a mail report does: history, suppression, a
//!   mail `bounced`; it is found by the provider's message id (from the
//!   relay's reply) or by the Message-ID; a recipient the mail did not go to
//!   is kept unmatched and changes nothing;
//! - a provider's retry of an event is recorded once;
//! - refused, recording nothing: wrong or missing credentials, wrong
//!   signatures, tampered bodies, old timestamps, replayed tokens, oversize
//!   bodies, certificate URLs on other hosts, certificates of another
//!   authority, topics not configured; a provider without a key has no
//!   endpoint; one address past the rate limit is told 429.
//!
//! Every payload here is written by hand after the shapes the providers
//! document.

mod support;

use std::{
    process::Command,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use base64::Engine as _;
use ring::{rand::SystemRandom, signature::KeyPair as _};
use support::{
    http::{request, Response},
    *,
};

for_each_backend!(
    postmark_bounces_and_complaints,
    mailgun_failures_and_complaints,
    sendgrid_events,
    ses_notifications_through_sns,
    the_listener_bounds_its_requests,
);

/// How long the daemon gets to send the mails a test reports on.
const SENDING: Duration = Duration::from_secs(60);
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

// ---------------------------------------------------------------------------
// The daemon, its relay, the mails.

/// A daemon whose relay answers like `provider`, listening for webhooks.
struct Setup {
    daemon: Daemon,
    port: u16,
    _relay: SmtpServer,
}

/// A mail the daemon sent: its id, Message-ID and the provider's id for it
/// (`relay_queue_id`, from the relay's reply).
struct Sent {
    id: i64,
    message_id: String,
    queue_id: Option<String>,
}

async fn start(db: &TestDb, provider: &str, extra: Vec<(String, String)>) -> Setup {
    let relay = SmtpServer::start(&["--reply-like", provider]);
    let port = free_port();
    let mut env = daemon_env(db, &relay.url(), &[]);
    env.push((
        "TABLEMAIL__WEBHOOKS__LISTEN".into(),
        format!("127.0.0.1:{port}"),
    ));
    env.extend(extra);
    let daemon = Daemon::start(env);
    daemon
        .wait_for_log("webhook listener started", Duration::from_secs(30))
        .await;
    Setup {
        daemon,
        port,
        _relay: relay,
    }
}

/// Sends one mail to each address and waits until every one is sent.
async fn send(db: &TestDb, to: &[&str]) -> Vec<Sent> {
    let mut ids = Vec::new();
    for (i, address) in to.iter().enumerate() {
        ids.push(db.enqueue(mail(address, &format!("order {i}"))).await);
    }
    eventually("every mail sent", SENDING, || async {
        let mut all = true;
        for &id in &ids {
            all &= db.row(id).await.status == "sent";
        }
        all
    })
    .await;
    let mut sent = Vec::new();
    for id in ids {
        let queue_id = db
            .strings(&format!(
                "SELECT relay_queue_id FROM mail_queue WHERE id = {id} AND relay_queue_id IS NOT NULL"
            ))
            .await
            .pop();
        sent.push(Sent {
            id,
            message_id: db.row(id).await.message_id.expect("a Message-ID"),
            queue_id,
        });
    }
    sent
}

fn post(port: u16, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
    request(
        port,
        "POST",
        path,
        headers,
        Some(("application/json", body.as_bytes())),
    )
    .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

async fn reports(db: &TestDb) -> i64 {
    db.count_in("mail_feedback", "1 = 1").await
}

async fn matched(db: &TestDb, mail_id: i64, kind: &str) -> i64 {
    db.count_in(
        "mail_feedback",
        &format!("matched AND source = 'webhook' AND mail_id = {mail_id} AND kind = '{kind}'"),
    )
    .await
}

async fn suppressed(db: &TestDb, address: &str) -> Vec<String> {
    db.strings(&format!(
        "SELECT reason FROM mail_suppression WHERE address = '{address}'"
    ))
    .await
}

async fn events(db: &TestDb, mail_id: i64, outcome: &str) -> i64 {
    db.count_in(
        "mail_event",
        &format!("mail_id = {mail_id} AND outcome = '{outcome}' AND stage = 'report'"),
    )
    .await
}

/// Waits for the log line "webhook refused" number `n` and returns it.
async fn refusal(setup: &Setup, n: usize) -> serde_json::Value {
    eventually("the refusal logged", Duration::from_secs(10), || async {
        setup.daemon.logged("webhook refused").len() >= n
    })
    .await;
    setup.daemon.logged("webhook refused").remove(n - 1)
}

/// No log line carries a payload's recipient or secret.
fn logs_keep_quiet(setup: &Setup, secrets: &[&str]) {
    let output = setup.daemon.output();
    for secret in secrets {
        assert!(!output.contains(secret), "the log shows {secret}");
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

// ---------------------------------------------------------------------------
// Postmark: HTTP basic credentials.

const POSTMARK_USER: &str = "postmark-hook";
const POSTMARK_PASSWORD: &str = "the postmark tests' password";

fn basic(user: &str, password: &str) -> String {
    format!("Basic {}", B64.encode(format!("{user}:{password}")))
}

/// A bounce webhook's body, in the shape of Postmark's example.
fn postmark_bounce(id: u64, kind: &str, code: u32, message_id: &str, email: &str) -> String {
    let record = if kind == "SpamComplaint" {
        "SpamComplaint"
    } else {
        "Bounce"
    };
    format!(
        r#"{{
  "RecordType": "{record}",
  "MessageStream": "outbound",
  "ID": {id},
  "Type": "{kind}",
  "TypeCode": {code},
  "Name": "Hard bounce",
  "Tag": "Invitation",
  "MessageID": "{message_id}",
  "Metadata": {{"customer": "42"}},
  "ServerID": 23,
  "Description": "The server was unable to deliver your message (ex: unknown user, mailbox not found).",
  "Details": "smtp;550 5.1.1 The email account that you tried to reach does not exist.",
  "Email": "{email}",
  "From": "shop@example.com",
  "BouncedAt": "2026-03-05T16:33:54.9070259Z",
  "DumpAvailable": true,
  "Inactive": true,
  "CanActivate": true,
  "Subject": "order"
}}"#
    )
}

async fn postmark_bounces_and_complaints(db: TestDb) {
    let dir = TempDir::new();
    let file = dir.path().join("postmark-credentials");
    std::fs::write(&file, format!("{POSTMARK_USER}:{POSTMARK_PASSWORD}\n")).unwrap();
    let setup = start(
        &db,
        "postmark",
        vec![(
            "TABLEMAIL__WEBHOOKS__POSTMARK__CREDENTIALS_FILE".into(),
            file.display().to_string(),
        )],
    )
    .await;
    let sent = send(&db, &["ann@ok.test", "bob@ok.test", "cat@ok.test"]).await;
    let (ann, bob, cat) = (&sent[0], &sent[1], &sent[2]);
    let auth = basic(POSTMARK_USER, POSTMARK_PASSWORD);
    let hook = |body: &str, auth: Option<&str>| {
        let headers: Vec<(&str, &str)> = auth.map(|a| ("Authorization", a)).into_iter().collect();
        post(setup.port, "/webhooks/postmark", &headers, body)
    };

    // Refused before anything: no credentials, the wrong ones.
    let bounce = postmark_bounce(
        4323372036854775807,
        "HardBounce",
        1,
        ann.queue_id
            .as_deref()
            .expect("Postmark's reply names its id"),
        "ann@ok.test",
    );
    assert_eq!(hook(&bounce, None).status, 401);
    let wrong = basic(POSTMARK_USER, "not the password at all");
    assert_eq!(hook(&bounce, Some(&wrong)).status, 401);
    assert_eq!(reports(&db).await, 0, "a refused request records nothing");
    let line = refusal(&setup, 2).await;
    assert_eq!(line["provider"], "postmark");
    assert_eq!(line["status"], 401);

    // A hard bounce, found by Postmark's MessageID: the mail bounces.
    let answer = hook(&bounce, Some(&auth));
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(matched(&db, ann.id, "hard_bounce").await, 1);
    assert_eq!(db.row(ann.id).await.status, "bounced");
    assert_eq!(suppressed(&db, "ann@ok.test").await, ["hard_bounce"]);
    assert_eq!(events(&db, ann.id, "bounced").await, 1);
    // Postmark's retry of the same bounce: answered, recorded once.
    assert_eq!(hook(&bounce, Some(&auth)).status, 200);
    assert_eq!(reports(&db).await, 1);
    assert_eq!(events(&db, ann.id, "bounced").await, 1);

    // A spam complaint.
    let complaint = postmark_bounce(
        4323372036854775808,
        "SpamComplaint",
        100001,
        bob.queue_id.as_deref().unwrap(),
        "bob@ok.test",
    );
    assert_eq!(hook(&complaint, Some(&auth)).status, 200);
    assert_eq!(matched(&db, bob.id, "complaint").await, 1);
    assert_eq!(suppressed(&db, "bob@ok.test").await, ["complaint"]);

    // Cat's mail, about someone it never went to: kept, changes nothing.
    let stranger = postmark_bounce(
        4323372036854775809,
        "HardBounce",
        1,
        cat.queue_id.as_deref().unwrap(),
        "dan@elsewhere.test",
    );
    assert_eq!(hook(&stranger, Some(&auth)).status, 200);
    assert_eq!(
        db.count_in(
            "mail_feedback",
            &format!(
                "NOT matched AND mail_id = {} AND recipient = 'dan@elsewhere.test'",
                cat.id
            )
        )
        .await,
        1
    );
    assert_eq!(db.row(cat.id).await.status, "sent");
    assert!(suppressed(&db, "dan@elsewhere.test").await.is_empty());

    // A delivery webhook: acknowledged, not recorded.
    let delivery = format!(
        r#"{{"RecordType":"Delivery","ServerID":23,"MessageStream":"outbound","MessageID":"{}",
        "Recipient":"cat@ok.test","Tag":"welcome-email","DeliveredAt":"2026-03-05T16:33:54Z",
        "Details":"Test delivery webhook details","Metadata":{{}}}}"#,
        cat.queue_id.as_deref().unwrap()
    );
    assert_eq!(hook(&delivery, Some(&auth)).status, 200);
    assert_eq!(reports(&db).await, 3);
    assert_eq!(db.count_in("mail_feedback", "source <> 'webhook'").await, 0);
    logs_keep_quiet(
        &setup,
        &[POSTMARK_PASSWORD, "ann@ok.test", "dan@elsewhere.test"],
    );
}

// ---------------------------------------------------------------------------
// Mailgun: HMAC-SHA256 of timestamp and token.

const MAILGUN_KEY: &str = "key-of-the-mailgun-webhook-tests";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn mailgun_sign(key: &str, timestamp: u64, token: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key.as_bytes());
    hex(ring::hmac::sign(&key, format!("{timestamp}{token}").as_bytes()).as_ref())
}

/// A webhook's body in the shape of Mailgun's example: the signature, then
/// the event.
fn mailgun_event(
    key: &str,
    timestamp: u64,
    token: &str,
    event: &str,
    id: &str,
    recipient: &str,
    message_id: &str,
) -> String {
    let signature = mailgun_sign(key, timestamp, token);
    let failure = match event {
        "failed-permanent" => {
            r#""event": "failed", "severity": "permanent", "reason": "bounce",
      "delivery-status": {"attempt-no": 1, "code": 550, "enhanced-code": "5.1.1",
        "message": "550 5.1.1 The email account that you tried to reach does not exist.",
        "description": "", "session-seconds": 0.43},"#
        }
        "failed-temporary" => {
            r#""event": "failed", "severity": "temporary", "reason": "generic",
      "delivery-status": {"attempt-no": 1, "code": 452, "enhanced-code": "4.2.2",
        "message": "452 4.2.2 The email account that you tried to reach is over quota.",
        "description": "", "session-seconds": 0.2, "retry-seconds": 600},"#
        }
        _ => r#""event": "complained","#,
    };
    // Mailgun gives the Message-ID without its angle brackets.
    let message_id = message_id.trim_start_matches('<').trim_end_matches('>');
    format!(
        r#"{{
  "signature": {{"timestamp": "{timestamp}", "token": "{token}", "signature": "{signature}"}},
  "event-data": {{
    {failure}
    "id": "{id}",
    "timestamp": {timestamp}.329574,
    "log-level": "error",
    "recipient": "{recipient}",
    "recipient-domain": "ok.test",
    "tags": [],
    "envelope": {{"transport": "smtp", "sender": "shop@example.com", "targets": "{recipient}"}},
    "message": {{"headers": {{"to": "{recipient}", "message-id": "{message_id}",
      "from": "shop@example.com", "subject": "order"}}, "attachments": [], "size": 111}},
    "flags": {{"is-routed": false, "is-authenticated": true, "is-system-test": false, "is-test-mode": false}}
  }}
}}"#
    )
}

async fn mailgun_failures_and_complaints(db: TestDb) {
    let dir = TempDir::new();
    let file = dir.path().join("mailgun-key");
    std::fs::write(&file, format!("{MAILGUN_KEY}\n")).unwrap();
    let setup = start(
        &db,
        "mailgun",
        vec![(
            "TABLEMAIL__WEBHOOKS__MAILGUN__SIGNING_KEY_FILE".into(),
            file.display().to_string(),
        )],
    )
    .await;
    let sent = send(&db, &["ann@ok.test", "bob@ok.test", "cat@ok.test"]).await;
    let (ann, bob, cat) = (&sent[0], &sent[1], &sent[2]);
    assert!(ann.queue_id.is_none(), "Mailgun's reply names no id");
    let hook = |body: &str| post(setup.port, "/webhooks/mailgun", &[], body);

    // A permanent failure, found by the Message-ID tablemail gave the mail.
    let t = now();
    let failed = mailgun_event(
        MAILGUN_KEY,
        t,
        "token-1-a8ce0edb2dd8301dee6c2405235584e45aa91d1e9f979f3de0",
        "failed-permanent",
        "G9Bn5sl1TC6nu79C8C0bwg",
        "ann@ok.test",
        &ann.message_id,
    );
    let answer = hook(&failed);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(matched(&db, ann.id, "hard_bounce").await, 1);
    assert_eq!(db.row(ann.id).await.status, "bounced");
    assert_eq!(suppressed(&db, "ann@ok.test").await, ["hard_bounce"]);

    // The same request again: its token was seen.
    assert_eq!(hook(&failed).status, 403);
    // Mailgun's retry of the event, signed anew: answered, recorded once.
    let retry = mailgun_event(
        MAILGUN_KEY,
        now(),
        "token-2-b8ce0edb2dd8301dee6c2405235584e45aa91d1e9f979f3de0",
        "failed-permanent",
        "G9Bn5sl1TC6nu79C8C0bwg",
        "ann@ok.test",
        &ann.message_id,
    );
    assert_eq!(hook(&retry).status, 200);
    assert_eq!(reports(&db).await, 1);

    // A temporary failure: delayed, the mail still sent, nobody suppressed.
    let temporary = mailgun_event(
        MAILGUN_KEY,
        now(),
        "token-3",
        "failed-temporary",
        "Ase7i2zsRYeDXztHGENqRA",
        "bob@ok.test",
        &bob.message_id,
    );
    assert_eq!(hook(&temporary).status, 200);
    assert_eq!(matched(&db, bob.id, "delayed").await, 1);
    assert_eq!(events(&db, bob.id, "delayed").await, 1);
    assert_eq!(db.row(bob.id).await.status, "sent");
    assert!(suppressed(&db, "bob@ok.test").await.is_empty());

    // A complaint.
    let complained = mailgun_event(
        MAILGUN_KEY,
        now(),
        "token-4",
        "complained",
        "-Agny091SquKnsrW2NEKUA",
        "cat@ok.test",
        &cat.message_id,
    );
    assert_eq!(hook(&complained).status, 200);
    assert_eq!(suppressed(&db, "cat@ok.test").await, ["complaint"]);
    assert_eq!(reports(&db).await, 3);

    // Refused, recording nothing: a timestamp six minutes old, a signature
    // under another key, a signature altered after signing.
    let old = mailgun_event(
        MAILGUN_KEY,
        now() - 360,
        "token-5",
        "complained",
        "old-event-1",
        "bob@ok.test",
        &bob.message_id,
    );
    assert_eq!(hook(&old).status, 403);
    let forged = mailgun_event(
        "another key, not the configured one",
        now(),
        "token-6",
        "complained",
        "forged-1",
        "bob@ok.test",
        &bob.message_id,
    );
    assert_eq!(hook(&forged).status, 403);
    let good = mailgun_sign(MAILGUN_KEY, t, "token-7");
    let flipped = if good.ends_with('0') { '1' } else { '0' };
    let tampered = mailgun_event(
        MAILGUN_KEY,
        t,
        "token-7",
        "complained",
        "tampered-1",
        "bob@ok.test",
        &bob.message_id,
    )
    .replace(&good, &format!("{}{flipped}", &good[..good.len() - 1]));
    assert_eq!(hook(&tampered).status, 403);
    assert_eq!(reports(&db).await, 3, "refused requests record nothing");
    assert!(suppressed(&db, "bob@ok.test").await.is_empty());
    let line = refusal(&setup, 4).await;
    assert_eq!(line["provider"], "mailgun");
    logs_keep_quiet(&setup, &[MAILGUN_KEY, "bob@ok.test", "token-7"]);
}

// ---------------------------------------------------------------------------
// SendGrid: ECDSA P-256 over timestamp and body.

/// The DER of a P-256 SubjectPublicKeyInfo up to the point.
const P256_SPKI: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

/// A key pair, and its public key as SendGrid shows it (base64 DER).
fn sendgrid_keys() -> (ring::signature::EcdsaKeyPair, String) {
    let rng = SystemRandom::new();
    let alg = &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING;
    let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(alg, &rng).unwrap();
    let pair = ring::signature::EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).unwrap();
    let mut spki = P256_SPKI.to_vec();
    spki.extend_from_slice(pair.public_key().as_ref());
    (pair, B64.encode(spki))
}

fn sendgrid_sign(pair: &ring::signature::EcdsaKeyPair, timestamp: &str, body: &str) -> String {
    let mut signed = timestamp.as_bytes().to_vec();
    signed.extend_from_slice(body.as_bytes());
    B64.encode(pair.sign(&SystemRandom::new(), &signed).unwrap().as_ref())
}

/// A batch in the shape of SendGrid's event webhook examples.
fn sendgrid_batch(ann: &Sent, bob: &Sent, cat: &Sent) -> String {
    let sg = |sent: &Sent| {
        format!(
            "{}.filterdrecv-5645d9c87f-8kdrv-1-5F3E5D2A-12.0",
            sent.queue_id
                .as_deref()
                .expect("SendGrid's reply names its id")
        )
    };
    format!(
        r#"[
  {{"email": "ann@ok.test", "timestamp": 1513299569, "smtp-id": "{ann_mid}", "event": "bounce",
    "category": "cat facts", "sg_event_id": "6g4ZI7SA-xmRDv57GoPIPw==", "sg_message_id": "{ann_sg}",
    "reason": "500 unknown recipient", "status": "5.0.0", "type": "bounce",
    "bounce_classification": "Invalid Address"}},
  {{"email": "bob@ok.test", "timestamp": 1513299569, "smtp-id": "{bob_mid}", "event": "deferred",
    "category": "cat facts", "sg_event_id": "t7LEShmowp86DTdUW8M-GQ==", "sg_message_id": "{bob_sg}",
    "response": "400 try again later", "attempt": "5"}},
  {{"email": "cat@ok.test", "timestamp": 1513299569, "smtp-id": "{cat_mid}", "event": "spamreport",
    "category": "cat facts", "sg_event_id": "37nvH5QBz858KGVYCM4uOA==", "sg_message_id": "{cat_sg}"}},
  {{"email": "cat@ok.test", "timestamp": 1513299569, "smtp-id": "{cat_mid}", "event": "delivered",
    "category": "cat facts", "sg_event_id": "rWVYmVk90MjZJ9iohOBa3w==", "sg_message_id": "{cat_sg}",
    "response": "250 OK"}}
]"#,
        ann_mid = ann.message_id,
        bob_mid = bob.message_id,
        cat_mid = cat.message_id,
        ann_sg = sg(ann),
        bob_sg = sg(bob),
        cat_sg = sg(cat),
    )
}

async fn sendgrid_events(db: TestDb) {
    let dir = TempDir::new();
    let (pair, shown) = sendgrid_keys();
    let file = dir.path().join("sendgrid-key");
    std::fs::write(&file, format!("{shown}\n")).unwrap();
    let setup = start(
        &db,
        "sendgrid",
        vec![(
            "TABLEMAIL__WEBHOOKS__SENDGRID__PUBLIC_KEY_FILE".into(),
            file.display().to_string(),
        )],
    )
    .await;
    let sent = send(&db, &["ann@ok.test", "bob@ok.test", "cat@ok.test"]).await;
    let (ann, bob, cat) = (&sent[0], &sent[1], &sent[2]);
    let batch = sendgrid_batch(ann, bob, cat);
    let hook = |signature: &str, timestamp: &str, body: &str| {
        post(
            setup.port,
            "/webhooks/sendgrid",
            &[
                ("X-Twilio-Email-Event-Webhook-Signature", signature),
                ("X-Twilio-Email-Event-Webhook-Timestamp", timestamp),
            ],
            body,
        )
    };
    let timestamp = now().to_string();
    let signature = sendgrid_sign(&pair, &timestamp, &batch);

    // Refused, recording nothing: a body altered after signing, a
    // signature of another key, no signature.
    let tampered = batch.replace("\"type\": \"bounce\"", "\"type\": \"blocked\"");
    assert_eq!(hook(&signature, &timestamp, &tampered).status, 403);
    let (other, _) = sendgrid_keys();
    let foreign = sendgrid_sign(&other, &timestamp, &batch);
    assert_eq!(hook(&foreign, &timestamp, &batch).status, 403);
    let unsigned = post(setup.port, "/webhooks/sendgrid", &[], &batch);
    assert_eq!(unsigned.status, 403);
    assert_eq!(reports(&db).await, 0);

    // The batch: a bounce, a deferral and a spam report, found by the id
    // in SendGrid's reply; the delivery records nothing.
    let answer = hook(&signature, &timestamp, &batch);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(matched(&db, ann.id, "hard_bounce").await, 1);
    assert_eq!(db.row(ann.id).await.status, "bounced");
    assert_eq!(suppressed(&db, "ann@ok.test").await, ["hard_bounce"]);
    assert_eq!(matched(&db, bob.id, "delayed").await, 1);
    assert_eq!(db.row(bob.id).await.status, "sent");
    assert_eq!(matched(&db, cat.id, "complaint").await, 1);
    assert_eq!(suppressed(&db, "cat@ok.test").await, ["complaint"]);
    assert_eq!(reports(&db).await, 3);

    // SendGrid's retry of the batch: answered, recorded once.
    let later = (now() + 1).to_string();
    let resigned = sendgrid_sign(&pair, &later, &batch);
    assert_eq!(hook(&resigned, &later, &batch).status, 200);
    assert_eq!(reports(&db).await, 3);
    assert_eq!(events(&db, ann.id, "bounced").await, 1);
    let line = refusal(&setup, 3).await;
    assert_eq!(line["provider"], "sendgrid");
    logs_keep_quiet(&setup, &["ann@ok.test", &signature]);
}

// ---------------------------------------------------------------------------
// Amazon SES through SNS: a certificate authority and an SNS of our own.

const TOPIC: &str = "arn:aws:sns:us-east-1:123456789012:ses-feedback";
const CERT_PATH: &str = "/SimpleNotificationService-7ff5318490ec183fbaddaa2a969abfda.pem";

fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `NAME-ca.pem`, and `NAME.pem` / `NAME.key` for SNS's hosts signed by it.
fn authority(dir: &std::path::Path, name: &str) {
    let (ca, ca_key) = (format!("{name}-ca.pem"), format!("{name}-ca.key"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-keyout",
            &ca_key,
            "-out",
            &ca,
            "-subj",
            &format!("/CN=tablemail test CA {name}"),
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
    let (leaf, key, csr) = (
        format!("{name}.pem"),
        format!("{name}.key"),
        format!("{name}.csr"),
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            "/CN=sns.amazonaws.com",
        ],
    );
    let ext = format!("{name}.ext");
    std::fs::write(
        dir.join(&ext),
        "subjectAltName=DNS:sns.us-east-1.amazonaws.com,DNS:sns.amazonaws.com\n\
         extendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n\
         keyUsage=critical,digitalSignature,keyEncipherment\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &leaf,
            "-extfile",
            &ext,
        ],
    );
}

/// What the test's SNS saw: the paths it was asked for.
type Asked = Arc<Mutex<Vec<String>>>;

/// An HTTPS server for `sns.us-east-1.amazonaws.com` with the test CA's
/// certificate: it serves the signing certificates and answers the
/// subscription link.
async fn fake_sns(dir: &std::path::Path) -> (u16, Asked) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::{
        self,
        pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer},
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("sns.pem"))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(dir.join("sns.key")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let asked: Asked = Arc::default();
    let (signing, rogue) = (
        std::fs::read(dir.join("sns.pem")).unwrap(),
        std::fs::read(dir.join("rogue.pem")).unwrap(),
    );
    let seen = asked.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, seen) = (acceptor.clone(), seen.clone());
            let (signing, rogue) = (signing.clone(), rogue.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&head).to_string();
                let path = text.split_whitespace().nth(1).unwrap_or("").to_string();
                seen.lock().unwrap().push(path.clone());
                let (status, body) = if path == CERT_PATH {
                    ("200 OK", signing)
                } else if path == "/rogue.pem" {
                    ("200 OK", rogue)
                } else if path.starts_with("/?Action=ConfirmSubscription") {
                    (
                        "200 OK",
                        b"<ConfirmSubscriptionResponse><ConfirmSubscriptionResult><SubscriptionArn>arn:aws:sns:us-east-1:123456789012:ses-feedback:1</SubscriptionArn></ConfirmSubscriptionResult></ConfirmSubscriptionResponse>".to_vec(),
                    )
                } else {
                    ("404 Not Found", b"no".to_vec())
                };
                let answer = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = tls.write_all(answer.as_bytes()).await;
                let _ = tls.write_all(&body).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    (port, asked)
}

/// An SNS message: its fields, signed as SNS signs them (`Name\nvalue\n` in
/// the type's order) with `key` (SignatureVersion 1: SHA-1, 2: SHA-256).
struct Sns {
    kind: &'static str,
    message_id: String,
    topic: String,
    message: String,
    subject: Option<String>,
    subscribe_url: Option<String>,
    token: Option<String>,
    cert_url: String,
}

impl Sns {
    fn notification(message_id: &str, message: String) -> Sns {
        Sns {
            kind: "Notification",
            message_id: message_id.into(),
            topic: TOPIC.into(),
            message,
            subject: None,
            subscribe_url: None,
            token: None,
            cert_url: format!("https://sns.us-east-1.amazonaws.com{CERT_PATH}"),
        }
    }

    fn confirmation(kind: &'static str) -> Sns {
        let token =
            "2336412f37fb687f5d51e6e2425f004aed4b6ec9a7c45c27b3b0b9c9a5f2c3c5f4a0c6bd".to_string();
        Sns {
            kind,
            message_id: "165545c9-2a5c-472c-8df2-7ff2be2b3b1b".into(),
            topic: TOPIC.into(),
            message: format!("You have chosen to subscribe to the topic {TOPIC}.\nTo confirm the subscription, visit the SubscribeURL included in this message."),
            subject: None,
            subscribe_url: Some(format!(
                "https://sns.us-east-1.amazonaws.com/?Action=ConfirmSubscription&TopicArn={TOPIC}&Token={token}"
            )),
            token: Some(token),
            cert_url: format!("https://sns.us-east-1.amazonaws.com{CERT_PATH}"),
        }
    }

    fn signed_text(&self) -> String {
        let mut fields: Vec<(&str, &str)> =
            vec![("Message", &self.message), ("MessageId", &self.message_id)];
        if self.kind == "Notification" {
            if let Some(subject) = &self.subject {
                fields.push(("Subject", subject));
            }
        } else {
            fields.push(("SubscribeURL", self.subscribe_url.as_deref().unwrap()));
        }
        fields.push(("Timestamp", "2026-03-05T00:54:06.655Z"));
        if self.kind != "Notification" {
            fields.push(("Token", self.token.as_deref().unwrap()));
        }
        fields.push(("TopicArn", &self.topic));
        fields.push(("Type", self.kind));
        fields
            .iter()
            .map(|(name, value)| format!("{name}\n{value}\n"))
            .collect()
    }

    fn body(&self, dir: &std::path::Path, key: &str, version: u8) -> String {
        let text = dir.join("to-sign.txt");
        std::fs::write(&text, self.signed_text()).unwrap();
        let digest = if version == 1 { "-sha1" } else { "-sha256" };
        openssl(
            dir,
            &[
                "dgst",
                digest,
                "-sign",
                key,
                "-out",
                "signature.bin",
                "to-sign.txt",
            ],
        );
        let signature = B64.encode(std::fs::read(dir.join("signature.bin")).unwrap());
        let mut body = serde_json::json!({
            "Type": self.kind,
            "MessageId": self.message_id,
            "TopicArn": self.topic,
            "Message": self.message,
            "Timestamp": "2026-03-05T00:54:06.655Z",
            "SignatureVersion": version.to_string(),
            "Signature": signature,
            "SigningCertURL": self.cert_url,
            "UnsubscribeURL": format!("https://sns.us-east-1.amazonaws.com/?Action=Unsubscribe&SubscriptionArn={TOPIC}:c9135db0"),
        });
        if let Some(subject) = &self.subject {
            body["Subject"] = subject.clone().into();
        }
        if let Some(url) = &self.subscribe_url {
            body["SubscribeURL"] = url.clone().into();
            body["Token"] = self.token.clone().unwrap().into();
        }
        serde_json::to_string_pretty(&body).unwrap()
    }
}

/// An SES notification (the SNS message's `Message`) in the shape of SES's
/// examples.
fn ses_message(kind: &str, sent: &Sent, recipient: &str) -> String {
    let mail = serde_json::json!({
        "timestamp": "2026-03-05T00:54:05.000Z",
        "source": "shop@example.com",
        "sourceArn": "arn:aws:ses:us-east-1:123456789012:identity/example.com",
        "sourceIp": "127.0.3.0",
        "sendingAccountId": "123456789012",
        "messageId": sent.queue_id.as_deref().expect("SES's reply names its id"),
        "destination": [recipient],
        "headersTruncated": false,
        "commonHeaders": {"from": ["shop@example.com"], "to": [recipient], "subject": "order"},
    });
    let event = match kind {
        "Bounce" => serde_json::json!({
            "notificationType": "Bounce",
            "bounce": {
                "bounceType": "Permanent",
                "bounceSubType": "General",
                "bouncedRecipients": [{
                    "emailAddress": recipient,
                    "action": "failed",
                    "status": "5.1.1",
                    "diagnosticCode": "smtp; 550 5.1.1 user unknown"
                }],
                "timestamp": "2026-03-05T00:54:06.000Z",
                "feedbackId": "00000137860315fd-869464a4-8680-4114-98d3-716fe35851f9-000000",
                "remoteMtaIp": "127.0.2.0",
                "reportingMTA": "dsn; a8-70.smtp-out.amazonses.com"
            },
            "mail": mail,
        }),
        "Complaint" => serde_json::json!({
            "notificationType": "Complaint",
            "complaint": {
                "userAgent": "AnyCompany Feedback Loop (V0.01)",
                "complainedRecipients": [{"emailAddress": recipient}],
                "complaintFeedbackType": "abuse",
                "arrivalDate": "2026-03-05T00:54:06.000Z",
                "timestamp": "2026-03-05T00:54:07.000Z",
                "feedbackId": "000001378603177f-18c07c78-fa81-4a58-9dd1-fedc3cb8f49a-000000"
            },
            "mail": mail,
        }),
        _ => serde_json::json!({
            "notificationType": "Delivery",
            "delivery": {
                "timestamp": "2026-03-05T00:54:06.000Z",
                "processingTimeMillis": 546,
                "recipients": [recipient],
                "smtpResponse": "250 ok:  Message 64111812 accepted",
                "reportingMTA": "a8-70.smtp-out.amazonses.com",
                "remoteMtaIp": "127.0.2.0"
            },
            "mail": mail,
        }),
    };
    event.to_string()
}

async fn ses_notifications_through_sns(db: TestDb) {
    // The test override exists in debug builds only.
    if !cfg!(debug_assertions) || std::env::var_os("TABLEMAIL_TEST_BIN").is_some() {
        eprintln!("skipped: the SNS test override is in debug builds only");
        return;
    }
    let dir = TempDir::new();
    authority(dir.path(), "sns");
    authority(dir.path(), "rogue");
    let (sns_port, asked) = fake_sns(dir.path()).await;
    let setup = start(
        &db,
        "ses",
        vec![
            ("TABLEMAIL__WEBHOOKS__SES__TOPIC_ARNS".into(), TOPIC.into()),
            (
                "TABLEMAIL_TEST_SNS_CA".into(),
                dir.path().join("sns-ca.pem").display().to_string(),
            ),
            (
                "TABLEMAIL_TEST_SNS_ADDRESS".into(),
                format!("127.0.0.1:{sns_port}"),
            ),
        ],
    )
    .await;
    let sent = send(&db, &["ann@ok.test", "bob@ok.test", "cat@ok.test"]).await;
    let (ann, bob, cat) = (&sent[0], &sent[1], &sent[2]);
    let hook = |body: &str| {
        post(
            setup.port,
            "/webhooks/ses",
            &[("x-amz-sns-message-type", "Notification")],
            body,
        )
    };
    let dir = dir.path();

    // The subscription is confirmed: its link is fetched.
    let confirm = Sns::confirmation("SubscriptionConfirmation").body(dir, "sns.key", 1);
    let answer = hook(&confirm);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(
        asked
            .lock()
            .unwrap()
            .iter()
            .any(|p| p.starts_with("/?Action=ConfirmSubscription&TopicArn=")),
        "{asked:?}"
    );
    setup
        .daemon
        .wait_for_log("SNS subscription confirmed", Duration::from_secs(10))
        .await;

    // A bounce (SignatureVersion 1), found by SES's message id.
    let bounce = Sns::notification(
        "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324",
        ses_message("Bounce", ann, "ann@ok.test"),
    );
    let body = bounce.body(dir, "sns.key", 1);
    let answer = hook(&body);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(matched(&db, ann.id, "hard_bounce").await, 1);
    assert_eq!(db.row(ann.id).await.status, "bounced");
    assert_eq!(suppressed(&db, "ann@ok.test").await, ["hard_bounce"]);
    // SNS's retry of it: answered, recorded once.
    assert_eq!(hook(&body).status, 200);
    assert_eq!(reports(&db).await, 1);

    // A complaint (SignatureVersion 2).
    let complaint = Sns::notification(
        "d2a7a2e4-3c55-5a8d-9b22-2c8d6f4e5b61",
        ses_message("Complaint", bob, "bob@ok.test"),
    );
    assert_eq!(hook(&complaint.body(dir, "sns.key", 2)).status, 200);
    assert_eq!(matched(&db, bob.id, "complaint").await, 1);
    assert_eq!(suppressed(&db, "bob@ok.test").await, ["complaint"]);

    // A delivery: acknowledged, not recorded.
    let delivery = Sns::notification(
        "5b2c7a1e-0f4d-4c3b-9a8e-7d6c5b4a3f21",
        ses_message("Delivery", cat, "cat@ok.test"),
    );
    assert_eq!(hook(&delivery.body(dir, "sns.key", 2)).status, 200);
    assert_eq!(reports(&db).await, 2);

    // Refused, recording nothing: a message altered after signing, a
    // certificate URL on another host, a certificate of another authority
    // on SNS's host, a topic not configured.
    let cat_bounce = |id: &str| Sns::notification(id, ses_message("Bounce", cat, "cat@ok.test"));
    let signed = cat_bounce("0e5f4a4e-1b0c-4d6b-8a3f-111111111111").body(dir, "sns.key", 2);
    let tampered = signed.replace("Permanent", "Transient");
    assert_ne!(tampered, signed);
    assert_eq!(hook(&tampered).status, 403);
    let mut elsewhere = cat_bounce("0e5f4a4e-1b0c-4d6b-8a3f-222222222222");
    elsewhere.cert_url = "https://sns.us-east-1.amazonaws.com.evil.test/cert.pem".into();
    assert_eq!(hook(&elsewhere.body(dir, "sns.key", 2)).status, 403);
    elsewhere.cert_url = "https://evil.test/SimpleNotificationService-1.pem".into();
    assert_eq!(hook(&elsewhere.body(dir, "sns.key", 2)).status, 403);
    let mut rogue = cat_bounce("0e5f4a4e-1b0c-4d6b-8a3f-333333333333");
    rogue.cert_url = "https://sns.us-east-1.amazonaws.com/rogue.pem".into();
    assert_eq!(hook(&rogue.body(dir, "rogue.key", 2)).status, 403);
    let mut other_topic = cat_bounce("0e5f4a4e-1b0c-4d6b-8a3f-444444444444");
    other_topic.topic = "arn:aws:sns:us-east-1:999999999999:someone-elses".into();
    assert_eq!(hook(&other_topic.body(dir, "sns.key", 2)).status, 403);
    assert_eq!(reports(&db).await, 2, "refused requests record nothing");
    assert_eq!(db.row(cat.id).await.status, "sent");
    assert!(
        asked.lock().unwrap().iter().all(|p| !p.contains("evil")),
        "a URL on another host was fetched: {asked:?}"
    );
    assert!(asked.lock().unwrap().iter().any(|p| p == "/rogue.pem"));
    let reasons: Vec<String> = setup
        .daemon
        .logged("webhook refused")
        .iter()
        .map(|l| l["reason"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("does not chain to a trusted root")),
        "{reasons:?}"
    );

    // An unsubscription: verified and logged.
    let unsubscribe = Sns::confirmation("UnsubscribeConfirmation").body(dir, "sns.key", 1);
    assert_eq!(hook(&unsubscribe).status, 200);
    setup
        .daemon
        .wait_for_log("SNS unsubscription confirmed", Duration::from_secs(10))
        .await;
    logs_keep_quiet(&setup, &["ann@ok.test", "cat@ok.test"]);
}

// ---------------------------------------------------------------------------
// The listener's own bounds.

async fn the_listener_bounds_its_requests(db: TestDb) {
    let dir = TempDir::new();
    let file = dir.path().join("postmark-credentials");
    std::fs::write(&file, format!("{POSTMARK_USER}:{POSTMARK_PASSWORD}\n")).unwrap();
    let setup = start(
        &db,
        "postmark",
        vec![
            (
                "TABLEMAIL__WEBHOOKS__POSTMARK__CREDENTIALS_FILE".into(),
                file.display().to_string(),
            ),
            ("TABLEMAIL__WEBHOOKS__MAX_BODY_SIZE".into(), "4KiB".into()),
            ("TABLEMAIL__WEBHOOKS__RATE_LIMIT".into(), "5".into()),
        ],
    )
    .await;
    let auth = basic(POSTMARK_USER, POSTMARK_PASSWORD);
    let headers = [("Authorization", auth.as_str())];

    // A body over webhooks.max_body_size: 413, nothing recorded.
    let mut big = postmark_bounce(7, "HardBounce", 1, "x", "ann@ok.test");
    big.insert_str(1, &format!("\"Padding\": \"{}\",", "x".repeat(5000)));
    assert_eq!(
        post(setup.port, "/webhooks/postmark", &headers, &big).status,
        413
    );
    // Providers without a key have no endpoint; nor has anything else.
    for path in [
        "/webhooks/mailgun",
        "/webhooks/sendgrid",
        "/webhooks/ses",
        "/",
    ] {
        assert_eq!(post(setup.port, path, &[], "{}").status, 404, "{path}");
    }
    assert_eq!(reports(&db).await, 0);

    // Five a second from one address, a burst of ten: the rest are 429.
    let statuses: Vec<u16> = (0..30)
        .map(|_| post(setup.port, "/webhooks/postmark", &[], "{}").status)
        .collect();
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 401 || *s == 429),
        "{statuses:?}"
    );
    // …and the bucket fills again.
    eventually(
        "the rate limit lets requests through again",
        Duration::from_secs(10),
        || async { post(setup.port, "/webhooks/postmark", &[], "{}").status == 401 },
    )
    .await;
    assert_eq!(reports(&db).await, 0);

    // `check` names the configured provider.
    let mut check = tablemail();
    check
        .arg("check")
        .envs(db.env())
        .env("TABLEMAIL__WEBHOOKS__LISTEN", "127.0.0.1:1")
        .env("TABLEMAIL__WEBHOOKS__POSTMARK__CREDENTIALS_FILE", &file)
        .env("TABLEMAIL__TRANSPORT__URL", "smtp://127.0.0.1:1")
        .env("TABLEMAIL__DEFAULTS__FROM_ADDRESS", "shop@example.com");
    let (_, stdout, _) = output(&mut check);
    assert!(
        stdout.contains("webhook postmark: POST /webhooks/postmark"),
        "{stdout}"
    );
    assert!(!stdout.contains(POSTMARK_PASSWORD));
}
