//! Typed access to the pinned maps: what the agent writes (rules, config) and
//! what operators read (conntrack, counters). Works without a loaded program.
//! One file per concern, named as the program's modules: `rules` (DNAT, SNAT,
//! ACL entries), `conntrack` (flows, fragments, flush, garbage collection),
//! `counters`, `sched` (scheduler tables), `proxy_guard`, `egress_mtu` (the
//! fast path's MTUs), `zone_ct` (each zone's conntrack share); QoS maps are
//! in `dataplane/qos.rs`.

mod conntrack;
mod counters;
mod egress_mtu;
mod proxy_guard;
mod rules;
mod sched;
mod zone_ct;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray, PerCpuValues};
pub use conntrack::{FlowWriter, HalfWritten};
use lbagent_common::*;
pub use rules::{AclSpec, DnatSpec, RuleSnat, SchedKind, SchedSpec, SnatSpec};
pub use sched::table_digest;
pub use zone_ct::ZoneCt;

use super::pins;

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
        if !dir.join(MAP_CT).exists() {
            bail!("no lbagent maps pinned under {} (is the dataplane running? see --bpffs)", dir.display());
        }
        pins::check_meta(bpffs)?;
        Ok(Self { dir })
    }

    pub(in crate::dataplane) fn data(&self, name: &str) -> Result<MapData> {
        let path = self.dir.join(name);
        MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))
    }

    pub(in crate::dataplane) fn hash<K: aya::Pod, V: aya::Pod>(&self, name: &str) -> Result<HashMap<MapData, K, V>> {
        let data = self.data(name)?;
        let map = if name == MAP_CT_NEW || name == MAP_QOS_DROPS { Map::LruHashMap(data) } else { Map::HashMap(data) };
        Ok(HashMap::try_from(map)?)
    }

    pub(in crate::dataplane) fn array<V: aya::Pod>(&self, name: &str) -> Result<Array<MapData, V>> {
        Ok(Array::try_from(Map::Array(self.data(name)?))?)
    }

    pub(in crate::dataplane) fn per_cpu_array<V: aya::Pod>(&self, name: &str) -> Result<PerCpuArray<MapData, V>> {
        Ok(PerCpuArray::try_from(Map::PerCpuArray(self.data(name)?))?)
    }

    pub fn set_config(&self, cfg: NatConfig) -> Result<()> {
        self.array::<NatConfig>(MAP_NAT_CONFIG)?.set(0, &cfg, 0)?;
        Ok(())
    }

    pub fn config(&self) -> Result<NatConfig> {
        Ok(self.array::<NatConfig>(MAP_NAT_CONFIG)?.get(&0, 0)?)
    }
}
