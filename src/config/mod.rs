//! Settings: compiled-in defaults < config file < `TABLEMAIL__SECTION__KEY` env.
//!
//! Every struct denies unknown fields, so a misspelt key is an error at start
//! instead of a silently ignored setting. Secrets are `SecretString`s, which never
//! print their value in `Debug` output or logs.
//!
//! - `sections`: one struct per section, its defaults and the client it
//!   builds.
//! - `delivery`: the delivery loop's sections (bounce, inbound,
//!   suppression).
//! - `webhooks`: the providers' webhooks (listener, keys).
//! - `files`: the config file and credential files.
//! - `limits`: the send caps shared by every daemon.

use std::{path::Path, time::Duration};

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::smtp::TransportKind;

mod delivery;
mod files;
mod limits;
mod sections;
mod webhooks;

pub use delivery::*;
pub use files::credential_path;
use files::{check_readable, read_credential};
pub use limits::*;
pub use sections::*;
pub use webhooks::*;

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
    pub dkim: DkimKeys,
    pub console: ConsoleSettings,
    pub bounce: BounceSettings,
    pub inbound: InboundSettings,
    pub suppression: SuppressionSettings,
    pub webhooks: WebhooksSettings,
    pub routes: Vec<RouteSettings>,
    /// Send caps shared by every daemon (DESIGN §16).
    pub limits: Vec<LimitSettings>,
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
        if self.database.look_interval < Duration::from_millis(1) {
            return Err(invalid("database.look_interval", "must be at least 1ms"));
        }
        if let Some(oauth2) = &self.transport.oauth2 {
            if self.transport.password.is_some() || self.transport.password_file.is_some() {
                return Err(invalid(
                    "transport.oauth2",
                    "set either a password or oauth2, not both",
                ));
            }
            // Reads the secrets now, so that a missing one stops the start.
            oauth2.tokens("transport.oauth2", self.transport.username.as_deref())?;
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
        for key in self.dkim.keys() {
            key.validate()?;
        }
        self.validate_routes()?;
        validate_limits(&self.limits)?;
        for limit in &self.limits {
            if let Some(route) = limit
                .route
                .iter()
                .find(|r| *r != "default" && !self.routes.iter().any(|n| &n.name == *r))
            {
                return Err(invalid(
                    "limits",
                    format!("limit {}: route `{route}` is not configured", limit.name),
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
        if let Some(domain) = &self.bounce.domain {
            let valid = !domain.is_empty()
                && domain.trim_end_matches('.').split('.').all(|label| {
                    !label.is_empty()
                        && label.len() <= 63
                        && label
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                });
            if !valid {
                return Err(invalid(
                    "bounce.domain",
                    "not a domain name such as `bounces.example.com` (A-labels)",
                ));
            }
        }
        self.bounce.verp()?;
        let inbound = &self.inbound;
        if let Some(listen) = &inbound.listen {
            listen
                .parse::<std::net::SocketAddr>()
                .map_err(|e| invalid("inbound.listen", format!("`{listen}`: {e}")))?;
            if self.bounce.domain.is_none() {
                return Err(invalid(
                    "inbound.listen",
                    "needs bounce.domain: the listener takes mail for that domain only",
                ));
            }
        }
        if inbound.tls_cert_file.is_some() != inbound.tls_key_file.is_some() {
            return Err(invalid(
                "inbound.tls_key_file",
                "set inbound.tls_cert_file and inbound.tls_key_file together",
            ));
        }
        if inbound.max_connections == 0 {
            return Err(invalid("inbound.max_connections", "must be at least 1"));
        }
        if inbound.timeout.is_zero() || inbound.session_limit.is_zero() {
            return Err(invalid(
                "inbound.timeout",
                "inbound.timeout and inbound.session_limit must be above zero",
            ));
        }
        self.webhooks.validate()?;
        tracing_subscriber::EnvFilter::try_new(&self.log.level)
            .map_err(|e| invalid("log.level", e.to_string()))?;
        Ok(())
    }

    /// Each route named once, in the form a row's `route` column can hold,
    /// with a relay of its own that parses, and its keys read now so that a
    /// missing one stops the start.
    fn validate_routes(&self) -> Result<()> {
        let invalid = |reason: String| ConfigError::Invalid {
            key: "routes",
            reason,
        };
        let mut names = std::collections::HashSet::new();
        for route in &self.routes {
            let name = &route.name;
            unique_name(name, &mut names, "routes").map_err(invalid)?;
            match TransportKind::parse(&route.url) {
                Ok(TransportKind::Smtp { .. }) => {}
                Ok(_) => {
                    return Err(invalid(format!(
                        "route {name}: url must be smtp:// or smtps://"
                    )))
                }
                Err(e) => return Err(invalid(format!("route {name}: url: {e}"))),
            }
            if route.oauth2.is_some() && route.password_file.is_some() {
                return Err(invalid(format!(
                    "route {name}: set either password_file or oauth2, not both"
                )));
            }
            if route.username.is_some() && route.password_file.is_none() && route.oauth2.is_none() {
                return Err(invalid(format!(
                    "route {name}: a username needs password_file or oauth2"
                )));
            }
            if let Some(oauth2) = &route.oauth2 {
                oauth2.tokens("routes.oauth2", route.username.as_deref())?;
            }
            if let Some(to) = &route.redirect_to {
                crate::mail::parse_address(to)
                    .map_err(|e| invalid(format!("route {name}: redirect_to: {e}")))?;
            }
            if let Some(dkim) = &route.dkim {
                dkim.validate()?;
            }
        }
        Ok(())
    }

    /// The SMTP password from `transport.password` or `transport.password_file`.
    pub fn smtp_password(&self) -> Result<Option<SecretString>> {
        self.transport.password()
    }
}

/// A `[[routes]]` or `[[limits]]` name, as a metric label carries it: 1 to
/// 64 letters, digits, `-`, `_` or `.`, not in `seen` yet (`what`: "routes").
fn unique_name<'a>(
    name: &'a str,
    seen: &mut std::collections::HashSet<&'a str>,
    what: &str,
) -> std::result::Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !valid {
        return Err(format!(
            "name `{name}`: 1 to 64 letters, digits, `-`, `_` or `.`"
        ));
    }
    if !seen.insert(name) {
        return Err(format!("two {what} are named `{name}`"));
    }
    Ok(())
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
        assert_eq!(s.database.look_interval, Duration::from_millis(100));
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
                ("TABLEMAIL__DATABASE__LOOK_INTERVAL", "2ms"),
                ("OTHER__WORKER__CONCURRENCY", "9"),
            ]),
        )
        .unwrap();
        assert_eq!(s.database.look_interval, Duration::from_millis(2));
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
        // A look interval of zero would look without pause.
        let err = Settings::load_from(None, env(&[("TABLEMAIL__DATABASE__LOOK_INTERVAL", "0s")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("database.look_interval: must be at least 1ms"),
            "{err}"
        );
    }

    #[test]
    fn routes_are_named_once_with_a_label_a_metric_can_carry() {
        let dir = std::env::temp_dir().join(format!("tm-routes-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t.toml");
        let route = |name: &str| {
            format!(
                "[[routes]]\nname = \"{name}\"\nfrom_domains = [\"{name}.example\"]\n\
                 url = \"smtp://localhost:2525\"\n"
            )
        };
        for (routes, says) in [
            (
                route("shop") + &route("shop"),
                "two routes are named `shop`",
            ),
            (route("a b"), "name `a b`: 1 to 64 letters"),
        ] {
            std::fs::write(&file, &routes).unwrap();
            let Err(err) = Settings::load_from(Some(&file), env(&[])) else {
                panic!("accepted: {routes}");
            };
            let err = err.to_string();
            assert!(err.contains(says), "{err}");
        }
        std::fs::write(&file, route("shop") + &route("support")).unwrap();
        Settings::load_from(Some(&file), env(&[])).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn dkim_takes_one_key_or_several() {
        let dir = std::env::temp_dir().join(format!("tm-dkim-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t.toml");
        std::fs::write(
            &file,
            "[[dkim]]\ndomain = \"shop.example\"\nselector = \"s1\"\nprivate_key_file = \"/k1\"\n\
             [[dkim]]\ndomain = \"example.org\"\nselector = \"s2\"\nprivate_key_file = \"/k2\"\n",
        )
        .unwrap();
        let s = Settings::load_from(Some(&file), env(&[])).unwrap();
        let domains: Vec<_> = s
            .dkim
            .keys()
            .iter()
            .map(|k| k.domain.clone().unwrap())
            .collect();
        assert_eq!(domains, ["shop.example", "example.org"]);
        // The single table, as before, from the file or the environment.
        let s = Settings::load_from(
            None,
            env(&[
                ("TABLEMAIL__DKIM__DOMAIN", "example.com"),
                ("TABLEMAIL__DKIM__SELECTOR", "s3"),
                ("TABLEMAIL__DKIM__PRIVATE_KEY_FILE", "/k3"),
            ]),
        )
        .unwrap();
        assert_eq!(s.dkim.keys().len(), 1);
        assert_eq!(s.dkim.keys()[0].selector.as_deref(), Some("s3"));
        let _ = std::fs::remove_dir_all(&dir);
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
        assert_eq!(
            refused(&[(url, "smtp://relay:25?tls=none")]),
            ["transport.url"]
        );
        // smtp:// means STARTTLS, except on this host.
        assert!(refused(&[(url, "smtp://relay:25")]).is_empty());
        assert_eq!(refused(&[(url, "smtp://127.0.0.1:25")]), ["transport.url"]);
        assert!(refused(&[(url, "smtp://relay:587?tls=required")]).is_empty());
        assert!(refused(&[(url, "smtps://relay")]).is_empty());
        assert!(refused(&[
            (url, "smtp://relay:25?tls=none"),
            ("TABLEMAIL__TRANSPORT__ALLOW_PLAINTEXT_AUTH", "true"),
        ])
        .is_empty());
        // The fallback's own login, judged by its own URL.
        let fallback = [
            (url, "smtps://relay"),
            (
                "TABLEMAIL__TRANSPORT__FALLBACK_URL",
                "smtp://backup:25?tls=none",
            ),
            ("TABLEMAIL__TRANSPORT__FALLBACK_USERNAME", "other"),
            ("TABLEMAIL__TRANSPORT__FALLBACK_PASSWORD_FILE", "/dev/null"),
        ];
        assert_eq!(refused(&fallback), ["transport.fallback_url"]);
        // No username, no password to protect.
        let s = Settings::load_from(None, env(&[(url, "smtp://relay:25")])).unwrap();
        assert!(s.transport.plaintext_auth_refused().is_empty());
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
