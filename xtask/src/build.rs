//! Builds the eBPF object and the userspace crates.

use std::{path::PathBuf, process::Command};

use anyhow::Result;

use crate::run;

pub const BPF_TARGET: &str = "bpfel-unknown-none";

/// Workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The per-machine cache for what outlives a clone (the previous release's
/// binary, the KVM probe's answer): `/var/cache/lbagent-xtask`, or
/// `LBAGENT_XTASK_CACHE`. Deleting it is always safe (rebuilt on demand).
pub fn machine_cache() -> PathBuf {
    std::env::var_os("LBAGENT_XTASK_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/lbagent-xtask"))
}

/// `cargo +<pinned channel>` in the workspace root.
pub fn cargo(channel: &str) -> Command {
    let mut c = Command::new("cargo");
    c.arg(format!("+{channel}")).current_dir(root());
    // Set by the outer `cargo run` for its own toolchain; the pinned one wins.
    c.env_remove("RUSTUP_TOOLCHAIN").env_remove("RUSTC").env_remove("RUSTDOC").env_remove("CARGO");
    c
}

/// Builds `lbagent-ebpf` in release (debug objects fail the verifier) with BTF.
pub fn ebpf(channel: &str) -> Result<()> {
    eprintln!("xtask: building eBPF object");
    run(cargo(channel)
        .args(["build", "--release", "-p", "lbagent-ebpf", "--target", BPF_TARGET, "-Z", "build-std=core"])
        // BTF for typed map dumps; the object's path is read by lbagent's build.rs.
        .env("CARGO_ENCODED_RUSTFLAGS", ["-C", "debuginfo=2", "-C", "link-arg=--btf"].join("\x1f")))
}

/// Builds the eBPF object, then every default member (which embeds the object).
pub fn all(channel: &str) -> Result<()> {
    ebpf(channel)?;
    eprintln!("xtask: building userspace");
    run(cargo(channel).args(["build", "--workspace", "--exclude", "lbagent-ebpf", "--all-targets"]))
}

/// The release binary an operator installs (`target/release/lbagent`, the
/// eBPF object embedded).
pub fn release(channel: &str) -> Result<PathBuf> {
    ebpf(channel)?;
    eprintln!("xtask: building the release binary");
    run(cargo(channel).args(["build", "--release", "-p", "lbagent", "--bin", "lbagent"]))?;
    Ok(root().join("target/release/lbagent"))
}

/// The lint policy: rustfmt's layout, and clippy with warnings denied on the
/// host crates (every target) and on the eBPF crate (its own target). The
/// workspace's `[workspace.lints]` adds `undocumented_unsafe_blocks`.
pub fn lint(channel: &str) -> Result<()> {
    eprintln!("xtask: checking formatting");
    run(cargo(channel).args(["fmt", "--all", "--check"]))?;
    eprintln!("xtask: clippy (host crates)");
    run(cargo(channel).args([
        "clippy",
        "--workspace",
        "--exclude",
        "lbagent-ebpf",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    eprintln!("xtask: clippy (eBPF crate)");
    run(cargo(channel)
        .args([
            "clippy",
            "--release",
            "-p",
            "lbagent-ebpf",
            "--target",
            BPF_TARGET,
            "-Z",
            "build-std=core",
            "--",
            "-D",
            "warnings",
        ])
        .env("CARGO_ENCODED_RUSTFLAGS", ["-C", "debuginfo=2", "-C", "link-arg=--btf"].join("\x1f")))
}
