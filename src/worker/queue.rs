//! The claimed rows waiting for a lane, in claim order.

use std::{collections::VecDeque, sync::Mutex};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::store::QueuedMail;

/// Claimed rows in claim order, shared by the lanes.
#[derive(Default)]
pub(super) struct JobQueue {
    jobs: Mutex<VecDeque<QueuedMail>>,
    ready: Notify,
    /// No more rows will come: lanes stop once it is empty.
    closed: std::sync::atomic::AtomicBool,
}

impl JobQueue {
    pub(super) fn push(&self, mails: impl IntoIterator<Item = QueuedMail>) {
        self.jobs.lock().unwrap().extend(mails);
        self.ready.notify_waiters();
    }

    pub(super) fn pop(&self) -> Option<QueuedMail> {
        self.jobs.lock().unwrap().pop_front()
    }

    pub(super) fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.ready.notify_waiters();
    }

    /// Everything still queued, taken out.
    pub(super) fn drain(&self) -> Vec<QueuedMail> {
        self.jobs.lock().unwrap().drain(..).collect()
    }

    /// The next row, waiting for one; `None` once `stop` fires, or the queue
    /// is closed and empty.
    pub(super) async fn next(&self, stop: &CancellationToken) -> Option<QueuedMail> {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if stop.is_cancelled() {
                return None;
            }
            if let Some(job) = self.pop() {
                return Some(job);
            }
            if self.closed.load(std::sync::atomic::Ordering::Relaxed) {
                return None;
            }
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = notified => {}
            }
        }
    }
}
