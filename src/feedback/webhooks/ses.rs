//! `POST /webhooks/ses`: Amazon SNS notifications carrying SES events. The
//! envelope's topic must be one of `webhooks.ses.topic_arns`, its
//! `SigningCertURL` an SNS address ([`sns::sns_url`]), and its signature
//! that of the certificate found there ([`sns::Certificates`]). Then:
//! - `SubscriptionConfirmation`: the subscription is confirmed (a GET of its
//!   `SubscribeURL`, itself an SNS address);
//! - `UnsubscribeConfirmation`: logged;
//! - `Notification`: its `Message` is an SES notification (or event):
//!   `Bounce` (Permanent: hard bounce, Transient: soft bounce),
//!   `Complaint`, `DeliveryDelay` (delayed) are recorded, each recipient an
//!   item; `Delivery` and the rest are acknowledged and not recorded.
//!
//! The SES message id (`mail.messageId`) is the one SES's SMTP server names
//! in its reply to "." (`250 Ok <id>`); `mail.source` is the envelope sender
//! (a VERP address when `bounce.domain` is set); the SNS `MessageId` is the
//! event's key.

use serde::Deserialize;

use super::{
    event_key, item, report,
    sns::{self, CertError, Certificates, Trust},
    Event, Refusal,
};
use crate::feedback::parse::{Kind, MAX_ITEMS};

/// The SNS side of `/webhooks/ses`.
pub struct Ses {
    topics: Vec<String>,
    certificates: Certificates,
}

/// What a verified request came to.
#[derive(Debug)]
pub enum Outcome {
    Events(Vec<Event>),
    /// A subscription confirmed, an unsubscription logged, or a
    /// notification with nothing to record.
    Done,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Envelope {
    #[serde(rename = "Type")]
    kind: Option<String>,
    message_id: Option<String>,
    topic_arn: Option<String>,
    subject: Option<String>,
    message: Option<String>,
    timestamp: Option<String>,
    token: Option<String>,
    #[serde(rename = "SubscribeURL")]
    subscribe_url: Option<String>,
    signature_version: Option<String>,
    signature: Option<String>,
    #[serde(rename = "SigningCertURL")]
    signing_cert_url: Option<String>,
}

impl Envelope {
    /// The text SNS signed: `Name\nvalue\n` for each field of the type's
    /// list, in that order, a missing optional one (`Subject`) left out.
    fn signed_text(&self) -> Result<String, Refusal> {
        let kind = self.kind.as_deref().unwrap_or("");
        let fields: &[(&str, &Option<String>)] = match kind {
            "Notification" => &[
                ("Message", &self.message),
                ("MessageId", &self.message_id),
                ("Subject", &self.subject),
                ("Timestamp", &self.timestamp),
                ("TopicArn", &self.topic_arn),
                ("Type", &self.kind),
            ],
            "SubscriptionConfirmation" | "UnsubscribeConfirmation" => &[
                ("Message", &self.message),
                ("MessageId", &self.message_id),
                ("SubscribeURL", &self.subscribe_url),
                ("Timestamp", &self.timestamp),
                ("Token", &self.token),
                ("TopicArn", &self.topic_arn),
                ("Type", &self.kind),
            ],
            _ => return Err(Refusal::Forbidden("not an SNS message type")),
        };
        let mut text = String::new();
        for (name, value) in fields {
            match value {
                Some(value) => {
                    text.push_str(name);
                    text.push('\n');
                    text.push_str(value);
                    text.push('\n');
                }
                None if *name == "Subject" => {}
                None => return Err(Refusal::Forbidden("a signed field is missing")),
            }
        }
        Ok(text)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SesMessage {
    notification_type: Option<String>,
    event_type: Option<String>,
    mail: Option<Mail>,
    bounce: Option<Bounce>,
    complaint: Option<Complaint>,
    delivery_delay: Option<DeliveryDelay>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Mail {
    message_id: Option<String>,
    source: Option<String>,
    common_headers: Option<CommonHeaders>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CommonHeaders {
    message_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Bounce {
    bounce_type: Option<String>,
    #[serde(default)]
    bounced_recipients: Vec<Recipient>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Complaint {
    #[serde(default)]
    complained_recipients: Vec<Recipient>,
    complaint_feedback_type: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct DeliveryDelay {
    #[serde(default)]
    delayed_recipients: Vec<Recipient>,
    delay_type: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Recipient {
    email_address: Option<String>,
    status: Option<String>,
    diagnostic_code: Option<String>,
}

/// A bounce's `bounceType` in DESIGN §12's kinds.
pub fn bounce_kind(bounce_type: &str) -> Kind {
    match bounce_type {
        "Permanent" => Kind::HardBounce,
        "Transient" => Kind::SoftBounce,
        _ => Kind::Unknown,
    }
}

impl Ses {
    pub fn new(topics: Vec<String>, trust: Trust) -> Ses {
        Ses {
            topics,
            certificates: Certificates::new(trust),
        }
    }

    /// Verifies an SNS message and does what it asks.
    pub async fn read(&self, body: &[u8]) -> Result<Outcome, Refusal> {
        let envelope: Envelope =
            serde_json::from_slice(body).map_err(|_| Refusal::BadRequest("not an SNS message"))?;
        let topic = envelope.topic_arn.as_deref().unwrap_or("");
        if !self.topics.iter().any(|t| t == topic) {
            return Err(Refusal::Forbidden("topic not in webhooks.ses.topic_arns"));
        }
        let url = envelope
            .signing_cert_url
            .as_deref()
            .and_then(|u| sns::sns_url(u, true))
            .ok_or(Refusal::Forbidden("SigningCertURL not on an SNS host"))?;
        let signature = envelope
            .signature
            .as_deref()
            .and_then(|s| {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD.decode(s).ok()
            })
            .ok_or(Refusal::Forbidden("no signature"))?;
        let text = envelope.signed_text()?;
        let version = envelope.signature_version.as_deref().unwrap_or("");
        match self
            .certificates
            .verify(&url, text.as_bytes(), &signature, version)
            .await
        {
            Ok(()) => {}
            Err(CertError::Refused(why)) => return Err(Refusal::Forbidden(why)),
            Err(CertError::Unreachable(why)) => {
                tracing::warn!(error = %why, "SNS signing certificate not fetched");
                return Err(Refusal::Unavailable("signing certificate not fetched"));
            }
        }
        match envelope.kind.as_deref() {
            Some("SubscriptionConfirmation") => self.confirm(&envelope, topic).await,
            Some("UnsubscribeConfirmation") => {
                tracing::info!(topic, "SNS unsubscription confirmed");
                Ok(Outcome::Done)
            }
            _ => {
                let key = event_key("ses", envelope.message_id.as_deref())?;
                let message = envelope.message.as_deref().unwrap_or("");
                Ok(match notification(message, key)? {
                    Some(event) => Outcome::Events(vec![event]),
                    None => Outcome::Done,
                })
            }
        }
    }

    /// Confirms a subscription to one of the accepted topics.
    async fn confirm(&self, envelope: &Envelope, topic: &str) -> Result<Outcome, Refusal> {
        let url = envelope
            .subscribe_url
            .as_deref()
            .and_then(|u| sns::sns_url(u, false))
            .ok_or(Refusal::Forbidden("SubscribeURL not on an SNS host"))?;
        match self.certificates.trust().get(&url).await {
            Ok(_) => {
                tracing::info!(topic, "SNS subscription confirmed");
                Ok(Outcome::Done)
            }
            Err(e) => {
                tracing::warn!(topic, error = %e, "SNS subscription not confirmed");
                Err(Refusal::Unavailable("subscription not confirmed"))
            }
        }
    }
}

/// The event an SES notification (`Message`) carries, if it records one.
fn notification(message: &str, key: String) -> Result<Option<Event>, Refusal> {
    let message: SesMessage = serde_json::from_str(message)
        .map_err(|_| Refusal::BadRequest("not an SES notification"))?;
    let kind = message
        .notification_type
        .as_deref()
        .or(message.event_type.as_deref())
        .unwrap_or("");
    let items: Vec<_> = match kind {
        "Bounce" => {
            let bounce = message.bounce.as_ref();
            let kind = bounce_kind(bounce.and_then(|b| b.bounce_type.as_deref()).unwrap_or(""));
            bounce
                .map(|b| &b.bounced_recipients[..])
                .unwrap_or_default()
                .iter()
                .take(MAX_ITEMS)
                .map(|r| {
                    item(
                        r.email_address.as_deref(),
                        kind,
                        r.status.as_deref(),
                        r.diagnostic_code.as_deref(),
                    )
                })
                .collect()
        }
        "Complaint" => {
            let complaint = message.complaint.as_ref();
            let feedback = complaint.and_then(|c| c.complaint_feedback_type.as_deref());
            complaint
                .map(|c| &c.complained_recipients[..])
                .unwrap_or_default()
                .iter()
                .take(MAX_ITEMS)
                .map(|r| item(r.email_address.as_deref(), Kind::Complaint, None, feedback))
                .collect()
        }
        "DeliveryDelay" => {
            let delay = message.delivery_delay.as_ref();
            let why = delay.and_then(|d| d.delay_type.as_deref());
            delay
                .map(|d| &d.delayed_recipients[..])
                .unwrap_or_default()
                .iter()
                .take(MAX_ITEMS)
                .map(|r| {
                    item(
                        r.email_address.as_deref(),
                        Kind::Delayed,
                        r.status.as_deref(),
                        r.diagnostic_code.as_deref().or(why),
                    )
                })
                .collect()
        }
        _ => return Ok(None),
    };
    let mail = message.mail.as_ref();
    let report = report(
        "ses",
        items,
        mail.and_then(|m| m.message_id.as_deref()),
        mail.and_then(|m| m.common_headers.as_ref())
            .and_then(|h| h.message_id.as_deref()),
        mail.and_then(|m| m.source.as_deref()),
    );
    Ok(Some(Event { key, report }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bounce_notification_names_each_recipient() {
        let message = r#"{"notificationType":"Bounce","bounce":{"bounceType":"Permanent",
            "bounceSubType":"General","bouncedRecipients":[{"emailAddress":"jane@example.com",
            "action":"failed","status":"5.1.1","diagnosticCode":"smtp; 550 5.1.1 user unknown"},
            {"emailAddress":"richard@example.com"}],"timestamp":"2016-01-27T14:59:38.237Z",
            "feedbackId":"00000138111222aa-33322211-cccc-cccc-cccc-ddddaaaa068a-000000"},
            "mail":{"timestamp":"2016-01-27T14:59:38.237Z","messageId":"00000138111222aa-33322211-cccc-cccc-cccc-ddddaaaa0680-000000",
            "source":"john@example.com","destination":["jane@example.com","richard@example.com"],
            "commonHeaders":{"messageId":"<0a1b.42@mail.example>"}}}"#;
        let event = notification(message, "ses:k".into()).unwrap().unwrap();
        let report = &event.report;
        assert_eq!(report.items.len(), 2);
        assert_eq!(report.items[0].kind, Kind::HardBounce);
        assert_eq!(report.items[0].status.as_deref(), Some("5.1.1"));
        assert_eq!(
            report.relay_queue_ids,
            ["00000138111222aa-33322211-cccc-cccc-cccc-ddddaaaa0680-000000"]
        );
        assert_eq!(
            report.original_message_id.as_deref(),
            Some("<0a1b.42@mail.example>")
        );
        assert_eq!(report.original_sender.as_deref(), Some("john@example.com"));
    }

    #[test]
    fn deliveries_record_nothing() {
        let message = r#"{"notificationType":"Delivery","mail":{"messageId":"x"},
            "delivery":{"recipients":["a@example.com"],"smtpResponse":"250 ok"}}"#;
        assert_eq!(notification(message, "ses:k".into()), Ok(None));
    }

    #[test]
    fn the_signed_text_follows_the_type() {
        let envelope: Envelope = serde_json::from_str(
            r#"{"Type":"Notification","MessageId":"m","TopicArn":"t","Message":"x",
            "Timestamp":"2012-05-02T00:54:06.655Z","SignatureVersion":"1","Signature":"s",
            "SigningCertURL":"u"}"#,
        )
        .unwrap();
        assert_eq!(
            envelope.signed_text().unwrap(),
            "Message\nx\nMessageId\nm\nTimestamp\n2012-05-02T00:54:06.655Z\nTopicArn\nt\nType\nNotification\n"
        );
    }
}
