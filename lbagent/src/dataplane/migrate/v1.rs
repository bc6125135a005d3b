//! Layout version 1: the map types an lbagent of that layout pinned under
//! `<bpffs>/v1/`, as they were, and how each becomes today's. Read only by
//! the migration; nothing else may use them.
//!
//! What changed in layout 2 (and what the conversion does about it):
//! - `ct` was one LRU table of both halves of every flow; now `ct` (hash)
//!   holds established flows and `ct_new` (LRU) the others. An entry grew
//!   `created_ns`, TCP sequence tracking (`seq_end`, `max_win`, `wscale`)
//!   and a state (`CT_REPLIED`) between new and established.
//! - `DnatRule` grew `acl_digest`; `RuleStats` grew `acl_drops`; the
//!   counters array grew (the first 13 counters kept their index).
//! - `snat_rules` keys changed meaning (ingress interface then, egress
//!   interface now): they are not carried; the agent writes them from the
//!   desired state before any of its programs is attached.

use lbagent_common::{self as common, CtEntry, Tuple};

/// `CtEntry` of layout 1 (40 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntryV1 {
    pub xlate: Tuple,
    pub last_seen_ns: u64,
    pub dnat_rule: u32,
    pub snat_rule: u32,
    pub flags: u8,
    /// 0 new, 1 both directions seen, 2 closing.
    pub state: u8,
    pub _pad0: u16,
    pub _pad1: u32,
}

/// `DnatRule` of layout 1 (20 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DnatRuleV1 {
    pub rule_id: u32,
    pub backend_count: u32,
    pub snat_ifindex: u32,
    pub snat_addr: [u8; 4],
    pub flags: u32,
}

/// `RuleStats` of layout 1 (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleStatsV1 {
    pub packets: u64,
    pub bytes: u64,
}

/// Entries of layout 1's counters array.
pub const COUNTER_COUNT_V1: u32 = 13;

const STATE_NEW: u8 = 0;
const STATE_SEEN_BOTH: u8 = 1;
const STATE_CLOSING: u8 = 2;

/// Window-scale shift given to migrated TCP halves: layout 1 did not record
/// the one the SYN offered, so the most liberal is assumed (a flow picked
/// up mid-stream, as nf_conntrack's liberal mode treats it): an in-window
/// RST is never ignored because of an unknown scale.
const WSCALE_UNKNOWN: u8 = 14;

/// Which table of layout 2 a converted half belongs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtTable {
    Established,
    New,
}

/// One half of a layout-1 flow as layout 2 stores it, and its table.
///
/// States: "both directions seen" becomes established for TCP (the
/// handshake's last ACK is not told apart in layout 1; an open connection
/// is what it almost always was) and for UDP (a stream: layout 1 kept
/// answered UDP for 180 s, a stream now keeps 120 s), and replied for ICMP
/// (layout 2 never promotes echo). Creation time is unknown: the last
/// packet's time stands in. Sequence state is left unknown (`CT_F_SEQ`
/// clear): the next packet of each direction records it.
pub fn ct_entry(key: &Tuple, e: &CtEntryV1) -> (CtEntry, CtTable) {
    let state = match (e.state, key.proto) {
        (STATE_NEW, _) => common::CT_NEW,
        (STATE_SEEN_BOTH, common::PROTO_ICMP) => common::CT_REPLIED,
        (STATE_SEEN_BOTH, _) => common::CT_ESTABLISHED,
        (STATE_CLOSING, _) => common::CT_CLOSING,
        // Unknown states (never written by layout 1): the shortest timeout.
        _ => common::CT_CLOSING,
    };
    let table = match state {
        common::CT_ESTABLISHED | common::CT_CLOSING => CtTable::Established,
        _ => CtTable::New,
    };
    let known = common::CT_F_REPLY | common::CT_F_SNAT | common::CT_F_DNAT | common::CT_F_FIN;
    let entry = CtEntry {
        xlate: e.xlate,
        last_seen_ns: e.last_seen_ns,
        created_ns: e.last_seen_ns,
        dnat_rule: e.dnat_rule,
        snat_rule: e.snat_rule,
        seq_end: 0,
        max_win: 0,
        flags: e.flags & known,
        state,
        wscale: if key.proto == common::PROTO_TCP { WSCALE_UNKNOWN } else { common::CT_WSCALE_NONE },
        _pad0: 0,
        _pad1: 0,
    };
    (entry, table)
}

/// A layout-1 DNAT rule in layout 2: no ACL (layout 1 had none).
pub fn dnat_rule(r: &DnatRuleV1) -> common::DnatRule {
    common::DnatRule {
        rule_id: r.rule_id,
        backend_count: r.backend_count,
        snat_ifindex: r.snat_ifindex,
        snat_addr: r.snat_addr,
        flags: r.flags & (common::DNAT_F_SNAT | common::DNAT_F_SNAT_RANDOM),
        acl_digest: 0,
    }
}

pub fn rule_stats(s: &RuleStatsV1) -> common::RuleStats {
    common::RuleStats { packets: s.packets, bytes: s.bytes, acl_drops: 0 }
}

macro_rules! pod_v1 {
    ($($t:ty),*) => {$(
        // SAFETY: repr(C), no implicit padding (asserted below), every bit pattern valid.
        unsafe impl aya::Pod for $t {}
    )*};
}
pod_v1!(CtEntryV1, DnatRuleV1, RuleStatsV1);

const _: () = {
    assert!(core::mem::size_of::<CtEntryV1>() == 16 + 8 + 4 + 4 + 1 + 1 + 2 + 4);
    assert!(core::mem::size_of::<DnatRuleV1>() == 20);
    assert!(core::mem::size_of::<RuleStatsV1>() == 16);
};

#[cfg(test)]
mod tests {
    use super::*;

    fn key(proto: u8) -> Tuple {
        Tuple { saddr: [10, 0, 0, 1], daddr: [10, 0, 0, 2], sport: 1, dport: 2, proto, _pad0: 0, zone: 3 }
    }

    #[test]
    fn states_and_tables() {
        let e = |state| CtEntryV1 { state, last_seen_ns: 7, flags: common::CT_F_REPLY, ..Default::default() };
        let tcp = key(common::PROTO_TCP);
        assert_eq!(ct_entry(&tcp, &e(0)).1, CtTable::New);
        let (est, table) = ct_entry(&tcp, &e(1));
        assert_eq!((est.state, table), (common::CT_ESTABLISHED, CtTable::Established));
        assert_eq!((est.created_ns, est.last_seen_ns, est.flags), (7, 7, common::CT_F_REPLY));
        assert_eq!(est.wscale, WSCALE_UNKNOWN);
        assert_eq!(ct_entry(&tcp, &e(2)).0.state, common::CT_CLOSING);
        let udp = key(common::PROTO_UDP);
        assert_eq!(ct_entry(&udp, &e(1)).0.state, common::CT_ESTABLISHED);
        assert_eq!(ct_entry(&udp, &e(1)).0.wscale, common::CT_WSCALE_NONE);
        let icmp = key(common::PROTO_ICMP);
        assert_eq!(ct_entry(&icmp, &e(1)), (ct_entry(&icmp, &e(1)).0, CtTable::New));
        assert_eq!(ct_entry(&icmp, &e(1)).0.state, common::CT_REPLIED);
    }

    #[test]
    fn rules_keep_ids_and_snat() {
        let r = DnatRuleV1 { rule_id: 9, backend_count: 2, snat_ifindex: 4, snat_addr: [1, 2, 3, 4], flags: 3 };
        let n = dnat_rule(&r);
        assert_eq!((n.rule_id, n.backend_count, n.snat_ifindex, n.snat_addr, n.flags), (9, 2, 4, [1, 2, 3, 4], 3));
        assert_eq!(n.acl_digest, 0);
    }
}
