//! The sending pace of one daemon: `worker.rate_limit` mails per second, and
//! slowing down when the relay says it is sent too much (a 421, or a 4.7.x
//! reply such as "451 4.7.1 Rate limit exceeded"): for the whole daemon, not
//! only the one mail. After a quiet half minute the pace climbs back by a
//! quarter every ten seconds, up to the configured limit (or none).

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Mutex,
    },
    time::Duration,
};

use tokio::time::Instant;

/// Never slower than this, whatever the relay says.
const MIN_RATE: f64 = 1.0;
const CALM_BEFORE_RECOVERY: Duration = Duration::from_secs(30);
const RECOVERY_STEP: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct Pace {
    /// A limit is in force: the fast path checks only this.
    limited: AtomicBool,
    /// Mails started, for measuring the pace when nothing limits it.
    started: AtomicU64,
    state: Mutex<PaceState>,
}

#[derive(Debug)]
struct PaceState {
    /// `worker.rate_limit`; `None` when 0 (unlimited).
    configured: Option<f64>,
    /// The limit in force.
    current: Option<f64>,
    /// When the next mail may start.
    next_start: Instant,
    /// Measured pace: mails per second over the last second or so.
    sample_at: Instant,
    sample_started: u64,
    measured: f64,
    last_throttle: Option<Instant>,
    last_step: Instant,
    /// Without a configured limit: the pace before the relay complained,
    /// which recovery climbs back to before it lifts the limit.
    unlimited_pace: f64,
}

impl Pace {
    pub fn new(rate_limit: u32) -> Pace {
        let configured = (rate_limit > 0).then_some(rate_limit as f64);
        let now = Instant::now();
        Pace {
            limited: AtomicBool::new(configured.is_some()),
            started: AtomicU64::new(0),
            state: Mutex::new(PaceState {
                configured,
                current: configured,
                next_start: now,
                sample_at: now,
                sample_started: 0,
                measured: 0.0,
                last_throttle: None,
                last_step: now,
                unlimited_pace: 0.0,
            }),
        }
    }

    /// Waits until the next mail may start.
    pub async fn turn(&self) {
        let started = self.started.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.limited.load(Ordering::Relaxed) {
            // Keep the measured pace fresh, without ever waiting on a lock.
            if let Ok(mut state) = self.state.try_lock() {
                state.sample(started);
            }
            return;
        }
        let wait = {
            let mut state = self.state.lock().unwrap();
            state.sample(started);
            let Some(rate) = state.current else {
                return;
            };
            let now = Instant::now();
            let start = state.next_start.max(now);
            state.next_start = start + Duration::from_secs_f64(1.0 / rate);
            start - now
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// The relay asked to slow down: halve the pace.
    pub fn throttled(&self) {
        let mut state = self.state.lock().unwrap();
        let now = Instant::now();
        let base = state.current.unwrap_or(state.measured).max(MIN_RATE * 2.0);
        // One halving per burst of throttling replies, not one per mail.
        if state
            .last_throttle
            .is_some_and(|t| now - t < Duration::from_secs(1))
        {
            return;
        }
        let rate = (base / 2.0).max(MIN_RATE);
        if state.current.is_none() {
            state.unlimited_pace = base;
        }
        state.current = Some(rate);
        state.last_throttle = Some(now);
        state.last_step = now;
        self.limited.store(true, Ordering::Relaxed);
        tracing::warn!(rate_per_second = rate, "relay throttling: slowing down");
    }

    /// A mail went through: after a calm spell, speed up again.
    pub fn went_through(&self) {
        if !self.limited.load(Ordering::Relaxed) {
            return;
        }
        let Ok(mut state) = self.state.try_lock() else {
            return;
        };
        let Some(last) = state.last_throttle else {
            return; // only the configured limit: nothing to recover
        };
        let now = Instant::now();
        if now - last < CALM_BEFORE_RECOVERY || now - state.last_step < RECOVERY_STEP {
            return;
        }
        state.last_step = now;
        let faster = state.current.unwrap_or(MIN_RATE) * 1.25;
        match state.configured {
            Some(limit) if faster >= limit => {
                state.current = Some(limit);
                state.last_throttle = None;
            }
            None if faster >= state.unlimited_pace => {
                state.current = None;
                state.last_throttle = None;
                self.limited.store(false, Ordering::Relaxed);
            }
            _ => state.current = Some(faster),
        }
        tracing::info!(
            rate_per_second = state.current.unwrap_or(0.0),
            "relay throttling over: speeding up"
        );
    }

    /// The limit in force, mails per second (`None`: unlimited).
    pub fn current(&self) -> Option<f64> {
        self.state.lock().unwrap().current
    }
}

impl PaceState {
    fn sample(&mut self, started: u64) {
        let elapsed = self.sample_at.elapsed();
        if elapsed >= Duration::from_secs(1) {
            self.measured =
                started.saturating_sub(self.sample_started) as f64 / elapsed.as_secs_f64();
            self.sample_at = Instant::now();
            self.sample_started = started;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_configured_limit_spaces_mails() {
        let pace = Pace::new(10);
        let begin = Instant::now();
        for _ in 0..21 {
            pace.turn().await;
        }
        // 21 mails at 10/s: the last starts 2 s after the first.
        assert_eq!(begin.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn unlimited_never_waits() {
        let pace = Pace::new(0);
        let begin = Instant::now();
        for _ in 0..1000 {
            pace.turn().await;
        }
        assert_eq!(begin.elapsed(), Duration::ZERO);
        assert_eq!(pace.current(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn throttling_halves_then_recovers_to_the_limit() {
        let pace = Pace::new(100);
        pace.throttled();
        assert_eq!(pace.current(), Some(50.0));
        // A burst of throttling replies halves once.
        pace.throttled();
        assert_eq!(pace.current(), Some(50.0));
        tokio::time::advance(Duration::from_secs(2)).await;
        pace.throttled();
        assert_eq!(pace.current(), Some(25.0));
        // Calm: +25% every 10 s after 30 s, up to the configured 100/s.
        tokio::time::advance(Duration::from_secs(31)).await;
        pace.went_through();
        assert_eq!(pace.current(), Some(31.25));
        for _ in 0..10 {
            tokio::time::advance(Duration::from_secs(10)).await;
            pace.went_through();
        }
        assert_eq!(pace.current(), Some(100.0));
    }

    #[tokio::test(start_paused = true)]
    async fn throttling_an_unlimited_daemon_starts_from_its_measured_pace() {
        let pace = Pace::new(0);
        for _ in 0..400 {
            pace.turn().await;
        }
        tokio::time::advance(Duration::from_secs(2)).await;
        pace.turn().await; // takes a sample: ~200/s over the last 2 s
        pace.throttled();
        let rate = pace.current().unwrap();
        assert!((90.0..=110.0).contains(&rate), "{rate}");
        // Back to unlimited once it has climbed to the pace it had.
        tokio::time::advance(Duration::from_secs(31)).await;
        for _ in 0..4 {
            pace.went_through();
            tokio::time::advance(Duration::from_secs(10)).await;
        }
        assert_eq!(pace.current(), None);
    }
}
