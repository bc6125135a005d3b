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

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_prandom_u32};
use lbagent_common::*;

use crate::{
    conntrack::NewFlow,
    counters::count,
    maps::{FLOW_ACCT, FLOW_EVENTS, FLOW_LOG_ZONES},
};

/// What a new flow of `zone` logs (`FLOW_LOG_*`; 0: nothing), its sample
/// drawn.
#[inline(always)]
pub fn wanted(zone: u16) -> u32 {
    let Some(z) = FLOW_LOG_ZONES.get(zone as u32) else { return 0 };
    if z.flags == 0 {
        return 0;
    }
    // SAFETY: bpf_get_prandom_u32 has no preconditions.
    if z.sample > 1 && unsafe { bpf_get_prandom_u32() } % z.sample != 0 {
        return 0;
    }
    z.flags
}

/// The key of a flow's counts from either half: `key` and its entry `e`.
#[inline(always)]
fn acct_key(key: &Tuple, e: &CtEntry) -> FlowAcctKey {
    let orig = if e.flags & CT_F_REPLY != 0 { e.xlate.reversed() } else { *key };
    FlowAcctKey { orig, created_ms: e.created_ms, _pad0: 0 }
}

/// A logged flow was created by `f`: `orig` translated to `xlate`, created
/// at `now` by a packet of `bytes`. Starts its counts (with
/// `FLOW_LOG_END`) and writes its start record (with `FLOW_LOG_START`).
#[inline(always)]
pub fn started(what: u32, orig: &Tuple, xlate: &Tuple, f: &NewFlow, bytes: u64, now: u64) {
    let (flags, rules) = (f.flags, (f.dnat_rule, f.snat_rule));
    if what & FLOW_LOG_END != 0 {
        let acct = FlowAcct {
            packets: [1, 0],
            bytes: [bytes, 0],
            last_ns: now,
            start_ns: now,
            xlate: *xlate,
            dnat_rule: rules.0,
            snat_rule: rules.1,
            flags,
            ended: 0,
            _pad0: 0,
            _pad1: 0,
        };
        let key = FlowAcctKey { orig: *orig, created_ms: ct_clock_ms(now), _pad0: 0 };
        if FLOW_ACCT.insert(&key, &acct, BPF_NOEXIST as u64).is_err() {
            count(Counter::FlowLogAcctFull);
        }
    }
    if what & FLOW_LOG_START == 0 {
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
        (*r)._pad0 = 0;
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

/// Counts a packet of `bytes` of a logged flow, hit under `key` (entry `e`).
#[inline(always)]
pub fn packet(key: &Tuple, e: &CtEntry, bytes: u64, now: u64) {
    let k = acct_key(key, e);
    let Some(a) = FLOW_ACCT.get_ptr_mut(&k) else { return };
    let dir = (e.flags & CT_F_REPLY != 0) as usize;
    // SAFETY: a map value pointer stays valid for the program run; the
    // counts are 8-byte aligned u64s added atomically (CPUs share them);
    // `last_ns` is a plain store (a lost update only ages it by a packet).
    unsafe {
        crate::atomic::add(&raw mut (*a).packets[dir & 1], 1);
        crate::atomic::add(&raw mut (*a).bytes[dir & 1], bytes);
        (*a).last_ns = now;
    }
}

/// A logged flow closed (FIN both ways, or an RST; `reason`): its end
/// record, with its counts, and `ended` set so that the agent writes no
/// second one when the entries go. `key` and `e` are the half the packet
/// hit.
#[inline(always)]
pub fn closed(key: &Tuple, e: &CtEntry, reason: u8, now: u64) {
    let k = acct_key(key, e);
    let Some(a) = FLOW_ACCT.get_ptr_mut(&k) else { return };
    // SAFETY: a map value pointer stays valid for the program run.
    let a = unsafe { &mut *a };
    if a.ended != 0 {
        return;
    }
    a.ended = reason;
    let Some(mut slot) = FLOW_EVENTS.reserve(0) else {
        count(Counter::FlowLogRingFull);
        return;
    };
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
    }
    slot.submit(0);
}
