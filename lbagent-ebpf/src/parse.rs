//! IPv4 parsing with direct packet access. Produces the packet's tuple and the
//! offsets the rewriter needs. Every IPv4 packet gets a tuple: TCP and UDP
//! with their ports, ICMP echo with its identifier, every other protocol (and
//! ICMP types other than echo and errors) address-only with ports 0.
//!
//! Headers outside the linear area are pulled in first (`bpf_skb_pull_data`),
//! so a non-linear skb is parsed like any other. What cannot be an IPv4
//! packet the kernel would accept (truncated headers, bad IHL) is dropped.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, programs::TcContext};
use lbagent_common::{Counter, PROTO_ICMP, PROTO_TCP, PROTO_UDP, Tuple};

pub const ETH_LEN: usize = 14;
/// Offset of the EtherType in the Ethernet header.
pub const ETH_TYPE: usize = 12;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

pub const ICMP_ECHO_REPLY: u8 = 0;
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_ECHO_REQUEST: u8 = 8;
pub const ICMP_TIME_EXCEEDED: u8 = 11;
pub const ICMP_PARAM_PROBLEM: u8 = 12;

/// IPv4 header field offsets.
const IP_TOT_LEN: usize = 2;
const IP_ID: usize = 4;
const IP_FRAG_OFF: usize = 6;
const IP_PROTO: usize = 9;
const IP_MF: u16 = 0x2000;
const IP_OFFSET_MASK: u16 = 0x1fff;
/// TCP header field offsets.
const TCP_SEQ: usize = 4;
pub const TCP_DOFF: usize = 12;
const TCP_FLAGS: usize = 13;
const TCP_WINDOW: usize = 14;
const TCP_OPT_EOL: u8 = 0;
const TCP_OPT_NOP: u8 = 1;
const TCP_OPT_WSCALE: u8 = 3;
/// TCP header without options; a UDP header.
const TCP_FIXED: u32 = 20;
const UDP_LEN: u32 = 8;
/// Most bytes parsing ever reads: Ethernet, IPv4 with options, ICMP, the
/// quoted IPv4 header with options and 20 bytes of its L4 header.
const PARSE_MAX: u32 = (ETH_LEN + 60 + 8 + 60 + 20) as u32;

/// What the L4 identifiers of a tuple are.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// TCP or UDP: source and destination ports.
    Ports,
    /// ICMP echo request: `sport` is the identifier.
    EchoRequest,
    /// ICMP echo reply: `dport` is the identifier.
    EchoReply,
    /// Any other protocol or ICMP type: addresses only, ports 0.
    AddressOnly,
}

/// Where the packet sits in a fragmented datagram.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Frag {
    None,
    /// Offset 0 with more fragments: carries the L4 header.
    First,
    /// Non-zero offset: no L4 header, the flow comes from the `frags` map.
    Later,
}

/// A parsed flow packet.
#[derive(Clone, Copy)]
pub struct Packet {
    /// Offset of the IPv4 header.
    pub l3: usize,
    /// Offset of the L4 header (after IP options).
    pub l4: usize,
    pub tuple: Tuple,
    pub kind: Kind,
    pub frag: Frag,
    /// IPv4 identification (host order).
    pub ip_id: u16,
    pub ifindex: u32,
    pub tcp: TcpInfo,
}

/// The TCP fields conntrack tracks (zero for other protocols).
#[derive(Clone, Copy, Default)]
pub struct TcpInfo {
    pub flags: u8,
    /// Window-scale option of a SYN, or `None`.
    pub wscale: Option<u8>,
    pub seq: u32,
    /// Sequence space the segment uses: payload, plus one for SYN and FIN.
    pub seq_len: u32,
    /// Advertised window (unscaled).
    pub window: u16,
}

impl Packet {
    /// Whether the tuple's ports are real ports the rewriter may change.
    #[inline(always)]
    pub fn has_ports(&self) -> bool {
        self.kind == Kind::Ports
    }

    /// Whether a new flow may start with this packet (not an echo reply).
    #[inline(always)]
    pub fn may_open(&self) -> bool {
        self.kind != Kind::EchoReply
    }
}

/// The header embedded in an ICMP error, as the original packet carried it.
#[derive(Clone, Copy)]
pub struct Embedded {
    pub l3: usize,
    pub l4: usize,
    /// The embedded packet's tuple (in the direction it was sent).
    pub tuple: Tuple,
    pub kind: Kind,
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
    // SAFETY: the N bytes at `off` lie between data and data_end (checked above).
    Some(unsafe { core::ptr::read_unaligned((start + off) as *const [u8; N]) })
}

#[inline(always)]
fn be16(b: [u8; 2]) -> u16 {
    u16::from_be_bytes(b)
}

/// The IPv4 header at `l3`.
#[derive(Clone, Copy)]
struct Ipv4 {
    l4: usize,
    proto: u8,
    saddr: [u8; 4],
    daddr: [u8; 4],
    id: u16,
    frag: Frag,
    /// Bytes after the IP header (total length − header length).
    payload_len: u32,
}

#[inline(always)]
fn ipv4(ctx: &TcContext, l3: usize) -> Option<Ipv4> {
    let h: [u8; 20] = bytes(ctx, l3)?;
    if h[0] >> 4 != 4 {
        return None;
    }
    let ihl = ((h[0] & 0x0f) as usize) * 4;
    if ihl < 20 {
        return None;
    }
    let tot = be16([h[IP_TOT_LEN], h[IP_TOT_LEN + 1]]) as u32;
    let frag_off = be16([h[IP_FRAG_OFF], h[IP_FRAG_OFF + 1]]);
    let frag = if frag_off & IP_OFFSET_MASK != 0 {
        Frag::Later
    } else if frag_off & IP_MF != 0 {
        Frag::First
    } else {
        Frag::None
    };
    Some(Ipv4 {
        l4: l3 + ihl,
        proto: h[IP_PROTO],
        saddr: [h[12], h[13], h[14], h[15]],
        daddr: [h[16], h[17], h[18], h[19]],
        id: be16([h[IP_ID], h[IP_ID + 1]]),
        frag,
        payload_len: tot.saturating_sub(ihl as u32),
    })
}

/// Pulls the headers into the linear area, only when parsing would read
/// past it. A local sender's TCP segment arrives as a clone whose headers
/// are linear and whose payload sits in page fragments; pulling it anyway
/// would copy the shared header (`pskb_expand_head`) and move payload into
/// it on every segment, for nothing (docs/benchmarks.md, *Fast path*).
#[inline(always)]
fn pull_headers(ctx: &TcContext) {
    let len = ctx.len();
    let linear = (ctx.data_end() - ctx.data()) as u32;
    if linear >= len || linear >= reads(ctx) {
        return;
    }
    let want = if len < PARSE_MAX { len } else { PARSE_MAX };
    let _ = ctx.pull_data(want);
}

/// How many bytes from the frame's start `parse` reads directly: Ethernet,
/// the IPv4 header with its options and the fixed part of the TCP or UDP
/// header (a SYN's options are read with a helper). ICMP may quote a
/// header, and a header not linear enough to say: everything, `PARSE_MAX`.
#[inline(always)]
fn reads(ctx: &TcContext) -> u32 {
    let Some(h) = bytes::<{ ETH_LEN + 20 }>(ctx, 0) else { return PARSE_MAX };
    if !is_ipv4(&h) {
        return ETH_LEN as u32;
    }
    let l4 = (ETH_LEN + ((h[ETH_LEN] & 0x0f) as usize) * 4) as u32;
    let frag_off = be16([h[ETH_LEN + IP_FRAG_OFF], h[ETH_LEN + IP_FRAG_OFF + 1]]);
    if frag_off & IP_OFFSET_MASK != 0 {
        return l4;
    }
    match h[ETH_LEN + IP_PROTO] {
        PROTO_TCP => l4 + TCP_FIXED,
        PROTO_UDP => l4 + UDP_LEN,
        PROTO_ICMP => PARSE_MAX,
        _ => l4,
    }
}

#[inline(always)]
pub fn parse(ctx: &TcContext, zone: u16) -> Result<Parsed, Counter> {
    pull_headers(ctx);
    let eth: [u8; ETH_LEN] = bytes(ctx, 0).ok_or(Counter::PassNonIpv4)?;
    if !is_ipv4(&eth) {
        return Err(Counter::PassNonIpv4);
    }
    let l3 = ETH_LEN;
    let ip = ipv4(ctx, l3).ok_or(Counter::DropMalformed)?;
    // SAFETY: the context pointer of a TC program is a valid __sk_buff.
    let ifindex = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ifindex };
    let l4 = ip.l4;
    let mut p = Packet {
        l3,
        l4,
        tuple: Tuple { saddr: ip.saddr, daddr: ip.daddr, sport: 0, dport: 0, proto: ip.proto, _pad0: 0, zone },
        kind: Kind::AddressOnly,
        frag: ip.frag,
        ip_id: ip.id,
        ifindex,
        tcp: TcpInfo::default(),
    };
    if ip.frag == Frag::Later {
        // No L4 header here: the kind is the protocol's; ports come later.
        p.kind = match ip.proto {
            PROTO_TCP | PROTO_UDP => Kind::Ports,
            _ => Kind::AddressOnly,
        };
        return Ok(Parsed::Flow(p));
    }
    match ip.proto {
        PROTO_TCP => {
            let h: [u8; 20] = bytes(ctx, l4).ok_or(Counter::DropMalformed)?;
            p.kind = Kind::Ports;
            p.tuple.sport = be16([h[0], h[1]]);
            p.tuple.dport = be16([h[2], h[3]]);
            let doff = ((h[TCP_DOFF] >> 4) as u32) * 4;
            if doff < 20 {
                return Err(Counter::DropMalformed);
            }
            let flags = h[TCP_FLAGS];
            let mut seq_len = ip.payload_len.saturating_sub(doff);
            if flags & TCP_SYN != 0 {
                seq_len += 1;
            }
            if flags & TCP_FIN != 0 {
                seq_len += 1;
            }
            p.tcp = TcpInfo {
                flags,
                wscale: if flags & TCP_SYN != 0 { wscale_option(ctx, l4, doff as usize) } else { None },
                seq: u32::from_be_bytes([h[TCP_SEQ], h[TCP_SEQ + 1], h[TCP_SEQ + 2], h[TCP_SEQ + 3]]),
                seq_len,
                window: be16([h[TCP_WINDOW], h[TCP_WINDOW + 1]]),
            };
            Ok(Parsed::Flow(p))
        }
        PROTO_UDP => {
            let h: [u8; 8] = bytes(ctx, l4).ok_or(Counter::DropMalformed)?;
            p.kind = Kind::Ports;
            p.tuple.sport = be16([h[0], h[1]]);
            p.tuple.dport = be16([h[2], h[3]]);
            Ok(Parsed::Flow(p))
        }
        PROTO_ICMP => {
            let h: [u8; 8] = bytes(ctx, l4).ok_or(Counter::DropMalformed)?;
            let id = be16([h[4], h[5]]);
            match h[0] {
                ICMP_ECHO_REQUEST => {
                    p.kind = Kind::EchoRequest;
                    p.tuple.sport = id;
                    Ok(Parsed::Flow(p))
                }
                ICMP_ECHO_REPLY => {
                    p.kind = Kind::EchoReply;
                    p.tuple.dport = id;
                    Ok(Parsed::Flow(p))
                }
                ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAM_PROBLEM if ip.frag == Frag::None => {
                    match embedded(ctx, l4 + 8, zone) {
                        Some(e) => Ok(Parsed::IcmpError(p, e)),
                        // Nothing we could translate is quoted: an address-only packet.
                        None => Ok(Parsed::Flow(p)),
                    }
                }
                _ => Ok(Parsed::Flow(p)),
            }
        }
        _ => Ok(Parsed::Flow(p)),
    }
}

/// The window-scale shift in a SYN's options, if present (capped at 14).
/// Options are read with `bpf_skb_load_bytes` (the helper bounds-checks a
/// variable offset itself; direct access at one would need a proof the
/// verifier of 5.10 cannot follow).
#[inline(always)]
fn wscale_option(ctx: &TcContext, l4: usize, doff: usize) -> Option<u8> {
    let mut off = 20;
    // SYNs carry a handful of options (Linux 5, Windows 6 with NOPs); past
    // ten the option is treated as absent (the RST check then fails open).
    for _ in 0..10 {
        if off >= doff {
            return None;
        }
        let [kind, len, value] = ctx.load::<[u8; 3]>(l4 + off).ok()?;
        match kind {
            TCP_OPT_EOL => return None,
            TCP_OPT_NOP => off += 1,
            TCP_OPT_WSCALE => return Some(if value > 14 { 14 } else { value }),
            _ if len < 2 => return None,
            _ => off += len as usize,
        }
    }
    None
}

/// Parses the IPv4 header + first L4 bytes embedded in an ICMP error.
#[inline(always)]
fn embedded(ctx: &TcContext, l3: usize, zone: u16) -> Option<Embedded> {
    let ip = ipv4(ctx, l3)?;
    if ip.frag == Frag::Later {
        return None;
    }
    let l4 = ip.l4;
    let mut t = Tuple { saddr: ip.saddr, daddr: ip.daddr, sport: 0, dport: 0, proto: ip.proto, _pad0: 0, zone };
    let mut l4_csum = None;
    let mut kind = Kind::AddressOnly;
    match ip.proto {
        PROTO_TCP => {
            let h: [u8; 8] = bytes(ctx, l4)?;
            kind = Kind::Ports;
            t.sport = be16([h[0], h[1]]);
            t.dport = be16([h[2], h[3]]);
            if bytes::<2>(ctx, l4 + 16).is_some() {
                l4_csum = Some(l4 + 16);
            }
        }
        PROTO_UDP => {
            let h: [u8; 8] = bytes(ctx, l4)?;
            kind = Kind::Ports;
            t.sport = be16([h[0], h[1]]);
            t.dport = be16([h[2], h[3]]);
            if h[6] != 0 || h[7] != 0 {
                l4_csum = Some(l4 + 6);
            }
        }
        PROTO_ICMP => {
            let h: [u8; 8] = bytes(ctx, l4)?;
            let id = be16([h[4], h[5]]);
            match h[0] {
                ICMP_ECHO_REQUEST => {
                    kind = Kind::EchoRequest;
                    t.sport = id;
                }
                ICMP_ECHO_REPLY => {
                    kind = Kind::EchoReply;
                    t.dport = id;
                }
                // An error about an error (or another type): address-only.
                _ => {}
            }
            if kind != Kind::AddressOnly {
                l4_csum = Some(l4 + 2);
            }
        }
        _ => {}
    }
    Some(Embedded { l3, l4, tuple: t, kind, l4_csum })
}

/// Whether the frame starting with `h` (at least the Ethernet header) is
/// IPv4 (EtherType 0x0800).
#[inline(always)]
pub fn is_ipv4<const N: usize>(h: &[u8; N]) -> bool {
    h[ETH_TYPE] == 0x08 && h[ETH_TYPE + 1] == 0x00
}

/// The protocol of an IPv4 frame, read without parsing it; `None` when it
/// is not IPv4 or its header is not in the linear area yet.
#[inline(always)]
pub fn ip_proto(ctx: &TcContext) -> Option<u8> {
    let h: [u8; ETH_LEN + IP_PROTO + 1] = bytes(ctx, 0)?;
    if !is_ipv4(&h) {
        return None;
    }
    Some(h[ETH_LEN + IP_PROTO])
}

/// Reads `N` bytes at `off` (bounds-checked direct access).
#[inline(always)]
pub fn read<const N: usize>(ctx: &TcContext, off: usize) -> Option<[u8; N]> {
    bytes(ctx, off)
}
