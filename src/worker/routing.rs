//! Which relay takes mail. The relay is probed at start and, while no mail
//! goes through, every `transport.probe_interval` (connect, TLS, EHLO and AUTH
//! as configured, QUIT), so `/healthz` and the logs know it is down before a
//! mail finds out. When it is unavailable and `transport.fallback_url` is set,
//! new sessions go to the fallback; the primary is probed and taken back as
//! soon as it answers. Without a fallback (or with both down) the relay gate
//! pauses sending.

use std::{sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;

use crate::{
    smtp::{Role, SendError},
    telemetry::redact_addresses,
};

use super::Worker;

impl Worker {
    /// The relay in use was found unavailable by a send (or a probe).
    pub(super) fn relay_unavailable(&self, e: &SendError, needs_operator: bool, probe_first: bool) {
        let reason = redact_addresses(&e.to_string());
        if self.transport.active() == Role::Primary && self.transport.use_fallback(true) {
            tracing::warn!(
                error = %reason,
                smtp_code = e.code(),
                relay = Role::Fallback.as_str(),
                "relay unavailable: sending through the fallback relay"
            );
            return;
        }
        self.relay
            .trip(&reason, needs_operator, probe_first, e.code());
        self.metrics.relay_down(&reason);
    }

    /// Probes the primary relay, then the fallback: the first that answers
    /// takes new sessions. Returns whether one answered.
    async fn probe_and_route(&self) -> Result<Role, SendError> {
        let primary = self.transport.probe(Role::Primary).await;
        let found = match primary {
            Ok(_) => Ok(Role::Primary),
            Err(e) if self.transport.has_fallback() => {
                match self.transport.probe(Role::Fallback).await {
                    Ok(_) => Ok(Role::Fallback),
                    Err(_) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        if let Ok(role) = found {
            if self.transport.use_fallback(role == Role::Fallback) {
                match role {
                    Role::Primary => tracing::info!(
                        relay = role.as_str(),
                        "primary relay available again: leaving the fallback"
                    ),
                    Role::Fallback => tracing::warn!(
                        relay = role.as_str(),
                        "relay unavailable: sending through the fallback relay"
                    ),
                }
            }
            self.metrics.relay_up();
        }
        found
    }

    /// Whether rows may be claimed for the relay now: not while it is paused;
    /// after a pause for an unreachable relay, only once a probe finds it (or
    /// the fallback) answering.
    pub(super) async fn relay_ready(&self) -> bool {
        if self.relay.paused_for().is_some() {
            return false;
        }
        if !self.relay.wants_probe() {
            return true;
        }
        match self.probe_and_route().await {
            Ok(_) => {
                self.relay.probed();
                true
            }
            Err(e) => {
                self.relay_unavailable(&e, e.needs_operator(), true);
                false
            }
        }
    }

    /// Probes at start, then every `transport.probe_interval` while no mail
    /// went through in that time, or while the fallback is in use (to take
    /// the primary back).
    pub(super) async fn probe_relay(self: Arc<Self>, stop: CancellationToken) {
        let every = self.transport.probe_interval().max(MIN_PROBE_INTERVAL);
        match self.probe_and_route().await {
            Ok(role) => tracing::info!(relay = role.as_str(), "relay reachable"),
            Err(e) => {
                tracing::error!(
                    error = %redact_addresses(&e.to_string()),
                    smtp_code = e.code(),
                    "relay unreachable at start"
                );
                self.relay.trip(
                    &redact_addresses(&e.to_string()),
                    e.needs_operator(),
                    true,
                    e.code(),
                );
                self.metrics.relay_down(&redact_addresses(&e.to_string()));
            }
        }
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let busy = self.relay.last_success_age().is_some_and(|age| age < every);
            let on_fallback = self.transport.active() == Role::Fallback;
            if busy && !on_fallback && self.relay.is_up() {
                continue;
            }
            if self.relay.paused_for().is_some() && !on_fallback {
                // The claimer probes when the pause ends.
                continue;
            }
            match self.probe_and_route().await {
                Ok(_) => {
                    if self.relay.wants_probe() {
                        self.relay.probed();
                        self.wake.notify_one();
                    }
                }
                Err(e) if self.relay.is_up() || on_fallback => {
                    self.relay_unavailable(&e, e.needs_operator(), true);
                }
                Err(_) => {}
            }
        }
    }
}

/// Not shorter than this, whatever the setting: a probe is a connection.
pub(super) const MIN_PROBE_INTERVAL: Duration = Duration::from_millis(200);
