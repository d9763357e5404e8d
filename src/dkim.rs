//! DKIM signing (RFC 6376) with lettre's signer: the key loaded once at
//! start from `dkim.private_key_file` (PEM: an RSA key of at least 2048 bits
//! in PKCS#1 or PKCS#8 form, or an Ed25519 key in PKCS#8 form), and the
//! decision which mails it signs: those whose From domain is `dkim.domain` or
//! below it.
//!
//! Canonicalization is relaxed/relaxed, which survives the refolding and
//! whitespace changes relays make. Every header of the list below is named in
//! the signature whether the message has it or not (RFC 6376 §5.4: an absent
//! header signs as empty), so none of them can be added on the way without
//! breaking it. `Content-Type` and `Content-Transfer-Encoding` are not on the
//! list: lettre writes them with the MIME part, outside the headers its signer
//! sees, so naming them would sign them as absent and every receiver would
//! reject the signature (tests/relays.rs verifies with dkimpy). The body hash
//! still covers the whole MIME structure below them.

use base64::Engine as _;
use lettre::message::{
    dkim::{
        DkimCanonicalization, DkimCanonicalizationType, DkimConfig, DkimSigningAlgorithm,
        DkimSigningKey,
    },
    header::HeaderName,
    Message,
};
use rsa::{
    pkcs1::{DecodeRsaPrivateKey, EncodeRsaPrivateKey, LineEnding},
    pkcs8::DecodePrivateKey,
    traits::PublicKeyParts,
    RsaPrivateKey,
};

/// Signed, in this order.
const SIGNED: &[&str] = &[
    "From",
    "Reply-To",
    "To",
    "Cc",
    "Subject",
    "Date",
    "Message-ID",
    "MIME-Version",
    "List-Unsubscribe",
    "List-Unsubscribe-Post",
];

/// The DER prefix of an Ed25519 private key in PKCS#8 (RFC 8410): the 32-byte
/// seed follows it.
const ED25519_PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("not a PEM private key (RSA in PKCS#1 or PKCS#8, or Ed25519 in PKCS#8)")]
    NotPem,
    #[error("an RSA key of {0} bits is too weak: at least 2048")]
    WeakRsa(usize),
    #[error("unreadable key: {0}")]
    Invalid(String),
}

/// A loaded key and the domain it signs for.
pub struct Signer {
    domain: String,
    /// `selector=s1 algorithm=rsa-sha256 (2048 bits)`, for logs and `check`.
    described: String,
    config: DkimConfig,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

impl Signer {
    /// Parses `pem` and checks it; the error says what is wrong with it.
    pub fn new(domain: &str, selector: &str, pem: &str) -> Result<Signer, KeyError> {
        let (key, algorithm, strength) = parse_key(pem)?;
        let described = match algorithm {
            DkimSigningAlgorithm::Rsa => {
                format!("selector {selector}, rsa-sha256 ({strength} bits)")
            }
            DkimSigningAlgorithm::Ed25519 => format!("selector {selector}, ed25519-sha256"),
        };
        let key = DkimSigningKey::new(&key, algorithm)
            .map_err(|e| KeyError::Invalid(format!("{e:?}")))?;
        let domain = domain.trim_end_matches('.').to_ascii_lowercase();
        let config = DkimConfig::new(
            selector.to_string(),
            domain.clone(),
            key,
            SIGNED
                .iter()
                .map(|name| HeaderName::new_from_ascii_str(name))
                .collect(),
            DkimCanonicalization {
                header: DkimCanonicalizationType::Relaxed,
                body: DkimCanonicalizationType::Relaxed,
            },
        );
        Ok(Signer {
            domain,
            described,
            config,
        })
    }

    /// The signing domain.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The selector and algorithm, as an operator reads them.
    pub fn describe(&self) -> &str {
        &self.described
    }

    /// Whether a mail from `from_domain` is signed: `dkim.domain` or below.
    pub fn covers(&self, from_domain: &str) -> bool {
        let from = from_domain.trim_end_matches('.').to_ascii_lowercase();
        from == self.domain
            || from
                .strip_suffix(&self.domain)
                .is_some_and(|rest| rest.ends_with('.'))
    }

    /// Adds a DKIM-Signature header to `message`.
    pub fn sign(&self, message: &mut Message) {
        message.sign(&self.config);
    }
}

/// What lettre's `DkimSigningKey::new` wants: a PKCS#1 PEM for RSA, the
/// base64 of the 32-byte seed for Ed25519.
/// The third element is the RSA key's size in bits (0 for Ed25519).
fn parse_key(pem: &str) -> Result<(String, DkimSigningAlgorithm, usize), KeyError> {
    let pem = pem.trim();
    if pem.starts_with("-----BEGIN RSA PRIVATE KEY-----") {
        let key =
            RsaPrivateKey::from_pkcs1_pem(pem).map_err(|e| KeyError::Invalid(e.to_string()))?;
        return rsa_key(key);
    }
    if !pem.starts_with("-----BEGIN PRIVATE KEY-----") {
        return Err(KeyError::NotPem);
    }
    if let Ok(key) = RsaPrivateKey::from_pkcs8_pem(pem) {
        return rsa_key(key);
    }
    let body: String = pem
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .map(str::trim)
        .collect();
    let der = base64::engine::general_purpose::STANDARD
        .decode(body)
        .map_err(|_| KeyError::NotPem)?;
    match der.strip_prefix(&ED25519_PKCS8_PREFIX[..]) {
        Some(seed) if seed.len() == 32 => Ok((
            base64::engine::general_purpose::STANDARD.encode(seed),
            DkimSigningAlgorithm::Ed25519,
            0,
        )),
        _ => Err(KeyError::Invalid(
            "neither an RSA nor an Ed25519 private key".into(),
        )),
    }
}

fn rsa_key(key: RsaPrivateKey) -> Result<(String, DkimSigningAlgorithm, usize), KeyError> {
    let bits = key.size() * 8;
    if bits < 2048 {
        return Err(KeyError::WeakRsa(bits));
    }
    let pem = key
        .to_pkcs1_pem(LineEnding::LF)
        .map_err(|e| KeyError::Invalid(e.to_string()))?;
    Ok((pem.to_string(), DkimSigningAlgorithm::Rsa, bits))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixed Ed25519 test key (RFC 8032's first test vector's seed).
    const ED25519_PEM: &str = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIJ1hsZ3v/VpguoRK9JLsLMREScVpezJpGXA7rAMcrn9g\n-----END PRIVATE KEY-----\n";

    #[test]
    fn covers_the_domain_and_below_only() {
        let s = Signer::new("Example.com.", "s", ED25519_PEM).unwrap();
        assert!(s.covers("example.com"));
        assert!(s.covers("Mail.Example.COM"));
        assert!(!s.covers("badexample.com"));
        assert!(!s.covers("example.org"));
    }

    #[test]
    fn refuses_what_is_not_a_key() {
        assert!(matches!(
            Signer::new("a.b", "s", "hello"),
            Err(KeyError::NotPem)
        ));
        let junk = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
        assert!(Signer::new("a.b", "s", junk).is_err());
    }

    /// lettre canonicalizes a header one character per call: with
    /// dependencies built optimized (Cargo.toml) that is a loop, and a
    /// megabyte of subject signs on a tokio worker's 2 MiB stack.
    #[test]
    fn a_huge_header_signs_without_exhausting_the_stack() {
        let signer = Signer::new("example.com", "s", ED25519_PEM).unwrap();
        let signed = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let mut m = Message::builder()
                    .from("a@example.com".parse().unwrap())
                    .to("b@example.com".parse().unwrap())
                    .subject("\u{fc}x".repeat(300_000))
                    .body(String::from("hi"))
                    .unwrap();
                signer.sign(&mut m);
                String::from_utf8(m.formatted()).unwrap()
            })
            .unwrap()
            .join()
            .expect("signing did not overflow the stack");
        assert!(signed.contains("DKIM-Signature: v=1; a=ed25519-sha256"));
    }
}
