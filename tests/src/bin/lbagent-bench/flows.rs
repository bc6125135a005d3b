//! Section 17 of `cargo xtask bench`: a million flows. The established
//! table is sized for 1 048 576 flows (`--conntrack-max 2097152` halves;
//! `ct_new` its default quarter) and filled with 1 000 000 DNAT'ed flows,
//! both halves written into the map from userspace (crafted entries, not
//! packets: a million handshakes through the program would take this
//! machine minutes and measure the program, not the tables). Reported:
//! the kernel-accounted memory of both tables (`memlock` in the map's
//! fdinfo) per flow, beside Linux conntrack's object size on this machine
//! (`nf_conntrack` in `/proc/slabinfo`, one object per flow, both
//! directions, NAT included); the time and CPU of a whole-table read in
//! batches and entry by entry (in this process, the bench's debug build:
//! compare the two), and of `lbagent conntrack gc` (a pass that frees
//! nothing) and `lbagent conntrack list` with a filter, run as the release
//! agent (as installed).

use std::{fmt::Write as _, time::Instant};

use anyhow::{Context, Result};
use aya::maps::MapData;
use lbagent::dataplane::{pins, tables::monotonic_ns};
use lbagent_common::{MAP_CT, MAP_CT_NEW};
use lbagent_tests::{engine::TestZone, lbagent_release_bin, topology::ZONE};
use nix::sys::resource::{UsageWho, getrusage};

const FLOWS: u32 = 1_000_000;
/// Halves the established table holds (`--conntrack-max`).
const CT_HALVES: u32 = 2_097_152;

/// Kernel memory charged for a pinned map (`memlock` in its fdinfo).
fn memlock(path: &std::path::Path) -> Result<u64> {
    use std::os::fd::{AsFd, AsRawFd};
    let map = MapData::from_pin(path)?;
    let fd = map.fd().as_fd().as_raw_fd();
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
    info.lines()
        .find_map(|l| l.strip_prefix("memlock:").map(|v| v.trim().parse::<u64>()))
        .context("no memlock in the map's fdinfo")?
        .context("memlock")
}

/// Linux conntrack's object size (bytes per flow), if the slab is listed.
fn nf_conntrack_objsize() -> Option<u64> {
    let _ = std::process::Command::new("modprobe").arg("nf_conntrack").status();
    let slab = std::fs::read_to_string("/proc/slabinfo").ok()?;
    // name active_objs num_objs objsize ...
    slab.lines().find(|l| l.starts_with("nf_conntrack ")).and_then(|l| l.split_whitespace().nth(3)?.parse().ok())
}

/// CPU seconds (user + system) this process, or its waited children, used.
fn cpu_of(who: UsageWho) -> f64 {
    getrusage(who)
        .map(|u| {
            let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
            t(u.user_time()) + t(u.system_time())
        })
        .unwrap_or(0.0)
}

/// Runs `f`: (its result, wall seconds, CPU seconds of this process).
fn timed<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, f64, f64)> {
    let (t, c) = (Instant::now(), cpu_of(UsageWho::RUSAGE_SELF));
    let v = f()?;
    Ok((v, t.elapsed().as_secs_f64(), cpu_of(UsageWho::RUSAGE_SELF) - c))
}

/// Runs the release agent's `args`: (its output, wall seconds, its CPU seconds).
fn agent(args: &[&str], root: &std::path::Path) -> Result<(String, f64, f64)> {
    let (t, c) = (Instant::now(), cpu_of(UsageWho::RUSAGE_CHILDREN));
    let out = std::process::Command::new(lbagent_release_bin()).args(args).arg("--bpffs").arg(root).output()?;
    let (wall, cpu) = (t.elapsed().as_secs_f64(), cpu_of(UsageWho::RUSAGE_CHILDREN) - c);
    anyhow::ensure!(out.status.success(), "lbagent {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok((String::from_utf8_lossy(&out.stdout).into_owned(), wall, cpu))
}

pub fn flows(out: &mut String) -> Result<()> {
    eprintln!("bench: a million flows");
    let e = TestZone::with_ct_max(ZONE, Some(CT_HALVES))?;
    let dir = pins::versioned_dir(&e.pins.root);
    let (empty_ct, empty_new) = (memlock(&dir.join(MAP_CT.name))?, memlock(&dir.join(MAP_CT_NEW.name))?);
    let ((), fill_s, _) = timed(|| super::fill_dnat_flows(&e.tables, FLOWS, monotonic_ns()))?;
    eprint!(".");
    let (full_ct, full_new) = (memlock(&dir.join(MAP_CT.name))?, memlock(&dir.join(MAP_CT_NEW.name))?);
    let (batched, batch_s, batch_cpu) = timed(|| e.tables.conntrack_table(MAP_CT))?;
    eprint!(".");
    let (by_key, key_s, key_cpu) = timed(|| e.tables.conntrack_table_by_key(MAP_CT))?;
    eprint!(".");
    let (freed, gc_s, gc_cpu) = agent(&["conntrack", "gc"], &e.pins.root)?;
    let freed = freed.trim();
    eprint!(".");
    let (listed, list_s, list_cpu) = agent(&["conntrack", "list", "--addr", "10.1.2.3"], &e.pins.root)?;
    let listed = listed.lines().count();
    eprint!(".");
    // Both tables preallocate: bytes per flow of the capacity.
    let per_flow = |bytes: u64| bytes as f64 / (CT_HALVES as f64 / 2.0);
    let linux = nf_conntrack_objsize();
    writeln!(
        out,
        "\n## 17. A million flows\n\n\
         `ct` sized for {CT_HALVES} halves (`--conntrack-max`), `ct_new` its default quarter; {FLOWS} DNAT'ed \
         flows written into `ct` from userspace, both halves (crafted entries, not packets). Memory is the \
         kernel's charge for each map (`memlock`, fdinfo): hash maps preallocate, so it is the same empty and \
         full ({} and {} bytes for `ct` empty and full).\n\n\
         | what | value |\n|---|---:|\n\
         | `ct` memlock | {:.1} MB |\n\
         | `ct_new` memlock | {:.1} MB |\n\
         | bytes per established flow in `ct` (both halves; capacity {} flows) | {:.0} B |\n\
         | bytes per flow with `ct_new` counted | {:.0} B |\n\
         | Linux conntrack, `nf_conntrack` object size (one per flow, both directions) | {} |\n\
         | filling 1 M flows (2 M map updates) | {fill_s:.1} s |\n\
         | reading `ct` whole, in batches ({} entries) | {batch_s:.2} s wall, {batch_cpu:.2} s CPU |\n\
         | reading `ct` whole, entry by entry ({} entries) | {key_s:.2} s wall, {key_cpu:.2} s CPU |\n\
         | `lbagent conntrack gc`, nothing idle (\"{freed}\") | {gc_s:.2} s wall, {gc_cpu:.2} s CPU |\n\
         | `lbagent conntrack list --addr 10.1.2.3` ({listed} entries) | {list_s:.2} s wall, {list_cpu:.2} s CPU |",
        empty_ct,
        full_ct,
        full_ct as f64 / 1e6,
        full_new as f64 / 1e6,
        CT_HALVES / 2,
        per_flow(full_ct),
        per_flow(full_ct + full_new),
        linux.map_or("not listed (slab merged)".to_string(), |b| format!("{b} B")),
        batched.len(),
        by_key.len(),
    )?;
    writeln!(out, "\n(`ct_new` memlock empty: {empty_new} bytes.)")?;
    Ok(())
}
