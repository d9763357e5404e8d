//! The delivery loop's sections (DESIGN §12): `bounce.*` (the VERP envelope
//! sender), `inbound.*` (the SMTP listener for reports) and
//! `suppression.*` (what reports do to the suppression list).

use std::{path::PathBuf, time::Duration};

use secrecy::ExposeSecret;
use serde::Deserialize;

use crate::{
    feedback::{inbound, verp::Verp},
    store::SuppressionPolicy,
};

use super::{files::read_credential, sections::ByteSize, ConfigError, Result};

/// VERP: every mail's envelope sender is `b-<id>-<tag>@<domain>`; off
/// unless `domain` is set.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct BounceSettings {
    pub domain: Option<String>,
    /// The key of the tags; required with `domain`. Read like
    /// `transport.password_file`.
    pub secret_file: Option<PathBuf>,
}

/// A secret shorter than this is refused: the tag is all that stands
/// between a forged report and the suppression list.
pub const BOUNCE_SECRET_MIN_LEN: usize = 16;

impl BounceSettings {
    /// The VERP signer these settings name, its key read and checked.
    pub fn verp(&self) -> Result<Option<Verp>> {
        let Some(domain) = &self.domain else {
            return Ok(None);
        };
        let Some(file) = &self.secret_file else {
            return Err(ConfigError::Invalid {
                key: "bounce.secret_file",
                reason: "required with bounce.domain (e.g. `openssl rand -hex 32`)".into(),
            });
        };
        let secret = read_credential("bounce.secret_file", file)?;
        if secret.expose_secret().len() < BOUNCE_SECRET_MIN_LEN {
            return Err(ConfigError::Invalid {
                key: "bounce.secret_file",
                reason: format!(
                    "the secret must be at least {BOUNCE_SECRET_MIN_LEN} characters \
                     (e.g. `openssl rand -hex 32`)"
                ),
            });
        }
        Ok(Some(Verp::new(domain, secret.expose_secret().as_bytes())))
    }
}

/// The SMTP listener for reports; off unless `listen` is set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InboundSettings {
    /// e.g. `0.0.0.0:25`; needs `bounce.domain`.
    pub listen: Option<String>,
    /// Larger reports are refused (`552`); default 10MB.
    pub max_message_size: ByteSize,
    /// Connections at once; more are told `421` and closed. Default 64.
    pub max_connections: usize,
    /// Wait for each command (and each line of data); default 5m, as RFC
    /// 5321 asks of a server.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Longest a connection may last; default 30m (a large report over a
    /// slow link).
    #[serde(with = "humantime_serde")]
    pub session_limit: Duration,
    /// STARTTLS: a PEM certificate chain and its key.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// Keep each report as received in `mail_feedback.raw`; default false.
    pub keep_raw: bool,
}

impl Default for InboundSettings {
    fn default() -> Self {
        InboundSettings {
            listen: None,
            max_message_size: ByteSize(inbound::DEFAULT_MAX_MESSAGE_SIZE as u64),
            max_connections: inbound::DEFAULT_MAX_CONNECTIONS,
            timeout: inbound::DEFAULT_TIMEOUT,
            session_limit: inbound::DEFAULT_SESSION_LIMIT,
            tls_cert_file: None,
            tls_key_file: None,
            keep_raw: false,
        }
    }
}

/// What reports do to the suppression list.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SuppressionSettings {
    /// Soft bounces of one address within `soft_bounce_window` that
    /// suppress it for `soft_bounce_ttl`; default 3 (0: never).
    pub soft_bounce_limit: u32,
    #[serde(with = "humantime_serde")]
    pub soft_bounce_window: Duration,
    #[serde(with = "humantime_serde")]
    pub soft_bounce_ttl: Duration,
    /// A complaint suppresses its address until removed; default true.
    pub complaints: bool,
}

impl Default for SuppressionSettings {
    fn default() -> Self {
        let policy = SuppressionPolicy::default();
        SuppressionSettings {
            soft_bounce_limit: policy.soft_bounce_limit,
            soft_bounce_window: policy.soft_bounce_window,
            soft_bounce_ttl: policy.soft_bounce_ttl,
            complaints: policy.complaints,
        }
    }
}

impl SuppressionSettings {
    pub fn policy(&self) -> SuppressionPolicy {
        SuppressionPolicy {
            soft_bounce_limit: self.soft_bounce_limit,
            soft_bounce_window: self.soft_bounce_window,
            soft_bounce_ttl: self.soft_bounce_ttl,
            complaints: self.complaints,
        }
    }
}

/// Whether `bounce_domain` aligns with the sender's domain for SPF under
/// DMARC's relaxed alignment: the same organisational domain. The
/// organisational domain is taken as the last two labels (three when the
/// second-to-last is a short public second level such as `co.uk`), which
/// is right for most domains without shipping the public suffix list; a
/// false warning costs a line in `check`, not a mail.
pub fn aligned(bounce_domain: &str, from_domain: &str) -> bool {
    let bounce = bounce_domain.trim_end_matches('.').to_ascii_lowercase();
    let from = from_domain.trim_end_matches('.').to_ascii_lowercase();
    organisational(&bounce) == organisational(&from)
}

fn organisational(domain: &str) -> &str {
    let labels: Vec<&str> = domain.split('.').collect();
    let keep = match labels.as_slice() {
        [.., second, top] if top.len() == 2 && second.len() <= 3 && labels.len() > 2 => 3,
        _ => 2,
    };
    let start = labels.len().saturating_sub(keep);
    let skip: usize = labels[..start].iter().map(|l| l.len() + 1).sum();
    &domain[skip..]
}

#[cfg(test)]
mod tests {
    use super::aligned;

    #[test]
    fn alignment_compares_organisational_domains() {
        assert!(aligned("bounces.example.com", "example.com"));
        assert!(aligned("bounces.example.com", "shop.example.com"));
        assert!(aligned("example.com", "example.com."));
        assert!(aligned("b.shop.example.co.uk", "example.co.uk"));
        assert!(!aligned("bounces.example.net", "example.com"));
        assert!(!aligned("bounces.other.co.uk", "example.co.uk"));
        assert!(!aligned("example.com", "com"));
    }
}
