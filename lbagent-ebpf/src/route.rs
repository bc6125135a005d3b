//! Where a packet leaves the namespace, from the kernel's FIB
//! (`bpf_fib_lookup`, Linux 4.18): SNAT rules are keyed on the *egress*
//! interface, like iptables' `-o net1`, so traffic routed back into the VPC
//! is not SNAT'ed, and nothing addressed to the namespace itself is; and a
//! packet the namespace addressed to itself but that belongs elsewhere (an
//! ICMP error about a SNAT'ed packet) is sent out directly (`forward`).
//!
//! The fast path (`next_hop`, on when the agent sets
//! `NAT_CFG_FAST_PATH`, its default): a translated packet the namespace would
//! forward is handed straight to its egress interface, as a router would
//! send it (TTL decremented, IP checksum updated), instead of climbing the
//! namespace's IP stack (routing, netfilter hooks). It leaves with
//! `bpf_redirect_neigh` (Linux 5.10) toward the next hop the FIB named: the
//! kernel's neighbour layer writes the Ethernet header, so an entry that is
//! stale is probed and a next hop whose MAC changed is learnt again, exactly
//! as for a packet the stack forwards. A next hop the FIB has no valid
//! entry for is the stack's to resolve (it queues the packet and answers
//! host-unreachable when resolution fails). The FIB's own MAC answer is
//! not used: it hands out a stale entry's address forever, since nothing
//! that bypasses the neighbour layer ever moves the entry on to a probe.
//!
//! What the stack must decide takes the stack: local delivery, no route, an
//! unresolved next hop, an IPv6 next hop of an IPv4 route, a FIB refusal (among them its own device-MTU check), TTL 1 or less (the
//! stack sends time-exceeded), and a packet that does not fit the egress
//! interface's MTU from `egress_mtu` (the smaller of the link MTU and the
//! route MTUs through it, as `ip_forward` checks it, written by the agent;
//! no entry: the stack): a TCP GSO packet by the size of the segments it
//! becomes, any other by its length, with no slack; other GSO packets. The stack then sends
//! frag-needed for DF or fragments. The egress interface's programs (clsact
//! egress: QoS, the egress companion) still see the packet.

use aya_ebpf::{
    EbpfContext,
    bindings::{
        __sk_buff, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_NOT_FWDED, BPF_FIB_LKUP_RET_SUCCESS,
        bpf_fib_lookup as FibParams, bpf_redir_neigh,
    },
    helpers::{bpf_fib_lookup, bpf_redirect_neigh},
    programs::TcContext,
};
use lbagent_common::{MtuKey, PROTO_TCP, Tuple};

use crate::{hdr::tcp, maps::EGRESS_MTU, parse::Packet, tc::zone};

const AF_INET: u8 = 2;
/// `struct bpf_fib_lookup` is 64 bytes: eight words.
const FIB_WORDS: usize = 8;
/// `struct bpf_redir_neigh` is 20 bytes: five 32-bit words.
const NH_WORDS: usize = 5;

pub enum Route {
    /// Delivered to the namespace itself.
    Local,
    /// Forwarded out of this interface.
    Out(u32),
    /// No route (the kernel will drop it) or a lookup the FIB refused.
    Unknown,
}

impl Route {
    /// The interface SNAT rules are looked up with: the egress one, or the
    /// ingress one when the FIB cannot tell; `None` for local delivery.
    #[inline(always)]
    pub fn snat_ifindex(&self, ingress: u32) -> Option<u32> {
        match self {
            Route::Local => None,
            Route::Out(i) => Some(*i),
            Route::Unknown => Some(ingress),
        }
    }
}

/// The route of a packet with tuple `t` that arrived on `ingress`.
#[inline(always)]
pub fn route(ctx: &TcContext, t: &Tuple, ingress: u32) -> Route {
    let mut words = core::mem::MaybeUninit::uninit();
    match lookup(ctx, t.proto, t.saddr, t.daddr, ingress, &mut words) {
        (BPF_FIB_LKUP_RET_SUCCESS | BPF_FIB_LKUP_RET_NO_NEIGH, params) => Route::Out(params.ifindex),
        (BPF_FIB_LKUP_RET_NOT_FWDED, _) => Route::Local,
        _ => Route::Unknown,
    }
}

/// Sends the packet out of the interface the FIB names for `daddr`,
/// through the neighbour layer (`TC_ACT_REDIRECT`); `None` when the FIB has
/// no route out.
#[inline(always)]
pub fn forward(ctx: &TcContext, proto: u8, saddr: [u8; 4], daddr: [u8; 4], ingress: u32) -> Option<i32> {
    let mut words = core::mem::MaybeUninit::uninit();
    let (rc, params) = lookup(ctx, proto, saddr, daddr, ingress, &mut words);
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return None;
    }
    Some(redirect(&hop_of(params)?))
}

/// Where the fast path sends a translated packet: the egress interface and
/// the next hop on it (the gateway of the route, or the destination).
pub struct Hop {
    pub ifindex: u32,
    /// The next hop's IPv4 address, as the packet holds addresses.
    pub via: u32,
}

/// The hop the FIB answered: after a lookup that found a route out, its
/// `ifindex` is the egress interface and its destination the next hop.
/// `None` for an IPv4 route via an IPv6 next hop (the FIB answers family
/// `AF_INET6`): the stack forwards those.
#[inline(always)]
fn hop_of(params: &FibParams) -> Option<Hop> {
    if params.family != AF_INET {
        return None;
    }
    // SAFETY: the helper wrote the destination union as IPv4 (the family
    // checked above).
    Some(Hop { ifindex: params.ifindex, via: unsafe { params.__bindgen_anon_4.ipv4_dst } })
}

/// The fast path's next hop for packet `p` (TTL `ttl`) translated to `to`
/// (see the module docs); `None`: let the stack forward or deliver it. The
/// packet is not touched: `redirect` names the hop and the rewrite
/// decrements the TTL with the tuple (`rewrite::rewrite`).
#[inline(always)]
pub fn next_hop(ctx: &TcContext, p: &Packet, to: &Tuple, ttl: u8) -> Option<Hop> {
    if ttl <= 1 {
        return None;
    }
    let mut words = core::mem::MaybeUninit::uninit();
    let (rc, params) = lookup(ctx, to.proto, to.saddr, to.daddr, p.ifindex, &mut words);
    // A neighbour entry the FIB calls valid (reachable, or stale: the
    // neighbour layer probes it); every other answer is the stack's: an
    // entry to resolve (the stack queues the packet, and answers
    // host-unreachable if resolution fails), local, unreachable, and the
    // helper's device-MTU check (FRAG_NEEDED; it has 4 bytes of slack and
    // passes every GSO packet, hence `fits`).
    if rc != BPF_FIB_LKUP_RET_SUCCESS {
        return None;
    }
    let hop = hop_of(params)?;
    // SAFETY: a lookup in a map the program owns, by a key on the stack.
    let mtu = unsafe { EGRESS_MTU.get(&MtuKey { zone: zone(), _pad: 0, ifindex: hop.ifindex }) }?;
    if !fits(ctx, p, *mtu) {
        return None;
    }
    Some(hop)
}

/// Whether every packet that `p` becomes on the wire is at most `mtu`
/// bytes of IPv4: a TCP GSO packet's segments (its `gso_size` of payload
/// behind the IP and TCP headers), any other packet whole. Any other GSO
/// packet does not: UDP GSO may be a tunnel's (VXLAN, Geneve), whose
/// segments carry inner headers that Linux 5.10 does not let the program
/// see (`gso_type`); the stack knows how it splits.
#[inline(always)]
fn fits(ctx: &TcContext, p: &Packet, mtu: u32) -> bool {
    let skb = ctx.as_ptr() as *const __sk_buff;
    // SAFETY: the context pointer of a TC program is a valid __sk_buff;
    // `gso_size` is a plain field of it (readable since Linux 5.7).
    let gso_size = unsafe { (*skb).gso_size };
    let l3_len = (p.l4 - p.l3) as u32;
    if gso_size == 0 {
        // Ethernet padding of a short frame counts too: only short frames
        // have any, and they fit.
        return ctx.len() <= mtu.saturating_add(p.l3 as u32);
    }
    if p.tuple.proto != PROTO_TCP {
        return false;
    }
    let l4_len = match crate::parse::read::<1>(ctx, p.l4 + tcp::DOFF) {
        Some([doff]) => u32::from(doff >> 4) * 4,
        None => return false,
    };
    gso_size + l3_len + l4_len <= mtu
}

/// Names the hop's interface as where the packet goes once the program
/// returns (`TC_ACT_REDIRECT`), through the neighbour layer with the hop's
/// address as the next hop.
#[inline(always)]
pub fn redirect(hop: &Hop) -> i32 {
    let mut nh = core::mem::MaybeUninit::<bpf_redir_neigh>::uninit();
    let words = nh.as_mut_ptr() as *mut u32;
    // SAFETY: `struct bpf_redir_neigh` is five 32-bit words (the family,
    // then the address union); each store is inside it. Volatile word
    // stores: a plain initialiser becomes a `memset` call the BPF target
    // lacks.
    unsafe {
        core::ptr::write_volatile(words, AF_INET as u32);
        core::ptr::write_volatile(words.add(1), hop.via);
        for i in 2..NH_WORDS {
            core::ptr::write_volatile(words.add(i), 0);
        }
    }
    // SAFETY: `nh` is initialised above, its size passed with it; the
    // helper copies it before returning.
    unsafe { bpf_redirect_neigh(hop.ifindex, nh.as_mut_ptr(), NH_WORDS as i32 * 4, 0) as i32 }
}

/// One FIB lookup (input, as if the packet arrived on `ingress`) in `words`,
/// the 64 bytes of `struct bpf_fib_lookup` (zeroed here, word by word);
/// returns the helper's code and the filled parameters.
#[inline(always)]
fn lookup<'a>(
    ctx: &TcContext,
    proto: u8,
    saddr: [u8; 4],
    daddr: [u8; 4],
    ingress: u32,
    words: &'a mut core::mem::MaybeUninit<[u64; FIB_WORDS]>,
) -> (u32, &'a FibParams) {
    let base = words.as_mut_ptr() as *mut u64;
    for i in 0..FIB_WORDS {
        // SAFETY: `i` < FIB_WORDS, inside `words`. Volatile word stores: a
        // plain zeroing could become a `memset` call the BPF target lacks.
        unsafe { core::ptr::write_volatile(base.add(i), 0) };
    }
    let params = base as *mut FibParams;
    // SAFETY: `params` points at 64 initialised bytes, the size and
    // alignment of `struct bpf_fib_lookup`; the helper reads and writes only
    // inside them.
    let rc = unsafe {
        (*params).family = AF_INET;
        (*params).l4_protocol = proto;
        (*params).ifindex = ingress;
        (*params).__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(saddr);
        (*params).__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(daddr);
        bpf_fib_lookup(ctx.as_ptr(), params, core::mem::size_of::<FibParams>() as i32, 0)
    };
    // SAFETY: as above.
    (rc as u32, unsafe { &*params })
}
