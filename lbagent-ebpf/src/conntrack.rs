//! Conntrack: lookup with expiry, the coarse state machine, and creation of a
//! flow's two entries with collision-free source port allocation.
//!
//! State machine (per flow, mirrored in both entries):
//! `NEW` --packet in reply direction--> `ESTABLISHED`
//! any --RST, or FIN seen in both directions--> `CLOSING` (short timeout).

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
};
use lbagent_common::*;

use crate::{
    maps::{CT, NAT_CONFIG},
    parse::{Packet, TCP_FIN, TCP_RST},
};

const NS: u64 = 1_000_000_000;
/// How many source ports a new flow tries before giving up.
const PORT_TRIES: u32 = 32;

#[inline(always)]
pub fn now() -> u64 {
    unsafe { bpf_ktime_get_ns() }
}

/// Idle timeout of an entry, from its protocol and state.
#[inline(always)]
fn timeout_ns(proto: u8, state: u8) -> u64 {
    NAT_CONFIG.get(0).copied().unwrap_or_default().timeout_s(proto, state) as u64 * NS
}

#[inline(always)]
fn fresh(e: &CtEntry, proto: u8, now: u64) -> bool {
    now.wrapping_sub(e.last_seen_ns) <= timeout_ns(proto, e.state)
}

pub enum Lookup {
    /// A live entry: rewrite to this tuple.
    Hit(CtEntry),
    /// No entry, or an expired one (already removed).
    Miss { expired: bool },
}

/// Finds the entry for `p`, advances the flow state and refreshes its timer.
#[inline(always)]
pub fn lookup(p: &Packet, now: u64) -> Lookup {
    let Some(ptr) = CT.get_ptr_mut(&p.tuple) else { return Lookup::Miss { expired: false } };
    let e = unsafe { &mut *ptr };
    let pair_key = e.xlate.reversed();
    if !fresh(e, p.tuple.proto, now) {
        // A one-way stream keeps only one entry warm: ask the other one.
        let pair_fresh = match unsafe { CT.get(&pair_key) } {
            Some(pair) => fresh(pair, p.tuple.proto, now),
            None => false,
        };
        if !pair_fresh {
            let _ = CT.remove(&pair_key);
            let _ = CT.remove(&p.tuple);
            return Lookup::Miss { expired: true };
        }
    }
    let mut changed = false;
    if p.tuple.proto == PROTO_TCP && p.tcp_flags & TCP_FIN != 0 && e.flags & CT_F_FIN == 0 {
        e.flags |= CT_F_FIN;
        changed = true;
    }
    let state = next_state(e, p);
    if state != e.state {
        e.state = state;
        changed = true;
    }
    if changed {
        if let Some(pair) = CT.get_ptr_mut(&pair_key) {
            let pair = unsafe { &mut *pair };
            // FIN in both directions closes the flow.
            if e.flags & CT_F_FIN != 0 && pair.flags & CT_F_FIN != 0 {
                e.state = CT_CLOSING;
            }
            if e.state > pair.state {
                pair.state = e.state;
                pair.last_seen_ns = now;
            }
        }
    }
    if now.wrapping_sub(e.last_seen_ns) > NS {
        e.last_seen_ns = now;
    }
    Lookup::Hit(*e)
}

#[inline(always)]
fn next_state(e: &CtEntry, p: &Packet) -> u8 {
    if p.tuple.proto == PROTO_TCP && p.tcp_flags & TCP_RST != 0 {
        return CT_CLOSING;
    }
    if e.state == CT_NEW && e.flags & CT_F_REPLY != 0 {
        return CT_ESTABLISHED;
    }
    e.state
}

/// What a new flow should become.
pub struct NewFlow {
    pub xlate: Tuple,
    pub flags: u8,
    pub dnat_rule: u32,
    pub snat_rule: u32,
    /// Source port range to allocate from, and whether to start at random.
    pub port_min: u16,
    pub port_max: u16,
    pub random: bool,
}

/// Creates both entries of a new flow; returns the final translated tuple,
/// or `None` when no source port is free (or the table refuses inserts).
#[inline(always)]
pub fn create(p: &Packet, f: &NewFlow, now: u64) -> Result<Tuple, Counter> {
    let orig = p.tuple;
    let mut x = f.xlate;
    let mut reply = CtEntry {
        xlate: orig.reversed(),
        last_seen_ns: now,
        dnat_rule: f.dnat_rule,
        snat_rule: f.snat_rule,
        flags: f.flags | CT_F_REPLY,
        state: CT_NEW,
        _pad0: 0,
        _pad1: 0,
    };
    let span = (f.port_max as u32).saturating_sub(f.port_min as u32) + 1;
    // Random-fully draws the start; otherwise a per-flow hash spreads flows
    // over the range (a plain sport start would cluster and probe long).
    let start = if f.random { unsafe { bpf_get_prandom_u32() } } else { crate::rules::flow_hash(&orig) };
    let keep_first = !f.random && (f.flags & CT_F_SNAT == 0 || (x.sport >= f.port_min && x.sport <= f.port_max));
    let mut claimed = false;
    for i in 0..PORT_TRIES {
        if i > 0 || !keep_first {
            x.sport = f.port_min + ((start.wrapping_add(i)) % span) as u16;
        }
        if CT.insert(&x.reversed(), &reply, BPF_NOEXIST as u64).is_ok() {
            claimed = true;
            break;
        }
    }
    if !claimed {
        return Err(Counter::DropNoPort);
    }
    reply.flags = f.flags;
    reply.xlate = x;
    if CT.insert(&orig, &reply, BPF_NOEXIST as u64).is_err() {
        // Another CPU created this flow first: use its translation.
        let _ = CT.remove(&x.reversed());
        return match unsafe { CT.get(&orig) } {
            Some(e) => Ok(e.xlate),
            None => Err(Counter::DropCtInsert),
        };
    }
    Ok(x)
}
