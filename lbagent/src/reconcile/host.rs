//! The realizer for this host: NAT gateways (plumbing + engine rules) and the
//! runtime facts of load balancers (zone, link-local addresses, mapped ports;
//! their plumbing plugs in here).

use std::{collections::HashSet, net::Ipv4Addr, path::PathBuf};

use anyhow::Result;

use super::Realizer;
use crate::{
    alloc::Allocations,
    dataplane::{attach::AttachMode, engine::Engine},
    naming, natgw,
    state::model::{AgentConfig, LoadBalancer, NatGateway},
};

pub struct Host {
    pub engine: Engine,
    /// The OVS integration bridge (from the state file's `agent` section).
    pub bridge: String,
}

impl Host {
    pub fn new(bpffs: PathBuf, mode: AttachMode) -> Self {
        Host { engine: Engine::new(bpffs, mode), bridge: AgentConfig::default().integration_bridge }
    }
}

/// IPv4 addresses configured on the host (the agent's namespace).
pub fn host_addresses() -> HashSet<Ipv4Addr> {
    nix::ifaddrs::getifaddrs()
        .map(|it| {
            it.filter_map(|ifa| ifa.address.and_then(|a| a.as_sockaddr_in().map(|s| s.ip()))).collect()
        })
        .unwrap_or_default()
}

impl Realizer for Host {
    fn ensure_lb(&mut self, lb: &LoadBalancer, alloc: &mut Allocations) -> Result<Vec<String>> {
        let mut changes = Vec::new();
        let zone_key = naming::lb_zone_key(&lb.id);
        if !alloc.zones.contains_key(&zone_key) {
            changes.push(format!("zone {}", alloc.zone(&zone_key)?));
        }
        if !alloc.lbs.contains_key(&lb.id) {
            let (inner, outer) = alloc.lb_addresses(&lb.id, &host_addresses())?;
            changes.push(format!("allocated inner {inner}, outer {outer}"));
        }
        let backends: Vec<&str> =
            lb.backend_groups.iter().flat_map(|g| g.backends.iter().map(|b| b.id.as_str())).collect();
        let (added, released) = alloc.lb_ports(&lb.id, &backends)?;
        for b in added {
            changes.push(format!("backend {b}: mapped port {}", alloc.lbs[&lb.id].ports[&b]));
        }
        for b in released {
            changes.push(format!("backend {b}: mapped port released"));
        }
        Ok(changes)
    }

    fn remove_lb(&mut self, id: &str, alloc: &mut Allocations) -> Result<Vec<String>> {
        let mut changes = Vec::new();
        if let Some(a) = alloc.release_lb(id) {
            changes.push(format!("released inner {}, outer {}, {} mapped ports", a.inner, a.outer, a.ports.len()));
        }
        if let Some(z) = alloc.release_zone(&naming::lb_zone_key(id)) {
            changes.push(format!("released zone {z}"));
        }
        Ok(changes)
    }

    fn configure(&mut self, agent: &AgentConfig) {
        self.bridge = agent.integration_bridge.clone();
    }

    fn ensure_gw(&mut self, gw: &NatGateway, prev: Option<&NatGateway>, alloc: &mut Allocations) -> Result<Vec<String>> {
        natgw::ensure(&mut self.engine, &self.bridge, gw, prev, alloc)
    }

    fn remove_gw(&mut self, prev: &NatGateway, alloc: &mut Allocations) -> Result<Vec<String>> {
        natgw::remove(&mut self.engine, prev, alloc)
    }
}
