//! What each command does, on top of the store, the transport and the worker.
//! Exit codes: 0 success, 1 runtime failure, 2 bad configuration or usage.

use std::{io::BufRead, process::ExitCode, sync::Arc, time::Duration};

use chrono::{DateTime, Utc};
use secrecy::ExposeSecret;
use tokio_util::sync::CancellationToken;

use crate::{
    cli::{Command, EnqueueArgs, RetryArgs},
    config::Settings,
    mail::{self, MessageDefaults},
    metrics, retry, shutdown,
    store::{self, NewMail, RetrySelection, Store, StoreError},
    systemd,
    telemetry::redact_addresses,
    transport::{Transport, TransportKind},
    worker::Worker,
};

pub const EXIT_RUNTIME: u8 = 1;
pub const EXIT_CONFIG: u8 = 2;

/// A command's failure, by exit code.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// Bad configuration or usage: exit 2.
    #[error("{0}")]
    Usage(String),
    /// Anything that went wrong while running: exit 1.
    #[error("{0}")]
    Runtime(String),
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
        Command::Run => run(&settings).await,
        Command::Migrate => migrate(&settings).await,
        Command::Enqueue(args) => enqueue(&settings, *args).await,
        Command::Status { json } => status(&settings, json).await,
        Command::Retry(args) => retry_failed(&settings, args).await,
        Command::Cancel { id } => cancel(&settings, id).await,
        Command::Purge => purge(&settings).await,
        Command::Check => check(&settings).await,
    };
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
            })
        }
    }
}

/// The defaults every message takes from the configuration.
pub fn message_defaults(settings: &Settings) -> Result<MessageDefaults> {
    let from_address = settings
        .defaults
        .from_address
        .as_deref()
        .map(mail::parse_address)
        .transpose()
        .map_err(|e| CommandError::Usage(format!("defaults.from_address: {e}")))?;
    Ok(MessageDefaults {
        from_address,
        from_name: settings.defaults.from_name.clone(),
        max_message_size: settings.transport.max_message_size.0,
    })
}

async fn connect(settings: &Settings) -> Result<Arc<dyn Store>> {
    store::connect(
        settings.database.url.expose_secret(),
        settings.database.max_connections,
    )
    .await
    .map_err(|e| CommandError::Usage(format!("database.url: {e}")))
}

/// Builds the transport named by `transport.url`.
pub fn build_transport(settings: &Settings) -> Result<Transport> {
    let password = settings
        .smtp_password()
        .map_err(|e| CommandError::Usage(e.to_string()))?;
    Transport::new(&settings.transport, password, &mail::local_hostname())
        .map_err(|e| CommandError::Usage(format!("transport: {e}")))
}

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
                tracing::error!(error = %e, retry_in_ms = pause.as_millis() as u64, "database unavailable");
                tokio::select! {
                    _ = cancel.cancelled() => return false,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
}

async fn run(settings: &Settings) -> Result<()> {
    let cancel = shutdown::on_signal();
    let transport = build_transport(settings)?;
    if let Ok(TransportKind::File { dir }) = TransportKind::parse(&settings.transport.url) {
        tracing::warn!(
            dir = %dir.display(),
            "file transport: mails are written as .eml files and do not leave this machine"
        );
    }
    let defaults = message_defaults(settings)?;
    let store = connect(settings).await?;
    if !wait_for_database(&store, &cancel).await {
        return Ok(());
    }
    if settings.database.migrate {
        store.migrate().await?;
    }
    let worker = Worker::new(
        store.clone(),
        Arc::new(transport),
        settings.worker.clone(),
        settings.retention.clone(),
        defaults,
        mail::local_hostname(),
    );
    if let Some(listen) = &settings.metrics.listen {
        let addr = listen.parse().expect("validated with the configuration");
        let listener = metrics::bind(addr)
            .await
            .map_err(|e| CommandError::Runtime(format!("metrics.listen {listen}: {e}")))?;
        tracing::info!(listen = %listen, "serving /metrics and /healthz");
        let serving = metrics::serve(
            listener,
            worker.clone(),
            store,
            settings.worker.lock_timeout,
            cancel.clone(),
        );
        tokio::spawn(serving);
    }
    // Migrated, and the database answered: ready to work.
    systemd::notify("READY=1");
    worker.run(cancel).await;
    Ok(())
}

async fn migrate(settings: &Settings) -> Result<()> {
    let store = connect(settings).await?;
    store.migrate().await?;
    println!("migrations applied ({})", store.backend());
    Ok(())
}

/// Turns the flags of `enqueue` into one mail.
fn mail_from_flags(args: EnqueueArgs) -> Result<NewMail> {
    let send_at = args.send_at.as_deref().map(parse_send_at).transpose()?;
    let mut headers = serde_json::Map::new();
    for h in &args.header {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| CommandError::Usage(format!("--header `{h}`: expected NAME:VALUE")))?;
        headers.insert(
            name.trim().to_string(),
            serde_json::Value::String(value.trim_start().to_string()),
        );
    }
    Ok(NewMail {
        to_address: args.to.unwrap_or_default(),
        subject: args.subject,
        body: args.body,
        body_html: args.html,
        cc: args.cc,
        bcc: args.bcc,
        reply_to: args.reply_to,
        from_name: args.from_name,
        from_address: args.from,
        priority: args.priority,
        send_at,
        dedupe_key: args.dedupe_key,
        headers: (!headers.is_empty()).then_some(headers),
        ..NewMail::default()
    })
}

/// An RFC 3339 time, or a delay from now such as `10m`.
fn parse_send_at(s: &str) -> Result<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let delay = humantime::parse_duration(s).map_err(|_| {
        CommandError::Usage(format!(
            "--send-at `{s}`: expected an RFC 3339 time or a delay such as 10m"
        ))
    })?;
    let delay = chrono::Duration::from_std(delay)
        .map_err(|_| CommandError::Usage(format!("--send-at `{s}`: too far away")))?;
    Ok(Utc::now() + delay)
}

async fn enqueue(settings: &Settings, args: EnqueueArgs) -> Result<()> {
    let defaults = message_defaults(settings)?;
    let mails = if args.jsonl {
        let mut mails = Vec::new();
        for (n, line) in std::io::stdin().lock().lines().enumerate() {
            let line = line.map_err(|e| CommandError::Runtime(format!("stdin: {e}")))?;
            if line.trim().is_empty() {
                continue;
            }
            let mail: NewMail = serde_json::from_str(&line)
                .map_err(|e| CommandError::Usage(format!("line {}: {e}", n + 1)))?;
            mail::check_new(&mail, &defaults)
                .map_err(|e| CommandError::Usage(format!("line {}: {e}", n + 1)))?;
            mails.push(mail);
        }
        mails
    } else {
        let mail = mail_from_flags(args)?;
        mail::check_new(&mail, &defaults).map_err(|e| CommandError::Usage(e.to_string()))?;
        vec![mail]
    };
    let store = connect(settings).await?;
    let results = store.enqueue(&mails).await?;
    for (mail, r) in mails.iter().zip(&results) {
        println!("{}", r.id);
        if r.duplicate {
            eprintln!(
                "tablemail: dedupe_key {:?} exists already as mail {}; nothing inserted",
                mail.dedupe_key.as_deref().unwrap_or_default(),
                r.id
            );
        }
    }
    Ok(())
}

/// What a failure came to, for counting: the SMTP reply code when the relay
/// gave one ("RCPT TO: 550 …" -> "550"), otherwise a short kind.
fn failure_kind(last_error: &str) -> String {
    let code = last_error
        .split_once(": ")
        .map(|(_, rest)| rest)
        .and_then(|rest| rest.get(..3))
        .filter(|c| {
            c.bytes().all(|b| b.is_ascii_digit()) && matches!(c.as_bytes()[0], b'4' | b'5')
        });
    if let Some(code) = code {
        return code.to_string();
    }
    let kind = if last_error.starts_with("expired") {
        "expired"
    } else if last_error.starts_with("no reply after end of data") {
        "no reply after \".\""
    } else if last_error.starts_with("lock expired") {
        "worker lost"
    } else if last_error.contains("connection lost") {
        "connection lost"
    } else {
        "invalid mail"
    };
    kind.to_string()
}

async fn status(settings: &Settings, json: bool) -> Result<()> {
    let store = connect(settings).await?;
    let mut stats = store.stats(settings.worker.lock_timeout).await?;
    for f in &mut stats.recent_failures {
        f.last_error = f.last_error.as_deref().map(redact_addresses);
    }
    let mut by_kind: Vec<(String, i64)> = Vec::new();
    for reason in store
        .failure_reasons(Duration::from_secs(3600), 10_000)
        .await?
    {
        let kind = failure_kind(&reason);
        match by_kind.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => by_kind.push((kind, 1)),
        }
    }
    by_kind.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let rates = [
        ("1m", stats.sent_last_1m as f64 / 60.0),
        ("5m", stats.sent_last_5m as f64 / 300.0),
        ("15m", stats.sent_last_15m as f64 / 900.0),
    ];
    if json {
        let object = |pairs: Vec<(String, serde_json::Value)>| {
            serde_json::Value::Object(pairs.into_iter().collect())
        };
        let value = serde_json::json!({
            "backend": store.backend().to_string(),
            "counts": object(stats.counts.iter().map(|c| (c.status.clone(), c.count.into())).collect()),
            "oldest_due_age_seconds": stats.oldest_due_age_seconds,
            "stale_locks": stats.stale_locks,
            "sent_per_second": object(rates.iter().map(|(k, v)| (k.to_string(), (*v).into())).collect()),
            "failures_last_hour": object(by_kind.iter().map(|(k, n)| (k.clone(), (*n).into())).collect()),
            "recent_failures": stats.recent_failures,
        });
        println!("{value}");
        return Ok(());
    }
    println!("tablemail queue ({})", store.backend());
    for s in [
        "queued",
        "sending",
        "sent",
        "failed",
        "unknown",
        "cancelled",
    ] {
        let note = match s {
            "queued" => match stats.oldest_due_age_seconds {
                Some(age) => format!(
                    "oldest due for {}",
                    humantime::format_duration(Duration::from_secs(age.max(0.0) as u64))
                ),
                None => "nothing due".into(),
            },
            "sending" => format!("{} stale locks", stats.stale_locks),
            _ => String::new(),
        };
        println!("  {s:<10} {:>10}  {note}", stats.count(s));
    }
    println!(
        "sent per second: {:.1} over the last minute, {:.1} over 5 minutes, {:.1} over 15 minutes",
        rates[0].1, rates[1].1, rates[2].1
    );
    if by_kind.is_empty() {
        println!("no failures in the last hour");
    } else {
        println!("failures in the last hour, by reply:");
        for (kind, n) in &by_kind {
            println!("  {kind:<24} {n:>8}");
        }
    }
    if !stats.recent_failures.is_empty() {
        println!("recent failures:");
        for f in &stats.recent_failures {
            let when = f
                .processed_at
                .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
                .unwrap_or_default();
            println!(
                "  #{:<8} {:<8} {when}  {}",
                f.id,
                f.status,
                f.last_error.as_deref().unwrap_or("")
            );
        }
    }
    Ok(())
}

async fn retry_failed(settings: &Settings, args: RetryArgs) -> Result<()> {
    let which = match args.id {
        Some(id) => RetrySelection::Id(id),
        None => RetrySelection::AllFailed,
    };
    let store = connect(settings).await?;
    let n = store.retry(which, 5).await?;
    println!("{n} mails queued again");
    if n == 0 {
        if let RetrySelection::Id(id) = which {
            return Err(CommandError::Runtime(format!(
                "mail {id} is not failed or unknown"
            )));
        }
    }
    Ok(())
}

async fn cancel(settings: &Settings, id: i64) -> Result<()> {
    let store = connect(settings).await?;
    if store.cancel(id).await? == 0 {
        return Err(CommandError::Runtime(format!("mail {id} is not queued")));
    }
    println!("mail {id} cancelled");
    Ok(())
}

async fn purge(settings: &Settings) -> Result<()> {
    let store = connect(settings).await?;
    let mut total = 0;
    loop {
        let n = store
            .purge(settings.retention.sent, settings.retention.failed, 1000)
            .await?;
        total += n;
        if n < 1000 {
            break;
        }
    }
    println!("{total} finished mails deleted");
    Ok(())
}

async fn check(settings: &Settings) -> Result<()> {
    let mut problems = Vec::new();
    let transport = build_transport(settings)?;
    println!("configuration: ok");
    let store = connect(settings).await?;
    match store.ping().await {
        Ok(()) => match store.stats(settings.worker.lock_timeout).await {
            Ok(stats) => {
                let total: i64 = stats.counts.iter().map(|c| c.count).sum();
                println!(
                    "database: {} reachable, mail_queue holds {total} rows",
                    store.backend()
                );
            }
            Err(e) => {
                println!(
                    "database: {} reachable, but mail_queue is not usable: {e}",
                    store.backend()
                );
                problems.push("mail_queue (run `tablemail migrate`)");
            }
        },
        Err(e) => {
            println!("database: unreachable: {e}");
            problems.push("database");
        }
    }
    match transport.probe().await {
        Ok(info) => println!("transport: {} ok: {info}", settings.transport.url),
        Err(e) => {
            println!("transport: {} unavailable: {e}", settings.transport.url);
            problems.push("transport");
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(CommandError::Runtime(format!(
            "check failed: {}",
            problems.join(", ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::failure_kind;

    #[test]
    fn failures_are_counted_by_reply_code_or_kind() {
        assert_eq!(
            failure_kind("RCPT TO: 550 5.1.1 <***@x.org>: unknown"),
            "550"
        );
        assert_eq!(failure_kind("end of data: 554 5.7.1 spam"), "554");
        assert_eq!(failure_kind("MAIL FROM: 451 4.3.0 try later"), "451");
        assert_eq!(failure_kind("expired"), "expired");
        assert_eq!(
            failure_kind("no reply after end of data: timed out after 10m"),
            "no reply after \".\""
        );
        assert_eq!(
            failure_kind("lock expired: the worker stopped during the last attempt"),
            "worker lost"
        );
        assert_eq!(
            failure_kind("DATA: connection lost before end of data: reset"),
            "connection lost"
        );
        assert_eq!(
            failure_kind("invalid address in to_address: …"),
            "invalid mail"
        );
        assert_eq!(failure_kind("CR or LF in subject"), "invalid mail");
    }
}
