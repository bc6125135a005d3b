//! Userspace plumbing the dataplane needs: namespaces, links, addresses and
//! routes over rtnetlink, sysctls, OVS ports (`ovs-vsctl --timeout`),
//! gratuitous ARP. Every operation is "ensure" style: safe to repeat.

pub mod garp;
pub mod nl;
pub mod ovs;
pub mod sysctl;
pub mod veth;
