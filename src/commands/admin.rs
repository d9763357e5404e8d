//! The operator's other commands: `migrate`, `retry`, `cancel`, `purge` and
//! `check`.

use crate::{
    cli::RetryArgs,
    config::Settings,
    smtp::Role,
    store::{RetrySelection, RETRY_ATTEMPTS},
    telemetry::redact_addresses,
};

use super::{build_routes, build_transport, connect, message_defaults, CommandError, Result};

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
    let n = store.retry(which, RETRY_ATTEMPTS).await?;
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
    let mut reports = 0;
    loop {
        let n = store
            .purge_feedback(settings.retention.failed, 1000)
            .await?;
        reports += n;
        if n < 1000 {
            break;
        }
    }
    println!("{reports} delivery reports and expired suppressions deleted");
    Ok(())
}

/// What `check` says of the delivery loop (DESIGN §12): the VERP sender,
/// its SPF alignment with the default sender, the inbound listener. A
/// misalignment is a warning: mail still goes, but receivers that check
/// DMARC see an SPF domain that is not the From domain's.
fn delivery_loop(settings: &Settings, defaults: &crate::mail::MessageDefaults) {
    let Some(verp) = &defaults.bounce else {
        println!("bounce.domain: not set: bounces go to the sender's own address");
        return;
    };
    println!(
        "bounce.domain: every mail's envelope sender is b-<id>-<tag>@{}",
        verp.domain()
    );
    if let Some(from) = &defaults.from_address {
        if !crate::config::aligned(verp.domain(), from.domain()) {
            println!(
                "warning: bounce.domain {} is not under the organisational domain of                  defaults.from_address's domain {}: SPF will not align for DMARC",
                verp.domain(),
                from.domain()
            );
        }
    }
    match &settings.inbound.listen {
        Some(listen) => println!(
            "inbound.listen: {listen} takes reports for {} (STARTTLS {})",
            verp.domain(),
            if settings.inbound.tls_cert_file.is_some() {
                "offered"
            } else {
                "not offered"
            }
        ),
        None => println!(
            "inbound.listen: not set: deliver reports with `tablemail ingest` (a pipe transport)"
        ),
    }
}

/// One line per provider whose webhook is configured (DESIGN §14); the
/// keys were read and checked with the configuration.
fn webhooks(settings: &Settings) {
    let hooks = &settings.webhooks;
    let Some(listen) = &hooks.listen else {
        println!("webhooks.listen: not set: no provider webhooks");
        return;
    };
    let providers = hooks.providers();
    println!(
        "webhooks.listen: {listen} ({} configured)",
        if providers.is_empty() {
            "no provider".to_string()
        } else {
            providers.join(", ")
        }
    );
    for provider in providers {
        let how = match provider {
            "ses" => format!(
                "SNS topics {} (signatures verified against Amazon's certificates)",
                hooks.ses.topic_arns.join(", ")
            ),
            "postmark" => "HTTP basic credentials (webhooks.postmark.credentials_file)".into(),
            "mailgun" => "HMAC signing key (webhooks.mailgun.signing_key_file)".into(),
            _ => "ECDSA public key (webhooks.sendgrid.public_key_file)".into(),
        };
        println!("webhook {provider}: POST /webhooks/{provider}, {how}");
    }
}

pub(super) async fn check(settings: &Settings) -> Result<()> {
    let mut problems: Vec<String> = Vec::new();
    let transport = build_transport(settings)?;
    let defaults = message_defaults(settings)?;
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
                problems.push("mail_queue (run `tablemail migrate`)".to_string());
            }
        },
        Err(e) => {
            println!("database: unreachable: {e}");
            problems.push("database".to_string());
        }
    }
    let routes = build_routes(settings)?;
    for route in &routes {
        // `transport.url` for the default route; the route's name otherwise.
        let (name, url_key, fallback_key) = match &route.name {
            None => (
                "transport".to_string(),
                "transport.url".to_string(),
                "transport.fallback_url".to_string(),
            ),
            Some(name) => (
                format!("route {name}"),
                format!("route {name}"),
                format!("route {name} (fallback)"),
            ),
        };
        for tokens in route.transport.oauth2() {
            match tokens.fetch().await {
                Ok(lifetime) => println!(
                    "{name}: oauth2: {} token obtained for {}, valid for {}s",
                    tokens.provider(),
                    redact_addresses(tokens.user()),
                    lifetime.as_secs()
                ),
                Err(e) => {
                    println!("{name}: oauth2: no token: {e}");
                    problems.push(format!("{name}.oauth2 (token)"));
                }
            }
        }
        let mut relays = vec![(Role::Primary, url_key)];
        if route.transport.has_fallback() {
            relays.push((Role::Fallback, fallback_key));
        }
        let mut reachable = false;
        for (role, key) in relays {
            match route.transport.probe(role).await {
                Ok(info) => {
                    reachable = true;
                    println!("relay ({key}): ok: {info}");
                }
                Err(e) => println!(
                    "relay ({key}): unavailable: {}",
                    redact_addresses(&e.to_string())
                ),
            }
        }
        if !reachable {
            problems.push(match &route.name {
                None => "relay".to_string(),
                Some(n) => format!("route {n}"),
            });
        }
    }
    match super::unknown_routes(settings, &store).await {
        Ok(unknown) if !unknown.is_empty() => {
            println!(
                "routes: queued rows name routes no configuration has, and wait: {}",
                unknown.join(", ")
            );
            problems.push("routes".to_string());
        }
        _ => {}
    }
    let plaintext = settings.transport.plaintext_auth_refused();
    for key in &plaintext {
        println!(
            "transport.allow_plaintext_auth: false, and {key} has a username but no TLS: \
             AUTH is refused rather than sending the password in clear \
             (use ?tls=required or smtps://, or set transport.allow_plaintext_auth = true)"
        );
    }
    if !plaintext.is_empty() {
        problems.push("transport.allow_plaintext_auth".to_string());
    }
    if transport.outbox().is_none() && settings.defaults.from_address.is_none() {
        println!("defaults.from_address: not set: rows without a sender wait until it is");
        problems.push("defaults.from_address".to_string());
    }
    for signer in defaults.dkim.iter().flat_map(|s| s.iter()) {
        println!(
            "dkim: signs mail from {} and its subdomains, {}",
            signer.domain(),
            signer.describe()
        );
    }
    if let Some(to) = transport.redirected_to() {
        println!(
            "transport.redirect_to: every mail goes to {} (staging)",
            redact_addresses(to.as_ref())
        );
    }
    delivery_loop(settings, &defaults);
    webhooks(settings);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(CommandError::Runtime(format!(
            "check failed: {}",
            problems.join(", ")
        )))
    }
}
