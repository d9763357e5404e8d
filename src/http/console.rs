//! The operator console's pages (DESIGN §9): the overview, the failures of
//! the last hour, the mail list and a mail's page, server-rendered from
//! templates compiled in (`templates/`), HTML-escaped, working without
//! JavaScript and fetching nothing (the style and the chart are inline).
//!
//! Nothing here shows a body or a full recipient address unless a logged-in
//! operator asks for it on a mail's page: recipients appear as their domains,
//! and replies, errors, subjects and dedupe keys have the local part of
//! every address in them replaced by `***`.

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
    smtp::Role,
    store::{
        AttachmentInfo, MailFilter, MailLookup, MailRecord, MailSummary, RetrySelection, Store,
    },
    telemetry::redact_addresses,
    worker::outcome::failure_label,
};

/// Mails per page of the list.
const PAGE: usize = 50;
/// Fresh attempts a retried mail gets (as `tablemail retry`).
const RETRY_ATTEMPTS: i32 = 5;
/// The statuses a row can have, in the order the pages list them.
const STATUSES: [&str; 6] = [
    "queued",
    "sending",
    "sent",
    "failed",
    "unknown",
    "cancelled",
];
/// Outcomes of the history that ended a mail (the rest put it off).
const FINAL_OUTCOMES: [&str; 3] = ["failed", "unknown", "stale"];

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
        })
    }
}

/// The console's routes, without a fallback (the caller adds one).
pub fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(overview))
        .route("/failures", get(failures))
        .route("/mails", get(mails))
        .route("/mails/{id}", get(mail))
        .route("/mails/{id}/retry", post(retry))
        .route("/mails/{id}/cancel", post(cancel))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
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

// ----- the overview -----

struct CountRow {
    status: &'static str,
    count: i64,
}

struct DaemonView {
    host: String,
    pid: i32,
    version: String,
    started: String,
    last_seen: String,
    in_flight: i32,
    sent: i64,
    silent: bool,
}

struct GroupView {
    label: String,
    outcome: String,
    count: i64,
    example: String,
    /// It ended mails (failed, unknown, stale), rather than put them off.
    final_outcome: bool,
}

struct FailureView {
    id: i64,
    status: String,
    at: String,
    error: String,
}

#[derive(Template)]
#[template(path = "overview.html", config = "src/http/askama.toml")]
struct OverviewPage {
    layout: Layout,
    healthy: bool,
    health: Vec<String>,
    database_ok: bool,
    database_error: String,
    /// `read 3s ago`, or empty before the first answer.
    figures_age: String,
    has_figures: bool,
    counts: Vec<CountRow>,
    total: i64,
    oldest_due: String,
    stale_locks: i64,
    rates: [String; 3],
    relay_trouble: Option<String>,
    relay_active: &'static str,
    has_fallback: bool,
    redirect: Option<String>,
    file_transport: bool,
    chart: Chart,
    daemons: Vec<DaemonView>,
    groups: Vec<GroupView>,
    recent: Vec<FailureView>,
}

fn group_views(snapshot: &Snapshot) -> Vec<GroupView> {
    let Some(figures) = &snapshot.figures else {
        return Vec::new();
    };
    figures
        .failures
        .iter()
        .map(|g| GroupView {
            label: failure_label(g.stage.as_deref(), g.smtp_code),
            outcome: g.outcome.clone(),
            count: g.count,
            example: redacted(&g.example),
            final_outcome: FINAL_OUTCOMES.contains(&g.outcome.as_str()),
        })
        .collect()
}

async fn overview(State(console): State<Arc<Console>>, headers: HeaderMap) -> Response {
    let session = console.auth.session(&headers);
    let observed = &console.observed;
    let snapshot = observed.snapshots.latest().await;
    let database_ok = snapshot.database_ok();
    let (healthy, health) = crate::metrics::health(&observed.metrics, database_ok);
    let figures = snapshot.figures.clone();
    let stats = figures
        .as_ref()
        .map(|f| f.stats.clone())
        .unwrap_or_default();
    let counts: Vec<CountRow> = STATUSES
        .iter()
        .map(|status| CountRow {
            status,
            count: stats.count(status),
        })
        .collect();
    let transport = &observed.transport;
    let page = OverviewPage {
        layout: console.layout("overview", session.as_ref()),
        healthy,
        health: health.lines().map(str::to_string).collect(),
        database_ok,
        database_error: snapshot.error.clone().unwrap_or_default(),
        figures_age: snapshot
            .age()
            .map(|a| age(a.as_secs_f64()))
            .unwrap_or_default(),
        has_figures: figures.is_some(),
        total: counts.iter().map(|c| c.count).sum(),
        counts,
        oldest_due: match stats.oldest_due_age_seconds {
            Some(seconds) => age(seconds),
            None => "nothing due".into(),
        },
        stale_locks: stats.stale_locks,
        rates: [
            format!("{:.1}", stats.sent_last_1m as f64 / 60.0),
            format!("{:.1}", stats.sent_last_5m as f64 / 300.0),
            format!("{:.1}", stats.sent_last_15m as f64 / 900.0),
        ],
        relay_trouble: observed
            .metrics
            .relay_trouble()
            .map(|t| redact_addresses(&t)),
        relay_active: match transport.active() {
            Role::Primary => "primary",
            Role::Fallback => "fallback",
        },
        has_fallback: transport.has_fallback(),
        redirect: transport
            .redirected_to()
            .map(|to| redact_addresses(to.as_ref())),
        file_transport: transport.outbox().is_some(),
        chart: match &figures {
            Some(f) => chart::per_minute(&f.minutes, f.read_at, CHART_MINUTES),
            None => chart::per_minute(&[], Utc::now(), CHART_MINUTES),
        },
        daemons: figures
            .as_ref()
            .map(|f| {
                f.daemons
                    .iter()
                    .map(|d| DaemonView {
                        host: d.host.clone(),
                        pid: d.pid,
                        version: d.version.clone(),
                        started: time(&d.started_at),
                        last_seen: time(&d.last_seen),
                        in_flight: d.in_flight,
                        sent: d.sent,
                        silent: d.silent,
                    })
                    .collect()
            })
            .unwrap_or_default(),
        groups: group_views(&snapshot).into_iter().take(8).collect(),
        recent: stats
            .recent_failures
            .iter()
            .map(|f| FailureView {
                id: f.id,
                status: f.status.clone(),
                at: optional_time(&f.processed_at),
                error: redacted(&f.last_error),
            })
            .collect(),
    };
    render(StatusCode::OK, page)
}

// ----- failures -----

#[derive(Template)]
#[template(path = "failures.html", config = "src/http/askama.toml")]
struct FailuresPage {
    layout: Layout,
    has_figures: bool,
    figures_age: String,
    ended: Vec<GroupView>,
    put_off: Vec<GroupView>,
}

async fn failures(State(console): State<Arc<Console>>, headers: HeaderMap) -> Response {
    let session = console.auth.session(&headers);
    let snapshot = console.observed.snapshots.latest().await;
    let (ended, put_off) = group_views(&snapshot)
        .into_iter()
        .partition(|g| g.final_outcome);
    let page = FailuresPage {
        layout: console.layout("failures", session.as_ref()),
        has_figures: snapshot.figures.is_some(),
        figures_age: snapshot
            .age()
            .map(|a| age(a.as_secs_f64()))
            .unwrap_or_default(),
        ended,
        put_off,
    };
    render(StatusCode::OK, page)
}

// ----- the mail list -----

/// The list's filters as the form sends them (empty fields are no filter).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
struct ListQuery {
    #[serde(default, skip_serializing_if = "is_blank")]
    status: Option<String>,
    #[serde(default, skip_serializing_if = "is_blank")]
    domain: Option<String>,
    #[serde(default, skip_serializing_if = "is_blank")]
    id: Option<String>,
    #[serde(default, skip_serializing_if = "is_blank")]
    message_id: Option<String>,
    #[serde(default, skip_serializing_if = "is_blank")]
    dedupe_key: Option<String>,
    #[serde(default, skip_serializing_if = "is_blank")]
    before_id: Option<String>,
}

fn is_blank(value: &Option<String>) -> bool {
    value.as_deref().is_none_or(|v| v.trim().is_empty())
}

fn field(value: &Option<String>) -> Option<String> {
    value
        .as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_string)
}

impl ListQuery {
    fn filter(&self) -> Result<MailFilter, String> {
        let number = |name: &str, value: &Option<String>| {
            field(value)
                .map(|v| {
                    v.parse::<i64>()
                        .map_err(|_| format!("{name} must be a number, not {v:?}"))
                })
                .transpose()
        };
        let status = field(&self.status);
        if let Some(s) = &status {
            if !STATUSES.contains(&s.as_str()) {
                return Err(format!("unknown status {s:?}"));
            }
        }
        Ok(MailFilter {
            status,
            domain: field(&self.domain).map(|d| d.trim_start_matches('@').to_ascii_lowercase()),
            id: number("id", &self.id)?,
            message_id: field(&self.message_id),
            dedupe_key: field(&self.dedupe_key),
            before_id: number("before_id", &self.before_id)?,
        })
    }

    /// The query string of the same filters on another page.
    fn with_before(&self, before_id: Option<i64>) -> String {
        let mut query = self.clone();
        query.before_id = before_id.map(|id| id.to_string());
        let text = serde_urlencoded::to_string(&query).unwrap_or_default();
        if text.is_empty() {
            "/mails".into()
        } else {
            format!("/mails?{text}")
        }
    }
}

struct SummaryView {
    id: i64,
    status: String,
    priority: i32,
    attempts: i32,
    created: String,
    send_at: String,
    processed: String,
    domains: String,
    subject: String,
    error: String,
}

impl From<&MailSummary> for SummaryView {
    fn from(m: &MailSummary) -> Self {
        SummaryView {
            id: m.id,
            status: m.status.clone(),
            priority: m.priority,
            attempts: m.attempts,
            created: time(&m.created_at),
            send_at: time(&m.send_at),
            processed: optional_time(&m.processed_at),
            domains: m.domains.clone(),
            subject: redact_addresses(&m.subject),
            error: redacted(&m.last_error),
        }
    }
}

#[derive(Template)]
#[template(path = "mails.html", config = "src/http/askama.toml")]
struct MailsPage {
    layout: Layout,
    statuses: [&'static str; 6],
    /// The form's fields, as sent.
    status: String,
    domain: String,
    id: String,
    message_id: String,
    dedupe_key: String,
    filtered: bool,
    mails: Vec<SummaryView>,
    /// Links to the first page and the next (older) one.
    first_page: Option<String>,
    next_page: Option<String>,
}

async fn mails(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let session = console.auth.session(&headers);
    let Ok(Query(query)) = query else {
        return console.message(
            StatusCode::BAD_REQUEST,
            session.as_ref(),
            "Bad filter",
            "the filter could not be read",
        );
    };
    let filter = match query.filter() {
        Ok(filter) => filter,
        Err(e) => {
            return console.message(StatusCode::BAD_REQUEST, session.as_ref(), "Bad filter", e)
        }
    };
    let mut found = match console.store.list_mails(&filter, PAGE + 1).await {
        Ok(found) => found,
        Err(e) => return console.database_error(session.as_ref(), e),
    };
    let more = found.len() > PAGE;
    found.truncate(PAGE);
    let text = |v: &Option<String>| field(v).unwrap_or_default();
    let page = MailsPage {
        layout: console.layout("mails", session.as_ref()),
        statuses: STATUSES,
        status: text(&query.status),
        domain: text(&query.domain),
        id: text(&query.id),
        message_id: text(&query.message_id),
        dedupe_key: text(&query.dedupe_key),
        filtered: filter.status.is_some()
            || filter.domain.is_some()
            || filter.id.is_some()
            || filter.message_id.is_some()
            || filter.dedupe_key.is_some(),
        first_page: filter.before_id.map(|_| query.with_before(None)),
        next_page: more
            .then(|| found.last().map(|m| query.with_before(Some(m.id))))
            .flatten(),
        mails: found.iter().map(SummaryView::from).collect(),
    };
    render(StatusCode::OK, page)
}

// ----- one mail -----

struct EventView {
    at: String,
    attempt: i32,
    outcome: String,
    stage: String,
    code: String,
    detail: String,
}

struct ContentView {
    from: String,
    to: String,
    cc: String,
    bcc: String,
    reply_to: String,
    headers: String,
    body: Option<String>,
    body_html: Option<String>,
}

#[derive(Template)]
#[template(path = "mail.html", config = "src/http/askama.toml")]
struct MailPage {
    layout: Layout,
    id: i64,
    status: String,
    subject: String,
    priority: i32,
    attempts: i32,
    attempts_remaining: i32,
    created: String,
    send_at: String,
    processed: String,
    retried: Option<String>,
    message_id: String,
    dedupe_key: String,
    relay_reply: String,
    last_error: String,
    attachments: Vec<AttachmentInfo>,
    events: Vec<EventView>,
    content: Option<ContentView>,
    /// Logged in: the actions and the content can be had.
    logged_in: bool,
    can_retry: bool,
    can_cancel: bool,
}

#[derive(Debug, Default, Deserialize)]
struct MailQuery {
    /// `1`: show the sender, recipients, headers and bodies.
    #[serde(default)]
    content: Option<String>,
}

impl MailPage {
    fn new(layout: Layout, r: MailRecord, logged_in: bool) -> MailPage {
        // Without the content, what may carry an address shows its domain.
        let shown = |text: &Option<String>| match &r.content {
            Some(_) => text.clone().unwrap_or_default(),
            None => redacted(text),
        };
        let content = r.content.as_ref().map(|c| ContentView {
            from: format!(
                "{} {}",
                c.from_name.as_deref().unwrap_or(""),
                c.from_address
                    .as_deref()
                    .unwrap_or("(defaults.from_address)")
            )
            .trim()
            .to_string(),
            to: c.to_address.clone(),
            cc: c.cc.clone().unwrap_or_default(),
            bcc: c.bcc.clone().unwrap_or_default(),
            reply_to: c.reply_to.clone().unwrap_or_default(),
            headers: c.headers.clone().unwrap_or_default(),
            body: c.body.clone(),
            body_html: c.body_html.clone(),
        });
        MailPage {
            layout,
            id: r.id,
            subject: match &r.content {
                Some(_) => r.subject.clone(),
                None => redact_addresses(&r.subject),
            },
            priority: r.priority,
            attempts: r.attempts,
            attempts_remaining: r.attempts_remaining,
            created: time(&r.created_at),
            send_at: time(&r.send_at),
            processed: optional_time(&r.processed_at),
            retried: r.retried_at.as_ref().map(time),
            message_id: r.message_id.clone().unwrap_or_default(),
            dedupe_key: shown(&r.dedupe_key),
            relay_reply: shown(&r.relay_reply),
            last_error: shown(&r.last_error),
            events: r
                .events
                .iter()
                .map(|e| EventView {
                    at: time(&e.at),
                    attempt: e.attempt,
                    outcome: e.outcome.clone(),
                    stage: e.stage.clone().unwrap_or_default(),
                    code: e.smtp_code.map(|c| c.to_string()).unwrap_or_default(),
                    detail: shown(&e.detail),
                })
                .collect(),
            attachments: r.attachments.clone(),
            content,
            logged_in,
            can_retry: logged_in && matches!(r.status.as_str(), "failed" | "unknown"),
            can_cancel: logged_in && r.status == "queued",
            status: r.status,
        }
    }
}

async fn mail(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(query): Query<MailQuery>,
) -> Response {
    let session = console.auth.session(&headers);
    let Ok(id) = id.parse::<i64>() else {
        return console.message(
            StatusCode::NOT_FOUND,
            session.as_ref(),
            "No such mail",
            format!("{id:?} is not a mail's id"),
        );
    };
    let content = query.content.as_deref() == Some("1");
    if content && session.is_none() {
        let refusal = if console.auth.enabled() {
            Refusal::NotLoggedIn
        } else {
            Refusal::ReadOnly
        };
        return console.refused(refusal, None);
    }
    let record = match console.store.find_mail(&MailLookup::Id(id), content).await {
        Ok(Some(record)) => record,
        Ok(None) => {
            return console.message(
                StatusCode::NOT_FOUND,
                session.as_ref(),
                "No such mail",
                format!("there is no mail {id}"),
            )
        }
        Err(e) => return console.database_error(session.as_ref(), e),
    };
    let page = MailPage::new(
        console.layout("mails", session.as_ref()),
        record,
        session.is_some(),
    );
    render(StatusCode::OK, page)
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

async fn retry(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    let session = match console.auth.authorize(&headers, csrf_of(&form)) {
        Ok(session) => session,
        Err(refusal) => return console.refused(refusal, console.auth.session(&headers).as_ref()),
    };
    match console
        .store
        .retry(RetrySelection::Id(id), RETRY_ATTEMPTS)
        .await
    {
        Ok(0) => console.message(
            StatusCode::CONFLICT,
            Some(&session),
            "Not retried",
            format!("mail {id} is not failed or unknown"),
        ),
        Ok(_) => {
            tracing::info!(mail_id = id, "console: mail retried");
            Redirect::to(&format!("/mails/{id}")).into_response()
        }
        Err(e) => console.database_error(Some(&session), e),
    }
}

async fn cancel(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    let session = match console.auth.authorize(&headers, csrf_of(&form)) {
        Ok(session) => session,
        Err(refusal) => return console.refused(refusal, console.auth.session(&headers).as_ref()),
    };
    match console.store.cancel(id).await {
        Ok(0) => console.message(
            StatusCode::CONFLICT,
            Some(&session),
            "Not cancelled",
            format!("mail {id} is not queued"),
        ),
        Ok(_) => {
            tracing::info!(mail_id = id, "console: mail cancelled");
            Redirect::to(&format!("/mails/{id}")).into_response()
        }
        Err(e) => console.database_error(Some(&session), e),
    }
}

// ----- login -----

#[derive(Template)]
#[template(path = "login.html", config = "src/http/askama.toml")]
struct LoginPage {
    layout: Layout,
    next: String,
    wrong: bool,
}

#[derive(Debug, Default, Deserialize)]
struct LoginQuery {
    #[serde(default)]
    next: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
    #[serde(default)]
    next: Option<String>,
}

/// Where to go after logging in: a path of this console, nothing else.
fn local_path(next: Option<&str>) -> String {
    match next {
        Some(p)
            if p.starts_with('/') && !p.starts_with("//") && !p.contains(['\\', '\r', '\n']) =>
        {
            p.to_string()
        }
        _ => "/".into(),
    }
}

async fn login_page(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    Query(query): Query<LoginQuery>,
) -> Response {
    let session = console.auth.session(&headers);
    if !console.auth.enabled() {
        return console.refused(Refusal::ReadOnly, None);
    }
    let page = LoginPage {
        layout: console.layout("login", session.as_ref()),
        next: local_path(query.next.as_deref()),
        wrong: false,
    };
    render(StatusCode::OK, page)
}

async fn login(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    form: Result<Form<LoginForm>, FormRejection>,
) -> Response {
    let form = form.map(|Form(f)| f).unwrap_or_default();
    let next = local_path(form.next.as_deref());
    match console.auth.login(&form.token) {
        Ok(id) => {
            tracing::info!("console: operator logged in");
            let mut response = Redirect::to(&next).into_response();
            if let Ok(cookie) = HeaderValue::from_str(&auth::set_cookie(&id)) {
                response.headers_mut().insert(header::SET_COOKIE, cookie);
            }
            response
        }
        Err(Refusal::ReadOnly) => console.refused(Refusal::ReadOnly, None),
        Err(_) => {
            tracing::warn!("console: login refused (wrong token)");
            tokio::time::sleep(auth::WRONG_TOKEN_DELAY).await;
            let session = console.auth.session(&headers);
            let page = LoginPage {
                layout: console.layout("login", session.as_ref()),
                next,
                wrong: true,
            };
            render(StatusCode::FORBIDDEN, page)
        }
    }
}

async fn logout(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    if let Err(refusal) = console.auth.authorize(&headers, csrf_of(&form)) {
        return console.refused(refusal, console.auth.session(&headers).as_ref());
    }
    console.auth.logout(&headers);
    let mut response = Redirect::to("/").into_response();
    if let Ok(cookie) = HeaderValue::from_str(&auth::clear_cookie()) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
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
    fn logins_only_lead_back_into_the_console() {
        assert_eq!(local_path(Some("/mails/7")), "/mails/7");
        for elsewhere in [
            "//evil.example/",
            "https://evil.example/",
            "/\\evil.example",
            "mails",
            "",
        ] {
            assert_eq!(local_path(Some(elsewhere)), "/", "{elsewhere}");
        }
        assert_eq!(local_path(None), "/");
    }

    #[test]
    fn list_filters_are_checked_and_carried_to_the_next_page() {
        let query = ListQuery {
            status: Some("failed".into()),
            domain: Some(" @Example.COM ".into()),
            id: Some(String::new()),
            ..ListQuery::default()
        };
        let filter = query.filter().unwrap();
        assert_eq!(filter.status.as_deref(), Some("failed"));
        assert_eq!(filter.domain.as_deref(), Some("example.com"));
        assert_eq!(filter.id, None);
        assert_eq!(
            query.with_before(Some(42)),
            "/mails?status=failed&domain=+%40Example.COM+&before_id=42"
        );
        let bad = ListQuery {
            status: Some("lost".into()),
            ..ListQuery::default()
        };
        assert!(bad.filter().is_err());
        let bad = ListQuery {
            id: Some("7; DROP".into()),
            ..ListQuery::default()
        };
        assert!(bad.filter().unwrap_err().contains("id must be a number"));
        assert_eq!(ListQuery::default().with_before(None), "/mails");
    }
}
