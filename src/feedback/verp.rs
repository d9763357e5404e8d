//! The VERP envelope sender (DESIGN §12): every mail leaves with
//! `MAIL FROM:<b-<id>-<tag>@<bounce.domain>>`, so a report that comes back
//! names the mail it is about. The tag is the first 10 characters of the
//! lowercase RFC 4648 base32 (no padding) of HMAC-SHA256(secret, decimal
//! id): without the secret nobody can name a mail that is not theirs, so a
//! forged report acts on nothing.

use ring::hmac;

/// Characters of the tag: 50 bits of the HMAC.
const TAG_LEN: usize = 10;
const BASE32: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

/// The bounce domain and the key of its tags.
#[derive(Clone)]
pub struct Verp {
    domain: String,
    key: hmac::Key,
}

impl std::fmt::Debug for Verp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("Verp")
            .field("domain", &self.domain)
            .finish()
    }
}

impl Verp {
    /// `secret`: the contents of `bounce.secret_file` without its trailing
    /// newline. `domain` is lower-cased; a trailing dot is dropped.
    pub fn new(domain: &str, secret: &[u8]) -> Verp {
        Verp {
            domain: domain.trim_end_matches('.').to_ascii_lowercase(),
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
        }
    }

    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The tag of mail `id`.
    pub fn tag(&self, id: i64) -> String {
        let mac = hmac::sign(&self.key, id.to_string().as_bytes());
        base32_prefix(mac.as_ref(), TAG_LEN)
    }

    /// The envelope sender of mail `id`.
    pub fn address(&self, id: i64) -> String {
        format!("b-{id}-{}@{}", self.tag(id), self.domain)
    }

    /// The mail an address names, when it is one of ours and its tag
    /// verifies (in constant time); `None` for anything else. Case does not
    /// matter: mail systems may fold the local part.
    pub fn verify(&self, address: &str) -> Option<i64> {
        let address = address.trim().trim_start_matches('<').trim_end_matches('>');
        let (local, domain) = address.rsplit_once('@')?;
        if !domain
            .trim_end_matches('.')
            .eq_ignore_ascii_case(&self.domain)
        {
            return None;
        }
        let rest = local
            .strip_prefix("b-")
            .or_else(|| local.strip_prefix("B-"))?;
        let (id, tag) = rest.split_once('-')?;
        // Canonical decimal only: "007" or "+7" would name mail 7 with a
        // tag computed over other text.
        if id.is_empty()
            || id.len() > 19
            || id.starts_with('0')
            || !id.bytes().all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let id: i64 = id.parse().ok()?;
        if tag.len() != TAG_LEN {
            return None;
        }
        let expected = self.tag(id);
        let given = tag.to_ascii_lowercase();
        let same: bool =
            subtle::ConstantTimeEq::ct_eq(expected.as_bytes(), given.as_bytes()).into();
        same.then_some(id)
    }
}

/// The first `len` characters of the lowercase base32 of `bytes`.
fn base32_prefix(bytes: &[u8], len: usize) -> String {
    let mut out = String::with_capacity(len);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &byte in bytes {
        buffer = (buffer << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(BASE32[((buffer >> bits) & 31) as usize] as char);
            if out.len() == len {
                return out;
            }
        }
        buffer &= (1 << bits) - 1;
    }
    if bits > 0 && out.len() < len {
        // The last group, filled up with zero bits.
        out.push(BASE32[((buffer << (5 - bits)) & 31) as usize] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base32_follows_rfc_4648() {
        // RFC 4648 section 10, lower-cased, without padding.
        for (input, encoded) in [
            ("f", "my"),
            ("fo", "mzxq"),
            ("foo", "mzxw6"),
            ("foob", "mzxw6yq"),
            ("fooba", "mzxw6ytb"),
            ("foobar", "mzxw6ytboi"),
        ] {
            assert_eq!(base32_prefix(input.as_bytes(), 16), encoded, "{input}");
        }
    }

    #[test]
    fn the_tag_is_the_hmac_of_the_decimal_id() {
        // Computed independently: python3 -c "import hmac,hashlib,base64;
        // print(base64.b32encode(hmac.new(b'secret', b'42',
        // hashlib.sha256).digest()).decode().lower()[:10])"
        let verp = Verp::new("Bounce.Example.COM.", b"secret");
        let expected = "spasdz5kin";
        assert_eq!(verp.tag(42), expected);
        assert_eq!(independent_tag(b"secret", 42), expected);
        assert_eq!(
            verp.address(42),
            format!("b-42-{expected}@bounce.example.com")
        );
    }

    /// The tag by way of ring's digest and a bit-by-bit base32, to check the
    /// encoder against a second path.
    fn independent_tag(secret: &[u8], id: i64) -> String {
        let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let mac = hmac::sign(&key, id.to_string().as_bytes());
        let bits: Vec<u8> = mac
            .as_ref()
            .iter()
            .flat_map(|b| (0..8).rev().map(move |i| (b >> i) & 1))
            .collect();
        bits.chunks(5)
            .take(TAG_LEN)
            .map(|c| BASE32[c.iter().fold(0usize, |v, b| v << 1 | *b as usize)] as char)
            .collect()
    }

    #[test]
    fn only_a_verified_tag_names_a_mail() {
        let verp = Verp::new("bounce.example.com", b"secret");
        let other = Verp::new("bounce.example.com", b"another secret");
        let address = verp.address(12345);
        assert_eq!(verp.verify(&address), Some(12345));
        assert_eq!(verp.verify(&address.to_uppercase()), Some(12345));
        assert_eq!(verp.verify(&format!("<{address}>")), Some(12345));
        assert_eq!(other.verify(&address), None, "another key");
        let tag = verp.tag(12345);
        for forged in [
            format!("b-12346-{tag}@bounce.example.com"),
            format!("b-012345-{tag}@bounce.example.com"),
            format!("b-+12345-{tag}@bounce.example.com"),
            format!("b-12345-{}@bounce.example.com", &tag[..9]),
            format!("b-12345-{tag}x@bounce.example.com"),
            format!("b-12345-{tag}@example.com"),
            format!("b-12345-{tag}@evil.bounce.example.com"),
            format!("x-12345-{tag}@bounce.example.com"),
            "b-99999999999999999999-aaaaaaaaaa@bounce.example.com".to_string(),
            "b--aaaaaaaaaa@bounce.example.com".to_string(),
            "postmaster@bounce.example.com".to_string(),
            "".to_string(),
            "@".to_string(),
        ] {
            assert_eq!(verp.verify(&forged), None, "{forged}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_text_is_verified_without_panic(address in ".{0,80}") {
            let verp = Verp::new("bounce.example.com", b"secret");
            let _ = verp.verify(&address);
        }

        #[test]
        fn every_id_round_trips(id in 1i64..i64::MAX) {
            let verp = Verp::new("bounce.example.com", b"k");
            proptest::prop_assert_eq!(verp.verify(&verp.address(id)), Some(id));
        }
    }
}
