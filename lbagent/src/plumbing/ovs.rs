//! Open vSwitch ports through `ovs-vsctl` (always with `--timeout`).

use anyhow::{Context, Result, bail};

use crate::tools;

pub const TIMEOUT: &str = "--timeout=10";

pub fn vsctl(args: &[&str]) -> Result<String> {
    let out = tools::command(tools::OVS_VSCTL)?
        .arg(TIMEOUT)
        .args(args)
        .output()
        .context("running ovs-vsctl (is openvswitch-switch installed?)")?;
    if !out.status.success() {
        bail!("ovs-vsctl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn bridge_exists(bridge: &str) -> bool {
    tools::command(tools::OVS_VSCTL)
        .and_then(|mut c| Ok(c.args([TIMEOUT, "br-exists", bridge]).status()?.success()))
        .unwrap_or(false)
}

/// Adds `port` to `bridge` with `external_ids:iface-id`, or fixes both if the
/// port exists elsewhere or with another id. Returns whether anything changed.
pub fn ensure_port(bridge: &str, port: &str, iface_id: &str) -> Result<bool> {
    let current = vsctl(&["--if-exists", "port-to-br", port]).unwrap_or_default();
    let id = vsctl(&["--if-exists", "get", "Interface", port, "external_ids:iface-id"]).unwrap_or_default();
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
    let id = vsctl(&["--if-exists", "get", "Interface", port, "external_ids:iface-id"])?;
    if id.trim_matches('"') != iface_id {
        return Ok(false);
    }
    vsctl(&["--if-exists", "del-port", port]).map(|_| true)
}
