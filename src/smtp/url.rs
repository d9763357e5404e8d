//! `transport.url`: where mail goes, parsed in one place.

use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("not a transport URL: use smtp://, smtps:// or file://")]
    Scheme,
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// Plain text, for a relay on the same host or network.
    None,
    /// STARTTLS, never downgraded to plain text.
    StartTls,
    /// TLS from the first byte (`smtps://`).
    Implicit,
}

/// What `transport.url` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportKind {
    Smtp {
        host: String,
        port: u16,
        tls: TlsMode,
    },
    File {
        dir: PathBuf,
    },
}

impl TransportKind {
    /// Parses a URL. Errors never repeat the URL: it may hold a password.
    pub fn parse(url: &str) -> Result<TransportKind, UrlError> {
        let (scheme, rest) = url.split_once("://").ok_or(UrlError::Scheme)?;
        match scheme {
            "file" => {
                if rest.is_empty() {
                    return Err(UrlError::Invalid("file:// needs a directory".into()));
                }
                Ok(TransportKind::File {
                    dir: PathBuf::from(rest),
                })
            }
            "smtp" | "smtps" => {
                let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
                let authority = authority.trim_end_matches('/');
                let default_port = if scheme == "smtps" { 465 } else { 25 };
                let (host, port) = split_host_port(authority, default_port)?;
                let mut tls = if scheme == "smtps" {
                    TlsMode::Implicit
                } else {
                    TlsMode::None
                };
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    match pair {
                        "tls=required" if scheme == "smtp" => tls = TlsMode::StartTls,
                        "tls=none" if scheme == "smtp" => tls = TlsMode::None,
                        other => {
                            return Err(UrlError::Invalid(format!(
                                "unknown option `{other}` (smtp:// takes tls=required)"
                            )))
                        }
                    }
                }
                Ok(TransportKind::Smtp { host, port, tls })
            }
            _ => Err(UrlError::Scheme),
        }
    }
}

fn split_host_port(authority: &str, default_port: u16) -> Result<(String, u16), UrlError> {
    if authority.is_empty() || authority.contains('@') {
        return Err(UrlError::Invalid(
            "the URL needs a host, and no credentials (they go in transport.username/password)"
                .into(),
        ));
    }
    let invalid = || UrlError::Invalid(format!("`{authority}` is not host:port"));
    if let Some(v6) = authority.strip_prefix('[') {
        let (host, rest) = v6.split_once(']').ok_or_else(invalid)?;
        let port = match rest.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| invalid())?,
            None if rest.is_empty() => default_port,
            None => return Err(invalid()),
        };
        return Ok((host.to_string(), port));
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => Ok((host.to_string(), port.parse().map_err(|_| invalid())?)),
        None => Ok((authority.to_string(), default_port)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_transport_urls() {
        let smtp = |host: &str, port, tls| TransportKind::Smtp {
            host: host.into(),
            port,
            tls,
        };
        let cases = [
            (
                "smtp://relay.example:2525",
                smtp("relay.example", 2525, TlsMode::None),
            ),
            (
                "smtp://relay.example:587?tls=required",
                smtp("relay.example", 587, TlsMode::StartTls),
            ),
            (
                "smtps://relay.example",
                smtp("relay.example", 465, TlsMode::Implicit),
            ),
            ("smtp://[::1]:25", smtp("::1", 25, TlsMode::None)),
            (
                "file://./outbox",
                TransportKind::File {
                    dir: PathBuf::from("./outbox"),
                },
            ),
        ];
        for (url, kind) in cases {
            assert_eq!(TransportKind::parse(url).unwrap(), kind, "{url}");
        }
        for bad in [
            "http://x",
            "smtp://x:notaport",
            "smtp://user:pw@x:25",
            "smtp://x:25?tls=maybe",
            "relay.example:25",
        ] {
            assert!(TransportKind::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn errors_never_echo_credentials() {
        for url in ["user:s3cret@relay:25", "smtp://user:s3cret@relay:25"] {
            let e = TransportKind::parse(url).unwrap_err().to_string();
            assert!(!e.contains("s3cret"), "{e}");
        }
    }
}
