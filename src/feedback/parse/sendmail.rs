//! Sendmail's bounce text, for when it comes without its DSN part: "-----
//! The following addresses had permanent fatal errors -----" (or "transient
//! non-fatal errors" in a warning), one address per line, each optionally
//! followed by "(reason: 550 5.1.1 User unknown)"; then "----- Transcript of
//! session follows -----", whose reply lines ("550 5.1.1 <a@b>... User
//! unknown") give the reason where the list gave none, or the recipients
//! when there is no list.

use std::collections::HashMap;

use super::bounce::{self, addresses_in, Block};
use super::classify::Action;
use super::text::{self, contains_any};
use super::Context;

pub(super) fn detect(ctx: &Context<'_>) -> bool {
    contains_any(
        &ctx.text_lower,
        &[
            "the following addresses had permanent fatal errors",
            "the following addresses had transient non-fatal errors",
            "----- transcript of session follows -----",
            "the original message was received at",
        ],
    )
}

const LISTS: &[(&str, Action)] = &[
    (
        "the following addresses had permanent fatal errors",
        Action::Failed,
    ),
    (
        "the following addresses had transient non-fatal errors",
        Action::Delayed,
    ),
];

pub(super) fn read(ctx: &Context<'_>) -> Vec<Block> {
    let head = bounce::head(ctx);
    let head_lower = text::ascii_lower(head);
    let mut blocks: Vec<Block> = Vec::new();
    for (marker, action) in LISTS {
        let Some(at) = text::find(&head_lower, marker) else {
            continue;
        };
        let mut current: Option<Block> = None;
        for line in bounce::lines_after(head, at) {
            let trimmed = line.trim();
            if trimmed.starts_with("-----") {
                break;
            }
            if trimmed.is_empty() {
                continue;
            }
            let lower = text::ascii_lower(trimmed);
            if lower.starts_with("(reason:") {
                if let Some(block) = current.as_mut() {
                    block.add(
                        trimmed
                            .get("(reason:".len()..)
                            .unwrap_or_default()
                            .trim_end_matches(')'),
                    );
                }
                continue;
            }
            if lower.starts_with("(expanded from") || lower.starts_with('(') {
                continue;
            }
            let first = trimmed.split_whitespace().next().unwrap_or_default();
            if let Some(addr) = text::addr_spec(first) {
                blocks.extend(current.take());
                current = Some(Block::new(Some(addr), *action));
            }
        }
        blocks.extend(current);
    }
    transcript(head, &head_lower, &mut blocks);
    blocks
}

/// Reasons from the session transcript: for each listed recipient with no
/// reason, the first reply line that names it; with no list, one block per
/// address that a reply line names.
fn transcript(head: &str, head_lower: &str, blocks: &mut Vec<Block>) {
    let Some(at) = text::find(head_lower, "----- transcript of session follows -----") else {
        return;
    };
    let listed = !blocks.is_empty();
    let mut index: HashMap<String, usize> = blocks
        .iter()
        .enumerate()
        .filter_map(|(i, b)| b.recipient.clone().map(|r| (r, i)))
        .collect();
    for line in bounce::lines_after(head, at) {
        let trimmed = line.trim_start_matches(['<', ' ']).trim();
        let coded = text::reply_code(trimmed, b"45").is_some_and(|c| trimmed.starts_with(c));
        if !coded {
            continue;
        }
        for addr in addresses_in(trimmed).take(2) {
            match index.get(&addr) {
                Some(&i) => {
                    if let Some(block) = blocks.get_mut(i).filter(|b| b.reason.is_empty()) {
                        block.add(trimmed);
                    }
                }
                None if !listed && index.len() < super::MAX_ITEMS => {
                    let mut block = Block::new(Some(addr.clone()), Action::Failed);
                    block.add(trimmed);
                    index.insert(addr, blocks.len());
                    blocks.push(block);
                }
                None => {}
            }
        }
    }
}
