//! HTTP, on axum: `/metrics` and `/healthz` on `metrics.listen`, the
//! operator console (DESIGN §9) on `console.listen`; one listener serves both
//! when the two addresses are the same.
//!
//! Neither runs a query on the daemon's pool. What they show of the queue
//! comes from the [`snapshot`], refreshed every few seconds by one task on a
//! pool of one connection of its own; the console's mail list and a mail's
//! page read that same connection live, so they queue behind each other and
//! never behind the claims. Counters and the relay's state are the worker's
//! live [`Metrics`].
//!
//! - [`snapshot`]: the figures and the task that keeps them fresh.
//! - [`auth`]: token login, sessions, CSRF: who may retry and cancel.
//! - [`chart`]: sent and failed per minute as the shapes of an inline SVG.
//! - `console`: the pages (overview, mails, login), templates compiled in
//!   (`templates/`).
//! - [`limit`]: at most 64 HTTP connections, each for a minute at most.

pub mod auth;
pub mod chart;
mod console;
pub mod limit;
pub mod snapshot;

use std::{sync::Arc, time::Duration};

use axum::{
    extract::State,
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use secrecy::SecretString;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::{metrics::Metrics, smtp::Transport, store::Store};

pub use snapshot::{Snapshot, Snapshots};

/// What the endpoints show: the worker's counters, the transport's relays,
/// the snapshot.
pub struct Observed {
    pub metrics: Arc<Metrics>,
    pub transport: Arc<Transport>,
    /// The routes besides the default, by label (DESIGN §13).
    pub routes: Vec<(String, Arc<Transport>)>,
    pub snapshots: Arc<Snapshots>,
}

/// Where to listen and what to serve there.
pub struct Endpoints {
    /// `metrics.listen`.
    pub metrics: Option<String>,
    /// `console.listen`.
    pub console: Option<String>,
    /// The console's token (`console.token_file`); `None`: read-only.
    pub token: Option<SecretString>,
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("{key} {address}: {source}")]
    Bind {
        key: &'static str,
        address: String,
        source: std::io::Error,
    },
}

/// Binds the listeners, starts the snapshot's task on `store` (a pool of
/// its own) and serves until `stop`. Nothing starts when neither address is
/// set.
pub async fn start(
    endpoints: Endpoints,
    observed: Observed,
    store: Arc<dyn Store>,
    lock_timeout: Duration,
    stop: CancellationToken,
) -> Result<(), HttpError> {
    let bind = |key: &'static str, address: String| async move {
        TcpListener::bind(&address)
            .await
            .map(limit::Limited::new)
            .map_err(|source| HttpError::Bind {
                key,
                address,
                source,
            })
    };
    let shared = endpoints.metrics.is_some() && endpoints.metrics == endpoints.console;
    let metrics_listener = match &endpoints.metrics {
        Some(address) => Some(bind("metrics.listen", address.clone()).await?),
        None => None,
    };
    let console_listener = match &endpoints.console {
        Some(_) if shared => None,
        Some(address) => Some(bind("console.listen", address.clone()).await?),
        None => None,
    };
    if endpoints.metrics.is_none() && endpoints.console.is_none() {
        return Ok(());
    }
    let observed = Arc::new(observed);
    tokio::spawn(
        observed
            .snapshots
            .clone()
            .keep_fresh(store.clone(), lock_timeout, stop.clone()),
    );
    // Without a fallback of its own: merged with the probes, or given one.
    let console = endpoints.console.as_ref().map(|_| {
        console::router(console::Console::new(
            observed.clone(),
            store,
            endpoints.token.as_ref(),
        ))
    });
    let read_only = endpoints.token.is_none();
    if let Some(listener) = metrics_listener {
        let mut router = probes(observed.clone());
        if shared {
            router = router.merge(console.clone().expect("console router"));
            tracing::info!(
                listen = %endpoints.metrics.as_deref().unwrap_or_default(),
                read_only,
                "serving /metrics, /healthz and the console"
            );
        } else {
            tracing::info!(
                listen = %endpoints.metrics.as_deref().unwrap_or_default(),
                "serving /metrics and /healthz"
            );
        }
        tokio::spawn(serve(listener, router.fallback(not_found), stop.clone()));
    }
    if let (Some(listener), Some(router)) = (console_listener, console) {
        tracing::info!(
            listen = %endpoints.console.as_deref().unwrap_or_default(),
            read_only,
            "serving the console"
        );
        tokio::spawn(serve(listener, router.fallback(not_found), stop));
    }
    Ok(())
}

async fn serve(listener: limit::Limited, router: Router, stop: CancellationToken) {
    let serving = axum::serve(listener, router).with_graceful_shutdown(stop.cancelled_owned());
    if let Err(e) = serving.await {
        tracing::warn!(error = %e, "http: serving stopped");
    }
}

/// `/metrics` and `/healthz`: from the snapshot and the live counters.
fn probes(observed: Arc<Observed>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .with_state(observed)
}

async fn metrics_text(State(observed): State<Arc<Observed>>) -> Response {
    let snapshot = observed.snapshots.latest().await;
    let text = crate::metrics::exposition(
        &observed.metrics,
        snapshot.figures.as_ref().map(|f| &f.stats),
        snapshot.database_ok(),
        snapshot.age(),
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn healthz(State(observed): State<Arc<Observed>>) -> Response {
    let snapshot = observed.snapshots.latest().await;
    let (healthy, body) = crate::metrics::health(&observed.metrics, snapshot.database_ok());
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        "not found\n",
    )
        .into_response()
}
