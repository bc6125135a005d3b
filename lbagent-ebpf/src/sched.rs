//! Scheduler tables: a new flow of a rule with a `DNAT_F_SCHED_*` flag
//! takes its backend from the rule's table (layout: `lbagent_common::sched`;
//! built by `lbagent/src/lb/sched.rs`).
//!
//! - `DNAT_F_SCHED_SOURCE` / `_TUPLE`: Maglev, slot = hash of the source
//!   address / of the 5-tuple, modulo the (prime) table size.
//! - `DNAT_F_SCHED_TURN`: slot = this CPU's position for the rule, then the
//!   position moves on. Positions are per CPU (`sched_turns` is a per-CPU
//!   map): no two CPUs write one counter, so no atomics are needed (Linux
//!   5.10 has no fetching atomic add) and each CPU walks the weighted
//!   sequence in turn on its own; together they still honour the weights.
//!
//! The agent replaces a table by inserting a new inner map under the rule
//! id: one map update, so a lookup sees the old table or the new one.

use lbagent_common::*;

use crate::{
    maps::{SCHED_TABLES, SCHED_TURNS},
    rules::flow_hash,
};

/// The backend the rule's table gives a new flow `t`; `None` when the rule
/// has no scheduler (or its table is not there: the caller falls back to
/// the plain hash over `dnat_backends`).
#[inline(always)]
pub fn pick(rule: &DnatRule, t: &Tuple) -> Option<Backend> {
    let sched = rule.flags & DNAT_F_SCHED_MASK;
    if sched == 0 {
        return None;
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
    unsafe { SCHED_TABLES.get_value(&rule_id, &slot) }.copied()
}

/// This CPU's position for `rule_id`, moved on by one.
#[inline(always)]
fn next_turn(rule_id: u32) -> u32 {
    match SCHED_TURNS.get_ptr_mut(&rule_id) {
        Some(p) => {
            // SAFETY: a per-CPU value: only this CPU touches it, and a TC
            // program is not preempted by itself on one CPU.
            let n = unsafe { *p };
            // SAFETY: as above.
            unsafe { *p = n.wrapping_add(1) % SCHED_TABLE_SIZE };
            n
        }
        None => {
            let _ = SCHED_TURNS.insert(&rule_id, &1, 0);
            0
        }
    }
}

/// A hash of the source address alone (`sch`: one client, one backend).
#[inline(always)]
fn source_hash(saddr: [u8; 4]) -> u32 {
    let mut h = u32::from_ne_bytes(saddr).wrapping_mul(0x9e37_79b1);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^ (h >> 13)
}
