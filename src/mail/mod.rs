//! A [`Draft`] (a row's columns and its attachments, borrowed) -> the
//! message's bytes and envelope, written by our own MIME writer in time and
//! memory linear in the size of the row: the header section is written on
//! its own, the body sized (from one scan of each body), then the message
//! written once into a buffer allocated at that size, and DKIM-signed when
//! configured. Everything refused here is a permanent failure that never
//! opens an SMTP session.
//!
//! # Layout
//! - [`address`]: address lists (one pass), checks, IDN domains as A-labels.
//! - [`header`]: folding (≤ 78 where possible, ≤ 998 always), RFC 2047
//!   encoded-words, control characters refused, the `headers` column.
//! - [`body`]: CRLF line endings and the transfer encoding, chosen from one
//!   scan and written in one pass.
//! - [`mime`]: the structure (alternative, related, mixed), boundaries,
//!   attachment parts and their content types.
//!
//! lettre is used for its `Address` and `Envelope` only (the SMTP client
//! takes them). Its message builder was quadratic in the number of
//! recipients and headers, folded only at spaces (lines of over 998
//! octets), and had no attachments.

mod address;
mod body;
mod header;
mod mime;

use std::collections::{BTreeSet, HashSet};

use lettre::Address;

pub use address::parse_address;
pub use header::{MAX_EXTRA_HEADERS, MAX_HEADERS_JSON};

use address::Mailbox;
use header::{Count, ExtraHeader, Field, Out};
use mime::Node;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MailError {
    #[error("invalid address in {field}: {reason}")]
    InvalidAddress { field: &'static str, reason: String },
    #[error("CR, LF or NUL in {field}")]
    LineBreak { field: String },
    #[error("control character in {field}")]
    ControlCharacter { field: String },
    #[error("invalid header {name:?}: {reason}")]
    InvalidHeader { name: String, reason: String },
    #[error("more than {max} headers in the headers column")]
    TooManyHeaders { max: usize },
    #[error("the headers column is {size} bytes: over the limit of {max}")]
    HeadersTooLarge { size: usize, max: usize },
    #[error("message_id must look like <id@domain>: {0}")]
    MessageId(String),
    #[error("attachment {number}: {reason}")]
    Attachment { number: usize, reason: String },
    #[error("no recipient")]
    NoRecipient,
    #[error("{count} recipients: over transport.max_recipients ({max})")]
    TooManyRecipients { count: usize, max: usize },
    #[error("no sender: the row has no from_address and defaults.from_address is not set")]
    NoSender,
    #[error("message of {size} bytes is over transport.max_message_size ({max} bytes)")]
    TooLarge { size: usize, max: u64 },
    #[error("{column} is not UTF-8 text (a bad octet at offset {at})")]
    NotUtf8 { column: &'static str, at: usize },
    #[error("cannot build the message: {0}")]
    Build(String),
    #[error("{0}")]
    Field(String),
    /// The row's template is missing or failed to render (DESIGN §15).
    #[error("{0}")]
    Template(#[from] crate::templates::TemplateError),
}

/// What every message takes from the configuration.
#[derive(Debug, Clone)]
pub struct MessageDefaults {
    pub from_address: Option<Address>,
    pub from_name: Option<String>,
    pub max_message_size: u64,
    /// Most recipients (to, cc and bcc together) of one mail.
    pub max_recipients: usize,
    /// The DKIM keys (`[[dkim]]`, routes' keys); `None`: nothing is signed.
    pub dkim: Option<std::sync::Arc<crate::dkim::Signers>>,
    /// The VERP envelope sender (`bounce.*`, DESIGN §12): every mail leaves
    /// with `MAIL FROM:<b-<id>-<tag>@<bounce.domain>>`.
    pub bounce: Option<std::sync::Arc<crate::feedback::verp::Verp>>,
}

/// A message ready for the wire.
#[derive(Debug, Clone)]
pub struct PreparedMail {
    pub envelope: lettre::address::Envelope,
    pub bytes: Vec<u8>,
    /// Recipient domains (A-labels), sorted, for throttling and the logs
    /// (never the full address).
    pub recipient_domains: Vec<String>,
    /// An address has a non-ASCII local part: only a relay that offers
    /// SMTPUTF8 (RFC 6531) may take the mail. Domains never need it: they
    /// are written as A-labels.
    pub needs_smtputf8: bool,
}

impl PreparedMail {
    pub fn domains(&self) -> impl Iterator<Item = &str> {
        self.recipient_domains.iter().map(String::as_str)
    }
}

/// One attachment of a mail (a `mail_attachment` row), borrowed.
#[derive(Debug, Clone, Copy)]
pub struct Attachment<'a> {
    /// Shown to the reader; any text without control characters.
    pub filename: &'a str,
    /// `type/subtype`, optionally with well-formed parameters.
    pub content_type: &'a str,
    pub content: &'a [u8],
    /// Set: an inline part, referenced from the HTML as `cid:<content_id>`.
    pub content_id: Option<&'a str>,
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
    /// In the order they go out (`mail_attachment.id`).
    pub attachments: &'a [Attachment<'a>],
}

/// Octet lengths of a row's columns, as a claim can read them in SQL
/// without loading the columns themselves.
#[derive(Debug, Clone, Copy, Default)]
pub struct ColumnSizes<'a> {
    pub subject: u64,
    pub body: u64,
    pub body_html: u64,
    /// The `headers` column's JSON text.
    pub headers: u64,
    /// Each attachment's content. One total for all of them gives a lower
    /// bound too (a little less tight).
    pub attachments: &'a [u64],
}

/// The least header section any message has (From, Subject, Date,
/// Message-ID, MIME-Version, a Content-Type and the blank line).
const LEAST_HEADERS: u64 = 128;
/// The least an attachment adds beside its base64: its delimiter line and
/// its Content-Type, Content-Transfer-Encoding and Content-Disposition.
const LEAST_PART_HEADERS: u64 = 128;
/// The longest Message-ID an application may give (RFC 5322 allows a line
/// of 998; this keeps it a sane identifier).
const MAX_MESSAGE_ID: usize = 250;
/// Room for a header section as most mail has it (From, To, Subject, Date,
/// Message-ID, the MIME fields: 400–700 octets); a longer one grows it.
const HEAD_CAPACITY: usize = 1024;

/// A lower bound of the size of the message built from columns of these
/// sizes, from the lengths alone: a mail over the limit by this bound fails
/// before its bodies or attachments are loaded. Text never shrinks when it
/// is encoded; JSON text is at most six times the header text it holds.
pub fn min_encoded_size(sizes: &ColumnSizes<'_>) -> u64 {
    let attachments: u64 = sizes
        .attachments
        .iter()
        .map(|&n| body::base64_len(n as usize) as u64 + LEAST_PART_HEADERS)
        .sum();
    LEAST_HEADERS + sizes.subject + sizes.body + sizes.body_html + sizes.headers / 6 + attachments
}

/// The message of a draft, checked and sized, ready to be written.
struct Message<'a> {
    from: Mailbox<'a>,
    to: Vec<Mailbox<'a>>,
    cc: Vec<Mailbox<'a>>,
    reply_to: Vec<Mailbox<'a>>,
    subject: &'a str,
    date: &'a str,
    message_id: &'a str,
    root: Node<'a>,
    extra: Vec<ExtraHeader<'a>>,
}

impl Message<'_> {
    /// The header section, through the empty line that ends it: written
    /// once (its encoded words and folds cost more than copying it).
    fn write_head(&self, out: &mut Vec<u8>) {
        address::write_list(out, "From", std::slice::from_ref(&self.from));
        for (name, list) in [
            ("To", &self.to),
            ("Cc", &self.cc),
            ("Reply-To", &self.reply_to),
        ] {
            // Bcc is never a header: it is in the envelope only.
            if !list.is_empty() {
                address::write_list(out, name, list);
            }
        }
        header::unstructured(out, "Subject", self.subject);
        for (name, value) in [
            ("Date", self.date),
            ("Message-ID", self.message_id),
            ("MIME-Version", "1.0"),
        ] {
            let mut field = Field::new(out, name);
            field.word(b" ", &[value.as_bytes()]);
            field.end();
        }
        self.root.write_headers(out);
        for header in &self.extra {
            header.write(out);
        }
        out.put(b"\r\n");
    }

    /// The body: the same code sizes it (into a [`Count`], from its parts'
    /// planned lengths) and writes it.
    fn write_body<O: Out>(&self, out: &mut O) {
        self.root.write_body(out);
        if matches!(self.root, Node::Multi { .. }) {
            out.put(b"\r\n");
        }
    }
}

/// The row's text columns checked for line breaks and control characters.
fn check_columns(mail: &Draft<'_>) -> Result<(), MailError> {
    let columns = [
        ("to_address", Some(mail.to_address)),
        ("cc", mail.cc),
        ("bcc", mail.bcc),
        ("reply_to", mail.reply_to),
        ("from_name", mail.from_name),
        ("subject", Some(mail.subject)),
    ];
    for (field, value) in columns {
        if let Some(value) = value {
            header::check_text(|| field.to_string(), value)?;
        }
    }
    Ok(())
}

/// How the suppression list keys an address (DESIGN §12): lower-cased,
/// the domain as A-labels.
pub fn suppression_key(address: &Address) -> String {
    let mut key = String::with_capacity(address.user().len() + address.domain().len() + 1);
    key.push_str(address.user());
    key.push('@');
    key.push_str(address.domain());
    key.make_ascii_lowercase();
    if !key.is_ascii() {
        key = key.to_lowercase();
    }
    key
}

/// An address as an operator or a report gives it (`a@example.com`, with
/// or without angle brackets), as its suppression key.
pub fn address_key(text: &str) -> Result<String, MailError> {
    let text = text.trim();
    let text = text
        .strip_prefix('<')
        .and_then(|t| t.strip_suffix('>'))
        .unwrap_or(text);
    address::parse_bare("address", text).map(|a| suppression_key(&a))
}

/// The envelope recipients of a row (to, cc, bcc) as suppression keys,
/// without repeats. None when a list does not parse or holds more than
/// `max` addresses: such a mail fails when it is built, and the lookup
/// would be wasted.
pub fn recipient_keys(to: &str, cc: Option<&str>, bcc: Option<&str>, max: usize) -> Vec<String> {
    let lists = [Some(to), cc, bcc];
    let count: usize = lists
        .iter()
        .flatten()
        .map(|list| address::entries(list).count())
        .sum();
    if count > max {
        return Vec::new();
    }
    let mut keys: Vec<String> = Vec::with_capacity(count);
    for (field, list) in ["to_address", "cc", "bcc"].into_iter().zip(lists) {
        let Ok(mailboxes) = address::parse_list(field, list) else {
            return Vec::new();
        };
        for mailbox in mailboxes {
            let key = suppression_key(&mailbox.address());
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }
    keys
}

/// Leaves the addresses `out` (suppression keys) out of the envelope, and
/// their domains out of the recipient domains when no other recipient has
/// them; `false` when no recipient is left.
pub fn leave_out(prepared: &mut PreparedMail, out: &[String]) -> bool {
    let kept: Vec<Address> = prepared
        .envelope
        .to()
        .iter()
        .filter(|a| !out.contains(&suppression_key(a)))
        .cloned()
        .collect();
    if kept.is_empty() {
        return false;
    }
    let domains: BTreeSet<String> = kept.iter().map(|a| a.domain().to_string()).collect();
    prepared.recipient_domains = domains.into_iter().collect();
    prepared.envelope = lettre::address::Envelope::new(prepared.envelope.from().cloned(), kept)
        .expect("a sender and at least one recipient");
    true
}

/// Replaces the envelope sender (VERP, DESIGN §12); the From header stays.
pub fn set_envelope_sender(prepared: &mut PreparedMail, sender: &str) -> Result<(), MailError> {
    let sender = address::parse_bare("bounce.domain", sender)?;
    prepared.envelope =
        lettre::address::Envelope::new(Some(sender), prepared.envelope.to().to_vec())
            .map_err(|e| MailError::Build(e.to_string()))?;
    Ok(())
}

/// Builds the message of a draft.
pub fn prepare(mail: &Draft<'_>, defaults: &MessageDefaults) -> Result<PreparedMail, MailError> {
    let max_size = defaults.max_message_size;
    // Over the limit by the columns' lengths alone: not built at all.
    let attachment_sizes: Vec<u64> = mail
        .attachments
        .iter()
        .map(|a| a.content.len() as u64)
        .collect();
    let least = min_encoded_size(&ColumnSizes {
        subject: mail.subject.len() as u64,
        body: mail.body.map_or(0, |b| b.len() as u64),
        body_html: mail.body_html.map_or(0, |b| b.len() as u64),
        headers: mail.headers.map_or(0, |h| h.len() as u64),
        attachments: &attachment_sizes,
    });
    if least > max_size {
        return Err(MailError::TooLarge {
            size: least as usize,
            max: max_size,
        });
    }
    check_columns(mail)?;

    let from_address = match mail.from_address {
        Some(a) if !a.trim().is_empty() => address::parse_bare("from_address", a)?,
        _ => defaults.from_address.clone().ok_or(MailError::NoSender)?,
    };
    let from_name = match mail.from_name {
        Some(name) => Some(name),
        None => {
            let name = defaults.from_name.as_deref();
            if let Some(name) = name {
                header::check_text(|| "defaults.from_name".into(), name)?;
            }
            name
        }
    };
    let from = Mailbox {
        name: from_name
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(Into::into),
        local: from_address.user(),
        domain: from_address.domain().into(),
    };

    // Counted with a cheap split before anything is parsed: a row with
    // 100,000 recipients costs one pass over its text.
    let count: usize = [Some(mail.to_address), mail.cc, mail.bcc]
        .into_iter()
        .flatten()
        .map(|list| address::entries(list).count())
        .sum();
    if count > defaults.max_recipients {
        return Err(MailError::TooManyRecipients {
            count,
            max: defaults.max_recipients,
        });
    }
    if count == 0 {
        return Err(MailError::NoRecipient);
    }
    let to = address::parse_list("to_address", Some(mail.to_address))?;
    let cc = address::parse_list("cc", mail.cc)?;
    let bcc = address::parse_list("bcc", mail.bcc)?;
    let reply_to = address::parse_list("reply_to", mail.reply_to)?;

    let generated;
    let message_id = match mail.message_id {
        Some(id) => {
            check_message_id(id)?;
            id
        }
        None => {
            generated = format!("<{}@{}>", uuid::Uuid::new_v4().simple(), local_hostname());
            &generated
        }
    };
    let extra = header::extra_headers(mail.headers)?;
    let files = mail
        .attachments
        .iter()
        .enumerate()
        .map(|(i, a)| mime::file_part(i + 1, a))
        .collect::<Result<Vec<_>, _>>()?;
    let multipart = !files.is_empty() || (mail.body.is_some() && mail.body_html.is_some());
    let random = if multipart {
        crate::random::next_u128()
    } else {
        0
    };
    let root = mime::structure(mail.body, mail.body_html, files, random);

    let now = chrono::Utc::now();
    let date = now.to_rfc2822();
    let needs_smtputf8 = from.needs_smtputf8()
        || to
            .iter()
            .chain(&cc)
            .chain(&bcc)
            .chain(&reply_to)
            .any(Mailbox::needs_smtputf8);
    // One RCPT per address: a look through the few, a set for the many.
    let mut recipients: Vec<Address> = Vec::with_capacity(count);
    let mut seen: HashSet<(&str, &str)> = HashSet::new();
    let mut domains = BTreeSet::new();
    for mailbox in to.iter().chain(&cc).chain(&bcc) {
        let key = (mailbox.local, mailbox.domain.as_ref());
        let new = if count <= 16 {
            !recipients.iter().any(|r| (r.user(), r.domain()) == key)
        } else {
            seen.insert(key)
        };
        if new {
            domains.insert(mailbox.domain.as_ref());
            recipients.push(mailbox.address());
        }
    }
    let recipient_domains = domains.into_iter().map(str::to_string).collect();
    let envelope = lettre::address::Envelope::new(Some(from_address.clone()), recipients)
        .map_err(|e| MailError::Build(e.to_string()))?;

    let message = Message {
        from,
        to,
        cc,
        reply_to,
        subject: mail.subject,
        date: &date,
        message_id,
        root,
        extra,
    };
    // The header section written first, on its own; the body sized from
    // its parts' planned lengths (exactly, or within a few percent when a
    // part is quoted-printable); then the message written once into a
    // buffer of that size: the header section copied, the body encoded.
    let mut head = Vec::with_capacity(HEAD_CAPACITY);
    message.write_head(&mut head);
    let mut body = Count::default();
    message.write_body(&mut body);
    let size = head.len() + body.len;
    if body.exact && size as u64 > max_size {
        return Err(MailError::TooLarge {
            size,
            max: max_size,
        });
    }
    let mut bytes = Vec::with_capacity(size);
    bytes.extend_from_slice(&head);
    drop(head);
    message.write_body(&mut bytes);
    debug_assert!(bytes.len() <= size && bytes.capacity() == size);
    debug_assert!(!body.exact || bytes.len() == size);
    if bytes.len() as u64 > max_size {
        return Err(MailError::TooLarge {
            size: bytes.len(),
            max: max_size,
        });
    }

    let signer = defaults
        .dkim
        .as_ref()
        .and_then(|signers| signers.pick(from_address.domain()));
    if let Some(signer) = signer {
        // The signature goes in front: one copy of the message, in the
        // signer, against an RSA signature's millisecond.
        bytes = signer.sign(&bytes, now.timestamp());
        if bytes.len() as u64 > max_size {
            return Err(MailError::TooLarge {
                size: bytes.len(),
                max: max_size,
            });
        }
    }
    Ok(PreparedMail {
        envelope,
        bytes,
        recipient_domains,
        needs_smtputf8,
    })
}

/// A Message-ID as the row may give it: an RFC 5322 msg-id
/// `<id-left@id-right>`, id-left dot-atom text, id-right dot-atom text or a
/// `[literal]`, printable ASCII, at most 250 characters.
pub fn check_message_id(id: &str) -> Result<(), MailError> {
    header::check_text(|| "message_id".into(), id)?;
    let bad = |reason: &str| Err(MailError::MessageId(reason.into()));
    if id.len() > MAX_MESSAGE_ID {
        return bad("over 250 characters");
    }
    if !id.is_ascii() {
        return bad("not ASCII");
    }
    let Some(inner) = id.strip_prefix('<').and_then(|i| i.strip_suffix('>')) else {
        return bad("not within angle brackets");
    };
    let Some((left, right)) = inner.split_once('@') else {
        return bad("no '@'");
    };
    if !dot_atom_text(left) {
        return bad("the part before '@' is not dot-atom text");
    }
    let right_ok = match right.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        Some(literal) => {
            !literal.is_empty() && literal.bytes().all(|b| matches!(b, 33..=90 | 94..=126))
        }
        None => dot_atom_text(right),
    };
    if !right_ok {
        return bad("the part after '@' is not dot-atom text or a [literal]");
    }
    Ok(())
}

/// RFC 5322 dot-atom-text: atoms of ASCII atext joined by single dots.
fn dot_atom_text(s: &str) -> bool {
    !s.is_empty()
        && s.split('.')
            .all(|atom| !atom.is_empty() && atom.bytes().all(address::atext))
}

/// This host's name, for EHLO and the right-hand side of Message-IDs: a
/// host name of letters, digits, hyphens and dots, or `localhost`.
pub fn local_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().trim_end_matches('.').to_string())
        .filter(|h| {
            h.split('.').all(|label| {
                !label.is_empty()
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            })
        })
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests;
