//! `webhooks.rate_limit`: a token bucket per client address, holding a
//! second's worth of requests and as many again for a burst. The table of
//! addresses is bounded: full buckets are forgotten when it grows, and
//! while it is full of busy addresses a new one waits its turn (429).

use std::{collections::HashMap, net::IpAddr, sync::Mutex, time::Instant};

/// Addresses tracked at once.
const MAX_ADDRESSES: usize = 10_000;

pub struct Limiter {
    /// Requests a second; 0: no limit.
    rate: u32,
    buckets: Mutex<HashMap<IpAddr, Bucket>>,
}

#[derive(Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Limiter {
    pub fn new(rate: u32) -> Limiter {
        Limiter {
            rate,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    fn capacity(&self) -> f64 {
        f64::from(self.rate) * 2.0
    }

    /// Takes a token of `address`'s bucket, if it has one.
    pub fn allow(&self, address: IpAddr) -> bool {
        self.allow_at(address, Instant::now())
    }

    fn allow_at(&self, address: IpAddr, now: Instant) -> bool {
        if self.rate == 0 {
            return true;
        }
        let (rate, capacity) = (f64::from(self.rate), self.capacity());
        let mut buckets = self
            .buckets
            .lock()
            .expect("the rate table is never poisoned");
        if !buckets.contains_key(&address) && buckets.len() >= MAX_ADDRESSES {
            buckets.retain(|_, b| {
                b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * rate < capacity
            });
            if buckets.len() >= MAX_ADDRESSES {
                return false;
            }
        }
        let bucket = buckets.entry(address).or_insert(Bucket {
            tokens: capacity,
            at: now,
        });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * rate).min(capacity);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_burst_then_the_rate() {
        let limiter = Limiter::new(5);
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let t0 = Instant::now();
        let allowed = (0..20).filter(|_| limiter.allow_at(a, t0)).count();
        assert_eq!(allowed, 10, "a burst of two seconds' worth");
        assert!(
            limiter.allow_at(b, t0),
            "another address has its own bucket"
        );
        assert!(!limiter.allow_at(a, t0 + Duration::from_millis(100)));
        assert!(limiter.allow_at(a, t0 + Duration::from_millis(250)));
    }

    #[test]
    fn no_limit_at_zero() {
        let limiter = Limiter::new(0);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        assert!((0..1000).all(|_| limiter.allow(a)));
    }
}
