//! Rule lookups for new flows: DNAT by exact key (then address-wide), SNAT by
//! longest source prefix on the interface the flow leaves by (`route`).

use aya_ebpf::btf_maps::lpm_trie::Key;
use lbagent_common::*;

use crate::{
    hash::flow_hash,
    maps::{ACL_RULES, DNAT_BACKENDS, DNAT_RULES, SNAT_RULES},
    parse::Packet,
};

/// The chosen DNAT target and the rule id.
pub struct DnatHit {
    pub backend: Backend,
    pub rule: DnatRule,
}

/// The DNAT rule for a new flow: by (address, protocol, port), then
/// address-wide. `has_ports` is false for address-only packets (ICMP, GRE,
/// ...), which match a rule with port 0.
#[inline(always)]
pub fn dnat(t: &Tuple, has_ports: bool) -> Option<DnatHit> {
    let port = if has_ports { t.dport } else { 0 };
    let mut key = DnatKey { addr: t.daddr, port, proto: t.proto, _pad0: 0, zone: t.zone, _pad1: 0 };
    // SAFETY: map values are plain data, copied out at once.
    let rule = match unsafe { DNAT_RULES.get(&key) } {
        Some(r) => *r,
        None => {
            key.port = 0;
            key.proto = 0;
            // SAFETY: as above.
            *unsafe { DNAT_RULES.get(&key) }?
        }
    };
    // A local copy: the divisor below must stay provably non-zero after
    // the scheduler's map lookups (which take pointers to locals).
    let count = rule.backend_count;
    if count == 0 {
        return None;
    }
    let backend = crate::sched::pick(&rule, t);
    if backend.addr != [0; 4] {
        return Some(DnatHit { backend, rule });
    }
    let index = flow_hash(t) % count;
    // SAFETY: as above.
    let backend = *unsafe { DNAT_BACKENDS.get(&BackendKey { rule_id: rule.rule_id, index }) }?;
    Some(DnatHit { backend, rule })
}

/// Whether the rule's ACL (if any) accepts a new flow from `saddr`.
#[inline(always)]
pub fn acl_accepts(rule: &DnatRule, saddr: [u8; 4]) -> bool {
    if rule.flags & (DNAT_F_ACL_ALLOW | DNAT_F_ACL_DENY) == 0 {
        return true;
    }
    let key = Key::new(ACL_KEY_FIXED_BITS + 32, AclKey { rule_id: rule.rule_id, addr: saddr });
    let listed = ACL_RULES.get(&key).is_some();
    if rule.flags & DNAT_F_ACL_ALLOW != 0 { listed } else { !listed }
}

/// Whether a DNAT rule with backends would translate a new flow of `t`,
/// without picking a backend: by port, by protocol alone (an address-only
/// protocol's rule), then address-wide — the keys `dnat` tries, whether or
/// not the packet has ports (an address-only rule's port is 0, so the first
/// step cannot match for it). Not shared with `dnat`: a common lookup
/// costs the ingress program stack that Linux 5.10's 512 bytes do not have.
#[inline(always)]
pub fn dnat_applies(t: &Tuple) -> bool {
    let mut key = DnatKey { addr: t.daddr, port: t.dport, proto: t.proto, _pad0: 0, zone: t.zone, _pad1: 0 };
    for step in 0..3 {
        if step == 1 {
            key.port = 0;
        } else if step == 2 {
            key.proto = 0;
        }
        // SAFETY: map values are plain data, read at once.
        if let Some(r) = unsafe { DNAT_RULES.get(&key) } {
            return r.backend_count > 0;
        }
    }
    false
}

/// Whether `addr` has an address-wide DNAT rule (a floating IP).
#[inline(always)]
pub fn address_wide_dnat(zone: u16, addr: [u8; 4]) -> bool {
    let key = DnatKey { addr, port: 0, proto: 0, _pad0: 0, zone, _pad1: 0 };
    // SAFETY: only checks presence; the value is not read.
    unsafe { DNAT_RULES.get(&key) }.is_some()
}

/// The SNAT rule for packet `p`'s source leaving by `ifindex`, with the
/// port range its flow takes: a rule without a range asked for
/// (`SNAT_F_PORT_CLASS`) keeps a privileged source port in its class
/// (below 512: 1–511; 512–1023: 600–1023), as Linux NAT does.
#[inline(always)]
pub fn snat(p: &Packet, ifindex: u32) -> Option<SnatRule> {
    let t = &p.tuple;
    let key = Key::new(SNAT_KEY_FIXED_BITS + 32, SnatKey { zone: t.zone, _pad0: 0, ifindex, addr: t.saddr });
    let s = SNAT_RULES.get(&key)?;
    if s.flags & SNAT_F_PORT_CLASS != 0 && p.has_ports() && t.sport < PRIVILEGED_PORT_END {
        let (port_min, port_max) = if t.sport < 512 { (1, 511) } else { (600, 1023) };
        return Some(SnatRule { port_min, port_max, ..*s });
    }
    Some(*s)
}

/// Ports below this are privileged (`SNAT_F_PORT_CLASS`).
const PRIVILEGED_PORT_END: u16 = 1024;
