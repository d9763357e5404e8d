//! A part's content on the wire: text with every line ending made CRLF and a
//! transfer encoding chosen once from one scan, or bytes in base64. The
//! encoded length (exact, or for quoted-printable a close upper bound) is
//! known from the scan before anything is written, so the message is
//! allocated once; the content is then written in one pass, straight into
//! the message (never a second copy of a body).
//!
//! Text goes 7bit as it is when it is ASCII without control characters and
//! every line fits 998 octets (the common case, and the fast one: a single
//! copy when its line endings are CRLF already); quoted-printable when it is
//! mostly ASCII; base64 otherwise. A lone CR, a lone LF and CRLF all become
//! CRLF, so no bare CR or LF reaches the relay; NUL and other control
//! characters never go out raw. Dot-stuffing is the SMTP client's business.

use super::header::LINE_LIMIT;

/// The Content-Transfer-Encoding of a part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Transfer {
    SevenBit,
    QuotedPrintable,
    Base64,
}

impl Transfer {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Transfer::SevenBit => "7bit",
            Transfer::QuotedPrintable => "quoted-printable",
            Transfer::Base64 => "base64",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// 7bit text whose line endings are all CRLF already: copied as it is.
    Verbatim,
    /// 7bit text with line endings to rewrite.
    SevenBit,
    QuotedPrintable,
    /// Text: line endings made CRLF, then base64.
    Base64Text,
    /// Bytes as they are, in base64.
    Base64,
}

/// One part's content with its encoding decided and its encoded length
/// known; written by [`Content::write`].
#[derive(Debug, Clone)]
pub(super) struct Content<'a> {
    bytes: &'a [u8],
    form: Form,
    len: usize,
}

impl<'a> Content<'a> {
    /// A text part (text/plain, text/html): scanned once.
    pub(super) fn text(text: &'a str) -> Content<'a> {
        let bytes = text.as_bytes();
        let scan = Scan::of(bytes);
        let seven_bit = scan.controls == 0
            && scan.non_ascii == 0
            && scan.longest_line <= LINE_LIMIT
            && !scan.boundary_like;
        let (form, len) = if seven_bit && scan.rewritten == 0 {
            (Form::Verbatim, bytes.len())
        } else if seven_bit {
            (Form::SevenBit, scan.normalized)
        } else if (scan.non_ascii + scan.controls) * 16 <= bytes.len() * 3 {
            // Mostly ASCII: quoted-printable stays readable and is shorter
            // than base64 while under about one octet in five is escaped.
            (
                Form::QuotedPrintable,
                scan.quoted_printable_bound(bytes.len()),
            )
        } else {
            (Form::Base64Text, base64_len(scan.normalized))
        };
        Content { bytes, form, len }
    }

    /// An attachment's bytes, as they are, in base64.
    pub(super) fn binary(bytes: &'a [u8]) -> Content<'a> {
        Content {
            bytes,
            form: Form::Base64,
            len: base64_len(bytes.len()),
        }
    }

    pub(super) fn transfer(&self) -> Transfer {
        match self.form {
            Form::Verbatim | Form::SevenBit => Transfer::SevenBit,
            Form::QuotedPrintable => Transfer::QuotedPrintable,
            Form::Base64Text | Form::Base64 => Transfer::Base64,
        }
    }

    /// The encoded length in octets: exact, or for quoted-printable (see
    /// [`Content::exact`]) an upper bound within a few percent.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Whether [`Content::len`] is the exact length.
    pub(super) fn exact(&self) -> bool {
        self.form != Form::QuotedPrintable
    }

    /// Appends the encoded content (without a final line break of its own
    /// beyond the text's) to `out`.
    pub(super) fn write(&self, out: &mut Vec<u8>) {
        let start = out.len();
        match self.form {
            Form::Verbatim => out.extend_from_slice(self.bytes),
            Form::SevenBit => {
                for (line, ended) in lines(self.bytes) {
                    out.extend_from_slice(line);
                    if ended {
                        out.extend_from_slice(b"\r\n");
                    }
                }
            }
            Form::QuotedPrintable => quoted_printable(self.bytes, out),
            Form::Base64Text => {
                let mut b64 = Base64Lines::new(out);
                for (line, ended) in lines(self.bytes) {
                    b64.feed(line);
                    if ended {
                        b64.feed(b"\r\n");
                    }
                }
                b64.finish();
            }
            Form::Base64 => {
                let mut b64 = Base64Lines::new(out);
                b64.feed(self.bytes);
                b64.finish();
            }
        }
        debug_assert!(
            out.len() - start == self.len || (!self.exact() && out.len() - start <= self.len),
            "{:?}: {} planned, {} written",
            self.form,
            self.len,
            out.len() - start
        );
    }
}

/// What one pass over a text finds.
#[derive(Debug, Default, PartialEq, Eq)]
struct Scan {
    /// The length with every line ending made CRLF.
    normalized: usize,
    /// Line endings.
    breaks: usize,
    /// Line endings that are not CRLF (a lone CR or LF).
    rewritten: usize,
    /// The longest line, in octets, line ending not counted.
    longest_line: usize,
    /// Octets over 127.
    non_ascii: usize,
    /// Control characters other than TAB, CR and LF.
    controls: usize,
    /// `=` signs (escaped in quoted-printable).
    equals: usize,
    /// A line starts with `--=_`, as every boundary of ours does: such text
    /// is encoded, so no part can ever hold one of our delimiter lines.
    boundary_like: bool,
}

impl Scan {
    fn of(bytes: &[u8]) -> Scan {
        let mut scan = Scan::starting(bytes);
        // Two passes, each at vector speed: the octets are counted by class
        // over the whole text (the counts do not depend on the lines), then
        // the line endings are found with memchr and only they are looked
        // at one by one.
        let classes = Classes::of(bytes);
        let mut line_start = 0;
        let mut ending_octets = 0;
        let mut crlf_lf = usize::MAX;
        for i in memchr::memchr2_iter(b'\r', b'\n', bytes) {
            ending_octets += 1;
            if i == crlf_lf {
                continue; // the LF of a CRLF, counted with its CR
            }
            scan.longest_line = scan.longest_line.max(i - line_start);
            scan.breaks += 1;
            if bytes[i] == b'\r' && bytes.get(i + 1) == Some(&b'\n') {
                crlf_lf = i + 1;
                line_start = i + 2;
            } else {
                scan.rewritten += 1;
                line_start = i + 1;
            }
            scan.boundary_like |= bytes[line_start..].starts_with(b"--=_");
        }
        scan.non_ascii = classes.non_ascii;
        scan.equals = classes.equals;
        // CR and LF are line endings, not control characters.
        scan.controls = classes.controls - ending_octets;
        scan.finish(bytes.len(), line_start)
    }

    /// Before the first octet of `bytes`.
    fn starting(bytes: &[u8]) -> Scan {
        Scan {
            boundary_like: bytes.starts_with(b"--=_"),
            ..Scan::default()
        }
    }

    /// After the last of `n` octets, the last line starting at `line_start`.
    fn finish(mut self, n: usize, line_start: usize) -> Scan {
        self.longest_line = self.longest_line.max(n - line_start);
        self.normalized = n + self.rewritten;
        self
    }

    /// At least the length of [`quoted_printable`]'s output for a text of
    /// `n` octets: every escaped octet (over 127, a control, `=`, and at
    /// most one whitespace at the end of each line) takes 3 characters, and
    /// a soft line break (3) comes after at least 73 characters of a line.
    fn quoted_printable_bound(&self, n: usize) -> usize {
        let escaped = self.non_ascii + self.controls + self.equals + self.breaks + 1;
        let chars = n + 2 * escaped;
        self.normalized + 2 * escaped + 3 * (chars / 73 + 1)
    }
}

fn printable(b: u8) -> bool {
    b.wrapping_sub(0x20) < 0x5f
}

/// The octets of a text counted by class.
struct Classes {
    /// Over 127.
    non_ascii: usize,
    /// `=`.
    equals: usize,
    /// Below 32 (CR and LF included) but TAB, and DEL.
    controls: usize,
}

impl Classes {
    fn of(bytes: &[u8]) -> Classes {
        const BLOCK: usize = 32;
        let mut c = Classes {
            non_ascii: 0,
            equals: 0,
            controls: 0,
        };
        // One counter per octet lane, in octets: blocks of a fixed size
        // compile to vector compares and adds. A lane counts at most 255
        // blocks before it is added up; the last few octets go as a block
        // of their own, filled up with a letter (which counts as nothing).
        for run in bytes.chunks(BLOCK * 255) {
            let mut lanes = [[0u8; BLOCK]; 3];
            let mut add = |block: &[u8; BLOCK]| {
                for k in 0..BLOCK {
                    let b = block[k];
                    lanes[0][k] += u8::from(b >= 0x80);
                    lanes[1][k] += u8::from(b == b'=');
                    lanes[2][k] += u8::from((b < 0x20 && b != b'\t') || b == 0x7f);
                }
            };
            let mut blocks = run.chunks_exact(BLOCK);
            for block in &mut blocks {
                add(block.try_into().expect("a whole block"));
            }
            let rest = blocks.remainder();
            if !rest.is_empty() {
                let mut last = [b'a'; BLOCK];
                last[..rest.len()].copy_from_slice(rest);
                add(&last);
            }
            let sum = |lanes: &[u8; BLOCK]| lanes.iter().map(|&n| usize::from(n)).sum::<usize>();
            c.non_ascii += sum(&lanes[0]);
            c.equals += sum(&lanes[1]);
            c.controls += sum(&lanes[2]);
        }
        c
    }
}

/// The 16 octets at `i`, if there are that many left: a fixed size, so that
/// the folds over it compile to a few vector instructions.
fn window(bytes: &[u8], i: usize) -> Option<&[u8; 16]> {
    bytes.get(i..i + 16)?.try_into().ok()
}

/// Whether the 16 octets at `i` are all printable ASCII but `=` (false when
/// fewer than 16 are left).
fn all_plain(bytes: &[u8], i: usize) -> bool {
    window(bytes, i).is_some_and(|w| {
        w.iter()
            .fold(true, |all, &b| all & printable(b) & (b != b'='))
    })
}

/// The lines of `bytes` and whether each ended with a line break (CRLF, a
/// lone CR or a lone LF); the last one did not.
fn lines(bytes: &[u8]) -> impl Iterator<Item = (&[u8], bool)> {
    let mut rest = Some(bytes);
    std::iter::from_fn(move || {
        let r = rest?;
        match memchr::memchr2(b'\r', b'\n', r) {
            Some(i) => {
                let crlf = r[i] == b'\r' && r.get(i + 1) == Some(&b'\n');
                rest = Some(&r[i + if crlf { 2 } else { 1 }..]);
                Some((&r[..i], true))
            }
            None => {
                rest = None;
                Some((r, false))
            }
        }
    })
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// Octets quoted-printable writes as they are: printable ASCII but `=`,
/// and whitespace (escaped instead at the end of a line).
const QP_LITERAL: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0x21;
    while b <= 0x7e {
        table[b] = b != b'=' as usize;
        b += 1;
    }
    table[b' ' as usize] = true;
    table[b'\t' as usize] = true;
    table
};

/// The widest a quoted-printable line gets before its soft break's `=`.
const QP_LINE: usize = 75;

/// Quoted-printable (RFC 2045 §6.7) of a text with its line endings made
/// CRLF: lines of at most 76 characters (soft breaks), `=` and everything
/// outside printable ASCII escaped, and whitespace at a line's end escaped
/// so that no relay can strip it. Runs of literal octets are copied whole.
/// `=` never precedes `_`, so no boundary of ours can appear in it.
fn quoted_printable(bytes: &[u8], out: &mut Vec<u8>) {
    for (line, ended) in lines(bytes) {
        let n = line.len();
        let mut col = 0;
        let mut i = 0;
        while i < n {
            let start = i;
            // Spaces and tabs are literal too: a run of 16 plain octets
            // needs no look at the table.
            while all_plain(line, i) {
                i += 16;
            }
            while i < n && QP_LITERAL[line[i] as usize] {
                i += 1;
            }
            if i == n && i > start && matches!(line[i - 1], b' ' | b'\t') {
                i -= 1;
            }
            let mut run = &line[start..i];
            while !run.is_empty() {
                if col == QP_LINE {
                    out.extend_from_slice(b"=\r\n");
                    col = 0;
                }
                let take = (QP_LINE - col).min(run.len());
                out.extend_from_slice(&run[..take]);
                col += take;
                run = &run[take..];
            }
            // The octet that ended the run, and those escaped right after
            // it (the rest of a character beyond ASCII), here together.
            while i < n {
                if col + 3 > QP_LINE {
                    out.extend_from_slice(b"=\r\n");
                    col = 0;
                }
                let b = line[i];
                out.extend_from_slice(&[b'=', HEX[(b >> 4) as usize], HEX[(b & 15) as usize]]);
                col += 3;
                i += 1;
                if i < n && QP_LITERAL[line[i] as usize] {
                    break;
                }
            }
        }
        if ended {
            out.extend_from_slice(b"\r\n");
        }
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
/// Characters per base64 line (RFC 2045 §6.8).
const B64_LINE: usize = 76;

/// The length of `n` octets in base64 with lines of 76 characters and CRLF
/// between them (none after the last).
pub(super) fn base64_len(n: usize) -> usize {
    let chars = n.div_ceil(3) * 4;
    if chars == 0 {
        0
    } else {
        chars + 2 * ((chars - 1) / B64_LINE)
    }
}

fn quad(b: [u8; 3]) -> [u8; 4] {
    [
        B64[(b[0] >> 2) as usize],
        B64[(((b[0] & 3) << 4) | (b[1] >> 4)) as usize],
        B64[(((b[1] & 15) << 2) | (b[2] >> 6)) as usize],
        B64[(b[2] & 63) as usize],
    ]
}

/// A base64 encoder fed in pieces, writing lines of 76 characters.
struct Base64Lines<'o> {
    out: &'o mut Vec<u8>,
    carry: [u8; 3],
    held: usize,
    /// Characters on the current line.
    col: usize,
}

impl<'o> Base64Lines<'o> {
    fn new(out: &'o mut Vec<u8>) -> Self {
        Base64Lines {
            out,
            carry: [0; 3],
            held: 0,
            col: 0,
        }
    }

    fn group(&mut self, g: [u8; 3]) {
        if self.col == B64_LINE {
            self.out.extend_from_slice(b"\r\n");
            self.col = 0;
        }
        self.out.extend_from_slice(&quad(g));
        self.col += 4;
    }

    fn feed(&mut self, mut data: &[u8]) {
        if self.held > 0 {
            let take = (3 - self.held).min(data.len());
            self.carry[self.held..self.held + take].copy_from_slice(&data[..take]);
            self.held += take;
            data = &data[take..];
            if self.held < 3 {
                return;
            }
            self.held = 0;
            self.group(self.carry);
        }
        // Whole lines (57 octets -> 76 characters) while on a line boundary.
        while data.len() >= 57 && (self.col == 0 || self.col == B64_LINE) {
            let mut line = [0u8; 78];
            let mut n = 0;
            if self.col == B64_LINE {
                line[..2].copy_from_slice(b"\r\n");
                n = 2;
            }
            for g in data[..57].chunks_exact(3) {
                line[n..n + 4].copy_from_slice(&quad([g[0], g[1], g[2]]));
                n += 4;
            }
            self.out.extend_from_slice(&line[..n]);
            self.col = B64_LINE;
            data = &data[57..];
        }
        let mut groups = data.chunks_exact(3);
        for g in &mut groups {
            self.group([g[0], g[1], g[2]]);
        }
        let rest = groups.remainder();
        self.carry[..rest.len()].copy_from_slice(rest);
        self.held = rest.len();
    }

    fn finish(mut self) {
        if self.held == 0 {
            return;
        }
        let mut g = [0u8; 3];
        g[..self.held].copy_from_slice(&self.carry[..self.held]);
        let held = self.held;
        self.group(g);
        let end = self.out.len();
        for pad in &mut self.out[end - (3 - held)..] {
            *pad = b'=';
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(content: &Content<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        content.write(&mut out);
        if content.exact() {
            assert_eq!(out.len(), content.len(), "planned length");
        } else {
            assert!(out.len() <= content.len(), "within the bound");
            if out.len() > 1000 {
                assert!(out.len() * 100 >= content.len() * 90, "a close bound");
            }
        }
        out
    }

    fn no_bare_cr_or_lf(bytes: &[u8]) {
        for (i, &b) in bytes.iter().enumerate() {
            match b {
                b'\r' => assert_eq!(bytes.get(i + 1), Some(&b'\n'), "bare CR at {i}"),
                b'\n' => assert!(i > 0 && bytes[i - 1] == b'\r', "bare LF at {i}"),
                _ => {}
            }
        }
    }

    fn decode_qp(bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'=' {
                if &bytes[i + 1..i + 3] == b"\r\n" {
                    i += 3;
                    continue;
                }
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        out
    }

    fn decode_b64(bytes: &[u8]) -> Vec<u8> {
        use base64::Engine as _;
        let clean: Vec<u8> = bytes
            .iter()
            .copied()
            .filter(|b| !b"\r\n".contains(b))
            .collect();
        base64::engine::general_purpose::STANDARD
            .decode(clean)
            .unwrap()
    }

    fn crlf(text: &str) -> String {
        text.replace("\r\n", "\n")
            .replace('\r', "\n")
            .replace('\n', "\r\n")
    }

    #[test]
    fn ascii_goes_7bit_and_crlf_text_is_copied() {
        let c = Content::text("Hello\r\nworld");
        assert_eq!((c.form, c.transfer()), (Form::Verbatim, Transfer::SevenBit));
        assert_eq!(encoded(&c), b"Hello\r\nworld");
        let c = Content::text("Hello\nworld\n");
        assert_eq!(c.form, Form::SevenBit);
        assert_eq!(encoded(&c), b"Hello\r\nworld\r\n");
        let line = "x".repeat(998);
        assert_eq!(Content::text(&line).form, Form::Verbatim);
        let c = Content::text("");
        assert_eq!((c.form, c.len()), (Form::Verbatim, 0));
    }

    #[test]
    fn lone_crs_become_line_breaks() {
        for text in ["a\r.\rb", "<p>a</p>\r.\r<p>b</p>", "\r", "\r\r\n\n\r"] {
            let c = Content::text(text);
            let out = encoded(&c);
            no_bare_cr_or_lf(&out);
            assert_eq!(out, crlf(text).as_bytes(), "{text:?}");
        }
    }

    #[test]
    fn long_lines_non_ascii_and_controls_go_quoted_printable() {
        let long = "y".repeat(1200);
        for text in [
            long.as_str(),
            "Vielen Dank für Ihre Bestellung.\nWir versenden sie in Kürze.\n",
            "a line with a NUL \0 and a bell \u{7} in it",
            "--=_looks like a boundary\n",
            "ok\n--=_x",
        ] {
            let c = Content::text(text);
            assert_eq!(c.transfer(), Transfer::QuotedPrintable, "{text:?}");
            let out = encoded(&c);
            no_bare_cr_or_lf(&out);
            assert!(
                out.split(|&b| b == b'\n').all(|l| l.len() <= 77),
                "{text:?}"
            );
            assert!(!out.windows(2).any(|w| w == b"=_"), "{text:?}");
            assert!(out
                .iter()
                .all(|&b| b == b'\r' || b == b'\n' || printable(b)));
            assert_eq!(decode_qp(&out), crlf(text).as_bytes(), "{text:?}");
        }
        let long = format!("{} \nb\t", "y".repeat(1000));
        assert!(encoded(&Content::text(&long)).ends_with(b"y=20\r\nb=09"));
    }

    #[test]
    fn mostly_non_ascii_text_goes_base64() {
        let text = "Привет, мир!\nЭто письмо.\r\n".repeat(30);
        let c = Content::text(&text);
        assert_eq!(c.transfer(), Transfer::Base64);
        let out = encoded(&c);
        assert!(out.split(|&b| b == b'\n').all(|l| l.len() <= 77));
        assert_eq!(decode_b64(&out), crlf(&text).as_bytes());
    }

    #[test]
    fn binary_round_trips_at_every_length() {
        let bytes: Vec<u8> = (0..400u32).map(|i| (i * 7919 % 256) as u8).collect();
        for n in [0, 1, 2, 3, 56, 57, 58, 114, 400] {
            let c = Content::binary(&bytes[..n]);
            let out = encoded(&c);
            for line in out.split(|&b| b == b'\n') {
                assert!(line.len() <= 77);
            }
            let lines: Vec<&[u8]> = out.split(|&b| b == b'\n').collect();
            for line in &lines[..lines.len().saturating_sub(1)] {
                assert_eq!(line.len(), 77, "76 characters and CR");
            }
            assert_eq!(decode_b64(&out), &bytes[..n], "{n}");
        }
    }

    #[test]
    fn the_800000_newline_body_is_one_pass() {
        let text = format!("{}{}", "x".repeat(80), "\n".repeat(800_000));
        let started = std::time::Instant::now();
        let c = Content::text(&text);
        let out = encoded(&c);
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        assert_eq!(out.len(), 80 + 1_600_000);
        no_bare_cr_or_lf(&out);
    }

    /// Counts the octet at `i` (a CRLF as one line ending); returns where
    /// the next one is.
    fn octet(scan: &mut Scan, bytes: &[u8], mut i: usize, line_start: &mut usize) -> usize {
        match bytes[i] {
            b'\r' | b'\n' => {
                scan.longest_line = scan.longest_line.max(i - *line_start);
                scan.breaks += 1;
                if bytes[i] == b'\r' && bytes.get(i + 1) == Some(&b'\n') {
                    i += 1;
                } else {
                    scan.rewritten += 1;
                }
                *line_start = i + 1;
                scan.boundary_like |= bytes[*line_start..].starts_with(b"--=_");
            }
            b'=' => scan.equals += 1,
            b'\t' | 0x20..=0x7e => {}
            0x80.. => scan.non_ascii += 1,
            _ => scan.controls += 1,
        }
        i + 1
    }

    /// Quoted-printable as the obvious loop over every octet, with the
    /// writer's rules: a soft break before a plain octet at column 75 and
    /// before an escape that would pass it, TAB plain but at a line's end,
    /// a space escaped at a line's end.
    fn qp_octet_by_octet(text: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for (line, ended) in lines(text) {
            let mut col = 0;
            for (i, &b) in line.iter().enumerate() {
                let last = i + 1 == line.len();
                let plain =
                    matches!(b, 0x21..=0x7e if b != b'=') || (!last && (b == b' ' || b == b'\t'));
                if plain {
                    if col == 75 {
                        out.extend_from_slice(b"=\r\n");
                        col = 0;
                    }
                    out.push(b);
                    col += 1;
                } else {
                    if col + 3 > 75 {
                        out.extend_from_slice(b"=\r\n");
                        col = 0;
                    }
                    out.extend_from_slice(format!("={b:02X}").as_bytes());
                    col += 3;
                }
            }
            if ended {
                out.extend_from_slice(b"\r\n");
            }
        }
        out
    }

    /// The scan as the obvious loop over every octet.
    fn octet_by_octet(bytes: &[u8]) -> Scan {
        let mut scan = Scan::starting(bytes);
        let (mut line_start, mut i) = (0, 0);
        while i < bytes.len() {
            i = octet(&mut scan, bytes, i, &mut line_start);
        }
        scan.finish(bytes.len(), line_start)
    }

    proptest::proptest! {
        /// Texts made of the pieces that steer the scan and the writer,
        /// at every alignment against their 16-octet strides.
        #[test]
        fn the_strided_scan_and_writer_agree_with_the_obvious_ones(
            pieces in proptest::collection::vec(
                proptest::sample::select(vec![
                    "a", "Wir versenden sie", "=", "\r\n", "\n", "\r", " ", "\t", "ü", "€",
                    "\u{1}", "--=_", "<td style=\"padding: 4px\">", "ü ", "  ", "\u{7f}",
                    "Sehr geehrte Frau Müller, vielen Dank", "„Schwarzwälder“",
                ]),
                0..160,
            )
        ) {
            let text = pieces.concat();
            proptest::prop_assert_eq!(Scan::of(text.as_bytes()), octet_by_octet(text.as_bytes()));
            let c = Content::text(&text);
            let out = encoded(&c);
            no_bare_cr_or_lf(&out);
            proptest::prop_assert!(out.is_ascii(), "8-bit octets written as they are");
            if c.transfer() == Transfer::QuotedPrintable {
                proptest::prop_assert_eq!(&out, &qp_octet_by_octet(text.as_bytes()));
            }
            // Encoded lines take 76 characters at most; 7bit text keeps its
            // own lines, up to the limit of SMTP (each with its CR).
            let widest = match c.transfer() {
                Transfer::SevenBit => LINE_LIMIT + 1,
                _ => 77,
            };
            proptest::prop_assert!(out.split(|&b| b == b'\n').all(|l| l.len() <= widest));
            let decoded = match c.transfer() {
                Transfer::SevenBit => out.clone(),
                Transfer::QuotedPrintable => decode_qp(&out),
                Transfer::Base64 => decode_b64(&out),
            };
            proptest::prop_assert_eq!(decoded, crlf(&text).into_bytes());
        }
    }

    #[test]
    fn quoted_printable_is_the_same_at_every_alignment() {
        // Each piece starts at every offset against the writer's 16-octet
        // windows and against the 75 columns of a line.
        for piece in ["Grüße =\t x\t", "ü ", "a\t", "Müller  \n", "=\u{1}\u{7f} "] {
            for k in 0..90 {
                let text = format!(
                    "{}{piece}{} and then a line of plain words after it all, 60.",
                    "x".repeat(k),
                    "é".repeat(k % 3 + 1)
                );
                let c = Content::text(&text);
                assert_eq!(c.transfer(), Transfer::QuotedPrintable, "{text:?}");
                let out = encoded(&c);
                assert_eq!(out, qp_octet_by_octet(text.as_bytes()), "{text:?}");
                assert_eq!(decode_qp(&out), crlf(&text).as_bytes(), "{text:?}");
            }
        }
    }

    #[test]
    fn a_long_ascii_line_goes_as_it_is() {
        let text = format!("{}\r\nshort\r\n", "Wir versenden sie ".repeat(50));
        let c = Content::text(&text);
        assert_eq!(c.transfer(), Transfer::SevenBit);
        assert_eq!(encoded(&c), text.as_bytes());
    }

    #[test]
    fn the_counts_hold_across_the_counters_refills() {
        // Longer than the 255 blocks of 32 octets a lane counts before it
        // is added up, with every class on both sides of the seam.
        let piece = "Bestellung=Nr.\u{1}\u{7f}\tüx\r\n--=_a\n\r";
        let text = piece.repeat(32 * 255 * 3 / piece.len() + 7);
        assert_eq!(Scan::of(text.as_bytes()), octet_by_octet(text.as_bytes()));
        for cut in [8159, 8160, 8161, 16320, 16321] {
            let part = &text.as_bytes()[..cut];
            assert_eq!(Scan::of(part), octet_by_octet(part), "first {cut} octets");
        }
    }

    #[test]
    fn the_scan_sees_what_decides() {
        let s = Scan::of(b"ab\r\ncd\nef\rg\xc3\xbc\x01");
        assert_eq!(
            s,
            Scan {
                normalized: 16,
                breaks: 3,
                rewritten: 2,
                longest_line: 4,
                non_ascii: 2,
                controls: 1,
                equals: 0,
                boundary_like: false,
            }
        );
        let long = format!("{}\n{}", "a".repeat(40), "b".repeat(999));
        assert_eq!(Scan::of(long.as_bytes()).longest_line, 999);
    }
}
