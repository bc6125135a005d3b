//! The HA pair (docs/ha.md): two hosts with the same objects, one active.
//!
//! The standby builds every namespace, rule and program the active has,
//! but keeps each NAT gateway's host-side links down: it neither answers
//! ARP for the gateway's addresses nor takes traffic. Promotion brings the
//! links up and announces every EIP (on `net1`) and LAN address (on
//! `eth0`) with gratuitous ARP; demotion takes them down. Both hosts give
//! a flow the same translation because the active's flows are copied into
//! the standby's conntrack tables as they are created:
//!
//! - the programs write a start record of every new flow into the ring
//!   `flow_events` (`FLOW_LOG_SYNC` in `flow_log_zones`); the flow
//!   logger's thread reads the ring and hands these records to the sync
//!   link (`crate::flow_log::Feed`);
//! - the link thread (`link.rs`) sends them to the peer at once, sends
//!   every flow with a packet in the last seconds every second (their
//!   state and idle time), and every flow in a *bulk pass* when the peer
//!   asks (it joined, rejoined, or missed a datagram) and every
//!   `bulk_every_s`;
//! - the peer writes each flow's two halves (`FlowWriter::put_flow`) under
//!   its own zone and rule ids (records name zones and rules by key), and
//!   after a complete bulk pass removes the flows the active no longer has.
//!
//! The role: who is active is decided outside (keepalived's notify script,
//! an operator) with `lbagent ha promote|demote`; `lbagent ha switchover`
//! hands the role to a ready peer over the link. It is kept in the state
//! dir, so a restarted agent resumes its role. If both hosts find each
//! other active (a partition healed, two promotions), the one promoted
//! last keeps the role: the arbiter's latest decision wins.

mod link;
pub mod wire;

use std::{
    collections::HashMap,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::{
    alloc::Allocations,
    flow_log::Feed,
    naming, netns,
    plumbing::{garp, nl::Nl},
    state::{ha::HaSpec, spec::Gw},
};

static ANNOUNCING: AtomicBool = AtomicBool::new(true);

/// Whether this host announces its gateways' addresses (it is active, or
/// alone): the plumbing keeps the host-side links up and sends gratuitous
/// ARP only then.
pub fn announcing() -> bool {
    ANNOUNCING.load(Ordering::SeqCst)
}

/// File in the state dir that keeps the role across restarts.
pub const ROLE_FILE: &str = "ha-role";

/// File in the state dir holding this host's VRRP priority adjustment, for
/// keepalived's `track_file` (weight 1): [`PRIORITY_ACTIVE`] while
/// active, 0 while standby, [`PRIORITY_HANDOVER`] while a switchover
/// hands the role over. So keepalived's mastership follows the role: the
/// active stays master, and a switchover moves the master too.
pub const PRIORITY_FILE: &str = "ha-priority";
pub const PRIORITY_ACTIVE: i32 = 50;
pub const PRIORITY_HANDOVER: i32 = -50;

/// `ha` in the status document, `lbagent ha status` and the metrics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HaStatus {
    /// `active` or `standby`.
    pub role: String,
    /// Unix time (s) this host last became active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_since: Option<u64>,
    /// This host holds every flow of its peer: a bulk pass completed since
    /// it last (re)joined. A standby that is not ready refuses a
    /// switchover.
    pub ready: bool,
    pub listen: String,
    pub peer: PeerStatus,
    /// Flow records sent to the peer, and written from it.
    pub synced_out: u64,
    pub synced_in: u64,
    /// Bulk passes sent, and received complete.
    pub bulk_passes_sent: u64,
    pub bulk_passes_received: u64,
    /// Unix time (s) of the last complete bulk pass received.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_bulk_received: Option<u64>,
    /// Flows the last complete bulk pass removed (gone on the active).
    pub swept: u64,
    /// From a new flow's start record in the ring to the peer's
    /// acknowledgement that it wrote it (ms; the last 4096 datagrams).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_ms_p50: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_ms_p99: Option<f64>,
    pub dropped: HaDrops,
    /// What fails (the socket, the maps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerStatus {
    pub address: String,
    /// Milliseconds since its last hello; absent: never heard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heard_ms: Option<u64>,
    pub active: bool,
    pub ready: bool,
}

/// Records lost or refused, by reason.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HaDrops {
    /// Start records the link had no room for (the flow logger's thread
    /// does not wait for it).
    pub feed_full: u64,
    /// Datagrams the socket did not take.
    pub send_failed: u64,
    /// Datagrams refused: not from the peer, a bad MAC, a replay.
    pub refused: u64,
    /// Records naming a zone or rule this host does not have, or an
    /// address family it does not carry.
    pub unknown: u64,
    /// Flows the conntrack tables had no room for.
    pub table_full: u64,
    /// Start records the programs had no room for in the ring
    /// (`flow_log_ring_full`, shared with flow logs): the next bulk pass
    /// carries those flows.
    #[serde(default)]
    pub ring_full: u64,
}

/// One NAT gateway's announcing side: its host-side links, and the
/// addresses announced in its namespace.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    pub netns: String,
    pub host_links: [String; 2],
    /// (link in the namespace, address).
    pub addresses: Vec<(&'static str, Ipv4Addr)>,
}

/// The targets of the running gateways `gws`.
pub fn targets<'a>(gws: impl IntoIterator<Item = &'a Gw>) -> Vec<Target> {
    gws.into_iter()
        .map(|g| {
            let (lan, ext) = naming::gw_host_veths(&g.name);
            let mut addresses = vec![(naming::GW_LAN_IF, g.lan.ip)];
            addresses.extend(g.eips.iter().map(|e| (naming::GW_EXT_IF, e.ip)));
            Target { netns: naming::gw_netns(&g.name), host_links: [lan, ext], addresses }
        })
        .collect()
}

/// Zone and rule keys both ways (records name them by key).
#[derive(Debug, Default)]
pub struct SyncNames {
    pub zone_key: HashMap<u16, Arc<str>>,
    pub zone_id: HashMap<Arc<str>, u16>,
    pub rule_key: HashMap<u32, Arc<str>>,
    pub rule_id: HashMap<Arc<str>, u32>,
}

impl SyncNames {
    pub fn of(alloc: &Allocations) -> SyncNames {
        let mut n = SyncNames::default();
        for (k, z) in &alloc.zones {
            let k: Arc<str> = Arc::from(k.as_str());
            n.zone_key.insert(*z, k.clone());
            n.zone_id.insert(k, *z);
        }
        for (k, id) in alloc.rule_ids.iter() {
            n.rule_key.insert(id, k.clone());
            n.rule_id.insert(k.clone(), id);
        }
        n
    }
}

/// A planned switchover's outcome, handed from the link thread to the
/// waiting request.
#[derive(Default)]
struct Handover {
    requested: bool,
    outcome: Option<Result<String, String>>,
}

/// What the daemon, its API and the link thread share.
pub struct Shared {
    state_dir: PathBuf,
    pub status: Mutex<HaStatus>,
    targets: Mutex<Vec<Target>>,
    names: Mutex<Arc<SyncNames>>,
    active_since_ms: AtomicU64,
    /// The role's term: every promotion takes one above both hosts' last
    /// (the peer's from its hellos). Of two active hosts, the one with the
    /// lower term steps down: it was promoted first.
    term: AtomicU64,
    peer_term: AtomicU64,
    /// Set on demotion: the link asks the new active for a bulk pass.
    want_bulk: AtomicBool,
    handover: Mutex<Handover>,
    handed_over: Condvar,
    configured: AtomicBool,
    report: Box<dyn Fn(&HaStatus) + Send + Sync>,
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// This boot of the host (a role kept across a reboot is not resumed: the
/// conntrack tables did not survive it).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Role changes, and the plumbing's reading of the role with what it does
/// to the links, one at a time (a repair pass that read "standby" must not
/// take the links down after a promotion brought them up).
static ROLE: Mutex<()> = Mutex::new(());

/// Runs `f` with the role ([`announcing`]) held still: the plumbing sets a
/// gateway's links under it.
pub fn with_role<T>(f: impl FnOnce(bool) -> T) -> T {
    let _one = ROLE.lock().unwrap_or_else(|e| e.into_inner());
    f(announcing())
}

impl Shared {
    /// Hands the status to the daemon's document.
    fn publish(&self) {
        let st = self.status.lock().unwrap().clone();
        (self.report)(&st);
    }

    /// Keeps the role (`active <since> <term> <boot id>` or
    /// `standby <term>`) and writes the priority adjustment.
    fn persist(&self, active: bool) {
        let term = self.term.load(Ordering::SeqCst);
        let text = if active {
            format!("active {} {term} {}\n", self.active_since_ms.load(Ordering::SeqCst), boot_id())
        } else {
            format!("standby {term}\n")
        };
        if let Err(e) = crate::files::write_private(&self.state_dir.join(ROLE_FILE), text.as_bytes(), true) {
            warn!("ha: keeping the role in {}: {e:#}", self.state_dir.display());
        }
        self.set_priority(if active { PRIORITY_ACTIVE } else { 0 });
    }

    fn set_priority(&self, p: i32) {
        let path = self.state_dir.join(PRIORITY_FILE);
        // Replaced whole (keepalived watches it); readable by root.
        let tmp = self.state_dir.join(format!("{PRIORITY_FILE}.new"));
        let done = crate::files::write_private(&tmp, format!("{p}\n").as_bytes(), false)
            .and_then(|()| std::fs::rename(&tmp, &path).context("renaming"));
        if let Err(e) = done {
            warn!("ha: writing {}: {e:#}", path.display());
        }
    }

    /// The peer's term, from an authenticated hello addressed to this run.
    fn peer_term(&self, term: u64) {
        self.peer_term.fetch_max(term, Ordering::SeqCst);
    }

    /// Takes the active role: every gateway's links up, its addresses
    /// announced (again at 0.1, 0.3, 1 and 2 s: the bridge may see the
    /// link come up after the first announcement, and re-learns the LAN
    /// MAC here after the old active's last packets). Every gateway is
    /// tried; the errors are reported together.
    pub fn promote(&self, why: &str) -> Result<String> {
        let _one = ROLE.lock().unwrap_or_else(|e| e.into_inner());
        let was = announcing();
        ANNOUNCING.store(true, Ordering::SeqCst);
        if !was {
            self.active_since_ms.store(unix_ms(), Ordering::SeqCst);
            let next = self.term.load(Ordering::SeqCst).max(self.peer_term.load(Ordering::SeqCst)) + 1;
            self.term.store(next, Ordering::SeqCst);
        }
        self.persist(true);
        let targets = self.targets.lock().unwrap().clone();
        let failed = set_links(&targets, true);
        let announced = announce(&targets);
        {
            let mut st = self.status.lock().unwrap();
            st.role = "active".into();
            st.active_since = Some(self.active_since_ms.load(Ordering::SeqCst) / 1000);
            st.problem = (!failed.is_empty()).then(|| failed.join("; "));
        }
        let later = targets.clone();
        std::thread::spawn(move || {
            for wait in [100, 200, 700, 1000] {
                std::thread::sleep(Duration::from_millis(wait));
                announce(&later);
            }
        });
        self.publish();
        let msg = format!("active ({why}): {} gateways up, {announced} addresses announced", targets.len());
        info!("ha: {msg}");
        if failed.is_empty() { Ok(msg) } else { anyhow::bail!("{msg}; but: {}", failed.join("; ")) }
    }

    /// Announces every address again (the active, when its peer stepped
    /// down).
    pub fn reannounce(&self) {
        let targets = self.targets.lock().unwrap().clone();
        announce(&targets);
    }

    /// Gives up the active role: every gateway's host-side links down
    /// (every gateway tried; the errors reported together).
    pub fn demote(&self, why: &str) -> Result<String> {
        let _one = ROLE.lock().unwrap_or_else(|e| e.into_inner());
        ANNOUNCING.store(false, Ordering::SeqCst);
        self.active_since_ms.store(0, Ordering::SeqCst);
        self.want_bulk.store(true, Ordering::SeqCst);
        self.persist(false);
        let targets = self.targets.lock().unwrap().clone();
        let failed = set_links(&targets, false);
        {
            let mut st = self.status.lock().unwrap();
            st.role = "standby".into();
            st.active_since = None;
            st.problem = (!failed.is_empty()).then(|| failed.join("; "));
        }
        self.publish();
        let msg = format!("standby ({why}): {} gateways down", targets.len());
        info!("ha: {msg}");
        if failed.is_empty() { Ok(msg) } else { anyhow::bail!("{msg}; but: {}", failed.join("; ")) }
    }

    /// A planned switchover, asked on the active: the link hands the role
    /// to the peer (once the peer is heard and ready, and has every flow
    /// sent so far), and this host steps down once the peer says it is
    /// active.
    pub fn switchover(&self) -> Result<String, String> {
        if !self.configured.load(Ordering::SeqCst) {
            return Err("this host is not one of an HA pair (agent.ha)".into());
        }
        if !announcing() {
            return Err("this host is the standby: run the switchover on the active".into());
        }
        let mut h = self.handover.lock().unwrap();
        h.requested = true;
        h.outcome = None;
        let (mut h, _) = self
            .handed_over
            .wait_timeout_while(h, link::HANDOVER_WAIT + Duration::from_secs(1), |h| h.outcome.is_none())
            .unwrap();
        h.requested = false;
        let outcome = h.outcome.take().unwrap_or_else(|| Err("the link did not answer".into()));
        drop(h);
        if outcome.is_err() && announcing() {
            self.set_priority(PRIORITY_ACTIVE);
        }
        outcome
    }

    fn handover_requested(&self) -> bool {
        self.handover.lock().unwrap().requested
    }

    fn handover_done(&self, outcome: Result<String, String>) {
        let mut h = self.handover.lock().unwrap();
        h.requested = false;
        h.outcome = Some(outcome);
        self.handed_over.notify_all();
    }

    pub fn is_configured(&self) -> bool {
        self.configured.load(Ordering::SeqCst)
    }

    /// A session id for a new run of the link: the wall clock, but always
    /// above the last one this host used (kept in the state dir), so a
    /// clock stepped back never makes the peer refuse this host.
    fn next_session(&self) -> u64 {
        let path = self.state_dir.join(SESSION_FILE);
        let last: u64 = std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        let session = now.max(last + 1);
        if let Err(e) = crate::files::write_private(&path, format!("{session}\n").as_bytes(), true) {
            warn!("ha: keeping the link's run id in {}: {e:#}", path.display());
        }
        session
    }
}

/// File in the state dir with the last run id the sync link used (each
/// start of the link takes a higher one).
const SESSION_FILE: &str = "ha-session";

/// Every target's host-side links up or down, each tried; what failed.
fn set_links(targets: &[Target], up: bool) -> Vec<String> {
    let done = netns::run_in(None, || {
        let nl = Nl::new()?;
        let mut failed = Vec::new();
        for t in targets {
            for l in &t.host_links {
                // A gateway still being built has no links yet.
                let set = nl.index(l).and_then(|i| match i {
                    Some(i) if up => nl.set_up(i),
                    Some(i) => nl.set_down(i),
                    None => Ok(()),
                });
                if let Err(e) = set {
                    failed.push(format!("{l}: {e:#}"));
                }
            }
        }
        Ok(failed)
    });
    done.unwrap_or_else(|e| vec![format!("{e:#}")])
}

/// Whether any target's host-side link exists and is down.
fn links_down(targets: &[Target]) -> bool {
    netns::run_in(None, || {
        let nl = Nl::new()?;
        for t in targets {
            for l in &t.host_links {
                if let Some(i) = nl.index(l)?
                    && !nl.link_info(i)?.0
                {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    })
    .unwrap_or(false)
}

/// Gratuitous ARP for every target's addresses; how many were sent.
fn announce(targets: &[Target]) -> usize {
    let mut n = 0;
    for t in targets {
        let sent = netns::run_in(Some(&t.netns), || {
            let nl = Nl::new()?;
            let mut n = 0;
            // Both hosts answer to the LAN MAC for a switchover's moment:
            // an ARP reply to this host's request may reach the peer. A
            // neighbour left unresolved is asked again after 20 ms, not
            // the default second (and after three tries, on the next
            // packet: only a stream's packets wait for it).
            for link in [naming::GW_LAN_IF, naming::GW_EXT_IF] {
                let _ = crate::plumbing::sysctl::set(&format!("net.ipv4.neigh.{link}.retrans_time_ms"), "20");
            }
            for (link, ip) in &t.addresses {
                let Some(i) = nl.index(link)? else { continue };
                let mac: [u8; 6] = nl.link_info(i)?.1.try_into().unwrap_or([0; 6]);
                match garp::announce(i, mac, *ip) {
                    Ok(()) => n += 1,
                    Err(e) => warn!("ha: gratuitous ARP for {ip} in {}: {e:#}", t.netns),
                }
            }
            Ok(n)
        });
        match sent {
            Ok(k) => n += k,
            Err(e) => warn!("ha: announcing in {}: {e:#}", t.netns),
        }
    }
    n
}

/// The daemon's side: the shared state and the link thread.
pub struct Ha {
    pub shared: Arc<Shared>,
    bpffs: PathBuf,
    running: Option<Running>,
    /// The feed of start records, one for the agent's life: a restarted
    /// link takes the same receiving end, so the flow logger's thread
    /// never feeds a channel nobody reads.
    feed: Feed,
    feed_rx: Arc<Mutex<std::sync::mpsc::Receiver<Vec<lbagent_common::FlowEvent>>>>,
    /// The role was settled for this run (from the role file, or first
    /// configured).
    settled: bool,
}

struct Running {
    spec: HaSpec,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Ha {
    pub fn new(state_dir: &Path, bpffs: &Path, report: impl Fn(&HaStatus) + Send + Sync + 'static) -> Ha {
        let shared = Arc::new(Shared {
            state_dir: state_dir.to_path_buf(),
            status: Mutex::default(),
            targets: Mutex::default(),
            names: Mutex::default(),
            active_since_ms: AtomicU64::new(0),
            term: AtomicU64::new(0),
            peer_term: AtomicU64::new(0),
            want_bulk: AtomicBool::new(true),
            handover: Mutex::default(),
            handed_over: Condvar::new(),
            configured: AtomicBool::new(false),
            report: Box::new(report),
        });
        let (tx, rx) = std::sync::mpsc::sync_channel(link::FEED_BATCHES);
        let feed = Feed { tx, lost: Arc::default() };
        Ha {
            shared,
            bpffs: bpffs.to_path_buf(),
            running: None,
            settled: false,
            feed,
            feed_rx: Arc::new(Mutex::new(rx)),
        }
    }

    /// Before a document's apply: settles the role the first time (the
    /// plumbing asks [`announcing`]). A host alone is active. A host of a
    /// pair resumes the role kept in the state dir, but an active one whose
    /// gateways' links are down (its host failed, or was taken down
    /// meanwhile) comes back as standby; without a kept role it is active
    /// when it already runs objects (HA added to a serving host) and
    /// standby when it is new.
    pub fn settle<'a>(&mut self, spec: Option<&HaSpec>, gws: impl IntoIterator<Item = &'a Gw>, serving: bool) {
        self.shared.configured.store(spec.is_some(), Ordering::SeqCst);
        if spec.is_none() {
            ANNOUNCING.store(true, Ordering::SeqCst);
            self.settled = false;
            return;
        }
        if self.settled {
            return;
        }
        self.settled = true;
        let kept = std::fs::read_to_string(self.shared.state_dir.join(ROLE_FILE)).ok();
        let words: Vec<&str> = kept.as_deref().unwrap_or("").split_whitespace().collect();
        let number = |i: usize| words.get(i).and_then(|w| w.parse::<u64>().ok());
        let (mut active, since, term) = match words.first().copied() {
            Some("standby") => (false, 0, number(1).unwrap_or(0)),
            Some("active") => (true, number(1).unwrap_or_else(unix_ms), number(2).unwrap_or(0)),
            _ => (serving, unix_ms(), 0),
        };
        self.shared.term.store(term, Ordering::SeqCst);
        if active && kept.is_some() {
            if words.get(3).copied() != Some(boot_id().as_str()) {
                info!("ha: the role kept is active, but from before this host's boot: starting as standby");
                active = false;
            } else if links_down(&targets(gws)) {
                info!("ha: the role kept is active, but the gateways' links are down: starting as standby");
                active = false;
            }
        }
        ANNOUNCING.store(active, Ordering::SeqCst);
        self.shared.active_since_ms.store(if active { since } else { 0 }, Ordering::SeqCst);
        self.shared.persist(active);
        let mut st = self.shared.status.lock().unwrap();
        st.role = if active { "active" } else { "standby" }.into();
        st.active_since = active.then_some(since / 1000);
        info!("ha: starting as {}", st.role);
        drop(st);
        self.shared.publish();
    }

    /// After every apply: the targets and names from what runs, the link
    /// (re)started or stopped with `spec`. Returns the feed the flow
    /// logger's thread hands start records to.
    pub fn sync<'a>(
        &mut self,
        spec: Option<&HaSpec>,
        gws: impl IntoIterator<Item = &'a Gw>,
        alloc: &Allocations,
    ) -> Option<Feed> {
        *self.shared.targets.lock().unwrap() = targets(gws);
        if spec.is_some() {
            *self.shared.names.lock().unwrap() = Arc::new(SyncNames::of(alloc));
        }
        if self.running.as_ref().map(|r| &r.spec) != spec {
            self.stop();
            if let Some(spec) = spec {
                self.start(spec.clone());
            } else {
                *self.shared.status.lock().unwrap() = HaStatus::default();
                (self.shared.report)(&HaStatus::default());
            }
        }
        self.running.as_ref().map(|_| self.feed.clone())
    }

    fn start(&mut self, spec: HaSpec) {
        let stop = Arc::new(AtomicBool::new(false));
        let mut l = link::Link::new(
            spec.clone(),
            self.shared.clone(),
            self.bpffs.clone(),
            self.feed_rx.clone(),
            self.feed.lost.clone(),
            stop.clone(),
        );
        let thread =
            std::thread::Builder::new().name("ha-link".into()).spawn(move || l.run()).expect("spawning the HA link");
        info!("ha: sync link on {} with peer {}", spec.listen, spec.peer);
        self.running = Some(Running { spec, stop, thread });
    }

    pub fn stop(&mut self) {
        let Some(r) = self.running.take() else { return };
        r.stop.store(true, Ordering::SeqCst);
        let _ = r.thread.join();
    }
}

impl Drop for Ha {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The role kept in `state_dir` ("active" or "standby"), for tests and
/// `lbagent ha status` without a daemon.
pub fn kept_role(state_dir: &Path) -> Result<String> {
    let text = std::fs::read_to_string(state_dir.join(ROLE_FILE)).context("reading the kept role")?;
    Ok(text.split_whitespace().next().unwrap_or("").to_string())
}
