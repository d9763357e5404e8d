//! RFC 5965 feedback reports (ARF), the form of most feedback loops: a
//! `multipart/report; report-type=feedback-report` with a
//! `message/feedback-report` part and the original message (or its
//! headers). Every Feedback-Type is a complaint except `not-spam` (a user
//! taking a complaint back) and `auth-failure` (RFC 6591 authentication
//! failure reports, no one's complaint): those are kind unknown.

use super::mime::{self, Headers};
use super::text::{self, Fields, Line};
use super::{item, Context, Found, Items, Kind};

/// The most Original-Rcpt-To values read.
const MAX_RECIPIENTS: usize = 100;

/// Adds the items of a feedback report; false when the message is none.
pub(super) fn parse(ctx: &Context<'_>, items: &mut Items, found: &mut Found) -> bool {
    let root = ctx.root();
    let report_part = ctx
        .parts
        .iter()
        .find(|p| p.content_type.is("message/feedback-report"));
    let declared = root.content_type.is("multipart/report")
        && root.content_type.report_type.as_deref() == Some("feedback-report");
    if report_part.is_none() && !declared {
        return false;
    }

    let mut feedback_type = String::new();
    let mut recipients = Vec::new();
    if let Some(part) = report_part {
        for line in Fields::new(&part.body) {
            let Line::Field(name, value) = line else {
                continue;
            };
            match name.as_str() {
                "feedback-type" if feedback_type.is_empty() => {
                    feedback_type = text::clean(&value).to_ascii_lowercase();
                }
                "original-rcpt-to" | "removal-recipient" if recipients.len() < MAX_RECIPIENTS => {
                    recipients.extend(text::addr_spec(&value));
                }
                "original-mail-from" if found.original_sender.is_none() => {
                    found.original_sender = text::addr_spec(&value);
                }
                _ => {}
            }
        }
    }

    let original = original_headers(ctx);
    if recipients.is_empty() {
        // The original message's To, when it names exactly one address
        // (feedback loops often redact it: then no one).
        let to = original
            .as_ref()
            .map(|h| h.addresses("to"))
            .unwrap_or_default();
        if let [only] = to.as_slice() {
            recipients.push(only.clone());
        }
    }
    if let Some(id) = original
        .as_ref()
        .and_then(|h| h.get("message-id"))
        .and_then(text::message_id)
    {
        found.message_id.get_or_insert(id);
    }

    let kind = match feedback_type.split_whitespace().next().unwrap_or_default() {
        "not-spam" | "auth-failure" => Kind::Unknown,
        _ => Kind::Complaint,
    };
    let reason = feedback_type;
    let mut seen = std::collections::HashSet::new();
    recipients.retain(|r| seen.insert(r.clone()));
    if recipients.is_empty() {
        items.push(item(None, kind, None, &reason));
    }
    for recipient in recipients {
        if !items.push(item(Some(recipient), kind, None, &reason)) {
            break;
        }
    }
    true
}

/// The header section of the reported message.
fn original_headers(ctx: &Context<'_>) -> Option<Headers> {
    ctx.parts
        .iter()
        .find(|p| {
            matches!(
                p.content_type.mime.as_str(),
                "message/rfc822"
                    | "message/global"
                    | "text/rfc822-headers"
                    | "message/rfc822-headers"
            )
        })
        .map(|p| mime::header_section(&p.body).0)
}
