//! Non-standard bounces: which family's recogniser reads the message, and
//! what they share: per-recipient blocks of reason text, the point where the
//! returned copy of the message starts, and what to do when a recognised
//! bounce names no recipient that could be read.
//!
//! Each family recogniser keys on the fixed sentences its server writes; the
//! first whose sentence is in the text reads it. A bounce-looking message
//! that none of them claims goes to [`generic`].

use super::classify::{self, Action};
use super::text::{self, contains_any};
use super::{exchange, exim, generic, gmail, item, postfix, qmail, sendmail};
use super::{Context, Items};

/// The longest reason text kept for one recipient, in octets, before
/// cleaning cuts it to the diagnostic's length.
const MAX_REASON: usize = 4096;

/// What one recipient's paragraph of a bounce says.
#[derive(Debug)]
pub(super) struct Block {
    pub(super) recipient: Option<String>,
    pub(super) reason: String,
    pub(super) action: Action,
}

impl Block {
    pub(super) fn new(recipient: Option<String>, action: Action) -> Block {
        Block {
            recipient,
            reason: String::new(),
            action,
        }
    }

    /// Appends a line of reason text (trimmed, one space between lines).
    pub(super) fn add(&mut self, line: &str) {
        let line = line.trim();
        if line.is_empty() || self.reason.len() >= MAX_REASON {
            return;
        }
        if !self.reason.is_empty() {
            self.reason.push(' ');
        }
        let room = MAX_REASON.saturating_sub(self.reason.len());
        self.reason.push_str(text::prefix(line, room));
    }
}

/// A family: its name, whether the message is one of its bounces, and its
/// reader.
type Family = (
    &'static str,
    fn(&Context<'_>) -> bool,
    fn(&Context<'_>) -> Vec<Block>,
);

const FAMILIES: &[Family] = &[
    ("exim", exim::detect, exim::read),
    ("qmail", qmail::detect_qmail, qmail::read),
    ("yahoo", qmail::detect_yahoo, qmail::read),
    ("postfix", postfix::detect, postfix::read),
    ("sendmail", sendmail::detect, sendmail::read),
    ("exchange", exchange::detect, exchange::read),
    ("gmail", gmail::detect, gmail::read),
];

/// Adds the items of a non-standard bounce and returns its family; `None`
/// when the message is none.
pub(super) fn parse(ctx: &Context<'_>, items: &mut Items) -> Option<&'static str> {
    let permanent = contains_any(
        &ctx.text_lower,
        &[
            "this is a permanent error",
            "failed permanently",
            "permanent fatal error",
        ],
    );
    for (family, detect, read) in FAMILIES {
        if detect(ctx) {
            let blocks = read(ctx);
            add(ctx, items, blocks, permanent);
            if items.is_empty() {
                add(ctx, items, generic::scan(ctx), permanent);
            }
            if items.is_empty() {
                fallback(ctx, items, permanent, true);
            }
            return Some(family);
        }
    }
    if !generic::looks_like_bounce(ctx) {
        return None;
    }
    add(ctx, items, generic::scan(ctx), permanent);
    if items.is_empty() && !fallback(ctx, items, permanent, false) {
        return None;
    }
    Some("generic")
}

/// Adds one item per block.
fn add(ctx: &Context<'_>, items: &mut Items, blocks: Vec<Block>, permanent: bool) {
    for block in blocks {
        let reason = text::clean(&block.reason);
        let status = classify::status(None, Some(&reason));
        let kind = classify::kind(
            block.action,
            status.as_deref(),
            Some(&reason),
            ctx.delay_notice,
            permanent,
        );
        if !items.push(item(block.recipient, kind, status, &reason)) {
            return;
        }
    }
}

/// For a bounce whose paragraphs could not be read: one item per
/// `X-Failed-Recipients` address, else (when `recognised`, or a code stands
/// in the text) one item with no recipient, classified from the first line
/// that has a code. False when it added nothing.
fn fallback(ctx: &Context<'_>, items: &mut Items, permanent: bool, recognised: bool) -> bool {
    let head = head(ctx);
    let coded_line = head.lines().find(|l| {
        text::enhanced_status(l, b"45").is_some() || text::reply_code(l, b"45").is_some()
    });
    let action = if ctx.delay_notice && !permanent {
        Action::Delayed
    } else {
        Action::Failed
    };
    let reason = coded_line.unwrap_or_default();
    let failed: Vec<String> = ctx
        .root()
        .headers
        .all("x-failed-recipients")
        .flat_map(|v| v.split(','))
        .filter_map(text::addr_spec)
        .take(super::MAX_ITEMS)
        .collect();
    let blocks: Vec<Block> = if !failed.is_empty() {
        failed
            .into_iter()
            .map(|r| {
                let mut b = Block::new(Some(r), action);
                b.add(reason);
                b
            })
            .collect()
    } else if recognised || coded_line.is_some() {
        let mut b = Block::new(None, action);
        b.add(reason);
        vec![b]
    } else {
        return false;
    };
    add(ctx, items, blocks, permanent);
    !items.is_empty()
}

/// Sentences after which a bounce quotes the returned message (or its
/// headers), lower-case.
const COPY_MARKERS: &[&str] = &[
    "------ this is a copy of the message",
    "------ this is a copy of the body",
    "------ the body of the message is",
    "--- below this line is a copy of the message",
    "--- enclosed are the original headers",
    "original message headers:",
    "----- original message -----",
    "-----original message-----",
    "----- original message follows -----",
    "--- undelivered message follows ---",
    "undelivered message headers",
    "----- the header of the original message is following. -----",
];

/// The text up to where the returned copy of the message starts.
pub(super) fn head<'c>(ctx: &'c Context<'_>) -> &'c str {
    let end = COPY_MARKERS
        .iter()
        .filter_map(|m| text::find(&ctx.text_lower, m))
        .min()
        .unwrap_or(ctx.text.len());
    ctx.text.get(..end).unwrap_or(&ctx.text)
}

/// The lines of `text` after the line holding offset `at`.
pub(super) fn lines_after(text: &str, at: usize) -> std::str::Lines<'_> {
    let rest = text.get(at..).unwrap_or_default();
    match rest.find('\n') {
        Some(n) => rest.get(n + 1..).unwrap_or_default().lines(),
        None => "".lines(),
    }
}

/// The number of leading spaces (a tab counts as eight) of `line`.
pub(super) fn indent(line: &str) -> usize {
    line.chars()
        .take_while(|c| *c == ' ' || *c == '\t')
        .map(|c| if c == '\t' { 8 } else { 1 })
        .sum()
}

/// The addr-specs in a line of text: its words (split at white space and
/// the punctuation that surrounds addresses in prose) that hold an `@`.
pub(super) fn addresses_in(line: &str) -> impl Iterator<Item = String> + '_ {
    line.split(|c: char| {
        c.is_whitespace()
            || matches!(
                c,
                '<' | '>' | '(' | ')' | '[' | ']' | '"' | '\'' | ',' | ';'
            )
    })
    .filter(|w| w.contains('@'))
    .filter_map(text::addr_spec)
}
