//! `webhooks.*` (DESIGN §14): the HTTP listener for providers' reports and
//! each provider's key. A provider whose key is not set has no endpoint.

use std::{path::PathBuf, time::Duration};

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::feedback::webhooks::{self, Keys, PostmarkCredentials};

use super::{files::read_credential, sections::ByteSize, ConfigError, Result};

/// The webhook listener; off unless `listen` is set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebhooksSettings {
    /// e.g. `0.0.0.0:8025`: internet-facing, apart from the console.
    pub listen: Option<String>,
    /// Larger request bodies are refused (`413`); default 256KiB.
    pub max_body_size: ByteSize,
    /// Requests per second from one address (a burst of as many more);
    /// default 20, 0: no limit.
    pub rate_limit: u32,
    /// Longest a request may take, its body read and its report recorded;
    /// default 30s.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    pub ses: SesSettings,
    pub postmark: PostmarkSettings,
    pub mailgun: MailgunSettings,
    pub sendgrid: SendgridSettings,
}

impl Default for WebhooksSettings {
    fn default() -> Self {
        WebhooksSettings {
            listen: None,
            max_body_size: ByteSize(webhooks::DEFAULT_MAX_BODY_SIZE as u64),
            rate_limit: webhooks::DEFAULT_RATE_LIMIT,
            timeout: webhooks::DEFAULT_TIMEOUT,
            ses: SesSettings::default(),
            postmark: PostmarkSettings::default(),
            mailgun: MailgunSettings::default(),
            sendgrid: SendgridSettings::default(),
        }
    }
}

/// Amazon SES through SNS.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SesSettings {
    /// The SNS topics accepted, e.g.
    /// `arn:aws:sns:eu-west-1:123456789012:ses-feedback`. Empty: no SES
    /// endpoint (any AWS account can publish a validly signed message to a
    /// topic of its own, so the topics are named). A list in the file; in
    /// the environment, separated by commas.
    #[serde(deserialize_with = "list_or_commas")]
    pub topic_arns: Vec<String>,
}

/// A list of strings, or one string of comma-separated items (what an
/// environment variable can hold).
fn list_or_commas<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrList {
        One(String),
        List(Vec<String>),
    }
    Ok(match OneOrList::deserialize(d)? {
        OneOrList::One(text) => text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
        OneOrList::List(list) => list,
    })
}

/// Postmark: HTTP basic authentication.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct PostmarkSettings {
    /// A file holding `user:password`.
    pub credentials_file: Option<PathBuf>,
}

/// Mailgun: HMAC-SHA256 with the webhook signing key.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct MailgunSettings {
    /// A file holding the HTTP webhook signing key.
    pub signing_key_file: Option<PathBuf>,
}

/// SendGrid: the signed event webhook's ECDSA P-256 key.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SendgridSettings {
    /// A file holding the verification key as SendGrid shows it (base64 of
    /// the DER public key), or as PEM.
    pub public_key_file: Option<PathBuf>,
}

impl WebhooksSettings {
    /// Every provider's key, read from its file and checked.
    pub fn keys(&self) -> Result<Keys> {
        let invalid = |key: &'static str, reason: String| ConfigError::Invalid { key, reason };
        let mut keys = Keys::default();
        for arn in &self.ses.topic_arns {
            let valid = arn.starts_with("arn:aws") && arn.split(':').count() == 6;
            if !valid {
                return Err(invalid(
                    "webhooks.ses.topic_arns",
                    format!("`{arn}` is not an SNS topic ARN (arn:aws:sns:REGION:ACCOUNT:NAME)"),
                ));
            }
        }
        keys.ses_topics = self.ses.topic_arns.clone();
        if let Some(path) = &self.postmark.credentials_file {
            let key = "webhooks.postmark.credentials_file";
            let text = read_credential(key, path)?;
            let (user, password) = text
                .expose_secret()
                .split_once(':')
                .filter(|(u, p)| !u.is_empty() && !p.is_empty())
                .ok_or_else(|| invalid(key, "the file must hold `user:password`".into()))?;
            if password.chars().count() < webhooks::MIN_SECRET_LEN {
                return Err(invalid(
                    key,
                    format!(
                        "the password must be at least {} characters (e.g. `openssl rand -hex 24`)",
                        webhooks::MIN_SECRET_LEN
                    ),
                ));
            }
            keys.postmark = Some(PostmarkCredentials {
                user: user.to_string(),
                password: SecretString::from(password.to_string()),
            });
        }
        if let Some(path) = &self.mailgun.signing_key_file {
            let key = "webhooks.mailgun.signing_key_file";
            let secret = read_credential(key, path)?;
            let trimmed = secret.expose_secret().trim();
            if trimmed.chars().count() < webhooks::MIN_SECRET_LEN {
                return Err(invalid(
                    key,
                    format!(
                        "the signing key must be at least {} characters",
                        webhooks::MIN_SECRET_LEN
                    ),
                ));
            }
            keys.mailgun = Some(SecretString::from(trimmed.to_string()));
        }
        if let Some(path) = &self.sendgrid.public_key_file {
            let key = "webhooks.sendgrid.public_key_file";
            let text = read_credential(key, path)?;
            let public = webhooks::sendgrid::public_key(text.expose_secret())
                .map_err(|e| invalid(key, e.to_string()))?;
            keys.sendgrid = Some(public);
        }
        Ok(keys)
    }

    /// The providers whose endpoint is on, for `check` and the start's log.
    pub fn providers(&self) -> Vec<&'static str> {
        let mut on = Vec::new();
        if !self.ses.topic_arns.is_empty() {
            on.push("ses");
        }
        if self.postmark.credentials_file.is_some() {
            on.push("postmark");
        }
        if self.mailgun.signing_key_file.is_some() {
            on.push("mailgun");
        }
        if self.sendgrid.public_key_file.is_some() {
            on.push("sendgrid");
        }
        on
    }

    pub(super) fn validate(&self) -> Result<()> {
        let invalid = |key: &'static str, reason: String| ConfigError::Invalid { key, reason };
        if let Some(listen) = &self.listen {
            listen
                .parse::<std::net::SocketAddr>()
                .map_err(|e| invalid("webhooks.listen", format!("`{listen}`: {e}")))?;
        }
        if self.max_body_size.0 < 1024 || self.max_body_size.0 > 64 << 20 {
            return Err(invalid(
                "webhooks.max_body_size",
                "must be between 1KiB and 64MiB".into(),
            ));
        }
        if self.timeout < Duration::from_secs(1) {
            return Err(invalid("webhooks.timeout", "must be at least 1s".into()));
        }
        // Read now, so that a missing or bad key stops the start (exit 2).
        self.keys()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Settings;

    fn load(pairs: &[(&str, &str)]) -> Result<Settings, String> {
        let env = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        Settings::load_from(None, env).map_err(|e| e.to_string())
    }

    #[test]
    fn topics_come_as_a_list_or_comma_separated() {
        let s = load(&[(
            "TABLEMAIL__WEBHOOKS__SES__TOPIC_ARNS",
            "arn:aws:sns:eu-west-1:123456789012:a, arn:aws:sns:eu-west-1:123456789012:b",
        )])
        .unwrap();
        assert_eq!(s.webhooks.ses.topic_arns.len(), 2);
        assert_eq!(s.webhooks.providers(), ["ses"]);
        let err = load(&[("TABLEMAIL__WEBHOOKS__SES__TOPIC_ARNS", "my-topic")]).unwrap_err();
        assert!(err.contains("webhooks.ses.topic_arns"), "{err}");
    }

    #[test]
    fn keys_are_read_and_checked_at_start() {
        let dir = std::env::temp_dir().join(format!("tm-webhooks-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        };
        let good = file("postmark", "hooks:0123456789abcdef0123\n");
        let s = load(&[
            ("TABLEMAIL__WEBHOOKS__LISTEN", "127.0.0.1:8025"),
            ("TABLEMAIL__WEBHOOKS__POSTMARK__CREDENTIALS_FILE", &good),
        ])
        .unwrap();
        let keys = s.webhooks.keys().unwrap();
        assert_eq!(keys.postmark.unwrap().user, "hooks");
        assert!(!format!("{s:?}").contains("0123456789abcdef0123"));
        for (key, text, expected) in [
            (
                "TABLEMAIL__WEBHOOKS__POSTMARK__CREDENTIALS_FILE",
                "no colon here at all",
                "webhooks.postmark.credentials_file: the file must hold `user:password`",
            ),
            (
                "TABLEMAIL__WEBHOOKS__POSTMARK__CREDENTIALS_FILE",
                "hooks:short",
                "webhooks.postmark.credentials_file: the password must be at least 16",
            ),
            (
                "TABLEMAIL__WEBHOOKS__MAILGUN__SIGNING_KEY_FILE",
                "short",
                "webhooks.mailgun.signing_key_file: the signing key must be at least 16",
            ),
            (
                "TABLEMAIL__WEBHOOKS__SENDGRID__PUBLIC_KEY_FILE",
                "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE",
                "webhooks.sendgrid.public_key_file: not an ECDSA P-256 public key",
            ),
        ] {
            let path = file("key", text);
            let err = load(&[(key, &path)]).unwrap_err();
            assert!(err.contains(expected), "{err}");
        }
        let err = load(&[("TABLEMAIL__WEBHOOKS__LISTEN", "anywhere")]).unwrap_err();
        assert!(err.contains("webhooks.listen"), "{err}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
