//! Developer tasks: `cargo xtask setup|build-ebpf|build|lint|test|vm-test|demo|bench`.
//!
//! Every task first runs the idempotent setup, so a fresh machine goes from
//! `git clone` to a green test run with one command.

mod build;
mod package;
mod previous;
mod setup;
mod vm;

use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what is missing: toolchain, bpf-linker (against the toolchain's LLVM), Debian packages.
    Setup,
    /// Build the eBPF object (release, BTF) into target/bpfel-unknown-none/release/.
    BuildEbpf,
    /// Build the eBPF object, the userspace binaries and tests (debug), and the release binary
    /// an operator installs (target/release/lbagent).
    Build,
    /// Build (release) and run the agent: `cargo xtask run -- run --state my.yaml`.
    Run {
        /// Arguments of `lbagent`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the Debian package (binary, systemd unit, defaults, docs, example) into target/package/.
    Package {
        /// Package the debug binary (what the test suite installs) instead of a release build.
        #[arg(long)]
        debug: bool,
    },
    /// Run every test tier: unit, program (BPF_PROG_TEST_RUN), static checks, integration, then
    /// (without a filter) the traffic tests with the fast path off and the smoke tier on Linux 5.10 in a VM.
    Test {
        /// Extra arguments passed to `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Check formatting (rustfmt) and lints (clippy, warnings denied) of the host crates and the eBPF crate.
    Lint,
    /// Build everything, run the agent with a load balancer and a NAT gateway, send traffic, show the maps, clean up.
    Demo,
    /// Run the root tests in QEMU on Debian's 5.10 and/or 6.1 kernels (virtme-ng; KVM if it works, else TCG).
    VmTest {
        /// 5.10, 6.1 or all.
        #[arg(long, default_value = "5.10")]
        kernel: String,
        /// smoke (one test per layer, what `cargo xtask test` runs) or full (every program test too).
        #[arg(long, default_value = "smoke")]
        tier: vm::Tier,
        /// Only these test files of the tier (repeatable), e.g. `--file daemon`.
        #[arg(long = "file")]
        files: Vec<String>,
    },
    /// Measure the dataplane side by side with iptables and plain routing (results in target/bench/results.md).
    Bench,
}

/// Test files whose traffic the fast path carries; `cargo xtask test` runs
/// them a second time with it off.
const SLOW_PATH_TESTS: [&str; 4] = ["traffic", "natgw", "lb", "sched"];

/// Test files whose tests mostly wait (on agents, etcd, haproxy, health
/// checks) rather than compute or measure rates: run three at a time, the
/// others two at a time (2026-12-06: 304 s and 307 s of tests in each, 161 s
/// and 155 s of wall time two at a time).
const WAITING_TESTS: [&str; 2] = ["daemon", "fleet"];

/// Every integration-test target of the workspace's host crates (the root
/// tests in `tests/tests/`, the agent's own in `lbagent/tests/`), by name,
/// as `cargo metadata` lists them: a file added anywhere is run.
fn test_targets(channel: &str) -> Result<Vec<String>> {
    let json = output(build::cargo(channel).args(["metadata", "--no-deps", "--format-version", "1"]))?;
    let meta: serde_json::Value = serde_json::from_str(&json).context("parsing cargo metadata")?;
    let mut names = Vec::new();
    for package in meta["packages"].as_array().context("cargo metadata: no packages")? {
        if package["name"] == "lbagent-ebpf" {
            continue;
        }
        for target in package["targets"].as_array().into_iter().flatten() {
            if target["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "test")) {
                names.push(target["name"].as_str().context("cargo metadata: a target without a name")?.to_string());
            }
        }
    }
    names.sort();
    Ok(names)
}

/// `cargo test` over the workspace's host crates, as every run of the
/// suite starts it: the same packages and features each time, so no run
/// rebuilds what another built (`-p lbagent-tests` alone resolved other
/// features and rebuilt for half a minute).
fn cargo_test(channel: &str, threads: &str) -> Command {
    let mut cmd = build::cargo(channel);
    cmd.args(["test", "--workspace", "--exclude", "lbagent-ebpf"])
        .env("RUST_TEST_THREADS", std::env::var("RUST_TEST_THREADS").unwrap_or(threads.into()));
    cmd
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Setup => setup::ensure_all().map(|_| ()),
        Cmd::BuildEbpf => build::ebpf(&setup::ensure_all()?),
        Cmd::Build => {
            let channel = setup::ensure_all()?;
            build::all(&channel)?;
            let bin = build::release(&channel)?;
            eprintln!("xtask: release binary {}", bin.display());
            Ok(())
        }
        Cmd::Run { args } => {
            let channel = setup::ensure_all()?;
            let bin = build::release(&channel)?;
            let status =
                Command::new(&bin).args(&args).status().with_context(|| format!("running {}", bin.display()))?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Cmd::Package { debug } => {
            let channel = setup::ensure_all()?;
            if debug {
                build::all(&channel)?;
            }
            package::build(&channel, debug).map(|_| ())
        }
        Cmd::Lint => build::lint(&setup::ensure_all()?),
        Cmd::Test { args } => {
            let channel = setup::ensure_all()?;
            build::all(&channel)?;
            build::lint(&channel)?;
            // The upgrade test runs the previous release, then this one; the
            // package test installs the Debian package.
            let previous = previous::build(&channel)?;
            let deb = package::build(&channel, true)?;
            let started = std::time::Instant::now();
            // Root tests share the kernel; they use unique names and run two
            // at a time (the waiting ones three at a time).
            let env = [("LBAGENT_PREVIOUS_BIN", &previous), ("LBAGENT_DEB", &deb)];
            if !args.is_empty() {
                run(cargo_test(&channel, "2").args(&args).envs(env))?;
            } else {
                let targets = test_targets(&channel)?;
                let busy = targets.iter().filter(|f| !WAITING_TESTS.contains(&f.as_str()));
                run(cargo_test(&channel, "2")
                    .args(["--lib", "--bins"])
                    .args(busy.flat_map(|t| ["--test", t.as_str()]))
                    .envs(env))?;
                // Documentation examples (none run today; any added are).
                run(cargo_test(&channel, "2").arg("--doc"))?;
                eprintln!("xtask: the waiting tests ({}) three at a time", WAITING_TESTS.join(", "));
                run(cargo_test(&channel, "3").args(WAITING_TESTS.iter().flat_map(|t| ["--test", *t])).envs(env))?;
                // The traffic tests again with the fast path off: both paths
                // must carry the same packets.
                eprintln!("xtask: traffic tests again with the fast path off (LBAGENT_TEST_SLOW_PATH=1)");
                run(cargo_test(&channel, "2")
                    .args(SLOW_PATH_TESTS.iter().flat_map(|t| ["--test", *t]))
                    .env("LBAGENT_TEST_SLOW_PATH", "1"))?;
                // The smoke tier on Linux 5.10, the oldest kernel we support
                // (`docs/kernels.md`): ~8 minutes under TCG.
                eprintln!(
                    "xtask: host tests passed in {:.0?}; the smoke tier on Linux 5.10 in a VM",
                    started.elapsed()
                );
                setup::ensure_vm_tools()?;
                let oldest = vm::SERIES.iter().find(|s| s.name == "5.10").expect("5.10 is a series");
                vm::test(&channel, &[oldest], vm::Tier::Smoke, &[])?;
            }
            eprintln!("xtask: tests passed in {:.0?}", started.elapsed());
            Ok(())
        }
        Cmd::VmTest { kernel, tier, files } => {
            let channel = setup::ensure_all()?;
            setup::ensure_vm_tools()?;
            build::all(&channel)?;
            let kernels: Vec<&vm::Series> = match kernel.as_str() {
                "all" => vm::SERIES.iter().collect(),
                k => vec![vm::SERIES.iter().find(|s| s.name == k).with_context(|| {
                    format!("--kernel {k:?}: expected {} or all", vm::SERIES.map(|s| s.name).join(", "))
                })?],
            };
            vm::test(&channel, &kernels, tier, &files)
        }
        Cmd::Demo => {
            let channel = setup::ensure_all()?;
            build::all(&channel)?;
            run(build::cargo(&channel).args(["run", "--quiet", "-p", "lbagent-tests", "--bin", "lbagent-demo"]))
        }
        Cmd::Bench => {
            let channel = setup::ensure_all()?;
            build::all(&channel)?;
            // Sections 15 and 17 run the release agent, as installed: this
            // tree's, not whatever an earlier build left.
            build::release(&channel)?;
            run(build::cargo(&channel).args(["run", "--quiet", "-p", "lbagent-tests", "--bin", "lbagent-bench"]))?;
            // Setup installed python3-matplotlib for Debian's interpreter.
            let plotted =
                Command::new(setup::DEBIAN_PYTHON).arg(build::root().join("docs/plot_benchmarks.py")).status();
            if !plotted.is_ok_and(|s| s.success()) {
                bail!("drawing the plots failed (docs/plot_benchmarks.py with {})", setup::DEBIAN_PYTHON);
            }
            Ok(())
        }
    }
}

/// Runs a command, failing with its command line when it does not exit 0.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Runs a command and returns its stdout.
pub(crate) fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("spawning {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}
