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
    io::Write,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc::{sync_channel, SyncSender, TrySendError},
        Arc,
    },
};

use tracing::{
    field::{Field, Visit},
    span::Record,
    Event, Subscriber,
};
use tracing_subscriber::{
    field::RecordFields,
    fmt::{self, format, FmtContext, FormatEvent, FormatFields, FormattedFields, MakeWriter},
    registry::LookupSpan,
    EnvFilter,
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
    let result = match settings.format {
        LogFormat::Json => fmt::fmt()
            .fmt_fields(JsonFieldsFormat)
            .event_format(FlatJson)
            .with_env_filter(filter)
            .with_writer(writer)
            .try_init(),
        LogFormat::Pretty => fmt::fmt()
            .with_env_filter(filter)
            .with_writer(writer)
            .try_init(),
    };
    let _ = result;
    guard
}

/// One flat JSON object per event: `timestamp`, `level`, the fields of the
/// spans it happens in (outermost first), the event's fields, `target`.
/// Written straight into the line buffer (a per-mail log line costs a few
/// hundred nanoseconds, not the microseconds of building a JSON map first).
pub struct FlatJson;

/// Formats a span's fields as `,"name":value` pieces, kept with the span and
/// copied into each event line inside it.
pub struct JsonFieldsFormat;

impl<'w> FormatFields<'w> for JsonFieldsFormat {
    fn format_fields<R: RecordFields>(
        &self,
        mut writer: format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = JsonFields {
            out: &mut writer,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }

    fn add_fields(
        &self,
        current: &'w mut FormattedFields<Self>,
        fields: &Record<'_>,
    ) -> std::fmt::Result {
        self.format_fields(current.as_writer(), fields)
    }
}

impl<S, N> FormatEvent<S, N> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: format::Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        write!(
            writer,
            "{{\"timestamp\":\"{}\",\"level\":\"{}\"",
            humantime::format_rfc3339_micros(std::time::SystemTime::now()),
            meta.level()
        )?;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                if let Some(fields) = span.extensions().get::<FormattedFields<N>>() {
                    writer.write_str(fields.as_str())?;
                }
            }
        }
        let mut fields = JsonFields {
            out: &mut writer,
            result: Ok(()),
        };
        event.record(&mut fields);
        fields.result?;
        writer.write_str(",\"target\":")?;
        write_json_str(&mut writer, meta.target())?;
        writer.write_str("}\n")
    }
}

/// Writes each field as `,"name":value`.
struct JsonFields<'a, 'w> {
    out: &'a mut format::Writer<'w>,
    result: std::fmt::Result,
}

impl JsonFields<'_, '_> {
    fn field(
        &mut self,
        field: &Field,
        value: impl FnOnce(&mut format::Writer<'_>) -> std::fmt::Result,
    ) {
        if self.result.is_ok() {
            self.result = (|| {
                self.out.write_char(',')?;
                write_json_str(self.out, field.name())?;
                self.out.write_char(':')?;
                value(self.out)
            })();
        }
    }
}

impl Visit for JsonFields<'_, '_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.field(field, |w| write_json_str(w, value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.field(field, |w| write!(w, "{value}"));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.field(field, |w| write!(w, "{value}"));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.field(field, |w| write!(w, "{value}"));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        if value.is_finite() {
            self.field(field, |w| write!(w, "{value}"));
        } else {
            self.field(field, |w| write_json_str(w, &value.to_string()));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.record_debug(field, &format_args!("{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let text = format!("{value:?}");
        self.field(field, |w| write_json_str(w, &text));
    }
}

/// A JSON string literal (RFC 8259 escaping).
fn write_json_str(w: &mut impl std::fmt::Write, s: &str) -> std::fmt::Result {
    w.write_char('"')?;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        let escape = match c {
            '"' => "\\\"",
            '\\' => "\\\\",
            '\n' => "\\n",
            '\r' => "\\r",
            '\t' => "\\t",
            c if (c as u32) < 0x20 => "",
            _ => continue,
        };
        w.write_str(&s[start..i])?;
        if escape.is_empty() {
            write!(w, "\\u{:04x}", c as u32)?;
        } else {
            w.write_str(escape)?;
        }
        start = i + c.len_utf8();
    }
    w.write_str(&s[start..])?;
    w.write_char('"')
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
        if self.buf.is_empty() {
            return;
        }
        let len = self.buf.len();
        let queued = &self.writer.queued_bytes;
        if queued.fetch_add(len, Ordering::Relaxed) + len > MAX_QUEUED_BYTES {
            queued.fetch_sub(len, Ordering::Relaxed);
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let line = Queued::Line(std::mem::take(&mut self.buf));
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.writer.queue.try_send(line)
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
    use std::sync::{Arc, Mutex};

    use super::{redact_addresses, write_json_str, FlatJson, JsonFieldsFormat};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn span_fields_sit_beside_the_event_fields() {
        let captured = Captured::default();
        let sink = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(JsonFieldsFormat)
            .event_format(FlatJson)
            .with_writer(move || sink.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::error_span!("mail", mail_id = 7_i64, lock = "ab\"c");
            let _entered = span.enter();
            tracing::info!(outcome = "sent", "mail sent");
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["mail_id"], 7);
        assert_eq!(line["lock"], "ab\"c");
        assert_eq!(line["outcome"], "sent");
        assert_eq!(line["message"], "mail sent");
        assert_eq!(line["level"], "INFO");
    }

    #[test]
    fn json_strings_are_escaped() {
        let mut out = String::new();
        write_json_str(&mut out, "a\"b\\c\nd\u{1}é").unwrap();
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
