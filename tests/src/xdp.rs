//! The XDP probes (`lbagent-ebpf/src/xdp.rs`) from userspace: loaded from
//! the product's object, attached natively to a veth in a namespace. Used by
//! `tests/tests/xdp.rs` and the benchmark's XDP section.

use anyhow::{Context, Result};
use aya::{
    Ebpf, EbpfLoader,
    programs::{Xdp, XdpMode},
};
use lbagent::dataplane::OBJECT;

use crate::engine::TestPins;

pub const PASS: &str = "lbagent_xdp_pass";
pub const FORWARD: &str = "lbagent_xdp_forward";

/// Where `lbagent_xdp_forward` sends packets: the egress interface and the
/// next hop's and the interface's own MAC addresses.
#[derive(Clone, Copy, Debug, Default)]
pub struct NextHop {
    pub ifindex: u32,
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
}

/// The object with both probes loaded, `lbagent_xdp_forward` sending to
/// `hop`. The object's maps (the probes use none) are created under `pins`.
/// Attachments end when the returned object is dropped.
pub fn probes(pins: &TestPins, hop: NextHop) -> Result<Ebpf> {
    lbagent::dataplane::pins::ensure_bpffs(&pins.root)?;
    std::fs::create_dir_all(&pins.root)?;
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(&hop.dst_mac);
    macs[6..].copy_from_slice(&hop.src_mac);
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(&pins.root)
        .override_global("XDP_FORWARD_IFINDEX", &hop.ifindex, true)
        .override_global("XDP_FORWARD_MACS", &macs, true)
        .load(OBJECT)
        .context("loading the eBPF object")?;
    for name in [PASS, FORWARD] {
        probe(&mut ebpf, name)?.load().with_context(|| format!("loading {name}"))?;
    }
    Ok(ebpf)
}

pub fn probe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut Xdp> {
    Ok(ebpf.program_mut(name).with_context(|| format!("{name} missing from the object"))?.try_into()?)
}

/// Attaches probe `name` natively (driver mode: the veth's own XDP) to
/// `ifname` in namespace `ns`.
pub fn attach(ebpf: &mut Ebpf, name: &str, ns: &str, ifname: &str) -> Result<()> {
    let p = probe(ebpf, name)?;
    lbagent::netns::run_in(Some(ns), || {
        let ifindex = lbagent::netns::ifindex(ifname)?;
        p.attach(ifindex, XdpMode::Driver).with_context(|| format!("attaching {name} to {ifname} in {ns}"))?;
        Ok(())
    })
}

/// Forwarding across a [`NatTopology`](crate::topology::NatTopology) built
/// `plain()`: the NAT namespace's client-side veth forwards to the server
/// with `lbagent_xdp_forward`; the server's veth runs `lbagent_xdp_pass`
/// (a veth receives redirected frames only with an XDP program of its own).
///
/// The client's checksum offload is switched off: a frame XDP redirects
/// between veths is rebuilt without the sender's offload state
/// (`CHECKSUM_PARTIAL`), so a sender that leaves its checksums to offload
/// has its packets arrive with unfinished ones (measured: every UDP
/// datagram counted in the server's `UdpInCsumErrors`). That also turns off
/// the client's TSO: part of what XDP costs on this path.
pub fn forward_to_server(t: &crate::topology::NatTopology, pins: &TestPins) -> Result<Ebpf> {
    t.client.exec(&["ethtool", "-K", &t.client_if, "tx", "off"])?;
    let n1 = &t.ifaces[1];
    let s0 = &t.server_if;
    let (ifindex, src_mac) =
        lbagent::netns::run_in(Some(&t.nat.name), || Ok((lbagent::netns::ifindex(n1)?, crate::engine::mac_of(n1))))?;
    let dst_mac = lbagent::netns::run_in(Some(&t.server.name), || Ok(crate::engine::mac_of(s0)))?;
    let mut ebpf = probes(pins, NextHop { ifindex, dst_mac, src_mac })?;
    attach(&mut ebpf, PASS, &t.server.name, s0)?;
    attach(&mut ebpf, FORWARD, &t.nat.name, &t.ifaces[0])?;
    Ok(ebpf)
}
