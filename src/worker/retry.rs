//! Backoff arithmetic: pure functions, so it is tested without clocks.

use std::time::Duration;

/// Delay before the next try of a mail after a transient failure.
///
/// Exponential from `base` (the delay after the first failed attempt), doubling
/// per attempt, capped at `max`, then spread by `jitter` in `[0, 1)` over
/// 75%–125% of that value (and capped again), so that mails that failed together
/// do not all come back at the same instant.
pub fn retry_delay(attempts: u32, base: Duration, max: Duration, jitter: f64) -> Duration {
    let exponent = attempts.saturating_sub(1).min(30);
    let raw = base.saturating_mul(1u32 << exponent).min(max);
    let spread = 0.75 + 0.5 * jitter.clamp(0.0, 1.0);
    raw.mul_f64(spread).min(max)
}

/// How long the worker pauses after the relay was found unavailable for the
/// `failures`-th time in a row: 1s, 2s, 4s … up to 60s, with the same jitter.
pub fn relay_pause(failures: u32, jitter: f64) -> Duration {
    retry_delay(
        failures.max(1),
        Duration::from_secs(1),
        Duration::from_secs(60),
        jitter,
    )
}

/// A random number in `[0, 1)` for jitter.
pub fn jitter() -> f64 {
    crate::random::unit()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);
    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn doubles_from_base_without_jitter_spread() {
        assert_eq!(retry_delay(1, MIN, HOUR, 0.5), MIN);
        assert_eq!(retry_delay(2, MIN, HOUR, 0.5), 2 * MIN);
        assert_eq!(retry_delay(3, MIN, HOUR, 0.5), 4 * MIN);
        assert_eq!(retry_delay(0, MIN, HOUR, 0.5), MIN);
    }

    #[test]
    fn never_exceeds_max_even_with_jitter() {
        for attempts in 1..100 {
            for j in [0.0, 0.3, 0.999] {
                assert!(retry_delay(attempts, MIN, HOUR, j) <= HOUR);
            }
        }
        assert_eq!(retry_delay(50, MIN, HOUR, 0.999), HOUR);
    }

    #[test]
    fn jitter_spreads_around_the_exponential_value() {
        assert_eq!(retry_delay(2, MIN, HOUR, 0.0), Duration::from_secs(90));
        assert_eq!(retry_delay(2, MIN, HOUR, 1.0), Duration::from_secs(150));
        let j = jitter();
        assert!((0.0..1.0).contains(&j));
    }

    #[test]
    fn relay_pause_is_bounded() {
        assert_eq!(relay_pause(1, 0.5), Duration::from_secs(1));
        assert_eq!(relay_pause(3, 0.5), Duration::from_secs(4));
        assert_eq!(relay_pause(40, 0.9), Duration::from_secs(60));
    }
}
