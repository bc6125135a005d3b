//! Layout version 2: the map types an lbagent of that layout pinned under
//! `<bpffs>/v2/` that layout 3 changed, as they were, and how each becomes
//! today's. Read only by the migration; nothing else may use them.
//!
//! What layout 3 changed (and what the conversion does about it):
//! - `qos_stats` is a per-CPU array (it was one array that every CPU added
//!   to atomically): a bucket's old totals go to the first CPU's slot.
//! - `qos_zones` holds a [`QosZoneInfo`] (it held a count of hooks);
//!   `QosHook` lost `eip_side` (where EIP rules act is in the zone's info
//!   now); `QosEip` grew `flags`. Hooks and EIP rules are converted only so
//!   that the first apply finds the buckets in use and keeps their clocks
//!   and counts: it rewrites the zone info and the EIP flags from the
//!   desired state (they differ from what is converted), before any
//!   program of layout 3 is attached.
//!
//! Everything else the migration copies has the same layout in both.

use lbagent_common::{self as common, QOS_HOOK_RULES, QosMatch, QosStats};

/// `QosHook` of layout 2 (8 + 16 × 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QosHookV2 {
    pub eip_side: u32,
    pub count: u32,
    pub rules: [QosMatch; QOS_HOOK_RULES],
}

/// `QosEip` of layout 2 (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QosEipV2 {
    pub bucket: u32,
    pub priority: u32,
}

/// A layout-2 hook in layout 3: its gateway rules.
pub fn qos_hook(h: &QosHookV2) -> common::QosHook {
    common::QosHook { count: h.count.min(QOS_HOOK_RULES as u32), rules: h.rules }
}

/// A layout-2 EIP rule in layout 3: no flags (the program then reads the
/// hook, which is always right; the first apply sets the flags).
pub fn qos_eip(e: &QosEipV2) -> common::QosEip {
    common::QosEip { bucket: e.bucket, priority: e.priority, flags: 0, _pad0: 0 }
}

/// A bucket's layout-2 totals as layout 3's per-CPU values: all on the
/// first CPU (only the sum is ever read).
pub fn qos_stats(total: &QosStats, cpus: usize) -> Vec<QosStats> {
    let mut v = vec![QosStats::default(); cpus.max(1)];
    v[0] = *total;
    v
}

macro_rules! pod_v2 {
    ($($t:ty),*) => {$(
        // SAFETY: repr(C), no implicit padding (asserted below), every bit pattern valid.
        unsafe impl aya::Pod for $t {}
    )*};
}
pod_v2!(QosHookV2, QosEipV2);

const _: () = {
    assert!(core::mem::size_of::<QosHookV2>() == 8 + 16 * QOS_HOOK_RULES);
    assert!(core::mem::size_of::<QosEipV2>() == 8);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_keep_their_rules_and_eips_their_buckets() {
        let mut h = QosHookV2 { eip_side: 1, count: 2, ..Default::default() };
        h.rules[1] = QosMatch { bucket: 7, priority: 3, addr: [10, 0, 0, 0], kind: 1, prefix_len: 8, _pad0: 0 };
        let n = qos_hook(&h);
        assert_eq!((n.count, n.rules), (2, h.rules));
        let e = qos_eip(&QosEipV2 { bucket: 9, priority: 4 });
        assert_eq!((e.bucket, e.priority, e.flags), (9, 4, 0));
        let total = QosStats { passed_packets: 5, passed_bytes: 500, ..Default::default() };
        let per_cpu = qos_stats(&total, 2);
        assert_eq!(per_cpu, vec![total, QosStats::default()]);
    }
}
