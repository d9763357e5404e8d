//! tablemail: a worker daemon for a transactional mail queue kept in a
//! database table.
//!
//! Applications INSERT one row per mail inside their own transactions; the
//! daemon claims due rows in batches under a per-batch GUID lock, sends them
//! over SMTP, records the outcome, retries transient failures while attempts
//! remain, and releases stale locks left by crashed workers.
//!
//! # Layout
//! - [`cli`]: the clap command line.
//! - [`commands`]: what each command does (run, migrate, enqueue, status, …).
//! - [`config`]: `Settings`: defaults < file < `TABLEMAIL__*` environment.
//! - [`telemetry`]: JSON or pretty logs; address redaction.
//! - [`shutdown`]: SIGTERM | SIGINT -> `CancellationToken`.
//! - [`mail`]: a claimed row -> a lettre `Message`, with validation.
//! - [`transport`]: stage-aware SMTP client and pool; the file transport.
//! - [`retry`]: backoff arithmetic.
//! - [`pace`]: `worker.rate_limit`, and slowing down when the relay throttles.
//! - [`worker`]: claim -> send -> finalize, lock renewal, stale-lock sweeps.
//! - [`store`]: the `Store` trait and one module per database.
//! - [`metrics`]: `/metrics` (Prometheus) and `/healthz` on `metrics.listen`.
//! - [`systemd`]: READY/WATCHDOG/STOPPING notifications under `Type=notify`.
#![forbid(unsafe_code)]

pub mod cli;
pub mod commands;
pub mod config;
pub mod mail;
pub mod metrics;
pub mod pace;
pub mod retry;
pub mod shutdown;
pub mod store;
pub mod systemd;
pub mod telemetry;
pub mod transport;
pub mod worker;
