//! `cargo xtask vm-test`: the root tests on other kernels, in QEMU.
//!
//! A Debian kernel package (bullseye's 5.10, bookworm's 6.1) is fetched with
//! `apt-get download` through a temporary sources list (the machine's own apt
//! configuration is not touched) and unpacked under `target/vm/<series>/`
//! (cached). virtme-ng boots it with this machine's userspace mounted
//! (read-only, with writable overlays for /tmp, /var, /etc), so the guest
//! runs the test binaries `cargo` built here. KVM is used when a probe boot
//! under KVM prints its marker in time; otherwise TCG (nested
//! virtualisation does not work on every host, and a KVM guest can hang
//! after decompression rather than fail).
//!
//! The guest prints `VMTEST` marker lines; vng's own exit code is 255
//! whatever the command did, so the markers are the only result.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{build, output, run};

/// A kernel series to test and where Debian keeps it.
pub struct Series {
    pub name: &'static str,
    suite: &'static str,
    /// `linux-image-<abi>-<N>-amd64-unsigned`: the newest N is taken.
    abi: &'static str,
}

pub const SERIES: [Series; 2] = [
    Series { name: "5.10", suite: "bullseye", abi: "5.10.0" },
    Series { name: "6.1", suite: "bookworm", abi: "6.1.0" },
];

/// What runs in the guest: (test file, test name filters; empty = all).
/// Tiers: `smoke` is what `cargo xtask test` runs on 5.10 (one test per
/// layer, so the CI run stays within its budget under TCG); `full` adds
/// every program test and the rest of the traffic tests.
const SMOKE: &[(&str, &[&str])] = &[
    ("static_checks", &[]),
    ("traffic", &["traffic_through_netlink_attach"]),
    ("natgw", &["fip_dnat_snat_hairpin_and_icmp", "tso_tcp_over_a_smaller_mtu"]),
    ("daemon", &["kill_9_and_restart_keep_established_connections"]),
    // The garbage collector is a program of its own, verified when run.
    ("conntrack", &["garbage_collection_frees_idle_flows_only"]),
    // The ring buffer and the flow-log records on the oldest kernel.
    ("flow_log", &["the_program_writes_start_and_close_records_with_counts_both_ways"]),
];

const FULL_EXTRA: &[(&str, &[&str])] = &[
    ("pins", &[]),
    ("parse", &[]),
    ("lb", &["load_balancer_seed_parity_and_lifecycle"]),
    ("rewrite", &[]),
    ("icmp_error", &[]),
    ("rules", &[]),
    ("counters", &[]),
    ("conntrack", &[]),
    ("fragment", &[]),
    ("egress", &[]),
    ("address_only", &[]),
    ("acl", &[]),
    ("zone_ct", &[]),
    // The QoS program tests that measure time (bucket refill, backlog,
    // achieved rates) are host-only: under TCG the guest's clock runs
    // against a CPU ~20 times slower, so rates mean nothing there. The
    // logic (marking, ladder, live rate change, zones without rules) runs.
    (
        "qos",
        &[
            "a_rate_change_keeps_the_bucket_and_applies_at_once",
            "past_half_the_burst_tcp_gets_one_signal_a_quarter_burst_and_acks_pass",
            "the_priority_ladder_picks_the_first_matching_rule",
            "zones_without_rules_pay_one_lookup_and_are_never_limited",
            "traffic::the_priority_ladder_holds_with_real_traffic",
            "traffic::two_eips_are_limited_independently",
        ],
    ),
    ("route", &[]),
    ("natgw", &["large_udp_datagrams", "a_floating_ip_carries_every_ip_protocol"]),
    ("sched", &[]),
    ("xdp", &[]),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Smoke,
    Full,
}

impl std::str::FromStr for Tier {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "smoke" => Ok(Tier::Smoke),
            "full" => Ok(Tier::Full),
            _ => bail!("--tier {s:?}: expected smoke or full"),
        }
    }
}

/// One test file's result in one guest.
#[derive(Debug, Default)]
struct FileResult {
    passed: u32,
    failed: u32,
    skipped: u32,
    secs: u64,
    rc: i32,
    tail: String,
}

/// One entry per test file (the guest reports by file): the filters of a
/// file listed twice are joined, and a file listed once without filters
/// runs whole.
fn merged<'a>(plan: Vec<(&'a str, &'a [&'a str])>) -> Vec<(&'a str, Vec<&'a str>)> {
    let mut out: Vec<(&str, Vec<&str>)> = Vec::new();
    for (file, filters) in plan {
        match out.iter_mut().find(|(f, _)| *f == file) {
            // Either entry runs the whole file: so does the merged one.
            Some((_, have)) if have.is_empty() || filters.is_empty() => have.clear(),
            Some((_, have)) => have.extend(filters.iter().filter(|f| !have.contains(f)).collect::<Vec<_>>()),
            None => out.push((file, filters.to_vec())),
        }
    }
    out
}

/// Runs the tier on each series; prints a summary per kernel and fails
/// when any guest test failed (or a guest did not report).
pub fn test(channel: &str, kernels: &[&Series], tier: Tier, files: &[String]) -> Result<()> {
    let bins = test_binaries(channel)?;
    let mut plan = merged(match tier {
        Tier::Smoke => SMOKE.to_vec(),
        Tier::Full => SMOKE.iter().chain(FULL_EXTRA).copied().collect(),
    });
    if !files.is_empty() {
        if let Some(f) = files.iter().find(|f| !plan.iter().any(|(p, _)| p == f)) {
            bail!("--file {f:?} is not in the {tier:?} tier");
        }
        plan.retain(|(p, _)| files.iter().any(|f| f == p));
    }
    let mut failed = Vec::new();
    for s in kernels {
        let vmlinuz = fetch(s)?;
        let accel = accel(&vmlinuz)?;
        eprintln!("xtask: vm-test {} ({}) under {accel}: {} test files", s.name, vmlinuz.display(), plan.len());
        let script = guest_script(s, &plan, &bins, accel)?;
        let started = Instant::now();
        let console = boot(&vmlinuz, accel, &script)?;
        let (uname, results) = parse(&console);
        let log = build::root().join(format!("target/vm/{}-console.log", s.name));
        std::fs::write(&log, &console)?;
        println!(
            "\n== kernel {} (guest uname -r: {}), {accel}, {:.0?}",
            s.name,
            uname.as_deref().unwrap_or("?"),
            started.elapsed()
        );
        println!("{:<16} {:>6} {:>6} {:>7} {:>6}", "test file", "passed", "failed", "skipped", "secs");
        for (file, _) in &plan {
            match results.get(*file) {
                Some(r) => {
                    println!("{file:<16} {:>6} {:>6} {:>7} {:>6}", r.passed, r.failed, r.skipped, r.secs);
                    if r.rc != 0 || r.failed > 0 {
                        failed.push(format!("{} {file}", s.name));
                        eprintln!("--- {file} on {} (rc {}):\n{}", s.name, r.rc, r.tail);
                    }
                }
                None => {
                    println!("{file:<16} no result (the guest stopped early; see {})", log.display());
                    failed.push(format!("{} {file} (no result)", s.name));
                }
            }
        }
        if uname.is_none() {
            failed.push(format!("{}: the guest never ran the tests (see {})", s.name, log.display()));
        }
    }
    if !failed.is_empty() {
        bail!("vm-test failed: {}", failed.join(", "));
    }
    Ok(())
}

/// Test file name → its built executable (`cargo test --no-run`).
fn test_binaries(channel: &str) -> Result<BTreeMap<String, PathBuf>> {
    let out = output(build::cargo(channel).args(["test", "-p", "lbagent-tests", "--no-run", "--message-format=json"]))?;
    let mut bins = BTreeMap::new();
    for line in out.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if v["reason"] == "compiler-artifact"
            && v["target"]["kind"] == serde_json::json!(["test"])
            && let (Some(name), Some(exe)) = (v["target"]["name"].as_str(), v["executable"].as_str())
        {
            bins.insert(name.to_string(), PathBuf::from(exe));
        }
    }
    Ok(bins)
}

/// The guest's script: PATH as on the host, `CI` passed on, each file run
/// between markers with its exit code and duration.
fn guest_script(
    s: &Series,
    plan: &[(&str, Vec<&str>)],
    bins: &BTreeMap<String, PathBuf>,
    accel: &str,
) -> Result<PathBuf> {
    let mut sh = String::from("#!/bin/sh\n");
    // Program loads take ~20 times as long under TCG: the tests' waits for
    // the agent stretch accordingly.
    if accel == "tcg" {
        sh += "export LBAGENT_TEST_SLOWDOWN=10\n";
    }
    sh += "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n";
    if let Ok(ci) = std::env::var("CI") {
        sh += &format!("export CI={ci}\n");
    }
    sh += "export RUST_BACKTRACE=0\nmountpoint -q /sys/fs/bpf || mount -t bpf bpffs /sys/fs/bpf\n";
    // Modules the tests need that the guest's init does not load (no udev,
    // no static device nodes): the userspace OVS datapath opens /dev/net/tun.
    sh += "for m in tun veth bridge sch_ingress cls_bpf; do modprobe $m 2>/dev/null; done\n";
    sh += "dmesg -n 1\n";
    sh += &format!("cd {}\n", build::root().join("tests").display());
    sh += "echo \"VMTEST-UNAME $(uname -r)\"\n";
    for (file, filters) in plan {
        let bin = bins.get(*file).with_context(|| format!("no test binary for {file}"))?;
        let filters = filters.join(" ");
        sh += &format!(
            "s=$(date +%s); echo \"VMTEST-BEGIN {file}\"; {} --test-threads=1 --color never {filters} 2>&1; rc=$?; \
             echo \"VMTEST-END {file} rc=$rc secs=$(( $(date +%s) - s ))\"\n",
            bin.display()
        );
    }
    sh += "echo VMTEST-DONE\n";
    let path = build::root().join(format!("target/vm/{}-run.sh", s.name));
    std::fs::create_dir_all(path.parent().unwrap())?;
    std::fs::write(&path, sh)?;
    Ok(path)
}

/// Parses the console: the guest's `uname -r` and each file's result.
fn parse(console: &str) -> (Option<String>, BTreeMap<String, FileResult>) {
    let mut uname = None;
    let mut results = BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in console.lines().map(|l| l.trim_end_matches('\r')).map(strip_ansi) {
        let line = line.as_str();
        if let Some(u) = line.strip_prefix("VMTEST-UNAME ") {
            uname = Some(u.trim().to_string());
        } else if let Some(f) = line.strip_prefix("VMTEST-BEGIN ") {
            current = Some((f.trim().to_string(), vec![]));
        } else if let Some(rest) = line.strip_prefix("VMTEST-END ") {
            let mut it = rest.split_whitespace();
            let file = it.next().unwrap_or_default().to_string();
            let field = |p: &str, s: &str| s.strip_prefix(p).and_then(|v| v.parse::<i64>().ok());
            let (mut rc, mut secs) = (-1, 0);
            for kv in it {
                rc = field("rc=", kv).map(|v| v as i32).unwrap_or(rc);
                secs = field("secs=", kv).map(|v| v as u64).unwrap_or(secs);
            }
            let lines = current.take().map(|(_, l)| l).unwrap_or_default();
            let mut r = FileResult { rc, secs, ..Default::default() };
            // libtest's summary: `test result: ok. 3 passed; 0 failed; 1 ignored; ...`
            for l in lines.iter().filter_map(|l| l.split_once("test result: ").map(|(_, t)| t)) {
                let count = |what: &str| {
                    l.split(';')
                        .find_map(|part| part.trim().strip_suffix(what)?.trim().rsplit(' ').next()?.parse::<u32>().ok())
                };
                r.passed += count(" passed").unwrap_or(0);
                r.failed += count(" failed").unwrap_or(0);
                r.skipped += count(" ignored").unwrap_or(0);
            }
            // A test that returned early (root tests that cannot run their
            // component outside CI) says so on its own output line.
            r.skipped += lines.iter().filter(|l| l.starts_with("skipped:")).count() as u32;
            r.tail = lines.iter().rev().take(40).rev().cloned().collect::<Vec<_>>().join("\n");
            results.insert(file, r);
        } else if let Some((_, lines)) = current.as_mut() {
            lines.push(line.to_string());
        }
    }
    (uname, results)
}

/// The line without terminal colour sequences (`ESC [ ... m`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The unpacked kernel of `s` (fetched and unpacked when missing).
fn fetch(s: &Series) -> Result<PathBuf> {
    let base = build::root().join("target/vm").join(s.name);
    let stamp = base.join("package");
    if let Ok(pkg) = std::fs::read_to_string(&stamp)
        && let Some(v) = find_vmlinuz(&base.join("root"))?
    {
        eprintln!("xtask: kernel {} cached ({})", s.name, pkg.trim());
        return Ok(v);
    }
    let apt = base.join("apt");
    std::fs::create_dir_all(apt.join("lists/partial"))?;
    std::fs::create_dir_all(apt.join("cache/archives/partial"))?;
    std::fs::write(apt.join("sources.list"), format!("deb http://deb.debian.org/debian {} main\n", s.suite))?;
    let opts = |c: &mut Command| {
        c.arg("-o")
            .arg(format!("Dir::Etc::sourcelist={}", apt.join("sources.list").display()))
            .args(["-o", "Dir::Etc::sourceparts=-"])
            .arg("-o")
            .arg(format!("Dir::State::Lists={}", apt.join("lists").display()))
            .arg("-o")
            .arg(format!("Dir::Cache={}", apt.join("cache").display()));
    };
    eprintln!("xtask: fetching the {} kernel package list ({})", s.name, s.suite);
    let mut update = Command::new("apt-get");
    update.args(["update", "-qq"]);
    opts(&mut update);
    run(&mut update)?;
    let mut search = Command::new("apt-cache");
    opts(&mut search);
    search.args(["search", "--names-only", &format!("^linux-image-{}-[0-9]+-amd64-unsigned$", s.abi)]);
    let list = output(&mut search)?;
    let pkg = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .max_by_key(|p| {
            p.trim_start_matches(&format!("linux-image-{}-", s.abi))
                .split('-')
                .next()
                .unwrap_or("0")
                .parse::<u32>()
                .unwrap_or(0)
        })
        .with_context(|| format!("no linux-image-{}-*-amd64-unsigned in {}", s.abi, s.suite))?
        .to_string();
    eprintln!("xtask: downloading {pkg}");
    let mut download = Command::new("apt-get");
    download.current_dir(&apt).arg("download").arg("-qq");
    opts(&mut download);
    run(download.arg(&pkg))?;
    let deb = std::fs::read_dir(&apt)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb") && p.to_string_lossy().contains(&pkg))
        .context("the downloaded package is missing")?;
    let root = base.join("root");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root)?;
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
    std::fs::remove_file(&deb)?;
    std::fs::write(&stamp, &pkg)?;
    find_vmlinuz(&root)?.context("the package has no boot/vmlinuz-*")
}

fn find_vmlinuz(root: &Path) -> Result<Option<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(root.join("boot")) else { return Ok(None) };
    Ok(entries
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))))
}

/// `kvm` when a probe boot under KVM prints its marker within 60 s, else
/// `tcg`. The answer is cached per host kernel in the machine cache
/// (`accel`), so a fresh clone does not probe again.
fn accel(vmlinuz: &Path) -> Result<&'static str> {
    let host = output(Command::new("uname").arg("-r"))?.trim().to_string();
    let cache = build::machine_cache().join("accel");
    if let Ok(text) = std::fs::read_to_string(&cache)
        && let Some((h, a)) = text.trim().split_once(' ')
        && h == host
    {
        return Ok(if a == "kvm" { "kvm" } else { "tcg" });
    }
    let kvm = if !Path::new("/dev/kvm").exists() {
        false
    } else {
        eprintln!("xtask: probing KVM (a guest that hangs after decompression means TCG)");
        let probe = build::root().join("target/vm/probe.sh");
        std::fs::write(&probe, "#!/bin/sh\necho VMTEST-KVM-OK\n")?;
        boot_with_timeout(vmlinuz, "kvm", &probe, Duration::from_secs(60)).is_ok_and(|c| c.contains("VMTEST-KVM-OK"))
    };
    let a = if kvm { "kvm" } else { "tcg" };
    std::fs::create_dir_all(build::machine_cache())?;
    std::fs::write(&cache, format!("{host} {a}\n"))?;
    Ok(a)
}

/// Boots the kernel and runs `script`; the console output.
fn boot(vmlinuz: &Path, accel: &str, script: &Path) -> Result<String> {
    // The full tier takes over an hour under TCG.
    boot_with_timeout(vmlinuz, accel, script, Duration::from_secs(3 * 3600))
}

fn boot_with_timeout(vmlinuz: &Path, accel: &str, script: &Path, limit: Duration) -> Result<String> {
    use std::io::BufRead;
    let mut vng = Command::new("timeout");
    vng.arg("--kill-after=10").arg(limit.as_secs().to_string()).arg("vng").arg("--verbose").arg("--run").arg(vmlinuz);
    if accel == "tcg" {
        vng.arg("--disable-kvm");
    }
    vng.args(["--memory", "2G", "--cpus", "2", "--exec"]).arg(format!("sh {}", script.display()));
    // vng writes the guest's console to stdout or stderr depending on
    // whether they are terminals: read both from one pipe.
    let (reader, writer) = std::io::pipe()?;
    let mut child = vng.stdout(writer.try_clone()?).stderr(writer).spawn().context("running vng (virtme-ng)")?;
    drop(vng);
    let mut console = String::new();
    let started = Instant::now();
    for line in std::io::BufReader::new(reader).lines() {
        let Ok(line) = line else { break };
        // Progress: each test file as the guest finishes it.
        if let Some(rest) = line.trim_end_matches('\r').strip_prefix("VMTEST-END ") {
            eprintln!("xtask: [{:>4.0?}] {rest}", started.elapsed());
        }
        console.push_str(&line);
        console.push('\n');
    }
    child.wait()?;
    Ok(console)
}

#[cfg(test)]
mod tests {
    #[test]
    fn markers_are_parsed() {
        let console = "noise\r\nVMTEST-UNAME 5.10.0-32-amd64\r\nVMTEST-BEGIN pins\r\nrunning 2 tests\r\n\
                       test a ... ok\r\ntest b ... \u{1b}[31mFAILED\u{1b}[m\r\nskipped: needs root\r\n\
                       test result: \u{1b}[31mFAILED\u{1b}[m. 1 passed; 1 failed; 0 ignored; 0 measured\r\n\
                       VMTEST-END pins rc=101 secs=7\r\n";
        let (uname, r) = super::parse(console);
        assert_eq!(uname.as_deref(), Some("5.10.0-32-amd64"));
        let p = &r["pins"];
        assert_eq!((p.passed, p.failed, p.skipped, p.rc, p.secs), (1, 1, 1, 101, 7));
    }

    #[test]
    fn a_file_listed_twice_runs_once_with_both_filters_or_whole() {
        use super::{FULL_EXTRA, SMOKE, merged};
        let plan = merged(vec![("a", &["x"][..]), ("b", &["y"][..]), ("a", &["z", "x"][..]), ("b", &[][..])]);
        assert_eq!(plan, vec![("a", vec!["x", "z"]), ("b", vec![])]);
        let full = merged(SMOKE.iter().chain(FULL_EXTRA).copied().collect());
        let files: Vec<&str> = full.iter().map(|(f, _)| *f).collect();
        let mut unique = files.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(files.len(), unique.len(), "{files:?}");
        assert!(full.iter().any(|(f, filters)| *f == "conntrack" && filters.is_empty()), "conntrack runs whole");
    }
}
