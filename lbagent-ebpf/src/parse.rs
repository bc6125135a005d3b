//! IPv4 parsing with direct packet access. Produces the packet's tuple and the
//! offsets the rewriter needs; everything else is passed untouched.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, programs::TcContext};
use lbagent_common::{Counter, PROTO_ICMP, PROTO_TCP, PROTO_UDP, Tuple};

pub const ETH_LEN: usize = 14;
pub const TCP_RST: u8 = 0x04;
pub const TCP_FIN: u8 = 0x01;

pub const ICMP_ECHO_REPLY: u8 = 0;
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_ECHO_REQUEST: u8 = 8;
pub const ICMP_TIME_EXCEEDED: u8 = 11;
pub const ICMP_PARAM_PROBLEM: u8 = 12;

/// A parsed flow packet (TCP, UDP or ICMP echo).
#[derive(Clone, Copy)]
pub struct Packet {
    /// Offset of the IPv4 header.
    pub l3: usize,
    /// Offset of the L4 header (after IP options).
    pub l4: usize,
    pub tuple: Tuple,
    pub tcp_flags: u8,
    pub ifindex: u32,
}

/// The header embedded in an ICMP error, as the original packet carried it.
#[derive(Clone, Copy)]
pub struct Embedded {
    pub l3: usize,
    pub l4: usize,
    /// The embedded packet's tuple (in the direction it was sent).
    pub tuple: Tuple,
    /// Offset of the embedded L4 checksum if it lies inside the packet.
    pub l4_csum: Option<usize>,
}

pub enum Parsed {
    Flow(Packet),
    IcmpError(Packet, Embedded),
}

#[inline(always)]
fn bytes<const N: usize>(ctx: &TcContext, off: usize) -> Option<[u8; N]> {
    let start = ctx.data();
    if start + off + N > ctx.data_end() {
        return None;
    }
    Some(unsafe { core::ptr::read_unaligned((start + off) as *const [u8; N]) })
}

#[inline(always)]
fn be16(b: [u8; 2]) -> u16 {
    u16::from_be_bytes(b)
}

/// IPv4 header at `l3`: (l4 offset, protocol, saddr, daddr, is_fragment).
#[inline(always)]
fn ipv4(ctx: &TcContext, l3: usize) -> Option<(usize, u8, [u8; 4], [u8; 4], bool)> {
    let h: [u8; 20] = bytes(ctx, l3)?;
    if h[0] >> 4 != 4 {
        return None;
    }
    let ihl = ((h[0] & 0x0f) as usize) * 4;
    if ihl < 20 {
        return None;
    }
    let frag = be16([h[6], h[7]]) & 0x3fff != 0;
    Some((l3 + ihl, h[9], [h[12], h[13], h[14], h[15]], [h[16], h[17], h[18], h[19]], frag))
}

#[inline(always)]
pub fn parse(ctx: &TcContext, zone: u16) -> Result<Parsed, Counter> {
    let eth: [u8; ETH_LEN] = bytes(ctx, 0).ok_or(Counter::PassNonIpv4)?;
    if eth[12] != 0x08 || eth[13] != 0x00 {
        return Err(Counter::PassNonIpv4);
    }
    let l3 = ETH_LEN;
    let (l4, proto, saddr, daddr, frag) = ipv4(ctx, l3).ok_or(Counter::DropMalformed)?;
    if frag {
        return Err(Counter::PassFragment);
    }
    let ifindex = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ifindex };
    let mut p = Packet {
        l3,
        l4,
        tuple: Tuple { saddr, daddr, sport: 0, dport: 0, proto, _pad0: 0, zone },
        tcp_flags: 0,
        ifindex,
    };
    match proto {
        PROTO_TCP => {
            let h: [u8; 20] = bytes(ctx, l4).ok_or(Counter::DropMalformed)?;
            p.tuple.sport = be16([h[0], h[1]]);
            p.tuple.dport = be16([h[2], h[3]]);
            p.tcp_flags = h[13];
            Ok(Parsed::Flow(p))
        }
        PROTO_UDP => {
            let h: [u8; 8] = bytes(ctx, l4).ok_or(Counter::DropMalformed)?;
            p.tuple.sport = be16([h[0], h[1]]);
            p.tuple.dport = be16([h[2], h[3]]);
            Ok(Parsed::Flow(p))
        }
        PROTO_ICMP => {
            let h: [u8; 8] = bytes(ctx, l4).ok_or(Counter::DropMalformed)?;
            let id = be16([h[4], h[5]]);
            match h[0] {
                ICMP_ECHO_REQUEST => {
                    p.tuple.sport = id;
                    Ok(Parsed::Flow(p))
                }
                ICMP_ECHO_REPLY => {
                    p.tuple.dport = id;
                    Ok(Parsed::Flow(p))
                }
                ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAM_PROBLEM => {
                    let e = embedded(ctx, l4 + 8, zone).ok_or(Counter::PassUnmatched)?;
                    Ok(Parsed::IcmpError(p, e))
                }
                _ => Err(Counter::PassUnmatched),
            }
        }
        _ => Err(Counter::PassUnmatched),
    }
}

/// Parses the IPv4 header + first L4 bytes embedded in an ICMP error.
#[inline(always)]
fn embedded(ctx: &TcContext, l3: usize, zone: u16) -> Option<Embedded> {
    let (l4, proto, saddr, daddr, _) = ipv4(ctx, l3)?;
    let h: [u8; 8] = bytes(ctx, l4)?;
    let mut t = Tuple { saddr, daddr, sport: 0, dport: 0, proto, _pad0: 0, zone };
    let mut l4_csum = None;
    match proto {
        PROTO_TCP => {
            t.sport = be16([h[0], h[1]]);
            t.dport = be16([h[2], h[3]]);
            if bytes::<2>(ctx, l4 + 16).is_some() {
                l4_csum = Some(l4 + 16);
            }
        }
        PROTO_UDP => {
            t.sport = be16([h[0], h[1]]);
            t.dport = be16([h[2], h[3]]);
            if h[6] != 0 || h[7] != 0 {
                l4_csum = Some(l4 + 6);
            }
        }
        PROTO_ICMP => {
            let id = be16([h[4], h[5]]);
            match h[0] {
                ICMP_ECHO_REQUEST => t.sport = id,
                ICMP_ECHO_REPLY => t.dport = id,
                _ => return None,
            }
            l4_csum = Some(l4 + 2);
        }
        _ => return None,
    }
    Some(Embedded { l3, l4, tuple: t, l4_csum })
}

/// Reads `N` bytes at `off` (bounds-checked direct access).
#[inline(always)]
pub fn read<const N: usize>(ctx: &TcContext, off: usize) -> Option<[u8; N]> {
    bytes(ctx, off)
}
