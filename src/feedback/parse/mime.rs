//! The MIME tree of a report, walked by us within fixed bounds: at most
//! [`MAX_DEPTH`] levels of multipart, [`MAX_PARTS`] parts, [`MAX_HEADERS`]
//! header fields kept per part, each boundary looked for in one pass over its
//! own body. The header grammars (Content-Type parameters, address lists,
//! encoded-words), the transfer encodings and the charsets are mail-parser's.
//!
//! Why not mail-parser's whole-message `parse`: for each multipart whose
//! boundary never comes it scans to the end of the input and then goes on
//! with the next part, so a message made of such parts costs the square of
//! its size (measured: 4x the time for 2x the size, seconds at 512 KiB);
//! and it re-parses base64-encoded `message/rfc822` parts, whose contents a
//! check of the raw input made beforehand could not see. Here every byte is
//! looked at a bounded number of times, once per level of nesting it sits
//! under.
//!
//! Embedded messages (`message/rfc822`, `message/global`) and header-only
//! parts (`text/rfc822-headers`) are leaves: their header sections are read
//! on demand with [`header_section`], their bodies never walked.

use std::borrow::Cow;

use mail_parser::{parsers::MessageStream, HeaderValue};

use super::text::{self, Fields, Line};

/// The deepest nesting of multiparts walked; parts below are ignored.
pub(super) const MAX_DEPTH: usize = 8;
/// The most parts (containers and leaves) kept from one message.
pub(super) const MAX_PARTS: usize = 128;
/// The most header fields kept from one header section; the rest are read
/// past.
const MAX_HEADERS: usize = 256;
/// The most fields of one name whose addresses are read.
const MAX_ADDRESS_FIELDS: usize = 4;
/// The most octets of an address field read (a long list is cut, and the
/// address cut in two dropped as junk).
const MAX_ADDRESS_FIELD: usize = 8 * 1024;
/// The longest boundary accepted (RFC 2046 allows 70); a part with a longer
/// one is read as text.
const MAX_BOUNDARY: usize = 200;

/// A part with no headers and no body, for when there is none.
pub(super) static EMPTY_PART: Part<'static> = Part {
    headers: Headers { fields: Vec::new() },
    content_type: ContentType {
        mime: String::new(),
        boundary: None,
        charset: None,
        report_type: None,
    },
    body: Cow::Borrowed(&[]),
};

/// A header section: each field's lower-cased name and unfolded raw value.
#[derive(Debug, Default)]
pub(super) struct Headers {
    fields: Vec<(String, String)>,
}

impl Headers {
    /// The first value of `name` (lower-case).
    pub(super) fn get(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of `name` (lower-case), in order.
    pub(super) fn all<'s>(&'s self, name: &'s str) -> impl Iterator<Item = &'s str> + 's {
        self.fields
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether any field is named `name` (lower-case).
    pub(super) fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// The addr-specs of an address-list field (`From`, `To`), through
    /// mail-parser's address grammar, normalised; junk dropped.
    pub(super) fn addresses(&self, name: &str) -> Vec<String> {
        let mut out = Vec::new();
        for value in self.all(name).take(MAX_ADDRESS_FIELDS) {
            let raw = with_newline(text::prefix(value, MAX_ADDRESS_FIELD));
            if let HeaderValue::Address(list) = MessageStream::new(&raw).parse_address() {
                out.extend(
                    list.iter()
                        .filter_map(|a| a.address())
                        .filter_map(text::addr_spec),
                );
            }
            if out.len() >= 64 {
                break;
            }
        }
        out
    }

    /// An unstructured field (`Subject`) with its encoded-words decoded.
    pub(super) fn decoded(&self, name: &str) -> Option<String> {
        let value = self.get(name)?;
        let raw = with_newline(value);
        match MessageStream::new(&raw).parse_unstructured() {
            HeaderValue::Text(t) => Some(t.into_owned()),
            _ => Some(value.to_owned()),
        }
    }
}

/// A field value as mail-parser's field parsers expect it: ending a line.
fn with_newline(value: &str) -> Vec<u8> {
    let mut raw = Vec::with_capacity(value.len() + 1);
    raw.extend_from_slice(value.as_bytes());
    raw.push(b'\n');
    raw
}

/// A Content-Type, lower-cased, with the parameters we use.
#[derive(Debug, Default, Clone)]
pub(super) struct ContentType {
    /// `type/subtype`, e.g. `message/delivery-status`.
    pub(super) mime: String,
    pub(super) boundary: Option<String>,
    pub(super) charset: Option<String>,
    /// `multipart/report`'s `report-type`, lower-cased.
    pub(super) report_type: Option<String>,
}

impl ContentType {
    fn parse(value: &str) -> ContentType {
        let raw = with_newline(value);
        let HeaderValue::ContentType(ct) = MessageStream::new(&raw).parse_content_type() else {
            return ContentType::default();
        };
        let mime = match ct.subtype() {
            Some(sub) => format!("{}/{}", ct.ctype(), sub),
            None => ct.ctype().to_owned(),
        }
        .to_ascii_lowercase();
        ContentType {
            mime,
            boundary: ct.attribute("boundary").map(str::to_owned),
            charset: ct.attribute("charset").map(str::to_owned),
            report_type: ct.attribute("report-type").map(str::to_ascii_lowercase),
        }
    }

    pub(super) fn is(&self, mime: &str) -> bool {
        self.mime == mime
    }

    pub(super) fn is_multipart(&self) -> bool {
        self.mime.starts_with("multipart/")
    }
}

/// One part of the tree, in document order.
#[derive(Debug)]
pub(super) struct Part<'a> {
    pub(super) headers: Headers,
    pub(super) content_type: ContentType,
    /// The body with its transfer encoding undone; empty for a multipart
    /// that was split into children.
    pub(super) body: Cow<'a, [u8]>,
}

impl Part<'_> {
    /// The body as text, through its charset (UTF-8 when none is named or
    /// the name is unknown).
    pub(super) fn text(&self) -> String {
        let decoder = self
            .content_type
            .charset
            .as_deref()
            .and_then(|c| mail_parser::decoders::charsets::map::charset_decoder(c.as_bytes()));
        match decoder {
            Some(decode) => decode(&self.body),
            None => String::from_utf8_lossy(&self.body).into_owned(),
        }
    }

    /// Whether this part is a leaf to read as plain text: `text/plain`, no
    /// type, or a multipart that could not be split (its boundary never
    /// comes, or it lies deeper than [`MAX_DEPTH`]).
    pub(super) fn is_plain_text(&self) -> bool {
        let mime = self.content_type.mime.as_str();
        mime.is_empty()
            || mime == "text/plain"
            || mime == "text"
            || (self.content_type.is_multipart() && !self.body.is_empty())
    }
}

/// Parses a header section from the start of `data`; returns it and the
/// offset of the body. A section that does not start with a field (a part
/// with no headers and no blank line) is empty, and the body is all of
/// `data`.
pub(super) fn header_section(data: &[u8]) -> (Headers, usize) {
    let mut headers = Headers::default();
    let mut fields = Fields::new(data);
    let mut first = true;
    while let Some(line) = fields.next() {
        match line {
            Line::Blank => return (headers, fields.offset()),
            Line::Field(name, value) => {
                if headers.fields.len() < MAX_HEADERS {
                    headers.fields.push((name, value));
                }
            }
            Line::Other if first => return (Headers::default(), 0),
            Line::Other => {}
        }
        first = false;
    }
    (headers, data.len())
}

/// The parts of the message `raw`, the message itself first.
pub(super) fn walk(raw: &[u8]) -> Vec<Part<'_>> {
    // A byte-order mark, and an mbox "From " line, before the header
    // section.
    let raw = raw.strip_prefix("\u{feff}".as_bytes()).unwrap_or(raw);
    let raw = if raw.starts_with(b"From ") {
        memchr::memchr(b'\n', raw)
            .and_then(|n| raw.get(n + 1..))
            .unwrap_or_default()
    } else {
        raw
    };
    let mut parts = Vec::new();
    walk_entity(raw, 0, &mut parts);
    parts
}

fn walk_entity<'a>(data: &'a [u8], depth: usize, parts: &mut Vec<Part<'a>>) {
    if parts.len() >= MAX_PARTS {
        return;
    }
    let (headers, body_at) = header_section(data);
    let body = data.get(body_at..).unwrap_or_default();
    let content_type = headers
        .get("content-type")
        .map(ContentType::parse)
        .unwrap_or_default();

    if content_type.is_multipart() && depth + 1 < MAX_DEPTH {
        if let Some(boundary) = content_type
            .boundary
            .as_deref()
            .filter(|b| !b.is_empty() && b.len() <= MAX_BOUNDARY)
        {
            let children = split_multipart(body, boundary.as_bytes());
            if !children.is_empty() {
                parts.push(Part {
                    headers,
                    content_type,
                    body: Cow::Borrowed(&[]),
                });
                for child in children {
                    walk_entity(child, depth + 1, parts);
                }
                return;
            }
        }
    }

    let body = decode_transfer(body, headers.get("content-transfer-encoding"));
    parts.push(Part {
        headers,
        content_type,
        body,
    });
}

/// `body` with its Content-Transfer-Encoding undone; as it is when the
/// encoding is an identity or the content is not valid in it.
fn decode_transfer<'a>(body: &'a [u8], encoding: Option<&str>) -> Cow<'a, [u8]> {
    let encoding = encoding.map(str::trim).unwrap_or_default();
    if encoding.eq_ignore_ascii_case("base64") {
        // Line breaks, and the junk some senders leave, are not base64.
        let alphabet: Vec<u8> = body
            .iter()
            .copied()
            .filter(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
            .collect();
        let alphabet = match memchr::memchr(b'=', &alphabet) {
            // Nothing after the padding: a second encoded object would
            // decode as garbage.
            Some(pad) => {
                let end = alphabet
                    .get(pad..)
                    .and_then(|tail| tail.iter().position(|b| *b != b'='))
                    .map_or(alphabet.len(), |n| pad + n);
                alphabet.get(..end).unwrap_or_default().to_vec()
            }
            None => alphabet,
        };
        if let Some(decoded) = mail_parser::decoders::base64::base64_decode(&alphabet) {
            return Cow::Owned(decoded);
        }
    } else if encoding.eq_ignore_ascii_case("quoted-printable") {
        if let Some(decoded) =
            mail_parser::decoders::quoted_printable::quoted_printable_decode(body)
        {
            return Cow::Owned(decoded);
        }
    }
    Cow::Borrowed(body)
}

/// The bodies of the parts of a multipart body, in one pass over its lines:
/// a delimiter line is `--boundary` followed by nothing but white space,
/// the close delimiter `--boundary--`. The line break before a delimiter
/// belongs to it. The preamble and the epilogue are dropped; a body with no
/// close delimiter ends its last part.
fn split_multipart<'a>(body: &'a [u8], boundary: &[u8]) -> Vec<&'a [u8]> {
    let mut children = Vec::new();
    let mut start: Option<usize> = None;
    let mut pos = 0;
    while pos < body.len() {
        let rest = body.get(pos..).unwrap_or_default();
        let (line_len, next) = match memchr::memchr(b'\n', rest) {
            Some(n) => (n, pos + n + 1),
            None => (rest.len(), body.len()),
        };
        let line = rest.get(..line_len).unwrap_or_default();
        if let Some(close) = delimiter(line, boundary) {
            if let Some(s) = start {
                // Drop the line break before the delimiter.
                let mut end = pos.saturating_sub(1);
                if end > s && body.get(end.saturating_sub(1)) == Some(&b'\r') {
                    end -= 1;
                }
                children.push(body.get(s..end.max(s)).unwrap_or_default());
                if children.len() >= MAX_PARTS {
                    return children;
                }
            }
            if close {
                return children;
            }
            start = Some(next);
        }
        pos = next;
    }
    if let Some(s) = start {
        children.push(body.get(s..).unwrap_or_default());
    }
    children
}

/// `Some(is_close)` when `line` is a delimiter of `boundary`.
fn delimiter(line: &[u8], boundary: &[u8]) -> Option<bool> {
    let rest = line.strip_prefix(b"--")?.strip_prefix(boundary)?;
    let (close, rest) = match rest.strip_prefix(b"--") {
        Some(r) => (true, r),
        None => (false, rest),
    };
    rest.iter()
        .all(|b| b.is_ascii_whitespace())
        .then_some(close)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_nested_parts() {
        let raw = b"Content-Type: multipart/mixed; boundary=\"a\"\r\n\r\npreamble\r\n--a\r\nContent-Type: text/plain\r\n\r\none\r\n--a\r\nContent-Type: multipart/alternative; boundary=ab\r\n\r\n--ab\r\n\r\ntwo\r\n--ab--\r\n--a\r\nContent-Transfer-Encoding: base64\r\n\r\ndGhy\r\nZWU=\r\n--a--\r\nepilogue";
        let parts = walk(raw);
        let summary: Vec<_> = parts
            .iter()
            .map(|p| {
                (
                    p.content_type.mime.as_str(),
                    String::from_utf8_lossy(&p.body).into_owned(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("multipart/mixed", String::new()),
                ("text/plain", "one".to_owned()),
                ("multipart/alternative", String::new()),
                ("", "two".to_owned()),
                ("", "three".to_owned()),
            ]
        );
    }

    #[test]
    fn similar_boundary_is_not_a_delimiter() {
        assert_eq!(delimiter(b"--abc", b"abc"), Some(false));
        assert_eq!(delimiter(b"--abc-- ", b"abc"), Some(true));
        assert_eq!(delimiter(b"--abcd", b"abc"), None);
    }

    #[test]
    fn depth_is_bounded() {
        let mut raw = Vec::new();
        for i in 0..50 {
            raw.extend_from_slice(
                format!("Content-Type: multipart/mixed; boundary=b{i}\n\n--b{i}\n").as_bytes(),
            );
        }
        raw.extend_from_slice(b"\nbottom\n");
        let parts = walk(&raw);
        // One container per level walked, the last level a leaf.
        assert_eq!(parts.len(), MAX_DEPTH);
        assert!(parts
            .iter()
            .take(MAX_DEPTH - 1)
            .all(|p| p.content_type.is_multipart()));
    }
}
