//! The memory budget of mails loaded to be sent: the columns of a large row
//! and its attachments are read one mail at a time per lane, and the mails
//! being built and sent together never hold more than [`LOAD_BUDGET`] of
//! them. What a daemon holds is then bounded by what it sends, not by what it
//! claimed (a claimed row brings at most [`INLINE_CONTENT`] of text).

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::store::MailSizes;

/// Rows whose text columns together stay within this come with their claim
/// (a typical mail, HTML and all); larger ones are loaded when they are sent.
pub const INLINE_CONTENT: usize = 32 * 1024;

/// Loaded mails in memory at once, counted as stored plus encoded.
pub const LOAD_BUDGET: u64 = 96 * 1024 * 1024;

/// Permits of one KiB each; a mail larger than the whole budget takes all of
/// it and goes alone.
#[derive(Debug)]
pub struct MemoryBudget {
    permits: Arc<Semaphore>,
    total: u32,
}

impl MemoryBudget {
    pub fn new(bytes: u64) -> MemoryBudget {
        let total = (bytes / 1024).clamp(1, u64::from(u32::MAX >> 3)) as u32;
        MemoryBudget {
            permits: Arc::new(Semaphore::new(total as usize)),
            total,
        }
    }

    /// Waits until a mail of these sizes fits, and holds its share until the
    /// permit is dropped.
    pub async fn take(&self, sizes: &MailSizes) -> OwnedSemaphorePermit {
        self.permits
            .clone()
            .acquire_many_owned(Self::share(sizes, self.total))
            .await
            .expect("the budget is never closed")
    }

    /// A mail's share in KiB: its columns and attachments as stored, and
    /// again as they are encoded into the message (base64 adds a third).
    fn share(sizes: &MailSizes, total: u32) -> u32 {
        let bytes = sizes.content * 2 + sizes.attachment_bytes * 7 / 3;
        (bytes / 1024).clamp(1, u64::from(total)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn large_mails_wait_for_room_and_the_largest_goes_alone() {
        let budget = MemoryBudget::new(1024 * 1024);
        let big = MailSizes {
            content: 300 * 1024,
            ..MailSizes::default()
        };
        let first = budget.take(&big).await;
        // 600 KiB of 1 MiB taken: a second one must wait.
        let second = tokio::time::timeout(std::time::Duration::from_millis(50), budget.take(&big));
        assert!(second.await.is_err(), "two 600 KiB mails in a 1 MiB budget");
        drop(first);
        let huge = MailSizes {
            attachment_bytes: 100 * 1024 * 1024,
            ..MailSizes::default()
        };
        let alone = budget.take(&huge).await;
        assert_eq!(alone.num_permits(), 1024, "capped at the whole budget");
    }
}
