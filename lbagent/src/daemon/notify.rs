//! systemd's readiness protocol (`sd_notify(3)`): with `Type=notify` the
//! unit is started once the daemon sends `READY=1` to `$NOTIFY_SOCKET`.
//! The daemon sends it after its first apply (a start returns with the
//! state in force), or — when its source has no document to give within
//! [`FIRST_DOCUMENT_WAIT`] (fleet mode before the host's first `fleet put`,
//! etcd unreachable with no usable cache) — without one, with a `STATUS=`
//! that says it is waiting, so neither `systemctl start` nor a package
//! install waits on etcd. `STATUS=` follows the first apply either way;
//! `STOPPING=1` on a clean stop. No socket (not under systemd): nothing is
//! sent.

use std::{os::unix::net::UnixDatagram, sync::Mutex, time::Duration};

/// How long the daemon waits for its first document before it reports
/// itself ready without one.
pub const FIRST_DOCUMENT_WAIT: Duration = Duration::from_secs(5);

/// Whether `READY=1` was sent. Held while a message is sent, so a waiting
/// `STATUS=` can never arrive after the first apply's.
static READY_SENT: Mutex<bool> = Mutex::new(false);

/// Sends `msg` to `$NOTIFY_SOCKET` (a path, or `@name` for the abstract
/// namespace). Errors are logged, never fatal.
pub fn notify(msg: &str) {
    let mut ready = READY_SENT.lock().unwrap_or_else(|e| e.into_inner());
    send(msg);
    *ready |= msg.lines().any(|l| l == "READY=1");
}

/// After [`FIRST_DOCUMENT_WAIT`], sends `READY=1` with `STATUS=<waiting>`
/// unless readiness was already reported or `seen()` says a document has
/// arrived (its apply reports readiness when it is done).
pub fn ready_without_document(waiting: String, seen: impl Fn() -> bool + Send + 'static) {
    ready_after(FIRST_DOCUMENT_WAIT, waiting, seen);
}

fn ready_after(wait: Duration, waiting: String, seen: impl Fn() -> bool + Send + 'static) {
    tokio::spawn(async move {
        tokio::time::sleep(wait).await;
        let mut ready = READY_SENT.lock().unwrap_or_else(|e| e.into_inner());
        if !*ready && !seen() {
            tracing::info!("no desired-state document yet; reporting ready to systemd: {waiting}");
            send(&format!("READY=1\nSTATUS={waiting}"));
            *ready = true;
        }
    });
}

fn send(msg: &str) {
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
    use std::{
        sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        },
        time::Duration,
    };

    /// One test: `NOTIFY_SOCKET` and the readiness flag are process-wide.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ready_is_sent_once_with_or_without_a_document() {
        let dir = std::env::temp_dir().join(format!("lbagent-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let server = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        server.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // SAFETY: this test is the only one touching NOTIFY_SOCKET, and it
        // sets it before anything it starts reads the environment.
        unsafe { std::env::set_var("NOTIFY_SOCKET", &path) };
        let mut buf = [0u8; 128];

        // A document arrived before the wait ended: the timer stays quiet
        // and the apply's READY=1 is the only one.
        let seen = Arc::new(AtomicBool::new(false));
        let s = seen.clone();
        super::ready_after(Duration::from_millis(200), "waiting".into(), move || s.load(Ordering::SeqCst));
        seen.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(400)).await;
        super::notify("READY=1\nSTATUS=applied");
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=applied");
        server.set_nonblocking(true).unwrap();
        assert!(server.recv(&mut buf).is_err(), "nothing else was sent");
        server.set_nonblocking(false).unwrap();

        // No document within the wait: READY=1 with the waiting status,
        // once; a later apply updates the status.
        *super::READY_SENT.lock().unwrap() = false;
        let started = std::time::Instant::now();
        super::ready_after(Duration::from_millis(200), "waiting for etcd".into(), || false);
        let n = server.recv(&mut buf).unwrap();
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=waiting for etcd");
        super::ready_after(Duration::from_millis(1), "again".into(), || false);
        tokio::time::sleep(Duration::from_millis(200)).await;
        super::notify("STATUS=applied");
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STATUS=applied", "a second timer sends nothing once ready");

        // SAFETY: as above.
        unsafe { std::env::remove_var("NOTIFY_SOCKET") };
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
