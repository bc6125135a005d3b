//! The logger's threads: one reads the ring and exports what it reads and
//! what the scan hands it (IPFIX to each collector, JSON Lines); one scans
//! `flow_acct` for the flows that ended without a close the program saw.

use std::{
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc::{Receiver, SyncSender},
    },
    time::{Duration, Instant, SystemTime},
};

use anyhow::Result;
use lbagent_common::*;
use tracing::warn;

use super::{
    BATCH, FlowLogStatus, Names, POLL, RETRY, Report, SCAN_EVERY, ends, ipfix, jsonl,
    record::{self, Clock, FlowRecord},
};
use crate::{
    dataplane::tables::{Tables, monotonic_ns},
    state::flow_log::{FlowLogSpec, IpfixSpec},
};

/// The thread's state.
pub(super) struct Logger {
    pub(super) bpffs: PathBuf,
    pub(super) dir: PathBuf,
    /// `spec` was asked for: without it the thread only feeds `feed`
    /// (nothing exported, no scan, no status).
    pub(super) logs: bool,
    pub(super) spec: FlowLogSpec,
    pub(super) feed: Option<super::Feed>,
    pub(super) names: Arc<Mutex<Arc<Names>>>,
    pub(super) report: Report,
    pub(super) status: Arc<Mutex<FlowLogStatus>>,
    pub(super) stop: Arc<AtomicBool>,
}

/// An IPFIX collector: its exporter once its socket is made.
struct Collector {
    spec: IpfixSpec,
    exporter: Option<ipfix::Exporter>,
    retry_at: Instant,
    /// Why its socket could not be made (shown until it can).
    problem: Option<String>,
}

impl Logger {
    pub(super) fn run(&mut self) {
        // End records of flows that ended otherwise come from a scan on a
        // thread of its own: the ring is read on while it runs.
        let (ended_tx, ended) = std::sync::mpsc::sync_channel::<Vec<FlowEvent>>(4);
        let scanner = self.spec.end.then(|| {
            let (bpffs, stop, status) = (self.bpffs.clone(), self.stop.clone(), self.status.clone());
            std::thread::Builder::new()
                .name("flow-log-scan".into())
                .spawn(move || scan_until_stopped(&bpffs, &stop, &ended_tx, &status))
                .expect("spawning the flow-log scan")
        });
        let mut done = false;
        while !done {
            match self.export_until_stopped(&ended) {
                Ok(()) => done = true,
                Err(e) if self.stop.load(Ordering::Relaxed) => {
                    warn!("flow logs: {e:#}");
                    done = true;
                }
                Err(e) => {
                    let why = format!("{e:#}");
                    warn!("flow logs: {why}; retrying in 1 s");
                    let st = {
                        let mut st = self.status.lock().unwrap();
                        st.running = false;
                        st.problem = Some(why);
                        st.clone()
                    };
                    if self.logs {
                        (self.report)(&st);
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
        // Whatever the scan still hands over is lost: count it.
        let mut lost = 0;
        while let Ok(batch) = ended.recv() {
            lost += batch.len() as u64;
        }
        self.status.lock().unwrap().dropped.stopped += lost;
        if let Some(s) = scanner {
            let _ = s.join();
        }
        let st = {
            let mut st = self.status.lock().unwrap();
            st.running = false;
            st.clone()
        };
        if self.logs {
            (self.report)(&st);
        }
    }

    fn export_until_stopped(&mut self, ended: &Receiver<Vec<FlowEvent>>) -> Result<()> {
        let tables = Tables::open(&self.bpffs)?;
        anyhow::ensure!(tables.has_flow_log(), "the pinned maps have no flow_events (an older layout's pins)");
        let mut ring = tables.flow_events()?;
        let mut collectors: Vec<Collector> = self
            .spec
            .ipfix
            .iter()
            .map(|c| Collector { spec: c.clone(), exporter: None, retry_at: Instant::now(), problem: None })
            .collect();
        let mut jsonl = self.spec.jsonl.clone().map(|j| jsonl::Writer::new(j, self.dir.clone()));
        {
            let mut st = self.status.lock().unwrap();
            st.running = true;
            st.problem = None;
        }
        let mut reported = Instant::now() - Duration::from_secs(1);
        let mut events: Vec<FlowEvent> = Vec::with_capacity(BATCH);
        // Until stopped and the scan has handed over its last records.
        let mut scan_over = false;
        while !(self.stop.load(Ordering::Relaxed) && scan_over) {
            for c in collectors.iter_mut().filter(|c| c.exporter.is_none() && Instant::now() >= c.retry_at) {
                match ipfix::Exporter::new(c.spec.clone()) {
                    Ok(x) => {
                        c.exporter = Some(x);
                        c.problem = None;
                    }
                    Err(e) => {
                        if c.problem.is_none() {
                            warn!(
                                "flow logs: IPFIX collector {}: {e}; retrying every {} s",
                                c.spec.collector,
                                RETRY.as_secs()
                            );
                        }
                        c.retry_at = Instant::now() + RETRY;
                        c.problem = Some(format!("IPFIX collector {}: {e}", c.spec.collector));
                    }
                }
            }
            let problems: Vec<&str> = collectors.iter().filter_map(|c| c.problem.as_deref()).collect();
            let problem = (!problems.is_empty()).then(|| problems.join("; "));
            let mut pfd = libc::pollfd { fd: ring.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd for the call's duration.
            unsafe { libc::poll(&mut pfd, 1, POLL.as_millis() as i32) };
            while events.len() < BATCH {
                let Some(item) = ring.next() else { break };
                if item.len() >= std::mem::size_of::<FlowEvent>() {
                    // SAFETY: the ring holds `FlowEvent`s the programs wrote
                    // whole (any bytes are a valid `FlowEvent`); read
                    // unaligned from the ring's memory.
                    events.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<FlowEvent>()) });
                }
            }
            if let Some(f) = &self.feed {
                let synced: Vec<FlowEvent> =
                    events.iter().filter(|e| u32::from(e.serves) & FLOW_LOG_SYNC != 0).copied().collect();
                if !synced.is_empty() {
                    let n = synced.len() as u64;
                    if f.tx.try_send(synced).is_err() {
                        f.lost.fetch_add(n, Ordering::Relaxed);
                    }
                }
            }
            // Records for the sync alone are not logged (still in the ring
            // when the sync stopped, too); `serves` 0 is the previous
            // layout's programs' (they log what they write).
            events.retain(|e| e.serves == 0 || u32::from(e.serves) & (FLOW_LOG_START | FLOW_LOG_END) != 0);
            let mut exported = self.export(&events, &mut collectors, jsonl.as_mut());
            events.clear();
            loop {
                match ended.try_recv() {
                    Ok(batch) => exported.add(&self.export(&batch, &mut collectors, jsonl.as_mut())),
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        scan_over = true;
                        break;
                    }
                }
            }
            let mut st = self.status.lock().unwrap();
            exported.into_status(&mut st);
            st.problem = problem;
            if self.logs && reported.elapsed() >= Duration::from_secs(1) {
                if let Ok(counters) = tables.counters() {
                    for (c, v) in counters {
                        match c {
                            Counter::FlowLogRingFull => st.dropped.ring_full = v,
                            Counter::FlowLogAcctFull => st.dropped.acct_full = v,
                            _ => {}
                        }
                    }
                }
                (self.report)(&st);
                reported = Instant::now();
            }
        }
        Ok(())
    }

    /// Names, filters and exports `events`, [`BATCH`] records at a time.
    fn export(
        &self,
        events: &[FlowEvent],
        collectors: &mut [Collector],
        mut jsonl: Option<&mut jsonl::Writer>,
    ) -> Exported {
        let mut out = Exported::default();
        let names = self.names.lock().unwrap().clone();
        let clock = Clock::now();
        for chunk in events.chunks(BATCH) {
            let records: Vec<FlowRecord> = chunk
                .iter()
                .map(|e| FlowRecord::of(e, &clock, &names))
                .filter(|r| {
                    // A record whose rules have no name any more is kept.
                    let mut kinds = r.kinds().peekable();
                    let keep = self.spec.kinds.is_empty()
                        || kinds.peek().is_none()
                        || kinds.any(|k| self.spec.kinds.contains(&k));
                    out.filtered += u64::from(!keep);
                    keep
                })
                .collect();
            for r in &records {
                match r.event {
                    record::Event::Start => out.starts += 1,
                    record::Event::End(_) => out.ends += 1,
                }
            }
            for c in collectors.iter_mut() {
                match &mut c.exporter {
                    Some(x) => {
                        let (sent, lost) = x.send(&records);
                        out.ipfix_sent += sent;
                        out.ipfix_lost += lost;
                    }
                    None => out.ipfix_lost += records.len() as u64,
                }
            }
            if let Some(w) = jsonl.as_deref_mut()
                && !records.is_empty()
            {
                let mut lines = String::with_capacity(records.len() * 400);
                for r in &records {
                    lines.push_str(&jsonl::line(r));
                    lines.push('\n');
                }
                match w.write(&lines) {
                    Ok(()) => out.jsonl_written += records.len() as u64,
                    Err(e) => {
                        out.jsonl_lost += records.len() as u64;
                        warn!("flow logs: writing JSON Lines: {e}");
                    }
                }
            }
        }
        // Templates go out on time even without records.
        if events.is_empty() {
            for x in collectors.iter_mut().filter_map(|c| c.exporter.as_mut()) {
                x.send(&[]);
            }
        }
        out
    }
}

/// The scan's loop: every [`SCAN_EVERY`] (or ten times what the last scan
/// took), the end records of the flows gone, handed to the exporting
/// thread in batches (it waits while the exporter is behind).
fn scan_until_stopped(
    bpffs: &Path,
    stop: &AtomicBool,
    ended: &SyncSender<Vec<FlowEvent>>,
    status: &Mutex<FlowLogStatus>,
) {
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(POLL);
        if Instant::now() < next {
            continue;
        }
        let began = Instant::now();
        let scan = Tables::open(bpffs).and_then(|t| ends::scan(&t, monotonic_ns(), stop));
        let took = began.elapsed();
        next = Instant::now() + SCAN_EVERY.max(took * 10);
        match scan {
            Ok(scan) => {
                {
                    let mut st = status.lock().unwrap();
                    st.logged_flows = scan.alive;
                    st.last_scan = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).ok().map(|d| d.as_secs());
                    st.last_scan_ms = took.as_millis() as u64;
                }
                for batch in scan.ended.chunks(BATCH) {
                    if ended.send(batch.to_vec()).is_err() {
                        return;
                    }
                }
            }
            Err(e) => warn!("flow logs: scanning for ended flows: {e:#}"),
        }
    }
}

#[derive(Default)]
struct Exported {
    starts: u64,
    ends: u64,
    filtered: u64,
    ipfix_sent: u64,
    ipfix_lost: u64,
    jsonl_written: u64,
    jsonl_lost: u64,
}

impl Exported {
    fn add(&mut self, o: &Exported) {
        self.starts += o.starts;
        self.ends += o.ends;
        self.filtered += o.filtered;
        self.ipfix_sent += o.ipfix_sent;
        self.ipfix_lost += o.ipfix_lost;
        self.jsonl_written += o.jsonl_written;
        self.jsonl_lost += o.jsonl_lost;
    }

    fn into_status(self, st: &mut FlowLogStatus) {
        st.start_records += self.starts;
        st.end_records += self.ends;
        st.filtered += self.filtered;
        st.ipfix_sent += self.ipfix_sent;
        st.dropped.ipfix_send_failed += self.ipfix_lost;
        st.jsonl_written += self.jsonl_written;
        st.dropped.jsonl_write_failed += self.jsonl_lost;
    }
}
