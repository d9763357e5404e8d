//! A pure parser of inbound delivery reports: the raw bytes of a mail that
//! came back -> which kind of report it is, and for each recipient it names,
//! what happened ([`Kind`]), with the status code and the reason text.
//!
//! Recognised, in this order (the first that matches wins):
//! - `arf`: feedback reports (RFC 5965): complaints.
//! - `dsn`: delivery status notifications (RFC 3464, RFC 6533), whoever
//!   sends them (Postfix, Exim, Sendmail, Exchange and Office 365, Gmail,
//!   Amazon SES...).
//! - `bounce`: the non-standard bounces of common servers (`postfix`,
//!   `exim`, `qmail` and Yahoo, `sendmail`, `exchange`, `gmail`), and a
//!   `generic` fallback for any bounce-looking message.
//! - `autoreply`: automatic replies (RFC 3834 and the common non-standard
//!   signs) that do not come from a mail delivery system.
//!
//! Under them: `mime` walks the MIME tree within fixed bounds (mail-parser
//! reads the header grammars, transfer encodings and charsets), `text` holds
//! the single-pass primitives (addresses, codes, field lines), `classify`
//! the rules that turn an action, a code and a reason into a [`Kind`].
//!
//! Hostile input is the rule: any byte sequence is parsed without panicking,
//! in time linear in its size (every scan is a single pass or a `memchr`
//! search over a bounded number of needles; no regex), and with bounded
//! output: at most [`MAX_ITEMS`] items, [`MAX_INPUT`] octets read, diagnostics
//! of at most 1,000 characters, a MIME tree walked at most 8 levels deep.

mod arf;
mod autoreply;
mod bounce;
mod classify;
mod dsn;
mod exchange;
mod exim;
mod generic;
mod gmail;
mod mime;
mod postfix;
mod qmail;
mod sendmail;
mod text;

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod tests;

use std::collections::HashSet;

use mime::Part;

/// The most items one report yields; recipients past it are ignored.
pub const MAX_ITEMS: usize = 1000;
/// The most octets of a report that are read; the rest is ignored (the parts
/// that matter come first, the returned message last).
pub const MAX_INPUT: usize = 8 * 1024 * 1024;
/// The most relay queue ids kept.
const MAX_QUEUE_IDS: usize = 4;
/// The most addresses kept in [`Report::addressed_to`].
const MAX_ADDRESSED_TO: usize = 16;
/// The most octets of human-readable text the non-standard recognisers scan.
const MAX_TEXT: usize = 1024 * 1024;

/// What a report says, as far as it could be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// Which kind of report this was recognised as.
    pub form: Form,
    /// One per recipient the report names (at most [`MAX_ITEMS`]); may be
    /// empty.
    pub items: Vec<Item>,
    /// `<id@domain>` of the mail the report is about, from the first of: a
    /// text/rfc822-headers or message/rfc822 part (an ARF report's original
    /// message among them), a DSN's `X-Original-Message-ID`, then an
    /// automatic reply's `In-Reply-To`, or a bounce's embedded `Message-ID:`
    /// line of the returned headers. `None` when the form is
    /// [`Form::Unknown`].
    pub original_message_id: Option<String>,
    /// Queue ids of the relay that handled the original mail: a DSN's
    /// `X-Postfix-Queue-ID`, or `queued as XYZ` in the text; deduplicated, at
    /// most a few. Empty when the form is [`Form::Unknown`].
    pub relay_queue_ids: Vec<String>,
    /// Lower-cased addr-specs from the report's own `Delivered-To`,
    /// `X-Original-To` and `To` headers, in that order, deduplicated: where a
    /// VERP return address may be found when the SMTP envelope is unknown.
    pub addressed_to: Vec<String>,
    /// The report's `From` addr-spec (for automatic replies: who replied).
    pub from: Option<String>,
    /// The envelope sender of the mail the report is about, where the report
    /// gives it (ARF `Original-Mail-From`, a DSN's `X-Postfix-Sender`, the
    /// returned headers' `Return-Path`): another place for a VERP address.
    pub original_sender: Option<String>,
}

/// Which kind of report a message was recognised as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// RFC 3464 (or RFC 6533) delivery status notification.
    Dsn,
    /// RFC 5965 feedback report.
    Arf,
    /// RFC 3834 automatic reply, or one of its common non-standard forms.
    AutoReply,
    /// A non-standard bounce of the family named: "postfix", "exim",
    /// "qmail", "yahoo", "sendmail", "exchange", "gmail", or "generic".
    NonStandard(&'static str),
    /// An event of the provider named ("ses", "postmark", "mailgun",
    /// "sendgrid"), received by its webhook and put in these terms there
    /// (DESIGN §14); never the parser's answer.
    Webhook(&'static str),
    /// None of these.
    Unknown,
}

impl Form {
    /// `dsn`, `arf`, `auto_reply`, the family of a non-standard bounce, the
    /// provider of a webhook's event, or `unknown`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Form::Dsn => "dsn",
            Form::Arf => "arf",
            Form::AutoReply => "auto_reply",
            Form::NonStandard(family) | Form::Webhook(family) => family,
            Form::Unknown => "unknown",
        }
    }
}

/// What a report says about one recipient.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    /// Lower-cased addr-spec: a DSN's Original-Recipient when it is rfc822,
    /// else its Final-Recipient; an ARF report's Original-Rcpt-To, else the
    /// original message's single To address; an automatic reply's From.
    /// `None` when the report names none that is a plausible address.
    pub recipient: Option<String>,
    pub kind: Kind,
    /// Enhanced status code (`5.1.1`), or the SMTP reply code (`550`) when
    /// only that is known.
    pub status: Option<String>,
    /// The Diagnostic-Code or the reason text: unfolded, control characters
    /// removed, at most 1,000 characters. For a feedback report, its
    /// Feedback-Type; for an automatic reply, its Subject.
    pub diagnostic: Option<String>,
}

/// What happened to one recipient, as the project classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A permanent failure: the address is dead.
    HardBounce,
    /// Given up for a temporary reason (a 4.x.x failure, a full mailbox).
    SoftBounce,
    /// Still being retried.
    Delayed,
    /// The recipient complained (an ARF report other than `not-spam`).
    Complaint,
    /// An automatic reply.
    AutoReply,
    /// Nothing to act on (delivered, relayed, expanded, or not classifiable).
    Unknown,
}

impl Kind {
    pub fn as_str(&self) -> &'static str {
        match self {
            Kind::HardBounce => "hard_bounce",
            Kind::SoftBounce => "soft_bounce",
            Kind::Delayed => "delayed",
            Kind::Complaint => "complaint",
            Kind::AutoReply => "auto_reply",
            Kind::Unknown => "unknown",
        }
    }
}

/// Reads a delivery report. Never fails: what cannot be read is left out,
/// and a message that is no report is [`Form::Unknown`] with no items.
pub fn parse_report(raw: &[u8]) -> Report {
    let raw = raw.get(..raw.len().min(MAX_INPUT)).unwrap_or(raw);
    let ctx = Context::new(mime::walk(raw));
    let mut found = Found::default();
    let mut items = Items::default();

    let form = if arf::parse(&ctx, &mut items, &mut found) {
        Form::Arf
    } else if dsn::parse(&ctx, &mut items, &mut found) {
        if items.is_empty() {
            // A DSN whose field groups named no one: its text may.
            bounce::parse(&ctx, &mut items);
        }
        Form::Dsn
    } else if let Some(family) = bounce::parse(&ctx, &mut items) {
        Form::NonStandard(family)
    } else if autoreply::parse(&ctx, &mut items) {
        Form::AutoReply
    } else {
        Form::Unknown
    };

    let mut report = Report {
        form,
        items: Vec::new(),
        original_message_id: None,
        relay_queue_ids: Vec::new(),
        addressed_to: ctx.addressed_to(),
        from: ctx.from.clone(),
        original_sender: None,
    };
    if form == Form::Unknown {
        return report;
    }
    report.items = items.into_vec();
    let embedded = ctx.embedded_headers();
    report.original_message_id = embedded
        .as_ref()
        .and_then(|h| h.get("message-id"))
        .and_then(text::message_id)
        .or(found.message_id)
        .or_else(|| {
            if form == Form::AutoReply {
                // What a reply answers; its body is a person's text.
                ctx.root()
                    .headers
                    .get("in-reply-to")
                    .and_then(text::message_id)
            } else {
                ctx.message_id_in_text()
            }
        });
    report.original_sender = found.original_sender.or_else(|| {
        embedded
            .as_ref()
            .and_then(|h| h.get("return-path"))
            .and_then(text::addr_spec)
    });
    found.queue_ids.extend(ctx.queued_as());
    report.relay_queue_ids = dedup(found.queue_ids, MAX_QUEUE_IDS);
    report
}

/// What recognisers find besides the items.
#[derive(Debug, Default)]
struct Found {
    /// The original Message-ID where the report gives it outside an
    /// embedded header section (a DSN's `X-Original-Message-ID`).
    message_id: Option<String>,
    queue_ids: Vec<String>,
    original_sender: Option<String>,
}

/// The items of a report, capped at [`MAX_ITEMS`], exact repeats dropped.
#[derive(Debug, Default)]
struct Items {
    items: Vec<Item>,
    seen: HashSet<(Option<String>, Kind, Option<String>)>,
}

impl Items {
    /// Adds an item; false once the cap is reached (stop looking).
    fn push(&mut self, item: Item) -> bool {
        if self.items.len() >= MAX_ITEMS {
            return false;
        }
        let key = (item.recipient.clone(), item.kind, item.status.clone());
        if self.seen.insert(key) {
            self.items.push(item);
        }
        self.items.len() < MAX_ITEMS
    }

    fn is_full(&self) -> bool {
        self.items.len() >= MAX_ITEMS
    }

    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    fn into_vec(self) -> Vec<Item> {
        self.items
    }
}

/// The report as the recognisers see it: its parts, its own header fields
/// read once, and its human-readable text.
struct Context<'a> {
    parts: Vec<Part<'a>>,
    /// The decoded Subject.
    subject: String,
    subject_lower: String,
    from: Option<String>,
    /// The text/plain parts (or, when there are none, the text/html ones as
    /// text), outside embedded messages, joined; at most [`MAX_TEXT`] octets.
    text: String,
    /// `text`, ASCII-lower-cased: offsets in one index the other.
    text_lower: String,
    /// Whether the report as a whole says it is a warning, not a failure.
    delay_notice: bool,
}

impl<'a> Context<'a> {
    fn new(parts: Vec<Part<'a>>) -> Self {
        let root = parts.first();
        let subject = root
            .and_then(|p| p.headers.decoded("subject"))
            .map(|s| text::clean(&s))
            .unwrap_or_default();
        let from = root.and_then(|p| p.headers.addresses("from").into_iter().next());
        let text = human_text(&parts);
        let text_lower = text::ascii_lower(&text);
        let subject_lower = text::ascii_lower(&subject);
        let delay_notice = text::contains_any(
            &subject_lower,
            &[
                "delay",
                "warning",
                "still being retried",
                "not yet been delivered",
            ],
        ) || text::contains_any(
            &text_lower,
            &[
                "this is a warning only",
                "have not yet been delivered",
                "has not yet been delivered",
                "has been delayed",
                "will continue to try",
                "will keep trying",
            ],
        );
        Context {
            parts,
            subject,
            subject_lower,
            from,
            text,
            text_lower,
            delay_notice,
        }
    }

    /// The message itself (`mime::walk` always yields it first).
    fn root(&self) -> &Part<'a> {
        self.parts.first().unwrap_or(&mime::EMPTY_PART)
    }

    /// Delivered-To, X-Original-To, To: lower-cased, deduplicated.
    fn addressed_to(&self) -> Vec<String> {
        let headers = &self.root().headers;
        let mut all: Vec<String> = Vec::new();
        for name in ["delivered-to", "x-original-to"] {
            all.extend(headers.all(name).filter_map(text::addr_spec));
        }
        all.extend(headers.addresses("to"));
        dedup(all, MAX_ADDRESSED_TO)
    }

    /// The header section of the first embedded original message
    /// (message/rfc822, message/global, text/rfc822-headers and the like)
    /// that has a Message-ID, else of the first one.
    fn embedded_headers(&self) -> Option<mime::Headers> {
        let mut first = None;
        for part in self
            .parts
            .iter()
            .filter(|p| is_embedded(&p.content_type.mime))
        {
            let (headers, _) = mime::header_section(&part.body);
            if headers.has("message-id") {
                return Some(headers);
            }
            first.get_or_insert(headers);
        }
        first
    }

    /// The first `Message-ID:` line of the returned headers quoted in the
    /// text.
    fn message_id_in_text(&self) -> Option<String> {
        let lower = self.text_lower.as_bytes();
        for at in memchr::memmem::find_iter(lower, b"message-id:") {
            let line_start = at == 0 || lower.get(at - 1) == Some(&b'\n');
            if !line_start {
                continue;
            }
            let rest = self
                .text
                .get(at + "message-id:".len()..)
                .unwrap_or_default();
            // The value, and the next line when the field was folded there.
            let mut lines = rest.lines();
            let mut value = text::prefix(lines.next().unwrap_or_default(), 2000).to_owned();
            if value.trim().is_empty() {
                let next = lines.next().unwrap_or_default();
                if next.starts_with([' ', '\t']) {
                    value = text::prefix(next, 2000).to_owned();
                }
            }
            if let Some(id) = text::message_id(&value) {
                return Some(id);
            }
        }
        None
    }

    /// The ids after `queued as` in the text and in delivery-status parts.
    fn queued_as(&self) -> Vec<String> {
        let mut ids = Vec::new();
        let dsn_texts: Vec<String> = self
            .parts
            .iter()
            .filter(|p| dsn::is_dsn_type(&p.content_type.mime))
            .map(Part::text)
            .collect();
        let dsn_lower: Vec<String> = dsn_texts.iter().map(|t| text::ascii_lower(t)).collect();
        let texts =
            std::iter::once((&self.text, &self.text_lower)).chain(dsn_texts.iter().zip(&dsn_lower));
        for (original, lower) in texts {
            for at in memchr::memmem::find_iter(lower.as_bytes(), b"queued as ") {
                let rest = original.get(at + "queued as ".len()..).unwrap_or_default();
                ids.extend(text::queue_id(text::prefix(rest, 80)));
                if ids.len() >= MAX_QUEUE_IDS {
                    return ids;
                }
            }
        }
        ids
    }
}

/// Whether a part of this type holds the original message or its headers.
fn is_embedded(mime: &str) -> bool {
    matches!(
        mime,
        "message/rfc822"
            | "message/global"
            | "text/rfc822-headers"
            | "message/rfc822-headers"
            | "message/global-headers"
    )
}

/// The report's human-readable text: its text/plain leaves (text/html ones
/// when there is none), joined by blank lines, with LF line ends, at most
/// [`MAX_TEXT`] octets.
fn human_text(parts: &[Part<'_>]) -> String {
    let leaves = |html: bool| {
        parts.iter().filter(move |p| {
            if html {
                p.content_type.is("text/html")
            } else {
                p.is_plain_text()
            }
        })
    };
    let mut out = String::new();
    for part in leaves(false) {
        push_text(&mut out, &part.text());
        if out.len() >= MAX_TEXT {
            break;
        }
    }
    if out.trim().is_empty() {
        out.clear();
        for part in leaves(true) {
            push_text(
                &mut out,
                &mail_parser::decoders::html::html_to_text(&part.text()),
            );
            if out.len() >= MAX_TEXT {
                break;
            }
        }
    }
    text::prefix(&out, MAX_TEXT).to_owned()
}

/// Appends a part's text with LF line ends.
fn push_text(out: &mut String, part: &str) {
    if !out.is_empty() {
        out.push_str("\n\n");
    }
    let part = text::prefix(part, MAX_TEXT.saturating_sub(out.len()));
    out.push_str(&part.replace("\r\n", "\n"));
}

/// `values` without repeats, in order, at most `max`.
fn dedup(values: Vec<String>, max: usize) -> Vec<String> {
    let mut seen = HashSet::new();
    values
        .into_iter()
        .filter(|v| seen.insert(v.clone()))
        .take(max)
        .collect()
}

/// An item for `recipient` with `reason` cleaned into its diagnostic.
fn item(recipient: Option<String>, kind: Kind, status: Option<String>, reason: &str) -> Item {
    let diagnostic = text::clean(reason);
    Item {
        recipient,
        kind,
        status,
        diagnostic: (!diagnostic.is_empty()).then_some(diagnostic),
    }
}
