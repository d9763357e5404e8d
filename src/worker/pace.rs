//! The sending pace: `worker.rate_limit` mails per second, and slowing down
//! when the relay says it is sent too much (a 421, or a 4.7.x reply such as
//! "451 4.7.1 Rate limit exceeded").
//!
//! A throttling reply to RCPT or later slows the recipient domain that drew it
//! (a refused MAIL comes before any recipient: it only counts towards the whole
//! relay's throttling): that domain pauses (1 s, 2 s, 4 s, up to 5 s while it
//! keeps throttling), its mails are deferred meanwhile, and one success to it
//! ends the pause. Only when throttling replies come one after the other with
//! no success between them (the whole relay throttles) does the daemon's own
//! pace back off, halving at most once a second; it then finds the relay's rate
//! again the way TCP does after a loss: after a calm second it doubles four
//! times a second, back to the pace it had (or the configured limit), within
//! seconds of the throttling ending.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Mutex,
    },
    time::Duration,
};

use tokio::time::Instant;

/// Never slower than this, whatever the relay says.
const MIN_RATE: f64 = 1.0;
/// One halving per burst of throttling replies, and the calm before climbing.
const STEP: Duration = Duration::from_secs(1);
/// How often the pace doubles once calm: from the floor back to ~250 mails/s
/// in two seconds.
const CLIMB: Duration = Duration::from_millis(250);
/// Longest pause of a throttled domain.
const MAX_DOMAIN_PAUSE: Duration = Duration::from_secs(5);
/// Domains remembered at most (the oldest calm ones are forgotten first).
const MAX_DOMAINS: usize = 10_000;

/// The daemon's own pace.
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
    /// Throttling in progress: when the relay last said so.
    last_throttle: Option<Instant>,
    last_step: Instant,
    /// The pace before the relay complained, which recovery climbs back to
    /// before it lifts the limit.
    before: f64,
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
                before: 0.0,
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

    /// The limit in force, mails per second (`None`: unlimited).
    pub fn limit(&self) -> Option<f64> {
        if !self.limited.load(Ordering::Relaxed) {
            return None;
        }
        self.state.lock().unwrap().current
    }

    /// The whole relay throttles: halve the pace (once per burst).
    pub fn throttled(&self) {
        let mut state = self.state.lock().unwrap();
        let now = Instant::now();
        if state.last_throttle.is_some_and(|t| now - t < STEP) {
            return;
        }
        if state.last_throttle.is_none() {
            // Where recovery will climb back to.
            state.before = state.current.unwrap_or(state.measured).max(MIN_RATE);
        }
        let base = state.current.unwrap_or(state.measured).max(MIN_RATE * 2.0);
        let rate = (base / 2.0).max(MIN_RATE);
        state.current = Some(rate);
        state.last_throttle = Some(now);
        state.last_step = now;
        self.limited.store(true, Ordering::Relaxed);
        tracing::warn!(rate_per_second = rate, "relay throttling: slowing down");
    }

    /// A mail went through: after a calm second, double the pace every
    /// quarter second until it is back where it was.
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
        if now - last < STEP || now - state.last_step < CLIMB {
            return;
        }
        state.last_step = now;
        let faster = state.current.unwrap_or(MIN_RATE) * 2.0;
        let target = state.configured.unwrap_or(state.before);
        if faster >= target {
            state.current = state.configured;
            state.last_throttle = None;
            self.limited
                .store(state.configured.is_some(), Ordering::Relaxed);
            tracing::info!(
                rate_per_second = state.configured.unwrap_or(0.0),
                "relay throttling over: back to full pace"
            );
        } else {
            state.current = Some(faster);
            tracing::info!(
                rate_per_second = faster,
                "relay throttling calmer: speeding up"
            );
        }
    }
}

impl PaceState {
    fn sample(&mut self, started: u64) {
        let elapsed = self.sample_at.elapsed();
        if elapsed >= STEP {
            self.measured =
                started.saturating_sub(self.sample_started) as f64 / elapsed.as_secs_f64();
            self.sample_at = Instant::now();
            self.sample_started = started;
        }
    }
}

/// Recipient domains that asked us to slow down, and whether the whole relay
/// did.
#[derive(Debug, Default)]
pub struct Throttles {
    state: Mutex<ThrottleState>,
}

#[derive(Debug, Default)]
struct ThrottleState {
    domains: HashMap<String, DomainPause>,
    /// Throttling replies since the last success.
    in_a_row: u32,
}

#[derive(Debug, Clone, Copy)]
struct DomainPause {
    until: Instant,
    /// Throttling replies since this domain's last success.
    strikes: u32,
}

impl Throttles {
    /// Whether one of `domains` is paused, and for how long still.
    pub fn paused<'a>(
        &self,
        domains: impl IntoIterator<Item = &'a str>,
    ) -> Option<(String, Duration)> {
        let state = self.state.lock().unwrap();
        if state.domains.is_empty() {
            return None;
        }
        let now = Instant::now();
        domains.into_iter().find_map(|d| {
            let pause = state.domains.get(d)?;
            (pause.until > now).then(|| (d.to_string(), pause.until - now))
        })
    }

    /// A mail to `domains` drew a throttling reply. Returns whether the whole
    /// relay seems to throttle (no success since the previous such reply).
    pub fn throttled<'a>(&self, domains: impl IntoIterator<Item = &'a str>) -> bool {
        let mut state = self.state.lock().unwrap();
        let now = Instant::now();
        if state.domains.len() >= MAX_DOMAINS {
            state.domains.retain(|_, p| p.until > now);
        }
        for domain in domains {
            let pause = state
                .domains
                .entry(domain.to_string())
                .or_insert(DomainPause {
                    until: now,
                    strikes: 0,
                });
            if pause.until > now {
                continue; // one step per pause, not per mail in flight
            }
            pause.strikes += 1;
            let length = (STEP * 2u32.pow(pause.strikes.min(8) - 1)).min(MAX_DOMAIN_PAUSE);
            pause.until = now + length;
            tracing::warn!(
                domain,
                pause_ms = length.as_millis() as u64,
                "domain throttling: pausing it"
            );
        }
        state.in_a_row += 1;
        state.in_a_row > 1
    }

    /// A mail to `domains` went through: their pauses end.
    pub fn went_through<'a>(&self, domains: impl IntoIterator<Item = &'a str>) {
        let mut state = self.state.lock().unwrap();
        state.in_a_row = 0;
        if state.domains.is_empty() {
            return;
        }
        for domain in domains {
            state.domains.remove(domain);
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
        assert_eq!(pace.limit(), Some(10.0));
    }

    #[tokio::test(start_paused = true)]
    async fn unlimited_never_waits() {
        let pace = Pace::new(0);
        let begin = Instant::now();
        for _ in 0..1000 {
            pace.turn().await;
        }
        assert_eq!(begin.elapsed(), Duration::ZERO);
        assert_eq!(pace.limit(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn throttling_halves_then_recovers_within_seconds() {
        let pace = Pace::new(100);
        pace.throttled();
        assert_eq!(pace.limit(), Some(50.0));
        // A burst of throttling replies halves once.
        pace.throttled();
        assert_eq!(pace.limit(), Some(50.0));
        for expected in [25.0, 12.5, 6.25] {
            tokio::time::advance(STEP).await;
            pace.throttled();
            assert_eq!(pace.limit(), Some(expected));
        }
        // Calm for a second, then doubling every quarter second, back to
        // the configured 100/s.
        tokio::time::advance(STEP).await;
        for expected in [12.5, 25.0, 50.0, 100.0] {
            pace.went_through();
            assert_eq!(pace.limit(), Some(expected));
            tokio::time::advance(CLIMB).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_unlimited_daemon_climbs_back_to_its_measured_pace_then_unlimited() {
        let pace = Pace::new(0);
        for _ in 0..400 {
            pace.turn().await;
        }
        tokio::time::advance(Duration::from_secs(2)).await;
        pace.turn().await; // takes a sample: ~200/s over the last 2 s
        pace.throttled();
        let rate = pace.limit().unwrap();
        assert!((90.0..=110.0).contains(&rate), "{rate}");
        // 30 s of throttling: down to the floor.
        for _ in 0..30 {
            tokio::time::advance(STEP).await;
            pace.throttled();
        }
        assert_eq!(pace.limit(), Some(MIN_RATE));
        // From 1/s back to unlimited (~200/s): a calm second, then eight
        // doublings a quarter second apart.
        tokio::time::advance(STEP).await;
        let mut steps = 0;
        while pace.limit().is_some() {
            pace.went_through();
            tokio::time::advance(CLIMB).await;
            steps += 1;
            assert!(steps <= 8, "still limited to {:?}", pace.limit());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_throttled_domain_pauses_alone_and_longer_each_time() {
        let t = Throttles::default();
        assert!(!t.throttled(["slow.example"]), "one reply is the domain's");
        assert_eq!(t.paused(["other.example"]), None, "other domains go on");
        let (domain, left) = t.paused(["other.example", "slow.example"]).unwrap();
        assert_eq!((domain.as_str(), left), ("slow.example", STEP));
        t.went_through(["other.example"]);
        tokio::time::advance(STEP).await;
        assert_eq!(t.paused(["slow.example"]), None);
        assert!(!t.throttled(["slow.example"]));
        assert_eq!(t.paused(["slow.example"]).unwrap().1, 2 * STEP);
        // Two throttled mails with no success between: the relay throttles.
        assert!(t.throttled(["third.example"]));
        t.went_through(["slow.example"]);
        assert_eq!(t.paused(["slow.example"]), None);
    }
}
