//! End records of the flows that ended without a close the program saw:
//! idle past their timeout (expired by a lookup, a port claim or GC),
//! deleted by the agent (a flush, a rule removed), or evicted from the LRU
//! `ct_new`. A scan reads `flow_acct` a batch at a time; a logged flow
//! whose original half is gone from both tables gets its end record, built
//! from its counts, and its counts go. A flow the program closed (FIN, RST)
//! had its end record then: its counts only go.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use lbagent_common::*;

use crate::dataplane::tables::Tables;

/// What one scan found.
#[derive(Default, Debug)]
pub struct Scan {
    /// End records to export.
    pub ended: Vec<FlowEvent>,
    /// Logged flows still alive.
    pub alive: u64,
}

/// The reason a gone flow ended: the mark (the agent's deletion, or a
/// close the program had no room in the ring for), else a timeout when it
/// was idle at least its shortest timeout, else an eviction.
fn reason(a: &FlowAcct, proto: u8, cfg: &NatConfig, now_ns: u64) -> u8 {
    if a.ended != 0 {
        return a.ended & !FLOW_END_BY_AGENT;
    }
    let shortest = cfg.timeout_s(proto, CT_NEW).min(cfg.timeout_s(proto, CT_ESTABLISHED));
    if now_ns.saturating_sub(a.last_ns) >= u64::from(shortest) * 1_000_000_000 {
        FLOW_END_TIMEOUT
    } else {
        FLOW_END_EVICTED
    }
}

/// One scan of `flow_acct` at `now_ns` (monotonic). A set `stop` ends it
/// between two batches, with what it found so far (counts are removed
/// only for the end records it returns).
pub fn scan(t: &Tables, now_ns: u64, stop: &AtomicBool) -> Result<Scan> {
    let cfg = t.config()?;
    let alive = t.alive_checker()?;
    let acct = t.hash(MAP_FLOW_ACCT)?;
    let mut out = Scan::default();
    let mut gone = Vec::new();
    t.each_flow_acct(|keys, values| {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        for (k, read) in keys.iter().zip(values) {
            if alive.alive(k, &read.xlate) {
                out.alive += 1;
                continue;
            }
            // Read again now that the flow is gone: the batch's copy may
            // predate the agent's mark (a flush) or the program's close.
            let Ok(a) = acct.get(k, 0) else { continue };
            gone.push(*k);
            // The program wrote its end record.
            if matches!(a.ended, FLOW_END_FIN | FLOW_END_RST) {
                continue;
            }
            let why = reason(&a, k.orig.proto, &cfg, now_ns);
            let mut e = FlowEvent::ipv4(FLOW_EVENT_END, &k.orig, &a.xlate, a.flags, a.dnat_rule, a.snat_rule);
            // An agent's deletion ends the flow now; any other end is the
            // flow's last packet.
            e.time_ns = if matches!(why, FLOW_END_FLUSH | FLOW_END_RULE_REMOVED) { now_ns } else { a.last_ns };
            e.start_ns = a.start_ns;
            e.created_ms = k.created_ms;
            e.packets = a.packets;
            e.bytes = a.bytes;
            e.reason = why;
            out.ended.push(e);
        }
    })?;
    t.remove_flow_acct(&gone)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gone_flow_ends_by_its_mark_its_idle_time_or_an_eviction() {
        let cfg = NatConfig::default();
        let s = 1_000_000_000u64;
        let a = |last_ns, ended| FlowAcct { last_ns, ended, ..Default::default() };
        let now = 1000 * s;
        assert_eq!(reason(&a(now - 31 * s, 0), PROTO_UDP, &cfg, now), FLOW_END_TIMEOUT);
        assert_eq!(reason(&a(now - 5 * s, 0), PROTO_UDP, &cfg, now), FLOW_END_EVICTED);
        assert_eq!(reason(&a(now - 61 * s, 0), PROTO_TCP, &cfg, now), FLOW_END_TIMEOUT);
        assert_eq!(reason(&a(now - 5 * s, FLOW_END_FLUSH), PROTO_TCP, &cfg, now), FLOW_END_FLUSH);
        // Closed by the program without room in the ring: its reason.
        assert_eq!(reason(&a(now, FLOW_END_RST | FLOW_END_BY_AGENT), PROTO_TCP, &cfg, now), FLOW_END_RST);
    }
}
