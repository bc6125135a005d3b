//! Scheduler tables: a new flow of a rule with a `DNAT_F_SCHED_*` flag
//! takes its backend from the rule's table (layout: `lbagent_common::sched`;
//! built by `lbagent/src/lb/sched.rs`).
//!
//! - `DNAT_F_SCHED_SOURCE` / `_TUPLE`: Maglev, slot = hash of the source
//!   address / of the 5-tuple, modulo the (prime) table size.
//! - `DNAT_F_SCHED_TURN`: slot = this CPU's position for the rule (a random
//!   one at first), then the position moves on. Positions are per CPU (`sched_turns` is a per-CPU
//!   map): no two CPUs write one counter, so no atomics are needed (Linux
//!   5.10 has no fetching atomic add) and each CPU walks the weighted
//!   sequence in turn on its own; together they still honour the weights.
//! - `DNAT_F_SCHED_LEAST`: no table; the backend of `dnat_backends` with the
//!   fewest active flows per weight (`sched_active`), ties to the first.
//!   Counts move with atomic adds when a flow opens (`flow_opened`) and
//!   when it starts closing (`flow_closing`); two CPUs opening flows at
//!   once may both pick the same backend (one flow of imbalance); the agent
//!   recounts from conntrack on every repair pass.
//!
//! The agent replaces a table by inserting a new inner map under the rule
//! id: one map update, so a lookup sees the old table or the new one.

use lbagent_common::*;

use crate::{
    hash::{flow_hash, source_hash},
    maps::{DNAT_BACKENDS, SCHED_ACTIVE, SCHED_TABLES, SCHED_TURNS},
};

/// The backend the rule's scheduler gives a new flow `t`; all zero (no
/// backend has address 0.0.0.0) when the rule has no scheduler or its table
/// is not there: the caller then falls back to the plain hash over
/// `dnat_backends`. Not an `Option`: LLVM leaves the payload of a `None`
/// undefined, and a register holding it fails the verifier when copied.
#[inline(always)]
pub fn pick(rule: &DnatRule, t: &Tuple) -> Backend {
    let sched = rule.flags & DNAT_F_SCHED_MASK;
    if sched == 0 {
        return Backend::default();
    }
    if sched == DNAT_F_SCHED_LEAST {
        return least(rule);
    }
    let slot = if sched == DNAT_F_SCHED_SOURCE {
        source_hash(t.saddr) % SCHED_TABLE_SIZE
    } else if sched == DNAT_F_SCHED_TUPLE {
        flow_hash(t) % SCHED_TABLE_SIZE
    } else {
        next_turn(rule.rule_id) % SCHED_TABLE_SIZE
    };
    // The key's address goes to the helper: a copy, not the rule's field.
    let rule_id = rule.rule_id;
    // SAFETY: the inner table is only replaced whole (never written in
    // place) and its values are plain data, copied out at once.
    match unsafe { SCHED_TABLES.get_value(&rule_id, &slot) } {
        // SAFETY: the slot's 8 bytes are a `Backend` (see `SCHED_TABLES`),
        // and a u64's alignment covers the Backend's.
        Some(v) => unsafe { *(v as *const u64 as *const Backend) },
        None => Backend::default(),
    }
}

/// This CPU's position for `rule_id`, moved on by one. A CPU's first
/// position is drawn at random: CPUs that all started at slot 0 would send
/// their first flows, and every burst spread over the CPUs, to the same
/// backends. The per-CPU value holds the next position plus one: 0 is a
/// CPU that has not started (a per-CPU entry that another CPU created
/// holds 0 on every other CPU).
#[inline(always)]
fn next_turn(rule_id: u32) -> u32 {
    // SAFETY: bpf_get_prandom_u32 has no preconditions.
    let random = || unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() } % SCHED_TABLE_SIZE;
    match SCHED_TURNS.get_ptr_mut(&rule_id) {
        Some(p) => {
            // SAFETY: a per-CPU value: only this CPU touches it, and a TC
            // program is not preempted by itself on one CPU.
            let v = unsafe { *p };
            let n = if v == 0 { random() } else { (v - 1) % SCHED_TABLE_SIZE };
            // SAFETY: as above.
            unsafe { *p = (n + 1) % SCHED_TABLE_SIZE + 1 };
            n
        }
        None => {
            let n = random();
            let _ = SCHED_TURNS.insert(&rule_id, &((n + 1) % SCHED_TABLE_SIZE + 1), 0);
            n
        }
    }
}

/// The backend with the fewest active flows per weight (all zero: none).
#[inline(always)]
fn least(rule: &DnatRule) -> Backend {
    let packed = lbagent_sched_least(rule.rule_id, rule.backend_count);
    let b = packed.to_le_bytes();
    Backend { addr: [b[0], b[1], b[2], b[3]], port: u16::from_le_bytes([b[4], b[5]]), _pad0: 0 }
}

/// `least`'s loop as a global BPF function: the verifier checks a global
/// function once, on its own, instead of once for every state in which the
/// new-flow path reaches it (the loop made each program load ~50 % slower).
/// Scalars in, the chosen backend packed in a scalar out (address in the
/// low 4 bytes, port in the next 2; 0: none).
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn lbagent_sched_least(rule_id: u32, n: u32) -> u64 {
    let mut best = 0u64;
    let (mut best_active, mut best_weight) = (0u64, 1u64);
    for index in 0..SCHED_LEAST_MAX {
        if index >= n {
            break;
        }
        // SAFETY: plain data, copied out at once.
        let Some(b) = (unsafe { DNAT_BACKENDS.get(&BackendKey { rule_id, index }) }).copied() else { continue };
        let key = ActiveKey { rule_id, addr: b.addr, port: b.port, _pad0: 0 };
        // SAFETY: as above (`active` may be added to meanwhile: a torn
        // read is impossible for an aligned 8-byte field).
        let Some(a) = (unsafe { SCHED_ACTIVE.get(&key) }).copied() else { continue };
        if a.weight == 0 {
            continue;
        }
        let active = if a.active < 0 { 0 } else { a.active as u64 };
        let weight = a.weight as u64;
        // active / weight < best_active / best_weight, without division.
        if best == 0 || active * best_weight < best_active * weight {
            best = u32::from_le_bytes(b.addr) as u64 | (b.port as u64) << 32;
            best_active = active;
            best_weight = weight;
        }
    }
    best
}

/// Adds `delta` to a least-connection backend's active flows (if the rule
/// counts them).
#[inline(always)]
fn add_active(rule_id: u32, addr: [u8; 4], port: u16, delta: i64) {
    let key = ActiveKey { rule_id, addr, port, _pad0: 0 };
    if let Some(p) = SCHED_ACTIVE.get_ptr_mut(&key) {
        // SAFETY: `p` points at a live map value whose first field is the
        // 8-byte aligned `active`; other CPUs add to it concurrently, hence
        // the atomic add.
        unsafe { crate::atomic::add(p.cast::<u64>(), delta as u64) };
    }
}

/// A new flow of a least-connection rule went to `backend` (address, port
/// as translated).
#[inline(always)]
pub fn flow_opened(rule: u32, addr: [u8; 4], port: u16) {
    add_active(rule, addr, port, 1);
}

/// A flow started closing: if its rule counts active flows, the backend has
/// one fewer. `e` is the entry of the direction the packet took, `t` the
/// packet's tuple (for a reply, its source is the backend).
#[inline(always)]
pub fn flow_closing(e: &CtEntry, t: &Tuple) {
    if e.dnat_rule == 0 {
        return;
    }
    let (addr, port) = if e.flags & CT_F_REPLY != 0 { (t.saddr, t.sport) } else { (e.xlate.daddr, e.xlate.dport) };
    add_active(e.dnat_rule, addr, port, -1);
}
