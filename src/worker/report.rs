//! What the pipeline tells the operator about each mail: one log line per
//! outcome, inside the mail's span.

use std::time::Duration;

use crate::{store::FinalAction, telemetry::redact_addresses};

use super::pipeline::Done;

pub(super) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

pub(super) fn log_outcome(d: &Done, written: bool) {
    // The unit of work: its fields are recorded once, on the span, and every
    // line below carries them. At error level so that no `log.level` filters
    // the span out while keeping its lines.
    let span = tracing::error_span!(
        "mail",
        mail_id = d.id,
        lock = %d.lock,
        attempt = d.attempt
    );
    let _entered = span.enter();
    if !written {
        tracing::warn!("mail lock lost: outcome not written");
        return;
    }
    let outcome = d.decision.logged.as_str();
    let smtp_code = d.smtp_code;
    let elapsed_ms = d.send_time.map(|t| t.as_millis() as u64);
    let domain = d.domains.as_str();
    let retry_in_ms = |delay: &Duration| delay.as_millis() as u64;
    match &d.decision.action {
        FinalAction::Sent => {
            let reply = d.reply.as_deref().map(redact_addresses);
            let relay = d.relay;
            tracing::info!(
                outcome,
                smtp_code,
                elapsed_ms,
                domain,
                relay,
                reply,
                "mail sent"
            )
        }
        FinalAction::Retry { delay, error, .. } => tracing::warn!(
            outcome, smtp_code, elapsed_ms, domain, retry_in_ms = retry_in_ms(delay),
            error = %redact_addresses(error), "mail retry scheduled"
        ),
        FinalAction::Defer { delay, error, .. } => tracing::warn!(
            outcome, smtp_code, elapsed_ms, domain, retry_in_ms = retry_in_ms(delay),
            error = %redact_addresses(error), "mail deferred"
        ),
        FinalAction::Failed { error, .. } => tracing::warn!(
            outcome, smtp_code, elapsed_ms, domain,
            error = %redact_addresses(error), "mail failed"
        ),
        FinalAction::Unknown { error } => tracing::warn!(
            outcome, smtp_code, elapsed_ms, domain,
            error = %redact_addresses(error), "mail held as unknown"
        ),
        FinalAction::Release => tracing::info!(outcome, "mail released"),
    }
}
