//! Typed access to the pinned maps: what the agent writes (rules, config) and
//! what operators read (conntrack, counters). Works without a loaded program.
//! One file per concern, named as the program's modules: `rules` (DNAT, SNAT,
//! ACL entries), `conntrack` (flows, fragments, flush; garbage collection is the program's, `dataplane/ct_gc.rs`),
//! `counters`, `sched` (scheduler tables), `proxy_guard`, `egress_mtu` (the
//! fast path's MTUs), `zone_ct` (each zone's conntrack share); QoS maps are
//! in `dataplane/qos.rs`.

pub mod batch;
mod conntrack;
mod counters;
mod egress_mtu;
pub mod flow_log;
mod ports;
mod proxy_guard;
mod rules;
mod sched;
mod zone_ct;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use aya::maps::{Array, HashMap, HashOfMaps, LpmTrie, Map, MapData, PerCpuArray, PerCpuHashMap, PerCpuValues};
pub use conntrack::{FlowPut, FlowWriter, HalfWritten};
use lbagent_common::*;
pub use ports::{PerProto, PortCensus, PortCounter, RuleCount};
pub use rules::{AclSpec, DnatSpec, RuleSnat, SchedKind, SchedSpec, SnatSpec};
pub use sched::table_digest;
pub use zone_ct::ZoneCt;

use super::pins;

/// `BPF_NOEXIST`: a map update that only inserts (the key is absent).
pub const NOEXIST: u64 = 1;
/// `BPF_EXIST`: a map update that only replaces (the key is present).
pub const EXIST: u64 = 2;

/// CLOCK_MONOTONIC in ns: the clock of `bpf_ktime_get_ns`, so of every
/// conntrack timestamp.
pub fn monotonic_ns() -> u64 {
    // CLOCK_MONOTONIC cannot fail on Linux.
    let ts =
        nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap_or(nix::sys::time::TimeSpec::new(0, 0));
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

/// How many values a per-CPU map entry holds (the possible CPUs).
pub fn possible_cpus() -> Result<usize> {
    Ok(aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?.get() as usize)
}

/// A whole per-CPU map value from one value per CPU (`values` has
/// [`possible_cpus`] entries).
pub fn per_cpu<V: aya::Pod>(values: Vec<V>) -> Result<PerCpuValues<V>> {
    Ok(PerCpuValues::try_from(values)?)
}

pub struct Tables {
    dir: PathBuf,
}

impl Tables {
    /// Opens the pins under `bpffs` (they must exist: load a program first).
    pub fn open(bpffs: &Path) -> Result<Self> {
        let dir = pins::versioned_dir(bpffs);
        if !dir.join(MAP_CT.name).exists() {
            bail!("no lbagent maps pinned under {} (is the dataplane running? see --bpffs)", dir.display());
        }
        pins::check_meta(bpffs)?;
        Ok(Self { dir })
    }

    pub(in crate::dataplane) fn data(&self, name: &str) -> Result<MapData> {
        let path = self.dir.join(name);
        MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))
    }

    /// Whether the map is pinned (maps added by a newer layout are absent
    /// from pins an older agent made until it migrates them).
    pub fn pinned<K, V>(&self, def: MapDef<K, V>) -> bool {
        self.dir.join(def.name).exists()
    }

    /// The pinned map as aya's map of its kind.
    fn map<K, V>(&self, def: MapDef<K, V>) -> Result<Map> {
        Ok(pins::map_of(def, self.data(def.name)?))
    }

    pub fn hash<K: aya::Pod, V: aya::Pod>(&self, def: MapDef<K, V>) -> Result<HashMap<MapData, K, V>> {
        Ok(HashMap::try_from(self.map(def)?)?)
    }

    pub fn per_cpu_hash<K: aya::Pod, V: aya::Pod>(&self, def: MapDef<K, V>) -> Result<PerCpuHashMap<MapData, K, V>> {
        Ok(PerCpuHashMap::try_from(self.map(def)?)?)
    }

    pub fn array<V: aya::Pod>(&self, def: MapDef<u32, V>) -> Result<Array<MapData, V>> {
        Ok(Array::try_from(self.map(def)?)?)
    }

    pub fn per_cpu_array<V: aya::Pod>(&self, def: MapDef<u32, V>) -> Result<PerCpuArray<MapData, V>> {
        Ok(PerCpuArray::try_from(self.map(def)?)?)
    }

    pub fn lpm<K: aya::Pod, V: aya::Pod>(&self, def: MapDef<K, V>) -> Result<LpmTrie<MapData, K, V>> {
        Ok(LpmTrie::try_from(self.map(def)?)?)
    }

    /// A hash of maps whose inner maps are `I` (the definition's value is
    /// the inner map's id).
    pub fn hash_of_maps<K: aya::Pod, I: aya::maps::InnerMap>(
        &self,
        def: MapDef<K, u32>,
    ) -> Result<HashOfMaps<MapData, K, I>> {
        Ok(HashOfMaps::try_from(self.map(def)?)?)
    }

    pub fn set_config(&self, cfg: NatConfig) -> Result<()> {
        self.array(MAP_NAT_CONFIG)?.set(0, &cfg, 0)?;
        Ok(())
    }

    pub fn config(&self) -> Result<NatConfig> {
        Ok(self.array(MAP_NAT_CONFIG)?.get(&0, 0)?)
    }
}
