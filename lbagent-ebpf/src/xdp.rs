//! XDP probes for the fast-path decision (results and decision in
//! `docs/benchmarks.md`, *XDP*). The agent never attaches them: the
//! benchmark's `xdp` section does, to measure two things an XDP dataplane
//! would have to win on before it is worth building:
//!
//! - `lbagent_xdp_pass` returns `XDP_PASS`: attached to an interface it
//!   shows the cost XDP's mere presence imposes there (on a veth the
//!   packets of a native XDP program are received one by one through the
//!   veth's NAPI, and its peer may no longer hand over GSO packets whole).
//! - `lbagent_xdp_forward` forwards every IPv4 packet as a router would,
//!   without any NAT: TTL decremented with the IP checksum updated (RFC
//!   1624), the next hop's MAC addresses written, `XDP_REDIRECT` to one
//!   interface; anything else passes. Its rate bounds what an XDP NAT could
//!   reach on the same path (a NAT only adds work).
//!
//! The loader sets the egress interface and the MAC addresses (globals).

use aya_ebpf::{bindings::xdp_action, helpers::bpf_redirect, programs::XdpContext};

use crate::hdr::{eth, ipv4};

/// Egress interface of `lbagent_xdp_forward` (set by the loader).
#[unsafe(no_mangle)]
static XDP_FORWARD_IFINDEX: u32 = 0;
/// Destination then source MAC address written by `lbagent_xdp_forward`.
#[unsafe(no_mangle)]
static XDP_FORWARD_MACS: [u8; 12] = [0; 12];

/// Ethernet and the fixed IPv4 header.
const HEAD_LEN: usize = eth::LEN + ipv4::MIN_LEN;

#[inline(always)]
pub fn pass(_ctx: &XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

#[inline(always)]
pub fn forward(ctx: &XdpContext) -> u32 {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + HEAD_LEN > end {
        return xdp_action::XDP_PASS;
    }
    let p = start as *mut u8;
    // SAFETY: every offset below is < HEAD_LEN, checked against data_end;
    // XDP packet data is writable.
    unsafe {
        if *p.add(eth::TYPE) != eth::P_IP[0] || *p.add(eth::TYPE + 1) != eth::P_IP[1] {
            return xdp_action::XDP_PASS;
        }
        let ttl = p.add(eth::LEN + ipv4::TTL);
        if *ttl <= 1 {
            return xdp_action::XDP_PASS;
        }
        // RFC 1624: the TTL is the high byte of its 16-bit word, so one
        // less adds 0x0100 to the checksum (end-around carry), as Linux's
        // ip_decrease_ttl does.
        let csum = p.add(eth::LEN + ipv4::CSUM);
        let sum = u16::from_be_bytes([*csum, *csum.add(1)]) as u32 + 0x0100;
        let sum = (sum + (sum >> 16)) as u16;
        *ttl -= 1;
        *csum = (sum >> 8) as u8;
        *csum.add(1) = sum as u8;
        let macs = core::ptr::read_volatile(&XDP_FORWARD_MACS);
        for (i, b) in macs.iter().enumerate() {
            *p.add(i) = *b;
        }
        bpf_redirect(core::ptr::read_volatile(&XDP_FORWARD_IFINDEX), 0) as u32
    }
}
