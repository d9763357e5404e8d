//! Exim's classic bounce and delay warning (its DSNs are read by
//! [`super::dsn`]): "This message was created automatically by mail delivery
//! software.", then "The following address(es) failed:" (or "have not yet
//! been delivered:" in a warning), then one paragraph per recipient: the
//! address indented by two spaces, its reason lines indented by four, until
//! "------ This is a copy of the message ...".

use super::bounce::{self, indent, Block};
use super::classify::Action;
use super::text::{self, contains_any};
use super::Context;

pub(super) fn detect(ctx: &Context<'_>) -> bool {
    contains_any(
        &ctx.text_lower,
        &[
            "this message was created automatically by mail delivery software",
            "the following address(es) failed",
            "address(es) have not yet been delivered",
        ],
    )
}

/// The sentences that open a list of recipients, and what happened to them.
const LISTS: &[(&str, Action)] = &[
    ("following address(es) failed", Action::Failed),
    ("address(es) have not yet been delivered", Action::Delayed),
    (
        "to which the message has not yet been delivered",
        Action::Delayed,
    ),
    ("address(es) have yet to be delivered", Action::Delayed),
    ("following address(es) are still pending", Action::Delayed),
];

pub(super) fn read(ctx: &Context<'_>) -> Vec<Block> {
    let head = bounce::head(ctx);
    let head_lower = text::ascii_lower(head);
    let mut blocks = Vec::new();
    for (marker, action) in LISTS {
        let Some(at) = text::find(&head_lower, marker) else {
            continue;
        };
        read_list(bounce::lines_after(head, at), *action, &mut blocks);
    }
    blocks
}

/// Reads `  address` / `    reason` paragraphs until an unindented line
/// that is no address.
fn read_list<'t>(lines: impl Iterator<Item = &'t str>, action: Action, blocks: &mut Vec<Block>) {
    let mut current: Option<Block> = None;
    let mut started = false;
    for line in lines {
        if line.trim().is_empty() {
            continue;
        }
        let depth = indent(line);
        if depth < 4 {
            let first = line.split_whitespace().next().unwrap_or_default();
            if let Some(addr) = text::addr_spec(first) {
                blocks.extend(current.take());
                let mut block = Block::new(Some(addr), action);
                // Some templates put the reason on the address's line.
                block.add(line.trim().get(first.len()..).unwrap_or_default());
                current = Some(block);
                started = true;
                continue;
            }
            blocks.extend(current.take());
            if depth == 0 && started {
                break;
            }
            continue;
        }
        if let Some(block) = current.as_mut() {
            block.add(line);
        }
    }
    blocks.extend(current);
}
