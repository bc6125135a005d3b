//! The proxy side's guard, at clsact egress of a load balancer's host-side
//! link `h…1` (in the host namespace). What leaves there enters the load
//! balancer's namespace at `h…0`, where the engine DNATs the inner address's
//! mapped ports to the VPC backends: only haproxy may open connections that
//! way, or any process on the host could reach the tenant's VPC.
//!
//! The sender is known only here: the veth scrubs `skb->sk` on the way
//! into the namespace. An IPv4 packet passes when its socket is root's (root
//! on the host is trusted: it can enter the namespace anyway; haproxy's
//! master binds the listeners, so the client side of every proxied
//! connection, SYN-ACKs included, is root's; the kernel's reply sockets that
//! send RSTs and TIME_WAIT ACKs are root's) or haproxy's workers'
//! (`proxy_guard[0].uid`: their connections to the backends). Anything else
//! passes only when it cannot open a flow: a TCP segment without SYN (a
//! TIME_WAIT socket has no owner uid; without a SYN no connection ever
//! opens) or an ICMP error, and never a later fragment. Non-IPv4 (ARP)
//! passes. Drops are counted in `proxy_guard_drops`.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, helpers::bpf_get_socket_uid, programs::TcContext};
use lbagent_common::*;

use crate::{
    hdr::{eth, icmp, ipv4, tcp},
    maps::{PROXY_GUARD, PROXY_GUARD_DROPS},
    tc::{TC_ACT_OK, TC_ACT_SHOT},
};

#[inline(always)]
pub fn process(ctx: &TcContext) -> i32 {
    let Ok(ethertype) = ctx.load::<[u8; 2]>(eth::TYPE) else { return TC_ACT_OK };
    if ethertype != eth::P_IP {
        return TC_ACT_OK;
    }
    if trusted(ctx) {
        return TC_ACT_OK;
    }
    if cannot_open(ctx) {
        return TC_ACT_OK;
    }
    if let Some(p) = PROXY_GUARD_DROPS.get_ptr_mut(0) {
        // SAFETY: this CPU's slot of a per-CPU array, valid for the program
        // run; no other CPU touches it.
        unsafe { *p += 1 };
    }
    TC_ACT_SHOT
}

/// Whether a socket of root or of haproxy's workers sent the packet.
#[inline(always)]
fn trusted(ctx: &TcContext) -> bool {
    let skb = ctx.as_ptr() as *mut __sk_buff;
    // SAFETY: the context pointer of a TC program is a valid __sk_buff; the
    // verifier turns this read into a (nullable) socket pointer we only test.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        // Forwarded by the host, or made by the kernel without a socket.
        return false;
    }
    // SAFETY: a helper call on the program's own context; it returns the
    // owner of the packet's full socket (the listener for a SYN-ACK), or
    // the overflow uid when there is none.
    let uid = unsafe { bpf_get_socket_uid(skb) };
    if uid == 0 {
        return true;
    }
    match PROXY_GUARD.get(0) {
        Some(g) => g.flags & PROXY_GUARD_F_UID != 0 && g.uid == uid,
        None => false,
    }
}

/// A first fragment or whole packet that opens nothing: TCP without SYN or
/// with SYN and ACK (a SYN-ACK answers a handshake; under SYN cookies the
/// kernel sends it with no socket), or an ICMP error.
#[inline(always)]
fn cannot_open(ctx: &TcContext) -> bool {
    let Ok(ip) = ctx.load::<[u8; ipv4::MIN_LEN]>(eth::LEN).map(ipv4::Head) else { return false };
    let ihl = ip.header_len();
    if ihl < ipv4::MIN_LEN || ip.is_later_fragment() {
        return false;
    }
    let l4 = eth::LEN + ihl;
    match ip.proto() {
        PROTO_TCP => ctx.load::<u8>(l4 + tcp::FLAGS).is_ok_and(|f| f & tcp::SYN == 0 || f & tcp::ACK != 0),
        PROTO_ICMP => ctx.load::<u8>(l4 + icmp::TYPE).is_ok_and(|t| icmp::ERRORS.contains(&t)),
        _ => false,
    }
}
