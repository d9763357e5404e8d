//! The connections a store keeps: a small pool of our own, with a deadline
//! on every wait.
//!
//! sqlx's pool tests each connection on its way back with a round trip that
//! has no deadline. A connection that goes silent during that test (packets
//! dropped, a database host that stops answering, a proxy that stops
//! forwarding) never comes back and keeps its place in the pool for good: on
//! a pool of one (the claims' connection on PostgreSQL, the console's
//! snapshot) the daemon stops claiming, or its health stays 503, until the
//! kernel gives up on the connection, which, when something between still
//! acknowledges the packets, is never. Here the same test is part of the
//! call, within its deadline, and a connection that fails it is closed and
//! its place freed.
//!
//! The rest is what a daemon's calls need and no more: at most `max`
//! connections, made on demand (lazily), the most recently used taken first;
//! one idle for more than [`TEST_IF_IDLE`] tested before use; idle ones
//! closed after `idle_timeout`, any after [`MAX_LIFETIME`].
//!
//! SQLite's connections are threads of this process ([`Reach::InProcess`]):
//! nothing between can go silent, and a dropped transaction's ROLLBACK goes
//! to the thread at once, so neither test is made there (the caller would
//! wait for the one on the way back for nothing: SQLite's drain was slower
//! with it).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::future::BoxFuture;
use sqlx::{ConnectOptions, Connection, Database};
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};

use super::{Result, StoreError};

/// Idle connections are closed after this long, unless the database says
/// otherwise (sqlx's default).
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// A connection idle longer than this is tested (one round trip) before it
/// is used: the server may have closed it meanwhile (a restart, a failover,
/// its idle timeout). One in steady use is not.
const TEST_IF_IDLE: Duration = Duration::from_secs(1);

/// Connections are replaced after this long (a failed-over address, a
/// server process's memory), as sqlx's pool does.
const MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// How long a retired connection may take to say goodbye to the server.
const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// Runs on each new connection before its first use (session settings).
pub(crate) type Setup<DB> = Arc<
    dyn for<'c> Fn(&'c mut <DB as Database>::Connection) -> BoxFuture<'c, Result<(), sqlx::Error>>
        + Send
        + Sync,
>;

type Options<DB> = <<DB as Database>::Connection as Connection>::Options;

/// Where the database is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Over a network connection: connections are tested (see the module).
    Network,
    /// In this process (SQLite): no test.
    InProcess,
}

/// A pool of connections to one database (cheap to clone: the clones share
/// it).
pub(crate) struct Conns<DB: Database> {
    inner: Arc<Inner<DB>>,
}

impl<DB: Database> Clone for Conns<DB> {
    fn clone(&self) -> Self {
        Conns {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<DB: Database> {
    options: Options<DB>,
    setup: Option<Setup<DB>>,
    /// One permit for each connection in use (or being tested on its way
    /// back). A connection is made only by a holder that found none idle,
    /// and one goes back to `idle` before its permit is released, so there
    /// are never more than `max` connections.
    slots: Arc<Semaphore>,
    /// Oldest first; taken from the back.
    idle: Mutex<Vec<Pooled<DB>>>,
    idle_timeout: Duration,
    reach: Reach,
}

struct Pooled<DB: Database> {
    raw: DB::Connection,
    born: Instant,
    idle_since: Instant,
}

impl<DB: Database> Conns<DB> {
    /// A pool of at most `max` connections, none made yet.
    pub fn new(
        options: Options<DB>,
        reach: Reach,
        max: u32,
        idle_timeout: Duration,
        setup: Option<Setup<DB>>,
    ) -> Self {
        let max = (max.max(1) as usize).min(Semaphore::MAX_PERMITS);
        Conns {
            inner: Arc::new(Inner {
                options,
                setup,
                slots: Arc::new(Semaphore::new(max)),
                idle: Mutex::new(Vec::new()),
                idle_timeout,
                reach,
            }),
        }
    }

    /// A pool of sqlx's, of one connection with these settings, outside this
    /// pool's count, for what sqlx runs on a pool of its own (migrations;
    /// their lock and their connection are sqlx's), connecting within
    /// `connect_within`. Close it after use.
    pub fn one_off(&self, connect_within: Duration) -> sqlx::Pool<DB> {
        let setup = self.inner.setup.clone();
        sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(1)
            .acquire_timeout(connect_within)
            .after_connect(move |conn, _| match &setup {
                Some(setup) => setup(conn),
                None => Box::pin(async { Ok(()) }),
            })
            .connect_lazy_with(self.inner.options.clone())
    }

    /// Closes the idle connections politely, together, within
    /// [`CLOSE_WITHIN`] (at the end of a command: a connection only dropped
    /// is a lost client to the server, which MariaDB counts in
    /// `Aborted_clients` and logs, and PostgreSQL counts in
    /// `sessions_abandoned`). Connections in use are dropped with their
    /// holders.
    pub async fn close(&self) {
        let idle = std::mem::take(&mut *self.inner.idle.lock().expect("idle list"));
        let closes = idle.into_iter().map(|c| c.raw.close());
        let _ = tokio::time::timeout(CLOSE_WITHIN, futures_util::future::join_all(closes)).await;
    }

    /// A connection, and the place in the pool it holds: an idle one (tested
    /// first if it sat for a while, the test given a quarter of `limit` so
    /// that a silent one leaves time to connect anew) or a new one. The
    /// caller's deadline bounds the whole.
    async fn take(
        &self,
        limit: Duration,
    ) -> Result<(OwnedSemaphorePermit, Pooled<DB>), sqlx::Error> {
        let permit = Arc::clone(&self.inner.slots)
            .acquire_owned()
            .await
            .expect("the pool's semaphore is never closed");
        loop {
            let found = {
                let mut idle = self.inner.idle.lock().expect("idle list");
                let expired = idle
                    .iter()
                    .take_while(|c| c.idle_since.elapsed() >= self.inner.idle_timeout)
                    .count();
                idle.drain(..expired).for_each(retire::<DB>);
                idle.pop()
            };
            let Some(mut conn) = found else {
                let mut raw = self.inner.options.connect().await?;
                if let Some(setup) = &self.inner.setup {
                    setup(&mut raw).await?;
                }
                let now = Instant::now();
                return Ok((
                    permit,
                    Pooled {
                        raw,
                        born: now,
                        idle_since: now,
                    },
                ));
            };
            if self.inner.reach == Reach::InProcess
                || conn.idle_since.elapsed() < TEST_IF_IDLE
                || matches!(
                    tokio::time::timeout(limit / 4, conn.raw.ping()).await,
                    Ok(Ok(()))
                )
            {
                return Ok((permit, conn));
            }
            // Broken or silent while idle: dropped (its socket closed); the
            // next one.
        }
    }

    /// Hands `conn` back, as sqlx does, after one round trip that sends what
    /// a dropped transaction left queued (its ROLLBACK) and proves the
    /// connection still answers; but here by `deadline`, or the connection is
    /// closed and its place freed. sqlx's test has no deadline: a connection
    /// that goes silent during it keeps its place in the pool for good.
    async fn give_back(
        &self,
        permit: OwnedSemaphorePermit,
        mut conn: Pooled<DB>,
        deadline: Instant,
    ) {
        if conn.born.elapsed() >= MAX_LIFETIME {
            retire::<DB>(conn);
        } else if self.inner.reach == Reach::InProcess
            || matches!(
                tokio::time::timeout_at(deadline, conn.raw.ping()).await,
                Ok(Ok(()))
            )
        {
            conn.idle_since = Instant::now();
            self.inner.idle.lock().expect("idle list").push(conn);
        }
        drop(permit);
    }
}

/// Closes a connection that is still sound, politely and within
/// [`CLOSE_WITHIN`].
fn retire<DB: Database>(conn: Pooled<DB>) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(CLOSE_WITHIN, conn.raw.close()).await;
    });
}

/// Whether a connection whose call failed with `e` is still fit for the
/// next: the database's own errors leave the session as it was (a
/// transaction that was open is rolled back on the way back); anything else
/// (I/O, protocol, decoding) closes it.
fn reusable(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(_) | sqlx::Error::RowNotFound)
}

/// Runs `work` on a pooled connection, all of it (waiting for a connection
/// and giving it back included) within `limit`. On timeout the connection
/// is closed, not given back.
pub(crate) async fn within<DB, T>(
    conns: &Conns<DB>,
    limit: Duration,
    work: impl for<'c> FnOnce(&'c mut DB::Connection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
) -> Result<T>
where
    DB: Database,
{
    let deadline = Instant::now() + limit;
    let (permit, mut conn) = tokio::time::timeout_at(deadline, conns.take(limit))
        .await
        .map_err(|_| StoreError::Timeout(limit))??;
    let Ok(result) = tokio::time::timeout_at(deadline, work(&mut conn.raw)).await else {
        // Dropped with its socket, unread answers and all.
        return Err(StoreError::Timeout(limit));
    };
    if result.as_ref().map_or_else(reusable, |_| true) {
        conns.give_back(permit, conn, deadline).await;
    }
    Ok(result?)
}

#[cfg(test)]
mod tests {
    use std::{
        str::FromStr,
        sync::atomic::{AtomicUsize, Ordering},
    };

    use sqlx::postgres::{PgConnectOptions, Postgres};
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
    };

    use super::*;

    /// A TCP proxy to PostgreSQL that can make the connections open at a
    /// moment go silent (nothing forwarded either way, nothing closed: a
    /// lost route, a frozen host), while new ones work.
    #[derive(Clone)]
    struct Silencer {
        port: u16,
        accepted: Arc<AtomicUsize>,
        /// Connections numbered below this are silent.
        silent_below: Arc<AtomicUsize>,
    }

    impl Silencer {
        async fn start(upstream: (String, u16)) -> Silencer {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let silencer = Silencer {
                port: listener.local_addr().unwrap().port(),
                accepted: Arc::default(),
                silent_below: Arc::default(),
            };
            let s = silencer.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let number = s.accepted.fetch_add(1, Ordering::SeqCst);
                    let server = TcpStream::connect(upstream.clone()).await.unwrap();
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    for (from, to) in [(client_read, server_write), (server_read, client_write)] {
                        let silent_below = Arc::clone(&s.silent_below);
                        tokio::spawn(async move {
                            let (mut from, mut to, mut buf) = (from, to, vec![0; 16 * 1024]);
                            while let Ok(n @ 1..) = from.read(&mut buf).await {
                                if number < silent_below.load(Ordering::SeqCst) {
                                    // Held open, never answered.
                                    std::future::pending::<()>().await;
                                }
                                if to.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                        });
                    }
                }
            });
            silencer
        }

        fn silence_open_connections(&self) {
            let now = self.accepted.load(Ordering::SeqCst);
            self.silent_below.store(now, Ordering::SeqCst);
        }

        fn accepted(&self) -> usize {
            self.accepted.load(Ordering::SeqCst)
        }
    }

    /// A pool of one connection to PostgreSQL through a [`Silencer`]; `None`
    /// where PostgreSQL is missing on purpose (as the integration tests:
    /// never under CI=true).
    async fn pool_of_one() -> Option<(Conns<Postgres>, Silencer)> {
        let url = std::env::var("TABLEMAIL_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let options = PgConnectOptions::from_str(&url).unwrap();
        if let Err(e) = options.connect().await {
            let skip = std::env::var("TABLEMAIL_TEST_SKIP_UNREACHABLE").as_deref() == Ok("1")
                && std::env::var("CI").as_deref() != Ok("true");
            assert!(skip, "PostgreSQL is unreachable: {e}");
            return None;
        }
        let upstream = (options.get_host().to_string(), options.get_port());
        let silencer = Silencer::start(upstream).await;
        let options = options.host("127.0.0.1").port(silencer.port);
        Some((
            Conns::new(options, Reach::Network, 1, IDLE_TIMEOUT, None),
            silencer,
        ))
    }

    async fn select(conns: &Conns<Postgres>, limit: Duration, n: i32) -> Result<i32> {
        within(conns, limit, move |c| {
            Box::pin(async move {
                sqlx::query_scalar("SELECT $1::int4")
                    .bind(n)
                    .fetch_one(c)
                    .await
            })
        })
        .await
    }

    /// The work is done, and its connection goes silent on the way back to
    /// the pool (where sqlx's own pool tests it with no deadline and keeps
    /// its place for good): the call still returns the work's answer, and the
    /// next call gets a new connection.
    #[tokio::test]
    async fn a_connection_silenced_on_its_way_back_frees_its_place() {
        let Some((conns, silencer)) = pool_of_one().await else {
            return;
        };
        let limit = Duration::from_secs(2);
        let s = silencer.clone();
        let call = within(&conns, limit, move |c| {
            Box::pin(async move {
                let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut *c).await?;
                s.silence_open_connections();
                Ok(one)
            })
        });
        let done = tokio::time::timeout(limit * 2, call)
            .await
            .expect("the call returns by its deadline");
        assert_eq!(done.unwrap(), 1);
        assert_eq!(select(&conns, limit, 2).await.unwrap(), 2);
        assert_eq!(silencer.accepted(), 2);
    }

    /// A connection that went silent while idle is tested before use, and
    /// replaced within the same call.
    #[tokio::test]
    async fn an_idle_connection_gone_silent_is_replaced_within_the_call() {
        let Some((conns, silencer)) = pool_of_one().await else {
            return;
        };
        let limit = Duration::from_secs(4);
        assert_eq!(select(&conns, limit, 1).await.unwrap(), 1);
        silencer.silence_open_connections();
        // Idle long enough to be tested.
        tokio::time::sleep(TEST_IF_IDLE + Duration::from_millis(100)).await;
        assert_eq!(select(&conns, limit, 2).await.unwrap(), 2);
        assert_eq!(silencer.accepted(), 2);
        // In steady use, no test: the same connection.
        assert_eq!(select(&conns, limit, 3).await.unwrap(), 3);
        assert_eq!(silencer.accepted(), 2);
    }

    /// A call whose connection goes silent in the middle times out at its
    /// deadline, and its place is free for the next call.
    #[tokio::test]
    async fn a_call_silenced_midway_times_out_and_frees_its_place() {
        let Some((conns, silencer)) = pool_of_one().await else {
            return;
        };
        let limit = Duration::from_secs(1);
        let s = silencer.clone();
        let started = Instant::now();
        let stuck = within(&conns, limit, move |c| {
            Box::pin(async move {
                s.silence_open_connections();
                sqlx::query_scalar::<_, i32>("SELECT 1")
                    .fetch_one(&mut *c)
                    .await
            })
        })
        .await;
        assert!(matches!(stuck, Err(StoreError::Timeout(_))), "{stuck:?}");
        assert!(started.elapsed() < limit * 2, "{:?}", started.elapsed());
        assert_eq!(select(&conns, limit, 2).await.unwrap(), 2);
        assert_eq!(silencer.accepted(), 2);
    }
}
