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
/// carries them; the outcome's own fields are recorded on it when it is
/// written. At error level so that no `log.level` filters the span out while
/// keeping its lines.
pub(super) fn mail_span(mail: &QueuedMail) -> tracing::Span {
    tracing::error_span!(
        "mail",
        mail_id = mail.id,
        lock = %mail.lock,
        attempt = mail.attempts,
        outcome = tracing::field::Empty,
        smtp_code = tracing::field::Empty,
        elapsed_ms = tracing::field::Empty,
        domain = tracing::field::Empty,
    )
}

pub(super) fn log_outcome(d: &Done, written: bool) {
    let _in = d.span.enter();
    if !written {
        tracing::warn!("mail lock lost: outcome not written");
        return;
    }
    d.span.record("outcome", d.decision.logged.as_str());
    if let Some(code) = d.smtp_code {
        d.span.record("smtp_code", code);
    }
    if let Some(t) = d.send_time {
        d.span.record("elapsed_ms", t.as_millis() as u64);
    }
    if !d.domains.is_empty() {
        d.span.record("domain", d.domains.as_str());
    }
    let retry_in_ms = |delay: &Duration| delay.as_millis() as u64;
    match &d.decision.action {
        FinalAction::Sent => {
            let reply = d.reply.as_deref().map(redact_addresses);
            tracing::info!(relay = d.relay, reply, "mail sent")
        }
        FinalAction::Retry { delay, error, .. } => tracing::warn!(
            retry_in_ms = retry_in_ms(delay), error = %redact_addresses(error), "mail retry scheduled"
        ),
        FinalAction::Defer { delay, error, .. } => tracing::warn!(
            retry_in_ms = retry_in_ms(delay), error = %redact_addresses(error), "mail deferred"
        ),
        FinalAction::Failed { error, .. } => {
            tracing::warn!(error = %redact_addresses(error), "mail failed")
        }
        FinalAction::Unknown { error } => {
            tracing::warn!(error = %redact_addresses(error), "mail held as unknown")
        }
        FinalAction::Release => tracing::info!("mail released"),
    }
}
