//! `POST /webhooks/mailgun`: Mailgun's `failed` (permanent and temporary)
//! and `complained` events, one JSON object a request. The signature is the
//! hex HMAC-SHA256 of `timestamp` and `token` under the webhook signing key
//! (`webhooks.mailgun.signing_key_file`); a timestamp more than five
//! minutes away and a token seen before are refused. Mailgun's SMTP server
//! names no id in its reply to ".": the event is tied to its mail by the
//! Message-ID (`message.headers.message-id`, the one tablemail assigned),
//! or by the envelope sender where VERP is on. The event's `id` is its key.

use std::{
    collections::{HashMap, VecDeque},
    sync::Mutex,
    time::{SystemTime, UNIX_EPOCH},
};

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::{event_key, item, report, same, Event, Refusal};
use crate::feedback::parse::Kind;

/// How far a signature's timestamp may be from this host's clock.
pub const MAX_AGE_SECONDS: u64 = 300;
/// Tokens remembered at once (each for [`MAX_AGE_SECONDS`] and as long
/// again: a token older than that is refused by its timestamp anyway).
const MAX_TOKENS: usize = 100_000;

/// Seconds since the epoch, by this host's clock.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The tokens of the signatures accepted lately: a token comes once.
#[derive(Default)]
pub struct Tokens {
    seen: Mutex<Seen>,
}

/// Each token with when it may be forgotten, and the same in that order.
#[derive(Default)]
struct Seen {
    expiry: HashMap<String, u64>,
    order: VecDeque<(u64, String)>,
}

impl Tokens {
    /// Remembers `token` until `now + 2 * MAX_AGE_SECONDS`; false when it
    /// was seen before (or the table is full of live tokens).
    fn first_time(&self, token: &str, now: u64) -> Result<(), Refusal> {
        let mut guard = self.seen.lock().expect("the token table is never poisoned");
        let Seen {
            expiry: seen,
            order,
        } = &mut *guard;
        while let Some((expires, _)) = order.front() {
            if *expires > now {
                break;
            }
            let (_, old) = order.pop_front().expect("a front entry");
            seen.remove(&old);
        }
        if seen.contains_key(token) {
            return Err(Refusal::Forbidden("token seen before"));
        }
        if seen.len() >= MAX_TOKENS {
            return Err(Refusal::Unavailable("too many tokens to remember"));
        }
        let expires = now + 2 * MAX_AGE_SECONDS;
        seen.insert(token.to_string(), expires);
        order.push_back((expires, token.to_string()));
        Ok(())
    }
}

#[derive(Deserialize)]
struct Body {
    signature: Option<Signature>,
    #[serde(rename = "event-data")]
    event_data: Option<EventData>,
}

#[derive(Deserialize)]
struct Signature {
    timestamp: Option<serde_json::Value>,
    token: Option<String>,
    signature: Option<String>,
}

#[derive(Deserialize)]
struct EventData {
    event: Option<String>,
    id: Option<String>,
    recipient: Option<String>,
    severity: Option<String>,
    reason: Option<String>,
    #[serde(rename = "delivery-status")]
    delivery_status: Option<DeliveryStatus>,
    message: Option<Message>,
    envelope: Option<Envelope>,
}

#[derive(Deserialize)]
struct DeliveryStatus {
    code: Option<serde_json::Value>,
    #[serde(rename = "enhanced-code")]
    enhanced_code: Option<String>,
    message: Option<String>,
    description: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    headers: Option<Headers>,
}

#[derive(Deserialize)]
struct Headers {
    #[serde(rename = "message-id")]
    message_id: Option<String>,
}

#[derive(Deserialize)]
struct Envelope {
    sender: Option<String>,
}

/// The hex HMAC-SHA256 of `timestamp` then `token` under `key`.
pub fn sign(key: &[u8], timestamp: &str, token: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let mut context = ring::hmac::Context::with_key(&key);
    context.update(timestamp.as_bytes());
    context.update(token.as_bytes());
    context
        .sign()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What a `failed` or `complained` event is, in DESIGN §12's kinds; `None`
/// for the events that record nothing.
pub fn kind(event: &str, severity: Option<&str>, reason: Option<&str>) -> Option<Kind> {
    match (event, severity) {
        ("complained", _) => Some(Kind::Complaint),
        ("failed", Some("temporary")) => Some(Kind::Delayed),
        // Given up after temporary failures: the mailbox may come back.
        ("failed", _) if reason == Some("old") => Some(Kind::SoftBounce),
        ("failed", _) => Some(Kind::HardBounce),
        _ => None,
    }
}

/// Checks the signature, its age and its token, then reads the event.
pub fn read(
    key: &SecretString,
    tokens: &Tokens,
    body: &[u8],
    now: u64,
) -> Result<Vec<Event>, Refusal> {
    let body: Body =
        serde_json::from_slice(body).map_err(|_| Refusal::BadRequest("not a Mailgun event"))?;
    let signature = body.signature.ok_or(Refusal::Forbidden("no signature"))?;
    let timestamp = match signature.timestamp {
        Some(serde_json::Value::String(s)) => s,
        Some(serde_json::Value::Number(n)) => n.to_string(),
        _ => return Err(Refusal::Forbidden("no signature timestamp")),
    };
    let (Some(token), Some(given)) = (signature.token, signature.signature) else {
        return Err(Refusal::Forbidden("no signature token"));
    };
    let expected = sign(key.expose_secret().as_bytes(), &timestamp, &token);
    if !same(given.to_ascii_lowercase().as_bytes(), expected.as_bytes()) {
        return Err(Refusal::Forbidden("signature does not verify"));
    }
    let at: u64 = timestamp
        .parse()
        .map_err(|_| Refusal::Forbidden("signature timestamp not a number"))?;
    if at.abs_diff(now) > MAX_AGE_SECONDS {
        return Err(Refusal::Forbidden(
            "signature timestamp more than five minutes away",
        ));
    }
    tokens.first_time(&token, now)?;
    let Some(data) = body.event_data else {
        return Err(Refusal::BadRequest("no event-data"));
    };
    let Some(kind) = kind(
        data.event.as_deref().unwrap_or(""),
        data.severity.as_deref(),
        data.reason.as_deref(),
    ) else {
        return Ok(Vec::new());
    };
    let key = event_key("mailgun", data.id.as_deref())?;
    let status = data.delivery_status.as_ref().and_then(|s| {
        s.enhanced_code.clone().or_else(|| {
            s.code.as_ref().map(|c| match c {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            })
        })
    });
    let diagnostic = data.delivery_status.as_ref().and_then(|s| {
        s.message
            .clone()
            .filter(|m| !m.trim().is_empty())
            .or_else(|| s.description.clone())
    });
    let items = vec![item(
        data.recipient.as_deref(),
        kind,
        status.as_deref().filter(|s| *s != "0"),
        diagnostic.as_deref().or(data.reason.as_deref()),
    )];
    let message_id = data
        .message
        .as_ref()
        .and_then(|m| m.headers.as_ref())
        .and_then(|h| h.message_id.as_deref());
    let sender = data.envelope.as_ref().and_then(|e| e.sender.as_deref());
    Ok(vec![Event {
        key,
        report: report("mailgun", items, None, message_id, sender),
    }])
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "key-of-the-mailgun-tests";

    fn body(timestamp: u64, token: &str, signature: &str) -> String {
        format!(
            r#"{{"signature":{{"timestamp":"{timestamp}","token":"{token}","signature":"{signature}"}},
            "event-data":{{"event":"failed","id":"G9Bn5sl1TC6nu79C8C0bwg","severity":"permanent",
            "reason":"bounce","recipient":"alice@example.com",
            "delivery-status":{{"code":550,"message":"550 5.1.1 no such user","attempt-no":1}},
            "message":{{"headers":{{"message-id":"0a1b.42@mail.example"}}}},
            "envelope":{{"sender":"shop@example.com"}}}}}}"#
        )
    }

    #[test]
    fn a_signed_failure_is_read_once() {
        let (key, tokens, now) = (SecretString::from(KEY), Tokens::default(), 1_700_000_000);
        let token = "a8ce0edb2dd8301dee6c2405235584e45aa91d1e9f979f3de0";
        let signed = body(now, token, &sign(KEY.as_bytes(), &now.to_string(), token));
        let events = read(&key, &tokens, signed.as_bytes(), now + 10).unwrap();
        assert_eq!(events[0].key, "mailgun:G9Bn5sl1TC6nu79C8C0bwg");
        let report = &events[0].report;
        assert_eq!(
            report.original_message_id.as_deref(),
            Some("<0a1b.42@mail.example>")
        );
        assert_eq!(report.items[0].kind, Kind::HardBounce);
        assert_eq!(report.items[0].status.as_deref(), Some("550"));
        assert_eq!(
            read(&key, &tokens, signed.as_bytes(), now + 11),
            Err(Refusal::Forbidden("token seen before"))
        );
    }

    #[test]
    fn old_timestamps_and_wrong_signatures_are_refused() {
        let (key, tokens, now) = (SecretString::from(KEY), Tokens::default(), 1_700_000_000);
        let old = now - MAX_AGE_SECONDS - 1;
        let signed = body(old, "t1", &sign(KEY.as_bytes(), &old.to_string(), "t1"));
        assert!(matches!(
            read(&key, &tokens, signed.as_bytes(), now),
            Err(Refusal::Forbidden(_))
        ));
        let forged = body(
            now,
            "t2",
            &sign(b"another key of some length", &now.to_string(), "t2"),
        );
        assert_eq!(
            read(&key, &tokens, forged.as_bytes(), now),
            Err(Refusal::Forbidden("signature does not verify"))
        );
    }

    #[test]
    fn kinds_follow_severity_and_reason() {
        assert_eq!(kind("failed", Some("temporary"), None), Some(Kind::Delayed));
        assert_eq!(
            kind("failed", Some("permanent"), Some("old")),
            Some(Kind::SoftBounce)
        );
        assert_eq!(
            kind("failed", Some("permanent"), Some("bounce")),
            Some(Kind::HardBounce)
        );
        assert_eq!(kind("complained", None, None), Some(Kind::Complaint));
        assert_eq!(kind("delivered", None, None), None);
    }

    #[test]
    fn tokens_are_forgotten_once_their_timestamps_are_refused() {
        let tokens = Tokens::default();
        assert!(tokens.first_time("t", 100).is_ok());
        assert!(tokens
            .first_time("t", 100 + 2 * MAX_AGE_SECONDS - 1)
            .is_err());
        assert!(tokens.first_time("t", 100 + 2 * MAX_AGE_SECONDS).is_ok());
    }
}
