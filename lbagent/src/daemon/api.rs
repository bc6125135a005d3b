//! The unix-socket API: a client writes one request line, the daemon answers
//! with one JSON document and closes. Requests: `status`; `ha status`,
//! `ha promote`, `ha demote`, `ha switchover` (the HA pair's role:
//! `crate::ha`).
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
    time::Duration,
};

use anyhow::{Context, Result, bail};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader as TokioBufReader},
    net::UnixListener,
    sync::Semaphore,
};
use tracing::warn;

use super::status::Status;

const NOT_A_PAIR: &str = "this host is not one of an HA pair (agent.ha in the state file)";

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

pub async fn serve(listener: UnixListener, status: Arc<Mutex<Status>>, ha: Arc<crate::ha::Shared>) {
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
        let (status, ha) = (status.clone(), ha.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let _ = tokio::time::timeout(IO_TIMEOUT, answer(stream, status, ha)).await;
        });
    }
}

async fn answer(stream: tokio::net::UnixStream, status: Arc<Mutex<Status>>, ha: Arc<crate::ha::Shared>) {
    let refused = allowed(&stream).err();
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    let mut reply = Chunks::default();
    let written = if let Some(why) = refused {
        warn!("api: refused a client: {why}");
        serde_json::to_writer(&mut reply, &serde_json::json!({ "error": why }))
    } else if TokioBufReader::new(r.take(MAX_REQUEST)).read_line(&mut line).await.is_err() {
        return;
    } else if !line.ends_with('\n') {
        let why = format!("a request is one line of at most {MAX_REQUEST} bytes");
        serde_json::to_writer(&mut reply, &serde_json::json!({ "error": why }))
    } else {
        match line.trim() {
            // Copied under the lock (its large parts are shared), written
            // out after it: an EIP's `used_by` lines are made as the
            // document is serialized, which the daemon's loop must not wait
            // for. (On this task's thread: a thread of its own per request
            // would count against the unit's task limit, and could not be
            // created when that limit is reached.)
            "status" => {
                let doc = status.lock().unwrap().document.clone();
                serde_json::to_writer(&mut reply, &doc)
            }
            "ha status" => {
                let st = ha.is_configured().then(|| ha.status.lock().unwrap().clone());
                match st {
                    Some(st) => serde_json::to_writer(&mut reply, &st),
                    None => serde_json::to_writer(&mut reply, &serde_json::json!({ "error": NOT_A_PAIR })),
                }
            }
            req @ ("ha promote" | "ha demote" | "ha switchover") => {
                let req = req.to_string();
                let done = tokio::task::spawn_blocking(move || -> Result<String, String> {
                    if !ha.is_configured() {
                        return Err(NOT_A_PAIR.into());
                    }
                    match req.as_str() {
                        "ha promote" => ha.promote("asked").map_err(|e| format!("{e:#}")),
                        "ha demote" => ha.demote("asked").map_err(|e| format!("{e:#}")),
                        _ => ha.switchover(),
                    }
                })
                .await
                .unwrap_or_else(|e| Err(format!("{e}")));
                let doc = match done {
                    Ok(m) => serde_json::json!({ "ok": m }),
                    Err(e) => serde_json::json!({ "error": e }),
                };
                serde_json::to_writer(&mut reply, &doc)
            }
            other => {
                serde_json::to_writer(&mut reply, &serde_json::json!({ "error": format!("unknown request {other:?}") }))
            }
        }
    };
    if let Err(e) = written {
        warn!("api reply: serializing: {e}");
        return;
    }
    reply.push_newline();
    for chunk in reply.into_chunks() {
        if let Err(e) = w.write_all(&chunk).await {
            warn!("api reply: {e}");
            return;
        }
    }
}

/// An answer serialized in pieces of [`Chunks::SIZE`] bytes: at 100 000
/// rules the status document is ~9 MB of JSON, and one growing buffer
/// would hold up to twice that (and its old copy while it moved).
#[derive(Default)]
struct Chunks {
    full: Vec<Vec<u8>>,
    last: Vec<u8>,
}

impl Chunks {
    const SIZE: usize = 64 * 1024;

    fn push_newline(&mut self) {
        let _ = self.write_all(b"\n");
    }

    fn into_chunks(mut self) -> Vec<Vec<u8>> {
        self.full.push(self.last);
        self.full
    }
}

impl Write for Chunks {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.last.capacity() == 0 {
            self.last.reserve_exact(Self::SIZE);
        }
        let n = buf.len().min(Self::SIZE - self.last.len());
        self.last.extend_from_slice(&buf[..n]);
        if self.last.len() == Self::SIZE {
            self.full.push(std::mem::take(&mut self.last));
        }
        Ok(n)
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
    use crate::daemon::status::StatusDoc;

    #[test]
    fn an_answer_in_chunks_is_the_answer_in_one_piece() {
        let doc = StatusDoc {
            state_file: "s.yaml".into(),
            backends_down: (0..40_000).map(|i| format!("lb{i}/listener/backend")).collect(),
            ..Default::default()
        };
        let mut chunks = Chunks::default();
        serde_json::to_writer(&mut chunks, &doc).unwrap();
        chunks.push_newline();
        let pieces = chunks.into_chunks();
        assert!(pieces.len() > 10, "{} pieces", pieces.len());
        assert!(pieces.iter().all(|c| c.len() <= Chunks::SIZE && c.capacity() <= Chunks::SIZE));
        let line = String::from_utf8(pieces.concat()).unwrap();
        assert_eq!(line, format!("{}\n", serde_json::to_string(&doc).unwrap()));
        assert_eq!(serde_json::from_str::<StatusDoc>(&line).unwrap(), doc);
    }
}
