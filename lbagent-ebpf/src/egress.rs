//! The namespace's egress: what the namespace itself sends.
//!
//! ICMP errors it generates while forwarding a packet the ingress program
//! translated (frag needed on a smaller MTU, TTL exceeded) quote the
//! *translated* header; the sender only knows the original one, so PMTU
//! discovery and traceroute would break. They are translated back here like
//! errors from a peer.
//!
//! Connections of the namespace's own sockets (a load balancer's health
//! probes from its VIP, a gateway's own traffic) get conntrack entries like
//! translated flows, so a client flow can never be given their tuple; a
//! socket whose tuple a client flow already holds has its source port moved
//! instead (as Linux NATs a local connection that clashes). Their answers
//! come back through the ingress program's conntrack hit.
//!
//! On `lo`: an ICMP error the namespace generates about a SNAT'ed packet is
//! addressed to the SNAT address (the namespace's own) and would loop back
//! and die. Translated (outer destination back to the real sender), it is
//! sent straight out of the interface the FIB names (`route::forward`), so
//! path MTU discovery and traceroute work for SNAT'ed hosts too.
//!
//! Forwarded packets (no socket) pass untouched: the ingress program did
//! the work.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, programs::TcContext};
use lbagent_common::*;

use crate::{
    conntrack::{self, Lookup, NewFlow},
    counters::count,
    hdr::tcp,
    icmp_error::{self, Side, rewrite_error},
    parse::{Embedded, Frag, Kind, Packet, Parsed, ip_proto, parse},
    qos,
    rewrite::{Store, rewrite},
    route,
    tc::{TC_ACT_OK, TC_ACT_SHOT, zone},
    verdict::verdict,
};

/// Lowest source port a clashing local connection moves to.
const LOCAL_PORT_MIN: u16 = 1024;
/// `lo` in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

#[inline(always)]
pub fn process(ctx: &TcContext) -> i32 {
    // QoS first, on the packet as it leaves (an EIP after SNAT).
    // Most of what leaves was forwarded and needs no clock: QoS reads it
    // only for a packet a rule limits.
    if qos::police(ctx, zone(), QOS_EGRESS, conntrack::now) {
        return TC_ACT_SHOT;
    }
    // A forwarded packet that is not ICMP needs nothing here (the ingress
    // program translated it); telling it apart costs two context reads and
    // one byte, where parsing it would cost the whole parse.
    if !from_socket(ctx) && ip_proto(ctx).is_some_and(|proto| proto != PROTO_ICMP) {
        return TC_ACT_OK;
    }
    match parse(ctx, zone()) {
        Ok(Parsed::IcmpError(p, e)) => {
            if p.ifindex == LOOPBACK_IFINDEX {
                looped_error(ctx, &p, &e)
            } else {
                icmp_error::translate(ctx, &p, &e, Side::Egress)
            }
        }
        Ok(Parsed::Flow(p)) => {
            if p.frag == Frag::None && from_socket(ctx) {
                own_connection(ctx, &p)
            } else {
                TC_ACT_OK
            }
        }
        _ => TC_ACT_OK,
    }
}

/// An ICMP error on `lo`: about a flow we translated, it is translated and
/// sent out to the flow's real endpoint; anything else stays local.
#[inline(always)]
fn looped_error(ctx: &TcContext, p: &Packet, e: &Embedded) -> i32 {
    let Some(entry) = conntrack::peek(&e.tuple.reversed(), conntrack::now()) else { return TC_ACT_OK };
    let x = entry.xlate;
    // The error goes where the quoted packet came from: the flow's endpoint.
    let to = if p.tuple.daddr == e.tuple.saddr { x.daddr } else { p.tuple.daddr };
    if rewrite_error(ctx, p, e, &x).is_none() {
        return verdict(Counter::DropRewriteFailed);
    }
    count(Counter::IcmpErrorsLocalTranslated);
    if to == p.tuple.daddr {
        return TC_ACT_OK;
    }
    match route::forward(ctx, p.tuple.proto, p.tuple.saddr, to, p.ifindex) {
        Some(rc) => rc,
        // No route or neighbour yet: the error is lost, as a router's would be.
        None => verdict(Counter::PassedUnmatched),
    }
}

/// Whether a socket of the namespace sent the packet. Forwarded packets
/// have none once the stack took them in (`ip_rcv` orphans them); a packet
/// the fast path redirected from an ingress hook (`route::next_hop`)
/// may still carry the socket of the host in another namespace that sent
/// it, but it was received: its ingress interface is set, a local one's
/// is 0.
#[inline(always)]
fn from_socket(ctx: &TcContext) -> bool {
    let skb = ctx.as_ptr() as *const __sk_buff;
    // SAFETY: the context pointer of a TC program is a valid __sk_buff; the
    // verifier turns this read into a (nullable) socket pointer we only test.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    // SAFETY: as above; a plain field of the context.
    let received = unsafe { (*skb).ingress_ifindex } != 0;
    !sk.is_null() && !received
}

/// Tracks (and if it clashes, moves) a connection the namespace opens.
#[inline(always)]
fn own_connection(ctx: &TcContext, p: &Packet) -> i32 {
    let now = conntrack::now();
    let x = match conntrack::lookup(p, now) {
        Lookup::Hit(e) => e.xlate,
        Lookup::Miss { .. } => {
            // Only what opens a connection: a SYN (or SYN-ACK of a local
            // listener), a UDP datagram, an echo request.
            let opens = match p.kind {
                Kind::Ports => p.tuple.proto != PROTO_TCP || p.tcp.flags & tcp::SYN != 0,
                Kind::EchoRequest => true,
                _ => false,
            };
            if !opens {
                return TC_ACT_OK;
            }
            let f = NewFlow {
                xlate: p.tuple,
                flags: CT_F_LOCAL,
                dnat_rule: 0,
                snat_rule: 0,
                port_min: LOCAL_PORT_MIN,
                port_max: u16::MAX,
                random: false,
                least: false,
            };
            match conntrack::create(p, &f, now) {
                Ok(c) => {
                    count(Counter::LocalFlows);
                    c.xlate
                }
                Err(c) => return verdict(c),
            }
        }
    };
    match rewrite(ctx, p, &x, false, Store::Fields) {
        Ok(()) => TC_ACT_OK,
        Err(_) => verdict(Counter::DropRewriteFailed),
    }
}
