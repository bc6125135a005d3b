//! Loading the eBPF object for one zone, reusing (or creating) the pinned maps.

use std::path::Path;

use anyhow::{Context, Result, bail};
use aya::{Ebpf, EbpfError, EbpfLoader, maps::MapError, programs::SchedClassifier};

use super::{OBJECT, attach::Direction, pins};

/// The NAT program loaded for one zone. Dropping it does not detach anything
/// (attachments are owned by the kernel; see `attach`).
pub struct ZoneProgram {
    pub zone: u16,
    ebpf: Ebpf,
}

impl ZoneProgram {
    /// Loads the object with `ZONE = zone`, pinning its maps under `root`
    /// (or reusing compatible pins: conntrack and rules survive restarts).
    pub fn load(root: &Path, zone: u16) -> Result<Self> {
        Self::load_sized(root, zone, None)
    }

    /// Like `load`, with the established conntrack table sized to `ct_max`
    /// entries (two per flow) and the new-flow table to `ct_new_max(ct_max)`,
    /// instead of the built-in sizes. Reusing pins of another size is refused.
    pub fn load_sized(root: &Path, zone: u16, ct_max: Option<u32>) -> Result<Self> {
        let names = [Direction::Ingress, Direction::Egress].map(Direction::program);
        Ok(Self { zone, ebpf: load_programs(root, zone, ct_max, &names)? })
    }

    /// The ingress program (the NAT engine).
    pub fn program(&mut self) -> &mut SchedClassifier {
        self.program_for(Direction::Ingress)
    }

    pub fn program_for(&mut self, dir: Direction) -> &mut SchedClassifier {
        self.ebpf.program_mut(dir.program()).unwrap().try_into().unwrap()
    }
}

/// The proxy guard (`lbagent_proxy_guard`): one instance for every load
/// balancer's host-side link (it needs no zone: it reads only the socket's
/// owner and `proxy_guard`).
pub struct GuardProgram {
    ebpf: Ebpf,
}

impl GuardProgram {
    pub fn load(root: &Path, ct_max: Option<u32>) -> Result<Self> {
        Ok(Self { ebpf: load_programs(root, 0, ct_max, &[super::PROGRAM_PROXY_GUARD])? })
    }

    pub fn program(&mut self) -> &mut SchedClassifier {
        self.ebpf.program_mut(super::PROGRAM_PROXY_GUARD).unwrap().try_into().unwrap()
    }
}

/// Loads the object with `ZONE = zone` and its programs `names` (the
/// others stay unloaded), pinning its maps under `root` (or reusing
/// compatible pins: conntrack and rules survive restarts).
fn load_programs(root: &Path, zone: u16, ct_max: Option<u32>, names: &[&str]) -> Result<Ebpf> {
    if OBJECT.is_empty() {
        bail!("this lbagent was built without its eBPF object; build with `cargo xtask build`");
    }
    raise_memlock();
    pins::ensure_bpffs(root)?;
    pins::check_meta(root)?;
    let dir = pins::ensure_versioned_dir(root)?;
    let mut loader = EbpfLoader::new();
    let log_level = super::logs::level();
    loader.default_map_pin_directory(&dir).override_global("ZONE", &zone, true).override_global(
        aya_log::LEVEL,
        &log_level,
        false,
    );
    if let Some(n) = ct_max {
        loader.map_max_entries(lbagent_common::MAP_CT, n);
        loader.map_max_entries(lbagent_common::MAP_CT_NEW, lbagent_common::ct_new_max(n));
    }
    let mut ebpf = loader.load(OBJECT).map_err(|e| explain(e, &dir))?;
    super::logs::attach(&mut ebpf);
    pins::write_meta(root)?;
    for &name in names {
        let prog: &mut SchedClassifier = ebpf.program_mut(name).context("program missing from object")?.try_into()?;
        prog.load().with_context(|| format!("loading {name} (verifier)"))?;
    }
    // The loaded program holds its maps in the kernel and every user
    // opens them by pin: close this object's map fds, so a zone costs
    // its two program fds and the object's BTF fd (plus a log ring when
    // eBPF logs are on), not one fd per map (200 zones stay far below a
    // 1 024 fd limit).
    let maps: Vec<String> = ebpf.maps().map(|(name, _)| name.to_string()).collect();
    for name in maps {
        drop(ebpf.take_map(&name));
    }
    Ok(ebpf)
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
