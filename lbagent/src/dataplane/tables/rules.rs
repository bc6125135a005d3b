//! Rule maps: DNAT rules and their backends, SNAT (LPM by interface and
//! source), listener ACLs.

use std::{collections::HashSet, net::Ipv4Addr};

use anyhow::Result;
use aya::maps::{LpmTrie, MapData, lpm_trie::Key};
use lbagent_common::*;

use super::Tables;

/// A DNAT rule as the agent describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnatSpec {
    pub zone: u16,
    pub addr: Ipv4Addr,
    /// 0 with port 0: every protocol and port (floating IP).
    pub proto: u8,
    pub port: u16,
    pub rule_id: u32,
    pub backends: Vec<(Ipv4Addr, u16)>,
    /// The rule's own SNAT for new flows no SNAT rule matched (hairpin, load
    /// balancer paths); `None` = none.
    pub snat: Option<RuleSnat>,
    /// Which sources may open new flows through this rule; `None` = all.
    pub acl: Option<AclSpec>,
    /// How new flows pick a backend: `None` = hash over `backends`.
    pub sched: Option<SchedSpec>,
}

/// How a rule's new flows pick a backend (`dataplane/tables/sched.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedSpec {
    pub kind: SchedKind,
    /// `Source`, `Tuple`, `Turn`: `SCHED_TABLE_SIZE` targets (`lb::sched`
    /// builds them); `Least`: empty.
    pub table: std::sync::Arc<Vec<(Ipv4Addr, u16)>>,
    /// `Least`: the weight of each of the rule's backends, in order; empty
    /// for the others.
    pub weights: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedKind {
    /// Maglev by source address.
    Source,
    /// Maglev by 5-tuple.
    Tuple,
    /// In turn (round robin, weighted by the table).
    Turn,
    /// Fewest active flows per weight (no table).
    Least,
}

impl SchedKind {
    pub fn flag(self) -> u32 {
        match self {
            SchedKind::Source => DNAT_F_SCHED_SOURCE,
            SchedKind::Tuple => DNAT_F_SCHED_TUPLE,
            SchedKind::Turn => DNAT_F_SCHED_TURN,
            SchedKind::Least => DNAT_F_SCHED_LEAST,
        }
    }
}

/// A listener's ACL: with `allow`, only sources in `cidrs` open new flows;
/// without, sources in `cidrs` are refused and the rest accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AclSpec {
    pub allow: bool,
    pub cidrs: Vec<(Ipv4Addr, u8)>,
}

impl AclSpec {
    /// The ACL's entries for rule `rule_id` (host bits masked).
    pub fn keys(&self, rule_id: u32) -> Vec<Key<AclKey>> {
        let mut keys: Vec<_> = self
            .cidrs
            .iter()
            .map(|(addr, len)| {
                let masked = u32::from(*addr) & mask(*len);
                Key::new(ACL_KEY_FIXED_BITS + *len as u32, AclKey { rule_id, addr: masked.to_be_bytes() })
            })
            .collect();
        keys.sort_by_key(|k| (k.prefix_len(), k.data().addr));
        keys.dedup_by_key(|k| (k.prefix_len(), k.data().addr));
        keys
    }

    /// Whether a new flow from `saddr` passes, as the program decides it
    /// (`rules::acl_accepts`).
    pub fn accepts(&self, saddr: Ipv4Addr) -> bool {
        let listed = self.cidrs.iter().any(|(net, len)| u32::from(saddr) & mask(*len) == u32::from(*net) & mask(*len));
        listed == self.allow
    }

    /// FNV-1a over the mode and the masked prefixes: equal ACLs, equal digests.
    fn digest(&self) -> u32 {
        let mut h: u32 = 0x811c_9dc5;
        let mut eat = |b: u8| h = (h ^ b as u32).wrapping_mul(0x0100_0193);
        eat(self.allow as u8);
        for k in self.keys(0) {
            eat(k.prefix_len() as u8);
            k.data().addr.iter().for_each(|b| eat(*b));
        }
        h
    }
}

/// See `DnatRule::snat_ifindex`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleSnat {
    /// Only flows arriving on this interface (0 = any).
    pub ifindex: u32,
    /// New source (`None` = the rule's own address).
    pub to: Option<Ipv4Addr>,
    pub random: bool,
}

impl RuleSnat {
    /// The NAT gateway's hairpin: SNAT to the EIP the client asked for.
    pub fn hairpin(ifindex: u32) -> Self {
        RuleSnat { ifindex, to: None, random: true }
    }
}

/// A SNAT rule: source `cidr` arriving on `ifindex` leaves as `to`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnatSpec {
    pub zone: u16,
    pub ifindex: u32,
    pub cidr: (Ipv4Addr, u8),
    pub to: Ipv4Addr,
    pub ports: (u16, u16),
    pub random: bool,
    /// No range was asked for: privileged source ports keep their class
    /// (`SNAT_F_PORT_CLASS`); `ports` is for the others.
    pub port_class: bool,
    pub rule_id: u32,
}

impl DnatSpec {
    /// The map value for this rule.
    pub fn rule(&self) -> DnatRule {
        let (snat_ifindex, snat_addr, flags) = match self.snat {
            None => (0, [0; 4], 0),
            Some(s) => (
                s.ifindex,
                s.to.map(|a| a.octets()).unwrap_or([0; 4]),
                DNAT_F_SNAT | if s.random { DNAT_F_SNAT_RANDOM } else { 0 },
            ),
        };
        let (acl_flags, acl_digest) = match &self.acl {
            None => (0, 0),
            Some(a) => (if a.allow { DNAT_F_ACL_ALLOW } else { DNAT_F_ACL_DENY }, a.digest()),
        };
        DnatRule {
            rule_id: self.rule_id,
            backend_count: self.backends.len() as u32,
            snat_ifindex,
            snat_addr,
            flags: flags | acl_flags | self.sched.as_ref().map_or(0, |s| s.kind.flag()),
            acl_digest,
        }
    }

    pub fn key(&self) -> DnatKey {
        DnatKey { addr: self.addr.octets(), port: self.port, proto: self.proto, _pad0: 0, zone: self.zone, _pad1: 0 }
    }
}

impl SnatSpec {
    /// The map value for this rule.
    pub fn rule(&self) -> SnatRule {
        SnatRule {
            addr: self.to.octets(),
            port_min: self.ports.0,
            port_max: self.ports.1,
            rule_id: self.rule_id,
            flags: if self.random { SNAT_F_RANDOM } else { 0 } | if self.port_class { SNAT_F_PORT_CLASS } else { 0 },
        }
    }

    pub fn key(&self) -> Key<SnatKey> {
        let (addr, len) = self.cidr;
        let masked = u32::from(addr) & mask(len);
        Key::new(
            SNAT_KEY_FIXED_BITS + len as u32,
            SnatKey { zone: self.zone, _pad0: 0, ifindex: self.ifindex, addr: masked.to_be_bytes() },
        )
    }
}

fn mask(len: u8) -> u32 {
    if len == 0 { 0 } else { u32::MAX << (32 - len.min(32)) }
}

impl Tables {
    fn snat_map(&self) -> Result<LpmTrie<MapData, SnatKey, SnatRule>> {
        self.lpm(MAP_SNAT_RULES)
    }

    fn acl_map(&self) -> Result<LpmTrie<MapData, AclKey, u32>> {
        self.lpm(MAP_ACL_RULES)
    }

    /// Every ACL entry: (prefix length, key).
    pub fn acl_entries(&self) -> Result<Vec<(u32, AclKey)>> {
        let map = self.acl_map()?;
        let mut out = Vec::new();
        for item in map.keys() {
            let k = item?;
            out.push((k.prefix_len(), k.data()));
        }
        out.sort_by_key(|(len, k)| (k.rule_id, k.addr, *len));
        Ok(out)
    }

    /// Makes rule `rule_id`'s ACL entries exactly `want`'s keys.
    fn set_acl(&self, rule_id: u32, want: &[Key<AclKey>]) -> Result<()> {
        let mut map = self.acl_map()?;
        for k in want {
            map.insert(k, &1, 0)?;
        }
        for (len, k) in self.acl_entries()? {
            if k.rule_id == rule_id && !want.iter().any(|w| w.prefix_len() == len && w.data() == k) {
                let _ = map.remove(&Key::new(len, k));
            }
        }
        Ok(())
    }

    /// Installs or replaces a DNAT rule. Backends and ACL entries are
    /// written before the rule, so a packet never sees a count larger than
    /// the backends present nor an ACL flag without its entries (an
    /// allow-list fails closed meanwhile); surplus backends of a shrunk rule
    /// are removed afterwards.
    pub fn set_dnat(&self, spec: &DnatSpec) -> Result<()> {
        self.set_dnat_keeping(spec, &HashSet::new())
    }

    /// `set_dnat`, leaving alone what belongs to the rule ids in `in_use`
    /// (rules wanted under other keys): the rule this one replaces under its
    /// key may have moved to another key in the same change (two listeners
    /// that swap ports), and its backends, table and ACL are then its own.
    pub fn set_dnat_keeping(&self, spec: &DnatSpec, in_use: &HashSet<u32>) -> Result<()> {
        let mut rules = self.hash(MAP_DNAT_RULES)?;
        let mut backends = self.hash(MAP_DNAT_BACKENDS)?;
        let old = rules.get(&spec.key(), 0).ok();
        let acl_keys = spec.acl.as_ref().map(|a| a.keys(spec.rule_id)).unwrap_or_default();
        let mut acl = self.acl_map()?;
        for k in &acl_keys {
            acl.insert(k, &1, 0)?;
        }
        for (i, (addr, port)) in spec.backends.iter().enumerate() {
            let b = Backend { addr: addr.octets(), port: *port, _pad0: 0 };
            backends.insert(&BackendKey { rule_id: spec.rule_id, index: i as u32 }, &b, 0)?;
        }
        // This rule id's backends past the new count (they are numbered
        // from 0 without gaps, wherever the rule was before).
        let mut index = spec.backends.len() as u32;
        while backends.remove(&BackendKey { rule_id: spec.rule_id, index }).is_ok() {
            index += 1;
        }
        match &spec.sched {
            Some(s) if s.kind == SchedKind::Least => self.set_least(spec.rule_id, &spec.backends, &s.weights)?,
            Some(s) => {
                self.set_sched_table(spec.rule_id, &s.table)?;
            }
            None => {}
        }
        let rule = spec.rule();
        rules.insert(&spec.key(), &rule, 0)?;
        self.set_acl(spec.rule_id, &acl_keys)?;
        if let Some(old) = old {
            // The old rule's table or counts go unless this rule id keeps
            // the same kind of scheduler, or the old rule lives on elsewhere.
            let same_id = old.rule_id == spec.rule_id;
            let moved = !same_id && in_use.contains(&old.rule_id);
            let table_bits = DNAT_F_SCHED_MASK & !DNAT_F_SCHED_LEAST;
            if !moved && old.flags & table_bits != 0 && !(same_id && rule.flags & table_bits != 0) {
                self.remove_sched_table(old.rule_id)?;
            }
            if !moved && old.flags & DNAT_F_SCHED_LEAST != 0 && !(same_id && rule.flags & DNAT_F_SCHED_LEAST != 0) {
                self.set_least(old.rule_id, &[], &[])?;
            }
            if !same_id && !moved {
                for index in 0..old.backend_count {
                    let _ = backends.remove(&BackendKey { rule_id: old.rule_id, index });
                }
                if old.flags & (DNAT_F_ACL_ALLOW | DNAT_F_ACL_DENY) != 0 {
                    self.set_acl(old.rule_id, &[])?;
                }
            }
        }
        Ok(())
    }

    /// Removes a DNAT rule, its backends and its ACL entries (existing
    /// flows keep their entries).
    pub fn remove_dnat(&self, key: &DnatKey) -> Result<()> {
        self.remove_dnat_keeping(key, &HashSet::new())
    }

    /// `remove_dnat`, removing only the key when its rule id is in `in_use`
    /// (the rule moved to another key: its backends, table and ACL go with it).
    pub fn remove_dnat_keeping(&self, key: &DnatKey, in_use: &HashSet<u32>) -> Result<()> {
        let mut rules = self.hash(MAP_DNAT_RULES)?;
        let mut backends = self.hash(MAP_DNAT_BACKENDS)?;
        if let Ok(old) = rules.get(key, 0) {
            rules.remove(key)?;
            if in_use.contains(&old.rule_id) {
                return Ok(());
            }
            for index in 0..old.backend_count {
                let _ = backends.remove(&BackendKey { rule_id: old.rule_id, index });
            }
            if old.flags & (DNAT_F_ACL_ALLOW | DNAT_F_ACL_DENY) != 0 {
                self.set_acl(old.rule_id, &[])?;
            }
            if old.flags & DNAT_F_SCHED_MASK & !DNAT_F_SCHED_LEAST != 0 {
                self.remove_sched_table(old.rule_id)?;
            }
            if old.flags & DNAT_F_SCHED_LEAST != 0 {
                self.set_least(old.rule_id, &[], &[])?;
            }
        }
        Ok(())
    }

    pub fn set_snat(&self, spec: &SnatSpec) -> Result<()> {
        self.snat_map()?.insert(&spec.key(), &spec.rule(), 0)?;
        Ok(())
    }

    pub fn remove_snat_key(&self, prefix_len: u32, key: SnatKey) -> Result<()> {
        let _ = self.snat_map()?.remove(&Key::new(prefix_len, key));
        Ok(())
    }

    pub fn dnat_rules(&self) -> Result<Vec<(DnatKey, DnatRule, Vec<Backend>)>> {
        let rules = self.hash(MAP_DNAT_RULES)?;
        let backends = self.hash(MAP_DNAT_BACKENDS)?;
        let mut out = Vec::new();
        for item in rules.iter() {
            let (k, r) = item?;
            let bs = (0..r.backend_count)
                .filter_map(|index| backends.get(&BackendKey { rule_id: r.rule_id, index }, 0).ok())
                .collect();
            out.push((k, r, bs));
        }
        out.sort_by_key(|(k, _, _)| (k.zone, k.addr, k.proto, k.port));
        Ok(out)
    }

    /// Every backend slot: (rule id, index, backend).
    pub fn backends(&self) -> Result<Vec<(BackendKey, Backend)>> {
        let map = self.hash(MAP_DNAT_BACKENDS)?;
        let mut out: Vec<_> = map.iter().collect::<Result<_, _>>()?;
        out.sort_by_key(|(k, _)| (k.rule_id, k.index));
        Ok(out)
    }

    pub fn snat_rules(&self) -> Result<Vec<(u32, SnatKey, SnatRule)>> {
        let map = self.snat_map()?;
        let mut out = Vec::new();
        for item in map.iter() {
            let (k, v) = item?;
            out.push((k.prefix_len(), k.data(), v));
        }
        out.sort_by_key(|(len, k, _)| (k.zone, k.ifindex, k.addr, *len));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snat_key_masks_host_bits_and_counts_fixed_prefix() {
        let s = SnatSpec {
            zone: 3,
            ifindex: 7,
            cidr: ("10.1.2.3".parse().unwrap(), 16),
            to: "198.51.100.1".parse().unwrap(),
            ports: (1024, 65535),
            random: true,
            port_class: true,
            rule_id: 1,
        };
        let k = s.key();
        assert_eq!(k.prefix_len(), 64 + 16);
        assert_eq!(k.data().addr, [10, 1, 0, 0]);
        assert_eq!(k.data().ifindex, 7);
        assert_eq!(mask(0), 0);
        assert_eq!(mask(32), u32::MAX);
    }
}
