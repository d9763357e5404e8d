//! The inbound SMTP listener for the bounce domain: it receives the delivery
//! reports (bounces, complaints) that remote servers send back after the
//! relay's 250, and hands each message to a [`ReportSink`], which commits it.
//!
//! It faces the internet, so every byte is hostile and every resource is
//! bounded:
//! - no relaying: a recipient must be at the bounce domain (`550 5.7.1`
//!   otherwise), and its address is only recorded, never used;
//! - memory: a fixed read buffer, a command line of at most
//!   [`MAX_COMMAND_LINE`] octets, a message of at most `max_message_size`
//!   (past it the data is counted and dropped, never kept);
//! - time: `timeout` on every read, write and sink call, `session_limit` on
//!   the whole connection;
//! - connections: at most `max_connections`, the next one gets `421` at once;
//! - errors: a client is cut off after [`MAX_ERRORS`] bad commands;
//! - STARTTLS: bytes pipelined behind `STARTTLS` in the clear are dropped, so
//!   they can never pass for commands sent over TLS (the CVE-2011-0411 class
//!   of command injection), and the session starts over after the handshake.
//!
//! A `250` after DATA means the sink has committed the report: a sink that
//! cannot (the database is away) makes it `451 4.3.0` and the sender tries
//! again later.

use std::{
    fmt, io,
    io::Write as _,
    net::SocketAddr,
    path::Path,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use async_trait::async_trait;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::Semaphore,
    task::{JoinError, JoinSet},
    time::{timeout_at, Instant},
};
use tokio_rustls::{server::TlsStream, TlsAcceptor};
use tokio_util::sync::CancellationToken;

/// The rustls under lettre and this listener, for naming its `ServerConfig`.
pub use tokio_rustls::rustls;

/// `inbound.max_message_size`'s default: "10MB".
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 10_000_000;
/// `inbound.max_connections`'s default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// The wait for each command, DATA line or reply write: RFC 5321's five
/// minutes for a server.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// The whole connection: room for a 10 MB report over a slow link.
pub const DEFAULT_SESSION_LIMIT: Duration = Duration::from_secs(1800);

/// The longest command line accepted, its line end included (RFC 5321 asks
/// for 512; extensions' parameters make room for more).
pub const MAX_COMMAND_LINE: usize = 2048;
/// Recipients in one transaction; the next gets `452 4.5.3`.
pub const MAX_RECIPIENTS: usize = 100;
/// Bad commands a client may send before it is cut off.
pub const MAX_ERRORS: u32 = 10;
/// RFC 5321's longest path (an address between `<` and `>`).
const MAX_PATH: usize = 256;
/// The fixed read buffer of a connection: longer than a command line, so an
/// over-long one is always seen as such.
const READ_BUFFER: usize = 8 * 1024;
/// How long `serve` lets transactions in flight finish once cancelled.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// The pause after an accept failure such as EMFILE, so that the loop does
/// not spin while descriptors are short.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// The longest wait for the last reply and the close after a session ends.
const CLOSING_WRITE: Duration = Duration::from_secs(2);
/// The longest refusal reason a sink may put after `554 5.6.0`.
const MAX_REASON: usize = 200;

/// What the listener needs to know; [`InboundOptions::new`] gives the
/// defaults of the `[inbound]` settings.
#[derive(Clone, Debug)]
pub struct InboundOptions {
    /// `bounce.domain`, lower-case: the only domain mail is accepted for.
    pub domain: String,
    /// The largest message, after dot-unstuffing, line ends counted as CRLF.
    pub max_message_size: usize,
    /// Sessions open at once; the next connection gets `421 4.3.2`.
    pub max_connections: usize,
    /// The wait for each command, each read of DATA, each reply write and the
    /// sink's answer.
    pub timeout: Duration,
    /// The whole connection.
    pub session_limit: Duration,
    /// STARTTLS is offered when set.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// This server's name in the greeting and the EHLO reply.
    pub hostname: String,
}

impl InboundOptions {
    /// The defaults for `domain`, without TLS.
    pub fn new(domain: &str, hostname: &str) -> InboundOptions {
        InboundOptions {
            domain: domain.to_ascii_lowercase(),
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            timeout: DEFAULT_TIMEOUT,
            session_limit: DEFAULT_SESSION_LIMIT,
            tls: None,
            hostname: hostname.to_string(),
        }
    }
}

/// The envelope of one received message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// The MAIL FROM address as given (a source route dropped); empty for the
    /// null sender `<>` of bounces.
    pub mail_from: String,
    /// The recipients, each `local@domain` with the configured bounce domain,
    /// lower-cased, without repeats.
    pub recipients: Vec<String>,
    /// The client's address.
    pub peer: SocketAddr,
    /// Whether the message came over STARTTLS.
    pub tls: bool,
}

/// Why a sink did not take a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `451 4.3.0`: the database is away, the sender should try again later.
    Unavailable,
    /// `554 5.6.0` and the reason: a refusal on purpose. Never for a report
    /// that cannot be parsed: that one is recorded all the same.
    Rejected(String),
}

/// Where received reports go.
#[async_trait]
pub trait ReportSink: Send + Sync + 'static {
    /// One message received: its envelope recipients (all @domain,
    /// lower-cased), the MAIL FROM (may be empty: the null sender of
    /// bounces), and the message bytes as received (dot-unstuffed, CRLF line
    /// ends). `Ok` only once the report is committed: the client is told
    /// `250` and will not send it again.
    async fn deliver(&self, envelope: Envelope, message: Vec<u8>) -> Result<(), Refusal>;
}

/// Reads `inbound.tls_cert_file` (the PEM certificate chain, leaf first) and
/// `inbound.tls_key_file` (an unencrypted PKCS#8, RSA or SEC1 PEM key) into a
/// server configuration with the ring provider, TLS 1.2 and 1.3. Each error
/// names the file it is about.
pub fn load_tls(cert_file: &Path, key_file: &Path) -> Result<Arc<rustls::ServerConfig>, String> {
    use rustls::pki_types::{
        pem::{self, PemObject},
        CertificateDer, PrivateKeyDer,
    };

    let chain = CertificateDer::pem_file_iter(cert_file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{}: {e}", cert_file.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "{}: no PEM CERTIFICATE in the file",
            cert_file.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| match e {
        pem::Error::NoItemsFound => format!(
            "{}: no unencrypted PEM private key (PKCS#8, RSA or SEC1) in the file",
            key_file.display()
        ),
        e => format!("{}: {e}", key_file.display()),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| format!("TLS versions: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("{} and {}: {e}", cert_file.display(), key_file.display()))?;
    Ok(Arc::new(config))
}

/// Accepts connections on `listener` until `cancel`, one session each, at
/// most `max_connections` at once. Once cancelled it stops accepting, sessions
/// waiting for a command are told `421 4.3.2` and closed, transactions in
/// flight get a few seconds to finish, and the rest are cut.
pub async fn serve(
    listener: TcpListener,
    options: InboundOptions,
    sink: Arc<dyn ReportSink>,
    cancel: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(
        options.max_connections.min(Semaphore::MAX_PERMITS),
    ));
    let shared = Arc::new(Shared::new(options, sink, cancel.clone()));
    let mut sessions = JoinSet::new();
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            Some(ended) = sessions.join_next(), if !sessions.is_empty() => session_ended(ended),
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => match Arc::clone(&permits).try_acquire_owned() {
                    Ok(permit) => {
                        let shared = Arc::clone(&shared);
                        sessions.spawn(async move {
                            session(stream, peer, shared).await;
                            drop(permit);
                        });
                    }
                    Err(_) => refuse_busy(stream, peer),
                },
                Err(e) => accept_failed(e, &cancel).await,
            },
        }
    }
    drop(listener);
    let grace = Instant::now() + SHUTDOWN_GRACE;
    while let Ok(Some(ended)) = timeout_at(grace, sessions.join_next()).await {
        session_ended(ended);
    }
    if !sessions.is_empty() {
        tracing::debug!(
            open = sessions.len(),
            "inbound sessions still open after the grace period are cut"
        );
        sessions.shutdown().await;
    }
}

/// A session task's end: only a panic is news (the session logs the rest).
fn session_ended(ended: Result<(), JoinError>) {
    if let Err(e) = ended {
        if e.is_panic() {
            tracing::error!("inbound session panicked");
        }
    }
}

/// A connection beyond `max_connections`: `421` and closed, with no task:
/// a fresh socket's send buffer is empty, so one non-blocking write sends it.
fn refuse_busy(stream: TcpStream, peer: SocketAddr) {
    match stream.into_std() {
        Ok(stream) => {
            let _ = (&stream).write(b"421 4.3.2 too busy\r\n");
        }
        Err(e) => tracing::debug!(%peer, error = %e, "inbound connection refused"),
    }
    tracing::debug!(%peer, "inbound connection refused: too busy");
}

/// An accept failure. One connection's (reset before it was taken) is passed
/// over; anything else, such as EMFILE, gets a short pause first.
async fn accept_failed(e: io::Error, cancel: &CancellationToken) {
    use io::ErrorKind::*;
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock
    ) {
        tracing::debug!(error = %e, "inbound accept failed");
        return;
    }
    tracing::warn!(error = %e, "inbound accept failed; pausing");
    tokio::select! {
        () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
        () = cancel.cancelled() => {}
    }
}

/// What every session shares: the options, normalised once.
struct Shared {
    /// The bounce domain as recipients are recorded: lower-case, no trailing
    /// dot.
    domain: String,
    /// The same as ASCII (IDNA), for comparing with what clients send.
    domain_ascii: String,
    hostname: String,
    max_message_size: usize,
    timeout: Duration,
    session_limit: Duration,
    acceptor: Option<TlsAcceptor>,
    sink: Arc<dyn ReportSink>,
    cancel: CancellationToken,
}

impl Shared {
    fn new(
        options: InboundOptions,
        sink: Arc<dyn ReportSink>,
        cancel: CancellationToken,
    ) -> Shared {
        let domain = options.domain.trim().trim_end_matches('.').to_lowercase();
        let domain_ascii = idna::domain_to_ascii(&domain).unwrap_or_else(|_| domain.clone());
        // The hostname goes into replies: graphic ASCII only.
        let hostname: String = options
            .hostname
            .chars()
            .filter(char::is_ascii_graphic)
            .collect();
        Shared {
            domain,
            domain_ascii,
            hostname: if hostname.is_empty() {
                "localhost".to_string()
            } else {
                hostname
            },
            max_message_size: options.max_message_size,
            timeout: options.timeout,
            session_limit: options.session_limit,
            acceptor: options.tls.map(TlsAcceptor::from),
            sink,
            cancel,
        }
    }

    /// Whether a recipient's domain is the bounce domain: case-insensitive, a
    /// trailing dot ignored, a Unicode domain compared by its ASCII form.
    fn is_our_domain(&self, domain: &str) -> bool {
        let domain = domain.strip_suffix('.').unwrap_or(domain);
        if domain.is_ascii() {
            domain.eq_ignore_ascii_case(&self.domain_ascii)
        } else {
            idna::domain_to_ascii(domain).is_ok_and(|ascii| ascii == self.domain_ascii)
        }
    }
}

/// Why a session ended.
#[derive(Debug)]
enum Stop {
    /// QUIT, answered.
    Quit,
    /// The client closed the connection.
    Closed,
    /// No byte (or no room to write) within `timeout`.
    Timeout,
    /// The connection reached `session_limit`.
    SessionLimit,
    /// `serve` was cancelled while the session waited for a command.
    Shutdown,
    /// [`MAX_ERRORS`] bad commands.
    TooManyErrors,
    /// The STARTTLS handshake failed.
    Tls(io::Error),
    Io(io::Error),
}

impl Stop {
    /// The last word to the client, when it is owed one.
    fn farewell(&self) -> Option<&'static str> {
        match self {
            Stop::Timeout => Some("421 4.4.2 timeout"),
            Stop::SessionLimit => Some("421 4.4.2 session time limit reached"),
            Stop::Shutdown => Some("421 4.3.2 shutting down"),
            Stop::TooManyErrors => Some("421 4.7.0 too many errors"),
            Stop::Quit | Stop::Closed | Stop::Tls(_) | Stop::Io(_) => None,
        }
    }
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::Quit => f.write_str("quit"),
            Stop::Closed => f.write_str("closed by the client"),
            Stop::Timeout => f.write_str("timeout"),
            Stop::SessionLimit => f.write_str("session time limit"),
            Stop::Shutdown => f.write_str("shutting down"),
            Stop::TooManyErrors => f.write_str("too many errors"),
            Stop::Tls(e) => write!(f, "TLS handshake: {e}"),
            Stop::Io(e) => write!(f, "{e}"),
        }
    }
}

/// A session's two clocks: `timeout` for each wait, `session_limit` for the
/// whole connection.
struct Clock {
    timeout: Duration,
    session_end: Instant,
}

impl Clock {
    /// When the next wait must end, and why it would.
    fn deadline(&self) -> (Instant, Stop) {
        let wait = after(self.timeout);
        if wait < self.session_end {
            (wait, Stop::Timeout)
        } else {
            (self.session_end, Stop::SessionLimit)
        }
    }
}

/// `wait` from now; a wait too long for the clock (a setting of years) is
/// as good as forever.
fn after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

/// One command line, or the news that it was too long (and was dropped).
#[derive(Debug, PartialEq, Eq)]
enum Line {
    /// The line without its line end.
    Command(Vec<u8>),
    TooLong,
}

/// The message after DATA.
#[derive(Debug, PartialEq, Eq)]
enum Data {
    Message(Vec<u8>),
    /// Over the limit: counted and dropped.
    TooBig {
        size: usize,
    },
}

/// Bytes read from the client and not yet used: a fixed buffer, which a
/// client cannot make grow.
struct Input {
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
}

impl Input {
    fn new() -> Input {
        Input {
            buf: vec![0; READ_BUFFER].into_boxed_slice(),
            pos: 0,
            end: 0,
        }
    }

    fn pending(&self) -> &[u8] {
        &self.buf[self.pos..self.end]
    }

    fn consume(&mut self, n: usize) {
        self.pos += n;
        if self.pos == self.end {
            self.discard();
        }
    }

    fn discard(&mut self) {
        self.pos = 0;
        self.end = 0;
    }

    /// Reads more bytes behind those pending, waiting until the clock's
    /// deadline, or until `cancel` when given.
    async fn fill<R: AsyncRead + Unpin>(
        &mut self,
        io: &mut R,
        clock: &Clock,
        cancel: Option<&CancellationToken>,
    ) -> Result<(), Stop> {
        if self.pos > 0 {
            self.buf.copy_within(self.pos..self.end, 0);
            self.end -= self.pos;
            self.pos = 0;
        }
        // A client that always has bytes ready never meets a read's
        // deadline: the session's end is checked before each read.
        if Instant::now() >= clock.session_end {
            return Err(Stop::SessionLimit);
        }
        if self.end == self.buf.len() {
            // The readers never leave a full buffer pending; a read into no
            // room would look like the end of the stream.
            return Err(Stop::Io(io::Error::other("read buffer full")));
        }
        let (deadline, late) = clock.deadline();
        let read = timeout_at(deadline, io.read(&mut self.buf[self.end..]));
        let read = match cancel {
            Some(cancel) => tokio::select! {
                biased;
                () = cancel.cancelled() => return Err(Stop::Shutdown),
                read = read => read,
            },
            None => read.await,
        };
        match read {
            Err(_) => Err(late),
            Ok(Ok(0)) => Err(Stop::Closed),
            Ok(Ok(n)) => {
                self.end += n;
                Ok(())
            }
            Ok(Err(e)) => Err(Stop::Io(e)),
        }
    }

    /// The next command line. One longer than [`MAX_COMMAND_LINE`] is read
    /// to its end and dropped, never kept.
    async fn read_command<R: AsyncRead + Unpin>(
        &mut self,
        io: &mut R,
        clock: &Clock,
        cancel: Option<&CancellationToken>,
    ) -> Result<Line, Stop> {
        let mut too_long = false;
        loop {
            let pending = self.pending();
            if let Some(lf) = memchr::memchr(b'\n', pending) {
                if too_long || lf + 1 > MAX_COMMAND_LINE {
                    self.consume(lf + 1);
                    return Ok(Line::TooLong);
                }
                let line = strip_cr(&pending[..lf]).to_vec();
                self.consume(lf + 1);
                return Ok(Line::Command(line));
            }
            if pending.len() >= MAX_COMMAND_LINE {
                too_long = true;
                self.discard();
            }
            self.fill(io, clock, cancel).await?;
        }
    }

    /// The message after `354`, up to the line `.` alone: dot-unstuffed,
    /// each line end (CRLF or a bare LF) made CRLF. Past `limit` bytes are
    /// counted and dropped, so memory never holds more than `limit`; a line
    /// is taken piecewise, so its length is bounded by nothing else.
    async fn read_data<R: AsyncRead + Unpin>(
        &mut self,
        io: &mut R,
        clock: &Clock,
        limit: usize,
    ) -> Result<Data, Stop> {
        let mut message = Message::new(limit);
        let mut line_start = true;
        loop {
            let pending = self.pending();
            if pending.is_empty() {
                self.fill(io, clock, None).await?;
                continue;
            }
            if let Some(lf) = memchr::memchr(b'\n', pending) {
                let mut line = strip_cr(&pending[..lf]);
                if line_start {
                    if line == b"." {
                        self.consume(lf + 1);
                        return Ok(message.finish());
                    }
                    if let [b'.', rest @ ..] = line {
                        line = rest;
                    }
                }
                message.append(line);
                message.append(b"\r\n");
                self.consume(lf + 1);
                line_start = true;
                continue;
            }
            // Part of a line. At its start "." or ".\r" may yet be the end
            // of data: wait for the next byte.
            if line_start && (pending == b"." || pending == b".\r") {
                self.fill(io, clock, None).await?;
                continue;
            }
            let skip = usize::from(line_start && pending[0] == b'.');
            // A CR at the end may be half of a CRLF: keep it for later.
            let take = pending.len() - usize::from(pending.ends_with(b"\r"));
            if take == 0 {
                self.fill(io, clock, None).await?;
                continue;
            }
            message.append(&pending[skip..take]);
            self.consume(take);
            line_start = false;
        }
    }
}

/// A line without the CR of its CRLF.
fn strip_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// A message being received: kept while it fits the limit, only counted
/// after that.
struct Message {
    bytes: Vec<u8>,
    size: usize,
    limit: usize,
}

impl Message {
    fn new(limit: usize) -> Message {
        Message {
            bytes: Vec::new(),
            size: 0,
            limit,
        }
    }

    fn append(&mut self, more: &[u8]) {
        self.size = self.size.saturating_add(more.len());
        if self.size > self.limit {
            // Over: what was kept is freed at once.
            self.bytes = Vec::new();
            return;
        }
        if self.bytes.capacity() - self.bytes.len() < more.len() {
            // Doubling, as Vec would, but never past the limit.
            let want = (self.bytes.capacity().max(4096) * 2)
                .max(self.size)
                .min(self.limit);
            self.bytes.reserve_exact(want - self.bytes.len());
        }
        self.bytes.extend_from_slice(more);
    }

    fn finish(self) -> Data {
        if self.size > self.limit {
            Data::TooBig { size: self.size }
        } else {
            Data::Message(self.bytes)
        }
    }
}

/// The connection under a session: TCP, then TLS after STARTTLS.
enum Transport {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
    /// While the handshake owns the socket, and after it failed.
    Gone,
}

fn gone() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "connection handed over")
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Transport::Gone => Poll::Ready(Err(gone())),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Transport::Gone => Poll::Ready(Err(gone())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Transport::Gone => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Transport::Gone => Poll::Ready(Ok(())),
        }
    }
}

/// What the session does after a command.
enum Next {
    Continue,
    Quit,
}

/// One connection's conversation.
struct Session {
    shared: Arc<Shared>,
    peer: SocketAddr,
    io: Transport,
    input: Input,
    clock: Clock,
    tls: bool,
    /// EHLO or HELO seen (since the connection or the TLS handshake).
    greeted: bool,
    /// MAIL FROM of the open transaction.
    mail_from: Option<String>,
    recipients: Vec<String>,
    errors: u32,
}

/// Runs one connection to its end and closes it.
async fn session(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>) {
    // Replies are small and each is waited for.
    let _ = stream.set_nodelay(true);
    let clock = Clock {
        timeout: shared.timeout,
        session_end: after(shared.session_limit),
    };
    let mut session = Session {
        shared,
        peer,
        io: Transport::Plain(stream),
        input: Input::new(),
        clock,
        tls: false,
        greeted: false,
        mail_from: None,
        recipients: Vec::new(),
        errors: 0,
    };
    let stop = match session.converse().await {
        Ok(()) => Stop::Quit,
        Err(stop) => stop,
    };
    session.close(stop.farewell()).await;
    tracing::debug!(%peer, reason = %stop, "inbound connection closed");
}

impl Session {
    async fn converse(&mut self) -> Result<(), Stop> {
        let greeting = format!("220 {} ESMTP tablemail", self.shared.hostname);
        self.reply(&greeting).await?;
        loop {
            let line = self
                .input
                .read_command(&mut self.io, &self.clock, Some(&self.shared.cancel))
                .await?;
            let next = match line {
                Line::TooLong => self.error("500 5.5.2 line too long").await?,
                Line::Command(line) => self.command(&line).await?,
            };
            if let Next::Quit = next {
                return Ok(());
            }
        }
    }

    /// Sends one reply (multi-line replies carry their inner CRLFs).
    async fn reply(&mut self, text: &str) -> Result<(), Stop> {
        let mut out = Vec::with_capacity(text.len() + 2);
        out.extend_from_slice(text.as_bytes());
        out.extend_from_slice(b"\r\n");
        let (deadline, late) = self.clock.deadline();
        let write = async {
            self.io.write_all(&out).await?;
            self.io.flush().await
        };
        match timeout_at(deadline, write).await {
            Err(_) => Err(late),
            Ok(Err(e)) => Err(Stop::Io(e)),
            Ok(Ok(())) => Ok(()),
        }
    }

    /// Replies to a bad command and counts it; too many end the session.
    async fn error(&mut self, text: &str) -> Result<Next, Stop> {
        self.reply(text).await?;
        self.errors += 1;
        if self.errors >= MAX_ERRORS {
            return Err(Stop::TooManyErrors);
        }
        Ok(Next::Continue)
    }

    async fn ok(&mut self, text: &str) -> Result<Next, Stop> {
        self.reply(text).await?;
        Ok(Next::Continue)
    }

    /// The last reply, if any, and the close (TLS's close_notify included),
    /// each bounded even when the session's time is up.
    async fn close(&mut self, farewell: Option<&str>) {
        let deadline = Instant::now() + self.shared.timeout.min(CLOSING_WRITE);
        let io = &mut self.io;
        let close = async {
            if let Some(text) = farewell {
                io.write_all(text.as_bytes()).await?;
                io.write_all(b"\r\n").await?;
            }
            io.shutdown().await
        };
        let _ = timeout_at(deadline, close).await;
    }

    fn reset(&mut self) {
        self.mail_from = None;
        self.recipients.clear();
    }

    async fn command(&mut self, line: &[u8]) -> Result<Next, Stop> {
        let Ok(line) = std::str::from_utf8(line) else {
            return self.error("500 5.5.2 syntax error").await;
        };
        let line = line.trim_end_matches([' ', '\t']);
        let (verb, arg) = line.split_once(' ').unwrap_or((line, ""));
        let verb = verb.to_ascii_uppercase();
        match verb.as_str() {
            "EHLO" => self.hello(arg, true).await,
            "HELO" => self.hello(arg, false).await,
            "MAIL" => self.mail(arg).await,
            "RCPT" => self.rcpt(arg).await,
            "DATA" => self.data(arg).await,
            "STARTTLS" => self.starttls(arg).await,
            "RSET" => {
                if !arg.is_empty() {
                    return self.error("501 5.5.4 syntax: RSET").await;
                }
                self.reset();
                self.ok("250 2.0.0 OK").await
            }
            "NOOP" => self.ok("250 2.0.0 OK").await,
            "QUIT" => {
                self.reply("221 2.0.0 bye").await?;
                Ok(Next::Quit)
            }
            "VRFY" => {
                if arg.is_empty() {
                    return self.error("501 5.5.4 syntax: VRFY address").await;
                }
                self.ok("252 2.5.0 cannot verify, send the mail").await
            }
            "HELP" => {
                self.ok("214 2.0.0 EHLO HELO MAIL RCPT DATA RSET NOOP QUIT VRFY HELP STARTTLS")
                    .await
            }
            "EXPN" | "AUTH" | "BDAT" | "TURN" | "ETRN" | "ATRN" | "SEND" | "SOML" | "SAML"
            | "XCLIENT" | "XFORWARD" => self.error("502 5.5.1 command not implemented").await,
            _ => self.error("500 5.5.1 command unrecognized").await,
        }
    }

    async fn hello(&mut self, arg: &str, extended: bool) -> Result<Next, Stop> {
        if arg.trim().is_empty() {
            return self.error("501 5.5.4 syntax: EHLO domain").await;
        }
        self.reset();
        self.greeted = true;
        let hostname = &self.shared.hostname;
        if !extended {
            let reply = format!("250 {hostname}");
            return self.ok(&reply).await;
        }
        let size = format!("SIZE {}", self.shared.max_message_size);
        let mut lines = vec![
            hostname.as_str(),
            size.as_str(),
            "8BITMIME",
            "PIPELINING",
            "ENHANCEDSTATUSCODES",
            "SMTPUTF8",
        ];
        if self.shared.acceptor.is_some() && !self.tls {
            lines.push("STARTTLS");
        }
        let last = lines.len() - 1;
        let reply = lines
            .iter()
            .enumerate()
            .map(|(i, line)| format!("250{}{line}", if i == last { ' ' } else { '-' }))
            .collect::<Vec<_>>()
            .join("\r\n");
        self.ok(&reply).await
    }

    async fn mail(&mut self, arg: &str) -> Result<Next, Stop> {
        if !self.greeted {
            return self.error("503 5.5.1 send EHLO or HELO first").await;
        }
        if self.mail_from.is_some() {
            return self.error("503 5.5.1 nested MAIL command").await;
        }
        let Some((path, params)) = strip_keyword(arg, "FROM:").and_then(split_path) else {
            return self.error("501 5.5.4 syntax: MAIL FROM:<address>").await;
        };
        let Some(sender) = reverse_path(path) else {
            return self.error("501 5.1.7 bad sender address syntax").await;
        };
        let mut declared = 0u64;
        for param in params.split(' ').filter(|p| !p.is_empty()) {
            let (key, value) = match param.split_once('=') {
                Some((key, value)) => (key, Some(value)),
                None => (param, None),
            };
            match (key.to_ascii_uppercase().as_str(), value) {
                ("SIZE", Some(value)) => match parse_size(value) {
                    Some(size) => declared = size,
                    None => return self.error("501 5.5.4 syntax: SIZE=octets").await,
                },
                ("BODY", Some(value))
                    if value.eq_ignore_ascii_case("7BIT")
                        || value.eq_ignore_ascii_case("8BITMIME") => {}
                ("SMTPUTF8", None) => {}
                _ => return self.error("555 5.5.4 unsupported parameter").await,
            }
        }
        if declared > self.shared.max_message_size as u64 {
            return self
                .ok("552 5.3.4 message size exceeds fixed maximum message size")
                .await;
        }
        self.mail_from = Some(sender.to_string());
        self.recipients.clear();
        self.ok("250 2.1.0 OK").await
    }

    async fn rcpt(&mut self, arg: &str) -> Result<Next, Stop> {
        if !self.greeted || self.mail_from.is_none() {
            return self.error("503 5.5.1 send MAIL first").await;
        }
        let Some((path, params)) = strip_keyword(arg, "TO:").and_then(split_path) else {
            return self.error("501 5.5.4 syntax: RCPT TO:<address>").await;
        };
        if !params.trim().is_empty() {
            return self.error("555 5.5.4 unsupported parameter").await;
        }
        // A source route asks for relaying by definition.
        if path.starts_with('@') {
            return self.error("550 5.7.1 relaying denied").await;
        }
        let local = if path.eq_ignore_ascii_case("postmaster") {
            // RFC 5321 4.5.1: "Postmaster" without a domain is this server's.
            "postmaster"
        } else {
            let Some((local, domain)) = split_mailbox(path) else {
                return self.error("501 5.1.3 bad recipient address syntax").await;
            };
            if !self.shared.is_our_domain(domain) {
                return self.error("550 5.7.1 relaying denied").await;
            }
            local
        };
        let recipient = format!("{}@{}", local.to_lowercase(), self.shared.domain);
        if !self.recipients.contains(&recipient) {
            if self.recipients.len() >= MAX_RECIPIENTS {
                return self.ok("452 4.5.3 too many recipients").await;
            }
            self.recipients.push(recipient);
        }
        self.ok("250 2.1.5 OK").await
    }

    async fn data(&mut self, arg: &str) -> Result<Next, Stop> {
        if !arg.is_empty() {
            return self.error("501 5.5.4 syntax: DATA").await;
        }
        if !self.greeted || self.mail_from.is_none() {
            return self.error("503 5.5.1 send MAIL first").await;
        }
        if self.recipients.is_empty() {
            return self.error("503 5.5.1 send RCPT first").await;
        }
        self.reply("354 end data with <CR><LF>.<CR><LF>").await?;
        let data = self
            .input
            .read_data(&mut self.io, &self.clock, self.shared.max_message_size)
            .await?;
        let mail_from = self.mail_from.take().unwrap_or_default();
        let recipients = std::mem::take(&mut self.recipients);
        let message = match data {
            Data::Message(message) => message,
            Data::TooBig { size } => {
                tracing::debug!(peer = %self.peer, size, "inbound message over the size limit dropped");
                return self.ok("552 5.3.4 message too big").await;
            }
        };
        let size = message.len();
        let count = recipients.len();
        let envelope = Envelope {
            mail_from,
            recipients,
            peer: self.peer,
            tls: self.tls,
        };
        let (deadline, _) = self.clock.deadline();
        let delivered = timeout_at(deadline, self.shared.sink.deliver(envelope, message)).await;
        let (reply, outcome) = match delivered {
            Ok(Ok(())) => ("250 2.0.0 OK report received".to_string(), "committed"),
            Ok(Err(Refusal::Unavailable)) => {
                ("451 4.3.0 try again later".to_string(), "unavailable")
            }
            Err(_) => ("451 4.3.0 try again later".to_string(), "sink timeout"),
            Ok(Err(Refusal::Rejected(reason))) => {
                (format!("554 5.6.0 {}", reply_text(&reason)), "rejected")
            }
        };
        tracing::info!(
            size,
            recipients = count,
            peer = %self.peer,
            tls = self.tls,
            outcome,
            "inbound report received"
        );
        self.ok(&reply).await
    }

    async fn starttls(&mut self, arg: &str) -> Result<Next, Stop> {
        let Some(acceptor) = self.shared.acceptor.clone() else {
            return self.error("502 5.5.1 command not implemented").await;
        };
        if self.tls {
            return self.error("503 5.5.1 TLS already active").await;
        }
        if !arg.is_empty() {
            return self.error("501 5.5.4 syntax: STARTTLS").await;
        }
        if !self.greeted {
            return self.error("503 5.5.1 send EHLO first").await;
        }
        if self.mail_from.is_some() {
            return self.error("503 5.5.1 mail transaction in progress").await;
        }
        // Whatever followed STARTTLS in the clear must never pass for
        // commands sent over TLS (CVE-2011-0411): dropped unread.
        if !self.input.pending().is_empty() {
            tracing::debug!(peer = %self.peer, "inbound: bytes pipelined after STARTTLS dropped");
            self.input.discard();
        }
        self.reply("220 2.0.0 ready to start TLS").await?;
        let Transport::Plain(tcp) = std::mem::replace(&mut self.io, Transport::Gone) else {
            return Err(Stop::Io(gone()));
        };
        let (deadline, late) = self.clock.deadline();
        match timeout_at(deadline, acceptor.accept(tcp)).await {
            Err(_) => Err(late),
            Ok(Err(e)) => Err(Stop::Tls(e)),
            Ok(Ok(tls)) => {
                self.io = Transport::Tls(Box::new(tls));
                self.tls = true;
                // RFC 3207: the client starts over with EHLO.
                self.greeted = false;
                self.reset();
                Ok(Next::Continue)
            }
        }
    }
}

/// `arg` after a case-insensitive keyword such as `FROM:`, spaces after it
/// allowed.
fn strip_keyword<'a>(arg: &'a str, keyword: &str) -> Option<&'a str> {
    let head = arg.get(..keyword.len())?;
    head.eq_ignore_ascii_case(keyword)
        .then(|| arg[keyword.len()..].trim_start_matches(' '))
}

/// `<path> parameters` into the path between the brackets and the
/// parameters; a `>` inside a quoted local part does not close the path.
fn split_path(arg: &str) -> Option<(&str, &str)> {
    let inner = arg.strip_prefix('<')?;
    let bytes = inner.as_bytes();
    let mut quoted = false;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'\\' if quoted => i += 1,
            b'"' => quoted = !quoted,
            b'>' if !quoted => break,
            _ => {}
        }
        i += 1;
    }
    if i >= bytes.len() {
        return None;
    }
    let (path, params) = (&inner[..i], &inner[i + 1..]);
    (params.is_empty() || params.starts_with(' ')).then_some((path, params))
}

/// MAIL FROM's path: empty for `<>`, else a mailbox, a source route in front
/// dropped (RFC 5321 asks servers to ignore it).
fn reverse_path(path: &str) -> Option<&str> {
    if path.is_empty() {
        return Some("");
    }
    let mailbox = match path.strip_prefix('@') {
        Some(route) => &route[route.find(':')? + 1..],
        None => path,
    };
    split_mailbox(mailbox).map(|_| mailbox)
}

/// A mailbox's local part and domain, checked as far as this listener needs:
/// at most a path's length, no control characters, an `@` with something on
/// each side, no specials in an unquoted local part, no spaces in the domain.
fn split_mailbox(mailbox: &str) -> Option<(&str, &str)> {
    if mailbox.len() > MAX_PATH || mailbox.chars().any(char::is_control) {
        return None;
    }
    let at = if mailbox.starts_with('"') {
        let bytes = mailbox.as_bytes();
        let mut i = 1;
        loop {
            match bytes.get(i)? {
                b'\\' => i += 2,
                b'"' => break,
                _ => i += 1,
            }
        }
        (bytes.get(i + 1) == Some(&b'@')).then_some(i + 1)?
    } else {
        let at = mailbox.find('@')?;
        if mailbox[..at].contains([' ', '"', '(', ')', ',', ':', ';', '<', '>', '[', ']', '\\']) {
            return None;
        }
        at
    };
    let (local, domain) = (&mailbox[..at], &mailbox[at + 1..]);
    (!local.is_empty() && !domain.is_empty() && !domain.contains(' ')).then_some((local, domain))
}

/// SIZE='s value: digits only; one too large for u64 is as good as too big.
fn parse_size(value: &str) -> Option<u64> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(value.parse().unwrap_or(u64::MAX))
}

/// A sink's reason made fit for a reply line: printable ASCII, bounded.
fn reply_text(reason: &str) -> String {
    let text: String = reason
        .chars()
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c
            } else {
                '?'
            }
        })
        .take(MAX_REASON)
        .collect();
    if text.trim().is_empty() {
        "rejected".to_string()
    } else {
        text
    }
}

#[cfg(test)]
mod tests;
