//! Which relay takes mail, route by route. Each route's relay is probed at
//! start and, while no mail goes through it, every
//! `transport.probe_interval` (connect, TLS, EHLO and AUTH as configured,
//! QUIT), so `/healthz` and the logs know it is down before a mail finds
//! out. When it is unavailable and the route has a fallback, new sessions go
//! to the fallback; the primary is probed and taken back as soon as it
//! answers. Without a fallback (or with both down) the route's relay gate
//! pauses its mail; claims pause only when every route is paused.

use std::{sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;

use crate::{
    smtp::{Role, SendError},
    telemetry::redact_addresses,
};

use super::{
    route::{Route, RouteId},
    Worker,
};

impl Worker {
    /// The relay `route` uses was found unavailable by a send (or a probe).
    pub(super) fn relay_unavailable(
        &self,
        route: &Route,
        e: &SendError,
        needs_operator: bool,
        probe_first: bool,
    ) {
        let reason = redact_addresses(&e.to_string());
        let transport = &route.transport;
        if transport.active() == Role::Primary && transport.use_fallback(true) {
            tracing::warn!(
                route = route.label(),
                error = %reason,
                smtp_code = e.code(),
                relay = Role::Fallback.as_str(),
                "relay unavailable: sending through the fallback relay"
            );
            return;
        }
        route
            .relay
            .trip(&reason, needs_operator, probe_first, e.code());
        self.metrics.route_down(route.label(), &reason);
    }

    /// Probes a route's primary relay, then its fallback: the first that
    /// answers takes new sessions. Returns which one answered.
    async fn probe_and_route(&self, route: &Route) -> Result<Role, SendError> {
        let transport = &route.transport;
        let primary = transport.probe(Role::Primary).await;
        let found = match primary {
            Ok(_) => Ok(Role::Primary),
            Err(e) if transport.has_fallback() => match transport.probe(Role::Fallback).await {
                Ok(_) => Ok(Role::Fallback),
                Err(_) => Err(e),
            },
            Err(e) => Err(e),
        };
        if let Ok(role) = found {
            if transport.use_fallback(role == Role::Fallback) {
                match role {
                    Role::Primary => tracing::info!(
                        route = route.label(),
                        relay = role.as_str(),
                        "primary relay available again: leaving the fallback"
                    ),
                    Role::Fallback => tracing::warn!(
                        route = route.label(),
                        relay = role.as_str(),
                        "relay unavailable: sending through the fallback relay"
                    ),
                }
            }
            self.metrics.route_up(route.label());
        }
        found
    }

    /// How long claims wait: while every route is paused, until the first
    /// pause ends. One route that is down holds up only its own mail.
    pub(super) fn claim_pause(&self) -> Option<Duration> {
        self.routes
            .iter()
            .map(|(_, r)| r.relay.paused_for())
            .try_fold(Duration::MAX, |least, pause| pause.map(|p| least.min(p)))
    }

    /// Whether rows may be claimed now: a route that was found unreachable
    /// is probed first, after its pause; rows are claimed once some route
    /// is ready.
    pub(super) async fn relay_ready(&self) -> bool {
        let mut ready = false;
        for (id, route) in self.routes.iter() {
            ready |= self.route_ready(id, route).await;
        }
        ready
    }

    async fn route_ready(&self, _id: RouteId, route: &Route) -> bool {
        if route.relay.paused_for().is_some() {
            return false;
        }
        if !route.relay.wants_probe() {
            return true;
        }
        match self.probe_and_route(route).await {
            Ok(_) => {
                route.relay.probed();
                true
            }
            Err(e) => {
                self.relay_unavailable(route, &e, e.needs_operator(), true);
                false
            }
        }
    }

    /// Probes every route's relay, each on its own schedule.
    pub(super) async fn probe_relays(self: Arc<Self>, stop: CancellationToken) {
        let probes: Vec<_> = (0..self.routes.len())
            .map(|id| tokio::spawn(self.clone().probe_route(id, stop.clone())))
            .collect();
        for probe in probes {
            let _ = probe.await;
        }
    }

    /// Probes a route at start, then every `transport.probe_interval` while
    /// no mail went through it in that time, or while its fallback is in use
    /// (to take the primary back).
    async fn probe_route(self: Arc<Self>, id: RouteId, stop: CancellationToken) {
        let route = self.routes.get(id);
        let every = route.transport.probe_interval().max(MIN_PROBE_INTERVAL);
        match self.probe_and_route(route).await {
            Ok(role) => tracing::info!(
                route = route.label(),
                relay = role.as_str(),
                "relay reachable"
            ),
            Err(e) => {
                tracing::error!(
                    route = route.label(),
                    error = %redact_addresses(&e.to_string()),
                    smtp_code = e.code(),
                    "relay unreachable at start"
                );
                route.relay.trip(
                    &redact_addresses(&e.to_string()),
                    e.needs_operator(),
                    true,
                    e.code(),
                );
                self.metrics
                    .route_down(route.label(), &redact_addresses(&e.to_string()));
            }
        }
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let busy = route
                .relay
                .last_success_age()
                .is_some_and(|age| age < every);
            let on_fallback = route.transport.active() == Role::Fallback;
            if busy && !on_fallback && route.relay.is_up() {
                continue;
            }
            if route.relay.paused_for().is_some() && !on_fallback {
                // The claimer probes when the pause ends.
                continue;
            }
            match self.probe_and_route(route).await {
                Ok(_) => {
                    if route.relay.wants_probe() {
                        route.relay.probed();
                        self.wake.notify_one();
                    }
                }
                Err(e) if route.relay.is_up() || on_fallback => {
                    self.relay_unavailable(route, &e, e.needs_operator(), true);
                }
                Err(_) => {}
            }
        }
    }
}

/// Not shorter than this, whatever the setting: a probe is a connection.
pub(super) const MIN_PROBE_INTERVAL: Duration = Duration::from_millis(200);
