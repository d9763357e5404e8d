//! The sections of the settings, one struct each with its defaults, and
//! the clients they build: the database connection options, the transport,
//! the DKIM signer. The defaults are the ones users are told (the README's
//! key table), so a default changed here changes there too.

use std::{fmt, path::PathBuf, str::FromStr, time::Duration};

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Deserializer};

use crate::{
    smtp::{RelayOptions, Transport, TransportError, TransportKind},
    store::{Store, StoreError},
};

use super::{files::read_credential, ConfigError, Result};

/// A route (DESIGN §13): mails from `from_domains` (or a row naming it in
/// its `route` column) go through a relay of their own, with its own
/// credentials, fallback, staging redirect and DKIM key. The limits
/// (`timeout`, `pool_size`, …) are `transport.*`'s.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RouteSettings {
    pub name: String,
    /// A mail whose From domain is one of these, or below one, takes this
    /// route; the first route that matches wins.
    pub from_domains: Vec<String>,
    pub url: String,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
    pub oauth2: Option<OAuth2Settings>,
    pub fallback_url: Option<String>,
    pub fallback_username: Option<String>,
    pub fallback_password_file: Option<PathBuf>,
    pub redirect_to: Option<String>,
    pub dkim: Option<DkimSettings>,
}

impl RouteSettings {
    /// `transport`'s settings with this route's relay in place of its own.
    pub fn transport(&self, base: &TransportSettings) -> TransportSettings {
        TransportSettings {
            url: self.url.clone(),
            username: self.username.clone(),
            password: None,
            password_file: self.password_file.clone(),
            fallback_url: self.fallback_url.clone(),
            fallback_username: self.fallback_username.clone(),
            fallback_password_file: self.fallback_password_file.clone(),
            redirect_to: self.redirect_to.clone(),
            oauth2: self.oauth2.clone(),
            ..base.clone()
        }
    }

    /// Whether a mail from `domain` takes this route.
    pub fn covers(&self, domain: &str) -> bool {
        let domain = domain.trim_end_matches('.').to_ascii_lowercase();
        self.from_domains.iter().any(|d| {
            let d = d.trim_end_matches('.').to_ascii_lowercase();
            domain == d
                || domain
                    .strip_suffix(&d)
                    .is_some_and(|rest| rest.ends_with('.'))
        })
    }
}

/// One DKIM key: signs mails from `domain` (and below it); off unless all
/// three keys are set.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DkimSettings {
    pub domain: Option<String>,
    pub selector: Option<String>,
    /// PEM: RSA (2048 bits or more) or Ed25519; a relative path is looked up
    /// in `$CREDENTIALS_DIRECTORY` first.
    pub private_key_file: Option<PathBuf>,
}

impl DkimSettings {
    /// The signer these settings name, loaded and checked (`None`: off).
    pub fn signer(&self) -> Result<Option<crate::dkim::Signer>> {
        let (Some(domain), Some(selector), Some(file)) =
            (&self.domain, &self.selector, &self.private_key_file)
        else {
            return Ok(None);
        };
        let pem = read_credential("dkim.private_key_file", file)?;
        crate::dkim::Signer::new(domain, selector, pem.expose_secret())
            .map(Some)
            .map_err(|e| ConfigError::Invalid {
                key: "dkim.private_key_file",
                reason: e.to_string(),
            })
    }

    /// Every key set together, the selector a DNS name.
    pub(super) fn validate(&self) -> Result<()> {
        let invalid = |key, reason: &str| ConfigError::Invalid {
            key,
            reason: reason.into(),
        };
        let set = [
            self.domain.is_some(),
            self.selector.is_some(),
            self.private_key_file.is_some(),
        ];
        if set.contains(&true) && set.contains(&false) {
            return Err(invalid(
                "dkim.private_key_file",
                "set dkim.domain, dkim.selector and dkim.private_key_file together",
            ));
        }
        if let Some(selector) = &self.selector {
            let valid = !selector.is_empty()
                && selector.split('.').all(|part| {
                    !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                });
            if !valid {
                return Err(invalid(
                    "dkim.selector",
                    "not a DNS label such as `mail2026`",
                ));
            }
        }
        Ok(())
    }
}

/// `[dkim]` (one key, as before) or `[[dkim]]` (several): DESIGN §13.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum DkimKeys {
    One(DkimSettings),
    Many(Vec<DkimSettings>),
}

impl Default for DkimKeys {
    fn default() -> Self {
        DkimKeys::One(DkimSettings::default())
    }
}

impl DkimKeys {
    pub fn keys(&self) -> &[DkimSettings] {
        match self {
            DkimKeys::One(one) => std::slice::from_ref(one),
            DkimKeys::Many(many) => many,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSettings {
    /// `postgres://…`, `mysql://…` or `sqlite://…`; default `sqlite://tablemail.db`.
    pub url: SecretString,
    /// Pool size; default 8.
    pub max_connections: u32,
    /// Apply pending migrations when `run` starts; default true.
    pub migrate: bool,
    /// Deadline of every database call: a connection whose packets vanish is
    /// dropped after this long; default 30s.
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
    /// A file holding the database password, read like
    /// `transport.password_file` (systemd credentials, container secrets);
    /// it overrides a password in `url`.
    pub password_file: Option<PathBuf>,
    /// MySQL/MariaDB (no NOTIFY): how often an idle daemon looks for a new
    /// newest row; default 100ms. Ignored by the other backends.
    #[serde(with = "humantime_serde")]
    pub look_interval: Duration,
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: SecretString::from("sqlite://tablemail.db"),
            max_connections: 8,
            migrate: true,
            statement_timeout: Duration::from_secs(30),
            password_file: None,
            look_interval: crate::store::DEFAULT_LOOK_INTERVAL,
        }
    }
}

impl DatabaseSettings {
    /// The database client these settings name (the pool connects lazily),
    /// with the password of `password_file` read once here.
    pub async fn connect(&self) -> Result<std::sync::Arc<dyn Store>, StoreError> {
        let password = match &self.password_file {
            Some(path) => Some(
                read_credential("database.password_file", path)
                    .map_err(|e| StoreError::Unsupported(e.to_string()))?,
            ),
            None => None,
        };
        crate::store::connect_with(
            self.url.expose_secret(),
            crate::store::ConnectOptions {
                max_connections: self.max_connections,
                statement_timeout: self.statement_timeout,
                password,
                look_interval: self.look_interval,
            },
        )
        .await
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportSettings {
    /// `smtp://host:port`, `smtp://host:587?tls=required`, `smtps://host:465` or
    /// `file://DIR`; default `file://./outbox`.
    pub url: String,
    pub username: Option<String>,
    pub password: Option<SecretString>,
    /// A file holding the password (systemd credentials, container secrets).
    pub password_file: Option<PathBuf>,
    /// Limit on every SMTP command; default 30s.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Limit on the reply to the final "." (RFC 5321 §4.5.3.2); default 10m.
    #[serde(with = "humantime_serde")]
    pub data_timeout: Duration,
    /// Larger mails fail without an attempt; default 25MB.
    pub max_message_size: ByteSize,
    /// Most recipients (to, cc and bcc together) of one mail; default 1000.
    pub max_recipients: usize,
    /// Idle SMTP connections kept open for reuse; default 16.
    pub pool_size: usize,
    /// Skip certificate verification (test relays only); default false.
    pub accept_invalid_certs: bool,
    /// Used while the primary relay is unavailable (Postfix's fallback_relay).
    pub fallback_url: Option<String>,
    pub fallback_username: Option<String>,
    pub fallback_password_file: Option<PathBuf>,
    /// While idle, probe the relay this often; default 30s.
    #[serde(with = "humantime_serde")]
    pub probe_interval: Duration,
    /// Staging: every envelope goes to this one address, headers untouched.
    pub redirect_to: Option<String>,
    /// Send AUTH (the password) over a connection without TLS: `smtp://`
    /// without `?tls=required`. Default false: such a relay is a
    /// configuration fault (`check` fails, mail waits unspent).
    pub allow_plaintext_auth: bool,
    /// SASL XOAUTH2 instead of a password (DESIGN §13).
    pub oauth2: Option<OAuth2Settings>,
}

/// `transport.oauth2` (and a route's `oauth2`): where XOAUTH2 tokens come
/// from.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct OAuth2Settings {
    /// `microsoft`, `google` or `command`.
    pub provider: String,
    /// microsoft: the directory (tenant) and the application.
    pub tenant_id: Option<String>,
    pub client_id: Option<String>,
    pub client_secret_file: Option<PathBuf>,
    /// google: the service account's JSON key file and the mailbox it acts
    /// for.
    pub service_account_file: Option<PathBuf>,
    pub subject: Option<String>,
    /// command: run by `/bin/sh -c`; prints a token and, optionally, its
    /// lifetime in seconds.
    pub token_command: Option<String>,
    /// The provider's token endpoint, for national clouds and tests.
    pub token_url: Option<String>,
}

impl OAuth2Settings {
    /// The token source these settings name; `username` is the XOAUTH2
    /// `user=` (for `google`, `subject` when it is not set).
    pub fn tokens(
        &self,
        key: &'static str,
        username: Option<&str>,
    ) -> Result<crate::smtp::oauth2::Tokens> {
        use crate::smtp::oauth2::{Provider, ServiceAccount, Tokens};
        let invalid = |reason: String| ConfigError::Invalid { key, reason };
        let need = |v: &Option<String>, name: &str| {
            v.clone()
                .filter(|v| !v.trim().is_empty())
                .ok_or_else(|| invalid(format!("provider {} needs {name}", self.provider)))
        };
        let provider = match self.provider.as_str() {
            "microsoft" => Provider::Microsoft {
                tenant_id: need(&self.tenant_id, "tenant_id")?,
                client_id: need(&self.client_id, "client_id")?,
                client_secret: match &self.client_secret_file {
                    Some(path) => read_credential(key, path)?,
                    None => {
                        return Err(invalid(
                            "provider microsoft needs client_secret_file".into(),
                        ))
                    }
                },
            },
            "google" => {
                let path = self
                    .service_account_file
                    .as_ref()
                    .ok_or_else(|| invalid("provider google needs service_account_file".into()))?;
                let json = read_credential(key, path)?;
                let account: ServiceAccount = serde_json::from_str(json.expose_secret())
                    .map_err(|e| invalid(format!("service_account_file: {e}")))?;
                Provider::Google {
                    private_key: std::sync::Arc::new(
                        account
                            .key()
                            .map_err(|e| invalid(format!("service_account_file: {e}")))?,
                    ),
                    client_email: account.client_email,
                    subject: need(&self.subject, "subject")?,
                    token_uri: account.token_uri,
                }
            }
            "command" => Provider::Command {
                command: need(&self.token_command, "token_command")?,
            },
            other => {
                return Err(invalid(format!(
                    "provider `{other}`: use microsoft, google or command"
                )))
            }
        };
        let user = match (username, &provider) {
            (Some(user), _) => user.to_string(),
            (None, Provider::Google { subject, .. }) => subject.clone(),
            (None, _) => {
                return Err(invalid(
                    "XOAUTH2 needs the sending mailbox as the username".into(),
                ))
            }
        };
        Tokens::new(provider, user, self.token_url.clone()).map_err(invalid)
    }
}

impl Default for TransportSettings {
    fn default() -> Self {
        Self {
            url: "file://./outbox".into(),
            username: None,
            password: None,
            password_file: None,
            timeout: Duration::from_secs(30),
            data_timeout: Duration::from_secs(600),
            max_message_size: ByteSize(25_000_000),
            max_recipients: 1000,
            pool_size: 16,
            accept_invalid_certs: false,
            fallback_url: None,
            fallback_username: None,
            fallback_password_file: None,
            probe_interval: Duration::from_secs(30),
            redirect_to: None,
            allow_plaintext_auth: false,
            oauth2: None,
        }
    }
}

/// What to do with a mail whose reply was lost after the final ".".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ambiguous {
    /// Queue it again with the same Message-ID (receivers can drop the duplicate).
    Resend,
    /// Park it as `unknown` for an operator.
    Hold,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSettings {
    /// Mails in flight at once; default 16.
    pub concurrency: usize,
    /// Rows per claim, one GUID lock per batch; default 100.
    pub batch_size: usize,
    /// Fallback poll when no wake-up arrives; default 1s.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// A `sending` row older than this is released; default 5m.
    #[serde(with = "humantime_serde")]
    pub lock_timeout: Duration,
    /// First backoff after a transient failure; default 1m.
    #[serde(with = "humantime_serde")]
    pub retry_base: Duration,
    /// Backoff cap; default 1h.
    #[serde(with = "humantime_serde")]
    pub retry_max: Duration,
    /// A mail not sent by then fails as `expired`; default 5d.
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
    /// `resend` (default) or `hold`.
    pub ambiguous: Ambiguous,
    /// Mails per second for this daemon, 0 = unlimited (default).
    pub rate_limit: u32,
    /// Drain time on SIGTERM; default 30s.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// Relay-down outcomes one row may draw in a row while other mails go
    /// through, before it spends attempts; default 3.
    pub relay_down_limit: u32,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            concurrency: 16,
            batch_size: 100,
            poll_interval: Duration::from_secs(1),
            lock_timeout: Duration::from_secs(300),
            retry_base: Duration::from_secs(60),
            retry_max: Duration::from_secs(3600),
            max_age: Duration::from_secs(5 * 86400),
            ambiguous: Ambiguous::Resend,
            rate_limit: 0,
            shutdown_timeout: Duration::from_secs(30),
            relay_down_limit: 3,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DefaultsSettings {
    /// Sender used when a row has no `from_address`.
    pub from_address: Option<String>,
    /// Display name used when a row has no `from_name`.
    pub from_name: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionSettings {
    /// Age after which `sent` rows are deleted; default 7d, `0s` at once.
    #[serde(with = "humantime_serde")]
    pub sent: Duration,
    /// Age after which `failed` and `cancelled` rows are deleted; default 30d.
    #[serde(with = "humantime_serde")]
    pub failed: Duration,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self {
            sent: Duration::from_secs(7 * 86400),
            failed: Duration::from_secs(30 * 86400),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One flat JSON object per line (default).
    Json,
    /// Human-readable lines.
    Pretty,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSettings {
    pub format: LogFormat,
    /// Filter directive; `RUST_LOG` overrides. Default `info`.
    pub level: String,
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            format: LogFormat::Json,
            level: "info".into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSettings {
    /// Address for `/metrics` and `/healthz`, e.g. `127.0.0.1:9898`; none by default.
    pub listen: Option<String>,
}

/// The operator console (DESIGN §9): off unless `listen` is set, read-only
/// unless a token is.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleSettings {
    /// Address of the console, e.g. `127.0.0.1:9899`; none by default. It may
    /// be `metrics.listen`'s: then one listener serves both.
    pub listen: Option<String>,
    /// A file holding the operator token that unlocks retry and cancel, read
    /// like `transport.password_file` (a relative path is looked up in
    /// `$CREDENTIALS_DIRECTORY` first).
    pub token_file: Option<PathBuf>,
    /// The operator token itself; `token_file` is preferred.
    pub token: Option<SecretString>,
}

/// A console token shorter than this is refused: it is all that stands
/// between the network and retry/cancel.
pub const CONSOLE_TOKEN_MIN_LEN: usize = 16;

impl ConsoleSettings {
    /// The operator token from `token` or `token_file`; `None`: read-only.
    pub fn token(&self) -> Result<Option<SecretString>> {
        let token = match (&self.token, &self.token_file) {
            (Some(token), _) => token.clone(),
            (None, Some(path)) => read_credential("console.token_file", path)?,
            (None, None) => return Ok(None),
        };
        let key = if self.token.is_some() {
            "console.token"
        } else {
            "console.token_file"
        };
        let length = token.expose_secret().trim().chars().count();
        if length < CONSOLE_TOKEN_MIN_LEN {
            return Err(ConfigError::Invalid {
                key,
                reason: format!(
                    "the token must be at least {CONSOLE_TOKEN_MIN_LEN} characters \
                     (e.g. `openssl rand -hex 32`)"
                ),
            });
        }
        Ok(Some(token))
    }
}

/// A byte count written as `25MB`, `512KiB` or a bare number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(split);
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("`{s}` is not a size such as 25MB"))?;
        let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kb" | "k" => 1_000,
            "mb" | "m" => 1_000_000,
            "gb" | "g" => 1_000_000_000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            other => return Err(format!("unknown size unit `{other}` in `{s}`")),
        };
        n.checked_mul(factor)
            .map(ByteSize)
            .ok_or_else(|| format!("`{s}` is too large"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes", self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(ByteSize(n)),
            Raw::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl TransportSettings {
    /// The password from `password` or `password_file`.
    pub fn password(&self) -> Result<Option<SecretString>> {
        if let Some(p) = &self.password {
            return Ok(Some(p.clone()));
        }
        match &self.password_file {
            Some(path) => read_credential("transport.password_file", path).map(Some),
            None => Ok(None),
        }
    }

    /// The relays (`transport.url`, `transport.fallback_url`) whose AUTH
    /// would send the password over a connection without TLS, which
    /// `allow_plaintext_auth = false` refuses: a configuration fault that
    /// `check` and `/healthz` report and that keeps mail waiting, unspent.
    pub fn plaintext_auth_refused(&self) -> Vec<&'static str> {
        if self.allow_plaintext_auth {
            return Vec::new();
        }
        let plain = |url: &str| {
            matches!(
                TransportKind::parse(url),
                Ok(TransportKind::Smtp {
                    tls: crate::smtp::TlsMode::None,
                    ..
                })
            )
        };
        let mut refused = Vec::new();
        if (self.username.is_some() || self.oauth2.is_some()) && plain(&self.url) {
            refused.push("transport.url");
        }
        if let Some(url) = &self.fallback_url {
            if self.fallback_username.is_some() && plain(url) {
                refused.push("transport.fallback_url");
            }
        }
        refused
    }

    /// The relays (keys) that send in clear to another host: `?tls=none`
    /// said on purpose, logged at start.
    pub fn clear_text_relays(&self) -> Vec<&'static str> {
        let clear = |url: &str| {
            matches!(
                TransportKind::parse(url),
                Ok(TransportKind::Smtp { ref host, tls: crate::smtp::TlsMode::None, .. })
                    if !crate::smtp::is_loopback(host)
            )
        };
        let mut keys = Vec::new();
        if clear(&self.url) {
            keys.push("transport.url");
        }
        if self.fallback_url.as_deref().is_some_and(clear) {
            keys.push("transport.fallback_url");
        }
        keys
    }

    /// The relay client these settings name; `hello` is our name in EHLO.
    pub fn client(&self, hello: &str) -> Result<Transport> {
        let invalid = |e: TransportError| ConfigError::Invalid {
            key: "transport.url",
            reason: e.to_string(),
        };
        let options = |url: &str, username: Option<String>, password, oauth2| {
            Ok(RelayOptions {
                kind: TransportKind::parse(url).map_err(|e| invalid(e.into()))?,
                username,
                password,
                oauth2,
                hello: hello.to_string(),
                timeout: self.timeout,
                data_timeout: self.data_timeout,
                pool_size: self.pool_size,
                accept_invalid_certs: self.accept_invalid_certs,
                allow_plaintext_auth: self.allow_plaintext_auth,
            })
        };
        let oauth2 = match &self.oauth2 {
            Some(o) => Some(std::sync::Arc::new(
                o.tokens("transport.oauth2", self.username.as_deref())?,
            )),
            None => None,
        };
        let mut transport = Transport::new(options(
            &self.url,
            self.username.clone(),
            self.password()?,
            oauth2,
        )?)
        .map_err(invalid)?;
        if let Some(url) = &self.fallback_url {
            let password = match &self.fallback_password_file {
                Some(path) => Some(read_credential("transport.fallback_password_file", path)?),
                None => None,
            };
            transport = transport
                .with_fallback(options(
                    url,
                    self.fallback_username.clone(),
                    password,
                    None,
                )?)
                .map_err(|e| ConfigError::Invalid {
                    key: "transport.fallback_url",
                    reason: e.to_string(),
                })?;
        }
        let redirect = match &self.redirect_to {
            Some(to) => Some(
                crate::mail::parse_address(to).map_err(|e| ConfigError::Invalid {
                    key: "transport.redirect_to",
                    reason: e.to_string(),
                })?,
            ),
            None => None,
        };
        Ok(transport
            .redirect_to(redirect)
            .probe_every(self.probe_interval))
    }
}
