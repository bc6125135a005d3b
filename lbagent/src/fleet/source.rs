//! The daemon's etcd source (`lbagent run --etcd … --host H`).
//!
//! Two loops share one task:
//! - the reader gets `/lbagent/v1/desired/<H>`, then watches it from the
//!   revision after, and resumes the watch from its last revision after a
//!   reconnect. It reads the key again only when the watch reports a
//!   compaction, a revision goes backwards (a restored cluster) or the
//!   cluster id changes. A deleted key changes nothing (only an explicit
//!   empty document drains a host). Every accepted document is cached on
//!   disk; at start, when no endpoint answers, the cached one is applied.
//! - the reporter keeps `/lbagent/v1/alive/<H>` on a 30 s lease (kept alive
//!   every 10 s) and writes `/lbagent/v1/status/<H>` whenever the daemon's
//!   status changes (`HostStatus`), re-granting after any failure.
//!
//! Neither loop ever touches the dataplane: etcd being unreachable, losing
//! quorum (every request requires a leader) or the lease expiring only
//! delays new documents.

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context, Result, bail};
use etcd_client::{Client, EventType, KeyValue, PutOptions, WatchOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc::UnboundedSender};
use tracing::{info, warn};

use super::{
    HostStatus,
    conn::{Backoff, Etcd},
};
use crate::{
    daemon::source::{Feedback, Source, Update},
    naming,
    state::{self, Format},
};

/// Lease of the liveness key, and how often it is kept alive.
const ALIVE_TTL_SECS: i64 = 30;
const KEEPALIVE_EVERY: Duration = Duration::from_secs(10);

pub struct EtcdSource {
    pub etcd: Etcd,
    pub host: String,
    /// The last accepted document (`<state dir>/fleet-desired.json`).
    pub cache: PathBuf,
}

/// The on-disk cache of the last accepted document.
#[derive(Serialize, Deserialize)]
struct Cached {
    revision: i64,
    document: String,
}

/// How a document in etcd is parsed: JSON when it starts with `{`, else YAML.
pub fn format_of(text: &str) -> Format {
    if text.trim_start().starts_with('{') { Format::Json } else { Format::Yaml }
}

impl EtcdSource {
    fn key(&self) -> String {
        naming::fleet_desired_key(&self.host)
    }

    /// An update from a key-value; caches it when accepted.
    fn update(&self, why: &'static str, kv: &KeyValue) -> Update {
        let revision = kv.mod_revision();
        let state = match std::str::from_utf8(kv.value()) {
            Ok(text) => {
                let accepted = state::accept_str(text, format_of(text));
                if accepted.is_ok() {
                    let cached = Cached { revision, document: text.to_string() };
                    let bytes = serde_json::to_vec(&cached).expect("plain data serializes");
                    if let Err(e) = crate::files::write_private(&self.cache, &bytes, true) {
                        warn!("caching the accepted document in {}: {e:#}", self.cache.display());
                    }
                }
                accepted
            }
            Err(_) => Err(state::Problems(vec![state::Problem {
                path: String::new(),
                message: "the document is not UTF-8 text".into(),
            }])),
        };
        Update { why, revision: revision.to_string(), state }
    }

    fn cached(&self) -> Option<Update> {
        let bytes = std::fs::read(&self.cache).ok()?;
        let c: Cached = serde_json::from_slice(&bytes).ok()?;
        Some(Update {
            why: "cached document (etcd unreachable)",
            revision: c.revision.to_string(),
            state: state::accept_str(&c.document, format_of(&c.document)),
        })
    }

    /// Reads the key; `*rev` becomes the store's revision.
    async fn get(
        &self,
        c: &mut Client,
        rev: &mut i64,
        why: &'static str,
        updates: &UnboundedSender<Update>,
    ) -> Result<bool> {
        let resp = c.get(self.key(), None).await.context("get")?;
        let store = resp.header().map_or(0, |h| h.revision());
        match resp.kvs().first() {
            Some(kv) => {
                if updates.send(self.update(why, kv)).is_err() {
                    return Ok(false);
                }
            }
            None => warn!("no desired state at {} yet; the running state stays", self.key()),
        }
        *rev = store;
        Ok(true)
    }

    /// Follows the key on one connection until an error (reconnect), a
    /// re-read is needed (`*rev` = 0), or the daemon is gone (`Ok(false)`).
    async fn follow(
        &self,
        c: &mut Client,
        rev: &mut i64,
        updates: &UnboundedSender<Update>,
        refresh: &Notify,
    ) -> Result<bool> {
        if *rev == 0 && !self.get(c, rev, "etcd: read", updates).await? {
            return Ok(false);
        }
        let opts = WatchOptions::new().with_start_revision(*rev + 1);
        let mut stream = c.watch(self.key(), Some(opts)).await.context("watch")?;
        loop {
            tokio::select! {
                msg = stream.message() => {
                    let Some(resp) = msg.context("watch")? else { bail!("the watch stream ended") };
                    if resp.compact_revision() > 0 {
                        warn!("etcd compacted past revision {} (now {}); reading the key again", *rev, resp.compact_revision());
                        *rev = 0;
                        return Ok(true);
                    }
                    if resp.canceled() {
                        bail!("watch canceled: {}", resp.cancel_reason());
                    }
                    if let Some(h) = resp.header()
                        && h.revision() < *rev
                    {
                        warn!("etcd's revision went backwards ({} < {}): reading the key again", h.revision(), *rev);
                        *rev = 0;
                        return Ok(true);
                    }
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        *rev = (*rev).max(kv.mod_revision());
                        match ev.event_type() {
                            EventType::Put => {
                                if updates.send(self.update("etcd: changed", kv)).is_err() {
                                    return Ok(false);
                                }
                            }
                            EventType::Delete => warn!(
                                "{} was deleted; the running state stays (put an empty document to drain this host)",
                                self.key()
                            ),
                        }
                    }
                }
                _ = refresh.notified() => {
                    let mut now = *rev;
                    if !self.get(c, &mut now, "SIGHUP", updates).await? {
                        return Ok(false);
                    }
                }
            }
        }
    }

    async fn read_loop(&self, updates: UnboundedSender<Update>, refresh: Arc<Notify>) {
        let (mut next, mut backoff) = (0usize, Backoff::default());
        let mut conn = match self.etcd.connect_any(&mut next).await {
            Ok(c) => c,
            Err(e) => {
                warn!("etcd unreachable at start ({e:#})");
                if let Some(u) = self.cached() {
                    info!(revision = %u.revision, "applying the cached document from {}", self.cache.display());
                    if updates.send(u).is_err() {
                        return;
                    }
                }
                self.etcd.connect_retrying(&mut next, &mut backoff, "desired state").await
            }
        };
        let (mut rev, mut cluster) = (0i64, None);
        loop {
            let (mut c, id) = conn;
            if cluster.is_some_and(|old| old != id) {
                warn!("etcd cluster id changed ({:x} → {id:x}): reading the key again", cluster.unwrap_or(0));
                rev = 0;
            }
            cluster = Some(id);
            match self.follow(&mut c, &mut rev, &updates, &refresh).await {
                Ok(false) => return,
                Ok(true) => continue_after(Duration::ZERO).await,
                Err(e) => {
                    // Another endpoint next: this one failed us.
                    next += 1;
                    let wait = backoff.wait();
                    warn!("desired state: {e:#}; reconnecting in {wait:.1?} (resuming after revision {rev})");
                    continue_after(wait).await;
                }
            }
            conn = self.etcd.connect_retrying(&mut next, &mut backoff, "desired state").await;
        }
    }

    /// Keeps the liveness lease and writes status changes on one connection.
    async fn report(&self, c: &mut Client, feedback: &Feedback, last: &mut Option<HostStatus>) -> Result<()> {
        let lease = c.lease_grant(ALIVE_TTL_SECS, None).await.context("lease grant")?.id();
        let alive = serde_json::json!({ "pid": std::process::id(), "version": env!("CARGO_PKG_VERSION") });
        c.put(naming::fleet_alive_key(&self.host), alive.to_string(), Some(PutOptions::new().with_lease(lease)))
            .await
            .context("writing the alive key")?;
        let (mut keeper, mut answers) = c.lease_keep_alive(lease).await.context("lease keep-alive")?;
        let mut tick = tokio::time::interval(KEEPALIVE_EVERY);
        loop {
            let now = HostStatus::of(&feedback.status.lock().unwrap().document);
            if last.as_ref() != Some(&now) {
                let text = serde_json::to_string(&now)?;
                c.put(naming::fleet_status_key(&self.host), text, None).await.context("writing the status")?;
                *last = Some(now);
            }
            tokio::select! {
                _ = feedback.changed.notified() => {}
                _ = tick.tick() => {
                    keeper.keep_alive().await.context("lease keep-alive")?;
                    match answers.message().await.context("lease keep-alive")? {
                        Some(r) if r.ttl() > 0 => {}
                        _ => bail!("the alive lease expired"),
                    }
                }
            }
        }
    }

    async fn report_loop(&self, feedback: Feedback) {
        let (mut next, mut backoff) = (0usize, Backoff::default());
        let mut last = None;
        loop {
            let (mut c, _) = self.etcd.connect_retrying(&mut next, &mut backoff, "status").await;
            if let Err(e) = self.report(&mut c, &feedback, &mut last).await {
                next += 1;
                let wait = backoff.wait();
                warn!("status to etcd: {e:#}; again in {wait:.1?}");
                continue_after(wait).await;
            }
        }
    }
}

async fn continue_after(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

impl Source for EtcdSource {
    fn describe(&self) -> String {
        format!("{} key {}", self.etcd.describe(), self.key())
    }

    fn run(
        self: Box<Self>,
        updates: UnboundedSender<Update>,
        refresh: Arc<Notify>,
        feedback: Feedback,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            // One task: aborting it (daemon stop) stops both loops.
            tokio::select! {
                _ = self.read_loop(updates, refresh) => {}
                _ = self.report_loop(feedback) => {}
            }
        })
    }
}
