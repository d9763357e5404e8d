//! Reports from providers that answer by webhook (DESIGN §14): Amazon SES
//! through SNS, Postmark, Mailgun and SendGrid. Each endpoint verifies its
//! request first (a signature, or HTTP basic credentials), then puts each
//! event in the terms of a mail report ([`parse::Report`]) and hands it to
//! the [`Recorder`], so a webhook's event follows the correlation and the
//! proof rule of every other report, under the provider's event id so that
//! a provider's retry is recorded once.
//!
//! The listener is its own (`webhooks.listen`), meant to face the internet:
//! at most [`limit::MAX_CONNECTIONS`](crate::http::limit::MAX_CONNECTIONS)
//! connections of a minute each, bodies up to `webhooks.max_body_size`,
//! `webhooks.rate_limit` requests a second from one address, and every
//! request within `webhooks.timeout`. A request that fails verification is
//! answered 401 or 403, records nothing and logs one line without its
//! payload.
//!
//! - [`ses`]: SNS envelopes and SES notifications; [`sns`]: the signing
//!   certificate, fetched, chained to a trusted root and cached.
//! - [`postmark`], [`mailgun`], [`sendgrid`]: one file per provider.
//! - `rate`: the per-address token bucket.

pub mod mailgun;
pub mod postmark;
mod rate;
pub mod sendgrid;
pub mod ses;
pub mod sns;

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use axum::{
    body::Bytes,
    extract::{connect_info::Connected, ConnectInfo, DefaultBodyLimit, Request, State},
    http::{header, HeaderMap, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
    Router,
};
use secrecy::SecretString;
use tokio_util::sync::CancellationToken;

use super::{
    parse::{self, Report},
    record::Recorder,
};
use crate::store::FeedbackSource;

/// `webhooks.max_body_size` unless set: SendGrid posts events in batches.
pub const DEFAULT_MAX_BODY_SIZE: usize = 256 * 1024;
/// `webhooks.rate_limit` unless set: requests a second from one address.
pub const DEFAULT_RATE_LIMIT: u32 = 20;
/// `webhooks.timeout` unless set.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Shortest password or signing key accepted from a file.
pub const MIN_SECRET_LEN: usize = 16;
/// Longest event id a provider may give (the key is kept in an index).
const MAX_EVENT_ID: usize = 200;
/// Longest status and diagnostic kept from an event, in characters.
const MAX_STATUS: usize = 32;
const MAX_DIAGNOSTIC: usize = 1000;

/// Every provider's key; a provider without one has no endpoint.
#[derive(Debug, Clone, Default)]
pub struct Keys {
    /// The SNS topics SES notifications may come from; empty: no endpoint.
    pub ses_topics: Vec<String>,
    pub postmark: Option<PostmarkCredentials>,
    pub mailgun: Option<SecretString>,
    pub sendgrid: Option<sendgrid::PublicKey>,
}

impl Keys {
    /// The providers with an endpoint.
    pub fn providers(&self) -> Vec<&'static str> {
        let mut on = Vec::new();
        if !self.ses_topics.is_empty() {
            on.push("ses");
        }
        if self.postmark.is_some() {
            on.push("postmark");
        }
        if self.mailgun.is_some() {
            on.push("mailgun");
        }
        if self.sendgrid.is_some() {
            on.push("sendgrid");
        }
        on
    }
}

/// Postmark's HTTP basic credentials.
#[derive(Debug, Clone)]
pub struct PostmarkCredentials {
    pub user: String,
    pub password: SecretString,
}

/// The listener's bounds (`webhooks.*`).
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub max_body_size: usize,
    /// Requests a second from one address; 0: no limit.
    pub rate_limit: u32,
    pub timeout: Duration,
}

/// One event of a verified request, in the terms of a mail report.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// `provider:id`, the provider's own id of the event.
    pub key: String,
    pub report: Report,
}

/// Why a request is refused; the reason is logged, never the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No credentials, or the wrong ones (401).
    Unauthorized(&'static str),
    /// A signature that does not verify, or a sender not accepted (403).
    Forbidden(&'static str),
    /// Verified, or never verifiable, but not readable (400).
    BadRequest(&'static str),
    /// Cannot be verified now (the signing certificate could not be
    /// fetched): the provider should try again (503).
    Unavailable(&'static str),
}

impl Refusal {
    fn status(self) -> StatusCode {
        match self {
            Refusal::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Refusal::Forbidden(_) => StatusCode::FORBIDDEN,
            Refusal::BadRequest(_) => StatusCode::BAD_REQUEST,
            Refusal::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn reason(self) -> &'static str {
        match self {
            Refusal::Unauthorized(r)
            | Refusal::Forbidden(r)
            | Refusal::BadRequest(r)
            | Refusal::Unavailable(r) => r,
        }
    }
}

/// What the endpoints share.
struct Hooks {
    recorder: Recorder,
    keys: Keys,
    ses: Option<ses::Ses>,
    mailgun_tokens: mailgun::Tokens,
}

/// Binds `listen` and serves the endpoints of the providers in `keys`
/// until `cancel`.
pub async fn start(
    listen: &str,
    options: Options,
    keys: Keys,
    recorder: Recorder,
    cancel: CancellationToken,
) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("webhooks.listen {listen}: {e}"))?;
    let local = listener
        .local_addr()
        .map_err(|e| format!("webhooks.listen {listen}: {e}"))?;
    let ses = (!keys.ses_topics.is_empty())
        .then(|| ses::Ses::new(keys.ses_topics.clone(), sns::Trust::aws()));
    let providers = keys.providers();
    let hooks = Arc::new(Hooks {
        recorder,
        keys,
        ses,
        mailgun_tokens: mailgun::Tokens::default(),
    });
    let mut router = Router::new();
    for provider in &providers {
        router = match *provider {
            "ses" => router.route("/webhooks/ses", post(ses_hook)),
            "postmark" => router.route("/webhooks/postmark", post(postmark_hook)),
            "mailgun" => router.route("/webhooks/mailgun", post(mailgun_hook)),
            _ => router.route("/webhooks/sendgrid", post(sendgrid_hook)),
        };
    }
    let limiter = Arc::new(rate::Limiter::new(options.rate_limit));
    let router = router
        .with_state(hooks)
        .layer(DefaultBodyLimit::max(options.max_body_size))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(limiter, rate_limited))
        .layer(middleware::from_fn_with_state(options.timeout, timed));
    tracing::info!(
        listen = %local,
        providers = providers.join(","),
        "webhook listener started"
    );
    let listener = crate::http::limit::Limited::new(listener);
    tokio::spawn(async move {
        let serving = axum::serve(
            listener,
            router.into_make_service_with_connect_info::<Peer>(),
        )
        .with_graceful_shutdown(cancel.cancelled_owned());
        if let Err(e) = serving.await {
            tracing::warn!(error = %e, "webhooks: serving stopped");
        }
    });
    Ok(local)
}

/// The client's address, as the bounded listener accepted it.
#[derive(Debug, Clone, Copy)]
struct Peer(SocketAddr);

impl Connected<axum::serve::IncomingStream<'_, crate::http::limit::Limited>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, crate::http::limit::Limited>) -> Peer {
        Peer(*stream.remote_addr())
    }
}

async fn not_found() -> Response {
    plain(StatusCode::NOT_FOUND, "not found\n")
}

fn plain(status: StatusCode, body: &'static str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

/// Each request within `webhooks.timeout`, its body read and its report
/// recorded; past it, 503 (the provider tries again, and an event kept
/// meanwhile is not kept twice).
async fn timed(State(limit): State<Duration>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!(limit_ms = limit.as_millis() as u64, "webhook timed out");
            plain(StatusCode::SERVICE_UNAVAILABLE, "timed out\n")
        }
    }
}

/// `webhooks.rate_limit` requests a second from one address: 429 past it.
async fn rate_limited(
    State(limiter): State<Arc<rate::Limiter>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    request: Request,
    next: Next,
) -> Response {
    if !limiter.allow(peer.ip()) {
        let mut response = plain(StatusCode::TOO_MANY_REQUESTS, "too many requests\n");
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return response;
    }
    next.run(request).await
}

fn refused(provider: &'static str, peer: IpAddr, refusal: Refusal) -> Response {
    tracing::warn!(
        provider,
        peer = %peer,
        status = refusal.status().as_u16(),
        reason = refusal.reason(),
        "webhook refused"
    );
    let body = match refusal {
        Refusal::Unauthorized(_) => "unauthorized\n",
        Refusal::Forbidden(_) => "forbidden\n",
        Refusal::BadRequest(_) => "bad request\n",
        Refusal::Unavailable(_) => "try again later\n",
    };
    let mut response = plain(refusal.status(), body);
    if let Refusal::Unauthorized(_) = refusal {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Basic realm=\"tablemail webhooks\""),
        );
    }
    response
}

/// Records the events of a verified request, each under its key: 200 once
/// all are kept (or were kept before), 503 while the database is away.
async fn record(
    hooks: &Hooks,
    provider: &'static str,
    events: Vec<Event>,
    body: &[u8],
) -> Response {
    let count = events.len();
    let mut repeated = 0;
    for event in events {
        match hooks
            .recorder
            .record_report(
                &event.report,
                body,
                FeedbackSource::Webhook,
                Some(event.key),
            )
            .await
        {
            Ok((verdict, recorded)) => {
                if recorded.repeated.len() == verdict.items.len() {
                    repeated += 1;
                }
            }
            Err(e) => {
                tracing::error!(
                    provider,
                    error = %e,
                    "webhook report not recorded: the provider is told to try again"
                );
                return plain(StatusCode::SERVICE_UNAVAILABLE, "try again later\n");
            }
        }
    }
    tracing::info!(provider, events = count, repeated, "webhook received");
    plain(StatusCode::OK, "ok\n")
}

async fn ses_hook(
    State(hooks): State<Arc<Hooks>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    body: Bytes,
) -> Response {
    let Some(ses) = &hooks.ses else {
        return not_found().await;
    };
    match ses.read(&body).await {
        Ok(ses::Outcome::Events(events)) => record(&hooks, "ses", events, &body).await,
        Ok(ses::Outcome::Done) => plain(StatusCode::OK, "ok\n"),
        Err(refusal) => refused("ses", peer.ip(), refusal),
    }
}

async fn postmark_hook(
    State(hooks): State<Arc<Hooks>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(credentials) = &hooks.keys.postmark else {
        return not_found().await;
    };
    match postmark::read(credentials, &headers, &body) {
        Ok(events) => record(&hooks, "postmark", events, &body).await,
        Err(refusal) => refused("postmark", peer.ip(), refusal),
    }
}

async fn mailgun_hook(
    State(hooks): State<Arc<Hooks>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    body: Bytes,
) -> Response {
    let Some(key) = &hooks.keys.mailgun else {
        return not_found().await;
    };
    match mailgun::read(key, &hooks.mailgun_tokens, &body, mailgun::now()) {
        Ok(events) => record(&hooks, "mailgun", events, &body).await,
        Err(refusal) => refused("mailgun", peer.ip(), refusal),
    }
}

async fn sendgrid_hook(
    State(hooks): State<Arc<Hooks>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(key) = &hooks.keys.sendgrid else {
        return not_found().await;
    };
    match sendgrid::read(key, &headers, &body) {
        Ok(events) => record(&hooks, "sendgrid", events, &body).await,
        Err(refusal) => refused("sendgrid", peer.ip(), refusal),
    }
}

// ---------------------------------------------------------------------------
// Shared by the providers: an event in the terms of a mail report.

/// A report of one provider's event about `items`, found by the provider's
/// message id (`queue_id`, kept from the relay's reply to ".") or the
/// Message-ID (`message_id`, with or without its angle brackets), with the
/// envelope sender where the provider gives it (a VERP address).
pub(crate) fn report(
    provider: &'static str,
    items: Vec<parse::Item>,
    queue_id: Option<&str>,
    message_id: Option<&str>,
    envelope_sender: Option<&str>,
) -> Report {
    Report {
        form: parse::Form::Webhook(provider),
        items,
        original_message_id: message_id.and_then(bracketed),
        relay_queue_ids: queue_id
            .map(str::trim)
            .filter(|q| !q.is_empty() && q.len() <= 255)
            .map(|q| vec![q.to_string()])
            .unwrap_or_default(),
        addressed_to: Vec::new(),
        from: None,
        original_sender: envelope_sender
            .map(|s| s.trim().trim_matches(['<', '>']).to_ascii_lowercase())
            .filter(|s| s.contains('@') && s.len() <= 320),
    }
}

/// What an event says of one recipient, bounded as a parsed report's item.
pub(crate) fn item(
    recipient: Option<&str>,
    kind: parse::Kind,
    status: Option<&str>,
    diagnostic: Option<&str>,
) -> parse::Item {
    let clean = |text: &str, max: usize| -> Option<String> {
        let text: String = text
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .take(max)
            .collect();
        let text = text.trim();
        (!text.is_empty()).then(|| text.to_string())
    };
    parse::Item {
        recipient: recipient
            .map(|r| r.trim().trim_matches(['<', '>']).to_ascii_lowercase())
            .filter(|r| r.contains('@') && r.len() <= 320),
        kind,
        status: status.and_then(|s| clean(s, MAX_STATUS)),
        diagnostic: diagnostic.and_then(|d| clean(d, MAX_DIAGNOSTIC)),
    }
}

/// `provider:id`, or a refusal for an id that is missing or too long.
pub(crate) fn event_key(provider: &'static str, id: Option<&str>) -> Result<String, Refusal> {
    match id.map(str::trim) {
        Some(id) if !id.is_empty() && id.len() <= MAX_EVENT_ID => Ok(format!("{provider}:{id}")),
        _ => Err(Refusal::BadRequest("an event without a usable id")),
    }
}

/// `<id@domain>` from a Message-ID given with or without its brackets.
fn bracketed(message_id: &str) -> Option<String> {
    let inner = message_id
        .trim()
        .trim_start_matches('<')
        .trim_end_matches('>');
    let valid = inner.contains('@')
        && inner.len() <= 250
        && inner
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'<' && b != b'>');
    valid.then(|| format!("<{inner}>"))
}

/// Compares two secrets in constant time (in their length, which is not
/// secret).
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_get_their_brackets() {
        assert_eq!(
            bracketed("20130503182626.18666.16540@mail.example").as_deref(),
            Some("<20130503182626.18666.16540@mail.example>")
        );
        assert_eq!(bracketed("<a.7@host>").as_deref(), Some("<a.7@host>"));
        assert_eq!(bracketed("no-at-sign"), None);
        assert_eq!(bracketed("<a b@host>"), None);
    }

    #[test]
    fn event_keys_are_bounded() {
        assert_eq!(event_key("ses", Some("abc")), Ok("ses:abc".to_string()));
        assert!(event_key("ses", None).is_err());
        assert!(event_key("ses", Some(" ")).is_err());
        assert!(event_key("ses", Some(&"x".repeat(201))).is_err());
    }

    #[test]
    fn items_are_cleaned_and_bounded() {
        let i = item(
            Some(" <Dora@Example.COM> "),
            parse::Kind::HardBounce,
            Some("5.1.1"),
            Some(&format!("550\r\nuser unknown{}", "x".repeat(2000))),
        );
        assert_eq!(i.recipient.as_deref(), Some("dora@example.com"));
        assert_eq!(
            i.diagnostic.as_ref().unwrap().chars().count(),
            MAX_DIAGNOSTIC
        );
        assert!(!i.diagnostic.unwrap().contains('\r'));
        assert_eq!(
            item(Some("nobody"), parse::Kind::Unknown, None, None).recipient,
            None
        );
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same(b"secret", b"secret"));
        assert!(!same(b"secret", b"secreT"));
        assert!(!same(b"secret", b"secret2"));
    }
}
