//! Conntrack garbage collection, run by the agent (`BPF_PROG_TEST_RUN`,
//! never attached): its input is the clock and a batch of keys of halves
//! the agent read idle (`lbagent_common::CT_GC_KEYS`), and each goes through
//! the reclaim a new flow uses on an expired flow's tuple
//! (`conntrack::reclaim`): read again, with its pair, at this clock; freed
//! with its pair when both are still idle; kept when either is live again
//! or the key now holds another flow. The decision and the deletes happen
//! within a few instructions of each other, not a system call apart, and
//! each flow costs one run's share of a system call instead of four.
//!
//! Races with the NAT program on other CPUs are the reclaim's (see the
//! module docs of `conntrack.rs`): the same as two new flows reclaiming one
//! tuple.

use aya_ebpf::programs::TcContext;
use lbagent_common::{CT_GC_BATCH, CT_GC_KEYS, CT_RECLAIM_FREED, Tuple};

use crate::conntrack;

/// Frees the flows of the input's keys that are idle at its clock; returns
/// how many it freed.
#[inline(always)]
pub fn collect(ctx: &TcContext) -> i32 {
    let Ok(now) = ctx.load::<u64>(0) else { return 0 };
    let mut freed = 0;
    for i in 0..CT_GC_BATCH {
        let Ok(key) = ctx.load::<Tuple>(CT_GC_KEYS + i * size_of::<Tuple>()) else { break };
        if conntrack::reclaim(&key, now) == CT_RECLAIM_FREED {
            freed += 1;
        }
    }
    freed
}
