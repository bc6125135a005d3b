//! Testbed for lbagent's root tests and demo: unique names, namespaces and
//! veths that clean up on drop (also when a test fails), crafted packets with
//! independently computed checksums, and an engine harness for
//! `BPF_PROG_TEST_RUN`.

pub mod agent;
pub mod bed;
pub mod cgroup;
pub mod collector;
pub mod engine;
pub mod etcd;
pub mod fixture;
pub mod gateway;
pub mod ha_pair;
pub mod hosts;
pub mod keepalived;
pub mod net;
pub mod ovn;
pub mod ovs;
pub mod packet;
pub mod rate;
pub mod topology;
pub mod traffic;
pub mod xdp;

use std::sync::atomic::{AtomicU32, Ordering};

/// A name unique to this process and call, at most `prefix.len() + 7` chars
/// (interface names must stay under 16 bytes).
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{:04x}{:x}", std::process::id() & 0xffff, n % 256)
}

/// The `lbagent` binary of this workspace (built with the tests).
pub fn lbagent_bin() -> std::path::PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("debug/lbagent")
}

/// The release build of `lbagent` (what the package installs), which
/// `cargo xtask build` makes: benchmarks that time the agent's own work run
/// it, not the debug build the tests use.
pub fn lbagent_release_bin() -> std::path::PathBuf {
    lbagent_bin().parent().and_then(|d| d.parent()).expect("target dir").join("release/lbagent")
}

/// The previous release's `lbagent` (the last build of the previous map
/// layout), built from git history by `cargo xtask test` and named by
/// `LBAGENT_PREVIOUS_BIN`. `None` (skip) outside CI when it was not built;
/// under `CI=true` a missing build fails the test instead.
pub fn previous_lbagent_bin() -> Option<std::path::PathBuf> {
    built_artifact("LBAGENT_PREVIOUS_BIN", "`cargo xtask test` builds the previous release")
}

/// A file `cargo xtask test` builds and names in environment variable
/// `var`. `None` (skip, saying `how` to build it) outside CI when it is
/// missing; under `CI=true` a missing one fails the test instead.
pub fn built_artifact(var: &str, how: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os(var).map(std::path::PathBuf::from).filter(|p| p.exists());
    if path.is_none() {
        assert!(std::env::var_os("CI").is_none_or(|v| v != "true"), "{var} unset or missing under CI: {how}");
        eprintln!("skipped: {var} not set ({how})");
    }
    path
}

/// Skips (with a message) when not root; root tests need CAP_NET_ADMIN and CAP_BPF.
pub fn require_root() -> bool {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root");
        return false;
    }
    true
}

/// Polls `f` every 100 ms until it holds; panics naming `what` after 15 s
/// (times [`slowdown`]).
pub fn wait_for(mut f: impl FnMut() -> bool, what: &str) {
    let t = std::time::Instant::now();
    let limit = std::time::Duration::from_secs(15) * slowdown();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// `LBAGENT_TEST_SLOWDOWN=N`: waits for the agent are N times longer. Set
/// by `cargo xtask vm-test` for guests under TCG, where loading a program
/// (the verifier) takes ~20 times as long as on the host.
pub fn slowdown() -> u32 {
    std::env::var("LBAGENT_TEST_SLOWDOWN").ok().and_then(|v| v.parse().ok()).filter(|n| *n > 0).unwrap_or(1)
}

/// `LBAGENT_TEST_SLOW_PATH=1`: test beds and topologies turn the fast path
/// off (`agent.fast_path: false`), so the traffic tests run both ways.
pub fn slow_path() -> bool {
    std::env::var_os("LBAGENT_TEST_SLOW_PATH").is_some_and(|v| v == "1")
}
