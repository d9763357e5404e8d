//! Logging: one flat JSON object per line on stdout (or pretty lines for
//! humans), filtered by `log.level` unless `RUST_LOG` is set.
//!
//! Mail bodies and passwords are never logged; recipients appear only as their
//! domain, and SMTP replies pass through [`redact_addresses`] first.

use std::{
    io::Write,
    sync::mpsc::{sync_channel, SyncSender},
};

use tracing_subscriber::{fmt, fmt::MakeWriter, EnvFilter};

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
        LogFormat::Json => fmt()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_env_filter(filter)
            .with_writer(writer)
            .try_init(),
        LogFormat::Pretty => fmt().with_env_filter(filter).with_writer(writer).try_init(),
    };
    let _ = result;
    guard
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
    use super::redact_addresses;

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
