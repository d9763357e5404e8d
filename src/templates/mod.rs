//! Templates in the database (DESIGN §15): a row that names a template is
//! rendered with minijinja when it is sent, the template filling the
//! subject, text and HTML the row leaves empty.
//!
//! - [`Catalog`]: the templates compiled, one minijinja environment holding
//!   each part of each (name, locale) under a name of its own; `{% include
//!   %}`, `{% import %}` and `{% extends %}` find only those (never a
//!   file: the environment has no loader).
//! - [`Templates`]: the daemon's cache of the catalog, brought up to date
//!   at most once per claim batch by one query of the templates' keys and
//!   `updated_at`; only templates that changed are compiled again.
//!
//! Rendering is bounded: fuel (minijinja's count of instructions), a
//! recursion limit, and an output limit (`transport.max_message_size` for
//! the three parts together), so that a hostile template or data fails its
//! mail within milliseconds and the daemon goes on.

use std::{
    borrow::Cow,
    collections::HashMap,
    io,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, RwLock,
    },
};

use chrono::{DateTime, Utc};
use minijinja::{AutoEscape, Environment, ErrorKind, UndefinedBehavior, Value};

use crate::store::{Store, StoreError, TemplateRow};

#[cfg(test)]
mod tests;

/// Instructions one render may run (minijinja's fuel): an order
/// confirmation of a hundred lines takes a few thousand; a loop that would
/// run for minutes stops within milliseconds.
pub const FUEL: u64 = 1_000_000;

/// How deep includes, macros and blocks may nest.
pub const RECURSION_LIMIT: usize = 64;

/// The parts of a template, each compiled on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Subject,
    Text,
    Html,
}

impl Part {
    fn as_str(self) -> &'static str {
        match self {
            Part::Subject => "subject",
            Part::Text => "text",
            Part::Html => "html",
        }
    }
}

/// Why a templated mail cannot be rendered; the mail fails with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("template {name:?} does not exist (locale {locale:?} or a fallback)")]
    NotFound { name: String, locale: String },
    #[error("template {name:?}: template_data is not a JSON object: {reason}")]
    Data { name: String, reason: String },
    #[error("template {name:?} (locale {locale:?}), {part}: {reason}")]
    Render {
        name: String,
        locale: String,
        part: &'static str,
        reason: String,
    },
    #[error("template {name:?} (locale {locale:?}): output over transport.max_message_size ({max} bytes)")]
    TooLarge {
        name: String,
        locale: String,
        max: u64,
    },
}

/// What a row asks of its template.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub name: &'a str,
    /// The locale wanted; `None` or `''`: the default.
    pub locale: Option<&'a str>,
    /// `template_data`: a JSON object as text; `None`: no variables.
    pub data: Option<&'a str>,
    /// Which parts the row leaves empty (only those are rendered).
    pub subject: bool,
    pub text: bool,
    pub html: bool,
    /// Most octets of output, the parts together.
    pub max_output: u64,
}

impl<'a> Request<'a> {
    /// What a row asks of template `name`: the parts it leaves empty
    /// (NULL or `''`; a blank subject).
    pub fn filling(
        name: &'a str,
        locale: Option<&'a str>,
        data: Option<&'a str>,
        row: (&str, Option<&str>, Option<&str>),
        max_output: u64,
    ) -> Request<'a> {
        let (subject, text, html) = row;
        Request {
            name,
            locale,
            data,
            subject: subject.trim().is_empty(),
            text: text.is_none_or(str::is_empty),
            html: html.is_none_or(str::is_empty),
            max_output,
        }
    }
}

/// The row of template `name` a mail in `locale` is rendered with.
pub fn pick<'r>(rows: &'r [TemplateRow], name: &str, locale: &str) -> Option<&'r TemplateRow> {
    locale_chain(locale).find_map(|l| rows.iter().find(|t| t.name == name && t.locale == l))
}

/// The parts a template gave, and the locale it was found under.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rendered {
    pub locale: String,
    pub subject: Option<String>,
    pub text: Option<String>,
    pub html: Option<String>,
}

/// `de-AT` -> `de-AT`, `de`, `''`: the locales tried, most specific first.
pub fn locale_chain(locale: &str) -> impl Iterator<Item = &str> {
    let mut next = Some(locale.trim());
    std::iter::from_fn(move || {
        let current = next?;
        next = match current.rfind('-') {
            Some(at) => Some(&current[..at]),
            None if current.is_empty() => None,
            None => Some(""),
        };
        Some(current)
    })
}

/// The name a part of a template has in the environment: the name, the
/// locale and the part, joined by NUL (which neither a name nor a locale
/// an include writes can hold in a way that matters: an include of such a
/// name reaches a template of the table all the same).
fn key(name: &str, locale: &str, part: Part) -> String {
    format!("{name}\0{locale}\0{}", part.as_str())
}

/// The templates, compiled.
#[derive(Clone)]
pub struct Catalog {
    env: Environment<'static>,
    /// `updated_at` of each (name, locale) compiled.
    versions: HashMap<(String, String), DateTime<Utc>>,
    /// The parts that did not compile, with the reason.
    broken: HashMap<String, String>,
}

impl Default for Catalog {
    fn default() -> Self {
        Catalog::from_rows(&[])
    }
}

impl Catalog {
    /// A catalog of these templates.
    pub fn from_rows(rows: &[TemplateRow]) -> Catalog {
        let mut catalog = Catalog {
            env: new_environment(),
            versions: HashMap::new(),
            broken: HashMap::new(),
        };
        catalog.update(rows);
        catalog
    }

    /// Brings the catalog to these templates (every template there is):
    /// those whose `updated_at` changed are compiled again, those gone are
    /// dropped. Returns how many were compiled.
    fn update(&mut self, rows: &[TemplateRow]) -> usize {
        let mut compiled = 0;
        let mut seen = std::collections::HashSet::new();
        for row in rows {
            let id = (row.name.clone(), row.locale.clone());
            seen.insert(id.clone());
            if self.versions.get(&id) == Some(&row.updated_at) {
                continue;
            }
            let parts = [
                (Part::Subject, Some(row.subject.as_str())),
                (Part::Text, row.body.as_deref()),
                (Part::Html, row.body_html.as_deref()),
            ];
            for (part, source) in parts {
                let name = key(&row.name, &row.locale, part);
                self.env.remove_template(&name);
                self.broken.remove(&name);
                let Some(source) = source.filter(|s| !s.is_empty()) else {
                    continue;
                };
                if let Err(e) = self
                    .env
                    .add_template_owned(name.clone(), source.to_string())
                {
                    self.broken.insert(name, describe(&e));
                }
            }
            self.versions.insert(id, row.updated_at);
            compiled += 1;
        }
        let gone: Vec<(String, String)> = self
            .versions
            .keys()
            .filter(|id| !seen.contains(*id))
            .cloned()
            .collect();
        for (name, locale) in gone {
            for part in [Part::Subject, Part::Text, Part::Html] {
                let k = key(&name, &locale, part);
                self.env.remove_template(&k);
                self.broken.remove(&k);
            }
            self.versions.remove(&(name, locale));
        }
        let known: std::collections::HashSet<String> = self
            .env
            .templates()
            .map(|(name, _)| name.to_string())
            .collect();
        self.env
            .set_path_join_callback(move |included, parent| resolve(&known, included, parent));
        compiled
    }

    /// Whether the catalog holds exactly these versions.
    fn is_current(&self, versions: &[crate::store::TemplateVersion]) -> bool {
        versions.len() == self.versions.len()
            && versions.iter().all(|v| {
                self.versions.get(&(v.name.clone(), v.locale.clone())) == Some(&v.updated_at)
            })
    }

    /// Why a template's part did not compile, if one did not.
    pub fn compile_error(&self, name: &str, locale: &str) -> Option<String> {
        [Part::Subject, Part::Text, Part::Html]
            .iter()
            .find_map(|&part| {
                self.broken.get(&key(name, locale, part)).map(|reason| {
                    format!(
                        "template {name:?} (locale {locale:?}), {}: {reason}",
                        part.as_str()
                    )
                })
            })
    }

    /// The locale a template is found under for `locale`, if any.
    pub fn find<'a>(&self, name: &str, locale: &'a str) -> Option<&'a str> {
        locale_chain(locale).find(|l| {
            self.versions
                .contains_key(&(name.to_string(), l.to_string()))
        })
    }

    /// Renders the parts `request` asks for.
    pub fn render(&self, request: &Request<'_>) -> Result<Rendered, TemplateError> {
        let wanted = request.locale.unwrap_or("");
        let Some(locale) = self.find(request.name, wanted) else {
            return Err(TemplateError::NotFound {
                name: request.name.to_string(),
                locale: wanted.to_string(),
            });
        };
        let data = match request.data {
            None => Value::from(std::collections::BTreeMap::<String, Value>::new()),
            Some(text) => {
                let value: Value = serde_json::from_str(text).map_err(|e| TemplateError::Data {
                    name: request.name.to_string(),
                    reason: e.to_string(),
                })?;
                if value.kind() != minijinja::value::ValueKind::Map {
                    return Err(TemplateError::Data {
                        name: request.name.to_string(),
                        reason: format!("a JSON {}", value.kind()),
                    });
                }
                value
            }
        };
        let mut left = request.max_output;
        let mut rendered = Rendered {
            locale: locale.to_string(),
            ..Rendered::default()
        };
        for (part, wanted, out) in [
            (Part::Subject, request.subject, &mut rendered.subject),
            (Part::Text, request.text, &mut rendered.text),
            (Part::Html, request.html, &mut rendered.html),
        ] {
            if !wanted {
                continue;
            }
            *out = self.render_part(request, locale, part, &data, &mut left)?;
        }
        if let Some(subject) = &mut rendered.subject {
            // A header: one line, without the newline an editor leaves at
            // the end of a file.
            if subject.contains(['\r', '\n']) {
                *subject = subject.split(['\r', '\n']).collect::<Vec<_>>().join(" ");
            }
            *subject = subject.trim().to_string();
        }
        Ok(rendered)
    }

    fn render_part(
        &self,
        request: &Request<'_>,
        locale: &str,
        part: Part,
        data: &Value,
        left: &mut u64,
    ) -> Result<Option<String>, TemplateError> {
        let name = key(request.name, locale, part);
        let failed = |reason: String| TemplateError::Render {
            name: request.name.to_string(),
            locale: locale.to_string(),
            part: part.as_str(),
            reason,
        };
        if let Some(reason) = self.broken.get(&name) {
            return Err(failed(reason.clone()));
        }
        let Ok(template) = self.env.get_template(&name) else {
            return Ok(None); // the template has no such part
        };
        let mut out = Bounded {
            buf: Vec::new(),
            left: *left,
            over: false,
        };
        let result = template.render_captured_to(data.clone(), &mut out);
        if out.over {
            return Err(TemplateError::TooLarge {
                name: request.name.to_string(),
                locale: locale.to_string(),
                max: request.max_output,
            });
        }
        if let Err(e) = result {
            return Err(failed(describe(&e)));
        }
        *left = out.left;
        // minijinja writes only text it holds as UTF-8.
        Ok(Some(
            String::from_utf8(out.buf).map_err(|e| failed(e.to_string()))?,
        ))
    }
}

/// The environment every catalog starts from: strict about undefined
/// variables, HTML escaped in HTML parts only, bounded, and without a
/// loader (so that nothing outside the table can be reached).
fn new_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    env.set_auto_escape_callback(|name| match name.ends_with("\0html") {
        true => AutoEscape::Html,
        false => AutoEscape::None,
    });
    env.set_fuel(Some(FUEL));
    env.set_recursion_limit(RECURSION_LIMIT);
    env
}

/// What `{% include "footer" %}` in a part of a template names: the same
/// part of the template `footer` in the including template's locale or the
/// first fallback that has that part. A name no template has stays as it
/// is, and is not found.
fn resolve<'s>(
    known: &std::collections::HashSet<String>,
    included: &'s str,
    parent: &'s str,
) -> Cow<'s, str> {
    let mut fields = parent.split('\0');
    let (Some(_), Some(locale), Some(part)) = (fields.next(), fields.next(), fields.next()) else {
        return Cow::Borrowed(included);
    };
    for l in locale_chain(locale) {
        let name = format!("{included}\0{l}\0{part}");
        if known.contains(&name) {
            return Cow::Owned(name);
        }
    }
    Cow::Borrowed(included)
}

/// An error of minijinja as one line, without the environment's names of
/// parts (the template's name and part are said by [`TemplateError`]).
fn describe(e: &minijinja::Error) -> String {
    let mut text = match e.kind() {
        ErrorKind::TemplateNotFound => {
            // "tried to include non-existing template 'NAME'"
            let detail = e.detail().unwrap_or("");
            let name = detail
                .split_once(['\'', '"'])
                .and_then(|(_, rest)| rest.rsplit_once(['\'', '"']))
                .map_or(detail, |(name, _)| name);
            let name = name.split('\0').next().unwrap_or("");
            format!("included template {name:?} does not exist")
        }
        kind => match e.detail() {
            Some(detail) => format!("{kind}: {detail}"),
            None => kind.to_string(),
        },
    };
    if let Some(line) = e.line() {
        text.push_str(&format!(" (line {line})"));
    }
    text.replace('\0', "/")
}

/// Output that fails once it would pass its limit.
struct Bounded {
    buf: Vec<u8>,
    left: u64,
    over: bool,
}

impl io::Write for Bounded {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if data.len() as u64 > self.left {
            self.over = true;
            return Err(io::Error::other("output over the limit"));
        }
        self.left -= data.len() as u64;
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The daemon's templates: the catalog, brought up to date at most once
/// per claim batch.
#[derive(Default)]
pub struct Templates {
    catalog: RwLock<Arc<Catalog>>,
    /// The last look at the table failed: a template not in the catalog
    /// may exist, and its mails wait rather than fail.
    unavailable: AtomicBool,
}

impl Templates {
    pub fn new() -> Templates {
        Templates::default()
    }

    /// The catalog as it is now (cheap: shared).
    pub fn catalog(&self) -> Arc<Catalog> {
        self.catalog.read().expect("not poisoned").clone()
    }

    /// Whether the last look at the table failed.
    pub fn unavailable(&self) -> bool {
        self.unavailable.load(Ordering::Relaxed)
    }

    /// One query of the templates' keys and `updated_at`; when any changed,
    /// the templates are read and those changed compiled again. Returns
    /// how many were compiled.
    pub async fn refresh(&self, store: &dyn Store) -> Result<usize, StoreError> {
        let result = self.look(store).await;
        self.unavailable.store(result.is_err(), Ordering::Relaxed);
        result
    }

    async fn look(&self, store: &dyn Store) -> Result<usize, StoreError> {
        let versions = store.template_versions().await?;
        if self.catalog().is_current(&versions) {
            return Ok(0);
        }
        let rows = store.templates().await?;
        let mut next = Catalog::clone(&self.catalog());
        // Compiling is CPU work: off the async threads.
        let (next, compiled) = tokio::task::spawn_blocking(move || {
            let compiled = next.update(&rows);
            (next, compiled)
        })
        .await
        .map_err(|e| StoreError::Unsupported(format!("compiling templates: {e}")))?;
        *self.catalog.write().expect("not poisoned") = Arc::new(next);
        if compiled > 0 {
            tracing::info!(compiled, "templates compiled");
        }
        Ok(compiled)
    }
}
