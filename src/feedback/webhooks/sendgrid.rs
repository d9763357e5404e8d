//! `POST /webhooks/sendgrid`: SendGrid's signed event webhook, a JSON array
//! of events; `bounce`, `dropped`, `spamreport` and `deferred` are recorded,
//! the others acknowledged. The signature
//! (`X-Twilio-Email-Event-Webhook-Signature`) is ECDSA P-256 with SHA-256,
//! DER-encoded, over the timestamp header followed by the body, verified
//! with the key SendGrid shows (`webhooks.sendgrid.public_key_file`). An
//! event's `sg_message_id` starts with the id SendGrid's SMTP server names
//! in its reply to "." (`queued as X`), followed by `.filter…`; its
//! `smtp-id` is the Message-ID; its `sg_event_id` is its key.

use axum::http::HeaderMap;
use base64::Engine as _;
use serde::Deserialize;

use super::{event_key, item, report, Event, Refusal};
use crate::feedback::parse::{Kind, MAX_ITEMS};

pub const SIGNATURE_HEADER: &str = "x-twilio-email-event-webhook-signature";
pub const TIMESTAMP_HEADER: &str = "x-twilio-email-event-webhook-timestamp";

/// The DER of a P-256 SubjectPublicKeyInfo up to the point: the algorithm
/// (id-ecPublicKey, prime256v1) and the bit string's header.
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

/// SendGrid's verification key: an uncompressed P-256 point.
#[derive(Clone, PartialEq, Eq)]
pub struct PublicKey(Vec<u8>);

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PublicKey(P-256)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("not base64 (the key as SendGrid shows it) nor PEM")]
    Encoding,
    #[error("not an ECDSA P-256 public key")]
    NotP256,
}

/// Reads the key as SendGrid shows it (base64 of the DER
/// SubjectPublicKeyInfo) or as a PEM `PUBLIC KEY`.
pub fn public_key(text: &str) -> Result<PublicKey, KeyError> {
    let text = text.trim();
    let base64: String = match text.strip_prefix("-----BEGIN PUBLIC KEY-----") {
        Some(rest) => rest
            .split("-----END PUBLIC KEY-----")
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect(),
        None => text.split_whitespace().collect(),
    };
    let der = base64::engine::general_purpose::STANDARD
        .decode(base64)
        .map_err(|_| KeyError::Encoding)?;
    match der.strip_prefix(&P256_SPKI_PREFIX[..]) {
        Some(point) if point.len() == 65 && point[0] == 0x04 => Ok(PublicKey(point.to_vec())),
        _ => Err(KeyError::NotP256),
    }
}

#[derive(Deserialize)]
struct SgEvent {
    event: Option<String>,
    email: Option<String>,
    sg_event_id: Option<String>,
    sg_message_id: Option<String>,
    #[serde(rename = "smtp-id")]
    smtp_id: Option<String>,
    status: Option<String>,
    reason: Option<String>,
    response: Option<String>,
    #[serde(rename = "type")]
    bounce_type: Option<String>,
}

/// What an event is, in DESIGN §12's kinds; `None` for the events that
/// record nothing.
pub fn kind(event: &str, bounce_type: Option<&str>, reason: Option<&str>) -> Option<Kind> {
    Some(match event {
        // A block is the receiver refusing for now, not a dead address.
        "bounce" if bounce_type == Some("blocked") => Kind::SoftBounce,
        "bounce" => Kind::HardBounce,
        "dropped" => match reason.unwrap_or("") {
            r if r.starts_with("Bounced Address") || r.starts_with("Invalid") => Kind::HardBounce,
            r if r.starts_with("Spam Reporting Address") => Kind::Complaint,
            _ => Kind::Unknown,
        },
        "spamreport" => Kind::Complaint,
        "deferred" => Kind::Delayed,
        _ => return None,
    })
}

/// Checks the signature, then reads the events.
pub fn read(key: &PublicKey, headers: &HeaderMap, body: &[u8]) -> Result<Vec<Event>, Refusal> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let (Some(signature), Some(timestamp)) = (header(SIGNATURE_HEADER), header(TIMESTAMP_HEADER))
    else {
        return Err(Refusal::Forbidden("no signature"));
    };
    let signature = base64::engine::general_purpose::STANDARD
        .decode(signature.trim())
        .map_err(|_| Refusal::Forbidden("signature not in base64"))?;
    let mut signed = Vec::with_capacity(timestamp.len() + body.len());
    signed.extend_from_slice(timestamp.as_bytes());
    signed.extend_from_slice(body);
    ring::signature::UnparsedPublicKey::new(&ring::signature::ECDSA_P256_SHA256_ASN1, &key.0)
        .verify(&signed, &signature)
        .map_err(|_| Refusal::Forbidden("signature does not verify"))?;
    let events: Vec<SgEvent> =
        serde_json::from_slice(body).map_err(|_| Refusal::BadRequest("not SendGrid events"))?;
    let mut out = Vec::new();
    for event in events.iter().take(MAX_ITEMS) {
        let Some(kind) = kind(
            event.event.as_deref().unwrap_or(""),
            event.bounce_type.as_deref(),
            event.reason.as_deref(),
        ) else {
            continue;
        };
        let key = event_key("sendgrid", event.sg_event_id.as_deref())?;
        let queue_id = event
            .sg_message_id
            .as_deref()
            .map(|id| id.split('.').next().unwrap_or(id));
        let diagnostic = event.reason.as_deref().or(event.response.as_deref());
        let items = vec![item(
            event.email.as_deref(),
            kind,
            event.status.as_deref(),
            diagnostic,
        )];
        out.push(Event {
            key,
            report: report("sendgrid", items, queue_id, event.smtp_id.as_deref(), None),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use ring::{rand::SystemRandom, signature::KeyPair as _};

    fn keys() -> (ring::signature::EcdsaKeyPair, String) {
        let rng = SystemRandom::new();
        let alg = &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING;
        let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(alg, &rng).unwrap();
        let pair = ring::signature::EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).unwrap();
        let mut spki = P256_SPKI_PREFIX.to_vec();
        spki.extend_from_slice(pair.public_key().as_ref());
        let shown = base64::engine::general_purpose::STANDARD.encode(spki);
        (pair, shown)
    }

    fn signed(pair: &ring::signature::EcdsaKeyPair, timestamp: &str, body: &str) -> HeaderMap {
        let mut message = timestamp.as_bytes().to_vec();
        message.extend_from_slice(body.as_bytes());
        let signature = pair.sign(&SystemRandom::new(), &message).unwrap();
        let mut headers = HeaderMap::new();
        let b64 = base64::engine::general_purpose::STANDARD.encode(signature.as_ref());
        headers.insert(SIGNATURE_HEADER, HeaderValue::from_str(&b64).unwrap());
        headers.insert(TIMESTAMP_HEADER, HeaderValue::from_str(timestamp).unwrap());
        headers
    }

    const EVENTS: &str = r#"[{"email":"example@test.com","timestamp":1513299569,
        "smtp-id":"<14c5d75ce93.dfd.64b469@ismtpd-555>","event":"bounce","category":"cat facts",
        "sg_event_id":"6g4ZI7SA-xmRDv57GoPIPw==","sg_message_id":"14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0",
        "reason":"500 unknown recipient","status":"5.0.0","type":"bounce"},
        {"email":"example@test.com","timestamp":1513299569,"event":"processed","sg_event_id":"x"}]"#;

    #[test]
    fn the_key_is_read_as_sendgrid_shows_it_or_as_pem() {
        let (_, shown) = keys();
        let key = public_key(&shown).unwrap();
        let pem = format!(
            "-----BEGIN PUBLIC KEY-----\n{}\n{}\n-----END PUBLIC KEY-----\n",
            &shown[..64],
            &shown[64..]
        );
        assert_eq!(public_key(&pem).unwrap(), key);
        assert!(public_key("not a key").is_err());
        assert!(matches!(public_key("AAAA"), Err(KeyError::NotP256)));
    }

    #[test]
    fn signed_events_are_read_and_tampered_ones_refused() {
        let (pair, shown) = keys();
        let key = public_key(&shown).unwrap();
        let headers = signed(&pair, "1513299569", EVENTS);
        let events = read(&key, &headers, EVENTS.as_bytes()).unwrap();
        assert_eq!(events.len(), 1, "processed records nothing");
        assert_eq!(events[0].key, "sendgrid:6g4ZI7SA-xmRDv57GoPIPw==");
        assert_eq!(events[0].report.relay_queue_ids, ["14c5d75ce93"]);
        assert_eq!(
            events[0].report.original_message_id.as_deref(),
            Some("<14c5d75ce93.dfd.64b469@ismtpd-555>")
        );
        let tampered = EVENTS.replace("bounce\"}", "blocked\"}");
        assert_eq!(
            read(&key, &headers, tampered.as_bytes()),
            Err(Refusal::Forbidden("signature does not verify"))
        );
        let other_time = signed(&pair, "1513299570", EVENTS);
        let mut mixed = headers.clone();
        mixed.insert(TIMESTAMP_HEADER, other_time[TIMESTAMP_HEADER].clone());
        assert!(read(&key, &mixed, EVENTS.as_bytes()).is_err());
    }

    #[test]
    fn kinds() {
        assert_eq!(
            kind("bounce", Some("blocked"), None),
            Some(Kind::SoftBounce)
        );
        assert_eq!(
            kind("dropped", None, Some("Bounced Address")),
            Some(Kind::HardBounce)
        );
        assert_eq!(
            kind("dropped", None, Some("Unsubscribed Address")),
            Some(Kind::Unknown)
        );
        assert_eq!(kind("deferred", None, None), Some(Kind::Delayed));
        assert_eq!(kind("open", None, None), None);
    }
}
