//! `POST /webhooks/postmark`: Postmark's bounce and spam complaint
//! webhooks, one JSON object a request, behind HTTP basic credentials
//! (`webhooks.postmark.credentials_file`). The bounce's `MessageID` is the
//! id Postmark gave the mail, the one its SMTP server names in its reply to
//! "." (`queued as …`); the bounce's `ID` is the event's key. Other record
//! types (deliveries, opens, clicks) are acknowledged and not recorded.

use axum::http::{header, HeaderMap};
use base64::Engine as _;
use secrecy::ExposeSecret;
use serde::Deserialize;

use super::{event_key, item, report, same, Event, PostmarkCredentials, Refusal};
use crate::feedback::parse::Kind;

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Record {
    record_type: Option<String>,
    #[serde(rename = "ID")]
    id: Option<serde_json::Value>,
    #[serde(rename = "Type")]
    kind: Option<String>,
    #[serde(rename = "MessageID")]
    message_id: Option<String>,
    email: Option<String>,
    details: Option<String>,
    description: Option<String>,
}

/// What a bounce's `Type` is, in DESIGN §12's kinds.
pub fn kind(bounce_type: &str) -> Kind {
    match bounce_type {
        "HardBounce" | "BadEmailAddress" => Kind::HardBounce,
        "SoftBounce" | "DnsError" | "Blocked" | "SpamNotification" => Kind::SoftBounce,
        "Transient" => Kind::Delayed,
        "AutoResponder" => Kind::AutoReply,
        "SpamComplaint" => Kind::Complaint,
        _ => Kind::Unknown,
    }
}

/// Checks the credentials, then reads the event.
pub fn read(
    credentials: &PostmarkCredentials,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Vec<Event>, Refusal> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, value) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("basic").then_some(value.trim())
        })
        .ok_or(Refusal::Unauthorized("no basic credentials"))?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(given)
        .map_err(|_| Refusal::Unauthorized("credentials not in base64"))?;
    let (user, password) = match decoded.iter().position(|&b| b == b':') {
        Some(i) => (&decoded[..i], &decoded[i + 1..]),
        None => (&decoded[..], &[][..]),
    };
    // Both compared, whatever the first comparison said.
    let user_ok = same(user, credentials.user.as_bytes());
    let password_ok = same(password, credentials.password.expose_secret().as_bytes());
    if !(user_ok & password_ok) {
        return Err(Refusal::Unauthorized("wrong credentials"));
    }
    let record: Record =
        serde_json::from_slice(body).map_err(|_| Refusal::BadRequest("not a Postmark event"))?;
    let (kind, diagnostic) = match record.record_type.as_deref() {
        Some("Bounce") => (
            kind(record.kind.as_deref().unwrap_or("")),
            record.details.as_deref().or(record.description.as_deref()),
        ),
        Some("SpamComplaint") => (Kind::Complaint, record.details.as_deref()),
        _ => return Ok(Vec::new()),
    };
    let id = record.id.as_ref().map(|id| match id {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    });
    let key = event_key("postmark", id.as_deref())?;
    let items = vec![item(record.email.as_deref(), kind, None, diagnostic)];
    Ok(vec![Event {
        key,
        report: report("postmark", items, record.message_id.as_deref(), None, None),
    }])
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use secrecy::SecretString;

    fn credentials() -> PostmarkCredentials {
        PostmarkCredentials {
            user: "postmark".into(),
            password: SecretString::from("a password long enough"),
        }
    }

    fn basic(user_password: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let value = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(user_password)
        );
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&value).unwrap(),
        );
        headers
    }

    const BOUNCE: &str = r#"{"RecordType":"Bounce","ID":4323372036854775807,"Type":"HardBounce",
        "TypeCode":1,"MessageID":"883953f4-6105-42a2-a16a-77a8eac79483","Email":"John@Example.com",
        "Details":"smtp;550 5.1.1 The email account that you tried to reach does not exist",
        "BouncedAt":"2019-11-05T16:33:54.9070259Z"}"#;

    #[test]
    fn a_bounce_becomes_a_hard_bounce_found_by_message_id() {
        let events = read(
            &credentials(),
            &basic("postmark:a password long enough"),
            BOUNCE.as_bytes(),
        )
        .unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].key, "postmark:4323372036854775807");
        let report = &events[0].report;
        assert_eq!(
            report.relay_queue_ids,
            ["883953f4-6105-42a2-a16a-77a8eac79483"]
        );
        assert_eq!(
            report.items[0].recipient.as_deref(),
            Some("john@example.com")
        );
        assert_eq!(report.items[0].kind, Kind::HardBounce);
    }

    #[test]
    fn wrong_or_missing_credentials_are_refused() {
        for headers in [
            HeaderMap::new(),
            basic("postmark:wrong password of length"),
            basic("other:a password long enough"),
            basic("postmark"),
        ] {
            assert!(matches!(
                read(&credentials(), &headers, BOUNCE.as_bytes()),
                Err(Refusal::Unauthorized(_))
            ));
        }
    }

    #[test]
    fn other_record_types_record_nothing() {
        let body = br#"{"RecordType":"Delivery","MessageID":"x","Recipient":"a@b.example"}"#;
        let events = read(
            &credentials(),
            &basic("postmark:a password long enough"),
            body,
        )
        .unwrap();
        assert!(events.is_empty());
    }
}
