//! OVN for tests, single chassis: NB/SB databases and northd (`ovn-ctl
//! start_northd`), ovn-controller with `br-int` on the netdev datapath.
//! Started once per machine under the OVS lock; logical objects the tests
//! create have unique names and are removed by their guards.

use std::{process::Command, time::Duration};

use anyhow::{Result, bail};

use crate::{net::sh, ovs};

const OVN_CTL: &str = "/usr/share/ovn/scripts/ovn-ctl";

fn ok(cmd: &[&str]) -> bool {
    Command::new(cmd[0]).args(&cmd[1..]).output().is_ok_and(|o| o.status.success())
}

/// ovn-ctl skips a daemon whose pidfile names a live process; after a
/// crash or reboot the pid may belong to anything (a kworker), and the
/// database never starts. Pidfiles of processes that are not OVN's go.
fn remove_stale_pidfiles() {
    for name in ["ovnnb_db", "ovnsb_db", "ovn-northd", "ovn-controller"] {
        let pidfile = format!("/var/run/ovn/{name}.pid");
        let Ok(pid) = std::fs::read_to_string(&pidfile) else { continue };
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", pid.trim())).unwrap_or_default();
        if !["ovsdb-server", "ovn-northd", "ovn-controller"].contains(&comm.trim()) {
            let _ = std::fs::remove_file(&pidfile);
        }
    }
}

pub fn ensure_running() -> Result<()> {
    ovs::ensure_running()?;
    let _lock = ovs::lock()?;
    if !ok(&["ovn-sbctl", "--timeout=2", "show"]) {
        remove_stale_pidfiles();
        sh(&[OVN_CTL, "start_northd"])?;
    }
    // Keep an existing chassis name: changing it under a running
    // ovn-controller leaves a stale chassis that blocks port binding.
    if !ok(&["ovs-vsctl", "--timeout=5", "get", "open", ".", "external-ids:system-id"]) {
        sh(&["ovs-vsctl", "--timeout=10", "set", "open", ".", "external-ids:system-id=lbagent-test"])?;
    }
    sh(&[
        "ovs-vsctl",
        "--timeout=10",
        "set",
        "open",
        ".",
        "external-ids:ovn-remote=unix:/var/run/ovn/ovnsb_db.sock",
        "external-ids:ovn-encap-type=geneve",
        "external-ids:ovn-encap-ip=127.0.0.1",
        "external-ids:ovn-bridge-datapath-type=netdev",
    ])?;
    if !ok(&["ovn-appctl", "-t", "ovn-controller", "version"]) {
        sh(&[OVN_CTL, "start_controller"])?;
    }
    for _ in 0..100 {
        if ovs::bridge_exists("br-int") {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("ovn-controller did not create br-int")
}

/// A logical switch, deleted (with its ports) on drop.
pub struct LogicalSwitch {
    pub name: String,
}

impl LogicalSwitch {
    pub fn new(name: &str) -> Result<Self> {
        sh(&["ovn-nbctl", "--timeout=10", "ls-add", name])?;
        Ok(LogicalSwitch { name: name.into() })
    }

    /// A port with `mac ip` as its address.
    pub fn add_port(&self, port: &str, mac: &str, ip: &str) -> Result<()> {
        sh(&["ovn-nbctl", "--timeout=10", "lsp-add", &self.name, port])?;
        sh(&["ovn-nbctl", "--timeout=10", "lsp-set-addresses", port, &format!("{mac} {ip}")]).map(|_| ())
    }

    /// Chassis the port is bound to (empty while unbound).
    pub fn binding(port: &str) -> String {
        sh(&[
            "ovn-sbctl",
            "--timeout=10",
            "--bare",
            "--columns=chassis",
            "find",
            "Port_Binding",
            &format!("logical_port={port}"),
        ])
        .unwrap_or_default()
        .trim()
        .to_string()
    }
}

impl Drop for LogicalSwitch {
    fn drop(&mut self) {
        let _ = sh(&["ovn-nbctl", "--timeout=10", "--if-exists", "ls-del", &self.name]);
    }
}
