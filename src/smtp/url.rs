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
    /// Plain text: a relay on this host (`localhost`, a loopback address),
    /// or `?tls=none` said on purpose.
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
                // RFC 8314: a session is confidential only with TLS and a
                // certificate that validates. `smtp://` means STARTTLS,
                // required, except on this host, where there is no wire to
                // protect.
                let mut tls = if scheme == "smtps" {
                    TlsMode::Implicit
                } else if is_loopback(&host) {
                    TlsMode::None
                } else {
                    TlsMode::StartTls
                };
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    match pair {
                        "tls=required" if scheme == "smtp" => tls = TlsMode::StartTls,
                        "tls=none" if scheme == "smtp" => tls = TlsMode::None,
                        other => {
                            return Err(UrlError::Invalid(format!(
                                "unknown option `{other}` (smtp:// takes tls=required or tls=none)"
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

/// `localhost` or a loopback address: no wire to protect.
pub fn is_loopback(host: &str) -> bool {
    let host = host.trim_end_matches('.');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
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
            // STARTTLS unless said otherwise, except on this host.
            (
                "smtp://relay.example:2525",
                smtp("relay.example", 2525, TlsMode::StartTls),
            ),
            (
                "smtp://relay.example:2525?tls=none",
                smtp("relay.example", 2525, TlsMode::None),
            ),
            ("smtp://10.1.2.3", smtp("10.1.2.3", 25, TlsMode::StartTls)),
            (
                "smtp://127.0.0.1:2525",
                smtp("127.0.0.1", 2525, TlsMode::None),
            ),
            ("smtp://127.9.9.9", smtp("127.9.9.9", 25, TlsMode::None)),
            ("smtp://localhost", smtp("localhost", 25, TlsMode::None)),
            (
                "smtp://localhost?tls=required",
                smtp("localhost", 25, TlsMode::StartTls),
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
