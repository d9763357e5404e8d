//! What each database does its own way ([`Dialect`]: its claim, its group
//! commit, lock renewal and release, the insert's conflict handling, and
//! optionally wake-up and maintenance), and the store made of a dialect and
//! its pool ([`SqlStore`], whose one `Store` implementation is in
//! `sql_store`).

use std::{future::Future, sync::Arc, time::Duration};

use sqlx::Database;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{
    conns::Conns,
    shared::{FeedbackQueries, LimitQueries, Queries, Shared},
    templates::TemplateQueries,
    Backend, BatchLock, ClaimBinds, Enqueued, Finalize, Finished, Maintenance, NewMail, QueuedMail,
    Result, StaleRow,
};

/// A connection of a dialect's database.
pub(crate) type Conn<D> = <<D as Dialect>::DB as Database>::Connection;

/// What one database does its own way. Each operation runs on a connection
/// the shared code took from the pool, under the deadline.
pub(crate) trait Dialect: Send + Sync + Sized + 'static {
    type DB: Database;
    const BACKEND: Backend;

    /// The SQL of the operations written once.
    const QUERIES: &'static Queries;
    /// The delivery loop's SQL.
    const FEEDBACK: &'static FeedbackQueries;
    /// The send caps' SQL.
    const LIMITS: &'static LimitQueries;
    /// The SQL of templates (DESIGN §15).
    const TEMPLATES: &'static TemplateQueries;
    /// Durations as its SQL counts them.
    const UNIT: fn(Duration) -> i64;

    fn claim(
        c: &mut Conn<Self>,
        binds: ClaimBinds,
    ) -> impl Future<Output = Result<Vec<QueuedMail>, sqlx::Error>> + Send;

    /// Where [`Dialect::claim`] runs: the shared pool, unless the database
    /// keeps connections of its own for claims.
    fn claim_pool<'a>(&'a self, shared: &'a Shared<Self::DB>) -> &'a Conns<Self::DB> {
        &shared.pool
    }

    /// `sql` is [`FeedbackQueries::suppressed_among`]; `addresses` is never
    /// empty.
    fn suppressed_among(
        c: &mut Conn<Self>,
        sql: &'static str,
        addresses: Vec<String>,
    ) -> impl Future<Output = Result<Vec<super::Suppressed>, sqlx::Error>> + Send;

    /// `writes` is never empty.
    fn finalize(
        c: &mut Conn<Self>,
        writes: Vec<Finalize>,
    ) -> impl Future<Output = Result<Vec<i64>, sqlx::Error>> + Send;

    /// `held` is never empty.
    fn renew_locks(
        c: &mut Conn<Self>,
        held: Vec<(i64, BatchLock)>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// `older_than` in the dialect's unit.
    fn release_stale_locks(
        c: &mut Conn<Self>,
        older_than: i64,
        spare: Vec<BatchLock>,
    ) -> impl Future<Output = Result<Vec<StaleRow>, sqlx::Error>> + Send;

    fn enqueue(
        c: &mut Conn<Self>,
        mails: Vec<NewMail>,
    ) -> impl Future<Output = Result<Vec<Enqueued>, sqlx::Error>> + Send;

    /// Deletes up to `limit` finished rows of `kind` older than
    /// `older_than` (the dialect's unit) its own way and says how many;
    /// `None`: the shared statement (`purge_sent`, `purge_failed`) does.
    fn purge(
        c: &mut Conn<Self>,
        kind: Finished,
        older_than: i64,
        limit: i64,
    ) -> impl Future<Output = Result<Option<u64>, sqlx::Error>> + Send {
        let _ = (c, kind, older_than, limit);
        async { Ok(None) }
    }

    /// Rows became due now (an operator's retry): wake the daemons, where
    /// the database can.
    fn rows_due_now(c: &mut Conn<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send {
        let _ = c;
        async { Ok(()) }
    }

    fn maintain(
        &self,
        shared: &Shared<Self::DB>,
    ) -> impl Future<Output = Result<Option<Maintenance>>> + Send {
        let _ = shared;
        async { Ok(None) }
    }

    fn spawn_wakeup_listener(
        &self,
        shared: &Shared<Self::DB>,
        wake: Arc<Notify>,
        cancel: CancellationToken,
    ) -> Option<&'static str> {
        let _ = (shared, wake, cancel);
        None
    }
}

/// A database's pool and the dialect that speaks to it.
pub(crate) struct SqlStore<D: Dialect> {
    pub(crate) shared: Shared<D::DB>,
    pub(crate) dialect: D,
}
