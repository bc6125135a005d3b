//! A NAT gateway testbed: an integration bridge (OVS, netdev) with VPC hosts,
//! an external Linux bridge with an "internet" host that is also the
//! external gateway (198.51.100.1), and an in-process reconciler driving the
//! gateway through real plumbing and the engine.
//!
//! ```text
//!  vpc hosts 10.10.0.x ── OVS brvpc ── eth0 [natgw-<gw>] net1 ── Linux br ── internet 198.51.100.1
//! ```

use anyhow::Result;

use crate::{
    bed::Bed,
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
    pub bed: Bed,
    pub internet: TestHost,
    pub vpc: Vec<TestHost>,
    pub lan_bridge: OvsBridge,
    pub ext_bridge: LinuxBridge,
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
        // Gateways attach over netlink (the Linux 5.x path); load balancer
        // tests use tcx, so both paths carry real plumbing and traffic.
        let bed = Bed::with_attach(lbagent::dataplane::attach::AttachMode::Netlink)?;
        Ok(GwBed { gw: unique("gw"), bed, internet, vpc, lan_bridge, ext_bridge })
    }

    /// A state file with this bed's bridges and the given gateway sections
    /// (YAML, indented for the gateway mapping: `eips:`, `fips:` ...).
    pub fn state(&self, sections: &str) -> String {
        format!(
            "version: 1\nagent: {{integration_bridge: {}}}\nnat_gateways:\n  - name: {}\n    lan: {{ip: {LAN_GW_IP}, prefix_len: 24, mac: \"02:00:0a:0a:00:fe\", gateway: 10.10.0.1}}\n    external: {{bridge: {}, prefix_len: 24, gateway: {INTERNET_IP}}}\n{}",
            self.lan_bridge.name, self.gw, self.ext_bridge.name, sections
        )
    }

    /// Applies a state, then sets the gateway's veths to the dataplane side
    /// of the mixed-offload setting.
    pub fn apply(&mut self, yaml: &str) {
        self.bed.apply(yaml);
        crate::net::dataplane_offloads_all(&self.netns()).unwrap();
    }

    pub fn netns(&self) -> String {
        lbagent::naming::gw_netns(&self.gw)
    }

    pub fn zone(&self) -> u16 {
        self.bed.reconciler.alloc.zones[&lbagent::naming::gw_zone_key(&self.gw)]
    }
}
