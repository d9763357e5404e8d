//! Gmail's bounce text, for when it comes without its DSN part:
//! - current: "** Address not found **" (or "** Message not delivered **",
//!   "** Message blocked **") then "Your message wasn't delivered to
//!   address because ..." and "The response was:" (or "The response from
//!   the remote server was:") with the reason in the next paragraph;
//! - older: "Delivery to the following recipient failed permanently:" (or
//!   "has been delayed:") then the addresses, indented, one per line, and
//!   the reason after "Technical details of permanent (temporary) failure:".
//! - "There was a temporary problem delivering your message to address."

use super::bounce::{self, Block};
use super::classify::Action;
use super::text::{self, contains_any};
use super::Context;

pub(super) fn detect(ctx: &Context<'_>) -> bool {
    contains_any(
        &ctx.text_lower,
        &[
            "** address not found **",
            "** message not delivered **",
            "** message blocked **",
            "your message wasn't delivered to ",
            "delivery to the following recipient failed permanently",
            "delivery to the following recipients failed permanently",
            "delivery to the following recipient has been delayed",
            "delivery to the following recipients has been delayed",
            "there was a temporary problem delivering your message to ",
        ],
    )
}

pub(super) fn read(ctx: &Context<'_>) -> Vec<Block> {
    let head = bounce::head(ctx);
    let lower = text::ascii_lower(head);
    let reason = response(head, &lower);
    let mut blocks = Vec::new();

    let sentences: &[(&str, Action)] = &[
        ("your message wasn't delivered to ", Action::Failed),
        (
            "there was a temporary problem delivering your message to ",
            Action::Delayed,
        ),
    ];
    for (sentence, action) in sentences {
        if let Some(at) = text::find(&lower, sentence) {
            let rest = head.get(at + sentence.len()..).unwrap_or_default();
            let word = rest.split_whitespace().next().unwrap_or_default();
            let mut block = Block::new(text::addr_spec(word), *action);
            block.add(&reason);
            blocks.push(block);
        }
    }

    let lists: &[(&str, Action)] = &[
        (
            "delivery to the following recipient failed permanently:",
            Action::Failed,
        ),
        (
            "delivery to the following recipients failed permanently:",
            Action::Failed,
        ),
        (
            "delivery to the following recipient has been delayed:",
            Action::Delayed,
        ),
        (
            "delivery to the following recipients has been delayed:",
            Action::Delayed,
        ),
    ];
    for (marker, action) in lists {
        let Some(at) = text::find(&lower, marker) else {
            continue;
        };
        let mut started = false;
        for line in bounce::lines_after(head, at) {
            let trimmed = line.trim();
            if trimmed.is_empty() {
                if started {
                    break;
                }
                continue;
            }
            started = true;
            if let Some(addr) = text::addr_spec(trimmed) {
                let mut block = Block::new(Some(addr), *action);
                block.add(&reason);
                blocks.push(block);
            }
            if blocks.len() >= super::MAX_ITEMS {
                break;
            }
        }
    }
    blocks
}

/// The paragraph after "The response was:" and the like, and the one or
/// two after it when it has no code (older bounces put the server's reply
/// a paragraph further down).
fn response(head: &str, lower: &str) -> String {
    const MARKERS: &[&str] = &[
        "the response from the remote server was:",
        "the response was:",
        "technical details of permanent failure:",
        "technical details of temporary failure:",
    ];
    let Some(at) = MARKERS.iter().filter_map(|m| text::find(lower, m)).min() else {
        return String::new();
    };
    // The text has LF line ends (see `human_text`).
    let mut out = String::new();
    for para in bounce::lines_after(head, at)
        .collect::<Vec<_>>()
        .join("\n")
        .split("\n\n")
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .take(3)
    {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(text::prefix(para, 2048));
        if text::enhanced_status(para, b"45").is_some() || text::reply_code(para, b"45").is_some() {
            break;
        }
    }
    out
}
