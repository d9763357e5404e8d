//! Delivery: an SMTP client that knows the stage every failure happened at, and
//! a file transport for development.
//!
//! lettre's pooled `AsyncSmtpTransport::send()` cannot tell a refused connection
//! from a reply lost after ".", only bounds the TCP connect with its timeout,
//! sends a NOOP before every mail, and leaves Nagle's algorithm on (lettre writes
//! the body and the final "." separately, which costs ~40 ms per mail). So this
//! module opens the TCP stream itself with `TCP_NODELAY`, hands it to lettre's
//! connection-level API, drives MAIL/RCPT/DATA one command at a time under a
//! timeout each, and keeps its own pool of idle connections.

use std::{
    fmt, io,
    net::SocketAddr,
    path::PathBuf,
    pin::Pin,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use lettre::transport::smtp::{
    authentication::{Credentials, Mechanism},
    client::{AsyncSmtpConnection, AsyncTokioStream, TlsParameters},
    commands::{Data, Ehlo, Mail, Noop, Rcpt, Rset},
    extension::{ClientId, Extension, MailBodyParameter, MailParameter},
    Error as SmtpError,
};
use secrecy::{ExposeSecret, SecretString};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
};

use crate::{config::TransportSettings, mail::PreparedMail};

/// How a failed delivery is handled (DESIGN §2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The relay cannot take mail now: the batch goes back untouched.
    #[error("{reason}")]
    RelayDown {
        reason: String,
        code: Option<u16>,
        /// TLS or AUTH trouble that an operator must fix.
        needs_operator: bool,
    },
    /// 4xx to MAIL/RCPT/DATA, or the connection dropped before ".": try later.
    #[error("{reason}")]
    Transient { reason: String, code: Option<u16> },
    /// 5xx, or a mail the relay will never take: fail it now.
    #[error("{reason}")]
    Permanent { reason: String, code: Option<u16> },
    /// Lost after "." was sent: the relay may have the mail.
    #[error("{reason}")]
    Ambiguous { reason: String },
}

impl SendError {
    /// The relay says it is sent too much: a 421, or a 4.7.x enhanced status
    /// (RFC 3463), as in "451 4.7.1 Rate limit exceeded".
    pub fn is_throttling(&self) -> bool {
        match self {
            SendError::RelayDown {
                code: Some(421), ..
            } => true,
            SendError::Transient {
                code: Some(400..=499),
                reason,
            } => reason.split_whitespace().any(|w| w.starts_with("4.7.")),
            _ => false,
        }
    }

    pub fn code(&self) -> Option<u16> {
        match self {
            SendError::RelayDown { code, .. }
            | SendError::Transient { code, .. }
            | SendError::Permanent { code, .. } => *code,
            SendError::Ambiguous { .. } => None,
        }
    }
}

/// The relay accepted the mail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    pub code: u16,
    /// The relay's reply to ".", usually naming its queue id.
    pub reply: String,
}

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("`{0}` is not a transport URL: use smtp://, smtps:// or file://")]
    Scheme(String),
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// Plain text, for a relay on the same host or network.
    None,
    /// STARTTLS, never downgraded to plain text.
    StartTls,
    /// TLS from the first byte (`smtps://`).
    Implicit,
}

/// What `transport.url` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportKind {
    Smtp {
        host: String,
        port: u16,
        tls: TlsMode,
    },
    File {
        dir: PathBuf,
    },
}

impl TransportKind {
    pub fn parse(url: &str) -> Result<TransportKind, TransportError> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| TransportError::Scheme(url.to_string()))?;
        match scheme {
            "file" => {
                if rest.is_empty() {
                    return Err(TransportError::Invalid("file:// needs a directory".into()));
                }
                Ok(TransportKind::File {
                    dir: PathBuf::from(rest),
                })
            }
            "smtp" | "smtps" => {
                let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
                let authority = authority.trim_end_matches('/');
                let default_port = if scheme == "smtps" { 465 } else { 25 };
                let (host, port) = split_host_port(authority, default_port)?;
                let mut tls = if scheme == "smtps" {
                    TlsMode::Implicit
                } else {
                    TlsMode::None
                };
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    match pair {
                        "tls=required" if scheme == "smtp" => tls = TlsMode::StartTls,
                        "tls=none" if scheme == "smtp" => tls = TlsMode::None,
                        other => {
                            return Err(TransportError::Invalid(format!(
                                "unknown option `{other}` (smtp:// takes tls=required)"
                            )))
                        }
                    }
                }
                Ok(TransportKind::Smtp { host, port, tls })
            }
            other => Err(TransportError::Scheme(other.to_string())),
        }
    }
}

fn split_host_port(authority: &str, default_port: u16) -> Result<(String, u16), TransportError> {
    let invalid = || TransportError::Invalid(format!("`{authority}` is not host:port"));
    if authority.is_empty() || authority.contains('@') {
        return Err(TransportError::Invalid(
            "the URL needs a host (credentials go in transport.username/password)".into(),
        ));
    }
    if let Some(v6) = authority.strip_prefix('[') {
        let (host, rest) = v6.split_once(']').ok_or_else(invalid)?;
        let port = match rest.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| invalid())?,
            None if rest.is_empty() => default_port,
            None => return Err(invalid()),
        };
        return Ok((host.to_string(), port));
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => Ok((host.to_string(), port.parse().map_err(|_| invalid())?)),
        None => Ok((authority.to_string(), default_port)),
    }
}

/// Where mail goes: an SMTP relay or a directory of `.eml` files.
pub enum Transport {
    Smtp(SmtpRelay),
    File(FileTransport),
}

/// One sender's connection to the relay, kept from mail to mail. Take one
/// with [`Transport::session`], send through it with [`Transport::send`],
/// give it back with [`Transport::recycle`]: up to `transport.pool_size` idle
/// sessions stay connected for the next sender.
#[derive(Default)]
pub struct Session {
    conn: Option<Connection>,
    /// The MAIL/RCPT/DATA of the mail with this id went out with the previous
    /// mail's end of data; their replies are still to be read.
    pending: Option<i64>,
    idle_since: Option<Instant>,
}

/// The mail a session will send next: with PIPELINING, its MAIL, RCPT and
/// DATA ride in the same write as the current mail's end of data, so that a
/// mail costs the relay one round-trip instead of two.
#[derive(Clone, Copy)]
pub struct Next<'a> {
    pub id: i64,
    pub mail: &'a PreparedMail,
}

impl Transport {
    pub fn new(
        settings: &TransportSettings,
        password: Option<SecretString>,
        hello_name: &str,
    ) -> Result<Transport, TransportError> {
        match TransportKind::parse(&settings.url)? {
            TransportKind::File { dir } => Ok(Transport::File(FileTransport { dir })),
            TransportKind::Smtp { host, port, tls } => {
                let tls_parameters = match tls {
                    TlsMode::None => None,
                    _ => Some(
                        TlsParameters::builder(host.clone())
                            .dangerous_accept_invalid_certs(settings.accept_invalid_certs)
                            .dangerous_accept_invalid_hostnames(settings.accept_invalid_certs)
                            .build_rustls()
                            .map_err(|e| TransportError::Invalid(format!("TLS setup: {e}")))?,
                    ),
                };
                let credentials = match (&settings.username, password) {
                    (Some(user), Some(pass)) => Some(Credentials::new(
                        user.clone(),
                        pass.expose_secret().to_string(),
                    )),
                    (Some(_), None) => {
                        return Err(TransportError::Invalid(
                            "transport.username needs transport.password or password_file".into(),
                        ))
                    }
                    (None, _) => None,
                };
                Ok(Transport::Smtp(SmtpRelay {
                    host,
                    port,
                    tls,
                    tls_parameters,
                    credentials,
                    hello: ClientId::Domain(hello_name.to_string()),
                    timeout: settings.timeout,
                    data_timeout: settings.data_timeout,
                    pool_size: settings.pool_size,
                    idle: Mutex::new(Vec::new()),
                }))
            }
        }
    }

    /// A session, connected already if an idle one was kept.
    pub fn session(&self) -> Session {
        match self {
            Transport::Smtp(relay) => relay.idle.lock().unwrap().pop().unwrap_or_default(),
            Transport::File(_) => Session::default(),
        }
    }

    /// Takes a session back: kept for reuse while fewer than
    /// `transport.pool_size` are idle, closed otherwise.
    pub async fn recycle(&self, mut session: Session) {
        let Transport::Smtp(relay) = self else {
            return;
        };
        let Some(conn) = session.conn.take() else {
            return;
        };
        // An envelope sent ahead for a mail that will not follow leaves the
        // relay mid-transaction: only closing gets out of that.
        if session.pending.take().is_some() || conn.conn.has_broken() {
            return;
        }
        {
            let mut idle = relay.idle.lock().unwrap();
            if idle.len() < relay.pool_size {
                idle.push(Session {
                    conn: Some(conn),
                    pending: None,
                    idle_since: Some(Instant::now()),
                });
                return;
            }
        }
        relay.hang_up(conn.conn).await;
    }

    /// Delivers one prepared mail through `session`; `id` is its row (and
    /// names the file of the file transport). `next`, when known, is the mail
    /// this session sends after it.
    pub async fn send(
        &self,
        session: &mut Session,
        id: i64,
        mail: &PreparedMail,
        next: Option<Next<'_>>,
    ) -> Result<Delivered, SendError> {
        match self {
            Transport::Smtp(relay) => relay.send(session, id, mail, next).await,
            Transport::File(file) => file.send(id, mail).await,
        }
    }

    /// Opens (and closes) one session, as `tablemail check` does.
    pub async fn probe(&self) -> Result<String, SendError> {
        match self {
            Transport::Smtp(relay) => {
                let mut conn = relay.connect().await?;
                let info = conn.conn.server_info().to_string();
                let _ = tokio::time::timeout(relay.timeout, conn.conn.quit()).await;
                Ok(info)
            }
            Transport::File(file) => {
                tokio::fs::create_dir_all(&file.dir)
                    .await
                    .map_err(|e| SendError::RelayDown {
                        reason: format!("cannot create {}: {e}", file.dir.display()),
                        code: None,
                        needs_operator: true,
                    })?;
                Ok(format!("directory {}", file.dir.display()))
            }
        }
    }

    /// Closes idle connections politely.
    pub async fn close(&self) {
        if let Transport::Smtp(relay) = self {
            let idle: Vec<Session> = std::mem::take(&mut *relay.idle.lock().unwrap());
            for session in idle {
                if let Some(conn) = session.conn {
                    relay.hang_up(conn.conn).await;
                }
            }
        }
    }
}

/// Writes each mail as `<id>.eml` into a directory; nothing leaves the machine.
pub struct FileTransport {
    dir: PathBuf,
}

impl FileTransport {
    async fn send(&self, id: i64, mail: &PreparedMail) -> Result<Delivered, SendError> {
        let down = |e: io::Error| SendError::RelayDown {
            reason: format!("cannot write to {}: {e}", self.dir.display()),
            code: None,
            needs_operator: true,
        };
        tokio::fs::create_dir_all(&self.dir).await.map_err(down)?;
        let tmp = self.dir.join(format!(".{id}.eml.tmp"));
        let path = self.dir.join(format!("{id}.eml"));
        tokio::fs::write(&tmp, &mail.bytes).await.map_err(down)?;
        tokio::fs::rename(&tmp, &path).await.map_err(down)?;
        Ok(Delivered {
            code: 250,
            reply: format!("written to {}", path.display()),
        })
    }
}

/// Reuse an idle connection without a NOOP if it rested less than this.
const IDLE_CHECK_AFTER: Duration = Duration::from_secs(5);

/// An SMTP relay, and its idle sessions.
pub struct SmtpRelay {
    host: String,
    port: u16,
    tls: TlsMode,
    tls_parameters: Option<TlsParameters>,
    credentials: Option<Credentials>,
    hello: ClientId,
    timeout: Duration,
    data_timeout: Duration,
    pool_size: usize,
    idle: Mutex<Vec<Session>>,
}

struct Connection {
    conn: AsyncSmtpConnection,
    /// Counts reads on the socket, to tell whether "." went out (see `TrackedStream`).
    reads: Arc<AtomicU64>,
    /// The relay announced PIPELINING (RFC 2920): MAIL, RCPT and DATA go out
    /// in one write, which halves the round-trips of a mail.
    pipelining: bool,
}

/// Where in the SMTP conversation a failure happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    MailFrom,
    RcptTo,
    Data,
    /// Body and final "." (and the wait for the reply).
    EndOfData,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::MailFrom => "MAIL FROM",
            Stage::RcptTo => "RCPT TO",
            Stage::Data => "DATA",
            Stage::EndOfData => "end of data",
        })
    }
}

/// A failure inside one mail transaction.
struct TxFailure {
    stage: Stage,
    /// The relay's reply, when it gave one.
    reply: Option<(u16, String)>,
    /// Without a reply: what broke.
    detail: String,
    /// For `EndOfData` without a reply: "." was written before it broke.
    dot_sent: bool,
    /// The session cannot continue (a pipelined DATA was accepted).
    poisoned: bool,
    /// The next mail's envelope went out with this end of data (and the
    /// relay answered: the session is still in step).
    pending: Option<i64>,
}

impl SmtpRelay {
    async fn send(
        &self,
        session: &mut Session,
        id: i64,
        mail: &PreparedMail,
        next: Option<Next<'_>>,
    ) -> Result<Delivered, SendError> {
        // This mail's envelope may be on its way already.
        let mut sent_ahead = match session.pending.take() {
            Some(pending) if pending == id && session.conn.is_some() => true,
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
            let reused = session.conn.is_some();
            if !reused {
                session.conn = Some(self.connect().await?);
                sent_ahead = false;
            } else if !sent_ahead
                && session
                    .idle_since
                    .is_some_and(|t| t.elapsed() >= IDLE_CHECK_AFTER)
            {
                let conn = session.conn.as_mut().expect("reused");
                if timed(self.timeout, conn.conn.command(Noop)).await.is_err() {
                    session.conn = None;
                    continue;
                }
            }
            session.idle_since = None;
            let conn = session.conn.as_mut().expect("connected");
            match self.transaction(conn, mail, sent_ahead, next).await {
                Ok((delivered, pending)) => {
                    session.pending = pending;
                    return Ok(delivered);
                }
                Err(f) => {
                    let not_ours = fresh_retry
                        && reused
                        && f.stage != Stage::EndOfData
                        && f.reply.as_ref().is_none_or(|(code, _)| *code == 421);
                    if not_ours {
                        fresh_retry = false;
                        sent_ahead = false;
                        session.conn = None;
                        continue;
                    }
                    let error = classify(&f);
                    let in_step = matches!(f.reply, Some((code, _)) if code != 421) && !f.poisoned;
                    let keep = in_step
                        && (f.stage == Stage::EndOfData
                            || timed(self.timeout, conn.conn.command(Rset)).await.is_ok());
                    if keep {
                        session.pending = f.pending;
                    } else if let Some(conn) = session.conn.take() {
                        if in_step {
                            self.hang_up(conn.conn).await;
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
    async fn hang_up(&self, mut conn: AsyncSmtpConnection) {
        let limit = self.timeout.min(Duration::from_secs(1));
        let _ = tokio::time::timeout(limit, conn.abort()).await;
    }

    /// Opens a session: TCP (NODELAY), TLS, greeting, EHLO, STARTTLS, AUTH.
    /// Every failure here means the relay is unavailable.
    async fn connect(&self) -> Result<Connection, SendError> {
        let down = |reason: String, code: Option<u16>, needs_operator: bool| SendError::RelayDown {
            reason,
            code,
            needs_operator,
        };
        let addr = format!("{}:{}", self.host, self.port);
        let tcp = match tokio::time::timeout(self.timeout, TcpStream::connect(&addr)).await {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) => return Err(down(format!("connect to {addr}: {e}"), None, false)),
            Err(_) => return Err(down(format!("connect to {addr}: timed out"), None, false)),
        };
        tcp.set_nodelay(true)
            .map_err(|e| down(format!("set TCP_NODELAY: {e}"), None, false))?;
        let reads = Arc::new(AtomicU64::new(0));
        let tracked = TrackedStream {
            inner: tcp,
            reads: reads.clone(),
        };
        let stream: Box<dyn AsyncTokioStream> = match (self.tls, &self.tls_parameters) {
            (TlsMode::Implicit, Some(params)) => {
                let tls = timed(self.timeout, implicit_tls(tracked, params.clone()))
                    .await
                    .map_err(|e| down(format!("TLS with {addr}: {e}"), None, true))?;
                Box::new(tls)
            }
            _ => Box::new(tracked),
        };
        let mut conn = timed(
            self.timeout,
            AsyncSmtpConnection::connect_with_transport(stream, &self.hello),
        )
        .await
        .map_err(|e| {
            let code = e.code();
            down(format!("greeting from {addr}: {e}"), code, e.is_tls())
        })?;
        if let (TlsMode::StartTls, Some(params)) = (self.tls, &self.tls_parameters) {
            if !conn.can_starttls() {
                self.hang_up(conn).await;
                return Err(down(
                    format!("{addr} does not offer STARTTLS, and tls=required forbids plain text"),
                    None,
                    true,
                ));
            }
            timed(self.timeout, conn.starttls(params.clone(), &self.hello))
                .await
                .map_err(|e| {
                    let code = e.code();
                    down(
                        format!("STARTTLS with {addr}: {e}"),
                        code,
                        code.is_none_or(|c| c >= 500),
                    )
                })?;
        }
        // lettre keeps only the EHLO keywords it uses; ask once more for the
        // rest (PIPELINING), before AUTH, which a new EHLO could reset.
        let ehlo = timed(self.timeout, conn.command(Ehlo::new(self.hello.clone())))
            .await
            .map_err(|e| {
                let code = e.code();
                down(format!("EHLO at {addr}: {e}"), code, false)
            })?;
        let pipelining = ehlo
            .message()
            .any(|line| line.eq_ignore_ascii_case("PIPELINING"));
        if let Some(credentials) = &self.credentials {
            let mechanisms = [Mechanism::Plain, Mechanism::Login];
            if let Err(e) = timed(self.timeout, conn.auth(&mechanisms, credentials)).await {
                let code = e.code();
                self.hang_up(conn).await;
                // 454 and friends are temporary; 535 and the like need an operator.
                let needs_operator = code.is_none_or(|c| c >= 500);
                return Err(down(format!("AUTH at {addr}: {e}"), code, needs_operator));
            }
        }
        Ok(Connection {
            conn,
            reads,
            pipelining,
        })
    }

    /// One mail: its envelope (unless it went ahead), then its content and
    /// ".", followed in the same write by the next mail's envelope when the
    /// relay pipelines. Every step under a timeout.
    async fn transaction(
        &self,
        conn: &mut Connection,
        mail: &PreparedMail,
        sent_ahead: bool,
        next: Option<Next<'_>>,
    ) -> Result<(Delivered, Option<i64>), TxFailure> {
        let rcpts = mail.envelope.to().len();
        if sent_ahead {
            self.envelope_replies(conn, None, rcpts).await?;
        } else if conn.pipelining {
            let group = envelope(conn, mail);
            self.envelope_replies(conn, Some(&group), rcpts).await?;
        } else {
            let group = envelope(conn, mail);
            step(
                Stage::MailFrom,
                timed(self.timeout, conn.conn.command(&group.mail_from)).await,
            )?;
            for rcpt in &group.rcpts {
                step(
                    Stage::RcptTo,
                    timed(self.timeout, conn.conn.command(rcpt)).await,
                )?;
            }
            step(
                Stage::Data,
                timed(self.timeout, conn.conn.command(Data)).await,
            )?;
        }
        let ahead = next
            .filter(|_| conn.pipelining)
            .map(|n| (n.id, envelope(conn, n.mail)));
        let reads_before = conn.reads.load(Ordering::Relaxed);
        let (sent, ahead) = match std::str::from_utf8(&mail.bytes) {
            // The message, dot-stuffed, ".", and maybe the next envelope, in one write.
            Ok(text) => {
                let data = EndOfData {
                    text,
                    then: ahead.as_ref().map(|(_, group)| group),
                };
                let sent = timed(self.data_timeout, conn.conn.command(data)).await;
                (sent, ahead.map(|(id, _)| id))
            }
            Err(_) => (
                timed(self.data_timeout, conn.conn.message(&mail.bytes)).await,
                None,
            ),
        };
        match sent {
            Ok(response) => Ok((
                Delivered {
                    code: code_number(response.code()),
                    reply: response.message().collect::<Vec<_>>().join(" "),
                },
                ahead,
            )),
            Err(e) => {
                // lettre reads the reply only after it wrote everything: any
                // read since DATA's reply means "." went out.
                let dot_sent = conn.reads.load(Ordering::Relaxed) > reads_before;
                let mut f = failure(Stage::EndOfData, e, dot_sent);
                if f.reply.is_some() {
                    f.pending = ahead;
                }
                Err(f)
            }
        }
    }

    /// The replies to MAIL, each RCPT and DATA, in order; `group` is written
    /// first unless it went ahead. The first negative reply decides, and its
    /// stage is known exactly.
    async fn envelope_replies(
        &self,
        conn: &mut Connection,
        group: Option<&Envelope>,
        rcpts: usize,
    ) -> Result<(), TxFailure> {
        let stages = std::iter::once(Stage::MailFrom)
            .chain(std::iter::repeat_n(Stage::RcptTo, rcpts))
            .chain(std::iter::once(Stage::Data));
        let mut first_failure: Option<TxFailure> = None;
        let mut data_open = false;
        for (i, stage) in stages.enumerate() {
            let reply = match group {
                Some(group) if i == 0 => timed(self.timeout, conn.conn.command(group)).await,
                _ => timed(self.timeout, conn.conn.read_response()).await,
            };
            match reply {
                Ok(_) if stage == Stage::Data => data_open = true,
                Ok(_) => {}
                Err(e) => {
                    let f = failure(stage, e, false);
                    if f.reply.is_none() {
                        // No reply at all: the connection is gone.
                        return Err(first_failure.unwrap_or(f));
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
}

/// MAIL FROM (with SMTPUTF8/8BITMIME when needed and offered), then RCPT TO
/// for every recipient, then DATA: as one pipelined group (RFC 2920), or one
/// command at a time.
struct Envelope {
    mail_from: Mail,
    rcpts: Vec<Rcpt>,
}

fn envelope(conn: &Connection, mail: &PreparedMail) -> Envelope {
    let envelope = &mail.envelope;
    let info = conn.conn.server_info();
    let mut params = Vec::new();
    let ascii = |a: &lettre::Address| AsRef::<str>::as_ref(a).is_ascii();
    let non_ascii = envelope.from().is_some_and(|a| !ascii(a)) || !envelope.to().iter().all(ascii);
    if non_ascii && info.supports_feature(Extension::SmtpUtfEight) {
        params.push(MailParameter::SmtpUtfEight);
    }
    if !mail.bytes.is_ascii() && info.supports_feature(Extension::EightBitMime) {
        params.push(MailParameter::Body(MailBodyParameter::EightBitMime));
    }
    Envelope {
        mail_from: Mail::new(envelope.from().cloned(), params),
        rcpts: envelope
            .to()
            .iter()
            .map(|r| Rcpt::new(r.clone(), vec![]))
            .collect(),
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
struct EndOfData<'a> {
    text: &'a str,
    then: Option<&'a Envelope>,
}

impl fmt::Display for EndOfData<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.text;
        if rest.starts_with('.') {
            f.write_str(".")?;
        }
        while let Some(i) = rest.find("\r\n.") {
            f.write_str(&rest[..i + 3])?;
            f.write_str(".")?;
            rest = &rest[i + 3..];
        }
        f.write_str(rest)?;
        f.write_str("\r\n.\r\n")?;
        match self.then {
            Some(envelope) => write!(f, "{envelope}"),
            None => Ok(()),
        }
    }
}

/// The failure of one step, or nothing.
fn step<T>(stage: Stage, result: Result<T, StepError>) -> Result<(), TxFailure> {
    result.map(|_| ()).map_err(|e| failure(stage, e, false))
}

fn failure(stage: Stage, e: StepError, dot_sent: bool) -> TxFailure {
    TxFailure {
        stage,
        reply: e.reply(),
        detail: e.to_string(),
        dot_sent,
        poisoned: false,
        pending: None,
    }
}

/// Maps a transaction failure onto the table of DESIGN §2.
fn classify(f: &TxFailure) -> SendError {
    match &f.reply {
        Some((421, text)) => SendError::RelayDown {
            reason: format!("{}: 421 {text}", f.stage),
            code: Some(421),
            needs_operator: false,
        },
        Some((code, text)) if *code >= 500 => SendError::Permanent {
            reason: format!("{}: {code} {text}", f.stage),
            code: Some(*code),
        },
        Some((code, text)) => SendError::Transient {
            reason: format!("{}: {code} {text}", f.stage),
            code: Some(*code),
        },
        None if f.stage == Stage::EndOfData && f.dot_sent => SendError::Ambiguous {
            reason: format!("no reply after end of data: {}", f.detail),
        },
        None => SendError::Transient {
            reason: format!(
                "{}: connection lost before end of data: {}",
                f.stage, f.detail
            ),
            code: None,
        },
    }
}

/// A step's error: lettre's, or our timeout.
#[derive(Debug)]
enum StepError {
    Smtp(SmtpError),
    Timeout(Duration),
}

impl StepError {
    fn code(&self) -> Option<u16> {
        match self {
            StepError::Smtp(e) => e.status().map(code_number),
            StepError::Timeout(_) => None,
        }
    }

    fn is_tls(&self) -> bool {
        matches!(self, StepError::Smtp(e) if e.is_tls())
    }

    fn reply(&self) -> Option<(u16, String)> {
        let StepError::Smtp(e) = self else {
            return None;
        };
        let code = e.status().map(code_number)?;
        let text = std::error::Error::source(e)
            .map(|s| s.to_string())
            .unwrap_or_default();
        Some((code, text))
    }
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepError::Smtp(e) => match self.reply() {
                Some((code, text)) => write!(f, "{code} {text}"),
                None => write!(f, "{e}"),
            },
            StepError::Timeout(d) => {
                write!(f, "timed out after {}", humantime::format_duration(*d))
            }
        }
    }
}

/// Runs one SMTP step under a deadline.
async fn timed<T>(
    limit: Duration,
    step: impl std::future::Future<Output = Result<T, SmtpError>>,
) -> Result<T, StepError> {
    match tokio::time::timeout(limit, step).await {
        Ok(result) => result.map_err(StepError::Smtp),
        Err(_) => Err(StepError::Timeout(limit)),
    }
}

fn code_number(code: lettre::transport::smtp::response::Code) -> u16 {
    code.to_string().parse().unwrap_or(0)
}

/// The TCP stream under lettre, counting reads.
///
/// lettre writes the body and the final "." and only then reads the reply, so
/// a read after DATA's reply proves "." was written; that is how a failure
/// after "." (ambiguous: the relay may have the mail) is told apart from a drop
/// during the body (transient), with or without TLS on top.
#[derive(Debug)]
struct TrackedStream {
    inner: TcpStream,
    reads: Arc<AtomicU64>,
}

impl AsyncRead for TrackedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TrackedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl AsyncTokioStream for TrackedStream {
    fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.inner.peer_addr()
    }
}

/// Implicit TLS (`smtps://`) over our own NODELAY socket, using lettre's TLS
/// setup: lettre's connection API only accepts a stream it then reads the
/// greeting from, so the TLS layer must already be there.
#[allow(deprecated)]
mod implicit {
    use super::*;
    use lettre::transport::smtp::client::AsyncNetworkStream;
    use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt};

    pub(super) struct TlsOverTcp {
        inner: Compat<AsyncNetworkStream>,
    }

    impl fmt::Debug for TlsOverTcp {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("TlsOverTcp")
        }
    }

    pub(super) async fn implicit_tls(
        tcp: TrackedStream,
        params: TlsParameters,
    ) -> Result<TlsOverTcp, SmtpError> {
        let mut stream = AsyncNetworkStream::use_existing_tokio1(Box::new(tcp));
        stream.upgrade_tls(params).await?;
        Ok(TlsOverTcp {
            inner: stream.compat(),
        })
    }

    impl AsyncRead for TlsOverTcp {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for TlsOverTcp {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.inner).poll_write(cx, buf)
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    impl AsyncTokioStream for TlsOverTcp {
        fn peer_addr(&self) -> io::Result<SocketAddr> {
            self.inner.get_ref().peer_addr()
        }
    }
}

use implicit::implicit_tls;

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
            let data = EndOfData {
                text: body,
                then: None,
            };
            assert_eq!(data.to_string(), wire, "{body:?}");
        }
    }

    #[test]
    fn parses_transport_urls() {
        assert_eq!(
            TransportKind::parse("smtp://relay.example:2525").unwrap(),
            TransportKind::Smtp {
                host: "relay.example".into(),
                port: 2525,
                tls: TlsMode::None
            }
        );
        assert_eq!(
            TransportKind::parse("smtp://relay.example:587?tls=required").unwrap(),
            TransportKind::Smtp {
                host: "relay.example".into(),
                port: 587,
                tls: TlsMode::StartTls
            }
        );
        assert_eq!(
            TransportKind::parse("smtps://relay.example").unwrap(),
            TransportKind::Smtp {
                host: "relay.example".into(),
                port: 465,
                tls: TlsMode::Implicit
            }
        );
        assert_eq!(
            TransportKind::parse("smtp://[::1]:25").unwrap(),
            TransportKind::Smtp {
                host: "::1".into(),
                port: 25,
                tls: TlsMode::None
            }
        );
        assert_eq!(
            TransportKind::parse("file://./outbox").unwrap(),
            TransportKind::File {
                dir: PathBuf::from("./outbox")
            }
        );
        assert!(TransportKind::parse("http://x").is_err());
        assert!(TransportKind::parse("smtp://x:notaport").is_err());
        assert!(TransportKind::parse("smtp://user:pw@x:25").is_err());
        assert!(TransportKind::parse("smtp://x:25?tls=maybe").is_err());
    }

    fn tx(stage: Stage, reply: Option<(u16, &str)>, dot_sent: bool) -> SendError {
        classify(&TxFailure {
            stage,
            reply: reply.map(|(c, t)| (c, t.to_string())),
            detail: "connection reset".into(),
            dot_sent,
            poisoned: false,
            pending: None,
        })
    }

    #[test]
    fn classifies_by_stage_and_reply() {
        assert!(matches!(
            tx(Stage::RcptTo, Some((451, "try later")), false),
            SendError::Transient {
                code: Some(451),
                ..
            }
        ));
        assert!(matches!(
            tx(Stage::RcptTo, Some((550, "no such user")), false),
            SendError::Permanent {
                code: Some(550),
                ..
            }
        ));
        assert!(matches!(
            tx(Stage::EndOfData, Some((554, "spam")), true),
            SendError::Permanent {
                code: Some(554),
                ..
            }
        ));
        assert!(matches!(
            tx(Stage::MailFrom, Some((421, "closing")), false),
            SendError::RelayDown {
                code: Some(421),
                ..
            }
        ));
        assert!(matches!(
            tx(Stage::EndOfData, None, true),
            SendError::Ambiguous { .. }
        ));
        assert!(matches!(
            tx(Stage::EndOfData, None, false),
            SendError::Transient { code: None, .. }
        ));
        assert!(matches!(
            tx(Stage::Data, None, false),
            SendError::Transient { code: None, .. }
        ));
        assert!(tx(
            Stage::MailFrom,
            Some((451, "4.7.1 Rate limit exceeded")),
            false
        )
        .is_throttling());
        assert!(tx(Stage::Data, Some((421, "4.3.2 Too busy")), false).is_throttling());
        assert!(!tx(Stage::RcptTo, Some((451, "4.3.0 Try later")), false).is_throttling());
        assert!(!tx(Stage::RcptTo, Some((550, "5.7.1 Relaying denied")), false).is_throttling());
        let reason = tx(Stage::RcptTo, Some((550, "5.1.1 unknown")), false).to_string();
        assert_eq!(reason, "RCPT TO: 550 5.1.1 unknown");
    }
}
