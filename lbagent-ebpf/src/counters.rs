//! Per-CPU counters.

use aya_ebpf::bindings::BPF_NOEXIST;
use lbagent_common::{Counter, RuleStats};

use crate::maps::{COUNTERS, RULE_STATS};

#[inline(always)]
pub fn count(c: Counter) {
    if let Some(p) = COUNTERS.get_ptr_mut(c as u32) {
        // SAFETY: this CPU's slot of a per-CPU array, valid for the program
        // run; no other CPU touches it.
        unsafe { *p += 1 };
    }
}

/// Adds one packet of `bytes` to rule `id` (0 = no rule).
#[inline(always)]
pub fn count_rule(id: u32, bytes: u64) {
    if id == 0 {
        return;
    }
    match RULE_STATS.get_ptr_mut(&id) {
        // SAFETY: this CPU's value of a per-CPU hash entry, valid for the
        // program run; no other CPU touches it.
        Some(p) => unsafe {
            (*p).packets += 1;
            (*p).bytes += bytes;
        },
        None => {
            let _ = RULE_STATS.insert(&id, &RuleStats { packets: 1, bytes, refused: 0 }, BPF_NOEXIST as u64);
        }
    }
}

/// Counts a new flow rule `id` refused: its ACL refused the client, or (a
/// SNAT rule) no port was free for it.
#[inline(always)]
pub fn count_refused(id: u32) {
    match RULE_STATS.get_ptr_mut(&id) {
        // SAFETY: a per-CPU map value pointer, valid for the program run.
        Some(p) => unsafe { (*p).refused += 1 },
        None => {
            let _ = RULE_STATS.insert(&id, &RuleStats { packets: 0, bytes: 0, refused: 1 }, BPF_NOEXIST as u64);
        }
    }
}

/// Counts a translated packet under the flow's DNAT rule and SNAT rule.
#[inline(always)]
pub fn count_flow(dnat_rule: u32, snat_rule: u32, bytes: u64) {
    count_rule(dnat_rule, bytes);
    if snat_rule != dnat_rule {
        count_rule(snat_rule, bytes);
    }
}
