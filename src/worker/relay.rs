//! The relay gate: whether the relay takes mail, as far as this daemon knows.
//! When it is found unavailable, sending pauses with exponential backoff
//! (1 s, 2 s, 4 s … up to 60 s); after a pause, a relay that could not be
//! reached is probed (connect, EHLO, QUIT) before any row is claimed, so an
//! outage never claims and releases whole batches. Successes are counted, so
//! the outcome policy can tell a refusal that only one row draws from one the
//! whole relay gives.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Mutex,
    },
    time::Duration,
};

use tokio::time::Instant;

use super::{outcome::RelayView, retry};

/// A success this recent says the relay works.
const RECENT: Duration = Duration::from_secs(5);
/// The longest pause after refusals mid-transaction (connection failures
/// back off up to a minute).
const MAX_REFUSAL_PAUSE: Duration = Duration::from_secs(4);

#[derive(Debug)]
pub struct RelayGate {
    state: Mutex<GateState>,
    /// Mirrors `state.failures != 0`, so that the common case (the relay
    /// answers) takes no lock.
    troubled: AtomicBool,
    /// Mails that went through since start.
    successes: AtomicU64,
    born: Instant,
    /// When the last mail went through, in ms since `born` (0: never).
    last_success_ms: AtomicU64,
}

#[derive(Debug, Default)]
struct GateState {
    failures: u32,
    paused_until: Option<Instant>,
    /// Why the relay is unavailable (for /healthz and status).
    reason: Option<String>,
    /// The relay could not be reached: probe it before claiming.
    probe_first: bool,
    /// Mails refused mid-transaction since the last success.
    refusals_in_a_row: u32,
}

impl Default for RelayGate {
    fn default() -> Self {
        RelayGate {
            state: Mutex::default(),
            troubled: AtomicBool::new(false),
            successes: AtomicU64::new(0),
            born: Instant::now(),
            last_success_ms: AtomicU64::new(0),
        }
    }
}

impl RelayGate {
    /// Time left in the current pause, if any.
    pub fn paused_for(&self) -> Option<Duration> {
        if !self.troubled.load(Ordering::Relaxed) {
            return None;
        }
        let state = self.state.lock().unwrap();
        let until = state.paused_until?;
        let now = Instant::now();
        (until > now).then(|| until - now)
    }

    /// How long ago the last mail went through, if one did.
    pub fn last_success_age(&self) -> Option<Duration> {
        match self.last_success_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(
                self.born
                    .elapsed()
                    .saturating_sub(Duration::from_millis(ms)),
            ),
        }
    }

    /// Whether the relay answered the last attempt (for health checks).
    pub fn is_up(&self) -> bool {
        !self.troubled.load(Ordering::Relaxed)
    }

    /// Why the relay is unavailable, if it is.
    pub fn trouble(&self) -> Option<String> {
        if self.is_up() {
            return None;
        }
        self.state.lock().unwrap().reason.clone()
    }

    /// Whether the pause is over and the relay should be probed before rows
    /// are claimed for it.
    pub fn wants_probe(&self) -> bool {
        self.troubled.load(Ordering::Relaxed) && self.state.lock().unwrap().probe_first
    }

    /// Mails that went through so far; a send notes it when it starts.
    pub fn successes(&self) -> u64 {
        self.successes.load(Ordering::Relaxed)
    }

    /// What the relay did for other mails lately, seen by a mail whose send
    /// started when `successes()` was `since`.
    pub fn view(&self, since: u64) -> RelayView {
        let state = self.state.lock().unwrap();
        self.view_locked(&state, since)
    }

    fn view_locked(&self, state: &GateState, since: u64) -> RelayView {
        let last = self.last_success_ms.load(Ordering::Relaxed);
        let recent = last > 0
            && self
                .born
                .elapsed()
                .saturating_sub(Duration::from_millis(last))
                <= RECENT;
        RelayView {
            others_went_through: self.successes() > since || recent,
            refusals_in_a_row: state.refusals_in_a_row,
        }
    }

    /// A mail was refused in the middle of its transaction (a 421): the view
    /// the policy decides on, and the refusal counted, in one step (two
    /// refusals at once must not both believe they are the first).
    pub fn refusal(&self, since: u64) -> RelayView {
        let mut state = self.state.lock().unwrap();
        let view = self.view_locked(&state, since);
        state.refusals_in_a_row += 1;
        view
    }

    /// The relay cannot take mail: start (or keep) a pause. Logs once per
    /// pause; at error level when an operator must act (TLS, AUTH).
    pub fn trip(
        &self,
        reason: &str,
        needs_operator: bool,
        probe_first: bool,
        smtp_code: Option<u16>,
    ) {
        let mut state = self.state.lock().unwrap();
        let now = Instant::now();
        if state.paused_until.is_some_and(|until| until > now) {
            return;
        }
        state.failures += 1;
        state.probe_first = probe_first;
        state.reason = Some(reason.to_string());
        self.troubled.store(true, Ordering::Relaxed);
        let mut pause = retry::relay_pause(state.failures, retry::jitter());
        if !probe_first {
            // Refusals in the middle of transactions are often throttling
            // that ends by itself: look again soon, with real mail.
            pause = pause.min(MAX_REFUSAL_PAUSE);
        }
        state.paused_until = Some(now + pause);
        let pause_ms = pause.as_millis() as u64;
        if needs_operator {
            tracing::error!(error = %reason, smtp_code, pause_ms, "relay unavailable");
        } else {
            tracing::warn!(error = %reason, smtp_code, pause_ms, "relay unavailable");
        }
    }

    /// A probe found the relay answering: rows may be claimed again. The
    /// pause lengths are kept until a mail goes through.
    pub fn probed(&self) {
        let mut state = self.state.lock().unwrap();
        state.probe_first = false;
        state.paused_until = None;
    }

    /// A mail went through: the relay works.
    pub fn went_through(&self) {
        self.successes.fetch_add(1, Ordering::Relaxed);
        let ms = self.born.elapsed().as_millis().max(1) as u64;
        self.last_success_ms.store(ms, Ordering::Relaxed);
        let mut state = self.state.lock().unwrap();
        state.refusals_in_a_row = 0;
        if self.troubled.load(Ordering::Relaxed) {
            if state.failures > 0 {
                tracing::info!(failures = state.failures, "relay available again");
            }
            *state = GateState::default();
            self.troubled.store(false, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn pauses_grow_and_a_success_ends_them() {
        let gate = RelayGate::default();
        assert!(gate.is_up() && gate.paused_for().is_none());
        gate.trip("connect: refused", false, true, None);
        assert!(!gate.is_up());
        assert!(gate.wants_probe());
        let first = gate.paused_for().unwrap();
        assert!(first <= Duration::from_millis(1250), "{first:?}");
        // Tripping again during the pause changes nothing.
        gate.trip("connect: refused", false, true, None);
        assert_eq!(gate.paused_for().unwrap(), first);
        tokio::time::advance(first).await;
        gate.trip("connect: refused", false, true, None);
        let second = gate.paused_for().unwrap();
        assert!(second > first, "{second:?} after {first:?}");
        assert_eq!(gate.trouble().as_deref(), Some("connect: refused"));
        gate.went_through();
        assert!(gate.is_up() && gate.paused_for().is_none() && !gate.wants_probe());
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_in_a_row_end_with_a_success() {
        let gate = RelayGate::default();
        let since = gate.successes();
        assert_eq!(gate.refusal(since), RelayView::default());
        assert_eq!(gate.refusal(since).refusals_in_a_row, 1);
        gate.went_through();
        let view = gate.refusal(since);
        assert!(view.others_went_through);
        assert_eq!(view.refusals_in_a_row, 0);
        // Long after the last success, and none during this send.
        tokio::time::advance(Duration::from_secs(10)).await;
        let view = gate.view(gate.successes());
        assert!(!view.others_went_through);
    }
}
