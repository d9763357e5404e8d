//! A listener that bounds what HTTP clients can hold: at most
//! [`MAX_CONNECTIONS`] open at once (more wait in the kernel's backlog), each
//! closed after [`MAX_LIFETIME`]. A client that opens connections and sends
//! nothing (slowloris) can then take the console's and the probes' slots for
//! a while, never the daemon's file descriptors or memory; mail goes on.

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Sleep,
};

/// HTTP connections open at once.
pub const MAX_CONNECTIONS: usize = 64;
/// How long one connection may stay open (a scraper's keep-alive connection
/// is simply opened again).
pub const MAX_LIFETIME: Duration = Duration::from_secs(60);

/// [`TcpListener`] with the bounds above.
pub struct Limited {
    inner: TcpListener,
    slots: Arc<Semaphore>,
}

impl Limited {
    pub fn new(inner: TcpListener) -> Limited {
        Limited {
            inner,
            slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
        }
    }
}

impl axum::serve::Listener for Limited {
    type Io = Bounded;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Bounded, std::net::SocketAddr) {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        let stream = Bounded {
            stream,
            _slot: slot,
            expires: Box::pin(tokio::time::sleep(MAX_LIFETIME)),
        };
        (stream, addr)
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection holding its slot until it is dropped, and ending at its
/// deadline: reads see the end of the stream, writes fail.
pub struct Bounded {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    expires: Pin<Box<Sleep>>,
}

impl Bounded {
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.expires.as_mut().poll(cx).is_ready()
    }
}

impl AsyncRead for Bounded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.expired(cx) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Bounded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.expired(cx) {
            return Poll::Ready(Err(io::ErrorKind::TimedOut.into()));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;

    #[tokio::test]
    async fn connections_past_the_cap_wait_for_a_slot() {
        let mut listener = Limited::new(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let addr = listener.local_addr().unwrap();
        let mut clients = Vec::new();
        let mut accepted = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            clients.push(TcpStream::connect(addr).await.unwrap());
            accepted.push(listener.accept().await.0);
        }
        clients.push(TcpStream::connect(addr).await.unwrap());
        let next = tokio::time::timeout(Duration::from_millis(100), listener.accept()).await;
        assert!(next.is_err(), "a connection past the cap was accepted");
        accepted.pop();
        let next = tokio::time::timeout(Duration::from_secs(5), listener.accept()).await;
        assert!(next.is_ok(), "a freed slot takes the waiting connection");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_ends_at_its_deadline() {
        use tokio::io::AsyncReadExt;
        let mut listener = Limited::new(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let addr = listener.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (mut server, _) = listener.accept().await;
        let mut buf = [0u8; 16];
        // The client sends nothing: the read ends at the deadline.
        let n = server.read(&mut buf).await.unwrap();
        assert_eq!(n, 0);
    }
}
