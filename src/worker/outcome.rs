//! The outcome policy: what becomes of one claimed mail, as a pure function
//! of how far its send got and what it returned, the row's attempts, the
//! settings, and what the relay did for other mails lately. DESIGN §2, row by
//! row; the tests below are that table.

use std::time::Duration;

pub use crate::metrics::Outcome as Logged;
use crate::{
    config::Ambiguous,
    mail::MailError,
    smtp::{Delivered, SendError, Stage},
    store::{EventOutcome, FinalAction},
};

use super::retry;

/// The settings the policy reads.
#[derive(Debug, Clone)]
pub struct Policy {
    pub ambiguous: Ambiguous,
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// Relay-down outcomes one row may draw in a row, while others go
    /// through, before it spends attempts (`worker.relay_down_limit`).
    pub relay_down_limit: u32,
}

/// What the policy needs of the claimed row.
#[derive(Debug, Clone, Copy)]
pub struct Row {
    /// Tries made, this one included.
    pub attempts: i32,
    /// Tries left after this one.
    pub attempts_remaining: i32,
    /// Relay-down outcomes this row drew in a row before this one.
    pub relay_down_count: i32,
}

/// What the relay did for other mails lately.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayView {
    /// Another mail went through while this one was being sent, or just
    /// before: the relay works, a refusal is this mail's own.
    pub others_went_through: bool,
    /// Mails the relay refused in the middle of their transaction (a 421)
    /// since the last one went through, this one not counted.
    pub refusals_in_a_row: u32,
}

/// How far one mail got.
#[derive(Debug, Clone)]
pub enum Attempt {
    Delivered(Delivered),
    Failed(SendError),
    /// The send was stopped from outside at `stage`.
    CutOff {
        stage: Stage,
        by: CutOff,
    },
    /// The row cannot become a message.
    Invalid(MailError),
    /// `created_at` is older than `worker.max_age`.
    Expired,
    /// Not tried now, and why.
    Held(Hold),
    /// Every recipient is on the suppression list (DESIGN §12): the mail
    /// ends without a session, its attempt refunded.
    Suppressed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutOff {
    /// The shutdown deadline (`worker.shutdown_timeout`) passed.
    Shutdown,
    /// The sender crashed (a panic).
    Crash,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hold {
    /// The relay was found unavailable: wait for the pause to end.
    RelayPaused,
    /// The daemon is stopping.
    ShuttingDown,
    /// The row's content could not be loaded: the database did not answer.
    DatabaseUnavailable,
    /// The row's content could not be loaded: its lock is gone (another
    /// daemon took the row back), so nothing may be written for it either.
    LockLost,
    /// A recipient domain asked us to slow down.
    DomainThrottled { domain: String, wait: Duration },
    /// Its route's relay is paused while other routes send: the row is
    /// moved out of the way until the pause ends, not claimed again and
    /// again.
    RoutePaused { route: String, wait: Duration },
    /// The row names a route no configuration has (DESIGN §13): a
    /// configuration fault, the mail waits unspent.
    UnknownRoute(String),
    /// A send cap has no room for it (DESIGN §16): it waits, unspent,
    /// until room frees.
    OverCap { cap: String, wait: Duration },
}

/// What the relay's answer tells about the relay as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelaySignal {
    /// Nothing new.
    Quiet,
    /// A mail went through: the relay works.
    WentThrough,
    /// The relay cannot take mail now: pause everything.
    Down { needs_operator: bool },
    /// The configuration cannot send this mail (no sender): say so loudly.
    ConfigFault,
}

/// The policy's answer for one mail.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub action: FinalAction,
    pub logged: Logged,
    pub relay: RelaySignal,
}

/// How the relay's answer counts, DESIGN §2's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The relay cannot take mail now (refused, TLS, AUTH, 421, a negative
    /// greeting): no attempt is spent.
    RelayDown,
    /// 4xx to MAIL, RCPT or DATA, or the connection dropped before ".".
    Transient,
    /// 5xx to MAIL, RCPT, DATA or after ".".
    Permanent,
    /// No reply after "." went out: the relay may have the mail.
    Ambiguous,
}

pub fn classify(e: &SendError) -> Class {
    if e.refused_here {
        // The relay cannot carry this mail (SMTPUTF8 not offered).
        return Class::Permanent;
    }
    let reaching_the_relay = !e.stage.in_transaction();
    match e.code() {
        Some(421) => Class::RelayDown,
        Some(_) if reaching_the_relay => Class::RelayDown,
        Some(code) if code >= 500 => Class::Permanent,
        Some(_) => Class::Transient,
        None if reaching_the_relay => Class::RelayDown,
        None if e.stage == Stage::AfterDot => Class::Ambiguous,
        None => Class::Transient,
    }
}

/// A pause that moves a row out of the way without blaming it.
const SHORT_DEFERRAL: Duration = Duration::from_secs(1);

/// What becomes of one mail. `jitter` in `[0, 1)` spreads backoffs.
pub fn decide(
    attempt: &Attempt,
    row: Row,
    relay: RelayView,
    policy: &Policy,
    jitter: f64,
) -> Decision {
    let backoff =
        |n: i32| retry::retry_delay(n.max(1) as u32, policy.retry_base, policy.retry_max, jitter);
    let decision = |action, logged, relay| Decision {
        action,
        logged,
        relay,
    };
    // A failed try: again later while attempts remain.
    let transient = |error: String, relay_down: bool| {
        if row.attempts_remaining > 0 {
            decision(
                FinalAction::Retry {
                    delay: backoff(row.attempts),
                    error,
                    relay_down,
                },
                Logged::Retry,
                RelaySignal::Quiet,
            )
        } else {
            decision(
                FinalAction::Failed { error, relay_down },
                Logged::Failed,
                RelaySignal::Quiet,
            )
        }
    };
    // The relay may have it.
    let ambiguous = |error: String| {
        let action = if policy.ambiguous == Ambiguous::Hold || row.attempts_remaining == 0 {
            FinalAction::Unknown { error }
        } else {
            FinalAction::Retry {
                delay: backoff(row.attempts),
                error,
                relay_down: false,
            }
        };
        decision(action, Logged::Ambiguous, RelaySignal::Quiet)
    };
    let released = |relay| decision(FinalAction::Release, Logged::Released, relay);
    let deferred = |delay, error, counted| {
        decision(
            FinalAction::Defer {
                delay,
                error,
                counted,
            },
            Logged::Released,
            RelaySignal::Quiet,
        )
    };
    let failed = |error: String| {
        decision(
            FinalAction::Failed {
                error,
                relay_down: false,
            },
            Logged::Failed,
            RelaySignal::Quiet,
        )
    };
    match attempt {
        Attempt::Delivered(_) => {
            decision(FinalAction::Sent, Logged::Sent, RelaySignal::WentThrough)
        }
        Attempt::Failed(e) => match classify(e) {
            Class::Transient => transient(e.to_string(), false),
            Class::Permanent => failed(e.to_string()),
            Class::Ambiguous => ambiguous(e.to_string()),
            Class::RelayDown if !e.stage.in_transaction() => released(RelaySignal::Down {
                needs_operator: e.needs_operator(),
            }),
            // A refusal in the middle of the transaction (a 421 to MAIL,
            // RCPT, DATA or "."): the relay's, or only this mail's?
            Class::RelayDown if relay.others_went_through => {
                let count = row.relay_down_count;
                if count < policy.relay_down_limit as i32 {
                    let error = format!(
                        "{e} (deferred: {} of {} while other mails went through)",
                        count + 1,
                        policy.relay_down_limit
                    );
                    deferred(backoff(count + 1), error, true)
                } else {
                    transient(e.to_string(), true)
                }
            }
            // The first refusal since the last success: move the row out of
            // the way (it would be first in line again) without blaming it.
            Class::RelayDown if relay.refusals_in_a_row == 0 => {
                deferred(SHORT_DEFERRAL, e.to_string(), false)
            }
            Class::RelayDown => released(RelaySignal::Down {
                needs_operator: false,
            }),
        },
        Attempt::CutOff { stage, by } => {
            let error = match by {
                CutOff::Shutdown => format!("{stage}: interrupted by shutdown"),
                CutOff::Crash => format!("{stage}: the sender crashed"),
            };
            match (stage, by) {
                (Stage::AfterDot, _) => ambiguous(format!(
                    "no reply after end of data: {}",
                    match by {
                        CutOff::Shutdown => "interrupted by shutdown",
                        CutOff::Crash => "the sender crashed",
                    }
                )),
                (_, CutOff::Shutdown) => released(RelaySignal::Quiet),
                // Spent: a mail that crashes its sender must not loop forever.
                (_, CutOff::Crash) => transient(error, false),
            }
        }
        Attempt::Invalid(MailError::NoSender) => Decision {
            action: FinalAction::Defer {
                delay: policy.retry_base.min(Duration::from_secs(60)),
                error: MailError::NoSender.to_string(),
                counted: false,
            },
            logged: Logged::Released,
            relay: RelaySignal::ConfigFault,
        },
        Attempt::Invalid(e) => failed(e.to_string()),
        Attempt::Expired => failed("expired".into()),
        Attempt::Held(
            Hold::RelayPaused | Hold::ShuttingDown | Hold::DatabaseUnavailable | Hold::LockLost,
        ) => released(RelaySignal::Quiet),
        Attempt::Suppressed => decision(
            FinalAction::Suppressed {
                error: "suppressed: every recipient is on the suppression list".into(),
            },
            Logged::Suppressed,
            RelaySignal::Quiet,
        ),
        Attempt::Held(Hold::RoutePaused { route, wait }) => deferred(
            *wait,
            format!("deferred: route {route} is unavailable"),
            false,
        ),
        Attempt::Held(Hold::UnknownRoute(name)) => Decision {
            action: FinalAction::Defer {
                delay: policy.retry_base.min(Duration::from_secs(60)),
                error: format!("route `{name}` is not configured"),
                counted: false,
            },
            logged: Logged::Released,
            relay: RelaySignal::ConfigFault,
        },
        Attempt::Held(Hold::DomainThrottled { domain, wait }) => deferred(
            *wait,
            format!("deferred: {domain} asked to slow down"),
            false,
        ),
        Attempt::Held(Hold::OverCap { cap, wait }) => {
            deferred(*wait, format!("deferred: send cap {cap} reached"), false)
        }
    }
}

/// The history row an attempt leaves (DESIGN §8): every attempt that did
/// not end in `sent`, except a row that was only held back (shutdown, a
/// paused relay) and never tried. `None`: no row.
pub fn history(
    attempt: &Attempt,
    action: &FinalAction,
) -> Option<(EventOutcome, Option<&'static str>)> {
    let outcome = match action {
        FinalAction::Sent => return None,
        FinalAction::Retry { .. } => EventOutcome::Retry,
        FinalAction::Failed { .. } => EventOutcome::Failed,
        FinalAction::Unknown { .. } => EventOutcome::Unknown,
        FinalAction::Defer { .. } => EventOutcome::Deferred,
        // Released after the relay refused it: the try is refunded, but it
        // was a try, and the relay's answer is worth keeping.
        FinalAction::Release if matches!(attempt, Attempt::Failed(_)) => EventOutcome::Released,
        FinalAction::Release => return None,
        // Each recipient left out has a row of its own, written when the
        // suppression list was read.
        FinalAction::Suppressed { .. } => return None,
    };
    Some((outcome, stage_key(attempt)))
}

/// What `mail_event.stage` says of an attempt: how far the conversation got,
/// or what stopped the mail before the relay.
pub fn stage_key(attempt: &Attempt) -> Option<&'static str> {
    match attempt {
        Attempt::Delivered(_) => Some(Stage::AfterDot.key()),
        // Not the relay's answer: the relay cannot carry this mail (no
        // SMTPUTF8 for a non-ASCII address), and nothing of it went out.
        Attempt::Failed(e) if e.refused_here => Some("refused"),
        Attempt::Failed(e) => Some(e.stage.key()),
        Attempt::CutOff { stage, .. } => Some(stage.key()),
        Attempt::Invalid(MailError::NoSender) => Some("config"),
        Attempt::Invalid(_) => Some("message"),
        Attempt::Expired => Some("queue"),
        Attempt::Held(Hold::DomainThrottled { .. }) => Some("throttle"),
        // A route's own keys: neither is a domain's throttling nor a missing
        // sender, which `status` and the console would call them.
        Attempt::Held(Hold::RoutePaused { .. }) => Some("route_down"),
        Attempt::Held(Hold::UnknownRoute(_)) => Some("route"),
        Attempt::Held(Hold::OverCap { .. }) => Some("limit"),
        Attempt::Suppressed => Some("suppression"),
        Attempt::Held(_) => None,
    }
}

#[cfg(test)]
mod tests;
