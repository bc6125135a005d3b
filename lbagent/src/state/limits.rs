//! How much one document may ask of a host: limits per object, and a host
//! budget against the pinned maps that every load balancer and gateway
//! shares (sizes in `lbagent_common`).
//!
//! Every object's rules live in the same maps (`dnat_rules`,
//! `dnat_backends`, `snat_rules`, `acl_rules`, the scheduler and QoS maps),
//! so a document that fills a map makes whichever objects the agent
//! happens to apply last fail. The budget is checked here, at validation:
//! a document whose objects need more than their share is refused, with
//! the path of the first object (in document order) that goes over, and
//! nothing runs. The share is half of each map: while an apply moves
//! objects from the running document to a new one, each object is ensured
//! in turn, so entries of both can be in a map at once; and an object whose
//! removal failed keeps its entries until it is retried.
//!
//! What an object needs is counted as `lb::rules`, `natgw::rules` and
//! `natgw::qos` write it, with every backend up (the most it can need).

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::Ipv4Addr,
};

use lbagent_common as common;

use super::{
    model::{Direction, ListenerMode, LoadBalancer, NatGateway, QosBinding, QosPolicy, Scheduler, StateFile},
    names::parse_cidr,
    problem::Problem,
};

/// Most slots one backend takes in a direct listener's table (the rule
/// builder repeats a backend by its weight, up to this).
pub const MAX_WEIGHT_SLOTS: u32 = 16;

/// Listeners of one load balancer.
pub const MAX_LISTENERS_PER_LB: usize = 256;
/// Backend groups of one load balancer.
pub const MAX_GROUPS_PER_LB: usize = 256;
/// Backends of one group (what one listener balances over).
pub const MAX_BACKENDS_PER_GROUP: usize = 1024;
/// Backends of one load balancer, all groups (each has a mapped port and
/// two rules).
pub const MAX_BACKENDS_PER_LB: usize = 4096;
/// Prefixes of one listener's ACL.
pub const MAX_ACL_CIDRS_PER_LISTENER: usize = 1024;
/// Routes of one gateway.
pub const MAX_ROUTES_PER_GW: usize = 256;
/// EIPs of one gateway (and so FIPs: one per EIP).
pub const MAX_EIPS_PER_GW: usize = 1024;
/// DNAT entries of one gateway.
pub const MAX_DNATS_PER_GW: usize = 4096;
/// SNAT entries of one gateway.
pub const MAX_SNATS_PER_GW: usize = 1024;
/// Rules of one QoS policy (a gateway uses at most 8 per interface and
/// direction; an EIP the first of each direction).
pub const MAX_RULES_PER_QOS_POLICY: usize = 32;

/// Load balancers (enabled) and gateways one document runs: each takes a
/// zone id (65 535) and a network namespace; each load balancer two
/// link-local addresses of 169.254.0.100–169.254.255.254 (about 64 900,
/// so about 32 400 load balancers). Half of the smaller, as for the maps.
pub const MAX_ZONES: u64 = 16_000;

/// The budget line of zones (not a map: namespaces, zone ids, addresses).
const ZONES: &str = "zones";

/// The rule tables hold a million rules, but the agent's own memory grows
/// with the rules of its document (~0.45 KB of RSS a rule, ~0.7 KB at the
/// peak of a document replacing the running one, measured at 100 000 rules:
/// `docs/benchmarks.md`, section 18), and the unit's
/// `MemoryMax` is sized for that: one document keeps at most these many
/// entries of each rule table (the halves of the tables' sizes before map
/// layout 4), until the agent's memory per rule comes down.
pub const AGENT_RULE_BUDGET: u64 = 65_536;

/// Half of `max_entries`, at most `cap`.
const fn half_at_most(max_entries: u32, cap: u64) -> u64 {
    let half = max_entries as u64 / 2;
    if half < cap { half } else { cap }
}

/// What the objects of one host's document may use of each shared map.
pub const HOST_BUDGET: [(&str, u64); 10] = [
    (common::MAP_DNAT_RULES.name, half_at_most(common::MAP_DNAT_RULES.max_entries, AGENT_RULE_BUDGET)),
    // A rule's backends: two a rule on average, as the tables are sized.
    (common::MAP_DNAT_BACKENDS.name, half_at_most(common::MAP_DNAT_BACKENDS.max_entries, 2 * AGENT_RULE_BUDGET)),
    (common::MAP_SNAT_RULES.name, half_at_most(common::MAP_SNAT_RULES.max_entries, AGENT_RULE_BUDGET)),
    (common::MAP_ACL_RULES.name, common::MAP_ACL_RULES.max_entries as u64 / 2),
    (common::MAP_SCHED_TABLES.name, common::MAP_SCHED_TABLES.max_entries as u64 / 2),
    (common::MAP_SCHED_ACTIVE.name, common::MAP_SCHED_ACTIVE.max_entries as u64 / 2),
    // Buckets index `qos_config`, `qos_state` and `qos_stats`; bucket 0 is never used.
    (common::MAP_QOS_CONFIG.name, (common::MAP_QOS_CONFIG.max_entries as u64 - 1) / 2),
    (common::MAP_QOS_HOOKS.name, common::MAP_QOS_HOOKS.max_entries as u64 / 2),
    (common::MAP_QOS_EIPS.name, common::MAP_QOS_EIPS.max_entries as u64 / 2),
    (ZONES, MAX_ZONES),
];

/// The whole size of `map`, as the message says it.
fn map_size(map: &str) -> Option<u64> {
    common::map_info(map).map(|m| u64::from(m.max_entries))
}

/// Entries one object needs, in `HOST_BUDGET` order.
type Need = [u64; HOST_BUDGET.len()];

fn need(entries: &[(&str, u64)]) -> Need {
    let mut n = [0; HOST_BUDGET.len()];
    for (map, v) in entries {
        let i = HOST_BUDGET.iter().position(|(m, _)| m == map).expect("every map has a budget line");
        n[i] += v;
    }
    n
}

/// Per-object limits: each list longer than its limit, with its path.
pub fn object_limits(s: &StateFile) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut over = |path: String, n: usize, max: usize, what: &str, of: &str| {
        if n > max {
            out.push(Problem { path, message: format!("{n} {what}, more than the {max} {of} may have") });
        }
    };
    for (i, lb) in s.load_balancers.iter().enumerate() {
        let p = format!("load_balancers[{i}]");
        over(format!("{p}.listeners"), lb.listeners.len(), MAX_LISTENERS_PER_LB, "listeners", "a load balancer");
        over(
            format!("{p}.backend_groups"),
            lb.backend_groups.len(),
            MAX_GROUPS_PER_LB,
            "backend groups",
            "a load balancer",
        );
        for (j, g) in lb.backend_groups.iter().enumerate() {
            over(
                format!("{p}.backend_groups[{j}].backends"),
                g.backends.len(),
                MAX_BACKENDS_PER_GROUP,
                "backends",
                "a backend group",
            );
        }
        let all: usize = lb.backend_groups.iter().map(|g| g.backends.len()).sum();
        over(format!("{p}.backend_groups"), all, MAX_BACKENDS_PER_LB, "backends in all groups", "a load balancer");
        for (j, l) in lb.listeners.iter().enumerate() {
            if let Some(acl) = &l.acl {
                over(
                    format!("{p}.listeners[{j}].acl.cidrs"),
                    acl.cidrs.len(),
                    MAX_ACL_CIDRS_PER_LISTENER,
                    "prefixes",
                    "a listener's ACL",
                );
            }
        }
    }
    for (i, gw) in s.nat_gateways.iter().enumerate() {
        let p = format!("nat_gateways[{i}]");
        over(format!("{p}.routes"), gw.routes.len(), MAX_ROUTES_PER_GW, "routes", "a gateway");
        over(format!("{p}.eips"), gw.eips.len(), MAX_EIPS_PER_GW, "EIPs", "a gateway");
        over(format!("{p}.fips"), gw.fips.len(), MAX_EIPS_PER_GW, "FIPs", "a gateway");
        over(format!("{p}.dnats"), gw.dnats.len(), MAX_DNATS_PER_GW, "DNAT entries", "a gateway");
        over(format!("{p}.snats"), gw.snats.len(), MAX_SNATS_PER_GW, "SNAT entries", "a gateway");
    }
    for (i, q) in s.qos_policies.iter().enumerate() {
        over(format!("qos_policies[{i}].rules"), q.rules.len(), MAX_RULES_PER_QOS_POLICY, "rules", "a QoS policy");
    }
    out
}

/// Backends of group `id`: those with a weight (what a scheduler's table
/// holds), and their slots without a scheduler (one per unit of weight, at
/// most [`MAX_WEIGHT_SLOTS`] each).
fn weighted(lb: &LoadBalancer, id: &str) -> (u64, u64) {
    let Some(g) = lb.backend_groups.iter().find(|g| g.id == id) else { return (0, 0) };
    let weighted = g.backends.iter().filter(|b| b.weight > 0).count() as u64;
    let slots = g.backends.iter().map(|b| b.weight.min(MAX_WEIGHT_SLOTS) as u64).sum();
    (weighted, slots)
}

/// What an enabled load balancer writes into the shared maps.
fn lb_need(lb: &LoadBalancer) -> Need {
    let backends: u64 = lb.backend_groups.iter().map(|g| g.backends.len() as u64).sum();
    // One rule per listener; each backend's mapped port has a rule (and a
    // backend entry) per protocol.
    let (mut targets, mut acl, mut tables, mut active) = (2 * backends, 0, 0, 0);
    for l in &lb.listeners {
        let (with_weight, slots) = weighted(lb, &l.backend_group);
        match (l.effective_mode(), l.scheduler) {
            (ListenerMode::Proxy, _) => targets += 1,
            (ListenerMode::Direct, None) => targets += slots,
            (ListenerMode::Direct, Some(Scheduler::Wlc)) => {
                targets += with_weight;
                active += with_weight;
            }
            (ListenerMode::Direct, Some(_)) => {
                targets += with_weight;
                tables += u64::from(with_weight > 0);
            }
        }
        if let Some(a) = &l.acl {
            let prefixes: HashSet<(Ipv4Addr, u8)> = a.cidrs.iter().filter_map(|c| parse_cidr(c).ok()).collect();
            acl += prefixes.len() as u64;
        }
    }
    need(&[
        (common::MAP_DNAT_RULES.name, lb.listeners.len() as u64 + 2 * backends),
        (common::MAP_DNAT_BACKENDS.name, targets),
        (common::MAP_ACL_RULES.name, acl),
        (common::MAP_SCHED_TABLES.name, tables),
        (common::MAP_SCHED_ACTIVE.name, active),
        (ZONES, 1),
    ])
}

/// What a gateway writes into the shared maps.
fn gw_need(gw: &NatGateway, policies: &BTreeMap<&str, &QosPolicy>) -> Need {
    let fips = gw.fips.len() as u64;
    let fip_targets: HashSet<&str> = gw.fips.iter().map(|f| f.internal_ip.as_str()).collect();
    // DNAT identities (EIP, protocol, external port), each with its distinct targets.
    type Identity<'a> = (&'a str, crate::proto::Protocol, u32);
    let mut identities: BTreeMap<Identity, BTreeSet<(&str, u32)>> = BTreeMap::new();
    for d in &gw.dnats {
        identities
            .entry((d.eip.as_str(), d.protocol, d.external_port))
            .or_default()
            .insert((&d.internal_ip, d.internal_port));
    }
    let targets: u64 = identities.values().map(|t| t.len() as u64).sum();
    // A SNAT of a FIP's own address is the FIP's SNAT.
    let snats: HashSet<(Ipv4Addr, u8)> = gw
        .snats
        .iter()
        .filter_map(|s| parse_cidr(&s.internal_cidr).ok())
        .filter(|(a, len)| !(*len == 32 && fip_targets.contains(a.to_string().as_str())))
        .collect();
    let (mut buckets, mut eip_entries, mut hooks) = (0, 0, 0);
    for e in &gw.eips {
        let Some(p) = e.qos_policy.as_deref().and_then(|n| policies.get(n)) else { continue };
        if p.binding != QosBinding::Eip {
            continue;
        }
        // The first rule of each direction that has one.
        for d in [Direction::Ingress, Direction::Egress] {
            let n = u64::from(p.rules.iter().any(|r| r.direction == d));
            buckets += n;
            eip_entries += n;
        }
    }
    if let Some(p) = gw.qos_policy.as_deref().and_then(|n| policies.get(n))
        && p.binding == QosBinding::Natgw
    {
        buckets += p.rules.len() as u64;
        let on: HashSet<(bool, Direction)> = p
            .rules
            .iter()
            .map(|r| {
                let lan = match r.interface.as_deref() {
                    Some(i) => i == crate::naming::GW_LAN_IF,
                    None => r.direction == Direction::Ingress,
                };
                (lan, r.direction)
            })
            .collect();
        hooks += on.len() as u64;
    }
    need(&[
        (common::MAP_DNAT_RULES.name, fips + identities.len() as u64),
        (common::MAP_DNAT_BACKENDS.name, fips + targets),
        (common::MAP_SNAT_RULES.name, fips + snats.len() as u64),
        (common::MAP_QOS_CONFIG.name, buckets),
        (common::MAP_QOS_HOOKS.name, hooks),
        (common::MAP_QOS_EIPS.name, eip_entries),
        (ZONES, 1),
    ])
}

/// The host budget: for each map, the first object (load balancers, then
/// gateways, in document order) with which the document needs more than
/// `HOST_BUDGET` allows.
pub fn host_budget(s: &StateFile) -> Vec<Problem> {
    let policies: BTreeMap<&str, &QosPolicy> = s.qos_policies.iter().map(|q| (q.name.as_str(), q)).collect();
    let objects = s
        .load_balancers
        .iter()
        .enumerate()
        .filter(|(_, lb)| lb.enabled)
        .map(|(i, lb)| (format!("load_balancers[{i}]"), "load balancer", lb_need(lb)))
        .chain(
            s.nat_gateways
                .iter()
                .enumerate()
                .map(|(i, gw)| (format!("nat_gateways[{i}]"), "gateway", gw_need(gw, &policies))),
        );
    let mut used = [0u64; HOST_BUDGET.len()];
    let mut reported = [false; HOST_BUDGET.len()];
    let mut out = Vec::new();
    for (path, what, need) in objects {
        for (k, (map, budget)) in HOST_BUDGET.iter().enumerate() {
            let before = used[k];
            used[k] += need[k];
            if used[k] > *budget && !reported[k] {
                reported[k] = true;
                let (unit, why) = match map_size(map) {
                    Some(size) if *budget < size / 2 => (
                        format!("{map} entries"),
                        format!(
                            "the map holds {size}, but the agent's memory grows with each rule of its document \
                             (about 0.45 KB a rule, 0.7 KB while a document replaces the running one), and its unit is sized for this many"
                        ),
                    ),
                    Some(size) => (
                        format!("{map} entries"),
                        format!("half of the map's {size}: the running document and the one replacing it fit together"),
                    ),
                    None => ("zones".to_string(), "load balancers and gateways together".to_string()),
                };
                out.push(Problem {
                    path: path.clone(),
                    message: format!(
                        "this {what} needs {} {unit}; with the {before} of the objects before it the document \
                         needs {}, more than the {budget} one host's document may use ({why})",
                        need[k], used[k],
                    ),
                });
            }
        }
    }
    out
}
