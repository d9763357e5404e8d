//! Cheap randomness where unpredictability is not the point: retry jitter
//! and MIME boundaries. A splitmix64 sequence per thread, seeded once from
//! the operating system (`Uuid::new_v4` asks the kernel on every call: a
//! system call per mail on the hot path).

use std::cell::Cell;

thread_local! {
    static STATE: Cell<u64> = Cell::new(uuid::Uuid::new_v4().as_u128() as u64);
}

/// The next 64 bits of this thread's sequence.
pub fn next_u64() -> u64 {
    STATE.with(|state| {
        let x = state.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        state.set(x);
        let z = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

/// A number in `[0, 1)`.
pub fn unit() -> f64 {
    (next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// 128 bits, for a MIME boundary.
pub fn next_u128() -> u128 {
    u128::from(next_u64()) << 64 | u128::from(next_u64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_spread_over_the_unit_interval_and_do_not_repeat() {
        let values: Vec<f64> = (0..10_000).map(|_| unit()).collect();
        assert!(values.iter().all(|v| (0.0..1.0).contains(v)));
        let low = values.iter().filter(|v| **v < 0.5).count();
        assert!((4_500..5_500).contains(&low), "{low} of 10000 under 0.5");
        let mut bits: Vec<u128> = (0..10_000).map(|_| next_u128()).collect();
        bits.sort_unstable();
        bits.dedup();
        assert_eq!(bits.len(), 10_000);
    }
}
