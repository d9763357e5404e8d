//! Hostile input: arbitrary bytes, and the fixtures mutated and spliced,
//! must parse without panicking and with bounded output; inputs of about
//! 2 MB built to trigger quadratic behaviour must parse quickly even in a
//! debug build.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::tests::{to_crlf, FIXTURES};
use super::*;

/// The bounds every report keeps, whatever it was read from.
fn assert_bounded(report: &Report) {
    assert!(report.items.len() <= MAX_ITEMS);
    assert!(report.relay_queue_ids.len() <= MAX_QUEUE_IDS);
    assert!(report.addressed_to.len() <= MAX_ADDRESSED_TO);
    if report.form == Form::Unknown {
        assert!(report.items.is_empty());
        assert!(report.original_message_id.is_none());
    }
    for item in &report.items {
        if let Some(d) = &item.diagnostic {
            assert!(!d.is_empty() && d.chars().count() <= text::MAX_DIAGNOSTIC_CHARS);
            assert!(!d.chars().any(char::is_control), "{d:?}");
        }
        if let Some(s) = &item.status {
            assert!(s.len() <= 9, "{s:?}");
        }
        if let Some(r) = &item.recipient {
            assert_plausible_addr(r);
        }
    }
    for addr in report
        .addressed_to
        .iter()
        .chain(&report.from)
        .chain(&report.original_sender)
    {
        assert_plausible_addr(addr);
    }
    if let Some(id) = &report.original_message_id {
        assert!(
            id.starts_with('<') && id.ends_with('>') && id.len() <= 998,
            "{id:?}"
        );
    }
    for id in &report.relay_queue_ids {
        assert!(!id.is_empty() && id.len() <= 64, "{id:?}");
    }
}

fn assert_plausible_addr(addr: &str) {
    assert!(addr.len() <= 254, "{addr:?}");
    assert_eq!(addr.matches('@').count(), 1, "{addr:?}");
    assert!(
        !addr.chars().any(|c| c.is_whitespace() || c.is_control()),
        "{addr:?}"
    );
}

/// One change to a fixture.
#[derive(Debug, Clone)]
enum Edit {
    Delete(usize, usize),
    Duplicate(usize, usize),
    Insert(usize, Vec<u8>),
    Overwrite(usize, u8),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 0usize..64).prop_map(|(at, len)| Edit::Delete(at, len)),
        (any::<usize>(), 0usize..256).prop_map(|(at, len)| Edit::Duplicate(at, len)),
        (
            any::<usize>(),
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..16),
                proptest::sample::select(vec![
                    b"\n\n".to_vec(),
                    b"\r\n ".to_vec(),
                    b"--".to_vec(),
                    b"<".to_vec(),
                    b"@".to_vec(),
                    b";".to_vec(),
                    b"=?utf-8?b?".to_vec(),
                    b"\nContent-Type: multipart/mixed; boundary=x\n\n--x\n".to_vec(),
                    b"\nContent-Transfer-Encoding: base64\n".to_vec(),
                    b"\nFinal-Recipient: rfc822; <x@example.org>\nAction: failed\nStatus: 5.1.1\n"
                        .to_vec(),
                    "ü\u{0}\u{feff}".as_bytes().to_vec(),
                ]),
            ]
        )
            .prop_map(|(at, bytes)| Edit::Insert(at, bytes)),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Edit::Overwrite(at, b)),
    ]
}

fn apply(mut raw: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let len = raw.len();
        let pos = |at: usize| if len == 0 { 0 } else { at % (len + 1) };
        match e {
            Edit::Delete(at, n) => {
                let start = pos(*at);
                let end = (start + n).min(len);
                raw.drain(start..end);
            }
            Edit::Duplicate(at, n) => {
                let start = pos(*at);
                let end = (start + n).min(len);
                let copy = raw[start..end].to_vec();
                raw.splice(end..end, copy);
            }
            Edit::Insert(at, bytes) => {
                let at = pos(*at);
                raw.splice(at..at, bytes.iter().copied());
            }
            Edit::Overwrite(at, b) => {
                if len > 0 {
                    raw[at % len] = *b;
                }
            }
        }
    }
    raw
}

proptest! {
    #[test]
    fn arbitrary_bytes(raw in proptest::collection::vec(any::<u8>(), 0..4096)) {
        assert_bounded(&parse_report(&raw));
    }

    #[test]
    fn mutated_fixtures(
        which in 0..FIXTURES.len(),
        edits in proptest::collection::vec(edit(), 1..8),
        crlf in any::<bool>(),
    ) {
        let base = FIXTURES[which].to_vec();
        let base = if crlf { to_crlf(&base) } else { base };
        assert_bounded(&parse_report(&apply(base, &edits)));
    }

    #[test]
    fn any_charset_and_type(
        mime in proptest::sample::select(vec!["text/plain", "text/html", "message/delivery-status", "text/rfc822-headers", "multipart/mixed"]),
        charset in proptest::sample::select(vec![
            "utf-8", "utf-16", "utf-16le", "utf-7", "iso-2022-jp", "shift_jis", "euc-kr", "gb18030",
            "big5", "koi8-r", "windows-1252", "iso-8859-15", "x-unknown", "",
        ]),
        encoding in proptest::sample::select(vec!["7bit", "base64", "quoted-printable"]),
        body in proptest::collection::vec(any::<u8>(), 0..2048),
    ) {
        let mut raw = format!(
            "From: MAILER-DAEMON@x.example\nSubject: Undeliverable\n\
             Content-Type: {mime}; charset=\"{charset}\"; boundary=\"b\"\n\
             Content-Transfer-Encoding: {encoding}\n\n"
        )
        .into_bytes();
        raw.extend_from_slice(&body);
        assert_bounded(&parse_report(&raw));
    }

    #[test]
    fn spliced_fixtures(
        a in 0..FIXTURES.len(),
        b in 0..FIXTURES.len(),
        cut_a in any::<usize>(),
        cut_b in any::<usize>(),
    ) {
        let (fa, fb) = (FIXTURES[a], FIXTURES[b]);
        let mut raw = fa[..cut_a % (fa.len() + 1)].to_vec();
        raw.extend_from_slice(&fb[cut_b % (fb.len() + 1)..]);
        assert_bounded(&parse_report(&raw));
    }
}

/// A DSN whose delivery-status part is `body`.
fn dsn_with(body: &[u8]) -> Vec<u8> {
    let mut raw = b"From: MAILER-DAEMON@mx.example.net\n\
        Content-Type: multipart/report; report-type=delivery-status; boundary=b\n\n\
        --b\nContent-Type: message/delivery-status\n\n"
        .to_vec();
    raw.extend_from_slice(body);
    raw.extend_from_slice(b"\n--b--\n");
    raw
}

/// A non-MIME bounce whose text is `body`.
fn bounce_with(body: &[u8]) -> Vec<u8> {
    let mut raw = b"From: MAILER-DAEMON@mx.example.net\nSubject: Undeliverable\n\n".to_vec();
    raw.extend_from_slice(body);
    raw
}

fn repeat(unit: &str, total: usize) -> Vec<u8> {
    unit.as_bytes()
        .iter()
        .copied()
        .cycle()
        .take(total)
        .collect()
}

#[test]
fn pathological_inputs_parse_in_linear_time() {
    const SIZE: usize = 2 * 1024 * 1024;
    let nested: Vec<u8> = (0..50_000)
        .flat_map(|i| {
            format!("Content-Type: multipart/mixed; boundary=b{i}\n\n--b{i}\n").into_bytes()
        })
        .take(SIZE)
        .collect();
    let missing_boundaries: Vec<u8> = {
        let mut raw = b"Content-Type: multipart/mixed; boundary=top\n\n".to_vec();
        raw.extend(
            (0..40_000)
                .flat_map(|i| {
                    format!("--top\nContent-Type: multipart/mixed; boundary=nx{i}\n\nx\n")
                        .into_bytes()
                })
                .take(SIZE),
        );
        raw
    };
    let dash_boundary = {
        let mut raw = format!(
            "Content-Type: multipart/mixed; boundary=\"{}x\"\n\n",
            "-".repeat(150)
        )
        .into_bytes();
        raw.extend(repeat("-", SIZE));
        raw
    };
    let many_headers = {
        let mut raw = repeat("X-Failed-Recipients: a@example.org\n", SIZE);
        raw.extend_from_slice(b"\nbody\n");
        raw
    };
    let inputs: Vec<(&str, Vec<u8>)> = vec![
        (
            "100,000 Final-Recipient lines",
            dsn_with(&repeat("Final-Recipient: rfc822; a@example.org\n", SIZE)),
        ),
        (
            "Final-Recipient groups",
            dsn_with(&repeat(
                "Final-Recipient: rfc822; <a@example.org>\nAction: failed\nStatus: 5.1.1\nDiagnostic-Code: smtp; 550-5.1.1 x\n 550 5.1.1 y\n\n",
                SIZE,
            )),
        ),
        ("50,000 nested multiparts", nested),
        ("multiparts whose boundary never comes", missing_boundaries),
        ("the same boundary line", {
            let mut raw = b"Content-Type: multipart/mixed; boundary=b\n\n".to_vec();
            raw.extend(repeat("--b\n", SIZE));
            raw
        }),
        ("a boundary of dashes in a body of dashes", dash_boundary),
        ("a million '<' in the body", bounce_with(&repeat("<", SIZE))),
        ("a million '<' in To", {
            let mut raw = b"To: ".to_vec();
            raw.extend(repeat("<", SIZE));
            raw.extend_from_slice(b"\nFrom: MAILER-DAEMON@x.example\n\nbody\n");
            raw
        }),
        ("a million '<' in a folded From", {
            let mut raw = b"From: ".to_vec();
            raw.extend(repeat("<<<<<<<<<<\n ", SIZE));
            raw.extend_from_slice(b"\n\nbody\n");
            raw
        }),
        ("a million '<' in a DSN field", dsn_with(&{
            let mut f = b"Final-Recipient: rfc822; ".to_vec();
            f.extend(repeat("<", SIZE));
            f
        })),
        ("a Content-Type of quotes and semicolons", {
            let mut raw = b"Content-Type: multipart/mixed; boundary=".to_vec();
            raw.extend(repeat("\";=\\(", SIZE));
            raw.extend_from_slice(b"\n\nbody\n");
            raw
        }),
        ("many header fields", many_headers),
        ("qmail paragraphs", bounce_with(&{
            let mut b = b"Hi. This is the qmail-send program at x.example.\n\n".to_vec();
            b.extend(repeat("<a@example.org>:\nRemote host said: 550 5.1.1 no\n\n", SIZE));
            b
        })),
        ("generic lines", bounce_with(&repeat("<a1@example.org> 550 5.1.1 nope b@example.org\n", SIZE))),
        ("exchange recipients", bounce_with(&{
            let mut b = b"Delivery has failed to these recipients or groups:\n\n".to_vec();
            b.extend(repeat("Name (a@example.org)\ntext\n", SIZE));
            b.extend_from_slice(b"Diagnostic information for administrators:\n");
            b.extend(repeat("a@example.org\n#550 5.1.1 x ##\n", SIZE / 2));
            b
        })),
        ("exim paragraphs", bounce_with(&{
            let mut b = b"The following address(es) failed:\n\n".to_vec();
            b.extend(repeat("  a@example.org\n    550 5.1.1 x\n", SIZE));
            b
        })),
        ("sendmail transcript", bounce_with(&{
            let mut b = b"----- The following addresses had permanent fatal errors -----\n<a@example.org>\n\n----- Transcript of session follows -----\n".to_vec();
            b.extend(repeat("550 5.1.1 <b@example.org>... unknown <a@example.org>\n", SIZE));
            b
        })),
        ("gmail paragraphs", bounce_with(&{
            let mut b = b"Delivery to the following recipients failed permanently:\n\n".to_vec();
            b.extend(repeat("   a@example.org\n", SIZE));
            b
        })),
        ("message-id lines", bounce_with(&repeat("Message-ID:\n", SIZE))),
        ("queued as", bounce_with(&repeat("250 ok queued as ", SIZE))),
        ("one long word with at-signs", bounce_with(&repeat("a@", SIZE))),
        ("base64 junk", {
            let mut raw = b"Content-Type: message/delivery-status\nContent-Transfer-Encoding: base64\n\n".to_vec();
            raw.extend(repeat("QUJD=\n", SIZE));
            raw
        }),
        ("quoted-printable junk", {
            let mut raw = b"Content-Transfer-Encoding: quoted-printable\nFrom: postmaster@x.example\n\n".to_vec();
            raw.extend(repeat("=4=\n=", SIZE));
            raw
        }),
        ("html", {
            let mut raw = b"Content-Type: text/html\nSubject: Undeliverable\n\n".to_vec();
            raw.extend(repeat("<p><a href=\"<<<<\">a@example.org 550 5.1.1</a>", SIZE));
            raw
        }),
        ("utf-8 escapes", dsn_with(&repeat("Final-Recipient: utf-8; \\x{FFFFFFF}\\x{41}@\\x{", SIZE))),
    ];
    let bound = Duration::from_secs(5);
    for (name, raw) in inputs {
        let started = Instant::now();
        let report = parse_report(&raw);
        let took = started.elapsed();
        assert_bounded(&report);
        assert!(took < bound, "{name}: {took:?} for {} bytes", raw.len());
    }
}

#[test]
fn items_are_capped() {
    let body = (0..5_000)
        .map(|i| {
            format!("Final-Recipient: rfc822; r{i}@example.org\nAction: failed\nStatus: 5.1.1\n\n")
        })
        .collect::<String>();
    let report = parse_report(&dsn_with(body.as_bytes()));
    assert_eq!(report.form, Form::Dsn);
    assert_eq!(report.items.len(), MAX_ITEMS);
    assert_eq!(report.items[0].recipient.as_deref(), Some("r0@example.org"));
}

#[test]
fn long_diagnostic_is_cut() {
    let body = format!(
        "Final-Recipient: rfc822; a@example.org\nAction: failed\nStatus: 5.1.1\nDiagnostic-Code: smtp; 550 {}\n",
        "word ".repeat(2_000)
    );
    let report = parse_report(&dsn_with(body.as_bytes()));
    let diagnostic = report.items[0].diagnostic.as_deref().unwrap_or_default();
    assert_eq!(diagnostic.chars().count(), text::MAX_DIAGNOSTIC_CHARS);
}
