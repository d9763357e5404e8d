//! tablemail: a worker daemon for a transactional mail queue kept in a
//! database table.
//!
//! Applications INSERT one row per mail inside their own transactions; the
//! daemon claims due rows in batches under a per-batch GUID lock, sends them
//! over SMTP, records the outcome, retries transient failures while attempts
//! remain, and releases stale locks left by crashed workers.
//!
//! # Layout
//! Read bottom-up; the arrows run one way: `main -> commands -> worker ->
//! {smtp, mail, store}`; `config` builds the clients; `metrics` and `http`
//! see outcomes and snapshots, never the worker.
//! - [`store`]: one `Store` interface, SQL per database, shared code once.
//! - [`mail`]: a row's draft -> checked, maybe DKIM-signed message bytes.
//! - [`smtp`]: the stage-aware SMTP client, its pool, fallback, file transport.
//! - [`dkim`]: the DKIM key and which mails it signs.
//! - [`limits`]: send caps shared by every daemon, and warm-up.
//! - [`feedback`]: bounces and complaints: VERP, parser, correlation, the
//!   SMTP listener, the providers' webhooks.
//! - [`metrics`]: outcome counters, relay health, `/metrics` and `/healthz`.
//! - [`http`]: `/metrics`, `/healthz` and the console (axum), from snapshots.
//! - [`worker`]: claim -> send -> group commit; outcome policy, pacing, chores.
//! - [`config`]: `Settings`: defaults < file < `TABLEMAIL__*` environment.
//! - [`telemetry`]: flat JSON or pretty logs that never block; redaction.
//! - [`templates`]: templates in the database, rendered at send time.
//! - [`random`]: cheap per-thread randomness for jitter and MIME boundaries.
//! - [`shutdown`]: SIGTERM | SIGINT -> `CancellationToken`.
//! - [`systemd`]: READY/WATCHDOG/STOPPING notifications under `Type=notify`.
//! - [`cli`]: the clap command line.
//! - [`commands`]: what each command does (run, migrate, enqueue, status, …).
#![forbid(unsafe_code)]

pub mod cli;
pub mod commands;
pub mod config;
pub mod dkim;
pub mod feedback;
pub mod http;
pub mod limits;
pub mod mail;
pub mod metrics;
pub mod random;
pub mod shutdown;
pub mod smtp;
pub mod store;
pub mod systemd;
pub mod telemetry;
pub mod templates;
pub mod worker;
