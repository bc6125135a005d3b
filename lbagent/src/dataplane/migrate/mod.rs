//! Upgrades across a map-layout change: a new agent that finds the pins of
//! the previous layout (`<bpffs>/v<LAYOUT_VERSION-1>/`, still live: its
//! `meta` names its own version) carries their state into its own layout
//! instead of starting empty, so no established flow is lost.
//!
//! Sequence (the daemon drives it; each step is idempotent, so a crash at
//! any point is repaired by the next start, which finds the same pins):
//! 1. [`Migration::begin`], before the first apply: this layout's maps are
//!    created and filled from the old ones: both halves of every flow
//!    (converted, into the table their state belongs in), DNAT rules and
//!    backends, per-rule statistics and counters. The old programs keep
//!    running on the old maps meanwhile; nothing old is changed yet except
//!    that pinned tcx links move to this layout's link directory (the same
//!    links, so the next attach replaces their program in place).
//! 2. The first apply writes every zone's rules from the desired state and
//!    only then attaches the zone's new programs (`lb::ensure`,
//!    `natgw::ensure`): a new program never sees a half-written table.
//! 3. [`Migration::finish`], after an apply that attached every zone: the
//!    flows the old programs created between step 1 and their replacement
//!    are copied (a second, catch-up pass; halves already present are
//!    kept), then the old directory becomes a marker: its maps are unpinned
//!    (the kernel frees them with the last old program) and its `meta` is
//!    set to this layout, which makes an agent of the old layout refuse to
//!    start (a downgrade would lose every flow).
//!
//! Only the previous layout is migrated; pins of older ones are refused as
//! before (`pins::check_meta` and the daemon's warning about stale pins).

mod v1;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use aya::maps::{HashMap, Map, MapData, PerCpuArray, PerCpuHashMap, PerCpuValues};
use lbagent_common::*;
use tracing::info;

use super::{pins, tables::Tables};

/// `BPF_NOEXIST`: insert only when the key is absent.
const NOEXIST: u64 = 1;

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
    pub dnat_rules: usize,
    pub backends: usize,
    pub rule_stats: usize,
    pub links: usize,
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
    /// state into this layout's maps (creating them with `ct_max`). `None`:
    /// nothing to migrate (no old pins, or only a marker of a finished
    /// migration).
    ///
    /// Live pins of a layout older than the previous one are refused: their
    /// flows cannot be carried, and an empty dataplane beside them would
    /// replace their programs and lose every flow.
    pub fn begin(root: &Path, ct_max: Option<u32>) -> Result<Option<Migration>> {
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
        if !old.join(MAP_CT).exists() {
            return Ok(None);
        }
        info!(
            "found the dataplane of layout {FROM_VERSION} in {}: migrating it to layout {LAYOUT_VERSION}",
            old.display()
        );
        // Creates (or reuses, after the usual checks) this layout's maps.
        super::loader::ZoneProgram::load_sized(root, 0, ct_max).context("creating the new layout's maps")?;
        let tables = Tables::open(root)?;
        let mut carried = copy_conntrack(&old, &tables)?;
        copy_rules(&old, &tables, &mut carried)?;
        copy_counters(&old, &tables)?;
        carried.links = move_links(&old, &pins::links_dir(root))?;
        info!(
            "carried {} conntrack halves ({} already present, {} did not fit), {} DNAT rules, {} backends, \
             statistics of {} rules, {} tcx links",
            carried.ct_halves,
            carried.ct_present,
            carried.ct_full,
            carried.dnat_rules,
            carried.backends,
            carried.rule_stats,
            carried.links
        );
        Ok(Some(Migration { root: root.to_path_buf(), from: FROM_VERSION, carried }))
    }

    /// After an apply that attached this build's programs to every zone:
    /// catches up the flows the old programs created meanwhile, then leaves
    /// the old directory as a marker. Returns the catch-up pass's count.
    pub fn finish(self) -> Result<Carried> {
        let old = pins::version_dir(&self.root, self.from);
        let tables = Tables::open(&self.root)?;
        let caught = copy_conntrack(&old, &tables)?;
        pins::leave_marker(&self.root, self.from)?;
        info!(
            "migration from layout {} done: {} conntrack halves caught up after the switch-over; {} is a marker now \
             (an lbagent of layout {} refuses to start on this dataplane)",
            self.from,
            caught.ct_halves,
            old.display(),
            self.from
        );
        Ok(caught)
    }
}

fn old_map(dir: &Path, name: &str) -> Result<MapData> {
    let path = dir.join(name);
    MapData::from_pin(&path).with_context(|| format!("opening {} of layout {FROM_VERSION}", path.display()))
}

/// Both halves of every old flow into `ct` / `ct_new`, never over a half
/// the new tables already hold.
fn copy_conntrack(old: &Path, t: &Tables) -> Result<Carried> {
    let ct: HashMap<_, Tuple, v1::CtEntryV1> = HashMap::try_from(Map::LruHashMap(old_map(old, MAP_CT)?))?;
    let mut established = t.hash::<Tuple, CtEntry>(MAP_CT)?;
    let mut new = t.hash::<Tuple, CtEntry>(MAP_CT_NEW)?;
    let mut c = Carried::default();
    // Iterating an LRU hash that the old programs still write can skip or
    // repeat keys (a key deleted under the cursor restarts the walk); both
    // are harmless here: a repeat is "present", a skip is caught up by
    // `finish`, or repaired by the program from the other half.
    for item in ct.iter() {
        let Ok((key, e)) = item else { continue };
        if established.get(&key, 0).is_ok() || new.get(&key, 0).is_ok() {
            c.ct_present += 1;
            continue;
        }
        let (entry, table) = v1::ct_entry(&key, &e);
        let map = if table == v1::CtTable::Established { &mut established } else { &mut new };
        match map.insert(&key, &entry, NOEXIST) {
            Ok(()) => c.ct_halves += 1,
            Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                c.ct_present += 1
            }
            Err(_) => c.ct_full += 1,
        }
    }
    Ok(c)
}

/// DNAT rules and their backends (ids are the agent's, kept in its state
/// dir, so they stay valid), and per-rule statistics. Entries the new
/// tables already hold win.
fn copy_rules(old: &Path, t: &Tables, c: &mut Carried) -> Result<()> {
    let rules: HashMap<_, DnatKey, v1::DnatRuleV1> = HashMap::try_from(Map::HashMap(old_map(old, MAP_DNAT_RULES)?))?;
    let mut new_rules = t.hash::<DnatKey, DnatRule>(MAP_DNAT_RULES)?;
    for (k, r) in rules.iter().flatten() {
        if new_rules.insert(&k, &v1::dnat_rule(&r), NOEXIST).is_ok() {
            c.dnat_rules += 1;
        }
    }
    let backends: HashMap<_, BackendKey, Backend> = HashMap::try_from(Map::HashMap(old_map(old, MAP_DNAT_BACKENDS)?))?;
    let mut new_backends = t.hash::<BackendKey, Backend>(MAP_DNAT_BACKENDS)?;
    for (k, b) in backends.iter().flatten() {
        if new_backends.insert(&k, &b, NOEXIST).is_ok() {
            c.backends += 1;
        }
    }
    let stats: PerCpuHashMap<_, u32, v1::RuleStatsV1> =
        PerCpuHashMap::try_from(Map::PerCpuLruHashMap(old_map(old, MAP_RULE_STATS)?))?;
    let mut new_stats: PerCpuHashMap<_, u32, RuleStats> =
        PerCpuHashMap::try_from(Map::PerCpuLruHashMap(t.data(MAP_RULE_STATS)?))?;
    for (id, per_cpu) in stats.iter().flatten() {
        let values: Vec<RuleStats> = per_cpu.iter().map(v1::rule_stats).collect();
        let values = PerCpuValues::try_from(values)?;
        if new_stats.insert(&id, values, NOEXIST).is_ok() {
            c.rule_stats += 1;
        }
    }
    Ok(())
}

/// Counters: the old values added to the new ones (per CPU), so totals
/// continue across the upgrade. Only on the first pass (`begin`).
fn copy_counters(old: &Path, t: &Tables) -> Result<()> {
    let counters: PerCpuArray<_, u64> = PerCpuArray::try_from(Map::PerCpuArray(old_map(old, MAP_COUNTERS)?))?;
    let mut new: PerCpuArray<_, u64> = PerCpuArray::try_from(Map::PerCpuArray(t.data(MAP_COUNTERS)?))?;
    for i in 0..v1::COUNTER_COUNT_V1 {
        let was = counters.get(&i, 0)?;
        let now = new.get(&i, 0)?;
        let sum: Vec<u64> = now.iter().zip(was.iter()).map(|(a, b)| a + b).collect();
        new.set(i, PerCpuValues::try_from(sum)?, 0)?;
    }
    // Zeroed so a repeated `begin` (a crash before `finish`) adds nothing twice.
    let mut counters = counters;
    let cpus = aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?;
    for i in 0..v1::COUNTER_COUNT_V1 {
        counters.set(i, PerCpuValues::try_from(vec![0u64; cpus.get() as usize])?, 0)?;
    }
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
