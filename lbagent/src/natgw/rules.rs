//! From a gateway spec to engine rules (pure), and which flows a change must
//! flush:
//! - FIP: address-wide DNAT `eip → internal` + SNAT `internal/32 → eip`
//!   keeping ports; hairpin on the LAN interface;
//! - DNAT: exact `(eip, proto, port)`, several backends when `share`;
//! - SNAT: longest prefix for flows leaving by the external interface (the
//!   engine keys SNAT on the egress interface, like `-o net1`), random ports
//!   ("random-fully"); hairpin, VPC routes and the gateway's own addresses
//!   are never CIDR-SNAT'ed;
//!   a FIP's /32 wins over a SNAT of the same single address;
//! - deleting a FIP flushes its flows; deleting a DNAT identity (or replacing
//!   an exclusive target) flushes that identity's flows; deleting a SNAT (or
//!   moving it to another EIP) flushes its flows, which would otherwise keep
//!   sending from the old address; removing one share backend flushes its
//!   UDP flows only (`dataplane::sync`), TCP flows drain.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use crate::{
    alloc::Allocations,
    dataplane::tables::{DnatSpec, RuleSnat, SnatSpec},
    naming,
    state::spec::{Cidr, DnatMode, Gw, Protocol},
};

/// SNAT port range for CIDR SNAT (no range asked for, as the reference's
/// `-j SNAT --to-source <eip>`: privileged ports keep their class).
pub const SNAT_PORTS: (u16, u16) = (1024, 65535);

#[derive(Clone, Copy, Debug)]
pub struct Ifaces {
    pub lan: u32,
    pub ext: u32,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct GwRules {
    pub dnats: Vec<DnatSpec>,
    pub snats: Vec<SnatSpec>,
    /// Rule-id keys in use (the rest of this gateway's ids can be released).
    pub keys: BTreeSet<String>,
}

/// CIDR SNATs as internal CIDR → EIP address.
fn snats(gw: &Gw) -> BTreeMap<Cidr, Ipv4Addr> {
    gw.snats.iter().map(|s| (s.internal_cidr, s.eip.ip)).collect()
}

/// FIPs as (eip address, internal address).
fn fips(gw: &Gw) -> Vec<(Ipv4Addr, Ipv4Addr)> {
    gw.fips.iter().map(|f| (f.eip.ip, f.internal_ip)).collect()
}

/// A DNAT identity: (EIP address, protocol, external port).
type Identity = (Ipv4Addr, Protocol, u16);

/// DNAT identities with their backends (sorted: stable indexes) and mode.
fn identities(gw: &Gw) -> BTreeMap<Identity, (Vec<(Ipv4Addr, u16)>, DnatMode)> {
    let mut out: BTreeMap<_, (Vec<_>, DnatMode)> = BTreeMap::new();
    for d in &gw.dnats {
        let e = out.entry((d.eip.ip, d.protocol, d.external_port)).or_default();
        e.0.push((d.internal_ip, d.internal_port));
        e.1 = d.mode;
    }
    for (b, _) in out.values_mut() {
        b.sort();
        b.dedup();
    }
    out
}

/// `ids` gives each rule key its id (allocating in `natgw::allocate`,
/// looking up in `natgw::ensure`).
pub fn rules(gw: &Gw, zone: u16, ifs: Ifaces, ids: &mut dyn FnMut(&str) -> u32) -> GwRules {
    let mut r = GwRules::default();
    let mut id = |key: String, r: &mut GwRules| {
        let id = ids(&key);
        r.keys.insert(key);
        id
    };
    let fips = fips(gw);
    for (eip, internal) in &fips {
        let rule_id = id(naming::gw_fip_key(&gw.name, *eip), &mut r);
        r.dnats.push(DnatSpec {
            zone,
            addr: *eip,
            proto: 0,
            port: 0,
            rule_id,
            backends: vec![(*internal, 0)],
            snat: Some(RuleSnat::hairpin(ifs.lan)),
            acl: None,
            sched: None,
        });
        let rule_id = id(naming::gw_fip_snat_key(&gw.name, *internal), &mut r);
        r.snats.push(SnatSpec {
            zone,
            ifindex: ifs.ext,
            cidr: (*internal, 32),
            to: *eip,
            ports: (1, 65535),
            random: false,
            port_class: false,
            rule_id,
        });
    }
    for ((eip, p, port), (backends, _)) in identities(gw) {
        let rule_id = id(naming::gw_dnat_key(&gw.name, eip, p, port), &mut r);
        r.dnats.push(DnatSpec {
            zone,
            addr: eip,
            proto: p.number(),
            port,
            rule_id,
            backends,
            snat: Some(RuleSnat::hairpin(ifs.lan)),
            acl: None,
            sched: None,
        });
    }
    for (cidr, eip) in snats(gw) {
        if cidr.1 == 32 && fips.iter().any(|(_, i)| *i == cidr.0) {
            continue; // the FIP's own SNAT wins
        }
        let rule_id = id(naming::gw_snat_key(&gw.name, cidr), &mut r);
        r.snats.push(SnatSpec {
            zone,
            ifindex: ifs.ext,
            cidr,
            to: eip,
            ports: SNAT_PORTS,
            random: true,
            port_class: true,
            rule_id,
        });
    }
    r
}

/// Rule ids whose flows must be flushed when `prev` becomes `next`.
pub fn flushes(prev: &Gw, next: Option<&Gw>, alloc: &Allocations) -> BTreeSet<u32> {
    let id = |k: String| alloc.rule_ids.get(k.as_str());
    let mut out = BTreeSet::new();
    let next_fips = next.map(fips).unwrap_or_default();
    for (eip, internal) in fips(prev) {
        if !next_fips.contains(&(eip, internal)) {
            out.extend(id(naming::gw_fip_key(&prev.name, eip)));
            out.extend(id(naming::gw_fip_snat_key(&prev.name, internal)));
        }
    }
    let next_ids = next.map(identities).unwrap_or_default();
    for (ident, (backends, _)) in identities(prev) {
        let gone = match next_ids.get(&ident) {
            None => true,
            Some((nb, DnatMode::Exclusive)) => !nb.iter().any(|b| backends.contains(b)),
            Some(_) => false,
        };
        if gone {
            out.extend(id(naming::gw_dnat_key(&prev.name, ident.0, ident.1, ident.2)));
        }
    }
    let next_snats = next.map(snats).unwrap_or_default();
    for (cidr, eip) in snats(prev) {
        if next_snats.get(&cidr) != Some(&eip) {
            out.extend(id(naming::gw_snat_key(&prev.name, cidr)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Format, load_str, spec::EipRef};

    fn gw() -> Gw {
        let s = load_str(include_str!("../../../examples/state.yaml"), Format::Yaml).unwrap();
        (*crate::state::Desired::from_state(&s).unwrap().gws["gw1"]).clone()
    }

    const IFS: Ifaces = Ifaces { lan: 2, ext: 3 };

    #[test]
    fn rules_of_the_example() {
        let mut a = Allocations::default();
        let r = rules(&gw(), 5, IFS, &mut |k| a.rule_id(k));
        // FIP eip1 (address-wide) + two identities (eip2 tcp/2222, eip3 tcp/80 shared by two backends).
        assert_eq!(r.dnats.len(), 3);
        let fip = r.dnats.iter().find(|d| d.proto == 0).unwrap();
        assert_eq!((fip.addr.to_string(), fip.port, fip.snat), ("198.51.100.10".into(), 0, Some(RuleSnat::hairpin(2))));
        let share = r.dnats.iter().find(|d| d.addr == Ipv4Addr::new(198, 51, 100, 12)).unwrap();
        assert_eq!(share.backends.len(), 2);
        // FIP SNAT (/32, keep ports) + CIDR SNAT (random).
        assert_eq!(r.snats.len(), 2);
        assert!(r.snats.iter().any(|s| s.cidr.1 == 32 && !s.random && s.to == Ipv4Addr::new(198, 51, 100, 10)));
        assert!(r.snats.iter().any(|s| s.cidr.1 == 24 && s.random && s.ifindex == 3), "keyed on net1");
        // Stable ids on repeat.
        assert_eq!(rules(&gw(), 5, IFS, &mut |k| a.rule_id(k)), r);
    }

    #[test]
    fn flush_rules_follow_the_reference() {
        let mut a = Allocations::default();
        let prev = gw();
        rules(&prev, 5, IFS, &mut |k| a.rule_id(k));
        let fip_id = a.rule_ids[&*naming::gw_fip_key("gw1", Ipv4Addr::new(198, 51, 100, 10))];
        let ssh_id = a.rule_ids[&*naming::gw_dnat_key("gw1", Ipv4Addr::new(198, 51, 100, 11), Protocol::Tcp, 2222)];
        let snat_id = a.rule_ids[&*naming::gw_snat_key("gw1", (Ipv4Addr::new(10, 10, 0, 0), 24))];
        // Deleting a FIP flushes it; deleting a SNAT flushes it (its flows
        // would keep sending from the EIP); a share backend flushes nothing here.
        let mut next = prev.clone();
        next.fips.clear();
        next.snats.clear();
        next.dnats.pop();
        let f = flushes(&prev, Some(&next), &a);
        assert!(f.contains(&fip_id));
        assert!(f.contains(&snat_id));
        assert!(!f.contains(&ssh_id));
        assert_eq!(f.len(), 3, "fip dnat + fip snat + snat: {f:?}");
        // Moving a SNAT to another EIP flushes it too.
        let mut next = prev.clone();
        next.snats[0].eip =
            next.eips.iter().find(|e| e.name == "eip1").map(|e| EipRef { name: e.name.clone(), ip: e.ip }).unwrap();
        assert!(flushes(&prev, Some(&next), &a).contains(&snat_id));
        // Deleting a DNAT identity flushes it; so does replacing an exclusive target.
        let mut next = prev.clone();
        next.dnats[0].internal_ip = Ipv4Addr::new(10, 10, 0, 99);
        assert!(flushes(&prev, Some(&next), &a).contains(&ssh_id));
        next.dnats.remove(0);
        assert!(flushes(&prev, Some(&next), &a).contains(&ssh_id));
        // Removing the gateway flushes every FIP, identity and SNAT.
        assert_eq!(flushes(&prev, None, &a).len(), 5);
    }

    #[test]
    fn fip_snat_beats_a_bare_ip_snat() {
        let mut g = gw();
        let eip2 = g.eips.iter().find(|e| e.name == "eip2").map(|e| EipRef { name: e.name.clone(), ip: e.ip }).unwrap();
        g.snats.push(crate::state::spec::Snat { eip: eip2, internal_cidr: (Ipv4Addr::new(10, 10, 0, 21), 32) });
        let r = rules(&g, 5, IFS, &mut |k| Allocations::default().rule_id(k));
        let at_32: Vec<_> = r.snats.iter().filter(|s| s.cidr == (Ipv4Addr::new(10, 10, 0, 21), 32)).collect();
        assert_eq!(at_32.len(), 1);
        assert_eq!(at_32[0].to, Ipv4Addr::new(198, 51, 100, 10));
    }
}
