//! The daemon's etcd source (`lbagent run --etcd … --host H`).
//!
//! Two loops share one task:
//! - the reporter holds `/lbagent/v1/alive/<H>` on a 30 s lease (kept alive
//!   every 10 s). The key is taken in a transaction that succeeds only when
//!   nobody holds it, or when the holder's lease is the one this state dir's
//!   previous agent held (a restart after a crash takes over at once). While
//!   another agent holds it, this one applies nothing from etcd and says so
//!   in its status. Only the holder writes `/lbagent/v1/status/<H>`
//!   (`HostStatus`, on change). A clean stop revokes the lease.
//! - the reader applies only the newest document: on every connect, on
//!   every watch event and on SIGHUP it reads the key itself (a linearizable
//!   get) rather than replaying the events in between, so a burst of writes,
//!   a stall or a reconnect yields the newest revision only (a drain that
//!   was reverted meanwhile is never seen), and no history is replayed
//!   however large. A deleted key changes nothing (only a document that
//!   drains says so). Every accepted document is cached on disk with its
//!   host and cluster id; the cache's age is the time since etcd last
//!   confirmed it current (its modification time, refreshed every 10 s).
//!   At start, when no endpoint answers, the cache is applied only if it is
//!   this host's and younger than `cache_max_age`: addresses that etcd may
//!   have moved to another host are not announced again from an old copy.
//!
//! Neither loop ever touches the dataplane: etcd being unreachable, losing
//! quorum (every request requires a leader) or the lease expiring only
//! delays new documents.

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result, bail};
use etcd_client::{Client, Compare, CompareOp, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp, WatchOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc::UnboundedSender, watch};
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
/// How often the reader confirms that the running document is still the
/// newest (a keys-only read), which refreshes the cache's age.
const CONFIRM_EVERY: Duration = Duration::from_secs(10);
/// How often an agent that does not hold the alive key tries again.
const HELD_ELSEWHERE_RETRY: Duration = Duration::from_secs(2);

/// The default `--etcd-cache-max-age`: two alive leases.
pub const DEFAULT_CACHE_MAX_AGE: Duration = Duration::from_secs(60);

pub struct EtcdSource {
    pub etcd: Etcd,
    pub host: String,
    /// The last accepted document (`<state dir>/fleet-desired.json`).
    pub cache: PathBuf,
    /// The lease this state dir's agent last held the alive key with
    /// (`<state dir>/fleet-lease`).
    pub lease_file: PathBuf,
    /// The oldest cached document applied when etcd is unreachable at start.
    pub cache_max_age: Duration,
}

/// The on-disk cache of the last accepted document.
#[derive(Serialize, Deserialize)]
struct Cached {
    host: String,
    cluster_id: u64,
    revision: i64,
    document: String,
}

/// The alive key's value.
#[derive(Serialize, Deserialize)]
struct Alive {
    pid: u32,
    machine: String,
    version: String,
}

/// How a document in etcd is parsed: JSON when it starts with `{`, else YAML.
pub fn format_of(text: &str) -> Format {
    if text.trim_start().starts_with('{') { Format::Json } else { Format::Yaml }
}

/// What the reader last sent, shared across reconnects.
struct Reader {
    /// mod_revision of the last document sent (0: none).
    sent: i64,
    cluster: u64,
    backoff: Backoff,
    next: usize,
    /// Why the cache was not applied at start (kept in the status until
    /// etcd answers).
    cache_note: Option<String>,
}

impl EtcdSource {
    fn key(&self) -> String {
        naming::fleet_desired_key(&self.host)
    }

    fn problem(feedback: &Feedback, problem: Option<String>) {
        let mut st = feedback.status.lock().unwrap();
        if st.document.source_problem != problem {
            st.document.source_problem = problem;
            drop(st);
            feedback.changed.notify_one();
        }
    }

    /// An update from a key-value; caches it when accepted.
    fn update(&self, why: &'static str, kv: &KeyValue, cluster_id: u64) -> Update {
        let revision = kv.mod_revision();
        let state = match std::str::from_utf8(kv.value()) {
            Ok(text) => {
                let accepted = state::accept_str(text, format_of(text));
                if accepted.is_ok() {
                    let cached = Cached { host: self.host.clone(), cluster_id, revision, document: text.to_string() };
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

    /// The cached document, when it may be applied without etcd: this
    /// host's, and confirmed current within `cache_max_age`.
    fn cached(&self) -> Result<Update, String> {
        let bytes = std::fs::read(&self.cache).map_err(|e| format!("no cached document ({e})"))?;
        let c: Cached = serde_json::from_slice(&bytes).map_err(|e| format!("cached document unreadable ({e})"))?;
        if c.host != self.host {
            return Err(format!("the cached document is host {:?}'s, not {:?}'s", c.host, self.host));
        }
        let age = std::fs::metadata(&self.cache)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .unwrap_or(Duration::MAX);
        if age > self.cache_max_age {
            return Err(format!(
                "the cached document (revision {}) was last confirmed by etcd {}s ago, more than \
                 --etcd-cache-max-age {}s: not applied, its addresses may have moved to another host",
                c.revision,
                age.as_secs(),
                self.cache_max_age.as_secs()
            ));
        }
        Ok(Update {
            why: "cached document (etcd unreachable)",
            revision: c.revision.to_string(),
            state: state::accept_str(&c.document, format_of(&c.document)),
        })
    }

    /// Marks the cache as confirmed current now.
    fn confirm_cache(&self) {
        if let Ok(f) = std::fs::File::options().append(true).open(&self.cache) {
            let _ = f.set_modified(SystemTime::now());
        }
    }

    /// Reads the key and sends it when it is newer than what was sent.
    async fn read(
        &self,
        c: &mut Client,
        r: &mut Reader,
        why: &'static str,
        updates: &Sender<'_>,
        feedback: &Feedback,
    ) -> Result<i64> {
        // Fenced before the read, not after: a document read while another
        // agent held the key may be stale by the time this one holds it.
        updates.held().await?;
        let resp = c.get(self.key(), None).await.context("get")?;
        Self::problem(feedback, None);
        let store = resp.header().map_or(0, |h| h.revision());
        match resp.kvs().first() {
            Some(kv) if kv.mod_revision() != r.sent => {
                if !updates.is_held() {
                    // The key was lost during the get: what was read may be
                    // stale once it is held again, so it is read again then.
                    return Box::pin(self.read(c, r, why, updates, feedback)).await;
                }
                r.sent = kv.mod_revision();
                updates.send_unfenced(self.update(why, kv, r.cluster))?;
            }
            Some(_) if updates.is_held() => self.confirm_cache(),
            Some(_) => {}
            None => warn!("no desired state at {} yet; the running state stays", self.key()),
        }
        Ok(store)
    }

    /// Follows the key on one connection until an error (reconnect after a
    /// backoff), a compaction (`Ok`: watch again at once) or the daemon is
    /// gone (the error is [`Gone`]).
    async fn follow(
        &self,
        c: &mut Client,
        r: &mut Reader,
        updates: &Sender<'_>,
        refresh: &Notify,
        feedback: &Feedback,
    ) -> Result<()> {
        let rev = self.read(c, r, "etcd: read", updates, feedback).await?;
        let opts = WatchOptions::new().with_start_revision(rev + 1);
        let mut stream = c.watch(self.key(), Some(opts)).await.context("watch")?;
        let mut confirm = tokio::time::interval(CONFIRM_EVERY);
        confirm.tick().await;
        loop {
            let why = tokio::select! {
                msg = stream.message() => {
                    let Some(resp) = msg.context("watch")? else { bail!("the watch stream ended") };
                    if resp.canceled() && resp.compact_revision() == 0 {
                        bail!("watch canceled: {}", resp.cancel_reason());
                    }
                    if resp.compact_revision() > 0 {
                        // The events are gone, the key is not: read it.
                        warn!("etcd compacted to revision {}; reading the key again", resp.compact_revision());
                        self.read(c, r, "etcd: read after compaction", updates, feedback).await?;
                        return Ok(());
                    }
                    for ev in resp.events() {
                        if ev.event_type() == EventType::Delete {
                            warn!(
                                "{} was deleted; the running state stays (put a document that drains this host to empty it)",
                                self.key()
                            );
                        }
                    }
                    if !resp.events().iter().any(|e| e.event_type() == EventType::Put) {
                        continue;
                    }
                    "etcd: changed"
                }
                _ = refresh.notified() => "SIGHUP",
                _ = confirm.tick() => {
                    let resp = c.get(self.key(), Some(GetOptions::new().with_keys_only())).await.context("get")?;
                    match resp.kvs().first() {
                        Some(kv) if kv.mod_revision() == r.sent => {
                            // Only the holder of the alive key vouches for the cache.
                            if updates.is_held() {
                                self.confirm_cache();
                            }
                            continue;
                        }
                        Some(_) => "etcd: changed",
                        None => continue,
                    }
                }
            };
            self.read(c, r, why, updates, feedback).await?;
        }
    }

    async fn read_loop(&self, updates: Sender<'_>, refresh: Arc<Notify>, feedback: &Feedback) -> Result<()> {
        let mut r = Reader { sent: 0, cluster: 0, backoff: Backoff::default(), next: 0, cache_note: None };
        let mut conn = match self.etcd.connect_any(&mut r.next).await {
            Ok(c) => c,
            Err(e) => {
                warn!("etcd unreachable at start ({e:#})");
                match self.cached() {
                    Ok(u) => {
                        info!(revision = %u.revision, "applying the cached document from {}", self.cache.display());
                        updates.send_unfenced(u)?;
                    }
                    Err(why) => {
                        warn!("{why}");
                        Self::problem(feedback, Some(format!("etcd unreachable at start; {why}")));
                        r.cache_note = Some(why);
                    }
                }
                self.connect(&mut r, feedback).await
            }
        };
        loop {
            let (mut c, id) = conn;
            if r.cluster != 0 && r.cluster != id {
                warn!("etcd cluster id changed ({:x} → {id:x})", r.cluster);
                r.sent = 0;
            }
            r.cluster = id;
            let since = Instant::now();
            match self.follow(&mut c, &mut r, &updates, &refresh, feedback).await {
                Err(e) if e.is::<Gone>() => return Ok(()),
                Err(e) => {
                    Self::problem(feedback, Some(format!("desired state from etcd: {e:#}")));
                    // Another endpoint next: this one failed us.
                    r.next += 1;
                    r.backoff.settle(since);
                    let wait = r.backoff.wait();
                    warn!("desired state: {e:#}; reconnecting in {wait:.1?}");
                    tokio::time::sleep(wait).await;
                }
                Ok(()) => {}
            }
            conn = self.connect(&mut r, feedback).await;
        }
    }

    /// Connects with backoff, reporting each failure in the status.
    async fn connect(&self, r: &mut Reader, feedback: &Feedback) -> (Client, u64) {
        loop {
            match self.etcd.connect_any(&mut r.next).await {
                Ok(c) => {
                    r.cache_note = None;
                    return c;
                }
                Err(e) => {
                    let wait = r.backoff.wait();
                    warn!("desired state: etcd unreachable ({e:#}); retrying in {wait:.1?}");
                    let note = r.cache_note.as_ref().map(|n| format!("; {n}")).unwrap_or_default();
                    Self::problem(feedback, Some(format!("etcd unreachable: {e:#}{note}")));
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Takes the alive key with `lease`: succeeds when nobody holds it or
    /// when its lease is the one this state dir's previous agent held.
    /// `Err(holder)` names the agent that holds it.
    async fn acquire(&self, c: &mut Client, lease: i64) -> Result<std::result::Result<(), String>> {
        let key = naming::fleet_alive_key(&self.host);
        let machine = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string();
        let me = Alive { pid: std::process::id(), machine, version: env!("CARGO_PKG_VERSION").into() };
        let value = serde_json::to_string(&me)?;
        let put = || TxnOp::put(key.clone(), value.clone(), Some(PutOptions::new().with_lease(lease)));
        let free = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([put()])
            .or_else([TxnOp::get(key.clone(), None)]);
        let resp = c.txn(free).await.context("taking the alive key")?;
        if resp.succeeded() {
            return Ok(Ok(()));
        }
        let holder = resp.op_responses().into_iter().find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => g.kvs().first().map(|kv| (kv.lease(), kv.value().to_vec())),
            _ => None,
        });
        let Some((held_by, value_held)) = holder else { return Ok(Err("the alive key vanished".into())) };
        let ours = std::fs::read_to_string(&self.lease_file).ok().and_then(|s| s.trim().parse::<i64>().ok());
        if ours == Some(held_by) && held_by != 0 {
            // This state dir's previous agent (killed, or restarted): take over.
            let take = Txn::new().when([Compare::lease(key.clone(), CompareOp::Equal, held_by)]).and_then([put()]);
            if c.txn(take).await.context("taking over the alive key")?.succeeded() {
                let _ = c.lease_revoke(held_by).await;
                return Ok(Ok(()));
            }
            return Ok(Err("the alive key changed hands while taking it over".into()));
        }
        let who = serde_json::from_slice::<Alive>(&value_held)
            .map(|a| format!("pid {} on {} (lbagent {})", a.pid, a.machine, a.version))
            .unwrap_or_else(|_| "an unknown holder".into());
        Ok(Err(format!("another agent holds {key}: {who}, lease {held_by:x}")))
    }

    /// Holds the liveness lease and writes status changes on one connection,
    /// until an error or a stop (then the lease is revoked).
    async fn report(
        &self,
        c: &mut Client,
        feedback: &Feedback,
        last: &mut Option<HostStatus>,
        held: &watch::Sender<bool>,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Reported> {
        let lease = c.lease_grant(ALIVE_TTL_SECS, None).await.context("lease grant")?.id();
        if let Err(holder) = self.acquire(c, lease).await? {
            let _ = c.lease_revoke(lease).await;
            return Ok(Reported::HeldElsewhere(holder));
        }
        crate::files::write_private(&self.lease_file, format!("{lease}\n").as_bytes(), true)
            .context("recording the alive lease")?;
        held.send_replace(true);
        Self::problem(feedback, None);
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
                _ = stop.changed() => {
                    held.send_replace(false);
                    // Kept when the revoke failed: the next start takes the
                    // key back from this lease instead of waiting it out.
                    if c.lease_revoke(lease).await.is_ok() {
                        let _ = std::fs::remove_file(&self.lease_file);
                    }
                    return Ok(Reported::Stopped);
                }
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

    async fn report_loop(&self, feedback: Feedback, held: watch::Sender<bool>) {
        let (mut next, mut backoff) = (0usize, Backoff::default());
        let mut last = None;
        let mut stop = feedback.stop.clone();
        loop {
            let (mut c, _) = self.etcd.connect_retrying(&mut next, &mut backoff, "status").await;
            let since = Instant::now();
            match self.report(&mut c, &feedback, &mut last, &held, &mut stop).await {
                Ok(Reported::Stopped) => return,
                Ok(Reported::HeldElsewhere(holder)) => {
                    warn!("{holder}; this agent applies nothing from etcd until it is released");
                    Self::problem(&feedback, Some(format!("{holder}: nothing from etcd is applied")));
                    tokio::time::sleep(HELD_ELSEWHERE_RETRY).await;
                }
                Err(e) => {
                    held.send_replace(false);
                    Self::problem(&feedback, Some(format!("status and alive key in etcd: {e:#}")));
                    next += 1;
                    backoff.settle(since);
                    let wait = backoff.wait();
                    warn!("status to etcd: {e:#}; again in {wait:.1?}");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }
}

enum Reported {
    Stopped,
    HeldElsewhere(String),
}

/// The daemon is gone (its receiver dropped).
#[derive(Debug)]
struct Gone;

impl std::fmt::Display for Gone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the daemon stopped")
    }
}

impl std::error::Error for Gone {}

/// The reader's way to the daemon: documents from etcd wait until this
/// agent holds the alive key (fencing); the cached document does not.
struct Sender<'a> {
    updates: UnboundedSender<Update>,
    held: &'a watch::Receiver<bool>,
}

impl Sender<'_> {
    /// Waits until this agent holds the alive key.
    async fn held(&self) -> Result<()> {
        let mut held = self.held.clone();
        held.wait_for(|h| *h).await.map_err(|_| Gone)?;
        Ok(())
    }

    fn is_held(&self) -> bool {
        *self.held.borrow()
    }

    fn send_unfenced(&self, u: Update) -> Result<()> {
        self.updates.send(u).map_err(|_| Gone.into())
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
            let (held_tx, held_rx) = watch::channel(false);
            let sender = Sender { updates, held: &held_rx };
            // One task: the reporter returns after revoking the lease on a
            // stop; the reader is dropped with it.
            tokio::select! {
                _ = self.read_loop(sender, refresh, &feedback) => {}
                _ = self.report_loop(feedback.clone(), held_tx) => {}
            }
        })
    }
}
