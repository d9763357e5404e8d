//! Settings: compiled-in defaults < config file < `TABLEMAIL__SECTION__KEY` env.
//!
//! Every struct denies unknown fields, so a misspelt key is an error at start
//! instead of a silently ignored setting. Secrets are `SecretString`s, which never
//! print their value in `Debug` output or logs.
//!
//! Over 500 lines because the settings of every section, their validation
//! and the clients they build (the transport, the DKIM signer, the database
//! options) read best side by side with the key table of the README; a third
//! of the file is its tests.

use std::{fmt, path::Path, path::PathBuf, str::FromStr, time::Duration};

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Deserializer};

use crate::{
    smtp::{RelayOptions, Transport, TransportError, TransportKind},
    store::{Store, StoreError},
};

/// Where the daemon looks for a config file when `--config` is not given.
pub const SYSTEM_CONFIG_PATH: &str = "/etc/tablemail/tablemail.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Load(String),
    #[error("configuration: {key}: {reason}")]
    Invalid { key: &'static str, reason: String },
}

pub type Result<T, E = ConfigError> = std::result::Result<T, E>;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    pub database: DatabaseSettings,
    pub transport: TransportSettings,
    pub worker: WorkerSettings,
    pub defaults: DefaultsSettings,
    pub retention: RetentionSettings,
    pub log: LogSettings,
    pub metrics: MetricsSettings,
    pub dkim: DkimSettings,
    pub console: ConsoleSettings,
}

/// DKIM signing of mails from `domain` (and below it); off unless all three
/// keys are set.
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
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: SecretString::from("sqlite://tablemail.db"),
            max_connections: 8,
            migrate: true,
            statement_timeout: Duration::from_secs(30),
            password_file: None,
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

impl Settings {
    /// Loads defaults, then `file` (or [`SYSTEM_CONFIG_PATH`] when it exists),
    /// then `TABLEMAIL__*` environment variables, and validates the result.
    pub fn load(file: Option<&Path>) -> Result<Settings> {
        let vars: Vec<(String, String)> = std::env::vars().collect();
        Self::load_from(file, vars)
    }

    /// Like [`Settings::load`] with an explicit environment (for tests).
    pub fn load_from(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings> {
        let mut builder = config::Config::builder();
        let system = Path::new(SYSTEM_CONFIG_PATH);
        let path = match file {
            Some(path) if !path.exists() => {
                return Err(ConfigError::Load(format!(
                    "config file {} does not exist",
                    path.display()
                )))
            }
            Some(path) => Some(path),
            None => system.exists().then_some(system),
        };
        if let Some(path) = path {
            // Opened here first: when the service's user cannot read the
            // file, the message names its mode and owner, not just EACCES.
            check_readable(path)?;
            builder = builder.add_source(config::File::from(path).format(config::FileFormat::Toml));
        }
        let env: std::collections::HashMap<String, String> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with("TABLEMAIL__"))
            .collect();
        builder = builder.add_source(
            config::Environment::with_prefix("TABLEMAIL")
                .prefix_separator("__")
                .separator("__")
                // Values stay the strings they were: `00042` is a password,
                // not the number 42. Numbers and booleans are still read
                // from these strings where a key wants one.
                .try_parsing(false)
                .source(Some(env)),
        );
        let settings: Settings = builder
            .build()
            .and_then(|c| c.try_deserialize())
            .map_err(|e| ConfigError::Load(e.to_string()))?;
        settings.validate()?;
        Ok(settings)
    }

    fn validate(&self) -> Result<()> {
        fn invalid(key: &'static str, reason: impl Into<String>) -> ConfigError {
            ConfigError::Invalid {
                key,
                reason: reason.into(),
            }
        }
        let url = self.database.url.expose_secret();
        let backend =
            crate::store::Backend::from_url(url).map_err(|e| invalid("database.url", e))?;
        if let Some(path) = &self.database.password_file {
            if backend == crate::store::Backend::Sqlite {
                return Err(invalid(
                    "database.password_file",
                    "SQLite has no password: remove the key",
                ));
            }
            // Read now, so that a missing credential stops the start (exit 2).
            read_credential("database.password_file", path)?;
        }
        if self.database.max_connections < 2 {
            return Err(invalid("database.max_connections", "must be at least 2"));
        }
        TransportKind::parse(&self.transport.url)
            .map_err(|e| invalid("transport.url", e.to_string()))?;
        if self.database.statement_timeout < Duration::from_secs(1) {
            return Err(invalid("database.statement_timeout", "must be at least 1s"));
        }
        if self.transport.password.is_some() && self.transport.password_file.is_some() {
            return Err(invalid(
                "transport.password_file",
                "set either transport.password or transport.password_file, not both",
            ));
        }
        if let Some(url) = &self.transport.fallback_url {
            match TransportKind::parse(url) {
                Ok(TransportKind::Smtp { .. }) => {}
                Ok(TransportKind::File { .. }) => {
                    return Err(invalid(
                        "transport.fallback_url",
                        "must be an SMTP relay (smtp:// or smtps://)",
                    ))
                }
                Err(e) => return Err(invalid("transport.fallback_url", e.to_string())),
            }
            if !matches!(
                TransportKind::parse(&self.transport.url),
                Ok(TransportKind::Smtp { .. })
            ) {
                return Err(invalid(
                    "transport.fallback_url",
                    "needs an SMTP relay in transport.url",
                ));
            }
        }
        if self.transport.fallback_username.is_some()
            != self.transport.fallback_password_file.is_some()
        {
            return Err(invalid(
                "transport.fallback_password_file",
                "set transport.fallback_username and transport.fallback_password_file together",
            ));
        }
        if self.transport.probe_interval < Duration::from_secs(1) {
            return Err(invalid("transport.probe_interval", "must be at least 1s"));
        }
        if let Some(to) = &self.transport.redirect_to {
            crate::mail::parse_address(to)
                .map_err(|e| invalid("transport.redirect_to", e.to_string()))?;
        }
        if self.transport.timeout.is_zero() {
            return Err(invalid("transport.timeout", "must be above zero"));
        }
        if self.transport.data_timeout.is_zero() {
            return Err(invalid("transport.data_timeout", "must be above zero"));
        }
        let w = &self.worker;
        if w.concurrency == 0 {
            return Err(invalid("worker.concurrency", "must be at least 1"));
        }
        if w.batch_size == 0 || w.batch_size > 10_000 {
            return Err(invalid("worker.batch_size", "must be between 1 and 10000"));
        }
        if w.poll_interval.is_zero() {
            return Err(invalid("worker.poll_interval", "must be above zero"));
        }
        if w.lock_timeout < Duration::from_secs(3) {
            return Err(invalid("worker.lock_timeout", "must be at least 3s"));
        }
        if w.retry_base.is_zero() || w.retry_max < w.retry_base {
            return Err(invalid(
                "worker.retry_max",
                "retry_base must be above zero and retry_max at least retry_base",
            ));
        }
        if let Some(from) = &self.defaults.from_address {
            crate::mail::parse_address(from)
                .map_err(|e| invalid("defaults.from_address", e.to_string()))?;
        }
        if let Some(name) = &self.defaults.from_name {
            if name.contains(['\r', '\n']) {
                return Err(invalid("defaults.from_name", "contains CR or LF"));
            }
        }
        let d = &self.dkim;
        let set = [
            d.domain.is_some(),
            d.selector.is_some(),
            d.private_key_file.is_some(),
        ];
        if set.contains(&true) && set.contains(&false) {
            return Err(invalid(
                "dkim.private_key_file",
                "set dkim.domain, dkim.selector and dkim.private_key_file together",
            ));
        }
        if let Some(selector) = &d.selector {
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
        if let Some(listen) = &self.metrics.listen {
            listen
                .parse::<std::net::SocketAddr>()
                .map_err(|e| invalid("metrics.listen", format!("`{listen}`: {e}")))?;
        }
        if let Some(listen) = &self.console.listen {
            listen
                .parse::<std::net::SocketAddr>()
                .map_err(|e| invalid("console.listen", format!("`{listen}`: {e}")))?;
        }
        if self.console.token.is_some() && self.console.token_file.is_some() {
            return Err(invalid(
                "console.token_file",
                "set either console.token or console.token_file, not both",
            ));
        }
        // Read now, so that a missing or short token stops the start (exit 2).
        self.console.token()?;
        tracing_subscriber::EnvFilter::try_new(&self.log.level)
            .map_err(|e| invalid("log.level", e.to_string()))?;
        Ok(())
    }

    /// The SMTP password from `transport.password` or `transport.password_file`.
    pub fn smtp_password(&self) -> Result<Option<SecretString>> {
        self.transport.password()
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
        if self.username.is_some() && plain(&self.url) {
            refused.push("transport.url");
        }
        if let Some(url) = &self.fallback_url {
            if self.fallback_username.is_some() && plain(url) {
                refused.push("transport.fallback_url");
            }
        }
        refused
    }

    /// The relay client these settings name; `hello` is our name in EHLO.
    pub fn client(&self, hello: &str) -> Result<Transport> {
        let invalid = |e: TransportError| ConfigError::Invalid {
            key: "transport.url",
            reason: e.to_string(),
        };
        let options = |url: &str, username: Option<String>, password| {
            Ok(RelayOptions {
                kind: TransportKind::parse(url).map_err(|e| invalid(e.into()))?,
                username,
                password,
                hello: hello.to_string(),
                timeout: self.timeout,
                data_timeout: self.data_timeout,
                pool_size: self.pool_size,
                accept_invalid_certs: self.accept_invalid_certs,
                allow_plaintext_auth: self.allow_plaintext_auth,
            })
        };
        let mut transport =
            Transport::new(options(&self.url, self.username.clone(), self.password()?)?)
                .map_err(invalid)?;
        if let Some(url) = &self.fallback_url {
            let password = match &self.fallback_password_file {
                Some(path) => Some(read_credential("transport.fallback_password_file", path)?),
                None => None,
            };
            transport = transport
                .with_fallback(options(url, self.fallback_username.clone(), password)?)
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

/// Fails, saying why, unless this process can read the config file at
/// `path`: a file the service's user may not read (the classic 0640 root
/// file under a systemd `DynamicUser`) is named with its mode, its owner and
/// who we run as.
fn check_readable(path: &Path) -> Result<()> {
    let error = match std::fs::File::open(path) {
        Ok(_) => return Ok(()),
        Err(e) => e,
    };
    let mut why = String::new();
    if let Ok(meta) = std::fs::metadata(path) {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        why = format!(
            " (mode {:04o}, owner {}:{}",
            meta.permissions().mode() & 0o7777,
            account_name("/etc/passwd", meta.uid()),
            account_name("/etc/group", meta.gid()),
        );
        if let Some((uid, gid)) = effective_ids() {
            why.push_str(&format!("; tablemail runs as uid {uid} gid {gid}"));
        }
        why.push(')');
    }
    Err(ConfigError::Load(format!(
        "cannot read {}{why}: {error}",
        path.display()
    )))
}

/// This process's effective uid and gid, from `/proc/self/status` (Linux).
fn effective_ids() -> Option<(u32, u32)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let effective = |key: &str| -> Option<u32> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().nth(1)?.parse().ok()
    };
    Some((effective("Uid:")?, effective("Gid:")?))
}

/// The name of the user (or group) `id` in `file` (`/etc/passwd`,
/// `/etc/group`), or the number when it has none there.
fn account_name(file: &str, id: u32) -> String {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|text| {
            text.lines().find_map(|line| {
                let mut fields = line.split(':');
                let name = fields.next()?;
                (fields.nth(1)?.parse::<u32>().ok()? == id).then(|| name.to_string())
            })
        })
        .unwrap_or_else(|| id.to_string())
}

/// A secret kept in a file: a relative path is looked up in
/// `$CREDENTIALS_DIRECTORY` first, which is where systemd's `LoadCredential=`
/// puts it. One trailing line break is not part of the secret.
fn read_credential(key: &'static str, path: &Path) -> Result<SecretString> {
    let path = match std::env::var_os("CREDENTIALS_DIRECTORY") {
        Some(dir) if path.is_relative() => Path::new(&dir).join(path),
        _ => path.to_path_buf(),
    };
    let text = std::fs::read_to_string(&path).map_err(|e| ConfigError::Invalid {
        key,
        reason: format!("cannot read {}: {e}", path.display()),
    })?;
    let secret = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(&text);
    Ok(SecretString::from(secret.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_match_the_contract() {
        let s = Settings::load_from(None, env(&[])).unwrap();
        assert_eq!(s.database.url.expose_secret(), "sqlite://tablemail.db");
        assert_eq!(s.transport.url, "file://./outbox");
        assert_eq!(s.transport.max_message_size, ByteSize(25_000_000));
        assert_eq!(s.worker.concurrency, 16);
        assert_eq!(s.worker.batch_size, 100);
        assert_eq!(s.worker.lock_timeout, Duration::from_secs(300));
        assert_eq!(s.worker.ambiguous, Ambiguous::Resend);
        assert_eq!(s.retention.failed, Duration::from_secs(30 * 86400));
        assert_eq!(s.log.format, LogFormat::Json);
    }

    #[test]
    fn env_overrides_and_parses_values() {
        let s = Settings::load_from(
            None,
            env(&[
                ("TABLEMAIL__WORKER__CONCURRENCY", "4"),
                ("TABLEMAIL__WORKER__RETRY_BASE", "5s"),
                ("TABLEMAIL__TRANSPORT__MAX_MESSAGE_SIZE", "1MiB"),
                ("TABLEMAIL__DATABASE__URL", "postgres://u@h/db"),
                ("OTHER__WORKER__CONCURRENCY", "9"),
            ]),
        )
        .unwrap();
        assert_eq!(s.worker.concurrency, 4);
        assert_eq!(s.worker.retry_base, Duration::from_secs(5));
        assert_eq!(s.transport.max_message_size, ByteSize(1 << 20));
        assert_eq!(s.database.url.expose_secret(), "postgres://u@h/db");
    }

    #[test]
    fn env_strings_arrive_verbatim() {
        let s = Settings::load_from(
            None,
            env(&[
                ("TABLEMAIL__TRANSPORT__USERNAME", "007"),
                ("TABLEMAIL__TRANSPORT__PASSWORD", "00042"),
                ("TABLEMAIL__DEFAULTS__FROM_NAME", "1e3"),
                ("TABLEMAIL__WORKER__RATE_LIMIT", "0042"),
                ("TABLEMAIL__DATABASE__MIGRATE", "false"),
                ("TABLEMAIL__TRANSPORT__ACCEPT_INVALID_CERTS", "true"),
            ]),
        )
        .unwrap();
        assert_eq!(s.transport.username.as_deref(), Some("007"));
        assert_eq!(s.smtp_password().unwrap().unwrap().expose_secret(), "00042");
        assert_eq!(s.defaults.from_name.as_deref(), Some("1e3"));
        assert_eq!(s.worker.rate_limit, 42);
        assert!(!s.database.migrate);
        assert!(s.transport.accept_invalid_certs);
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_key() {
        let err = Settings::load_from(None, env(&[("TABLEMAIL__WORKER__CONCURENCY", "4")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("concurency"), "{err}");
        let err = Settings::load_from(None, env(&[("TABLEMAIL__NOPE__X", "4")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("nope"), "{err}");
    }

    #[test]
    fn bad_values_are_errors_naming_the_key() {
        let err = Settings::load_from(None, env(&[("TABLEMAIL__WORKER__CONCURRENCY", "0")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("worker.concurrency"), "{err}");
        let err = Settings::load_from(None, env(&[("TABLEMAIL__DATABASE__URL", "redis://x")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("database.url"), "{err}");
        let err = Settings::load_from(None, env(&[("TABLEMAIL__WORKER__POLL_INTERVAL", "soon")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("poll_interval"), "{err}");
        // A database password file: none for SQLite, and one that cannot be
        // read stops the start.
        let err = Settings::load_from(
            None,
            env(&[("TABLEMAIL__DATABASE__PASSWORD_FILE", "/nonexistent")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("database.password_file: SQLite has no password"),
            "{err}"
        );
        let err = Settings::load_from(
            None,
            env(&[
                ("TABLEMAIL__DATABASE__URL", "postgres://app@db/app"),
                (
                    "TABLEMAIL__DATABASE__PASSWORD_FILE",
                    "/nonexistent/db-password",
                ),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("database.password_file: cannot read /nonexistent/db-password"),
            "{err}"
        );
    }

    #[test]
    fn the_example_configurations_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        for name in ["production.toml", "development.toml"] {
            let s = Settings::load_from(Some(&dir.join(name)), env(&[]))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(s.defaults.from_address.is_some(), "{name}");
        }
    }

    #[test]
    fn auth_without_tls_is_a_fault_unless_allowed() {
        let refused = |pairs: &[(&str, &str)]| {
            let mut all = vec![
                ("TABLEMAIL__TRANSPORT__USERNAME", "mailer"),
                ("TABLEMAIL__TRANSPORT__PASSWORD", "pw"),
            ];
            all.extend_from_slice(pairs);
            Settings::load_from(None, env(&all))
                .unwrap()
                .transport
                .plaintext_auth_refused()
        };
        let url = "TABLEMAIL__TRANSPORT__URL";
        assert_eq!(refused(&[(url, "smtp://relay:25")]), ["transport.url"]);
        assert!(refused(&[(url, "smtp://relay:587?tls=required")]).is_empty());
        assert!(refused(&[(url, "smtps://relay")]).is_empty());
        assert!(refused(&[
            (url, "smtp://relay:25"),
            ("TABLEMAIL__TRANSPORT__ALLOW_PLAINTEXT_AUTH", "true"),
        ])
        .is_empty());
        // The fallback's own login, judged by its own URL.
        let fallback = [
            (url, "smtps://relay"),
            ("TABLEMAIL__TRANSPORT__FALLBACK_URL", "smtp://backup:25"),
            ("TABLEMAIL__TRANSPORT__FALLBACK_USERNAME", "other"),
            ("TABLEMAIL__TRANSPORT__FALLBACK_PASSWORD_FILE", "/dev/null"),
        ];
        assert_eq!(refused(&fallback), ["transport.fallback_url"]);
        // No username, no password to protect.
        let s = Settings::load_from(None, env(&[(url, "smtp://relay:25")])).unwrap();
        assert!(s.transport.plaintext_auth_refused().is_empty());
    }

    #[test]
    fn accounts_are_named_from_the_system_files() {
        assert_eq!(account_name("/etc/passwd", 0), "root");
        assert_eq!(account_name("/etc/passwd", 4_000_000_000), "4000000000");
        assert!(effective_ids().is_some());
    }

    #[test]
    fn the_console_token_comes_from_a_file_or_the_key() {
        let s = Settings::load_from(None, env(&[])).unwrap();
        assert!(s.console.listen.is_none());
        assert!(s.console.token().unwrap().is_none(), "read-only by default");
        let dir = std::env::temp_dir().join(format!("tm-console-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("console-token");
        std::fs::write(&file, "0123456789abcdef0123\n").unwrap();
        let path = file.display().to_string();
        let s = Settings::load_from(
            None,
            env(&[
                ("TABLEMAIL__CONSOLE__LISTEN", "127.0.0.1:9899"),
                ("TABLEMAIL__CONSOLE__TOKEN_FILE", &path),
            ]),
        )
        .unwrap();
        let token = s.console.token().unwrap().unwrap();
        assert_eq!(token.expose_secret(), "0123456789abcdef0123");
        assert!(!format!("{s:?}").contains("0123456789abcdef0123"));
        for (pairs, key) in [
            (
                vec![("TABLEMAIL__CONSOLE__TOKEN", "short")],
                "console.token: the token must be at least 16",
            ),
            (
                vec![
                    ("TABLEMAIL__CONSOLE__TOKEN", "0123456789abcdef0123"),
                    ("TABLEMAIL__CONSOLE__TOKEN_FILE", path.as_str()),
                ],
                "console.token_file: set either",
            ),
            (
                vec![("TABLEMAIL__CONSOLE__TOKEN_FILE", "/nonexistent/token")],
                "console.token_file: cannot read /nonexistent/token",
            ),
            (
                vec![("TABLEMAIL__CONSOLE__LISTEN", "anywhere")],
                "console.listen",
            ),
        ] {
            let err = Settings::load_from(None, env(&pairs))
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{err}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn byte_sizes_parse() {
        assert_eq!("25MB".parse::<ByteSize>().unwrap(), ByteSize(25_000_000));
        assert_eq!("512 KiB".parse::<ByteSize>().unwrap(), ByteSize(512 * 1024));
        assert_eq!("100".parse::<ByteSize>().unwrap(), ByteSize(100));
        assert!("12 parsecs".parse::<ByteSize>().is_err());
        assert!("MB".parse::<ByteSize>().is_err());
    }
}
