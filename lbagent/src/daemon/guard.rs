//! The mass-removal guard: a document that removes more than a share of
//! the running objects at once is refused, unless it says
//! `allow_mass_removal: true` (as `lbagent fleet drain` writes). A state
//! file cut short by a writer that stalled, or read on a SIGHUP in the
//! middle of a write, is often still a valid document, only shorter: the
//! guard keeps it from tearing the host down.
//!
//! Objects are load balancers, their listeners and backends, NAT gateways
//! and their EIPs, FIPs, DNATs and SNATs, each known by its identity: a
//! changed field is not a removal. A backend is known by its load balancer
//! and id (moved to another or a renamed group, it is updated in place); a
//! DNAT by its EIP, protocol and port, each further member of a shared one
//! by its position (re-pointed to another internal address, it is updated
//! in place; a share that loses a member loses an object).

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use crate::{
    naming,
    reconcile::applied::Applied,
    state::{
        Desired,
        spec::{Gw, Lb},
    },
};

/// The default `--max-removal`: more than half of the objects.
pub const DEFAULT_MAX_REMOVAL_PERCENT: u8 = 50;

/// The identities of a load balancer and of everything in it.
fn lb_objects(lb: &Lb) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for l in &lb.listeners {
        out.insert(naming::lb_listener_key(&lb.id, &l.id));
    }
    for (_, b) in lb.backends() {
        out.insert(naming::lb_backend(&lb.id, &b.id));
    }
    out.insert(naming::lb_zone_key(&lb.id));
    out
}

/// The identities of a NAT gateway and of everything in it.
fn gw_objects(gw: &Gw) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let zone = naming::gw_zone_key(&gw.name);
    for e in &gw.eips {
        out.insert(format!("{zone}/eip/{}", e.ip));
    }
    for f in &gw.fips {
        out.insert(naming::gw_fip_key(&gw.name, f.eip.ip));
    }
    let mut members: BTreeMap<String, usize> = BTreeMap::new();
    for n in &gw.dnats {
        let key = naming::gw_dnat_key(&gw.name, n.eip.ip, n.protocol, n.external_port);
        let seen = members.entry(key.clone()).or_default();
        out.insert(if *seen == 0 { key } else { format!("{key}#{seen}") });
        *seen += 1;
    }
    for s in &gw.snats {
        out.insert(naming::gw_snat_key(&gw.name, s.internal_cidr));
    }
    out.insert(zone);
    out
}

/// What a document removes of the running objects, counted one running
/// object at a time (the identities of every rule at once were ~20 MB at
/// 100 000 rules, on top of the parse).
#[derive(Default)]
struct Removal {
    running: usize,
    removed: usize,
    /// The first few removed, by name.
    first: Vec<String>,
}

impl Removal {
    const NAMED: usize = 5;

    /// One running object's identities, and the next document's for the
    /// same object (`None`: it is gone).
    fn count(&mut self, before: BTreeSet<String>, after: Option<BTreeSet<String>>) {
        self.running += before.len();
        for id in before {
            if after.as_ref().is_some_and(|a| a.contains(&id)) {
                continue;
            }
            self.removed += 1;
            if self.first.len() < Self::NAMED {
                self.first.push(id);
            }
        }
    }
}

/// `Some(reason)` when going from what runs (`applied`: also right after a
/// restart) to `next` removes more than `max_percent` of the running
/// objects and `next` does not allow it.
pub fn refuse(running: &Applied, next: &Desired, allowed: bool, max_percent: u8) -> Option<String> {
    if allowed || max_percent >= 100 {
        return None;
    }
    let mut r = Removal::default();
    for (key, lb) in &running.lbs {
        match next.lbs.get(key) {
            // The same spec (shared): nothing of it goes.
            Some(n) if Arc::ptr_eq(n, lb) => r.running += lb_objects(lb).len(),
            n => r.count(lb_objects(lb), n.map(|n| lb_objects(n))),
        }
    }
    for (key, gw) in &running.gws {
        match next.gws.get(key) {
            Some(n) if Arc::ptr_eq(n, gw) => r.running += gw_objects(gw).len(),
            n => r.count(gw_objects(gw), n.map(|n| gw_objects(n))),
        }
    }
    if r.removed == 0 || r.removed * 100 <= r.running * max_percent as usize {
        return None;
    }
    Some(format!(
        "the document removes {} of the {} running objects (more than {max_percent} %: {}{}); refused as a likely \
         torn or truncated document. Set `allow_mass_removal: true` in it (or use `lbagent fleet drain`) if this \
         is meant, or raise `--max-removal`",
        r.removed,
        r.running,
        r.first.join(", "),
        if r.removed > r.first.len() { ", …" } else { "" }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Format, accept_str};

    fn running(d: &Desired) -> Applied {
        Applied { lbs: d.lbs.clone(), gws: d.gws.clone(), ..Default::default() }
    }

    fn desired(gws: &[&str]) -> Desired {
        let mut doc = String::from("version: 1\nnat_gateways:\n");
        for (i, g) in gws.iter().enumerate() {
            doc += &format!(
                "  - name: {g}\n    lan: {{ip: 10.{i}.0.254, prefix_len: 24, mac: \"02:00:0a:0a:00:{i:02x}\", gateway: 10.{i}.0.1}}\n    external: {{bridge: br-ext, prefix_len: 24, gateway: 203.0.{i}.1}}\n    eips: [{{name: e{i}, ip: 203.0.{i}.10}}]\n"
            );
        }
        accept_str(&doc, Format::Yaml).map_err(|p| format!("{p:?}")).unwrap().desired
    }

    #[test]
    fn most_objects_removed_at_once_is_refused_unless_allowed() {
        let four_running = running(&desired(&["g0", "g1", "g2", "g3"]));
        let four = desired(&["g0", "g1", "g2", "g3"]);
        let empty = desired(&[]);
        let why = refuse(&four_running, &empty, false, 50).expect("everything removed");
        assert!(why.contains("removes 8 of the 8") && why.contains("natgw/g0"), "{why}");
        assert!(refuse(&four_running, &empty, true, 50).is_none(), "explicitly allowed");
        assert!(refuse(&four_running, &empty, false, 100).is_none(), "guard off");
        // Half removed is not more than half.
        assert!(refuse(&four_running, &desired(&["g0", "g1"]), false, 50).is_none());
        assert!(refuse(&four_running, &desired(&["g0"]), false, 50).is_some());
        // Adding and keeping are never refused.
        assert!(refuse(&running(&empty), &four, false, 50).is_none());
        assert!(refuse(&four_running, &four, false, 0).is_none());
    }

    fn gateway(dnats: &[(&str, u16)]) -> Desired {
        let dnats: String = dnats
            .iter()
            .map(|(ip, port)| {
                format!(
                    "      - {{eip: e0, protocol: tcp, external_port: {port}, internal_ip: {ip}, internal_port: 22, mode: share}}\n"
                )
            })
            .collect();
        let doc = format!(
            "version: 1\nnat_gateways:\n  - name: g0\n    lan: {{ip: 10.0.0.254, prefix_len: 24, mac: \"02:00:0a:0a:00:01\", gateway: 10.0.0.1}}\n    external: {{bridge: br-ext, prefix_len: 24, gateway: 203.0.0.1}}\n    eips: [{{name: e0, ip: 203.0.0.10}}]\n    dnats:\n{dnats}"
        );
        accept_str(&doc, Format::Yaml).map_err(|p| format!("{p:?}")).unwrap().desired
    }

    #[test]
    fn a_dnat_pointed_elsewhere_is_no_removal() {
        let before = running(&gateway(&[("10.0.0.21", 2222), ("10.0.0.22", 2223)]));
        // Both re-pointed: updated in place, nothing removed (guard at 0 %).
        assert!(refuse(&before, &gateway(&[("10.0.0.31", 2222), ("10.0.0.32", 2223)]), false, 0).is_none());
        // One gone: removed.
        let why = refuse(&before, &gateway(&[("10.0.0.21", 2222)]), false, 0).expect("a DNAT removed");
        assert!(why.contains("removes 1 of the 4") && why.contains("dnat/203.0.0.10/tcp/2223"), "{why}");
        // A shared DNAT: a member re-pointed is kept, a member dropped is removed.
        let shared = running(&gateway(&[("10.0.0.21", 80), ("10.0.0.22", 80)]));
        assert!(refuse(&shared, &gateway(&[("10.0.0.21", 80), ("10.0.0.23", 80)]), false, 0).is_none());
        assert!(refuse(&shared, &gateway(&[("10.0.0.21", 80)]), false, 0).is_some());
    }

    fn balancer(group: &str, backends: &[&str]) -> Desired {
        let backends: Vec<String> = backends
            .iter()
            .enumerate()
            .map(|(i, b)| format!("{{id: {b}, address: 10.1.0.{}, port: 80}}", i + 20))
            .collect();
        let doc = format!(
            "version: 1\nagent: {{integration_bridge: br-int}}\nload_balancers:\n  - id: lb-guard-test1\n    network: {{ip: 10.1.0.5, mac: \"02:00:0a:01:00:05\", prefix_len: 24, gateway: 10.1.0.1}}\n    listeners: [{{id: l1, type: tcp, port: 80, backend_group: {group}}}]\n    backend_groups: [{{id: {group}, backends: [{}]}}]\n",
            backends.join(", ")
        );
        accept_str(&doc, Format::Yaml).map_err(|p| format!("{p:?}")).unwrap().desired
    }

    #[test]
    fn a_backend_in_a_renamed_group_is_no_removal() {
        let before = running(&balancer("g", &["b1", "b2"]));
        assert!(refuse(&before, &balancer("g2", &["b1", "b2"]), false, 0).is_none());
        let why = refuse(&before, &balancer("g2", &["b1"]), false, 0).expect("a backend removed");
        assert!(why.contains("removes 1 of the 4") && why.contains("lb/lb-guard-test1/backend/b2"), "{why}");
    }
}
