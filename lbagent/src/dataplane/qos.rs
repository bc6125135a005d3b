//! The QoS maps from the agent's side (the program's half is
//! `lbagent-ebpf/src/qos.rs`, the layouts `lbagent_common::qos`): a zone's
//! hooks, EIP rules and buckets made equal to a desired set, touching only
//! what differs.
//!
//! Order keeps every packet consistent: a new bucket's state and counters
//! are zeroed and its config written before any hook or EIP entry points at
//! it; entries stop pointing at a bucket before it is cleared. A bucket's
//! state is zeroed only when the bucket is created or freed (a rate change
//! replaces only its config, so the bucket keeps its clock and no flow sees
//! a reset).

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;
use lbagent_common::*;

use super::tables::Tables;
use crate::outcome::Changes;

/// One zone's QoS entries as the program reads them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QosZone {
    /// Where EIP rules act, and how many hooks have gateway rules.
    pub info: QosZoneInfo,
    /// (ifindex, direction) → the hook's gateway rules.
    pub hooks: BTreeMap<(u32, u8), QosHook>,
    /// (EIP, direction) → its rule.
    pub eips: BTreeMap<([u8; 4], u8), QosEip>,
    /// Bucket → config.
    pub buckets: BTreeMap<u32, QosConfig>,
}

impl QosZone {
    /// Derives what the program reads before the rules from the rules
    /// themselves: where EIP rules act (`eip_if`, the interface whose
    /// packets are looked up by EIP, for each direction with an EIP rule),
    /// how many hooks have gateway rules, and which EIP rules no gateway
    /// rule of their hook can precede (`QOS_EIP_F_FIRST`: the program then
    /// skips the hook). Call after the last change to `hooks` or `eips`.
    pub fn finish(&mut self, eip_if: u32) {
        self.info = QosZoneInfo { hooks: self.hooks.len() as u32, ..Default::default() };
        for ((_, dir), e) in self.eips.iter_mut() {
            self.info.eip_ifindex[(*dir as usize).min(1)] = eip_if;
            let hook = self.hooks.get(&(eip_if, *dir));
            let count = hook.map_or(0, |h| (h.count as usize).min(QOS_HOOK_RULES));
            let before = hook.is_some_and(|h| h.rules[..count].iter().any(|r| r.priority < e.priority));
            e.flags = if before { 0 } else { QOS_EIP_F_FIRST };
        }
    }
}

/// Every entry of the QoS maps.
#[derive(Debug, Default)]
pub struct QosDump {
    /// Zones with rules.
    pub zones: Vec<(u32, QosZoneInfo)>,
    pub hooks: Vec<(QosHookKey, QosHook)>,
    pub eips: Vec<(QosEipKey, QosEip)>,
    /// Buckets in use (rate > 0): config and state.
    pub config: Vec<(u32, QosConfig)>,
    pub state: Vec<(u32, QosBucket)>,
    /// Flows' latest drops.
    pub drops: Vec<(QosDropKey, QosDrop)>,
}

impl Tables {
    /// The zone's QoS entries as the maps hold them.
    pub fn qos_zone(&self, zone: u16) -> Result<QosZone> {
        let mut out = QosZone { info: self.array(MAP_QOS_ZONES)?.get(&(zone as u32), 0)?, ..Default::default() };
        let hooks = self.hash(MAP_QOS_HOOKS)?;
        for item in hooks.iter() {
            let (k, v) = item?;
            if k.zone == zone {
                out.hooks.insert((k.ifindex, k.dir), v);
            }
        }
        let eips = self.hash(MAP_QOS_EIPS)?;
        for item in eips.iter() {
            let (k, v) = item?;
            if k.zone == zone {
                out.eips.insert((k.addr, k.dir), v);
            }
        }
        let config = self.array(MAP_QOS_CONFIG)?;
        let used: BTreeSet<u32> = out
            .hooks
            .values()
            .flat_map(|h| h.rules[..(h.count as usize).min(QOS_HOOK_RULES)].iter().map(|r| r.bucket))
            .chain(out.eips.values().map(|e| e.bucket))
            .collect();
        for b in used {
            let c = config.get(&b, 0)?;
            if c.rate_bps != 0 {
                out.buckets.insert(b, c);
            }
        }
        Ok(out)
    }

    /// Makes the zone's QoS entries equal `want`; returns what changed.
    pub fn sync_qos(&self, zone: u16, want: &QosZone) -> Result<Changes> {
        let have = self.qos_zone(zone)?;
        if &have == want {
            return Ok(Changes::new());
        }
        let mut changes = Changes::new();
        let mut config = self.array(MAP_QOS_CONFIG)?;
        let mut state = self.array(MAP_QOS_STATE)?;
        let mut stats = self.per_cpu_array(MAP_QOS_STATS)?;
        let cpus = super::tables::possible_cpus()?;
        let zeroed = || super::tables::per_cpu(vec![QosStats::default(); cpus]);
        let mut hooks = self.hash(MAP_QOS_HOOKS)?;
        let mut eips = self.hash(MAP_QOS_EIPS)?;
        let fresh: BTreeSet<u32> = want
            .buckets
            .keys()
            .chain(have.buckets.keys())
            .filter(|b| !(have.buckets.contains_key(b) && want.buckets.contains_key(b)))
            .copied()
            .collect();
        self.forget_qos_drops(&fresh)?;
        for (b, c) in &want.buckets {
            if !have.buckets.contains_key(b) {
                // A new bucket: full, with no counts.
                state.set(*b, &QosBucket::default(), 0)?;
                stats.set(*b, zeroed()?, 0)?;
            }
            if have.buckets.get(b) != Some(c) {
                config.set(*b, c, 0)?;
                changes.push(format!("QoS bucket {b}: {} bit/s, burst {} ns", c.rate_bps, c.burst_ns));
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
        if have.info != want.info {
            self.array(MAP_QOS_ZONES)?.set(zone as u32, &want.info, 0)?;
        }
        for (addr, dir) in have.eips.keys().filter(|k| !want.eips.contains_key(k)) {
            let _ = eips.remove(&QosEipKey { addr: *addr, zone, dir: *dir, _pad0: 0 });
        }
        for (ifindex, dir) in have.hooks.keys().filter(|k| !want.hooks.contains_key(k)) {
            let _ = hooks.remove(&QosHookKey { ifindex: *ifindex, zone, dir: *dir, _pad0: 0 });
        }
        for b in have.buckets.keys().filter(|b| !want.buckets.contains_key(b)) {
            config.set(*b, &QosConfig::default(), 0)?;
            state.set(*b, &QosBucket::default(), 0)?;
            stats.set(*b, zeroed()?, 0)?;
            changes.push(format!("QoS bucket {b} removed"));
        }
        Ok(changes)
    }

    /// Removes the `qos_drops` entries of `buckets` (created or freed: a
    /// new bucket starts with no memory of another's drops).
    fn forget_qos_drops(&self, buckets: &BTreeSet<u32>) -> Result<()> {
        if buckets.is_empty() {
            return Ok(());
        }
        let mut drops = self.hash(MAP_QOS_DROPS)?;
        let stale: Vec<QosDropKey> =
            drops.keys().filter_map(|k| k.ok()).filter(|k| buckets.contains(&k.bucket)).collect();
        for k in stale {
            let _ = drops.remove(&k);
        }
        Ok(())
    }

    /// The counters of `buckets` (all CPUs added up).
    pub fn qos_stats_of(&self, buckets: impl IntoIterator<Item = u32>) -> Result<BTreeMap<u32, QosStats>> {
        let stats = self.per_cpu_array(MAP_QOS_STATS)?;
        let mut out = BTreeMap::new();
        for b in buckets {
            if b != 0 && b < QOS_BUCKETS_MAX {
                let mut sum = QosStats::default();
                for cpu in stats.get(&b, 0)?.iter() {
                    sum.add(cpu);
                }
                out.insert(b, sum);
            }
        }
        Ok(out)
    }

    /// The counters of every bucket in use (rate > 0).
    pub fn qos_stats(&self) -> Result<BTreeMap<u32, QosStats>> {
        let used: Vec<u32> = self.qos_dump()?.config.iter().map(|(b, _)| *b).collect();
        self.qos_stats_of(used)
    }

    /// Every QoS map's entries (for `lbagent maps`).
    pub fn qos_dump(&self) -> Result<QosDump> {
        let mut d = QosDump::default();
        let zones = self.array(MAP_QOS_ZONES)?;
        for item in zones.iter().enumerate() {
            let (z, info) = (item.0 as u32, item.1?);
            if info.any() {
                d.zones.push((z, info));
            }
        }
        for item in self.hash(MAP_QOS_HOOKS)?.iter() {
            d.hooks.push(item?);
        }
        for item in self.hash(MAP_QOS_EIPS)?.iter() {
            d.eips.push(item?);
        }
        let config = self.array(MAP_QOS_CONFIG)?;
        let state = self.array(MAP_QOS_STATE)?;
        for (b, c) in config.iter().enumerate() {
            let c = c?;
            if c.rate_bps != 0 {
                d.config.push((b as u32, c));
                d.state.push((b as u32, state.get(&(b as u32), 0)?));
            }
        }
        for item in self.hash(MAP_QOS_DROPS)?.iter() {
            d.drops.push(item?);
        }
        d.drops.sort_by_key(|(k, _)| *k);
        d.hooks.sort_by_key(|(k, _)| (k.zone, k.ifindex, k.dir));
        d.eips.sort_by_key(|(k, _)| (k.zone, k.dir, k.addr));
        Ok(d)
    }
}
