//! Hashes of a packet's tuple that pick backends and ports: stable, so a
//! flow's choice is reproducible (`rules`, `sched`, `conntrack`).

use lbagent_common::Tuple;

/// A stable hash of the tuple, so a flow's backend choice is reproducible.
#[inline(always)]
pub fn flow_hash(t: &Tuple) -> u32 {
    let mut h = u32::from_ne_bytes(t.saddr).wrapping_mul(0x9e37_79b1);
    h ^= u32::from_ne_bytes(t.daddr).wrapping_mul(0x85eb_ca6b);
    h ^= (((t.sport as u32) << 16) | t.dport as u32).wrapping_mul(0xc2b2_ae35);
    h ^= t.proto as u32;
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb_352d);
    h ^ (h >> 15)
}

/// A hash of the source address alone (`sch`: one client, one backend).
#[inline(always)]
pub fn source_hash(saddr: [u8; 4]) -> u32 {
    let mut h = u32::from_ne_bytes(saddr).wrapping_mul(0x9e37_79b1);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^ (h >> 13)
}
