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

use crate::hdr::{be16_at, eth, icmp, ipv4, tcp, udp};

/// Most bytes parsing ever reads: Ethernet, IPv4 with options, ICMP, the
/// quoted IPv4 header with options and 20 bytes of its L4 header.
const PARSE_MAX: u32 = (eth::LEN + ipv4::MAX_LEN + icmp::LEN + ipv4::MAX_LEN + tcp::MIN_LEN) as u32;

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
    let h = ipv4::Head(bytes(ctx, l3)?);
    if h.version() != 4 {
        return None;
    }
    let ihl = h.header_len();
    if ihl < ipv4::MIN_LEN {
        return None;
    }
    let frag = if h.is_later_fragment() {
        Frag::Later
    } else if h.has_more_fragments() {
        Frag::First
    } else {
        Frag::None
    };
    Some(Ipv4 {
        l4: l3 + ihl,
        proto: h.proto(),
        saddr: h.saddr(),
        daddr: h.daddr(),
        id: h.id(),
        frag,
        payload_len: (h.total_len() as u32).saturating_sub(ihl as u32),
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
    let Some(h) = bytes::<{ eth::LEN + ipv4::MIN_LEN }>(ctx, 0) else { return PARSE_MAX };
    if !eth::is_ipv4(&h) {
        return eth::LEN as u32;
    }
    let ip = ipv4::Head::in_frame(&h);
    let l4 = (eth::LEN + ip.header_len()) as u32;
    if ip.is_later_fragment() {
        return l4;
    }
    match ip.proto() {
        PROTO_TCP => l4 + tcp::MIN_LEN as u32,
        PROTO_UDP => l4 + udp::LEN as u32,
        PROTO_ICMP => PARSE_MAX,
        _ => l4,
    }
}

#[inline(always)]
pub fn parse(ctx: &TcContext, zone: u16) -> Result<Parsed, Counter> {
    pull_headers(ctx);
    let frame: [u8; eth::LEN] = bytes(ctx, 0).ok_or(Counter::PassedNonIpv4)?;
    if !eth::is_ipv4(&frame) {
        return Err(Counter::PassedNonIpv4);
    }
    let l3 = eth::LEN;
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
            let h: [u8; tcp::MIN_LEN] = bytes(ctx, l4).ok_or(Counter::DropMalformed)?;
            p.kind = Kind::Ports;
            p.tuple.sport = be16_at(&h, tcp::SPORT);
            p.tuple.dport = be16_at(&h, tcp::DPORT);
            let doff = ((h[tcp::DOFF] >> 4) as u32) * 4;
            if doff < tcp::MIN_LEN as u32 {
                return Err(Counter::DropMalformed);
            }
            let flags = h[tcp::FLAGS];
            let mut seq_len = ip.payload_len.saturating_sub(doff);
            if flags & tcp::SYN != 0 {
                seq_len += 1;
            }
            if flags & tcp::FIN != 0 {
                seq_len += 1;
            }
            let s = tcp::SEQ;
            p.tcp = TcpInfo {
                flags,
                wscale: if flags & tcp::SYN != 0 { wscale_option(ctx, l4, doff as usize) } else { None },
                seq: u32::from_be_bytes([h[s], h[s + 1], h[s + 2], h[s + 3]]),
                seq_len,
                window: be16_at(&h, tcp::WINDOW),
            };
            Ok(Parsed::Flow(p))
        }
        PROTO_UDP => {
            let h: [u8; udp::LEN] = bytes(ctx, l4).ok_or(Counter::DropMalformed)?;
            p.kind = Kind::Ports;
            p.tuple.sport = be16_at(&h, udp::SPORT);
            p.tuple.dport = be16_at(&h, udp::DPORT);
            Ok(Parsed::Flow(p))
        }
        PROTO_ICMP => {
            let h: [u8; icmp::LEN] = bytes(ctx, l4).ok_or(Counter::DropMalformed)?;
            let id = be16_at(&h, icmp::ECHO_ID);
            match h[icmp::TYPE] {
                icmp::ECHO_REQUEST => {
                    p.kind = Kind::EchoRequest;
                    p.tuple.sport = id;
                    Ok(Parsed::Flow(p))
                }
                icmp::ECHO_REPLY => {
                    p.kind = Kind::EchoReply;
                    p.tuple.dport = id;
                    Ok(Parsed::Flow(p))
                }
                icmp::DEST_UNREACH | icmp::TIME_EXCEEDED | icmp::PARAM_PROBLEM if ip.frag == Frag::None => {
                    match embedded(ctx, l4 + icmp::LEN, zone) {
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
    let mut off = tcp::MIN_LEN;
    // SYNs carry a handful of options (Linux 5, Windows 6 with NOPs); past
    // ten the option is treated as absent (the RST check then fails open).
    for _ in 0..10 {
        if off >= doff {
            return None;
        }
        let [kind, len, value] = ctx.load::<[u8; 3]>(l4 + off).ok()?;
        match kind {
            tcp::OPT_EOL => return None,
            tcp::OPT_NOP => off += 1,
            tcp::OPT_WSCALE => return Some(if value > tcp::WSCALE_MAX { tcp::WSCALE_MAX } else { value }),
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
            // An error quotes at least 8 bytes of the L4 header: the ports;
            // the checksum only when more was quoted.
            let h: [u8; 8] = bytes(ctx, l4)?;
            kind = Kind::Ports;
            t.sport = be16_at(&h, tcp::SPORT);
            t.dport = be16_at(&h, tcp::DPORT);
            if bytes::<2>(ctx, l4 + tcp::CSUM).is_some() {
                l4_csum = Some(l4 + tcp::CSUM);
            }
        }
        PROTO_UDP => {
            let h: [u8; udp::LEN] = bytes(ctx, l4)?;
            kind = Kind::Ports;
            t.sport = be16_at(&h, udp::SPORT);
            t.dport = be16_at(&h, udp::DPORT);
            if h[udp::CSUM] != 0 || h[udp::CSUM + 1] != 0 {
                l4_csum = Some(l4 + udp::CSUM);
            }
        }
        PROTO_ICMP => {
            let h: [u8; icmp::LEN] = bytes(ctx, l4)?;
            let id = be16_at(&h, icmp::ECHO_ID);
            match h[icmp::TYPE] {
                icmp::ECHO_REQUEST => {
                    kind = Kind::EchoRequest;
                    t.sport = id;
                }
                icmp::ECHO_REPLY => {
                    kind = Kind::EchoReply;
                    t.dport = id;
                }
                // An error about an error (or another type): address-only.
                _ => {}
            }
            if kind != Kind::AddressOnly {
                l4_csum = Some(l4 + icmp::CSUM);
            }
        }
        _ => {}
    }
    Some(Embedded { l3, l4, tuple: t, kind, l4_csum })
}

/// The protocol of an IPv4 frame, read without parsing it; `None` when it
/// is not IPv4 or its header is not in the linear area yet.
#[inline(always)]
pub fn ip_proto(ctx: &TcContext) -> Option<u8> {
    let h: [u8; eth::LEN + ipv4::PROTO + 1] = bytes(ctx, 0)?;
    if !eth::is_ipv4(&h) {
        return None;
    }
    Some(h[eth::LEN + ipv4::PROTO])
}

/// Reads `N` bytes at `off` (bounds-checked direct access).
#[inline(always)]
pub fn read<const N: usize>(ctx: &TcContext, off: usize) -> Option<[u8; N]> {
    bytes(ctx, off)
}
