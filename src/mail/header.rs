//! Header fields as they go on the wire: folding at whitespace so that lines
//! stay within 78 octets where they can and within 998 always (RFC 5322
//! §2.1.1), RFC 2047 encoded-words for text that cannot go as it is, the
//! check that keeps control characters out, and the `headers` column (a JSON
//! object) read with its limits.
//!
//! Nothing here can write a bare CR or LF: every value is checked for control
//! characters before it is planned, and the only line breaks written are the
//! CRLF of a fold (always followed by whitespace) and the one ending a field.
//!
//! Folding and encoding are one mechanism, read in one place.

use std::borrow::Cow;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};

use super::{body::Content, MailError};

/// The longest line RFC 5322 allows, CRLF not counted.
pub(super) const LINE_LIMIT: usize = 998;
/// Where lines are folded when they can be (RFC 5322 §2.1.1 "SHOULD").
const FOLD_AT: usize = 78;
/// A word of an unstructured value longer than this goes as encoded-words:
/// with the longest header name (76) it still fits a line of 998.
const RAW_WORD_LIMIT: usize = 900;
/// `=?utf-8?q?` and `?=`.
const ENCODED_WORD_OVERHEAD: usize = 12;
/// An encoded-word is at most 75 characters (RFC 2047 §2).
const ENCODED_WORD_PAYLOAD: usize = 75 - ENCODED_WORD_OVERHEAD;

/// Most extra headers one mail may set through the `headers` column.
pub const MAX_EXTRA_HEADERS: usize = 100;
/// The longest `headers` column (its JSON text), in octets.
pub const MAX_HEADERS_JSON: usize = 64 * 1024;
/// The longest header name: with ": " and a word it must fit a line.
const MAX_NAME: usize = 76;

/// Where a message goes: the bytes themselves, or a [`Count`] that sizes
/// its body first, so that the message is written once into a buffer
/// allocated once.
pub(super) trait Out {
    fn put(&mut self, bytes: &[u8]);
    /// A part's content, whose encoded length was known when it was planned.
    fn content(&mut self, content: &Content<'_>);
}

impl Out for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    fn content(&mut self, content: &Content<'_>) {
        content.write(self);
    }
}

/// Counts what would be written: exactly, or an upper bound when a part is
/// quoted-printable.
#[derive(Debug)]
pub(super) struct Count {
    pub(super) len: usize,
    pub(super) exact: bool,
}

impl Default for Count {
    fn default() -> Self {
        Count {
            len: 0,
            exact: true,
        }
    }
}

impl Out for Count {
    fn put(&mut self, bytes: &[u8]) {
        self.len += bytes.len();
    }

    fn content(&mut self, content: &Content<'_>) {
        self.len += content.len();
        self.exact &= content.exact();
    }
}

/// One header field being written: `Name:` then words, each folded onto a
/// new line (before its whitespace) when the line would pass 78 octets.
pub(super) struct Field<'o, O: Out> {
    out: &'o mut O,
    /// Octets on the current line.
    col: usize,
    /// Nothing written on the line yet after the name or a fold.
    fresh: bool,
}

impl<'o, O: Out> Field<'o, O> {
    pub(super) fn new(out: &'o mut O, name: &str) -> Self {
        out.put(name.as_bytes());
        out.put(b":");
        Field {
            out,
            col: name.len() + 1,
            fresh: true,
        }
    }

    /// A word (given in parts) after the whitespace `ws`, which must not be
    /// empty: the fold, when needed, goes before it.
    pub(super) fn word(&mut self, ws: &[u8], parts: &[&[u8]]) {
        debug_assert!(!ws.is_empty() && ws.iter().all(|&b| b == b' ' || b == b'\t'));
        let len = ws.len() + parts.iter().map(|p| p.len()).sum::<usize>();
        if !self.fresh && self.col + len > FOLD_AT {
            self.out.put(b"\r\n");
            self.col = 0;
        }
        self.out.put(ws);
        for part in parts {
            self.out.put(part);
        }
        self.col += len;
        self.fresh = false;
    }

    /// Text glued to the previous word (a comma, a semicolon): no fold point.
    pub(super) fn glued(&mut self, text: &[u8]) {
        self.out.put(text);
        self.col += text.len();
    }

    /// Room left on the current line before the preferred limit.
    fn room(&self) -> usize {
        FOLD_AT.saturating_sub(self.col)
    }

    pub(super) fn end(self) {
        self.out.put(b"\r\n");
    }
}

/// Refuses CR, LF and NUL (a header or command injection), and every other
/// control character but TAB (C0, DEL and C1), in a value that goes into a
/// header or the envelope.
pub(super) fn check_text(field: impl FnOnce() -> String, value: &str) -> Result<(), MailError> {
    let mut control = false;
    let mut previous = 0u8;
    for &b in value.as_bytes() {
        match b {
            b'\r' | b'\n' | 0 => return Err(MailError::LineBreak { field: field() }),
            b'\t' => {}
            0x01..=0x1f | 0x7f => control = true,
            // U+0080..U+009F are C2 80..C2 9F in UTF-8.
            0x80..=0x9f if previous == 0xc2 => control = true,
            _ => {}
        }
        previous = b;
    }
    if control {
        return Err(MailError::ControlCharacter { field: field() });
    }
    Ok(())
}

/// Whether `b` may stand for itself in a Q-encoded word wherever one may
/// appear (RFC 2047 §5 (3): the strictest of the three rules).
fn q_safe(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'!' | b'*' | b'+' | b'-' | b'/')
}

/// Whether Q encoding of `text` is no longer than B encoding.
fn prefer_q(text: &str) -> bool {
    let n = text.len();
    let escaped = text.bytes().filter(|&b| !q_safe(b) && b != b' ').count();
    n + 2 * escaped <= n.div_ceil(3) * 4
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";
const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// `text` as UTF-8 encoded-words (RFC 2047), each at most 75 characters and
/// whole characters only, separated by folding whitespace (which readers
/// drop between encoded-words, so all of the text's own spaces are inside).
pub(super) fn encoded_words<O: Out>(field: &mut Field<'_, O>, text: &str) {
    encoded_words_within(field, text, b"", b"");
}

/// [`encoded_words`] with `open` glued before the first word and `close`
/// after the last (`name="` and `"` for a parameter).
pub(super) fn encoded_words_within<O: Out>(
    field: &mut Field<'_, O>,
    text: &str,
    open: &[u8],
    close: &[u8],
) {
    let q = prefer_q(text);
    let mut rest = text;
    let mut first = true;
    while !rest.is_empty() {
        // Fill what is left of this line, or a whole new one.
        let extra = 1 + ENCODED_WORD_OVERHEAD + close.len() + if first { open.len() } else { 0 };
        let room = field.room().saturating_sub(extra);
        let budget = if room >= 16 {
            room.min(ENCODED_WORD_PAYLOAD)
        } else {
            ENCODED_WORD_PAYLOAD.min(FOLD_AT - 1 - extra)
        };
        let mut word = [0u8; 80];
        word[..10].copy_from_slice(if q { b"=?utf-8?q?" } else { b"=?utf-8?b?" });
        let mut len = 10;
        let mut taken = 0;
        if q {
            // A whole character at a time, read from its first octet: an
            // ASCII one takes one character or three, every octet of any
            // other takes three.
            let octets = rest.as_bytes();
            while let Some(&b) = octets.get(taken) {
                let (n, width) = match b {
                    0..=0x7f if q_safe(b) || b == b' ' => (1, 1),
                    0..=0x7f => (1, 3),
                    0xf0.. => (4, 12),
                    0xe0.. => (3, 9),
                    _ => (2, 6),
                };
                if len - 10 + width > budget && taken > 0 {
                    break;
                }
                for &b in &octets[taken..taken + n] {
                    if b == b' ' {
                        word[len] = b'_';
                        len += 1;
                    } else if width == 1 {
                        word[len] = b;
                        len += 1;
                    } else {
                        word[len..len + 3].copy_from_slice(&[
                            b'=',
                            HEX[(b >> 4) as usize],
                            HEX[(b & 15) as usize],
                        ]);
                        len += 3;
                    }
                }
                taken += n;
            }
        } else {
            for (i, c) in rest.char_indices() {
                let end = i + c.len_utf8();
                if end.div_ceil(3) * 4 > budget && taken > 0 {
                    break;
                }
                taken = end;
            }
            len += base64_into(&rest.as_bytes()[..taken], &mut word[10..]);
        }
        word[len..len + 2].copy_from_slice(b"?=");
        len += 2;
        rest = &rest[taken..];
        let before: &[u8] = if first { open } else { b"" };
        let after: &[u8] = if rest.is_empty() { close } else { b"" };
        field.word(b" ", &[before, &word[..len], after]);
        first = false;
    }
}

/// Plain base64 of a short input into `out`; returns the length written.
fn base64_into(input: &[u8], out: &mut [u8]) -> usize {
    let mut n = 0;
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let quad = [
            B64[(b[0] >> 2) as usize],
            B64[(((b[0] & 3) << 4) | (b[1] >> 4)) as usize],
            if chunk.len() > 1 {
                B64[(((b[1] & 15) << 2) | (b[2] >> 6)) as usize]
            } else {
                b'='
            },
            if chunk.len() > 2 {
                B64[(b[2] & 63) as usize]
            } else {
                b'='
            },
        ];
        out[n..n + 4].copy_from_slice(&quad);
        n += 4;
    }
    n
}

/// Splits `value` into (whitespace before, word) pairs; the first pair's
/// whitespace is empty when the value does not start with whitespace.
fn words(value: &str) -> impl Iterator<Item = (&str, &str)> {
    let bytes = value.as_bytes();
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= bytes.len() {
            return None;
        }
        let ws_start = at;
        while at < bytes.len() && matches!(bytes[at], b' ' | b'\t') {
            at += 1;
        }
        let word_start = at;
        while at < bytes.len() && !matches!(bytes[at], b' ' | b'\t') {
            at += 1;
        }
        Some((&value[ws_start..word_start], &value[word_start..at]))
    })
}

/// Whether an unstructured value can go as it is: printable ASCII words
/// between single runs of whitespace, nothing a reader could take for an
/// encoded-word, no whitespace at either end (a reader would drop it), and
/// no word too long to fold.
fn raw_unstructured(value: &str) -> bool {
    let bytes = value.as_bytes();
    !bytes.is_empty()
        && !matches!(bytes[0], b' ' | b'\t')
        && !matches!(bytes[bytes.len() - 1], b' ' | b'\t')
        && bytes
            .iter()
            .all(|&b| (0x20..0x7f).contains(&b) || b == b'\t')
        && !value.contains("=?")
        && words(value).all(|(ws, w)| ws.len() + w.len() <= RAW_WORD_LIMIT)
}

/// An unstructured field (Subject, an `X-` header): as it is when it can
/// be, folded at its whitespace; otherwise as encoded-words.
pub(super) fn unstructured<O: Out>(out: &mut O, name: &str, value: &str) {
    let mut field = Field::new(out, name);
    if raw_unstructured(value) {
        for (ws, word) in words(value) {
            let ws = if ws.is_empty() { " " } else { ws };
            field.word(ws.as_bytes(), &[word.as_bytes()]);
        }
    } else {
        // Nothing at all for an empty value.
        encoded_words(&mut field, value);
    }
    field.end();
}

/// A structured value (List-Unsubscribe, References, …) that the
/// application wrote: checked to be printable ASCII that folds at its
/// whitespace to lines of at most 998 octets, since it may not be encoded.
fn check_structured(name: &str, value: &str) -> Result<(), MailError> {
    let invalid = |reason: String| MailError::InvalidHeader {
        name: name.to_string(),
        reason,
    };
    if !value
        .bytes()
        .all(|b| (0x20..0x7f).contains(&b) || b == b'\t')
    {
        return Err(invalid(
            "a structured header is printable ASCII (it cannot be encoded)".into(),
        ));
    }
    let mut first = true;
    for (ws, word) in words(value.trim_matches([' ', '\t'])) {
        let line = if first {
            name.len() + 2 + word.len()
        } else {
            ws.len() + word.len()
        };
        if line > LINE_LIMIT {
            return Err(invalid(format!(
                "a word of {} octets cannot be folded into a line of at most {LINE_LIMIT}",
                word.len()
            )));
        }
        first = false;
    }
    Ok(())
}

/// A structured value checked by [`check_structured`], folded at its
/// whitespace.
fn structured<O: Out>(out: &mut O, name: &str, value: &str) {
    let mut field = Field::new(out, name);
    for (ws, word) in words(value.trim_matches([' ', '\t'])) {
        let ws = if ws.is_empty() { " " } else { ws };
        field.word(ws.as_bytes(), &[word.as_bytes()]);
    }
    field.end();
}

/// Headers that come from the row's columns, or that would change the
/// envelope, the trace or the signature; `headers` may not set them (nor any
/// `Resent-*`).
pub(super) const RESERVED_HEADERS: &[&str] = &[
    "from",
    "to",
    "cc",
    "bcc",
    "reply-to",
    "subject",
    "message-id",
    "date",
    "mime-version",
    "content-type",
    "content-transfer-encoding",
    "sender",
    "return-path",
    "received",
    "dkim-signature",
];

/// Headers whose syntax is not free text: never RFC 2047-encoded, so a value
/// that cannot go as it is gets refused. `List-*` (RFC 2369, 2919, 8058)
/// among them: List-Unsubscribe and List-Unsubscribe-Post are DKIM-signed
/// and must arrive as the application wrote them.
const STRUCTURED_HEADERS: &[&str] = &[
    "in-reply-to",
    "references",
    "auto-submitted",
    "archived-at",
    "content-language",
    "content-disposition",
    "content-id",
    "precedence",
    "feedback-id",
    "autocrypt",
];

fn is_structured(lower: &str) -> bool {
    lower.starts_with("list-") || STRUCTURED_HEADERS.contains(&lower)
}

/// One header of the `headers` column, validated.
#[derive(Debug)]
pub(super) struct ExtraHeader<'a> {
    name: Cow<'a, str>,
    value: Cow<'a, str>,
    structured: bool,
}

impl ExtraHeader<'_> {
    pub(super) fn write<O: Out>(&self, out: &mut O) {
        if self.structured {
            structured(out, &self.name, &self.value);
        } else {
            unstructured(out, &self.name, &self.value);
        }
    }
}

/// Validates a header name per RFC 5322 §2.2 and refuses the reserved ones.
fn check_name(name: &str) -> Result<String, MailError> {
    let invalid = |reason: &str| MailError::InvalidHeader {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(invalid("a name is 1 to 76 characters"));
    }
    if !name.bytes().all(|b| (33..=126).contains(&b) && b != b':') {
        return Err(invalid("a name is printable ASCII without ':' or spaces"));
    }
    let lower = name.to_ascii_lowercase();
    if RESERVED_HEADERS.contains(&lower.as_str()) || lower.starts_with("resent-") {
        return Err(invalid(
            "reserved: set by tablemail, or it would change the envelope or the trace",
        ));
    }
    Ok(lower)
}

/// Reads the `headers` column: a JSON object of string values, at most
/// [`MAX_EXTRA_HEADERS`] of them in at most [`MAX_HEADERS_JSON`] octets, in
/// the order given. A longer column is refused before it is parsed; a parse
/// stops at the first header over the count.
pub(super) fn extra_headers(json: Option<&str>) -> Result<Vec<ExtraHeader<'_>>, MailError> {
    let Some(json) = json else {
        return Ok(Vec::new());
    };
    if json.len() > MAX_HEADERS_JSON {
        return Err(MailError::HeadersTooLarge {
            size: json.len(),
            max: MAX_HEADERS_JSON,
        });
    }
    let mut failure = None;
    let mut de = serde_json::Deserializer::from_str(json);
    let parsed = HeaderMap {
        failure: &mut failure,
    }
    .deserialize(&mut de)
    .and_then(|map| de.end().map(|()| map));
    let pairs = match (parsed, failure) {
        (_, Some(failure)) => return Err(failure),
        (Err(e), None) => {
            return Err(MailError::InvalidHeader {
                name: "headers".into(),
                reason: format!("not a JSON object of strings: {e}"),
            })
        }
        (Ok(pairs), None) => pairs,
    };
    let mut headers: Vec<ExtraHeader<'_>> = Vec::with_capacity(pairs.len());
    let mut lowers: Vec<String> = Vec::with_capacity(pairs.len());
    for (name, value) in pairs {
        let lower = check_name(&name)?;
        // At most MAX_EXTRA_HEADERS names: a quadratic look is bounded.
        if lowers.contains(&lower) {
            return Err(MailError::InvalidHeader {
                name: name.into_owned(),
                reason: "given twice".into(),
            });
        }
        check_text(|| format!("header {name}"), &value)?;
        let structured = is_structured(&lower);
        if structured {
            check_structured(&name, &value)?;
        }
        lowers.push(lower);
        headers.push(ExtraHeader {
            name,
            value,
            structured,
        });
    }
    Ok(headers)
}

/// A JSON string, borrowed from the column when it has no escapes.
struct Text<'a>(Cow<'a, str>);

impl<'de> de::Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// A JSON value that is a string (borrowed when it has no escapes), or
/// `None` for any other value, which is skipped over.
struct MaybeText<'a>(Option<Cow<'a, str>>);

impl<'de> de::Deserialize<'de> for MaybeText<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MaybeText<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(MaybeText(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(MaybeText(Some(Cow::Owned(v.to_string()))))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(MaybeText(Some(Cow::Owned(v))))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(MaybeText(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(MaybeText(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(MaybeText(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(MaybeText(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(MaybeText(None))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(MaybeText(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map
                    .next_entry::<de::IgnoredAny, de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(MaybeText(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// The `headers` object as (name, value) pairs, stopping at the first one
/// over [`MAX_EXTRA_HEADERS`] or the first value that is not a string; why it
/// stopped goes to `failure`.
struct HeaderMap<'f> {
    failure: &'f mut Option<MailError>,
}

type Pairs<'a> = Vec<(Cow<'a, str>, Cow<'a, str>)>;

impl<'de> DeserializeSeed<'de> for HeaderMap<'_> {
    type Value = Pairs<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderMap<'_> {
    type Value = Pairs<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut pairs = Vec::new();
        while let Some(Text(name)) = map.next_key::<Text<'de>>()? {
            if pairs.len() == MAX_EXTRA_HEADERS {
                *self.failure = Some(MailError::TooManyHeaders {
                    max: MAX_EXTRA_HEADERS,
                });
                return Err(de::Error::custom("too many headers"));
            }
            let MaybeText(Some(value)) = map.next_value::<MaybeText<'de>>()? else {
                *self.failure = Some(MailError::InvalidHeader {
                    name: name.into_owned(),
                    reason: "the value is not a string".into(),
                });
                return Err(de::Error::custom("not a string"));
            };
            pairs.push((name, value));
        }
        Ok(pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(name: &str, write: impl FnOnce(&mut Field<'_, Vec<u8>>)) -> String {
        let mut out = Vec::new();
        let mut f = Field::new(&mut out, name);
        write(&mut f);
        f.end();
        String::from_utf8(out).unwrap()
    }

    fn lines_ok(text: &str) {
        for line in text.split("\r\n") {
            assert!(line.len() <= LINE_LIMIT, "{} octets", line.len());
            assert!(!line.contains(['\r', '\n']), "bare CR or LF: {line:?}");
        }
    }

    /// Unfolds and decodes a field the way a reader does, with mail-parser.
    fn decoded(header: &str) -> String {
        let message = format!("{header}\r\n");
        let parsed = mail_parser::MessageParser::default()
            .parse(message.as_bytes())
            .unwrap();
        parsed.subject().unwrap_or_default().to_string()
    }

    #[test]
    fn short_ascii_goes_as_it_is() {
        let mut out = Vec::new();
        unstructured(&mut out, "Subject", "Your order 42");
        assert_eq!(out, b"Subject: Your order 42\r\n");
    }

    #[test]
    fn long_text_folds_at_whitespace() {
        let value = "word ".repeat(100);
        let value = value.trim_end();
        let mut out = Vec::new();
        unstructured(&mut out, "Subject", value);
        let text = String::from_utf8(out).unwrap();
        assert!(text.lines().all(|l| l.len() <= 78), "{text}");
        assert_eq!(text.replace("\r\n ", " "), format!("Subject: {value}\r\n"));
    }

    #[test]
    fn a_1500_character_subject_fits_998_and_round_trips() {
        for value in [
            "x".repeat(1500),
            "ü".repeat(1500),
            format!("Bestellbestätigung {}", "y".repeat(1500)),
            " leading and trailing ".into(),
            "looks =?utf-8?q?encoded?= but is not".into(),
            "tab\tand  two spaces".into(),
        ] {
            let mut out = Vec::new();
            unstructured(&mut out, "Subject", &value);
            let text = String::from_utf8(out).unwrap();
            lines_ok(&text);
            assert!(
                text.split("\r\n").all(|l| l.len() <= 78),
                "folded to 78: {text}"
            );
            assert_eq!(decoded(text.trim_end()), value, "{text}");
        }
    }

    #[test]
    fn encoded_words_are_75_characters_and_whole_characters() {
        let value = "€😀a ".repeat(50);
        let mut out = Vec::new();
        unstructured(&mut out, "Subject", &value);
        let text = String::from_utf8(out).unwrap();
        for word in text.split_whitespace().skip(1) {
            assert!(word.len() <= 75, "{word}");
            assert!(
                word.starts_with("=?utf-8?") && word.ends_with("?="),
                "{word}"
            );
        }
        assert_eq!(decoded(text.trim_end()), value);
    }

    #[test]
    fn q_or_b_whichever_is_shorter() {
        assert!(prefer_q("Ihre Bestellung bei Müller"));
        assert!(!prefer_q("Grüße aus Köln"));
        assert!(!prefer_q("Привет, мир"));
    }

    #[test]
    fn folding_never_leaves_a_word_alone_after_the_name() {
        let text = field("X-Very-Long-Header-Name-That-Takes-Much-Of-The-Line", |f| {
            f.word(b" ", &[b"a-rather-long-first-word-of-forty-characters"]);
            f.word(b" ", &[b"second"]);
        });
        let first = text.split("\r\n").next().unwrap();
        assert!(first.ends_with("characters"), "{text}");
        assert!(text.contains("\r\n second"), "{text}");
    }

    #[test]
    fn controls_are_refused_with_the_field_named() {
        let f = || "subject".to_string();
        assert!(check_text(f, "ok\there").is_ok());
        assert!(check_text(f, "Grüße").is_ok());
        for bad in ["a\rb", "a\nb", "a\0b"] {
            assert_eq!(
                check_text(f, bad).unwrap_err().to_string(),
                "CR, LF or NUL in subject"
            );
        }
        for bad in ["a\u{1}b", "a\u{7f}b", "a\u{85}b", "a\u{9f}"] {
            assert_eq!(
                check_text(f, bad).unwrap_err().to_string(),
                "control character in subject"
            );
        }
    }

    #[test]
    fn extra_headers_keep_their_order_and_limits() {
        let h = extra_headers(Some(r#"{"X-B":"2","X-A":"1"}"#)).unwrap();
        let names: Vec<&str> = h.iter().map(|h| h.name.as_ref()).collect();
        assert_eq!(names, ["X-B", "X-A"]);

        for (json, expected) in [
            (
                r#"{"X-A":1}"#,
                "invalid header \"X-A\": the value is not a string",
            ),
            (r#"["a"]"#, "invalid header \"headers\": not a JSON object"),
            (
                r#"{"X-A":"1"} x"#,
                "invalid header \"headers\": not a JSON object",
            ),
            (
                r#"{"x-a":"1","X-A":"2"}"#,
                "invalid header \"X-A\": given twice",
            ),
            (
                r#"{"Sender":"a@b.c"}"#,
                "invalid header \"Sender\": reserved",
            ),
            (
                r#"{"Resent-To":"a@b.c"}"#,
                "invalid header \"Resent-To\": reserved",
            ),
            (r#"{"X-A":"a\u0001"}"#, "control character in header X-A"),
            (
                r#"{"List-Id":"Liste für <l.example>"}"#,
                "invalid header \"List-Id\": a structured header is printable ASCII",
            ),
        ] {
            let err = extra_headers(Some(json)).unwrap_err().to_string();
            assert!(err.starts_with(expected), "{json}: {err}");
        }
    }

    #[test]
    fn too_many_headers_are_refused_at_once() {
        let many = |n: usize| {
            let body: Vec<String> = (0..n).map(|i| format!("\"X-H{i}\":\"v\"")).collect();
            format!("{{{}}}", body.join(","))
        };
        assert_eq!(extra_headers(Some(&many(100))).unwrap().len(), 100);
        assert_eq!(
            extra_headers(Some(&many(101))).unwrap_err(),
            MailError::TooManyHeaders { max: 100 }
        );
        // Refused by its size, before any parsing (a parse would have
        // stopped at the count instead: TooManyHeaders).
        let err = extra_headers(Some(&many(100_000))).unwrap_err();
        assert!(matches!(err, MailError::HeadersTooLarge { .. }), "{err}");
    }

    #[test]
    fn a_long_unstructured_value_is_encoded_and_a_long_structured_one_refused() {
        let long = format!("https://example.com/{}", "u".repeat(1500));
        let json = serde_json::json!({ "X-Tracking": long }).to_string();
        let h = extra_headers(Some(&json)).unwrap();
        let mut out = Vec::new();
        h[0].write(&mut out);
        let text = String::from_utf8(out).unwrap();
        lines_ok(&text);
        let raw = format!("{text}\r\n");
        let parsed = mail_parser::MessageParser::default()
            .header_text("X-Tracking")
            .parse(raw.as_bytes())
            .unwrap();
        assert_eq!(
            parsed.header("X-Tracking").and_then(|v| v.as_text()),
            Some(long.as_str())
        );

        let json = serde_json::json!({ "List-Unsubscribe": format!("<{long}>") }).to_string();
        let err = extra_headers(Some(&json)).unwrap_err().to_string();
        assert!(err.contains("cannot be folded"), "{err}");
    }

    #[test]
    fn list_unsubscribe_passes_through() {
        let value = "<https://example.com/u/1?t=abc>, <mailto:u@example.com?subject=unsub>";
        let json = serde_json::json!({
            "List-Unsubscribe": value,
            "List-Unsubscribe-Post": "List-Unsubscribe=One-Click",
        })
        .to_string();
        let mut out = Vec::new();
        for h in extra_headers(Some(&json)).unwrap() {
            h.write(&mut out);
        }
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text.replace("\r\n ", " "),
            format!("List-Unsubscribe: {value}\r\nList-Unsubscribe-Post: List-Unsubscribe=One-Click\r\n")
        );
    }
}
