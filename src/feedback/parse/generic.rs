//! The fallback for bounces of servers no family recogniser knows: a
//! message that looks like a bounce (from MAILER-DAEMON, postmaster or a
//! "Mail Delivery" system, an `X-Failed-Recipients` field; or, on a message
//! that is no automatic reply, a null Return-Path or a subject such as
//! "Undeliverable", "Mail delivery failed", "failure notice", "Returned
//! mail") yields one item per address that stands next to an SMTP reply
//! code or an enhanced status code: on the same line or on one of the two
//! lines after it, before the returned copy of the message.

use std::collections::HashSet;

use super::bounce::{self, addresses_in, Block};
use super::classify::Action;
use super::text::{self, contains_any};
use super::{autoreply, Context};

/// The most lines scanned.
const MAX_LINES: usize = 100_000;
/// How many lines after an address its code may stand.
const REACH: usize = 2;

/// Local parts of the reporting system's own addresses, never recipients.
const SYSTEM_LOCAL_PARTS: &[&str] = &["mailer-daemon", "mailerdaemon", "mail-daemon", "postmaster"];

/// Fields that open a quoted header section, lower-case.
const QUOTED_HEADERS: &[&str] = &[
    "received:",
    "return-path:",
    "dkim-signature:",
    "message-id:",
];

/// Subjects of bounces, lower-case.
const SUBJECTS: &[&str] = &[
    "undeliverable",
    "undelivered",
    "undeliverd",
    "mail delivery failed",
    "delivery status notification",
    "delivery failure",
    "delivery failed",
    "delivery problem",
    "failure notice",
    "returned mail",
    "non-delivery",
    "nondelivery",
    "not delivered",
    "could not be delivered",
    "couldn't be delivered",
    "mail system error",
    "unzustellbar",
    "nicht zustellbar",
    "non remis",
    "no entregado",
];

/// Whether the message looks like a bounce, whoever sent it. The subject
/// and a null Return-Path count only on a message that is no automatic
/// reply: those echo the subject they answer ("Automatic reply:
/// Undeliverable parcel"), and RFC 3834 asks them to be sent with a null
/// sender.
pub(super) fn looks_like_bounce(ctx: &Context<'_>) -> bool {
    let null_return_path = ctx
        .root()
        .headers
        .get("return-path")
        .is_some_and(|v| v.chars().filter(|c| !c.is_whitespace()).eq("<>".chars()));
    from_delivery_system(ctx)
        || ((null_return_path || contains_any(&ctx.subject_lower, SUBJECTS))
            && !autoreply::is_auto_reply(ctx))
}

/// Whether the message comes from a mail system rather than a person: from
/// MAILER-DAEMON, postmaster or a "Mail Delivery" system, or with an
/// `X-Failed-Recipients` field.
pub(super) fn from_delivery_system(ctx: &Context<'_>) -> bool {
    let headers = &ctx.root().headers;
    let from = headers
        .get("from")
        .map(text::ascii_lower)
        .unwrap_or_default();
    contains_any(
        &from,
        &[
            "mailer-daemon",
            "mailerdaemon",
            "mail-daemon",
            "postmaster@",
            "mail delivery",
        ],
    ) || headers.has("x-failed-recipients")
}

/// One block per address with a code next to it.
pub(super) fn scan(ctx: &Context<'_>) -> Vec<Block> {
    let action = if ctx.delay_notice {
        Action::Delayed
    } else {
        Action::Failed
    };
    let mut skip: HashSet<String> = ctx.addressed_to().into_iter().collect();
    skip.extend(ctx.from.clone());
    // Up to the returned copy, or to the first line that starts a quoted
    // header section when no sentence announces the copy.
    let lines: Vec<&str> = bounce::head(ctx)
        .lines()
        .take_while(|l| {
            let l = text::prefix(l, 16).to_ascii_lowercase();
            !QUOTED_HEADERS.iter().any(|h| l.starts_with(h))
        })
        .take(MAX_LINES)
        .collect();
    // Each line is searched for a code once.
    let coded: Vec<bool> = lines
        .iter()
        .map(|l| text::enhanced_status(l, b"45").is_some() || text::reply_code(l, b"45").is_some())
        .collect();
    let mut blocks = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        for addr in addresses_in(line).take(4) {
            let system = addr
                .split('@')
                .next()
                .is_some_and(|local| SYSTEM_LOCAL_PARTS.contains(&local));
            if system || skip.contains(&addr) {
                continue;
            }
            let end = (i + REACH + 1).min(lines.len());
            let near = coded.get(i..end).and_then(|c| c.iter().position(|c| *c));
            if let Some(last) = near {
                let mut block = Block::new(Some(addr.clone()), action);
                for l in lines.get(i..=i + last).unwrap_or_default() {
                    block.add(l);
                }
                skip.insert(addr);
                blocks.push(block);
                if blocks.len() >= super::MAX_ITEMS {
                    return blocks;
                }
            }
        }
    }
    blocks
}
