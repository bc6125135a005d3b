//! Flow logs: who used which address and port, when (docs/flow-logs.md).
//!
//! The programs write a start record when a logged flow is created and an
//! end record when it closes (FIN both ways, RST) into the ring
//! `flow_events`, and count each logged flow's packets and bytes in
//! `flow_acct` (`lbagent-ebpf/src/flow_log.rs`). The logger, threads of
//! the daemon (`export.rs`), consumes the ring, scans `flow_acct` for
//! flows that ended otherwise (`ends.rs`), names each record's object and rules
//! (`record.rs`), filters them by rule kind and exports them: IPFIX to each
//! collector (`ipfix.rs`), JSON Lines to a file or standard output
//! (`jsonl.rs`).
//!
//! It never holds a packet back: the programs drop a record the ring has no
//! room for (`flow_log_ring_full`), the logger drops what a collector or
//! the file does not take, and counts both. Which zones log, and one flow
//! in how many, is written into `flow_log_zones` at every apply
//! ([`FlowLogger::sync`]).

pub mod ends;
mod export;
pub mod ipfix;
pub mod jsonl;
pub mod record;

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::Result;
use lbagent_common::*;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::{alloc::Allocations, dataplane::tables::Tables, state::flow_log::FlowLogSpec};

/// The default directory of JSON Lines files (`--flow-log-dir`).
pub const DEFAULT_DIR: &str = "/var/log/lbagent";

/// Longest wait for records before the logger looks at its other work.
pub(crate) const POLL: Duration = Duration::from_millis(100);
/// Records taken from the ring, and exported, at a time.
pub(crate) const BATCH: usize = 4096;
/// Scans of `flow_acct` for ended flows (on a thread of their own): at
/// least this far apart, and ten times as far apart as the last one took
/// (a scan looks each logged flow up: at a million flows about a second).
pub(crate) const SCAN_EVERY: Duration = Duration::from_secs(2);
/// How long the names of removed rules stay for the records of their last
/// flows (the flows a removal flushes end within a scan or two).
const RETAIN: Duration = Duration::from_secs(600);
/// A collector whose socket could not be made is tried again this often.
pub(crate) const RETRY: Duration = Duration::from_secs(5);
/// The longest `stop` waits for the thread (a write to a stuck file or a
/// blocked standard output); it is left to finish on its own after.
const STOP_WAIT: Duration = Duration::from_secs(3);

/// Names of zones and rules for the records, from the allocations. Rule
/// ids are never reused, so a removed rule's name is kept a while
/// ([`RETAIN`]) for the records of its last flows; zone ids are reused, so
/// a record's object is its rule's (a rule key starts with its object's
/// key) and the zone's only when the rule has no name.
#[derive(Debug, Default)]
pub struct Names {
    pub zones: HashMap<u16, Arc<str>>,
    pub rules: HashMap<u32, Arc<str>>,
    gone: HashMap<u32, (Arc<str>, Instant)>,
}

impl Names {
    pub fn of(alloc: &Allocations) -> Names {
        Names {
            zones: alloc.zones.iter().map(|(k, z)| (*z, Arc::from(k.as_str()))).collect(),
            rules: alloc.rule_ids.iter().map(|(k, id)| (id, k.clone())).collect(),
            gone: HashMap::new(),
        }
    }

    /// The names of `alloc`, keeping those of rules removed since `self`
    /// for [`RETAIN`].
    pub fn after(&self, alloc: &Allocations) -> Names {
        let mut next = Names::of(alloc);
        let now = Instant::now();
        let removed =
            self.rules.iter().filter(|(id, _)| !next.rules.contains_key(id)).map(|(id, k)| (*id, (k.clone(), now)));
        let kept = self.gone.iter().filter(|(id, (_, at))| !next.rules.contains_key(id) && at.elapsed() < RETAIN);
        next.gone = kept.map(|(id, v)| (*id, v.clone())).chain(removed).collect();
        next
    }

    pub fn rule(&self, id: u32) -> Option<Arc<str>> {
        if id == 0 {
            return None;
        }
        self.rules.get(&id).or_else(|| self.gone.get(&id).map(|(k, _)| k)).cloned()
    }

    /// A record's object: its rule's, else its zone's when it has no rule
    /// (`ruled`: it has one, named or not; a rule without a name here is
    /// another object's for all the zone says: its zone id may be reused).
    pub fn object(&self, zone: u16, ruled: bool, rule: Option<&Arc<str>>) -> Option<Arc<str>> {
        match rule {
            Some(key) => Some(Arc::from(crate::naming::rule_object(key).trim_end_matches('/'))),
            None if ruled => None,
            None => self.zones.get(&zone).cloned(),
        }
    }
}

/// The logger in the status document (`lbagent status`, metrics).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FlowLogStatus {
    pub running: bool,
    /// Why it does not run, or what fails (a collector's socket, the file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    pub start_records: u64,
    pub end_records: u64,
    /// Records left out by the `kinds` filter.
    pub filtered: u64,
    pub ipfix_sent: u64,
    pub jsonl_written: u64,
    /// Records lost, by reason.
    pub dropped: FlowLogDrops,
    /// Logged flows alive at the last scan.
    pub logged_flows: u64,
    /// Unix time (s) of the last scan, and how long it took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scan: Option<u64>,
    pub last_scan_ms: u64,
}

/// Records lost, by reason: the ring was full (the program's count), a
/// logged flow had no room for its counts (so no end record), a send to a
/// collector failed, a write to the file failed, the logger stopped (a
/// change of `agent.flow_logs`, the daemon's stop) with end records of a
/// scan not exported.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FlowLogDrops {
    pub ring_full: u64,
    pub acct_full: u64,
    pub ipfix_send_failed: u64,
    pub jsonl_write_failed: u64,
    /// End records a scan made that the logger, stopping, did not export.
    #[serde(default)]
    pub stopped: u64,
}

impl FlowLogDrops {
    pub fn by_name(&self) -> [(&'static str, u64); 5] {
        [
            ("ring_full", self.ring_full),
            ("acct_full", self.acct_full),
            ("ipfix_send_failed", self.ipfix_send_failed),
            ("jsonl_write_failed", self.jsonl_write_failed),
            ("stopped", self.stopped),
        ]
    }
}

pub(crate) type Report = Arc<dyn Fn(&FlowLogStatus) + Send + Sync>;

/// Another consumer of the records (the HA pair's sync, `crate::ha`): the
/// ring has one reader, the logger's thread, which hands each batch of
/// start records with `FLOW_LOG_SYNC` to it. A batch it has no room for is
/// counted in `lost`, never waited for (the next bulk pass repairs it).
#[derive(Clone)]
pub struct Feed {
    pub tx: std::sync::mpsc::SyncSender<Vec<FlowEvent>>,
    pub lost: Arc<std::sync::atomic::AtomicU64>,
}

/// The daemon's flow logger: the zones it configured and the thread that
/// exports.
pub struct FlowLogger {
    bpffs: PathBuf,
    /// Where JSON Lines files go (`--flow-log-dir`).
    dir: PathBuf,
    report: Report,
    names: Arc<Mutex<Arc<Names>>>,
    /// What `flow_log_zones` holds (read once, then kept equal).
    zones: Option<BTreeMap<u16, FlowLogZone>>,
    running: Option<Running>,
    /// The counts of a thread that stopped carry over to the next.
    carried: Arc<Mutex<FlowLogStatus>>,
}

struct Running {
    spec: Option<FlowLogSpec>,
    fed: bool,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl FlowLogger {
    pub fn new(bpffs: PathBuf, dir: PathBuf, report: impl Fn(&FlowLogStatus) + Send + Sync + 'static) -> Self {
        FlowLogger {
            bpffs,
            dir,
            report: Arc::new(report),
            names: Arc::default(),
            zones: None,
            running: None,
            carried: Arc::default(),
        }
    }

    /// After every apply: logs what `spec` asks for (`None`: nothing) of the
    /// zones in `alloc`, and hands every new flow's start record to `feed`
    /// when there is one. Writes `flow_log_zones` where it differs, and
    /// (re)starts or stops the thread when either changed.
    pub fn sync(&mut self, spec: Option<&FlowLogSpec>, alloc: &Allocations, feed: Option<&Feed>) -> Result<()> {
        if spec.is_some() || feed.is_some() {
            let next = self.names.lock().unwrap().after(alloc);
            *self.names.lock().unwrap() = Arc::new(next);
        }
        if crate::dataplane::pins::versioned_dir(&self.bpffs).join(MAP_CT.name).exists() {
            let t = Tables::open(&self.bpffs)?;
            if t.has_flow_log() {
                self.write_zones(&t, spec, alloc, feed.is_some())?;
                if spec.is_none_or(|s| !s.end) {
                    // Counts nobody will write an end record from.
                    let mut keys = Vec::new();
                    t.each_flow_acct(|k, _| keys.extend_from_slice(k))?;
                    t.remove_flow_acct(&keys)?;
                }
            }
        }
        let running = self.running.as_ref().map(|r| (r.spec.as_ref(), r.fed));
        if running != Some((spec, feed.is_some())) && (running.is_some() || spec.is_some() || feed.is_some()) {
            self.stop();
            if spec.is_some() || feed.is_some() {
                self.start(spec.cloned(), feed.cloned());
            }
            if spec.is_none() {
                (self.report)(&FlowLogStatus::default());
            }
        }
        Ok(())
    }

    fn write_zones(&mut self, t: &Tables, spec: Option<&FlowLogSpec>, alloc: &Allocations, sync: bool) -> Result<()> {
        let mut want = BTreeMap::new();
        for (key, zone) in &alloc.zones {
            let mut z = FlowLogZone { flags: u32::from(sync) * FLOW_LOG_SYNC, sample: 1 };
            if let Some(s) = spec.filter(|s| s.objects.is_empty() || s.objects.contains(key)) {
                z.flags |= (u32::from(s.start) * FLOW_LOG_START) | (u32::from(s.end) * FLOW_LOG_END);
                z.sample = s.sample;
            }
            if z.flags != 0 {
                want.insert(*zone, z);
            }
        }
        let have = match self.zones.take() {
            Some(h) => h,
            None => t.flow_log_zones()?,
        };
        let mut now = have.clone();
        for (zone, z) in &want {
            if have.get(zone) != Some(z) {
                t.set_flow_log_zone(*zone, *z)?;
                now.insert(*zone, *z);
            }
        }
        for zone in have.keys().filter(|z| !want.contains_key(z)) {
            t.set_flow_log_zone(*zone, FlowLogZone::default())?;
            now.remove(zone);
        }
        self.zones = Some(now);
        Ok(())
    }

    fn start(&mut self, spec: Option<FlowLogSpec>, feed: Option<Feed>) {
        let stop = Arc::new(AtomicBool::new(false));
        let fed = feed.is_some();
        let mut logger = export::Logger {
            bpffs: self.bpffs.clone(),
            dir: self.dir.clone(),
            logs: spec.is_some(),
            spec: spec.clone().unwrap_or_default(),
            feed,
            names: self.names.clone(),
            report: self.report.clone(),
            status: self.carried.clone(),
            stop: stop.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("flow-log".into())
            .spawn(move || logger.run())
            .expect("spawning the flow logger");
        match &spec {
            Some(s) => {
                info!("flow logs: started ({} IPFIX collectors, JSON Lines: {})", s.ipfix.len(), s.jsonl.is_some())
            }
            None => info!("flow events: read for the HA sync only"),
        }
        self.running = Some(Running { spec, fed, stop, thread });
    }

    /// Stops the thread (the ring keeps what it did not read, for the
    /// next one), waiting at most [`STOP_WAIT`].
    pub fn stop(&mut self) {
        let Some(r) = self.running.take() else { return };
        r.stop.store(true, Ordering::Relaxed);
        let began = Instant::now();
        while !r.thread.is_finished() {
            if began.elapsed() > STOP_WAIT {
                warn!("flow logs: the logger is stuck (a write that does not return); left to finish on its own");
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = r.thread.join();
    }
}

impl Drop for FlowLogger {
    fn drop(&mut self) {
        self.stop();
    }
}
