//! DKIM signing (RFC 6376, RFC 8463 for Ed25519) of the message bytes exactly
//! as they go out: the key loaded once at start from `dkim.private_key_file`
//! (PEM: an RSA key of at least 2048 bits in PKCS#1 or PKCS#8 form, or an
//! Ed25519 key in PKCS#8 form), and the decision which mails it signs: those
//! whose From domain is `dkim.domain` or below it.
//!
//! Canonicalization is relaxed/relaxed, which survives the refolding and
//! whitespace changes relays make. Every header of [`SIGNED`] is named in the
//! signature whether the message has it or not (RFC 6376 §5.4: an absent
//! header signs as empty), so none of them can be added on the way without
//! breaking it.
//!
//! Why not lettre's signer: it hashes the headers of its `Message` only, and
//! lettre writes Content-Type and Content-Transfer-Encoding with the MIME
//! part, so they could not be signed (naming them made every receiver reject
//! the signature); and its RSA is the `rsa` crate's, several times slower
//! than ring's and not constant-time (RUSTSEC-2023-0071). The signatures
//! here are ring's (already in the build for rustls): constant-time, and
//! Ed25519 cheaper still. Canonicalization is one pass over the bytes.

use base64::Engine as _;
use ring::{
    digest,
    rand::SystemRandom,
    signature::{Ed25519KeyPair, RsaKeyPair, RSA_PKCS1_SHA256},
};

/// Signed, in this order (each once: the last instance counts, RFC 6376
/// §5.4.2; the message builder writes each of them at most once).
const SIGNED: &[&str] = &[
    "from",
    "reply-to",
    "to",
    "cc",
    "subject",
    "date",
    "message-id",
    "mime-version",
    "content-type",
    "content-transfer-encoding",
    "list-unsubscribe",
    "list-unsubscribe-post",
    // Gmail's feedback loop reads it only when it is signed.
    "feedback-id",
];

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("not a PEM private key (RSA in PKCS#1 or PKCS#8, or Ed25519 in PKCS#8)")]
    NotPem,
    #[error("an RSA key under 2048 bits is too weak: at least 2048")]
    WeakRsa,
    #[error("unreadable key: {0}")]
    Invalid(String),
}

enum Key {
    Rsa(RsaKeyPair),
    Ed25519(Ed25519KeyPair),
}

/// Every configured key (`[[dkim]]`, and each route's): a mail is signed
/// with the key of the most specific domain at or above its From domain.
#[derive(Debug, Default)]
pub struct Signers(Vec<Signer>);

impl Signers {
    pub fn new(mut signers: Vec<Signer>) -> Signers {
        // The longest domain first: the first that covers is the most
        // specific.
        signers.sort_by_key(|s| std::cmp::Reverse(s.domain.len()));
        Signers(signers)
    }

    /// The key for a mail from `from_domain`, if any covers it.
    pub fn pick(&self, from_domain: &str) -> Option<&Signer> {
        self.0.iter().find(|s| s.covers(from_domain))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Signer> {
        self.0.iter()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A loaded key and the domain it signs for.
pub struct Signer {
    domain: String,
    selector: String,
    key: Key,
    /// `selector s1, rsa-sha256 (2048 bits)`, for logs and `check`.
    described: String,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("domain", &self.domain)
            .field("key", &self.described)
            .finish_non_exhaustive()
    }
}

impl Signer {
    /// Parses `pem` and checks it; the error says what is wrong with it.
    pub fn new(domain: &str, selector: &str, pem: &str) -> Result<Signer, KeyError> {
        let key = parse_key(pem)?;
        let described = match &key {
            Key::Rsa(k) => format!(
                "selector {selector}, rsa-sha256 ({} bits)",
                k.public().modulus_len() * 8
            ),
            Key::Ed25519(_) => format!("selector {selector}, ed25519-sha256"),
        };
        Ok(Signer {
            domain: domain.trim_end_matches('.').to_ascii_lowercase(),
            selector: selector.to_string(),
            key,
            described,
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

    /// `message` (CRLF lines, headers then a blank line then the body) with a
    /// DKIM-Signature header in front, signed at `timestamp` (Unix seconds).
    pub fn sign(&self, message: &[u8], timestamp: i64) -> Vec<u8> {
        let (head, body) = split_message(message);
        let body_hash = digest::digest(&digest::SHA256, &relaxed_body(body));
        let b64 = base64::engine::general_purpose::STANDARD;
        let algorithm = match self.key {
            Key::Rsa(_) => "rsa-sha256",
            Key::Ed25519(_) => "ed25519-sha256",
        };
        // Folded so that no line passes 78 octets: verifiers ignore folding
        // whitespace in h= (after a colon) and in b=.
        let names: Vec<String> = SIGNED.chunks(3).map(|c| c.join(":")).collect();
        let tags = format!(
            "v=1; a={algorithm}; c=relaxed/relaxed; d={}; s={};\r\n\tt={timestamp}; bh={};\r\n\th={};\r\n\tb=",
            self.domain,
            self.selector,
            b64.encode(body_hash.as_ref()),
            names.join(":\r\n\t "),
        );
        // What is signed: the named headers, then the signature header itself
        // with an empty b=, without its final CRLF (RFC 6376 §3.7).
        let fields = header_fields(head);
        let mut signed = Vec::with_capacity(head.len() + tags.len() + 32);
        for name in SIGNED {
            if let Some(field) = fields.iter().rev().find(|f| f.name == *name) {
                relaxed_header(name, field.value, &mut signed);
                signed.extend_from_slice(b"\r\n");
            }
        }
        relaxed_header("dkim-signature", tags.as_bytes(), &mut signed);
        let signature = match &self.key {
            Key::Rsa(key) => {
                let mut out = vec![0; key.public().modulus_len()];
                key.sign(&RSA_PKCS1_SHA256, &SystemRandom::new(), &signed, &mut out)
                    .expect("an RSA signature over a buffer of the modulus' length");
                out
            }
            Key::Ed25519(key) => {
                // RFC 8463: Ed25519 signs the SHA-256 hash of the data.
                let hash = digest::digest(&digest::SHA256, &signed);
                key.sign(hash.as_ref()).as_ref().to_vec()
            }
        };
        let mut out = Vec::with_capacity(message.len() + tags.len() + 512);
        out.extend_from_slice(b"DKIM-Signature: ");
        out.extend_from_slice(tags.as_bytes());
        let encoded = b64.encode(signature);
        for (i, chunk) in encoded.as_bytes().chunks(72).enumerate() {
            if i > 0 {
                out.extend_from_slice(b"\r\n\t ");
            }
            out.extend_from_slice(chunk);
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(message);
        out
    }
}

/// The header block (with its final CRLF) and the body after the blank line.
fn split_message(message: &[u8]) -> (&[u8], &[u8]) {
    match message.windows(4).position(|w| w == b"\r\n\r\n") {
        Some(at) => (&message[..at + 2], &message[at + 4..]),
        None => (message, &[]),
    }
}

struct Field<'a> {
    /// Lowercase.
    name: String,
    /// Everything after the colon, folding included, without the final CRLF.
    value: &'a [u8],
}

/// The header fields of `head`, continuation lines joined to their field.
fn header_fields(head: &[u8]) -> Vec<Field<'_>> {
    // (where the field starts, its colon, where its value ends)
    let mut spans: Vec<(usize, usize, usize)> = Vec::new();
    let mut current: Option<(usize, usize)> = None;
    let mut start = 0;
    while start < head.len() {
        let end = head[start..]
            .windows(2)
            .position(|w| w == b"\r\n")
            .map_or(head.len(), |p| start + p);
        if !matches!(head[start], b' ' | b'\t') {
            if let Some((from, colon)) = current.take() {
                spans.push((from, colon, start - 2));
            }
            current = head[start..end]
                .iter()
                .position(|&b| b == b':')
                .map(|colon| (start, start + colon));
        }
        start = end + 2;
    }
    if let Some((from, colon)) = current {
        let end = head.strip_suffix(b"\r\n").unwrap_or(head).len();
        spans.push((from, colon, end.max(colon + 1)));
    }
    spans
        .into_iter()
        .map(|(from, colon, end)| Field {
            name: String::from_utf8_lossy(&head[from..colon])
                .trim()
                .to_ascii_lowercase(),
            value: &head[colon + 1..end],
        })
        .collect()
}

/// RFC 6376 §3.4.2: `name:value` with the value unfolded, runs of whitespace
/// made one space, and no whitespace at either end.
fn relaxed_header(name: &str, value: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(name.as_bytes());
    out.push(b':');
    let mut pending_space = false;
    let mut wrote = false;
    for &b in value {
        match b {
            b'\r' | b'\n' => {}
            b' ' | b'\t' => pending_space = true,
            _ => {
                if pending_space && wrote {
                    out.push(b' ');
                }
                pending_space = false;
                wrote = true;
                out.push(b);
            }
        }
    }
}

/// RFC 6376 §3.4.4: whitespace runs made one space, none at a line's end, no
/// empty lines at the end, and a final CRLF unless the body is empty.
fn relaxed_body(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 2);
    let mut empty_lines = 0;
    let mut lines = body.split(|&b| b == b'\n').peekable();
    while let Some(line) = lines.next() {
        if lines.peek().is_none() && line.is_empty() {
            break; // the part after the final line break
        }
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let (mut started, mut pending_space) = (false, false);
        for &b in line {
            if b == b' ' || b == b'\t' {
                pending_space = true;
                continue;
            }
            if !started {
                // Empty lines count only when something follows them.
                for _ in 0..empty_lines {
                    out.extend_from_slice(b"\r\n");
                }
                empty_lines = 0;
                started = true;
            }
            if pending_space {
                out.push(b' ');
                pending_space = false;
            }
            out.push(b);
        }
        if started {
            out.extend_from_slice(b"\r\n");
        } else {
            empty_lines += 1;
        }
    }
    out
}

fn parse_key(pem: &str) -> Result<Key, KeyError> {
    let pem = pem.trim();
    let first = pem.lines().next().unwrap_or("");
    let pkcs1 = first == "-----BEGIN RSA PRIVATE KEY-----";
    if !pkcs1 && first != "-----BEGIN PRIVATE KEY-----" {
        return Err(KeyError::NotPem);
    }
    let body: String = pem
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .map(str::trim)
        .collect();
    let der = base64::engine::general_purpose::STANDARD
        .decode(body)
        .map_err(|_| KeyError::NotPem)?;
    let rsa = if pkcs1 {
        RsaKeyPair::from_der(&der)
    } else {
        RsaKeyPair::from_pkcs8(&der)
    };
    match rsa {
        Ok(key) => return Ok(Key::Rsa(key)),
        Err(e) if e.to_string() == "TooSmall" => return Err(KeyError::WeakRsa),
        Err(e) if pkcs1 => return Err(KeyError::Invalid(e.to_string())),
        Err(_) => {}
    }
    Ed25519KeyPair::from_pkcs8_maybe_unchecked(&der)
        .map(Key::Ed25519)
        .map_err(|_| KeyError::Invalid("neither an RSA nor an Ed25519 private key".into()))
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
        assert!(matches!(
            Signer::new("a.b", "s", junk),
            Err(KeyError::Invalid(_))
        ));
    }

    #[test]
    fn relaxed_canonicalization_follows_rfc_6376() {
        // RFC 6376 §3.4.6's example.
        let mut h = Vec::new();
        relaxed_header("a", b" X", &mut h);
        h.extend_from_slice(b"\r\n");
        relaxed_header("b", b" Y\t\r\n\tZ  ", &mut h);
        assert_eq!(h, b"a:X\r\nb:Y Z");
        assert_eq!(relaxed_body(b" C \r\nD \t E\r\n\r\n\r\n"), b" C\r\nD E\r\n");
        assert_eq!(relaxed_body(b""), b"");
        assert_eq!(relaxed_body(b"\r\n\r\n"), b"");
        assert_eq!(relaxed_body(b"x"), b"x\r\n");
    }

    #[test]
    fn the_signature_header_leads_and_names_the_headers() {
        let s = Signer::new("example.com", "s1", ED25519_PEM).unwrap();
        let message = b"From: a@example.com\r\nSubject: Hi\r\n there\r\nContent-Type: text/plain\r\n\r\nHello\r\n";
        let signed = String::from_utf8(s.sign(message, 1_700_000_000)).unwrap();
        assert!(signed.starts_with(
            "DKIM-Signature: v=1; a=ed25519-sha256; c=relaxed/relaxed; d=example.com; s=s1;\r\n"
        ));
        assert!(signed.contains("h=from:reply-to:to:\r\n\t cc:subject:date:\r\n\t message-id:mime-version:content-type:"));
        assert!(signed.ends_with("\r\nFrom: a@example.com\r\nSubject: Hi\r\n there\r\nContent-Type: text/plain\r\n\r\nHello\r\n"));
        assert!(signed.lines().all(|l| l.len() <= 78), "{signed}");
        let fields = header_fields(b"From: a\r\nSubject: Hi\r\n there\r\n");
        assert_eq!(fields[1].name, "subject");
        assert_eq!(fields[1].value, b" Hi\r\n there");
    }

    #[test]
    fn the_most_specific_key_signs() {
        let signers = Signers::new(vec![
            Signer::new("example.com", "outer", ED25519_PEM).unwrap(),
            Signer::new("shop.example.com", "shop", ED25519_PEM).unwrap(),
            Signer::new("other.org", "other", ED25519_PEM).unwrap(),
        ]);
        let pick = |d: &str| signers.pick(d).map(|s| s.selector.clone());
        assert_eq!(pick("shop.example.com").as_deref(), Some("shop"));
        assert_eq!(pick("eu.shop.example.com").as_deref(), Some("shop"));
        assert_eq!(pick("example.com").as_deref(), Some("outer"));
        assert_eq!(pick("support.example.com").as_deref(), Some("outer"));
        assert_eq!(pick("other.org").as_deref(), Some("other"));
        assert_eq!(pick("example.net"), None);
        assert_eq!(pick("notexample.com"), None);
    }

    /// Linear in the message: a megabyte of subject and body sign at once.
    #[test]
    fn a_huge_message_signs_in_one_pass() {
        let s = Signer::new("example.com", "s", ED25519_PEM).unwrap();
        let mut message = b"From: a@example.com\r\nSubject: ".to_vec();
        message.extend(std::iter::repeat_n(b'x', 1 << 20));
        message.extend_from_slice(b"\r\n\r\n");
        message.extend(b"y \r\n".repeat(250_000));
        let signed = s.sign(&message, 0);
        assert!(signed.starts_with(b"DKIM-Signature:"));
        assert!(signed.ends_with(&message));
    }
}
