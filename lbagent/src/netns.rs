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

/// Runs `f` inside namespace `name` (or in the caller's when `None`).
pub fn run_in<T: Send>(name: Option<&str>, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let Some(name) = name else { return f() };
    let file = File::open(path(name)).with_context(|| format!("network namespace {name} not found"))?;
    std::thread::scope(|s| {
        s.spawn(move || {
            setns(&file, CloneFlags::CLONE_NEWNET).with_context(|| format!("entering network namespace {name}"))?;
            f()
        })
        .join()
        .map_err(|_| anyhow!("thread working in network namespace {name} panicked"))?
    })
}

/// Interface index of `ifname` in the current thread's namespace.
pub fn ifindex(ifname: &str) -> Result<u32> {
    nix::net::if_::if_nametoindex(ifname).with_context(|| format!("interface {ifname} not found"))
}
