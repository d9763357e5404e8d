//! The pipeline, the same whether the daemon runs it or a test drives one
//! batch through it: claimed rows wait in a [`JobQueue`]; `lanes` (one per
//! `worker.concurrency`) each own an SMTP session and send the mails one
//! after the other, the next mail's envelope riding along with the current
//! one's end of data; the [`finalize`](Worker::finalize_loop) step writes the
//! outcomes that are ready in one fenced statement (group commit), retrying
//! the write, never the send.
//!
//! Stopping: no new claims, queued rows go back unspent, sends in flight get
//! `worker.shutdown_timeout`; after that they are cut off and judged by the
//! stage they reached (after "." is ambiguous, before it is released).
//!
//! The lane, the finalizer and the drain share their types and read best
//! as one story, so they are kept in one file. Making a claimed row ready
//! to send (loading and building its message) is [`ready`](super::ready).

use std::{panic::AssertUnwindSafe, sync::Arc, time::Duration};

use futures_util::FutureExt;
use tokio::{sync::mpsc, task::JoinSet, time::Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::{
    mail,
    smtp::{Outgoing, Session, Stage},
    store::{CapCheck, Event, FinalAction, Finalize, StoreError},
};

use super::{
    outcome::{self, Attempt, CutOff, Decision, Hold, RelaySignal, Row},
    queue::JobQueue,
    ready::Ready,
    report::{log_outcome, panic_text},
    retry,
    route::RouteId,
    BatchReport, Worker,
};

/// How long the finalizer waits for more outcomes before writing a group.
const FINALIZE_LINGER: Duration = Duration::from_millis(10);
/// Most outcomes in one statement.
const MAX_GROUP: usize = 1000;
/// One mail's fate, on its way to the group commit.
pub(super) struct Done {
    pub(super) id: i64,
    pub(super) lock: crate::store::BatchLock,
    pub(super) decision: Decision,
    pub(super) smtp_code: Option<u16>,
    /// The relay's reply to "." when it took the mail.
    pub(super) reply: Option<String>,
    /// The history row written with the outcome, if any.
    pub(super) event: Option<Event>,
    /// How long the SMTP transaction took, if there was one.
    pub(super) send_time: Option<Duration>,
    /// Recipient domains, for the log line (never the full address).
    pub(super) domains: String,
    /// Which relay took it (`primary`, `fallback`), when one did.
    pub(super) relay: Option<&'static str>,
    /// The mail's span, for the outcome's log line.
    pub(super) span: tracing::Span,
    /// Its attachments' bytes, counted when it is written as sent.
    pub(super) attachment_bytes: u64,
    /// The send caps it holds room under (DESIGN §16), and whether its
    /// send surely did not go out (the room is given back).
    pub(super) caps: Option<(Vec<String>, bool)>,
}

impl Done {
    /// The write that records this outcome.
    fn finalize(&self) -> Finalize {
        Finalize {
            id: self.id,
            lock: self.lock,
            action: self.decision.action.clone(),
            relay_reply: match (&self.decision.action, self.smtp_code, &self.reply) {
                (FinalAction::Sent, Some(code), Some(reply)) => Some(format!("{code} {reply}")),
                _ => None,
            },
            event: self.event.clone(),
        }
    }
}

/// The signals that stop a pipeline.
#[derive(Clone, Default)]
pub(super) struct Stop {
    /// Take no new rows.
    pub(super) taking: CancellationToken,
    /// Cut off the sends in flight.
    pub(super) sending: CancellationToken,
}

impl Worker {
    /// Sends claimed rows from `queue` until it is closed and empty, or
    /// `stop.taking` fires (the rows then still queued go back unsent).
    pub(super) async fn lane(
        self: Arc<Self>,
        queue: Arc<JobQueue>,
        results: mpsc::UnboundedSender<Done>,
        stop: Stop,
    ) {
        // The session, and the route it is a session of.
        let mut session: Option<(RouteId, Session)> = None;
        let mut current: Option<Ready> = None;
        loop {
            let ready = match current.take() {
                Some(ready) => ready,
                None => {
                    let job = match queue.pop() {
                        Some(job) => job,
                        None => {
                            // Idle: the connection goes back to the pool.
                            if let Some((route, s)) = session.take() {
                                self.routes.get(route).transport.recycle(s).await;
                            }
                            match queue.next(&stop.taking).await {
                                Some(job) => job,
                                None => break,
                            }
                        }
                    };
                    self.ready(job).await
                }
            };
            if stop.taking.is_cancelled() {
                // Stopping: nothing new goes out.
                let done = self.judge(&ready, Attempt::Held(Hold::ShuttingDown), None, 0);
                let _ = results.send(done);
                continue;
            }
            let next = match queue.pop() {
                Some(job) => Some(self.ready(job).await),
                None => None,
            };
            let route = self.routes.get(ready.route);
            if let Some((other, s)) = session.take_if(|(r, _)| *r != ready.route) {
                // Another route's mail: its session goes back to its pool.
                self.routes.get(other).transport.recycle(s).await;
            }
            let (_, session) =
                session.get_or_insert_with(|| (ready.route, route.transport.session()));
            let since = route.relay.successes();
            let started = std::time::Instant::now();
            // The next mail's envelope rides along only on its own route.
            let ahead = next
                .as_ref()
                .filter(|n| n.route == ready.route)
                .and_then(Ready::outgoing);
            let sending = AssertUnwindSafe(self.attempt(&ready, ahead, session))
                .catch_unwind()
                .instrument(ready.span.clone());
            let attempt = tokio::select! {
                attempt = sending => Some(attempt),
                _ = stop.sending.cancelled() => None,
            };
            let attempt = match attempt {
                Some(Ok(attempt)) => attempt,
                Some(Err(panic)) => {
                    let stage = session.cut_off();
                    let _in = ready.span.enter();
                    tracing::error!(
                        panic = panic_text(&panic),
                        stage = %stage,
                        "sender crashed"
                    );
                    Attempt::CutOff {
                        stage,
                        by: CutOff::Crash,
                    }
                }
                None => Attempt::CutOff {
                    stage: session.cut_off(),
                    by: CutOff::Shutdown,
                },
            };
            let send_time = match &attempt {
                Attempt::Delivered(_) | Attempt::Failed(_) | Attempt::CutOff { .. } => {
                    Some(started.elapsed())
                }
                _ => None,
            };
            let done = self.judge(&ready, attempt, send_time, since);
            let _ = results.send(done);
            if stop.sending.is_cancelled() {
                // Cut off: whatever rode along is released with the queue.
                if let Some(next) = next {
                    let done = self.judge(&next, Attempt::Held(Hold::ShuttingDown), None, 0);
                    let _ = results.send(done);
                }
                break;
            }
            current = next;
        }
        if let Some((route, s)) = session.take() {
            self.routes.get(route).transport.recycle(s).await;
        }
    }

    /// How far one mail gets: held back, or sent through `session`.
    async fn attempt(
        &self,
        ready: &Ready,
        next: Option<Outgoing<'_>>,
        session: &mut Session,
    ) -> Attempt {
        let prepared = match &ready.prepared {
            Ok(prepared) => prepared,
            Err(attempt) => return attempt.clone(),
        };
        let route = self.routes.get(ready.route);
        if let Some(wait) = route.relay.paused_for() {
            // With one route, claims stop while it is paused: the row goes
            // back at once. With several, the others go on claiming, and the
            // row waits out the pause instead of being claimed again.
            return Attempt::Held(match self.routes.len() {
                1 => Hold::RelayPaused,
                _ => Hold::RoutePaused {
                    route: route.label().to_string(),
                    wait,
                },
            });
        }
        if let Some((domain, wait)) = route.throttles.paused(prepared.domains()) {
            return Attempt::Held(Hold::DomainThrottled { domain, wait });
        }
        self.pace.turn().await;
        let outgoing = ready.outgoing().expect("prepared");
        match route.transport.send(session, outgoing, next).await {
            Ok(delivered) => Attempt::Delivered(delivered),
            Err(e) => Attempt::Failed(e),
        }
    }

    /// Decides a mail's fate and applies what it tells about the relay.
    fn judge(
        &self,
        ready: &Ready,
        attempt: Attempt,
        send_time: Option<Duration>,
        since: u64,
    ) -> Done {
        let _in = ready.span.enter();
        let mail = &ready.mail;
        let domains: &[String] = match &ready.prepared {
            Ok(prepared) => &prepared.recipient_domains,
            Err(_) => &[],
        };
        let domain_names = || domains.iter().map(String::as_str);
        let route = self.routes.get(ready.route);
        let refused_mid_transaction = matches!(&attempt, Attempt::Failed(e)
            if e.stage.in_transaction() && outcome::classify(e) == outcome::Class::RelayDown);
        let view = if refused_mid_transaction {
            route.relay.refusal(since)
        } else {
            route.relay.view(since)
        };
        let row = Row {
            attempts: mail.attempts,
            attempts_remaining: mail.attempts_remaining,
            relay_down_count: mail.relay_down_count,
        };
        let decision = outcome::decide(&attempt, row, view, &self.policy, retry::jitter());
        let event = outcome::history(&attempt, &decision.action).map(|(outcome, stage)| Event {
            attempt: mail.attempts,
            outcome,
            stage,
            smtp_code: match &attempt {
                Attempt::Failed(e) => e.code(),
                _ => None,
            },
            detail: match (&attempt, &decision.action) {
                // A refunded try leaves last_error alone; its history row
                // says what the relay answered.
                (Attempt::Failed(e), FinalAction::Release) => Some(e.to_string()),
                _ => None,
            },
        });
        let (mut smtp_code, mut reply, mut relay) = (None, None, None);
        match &attempt {
            Attempt::Delivered(d) => {
                smtp_code = Some(d.code);
                reply = Some(d.reply.clone());
                relay = Some(d.relay.as_str());
                self.metrics.sent_through(route.label(), d.relay);
                route.throttles.went_through(domain_names());
                self.pace.went_through();
            }
            Attempt::Failed(e) => {
                smtp_code = e.code();
                if e.is_throttling() && e.stage.in_transaction() {
                    // A refusal of MAIL comes before any recipient is named:
                    // it is about the sender or the relay as a whole, never
                    // a recipient domain. Pausing the domains for it only
                    // had their mails claimed and deferred unsent once the
                    // relay gate opened again.
                    let whole_relay = if e.stage == Stage::MailFrom {
                        route.throttles.throttled([])
                    } else {
                        route.throttles.throttled(domain_names())
                    };
                    if whole_relay {
                        self.pace.throttled();
                    }
                }
            }
            _ => {}
        }
        match decision.relay {
            RelaySignal::WentThrough => self.relay_went_through(route),
            RelaySignal::Down { needs_operator } => {
                let Attempt::Failed(e) = &attempt else {
                    unreachable!("only a failed send says the relay is down")
                };
                self.relay_unavailable(route, e, needs_operator, !e.stage.in_transaction());
            }
            RelaySignal::ConfigFault => match &attempt {
                Attempt::Held(Hold::UnknownRoute(name)) => tracing::error!(
                    route = %name,
                    "configuration fault: mail names a route that is not configured: it waits"
                ),
                _ => tracing::error!(
                    error = %mail::MailError::NoSender,
                    "configuration fault: mail waits until defaults.from_address is set"
                ),
            },
            RelaySignal::Quiet => {}
        }
        Done {
            id: mail.id,
            lock: mail.lock,
            decision,
            smtp_code,
            reply,
            event,
            send_time,
            domains: domains.join(","),
            relay,
            span: ready.span.clone(),
            attachment_bytes: mail.sizes.attachment_bytes,
            caps: match &mail.caps {
                CapCheck::Reserved(caps) => {
                    Some((caps.clone(), super::limits::surely_unsent(&attempt)))
                }
                _ => None,
            },
        }
    }

    /// Group commit: writes every outcome that is ready in one statement.
    /// A database error is retried (the commit, never the send) until it
    /// succeeds or `give_up` fires. Returns what was written, and the
    /// outcomes it gave up on.
    pub(super) async fn finalize_loop(
        self: Arc<Self>,
        mut input: mpsc::UnboundedReceiver<Done>,
        give_up: CancellationToken,
    ) -> (BatchReport, Vec<Done>) {
        // Under load, wait a moment for a fuller group: each statement and
        // commit costs the database far more than one more row in it.
        let fill = self.settings.batch_size;
        let mut report = BatchReport::default();
        let mut group = Vec::with_capacity(MAX_GROUP);
        while input.recv_many(&mut group, MAX_GROUP).await > 0 {
            if group.len() < fill {
                let deadline = Instant::now() + FINALIZE_LINGER;
                while group.len() < fill {
                    match tokio::time::timeout_at(deadline, input.recv_many(&mut group, MAX_GROUP))
                        .await
                    {
                        Ok(n) if n > 0 => {}
                        _ => break,
                    }
                }
            }
            let mut failures = 0u32;
            loop {
                match self.commit(&group, failures > 0).await {
                    Ok(written) => {
                        for (done, written) in group.iter().zip(written) {
                            report.add(&done.decision.action, written);
                        }
                        break;
                    }
                    Err(e) => {
                        failures += 1;
                        let pause = retry::relay_pause(failures, retry::jitter())
                            .min(Duration::from_secs(10));
                        tracing::error!(error = %e, rows = group.len(), retry_in_ms = pause.as_millis() as u64,
                            "{}: outcome not written yet", e.summary());
                        tokio::select! {
                            _ = give_up.cancelled() => {
                                // What is still waiting in the channel was
                                // decided too: keep every decision.
                                input.close();
                                while let Ok(done) = input.try_recv() {
                                    group.push(done);
                                }
                                return (report, group);
                            }
                            _ = tokio::time::sleep(pause) => {}
                        }
                    }
                }
            }
            group.clear();
            // Room for the claimer.
            self.freed.notify_one();
        }
        (report, Vec::new())
    }

    /// Writes outcomes in one fenced statement and logs each. Returns, per
    /// outcome, whether it was written (false: the lock had been taken away).
    ///
    /// `retried`: an earlier try of this group failed, and may have failed
    /// only to answer: a row it wrote is now unlocked in the state it was
    /// given, which the fenced statement no longer finds. Such rows are
    /// looked up and counted as written, not as locks lost.
    async fn commit(&self, group: &[Done], retried: bool) -> Result<Vec<bool>, StoreError> {
        if group.is_empty() {
            return Ok(Vec::new());
        }
        let writes: Vec<Finalize> = group.iter().map(Done::finalize).collect();
        let mut written: std::collections::HashSet<i64> =
            self.store.finalize(&writes).await?.into_iter().collect();
        self.database_answered();
        if retried && written.len() < writes.len() {
            let missing: Vec<i64> = writes
                .iter()
                .map(|w| w.id)
                .filter(|id| !written.contains(id))
                .collect();
            let unlocked: std::collections::HashMap<i64, String> = self
                .store
                .unlocked_rows(&missing)
                .await?
                .into_iter()
                .map(|u| (u.id, u.status))
                .collect();
            let before = written.len();
            written.extend(
                writes
                    .iter()
                    .filter(|w| {
                        unlocked.get(&w.id).map(String::as_str) == Some(w.action.columns().status)
                    })
                    .map(|w| w.id),
            );
            if written.len() > before {
                tracing::info!(
                    rows = written.len() - before,
                    "outcomes already written by the try whose answer was lost"
                );
            }
        }
        self.held.remove(group.iter().map(|d| d.id));
        self.settle_group(group).await;
        Ok(group
            .iter()
            .map(|d| {
                let ok = written.contains(&d.id);
                log_outcome(d, ok);
                if ok && d.decision.action == FinalAction::Sent {
                    self.metrics.attachments_sent(d.attachment_bytes);
                }
                self.metrics
                    .record(if ok { Some(d.decision.logged) } else { None }, d.send_time);
                ok
            })
            .collect())
    }

    /// The send caps' reservations of these outcomes, once written: one
    /// settlement per cap and claim.
    async fn settle_group(&self, group: &[Done]) {
        let mut counts: std::collections::BTreeMap<(&str, crate::store::BatchLock), (u64, u64)> =
            Default::default();
        for d in group {
            let Some((caps, unsent)) = &d.caps else {
                continue;
            };
            for name in caps {
                let (sent, given_back) = counts.entry((name.as_str(), d.lock)).or_default();
                if *unsent {
                    *given_back += 1;
                } else {
                    *sent += 1;
                }
            }
        }
        let settles = counts
            .into_iter()
            .map(|((name, lock), (sent, unsent))| crate::store::CapSettle {
                name: name.to_string(),
                lock,
                sent,
                unsent,
            })
            .collect();
        self.settle_caps(settles).await;
    }

    /// Runs the lanes and the finalizer on `queue` while `feed` fills it,
    /// then drains: if `stop.taking` fired, rows never started go back at
    /// once and sends in flight get `shutdown` to finish before they are cut
    /// off; otherwise the lanes empty the queue. Every outcome is committed,
    /// and whatever is still held at the end is released.
    pub(super) async fn drain(
        self: &Arc<Self>,
        queue: Arc<JobQueue>,
        lanes: usize,
        stop: Stop,
        feed: impl std::future::Future<Output = ()>,
        shutdown: Duration,
    ) -> BatchReport {
        let renewal = CancellationToken::new();
        let renewing = tokio::spawn(self.clone().renew_locks(renewal.clone()));
        let (results, finalizer_input) = mpsc::unbounded_channel();
        let give_up = CancellationToken::new();
        let mut finalizer =
            tokio::spawn(self.clone().finalize_loop(finalizer_input, give_up.clone()));
        let mut senders = JoinSet::new();
        for _ in 0..lanes {
            senders.spawn(
                self.clone()
                    .lane(queue.clone(), results.clone(), stop.clone()),
            );
        }
        feed.await;
        queue.close();
        let stopping = stop.taking.is_cancelled();
        if stopping {
            // Rows never started go back at once, unread.
            for mail in queue.drain() {
                let ready = Ready::held(mail, Attempt::Held(Hold::ShuttingDown));
                let _ =
                    results.send(self.judge(&ready, Attempt::Held(Hold::ShuttingDown), None, 0));
            }
            tracing::info!(in_flight = self.held.len(), "shutting down: draining");
        }
        let deadline = Instant::now() + shutdown;
        loop {
            tokio::select! {
                next = senders.join_next() => if next.is_none() { break },
                _ = tokio::time::sleep_until(deadline), if stopping && !stop.sending.is_cancelled() => {
                    tracing::warn!(interrupted = senders.len(), "shutdown timeout: interrupting sends");
                    stop.sending.cancel();
                }
            }
        }
        drop(results);
        // When stopping, the finalizer gets a bounded time to retry a failing
        // database; otherwise it keeps at it until the database answers.
        let (report, unwritten) = if stopping {
            let limit = deadline.max(Instant::now()) + Duration::from_secs(10);
            match tokio::time::timeout_at(limit, &mut finalizer).await {
                Ok(done) => done,
                Err(_) => {
                    give_up.cancel();
                    finalizer.await
                }
            }
        } else {
            finalizer.await
        }
        .expect("the finalizer does not panic");
        if !self.held.is_empty() {
            self.release_remaining(unwritten).await;
        }
        renewal.cancel();
        let _ = renewing.await;
        report
    }

    /// After the drain: the outcomes the finalizer could not write are tried
    /// once more as they were decided (a mail the relay took stays sent, an
    /// ambiguous one stays ambiguous: releasing those would send them again);
    /// rows held without a decision go back to `queued` unspent. What cannot
    /// be written now waits for the stale-lock sweep of any daemon.
    async fn release_remaining(&self, decided: Vec<Done>) {
        let decided_ids: std::collections::HashSet<i64> = decided.iter().map(|d| d.id).collect();
        let mut writes: Vec<Finalize> = decided.iter().map(Done::finalize).collect();
        writes.extend(
            self.held
                .all()
                .into_iter()
                .filter(|(id, _)| !decided_ids.contains(id))
                .map(|(id, lock)| Finalize {
                    id,
                    lock,
                    action: FinalAction::Release,
                    relay_reply: None,
                    event: None,
                }),
        );
        for attempt in 1..=5u32 {
            match self.store.finalize(&writes).await {
                Ok(done) => {
                    tracing::info!(
                        count = done.len(),
                        decided = decided.len(),
                        "outcomes written at shutdown, unsent mails released"
                    );
                    for d in &decided {
                        log_outcome(d, done.contains(&d.id));
                    }
                    self.settle_group(&decided).await;
                    self.held.remove(writes.iter().map(|w| w.id));
                    return;
                }
                Err(e) => {
                    tracing::error!(error = %e, attempt, "could not write the last outcomes");
                    tokio::time::sleep(Duration::from_millis(500 * attempt as u64)).await;
                }
            }
        }
        tracing::error!(
            count = writes.len(),
            "database unavailable at shutdown: mails stay locked; any daemon releases them after worker.lock_timeout (a mail already sent goes out again, with the same Message-ID)"
        );
    }
}
