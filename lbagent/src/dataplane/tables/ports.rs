//! The SNAT port census: the source ports (ICMP echo ids) that live SNAT'ed
//! flows hold, read from both conntrack tables in one pass.
//!
//! A translated tuple is unique per destination, so one port serves many
//! flows to different destinations; a rule runs out of ports toward one
//! destination when every port of its range is held toward it. The census
//! counts each rule's flows and, for each rule and each external address,
//! the distinct ports its flows hold (while the pass runs: a set, or a
//! bitmap of 8 KiB per rule or address and protocol once it holds more
//! than 1 024 ports).

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::Ipv4Addr,
};

use anyhow::Result;
use lbagent_common::*;
use serde::{Deserialize, Serialize};

use super::Tables;

/// A count for each protocol that holds ports: TCP, UDP, and ICMP (echo
/// ids). Address-only protocols hold none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PerProto {
    pub tcp: u64,
    pub udp: u64,
    pub icmp: u64,
}

impl PerProto {
    fn slot(&mut self, proto: u8) -> Option<&mut u64> {
        match proto {
            PROTO_TCP => Some(&mut self.tcp),
            PROTO_UDP => Some(&mut self.udp),
            PROTO_ICMP => Some(&mut self.icmp),
            _ => None,
        }
    }

    /// The largest of the three.
    pub fn max(&self) -> u64 {
        self.tcp.max(self.udp).max(self.icmp)
    }

    /// Each protocol by its name, as metrics label it.
    pub fn by_name(&self) -> [(&'static str, u64); 3] {
        [("tcp", self.tcp), ("udp", self.udp), ("icmp", self.icmp)]
    }
}

/// What the census found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PortCensus {
    /// SNAT rule id → its live flows.
    pub rule_flows: BTreeMap<u32, PerProto>,
    /// SNAT rule id → the distinct ports its flows hold.
    pub rule_ports: BTreeMap<u32, PerProto>,
    /// External address → the distinct ports its SNAT'ed flows hold.
    pub addr_ports: BTreeMap<Ipv4Addr, PerProto>,
}

/// Distinct ports: a small set while few, a 64 Ki-bit map (8 KiB) past
/// [`PortSet::FEW`], so a rule or address costs at most 8 KiB per protocol
/// and the census at most a few bytes per flow.
enum PortSet {
    Few(HashSet<u16>),
    Many(Box<[u64; 1024]>),
}

impl PortSet {
    const FEW: usize = 1024;

    fn insert(&mut self, port: u16) {
        match self {
            PortSet::Few(set) => {
                set.insert(port);
                if set.len() > Self::FEW {
                    let mut bits = Box::new([0u64; 1024]);
                    for p in set.drain() {
                        bits[p as usize / 64] |= 1 << (p % 64);
                    }
                    *self = PortSet::Many(bits);
                }
            }
            PortSet::Many(bits) => bits[port as usize / 64] |= 1 << (port % 64),
        }
    }

    fn len(&self) -> u64 {
        match self {
            PortSet::Few(set) => set.len() as u64,
            PortSet::Many(bits) => bits.iter().map(|w| u64::from(w.count_ones())).sum(),
        }
    }
}

/// Counts a census entry by entry, from a dump that also serves others
/// ([`Tables::recount_zone_flows_and`]).
pub struct PortCounter {
    /// The rules counted: CIDR SNAT rules (a FIP's 1:1 SNAT keeps the
    /// client's ports, a listener's own SNAT has no EIP).
    rules: HashSet<u32>,
    flows: BTreeMap<u32, PerProto>,
    by_rule: HashMap<(u32, u8), PortSet>,
    by_addr: HashMap<(Ipv4Addr, u8), PortSet>,
}

impl PortCounter {
    /// A census of the flows of `rules` (SNAT rule ids).
    pub fn new(rules: HashSet<u32>) -> Self {
        PortCounter { rules, flows: BTreeMap::new(), by_rule: HashMap::new(), by_addr: HashMap::new() }
    }

    /// Counts one conntrack entry: a flow of one of the rules counts once
    /// (its original half), whatever its state, until it is freed.
    pub fn add(&mut self, k: &Tuple, e: &CtEntry) {
        if e.flags & CT_F_REPLY != 0 || e.flags & CT_F_SNAT == 0 || !self.rules.contains(&e.snat_rule) {
            return;
        }
        if !matches!(k.proto, PROTO_TCP | PROTO_UDP | PROTO_ICMP) {
            return;
        }
        if let Some(n) = self.flows.entry(e.snat_rule).or_default().slot(k.proto) {
            *n += 1;
        }
        let few = || PortSet::Few(HashSet::new());
        let port = e.xlate.sport;
        self.by_rule.entry((e.snat_rule, k.proto)).or_insert_with(few).insert(port);
        self.by_addr.entry((Ipv4Addr::from(e.xlate.saddr), k.proto)).or_insert_with(few).insert(port);
    }

    pub fn finish(self) -> PortCensus {
        fn count<K: Ord + Copy>(sets: HashMap<(K, u8), PortSet>) -> BTreeMap<K, PerProto> {
            let mut out: BTreeMap<K, PerProto> = BTreeMap::new();
            for ((key, proto), set) in sets {
                if let Some(n) = out.entry(key).or_default().slot(proto) {
                    *n = set.len();
                }
            }
            out
        }
        PortCensus { rule_flows: self.flows, rule_ports: count(self.by_rule), addr_ports: count(self.by_addr) }
    }
}

impl Tables {
    /// The census of the flows of `rules` on a dump of its own (both
    /// tables).
    pub fn port_census(&self, rules: HashSet<u32>) -> Result<PortCensus> {
        let mut counter = PortCounter::new(rules);
        for table in [MAP_CT, MAP_CT_NEW] {
            self.each_conntrack(table, |keys, entries| keys.iter().zip(entries).for_each(|(k, e)| counter.add(k, e)))?;
        }
        Ok(counter.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_set_counts_distinct_ports_small_and_large() {
        let mut set = PortSet::Few(HashSet::new());
        for p in [80, 80, 443] {
            set.insert(p);
        }
        assert_eq!(set.len(), 2);
        for p in 1000..=65535u16 {
            set.insert(p);
            set.insert(p);
        }
        assert!(matches!(set, PortSet::Many(_)));
        assert_eq!(set.len(), 64536 + 2);
    }
}
