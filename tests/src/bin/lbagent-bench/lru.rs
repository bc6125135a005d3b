//! Section 16 of `cargo xtask bench`: the new-flow table's LRU, shared
//! (the kernel's common LRU, what `ct_new` is) against per-CPU LRU lists
//! (`BPF_F_NO_COMMON_LRU`). Two tables of `ct_new`'s default size, key and
//! value, made with bpftool side by side; entries are written from threads
//! pinned to one CPU each, which is where the kernel's LRU takes and evicts
//! elements (an update from userspace goes through the same LRU code as
//! one from the program).
//!
//! The scenario is a tenant's unanswered flows beside a SYN flood: zone B
//! opens a quarter of the table's flows on CPU 0, then zone C writes four
//! times the table's size of distinct flows, either on CPU 1 only (a flood
//! that one receive queue takes) or on both CPUs (spread by RSS). Timed:
//! ns per insert of the flood; counted: B's flows still in the table.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result, bail};
use aya::maps::{HashMap, Map, MapData};
use lbagent_common::{CtEntry, Tuple, ct_new_max};
use nix::{sched::CpuSet, unistd::Pid};

/// `BPF_F_NO_COMMON_LRU`.
const NO_COMMON_LRU: u32 = 2;

pub fn lru(out: &mut String) -> Result<()> {
    eprintln!("bench: the new-flow table's LRU, common against per-CPU");
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if cpus < 2 {
        bail!("the LRU section needs two CPUs (one per tenant); this machine has {cpus}");
    }
    let size = ct_new_max(lbagent_common::CT_MAX);
    let _ = writeln!(
        out,
        "\n## 16. The new-flow table's LRU: common or per CPU\n\n\
         Two LRU hash tables of `ct_new`'s default size ({size} entries, `Tuple` → `CtEntry`), made with \
         bpftool: the kernel's common LRU (what `ct_new` is) and per-CPU LRU lists \
         (`BPF_F_NO_COMMON_LRU`). Zone B opens {} flows on CPU 0, then zone C floods {} distinct flows, \
         from CPU 1 only or from both CPUs. *B kept*: B's flows still in the table after the flood; \
         *ns/insert*: the flood's inserts (median of 3 runs).\n\n\
         | LRU | flood from | B kept | ns/insert |\n|---|---|---:|---:|",
        size / 4,
        size * 4
    );
    for (name, flags) in [("common", 0), ("per CPU", NO_COMMON_LRU)] {
        for flood_cpus in [&[1usize][..], &[0, 1][..]] {
            let mut kept = Vec::new();
            let mut ns = Vec::new();
            for run in 0..3 {
                let pin = PathBuf::from(format!("/sys/fs/bpf/lbagent-bench-lru-{}-{run}", std::process::id()));
                let table = Table::create(&pin, size, flags)?;
                let (k, n) = table.scenario(size, flood_cpus)?;
                kept.push(k);
                ns.push(n);
            }
            kept.sort_unstable();
            ns.sort_by(f64::total_cmp);
            let from = if flood_cpus.len() == 1 { "CPU 1" } else { "CPUs 0 and 1" };
            let _ = writeln!(
                out,
                "| {name} | {from} | {:.1} % | {:.0} |",
                kept[1] as f64 * 100.0 / (size / 4) as f64,
                ns[1]
            );
        }
    }
    Ok(())
}

/// A pinned LRU table made by bpftool, unpinned on drop.
struct Table {
    pin: PathBuf,
}

impl Table {
    fn create(pin: &Path, size: u32, flags: u32) -> Result<Table> {
        let _ = std::fs::remove_file(pin);
        let status = Command::new("bpftool")
            .args(["map", "create"])
            .arg(pin)
            .args(["type", "lru_hash", "key"])
            .arg(size_of::<Tuple>().to_string())
            .arg("value")
            .arg(size_of::<CtEntry>().to_string())
            .arg("entries")
            .arg(size.to_string())
            .args(["name", "lbb_lru", "flags"])
            .arg(flags.to_string())
            .status()
            .context("bpftool map create")?;
        if !status.success() {
            bail!("bpftool map create {} (flags {flags}) failed", pin.display());
        }
        Ok(Table { pin: pin.to_path_buf() })
    }

    fn open(&self) -> Result<HashMap<MapData, Tuple, CtEntry>> {
        let data = MapData::from_pin(&self.pin).with_context(|| format!("opening {}", self.pin.display()))?;
        Ok(HashMap::try_from(Map::LruHashMap(data))?)
    }

    /// B's flows on CPU 0, then C's flood from `flood_cpus`: how many of
    /// B's flows are left, and the flood's ns per insert.
    fn scenario(&self, size: u32, flood_cpus: &[usize]) -> Result<(u32, f64)> {
        let flow = |zone: u16, i: u32| Tuple {
            saddr: [10, (i >> 16) as u8, (i >> 8) as u8, i as u8],
            daddr: [192, 0, 2, 1],
            sport: 40000,
            dport: 443,
            proto: lbagent_common::PROTO_TCP,
            _pad0: 0,
            zone,
        };
        let b = size / 4;
        self.on_cpu(0, move |t| {
            for i in 0..b {
                t.insert(&flow(2, i), &CtEntry::default(), 0)?;
            }
            Ok(())
        })?;
        let flood = size * 4;
        let share = flood / flood_cpus.len() as u32;
        let started = Instant::now();
        std::thread::scope(|s| -> Result<()> {
            let workers: Vec<_> = flood_cpus
                .iter()
                .enumerate()
                .map(|(w, &cpu)| {
                    s.spawn(move || {
                        self.on_cpu(cpu, move |t| {
                            for i in 0..share {
                                t.insert(&flow(3, w as u32 * share + i), &CtEntry::default(), 0)?;
                            }
                            Ok(())
                        })
                    })
                })
                .collect();
            for w in workers {
                w.join().map_err(|_| anyhow::anyhow!("a flood thread panicked"))??;
            }
            Ok(())
        })?;
        // Inserts run in parallel on several CPUs: the time per insert is
        // the wall time times the CPUs, over the inserts.
        let ns = started.elapsed().as_nanos() as f64 * flood_cpus.len() as f64 / flood as f64;
        let t = self.open()?;
        let kept = (0..b).filter(|&i| t.get(&flow(2, i), 0).is_ok()).count() as u32;
        Ok((kept, ns))
    }

    /// Runs `f` on the table from a thread pinned to `cpu`.
    fn on_cpu(
        &self,
        cpu: usize,
        f: impl FnOnce(&mut HashMap<MapData, Tuple, CtEntry>) -> Result<()> + Send,
    ) -> Result<()> {
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut set = CpuSet::new();
                set.set(cpu)?;
                nix::sched::sched_setaffinity(Pid::from_raw(0), &set).context("pinning to a CPU")?;
                let mut t = self.open()?;
                f(&mut t)
            })
            .join()
            .map_err(|_| anyhow::anyhow!("a table thread panicked"))?
        })
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.pin);
    }
}
