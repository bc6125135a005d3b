//! Loading the eBPF object for one zone, reusing (or creating) the pinned maps.

use std::{fs, path::Path};

use anyhow::{Context, Result, bail};
use aya::{Ebpf, EbpfError, EbpfLoader, maps::MapError, programs::SchedClassifier};

use super::{OBJECT, attach::Direction, pins};

/// The two conntrack tables' sizes in entries (two per flow), fixed for the
/// life of their pins: `ct` (`--conntrack-max`) holds established flows,
/// `ct_new` (`--conntrack-new-max`) the flows not established yet, an LRU
/// sized by how many of those a host has at once (see `docs/operations.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtSizes {
    pub established: u32,
    pub new: u32,
}

impl Default for CtSizes {
    fn default() -> Self {
        Self::new(None, None)
    }
}

impl CtSizes {
    /// The sizes asked for; the built-in size ([`lbagent_common::CT_MAX`],
    /// also the smallest default [`CtSizes::resolve`] picks) for
    /// `established`, and a quarter of `established` (at least 256) for
    /// `new`, when not given.
    pub fn new(established: Option<u32>, new: Option<u32>) -> Self {
        let established = established.unwrap_or(lbagent_common::CT_MAX);
        Self { established, new: new.unwrap_or(lbagent_common::ct_new_max(established)) }
    }

    /// The sizes a start of the agent uses, and where `established` came
    /// from. A size asked for is used as asked (pins of another size are
    /// then refused, [`CtSizes::check_pins`]). A size not asked for is the
    /// pinned table's: this layout's, or else a running older layout's
    /// that the migration carries over (each table on its own: a start that
    /// crashed while taking over the old tables pinned one of them). So a
    /// default never refuses a restart, and a host whose memory changed
    /// keeps its tables. `new` follows the pinned `ct_new` only while
    /// `established` is the pinned `ct`'s size: a `--conntrack-max` that
    /// resizes `ct` gets a quarter of it, as documented. On a fresh
    /// dataplane `established` is [`CtSizes::for_memory`] of the host's
    /// memory and `new` a quarter of it.
    pub fn resolve(root: &Path, established: Option<u32>, new: Option<u32>) -> Result<(Self, SizeOrigin)> {
        let dirs: Vec<std::path::PathBuf> = std::iter::once(pins::versioned_dir(root))
            .chain(pins::older_live_versions(root).into_iter().rev().map(|(_, dir)| dir))
            .collect();
        let pinned_ct = pinned_size(&dirs, lbagent_common::MAP_CT.name)?;
        let pinned_new = pinned_size(&dirs, lbagent_common::MAP_CT_NEW.name)?.map(|(size, _)| size);
        let established_as_pinned = match (established, &pinned_ct) {
            (Some(asked), Some((pinned, _))) => asked == *pinned,
            (None, Some(_)) => true,
            _ => false,
        };
        let new = new.or(pinned_new.filter(|_| established_as_pinned));
        Ok(match (established, pinned_ct) {
            (Some(established), _) => (Self::new(Some(established), new), SizeOrigin::Asked),
            (None, Some((pinned, dir))) => (Self::new(Some(pinned), new), SizeOrigin::Pinned(dir)),
            (None, None) => {
                let memory = meminfo("MemTotal")?;
                (Self::new(Some(Self::for_memory(memory)), new), SizeOrigin::Memory(memory))
            }
        })
    }

    /// The established table's default size on a host with `memory` bytes:
    /// the largest power of two of entries whose two tables take at most
    /// `1/DEFAULT_MEMORY_SHARE` of it (`ct` and a quarter as many `ct_new`
    /// entries, [`KERNEL_BYTES_PER_CT_ENTRY`] each), between
    /// [`lbagent_common::CT_MAX`] and [`DEFAULT_CT_MAX_CEILING`].
    pub fn for_memory(memory: u64) -> u32 {
        let entries = memory / DEFAULT_MEMORY_SHARE / (KERNEL_BYTES_PER_CT_ENTRY * 5 / 4);
        let pow2 = if entries == 0 { 1 } else { 1u64 << (63 - entries.leading_zeros()) };
        pow2.clamp(u64::from(lbagent_common::CT_MAX), u64::from(DEFAULT_CT_MAX_CEILING)) as u32
    }

    /// Each table with its size and the flag that sets it.
    fn tables(self) -> [(&'static str, u32, &'static str); 2] {
        [
            (lbagent_common::MAP_CT.name, self.established, "--conntrack-max"),
            (lbagent_common::MAP_CT_NEW.name, self.new, "--conntrack-new-max"),
        ]
    }

    /// Refuses pinned conntrack tables of other sizes under `root`, naming
    /// the table, both sizes and the flag (a table cannot be resized in
    /// place: a start with other sizes would fail to load, or lose every
    /// flow). Tables not pinned yet are created with these sizes.
    pub fn check_pins(self, root: &Path) -> Result<()> {
        let dir = pins::versioned_dir(root);
        for (name, want, flag) in self.tables() {
            let Ok(map) = aya::maps::MapData::from_pin(dir.join(name)) else { continue };
            let have = map.info().with_context(|| format!("reading the pinned {name}"))?.max_entries();
            if have != want {
                bail!(
                    "the pinned conntrack table `{name}` under {} holds {have} entries, but {flag} asks for {want} \
                     (a size not given is the pinned one); a table's size is \
                     fixed for the life of its pins: start with {flag} {have}, or tear the dataplane down \
                     (`lbagent teardown`, which drops every flow) to resize it",
                    dir.display()
                );
            }
        }
        Ok(())
    }
}

/// Where a start's conntrack sizes came from ([`CtSizes::resolve`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SizeOrigin {
    /// `--conntrack-max`.
    Asked,
    /// The tables pinned in this directory.
    Pinned(std::path::PathBuf),
    /// The host's memory (bytes): a fresh dataplane's default.
    Memory(u64),
}

impl std::fmt::Display for SizeOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SizeOrigin::Asked => write!(f, "--conntrack-max"),
            SizeOrigin::Pinned(dir) => write!(f, "the tables pinned in {}", dir.display()),
            SizeOrigin::Memory(m) => write!(
                f,
                "1/{DEFAULT_MEMORY_SHARE} of the host's {:.1} GiB (the default for a new dataplane)",
                *m as f64 / f64::from(1u32 << 30)
            ),
        }
    }
}

/// A new dataplane's conntrack tables take at most this fraction (1/N) of
/// the host's memory by default ([`CtSizes::for_memory`]).
pub const DEFAULT_MEMORY_SHARE: u64 = 64;

/// Kernel memory (bpftool's `memlock`) per conntrack entry of either
/// table, measured at every size from 262 144 to 2 097 152 entries: the
/// 16-byte key, the 48-byte entry, the kernel's element header (48 bytes)
/// and a bucket (16).
pub const KERNEL_BYTES_PER_CT_ENTRY: u64 = 128;

/// The largest default `ct`: 4 194 304 entries (2 097 152 flows), 671 MB
/// with its `ct_new`, which leaves room under the packaged unit's
/// `MemoryMax=2G` (a larger table is asked for with `--conntrack-max`).
pub const DEFAULT_CT_MAX_CEILING: u32 = 1 << 22;

/// The size of the first of `dirs` that pins table `name`, and that
/// directory. A pin that is there but cannot be read is an error (taking
/// it for absent would size a new table and then refuse the start).
fn pinned_size(dirs: &[std::path::PathBuf], name: &str) -> Result<Option<(u32, std::path::PathBuf)>> {
    for dir in dirs {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let map = aya::maps::MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
        let info = map.info().with_context(|| format!("reading {}", path.display()))?;
        return Ok(Some((info.max_entries(), dir.clone())));
    }
    Ok(None)
}

/// A `/proc/meminfo` figure in bytes (`field` without its colon, e.g.
/// `MemTotal`).
pub fn meminfo(field: &str) -> Result<u64> {
    let info = fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let kb: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in /proc/meminfo"))?;
    Ok(kb * 1024)
}

/// The NAT programs loaded for one zone. Dropping them does not detach
/// anything (attachments are owned by the kernel; see `attach`).
pub struct ZoneProgram {
    pub zone: u16,
    programs: Programs,
}

impl ZoneProgram {
    /// Loads the object with `ZONE = zone`, pinning its maps under `root`
    /// (or reusing compatible pins: conntrack and rules survive restarts).
    pub fn load(root: &Path, zone: u16) -> Result<Self> {
        Self::load_sized(root, zone, CtSizes::default())
    }

    /// Like `load`, with the conntrack tables of `sizes` instead of the
    /// built-in ones. Pins of other sizes are refused ([`CtSizes::check_pins`]).
    pub fn load_sized(root: &Path, zone: u16, sizes: CtSizes) -> Result<Self> {
        let names = [Direction::Ingress, Direction::Egress].map(Direction::program);
        Ok(Self { zone, programs: load_programs(root, &pins::zone_owner(zone), zone, sizes, &names)? })
    }

    /// The ingress program (the NAT engine).
    pub fn program(&mut self) -> &mut SchedClassifier {
        self.program_for(Direction::Ingress)
    }

    pub fn program_for(&mut self, dir: Direction) -> &mut SchedClassifier {
        self.programs.get(dir.program())
    }

    /// Whether the programs were taken from their pins (loaded and verified
    /// by an earlier run of this build) rather than loaded now.
    pub fn reused(&self) -> bool {
        self.programs.reused
    }
}

/// The proxy guard (`lbagent_proxy_guard`): one instance for every load
/// balancer's host-side link (it needs no zone: it reads only the socket's
/// owner and `proxy_guard`).
pub struct GuardProgram {
    programs: Programs,
}

impl GuardProgram {
    pub fn load(root: &Path, sizes: CtSizes) -> Result<Self> {
        let names = [super::PROGRAM_PROXY_GUARD];
        Ok(Self { programs: load_programs(root, pins::GUARD_OWNER, 0, sizes, &names)? })
    }

    pub fn program(&mut self) -> &mut SchedClassifier {
        self.programs.get(super::PROGRAM_PROXY_GUARD)
    }
}

/// Loaded programs of one owner (a zone, or the guard): opened from their
/// pins, or held by the object they were loaded from when eBPF logs are on
/// (the object owns each instance's log ring, which a later run cannot
/// take over, so those programs are neither pinned nor reused).
struct Programs {
    held: Held,
    reused: bool,
}

enum Held {
    Pinned(Vec<(&'static str, SchedClassifier)>),
    Object(Box<Ebpf>),
}

impl Programs {
    fn get(&mut self, name: &str) -> &mut SchedClassifier {
        match &mut self.held {
            Held::Pinned(progs) => &mut progs.iter_mut().find(|(n, _)| *n == name).expect("a loaded program").1,
            Held::Object(ebpf) => ebpf.program_mut(name).unwrap().try_into().unwrap(),
        }
    }
}

/// Loads the object with `ZONE = zone` and its programs `names` (the
/// others stay unloaded), pinning its maps under `root` (or reusing
/// compatible pins: conntrack and rules survive restarts).
///
/// The programs are pinned under `pins::programs_dir` for `owner`, and a
/// later run of the same object reuses them instead of loading (and the
/// verifier checking) them again, when they still use the pinned maps: a
/// restart over hundreds of zones then costs an open per program, not a
/// verification each. Another object (an upgrade), other maps (a pin
/// deleted while the agent was down) or eBPF logs on: loaded afresh.
fn load_programs(root: &Path, owner: &str, zone: u16, sizes: CtSizes, names: &[&'static str]) -> Result<Programs> {
    prepare(root, sizes)?;
    let (log_level, build) = (super::logs::level(), pins::programs_dir(root, object_id()));
    let logs = log_level != 0;
    if !logs && let Some(progs) = reuse(root, &build, owner, names) {
        // As a load does: the layout check of older and newer builds reads it.
        pins::write_meta(root)?;
        return Ok(Programs { held: Held::Pinned(progs), reused: true });
    }
    let mut ebpf = load_object(root, zone, sizes, names)?;
    // The loaded program holds its maps in the kernel and every user
    // opens them by pin: close this object's map fds, so a zone costs
    // its two program fds (plus, with eBPF logs on, the object's BTF fd
    // and a log ring), not one fd per map (200 zones stay far below a
    // 1 024 fd limit).
    let maps: Vec<String> = ebpf.maps().map(|(name, _)| name.to_string()).collect();
    for name in maps {
        drop(ebpf.take_map(&name));
    }
    if logs {
        return Ok(Programs { held: Held::Object(Box::new(ebpf)), reused: false });
    }
    pins::remove_other_builds(root, &build)?;
    fs::create_dir_all(&build).with_context(|| format!("creating {}", build.display()))?;
    let mut progs = Vec::new();
    for &name in names {
        let path = build.join(pins::program_pin_name(owner, name));
        // A pin that `reuse` refused (it uses other maps) is replaced.
        if path.exists() {
            fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
        let prog: &mut SchedClassifier = ebpf.program_mut(name).unwrap().try_into()?;
        prog.pin(&path).with_context(|| format!("pinning {name} at {}", path.display()))?;
        progs.push((name, SchedClassifier::from_pin(&path)?));
    }
    Ok(Programs { held: Held::Pinned(progs), reused: false })
}

/// The checks before a load: the bpffs, the layout's `meta`, the pinned
/// tables' sizes.
fn prepare(root: &Path, sizes: CtSizes) -> Result<()> {
    if OBJECT.is_empty() {
        bail!("this lbagent was built without its eBPF object; build with `cargo xtask build`");
    }
    raise_memlock();
    pins::ensure_bpffs(root)?;
    pins::check_meta(root)?;
    sizes.check_pins(root)
}

/// Loads the object with `ZONE = zone` (creating or reusing the pinned
/// maps under `root`) and its programs `names` (the others stay unloaded),
/// after [`prepare`]. With eBPF logs on, the programs log (the object owns
/// their log ring).
fn load_object(root: &Path, zone: u16, sizes: CtSizes, names: &[&'static str]) -> Result<Ebpf> {
    let dir = pins::ensure_versioned_dir(root)?;
    let mut ebpf = load_from(&dir, zone, sizes, super::logs::level()).map_err(|e| explain(e, &dir))?;
    super::logs::attach(&mut ebpf);
    pins::write_meta(root)?;
    verify(&mut ebpf, names)?;
    Ok(ebpf)
}

/// The object with its maps from (or pinned into) `dir`, its programs not
/// loaded yet.
fn load_from(dir: &Path, zone: u16, sizes: CtSizes, log_level: u8) -> Result<Ebpf, EbpfError> {
    let mut loader = EbpfLoader::new();
    loader.default_map_pin_directory(dir).override_global("ZONE", &zone, true).override_global(
        aya_log::LEVEL,
        &log_level,
        false,
    );
    for (name, size, _) in sizes.tables() {
        loader.map_max_entries(name, size);
    }
    // Every flow both tables hold may be logged, with its counts in
    // `flow_acct` (not preallocated: the size costs only its buckets).
    // Counts outlive their entries until the next scan (an evicted
    // `ct_new` flow's): room for a flow per entry of both tables.
    let acct = (u64::from(sizes.established) + u64::from(sizes.new)).min(u64::from(u32::MAX)) as u32;
    loader.map_max_entries(lbagent_common::MAP_FLOW_ACCT.name, acct);
    // The previous layout's tables, pinned by an upgrade at their own size
    // (`migrate`), and a pinned `flow_acct` are reused as they are.
    for name in
        [lbagent_common::MAP_CT_PREV.name, lbagent_common::MAP_CT_NEW_PREV.name, lbagent_common::MAP_FLOW_ACCT.name]
    {
        if let Ok(info) = aya::maps::MapData::from_pin(dir.join(name)).and_then(|m| m.info()) {
            loader.map_max_entries(name, info.max_entries());
        }
    }
    loader.load(OBJECT)
}

/// Loads (the verifier checks) the object's programs `names`.
fn verify(ebpf: &mut Ebpf, names: &[&'static str]) -> Result<()> {
    for &name in names {
        let prog: &mut SchedClassifier = ebpf.program_mut(name).context("program missing from object")?.try_into()?;
        prog.load().with_context(|| format!("loading {name} (verifier)"))?;
    }
    Ok(())
}

/// The conntrack garbage collector (`lbagent_ct_gc`), loaded on the maps
/// of a running dataplane (their sizes as pinned) and held by its object:
/// never pinned or attached, it is run by `ct_gc` and goes with its
/// holder. A load changes nothing under the pins: every map of this build
/// must be pinned already (a load would otherwise create and pin the
/// missing ones), `meta` is not written, and the program never logs.
pub struct GcProgram {
    ebpf: Ebpf,
    /// The ids of the conntrack tables it was loaded on (`ct`, `ct_new`).
    tables: [u32; 2],
}

impl GcProgram {
    pub fn load(root: &Path) -> Result<Self> {
        let (sizes, _) = CtSizes::resolve(root, None, None)?;
        prepare(root, sizes)?;
        let tables = Self::pinned_tables(root)?;
        let dir = pins::versioned_dir(root);
        let mut ebpf = load_from(&dir, 0, sizes, 0)
            .with_context(|| format!("loading the garbage collector on the maps pinned in {}", dir.display()))?;
        verify(&mut ebpf, &[super::PROGRAM_CT_GC])?;
        Ok(Self { ebpf, tables })
    }

    /// The pinned conntrack tables' ids, when every map of this build is
    /// pinned under `root`.
    fn pinned_tables(root: &Path) -> Result<[u32; 2]> {
        let ids = pins::pinned_map_ids(root).with_context(|| {
            format!(
                "the dataplane under {} lacks maps of this build (a dataplane of another build of layout {}):                  garbage collection needs the agent of this build to have started on it",
                root.display(),
                lbagent_common::LAYOUT_VERSION
            )
        })?;
        Ok([ids[lbagent_common::MAP_CT.name], ids[lbagent_common::MAP_CT_NEW.name]])
    }

    /// Whether the program still works on the tables pinned under `root`
    /// (they were not replaced since it was loaded: a teardown and a new
    /// dataplane).
    pub fn current(&self, root: &Path) -> bool {
        Self::pinned_tables(root).is_ok_and(|t| t == self.tables)
    }

    pub fn program(&mut self) -> &mut SchedClassifier {
        self.ebpf.program_mut(super::PROGRAM_CT_GC).expect("loaded").try_into().expect("a classifier")
    }
}

/// `owner`'s programs `names` from their pins in `build`, when every one
/// is pinned and uses exactly the maps pinned now (by name and id); else
/// `None` (and the caller loads them afresh).
fn reuse(
    root: &Path,
    build: &Path,
    owner: &str,
    names: &[&'static str],
) -> Option<Vec<(&'static str, SchedClassifier)>> {
    let pinned = pins::pinned_map_ids(root)?;
    let mut progs = Vec::new();
    for &name in names {
        let path = build.join(pins::program_pin_name(owner, name));
        let prog = SchedClassifier::from_pin(&path).ok()?;
        // The object's own maps (`.rodata`, `.bss`) are not pinned; every
        // other map must be the one pinned under its name.
        for id in prog.info().ok()?.map_ids().ok()??.into_iter() {
            let info = aya::maps::MapData::from_id(id).ok()?.info().ok()?;
            let pinned_id = info.name_as_str().and_then(lbagent_common::pin_name_of).and_then(|n| pinned.get(n));
            if pinned_id.is_some_and(|&want| want != id) {
                return None;
            }
        }
        progs.push((name, prog));
    }
    Some(progs)
}

/// Identifies the embedded object (FNV-1a over its bytes, computed once):
/// programs pinned by a run of the same object are reused.
pub fn object_id() -> u64 {
    static ID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        OBJECT.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
    })
}

fn explain(e: EbpfError, dir: &Path) -> anyhow::Error {
    match e {
        EbpfError::MapError(MapError::IncompatiblePinnedMap { .. }) => anyhow::anyhow!(
            "a pinned map in {} is incompatible with this build or its settings ({e}); \
             tear the old dataplane down or use another --bpffs",
            dir.display()
        ),
        e => anyhow::Error::new(e).context("loading eBPF object"),
    }
}

/// Kernels < 5.11 charge BPF memory to RLIMIT_MEMLOCK.
fn raise_memlock() {
    use nix::sys::resource::{RLIM_INFINITY, Resource, setrlimit};
    // Failure leaves the old limit (5.11+ does not need it).
    let _ = setrlimit(Resource::RLIMIT_MEMLOCK, RLIM_INFINITY, RLIM_INFINITY);
}

/// Raises the soft RLIMIT_NOFILE to the hard limit (a host with hundreds
/// of load balancers and gateways holds a program fd per zone, netlink and
/// namespace fds, and the metrics and API sockets). Returns the new soft limit.
pub fn raise_nofile() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return 0 };
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return hard;
    }
    soft
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_table_is_a_share_of_memory_in_powers_of_two_within_bounds() {
        const GIB: u64 = 1 << 30;
        // 1/64 of 24 GiB is 384 MiB: 2 097 152 entries take 2 097 152 ×
        // 160 B = 320 MiB with their quarter of `ct_new`; twice as many would not fit.
        assert_eq!(CtSizes::for_memory(24 * GIB), 2_097_152);
        const {
            assert!(2_097_152 * KERNEL_BYTES_PER_CT_ENTRY * 5 / 4 <= 24 * GIB / DEFAULT_MEMORY_SHARE);
            assert!(4_194_304 * KERNEL_BYTES_PER_CT_ENTRY * 5 / 4 > 24 * GIB / DEFAULT_MEMORY_SHARE);
        }
        // Small hosts keep the built-in size; huge ones stop at the ceiling.
        assert_eq!(CtSizes::for_memory(GIB), lbagent_common::CT_MAX);
        assert_eq!(CtSizes::for_memory(0), lbagent_common::CT_MAX);
        assert_eq!(CtSizes::for_memory(4096 * GIB), DEFAULT_CT_MAX_CEILING);
        for memory in [3 * GIB, 10 * GIB, 100 * GIB] {
            assert!(CtSizes::for_memory(memory).is_power_of_two());
        }
    }
}
