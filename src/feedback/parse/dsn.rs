//! RFC 3464 delivery status notifications and their UTF-8 form (RFC 6533):
//! the `message/delivery-status` (`message/global-delivery-status`) part's
//! per-message fields and per-recipient field groups, as real MTAs write
//! them: folded fields, `rfc822;` and `utf-8;` address types, addresses in
//! angle brackets, Status with comments, a multi-line Diagnostic-Code, a
//! missing Action, groups run together with no blank line between them.

use super::classify::{self, Action};
use super::text::{self, Fields, Line};
use super::{item, Context, Found, Items};

/// Whether a part of this type is a delivery-status report.
pub(super) fn is_dsn_type(mime: &str) -> bool {
    matches!(
        mime,
        "message/delivery-status" | "message/global-delivery-status"
    )
}

/// Adds the items of every delivery-status part; false when there is none.
pub(super) fn parse(ctx: &Context<'_>, items: &mut Items, found: &mut Found) -> bool {
    let mut any = false;
    for part in ctx
        .parts
        .iter()
        .filter(|p| is_dsn_type(&p.content_type.mime))
    {
        any = true;
        parse_fields(&part.body, ctx.delay_notice, items, found);
        if items.is_full() {
            break;
        }
    }
    any
}

/// One per-recipient field group, as read.
#[derive(Debug, Default)]
struct Recipient {
    original: Option<String>,
    final_: Option<String>,
    action: Option<String>,
    status: Option<String>,
    diagnostic: Option<String>,
    /// Exchange's `X-Supplementary-Info`, a diagnostic when there is none.
    supplementary: Option<String>,
}

impl Recipient {
    fn is_empty(&self) -> bool {
        self.original.is_none()
            && self.final_.is_none()
            && self.action.is_none()
            && self.status.is_none()
    }
}

/// Reads the fields of a delivery-status body (also used on DSN fields
/// pasted into a text part) into items.
pub(super) fn parse_fields(body: &[u8], delay_notice: bool, items: &mut Items, found: &mut Found) {
    let mut current = Recipient::default();
    for line in Fields::new(body) {
        let (name, value) = match line {
            Line::Blank => {
                if !flush(&mut current, delay_notice, items) {
                    return;
                }
                continue;
            }
            Line::Other => continue,
            Line::Field(name, value) => (name, value),
        };
        // A recipient field that repeats within a group starts the next
        // group: some MTAs leave out the blank line between groups. (Only a
        // repeat: the order of the fields varies, Postfix writes
        // Final-Recipient before Original-Recipient, Exim Action first.)
        let starts_next = match name.as_str() {
            "original-recipient" => current.original.is_some(),
            "final-recipient" => current.final_.is_some(),
            "action" => current.action.is_some(),
            _ => false,
        };
        if starts_next && !flush(&mut current, delay_notice, items) {
            return;
        }
        match name.as_str() {
            "original-recipient" => current.original = Some(value),
            "final-recipient" => current.final_ = Some(value),
            "action" => current.action = Some(value),
            "status" => {
                current.status.get_or_insert(value);
            }
            "diagnostic-code" => {
                current.diagnostic.get_or_insert(value);
            }
            "x-supplementary-info" => {
                current.supplementary.get_or_insert(value);
            }
            "x-postfix-queue-id" if found.queue_ids.len() < 16 => {
                found.queue_ids.extend(text::queue_id(&value));
            }
            "x-postfix-sender" if found.original_sender.is_none() => {
                found.original_sender = text::addr_spec(&value);
            }
            "x-original-message-id" if found.message_id.is_none() => {
                found.message_id = text::message_id(&value);
            }
            _ => {}
        }
    }
    flush(&mut current, delay_notice, items);
}

/// Turns the group read so far into an item and starts a new one; false
/// once the items are full.
fn flush(current: &mut Recipient, delay_notice: bool, items: &mut Items) -> bool {
    let r = std::mem::take(current);
    if r.is_empty() {
        return !items.is_full();
    }
    let recipient = r
        .original
        .as_deref()
        .filter(|v| is_rfc822_type(v))
        .and_then(text::addr_spec)
        .or_else(|| r.final_.as_deref().and_then(text::addr_spec));
    let diagnostic = r
        .diagnostic
        .as_deref()
        .and_then(text::diagnostic_code)
        .or_else(|| r.supplementary.as_deref().map(text::clean));
    let status = classify::status(r.status.as_deref(), diagnostic.as_deref());
    let action = r.action.as_deref().map_or(Action::Unstated, Action::parse);
    let kind = classify::kind(
        action,
        status.as_deref(),
        diagnostic.as_deref(),
        delay_notice,
        false,
    );
    items.push(item(
        recipient,
        kind,
        status,
        diagnostic.as_deref().unwrap_or_default(),
    ))
}

/// Whether an Original-Recipient is of an address type we read: `rfc822`,
/// `utf-8` (RFC 6533), or none given.
fn is_rfc822_type(value: &str) -> bool {
    match value.split_once(';') {
        Some((kind, _)) => {
            let kind = kind.trim();
            kind.eq_ignore_ascii_case("rfc822") || kind.eq_ignore_ascii_case("utf-8")
        }
        None => true,
    }
}
