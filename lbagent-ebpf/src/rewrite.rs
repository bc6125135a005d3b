//! Rewrites a packet's tuple in place with the kernel's checksum helpers.
//!
//! Address changes update the IPv4 header checksum and, with
//! `BPF_F_PSEUDO_HDR`, the TCP/UDP checksum (its pseudo header covers the
//! addresses; this is also what keeps CHECKSUM_PARTIAL packets right). UDP
//! uses `BPF_F_MARK_MANGLED_0`: a zero ("no checksum") UDP checksum stays zero
//! and a computed zero becomes 0xffff. Checksums are never zeroed.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use lbagent_common::{PROTO_TCP, PROTO_UDP, Tuple};

use crate::parse::{Frag, Kind, Packet};

/// L4 checksum offsets within their headers.
const TCP_CSUM: usize = 16;
const UDP_CSUM: usize = 6;
const ICMP_CSUM: usize = 2;
const ICMP_ECHO_ID: usize = 4;

pub const IP_CSUM: usize = 10;
pub const IP_SADDR: usize = 12;
pub const IP_DADDR: usize = 16;

#[inline(always)]
pub fn raw32(a: [u8; 4]) -> u64 {
    u32::from_ne_bytes(a) as u64
}

/// A host-order port as the raw 16-bit value found in the packet.
#[inline(always)]
pub fn raw16(port: u16) -> u64 {
    u16::from_ne_bytes(port.to_be_bytes()) as u64
}

/// Stores a 4-byte address and fixes the IP checksum (and, if given, the L4 one).
#[inline(always)]
pub fn set_addr(
    ctx: &TcContext,
    off: usize,
    l3: usize,
    old: [u8; 4],
    new: [u8; 4],
    l4csum: Option<(usize, u64)>,
) -> Result<(), i64> {
    ctx.store(off, &new, 0)?;
    ctx.l3_csum_replace(l3 + IP_CSUM, raw32(old), raw32(new), 4)?;
    if let Some((csum_off, flags)) = l4csum {
        ctx.l4_csum_replace(csum_off, raw32(old), raw32(new), flags | BPF_F_PSEUDO_HDR as u64 | 4)?;
    }
    Ok(())
}

/// Stores a 2-byte port (or ICMP id) and fixes the L4 checksum.
#[inline(always)]
pub fn set_port(ctx: &TcContext, off: usize, csum_off: usize, flags: u64, old: u16, new: u16) -> Result<(), i64> {
    ctx.store(off, &new.to_be_bytes(), 0)?;
    ctx.l4_csum_replace(csum_off, raw16(old), raw16(new), flags | 2)
}

/// Makes the packet's tuple equal `to`.
#[inline(always)]
pub fn rewrite(ctx: &TcContext, p: &Packet, to: &Tuple) -> Result<(), i64> {
    if p.frag == Frag::Later {
        // No L4 header in this fragment: the first one carried the checksum.
        return rewrite_addresses(ctx, p, to);
    }
    let t = &p.tuple;
    let (l4csum, flags) = match (p.kind, t.proto) {
        (Kind::Ports, PROTO_TCP) => (Some(p.l4 + TCP_CSUM), 0u64),
        (Kind::Ports, PROTO_UDP) => (Some(p.l4 + UDP_CSUM), BPF_F_MARK_MANGLED_0 as u64),
        _ => (None, 0u64),
    };
    let pseudo = l4csum.map(|c| (c, flags));
    if to.saddr != t.saddr {
        set_addr(ctx, p.l3 + IP_SADDR, p.l3, t.saddr, to.saddr, pseudo)?;
    }
    if to.daddr != t.daddr {
        set_addr(ctx, p.l3 + IP_DADDR, p.l3, t.daddr, to.daddr, pseudo)?;
    }
    match (p.kind, l4csum) {
        (Kind::EchoRequest, _) if to.sport != t.sport => {
            set_port(ctx, p.l4 + ICMP_ECHO_ID, p.l4 + ICMP_CSUM, 0, t.sport, to.sport)?
        }
        (Kind::EchoReply, _) if to.dport != t.dport => {
            set_port(ctx, p.l4 + ICMP_ECHO_ID, p.l4 + ICMP_CSUM, 0, t.dport, to.dport)?
        }
        (Kind::Ports, Some(csum)) => {
            if to.sport != t.sport {
                set_port(ctx, p.l4, csum, flags, t.sport, to.sport)?;
            }
            if to.dport != t.dport {
                set_port(ctx, p.l4 + 2, csum, flags, t.dport, to.dport)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Rewrites only the IPv4 addresses (address-only protocols' later
/// fragments): the IP checksum changes, nothing else.
#[inline(always)]
pub fn rewrite_addresses(ctx: &TcContext, p: &Packet, to: &Tuple) -> Result<(), i64> {
    let t = &p.tuple;
    if to.saddr != t.saddr {
        set_addr(ctx, p.l3 + IP_SADDR, p.l3, t.saddr, to.saddr, None)?;
    }
    if to.daddr != t.daddr {
        set_addr(ctx, p.l3 + IP_DADDR, p.l3, t.daddr, to.daddr, None)?;
    }
    Ok(())
}
