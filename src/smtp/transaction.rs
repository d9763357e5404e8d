//! One mail transaction on an open connection: MAIL FROM, RCPT TO, DATA (as
//! one pipelined group when the relay offers PIPELINING, RFC 2920), then the
//! dot-stuffed content and "." in one write, followed in the same write by the
//! next mail's envelope when one rides along. Every step under a deadline.

use std::{fmt, time::Duration};

use lettre::transport::smtp::{
    commands::{Data, Mail, Rcpt},
    extension::{Extension, MailBodyParameter, MailParameter},
    response::Code,
    Error as SmtpError,
};

use super::{
    error::{Delivered, Reply, SendError, Stage},
    session::{Connection, Session},
    Outgoing,
};

/// A step's error: lettre's, or our deadline.
#[derive(Debug)]
pub(super) enum StepError {
    Smtp(SmtpError),
    Timeout(Duration),
}

impl StepError {
    /// The relay's reply, when the error is one.
    pub(super) fn reply(&self) -> Option<Reply> {
        let StepError::Smtp(e) = self else {
            return None;
        };
        let code = code_number(e.status()?);
        let text = std::error::Error::source(e)
            .map(|s| s.to_string())
            .unwrap_or_default();
        Some(Reply { code, text })
    }

    pub(super) fn is_tls(&self) -> bool {
        matches!(self, StepError::Smtp(e) if e.is_tls())
    }

    /// The failure of `stage`: the reply if there is one, else what broke.
    pub(super) fn at(self, stage: Stage) -> SendError {
        match self.reply() {
            Some(reply) => SendError::replied(stage, reply),
            None => SendError::broke(stage, self.to_string()),
        }
    }
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepError::Smtp(e) => match self.reply() {
                Some(reply) => write!(f, "{reply}"),
                None => write!(f, "{e}"),
            },
            StepError::Timeout(d) => {
                write!(f, "timed out after {}", humantime::format_duration(*d))
            }
        }
    }
}

/// Runs one SMTP step under a deadline.
pub(super) async fn timed<T>(
    limit: Duration,
    step: impl std::future::Future<Output = Result<T, SmtpError>>,
) -> Result<T, StepError> {
    match tokio::time::timeout(limit, step).await {
        Ok(result) => result.map_err(StepError::Smtp),
        Err(_) => Err(StepError::Timeout(limit)),
    }
}

/// A reply code as a number, from its three digits.
pub(super) fn code_number(code: Code) -> u16 {
    code.severity as u16 * 100 + code.category as u16 * 10 + code.detail as u16
}

/// A failure inside one mail transaction.
pub(super) struct TxFailure {
    pub(super) error: SendError,
    /// The session cannot continue (a pipelined DATA was accepted although we
    /// will not send, or the connection broke).
    pub(super) poisoned: bool,
    /// The next mail's envelope went out with this end of data and the relay
    /// answered: the session is still in step.
    pub(super) pending: Option<i64>,
}

impl TxFailure {
    fn at(stage: Stage, e: StepError) -> TxFailure {
        TxFailure {
            error: e.at(stage),
            poisoned: false,
            pending: None,
        }
    }

    /// Refused by us before anything was written: the session is in step.
    fn refused(error: SendError) -> TxFailure {
        TxFailure {
            error,
            poisoned: false,
            pending: None,
        }
    }
}

/// Timeouts of one transaction.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Each command.
    pub(super) command: Duration,
    /// The reply to "." (RFC 5321 §4.5.3.2: 10 minutes).
    pub(super) data: Duration,
}

/// One mail: its envelope (unless it went ahead with the mail before), then
/// its content and ".", and the next mail's envelope in the same write when
/// the relay pipelines. `session.stage` follows along, so that a send cut off
/// from outside can still be judged by how far it got.
pub(super) async fn transaction(
    session: &mut Session,
    limits: Limits,
    mail: Outgoing<'_>,
    sent_ahead: bool,
    next: Option<Outgoing<'_>>,
) -> Result<(Delivered, Option<i64>), TxFailure> {
    session.stage = Stage::MailFrom;
    let conn = session.conn.as_mut().expect("connected");
    let rcpts = mail.envelope.to().len();
    if sent_ahead {
        envelope_replies(conn, limits, None, rcpts, &mut session.stage).await?;
    } else if conn.pipelining {
        let group = Envelope::of(conn, mail).map_err(TxFailure::refused)?;
        envelope_replies(conn, limits, Some(&group), rcpts, &mut session.stage).await?;
    } else {
        let group = Envelope::of(conn, mail).map_err(TxFailure::refused)?;
        let step = |stage, result: Result<_, StepError>| {
            result.map(|_| ()).map_err(|e| TxFailure::at(stage, e))
        };
        step(
            Stage::MailFrom,
            timed(limits.command, conn.conn.command(&group.mail_from)).await,
        )?;
        session.stage = Stage::RcptTo;
        for rcpt in &group.rcpts {
            step(
                Stage::RcptTo,
                timed(limits.command, conn.conn.command(rcpt)).await,
            )?;
        }
        session.stage = Stage::Data;
        step(
            Stage::Data,
            timed(limits.command, conn.conn.command(Data)).await,
        )?;
    }
    // A next mail this relay cannot take does not go ahead: its own
    // transaction refuses it.
    let ahead = next
        .filter(|_| conn.pipelining)
        .and_then(|n| Some((n.id, Envelope::of(conn, n).ok()?)));
    session.stage = Stage::Body;
    session.data_mark = Some(conn.reads.get());
    // The message is checked once more as text (lettre's command takes a
    // `str`), at vector speed: `core`'s check, an octet at a time, was a
    // noticeable share of a mail's CPU.
    let (sent, ahead) = match simdutf8::basic::from_utf8(mail.content) {
        // The message, dot-stuffed, ".", and maybe the next envelope, in one write.
        Ok(text) => {
            let data = end_of_data(text, ahead.as_ref().map(|(_, group)| group));
            (
                timed(limits.data, conn.conn.command(data.as_str())).await,
                ahead,
            )
        }
        Err(_) => (
            timed(limits.data, conn.conn.message(mail.content)).await,
            None,
        ),
    };
    let dot_sent = session
        .data_mark
        .take()
        .is_some_and(|mark| conn.reads.get() > mark);
    session.stage = Stage::AfterDot;
    match sent {
        Ok(response) => Ok((
            Delivered {
                relay: Default::default(),
                code: code_number(response.code()),
                reply: response.message().collect::<Vec<_>>().join(" "),
            },
            ahead.map(|(id, _)| id),
        )),
        Err(e) => {
            let stage = if dot_sent {
                Stage::AfterDot
            } else {
                Stage::Body
            };
            let mut f = TxFailure::at(stage, e);
            if f.error.reply.is_some() {
                f.pending = ahead.map(|(id, _)| id);
            }
            Err(f)
        }
    }
}

/// The replies to MAIL, each RCPT and DATA, in order; `group` is written
/// first unless it went ahead. The first negative reply decides, and its
/// stage is known exactly.
async fn envelope_replies(
    conn: &mut Connection,
    limits: Limits,
    group: Option<&Envelope>,
    rcpts: usize,
    progress: &mut Stage,
) -> Result<(), TxFailure> {
    let stages = std::iter::once(Stage::MailFrom)
        .chain(std::iter::repeat_n(Stage::RcptTo, rcpts))
        .chain(std::iter::once(Stage::Data));
    let mut first_failure: Option<TxFailure> = None;
    let mut data_open = false;
    for (i, stage) in stages.enumerate() {
        *progress = stage;
        let reply = match group {
            Some(group) if i == 0 => timed(limits.command, conn.conn.command(group)).await,
            _ => timed(limits.command, conn.conn.read_response()).await,
        };
        match reply {
            Ok(_) if stage == Stage::Data => data_open = true,
            Ok(_) => {}
            Err(e) => {
                let f = TxFailure::at(stage, e);
                if f.error.reply.is_none() {
                    // No reply at all: the connection is gone.
                    let mut f = first_failure.unwrap_or(f);
                    f.poisoned = true;
                    return Err(f);
                }
                first_failure.get_or_insert(f);
            }
        }
    }
    match first_failure {
        None => Ok(()),
        Some(mut f) => {
            // The relay opened DATA although we will not send: the only
            // way out without delivering an empty mail is to hang up.
            f.poisoned = data_open;
            Err(f)
        }
    }
}

/// MAIL FROM (with SMTPUTF8/8BITMIME when needed and offered), then RCPT TO
/// for every recipient, then DATA: as one pipelined group (RFC 2920), or one
/// command at a time.
struct Envelope {
    mail_from: Mail,
    rcpts: Vec<Rcpt>,
}

impl Envelope {
    /// The commands of one mail, or a permanent refusal when the mail needs
    /// SMTPUTF8 (a non-ASCII local part in the envelope or in a header; the
    /// message builder writes domains as A-labels and bodies as 7bit,
    /// quoted-printable or base64) and the relay does not offer it: such a
    /// relay would mangle or bounce it, so nothing of it is sent.
    fn of(conn: &Connection, mail: Outgoing<'_>) -> Result<Envelope, SendError> {
        let envelope = mail.envelope;
        let info = conn.conn.server_info();
        let mut params = Vec::new();
        let ascii = |a: &lettre::Address| AsRef::<str>::as_ref(a).is_ascii();
        let ascii_content = mail.content.is_ascii();
        let non_ascii_envelope =
            envelope.from().is_some_and(|a| !ascii(a)) || !envelope.to().iter().all(ascii);
        if non_ascii_envelope || !ascii_content {
            if !info.supports_feature(Extension::SmtpUtfEight) {
                return Err(SendError::refused_here(
                    Stage::MailFrom,
                    "the mail has a non-ASCII address (RFC 6531) and the relay does not \
                     offer SMTPUTF8",
                ));
            }
            params.push(MailParameter::SmtpUtfEight);
        }
        if !ascii_content && info.supports_feature(Extension::EightBitMime) {
            params.push(MailParameter::Body(MailBodyParameter::EightBitMime));
        }
        Ok(Envelope {
            mail_from: Mail::new(envelope.from().cloned(), params),
            rcpts: envelope
                .to()
                .iter()
                .map(|r| Rcpt::new(r.clone(), vec![]))
                .collect(),
        })
    }
}

impl fmt::Display for Envelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.mail_from)?;
        for rcpt in &self.rcpts {
            write!(f, "{rcpt}")?;
        }
        write!(f, "{Data}")
    }
}

/// A message's content as sent after DATA's 354: every line that starts with
/// "." gets a second one (RFC 5321 §4.5.2), then CRLF "." CRLF ends it, exactly
/// as lettre's `message()` would send it, but in one write instead of two;
/// followed by the next mail's envelope when one rides along.
///
/// Built as one string allocated at about its size: lettre's `command`
/// turns what it is given into a string, which for a `&str` is one copy,
/// where a `Display` value is formatted into a string grown step by step
/// (a noticeable share of a mail's CPU).
fn end_of_data(text: &str, then: Option<&Envelope>) -> String {
    /// A line that starts with ".", found with SIMD (a byte-at-a-time
    /// search was a tenth of the lane's CPU).
    static LINE_DOT: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\r\n."));
    /// Room for a few stuffed dots and an envelope (MAIL FROM, a few RCPT
    /// TO and DATA); a longer one grows the string once.
    const ROOM: usize = 512;
    let mut out = String::with_capacity(text.len() + ROOM);
    let mut rest = text;
    if rest.starts_with('.') {
        out.push('.');
    }
    // The pattern is ASCII: every index it gives is a char boundary.
    while let Some(i) = LINE_DOT.find(rest.as_bytes()) {
        out.push_str(&rest[..i + 3]);
        out.push('.');
        rest = &rest[i + 3..];
    }
    out.push_str(rest);
    out.push_str("\r\n.\r\n");
    if let Some(envelope) = then {
        use std::fmt::Write as _;
        // Writing into a String never fails.
        let _ = write!(out, "{envelope}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_of_data_stuffs_dots_like_lettre() {
        let cases = [
            ("Hello\r\nworld", "Hello\r\nworld\r\n.\r\n"),
            (
                ".top\r\n.\r\nMAIL FROM:<x>",
                "..top\r\n..\r\nMAIL FROM:<x>\r\n.\r\n",
            ),
            ("a\r\n..b\r\n", "a\r\n...b\r\n\r\n.\r\n"),
            ("no.dot.at.line.start", "no.dot.at.line.start\r\n.\r\n"),
        ];
        for (body, wire) in cases {
            assert_eq!(end_of_data(body, None), wire, "{body:?}");
        }
    }

    #[test]
    fn reply_codes_are_read_from_their_digits() {
        use lettre::transport::smtp::response::{Category, Detail, Severity};
        let code = Code::new(
            Severity::TransientNegativeCompletion,
            Category::Connections,
            Detail::One,
        );
        assert_eq!(code_number(code), 421);
    }
}
