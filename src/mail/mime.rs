//! The MIME structure of a message (RFC 2045, 2046, 2387) and its part
//! headers:
//!
//! - no attachments: text/plain, text/html, or multipart/alternative of both;
//! - attachments: multipart/mixed, the text/HTML first, then the parts in
//!   the order given;
//! - inline parts (a Content-ID) sit with the HTML in multipart/related:
//!   mixed -> alternative -> [text/plain, related -> [text/html, inline…]].
//!   With no attachment but inline ones, there is no mixed level. Without
//!   HTML nothing can reference an inline part: it goes as an ordinary
//!   attachment (its Content-ID kept), rather than failing the mail.
//!
//! Boundaries are `=_` followed by a letter for the level and 32 random hex
//! digits: quoted-printable and base64 output can never hold `=_`, and 7bit
//! text with a line starting `--=_` is sent quoted-printable instead
//! ([`super::body`]), so no content can collide with a boundary; the levels
//! differ in their third character, so none is a prefix of another.
//!
//! Attachment names: `name="…"` in Content-Type (RFC 2047 encoded-words when
//! not plain ASCII, for old readers) and `filename` in Content-Disposition
//! (RFC 2231 `filename*=utf-8''…`, with continuations `filename*0*=` … when
//! long, so that no line passes 998 octets).

use super::{
    body::{Content, Transfer},
    header::{check_text, encoded_words_within, Field, Out},
    Attachment, MailError,
};

/// The longest Content-Type an application may give an attachment.
const MAX_CONTENT_TYPE: usize = 255;
/// The longest filename, in octets.
const MAX_FILENAME: usize = 1024;
/// The longest Content-ID, in octets.
const MAX_CONTENT_ID: usize = 250;
/// A filename up to this length goes as a plain quoted `filename="…"`.
const PLAIN_FILENAME: usize = 60;

/// A boundary: `=_`, the level's letter, 32 hex digits.
type Boundary = [u8; 35];

/// One node of the structure.
#[derive(Debug)]
pub(super) enum Node<'a> {
    Text {
        html: bool,
        content: Content<'a>,
    },
    File {
        part: FilePart<'a>,
        inline: bool,
    },
    Multi {
        subtype: &'static str,
        boundary: Boundary,
        parts: Vec<Node<'a>>,
    },
}

/// An attachment, checked.
#[derive(Debug)]
pub(super) struct FilePart<'a> {
    filename: &'a str,
    content_type: ContentType<'a>,
    content_id: Option<&'a str>,
    content: Content<'a>,
}

/// Checks an attachment; `number` counts from 1, for the error.
pub(super) fn file_part<'a>(
    number: usize,
    attachment: &Attachment<'a>,
) -> Result<FilePart<'a>, MailError> {
    let invalid = |reason: String| MailError::Attachment { number, reason };
    let filename = attachment.filename;
    check_text(|| format!("attachment {number} filename"), filename)?;
    if filename.trim().is_empty() {
        return Err(invalid("an attachment needs a filename".into()));
    }
    if filename.len() > MAX_FILENAME {
        return Err(invalid(format!(
            "the filename is over {MAX_FILENAME} octets"
        )));
    }
    let content_type = ContentType::parse(attachment.content_type)
        .map_err(|reason| invalid(format!("content type: {reason}")))?;
    let content_id = attachment
        .content_id
        .map(|id| check_content_id(id).map_err(|reason| invalid(format!("content_id: {reason}"))))
        .transpose()?;
    Ok(FilePart {
        filename,
        content_type,
        content_id,
        content: Content::binary(attachment.content),
    })
}

/// A Content-ID as the row gives it (`logo` or `logo@shop.example`, with or
/// without its angle brackets): dot-atom text with at most one `@`.
fn check_content_id(id: &str) -> Result<&str, String> {
    let id = id
        .strip_prefix('<')
        .and_then(|i| i.strip_suffix('>'))
        .unwrap_or(id);
    if id.is_empty() || id.len() > MAX_CONTENT_ID {
        return Err(format!("1 to {MAX_CONTENT_ID} characters"));
    }
    let mut halves = id.split('@');
    let valid = id.matches('@').count() <= 1
        && halves.all(|half| {
            half.split('.')
                .all(|atom| !atom.is_empty() && atom.bytes().all(super::address::atext))
        });
    if !valid {
        return Err("letters, digits, dots and atext symbols, at most one '@'".into());
    }
    Ok(id)
}

/// A validated `type/subtype` with its parameters, as written back.
#[derive(Debug)]
pub(super) struct ContentType<'a> {
    /// Lowercase `type/subtype`.
    essence: String,
    /// `attribute=value` as given (value a token or a quoted string).
    params: Vec<&'a str>,
}

/// RFC 2045 §5.1 token characters.
fn token_char(b: u8) -> bool {
    (0x21..0x7f).contains(&b) && !b"()<>@,;:\\\"/[]?=".contains(&b)
}

fn token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(token_char)
}

impl<'a> ContentType<'a> {
    /// `type/subtype` (RFC 2045 tokens) and optional `; attribute=value`
    /// parameters (a token or a quoted string of printable ASCII). Not
    /// multipart/* nor message/*, which may not be base64-encoded (RFC 2046
    /// §5), and no `name` parameter: that one is written from the filename.
    fn parse(s: &'a str) -> Result<ContentType<'a>, String> {
        if s.len() > MAX_CONTENT_TYPE {
            return Err(format!("over {MAX_CONTENT_TYPE} characters"));
        }
        let mut rest = s.trim_matches([' ', '\t']);
        let end = rest.find(';').unwrap_or(rest.len());
        let essence = rest[..end].trim_end_matches([' ', '\t']);
        rest = &rest[end..];
        let Some((kind, subtype)) = essence.split_once('/') else {
            return Err(format!("{essence:?} is not type/subtype"));
        };
        if !token(kind) || !token(subtype) {
            return Err(format!("{essence:?} is not type/subtype"));
        }
        let essence = essence.to_ascii_lowercase();
        if essence.starts_with("multipart/") || essence.starts_with("message/") {
            return Err(format!(
                "{essence} cannot be an attachment's type (it may not be base64-encoded); \
                 application/octet-stream can"
            ));
        }
        let mut params = Vec::new();
        loop {
            rest = rest.trim_start_matches([' ', '\t']);
            let Some(after) = rest.strip_prefix(';') else {
                if rest.is_empty() {
                    break;
                }
                return Err(format!("unexpected {rest:?}"));
            };
            let after = after.trim_start_matches([' ', '\t']);
            if after.is_empty() {
                break;
            }
            let eq = after.find('=').ok_or("a parameter without '='")?;
            let attribute = &after[..eq];
            if !token(attribute) {
                return Err(format!("{attribute:?} is not a parameter name"));
            }
            let lower = attribute.to_ascii_lowercase();
            if lower == "name" || lower.starts_with("name*") {
                return Err("the name parameter is written from the filename".into());
            }
            let value = &after[eq + 1..];
            let len = if value.starts_with('"') {
                quoted_len(value).ok_or("a parameter's quoted value is not closed")?
            } else {
                value.bytes().take_while(|&b| token_char(b)).count()
            };
            if len == 0 {
                return Err(format!("the parameter {attribute} has no value"));
            }
            params.push(&after[..eq + 1 + len]);
            rest = &value[len..];
        }
        Ok(ContentType { essence, params })
    }
}

/// The length of the quoted string of printable ASCII that starts `s`.
fn quoted_len(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if bytes.get(i + 1).is_some_and(|b| (0x20..0x7f).contains(b)) => i += 2,
            b'"' => return Some(i + 1),
            b'\t' | 0x20..=0x7e => i += 1,
            _ => return None,
        }
    }
    None
}

/// The structure of a message, from its bodies and checked attachments.
pub(super) fn structure<'a>(
    body: Option<&'a str>,
    html: Option<&'a str>,
    files: Vec<FilePart<'a>>,
    random: u128,
) -> Node<'a> {
    let boundary = |level: u8| {
        let mut b = [0u8; 35];
        b[..3].copy_from_slice(&[b'=', b'_', level]);
        let hex = format!("{random:032x}");
        b[3..].copy_from_slice(hex.as_bytes());
        b
    };
    let has_html = html.is_some();
    let (inline, attached): (Vec<_>, Vec<_>) = files
        .into_iter()
        .partition(|f| f.content_id.is_some() && has_html);
    let html = html.map(|html| {
        let node = Node::Text {
            html: true,
            content: Content::text(html),
        };
        if inline.is_empty() {
            node
        } else {
            let mut parts = vec![node];
            parts.extend(
                inline
                    .into_iter()
                    .map(|part| Node::File { part, inline: true }),
            );
            Node::Multi {
                subtype: "related",
                boundary: boundary(b'r'),
                parts,
            }
        }
    });
    let text = || Node::Text {
        html: false,
        content: Content::text(body.unwrap_or("")),
    };
    let main = match (body, html) {
        (Some(_), Some(html)) => Node::Multi {
            subtype: "alternative",
            boundary: boundary(b'a'),
            parts: vec![text(), html],
        },
        (None, Some(html)) => html,
        (_, None) => text(),
    };
    if attached.is_empty() {
        return main;
    }
    let mut parts = vec![main];
    parts.extend(attached.into_iter().map(|part| Node::File {
        part,
        inline: false,
    }));
    Node::Multi {
        subtype: "mixed",
        boundary: boundary(b'm'),
        parts,
    }
}

impl Node<'_> {
    /// Content-Type, Content-Transfer-Encoding and, for a file,
    /// Content-Disposition and Content-ID.
    pub(super) fn write_headers<O: Out>(&self, out: &mut O) {
        match self {
            Node::Text { html, content } => {
                let mut field = Field::new(out, "Content-Type");
                let essence: &[u8] = if *html { b"text/html" } else { b"text/plain" };
                field.word(b" ", &[essence]);
                field.glued(b";");
                field.word(b" ", &[b"charset=utf-8"]);
                field.end();
                transfer_encoding(out, content.transfer());
            }
            Node::File { part, inline } => {
                let mut field = Field::new(out, "Content-Type");
                field.word(b" ", &[part.content_type.essence.as_bytes()]);
                for param in &part.content_type.params {
                    field.glued(b";");
                    field.word(b" ", &[param.as_bytes()]);
                }
                field.glued(b";");
                write_name(&mut field, part.filename);
                field.end();
                transfer_encoding(out, part.content.transfer());
                let mut field = Field::new(out, "Content-Disposition");
                field.word(
                    b" ",
                    &[if *inline {
                        b"inline" as &[u8]
                    } else {
                        b"attachment"
                    }],
                );
                write_filename(&mut field, part.filename);
                field.end();
                if let Some(id) = part.content_id {
                    let mut field = Field::new(out, "Content-ID");
                    field.word(b" ", &[b"<", id.as_bytes(), b">"]);
                    field.end();
                }
            }
            Node::Multi {
                subtype, boundary, ..
            } => {
                let mut field = Field::new(out, "Content-Type");
                field.word(b" ", &[b"multipart/", subtype.as_bytes()]);
                field.glued(b";");
                field.word(b" ", &[b"boundary=\"", boundary, b"\""]);
                field.end();
            }
        }
    }

    /// The content after the blank line: a leaf's encoded bytes, or the
    /// parts between delimiter lines (ending with the close delimiter, no
    /// line break after it).
    pub(super) fn write_body<O: Out>(&self, out: &mut O) {
        match self {
            Node::Text { content, .. } => out.content(content),
            Node::File { part, .. } => out.content(&part.content),
            Node::Multi {
                boundary, parts, ..
            } => {
                for part in parts {
                    out.put(b"--");
                    out.put(boundary);
                    out.put(b"\r\n");
                    part.write_headers(out);
                    out.put(b"\r\n");
                    part.write_body(out);
                    out.put(b"\r\n");
                }
                out.put(b"--");
                out.put(boundary);
                out.put(b"--");
            }
        }
    }
}

fn transfer_encoding<O: Out>(out: &mut O, transfer: Transfer) {
    let mut field = Field::new(out, "Content-Transfer-Encoding");
    field.word(b" ", &[transfer.as_str().as_bytes()]);
    field.end();
}

/// Whether a filename can go as a plain quoted string.
fn plain_filename(name: &str) -> bool {
    name.len() <= PLAIN_FILENAME
        && name.bytes().all(|b| (0x20..0x7f).contains(&b))
        && !name.contains("=?")
}

/// A quoted string of printable ASCII, `"` and `\` escaped.
fn quoted(name: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(name.len() + 4);
    q.push(b'"');
    for b in name.bytes() {
        if b == b'"' || b == b'\\' {
            q.push(b'\\');
        }
        q.push(b);
    }
    q.push(b'"');
    q
}

/// `name="…"` in Content-Type: the filename quoted, or as encoded-words
/// inside the quotes (what old readers understand).
fn write_name<O: Out>(field: &mut Field<'_, O>, name: &str) {
    if plain_filename(name) {
        field.word(b" ", &[b"name=", &quoted(name)]);
    } else {
        encoded_words_within(field, name, b"name=\"", b"\"");
    }
}

/// RFC 5987 attr-char: what RFC 2231 values may hold unescaped.
fn attr_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$&+-.^_`|~".contains(&b)
}

/// `filename="…"` in Content-Disposition, or the RFC 2231 form, split into
/// numbered continuations at character boundaries when long.
fn write_filename<O: Out>(field: &mut Field<'_, O>, name: &str) {
    field.glued(b";");
    if plain_filename(name) {
        field.word(b" ", &[b"filename=", &quoted(name)]);
        return;
    }
    let encoded_len: usize = name.bytes().map(|b| if attr_char(b) { 1 } else { 3 }).sum();
    // Each segment on a line of its own: " ", the segment, ";" in 78.
    let mut segment = Vec::with_capacity(80);
    let single = encoded_len <= 78 - 2 - "filename*=utf-8''".len();
    let mut number = 0usize;
    let mut rest = name;
    while !rest.is_empty() {
        segment.clear();
        if single {
            segment.extend_from_slice(b"filename*=utf-8''");
        } else {
            segment.extend_from_slice(format!("filename*{number}*=").as_bytes());
            if number == 0 {
                segment.extend_from_slice(b"utf-8''");
            }
        }
        let budget = 78 - 2 - segment.len();
        let start = segment.len();
        let mut taken = 0;
        for (i, c) in rest.char_indices() {
            let bytes = &rest.as_bytes()[i..i + c.len_utf8()];
            let width: usize = bytes
                .iter()
                .map(|&b| if attr_char(b) { 1 } else { 3 })
                .sum();
            if segment.len() - start + width > budget && taken > 0 {
                break;
            }
            for &b in bytes {
                if attr_char(b) {
                    segment.push(b);
                } else {
                    segment.extend_from_slice(&[
                        b'%',
                        b"0123456789ABCDEF"[(b >> 4) as usize],
                        b"0123456789ABCDEF"[(b & 15) as usize],
                    ]);
                }
            }
            taken = i + c.len_utf8();
        }
        rest = &rest[taken..];
        if number > 0 {
            field.glued(b";");
        }
        field.word(b" ", &[&segment]);
        number += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_types_are_tokens_with_well_formed_parameters() {
        for (given, essence, params) in [
            ("application/pdf", "application/pdf", vec![]),
            ("Image/PNG", "image/png", vec![]),
            (
                "text/calendar; method=REQUEST; charset=utf-8",
                "text/calendar",
                vec!["method=REQUEST", "charset=utf-8"],
            ),
            (
                r#"text/plain;format="flowed; really""#,
                "text/plain",
                vec![r#"format="flowed; really""#],
            ),
            (
                "application/vnd.ms-excel;",
                "application/vnd.ms-excel",
                vec![],
            ),
        ] {
            let ct = ContentType::parse(given).unwrap();
            assert_eq!(ct.essence, essence, "{given}");
            assert_eq!(ct.params, params, "{given}");
        }
        for bad in [
            "",
            "pdf",
            "application/",
            "/pdf",
            "application/pdf x",
            "application/p df",
            "text/plain; charset",
            "text/plain; charset=",
            "text/plain; a=\"unclosed",
            "text/plain; name=x.txt",
            "text/plain\r\nBcc: x@example.com",
            "text/plain; a=\"ü\"",
            "multipart/mixed",
            "message/rfc822",
        ] {
            assert!(ContentType::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn content_ids_are_checked() {
        assert_eq!(check_content_id("logo").unwrap(), "logo");
        assert_eq!(
            check_content_id("<logo@shop.example>").unwrap(),
            "logo@shop.example"
        );
        assert_eq!(check_content_id("logo.png").unwrap(), "logo.png");
        for bad in ["", "<>", "a b", "a@b@c", "a\"b", "a..b", "<a", "a>", "ü"] {
            assert!(check_content_id(bad).is_err(), "{bad:?}");
        }
    }

    fn disposition(name: &str) -> String {
        let mut out = Vec::new();
        let mut field = Field::new(&mut out, "Content-Disposition");
        field.word(b" ", &[b"attachment"]);
        write_filename(&mut field, name);
        field.end();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn filenames_are_quoted_or_rfc_2231() {
        assert_eq!(
            disposition("invoice 42.pdf"),
            "Content-Disposition: attachment; filename=\"invoice 42.pdf\"\r\n"
        );
        assert_eq!(
            disposition(r#"a "b" \c.txt"#),
            "Content-Disposition: attachment; filename=\"a \\\"b\\\" \\\\c.txt\"\r\n"
        );
        assert_eq!(
            disposition("Rechnung März.pdf"),
            "Content-Disposition: attachment; filename*=utf-8''Rechnung%20M%C3%A4rz.pdf\r\n"
        );
        let long = disposition(&"Ü".repeat(200));
        assert!(long.contains(" filename*0*=utf-8''%C3%9C"), "{long}");
        assert!(long.contains(" filename*1*=%C3%9C"), "{long}");
        assert!(long.split("\r\n").all(|l| l.len() <= 78), "{long}");
    }
}
