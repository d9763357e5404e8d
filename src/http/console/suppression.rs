//! The suppression list (DESIGN §12): the entries in force in address
//! order, 50 a page, searched by a part of the address and by reason, read
//! live on the snapshot's connection; and the removal of an address, for a
//! logged-in operator.
//!
//! Only a logged-in operator sees an address in full. Anyone else sees
//! `***@domain`, and no link of the page holds an address of the list: the
//! next page's link carries the last address sealed ([`Cursors`]), not as
//! text. The search is the visitor's own text and works either way.

use base64::Engine as _;
use ring::{
    aead,
    rand::{SecureRandom, SystemRandom},
};

use super::*;

/// The reasons the form offers, as `mail_suppression.reason` holds them.
const REASONS: [&str; 4] = ["hard_bounce", "soft_bounce", "complaint", "manual"];

/// What starts a sealed `after`. A plain address may start with it too
/// (`~` is an address character): only a value that opens is taken as
/// sealed.
const SEALED: char = '~';

/// Seals the page links' keyset cursor (the last address of a page) with a
/// key of this process: the link works, and shows nothing of the address.
/// A restart makes the old links stale, as it ends the sessions.
pub(super) struct Cursors {
    key: aead::LessSafeKey,
    random: SystemRandom,
}

impl Cursors {
    pub(super) fn new() -> Cursors {
        let random = SystemRandom::new();
        let mut bytes = [0u8; 32];
        random.fill(&mut bytes).expect("the system's random source");
        let key = aead::UnboundKey::new(&aead::AES_256_GCM, &bytes).expect("a 256-bit key");
        Cursors {
            key: aead::LessSafeKey::new(key),
            random,
        }
    }

    /// `~` and, in URL-safe base64, a random nonce, the address encrypted
    /// and the tag.
    fn seal(&self, address: &str) -> String {
        let mut nonce = [0u8; aead::NONCE_LEN];
        self.random
            .fill(&mut nonce)
            .expect("the system's random source");
        let mut sealed = address.as_bytes().to_vec();
        self.key
            .seal_in_place_append_tag(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::empty(),
                &mut sealed,
            )
            .expect("an address is far below AES-GCM's limit");
        let mut bytes = nonce.to_vec();
        bytes.extend_from_slice(&sealed);
        let text = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        format!("{SEALED}{text}")
    }

    /// The address `text` sealed, if this process sealed it.
    fn open(&self, text: &str) -> Option<String> {
        let text = text.strip_prefix(SEALED)?;
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(text)
            .ok()?;
        if bytes.len() < aead::NONCE_LEN {
            return None;
        }
        let (nonce, sealed) = bytes.split_at(aead::NONCE_LEN);
        let nonce = aead::Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut sealed = sealed.to_vec();
        let address = self
            .key
            .open_in_place(nonce, aead::Aad::empty(), &mut sealed)
            .ok()?;
        String::from_utf8(address.to_vec()).ok()
    }
}

/// The page's filters as the form sends them (empty fields are no filter),
/// and where the page starts.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub(super) struct ListQuery {
    /// A part of the address.
    #[serde(default, skip_serializing_if = "is_blank")]
    search: Option<String>,
    #[serde(default, skip_serializing_if = "is_blank")]
    reason: Option<String>,
    /// The last address of the page before, plain or sealed.
    #[serde(default, skip_serializing_if = "is_blank")]
    after: Option<String>,
}

impl ListQuery {
    fn filter(&self) -> Result<SuppressionFilter, String> {
        let reason = match field(&self.reason) {
            Some(r) => {
                Some(SuppressionReason::parse(&r).ok_or_else(|| format!("unknown reason {r:?}"))?)
            }
            None => None,
        };
        Ok(SuppressionFilter {
            reason,
            search: field(&self.search),
            include_expired: false,
        })
    }

    /// The page of the same filters that starts after `after`.
    fn with_after(&self, after: Option<String>) -> String {
        let query = ListQuery {
            after,
            ..self.clone()
        };
        let text = serde_urlencoded::to_string(&query).unwrap_or_default();
        if text.is_empty() {
            "/suppression".into()
        } else {
            format!("/suppression?{text}")
        }
    }
}

struct EntryView {
    /// In full for a logged-in operator, else `***@domain`.
    address: String,
    reason: String,
    created: String,
    expires: String,
    mail_id: Option<i64>,
    detail: String,
}

impl EntryView {
    fn new(e: &SuppressionEntry, logged_in: bool) -> EntryView {
        EntryView {
            address: if logged_in {
                e.address.clone()
            } else {
                masked(&e.address)
            },
            reason: e.reason.clone(),
            created: time(&e.created_at),
            expires: e
                .expires_at
                .as_ref()
                .map(time)
                .unwrap_or_else(|| "until removed".into()),
            mail_id: e.mail_id,
            detail: redacted(&e.detail),
        }
    }
}

#[derive(Template)]
#[template(path = "suppression.html", config = "src/http/askama.toml")]
struct SuppressionPage {
    layout: Layout,
    reasons: [&'static str; 4],
    /// The form's fields, as sent.
    search: String,
    reason: String,
    /// Where this page starts, as sent: the remove buttons bring the
    /// operator back here.
    after: String,
    filtered: bool,
    entries: Vec<EntryView>,
    /// Links to the first page and the next one.
    first_page: Option<String>,
    next_page: Option<String>,
    /// Logged in: addresses in full, and the remove buttons.
    logged_in: bool,
}

pub(super) async fn list(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let session = console.auth.session(&headers);
    let bad = |message: String| {
        console.message(
            StatusCode::BAD_REQUEST,
            session.as_ref(),
            "Bad filter",
            message,
        )
    };
    let Ok(Query(query)) = query else {
        return bad("the filter could not be read".into());
    };
    let filter = match query.filter() {
        Ok(filter) => filter,
        Err(e) => return bad(e),
    };
    let after = match field(&query.after) {
        None => None,
        Some(text) => match console.cursors.open(&text) {
            Some(address) => Some(address),
            // Sealed by the daemon before a restart: no address can be
            // made of it.
            None if text.starts_with(SEALED) && crate::mail::address_key(&text).is_err() => {
                return bad(
                    "the link to this page is older than the daemon: start from the first page"
                        .into(),
                )
            }
            None => Some(text),
        },
    };
    let mut found = match console
        .store
        .suppression_list(&filter, after.as_deref(), PAGE + 1)
        .await
    {
        Ok(found) => found,
        Err(e) => return console.database_error(session.as_ref(), e),
    };
    let more = found.len() > PAGE;
    found.truncate(PAGE);
    let logged_in = session.is_some();
    // The next page starts after this page's last address: as text for
    // whoever sees it here, sealed for anyone else.
    let next_page = more
        .then(|| found.last())
        .flatten()
        .map(|last| match logged_in {
            true => last.address.clone(),
            false => console.cursors.seal(&last.address),
        })
        .map(|cursor| query.with_after(Some(cursor)));
    let text = |v: &Option<String>| field(v).unwrap_or_default();
    let page = SuppressionPage {
        layout: console.layout("suppression", session.as_ref()),
        reasons: REASONS,
        search: text(&query.search),
        reason: text(&query.reason),
        after: text(&query.after),
        filtered: filter.reason.is_some() || filter.search.is_some(),
        first_page: after.is_some().then(|| query.with_after(None)),
        next_page,
        entries: found.iter().map(|e| EntryView::new(e, logged_in)).collect(),
        logged_in,
    };
    render(StatusCode::OK, page)
}

/// A remove button's form: the address, the session's CSRF token, and the
/// page to go back to.
#[derive(Debug, Default, Deserialize)]
pub(super) struct RemoveForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    address: String,
    #[serde(default)]
    search: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    after: Option<String>,
}

/// Removes an address from the list for a logged-in operator whose form
/// carries the session's CSRF token; refuses anyone else, changing nothing.
pub(super) async fn remove(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    form: Result<Form<RemoveForm>, FormRejection>,
) -> Response {
    let csrf = form.as_ref().ok().and_then(|Form(f)| f.csrf.as_deref());
    let session = match console.auth.authorize(&headers, csrf) {
        Ok(session) => session,
        Err(refusal) => return console.refused(refusal, console.auth.session(&headers).as_ref()),
    };
    let Ok(Form(form)) = form else {
        // Not reached: a form that could not be read carries no CSRF token.
        return console.refused(Refusal::Csrf, Some(&session));
    };
    let given = form.address.trim();
    if given.is_empty() {
        return console.message(
            StatusCode::BAD_REQUEST,
            Some(&session),
            "Not removed",
            "the form named no address",
        );
    }
    // The button sends the address as the list holds it; one typed by hand
    // is also looked for as the list keeps addresses (lower-cased, the
    // domain as A-labels).
    let mut addresses = vec![given.to_string()];
    if let Ok(key) = crate::mail::address_key(given) {
        if key != given {
            addresses.push(key);
        }
    }
    match console.store.unsuppress(&addresses).await {
        Ok(0) => console.message(
            StatusCode::CONFLICT,
            Some(&session),
            "Not removed",
            format!("{given} is not on the suppression list"),
        ),
        Ok(_) => {
            let domain = given
                .rsplit_once('@')
                .map(|(_, domain)| domain.to_ascii_lowercase())
                .unwrap_or_default();
            tracing::info!(domain = %domain, "console: address unsuppressed");
            let back = ListQuery {
                search: form.search,
                reason: form.reason,
                after: form.after,
            };
            Redirect::to(&back.with_after(field(&back.after))).into_response()
        }
        Err(e) => console.database_error(Some(&session), e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_open_what_they_sealed_and_show_nothing_of_it() {
        let cursors = Cursors::new();
        let sealed = cursors.seal("alice@example.org");
        assert!(sealed.starts_with(SEALED));
        assert!(!sealed.contains("alice") && !sealed.contains("example"));
        assert_eq!(cursors.open(&sealed).as_deref(), Some("alice@example.org"));
        // Sealed twice, it reads differently (a fresh nonce each time).
        assert_ne!(cursors.seal("alice@example.org"), sealed);
        // Another process's, tampered with, or no cursor at all.
        assert_eq!(Cursors::new().open(&sealed), None);
        let mut tampered = sealed.clone().into_bytes();
        let last = tampered.len() - 1;
        tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
        assert_eq!(cursors.open(&String::from_utf8(tampered).unwrap()), None);
        assert_eq!(cursors.open("~bob@example.org"), None);
        assert_eq!(cursors.open("~"), None);
        assert_eq!(cursors.open("alice@example.org"), None);
    }

    #[test]
    fn filters_are_checked_and_carried_to_the_next_page() {
        let query = ListQuery {
            search: Some(" Alice ".into()),
            reason: Some("complaint".into()),
            after: None,
        };
        let filter = query.filter().unwrap();
        assert_eq!(filter.search.as_deref(), Some("Alice"));
        assert_eq!(filter.reason, Some(SuppressionReason::Complaint));
        assert!(!filter.include_expired);
        assert_eq!(
            query.with_after(Some("alice@example.org".into())),
            "/suppression?search=+Alice+&reason=complaint&after=alice%40example.org"
        );
        let bad = ListQuery {
            reason: Some("bored".into()),
            ..ListQuery::default()
        };
        assert!(bad.filter().unwrap_err().contains("unknown reason"));
        assert_eq!(ListQuery::default().with_after(None), "/suppression");
        let blank = ListQuery {
            search: Some("  ".into()),
            ..ListQuery::default()
        };
        assert_eq!(blank.filter().unwrap().search, None);
        assert_eq!(blank.with_after(None), "/suppression");
    }
}
