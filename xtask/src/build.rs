//! Builds the eBPF object and the userspace crates.

use std::{path::PathBuf, process::Command};

use anyhow::Result;

use crate::run;

pub const BPF_TARGET: &str = "bpfel-unknown-none";

/// Workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Builds `lbagent-ebpf` in release (debug objects fail the verifier) with BTF.
pub fn ebpf() -> Result<()> {
    eprintln!("xtask: building eBPF object");
    run(Command::new("cargo")
        .current_dir(root())
        .args(["build", "--release", "-p", "lbagent-ebpf", "--target", BPF_TARGET, "-Z", "build-std=core"])
        // BTF for typed map dumps; the object's path is read by lbagent's build.rs.
        .env("CARGO_ENCODED_RUSTFLAGS", ["-C", "debuginfo=2", "-C", "link-arg=--btf"].join("\x1f")))
}

/// Builds the eBPF object, then every default member (which embeds the object).
pub fn all() -> Result<()> {
    ebpf()?;
    eprintln!("xtask: building userspace");
    run(Command::new("cargo").current_dir(root()).args([
        "build",
        "--workspace",
        "--exclude",
        "lbagent-ebpf",
        "--all-targets",
    ]))
}
