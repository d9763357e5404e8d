//! Postfix's bounce text, for when it comes without its DSN part (older
//! versions, or a forward that kept only the text): "This is the mail system
//! at host ..." (older: "This is the Postfix program at host ..."), then one
//! paragraph per recipient that opens at the start of a line with
//! `<address>: reason` or `<address> (expanded from <alias>): reason`, the
//! reason continued on indented lines. A warning ("Delayed Mail (still
//! being retried)", "THIS IS A WARNING ONLY") lists recipients the same way.

use super::bounce::{self, Block};
use super::classify::Action;
use super::text::{self, contains_any};
use super::Context;

pub(super) fn detect(ctx: &Context<'_>) -> bool {
    contains_any(
        &ctx.text_lower,
        &[
            "this is the mail system at host",
            "this is the postfix program at host",
        ],
    )
}

pub(super) fn read(ctx: &Context<'_>) -> Vec<Block> {
    let action = if contains_any(&ctx.text_lower, &["this is a warning only"])
        || contains_any(&ctx.subject_lower, &["delayed mail"])
    {
        Action::Delayed
    } else {
        Action::Failed
    };
    let mut blocks = Vec::new();
    let mut current: Option<Block> = None;
    for line in bounce::head(ctx).lines() {
        if line.starts_with("--") {
            break;
        }
        if line.trim().is_empty() {
            blocks.extend(current.take());
            continue;
        }
        if let Some((addr, reason)) = recipient_line(line) {
            blocks.extend(current.take());
            let mut block = Block::new(text::addr_spec(addr), action);
            block.add(reason);
            current = Some(block);
            continue;
        }
        if line.starts_with([' ', '\t']) {
            if let Some(block) = current.as_mut() {
                block.add(line);
            }
        } else {
            blocks.extend(current.take());
        }
    }
    blocks.extend(current);
    blocks
}

/// `<a@b>: reason` or `<a@b> (expanded from <c@d>): reason` -> (`a@b`,
/// `reason`).
fn recipient_line(line: &str) -> Option<(&str, &str)> {
    let rest = line.strip_prefix('<')?;
    let close = rest.find('>')?;
    let addr = rest.get(..close)?;
    let after = rest.get(close + 1..)?;
    let after = match after.trim_start().strip_prefix("(expanded from") {
        Some(expanded) => expanded.get(expanded.find(')')? + 1..)?,
        None => after,
    };
    let reason = after.trim_start().strip_prefix(':')?;
    Some((addr, reason))
}
