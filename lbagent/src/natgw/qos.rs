//! QoS of a gateway (pure): its bound policies → the entries of
//! `dataplane::qos::QosZone`, each rule instance with a bucket id of its own.
//!
//! - An EIP policy's rules limit that EIP: `ingress` on `net1` ingress by
//!   destination (before DNAT), `egress` on `net1` egress by source (after
//!   SNAT). One EIP has one rule per direction on the ladder: its
//!   lowest-priority-number rule (the others could never match first).
//! - A gateway policy's rules limit the gateway on `interface` (default
//!   `net1` for egress, `eth0` for ingress), all traffic or `match: src|dst
//!   CIDR`, sorted by priority on their hook.
//!
//! Buckets come from the QoS bucket allocator under stable keys, so a rate
//! change keeps the bucket; a key no longer used is released.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Result, bail};
use lbagent_common::*;

use super::{
    plumb::{EXT_IF, LAN_IF},
    rules::Ifaces,
};
use crate::{
    alloc::{Allocated, Allocations},
    dataplane::qos::QosZone,
    naming::{self, QosTarget},
    state::spec::{Direction, Gw, GwSide, QosMatch as Match, QosRule},
};

/// A rule instance as status shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Bound {
    pub key: String,
    pub bucket: u32,
    /// `eip/<name>` or `gateway`.
    pub target: String,
    pub policy: String,
    pub rule: String,
    pub direction: Direction,
    pub interface: String,
    pub rate_bps: u64,
    pub burst_bytes: u64,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct GwQos {
    pub zone: QosZone,
    pub keys: BTreeSet<String>,
    pub bound: Vec<Bound>,
}

fn dir(d: Direction) -> u8 {
    match d {
        Direction::Ingress => QOS_INGRESS,
        Direction::Egress => QOS_EGRESS,
    }
}

fn config(r: &QosRule) -> QosConfig {
    qos_config(r.rate_bps, r.burst_bytes)
}

/// The interface a gateway rule acts on.
pub fn interface(r: &QosRule) -> &'static str {
    match r.side {
        GwSide::Lan => LAN_IF,
        GwSide::External => EXT_IF,
    }
}

/// Stand-ins for the gateway's ifindexes where they are not known yet (before
/// plumbing, in status): distinct, so rules of the two sides stay on hooks
/// of their own, as they will on the host.
pub const IFACES_UNKNOWN: Ifaces = Ifaces { lan: 1, ext: 2 };

/// Allocates a bucket for every rule instance of the gateway (before any
/// host change; `natgw::allocate`).
pub fn allocate(gw: &Gw, alloc: &mut Allocations) -> Result<()> {
    let mut exhausted = None;
    build(gw, IFACES_UNKNOWN, &mut |k| {
        alloc.qos_bucket(k).unwrap_or_else(|e| {
            exhausted = Some(e);
            0
        })
    })?;
    exhausted.map_or(Ok(()), |e| bail!("{e}"))
}

/// The gateway's QoS entries with the buckets `allocate` gave them.
pub fn qos(gw: &Gw, ifs: Ifaces, alloc: &Allocations) -> Result<GwQos> {
    let mut ids = Allocated::new(&alloc.qos_buckets);
    let q = build(gw, ifs, &mut |k| ids.get(k))?;
    ids.check()?;
    Ok(q)
}

/// The gateway's bound rules with their bucket ids as allocated (0 when
/// not allocated yet), for status; allocates nothing.
pub fn bound(gw: &Gw, alloc: &Allocations) -> Vec<Bound> {
    build(gw, IFACES_UNKNOWN, &mut |k| alloc.qos_buckets.get(k).copied().unwrap_or(0))
        .map(|q| q.bound)
        .unwrap_or_default()
}

fn build(gw: &Gw, ifs: Ifaces, id: &mut dyn FnMut(&str) -> u32) -> Result<GwQos> {
    let mut out = GwQos::default();
    let mut gw_rules: BTreeMap<(u32, u8), Vec<QosMatch>> = BTreeMap::new();
    for e in &gw.eips {
        let Some(p) = &e.policy else { continue };
        let ip = e.ip;
        for d in [Direction::Ingress, Direction::Egress] {
            let Some(r) = p.rules.iter().filter(|r| r.direction == d).min_by_key(|r| (r.priority, r.name.clone()))
            else {
                continue;
            };
            let k = naming::gw_qos_key(&gw.name, QosTarget::Eip(&e.name), &p.name, &r.name);
            let bucket = id(&k);
            out.zone.eips.insert((ip.octets(), dir(d)), QosEip { bucket, priority: r.priority, flags: 0, _pad0: 0 });
            out.zone.buckets.insert(bucket, config(r));
            out.bound.push(Bound {
                key: k.clone(),
                bucket,
                target: format!("eip/{}", e.name),
                policy: p.name.clone(),
                rule: r.name.clone(),
                direction: d,
                interface: EXT_IF.into(),
                rate_bps: r.rate_bps,
                burst_bytes: r.burst_bytes,
            });
            out.keys.insert(k);
        }
    }
    if let Some(p) = &gw.policy {
        for r in &p.rules {
            let k = naming::gw_qos_key(&gw.name, QosTarget::Gateway, &p.name, &r.name);
            let bucket = id(&k);
            let ifname = interface(r);
            let ifindex = if ifname == LAN_IF { ifs.lan } else { ifs.ext };
            let (kind, (addr, len)) = match r.matches {
                Match::Src(c) => (QOS_MATCH_SRC, c),
                Match::Dst(c) => (QOS_MATCH_DST, c),
                Match::All => (QOS_MATCH_ALL, (std::net::Ipv4Addr::UNSPECIFIED, 0)),
            };
            gw_rules.entry((ifindex, dir(r.direction))).or_default().push(QosMatch {
                bucket,
                priority: r.priority,
                addr: addr.octets(),
                kind,
                prefix_len: len,
                _pad0: 0,
            });
            out.zone.buckets.insert(bucket, config(r));
            out.bound.push(Bound {
                key: k.clone(),
                bucket,
                target: "gateway".into(),
                policy: p.name.clone(),
                rule: r.name.clone(),
                direction: r.direction,
                interface: ifname.into(),
                rate_bps: r.rate_bps,
                burst_bytes: r.burst_bytes,
            });
            out.keys.insert(k);
        }
    }
    for ((ifindex, d), mut rules) in gw_rules {
        rules.sort_by_key(|r| (r.priority, r.bucket));
        if rules.len() > QOS_HOOK_RULES {
            bail!("more than {QOS_HOOK_RULES} gateway QoS rules on one interface and direction");
        }
        let mut hook = QosHook { count: rules.len() as u32, ..Default::default() };
        hook.rules[..rules.len()].copy_from_slice(&rules);
        out.zone.hooks.insert((ifindex, d), hook);
    }
    // EIP rules act on the external interface.
    out.zone.finish(ifs.ext);
    Ok(out)
}

#[cfg(test)]
mod side_tests {
    use super::*;
    use crate::state::{Format, load_str};

    /// A policy with the most rules each side allows (per interface and
    /// direction) allocates and builds: the two sides never share a hook.
    #[test]
    fn full_hooks_on_both_sides_allocate() {
        let s = load_str(include_str!("../../../examples/state.yaml"), Format::Yaml).unwrap();
        let mut gw = (*crate::state::Desired::from_state(&s).unwrap().gws["gw1"]).clone();
        let template = gw.policy.as_ref().and_then(|p| p.rules.first().cloned()).expect("the example's gateway policy");
        let rules = (0..2 * QOS_HOOK_RULES)
            .map(|i| QosRule {
                name: format!("r{i}"),
                direction: Direction::Egress,
                priority: i as u32,
                side: if i % 2 == 0 { GwSide::Lan } else { GwSide::External },
                ..template.clone()
            })
            .collect();
        gw.policy.as_mut().unwrap().rules = rules;
        let mut a = Allocations::default();
        allocate(&gw, &mut a).unwrap();
        assert_eq!(qos(&gw, Ifaces { lan: 7, ext: 8 }, &a).unwrap().zone.hooks.len(), 2);
        assert_eq!(bound(&gw, &a).iter().filter(|b| b.target == "gateway").count(), 2 * QOS_HOOK_RULES);
    }
}
