//! Flow logs (`lbagent_common::flow_log`): which new flows are logged, their
//! start records, their packet and byte counts, and the end records of the
//! flows that close (FIN both ways, RST). Every other end (a timeout, a
//! flush, an eviction) is written by the agent from `flow_acct` once the
//! flow's conntrack entries are gone.
//!
//! Records are written in place in the ring (`bpf_ringbuf_reserve`): the
//! stack has no room for a 144-byte record. A full ring loses the record,
//! never the packet (`flow_log_ring_full`). Counts are atomic adds: both
//! halves of a flow may be handled on two CPUs at once. Only logged flows
//! (`CT_F_LOGGED`, drawn at creation) pay for the lookup of their counts.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_prandom_u32, programs::TcContext};
use lbagent_common::*;

use crate::{
    conntrack::NewFlow,
    counters::count,
    maps::{FLOW_ACCT, FLOW_EVENTS, FLOW_LOG_SCRATCH, FLOW_LOG_ZONES},
    parse::Packet,
};

/// A packet as flow records count it: (packets, bytes), the bytes of its
/// IP header and payload (IPFIX's octet counts, not the Ethernet header
/// the TC hook sees). A GSO packet counts as one packet (its segments'
/// headers are not counted): the segment arithmetic on both the new-flow
/// and the hit path took the program past the verifier's million
/// instructions with eBPF logs on.
#[inline(always)]
pub fn ip_bytes(ctx: &TcContext, p: &Packet) -> (u64, u64) {
    (1, (ctx.len() as u64).saturating_sub(p.l3 as u64))
}

/// What a new flow of `zone` logs (`FLOW_LOG_*`; 0: nothing), its sample
/// drawn. The HA sync (`FLOW_LOG_SYNC`) takes every flow.
#[inline(always)]
pub fn wanted(zone: u16) -> u32 {
    let Some(z) = FLOW_LOG_ZONES.get(zone as u32) else { return 0 };
    if z.flags == 0 {
        return 0;
    }
    // SAFETY: bpf_get_prandom_u32 has no preconditions.
    if z.sample > 1 && unsafe { bpf_get_prandom_u32() } % z.sample != 0 {
        return z.flags & FLOW_LOG_SYNC;
    }
    z.flags
}

/// The key of a flow's counts from either half: `key` and its entry `e`.
#[inline(always)]
fn acct_key(key: &Tuple, e: &CtEntry) -> FlowAcctKey {
    let orig = if e.flags & CT_F_REPLY != 0 { e.xlate.reversed() } else { *key };
    FlowAcctKey { orig, created_ms: e.created_ms, _pad0: 0 }
}

/// A logged flow was created by `f` from packet `p`: its tuple translated
/// to `xlate`, created at `now`. Starts its counts (with
/// `FLOW_LOG_END`) and writes its start record (with `FLOW_LOG_START`).
#[inline(always)]
pub fn started(what: u32, xlate: &Tuple, f: &NewFlow, ctx: &TcContext, p: &Packet, now: u64) {
    let (flags, rules, orig) = (f.flags, (f.dnat_rule, f.snat_rule), &p.tuple);
    if what & FLOW_LOG_END != 0 {
        // Built in this CPU's room, not on the stack: the new-flow path's
        // frame has no 104 bytes to spare under Linux 5.10's limit.
        let Some(room) = FLOW_LOG_SCRATCH.get_ptr_mut(0) else { return };
        let first = ip_bytes(ctx, p);
        // SAFETY: this CPU's slot of a per-CPU array, valid for the program
        // run; only this program run touches it.
        let room = unsafe { &mut *room };
        room.key.orig = *orig;
        room.key.created_ms = ct_clock_ms(now);
        room.key._pad0 = 0;
        let a = &mut room.acct;
        a.packets[0] = first.0;
        a.packets[1] = 0;
        a.bytes[0] = first.1;
        a.bytes[1] = 0;
        a.last_ns = now;
        a.start_ns = now;
        a.xlate = *xlate;
        a.dnat_rule = rules.0;
        a.snat_rule = rules.1;
        a.flags = flags;
        a.ended = 0;
        a._pad0 = 0;
        a._pad1 = 0;
        if FLOW_ACCT.insert(&room.key, &room.acct, BPF_NOEXIST as u64).is_err() {
            count(Counter::FlowLogAcctFull);
        }
    }
    if what & (FLOW_LOG_START | FLOW_LOG_SYNC) == 0 {
        return;
    }
    let Some(mut slot) = FLOW_EVENTS.reserve(0) else {
        count(Counter::FlowLogRingFull);
        return;
    };
    let r = slot.as_mut_ptr();
    // SAFETY: `r` points to a reserved record of the ring, ours until it
    // is submitted; every field is written before the submit.
    unsafe {
        write_tuples(r, orig, xlate);
        (*r).time_ns = now;
        (*r).start_ns = now;
        write_counts(r, &[0; 2], &[0; 2]);
        (*r).created_ms = ct_clock_ms(now);
        (*r).dnat_rule = rules.0;
        (*r).snat_rule = rules.1;
        (*r).kind = FLOW_EVENT_START;
        (*r).reason = 0;
        (*r).flags = flags;
        (*r).serves = (what & (FLOW_LOG_START | FLOW_LOG_SYNC)) as u8;
    }
    slot.submit(0);
}

/// Writes the addresses, ports and identity of a record.
///
/// # Safety
/// `r` points to a record reserved in the ring.
#[inline(always)]
unsafe fn write_tuples(r: *mut FlowEvent, orig: &Tuple, xlate: &Tuple) {
    // SAFETY: the caller's guarantee. Addresses as IPv4-mapped, in words
    // (a 16-byte array store would become a `memcpy` call).
    unsafe {
        write_v4(&raw mut (*r).orig_saddr, orig.saddr);
        write_v4(&raw mut (*r).orig_daddr, orig.daddr);
        write_v4(&raw mut (*r).xlate_saddr, xlate.saddr);
        write_v4(&raw mut (*r).xlate_daddr, xlate.daddr);
        (*r).orig_sport = orig.sport;
        (*r).orig_dport = orig.dport;
        (*r).xlate_sport = xlate.sport;
        (*r).xlate_dport = xlate.dport;
        (*r).zone = orig.zone;
        (*r).proto = orig.proto;
        (*r).family = 4;
        (*r)._pad1 = 0;
    }
}

/// A record's counts, word by word and opaquely (LLVM merges adjacent
/// stores of an array, or of zeros, into a `memcpy` or `memset` call, which
/// the BPF target cannot link).
///
/// # Safety
/// `r` points to a record reserved in the ring.
#[inline(always)]
unsafe fn write_counts(r: *mut FlowEvent, packets: &[u64; 2], bytes: &[u64; 2]) {
    use core::ptr::write_volatile as put;
    // SAFETY: the caller's guarantee.
    unsafe {
        put(&raw mut (*r).packets[0], packets[0]);
        put(&raw mut (*r).packets[1], packets[1]);
        put(&raw mut (*r).bytes[0], bytes[0]);
        put(&raw mut (*r).bytes[1], bytes[1]);
    }
}

/// `::ffff:a.b.c.d` into a record's 16-byte address.
///
/// # Safety
/// `to` points into a record reserved in the ring (8-byte aligned fields).
#[inline(always)]
unsafe fn write_v4(to: *mut [u8; 16], a: [u8; 4]) {
    let w = to.cast::<u32>();
    // SAFETY: the caller's guarantee; the address fields are 4-byte aligned.
    unsafe {
        *w = 0;
        *w.add(1) = 0;
        *w.add(2) = u32::from_ne_bytes([0, 0, 0xff, 0xff]);
        *w.add(3) = u32::from_ne_bytes(a);
    }
}

/// Counts packet `p` of a logged flow ([`ip_bytes`]), hit under its tuple
/// (entry `e`).
#[inline(always)]
pub fn packet(ctx: &TcContext, p: &Packet, e: &CtEntry, now: u64) {
    let k = acct_key(&p.tuple, e);
    let Some(a) = FLOW_ACCT.get_ptr_mut(&k) else { return };
    let (packets, bytes) = ip_bytes(ctx, p);
    let dir = (e.flags & CT_F_REPLY != 0) as usize;
    // SAFETY: a map value pointer stays valid for the program run; the
    // counts are 8-byte aligned u64s added atomically (CPUs share them);
    // `last_ns` is a plain store (a lost update only ages it by a packet).
    unsafe {
        crate::atomic::add(&raw mut (*a).packets[dir & 1], packets);
        crate::atomic::add(&raw mut (*a).bytes[dir & 1], bytes);
        (*a).last_ns = now;
    }
}

/// A logged flow closed (FIN both ways, or an RST: `rst`): its end record,
/// with its counts (the closing packet's too), and `ended` set so that the
/// agent writes no second one when the entries go. `key` and `e` are the
/// half the packet hit.
#[inline(always)]
pub fn closed(key: &Tuple, e: &CtEntry, rst: bool, now: u64) {
    let reason = if rst { FLOW_END_RST } else { FLOW_END_FIN };
    let k = acct_key(key, e);
    let Some(a) = FLOW_ACCT.get_ptr_mut(&k) else { return };
    // SAFETY: a map value pointer stays valid for the program run.
    let a = unsafe { &mut *a };
    if a.ended != 0 {
        return;
    }
    let Some(mut slot) = FLOW_EVENTS.reserve(0) else {
        // The agent writes it, with this reason, when the entries go.
        a.ended = reason | FLOW_END_BY_AGENT;
        count(Counter::FlowLogRingFull);
        return;
    };
    a.ended = reason;
    let r = slot.as_mut_ptr();
    // SAFETY: `r` points to a reserved record of the ring, ours until it
    // is submitted; every field is written before the submit.
    unsafe {
        write_tuples(r, &k.orig, &a.xlate);
        (*r).time_ns = now;
        (*r).start_ns = a.start_ns;
        write_counts(r, &a.packets, &a.bytes);
        (*r).created_ms = k.created_ms;
        (*r).dnat_rule = a.dnat_rule;
        (*r).snat_rule = a.snat_rule;
        (*r).kind = FLOW_EVENT_END;
        (*r).reason = reason;
        (*r).flags = a.flags;
        (*r).serves = FLOW_LOG_END as u8;
    }
    slot.submit(0);
}
