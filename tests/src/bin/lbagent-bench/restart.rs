//! Section 15 of `cargo xtask bench`: a restart at scale. An agent runs N
//! load balancers (a zone each: namespace, veths, OVS port, programs);
//! it is killed with SIGKILL, a backend port is changed in the state file,
//! and the agent is started again (the release build, as installed). Timed: from the start to the first apply
//! reported (which carries the change), and from a second change written
//! once that apply is reported to its apply. Side by side at each N: the
//! restart as it runs (the same build takes its programs from their pins),
//! and a restart that must load every zone's programs again (their pins
//! removed while the agent is down, as the first start of a new build
//! does).

use std::{
    fmt::Write as _,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use lbagent_tests::{
    agent::{AgentDirs, AgentProcess},
    lbagent_release_bin,
    ovs::OvsBridge,
    unique,
};
use nix::sys::signal::Signal;
use serde_json::Value;

pub fn restart(quick: bool, out: &mut String) -> Result<()> {
    let sizes: &[usize] = if quick { &[10, 100] } else { &[10, 100, 500] };
    let _ = writeln!(
        out,
        "\n## 15. Restart at scale\n\n\
         N load balancers (2 direct listeners, 2 backends each); SIGKILL, a backend port changed in the \
         state file, start. *first apply*: start → the first apply reported (it carries the change); \
         *next change*: a change written once that apply is reported → its apply. *pins reused*: the \
         restart as it runs; *programs loaded*: the same with every zone's pinned programs removed while \
         the agent was down (what a new build's first start costs); *repair pass*: start → the end of \
         the repair pass that re-ensures every zone after a start (it runs in slices and yields to a \
         change). Creating the N zones is timed too. The agent is the release build.\n\n\
         | zones | create | restart | first apply | next change | repair pass | zones' programs |\n|---:|---:|---|---:|---:|---:|---|"
    );
    for &n in sizes {
        one_size(n, n <= 100, out)?;
    }
    Ok(())
}

fn one_size(n: usize, also_loaded: bool, out: &mut String) -> Result<()> {
    eprintln!("bench: restart over {n} load balancers");
    let bridge = OvsBridge::new(&unique("brr"))?;
    let dirs = AgentDirs::new("lbbr");
    let state = dirs.path("state.yaml");
    let base = crate::fleet::document(&bridge.name, 0, n, 9000);
    // A change: one backend of the first load balancer on another port.
    let changed = |port: u16| base.replacen("port: 9000}", &format!("port: {port}}}"), 1);
    let mut port = 9000;
    std::fs::write(&state, &base)?;
    let args: Vec<String> =
        ["--state", state.to_str().unwrap(), "--repair-interval", "600"].into_iter().map(String::from).collect();
    let started = Instant::now();
    let mut agent = dirs.spawn(&lbagent_release_bin(), &args, "agent.log");
    wait_apply(&dirs, &agent, None, Duration::from_secs(60 + 3 * n as u64))?;
    let create = started.elapsed();
    // The repair pass that follows every start, before the kill.
    wait_applies(&dirs, 2, Duration::from_secs(60 + 3 * n as u64))?;
    let _ = writeln!(out, "| {n} | {:.1} s | | | | | |", create.as_secs_f64());
    let modes: &[bool] = if also_loaded { &[true, false] } else { &[true] };
    for &reuse in modes {
        agent.signal(Signal::SIGKILL);
        agent.stop();
        if !reuse {
            remove_program_pins(&dirs.bpffs)?;
        }
        port += 1;
        std::fs::write(&state, changed(port))?;
        let t0 = Instant::now();
        agent = dirs.spawn(&lbagent_release_bin(), &args, "agent.log");
        let first = wait_apply(&dirs, &agent, None, Duration::from_secs(60 + 3 * n as u64))?;
        let to_first = t0.elapsed();
        port += 1;
        std::fs::write(&state, changed(port))?;
        let t1 = Instant::now();
        wait_apply(&dirs, &agent, Some(&first), Duration::from_secs(60 + 3 * n as u64))?;
        let to_change = t1.elapsed();
        // The repair pass that follows the start: every zone re-ensured
        // (the first apply, the change, then the pass).
        wait_applies(&dirs, 3, Duration::from_secs(60 + 3 * n as u64))?;
        let to_repaired = t0.elapsed();
        let _ = writeln!(
            out,
            "| {n} | | {} | {:.2} s | {:.2} s | {:.1} s | {} |",
            if reuse { "pins reused" } else { "programs loaded" },
            to_first.as_secs_f64(),
            to_change.as_secs_f64(),
            to_repaired.as_secs_f64(),
            if reuse { "taken from pins" } else { "loaded, verified" },
        );
        eprint!(".");
    }
    agent.stop();
    Ok(())
}

/// Waits for an apply without errors whose revision differs from
/// `after`'s (`None`: any); returns the status then.
pub(crate) fn wait_apply(
    dirs: &AgentDirs,
    agent: &AgentProcess,
    after: Option<&Value>,
    limit: Duration,
) -> Result<Value> {
    let t = Instant::now();
    let revision = |s: &Value| s["revision_running"].clone();
    loop {
        if let Some(s) = dirs.status()
            && s["last_apply"]["ok"] == true
            && after.is_none_or(|a| revision(a) != revision(&s))
        {
            return Ok(s);
        }
        if t.elapsed() > limit {
            bail!("no apply within {limit:?}:\n{}", agent.log());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the agent reports `n` applies done.
fn wait_applies(dirs: &AgentDirs, n: u64, limit: Duration) -> Result<()> {
    let t = Instant::now();
    while dirs.status().is_none_or(|s| s["applies"].as_u64().unwrap_or(0) < n) {
        if t.elapsed() > limit {
            bail!("fewer than {n} applies within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Removes every pinned program (of every build) under the agent's pins.
fn remove_program_pins(bpffs: &Path) -> Result<()> {
    let progs = lbagent::dataplane::pins::versioned_dir(bpffs).join("progs");
    if progs.exists() {
        std::fs::remove_dir_all(&progs)?;
    }
    Ok(())
}
