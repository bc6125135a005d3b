//! `lbagent run`: take desired state from its source (`source.rs`: the state
//! file, polled every second, re-read on SIGHUP), reconcile, then keep
//! reconciling on every new document and every repair interval. A refused
//! (invalid) document changes nothing that runs. SIGTERM/SIGINT stop
//! the daemon and leave the dataplane running: it belongs to the kernel.

pub mod api;
pub mod guard;
pub mod metrics;
pub mod notify;
pub mod source;
pub mod status;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use tokio::signal::unix::{SignalKind, signal};
use tracing::{debug, error, info, warn};

use crate::{
    dataplane::{
        attach::AttachMode,
        ct_gc::Collector,
        loader::{CtSizes, ZoneProgram},
        migrate::Migration,
    },
    lb::health,
    outcome::{Changes, ObjectError},
    reconcile::{ApplyReport, Kind, Reconciler, RepairPass, host::Host},
    state::Desired,
};
use status::Status;

#[derive(Clone, Debug)]
pub struct Options {
    pub state_dir: PathBuf,
    pub bpffs: PathBuf,
    pub attach: AttachMode,
    pub metrics: Option<SocketAddr>,
    pub api_socket: PathBuf,
    pub repair_interval: Duration,
    /// The conntrack tables' sizes asked for (`--conntrack-max`,
    /// `--conntrack-new-max`); the others are resolved at start
    /// (`CtSizes::resolve`: the pinned tables', or a share of memory).
    pub conntrack_max: Option<u32>,
    pub conntrack_new_max: Option<u32>,
    /// The largest share (percent) of the running objects one document may
    /// remove without `allow_mass_removal` (`guard.rs`; 100: no guard).
    pub max_removal_percent: u8,
    /// Where flow logs' JSON Lines files go (`--flow-log-dir`).
    pub flow_log_dir: PathBuf,
}

struct Daemon {
    opts: Options,
    reconciler: Reconciler<Host>,
    status: Arc<Mutex<Status>>,
    last_good: Option<Desired>,
    /// The direct-mode health prober (its checks refreshed, and the prober
    /// started when it does not run, after every apply).
    prober: health::Prober,
    /// An upgrade from the previous map layout waiting for a repair pass
    /// that attached every zone's new programs (`dataplane::migrate`).
    migration: Option<Migration>,
    /// The repair pass under way (it runs in slices between the daemon's
    /// other work).
    repair: Option<PassUnderWay>,
    /// The backends down when the daemon last acted on health.
    health_seen: BTreeSet<health::Key>,
    /// Notified after every status change (the source may report it).
    changed: Arc<tokio::sync::Notify>,
    /// The flow logger (`agent.flow_logs`), configured after every apply.
    flow_log: crate::flow_log::FlowLogger,
    /// This host's side of an HA pair (`agent.ha`): the role, the sync link.
    ha: crate::ha::Ha,
    /// The last conntrack garbage collection pass's thread; it hands back
    /// the collector it loaded, for the next pass.
    gc: Option<std::thread::JoinHandle<Option<Collector>>>,
}

impl Daemon {
    /// Refreshes the status document and the prober's check list.
    fn publish(&mut self) {
        let targets = health::targets(self.reconciler.applied.lbs.values().map(|l| &**l));
        let health = self.reconciler.realizer.health.clone();
        let checked: std::collections::HashSet<health::Key> = targets.iter().map(|t| t.key.clone()).collect();
        // A backend no longer checked is forgotten on both sides: checked
        // again later, its first fall is a change.
        self.health_seen.retain(|k| checked.contains(k));
        health.lock().unwrap().retain(&checked);
        self.prober.set_checks(targets);
        self.prober.ensure_running();
        let mut st = self.status.lock().unwrap();
        st.refresh(&self.reconciler.applied, &self.reconciler.alloc);
        let down: Vec<String> =
            health.lock().unwrap().down().iter().map(|(lb, l, b)| format!("{lb}/{l}/{b}")).collect();
        st.document.backends_down = down;
        self.changed.notify_one();
    }

    /// Takes a document from the source: applies it when valid, otherwise
    /// logs every problem and keeps what runs.
    fn reload(&mut self, mut update: source::Update) {
        let why = update.why;
        self.status.lock().unwrap().document.revision_seen = Some(update.revision.clone());
        // The document as written goes first: at 100 000 rules it is tens
        // of MB that nothing reads again.
        let state = update.state.map(|a| (a.desired, a.warnings, a.state.allow_mass_removal));
        let guarded = match &state {
            Ok((desired, _, allowed)) => {
                guard::refuse(&self.reconciler.applied, desired, *allowed, self.opts.max_removal_percent)
            }
            Err(_) => None,
        };
        if let Some(why) = guarded {
            let problems = crate::state::Problems(vec![crate::state::Problem { path: String::new(), message: why }]);
            error!(revision = %update.revision, "{}: desired state refused; keeping the running state", update.why);
            for p in &problems.0 {
                error!("  {p}");
            }
            self.status.lock().unwrap().set_rejected(Some(&problems));
            self.publish();
            return;
        }
        match state {
            Ok((desired, warnings, _)) => {
                info!(revision = %update.revision, "{why}: desired state valid, applying");
                for w in &warnings {
                    warn!("  {w}");
                }
                self.status.lock().unwrap().set_rejected(None);
                if let Some(accepted) = update.on_accept.take() {
                    accepted();
                }
                let applied = &self.reconciler.applied;
                let serving = !applied.gws.is_empty() || !applied.lbs.is_empty();
                self.ha.settle(desired.ha.as_ref(), applied.gws.values().map(|g| &**g), serving);
                self.last_good = Some(desired);
                self.apply(Some(update.revision));
            }
            Err(problems) => {
                error!(
                    revision = %update.revision,
                    "{why}: desired state refused ({} problems); keeping the running state",
                    problems.0.len()
                );
                for p in &problems.0 {
                    error!("  {p}");
                }
                self.status.lock().unwrap().set_rejected(Some(&problems));
                self.publish();
            }
        }
    }

    /// Starts a garbage collection pass on its own thread, unless the last
    /// one is still running: at a million flows a pass reads two million
    /// entries (about a second of CPU), and the loop must go on applying
    /// documents and acting on health meanwhile.
    fn start_garbage_collection(&mut self) {
        if self.gc.as_ref().is_some_and(|h| !h.is_finished()) {
            debug!("conntrack garbage collection: the previous pass is still running; skipped");
            return;
        }
        let (bpffs, status) = (self.opts.bpffs.clone(), self.status.clone());
        let collector = self.gc.take().and_then(|h| h.join().ok().flatten());
        let pass = move || collect_garbage(&bpffs, collector, &status);
        match std::thread::Builder::new().name("lbagent-gc".into()).spawn(pass) {
            Ok(h) => self.gc = Some(h),
            Err(e) => warn!("conntrack garbage collection: cannot start its thread: {e}"),
        }
    }

    /// Applies the last good document's changes; `revision`: a newly
    /// accepted document's, reported running together with this apply's
    /// result (not before: `fleet put --wait` and `lbagent status` readers
    /// must never see a revision running beside the previous apply's
    /// outcome).
    fn apply(&mut self, revision: Option<String>) {
        let Some(good) = &self.last_good else { return };
        let report = self.reconciler.apply(good, false);
        if !report.ok() {
            warn!("{} of {} steps failed; they are retried by the next repair pass", report.errors.len(), report.steps);
        }
        if let Some(p) = &mut self.repair {
            p.settled(&report);
        }
        self.record(&report, revision);
    }

    /// Starts a repair pass over every object unless one is under way.
    fn begin_repair(&mut self) {
        if self.repair.is_some() {
            return;
        }
        let p = PassUnderWay {
            pass: RepairPass::default(),
            started: std::time::SystemTime::now(),
            steps: 0,
            changes: Changes::new(),
            errors: BTreeMap::new(),
        };
        let objects = self.last_good.as_ref().map_or(0, |g| g.lbs.len() + g.gws.len());
        self.status.lock().unwrap().document.repair_pass =
            Some(status::RepairProgress { started: status::secs(Some(p.started)), objects_done: 0, objects });
        self.repair = Some(p);
    }

    /// Runs the repair pass under way for one slice: until `waiting` says
    /// that a document, a health change or a signal waits, or for
    /// `REPAIR_SLICE`. The pass is reported as one apply once complete.
    fn repair_slice(&mut self, waiting: &dyn Fn() -> bool) {
        let (Some(good), Some(p)) = (&self.last_good, &mut self.repair) else {
            self.repair = None;
            return;
        };
        let t0 = std::time::Instant::now();
        let report = self.reconciler.repair(good, &mut p.pass, &|| waiting() || t0.elapsed() > REPAIR_SLICE);
        p.steps += report.steps;
        p.changes.extend(report.changes.iter().cloned());
        p.settled(&report);
        let (done, left) = (p.pass.done(), report.deferred);
        if left > 0 {
            self.status.lock().unwrap().document.repair_pass = Some(status::RepairProgress {
                started: status::secs(Some(p.started)),
                objects_done: done,
                objects: done + left,
            });
            return;
        }
        let p = self.repair.take().expect("a pass under way");
        let total = ApplyReport {
            started: Some(p.started),
            steps: p.steps,
            changes: p.changes,
            errors: p.errors.into_values().collect(),
            ..Default::default()
        };
        if !total.ok() {
            warn!("{} of {} steps failed; they are retried by the next repair pass", total.errors.len(), total.steps);
        } else if let Some(m) = self.migration.take() {
            // Every zone runs this build's programs now: the old layout's
            // maps can go (after catching up what its programs still wrote).
            let from = m.from;
            self.reconciler.realizer.engine.migrating = false;
            // The catch-up copy and a GC pass could each leave a half the
            // other deleted: one at a time.
            if let Some(gc) = self.gc.take() {
                let _ = gc.join();
            }
            let sizes = self.reconciler.realizer.engine.ct_sizes;
            if let Err(e) = m.finish(sizes) {
                warn!("finishing the migration from layout {from}: {e:#}; the next start of the agent finishes it");
            }
        }
        self.record(&total, None);
    }

    /// Re-ensures the load balancers whose backends went down or came back
    /// since the last look (their scheduler tables leave out the backends
    /// that are down), and only those.
    fn health_changed(&mut self) {
        let Some(good) = &self.last_good else { return };
        let down: BTreeSet<health::Key> =
            self.reconciler.realizer.health.lock().unwrap().down().into_iter().cloned().collect();
        let lbs: BTreeSet<String> = down.symmetric_difference(&self.health_seen).map(|(lb, _, _)| lb.clone()).collect();
        self.health_seen = down;
        if lbs.is_empty() {
            return;
        }
        let report = self.reconciler.reensure(good, Kind::Lb, &lbs);
        if let Some(p) = &mut self.repair {
            p.settled(&report);
        }
        self.record(&report, None);
    }

    /// Reports an apply (a document's changes, or a whole repair pass).
    fn record(&mut self, report: &ApplyReport, revision: Option<String>) {
        {
            let mut st = self.status.lock().unwrap();
            st.document.applies += 1;
            st.document.last_apply = Some(status::LastApply::of(report));
            if self.repair.is_none() {
                st.document.repair_pass = None;
            }
            if let Some(r) = revision {
                st.document.revision_running = Some(r);
            }
        }
        let ha = self.last_good.as_ref().and_then(|g| g.ha.as_ref());
        let gws = self.reconciler.applied.gws.values().map(|g| &**g);
        let feed = self.ha.sync(ha, gws, &self.reconciler.alloc);
        let spec = self.last_good.as_ref().and_then(|g| g.flow_log.as_ref());
        if let Err(e) = self.flow_log.sync(spec, &self.reconciler.alloc, feed.as_ref()) {
            warn!("flow logs: {e:#}");
        }
        self.publish();
    }
}

/// The longest a repair slice runs before the daemon looks at its signals
/// and sources again (a slice also ends as soon as a document or a health
/// change is waiting).
const REPAIR_SLICE: Duration = Duration::from_millis(500);

/// A repair pass under way and what its slices found so far.
struct PassUnderWay {
    pass: RepairPass,
    started: std::time::SystemTime,
    steps: usize,
    changes: Changes,
    /// Each object's last failure, by object: an object that succeeded
    /// since (in a slice, a document's apply or a health change's) is
    /// taken out, so the pass reports what still fails, not what failed
    /// against an older document.
    errors: BTreeMap<String, ObjectError>,
}

impl PassUnderWay {
    /// Takes in the outcome of an apply made during the pass.
    fn settled(&mut self, report: &ApplyReport) {
        for o in &report.succeeded {
            self.errors.remove(o);
        }
        for e in &report.errors {
            self.errors.insert(e.object.clone(), e.clone());
        }
    }
}

/// The newest of the documents waiting: after a slow apply, a stall or a
/// burst of changes only the last one is applied (the ones it supersedes
/// are logged and skipped).
fn newest(
    mut update: source::Update,
    waiting: &mut tokio::sync::mpsc::UnboundedReceiver<source::Update>,
) -> source::Update {
    while let Ok(next) = waiting.try_recv() {
        info!(revision = %update.revision, "superseded by revision {} before it was applied; skipped", next.revision);
        update = next;
    }
    update
}

/// Frees conntrack entries idle past their timeout, then recounts the
/// least-connection backends' active flows and each zone's flows, and
/// counts the SNAT ports in use into the status. Runs
/// beside the loop (`Daemon::start_garbage_collection`): an apply may
/// remove a rule or a zone meanwhile; the recounts then write only counts
/// that still exist (a removed rule's or zone's is not brought back), and
/// flows both delete are deleted once.
fn collect_garbage(bpffs: &Path, collector: Option<Collector>, status: &Mutex<Status>) -> Option<Collector> {
    crate::crash::pause("gc-pass");
    let tables = match crate::dataplane::tables::Tables::open(bpffs) {
        Ok(t) => t,
        Err(e) => {
            warn!("conntrack garbage collection: {e:#}");
            return collector;
        }
    };
    // The collector of the last pass, unless the tables were replaced.
    let mut collector = match collector.filter(|c| c.current(bpffs)) {
        Some(c) => Some(c),
        None => match Collector::load(bpffs) {
            Ok(c) => {
                info!("conntrack garbage collector loaded (kept for the next passes)");
                Some(c)
            }
            Err(e) => {
                warn!("conntrack garbage collection: {e:#}");
                None
            }
        },
    };
    match collector.as_mut().map(|c| c.collect(&tables)) {
        None | Some(Ok(0)) => {}
        Some(Ok(n)) => info!("conntrack: {n} idle flows collected"),
        Some(Err(e)) => warn!("conntrack garbage collection: {e:#}"),
    }
    // Least-connection counts drift by the flows that ended without a
    // close (timeouts, evictions, the collection above): recount.
    match tables.recount_active() {
        Ok(0) => {}
        Ok(n) => info!("least-connection counts: {n} corrected from conntrack"),
        Err(e) => warn!("least-connection recount: {e:#}"),
    }
    // Each zone's flow counts (its conntrack share) drift the same way;
    // the SNAT port census reads the same dump.
    // The running rules and EIPs are copied under the status lock (the
    // rule map is shared, not copied) and named outside it.
    let as_of = status::secs(Some(std::time::SystemTime::now())).unwrap_or(0);
    let (rules, gws, last) = {
        let st = status.lock().unwrap();
        (st.document.rules.clone(), st.document.nat_gateways.clone(), st.document.snat_ports.clone())
    };
    let names = status::SnatNames::of(&rules, &gws);
    drop((rules, gws));
    // Sized by the last census's flows: its buffer grows only with them.
    let expected = last.map_or(0, |l| l.rules.iter().map(|r| r.flows.total()).sum::<u64>() as usize);
    let mut ports = crate::dataplane::tables::PortCounter::new(
        names.rules.keys().copied(),
        names.eips.iter().map(|(_, ip)| *ip),
        expected,
    );
    if let Err(e) = tables.recount_zone_flows_and(|k, e| ports.add(k, e)) {
        warn!("per-zone conntrack recount and SNAT port census: {e:#}");
        return collector;
    }
    match tables.rule_stats() {
        Ok(stats) => {
            let refused = stats.into_iter().filter(|(_, s)| s.refused > 0).map(|(id, s)| (id, s.refused)).collect();
            let counted = status::SnatPorts::of(&ports.finish(), &refused, &names, as_of);
            status.lock().unwrap().document.snat_ports = Some(Arc::new(counted));
        }
        Err(e) => warn!("SNAT port census: reading rule_stats: {e:#}"),
    }
    collector
}

/// Runs the daemon on desired state from `source` (the state file, or etcd
/// in fleet mode: `fleet::source`).
pub async fn run(opts: Options, source: Box<dyn source::Source>) -> Result<()> {
    crate::files::ensure_private_dir(&opts.state_dir).context("--state-dir")?;
    crate::dataplane::pins::ensure_bpffs(&opts.bpffs)?;
    let _locks = locks(&opts.state_dir, &opts.bpffs)?;
    let nofile = crate::dataplane::loader::raise_nofile();
    tracing::debug!("open file limit {nofile}");
    // An upgrade across a layout change: this layout's maps are filled from
    // the previous layout's before anything is attached.
    let (sizes, origin) = CtSizes::resolve(&opts.bpffs, opts.conntrack_max, opts.conntrack_new_max)
        .context("sizing the conntrack tables")?;
    info!(
        "conntrack tables: ct {} entries ({} flows), ct_new {} entries; sized by {origin}",
        sizes.established,
        sizes.established / 2,
        sizes.new
    );
    let migration = Migration::begin(&opts.bpffs, sizes).context("migrating the previous layout's dataplane")?;
    // Load the object once up front: it creates or reuses (after checking)
    // the pinned maps, and fails fast on a verifier or pin problem.
    ZoneProgram::load_sized(&opts.bpffs, 0, sizes).context("preparing the dataplane")?;
    let mut host = Host::new(opts.bpffs.clone(), opts.attach, &opts.state_dir);
    host.engine.ct_sizes = sizes;
    host.engine.migrating = migration.is_some();
    let reconciler = Reconciler::open(host, &opts.state_dir)?;
    let mut status = Status::default();
    status.document.state_file = source.describe();
    let status = Arc::new(Mutex::new(status));
    status.lock().unwrap().refresh(&reconciler.applied, &reconciler.alloc);

    let ha = {
        let status = status.clone();
        let report = move |r: &crate::ha::HaStatus| {
            status.lock().unwrap().document.ha = (!r.role.is_empty()).then(|| r.clone());
        };
        crate::ha::Ha::new(&opts.state_dir, &opts.bpffs, report)
    };
    let api = api::bind(&opts.api_socket)?;
    tokio::spawn(api::serve(api, status.clone(), ha.shared.clone()));
    if let Some(addr) = opts.metrics {
        let l = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding metrics on {addr}"))?;
        info!("metrics on http://{}/metrics", l.local_addr()?);
        tokio::spawn(metrics::serve(l, opts.bpffs.clone(), status.clone()));
    }

    let (wake, mut health_changed) = tokio::sync::mpsc::unbounded_channel();
    let prober = {
        let status = status.clone();
        let report = move |r: &health::ProberReport| status.lock().unwrap().document.health_prober = r.clone();
        health::Prober::new(reconciler.realizer.health.clone(), wake, report)
    };
    let changed = Arc::new(tokio::sync::Notify::new());
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let feedback = source::Feedback { status: status.clone(), changed: changed.clone(), stop };
    let flow_log = {
        let status = status.clone();
        let report = move |r: &crate::flow_log::FlowLogStatus| {
            status.lock().unwrap().document.flow_logs =
                (r.running || r.problem.is_some() || r.start_records > 0).then(|| r.clone());
        };
        crate::flow_log::FlowLogger::new(opts.bpffs.clone(), opts.flow_log_dir.clone(), report)
    };
    let mut d = Daemon {
        flow_log,
        ha,
        opts: opts.clone(),
        reconciler,
        status,
        last_good: None,
        prober,
        migration,
        changed,
        repair: None,
        health_seen: BTreeSet::new(),
        gc: None,
    };
    // Handlers first: a SIGTERM that arrives during the first apply, or
    // while waiting for the first document, must still be a clean stop (it
    // was the default action, death, before).
    let mut hup = signal(SignalKind::hangup())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let (updates_tx, mut updates) = tokio::sync::mpsc::unbounded_channel();
    let refresh = Arc::new(tokio::sync::Notify::new());
    info!("desired state from {}", source.describe());
    // systemd: ready without a document when none comes soon (fleet mode
    // before the host's first `fleet put`), so a start never waits on etcd.
    let seen = d.status.clone();
    let waiting = format!("waiting for the first desired-state document ({})", source.describe());
    notify::ready_without_document(waiting, move || seen.lock().unwrap().document.revision_seen.is_some());
    let source_task = source.run(updates_tx, refresh.clone(), feedback);
    let first = loop {
        tokio::select! {
            u = updates.recv() => break Some(u.context("the desired-state source stopped before its first document")?),
            _ = hup.recv() => refresh.notify_one(),
            _ = term.recv() => break None,
            _ = int.recv() => break None,
        }
    };
    let mut stopping = first.is_none();
    if let Some(first) = first {
        // The document's changes now; the repair pass that re-ensures every
        // object follows in slices, behind any change that comes meanwhile.
        tokio::task::block_in_place(|| d.reload(newest(first, &mut updates)));
        d.begin_repair();
        // systemd (Type=notify): started once the first document is applied
        // (or refused: the unit is up either way; the status says which).
        let summary = match &d.status.lock().unwrap().document.last_apply {
            Some(a) if a.ok => "applied".to_string(),
            Some(a) => format!("applied with {} errors", a.errors.len()),
            None => "no valid desired state yet".to_string(),
        };
        notify::notify(&format!("READY=1\nSTATUS={summary}"));
    }
    let mut repair = tokio::time::interval(opts.repair_interval);
    repair.tick().await;
    if !stopping {
        info!(api = %opts.api_socket.display(), "running");
    }
    while !stopping {
        // Signals, documents and health first; the repair pass runs in the
        // time left, a slice at a time.
        tokio::select! {
            biased;
            _ = term.recv() => stopping = true,
            _ = int.recv() => stopping = true,
            _ = hup.recv() => refresh.notify_one(),
            Some(update) = updates.recv() => tokio::task::block_in_place(|| d.reload(newest(update, &mut updates))),
            Some(()) = health_changed.recv() => tokio::task::block_in_place(|| d.health_changed()),
            _ = repair.tick() => {
                d.begin_repair();
                d.start_garbage_collection();
            }
            _ = std::future::ready(()), if d.repair.is_some() => tokio::task::block_in_place(|| {
                d.repair_slice(&|| !updates.is_empty() || !health_changed.is_empty())
            }),
        }
    }
    notify::notify("STOPPING=1");
    // The source releases what it holds (etcd's alive lease), within a bound.
    stop_tx.send_replace(true);
    let abort = source_task.abort_handle();
    if tokio::time::timeout(Duration::from_secs(3), source_task).await.is_err() {
        abort.abort();
    }
    let _ = std::fs::remove_file(&opts.api_socket);
    info!("stopped; the dataplane keeps running (`lbagent teardown` removes it)");
    Ok(())
}

/// The locks that keep one agent per state dir and per bpffs root (both:
/// two agents sharing either would fight over allocations or pins).
/// Missing directories need no lock (nothing to share yet).
fn locks(state_dir: &Path, bpffs: &Path) -> Result<Vec<crate::files::Lock>> {
    let mut out = Vec::new();
    if state_dir.is_dir() {
        out.push(crate::files::lock(&state_dir.join("agent.lock"), "state dir")?);
    }
    if bpffs.is_dir() {
        out.push(crate::files::lock(bpffs, "bpffs")?);
    }
    Ok(out)
}

/// `lbagent teardown`: removes every object the agent created, the pins and
/// the persisted allocations. Refused while a daemon serves `api_socket`.
pub fn teardown(state_dir: &Path, bpffs: &Path, api_socket: &Path) -> Result<()> {
    let bpffs_buf = bpffs.to_path_buf();
    if std::os::unix::net::UnixStream::connect(api_socket).is_ok() {
        anyhow::bail!("a daemon is running on {}; stop it first", api_socket.display());
    }
    let _locks = locks(state_dir, bpffs).context("a daemon is running; stop it first")?;
    let mut r = Reconciler::open(Host::new(bpffs_buf, AttachMode::Auto, state_dir), state_dir)?;
    let report = r.teardown();
    for c in &report.changes {
        println!("{c}");
    }
    if !report.ok() {
        for e in &report.errors {
            eprintln!("{}: {}", e.object, e.error);
        }
        anyhow::bail!("teardown incomplete; fix the errors above and run it again");
    }
    crate::dataplane::pins::remove_all(bpffs)?;
    println!("removed pins under {}", bpffs.display());
    Ok(())
}
