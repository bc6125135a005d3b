//! The VPC NAT gateway (kube-ovn's iptables gateway, with every iptables rule
//! replaced by engine map entries): plumbing in `plumb`, rules in `rules`.
//! Changes touch only the map entries that differ; no program reload.

pub mod plumb;
pub mod qos;
pub mod rules;

use anyhow::{Context, Result};

use crate::{
    alloc::Allocations,
    dataplane::engine::Engine,
    naming,
    state::model::{NatGateway, QosPolicy},
};

pub fn ensure(
    engine: &mut Engine,
    bridge: &str,
    gw: &NatGateway,
    policies: &[QosPolicy],
    prev: Option<&NatGateway>,
    alloc: &mut Allocations,
) -> Result<Vec<String>> {
    let mut changes = Vec::new();
    let zone = alloc.zone(&naming::gw_zone_key(&gw.name))?;
    let plumb::Plumbed { lan, ext, bridges } = plumb::ensure(gw, bridge, &mut changes)?;
    let ns = naming::gw_netns(&gw.name);
    engine.attach(zone, &ns, plumb::LAN_IF)?;
    engine.attach(zone, &ns, plumb::EXT_IF)?;
    engine.attach_loopback(zone, &ns)?;

    let want = rules::rules(gw, zone, rules::Ifaces { lan, ext }, alloc);
    engine.sync_zone(zone, &want.dnats, Some(&want.snats), &mut changes)?;
    let t = engine.tables()?;
    // Flush what the reference flushes, after the rules changed.
    if let Some(prev) = prev {
        let ids = rules::flushes(prev, Some(gw), alloc);
        if !ids.is_empty() {
            let n =
                t.flush_conntrack(|k, e| k.zone == zone && (ids.contains(&e.dnat_rule) || ids.contains(&e.snat_rule)))?;
            changes.push(format!("flushed {n} flows of deleted rules"));
        }
    }
    let q = qos::qos(gw, policies, rules::Ifaces { lan, ext }, alloc)?;
    changes.extend(t.sync_qos(zone, &q.zone)?);
    alloc.release_qos(&naming::gw_qos_prefix(&gw.name), &q.keys);
    let released = alloc.release_rules(&naming::gw_rule_prefix(&gw.name), &want.keys);
    if !released.is_empty() {
        t.forget_rule_stats(&released)?;
        changes.push(format!("released {} rule ids", released.len()));
    }
    // Last: an OVS outage must not hold back rule updates.
    bridges.context("bridge ports (the rules were updated)")?;
    Ok(changes)
}

pub fn remove(engine: &mut Engine, prev: &NatGateway, alloc: &mut Allocations) -> Result<Vec<String>> {
    let mut changes = Vec::new();
    let key = naming::gw_zone_key(&prev.name);
    let Some(zone) = alloc.zones.get(&key).copied() else { return Ok(changes) };
    let ns = naming::gw_netns(&prev.name);
    engine.release(zone, &ns, &[plumb::LAN_IF, plumb::EXT_IF]);
    let n = engine.clear_zone(zone)?;
    changes.push(format!("removed rules, flushed {n} flows"));
    plumb::remove(&prev.name, &mut changes)?;
    alloc.release_qos(&naming::gw_qos_prefix(&prev.name), &Default::default());
    let released = alloc.release_rules(&naming::gw_rule_prefix(&prev.name), &Default::default());
    engine.tables()?.forget_rule_stats(&released)?;
    alloc.release_zone(&key);
    changes.push(format!("released zone {zone}"));
    Ok(changes)
}
