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
pub mod oauth2;
mod session;
mod stream;
mod transaction;
mod url;

use std::{
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
    time::Duration,
};

use lettre::{
    address::Envelope,
    transport::smtp::{authentication::Credentials, client::TlsParameters, extension::ClientId},
};
use secrecy::{ExposeSecret, SecretString};

pub use error::{failure_label, Delivered, Reply, Role, SendError, Stage};
pub use session::Session;
pub use url::{is_loopback, TlsMode, TransportKind, UrlError};

use file::FileTransport;
use session::{Auth, SmtpRelay};
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
    /// Send AUTH over a connection without TLS (`transport.allow_plaintext_auth`);
    /// otherwise such a relay is refused before the password leaves.
    pub allow_plaintext_auth: bool,
    /// SASL XOAUTH2 with these tokens instead of a password.
    pub oauth2: Option<std::sync::Arc<oauth2::Tokens>>,
}

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{0}")]
    Url(#[from] UrlError),
    #[error("transport.username needs transport.password or password_file")]
    NoPassword,
    #[error("TLS setup: {0}")]
    Tls(String),
    #[error("a fallback relay needs an SMTP primary (transport.url)")]
    FallbackWithoutSmtp,
}

/// Where mail goes: an SMTP relay (and its fallback) or a directory of
/// `.eml` files.
pub struct Transport {
    kind: Kind,
    /// `transport.redirect_to`: every envelope goes to this one address.
    redirect_to: Option<lettre::Address>,
    /// `transport.probe_interval`.
    probe_interval: Duration,
}

enum Kind {
    Smtp(Box<Relays>),
    File(FileTransport),
}

/// `transport.url`, and `transport.fallback_url` for while it is unavailable.
/// Which one new sessions use is the worker's decision ([`Transport::use_fallback`]);
/// a session stays with the relay it is connected to.
pub struct Relays {
    primary: SmtpRelay,
    fallback: Option<SmtpRelay>,
    on_fallback: AtomicBool,
}

impl Relays {
    fn get(&self, role: Role) -> &SmtpRelay {
        match (role, &self.fallback) {
            (Role::Fallback, Some(fallback)) => fallback,
            _ => &self.primary,
        }
    }

    fn active(&self) -> Role {
        if self.on_fallback.load(Ordering::Relaxed) {
            Role::Fallback
        } else {
            Role::Primary
        }
    }
}

impl Transport {
    pub fn new(options: RelayOptions) -> Result<Transport, TransportError> {
        let kind = match options.kind {
            TransportKind::File { dir } => Kind::File(FileTransport { dir }),
            TransportKind::Smtp { .. } => Kind::Smtp(Box::new(Relays {
                primary: SmtpRelay::new(options)?,
                fallback: None,
                on_fallback: AtomicBool::new(false),
            })),
        };
        Ok(Transport {
            kind,
            redirect_to: None,
            probe_interval: Duration::from_secs(30),
        })
    }

    /// Sends every envelope to `to` (staging), headers untouched.
    pub fn redirect_to(mut self, to: Option<lettre::Address>) -> Transport {
        self.redirect_to = to;
        self
    }

    /// Where every envelope goes, if redirected.
    pub fn redirected_to(&self) -> Option<&lettre::Address> {
        self.redirect_to.as_ref()
    }

    /// How often the relay is probed while no mail goes through.
    pub fn probe_every(mut self, interval: Duration) -> Transport {
        self.probe_interval = interval;
        self
    }

    pub fn probe_interval(&self) -> Duration {
        self.probe_interval
    }

    /// Adds `transport.fallback_url`'s relay.
    pub fn with_fallback(mut self, options: RelayOptions) -> Result<Transport, TransportError> {
        match &mut self.kind {
            Kind::Smtp(relays) => relays.fallback = Some(SmtpRelay::new(options)?),
            Kind::File(_) => return Err(TransportError::FallbackWithoutSmtp),
        }
        Ok(self)
    }

    /// Whether a fallback relay is configured.
    pub fn has_fallback(&self) -> bool {
        matches!(&self.kind, Kind::Smtp(relays) if relays.fallback.is_some())
    }

    /// The relay new sessions connect to.
    pub fn active(&self) -> Role {
        match &self.kind {
            Kind::Smtp(relays) => relays.active(),
            Kind::File(_) => Role::Primary,
        }
    }

    /// Sends new sessions to the fallback (`true`) or back to the primary.
    /// Returns whether that changed anything.
    pub fn use_fallback(&self, on: bool) -> bool {
        match &self.kind {
            Kind::Smtp(relays) if relays.fallback.is_some() => {
                relays.on_fallback.swap(on, Ordering::Relaxed) != on
            }
            _ => false,
        }
    }

    /// The directory of the file transport, if that is what this is.
    pub fn outbox(&self) -> Option<&PathBuf> {
        match &self.kind {
            Kind::File(file) => Some(&file.dir),
            Kind::Smtp(_) => None,
        }
    }

    /// A session, connected already if an idle one was kept.
    pub fn session(&self) -> Session {
        match &self.kind {
            Kind::Smtp(relays) => {
                let role = relays.active();
                relays
                    .get(role)
                    .idle
                    .lock()
                    .unwrap()
                    .pop()
                    .unwrap_or_else(|| Session::for_relay(role))
            }
            Kind::File(_) => Session::default(),
        }
    }

    /// Takes a session back: kept for reuse while fewer than
    /// `transport.pool_size` are idle, closed otherwise.
    pub async fn recycle(&self, mut session: Session) {
        let Kind::Smtp(relays) = &self.kind else {
            return;
        };
        let role = session.relay;
        let relay = relays.get(role);
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
                    ..Session::for_relay(role)
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
        let redirected;
        let (mail, next) = match &self.redirect_to {
            Some(to) => {
                redirected = (
                    redirect(mail.envelope, to),
                    next.map(|n| redirect(n.envelope, to)),
                );
                (
                    Outgoing {
                        envelope: &redirected.0,
                        ..mail
                    },
                    next.zip(redirected.1.as_ref())
                        .map(|(n, envelope)| Outgoing { envelope, ..n }),
                )
            }
            None => (mail, next),
        };
        match &self.kind {
            Kind::Smtp(relays) => {
                if session.conn.is_none() {
                    // Not connected yet: to whichever relay is in use now.
                    session.relay = relays.active();
                }
                let role = session.relay;
                let mut delivered = relays.get(role).send(session, mail, next).await?;
                delivered.relay = role;
                Ok(delivered)
            }
            Kind::File(file) => Box::pin(file.send(mail)).await,
        }
    }

    /// Opens a session and says QUIT (connect, TLS, EHLO and AUTH as
    /// configured): whether the relay would take mail now. Returns what it
    /// said of itself.
    pub async fn probe(&self, role: Role) -> Result<String, SendError> {
        match &self.kind {
            Kind::Smtp(relays) => {
                let relay = relays.get(role);
                let mut stage = Stage::Connect;
                let mut conn = relay.connect(&mut stage).await?;
                let info = conn.conn.server_info().to_string();
                let _ = tokio::time::timeout(relay.limits.command, conn.conn.quit()).await;
                Ok(info)
            }
            Kind::File(file) => {
                file.create_dir().await?;
                Ok(format!("directory {}", file.dir.display()))
            }
        }
    }

    /// The OAuth2 token sources of its relays, to keep renewed.
    pub fn oauth2(&self) -> Vec<std::sync::Arc<oauth2::Tokens>> {
        match &self.kind {
            Kind::Smtp(relays) => std::iter::once(&relays.primary)
                .chain(&relays.fallback)
                .filter_map(|r| match &r.auth {
                    Auth::OAuth2(tokens) => Some(tokens.clone()),
                    _ => None,
                })
                .collect(),
            Kind::File(_) => Vec::new(),
        }
    }

    /// Closes idle connections politely.
    pub async fn close(&self) {
        if let Kind::Smtp(relays) = &self.kind {
            for relay in std::iter::once(&relays.primary).chain(&relays.fallback) {
                let idle: Vec<Session> = std::mem::take(&mut *relay.idle.lock().unwrap());
                for session in idle {
                    if let Some(conn) = session.conn {
                        relay.hang_up(conn.conn).await;
                    }
                }
            }
        }
    }
}

impl SmtpRelay {
    fn new(options: RelayOptions) -> Result<SmtpRelay, TransportError> {
        let TransportKind::Smtp { host, port, tls } = options.kind else {
            return Err(TransportError::FallbackWithoutSmtp);
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
        let auth = match (options.oauth2, options.username, options.password) {
            (Some(tokens), _, _) => Auth::OAuth2(tokens),
            (None, Some(user), Some(pass)) => {
                Auth::Password(Credentials::new(user, pass.expose_secret().to_string()))
            }
            (None, Some(_), None) => return Err(TransportError::NoPassword),
            (None, None, _) => Auth::None,
        };
        Ok(SmtpRelay {
            host,
            port,
            tls,
            tls_parameters,
            plaintext_auth: options.allow_plaintext_auth,
            auth,
            hello: ClientId::Domain(options.hello),
            limits: Limits {
                command: options.timeout,
                data: options.data_timeout,
            },
            pool_size: options.pool_size,
            idle: Mutex::new(Vec::new()),
        })
    }
}

/// The same sender, one recipient: `to`.
fn redirect(envelope: &Envelope, to: &lettre::Address) -> Envelope {
    Envelope::new(envelope.from().cloned(), vec![to.clone()])
        .expect("an envelope with one recipient is valid")
}
