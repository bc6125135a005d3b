//! The daemon's etcd source (`lbagent run --etcd … --host H`).
//!
//! Two loops share one task:
//! - the reporter holds `/lbagent/v1/alive/<H>` on a 30 s lease (kept alive
//!   every 10 s). The key is taken in a transaction that succeeds only when
//!   nobody holds it, or when the holder's lease is the one this state dir's
//!   previous agent held (a restart after a crash takes over at once). While
//!   another agent holds it, this one applies nothing from etcd and says so
//!   in its status (`alive_problem`), trying again with the connection
//!   backoff or as soon as the key is deleted. The holder does not trust its
//!   belief: every 10 s, and whenever a fenced read fails, it checks that
//!   the key still exists on its own lease; when it does not (deleted or its
//!   lease revoked from outside) it stops vouching, says so, and takes the
//!   key back only if nobody holds it. Only the holder writes
//!   `/lbagent/v1/status/<H>` (`HostStatus`, on change, in a transaction on
//!   its lease). A clean stop revokes the lease.
//! - the reader applies only the newest document: on every connect, on
//!   every watch event and on SIGHUP it reads the key itself, in a
//!   transaction that succeeds only while the alive key is on this agent's
//!   lease (the fence), rather than replaying the events in between, so a burst of writes,
//!   a stall or a reconnect yields the newest revision only (a drain that
//!   was reverted meanwhile is never seen), and no history is replayed
//!   however large. SIGHUP sends the revision even when it was sent before:
//!   a document the daemon refused is evaluated again. A deleted key
//!   changes nothing (only a document that drains says so). Every document
//!   the daemon accepts is cached on disk with its
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
/// How long the reader waits for the reporter's verdict after a fenced
/// read failed, before reading again.
const FENCE_RECHECK: Duration = Duration::from_secs(1);

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
    /// The last document read: the next one shares its unchanged specs.
    pub earlier: state::Earlier,
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

    /// The reader's problem (`source_problem`).
    fn problem(feedback: &Feedback, problem: Option<String>) {
        Self::set(feedback, problem, |d| &mut d.source_problem);
    }

    /// The reporter's problem (`alive_problem`).
    fn alive_problem(feedback: &Feedback, problem: Option<String>) {
        Self::set(feedback, problem, |d| &mut d.alive_problem);
    }

    fn set(
        feedback: &Feedback,
        problem: Option<String>,
        field: impl FnOnce(&mut crate::daemon::status::StatusDoc) -> &mut Option<String>,
    ) {
        let mut st = feedback.status.lock().unwrap();
        let slot = field(&mut st.document);
        if *slot != problem {
            *slot = problem;
            drop(st);
            feedback.changed.notify_one();
        }
    }

    /// An update from a key-value; cached once the daemon accepts it.
    fn update(&self, why: &'static str, kv: &KeyValue, cluster_id: u64) -> Update {
        let revision = kv.mod_revision();
        let (state, on_accept) = match std::str::from_utf8(kv.value()) {
            Ok(text) => {
                let cached = Cached { host: self.host.clone(), cluster_id, revision, document: text.to_string() };
                let bytes = serde_json::to_vec(&cached).expect("plain data serializes");
                let path = self.cache.clone();
                let cache = move || {
                    if let Err(e) = crate::files::write_private(&path, &bytes, true) {
                        warn!("caching the accepted document in {}: {e:#}", path.display());
                    }
                };
                (self.earlier.accept_str(text, format_of(text)), Some(Box::new(cache) as Box<dyn FnOnce() + Send>))
            }
            Err(_) => (
                Err(state::Problems(vec![state::Problem {
                    path: String::new(),
                    message: "the document is not UTF-8 text".into(),
                }])),
                None,
            ),
        };
        Update { why, revision: revision.to_string(), state, on_accept }
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
            state: self.earlier.accept_str(&c.document, format_of(&c.document)),
            on_accept: None,
        })
    }

    /// Marks the cache as confirmed current now, when it holds `revision`
    /// (etcd's revision of the key): a cache of an older accepted document
    /// (the newest was refused) is not current and ages out.
    fn confirm_cache(&self, revision: i64) {
        let cached = std::fs::read(&self.cache).ok().and_then(|b| serde_json::from_slice::<Cached>(&b).ok());
        if cached.is_none_or(|c| c.revision != revision) {
            return;
        }
        if let Ok(f) = std::fs::File::options().append(true).open(&self.cache) {
            let _ = f.set_modified(SystemTime::now());
        }
    }

    /// Reads the key, fenced: in one transaction that succeeds only while
    /// the alive key is on this agent's lease (a document read while another
    /// agent held the key may be stale). Sends it when it is newer than what
    /// was sent, or always when `again` (SIGHUP).
    async fn read(
        &self,
        c: &mut Client,
        r: &mut Reader,
        why: &'static str,
        again: bool,
        updates: &Sender<'_>,
        feedback: &Feedback,
    ) -> Result<i64> {
        let resp = loop {
            let lease = updates.held().await?;
            let alive = naming::fleet_alive_key(&self.host);
            let fenced = Txn::new()
                .when([Compare::lease(alive, CompareOp::Equal, lease)])
                .and_then([TxnOp::get(self.key(), None)]);
            let resp = c.txn(fenced).await.context("get")?;
            if resp.succeeded() {
                break resp;
            }
            // The key is not on this agent's lease: the reporter checks it
            // and stops vouching; read again once it has said.
            updates.fence_failed().await?;
        };
        Self::problem(feedback, None);
        let store = resp.header().map_or(0, |h| h.revision());
        let kv = resp.op_responses().into_iter().find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => g.kvs().first().cloned(),
            _ => None,
        });
        match kv {
            Some(kv) if kv.mod_revision() != r.sent || again => {
                r.sent = kv.mod_revision();
                updates.send_unfenced(self.update(why, &kv, r.cluster))?;
            }
            Some(kv) => self.confirm_cache(kv.mod_revision()),
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
        let rev = self.read(c, r, "etcd: read", false, updates, feedback).await?;
        let opts = WatchOptions::new().with_start_revision(rev + 1);
        let mut stream = c.watch(self.key(), Some(opts)).await.context("watch")?;
        let mut confirm = tokio::time::interval(CONFIRM_EVERY);
        confirm.tick().await;
        loop {
            let (why, again) = tokio::select! {
                msg = stream.message() => {
                    let Some(resp) = msg.context("watch")? else { bail!("the watch stream ended") };
                    if resp.canceled() && resp.compact_revision() == 0 {
                        bail!("watch canceled: {}", resp.cancel_reason());
                    }
                    if resp.compact_revision() > 0 {
                        // The events are gone, the key is not: read it.
                        warn!("etcd compacted to revision {}; reading the key again", resp.compact_revision());
                        self.read(c, r, "etcd: read after compaction", false, updates, feedback).await?;
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
                    ("etcd: changed", false)
                }
                _ = refresh.notified() => ("SIGHUP", true),
                _ = confirm.tick() => {
                    let resp = c.get(self.key(), Some(GetOptions::new().with_keys_only())).await.context("get")?;
                    match resp.kvs().first() {
                        Some(kv) if kv.mod_revision() == r.sent => {
                            // Only the holder of the alive key vouches for the cache.
                            if updates.is_held() {
                                self.confirm_cache(kv.mod_revision());
                            }
                            continue;
                        }
                        Some(_) => ("etcd: changed", false),
                        None => continue,
                    }
                }
            };
            self.read(c, r, why, again, updates, feedback).await?;
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
    /// `Err(held)` names the agent that holds it.
    async fn acquire(&self, c: &mut Client, lease: i64) -> Result<std::result::Result<(), Held>> {
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
        let revision = resp.header().map_or(0, |h| h.revision());
        let holder = resp.op_responses().into_iter().find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => g.kvs().first().map(|kv| (kv.lease(), kv.value().to_vec())),
            _ => None,
        });
        let Some((held_by, value_held)) = holder else {
            return Ok(Err(Held { who: "the alive key vanished while taking it".into(), revision }));
        };
        let ours = std::fs::read_to_string(&self.lease_file).ok().and_then(|s| s.trim().parse::<i64>().ok());
        if ours == Some(held_by) && held_by != 0 && held_by != lease {
            // This state dir's previous agent (killed, or restarted): take over.
            let take = Txn::new().when([Compare::lease(key.clone(), CompareOp::Equal, held_by)]).and_then([put()]);
            if c.txn(take).await.context("taking over the alive key")?.succeeded() {
                let _ = c.lease_revoke(held_by).await;
                return Ok(Ok(()));
            }
            return Ok(Err(Held { who: "the alive key changed hands while taking it over".into(), revision }));
        }
        let who = serde_json::from_slice::<Alive>(&value_held)
            .map(|a| format!("pid {} on {} (lbagent {})", a.pid, a.machine, a.version))
            .unwrap_or_else(|_| "an unknown holder".into());
        Ok(Err(Held { who: format!("another agent holds {key}: {who}, lease {held_by:x}"), revision }))
    }

    /// Whether the alive key exists on `lease` now.
    async fn verify(&self, c: &mut Client, lease: i64) -> Result<bool> {
        let resp = c.get(naming::fleet_alive_key(&self.host), None).await.context("checking the alive key")?;
        Ok(resp.kvs().first().is_some_and(|kv| kv.lease() == lease))
    }

    /// Writes the status, only while the alive key is on `lease`: `false`
    /// when it is not.
    async fn write_status(&self, c: &mut Client, lease: i64, st: &HostStatus) -> Result<bool> {
        let alive = naming::fleet_alive_key(&self.host);
        let put = TxnOp::put(naming::fleet_status_key(&self.host), serde_json::to_string(st)?, None);
        let txn = Txn::new().when([Compare::lease(alive, CompareOp::Equal, lease)]).and_then([put]);
        Ok(c.txn(txn).await.context("writing the status")?.succeeded())
    }

    /// Holds the liveness lease and writes status changes on one connection,
    /// until an error, the key held by another agent, or a stop (then the
    /// lease is revoked).
    async fn report(
        &self,
        c: &mut Client,
        feedback: &Feedback,
        last: &mut Option<HostStatus>,
        lost: &mut Option<String>,
        fence: &Fence,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Reported> {
        let lease = c.lease_grant(ALIVE_TTL_SECS, None).await.context("lease grant")?.id();
        if let Err(held) = self.acquire(c, lease).await? {
            let _ = c.lease_revoke(lease).await;
            return Ok(Reported::HeldElsewhere(held));
        }
        crate::files::write_private(&self.lease_file, format!("{lease}\n").as_bytes(), true)
            .context("recording the alive lease")?;
        fence.held.send_replace(Some(lease));
        Self::alive_problem(feedback, None);
        *last = None;
        *lost = None;
        let (mut keeper, mut answers) = c.lease_keep_alive(lease).await.context("lease keep-alive")?;
        let mut tick = tokio::time::interval(KEEPALIVE_EVERY);
        tick.tick().await;
        loop {
            let now = HostStatus::of(&feedback.status.lock().unwrap().document);
            let mut gone = false;
            if last.as_ref() != Some(&now) {
                match self.write_status(c, lease, &now).await {
                    Ok(true) => {
                        *last = Some(now);
                        Self::alive_problem(feedback, None);
                    }
                    Ok(false) => gone = true,
                    // Not fatal: the key is still held; retried at the next
                    // change or keep-alive.
                    Err(e) => {
                        warn!("status to etcd: {e:#}");
                        Self::alive_problem(feedback, Some(format!("{e:#}")));
                    }
                }
            }
            if !gone {
                tokio::select! {
                    _ = feedback.changed.notified() => {}
                    _ = stop.changed() => {
                        fence.held.send_replace(None);
                        // Kept when the revoke failed: the next start takes the
                        // key back from this lease instead of waiting it out.
                        if c.lease_revoke(lease).await.is_ok() {
                            let _ = std::fs::remove_file(&self.lease_file);
                        }
                        return Ok(Reported::Stopped);
                    }
                    _ = fence.check.notified() => gone = !self.verify(c, lease).await?,
                    _ = tick.tick() => {
                        keeper.keep_alive().await.context("lease keep-alive")?;
                        match answers.message().await.context("lease keep-alive")? {
                            Some(r) if r.ttl() > 0 => {}
                            _ => bail!("the alive lease expired"),
                        }
                        gone = !self.verify(c, lease).await?;
                    }
                }
            }
            if gone {
                // Deleted, or held on another lease: stop vouching, then take
                // it back only if nobody holds it.
                fence.held.send_replace(None);
                let key = naming::fleet_alive_key(&self.host);
                let note = format!(
                    "the alive key {key} is no longer held on this agent's lease {lease:x} (deleted or taken \
                     from outside)"
                );
                warn!("{note}: nothing from etcd is applied until it is taken back");
                Self::alive_problem(feedback, Some(format!("{note}: nothing from etcd is applied")));
                // Said with every refusal until the key is held again.
                *lost = Some(note);
                if let Err(held) = self.acquire(c, lease).await? {
                    let _ = c.lease_revoke(lease).await;
                    return Ok(Reported::HeldElsewhere(held));
                }
                info!("took the alive key {key} back");
                fence.held.send_replace(Some(lease));
                Self::alive_problem(feedback, None);
                *last = None;
                *lost = None;
            } else {
                // The reader waits for a verdict after a failed fenced read.
                fence.held.send_replace(Some(lease));
            }
        }
    }

    async fn report_loop(&self, feedback: Feedback, fence: Fence) {
        let (mut next, mut backoff) = (0usize, Backoff::default());
        let (mut last, mut lost) = (None, None);
        let mut stop = feedback.stop.clone();
        loop {
            let (mut c, _) = tokio::select! {
                c = self.etcd.connect_retrying(&mut next, &mut backoff, "status") => c,
                _ = stop.changed() => return,
            };
            let since = Instant::now();
            let outcome = self.report(&mut c, &feedback, &mut last, &mut lost, &fence, &mut stop).await;
            fence.held.send_replace(None);
            // Refusals back off like failures: the step grows until a
            // connection stayed up for `Backoff::STABLE`.
            backoff.settle(since);
            let wait = backoff.wait();
            match outcome {
                Ok(Reported::Stopped) => return,
                Ok(Reported::HeldElsewhere(held)) => {
                    let who = match &lost {
                        Some(note) => format!("{note}; {}", held.who),
                        None => held.who,
                    };
                    warn!(
                        "{who}; this agent applies nothing from etcd until it is released (again in {wait:.1?}, \
                         or when the key is deleted)"
                    );
                    Self::alive_problem(&feedback, Some(format!("{who}: nothing from etcd is applied")));
                    tokio::select! {
                        _ = self.released(&mut c, held.revision) => {}
                        _ = tokio::time::sleep(wait) => {}
                        _ = stop.changed() => return,
                    }
                }
                Err(e) => {
                    Self::alive_problem(&feedback, Some(format!("status and alive key in etcd: {e:#}")));
                    next += 1;
                    warn!("status to etcd: {e:#}; again in {wait:.1?}");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = stop.changed() => return,
                    }
                }
            }
        }
    }

    /// Returns once the alive key is deleted after `revision` (never when
    /// the watch fails: the backoff decides then).
    async fn released(&self, c: &mut Client, revision: i64) {
        let opts = WatchOptions::new().with_start_revision(revision + 1);
        if let Ok(mut stream) = c.watch(naming::fleet_alive_key(&self.host), Some(opts)).await {
            while let Ok(Some(resp)) = stream.message().await {
                if resp.events().iter().any(|e| e.event_type() == EventType::Delete) {
                    return;
                }
            }
        }
        std::future::pending().await
    }
}

enum Reported {
    Stopped,
    HeldElsewhere(Held),
}

/// Who holds the alive key, as of store revision `revision`.
struct Held {
    who: String,
    revision: i64,
}

/// The reporter's word to the reader: the lease the alive key is held on
/// (`None`: not held), and the reader's request to check it.
#[derive(Clone)]
struct Fence {
    held: Arc<watch::Sender<Option<i64>>>,
    check: Arc<Notify>,
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

/// The reader's way to the daemon: documents from etcd are read only while
/// this agent holds the alive key (fencing); the cached document is sent
/// without.
struct Sender<'a> {
    updates: UnboundedSender<Update>,
    held: &'a watch::Receiver<Option<i64>>,
    check: Arc<Notify>,
}

impl Sender<'_> {
    /// Waits until this agent holds the alive key; its lease.
    async fn held(&self) -> Result<i64> {
        let mut held = self.held.clone();
        let lease = held.wait_for(|h| h.is_some()).await.map_err(|_| Gone)?;
        Ok(lease.expect("waited for"))
    }

    fn is_held(&self) -> bool {
        self.held.borrow().is_some()
    }

    /// A fenced read failed: asks the reporter to check the alive key and
    /// waits (a bounded time) for its verdict.
    async fn fence_failed(&self) -> Result<()> {
        let mut held = self.held.clone();
        held.mark_unchanged();
        self.check.notify_one();
        if let Ok(Err(_)) = tokio::time::timeout(FENCE_RECHECK, held.changed()).await {
            return Err(Gone.into());
        }
        Ok(())
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
            let (held_tx, held_rx) = watch::channel(None);
            let fence = Fence { held: Arc::new(held_tx), check: Arc::new(Notify::new()) };
            let sender = Sender { updates, held: &held_rx, check: fence.check.clone() };
            // One task: the reporter returns after revoking the lease on a
            // stop; the reader is dropped with it.
            tokio::select! {
                _ = self.read_loop(sender, refresh, &feedback) => {}
                _ = self.report_loop(feedback.clone(), fence) => {}
            }
        })
    }
}
