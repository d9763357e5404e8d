//! What operators read back from the database: one mail with its
//! attachments and history (`tablemail show`, the console's mail page), the
//! queue's counts and ages (`status`), the failures of the last hour by stage
//! and reply, the daemons draining the queue, the per-minute counts behind
//! the rates and the console's chart; and what operators do (retry, purge).

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::MailContent;

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
    /// When every recipient it went to had hard-bounced (DESIGN §12).
    pub bounced_at: Option<DateTime<Utc>>,
    pub message_id: Option<String>,
    pub dedupe_key: Option<String>,
    pub last_error: Option<String>,
    /// The relay's reply to "." of the attempt that sent it.
    pub relay_reply: Option<String>,
    pub subject: String,
    /// The template it is rendered with and the locale it asks for (DESIGN
    /// §15).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub locale: Option<String>,
    /// The locale of the template it is rendered with, by the templates
    /// as they are now (`show` fills it in).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template_locale: Option<String>,
    /// The sender, recipients, bodies and headers: only when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<MailContent>,
    pub attachments: Vec<AttachmentInfo>,
    pub events: Vec<EventRow>,
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
    /// The recipient a report or the suppression list spoke of.
    pub recipient: Option<String>,
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

/// The statuses a row can have, in the order operators read them.
pub const STATUSES: [&str; 8] = [
    "queued",
    "sending",
    "sent",
    "failed",
    "unknown",
    "cancelled",
    "bounced",
    "suppressed",
];

/// Fresh attempts a mail gets when an operator retries it (`tablemail
/// retry`, the console's retry button).
pub const RETRY_ATTEMPTS: i32 = 5;

impl FailureGroup {
    /// The attempts of this group ended their mail (failed, unknown, or the
    /// worker was lost on the last attempt); the others put it off.
    pub fn ended_the_mail(&self) -> bool {
        matches!(self.outcome.as_str(), "failed" | "unknown" | "stale")
    }
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
    /// current minute, and the attachment bytes of those sent.
    pub sent_since: i64,
    pub failed_since: i64,
    pub attachment_bytes_since: i64,
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

/// Which rows `retry` puts back to `queued`.
#[derive(Debug, Clone, Copy)]
pub enum RetrySelection {
    Id(i64),
    AllFailed,
}

impl RetrySelection {
    /// The one row, or `None` for all of them (a NULL parameter in SQL).
    pub fn id(self) -> Option<i64> {
        match self {
            RetrySelection::Id(id) => Some(id),
            RetrySelection::AllFailed => None,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct StatusCount {
    pub status: String,
    pub count: i64,
}

/// Serialized as is into `status --json`'s `recent_failures`.
#[derive(Debug, Clone, Serialize)]
pub struct RecentFailure {
    pub id: i64,
    pub status: String,
    pub processed_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

/// What `tablemail status` shows.
#[derive(Debug, Clone, Default)]
pub struct QueueStats {
    pub counts: Vec<StatusCount>,
    /// Seconds since the oldest due `queued` row became due.
    pub oldest_due_age_seconds: Option<f64>,
    /// `sending` rows whose lock is older than the lock timeout.
    pub stale_locks: i64,
    /// Mails the daemons sent in the last minute, five minutes, fifteen
    /// minutes (from their per-minute counts: retention may already have
    /// deleted the rows).
    pub sent_last_1m: i64,
    pub sent_last_5m: i64,
    pub sent_last_15m: i64,
    /// Attachment bytes of the mails sent in the last fifteen minutes.
    pub attachment_bytes_last_15m: i64,
    pub recent_failures: Vec<RecentFailure>,
}

impl QueueStats {
    /// Rows with this status.
    pub fn count(&self, status: &str) -> i64 {
        self.counts
            .iter()
            .find(|c| c.status == status)
            .map_or(0, |c| c.count)
    }
}

/// Finished rows that retention deletes, each kind with its own age.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    Sent,
    FailedOrCancelled,
    /// Aged like failed rows (`retention.failed`).
    BouncedOrSuppressed,
}

/// What [`Store::maintain`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Maintenance {
    /// The table was vacuumed: it held this many dead rows.
    Vacuumed { dead_rows: i64, autovacuum: bool },
    /// Dead rows pile up, and this role may not vacuum (it does not own the table).
    CannotVacuum { dead_rows: i64 },
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
}
