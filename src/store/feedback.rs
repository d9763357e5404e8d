//! What the delivery loop keeps (DESIGN §12): reports as received
//! (`mail_feedback`), the history rows they add to a mail, and the
//! suppression list (`mail_suppression`) that keeps mail away from dead or
//! complaining addresses.

use std::time::Duration;

use chrono::{DateTime, Utc};

/// Where a report came from (`mail_feedback.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedbackSource {
    /// `inbound.listen`.
    Smtp,
    /// `tablemail ingest`.
    Ingest,
    /// A provider's webhook.
    Webhook,
}

impl FeedbackSource {
    pub const ALL: [FeedbackSource; 3] = [
        FeedbackSource::Smtp,
        FeedbackSource::Ingest,
        FeedbackSource::Webhook,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FeedbackSource::Smtp => "smtp",
            FeedbackSource::Ingest => "ingest",
            FeedbackSource::Webhook => "webhook",
        }
    }
}

/// What a report says of one recipient (`mail_feedback.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FeedbackKind {
    HardBounce,
    SoftBounce,
    Delayed,
    Complaint,
    AutoReply,
    Unknown,
}

impl FeedbackKind {
    pub const ALL: [FeedbackKind; 6] = [
        FeedbackKind::HardBounce,
        FeedbackKind::SoftBounce,
        FeedbackKind::Delayed,
        FeedbackKind::Complaint,
        FeedbackKind::AutoReply,
        FeedbackKind::Unknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FeedbackKind::HardBounce => "hard_bounce",
            FeedbackKind::SoftBounce => "soft_bounce",
            FeedbackKind::Delayed => "delayed",
            FeedbackKind::Complaint => "complaint",
            FeedbackKind::AutoReply => "auto_reply",
            FeedbackKind::Unknown => "unknown",
        }
    }

    /// The history row a matched report of this kind adds to its mail.
    pub fn event_outcome(self) -> Option<&'static str> {
        match self {
            FeedbackKind::HardBounce => Some("bounced"),
            FeedbackKind::SoftBounce => Some("soft_bounced"),
            FeedbackKind::Delayed => Some("delayed"),
            FeedbackKind::Complaint => Some("complained"),
            FeedbackKind::AutoReply => Some("auto_replied"),
            FeedbackKind::Unknown => None,
        }
    }
}

/// Why an address is on the suppression list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuppressionReason {
    HardBounce,
    SoftBounce,
    Complaint,
    Manual,
}

impl SuppressionReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SuppressionReason::HardBounce => "hard_bounce",
            SuppressionReason::SoftBounce => "soft_bounce",
            SuppressionReason::Complaint => "complaint",
            SuppressionReason::Manual => "manual",
        }
    }

    pub fn parse(text: &str) -> Option<SuppressionReason> {
        Some(match text {
            "hard_bounce" => SuppressionReason::HardBounce,
            "soft_bounce" => SuppressionReason::SoftBounce,
            "complaint" => SuppressionReason::Complaint,
            "manual" => SuppressionReason::Manual,
            _ => return None,
        })
    }
}

/// One recipient of one report, as it is recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedbackItem {
    /// The mail the report proved it saw, if any.
    pub mail_id: Option<i64>,
    /// Lower-cased, the domain as A-labels; what the report named.
    pub recipient: Option<String>,
    pub kind: FeedbackKind,
    pub status: Option<String>,
    pub diagnostic: Option<String>,
    /// The report proved it saw `mail_id` go to `recipient`: only then does
    /// it act (events, suppression, status).
    pub matched: bool,
    /// The SMTP reply code the diagnostic carries, for the history row.
    pub smtp_code: Option<u16>,
}

impl FeedbackItem {
    /// The history row's and the suppression entry's detail: the status
    /// and the receiver's words, within 1,000 characters.
    pub fn event_detail(&self) -> Option<String> {
        let text = match (&self.status, &self.diagnostic) {
            (Some(s), Some(d)) if d.starts_with(s.as_str()) => d.clone(),
            (Some(s), Some(d)) => format!("{s} {d}"),
            (Some(s), None) => s.clone(),
            (None, Some(d)) => d.clone(),
            (None, None) => return None,
        };
        Some(text.chars().take(1000).collect())
    }
}

/// Reports of one kind from one source received lately (the console's
/// overview).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedbackCount {
    /// `smtp`, `ingest` or `webhook` ([`FeedbackSource`]).
    pub source: String,
    pub kind: String,
    pub count: i64,
}

/// How reports turn into suppression (`suppression.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SuppressionPolicy {
    pub soft_bounce_limit: u32,
    pub soft_bounce_window: Duration,
    pub soft_bounce_ttl: Duration,
    pub complaints: bool,
}

impl Default for SuppressionPolicy {
    fn default() -> Self {
        SuppressionPolicy {
            soft_bounce_limit: 3,
            soft_bounce_window: Duration::from_secs(7 * 86_400),
            soft_bounce_ttl: Duration::from_secs(7 * 86_400),
            complaints: true,
        }
    }
}

/// One report to record, in one transaction.
#[derive(Debug, Clone)]
pub struct FeedbackRecord {
    pub source: FeedbackSource,
    /// The report's size in octets.
    pub size: usize,
    /// The report itself, kept only with `inbound.keep_raw`.
    pub raw: Option<Vec<u8>>,
    /// One per recipient the report names (at least one: a report that
    /// names none is recorded as one `unknown` item).
    pub items: Vec<FeedbackItem>,
    /// The recipients the matched mail went to (to, cc and bcc, normalised,
    /// less those left out as suppressed): when every one of them has
    /// hard-bounced, the mail's status becomes `bounced`.
    pub sent_to: Vec<String>,
    pub policy: SuppressionPolicy,
    /// The provider's id of the event (a webhook's, DESIGN §14): the first
    /// item is kept under it, the n-th after it under `KEY#n`. An item whose
    /// key is already kept is a provider's retry: it is not recorded again
    /// and does nothing.
    pub event_key: Option<String>,
}

impl FeedbackRecord {
    /// The key item `index` is kept under (see [`FeedbackRecord::event_key`]).
    pub fn item_key(&self, index: usize) -> Option<String> {
        self.event_key.as_ref().map(|key| match index {
            0 => key.clone(),
            n => format!("{key}#{n}"),
        })
    }
}

/// What recording a report did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeedbackRecorded {
    /// The indexes of the items already kept under their event key:
    /// recorded before, left alone now.
    pub repeated: Vec<usize>,
    /// Addresses added to (or made permanent on) the suppression list.
    pub suppressed: Vec<String>,
    /// The mail whose status became `bounced`.
    pub bounced: Option<i64>,
}

/// A mail a report may be about, with what proves a report saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedbackTarget {
    pub id: i64,
    pub status: String,
    pub message_id: Option<String>,
    pub to_address: String,
    pub cc: Option<String>,
    pub bcc: Option<String>,
    /// Recipients left out of its last attempt as suppressed.
    pub left_out: Vec<String>,
}

/// A suppressed recipient met at send time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suppressed {
    pub address: String,
    pub reason: String,
}

/// A row of the suppression list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuppressionEntry {
    pub address: String,
    pub reason: String,
    pub detail: Option<String>,
    pub mail_id: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
}

/// An address an operator adds (`tablemail suppress add`, `import`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSuppression {
    pub address: String,
    pub reason: SuppressionReason,
    pub detail: Option<String>,
    /// From now; `None`: until removed.
    pub expires_in: Option<Duration>,
}

/// Which part of the suppression list to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SuppressionFilter {
    pub reason: Option<SuppressionReason>,
    /// Addresses containing this text.
    pub search: Option<String>,
    /// Entries whose `expires_at` has passed too.
    pub include_expired: bool,
}

/// A history row about one recipient, written apart from an outcome: a
/// recipient left out of the envelope as suppressed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecipientEvent {
    pub mail_id: i64,
    pub attempt: i32,
    pub outcome: &'static str,
    pub recipient: String,
    pub detail: String,
}

/// What an operator's search text looks for in the suppression list, whose
/// addresses are lower-cased with their domains as A-labels: `bücher` finds
/// `…@xn--bcher-kva.example`. Only the part after an `@` (or, without one,
/// every dot-separated part) that is not ASCII is converted.
pub fn search_key(text: &str) -> String {
    let text = text.trim().to_lowercase();
    let label = |part: &str| -> String {
        if part.is_ascii() {
            return part.to_string();
        }
        idna::domain_to_ascii(part).unwrap_or_else(|_| part.to_string())
    };
    let domain = |d: &str| -> String { d.split('.').map(label).collect::<Vec<_>>().join(".") };
    match text.rsplit_once('@') {
        Some((local, d)) => format!("{local}@{}", domain(d)),
        None => domain(&text),
    }
}

/// The relay's queue id in its reply to "." (`relay_reply`), as the relay's
/// own reports name the mail: Postfix and many others say `queued as
/// 4XyZ`, Exim `id=1abc-000123-Xy`, Sendmail `<id> Message accepted`,
/// Amazon SES `Ok <message id>`. The providers' webhooks (DESIGN §14) name
/// the same ids: SES's `mail.messageId`, SendGrid's `sg_message_id` up to
/// its first dot (`Ok: queued as <id>`), Postmark's `MessageID` (`queued as
/// <uuid>`). `None` when the reply names none (Mailgun's `Great success`).
pub fn relay_queue_id(reply: &str) -> Option<&str> {
    let words: Vec<&str> = reply.split_ascii_whitespace().take(16).collect();
    let lower = |i: usize| words.get(i).map(|w| w.to_ascii_lowercase());
    let marked = words.iter().enumerate().find_map(|(i, word)| {
        if word.eq_ignore_ascii_case("queued") && lower(i + 1).as_deref() == Some("as") {
            return Some(words.get(i + 2).copied());
        }
        if let Some(id) = word.strip_prefix("id=") {
            return Some(Some(id));
        }
        if word.eq_ignore_ascii_case("message") && lower(i + 1).as_deref() == Some("accepted") {
            return Some(i.checked_sub(1).and_then(|j| words.get(j).copied()));
        }
        None
    });
    // SES: `250 Ok 0100018c…-000000`, a long id right after "Ok".
    let found = marked.unwrap_or_else(|| {
        let ok = words
            .iter()
            .take(3)
            .position(|w| w.eq_ignore_ascii_case("ok"))?;
        words.get(ok + 1).copied().filter(|next| next.len() >= 16)
    });
    let id = found?
        .trim_matches(|c: char| matches!(c, '<' | '>' | '(' | ')' | '[' | ']' | ',' | ';' | '.'));
    let plausible = (3..=255).contains(&id.len())
        && id.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'@' | b'=' | b'+')
        });
    plausible.then_some(id)
}

#[cfg(test)]
mod tests {
    use super::{relay_queue_id, search_key};

    #[test]
    fn searches_read_domains_as_a_labels() {
        assert_eq!(search_key("Bücher"), "xn--bcher-kva");
        assert_eq!(
            search_key("dora@Bücher.Example"),
            "dora@xn--bcher-kva.example"
        );
        assert_eq!(search_key("ann@"), "ann@");
        assert_eq!(search_key(" example.org "), "example.org");
    }

    #[test]
    fn queue_ids_are_found_in_the_replies_relays_give() {
        for (reply, id) in [
            ("250 2.0.0 Ok: queued as 4XyZ1AbC", Some("4XyZ1AbC")),
            ("250 OK id=1tQ2xY-000Abc-Zz", Some("1tQ2xY-000Abc-Zz")),
            (
                "250 2.0.0 4ASCbE8x012345 Message accepted for delivery",
                Some("4ASCbE8x012345"),
            ),
            (
                "250 Ok 0100018f2b9c1a2d-1b2c3d4e-5f6a-7b8c-9d0e-1f2a3b4c5d6e-000000",
                Some("0100018f2b9c1a2d-1b2c3d4e-5f6a-7b8c-9d0e-1f2a3b4c5d6e-000000"),
            ),
            ("250 Ok: queued as <abc.def@relay>", Some("abc.def@relay")),
            // SendGrid and Postmark.
            (
                "250 Ok: queued as nhIMmON9SFOPcT0ii4nt2A",
                Some("nhIMmON9SFOPcT0ii4nt2A"),
            ),
            (
                "250 2.0.0 OK: queued as 0a129aee-e1cd-480d-b08d-4f48548ff48d",
                Some("0a129aee-e1cd-480d-b08d-4f48548ff48d"),
            ),
            ("250 2.0.0 Ok", None),
            ("250 Great success", None),
            ("250 ok queued as", None),
            ("250 queued as x", None),
            ("250 queued as a\u{0}b", None),
            ("", None),
        ] {
            assert_eq!(relay_queue_id(reply), id, "{reply}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_reply_is_read_without_panic(reply in ".{0,300}") {
            if let Some(id) = relay_queue_id(&reply) {
                proptest::prop_assert!(id.len() <= 255);
            }
        }
    }
}
