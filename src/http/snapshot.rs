//! The snapshot: what `/metrics`, `/healthz` and the console's overview show
//! of the database (counts by status, ages, failures of the last hour, the
//! daemons, sent and failed per minute, reports of the last day by kind),
//! read by one task at most every [`INTERVAL`] on a pool of one connection
//! of its own. However many ask, the database sees one reader every few
//! seconds, and never on the daemon's pool: a scrape storm cannot starve
//! the claims (DESIGN §11).
//!
//! The task refreshes while someone asked within [`IDLE_AFTER`] and then
//! rests: a daemon nobody watches runs no full-table count. Prometheus or a
//! container health check (every 15–30 s) keeps it awake; the first request
//! after a rest waits for one refresh (at most [`WAIT_FOR_FRESH`]).

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use crate::{
    store::{DaemonRow, FailureGroup, FeedbackCount, MinuteCount, QueueStats, Store, StoreError},
    telemetry::redact_addresses,
};

/// How often the figures are read while someone is asking.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// Figures older than this (three refreshes missed) say nothing about the
/// database now: `/healthz` answers 503.
pub const STALE_AFTER: Duration = Duration::from_secs(15);
/// No request for this long: the task rests until the next one.
pub const IDLE_AFTER: Duration = Duration::from_secs(60);
/// How long a request that finds the figures stale waits for a refresh
/// (below the container health check's 5 s timeout).
pub const WAIT_FOR_FRESH: Duration = Duration::from_secs(3);
/// The failures the overview groups.
pub const FAILURE_WINDOW: Duration = Duration::from_secs(3600);
/// The minutes the overview's chart spans.
pub const CHART_MINUTES: u32 = 60;
/// The reports (bounces, complaints…) the overview counts by kind.
pub const FEEDBACK_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// The figures of one refresh that the database answered.
#[derive(Debug, Clone)]
pub struct Figures {
    pub stats: QueueStats,
    pub failures: Vec<FailureGroup>,
    pub daemons: Vec<DaemonRow>,
    pub minutes: Vec<MinuteCount>,
    /// Reports received within [`FEEDBACK_WINDOW`], by kind (kinds without
    /// any are left out).
    pub feedback: Vec<FeedbackCount>,
    /// When they were read (this host's clock, for the chart's axis).
    pub read_at: DateTime<Utc>,
}

/// The last refresh: its figures, or the last ones the database answered
/// and why this one failed.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// When the last refresh ended; `None`: none has yet.
    pub refreshed: Option<Instant>,
    /// When the database last answered one.
    pub answered: Option<Instant>,
    /// Why the last refresh failed (addresses redacted).
    pub error: Option<String>,
    /// The last figures the database answered.
    pub figures: Option<Arc<Figures>>,
}

impl Snapshot {
    /// The database answered the last refresh, within [`STALE_AFTER`].
    pub fn database_ok(&self) -> bool {
        self.error.is_none() && self.answered.is_some_and(|at| at.elapsed() <= STALE_AFTER)
    }

    /// How old the figures are.
    pub fn age(&self) -> Option<Duration> {
        self.answered.map(|at| at.elapsed())
    }

    fn stale(&self) -> bool {
        self.refreshed.is_none_or(|at| at.elapsed() > STALE_AFTER)
    }
}

/// The snapshot and the task that keeps it: requests read it, never the
/// database.
#[derive(Debug)]
pub struct Snapshots {
    current: watch::Sender<Arc<Snapshot>>,
    /// When a request last asked, in ms since `born`.
    asked_ms: AtomicU64,
    born: Instant,
    wake: Notify,
}

impl Snapshots {
    pub fn new() -> Arc<Snapshots> {
        Arc::new(Snapshots {
            current: watch::Sender::new(Arc::new(Snapshot::default())),
            // Starts as if asked: the first minute after start refreshes.
            asked_ms: AtomicU64::new(0),
            born: Instant::now(),
            wake: Notify::new(),
        })
    }

    /// The snapshot for a request: the current one, unless it is stale
    /// (the task rested, or the database hangs); then the next refresh, if
    /// it comes within [`WAIT_FOR_FRESH`].
    pub async fn latest(&self) -> Arc<Snapshot> {
        self.asked_ms
            .store(self.born.elapsed().as_millis() as u64, Ordering::Relaxed);
        let mut changes = self.current.subscribe();
        let now = changes.borrow_and_update().clone();
        if !now.stale() {
            return now;
        }
        self.wake.notify_one();
        match tokio::time::timeout(WAIT_FOR_FRESH, changes.changed()).await {
            Ok(Ok(())) => changes.borrow().clone(),
            _ => now,
        }
    }

    fn asked_within(&self, window: Duration) -> bool {
        let asked = Duration::from_millis(self.asked_ms.load(Ordering::Relaxed));
        self.born.elapsed().saturating_sub(asked) <= window
    }

    /// Refreshes until `stop`: every [`INTERVAL`] while asked, then on the
    /// next request. `store` is a pool of its own (one connection).
    pub async fn keep_fresh(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        lock_timeout: Duration,
        stop: CancellationToken,
    ) {
        loop {
            if !self.asked_within(IDLE_AFTER) {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = self.wake.notified() => {}
                }
            }
            let read = tokio::select! {
                _ = stop.cancelled() => return,
                read = read_figures(store.as_ref(), lock_timeout) => read,
            };
            let previous = self.current.borrow().clone();
            let now = Instant::now();
            let next = match read {
                Ok(figures) => Snapshot {
                    refreshed: Some(now),
                    answered: Some(now),
                    error: None,
                    figures: Some(Arc::new(figures)),
                },
                Err(e) => {
                    let error = redact_addresses(&e.to_string());
                    if previous.error.as_deref() != Some(error.as_str()) {
                        tracing::warn!(error = %error, "snapshot: database did not answer");
                    }
                    Snapshot {
                        refreshed: Some(now),
                        answered: previous.answered,
                        error: Some(error),
                        figures: previous.figures.clone(),
                    }
                }
            };
            self.current.send_replace(Arc::new(next));
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(INTERVAL) => {}
            }
        }
    }
}

impl Figures {
    /// Reports of `kind` received within [`FEEDBACK_WINDOW`].
    pub fn feedback_count(&self, kind: &str) -> i64 {
        self.feedback
            .iter()
            .filter(|c| c.kind == kind)
            .map(|c| c.count)
            .sum()
    }

    /// Reports from `source` received within [`FEEDBACK_WINDOW`].
    pub fn feedback_from(&self, source: &str) -> i64 {
        self.feedback
            .iter()
            .filter(|c| c.source == source)
            .map(|c| c.count)
            .sum()
    }
}

/// One refresh: five reads, one after the other on the one connection. The
/// reports' count reads the index on `received_at`: a day of reports, not
/// the table.
async fn read_figures(store: &dyn Store, lock_timeout: Duration) -> Result<Figures, StoreError> {
    let stats = store.stats(lock_timeout).await?;
    let failures = store.failure_groups(FAILURE_WINDOW).await?;
    let daemons = store.daemons().await?;
    let minutes = store.minutes(CHART_MINUTES).await?;
    let feedback = store.feedback_counts(FEEDBACK_WINDOW).await?;
    Ok(Figures {
        stats,
        failures,
        daemons,
        minutes,
        feedback,
        read_at: Utc::now(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_follows_the_last_answer() {
        let mut snapshot = Snapshot::default();
        assert!(!snapshot.database_ok(), "no answer yet");
        assert!(snapshot.stale());
        snapshot.refreshed = Some(Instant::now());
        snapshot.answered = Some(Instant::now());
        assert!(snapshot.database_ok());
        assert!(!snapshot.stale());
        snapshot.error = Some("database unavailable".into());
        assert!(!snapshot.database_ok(), "the last refresh failed");
        snapshot.error = None;
        snapshot.answered = Instant::now().checked_sub(STALE_AFTER + Duration::from_secs(1));
        assert!(!snapshot.database_ok(), "no answer for too long");
    }

    #[tokio::test]
    async fn a_request_after_a_rest_waits_for_one_refresh() {
        let snapshots = Snapshots::new();
        // Nobody refreshes: the request waits, then answers what there is.
        let started = Instant::now();
        let snapshot = snapshots.latest().await;
        assert!(snapshot.refreshed.is_none());
        assert!(started.elapsed() >= WAIT_FOR_FRESH);
        // The wake-up it left.
        snapshots.wake.notified().await;
        // A refresh arriving while it waits is what it answers.
        let waiting = {
            let snapshots = snapshots.clone();
            tokio::spawn(async move { snapshots.latest().await })
        };
        snapshots.wake.notified().await;
        let fresh = Snapshot {
            refreshed: Some(Instant::now()),
            answered: Some(Instant::now()),
            ..Snapshot::default()
        };
        snapshots.current.send_replace(Arc::new(fresh));
        assert!(waiting.await.unwrap().database_ok());
        // A fresh snapshot is answered at once.
        let started = Instant::now();
        assert!(snapshots.latest().await.database_ok());
        assert!(started.elapsed() < Duration::from_secs(1));
    }
}
