//! claim -> send -> group commit.
//!
//! [`Worker::run`] is the daemon: a claimer keeps the [`pipeline`] fed until
//! SIGTERM, while chores renew locks, sweep stale ones, purge and vacuum.
//! [`Worker::process_batch`] pushes one claimed batch through the very same
//! pipeline (lanes, group commit with retry, lock renewal while held), so the
//! step tests drive is the path the daemon runs. What becomes of each mail is
//! decided by one pure function, [`outcome::decide`].
//!
//! - [`pipeline`]: the lanes, the group commit, the drain.
//! - [`ready`]: a claimed row loaded and built into its message.
//! - [`queue`]: the claimed rows waiting for a lane.
//! - [`report`]: one log line per outcome, in the mail's span.
//! - [`outcome`]: the outcome policy (DESIGN §2).
//! - [`relay`]: the relay gate: pauses and probes while the relay is down.
//! - [`route`]: the routes: a relay per sender domain, each with its gate.
//! - [`routing`]: probing the relay, the fallback relay, the staging redirect.
//! - [`pace`]: `worker.rate_limit`, domain and relay throttling.
//! - [`held`]: the rows this process holds.
//! - [`budget`]: the memory budget of mails loaded to be sent.
//! - [`chores`]: lock renewal, stale-lock sweeps, purge, watchdog.
//! - [`retry`]: backoff arithmetic.
//! - [`suppression`]: recipients on the suppression list left out.
//! - [`limits`]: send caps: room reserved at claim, settled after the outcome.

mod budget;
mod chores;
mod held;
mod limits;
pub mod outcome;
pub mod pace;
mod pipeline;
mod queue;
mod ready;
pub mod relay;
mod report;
pub mod retry;
pub mod route;
mod routing;
mod suppression;

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::{sync::Notify, task::JoinSet};
use tokio_util::sync::CancellationToken;

use crate::{
    config::{RetentionSettings, WorkerSettings},
    mail::MessageDefaults,
    metrics::Metrics,
    smtp::Transport,
    store::{BatchLock, Claim, FinalAction, QueuedMail, Store, StoreError},
    systemd,
};

use budget::MemoryBudget;
use held::Held;
use outcome::Policy;
use pace::Pace;
use pipeline::Stop;
use queue::JobQueue;
use relay::RelayGate;
use route::{Route, Routes};

/// What [`Worker::process_batch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchReport {
    pub claimed: usize,
    pub sent: usize,
    pub retried: usize,
    pub failed: usize,
    pub unknown: usize,
    /// Back to `queued` unspent, at once (released) or later (deferred).
    pub released: usize,
    pub deferred: usize,
    /// Every recipient on the suppression list: ended unsent.
    pub suppressed: usize,
    /// Outcomes not written because the lock had been taken away.
    pub fenced: usize,
}

impl BatchReport {
    fn add(&mut self, action: &FinalAction, written: bool) {
        let counter = match (written, action) {
            (false, _) => &mut self.fenced,
            (true, FinalAction::Sent) => &mut self.sent,
            (true, FinalAction::Retry { .. }) => &mut self.retried,
            (true, FinalAction::Failed { .. }) => &mut self.failed,
            (true, FinalAction::Unknown { .. }) => &mut self.unknown,
            (true, FinalAction::Release) => &mut self.released,
            (true, FinalAction::Defer { .. }) => &mut self.deferred,
            (true, FinalAction::Suppressed { .. }) => &mut self.suppressed,
        };
        *counter += 1;
    }
}

/// Claims whose answer never came (see [`Worker::release_lost_claims`]).
#[derive(Default)]
struct LostClaims {
    locks: Vec<(BatchLock, std::time::Instant)>,
    /// The last time their release was tried.
    tried: Option<std::time::Instant>,
}

/// Claims, sends and finalizes mails for one daemon.
pub struct Worker {
    store: Arc<dyn Store>,
    /// The relays mail leaves through, the default (`transport.*`) first.
    routes: Routes,
    settings: WorkerSettings,
    retention: RetentionSettings,
    defaults: Arc<MessageDefaults>,
    message_id_domain: String,
    policy: Policy,
    metrics: Arc<Metrics>,
    pace: Pace,
    held: Held,
    /// Bounds the large mails and attachments loaded at once.
    memory: MemoryBudget,
    /// The templates rows name (DESIGN §15), compiled and cached.
    templates: crate::templates::Templates,
    /// New rows may be due (NOTIFY, a released stale lock).
    wake: Arc<Notify>,
    /// A group commit made room for more claimed rows.
    freed: Notify,
    /// This process among the daemons (`tablemail_daemon`).
    daemon_id: uuid::Uuid,
    /// When the database last answered a claim or a commit, in ms since `born`.
    db_answered_ms: AtomicU64,
    /// Claims whose answer never came, with when they failed: their rows may
    /// be `sending` under a lock nobody holds (see [`Worker::release_lost_claims`]).
    lost_claims: std::sync::Mutex<LostClaims>,
    born: std::time::Instant,
    /// The send caps shared with every daemon (DESIGN §16).
    caps: Arc<crate::limits::Caps>,
}

impl Worker {
    pub fn new(
        store: Arc<dyn Store>,
        transport: Arc<Transport>,
        settings: WorkerSettings,
        retention: RetentionSettings,
        defaults: MessageDefaults,
        message_id_domain: String,
    ) -> Arc<Worker> {
        Worker::with_routes(
            store,
            Routes::single(transport),
            settings,
            retention,
            defaults,
            message_id_domain,
            crate::limits::Caps::default(),
        )
    }

    /// A worker sending through these routes (DESIGN §13), under these
    /// send caps (DESIGN §16).
    pub fn with_routes(
        store: Arc<dyn Store>,
        routes: Routes,
        settings: WorkerSettings,
        retention: RetentionSettings,
        defaults: MessageDefaults,
        message_id_domain: String,
        caps: crate::limits::Caps,
    ) -> Arc<Worker> {
        let metrics = Arc::new(Metrics::new(
            &routes.iter().map(|(_, r)| r.label()).collect::<Vec<_>>(),
        ));
        for cap in caps.iter() {
            metrics.cap_use(&crate::store::CapUse {
                name: cap.name.clone(),
                used: 0,
                max: cap.max,
            });
        }
        Arc::new(Worker {
            caps: Arc::new(caps),
            policy: Policy {
                ambiguous: settings.ambiguous,
                retry_base: settings.retry_base,
                retry_max: settings.retry_max,
                relay_down_limit: settings.relay_down_limit,
            },
            pace: Pace::new(settings.rate_limit),
            metrics,
            db_answered_ms: AtomicU64::new(0),
            lost_claims: Default::default(),
            daemon_id: uuid::Uuid::new_v4(),
            born: std::time::Instant::now(),
            store,
            routes,
            settings,
            retention,
            defaults: Arc::new(defaults),
            message_id_domain,
            held: Held::default(),
            memory: MemoryBudget::new(budget::LOAD_BUDGET),
            templates: crate::templates::Templates::new(),
            wake: Arc::new(Notify::new()),
            freed: Notify::new(),
        })
    }

    /// The default route's relay gate.
    pub fn relay(&self) -> &RelayGate {
        &self.routes.default_route().relay
    }

    /// The routes, the default first.
    pub fn routes(&self) -> &Routes {
        &self.routes
    }

    /// The counters and health the HTTP endpoints read.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// The database answered just now.
    fn database_answered(&self) {
        let now = self.born.elapsed().as_millis() as u64;
        self.db_answered_ms.store(now, Ordering::Relaxed);
    }

    /// Whether the database answered within `window`.
    fn database_answered_within(&self, window: Duration) -> bool {
        let last = Duration::from_millis(self.db_answered_ms.load(Ordering::Relaxed));
        self.born.elapsed().saturating_sub(last) <= window
    }

    fn relay_went_through(&self, route: &Route) {
        if !route.relay.is_up() {
            self.metrics.route_up(route.label());
        }
        route.relay.went_through();
    }

    /// Claims one batch and pushes it through the pipeline: sends it (up to
    /// `worker.concurrency` sessions at once), renews its locks while it is
    /// held, and commits every outcome, retrying the commit until the
    /// database answers. While the relay is paused, claims nothing.
    pub async fn process_batch(self: &Arc<Self>) -> Result<BatchReport, StoreError> {
        if !self.relay_ready().await {
            return Ok(BatchReport::default());
        }
        let mails = self.claim(self.settings.batch_size).await?;
        let claimed = mails.len();
        if claimed == 0 {
            return Ok(BatchReport::default());
        }
        let queue = Arc::new(JobQueue::default());
        queue.push(mails);
        let lanes = self.settings.concurrency.min(claimed);
        let mut report = self
            .drain(
                queue,
                lanes,
                Stop::default(),
                async {},
                self.settings.shutdown_timeout,
            )
            .await;
        report.claimed = claimed;
        Ok(report)
    }

    /// Runs until `cancel` fires, then drains and returns.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        let listening = self
            .store
            .spawn_wakeup_listener(self.wake.clone(), cancel.clone());
        tracing::info!(
            backend = %self.store.backend(),
            concurrency = self.settings.concurrency,
            batch_size = self.settings.batch_size,
            wakeup = listening.unwrap_or("poll"),
            "worker started"
        );
        let background = CancellationToken::new();
        let mut chores = JoinSet::new();
        if let Some(interval) = systemd::watchdog_interval() {
            chores.spawn(self.clone().watchdog(interval, background.clone()));
        }
        chores.spawn(self.clone().sweep(background.clone()));
        chores.spawn(self.clone().probe_relays(background.clone()));
        chores.spawn(self.clone().purge(background.clone()));
        chores.spawn(self.clone().heartbeat(background.clone()));

        let queue = Arc::new(JobQueue::default());
        let stop = Stop {
            taking: cancel.clone(),
            sending: CancellationToken::new(),
        };
        let feed = async {
            self.claim_loop(&cancel, &queue).await;
            systemd::notify("STOPPING=1");
        };
        self.drain(
            queue.clone(),
            self.settings.concurrency,
            stop,
            feed,
            self.settings.shutdown_timeout,
        )
        .await;
        background.cancel();
        while chores.join_next().await.is_some() {}
        for (_, route) in self.routes.iter() {
            route.transport.close().await;
        }
        tracing::info!("worker stopped");
    }

    /// Claims up to `limit` due rows under a fresh batch lock. A claim that
    /// fails may still have committed: its lock is kept, to put its rows
    /// back once the database answers again.
    async fn claim(&self, limit: usize) -> Result<Vec<QueuedMail>, StoreError> {
        let claim = Claim {
            lock: BatchLock::generate(),
            limit,
            max_age: self.settings.max_age,
            message_id_domain: &self.message_id_domain,
            inline_limit: budget::INLINE_CONTENT,
        };
        let mut mails = match self.store.claim_batch(&claim).await {
            Ok(mails) => mails,
            Err(e) => {
                let mut lost = self.lost_claims.lock().expect("not poisoned");
                lost.locks.push((claim.lock, std::time::Instant::now()));
                return Err(e);
            }
        };
        self.database_answered();
        self.held.add(&mails);
        // The database returns them in no particular order; start the most
        // important ones first.
        mails.sort_unstable_by_key(|m| (std::cmp::Reverse(m.priority), m.id));
        self.read_suppression(&mut mails).await;
        self.reserve_caps(&mut mails).await;
        if self.refresh_templates(&mails).await {
            mails = self.prerender(mails).await;
        }
        Ok(mails)
    }

    /// Brings the templates up to date when a row of the batch may name one
    /// (its content came with the claim and names one, or is loaded later):
    /// one query of the templates' versions, the changed ones read and
    /// compiled. A batch without templates costs nothing.
    /// Returns whether the templates are at hand for the batch.
    async fn refresh_templates(&self, mails: &[QueuedMail]) -> bool {
        let named = mails
            .iter()
            .any(|m| m.content.as_ref().is_none_or(|c| c.template.is_some()));
        if !named {
            return false;
        }
        match self.templates.refresh(self.store.as_ref()).await {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, "could not read the templates: their mails wait");
                false
            }
        }
    }

    /// Puts back the rows of claims whose answer never came, once the
    /// database answers: without this they would wait, their attempt spent,
    /// for the stale-lock sweep (`worker.lock_timeout`). A release that finds
    /// nothing is tried again (a claim cut off on our side may still be
    /// finishing on the server), at most once a second, for a minute after
    /// the claim failed (a claim that never reached the server, as in a long
    /// outage, finds nothing for that long and is then forgotten); the sweep
    /// takes whatever is left.
    async fn release_lost_claims(&self) {
        const KEEP_TRYING: std::time::Duration = std::time::Duration::from_secs(60);
        let due: Vec<BatchLock> = {
            let mut lost = self.lost_claims.lock().expect("not poisoned");
            let now = std::time::Instant::now();
            let keep = KEEP_TRYING.min(self.settings.lock_timeout);
            lost.locks.retain(|(_, at)| now.duration_since(*at) < keep);
            if lost.locks.is_empty()
                || lost
                    .tried
                    .is_some_and(|t| now.duration_since(t).as_secs() < 1)
            {
                return;
            }
            lost.tried = Some(now);
            lost.locks.iter().map(|(lock, _)| *lock).collect()
        };
        for lock in due {
            match self.store.release_claim(lock).await {
                Ok(0) => {}
                Ok(rows) => {
                    tracing::warn!(
                        rows,
                        lock = %lock,
                        "claim whose answer was lost: its rows are queued again, attempt refunded"
                    );
                    let mut lost = self.lost_claims.lock().expect("not poisoned");
                    lost.locks.retain(|(l, _)| *l != lock);
                }
                Err(_) => return, // still unavailable: the claim loop says so
            }
        }
    }

    /// How many claimed rows this daemon may hold at once: enough to keep
    /// every connection busy while the next claim and the last commit are on
    /// their way; when paced, about two seconds of its pace, so that it never
    /// sits on minutes of mail that other daemons could send.
    fn claim_ahead(&self) -> usize {
        let normal = 2 * self.settings.concurrency + 4 * self.settings.batch_size;
        match self.pace.limit() {
            Some(rate) => ((2.0 * rate).ceil() as usize).clamp(1, normal),
            None => normal,
        }
    }

    /// Keeps the lanes' queue filled with claimed rows until `cancel` fires.
    async fn claim_loop(self: &Arc<Self>, cancel: &CancellationToken, queue: &JobQueue) {
        let batch = self.settings.batch_size;
        let mut more_due = true;
        let mut db_failures = 0u32;
        while !cancel.is_cancelled() {
            if !more_due {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(self.settings.poll_interval) => {}
                }
            }
            if let Some(pause) = self.claim_pause() {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
                more_due = true;
                continue;
            }
            if !self.relay_ready().await {
                more_due = true;
                continue;
            }
            // Under load, claim at least half a batch at a time, not a row
            // per freed slot: one round-trip per row would cap throughput.
            let cap = self.claim_ahead();
            let min_claim = (batch / 2).max(1).min(cap);
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let room = cap.saturating_sub(self.held.len());
            if room < min_claim {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = freed => {}
                    _ = tokio::time::sleep(self.settings.poll_interval) => {}
                }
                more_due = true;
                continue;
            }
            self.release_lost_claims().await;
            let want = room.min(batch);
            // Not raced against `cancel`: a claim that committed must reach
            // the queue, or its rows would wait for the stale-lock sweep.
            match self.claim(want).await {
                Ok(mails) => {
                    db_failures = 0;
                    more_due = mails.len() == want;
                    queue.push(mails);
                }
                Err(e) => {
                    db_failures += 1;
                    let pause = retry::relay_pause(db_failures, retry::jitter())
                        .min(Duration::from_secs(30));
                    tracing::error!(error = %e, retry_in_ms = pause.as_millis() as u64, "{}", e.summary());
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(pause) => {}
                    }
                    more_due = true;
                }
            }
        }
    }
}
