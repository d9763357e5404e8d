//! What an application (or `tablemail enqueue`) inserts: a mail with the
//! column names of `mail_queue`, and its attachments.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer};

/// One mail to insert, with the column names of `mail_queue`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewMail {
    pub to_address: String,
    #[serde(default)]
    pub subject: Option<String>,
    #[serde(default)]
    pub body: Option<String>,
    #[serde(default)]
    pub body_html: Option<String>,
    #[serde(default)]
    pub cc: Option<String>,
    #[serde(default)]
    pub bcc: Option<String>,
    #[serde(default)]
    pub reply_to: Option<String>,
    #[serde(default)]
    pub from_name: Option<String>,
    #[serde(default)]
    pub from_address: Option<String>,
    #[serde(default)]
    pub priority: Option<i32>,
    #[serde(default)]
    pub send_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub attempts_remaining: Option<i32>,
    #[serde(default)]
    pub dedupe_key: Option<String>,
    #[serde(default)]
    pub headers: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub message_id: Option<String>,
    /// The route it takes (DESIGN §13); `None`: its From domain's.
    #[serde(default)]
    pub route: Option<String>,
    /// The template it is rendered with at send time (DESIGN §15), its
    /// data and the locale wanted.
    #[serde(default)]
    pub template: Option<String>,
    #[serde(default)]
    pub template_data: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub locale: Option<String>,
    /// Sent even to recipients on the suppression list (DESIGN §12).
    #[serde(default)]
    pub bypass_suppression: Option<bool>,
    /// Inserted with the mail, in the same transaction, in this order.
    #[serde(default)]
    pub attachments: Vec<NewAttachment>,
}

/// The result of inserting one [`NewMail`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    pub id: i64,
    /// Its `dedupe_key` was already taken; `id` is the existing row.
    pub duplicate: bool,
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
