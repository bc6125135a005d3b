//! Rewrites a packet's tuple in place with the kernel's checksum helpers.
//!
//! Address changes update the IPv4 header checksum and, with
//! `BPF_F_PSEUDO_HDR`, the TCP/UDP checksum (its pseudo header covers the
//! addresses; this is also what keeps CHECKSUM_PARTIAL packets right). UDP
//! uses `BPF_F_MARK_MANGLED_0`: a zero ("no checksum") UDP checksum stays zero
//! and a computed zero becomes 0xffff. Checksums are never zeroed.
//!
//! The common shape (an established flow's TCP or UDP packet behind an
//! IPv4 header without options: TTL, protocol, header checksum, addresses
//! and ports are 16 contiguous bytes) takes `rewrite_head`: the bytes are
//! read directly, the header checksum is updated here (RFC 1624), and all
//! of it is written back in one store (the fast path's TTL − 1 included;
//! the neighbour layer writes its Ethernet header); the L4 checksum gets each kind of change
//! (addresses: pseudo header; ports: data) as one precomputed difference.
//! A fast-path DNAT packet makes four helper calls instead of nine; each
//! costs ~15–25 ns, and the rewrite was a third of an established flow's
//! cost (`docs/benchmarks.md`, section 1). The two L4 updates cannot be
//! one: a CHECKSUM_PARTIAL packet's checksum field holds only the pseudo
//! header's sum, which the ports are not part of. Every other shape, and a
//! flow's first packet (`Store::Fields`: the new-flow path's stack frame has
//! no room left for the copy under Linux 5.10's limit, see
//! `tests/tests/static_checks.rs`), is rewritten a field at a time.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use lbagent_common::{
    PROTO_DCCP, PROTO_TCP, PROTO_UDP, PROTO_UDPLITE, Tuple,
    csum::{apply, diff16, diff32},
};

use crate::{
    hdr::{eth, icmp, ipv4, tcp, udp},
    parse::{Frag, Kind, Packet},
};

/// From the TTL to the ports (IPv4 without options): TTL, protocol, header
/// checksum, both addresses, both ports.
const HEAD_LEN: usize = ipv4::MIN_LEN - ipv4::TTL + 4;

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
    ctx.l3_csum_replace(l3 + ipv4::CSUM, raw32(old), raw32(new), 4)?;
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

/// How `rewrite` may write the common shape (module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// In one store.
    OneStore,
    /// Field by field (callers whose stack frame cannot hold the copy).
    Fields,
}

/// Makes the packet's tuple equal `to`; with `hop` (the fast path), also
/// decrements the TTL as a router would.
#[inline(always)]
pub fn rewrite(ctx: &TcContext, p: &Packet, to: &Tuple, hop: bool, store: Store) -> Result<(), i64> {
    if p.frag == Frag::Later {
        // No L4 header in this fragment: the first one carried the checksum.
        rewrite_addresses(ctx, p, to)?;
        return write_hop(ctx, p, hop);
    }
    let t = &p.tuple;
    let (l4csum, flags) = match (p.kind, t.proto) {
        (Kind::Ports, PROTO_TCP) => (Some(p.l4 + tcp::CSUM), 0u64),
        (Kind::Ports, PROTO_UDP) => (Some(p.l4 + udp::CSUM), BPF_F_MARK_MANGLED_0 as u64),
        // Address-only, but their checksums cover the addresses: updated
        // with them (ports untouched). UDP-Lite's 0 (invalid there: it has
        // no "no checksum") is left as it came; a result of 0 is written as
        // 0xffff, its one's-complement twin.
        (Kind::AddressOnly, PROTO_UDPLITE) => (Some(p.l4 + udp::UDPLITE_CSUM), BPF_F_MARK_MANGLED_0 as u64),
        (Kind::AddressOnly, PROTO_DCCP) => (Some(p.l4 + udp::DCCP_CSUM), 0u64),
        _ => (None, 0u64),
    };
    if let Some(csum) = l4csum
        && p.kind == Kind::Ports
        && store == Store::OneStore
        && p.l3 == eth::LEN
        && p.l4 == p.l3 + ipv4::MIN_LEN
    {
        return rewrite_head(ctx, csum, flags, t, to, hop);
    }
    let pseudo = l4csum.map(|c| (c, flags));
    if to.saddr != t.saddr {
        set_addr(ctx, p.l3 + ipv4::SADDR, p.l3, t.saddr, to.saddr, pseudo)?;
    }
    if to.daddr != t.daddr {
        set_addr(ctx, p.l3 + ipv4::DADDR, p.l3, t.daddr, to.daddr, pseudo)?;
    }
    match (p.kind, l4csum) {
        (Kind::EchoRequest, _) if to.sport != t.sport => {
            set_port(ctx, p.l4 + icmp::ECHO_ID, p.l4 + icmp::CSUM, 0, t.sport, to.sport)?
        }
        (Kind::EchoReply, _) if to.dport != t.dport => {
            set_port(ctx, p.l4 + icmp::ECHO_ID, p.l4 + icmp::CSUM, 0, t.dport, to.dport)?
        }
        // TCP and UDP keep their ports at the same offsets.
        (Kind::Ports, Some(csum)) => {
            if to.sport != t.sport {
                set_port(ctx, p.l4 + tcp::SPORT, csum, flags, t.sport, to.sport)?;
            }
            if to.dport != t.dport {
                set_port(ctx, p.l4 + tcp::DPORT, csum, flags, t.dport, to.dport)?;
            }
        }
        _ => {}
    }
    write_hop(ctx, p, hop)
}

/// The hop written field by field, after a field-by-field rewrite: TTL − 1
/// with the header checksum.
#[inline(always)]
fn write_hop(ctx: &TcContext, p: &Packet, hop: bool) -> Result<(), i64> {
    if !hop {
        return Ok(());
    }
    let Some([ttl]) = crate::parse::read::<1>(ctx, p.l3 + ipv4::TTL) else { return Err(-1) };
    let old = [ttl, p.tuple.proto];
    let new = [ttl - 1, p.tuple.proto];
    ctx.store(p.l3 + ipv4::TTL, &new[0], 0)?;
    ctx.l3_csum_replace(p.l3 + ipv4::CSUM, u16::from_ne_bytes(old) as u64, u16::from_ne_bytes(new) as u64, 2)
}

/// Rewrites only the IPv4 addresses (address-only protocols' later
/// fragments): the IP checksum changes, nothing else.
#[inline(always)]
pub fn rewrite_addresses(ctx: &TcContext, p: &Packet, to: &Tuple) -> Result<(), i64> {
    let t = &p.tuple;
    if to.saddr != t.saddr {
        set_addr(ctx, p.l3 + ipv4::SADDR, p.l3, t.saddr, to.saddr, None)?;
    }
    if to.daddr != t.daddr {
        set_addr(ctx, p.l3 + ipv4::DADDR, p.l3, t.daddr, to.daddr, None)?;
    }
    Ok(())
}

/// The common shape's rewrite (module docs): the Ethernet header (no
/// VLAN tag), an IPv4 header without options, the ports right after it;
/// `csum_off` is the L4 checksum. Everything from the TTL to the ports is
/// written in one store.
#[inline(always)]
fn rewrite_head(ctx: &TcContext, csum_off: usize, flags: u64, t: &Tuple, to: &Tuple, hop: bool) -> Result<(), i64> {
    // A direct read (parse pulled the headers in): no helper call. Only
    // this copy is kept on the stack (the differences come from the
    // tuples): the program's frame is close to Linux 5.10's limit.
    let base = eth::LEN + ipv4::TTL;
    let Some(mut head) = crate::parse::read::<HEAD_LEN>(ctx, base) else { return Err(-1) };
    // Offsets in `head`.
    let (ttl_at, csum_at, saddr_at, daddr_at, ports_at) =
        (0, ipv4::CSUM - ipv4::TTL, ipv4::SADDR - ipv4::TTL, ipv4::DADDR - ipv4::TTL, ipv4::MIN_LEN - ipv4::TTL);
    // The header checksum covers the TTL and the addresses (RFC 1624, eqn.
    // 3: HC' = ~(~HC + ~m + m')); the L4 one the addresses (pseudo header)
    // and the ports.
    let addrs = diff32(t.saddr, to.saddr) + diff32(t.daddr, to.daddr);
    let ports = diff16(t.sport.to_be(), to.sport.to_be()) + diff16(t.dport.to_be(), to.dport.to_be());
    let mut ttl = 0;
    if hop {
        let word = u16::from_ne_bytes([head[ttl_at], head[ttl_at + 1]]);
        head[ttl_at] -= 1;
        ttl = diff16(word, u16::from_ne_bytes([head[ttl_at], head[ttl_at + 1]]));
    }
    let hc = u16::from_ne_bytes([head[csum_at], head[csum_at + 1]]);
    let hc = apply(hc, ttl + addrs);
    head[csum_at..csum_at + 2].copy_from_slice(&hc.to_ne_bytes());
    head[saddr_at..saddr_at + 4].copy_from_slice(&to.saddr);
    head[daddr_at..daddr_at + 4].copy_from_slice(&to.daddr);
    head[ports_at..ports_at + 2].copy_from_slice(&to.sport.to_be_bytes());
    head[ports_at + 2..].copy_from_slice(&to.dport.to_be_bytes());
    ctx.store(base, &head, 0)?;
    if t.saddr != to.saddr || t.daddr != to.daddr {
        ctx.l4_csum_replace(csum_off, 0, addrs as u64, flags | BPF_F_PSEUDO_HDR as u64)?;
    }
    if t.sport != to.sport || t.dport != to.dport {
        ctx.l4_csum_replace(csum_off, 0, ports as u64, flags)?;
    }
    Ok(())
}
