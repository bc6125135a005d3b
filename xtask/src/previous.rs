//! The previous release: the last commit of the previous map layout, built
//! from git history so the upgrade test (`tests/tests/upgrade.rs`) can run
//! it and then this build over the same dataplane.
//!
//! Sources come from `git archive` (no worktree is registered), into
//! `target/previous/src`; the build has its own target dir
//! (`target/previous/target`), so it never touches this build's artifacts
//! and is cached across runs (a fresh machine builds it once, ~3 min). The
//! binary (self-contained: the eBPF object is embedded) is also kept in a
//! per-machine cache (`build::machine_cache`, `previous-<commit>-<toolchain>/`),
//! so a fresh clone on the same machine does not build it again.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use crate::{build, output, run};

/// The last commit of layout version 4 (the next commit made layout 5).
/// Move it forward when `LAYOUT_VERSION` is bumped (and the migration with it).
pub const COMMIT: &str = "bde74ba8752c66e45c68c8e46c44469b7e1f5214";

/// Builds the previous release's `lbagent` (debug, with its eBPF object)
/// if it is not built yet; returns the binary's path.
pub fn build(channel: &str) -> Result<PathBuf> {
    let root = build::root();
    let base = root.join("target/previous");
    let src = base.join("src");
    let target = base.join("target");
    let bin = target.join("debug/lbagent");
    let stamp = src.join(".commit");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == COMMIT) && bin.exists() {
        return Ok(bin);
    }
    let cache = build::machine_cache().join(format!("previous-{}-{channel}", &COMMIT[..12]));
    let cached = cache.join("lbagent");
    if cached.exists() {
        eprintln!("xtask: previous release ({}) from {}", &COMMIT[..12], cache.display());
        return Ok(cached);
    }
    let git = |args: &[&str]| {
        let mut c = std::process::Command::new("git");
        c.arg("-C").arg(&root).args(args);
        c
    };
    if output(&mut git(&["cat-file", "-e", &format!("{COMMIT}^{{commit}}")])).is_err() {
        bail!(
            "commit {COMMIT} (the previous release, for the upgrade test) is not in this clone's history; \
             fetch the full history (`git fetch --unshallow`)"
        );
    }
    eprintln!("xtask: building the previous release ({}) for the upgrade test", &COMMIT[..12]);
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src)?;
    let archive = git(&["archive", "--format=tar", COMMIT]).output().context("git archive")?;
    if !archive.status.success() {
        bail!("git archive {COMMIT}: {}", String::from_utf8_lossy(&archive.stderr));
    }
    let mut tar = std::process::Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(&src)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .context("tar")?;
    std::io::Write::write_all(tar.stdin.as_mut().unwrap(), &archive.stdout)?;
    if !tar.wait()?.success() {
        bail!("unpacking the previous release into {}", src.display());
    }
    // Its own xtask's steps, run here with its own target dir.
    let cargo = || {
        let mut c = build::cargo(channel);
        c.current_dir(&src).env("CARGO_TARGET_DIR", &target);
        c
    };
    run(cargo()
        .args(["build", "--release", "-p", "lbagent-ebpf", "--target", build::BPF_TARGET, "-Z", "build-std=core"])
        .env("CARGO_ENCODED_RUSTFLAGS", ["-C", "debuginfo=2", "-C", "link-arg=--btf"].join("\x1f")))?;
    run(cargo().args(["build", "-p", "lbagent", "--bin", "lbagent"]))?;
    std::fs::write(&stamp, COMMIT)?;
    // Written under a temporary name and renamed: a killed copy leaves no
    // half binary in the cache.
    if std::fs::create_dir_all(&cache).is_ok() {
        let tmp = cache.join(".lbagent.tmp");
        if std::fs::copy(&bin, &tmp).is_ok() {
            let _ = std::fs::rename(&tmp, &cached);
        }
    }
    Ok(bin)
}
