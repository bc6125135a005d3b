//! Counters: per-CPU drop and event counters, per-rule packets and bytes.

use anyhow::Result;
use aya::maps::{MapData, PerCpuHashMap};
use lbagent_common::*;

use super::Tables;

impl Tables {
    /// Counters summed over CPUs.
    pub fn counters(&self) -> Result<Vec<(Counter, u64)>> {
        let arr = self.per_cpu_array(MAP_COUNTERS)?;
        Counter::ALL.iter().map(|c| Ok((*c, arr.get(&(*c as u32), 0)?.iter().sum()))).collect()
    }

    fn rule_stats_map(&self) -> Result<PerCpuHashMap<MapData, u32, RuleStats>> {
        self.per_cpu_hash(MAP_RULE_STATS)
    }

    /// Packets and bytes per rule id, summed over CPUs.
    pub fn rule_stats(&self) -> Result<Vec<(u32, RuleStats)>> {
        let map = self.rule_stats_map()?;
        let mut out = Vec::new();
        for item in map.iter() {
            let (id, per_cpu) = item?;
            let sum = per_cpu.iter().fold(RuleStats::default(), |a, v| RuleStats {
                packets: a.packets + v.packets,
                bytes: a.bytes + v.bytes,
                refused: a.refused + v.refused,
            });
            out.push((id, sum));
        }
        out.sort_by_key(|(id, _)| *id);
        Ok(out)
    }

    /// Drops the statistics of released rule ids (ids are reused).
    pub fn forget_rule_stats(&self, ids: &[u32]) -> Result<()> {
        let mut map = self.rule_stats_map()?;
        for id in ids {
            let _ = map.remove(id);
        }
        Ok(())
    }

    pub fn counter(&self, c: Counter) -> Result<u64> {
        Ok(self.counters()?.into_iter().find(|(k, _)| *k == c).map(|(_, v)| v).unwrap_or(0))
    }
}
