//! The TCP stream under lettre: our own socket (TCP_NODELAY, keepalive, a
//! user timeout), counting reads so that we know whether "." went out, and
//! implicit TLS on top of it for `smtps://`.

use std::{
    fmt, io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use lettre::transport::smtp::{
    client::{AsyncTokioStream, TlsParameters},
    Error as SmtpError,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
};

/// Tunes a fresh relay connection: no Nagle (lettre writes the body and the
/// final "." separately: ~40 ms per mail with Nagle on), keepalive probes
/// while it idles in the pool, and `TCP_USER_TIMEOUT`, so that a silent
/// network (packets dropped, no reset) breaks the connection within `timeout`
/// instead of the kernel's quarter of an hour.
pub(super) fn tune(tcp: &TcpStream, timeout: Duration) -> io::Result<()> {
    tcp.set_nodelay(true)?;
    let socket = socket2::SockRef::from(tcp);
    // The kernel counts keepalive times in whole seconds, at least one.
    let seconds = |d: Duration| Duration::from_secs(d.as_secs().max(1));
    let idle = seconds(timeout / 2);
    socket.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(idle)
            .with_interval(seconds(idle / 3))
            .with_retries(3),
    )?;
    socket.set_tcp_user_timeout(Some(timeout))
}

/// Reads made on a connection: lettre writes the whole content and the final
/// "." and only then reads the reply, so a read after the end of data began
/// proves that "." was written. That is how a failure after "." (the relay may
/// have the mail) is told apart from a drop during the body, with or without
/// TLS on top.
#[derive(Debug, Clone, Default)]
pub(super) struct ReadCount(Arc<AtomicU64>);

/// Writes go straight to `self.inner`: the wrappers here only watch reads or
/// name the peer.
macro_rules! forward_writes {
    ($wrapper:ty) => {
        impl AsyncWrite for $wrapper {
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

            fn poll_shutdown(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<io::Result<()>> {
                Pin::new(&mut self.inner).poll_shutdown(cx)
            }
        }
    };
}

impl ReadCount {
    pub(super) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Debug)]
pub(super) struct TrackedStream {
    inner: TcpStream,
    reads: ReadCount,
}

impl TrackedStream {
    pub(super) fn new(inner: TcpStream, reads: ReadCount) -> Self {
        TrackedStream { inner, reads }
    }
}

impl AsyncRead for TrackedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.reads.0.fetch_add(1, Ordering::Relaxed);
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

forward_writes!(TrackedStream);

impl AsyncTokioStream for TrackedStream {
    fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.inner.peer_addr()
    }
}

/// Implicit TLS (`smtps://`) over our own socket, using lettre's TLS setup:
/// lettre's connection API only accepts a stream it then reads the greeting
/// from, so the TLS layer must already be there.
pub(super) struct TlsOverTcp {
    inner: Compat,
}

#[allow(deprecated)]
type Compat = tokio_util::compat::Compat<lettre::transport::smtp::client::AsyncNetworkStream>;

impl fmt::Debug for TlsOverTcp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TlsOverTcp")
    }
}

#[allow(deprecated)]
pub(super) async fn implicit_tls(
    tcp: TrackedStream,
    params: TlsParameters,
) -> Result<TlsOverTcp, SmtpError> {
    use lettre::transport::smtp::client::AsyncNetworkStream;
    use tokio_util::compat::FuturesAsyncReadCompatExt;
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

forward_writes!(TlsOverTcp);

impl AsyncTokioStream for TlsOverTcp {
    fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.inner.get_ref().peer_addr()
    }
}
