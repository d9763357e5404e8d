//! What a claim asks for and what it brings: the batch's lock, the claimed
//! rows with their sizes, and the columns and attachments a message is built
//! from (brought by the claim for small rows, loaded at send time for the
//! others).

use std::{fmt, time::Duration};

use uuid::Uuid;

/// The GUID that one claimed batch holds in `thread_lock`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchLock(pub Uuid);

impl BatchLock {
    /// A fresh v4 GUID: every claim takes a new one.
    /// A fresh random lock (deliberately not `Default`: a lock made by
    /// accident would fence nothing).
    pub fn generate() -> Self {
        BatchLock(Uuid::new_v4())
    }
}

impl fmt::Display for BatchLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What a claim asks for.
#[derive(Debug, Clone)]
pub struct Claim<'a> {
    pub lock: BatchLock,
    pub limit: usize,
    /// Rows created (or retried by an operator) longer ago than this come
    /// back with `expired` set.
    pub max_age: Duration,
    /// Right-hand side of Message-IDs the daemon assigns.
    pub message_id_domain: &'a str,
    /// Rows whose text columns together are at most this many octets come
    /// with them; larger ones are loaded when they are sent
    /// ([`Store::load_content`]), so that what a daemon holds claimed is
    /// bounded whatever the rows carry.
    pub inline_limit: usize,
}

/// What every backend's claim statement binds, owned so that it moves into
/// the statement's future.
pub(crate) struct ClaimBinds {
    /// Makes SQLite's assigned Message-IDs unique across claims;
    /// PostgreSQL and MariaDB derive theirs from the row alone (the same
    /// Message-ID whichever claim gives it).
    pub nonce: String,
    pub lock: BatchLock,
    pub limit: i64,
    pub domain: String,
    /// `max_age` in the backend's unit.
    pub max_age: i64,
    pub inline_limit: i64,
}

impl ClaimBinds {
    /// Binds a one-statement claim's parameters, in this order: limit, lock,
    /// Message-ID nonce, Message-ID domain, max age, inline limit.
    pub(crate) fn bind<'q, DB: sqlx::Database>(
        self,
        query: sqlx::query::Query<'q, DB, DB::Arguments>,
    ) -> sqlx::query::Query<'q, DB, DB::Arguments>
    where
        i64: super::rows::Bind<DB>,
        String: super::rows::Bind<DB>,
    {
        let inline_limit = self.inline_limit;
        self.bind_but_inline_limit(query).bind(inline_limit)
    }

    /// [`ClaimBinds::bind`] without the inline limit, for a claim that
    /// leaves the text to a statement of its own (SQLite's).
    pub(crate) fn bind_but_inline_limit<'q, DB: sqlx::Database>(
        self,
        query: sqlx::query::Query<'q, DB, DB::Arguments>,
    ) -> sqlx::query::Query<'q, DB, DB::Arguments>
    where
        i64: super::rows::Bind<DB>,
        String: super::rows::Bind<DB>,
    {
        query
            .bind(self.limit)
            .bind(self.lock.to_string())
            .bind(self.nonce)
            .bind(self.domain)
            .bind(self.max_age)
    }
}

impl Claim<'_> {
    pub(crate) fn binds(&self, unit: fn(Duration) -> i64) -> ClaimBinds {
        ClaimBinds {
            nonce: uuid::Uuid::new_v4().simple().to_string(),
            lock: self.lock,
            limit: self.limit as i64,
            domain: self.message_id_domain.to_string(),
            max_age: unit(self.max_age),
            inline_limit: self.inline_limit as i64,
        }
    }
}

/// A claimed row: status `sending`, held by `lock`, attempt already spent.
#[derive(Debug, Clone)]
pub struct QueuedMail {
    pub id: i64,
    pub lock: BatchLock,
    pub priority: i32,
    /// Tries made, this one included.
    pub attempts: i32,
    /// Tries left after this one.
    pub attempts_remaining: i32,
    /// Relay-down outcomes this row drew in a row while other mails went
    /// through (`worker.relay_down_limit`).
    pub relay_down_count: i32,
    pub message_id: String,
    /// `created_at` (or the last operator retry) is older than
    /// `worker.max_age` (by the database clock).
    pub expired: bool,
    /// How large the row is, counted by the database.
    pub sizes: MailSizes,
    /// The text columns, when the claim brought them (`sizes.content` within
    /// the claim's `inline_limit`); otherwise [`Store::load_content`] reads
    /// them when the mail is sent.
    pub content: Option<MailContent>,
    /// What the suppression list says of its recipients; the worker reads
    /// it for the whole claim at once.
    pub suppression: SuppressionCheck,
    /// What the send caps said of it (DESIGN §16); the worker asks for the
    /// whole claim at once.
    pub caps: CapCheck,
}

/// What the send caps said of a claimed row (DESIGN §16).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CapCheck {
    /// Not asked yet (a large row: its sender and recipients come with its
    /// content).
    #[default]
    Unchecked,
    /// No cap counts it.
    Uncounted,
    /// Every cap that counts it (these, by name) reserved room for it under
    /// its claim.
    Reserved(Vec<String>),
    /// `cap` has no room: the mail waits `wait`, unspent.
    Over {
        cap: String,
        wait: std::time::Duration,
    },
    /// The caps could not be read: the mail waits, unspent.
    Unavailable,
}

/// What the suppression list said of a claimed row's recipients (DESIGN
/// §12).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SuppressionCheck {
    /// Not read yet (a large row: its recipients come with its content).
    #[default]
    Unchecked,
    /// These recipients are left out of the envelope (none: empty).
    Checked(Vec<super::Suppressed>),
    /// The list could not be read: the mail waits, unspent.
    Unavailable,
}

/// A mail's size in octets as stored, known from the claim before any of
/// it is loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MailSizes {
    /// The text columns together: addresses, subject, bodies, headers.
    pub content: u64,
    /// The bodies alone (`body`, `body_html`).
    pub bodies: u64,
    pub attachments: u32,
    /// The attachments' bytes together, before encoding.
    pub attachment_bytes: u64,
}

/// The columns a message is built from.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct MailContent {
    pub from_name: Option<String>,
    pub from_address: Option<String>,
    pub to_address: String,
    pub cc: Option<String>,
    pub bcc: Option<String>,
    pub reply_to: Option<String>,
    pub subject: String,
    pub body: Option<String>,
    pub body_html: Option<String>,
    /// The `headers` column as JSON text.
    pub headers: Option<String>,
    /// The route the row names (DESIGN §13); `None`: its From domain's.
    pub route: Option<String>,
    /// The template it is rendered with (DESIGN §15), its data (a JSON
    /// object as text) and the locale wanted.
    pub template: Option<String>,
    pub template_data: Option<String>,
    pub locale: Option<String>,
    /// The first of these columns that is not UTF-8 (text SQLite stored as
    /// it was given), and the offset of its first bad octet: that column
    /// reads as empty, and the mail fails rather than goes out.
    #[serde(skip)]
    pub not_utf8: Option<(&'static str, usize)>,
}

/// One row of `mail_attachment`, as loaded to be sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub filename: String,
    pub content_type: String,
    pub content: Vec<u8>,
    /// Set: an inline part, referenced from `body_html` as `cid:…`.
    pub content_id: Option<String>,
}
