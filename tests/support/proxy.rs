//! A TCP proxy between the daemon and a server, for faults the real servers
//! cannot produce: `blackhole()` makes every connection open at that moment
//! go silent in both directions (no reset, no close: packets seem to vanish,
//! as with a lost NAT entry or a failed-over address), while new connections
//! work as before; `set_down(true)` also closes every new connection at once
//! (the server is unreachable) until `set_down(false)`.

use std::sync::{
    atomic::{AtomicU64, Ordering},
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
    accepted: Arc<AtomicU64>,
    /// New connections are closed at once.
    down: Arc<std::sync::atomic::AtomicBool>,
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
        let accepted = Arc::new(AtomicU64::new(0));
        let graveyard = Arc::new(Mutex::new(Vec::new()));
        let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (silenced, count, graves, is_down) = (
            silenced_before.clone(),
            accepted.clone(),
            graveyard.clone(),
            down.clone(),
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
                let number = count.fetch_add(1, Ordering::SeqCst);
                let (silenced, graves) = (silenced.clone(), graves.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)).await else {
                        return;
                    };
                    forward(client, server, number, silenced, graves).await;
                });
            }
        });
        Proxy {
            port,
            silenced_before,
            accepted,
            down,
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

    /// Every connection open now goes silent.
    pub fn blackhole(&self) {
        let now = self.accepted.load(Ordering::SeqCst);
        self.silenced_before.store(now, Ordering::SeqCst);
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

/// Copies both ways until either side closes, or until this connection is
/// silenced: then both sockets are parked, open and unread.
async fn forward(
    client: TcpStream,
    server: TcpStream,
    number: u64,
    silenced_before: Arc<AtomicU64>,
    graveyard: Arc<Mutex<Vec<TcpStream>>>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let silenced = || number < silenced_before.load(Ordering::SeqCst);
    let (mut client, mut server) = (client, server);
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    loop {
        let tick = tokio::time::sleep(std::time::Duration::from_millis(50));
        tokio::select! {
            n = client.read(&mut up) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) if !silenced() => if server.write_all(&up[..n]).await.is_err() { return },
                Ok(_) => break,
            },
            n = server.read(&mut down) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) if !silenced() => if client.write_all(&down[..n]).await.is_err() { return },
                Ok(_) => break,
            },
            _ = tick => if silenced() { break },
        }
    }
    let mut graves = graveyard.lock().unwrap();
    graves.push(client);
    graves.push(server);
}
