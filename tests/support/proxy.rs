//! A TCP proxy between the daemon and a server, for faults the real servers
//! cannot produce: `blackhole()` makes every connection open at that moment
//! go silent in both directions (no reset, no close: packets seem to vanish,
//! as with a lost NAT entry or a failed-over address), while new connections
//! work as before; `set_down(true)` also closes every new connection at once
//! (the server is unreachable) until `set_down(false)`; `set_silent(true)`
//! also leaves every new connection unanswered (the server's host stopped
//! answering) until `set_silent(false)`. For a failover,
//! `set_upstream` sends new connections to another server and `close_all`
//! closes the open ones (both sides see the connection end), as a moved
//! virtual address does.

use std::sync::{
    atomic::{AtomicU16, AtomicU64, Ordering},
    Arc, Mutex,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

pub struct Proxy {
    pub port: u16,
    /// Connections accepted before this number are silenced.
    silenced_before: Arc<AtomicU64>,
    /// Connections accepted before this number are closed.
    closed_before: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
    /// The port on 127.0.0.1 that new connections go to.
    upstream: Arc<AtomicU16>,
    /// New connections are closed at once.
    down: Arc<std::sync::atomic::AtomicBool>,
    /// New connections are accepted and never answered.
    silent: Arc<std::sync::atomic::AtomicBool>,
    /// Silent connections are kept open here until the proxy goes away.
    graveyard: Arc<Mutex<Vec<TcpStream>>>,
    task: JoinHandle<()>,
}

impl Proxy {
    /// Forwards a new local port to `target_port` on 127.0.0.1.
    pub async fn start(target_port: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let silenced_before = Arc::new(AtomicU64::new(0));
        let closed_before = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let upstream = Arc::new(AtomicU16::new(target_port));
        let graveyard = Arc::new(Mutex::new(Vec::new()));
        let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let silent = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cut = Cut {
            silenced_before: silenced_before.clone(),
            closed_before: closed_before.clone(),
        };
        let (count, target, graves, is_down, is_silent) = (
            accepted.clone(),
            upstream.clone(),
            graveyard.clone(),
            down.clone(),
            silent.clone(),
        );
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if is_down.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                if is_silent.load(Ordering::SeqCst) {
                    graves.lock().unwrap().push(client);
                    continue;
                }
                let number = count.fetch_add(1, Ordering::SeqCst);
                let port = target.load(Ordering::SeqCst);
                let (cut, graves) = (cut.clone(), graves.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(("127.0.0.1", port)).await else {
                        return;
                    };
                    forward(client, server, number, cut, graves).await;
                });
            }
        });
        Proxy {
            port,
            silenced_before,
            closed_before,
            accepted,
            upstream,
            down,
            silent,
            graveyard,
            task,
        }
    }

    /// Down: every open connection goes silent and new ones are closed at
    /// once. Up again: new connections work.
    pub fn set_down(&self, down: bool) {
        if down {
            self.blackhole();
        }
        self.down.store(down, Ordering::SeqCst);
    }

    /// Silent: every open connection goes silent and new ones are accepted
    /// and never answered. Not silent again: new connections work.
    pub fn set_silent(&self, silent: bool) {
        if silent {
            self.silent.store(true, Ordering::SeqCst);
            self.blackhole();
        } else {
            self.silent.store(false, Ordering::SeqCst);
        }
    }

    /// Every connection open now goes silent.
    pub fn blackhole(&self) {
        let now = self.accepted.load(Ordering::SeqCst);
        self.silenced_before.store(now, Ordering::SeqCst);
    }

    /// New connections go to `port` on 127.0.0.1 from now on.
    pub fn set_upstream(&self, port: u16) {
        self.upstream.store(port, Ordering::SeqCst);
    }

    /// Every connection open now is closed (within 50 ms), on both sides.
    pub fn close_all(&self) {
        let now = self.accepted.load(Ordering::SeqCst);
        self.closed_before.store(now, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.graveyard.lock().unwrap().clear();
    }
}

/// Which connections are silenced and which closed, by the order they were
/// accepted in.
#[derive(Clone)]
struct Cut {
    silenced_before: Arc<AtomicU64>,
    closed_before: Arc<AtomicU64>,
}

/// Copies both ways until either side closes or this connection is closed
/// by `close_all` (both sockets dropped), or until it is silenced: then both
/// sockets are parked, open and unread.
async fn forward(
    client: TcpStream,
    server: TcpStream,
    number: u64,
    cut: Cut,
    graveyard: Arc<Mutex<Vec<TcpStream>>>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let silenced = || number < cut.silenced_before.load(Ordering::SeqCst);
    let closed = || number < cut.closed_before.load(Ordering::SeqCst);
    let (mut client, mut server) = (client, server);
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    loop {
        let tick = tokio::time::sleep(std::time::Duration::from_millis(50));
        tokio::select! {
            n = client.read(&mut up) => match n {
                Ok(0) | Err(_) => return,
                Ok(_) if closed() => return,
                Ok(n) if !silenced() => if server.write_all(&up[..n]).await.is_err() { return },
                Ok(_) => break,
            },
            n = server.read(&mut down) => match n {
                Ok(0) | Err(_) => return,
                Ok(_) if closed() => return,
                Ok(n) if !silenced() => if client.write_all(&down[..n]).await.is_err() { return },
                Ok(_) => break,
            },
            _ = tick => if closed() { return } else if silenced() { break },
        }
    }
    let mut graves = graveyard.lock().unwrap();
    graves.push(client);
    graves.push(server);
}
