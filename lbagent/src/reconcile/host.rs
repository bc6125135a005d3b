//! The realizer for this host. At this stage it owns the runtime facts of
//! every object (zone, link-local addresses, mapped ports); the load balancer
//! and NAT gateway plumbing plug in here.

use std::{collections::HashSet, net::Ipv4Addr};

use anyhow::Result;

use super::Realizer;
use crate::{
    alloc::Allocations,
    naming,
    state::model::{LoadBalancer, NatGateway},
};

#[derive(Default)]
pub struct Host;

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

    fn ensure_gw(&mut self, gw: &NatGateway, alloc: &mut Allocations) -> Result<Vec<String>> {
        let key = naming::gw_zone_key(&gw.name);
        if alloc.zones.contains_key(&key) {
            return Ok(vec![]);
        }
        Ok(vec![format!("zone {}", alloc.zone(&key)?)])
    }

    fn remove_gw(&mut self, name: &str, alloc: &mut Allocations) -> Result<Vec<String>> {
        Ok(alloc.release_zone(&naming::gw_zone_key(name)).map(|z| format!("released zone {z}")).into_iter().collect())
    }
}
