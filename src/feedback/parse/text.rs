//! Text primitives shared by every recogniser: addr-spec and Message-ID
//! normalisation, enhanced status and SMTP reply-code extraction, cleaning of
//! reason text, header-style field lines (folded, in groups), and ASCII
//! case-insensitive search. Each runs in one pass over its input with a
//! bounded look-ahead, and never slices a string except through `get`.

use std::borrow::Cow;

/// The longest diagnostic kept, in characters.
pub(super) const MAX_DIAGNOSTIC_CHARS: usize = 1000;
/// The longest addr-spec accepted, in octets (RFC 5321 path limit less the
/// angle brackets).
const MAX_ADDR: usize = 254;
/// The longest Message-ID accepted, in octets (a header line's limit).
const MAX_MESSAGE_ID: usize = 998;
/// The longest field value kept by [`Fields`]: the rest of a longer value is
/// read past, not stored.
pub(super) const MAX_FIELD_VALUE: usize = 16 * 1024;
/// The longest field name accepted by [`Fields`].
const MAX_FIELD_NAME: usize = 76;

/// `raw` as a lower-cased addr-spec, or `None` when it is not a plausible
/// one. Accepts what reports write around an address: an address-type prefix
/// (`rfc822;`, `utf-8;` with its `\x{..}` escapes), angle brackets (with a
/// display name before them), a trailing comment, and a trailing `:`, `,`,
/// `;` or `.`. Refuses anything with other than exactly
/// one `@` outside quotes, spaces or control characters, more than 254
/// octets, an empty local part, or a domain that is not dotted host name or a
/// domain literal.
pub(super) fn addr_spec(raw: &str) -> Option<String> {
    if raw.len() > 4 * MAX_ADDR {
        return None;
    }
    let mut s = raw.trim();
    let mut utf8_type = false;
    if let Some((kind, rest)) = s.split_once(';') {
        let kind = kind.trim();
        if !kind.is_empty()
            && kind.len() <= 16
            && kind.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            utf8_type = kind.eq_ignore_ascii_case("utf-8");
            s = rest.trim();
        }
    }
    let mut s = s.trim_end_matches([':', ',', ';', '.']);
    // A trailing comment: `a@b (Name)`.
    if s.ends_with(')') {
        if let Some(open) = s.rfind(" (") {
            s = s.get(..open)?.trim_end_matches([':', ',', ';', '.', ' ']);
        }
    }
    // `<a@b>`, and `Name <a@b>` where an addr-spec was due.
    let s = match s.strip_suffix('>') {
        Some(inner) => inner.get(inner.rfind('<')? + 1..)?,
        None => s,
    };
    let s: Cow<'_, str> = if utf8_type && s.contains("\\x{") {
        Cow::Owned(unescape_utf8_addr(s)?)
    } else {
        Cow::Borrowed(s)
    };
    if s.is_empty() || s.len() > MAX_ADDR {
        return None;
    }
    let at = split_at_sign(&s)?;
    let local = s.get(..at)?;
    let domain = s.get(at + 1..)?;
    if !plausible_local(local) || !plausible_domain(domain) {
        return None;
    }
    let lower = s.to_lowercase();
    (lower.len() <= MAX_ADDR).then_some(lower)
}

/// The byte index of the one `@` outside a quoted local part; `None` when
/// there are none or several, or a character no addr-spec holds.
fn split_at_sign(s: &str) -> Option<usize> {
    let mut in_quote = false;
    let mut escaped = false;
    let mut at = None;
    for (i, c) in s.char_indices() {
        if c.is_control() || c.is_whitespace() {
            return None;
        }
        if escaped {
            escaped = false;
            continue;
        }
        match c {
            '\\' if in_quote => escaped = true,
            '"' => in_quote = !in_quote,
            '@' if !in_quote => {
                if at.is_some() {
                    return None;
                }
                at = Some(i);
            }
            _ => {}
        }
    }
    if in_quote {
        return None;
    }
    at
}

fn plausible_local(local: &str) -> bool {
    if local.is_empty() {
        return false;
    }
    if local.len() >= 2 && local.starts_with('"') && local.ends_with('"') {
        return true;
    }
    !local.chars().any(|c| {
        matches!(
            c,
            '<' | '>' | '(' | ')' | '[' | ']' | ',' | ';' | ':' | '\\' | '"'
        )
    })
}

fn plausible_domain(domain: &str) -> bool {
    if let Some(literal) = domain.strip_prefix('[') {
        return literal.strip_suffix(']').is_some_and(|inner| {
            !inner.is_empty()
                && inner
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b':' | b'-'))
        });
    }
    if !domain.contains('.') || domain.len() > 253 {
        return false;
    }
    domain.split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && label
                .chars()
                .all(|c| c.is_alphanumeric() || c == '-' || c == '_')
    })
}

/// RFC 6533's `utf-8` address type writes non-ASCII characters, and some
/// ASCII ones, as `\x{HEX}`; undo that. `None` on a malformed escape.
fn unescape_utf8_addr(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find("\\x{") {
        out.push_str(rest.get(..pos)?);
        let after = rest.get(pos + 3..)?;
        let end = after.get(..after.len().min(9))?.find('}')?;
        let hex = after.get(..end)?;
        let code = u32::from_str_radix(hex, 16).ok()?;
        out.push(char::from_u32(code)?);
        rest = after.get(end + 1..)?;
    }
    out.push_str(rest);
    Some(out)
}

/// The first Message-ID in `raw`, as `<id@domain>`: the first `<…>` holding
/// no space, or else the first bare token with an `@` in it.
pub(super) fn message_id(raw: &str) -> Option<String> {
    let raw = prefix(raw, MAX_FIELD_VALUE);
    let bytes = raw.as_bytes();
    let mut from = 0;
    while let Some(open) = bytes.get(from..).and_then(|b| memchr::memchr(b'<', b)) {
        let start = from + open + 1;
        let Some(len) = bytes.get(start..).and_then(|b| memchr::memchr(b'>', b)) else {
            break;
        };
        let inner = raw.get(start..start + len)?;
        if let Some(id) = id_inner(inner) {
            return Some(id);
        }
        // `inner` held no `<`, so the next candidate starts after its `>`.
        from = start + len + 1;
        if inner.contains('<') {
            from = start + inner.rfind('<').unwrap_or(0);
        }
    }
    raw.split(|c: char| c.is_whitespace() || c == '<' || c == '>')
        .map(|t| t.trim_matches(|c: char| matches!(c, '(' | ')' | '"' | '\'' | ',' | ';')))
        .find(|t| t.contains('@'))
        .and_then(id_inner)
}

fn id_inner(inner: &str) -> Option<String> {
    if inner.is_empty()
        || inner.len() > MAX_MESSAGE_ID - 2
        || !inner.contains('@')
        || inner
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '<' || c == '>')
    {
        return None;
    }
    Some(format!("<{inner}>"))
}

/// A relay's queue id at the start of `s` (Postfix: `4F3A21C0123`; Exim:
/// `1abcDE-0001Xy-2Z`): letters, digits, `-`, `_` and inner `.`, at most 64.
pub(super) fn queue_id(s: &str) -> Option<String> {
    let id: String = s
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(65)
        .collect();
    let id = id.trim_end_matches('.');
    (!id.is_empty() && id.len() <= 64 && id.bytes().any(|b| b.is_ascii_digit()))
        .then(|| id.to_owned())
}

/// The first enhanced status code (RFC 3463, `class.subject.detail`, each of
/// subject and detail one to three digits) in `s` whose class is one of
/// `classes` (e.g. `b"45"`), not part of a longer dotted number such as an
/// IP address or a version.
pub(super) fn enhanced_status<'s>(s: &'s str, classes: &[u8]) -> Option<&'s str> {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let c = b.get(i).copied().unwrap_or(0);
        let prev = i
            .checked_sub(1)
            .and_then(|p| b.get(p))
            .copied()
            .unwrap_or(b' ');
        if classes.contains(&c) && !prev.is_ascii_digit() && prev != b'.' {
            if let Some(end) = status_end(b, i) {
                return s.get(i..end);
            }
        }
        i += 1;
    }
    None
}

/// The end of a status code starting with its class digit at `i`.
fn status_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    for _ in 0..2 {
        if b.get(j) != Some(&b'.') {
            return None;
        }
        j += 1;
        let start = j;
        while j < b.len() && j - start < 4 && b.get(j).is_some_and(u8::is_ascii_digit) {
            j += 1;
        }
        if j == start || j - start > 3 {
            return None;
        }
    }
    // Not the head of a longer dotted number ("5.1.1.2") or numeral.
    match (b.get(j), b.get(j + 1)) {
        (Some(d), _) if d.is_ascii_digit() => None,
        (Some(b'.'), Some(d)) if d.is_ascii_digit() => None,
        _ => Some(j),
    }
}

/// The first SMTP reply code (three digits, the second 0 to 5) in `s` whose
/// class is one of `classes`, standing as a word: before a space, a hyphen
/// (multi-line replies), a closing bracket or the end, and after the start,
/// a space, or one of `(#'";:[<`.
pub(super) fn reply_code<'s>(s: &'s str, classes: &[u8]) -> Option<&'s str> {
    let b = s.as_bytes();
    let mut i = 0;
    while i + 3 <= b.len() {
        let (c0, c1, c2) = (
            b.get(i).copied().unwrap_or(0),
            b.get(i + 1).copied().unwrap_or(0),
            b.get(i + 2).copied().unwrap_or(0),
        );
        let prev = i
            .checked_sub(1)
            .and_then(|p| b.get(p))
            .copied()
            .unwrap_or(b' ');
        let next = b.get(i + 3).copied().unwrap_or(b' ');
        if classes.contains(&c0)
            && (b'0'..=b'5').contains(&c1)
            && c2.is_ascii_digit()
            && (prev.is_ascii_whitespace() || b"(#'\";:[<=".contains(&prev))
            && (next.is_ascii_whitespace() || b"-),;:'\"]>".contains(&next))
        {
            return s.get(i..i + 3);
        }
        i += 1;
    }
    None
}

/// Reason text as kept in [`super::Item::diagnostic`]: line breaks unfolded,
/// control characters dropped, runs of white space made one space, trimmed,
/// and cut to [`MAX_DIAGNOSTIC_CHARS`] characters.
pub(super) fn clean(s: &str) -> String {
    let mut out = String::with_capacity(s.len().min(MAX_DIAGNOSTIC_CHARS * 4));
    let mut chars = 0;
    let mut pending_space = false;
    for c in s.chars() {
        if c.is_whitespace() || c.is_control() {
            // A control character inside a word (other than white space) is
            // dropped without splitting the word.
            pending_space |= c.is_whitespace();
            continue;
        }
        if pending_space && !out.is_empty() {
            if chars + 1 >= MAX_DIAGNOSTIC_CHARS {
                break;
            }
            out.push(' ');
            chars += 1;
        }
        pending_space = false;
        if chars >= MAX_DIAGNOSTIC_CHARS {
            break;
        }
        out.push(c);
        chars += 1;
    }
    out
}

/// A Diagnostic-Code value made readable: its type (`smtp;`, `X-Postfix;`)
/// dropped, cleaned, and the repeated `550-5.1.1` markers of a multi-line
/// SMTP reply dropped after the first.
pub(super) fn diagnostic_code(value: &str) -> Option<String> {
    let mut text = value.trim();
    if let Some((kind, rest)) = text.split_once(';') {
        let kind = kind.trim();
        if !kind.is_empty()
            && kind.len() <= 20
            && kind
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            text = rest;
        }
    }
    let cleaned = clean(text);
    let out = collapse_multiline_reply(&cleaned);
    (!out.is_empty()).then_some(out)
}

/// `550-5.1.1 first line 550-5.1.1 second 550 5.1.1 last` (a multi-line SMTP
/// reply unfolded) -> `550-5.1.1 first line second last`; `550-first
/// 550-second 550 last` -> `550-first second last`. Only when the text starts
/// with a continuation marker (`NNN-`); one pass over the words.
fn collapse_multiline_reply(s: &str) -> String {
    let mut words = s.split(' ').peekable();
    let Some(first) = words.next() else {
        return String::new();
    };
    let (code, enhanced) = match (first.get(..3), first.get(3..4), first.get(4..)) {
        (Some(code), Some("-"), Some(rest)) if code.bytes().all(|b| b.is_ascii_digit()) => {
            let is_status = !rest.is_empty() && enhanced_status(rest, b"245") == Some(rest);
            (code, if is_status { rest } else { "" })
        }
        _ => return s.to_owned(),
    };
    let mut out = String::with_capacity(s.len());
    out.push_str(first);
    while let Some(word) = words.next() {
        let after_code = word.strip_prefix(code);
        let mut word = word;
        if enhanced.is_empty() {
            match after_code {
                // "550" opening the last line of the reply.
                Some("") => continue,
                // "550-next": the marker glued to the line's first word.
                Some(rest) if rest.starts_with('-') => {
                    word = rest.get(1..).unwrap_or_default();
                    if word.is_empty() {
                        continue;
                    }
                }
                _ => {}
            }
        } else {
            match after_code {
                Some(rest) if rest.strip_prefix('-') == Some(enhanced) => continue,
                Some("" | "-") if words.peek() == Some(&enhanced) => {
                    words.next();
                    continue;
                }
                _ => {}
            }
        }
        out.push(' ');
        out.push_str(word);
    }
    out
}

/// The longest prefix of `s` of at most `max` octets that ends on a char
/// boundary.
pub(super) fn prefix(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or_default()
}

/// An ASCII-lower-cased copy of `s`: same length and same char boundaries as
/// `s`, so offsets found in it index `s` too.
pub(super) fn ascii_lower(s: &str) -> String {
    s.to_ascii_lowercase()
}

/// Where `needle` (already lower-case) first occurs in `hay_lower`.
pub(super) fn find(hay_lower: &str, needle: &str) -> Option<usize> {
    memchr::memmem::find(hay_lower.as_bytes(), needle.as_bytes())
}

/// Whether `hay_lower` contains any of `needles` (lower-case).
pub(super) fn contains_any(hay_lower: &str, needles: &[&str]) -> bool {
    // The length check spares building a searcher for a needle that cannot
    // fit (most reasons are short or empty).
    needles
        .iter()
        .any(|n| hay_lower.len() >= n.len() && find(hay_lower, n).is_some())
}

/// One logical line of a header section or of a report's field groups.
#[derive(Debug)]
pub(super) enum Line {
    /// An empty (or white-space only) line: the end of a header section or
    /// of a field group.
    Blank,
    /// `name: value`, the value unfolded (continuation lines joined by one
    /// space) and trimmed; the name lower-cased.
    Field(String, String),
    /// A line that is neither (no colon, a bad name, a continuation with no
    /// field before it).
    Other,
}

/// The logical lines of `data`, with the offset after each, in one pass:
/// every physical line is looked at once, by `memchr`.
pub(super) struct Fields<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Fields<'a> {
    pub(super) fn new(data: &'a [u8]) -> Self {
        Fields { data, pos: 0 }
    }

    /// The offset of the first byte not yet read.
    pub(super) fn offset(&self) -> usize {
        self.pos
    }

    /// The physical line at `pos` without its line break, and the offset
    /// after the break.
    fn line_at(&self, pos: usize) -> Option<(&'a [u8], usize)> {
        let rest = self.data.get(pos..)?;
        if rest.is_empty() {
            return None;
        }
        let (line, next) = match memchr::memchr(b'\n', rest) {
            Some(n) => (rest.get(..n)?, pos + n + 1),
            None => (rest, self.data.len()),
        };
        Some((line.strip_suffix(b"\r").unwrap_or(line), next))
    }
}

fn is_blank(line: &[u8]) -> bool {
    line.iter().all(|b| b.is_ascii_whitespace())
}

fn push_capped(value: &mut Vec<u8>, part: &[u8]) {
    let room = MAX_FIELD_VALUE.saturating_sub(value.len());
    value.extend_from_slice(part.get(..part.len().min(room)).unwrap_or_default());
}

impl Iterator for Fields<'_> {
    type Item = Line;

    fn next(&mut self) -> Option<Line> {
        let (line, next) = self.line_at(self.pos)?;
        self.pos = next;
        if is_blank(line) {
            return Some(Line::Blank);
        }
        if line.first().is_some_and(|b| *b == b' ' || *b == b'\t') {
            return Some(Line::Other);
        }
        let Some(colon) = memchr::memchr(b':', line) else {
            return Some(Line::Other);
        };
        let name = line.get(..colon).unwrap_or_default().trim_ascii();
        let valid_name = !name.is_empty()
            && name.len() <= MAX_FIELD_NAME
            && name.iter().all(|b| b.is_ascii_graphic());
        let mut value = Vec::new();
        push_capped(
            &mut value,
            line.get(colon + 1..).unwrap_or_default().trim_ascii(),
        );
        while let Some((cont, after)) = self.line_at(self.pos) {
            if !cont.first().is_some_and(|b| *b == b' ' || *b == b'\t') || is_blank(cont) {
                break;
            }
            self.pos = after;
            if valid_name && value.len() < MAX_FIELD_VALUE {
                if !value.is_empty() {
                    value.push(b' ');
                }
                push_capped(&mut value, cont.trim_ascii());
            }
        }
        if !valid_name {
            return Some(Line::Other);
        }
        let name = String::from_utf8_lossy(name).to_ascii_lowercase();
        let value = match String::from_utf8(value) {
            Ok(v) => v,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        };
        Some(Line::Field(name, value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addr_specs() {
        let cases: &[(&str, Option<&str>)] = &[
            ("rfc822; <Nobody@Example.ORG>", Some("nobody@example.org")),
            ("RFC822;nobody@example.org", Some("nobody@example.org")),
            ("<nobody@example.org>:", Some("nobody@example.org")),
            ("nobody@example.org.", Some("nobody@example.org")),
            ("\"a b\"@example.org", None),
            ("\"a.b\"@example.org", Some("\"a.b\"@example.org")),
            ("a@b@example.org", None),
            ("nobody@localhost", None),
            ("nobody @example.org", None),
            ("no\u{1}body@example.org", None),
            ("", None),
            ("@example.org", None),
            ("nobody@", None),
            ("nobody@[192.0.2.1]", Some("nobody@[192.0.2.1]")),
            ("utf-8; J\\x{F6}rg@example.org", Some("jörg@example.org")),
            ("utf-8; jörg@bücher.example", Some("jörg@bücher.example")),
            ("rfc822; <a@example..org>", None),
            ("x-unknown; <a@example.org", None),
            ("rfc822; a@example.org (Ann)", Some("a@example.org")),
            ("Ann Example <Ann@Example.org>", Some("ann@example.org")),
            ("<a@example.org> trailing", None),
            ("a>@example.org>", None),
        ];
        for (raw, want) in cases {
            assert_eq!(addr_spec(raw).as_deref(), *want, "{raw:?}");
        }
        let long = format!("{}@example.org", "a".repeat(250));
        assert_eq!(addr_spec(&long), None);
    }

    #[test]
    fn message_ids() {
        assert_eq!(
            message_id(" <abc.1@example.com> (comment)").as_deref(),
            Some("<abc.1@example.com>")
        );
        assert_eq!(
            message_id("<<<x y> <ok@example.com>").as_deref(),
            Some("<ok@example.com>")
        );
        assert_eq!(
            message_id("bare@example.com").as_deref(),
            Some("<bare@example.com>")
        );
        assert_eq!(message_id("<no-at-sign>"), None);
    }

    #[test]
    fn status_and_codes() {
        assert_eq!(
            enhanced_status("5.1.1 (bad mailbox)", b"245"),
            Some("5.1.1")
        );
        assert_eq!(enhanced_status("smtp; 550-5.1.10 x", b"45"), Some("5.1.10"));
        assert_eq!(enhanced_status("host 192.0.2.5.1 said", b"45"), None);
        assert_eq!(enhanced_status("Postfix 2.11.3", b"45"), None);
        assert_eq!(enhanced_status("(#5.1.1)", b"45"), Some("5.1.1"));
        assert_eq!(enhanced_status("end 4.2.2.", b"45"), Some("4.2.2"));
        assert_eq!(reply_code("said: 550 5.1.1 x", b"45"), Some("550"));
        assert_eq!(reply_code("returned '554-x'", b"45"), Some("554"));
        assert_eq!(reply_code("in 2550 bytes 1550", b"45"), None);
        assert_eq!(reply_code("error (554.30)", b"45"), None);
        assert_eq!(reply_code("590 x", b"45"), None);
    }

    #[test]
    fn cleaning() {
        assert_eq!(clean("  a\r\n\tb\u{7}c  \n d "), "a bc d");
        assert_eq!(
            clean(&"x".repeat(5000)).chars().count(),
            MAX_DIAGNOSTIC_CHARS
        );
        assert_eq!(
            diagnostic_code(
                "smtp; 550-5.1.1 The account does not\n 550-5.1.1 exist. Learn\n 550 5.1.1 more - gsmtp"
            )
            .as_deref(),
            Some("550-5.1.1 The account does not exist. Learn more - gsmtp")
        );
        assert_eq!(
            diagnostic_code("X-Postfix; host said: 550 no").as_deref(),
            Some("host said: 550 no")
        );
        assert_eq!(
            diagnostic_code("smtp;550-first\r\n 550-second\r\n 550 third").as_deref(),
            Some("550-first second third")
        );
    }

    #[test]
    fn field_lines() {
        let data = b"A: 1\r\n  continued\r\nbad line\r\n\r\nB : two\n\tthree\n";
        let lines: Vec<_> = Fields::new(data).collect();
        assert!(matches!(&lines[0], Line::Field(n, v) if n == "a" && v == "1 continued"));
        assert!(matches!(lines[1], Line::Other));
        assert!(matches!(lines[2], Line::Blank));
        assert!(matches!(&lines[3], Line::Field(n, v) if n == "b" && v == "two three"));
        assert_eq!(lines.len(), 4);
    }
}
