//! The QoS maps from the agent's side (the program's half is
//! `lbagent-ebpf/src/qos.rs`, the layouts `lbagent_common::qos`): a zone's
//! hooks, EIP rules and buckets made equal to a desired set, touching only
//! what differs.
//!
//! Order keeps every packet consistent: a new bucket's config and state
//! exist before any hook or EIP entry points at it; entries stop pointing at
//! a bucket before it goes. A bucket's state is created once and never
//! rewritten (a rate change replaces only its config, so the bucket keeps
//! its clock and no flow sees a reset).

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;
use aya::maps::{Array, Map, MapError, PerCpuHashMap, PerCpuValues};
use lbagent_common::*;

use super::tables::Tables;

/// One zone's QoS entries as the program reads them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QosZone {
    /// (ifindex, direction) → the hook's ladder.
    pub hooks: BTreeMap<(u32, u8), QosHook>,
    /// (EIP, direction) → its rule.
    pub eips: BTreeMap<([u8; 4], u8), QosEip>,
    /// Bucket id → config.
    pub buckets: BTreeMap<u32, QosConfig>,
}

/// Create only if absent.
const BPF_NOEXIST: u64 = 1;

/// An insert that lost a race with another creator is fine.
fn ignore_exists(r: Result<(), MapError>) -> Result<()> {
    match r {
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        r => Ok(r?),
    }
}

/// Every entry of the QoS maps.
#[derive(Debug, Default)]
pub struct QosDump {
    /// (zone, hooks with rules).
    pub zones: Vec<(u32, u32)>,
    pub hooks: Vec<(QosHookKey, QosHook)>,
    pub eips: Vec<(QosEipKey, QosEip)>,
    pub config: Vec<(u32, QosConfig)>,
    pub state: Vec<(u32, QosBucket)>,
}

/// One bucket's counters summed over CPUs.
pub type QosTotals = QosStats;

impl Tables {
    fn qos_zones(&self) -> Result<Array<aya::maps::MapData, u32>> {
        Ok(Array::try_from(Map::Array(self.data(MAP_QOS_ZONES)?))?)
    }

    fn qos_stats_map(&self) -> Result<PerCpuHashMap<aya::maps::MapData, u32, QosStats>> {
        Ok(PerCpuHashMap::try_from(Map::PerCpuHashMap(self.data(MAP_QOS_STATS)?))?)
    }

    /// The zone's QoS entries as the maps hold them.
    pub fn qos_zone(&self, zone: u16) -> Result<QosZone> {
        let mut out = QosZone::default();
        let hooks = self.hash::<QosHookKey, QosHook>(MAP_QOS_HOOKS)?;
        for item in hooks.iter() {
            let (k, v) = item?;
            if k.zone == zone {
                out.hooks.insert((k.ifindex, k.dir), v);
            }
        }
        let eips = self.hash::<QosEipKey, QosEip>(MAP_QOS_EIPS)?;
        for item in eips.iter() {
            let (k, v) = item?;
            if k.zone == zone {
                out.eips.insert((k.addr, k.dir), v);
            }
        }
        let config = self.hash::<u32, QosConfig>(MAP_QOS_CONFIG)?;
        let used: BTreeSet<u32> = out
            .hooks
            .values()
            .flat_map(|h| h.rules[..(h.count as usize).min(QOS_HOOK_RULES)].iter().map(|r| r.bucket))
            .chain(out.eips.values().map(|e| e.bucket))
            .collect();
        for id in used {
            if let Ok(c) = config.get(&id, 0) {
                out.buckets.insert(id, c);
            }
        }
        Ok(out)
    }

    /// Makes the zone's QoS entries equal `want`; returns what changed.
    pub fn sync_qos(&self, zone: u16, want: &QosZone) -> Result<Vec<String>> {
        let have = self.qos_zone(zone)?;
        if &have == want {
            return Ok(vec![]);
        }
        let mut changes = Vec::new();
        let mut config = self.hash::<u32, QosConfig>(MAP_QOS_CONFIG)?;
        let mut state = self.hash::<u32, QosBucket>(MAP_QOS_STATE)?;
        let mut hooks = self.hash::<QosHookKey, QosHook>(MAP_QOS_HOOKS)?;
        let mut eips = self.hash::<QosEipKey, QosEip>(MAP_QOS_EIPS)?;
        let mut stats = self.qos_stats_map()?;
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| anyhow::anyhow!("counting CPUs: {e}"))?;
        for (id, c) in &want.buckets {
            if have.buckets.get(id) != Some(c) {
                config.insert(id, c, 0)?;
                changes.push(format!("QoS bucket {id}: {} bit/s, burst {} ns", c.rate_bps, c.burst_ns));
            }
            // Created once (BPF_NOEXIST): a running bucket keeps its clock
            // and its counters.
            if state.get(id, 0).is_err() {
                ignore_exists(state.insert(id, &QosBucket::default(), BPF_NOEXIST))?;
            }
            if stats.get(id, 0).is_err() {
                let zero = PerCpuValues::try_from(vec![QosStats::default(); cpus.get() as usize])?;
                ignore_exists(stats.insert(id, zero, BPF_NOEXIST))?;
            }
        }
        for ((addr, dir), e) in &want.eips {
            if have.eips.get(&(*addr, *dir)) != Some(e) {
                eips.insert(&QosEipKey { addr: *addr, zone, dir: *dir, _pad0: 0 }, e, 0)?;
            }
        }
        for ((ifindex, dir), h) in &want.hooks {
            if have.hooks.get(&(*ifindex, *dir)) != Some(h) {
                hooks.insert(&QosHookKey { ifindex: *ifindex, zone, dir: *dir, _pad0: 0 }, h, 0)?;
            }
        }
        self.qos_zones()?.set(zone as u32, &(want.hooks.len() as u32), 0)?;
        for (addr, dir) in have.eips.keys().filter(|k| !want.eips.contains_key(k)) {
            let _ = eips.remove(&QosEipKey { addr: *addr, zone, dir: *dir, _pad0: 0 });
        }
        for (ifindex, dir) in have.hooks.keys().filter(|k| !want.hooks.contains_key(k)) {
            let _ = hooks.remove(&QosHookKey { ifindex: *ifindex, zone, dir: *dir, _pad0: 0 });
        }
        for id in have.buckets.keys().filter(|id| !want.buckets.contains_key(id)) {
            let _ = config.remove(id);
            let _ = state.remove(id);
            let _ = stats.remove(id);
            changes.push(format!("QoS bucket {id} removed"));
        }
        Ok(changes)
    }

    /// Every QoS map's entries (for `lbagent maps`).
    pub fn qos_dump(&self) -> Result<QosDump> {
        let mut d = QosDump::default();
        let zones = self.qos_zones()?;
        for z in 0..QOS_ZONES_MAX {
            let n = zones.get(&z, 0)?;
            if n != 0 {
                d.zones.push((z, n));
            }
        }
        for item in self.hash::<QosHookKey, QosHook>(MAP_QOS_HOOKS)?.iter() {
            d.hooks.push(item?);
        }
        for item in self.hash::<QosEipKey, QosEip>(MAP_QOS_EIPS)?.iter() {
            d.eips.push(item?);
        }
        for item in self.hash::<u32, QosConfig>(MAP_QOS_CONFIG)?.iter() {
            d.config.push(item?);
        }
        for item in self.hash::<u32, QosBucket>(MAP_QOS_STATE)?.iter() {
            d.state.push(item?);
        }
        d.hooks.sort_by_key(|(k, _)| (k.zone, k.ifindex, k.dir));
        d.eips.sort_by_key(|(k, _)| (k.zone, k.dir, k.addr));
        d.config.sort_by_key(|(id, _)| *id);
        d.state.sort_by_key(|(id, _)| *id);
        Ok(d)
    }

    /// Every bucket's counters, summed over CPUs.
    pub fn qos_stats(&self) -> Result<BTreeMap<u32, QosTotals>> {
        let map = self.qos_stats_map()?;
        let mut out = BTreeMap::new();
        for item in map.iter() {
            let (id, per_cpu) = item?;
            let sum = per_cpu.iter().fold(QosStats::default(), |a, v| QosStats {
                passed_packets: a.passed_packets + v.passed_packets,
                passed_bytes: a.passed_bytes + v.passed_bytes,
                marked_packets: a.marked_packets + v.marked_packets,
                marked_bytes: a.marked_bytes + v.marked_bytes,
                dropped_packets: a.dropped_packets + v.dropped_packets,
                dropped_bytes: a.dropped_bytes + v.dropped_bytes,
            });
            out.insert(id, sum);
        }
        Ok(out)
    }
}
