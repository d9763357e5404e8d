//! Send caps (DESIGN §16): what a reservation asks for and what it is
//! answered. Every daemon reserves through the database, in a transaction
//! serialized per cap (its `mail_limit` row locked; SQLite has one writer),
//! so that the count it reads is every daemon's.
//!
//! A reservation (`mail_limit_use`) is a claim's under one cap: the claim's
//! mails the cap counts, and how many of them are still pending. It counts
//! them while one is pending (`sent_ms` NULL: it may still go out) and for
//! one window after `sent_ms`: the moment the last was known sent, or the
//! claim was found no longer held (a daemon that died: whatever it sent, it
//! sent before). A mail known unsent (the send never reached ".") is taken
//! out of it. Times are milliseconds since the epoch, by the database clock.

use std::time::Duration;

/// The length of a warm-up day.
pub const DAY_MS: i64 = 86_400_000;

/// One cap's share of a reservation: the mails of a claim it counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapRequest {
    pub name: String,
    pub max: u64,
    pub per: Duration,
    /// The warm-up schedule: the first day's start (UTC midnight, ms) and
    /// each day's maximum.
    pub warmup: Option<(i64, Vec<u64>)>,
    /// In the order they should get capacity (most important first).
    pub mails: Vec<i64>,
}

/// What one cap allows at a moment: its window, and during warm-up the
/// day's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub max: u64,
    pub per_ms: i64,
    /// The day's start and maximum, while a warm-up day is in force.
    pub day: Option<(i64, u64)>,
}

impl CapRequest {
    /// What the cap allows at `now_ms`. Before `warmup_start` the first
    /// day's maximum applies (a domain not yet warming up is not warm).
    pub fn budget(&self, now_ms: i64) -> Budget {
        budget(self.max, self.per, self.warmup.as_ref(), now_ms)
    }
}

/// What a cap of `max` per `per` with this warm-up allows at `now_ms`.
pub fn budget(max: u64, per: Duration, warmup: Option<&(i64, Vec<u64>)>, now_ms: i64) -> Budget {
    let per_ms = super::shared::millis(per);
    let day = warmup.and_then(|(start, days)| {
        let index = (now_ms - start).div_euclid(DAY_MS);
        match index {
            i if i < 0 => days
                .first()
                .map(|m| (now_ms.div_euclid(DAY_MS) * DAY_MS, *m)),
            i => days.get(i as usize).map(|m| (start + i * DAY_MS, *m)),
        }
    });
    Budget { max, per_ms, day }
}

/// One cap's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapAnswer {
    pub name: String,
    /// The mails it reserved capacity for (for every cap that counts them).
    pub granted: Vec<i64>,
    /// The mails this cap itself had no room for.
    pub turned_away: Vec<i64>,
    /// `used` was counted now; otherwise it is a bound, never less than
    /// the count (far from the maximum, nothing is counted).
    pub counted: bool,
    /// What it counts now, reservations just made included, and the
    /// maximum that count is held to (the day's during warm-up).
    pub used: u64,
    pub max: u64,
    /// For the mails it turned away: how long until capacity frees.
    pub frees_in: Duration,
}

/// What a group of written outcomes settles of one claim's reservation
/// under one cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapSettle {
    pub name: String,
    pub lock: super::BatchLock,
    /// Its mails that may have gone out: they count one window from now
    /// once none is pending any more.
    pub sent: u64,
    /// Its mails that surely did not: given back.
    pub unsent: u64,
}

/// A cap's use now, for `status`, the console and `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapUse {
    pub name: String,
    pub used: u64,
    pub max: u64,
}

/// How much the cap has room for, given its counts, and when room frees
/// for one more once it has none. `oldest_ms`: the oldest settled
/// reservation in the window (`None`: all pending).
pub fn room(
    b: &Budget,
    now_ms: i64,
    used: u64,
    oldest_ms: Option<i64>,
    day_used: u64,
) -> (u64, i64) {
    let window_room = b.max.saturating_sub(used);
    let mut frees_at = now_ms;
    if window_room == 0 {
        // A pending reservation settles no earlier than now.
        frees_at = oldest_ms.unwrap_or(now_ms).min(now_ms) + b.per_ms;
    }
    let mut room = window_room;
    if let Some((start, day_max)) = b.day {
        let day_room = day_max.saturating_sub(day_used);
        if day_room == 0 {
            frees_at = frees_at.max(start + DAY_MS);
        }
        room = room.min(day_room);
    }
    (room, frees_at.max(now_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warm_up_day_holds_the_cap_to_its_maximum_until_the_list_ends() {
        let start = 20_000 * DAY_MS;
        let warmup = (start, vec![50, 100]);
        let per = Duration::from_secs(3600);
        let b = |now| budget(1000, per, Some(&warmup), now);
        assert_eq!(b(start + 5).day, Some((start, 50)));
        assert_eq!(b(start + DAY_MS + 5).day, Some((start + DAY_MS, 100)));
        assert_eq!(b(start + 2 * DAY_MS).day, None);
        assert_eq!(b(start - 5).day, Some((start - DAY_MS, 50)));
        assert_eq!(b(start).max, 1000);
    }

    #[test]
    fn room_frees_when_the_oldest_send_leaves_the_window_or_the_day_ends() {
        let b = Budget {
            max: 3,
            per_ms: 1000,
            day: None,
        };
        assert_eq!(room(&b, 5000, 1, Some(4500), 0), (2, 5000));
        assert_eq!(room(&b, 5000, 3, Some(4500), 0), (0, 5500));
        assert_eq!(room(&b, 5000, 3, None, 0), (0, 6000));
        let day = Budget {
            day: Some((0, 2)),
            ..b
        };
        assert_eq!(room(&day, 5000, 1, Some(4500), 2), (0, DAY_MS));
        assert_eq!(room(&day, 5000, 0, None, 1), (1, 5000));
    }
}
