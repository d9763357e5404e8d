//! Amazon SNS's side of `/webhooks/ses`: the only addresses fetched
//! (`https://sns.<region>.amazonaws.com/…`), the HTTPS GET that fetches
//! them, and the signing certificate: fetched once, chained to a trusted
//! root, cached, and asked whether it signed a message (SignatureVersion 1:
//! RSA with SHA-1, 2: RSA with SHA-256).
//!
//! The certificate is verified by rustls's own X.509 verifier (webpki)
//! against the Mozilla roots compiled in (`webpki-roots`): a certificate
//! that chains to no trusted root is refused, whoever serves it. Its
//! intermediates are those its file holds and those the HTTPS server
//! presented (Amazon's issue both).
//!
//! Tests need a certificate authority and a server of their own. In debug
//! builds only, two environment variables read at start replace the roots
//! and where `sns.*.amazonaws.com` is reached: `TABLEMAIL_TEST_SNS_CA` (a
//! PEM file of roots) and `TABLEMAIL_TEST_SNS_ADDRESS` (`host:port`). A
//! release build has no such code: neither the configuration file nor the
//! environment can change whom it trusts.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::body::Bytes;
use http_body_util::{BodyExt as _, Empty, Limited};
use tokio_rustls::rustls::{
    self,
    pki_types::{
        alg_id, pem::PemObject as _, AlgorithmIdentifier, CertificateDer, InvalidSignature,
        ServerName, SignatureVerificationAlgorithm, TrustAnchor, UnixTime,
    },
};

/// How long a connection, a TLS handshake, a request may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest certificate file or answer read.
const MAX_ANSWER: usize = 64 * 1024;
/// How long a certificate stays cached, and how many are.
const CACHE_FOR: Duration = Duration::from_secs(24 * 3600);
const MAX_CACHED: usize = 64;

/// Where a URL points, once it is one of SNS's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnsUrl {
    /// `sns.<region>.amazonaws.com`
    pub host: String,
    /// From the first `/`, query included.
    pub path: String,
}

/// `https://sns.<region>.amazonaws.com/…` and nothing else: no user, no
/// port, a region of letters, digits and dashes. `certificate`: the path
/// must also end in `.pem` and carry no query.
pub fn sns_url(url: &str, certificate: bool) -> Option<SnsUrl> {
    let rest = url.strip_prefix("https://")?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (host, path) = rest.split_at(end);
    let region = host.strip_prefix("sns.")?.strip_suffix(".amazonaws.com")?;
    let region_ok = !region.is_empty()
        && region.len() <= 32
        && region
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    let path_ok =
        path.starts_with('/') && !path.contains('#') && path.bytes().all(|b| b.is_ascii_graphic());
    let pem_ok = !certificate || (path.ends_with(".pem") && !path.contains('?'));
    (region_ok && path_ok && pem_ok).then(|| SnsUrl {
        host: host.to_string(),
        path: path.to_string(),
    })
}

/// Whom the SNS side trusts and where it connects.
#[derive(Clone)]
pub struct Trust {
    anchors: Arc<Vec<TrustAnchor<'static>>>,
    tls: Arc<rustls::ClientConfig>,
    /// Debug builds: where every SNS host is reached (a test's server).
    address: Option<String>,
}

impl Trust {
    /// The Mozilla roots; in a debug build, a test's own when it names them.
    pub fn aws() -> Trust {
        #[cfg(debug_assertions)]
        if let Some(trust) = Self::for_tests() {
            return trust;
        }
        Self::with_anchors(webpki_roots::TLS_SERVER_ROOTS.to_vec(), None)
    }

    fn with_anchors(anchors: Vec<TrustAnchor<'static>>, address: Option<String>) -> Trust {
        let roots = rustls::RootCertStore {
            roots: anchors.clone(),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        Trust {
            anchors: Arc::new(anchors),
            tls: Arc::new(tls),
            address,
        }
    }

    /// `TABLEMAIL_TEST_SNS_CA` and `TABLEMAIL_TEST_SNS_ADDRESS`, read at
    /// start; compiled into debug builds only.
    #[cfg(debug_assertions)]
    fn for_tests() -> Option<Trust> {
        let file = std::env::var_os("TABLEMAIL_TEST_SNS_CA")?;
        let roots: Vec<TrustAnchor<'static>> = CertificateDer::pem_file_iter(&file)
            .ok()?
            .filter_map(Result::ok)
            .filter_map(|der| {
                webpki::anchor_from_trusted_cert(&der)
                    .ok()
                    .map(|a| a.to_owned())
            })
            .collect();
        let address = std::env::var("TABLEMAIL_TEST_SNS_ADDRESS").ok();
        tracing::warn!(
            roots = roots.len(),
            address = address.as_deref(),
            "webhooks: SNS trusts a test's certificate authority (debug build)"
        );
        Some(Self::with_anchors(roots, address))
    }

    /// `GET https://<url.host><url.path>`: the answer's body when it is a
    /// 200 within [`MAX_ANSWER`] octets, with the certificates the server
    /// presented after its own.
    pub async fn get(&self, url: &SnsUrl) -> Result<(Bytes, Vec<CertificateDer<'static>>), String> {
        tokio::time::timeout(FETCH_TIMEOUT, self.get_within(url))
            .await
            .map_err(|_| format!("no answer from {} within {FETCH_TIMEOUT:?}", url.host))?
    }

    async fn get_within(
        &self,
        url: &SnsUrl,
    ) -> Result<(Bytes, Vec<CertificateDer<'static>>), String> {
        let address = self
            .address
            .clone()
            .unwrap_or_else(|| format!("{}:443", url.host));
        let tcp = tokio::net::TcpStream::connect(&address)
            .await
            .map_err(|e| format!("connecting to {}: {e}", url.host))?;
        let _ = tcp.set_nodelay(true);
        let name = ServerName::try_from(url.host.clone()).map_err(|e| e.to_string())?;
        let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {}: {e}", url.host))?;
        let presented: Vec<CertificateDer<'static>> = tls
            .get_ref()
            .1
            .peer_certificates()
            .map(|chain| {
                chain
                    .iter()
                    .skip(1)
                    .map(|c| c.clone().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .map_err(|e| format!("HTTP with {}: {e}", url.host))?;
        let connection = tokio::spawn(connection);
        let request = axum::http::Request::get(url.path.as_str())
            .header(axum::http::header::HOST, url.host.as_str())
            .header(axum::http::header::USER_AGENT, "tablemail")
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let answer = sender
            .send_request(request)
            .await
            .map_err(|e| format!("GET from {}: {e}", url.host))?;
        let status = answer.status();
        let body = Limited::new(answer.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| format!("reading the answer of {}: {e}", url.host))?
            .to_bytes();
        connection.abort();
        if status != axum::http::StatusCode::OK {
            return Err(format!("{} answered {status}", url.host));
        }
        Ok((body, presented))
    }
}

/// Why a message's signature was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertError {
    /// Cannot say now: the certificate could not be fetched.
    Unreachable(String),
    /// The certificate, or the signature, is not good.
    Refused(&'static str),
}

/// A verified signing certificate and its chain.
struct Verified {
    cert: CertificateDer<'static>,
    at: Instant,
}

/// The signing certificates fetched, by URL.
pub struct Certificates {
    trust: Trust,
    cache: Mutex<HashMap<String, Arc<Verified>>>,
    /// One fetch at a time: a burst of notifications fetches once.
    fetching: tokio::sync::Mutex<()>,
}

impl Certificates {
    pub fn new(trust: Trust) -> Certificates {
        Certificates {
            trust,
            cache: Mutex::new(HashMap::new()),
            fetching: tokio::sync::Mutex::new(()),
        }
    }

    pub fn trust(&self) -> &Trust {
        &self.trust
    }

    fn cached(&self, url: &str) -> Option<Arc<Verified>> {
        let cache = self
            .cache
            .lock()
            .expect("the certificate cache is never poisoned");
        cache
            .get(url)
            .filter(|v| v.at.elapsed() < CACHE_FOR)
            .cloned()
    }

    /// Whether the certificate at `url` (an SNS URL already checked) signed
    /// `message`; `version` is the SignatureVersion, "1" or "2".
    pub async fn verify(
        &self,
        url: &SnsUrl,
        message: &[u8],
        signature: &[u8],
        version: &str,
    ) -> Result<(), CertError> {
        let key = format!("{}{}", url.host, url.path);
        let verified = match self.cached(&key) {
            Some(v) => v,
            None => {
                let _one = self.fetching.lock().await;
                match self.cached(&key) {
                    Some(v) => v,
                    None => {
                        let fetched = self.fetch(url).await?;
                        let mut cache = self
                            .cache
                            .lock()
                            .expect("the certificate cache is never poisoned");
                        cache.retain(|_, v| v.at.elapsed() < CACHE_FOR);
                        if cache.len() >= MAX_CACHED {
                            cache.clear();
                        }
                        cache.insert(key, fetched.clone());
                        fetched
                    }
                }
            }
        };
        let cert = webpki::EndEntityCert::try_from(&verified.cert)
            .map_err(|_| CertError::Refused("certificate unreadable"))?;
        let algorithm: &dyn SignatureVerificationAlgorithm = match version {
            "1" => &RSA_PKCS1_SHA1,
            "2" => webpki::ring::RSA_PKCS1_2048_8192_SHA256,
            _ => return Err(CertError::Refused("unknown SignatureVersion")),
        };
        cert.verify_signature(algorithm, message, signature)
            .map_err(|_| CertError::Refused("signature does not verify"))
    }

    /// Fetches the certificate and checks that it chains to a trusted root
    /// today.
    async fn fetch(&self, url: &SnsUrl) -> Result<Arc<Verified>, CertError> {
        let (pem, presented) = self.trust.get(url).await.map_err(CertError::Unreachable)?;
        let mut certs = CertificateDer::pem_slice_iter(&pem)
            .map(|c| c.map(CertificateDer::into_owned))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| CertError::Refused("certificate file unreadable"))?;
        if certs.is_empty() {
            return Err(CertError::Refused("no certificate in the file"));
        }
        let leaf = certs.remove(0);
        let mut intermediates = certs;
        intermediates.extend(presented);
        {
            let cert = webpki::EndEntityCert::try_from(&leaf)
                .map_err(|_| CertError::Refused("certificate unreadable"))?;
            cert.verify_for_usage(
                webpki::ALL_VERIFICATION_ALGS,
                &self.trust.anchors,
                &intermediates,
                UnixTime::now(),
                webpki::KeyUsage::server_auth(),
                None,
                None,
            )
            .map_err(|_| CertError::Refused("certificate does not chain to a trusted root"))?;
        }
        tracing::info!(host = %url.host, "SNS signing certificate fetched");
        Ok(Arc::new(Verified {
            cert: leaf,
            at: Instant::now(),
        }))
    }
}

/// RSA PKCS#1 v1.5 with SHA-1, which SNS's SignatureVersion 1 uses and
/// webpki no longer offers: ring's legacy verifier behind webpki's
/// interface, so the key is still taken from the verified certificate.
#[derive(Debug)]
struct RsaPkcs1Sha1;

static RSA_PKCS1_SHA1: RsaPkcs1Sha1 = RsaPkcs1Sha1;

impl SignatureVerificationAlgorithm for RsaPkcs1Sha1 {
    fn verify_signature(
        &self,
        public_key: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), InvalidSignature> {
        ring::signature::UnparsedPublicKey::new(
            &ring::signature::RSA_PKCS1_2048_8192_SHA1_FOR_LEGACY_USE_ONLY,
            public_key,
        )
        .verify(message, signature)
        .map_err(|_| InvalidSignature)
    }

    fn public_key_alg_id(&self) -> AlgorithmIdentifier {
        alg_id::RSA_ENCRYPTION
    }

    fn signature_alg_id(&self) -> AlgorithmIdentifier {
        // sha1WithRSAEncryption (1.2.840.113549.1.1.5), NULL parameters.
        AlgorithmIdentifier::from_slice(&[
            0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x05, 0x05, 0x00,
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sns_hosts_are_fetched() {
        let good = sns_url(
            "https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-0a1b.pem",
            true,
        )
        .unwrap();
        assert_eq!(good.host, "sns.eu-west-1.amazonaws.com");
        assert_eq!(good.path, "/SimpleNotificationService-0a1b.pem");
        for bad in [
            "http://sns.eu-west-1.amazonaws.com/x.pem",
            "https://sns.eu-west-1.amazonaws.com.evil.example/x.pem",
            "https://evil.example/sns.eu-west-1.amazonaws.com/x.pem",
            "https://sns.eu-west-1.amazonaws.com@evil.example/x.pem",
            "https://sns.eu-west-1.amazonaws.com:8443/x.pem",
            "https://sns.eu.west.1.amazonaws.com/x.pem",
            "https://sns..amazonaws.com/x.pem",
            "https://SNS.eu-west-1.amazonaws.com/x.pem",
            "https://sns.eu-west-1.amazonaws.com/x.txt",
            "https://sns.eu-west-1.amazonaws.com/x.pem?a=b",
            "https://sns.eu-west-1.amazonaws.com",
            "https://sns.eu-west-1.amazonaws.com\\@evil.example/x.pem",
        ] {
            assert_eq!(sns_url(bad, true), None, "{bad}");
        }
        let subscribe = sns_url(
            "https://sns.us-east-1.amazonaws.com/?Action=ConfirmSubscription&TopicArn=arn:aws:sns:us-east-1:1:t&Token=2336",
            false,
        )
        .unwrap();
        assert!(subscribe.path.starts_with("/?Action=ConfirmSubscription"));
    }
}
