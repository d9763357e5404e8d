//! claim -> send -> finalize.
//!
//! [`Worker::process_batch`] is the whole unit of work in one call (tests drive
//! it directly). [`Worker::run`] is the daemon: the same pieces overlapped, so
//! that SMTP sessions never wait for the database. One claimer keeps a queue
//! of claimed rows filled; `worker.concurrency` lanes each own an SMTP session
//! and send the queued mails one after the other, the next mail's envelope
//! riding along with the current one's end of data; a finalizer writes the
//! outcomes that are ready in one fenced statement (group commit). Beside
//! them, tasks renew the locks of rows still held, release the stale locks of
//! dead workers, purge finished rows past their retention, and tell systemd
//! that the worker lives.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicU64, Ordering as AtomicOrdering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::{
    sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore},
    task::JoinSet,
    time::Instant,
};
use tokio_util::sync::CancellationToken;

use crate::{
    config::{Ambiguous, RetentionSettings, WorkerSettings},
    mail::{self, MessageDefaults, PreparedMail},
    metrics::Metrics,
    pace::Pace,
    retry,
    store::{BatchLock, Claim, FinalAction, Finalize, Maintenance, QueuedMail, Store, StoreError},
    systemd,
    telemetry::redact_addresses,
    transport::{Next, SendError, Session, Transport},
};

/// How long the finalizer waits for more outcomes before writing a group.
const FINALIZE_LINGER_MS: u64 = 5;

/// What one mail came to, with what the log line needs.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub write: Finalize,
    pub attempt: i32,
    pub smtp_code: Option<u16>,
    pub elapsed_ms: u64,
    pub recipient_domains: String,
    /// The relay's reply on success, for the log.
    pub reply: Option<String>,
    /// A reply lost after "." (logged as `ambiguous`).
    pub ambiguous: bool,
}

/// What [`Worker::process_batch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchReport {
    pub claimed: usize,
    pub sent: usize,
    pub retried: usize,
    pub failed: usize,
    pub unknown: usize,
    pub released: usize,
    /// Outcomes not written because the lock had been taken away.
    pub fenced: usize,
}

impl BatchReport {
    fn add(&mut self, outcome: &Outcome, written: bool) {
        if !written {
            self.fenced += 1;
            return;
        }
        match outcome.write.action {
            FinalAction::Sent => self.sent += 1,
            FinalAction::Retry { .. } => self.retried += 1,
            FinalAction::Failed { .. } => self.failed += 1,
            FinalAction::Unknown { .. } => self.unknown += 1,
            FinalAction::Release => self.released += 1,
        }
    }
}

/// Pauses sending while the relay is unavailable, with exponential backoff.
#[derive(Debug, Default)]
pub struct RelayGate {
    state: Mutex<GateState>,
    /// Mirrors `state.failures != 0`, so that the common case (the relay
    /// answers) takes no lock.
    troubled: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct GateState {
    failures: u32,
    paused_until: Option<Instant>,
}

impl RelayGate {
    /// Time left in the current pause, if any.
    pub fn paused_for(&self) -> Option<Duration> {
        if !self.troubled.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let state = self.state.lock().unwrap();
        let until = state.paused_until?;
        let now = Instant::now();
        (until > now).then(|| until - now)
    }

    /// The relay failed: start (or keep) a pause. Logs once per pause.
    fn trip(&self, error: &SendError) {
        let mut state = self.state.lock().unwrap();
        let now = Instant::now();
        if state.paused_until.is_some_and(|until| until > now) {
            return;
        }
        state.failures += 1;
        self.troubled
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let pause = retry::relay_pause(state.failures, retry::jitter());
        state.paused_until = Some(now + pause);
        let reason = redact_addresses(&error.to_string());
        let pause_ms = pause.as_millis() as u64;
        let smtp_code = error.code();
        match error {
            SendError::RelayDown {
                needs_operator: true,
                ..
            } => tracing::error!(error = %reason, smtp_code, pause_ms, "relay unavailable"),
            _ => tracing::warn!(error = %reason, smtp_code, pause_ms, "relay unavailable"),
        }
    }

    /// A mail went through: the relay is back.
    fn reset(&self) {
        if !self.troubled.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let mut state = self.state.lock().unwrap();
        if state.failures > 0 {
            tracing::info!(failures = state.failures, "relay available again");
        }
        *state = GateState::default();
        self.troubled
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the relay answered the last attempt (for health checks).
    pub fn is_up(&self) -> bool {
        !self.troubled.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many rows to claim: after the relay was found down, one row probes
    /// it, so an outage does not claim and release whole batches.
    fn claim_limit(&self, wanted: usize) -> usize {
        if self.is_up() {
            wanted
        } else {
            1
        }
    }
}

/// Rows this process holds, by id, with their batch lock. Claims add, commits
/// remove; renewals and the shutdown release read it.
#[derive(Debug, Default)]
struct Held {
    rows: Mutex<HashMap<i64, BatchLock>>,
}

impl Held {
    fn add(&self, mails: &[QueuedMail]) {
        let mut rows = self.rows.lock().unwrap();
        for m in mails {
            rows.insert(m.id, m.lock);
        }
    }

    fn remove(&self, ids: impl IntoIterator<Item = i64>) {
        let mut rows = self.rows.lock().unwrap();
        for id in ids {
            rows.remove(&id);
        }
    }

    fn locks(&self) -> Vec<BatchLock> {
        let rows = self.rows.lock().unwrap();
        let mut locks: Vec<BatchLock> = rows.values().copied().collect();
        locks.sort_unstable_by_key(|l| l.0);
        locks.dedup();
        locks
    }

    fn all(&self) -> Vec<(i64, BatchLock)> {
        self.rows
            .lock()
            .unwrap()
            .iter()
            .map(|(id, lock)| (*id, *lock))
            .collect()
    }

    fn len(&self) -> usize {
        self.rows.lock().unwrap().len()
    }
}

/// A claimed row waiting for a lane, with the buffer slot it holds.
struct Job {
    mail: QueuedMail,
    slot: Option<OwnedSemaphorePermit>,
}

/// A job with its message built, or its fate decided without sending.
struct Ready {
    job: Job,
    prepared: Result<PreparedMail, FinalAction>,
}

impl Ready {
    fn as_next(&self) -> Option<Next<'_>> {
        self.prepared.as_ref().ok().map(|mail| Next {
            id: self.job.mail.id,
            mail,
        })
    }
}

/// Claimed rows in claim order, shared by the lanes.
#[derive(Default)]
struct MailQueue {
    jobs: Mutex<VecDeque<Job>>,
    ready: Notify,
}

impl MailQueue {
    fn push(&self, jobs: impl IntoIterator<Item = Job>) {
        self.jobs.lock().unwrap().extend(jobs);
        self.ready.notify_waiters();
    }

    fn pop(&self) -> Option<Job> {
        self.jobs.lock().unwrap().pop_front()
    }

    fn drain(&self) -> Vec<Job> {
        self.jobs.lock().unwrap().drain(..).collect()
    }

    /// The next job, waiting for one; `None` once `stop` fires.
    async fn next(&self, stop: &CancellationToken) -> Option<Job> {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(job) = self.pop() {
                return Some(job);
            }
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = notified => {}
            }
        }
    }
}

/// Claims, sends and finalizes mails for one daemon.
pub struct Worker {
    metrics: Metrics,
    pace: Pace,
    /// When the database last answered a claim or a commit, in ms since `born`.
    db_answered_ms: AtomicU64,
    born: std::time::Instant,
    store: Arc<dyn Store>,
    transport: Arc<Transport>,
    settings: WorkerSettings,
    retention: RetentionSettings,
    defaults: MessageDefaults,
    message_id_domain: String,
    relay: RelayGate,
    held: Held,
    wake: Arc<Notify>,
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
        Arc::new(Worker {
            metrics: Metrics::default(),
            pace: Pace::new(settings.rate_limit),
            db_answered_ms: AtomicU64::new(0),
            born: std::time::Instant::now(),
            store,
            transport,
            settings,
            retention,
            defaults,
            message_id_domain,
            relay: RelayGate::default(),
            held: Held::default(),
            wake: Arc::new(Notify::new()),
        })
    }

    pub fn relay(&self) -> &RelayGate {
        &self.relay
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The database answered just now.
    fn database_answered(&self) {
        let now = self.born.elapsed().as_millis() as u64;
        self.db_answered_ms.store(now, AtomicOrdering::Relaxed);
    }

    /// Whether the database answered within `window`.
    fn database_answered_within(&self, window: Duration) -> bool {
        let last = Duration::from_millis(self.db_answered_ms.load(AtomicOrdering::Relaxed));
        self.born.elapsed().saturating_sub(last) <= window
    }

    /// Claims one batch, sends it (up to `worker.concurrency` sessions at
    /// once) and writes every outcome.
    pub async fn process_batch(self: &Arc<Self>) -> Result<BatchReport, StoreError> {
        let mails = self
            .claim(self.relay.claim_limit(self.settings.batch_size))
            .await?;
        let mut report = BatchReport {
            claimed: mails.len(),
            ..Default::default()
        };
        let lanes = self.settings.concurrency.min(mails.len());
        let queue = Arc::new(MailQueue::default());
        queue.push(mails.into_iter().map(|mail| Job { mail, slot: None }));
        let (results, mut outcomes_rx) = mpsc::unbounded_channel();
        let mut tasks = JoinSet::new();
        for _ in 0..lanes {
            let lane = self.clone().lane(queue.clone(), results.clone(), None);
            tasks.spawn(lane);
        }
        drop(results);
        while let Some(done) = tasks.join_next().await {
            done.expect("a lane does not panic");
        }
        let mut outcomes = Vec::with_capacity(report.claimed);
        while let Ok((outcome, _)) = outcomes_rx.try_recv() {
            outcomes.push(outcome);
        }
        let written = self.commit(&outcomes).await?;
        for (outcome, written) in outcomes.iter().zip(written) {
            report.add(outcome, written);
        }
        Ok(report)
    }

    /// Claims up to `limit` due rows under a fresh batch lock.
    async fn claim(&self, limit: usize) -> Result<Vec<QueuedMail>, StoreError> {
        let claim = Claim {
            lock: BatchLock::new(),
            limit,
            max_age: self.settings.max_age,
            message_id_domain: &self.message_id_domain,
        };
        let mut mails = self.store.claim_batch(&claim).await?;
        self.database_answered();
        self.held.add(&mails);
        // The database returns them in no particular order; start the most
        // important ones first.
        mails.sort_unstable_by_key(|m| (std::cmp::Reverse(m.priority), m.id));
        Ok(mails)
    }

    /// One sender: takes claimed mails off the queue and sends them through
    /// its own SMTP session, one after the other. While it sends a mail it
    /// looks at the next one waiting, so that its envelope can ride along with
    /// this one's end of data. With `stop`, it waits for more work until
    /// stopped; without, it ends when the queue is empty.
    async fn lane(
        self: Arc<Self>,
        queue: Arc<MailQueue>,
        results: mpsc::UnboundedSender<(Outcome, Option<OwnedSemaphorePermit>)>,
        stop: Option<CancellationToken>,
    ) {
        let mut session: Option<Session> = None;
        let mut current: Option<Ready> = None;
        loop {
            let ready = match current.take() {
                Some(ready) => ready,
                None => {
                    let job = match queue.pop() {
                        Some(job) => job,
                        None => {
                            // Idle: the connection goes back to the pool.
                            if let Some(s) = session.take() {
                                self.transport.recycle(s).await;
                            }
                            let Some(stop) = &stop else { break };
                            match queue.next(stop).await {
                                Some(job) => job,
                                None => break,
                            }
                        }
                    };
                    self.ready(job)
                }
            };
            if stop.as_ref().is_some_and(|s| s.is_cancelled()) {
                // Shutting down: nothing new goes out.
                let _ = results.send((self.release(&ready.job.mail), ready.job.slot));
                continue;
            }
            let next = queue.pop().map(|job| self.ready(job));
            let session = session.get_or_insert_with(|| self.transport.session());
            let outcome = self
                .deliver(&ready, next.as_ref().and_then(Ready::as_next), session)
                .await;
            let _ = results.send((outcome, ready.job.slot));
            current = next;
        }
        if let Some(s) = session.take() {
            self.transport.recycle(s).await;
        }
    }

    /// Builds a job's message, or decides its fate without sending.
    fn ready(&self, job: Job) -> Ready {
        let prepared = if job.mail.expired {
            Err(FinalAction::Failed {
                error: "expired".into(),
            })
        } else {
            mail::prepare(&job.mail, &self.defaults).map_err(|e| FinalAction::Failed {
                error: e.to_string(),
            })
        };
        Ready { job, prepared }
    }

    /// What becomes of one claimed mail: sent through `session` if it can go.
    async fn deliver(
        &self,
        ready: &Ready,
        next: Option<Next<'_>>,
        session: &mut Session,
    ) -> Outcome {
        let mail = &ready.job.mail;
        let mut outcome = self.release(mail);
        let prepared = match &ready.prepared {
            Ok(prepared) => prepared,
            Err(action) => {
                outcome.write.action = action.clone();
                return outcome;
            }
        };
        if self.relay.paused_for().is_some() {
            return outcome;
        }
        outcome.recipient_domains = prepared.recipient_domains.clone();
        self.pace.turn().await;
        let started = std::time::Instant::now();
        let sent = self.transport.send(session, mail.id, prepared, next).await;
        outcome.elapsed_ms = started.elapsed().as_millis() as u64;
        match &sent {
            Ok(_) => self.pace.went_through(),
            Err(e) if e.is_throttling() => self.pace.throttled(),
            Err(_) => {}
        }
        let can_retry = mail.attempts_remaining > 0;
        let backoff = || {
            retry::retry_delay(
                mail.attempts.max(1) as u32,
                self.settings.retry_base,
                self.settings.retry_max,
                retry::jitter(),
            )
        };
        outcome.write.action = match sent {
            Ok(delivered) => {
                self.relay.reset();
                outcome.smtp_code = Some(delivered.code);
                outcome.reply = Some(delivered.reply);
                FinalAction::Sent
            }
            Err(e) => {
                outcome.smtp_code = e.code();
                match e {
                    SendError::RelayDown { .. } => {
                        self.relay.trip(&e);
                        FinalAction::Release
                    }
                    SendError::Transient { reason, .. } if can_retry => FinalAction::Retry {
                        delay: backoff(),
                        error: reason,
                    },
                    SendError::Transient { reason, .. } | SendError::Permanent { reason, .. } => {
                        FinalAction::Failed { error: reason }
                    }
                    SendError::Ambiguous { reason } => {
                        outcome.ambiguous = true;
                        let hold = self.settings.ambiguous == Ambiguous::Hold;
                        if hold || !can_retry {
                            FinalAction::Unknown { error: reason }
                        } else {
                            FinalAction::Retry {
                                delay: backoff(),
                                error: reason,
                            }
                        }
                    }
                }
            }
        };
        outcome
    }

    /// Writes outcomes in one fenced statement and logs each. Returns, per
    /// outcome, whether it was written (false: the lock had been taken away).
    async fn commit(&self, outcomes: &[Outcome]) -> Result<Vec<bool>, StoreError> {
        if outcomes.is_empty() {
            return Ok(Vec::new());
        }
        let writes: Vec<Finalize> = outcomes.iter().map(|o| o.write.clone()).collect();
        let written = self.store.finalize(&writes).await?;
        self.database_answered();
        self.held.remove(outcomes.iter().map(|o| o.write.id));
        let written: std::collections::HashSet<i64> = written.into_iter().collect();
        Ok(outcomes
            .iter()
            .map(|o| {
                let ok = written.contains(&o.write.id);
                log_outcome(o, ok);
                self.metrics.record(o, ok);
                ok
            })
            .collect())
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
        chores.spawn(self.clone().renew_locks(background.clone()));
        chores.spawn(self.clone().sweep(background.clone()));
        chores.spawn(self.clone().purge(background.clone()));

        let (results, finalizer_input) = mpsc::unbounded_channel();
        let mut finalizer = tokio::spawn(self.clone().finalize_loop(finalizer_input));
        let queue = Arc::new(MailQueue::default());
        let mut lanes = JoinSet::new();
        for _ in 0..self.settings.concurrency {
            let lane = self
                .clone()
                .lane(queue.clone(), results.clone(), Some(cancel.clone()));
            lanes.spawn(lane);
        }
        self.claim_loop(&cancel, &queue).await;

        // Shutdown: no new claims, no new sends. Mails still queued go back
        // at once; those in flight get `shutdown_timeout` to finish.
        systemd::notify("STOPPING=1");
        for job in queue.drain() {
            let _ = results.send((self.release(&job.mail), job.slot));
        }
        let deadline = Instant::now() + self.settings.shutdown_timeout;
        tracing::info!(in_flight = self.held.len(), "shutting down: draining");
        loop {
            tokio::select! {
                next = lanes.join_next() => if next.is_none() { break },
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(interrupted = lanes.len(), "shutdown timeout: interrupting sends");
                    lanes.abort_all();
                    while lanes.join_next().await.is_some() {}
                    break;
                }
            }
        }
        drop(results);
        // The finalizer retries a failing database; give it a bounded time.
        let committed =
            tokio::time::timeout_at(deadline + Duration::from_secs(10), &mut finalizer).await;
        background.cancel();
        while chores.join_next().await.is_some() {}
        match committed {
            Ok(_) => self.release_remaining().await,
            Err(_) => {
                finalizer.abort();
                tracing::error!(
                    rows = self.held.len(),
                    "database unavailable at shutdown: outcomes not written; \
                     any daemon releases these rows after worker.lock_timeout"
                )
            }
        }
        self.transport.close().await;
        tracing::info!("worker stopped");
    }

    /// Keeps the lanes' queue filled with claimed rows.
    async fn claim_loop(self: &Arc<Self>, cancel: &CancellationToken, queue: &MailQueue) {
        let batch = self.settings.batch_size;
        // Claimed-but-unfinished rows: enough to keep every connection busy
        // while the next claim and the last commit are on their way.
        let slots = Arc::new(Semaphore::new(2 * self.settings.concurrency + 4 * batch));
        // Under load, claim at least half a batch at a time, not a row per
        // freed slot: one round-trip per row would cap throughput.
        let min_claim = (batch / 2).max(1);
        let mut more_due = true;
        let mut db_failures = 0u32;
        loop {
            if !more_due {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(self.settings.poll_interval) => {}
                }
            }
            if let Some(pause) = self.relay.paused_for() {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
            let mut permits = tokio::select! {
                _ = cancel.cancelled() => return,
                p = slots.clone().acquire_many_owned(min_claim as u32) => p.expect("never closed"),
            };
            let extra = slots.available_permits().min(batch - min_claim);
            if extra > 0 {
                if let Ok(more) = slots.clone().try_acquire_many_owned(extra as u32) {
                    permits.merge(more);
                }
            }
            let want = self.relay.claim_limit(permits.num_permits());
            let mails = match self.claim(want).await {
                Ok(mails) => {
                    db_failures = 0;
                    mails
                }
                Err(e) => {
                    db_failures += 1;
                    let pause = retry::relay_pause(db_failures, retry::jitter())
                        .min(Duration::from_secs(30));
                    tracing::error!(error = %e, retry_in_ms = pause.as_millis() as u64, "database unavailable");
                    drop(permits);
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(pause) => {}
                    }
                    more_due = true;
                    continue;
                }
            };
            more_due = mails.len() == want;
            queue.push(mails.into_iter().map(|mail| Job {
                mail,
                slot: permits.split(1),
            }));
        }
    }

    /// The outcome of a row given back unsent, its attempt refunded.
    fn release(&self, mail: &QueuedMail) -> Outcome {
        Outcome {
            write: Finalize {
                id: mail.id,
                lock: mail.lock,
                action: FinalAction::Release,
            },
            attempt: mail.attempts,
            smtp_code: None,
            elapsed_ms: 0,
            recipient_domains: String::new(),
            reply: None,
            ambiguous: false,
        }
    }

    /// Group commit: writes every outcome that is ready in one statement.
    /// A database error is retried (the commit, never the send).
    async fn finalize_loop(
        self: Arc<Self>,
        mut input: mpsc::UnboundedReceiver<(Outcome, Option<OwnedSemaphorePermit>)>,
    ) {
        const MAX_GROUP: usize = 1000;
        // Under load, wait a moment for a fuller group: each statement and
        // commit costs the database far more than one more row in it.
        let (fill, linger) = (
            self.settings.batch_size,
            Duration::from_millis(FINALIZE_LINGER_MS),
        );
        let mut group = Vec::with_capacity(MAX_GROUP);
        while input.recv_many(&mut group, MAX_GROUP).await > 0 {
            if group.len() < fill {
                let deadline = tokio::time::Instant::now() + linger;
                while group.len() < fill {
                    match tokio::time::timeout_at(deadline, input.recv_many(&mut group, MAX_GROUP))
                        .await
                    {
                        Ok(n) if n > 0 => {}
                        _ => break,
                    }
                }
            }
            let (outcomes, slots): (Vec<Outcome>, Vec<Option<OwnedSemaphorePermit>>) =
                group.drain(..).unzip();
            let mut failures = 0u32;
            while let Err(e) = self.commit(&outcomes).await {
                failures += 1;
                let pause =
                    retry::relay_pause(failures, retry::jitter()).min(Duration::from_secs(10));
                tracing::error!(error = %e, rows = outcomes.len(), retry_in_ms = pause.as_millis() as u64,
                    "database unavailable: outcome not written yet");
                tokio::time::sleep(pause).await;
            }
            // Frees the buffer slots of these rows.
            drop(slots);
        }
    }

    /// Tells systemd the worker is alive, but only while the database answers
    /// its claims and commits (an idle worker still claims every poll).
    async fn watchdog(self: Arc<Self>, interval: Duration, stop: CancellationToken) {
        let alive = interval.max(self.settings.poll_interval * 3);
        loop {
            if self.database_answered_within(alive) {
                systemd::notify("WATCHDOG=1");
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval / 3) => {}
            }
        }
    }

    /// Renews `locked_at` of held rows, so only a dead worker's rows go stale.
    async fn renew_locks(self: Arc<Self>, stop: CancellationToken) {
        let every = self.settings.lock_timeout / 3;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let locks = self.held.locks();
            if let Err(e) = self.store.renew_locks(&locks).await {
                tracing::warn!(error = %e, "lock renewal failed");
            }
        }
    }

    /// Releases the stale locks of dead or stuck workers.
    async fn sweep(self: Arc<Self>, stop: CancellationToken) {
        let every =
            (self.settings.lock_timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
        loop {
            match self
                .store
                .release_stale_locks(self.settings.lock_timeout)
                .await
            {
                Ok(rows) if !rows.is_empty() => {
                    let requeued = rows.iter().filter(|r| r.requeued).count();
                    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
                    tracing::warn!(
                        count = rows.len(),
                        requeued,
                        failed = rows.len() - requeued,
                        ids = ?ids,
                        outcome = "released",
                        "stale locks released"
                    );
                    self.wake.notify_one();
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "stale lock sweep failed"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    /// Deletes finished rows past their retention, a bounded batch per
    /// statement and a little every few seconds, so the table stays small
    /// under a constant stream without bursts of deletes; and, every half
    /// minute, lets the store vacuum if the database does not.
    async fn purge(self: Arc<Self>, stop: CancellationToken) {
        const PURGE_BATCH: usize = 1000;
        const PURGE_EVERY: Duration = Duration::from_secs(5);
        const MAINTAIN_EVERY: Duration = Duration::from_secs(30);
        let mut last_maintained = Instant::now();
        let mut warned = false;
        loop {
            let mut purged = 0;
            while !stop.is_cancelled() {
                match self
                    .store
                    .purge(self.retention.sent, self.retention.failed, PURGE_BATCH)
                    .await
                {
                    Ok(n) => {
                        purged += n;
                        if (n as usize) < PURGE_BATCH {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "retention purge failed");
                        break;
                    }
                }
            }
            if purged > 0 {
                tracing::debug!(count = purged, "finished rows purged");
            }
            if last_maintained.elapsed() >= MAINTAIN_EVERY {
                last_maintained = Instant::now();
                match self.store.maintain().await {
                    Ok(Some(Maintenance::Vacuumed {
                        dead_rows,
                        autovacuum,
                    })) => tracing::info!(dead_rows, autovacuum, "table maintenance: vacuumed"),
                    Ok(Some(Maintenance::CannotVacuum { dead_rows })) if !warned => {
                        warned = true;
                        tracing::warn!(
                            dead_rows,
                            "table maintenance: dead rows pile up and autovacuum does not clear \
                             them; this role may not VACUUM mail_queue (claims will slow down)"
                        );
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "table maintenance failed"),
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(PURGE_EVERY) => {}
            }
        }
    }

    /// After the drain: rows still held (interrupted or never committed) go
    /// back to `queued` with their attempt refunded.
    async fn release_remaining(&self) {
        let rows = self.held.all();
        if rows.is_empty() {
            return;
        }
        let writes: Vec<Finalize> = rows
            .iter()
            .map(|(id, lock)| Finalize {
                id: *id,
                lock: *lock,
                action: FinalAction::Release,
            })
            .collect();
        for attempt in 1..=5u32 {
            match self.store.finalize(&writes).await {
                Ok(done) => {
                    tracing::info!(
                        count = done.len(),
                        outcome = "released",
                        "unsent mails released"
                    );
                    self.held.remove(rows.iter().map(|(id, _)| *id));
                    return;
                }
                Err(e) => {
                    tracing::error!(error = %e, attempt, "could not release unsent mails");
                    tokio::time::sleep(Duration::from_millis(500 * attempt as u64)).await;
                }
            }
        }
        tracing::error!(
            count = rows.len(),
            "unsent mails stay locked; any daemon releases them after worker.lock_timeout"
        );
    }
}

fn log_outcome(o: &Outcome, written: bool) {
    let id = o.write.id;
    let lock = &o.write.lock;
    if !written {
        tracing::warn!(
            mail_id = id,
            %lock,
            attempt = o.attempt,
            "mail lock lost: outcome not written"
        );
        return;
    }
    let code = o.smtp_code;
    let elapsed = o.elapsed_ms;
    let domain = o.recipient_domains.as_str();
    match &o.write.action {
        FinalAction::Sent => {
            let reply = o.reply.as_deref().map(redact_addresses);
            tracing::info!(
                mail_id = id,
                %lock,
                attempt = o.attempt,
                outcome = "sent",
                smtp_code = code,
                elapsed_ms = elapsed,
                domain,
                reply,
                "mail sent"
            )
        }
        FinalAction::Retry { delay, error } => {
            let outcome = if o.ambiguous { "ambiguous" } else { "retry" };
            tracing::warn!(mail_id = id, %lock, attempt = o.attempt, outcome, smtp_code = code,
                elapsed_ms = elapsed, domain, retry_in_ms = delay.as_millis() as u64,
                error = %redact_addresses(error), "mail retry scheduled")
        }
        FinalAction::Failed { error } => {
            tracing::warn!(mail_id = id, %lock, attempt = o.attempt, outcome = "failed", smtp_code = code,
                elapsed_ms = elapsed, domain, error = %redact_addresses(error), "mail failed")
        }
        FinalAction::Unknown { error } => {
            tracing::warn!(mail_id = id, %lock, attempt = o.attempt, outcome = "ambiguous", smtp_code = code,
                elapsed_ms = elapsed, domain, error = %redact_addresses(error), "mail held as unknown")
        }
        FinalAction::Release => {
            tracing::info!(
                mail_id = id,
                %lock,
                attempt = o.attempt,
                outcome = "released",
                "mail released"
            )
        }
    }
}
