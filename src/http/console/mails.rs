//! The mail list with its filters and pages, a mail's page (what `tablemail
//! show` prints; the content only for a logged-in operator who asks), and its
//! retry and cancel buttons. Read live, on the snapshot's connection.

use super::*;

/// The list's filters as the form sends them (empty fields are no filter).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub(super) struct ListQuery {
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
    statuses: [&'static str; 8],
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

pub(super) async fn list(
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

struct EventView {
    at: String,
    attempt: i32,
    outcome: String,
    stage: String,
    code: String,
    /// The recipient a report or the suppression list spoke of; `***@domain`
    /// unless the content was asked for.
    recipient: String,
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
    bounced: Option<String>,
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
pub(super) struct MailQuery {
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
            bounced: r.bounced_at.as_ref().map(time),
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
                    recipient: match (&r.content, &e.recipient) {
                        (_, None) => String::new(),
                        (Some(_), Some(address)) => address.clone(),
                        (None, Some(address)) => masked(address),
                    },
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

pub(super) async fn mail(
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

pub(super) async fn retry(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    act(&console, &headers, id, &form, Action::Retry).await
}

pub(super) async fn cancel(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    act(&console, &headers, id, &form, Action::Cancel).await
}

/// What an operator's POST does to a mail.
#[derive(Debug, Clone, Copy)]
enum Action {
    /// failed or unknown -> queued, with fresh attempts.
    Retry,
    /// queued -> cancelled.
    Cancel,
}

/// Does `action` to mail `id` for a logged-in operator whose form carries
/// the session's CSRF token; refuses anyone else, changing nothing.
async fn act(
    console: &Console,
    headers: &HeaderMap,
    id: i64,
    form: &Result<Form<ActionForm>, FormRejection>,
    action: Action,
) -> Response {
    let session = match console.auth.authorize(headers, csrf_of(form)) {
        Ok(session) => session,
        Err(refusal) => return console.refused(refusal, console.auth.session(headers).as_ref()),
    };
    let done = match action {
        Action::Retry => {
            console
                .store
                .retry(RetrySelection::Id(id), RETRY_ATTEMPTS)
                .await
        }
        Action::Cancel => console.store.cancel(id).await,
    };
    let (title, not_now) = match action {
        Action::Retry => ("Not retried", "is not failed or unknown"),
        Action::Cancel => ("Not cancelled", "is not queued"),
    };
    match done {
        Ok(0) => console.message(
            StatusCode::CONFLICT,
            Some(&session),
            title,
            format!("mail {id} {not_now}"),
        ),
        Ok(_) => {
            match action {
                Action::Retry => tracing::info!(mail_id = id, "console: mail retried"),
                Action::Cancel => tracing::info!(mail_id = id, "console: mail cancelled"),
            }
            Redirect::to(&format!("/mails/{id}")).into_response()
        }
        Err(e) => console.database_error(Some(&session), e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
