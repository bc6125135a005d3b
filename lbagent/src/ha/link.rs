//! The sync link's thread: hellos both ways every [`HELLO_EVERY`], new
//! flows sent as the ring delivers them, changes every [`DELTA_EVERY`],
//! bulk passes, the peer's datagrams written into the conntrack tables,
//! and the handover of a planned switchover.
//!
//! Nothing here waits on the datapath: the flow logger's thread hands
//! start records over without waiting (a full channel is counted), a
//! datagram the socket does not take is counted, and the next bulk pass
//! repairs both.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    net::UdpSocket,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc::Receiver,
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use lbagent_common::*;
use tracing::{info, warn};

use super::{
    Shared, SyncNames, announcing, unix_ms,
    wire::{self, Body, FlowRec, Hello, Replay},
};
use crate::{
    dataplane::tables::{FlowPut, FlowWriter, Tables, monotonic_ns},
    state::ha::HaSpec,
};

/// Batches of start records the feed holds before it drops (the ring's
/// reader hands over what each wake-up read, often a few records: a link
/// busy for a second at 10 000 new flows/s needs thousands).
pub const FEED_BATCHES: usize = 16_384;
pub const HELLO_EVERY: Duration = Duration::from_millis(100);
pub const DELTA_EVERY: Duration = Duration::from_secs(1);
/// A flow is sent in a delta when a packet of either half is this recent
/// (the programs stamp `last_seen_ns` at most once a second) and its
/// refresh is due: each flow's turn comes every [`REFRESH_SLOTS`] deltas
/// (by a hash of its key), so a delta carries a tenth of the busy flows.
const DELTA_RECENT_NS: u64 = 2_500_000_000;
const REFRESH_SLOTS: u64 = 10;
/// The longest a switchover waits for the peer to say it is active.
pub const HANDOVER_WAIT: Duration = Duration::from_secs(2);
/// A switchover's ask is sent again this often until the peer answers.
const TAKEOVER_EVERY: Duration = Duration::from_millis(50);
/// Kept samples of the sync lag.
const LAG_SAMPLES: usize = 4096;
/// The flags a record carries (the rest are this host's).
const SYNCED_FLAGS: u8 = CT_F_SNAT | CT_F_DNAT;
/// Datagrams read per round of the loop, and the longest a round reads:
/// a flood (junk from anywhere, a bulk pass) never starves the rest.
const READ_PER_ROUND: usize = 512;
const READ_ROUND: Duration = Duration::from_millis(20);
/// Bulk datagrams sent per round of the loop.
const BULK_PER_ROUND: usize = 64;
/// The peer unheard this long: this host may have missed flows, so it is
/// not ready until the next complete bulk pass.
const PEER_SILENT: Duration = Duration::from_secs(2);

pub(super) struct Link {
    spec: HaSpec,
    shared: Arc<Shared>,
    bpffs: PathBuf,
    feed: Arc<Mutex<Receiver<Vec<FlowEvent>>>>,
    feed_lost: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

/// A bulk pass being received: the sender's session, its id, when it
/// began here, the flows seen, the records counted.
struct PassIn {
    session: u64,
    id: u32,
    began: u64,
    seen: HashSet<Tuple>,
    got: u32,
}

/// The link's state for one socket's life.
struct Run {
    sock: UdpSocket,
    key: wire::Key,
    session: u64,
    seq: u64,
    replay: Replay,
    tables: Tables,
    writer: FlowWriter,
    names: Arc<SyncNames>,
    /// The peer's last trusted hello (one that echoed this run's session).
    peer: Option<(Instant, Hello)>,
    /// The peer asked for a bulk pass.
    peer_wants_bulk: bool,
    pass_out: u32,
    /// The bulk pass being sent: its datagrams, then its end.
    outgoing: VecDeque<Body>,
    last_bulk: Instant,
    last_delta: Instant,
    deltas: u64,
    last_hello: Instant,
    pass_in: Option<PassIn>,
    ready: bool,
    /// Datagrams of new flows waiting for their ack: seq → the oldest
    /// start record's time.
    unacked: HashMap<u64, u64>,
    lags_us: VecDeque<u64>,
    handover: Option<Handover>,
    refused_logged: Option<Instant>,
}

/// A switchover under way on this host.
struct Handover {
    began: Instant,
    /// The changes went out, and the priority was lowered.
    asked: Option<Instant>,
}

impl Link {
    pub(super) fn new(
        spec: HaSpec,
        shared: Arc<Shared>,
        bpffs: PathBuf,
        feed: Arc<Mutex<Receiver<Vec<FlowEvent>>>>,
        feed_lost: Arc<AtomicU64>,
        stop: Arc<AtomicBool>,
    ) -> Link {
        Link { spec, shared, bpffs, feed, feed_lost, stop }
    }

    pub(super) fn run(&mut self) {
        {
            let mut st = self.shared.status.lock().unwrap();
            st.listen = self.spec.listen.to_string();
            st.peer.address = self.spec.peer.to_string();
        }
        while !self.stop.load(Ordering::SeqCst) {
            if let Err(e) = self.run_until_stopped() {
                let why = format!("{e:#}");
                warn!("ha: sync link: {why}; retrying in 1 s");
                self.shared.status.lock().unwrap().problem = Some(why);
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }

    fn run_until_stopped(&mut self) -> Result<()> {
        let sock = UdpSocket::bind(self.spec.listen).with_context(|| format!("binding {}", self.spec.listen))?;
        sock.set_read_timeout(Some(Duration::from_millis(5)))?;
        set_buffers(&sock);
        let tables = Tables::open(&self.bpffs)?;
        let writer = tables.flow_writer()?;
        let long_ago = Instant::now() - Duration::from_secs(3600);
        let mut r = Run {
            sock,
            key: wire::Key::new(&self.spec.secret),
            session: self.shared.next_session(),
            seq: 0,
            replay: Replay::default(),
            tables,
            writer,
            names: self.shared.names.lock().unwrap().clone(),
            peer: None,
            peer_wants_bulk: false,
            pass_out: 0,
            outgoing: VecDeque::new(),
            last_bulk: Instant::now(),
            last_delta: long_ago,
            deltas: 0,
            last_hello: long_ago,
            pass_in: None,
            ready: false,
            unacked: HashMap::new(),
            lags_us: VecDeque::new(),
            handover: None,
            refused_logged: None,
        };
        self.shared.status.lock().unwrap().problem = None;
        let mut reported = long_ago;
        let mut buf = vec![0u8; wire::MAX_DATAGRAM + 1];
        while !self.stop.load(Ordering::SeqCst) {
            r.names = self.shared.names.lock().unwrap().clone();
            // The peer's datagrams, a bounded round of them.
            let round = Instant::now();
            for _ in 0..READ_PER_ROUND {
                match r.sock.recv_from(&mut buf) {
                    Ok((n, from)) => {
                        if from != self.spec.peer || n > wire::MAX_DATAGRAM {
                            self.refused(&mut r, "not from the peer's address, or too long");
                        } else {
                            self.take(&mut r, &buf[..n]);
                        }
                    }
                    Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                        break;
                    }
                    Err(e) => return Err(e).context("receiving"),
                }
                if round.elapsed() >= READ_ROUND {
                    break;
                }
            }
            // New flows of this host's programs, whatever the role (both
            // hosts are active for a switchover's moment).
            let batches: Vec<Vec<FlowEvent>> = {
                let feed = self.feed.lock().unwrap();
                std::iter::from_fn(|| feed.try_recv().ok()).take(FEED_BATCHES).collect()
            };
            for batch in batches {
                let now = monotonic_ns();
                let oldest = batch.iter().map(|e| e.time_ns).min().unwrap_or(now);
                let flows: Vec<FlowRec> = batch.iter().filter_map(|e| record_of_event(e, &r.names, now)).collect();
                for body in wire::pack(wire::NEW_FLOWS, flows) {
                    if let Some(seq) = self.send(&mut r, &body) {
                        r.unacked.insert(seq, oldest);
                    }
                }
            }
            let active = announcing();
            if r.last_hello.elapsed() >= HELLO_EVERY {
                self.hello(&mut r, active);
            }
            if r.peer.is_some_and(|(at, _)| at.elapsed() > PEER_SILENT) && r.ready {
                warn!("ha: the peer is silent: not ready until its next bulk pass");
                r.ready = false;
            }
            if active {
                let bulk_due = r.last_bulk.elapsed() >= self.spec.bulk_every;
                if r.outgoing.is_empty() && (r.peer_wants_bulk || bulk_due) {
                    r.peer_wants_bulk = false;
                    r.last_bulk = Instant::now();
                    self.bulk(&mut r)?;
                } else if r.last_delta.elapsed() >= DELTA_EVERY {
                    r.last_delta = Instant::now();
                    r.deltas += 1;
                    let slot = r.deltas % REFRESH_SLOTS;
                    self.changes(&mut r, Some(slot))?;
                }
            } else {
                r.outgoing.clear();
            }
            for _ in 0..BULK_PER_ROUND {
                let Some(body) = r.outgoing.pop_front() else { break };
                self.send(&mut r, &body);
            }
            self.handover(&mut r, active);
            if reported.elapsed() >= Duration::from_millis(500) {
                reported = Instant::now();
                self.report(&mut r);
            }
        }
        Ok(())
    }

    /// Counts a refused datagram; logs one every 10 s at most.
    fn refused(&self, r: &mut Run, why: &str) {
        self.shared.status.lock().unwrap().dropped.refused += 1;
        if r.refused_logged.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
            r.refused_logged = Some(Instant::now());
            warn!("ha: refused a datagram: {why} (counted in dropped.refused; logged every 10 s at most)");
        }
    }

    /// Signs and sends one datagram; its seq when the socket took it.
    fn send(&self, r: &mut Run, body: &Body) -> Option<u64> {
        r.seq += 1;
        let echo = r.replay.peer_session;
        let d = wire::encode(&r.key, r.session, r.seq, echo, body);
        let mut sent = r.sock.send_to(&d, self.spec.peer);
        if sent.as_ref().is_err_and(|e| e.raw_os_error() == Some(libc::ENOBUFS)) {
            // The socket's buffer is full: a moment for it.
            std::thread::sleep(Duration::from_millis(1));
            sent = r.sock.send_to(&d, self.spec.peer);
        }
        match sent {
            Ok(_) => {
                if let Body::Flows { flows, .. } = body {
                    self.shared.status.lock().unwrap().synced_out += flows.len() as u64;
                }
                Some(r.seq)
            }
            Err(_) => {
                self.shared.status.lock().unwrap().dropped.send_failed += 1;
                None
            }
        }
    }

    fn hello(&self, r: &mut Run, active: bool) {
        r.last_hello = Instant::now();
        let want_bulk = !r.ready || self.shared.want_bulk.load(Ordering::SeqCst);
        let h = Hello {
            active,
            ready: r.ready,
            want_bulk: want_bulk && !active,
            term: self.shared.term.load(Ordering::SeqCst),
        };
        self.send(r, &Body::Hello(h));
    }

    /// One datagram from the peer's address.
    fn take(&self, r: &mut Run, d: &[u8]) {
        let before = r.replay.peer_session;
        let taken = wire::decode(&r.key, d)
            .map_err(|e| format!("{e:#}"))
            .and_then(|(h, b)| r.replay.admit(&h, r.session).map(|()| (h, b)).map_err(str::to_string));
        let (h, body) = match taken {
            Ok(x) => x,
            Err(why) => return self.refused(r, &why),
        };
        if r.replay.peer_session != before {
            // The peer restarted its link: what it was sending is over.
            r.pass_in = None;
            r.peer = None;
            r.ready = false;
        }
        match body {
            Body::Hello(hello) => {
                // Only a hello addressed to this run is believed: one
                // recorded before it started says nothing of the peer now.
                if h.echo != r.session {
                    return;
                }
                let fresh = r.peer.is_none();
                // The peer stepped down while this host announces (a
                // switchover's end): announce again, so the bridges
                // forget the peer's last packets.
                if r.peer.is_some_and(|(_, p)| p.active) && !hello.active && announcing() {
                    self.shared.reannounce();
                }
                r.peer = Some((Instant::now(), hello));
                self.shared.peer_term(hello.term);
                if fresh {
                    info!("ha: heard the peer ({})", if hello.active { "active" } else { "standby" });
                }
                if hello.want_bulk {
                    r.peer_wants_bulk = true;
                }
                // Both active: the one promoted last (the higher term)
                // keeps the role; never while this host hands it over.
                if hello.active && announcing() && r.handover.is_none() {
                    let mine = self.shared.term.load(Ordering::SeqCst);
                    if (hello.term, h.session) > (mine, r.session) {
                        warn!(
                            "ha: the peer is active too, promoted later (term {} > {mine}); stepping down",
                            hello.term
                        );
                        if let Err(e) = self.shared.demote("the peer was promoted later") {
                            warn!("ha: stepping down: {e:#}");
                        }
                        r.ready = false;
                    }
                }
            }
            Body::Flows { pass, flows } => {
                self.write(r, h.session, pass, &flows);
                if pass == wire::NEW_FLOWS {
                    self.send(r, &Body::Ack { seq: h.seq });
                }
            }
            Body::PassEnd { pass, records } => self.pass_end(r, h.session, pass, records),
            Body::Ack { seq } => {
                if let Some(t) = r.unacked.remove(&seq) {
                    let lag = monotonic_ns().saturating_sub(t) / 1000;
                    if r.lags_us.len() == LAG_SAMPLES {
                        r.lags_us.pop_front();
                    }
                    r.lags_us.push_back(lag);
                }
            }
            Body::Takeover => {
                let outcome = if announcing() {
                    Ok("already active".to_string())
                } else if !r.ready {
                    Err(anyhow::anyhow!("not ready: no complete bulk pass yet"))
                } else {
                    self.shared.promote("a switchover from the peer")
                };
                match outcome {
                    Ok(_) => self.hello(r, announcing()),
                    Err(e) => {
                        if r.refused_logged.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                            r.refused_logged = Some(Instant::now());
                            warn!("ha: refused a switchover: {e:#}");
                        }
                    }
                }
            }
        }
    }

    /// Writes the peer's flows.
    fn write(&self, r: &mut Run, session: u64, pass: u32, flows: &[FlowRec]) {
        let now = monotonic_ns();
        let bulk = pass != wire::NEW_FLOWS && pass != wire::CHANGES;
        if bulk && r.pass_in.as_ref().is_none_or(|p| (p.session, p.id) != (session, pass)) {
            r.pass_in = Some(PassIn { session, id: pass, began: now, seen: HashSet::new(), got: 0 });
        }
        let (mut written, mut unknown, mut full) = (0, 0, 0);
        for f in flows {
            if bulk && let Some(p) = r.pass_in.as_mut() {
                p.got += 1;
            }
            let Some((key, e)) = flow_of_record(f, &r.names, now) else {
                unknown += 1;
                continue;
            };
            if bulk && let Some(p) = r.pass_in.as_mut() {
                p.seen.insert(key);
            }
            match r.writer.put_flow(&key, &e, f.established) {
                FlowPut::Full => full += 1,
                _ => written += 1,
            }
        }
        let mut st = self.shared.status.lock().unwrap();
        st.synced_in += written;
        st.dropped.unknown += unknown;
        st.dropped.table_full += full;
    }

    /// A bulk pass ended: complete, it makes this host ready and (while
    /// standby) removes the flows the peer no longer has.
    fn pass_end(&self, r: &mut Run, session: u64, pass: u32, records: u32) {
        let p = match r.pass_in.take() {
            Some(p) if (p.session, p.id) == (session, pass) => p,
            // A pass of no record (the peer has no flow) sent nothing before.
            _ if records == 0 => PassIn { session, id: pass, began: monotonic_ns(), seen: HashSet::new(), got: 0 },
            _ => {
                warn!("ha: bulk pass {pass} ended without its records; asking for another");
                r.ready = false;
                self.shared.want_bulk.store(true, Ordering::SeqCst);
                return;
            }
        };
        if p.got != records {
            warn!("ha: bulk pass {pass} incomplete ({} of {records} records); asking for another", p.got);
            r.ready = false;
            self.shared.want_bulk.store(true, Ordering::SeqCst);
            return;
        }
        let mut swept = 0;
        if !announcing() {
            swept = sweep(&r.tables, &mut r.writer, &p.seen, p.began).unwrap_or_else(|e| {
                warn!("ha: removing the flows the peer no longer has: {e:#}");
                0
            });
        }
        r.ready = true;
        self.shared.want_bulk.store(false, Ordering::SeqCst);
        let mut st = self.shared.status.lock().unwrap();
        st.bulk_passes_received += 1;
        st.last_bulk_received = Some(unix_ms() / 1000);
        st.swept = swept;
    }

    /// Queues every flow as bulk pass `pass_out + 1`, then its end; sent
    /// [`BULK_PER_ROUND`] datagrams a round.
    fn bulk(&self, r: &mut Run) -> Result<()> {
        r.pass_out = r.pass_out.wrapping_add(1).clamp(1, wire::CHANGES - 1);
        let flows = self.scan(r, None)?;
        let n = flows.len() as u32;
        r.outgoing.extend(wire::pack(r.pass_out, flows));
        r.outgoing.push_back(Body::PassEnd { pass: r.pass_out, records: n });
        self.shared.status.lock().unwrap().bulk_passes_sent += 1;
        Ok(())
    }

    /// Sends the flows with a recent packet whose refresh is due (`slot`;
    /// `None`: every recent flow).
    fn changes(&self, r: &mut Run, slot: Option<u64>) -> Result<()> {
        let flows = self.scan(r, Some(slot))?;
        for body in wire::pack(wire::CHANGES, flows) {
            self.send(r, &body);
        }
        Ok(())
    }

    /// The records of every flow (`recent` `None`), or of those with a
    /// packet of either half in the last [`DELTA_RECENT_NS`] (and in
    /// refresh slot `s` when `Some(Some(s))`). `ct_new` is read before
    /// `ct`: a flow promoted meanwhile is then read in `ct` (the program
    /// inserts it there before it deletes it from `ct_new`).
    fn scan(&self, r: &mut Run, recent: Option<Option<u64>>) -> Result<Vec<FlowRec>> {
        let now = monotonic_ns();
        let fresh = |e: &CtEntry| now.saturating_sub(e.last_seen_ns) <= DELTA_RECENT_NS;
        let due = |k: &Tuple| match recent {
            Some(Some(slot)) => slot_of(k) == slot,
            _ => true,
        };
        // Original halves by key; the reply halves' last packet, by their
        // flow's original key.
        let mut origs: HashMap<Tuple, (CtEntry, bool)> = HashMap::new();
        let mut replies: HashMap<Tuple, u64> = HashMap::new();
        for table in [MAP_CT_NEW, MAP_CT] {
            let established = table.name == MAP_CT.name;
            r.tables.each_conntrack(table, |keys, entries| {
                for (k, e) in keys.iter().zip(entries) {
                    if e.flags & CT_F_LOCAL != 0 {
                        continue;
                    }
                    if e.flags & CT_F_REPLY != 0 {
                        let orig = e.xlate.reversed();
                        if (recent.is_none() || fresh(e)) && due(&orig) {
                            let t = replies.entry(orig).or_default();
                            *t = (*t).max(e.last_seen_ns);
                        }
                    } else if (recent.is_none() || fresh(e)) && due(k) {
                        origs.insert(*k, (*e, established));
                    }
                }
            })?;
        }
        // Flows busy only in the reply direction: their original half.
        if recent.is_some() {
            let missing: Vec<Tuple> = replies.keys().filter(|k| !origs.contains_key(k)).copied().collect();
            for k in missing {
                if let Some((established, e)) = r.writer.get(&k) {
                    origs.insert(k, (e, established));
                }
            }
        }
        let mut out = Vec::with_capacity(origs.len());
        for (k, (mut e, established)) in origs {
            if let Some(t) = replies.get(&k) {
                e.last_seen_ns = e.last_seen_ns.max(*t);
            }
            if let Some(f) = record_of_entry(&k, &e, established, &r.names, now) {
                out.push(f);
            }
        }
        Ok(out)
    }

    /// A switchover asked on this host: once the peer is heard and ready,
    /// the changes so far go out with the ask (and keepalived's priority is
    /// lowered, so its master moves too); the ask is repeated until the
    /// peer says it is active, and this host steps down then.
    fn handover(&self, r: &mut Run, active: bool) {
        if !self.shared.handover_requested() {
            r.handover = None;
            return;
        }
        let h = r.handover.get_or_insert_with(|| Handover { began: Instant::now(), asked: None });
        let (began, asked) = (h.began, h.asked);
        let peer = r.peer.filter(|(at, _)| at.elapsed() < Duration::from_secs(1)).map(|(_, h)| h);
        let outcome = match peer {
            // Stepped down meanwhile (keepalived followed the priority).
            Some(p) if !active && p.active => Some(Ok("the peer is active; this host stepped down".to_string())),
            _ if !active && began.elapsed() > HANDOVER_WAIT => {
                Some(Err("this host stepped down, and the peer is not active".to_string()))
            }
            _ if !active => None,
            None => Some(Err("the peer is not heard on the sync link".to_string())),
            Some(p) if !p.ready && !p.active => Some(Err("the peer is not ready (no complete bulk pass yet)".into())),
            Some(p) if p.active => {
                // The peer announces now: step down, and say so at once
                // (the peer announces again when it hears it).
                let done = self.shared.demote("switchover").map_err(|e| format!("{e:#}"));
                self.hello(r, false);
                Some(done.map(|m| format!("peer active; {m}")))
            }
            Some(_) if began.elapsed() > HANDOVER_WAIT => {
                Some(Err(format!("the peer did not take over within {} s", HANDOVER_WAIT.as_secs())))
            }
            Some(_) => {
                if asked.is_none() {
                    // What changed since the last delta, once.
                    if let Err(e) = self.changes(r, None) {
                        warn!("ha: switchover: sending changes: {e:#}");
                    }
                    self.shared.set_priority(super::PRIORITY_HANDOVER);
                }
                if asked.is_none_or(|t| t.elapsed() >= TAKEOVER_EVERY) {
                    self.send(r, &Body::Takeover);
                    if let Some(h) = r.handover.as_mut() {
                        h.asked = Some(Instant::now());
                    }
                }
                None
            }
        };
        if let Some(o) = outcome {
            if o.is_ok() {
                r.ready = false;
            }
            r.handover = None;
            self.shared.handover_done(o);
        }
    }

    fn report(&self, r: &mut Run) {
        let lost = self.feed_lost.load(Ordering::Relaxed);
        let cutoff = monotonic_ns().saturating_sub(5_000_000_000);
        r.unacked.retain(|_, t| *t > cutoff);
        let mut lags: Vec<u64> = r.lags_us.iter().copied().collect();
        lags.sort_unstable();
        let q = |p: f64| (!lags.is_empty()).then(|| lags[((lags.len() - 1) as f64 * p) as usize] as f64 / 1000.0);
        let ring_full = r.tables.counter(Counter::FlowLogRingFull).unwrap_or(0);
        let mut st = self.shared.status.lock().unwrap();
        st.ready = r.ready;
        st.dropped.feed_full = lost;
        st.dropped.ring_full = ring_full;
        st.lag_ms_p50 = q(0.5);
        st.lag_ms_p99 = q(0.99);
        st.peer.last_heard_ms = r.peer.map(|(at, _)| at.elapsed().as_millis() as u64);
        st.peer.active = r.peer.is_some_and(|(_, h)| h.active);
        st.peer.ready = r.peer.is_some_and(|(_, h)| h.ready);
        drop(st);
        self.shared.publish();
    }
}

/// A flow's refresh slot, from its original key.
fn slot_of(k: &Tuple) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(k, &mut h);
    std::hash::Hasher::finish(&h) % REFRESH_SLOTS
}

/// 4 MiB socket buffers both ways (past `rmem_max`/`wmem_max`: the agent
/// runs as root); a buffer it could not set is logged.
fn set_buffers(sock: &UdpSocket) {
    use std::os::fd::AsRawFd;
    let size: libc::c_int = 4 << 20;
    for (forced, plain, what) in
        [(libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, "send"), (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, "receive")]
    {
        let set = |opt| {
            // SAFETY: a valid socket and an int option of the right size.
            unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&raw const size).cast(),
                    size_of::<libc::c_int>() as libc::socklen_t,
                )
            }
        };
        if set(forced) != 0 && set(plain) != 0 {
            warn!("ha: could not set the sync link's {what} buffer to {size} bytes");
        }
    }
}

fn key_of(names: &SyncNames, id: u32) -> Option<String> {
    if id == 0 { Some(String::new()) } else { names.rule_key.get(&id).map(|k| k.to_string()) }
}

/// Fits a record (every key at most 255 bytes).
fn fits(f: FlowRec) -> Option<FlowRec> {
    [&f.zone, &f.dnat_rule, &f.snat_rule].iter().all(|s| s.len() <= 255).then_some(f)
}

/// The record of a new flow's start record (state new, in `ct_new`).
fn record_of_event(e: &FlowEvent, names: &SyncNames, now: u64) -> Option<FlowRec> {
    let since = (now.saturating_sub(e.time_ns) / 1_000_000) as u32;
    fits(FlowRec {
        family: e.family,
        proto: e.proto,
        state: CT_NEW,
        flags: e.flags & SYNCED_FLAGS,
        established: false,
        orig_saddr: e.orig_saddr,
        orig_daddr: e.orig_daddr,
        orig_sport: e.orig_sport,
        orig_dport: e.orig_dport,
        xlate_saddr: e.xlate_saddr,
        xlate_daddr: e.xlate_daddr,
        xlate_sport: e.xlate_sport,
        xlate_dport: e.xlate_dport,
        idle_ms: since,
        age_ms: since,
        zone: names.zone_key.get(&e.zone)?.to_string(),
        dnat_rule: key_of(names, e.dnat_rule)?,
        snat_rule: key_of(names, e.snat_rule)?,
    })
}

/// The record of a flow from its original half.
fn record_of_entry(k: &Tuple, e: &CtEntry, established: bool, names: &SyncNames, now: u64) -> Option<FlowRec> {
    let x = &e.xlate;
    fits(FlowRec {
        family: 4,
        proto: k.proto,
        state: e.state,
        flags: e.flags & SYNCED_FLAGS,
        established,
        orig_saddr: v4_mapped(k.saddr),
        orig_daddr: v4_mapped(k.daddr),
        orig_sport: k.sport,
        orig_dport: k.dport,
        xlate_saddr: v4_mapped(x.saddr),
        xlate_daddr: v4_mapped(x.daddr),
        xlate_sport: x.sport,
        xlate_dport: x.dport,
        idle_ms: (now.saturating_sub(e.last_seen_ns) / 1_000_000).min(u32::MAX as u64) as u32,
        age_ms: ct_ms_since(ct_clock_ms(now), e.created_ms),
        zone: names.zone_key.get(&k.zone)?.to_string(),
        dnat_rule: key_of(names, e.dnat_rule)?,
        snat_rule: key_of(names, e.snat_rule)?,
    })
}

/// A record as this host's original half: its zone and rules by this
/// host's ids, its times on this host's clock; `None` when this host has
/// no such zone or rule, or the record is not IPv4.
fn flow_of_record(f: &FlowRec, names: &SyncNames, now: u64) -> Option<(Tuple, CtEntry)> {
    if f.family != 4 || f.state > CT_CLOSING {
        return None;
    }
    let zone = *names.zone_id.get(f.zone.as_str())?;
    let rule = |k: &str| if k.is_empty() { Some(0) } else { names.rule_id.get(k).copied() };
    let tuple = |saddr: &[u8; 16], daddr: &[u8; 16], sport, dport| Tuple {
        saddr: v4_of(saddr),
        daddr: v4_of(daddr),
        sport,
        dport,
        proto: f.proto,
        _pad0: 0,
        zone,
    };
    let key = tuple(&f.orig_saddr, &f.orig_daddr, f.orig_sport, f.orig_dport);
    let xlate = tuple(&f.xlate_saddr, &f.xlate_daddr, f.xlate_sport, f.xlate_dport);
    let e = CtEntry {
        xlate,
        last_seen_ns: now.saturating_sub(u64::from(f.idle_ms) * 1_000_000),
        created_ms: ct_clock_ms(now.saturating_sub(u64::from(f.age_ms) * 1_000_000)),
        dnat_rule: rule(&f.dnat_rule)?,
        snat_rule: rule(&f.snat_rule)?,
        seq_end: 0,
        max_win: 0,
        flags: f.flags & SYNCED_FLAGS,
        state: f.state,
        wscale: CT_WSCALE_NONE,
        _pad0: 0,
    };
    Some((key, e))
}

/// After a complete bulk pass that began at `began`: removes the flows
/// not in it (`seen`) that had no packet since before it began (a flow
/// opened meanwhile is newer than the pass). How many it removed.
fn sweep(t: &Tables, w: &mut FlowWriter, seen: &HashSet<Tuple>, began: u64) -> Result<u64> {
    let before = began.saturating_sub(1_000_000_000);
    let mut gone = Vec::new();
    for table in [MAP_CT, MAP_CT_NEW] {
        t.each_conntrack(table, |keys, entries| {
            for (k, e) in keys.iter().zip(entries) {
                if e.flags & (CT_F_REPLY | CT_F_LOCAL) == 0 && !seen.contains(k) && e.last_seen_ns < before {
                    gone.push((*k, *e));
                }
            }
        })?;
    }
    for (k, e) in &gone {
        w.remove_flow(k, e);
    }
    Ok(gone.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flow_crosses_with_its_keys_and_clock() {
        let mut a = SyncNames::default();
        let (z, r): (Arc<str>, Arc<str>) = (Arc::from("natgw/g"), Arc::from("natgw/g/snat/10.0.0.0/24"));
        a.zone_key.insert(3, z.clone());
        a.rule_key.insert(40, r.clone());
        let mut b = SyncNames::default();
        b.zone_id.insert(z, 7);
        b.rule_id.insert(r, 9);
        let k =
            Tuple { saddr: [10, 0, 0, 5], daddr: [1, 1, 1, 1], sport: 1000, dport: 53, proto: 17, _pad0: 0, zone: 3 };
        let x = Tuple { saddr: [198, 51, 100, 1], sport: 20000, ..k };
        let now = 100_000_000_000u64;
        let e = CtEntry {
            xlate: x,
            last_seen_ns: now - 3_000_000_000,
            created_ms: ct_clock_ms(now - 10_000_000_000),
            snat_rule: 40,
            flags: CT_F_SNAT | CT_F_SEQ,
            state: CT_ESTABLISHED,
            ..CtEntry::default()
        };
        let f = record_of_entry(&k, &e, true, &a, now).unwrap();
        let later = now + 50_000_000_000;
        let (k2, e2) = flow_of_record(&f, &b, later).unwrap();
        assert_eq!((k2.zone, e2.xlate.zone, e2.snat_rule, e2.dnat_rule), (7, 7, 9, 0));
        assert_eq!((k2.saddr, k2.sport, e2.xlate.saddr, e2.xlate.sport), (k.saddr, k.sport, x.saddr, x.sport));
        assert_eq!(e2.last_seen_ns, later - 3_000_000_000);
        assert_eq!(e2.created_ms, ct_clock_ms(later - 10_000_000_000));
        assert_eq!((e2.flags, e2.state, e2.wscale), (CT_F_SNAT, CT_ESTABLISHED, CT_WSCALE_NONE));
        // A zone or rule the receiver does not have is refused.
        let mut unknown = f.clone();
        unknown.snat_rule = "natgw/g/snat/other".into();
        assert!(flow_of_record(&unknown, &b, later).is_none());
    }
}
