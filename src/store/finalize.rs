//! The writes that end a claim: what becomes of each claimed row, the
//! columns that says to write (the same on every backend), and the history
//! row written with it.

use std::time::Duration;

use super::{shared, BatchLock};

/// The final write for one claimed row.
#[derive(Debug, Clone)]
pub struct Finalize {
    pub id: i64,
    pub lock: BatchLock,
    pub action: FinalAction,
    /// The relay's reply to "." when the mail was sent (`relay_reply`).
    pub relay_reply: Option<String>,
    /// The history row written with the outcome, if it gets one: every
    /// attempt that did not end in `sent` (DESIGN §8).
    pub event: Option<Event>,
}

/// A row of a mail's history (`mail_event`) as the worker writes it; `at`
/// is the database's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub attempt: i32,
    pub outcome: EventOutcome,
    /// How far the attempt got ([`crate::smtp::Stage::key`]) or what stopped
    /// it before the relay (`message`, `config`, `throttle`, `queue`).
    pub stage: Option<&'static str>,
    pub smtp_code: Option<u16>,
    /// The relay's reply or the error; `None`: the outcome's `last_error`.
    pub detail: Option<String>,
}

/// What a history row records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventOutcome {
    /// A failed try, to be tried again.
    Retry,
    Failed,
    /// The relay may have it (`unknown`).
    Unknown,
    /// Put off without spending the try (relay-down outcome of this row
    /// alone, a throttled domain, no sender configured).
    Deferred,
    /// The relay was down: back to queued, the try refunded.
    Released,
    /// The lock went stale: the worker stopped during the try.
    Stale,
    /// An operator's `tablemail retry`.
    Retried,
    /// An operator's `tablemail cancel`.
    Cancelled,
}

impl EventOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            EventOutcome::Retry => "retry",
            EventOutcome::Failed => "failed",
            EventOutcome::Unknown => "unknown",
            EventOutcome::Deferred => "deferred",
            EventOutcome::Released => "released",
            EventOutcome::Stale => "stale",
            EventOutcome::Retried => "retried",
            EventOutcome::Cancelled => "cancelled",
        }
    }
}

/// What becomes of a claimed row. Every variant clears the lock.
#[derive(Debug, Clone, PartialEq)]
pub enum FinalAction {
    /// `sent`.
    Sent,
    /// Back to `queued`, `send_at = now() + delay`, the attempt stays spent.
    /// `relay_down`: the failure was a relay-down outcome past
    /// `worker.relay_down_limit` (the row's count goes on).
    Retry {
        delay: Duration,
        error: String,
        relay_down: bool,
    },
    /// `failed` for good.
    Failed { error: String, relay_down: bool },
    /// `unknown`: the relay may have the mail; an operator decides.
    Unknown { error: String },
    /// Back to `queued` as it was, the attempt refunded: never tried (relay
    /// unavailable, shutdown before ".").
    Release,
    /// Back to `queued` with the attempt refunded, but later:
    /// `send_at = now() + delay`, `last_error` says why. `counted`: a
    /// relay-down outcome that only this row drew (`relay_down_count + 1`).
    Defer {
        delay: Duration,
        error: String,
        counted: bool,
    },
    /// `suppressed` for good, the attempt refunded: every recipient is on
    /// the suppression list, so nothing was sent (DESIGN §12).
    Suppressed { error: String },
}

/// What happens to `relay_down_count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountWrite {
    Reset = 0,
    Increment = 1,
    Keep = 2,
}

/// The columns a finalize writes, the same on every backend.
#[derive(Debug, Clone, Copy)]
pub struct FinalColumns<'a> {
    pub status: &'static str,
    /// `send_at = now() + delay_ms`; negative: `send_at` stays.
    pub delay_ms: i64,
    /// New `last_error`; `None` keeps the old one.
    pub error: Option<&'a str>,
    /// Give the attempt back.
    pub refund: bool,
    /// `processed_at = now()`.
    pub processed: bool,
    pub relay_down: CountWrite,
}

impl FinalAction {
    pub fn columns(&self) -> FinalColumns<'_> {
        let spent = |relay_down: bool| {
            if relay_down {
                CountWrite::Increment
            } else {
                CountWrite::Reset
            }
        };
        let (status, delay_ms, error, refund, processed, relay_down) = match self {
            FinalAction::Sent => ("sent", -1, None, false, true, CountWrite::Reset),
            FinalAction::Retry {
                delay,
                error,
                relay_down,
            } => (
                "queued",
                shared::millis(*delay),
                Some(error.as_str()),
                false,
                true,
                spent(*relay_down),
            ),
            FinalAction::Failed { error, relay_down } => (
                "failed",
                -1,
                Some(error.as_str()),
                false,
                true,
                spent(*relay_down),
            ),
            FinalAction::Unknown { error } => (
                "unknown",
                -1,
                Some(error.as_str()),
                false,
                true,
                CountWrite::Reset,
            ),
            FinalAction::Release => ("queued", -1, None, true, false, CountWrite::Keep),
            FinalAction::Suppressed { error } => (
                "suppressed",
                -1,
                Some(error.as_str()),
                true,
                true,
                CountWrite::Reset,
            ),
            FinalAction::Defer {
                delay,
                error,
                counted,
            } => (
                "queued",
                shared::millis(*delay),
                Some(error.as_str()),
                true,
                true,
                if *counted {
                    CountWrite::Increment
                } else {
                    CountWrite::Keep
                },
            ),
        };
        FinalColumns {
            status,
            delay_ms,
            error,
            refund,
            processed,
            relay_down,
        }
    }
}

/// The history row a [`Finalize`] writes, as the backends bind it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EventColumns<'a> {
    pub attempt: i32,
    pub outcome: &'static str,
    pub stage: Option<&'static str>,
    pub smtp_code: Option<i32>,
    pub detail: Option<&'a str>,
}

impl Finalize {
    /// The relay's queue id in its reply to ".", kept indexed so that a
    /// report naming only it finds the mail.
    pub(crate) fn relay_queue_id(&self) -> Option<&str> {
        self.relay_reply
            .as_deref()
            .and_then(super::feedback::relay_queue_id)
    }

    /// Its history row, if it gets one; the detail defaults to the new
    /// `last_error`.
    pub(crate) fn event_columns(&self) -> Option<EventColumns<'_>> {
        let event = self.event.as_ref()?;
        Some(EventColumns {
            attempt: event.attempt,
            outcome: event.outcome.as_str(),
            stage: event.stage,
            smtp_code: event.smtp_code.map(i32::from),
            detail: event.detail.as_deref().or(self.action.columns().error),
        })
    }
}

/// The most a statement of outcomes sends to the database, in bytes: under
/// the 16 KiB a Linux TCP socket's send buffer starts with
/// (`net.ipv4.tcp_wmem`). A longer statement fills the buffer before it is
/// whole, the server waits for the rest before it answers, and the rest
/// waits for the server's delayed ACK: 40 ms per group commit, enough to
/// slow a drain to about half its speed. Larger groups go as several
/// statements in one transaction.
pub(crate) const STATEMENT_BUDGET: usize = 12 * 1024;

impl Finalize {
    /// What this outcome's texts add to a statement on the wire (with room
    /// for their quotes and escapes), beside the fixed columns.
    fn text_size(&self) -> usize {
        let texts = [
            self.action.columns().error,
            self.relay_reply.as_deref(),
            self.relay_queue_id(),
            self.event.as_ref().and_then(|e| e.detail.as_deref()),
        ];
        texts.iter().flatten().map(|t| t.len() + 4).sum()
    }
}

/// Splits outcomes, in id order, into groups of at most `budget` bytes on
/// the wire (one outcome at least each), each outcome counted as `fixed`
/// bytes for its columns (the backend's encoding: binary arrays or JSON)
/// plus its texts, and a history row as `event` bytes more.
pub(crate) fn wire_chunks(
    mut writes: Vec<Finalize>,
    budget: usize,
    fixed: usize,
    event: usize,
) -> Vec<Vec<Finalize>> {
    writes.sort_unstable_by_key(|w| w.id);
    let mut chunks = Vec::new();
    let (mut chunk, mut size) = (Vec::new(), 0);
    for w in writes {
        let n = fixed + w.text_size() + if w.event.is_some() { event } else { 0 };
        if !chunk.is_empty() && size + n > budget {
            chunks.push(std::mem::take(&mut chunk));
            size = 0;
        }
        size += n;
        chunk.push(w);
    }
    if !chunk.is_empty() {
        chunks.push(chunk);
    }
    chunks
}

/// A row no lock holds, and its status: what [`Store::unlocked_rows`] finds.
///
/// [`Store::unlocked_rows`]: super::Store::unlocked_rows
#[derive(Debug, Clone, PartialEq)]
pub struct UnlockedRow {
    pub id: i64,
    pub status: String,
}

/// A row that `release_stale_locks` took back from a dead or stuck worker.
#[derive(Debug, Clone, PartialEq)]
pub struct StaleRow {
    pub id: i64,
    /// `true`: back to `queued`; `false`: no attempt remained, now `failed`.
    pub requeued: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(id: i64, reply: &str) -> Finalize {
        Finalize {
            id,
            lock: BatchLock(uuid::Uuid::nil()),
            action: FinalAction::Sent,
            relay_reply: Some(reply.to_string()),
            event: None,
        }
    }

    /// MySQL's outcomes as arrays: the positions its `JSON_TABLE` paths
    /// read (`$[0]` … `$[13]`), the history fields only with a history row
    /// (its detail NULL where it is the error), and no longer than the 80
    /// octets besides the texts (40 more with a history row) that
    /// [`wire_chunks`] counts for them, for ids of up to fifteen digits and
    /// delays of up to a week.
    #[test]
    fn outcomes_as_arrays_are_in_place_and_within_their_count() {
        use crate::store::rows::finalize_rows_json;
        let lock = BatchLock(uuid::Uuid::nil());
        let retry = Finalize {
            id: 999_999_999_999_999,
            lock,
            action: FinalAction::Retry {
                delay: Duration::from_secs(7 * 86400),
                error: "RCPT TO: 450 4.2.0 busy".into(),
                relay_down: false,
            },
            relay_reply: None,
            event: Some(Event {
                attempt: 12,
                outcome: EventOutcome::Retry,
                stage: Some("rcpt"),
                smtp_code: Some(450),
                detail: None,
            }),
        };
        let json = finalize_rows_json(&[sent(7, "250 Ok: queued as 4XyZ"), retry.clone()]);
        let nil = "00000000-0000-0000-0000-000000000000";
        assert_eq!(
            json,
            format!(
                "[[7,\"{nil}\",\"sent\",-1,null,0,1,0,\"250 Ok: queued as 4XyZ\",\"4XyZ\"],\
                 [999999999999999,\"{nil}\",\"queued\",604800000,\"RCPT TO: 450 4.2.0 busy\",0,1,0,null,null,\
                 12,\"retry\",\"rcpt\",450,null]]"
            )
        );
        let alone = finalize_rows_json(std::slice::from_ref(&retry));
        assert!(alone.len() - 2 <= 85 + 40 + retry.text_size(), "{alone}");
        let mut failed = sent(999_999_999_999_999, "");
        failed.relay_reply = None;
        failed.action = FinalAction::Failed {
            error: String::new(),
            relay_down: true,
        };
        let alone = finalize_rows_json(std::slice::from_ref(&failed));
        assert!(alone.len() - 2 <= 85 + failed.text_size(), "{alone}");
    }

    #[test]
    fn outcomes_go_in_statements_that_fit_the_send_buffer() {
        let reply = "250 2.0.0 Ok: queued as 4XyZabc";
        let writes: Vec<Finalize> = (0..300).rev().map(|id| sent(id, reply)).collect();
        let chunks = wire_chunks(writes, STATEMENT_BUDGET, 110, 0);
        assert!(chunks.len() > 1, "300 outcomes in one statement");
        for chunk in &chunks {
            let size: usize = chunk.iter().map(|w| 110 + w.text_size()).sum();
            assert!(size <= STATEMENT_BUDGET, "{size}");
        }
        // In id order across chunks: rows are locked in one order.
        let ids: Vec<i64> = chunks.iter().flatten().map(|w| w.id).collect();
        assert_eq!(ids, (0..300).collect::<Vec<_>>());
        // An outcome larger than the budget still goes, alone.
        let huge = sent(1, &"x".repeat(STATEMENT_BUDGET * 2));
        let chunks = wire_chunks(
            vec![sent(0, reply), huge, sent(2, reply)],
            STATEMENT_BUDGET,
            110,
            0,
        );
        assert_eq!(chunks.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1, 1]);
    }
}
