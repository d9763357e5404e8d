//! Files the settings name: the config file, checked readable with a clear
//! reason when it is not, and credentials (`*_file` keys), looked up in
//! `$CREDENTIALS_DIRECTORY` when relative.

use std::path::Path;

use secrecy::SecretString;

use super::{ConfigError, Result};

/// Fails, saying why, unless this process can read the config file at
/// `path`: a file the service's user may not read (the classic 0640 root
/// file under a systemd `DynamicUser`) is named with its mode, its owner and
/// who we run as.
pub(super) fn check_readable(path: &Path) -> Result<()> {
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
pub(super) fn effective_ids() -> Option<(u32, u32)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let effective = |key: &str| -> Option<u32> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().nth(1)?.parse().ok()
    };
    Some((effective("Uid:")?, effective("Gid:")?))
}

/// The name of the user (or group) `id` in `file` (`/etc/passwd`,
/// `/etc/group`), or the number when it has none there.
pub(super) fn account_name(file: &str, id: u32) -> String {
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

/// Where a `*_file` key's file is: a relative path in
/// `$CREDENTIALS_DIRECTORY` when that is set (systemd's `LoadCredential=`).
pub fn credential_path(path: &Path) -> std::path::PathBuf {
    match std::env::var_os("CREDENTIALS_DIRECTORY") {
        Some(dir) if path.is_relative() => Path::new(&dir).join(path),
        _ => path.to_path_buf(),
    }
}

/// A secret kept in a file: a relative path is looked up in
/// `$CREDENTIALS_DIRECTORY` first, which is where systemd's `LoadCredential=`
/// puts it. One trailing line break is not part of the secret.
pub(super) fn read_credential(key: &'static str, path: &Path) -> Result<SecretString> {
    let path = credential_path(path);
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

    #[test]
    fn accounts_are_named_from_the_system_files() {
        assert_eq!(account_name("/etc/passwd", 0), "root");
        assert_eq!(account_name("/etc/passwd", 4_000_000_000), "4000000000");
        assert!(effective_ids().is_some());
    }
}
