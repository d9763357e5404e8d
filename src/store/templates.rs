//! Templates in the database (DESIGN §15): the rows of `mail_template` as
//! the daemon, the commands and the console read and write them.

use chrono::{DateTime, Utc};

/// One row of `mail_template`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateRow {
    pub name: String,
    /// `''`: the default, used when no row has the mail's locale.
    pub locale: String,
    pub subject: String,
    pub body: Option<String>,
    pub body_html: Option<String>,
    pub updated_at: DateTime<Utc>,
}

/// What the daemon reads once per claim batch to see which templates
/// changed: the key and the time of the last change, never the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateVersion {
    pub name: String,
    pub locale: String,
    pub updated_at: DateTime<Utc>,
}

/// A template as `tablemail template put` writes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewTemplate {
    pub name: String,
    pub locale: String,
    pub subject: String,
    pub body: Option<String>,
    pub body_html: Option<String>,
}

/// The SQL of templates, bound by `sql_store` like
/// [`Queries`](super::shared::Queries).
pub(crate) struct TemplateQueries {
    /// -> `name`, `locale`, `updated_at` of every template.
    pub versions: &'static str,
    /// -> every [`TemplateRow`] column, by name and locale.
    pub all: &'static str,
    /// ($1 name, $2 locale, $3 subject, $4 body, $5 body_html): inserts or
    /// replaces, `updated_at` set to now.
    pub put: &'static str,
}

/// The statements that read the same on every database.
pub(crate) mod portable {
    pub const VERSIONS: &str = "SELECT name, locale, updated_at FROM mail_template";
    pub const ALL: &str = "SELECT name, locale, subject, body, body_html, updated_at \
                           FROM mail_template ORDER BY name, locale";
}
