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
//! send it (TTL decremented, IP checksum updated, the next hop's MAC
//! addresses), instead of climbing the namespace's IP stack (routing,
//! netfilter hooks, neighbour lookup). Anything the FIB does not answer
//! with a complete next hop takes the stack: local delivery, no route, an
//! unresolved neighbour (the stack resolves it for the next packets), a
//! packet larger than the egress MTU (the stack sends frag-needed or
//! fragments), TTL 1 or less (the stack sends time-exceeded). The egress
//! interface's programs (clsact egress: QoS, the egress companion) still
//! see the packet.

use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_NOT_FWDED, BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibParams,
    },
    helpers::{bpf_fib_lookup, bpf_redirect},
    programs::TcContext,
};
use lbagent_common::Tuple;

use crate::rewrite::ETH_ADDRS;

const AF_INET: u8 = 2;
/// `struct bpf_fib_lookup` is 64 bytes: eight words.
const FIB_WORDS: usize = 8;

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

/// Sends the packet out of the interface the FIB names for `daddr`, with
/// that hop's MAC addresses (`TC_ACT_REDIRECT`); `None` when the FIB has no
/// complete answer (no route, or the neighbour is not resolved yet).
#[inline(always)]
pub fn forward(ctx: &TcContext, proto: u8, saddr: [u8; 4], daddr: [u8; 4], ingress: u32) -> Option<i32> {
    let mut words = core::mem::MaybeUninit::uninit();
    let (rc, params) = lookup(ctx, proto, saddr, daddr, ingress, &mut words);
    if rc != BPF_FIB_LKUP_RET_SUCCESS {
        return None;
    }
    set_macs(ctx, params).ok()?;
    // SAFETY: bpf_redirect takes plain integers.
    Some(unsafe { bpf_redirect(params.ifindex, 0) } as i32)
}

/// Writes the next hop's MAC addresses the FIB answered into the Ethernet
/// header, in one store.
#[inline(always)]
fn set_macs(ctx: &TcContext, params: &FibParams) -> Result<(), i64> {
    ctx.store(0, &macs(params), 0)
}

/// The FIB's MAC addresses as the Ethernet header holds them: destination
/// first (the FIB's answer holds the source first).
#[inline(always)]
fn macs(params: &FibParams) -> [u8; ETH_ADDRS] {
    // SAFETY: the helper filled the MAC union on success (callers check).
    let macs = unsafe { params.__bindgen_anon_6.__bindgen_anon_2 };
    let mut addrs = [0u8; ETH_ADDRS];
    addrs[..6].copy_from_slice(&macs.dmac);
    addrs[6..].copy_from_slice(&macs.smac);
    addrs
}

/// Where the fast path sends a translated packet: the egress interface and
/// the Ethernet addresses for it.
pub struct Hop {
    pub ifindex: u32,
    pub macs: [u8; ETH_ADDRS],
}

/// The fast path's next hop for a packet with TTL `ttl` translated to `to`
/// (see the module docs); `None`: let the stack forward or deliver it. The
/// packet is not touched: `redirect` names the interface and the rewrite
/// writes the hop with the tuple (`rewrite::rewrite`).
#[inline(always)]
pub fn next_hop(ctx: &TcContext, to: &Tuple, ttl: u8, ingress: u32) -> Option<Hop> {
    if ttl <= 1 {
        return None;
    }
    let mut words = core::mem::MaybeUninit::uninit();
    let (rc, params) = lookup(ctx, to.proto, to.saddr, to.daddr, ingress, &mut words);
    // Success only: the MTU check is the helper's (an skb too big for the
    // egress device, GSO aside, is FRAG_NEEDED), as are local and
    // unreachable destinations and unresolved neighbours.
    if rc != BPF_FIB_LKUP_RET_SUCCESS {
        return None;
    }
    Some(Hop { ifindex: params.ifindex, macs: macs(params) })
}

/// Sends the packet (its hop written) out of the hop's interface.
#[inline(always)]
pub fn redirect(hop: &Hop) -> i32 {
    // SAFETY: bpf_redirect takes plain integers.
    unsafe { bpf_redirect(hop.ifindex, 0) as i32 }
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
