//! Connections to the relay: connect (TCP, TLS, greeting, EHLO, STARTTLS,
//! AUTH) with a deadline on every step, a pool of idle sessions, and sending
//! one mail through a session, reconnecting once when a reused connection
//! turns out to have died while idle.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use lettre::transport::smtp::{
    authentication::{Credentials, Mechanism},
    client::{AsyncSmtpConnection, AsyncTokioStream, TlsParameters},
    commands::{Ehlo, Noop, Rset},
    extension::ClientId,
};
use secrecy::ExposeSecret;
use tokio::net::TcpStream;

use super::{
    error::{Delivered, Role, SendError, Stage},
    stream::{implicit_tls, tune, ReadCount, TrackedStream},
    transaction::{timed, transaction, Limits},
    url::TlsMode,
    Outgoing,
};

/// Reuse an idle connection without a NOOP if it rested less than this.
const IDLE_CHECK_AFTER: Duration = Duration::from_secs(5);

/// One sender's connection to the relay, kept from mail to mail. Take one
/// with [`super::Transport::session`], send through it with
/// [`super::Transport::send`], give it back with [`super::Transport::recycle`].
#[derive(Default)]
pub struct Session {
    pub(super) conn: Option<Connection>,
    /// The MAIL/RCPT/DATA of the mail with this id went out with the previous
    /// mail's end of data; their replies are still to be read.
    pub(super) pending: Option<i64>,
    pub(super) idle_since: Option<Instant>,
    /// How far the current send got; read when a send is cut off.
    pub(super) stage: Stage,
    /// Reads on the connection when the end of data began (see [`ReadCount`]).
    pub(super) data_mark: Option<u64>,
    /// The relay this session talks to.
    pub(super) relay: Role,
}

impl Session {
    pub(super) fn for_relay(relay: Role) -> Session {
        Session {
            relay,
            ..Session::default()
        }
    }

    /// The send in progress on this session was cut off from outside (by the
    /// shutdown deadline, or a panic): how far did it get? `AfterDot` means the
    /// relay may have the mail. The connection is out of step and is dropped.
    pub fn cut_off(&mut self) -> Stage {
        let stage = match (self.stage, self.data_mark.take(), &self.conn) {
            (Stage::Body, Some(mark), Some(conn)) if conn.reads.get() > mark => Stage::AfterDot,
            (stage, _, _) => stage,
        };
        self.conn = None;
        self.pending = None;
        stage
    }
}

pub(super) struct Connection {
    pub(super) conn: AsyncSmtpConnection,
    pub(super) reads: ReadCount,
    /// The relay announced PIPELINING (RFC 2920): MAIL, RCPT and DATA go out
    /// in one write, which halves the round-trips of a mail.
    pub(super) pipelining: bool,
}

/// How a relay's sessions log in.
pub(super) enum Auth {
    None,
    /// PLAIN or LOGIN with a password.
    Password(Credentials),
    /// XOAUTH2 with the current token (DESIGN §13).
    OAuth2(std::sync::Arc<super::oauth2::Tokens>),
}

/// An SMTP relay, and its idle sessions.
pub struct SmtpRelay {
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) tls: TlsMode,
    pub(super) tls_parameters: Option<TlsParameters>,
    pub(super) auth: Auth,
    /// AUTH may go over a connection without TLS (`transport.allow_plaintext_auth`).
    pub(super) plaintext_auth: bool,
    pub(super) hello: ClientId,
    pub(super) limits: Limits,
    pub(super) pool_size: usize,
    pub(super) idle: Mutex<Vec<Session>>,
}

impl SmtpRelay {
    pub(super) async fn send(
        &self,
        session: &mut Session,
        mail: Outgoing<'_>,
        next: Option<Outgoing<'_>>,
    ) -> Result<Delivered, SendError> {
        // This mail's envelope may be on its way already.
        let mut sent_ahead = match session.pending.take() {
            Some(pending) if pending == mail.id && session.conn.is_some() => true,
            Some(_) => {
                // Sent ahead for a mail that is not this one: cannot follow.
                session.conn = None;
                false
            }
            None => false,
        };
        // A connection that breaks before the relay said anything about this
        // mail died while idle, or with the mail before: try once more on a
        // fresh one rather than blaming this mail or the relay.
        let mut fresh_retry = true;
        loop {
            session.stage = Stage::Connect;
            session.data_mark = None;
            let reused = session.conn.is_some();
            if !reused {
                // Boxed: connecting (TCP, TLS, EHLO, AUTH) is a large
                // future and a rare one; inline, its state would be moved
                // along with every mail's send.
                session.conn = Some(Box::pin(self.connect(&mut session.stage)).await?);
                sent_ahead = false;
            } else if !sent_ahead
                && session
                    .idle_since
                    .is_some_and(|t| t.elapsed() >= IDLE_CHECK_AFTER)
            {
                let conn = session.conn.as_mut().expect("reused");
                if Box::pin(timed(self.limits.command, conn.conn.command(Noop)))
                    .await
                    .is_err()
                {
                    session.conn = None;
                    continue;
                }
            }
            session.idle_since = None;
            match transaction(session, self.limits, mail, sent_ahead, next).await {
                Ok((delivered, pending)) => {
                    session.pending = pending;
                    return Ok(delivered);
                }
                Err(f) if f.error.refused_here => {
                    // Nothing was written: the session stays as it was.
                    return Err(f.error);
                }
                Err(f) => {
                    let error = f.error;
                    let not_ours = fresh_retry
                        && reused
                        && !matches!(error.stage, Stage::Body | Stage::AfterDot)
                        && error.code().is_none_or(|code| code == 421);
                    if not_ours {
                        fresh_retry = false;
                        sent_ahead = false;
                        session.conn = None;
                        continue;
                    }
                    let in_step = error.code().is_some_and(|c| c != 421) && !f.poisoned;
                    // In step after a reply to ".", or once RSET clears the
                    // refused transaction: the session goes on.
                    let keep = in_step
                        && match session.conn.as_mut() {
                            Some(_) if error.stage == Stage::AfterDot => true,
                            Some(conn) => {
                                Box::pin(timed(self.limits.command, conn.conn.command(Rset)))
                                    .await
                                    .is_ok()
                            }
                            None => false,
                        };
                    if keep {
                        session.pending = f.pending;
                    } else if let Some(conn) = session.conn.take() {
                        if in_step {
                            Box::pin(self.hang_up(conn.conn)).await;
                        }
                        // Otherwise the connection is out of step: just close it.
                    }
                    return Err(error);
                }
            }
        }
    }

    /// Says QUIT if the relay still listens, then closes. lettre's `abort()`
    /// waits for the reply to QUIT without a limit: a relay that stopped
    /// answering would hold us forever.
    pub(super) async fn hang_up(&self, mut conn: AsyncSmtpConnection) {
        let limit = self.limits.command.min(Duration::from_secs(1));
        let _ = tokio::time::timeout(limit, conn.abort()).await;
    }

    /// Opens a session: TCP, TLS, greeting, EHLO, STARTTLS, AUTH, each under
    /// the command deadline; `stage` follows along.
    pub(super) async fn connect(&self, stage: &mut Stage) -> Result<Connection, SendError> {
        let addr = format!("{}:{}", self.host, self.port);
        let limit = self.limits.command;
        if !matches!(self.auth, Auth::None) && self.tls == TlsMode::None && !self.plaintext_auth {
            // Decided by the configuration alone: refused before any byte
            // goes out, so the password never travels in clear. An AUTH
            // failure with no reply needs an operator: mail waits, unspent.
            *stage = Stage::Auth;
            return Err(SendError::broke(
                Stage::Auth,
                format!(
                    "not sent: the connection to {addr} has no TLS (?tls=none, or a relay on this \
                     host without ?tls=required) and transport.allow_plaintext_auth is false"
                ),
            ));
        }
        *stage = Stage::Connect;
        let tcp = match tokio::time::timeout(limit, TcpStream::connect(&addr)).await {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) => return Err(SendError::broke(Stage::Connect, format!("{addr}: {e}"))),
            Err(_) => {
                return Err(SendError::broke(
                    Stage::Connect,
                    format!("{addr}: timed out"),
                ))
            }
        };
        tune(&tcp, limit).map_err(|e| SendError::broke(Stage::Connect, format!("{addr}: {e}")))?;
        let reads = ReadCount::default();
        let tracked = TrackedStream::new(tcp, reads.clone());
        let stream: Box<dyn AsyncTokioStream> = match (self.tls, &self.tls_parameters) {
            (TlsMode::Implicit, Some(params)) => {
                *stage = Stage::Tls;
                let tls = timed(limit, implicit_tls(tracked, params.clone()))
                    .await
                    .map_err(|e| SendError::broke(Stage::Tls, format!("{addr}: {e}")))?;
                Box::new(tls)
            }
            _ => Box::new(tracked),
        };
        *stage = Stage::Greeting;
        let mut conn = timed(
            limit,
            AsyncSmtpConnection::connect_with_transport(stream, &self.hello),
        )
        .await
        .map_err(|e| {
            let stage = if e.is_tls() {
                Stage::Tls
            } else {
                Stage::Greeting
            };
            e.at(stage)
        })?;
        if let (TlsMode::StartTls, Some(params)) = (self.tls, &self.tls_parameters) {
            *stage = Stage::Tls;
            if !conn.can_starttls() {
                self.hang_up(conn).await;
                // Said so that an operator who wrote no `tls=` (TLS by
                // default since DESIGN §13) sees both ways out.
                let why = if super::is_loopback(&self.host) {
                    "and tls=required forbids plain text"
                } else {
                    "which smtp:// requires of a relay not on this host \
                     (?tls=none sends in clear on purpose)"
                };
                return Err(SendError::broke(
                    Stage::Tls,
                    format!("{addr} does not offer STARTTLS, {why}"),
                ));
            }
            timed(limit, conn.starttls(params.clone(), &self.hello))
                .await
                .map_err(|e| e.at(Stage::Tls))?;
        }
        // lettre keeps only the EHLO keywords it uses; ask once more for the
        // rest (PIPELINING), before AUTH, which a new EHLO could reset.
        *stage = Stage::Ehlo;
        let ehlo = timed(limit, conn.command(Ehlo::new(self.hello.clone())))
            .await
            .map_err(|e| e.at(Stage::Ehlo))?;
        let pipelining = ehlo
            .message()
            .any(|line| line.eq_ignore_ascii_case("PIPELINING"));
        match &self.auth {
            Auth::None => {}
            Auth::Password(credentials) => {
                *stage = Stage::Auth;
                let mechanisms = [Mechanism::Plain, Mechanism::Login];
                if let Err(e) = timed(limit, conn.auth(&mechanisms, credentials)).await {
                    self.hang_up(conn).await;
                    return Err(e.at(Stage::Auth));
                }
            }
            Auth::OAuth2(tokens) => {
                *stage = Stage::Auth;
                let token = match tokens.current() {
                    Ok(token) => token,
                    Err(e) => {
                        self.hang_up(conn).await;
                        // Nothing was sent: a configuration fault, mail
                        // waits unspent until a token comes.
                        return Err(SendError::broke(
                            Stage::Auth,
                            format!("not sent: oauth2 ({}): {e}", tokens.provider()),
                        ));
                    }
                };
                let credentials =
                    Credentials::new(tokens.user().to_string(), token.expose_secret().to_string());
                if let Err(e) = timed(limit, conn.auth(&[Mechanism::Xoauth2], &credentials)).await {
                    // The relay refused this token: renew it once, now.
                    tokens.rejected(&token);
                    self.hang_up(conn).await;
                    return Err(e.at(Stage::Auth));
                }
            }
        }
        Ok(Connection {
            conn,
            reads,
            pipelining,
        })
    }
}
