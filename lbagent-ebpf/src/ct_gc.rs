//! Conntrack garbage collection, run by the agent (`BPF_PROG_TEST_RUN`,
//! never attached): its input is a batch of keys of halves the agent read
//! idle (`lbagent_common::CT_GC_BATCH`), and each goes through the reclaim
//! a new flow uses on an expired flow's tuple (`conntrack::reclaim`): read
//! again, with its pair, at the kernel's clock (the agent's read decides
//! nothing: its clock may be another's, in a time namespace); freed
//! with its pair when both are still idle; kept when either is live again
//! or the key now holds another flow. The decision and the deletes happen
//! within a few instructions of each other, not a system call apart, and
//! each flow costs one run's share of a system call instead of four.
//!
//! Races with the NAT program on other CPUs are the reclaim's (see the
//! module docs of `conntrack.rs`): the same as two new flows reclaiming one
//! tuple.

use aya_ebpf::programs::TcContext;
use lbagent_common::{CT_GC_BATCH, CT_RECLAIM_FREED, Tuple};

use crate::conntrack;

/// Frees the flows of the input's keys that are idle now; returns how many
/// it freed.
#[inline(always)]
pub fn collect(ctx: &TcContext) -> i32 {
    let now = conntrack::now();
    let mut freed = 0;
    for i in 0..CT_GC_BATCH {
        let Ok(key) = ctx.load::<Tuple>(i * size_of::<Tuple>()) else { break };
        if conntrack::reclaim(&key, now) == CT_RECLAIM_FREED {
            freed += 1;
        }
    }
    freed
}
