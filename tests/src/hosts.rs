//! Test hosts: a namespace with `eth0`, its other end plugged into a bridge.

use anyhow::Result;

use crate::{
    net::{Netns, sender_offloads, sh},
    ovs::HostLink,
    unique,
};

/// A host in its own namespace, plugged into a bridge.
pub struct TestHost {
    pub ns: Netns,
    pub ip: String,
    _link: HostLink,
}

impl TestHost {
    /// Plugs a new host into a bridge with `bridge_add(host-side port)`;
    /// `gw` empty = no default route.
    pub fn on(bridge_add: impl Fn(&str) -> Result<()>, ip: &str, len: u8, gw: &str) -> Result<TestHost> {
        let ns = Netns::new(&unique("lbh"))?;
        let outside = unique("th");
        sh(&["ip", "link", "add", &outside, "type", "veth", "peer", "name", "eth0", "netns", &ns.name])?;
        let link = HostLink(outside.clone());
        sh(&["ip", "link", "set", &outside, "up"])?;
        bridge_add(&outside)?;
        ns.exec(&["ip", "addr", "add", &format!("{ip}/{len}"), "dev", "eth0"])?;
        ns.exec(&["ip", "link", "set", "eth0", "up"])?;
        if !gw.is_empty() {
            ns.exec(&["ip", "route", "add", "default", "via", gw])?;
        }
        sender_offloads(&ns, "eth0")?;
        Ok(TestHost { ns, ip: ip.into(), _link: link })
    }
}

impl TestHost {
    pub fn set_mac(&self, mac: &str) -> Result<()> {
        self.ns.exec(&["ip", "link", "set", "eth0", "address", mac]).map(|_| ())
    }
}
