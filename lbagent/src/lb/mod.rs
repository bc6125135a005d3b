//! The VPC load balancer host (cloudpods `ovn.go`, iptables replaced by the
//! engine): plumbing in `plumb`, engine rules in `rules`, proxy-mode
//! listeners through `haproxy`.

pub mod haproxy;
pub mod health;
pub mod plumb;
pub mod rules;

use anyhow::{Context, Result};

use crate::{
    alloc::Allocations, dataplane::engine::Engine, naming, plumbing::host_addresses, state::model::LoadBalancer,
};

/// Allocates what the load balancer needs and makes the host match it.
pub fn ensure(
    engine: &mut Engine,
    bridge: &str,
    lb: &LoadBalancer,
    health: &health::Health,
    alloc: &mut Allocations,
) -> Result<Vec<String>> {
    let mut changes = Vec::new();
    let zone_key = naming::lb_zone_key(&lb.id);
    if !alloc.zones.contains_key(&zone_key) {
        changes.push(format!("zone {}", alloc.zone(&zone_key)?));
    }
    let zone = alloc.zone(&zone_key)?;
    if !alloc.lbs.contains_key(&lb.id) {
        let (inner, outer) = alloc.lb_addresses(&lb.id, &host_addresses())?;
        changes.push(format!("allocated inner {inner}, outer {outer}"));
    }
    let backends: Vec<&str> = lb.backend_groups.iter().flat_map(|g| g.backends.iter().map(|b| b.id.as_str())).collect();
    let (added, released) = alloc.lb_ports(&lb.id, &backends)?;
    let a = alloc.lbs[&lb.id].clone();
    changes.extend(added.iter().map(|b| format!("backend {b}: mapped port {}", a.ports[b])));
    changes.extend(released.iter().map(|b| format!("backend {b}: mapped port released")));

    let plumb::Plumbed { ovn, proxy, ovs } = plumb::ensure(lb, &a, bridge, &mut changes).context("plumbing")?;
    let ns = naming::lb_netns(&lb.id);
    let (o0, _) = naming::lb_ovn_veth(&lb.id);
    let (h0, _) = naming::lb_host_veth(&lb.id);
    engine.attach(zone, &ns, &o0)?;
    engine.attach(zone, &ns, &h0)?;
    engine.attach_loopback(zone, &ns)?;
    let up = |listener: &str, backend: &str| health.is_up(&lb.id, listener, backend);
    let (want, keys) = rules::rules(lb, &a, zone, rules::LbIfaces { ovn, proxy }, &up, alloc);
    engine.sync_zone(zone, &want, None, &mut changes)?;
    let t = engine.tables()?;
    let released = alloc.release_rules(&naming::lb_rule_prefix(&lb.id), &keys);
    if !released.is_empty() {
        t.forget_rule_stats(&released)?;
        changes.push(format!("released {} rule ids", released.len()));
    }
    // Last: an OVS outage must not hold back rule updates (health-driven
    // backend removal above all).
    ovs.context("OVS port (the rules were updated)")?;
    Ok(changes)
}

pub fn remove(engine: &mut Engine, id: &str, alloc: &mut Allocations) -> Result<Vec<String>> {
    let mut changes = Vec::new();
    let zone_key = naming::lb_zone_key(id);
    if let Some(zone) = alloc.zones.get(&zone_key).copied() {
        let ns = naming::lb_netns(id);
        let (o0, _) = naming::lb_ovn_veth(id);
        let (h0, _) = naming::lb_host_veth(id);
        engine.release(zone, &ns, &[&o0, &h0]);
        let n = engine.clear_zone(zone)?;
        changes.push(format!("removed rules, flushed {n} flows"));
    }
    plumb::remove(id, &mut changes)?;
    let released = alloc.release_rules(&naming::lb_rule_prefix(id), &Default::default());
    engine.tables()?.forget_rule_stats(&released)?;
    if let Some(a) = alloc.release_lb(id) {
        changes.push(format!("released inner {}, outer {}, {} mapped ports", a.inner, a.outer, a.ports.len()));
    }
    if let Some(z) = alloc.release_zone(&zone_key) {
        changes.push(format!("released zone {z}"));
    }
    Ok(changes)
}
