//! The project's classification of one recipient's outcome, shared by every
//! recogniser: an action (as a DSN names it, or as a non-standard bounce
//! implies it), a status or reply code, and the reason text -> [`Kind`].
//!
//! hard_bounce: a permanent failure (5.x.x, an SMTP 5xx, or a reason that
//! says the address is dead) unless the mailbox is full; soft_bounce: given
//! up for a temporary reason (4.x.x in a failed report, a full mailbox, or a
//! failure whose reason is not known to be permanent); delayed: still being
//! retried; delivered, relayed and expanded change nothing (unknown).

use super::text::{self, contains_any};
use super::Kind;

/// What the reporting MTA did with the recipient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    Failed,
    Delayed,
    /// Delivered, relayed or expanded: nothing to act on.
    Done,
    /// Missing, or a value RFC 3464 does not define.
    Unstated,
}

impl Action {
    pub(super) fn parse(value: &str) -> Action {
        let word = value
            .trim()
            .split(|c: char| c.is_whitespace() || c == '(' || c == ';')
            .next()
            .unwrap_or_default();
        match word.to_ascii_lowercase().as_str() {
            "failed" | "failure" => Action::Failed,
            "delayed" => Action::Delayed,
            "delivered" | "relayed" | "expanded" => Action::Done,
            _ => Action::Unstated,
        }
    }
}

/// Reasons that mean the mailbox is full (soft whatever the code).
const MAILBOX_FULL: &[&str] = &[
    "quota",
    "mailbox full",
    "mailbox is full",
    "mailbox was full",
    "mailfolder is full",
    "mailbox size limit",
    "mailbox has exceeded",
    "exceeded storage",
    "exceeds the storage",
    "storage allocation",
    "out of storage",
    "insufficient storage",
    "not enough storage",
    "mailbox is over",
    "user is over",
    "account is full",
    "inbox is full",
    "box full",
];

/// Reasons that mean the address does not (or no longer) exist.
const ADDRESS_DEAD: &[&str] = &[
    "user unknown",
    "unknown user",
    "unknown recipient",
    "recipient unknown",
    "no such user",
    "no such recipient",
    "no such mailbox",
    "no such address",
    "no such person",
    "no mailbox here",
    "no mailbox by that name",
    "mailbox unavailable",
    "mailbox not found",
    "mailbox does not exist",
    "mailbox is disabled",
    "mailbox disabled",
    "mailbox has been disabled",
    "account disabled",
    "account has been disabled",
    "account is disabled",
    "account that you tried to reach is disabled",
    "address rejected",
    "recipient rejected",
    "does not exist",
    "doesn't exist",
    "doesn't have a",
    "does not have an account",
    "not a valid mailbox",
    "invalid mailbox",
    "invalid recipient",
    "invalid address",
    "address not found",
    "address couldn't be found",
    "recipient not found",
    "recipnotfound",
    "recipientnotfound",
    "user not found",
    "unrouteable address",
    "unroutable address",
    "bad destination mailbox",
    "couldn't be found",
    "could not be found",
    "wasn't found at",
    "no longer available",
    "no longer active",
    "is not a known user",
    "host or domain name not found",
    "domain not found",
    "couldn't find any host named",
];

/// Reasons that mean a temporary failure was given up on.
const GAVE_UP_TEMPORARY: &[&str] = &[
    "retry timeout exceeded",
    "retry time not reached",
    "have been failing for a long time",
    "has been in the queue too long",
    "message expired",
    "connection timed out",
    "connection refused",
    "try again later",
    "temporarily",
    "greylist",
];

/// Phrases that say the failure is permanent, with nothing more specific.
const PERMANENT: &[&str] = &[
    "this is a permanent error",
    "failed permanently",
    "permanent fatal error",
    "permanent failure",
];

/// The class digit of `status` (`5.1.1` or `550`).
fn class(status: Option<&str>) -> Option<u8> {
    status.and_then(|s| s.bytes().next())
}

/// Whether `status` names a full mailbox (x.2.2).
fn status_is_full(status: Option<&str>) -> bool {
    status.is_some_and(|s| s.get(1..) == Some(".2.2"))
}

/// Whether `status` is an addressing failure (5.1.x): the address is dead
/// whatever else the reason says.
fn status_is_bad_address(status: Option<&str>) -> bool {
    status.is_some_and(|s| s.starts_with("5.1."))
}

/// The kind of one recipient's outcome.
///
/// `status` is an enhanced status code or a reply code; `reason` the
/// diagnostic text; `delay_notice` whether the report as a whole says it is a
/// warning (for a missing Action with a 4xx); `permanent_notice` whether it
/// says its failures are permanent (for a failure with no code).
pub(super) fn kind(
    action: Action,
    status: Option<&str>,
    reason: Option<&str>,
    delay_notice: bool,
    permanent_notice: bool,
) -> Kind {
    match action {
        Action::Delayed => return Kind::Delayed,
        Action::Done => return Kind::Unknown,
        Action::Failed | Action::Unstated => {}
    }
    let reason = reason.map(text::ascii_lower).unwrap_or_default();
    let full = status_is_full(status)
        || (!status_is_bad_address(status) && contains_any(&reason, MAILBOX_FULL));
    let stated = action == Action::Failed;
    match class(status) {
        Some(b'2') => Kind::Unknown,
        _ if full => {
            if !stated && delay_notice {
                Kind::Delayed
            } else {
                Kind::SoftBounce
            }
        }
        Some(b'5') => Kind::HardBounce,
        Some(b'4') => {
            if !stated && delay_notice {
                Kind::Delayed
            } else {
                Kind::SoftBounce
            }
        }
        _ if contains_any(&reason, ADDRESS_DEAD) => Kind::HardBounce,
        _ if contains_any(&reason, GAVE_UP_TEMPORARY) => Kind::SoftBounce,
        _ if permanent_notice || contains_any(&reason, PERMANENT) => Kind::HardBounce,
        _ if stated => Kind::SoftBounce,
        _ if delay_notice => Kind::Delayed,
        _ => Kind::Unknown,
    }
}

/// The status to report for a recipient: the enhanced status code of the
/// report's Status field, made more specific from the reason when the field
/// only gives the class (`5.0.0` and the reason says `5.1.1`); else the
/// first enhanced code in the reason; else its first SMTP reply code.
pub(super) fn status(field: Option<&str>, reason: Option<&str>) -> Option<String> {
    let from_field = field.and_then(|f| text::enhanced_status(f, b"245"));
    let from_reason = reason.and_then(|r| text::enhanced_status(r, b"245"));
    match (from_field, from_reason) {
        (Some(f), Some(r)) if f.ends_with(".0.0") && r.get(..1) == f.get(..1) => Some(r.to_owned()),
        (Some(f), _) => Some(f.to_owned()),
        (None, Some(r)) => Some(r.to_owned()),
        (None, None) => field
            .and_then(|f| text::reply_code(f.trim(), b"245"))
            .or_else(|| reason.and_then(|r| text::reply_code(r, b"245")))
            .map(str::to_owned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds() {
        use Action::*;
        type Case<'a> = (Action, Option<&'a str>, Option<&'a str>, bool, Kind);
        let cases: &[Case<'_>] = &[
            (Failed, Some("5.1.1"), None, false, Kind::HardBounce),
            (Failed, Some("5.2.2"), None, false, Kind::SoftBounce),
            (Failed, Some("4.2.2"), None, false, Kind::SoftBounce),
            (
                Failed,
                Some("5.7.1"),
                Some("quota exceeded"),
                false,
                Kind::SoftBounce,
            ),
            (
                Failed,
                Some("5.1.1"),
                Some("user unknown (quota)"),
                false,
                Kind::HardBounce,
            ),
            (Failed, Some("4.4.7"), None, false, Kind::SoftBounce),
            (Unstated, Some("4.4.7"), None, true, Kind::Delayed),
            (Unstated, Some("4.4.7"), None, false, Kind::SoftBounce),
            (Delayed, Some("5.1.1"), None, false, Kind::Delayed),
            (Done, Some("2.0.0"), None, false, Kind::Unknown),
            (Unstated, Some("2.0.0"), None, false, Kind::Unknown),
            (
                Failed,
                None,
                Some("No such user here"),
                false,
                Kind::HardBounce,
            ),
            (Failed, None, Some("Mailbox full"), false, Kind::SoftBounce),
            (
                Failed,
                None,
                Some("retry timeout exceeded"),
                true,
                Kind::SoftBounce,
            ),
            (Failed, None, Some("something odd"), false, Kind::SoftBounce),
            (Unstated, None, Some("something odd"), false, Kind::Unknown),
            (Failed, Some("550"), None, false, Kind::HardBounce),
            (Failed, Some("452"), None, false, Kind::SoftBounce),
        ];
        for (action, status, reason, delay, want) in cases {
            assert_eq!(
                kind(*action, *status, *reason, *delay, false),
                *want,
                "{action:?} {status:?} {reason:?}"
            );
        }
        assert_eq!(kind(Failed, None, None, false, true), Kind::HardBounce);
    }

    #[test]
    fn statuses() {
        assert_eq!(
            status(Some("5.0.0"), Some("550 5.1.1 no")).as_deref(),
            Some("5.1.1")
        );
        assert_eq!(
            status(Some("5.0.0 (x)"), Some("450 4.2.0 no")).as_deref(),
            Some("5.0.0")
        );
        assert_eq!(
            status(None, Some("said: 550 no such user")).as_deref(),
            Some("550")
        );
        assert_eq!(status(Some("550"), None).as_deref(), Some("550"));
        assert_eq!(status(None, None), None);
    }

    #[test]
    fn actions() {
        assert_eq!(Action::parse(" Failed "), Action::Failed);
        assert_eq!(Action::parse("delayed (will retry)"), Action::Delayed);
        assert_eq!(Action::parse("relayed"), Action::Done);
        assert_eq!(Action::parse("what"), Action::Unstated);
    }
}
