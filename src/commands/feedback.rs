//! The delivery loop's commands (DESIGN §12): `ingest`, one report from
//! stdin, and `suppress`, the suppression list by hand.

use std::{io::Read, sync::Arc};

use chrono::{DateTime, Utc};

use crate::{
    cli::{IngestArgs, SuppressCommand},
    config::Settings,
    feedback::record::{Recorder, Verdict},
    mail,
    store::{
        FeedbackSource, NewSuppression, Store, StoreError, SuppressionEntry, SuppressionFilter,
        SuppressionReason,
    },
};

use super::{connect, CommandError, Result};

/// The recorder the daemon's listener and `ingest` share.
pub fn recorder(
    settings: &Settings,
    store: Arc<dyn Store>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
) -> Result<Recorder> {
    let verp = settings
        .bounce
        .verp()
        .map_err(|e| CommandError::Usage(e.to_string()))?
        .map(Arc::new);
    Ok(Recorder {
        store,
        verp,
        policy: settings.suppression.policy(),
        keep_raw: settings.inbound.keep_raw,
        metrics,
    })
}

/// A database that is away is a temporary failure for the mail system
/// that runs `ingest` (exit 75): it delivers the report again later, and a
/// bounce never bounces.
fn temporary(e: StoreError) -> CommandError {
    CommandError::TempFail(e.to_string())
}

pub(super) async fn ingest(settings: &Settings, args: IngestArgs) -> Result<()> {
    let limit = settings.inbound.max_message_size.0 as usize;
    let (raw, size) = read_bounded(std::io::stdin().lock(), limit)
        .map_err(|e| CommandError::TempFail(format!("reading the report: {e}")))?;
    let store = connect(settings).await.map_err(|e| match e {
        CommandError::Usage(u) => CommandError::Usage(u),
        other => CommandError::TempFail(other.to_string()),
    })?;
    let recorder = recorder(settings, store, None)?;
    if args.dry_run {
        let verdict = recorder.judge(&raw, &args.rcpt).await.map_err(temporary)?;
        print_verdict(&verdict, args.json);
        return Ok(());
    }
    if size > raw.len() {
        tracing::warn!(
            size,
            kept = raw.len(),
            "report larger than inbound.max_message_size: its beginning is read"
        );
    }
    recorder
        .record(&raw, &args.rcpt, FeedbackSource::Ingest)
        .await
        .map_err(temporary)?;
    Ok(())
}

/// Reads at most `limit` octets and counts the rest without keeping it:
/// the report part of a bounce comes first, the returned mail after it.
fn read_bounded(mut input: impl Read, limit: usize) -> std::io::Result<(Vec<u8>, usize)> {
    let mut kept = Vec::new();
    (&mut input).take(limit as u64).read_to_end(&mut kept)?;
    let rest = std::io::copy(&mut input, &mut std::io::sink())? as usize;
    let size = kept.len() + rest;
    Ok((kept, size))
}

fn print_verdict(verdict: &Verdict, json: bool) {
    if json {
        let items: Vec<serde_json::Value> = verdict
            .items
            .iter()
            .map(|i| {
                serde_json::json!({
                    "recipient": i.recipient,
                    "kind": i.kind.as_str(),
                    "status": i.status,
                    "diagnostic": i.diagnostic,
                    "mail_id": if i.matched { i.mail_id } else { None },
                    "matched": i.matched,
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(items));
        return;
    }
    match verdict.mail {
        Some((id, proof)) => println!("mail {id} (found by {})", proof.as_str()),
        None => println!("no mail found: recorded as unmatched, acting on nothing"),
    }
    for i in &verdict.items {
        println!(
            "  {:<12} {:<8} {:<40} {}{}",
            i.kind.as_str(),
            i.status.as_deref().unwrap_or("-"),
            i.recipient.as_deref().unwrap_or("-"),
            if i.matched { "" } else { "(unmatched) " },
            i.diagnostic.as_deref().unwrap_or("")
        );
    }
}

pub(super) async fn suppress(settings: &Settings, command: SuppressCommand) -> Result<()> {
    let store = connect(settings).await?;
    match command {
        SuppressCommand::List {
            reason,
            search,
            all,
            json,
        } => {
            let filter = SuppressionFilter {
                reason: reason.as_deref().map(parse_reason).transpose()?,
                search,
                include_expired: all,
            };
            each_entry(&store, &filter, |e| {
                if json {
                    println!("{}", entry_json(e));
                } else {
                    println!(
                        "{:<40} {:<12} {:<24} {}",
                        e.address,
                        e.reason,
                        e.created_at.format("%Y-%m-%dT%H:%M:%SZ"),
                        e.expires_at
                            .map(|t| format!("until {}", t.format("%Y-%m-%dT%H:%M:%SZ")))
                            .unwrap_or_default()
                    );
                }
            })
            .await
        }
        SuppressCommand::Add {
            addresses,
            reason,
            expires,
            detail,
        } => {
            let reason = parse_reason(&reason)?;
            let expires_in = expires
                .as_deref()
                .map(|e| match humantime::parse_duration(e) {
                    Ok(d) if !d.is_zero() => Ok(d),
                    Ok(_) => Err(CommandError::Usage(format!(
                        "--expires {e}: must be above zero (without it: until removed)"
                    ))),
                    Err(err) => Err(CommandError::Usage(format!("--expires {e}: {err}"))),
                })
                .transpose()?;
            let entries = addresses
                .iter()
                .map(|a| {
                    Ok(NewSuppression {
                        address: key(a)?,
                        reason,
                        detail: detail.clone(),
                        expires_in,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let n = store.suppress(&entries).await?;
            println!("{n} addresses suppressed");
            Ok(())
        }
        SuppressCommand::Remove { addresses } => {
            let keys = addresses
                .iter()
                .map(|a| key(a))
                .collect::<Result<Vec<_>>>()?;
            let n = store.unsuppress(&keys).await?;
            println!("{n} addresses removed");
            Ok(())
        }
        SuppressCommand::Import { file } => {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| CommandError::Usage(format!("{}: {e}", file.display())))?;
            let entries = parse_csv(&text, Utc::now())
                .map_err(|e| CommandError::Usage(format!("{}: {e}", file.display())))?;
            let mut n = 0;
            for chunk in entries.chunks(1000) {
                n += store.suppress(chunk).await?;
            }
            println!("{n} addresses imported");
            Ok(())
        }
        SuppressCommand::Export => {
            println!("address,reason,created_at,expires_at");
            let filter = SuppressionFilter::default();
            each_entry(&store, &filter, |e| {
                println!(
                    "{},{},{},{}",
                    csv_field(&e.address),
                    e.reason,
                    e.created_at.to_rfc3339(),
                    e.expires_at.map(|t| t.to_rfc3339()).unwrap_or_default()
                );
            })
            .await
        }
    }
}

/// Calls `f` for every entry `filter` selects, a page at a time.
async fn each_entry(
    store: &Arc<dyn Store>,
    filter: &SuppressionFilter,
    mut f: impl FnMut(&SuppressionEntry),
) -> Result<()> {
    const PAGE: usize = 1000;
    let mut after: Option<String> = None;
    loop {
        let page = store
            .suppression_list(filter, after.as_deref(), PAGE)
            .await?;
        page.iter().for_each(&mut f);
        if page.len() < PAGE {
            return Ok(());
        }
        after = page.last().map(|e| e.address.clone());
    }
}

fn entry_json(e: &SuppressionEntry) -> serde_json::Value {
    serde_json::json!({
        "address": e.address,
        "reason": e.reason,
        "detail": e.detail,
        "mail_id": e.mail_id,
        "created_at": e.created_at.to_rfc3339(),
        "expires_at": e.expires_at.map(|t| t.to_rfc3339()),
    })
}

fn parse_reason(text: &str) -> Result<SuppressionReason> {
    SuppressionReason::parse(text).ok_or_else(|| {
        CommandError::Usage(format!(
            "reason `{text}`: one of hard_bounce, soft_bounce, complaint, manual"
        ))
    })
}

fn key(address: &str) -> Result<String> {
    mail::address_key(address).map_err(|e| CommandError::Usage(format!("{address}: {e}")))
}

/// A CSV field, quoted when it must be.
fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

/// The entries of an exported list (a header line is optional):
/// `address,reason,created_at,expires_at`, the last two optional; an entry
/// whose `expires_at` has passed is left out.
fn parse_csv(text: &str, now: DateTime<Utc>) -> Result<Vec<NewSuppression>, String> {
    let mut entries = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let fields = csv_fields(line).map_err(|e| format!("line {}: {e}", n + 1))?;
        let field = |i: usize| fields.get(i).map(|f| f.trim()).filter(|f| !f.is_empty());
        let Some(address) = field(0) else { continue };
        if n == 0 && address.eq_ignore_ascii_case("address") {
            continue;
        }
        let address = mail::address_key(address).map_err(|e| format!("line {}: {e}", n + 1))?;
        let reason = match field(1) {
            Some(r) => SuppressionReason::parse(r)
                .ok_or_else(|| format!("line {}: reason `{r}`", n + 1))?,
            None => SuppressionReason::Manual,
        };
        let expires_in = match field(3) {
            Some(t) => {
                let at = DateTime::parse_from_rfc3339(t)
                    .map_err(|e| format!("line {}: expires_at `{t}`: {e}", n + 1))?
                    .with_timezone(&Utc);
                match (at - now).to_std() {
                    Ok(left) if !left.is_zero() => Some(left),
                    _ => continue,
                }
            }
            None => None,
        };
        entries.push(NewSuppression {
            address,
            reason,
            detail: Some("imported".into()),
            expires_in,
        });
    }
    Ok(entries)
}

/// The fields of one CSV line (RFC 4180 quoting).
fn csv_fields(line: &str) -> Result<Vec<String>, &'static str> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        let field = fields.last_mut().expect("one field at least");
        match (c, quoted) {
            ('"', false) if field.is_empty() => quoted = true,
            ('"', true) if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            ('"', true) => quoted = false,
            (',', false) => fields.push(String::new()),
            (c, _) => field.push(c),
        }
    }
    if quoted {
        return Err("an unclosed quote");
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn export_and_import_round_trip() {
        let now = Utc::now();
        let text = format!(
            "address,reason,created_at,expires_at\n\
             ann@example.org,hard_bounce,2026-01-01T00:00:00Z,\n\
             \"bob@example.net\",complaint,,\n\
             carl@example.com,soft_bounce,,{}\n\
             old@example.com,soft_bounce,,2000-01-01T00:00:00Z\n\
             Dora@Bücher.example\n",
            (now + chrono::Duration::days(3)).to_rfc3339()
        );
        let entries = parse_csv(&text, now).unwrap();
        let addresses: Vec<&str> = entries.iter().map(|e| e.address.as_str()).collect();
        assert_eq!(
            addresses,
            [
                "ann@example.org",
                "bob@example.net",
                "carl@example.com",
                "dora@xn--bcher-kva.example"
            ]
        );
        assert_eq!(entries[0].reason, SuppressionReason::HardBounce);
        assert_eq!(entries[3].reason, SuppressionReason::Manual);
        let left = entries[2].expires_in.unwrap();
        assert!(left > Duration::from_secs(2 * 86400) && left <= Duration::from_secs(3 * 86400));
        assert!(entries[0].expires_in.is_none());
        assert!(parse_csv("a@b.example,nonsense\n", now).is_err());
        assert!(parse_csv("\"a@b.example\n", now).is_err());
    }

    #[test]
    fn fields_with_commas_and_quotes_are_quoted() {
        assert_eq!(csv_field("a@b.example"), "a@b.example");
        assert_eq!(csv_field("\"a,b\"@c.example"), "\"\"\"a,b\"\"@c.example\"");
        assert_eq!(
            csv_fields(&csv_field("\"a,b\"@c.example")).unwrap(),
            ["\"a,b\"@c.example"]
        );
    }

    #[test]
    fn an_oversized_report_keeps_its_beginning() {
        let input = vec![b'x'; 1000];
        let (kept, size) = read_bounded(&input[..], 100).unwrap();
        assert_eq!((kept.len(), size), (100, 1000));
    }
}
