//! The operator's other commands: `migrate`, `retry`, `cancel`, `purge` and
//! `check`.

use crate::{cli::RetryArgs, config::Settings, store::RetrySelection};

use super::{build_transport, connect, CommandError, Result};

pub(super) async fn migrate(settings: &Settings) -> Result<()> {
    let store = connect(settings).await?;
    store.migrate().await?;
    println!("migrations applied ({})", store.backend());
    Ok(())
}

pub(super) async fn retry(settings: &Settings, args: RetryArgs) -> Result<()> {
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

pub(super) async fn cancel(settings: &Settings, id: i64) -> Result<()> {
    let store = connect(settings).await?;
    if store.cancel(id).await? == 0 {
        return Err(CommandError::Runtime(format!("mail {id} is not queued")));
    }
    println!("mail {id} cancelled");
    Ok(())
}

pub(super) async fn purge(settings: &Settings) -> Result<()> {
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

pub(super) async fn check(settings: &Settings) -> Result<()> {
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
