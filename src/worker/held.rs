//! The rows this process holds: claims add them, commits remove them. Lock
//! renewal reads them, the stale-lock sweep spares them, the claimer counts
//! them against how much it may hold ahead, and the shutdown releases what is
//! left.

use std::{collections::HashMap, sync::Mutex};

use crate::store::{BatchLock, QueuedMail};

#[derive(Debug, Default)]
pub struct Held {
    rows: Mutex<HashMap<i64, BatchLock>>,
}

impl Held {
    pub fn add(&self, mails: &[QueuedMail]) {
        let mut rows = self.rows.lock().unwrap();
        for m in mails {
            rows.insert(m.id, m.lock);
        }
    }

    pub fn remove(&self, ids: impl IntoIterator<Item = i64>) {
        let mut rows = self.rows.lock().unwrap();
        for id in ids {
            rows.remove(&id);
        }
    }

    /// Every held row with its lock.
    pub fn all(&self) -> Vec<(i64, BatchLock)> {
        let rows = self.rows.lock().unwrap();
        rows.iter().map(|(id, lock)| (*id, *lock)).collect()
    }

    /// The distinct locks held.
    pub fn locks(&self) -> Vec<BatchLock> {
        let rows = self.rows.lock().unwrap();
        let mut locks: Vec<BatchLock> = rows.values().copied().collect();
        locks.sort_unstable();
        locks.dedup();
        locks
    }

    pub fn len(&self) -> usize {
        self.rows.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
