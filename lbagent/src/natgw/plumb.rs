//! A gateway's namespace and links (the kube-ovn gateway pod, done by the
//! agent): `eth0` toward the VPC (host end on the integration bridge),
//! `net1` toward the external network (host end on the external bridge),
//! EIPs on `net1` with a gratuitous ARP each time one is added.

use std::{collections::BTreeSet, net::Ipv4Addr};

use anyhow::{Result, bail};

use crate::outcome::Changes;
use crate::{
    naming, netns,
    plumbing::{
        garp,
        nl::{Nl, Route4},
        ovs, sysctl, veth,
    },
    state::spec::{Gw, mac_text},
};

pub use naming::{GW_EXT_IF as EXT_IF, GW_LAN_IF as LAN_IF};

/// What `ensure` made: the gateway's interface indexes in its namespace,
/// and the outcome of putting the host ends on their bridges — kept apart
/// so an OVS outage is reported after the rules are synced, not before.
pub struct Plumbed {
    pub lan: u32,
    pub ext: u32,
    pub bridges: Result<()>,
}

/// Ensures everything below the engine.
pub fn ensure(gw: &Gw, integration_bridge: &str, changes: &mut Changes) -> Result<Plumbed> {
    let ns = naming::gw_netns(&gw.name);
    if netns::create(&ns)? {
        changes.push(format!("created namespace {ns}"));
    }
    let (lan_host, ext_host) = naming::gw_host_veths(&gw.name);
    let (lan_tmp, ext_tmp) = naming::gw_tmp_peers(&gw.name);
    let owner = naming::link_owner_alias(&naming::gw_zone_key(&gw.name));
    veth::ensure_pair(&ns, &lan_host, LAN_IF, Some(&lan_tmp), &owner, changes)?;
    veth::ensure_pair(&ns, &ext_host, EXT_IF, Some(&ext_tmp), &owner, changes)?;

    // Host ends: up, on their bridges; down on the standby of an HA pair
    // (it neither answers ARP for the gateway's addresses nor takes its
    // traffic until promoted: `crate::ha`).
    // The role is held still while the links are set (a promotion or
    // demotion waits for it, and sets every gateway's links itself).
    let announcing = crate::ha::with_role(|announcing| {
        netns::run_in(None, || {
            let nl = Nl::new()?;
            for h in [&lan_host, &ext_host] {
                let i = nl.must_index(h)?;
                if announcing { nl.set_up(i)? } else { nl.set_down(i)? }
            }
            Ok(announcing)
        })
    })?;
    // Before the addresses: a gratuitous ARP must find the port bridged.
    let bridges = ensure_bridges(gw, integration_bridge, changes);
    let (lan_ip, lan_mac, ext_gw) = (gw.lan.ip, gw.lan.mac, gw.external.gateway);
    let eips: BTreeSet<Ipv4Addr> = gw.eips.iter().map(|e| e.ip).collect();
    let ext_len = gw.external.prefix_len;
    let lan_len = gw.lan.prefix_len;
    let inner = netns::run_in(Some(&ns), || {
        let mut ch = Vec::new();
        let nl = Nl::new()?;
        nl.set_up(nl.must_index("lo")?)?;
        let lan = nl.must_index(LAN_IF)?;
        let ext = nl.must_index(EXT_IF)?;
        if nl.link_info(lan)?.1 != lan_mac {
            nl.set_mac(lan, lan_mac)?;
            ch.push(format!("{LAN_IF} mac {}", mac_text(&lan_mac)));
        }
        nl.set_up(lan)?;
        nl.set_up(ext)?;
        ch.extend(nl.sync_addresses(lan, &[(lan_ip, lan_len)], false)?.describe(LAN_IF, ""));
        // EIPs: exactly the configured ones on net1; announce new ones.
        let ext_mac: [u8; 6] = nl.link_info(ext)?.1.try_into().unwrap_or([0; 6]);
        let want: Vec<(Ipv4Addr, u8)> = eips.iter().map(|ip| (*ip, ext_len)).collect();
        let eip_changes = nl.sync_addresses(ext, &want, false)?;
        for (ip, len) in &eip_changes.added {
            ch.push(format!("EIP {ip}/{len} on {EXT_IF}"));
            if !announcing {
                ch.push(format!("{ip} not announced (HA standby)"));
            } else if let Err(e) = garp::announce(ext, ext_mac, *ip) {
                ch.push(format!("gratuitous ARP for {ip} failed: {e:#}"));
            } else {
                ch.push(format!("gratuitous ARP for {ip}"));
            }
        }
        for (ip, _) in &eip_changes.removed {
            ch.push(format!("EIP {ip} removed from {EXT_IF}"));
        }
        // Links nobody asked for go.
        ch.extend(nl.keep_only_links(&[LAN_IF, EXT_IF])?.into_iter().map(|n| format!("removed stray link {n}")));
        sysctl::router(&[LAN_IF, EXT_IF])?;
        // Routes: default via the external gateway (onlink), VPC routes via eth0.
        let mut want = vec![Route4 { dst: Ipv4Addr::UNSPECIFIED, len: 0, via: Some(ext_gw), oif: ext, onlink: true }];
        want.extend(gw.routes.iter().map(|r| Route4 {
            dst: r.cidr.0,
            len: r.cidr.1,
            via: Some(r.via),
            oif: lan,
            onlink: false,
        }));
        for r in &want {
            if nl.ensure_route(r)? {
                ch.push(format!("route {}/{} via {}", r.dst, r.len, r.via.unwrap()));
            }
        }
        for (r, m) in nl.routes()? {
            let Some(via) = r.via else { continue };
            if !want.iter().any(|w| w.dst == r.dst && w.len == r.len && w.via == r.via && w.oif == r.oif) {
                nl.del_route(m)?;
                ch.push(format!("removed route {}/{} via {via}", r.dst, r.len));
            }
        }
        Ok((ch, lan, ext))
    })?;
    changes.extend(inner.0);
    Ok(Plumbed { lan: inner.1, ext: inner.2, bridges })
}

/// The host ends on their bridges: `eth0`'s on the integration bridge,
/// `net1`'s on the external OVS or Linux bridge.
pub fn ensure_bridges(gw: &Gw, integration_bridge: &str, changes: &mut Changes) -> Result<()> {
    let (lan_host, ext_host) = naming::gw_host_veths(&gw.name);
    if ovs::ensure_port(integration_bridge, &lan_host, &naming::gw_lan_iface_id(&gw.name))? {
        changes.push(format!("{lan_host} on OVS bridge {integration_bridge}"));
    }
    let ext_br = &gw.external.bridge;
    if ovs::bridge_exists(ext_br)? {
        if ovs::ensure_port(ext_br, &ext_host, &naming::gw_ext_iface_id(&gw.name))? {
            changes.push(format!("{ext_host} on OVS bridge {ext_br}"));
        }
    } else if std::path::Path::new(&format!("/sys/class/net/{ext_br}/bridge")).exists() {
        netns::run_in(None, || {
            let nl = Nl::new()?;
            nl.set_master(nl.must_index(&ext_host)?, nl.must_index(ext_br)?)
        })?;
    } else {
        bail!("external.bridge {ext_br}: no such OVS or Linux bridge");
    }

    Ok(())
}

/// Removes the namespace (its veths and their host ends go with it) and the
/// OVS ports. Safe to repeat.
pub fn remove(name: &str, changes: &mut Changes) -> Result<()> {
    let (lan_host, ext_host) = naming::gw_host_veths(name);
    let ns = naming::gw_netns(name);
    if netns::delete(&ns)? {
        changes.push(format!("deleted namespace {ns}"));
    }
    veth::delete_host_links(&[&lan_host, &ext_host], &naming::link_owner_alias(&naming::gw_zone_key(name)), changes)?;
    let _ = ovs::del_owned_port(&lan_host, &naming::gw_lan_iface_id(name));
    let _ = ovs::del_owned_port(&ext_host, &naming::gw_ext_iface_id(name));
    Ok(())
}
