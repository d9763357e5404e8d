//! Addresses: the comma-separated lists of the row (`to_address`, `cc`,
//! `bcc`, `reply_to`) and the bare sender, parsed in one pass each, checked,
//! with every domain written as A-labels (punycode), and written back into
//! header fields.
//!
//! What a list entry may be: `local@domain` or `display name <local@domain>`,
//! the display name made of atoms and quoted strings (UTF-8 allowed), the
//! local part a dot-atom or a quoted string (UTF-8 allowed: it then needs
//! SMTPUTF8), the domain a host name (an internationalized one becomes
//! A-labels, so it never needs SMTPUTF8). Not supported, as before: comments,
//! groups, domain literals.

use std::borrow::Cow;

use lettre::Address;

use super::{
    header::{encoded_words, Field, Out},
    MailError,
};

/// The longest local part (RFC 5321 §4.5.3.1.1).
const MAX_LOCAL: usize = 64;
/// The longest domain in its A-label form (RFC 1035).
const MAX_DOMAIN: usize = 253;
/// A display name up to this length goes as an atom or a quoted string when
/// it can; longer ones as encoded-words, which fold.
const PLAIN_NAME: usize = 64;

/// One mailbox of a list, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Mailbox<'a> {
    pub(super) name: Option<Cow<'a, str>>,
    /// As written: a dot-atom or a quoted string.
    pub(super) local: &'a str,
    /// A-labels.
    pub(super) domain: Cow<'a, str>,
}

impl Mailbox<'_> {
    /// The address for the envelope.
    pub(super) fn address(&self) -> Address {
        // Checked by `addr_spec` more strictly than lettre would.
        Address::new_dangerous(self.local, &*self.domain)
    }

    /// A non-ASCII local part: the mail needs SMTPUTF8.
    pub(super) fn needs_smtputf8(&self) -> bool {
        !self.local.is_ascii()
    }
}

/// The entries of a list: split at the commas outside quoted strings and
/// angle brackets, trimmed, empty ones skipped. One pass, no allocation.
pub(super) fn entries(list: &str) -> impl Iterator<Item = &str> {
    let bytes = list.as_bytes();
    let mut start = 0;
    let mut at = 0;
    let (mut quoted, mut escaped, mut angle) = (false, false, false);
    std::iter::from_fn(move || {
        while start <= bytes.len() {
            let mut end = None;
            while at < bytes.len() {
                let b = bytes[at];
                at += 1;
                match b {
                    _ if escaped => escaped = false,
                    b'\\' if quoted => escaped = true,
                    b'"' => quoted = !quoted,
                    b'<' if !quoted => angle = true,
                    b'>' if !quoted => angle = false,
                    b',' if !quoted && !angle => {
                        end = Some(at - 1);
                        break;
                    }
                    _ => {}
                }
            }
            let end = end.unwrap_or(bytes.len());
            let entry = list[start..end].trim();
            start = end + 1;
            if !entry.is_empty() {
                return Some(entry);
            }
        }
        None
    })
}

/// Parses a list; an absent or empty one is `Ok(vec![])`.
pub(super) fn parse_list<'a>(
    field: &'static str,
    list: Option<&'a str>,
) -> Result<Vec<Mailbox<'a>>, MailError> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    entries(list)
        .enumerate()
        .map(|(i, entry)| {
            mailbox(entry).map_err(|reason| MailError::InvalidAddress {
                field,
                reason: format!("entry {}: {reason}", i + 1),
            })
        })
        .collect()
}

/// Parses one bare address such as `a@example.com` (the sender, a
/// configured address), its domain made A-labels.
pub fn parse_address(s: &str) -> Result<Address, MailError> {
    parse_bare("address", s)
}

pub(super) fn parse_bare(field: &'static str, s: &str) -> Result<Address, MailError> {
    super::header::check_text(|| field.to_string(), s)?;
    let (local, domain) =
        addr_spec(s.trim()).map_err(|reason| MailError::InvalidAddress { field, reason })?;
    Ok(Address::new_dangerous(local, &*domain))
}

/// Whether `b` is ASCII atext (RFC 5322 §3.2.3).
pub(super) fn atext(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-/=?^_`{|}~".contains(&b)
}

/// One entry: `addr-spec` or `[display-name] <addr-spec>`.
fn mailbox(entry: &str) -> Result<Mailbox<'_>, String> {
    let bytes = entry.as_bytes();
    // The '<' that opens the address: the first one outside quotes.
    let (mut quoted, mut escaped) = (false, false);
    let mut open = None;
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b'<' if !quoted => {
                open = Some(i);
                break;
            }
            _ => {}
        }
    }
    let (name, spec) = match open {
        Some(open) => {
            let Some(inner) = entry[open + 1..].strip_suffix('>') else {
                return Err("text after the address's closing '>'".into());
            };
            (phrase(entry[..open].trim())?, inner.trim())
        }
        None => (None, entry),
    };
    if spec.contains(['<', '>']) && !spec.starts_with('"') {
        return Err("unbalanced angle brackets".into());
    }
    let (local, domain) = addr_spec(spec)?;
    Ok(Mailbox {
        name,
        local,
        domain,
    })
}

/// A display name: atoms (UTF-8 allowed, and dots as in `John Q. Public`) and
/// quoted strings, separated by whitespace, read as their text with single
/// spaces between words. Borrowed when it is already that text.
fn phrase(s: &str) -> Result<Option<Cow<'_, str>>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    let bytes = s.as_bytes();
    let plain = !bytes.contains(&b'"')
        && !s.contains("  ")
        && !s.contains('\t')
        && bytes
            .iter()
            .all(|&b| atext(b) || b == b'.' || b == b' ' || b >= 0x80);
    if plain {
        return Ok(Some(Cow::Borrowed(s)));
    }
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b' ' | b'\t' => i += 1,
            b'"' => {
                if !out.is_empty() {
                    out.push(' ');
                }
                i += 1;
                let mut closed = false;
                while i < bytes.len() {
                    match bytes[i] {
                        b'"' => {
                            closed = true;
                            i += 1;
                            break;
                        }
                        b'\\' if i + 1 < bytes.len() => {
                            i += 1;
                            let c = s[i..].chars().next().expect("in bounds");
                            out.push(c);
                            i += c.len_utf8();
                        }
                        _ => {
                            let c = s[i..].chars().next().expect("in bounds");
                            out.push(c);
                            i += c.len_utf8();
                        }
                    }
                }
                if !closed {
                    return Err("a quoted display name is not closed".into());
                }
            }
            _ => {
                let start = i;
                while i < bytes.len() && (atext(bytes[i]) || bytes[i] == b'.' || bytes[i] >= 0x80) {
                    i += 1;
                }
                if i == start {
                    return Err(format!(
                        "{:?} in a display name outside quotes",
                        bytes[i] as char
                    ));
                }
                if !out.is_empty() {
                    out.push(' ');
                }
                out.push_str(&s[start..i]);
            }
        }
    }
    let trimmed = out.trim();
    Ok((!trimmed.is_empty()).then(|| Cow::Owned(trimmed.to_string())))
}

/// `local@domain`: the local part as written (checked), the domain as
/// A-labels.
fn addr_spec(s: &str) -> Result<(&str, Cow<'_, str>), String> {
    let (local, domain) = if s.starts_with('"') {
        let end = quoted_end(s).ok_or("the quoted local part is not closed")?;
        let rest = &s[end..];
        let domain = rest
            .strip_prefix('@')
            .ok_or("no '@' after the quoted local part")?;
        (&s[..end], domain)
    } else {
        s.rsplit_once('@').ok_or("no '@'")?
    };
    if local.len() > MAX_LOCAL {
        return Err(format!("the local part is over {MAX_LOCAL} octets"));
    }
    if local.starts_with('"') {
        check_quoted_local(local)?;
    } else if local.is_empty()
        || local
            .split('.')
            .any(|atom| atom.is_empty() || !atom.bytes().all(|b| atext(b) || b >= 0x80))
    {
        return Err("the local part is not a dot-atom or a quoted string".into());
    }
    Ok((local, domain_a_labels(domain)?))
}

/// Where a quoted string that starts `s` ends (after its closing quote).
fn quoted_end(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// A quoted local part: printable ASCII, spaces, quoted pairs, UTF-8.
fn check_quoted_local(local: &str) -> Result<(), String> {
    let inner = &local.as_bytes()[1..local.len() - 1];
    if inner.is_empty() {
        return Err("an empty quoted local part".into());
    }
    let mut i = 0;
    while i < inner.len() {
        match inner[i] {
            b'\\' if i + 1 < inner.len() && (0x20..0x7f).contains(&inner[i + 1]) => i += 2,
            b'\\' | b'"' => return Err("a bad quoted local part".into()),
            0x20..=0x7e | 0x80.. => i += 1,
            _ => return Err("a control character in the local part".into()),
        }
    }
    Ok(())
}

/// A host name as A-labels: an ASCII one is checked (letters, digits and
/// hyphens, labels of 1 to 63), an internationalized one converted per
/// UTS #46 first.
fn domain_a_labels(domain: &str) -> Result<Cow<'_, str>, String> {
    let domain = if domain.is_ascii() {
        Cow::Borrowed(domain)
    } else {
        Cow::Owned(
            idna::domain_to_ascii_strict(domain)
                .map_err(|_| "the domain is not a valid internationalized host name")?,
        )
    };
    let valid = !domain.is_empty()
        && domain.len() <= MAX_DOMAIN
        && domain.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if !valid {
        return Err("the domain is not a valid host name".into());
    }
    Ok(domain)
}

/// A display name as a phrase: an atom or a quoted string when it is short
/// ASCII that no reader could take for an encoded-word, else encoded-words.
pub(super) fn write_phrase<O: Out>(field: &mut Field<'_, O>, name: &str) {
    let bytes = name.as_bytes();
    if bytes.len() <= PLAIN_NAME && bytes.iter().all(|&b| atext(b)) && !name.contains("=?") {
        field.word(b" ", &[bytes]);
    } else if bytes.len() <= PLAIN_NAME
        && bytes.iter().all(|&b| (0x20..0x7f).contains(&b))
        && !name.contains("=?")
    {
        let mut quoted = Vec::with_capacity(bytes.len() + 8);
        quoted.push(b'"');
        for &b in bytes {
            if b == b'"' || b == b'\\' {
                quoted.push(b'\\');
            }
            quoted.push(b);
        }
        quoted.push(b'"');
        field.word(b" ", &[&quoted]);
    } else {
        encoded_words(field, name);
    }
}

/// An address header (From, To, Cc, Reply-To): mailboxes separated by
/// commas, folded between words.
pub(super) fn write_list<O: Out>(out: &mut O, name: &str, list: &[Mailbox<'_>]) {
    let mut field = Field::new(out, name);
    for (i, mailbox) in list.iter().enumerate() {
        if i > 0 {
            field.glued(b",");
        }
        let (local, domain) = (mailbox.local.as_bytes(), mailbox.domain.as_bytes());
        match &mailbox.name {
            Some(name) => {
                write_phrase(&mut field, name);
                field.word(b" ", &[b"<", local, b"@", domain, b">"]);
            }
            None => field.word(b" ", &[local, b"@", domain]),
        }
    }
    field.end();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(entry: &str) -> Result<Mailbox<'_>, String> {
        mailbox(entry)
    }

    #[test]
    fn entries_split_outside_quotes_and_brackets() {
        let list = r#""Doe, Jane" <jane@example.com>, x@example.com,, <a,b@c> , "#;
        let got: Vec<&str> = entries(list).collect();
        assert_eq!(
            got,
            [
                r#""Doe, Jane" <jane@example.com>"#,
                "x@example.com",
                "<a,b@c>"
            ]
        );
        assert_eq!(entries("").count(), 0);
        assert_eq!(entries(" , ").count(), 0);
    }

    #[test]
    fn mailboxes_read_like_lettre_read_them() {
        let m = one("Ann <ann@example.org>").unwrap();
        assert_eq!(m.name.as_deref(), Some("Ann"));
        assert_eq!((m.local, &*m.domain), ("ann", "example.org"));
        let m = one(r#""Doe, Jane" <jane@example.com>"#).unwrap();
        assert_eq!(m.name.as_deref(), Some("Doe, Jane"));
        let m = one(r#"John Q. Public <jqp@example.com>"#).unwrap();
        assert_eq!(m.name.as_deref(), Some("John Q. Public"));
        let m = one(r#""a \"b\"" <x@example.com>"#).unwrap();
        assert_eq!(m.name.as_deref(), Some(r#"a "b""#));
        let m = one("Jürgen Müller <j@example.de>").unwrap();
        assert_eq!(m.name.as_deref(), Some("Jürgen Müller"));
        let m = one(r#""john doe"@example.com"#).unwrap();
        assert_eq!(m.local, r#""john doe""#);
        let m = one("<bob@example.net>").unwrap();
        assert_eq!(m.name, None);
        let m = one("o'brien@example.ie").unwrap();
        assert_eq!(m.local, "o'brien");
    }

    #[test]
    fn bad_entries_are_refused() {
        for bad in [
            "not an address",
            "@@",
            "a@",
            "@example.com",
            "a..b@example.com",
            ".a@example.com",
            "a@example..com",
            "a@-example.com",
            "a@example.com.",
            "a@exa_mple.com",
            "Ann <ann@example.org",
            "Ann <ann@example.org> x",
            "Ann (Sales) <ann@example.org>",
            "a@[127.0.0.1]",
            "\"unclosed@example.com",
            "a b@example.com",
        ] {
            assert!(one(bad).is_err(), "{bad}");
        }
        let long_local = format!("{}@example.com", "a".repeat(65));
        assert!(one(&long_local).is_err());
        let long_label = format!("a@{}.com", "b".repeat(64));
        assert!(one(&long_label).is_err());
    }

    #[test]
    fn idn_domains_become_a_labels_and_utf8_locals_need_smtputf8() {
        let m = one("Jörg <joerg@bücher.example>").unwrap();
        assert_eq!(m.domain, "xn--bcher-kva.example");
        assert!(!m.needs_smtputf8());
        assert_eq!(m.address().to_string(), "joerg@xn--bcher-kva.example");
        let m = one("jörg@example.com").unwrap();
        assert!(m.needs_smtputf8());
        let a = parse_address("info@例え.テスト").unwrap();
        assert_eq!(a.domain(), "xn--r8jz45g.xn--zckzah");
    }

    #[test]
    fn lists_are_written_with_names_as_phrases() {
        let list = parse_list(
            "to_address",
            Some(r#"Ann <ann@example.org>, bob@example.net, "The Shop" <s@example.com>, Müller & Söhne <m@bücher.example>"#),
        )
        .unwrap();
        let mut out = Vec::new();
        write_list(&mut out, "To", &list);
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with("To: Ann <ann@example.org>, bob@example.net,"),
            "{text}"
        );
        assert!(text.contains(r#""The Shop" <s@example.com>"#), "{text}");
        assert!(text.contains("<m@xn--bcher-kva.example>"), "{text}");
        assert!(text.split("\r\n").all(|l| l.len() <= 78), "{text}");
        let raw = format!("{text}\r\n");
        let parsed = mail_parser::MessageParser::default()
            .parse(raw.as_bytes())
            .unwrap();
        let to: Vec<_> = parsed.to().unwrap().iter().collect();
        assert_eq!(to.len(), 4);
        assert_eq!(to[3].name(), Some("Müller & Söhne"));
        assert_eq!(to[3].address(), Some("m@xn--bcher-kva.example"));
    }

    #[test]
    fn errors_name_the_entry_not_the_address() {
        let err = parse_list("cc", Some("a@example.com, secret.person@@x"))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("invalid address in cc: entry 2"), "{err}");
        assert!(!err.contains("secret.person"), "{err}");
    }
}
