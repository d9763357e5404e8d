//! `tablemail status`: counts by status, the oldest due mail's age, stale
//! locks, the sending rate, the daemons draining the queue, and what failed
//! or was deferred in the last hour, grouped by stage and reply (from the
//! mails' history).

use std::time::Duration;

use crate::{
    cli::ShowArgs,
    config::Settings,
    smtp::{failure_label, Role, Transport},
    store::{MailLookup, MailRecord, STATUSES},
    telemetry::redact_addresses,
};

use super::{build_routes, connect, CommandError, Result};

/// What a probe of each configured relay finds now (at most 5 s each):
/// `(role, reachable, what it said or why not)`.
async fn relays(transport: &Transport) -> Vec<(Role, bool, String)> {
    let mut roles = vec![Role::Primary];
    if transport.has_fallback() {
        roles.push(Role::Fallback);
    }
    // A relay that takes OAuth2 tokens is probed as the daemon logs in:
    // with a token, fetched now as `check` does (the daemon's own is not
    // at hand); a token that cannot be had shows in the probe's answer.
    for tokens in transport.oauth2() {
        let _ = tokio::time::timeout(Duration::from_secs(5), tokens.fetch()).await;
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
    // Attempts that failed for good or went unknown, and those that were
    // put off (a retry, a deferral, a refused relay): a row deferred 37 times
    // for a 421 counts 37 here.
    let (mut failures, mut waiting) = (Tally::default(), Tally::default());
    for group in store.failure_groups(Duration::from_secs(3600)).await? {
        let tally = if group.ended_the_mail() {
            &mut failures
        } else {
            &mut waiting
        };
        tally.add(
            failure_label(group.stage.as_deref(), group.smtp_code),
            group.count,
        );
    }
    let daemons = store.daemons().await?;
    let routes = build_routes(settings)?;
    let mut relays = Vec::new();
    for route in &routes {
        let label = route.name.clone().unwrap_or_else(|| "default".into());
        for (role, reachable, detail) in self::relays(&route.transport).await {
            relays.push((label.clone(), role, reachable, detail));
        }
    }
    let unknown_routes = super::unknown_routes(settings, &store).await?;
    let caps = crate::limits::Caps::new(&settings.limits);
    let cap_uses = store.cap_uses(&caps.requests()).await?;
    let transport = &routes[0].transport;
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
            "attachment_bytes_sent_15m": stats.attachment_bytes_last_15m,
            "failures_last_hour": failures.json(),
            "retrying_last_hour": waiting.json(),
            "recent_failures": stats.recent_failures,
            "relays": relays.iter().map(|(route, role, reachable, detail)| serde_json::json!({
                "route": route, "relay": role.as_str(), "reachable": reachable, "detail": detail,
            })).collect::<Vec<_>>(),
            "unknown_routes": unknown_routes,
            "limits": cap_uses.iter().zip(caps.iter()).map(|(u, cap)| serde_json::json!({
                "name": u.name, "used": u.used, "max": u.max, "per_seconds": cap.per.as_secs(),
            })).collect::<Vec<_>>(),
            "redirect_to": redirect,
            "daemons": daemons,
        });
        println!("{value}");
        return Ok(());
    }
    println!("tablemail queue ({})", store.backend());
    for s in STATUSES {
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
    for (route, role, reachable, detail) in &relays {
        let state = if *reachable {
            "reachable"
        } else {
            "UNAVAILABLE"
        };
        if routes.len() == 1 {
            println!("relay ({}): {state}: {detail}", role.as_str());
        } else {
            println!(
                "relay (route {route}, {}): {state}: {detail}",
                role.as_str()
            );
        }
    }
    if !unknown_routes.is_empty() {
        println!(
            "routes queued rows name but no configuration has (they wait): {}",
            unknown_routes.join(", ")
        );
    }
    for (u, cap) in cap_uses.iter().zip(caps.iter()) {
        let state = if u.used >= u.max {
            "  REACHED: mails it counts wait"
        } else {
            ""
        };
        println!(
            "send cap {}: {} of {} used (per {}){state}",
            u.name,
            u.used,
            u.max,
            humantime::format_duration(cap.per)
        );
    }
    if let Some(to) = &redirect {
        println!("staging redirect: every mail goes to {to}");
    }
    if daemons.is_empty() {
        println!("daemons: none running");
    } else {
        println!("daemons:");
        for d in &daemons {
            println!(
                "  {:<24} pid {:<8} {:<8} started {}  {} in flight, {} sent{}",
                d.host,
                d.pid,
                d.version,
                d.started_at
                    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                d.in_flight,
                d.sent,
                if d.silent {
                    format!(
                        "  SILENT since {}",
                        d.last_seen
                            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                    )
                } else {
                    String::new()
                }
            );
        }
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
    fn add(&mut self, kind: String, count: i64) {
        match self.0.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += count,
            None => self.0.push((kind, count)),
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

/// `tablemail show`: one mail, its attachments and its history; addresses
/// reduced to their domains and no body unless `--body`.
pub(super) async fn show(settings: &Settings, args: ShowArgs) -> Result<()> {
    let lookup = match (args.which.id, args.which.message_id, args.which.dedupe_key) {
        (Some(id), _, _) => MailLookup::Id(id),
        (_, Some(message_id), _) => MailLookup::MessageId(message_id),
        (_, _, Some(key)) => MailLookup::DedupeKey(key),
        _ => {
            return Err(CommandError::Usage(
                "show needs an id, --message-id or --dedupe-key".into(),
            ))
        }
    };
    let store = connect(settings).await?;
    let Some(mut record) = store.find_mail(&lookup, args.body).await? else {
        return Err(CommandError::Runtime(match lookup {
            MailLookup::Id(id) => format!("no mail {id}"),
            MailLookup::MessageId(m) => format!("no mail with Message-ID {m}"),
            MailLookup::DedupeKey(k) => format!("no mail with dedupe_key {k:?}"),
        }));
    };
    if !args.body {
        redact_record(&mut record);
    }
    if let Some(name) = &record.template {
        let versions = store.template_versions().await?;
        let wanted = record.locale.as_deref().unwrap_or("");
        record.template_locale = crate::templates::locale_chain(wanted)
            .find(|l| versions.iter().any(|v| &v.name == name && v.locale == *l))
            .map(str::to_string);
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&record).expect("a record serializes")
        );
        return Ok(());
    }
    print_record(&record);
    Ok(())
}

/// What may be shown without asking: replies and errors with their
/// addresses reduced to domains.
fn redact_record(record: &mut MailRecord) {
    let redact = |text: &mut Option<String>| {
        if let Some(t) = text {
            *t = redact_addresses(t);
        }
    };
    redact(&mut record.last_error);
    redact(&mut record.relay_reply);
    for event in &mut record.events {
        redact(&mut event.detail);
        redact(&mut event.recipient);
    }
}

fn print_record(r: &MailRecord) {
    let time =
        |t: &chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let optional = |t: &Option<chrono::DateTime<chrono::Utc>>| {
        t.as_ref().map(time).unwrap_or_else(|| "-".into())
    };
    println!("mail {}: {}", r.id, r.status);
    println!("  subject            {}", r.subject);
    if let Some(name) = &r.template {
        let used = match &r.template_locale {
            Some(l) => format!("the template's {l:?}"),
            None => "no such template now".to_string(),
        };
        println!(
            "  template           {name}, locale {:?} ({used})",
            r.locale.as_deref().unwrap_or("")
        );
    }
    println!("  priority           {}", r.priority);
    println!(
        "  attempts           {} made, {} left",
        r.attempts, r.attempts_remaining
    );
    println!("  created_at         {}", time(&r.created_at));
    println!("  send_at            {}", time(&r.send_at));
    println!("  processed_at       {}", optional(&r.processed_at));
    if r.retried_at.is_some() {
        println!("  retried_at         {}", optional(&r.retried_at));
    }
    if r.bounced_at.is_some() {
        println!("  bounced_at         {}", optional(&r.bounced_at));
    }
    println!(
        "  message_id         {}",
        r.message_id.as_deref().unwrap_or("-")
    );
    println!(
        "  dedupe_key         {}",
        r.dedupe_key.as_deref().unwrap_or("-")
    );
    println!(
        "  relay_reply        {}",
        r.relay_reply.as_deref().unwrap_or("-")
    );
    println!(
        "  last_error         {}",
        r.last_error.as_deref().unwrap_or("-")
    );
    if let Some(c) = &r.content {
        println!(
            "  from               {} {}",
            c.from_name.as_deref().unwrap_or(""),
            c.from_address
                .as_deref()
                .unwrap_or("(defaults.from_address)")
        );
        println!("  to                 {}", c.to_address);
        for (name, value) in [
            ("cc", &c.cc),
            ("bcc", &c.bcc),
            ("reply_to", &c.reply_to),
            ("headers", &c.headers),
        ] {
            if let Some(v) = value {
                println!("  {name:<18} {v}");
            }
        }
    }
    if r.attachments.is_empty() {
        println!("attachments: none");
    } else {
        println!("attachments:");
        for a in &r.attachments {
            let inline = a
                .content_id
                .as_deref()
                .map(|c| format!("  inline cid:{c}"))
                .unwrap_or_default();
            println!(
                "  {}  {}  {} bytes{inline}",
                a.filename, a.content_type, a.size
            );
        }
    }
    if r.events.is_empty() {
        println!("history: none (sent at the first try, or not tried yet)");
    } else {
        println!("history:");
        for e in &r.events {
            let recipient = e
                .recipient
                .as_deref()
                .map(|r| format!("{r}: "))
                .unwrap_or_default();
            println!(
                "  {}  attempt {:<3} {:<10} {:<9} {:<4} {recipient}{}",
                time(&e.at),
                e.attempt,
                e.outcome,
                e.stage.as_deref().unwrap_or("-"),
                e.smtp_code
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "-".into()),
                e.detail.as_deref().unwrap_or("")
            );
        }
    }
    if let Some(c) = &r.content {
        if let Some(body) = &c.body {
            println!("body:\n{body}");
        }
        if let Some(html) = &c.body_html {
            println!("body_html:\n{html}");
        }
    }
}
