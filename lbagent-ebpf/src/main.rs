//! lbagent's TC dataplane: one NAT engine (conntrack + DNAT + SNAT) shared by
//! the VPC load balancer and the VPC NAT gateway.
//!
//! The program runs at clsact *ingress* of every interface of a zone's
//! namespace (a small companion, `lbagent_nat_egress`, at egress).
//! Translating before the routing decision lets the kernel route on the
//! translated destination; replies are matched by their conntrack entry on
//! the interface they come back on. One packet through `nat::process`:
//!
//! ```text
//! qos::police ─drop─▶ TC_ACT_SHOT
//!   └▶ parse ─┬─ later fragment ─▶ fragment::later (the first one's translation)
//!             ├─ ICMP error ─────▶ icmp_error::translate (outer and quoted headers)
//!             └─ flow ─▶ conntrack::lookup ─┬─ hit ──▶ rewrite (+ route::next_hop: the fast path)
//!                                           └─ miss ─▶ rules (ACL, DNAT, SNAT) ─▶ conntrack::create
//!                                                      ─▶ rewrite; nothing to do ─▶ verdict
//! ```
//!
//! Header layout is `hdr/`'s, the zone and the verdicts `tc.rs`'s; this file
//! only declares the modules and the entry points.
#![no_std]
#![no_main]
// The BPF target has no 64-bit `fetch_add` in core; QoS uses the intrinsic
// whose unused result lowers to the 5.10 atomic add (see qos.rs).
#![feature(core_intrinsics)]
#![allow(internal_features)]
// aya's `#[classifier]` entry point takes the kernel's `*mut __sk_buff`; the
// lint fires on that generated function and cannot be silenced on it alone.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

mod atomic;
mod conntrack;
mod counters;
mod ct_gc;
mod egress;
mod flow_log;
mod fragment;
mod hash;
mod hdr;
mod icmp_error;
mod maps;
mod nat;
mod parse;
mod proxy_guard;
mod qos;
mod rewrite;
mod route;
mod rules;
mod sched;
mod tc;
mod verdict;
mod xdp;
mod zone_ct;

use aya_ebpf::{
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

// `inline(always)`: the macro wraps this body in the exported entry point;
// without it LLVM may keep the (large) body as a BPF-to-BPF call.
#[classifier]
#[inline(always)]
pub fn lbagent_nat(ctx: TcContext) -> i32 {
    nat::process(&ctx)
}

/// At clsact egress of the same interfaces: errors the namespace generates.
#[classifier]
#[inline(always)]
pub fn lbagent_nat_egress(ctx: TcContext) -> i32 {
    egress::process(&ctx)
}

/// At clsact egress of a load balancer's host-side link `h…1`: only
/// haproxy (and root) may open connections into the namespace.
#[classifier]
#[inline(always)]
pub fn lbagent_proxy_guard(ctx: TcContext) -> i32 {
    proxy_guard::process(&ctx)
}

/// Conntrack garbage collection, run by the agent on batches of keys
/// (never attached): see `ct_gc.rs`.
#[classifier]
#[inline(always)]
pub fn lbagent_ct_gc(ctx: TcContext) -> i32 {
    ct_gc::collect(&ctx)
}

/// Measurement probe (never attached by the agent): see `xdp.rs`.
#[xdp]
#[inline(always)]
pub fn lbagent_xdp_pass(ctx: XdpContext) -> u32 {
    xdp::pass(&ctx)
}

/// Measurement probe (never attached by the agent): see `xdp.rs`.
#[xdp]
#[inline(always)]
pub fn lbagent_xdp_forward(ctx: XdpContext) -> u32 {
    xdp::forward(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
