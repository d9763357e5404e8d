//! Delivery: an SMTP client that knows the stage every failure happened at,
//! and a file transport for development.
//!
//! lettre's pooled `AsyncSmtpTransport::send()` cannot tell a refused
//! connection from a reply lost after ".", only bounds the TCP connect with
//! its timeout, sends a NOOP before every mail, and leaves Nagle's algorithm
//! on. So this module opens the TCP stream itself ([`stream`]), hands it to
//! lettre's connection-level API ([`session`]), drives each mail transaction
//! under a deadline per step ([`transaction`]), and keeps its own pool of idle
//! connections. What a failure means for the row is decided elsewhere
//! (`worker::outcome`): this module reports the stage and the reply as data
//! ([`error`]).

mod error;
mod file;
mod session;
mod stream;
mod transaction;
mod url;

use std::{path::PathBuf, sync::Mutex, time::Duration};

use lettre::{
    address::Envelope,
    transport::smtp::{authentication::Credentials, client::TlsParameters, extension::ClientId},
};
use secrecy::{ExposeSecret, SecretString};

pub use error::{Delivered, Reply, SendError, Stage};
pub use session::Session;
pub use url::{TlsMode, TransportKind, UrlError};

use file::FileTransport;
use session::SmtpRelay;
use transaction::Limits;

/// One message as the relay gets it: the row's id (it also names the file of
/// the file transport), the envelope and the formatted content.
#[derive(Clone, Copy)]
pub struct Outgoing<'a> {
    pub id: i64,
    pub envelope: &'a Envelope,
    pub content: &'a [u8],
}

/// How to reach the relay named by `transport.url`.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    pub kind: TransportKind,
    pub username: Option<String>,
    pub password: Option<SecretString>,
    /// Our name in EHLO.
    pub hello: String,
    /// Deadline of each command (and of the TCP connect, and TCP's own
    /// `TCP_USER_TIMEOUT`).
    pub timeout: Duration,
    /// Deadline of the reply to ".".
    pub data_timeout: Duration,
    /// Idle connections kept for reuse.
    pub pool_size: usize,
    pub accept_invalid_certs: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{0}")]
    Url(#[from] UrlError),
    #[error("transport.username needs transport.password or password_file")]
    NoPassword,
    #[error("TLS setup: {0}")]
    Tls(String),
}

/// Where mail goes: an SMTP relay or a directory of `.eml` files.
pub enum Transport {
    Smtp(SmtpRelay),
    File(FileTransport),
}

impl Transport {
    pub fn new(options: RelayOptions) -> Result<Transport, TransportError> {
        let (host, port, tls) = match options.kind {
            TransportKind::File { dir } => return Ok(Transport::File(FileTransport { dir })),
            TransportKind::Smtp { host, port, tls } => (host, port, tls),
        };
        let tls_parameters = match tls {
            TlsMode::None => None,
            _ => Some(
                TlsParameters::builder(host.clone())
                    .dangerous_accept_invalid_certs(options.accept_invalid_certs)
                    .dangerous_accept_invalid_hostnames(options.accept_invalid_certs)
                    .build_rustls()
                    .map_err(|e| TransportError::Tls(e.to_string()))?,
            ),
        };
        let credentials = match (options.username, options.password) {
            (Some(user), Some(pass)) => {
                Some(Credentials::new(user, pass.expose_secret().to_string()))
            }
            (Some(_), None) => return Err(TransportError::NoPassword),
            (None, _) => None,
        };
        Ok(Transport::Smtp(SmtpRelay {
            host,
            port,
            tls,
            tls_parameters,
            credentials,
            hello: ClientId::Domain(options.hello),
            limits: Limits {
                command: options.timeout,
                data: options.data_timeout,
            },
            pool_size: options.pool_size,
            idle: Mutex::new(Vec::new()),
        }))
    }

    /// The directory of the file transport, if that is what this is.
    pub fn outbox(&self) -> Option<&PathBuf> {
        match self {
            Transport::File(file) => Some(&file.dir),
            Transport::Smtp(_) => None,
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
                    idle_since: Some(std::time::Instant::now()),
                    ..Session::default()
                });
                return;
            }
        }
        relay.hang_up(conn.conn).await;
    }

    /// Delivers one message through `session`. `next`, when known, is the
    /// mail this session sends after it (its envelope may ride along).
    pub async fn send(
        &self,
        session: &mut Session,
        mail: Outgoing<'_>,
        next: Option<Outgoing<'_>>,
    ) -> Result<Delivered, SendError> {
        match self {
            Transport::Smtp(relay) => relay.send(session, mail, next).await,
            Transport::File(file) => file.send(mail).await,
        }
    }

    /// Opens a session and says QUIT (connect, TLS, EHLO and AUTH as
    /// configured): whether the relay would take mail now. Returns what it
    /// said of itself.
    pub async fn probe(&self) -> Result<String, SendError> {
        match self {
            Transport::Smtp(relay) => {
                let mut stage = Stage::Connect;
                let mut conn = relay.connect(&mut stage).await?;
                let info = conn.conn.server_info().to_string();
                let _ = tokio::time::timeout(relay.limits.command, conn.conn.quit()).await;
                Ok(info)
            }
            Transport::File(file) => {
                file.create_dir().await?;
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
