//! A load balancer's namespace and links, as cloudpods' `ovn.go` builds
//! them: `o…0`/`o…1` toward OVN (`o…1` on the integration bridge with
//! `iface-id=iface/lb/<id>`), `h…0`/`h…1` toward the host's proxy, the VIP
//! and default route on `o…0`, `inner/16` on `h…0`, `outer/16` noprefixroute
//! on `h…1` with the host route `inner/32 dev h…1`. Everything via
//! rtnetlink except the OVS port.

use std::net::Ipv4Addr;

use anyhow::Result;

use crate::outcome::Changes;
use crate::{
    alloc::LbAlloc,
    naming, netns,
    plumbing::{
        nl::{Nl, Route4},
        ovs, sysctl, veth,
    },
    state::spec::{Lb, mac_text},
};

pub const LINKLOCAL_LEN: u8 = 16;

/// What `ensure` made: ifindexes of `o…0` and `h…0` in the namespace, and
/// the outcome of the OVS port — kept apart so an OVS outage is reported
/// after the rules are synced, not before.
pub struct Plumbed {
    pub ovn: u32,
    pub proxy: u32,
    pub ovs: Result<()>,
}

pub fn ensure(lb: &Lb, a: &LbAlloc, bridge: &str, changes: &mut Changes) -> Result<Plumbed> {
    let ns = naming::lb_netns(&lb.id);
    if netns::create(&ns)? {
        changes.push(format!("created namespace {ns}"));
    }
    let (o0, o1) = naming::lb_ovn_veth(&lb.id);
    let (h0, h1) = naming::lb_host_veth(&lb.id);
    let owner = naming::link_owner_alias(&naming::lb_zone_key(&lb.id));
    veth::ensure_pair(&ns, &o1, &o0, None, &owner, changes)?;
    veth::ensure_pair(&ns, &h1, &h0, None, &owner, changes)?;
    let ovs = ensure_ovs(lb, bridge, changes);
    // Host side: h…1 carries outer/16 without a prefix route, plus inner/32.
    let (inner, outer) = (a.inner, a.outer);
    let host_changes = netns::run_in(None, || {
        let mut ch = Vec::new();
        let nl = Nl::new()?;
        let o1i = nl.must_index(&o1)?;
        let h1i = nl.must_index(&h1)?;
        nl.set_up(o1i)?;
        nl.set_up(h1i)?;
        ch.extend(nl.sync_addresses(h1i, &[(outer, LINKLOCAL_LEN)], true)?.describe(&h1, " noprefixroute"));
        if nl.ensure_route(&Route4 { dst: inner, len: 32, via: None, oif: h1i, onlink: false })? {
            ch.push(format!("route {inner}/32 dev {h1}"));
        }
        Ok(ch)
    })?;
    changes.extend(host_changes);

    let (vip, gw, mac, plen) = (lb.network.ip, lb.network.gateway, lb.network.mac, lb.network.prefix_len);
    let inside = netns::run_in(Some(&ns), || {
        let mut ch = Vec::new();
        let nl = Nl::new()?;
        nl.set_up(nl.must_index("lo")?)?;
        let oi = nl.must_index(&o0)?;
        let hi = nl.must_index(&h0)?;
        if nl.link_info(oi)?.1 != mac {
            nl.set_mac(oi, mac)?;
            ch.push(format!("{o0} mac {}", mac_text(&mac)));
        }
        nl.set_up(oi)?;
        nl.set_up(hi)?;
        for (i, name, want) in [(oi, &o0, (vip, plen)), (hi, &h0, (inner, LINKLOCAL_LEN))] {
            ch.extend(nl.sync_addresses(i, &[want], false)?.describe(name, ""));
        }
        if nl.ensure_route(&Route4 { dst: Ipv4Addr::UNSPECIFIED, len: 0, via: Some(gw), oif: oi, onlink: false })? {
            ch.push(format!("default route via {gw}"));
        }
        // Links nobody asked for go.
        ch.extend(nl.keep_only_links(&[&o0, &h0])?.into_iter().map(|n| format!("removed stray link {n}")));
        sysctl::router(&[&o0, &h0])?;
        Ok((ch, oi, hi))
    })?;
    changes.extend(inside.0);
    Ok(Plumbed { ovn: inside.1, proxy: inside.2, ovs })
}

/// `o…1` on the integration bridge with the load balancer's `iface-id`.
pub fn ensure_ovs(lb: &Lb, bridge: &str, changes: &mut Changes) -> Result<()> {
    let (_, o1) = naming::lb_ovn_veth(&lb.id);
    if ovs::ensure_port(bridge, &o1, &naming::lb_iface_id(&lb.id))? {
        changes.push(format!("{o1} on OVS bridge {bridge} as {}", naming::lb_iface_id(&lb.id)));
    }
    Ok(())
}

/// Removes the namespace (its veths and their host ends go with it) and the
/// OVS port; links and ports of these names that are not this load
/// balancer's are left alone. Safe to repeat.
pub fn remove(id: &str, changes: &mut Changes) -> Result<()> {
    let ns = naming::lb_netns(id);
    if netns::delete(&ns)? {
        changes.push(format!("deleted namespace {ns}"));
    }
    let (_, o1) = naming::lb_ovn_veth(id);
    let (_, h1) = naming::lb_host_veth(id);
    veth::delete_host_links(&[&o1, &h1], &naming::link_owner_alias(&naming::lb_zone_key(id)), changes)?;
    let _ = ovs::del_owned_port(&o1, &naming::lb_iface_id(id));
    Ok(())
}
