//! A network namespace of the test's own (`NetNs`): a host that is not this
//! one as far as an address can tell, for what tablemail decides by address
//! (a relay that is not loopback must speak TLS). A veth pair joins it to
//! this host: `host_addr` on this side, `ns_addr` inside, in a /24 drawn at
//! random from 10.231.0.0 to 10.250.255.0 so that tests running at once do
//! not clash. Everything is removed on drop. Traffic goes only between the
//! two ends of the pair.

use std::process::{Command, Stdio};

use super::{in_ci, running_as_root};

pub struct NetNs {
    pub name: String,
    /// This side's address.
    pub host_addr: String,
    /// The namespace's address.
    pub ns_addr: String,
    /// This side's end of the veth pair.
    veth: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl NetNs {
    /// A new namespace, or `None` (said on stderr) when this machine cannot
    /// make one: not root, or no `ip`. Under CI=true that fails the test.
    pub fn new() -> Option<NetNs> {
        let why = if !running_as_root() {
            Some("not root".to_string())
        } else if Command::new("ip")
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            Some("`ip` (iproute2) is not installed".to_string())
        } else {
            None
        };
        if let Some(why) = why {
            assert!(
                !in_ci(),
                "a network namespace is needed under CI=true: {why}"
            );
            eprintln!("SKIPPED: no network namespace: {why}");
            return None;
        }
        let mut last = String::new();
        for _ in 0..5 {
            match Self::try_new() {
                Ok(ns) => return Some(ns),
                Err(e) => last = e,
            }
        }
        panic!("could not make a network namespace: {last}");
    }

    fn try_new() -> Result<NetNs, String> {
        let random = uuid::Uuid::new_v4();
        let bytes = random.as_bytes();
        let (x, y) = (231 + bytes[0] % 20, bytes[1]);
        let id = &random.simple().to_string()[..8];
        let name = format!("tm{id}");
        // Interface names: at most 15 bytes.
        let (veth, peer) = (format!("tmh{id}"), format!("tmn{id}"));
        let ns = NetNs {
            name: name.clone(),
            host_addr: format!("10.{x}.{y}.1"),
            ns_addr: format!("10.{x}.{y}.2"),
            veth: veth.clone(),
        };
        // A /24 another test (or anything else) already uses is drawn again.
        let taken = Command::new("ip")
            .args(["-4", "-o", "addr", "show"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).contains(&format!(" 10.{x}.{y}.")))
            .unwrap_or(false);
        if taken {
            return Err(format!("10.{x}.{y}.0/24 is in use"));
        }
        ip(&["netns", "add", &name])?;
        // From here on, drop removes what was made.
        let host_cidr = format!("{}/24", ns.host_addr);
        let ns_cidr = format!("{}/24", ns.ns_addr);
        ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer])?;
        ip(&["link", "set", &peer, "netns", &name])?;
        ip(&["addr", "add", &host_cidr, "dev", &veth])?;
        ip(&["link", "set", &veth, "up"])?;
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &name, "ip"];
            all.extend_from_slice(args);
            ip(&all)
        };
        inside(&["addr", "add", &ns_cidr, "dev", &peer])?;
        inside(&["link", "set", &peer, "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The prefix that runs a command inside: `ip netns exec NAME`.
    pub fn exec(&self) -> [&str; 4] {
        ["ip", "netns", "exec", &self.name]
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it
        // this one; said again in case the namespace was never joined.
        let _ = ip(&["netns", "del", &self.name]);
        let _ = ip(&["link", "del", &self.veth]);
    }
}
