//! Open vSwitch ports through `ovs-vsctl` (always with `--timeout`).
//!
//! An unreachable or frozen ovsdb must not freeze the agent: every call is
//! bounded by `TIMEOUT`, and once a call finds ovsdb unavailable, further
//! calls fail at once for `OUTAGE_BACKOFF` instead of each waiting out its
//! own timeout. Callers run the OVS step after the rules (see `lb::ensure`),
//! so rule updates and health-driven backend removal go on during an outage.

use std::{
    process::Output,
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::tools;

pub const TIMEOUT: &str = "--timeout=5";
/// How long calls fail fast after ovsdb was found unavailable.
pub const OUTAGE_BACKOFF: Duration = Duration::from_secs(10);

/// When ovsdb was last found unavailable (shared by every caller).
static OUTAGE: Mutex<Option<Instant>> = Mutex::new(None);

fn run(args: &[&str]) -> Result<Output> {
    if let Some(t) = *OUTAGE.lock().unwrap()
        && t.elapsed() < OUTAGE_BACKOFF
    {
        bail!(
            "ovsdb unavailable (an ovs-vsctl call failed {}s ago; retrying after {}s)",
            t.elapsed().as_secs(),
            OUTAGE_BACKOFF.as_secs()
        );
    }
    let out = tools::command(tools::OVS_VSCTL)?
        .arg(TIMEOUT)
        .args(args)
        .output()
        .context("running ovs-vsctl (is openvswitch-switch installed?)")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Killed by its own alarm (--timeout), or no database connection.
    let outage = out.status.code().is_none() || stderr.contains("database connection failed");
    *OUTAGE.lock().unwrap() = outage.then(Instant::now);
    if outage {
        bail!("ovs-vsctl {}: ovsdb unavailable ({})", args.join(" "), stderr.trim());
    }
    Ok(out)
}

pub fn vsctl(args: &[&str]) -> Result<String> {
    let out = run(args)?;
    if !out.status.success() {
        bail!("ovs-vsctl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Like `vsctl`, but a command that fails (not an outage) gives "".
fn query(args: &[&str]) -> Result<String> {
    let out = run(args)?;
    Ok(if out.status.success() { String::from_utf8_lossy(&out.stdout).trim().to_string() } else { String::new() })
}

/// Whether `bridge` is an OVS bridge (`br-exists` exits 2 when it is not).
pub fn bridge_exists(bridge: &str) -> Result<bool> {
    let out = run(&["br-exists", bridge])?;
    match out.status.code() {
        Some(0) => Ok(true),
        Some(2) => Ok(false),
        _ => bail!("ovs-vsctl br-exists {bridge}: {}", String::from_utf8_lossy(&out.stderr).trim()),
    }
}

/// Adds `port` to `bridge` with `external_ids:iface-id`, or fixes both if the
/// port exists elsewhere or with another id. Returns whether anything changed.
pub fn ensure_port(bridge: &str, port: &str, iface_id: &str) -> Result<bool> {
    // `port-to-br` takes no `--if-exists`: it fails for a missing port,
    // which `query` turns into "".
    let current = query(&["port-to-br", port])?;
    let id = query(&["--if-exists", "get", "Interface", port, "external_ids:iface-id"])?;
    if current == bridge && id.trim_matches('"') == iface_id {
        return Ok(false);
    }
    let ext = format!("external_ids:iface-id={iface_id}");
    vsctl(&["--may-exist", "add-port", bridge, port, "--", "set", "Interface", port, &ext])?;
    Ok(true)
}

/// Deletes `port` if its `external_ids:iface-id` is `iface_id` (the proof
/// that the agent made it); a port of that name that is someone else's is
/// left alone. Returns whether it was deleted.
pub fn del_owned_port(port: &str, iface_id: &str) -> Result<bool> {
    let id = query(&["--if-exists", "get", "Interface", port, "external_ids:iface-id"])?;
    if id.trim_matches('"') != iface_id {
        return Ok(false);
    }
    vsctl(&["--if-exists", "del-port", port]).map(|_| true)
}
