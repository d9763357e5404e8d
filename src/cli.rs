//! The command line: `tablemail [--config FILE] <command>`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tablemail",
    version,
    about = "Sends the mails that applications insert into a database table"
)]
pub struct Cli {
    /// Configuration file (TOML); default /etc/tablemail/tablemail.toml when present.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon until SIGTERM or SIGINT.
    Run,
    /// Apply pending migrations and exit.
    Migrate,
    /// Insert mails: one from flags, or many as JSON lines on stdin (--jsonl).
    Enqueue(Box<EnqueueArgs>),
    /// Show queue depth, age, stale locks and recent failures.
    Status {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Show one mail: its state, the relay's reply, its attachments and history.
    Show(ShowArgs),
    /// Put failed or unknown mails back to queued with fresh attempts.
    Retry(RetryArgs),
    /// Cancel a queued mail.
    Cancel {
        #[arg(long)]
        id: i64,
    },
    /// Delete finished rows older than the retention settings.
    Purge,
    /// Validate the configuration, reach the database and the relay.
    Check,
}

#[derive(Debug, Args)]
pub struct EnqueueArgs {
    /// Read one JSON object per line from stdin, with the column names as keys.
    #[arg(long, conflicts_with_all = ["to", "subject", "body", "html", "cc", "bcc", "from", "from_name", "reply_to", "priority", "send_at", "dedupe_key", "header", "attach", "inline"])]
    pub jsonl: bool,
    /// Recipients, comma separated.
    #[arg(long, required_unless_present = "jsonl")]
    pub to: Option<String>,
    #[arg(long)]
    pub subject: Option<String>,
    /// Text body.
    #[arg(long)]
    pub body: Option<String>,
    /// HTML body.
    #[arg(long)]
    pub html: Option<String>,
    #[arg(long)]
    pub cc: Option<String>,
    #[arg(long)]
    pub bcc: Option<String>,
    #[arg(long = "reply-to")]
    pub reply_to: Option<String>,
    /// Sender address (default: defaults.from_address).
    #[arg(long)]
    pub from: Option<String>,
    #[arg(long = "from-name")]
    pub from_name: Option<String>,
    /// Higher is sent first.
    #[arg(long, allow_negative_numbers = true)]
    pub priority: Option<i32>,
    /// Not before: an RFC 3339 time or a delay such as 10m.
    #[arg(long = "send-at")]
    pub send_at: Option<String>,
    #[arg(long = "dedupe-key")]
    pub dedupe_key: Option<String>,
    /// Extra header, NAME:VALUE; repeatable.
    #[arg(long, value_name = "NAME:VALUE")]
    pub header: Vec<String>,
    /// Attach a file (its type from its extension, or PATH;type=TYPE); repeatable.
    #[arg(long, value_name = "PATH")]
    pub attach: Vec<String>,
    /// An inline image for the HTML, referenced there as cid:CID; repeatable.
    #[arg(long, value_name = "CID=PATH")]
    pub inline: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    #[command(flatten)]
    pub which: MailArg,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Include the body, the headers and the full addresses.
    #[arg(long)]
    pub body: bool,
}

/// One mail, by id, Message-ID or dedupe key.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct MailArg {
    /// The mail's id.
    pub id: Option<i64>,
    /// The Message-ID, with its angle brackets.
    #[arg(long = "message-id")]
    pub message_id: Option<String>,
    #[arg(long = "dedupe-key")]
    pub dedupe_key: Option<String>,
}

#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct RetryArgs {
    /// One mail by id.
    #[arg(long)]
    pub id: Option<i64>,
    /// Every failed and unknown mail.
    #[arg(long = "all-failed")]
    pub all_failed: bool,
}
