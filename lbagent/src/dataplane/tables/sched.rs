//! Scheduler tables (`sched_tables`; layout in `lbagent_common::sched`, the
//! program's side in `lbagent-ebpf/src/sched.rs`): a rule's table is
//! written into a fresh inner array and swapped in with one update of the
//! outer map, so no packet sees a half-written table. The digest slot lets
//! the agent skip rewriting a table that has not changed. Least-connection
//! rules have no table: their backends' weights and active-flow counts are
//! in `sched_active`, recounted from conntrack on every repair pass.

use std::net::Ipv4Addr;

use anyhow::Result;
use aya::maps::{Array, HashOfMaps, MapData, MapError};
use lbagent_common::*;
use std::collections::BTreeMap;

use super::Tables;

type Outer = HashOfMaps<MapData, u32, Array<MapData, Backend>>;

fn backend((addr, port): (Ipv4Addr, u16)) -> Backend {
    Backend { addr: addr.octets(), port, _pad0: 0 }
}

/// The digest slot's value.
fn digest_slot(digest: u64) -> Backend {
    Backend { addr: (digest as u32).to_ne_bytes(), port: (digest >> 32) as u16, _pad0: (digest >> 48) as u16 }
}

fn digest_of(b: &Backend) -> u64 {
    u32::from_ne_bytes(b.addr) as u64 | (b.port as u64) << 32 | (b._pad0 as u64) << 48
}

/// A digest of a table (FNV-1a over its entries).
pub fn table_digest(table: &[(Ipv4Addr, u16)]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for (a, p) in table {
        for b in a.octets().into_iter().chain(p.to_be_bytes()) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl Tables {
    fn sched_map(&self) -> Result<Outer> {
        self.hash_of_maps(MAP_SCHED_TABLES)
    }

    /// The digest of rule `rule_id`'s installed table, if it has one.
    pub fn sched_digest(&self, rule_id: u32) -> Result<Option<u64>> {
        match self.sched_map()?.get(&rule_id, 0) {
            Ok(inner) => Ok(Some(digest_of(&inner.get(&SCHED_DIGEST_SLOT, 0)?))),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Installs `table` (`SCHED_TABLE_SIZE` targets) as rule `rule_id`'s,
    /// unless the installed one has the same digest; returns whether it
    /// wrote. The new table is complete before it becomes visible.
    pub fn set_sched_table(&self, rule_id: u32, table: &[(Ipv4Addr, u16)]) -> Result<bool> {
        anyhow::ensure!(table.len() == SCHED_TABLE_SIZE as usize, "a scheduler table has {SCHED_TABLE_SIZE} slots");
        let digest = table_digest(table);
        if self.sched_digest(rule_id)? == Some(digest) {
            return Ok(false);
        }
        let mut inner: Array<MapData, Backend> = Array::create(SCHED_TABLE_LEN, 0)?;
        for (i, t) in table.iter().enumerate() {
            inner.set(i as u32, &backend(*t), 0)?;
        }
        inner.set(SCHED_DIGEST_SLOT, &digest_slot(digest), 0)?;
        self.sched_map()?.insert(&rule_id, &inner, 0)?;
        Ok(true)
    }

    /// Removes rule `rule_id`'s table (no-op without one).
    pub fn remove_sched_table(&self, rule_id: u32) -> Result<()> {
        match self.sched_map()?.remove(&rule_id) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Rule `rule_id`'s installed table (without the digest slot).
    pub fn sched_table(&self, rule_id: u32) -> Result<Option<Vec<(Ipv4Addr, u16)>>> {
        let inner = match self.sched_map()?.get(&rule_id, 0) {
            Ok(inner) => inner,
            Err(MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let mut out = Vec::with_capacity(SCHED_TABLE_SIZE as usize);
        for i in 0..SCHED_TABLE_SIZE {
            let b = inner.get(&i, 0)?;
            out.push((Ipv4Addr::from(b.addr), b.port));
        }
        Ok(Some(out))
    }

    /// Round-robin positions: (rule id, position on each CPU).
    pub fn sched_turns(&self) -> Result<Vec<(u32, Vec<u32>)>> {
        let map = self.per_cpu_hash(MAP_SCHED_TURNS)?;
        let mut out = Vec::new();
        for item in map.iter() {
            let (k, v) = item?;
            out.push((k, v.iter().copied().collect()));
        }
        out.sort();
        Ok(out)
    }

    /// Makes least-connection rule `rule_id`'s `sched_active` entries
    /// exactly `backends` with `weights` (active counts of backends that
    /// stay are kept; new ones start at 0). Empty `backends`: removes them.
    pub fn set_least(&self, rule_id: u32, backends: &[(Ipv4Addr, u16)], weights: &[u32]) -> Result<()> {
        anyhow::ensure!(backends.len() == weights.len(), "one weight per backend");
        let mut map = self.hash(MAP_SCHED_ACTIVE)?;
        let key = |(a, p): (Ipv4Addr, u16)| ActiveKey { rule_id, addr: a.octets(), port: p, _pad0: 0 };
        for (b, w) in backends.iter().zip(weights) {
            let k = key(*b);
            let active = map.get(&k, 0).map(|v| v.active).unwrap_or(0);
            map.insert(&k, &Active { active, weight: *w, _pad0: 0 }, 0)?;
        }
        let stale: Vec<ActiveKey> = map
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| k.rule_id == rule_id && !backends.iter().any(|b| key(*b) == *k))
            .collect();
        for k in stale {
            let _ = map.remove(&k);
        }
        Ok(())
    }

    /// The weights `sched_active` holds for `backends` of rule `rule_id`
    /// (0 for a backend without an entry).
    pub fn least_weights(&self, rule_id: u32, backends: &[(Ipv4Addr, u16)]) -> Result<Vec<u32>> {
        let map = self.hash(MAP_SCHED_ACTIVE)?;
        Ok(backends
            .iter()
            .map(|(a, p)| {
                map.get(&ActiveKey { rule_id, addr: a.octets(), port: *p, _pad0: 0 }, 0).map_or(0, |v| v.weight)
            })
            .collect())
    }

    /// Every `sched_active` entry, sorted.
    pub fn least_entries(&self) -> Result<Vec<(ActiveKey, Active)>> {
        let map = self.hash(MAP_SCHED_ACTIVE)?;
        let mut out = map.iter().collect::<Result<Vec<_>, _>>()?;
        out.sort_by_key(|(k, _)| *k);
        Ok(out)
    }

    /// Recounts every least-connection backend's active flows from
    /// conntrack (flows not closing, by their DNAT rule and translated
    /// destination) and writes the counts the program's adds drifted from
    /// (flows that timed out or were evicted never said goodbye). Returns
    /// how many counts it corrected.
    pub fn recount_active(&self) -> Result<usize> {
        let entries = self.least_entries()?;
        if entries.is_empty() {
            return Ok(0);
        }
        let rules: std::collections::BTreeSet<u32> = entries.iter().map(|(k, _)| k.rule_id).collect();
        let mut counts: BTreeMap<ActiveKey, i64> = BTreeMap::new();
        for table in [MAP_CT, MAP_CT_NEW] {
            self.each_conntrack(table, |_, entries| {
                for e in entries {
                    if e.flags & CT_F_REPLY == 0 && e.state != CT_CLOSING && rules.contains(&e.dnat_rule) {
                        let k = ActiveKey { rule_id: e.dnat_rule, addr: e.xlate.daddr, port: e.xlate.dport, _pad0: 0 };
                        *counts.entry(k).or_default() += 1;
                    }
                }
            })?;
        }
        let mut map = self.hash(MAP_SCHED_ACTIVE)?;
        let mut fixed = 0;
        for (k, _) in entries {
            let want = counts.get(&k).copied().unwrap_or(0);
            // The entry as it is now, not as read before the scan: the
            // daemon recounts beside its applies, which may have changed
            // the backend's weight or removed the rule since (a removed
            // rule is not brought back: `BPF_EXIST`). What lands between
            // this read and the write (the program's add, an apply's) is
            // lost until the next recount, as the program's adds always were.
            let Ok(now) = map.get(&k, 0) else { continue };
            if now.active != want && map.insert(&k, &Active { active: want, ..now }, super::EXIST).is_ok() {
                fixed += 1;
            }
        }
        Ok(fixed)
    }

    /// Rule ids that have a table.
    pub fn sched_rules(&self) -> Result<Vec<u32>> {
        Ok(self.sched_map()?.keys().collect::<Result<Vec<_>, _>>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_slot_round_trips() {
        for d in [0u64, 1, u64::MAX, 0x0123_4567_89ab_cdef] {
            assert_eq!(digest_of(&digest_slot(d)), d);
        }
    }
}
