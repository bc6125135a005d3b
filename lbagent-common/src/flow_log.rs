//! Flow logs: the records the programs emit when a flow starts and when it
//! closes (`flow_events`, a ring buffer), each logged flow's packet and byte
//! counts (`flow_acct`), and which zones log (`flow_log_zones`). The agent
//! consumes the ring, writes the end records of flows that ended without a
//! close (timeouts, flushes, evictions) from `flow_acct`, and exports both
//! (`lbagent/src/flow_log/`). One stream: any other consumer of flow
//! events (a standby's sync) reads the same records.
//!
//! Addresses are 16 bytes from the start: an IPv4 address is carried
//! IPv4-mapped (`::ffff:a.b.c.d`, RFC 4291 2.5.5.2) with `family` 4.

use crate::Tuple;

/// `flow_log_zones` value (written by the agent; index = zone): what the
/// zone's programs log. All zero: nothing (the default).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowLogZone {
    /// `FLOW_LOG_*` bits.
    pub flags: u32,
    /// Log one new flow in `sample` (drawn at random); 0 and 1: every flow.
    pub sample: u32,
}

/// Start records of the zone's flows.
pub const FLOW_LOG_START: u32 = 1;
/// End records (the program counts each logged flow's packets and bytes in
/// `flow_acct` for them).
pub const FLOW_LOG_END: u32 = 2;
/// A start record of every new flow of the zone, whatever the sample, for
/// the HA pair's sync (`lbagent/src/ha/`); the record says whether it is
/// also logged ([`FlowEvent::serves`]).
pub const FLOW_LOG_SYNC: u32 = 4;

/// Size of `flow_events` in bytes (a power of two, pages): about 27 600
/// records (144 bytes and the ring's 8-byte header each).
pub const FLOW_EVENTS_BYTES: u32 = 4 << 20;
/// Size of `flow_log_zones`: every zone id.
pub const FLOW_LOG_ZONES_MAX: u32 = 65_536;

/// `flow_acct` key: a flow by its original tuple and its creation time (a
/// later flow of the same tuple is another entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowAcctKey {
    pub orig: Tuple,
    /// `CtEntry::created_ms` of both halves.
    pub created_ms: u32,
    pub _pad0: u32,
}

/// `flow_acct` value. The program creates it with the flow and adds every
/// packet of either half (atomic adds: CPUs share it); the agent removes it
/// once the flow's end record is written.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowAcct {
    /// Original direction, then reply.
    pub packets: [u64; 2],
    pub bytes: [u64; 2],
    /// `bpf_ktime_get_ns()` of the latest packet counted.
    pub last_ns: u64,
    /// `bpf_ktime_get_ns()` of the flow's first packet.
    pub start_ns: u64,
    /// The flow's translated tuple (what its end record needs after its
    /// conntrack entries are gone).
    pub xlate: Tuple,
    pub dnat_rule: u32,
    pub snat_rule: u32,
    /// `CT_F_*` of the original direction.
    pub flags: u8,
    /// 0 while no end record was written; else the `FLOW_END_*` reason the
    /// program wrote one for (FIN, RST), or the agent deleted the flow for
    /// (flush, rule removed), or the program closed it for without room in
    /// the ring (with `FLOW_END_BY_AGENT`): the agent's end record follows.
    pub ended: u8,
    pub _pad0: u16,
    pub _pad1: u32,
}

/// `flow_log_scratch`, per CPU: a new logged flow's key and counts, built
/// there before the insert into `flow_acct`. Written by the programs only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowLogScratch {
    pub key: FlowAcctKey,
    pub acct: FlowAcct,
}

/// `FlowEvent::kind`.
pub const FLOW_EVENT_START: u8 = 1;
pub const FLOW_EVENT_END: u8 = 2;

/// End reasons (`FlowEvent::reason`, `FlowAcct::ended`).
pub const FLOW_END_FIN: u8 = 1;
pub const FLOW_END_RST: u8 = 2;
/// Idle past its timeout (expired by a lookup, a port claim or GC).
pub const FLOW_END_TIMEOUT: u8 = 3;
/// `lbagent conntrack flush`.
pub const FLOW_END_FLUSH: u8 = 4;
/// The agent deleted it: its rule, backend or object went, or a changed
/// ACL no longer admits it.
pub const FLOW_END_RULE_REMOVED: u8 = 5;
/// Gone while still fresh: the kernel evicted it from the LRU `ct_new`
/// (or a collision replaced it).
pub const FLOW_END_EVICTED: u8 = 6;

/// `FlowAcct::ended` bit: the program closed the flow (the reason in the
/// other bits) but had no room in the ring for its end record; the agent
/// writes it when the entries go.
pub const FLOW_END_BY_AGENT: u8 = 0x80;

/// The reason's name in records (`end_reason`).
pub const fn flow_end_name(reason: u8) -> &'static str {
    match reason {
        FLOW_END_FIN => "fin",
        FLOW_END_RST => "rst",
        FLOW_END_TIMEOUT => "timeout",
        FLOW_END_FLUSH => "flush",
        FLOW_END_RULE_REMOVED => "rule_removed",
        FLOW_END_EVICTED => "evicted",
        _ => "unknown",
    }
}

/// One record of `flow_events`, written in place in the ring by the
/// program (start; end on FIN or RST) and built the same way by the agent
/// (the other ends).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowEvent {
    /// `bpf_ktime_get_ns()` of the event (CLOCK_MONOTONIC).
    pub time_ns: u64,
    pub orig_saddr: [u8; 16],
    pub orig_daddr: [u8; 16],
    pub xlate_saddr: [u8; 16],
    pub xlate_daddr: [u8; 16],
    /// End: packets and bytes, original direction then reply.
    pub packets: [u64; 2],
    pub bytes: [u64; 2],
    /// End: `bpf_ktime_get_ns()` of the flow's first packet.
    pub start_ns: u64,
    /// The flow's identity with its original tuple (`CtEntry::created_ms`).
    pub created_ms: u32,
    pub dnat_rule: u32,
    pub snat_rule: u32,
    pub orig_sport: u16,
    pub orig_dport: u16,
    pub xlate_sport: u16,
    pub xlate_dport: u16,
    pub zone: u16,
    /// `FLOW_EVENT_*`.
    pub kind: u8,
    /// End: `FLOW_END_*`.
    pub reason: u8,
    pub proto: u8,
    /// 4 or 6: how to read the addresses.
    pub family: u8,
    /// `CT_F_*` of the original direction.
    pub flags: u8,
    /// The `FLOW_LOG_*` bits of the consumers the record is for: a start
    /// record is logged with `FLOW_LOG_START`, synced to the HA peer with
    /// `FLOW_LOG_SYNC`; end records carry `FLOW_LOG_END`.
    pub serves: u8,
    pub _pad1: u32,
}

/// The IPv4-mapped form of `a` (`::ffff:a.b.c.d`).
#[inline(always)]
pub const fn v4_mapped(a: [u8; 4]) -> [u8; 16] {
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a[0], a[1], a[2], a[3]]
}

/// The IPv4 address of an IPv4-mapped one.
#[inline(always)]
pub const fn v4_of(a: &[u8; 16]) -> [u8; 4] {
    [a[12], a[13], a[14], a[15]]
}

impl FlowEvent {
    /// The record of an IPv4 flow (`orig` and its translation `xlate`),
    /// without time, counts or reason.
    pub fn ipv4(kind: u8, orig: &Tuple, xlate: &Tuple, flags: u8, dnat_rule: u32, snat_rule: u32) -> FlowEvent {
        FlowEvent {
            orig_saddr: v4_mapped(orig.saddr),
            orig_daddr: v4_mapped(orig.daddr),
            xlate_saddr: v4_mapped(xlate.saddr),
            xlate_daddr: v4_mapped(xlate.daddr),
            orig_sport: orig.sport,
            orig_dport: orig.dport,
            xlate_sport: xlate.sport,
            xlate_dport: xlate.dport,
            zone: orig.zone,
            kind,
            proto: orig.proto,
            family: 4,
            flags,
            serves: if kind == FLOW_EVENT_END { FLOW_LOG_END as u8 } else { FLOW_LOG_START as u8 },
            dnat_rule,
            snat_rule,
            ..FlowEvent::default()
        }
    }
}

const _: () = {
    assert!(core::mem::size_of::<FlowLogZone>() == 8);
    assert!(core::mem::size_of::<FlowAcctKey>() == 16 + 4 + 4);
    assert!(core::mem::size_of::<FlowAcct>() == 16 + 16 + 8 + 8 + 16 + 4 + 4 + 1 + 1 + 2 + 4);
    assert!(core::mem::size_of::<FlowLogScratch>() == 24 + 80);
    assert!(core::mem::size_of::<FlowEvent>() == 8 + 64 + 16 + 16 + 8 + 12 + 8 + 2 + 6 + 4);
};

#[cfg(feature = "user")]
mod user {
    use super::*;

    pod!(FlowLogZone, FlowAcctKey, FlowAcct, FlowLogScratch, FlowEvent);
}
