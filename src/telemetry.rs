//! Logging: one flat JSON object per line on stdout (or pretty lines for
//! humans), filtered by `log.level` unless `RUST_LOG` is set.
//!
//! Mail bodies and passwords are never logged; recipients appear only as their
//! domain, and SMTP replies pass through [`redact_addresses`] first.

use std::{
    io::Write,
    sync::mpsc::{sync_channel, SyncSender},
};

use tracing::{
    field::{Field, Visit},
    Event, Subscriber,
};
use tracing_subscriber::{
    fmt::{self, format, FmtContext, FormatEvent, FormatFields, MakeWriter},
    registry::LookupSpan,
    EnvFilter,
};

use crate::config::{LogFormat, LogSettings};

/// Installs the global subscriber. Keep the returned guard until exit: its
/// drop writes out the lines still queued. Safe to call more than once.
pub fn init(settings: &LogSettings) -> LogGuard {
    // lettre prints AUTH exchanges at debug level: never let them through.
    let directives = format!("{},lettre=info", settings.level);
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(&directives))
        .add_directive("lettre=info".parse().expect("valid directive"))
        .add_directive(
            "sqlx::postgres::notice=warn"
                .parse()
                .expect("valid directive"),
        );
    let (writer, guard) = LogWriter::start();
    let result = match settings.format {
        LogFormat::Json => fmt::fmt()
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

/// One flat JSON object per event: `timestamp`, `level`, `message`, the
/// event's fields at the top level, `target`. Written straight into the line
/// buffer (a per-mail log line costs a few hundred nanoseconds, not the
/// microseconds of building a JSON map first).
pub struct FlatJson;

impl<S, N> FormatEvent<S, N> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
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

/// Hands each log line to a thread that writes whatever has queued up with
/// one write: a line at a time when the daemon is quiet, a batch per system
/// call under load (one write per mail was a tenth of the daemon's CPU).
#[derive(Clone)]
pub struct LogWriter {
    queue: SyncSender<Queued>,
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
        // Bounded: if stdout blocks, logging waits instead of eating memory.
        let (tx, rx) = sync_channel::<Queued>(16_384);
        std::thread::Builder::new()
            .name("tablemail-log".into())
            .spawn(move || {
                let mut batch = Vec::with_capacity(64 * 1024);
                let mut flushed = Vec::new();
                while let Ok(first) = rx.recv() {
                    let mut next = Some(first);
                    while let Some(item) = next.take() {
                        match item {
                            Queued::Line(line) => batch.extend_from_slice(&line),
                            Queued::Flush(done) => flushed.push(done),
                        }
                        if batch.len() < 256 * 1024 {
                            next = rx.try_recv().ok();
                        }
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
        (LogWriter { queue: tx.clone() }, LogGuard { queue: tx })
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        let (done, written) = sync_channel(1);
        if self.queue.send(Queued::Flush(done)).is_ok() {
            let _ = written.recv_timeout(std::time::Duration::from_secs(2));
        }
    }
}

/// One event's bytes, queued as a unit when the event is written.
pub struct LineBuffer {
    buf: Vec<u8>,
    queue: SyncSender<Queued>,
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
            let _ = self.queue.send(Queued::Line(std::mem::take(&mut self.buf)));
        }
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LineBuffer;

    fn make_writer(&'a self) -> LineBuffer {
        LineBuffer {
            buf: Vec::with_capacity(384),
            queue: self.queue.clone(),
        }
    }
}

/// Replaces the local part of every address in `text` with `***`, keeping the
/// domain: `<bob@example.com>` becomes `<***@example.com>`.
pub fn redact_addresses(text: &str) -> String {
    let is_local = |c: char| !(c.is_whitespace() || "<>()[]\",;:'".contains(c));
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('@') {
        let before = &rest[..at];
        let local_start = before
            .char_indices()
            .rev()
            .take_while(|(_, c)| is_local(*c))
            .last()
            .map(|(i, _)| i);
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
    use super::{redact_addresses, write_json_str};

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
    }
}
