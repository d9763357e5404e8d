//! The operator console's pages (DESIGN §9, §12, §15): the overview, the failures
//! of the last hour, the mail list, a mail's page and the suppression list,
//! server-rendered from templates compiled in (`templates/`), HTML-escaped,
//! working without JavaScript and fetching nothing (the style and the chart
//! are inline).
//!
//! Nothing here shows a body or a full recipient address unless a logged-in
//! operator asks for it on a mail's page (or opens the suppression list):
//! recipients appear as their domains, and replies, errors, subjects and
//! dedupe keys have the local part of every address in them replaced by
//! `***`.
//!
//! - `overview`: the overview and the failures, from the snapshot.
//! - `mails`: the list, a mail's page, and its retry and cancel buttons.
//! - `suppression`: the suppression list, searched, and removal from it.
//! - `templates`: the templates, and one with a rendered preview (§15).
//! - `login`: logging in and out.

mod login;
mod mails;
mod overview;
mod suppression;
mod templates;

use std::sync::Arc;

use askama::Template;
use axum::{
    extract::{rejection::FormRejection, Path, Query, Request, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    middleware::{self, Next},
    response::{Html, IntoResponse, Redirect, Response},
    routing::{get, post},
    Form, Router,
};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{
    auth::{self, Auth, Refusal, Session},
    chart::{self, Chart},
    snapshot::{Snapshot, CHART_MINUTES},
    Observed,
};
use crate::{
    smtp::{failure_label, Role},
    store::{
        AttachmentInfo, FeedbackKind, FeedbackSource, MailFilter, MailLookup, MailRecord,
        MailSummary, RetrySelection, Store, SuppressionEntry, SuppressionFilter, SuppressionReason,
        RETRY_ATTEMPTS, STATUSES,
    },
    telemetry::redact_addresses,
};

/// Mails per page of the list.
const PAGE: usize = 50;

/// Every page of the console is answered with these: no script, no frame,
/// nothing fetched, forms only to the console itself, not kept in caches.
const CONTENT_SECURITY_POLICY: &str =
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'self'; \
     frame-ancestors 'none'; base-uri 'none'";

pub struct Console {
    observed: Arc<Observed>,
    /// The snapshot's pool (one connection): the list and a mail's page
    /// queue behind its refresh, never behind the claims.
    store: Arc<dyn Store>,
    auth: Auth,
    /// Seals the suppression list's page links for those who may not see
    /// its addresses.
    cursors: suppression::Cursors,
}

impl Console {
    pub fn new(
        observed: Arc<Observed>,
        store: Arc<dyn Store>,
        token: Option<&secrecy::SecretString>,
    ) -> Arc<Console> {
        Arc::new(Console {
            observed,
            store,
            auth: Auth::new(token),
            cursors: suppression::Cursors::new(),
        })
    }
}

/// The console's routes, without a fallback (the caller adds one).
pub fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(overview::overview))
        .route("/failures", get(overview::failures))
        .route("/mails", get(mails::list))
        .route("/mails/{id}", get(mails::mail))
        .route("/mails/{id}/retry", post(mails::retry))
        .route("/mails/{id}/cancel", post(mails::cancel))
        .route("/suppression", get(suppression::list))
        .route("/suppression/remove", post(suppression::remove))
        .route("/templates", get(templates::list))
        .route("/templates/{name}", get(templates::template))
        .route("/login", get(login::login_page).post(login::login))
        .route("/logout", post(login::logout))
        .layer(middleware::from_fn(page_headers))
        .with_state(console)
}

async fn page_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        // Not `no-referrer`: under it a browser sends `Origin: null` with
        // the console's own forms, and the origin check refuses them.
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// What every page's frame shows.
struct Layout {
    /// The navigation entry of this page.
    nav: &'static str,
    /// Logged in: the session's CSRF token, for the logout form.
    csrf: Option<String>,
    /// A token is configured: logging in is possible.
    can_login: bool,
    backend: String,
    version: &'static str,
}

impl Console {
    fn layout(&self, nav: &'static str, session: Option<&Session>) -> Layout {
        Layout {
            nav,
            csrf: session.map(|s| s.csrf.clone()),
            can_login: self.auth.enabled(),
            backend: self.store.backend().to_string(),
            version: env!("CARGO_PKG_VERSION"),
        }
    }
}

fn render(status: StatusCode, page: impl Template) -> Response {
    match page.render() {
        Ok(html) => (status, Html(html)).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "console: a page did not render");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the page did not render\n",
            )
                .into_response()
        }
    }
}

#[derive(Template)]
#[template(path = "message.html", config = "src/http/askama.toml")]
struct MessagePage {
    layout: Layout,
    title: String,
    message: String,
    /// Offer the login form's link.
    login: bool,
}

impl Console {
    fn message(
        &self,
        status: StatusCode,
        session: Option<&Session>,
        title: &str,
        message: impl Into<String>,
    ) -> Response {
        let login = session.is_none()
            && self.auth.enabled()
            && matches!(status, StatusCode::FORBIDDEN | StatusCode::UNAUTHORIZED);
        render(
            status,
            MessagePage {
                layout: self.layout("", session),
                title: title.to_string(),
                message: message.into(),
                login,
            },
        )
    }

    fn refused(&self, refusal: Refusal, session: Option<&Session>) -> Response {
        self.message(StatusCode::FORBIDDEN, session, "Refused", refusal.explain())
    }

    fn database_error(&self, session: Option<&Session>, e: impl std::fmt::Display) -> Response {
        tracing::warn!(error = %redact_addresses(&e.to_string()), "console: database");
        self.message(
            StatusCode::SERVICE_UNAVAILABLE,
            session,
            "Database unavailable",
            redact_addresses(&e.to_string()),
        )
    }
}

/// A button's form: the session's CSRF token.
#[derive(Debug, Default, Deserialize)]
struct ActionForm {
    #[serde(default)]
    csrf: Option<String>,
}

/// The CSRF token a form carried, if it could be read at all.
fn csrf_of(form: &Result<Form<ActionForm>, FormRejection>) -> Option<&str> {
    form.as_ref().ok().and_then(|Form(f)| f.csrf.as_deref())
}

/// A filter's field left empty (or only spaces): no filter, and left out of
/// the links to other pages.
fn is_blank(value: &Option<String>) -> bool {
    value.as_deref().is_none_or(|v| v.trim().is_empty())
}

/// A filter's field, trimmed; `None` when blank.
fn field(value: &Option<String>) -> Option<String> {
    value
        .as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_string)
}

// ----- formatting -----

fn time(t: &DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

fn optional_time(t: &Option<DateTime<Utc>>) -> String {
    t.as_ref().map(time).unwrap_or_else(|| "–".into())
}

/// `3h 4m`, `4m 10s`, `12s`: the two largest units.
fn age(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    let (d, h, m, sec) = (s / 86400, s / 3600 % 24, s / 60 % 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{sec}s"),
        (0, 0, _) => format!("{m}m {sec}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

fn redacted(text: &Option<String>) -> String {
    text.as_deref().map(redact_addresses).unwrap_or_default()
}

/// One bare address as those who may not see it do: `***@example.org`
/// (the domain after the last `@`, as a quoted local part may hold one).
fn masked(address: &str) -> String {
    match address.rsplit_once('@') {
        Some((_, domain)) => format!("***@{domain}"),
        None => "***".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_in_two_units() {
        assert_eq!(age(0.4), "0s");
        assert_eq!(age(59.0), "59s");
        assert_eq!(age(250.0), "4m 10s");
        assert_eq!(age(3.0 * 3600.0 + 240.0), "3h 4m");
        assert_eq!(age(2.0 * 86400.0 + 3600.0), "2d 1h");
        assert_eq!(age(-5.0), "0s");
    }

    #[test]
    fn masked_addresses_keep_only_the_domain() {
        assert_eq!(masked("alice@example.org"), "***@example.org");
        assert_eq!(masked("\"a@b\"@example.org"), "***@example.org");
        assert_eq!(masked("no-at-sign"), "***");
    }
}
