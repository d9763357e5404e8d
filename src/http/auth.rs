//! Who may press the console's buttons (retry, cancel, removal from the
//! suppression list). Without a token the console is read-only: nothing that
//! changes a row is served. With one, an operator logs in once (the token,
//! compared in constant time), gets a random session id in an `HttpOnly`,
//! `SameSite=Strict` cookie and a per-session CSRF token that every form
//! carries back; a POST without both, or from another origin, is refused and
//! changes nothing. Sessions live in memory: a restart logs everyone out.

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use axum::http::{header, HeaderMap};
use ring::{digest, rand::SecureRandom};
use secrecy::{ExposeSecret, SecretString};
use subtle::ConstantTimeEq;

/// The session cookie's name.
pub const COOKIE: &str = "tablemail_session";
/// A session unused for this long ends.
const IDLE: Duration = Duration::from_secs(30 * 60);
/// A session ends this long after the login, used or not.
const LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// A wrong token is answered this late: guessing is slow.
pub const WRONG_TOKEN_DELAY: Duration = Duration::from_millis(500);

/// Why a request that would change something was refused (403).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No token is configured: the console is read-only.
    ReadOnly,
    /// No session, or an expired one.
    NotLoggedIn,
    /// The form's CSRF token is missing or wrong.
    Csrf,
    /// The request came from a page of another origin.
    Origin,
}

impl Refusal {
    pub fn explain(self) -> &'static str {
        match self {
            Refusal::ReadOnly => {
                "the console is read-only: set console.token_file to allow retry, cancel and \
                 removal from the suppression list"
            }
            Refusal::NotLoggedIn => "log in first (or again: the session ended)",
            Refusal::Csrf => "the form's CSRF token is missing or wrong: reload the page",
            Refusal::Origin => "the request came from another site",
        }
    }
}

/// A logged-in operator's session, as a page needs it.
#[derive(Debug, Clone)]
pub struct Session {
    /// Every form of the session carries it back.
    pub csrf: String,
}

#[derive(Debug)]
struct Stored {
    csrf: String,
    started: Instant,
    used: Instant,
}

/// The token's digest and the open sessions.
pub struct Auth {
    /// SHA-256 of the token: compared in constant time, and of one length
    /// whatever is offered.
    token: Option<digest::Digest>,
    sessions: Mutex<HashMap<String, Stored>>,
    random: ring::rand::SystemRandom,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("enabled", &self.enabled())
            .finish_non_exhaustive()
    }
}

impl Auth {
    pub fn new(token: Option<&SecretString>) -> Auth {
        Auth {
            token: token.map(|t| digest::digest(&digest::SHA256, t.expose_secret().as_bytes())),
            sessions: Mutex::default(),
            random: ring::rand::SystemRandom::new(),
        }
    }

    /// Retry, cancel and removal can be unlocked (a token is configured).
    pub fn enabled(&self) -> bool {
        self.token.is_some()
    }

    /// A new session id when `offered` is the token.
    pub fn login(&self, offered: &str) -> Result<String, Refusal> {
        let Some(token) = &self.token else {
            return Err(Refusal::ReadOnly);
        };
        let offered = digest::digest(&digest::SHA256, offered.as_bytes());
        if !bool::from(offered.as_ref().ct_eq(token.as_ref())) {
            return Err(Refusal::NotLoggedIn);
        }
        let (id, csrf) = (self.random_hex(), self.random_hex());
        let now = Instant::now();
        let mut sessions = self.sessions.lock().unwrap();
        sessions.retain(|_, s| live(s, now));
        sessions.insert(
            id.clone(),
            Stored {
                csrf,
                started: now,
                used: now,
            },
        );
        Ok(id)
    }

    /// The session the request's cookie names, if it is open.
    pub fn session(&self, headers: &HeaderMap) -> Option<Session> {
        let id = session_cookie(headers)?;
        let now = Instant::now();
        let mut sessions = self.sessions.lock().unwrap();
        let stored = sessions.get_mut(id)?;
        if !live(stored, now) {
            sessions.remove(id);
            return None;
        }
        stored.used = now;
        Some(Session {
            csrf: stored.csrf.clone(),
        })
    }

    /// Whether a POST may change something: an open session, the session's
    /// CSRF token in the form, and no foreign `Origin`.
    pub fn authorize(&self, headers: &HeaderMap, csrf: Option<&str>) -> Result<Session, Refusal> {
        if !self.enabled() {
            return Err(Refusal::ReadOnly);
        }
        if !same_origin(headers) {
            return Err(Refusal::Origin);
        }
        let session = self.session(headers).ok_or(Refusal::NotLoggedIn)?;
        let offered = csrf.unwrap_or("");
        if !bool::from(offered.as_bytes().ct_eq(session.csrf.as_bytes())) {
            return Err(Refusal::Csrf);
        }
        Ok(session)
    }

    /// Ends the request's session.
    pub fn logout(&self, headers: &HeaderMap) {
        if let Some(id) = session_cookie(headers) {
            self.sessions.lock().unwrap().remove(id);
        }
    }

    /// 32 random bytes as hex.
    fn random_hex(&self) -> String {
        let mut bytes = [0u8; 32];
        self.random
            .fill(&mut bytes)
            .expect("the system's random source");
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}

fn live(stored: &Stored, now: Instant) -> bool {
    now.duration_since(stored.used) <= IDLE && now.duration_since(stored.started) <= LIFETIME
}

/// The `Set-Cookie` value that opens a session.
pub fn set_cookie(id: &str) -> String {
    format!(
        "{COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}",
        LIFETIME.as_secs()
    )
}

/// The `Set-Cookie` value that forgets the session.
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0")
}

fn session_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value)
        .filter(|v| !v.is_empty())
}

/// A browser says where a form was posted from: it must be this console
/// (`Origin`'s host and port are the `Host` the request was sent to). A
/// request without `Origin` (an older browser, curl) relies on the cookie's
/// `SameSite=Strict` and the CSRF token.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return true;
    };
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let origin = origin.to_str().ok().and_then(|o| o.split_once("://"));
    matches!((origin, host), (Some((_, authority)), Some(host)) if authority == host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with_cookie(id: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!("theme=dark; {COOKIE}={id}")).unwrap(),
        );
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:9899"));
        headers
    }

    #[test]
    fn without_a_token_nothing_unlocks() {
        let auth = Auth::new(None);
        assert!(!auth.enabled());
        assert_eq!(auth.login(""), Err(Refusal::ReadOnly));
        assert_eq!(
            auth.authorize(&HeaderMap::new(), Some("x")).unwrap_err(),
            Refusal::ReadOnly
        );
    }

    #[test]
    fn a_post_needs_the_session_and_its_csrf_token() {
        let token = SecretString::from("correct horse battery staple");
        let auth = Auth::new(Some(&token));
        assert_eq!(auth.login("correct horse"), Err(Refusal::NotLoggedIn));
        assert_eq!(auth.login(""), Err(Refusal::NotLoggedIn));
        let id = auth.login("correct horse battery staple").unwrap();
        assert_eq!(id.len(), 64);
        let headers = with_cookie(&id);
        let csrf = auth.session(&headers).unwrap().csrf;
        assert_ne!(csrf, id);
        assert!(auth.authorize(&headers, Some(&csrf)).is_ok());
        assert_eq!(auth.authorize(&headers, None).unwrap_err(), Refusal::Csrf);
        assert_eq!(
            auth.authorize(&headers, Some(&csrf[1..])).unwrap_err(),
            Refusal::Csrf
        );
        assert_eq!(
            auth.authorize(&with_cookie("forged"), Some(&csrf))
                .unwrap_err(),
            Refusal::NotLoggedIn
        );
        let mut foreign = headers.clone();
        foreign.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://evil.example"),
        );
        assert_eq!(
            auth.authorize(&foreign, Some(&csrf)).unwrap_err(),
            Refusal::Origin
        );
        let mut own = headers.clone();
        own.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:9899"),
        );
        assert!(auth.authorize(&own, Some(&csrf)).is_ok());
        auth.logout(&headers);
        assert_eq!(
            auth.authorize(&headers, Some(&csrf)).unwrap_err(),
            Refusal::NotLoggedIn
        );
    }
}
