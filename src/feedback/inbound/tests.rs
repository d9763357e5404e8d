//! The listener driven over loopback sockets: a fake sink that records what
//! it got, a raw client speaking SMTP line by line, lettre's own client, and
//! a rustls client over STARTTLS with a certificate made at test time.

use std::{
    collections::VecDeque,
    path::PathBuf,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Mutex,
    },
};

use proptest::prelude::*;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    task::JoinHandle,
    time::timeout,
};

use super::*;

/// The longest any test waits for one thing before it fails.
const WAIT: Duration = Duration::from_secs(10);
const DOMAIN: &str = "bounce.example";

/// Records every delivery and answers from a script (`Ok` once it runs out).
#[derive(Default)]
struct FakeSink {
    got: Mutex<Vec<(Envelope, Vec<u8>)>>,
    answers: Mutex<VecDeque<Result<(), Refusal>>>,
}

impl FakeSink {
    fn answering(answers: impl IntoIterator<Item = Result<(), Refusal>>) -> Arc<FakeSink> {
        Arc::new(FakeSink {
            got: Mutex::default(),
            answers: Mutex::new(answers.into_iter().collect()),
        })
    }

    fn got(&self) -> Vec<(Envelope, Vec<u8>)> {
        self.got.lock().unwrap().clone()
    }
}

#[async_trait]
impl ReportSink for FakeSink {
    async fn deliver(&self, envelope: Envelope, message: Vec<u8>) -> Result<(), Refusal> {
        self.got.lock().unwrap().push((envelope, message));
        self.answers.lock().unwrap().pop_front().unwrap_or(Ok(()))
    }
}

fn options() -> InboundOptions {
    InboundOptions {
        max_message_size: 4096,
        max_connections: 8,
        timeout: WAIT,
        session_limit: Duration::from_secs(60),
        ..InboundOptions::new(DOMAIN, "mx.test")
    }
}

struct Server {
    addr: SocketAddr,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

async fn start(options: InboundOptions, sink: Arc<FakeSink>) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cancel = CancellationToken::new();
    let task = tokio::spawn(serve(listener, options, sink, cancel.clone()));
    Server { addr, cancel, task }
}

impl Server {
    async fn stop(self) {
        self.cancel.cancel();
        timeout(WAIT, self.task)
            .await
            .expect("serve returns once cancelled")
            .unwrap();
    }
}

/// A client that reads and writes raw SMTP lines.
struct Client<S> {
    io: BufReader<S>,
}

impl Client<TcpStream> {
    async fn connect(addr: SocketAddr) -> Client<TcpStream> {
        let stream = timeout(WAIT, TcpStream::connect(addr))
            .await
            .unwrap()
            .unwrap();
        Client {
            io: BufReader::new(stream),
        }
    }

    /// Connects and reads the greeting.
    async fn greeted(addr: SocketAddr) -> Client<TcpStream> {
        let mut client = Client::connect(addr).await;
        assert_eq!(client.reply().await, "220 mx.test ESMTP tablemail\r\n");
        client
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Client<S> {
    async fn send(&mut self, bytes: impl AsRef<[u8]>) {
        timeout(WAIT, self.io.get_mut().write_all(bytes.as_ref()))
            .await
            .expect("the server reads in time")
            .unwrap();
    }

    /// The next line; `None` at the end of the stream.
    async fn line(&mut self) -> Option<String> {
        let mut line = Vec::new();
        match timeout(WAIT, self.io.read_until(b'\n', &mut line))
            .await
            .expect("a line or the end in time")
        {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(String::from_utf8(line).unwrap()),
        }
    }

    /// One whole reply, its lines as sent.
    async fn reply(&mut self) -> String {
        let mut text = String::new();
        loop {
            let line = self.line().await.expect("a reply, not the end");
            assert!(line.ends_with("\r\n"), "{line:?}");
            text.push_str(&line);
            if line.as_bytes().get(3) != Some(&b'-') {
                return text;
            }
        }
    }

    async fn command(&mut self, line: &str) -> String {
        self.send(format!("{line}\r\n")).await;
        self.reply().await
    }

    /// Sends `line` and checks that the reply starts with `start`.
    async fn expect(&mut self, line: &str, start: &str) -> String {
        let reply = self.command(line).await;
        assert!(reply.starts_with(start), "{line:?} got {reply:?}");
        reply
    }

    async fn closed(&mut self) {
        assert_eq!(self.line().await, None, "the server closes");
    }
}

/// Sends one message in a session already greeted.
async fn transaction<S: AsyncRead + AsyncWrite + Unpin>(
    client: &mut Client<S>,
    data: &str,
) -> String {
    client.expect("MAIL FROM:<>", "250 2.1.0").await;
    client
        .expect("RCPT TO:<report@bounce.example>", "250 2.1.5")
        .await;
    client.expect("DATA", "354 ").await;
    client.send(data).await;
    client.reply().await
}

#[tokio::test]
async fn a_pipelined_transaction_is_delivered_once_with_the_bytes_as_sent() {
    let sink = FakeSink::answering([]);
    let server = start(options(), sink.clone()).await;
    let mut client = Client::greeted(server.addr).await;

    let ehlo = client
        .expect("EHLO client.example", "250-mx.test\r\n")
        .await;
    for word in [
        "SIZE 4096",
        "8BITMIME",
        "PIPELINING",
        "ENHANCEDSTATUSCODES",
        "SMTPUTF8",
    ] {
        assert!(ehlo.contains(word), "{word} in {ehlo:?}");
    }
    for word in ["STARTTLS", "AUTH", "CHUNKING"] {
        assert!(!ehlo.contains(word), "{word} in {ehlo:?}");
    }

    client
        .send(
            "MAIL FROM:<>\r\nRCPT TO:<Bounce+1@Bounce.Example>\r\n\
             RCPT TO: <b+2@bounce.example.>\r\nRCPT TO:<bounce+1@bounce.example>\r\nDATA\r\n",
        )
        .await;
    for start in ["250 2.1.0", "250 2.1.5", "250 2.1.5", "250 2.1.5", "354 "] {
        let reply = client.reply().await;
        assert!(reply.starts_with(start), "{reply:?}");
    }
    client
        .send("Subject: report\r\n\r\n..leading dot\r\nbare lf\n..\r\n...\r\nlast\r\n.\r\n")
        .await;
    assert!(client.reply().await.starts_with("250 2.0.0"));
    client.expect("QUIT", "221 ").await;
    client.closed().await;

    let got = sink.got();
    assert_eq!(got.len(), 1);
    let (envelope, message) = &got[0];
    assert_eq!(envelope.mail_from, "");
    assert_eq!(
        envelope.recipients,
        ["bounce+1@bounce.example", "b+2@bounce.example"]
    );
    assert!(!envelope.tls);
    assert!(envelope.peer.ip().is_loopback());
    assert_eq!(
        message.as_slice(),
        b"Subject: report\r\n\r\n.leading dot\r\nbare lf\r\n.\r\n..\r\nlast\r\n"
    );
    server.stop().await;
}

#[tokio::test]
async fn other_domains_are_relaying_denied() {
    let sink = FakeSink::answering([]);
    let server = start(options(), sink.clone()).await;
    let mut client = Client::greeted(server.addr).await;
    client.expect("EHLO client.example", "250-").await;
    client
        .expect("MAIL FROM:<sender@remote.example>", "250 2.1.0")
        .await;
    for path in [
        "<user@other.example>",
        "<user@bounce.example.evil>",
        "<user@sub.bounce.example>",
        "<@bounce.example:user@bounce.example>",
        "<user@[127.0.0.1]>",
        "<user@bounce.example@other.example>",
        "<\"user@bounce.example\"@other.example>",
    ] {
        client
            .expect(&format!("RCPT TO:{path}"), "550 5.7.1 relaying denied")
            .await;
    }
    client.expect("DATA", "503 5.5.1").await;
    client
        .expect("RCPT TO:<\"Quoted Name\"@BOUNCE.example>", "250 2.1.5")
        .await;
    client.expect("RCPT TO:<Postmaster>", "250 2.1.5").await;
    client.expect("DATA", "354 ").await;
    client.send("\r\n.\r\n").await;
    assert!(client.reply().await.starts_with("250 2.0.0"));

    let got = sink.got();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0.mail_from, "sender@remote.example");
    assert_eq!(
        got[0].0.recipients,
        [
            "\"quoted name\"@bounce.example",
            "postmaster@bounce.example"
        ]
    );
    server.stop().await;
}

#[tokio::test]
async fn the_sinks_answer_is_the_reply_after_data() {
    let sink = FakeSink::answering([
        Err(Refusal::Unavailable),
        Err(Refusal::Rejected("no thanks\r\n250 fake".to_string())),
        Ok(()),
    ]);
    let server = start(options(), sink.clone()).await;
    let mut client = Client::greeted(server.addr).await;
    client.expect("HELO client.example", "250 mx.test").await;

    let data = "Subject: bounce\r\n\r\nbody\r\n.\r\n";
    assert_eq!(
        transaction(&mut client, data).await,
        "451 4.3.0 try again later\r\n"
    );
    // The reason cannot add a line of its own.
    assert_eq!(
        transaction(&mut client, data).await,
        "554 5.6.0 no thanks??250 fake\r\n"
    );
    assert!(transaction(&mut client, data)
        .await
        .starts_with("250 2.0.0"));

    let got = sink.got();
    assert_eq!(got.len(), 3);
    assert!(got
        .iter()
        .all(|(_, message)| message == b"Subject: bounce\r\n\r\nbody\r\n"));
    server.stop().await;
}

#[tokio::test]
async fn a_declared_size_over_the_limit_is_refused() {
    let sink = FakeSink::answering([]);
    let server = start(options(), sink.clone()).await;
    let mut client = Client::greeted(server.addr).await;
    client.expect("EHLO client.example", "250-").await;
    client.expect("MAIL FROM:<> SIZE=4097", "552 5.3.4").await;
    client
        .expect("MAIL FROM:<> SIZE=99999999999999999999999", "552 5.3.4")
        .await;
    client.expect("MAIL FROM:<> SIZE=12k", "501 5.5.4").await;
    client.expect("MAIL FROM:<> RET=HDRS", "555 5.5.4").await;
    client
        .expect("MAIL FROM:<> BODY=BINARYMIME", "555 5.5.4")
        .await;
    client
        .expect(
            "MAIL FROM:<sender@remote.example> SIZE=4096 BODY=8BITMIME SMTPUTF8",
            "250 2.1.0",
        )
        .await;
    client
        .expect("RCPT TO:<a@bounce.example> NOTIFY=NEVER", "555 5.5.4")
        .await;
    assert!(sink.got().is_empty());
    server.stop().await;
}

#[tokio::test]
async fn data_over_the_limit_is_read_to_its_end_and_refused() {
    let sink = FakeSink::answering([]);
    let server = start(options(), sink.clone()).await;
    let mut client = Client::greeted(server.addr).await;
    client.expect("EHLO client.example", "250-").await;

    // Many lines, then one line of 200 KB with no line end in sight.
    let mut data = "x".repeat(998) + "\r\n";
    data = data.repeat(64);
    data.push_str(&"y".repeat(200_000));
    data.push_str("\r\n.\r\n");
    assert_eq!(
        transaction(&mut client, &data).await,
        "552 5.3.4 message too big\r\n"
    );
    assert!(sink.got().is_empty());

    // The session goes on, and a message of exactly the limit passes.
    client.expect("NOOP", "250 ").await;
    let line = "z".repeat(1022) + "\r\n";
    let exact = line.repeat(4);
    assert_eq!(exact.len(), 4096);
    assert!(transaction(&mut client, &(exact.clone() + ".\r\n"))
        .await
        .starts_with("250 2.0.0"));
    let got = sink.got();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].1, exact.as_bytes());
    server.stop().await;
}

/// Feeds a byte at a time, to take every partial-line path.
struct Trickle<'a>(&'a [u8]);

impl AsyncRead for Trickle<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some((&first, rest)) = self.0.split_first() {
            buf.put_slice(&[first]);
            self.0 = rest;
        }
        Poll::Ready(Ok(()))
    }
}

fn test_clock() -> Clock {
    Clock {
        timeout: WAIT,
        session_end: Instant::now() + WAIT,
    }
}

/// `read_data` on `bytes`, whole or a byte at a time, and what is left.
async fn read_data(bytes: &[u8], limit: usize, trickle: bool) -> (Data, Vec<u8>) {
    let mut input = Input::new();
    let clock = test_clock();
    let (data, mut rest) = if trickle {
        let mut reader = Trickle(bytes);
        let data = input.read_data(&mut reader, &clock, limit).await;
        (data, reader.0.to_vec())
    } else {
        let mut reader = bytes;
        let data = input.read_data(&mut reader, &clock, limit).await;
        (data, reader.to_vec())
    };
    let mut left = input.pending().to_vec();
    left.append(&mut rest);
    (data.expect("the end of data"), left)
}

#[tokio::test]
async fn a_message_never_holds_more_than_the_limit() {
    for trickle in [false, true] {
        let exact = "a".repeat(998) + "\r\n";
        let (data, left) = read_data(
            (exact.repeat(3) + ".\r\nNOOP\r\n").as_bytes(),
            3000,
            trickle,
        )
        .await;
        let Data::Message(message) = data else {
            panic!("a message of exactly the limit passes")
        };
        assert_eq!(message.len(), 3000);
        assert!(message.capacity() <= 3000, "{}", message.capacity());
        assert_eq!(left, b"NOOP\r\n");

        let (data, _) = read_data((exact.repeat(3) + "b\r\n.\r\n").as_bytes(), 3000, trickle).await;
        assert_eq!(data, Data::TooBig { size: 3003 });
        let long = "c".repeat(100_000) + "\n.\n";
        let (data, _) = read_data(long.as_bytes(), 3000, trickle).await;
        assert_eq!(data, Data::TooBig { size: 100_002 });
    }
}

#[tokio::test]
async fn dot_lines_and_line_ends_are_read_the_same_whole_or_piecewise() {
    let sent = b".\r\r\n..\n.x\r\nbare\rcr\r\n\r\n.\r.\r\n.\n";
    let want = b"\r\r\n.\r\nx\r\nbare\rcr\r\n\r\n\r.\r\n";
    for trickle in [false, true] {
        let (data, left) = read_data(sent, 1000, trickle).await;
        assert_eq!(data, Data::Message(want.to_vec()), "trickle {trickle}");
        assert!(left.is_empty());
    }
    // A "." line ends data only as ".\r\n" or ".\n".
    let (data, _) = read_data(b". \r\n.\r\n", 1000, true).await;
    assert_eq!(data, Data::Message(b" \r\n".to_vec()));
}

#[tokio::test]
async fn too_many_connections_get_421() {
    let sink = FakeSink::answering([]);
    let server = start(
        InboundOptions {
            max_connections: 2,
            ..options()
        },
        sink,
    )
    .await;
    let mut first = Client::greeted(server.addr).await;
    let _second = Client::greeted(server.addr).await;
    let mut third = Client::connect(server.addr).await;
    assert_eq!(
        third.line().await.as_deref(),
        Some("421 4.3.2 too busy\r\n")
    );
    third.closed().await;

    // Once a session ends, its place is free again.
    first.expect("QUIT", "221 ").await;
    first.closed().await;
    let deadline = Instant::now() + WAIT;
    loop {
        let mut next = Client::connect(server.addr).await;
        let line = next.line().await.unwrap_or_default();
        if line.starts_with("220 ") {
            break;
        }
        assert!(line.starts_with("421 "), "{line:?}");
        assert!(Instant::now() < deadline, "the place never came free");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.stop().await;
}

#[tokio::test]
async fn commands_out_of_order_get_503() {
    let sink = FakeSink::answering([]);
    let server = start(options(), sink).await;
    let mut client = Client::greeted(server.addr).await;
    client.expect("MAIL FROM:<>", "503 5.5.1").await;
    client
        .expect("RCPT TO:<a@bounce.example>", "503 5.5.1")
        .await;
    client.expect("DATA", "503 5.5.1").await;
    client.expect("STARTTLS", "502 5.5.1").await;
    client.expect("NOOP", "250 ").await;
    client.expect("RSET", "250 ").await;
    client.expect("VRFY someone", "252 ").await;
    client.expect("HELP", "214 ").await;
    client.expect("HELO client.example", "250 mx.test").await;
    client
        .expect("RCPT TO:<a@bounce.example>", "503 5.5.1")
        .await;
    client.expect("MAIL FROM:<>", "250 2.1.0").await;
    client.expect("MAIL FROM:<>", "503 5.5.1").await;
    client.expect("DATA", "503 5.5.1").await;
    client.expect("RSET", "250 ").await;
    client.expect("AUTH PLAIN", "502 5.5.1").await;
    client.expect("EXPN list", "502 5.5.1").await;
    // The tenth bad command is the last.
    client.expect("BDAT 10 LAST", "502 5.5.1").await;
    assert_eq!(
        client.line().await.as_deref(),
        Some("421 4.7.0 too many errors\r\n")
    );
    client.closed().await;
    server.stop().await;
}

#[tokio::test]
async fn over_long_lines_get_500_and_errors_end_the_session() {
    let sink = FakeSink::answering([]);
    let server = start(options(), sink).await;
    let mut client = Client::greeted(server.addr).await;
    // 2,048 octets with the CRLF pass; one more does not.
    let longest = format!("NOOP {}", "x".repeat(MAX_COMMAND_LINE - 7));
    client.expect(&longest, "250 ").await;
    client
        .expect(&format!("{longest}x"), "500 5.5.2 line too long")
        .await;
    client
        .expect(&format!("NOOP {}", "x".repeat(100_000)), "500 5.5.2")
        .await;
    client.expect("NOOP", "250 ").await;
    for _ in 0..7 {
        client.expect("BOGUS", "500 5.5.1").await;
    }
    client.expect("GET / HTTP/1.1", "500 5.5.1").await;
    assert_eq!(
        client.line().await.as_deref(),
        Some("421 4.7.0 too many errors\r\n")
    );
    client.closed().await;
    server.stop().await;
}

#[tokio::test]
async fn a_silent_client_gets_421_after_the_timeout() {
    let sink = FakeSink::answering([]);
    let server = start(
        InboundOptions {
            timeout: Duration::from_millis(300),
            ..options()
        },
        sink.clone(),
    )
    .await;
    // Waiting for a command.
    let mut idle = Client::greeted(server.addr).await;
    assert_eq!(idle.line().await.as_deref(), Some("421 4.4.2 timeout\r\n"));
    idle.closed().await;

    // Waiting in the middle of DATA: nothing is delivered.
    let mut stalled = Client::greeted(server.addr).await;
    stalled.expect("EHLO client.example", "250-").await;
    stalled.expect("MAIL FROM:<>", "250 ").await;
    stalled.expect("RCPT TO:<a@bounce.example>", "250 ").await;
    stalled.expect("DATA", "354 ").await;
    stalled.send("Subject: half a line").await;
    assert_eq!(
        stalled.line().await.as_deref(),
        Some("421 4.4.2 timeout\r\n")
    );
    stalled.closed().await;
    assert!(sink.got().is_empty());
    server.stop().await;
}

#[tokio::test]
async fn a_busy_client_is_cut_at_the_session_limit() {
    let sink = FakeSink::answering([]);
    let server = start(
        InboundOptions {
            session_limit: Duration::from_millis(500),
            ..options()
        },
        sink,
    )
    .await;
    let mut client = Client::greeted(server.addr).await;
    let deadline = Instant::now() + WAIT;
    loop {
        let reply = client.command("NOOP").await;
        if reply == "421 4.4.2 session time limit reached\r\n" {
            break;
        }
        assert_eq!(reply, "250 2.0.0 OK\r\n");
        assert!(Instant::now() < deadline, "never cut");
    }
    client.closed().await;
    server.stop().await;
}

#[tokio::test]
async fn cancelling_closes_idle_sessions_and_returns() {
    let sink = FakeSink::answering([]);
    let server = start(options(), sink).await;
    let mut client = Client::greeted(server.addr).await;
    client.expect("EHLO client.example", "250-").await;
    server.cancel.cancel();
    assert_eq!(
        client.line().await.as_deref(),
        Some("421 4.3.2 shutting down\r\n")
    );
    client.closed().await;
    timeout(WAIT, server.task)
        .await
        .expect("serve returns")
        .unwrap();
}

/// A temporary directory, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A self-signed certificate for CN=localhost and its key, made by openssl.
async fn self_signed() -> (TempDir, PathBuf, PathBuf) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tablemail-inbound-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let made = tokio::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes"])
        .args(["-subj", "/CN=localhost", "-days", "1", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .await
        .expect("openssl runs");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    (TempDir(dir), cert, key)
}

/// Trusts exactly one certificate, whatever its name.
#[derive(Debug)]
struct Pinned {
    cert: Vec<u8>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.cert {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General("not the pinned certificate".into()))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn tls_client(cert_file: &Path) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cert = CertificateDer::from_pem_file(cert_file).unwrap().to_vec();
    let config = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Pinned { cert, provider }))
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

#[tokio::test]
async fn starttls_drops_commands_pipelined_behind_it() {
    let (_dir, cert, key) = self_signed().await;
    let sink = FakeSink::answering([]);
    let server = start(
        InboundOptions {
            tls: Some(load_tls(&cert, &key).unwrap()),
            ..options()
        },
        sink.clone(),
    )
    .await;
    let mut client = Client::greeted(server.addr).await;
    let ehlo = client.expect("EHLO client.example", "250-").await;
    assert!(ehlo.ends_with("250 STARTTLS\r\n"), "{ehlo:?}");
    client.expect("MAIL FROM:<>", "250 ").await;
    client.expect("STARTTLS", "503 5.5.1").await;
    client.expect("RSET", "250 ").await;

    // The injection: commands behind STARTTLS in the same write, in clear.
    client
        .send("STARTTLS\r\nEHLO evil\r\nMAIL FROM:<evil@attacker.example>\r\n")
        .await;
    assert_eq!(client.reply().await, "220 2.0.0 ready to start TLS\r\n");
    let tcp = client.io.into_inner();
    let tls = timeout(
        WAIT,
        tls_client(&cert).connect("localhost".try_into().unwrap(), tcp),
    )
    .await
    .unwrap()
    .expect("the handshake");
    let mut client = Client {
        io: BufReader::new(tls),
    };

    // Over TLS the session starts over: EHLO first, and the injected EHLO
    // and MAIL left no reply and no trace.
    client.expect("MAIL FROM:<>", "503 5.5.1").await;
    let ehlo = client.expect("EHLO client.example", "250-mx.test").await;
    assert!(!ehlo.contains("STARTTLS"), "{ehlo:?}");
    client.expect("STARTTLS", "503 5.5.1").await;
    client.expect("MAIL FROM:<>", "250 2.1.0").await;
    client
        .expect("RCPT TO:<b@bounce.example>", "250 2.1.5")
        .await;
    client.expect("DATA", "354 ").await;
    client.send("Subject: over TLS\r\n\r\n.\r\n").await;
    assert!(client.reply().await.starts_with("250 2.0.0"));
    client.expect("QUIT", "221 ").await;

    let got = sink.got();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0.mail_from, "");
    assert_eq!(got[0].0.recipients, ["b@bounce.example"]);
    assert!(got[0].0.tls);
    assert_eq!(got[0].1, b"Subject: over TLS\r\n\r\n");
    server.stop().await;
}

#[tokio::test]
async fn load_tls_errors_name_the_file() {
    let (dir, cert, key) = self_signed().await;
    let missing = dir.0.join("missing.pem");
    let error = load_tls(&missing, &key).unwrap_err();
    assert!(error.contains("missing.pem"), "{error}");
    // A certificate where the key should be, and the other way round.
    let error = load_tls(&cert, &cert).unwrap_err();
    assert!(error.starts_with(&cert.display().to_string()), "{error}");
    assert!(error.contains("private key"), "{error}");
    let error = load_tls(&key, &key).unwrap_err();
    assert!(error.contains("key.pem: no PEM CERTIFICATE"), "{error}");
    assert!(load_tls(&cert, &key).is_ok());
}

fn lettre_message(to: &str) -> lettre::Message {
    lettre::Message::builder()
        .from("Sender <sender@remote.example>".parse().unwrap())
        .to(to.parse().unwrap())
        .subject("Undelivered mail")
        .body("report\r\n.leading dot\r\n".to_string())
        .unwrap()
}

#[tokio::test]
async fn lettre_sends_through_the_listener() {
    use lettre::{AsyncSmtpTransport, AsyncTransport, Tokio1Executor};
    let sink = FakeSink::answering([]);
    let server = start(options(), sink.clone()).await;
    let transport = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous("127.0.0.1")
        .port(server.addr.port())
        .timeout(Some(WAIT))
        .build();
    transport
        .send(lettre_message("Bounces <B+123@Bounce.Example>"))
        .await
        .unwrap();
    let got = sink.got();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0.mail_from, "sender@remote.example");
    assert_eq!(got[0].0.recipients, ["b+123@bounce.example"]);
    let text = String::from_utf8(got[0].1.clone()).unwrap();
    assert!(text.contains("Subject: Undelivered mail\r\n"), "{text}");
    assert!(
        text.contains("\r\n\r\nreport\r\n.leading dot\r\n"),
        "{text}"
    );
    server.stop().await;
}

#[tokio::test]
async fn lettre_sends_over_starttls() {
    use lettre::{
        transport::smtp::client::{Tls, TlsParameters},
        AsyncSmtpTransport, AsyncTransport, Tokio1Executor,
    };
    let (_dir, cert, key) = self_signed().await;
    let sink = FakeSink::answering([]);
    let server = start(
        InboundOptions {
            tls: Some(load_tls(&cert, &key).unwrap()),
            ..options()
        },
        sink.clone(),
    )
    .await;
    let tls = TlsParameters::builder("localhost".to_string())
        .dangerous_accept_invalid_certs(true)
        // The certificate names localhost in its CN only, which webpki ignores.
        .dangerous_accept_invalid_hostnames(true)
        .build_rustls()
        .unwrap();
    let transport = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous("127.0.0.1")
        .port(server.addr.port())
        .tls(Tls::Required(tls))
        .timeout(Some(WAIT))
        .build();
    transport
        .send(lettre_message("report@bounce.example"))
        .await
        .unwrap();
    let got = sink.got();
    assert_eq!(got.len(), 1);
    assert!(got[0].0.tls);
    server.stop().await;
}

#[test]
fn paths_and_mailboxes() {
    assert_eq!(split_path("<> SIZE=1"), Some(("", " SIZE=1")));
    assert_eq!(split_path("<\"a>b\"@x>"), Some(("\"a>b\"@x", "")));
    assert_eq!(split_path("<a@x>SIZE=1"), None);
    assert_eq!(split_path("a@x"), None);
    assert_eq!(split_path("<a@x"), None);
    assert_eq!(reverse_path("@r1,@r2:a@x"), Some("a@x"));
    assert_eq!(reverse_path("@r1"), None);
    assert_eq!(reverse_path("a b@x"), None);
    assert_eq!(split_mailbox("\"a \\\" b\"@x"), Some(("\"a \\\" b\"", "x")));
    assert_eq!(split_mailbox("a@"), None);
    assert_eq!(split_mailbox("@x"), None);
    assert_eq!(split_mailbox("a\u{0}@x"), None);
    assert_eq!(split_mailbox("\"unclosed@x"), None);
    assert_eq!(split_mailbox(&format!("{}@x", "a".repeat(MAX_PATH))), None);
    assert_eq!(
        split_mailbox("ü@bounce.example"),
        Some(("ü", "bounce.example"))
    );
    assert_eq!(parse_size("0"), Some(0));
    assert_eq!(parse_size("+1"), None);
    assert_eq!(strip_keyword("from: <a@x>", "FROM:"), Some("<a@x>"));
    assert_eq!(strip_keyword("FRO", "FROM:"), None);
}

/// Pieces of a hostile session: noise, and commands that reach deeper.
fn session_bytes() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        4 => proptest::collection::vec(any::<u8>(), 0..64),
        1 => prop_oneof![
            Just(b"EHLO x\r\n".to_vec()),
            Just(b"MAIL FROM:<>\r\n".to_vec()),
            Just(b"MAIL FROM:<a@b> SIZE=10 BODY=8BITMIME\r\n".to_vec()),
            Just(b"RCPT TO:<a@bounce.example>\r\n".to_vec()),
            Just(b"DATA\r\n".to_vec()),
            Just(b".\r\n".to_vec()),
            Just(b"..\n".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b"RSET\r\n".to_vec()),
            Just(b"STARTTLS\r\n".to_vec()),
            Just(vec![b'x'; 3000]),
        ],
    ];
    proptest::collection::vec(piece, 0..48).prop_map(|pieces| pieces.concat())
}

/// Runs one session on `bytes` from a client that then closes its side.
/// Returns what the client read, and whether it ended in an error (a reset).
async fn hostile_session(bytes: Vec<u8>) -> (Vec<u8>, bool) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (server, peer) = listener.accept().await.unwrap();
    let shared = Arc::new(Shared::new(
        InboundOptions {
            max_message_size: 256,
            timeout: Duration::from_secs(2),
            session_limit: Duration::from_secs(5),
            ..options()
        },
        FakeSink::answering([Err(Refusal::Unavailable)]),
        CancellationToken::new(),
    ));
    let (mut read, mut write) = client.into_split();
    let talk = async move {
        let _ = write.write_all(&bytes).await;
        let _ = write.shutdown().await;
    };
    let listen = async move {
        let mut seen = Vec::new();
        let reset = read.read_to_end(&mut seen).await.is_err();
        (seen, reset)
    };
    // The session runs here, not in a task: a panic fails the case.
    let ((), (), heard) = tokio::join!(session(server, peer, shared), talk, listen);
    heard
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn hostile_bytes_get_replies_or_a_close(bytes in session_bytes()) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (seen, reset) = runtime
            .block_on(async { timeout(WAIT, hostile_session(bytes)).await })
            .expect("the session ends");
        // Every whole line is a reply line; only a reset may cut one short.
        let mut lines = seen.split_inclusive(|&b| b == b'\n').peekable();
        while let Some(line) = lines.next() {
            if lines.peek().is_none() && !line.ends_with(b"\n") {
                prop_assert!(reset, "{:?}", String::from_utf8_lossy(&seen));
                break;
            }
            prop_assert!(line.ends_with(b"\r\n"));
            prop_assert!(line.len() >= 6 && line[..3].iter().all(u8::is_ascii_digit));
            prop_assert!(line[3] == b' ' || line[3] == b'-');
        }
        if !reset && !seen.is_empty() {
            prop_assert!(seen.starts_with(b"220 mx.test ESMTP tablemail\r\n"));
        }
    }

    #[test]
    fn data_reads_the_same_whole_or_a_byte_at_a_time(
        body in proptest::collection::vec(
            prop_oneof![Just(b'.'), Just(b'\r'), Just(b'\n'), Just(b'a')], 0..200),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut sent = body;
        sent.extend_from_slice(b"\r\n.\r\n");
        let whole = runtime.block_on(read_data(&sent, 150, false));
        let trickled = runtime.block_on(read_data(&sent, 150, true));
        prop_assert_eq!(&whole, &trickled);
        if let (Data::Message(message), _) = whole {
            prop_assert!(message.len() <= 150);
            // Line ends come out as CRLF only.
            for (i, &b) in message.iter().enumerate() {
                if b == b'\n' {
                    prop_assert!(i > 0 && message[i - 1] == b'\r');
                }
            }
        }
    }
}
