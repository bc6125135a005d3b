//! The SNAT port census: the source ports (ICMP echo ids) that live SNAT'ed
//! flows hold, read from both conntrack tables in one pass.
//!
//! A translated tuple is unique per destination, so one port serves many
//! flows to different destinations; a rule runs out of ports toward one
//! destination when every port of its range is held toward it. The census
//! counts each rule's flows and, for each external address, the distinct
//! ports its flows hold (a bitmap of 8 KiB per address and protocol while
//! the pass runs).

use std::{
    collections::{BTreeMap, HashMap},
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
    /// External address → the distinct ports its SNAT'ed flows hold.
    pub addr_ports: BTreeMap<Ipv4Addr, PerProto>,
}

/// Counts a census entry by entry, from a dump that also serves others
/// ([`Tables::recount_zone_flows_and`]).
#[derive(Default)]
pub struct PortCounter {
    census: PortCensus,
    held: HashMap<(Ipv4Addr, u8), Box<[u64; 1024]>>,
}

impl PortCounter {
    /// Counts one conntrack entry: a SNAT'ed flow counts once (its
    /// original half), whatever its state, until it is freed.
    pub fn add(&mut self, k: &Tuple, e: &CtEntry) {
        if e.flags & CT_F_REPLY != 0 || e.flags & CT_F_SNAT == 0 || e.snat_rule == 0 {
            return;
        }
        let Some(n) = self.census.rule_flows.entry(e.snat_rule).or_default().slot(k.proto) else { return };
        *n += 1;
        let bits = self.held.entry((Ipv4Addr::from(e.xlate.saddr), k.proto)).or_insert_with(|| Box::new([0; 1024]));
        let port = e.xlate.sport as usize;
        bits[port / 64] |= 1 << (port % 64);
    }

    pub fn finish(self) -> PortCensus {
        let mut census = self.census;
        for ((addr, proto), bits) in self.held {
            if let Some(n) = census.addr_ports.entry(addr).or_default().slot(proto) {
                *n = bits.iter().map(|w| u64::from(w.count_ones())).sum();
            }
        }
        census
    }
}

impl Tables {
    /// The census on a dump of its own (both tables).
    pub fn port_census(&self) -> Result<PortCensus> {
        let mut counter = PortCounter::default();
        for table in [MAP_CT, MAP_CT_NEW] {
            self.each_conntrack(table, |keys, entries| keys.iter().zip(entries).for_each(|(k, e)| counter.add(k, e)))?;
        }
        Ok(counter.finish())
    }
}
