//! The VPC NAT gateway (kube-ovn's iptables gateway, with every iptables rule
//! replaced by engine map entries): plumbing in `plumb`, rules in `rules`.
//! Changes touch only the map entries that differ; no program reload.

pub mod plumb;
pub mod qos;
pub mod rules;

use anyhow::{Context, Result};

use crate::outcome::{Changes, ErrorKind, WithKind};
use crate::{
    alloc::{AllocError, Allocated, Allocations},
    dataplane::engine::Engine,
    naming,
    state::spec::Gw,
    zone::{self, Site},
};

/// The gateway's zone: programs on `eth0` (VPC side) and `net1` (external).
fn site(name: &str) -> Site {
    Site {
        zone_key: naming::gw_zone_key(name),
        rule_prefix: naming::gw_rule_prefix(name),
        netns: naming::gw_netns(name),
        ifaces: vec![plumb::LAN_IF.into(), plumb::EXT_IF.into()],
    }
}

/// Allocates everything the gateway needs (zone, rule ids, QoS buckets),
/// changing nothing on the host: the reconciler persists the result before
/// `ensure` uses it.
pub fn allocate(gw: &Gw, alloc: &mut Allocations) -> Result<Changes> {
    let mut changes = Changes::new();
    let site = site(&gw.name);
    if !alloc.zones.contains_key(&site.zone_key) {
        changes.push(format!("zone {}", alloc.zone(&site.zone_key)?));
    }
    let zone = alloc.zone(&site.zone_key)?;
    rules::rules(gw, zone, rules::Ifaces { lan: 0, ext: 0 }, &mut |k| alloc.rule_id(k));
    qos::allocate(gw, alloc)?;
    Ok(changes)
}

/// Makes the host match the gateway with what `allocate` gave it; releases
/// what the gateway no longer uses once the host stopped using it.
pub fn ensure(
    engine: &mut Engine,
    bridge: &str,
    gw: &Gw,
    prev: Option<&Gw>,
    alloc: &mut Allocations,
) -> Result<Changes> {
    let mut changes = Changes::new();
    let site = site(&gw.name);
    let zone = *alloc
        .zones
        .get(&site.zone_key)
        .ok_or_else(|| AllocError::NotAllocated(site.zone_key.clone()))
        .kind(ErrorKind::Allocation)?;
    let plumb::Plumbed { lan, ext, bridges } = plumb::ensure(gw, bridge, &mut changes).kind(ErrorKind::Plumbing)?;
    let mut ids = Allocated::new(&alloc.rule_ids);
    let want = rules::rules(gw, zone, rules::Ifaces { lan, ext }, &mut |k| ids.get(k));
    ids.check().kind(ErrorKind::Allocation)?;
    engine.sync_zone(zone, &want.dnats, Some(&want.snats), &mut changes).kind(ErrorKind::Rules)?;
    let t = engine.tables().kind(ErrorKind::Rules)?;
    // Flush what the reference flushes, after the rules changed.
    if let Some(prev) = prev {
        let ids = rules::flushes(prev, Some(gw), alloc);
        if !ids.is_empty() {
            let n = t
                .flush_conntrack(|k, e| k.zone == zone && (ids.contains(&e.dnat_rule) || ids.contains(&e.snat_rule)))
                .kind(ErrorKind::Rules)?;
            changes.push(format!("flushed {n} flows of deleted rules"));
        }
    }
    let q = qos::qos(gw, rules::Ifaces { lan, ext }, alloc).kind(ErrorKind::Allocation)?;
    changes.append(t.sync_qos(zone, &q.zone).kind(ErrorKind::Rules)?);
    // Attached after rules and QoS are written (see `lb::ensure`).
    if engine.set_zone_ct_limits(zone, &gw.conntrack_limits).kind(ErrorKind::Rules)? {
        changes.push("conntrack limits set".into());
    }
    zone::attach(engine, zone, &site, &mut changes).kind(ErrorKind::Attach)?;
    alloc.release_qos(&naming::gw_qos_prefix(&gw.name), &q.keys);
    zone::release_unused_rules(engine, alloc, &site, &want.keys, &mut changes).kind(ErrorKind::Rules)?;
    // Last: an OVS outage must not hold back rule updates.
    bridges.context("bridge ports (the rules were updated)").kind(ErrorKind::Ovs)?;
    Ok(changes)
}

pub fn remove(engine: &mut Engine, name: &str, alloc: &mut Allocations) -> Result<Changes> {
    let mut changes = Changes::new();
    let site = site(name);
    zone::clear(engine, alloc, &site, &mut changes).kind(ErrorKind::Rules)?;
    plumb::remove(name, &mut changes).kind(ErrorKind::Plumbing)?;
    alloc.release_qos(&naming::gw_qos_prefix(name), &Default::default());
    zone::release(engine, alloc, &site, &mut changes).kind(ErrorKind::Allocation)?;
    Ok(changes)
}
