//! From a report's bytes to what it does (DESIGN §12): parse it, find the
//! mail it is about — by the VERP address and its verified tag, else by the
//! Message-ID tablemail gave the mail, else by the relay's queue id — and
//! act on a recipient only when the report proves it saw that mail go to
//! that recipient. Everything else is kept, unmatched, and changes nothing.
//! A provider's webhook event (DESIGN §14) arrives already read, in the
//! same terms ([`parse::Report`]), and takes the same path from
//! [`Recorder::judge_report`] on.

use std::sync::Arc;

use crate::{
    mail,
    metrics::Metrics,
    store::{
        FeedbackItem, FeedbackKind, FeedbackRecord, FeedbackRecorded, FeedbackSource,
        FeedbackTarget, Store, StoreError, SuppressionPolicy,
    },
};

use super::{
    parse::{self, Kind},
    verp::Verp,
};

/// Most recipients a mail is searched for when a report is matched: a
/// mail with more could never have been sent (`transport.max_recipients`
/// is far below).
const MAX_RECIPIENTS: usize = 100_000;

/// Reports up to this size are parsed on the async thread.
const PARSE_IN_PLACE: usize = 64 * 1024;

/// How a report proved which mail it is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proof {
    /// The VERP address, its tag verified.
    Verp,
    /// The Message-ID tablemail gave the mail.
    MessageId,
    /// The relay's queue id, kept from its reply to ".".
    QueueId,
}

impl Proof {
    pub fn as_str(self) -> &'static str {
        match self {
            Proof::Verp => "verp",
            Proof::MessageId => "message_id",
            Proof::QueueId => "queue_id",
        }
    }
}

/// What a report says and what it would do: [`Recorder::judge`]'s answer,
/// printed by `tablemail ingest --dry-run --json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub items: Vec<FeedbackItem>,
    /// The mail it proved it saw, and how.
    pub mail: Option<(i64, Proof)>,
    /// The recipients that mail went to.
    pub sent_to: Vec<String>,
    pub size: usize,
}

/// Turns reports into records, for the listener and `tablemail ingest`.
#[derive(Clone)]
pub struct Recorder {
    pub store: Arc<dyn Store>,
    pub verp: Option<Arc<Verp>>,
    pub policy: SuppressionPolicy,
    /// Keep the report's bytes (`inbound.keep_raw`).
    pub keep_raw: bool,
    /// Counts what the daemon's listener records.
    pub metrics: Option<Arc<Metrics>>,
}

impl Recorder {
    /// Parses a report and finds what it proves, reading the database and
    /// writing nothing. `envelope`: the addresses it was delivered to (the
    /// listener's RCPT TO, `ingest --rcpt`), where the VERP address is.
    pub async fn judge(&self, raw: &[u8], envelope: &[String]) -> Result<Verdict, StoreError> {
        let report = if raw.len() <= PARSE_IN_PLACE {
            parse::parse_report(raw)
        } else {
            // Linear, but a large report is milliseconds of CPU: off the
            // async threads, as a large message is built.
            let copy = raw.to_vec();
            tokio::task::spawn_blocking(move || parse::parse_report(&copy))
                .await
                .map_err(|e| StoreError::Unsupported(format!("the report's parser stopped: {e}")))?
        };
        self.judge_report(&report, envelope, raw.len()).await
    }

    /// Finds what a report already read proves (a mail report parsed, or a
    /// provider's webhook event put in the same terms, DESIGN §14): the
    /// same correlation and the same proof rule, whatever brought it.
    pub async fn judge_report(
        &self,
        report: &parse::Report,
        envelope: &[String],
        size: usize,
    ) -> Result<Verdict, StoreError> {
        let found = self.find_mail(report, envelope).await?;
        let sent_to = found
            .as_ref()
            .map(|(target, _)| sent_to(target))
            .unwrap_or_default();
        let mut items: Vec<FeedbackItem> = report
            .items
            .iter()
            .map(|item| {
                let recipient = item
                    .recipient
                    .as_deref()
                    .and_then(|r| mail::address_key(r).ok());
                FeedbackItem {
                    mail_id: found.as_ref().map(|(t, _)| t.id),
                    matched: false,
                    recipient,
                    kind: kind(item.kind),
                    status: item.status.clone(),
                    diagnostic: item.diagnostic.clone(),
                    smtp_code: item.diagnostic.as_deref().and_then(smtp_code),
                }
            })
            .collect();
        if items.is_empty() {
            items.push(FeedbackItem {
                mail_id: found.as_ref().map(|(t, _)| t.id),
                recipient: None,
                kind: FeedbackKind::Unknown,
                status: None,
                diagnostic: None,
                matched: false,
                smtp_code: None,
            });
        }
        if found.is_some() {
            for item in &mut items {
                match &item.recipient {
                    Some(r) => item.matched = sent_to.contains(r),
                    // A report that names nobody (a complaint whose
                    // provider redacted the address) about a mail that had
                    // one recipient can only mean that one.
                    None if sent_to.len() == 1 => {
                        item.recipient = Some(sent_to[0].clone());
                        item.matched = true;
                    }
                    None => {}
                }
            }
        }
        Ok(Verdict {
            items,
            mail: found.map(|(t, proof)| (t.id, proof)),
            sent_to,
            size,
        })
    }

    /// Judges a report and records it, in one transaction.
    pub async fn record(
        &self,
        raw: &[u8],
        envelope: &[String],
        source: FeedbackSource,
    ) -> Result<(Verdict, FeedbackRecorded), StoreError> {
        let verdict = self.judge(raw, envelope).await?;
        let recorded = self.keep(&verdict, raw, source, None).await?;
        Ok((verdict, recorded))
    }

    /// Judges a report already read and records it, in one transaction,
    /// under the provider's event key: a provider's retry of an event
    /// already kept records nothing and does nothing.
    pub async fn record_report(
        &self,
        report: &parse::Report,
        raw: &[u8],
        source: FeedbackSource,
        event_key: Option<String>,
    ) -> Result<(Verdict, FeedbackRecorded), StoreError> {
        let verdict = self.judge_report(report, &[], raw.len()).await?;
        let recorded = self.keep(&verdict, raw, source, event_key).await?;
        Ok((verdict, recorded))
    }

    /// Writes what a verdict does, counts and logs it.
    async fn keep(
        &self,
        verdict: &Verdict,
        raw: &[u8],
        source: FeedbackSource,
        event_key: Option<String>,
    ) -> Result<FeedbackRecorded, StoreError> {
        let recorded = self
            .store
            .record_feedback(&FeedbackRecord {
                source,
                size: raw.len(),
                raw: self.keep_raw.then(|| raw.to_vec()),
                items: verdict.items.clone(),
                sent_to: verdict.sent_to.clone(),
                policy: self.policy,
                event_key,
            })
            .await?;
        for (index, item) in verdict.items.iter().enumerate() {
            if recorded.repeated.contains(&index) {
                continue;
            }
            if let Some(metrics) = &self.metrics {
                metrics.feedback(item.kind);
            }
            tracing::info!(
                kind = item.kind.as_str(),
                matched = item.matched,
                mail_id = item.mail_id,
                proof = verdict.mail.map(|(_, p)| p.as_str()),
                domain = item
                    .recipient
                    .as_deref()
                    .and_then(|r| r.rsplit_once('@'))
                    .map(|(_, d)| d),
                status = item.status.as_deref(),
                source = source.as_str(),
                "report recorded"
            );
        }
        if !recorded.repeated.is_empty() {
            tracing::info!(
                items = recorded.repeated.len(),
                source = source.as_str(),
                "report already recorded"
            );
        }
        if !recorded.suppressed.is_empty() {
            tracing::info!(
                addresses = recorded.suppressed.len(),
                mail_id = verdict.mail.map(|(id, _)| id),
                "addresses suppressed"
            );
        }
        Ok(recorded)
    }

    /// The mail a report proves it is about, if any.
    async fn find_mail(
        &self,
        report: &parse::Report,
        envelope: &[String],
    ) -> Result<Option<(FeedbackTarget, Proof)>, StoreError> {
        if let Some(verp) = &self.verp {
            let id = envelope
                .iter()
                .chain(&report.addressed_to)
                .chain(&report.original_sender)
                .find_map(|a| verp.verify(a));
            if let Some(id) = id {
                if let Some(target) = self.store.feedback_target(id).await? {
                    return Ok(Some((target, Proof::Verp)));
                }
            }
        }
        if let Some(original) = &report.original_message_id {
            if let Some(id) = assigned_id(original) {
                if let Some(target) = self.store.feedback_target(id).await? {
                    if target.message_id.as_deref() == Some(original.as_str()) {
                        return Ok(Some((target, Proof::MessageId)));
                    }
                }
            }
        }
        for queue_id in &report.relay_queue_ids {
            if let Some(target) = self.store.feedback_target_by_queue_id(queue_id).await? {
                return Ok(Some((target, Proof::QueueId)));
            }
        }
        Ok(None)
    }
}

/// The recipients a mail went to: to, cc and bcc less those left out as
/// suppressed.
fn sent_to(target: &FeedbackTarget) -> Vec<String> {
    let mut keys = mail::recipient_keys(
        &target.to_address,
        target.cc.as_deref(),
        target.bcc.as_deref(),
        MAX_RECIPIENTS,
    );
    keys.retain(|k| !target.left_out.contains(k));
    keys
}

/// The row id in a Message-ID tablemail assigned, `<hash.ID@host>`; the
/// caller compares the whole Message-ID with the row's, which is the proof
/// (the host may be any daemon's).
fn assigned_id(message_id: &str) -> Option<i64> {
    let inner = message_id.strip_prefix('<')?.strip_suffix('>')?;
    let (left, _) = inner.rsplit_once('@')?;
    let (_, id) = left.rsplit_once('.')?;
    if id.is_empty() || id.len() > 19 || !id.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    id.parse().ok()
}

fn kind(kind: Kind) -> FeedbackKind {
    match kind {
        Kind::HardBounce => FeedbackKind::HardBounce,
        Kind::SoftBounce => FeedbackKind::SoftBounce,
        Kind::Delayed => FeedbackKind::Delayed,
        Kind::Complaint => FeedbackKind::Complaint,
        Kind::AutoReply => FeedbackKind::AutoReply,
        Kind::Unknown => FeedbackKind::Unknown,
    }
}

/// The SMTP reply code a diagnostic quotes (`smtp; 550 5.1.1 …`).
fn smtp_code(diagnostic: &str) -> Option<u16> {
    diagnostic
        .split(|c: char| !c.is_ascii_digit())
        .take(8)
        .find(|w| w.len() == 3 && matches!(w.as_bytes()[0], b'2'..=b'5'))
        .and_then(|w| w.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::{assigned_id, smtp_code};

    #[test]
    fn the_assigned_message_id_names_its_row() {
        assert_eq!(assigned_id("<0a1b2c.4711@mail.example>"), Some(4711));
        assert_eq!(assigned_id("<order-42@shop.example>"), None);
        assert_eq!(assigned_id("<order.42x@shop.example>"), None);
        assert_eq!(assigned_id("0a1b2c.4711@mail.example"), None);
        assert_eq!(assigned_id("<x.99999999999999999999@m>"), None);
    }

    #[test]
    fn the_reply_code_is_read_from_the_diagnostic() {
        assert_eq!(smtp_code("smtp; 550 5.1.1 <a@b>: user unknown"), Some(550));
        assert_eq!(smtp_code("550-5.1.1 The email account"), Some(550));
        assert_eq!(smtp_code("X-Postfix; mailbox full"), None);
        assert_eq!(smtp_code("smtp; 5.1.1 no code"), None);
    }
}
