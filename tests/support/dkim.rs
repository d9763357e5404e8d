//! DKIM as a receiver checks it: keys made by openssl with their DNS TXT
//! records (`DkimKey`), dkimpy's verdict on a message with those records
//! published (`dkim_verdict`, `tests/support/dkim_verify.py`), and the tags
//! of a DKIM-Signature (`dkim_tags`).

use std::{
    collections::HashMap,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

/// An Ed25519 key made by openssl, for `domain` under `selector`.
pub struct DkimKey {
    pub domain: String,
    pub selector: String,
    /// The private key (PKCS#8 PEM), for `private_key_file`.
    pub file: PathBuf,
    /// The TXT record a receiver finds at `name()`.
    pub record: String,
}

impl DkimKey {
    pub fn new(dir: &Path, domain: &str, selector: &str) -> DkimKey {
        let file = dir.join(format!("{selector}.{domain}.pem"));
        let made = Command::new("openssl")
            .args(["genpkey", "-algorithm", "ed25519", "-out"])
            .arg(&file)
            .output()
            .expect("openssl");
        assert!(made.status.success(), "{made:?}");
        let public = Command::new("openssl")
            .args(["pkey", "-pubout", "-outform", "DER", "-in"])
            .arg(&file)
            .output()
            .expect("openssl");
        assert!(public.status.success());
        use base64::Engine as _;
        // RFC 8463: the raw 32-byte key, the end of the SubjectPublicKeyInfo.
        let raw = &public.stdout[public.stdout.len() - 32..];
        DkimKey {
            domain: domain.into(),
            selector: selector.into(),
            file,
            record: format!(
                "v=DKIM1; k=ed25519; p={}",
                base64::engine::general_purpose::STANDARD.encode(raw)
            ),
        }
    }

    /// Where the record is published: `selector._domainkey.domain`.
    pub fn name(&self) -> String {
        format!("{}._domainkey.{}", self.selector, self.domain)
    }

    /// The key as a TOML table's lines (`[[dkim]]`, a route's `dkim`).
    pub fn toml(&self) -> String {
        format!(
            "domain = \"{}\"\nselector = \"{}\"\nprivate_key_file = \"{}\"\n",
            self.domain,
            self.selector,
            self.file.display()
        )
    }
}

/// dkimpy's verdict on `message` with `keys` published in DNS: "pass" or
/// "fail: …".
pub fn dkim_verdict(message: &str, keys: &[&DkimKey]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/dkim_verify.py");
    let mut cmd = Command::new("python3");
    cmd.arg(script);
    for key in keys {
        cmd.arg(key.name()).arg(&key.record);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 with dkimpy (scripts/test installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(message.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "dkim_verify.py failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The tags of a DKIM-Signature header's value (`d`, `s`, `h`, …), their
/// values without folding white space.
pub fn dkim_tags(signature: &str) -> HashMap<String, String> {
    signature
        .split(';')
        .filter_map(|tag| tag.split_once('='))
        .map(|(k, v)| {
            (
                k.trim().to_ascii_lowercase(),
                v.split_whitespace().collect::<String>(),
            )
        })
        .collect()
}
