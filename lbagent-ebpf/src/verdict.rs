//! What becomes of a packet the engine does not translate: counted, then
//! passed or dropped by what its counter means. Dropped whenever passing it
//! would leak a private address.

use lbagent_common::Counter;

use crate::{TC_ACT_OK, TC_ACT_SHOT, counters::count, parse::Packet, rules};

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
pub fn unmatched(p: &Packet) -> i32 {
    if rules::snat(p.tuple.zone, p.ifindex, p.tuple.saddr).is_some() {
        return verdict(Counter::DropUntranslatable);
    }
    verdict(Counter::PassUnmatched)
}

/// A later fragment whose first fragment is not on record: dropped when it
/// would need translation (a SNAT source, a floating-IP destination).
#[inline(always)]
pub fn untracked_fragment(p: &Packet) -> i32 {
    let t = &p.tuple;
    if rules::snat(t.zone, p.ifindex, t.saddr).is_some() || rules::address_wide_dnat(t.zone, t.daddr) {
        return verdict(Counter::DropFragUntracked);
    }
    verdict(Counter::PassFragment)
}
