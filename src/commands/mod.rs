//! What each command does, on top of the store, the transport and the
//! worker: one file per family. Exit codes: 0 success, 1 runtime failure,
//! 2 bad configuration or usage.
//!
//! - [`run`]: the daemon.
//! - [`enqueue`]: inserting mails from flags or JSON lines.
//! - [`status`]: what the queue holds and how it fares; one mail (`show`).
//! - [`admin`]: migrate, retry, cancel, purge, check.
//! - [`feedback`]: ingest a report, the suppression list.
//! - `templates`: the templates in the database.

mod admin;
mod enqueue;
pub mod feedback;
mod run;
mod status;
mod templates;

use std::{process::ExitCode, sync::Arc};

use crate::{
    cli::Command,
    config::Settings,
    mail::{self, MessageDefaults},
    smtp::Transport,
    store::{Store, StoreError},
};

pub const EXIT_RUNTIME: u8 = 1;
pub const EXIT_CONFIG: u8 = 2;
/// `tablemail ingest` while the database is away (EX_TEMPFAIL): the mail
/// system that ran it delivers the report again later.
pub const EXIT_TEMPFAIL: u8 = 75;

/// The runtime's worker threads: one per core, at most this many. The
/// daemon spends little CPU per mail, so more threads would only count
/// against the unit's `TasksMax=`.
pub const MAX_WORKER_THREADS: usize = 8;

/// Threads of the blocking pool (large or DKIM-signed messages being built,
/// `.eml` files, DNS lookups of the relay), instead of tokio's 512: one per
/// lane at the default `worker.concurrency` and as many again for lookups.
/// More work waits for a free thread. Together with the worker threads,
/// the log writer and the main thread this stays under the unit's
/// `TasksMax=64` (SQLite adds one thread per pooled connection, and two for
/// its wake-up: the watcher's connection and the file watch).
pub const MAX_BLOCKING_THREADS: usize = 32;

/// The runtime every command runs on, with its threads bounded (see
/// [`MAX_WORKER_THREADS`], [`MAX_BLOCKING_THREADS`]).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores.min(MAX_WORKER_THREADS))
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .enable_all()
        .build()
}

/// A command's failure, by exit code.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// Bad configuration or usage: exit 2.
    #[error("{0}")]
    Usage(String),
    /// Anything that went wrong while running: exit 1.
    #[error("{0}")]
    Runtime(String),
    /// Try again later: exit 75.
    #[error("{0}")]
    TempFail(String),
}

impl From<StoreError> for CommandError {
    fn from(e: StoreError) -> Self {
        CommandError::Runtime(e.to_string())
    }
}

type Result<T, E = CommandError> = std::result::Result<T, E>;

/// Runs one command and maps its result to an exit code.
pub async fn execute(command: Command, settings: Settings) -> ExitCode {
    let daemon = matches!(command, Command::Run);
    let result = match command {
        Command::Run => run::run(&settings).await,
        Command::Migrate => admin::migrate(&settings).await,
        Command::Enqueue(args) => enqueue::enqueue(&settings, *args).await,
        Command::Status { json } => status::status(&settings, json).await,
        Command::Show(args) => status::show(&settings, args).await,
        Command::Retry(args) => admin::retry(&settings, args).await,
        Command::Cancel { id } => admin::cancel(&settings, id).await,
        Command::Purge => admin::purge(&settings).await,
        Command::Check => admin::check(&settings).await,
        Command::Ingest(args) => feedback::ingest(&settings, args).await,
        Command::Suppress { command } => feedback::suppress(&settings, command).await,
        Command::Template { command } => templates::template(&settings, command).await,
    };
    close_opened().await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if daemon {
                tracing::error!(error = %e, "tablemail stopped");
            }
            eprintln!("tablemail: {e}");
            ExitCode::from(match e {
                CommandError::Usage(_) => EXIT_CONFIG,
                CommandError::Runtime(_) => EXIT_RUNTIME,
                CommandError::TempFail(_) => EXIT_TEMPFAIL,
            })
        }
    }
}

/// The sender of mails without one when the transport is the file transport
/// (development, the embedded defaults) and `defaults.from_address` is unset.
pub const DEVELOPMENT_SENDER: &str = "tablemail@localhost";

/// The defaults every message takes from the configuration. With the file
/// transport a missing sender is [`DEVELOPMENT_SENDER`]; with a relay it stays
/// missing, and rows without a sender wait for the operator.
pub fn message_defaults(settings: &Settings) -> Result<MessageDefaults> {
    let development = matches!(
        crate::smtp::TransportKind::parse(&settings.transport.url),
        Ok(crate::smtp::TransportKind::File { .. })
    );
    let from_address = settings
        .defaults
        .from_address
        .as_deref()
        .or(development.then_some(DEVELOPMENT_SENDER))
        .map(mail::parse_address)
        .transpose()
        .map_err(|e| CommandError::Usage(format!("defaults.from_address: {e}")))?;
    Ok(MessageDefaults {
        from_address,
        from_name: settings.defaults.from_name.clone(),
        max_message_size: settings.transport.max_message_size.0,
        max_recipients: settings.transport.max_recipients,
        dkim: {
            let mut signers = Vec::new();
            // `[[dkim]]` and each route's key: the most specific domain at
            // or above a mail's From domain signs it.
            let routes = settings.routes.iter().filter_map(|r| r.dkim.as_ref());
            for key in settings.dkim.keys().iter().chain(routes) {
                if let Some(signer) = key
                    .signer()
                    .map_err(|e| CommandError::Usage(e.to_string()))?
                {
                    signers.push(signer);
                }
            }
            (!signers.is_empty()).then(|| std::sync::Arc::new(crate::dkim::Signers::new(signers)))
        },
        bounce: settings
            .bounce
            .verp()
            .map_err(|e| CommandError::Usage(e.to_string()))?
            .map(std::sync::Arc::new),
    })
}

/// The database named by `database.*`, closed when the command ends.
async fn connect(settings: &Settings) -> Result<Arc<dyn Store>> {
    let store = settings
        .database
        .connect()
        .await
        .map_err(|e| CommandError::Usage(format!("database.url: {e}")))?;
    opened(&store);
    Ok(store)
}

/// The databases the command opened, whose idle connections are closed
/// politely when it ends, whichever way it ends (see [`Store::close`]).
static OPENED: std::sync::Mutex<Vec<Arc<dyn Store>>> = std::sync::Mutex::new(Vec::new());

fn opened(store: &Arc<dyn Store>) {
    OPENED
        .lock()
        .expect("opened stores")
        .push(Arc::clone(store));
}

async fn close_opened() {
    let stores = std::mem::take(&mut *OPENED.lock().expect("opened stores"));
    futures_util::future::join_all(stores.iter().map(|s| s.close())).await;
}

/// The transport named by `transport.*`.
/// A route as the commands build it: its name (`None`: `transport.*`), its
/// domains and its relay.
pub struct BuiltRoute {
    pub name: Option<String>,
    pub from_domains: Vec<String>,
    pub transport: Transport,
}

/// The default route and every `[[routes]]` one, their relays built.
pub fn build_routes(settings: &Settings) -> Result<Vec<BuiltRoute>> {
    let mut routes = vec![BuiltRoute {
        name: None,
        from_domains: Vec::new(),
        transport: build_transport(settings)?,
    }];
    for route in &settings.routes {
        let transport = route
            .transport(&settings.transport)
            .client(&mail::local_hostname())
            .map_err(|e| CommandError::Usage(format!("route {}: {e}", route.name)))?;
        routes.push(BuiltRoute {
            name: Some(route.name.clone()),
            from_domains: route.from_domains.clone(),
            transport,
        });
    }
    Ok(routes)
}

/// The route names queued rows give that no configuration has.
pub async fn unknown_routes(settings: &Settings, store: &Arc<dyn Store>) -> Result<Vec<String>> {
    let mut unknown = store.queued_routes().await?;
    unknown.retain(|name| !settings.routes.iter().any(|r| &r.name == name));
    unknown.sort();
    Ok(unknown)
}

pub fn build_transport(settings: &Settings) -> Result<Transport> {
    settings
        .transport
        .client(&mail::local_hostname())
        .map_err(|e| CommandError::Usage(e.to_string()))
}
