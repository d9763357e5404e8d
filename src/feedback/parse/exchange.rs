//! Microsoft Exchange and Office 365 non-delivery reports, for when they
//! come without their DSN part (or it names no one):
//! - Exchange 2007 and later, Office 365: "Delivery has failed to these
//!   recipients or groups:" then `address (address)` or `Name (address)`
//!   lines with a description; newer Office 365: "Your message to address
//!   couldn't be delivered."; both then "Diagnostic information for
//!   administrators:" with the address alone on a line and "Remote Server
//!   returned '550 5.1.10 ...'" or "#550 5.1.1 RESOLVER.ADR.RecipNotFound;
//!   not found ##" after it, until "Original message headers:".
//! - Exchange 2000/2003: "Your message did not reach some or all of the
//!   intended recipients." ... "The following recipient(s) cannot be
//!   reached:" then `address on date` lines, each followed by its indented
//!   reason lines.

use super::bounce::{self, indent, Block};
use super::classify::Action;
use super::text::{self, contains_any};
use super::Context;

pub(super) fn detect(ctx: &Context<'_>) -> bool {
    contains_any(
        &ctx.text_lower,
        &[
            "delivery has failed to these recipients or groups",
            "diagnostic information for administrators",
            "your message did not reach some or all of the intended recipients",
            "the following recipient(s) cannot be reached",
        ],
    ) || (text::find(&ctx.text_lower, "your message to ").is_some()
        && text::find(&ctx.text_lower, "couldn't be delivered").is_some())
}

pub(super) fn read(ctx: &Context<'_>) -> Vec<Block> {
    let text = ctx.text.as_str();
    let lower = ctx.text_lower.as_str();
    let mut blocks: Vec<Block> = Vec::new();

    if let Some(at) = text::find(lower, "delivery has failed to these recipients or groups") {
        user_section(bounce::lines_after(text, at), &mut blocks);
    }
    if let Some(at) = text::find(lower, "your message to ") {
        let rest = text
            .get(at + "your message to ".len()..)
            .unwrap_or_default();
        let line = rest.lines().next().unwrap_or_default();
        if let Some(end) = text::find(&text::ascii_lower(line), " couldn't be delivered") {
            let addr = line.get(..end).and_then(text::addr_spec);
            merge(&mut blocks, Block::new(addr, Action::Failed));
        }
    }
    if let Some(at) = text::find(lower, "the following recipient(s) cannot be reached") {
        legacy_section(bounce::lines_after(text, at), &mut blocks);
    }
    if let Some(at) = text::find(lower, "diagnostic information for administrators") {
        admin_section(bounce::lines_after(text, at), &mut blocks);
    }
    blocks
}

/// Adds `block`, or gives its reason to the block already there for the
/// same recipient when that one has none.
fn merge(blocks: &mut Vec<Block>, block: Block) {
    if blocks.len() >= super::MAX_ITEMS {
        return;
    }
    // Few recipients per NDR; the administrators' section repeats the
    // user section's, so this is one look-up per recipient of a short list.
    let existing = blocks
        .iter_mut()
        .take(64)
        .find(|b| b.recipient.is_some() && b.recipient == block.recipient);
    match existing {
        Some(b) => {
            if !block.reason.is_empty() {
                // The administrators' reason (with the code) goes first.
                let user = std::mem::take(&mut b.reason);
                b.add(&block.reason);
                b.add(&user);
            }
        }
        None => blocks.push(block),
    }
}

/// `address (address)` / `Name (address)` / `address` lines, each followed
/// by its description, until the administrators' section.
fn user_section<'t>(lines: impl Iterator<Item = &'t str>, blocks: &mut Vec<Block>) {
    let mut current: Option<Block> = None;
    for line in lines {
        let trimmed = line.trim();
        let lower = text::ascii_lower(trimmed);
        if lower.starts_with("diagnostic information for administrators")
            || lower.starts_with("original message headers")
        {
            break;
        }
        if trimmed.is_empty() {
            continue;
        }
        if let Some(addr) = recipient_line(trimmed) {
            if let Some(b) = current.take() {
                merge(blocks, b);
            }
            current = Some(Block::new(Some(addr), Action::Failed));
            continue;
        }
        if let Some(block) = current.as_mut() {
            block.add(trimmed);
        }
    }
    if let Some(b) = current {
        merge(blocks, b);
    }
}

/// `address`, `address (address)` or `Display Name (address)` alone on a
/// line.
fn recipient_line(line: &str) -> Option<String> {
    if let Some(addr) = text::addr_spec(line) {
        return Some(addr);
    }
    let inner = line.strip_suffix(')')?;
    let open = inner.rfind('(')?;
    text::addr_spec(inner.get(open + 1..)?)
}

/// `address on date` lines with their indented reasons (Exchange 2003).
fn legacy_section<'t>(lines: impl Iterator<Item = &'t str>, blocks: &mut Vec<Block>) {
    let mut current: Option<(usize, Block)> = None;
    for line in lines {
        if line.trim().is_empty() {
            continue;
        }
        let depth = indent(line);
        let first = line.split_whitespace().next().unwrap_or_default();
        let deeper = current.as_ref().is_some_and(|(d, _)| depth > *d);
        if !deeper {
            if let Some(addr) = text::addr_spec(first) {
                if let Some((_, b)) = current.take() {
                    merge(blocks, b);
                }
                current = Some((depth, Block::new(Some(addr), Action::Failed)));
                continue;
            }
            if current.is_some() {
                break;
            }
            continue;
        }
        if let Some((_, block)) = current.as_mut() {
            block.add(line);
        }
    }
    if let Some((_, b)) = current {
        merge(blocks, b);
    }
}

/// The administrators' section: an address alone on a line, then its
/// "Remote Server returned '...'" or "#550 5.1.1 ... ##" line(s).
fn admin_section<'t>(lines: impl Iterator<Item = &'t str>, blocks: &mut Vec<Block>) {
    let mut current: Option<Block> = None;
    for line in lines {
        let trimmed = line.trim();
        let lower = text::ascii_lower(trimmed);
        if lower.starts_with("original message headers") {
            break;
        }
        if trimmed.is_empty() || lower.starts_with("generating server:") {
            continue;
        }
        if let Some(addr) = text::addr_spec(trimmed) {
            if let Some(b) = current.take() {
                merge(blocks, b);
            }
            current = Some(Block::new(Some(addr), Action::Failed));
            continue;
        }
        let coded = lower.starts_with("remote server returned")
            || lower.starts_with('#')
            || text::enhanced_status(trimmed, b"45").is_some();
        match current.as_mut() {
            Some(block) if coded => {
                let reason = trimmed
                    .strip_prefix("Remote Server returned")
                    .map(|r| r.trim().trim_matches('\''))
                    .unwrap_or(trimmed);
                block.add(reason.trim_start_matches('#').trim_end_matches("##").trim());
            }
            _ => {}
        }
    }
    if let Some(b) = current {
        merge(blocks, b);
    }
}
