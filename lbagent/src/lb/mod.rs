//! The VPC load balancer host (cloudpods `ovn.go`, iptables replaced by the
//! engine): plumbing in `plumb`, engine rules in `rules`, proxy-mode
//! listeners through `haproxy`.

pub mod haproxy;
pub mod health;
pub mod plumb;
pub mod rules;
pub mod sched;

use anyhow::{Context, Result};

use crate::{
    alloc::Allocations,
    dataplane::engine::Engine,
    naming,
    plumbing::host_addresses,
    state::spec::Lb,
    zone::{self, Site},
};

/// The load balancer's zone: programs on `o…0` (VPC side) and `h…0` (proxy
/// side); the proxy guard on the host's `h…1` is attached apart (one
/// program for every load balancer, `Engine::attach_proxy_guard`).
fn site(id: &str) -> Site {
    let (o0, _) = naming::lb_ovn_veth(id);
    let (h0, _) = naming::lb_host_veth(id);
    Site {
        zone_key: naming::lb_zone_key(id),
        rule_prefix: naming::lb_rule_prefix(id),
        netns: naming::lb_netns(id),
        ifaces: vec![o0, h0],
    }
}

/// Allocates what the load balancer needs and makes the host match it.
pub fn ensure(
    engine: &mut Engine,
    bridge: &str,
    lb: &Lb,
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
    let backends: Vec<&str> = lb.backends().map(|(_, b)| b.id.as_str()).collect();
    let (added, released) = alloc.lb_ports(&lb.id, &backends)?;
    let a = alloc.lbs[&lb.id].clone();
    changes.extend(added.iter().map(|b| format!("backend {b}: mapped port {}", a.ports[b])));
    changes.extend(released.iter().map(|b| format!("backend {b}: mapped port released")));

    let plumb::Plumbed { ovn, proxy, ovs } = plumb::ensure(lb, &a, bridge, &mut changes).context("plumbing")?;
    // Before the rules that DNAT the inner address to the VPC: only
    // haproxy (and root) may open connections through `h…1`.
    let (_, h1) = naming::lb_host_veth(&lb.id);
    engine.attach_proxy_guard(&h1, haproxy::config::worker_uid()).context("proxy guard")?;
    let site = site(&lb.id);
    let up = |listener: &str, backend: &str| health.is_up(&lb.id, listener, backend);
    let (want, keys) = rules::rules(lb, &a, zone, rules::LbIfaces { ovn, proxy }, &up, alloc);
    engine.sync_zone(zone, &want, None, &mut changes)?;
    // Attached after the rules are written: a program that replaces an
    // older build's (an upgrade, `dataplane::migrate`) never runs against
    // a half-written table.
    zone::attach(engine, zone, &site)?;
    zone::release_unused_rules(engine, alloc, &site, &keys, &mut changes)?;
    // Last: an OVS outage must not hold back rule updates (health-driven
    // backend removal above all).
    ovs.context("OVS port (the rules were updated)")?;
    Ok(changes)
}

pub fn remove(engine: &mut Engine, id: &str, alloc: &mut Allocations) -> Result<Vec<String>> {
    let mut changes = Vec::new();
    let site = site(id);
    zone::clear(engine, alloc, &site, &mut changes)?;
    let (_, h1) = naming::lb_host_veth(id);
    engine.detach_proxy_guard(&h1)?;
    plumb::remove(id, &mut changes)?;
    if let Some(a) = alloc.release_lb(id) {
        changes.push(format!("released inner {}, outer {}, {} mapped ports", a.inner, a.outer, a.ports.len()));
    }
    zone::release(engine, alloc, &site, &mut changes)?;
    Ok(changes)
}
