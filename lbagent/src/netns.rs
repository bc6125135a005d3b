//! Network namespaces. Netlink sockets, interface lookups and TC/tcx attaches
//! act in the *calling thread's* namespace, so work for a namespace runs on a
//! scoped thread that has entered it with `setns(CLONE_NEWNET)`. Never through
//! `ip netns exec`: it remounts /sys and bpffs pins made under it vanish.

use std::{fs::File, path::PathBuf};

use anyhow::{Context, Result, anyhow};
use nix::sched::{CloneFlags, setns};

/// Where `ip netns` (and lbagent) keep named namespaces.
pub const NETNS_RUN_DIR: &str = "/run/netns";

pub fn path(name: &str) -> PathBuf {
    PathBuf::from(NETNS_RUN_DIR).join(name)
}

/// Runs `f` on a new thread inside namespace `name` (the caller's when `None`).
pub fn run_in<T: Send>(name: Option<&str>, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let file = match name {
        Some(name) => Some(File::open(path(name)).with_context(|| format!("network namespace {name} not found"))?),
        None => None,
    };
    let label = name.unwrap_or("host");
    // Always a fresh thread: it carries the namespace, and it is outside any
    // async runtime, so blocking netlink clients may run there.
    std::thread::scope(|s| {
        s.spawn(move || {
            if let Some(file) = &file {
                setns(file, CloneFlags::CLONE_NEWNET).with_context(|| format!("entering network namespace {label}"))?;
            }
            f()
        })
        .join()
        .map_err(|_| anyhow!("thread working in network namespace {label} panicked"))?
    })
}

/// Interface index of `ifname` in the current thread's namespace.
pub fn ifindex(ifname: &str) -> Result<u32> {
    nix::net::if_::if_nametoindex(ifname).with_context(|| format!("interface {ifname} not found"))
}

/// Creates named namespace `name` (like `ip netns add`) unless it exists:
/// a fresh namespace from a thread's `unshare`, bind-mounted at /run/netns.
pub fn create(name: &str) -> Result<bool> {
    let target = path(name);
    if target.exists() && File::open(&target).is_ok_and(|f| is_netns(&f)) {
        return Ok(false);
    }
    std::fs::create_dir_all(NETNS_RUN_DIR)?;
    File::create(&target).with_context(|| format!("creating {}", target.display()))?;
    std::thread::scope(|s| {
        s.spawn(|| -> Result<()> {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).context("unshare(CLONE_NEWNET)")?;
            let tid = nix::unistd::gettid();
            let src = format!("/proc/self/task/{tid}/ns/net");
            nix::mount::mount(Some(src.as_str()), &target, None::<&str>, nix::mount::MsFlags::MS_BIND, None::<&str>)
                .with_context(|| format!("bind-mounting namespace at {}", target.display()))?;
            Ok(())
        })
        .join()
        .map_err(|_| anyhow!("namespace creation thread panicked"))?
    })?;
    Ok(true)
}

fn is_netns(f: &File) -> bool {
    nix::sys::statfs::fstatfs(f).map(|s| s.filesystem_type().0 == 0x6e736673).unwrap_or(false)
}

/// Removes named namespace `name` (its interfaces go with it).
pub fn delete(name: &str) -> Result<bool> {
    let target = path(name);
    if !target.exists() {
        return Ok(false);
    }
    let _ = nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH);
    std::fs::remove_file(&target).with_context(|| format!("removing {}", target.display()))?;
    Ok(true)
}

pub fn exists(name: &str) -> bool {
    File::open(path(name)).is_ok_and(|f| is_netns(&f))
}

pub fn open(name: &str) -> Result<File> {
    File::open(path(name)).with_context(|| format!("network namespace {name} not found"))
}
