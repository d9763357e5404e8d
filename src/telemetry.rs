//! Logging: one flat JSON object per line on stdout (or pretty lines for
//! humans), filtered by `log.level` unless `RUST_LOG` is set.
//!
//! Mail bodies and passwords are never logged; recipients appear only as their
//! domain, and SMTP replies pass through [`redact_addresses`] first.

use tracing_subscriber::{fmt, EnvFilter};

use crate::config::{LogFormat, LogSettings};

/// Installs the global subscriber. Safe to call more than once (tests).
pub fn init(settings: &LogSettings) {
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
    let result = match settings.format {
        LogFormat::Json => fmt()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_env_filter(filter)
            .with_writer(std::io::stdout)
            .try_init(),
        LogFormat::Pretty => fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stdout)
            .try_init(),
    };
    let _ = result;
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
