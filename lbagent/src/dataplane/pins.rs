//! The pin directory: bpffs mounted, versioned by layout, checked before reuse.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::maps::{Array, MapData};
use lbagent_common::{LAYOUT_VERSION, MAP_META, Meta};

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// `<root>/v<LAYOUT_VERSION>`: where this build's maps are pinned.
pub fn versioned_dir(root: &Path) -> PathBuf {
    root.join(format!("v{LAYOUT_VERSION}"))
}

/// Directory for pinned tcx links.
pub fn links_dir(root: &Path) -> PathBuf {
    versioned_dir(root).join("links")
}

/// Mounts bpffs at /sys/fs/bpf (mode 0700) when `root` is not on a bpffs,
/// then creates `root` (mode 0700) and checks that it is the agent's and
/// writable by nobody else: whoever can write the pins steers the dataplane.
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
    crate::files::ensure_private_dir(root).context("--bpffs")?;
    fs::create_dir_all(links_dir(root)).with_context(|| format!("creating {}", root.display()))?;
    Ok(())
}

fn is_bpffs(path: &Path) -> Result<bool> {
    let st = nix::sys::statfs::statfs(path).with_context(|| format!("statfs {}", path.display()))?;
    Ok(st.filesystem_type().0 as i64 == BPF_FS_MAGIC)
}

/// Refuses pins made by an incompatible build; returns whether pins exist.
///
/// Pins of other layout versions live in other directories and are never
/// opened; this catches a same-version directory whose `meta` disagrees.
pub fn check_meta(root: &Path) -> Result<bool> {
    let path = versioned_dir(root).join(MAP_META);
    if !path.exists() {
        return Ok(false);
    }
    let meta = read_meta(&path)?;
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

fn read_meta(path: &Path) -> Result<Meta> {
    let data = MapData::from_pin(path).with_context(|| format!("opening {}", path.display()))?;
    let arr: Array<_, Meta> = Array::try_from(aya::maps::Map::Array(data))?;
    Ok(arr.get(&0, 0)?)
}

/// Records this build's layout version in the `meta` map.
pub fn write_meta(root: &Path) -> Result<()> {
    let path = versioned_dir(root).join(MAP_META);
    let data = MapData::from_pin(&path)?;
    let mut arr: Array<_, Meta> = Array::try_from(aya::maps::Map::Array(data))?;
    arr.set(0, &Meta { layout_version: LAYOUT_VERSION, _pad0: 0 }, 0)?;
    Ok(())
}

/// Lists other layout versions' pin dirs under `root` (left by older builds).
pub fn stale_versions(root: &Path) -> Vec<PathBuf> {
    let current = versioned_dir(root);
    fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p != &current && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('v')))
        .collect()
}

/// Removes every pin of this build under `root` (maps and links).
pub fn remove_all(root: &Path) -> Result<()> {
    let dir = versioned_dir(root);
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let _ = fs::remove_dir(root);
    Ok(())
}
