//! Health checks for direct-mode listeners (proxy-mode listeners are checked
//! by haproxy). One prober thread runs every backend's check at its
//! interval, each probe from a socket of the load balancer's namespace;
//! `rise` successes bring a backend up, `fall` failures take it down, and a
//! change re-applies the load balancer so new flows only go to backends that
//! are up (flows already on a backend keep their conntrack entry and drain).
//!
//! Bounded and fair: the thread is an event loop (no thread per probe) with
//! at most [`MAX_IN_FLIGHT`] probes in flight; every probe ends at its
//! check's `timeout`, counted from its start (connect, request and answer
//! together), so a backend that drops SYNs, accepts and never answers, or
//! drips its answer holds one slot for at most that long. Due checks wait in
//! one queue per load balancer, served in turn, and no load balancer holds
//! more than its share of the slots: one tenant's slow backends never delay
//! another's checks. A prober that cannot start (no thread, no event loop)
//! or stops is reported ([`ProberReport`]: status and metrics) and started
//! again at the next apply.

use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    fs::File,
    net::SocketAddr,
    os::fd::OwnedFd,
    sync::{Arc, Mutex},
    time::Duration,
};

use nix::{
    sched::{CloneFlags, setns},
    sys::socket::{AddressFamily, SockFlag, SockType},
};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::{Notify, mpsc::UnboundedSender},
    task::JoinSet,
    time::Instant,
};
use tracing::{error, info, warn};

use crate::{
    naming, netns,
    state::spec::{HealthCheckType, Lb, ListenerMode},
};

/// (load balancer id, listener id, backend id).
pub type Key = (String, String, String);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendHealth {
    pub up: bool,
    /// Consecutive results that disagree with `up`.
    streak: u32,
}

impl Default for BackendHealth {
    /// Unknown backends count as up, so a restart never blackholes traffic.
    fn default() -> Self {
        BackendHealth { up: true, streak: 0 }
    }
}

impl BackendHealth {
    /// Records one check result; returns whether `up` changed.
    pub fn observe(&mut self, ok: bool, rise: u32, fall: u32) -> bool {
        if ok == self.up {
            self.streak = 0;
            return false;
        }
        self.streak += 1;
        let needed = if self.up { fall } else { rise };
        if self.streak >= needed.max(1) {
            self.up = ok;
            self.streak = 0;
            return true;
        }
        false
    }
}

#[derive(Default)]
pub struct Health {
    states: HashMap<Key, BackendHealth>,
}

impl Health {
    pub fn is_up(&self, lb: &str, listener: &str, backend: &str) -> bool {
        self.states.get(&(lb.to_string(), listener.to_string(), backend.to_string())).is_none_or(|s| s.up)
    }

    pub fn observe(&mut self, key: &Key, ok: bool, rise: u32, fall: u32) -> bool {
        self.states.entry(key.clone()).or_default().observe(ok, rise, fall)
    }

    /// Forgets backends that are no longer checked.
    pub fn retain(&mut self, keep: &HashSet<Key>) {
        self.states.retain(|k, _| keep.contains(k));
    }

    pub fn down(&self) -> Vec<&Key> {
        self.states.iter().filter(|(_, s)| !s.up).map(|(k, _)| k).collect()
    }
}

/// One backend check to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub key: Key,
    pub netns: String,
    pub kind: HealthCheckType,
    pub addr: SocketAddr,
    pub interval: Duration,
    pub timeout: Duration,
    pub rise: u32,
    pub fall: u32,
    pub path: String,
    pub expect_status: Option<u16>,
}

/// Every check the applied load balancers ask for (direct listeners only).
pub fn targets<'a>(lbs: impl IntoIterator<Item = &'a Lb>) -> Vec<Target> {
    let mut out = Vec::new();
    for lb in lbs {
        for l in lb.listeners.iter().filter(|l| l.mode == ListenerMode::Direct) {
            let Some(h) = &l.health else { continue };
            for b in &l.group.backends {
                out.push(Target {
                    key: (lb.id.clone(), l.id.clone(), b.id.clone()),
                    netns: naming::lb_netns(&lb.id),
                    kind: h.kind,
                    addr: SocketAddr::from((b.addr, b.port)),
                    interval: Duration::from_secs(h.interval_s as u64),
                    timeout: Duration::from_secs(h.timeout_s as u64),
                    rise: h.rise,
                    fall: h.fall,
                    path: h.path.clone(),
                    expect_status: h.expect_status,
                });
            }
        }
    }
    out
}

/// What one check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    Up,
    Down,
    /// The check could not run here (namespace, sockets, local ports or
    /// memory): says nothing about the backend, which keeps its state.
    LocalError(String),
}

/// Errors that are the prober's own, not the backend's answer.
fn local(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::EADDRNOTAVAIL
                | libc::EADDRINUSE
                | libc::EACCES
                | libc::EPERM
                | libc::EAFNOSUPPORT
                | libc::EINVAL
        )
    )
}

fn verdict(r: std::io::Result<bool>) -> Probe {
    match r {
        Ok(true) => Probe::Up,
        Ok(false) => Probe::Down,
        Err(e) if local(&e) => Probe::LocalError(e.to_string()),
        Err(_) => Probe::Down,
    }
}

/// Probes in flight at once, over every load balancer (each holds one
/// socket for at most its check's timeout).
pub const MAX_IN_FLIGHT: usize = 128;

/// How long recording results waits for the health table when an apply
/// holds it (results are kept, in order, and recorded after).
const RECORD_RETRY: Duration = Duration::from_millis(20);

/// A socket of the load balancer's namespace for the check, or why there is
/// none.
enum SocketError {
    /// Says nothing about the backend (namespace gone, no descriptors).
    Local(String),
    /// The thread could not return to its own namespace: it must not make
    /// another socket (the next one would be in the wrong namespace).
    Stranded(String),
}

/// A socket for `kind` in the prober's current namespace (non-blocking).
fn socket(kind: HealthCheckType) -> std::io::Result<OwnedFd> {
    let ty = match kind {
        HealthCheckType::Udp => SockType::Datagram,
        HealthCheckType::Tcp | HealthCheckType::Http => SockType::Stream,
    };
    Ok(nix::sys::socket::socket(AddressFamily::Inet, ty, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?)
}

/// A socket made inside namespace `netns` (a socket stays in the namespace
/// it was made in): this thread enters it, makes the socket and goes back
/// to `home` before anything else runs on it.
fn socket_in(netns: &str, home: &File, kind: HealthCheckType) -> Result<OwnedFd, SocketError> {
    let ns =
        netns::open(netns).map_err(|e| SocketError::Local(format!("entering the load balancer's namespace: {e:#}")))?;
    setns(&ns, CloneFlags::CLONE_NEWNET)
        .map_err(|e| SocketError::Local(format!("entering the load balancer's namespace {netns}: {e}")))?;
    let made = socket(kind);
    setns(home, CloneFlags::CLONE_NEWNET)
        .map_err(|e| SocketError::Stranded(format!("returning from namespace {netns}: {e}")))?;
    made.map_err(|e| SocketError::Local(format!("socket: {e}")))
}

/// Runs one check on `fd` (a fresh socket for `t.kind`), ending by
/// `deadline` whatever the backend does.
async fn check(t: &Target, fd: OwnedFd, deadline: Instant) -> Probe {
    match t.kind {
        HealthCheckType::Tcp => {
            let connect = tokio::time::timeout_at(deadline, connect(t, fd));
            match connect.await {
                Ok(r) => verdict(r.map(|_| true)),
                Err(_) => Probe::Down,
            }
        }
        HealthCheckType::Http => match tokio::time::timeout_at(deadline, http(t, fd)).await {
            Ok(r) => verdict(r),
            Err(_) => Probe::Down,
        },
        HealthCheckType::Udp => verdict(udp(t, fd, deadline).await),
    }
}

async fn connect(t: &Target, fd: OwnedFd) -> std::io::Result<tokio::net::TcpStream> {
    tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(fd)).connect(t.addr).await
}

async fn http(t: &Target, fd: OwnedFd) -> std::io::Result<bool> {
    let mut s = connect(t, fd).await?;
    // Once connected, any failure to get a good answer is the backend's.
    let answer = async {
        s.write_all(format!("GET {} HTTP/1.0\r\nHost: {}\r\n\r\n", t.path, t.addr.ip()).as_bytes()).await?;
        let mut head = [0u8; 12];
        s.read_exact(&mut head).await?;
        Ok::<_, std::io::Error>(head)
    };
    let Ok(head) = answer.await else { return Ok(false) };
    let status: u16 = std::str::from_utf8(&head[9..12]).ok().and_then(|x| x.parse().ok()).unwrap_or(0);
    Ok(match t.expect_status {
        Some(want) => status == want,
        None => (200..400).contains(&status),
    })
}

/// UDP has no handshake: an ICMP port unreachable (ECONNREFUSED) by the
/// deadline means down; an answer or silence means up.
async fn udp(t: &Target, fd: OwnedFd, deadline: Instant) -> std::io::Result<bool> {
    let s = std::net::UdpSocket::from(fd);
    let s = tokio::net::UdpSocket::from_std(s)?;
    s.connect(t.addr).await?;
    let exchange = async {
        s.send(b"lbagent-health").await?;
        let mut buf = [0u8; 64];
        s.recv(&mut buf).await.map(|_| ())
    };
    Ok(match tokio::time::timeout_at(deadline, exchange).await {
        Err(_) | Ok(Ok(())) => true,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => false,
        Ok(Err(e)) => return Err(e),
    })
}

/// How the prober is doing: `health_prober` in the status document, and
/// the `lbagent_health_*` metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProberReport {
    /// Whether the prober runs (checks are made).
    pub running: bool,
    /// Why it does not run: its thread could not be created, its event loop
    /// could not be built, or it stopped (retried at the next apply).
    pub error: Option<String>,
    /// Times it could not start or stopped, since the daemon started.
    pub failures: u64,
    /// Probes made (every result, local errors included).
    pub probes: u64,
    /// Checks skipped: due while the backend already had a check waiting
    /// for a slot (that one is late; a check due while the previous probe
    /// runs waits for its end instead).
    pub late: u64,
    /// Probes running now (at most [`MAX_IN_FLIGHT`]).
    pub in_flight: usize,
}

/// What the prober thread and the daemon share.
struct Shared {
    /// The checks to run, with a generation that changes with them.
    checks: Mutex<(u64, Vec<Target>)>,
    /// Notified when `checks` change.
    changed: Notify,
    health: Arc<Mutex<Health>>,
    /// Woken after a backend changes state (the daemon re-applies).
    wake: UnboundedSender<()>,
    report: Mutex<ProberReport>,
    /// Called with the report after every change to it.
    on_report: Box<dyn Fn(&ProberReport) + Send + Sync>,
}

impl Shared {
    fn update(&self, f: impl FnOnce(&mut ProberReport)) {
        let mut r = self.report.lock().unwrap();
        f(&mut r);
        (self.on_report)(&r);
    }
}

/// The daemon's handle on the prober thread: hands it the checks, and
/// starts it (again) when it does not run.
pub struct Prober {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Prober {
    /// A prober (not started) recording into `health`, waking `wake` on
    /// every change of a backend's state, reporting through `on_report`.
    pub fn new(
        health: Arc<Mutex<Health>>,
        wake: UnboundedSender<()>,
        on_report: impl Fn(&ProberReport) + Send + Sync + 'static,
    ) -> Prober {
        let shared = Shared {
            checks: Mutex::new((0, Vec::new())),
            changed: Notify::new(),
            health,
            wake,
            report: Mutex::new(ProberReport::default()),
            on_report: Box::new(on_report),
        };
        Prober { shared: Arc::new(shared), thread: None }
    }

    /// Replaces the checks to run (those removed stop, new ones start now).
    pub fn set_checks(&self, targets: Vec<Target>) {
        let mut c = self.shared.checks.lock().unwrap();
        if c.1 != targets {
            c.0 += 1;
            c.1 = targets;
            self.shared.changed.notify_one();
        }
    }

    /// Starts the prober thread unless it runs. A thread that cannot be
    /// created is logged and reported, never fatal: the next call tries
    /// again.
    pub fn ensure_running(&mut self) {
        if self.thread.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        if let Some(ended) = self.thread.take() {
            // Its end (an error, or a panic) is already in the report.
            let _ = ended.join();
        }
        let shared = self.shared.clone();
        match std::thread::Builder::new().name("lbagent-health".into()).spawn(move || prober_thread(shared)) {
            Ok(t) => self.thread = Some(t),
            Err(e) => {
                error!(
                    "health prober: its thread could not be created ({e}); direct-mode checks wait for the next apply"
                );
                self.shared.update(|r| {
                    r.running = false;
                    r.error = Some(format!("creating the prober thread: {e}"));
                    r.failures += 1;
                    r.in_flight = 0;
                });
            }
        }
    }
}

/// Marks the prober stopped when its thread ends, however it ends.
struct Running(Arc<Shared>);

impl Drop for Running {
    fn drop(&mut self) {
        let panicked = std::thread::panicking();
        if panicked {
            error!("health prober panicked; it is started again at the next apply");
        }
        self.0.update(|r| {
            if panicked {
                r.error = Some("the prober panicked".into());
                r.failures += 1;
            }
            r.running = false;
            r.in_flight = 0;
        });
    }
}

fn prober_thread(shared: Arc<Shared>) {
    let guard = Running(shared.clone());
    let started = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| format!("building the prober's event loop: {e}"))
        .and_then(|rt| {
            let home = File::open("/proc/thread-self/ns/net").map_err(|e| format!("opening its own namespace: {e}"))?;
            Ok((rt, home))
        });
    let (rt, home) = match started {
        Ok(x) => x,
        Err(e) => {
            error!("health prober: {e}; direct-mode checks wait for the next apply");
            shared.update(|r| {
                r.running = false;
                r.error = Some(e);
                r.failures += 1;
            });
            return;
        }
    };
    shared.update(|r| {
        r.running = true;
        r.error = None;
    });
    let end = rt.block_on(Loop::new(shared.clone(), home).run());
    if let Err(e) = end {
        error!("health prober stopped: {e}; it is started again at the next apply");
        shared.update(|r| {
            r.running = false;
            r.error = Some(e);
            r.failures += 1;
            r.in_flight = 0;
        });
    }
    drop(guard);
}

/// Due checks waiting for a probe slot: one queue per load balancer,
/// served in turn; a load balancer holds at most its share of the slots
/// (`MAX_IN_FLIGHT` split evenly between the load balancers with checks,
/// at least one each), so the others' checks always find slots free.
#[derive(Default)]
struct Queues {
    waiting: BTreeMap<String, VecDeque<Target>>,
    running: HashMap<String, usize>,
    /// Checks waiting or running (a backend has one probe at a time).
    busy: HashSet<Key>,
    /// Checks running.
    started: HashSet<Key>,
    /// Checks that came due while their previous probe ran: queued when it
    /// ends (a probe that runs to a timeout as long as the interval ends
    /// just as the next is due, and must not cost that one).
    again: HashMap<Key, Target>,
    /// The load balancer served last.
    last: Option<String>,
}

impl Queues {
    /// Queues a due check (behind the backend's running probe, if any);
    /// false when the backend already has a check waiting (this one is
    /// skipped: that one is late).
    fn push(&mut self, t: Target) -> bool {
        if self.started.contains(&t.key) && !self.again.contains_key(&t.key) {
            self.again.insert(t.key.clone(), t);
            return true;
        }
        if !self.busy.insert(t.key.clone()) {
            return false;
        }
        self.waiting.entry(t.key.0.clone()).or_default().push_back(t);
        true
    }

    fn in_flight(&self) -> usize {
        self.running.values().sum()
    }

    /// The next check to start, when a slot is free for it; `lbs`: load
    /// balancers with checks.
    fn next(&mut self, lbs: usize) -> Option<Target> {
        if self.in_flight() >= MAX_IN_FLIGHT {
            return None;
        }
        let share = (MAX_IN_FLIGHT / lbs.max(1)).max(1);
        // In turn: the load balancers after the one served last, then
        // from the first.
        let after = self.last.clone();
        let order = self
            .waiting
            .keys()
            .filter(|lb| after.as_ref().is_none_or(|a| *lb > a))
            .chain(self.waiting.keys().filter(|lb| after.as_ref().is_some_and(|a| *lb <= a)));
        let lb = order
            .filter(|lb| self.running.get(*lb).copied().unwrap_or(0) < share)
            .find(|lb| !self.waiting[*lb].is_empty())?
            .clone();
        let queue = self.waiting.get_mut(&lb).unwrap();
        let t = queue.pop_front().unwrap();
        if queue.is_empty() {
            self.waiting.remove(&lb);
        }
        *self.running.entry(lb.clone()).or_default() += 1;
        self.started.insert(t.key.clone());
        self.last = Some(lb);
        Some(t)
    }

    /// A started check ended; the backend's next one, if already due, waits
    /// for a slot now.
    fn done(&mut self, key: &Key) {
        self.busy.remove(key);
        self.started.remove(key);
        if let Some(n) = self.running.get_mut(&key.0) {
            *n -= 1;
            if *n == 0 {
                self.running.remove(&key.0);
            }
        }
        if let Some(t) = self.again.remove(key) {
            self.push(t);
        }
    }

    /// Drops waiting checks that are no longer wanted.
    fn retain(&mut self, keep: &HashSet<Key>) {
        self.again.retain(|k, _| keep.contains(k));
        for q in self.waiting.values_mut() {
            q.retain(|t| {
                let k = keep.contains(&t.key);
                if !k {
                    self.busy.remove(&t.key);
                }
                k
            });
        }
        self.waiting.retain(|_, q| !q.is_empty());
    }
}

/// The prober's event loop.
struct Loop {
    shared: Arc<Shared>,
    /// The namespace this thread returns to after making a socket.
    home: File,
    generation: Option<u64>,
    targets: Vec<Target>,
    keys: HashSet<Key>,
    lbs: usize,
    /// When each backend's check is due next.
    next: HashMap<Key, Instant>,
    queues: Queues,
    probes: JoinSet<(Target, Probe)>,
    /// Running probes by task (a probe that panicked is known by its task).
    tasks: HashMap<tokio::task::Id, Key>,
    /// Results not yet recorded (the health table was held by an apply).
    results: Vec<(Target, Probe)>,
}

impl Loop {
    fn new(shared: Arc<Shared>, home: File) -> Loop {
        Loop {
            shared,
            home,
            generation: None,
            targets: Vec::new(),
            keys: HashSet::new(),
            lbs: 0,
            next: HashMap::new(),
            queues: Queues::default(),
            probes: JoinSet::new(),
            tasks: HashMap::new(),
            results: Vec::new(),
        }
    }

    /// Runs until the daemon is gone (`Ok`) or the thread cannot go on.
    async fn run(mut self) -> Result<(), String> {
        loop {
            self.refresh_targets();
            let now = Instant::now();
            let mut late = 0;
            for t in &self.targets {
                let next = self.next.entry(t.key.clone()).or_insert(now);
                if *next > now {
                    continue;
                }
                // The cadence holds (a due time is not pushed back by the
                // loop's own delays) unless the check fell a whole interval
                // behind.
                *next += t.interval.max(Duration::from_millis(1));
                if *next <= now {
                    *next = now + t.interval;
                }
                if !self.queues.push(t.clone()) {
                    late += 1;
                }
            }
            self.start_due()?;
            let due = self.next.values().min().copied().unwrap_or(now + Duration::from_secs(1));
            let wake_at = if self.results.is_empty() { due } else { due.min(now + RECORD_RETRY) };
            tokio::select! {
                Some(done) = self.probes.join_next_with_id(), if !self.probes.is_empty() => self.finished(done),
                _ = tokio::time::sleep_until(wake_at) => {}
                _ = self.shared.changed.notified() => {}
            }
            while let Some(done) = self.probes.try_join_next_with_id() {
                self.finished(done);
            }
            let recorded = self.record();
            let in_flight = self.queues.in_flight();
            self.shared.update(|r| {
                r.probes += recorded;
                r.late += late;
                r.in_flight = in_flight;
            });
            if self.shared.wake.is_closed() {
                return Ok(());
            }
        }
    }

    fn refresh_targets(&mut self) {
        let c = self.shared.checks.lock().unwrap();
        if self.generation == Some(c.0) {
            return;
        }
        self.generation = Some(c.0);
        self.targets = c.1.clone();
        drop(c);
        self.keys = self.targets.iter().map(|t| t.key.clone()).collect();
        self.lbs = self.targets.iter().map(|t| &t.key.0).collect::<HashSet<_>>().len();
        self.next.retain(|k, _| self.keys.contains(k));
        self.queues.retain(&self.keys);
    }

    /// Starts waiting checks while slots are free.
    fn start_due(&mut self) -> Result<(), String> {
        while let Some(t) = self.queues.next(self.lbs) {
            // The deadline counts from here: making the socket, connecting,
            // the request and the answer all fit in it.
            let deadline = Instant::now() + t.timeout;
            match socket_in(&t.netns, &self.home, t.kind) {
                Ok(fd) => {
                    let key = t.key.clone();
                    let task = self.probes.spawn(async move {
                        let p = check(&t, fd, deadline).await;
                        (t, p)
                    });
                    self.tasks.insert(task.id(), key);
                }
                Err(SocketError::Local(e)) => {
                    self.queues.done(&t.key);
                    self.results.push((t, Probe::LocalError(e)));
                }
                Err(SocketError::Stranded(e)) => return Err(e),
            }
        }
        Ok(())
    }

    fn finished(&mut self, done: Result<(tokio::task::Id, (Target, Probe)), tokio::task::JoinError>) {
        let (id, result) = match done {
            Ok((id, (t, p))) => (id, Some((t, p))),
            Err(e) => (e.id(), None),
        };
        let Some(key) = self.tasks.remove(&id) else { return };
        self.queues.done(&key);
        match result {
            Some(r) => self.results.push(r),
            None => warn!("health check of {key:?} panicked; it runs again at its next interval"),
        }
    }

    /// Records results in order (those of checks still wanted); returns how
    /// many. Waits for nothing: while an apply holds the health table, the
    /// results are kept for the next turn.
    fn record(&mut self) -> u64 {
        if self.results.is_empty() {
            return 0;
        }
        let mut health = match self.shared.health.try_lock() {
            Ok(h) => h,
            Err(std::sync::TryLockError::WouldBlock) => return 0,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        };
        let mut changed = false;
        let n = self.results.len() as u64;
        for (t, probe) in self.results.drain(..) {
            if !self.keys.contains(&t.key) {
                continue;
            }
            let (lb, l, b) = &t.key;
            let ok = match probe {
                Probe::Up => true,
                Probe::Down => false,
                Probe::LocalError(e) => {
                    warn!(object = %naming::lb_zone_key(lb), "listener {l} backend {b}: check could not run ({e}); state kept");
                    continue;
                }
            };
            if health.observe(&t.key, ok, t.rise, t.fall) {
                info!(object = %naming::lb_zone_key(lb), "listener {l} backend {b} ({}) is {}", t.addr, if ok { "up" } else { "down" });
                changed = true;
            }
        }
        drop(health);
        if changed {
            let _ = self.shared.wake.send(());
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rise_and_fall() {
        let mut h = BackendHealth::default();
        assert!(h.up);
        assert!(!h.observe(false, 2, 3));
        assert!(!h.observe(false, 2, 3));
        assert!(!h.observe(true, 2, 3), "a success resets the failure streak");
        assert!(!h.observe(false, 2, 3));
        assert!(!h.observe(false, 2, 3));
        assert!(h.observe(false, 2, 3), "third failure in a row: down");
        assert!(!h.up);
        assert!(!h.observe(true, 2, 3));
        assert!(h.observe(true, 2, 3), "second success: up");
        assert!(h.up);
    }

    fn target(kind: HealthCheckType, lb: &str, backend: u32, addr: SocketAddr) -> Target {
        Target {
            key: (lb.into(), "l".into(), format!("b{backend}")),
            netns: naming::lb_netns(lb),
            kind,
            addr,
            interval: Duration::from_secs(1),
            timeout: Duration::from_millis(400),
            rise: 1,
            fall: 1,
            path: "/".into(),
            expect_status: None,
        }
    }

    #[test]
    fn queues_serve_load_balancers_in_turn_within_their_share() {
        let addr: SocketAddr = "10.0.0.1:80".parse().unwrap();
        let mut q = Queues::default();
        for i in 0..200 {
            assert!(q.push(target(HealthCheckType::Tcp, "a", i, addr)));
        }
        assert!(q.push(target(HealthCheckType::Tcp, "b", 0, addr)));
        let order: Vec<String> = (0..3).map(|_| q.next(2).unwrap().key.0).collect();
        assert_eq!(order, ["a", "b", "a"], "in turn, whatever the queue lengths");
        // Two load balancers: A holds at most half of the slots…
        let mut a = 2;
        while q.next(2).is_some() {
            a += 1;
        }
        assert_eq!(a, MAX_IN_FLIGHT / 2, "A's share");
        // … and B's next check finds one free at once.
        assert!(q.push(target(HealthCheckType::Tcp, "b", 1, addr)));
        assert_eq!(q.next(2).unwrap().key, ("b".into(), "l".into(), "b1".into()));
        // One probe per backend at a time: due again while it runs, it
        // waits for that one's end; due once more meanwhile, skipped.
        let a0: Key = ("a".into(), "l".into(), "b0".into());
        assert!(q.push(target(HealthCheckType::Tcp, "a", 0, addr)));
        assert!(!q.push(target(HealthCheckType::Tcp, "a", 0, addr)));
        assert!(!q.waiting["a"].iter().any(|t| t.key == a0), "not queued beside its running probe");
        q.done(&a0);
        assert!(q.waiting["a"].iter().any(|t| t.key == a0), "queued once the running probe ended");
        // Due while it waits for a slot: skipped.
        assert!(!q.push(target(HealthCheckType::Tcp, "a", 0, addr)));
        // Checks no longer wanted leave the queue.
        q.retain(&HashSet::new());
        assert!(q.waiting.is_empty());

        // More load balancers than slots: one each, never more in all.
        let mut q = Queues::default();
        for lb in 0..300 {
            for i in 0..2 {
                q.push(target(HealthCheckType::Tcp, &format!("lb{lb:03}"), i, addr));
            }
        }
        let mut started = HashMap::<String, usize>::new();
        while let Some(t) = q.next(300) {
            *started.entry(t.key.0).or_default() += 1;
        }
        assert_eq!(started.values().sum::<usize>(), MAX_IN_FLIGHT);
        assert!(started.values().all(|n| *n == 1), "{started:?}");
    }

    /// A listener whose accept queue is full: the kernel drops further SYNs
    /// (no RST), as a black-holing backend does.
    fn black_hole() -> (std::net::TcpListener, Vec<std::net::TcpStream>) {
        use nix::sys::socket::{Backlog, SockaddrIn, bind, getsockname, listen};
        use std::os::fd::AsRawFd;
        let fd = nix::sys::socket::socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
        bind(fd.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, 0)).unwrap();
        listen(&fd, Backlog::new(0).unwrap()).unwrap();
        let at: SockaddrIn = getsockname(fd.as_raw_fd()).unwrap();
        let at = SocketAddr::from((at.ip(), at.port()));
        let fillers =
            (0..2).filter_map(|_| std::net::TcpStream::connect_timeout(&at, Duration::from_millis(200)).ok()).collect();
        (std::net::TcpListener::from(fd), fillers)
    }

    /// A server on loopback that reads a request, then sends `reply` a byte
    /// every `pace` (`None`: never answers).
    fn server(reply: Option<(&'static [u8], Duration)>) -> SocketAddr {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                std::thread::spawn(move || {
                    let _ = s.read(&mut [0u8; 1024]);
                    match reply {
                        Some((bytes, pace)) => {
                            for b in bytes {
                                std::thread::sleep(pace);
                                if s.write_all(std::slice::from_ref(b)).is_err() {
                                    return;
                                }
                            }
                        }
                        None => std::thread::sleep(Duration::from_secs(5)),
                    }
                });
            }
        });
        at
    }

    /// Runs `t`'s check on a socket of this namespace; its result and how
    /// long it took.
    async fn timed(t: &Target) -> (Probe, Duration) {
        let started = Instant::now();
        let p = check(t, socket(t.kind).unwrap(), started + t.timeout).await;
        (p, started.elapsed())
    }

    #[tokio::test(flavor = "current_thread")]
    async fn every_probe_ends_by_its_deadline() {
        let timeout = Duration::from_millis(400);
        let within = |d: Duration| d >= timeout - Duration::from_millis(50) && d < timeout + Duration::from_millis(300);
        // SYNs dropped: the connect ends at the deadline, as down.
        let (hole, _fillers) = black_hole();
        for kind in [HealthCheckType::Tcp, HealthCheckType::Http] {
            let (p, took) = timed(&target(kind, "a", 0, hole.local_addr().unwrap())).await;
            assert_eq!(p, Probe::Down, "{kind:?}");
            assert!(within(took), "{kind:?} against a black hole took {took:?}");
        }
        // HTTP accepted, never answered; or answered a byte every 100 ms (a
        // good answer, each byte in time, the whole long after the deadline).
        let answer: &[u8] = b"HTTP/1.0 200 OK\r\n\r\n";
        for (what, at) in [("mute", server(None)), ("drip", server(Some((answer, Duration::from_millis(100)))))] {
            let (p, took) = timed(&target(HealthCheckType::Http, "a", 0, at)).await;
            assert_eq!(p, Probe::Down, "{what}");
            assert!(within(took), "{what} took {took:?}");
        }
        // A prompt answer: up at once; a wrong status: down.
        let (p, took) = timed(&target(HealthCheckType::Http, "a", 0, server(Some((answer, Duration::ZERO))))).await;
        assert!(p == Probe::Up && took < timeout, "{p:?} after {took:?}");
        let mut t = target(HealthCheckType::Http, "a", 0, server(Some((answer, Duration::ZERO))));
        t.expect_status = Some(204);
        assert_eq!(timed(&t).await.0, Probe::Down);
        // A closed TCP port: down at once.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let (p, took) = timed(&target(HealthCheckType::Tcp, "a", 0, closed)).await;
        assert!(p == Probe::Down && took < timeout, "{p:?} after {took:?}");
        // UDP: a closed port (ICMP port unreachable) is down at once; a
        // silent one is up at the deadline.
        let closed = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let (p, took) = timed(&target(HealthCheckType::Udp, "a", 0, closed)).await;
        assert!(p == Probe::Down && took < timeout, "{p:?} after {took:?}");
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let (p, took) = timed(&target(HealthCheckType::Udp, "a", 0, silent.local_addr().unwrap())).await;
        assert!(p == Probe::Up && within(took), "{p:?} after {took:?}");
    }
}
