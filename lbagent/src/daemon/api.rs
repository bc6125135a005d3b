//! The unix-socket API: a client writes one request line, the daemon answers
//! with one JSON document and closes. Requests: `status`.

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader as TokioBufReader},
    net::UnixListener,
};
use tracing::warn;

use super::status::Status;

pub fn bind(path: &Path) -> Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!("another lbagent is serving {} (use --api-socket to run several)", path.display());
        }
        std::fs::remove_file(path)?;
    }
    UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))
}

pub async fn serve(listener: UnixListener, status: Arc<Mutex<Status>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let status = status.clone();
        tokio::spawn(async move {
            let (r, mut w) = stream.into_split();
            let mut line = String::new();
            if TokioBufReader::new(r).read_line(&mut line).await.is_err() {
                return;
            }
            let reply = match line.trim() {
                "status" => status.lock().unwrap().document.to_string(),
                other => serde_json::json!({"error": format!("unknown request {other:?}")}).to_string(),
            };
            if let Err(e) = w.write_all(format!("{reply}\n").as_bytes()).await {
                warn!("api reply: {e}");
            }
        });
    }
}

/// Client side: one request, one JSON answer.
pub fn request(path: &Path, req: &str) -> Result<serde_json::Value> {
    let mut s = UnixStream::connect(path).with_context(|| {
        format!("connecting to the daemon at {} (is `lbagent run` running? see --api-socket)", path.display())
    })?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(format!("{req}\n").as_bytes())?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    Ok(serde_json::from_str(&line)?)
}
