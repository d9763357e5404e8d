//! The templates in the database (DESIGN §15), read-only: the list, and one
//! template with its parts and a preview rendered with data the visitor
//! types in (nothing of a mail is shown). Read live on the snapshot's
//! connection; the preview renders off the async threads, bounded like the
//! daemon's.

use crate::templates::{self, Catalog};

use super::*;

/// Most octets of the preview, the parts together.
const PREVIEW_LIMIT: u64 = 1 << 20;

/// The page of a template in a locale: the name as a path segment, every
/// octet but the unreserved ones percent-encoded.
fn link(name: &str, locale: &str) -> String {
    let mut path = String::from("/templates/");
    for b in name.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                path.push(b as char)
            }
            _ => path.push_str(&format!("%{b:02X}")),
        }
    }
    if !locale.is_empty() {
        let query = serde_urlencoded::to_string([("locale", locale)]).unwrap_or_default();
        path.push('?');
        path.push_str(&query);
    }
    path
}

struct TemplateLine {
    href: String,
    name: String,
    locale: String,
    updated: String,
    parts: String,
}

#[derive(Template)]
#[template(path = "templates.html", config = "src/http/askama.toml")]
struct TemplatesPage {
    layout: Layout,
    templates: Vec<TemplateLine>,
}

pub(super) async fn list(State(console): State<Arc<Console>>, headers: HeaderMap) -> Response {
    let session = console.auth.session(&headers);
    let rows = match console.store.templates().await {
        Ok(rows) => rows,
        Err(e) => return console.database_error(session.as_ref(), e),
    };
    let templates = rows
        .iter()
        .map(|t| TemplateLine {
            href: link(&t.name, &t.locale),
            name: t.name.clone(),
            locale: t.locale.clone(),
            updated: time(&t.updated_at),
            parts: [
                ("subject", !t.subject.is_empty()),
                ("text", t.body.is_some()),
                ("html", t.body_html.is_some()),
            ]
            .iter()
            .filter(|(_, has)| *has)
            .map(|(part, _)| *part)
            .collect::<Vec<_>>()
            .join(", "),
        })
        .collect();
    let page = TemplatesPage {
        layout: console.layout("templates", session.as_ref()),
        templates,
    };
    render(StatusCode::OK, page)
}

/// The template's locale and the preview's data, as the form sends them.
#[derive(Debug, Default, Deserialize)]
pub(super) struct PreviewQuery {
    #[serde(default)]
    locale: Option<String>,
    #[serde(default)]
    data: Option<String>,
}

#[derive(Template)]
#[template(path = "template.html", config = "src/http/askama.toml")]
struct TemplatePage {
    layout: Layout,
    /// This page, without a query.
    action: String,
    name: String,
    /// As asked for, and as found.
    locale: String,
    found: String,
    updated: String,
    subject: String,
    text: Option<String>,
    html: Option<String>,
    data: String,
    preview: Result<templates::Rendered, String>,
}

pub(super) async fn template(
    State(console): State<Arc<Console>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    query: Result<Query<PreviewQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let session = console.auth.session(&headers);
    let query = query.map(|Query(q)| q).unwrap_or_default();
    let rows = match console.store.templates().await {
        Ok(rows) => rows,
        Err(e) => return console.database_error(session.as_ref(), e),
    };
    let locale = query.locale.unwrap_or_default().trim().to_string();
    let Some(found) = templates::pick(&rows, &name, &locale).cloned() else {
        return console.message(
            StatusCode::NOT_FOUND,
            session.as_ref(),
            "No such template",
            format!("There is no template {name:?} for locale {locale:?} or its fallback."),
        );
    };
    let data = query.data.unwrap_or_else(|| "{}".into());
    let (preview_name, preview_locale, preview_data) = (name.clone(), locale.clone(), data.clone());
    let preview = tokio::task::spawn_blocking(move || {
        Catalog::from_rows(&rows)
            .render(&templates::Request {
                name: &preview_name,
                locale: Some(&preview_locale),
                data: Some(&preview_data),
                subject: true,
                text: true,
                html: true,
                max_output: PREVIEW_LIMIT,
            })
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|e| Err(format!("the preview did not render: {e}")));
    let page = TemplatePage {
        layout: console.layout("templates", session.as_ref()),
        action: link(&name, ""),
        name,
        locale,
        found: found.locale.clone(),
        updated: time(&found.updated_at),
        subject: found.subject,
        text: found.body,
        html: found.body_html,
        data,
        preview,
    };
    render(StatusCode::OK, page)
}
