//! The delivery loop (DESIGN §12) against a real Postfix: the daemon sends
//! through a private Postfix instance, which accepts a mail for a user that
//! does not exist, bounces it later, and sends its delivery status
//! notification to the VERP address, routed by `transport_maps` back to the
//! daemon's inbound listener (or, in the pipe test, to `tablemail ingest`).
//! What is asserted is what a user sees: the row's status, the suppression
//! list, the history, and what reached Postfix and the final receiver.

mod support;

use std::time::Duration;

use support::{postfix::Postfix, *};
use tablemail::store::NewMail;

const BOUNCE_DOMAIN: &str = "bounce.test";
/// A domain Postfix relays to a receiver that takes everything.
const GOOD_DOMAIN: &str = "ok.test";
const DEAD: &str = "gone@deadend.test";

fn secret(dir: &TempDir) -> String {
    let path = dir.path().join("bounce-secret");
    std::fs::write(&path, "a bounce secret of the test, long enough\n").unwrap();
    path.display().to_string()
}

async fn id_by_dedupe(db: &TestDb, key: &str) -> i64 {
    db.scalar_i64(&format!(
        "SELECT id FROM mail_queue WHERE dedupe_key = '{key}'"
    ))
    .await
}

async fn suppression(db: &TestDb, address: &str) -> Vec<String> {
    db.strings(&format!(
        "SELECT reason FROM mail_suppression WHERE address = '{address}'"
    ))
    .await
}

fn to(address: &str, key: &str) -> NewMail {
    NewMail {
        dedupe_key: Some(key.into()),
        ..mail(address, key)
    }
}

/// A bounce from Postfix marks the mail `bounced` and suppresses the
/// address; the next mail leaves it out of its envelope (the other
/// recipient still gets it), a mail to it alone ends `suppressed` without
/// reaching Postfix or spending an attempt, and a mail that bypasses the
/// list goes out.
async fn a_bounce_from_postfix_suppresses_the_address(db: TestDb) {
    let sink = SmtpSink::start(&[]);
    let listener = free_port();
    let Some(postfix) = Postfix::start(
        &[
            (BOUNCE_DOMAIN, format!("smtp:[127.0.0.1]:{listener}")),
            (GOOD_DOMAIN, format!("smtp:[127.0.0.1]:{}", sink.port)),
        ],
        "",
    ) else {
        return;
    };
    let dir = TempDir::new();
    let secret = secret(&dir);
    let listen = format!("127.0.0.1:{listener}");
    let daemon = Daemon::start(daemon_env(
        &db,
        &postfix.url(),
        &[
            ("TABLEMAIL__BOUNCE__DOMAIN", BOUNCE_DOMAIN),
            ("TABLEMAIL__BOUNCE__SECRET_FILE", &secret),
            ("TABLEMAIL__INBOUND__LISTEN", &listen),
        ],
    ));

    db.enqueue(to(DEAD, "first")).await;
    let first = id_by_dedupe(&db, "first").await;
    eventually("the bounce recorded", Duration::from_secs(60), || async {
        db.row(first).await.status == "bounced"
    })
    .await;
    // What went out: the VERP envelope sender, the From header unchanged.
    let from_line = postfix
        .log()
        .lines()
        .find(|l| l.contains(&format!("from=<b-{first}-")))
        .map(str::to_string);
    assert!(
        from_line.is_some_and(|l| l.contains(&format!("@{BOUNCE_DOMAIN}>"))),
        "the envelope sender of mail {first}: {}",
        postfix.log()
    );
    assert_eq!(suppression(&db, DEAD).await, ["hard_bounce"]);
    assert_eq!(
        db.count(&format!(
            "id = {first} AND bounced_at IS NOT NULL AND processed_at IS NOT NULL"
        ))
        .await,
        1
    );
    let events = db
        .strings(&format!(
            "SELECT outcome || ' ' || recipient || ' ' || detail FROM mail_event WHERE mail_id = {first}"
        ))
        .await;
    assert!(
        events.len() == 1 && events[0].starts_with(&format!("bounced {DEAD} 5.1.1")),
        "{events:?}"
    );
    assert_eq!(
        db.count_in(
            "mail_feedback",
            &format!(
                "mail_id = {first} AND matched AND source = 'smtp' AND kind = 'hard_bounce' \
                 AND status = '5.1.1' AND recipient = '{DEAD}'"
            )
        )
        .await,
        1
    );
    daemon
        .wait_for_log("report recorded", Duration::from_secs(5))
        .await;

    // The same address again, written otherwise, beside a good one.
    db.enqueue(NewMail {
        cc: Some(format!("ann@{GOOD_DOMAIN}")),
        ..to("Gone@DEADEND.test", "second")
    })
    .await;
    let second = id_by_dedupe(&db, "second").await;
    eventually("the second mail sent", Duration::from_secs(30), || async {
        db.row(second).await.status == "sent"
    })
    .await;
    sink.wait_for_mails(1, Duration::from_secs(30)).await;
    let received = sink.mails();
    // Postfix adds its ORCPT parameter to what the sink records.
    let rcpts = &received[0].rcpt_tos;
    assert!(
        rcpts.len() == 1 && rcpts[0].starts_with(&format!("ann@{GOOD_DOMAIN}>")),
        "{rcpts:?}"
    );
    assert_eq!(
        db.strings(&format!(
            "SELECT recipient FROM mail_event WHERE mail_id = {second} AND outcome = 'suppressed'"
        ))
        .await,
        [DEAD]
    );

    // To the suppressed address alone: never sent, nothing spent.
    db.enqueue(to(DEAD, "third")).await;
    let third = id_by_dedupe(&db, "third").await;
    eventually(
        "the third mail suppressed",
        Duration::from_secs(30),
        || async { db.row(third).await.status == "suppressed" },
    )
    .await;
    let row = db.row(third).await;
    assert_eq!((row.attempts, row.attempts_remaining), (0, 5), "{row:?}");
    assert!(!row.locked && row.processed, "{row:?}");
    let third_message_id = row.message_id.expect("assigned at its claim");
    assert!(
        !postfix.log().contains(&third_message_id),
        "mail {third} reached Postfix: {}",
        postfix.log()
    );
    // One delivery attempt to the dead address so far: the first mail's.
    assert_eq!(postfix.deliveries_to(DEAD).len(), 1, "{}", postfix.log());

    // A password reset the user asked for goes regardless.
    db.enqueue(NewMail {
        bypass_suppression: Some(true),
        ..to(DEAD, "fourth")
    })
    .await;
    let fourth = id_by_dedupe(&db, "fourth").await;
    eventually("the fourth mail sent", Duration::from_secs(30), || async {
        let row = db.row(fourth).await;
        ["sent", "bounced"].contains(&row.status.as_str())
    })
    .await;
    eventually("Postfix saw it", Duration::from_secs(30), || async {
        postfix.deliveries_to(DEAD).len() == 2
    })
    .await;
    drop(daemon);
}

for_each_backend!(a_bounce_from_postfix_suppresses_the_address);

/// Postfix's `pipe` transport, as the README shows it: the report goes to
/// `tablemail ingest --rcpt ${original_recipient}` run as an unprivileged
/// user, which records it; the daemon has no listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postfix_pipe_transport_runs_ingest() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let dir = TempDir::new();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let secret_path = secret(&dir);
    let config = dir.path().join("tablemail.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{}\"\n[bounce]\ndomain = \"{BOUNCE_DOMAIN}\"\nsecret_file = \"{secret_path}\"\n[log]\nformat = \"json\"\n",
            db.url
        ),
    )
    .unwrap();
    for file in [&config, &dir.path().join("bounce-secret")] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let bin = std::env::var("TABLEMAIL_TEST_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_tablemail").to_string());
    let master = format!(
        "tablemail unix - n n - - pipe\n  flags=Rq user=nobody argv={bin} --config {} ingest --rcpt ${{original_recipient}}\n",
        config.display()
    );
    let Some(postfix) = Postfix::start(&[(BOUNCE_DOMAIN, "tablemail:".into())], &master) else {
        return;
    };
    let daemon = Daemon::start(daemon_env(
        &db,
        &postfix.url(),
        &[
            ("TABLEMAIL__BOUNCE__DOMAIN", BOUNCE_DOMAIN),
            ("TABLEMAIL__BOUNCE__SECRET_FILE", &secret_path),
        ],
    ));
    db.enqueue(to(DEAD, "piped")).await;
    let id = id_by_dedupe(&db, "piped").await;
    eventually(
        "the piped bounce recorded",
        Duration::from_secs(60),
        || async { db.row(id).await.status == "bounced" },
    )
    .await;
    assert_eq!(suppression(&db, DEAD).await, ["hard_bounce"]);
    assert_eq!(
        db.count_in("mail_feedback", "source = 'ingest' AND matched")
            .await,
        1
    );
    // Postfix logs the pipe's delivery once `ingest` has exited, after
    // its commit.
    eventually(
        "Postfix's delivery to ingest",
        Duration::from_secs(30),
        || async {
            postfix
                .log()
                .lines()
                .any(|l| l.contains("relay=tablemail") && l.contains("status=sent"))
        },
    )
    .await;
    drop(daemon);
}
