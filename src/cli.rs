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
    /// Record one delivery report (a bounce, a complaint) read from stdin:
    /// for a Postfix pipe transport or a .forward. Exit 75 while the
    /// database is away.
    Ingest(IngestArgs),
    /// The suppression list: addresses no mail goes to.
    Suppress {
        #[command(subcommand)]
        command: SuppressCommand,
    },
    /// Templates in the database: subject, text and HTML per name and locale.
    Template {
        #[command(subcommand)]
        command: TemplateCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum TemplateCommand {
    /// Every template: name, locale, when it last changed, its parts' sizes.
    List,
    /// One template's subject, text and HTML.
    Show {
        name: String,
        /// The locale ('' = the default); the fallback applies.
        #[arg(long, default_value = "")]
        locale: String,
    },
    /// Insert or replace a template (its parts are minijinja templates).
    Put {
        name: String,
        #[arg(long, default_value = "")]
        locale: String,
        #[arg(long)]
        subject: String,
        /// The text part, from a file (- for stdin).
        #[arg(long, value_name = "FILE")]
        text: Option<PathBuf>,
        /// The HTML part, from a file (- for stdin).
        #[arg(long, value_name = "FILE")]
        html: Option<PathBuf>,
    },
    /// Render a template with data, as the daemon would, and print it.
    Render {
        name: String,
        /// The variables: a JSON object.
        #[arg(long, default_value = "{}")]
        data: String,
        #[arg(long, default_value = "")]
        locale: String,
    },
}

#[derive(Debug, Args)]
pub struct IngestArgs {
    /// The address the report was delivered to (the VERP address; Postfix:
    /// ${original_recipient}); repeatable. Without it the report's own
    /// headers are read.
    #[arg(long, value_name = "ADDRESS")]
    pub rcpt: Vec<String>,
    /// Print what would be recorded; record nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum SuppressCommand {
    /// The addresses on the list, in address order.
    List {
        /// Only this reason: hard_bounce, soft_bounce, complaint, manual.
        #[arg(long)]
        reason: Option<String>,
        /// Only addresses containing this text.
        #[arg(long)]
        search: Option<String>,
        /// Expired entries too.
        #[arg(long)]
        all: bool,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Put addresses on the list.
    Add {
        #[arg(required = true, value_name = "ADDRESS")]
        addresses: Vec<String>,
        /// hard_bounce, soft_bounce, complaint or manual.
        #[arg(long, default_value = "manual")]
        reason: String,
        /// For this long (e.g. 30d); without it, until removed.
        #[arg(long, value_name = "DURATION")]
        expires: Option<String>,
        /// A note kept with the entry.
        #[arg(long)]
        detail: Option<String>,
    },
    /// Take addresses off the list.
    Remove {
        #[arg(required = true, value_name = "ADDRESS")]
        addresses: Vec<String>,
    },
    /// Add the entries of a CSV file: address,reason,created_at,expires_at.
    Import {
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Print the list as CSV: address,reason,created_at,expires_at.
    Export,
}

#[derive(Debug, Args)]
pub struct EnqueueArgs {
    /// Read one JSON object per line from stdin, with the column names as keys.
    #[arg(long, conflicts_with_all = ["to", "subject", "body", "html", "cc", "bcc", "from", "from_name", "reply_to", "priority", "send_at", "dedupe_key", "header", "attach", "inline", "route", "template", "data", "locale"])]
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
    /// The route it takes (`[[routes]]` name); default: its From domain's.
    #[arg(long)]
    pub route: Option<String>,
    /// Render this template (DESIGN §15) when the mail is sent; it fills
    /// the subject and bodies not given.
    #[arg(long)]
    pub template: Option<String>,
    /// The template's variables: a JSON object.
    #[arg(long, requires = "template")]
    pub data: Option<String>,
    /// The locale wanted (e.g. de-AT; falls back to de, then the default).
    #[arg(long, requires = "template")]
    pub locale: Option<String>,
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
