//! What a send came to, as data: the stage the conversation reached and the
//! relay's reply, if it gave one. Deciding what that means for the row is the
//! outcome policy's job (`worker::outcome`), not this module's.

use std::fmt;

/// How far the conversation with the relay got when it failed (or was cut off).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Stage {
    /// Opening the TCP connection.
    #[default]
    Connect,
    /// Waiting for the greeting.
    Greeting,
    /// The TLS handshake (implicit or STARTTLS), or a relay that does not offer
    /// STARTTLS where it is required.
    Tls,
    /// EHLO.
    Ehlo,
    /// AUTH.
    Auth,
    MailFrom,
    RcptTo,
    Data,
    /// Writing the content and the final "."; the "." has not gone out yet.
    Body,
    /// The final "." went out: the relay may have the mail.
    AfterDot,
    /// The file transport could not write its `.eml` file.
    Outbox,
}

impl Stage {
    /// Whether the relay had accepted the session: the failure belongs to one
    /// mail's transaction, not to reaching the relay.
    pub fn in_transaction(self) -> bool {
        matches!(
            self,
            Stage::MailFrom | Stage::RcptTo | Stage::Data | Stage::Body | Stage::AfterDot
        )
    }

    /// The stage as the history stores it (`mail_event.stage`): short,
    /// lower-case, stable.
    pub fn key(self) -> &'static str {
        match self {
            Stage::Connect => "connect",
            Stage::Greeting => "greeting",
            Stage::Tls => "tls",
            Stage::Ehlo => "ehlo",
            Stage::Auth => "auth",
            Stage::MailFrom => "mail",
            Stage::RcptTo => "rcpt",
            Stage::Data => "data",
            Stage::Body => "body",
            Stage::AfterDot => "dot",
            Stage::Outbox => "outbox",
        }
    }

    /// The stage a history key names.
    pub fn from_key(key: &str) -> Option<Stage> {
        [
            Stage::Connect,
            Stage::Greeting,
            Stage::Tls,
            Stage::Ehlo,
            Stage::Auth,
            Stage::MailFrom,
            Stage::RcptTo,
            Stage::Data,
            Stage::Body,
            Stage::AfterDot,
            Stage::Outbox,
        ]
        .into_iter()
        .find(|s| s.key() == key)
    }

    /// The stage as it is written at the start of `last_error`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Connect => "connect",
            Stage::Greeting => "greeting",
            Stage::Tls => "TLS",
            Stage::Ehlo => "EHLO",
            Stage::Auth => "AUTH",
            Stage::MailFrom => "MAIL FROM",
            Stage::RcptTo => "RCPT TO",
            Stage::Data => "DATA",
            Stage::Body | Stage::AfterDot => "end of data",
            Stage::Outbox => "outbox",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How `status` and the console name a group of history rows by their
/// `mail_event.stage` and reply code: the SMTP stage and the code when the
/// relay gave one ("RCPT TO 550"), otherwise what happened ("no reply after
/// \".\"", "invalid mail"…). Besides the [`Stage`] keys, the history holds
/// the keys of failures before the relay, named here too.
pub fn failure_label(stage: Option<&str>, smtp_code: Option<i32>) -> String {
    if let (Some(stage), Some(code)) = (stage.and_then(Stage::from_key), smtp_code) {
        return format!("{} {code}", stage.as_str());
    }
    match stage {
        Some("dot") => "no reply after \".\"".into(),
        Some("body") => "connection lost before \".\"".into(),
        Some("message") => "invalid mail".into(),
        Some("config") => "no sender configured".into(),
        Some("queue") => "expired".into(),
        Some("throttle") => "domain throttled".into(),
        Some("route") => "route not configured".into(),
        Some("route_down") => "route unavailable".into(),
        Some("lock") => "worker lost".into(),
        Some("refused") => "refused by tablemail".into(),
        Some(other) => match Stage::from_key(other) {
            Some(stage) => format!("{} (no reply)", stage.as_str()),
            None => other.to_string(),
        },
        None => "unknown".into(),
    }
}

/// A reply of the relay: its code and its text (lines joined by spaces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub code: u16,
    pub text: String,
}

impl Reply {
    /// "Slow down": a 421, or an enhanced status 4.7.x (RFC 3463), as in
    /// "451 4.7.1 Rate limit exceeded".
    pub fn is_throttling(&self) -> bool {
        self.code == 421
            || ((400..500).contains(&self.code)
                && self
                    .text
                    .split_whitespace()
                    .next()
                    .is_some_and(|w| w.starts_with("4.7.")))
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.text.is_empty() {
            write!(f, "{}", self.code)
        } else {
            write!(f, "{} {}", self.code, self.text)
        }
    }
}

/// A send that did not end in a positive reply to ".".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct SendError {
    pub stage: Stage,
    /// The relay's negative reply, when it gave one.
    pub reply: Option<Reply>,
    /// Without a reply: what broke (an I/O error, a timeout, a refusal to go on).
    pub detail: String,
    /// tablemail itself refused to send this mail over this relay (it
    /// cannot carry it): permanent, and nothing of the mail was sent.
    pub refused_here: bool,
}

impl SendError {
    pub fn replied(stage: Stage, reply: Reply) -> SendError {
        SendError {
            stage,
            reply: Some(reply),
            detail: String::new(),
            refused_here: false,
        }
    }

    pub fn broke(stage: Stage, detail: impl Into<String>) -> SendError {
        SendError {
            stage,
            reply: None,
            detail: detail.into(),
            refused_here: false,
        }
    }

    /// tablemail will not send the mail over this relay (`detail` says why),
    /// at `stage`, before a byte of it went out.
    pub fn refused_here(stage: Stage, detail: impl Into<String>) -> SendError {
        SendError {
            stage,
            reply: None,
            detail: detail.into(),
            refused_here: true,
        }
    }

    pub fn code(&self) -> Option<u16> {
        self.reply.as_ref().map(|r| r.code)
    }

    pub fn is_throttling(&self) -> bool {
        self.reply.as_ref().is_some_and(Reply::is_throttling)
    }

    /// TLS, certificate or AUTH trouble that only an operator can fix (a 4xx
    /// to AUTH is the relay's passing trouble).
    pub fn needs_operator(&self) -> bool {
        match self.stage {
            Stage::Tls | Stage::Outbox => true,
            Stage::Auth => self.code().is_none_or(|c| c >= 500),
            _ => false,
        }
    }

    /// `<stage>: <code> <text>` or `<stage>: <what broke>`: the form of
    /// `last_error` and of the history's detail, as operators read them.
    fn describe(&self) -> String {
        match (&self.reply, self.stage) {
            (None, stage) if self.refused_here => {
                format!(
                    "{stage}: refused by tablemail, not by the relay: {}",
                    self.detail
                )
            }
            (Some(reply), stage) => format!("{stage}: {reply}"),
            (None, Stage::AfterDot) => format!("no reply after end of data: {}", self.detail),
            (None, stage) if stage.in_transaction() => format!(
                "{stage}: connection lost before end of data: {}",
                self.detail
            ),
            (None, stage) => format!("{stage}: {}", self.detail),
        }
    }
}

/// The relay accepted the mail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    pub code: u16,
    /// The relay's reply to ".", usually naming its queue id.
    pub reply: String,
    /// Which relay took it.
    pub relay: Role,
}

/// The relay a session talks to: `transport.url`, or `transport.fallback_url`
/// while the first is unavailable.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Role {
    #[default]
    Primary,
    Fallback,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Primary => "primary",
            Role::Fallback => "fallback",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(code: u16, text: &str) -> Reply {
        Reply {
            code,
            text: text.into(),
        }
    }

    #[test]
    fn throttling_is_421_or_an_enhanced_4_7_status() {
        assert!(reply(421, "4.3.2 Too busy").is_throttling());
        assert!(reply(451, "4.7.1 Rate limit exceeded").is_throttling());
        assert!(!reply(451, "4.3.0 Try later").is_throttling());
        assert!(!reply(550, "5.7.1 Relaying denied").is_throttling());
        assert!(!reply(451, "Greylisted 4.7.1").is_throttling());
    }

    #[test]
    fn describes_the_stage_first() {
        let e = SendError::replied(Stage::RcptTo, reply(550, "5.1.1 unknown"));
        assert_eq!(e.to_string(), "RCPT TO: 550 5.1.1 unknown");
        let e = SendError::broke(Stage::AfterDot, "timed out after 10m");
        assert_eq!(
            e.to_string(),
            "no reply after end of data: timed out after 10m"
        );
        let e = SendError::broke(Stage::Data, "reset");
        assert_eq!(
            e.to_string(),
            "DATA: connection lost before end of data: reset"
        );
        let e = SendError::broke(Stage::Connect, "connection refused");
        assert_eq!(e.to_string(), "connect: connection refused");
        let e = SendError::refused_here(Stage::MailFrom, "no SMTPUTF8");
        assert_eq!(
            e.to_string(),
            "MAIL FROM: refused by tablemail, not by the relay: no SMTPUTF8"
        );
    }

    #[test]
    fn failures_are_labelled_by_stage_and_code_or_kind() {
        let cases = [
            (Some("rcpt"), Some(550), "RCPT TO 550"),
            (Some("dot"), Some(554), "end of data 554"),
            (Some("dot"), None, "no reply after \".\""),
            (Some("body"), None, "connection lost before \".\""),
            (Some("queue"), None, "expired"),
            (Some("lock"), None, "worker lost"),
            (Some("throttle"), None, "domain throttled"),
            (Some("message"), None, "invalid mail"),
            (Some("config"), None, "no sender configured"),
            (Some("route"), None, "route not configured"),
            (Some("route_down"), None, "route unavailable"),
            (Some("refused"), None, "refused by tablemail"),
            (Some("connect"), None, "connect (no reply)"),
        ];
        for (stage, code, label) in cases {
            assert_eq!(failure_label(stage, code), label, "{stage:?} {code:?}");
        }
    }

    #[test]
    fn operators_fix_tls_and_refused_logins() {
        assert!(SendError::broke(Stage::Tls, "bad certificate").needs_operator());
        assert!(SendError::replied(Stage::Auth, reply(535, "no")).needs_operator());
        assert!(!SendError::replied(Stage::Auth, reply(454, "later")).needs_operator());
        assert!(!SendError::broke(Stage::Connect, "refused").needs_operator());
    }
}
