//! A [`Draft`] (a row's columns) -> the message's bytes and envelope: address
//! parsing, header validation, DKIM and the size limit. Everything rejected
//! here is a permanent failure that never opens an SMTP session.
//!
//! Over 500 lines with its tests (a third of it): the builder itself is short.

use std::collections::BTreeSet;

use lettre::{
    message::{
        header::{ContentTransferEncoding, HeaderName, HeaderValue},
        Body, Mailbox, Mailboxes, MultiPart, SinglePart,
    },
    Address, Message,
};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MailError {
    #[error("invalid address in {field}: {reason}")]
    InvalidAddress { field: &'static str, reason: String },
    #[error("CR, LF or NUL in {field}")]
    LineBreak { field: String },
    #[error("invalid header {name:?}: {reason}")]
    InvalidHeader { name: String, reason: String },
    #[error("no recipient")]
    NoRecipient,
    #[error("{count} recipients: over transport.max_recipients ({max})")]
    TooManyRecipients { count: usize, max: usize },
    #[error("no sender: the row has no from_address and defaults.from_address is not set")]
    NoSender,
    #[error("message of {size} bytes is over transport.max_message_size ({max} bytes)")]
    TooLarge { size: usize, max: u64 },
    #[error("cannot build the message: {0}")]
    Build(String),
    #[error("{0}")]
    Field(String),
}

/// Headers that come from the row's columns, or that would change the
/// envelope, the trace or the signature; `headers` may not set them (nor any
/// `Resent-*`).
const RESERVED_HEADERS: &[&str] = &[
    "from",
    "to",
    "cc",
    "bcc",
    "reply-to",
    "subject",
    "message-id",
    "date",
    "mime-version",
    "content-type",
    "content-transfer-encoding",
    "sender",
    "return-path",
    "received",
    "dkim-signature",
];

/// What every message takes from the configuration.
#[derive(Debug, Clone)]
pub struct MessageDefaults {
    pub from_address: Option<Address>,
    pub from_name: Option<String>,
    pub max_message_size: u64,
    /// Most recipients (to, cc and bcc together) of one mail.
    pub max_recipients: usize,
    /// Signs mails from its domain (`dkim.*`).
    pub dkim: Option<std::sync::Arc<crate::dkim::Signer>>,
}

/// A message ready for the wire.
#[derive(Debug, Clone)]
pub struct PreparedMail {
    pub envelope: lettre::address::Envelope,
    pub bytes: Vec<u8>,
    /// Recipient domains, sorted, for throttling and the logs (never the
    /// full address).
    pub recipient_domains: Vec<String>,
}

impl PreparedMail {
    pub fn domains(&self) -> impl Iterator<Item = &str> {
        self.recipient_domains.iter().map(String::as_str)
    }
}

/// Parses one bare address such as `a@example.com`.
pub fn parse_address(s: &str) -> Result<Address, MailError> {
    reject_line_breaks("address", s)?;
    s.trim()
        .parse::<Address>()
        .map_err(|e| MailError::InvalidAddress {
            field: "address",
            reason: format!("{e}"),
        })
}

fn reject_line_breaks(field: &str, value: &str) -> Result<(), MailError> {
    if value.contains(['\r', '\n', '\0']) {
        return Err(MailError::LineBreak {
            field: field.to_string(),
        });
    }
    Ok(())
}

/// Parses a comma-separated address list; an empty list is `Ok(vec![])`.
fn parse_list(field: &'static str, value: Option<&str>) -> Result<Vec<Mailbox>, MailError> {
    let Some(value) = value else {
        return Ok(Vec::new());
    };
    reject_line_breaks(field, value)?;
    if value.trim().is_empty() {
        return Ok(Vec::new());
    }
    let invalid = |reason: &str| MailError::InvalidAddress {
        field,
        reason: reason.to_string(),
    };
    let list: Mailboxes = value
        .parse()
        .map_err(|_| invalid("not a comma-separated list of addresses"))?;
    let list: Vec<Mailbox> = list.into_iter().collect();
    // lettre's list parser stops quietly at the first thing it cannot read;
    // make sure it read every entry.
    let entries = split_list(value);
    if entries.len() != list.len() {
        return Err(invalid("not a comma-separated list of addresses"));
    }
    Ok(list)
}

/// Splits on commas outside quotes and angle brackets, skipping empty entries.
fn split_list(value: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut quoted, mut angle, mut escaped, mut start) = (false, false, false, 0);
    for (i, c) in value.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '<' if !quoted => angle = true,
            '>' if !quoted => angle = false,
            ',' if !quoted && !angle => {
                out.push(&value[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&value[start..]);
    out.retain(|s| !s.trim().is_empty());
    out
}

/// Validates a header name per RFC 5322 §2.2 and refuses the reserved ones.
fn header_name(name: &str) -> Result<HeaderName, MailError> {
    let invalid = |reason: &str| MailError::InvalidHeader {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    if name.is_empty() || name.len() > 76 {
        return Err(invalid("a name is 1 to 76 characters"));
    }
    if !name.bytes().all(|b| (33..=126).contains(&b) && b != b':') {
        return Err(invalid("a name is printable ASCII without ':' or spaces"));
    }
    let lower = name.to_ascii_lowercase();
    if RESERVED_HEADERS.contains(&lower.as_str()) || lower.starts_with("resent-") {
        return Err(invalid(
            "reserved: set by tablemail, or it would change the envelope or the trace",
        ));
    }
    HeaderName::new_from_ascii(name.to_string()).map_err(|e| invalid(&e.to_string()))
}

/// Parses the `headers` column: a JSON object of string values.
fn extra_headers(json: Option<&str>) -> Result<Vec<HeaderValue>, MailError> {
    let Some(json) = json else {
        return Ok(Vec::new());
    };
    let invalid = |reason: String| MailError::InvalidHeader {
        name: "headers".into(),
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| invalid(format!("not JSON: {e}")))?;
    let serde_json::Value::Object(map) = value else {
        return Err(invalid("not a JSON object".into()));
    };
    map.into_iter()
        .map(|(name, value)| {
            let header = header_name(&name)?;
            let serde_json::Value::String(value) = value else {
                return Err(MailError::InvalidHeader {
                    name,
                    reason: "the value is not a string".into(),
                });
            };
            reject_line_breaks(&format!("header {name}"), &value)?;
            Ok(HeaderValue::new(header, value))
        })
        .collect()
}

/// A part's body: CRLF line endings and a transfer encoding, in time linear
/// in its size.
///
/// lettre's `Body::new` inserts a CR before each bare LF one `String::insert`
/// at a time, which costs the square of the body (an 0.9 MB body of line
/// breaks took seconds of CPU); with every line ending made CRLF first it has
/// nothing left to insert. A lone CR becomes a line break too, so no bare CR
/// reaches the relay. A body with other control characters (NUL among them)
/// goes quoted-printable, so none of them goes out raw.
fn body(text: &str) -> Body {
    let (crlf, controls) = crlf_line_endings(text);
    if controls {
        return Body::new_with_encoding(crlf, ContentTransferEncoding::QuotedPrintable)
            .expect("quoted-printable carries any text");
    }
    if seven_bit(&crlf) {
        return Body::dangerous_pre_encoded(crlf.into_bytes(), ContentTransferEncoding::SevenBit);
    }
    Body::new(crlf)
}

/// `text` with every line ending (CRLF, LF or a lone CR) made CRLF, in one
/// pass, and whether it holds other control characters than TAB.
fn crlf_line_endings(text: &str) -> (String, bool) {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len() + bytes.len() / 32 + 2);
    let mut controls = false;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\r' => {
                out.extend_from_slice(b"\r\n");
                if bytes.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
            }
            b'\n' => out.extend_from_slice(b"\r\n"),
            b => {
                controls |= (b < 0x20 && b != b'\t') || b == 0x7f;
                out.push(b);
            }
        }
        i += 1;
    }
    let text = String::from_utf8(out).expect("only ASCII line endings were changed");
    (text, controls)
}

/// ASCII with lines of at most 72 characters: sent as it is (7bit), which
/// is what lettre would choose, without its second pass.
fn seven_bit(crlf: &str) -> bool {
    crlf.is_ascii() && crlf.split("\r\n").all(|line| line.len() <= 72)
}

/// What a message is built from: a row's columns, borrowed. The worker makes
/// one from a claimed row, `tablemail enqueue` from a mail it is about to
/// insert.
#[derive(Debug, Clone, Copy, Default)]
pub struct Draft<'a> {
    pub from_name: Option<&'a str>,
    pub from_address: Option<&'a str>,
    pub to_address: &'a str,
    pub cc: Option<&'a str>,
    pub bcc: Option<&'a str>,
    pub reply_to: Option<&'a str>,
    pub subject: &'a str,
    pub body: Option<&'a str>,
    pub body_html: Option<&'a str>,
    /// The `headers` column: a JSON object as text.
    pub headers: Option<&'a str>,
    /// Assigned at the first claim; `None` only while a new mail is checked.
    pub message_id: Option<&'a str>,
    /// The files sent with it (`mail_attachment`), in order.
    pub attachments: &'a [Attachment<'a>],
}

/// One attachment as a message is built from it.
#[derive(Debug, Clone, Copy)]
pub struct Attachment<'a> {
    pub filename: &'a str,
    pub content_type: &'a str,
    pub content: &'a [u8],
    /// Set: an inline part, referenced from the HTML as `cid:…`.
    pub content_id: Option<&'a str>,
}

/// Builds the message of a draft.
pub fn prepare(mail: &Draft<'_>, defaults: &MessageDefaults) -> Result<PreparedMail, MailError> {
    // The columns themselves over the limit: the message can only be larger,
    // so it is not built at all.
    let raw = [mail.body, mail.body_html, mail.headers]
        .iter()
        .flatten()
        .map(|t| t.len())
        .sum::<usize>()
        + mail.subject.len();
    if raw as u64 > defaults.max_message_size {
        return Err(MailError::TooLarge {
            size: raw,
            max: defaults.max_message_size,
        });
    }
    let from_address = match mail.from_address {
        Some(a) if !a.trim().is_empty() => {
            reject_line_breaks("from_address", a)?;
            a.trim()
                .parse::<Address>()
                .map_err(|e| MailError::InvalidAddress {
                    field: "from_address",
                    reason: e.to_string(),
                })?
        }
        _ => defaults.from_address.clone().ok_or(MailError::NoSender)?,
    };
    let from_name = mail.from_name.or(defaults.from_name.as_deref());
    if let Some(name) = from_name {
        reject_line_breaks("from_name", name)?;
    }
    let sign = defaults
        .dkim
        .as_ref()
        .filter(|signer| signer.covers(from_address.domain()));
    let from = Mailbox::new(from_name.map(str::to_string), from_address);

    let to = parse_list("to_address", Some(mail.to_address))?;
    let cc = parse_list("cc", mail.cc)?;
    let bcc = parse_list("bcc", mail.bcc)?;
    let reply_to = parse_list("reply_to", mail.reply_to)?;
    if to.is_empty() && cc.is_empty() && bcc.is_empty() {
        return Err(MailError::NoRecipient);
    }
    let count = to.len() + cc.len() + bcc.len();
    if count > defaults.max_recipients {
        return Err(MailError::TooManyRecipients {
            count,
            max: defaults.max_recipients,
        });
    }
    reject_line_breaks("subject", mail.subject)?;
    if let Some(id) = mail.message_id {
        check_message_id(id)?;
    }
    let headers = extra_headers(mail.headers)?;

    let domains: BTreeSet<&str> = to
        .iter()
        .chain(&cc)
        .chain(&bcc)
        .map(|m| m.email.domain())
        .collect();
    let recipient_domains = domains.into_iter().map(str::to_string).collect();

    let mut builder = Message::builder()
        .from(from)
        .subject(mail.subject)
        .message_id(mail.message_id.map(str::to_string));
    for m in to {
        builder = builder.to(m);
    }
    for m in cc {
        builder = builder.cc(m);
    }
    // Bcc goes into the envelope only; lettre drops the header when it builds.
    for m in bcc {
        builder = builder.bcc(m);
    }
    for m in reply_to {
        builder = builder.reply_to(m);
    }
    for h in headers {
        builder = builder.raw_header(h);
    }
    // lettre turns every line ending of a body into CRLF, so a bare LF cannot
    // smuggle an end-of-data sequence past the relay.
    let built = match (mail.body, mail.body_html) {
        (Some(text), Some(html)) => {
            builder.multipart(MultiPart::alternative_plain_html(body(text), body(html)))
        }
        (None, Some(html)) => builder.singlepart(SinglePart::html(body(html))),
        (text, None) => builder.singlepart(SinglePart::plain(body(text.unwrap_or("")))),
    };
    let message = built.map_err(|e| MailError::Build(e.to_string()))?;
    let mut bytes = message.formatted();
    if let Some(signer) = sign {
        bytes = signer.sign(&bytes, chrono::Utc::now().timestamp());
    }
    if bytes.len() as u64 > defaults.max_message_size {
        return Err(MailError::TooLarge {
            size: bytes.len(),
            max: defaults.max_message_size,
        });
    }
    Ok(PreparedMail {
        envelope: message.envelope().clone(),
        bytes,
        recipient_domains,
    })
}

/// A Message-ID as the row may give it: `<left@right>`, one line.
pub fn check_message_id(id: &str) -> Result<(), MailError> {
    reject_line_breaks("message_id", id)?;
    if !(id.starts_with('<') && id.ends_with('>') && id.contains('@')) {
        return Err(MailError::Field(
            "message_id must look like <id@domain>".into(),
        ));
    }
    Ok(())
}

/// This host's name, for EHLO and the right-hand side of Message-IDs.
pub fn local_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| {
            !h.is_empty()
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        })
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row's columns, owned, for tests to change one at a time.
    #[derive(Clone)]
    struct Row {
        from_name: Option<String>,
        from_address: Option<String>,
        to_address: String,
        cc: Option<String>,
        bcc: Option<String>,
        reply_to: Option<String>,
        subject: String,
        body: Option<String>,
        body_html: Option<String>,
        headers: Option<String>,
        message_id: String,
    }

    impl Row {
        fn draft(&self) -> Draft<'_> {
            Draft {
                from_name: self.from_name.as_deref(),
                from_address: self.from_address.as_deref(),
                to_address: &self.to_address,
                cc: self.cc.as_deref(),
                bcc: self.bcc.as_deref(),
                reply_to: self.reply_to.as_deref(),
                subject: &self.subject,
                body: self.body.as_deref(),
                body_html: self.body_html.as_deref(),
                headers: self.headers.as_deref(),
                message_id: Some(&self.message_id),
                attachments: &[],
            }
        }
    }

    fn row() -> Row {
        Row {
            from_name: Some("Shop".into()),
            from_address: Some("shop@example.com".into()),
            to_address: "Ann <ann@example.org>, bob@example.net".into(),
            cc: Some("carl@example.com".into()),
            bcc: Some("hidden@example.com".into()),
            reply_to: None,
            subject: "Your order".into(),
            body: Some("Hello\nworld".into()),
            body_html: None,
            headers: Some(r#"{"X-Campaign":"spring"}"#.into()),
            message_id: "<abc.7@host.example>".into(),
        }
    }

    fn defaults() -> MessageDefaults {
        MessageDefaults {
            from_address: None,
            from_name: None,
            max_message_size: 1_000_000,
            max_recipients: 1000,
            dkim: None,
        }
    }

    fn text(p: &PreparedMail) -> String {
        String::from_utf8(p.bytes.clone()).unwrap()
    }

    #[test]
    fn builds_headers_envelope_and_crlf_body() {
        let p = prepare(&row().draft(), &defaults()).unwrap();
        let t = text(&p);
        assert!(t.contains("From: Shop <shop@example.com>\r\n"), "{t}");
        assert!(t.contains("Message-ID: <abc.7@host.example>\r\n"), "{t}");
        assert!(t.contains("X-Campaign: spring\r\n"), "{t}");
        assert!(t.contains("Hello\r\nworld"), "{t}");
        assert!(!t.to_lowercase().contains("hidden@"), "bcc leaked: {t}");
        let rcpts: Vec<String> = p.envelope.to().iter().map(|a| a.to_string()).collect();
        assert_eq!(rcpts.len(), 4);
        assert!(rcpts.contains(&"hidden@example.com".to_string()));
        assert_eq!(
            p.recipient_domains,
            ["example.com", "example.net", "example.org"]
        );
    }

    #[test]
    fn refuses_bad_input_without_sending() {
        let mut r = row();
        r.subject = "Hi\r\nBcc: victim@example.com".into();
        assert!(matches!(
            prepare(&r.draft(), &defaults()),
            Err(MailError::LineBreak { .. })
        ));

        let mut r = row();
        r.to_address = "not an address".into();
        assert!(matches!(
            prepare(&r.draft(), &defaults()),
            Err(MailError::InvalidAddress { .. })
        ));

        let mut r = row();
        r.to_address = "a@example.com, ???".into();
        assert!(matches!(
            prepare(&r.draft(), &defaults()),
            Err(MailError::InvalidAddress { .. })
        ));

        let mut r = row();
        r.to_address = " ".into();
        r.cc = None;
        r.bcc = None;
        assert_eq!(
            prepare(&r.draft(), &defaults()).unwrap_err(),
            MailError::NoRecipient
        );

        let mut r = row();
        r.headers = Some(r#"{"Bad Name":"x"}"#.into());
        assert!(matches!(
            prepare(&r.draft(), &defaults()),
            Err(MailError::InvalidHeader { .. })
        ));

        let mut r = row();
        r.headers = Some(r#"{"X-Ok":"a\r\nBcc: b@example.com"}"#.into());
        assert!(matches!(
            prepare(&r.draft(), &defaults()),
            Err(MailError::LineBreak { .. })
        ));

        let mut r = row();
        r.headers = Some(r#"{"Subject":"other"}"#.into());
        assert!(matches!(
            prepare(&r.draft(), &defaults()),
            Err(MailError::InvalidHeader { .. })
        ));

        let mut r = row();
        r.body = Some("x".repeat(2_000_000));
        assert!(matches!(
            prepare(&r.draft(), &defaults()),
            Err(MailError::TooLarge { .. })
        ));

        let mut r = row();
        r.from_address = None;
        assert_eq!(
            prepare(&r.draft(), &defaults()).unwrap_err(),
            MailError::NoSender
        );
    }

    #[test]
    fn quoted_display_names_may_hold_commas() {
        let mut r = row();
        r.to_address = r#""Doe, Jane" <jane@example.com>, x@example.com"#.into();
        let p = prepare(&r.draft(), &defaults()).unwrap();
        assert_eq!(p.envelope.to().len(), 4);
    }

    #[test]
    fn the_fast_body_path_gives_what_lettre_gives() {
        let short = "x".repeat(72);
        let long = "y".repeat(73);
        let bodies = [
            String::new(),
            "Hello\nworld\n".to_string(),
            "Hello\r\nworld".to_string(),
            "a\n.\nMAIL FROM:<x@example.com>\n".to_string(),
            format!("{short}\n{short}"),
            format!("{long}\nshort"),
            "héllo".to_string(),
            "\n\n\r\n".to_string(),
        ];
        for text in bodies {
            let ours = body(&text);
            let theirs = Body::new(text.clone());
            assert_eq!(ours.encoding(), theirs.encoding(), "{text:?}");
            assert_eq!(ours.into_vec(), theirs.into_vec(), "{text:?}");
        }
        assert!(seven_bit(&format!("{short}\r\n")));
        assert!(!seven_bit("héllo"));
        // Where lettre would let them through: a lone CR becomes a line
        // break, a NUL goes quoted-printable.
        assert_eq!(body("a\r.\rb").into_vec(), b"a\r\n.\r\nb".to_vec());
        let nul = body("a\0b");
        assert_eq!(nul.encoding(), ContentTransferEncoding::QuotedPrintable);
        assert_eq!(nul.into_vec(), b"a=00b".to_vec());
    }

    #[test]
    fn building_is_linear_in_the_body() {
        // The body that took 9.5 s of CPU through lettre's own line endings;
        // here it builds in one pass (a test would time out long before a
        // quadratic build of it finished in an unoptimized build).
        let mut r = row();
        r.body = Some(format!("{}{}", "x".repeat(80), "\n".repeat(800_000)));
        let defaults = MessageDefaults {
            max_message_size: 25_000_000,
            ..defaults()
        };
        let t = text(&prepare(&r.draft(), &defaults).unwrap());
        assert!(!t.contains("\n\n"), "every line ending is CRLF");
    }

    #[test]
    fn reserved_headers_cannot_change_the_envelope_or_trace() {
        for name in [
            "Sender",
            "Return-Path",
            "Resent-From",
            "resent-to",
            "Received",
            "DKIM-Signature",
        ] {
            let mut r = row();
            r.headers = Some(format!(r#"{{"{name}": "bounce@attacker.example"}}"#));
            let err = prepare(&r.draft(), &defaults()).unwrap_err();
            assert!(
                matches!(err, MailError::InvalidHeader { .. }),
                "{name}: {err}"
            );
        }
    }

    #[test]
    fn recipients_are_capped_and_oversized_rows_are_not_built() {
        let mut r = row();
        r.to_address = (0..1001)
            .map(|i| format!("u{i}@example.com"))
            .collect::<Vec<_>>()
            .join(", ");
        r.cc = None;
        r.bcc = None;
        assert_eq!(
            prepare(&r.draft(), &defaults()).unwrap_err(),
            MailError::TooManyRecipients {
                count: 1001,
                max: 1000
            }
        );
        let mut r = row();
        r.body = Some("x".repeat(1_000_001));
        assert!(matches!(
            prepare(&r.draft(), &defaults()).unwrap_err(),
            MailError::TooLarge { .. }
        ));
    }

    #[test]
    fn html_and_text_make_alternative() {
        let mut r = row();
        r.body_html = Some("<p>Hello</p>".into());
        let t = text(&prepare(&r.draft(), &defaults()).unwrap());
        assert!(t.contains("multipart/alternative"), "{t}");
        assert!(t.contains("text/html"), "{t}");
    }
}
