//! A NAT gateway testbed: an integration bridge (OVS, netdev) with VPC hosts,
//! an external Linux bridge with an "internet" host that is also the
//! external gateway (198.51.100.1), and an in-process reconciler driving the
//! gateway through real plumbing and the engine.
//!
//! ```text
//!  vpc hosts 10.10.0.x ── OVS brvpc ── eth0 [natgw-<gw>] net1 ── Linux br ── internet 198.51.100.1
//! ```

use std::path::PathBuf;

use anyhow::Result;
use lbagent::{
    dataplane::attach::AttachMode,
    reconcile::{Desired, Reconciler, host::Host},
    state::{Format, load_str},
};

use crate::{
    engine::TestPins,
    hosts::TestHost,
    net::sh,
    ovs::{LinuxBridge, OvsBridge},
    unique,
};

pub const LAN_GW_IP: &str = "10.10.0.254";
pub const INTERNET_IP: &str = "198.51.100.1";

/// The gateway under test and its surroundings.
pub struct GwBed {
    pub gw: String,
    pub reconciler: Reconciler<Host>,
    pub internet: TestHost,
    pub vpc: Vec<TestHost>,
    pub lan_bridge: OvsBridge,
    pub ext_bridge: LinuxBridge,
    pub pins: TestPins,
    pub state_dir: PathBuf,
}

impl GwBed {
    /// VPC hosts get `vpc_ips` (in 10.10.0.0/24, default route via the gateway).
    pub fn new(vpc_ips: &[&str]) -> Result<Self> {
        let lan_bridge = OvsBridge::new(&unique("brv"))?;
        let ext_bridge = LinuxBridge::new(&unique("bre"))?;
        let ext_name = ext_bridge.name.clone();
        let internet =
            TestHost::on(|p| sh(&["ip", "link", "set", p, "master", &ext_name]).map(|_| ()), INTERNET_IP, 24, "")?;
        let mut vpc = Vec::new();
        for ip in vpc_ips {
            vpc.push(TestHost::on(|p| lan_bridge.add_port(p), ip, 24, LAN_GW_IP)?);
        }
        let pins = TestPins::new();
        let state_dir = std::env::temp_dir().join(unique("lbgwsd"));
        let reconciler = Reconciler::open(Host::new(pins.root.clone(), AttachMode::Auto, &state_dir), &state_dir)?;
        Ok(GwBed { gw: unique("gw"), reconciler, internet, vpc, lan_bridge, ext_bridge, pins, state_dir })
    }

    /// A state file with this bed's bridges and the given gateway sections
    /// (YAML, indented for the gateway mapping: `eips:`, `fips:` ...).
    pub fn state(&self, sections: &str) -> String {
        format!(
            "version: 1\nagent: {{integration_bridge: {}}}\nnat_gateways:\n  - name: {}\n    lan: {{ip: {LAN_GW_IP}, prefix_len: 24, mac: \"02:00:0a:0a:00:fe\", gateway: 10.10.0.1}}\n    external: {{bridge: {}, prefix_len: 24, gateway: {INTERNET_IP}}}\n{}",
            self.lan_bridge.name, self.gw, self.ext_bridge.name, sections
        )
    }

    /// Validates and applies a state; panics with every error on failure.
    pub fn apply(&mut self, yaml: &str) {
        let s = load_str(yaml, Format::Yaml).unwrap_or_else(|e| panic!("invalid test state: {e}\n{yaml}"));
        let report = self.reconciler.apply(&Desired::from_state(&s), false);
        assert!(report.ok(), "apply failed: {:?}", report.errors);
    }

    pub fn netns(&self) -> String {
        lbagent::naming::gw_netns(&self.gw)
    }

    pub fn zone(&self) -> u16 {
        self.reconciler.alloc.zones[&lbagent::naming::gw_zone_key(&self.gw)]
    }
}

impl Drop for GwBed {
    fn drop(&mut self) {
        let report = self.reconciler.teardown();
        if !report.ok() {
            eprintln!("gateway teardown: {:?}", report.errors);
        }
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}
