//! OAuth2 tokens for SASL XOAUTH2 (DESIGN §13), for relays that no longer
//! take passwords: Microsoft 365 (client credentials), Google Workspace (a
//! service account's JWT assertion, signed RS256 with ring, acting for a
//! mailbox) or any secret manager (a command that prints a token).
//!
//! A token is fetched at start and renewed in the background before it
//! expires, never on the send path: a session takes the current token or,
//! when there is none, fails its AUTH without a word on the wire (a
//! configuration fault: mail waits unspent). A relay that rejects a token
//! makes the renewal run at once, once per token. A token is a secret: it is
//! never logged, printed or shown.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use base64::Engine as _;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use tokio::{sync::Notify, time::Instant};
use tokio_rustls::rustls;
use tokio_util::sync::CancellationToken;

/// Microsoft's scope for SMTP AUTH with client credentials.
pub const MICROSOFT_SCOPE: &str = "https://outlook.office365.com/.default";
/// Google's scope for SMTP with XOAUTH2.
pub const GOOGLE_SCOPE: &str = "https://mail.google.com/";
/// How long a token from a command that says nothing of its lifetime is
/// used before it is asked for again.
const COMMAND_LIFETIME: Duration = Duration::from_secs(300);
/// The longest a fetch may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest lifetime a token is believed to have: an endpoint or a
/// command that says more (by mistake or on purpose) is renewed at least this
/// often, and its expiry stays a time the clock can hold.
const MAX_LIFETIME_S: u64 = 24 * 3600;
/// The largest answer read from a token endpoint or a command.
const MAX_ANSWER: usize = 64 * 1024;

/// Where tokens come from.
#[derive(Clone)]
pub enum Provider {
    /// Microsoft identity platform, client credentials.
    Microsoft {
        tenant_id: String,
        client_id: String,
        client_secret: SecretString,
    },
    /// A Google service account acting for `subject`.
    Google {
        client_email: String,
        private_key: Arc<ring::signature::RsaKeyPair>,
        subject: String,
        /// The service account file's `token_uri`.
        token_uri: String,
    },
    /// A command run by `/bin/sh -c` that prints a token and, optionally,
    /// its lifetime in seconds.
    Command { command: String },
}

impl std::fmt::Debug for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never a secret.
        f.write_str(self.name())
    }
}

impl Provider {
    pub fn name(&self) -> &'static str {
        match self {
            Provider::Microsoft { .. } => "microsoft",
            Provider::Google { .. } => "google",
            Provider::Command { .. } => "command",
        }
    }

    /// The token endpoint this provider uses unless `token_url` says
    /// otherwise.
    fn default_token_url(&self) -> Option<String> {
        match self {
            Provider::Microsoft { tenant_id, .. } => Some(format!(
                "https://login.microsoftonline.com/{tenant_id}/oauth2/v2.0/token"
            )),
            Provider::Google { token_uri, .. } => Some(token_uri.clone()),
            Provider::Command { .. } => None,
        }
    }
}

/// A Google service account file: the keys tablemail reads.
#[derive(Deserialize)]
pub struct ServiceAccount {
    pub client_email: String,
    pub private_key: String,
    #[serde(default = "google_token_uri")]
    pub token_uri: String,
}

fn google_token_uri() -> String {
    "https://oauth2.googleapis.com/token".into()
}

impl ServiceAccount {
    /// The RSA key of the account, from its PEM (PKCS#8).
    pub fn key(&self) -> Result<ring::signature::RsaKeyPair, String> {
        let body: String = self
            .private_key
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        let der = base64::engine::general_purpose::STANDARD
            .decode(body.trim())
            .map_err(|e| format!("private_key is not PEM: {e}"))?;
        ring::signature::RsaKeyPair::from_pkcs8(&der)
            .map_err(|e| format!("private_key is not an RSA key in PKCS#8: {e}"))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("token endpoint: {0}")]
    Endpoint(String),
    #[error("token endpoint refused: HTTP {status}: {error}")]
    Refused { status: u16, error: String },
    #[error("token command: {0}")]
    Command(String),
    #[error("no token yet: {0}")]
    Missing(String),
}

/// A token and when it stops being good.
#[derive(Clone)]
struct Token {
    secret: SecretString,
    expires: Instant,
    lifetime: Duration,
}

/// The tokens of one relay: the current one, renewed in the background.
pub struct Tokens {
    provider: Provider,
    /// The XOAUTH2 `user=`: the mailbox that sends.
    user: String,
    token_url: Option<String>,
    http: reqwest::Client,
    current: Mutex<Option<Token>>,
    /// Why the last fetch failed, while no good token is at hand.
    trouble: Mutex<Option<String>>,
    /// Renew now (a relay rejected the token).
    renew: Notify,
    /// The token a relay rejected, so that one rejection renews once.
    rejected: Mutex<Option<String>>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field("provider", &self.provider)
            .field("user", &self.user)
            .finish()
    }
}

impl Tokens {
    pub fn new(
        provider: Provider,
        user: String,
        token_url: Option<String>,
    ) -> Result<Tokens, String> {
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(client_tls()?)
            .timeout(FETCH_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Tokens {
            token_url: token_url.or_else(|| provider.default_token_url()),
            provider,
            user,
            http,
            current: Mutex::new(None),
            trouble: Mutex::new(None),
            renew: Notify::new(),
            rejected: Mutex::new(None),
        })
    }

    pub fn provider(&self) -> &'static str {
        self.provider.name()
    }

    pub fn user(&self) -> &str {
        &self.user
    }

    /// The token to send now, while it is good; otherwise why there is
    /// none.
    pub fn current(&self) -> Result<SecretString, TokenError> {
        let current = self.current.lock().unwrap();
        match current.as_ref() {
            Some(t) if t.expires > Instant::now() => Ok(t.secret.clone()),
            _ => Err(TokenError::Missing(
                self.trouble
                    .lock()
                    .unwrap()
                    .clone()
                    .unwrap_or_else(|| "not fetched yet".into()),
            )),
        }
    }

    /// A relay rejected `token`: renew at once, once for that token.
    pub fn rejected(&self, token: &SecretString) {
        let mut rejected = self.rejected.lock().unwrap();
        if rejected.as_deref() == Some(token.expose_secret()) {
            return;
        }
        *rejected = Some(token.expose_secret().to_string());
        self.renew.notify_one();
    }

    /// Fetches a token now and keeps it; returns its lifetime.
    pub async fn fetch(&self) -> Result<Duration, TokenError> {
        match self.request().await {
            Ok(token) => {
                let lifetime = token.lifetime;
                *self.current.lock().unwrap() = Some(token);
                *self.trouble.lock().unwrap() = None;
                Ok(lifetime)
            }
            Err(e) => {
                *self.trouble.lock().unwrap() = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// Keeps a good token at hand until `cancel` fires: renewed when a
    /// quarter of its lifetime is left (half of it for short-lived
    /// tokens), at once when a relay rejected it, and after a failure again
    /// with backoff (1 s doubling to a minute).
    pub fn spawn_renewal(self: Arc<Self>, cancel: CancellationToken) {
        tokio::spawn(async move {
            let mut failures = 0u32;
            // The token fetched at start is renewed on its own schedule, not
            // asked for again at once.
            let mut scheduled = self.renewal_due();
            loop {
                let fetched = match scheduled.take() {
                    Some(wait) => Ok(wait),
                    None => self.fetch().await.map(renew_after),
                };
                let wait = match fetched {
                    Ok(wait) => {
                        failures = 0;
                        wait
                    }
                    Err(e) => {
                        failures += 1;
                        let pause = Duration::from_secs(1 << (failures - 1).min(6))
                            .min(Duration::from_secs(60));
                        tracing::error!(
                            provider = self.provider.name(),
                            error = %e,
                            retry_in_ms = pause.as_millis() as u64,
                            "oauth2 token not renewed"
                        );
                        pause
                    }
                };
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                    _ = self.renew.notified() => {
                        tracing::warn!(
                            provider = self.provider.name(),
                            "oauth2 token rejected by the relay: renewing"
                        );
                    }
                }
            }
        });
    }

    /// How long until the token at hand is due for renewal; `None` when
    /// there is no good one.
    fn renewal_due(&self) -> Option<Duration> {
        let current = self.current.lock().unwrap();
        let token = current.as_ref().filter(|t| t.expires > Instant::now())?;
        let fetched = token.expires.checked_sub(token.lifetime)?;
        Some((fetched + renew_after(token.lifetime)).saturating_duration_since(Instant::now()))
    }

    async fn request(&self) -> Result<Token, TokenError> {
        match &self.provider {
            Provider::Command { command } => run_command(command).await,
            Provider::Microsoft {
                client_id,
                client_secret,
                ..
            } => {
                let form = [
                    ("grant_type", "client_credentials"),
                    ("client_id", client_id.as_str()),
                    ("client_secret", client_secret.expose_secret()),
                    ("scope", MICROSOFT_SCOPE),
                ];
                self.post(&form).await
            }
            Provider::Google {
                client_email,
                private_key,
                subject,
                token_uri,
            } => {
                let audience = self.token_url.as_deref().unwrap_or(token_uri);
                let assertion = google_assertion(
                    client_email,
                    subject,
                    audience,
                    private_key,
                    SystemTime::now(),
                )?;
                let form = [
                    ("grant_type", "urn:ietf:params:oauth:grant-type:jwt-bearer"),
                    ("assertion", assertion.as_str()),
                ];
                self.post(&form).await
            }
        }
    }

    /// POSTs a form to the token endpoint; reads `access_token` and
    /// `expires_in` from its JSON answer.
    async fn post(&self, form: &[(&str, &str)]) -> Result<Token, TokenError> {
        let url = self
            .token_url
            .as_deref()
            .expect("a provider with an endpoint");
        let started = Instant::now();
        let response = self
            .http
            .post(url)
            .form(form)
            .send()
            .await
            .map_err(|e| TokenError::Endpoint(without_url(&e)))?;
        let status = response.status();
        let body = read_limited(response).await?;
        #[derive(Deserialize)]
        struct Answer {
            access_token: Option<String>,
            expires_in: Option<serde_json::Value>,
            error: Option<String>,
            error_description: Option<String>,
        }
        let answer: Answer = serde_json::from_slice(&body).map_err(|e| {
            TokenError::Endpoint(format!("HTTP {}: not a token answer: {e}", status.as_u16()))
        })?;
        match (status.is_success(), answer.access_token) {
            (true, Some(token)) if !token.is_empty() => {
                let seconds = match answer.expires_in {
                    Some(serde_json::Value::Number(n)) => n.as_u64(),
                    Some(serde_json::Value::String(s)) => s.parse().ok(),
                    _ => None,
                }
                .unwrap_or(3600);
                let lifetime = Duration::from_secs(seconds.clamp(1, MAX_LIFETIME_S));
                Ok(Token {
                    secret: SecretString::from(token),
                    expires: started + lifetime,
                    lifetime,
                })
            }
            _ => Err(TokenError::Refused {
                status: status.as_u16(),
                // The endpoint's own words; never a token (there is none).
                error: [answer.error, answer.error_description]
                    .into_iter()
                    .flatten()
                    .map(|t| t.chars().take(200).collect::<String>())
                    .collect::<Vec<_>>()
                    .join(": "),
            }),
        }
    }
}

/// When to renew a token of this lifetime: a quarter of it before it ends,
/// or half of it for tokens of under two minutes.
fn renew_after(lifetime: Duration) -> Duration {
    if lifetime < Duration::from_secs(120) {
        lifetime / 2
    } else {
        lifetime - lifetime / 4
    }
}

/// A reqwest error without the URL, which may carry a tenant.
fn without_url(e: &reqwest::Error) -> String {
    let mut text = match e.url() {
        Some(url) => e.to_string().replace(url.as_str(), "the token endpoint"),
        None => e.to_string(),
    };
    if let Some(source) = std::error::Error::source(e) {
        text.push_str(&format!(": {source}"));
    }
    text
}

async fn read_limited(mut response: reqwest::Response) -> Result<Vec<u8>, TokenError> {
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| TokenError::Endpoint(without_url(&e)))?
    {
        body.extend_from_slice(&chunk);
        if body.len() > MAX_ANSWER {
            return Err(TokenError::Endpoint("answer too large".into()));
        }
    }
    Ok(body)
}

/// rustls with ring and the system's roots, as the SMTP side uses.
fn client_tls() -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        let _ = roots.add(cert);
    }
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())
        .map(|b| b.with_root_certificates(roots).with_no_client_auth())
}

/// Runs `command` with `/bin/sh -c`; its first line is `TOKEN` or `TOKEN
/// SECONDS`.
async fn run_command(command: &str) -> Result<Token, TokenError> {
    let started = Instant::now();
    let output = tokio::time::timeout(
        FETCH_TIMEOUT,
        tokio::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(command)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .map_err(|_| TokenError::Command("timed out".into()))?
    .map_err(|e| TokenError::Command(e.to_string()))?;
    if !output.status.success() {
        // Its stderr may say why; its stdout may hold a secret: never shown.
        let why: String = String::from_utf8_lossy(&output.stderr)
            .lines()
            .next()
            .unwrap_or("")
            .chars()
            .take(200)
            .collect();
        return Err(TokenError::Command(format!("{}: {why}", output.status)));
    }
    if output.stdout.len() > MAX_ANSWER {
        return Err(TokenError::Command("output too large".into()));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let mut words = text.split_whitespace();
    let token = words
        .next()
        .ok_or_else(|| TokenError::Command("printed no token".into()))?;
    let lifetime = match words.next() {
        Some(seconds) => Duration::from_secs(
            seconds
                .parse::<u64>()
                .map_err(|_| TokenError::Command("its lifetime is not a number of seconds".into()))?
                .clamp(1, MAX_LIFETIME_S),
        ),
        None => COMMAND_LIFETIME,
    };
    Ok(Token {
        secret: SecretString::from(token.to_string()),
        expires: started + lifetime,
        lifetime,
    })
}

/// A JWT assertion for Google's token endpoint: the service account
/// `client_email` acting for `subject`, for SMTP, valid for an hour.
fn google_assertion(
    client_email: &str,
    subject: &str,
    audience: &str,
    key: &ring::signature::RsaKeyPair,
    now: SystemTime,
) -> Result<String, TokenError> {
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let iat = now
        .duration_since(UNIX_EPOCH)
        .map_err(|_| TokenError::Endpoint("the clock is before 1970".into()))?
        .as_secs();
    let header = b64.encode(br#"{"alg":"RS256","typ":"JWT"}"#);
    let claims = serde_json::json!({
        "iss": client_email,
        "sub": subject,
        "scope": GOOGLE_SCOPE,
        "aud": audience,
        "iat": iat,
        "exp": iat + 3600,
    });
    let claims = b64.encode(claims.to_string());
    let signing_input = format!("{header}.{claims}");
    let mut signature = vec![0u8; key.public().modulus_len()];
    key.sign(
        &ring::signature::RSA_PKCS1_SHA256,
        &ring::rand::SystemRandom::new(),
        signing_input.as_bytes(),
        &mut signature,
    )
    .map_err(|_| TokenError::Endpoint("could not sign the assertion".into()))?;
    Ok(format!("{signing_input}.{}", b64.encode(signature)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_renewed_well_before_they_end() {
        assert_eq!(
            renew_after(Duration::from_secs(3600)),
            Duration::from_secs(2700)
        );
        assert_eq!(
            renew_after(Duration::from_secs(5)),
            Duration::from_millis(2500)
        );
    }

    #[tokio::test]
    async fn the_token_fetched_at_start_is_renewed_on_its_schedule() {
        let tokens = Tokens::new(
            Provider::Command {
                command: "echo tok-1 3600".into(),
            },
            "ann@example.com".into(),
            None,
        )
        .unwrap();
        assert_eq!(tokens.renewal_due(), None, "nothing to renew yet: fetch");
        tokens.fetch().await.unwrap();
        let due = tokens.renewal_due().expect("a token at hand");
        assert!(
            due > Duration::from_secs(2690) && due <= Duration::from_secs(2700),
            "{due:?}"
        );
    }

    #[tokio::test]
    async fn a_command_prints_a_token_and_maybe_its_lifetime() {
        let t = run_command("echo tok-123 42").await.unwrap();
        assert_eq!(t.secret.expose_secret(), "tok-123");
        assert_eq!(t.lifetime, Duration::from_secs(42));
        let t = run_command("printf 'tok-456\\n'").await.unwrap();
        assert_eq!(t.lifetime, COMMAND_LIFETIME);
        let e = run_command("echo secret-out; echo oops >&2; exit 3")
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("oops") && !e.contains("secret-out"), "{e}");
        assert!(run_command("true").await.is_err());
        // A lifetime no clock can hold is taken as a day.
        let t = run_command("echo tok 18446744073709551615").await.unwrap();
        assert_eq!(t.lifetime, Duration::from_secs(MAX_LIFETIME_S));
        assert!(run_command("echo tok x").await.is_err());
    }

    #[test]
    fn the_google_assertion_is_a_signed_jwt_for_the_mailbox() {
        // A service account file's key: PEM, PKCS#8, as Google gives it.
        let account = ServiceAccount {
            client_email: "svc@p.iam.gserviceaccount.com".into(),
            private_key: rsa_pem(),
            token_uri: google_token_uri(),
        };
        let key = account.key().unwrap();
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let jwt = google_assertion(
            "svc@p.iam.gserviceaccount.com",
            "ann@example.com",
            "https://t/token",
            &key,
            now,
        )
        .unwrap();
        let parts: Vec<&str> = jwt.split('.').collect();
        assert_eq!(parts.len(), 3);
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let claims: serde_json::Value =
            serde_json::from_slice(&b64.decode(parts[1]).unwrap()).unwrap();
        assert_eq!(claims["sub"], "ann@example.com");
        assert_eq!(claims["aud"], "https://t/token");
        assert_eq!(claims["scope"], GOOGLE_SCOPE);
        assert_eq!(claims["exp"], 1_800_003_600u64);
        let public = ring::signature::UnparsedPublicKey::new(
            &ring::signature::RSA_PKCS1_2048_8192_SHA256,
            key.public().as_ref(),
        );
        let signed = format!("{}.{}", parts[0], parts[1]);
        public
            .verify(signed.as_bytes(), &b64.decode(parts[2]).unwrap())
            .expect("the signature verifies with the account's public key");
    }

    /// An RSA-2048 key in PKCS#8 PEM, made by openssl for the test.
    fn rsa_pem() -> String {
        let out = std::process::Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
            ])
            .output()
            .expect("openssl");
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    }
}
