//! Templates in the database (DESIGN §15), on every backend: what the relay
//! receives from a templated row (subject, text and HTML, escaping, the
//! locale chosen), the daemon noticing a template put while it runs, every
//! way a template fails its mail (at once, without a session), hostile
//! templates among ordinary mails, the commands and the console's pages.

mod support;

use std::time::{Duration, Instant};

use mail_parser::MessageParser;
use support::*;
use tablemail::store::{NewMail, NewTemplate};

for_each_backend!(
    renders_parts_escaping_and_locale,
    failures_fail_at_once_and_ordinary_mails_go_on,
    commands_and_console_with_a_running_daemon,
);

fn template(name: &str, locale: &str, subject: &str, text: &str, html: &str) -> NewTemplate {
    NewTemplate {
        name: name.into(),
        locale: locale.into(),
        subject: subject.into(),
        body: (!text.is_empty()).then(|| text.into()),
        body_html: (!html.is_empty()).then(|| html.into()),
    }
}

fn templated(to: &str, name: &str, locale: Option<&str>, data: serde_json::Value) -> NewMail {
    NewMail {
        to_address: to.into(),
        template: Some(name.into()),
        locale: locale.map(str::to_string),
        template_data: match data {
            serde_json::Value::Object(map) => Some(map),
            _ => None,
        },
        ..NewMail::default()
    }
}

/// Subject, text and HTML of a received message, decoded.
fn parts(m: &Received) -> (String, String, String) {
    let message = MessageParser::default()
        .parse(m.data.as_bytes())
        .expect("a message");
    let part = |p: Option<std::borrow::Cow<'_, str>>| {
        p.unwrap_or_default()
            .replace("\r\n", "\n")
            .trim_end()
            .to_string()
    };
    (
        message.subject().unwrap_or_default().to_string(),
        part(message.body_text(0)),
        part(message.body_html(0)),
    )
}

fn received_by(smtp: &SmtpServer, rcpt: &str) -> Received {
    let all = smtp.received();
    all.iter()
        .find(|m| m.rcpt_tos.iter().any(|r| r == rcpt))
        .unwrap_or_else(|| panic!("nothing for {rcpt} among {}", all.len()))
        .clone()
}

const ORDER_TEXT: &str = "Hallo {{ name }},\n{% for i in items %}{{ i.qty }} x {{ i.title }}\n{% endfor %}{% include 'footer' %}";
const ORDER_HTML: &str = "<p>Hallo {{ name }}</p><ul>{% for i in items %}<li>{{ i.title }}</li>{% endfor %}</ul>{% include 'footer' %}";

async fn renders_parts_escaping_and_locale(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let worker = worker(&db, &settings(&db, &smtp.url()));
    for t in [
        template(
            "order",
            "",
            "Order {{ number }}",
            "Hello {{ name }}",
            "<p>Hello {{ name }}</p>",
        ),
        template(
            "order",
            "de",
            "Bestellung {{ number }} – danke, {{ name }}\n",
            ORDER_TEXT,
            ORDER_HTML,
        ),
        template("footer", "", "", "-- Der Laden", "<p>Der Laden</p>"),
    ] {
        db.store.put_template(&t).await.unwrap();
    }
    let data = serde_json::json!({
        "number": 42,
        "name": "Jörg <b>&</b>",
        "items": [{"qty": 2, "title": "Bücher & Co"}, {"qty": 1, "title": "<script>"}],
    });
    db.enqueue(templated(
        "de@example.org",
        "order",
        Some("de-AT"),
        data.clone(),
    ))
    .await;
    db.enqueue(templated(
        "fr@example.org",
        "order",
        Some("fr"),
        data.clone(),
    ))
    .await;
    // The row's own subject and text are kept; only the HTML comes from
    // the template.
    let mut own = templated("own@example.org", "order", None, data);
    own.subject = Some("My own subject".into());
    own.body = Some("My own text".into());
    db.enqueue(own).await;

    let report = worker.process_batch().await.unwrap();
    assert_eq!((report.claimed, report.sent), (3, 3), "{report:?}");

    let (subject, text, html) = parts(&received_by(&smtp, "de@example.org"));
    assert_eq!(subject, "Bestellung 42 – danke, Jörg <b>&</b>");
    assert_eq!(
        text,
        "Hallo Jörg <b>&</b>,\n2 x Bücher & Co\n1 x <script>\n-- Der Laden"
    );
    assert_eq!(
        html,
        "<p>Hallo Jörg &lt;b&gt;&amp;&lt;&#x2f;b&gt;</p><ul><li>Bücher &amp; Co</li>\
         <li>&lt;script&gt;</li></ul><p>Der Laden</p>"
    );
    let (subject, text, html) = parts(&received_by(&smtp, "fr@example.org"));
    assert_eq!(subject, "Order 42");
    assert_eq!(text, "Hello Jörg <b>&</b>");
    assert_eq!(html, "<p>Hello Jörg &lt;b&gt;&amp;&lt;&#x2f;b&gt;</p>");
    let (subject, text, html) = parts(&received_by(&smtp, "own@example.org"));
    assert_eq!(subject, "My own subject");
    assert_eq!(text, "My own text");
    assert_eq!(html, "<p>Hello Jörg &lt;b&gt;&amp;&lt;&#x2f;b&gt;</p>");

    // A new version put between two batches is what the next mail gets.
    db.store
        .put_template(&template(
            "order",
            "",
            "Order {{ number }}, version 2",
            "v2",
            "",
        ))
        .await
        .unwrap();
    db.enqueue(templated(
        "again@example.org",
        "order",
        Some("fr"),
        serde_json::json!({"number": 43, "name": "x"}),
    ))
    .await;
    let report = worker.process_batch().await.unwrap();
    assert_eq!(report.sent, 1, "{report:?}");
    let (subject, text, _) = parts(&received_by(&smtp, "again@example.org"));
    assert_eq!(
        (subject.as_str(), text.as_str()),
        ("Order 43, version 2", "v2")
    );

    // The README's insert, as written there (plain SQL on every backend).
    db.store
        .put_template(&template(
            "order",
            "de",
            "Bestellung {{ number }}",
            "Danke",
            "",
        ))
        .await
        .unwrap();
    db.exec(&readme_sql("templates:postgres")).await;
    let report = worker.process_batch().await.unwrap();
    assert_eq!(report.sent, 1, "{report:?}");
    let (subject, text, _) = parts(&received_by(&smtp, "ann@example.org"));
    assert_eq!(
        (subject.as_str(), text.as_str()),
        ("Bestellung 42", "Danke")
    );
}

/// The SQL block of the README that follows `<!-- marker -->`.
fn readme_sql(marker: &str) -> String {
    let readme = include_str!("../README.md");
    let block = &readme[readme
        .find(&format!("<!-- {marker} -->"))
        .expect("the marker")..];
    let open = block.find("```sql\n").expect("a SQL block") + "```sql\n".len();
    let close = block[open..].find("```").expect("its end") + open;
    block[open..close].to_string()
}

async fn failures_fail_at_once_and_ordinary_mails_go_on(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let mut settings = settings(&db, &smtp.url());
    settings.transport.max_message_size = tablemail::config::ByteSize(200_000);
    let worker = worker(&db, &settings);
    for t in [
        template("fine", "", "Fine {{ n }}", "fine {{ n }}", ""),
        template("undefined", "", "Hi {{ customer.name }}", "x", ""),
        template(
            "loop",
            "",
            "loop",
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "",
        ),
        template(
            "huge",
            "",
            "huge",
            "{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}",
            "",
        ),
        template("file", "", "file", "{% include '/etc/passwd' %}", ""),
        template("absent", "", "absent", "{% include 'no-such-part' %}", ""),
        template("broken", "", "broken {% if %}", "x", ""),
    ] {
        db.store.put_template(&t).await.unwrap();
    }
    let hostile = [
        ("undefined", "`customer` is undefined"),
        ("loop", "fuel"),
        ("huge", "max_message_size"),
        ("file", "\"/etc/passwd\" does not exist"),
        ("absent", "\"no-such-part\" does not exist"),
        ("broken", "syntax error"),
        ("missing", "\"missing\" does not exist"),
    ];
    let mut ids = Vec::new();
    for (i, (name, _)) in hostile.iter().enumerate() {
        let to = format!("hostile{i}@example.org");
        ids.push(
            db.enqueue(templated(&to, name, None, serde_json::json!({})))
                .await,
        );
    }
    let fine = db
        .enqueue(templated(
            "fine@example.org",
            "fine",
            None,
            serde_json::json!({"n": 1}),
        ))
        .await;
    let plain = db.enqueue(mail("plain@example.org", "Plain")).await;

    let started = Instant::now();
    let report = worker.process_batch().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        (report.sent, report.failed),
        (2, hostile.len()),
        "{report:?}"
    );
    let got = smtp.received();
    assert_eq!(got.len(), 2, "only the ordinary mails reach the relay");
    assert_eq!(parts(&received_by(&smtp, "fine@example.org")).0, "Fine 1");
    assert_eq!(db.row(fine).await.status, "sent");
    assert_eq!(db.row(plain).await.status, "sent");
    // No SMTP session was opened for them: the relay saw no other mail.
    assert_eq!(smtp.attempts().len(), 2);
    for (id, (name, reason)) in ids.iter().zip(hostile) {
        let row = db.row(*id).await;
        assert_eq!(row.status, "failed", "{name}");
        assert_eq!(row.attempts, 1, "{name}: failed at the first attempt");
        let error = row.last_error.unwrap_or_default();
        assert!(
            error.contains(&format!("template \"{name}\"")) && error.contains(reason),
            "{name}: {error}"
        );
    }
}

async fn commands_and_console_with_a_running_daemon(db: TestDb) {
    let smtp = SmtpServer::start(&[]);
    let dir = TempDir::new();
    let text = dir.path().join("order.txt");
    let html = dir.path().join("order.html");
    std::fs::write(&text, "Danke, {{ name }}!\n").unwrap();
    std::fs::write(&html, "<p>Danke, {{ name }}!</p>\n").unwrap();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let env = daemon_env(&db, &smtp.url(), &[("TABLEMAIL__CONSOLE__LISTEN", &listen)]);
    let tm = || {
        let mut cmd = tablemail();
        cmd.envs(env.iter().cloned());
        cmd
    };
    run_ok(
        tm().args(["template", "put", "order", "--locale", "de", "--subject"])
            .arg("Bestellung {{ number }}")
            .arg("--text")
            .arg(&text)
            .arg("--html")
            .arg(&html),
    );
    // A template that does not compile is refused and not stored.
    let (code, _, err) = output(tm().args(["template", "put", "bad", "--subject", "{% if %}"]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("syntax error"), "{err}");
    let list = run_ok(tm().args(["template", "list"]));
    assert!(
        list.contains("order") && list.contains("de") && !list.contains("bad"),
        "{list}"
    );
    let shown = run_ok(tm().args(["template", "show", "order", "--locale", "de-AT"]));
    assert!(shown.contains("Danke, {{ name }}!"), "{shown}");
    let rendered = run_ok(tm().args([
        "template",
        "render",
        "order",
        "--locale",
        "de-CH",
        "--data",
        r#"{"number": 7, "name": "<Ann>"}"#,
    ]));
    assert!(
        rendered.contains("subject: Bestellung 7")
            && rendered.contains("Danke, <Ann>!")
            && rendered.contains("<p>Danke, &lt;Ann&gt;!</p>"),
        "{rendered}"
    );
    let (code, _, err) = output(tm().args(["template", "render", "order", "--locale", "de"]));
    assert_eq!(code, 1);
    assert!(err.contains("`number` is undefined"), "{err}");
    // enqueue refuses what could never be rendered.
    let (code, _, err) = output(tm().args([
        "enqueue",
        "--to",
        "a@example.org",
        "--template",
        "nothing",
        "--data",
        "{}",
    ]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("\"nothing\" does not exist"), "{err}");

    let mut daemon = Daemon::start(env.clone());
    let enqueue = |n: u32| {
        run_ok(
            tm().args([
                "enqueue",
                "--to",
                "ann@example.org",
                "--template",
                "order",
                "--locale",
                "de-AT",
                "--data",
            ])
            .arg(format!(r#"{{"number": {n}, "name": "Ann"}}"#)),
        )
        .trim()
        .parse::<i64>()
        .unwrap()
    };
    let first = enqueue(1);
    eventually(
        "the first mail is sent",
        Duration::from_secs(20),
        || async { db.row(first).await.status == "sent" },
    )
    .await;
    let shown = run_ok(tm().args(["show", &first.to_string()]));
    assert!(
        shown.contains("template           order, locale \"de-AT\" (the template's \"de\")"),
        "{shown}"
    );
    // A new version, put while the daemon runs, is what the next mail gets.
    run_ok(
        tm().args([
            "template",
            "put",
            "order",
            "--locale",
            "de",
            "--subject",
            "Neu {{ number }}",
            "--text",
        ])
        .arg(&text),
    );
    let second = enqueue(2);
    eventually(
        "the second mail is sent",
        Duration::from_secs(20),
        || async { db.row(second).await.status == "sent" },
    )
    .await;
    let subjects: Vec<String> = smtp.received().iter().map(|m| parts(m).0).collect();
    assert_eq!(subjects, ["Bestellung 1", "Neu 2"]);

    // The console's pages: the list, and a preview rendered with data.
    let page = http::get(port, "/templates", None);
    assert_eq!(page.status, 200);
    assert!(
        page.body.contains("href=\"/templates/order?locale=de\""),
        "{}",
        page.body
    );
    let page = http::get(
        port,
        &format!(
            "/templates/order?locale=de-AT&data={}",
            http::encode(r#"{"number": 9, "name": "<i>"}"#)
        ),
        None,
    );
    assert_eq!(page.status, 200);
    assert!(page.body.contains("Neu 9"), "{}", page.body);
    // The text part, rendered unescaped, shown escaped by the page.
    assert!(page.body.contains("Danke, &#60;i&#62;!"), "{}", page.body);
    let page = http::get(port, "/templates/nothing", None);
    assert_eq!(page.status, 404);
    daemon.signal("TERM");
    assert_eq!(daemon.wait_exit(Duration::from_secs(20)).await, 0);
}
