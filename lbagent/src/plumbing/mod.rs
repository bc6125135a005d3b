//! Userspace plumbing the dataplane needs: namespaces, links, addresses and
//! routes over rtnetlink, sysctls, OVS ports (`ovs-vsctl --timeout`),
//! gratuitous ARP. Every operation is "ensure" style: safe to repeat.

pub mod garp;
pub mod nl;
pub mod ovs;
pub mod sysctl;
pub mod veth;

use std::{collections::HashSet, net::Ipv4Addr};

/// IPv4 addresses configured on the host (the agent's namespace).
pub fn host_addresses() -> HashSet<Ipv4Addr> {
    nix::ifaddrs::getifaddrs()
        .map(|it| it.filter_map(|ifa| ifa.address.and_then(|a| a.as_sockaddr_in().map(|s| s.ip()))).collect())
        .unwrap_or_default()
}
