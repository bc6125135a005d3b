//! lbagent's TC dataplane: one NAT engine (conntrack + DNAT + SNAT) shared by
//! the VPC load balancer and the VPC NAT gateway.
//!
//! The program runs at clsact *ingress* of every interface of a zone's
//! namespace (a small companion, `lbagent_nat_egress`, at egress). Translating before the routing decision lets the kernel route on
//! the translated destination; replies are matched by their conntrack entry on
//! the interface they come back on. Packet flow of one packet:
//!
//! `parse` → (later fragment? `fragment`) → (ICMP error? `icmp_error`)
//!         → `conntrack` hit → `rewrite`
//!         → miss → `rules` (DNAT, SNAT) → `conntrack::create` → `rewrite`
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
mod egress;
mod fragment;
mod hash;
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
mod verdict;
mod xdp;
mod zone_ct;

use aya_ebpf::{
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

/// The zone (namespace) this program instance serves; set by the loader.
#[unsafe(no_mangle)]
static ZONE: u16 = 0;

#[inline(always)]
pub(crate) fn zone() -> u16 {
    // SAFETY: a read of a static the loader sets before the program runs
    // (volatile, so the compiler does not fold the default 0 in).
    unsafe { core::ptr::read_volatile(&ZONE) }
}

pub(crate) const TC_ACT_OK: i32 = 0;
pub(crate) const TC_ACT_SHOT: i32 = 2;

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
