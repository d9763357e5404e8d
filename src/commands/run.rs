//! `tablemail run`: the daemon, wired from its settings.

use std::{sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;

use crate::{
    config::{credential_path, Settings},
    feedback::{
        inbound::{self, Envelope, InboundOptions, Refusal, ReportSink},
        record::Recorder,
        webhooks,
    },
    http, mail, shutdown,
    store::{FeedbackSource, Store},
    systemd,
    telemetry::redact_addresses,
    worker::{
        retry,
        route::{Route, Routes},
        Worker,
    },
};

use super::{connect, message_defaults, CommandError, Result};

/// Waits for the first database round-trip, retrying with backoff; `false`
/// when cancelled first.
async fn wait_for_database(store: &Arc<dyn Store>, cancel: &CancellationToken) -> bool {
    let mut failures = 0;
    loop {
        match store.ping().await {
            Ok(()) => return true,
            Err(e) => {
                failures += 1;
                let pause =
                    retry::relay_pause(failures, retry::jitter()).min(Duration::from_secs(30));
                tracing::error!(error = %e, retry_in_ms = pause.as_millis() as u64, "{}", e.summary());
                tokio::select! {
                    _ = cancel.cancelled() => return false,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
}

/// The configuration faults a daemon can start with but cannot send all
/// mail under (DESIGN §2: they never burn a mail), each logged at error
/// level now; returned for `/healthz`, which names them while they last.
fn config_faults(settings: &Settings, no_sender: bool) -> Vec<String> {
    let mut faults = Vec::new();
    if no_sender {
        tracing::error!(
            "configuration fault: defaults.from_address is not set: rows without a sender wait until it is"
        );
        faults.push(
            "defaults.from_address is not set: rows without a sender wait until it is".to_string(),
        );
    }
    let routes = settings.routes.iter().flat_map(|r| {
        r.transport(&settings.transport)
            .plaintext_auth_refused()
            .into_iter()
            .map(move |key| format!("route {}: {key}", r.name))
    });
    let refused = settings
        .transport
        .plaintext_auth_refused()
        .into_iter()
        .map(str::to_string)
        .chain(routes);
    for key in refused {
        tracing::error!(
            relay = %key,
            "configuration fault: AUTH without TLS refused (transport.allow_plaintext_auth is false): this relay gets no mail"
        );
        faults.push(format!(
            "{key} has a username but no TLS: AUTH refused, the password would go in clear \
             (use ?tls=required or smtps://, or set transport.allow_plaintext_auth = true)"
        ));
    }
    faults
}

/// Fetches the first OAuth2 token of each relay that uses one (waiting at
/// most a little while: a token endpoint that is down is a configuration
/// fault, said at error level, and mail waits until a token comes), then
/// keeps them renewed in the background.
async fn start_oauth2(transport: &crate::smtp::Transport, cancel: &CancellationToken) {
    for tokens in transport.oauth2() {
        match tokio::time::timeout(Duration::from_secs(30), tokens.fetch()).await {
            Ok(Ok(lifetime)) => tracing::info!(
                provider = tokens.provider(),
                lifetime_s = lifetime.as_secs(),
                "oauth2 token obtained"
            ),
            Ok(Err(e)) => tracing::error!(
                provider = tokens.provider(),
                error = %e,
                "configuration fault: no oauth2 token: mail waits until one comes"
            ),
            Err(_) => tracing::error!(
                provider = tokens.provider(),
                "configuration fault: the oauth2 token endpoint did not answer: mail waits until a token comes"
            ),
        }
        tokens.spawn_renewal(cancel.clone());
    }
}

/// Records what the inbound listener receives; `451` while it cannot.
struct ListenerSink(Recorder);

#[async_trait::async_trait]
impl ReportSink for ListenerSink {
    async fn deliver(&self, envelope: Envelope, message: Vec<u8>) -> Result<(), Refusal> {
        match self
            .0
            .record(&message, &envelope.recipients, FeedbackSource::Smtp)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::error!(error = %e, "report not recorded: the sender is told to try again");
                Err(Refusal::Unavailable)
            }
        }
    }
}

/// Binds `inbound.listen` and serves it until `cancel` fires.
async fn start_inbound(
    settings: &Settings,
    recorder: Recorder,
    cancel: CancellationToken,
) -> Result<()> {
    let inbound = &settings.inbound;
    let listen = inbound.listen.as_deref().expect("checked by the caller");
    let domain = recorder
        .verp
        .as_ref()
        .map(|v| v.domain().to_string())
        .ok_or_else(|| CommandError::Usage("inbound.listen needs bounce.domain".into()))?;
    let tls = match (&inbound.tls_cert_file, &inbound.tls_key_file) {
        (Some(cert), Some(key)) => Some(
            inbound::load_tls(&credential_path(cert), &credential_path(key))
                .map_err(|e| CommandError::Usage(format!("inbound.tls_cert_file: {e}")))?,
        ),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| CommandError::Runtime(format!("inbound.listen {listen}: {e}")))?;
    let options = InboundOptions {
        max_message_size: inbound.max_message_size.0 as usize,
        max_connections: inbound.max_connections,
        timeout: inbound.timeout,
        session_limit: inbound.session_limit,
        ..InboundOptions::new(&domain, &mail::local_hostname())
    };
    let options = InboundOptions { tls, ..options };
    tracing::info!(
        listen,
        bounce_domain = %domain,
        starttls = options.tls.is_some(),
        "inbound listener started"
    );
    tokio::spawn(inbound::serve(
        listener,
        options,
        Arc::new(ListenerSink(recorder)),
        cancel,
    ));
    Ok(())
}

/// Binds `webhooks.listen` and serves the providers' endpoints until
/// `cancel` fires (DESIGN §14).
async fn start_webhooks(
    settings: &Settings,
    listen: &str,
    recorder: Recorder,
    cancel: CancellationToken,
) -> Result<()> {
    let hooks = &settings.webhooks;
    let keys = hooks
        .keys()
        .map_err(|e| CommandError::Usage(e.to_string()))?;
    if keys.providers().is_empty() {
        tracing::warn!(
            listen,
            "webhooks.listen is set but no provider's key is: every endpoint answers 404"
        );
    }
    let options = webhooks::Options {
        max_body_size: hooks.max_body_size.0 as usize,
        rate_limit: hooks.rate_limit,
        timeout: hooks.timeout,
    };
    webhooks::start(listen, options, keys, recorder, cancel)
        .await
        .map_err(CommandError::Runtime)?;
    Ok(())
}

pub(super) async fn run(settings: &Settings) -> Result<()> {
    let cancel = shutdown::on_signal();
    let built = super::build_routes(settings)?;
    let transport = &built[0].transport;
    if let Some(dir) = transport.outbox() {
        tracing::warn!(
            dir = %dir.display(),
            "file transport: mails are written as .eml files and do not leave this machine"
        );
    }
    let defaults = message_defaults(settings)?;
    let faults = config_faults(settings, defaults.from_address.is_none());
    for signer in defaults.dkim.iter().flat_map(|s| s.iter()) {
        tracing::info!(
            dkim_domain = signer.domain(),
            dkim = signer.describe(),
            "DKIM signing mails from the domain and its subdomains"
        );
    }
    let routes = settings.routes.iter().flat_map(|r| {
        r.transport(&settings.transport)
            .clear_text_relays()
            .into_iter()
            .map(move |key| format!("route {}: {key}", r.name))
    });
    let clear = settings
        .transport
        .clear_text_relays()
        .into_iter()
        .map(str::to_string)
        .chain(routes);
    for key in clear {
        tracing::warn!(
            relay = %key,
            "relay without TLS (tls=none): mail travels in clear to another host"
        );
    }
    if let Some(to) = transport.redirected_to() {
        tracing::warn!(
            redirect_to = %redact_addresses(to.as_ref()),
            "staging redirect: every mail goes to transport.redirect_to"
        );
    }
    let store = connect(settings).await?;
    if !wait_for_database(&store, &cancel).await {
        return Ok(());
    }
    if settings.database.migrate {
        store.migrate().await?;
    }
    let mut built = built.into_iter();
    let default = built.next().expect("the default route");
    start_oauth2(&default.transport, &cancel).await;
    let transport = Arc::new(default.transport);
    let mut named = Vec::new();
    for route in built {
        start_oauth2(&route.transport, &cancel).await;
        tracing::info!(
            route = route.name.as_deref().unwrap_or_default(),
            from_domains = %route.from_domains.join(","),
            "route configured"
        );
        named.push(Route::new(
            route.name,
            &route.from_domains,
            Arc::new(route.transport),
        ));
    }
    let worker = Worker::with_routes(
        store.clone(),
        Routes::new(transport.clone(), named),
        settings.worker.clone(),
        settings.retention.clone(),
        defaults,
        mail::local_hostname(),
        crate::limits::Caps::new(&settings.limits),
    );
    for fault in faults {
        worker.metrics().config_fault(fault);
    }
    if settings.metrics.listen.is_some() || settings.console.listen.is_some() {
        // A pool of one connection of its own: scrapes and console pages
        // never wait for a connection the claims need.
        let mut database = settings.database.clone();
        database.max_connections = 1;
        let snapshot_store = database
            .connect()
            .await
            .map_err(|e| CommandError::Usage(format!("database.url: {e}")))?;
        super::opened(&snapshot_store);
        let token = settings
            .console
            .token()
            .map_err(|e| CommandError::Usage(e.to_string()))?;
        http::start(
            http::Endpoints {
                metrics: settings.metrics.listen.clone(),
                console: settings.console.listen.clone(),
                token,
            },
            http::Observed {
                metrics: worker.metrics(),
                transport,
                routes: worker
                    .routes()
                    .iter()
                    .skip(1)
                    .map(|(_, r)| (r.label().to_string(), r.transport.clone()))
                    .collect(),
                snapshots: http::Snapshots::new(),
            },
            snapshot_store,
            settings.worker.lock_timeout,
            cancel.clone(),
        )
        .await
        .map_err(|e| CommandError::Runtime(e.to_string()))?;
    }
    if settings.inbound.listen.is_some() {
        let recorder = super::feedback::recorder(settings, store.clone(), Some(worker.metrics()))?;
        start_inbound(settings, recorder, cancel.clone()).await?;
    }
    if let Some(listen) = &settings.webhooks.listen {
        let recorder = super::feedback::recorder(settings, store.clone(), Some(worker.metrics()))?;
        start_webhooks(settings, listen, recorder, cancel.clone()).await?;
    }
    // Migrated, and the database answered: ready to work.
    systemd::notify("READY=1");
    worker.run(cancel).await;
    Ok(())
}
