//! A small synchronous rtnetlink client. Create it on the thread that is in
//! the namespace to act on (see `netns::run_in`): the socket binds to the
//! creating thread's namespace.

use std::{
    net::{IpAddr, Ipv4Addr},
    os::fd::AsRawFd,
};

use anyhow::{Context, Result, anyhow};
use futures_util::TryStreamExt;
use rtnetlink::{
    Handle, LinkUnspec, LinkVeth, RouteMessageBuilder, new_connection,
    packet_route::{
        address::AddressAttribute,
        link::{LinkAttribute, LinkFlags},
        route::{RouteAddress, RouteAttribute, RouteMessage, RouteMetric, RouteScope},
    },
};
use tokio::runtime::Runtime;

/// What [`Nl::sync_addresses`] changed.
#[derive(Debug, Default)]
pub struct AddressChanges {
    pub added: Vec<(Ipv4Addr, u8)>,
    pub removed: Vec<(Ipv4Addr, u8)>,
}

impl AddressChanges {
    /// `<link> address a/l`, `<link> removed stray address a/l` lines.
    pub fn describe(&self, link: &str, extra: &str) -> Vec<String> {
        let added = self.added.iter().map(|(ip, len)| format!("{link} address {ip}/{len}{extra}"));
        added.chain(self.removed.iter().map(|(ip, len)| format!("{link} removed stray address {ip}/{len}"))).collect()
    }
}

pub struct Nl {
    rt: Runtime,
    h: Handle,
}

/// One IPv4 route as the agent manages it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route4 {
    pub dst: Ipv4Addr,
    pub len: u8,
    pub via: Option<Ipv4Addr>,
    pub oif: u32,
    pub onlink: bool,
}

impl Nl {
    pub fn new() -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let h = rt.block_on(async {
            let (conn, h, _) = new_connection()?;
            tokio::spawn(conn);
            Ok::<_, anyhow::Error>(h)
        })?;
        Ok(Nl { rt, h })
    }

    /// Index of a link by name, if present.
    pub fn index(&self, name: &str) -> Result<Option<u32>> {
        self.rt.block_on(async {
            let mut s = self.h.link().get().match_name(name.to_string()).execute();
            match s.try_next().await {
                Ok(Some(m)) => Ok(Some(m.header.index)),
                Ok(None) => Ok(None),
                Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(None),
                Err(e) => Err(anyhow!(e)).context(format!("looking up link {name}")),
            }
        })
    }

    pub fn must_index(&self, name: &str) -> Result<u32> {
        self.index(name)?.ok_or_else(|| anyhow!("link {name} not found"))
    }

    /// Names of every link in the namespace.
    pub fn link_names(&self) -> Result<Vec<String>> {
        self.rt.block_on(async {
            let mut s = self.h.link().get().execute();
            let mut out = Vec::new();
            while let Some(m) = s.try_next().await? {
                for a in &m.attributes {
                    if let LinkAttribute::IfName(n) = a {
                        out.push(n.clone());
                    }
                }
            }
            Ok(out)
        })
    }

    /// Every link's index and MTU, each lowered to the smallest MTU of an
    /// IPv4 route through it (any table; a multipath route counts for each
    /// of its next hops): the largest packet `ip_forward` sends out of the
    /// link unfragmented, whatever route it takes.
    pub fn egress_mtus(&self) -> Result<std::collections::BTreeMap<u32, u32>> {
        self.rt.block_on(async {
            let mut mtus = std::collections::BTreeMap::new();
            let mut links = self.h.link().get().execute();
            while let Some(m) = links.try_next().await? {
                for a in &m.attributes {
                    if let LinkAttribute::Mtu(mtu) = a {
                        mtus.insert(m.header.index, *mtu);
                    }
                }
            }
            let mut routes = self.h.route().get(RouteMessageBuilder::<Ipv4Addr>::new().build()).execute();
            while let Some(m) = routes.try_next().await? {
                let mut route_mtu = None;
                let mut oifs = Vec::new();
                for a in &m.attributes {
                    match a {
                        RouteAttribute::Metrics(metrics) => {
                            route_mtu = metrics.iter().find_map(|x| match x {
                                RouteMetric::Mtu(v) if *v != 0 => Some(*v),
                                _ => None,
                            })
                        }
                        RouteAttribute::Oif(i) => oifs.push(*i),
                        RouteAttribute::MultiPath(hops) => oifs.extend(hops.iter().map(|h| h.interface_index)),
                        _ => {}
                    }
                }
                let Some(route_mtu) = route_mtu else { continue };
                for oif in oifs {
                    if let Some(mtu) = mtus.get_mut(&oif) {
                        *mtu = (*mtu).min(route_mtu);
                    }
                }
            }
            Ok(mtus)
        })
    }

    /// The link's attributes and flags as the kernel reports them.
    fn link(&self, index: u32) -> Result<rtnetlink::packet_route::link::LinkMessage> {
        self.rt.block_on(async {
            self.h
                .link()
                .get()
                .match_index(index)
                .execute()
                .try_next()
                .await?
                .ok_or_else(|| anyhow!("link {index} vanished"))
        })
    }

    /// Whether the link is up, and its MAC.
    pub fn link_info(&self, index: u32) -> Result<(bool, Vec<u8>)> {
        let m = self.link(index)?;
        let mac =
            m.attributes.iter().find_map(|a| if let LinkAttribute::Address(a) = a { Some(a.clone()) } else { None });
        Ok((m.header.flags.contains(LinkFlags::Up), mac.unwrap_or_default()))
    }

    /// The link's alias (IFLA_IFALIAS), empty when unset.
    pub fn alias(&self, index: u32) -> Result<String> {
        let m = self.link(index)?;
        Ok(m.attributes
            .iter()
            .find_map(|a| if let LinkAttribute::IfAlias(s) = a { Some(s.clone()) } else { None })
            .unwrap_or_default())
    }

    pub fn set_alias(&self, index: u32, alias: &str) -> Result<()> {
        self.rt
            .block_on(self.h.link().set(LinkUnspec::new_with_index(index).alias(alias).build()).execute())
            .context("setting link alias")
    }

    /// Creates the veth pair `name`/`peer` unless `name` exists.
    pub fn ensure_veth(&self, name: &str, peer: &str) -> Result<bool> {
        if self.index(name)?.is_some() {
            return Ok(false);
        }
        self.rt
            .block_on(self.h.link().add(LinkVeth::new(name, peer).build()).execute())
            .with_context(|| format!("creating veth {name}/{peer}"))?;
        Ok(true)
    }

    pub fn delete(&self, name: &str) -> Result<bool> {
        let Some(i) = self.index(name)? else { return Ok(false) };
        self.rt.block_on(self.h.link().del(i).execute()).with_context(|| format!("deleting {name}"))?;
        Ok(true)
    }

    /// Moves a link into the namespace open at `ns`.
    pub fn move_to(&self, name: &str, ns: &std::fs::File) -> Result<()> {
        let i = self.must_index(name)?;
        self.rt
            .block_on(self.h.link().set(LinkUnspec::new_with_index(i).setns_by_fd(ns.as_raw_fd()).build()).execute())
            .with_context(|| format!("moving {name} to its namespace"))
    }

    pub fn rename(&self, index: u32, name: &str) -> Result<()> {
        self.rt
            .block_on(self.h.link().set(LinkUnspec::new_with_index(index).name(name).build()).execute())
            .with_context(|| format!("renaming to {name}"))
    }

    pub fn set_mac(&self, index: u32, mac: [u8; 6]) -> Result<()> {
        self.rt
            .block_on(self.h.link().set(LinkUnspec::new_with_index(index).address(mac.to_vec()).build()).execute())
            .context("setting MAC")
    }

    pub fn set_up(&self, index: u32) -> Result<()> {
        self.rt
            .block_on(self.h.link().set(LinkUnspec::new_with_index(index).up().build()).execute())
            .context("setting link up")
    }

    pub fn set_down(&self, index: u32) -> Result<()> {
        self.rt
            .block_on(self.h.link().set(LinkUnspec::new_with_index(index).down().build()).execute())
            .context("setting link down")
    }

    pub fn set_master(&self, index: u32, master: u32) -> Result<()> {
        self.rt
            .block_on(self.h.link().set(LinkUnspec::new_with_index(index).controller(master).build()).execute())
            .context("enslaving to bridge")
    }

    /// IPv4 addresses on a link, with prefix lengths.
    pub fn addresses(&self, index: u32) -> Result<Vec<(Ipv4Addr, u8)>> {
        self.rt.block_on(async {
            let mut s = self.h.address().get().set_link_index_filter(index).execute();
            let mut out = Vec::new();
            while let Some(m) = s.try_next().await? {
                for a in &m.attributes {
                    if let AddressAttribute::Local(IpAddr::V4(ip)) = a {
                        out.push((*ip, m.header.prefix_len));
                    }
                }
            }
            Ok(out)
        })
    }

    /// Adds `ip/len` unless present; returns whether it was added.
    pub fn ensure_addr(&self, index: u32, ip: Ipv4Addr, len: u8, noprefixroute: bool) -> Result<bool> {
        if self.addresses(index)?.contains(&(ip, len)) {
            return Ok(false);
        }
        let mut req = self.h.address().add(index, IpAddr::V4(ip), len);
        if noprefixroute {
            use rtnetlink::packet_route::address::AddressFlags;
            req.message_mut().attributes.push(AddressAttribute::Flags(AddressFlags::Noprefixroute));
        }
        self.rt.block_on(req.execute()).with_context(|| format!("adding {ip}/{len}"))?;
        Ok(true)
    }

    pub fn del_addr(&self, index: u32, ip: Ipv4Addr, len: u8) -> Result<bool> {
        self.rt.block_on(async {
            let mut s =
                self.h.address().get().set_link_index_filter(index).set_address_filter(IpAddr::V4(ip)).execute();
            while let Some(m) = s.try_next().await? {
                if m.header.prefix_len == len {
                    self.h.address().del(m).execute().await?;
                    return Ok(true);
                }
            }
            Ok(false)
        })
    }

    /// Makes `want` exactly the IPv4 addresses of link `index`: adds the
    /// missing ones first (with `noprefixroute` as given), then removes the
    /// rest. Returns (added, removed).
    pub fn sync_addresses(&self, index: u32, want: &[(Ipv4Addr, u8)], noprefixroute: bool) -> Result<AddressChanges> {
        let mut ch = AddressChanges::default();
        for (ip, len) in want {
            if self.ensure_addr(index, *ip, *len, noprefixroute)? {
                ch.added.push((*ip, *len));
            }
        }
        for (ip, len) in self.addresses(index)? {
            if !want.contains(&(ip, len)) && self.del_addr(index, ip, len)? {
                ch.removed.push((ip, len));
            }
        }
        Ok(ch)
    }

    /// Deletes every link of the namespace but `lo` and `keep`; returns the
    /// names deleted (call inside an object's own namespace only).
    pub fn keep_only_links(&self, keep: &[&str]) -> Result<Vec<String>> {
        let mut gone = Vec::new();
        for name in self.link_names()? {
            if name != "lo" && !keep.contains(&name.as_str()) && self.delete(&name)? {
                gone.push(name);
            }
        }
        Ok(gone)
    }

    /// Routes of the main table that point at an interface (oif set).
    pub fn routes(&self) -> Result<Vec<(Route4, RouteMessage)>> {
        self.rt.block_on(async {
            let mut s = self.h.route().get(RouteMessageBuilder::<Ipv4Addr>::new().build()).execute();
            let mut out = Vec::new();
            while let Some(m) = s.try_next().await? {
                if m.header.table != 254 {
                    continue;
                }
                let mut r = Route4 {
                    dst: Ipv4Addr::UNSPECIFIED,
                    len: m.header.destination_prefix_length,
                    via: None,
                    oif: 0,
                    onlink: m.header.flags.contains(rtnetlink::packet_route::route::RouteFlags::Onlink),
                };
                for a in &m.attributes {
                    match a {
                        RouteAttribute::Destination(RouteAddress::Inet(d)) => r.dst = *d,
                        RouteAttribute::Gateway(RouteAddress::Inet(g)) => r.via = Some(*g),
                        RouteAttribute::Oif(i) => r.oif = *i,
                        _ => {}
                    }
                }
                out.push((r, m));
            }
            Ok(out)
        })
    }

    /// Adds a route unless an identical one exists; returns whether added.
    pub fn ensure_route(&self, r: &Route4) -> Result<bool> {
        if self.routes()?.iter().any(|(x, _)| x.dst == r.dst && x.len == r.len && x.via == r.via && x.oif == r.oif) {
            return Ok(false);
        }
        // A route to the same prefix with other attributes is replaced.
        for (x, m) in self.routes()? {
            if x.dst == r.dst && x.len == r.len && x.via.is_some() {
                self.rt.block_on(self.h.route().del(m).execute())?;
            }
        }
        let mut b = RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(r.dst, r.len).output_interface(r.oif);
        if let Some(via) = r.via {
            b = b.gateway(via);
        } else {
            b = b.scope(RouteScope::Link);
        }
        if r.onlink {
            b = b.onlink();
        }
        self.rt
            .block_on(self.h.route().add(b.build()).execute())
            .with_context(|| format!("adding route {}/{} via {:?}", r.dst, r.len, r.via))?;
        Ok(true)
    }

    pub fn del_route(&self, m: RouteMessage) -> Result<()> {
        self.rt.block_on(self.h.route().del(m).execute()).context("deleting route")
    }
}
