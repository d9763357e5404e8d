//! Logging: one flat JSON object per line on stdout (or pretty lines for
//! humans), filtered by `log.level` unless `RUST_LOG` is set. The fields of
//! the spans an event happens in (a mail's `mail_id`, `lock`, `attempt`) are
//! written beside the event's own, at the top level.
//!
//! Logging never waits for stdout: lines go to a writer thread through a
//! bounded queue, and when journald or a pipe stops reading, new lines are
//! dropped and counted ([`lines_dropped`]) instead of stalling the async
//! threads that renew locks and commit outcomes.
//!
//! Mail bodies and passwords are never logged; recipients appear only as their
//! domain, and SMTP replies pass through [`redact_addresses`] first.

use std::{
    fmt::Write as _,
    io::Write,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc::{sync_channel, SyncSender, TrySendError},
        Arc,
    },
};

use tracing::{
    field::{Field, Visit},
    span::{Attributes, Id, Record},
    Event, Subscriber,
};
use tracing_subscriber::{
    fmt::{self, MakeWriter},
    layer::{Context, SubscriberExt},
    registry::LookupSpan,
    util::SubscriberInitExt,
    EnvFilter, Layer,
};

use crate::config::{LogFormat, LogSettings};

/// Installs the global subscriber. Keep the returned guard until exit: its
/// drop writes out the lines still queued. Safe to call more than once.
pub fn init(settings: &LogSettings) -> LogGuard {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(&settings.level))
        .add_directive(
            "sqlx::postgres::notice=warn"
                .parse()
                .expect("valid directive"),
        );
    let (writer, guard) = LogWriter::start();
    // An error means a subscriber is installed already: keep it.
    match settings.format {
        LogFormat::Json => {
            let _ = tracing_subscriber::registry()
                .with(filter)
                .with(FlatJson::new(writer))
                .try_init();
        }
        LogFormat::Pretty => {
            let _ = fmt::fmt()
                .with_env_filter(filter)
                .with_writer(writer)
                .try_init();
        }
    }
    guard
}

/// The JSON output: one flat object per event, `timestamp`, `level`, the
/// fields of the spans it happens in (outermost first), the event's fields,
/// `target`. A span's fields are written as JSON once, when they are
/// recorded, and copied into each line inside it.
///
/// Its own layer rather than tracing-subscriber's `fmt` layer with a custom
/// format: a mail's span and its outcome line are on every mail's path, and
/// here they cost a few allocations and no formatting machinery (the `fmt`
/// layer's buffers grow from empty for every span, and every number went
/// through `core::fmt`: a sixth of the daemon's instructions per mail).
pub struct FlatJson {
    writer: LogWriter,
}

/// A span's fields, as `,"name":value` pieces.
struct SpanFields(String);

impl FlatJson {
    pub fn new(writer: LogWriter) -> FlatJson {
        FlatJson { writer }
    }
}

impl<S> Layer<S> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        // Room for a mail's span (id, lock, attempt) and more: no regrowth.
        let mut fields = String::with_capacity(128);
        attrs.record(&mut JsonFields { out: &mut fields });
        span.extensions_mut().insert(SpanFields(fields));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut extensions = span.extensions_mut();
        if let Some(SpanFields(fields)) = extensions.get_mut::<SpanFields>() {
            values.record(&mut JsonFields { out: fields });
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut line = String::with_capacity(384);
        line.push_str("{\"timestamp\":\"");
        let _ = write!(
            line,
            "{}",
            humantime::format_rfc3339_micros(std::time::SystemTime::now())
        );
        line.push_str("\",\"level\":\"");
        line.push_str(meta.level().as_str());
        line.push('"');
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(SpanFields(fields)) = span.extensions().get::<SpanFields>() {
                    line.push_str(fields);
                }
            }
        }
        event.record(&mut JsonFields { out: &mut line });
        line.push_str(",\"target\":");
        write_json_str(&mut line, meta.target());
        line.push_str("}\n");
        self.writer.send(line.into_bytes());
    }
}

/// The octets of a field name written without a look at escaping: ASCII
/// letters, digits, `_` and `.`.
const PLAIN_NAME: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || c == b'_' || c == b'.';
        b += 1;
    }
    table
};

/// Writes each field as `,"name":value`.
struct JsonFields<'a> {
    out: &'a mut String,
}

impl JsonFields<'_> {
    fn name(&mut self, field: &Field) {
        let name = field.name();
        // Field names are identifiers (`mail_id`, `error`): nothing to
        // escape, so no escaping pass over each (ten of them a mail).
        if name.bytes().all(|b| PLAIN_NAME[usize::from(b)]) {
            self.out.push_str(",\"");
            self.out.push_str(name);
            self.out.push_str("\":");
        } else {
            self.out.push(',');
            write_json_str(self.out, name);
            self.out.push(':');
        }
    }
}

impl Visit for JsonFields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.name(field);
        write_json_str(self.out, value);
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.name(field);
        self.out.push_str(itoa::Buffer::new().format(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.name(field);
        self.out.push_str(itoa::Buffer::new().format(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.name(field);
        self.out.push_str(if value { "true" } else { "false" });
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.name(field);
        if value.is_finite() {
            let _ = write!(self.out, "{value}");
        } else {
            write_json_str(self.out, &value.to_string());
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.record_debug(field, &format_args!("{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.name(field);
        // Escaped as it is written: no copy of the text first.
        self.out.push('"');
        let _ = write!(Escaping(self.out), "{value:?}");
        self.out.push('"');
    }
}

/// Writes what it is given escaped for the inside of a JSON string.
struct Escaping<'a>(&'a mut String);

impl std::fmt::Write for Escaping<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        escape_into(self.0, s);
        Ok(())
    }
}

/// A JSON string literal (RFC 8259 escaping).
fn write_json_str(out: &mut String, s: &str) {
    out.push('"');
    escape_into(out, s);
    out.push('"');
}

/// `s` escaped for the inside of a JSON string: `"`, `\\` and the control
/// characters; everything else (UTF-8 included) as it is, copied in runs.
fn escape_into(out: &mut String, s: &str) {
    let bytes = s.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        // Eight octets at a time while none of them needs escaping.
        if let Some(word) = bytes.get(i..i + 8) {
            if !needs_escape(u64::from_le_bytes(word.try_into().expect("8 octets"))) {
                i += 8;
                continue;
            }
        }
        let b = bytes[i];
        if b >= 0x20 && b != b'"' && b != b'\\' {
            i += 1;
            continue;
        }
        // Only ASCII octets stop the run: `i` is on a character boundary.
        out.push_str(&s[start..i]);
        match b {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            _ => {
                let _ = write!(out, "\\u{:04x}", b);
            }
        }
        i += 1;
        start = i;
    }
    out.push_str(&s[start..]);
}

/// Whether any of the eight octets of `word` is below 0x20, `"` or `\\`
/// (exact: no false alarm from a neighbouring octet, none missed).
fn needs_escape(word: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    // An octet's high bit set when it equals zero, with no carry between
    // octets (each octet's sum stays within it).
    let is_zero = |x: u64| !(((x & LOW7) + LOW7) | x) & HIGH;
    // Below 0x20: the octet is ASCII and adding 0x60 leaves bit 7 clear.
    let below_space = !((word & LOW7) + 0x60 * ONES) & !word & HIGH;
    (below_space | is_zero(word ^ (b'"' as u64 * ONES)) | is_zero(word ^ (b'\\' as u64 * ONES)))
        != 0
}

/// Lines dropped because stdout did not keep up, since the start.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// How many log lines were dropped because stdout stopped reading.
pub fn lines_dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Most bytes waiting for stdout; beyond this, new lines are dropped.
const MAX_QUEUED_BYTES: usize = 8 * 1024 * 1024;

/// Hands each log line to a thread that writes whatever has queued up with
/// one write: a line at a time when the daemon is quiet, a batch per system
/// call under load (one write per mail was a tenth of the daemon's CPU).
/// Queuing never blocks: a full queue drops the line and counts it.
#[derive(Clone)]
pub struct LogWriter {
    queue: SyncSender<Queued>,
    queued_bytes: Arc<AtomicUsize>,
}

enum Queued {
    Line(Vec<u8>),
    /// Everything queued before this is written; then the sender is told.
    Flush(SyncSender<()>),
}

/// Writes out the queued lines when dropped (at the end of `main`).
pub struct LogGuard {
    queue: SyncSender<Queued>,
}

impl LogWriter {
    fn start() -> (LogWriter, LogGuard) {
        let (tx, rx) = sync_channel::<Queued>(16_384);
        let queued_bytes = Arc::new(AtomicUsize::new(0));
        let pending = queued_bytes.clone();
        std::thread::Builder::new()
            .name("tablemail-log".into())
            .spawn(move || {
                let mut batch = Vec::with_capacity(64 * 1024);
                let mut flushed = Vec::new();
                let mut reported = 0;
                while let Ok(first) = rx.recv() {
                    let mut next = Some(first);
                    while let Some(item) = next.take() {
                        match item {
                            Queued::Line(line) => {
                                pending.fetch_sub(line.len(), Ordering::Relaxed);
                                batch.extend_from_slice(&line);
                            }
                            Queued::Flush(done) => flushed.push(done),
                        }
                        if batch.len() < 256 * 1024 {
                            next = rx.try_recv().ok();
                        }
                    }
                    let dropped = lines_dropped();
                    if dropped != reported {
                        // Said once stdout reads again, so the gap is visible.
                        let _ = writeln!(
                            batch,
                            "{{\"timestamp\":\"{}\",\"level\":\"WARN\",\"message\":\"log lines dropped: stdout did not keep up\",\"dropped\":{},\"target\":\"tablemail::telemetry\"}}",
                            humantime::format_rfc3339_micros(std::time::SystemTime::now()),
                            dropped - reported
                        );
                        reported = dropped;
                    }
                    let mut out = std::io::stdout();
                    let _ = out.write_all(&batch).and_then(|_| out.flush());
                    batch.clear();
                    for done in flushed.drain(..) {
                        let _ = done.send(());
                    }
                }
            })
            .expect("start the log thread");
        (
            LogWriter {
                queue: tx.clone(),
                queued_bytes,
            },
            LogGuard { queue: tx },
        )
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        let (done, written) = sync_channel(1);
        if self.queue.try_send(Queued::Flush(done)).is_ok() {
            let _ = written.recv_timeout(std::time::Duration::from_secs(2));
        }
    }
}

/// One event's bytes, queued as a unit when the event is written.
pub struct LineBuffer {
    buf: Vec<u8>,
    writer: LogWriter,
}

impl Write for LineBuffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineBuffer {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            self.writer.send(std::mem::take(&mut self.buf));
        }
    }
}

impl LogWriter {
    /// Queues one line, or drops and counts it when too much is waiting.
    fn send(&self, line: Vec<u8>) {
        let len = line.len();
        let queued = &self.queued_bytes;
        if queued.fetch_add(len, Ordering::Relaxed) + len > MAX_QUEUED_BYTES {
            queued.fetch_sub(len, Ordering::Relaxed);
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.queue.try_send(Queued::Line(line))
        {
            queued.fetch_sub(len, Ordering::Relaxed);
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LineBuffer;

    fn make_writer(&'a self) -> LineBuffer {
        LineBuffer {
            buf: Vec::with_capacity(384),
            writer: self.clone(),
        }
    }
}

/// Replaces the local part of every address in `text` with `***`, keeping the
/// domain: `<bob@example.com>` becomes `<***@example.com>`. Apostrophes are
/// part of a local part (`o'brien@…`), and a quoted local part
/// (`"john doe"@…`) is replaced whole. Linear in the text.
pub fn redact_addresses(text: &str) -> String {
    let is_local = |c: char| !(c.is_whitespace() || "<>()[]\",;:".contains(c));
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('@') {
        let before = &rest[..at];
        let local_start = if let Some(quoted) = before.strip_suffix('"') {
            quoted.rfind('"')
        } else {
            before
                .char_indices()
                .rev()
                .take_while(|(_, c)| is_local(*c))
                .last()
                .map(|(i, _)| i)
        };
        match local_start {
            Some(start) => {
                out.push_str(&before[..start]);
                out.push_str("***@");
            }
            None => {
                out.push_str(before);
                out.push('@');
            }
        }
        rest = &rest[at + 1..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::layer::SubscriberExt;

    use super::{redact_addresses, write_json_str, FlatJson, LogWriter, Queued};

    /// The lines a [`FlatJson`] layer writes while `f` runs, as written.
    fn raw_lines_of(f: impl FnOnce()) -> Vec<String> {
        let (queue, lines) = std::sync::mpsc::sync_channel(64);
        let writer = LogWriter {
            queue,
            queued_bytes: Default::default(),
        };
        let subscriber = tracing_subscriber::registry().with(FlatJson::new(writer));
        tracing::subscriber::with_default(subscriber, f);
        lines
            .try_iter()
            .map(|queued| match queued {
                Queued::Line(line) => String::from_utf8(line).expect("UTF-8"),
                Queued::Flush(_) => panic!("no flush asked for"),
            })
            .collect()
    }

    /// The same, parsed: each is one JSON object ending its line.
    fn lines_of(f: impl FnOnce()) -> Vec<serde_json::Value> {
        raw_lines_of(f)
            .iter()
            .map(|line| {
                assert_eq!(line.matches('\n').count(), 1, "one line, ended: {line}");
                assert!(line.ends_with("}\n"), "one line, ended: {line}");
                serde_json::from_str(line).expect("a JSON object per line")
            })
            .collect()
    }

    #[test]
    fn span_fields_sit_beside_the_event_fields() {
        let lines = lines_of(|| {
            let span = tracing::error_span!(
                "mail",
                mail_id = 7_i64,
                lock = "ab\"c",
                attempt = 2_i32,
                outcome = tracing::field::Empty
            );
            let _entered = span.enter();
            span.record("outcome", "sent");
            tracing::info!(
                smtp_code = 250_u16,
                ok = true,
                error = %"a\nb",
                "x-\"odd\" name" = 3_u64,
                "mail sent"
            );
        });
        assert_eq!(lines.len(), 1);
        let line = &lines[0];
        assert_eq!(line["mail_id"], 7);
        assert_eq!(line["lock"], "ab\"c");
        assert_eq!(line["attempt"], 2);
        assert_eq!(line["outcome"], "sent");
        assert_eq!(line["smtp_code"], 250);
        assert_eq!(line["ok"], true);
        assert_eq!(line["error"], "a\nb");
        assert_eq!(
            line["x-\"odd\" name"], 3,
            "a field name that is not an identifier"
        );
        assert_eq!(line["message"], "mail sent");
        assert_eq!(line["level"], "INFO");
        assert_eq!(line["target"], module_path!());
        assert!(line["timestamp"].as_str().unwrap().ends_with('Z'));
    }

    #[test]
    fn nested_spans_write_outermost_first_and_none_outside() {
        let lines = raw_lines_of(|| {
            let outer = tracing::error_span!("daemon", daemon = "d1");
            let inner = tracing::error_span!(parent: &outer, "mail", mail_id = -3_i64);
            inner.in_scope(|| tracing::warn!(n = 1_u64, "inside"));
            tracing::warn!("outside");
        });
        assert_eq!(lines.len(), 2);
        let inside = &lines[0];
        let at = |piece: &str| {
            inside
                .find(piece)
                .unwrap_or_else(|| panic!("{piece} in {inside}"))
        };
        assert!(at(r#""level":"WARN""#) < at(r#""daemon":"d1""#));
        assert!(at(r#""daemon":"d1""#) < at(r#""mail_id":-3"#));
        assert!(at(r#""mail_id":-3"#) < at(r#""n":1"#));
        assert!(at(r#""mail_id":-3"#) < at(r#""message":"inside""#));
        assert!(at(r#""n":1"#) < at(r#""target":"#));
        assert!(at(r#""message":"inside""#) < at(r#""target":"#));
        assert!(!lines[1].contains("mail_id"), "{}", lines[1]);
        assert!(lines[1].contains(r#""message":"outside""#), "{}", lines[1]);
    }

    #[test]
    fn the_word_test_finds_exactly_the_octets_to_escape() {
        for b in 0..=255u8 {
            let escape = b < 0x20 || b == b'"' || b == b'\\';
            for at in 0..8 {
                // Neighbours at the extremes of the octets that need no
                // escape do not change the answer.
                for fill in [b'a', b' ', 0xff] {
                    let mut word = [fill; 8];
                    word[at] = b;
                    assert_eq!(
                        super::needs_escape(u64::from_le_bytes(word)),
                        escape,
                        "{b:#x} at {at} among {fill:#x}"
                    );
                }
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn escaped_strings_read_back_as_they_were(text in "[ -~\\x00-\\x1f\"\\\\éü€\u{10348}]{0,64}") {
            let mut out = String::new();
            write_json_str(&mut out, &text);
            let parsed: String = serde_json::from_str(&out).unwrap();
            proptest::prop_assert_eq!(parsed, text);
        }
    }

    #[test]
    fn json_strings_are_escaped() {
        let mut out = String::new();
        write_json_str(&mut out, "a\"b\\c\nd\u{1}é");
        assert_eq!(out, r#""a\"b\\c\nd\u0001é""#);
        let parsed: String = serde_json::from_str(&out).unwrap();
        assert_eq!(parsed, "a\"b\\c\nd\u{1}é");
    }

    #[test]
    fn keeps_domains_only() {
        assert_eq!(
            redact_addresses("550 5.1.1 <bob.smith@example.com>: Recipient address rejected"),
            "550 5.1.1 <***@example.com>: Recipient address rejected"
        );
        assert_eq!(
            redact_addresses("to a@x.org, b@y.org"),
            "to ***@x.org, ***@y.org"
        );
        assert_eq!(redact_addresses("no address here"), "no address here");
        assert_eq!(redact_addresses("@lonely"), "@lonely");
        assert_eq!(
            redact_addresses("550 <o'brien@example.ie> unknown"),
            "550 <***@example.ie> unknown"
        );
        assert_eq!(
            redact_addresses(r#"550 <"john doe"@example.com>: no"#),
            "550 <***@example.com>: no"
        );
    }
}
