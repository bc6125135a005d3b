//! The VPC NAT gateway (kube-ovn's iptables gateway, with every iptables rule
//! replaced by engine map entries): plumbing in `plumb`, rules in `rules`.
//! Changes touch only the map entries that differ; no program reload.

pub mod plumb;
pub mod rules;

use std::collections::HashSet;

use anyhow::Result;
use lbagent_common::DnatKey;

use crate::{
    alloc::Allocations,
    dataplane::engine::Engine,
    naming,
    state::model::NatGateway,
};

pub fn ensure(engine: &mut Engine, bridge: &str, gw: &NatGateway, prev: Option<&NatGateway>, alloc: &mut Allocations) -> Result<Vec<String>> {
    let mut changes = Vec::new();
    let zone = alloc.zone(&naming::gw_zone_key(&gw.name))?;
    let (lan, ext) = plumb::ensure(gw, bridge, &mut changes)?;
    let ns = naming::gw_netns(&gw.name);
    engine.attach(zone, &ns, plumb::LAN_IF)?;
    engine.attach(zone, &ns, plumb::EXT_IF)?;

    let want = rules::rules(gw, zone, rules::Ifaces { lan, ext }, alloc);
    let t = engine.tables()?;
    // DNAT: upsert what differs, delete what is no longer wanted.
    let have_dnat: Vec<_> = t.dnat_rules()?.into_iter().filter(|(k, _, _)| k.zone == zone).collect();
    for d in &want.dnats {
        let current = have_dnat.iter().find(|(k, _, _)| *k == d.key());
        let same = current.is_some_and(|(_, r, bs)| {
            *r == d.rule() && bs.iter().map(|b| (b.addr.into(), b.port)).collect::<Vec<_>>() == d.backends
        });
        if !same {
            t.set_dnat(d)?;
            changes.push(format!("dnat {} proto {} port {} -> {:?}", d.addr, d.proto, d.port, d.backends));
        }
    }
    let wanted: HashSet<DnatKey> = want.dnats.iter().map(|d| d.key()).collect();
    for (k, _, _) in &have_dnat {
        if !wanted.contains(k) {
            t.remove_dnat(k)?;
            changes.push(format!("removed dnat {} proto {} port {}", std::net::Ipv4Addr::from(k.addr), k.proto, k.port));
        }
    }
    // SNAT likewise.
    let have_snat: Vec<_> = t.snat_rules()?.into_iter().filter(|(_, k, _)| k.zone == zone).collect();
    for s in &want.snats {
        let key = s.key();
        let current = have_snat.iter().find(|(len, k, _)| *len == key.prefix_len() && *k == key.data());
        let same = current.is_some_and(|(_, _, r)| r.addr == s.to.octets() && r.rule_id == s.rule_id && (r.port_min, r.port_max) == s.ports);
        if !same {
            t.set_snat(s)?;
            changes.push(format!("snat {}/{} -> {}", s.cidr.0, s.cidr.1, s.to));
        }
    }
    for (len, k, _) in &have_snat {
        if !want.snats.iter().any(|s| s.key().prefix_len() == *len && s.key().data() == *k) {
            t.remove_snat_key(*len, *k)?;
            changes.push(format!("removed snat {}/{}", std::net::Ipv4Addr::from(k.addr), len - lbagent_common::SNAT_KEY_FIXED_BITS));
        }
    }
    // Flush what the reference flushes, after the rules changed.
    if let Some(prev) = prev {
        let ids = rules::flushes(prev, Some(gw), alloc);
        if !ids.is_empty() {
            let n = t.flush_conntrack(|k, e| k.zone == zone && (ids.contains(&e.dnat_rule) || ids.contains(&e.snat_rule)))?;
            changes.push(format!("flushed {n} flows of deleted rules"));
        }
    }
    let released = alloc.release_rules(&rules::prefix(&gw.name), &want.keys);
    if released > 0 {
        changes.push(format!("released {released} rule ids"));
    }
    Ok(changes)
}

pub fn remove(engine: &mut Engine, prev: &NatGateway, alloc: &mut Allocations) -> Result<Vec<String>> {
    let mut changes = Vec::new();
    let key = naming::gw_zone_key(&prev.name);
    let Some(zone) = alloc.zones.get(&key).copied() else { return Ok(changes) };
    let ns = naming::gw_netns(&prev.name);
    engine.release(zone, &ns, &[plumb::LAN_IF, plumb::EXT_IF]);
    let t = engine.tables()?;
    for (k, _, _) in t.dnat_rules()?.into_iter().filter(|(k, _, _)| k.zone == zone) {
        t.remove_dnat(&k)?;
    }
    for (len, k, _) in t.snat_rules()?.into_iter().filter(|(_, k, _)| k.zone == zone) {
        t.remove_snat_key(len, k)?;
    }
    let n = t.flush_conntrack(|k, _| k.zone == zone)?;
    changes.push(format!("removed rules, flushed {n} flows"));
    plumb::remove(&prev.name, &mut changes)?;
    alloc.release_rules(&rules::prefix(&prev.name), &Default::default());
    alloc.release_zone(&key);
    changes.push(format!("released zone {zone}"));
    Ok(changes)
}
