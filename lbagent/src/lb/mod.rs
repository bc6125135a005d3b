//! The VPC load balancer host (cloudpods `ovn.go`, iptables replaced by the
//! engine): plumbing in `plumb`, engine rules in `rules`, proxy-mode
//! listeners through `haproxy`.

pub mod haproxy;
pub mod health;
pub mod plumb;
pub mod rules;
pub mod sched;

use anyhow::{Context, Result};

use crate::outcome::{Changes, ErrorKind, WithKind};
use crate::{
    alloc::{AllocError, Allocated, Allocations},
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

/// Allocates everything the load balancer needs (zone, link-local
/// addresses, mapped ports, rule ids), changing nothing on the host: the
/// reconciler persists the result before `ensure` uses it.
pub fn allocate(lb: &Lb, alloc: &mut Allocations) -> Result<Changes> {
    let mut changes = Changes::new();
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
    // A released port is free at once: its rules are keyed by the backend's
    // rule ids, which stay allocated until `ensure` replaced them.
    let (added, released) = alloc.lb_ports(&lb.id, &backends)?;
    let a = alloc.lbs[&lb.id].clone();
    changes.extend(added.iter().map(|b| format!("backend {b}: mapped port {}", a.ports[b])));
    changes.extend(released.iter().map(|b| format!("backend {b}: mapped port released")));
    // Rule keys do not depend on health: with every backend down no
    // scheduler table is built for ids alone.
    let none = rules::LbIfaces { ovn: 0, proxy: 0 };
    rules::rules(lb, &a, zone, none, &|_, _| false, &mut |k| alloc.rule_id(k));
    Ok(changes)
}

/// Makes the host match the load balancer with what `allocate` gave it;
/// releases the rule ids it no longer uses once the host stopped using them.
pub fn ensure(
    engine: &mut Engine,
    bridge: &str,
    lb: &Lb,
    health: &health::Health,
    alloc: &mut Allocations,
) -> Result<Changes> {
    let mut changes = Changes::new();
    let zone_key = naming::lb_zone_key(&lb.id);
    let zone = *alloc
        .zones
        .get(&zone_key)
        .ok_or_else(|| AllocError::NotAllocated(zone_key.clone()))
        .kind(ErrorKind::Allocation)?;
    let a = alloc
        .lbs
        .get(&lb.id)
        .cloned()
        .ok_or_else(|| AllocError::NotAllocated(format!("addresses of {zone_key}")))
        .kind(ErrorKind::Allocation)?;

    let plumb::Plumbed { ovn, proxy, ovs } = plumb::ensure(lb, &a, bridge, &mut changes).kind(ErrorKind::Plumbing)?;
    // Before the rules that DNAT the inner address to the VPC: only
    // haproxy (and root) may open connections through `h…1`.
    let (_, h1) = naming::lb_host_veth(&lb.id);
    engine.attach_proxy_guard(&h1, haproxy::config::worker_uid()).context("proxy guard").kind(ErrorKind::Attach)?;
    let site = site(&lb.id);
    let up = |listener: &str, backend: &str| health.is_up(&lb.id, listener, backend);
    let mut ids = Allocated::new(&alloc.rule_ids);
    let (want, keys) = rules::rules(lb, &a, zone, rules::LbIfaces { ovn, proxy }, &up, &mut |k| ids.get(k));
    ids.check().kind(ErrorKind::Allocation)?;
    engine.sync_zone(zone, &want, None, &mut changes).kind(ErrorKind::Rules)?;
    // Attached after the rules are written: a program that replaces an
    // older build's (an upgrade, `dataplane::migrate`) never runs against
    // a half-written table.
    if engine.set_zone_ct_limits(zone, &lb.conntrack_limits).kind(ErrorKind::Rules)? {
        changes.push("conntrack limits set".into());
    }
    zone::attach(engine, zone, &site, &mut changes).kind(ErrorKind::Attach)?;
    zone::release_unused_rules(engine, alloc, &site, &keys, &mut changes).kind(ErrorKind::Rules)?;
    // Last: an OVS outage must not hold back rule updates (health-driven
    // backend removal above all).
    ovs.context("OVS port (the rules were updated)").kind(ErrorKind::Ovs)?;
    Ok(changes)
}

pub fn remove(engine: &mut Engine, id: &str, alloc: &mut Allocations) -> Result<Changes> {
    let mut changes = Changes::new();
    let site = site(id);
    zone::clear(engine, alloc, &site, &mut changes).kind(ErrorKind::Rules)?;
    let (_, h1) = naming::lb_host_veth(id);
    engine.detach_proxy_guard(&h1).kind(ErrorKind::Attach)?;
    plumb::remove(id, &mut changes).kind(ErrorKind::Plumbing)?;
    if let Some(a) = alloc.release_lb(id) {
        changes.push(format!("released inner {}, outer {}, {} mapped ports", a.inner, a.outer, a.ports.len()));
    }
    zone::release(engine, alloc, &site, &mut changes).kind(ErrorKind::Allocation)?;
    Ok(changes)
}
