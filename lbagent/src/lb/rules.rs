//! From a load balancer spec to engine rules (pure). The reference's iptables
//! rules, one for one:
//!
//! | reference (in `lb-<id>`)                                         | engine |
//! |-------------------------------------------------------------|--------|
//! | `-i o…0 -d VIP --dport L -j DNAT --to outer:L` (+ `-o h…0 SNAT inner`) | `dnat {VIP, L}` → `outer:L`, rule SNAT on `o…0` to `inner` |
//! | `-i h…0 -d inner --dport M -j DNAT --to addr:port` (+ `-o o…0 SNAT VIP`) | `dnat {inner, M}` (tcp and udp) → `addr:port`, rule SNAT on `h…0` to the VIP |
//!
//! Direct-mode listeners skip the proxy: `dnat {VIP, L}` → the group's
//! backends, picked by the listener's scheduler (`lb::sched`), SNAT to the
//! VIP so the backend sees the VIP and replies come back through us.

use std::{collections::BTreeSet, net::Ipv4Addr};

use crate::{
    alloc::LbAlloc,
    dataplane::tables::{AclSpec, DnatSpec, RuleSnat, SchedKind, SchedSpec},
    lb::sched,
    naming,
    state::spec::{Acl, Backend, Lb, Listener, ListenerMode, Protocol, Scheduler},
};

pub use crate::state::limits::MAX_WEIGHT_SLOTS;

#[derive(Clone, Copy, Debug)]
pub struct LbIfaces {
    /// `o…0`, toward the VPC.
    pub ovn: u32,
    /// `h…0`, toward the host and its proxy.
    pub proxy: u32,
}

/// A listener's ACL as the engine takes it.
fn acl(a: &Acl) -> AclSpec {
    AclSpec { allow: a.allow, cidrs: a.cidrs.clone() }
}

/// A direct listener's backends (those up) and its scheduler: `sch`/`tch`
/// a consistent table, `rr`/`wrr` a round-robin sequence, `wlc` the
/// weights (each backend once in `backends`; the scheduler does the
/// weighting); without a scheduler new flows hash over the backends, each
/// repeated by its weight (at most `MAX_WEIGHT_SLOTS`).
fn direct_backends(l: &Listener, up: &dyn Fn(&str, &str) -> bool) -> (Vec<(Ipv4Addr, u16)>, Option<SchedSpec>) {
    let live: Vec<&Backend> = l.group.backends.iter().filter(|b| up(&l.id, &b.id)).collect();
    let kind = match l.scheduler {
        Some(Scheduler::Sch) => Some(SchedKind::Source),
        Some(Scheduler::Tch) => Some(SchedKind::Tuple),
        Some(Scheduler::Rr | Scheduler::Wrr) => Some(SchedKind::Turn),
        Some(Scheduler::Wlc) => Some(SchedKind::Least),
        None => None,
    };
    let Some(kind) = kind else {
        let slots = |b: &Backend| b.weight.min(MAX_WEIGHT_SLOTS) as usize;
        return (live.iter().flat_map(|b| std::iter::repeat_n((b.addr, b.port), slots(b))).collect(), None);
    };
    let weight = |b: &Backend| if l.scheduler == Some(Scheduler::Rr) { b.weight.min(1) } else { b.weight };
    let members: Vec<sched::Member> =
        live.iter().map(|b| sched::Member { id: &b.id, target: (b.addr, b.port), weight: weight(b) }).collect();
    let live: Vec<&sched::Member> = members.iter().filter(|m| m.weight > 0).collect();
    let backends: Vec<(Ipv4Addr, u16)> = live.iter().map(|m| m.target).collect();
    if live.is_empty() {
        return (backends, None);
    }
    let sched = match kind {
        SchedKind::Least => {
            SchedSpec { kind, table: Default::default(), weights: live.iter().map(|m| m.weight).collect() }
        }
        SchedKind::Turn => {
            SchedSpec { kind, table: std::sync::Arc::new(sched::round_robin(&members)), weights: vec![] }
        }
        SchedKind::Source | SchedKind::Tuple => {
            SchedSpec { kind, table: std::sync::Arc::new(sched::consistent(&members)), weights: vec![] }
        }
    };
    (backends, Some(sched))
}

/// `up(listener, backend)` says whether a direct listener's backend passes
/// its health check (backends that are down get no new flows); `ids` gives
/// each rule key its id (allocating in `lb::allocate`, looking up in
/// `lb::ensure`).
pub fn rules(
    lb: &Lb,
    a: &LbAlloc,
    zone: u16,
    ifs: LbIfaces,
    up: &dyn Fn(&str, &str) -> bool,
    ids: &mut dyn FnMut(&str) -> u32,
) -> (Vec<DnatSpec>, BTreeSet<String>) {
    let mut out = Vec::new();
    let mut keys = BTreeSet::new();
    let vip = lb.network.ip;
    let mut id = |key: String| {
        let id = ids(&key);
        keys.insert(key);
        id
    };
    for l in &lb.listeners {
        let proto = l.protocol().number();
        let rule_id = id(naming::lb_listener_key(&lb.id, &l.id));
        let (backends, snat_to, sched) = match l.mode {
            ListenerMode::Proxy => (vec![(a.outer, l.port)], a.inner, None),
            ListenerMode::Direct => {
                let (backends, sched) = direct_backends(l, up);
                (backends, vip, sched)
            }
        };
        out.push(DnatSpec {
            zone,
            addr: vip,
            proto,
            port: l.port,
            rule_id,
            backends,
            snat: Some(RuleSnat { ifindex: ifs.ovn, to: Some(snat_to), random: false }),
            acl: l.acl.as_ref().map(acl),
            sched,
        });
    }
    for (_, b) in lb.backends() {
        // Every backend has its port once `alloc.lb_ports` ran (`lb::allocate`).
        if let Some(port) = a.ports.get(&b.id) {
            for p in Protocol::ALL {
                let (proto, rule_id) = (p.number(), id(naming::lb_backend_key(&lb.id, &b.id, p)));
                out.push(DnatSpec {
                    zone,
                    addr: a.inner,
                    proto,
                    port: *port,
                    rule_id,
                    backends: vec![(b.addr, b.port)],
                    snat: Some(RuleSnat { ifindex: ifs.proxy, to: Some(vip), random: false }),
                    acl: None,
                    sched: None,
                });
            }
        }
    }
    (out, keys)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        alloc::Allocations,
        state::{Format, load_str},
    };

    #[test]
    fn reference_rules_and_direct_listeners() {
        let s = load_str(include_str!("../../../examples/state.yaml"), Format::Yaml).unwrap();
        let d = crate::state::Desired::from_state(&s).unwrap();
        let lb = d.lbs.values().next().unwrap();
        let mut a = Allocations::default();
        a.lb_addresses(&lb.id, &Default::default()).unwrap();
        a.lb_ports(&lb.id, &["b1", "b2", "d1"]).unwrap();
        let la = a.lbs[&lb.id].clone();
        let (r, keys) = rules(lb, &la, 9, LbIfaces { ovn: 2, proxy: 3 }, &|_, _| true, &mut |k| a.rule_id(k));
        // 4 listeners + 3 backends × 2 protocols.
        assert_eq!(r.len(), 10);
        assert_eq!(keys.len(), 10);
        let http = r.iter().find(|d| d.port == 80).unwrap();
        assert_eq!(http.backends, vec![(la.outer, 80)]);
        assert_eq!(http.snat, Some(RuleSnat { ifindex: 2, to: Some(la.inner), random: false }));
        let direct = r.iter().find(|d| d.port == 5000).unwrap();
        assert_eq!(direct.backends.len(), 2, "wrr: each backend once, the table weights them");
        let sched = direct.sched.as_ref().expect("wrr has a round-robin table");
        assert_eq!(sched.kind, SchedKind::Turn);
        let b2 = sched.table.iter().filter(|t| **t == direct.backends[1]).count();
        assert_eq!(b2 * 3 / sched.table.len(), 2, "b2 (weight 2) has two thirds of the turns");
        let dns = r.iter().find(|d| d.port == 53).unwrap();
        assert_eq!(dns.sched.as_ref().map(|s| s.kind), Some(SchedKind::Source), "sch: Maglev by source");
        assert_eq!(direct.snat.unwrap().to, Some(std::net::Ipv4Addr::new(10, 10, 0, 5)));
        let (down, _) = rules(lb, &la, 9, LbIfaces { ovn: 2, proxy: 3 }, &|_, b| b != "b2", &mut |k| a.rule_id(k));
        let direct = down.iter().find(|d| d.port == 5000).unwrap();
        assert_eq!(direct.backends.len(), 1, "b2 is down: only b1 left");
        assert!(
            direct.sched.as_ref().unwrap().table.iter().all(|t| *t == direct.backends[0]),
            "and only b1 in the table"
        );
        let mapped = r.iter().filter(|d| d.addr == la.inner).count();
        assert_eq!(mapped, 6);
        assert!(r.iter().filter(|d| d.addr == la.inner).all(|d| d.snat.unwrap().ifindex == 3));
    }
}
