//! What operators read back from the database: one mail with its
//! attachments and history (`tablemail show`, the console's mail page), the
//! failures of the last hour by stage and reply, the daemons draining the
//! queue, and the per-minute counts behind the rates and the console's chart.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize};

/// How an operator names one mail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MailLookup {
    Id(i64),
    MessageId(String),
    DedupeKey(String),
}

impl MailLookup {
    /// The row id a Message-ID that this daemon assigned carries
    /// (`<nonce.ID@host>`): such a lookup is one by primary key, checked
    /// against the stored Message-ID, instead of a scan of the table.
    pub fn assigned_id(message_id: &str) -> Option<i64> {
        let inner = message_id.strip_prefix('<')?.strip_suffix('>')?;
        let (left, _) = inner.split_once('@')?;
        let (nonce, id) = left.split_once('.')?;
        let nonce_ok = nonce.len() == 32 && nonce.bytes().all(|b| b.is_ascii_hexdigit());
        if !nonce_ok || id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        id.parse().ok()
    }
}

/// One mail as `tablemail show --json` prints it (DESIGN §8: these keys are
/// a contract).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MailRecord {
    pub id: i64,
    pub status: String,
    pub attempts: i32,
    pub attempts_remaining: i32,
    pub priority: i32,
    pub created_at: DateTime<Utc>,
    pub send_at: DateTime<Utc>,
    pub processed_at: Option<DateTime<Utc>>,
    /// When an operator last retried it; expiry counts from the later of
    /// this and `created_at`.
    pub retried_at: Option<DateTime<Utc>>,
    pub message_id: Option<String>,
    pub dedupe_key: Option<String>,
    pub last_error: Option<String>,
    /// The relay's reply to "." of the attempt that sent it.
    pub relay_reply: Option<String>,
    pub subject: String,
    /// The sender, recipients and bodies: only when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<RecordContent>,
    pub attachments: Vec<AttachmentInfo>,
    pub events: Vec<EventRow>,
}

/// The parts of a mail that are not shown unless asked for.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RecordContent {
    pub from_name: Option<String>,
    pub from_address: Option<String>,
    pub to_address: String,
    pub cc: Option<String>,
    pub bcc: Option<String>,
    pub reply_to: Option<String>,
    pub body: Option<String>,
    pub body_html: Option<String>,
    pub headers: Option<String>,
}

/// An attachment without its bytes.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct AttachmentInfo {
    pub filename: String,
    pub content_type: String,
    pub size: i64,
    pub content_id: Option<String>,
}

/// One row of a mail's history.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct EventRow {
    pub at: DateTime<Utc>,
    pub attempt: i32,
    pub outcome: String,
    pub stage: Option<String>,
    pub smtp_code: Option<i32>,
    pub detail: Option<String>,
}

/// How many attempts of the last hour came to the same thing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureGroup {
    /// The event's outcome (`failed`, `retry`, `deferred`…).
    pub outcome: String,
    pub stage: Option<String>,
    pub smtp_code: Option<i32>,
    pub count: i64,
    /// The newest detail of the group, as an example.
    pub example: Option<String>,
}

/// A daemon draining the queue, as it last reported itself.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DaemonRow {
    pub id: String,
    pub host: String,
    pub pid: i32,
    pub version: String,
    pub started_at: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
    pub in_flight: i32,
    /// Mails it sent since it started.
    pub sent: i64,
    /// It has not reported for longer than [`SILENT_AFTER_SECONDS`]: it
    /// died, hangs, or cannot reach the database.
    pub silent: bool,
}

/// A daemon reports every few seconds; after this long without a report it
/// is marked silent.
pub const SILENT_AFTER_SECONDS: i64 = 30;

/// What a daemon reports about itself every few seconds.
#[derive(Debug, Clone)]
pub struct DaemonBeat {
    pub id: uuid::Uuid,
    pub host: String,
    pub pid: i32,
    pub version: String,
    pub in_flight: i32,
    /// Mails sent since start.
    pub sent_total: i64,
    /// Mails sent and failed since the last report, counted into the
    /// current minute.
    pub sent_since: i64,
    pub failed_since: i64,
}

/// Mails sent and failed in one minute, by every daemon together.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct MinuteCount {
    pub minute: DateTime<Utc>,
    pub sent: i64,
    pub failed: i64,
}

/// What the console's mail list may filter on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MailFilter {
    pub status: Option<String>,
    /// The recipient domain (of `to_address`, `cc` or `bcc`).
    pub domain: Option<String>,
    pub id: Option<i64>,
    pub message_id: Option<String>,
    pub dedupe_key: Option<String>,
    /// Only mails with a smaller id (the next page, newest first).
    pub before_id: Option<i64>,
}

/// One line of the console's mail list: no body, no full address.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct MailSummary {
    pub id: i64,
    pub status: String,
    pub priority: i32,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub send_at: DateTime<Utc>,
    pub processed_at: Option<DateTime<Utc>>,
    /// The recipients' domains, comma separated.
    pub domains: String,
    pub subject: String,
    pub last_error: Option<String>,
}

/// An attachment as `enqueue --jsonl` takes it: `{"filename",
/// "content_type", "content_base64", "content_id"}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewAttachment {
    pub filename: String,
    /// Default `application/octet-stream`.
    #[serde(default)]
    pub content_type: Option<String>,
    #[serde(rename = "content_base64", deserialize_with = "base64_bytes")]
    pub content: Vec<u8>,
    #[serde(default)]
    pub content_id: Option<String>,
}

/// The type of an attachment inserted without one.
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";

fn base64_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    use base64::Engine as _;
    let text = String::deserialize(d)?;
    base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .map_err(|e| serde::de::Error::custom(format!("content_base64: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assigned_message_ids_carry_their_row() {
        let nonce = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            MailLookup::assigned_id(&format!("<{nonce}.12345@host.example>")),
            Some(12345)
        );
        for other in [
            "<12345@host>".to_string(),
            format!("<{nonce}.12x@host>"),
            format!("<{nonce}.@host>"),
            format!("{nonce}.1@host"),
            "<order-42@shop.example>".to_string(),
        ] {
            assert_eq!(MailLookup::assigned_id(&other), None, "{other}");
        }
    }

    #[test]
    fn attachments_arrive_as_base64() {
        let a: NewAttachment = serde_json::from_str(
            r#"{"filename": "a.bin", "content_base64": "AAEC/w==", "content_id": "x"}"#,
        )
        .unwrap();
        assert_eq!(a.content, vec![0, 1, 2, 255]);
        assert!(serde_json::from_str::<NewAttachment>(
            r#"{"filename": "a", "content_base64": "not base64!"}"#
        )
        .is_err());
    }
}
