//! Relays of 2026 (DESIGN §13), against the daemon binary and real
//! components: OAuth2 (SASL XOAUTH2) with short-lived tokens from a token
//! endpoint that refuses and comes back; STARTTLS by default to a relay that
//! is not on this host (a network namespace of the test's own), with
//! certificates from a CA the test makes; routes per sender domain through
//! relays of their own, every signature checked by dkimpy as a receiver
//! would; Feedback-ID signed.

mod support;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Duration,
};

use support::{
    dkim::{dkim_tags, dkim_verdict, DkimKey},
    netns::NetNs,
    *,
};
use tablemail::store::NewMail;

for_each_backend!(
    xoauth2_tokens_are_renewed_through_a_drain_and_a_refusing_endpoint_burns_nothing,
    each_route_sends_through_its_relay_signed_by_the_most_specific_key,
);

/// How often each Message-ID reached a relay.
fn tally(mails: &[Received]) -> HashMap<String, usize> {
    let mut seen = HashMap::new();
    for m in mails {
        *seen
            .entry(m.header("Message-ID").expect("a Message-ID"))
            .or_default() += 1;
    }
    seen
}

fn subjects(mails: &[Received]) -> Vec<String> {
    let mut subjects: Vec<String> = mails
        .iter()
        .map(|m| m.header("Subject").unwrap_or_default())
        .collect();
    subjects.sort();
    subjects
}

fn now_unix() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("tablemail.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `tablemail --config FILE <args>` with `env`: (exit code, stdout, stderr).
fn command(config: &Path, env: &[(String, String)], args: &[&str]) -> (i32, String, String) {
    output(
        tablemail()
            .arg("--config")
            .arg(config)
            .args(args)
            .envs(env.iter().cloned()),
    )
}

/// /healthz: (status, body); (0, "") while nothing answers.
fn healthz(port: u16) -> (u16, String) {
    http::try_get(port, "/healthz", None)
        .map(|r| (r.status, r.body))
        .unwrap_or((0, String::new()))
}

/// `attempts_remaining` of a row nobody touched yet: what "unspent" is.
async fn fresh_attempts(db: &TestDb) -> i32 {
    let id = db.enqueue(mail("probe@example.net", "probe")).await;
    let fresh = db.row(id).await.attempts_remaining;
    db.exec(&format!("DELETE FROM mail_queue WHERE id = {id}"))
        .await;
    fresh
}

/// Rows that must wait: back to queued (a try in flight is written back
/// refunded), never counted, nothing spent.
async fn assert_waiting_unspent(db: &TestDb, ids: &[i64], fresh: i32, why: &str) {
    let unspent = |row: &RowState| {
        row.status == "queued" && row.attempts == 0 && row.attempts_remaining == fresh
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let rows: Vec<RowState> = db
            .rows()
            .await
            .into_iter()
            .filter(|r| ids.contains(&r.id))
            .collect();
        assert_eq!(rows.len(), ids.len());
        if rows.iter().all(unspent) {
            return;
        }
        let spent: Vec<&RowState> = rows
            .iter()
            .filter(|r| r.attempts_remaining < fresh && r.status != "sending")
            .collect();
        assert!(spent.is_empty(), "{why}: rows spent: {spent:?}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "{why}: rows should wait unspent: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Mails to send in the OAuth2 drain, and its pace: 20 a second makes it
/// last 15 seconds, three lifetimes of a token.
const DRAIN: usize = 300;
const DRAIN_RATE: &str = "20";
/// The token endpoint's tokens live this long (seconds).
const TOKEN_LIFE: f64 = 5.0;
const CLIENT_SECRET: &str = "app-secret-4242";

/// XOAUTH2 (DESIGN §13) against a relay that offers nothing else and takes
/// only a live token from its endpoint, behind STARTTLS with a certificate
/// the daemon verifies: tokens of 5 seconds renewed in the background
/// through a 15-second drain, sessions logging in again as their token
/// ends; then the endpoint refuses (mails wait unspent, `check` names the
/// token) and comes back (all delivered, none twice, no attempt spent).
async fn xoauth2_tokens_are_renewed_through_a_drain_and_a_refusing_endpoint_burns_nothing(
    db: TestDb,
) {
    let fresh = fresh_attempts(&db).await;
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "oauth");
    let (cert, key) = ca.issue("relay", "IP:127.0.0.1");
    let refuse = dir.path().join("endpoint-refuses");
    let relay = SmtpServer::start(&[
        "--xoauth2",
        &TOKEN_LIFE.to_string(),
        "--auth",
        "sender@example.com:-",
        "--xoauth2-client",
        &format!("tablemail-app:{CLIENT_SECRET}"),
        "--token-refuse-file",
        refuse.to_str().unwrap(),
        "--tls",
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
    ]);
    let secret = dir.path().join("client_secret");
    std::fs::write(&secret, format!("{CLIENT_SECRET}\n")).unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "[transport]\nusername = \"sender@example.com\"\nprobe_interval = \"1s\"\n\
             [transport.oauth2]\nprovider = \"microsoft\"\ntenant_id = \"contoso.example\"\n\
             client_id = \"tablemail-app\"\nclient_secret_file = \"{}\"\ntoken_url = \"{}\"\n\
             [worker]\nrate_limit = {DRAIN_RATE}\n",
            secret.display(),
            relay.token_url.as_deref().expect("a token endpoint"),
        ),
    );
    let metrics = free_port();
    let listen = format!("127.0.0.1:{metrics}");
    let url = format!("smtp://127.0.0.1:{}?tls=required", relay.port);
    let mut env = daemon_env(&db, &url, &[("TABLEMAIL__METRICS__LISTEN", &listen)]);
    // The relay's certificate is verified against the test's CA.
    env.push(("SSL_CERT_FILE".into(), ca.cert.display().to_string()));

    let (code, out, err) = command(&config, &env, &["check"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("oauth2: microsoft token obtained") && out.contains("valid for 5s"),
        "{out}"
    );

    let drain: Vec<NewMail> = (0..DRAIN)
        .map(|i| mail(&format!("r{i}@example.net"), &format!("drain {i}")))
        .collect();
    db.store.enqueue(&drain).await.expect("enqueue");
    let mut daemon = Daemon::start_config(&config, env.clone());
    eventually("the drain delivered", Duration::from_secs(60), || async {
        relay.received().len() >= DRAIN
    })
    .await;
    let got = relay.received();
    let seen = tally(&got);
    assert_eq!(seen.len(), DRAIN, "every mail arrived");
    assert!(seen.values().all(|&n| n == 1), "none twice: {seen:?}");
    let times: Vec<f64> = got.iter().filter_map(|m| m.received_at).collect();
    let span = times.iter().cloned().fold(f64::MIN, f64::max)
        - times.iter().cloned().fold(f64::MAX, f64::min);
    assert!(
        span > 2.0 * TOKEN_LIFE,
        "the drain outlived two tokens: {span:.1}s"
    );
    let auths = relay.auths();
    assert!(auths.iter().all(|a| a.mechanism == "XOAUTH2" && a.tls));
    // Renewed in the background, never late: no login was refused.
    let refused: Vec<_> = auths.iter().filter(|a| a.ok != Some(true)).collect();
    assert!(refused.is_empty(), "logins refused: {refused:?}");
    let used: std::collections::HashSet<_> = auths.iter().filter_map(|a| a.token.clone()).collect();
    assert!(
        used.len() >= 3,
        "sessions logged in again with renewed tokens: {} tokens in {} logins",
        used.len(),
        auths.len()
    );
    assert!(auths
        .iter()
        .all(|a| a.login.as_deref() == Some("sender@example.com")));
    eprintln!(
        "{}: drain of {DRAIN} mails over {span:.1}s: {} logins with {} tokens",
        db.backend,
        auths.len(),
        used.len()
    );

    // The endpoint refuses. Once the last token it issued has run out, the
    // daemon has none: mails inserted now wait, unspent.
    std::fs::write(&refuse, "").unwrap();
    eventually(
        "the last token issued has expired",
        Duration::from_secs(15),
        || async {
            let last = relay.tokens_issued().last().map_or(0.0, |t| t.issued_at);
            now_unix() > last + TOKEN_LIFE + 0.3
        },
    )
    .await;
    let mut waiting = Vec::new();
    for i in 0..20 {
        waiting.push(
            db.enqueue(mail(&format!("w{i}@example.net"), &format!("waits {i}")))
                .await,
        );
    }
    eventually(
        "/healthz says the relay cannot be logged in to",
        Duration::from_secs(15),
        || async {
            let (status, body) = healthz(metrics);
            status == 503 && body.contains("oauth2")
        },
    )
    .await;
    let (code, out, err) = command(&config, &env, &["check"]);
    assert_ne!(code, 0, "check passes without a token: {out}");
    assert!(
        out.contains("transport: oauth2: no token") && out.contains("invalid_client"),
        "check says why: {out}"
    );
    assert!(err.contains("transport.oauth2"), "{err}");
    assert!(!out.contains(CLIENT_SECRET) && !err.contains(CLIENT_SECRET));
    assert_waiting_unspent(&db, &waiting, fresh, "while no token can be had").await;
    assert_eq!(
        relay.received().len(),
        DRAIN,
        "nothing sent without a token"
    );
    let said = daemon.logged("oauth2 token not renewed");
    assert!(
        said.iter().any(|l| l["level"] == "ERROR"
            && l["error"].as_str().unwrap_or("").contains("invalid_client")),
        "the log says why: {said:?}"
    );

    // The endpoint comes back: everything goes, once.
    std::fs::remove_file(&refuse).unwrap();
    let back = std::time::Instant::now();
    eventually(
        "the waiting mails delivered",
        Duration::from_secs(60),
        || async { relay.received().len() >= DRAIN + waiting.len() },
    )
    .await;
    eprintln!(
        "{}: the waiting mails went {:.1}s after the endpoint came back",
        db.backend,
        back.elapsed().as_secs_f64()
    );
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(15)).await, 0);
    let seen = tally(&relay.received());
    assert_eq!(seen.len(), DRAIN + waiting.len());
    assert!(seen.values().all(|&n| n == 1), "none twice: {seen:?}");
    // Every row sent on its first counted attempt: the refused logins and the
    // expired sessions spent nothing.
    let rows = db.rows().await;
    assert_eq!(rows.len(), DRAIN + waiting.len());
    for row in &rows {
        assert!(
            row.status == "sent" && row.attempts == 1,
            "sent once, one attempt: {row:?}"
        );
    }
    // A token is a secret: never in a log line or `check`'s output.
    let logs = daemon.output();
    for token in relay.tokens_issued() {
        assert!(!logs.contains(&token.value), "a token in the log");
        assert!(!out.contains(&token.value));
    }
    assert!(
        !logs.contains(CLIENT_SECRET),
        "the client secret in the log"
    );
}

/// A relay that rejects a token it issued (revoked before its end) makes
/// the daemon renew it at once, not three quarters of its hour later, and
/// no mail is burned meanwhile (DESIGN §13: "an AUTH rejection renews once
/// before it counts as a configuration fault"). The `command` provider
/// fetches it, as a secret manager's script would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_token_is_renewed_at_once_and_burns_nothing() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "revoke");
    let (cert, key) = ca.issue("relay", "IP:127.0.0.1");
    let revoke = dir.path().join("revoked");
    let relay = SmtpServer::start(&[
        "--xoauth2",
        "3600",
        "--auth",
        "sender@example.com:-",
        "--token-revoke-file",
        revoke.to_str().unwrap(),
        "--tls",
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
    ]);
    // A secret manager's script: asks the endpoint, prints the token and
    // its lifetime.
    let fetch = dir.path().join("fetch-token.py");
    std::fs::write(
        &fetch,
        format!(
            "import json, urllib.request\n\
             answer = json.load(urllib.request.urlopen(urllib.request.Request(\
             {url:?}, data=b'grant_type=client_credentials&client_id=x&client_secret=y')))\n\
             print(answer['access_token'], answer['expires_in'])\n",
            url = relay.token_url.as_deref().unwrap()
        ),
    )
    .unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "[transport]\nusername = \"sender@example.com\"\n\
             [transport.oauth2]\nprovider = \"command\"\ntoken_command = \"python3 {}\"\n",
            fetch.display()
        ),
    );
    let url = format!("smtp://127.0.0.1:{}?tls=required", relay.port);
    let mut env = daemon_env(&db, &url, &[]);
    env.push(("SSL_CERT_FILE".into(), ca.cert.display().to_string()));
    let mut daemon = Daemon::start_config(&config, env);
    for i in 0..5 {
        db.enqueue(mail(&format!("a{i}@example.net"), &format!("before {i}")))
            .await;
    }
    eventually("the first mails sent", Duration::from_secs(20), || async {
        relay.received().len() == 5
    })
    .await;
    assert_eq!(relay.tokens_issued().len(), 1);

    // Revoked: the relay refuses the token at the next login (and closes
    // the sessions that used it).
    std::fs::write(&revoke, "").unwrap();
    let revoked_at = std::time::Instant::now();
    for i in 0..5 {
        db.enqueue(mail(&format!("b{i}@example.net"), &format!("after {i}")))
            .await;
    }
    eventually("the later mails sent", Duration::from_secs(20), || async {
        relay.received().len() == 10
    })
    .await;
    assert!(revoked_at.elapsed() < Duration::from_secs(15));
    let issued = relay.tokens_issued();
    assert_eq!(
        issued.len(),
        2,
        "renewed once: {issued:?} {:?} {}",
        relay.auths(),
        daemon.output()
    );
    let auths = relay.auths();
    let rejected: Vec<_> = auths.iter().filter(|a| a.ok == Some(false)).collect();
    assert!(
        !rejected.is_empty()
            && rejected
                .iter()
                .all(|a| a.token.as_ref() == Some(&issued[0].token)),
        "the revoked token was refused: {auths:?}"
    );
    assert_eq!(
        auths.last().and_then(|a| a.token.as_ref()),
        Some(&issued[1].token)
    );
    let seen = tally(&relay.received());
    assert!(seen.len() == 10 && seen.values().all(|&n| n == 1));
    // The relay has them all; the last outcomes may still be on their way
    // to the database.
    eventually(
        "every outcome recorded",
        Duration::from_secs(10),
        || async { db.count("status <> 'sending'").await == 10 },
    )
    .await;
    for row in db.rows().await {
        assert!(row.status == "sent" && row.attempts == 1, "{row:?}");
    }
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    let said = daemon.logged("oauth2 token rejected by the relay: renewing");
    assert_eq!(said.len(), 1, "{}", daemon.tail(30));
}

/// One daemon run in the TLS test: `url`, `extra` settings, with the test
/// CA trusted or not.
fn tls_env(db: &TestDb, url: &str, extra: &[(&str, &str)], ca: &Path) -> Vec<(String, String)> {
    let mut env = daemon_env(db, url, extra);
    env.push(("SSL_CERT_FILE".into(), ca.display().to_string()));
    env
}

/// A daemon that must not send: it starts, finds the relay unusable, says
/// why on /healthz (and `check` says it too), and the `waiting` rows wait
/// unspent.
async fn refuses(
    db: &TestDb,
    env: Vec<(String, String)>,
    metrics: u16,
    why: &str,
    (waiting, fresh): (&[i64], i32),
) {
    let (code, out, _) = output(tablemail().envs(env.clone()).arg("check"));
    assert_ne!(code, 0, "check passes: {out}");
    assert!(out.contains(why), "check says {why:?}: {out}");
    let mut daemon = Daemon::start(env);
    eventually(
        &format!("/healthz 503 saying {why:?}"),
        Duration::from_secs(15),
        || async {
            let (status, body) = healthz(metrics);
            status == 503 && body.contains(why)
        },
    )
    .await;
    let said = daemon
        .wait_for_log("relay unreachable at start", Duration::from_secs(5))
        .await;
    assert_eq!(said["level"], "ERROR", "an operator must act");
    assert_waiting_unspent(db, waiting, fresh, why).await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
}

/// `smtp://host` to a relay that is not on this host means STARTTLS with a
/// certificate that verifies (DESIGN §13, RFC 8314). The relays listen in a
/// network namespace of the test's own, so their address is not loopback;
/// the daemon runs outside. A relay without STARTTLS, and one whose
/// certificate another authority issued, are refused before a byte of mail
/// (mail waits unspent, /healthz and `check` say why); the relay whose
/// certificate the trusted CA issued takes the mail, as does the other one
/// with `transport.accept_invalid_certs`; `?tls=none` sends in clear, said
/// at start; a relay on 127.0.0.1 is plain without asking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_off_this_host_need_tls_unless_told_otherwise() {
    let Some(ns) = NetNs::new() else {
        return;
    };
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let fresh = fresh_attempts(&db).await;
    let dir = TempDir::new();
    let trusted = TestCa::new(dir.path(), "trusted");
    let other = TestCa::new(dir.path(), "other");
    let san = format!("IP:{}", ns.ns_addr);
    let (good_cert, good_key) = trusted.issue("good", &san);
    let (foreign_cert, foreign_key) = other.issue("foreign", &san);
    let inside = ns.exec();
    let host = ["--host", ns.ns_addr.as_str()];
    let plain = SmtpServer::start_under(&inside, &host);
    let tls_args = |cert: &Path, key: &Path| {
        let mut args: Vec<String> = host.iter().map(|s| s.to_string()).collect();
        args.extend([
            "--tls".into(),
            cert.display().to_string(),
            key.display().to_string(),
        ]);
        args
    };
    let good_args = tls_args(&good_cert, &good_key);
    let good = SmtpServer::start_under(
        &inside,
        &good_args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let foreign_args = tls_args(&foreign_cert, &foreign_key);
    let foreign = SmtpServer::start_under(
        &inside,
        &foreign_args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let local = SmtpServer::start(&[]);
    let at =
        |relay: &SmtpServer, query: &str| format!("smtp://{}:{}{query}", ns.ns_addr, relay.port);
    let metrics = free_port();
    let listen = format!("127.0.0.1:{metrics}");
    let observed = [("TABLEMAIL__METRICS__LISTEN", listen.as_str())];

    let first = db.enqueue(mail("first@example.net", "first")).await;
    // (a) No STARTTLS offered: nothing is sent in clear.
    refuses(
        &db,
        tls_env(&db, &at(&plain, ""), &observed, &trusted.cert),
        metrics,
        "does not offer STARTTLS, which smtp:// requires of a relay not on this host \
         (?tls=none sends in clear on purpose)",
        (&[first], fresh),
    )
    .await;
    assert!(plain.attempts().is_empty(), "nothing sent in clear");
    // (b) A certificate from another authority.
    refuses(
        &db,
        tls_env(&db, &at(&foreign, ""), &observed, &trusted.cert),
        metrics,
        "invalid peer certificate: UnknownIssuer",
        (&[first], fresh),
    )
    .await;
    assert!(foreign.attempts().is_empty());

    // The certificate the trusted CA issued: verified, and the mail goes.
    let mut daemon = Daemon::start(tls_env(&db, &at(&good, ""), &observed, &trusted.cert));
    eventually(
        "sent over verified TLS",
        Duration::from_secs(20),
        || async { good.received().len() == 1 },
    )
    .await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    assert_eq!(subjects(&good.received()), ["first"]);

    // The other authority's certificate, accepted on purpose.
    db.enqueue(mail("second@example.net", "second")).await;
    let mut daemon = Daemon::start(tls_env(
        &db,
        &at(&foreign, ""),
        &[("TABLEMAIL__TRANSPORT__ACCEPT_INVALID_CERTS", "true")],
        &trusted.cert,
    ));
    eventually(
        "sent with accept_invalid_certs",
        Duration::from_secs(20),
        || async { foreign.received().len() == 1 },
    )
    .await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    assert_eq!(subjects(&foreign.received()), ["second"]);

    // (c) In clear, said so.
    db.enqueue(mail("third@example.net", "third")).await;
    let mut daemon = Daemon::start(tls_env(&db, &at(&plain, "?tls=none"), &[], &trusted.cert));
    eventually("sent in clear", Duration::from_secs(20), || async {
        plain.received().len() == 1
    })
    .await;
    let said = daemon
        .wait_for_log(
            "relay without TLS (tls=none): mail travels in clear to another host",
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(said["relay"], "transport.url");
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    assert_eq!(subjects(&plain.received()), ["third"]);

    // (d) On this host: plain, without a word.
    db.enqueue(mail("fourth@example.net", "fourth")).await;
    let mut daemon = Daemon::start(tls_env(&db, &local.url(), &[], &trusted.cert));
    eventually("sent on loopback", Duration::from_secs(20), || async {
        local.received().len() == 1
    })
    .await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    assert!(!daemon.output().contains("relay without TLS"));
    assert_eq!(subjects(&local.received()), ["fourth"]);
    for row in db.rows().await {
        assert!(row.status == "sent" && row.attempts == 1, "{row:?}");
    }
}

/// Routes (DESIGN §13): `shop.example` through relay A signed by the
/// route's key, `support.example` through relay B with its own, everything
/// else through `transport.*` (relay C); a row's `route` column overrides
/// its From domain; a row naming a route no configuration has waits
/// unspent, named by `check` and `status`. Every message is verified by
/// dkimpy with all the keys published, as a receiver would, and signed by
/// the most specific key at or above its From domain whichever route it
/// took. Then relay B goes down: only its route's mail waits.
async fn each_route_sends_through_its_relay_signed_by_the_most_specific_key(db: TestDb) {
    let fresh = fresh_attempts(&db).await;
    let dir = TempDir::new();
    let k_shop = DkimKey::new(dir.path(), "shop.example", "s1");
    let k_support = DkimKey::new(dir.path(), "support.example", "s2");
    let k_eu = DkimKey::new(dir.path(), "eu.shop.example", "s3");
    let k_net = DkimKey::new(dir.path(), "example.net", "s4");
    let published = [&k_shop, &k_support, &k_eu, &k_net];
    // The shop's relay takes XOAUTH2 alone, behind STARTTLS (Microsoft 365
    // for one brand): the route logs in with a token of its own.
    let ca = TestCa::new(dir.path(), "routes");
    let (cert, key) = ca.issue("relay-a", "IP:127.0.0.1");
    let a = SmtpServer::start(&[
        "--xoauth2",
        "3600",
        "--auth",
        "orders@shop.example:-",
        "--xoauth2-client",
        "shop-app:shop-secret",
        "--tls",
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
    ]);
    let secret = dir.path().join("shop-secret");
    std::fs::write(&secret, "shop-secret").unwrap();
    let b_port = free_port();
    let b = SmtpServer::start(&["--port", &b_port.to_string()]);
    let c = SmtpServer::start(&[]);
    let config = write_config(
        dir.path(),
        &format!(
            "[[dkim]]\n{eu}\n[[dkim]]\n{net}\n\
             [[routes]]\nname = \"shop\"\nfrom_domains = [\"shop.example\"]\n\
             url = \"smtp://127.0.0.1:{a}?tls=required\"\nusername = \"orders@shop.example\"\n\
             [routes.dkim]\n{shop}\n\
             [routes.oauth2]\nprovider = \"microsoft\"\ntenant_id = \"shop\"\n\
             client_id = \"shop-app\"\nclient_secret_file = \"{secret}\"\ntoken_url = \"{token_url}\"\n\
             [[routes]]\nname = \"support\"\nfrom_domains = [\"support.example\"]\nurl = \"{b}\"\n\
             [routes.dkim]\n{support}\n",
            eu = k_eu.toml(),
            net = k_net.toml(),
            shop = k_shop.toml(),
            support = k_support.toml(),
            a = a.port,
            secret = secret.display(),
            token_url = a.token_url.as_deref().unwrap(),
            b = b.url(),
        ),
    );
    let metrics = free_port();
    let listen = format!("127.0.0.1:{metrics}");
    let mut env = daemon_env(
        &db,
        &c.url(),
        &[
            ("TABLEMAIL__METRICS__LISTEN", &listen),
            ("TABLEMAIL__TRANSPORT__PROBE_INTERVAL", "1s"),
        ],
    );
    env.push(("SSL_CERT_FILE".into(), ca.cert.display().to_string()));
    let from = |addr: &str, to: &str, subject: &str| {
        let mut m = mail(to, subject);
        m.from_address = Some(addr.into());
        m
    };
    db.enqueue(from("orders@shop.example", "a1@example.org", "shop"))
        .await;
    db.enqueue(from("team@eu.shop.example", "a2@example.org", "eu shop"))
        .await;
    db.enqueue(from("help@support.example", "b1@example.org", "support"))
        .await;
    db.enqueue(from("news@example.net", "c1@example.org", "net"))
        .await;
    db.enqueue(from("someone@other.example", "c2@example.org", "unsigned"))
        .await;
    // As an application writes rows: the route column names the route.
    db.exec(
        "INSERT INTO mail_queue (to_address, subject, body, from_address, route) \
         VALUES ('b2@example.org', 'shop via support', 'x', 'orders@shop.example', 'support')",
    )
    .await;
    db.exec(
        "INSERT INTO mail_queue (to_address, subject, body, from_address, route) \
         VALUES ('x@example.org', 'unknown route', 'x', 'orders@shop.example', 'billing')",
    )
    .await;
    let billing = db
        .scalar_i64("SELECT id FROM mail_queue WHERE route = 'billing'")
        .await;
    // And as the command line does.
    run_ok(
        tablemail()
            .arg("--config")
            .arg(&config)
            .envs(env.clone())
            .args([
                "enqueue",
                "--to",
                "a3@example.org",
                "--subject",
                "support via shop",
            ])
            .args(["--from", "help@support.example", "--route", "shop"]),
    );

    let (code, out, err) = command(&config, &env, &["check"]);
    assert_ne!(code, 0, "check passes with a row naming no route: {out}");
    assert!(
        out.contains("billing") && err.contains("routes"),
        "check names the route: {out}{err}"
    );
    assert!(
        out.contains("relay (route shop): ok")
            && out.contains("relay (route support): ok")
            && out.contains("route shop: oauth2: microsoft token obtained"),
        "{out}"
    );

    let mut daemon = Daemon::start_config(&config, env.clone());
    eventually(
        "seven mails through three relays",
        Duration::from_secs(20),
        || async { a.received().len() + b.received().len() + c.received().len() >= 7 },
    )
    .await;
    assert_eq!(
        subjects(&a.received()),
        ["eu shop", "shop", "support via shop"]
    );
    assert_eq!(subjects(&b.received()), ["shop via support", "support"]);
    assert_eq!(subjects(&c.received()), ["net", "unsigned"]);
    let logins = a.auths();
    assert!(
        !logins.is_empty()
            && logins.iter().all(|l| l.ok == Some(true)
                && l.tls
                && l.login.as_deref() == Some("orders@shop.example")),
        "the shop route logs in with its token: {logins:?}"
    );
    assert!(b.auths().is_empty() && c.auths().is_empty());
    // Signed by the most specific key at or above the From domain.
    let expected = [
        ("shop", Some(&k_shop)),
        ("eu shop", Some(&k_eu)),
        ("support via shop", Some(&k_support)),
        ("support", Some(&k_support)),
        ("shop via support", Some(&k_shop)),
        ("net", Some(&k_net)),
        ("unsigned", None),
    ];
    let all: Vec<Received> = [a.received(), b.received(), c.received()].concat();
    for (subject, key) in expected {
        let m = all
            .iter()
            .find(|m| m.header("Subject").as_deref() == Some(subject))
            .unwrap();
        let Some(key) = key else {
            assert_eq!(m.header("DKIM-Signature"), None, "{subject}");
            continue;
        };
        let signature = m.header("DKIM-Signature").expect("signed");
        let tags = dkim_tags(&signature);
        assert_eq!(
            (tags["d"].as_str(), tags["s"].as_str()),
            (key.domain.as_str(), key.selector.as_str()),
            "{subject}: {signature}"
        );
        assert_eq!(dkim_verdict(&m.data, &published), "pass", "{subject}");
    }
    // The unknown route: waits unspent, said at error level, by `status`
    // and `check`.
    daemon
        .wait_for_log(
            "configuration fault: mail names a route that is not configured: it waits",
            Duration::from_secs(10),
        )
        .await;
    assert_waiting_unspent(&db, &[billing], fresh, "a route no configuration has").await;
    let status = run_ok(
        tablemail()
            .arg("--config")
            .arg(&config)
            .envs(env.clone())
            .arg("status"),
    );
    assert!(
        status.contains("billing") && status.contains("route not configured"),
        "status names it: {status}"
    );
    assert!(!status.contains("no sender configured"), "{status}");
    for route in ["default", "shop", "support"] {
        assert!(
            status.contains(&format!("relay (route {route}, primary): reachable")),
            "status shows each route: {status}"
        );
    }

    // Relay B goes down: only the support route's mail waits.
    drop(b);
    let mut later = Vec::new();
    for (addr, to, subject) in [
        (
            "help@support.example",
            "b3@example.org",
            "support while down",
        ),
        (
            "orders@shop.example",
            "a4@example.org",
            "shop while B is down",
        ),
        ("news@example.net", "c3@example.org", "net while B is down"),
    ] {
        later.push(db.enqueue(from(addr, to, subject)).await);
    }
    eventually(
        "the other routes' mails arrive",
        Duration::from_secs(20),
        || async { a.received().len() == 4 && c.received().len() == 3 },
    )
    .await;
    eventually(
        "/healthz names the route that is down",
        Duration::from_secs(15),
        || async {
            let (status, body) = healthz(metrics);
            status == 503 && body.contains("support")
        },
    )
    .await;
    let exposition = http::try_get(metrics, "/metrics", None).unwrap().body;
    assert!(
        exposition.contains("tablemail_relay_up{route=\"support\"} 0")
            && exposition.contains("tablemail_relay_up{route=\"shop\"} 1")
            && exposition.contains("tablemail_relay_up{route=\"default\"} 1"),
        "{exposition}"
    );
    assert_waiting_unspent(&db, &later[..1], fresh, "the support route's mail").await;
    // B is back: its mail goes.
    let b = SmtpServer::start(&["--port", &b_port.to_string()]);
    eventually(
        "the support mail arrives",
        Duration::from_secs(30),
        || async { b.received().len() == 1 },
    )
    .await;
    assert_eq!(subjects(&b.received()), ["support while down"]);
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    for row in db.rows().await {
        if row.id == billing {
            continue;
        }
        assert!(
            row.status == "sent" && row.attempts == 1,
            "sent on its first attempt: {row:?}"
        );
    }
}

/// Feedback-ID is signed (DESIGN §13: Gmail's feedback loop reads it only
/// when it is): named in `h=` and verified by dkimpy; changed on the way,
/// or added to a mail that had none, the signature fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_id_is_signed() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let dir = TempDir::new();
    let key = DkimKey::new(dir.path(), "example.com", "fb1");
    let relay = SmtpServer::start(&[]);
    let mut with = mail("a@example.net", "with feedback id");
    with.headers = Some(
        serde_json::json!({"Feedback-ID": "order-42:shop:transactional:tablemail"})
            .as_object()
            .unwrap()
            .clone(),
    );
    db.enqueue(with).await;
    db.enqueue(mail("b@example.net", "without")).await;
    let file = key.file.display().to_string();
    let mut daemon = Daemon::start(daemon_env(
        &db,
        &relay.url(),
        &[
            ("TABLEMAIL__DKIM__DOMAIN", "example.com"),
            ("TABLEMAIL__DKIM__SELECTOR", "fb1"),
            ("TABLEMAIL__DKIM__PRIVATE_KEY_FILE", &file),
        ],
    ));
    eventually("both sent", Duration::from_secs(20), || async {
        relay.received().len() == 2
    })
    .await;
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(10)).await, 0);
    let got = relay.received();
    let by_subject = |s: &str| {
        got.iter()
            .find(|m| m.header("Subject").as_deref() == Some(s))
            .unwrap()
    };
    let signed = by_subject("with feedback id");
    assert_eq!(
        signed.header("Feedback-ID").as_deref(),
        Some("order-42:shop:transactional:tablemail")
    );
    let signature = signed.header("DKIM-Signature").expect("signed");
    let names: Vec<String> = dkim_tags(&signature)["h"]
        .split(':')
        .map(str::to_ascii_lowercase)
        .collect();
    assert!(names.iter().any(|n| n == "feedback-id"), "{signature}");
    assert_eq!(dkim_verdict(&signed.data, &[&key]), "pass");
    let tampered = signed.data.replacen("order-42:shop", "order-43:shop", 1);
    assert_ne!(tampered, signed.data);
    assert_ne!(
        dkim_verdict(&tampered, &[&key]),
        "pass",
        "a changed Feedback-ID"
    );
    // Named in h= even when absent: one added on the way breaks the signature.
    let bare = by_subject("without");
    assert_eq!(dkim_verdict(&bare.data, &[&key]), "pass");
    let added = format!("Feedback-ID: spoofed:x:y:z\r\n{}", bare.data);
    assert_ne!(
        dkim_verdict(&added, &[&key]),
        "pass",
        "an added Feedback-ID"
    );
}
