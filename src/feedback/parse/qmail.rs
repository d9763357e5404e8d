//! qmail's bounce ("Hi. This is the qmail-send program at ...") and the
//! qmail-shaped bounces of Yahoo ("Sorry, we were unable to deliver your
//! message to the following address."): one paragraph per recipient that
//! opens with `<address>:` alone on its line, its reason on the lines after
//! (often "Remote host said: 550 ..."), until "--- Below this line is a copy
//! of the message.".

use super::bounce::{self, Block};
use super::classify::Action;
use super::text::{self, contains_any};
use super::Context;

pub(super) fn detect_qmail(ctx: &Context<'_>) -> bool {
    contains_any(
        &ctx.text_lower,
        &[
            "this is the qmail-send program",
            "i wasn't able to deliver your message to the following addresses",
        ],
    )
}

pub(super) fn detect_yahoo(ctx: &Context<'_>) -> bool {
    contains_any(
        &ctx.text_lower,
        &["sorry, we were unable to deliver your message to the following address"],
    )
}

pub(super) fn read(ctx: &Context<'_>) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut current: Option<Block> = None;
    for line in bounce::head(ctx).lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("--- ") {
            break;
        }
        if trimmed.is_empty() {
            blocks.extend(current.take());
            continue;
        }
        if trimmed.starts_with('<') && trimmed.ends_with(">:") {
            blocks.extend(current.take());
            current = Some(Block::new(text::addr_spec(trimmed), Action::Failed));
            continue;
        }
        if let Some(block) = current.as_mut() {
            block.add(trimmed);
        }
    }
    blocks.extend(current);
    blocks
}
