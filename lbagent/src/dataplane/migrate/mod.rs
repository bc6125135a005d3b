//! Upgrades across a map-layout change: a new agent that finds the pins of
//! the previous layout (`<bpffs>/v<LAYOUT_VERSION-1>/`, still live: its
//! `meta` names its own version) carries their state into its own layout
//! instead of starting empty, so no established flow is lost.
//!
//! Sequence (the daemon drives it; each step is idempotent, so a crash at
//! any point is repaired by the next start, which finds the same pins):
//! 1. [`Migration::begin`], before the first apply: the old conntrack
//!    tables become this layout's `ct_prev` and `ct_new_prev`, flagged in
//!    `ct_adopt` (`adopt_conntrack`): the new programs adopt each flow from
//!    them on its next packet, and treat their translated tuples as taken,
//!    so a flow keeps its translation whichever layout's program sees it
//!    and one the old programs open during the switch-over is found by the
//!    new ones. This layout's other maps are created and filled with the
//!    old ones' *state*, what the agent cannot recompute: per-rule statistics, counters,
//!    and every QoS bucket (rate, clock, counts, and the hook and EIP
//!    entries that use it, so the first apply keeps the bucket). Rules
//!    (DNAT, backends, ACLs, SNAT, scheduler tables) are not carried: the
//!    first apply writes them from the desired state, whole (a rule copied
//!    without its ACL entries would deny everything). The old programs keep
//!    running on the old maps meanwhile; nothing old is changed yet except
//!    that pinned tcx links move to this layout's link directory (the same
//!    links, so the next attach replaces their program in place).
//! 2. The first apply writes every zone's rules from the desired state and
//!    only then attaches the zone's new programs (`lb::ensure`,
//!    `natgw::ensure`): a new program never sees a half-written table.
//! 3. [`Migration::finish`], after an apply that attached every zone:
//!    the flows no new program adopted (idle ones) are copied, converted
//!    (halves already present are kept); the flag is cleared and
//!    `ct_prev`/`ct_new_prev` are pinned afresh, small and empty (the
//!    running programs hold the old tables until they are next loaded: the
//!    next start loads them again, as they use maps no longer pinned); then
//!    the old directory becomes a marker: its maps are unpinned
//!    (the kernel frees them with the last old program) and its `meta` is
//!    set to this layout, which makes an agent of the old layout refuse to
//!    start (a downgrade would lose every flow).
//!
//! Only the previous layout is migrated; pins of older ones are refused as
//! before (`pins::check_meta` and the daemon's warning about stale pins).
//! Layout 5 changed the conntrack entry (48 bytes: the creation time in
//! milliseconds); `CtEntryPrev` is layout 4's, converted by
//! `CtEntryPrev::adopted` on both sides of the kernel boundary. Every
//! other map this module copies has the same types in layout 4.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use aya::maps::{Array, HashMap, MapData, PerCpuArray, PerCpuHashMap};
use lbagent_common::*;
use tracing::info;

use super::{
    loader::CtSizes,
    pins::{self, map_of},
    tables::{HalfWritten, NOEXIST, Tables, per_cpu, possible_cpus},
};

/// The layout this build migrates from.
pub const FROM_VERSION: u32 = LAYOUT_VERSION - 1;

/// What one migration pass carried over.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Carried {
    /// Conntrack halves written (flows × 2, when both halves were present).
    pub ct_halves: usize,
    /// Halves already present in the new tables (a previous pass wrote
    /// them, or a new program created them): left as they are.
    pub ct_present: usize,
    /// Halves the new tables had no room for.
    pub ct_full: usize,
    pub rule_stats: usize,
    /// QoS buckets in use (rate, clock and counts).
    pub qos_buckets: usize,
    pub links: usize,
    /// The old conntrack tables became this layout's `ct_prev` and
    /// `ct_new_prev` (`adopt_conntrack`), their flows adopted on demand.
    pub ct_adopted: bool,
}

/// A migration in progress: the old layout's live pins were found.
#[derive(Debug)]
pub struct Migration {
    root: PathBuf,
    pub from: u32,
    /// What [`Migration::begin`] carried.
    pub carried: Carried,
}

impl Migration {
    /// Finds live pins of the previous layout under `root` and copies their
    /// state into this layout's maps (creating them with `sizes`). `None`:
    /// nothing to migrate (no old pins, or only a marker of a finished
    /// migration).
    ///
    /// Live pins of a layout older than the previous one are refused: their
    /// flows cannot be carried, and an empty dataplane beside them would
    /// replace their programs and lose every flow.
    pub fn begin(root: &Path, sizes: CtSizes) -> Result<Option<Migration>> {
        if let Some((v, dir)) = pins::older_live_versions(root).into_iter().find(|(v, _)| *v != FROM_VERSION) {
            bail!(
                "{} holds a running dataplane of layout version {v}; this lbagent (layout {LAYOUT_VERSION}) \
                 migrates only layout {FROM_VERSION}: upgrade through a release of layout {} first, or tear that \
                 dataplane down with its own release (`lbagent teardown`)",
                dir.display(),
                v + 1
            );
        }
        let old = pins::version_dir(root, FROM_VERSION);
        if FROM_VERSION == 0 || !pins::is_live(root, FROM_VERSION) {
            return Ok(None);
        }
        if !old.join(MAP_CT.name).exists() {
            return Ok(None);
        }
        info!(
            "found the dataplane of layout {FROM_VERSION} in {}: migrating it to layout {LAYOUT_VERSION}",
            old.display()
        );
        adopt_conntrack(&old, root)?;
        // Creates (or reuses, after the usual checks) this layout's maps:
        // the old conntrack tables among them, as `ct_prev`/`ct_new_prev`.
        super::loader::ZoneProgram::load_sized(root, 0, sizes).context("creating the new layout's maps")?;
        let tables = Tables::open(root)?;
        tables.set_adopting(true).context("flagging the flows to adopt")?;
        let mut carried = Carried { ct_adopted: true, ..Default::default() };
        carried.rule_stats = copy_rule_stats(&old, &tables)?;
        copy_counters(&old, &tables)?;
        copy_zone_counts(&old, &tables)?;
        carried.qos_buckets = copy_qos(&old, &tables)?;
        carried.links = move_links(&old, &pins::links_dir(root))?;
        info!(
            "conntrack tables of the running programs kept as {} and {}: the new programs adopt each flow on its \
             next packet",
            MAP_CT_PREV.name, MAP_CT_NEW_PREV.name
        );
        info!(
            "carried statistics of {} rules, {} QoS buckets, {} tcx links",
            carried.rule_stats, carried.qos_buckets, carried.links
        );
        Ok(Some(Migration { root: root.to_path_buf(), from: FROM_VERSION, carried }))
    }

    /// After an apply that attached this build's programs to every zone:
    /// catches up the flows the old programs created meanwhile, then leaves
    /// the old directory as a marker. Returns the catch-up pass's count.
    pub fn finish(self, sizes: CtSizes) -> Result<Carried> {
        let old = pins::version_dir(&self.root, self.from);
        let tables = Tables::open(&self.root)?;
        // Every zone runs the new programs: the old tables change no more.
        let caught = copy_conntrack(&old, &tables)?;
        tables.set_adopting(false).context("clearing the adoption flag")?;
        let dir = pins::versioned_dir(&self.root);
        for name in [MAP_CT_PREV.name, MAP_CT_NEW_PREV.name] {
            let path = dir.join(name);
            if path.exists() {
                std::fs::remove_file(&path).with_context(|| format!("unpinning {}", path.display()))?;
            }
        }
        // Pins them afresh, small (the maps of a later load).
        super::loader::ZoneProgram::load_sized(&self.root, 0, sizes).context("pinning empty previous tables")?;
        pins::leave_marker(&self.root, self.from)?;
        info!(
            "migration from layout {} done: {} conntrack halves no program adopted copied after the switch-over \
             ({} adopted or present, {} did not fit); {} is a marker now \
             (an lbagent of layout {} refuses to start on this dataplane)",
            self.from,
            caught.ct_halves,
            caught.ct_present,
            caught.ct_full,
            old.display(),
            self.from
        );
        Ok(caught)
    }
}

/// Pins the old layout's conntrack tables as this layout's `ct_prev` and
/// `ct_new_prev` before the first load (which then reuses them at their
/// sizes: `loader::load_from`). A pin already there is kept when it is the
/// old table itself (a start that crashed after pinning it) and replaced
/// otherwise (the small empty one of an earlier start).
fn adopt_conntrack(old: &Path, root: &Path) -> Result<()> {
    pins::check_meta(root)?;
    let dir = pins::ensure_versioned_dir(root)?;
    for (table, prev) in [(MAP_CT, MAP_CT_PREV.name), (MAP_CT_NEW, MAP_CT_NEW_PREV.name)] {
        let map = old_map(old, table)?;
        let id = map.info()?.id();
        let path = dir.join(prev);
        match MapData::from_pin(&path).ok().and_then(|m| m.info().ok()).map(|i| i.id()) {
            Some(pinned) if pinned == id => continue,
            Some(_) => std::fs::remove_file(&path).with_context(|| format!("replacing {}", path.display()))?,
            None => {}
        }
        map.pin(&path).with_context(|| format!("pinning {} of layout {FROM_VERSION} as {prev}", table.name))?;
    }
    Ok(())
}

/// A map of the previous layout, found by this layout's definition's name.
/// Its kind, key and value are this layout's, the same in layout 4 for
/// every map copied but the conntrack tables (`CtEntryPrev`).
fn old_map<K, V>(dir: &Path, def: MapDef<K, V>) -> Result<MapData> {
    let path = dir.join(def.name);
    MapData::from_pin(&path).with_context(|| format!("opening {} of layout {FROM_VERSION}", path.display()))
}

/// Both halves of every old flow into the same table (`ct`: established,
/// `ct_new`: the others), converted, never over a half the new tables
/// already hold (the programs adopted it, or made a newer flow of it).
fn copy_conntrack(old: &Path, t: &Tables) -> Result<Carried> {
    let mut writer = t.flow_writer()?;
    let mut c = Carried::default();
    for (table, established) in [(MAP_CT, true), (MAP_CT_NEW, false)] {
        let table: HashMap<_, Tuple, CtEntryPrev> = HashMap::try_from(map_of(table, old_map(old, table)?))?;
        // Only the new programs run now, and they only read these tables:
        // the walk sees each old half once.
        for item in table.iter() {
            // A half a program adopted is this layout's already (or was,
            // and is closed or freed now): never copied back.
            let Ok((key, entry)) = item else { continue };
            if entry.adopted != 0 {
                c.ct_present += 1;
                continue;
            }
            match writer.insert_half(&key, &entry.adopted(), established) {
                HalfWritten::Inserted => c.ct_halves += 1,
                HalfWritten::Present => c.ct_present += 1,
                HalfWritten::Full => c.ct_full += 1,
            }
        }
    }
    Ok(c)
}

/// Per-rule statistics (rule ids are the agent's, kept in its state dir, so
/// they stay valid); entries the new table already holds win. `refused`
/// also counts a SNAT rule's new flows that found no free port, which the
/// previous layout's programs never counted (it was an ACL count, 0 for
/// SNAT rules): the copied values mean the same, and the layout is the
/// same.
fn copy_rule_stats(old: &Path, t: &Tables) -> Result<usize> {
    let stats: PerCpuHashMap<_, u32, RuleStats> =
        PerCpuHashMap::try_from(map_of(MAP_RULE_STATS, old_map(old, MAP_RULE_STATS)?))?;
    let mut new_stats = t.per_cpu_hash(MAP_RULE_STATS)?;
    let mut n = 0;
    for (id, per_cpu) in stats.iter().flatten() {
        if new_stats.insert(&id, per_cpu, NOEXIST).is_ok() {
            n += 1;
        }
    }
    Ok(n)
}

/// Every QoS bucket in use (rate > 0): its config, clock and counts, and
/// the hook and EIP entries that point at it, so that the first
/// apply finds the bucket in use and changes only what differs. Returns the
/// number of buckets.
fn copy_qos(old: &Path, t: &Tables) -> Result<usize> {
    let config: Array<_, QosConfig> = Array::try_from(map_of(MAP_QOS_CONFIG, old_map(old, MAP_QOS_CONFIG)?))?;
    let state: Array<_, QosBucket> = Array::try_from(map_of(MAP_QOS_STATE, old_map(old, MAP_QOS_STATE)?))?;
    let stats: PerCpuArray<_, QosStats> = PerCpuArray::try_from(map_of(MAP_QOS_STATS, old_map(old, MAP_QOS_STATS)?))?;
    let mut new_config = t.array(MAP_QOS_CONFIG)?;
    let mut new_state = t.array(MAP_QOS_STATE)?;
    let mut new_stats = t.per_cpu_array(MAP_QOS_STATS)?;
    let mut n = 0;
    for b in 1..QOS_BUCKETS_MAX {
        let c = config.get(&b, 0)?;
        if c.rate_bps == 0 || new_config.get(&b, 0)?.rate_bps != 0 {
            continue;
        }
        // Clock and counts before the config: the bucket is complete before
        // anything in this layout could use it.
        new_state.set(b, &state.get(&b, 0)?, 0)?;
        new_stats.set(b, stats.get(&b, 0)?, 0)?;
        new_config.set(b, &c, 0)?;
        n += 1;
    }
    let hooks: HashMap<_, QosHookKey, QosHook> =
        HashMap::try_from(map_of(MAP_QOS_HOOKS, old_map(old, MAP_QOS_HOOKS)?))?;
    let mut new_hooks = t.hash(MAP_QOS_HOOKS)?;
    for (k, h) in hooks.iter().flatten() {
        let _ = new_hooks.insert(&k, &h, NOEXIST);
    }
    let eips: HashMap<_, QosEipKey, QosEip> = HashMap::try_from(map_of(MAP_QOS_EIPS, old_map(old, MAP_QOS_EIPS)?))?;
    let mut new_eips = t.hash(MAP_QOS_EIPS)?;
    for (k, e) in eips.iter().flatten() {
        let _ = new_eips.insert(&k, &e, NOEXIST);
    }
    Ok(n)
}

/// Counters: the old values added to the new ones (per CPU), so totals
/// continue across the upgrade. Only on the first pass (`begin`).
fn copy_counters(old: &Path, t: &Tables) -> Result<()> {
    let counters: PerCpuArray<_, u64> = PerCpuArray::try_from(map_of(MAP_COUNTERS, old_map(old, MAP_COUNTERS)?))?;
    let mut new = t.per_cpu_array(MAP_COUNTERS)?;
    // Counters keep their index across layouts (new ones are appended).
    let shared = counters.len().min(COUNTER_COUNT);
    for i in 0..shared {
        let was = counters.get(&i, 0)?;
        let now = new.get(&i, 0)?;
        let sum: Vec<u64> = now.iter().zip(was.iter()).map(|(a, b)| a + b).collect();
        new.set(i, per_cpu(sum)?, 0)?;
    }
    // Zeroed so a repeated `begin` (a crash before `finish`) adds nothing twice.
    let mut counters = counters;
    let cpus = possible_cpus()?;
    for i in 0..shared {
        counters.set(i, per_cpu(vec![0u64; cpus])?, 0)?;
    }
    Ok(())
}

/// Each zone's flow counts (its conntrack share: every flow comes into the
/// new tables, adopted or copied, without being counted again, so the
/// counts are the flows' own until the next recount corrects any drift)
/// where the new table has none, and its refusals and the proxy
/// guard's drops added to the new ones (zeroed in the old maps, so a
/// repeated `begin` adds nothing twice), as counters continue.
fn copy_zone_counts(old: &Path, t: &Tables) -> Result<()> {
    let flows: HashMap<_, u32, ZoneCtFlows> =
        HashMap::try_from(map_of(MAP_ZONE_CT_FLOWS, old_map(old, MAP_ZONE_CT_FLOWS)?))?;
    let mut new_flows = t.hash(MAP_ZONE_CT_FLOWS)?;
    for (zone, f) in flows.iter().flatten() {
        let _ = new_flows.insert(&zone, &f, NOEXIST);
    }
    let mut refused: HashMap<_, u32, ZoneCtRefused> =
        HashMap::try_from(map_of(MAP_ZONE_CT_REFUSED, old_map(old, MAP_ZONE_CT_REFUSED)?))?;
    let mut new_refused = t.hash(MAP_ZONE_CT_REFUSED)?;
    let zones: Vec<(u32, ZoneCtRefused)> = refused.iter().flatten().collect();
    for (zone, r) in zones {
        let now = new_refused.get(&zone, 0).unwrap_or(ZoneCtRefused { established: 0, new: 0 });
        let sum = ZoneCtRefused { established: now.established + r.established, new: now.new + r.new };
        new_refused.insert(&zone, &sum, 0)?;
        refused.insert(&zone, &ZoneCtRefused { established: 0, new: 0 }, 0)?;
    }
    let mut drops: PerCpuArray<_, u64> =
        PerCpuArray::try_from(map_of(MAP_PROXY_GUARD_DROPS, old_map(old, MAP_PROXY_GUARD_DROPS)?))?;
    let mut new_drops = t.per_cpu_array(MAP_PROXY_GUARD_DROPS)?;
    let (was, now) = (drops.get(&0, 0)?, new_drops.get(&0, 0)?);
    new_drops.set(0, per_cpu(now.iter().zip(was.iter()).map(|(a, b)| a + b).collect())?, 0)?;
    drops.set(0, per_cpu(vec![0u64; possible_cpus()?])?, 0)?;
    Ok(())
}

/// Moves the old layout's pinned tcx links into `to` (a rename on bpffs:
/// the links themselves, still attached, keep running the old program until
/// the next attach replaces it through the pin). Returns how many moved.
fn move_links(old: &Path, to: &Path) -> Result<usize> {
    let from = old.join("links");
    let Ok(entries) = std::fs::read_dir(&from) else { return Ok(0) };
    std::fs::create_dir_all(to)?;
    let mut n = 0;
    for entry in entries.flatten() {
        let target = to.join(entry.file_name());
        if target.exists() {
            continue;
        }
        std::fs::rename(entry.path(), &target)
            .with_context(|| format!("moving {} to {}", entry.path().display(), target.display()))?;
        n += 1;
    }
    Ok(n)
}
