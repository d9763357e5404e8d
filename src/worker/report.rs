//! What the pipeline tells the operator about each mail: the mail's span
//! (its unit of work), and one log line per outcome inside it.

use std::time::Duration;

use crate::{
    store::{FinalAction, QueuedMail},
    telemetry::redact_addresses,
};

use super::pipeline::Done;

pub(super) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// The span of one mail's unit of work, from its build to its outcome:
/// `mail_id`, `lock` and `attempt` are recorded once and every line inside
/// carries them. At error level so that no `log.level` filters the span out
/// while keeping its lines.
pub(super) fn mail_span(mail: &QueuedMail) -> tracing::Span {
    tracing::error_span!(
        "mail",
        mail_id = mail.id,
        lock = %mail.lock,
        attempt = mail.attempts,
    )
}

/// One outcome line at `$level`, inside the mail's span: the outcome's
/// fields (those the mail has), then the line's own.
macro_rules! outcome_line {
    ($level:ident, $d:expr, $($fields:tt)*) => {
        tracing::$level!(
            outcome = $d.decision.logged.as_str(),
            smtp_code = $d.smtp_code,
            elapsed_ms = $d.send_time.map(|t| t.as_millis() as u64),
            domain = (!$d.domains.is_empty()).then_some($d.domains.as_str()),
            $($fields)*
        )
    };
}

pub(super) fn log_outcome(d: &Done, written: bool) {
    let _in = d.span.enter();
    if !written {
        tracing::warn!("mail lock lost: outcome not written");
        return;
    }
    let retry_in_ms = |delay: &Duration| delay.as_millis() as u64;
    match &d.decision.action {
        FinalAction::Sent => {
            let reply = d.reply.as_deref().map(redact_addresses);
            outcome_line!(info, d, relay = d.relay, reply, "mail sent")
        }
        FinalAction::Retry { delay, error, .. } => outcome_line!(
            warn, d, retry_in_ms = retry_in_ms(delay), error = %redact_addresses(error), "mail retry scheduled"
        ),
        FinalAction::Defer { delay, error, .. } => outcome_line!(
            warn, d, retry_in_ms = retry_in_ms(delay), error = %redact_addresses(error), "mail deferred"
        ),
        FinalAction::Failed { error, .. } => {
            outcome_line!(warn, d, error = %redact_addresses(error), "mail failed")
        }
        FinalAction::Unknown { error } => {
            outcome_line!(warn, d, error = %redact_addresses(error), "mail held as unknown")
        }
        FinalAction::Release => outcome_line!(info, d, "mail released"),
        FinalAction::Suppressed { .. } => outcome_line!(info, d, "mail suppressed"),
    }
}
