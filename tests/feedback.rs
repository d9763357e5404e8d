//! The delivery loop (DESIGN §12) as a user meets it: real mails sent by the
//! daemon, then reports about them — delivery status notifications (RFC
//! 3464), a feedback-loop complaint (RFC 5965), mailbox-full soft bounces —
//! fed to `tablemail ingest` or to the daemon's inbound SMTP listener.
//!
//! What is proved:
//! - a report acts only when it proves it saw the mail go to that recipient
//!   (a verified VERP tag, the Message-ID tablemail gave the mail, the
//!   relay's queue id); forged ones are kept as unmatched and change nothing;
//! - what acting means: history rows, the suppression list (hard bounces,
//!   complaints, repeated soft bounces for a while), a mail `bounced` once
//!   every recipient hard-bounced;
//! - `ingest --dry-run --json` tells and records nothing; `ingest` exits 75
//!   while the database is away, 0 for garbage (a bounce never bounces);
//! - `suppress` by hand: add, list, search, remove, expiry, export/import;
//! - the listener: 550 for other domains, 250 only once committed, 451 while
//!   the database is away and 250 again once it is back.
//!
//! Every report here is written by hand for these tests.

mod support;

use std::{
    io::Write as _,
    process::Stdio,
    time::{Duration, Instant},
};

use support::{postfix::Postfix, proxy::Proxy, *};
use tablemail::store::{Backend, NewMail};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

for_each_backend!(
    forged_reports_change_nothing,
    reports_without_verp_are_matched_by_message_id_or_queue_id,
    a_complaint_suppresses_the_address_unless_told_not_to,
    three_soft_bounces_suppress_for_a_while,
    a_mail_is_bounced_once_every_recipient_bounced,
    a_dry_run_tells_and_records_nothing,
    garbage_is_recorded_as_one_unmatched_report,
    the_suppression_list_by_hand,
);

const BOUNCE_DOMAIN: &str = "bounce.test";
/// The bounce secret as its file holds it: the trailing newline is not part
/// of the key.
const SECRET: &str = "the feedback tests' bounce secret\n";
/// How long the daemon gets to send the mails a test reports on.
const SENDING: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------
// VERP: the envelope sender of mail N, computed here as the design says.

/// `b-N-<tag>@bounce.test`, the tag the first 10 characters of the lowercase
/// base32 of HMAC-SHA256(secret, decimal N).
fn verp(id: i64) -> String {
    format!("b-{id}-{}@{BOUNCE_DOMAIN}", tag(id))
}

fn tag(id: i64) -> String {
    let key = ring::hmac::Key::new(
        ring::hmac::HMAC_SHA256,
        SECRET.trim_end_matches('\n').as_bytes(),
    );
    let mac = ring::hmac::sign(&key, id.to_string().as_bytes());
    base32(mac.as_ref())[..10].to_string()
}

/// RFC 4648 base32, lower-case, without padding: five octets at a time.
fn base32(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut out = String::new();
    for chunk in bytes.chunks(5) {
        let mut group = [0u8; 8];
        group[3..3 + chunk.len()].copy_from_slice(chunk);
        let bits = u64::from_be_bytes(group);
        for i in 0..(chunk.len() * 8).div_ceil(5) {
            out.push(ALPHABET[((bits >> (35 - 5 * i)) & 31) as usize] as char);
        }
    }
    out
}

#[test]
fn the_test_base32_follows_rfc_4648() {
    for (input, encoded) in [
        ("", ""),
        ("f", "my"),
        ("fo", "mzxq"),
        ("foo", "mzxw6"),
        ("foob", "mzxw6yq"),
        ("fooba", "mzxw6ytb"),
        ("foobar", "mzxw6ytboi"),
    ] {
        assert_eq!(base32(input.as_bytes()), encoded, "{input}");
    }
}

/// The bounce domain and its secret file, for the daemon and `ingest`.
struct Bounce {
    dir: TempDir,
}

impl Bounce {
    fn new() -> Bounce {
        let dir = TempDir::new();
        std::fs::write(dir.path().join("bounce-secret"), SECRET).unwrap();
        Bounce { dir }
    }

    fn secret_file(&self) -> String {
        self.dir.path().join("bounce-secret").display().to_string()
    }

    fn env(&self) -> Vec<(String, String)> {
        vec![
            ("TABLEMAIL__BOUNCE__DOMAIN".into(), BOUNCE_DOMAIN.into()),
            ("TABLEMAIL__BOUNCE__SECRET_FILE".into(), self.secret_file()),
        ]
    }

    /// `ingest`'s environment: the database and the bounce settings.
    fn ingest_env(&self, db: &TestDb) -> Vec<(String, String)> {
        let mut env = db.env();
        env.extend(self.env());
        env
    }
}

// ---------------------------------------------------------------------------
// Sending the mails reports are about.

/// Lets a daemon send `mails` through `relay` with `extra` settings, waits
/// until every one is `sent`, stops the daemon, and returns their ids.
async fn sent_through(
    db: &TestDb,
    relay: &str,
    extra: &[(String, String)],
    mails: Vec<NewMail>,
) -> Vec<i64> {
    let mut env = daemon_env(db, relay, &[]);
    env.extend(extra.iter().cloned());
    let mut daemon = Daemon::start(env);
    let mut ids = Vec::new();
    for mail in mails {
        ids.push(db.enqueue(mail).await);
    }
    eventually("every mail sent", SENDING, || async {
        let mut all = true;
        for &id in &ids {
            all &= db.row(id).await.status == "sent";
        }
        all
    })
    .await;
    daemon.signal("TERM");
    daemon.wait_exit(Duration::from_secs(30)).await;
    ids
}

/// Sends `mails` with VERP to an smtp-sink and checks that each left with
/// the envelope sender this file computes for it.
async fn sent_with_verp(db: &TestDb, bounce: &Bounce, mails: Vec<NewMail>) -> Vec<i64> {
    let sink = SmtpSink::start(&[]);
    let ids = sent_through(db, &sink.url(), &bounce.env(), mails).await;
    sink.wait_for_mails(ids.len(), SENDING).await;
    let mut senders: Vec<String> = sink.mails().into_iter().map(|m| m.mail_from).collect();
    let mut expected: Vec<String> = ids.iter().map(|&id| verp(id)).collect();
    senders.sort();
    expected.sort();
    assert_eq!(senders, expected, "the envelope senders the relay saw");
    ids
}

async fn message_id(db: &TestDb, id: i64) -> String {
    db.row(id)
        .await
        .message_id
        .expect("a sent mail has its Message-ID")
}

async fn status(db: &TestDb, id: i64) -> String {
    db.row(id).await.status
}

// ---------------------------------------------------------------------------
// Running `tablemail ingest`.

/// `tablemail ingest ARGS < report`: (exit code, stdout, stderr).
fn ingest(env: &[(String, String)], args: &[&str], report: &[u8]) -> (i32, String, String) {
    let mut child = tablemail()
        .arg("ingest")
        .args(args)
        .envs(env.iter().cloned())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tablemail ingest");
    // A command that stops reading early is its business: the exit code says.
    let _ = child.stdin.take().unwrap().write_all(report);
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `ingest` that must exit 0; its stdout.
fn ingest_ok(env: &[(String, String)], args: &[&str], report: &[u8]) -> String {
    let (code, stdout, stderr) = ingest(env, args, report);
    assert_eq!(code, 0, "ingest {args:?}: {stdout}{stderr}");
    stdout
}

/// `tablemail suppress ARGS` on this database: (exit code, stdout, stderr).
fn suppress(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    output(tablemail().arg("suppress").args(args).envs(db.env()))
}

fn suppress_ok(db: &TestDb, args: &[&str]) -> String {
    run_ok(tablemail().arg("suppress").args(args).envs(db.env()))
}

// ---------------------------------------------------------------------------
// What tests look at.

/// `(reason, expires_at is set)` of an address on the suppression list.
async fn suppression(db: &TestDb, address: &str) -> Option<(String, bool)> {
    let reasons = db
        .strings(&format!(
            "SELECT reason FROM mail_suppression WHERE address = '{address}'"
        ))
        .await;
    let reason = reasons.into_iter().next()?;
    let expires = db
        .count_in(
            "mail_suppression",
            &format!("address = '{address}' AND expires_at IS NOT NULL"),
        )
        .await
        == 1;
    Some((reason, expires))
}

/// History rows that reports added to a mail.
async fn report_events(db: &TestDb, id: i64) -> i64 {
    db.count_in(
        "mail_event",
        &format!("mail_id = {id} AND stage = 'report'"),
    )
    .await
}

/// A condition: `expires_at` lies between `from` and `to` days from now,
/// by the database clock.
fn expires_within_days(db: &TestDb, from: i64, to: i64) -> String {
    match db.backend {
        Backend::Postgres => format!(
            "expires_at > now() + interval '{from} days' AND expires_at < now() + interval '{to} days'"
        ),
        Backend::Sqlite => format!(
            "julianday(expires_at) > julianday('now', '+{from} days') \
             AND julianday(expires_at) < julianday('now', '+{to} days')"
        ),
        Backend::Mysql => format!(
            "expires_at > UTC_TIMESTAMP(6) + INTERVAL {from} DAY \
             AND expires_at < UTC_TIMESTAMP(6) + INTERVAL {to} DAY"
        ),
    }
}

// ---------------------------------------------------------------------------
// Reports, written by hand.

/// A delivery status notification (RFC 3464) as a receiving MTA writes it:
/// a human-readable part, the `message/delivery-status` part, and (when
/// `returned` is set) the original message's header section as
/// `text/rfc822-headers`.
#[derive(Clone)]
struct Dsn {
    /// The reporting MTA.
    mta: &'static str,
    /// The report's `To:`: where it was sent (the envelope sender of the
    /// original mail).
    to: String,
    recipient: String,
    action: &'static str,
    status: &'static str,
    diagnostic: String,
    /// `X-Postfix-Queue-ID`: the reporting Postfix's id of the mail.
    queue_id: Option<String>,
    /// The returned header section: its Return-Path and Message-ID.
    returned: Option<(String, Option<String>)>,
}

impl Dsn {
    /// `550 5.1.1 User unknown`: a hard bounce.
    fn user_unknown(recipient: &str) -> Dsn {
        Dsn {
            mta: "mx1.example.org",
            to: "shop@example.com".into(),
            recipient: recipient.into(),
            action: "failed",
            status: "5.1.1",
            diagnostic: format!(
                "smtp; 550 5.1.1 <{recipient}>: Recipient address rejected: User unknown in virtual mailbox table"
            ),
            queue_id: None,
            returned: None,
        }
    }

    /// `452 4.2.2 Mailbox full`, given up after the queue lifetime: a soft
    /// bounce.
    fn mailbox_full(recipient: &str) -> Dsn {
        Dsn {
            action: "failed",
            status: "4.2.2",
            diagnostic: format!(
                "smtp; 452 4.2.2 <{recipient}>: Mailbox full, the user's quota has been exceeded"
            ),
            ..Dsn::user_unknown(recipient)
        }
    }

    /// Sent to this address (the VERP address, when the mail had one).
    fn to(self, to: &str) -> Dsn {
        Dsn {
            to: to.into(),
            ..self
        }
    }

    /// With the original message's header section.
    fn returning(self, return_path: &str, message_id: Option<&str>) -> Dsn {
        Dsn {
            returned: Some((return_path.into(), message_id.map(str::to_string))),
            ..self
        }
    }

    fn queue_id(self, queue_id: &str) -> Dsn {
        Dsn {
            queue_id: Some(queue_id.into()),
            ..self
        }
    }

    fn by(self, mta: &'static str) -> Dsn {
        Dsn { mta, ..self }
    }

    fn render(&self) -> Vec<u8> {
        let Dsn {
            mta,
            to,
            recipient,
            action,
            status,
            diagnostic,
            ..
        } = self;
        let boundary = "7C2A41C01F8.1776157964/mx1";
        let mut per_message = format!("Reporting-MTA: dns; {mta}\n");
        if let Some(queue_id) = &self.queue_id {
            per_message.push_str(&format!("X-Postfix-Queue-ID: {queue_id}\n"));
            per_message.push_str("X-Postfix-Sender: rfc822; shop@example.com\n");
        }
        per_message.push_str("Arrival-Date: Tue, 14 Apr 2026 09:12:41 +0200 (CEST)\n");
        let mut report = format!(
            "Return-Path: <>\n\
             Received: by {mta} (Postfix)\n\
             \tid 7C2A41C01F8; Tue, 14 Apr 2026 09:12:44 +0200 (CEST)\n\
             Date: Tue, 14 Apr 2026 09:12:44 +0200 (CEST)\n\
             From: MAILER-DAEMON@{mta} (Mail Delivery System)\n\
             Subject: Undelivered Mail Returned to Sender\n\
             To: {to}\n\
             Auto-Submitted: auto-replied\n\
             MIME-Version: 1.0\n\
             Content-Type: multipart/report; report-type=delivery-status;\n\
             \tboundary=\"{boundary}\"\n\
             Message-Id: <20260414071244.7C2A41C01F8@{mta}>\n\
             \n\
             This is a MIME-encapsulated message.\n\
             \n\
             --{boundary}\n\
             Content-Description: Notification\n\
             Content-Type: text/plain; charset=us-ascii\n\
             \n\
             This is the mail system at host {mta}.\n\
             \n\
             I'm sorry to have to inform you that your message could not\n\
             be delivered to one or more recipients. It's attached below.\n\
             \n\
             For further assistance, please send mail to postmaster.\n\
             \n\
             \x20                  The mail system\n\
             \n\
             <{recipient}>: host mail.example.org[198.51.100.7] said: {said}\n\
             \n\
             --{boundary}\n\
             Content-Description: Delivery report\n\
             Content-Type: message/delivery-status\n\
             \n\
             {per_message}\
             \n\
             Final-Recipient: rfc822; {recipient}\n\
             Original-Recipient: rfc822;{recipient}\n\
             Action: {action}\n\
             Status: {status}\n\
             Remote-MTA: dns; mail.example.org\n\
             Diagnostic-Code: {diagnostic}\n\
             \n",
            said = diagnostic.trim_start_matches("smtp; "),
        );
        if let Some((return_path, message_id)) = &self.returned {
            report.push_str(&format!(
                "--{boundary}\n\
                 Content-Description: Undelivered Message Headers\n\
                 Content-Type: text/rfc822-headers\n\
                 \n\
                 Return-Path: <{return_path}>\n\
                 Received: from mail.shop.example (mail.shop.example [192.0.2.25])\n\
                 \tby {mta} (Postfix) with ESMTPS id 7C2A41C01F8\n\
                 \tfor <{recipient}>; Tue, 14 Apr 2026 09:12:41 +0200 (CEST)\n\
                 From: Shop <shop@example.com>\n\
                 To: {recipient}\n\
                 Subject: Your order has shipped\n\
                 Date: Tue, 14 Apr 2026 07:12:40 +0000\n"
            ));
            if let Some(id) = message_id {
                report.push_str(&format!("Message-ID: {id}\n"));
            }
            report.push_str("MIME-Version: 1.0\n\n");
        }
        report.push_str(&format!("--{boundary}--\n"));
        report.into_bytes()
    }
}

/// A feedback-loop complaint (RFC 5965): the provider's words, the
/// `message/feedback-report` part, and the reported message's headers with
/// the recipient redacted, as most feedback loops send it.
fn complaint(envelope_sender: &str, message_id: &str) -> Vec<u8> {
    let boundary = "----=_fbl_20260415_1003_2f9c";
    format!(
        "From: Feedback Loop <fbl@mail.example.net>\n\
         Date: Wed, 15 Apr 2026 10:03:11 +0000\n\
         Subject: Complaint about message from 192.0.2.25\n\
         To: fbl-reports@example.com\n\
         Message-ID: <fbl.20260415100311.88412@mail.example.net>\n\
         MIME-Version: 1.0\n\
         Content-Type: multipart/report; report-type=feedback-report;\n\
         \tboundary=\"{boundary}\"\n\
         \n\
         --{boundary}\n\
         Content-Type: text/plain; charset=\"US-ASCII\"\n\
         Content-Transfer-Encoding: 7bit\n\
         \n\
         This is an email abuse report for an email message received from\n\
         IP 192.0.2.25 on Wed, 15 Apr 2026 09:58:02 +0000. A user of this\n\
         service marked it as spam. The recipient's address is redacted.\n\
         \n\
         --{boundary}\n\
         Content-Type: message/feedback-report\n\
         \n\
         Feedback-Type: abuse\n\
         User-Agent: ExampleFBL/2.1\n\
         Version: 1\n\
         Original-Mail-From: <{envelope_sender}>\n\
         Arrival-Date: Wed, 15 Apr 2026 09:58:02 +0000\n\
         Source-IP: 192.0.2.25\n\
         Reported-Domain: example.com\n\
         \n\
         --{boundary}\n\
         Content-Type: text/rfc822-headers\n\
         \n\
         Return-Path: <{envelope_sender}>\n\
         Received: from mail.shop.example (mail.shop.example [192.0.2.25])\n\
         \tby mx.mail.example.net; Wed, 15 Apr 2026 09:58:02 +0000\n\
         From: Shop <shop@example.com>\n\
         To: redacted\n\
         Subject: Spring sale: 20% off everything\n\
         Date: Wed, 15 Apr 2026 09:57:59 +0000\n\
         Message-ID: {message_id}\n\
         MIME-Version: 1.0\n\
         \n\
         --{boundary}--\n"
    )
    .into_bytes()
}

// ---------------------------------------------------------------------------
// The tests.

/// Reports that cannot prove they saw the mail go to the recipient —
/// a forged tag, a real tag with a recipient the mail never had, a made-up
/// or altered Message-ID, no clue at all — are kept as unmatched: no
/// history row, nobody suppressed, the mail stays `sent`. The genuine report
/// does all of that.
async fn forged_reports_change_nothing(db: TestDb) {
    let bounce = Bounce::new();
    let ann = "ann@example.org";
    let ids = sent_with_verp(&db, &bounce, vec![mail(ann, "order 1")]).await;
    let a = ids[0];
    let real_id = message_id(&db, a).await;
    let env = bounce.ingest_env(&db);

    let wrong_tag = {
        let t = if tag(a) == "aaaaaaaaaa" {
            "bbbbbbbbbb"
        } else {
            "aaaaaaaaaa"
        };
        format!("b-{a}-{t}@{BOUNCE_DOMAIN}")
    };
    let (hash, rest) = real_id
        .trim_start_matches('<')
        .split_once('.')
        .expect("<hash.ID@host>");
    let altered_hash: String = hash
        .chars()
        .enumerate()
        .map(|(i, c)| match (i, c) {
            (0, '0') => '1',
            (0, _) => '0',
            (_, c) => c,
        })
        .collect();
    let altered_id = format!("<{altered_hash}.{rest}");
    let never_sent = format!(
        "<{hash}.{}@{}",
        a + 1_000_000,
        rest.split_once('@').unwrap().1
    );

    let forged: Vec<(&str, Vec<String>, Vec<u8>)> = vec![
        (
            "a wrong tag",
            vec!["--rcpt".into(), wrong_tag.clone()],
            Dsn::user_unknown(ann)
                .to(&wrong_tag)
                .returning(&wrong_tag, None)
                .render(),
        ),
        (
            "mail A's tag, a recipient it never had",
            vec!["--rcpt".into(), verp(a)],
            Dsn::user_unknown("mallory@example.com")
                .to(&verp(a))
                .returning(&verp(a), None)
                .render(),
        ),
        (
            "a Message-ID never sent",
            vec![],
            Dsn::user_unknown(ann)
                .returning("shop@example.com", Some(&never_sent))
                .render(),
        ),
        (
            "mail A's Message-ID with its hash altered",
            vec![],
            Dsn::user_unknown(ann)
                .returning("shop@example.com", Some(&altered_id))
                .render(),
        ),
        (
            "no VERP, no Message-ID, no queue id",
            vec![],
            Dsn::user_unknown(ann).render(),
        ),
    ];
    for (n, (what, args, report)) in forged.iter().enumerate() {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ingest_ok(&env, &args, report);
        let recorded = n as i64 + 1;
        assert_eq!(
            db.count_in("mail_feedback", "source = 'ingest' AND NOT matched")
                .await,
            recorded,
            "{what}: recorded as unmatched"
        );
        assert_eq!(
            db.count_in("mail_feedback", "matched").await,
            0,
            "{what}: matched"
        );
        assert_eq!(report_events(&db, a).await, 0, "{what}: a history row");
        assert_eq!(
            db.count_in("mail_suppression", "1 = 1").await,
            0,
            "{what}: someone suppressed"
        );
        assert_eq!(status(&db, a).await, "sent", "{what}");
    }

    // The control: the genuine report, to the real VERP address.
    ingest_ok(
        &env,
        &["--rcpt", &verp(a)],
        &Dsn::user_unknown(ann)
            .to(&verp(a))
            .returning(&verp(a), Some(&real_id))
            .render(),
    );
    assert_eq!(
        db.count_in(
            "mail_feedback",
            &format!("matched AND mail_id = {a} AND recipient = '{ann}' AND kind = 'hard_bounce'")
        )
        .await,
        1
    );
    assert_eq!(
        db.count_in(
            "mail_event",
            &format!(
                "mail_id = {a} AND stage = 'report' AND outcome = 'bounced' AND recipient = '{ann}'"
            )
        )
        .await,
        1
    );
    assert_eq!(
        suppression(&db, ann).await,
        Some(("hard_bounce".into(), false))
    );
    assert_eq!(db.count_in("mail_suppression", "1 = 1").await, 1);
    assert_eq!(status(&db, a).await, "bounced");
}

/// Without a bounce domain the mails leave with the shop's own envelope
/// sender; a bounce still finds its mail by the Message-ID in the returned
/// headers, and a relay's bounce that names only its queue id (the one in
/// its "250 ... queued as" reply) finds it by that. The relay here is a real
/// Postfix, which gives queue ids (smtp-sink does not).
async fn reports_without_verp_are_matched_by_message_id_or_queue_id(db: TestDb) {
    const GOOD_DOMAIN: &str = "ok.test";
    let sink = SmtpSink::start(&[]);
    let Some(postfix) = Postfix::start(
        &[(GOOD_DOMAIN, format!("smtp:[127.0.0.1]:{}", sink.port))],
        "",
    ) else {
        return;
    };
    let (carl, dana) = ("carl@ok.test", "dana@ok.test");
    let ids = sent_through(
        &db,
        &postfix.url(),
        &[],
        vec![mail(carl, "invoice 7"), mail(dana, "invoice 8")],
    )
    .await;
    let (a, b) = (ids[0], ids[1]);
    let env = db.env();

    // By the Message-ID tablemail gave mail A.
    let id_a = message_id(&db, a).await;
    let stdout = ingest_ok(
        &env,
        &["--dry-run"],
        &Dsn::user_unknown(carl)
            .returning("shop@example.com", Some(&id_a))
            .render(),
    );
    assert!(
        stdout.contains(&format!("mail {a} (found by message_id)")),
        "{stdout}"
    );
    ingest_ok(
        &env,
        &[],
        &Dsn::user_unknown(carl)
            .returning("shop@example.com", Some(&id_a))
            .render(),
    );
    assert_eq!(
        db.count_in(
            "mail_feedback",
            &format!("matched AND mail_id = {a} AND recipient = '{carl}'")
        )
        .await,
        1
    );
    assert_eq!(status(&db, a).await, "bounced");
    assert_eq!(
        suppression(&db, carl).await,
        Some(("hard_bounce".into(), false))
    );

    // By Postfix's queue id alone: its bounce returns no headers.
    let replies = db
        .strings(&format!(
            "SELECT relay_reply FROM mail_queue WHERE id = {b}"
        ))
        .await;
    let queue_ids = db
        .strings(&format!(
            "SELECT relay_queue_id FROM mail_queue WHERE id = {b} AND relay_queue_id IS NOT NULL"
        ))
        .await;
    assert_eq!(queue_ids.len(), 1, "relay_reply {replies:?}");
    let queue_id = &queue_ids[0];
    assert!(
        replies[0].contains(&format!("queued as {queue_id}")),
        "{replies:?} {queue_id}"
    );
    let report = Dsn::user_unknown(dana)
        .by("relay.test")
        .queue_id(queue_id)
        .render();
    let stdout = ingest_ok(&env, &["--dry-run"], &report);
    assert!(
        stdout.contains(&format!("mail {b} (found by queue_id)")),
        "{stdout}"
    );
    ingest_ok(&env, &[], &report);
    assert_eq!(
        db.count_in(
            "mail_feedback",
            &format!("matched AND mail_id = {b} AND recipient = '{dana}'")
        )
        .await,
        1
    );
    assert_eq!(
        db.count_in(
            "mail_event",
            &format!("mail_id = {b} AND stage = 'report' AND outcome = 'bounced'")
        )
        .await,
        1
    );
    assert_eq!(status(&db, b).await, "bounced");
    drop(postfix);
}

/// A feedback-loop complaint names the mail by its VERP envelope sender and
/// redacts the recipient: about a mail to one recipient, that recipient
/// complained; the address is suppressed (reason complaint) until removed.
/// With `suppression.complaints = false` the complaint is recorded and the
/// address is still mailed.
async fn a_complaint_suppresses_the_address_unless_told_not_to(db: TestDb) {
    let bounce = Bounce::new();
    let (erin, finn) = ("erin@example.org", "finn@example.org");
    let ids = sent_with_verp(
        &db,
        &bounce,
        vec![mail(erin, "spring sale"), mail(finn, "spring sale")],
    )
    .await;
    let (a, b) = (ids[0], ids[1]);

    let report = complaint(&verp(a), &message_id(&db, a).await);
    let dry = ingest_ok(&bounce.ingest_env(&db), &["--dry-run", "--json"], &report);
    let verdict: serde_json::Value = serde_json::from_str(&dry).expect("JSON");
    assert_eq!(verdict[0]["kind"], "complaint", "{dry}");
    assert_eq!(verdict[0]["recipient"], erin, "{dry}");
    ingest_ok(&bounce.ingest_env(&db), &[], &report);
    assert_eq!(
        db.count_in(
            "mail_feedback",
            &format!("matched AND mail_id = {a} AND kind = 'complaint' AND recipient = '{erin}'")
        )
        .await,
        1
    );
    assert_eq!(
        db.count_in(
            "mail_event",
            &format!(
                "mail_id = {a} AND stage = 'report' AND outcome = 'complained' AND recipient = '{erin}'"
            )
        )
        .await,
        1
    );
    assert_eq!(
        suppression(&db, erin).await,
        Some(("complaint".into(), false))
    );
    assert_eq!(status(&db, a).await, "sent", "a complaint is no bounce");

    let mut env = bounce.ingest_env(&db);
    env.push(("TABLEMAIL__SUPPRESSION__COMPLAINTS".into(), "false".into()));
    ingest_ok(&env, &[], &complaint(&verp(b), &message_id(&db, b).await));
    assert_eq!(
        db.count_in(
            "mail_feedback",
            &format!("matched AND mail_id = {b} AND kind = 'complaint' AND recipient = '{finn}'")
        )
        .await,
        1
    );
    assert_eq!(
        db.count_in(
            "mail_event",
            &format!("mail_id = {b} AND stage = 'report' AND outcome = 'complained'")
        )
        .await,
        1
    );
    assert_eq!(suppression(&db, finn).await, None);
}

/// A full mailbox is temporary: two reports leave the address alone, the
/// third within the week suppresses it for a week (by the database clock),
/// and a hard bounce after that suppresses it for good.
async fn three_soft_bounces_suppress_for_a_while(db: TestDb) {
    let bounce = Bounce::new();
    let gus = "gus@example.net";
    let ids = sent_with_verp(
        &db,
        &bounce,
        (1..=4)
            .map(|n| mail(gus, &format!("newsletter {n}")))
            .collect(),
    )
    .await;
    let env = bounce.ingest_env(&db);
    let full = |id: i64| Dsn::mailbox_full(gus).to(&verp(id)).render();

    for &id in &ids[..2] {
        ingest_ok(&env, &["--rcpt", &verp(id)], &full(id));
        assert_eq!(
            suppression(&db, gus).await,
            None,
            "after mail {id}'s report"
        );
    }
    ingest_ok(&env, &["--rcpt", &verp(ids[2])], &full(ids[2]));
    assert_eq!(
        suppression(&db, gus).await,
        Some(("soft_bounce".into(), true))
    );
    assert_eq!(
        db.count_in(
            "mail_suppression",
            &format!("address = '{gus}' AND {}", expires_within_days(&db, 6, 8))
        )
        .await,
        1,
        "suppressed for soft_bounce_ttl (7d) from now"
    );
    assert_eq!(
        db.count_in(
            "mail_event",
            &format!("stage = 'report' AND outcome = 'soft_bounced' AND recipient = '{gus}'")
        )
        .await,
        3
    );
    for &id in &ids[..3] {
        assert_eq!(
            status(&db, id).await,
            "sent",
            "a soft bounce bounces no mail"
        );
    }

    let last = ids[3];
    ingest_ok(
        &env,
        &["--rcpt", &verp(last)],
        &Dsn::user_unknown(gus).to(&verp(last)).render(),
    );
    assert_eq!(
        suppression(&db, gus).await,
        Some(("hard_bounce".into(), false)),
        "made permanent"
    );
    assert_eq!(status(&db, last).await, "bounced");
}

/// A mail to two people is `bounced` only once both addresses bounced;
/// until then it stays `sent`, with the one address suppressed.
async fn a_mail_is_bounced_once_every_recipient_bounced(db: TestDb) {
    let bounce = Bounce::new();
    let (hana, ivan) = ("hana@example.org", "ivan@example.com");
    let ids = sent_with_verp(
        &db,
        &bounce,
        vec![NewMail {
            cc: Some(ivan.into()),
            ..mail(hana, "meeting notes")
        }],
    )
    .await;
    let a = ids[0];
    let env = bounce.ingest_env(&db);
    let bounced_at_set = format!("id = {a} AND bounced_at IS NOT NULL");

    ingest_ok(
        &env,
        &["--rcpt", &verp(a)],
        &Dsn::user_unknown(hana).to(&verp(a)).render(),
    );
    assert_eq!(status(&db, a).await, "sent");
    assert_eq!(db.count(&bounced_at_set).await, 0);
    assert_eq!(
        suppression(&db, hana).await,
        Some(("hard_bounce".into(), false))
    );
    assert_eq!(suppression(&db, ivan).await, None);

    ingest_ok(
        &env,
        &["--rcpt", &verp(a)],
        &Dsn::user_unknown(ivan)
            .by("mx.example.com")
            .to(&verp(a))
            .render(),
    );
    assert_eq!(status(&db, a).await, "bounced");
    assert_eq!(db.count(&bounced_at_set).await, 1);
    assert_eq!(
        suppression(&db, ivan).await,
        Some(("hard_bounce".into(), false))
    );
    assert_eq!(report_events(&db, a).await, 2);
}

/// `ingest --dry-run --json` prints what a report says and whether it would
/// act — and records nothing at all.
async fn a_dry_run_tells_and_records_nothing(db: TestDb) {
    let bounce = Bounce::new();
    let jo = "jo@example.org";
    let ids = sent_with_verp(&db, &bounce, vec![mail(jo, "welcome")]).await;
    let a = ids[0];
    let env = bounce.ingest_env(&db);

    let stdout = ingest_ok(
        &env,
        &["--dry-run", "--json", "--rcpt", &verp(a)],
        &Dsn::user_unknown(jo).to(&verp(a)).render(),
    );
    let items: Vec<serde_json::Value> = serde_json::from_str(&stdout).expect("a JSON array");
    assert_eq!(items.len(), 1, "{stdout}");
    let item = &items[0];
    assert_eq!(item["recipient"], jo, "{stdout}");
    assert_eq!(item["kind"], "hard_bounce", "{stdout}");
    assert_eq!(item["status"], "5.1.1", "{stdout}");
    assert_eq!(item["mail_id"], a, "{stdout}");
    assert_eq!(item["matched"], true, "{stdout}");
    assert!(
        item["diagnostic"]
            .as_str()
            .is_some_and(|d| d.contains("User unknown")),
        "{stdout}"
    );

    // One that does not prove anything: unmatched, no mail named.
    let stdout = ingest_ok(
        &env,
        &["--dry-run", "--json", "--rcpt", &verp(a)],
        &Dsn::user_unknown("kai@example.org").to(&verp(a)).render(),
    );
    let items: Vec<serde_json::Value> = serde_json::from_str(&stdout).expect("a JSON array");
    assert_eq!(items.len(), 1, "{stdout}");
    assert_eq!(items[0]["matched"], false, "{stdout}");
    assert!(items[0]["mail_id"].is_null(), "{stdout}");

    assert_eq!(db.count_in("mail_feedback", "1 = 1").await, 0);
    assert_eq!(report_events(&db, a).await, 0);
    assert_eq!(db.count_in("mail_suppression", "1 = 1").await, 0);
    assert_eq!(status(&db, a).await, "sent");
}

/// Bytes that are no mail at all still exit 0 (a bounce never bounces) and
/// are kept as one unmatched report of kind unknown.
async fn garbage_is_recorded_as_one_unmatched_report(db: TestDb) {
    let bounce = Bounce::new();
    let garbage: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    ingest_ok(&bounce.ingest_env(&db), &[], &garbage);
    assert_eq!(db.count_in("mail_feedback", "1 = 1").await, 1);
    assert_eq!(
        db.count_in(
            "mail_feedback",
            "source = 'ingest' AND kind = 'unknown' AND NOT matched \
             AND mail_id IS NULL AND recipient IS NULL AND size = 4096"
        )
        .await,
        1
    );
}

/// While the database cannot be reached, `ingest` exits 75 (EX_TEMPFAIL):
/// the mail system keeps the report and tries again later. A configuration
/// it cannot work with exits 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_exits_75_while_the_database_is_away() {
    let bounce = Bounce::new();
    let report = Dsn::user_unknown("ann@example.org").to(&verp(1)).render();
    let closed = free_port();
    for url in [
        format!("postgres://root@127.0.0.1:{closed}/tablemail"),
        format!("mysql://root@127.0.0.1:{closed}/tablemail"),
    ] {
        let mut env = vec![("TABLEMAIL__DATABASE__URL".to_string(), url.clone())];
        env.extend(bounce.env());
        let started = Instant::now();
        let (code, stdout, stderr) = ingest(&env, &["--rcpt", &verp(1)], &report);
        assert_eq!(code, 75, "{url}: {stdout}{stderr}");
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{url}: {:?}",
            started.elapsed()
        );
    }

    // A secret too short to be a key: the configuration is wrong.
    let dir = TempDir::new();
    let short = dir.path().join("short-secret");
    std::fs::write(&short, "tiny\n").unwrap();
    let env = vec![
        (
            "TABLEMAIL__DATABASE__URL".to_string(),
            format!("sqlite://{}", dir.path().join("t.db").display()),
        ),
        ("TABLEMAIL__BOUNCE__DOMAIN".into(), BOUNCE_DOMAIN.into()),
        (
            "TABLEMAIL__BOUNCE__SECRET_FILE".into(),
            short.display().to_string(),
        ),
    ];
    let (code, stdout, stderr) = ingest(&env, &[], &report);
    assert_eq!(code, 2, "{stdout}{stderr}");
}

/// The list by hand: addresses are kept lower-cased with IDN domains as
/// A-labels; list, search, filter by reason, remove, a limited entry, and
/// an export that imports into another database as it was. A wrong address
/// or reason is refused (exit 2) and adds nothing.
async fn the_suppression_list_by_hand(db: TestDb) {
    let dora = "dora@xn--bcher-kva.example";
    assert_eq!(
        suppress_ok(&db, &["add", "Dora@Bücher.example", "Eve@Example.COM"]).trim(),
        "2 addresses suppressed"
    );
    suppress_ok(
        &db,
        &[
            "add",
            "--reason",
            "complaint",
            "--detail",
            "ticket 4711",
            "frank@example.net",
        ],
    );
    suppress_ok(&db, &["add", "--expires", "30d", "gina@example.org"]);

    let text = suppress_ok(&db, &["list"]);
    let lines: Vec<&str> = text.lines().collect();
    let addresses: Vec<&str> = lines
        .iter()
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(
        addresses,
        [
            dora,
            "eve@example.com",
            "frank@example.net",
            "gina@example.org"
        ],
        "{text}"
    );
    assert!(lines[0].contains("manual"), "{text}");
    assert!(lines[2].contains("complaint"), "{text}");
    assert!(lines[3].contains("until "), "{text}");
    assert!(!lines[0].contains("until "), "{text}");

    let json = suppress_ok(&db, &["list", "--json"]);
    let entries: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert_eq!(entries.len(), 4, "{json}");
    assert_eq!(entries[0]["address"], dora);
    assert_eq!(entries[0]["reason"], "manual");
    assert!(entries[0]["expires_at"].is_null(), "{json}");
    assert_eq!(entries[2]["reason"], "complaint");
    assert_eq!(entries[2]["detail"], "ticket 4711");
    assert!(entries[3]["expires_at"].is_string(), "{json}");
    assert_eq!(
        db.count_in(
            "mail_suppression",
            &format!(
                "address = 'gina@example.org' AND {}",
                expires_within_days(&db, 29, 31)
            )
        )
        .await,
        1,
        "--expires 30d"
    );

    let found = |args: &[&str]| {
        suppress_ok(&db, args)
            .lines()
            .map(|l| l.split_whitespace().next().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        found(&["list", "--reason", "complaint"]),
        ["frank@example.net"]
    );

    assert_eq!(
        suppress_ok(&db, &["remove", "EVE@example.com"]).trim(),
        "1 addresses removed"
    );
    assert_eq!(
        found(&["list"]),
        [dora, "frank@example.net", "gina@example.org"]
    );

    // Export, then import into a database of its own.
    let csv = suppress_ok(&db, &["export"]);
    let mut rows = csv.lines();
    assert_eq!(rows.next(), Some("address,reason,created_at,expires_at"));
    assert_eq!(rows.count(), 3, "{csv}");
    let dir = TempDir::new();
    let file = dir.path().join("suppressed.csv");
    std::fs::write(&file, &csv).unwrap();
    let fresh = match db.backend {
        Backend::Postgres => TestDb::postgres().await,
        Backend::Sqlite => TestDb::sqlite().await,
        Backend::Mysql => TestDb::mysql().await,
    }
    .expect("a second database on the same server");
    assert_eq!(
        suppress_ok(&fresh, &["import", file.to_str().unwrap()]).trim(),
        "3 addresses imported"
    );
    let listed = |db: &TestDb| {
        suppress_ok(db, &["list", "--json"])
            .lines()
            .map(|l| {
                let e: serde_json::Value = serde_json::from_str(l).unwrap();
                (
                    e["address"].as_str().unwrap().to_string(),
                    e["reason"].as_str().unwrap().to_string(),
                    e["expires_at"].is_string(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(listed(&fresh), listed(&db));

    // Refused whole: nothing of the command is added.
    for args in [
        &["add", "ok@example.com", "not an address"][..],
        &["add", "--reason", "spam", "ok@example.com"][..],
    ] {
        let (code, stdout, stderr) = suppress(&db, args);
        assert_eq!(code, 2, "{args:?}: {stdout}{stderr}");
        assert_eq!(
            db.count_in("mail_suppression", "address = 'ok@example.com'")
                .await,
            0,
            "{args:?}"
        );
    }
    assert_eq!(db.count_in("mail_suppression", "1 = 1").await, 3);

    // Search: a plain substring, case-insensitive, of the stored form.
    assert_eq!(found(&["list", "--search", "xn--bcher"]), [dora]);
    assert_eq!(
        found(&["list", "--search", "EXAMPLE.ORG"]),
        ["gina@example.org"]
    );
}

// ---------------------------------------------------------------------------
// The inbound listener.

/// A bare SMTP client, as a remote MTA returning a report speaks.
struct SmtpClient {
    reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
}

/// The longest wait for one reply.
const REPLY: Duration = Duration::from_secs(30);

impl SmtpClient {
    /// Connects and reads the greeting.
    async fn connect(port: u16) -> SmtpClient {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect to the listener");
        let (read, writer) = stream.into_split();
        let mut client = SmtpClient {
            reader: BufReader::new(read),
            writer,
        };
        let greeting = client.reply().await;
        assert!(greeting.starts_with("220"), "{greeting}");
        client
    }

    /// The next reply, all its lines.
    async fn reply(&mut self) -> String {
        let mut all = String::new();
        loop {
            let mut line = String::new();
            let n = tokio::time::timeout(REPLY, self.reader.read_line(&mut line))
                .await
                .expect("a reply in time")
                .expect("read a reply");
            assert!(n > 0, "connection closed after {all:?}");
            all.push_str(&line);
            if line.as_bytes().get(3) != Some(&b'-') {
                return all;
            }
        }
    }

    async fn command(&mut self, line: &str) -> String {
        self.writer
            .write_all(format!("{line}\r\n").as_bytes())
            .await
            .unwrap();
        self.reply().await
    }

    /// EHLO, MAIL FROM:<> (the null sender of reports), RCPT TO:<rcpt>.
    async fn envelope(&mut self, rcpt: &str) -> String {
        let ehlo = self.command("EHLO mx1.example.org").await;
        assert!(ehlo.starts_with("250"), "{ehlo}");
        let mail = self.command("MAIL FROM:<>").await;
        assert!(mail.starts_with("250"), "{mail}");
        self.command(&format!("RCPT TO:<{rcpt}>")).await
    }

    /// DATA, the message (CRLF line ends, dot-stuffed) and the final dot:
    /// the reply to the dot.
    async fn data(&mut self, message: &[u8]) -> String {
        let go = self.command("DATA").await;
        assert!(go.starts_with("354"), "{go}");
        let text = String::from_utf8(message.to_vec()).unwrap();
        let mut wire = String::new();
        for line in text.lines() {
            if line.starts_with('.') {
                wire.push('.');
            }
            wire.push_str(line);
            wire.push_str("\r\n");
        }
        wire.push_str(".\r\n");
        self.writer.write_all(wire.as_bytes()).await.unwrap();
        self.reply().await
    }

    async fn quit(mut self) {
        let _ = self.command("QUIT").await;
    }
}

/// One session that delivers `report` to `rcpt`: the reply to the dot.
async fn deliver_report(port: u16, rcpt: &str, report: &[u8]) -> String {
    let mut client = SmtpClient::connect(port).await;
    let reply = client.envelope(rcpt).await;
    assert!(reply.starts_with("250"), "RCPT TO:<{rcpt}>: {reply}");
    let reply = client.data(report).await;
    client.quit().await;
    reply
}

fn url_port(url: &str) -> u16 {
    let authority = url.split("://").nth(1).unwrap().split('/').next().unwrap();
    authority.rsplit(':').next().unwrap().parse().unwrap()
}

/// The daemon's own listener for the bounce domain: mail for anyone else is
/// refused (550, never relayed); a report gets 250 once it is recorded;
/// while the database is unreachable the sender is told 451 (try again)
/// within seconds, and the same report is taken once the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_takes_reports_and_asks_to_retry_while_the_database_is_away() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let bounce = Bounce::new();
    let sink = SmtpSink::start(&[]);
    let pg_port = url_port(&db.url);
    let db_proxy = Proxy::start(pg_port).await;
    let proxied = db
        .url
        .replacen(&format!(":{pg_port}/"), &format!(":{}/", db_proxy.port), 1);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut env = daemon_env(
        &db,
        &sink.url(),
        &[
            ("TABLEMAIL__INBOUND__LISTEN", &listen),
            ("TABLEMAIL__DATABASE__STATEMENT_TIMEOUT", "2s"),
        ],
    );
    env.extend(bounce.env());
    env.push(("TABLEMAIL__DATABASE__URL".into(), proxied));
    let daemon = Daemon::start(env);

    let (kim, lee) = ("kim@example.org", "lee@example.org");
    let a = db.enqueue(mail(kim, "your receipt")).await;
    let b = db.enqueue(mail(lee, "your receipt")).await;
    eventually("both mails sent", SENDING, || async {
        status(&db, a).await == "sent" && status(&db, b).await == "sent"
    })
    .await;
    eventually("the listener is up", Duration::from_secs(20), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;

    // Not a relay: only the bounce domain is taken.
    let mut client = SmtpClient::connect(port).await;
    let reply = client.envelope("someone@example.com").await;
    assert!(reply.starts_with("550"), "{reply}");
    client.quit().await;

    // A report for mail A: 250 means recorded, at once.
    let reply = deliver_report(
        port,
        &verp(a),
        &Dsn::user_unknown(kim).to(&verp(a)).render(),
    )
    .await;
    assert!(reply.starts_with("250"), "{reply}\n{}", daemon.tail(20));
    assert_eq!(
        db.count_in(
            "mail_feedback",
            &format!("source = 'smtp' AND matched AND mail_id = {a} AND recipient = '{kim}'")
        )
        .await,
        1
    );
    assert_eq!(status(&db, a).await, "bounced");

    // The database unreachable: the sender is asked to come back.
    let report_b = Dsn::user_unknown(lee).to(&verp(b)).render();
    db_proxy.set_down(true);
    let started = Instant::now();
    let reply = deliver_report(port, &verp(b), &report_b).await;
    assert!(reply.starts_with("451"), "{reply}\n{}", daemon.tail(20));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "451 after {:?}",
        started.elapsed()
    );
    assert_eq!(
        db.count_in("mail_feedback", &format!("mail_id = {b}"))
            .await,
        0
    );

    // Back: the same report is taken, once.
    db_proxy.set_down(false);
    let reply = deliver_report(port, &verp(b), &report_b).await;
    assert!(reply.starts_with("250"), "{reply}\n{}", daemon.tail(20));
    assert_eq!(
        db.count_in(
            "mail_feedback",
            &format!("source = 'smtp' AND matched AND mail_id = {b}")
        )
        .await,
        1
    );
    assert_eq!(status(&db, b).await, "bounced");
    assert_eq!(
        suppression(&db, lee).await,
        Some(("hard_bounce".into(), false))
    );
    drop(daemon);
}
