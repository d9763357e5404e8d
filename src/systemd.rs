//! The systemd notify protocol (sd_notify(3)): `READY=1` once the daemon can
//! work, `WATCHDOG=1` while it keeps working, `STOPPING=1` when it drains.
//! Datagrams to `$NOTIFY_SOCKET`; without that variable (not under systemd,
//! or not `Type=notify`) every call does nothing.

use std::{
    os::unix::net::{SocketAddr, UnixDatagram},
    time::Duration,
};

/// Sends one state line to systemd, if it is listening.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = UnixDatagram::unbound().and_then(|socket| {
        let bytes = path.as_encoded_bytes();
        // "@name" is a socket in the abstract namespace.
        let addr = match bytes.strip_prefix(b"@") {
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(name)?
            }
            None => SocketAddr::from_pathname(&path)?,
        };
        socket.send_to_addr(state.as_bytes(), &addr)
    });
    if let Err(e) = sent {
        tracing::warn!(error = %e, state, "cannot notify systemd");
    }
}

/// How often systemd expects `WATCHDOG=1` (`WatchdogSec=`), if it does.
pub fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok()? != std::process::id() {
            return None;
        }
    }
    (usec > 0).then(|| Duration::from_micros(usec))
}
