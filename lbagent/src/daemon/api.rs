//! The unix-socket API: a client writes one request line, the daemon answers
//! with one JSON document and closes. Requests: `status`.
//!
//! Only root or the daemon's own user may ask: the socket is 0600 in a
//! directory that is the daemon's and not writable by others, and every
//! connection's peer credentials are checked. A request is one line of at
//! most `MAX_REQUEST` bytes read within `IO_TIMEOUT`; at most `MAX_CLIENTS`
//! are served at once; accept errors back off instead of spinning.

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::{fs::PermissionsExt, net::UnixStream},
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, BufReader as TokioBufReader},
    net::UnixListener,
    sync::Semaphore,
};
use tracing::warn;

use super::status::{Status, StatusDoc};

/// Longest request line read.
pub const MAX_REQUEST: u64 = 256;
/// Connections served at once (more wait in the backlog).
pub const MAX_CLIENTS: usize = 16;
/// A client has this long to send its request and take its answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

pub fn bind(path: &Path) -> Result<UnixListener> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    crate::files::ensure_private_dir(dir).context("the API socket's directory")?;
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!("another lbagent is serving {} (use --api-socket to run several)", path.display());
        }
        std::fs::remove_file(path)?;
    }
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Whether the peer may use the API: root, or the daemon's own user.
fn allowed(stream: &tokio::net::UnixStream) -> Result<(), String> {
    let me = nix::unistd::geteuid().as_raw();
    match stream.peer_cred() {
        Ok(c) if c.uid() == 0 || c.uid() == me => Ok(()),
        Ok(c) => Err(format!("uid {} may not use the API", c.uid())),
        Err(e) => Err(format!("peer credentials: {e}")),
    }
}

pub async fn serve(listener: UnixListener, status: Arc<Mutex<Status>>) {
    let slots = Arc::new(Semaphore::new(MAX_CLIENTS));
    let mut backoff = Duration::from_millis(10);
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let stream = match listener.accept().await {
            Ok((s, _)) => {
                backoff = Duration::from_millis(10);
                s
            }
            Err(e) => {
                // EMFILE and friends: wait instead of spinning on the error.
                warn!("api accept: {e}; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let status = status.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let _ = tokio::time::timeout(IO_TIMEOUT, answer(stream, status)).await;
        });
    }
}

async fn answer(mut stream: tokio::net::UnixStream, status: Arc<Mutex<Status>>) {
    let until = Instant::now() + IO_TIMEOUT;
    let reply = if let Err(why) = allowed(&stream) {
        warn!("api: refused a client: {why}");
        Reply::Error(why)
    } else {
        let mut line = String::new();
        if TokioBufReader::new((&mut stream).take(MAX_REQUEST)).read_line(&mut line).await.is_err() {
            return;
        }
        if !line.ends_with('\n') {
            Reply::Error(format!("a request is one line of at most {MAX_REQUEST} bytes"))
        } else {
            match line.trim() {
                // Copied under the lock (its large parts are shared): an
                // EIP's `used_by` lines are made as the document is
                // serialized, which the daemon's loop must not wait for.
                "status" => Reply::Status(Box::new(status.lock().unwrap().document.clone())),
                other => Reply::Error(format!("unknown request {other:?}")),
            }
        }
    };
    // Serialized straight onto the socket, on the blocking pool (as the
    // metrics are rendered): at 100 000 rules the status document is ~9 MB
    // of JSON, which a buffer would hold whole (twice, as it grew).
    let Ok(sock) = stream.into_std() else { return };
    if let Ok(Err(e)) = tokio::task::spawn_blocking(move || reply.write(&sock, until)).await {
        warn!("api reply: {e}");
    }
}

/// What the API answers.
enum Reply {
    Status(Box<StatusDoc>),
    Error(String),
}

impl Reply {
    /// Writes the reply and its newline to `sock` (a blocking socket from
    /// here on) by `until`.
    fn write(&self, sock: &UnixStream, until: Instant) -> std::io::Result<()> {
        sock.set_nonblocking(false)?;
        let mut out = std::io::BufWriter::with_capacity(64 * 1024, Deadline { sock, until });
        match self {
            Reply::Status(doc) => serde_json::to_writer(&mut out, doc),
            Reply::Error(why) => serde_json::to_writer(&mut out, &serde_json::json!({ "error": why })),
        }?;
        out.write_all(b"\n")?;
        out.flush()
    }
}

/// A socket that refuses to be written after `until`: a client that does
/// not read its answer holds a thread of the pool at most until then.
struct Deadline<'a> {
    sock: &'a UnixStream,
    until: Instant,
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client did not take its answer in time",
            ));
        }
        self.sock.set_write_timeout(Some(left))?;
        let mut sock = self.sock;
        sock.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Client side: one request, one JSON answer.
pub fn request(path: &Path, req: &str) -> Result<serde_json::Value> {
    request_with_peer(path, req).map(|(v, _)| v)
}

/// [`request`], with the pid of the process that answers (the socket's peer
/// credentials; `None` when the kernel gives none, e.g. across pid namespaces).
pub fn request_with_peer(path: &Path, req: &str) -> Result<(serde_json::Value, Option<i32>)> {
    let mut s = UnixStream::connect(path).with_context(|| {
        format!("connecting to the daemon at {} (is `lbagent run` running? see --api-socket)", path.display())
    })?;
    let pid = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
        .ok()
        .map(|c| c.pid())
        .filter(|p| *p > 0);
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    // A refusing daemon answers without reading the request: its answer
    // matters more than our write error.
    let sent = s.write_all(format!("{req}\n").as_bytes());
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    if line.is_empty() {
        sent?;
    }
    let v: serde_json::Value = serde_json::from_str(&line)?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        bail!("the daemon refused the request: {e}");
    }
    Ok((v, pid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_that_does_not_read_its_answer_is_dropped_at_the_deadline() {
        let (sock, _client) = UnixStream::pair().unwrap();
        // Far more than the socket buffers hold, never read.
        let doc = Reply::Error("x".repeat(64 << 20));
        let t = Instant::now();
        let err = doc.write(&sock, t + Duration::from_millis(300)).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[test]
    fn the_answer_is_one_json_line() {
        let (sock, client) = UnixStream::pair().unwrap();
        let doc = StatusDoc { state_file: "s.yaml".into(), applies: 7, ..Default::default() };
        let reader = std::thread::spawn(move || {
            let mut line = String::new();
            BufReader::new(client).read_line(&mut line).unwrap();
            line
        });
        Reply::Status(Box::new(doc.clone())).write(&sock, Instant::now() + IO_TIMEOUT).unwrap();
        drop(sock);
        let line = reader.join().unwrap();
        assert!(line.ends_with('\n'));
        assert_eq!(serde_json::from_str::<StatusDoc>(&line).unwrap(), doc);
    }
}
