//! The SNAT port census: the source ports (ICMP echo ids) that live SNAT'ed
//! flows hold, read from both conntrack tables in one pass.
//!
//! A translated tuple is unique per destination, so one port serves many
//! flows to different destinations; a rule runs out of ports toward one
//! destination when every port of its range is held toward it. The census
//! counts each rule's flows and, for each rule and each EIP, the distinct
//! ports its flows hold.
//!
//! Memory: 12 bytes per rule counted and 8 per SNAT'ed flow while the pass
//! runs (one packed word per flow, sorted twice at the end: by EIP, then by
//! rule), whatever the spread of flows over rules; a set per rule cost
//! ~26 bytes per flow and ~100 per rule.

use std::net::Ipv4Addr;

use anyhow::Result;
use lbagent_common::*;
use serde::{Deserialize, Serialize};

use super::Tables;

/// A count for each protocol that holds ports: TCP, UDP, and ICMP (echo
/// ids). Address-only protocols hold none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PerProto {
    pub tcp: u32,
    pub udp: u32,
    pub icmp: u32,
}

impl PerProto {
    fn slot(&mut self, proto: u8) -> Option<&mut u32> {
        match proto {
            PROTO_TCP => Some(&mut self.tcp),
            PROTO_UDP => Some(&mut self.udp),
            PROTO_ICMP => Some(&mut self.icmp),
            _ => None,
        }
    }

    /// The largest of the three.
    pub fn max(&self) -> u64 {
        u64::from(self.tcp.max(self.udp).max(self.icmp))
    }

    /// The sum of the three.
    pub fn total(&self) -> u64 {
        u64::from(self.tcp) + u64::from(self.udp) + u64::from(self.icmp)
    }

    /// Each protocol by its name, as metrics label it.
    pub fn by_name(&self) -> [(&'static str, u64); 3] {
        [("tcp", self.tcp.into()), ("udp", self.udp.into()), ("icmp", self.icmp.into())]
    }
}

/// The protocols that hold ports, in the order of [`PerProto`]'s fields.
const PROTOS: [u8; 3] = [PROTO_TCP, PROTO_UDP, PROTO_ICMP];

/// What the census found for one SNAT rule with flows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleCount {
    pub id: u32,
    /// Its live flows.
    pub flows: PerProto,
    /// The distinct ports its flows hold.
    pub ports: PerProto,
}

/// What the census found: only rules and EIPs with flows, each sorted
/// (rules by id, EIPs by address).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PortCensus {
    pub rules: Vec<RuleCount>,
    /// An EIP → the distinct ports its SNAT'ed flows hold.
    pub eips: Vec<(Ipv4Addr, PerProto)>,
}

impl PortCensus {
    /// The count of rule `id`, if it has flows.
    pub fn rule(&self, id: u32) -> Option<&RuleCount> {
        self.rules.binary_search_by_key(&id, |r| r.id).ok().map(|i| &self.rules[i])
    }

    /// The ports EIP `ip` holds, if its SNAT'ed flows hold any.
    pub fn eip(&self, ip: Ipv4Addr) -> Option<PerProto> {
        self.eips.binary_search_by_key(&ip, |e| e.0).ok().map(|i| self.eips[i].1)
    }
}

/// One SNAT'ed flow packed in a word, in two orders: by EIP
/// (`eip | proto | port | rule`), then by rule (`rule | proto | port |
/// eip`); sorting the words groups the distinct ports of each.
mod packed {
    pub const RULE_BITS: u32 = 22;
    pub const EIP_BITS: u32 = 24;
    /// The index of an address that is no EIP counted.
    pub const NO_EIP: u64 = (1 << EIP_BITS) - 1;
    const RULE_MASK: u64 = (1 << RULE_BITS) - 1;
    /// Protocol index (2 bits) and port (16 bits).
    const SLOT_MASK: u64 = (1 << 18) - 1;

    pub fn by_eip(rule: u64, eip: u64, slot: u64) -> u64 {
        eip << (64 - EIP_BITS) | slot << RULE_BITS | rule
    }

    /// (eip, proto and port) of a word by EIP.
    pub fn eip_slot(w: u64) -> (u64, u64) {
        (w >> (64 - EIP_BITS), w >> RULE_BITS & SLOT_MASK)
    }

    /// The same flow, by rule.
    pub fn to_by_rule(w: u64) -> u64 {
        let (eip, slot) = eip_slot(w);
        (w & RULE_MASK) << (64 - RULE_BITS) | slot << EIP_BITS | eip
    }

    /// (rule, proto and port) of a word by rule.
    pub fn rule_slot(w: u64) -> (u64, u64) {
        (w >> (64 - RULE_BITS), w >> EIP_BITS & SLOT_MASK)
    }
}

/// Counts a census entry by entry, from a dump that also serves others
/// ([`Tables::recount_zone_flows_and`]).
pub struct PortCounter {
    /// The rules counted, sorted: CIDR SNAT rules (a FIP's 1:1 SNAT keeps
    /// the client's ports, a listener's own SNAT has no EIP).
    rules: Vec<u32>,
    /// The EIPs counted, sorted.
    eips: Vec<Ipv4Addr>,
    /// Flows of each rule, by its index in `rules`.
    flows: Vec<PerProto>,
    /// One word per flow counted (`packed::by_eip`).
    words: Vec<u64>,
}

impl PortCounter {
    /// A census of the flows of `rules` (SNAT rule ids) and of the ports of
    /// `eips`, expecting about `flows` SNAT'ed flows (the last census's: the
    /// buffer is sized once).
    pub fn new(rules: impl IntoIterator<Item = u32>, eips: impl IntoIterator<Item = Ipv4Addr>, flows: usize) -> Self {
        let mut rules: Vec<u32> = rules.into_iter().collect();
        rules.sort_unstable();
        rules.dedup();
        rules.truncate(1 << packed::RULE_BITS);
        let mut eips: Vec<Ipv4Addr> = eips.into_iter().collect();
        eips.sort_unstable();
        eips.dedup();
        eips.truncate(packed::NO_EIP as usize);
        let flows_per_rule = vec![PerProto::default(); rules.len()];
        PortCounter { rules, eips, flows: flows_per_rule, words: Vec::with_capacity(flows + flows / 8) }
    }

    /// Counts one conntrack entry: a flow of one of the rules counts once
    /// (its original half), whatever its state, until it is freed.
    pub fn add(&mut self, k: &Tuple, e: &CtEntry) {
        if e.flags & CT_F_REPLY != 0 || e.flags & CT_F_SNAT == 0 {
            return;
        }
        let Some(proto) = PROTOS.iter().position(|p| *p == k.proto) else { return };
        let Ok(rule) = self.rules.binary_search(&e.snat_rule) else { return };
        if let Some(n) = self.flows[rule].slot(k.proto) {
            *n += 1;
        }
        let eip = self.eips.binary_search(&Ipv4Addr::from(e.xlate.saddr)).map_or(packed::NO_EIP, |i| i as u64);
        let slot = (proto as u64) << 16 | u64::from(e.xlate.sport);
        self.words.push(packed::by_eip(rule as u64, eip, slot));
    }

    pub fn finish(self) -> PortCensus {
        let PortCounter { rules, eips, flows, mut words } = self;
        /// Counts each distinct (owner, slot) once, in owner order.
        fn distinct(words: &[u64], key: fn(u64) -> (u64, u64), mut count: impl FnMut(u64, u8)) {
            let mut last = None;
            for &w in words {
                let (owner, slot) = key(w);
                if last != Some((owner, slot)) {
                    last = Some((owner, slot));
                    count(owner, PROTOS[(slot >> 16) as usize]);
                }
            }
        }
        words.sort_unstable();
        let mut by_eip: Vec<(Ipv4Addr, PerProto)> = Vec::new();
        distinct(&words, packed::eip_slot, |eip, proto| {
            if eip == packed::NO_EIP {
                return;
            }
            let ip = eips[eip as usize];
            if by_eip.last().is_none_or(|l| l.0 != ip) {
                by_eip.push((ip, PerProto::default()));
            }
            if let Some(n) = by_eip.last_mut().and_then(|l| l.1.slot(proto)) {
                *n += 1;
            }
        });
        words.iter_mut().for_each(|w| *w = packed::to_by_rule(*w));
        words.sort_unstable();
        let mut ports = vec![PerProto::default(); rules.len()];
        distinct(&words, packed::rule_slot, |rule, proto| {
            if let Some(n) = ports[rule as usize].slot(proto) {
                *n += 1;
            }
        });
        drop(words);
        let rules = rules
            .iter()
            .zip(flows.iter().zip(&ports))
            .filter(|(_, (f, _))| **f != PerProto::default())
            .map(|(id, (flows, ports))| RuleCount { id: *id, flows: *flows, ports: *ports })
            .collect();
        PortCensus { rules, eips: by_eip }
    }
}

impl Tables {
    /// The census of the flows of `rules` and the ports of `eips`, on a
    /// dump of its own (both tables).
    pub fn port_census(
        &self,
        rules: impl IntoIterator<Item = u32>,
        eips: impl IntoIterator<Item = Ipv4Addr>,
    ) -> Result<PortCensus> {
        let mut counter = PortCounter::new(rules, eips, 0);
        for table in [MAP_CT, MAP_CT_NEW] {
            self.each_conntrack(table, |keys, entries| keys.iter().zip(entries).for_each(|(k, e)| counter.add(k, e)))?;
        }
        Ok(counter.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(rule: u32, eip: [u8; 4], proto: u8, port: u16, dest: u8) -> (Tuple, CtEntry) {
        let k = Tuple {
            saddr: [10, 0, 0, 1],
            daddr: [198, 51, 100, dest],
            sport: 5000,
            dport: 443,
            proto,
            ..Default::default()
        };
        let xlate = Tuple { saddr: eip, sport: port, ..k };
        (k, CtEntry { xlate, snat_rule: rule, flags: CT_F_SNAT, ..Default::default() })
    }

    #[test]
    fn distinct_ports_by_rule_and_by_eip() {
        let (a, b) = ([100, 64, 0, 1], [100, 64, 0, 2]);
        let mut c = PortCounter::new([7, 3, 9], [Ipv4Addr::from(b), Ipv4Addr::from(a)], 4);
        let flows = [
            // Rule 3 on EIP a: port 1024 toward two destinations, 1025 once; UDP 1024.
            flow(3, a, PROTO_TCP, 1024, 1),
            flow(3, a, PROTO_TCP, 1024, 2),
            flow(3, a, PROTO_TCP, 1025, 1),
            flow(3, a, PROTO_UDP, 1024, 1),
            // Rule 7 shares EIP a's port 1025 (another destination) and uses b.
            flow(7, a, PROTO_TCP, 1025, 3),
            flow(7, b, PROTO_ICMP, 9, 1),
            // Not counted: an unknown rule, a reply half, an address that is no EIP.
            flow(8, a, PROTO_TCP, 2000, 1),
            flow(9, [192, 0, 2, 1], PROTO_TCP, 2000, 1),
        ];
        for (k, e) in &flows {
            c.add(k, e);
        }
        let (k, e) = flow(3, a, PROTO_TCP, 3000, 1);
        c.add(&k, &CtEntry { flags: CT_F_SNAT | CT_F_REPLY, ..e });
        let census = c.finish();
        let r3 = census.rule(3).unwrap();
        assert_eq!((r3.flows, r3.ports), (PerProto { tcp: 3, udp: 1, icmp: 0 }, PerProto { tcp: 2, udp: 1, icmp: 0 }));
        let r7 = census.rule(7).unwrap();
        assert_eq!((r7.flows, r7.ports), (PerProto { tcp: 1, udp: 0, icmp: 1 }, PerProto { tcp: 1, udp: 0, icmp: 1 }));
        let r9 = census.rule(9).unwrap();
        assert_eq!((r9.flows.tcp, r9.ports.tcp), (1, 1), "counted by rule, not by EIP");
        assert!(census.rule(8).is_none());
        assert_eq!(census.rules.len(), 3);
        assert_eq!(census.eip(Ipv4Addr::from(a)), Some(PerProto { tcp: 2, udp: 1, icmp: 0 }), "1025 held by two rules");
        assert_eq!(census.eip(Ipv4Addr::from(b)), Some(PerProto { tcp: 0, udp: 0, icmp: 1 }));
        assert_eq!(census.eips.len(), 2);
    }

    #[test]
    fn a_whole_range_of_ports_counts_once_each() {
        let a = [100, 64, 0, 1];
        let mut c = PortCounter::new([1], [Ipv4Addr::from(a)], 0);
        for port in 1024..=65535u16 {
            for dest in [1, 2] {
                let (k, e) = flow(1, a, PROTO_UDP, port, dest);
                c.add(&k, &e);
            }
        }
        let census = c.finish();
        assert_eq!((census.rules[0].flows.udp, census.rules[0].ports.udp), (2 * 64512, 64512));
        assert_eq!(census.eip(Ipv4Addr::from(a)).unwrap().udp, 64512);
    }
}
