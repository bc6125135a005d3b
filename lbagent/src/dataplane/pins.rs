//! The pin directory: bpffs mounted, versioned by layout, checked before reuse.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::maps::{Array, Map, MapData};
use lbagent_common::{LAYOUT_VERSION, MAP_META, MapDef, MapKind, Meta};

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// `<root>/v<LAYOUT_VERSION>`: where this build's maps are pinned.
pub fn versioned_dir(root: &Path) -> PathBuf {
    version_dir(root, LAYOUT_VERSION)
}

/// `<root>/v<version>`: where a build of that layout pins its maps.
pub fn version_dir(root: &Path, version: u32) -> PathBuf {
    root.join(format!("v{version}"))
}

/// Directory for pinned tcx links.
pub fn links_dir(root: &Path) -> PathBuf {
    versioned_dir(root).join("links")
}

/// Directory of every build's pinned programs.
fn programs_root(root: &Path) -> PathBuf {
    versioned_dir(root).join("progs")
}

/// `<root>/v<N>/progs/<object id>`: the programs a build of that object
/// pinned (`loader`), one directory per object so that a run of another
/// build never takes them.
pub fn programs_dir(root: &Path, object_id: u64) -> PathBuf {
    programs_root(root).join(format!("{object_id:016x}"))
}

/// Who owns a pinned program: zone `zone`'s NAT programs…
pub fn zone_owner(zone: u16) -> String {
    format!("z{zone}")
}

/// …or the proxy guard (one instance for every load balancer).
pub const GUARD_OWNER: &str = "guard";

/// File name of `owner`'s pinned program `program`.
pub fn program_pin_name(owner: &str, program: &str) -> String {
    format!("{owner}_{program}")
}

/// Removes the programs other builds pinned (an upgrade leaves them; the
/// interfaces that still run them hold them until re-attached).
pub fn remove_other_builds(root: &Path, keep: &Path) -> Result<()> {
    for entry in fs::read_dir(programs_root(root)).into_iter().flatten().flatten() {
        let path = entry.path();
        if path != keep {
            fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// Removes zone `zone`'s pinned programs, of every build (the zone is gone).
pub fn remove_zone_programs(root: &Path, zone: u16) -> Result<()> {
    let prefix = format!("{}_", zone_owner(zone));
    for build in fs::read_dir(programs_root(root)).into_iter().flatten().flatten() {
        for entry in fs::read_dir(build.path()).into_iter().flatten().flatten() {
            if entry.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
                let path = entry.path();
                fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
            }
        }
    }
    Ok(())
}

/// The id of every map of this layout pinned under `root`, by pin name;
/// `None` when one is missing.
pub fn pinned_map_ids(root: &Path) -> Option<std::collections::HashMap<&'static str, u32>> {
    let dir = versioned_dir(root);
    lbagent_common::ALL_MAPS
        .iter()
        .map(|m| Some((m.name, MapData::from_pin(dir.join(m.name)).ok()?.info().ok()?.id())))
        .collect()
}

/// Mounts bpffs at /sys/fs/bpf (mode 0700) when `root` is not on a bpffs,
/// then creates `root` (mode 0700) and checks that it is the agent's and
/// writable by nobody else: whoever can write the pins steers the dataplane.
/// Nothing under `root` is created here: a build that `check_meta` refuses
/// must leave no directory of its layout behind.
pub fn ensure_bpffs(root: &Path) -> Result<()> {
    let probe = root.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"));
    if !is_bpffs(probe)? {
        let mnt = Path::new("/sys/fs/bpf");
        if !root.starts_with(mnt) {
            bail!(
                "--bpffs {}: not on a bpf filesystem (mount one there or use a path under /sys/fs/bpf)",
                root.display()
            );
        }
        if !is_bpffs(mnt)? {
            fs::create_dir_all(mnt)?;
            nix::mount::mount(Some("bpffs"), mnt, Some("bpf"), nix::mount::MsFlags::empty(), Some("mode=0700"))
                .context("mounting bpffs at /sys/fs/bpf")?;
        }
    }
    crate::files::ensure_private_dir(root).context("--bpffs")
}

/// `versioned_dir(root)`, created when missing (after `check_meta`, before
/// maps are pinned there).
pub fn ensure_versioned_dir(root: &Path) -> Result<PathBuf> {
    let dir = versioned_dir(root);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// `links_dir(root)`, created when missing (before a link is pinned there).
pub fn ensure_links_dir(root: &Path) -> Result<PathBuf> {
    let dir = links_dir(root);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

fn is_bpffs(path: &Path) -> Result<bool> {
    let st = nix::sys::statfs::statfs(path).with_context(|| format!("statfs {}", path.display()))?;
    Ok(st.filesystem_type().0 as i64 == BPF_FS_MAGIC)
}

/// Refuses pins made by an incompatible build; returns whether pins exist.
///
/// Two cases: this build's directory holds a `meta` of another version (a
/// newer agent migrated away from it and left it as a marker, or it was
/// tampered with), or a newer layout's directory is live (a newer agent
/// runs the dataplane). Either way this build would replace the newer
/// programs with ones that cannot see their maps, losing every flow: a
/// downgrade is refused before anything is touched.
pub fn check_meta(root: &Path) -> Result<bool> {
    if let Some(newer) = newer_live_version(root) {
        bail!(
            "the dataplane under {} runs pins of layout version {newer} (a newer lbagent); this lbagent uses \
             layout {LAYOUT_VERSION} and cannot take it over without losing every flow: downgrade refused. \
             Run the newer lbagent, or tear the dataplane down (`lbagent teardown`) and start over",
            root.display()
        );
    }
    let path = versioned_dir(root).join(MAP_META.name);
    if !path.exists() {
        return Ok(false);
    }
    let meta = read_meta(&path)?;
    if meta.layout_version > LAYOUT_VERSION {
        bail!(
            "pinned maps in {} were migrated to layout version {} by a newer lbagent; this lbagent uses \
             layout {LAYOUT_VERSION}: downgrade refused (it would lose every flow). Run the newer lbagent, \
             or tear the dataplane down (`lbagent teardown`) and start over",
            versioned_dir(root).display(),
            meta.layout_version,
        );
    }
    if meta.layout_version != 0 && meta.layout_version != LAYOUT_VERSION {
        bail!(
            "pinned maps in {} have layout version {}, this lbagent uses {}; \
             tear the old dataplane down or use another --bpffs",
            versioned_dir(root).display(),
            meta.layout_version,
            LAYOUT_VERSION
        );
    }
    Ok(true)
}

/// The layout version recorded in `<root>/v<version>/meta`, if pinned.
pub fn meta_version(root: &Path, version: u32) -> Result<Option<u32>> {
    let path = version_dir(root, version).join(MAP_META.name);
    if !path.exists() {
        return Ok(None);
    }
    Ok(Some(read_meta(&path)?.layout_version))
}

/// Every layout version's directory under `root` (`v<version>`), with its version.
pub fn version_dirs(root: &Path) -> Vec<(u32, PathBuf)> {
    fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.strip_prefix('v')?.parse::<u32>().ok()?;
            Some((v, e.path()))
        })
        .collect()
}

/// A newer layout whose maps are live (its `meta` says its own version).
fn newer_live_version(root: &Path) -> Option<u32> {
    version_dirs(root)
        .into_iter()
        .filter(|(v, _)| *v > LAYOUT_VERSION)
        .filter(|(v, _)| is_live(root, *v))
        .map(|(v, _)| v)
        .max()
}

fn read_meta(path: &Path) -> Result<Meta> {
    let data = MapData::from_pin(path).with_context(|| format!("opening {}", path.display()))?;
    let arr: Array<_, Meta> = Array::try_from(map_of(MAP_META, data))?;
    Ok(arr.get(&0, 0)?)
}

/// Records this build's layout version in the `meta` map.
pub fn write_meta(root: &Path) -> Result<()> {
    write_meta_in(&versioned_dir(root))
}

/// Sets `<dir>/meta` to this build's layout version.
fn write_meta_in(dir: &Path) -> Result<()> {
    let data = MapData::from_pin(dir.join(MAP_META.name))?;
    let mut arr: Array<_, Meta> = Array::try_from(map_of(MAP_META, data))?;
    arr.set(0, &Meta { layout_version: LAYOUT_VERSION, _pad0: 0 }, 0)?;
    Ok(())
}

/// Whether `<root>/v<version>` holds a live dataplane of that layout (its
/// `meta` names its own version; a marker names a newer one).
pub fn is_live(root: &Path, version: u32) -> bool {
    meta_version(root, version).ok().flatten() == Some(version)
}

/// Older layouts' directories under `root` whose maps are live (their
/// `meta` names their own version): (version, directory), oldest first.
/// Migration markers are not listed.
pub fn older_live_versions(root: &Path) -> Vec<(u32, PathBuf)> {
    let mut v: Vec<(u32, PathBuf)> =
        version_dirs(root).into_iter().filter(|(v, _)| *v < LAYOUT_VERSION && is_live(root, *v)).collect();
    v.sort();
    v
}

/// Whether `<root>/v<version>` is what a migration leaves behind: its
/// `meta` names a newer layout (so that agent refuses to start) and its
/// maps are gone.
pub fn is_marker(root: &Path, version: u32) -> bool {
    meta_version(root, version).ok().flatten().is_some_and(|m| m > version)
}

/// Turns `<root>/v<version>` into a migration marker: every pin but `meta`
/// removed (the programs that still use those maps keep them alive until
/// they are replaced), `meta` set to this build's layout, which makes an
/// agent of that version refuse to start (its check reads `meta` first).
pub fn leave_marker(root: &Path, version: u32) -> Result<()> {
    let dir = version_dir(root, version);
    for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.file_name().is_some_and(|n| n == MAP_META.name) {
            continue;
        }
        let removed = if path.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
        removed.with_context(|| format!("removing {}", path.display()))?;
    }
    write_meta_in(&dir)
}

/// Removes every pin of this build under `root` (maps and links) and the
/// markers of layouts migrated from.
pub fn remove_all(root: &Path) -> Result<()> {
    let markers = version_dirs(root).into_iter().filter(|(v, _)| *v < LAYOUT_VERSION && is_marker(root, *v));
    for dir in markers.map(|(_, p)| p).chain([versioned_dir(root)]) {
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
    }
    let _ = fs::remove_dir(root);
    Ok(())
}
/// An opened pin as aya's map of the kind `def` declares (the one place a
/// kind becomes aya's variant).
pub fn map_of<K, V>(def: MapDef<K, V>, data: MapData) -> Map {
    match def.kind {
        MapKind::Hash => Map::HashMap(data),
        MapKind::LruHash => Map::LruHashMap(data),
        MapKind::Array => Map::Array(data),
        MapKind::PerCpuArray => Map::PerCpuArray(data),
        MapKind::LruPerCpuHash => Map::PerCpuLruHashMap(data),
        MapKind::LpmTrie => Map::LpmTrie(data),
        MapKind::HashOfMaps => Map::HashOfMaps(data),
        MapKind::RingBuf => Map::RingBuf(data),
    }
}
