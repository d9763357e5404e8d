//! Logging in with the operator token, and out.

use super::*;

#[derive(Template)]
#[template(path = "login.html", config = "src/http/askama.toml")]
struct LoginPage {
    layout: Layout,
    next: String,
    wrong: bool,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct LoginQuery {
    #[serde(default)]
    next: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct LoginForm {
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

pub(super) async fn login_page(
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

pub(super) async fn login(
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

pub(super) async fn logout(
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
}
