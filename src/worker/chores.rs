//! What runs beside the pipeline: renewing the locks of rows still held,
//! releasing the stale locks of dead workers, purging finished rows past their
//! retention (and vacuuming when the database does not), reporting this
//! daemon to the others (`tablemail_daemon`), and telling systemd that the
//! worker lives.

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    metrics::Outcome,
    store::{DaemonBeat, Maintenance},
    systemd,
};

use super::Worker;

impl Worker {
    /// Renews `locked_at` of held rows, so only a dead worker's rows go stale.
    pub(super) async fn renew_locks(self: Arc<Self>, stop: CancellationToken) {
        let every = self.settings.lock_timeout / 3;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let held = self.held.all();
            if held.is_empty() {
                continue;
            }
            if let Err(e) = self.store.renew_locks(&held).await {
                tracing::warn!(error = %e, rows = held.len(), "lock renewal failed");
            }
        }
    }

    /// Releases the stale locks of dead or stuck workers, never this
    /// process's own (even when its renewals have been failing).
    pub(super) async fn sweep(self: Arc<Self>, stop: CancellationToken) {
        let every =
            (self.settings.lock_timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
        loop {
            let spare = self.held.locks();
            match self
                .store
                .release_stale_locks(self.settings.lock_timeout, &spare)
                .await
            {
                Ok(rows) if !rows.is_empty() => {
                    let requeued = rows.iter().filter(|r| r.requeued).count();
                    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
                    tracing::warn!(
                        count = rows.len(),
                        requeued,
                        failed = rows.len() - requeued,
                        ids = ?ids,
                        outcome = "released",
                        "stale locks released"
                    );
                    self.wake.notify_one();
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "stale lock sweep failed"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    /// Deletes finished rows past their retention, a bounded batch per
    /// statement and a little every few seconds, so the table stays small
    /// under a constant stream without bursts of deletes; and, every half
    /// minute, lets the store vacuum if the database does not.
    pub(super) async fn purge(self: Arc<Self>, stop: CancellationToken) {
        const PURGE_BATCH: usize = 1000;
        const PURGE_EVERY: Duration = Duration::from_secs(5);
        const MAINTAIN_EVERY: Duration = Duration::from_secs(30);
        let mut last_maintained = Instant::now();
        let mut warned = false;
        loop {
            let mut purged = 0;
            while !stop.is_cancelled() {
                match self
                    .store
                    .purge(self.retention.sent, self.retention.failed, PURGE_BATCH)
                    .await
                {
                    Ok(n) => {
                        purged += n;
                        if (n as usize) < PURGE_BATCH {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "retention purge failed");
                        break;
                    }
                }
            }
            if purged > 0 {
                tracing::debug!(count = purged, "finished rows purged");
            }
            if last_maintained.elapsed() >= MAINTAIN_EVERY {
                last_maintained = Instant::now();
                // Reports go with failed rows' retention; expired
                // suppression entries go at once.
                if let Err(e) = self
                    .store
                    .purge_feedback(self.retention.failed, PURGE_BATCH)
                    .await
                {
                    tracing::warn!(error = %e, "retention purge of reports failed");
                }
                // Send cap reservations that no window counts any more
                // (DESIGN §16).
                if !self.caps.is_empty() {
                    let keep = self.caps.longest_window() + Duration::from_secs(60);
                    if let Err(e) = self.store.purge_cap_uses(keep).await {
                        tracing::warn!(error = %e, "purge of send cap reservations failed");
                    }
                }
                match self.store.maintain().await {
                    Ok(Some(Maintenance::Vacuumed {
                        dead_rows,
                        autovacuum,
                    })) => tracing::info!(dead_rows, autovacuum, "table maintenance: vacuumed"),
                    Ok(Some(Maintenance::CannotVacuum { dead_rows })) if !warned => {
                        warned = true;
                        tracing::warn!(
                            dead_rows,
                            "table maintenance: dead rows pile up and autovacuum does not clear \
                             them; this role may not VACUUM mail_queue (claims will slow down)"
                        );
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "table maintenance failed"),
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(PURGE_EVERY) => {}
            }
        }
    }

    /// Reports this daemon every few seconds: what it holds, what it sent
    /// and failed since the last report (the per-minute counts behind
    /// `status`'s rates and the console's chart). Its row goes when it stops.
    pub(super) async fn heartbeat(self: Arc<Self>, stop: CancellationToken) {
        const EVERY: Duration = Duration::from_secs(5);
        let mut reported = (0, 0, 0);
        loop {
            let stopping = stop.is_cancelled();
            reported = self.report_daemon(reported).await;
            self.refresh_caps().await;
            if stopping {
                break;
            }
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(EVERY) => {}
            }
        }
        if let Err(e) = self.store.daemon_stopped(self.daemon_id).await {
            tracing::debug!(error = %e, "could not remove this daemon's row");
        }
    }

    /// One report; returns the sent and failed counts it covered (those
    /// before it when the database did not take it).
    async fn report_daemon(&self, before: (u64, u64, u64)) -> (u64, u64, u64) {
        let (sent_before, failed_before, bytes_before) = before;
        let sent = self.metrics.count(Outcome::Sent);
        let failed = self.metrics.count(Outcome::Failed);
        let bytes = self.metrics.attachment_bytes();
        let beat = DaemonBeat {
            id: self.daemon_id,
            host: self.message_id_domain.clone(),
            pid: std::process::id() as i32,
            version: env!("CARGO_PKG_VERSION").to_string(),
            in_flight: self.held.len() as i32,
            sent_total: sent as i64,
            sent_since: (sent - sent_before) as i64,
            failed_since: (failed - failed_before) as i64,
            attachment_bytes_since: (bytes - bytes_before) as i64,
        };
        match self.store.heartbeat(&beat).await {
            Ok(()) => (sent, failed, bytes),
            Err(e) => {
                tracing::debug!(error = %e, "daemon report failed");
                before
            }
        }
    }

    /// Tells systemd the worker is alive, but only while the database answers
    /// its claims and commits (an idle worker still claims every poll).
    pub(super) async fn watchdog(self: Arc<Self>, interval: Duration, stop: CancellationToken) {
        let alive = interval.max(self.settings.poll_interval * 3);
        loop {
            if self.database_answered_within(alive) {
                systemd::notify("WATCHDOG=1");
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval / 3) => {}
            }
        }
    }
}
