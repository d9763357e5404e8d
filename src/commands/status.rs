//! `tablemail status`: counts by status, the oldest due mail's age, stale
//! locks, the sending rate, and what failed or was deferred in the last hour,
//! grouped by stage and reply.

use std::time::Duration;

use crate::{
    config::Settings,
    smtp::{Role, Transport},
    telemetry::redact_addresses,
    worker::outcome::failure_kind,
};

use super::{build_transport, connect, Result};

/// What a probe of each configured relay finds now (at most 5 s each):
/// `(role, reachable, what it said or why not)`.
async fn relays(transport: &Transport) -> Vec<(Role, bool, String)> {
    let mut roles = vec![Role::Primary];
    if transport.has_fallback() {
        roles.push(Role::Fallback);
    }
    let mut found = Vec::new();
    for role in roles {
        let probe = tokio::time::timeout(Duration::from_secs(5), transport.probe(role)).await;
        found.push(match probe {
            Ok(Ok(info)) => (role, true, info),
            Ok(Err(e)) => (role, false, redact_addresses(&e.to_string())),
            Err(_) => (role, false, "no answer within 5s".into()),
        });
    }
    found
}

pub(super) async fn status(settings: &Settings, json: bool) -> Result<()> {
    let store = connect(settings).await?;
    let mut stats = store.stats(settings.worker.lock_timeout).await?;
    for f in &mut stats.recent_failures {
        f.last_error = f.last_error.as_deref().map(redact_addresses);
    }
    // Failed or unknown for good, and queued again with an error (waiting
    // for a retry, or deferred): a row deferred 37 times for a 421 shows here.
    let (mut failures, mut waiting) = (Tally::default(), Tally::default());
    for reason in store
        .failure_reasons(Duration::from_secs(3600), 10_000)
        .await?
    {
        let tally = if reason.status == "queued" {
            &mut waiting
        } else {
            &mut failures
        };
        tally.add(failure_kind(&reason.last_error));
    }
    let transport = build_transport(settings)?;
    let relays = relays(&transport).await;
    let redirect = transport
        .redirected_to()
        .map(|to| redact_addresses(to.as_ref()));
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
            "failures_last_hour": failures.json(),
            "retrying_last_hour": waiting.json(),
            "recent_failures": stats.recent_failures,
            "relays": relays.iter().map(|(role, reachable, detail)| serde_json::json!({
                "relay": role.as_str(), "reachable": reachable, "detail": detail,
            })).collect::<Vec<_>>(),
            "redirect_to": redirect,
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
    for (role, reachable, detail) in &relays {
        let state = if *reachable {
            "reachable"
        } else {
            "UNAVAILABLE"
        };
        println!("relay ({}): {state}: {detail}", role.as_str());
    }
    if let Some(to) = &redirect {
        println!("staging redirect: every mail goes to {to}");
    }
    failures.print("failures in the last hour", "no failures in the last hour");
    waiting.print(
        "queued again with an error in the last hour (retry or deferral), by reply",
        "nothing deferred or waiting to retry in the last hour",
    );
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

/// Counts by kind, most frequent first.
#[derive(Default)]
struct Tally(Vec<(String, i64)>);

impl Tally {
    fn add(&mut self, kind: String) {
        match self.0.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => self.0.push((kind, 1)),
        }
        self.0
            .sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    }

    fn json(&self) -> serde_json::Value {
        serde_json::Value::Object(
            self.0
                .iter()
                .map(|(k, n)| (k.clone(), (*n).into()))
                .collect(),
        )
    }

    fn print(&self, heading: &str, empty: &str) {
        if self.0.is_empty() {
            println!("{empty}");
            return;
        }
        println!("{heading}:");
        for (kind, n) in &self.0 {
            println!("  {kind:<24} {n:>8}");
        }
    }
}
