//! The per-packet pipeline.

use aya_ebpf::programs::TcContext;
use lbagent_common::*;

use crate::{
    conntrack::{self, Lookup, NewFlow},
    counters::{count, count_flow, count_refused},
    flow_log, fragment,
    hdr::{ipv4, tcp},
    icmp_error::{self, Side},
    parse::{Frag, Packet, Parsed, parse},
    qos,
    rewrite::{Store, rewrite},
    route::{next_hop, redirect, route},
    rules,
    tc::{TC_ACT_OK, TC_ACT_SHOT, zone},
    verdict::{unmatched, verdict},
};

/// Lowest port a translated flow that is not SNAT'ed moves to on a collision.
const COLLISION_PORT_MIN: u16 = 1024;

#[inline(always)]
pub fn process(ctx: &TcContext) -> i32 {
    count(Counter::Packets);
    // One clock read per packet, shared by QoS and conntrack.
    let now = conntrack::now();
    // QoS first, on the packet as it arrived (an EIP before DNAT).
    if qos::police(ctx, zone(), QOS_INGRESS, || now) {
        return TC_ACT_SHOT;
    }
    match parse(ctx, zone()) {
        Ok(Parsed::Flow(p)) => {
            if p.frag == Frag::Later {
                return fragment::later(ctx, &p);
            }
            if p.frag == Frag::First {
                fragment::record_first(&p, now);
            }
            flow(ctx, &p, now)
        }
        Ok(Parsed::IcmpError(p, e)) => icmp_error::translate(ctx, &p, &e, Side::Ingress),
        Err(c) => verdict(c),
    }
}

#[inline(always)]
fn flow(ctx: &TcContext, p: &Packet, now: u64) -> i32 {
    match conntrack::lookup(p, now) {
        Lookup::Hit(e) => {
            count(if e.flags & CT_F_REPLY != 0 { Counter::TranslatedReply } else { Counter::TranslatedOriginal });
            count_flow(e.dnat_rule, e.snat_rule, ctx.len() as u64);
            if e.flags & CT_F_LOGGED != 0 {
                // Counted first: the packet that closes the flow is in its
                // end record. A FIN or RST of a closing flow: the close, or
                // a late one (the end record is written once).
                flow_log::packet(ctx, p, &e, now);
                if e.state == CT_CLOSING && p.tcp.flags & (tcp::FIN | tcp::RST) != 0 {
                    flow_log::closed(&p.tuple, &e, p.tcp.flags & tcp::RST != 0, now);
                }
            }
            apply(ctx, p, &e.xlate, Store::OneStore)
        }
        Lookup::Miss { expired } => {
            if expired {
                count(Counter::ExpiredFlows);
            }
            new_flow(ctx, p, now)
        }
    }
}

#[inline(always)]
fn new_flow(ctx: &TcContext, p: &Packet, now: u64) -> i32 {
    let t = &p.tuple;
    if !p.may_open() {
        return unmatched(ctx, p);
    }
    let mut f = NewFlow {
        xlate: *t,
        flags: 0,
        dnat_rule: 0,
        snat_rule: 0,
        port_min: COLLISION_PORT_MIN,
        port_max: u16::MAX,
        random: false,
        least: false,
    };
    let mut rule_snat: Option<DnatRule> = None;
    if let Some(hit) = rules::dnat(t, p.has_ports()) {
        f.least = hit.rule.flags & DNAT_F_SCHED_MASK == DNAT_F_SCHED_LEAST;
        if !rules::acl_accepts(&hit.rule, t.saddr) {
            // The listener's ACL refuses this client: no flow, no NAT.
            count_refused(hit.rule.rule_id);
            return verdict(Counter::DropAcl);
        }
        f.xlate.daddr = hit.backend.addr;
        if hit.backend.port != 0 && p.has_ports() {
            f.xlate.dport = hit.backend.port;
        }
        f.flags |= CT_F_DNAT;
        f.dnat_rule = hit.rule.rule_id;
        if hit.rule.flags & DNAT_F_SNAT != 0 && (hit.rule.snat_ifindex == 0 || hit.rule.snat_ifindex == p.ifindex) {
            rule_snat = Some(hit.rule);
        }
    }
    // SNAT rules are keyed on the interface the flow leaves by (after DNAT);
    // nothing delivered to the namespace itself is SNAT'ed.
    let out = route(ctx, &f.xlate, p.ifindex).snat_ifindex(p.ifindex);
    if let Some(s) = out.and_then(|out| rules::snat(p, out)) {
        f.xlate.saddr = s.addr;
        f.flags |= CT_F_SNAT;
        f.snat_rule = s.rule_id;
        f.port_min = s.port_min;
        f.port_max = s.port_max;
        f.random = s.flags & SNAT_F_RANDOM != 0;
    } else if let Some(r) = rule_snat {
        // The rule's own SNAT (hairpin, load balancer paths): replies must
        // come back through us.
        f.xlate.saddr = if r.snat_addr == [0; 4] { t.daddr } else { r.snat_addr };
        f.flags |= CT_F_SNAT;
        f.snat_rule = r.rule_id;
        f.random = r.flags & DNAT_F_SNAT_RANDOM != 0;
    }
    if f.flags == 0 {
        return verdict(Counter::PassedUnmatched);
    }
    let log = flow_log::wanted(t.zone);
    // Only flows with end records carry counts: the others' packets pay
    // for no lookup.
    if log & FLOW_LOG_END != 0 {
        f.flags |= CT_F_LOGGED;
    }
    match conntrack::create(p, &f, now) {
        Ok(c) => {
            let x = c.xlate;
            count(Counter::NewFlows);
            if log != 0 && c.here {
                flow_log::started(log, &x, &f, ctx, p, now);
            }
            aya_log_ebpf::debug!(
                ctx,
                "zone {} new flow proto {} {:i}:{} -> {:i}:{} dnat rule {} snat rule {}",
                t.zone,
                t.proto,
                u32::from_be_bytes(t.saddr),
                t.sport,
                u32::from_be_bytes(t.daddr),
                t.dport,
                f.dnat_rule,
                f.snat_rule
            );
            count_flow(f.dnat_rule, f.snat_rule, ctx.len() as u64);
            apply(ctx, p, &x, Store::Fields)
        }
        Err(c) => {
            aya_log_ebpf::warn!(ctx, "zone {} dropped a new flow: {}", t.zone, c as u32);
            if c == Counter::DropNoFreePort && f.snat_rule != 0 && f.snat_rule != f.dnat_rule {
                // A SNAT rule's port failures (its EIP's ports toward this
                // destination are all held). A DNAT rule's own SNAT (a
                // listener's, a hairpin's) counts none: its `refused` is
                // its ACL's.
                count_refused(f.snat_rule);
            }
            verdict(c)
        }
    }
}

/// Rewrites the packet to `to`; on the fast path (`route.rs`) also
/// decrements the TTL in the same pass and redirects the packet to its
/// next hop. A flow's
/// first packet is rewritten field by field (`Store::Fields`): the new-flow
/// path's stack frame has no room left for the one-store copy under Linux
/// 5.10's limit (512 bytes with the scheduler's global function).
#[inline(always)]
fn apply(ctx: &TcContext, p: &Packet, to: &Tuple, store: Store) -> i32 {
    let hop = if conntrack::config().flags & NAT_CFG_FAST_PATH != 0 {
        crate::parse::read::<1>(ctx, p.l3 + ipv4::TTL).and_then(|[ttl]| next_hop(ctx, p, to, ttl))
    } else {
        None
    };
    // The redirect only names where the packet goes once the program
    // returns TC_ACT_REDIRECT; named first, nothing of the hop stays live
    // across the rewrite (the stack frame is close to Linux 5.10's limit).
    let verdict = hop.as_ref().map_or(TC_ACT_OK, redirect);
    match rewrite(ctx, p, to, hop.is_some(), store) {
        Ok(()) => verdict,
        Err(_) => {
            count(Counter::DropRewriteFailed);
            TC_ACT_SHOT
        }
    }
}
