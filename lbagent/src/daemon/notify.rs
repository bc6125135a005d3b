//! systemd's readiness protocol (`sd_notify(3)`): with `Type=notify` the
//! unit is started once the daemon sends `READY=1` to `$NOTIFY_SOCKET`,
//! which it does after its first apply; `STOPPING=1` on a clean stop. No
//! socket (not under systemd): nothing is sent.

use std::os::unix::net::UnixDatagram;

/// Sends `msg` to `$NOTIFY_SOCKET` (a path, or `@name` for the abstract
/// namespace). Errors are logged, never fatal.
pub fn notify(msg: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let sent = (|| -> std::io::Result<()> {
        let sock = UnixDatagram::unbound()?;
        let bytes = path.as_encoded_bytes();
        if let Some(name) = bytes.strip_prefix(b"@") {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.send_to_addr(msg.as_bytes(), &addr)?;
        } else {
            sock.send_to(msg.as_bytes(), &path)?;
        }
        Ok(())
    })();
    if let Err(e) = sent {
        tracing::warn!("notifying systemd ({}): {e}", path.to_string_lossy());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ready_reaches_the_socket() {
        let dir = std::env::temp_dir().join(format!("lbagent-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let server = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        // SAFETY: this test is the only one touching NOTIFY_SOCKET, and it
        // sets it before any thread of its own reads the environment.
        unsafe { std::env::set_var("NOTIFY_SOCKET", &path) };
        super::notify("READY=1\nSTATUS=applied");
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=applied");
        // SAFETY: as above.
        unsafe { std::env::remove_var("NOTIFY_SOCKET") };
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
