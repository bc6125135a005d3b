//! What becomes of a packet the engine does not translate: counted, then
//! passed or dropped by what its counter means. Dropped whenever passing it
//! would leak a private address.

use aya_ebpf::programs::TcContext;
use lbagent_common::Counter;

use crate::{
    counters::count,
    parse::Packet,
    route::route,
    rules,
    tc::{TC_ACT_OK, TC_ACT_SHOT},
};

/// Counts `c` and returns what it means for the packet.
#[inline(always)]
pub fn verdict(c: Counter) -> i32 {
    count(c);
    if c.is_drop() { TC_ACT_SHOT } else { TC_ACT_OK }
}

/// A packet that matched no flow and opens none: passed, unless a SNAT rule
/// covers its source, in which case passing it would leak the private
/// address (an unsolicited echo reply, an ICMP error about nothing we
/// translated, an address-only packet whose tuple is taken).
#[inline(always)]
pub fn unmatched(ctx: &TcContext, p: &Packet) -> i32 {
    if snat_covers(ctx, p) {
        return verdict(Counter::DropUntranslatable);
    }
    verdict(Counter::PassedUnmatched)
}

/// A later fragment whose first fragment is not on record: dropped when it
/// would need translation (a SNAT source, a floating-IP destination).
#[inline(always)]
pub fn untracked_fragment(ctx: &TcContext, p: &Packet) -> i32 {
    if snat_covers(ctx, p) || rules::address_wide_dnat(p.tuple.zone, p.tuple.daddr) {
        return verdict(Counter::DropFragmentUntracked);
    }
    verdict(Counter::PassedFragment)
}

/// A later fragment whose first fragment is on record but opened no flow
/// (`t`: its tuple with the first fragment's ports): dropped when a rule
/// would have translated the datagram (the first fragment was then dropped,
/// and passing the rest would send them untranslated), passed otherwise.
#[inline(always)]
pub fn orphan_fragment(ctx: &TcContext, p: &Packet, t: &lbagent_common::Tuple) -> i32 {
    if snat_covers(ctx, p) || rules::dnat_applies(t) {
        return verdict(Counter::DropFragmentUntracked);
    }
    verdict(Counter::PassedFragment)
}

/// Whether a SNAT rule covers the packet's source on the interface it will
/// leave by (nothing covers what is delivered to the namespace itself).
#[inline(always)]
fn snat_covers(ctx: &TcContext, p: &Packet) -> bool {
    let t = &p.tuple;
    match route(ctx, t, p.ifindex).snat_ifindex(p.ifindex) {
        Some(out) => rules::snat(p, out).is_some(),
        None => false,
    }
}
