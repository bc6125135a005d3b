//! Open vSwitch ports through `ovs-vsctl` (always with `--timeout`).
//!
//! Checks read one snapshot of every bridge's ports and every interface's
//! `iface-id` per pass (`begin_pass`), not two `ovs-vsctl` calls per port:
//! each call reads the tables it needs, so at 500 ports a check cost
//! ~50 ms and a repair pass over 500 objects spent most of its time in
//! them. A port the snapshot does not show as wanted is asked and fixed as
//! before.
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

/// Every port's bridge and `iface-id` as one `ovs-vsctl` call read them,
/// for the pass under way (`None`: not read yet in this pass).
static VIEW: Mutex<Option<View>> = Mutex::new(None);

#[derive(Debug, Default, PartialEq)]
struct View {
    /// Port name → its bridge.
    bridge: std::collections::HashMap<String, String>,
    /// Interface name → its `external_ids:iface-id`.
    iface_id: std::collections::HashMap<String, String>,
}

/// Starts a pass: the next check reads OVS again.
pub fn begin_pass() {
    *VIEW.lock().unwrap() = None;
}

/// Whether this pass's snapshot shows `port` on `bridge` with `iface_id`
/// (read once per pass; a failed read answers `false`: ask as before).
fn seen_as_wanted(bridge: &str, port: &str, iface_id: &str) -> bool {
    let mut view = VIEW.lock().unwrap();
    if view.is_none() {
        match snapshot() {
            Ok(v) => *view = Some(v),
            Err(e) => {
                tracing::debug!("reading OVS ports at once: {e:#}");
                return false;
            }
        }
    }
    let v = view.as_ref().expect("read above");
    v.bridge.get(port).is_some_and(|b| b == bridge) && v.iface_id.get(port).is_some_and(|i| i == iface_id)
}

/// Forgets what the snapshot says of `port` (it was changed).
fn forget(port: &str) {
    if let Some(v) = VIEW.lock().unwrap().as_mut() {
        v.bridge.remove(port);
        v.iface_id.remove(port);
    }
}

/// Every bridge's ports and every interface's `iface-id`, in one call.
fn snapshot() -> Result<View> {
    let out = vsctl(&[
        "--format=json",
        "--",
        "--columns=name,ports",
        "list",
        "Bridge",
        "--",
        "--columns=_uuid,name",
        "list",
        "Port",
        "--",
        "--columns=name,external_ids",
        "list",
        "Interface",
    ])?;
    parse_snapshot(&out)
}

/// Parses the three tables `snapshot` lists (ovs-vsctl's JSON format: a
/// set of one element is written as the element itself).
fn parse_snapshot(out: &str) -> Result<View> {
    use serde_json::Value;
    let tables: Vec<Value> = out.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    let [bridges, ports, ifaces] = tables.as_slice() else {
        bail!("ovs-vsctl listed {} tables, expected 3", tables.len());
    };
    let rows = |t: &Value| t["data"].as_array().cloned().unwrap_or_default();
    let uuid = |v: &Value| (v[0] == "uuid").then(|| v[1].as_str().map(str::to_string)).flatten();
    let port_names: std::collections::HashMap<String, String> =
        rows(ports).iter().filter_map(|r| Some((uuid(&r[0])?, r[1].as_str()?.to_string()))).collect();
    let mut view = View::default();
    for r in rows(bridges) {
        let Some(name) = r[0].as_str() else { continue };
        let members: Vec<Value> = match r[1][0].as_str() {
            Some("set") => r[1][1].as_array().cloned().unwrap_or_default(),
            Some("uuid") => vec![r[1].clone()],
            _ => vec![],
        };
        for m in members {
            if let Some(port) = uuid(&m).and_then(|u| port_names.get(&u)) {
                view.bridge.insert(port.clone(), name.to_string());
            }
        }
    }
    for r in rows(ifaces) {
        let Some(name) = r[0].as_str() else { continue };
        let pairs = if r[1][0] == "map" { r[1][1].as_array().cloned().unwrap_or_default() } else { vec![] };
        if let Some(id) = pairs.iter().find(|p| p[0] == "iface-id").and_then(|p| p[1].as_str()) {
            view.iface_id.insert(name.to_string(), id.to_string());
        }
    }
    Ok(view)
}

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
    if seen_as_wanted(bridge, port, iface_id) {
        return Ok(false);
    }
    forget(port);
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
    forget(port);
    vsctl(&["--if-exists", "del-port", port]).map(|_| true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What ovs-vsctl 3.x printed for one bridge with two ports (a set)
    /// and one with one port (the bare element), one of them without an
    /// iface-id.
    #[test]
    fn a_snapshot_parses_sets_of_one_and_many() {
        let out = r#"{"data":[["br1",["set",[["uuid","u1"],["uuid","u2"]]]],["br2",["uuid","u3"]]],"headings":["name","ports"]}
{"data":[[["uuid","u1"],"br1"],[["uuid","u2"],"vt1"],[["uuid","u3"],"vt2"]],"headings":["_uuid","name"]}
{"data":[["br1",["map",[]]],["vt1",["map",[["iface-id","abc"],["other","x"]]]],["vt2",["map",[]]]],"headings":["name","external_ids"]}"#;
        let v = parse_snapshot(out).unwrap();
        assert_eq!(v.bridge.get("vt1").map(String::as_str), Some("br1"));
        assert_eq!(v.bridge.get("vt2").map(String::as_str), Some("br2"));
        assert_eq!(v.iface_id.get("vt1").map(String::as_str), Some("abc"));
        assert_eq!(v.iface_id.get("vt2"), None);
        assert!(parse_snapshot("{}").is_err(), "three tables or an error");
    }
}
