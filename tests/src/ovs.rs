//! Open vSwitch on the userspace (netdev) datapath for tests: started once
//! per machine (under a file lock, shared by parallel test processes) and
//! bridges with unique names removed on drop.

use std::{fs::File, path::Path, process::Command, time::Duration};

use anyhow::{Context, Result, bail};

use crate::net::sh;

const LOCK: &str = "/run/lbagent-tests-ovs.lock";

fn vsctl_ok() -> bool {
    Command::new("ovs-vsctl").args(["--timeout=2", "show"]).output().is_ok_and(|o| o.status.success())
        && Path::new("/var/run/openvswitch/ovs-vswitchd.pid").exists()
}

/// The machine-wide lock for starting daemons (held until dropped).
pub fn lock() -> Result<nix::fcntl::Flock<File>> {
    let lock = File::create(LOCK)?;
    Ok(nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| e)?)
}

pub fn bridge_exists(name: &str) -> bool {
    Command::new("ovs-vsctl").args(["--timeout=5", "br-exists", name]).status().is_ok_and(|s| s.success())
}

/// Starts ovsdb-server and ovs-vswitchd (userspace TSO on) unless running.
pub fn ensure_running() -> Result<()> {
    let _lock = lock()?;
    if vsctl_ok() {
        return Ok(());
    }
    for d in ["/var/lib/openvswitch", "/var/run/openvswitch", "/var/log/openvswitch", "/etc/openvswitch"] {
        std::fs::create_dir_all(d)?;
    }
    let db = "/var/lib/openvswitch/conf.db";
    if !Path::new(db).exists() {
        sh(&["ovsdb-tool", "create", db, "/usr/share/openvswitch/vswitch.ovsschema"])?;
    }
    if !Command::new("ovs-appctl").args(["-t", "ovsdb-server", "version"]).output().is_ok_and(|o| o.status.success()) {
        sh(&[
            "ovsdb-server",
            db,
            "--remote=punix:/var/run/openvswitch/db.sock",
            "--pidfile",
            "--detach",
            "--log-file",
        ])?;
    }
    sh(&["ovs-vsctl", &ovs_timeout(), "--no-wait", "init"])?;
    // Without userspace TSO, TCP over veth ports fails with bad checksums.
    sh(&[
        "ovs-vsctl",
        &ovs_timeout(),
        "--no-wait",
        "set",
        "Open_vSwitch",
        ".",
        "other_config:userspace-tso-enable=true",
    ])?;
    sh(&["ovs-vswitchd", "--pidfile", "--detach", "--log-file"]).context("starting ovs-vswitchd")?;
    for _ in 0..50 {
        if vsctl_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("Open vSwitch did not come up")
}

/// An OVS bridge on the netdev datapath, deleted on drop.
pub struct OvsBridge {
    pub name: String,
}

impl OvsBridge {
    pub fn new(name: &str) -> Result<Self> {
        ensure_running()?;
        sh(&["ovs-vsctl", &ovs_timeout(), "add-br", name, "--", "set", "bridge", name, "datapath_type=netdev"])?;
        sh(&["ip", "link", "set", name, "up"])?;
        Ok(OvsBridge { name: name.into() })
    }

    /// Plugs a host-namespace interface in as a port.
    pub fn add_port(&self, port: &str) -> Result<()> {
        sh(&["ovs-vsctl", &ovs_timeout(), "add-port", &self.name, port]).map(|_| ())
    }
}

impl Drop for OvsBridge {
    fn drop(&mut self) {
        let _ = sh(&["ovs-vsctl", &ovs_timeout(), "--if-exists", "del-br", &self.name]);
    }
}

/// A Linux bridge, deleted on drop.
pub struct LinuxBridge {
    pub name: String,
}

impl LinuxBridge {
    pub fn new(name: &str) -> Result<Self> {
        sh(&["ip", "link", "add", name, "type", "bridge"])?;
        sh(&["ip", "link", "set", name, "up"])?;
        Ok(LinuxBridge { name: name.into() })
    }
}

impl Drop for LinuxBridge {
    fn drop(&mut self) {
        let _ = sh(&["ip", "link", "del", &self.name]);
    }
}

/// A port on a shared bridge (e.g. `br-int`), removed on drop.
pub struct OvsPort(pub String);

impl Drop for OvsPort {
    fn drop(&mut self) {
        let _ = sh(&["ovs-vsctl", &ovs_timeout(), "--if-exists", "del-port", &self.0]);
    }
}

/// A host link (e.g. a veth end left in the host namespace), deleted on drop.
pub struct HostLink(pub String);

impl Drop for HostLink {
    fn drop(&mut self) {
        let _ = sh(&["ip", "link", "del", &self.0]);
    }
}

/// `--timeout=N` for ovs-vsctl: 10 s, stretched in emulated guests
/// (`LBAGENT_TEST_SLOWDOWN`), where ovsdb answers far slower.
fn ovs_timeout() -> String {
    format!("--timeout={}", 10 * crate::slowdown())
}
