//! IPv4 fragments. Only the first fragment carries the L4 header, so it
//! records its (pre-translation) ports under the datagram's identity
//! (addresses, IP id, protocol, zone); later fragments take the ports from
//! there, find the same conntrack entry and get the same address
//! translation (they have no ports or L4 checksum to rewrite).
//!
//! A later fragment whose first fragment was not seen (reordered, or the
//! entry is older than `FRAG_TIMEOUT_S`) cannot be matched to a flow: it is
//! dropped when it would need translation (its source is in a SNAT rule, or
//! its destination is a floating IP), so a private address never leaks, and
//! passed otherwise. A later fragment whose first fragment is on record but
//! opened no flow (it was dropped: an ACL, no free port, a taken tuple) is
//! dropped when a rule would have translated its datagram. Like Cilium, and
//! unlike Linux (which reassembles), the first fragment must come first.

use aya_ebpf::{bindings::BPF_ANY, programs::TcContext};
use lbagent_common::*;

use crate::{
    conntrack,
    counters::count_flow,
    maps::FRAGS,
    parse::Packet,
    rewrite::rewrite_addresses,
    verdict::{orphan_fragment, untracked_fragment, verdict},
};

#[inline(always)]
fn key(p: &Packet) -> FragKey {
    let t = &p.tuple;
    FragKey { saddr: t.saddr, daddr: t.daddr, id: p.ip_id, proto: t.proto, _pad0: 0, zone: t.zone, _pad1: 0 }
}

/// Remembers the first fragment's ports for the fragments that follow.
#[inline(always)]
pub fn record_first(p: &Packet, now: u64) {
    let v = FragEntry { sport: p.tuple.sport, dport: p.tuple.dport, _pad0: 0, seen_ns: now };
    let _ = FRAGS.insert(&key(p), &v, BPF_ANY as u64);
}

/// A non-first fragment: translated like its first fragment was.
#[inline(always)]
pub fn later(ctx: &TcContext, p: &Packet) -> i32 {
    let now = conntrack::now();
    let first = match FRAGS.get_ptr(&key(p)) {
        // SAFETY: a map value pointer stays valid for the program run.
        Some(v) => unsafe { *v },
        None => return untracked_fragment(ctx, p),
    };
    if conntrack::since(now, first.seen_ns) > FRAG_TIMEOUT_S * 1_000_000_000 {
        return untracked_fragment(ctx, p);
    }
    let mut t = p.tuple;
    t.sport = first.sport;
    t.dport = first.dport;
    let Some(e) = conntrack::peek(&t, now) else {
        // The first fragment opened no flow: it was untranslated, or dropped
        // (an ACL refused it, no free port, its tuple taken). Its datagram
        // goes the same way as what it would have needed.
        return orphan_fragment(ctx, p, &t);
    };
    count_flow(e.dnat_rule, e.snat_rule, ctx.len() as u64);
    match rewrite_addresses(ctx, p, &e.xlate) {
        Ok(()) => verdict(Counter::FragmentsTranslated),
        Err(_) => verdict(Counter::DropRewriteFailed),
    }
}
