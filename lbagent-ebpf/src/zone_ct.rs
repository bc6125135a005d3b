//! Each zone's share of the conntrack tables (`lbagent_common::ZONE_CT_MAX`
//! has the rules): a zone at its `new` limit opens no flow, one at its
//! `established` limit promotes none, and every refusal is counted per zone.
//!
//! Races between CPUs. Linux 5.10 has no fetching atomic add, so the check
//! and the add are two steps: CPUs that check a zone at the same moment may
//! each pass, and a limit can be exceeded by at most one flow per CPU. The
//! adds themselves are atomic; the agent's recount overwrites the counts at
//! every collection pass (which also corrects what the kernel's LRU evicted
//! from `ct_new` without telling anyone). A count is only taken down after
//! this CPU's delete succeeded; one that still runs below zero (a flow
//! counted before the maps existed, an agent write racing a program add)
//! reads as zero until the next recount: it never makes a limit refuse.

use aya_ebpf::bindings::BPF_NOEXIST;
use lbagent_common::{ZoneCtFlows, ZoneCtLimits, ZoneCtRefused};

use crate::maps::{ZONE_CT_FLOWS, ZONE_CT_LIMITS, ZONE_CT_REFUSED};

/// The zone's limits; `None` when it has none.
#[inline(always)]
fn limits(zone: u16) -> Option<ZoneCtLimits> {
    // SAFETY: a lookup by a key on the stack; the value is copied out.
    unsafe { ZONE_CT_LIMITS.get(&(zone as u32)) }.copied()
}

/// The zone's flow counts, created (zero) on its first flow.
#[inline(always)]
fn flows(zone: u16) -> Option<*mut ZoneCtFlows> {
    let key = zone as u32;
    if let Some(p) = ZONE_CT_FLOWS.get_ptr_mut(&key) {
        return Some(p);
    }
    let _ = ZONE_CT_FLOWS.insert(&key, &ZoneCtFlows { established: 0, new: 0 }, BPF_NOEXIST as u64);
    ZONE_CT_FLOWS.get_ptr_mut(&key)
}

/// Adds one to the field `field` picks in the zone's counts (created on
/// its first flow).
#[inline(always)]
fn add_flow(zone: u16, field: impl FnOnce(*mut ZoneCtFlows) -> *mut u64) {
    if let Some(f) = flows(zone) {
        // SAFETY: a field of a map value, 8-byte aligned, valid for the run.
        unsafe { crate::atomic::add(field(f), 1) };
    }
}

/// Takes one away from the field `field` picks in the zone's counts, if
/// the zone has counts: a removed zone's (the agent deletes them with the
/// zone, then flushes its flows) are not brought back by the flows that
/// end after.
#[inline(always)]
fn sub_flow(zone: u16, field: impl FnOnce(*mut ZoneCtFlows) -> *mut u64) {
    if let Some(f) = ZONE_CT_FLOWS.get_ptr_mut(&(zone as u32)) {
        // SAFETY: as in `add_flow`; the wrapping add of `u64::MAX` takes one.
        unsafe { crate::atomic::add(field(f), u64::MAX) };
    }
}

/// Counts one refusal in the field `field` picks.
#[inline(always)]
fn refused(zone: u16, field: impl FnOnce(*mut ZoneCtRefused) -> *mut u64) {
    let key = zone as u32;
    if ZONE_CT_REFUSED.get_ptr_mut(&key).is_none() {
        let _ = ZONE_CT_REFUSED.insert(&key, &ZoneCtRefused { established: 0, new: 0 }, BPF_NOEXIST as u64);
    }
    if let Some(r) = ZONE_CT_REFUSED.get_ptr_mut(&key) {
        // SAFETY: as in `add_flow`.
        unsafe { crate::atomic::add(field(r), 1) };
    }
}

/// Whether `count` is below `limit`; a count that ran below zero (its top
/// bit set) is.
#[inline(always)]
fn below(count: u64, limit: u32) -> bool {
    (count as i64) < limit as i64
}

/// Whether the zone may open one more flow (in `ct_new`); a refusal is
/// counted.
#[inline(always)]
pub fn may_open(zone: u16) -> bool {
    let Some(lim) = limits(zone) else { return true };
    if lim.new == 0 {
        return true;
    }
    // SAFETY: a plain read of a map value field (a torn or stale read only
    // moves the limit by a flow; module docs).
    if flows(zone).is_none_or(|f| below(unsafe { (*f).new }, lim.new)) {
        return true;
    }
    // SAFETY: the pointer is the map value's; only its address is taken.
    refused(zone, |r| unsafe { core::ptr::addr_of_mut!((*r).new) });
    false
}

/// Whether the zone may move one more flow to `ct`; a refusal is counted.
#[inline(always)]
pub fn may_promote(zone: u16) -> bool {
    let Some(lim) = limits(zone) else { return true };
    if lim.established == 0 {
        return true;
    }
    // SAFETY: as in `may_open`.
    if flows(zone).is_none_or(|f| below(unsafe { (*f).established }, lim.established)) {
        return true;
    }
    // SAFETY: as in `may_open`.
    refused(zone, |r| unsafe { core::ptr::addr_of_mut!((*r).established) });
    false
}

/// A flow was created in `ct_new`.
#[inline(always)]
pub fn opened(zone: u16) {
    // SAFETY: only the field's address is taken.
    add_flow(zone, |f| unsafe { core::ptr::addr_of_mut!((*f).new) });
}

/// A flow moved from `ct_new` to `ct`.
#[inline(always)]
pub fn promoted(zone: u16) {
    // SAFETY: as in `opened`.
    add_flow(zone, |f| unsafe { core::ptr::addr_of_mut!((*f).established) });
    // SAFETY: as in `opened`.
    sub_flow(zone, |f| unsafe { core::ptr::addr_of_mut!((*f).new) });
}

/// A flow left its table (`established`: `ct`, else `ct_new`).
#[inline(always)]
pub fn ended(zone: u16, established: bool) {
    // SAFETY: as in `opened`.
    sub_flow(zone, |f| unsafe {
        if established { core::ptr::addr_of_mut!((*f).established) } else { core::ptr::addr_of_mut!((*f).new) }
    });
}
