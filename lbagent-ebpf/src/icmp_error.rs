//! ICMP error translation (destination unreachable, time exceeded, parameter
//! problem). The error carries the header of a packet we translated; the
//! flow is found from that embedded header, then both the outer header and the
//! embedded one are rewritten so each end sees addresses it knows.
//!
//! Checksums: the outer IP header via `l3_csum_replace`; the embedded IP and
//! L4 checksums are recomputed incrementally (RFC 1624) and every changed
//! 16-bit word of the ICMP payload is folded into the ICMP checksum.

use aya_ebpf::programs::TcContext;
use lbagent_common::{Counter, Tuple, csum};

use crate::{
    TC_ACT_OK, TC_ACT_SHOT, conntrack,
    counters::count,
    parse::{Embedded, Kind, Packet, read},
    rewrite::{IP_CSUM, IP_DADDR, IP_SADDR, raw16, raw32, set_addr},
    verdict::unmatched,
};

/// Translates an ICMP error about a tracked flow. The lookup does not touch
/// the flow's state or timer: an error is not traffic of the flow.
#[inline(always)]
pub fn translate(ctx: &TcContext, p: &Packet, e: &Embedded) -> i32 {
    // The embedded packet went the other way: its reverse is this flow direction.
    let x = match conntrack::peek(&e.tuple.reversed(), conntrack::now()) {
        Some(entry) => entry.xlate,
        None => return unmatched(p),
    };
    match rewrite_error(ctx, p, e, &x) {
        Some(()) => {
            count(Counter::IcmpErrorXlated);
            TC_ACT_OK
        }
        None => {
            count(Counter::DropRewrite);
            TC_ACT_SHOT
        }
    }
}

/// Rewrites the outer header toward `x` and the embedded header to `x` reversed.
#[inline(always)]
fn rewrite_error(ctx: &TcContext, p: &Packet, e: &Embedded, x: &Tuple) -> Option<()> {
    let icmp_csum = p.l4 + 2;
    let inner = x.reversed();
    let t = &e.tuple;
    // Read every old checksum before the first write (writes invalidate packet pointers).
    let old_ip_csum = u16::from_ne_bytes(read::<2>(ctx, e.l3 + IP_CSUM)?);
    let old_l4_csum = match e.l4_csum {
        Some(off) => Some((off, u16::from_ne_bytes(read::<2>(ctx, off)?))),
        None => None,
    };

    // Outer header: the error goes to where the flow's packets go; its source
    // is translated only when the flow's endpoint itself sent it.
    if p.tuple.daddr == t.saddr && x.daddr != p.tuple.daddr {
        set_addr(ctx, p.l3 + IP_DADDR, p.l3, p.tuple.daddr, x.daddr, None).ok()?;
    }
    if p.tuple.saddr == t.daddr && x.saddr != p.tuple.saddr {
        set_addr(ctx, p.l3 + IP_SADDR, p.l3, p.tuple.saddr, x.saddr, None).ok()?;
    }

    // Embedded IP header.
    let mut ip_csum = old_ip_csum;
    let mut l4 = old_l4_csum.map(|(_, c)| c).unwrap_or(0);
    let pseudo = e.kind == Kind::Ports;
    if inner.saddr != t.saddr {
        payload_store(ctx, icmp_csum, e.l3 + IP_SADDR, &t.saddr, &inner.saddr)?;
        ip_csum = csum::replace32(ip_csum, t.saddr, inner.saddr);
        if pseudo {
            l4 = csum::replace32(l4, t.saddr, inner.saddr);
        }
    }
    if inner.daddr != t.daddr {
        payload_store(ctx, icmp_csum, e.l3 + IP_DADDR, &t.daddr, &inner.daddr)?;
        ip_csum = csum::replace32(ip_csum, t.daddr, inner.daddr);
        if pseudo {
            l4 = csum::replace32(l4, t.daddr, inner.daddr);
        }
    }
    if ip_csum != old_ip_csum {
        payload_store(ctx, icmp_csum, e.l3 + IP_CSUM, &old_ip_csum.to_ne_bytes(), &ip_csum.to_ne_bytes())?;
    }

    // Embedded ports (or echo id).
    if e.kind == Kind::EchoRequest || e.kind == Kind::EchoReply {
        let (old, new) = if e.kind == Kind::EchoRequest { (t.sport, inner.sport) } else { (t.dport, inner.dport) };
        if old != new {
            payload_store(ctx, icmp_csum, e.l4 + 4, &old.to_be_bytes(), &new.to_be_bytes())?;
            l4 = csum::replace16(l4, raw16(old) as u16, raw16(new) as u16);
        }
    } else if e.kind == Kind::Ports {
        if inner.sport != t.sport {
            payload_store(ctx, icmp_csum, e.l4, &t.sport.to_be_bytes(), &inner.sport.to_be_bytes())?;
            l4 = csum::replace16(l4, raw16(t.sport) as u16, raw16(inner.sport) as u16);
        }
        if inner.dport != t.dport {
            payload_store(ctx, icmp_csum, e.l4 + 2, &t.dport.to_be_bytes(), &inner.dport.to_be_bytes())?;
            l4 = csum::replace16(l4, raw16(t.dport) as u16, raw16(inner.dport) as u16);
        }
    }
    if let Some((off, old)) = old_l4_csum
        && l4 != old
    {
        payload_store(ctx, icmp_csum, off, &old.to_ne_bytes(), &l4.to_ne_bytes())?;
    }
    Some(())
}

/// Stores bytes inside the ICMP payload and folds the change into the ICMP checksum.
#[inline(always)]
fn payload_store<const N: usize>(
    ctx: &TcContext,
    icmp_csum: usize,
    off: usize,
    old: &[u8; N],
    new: &[u8; N],
) -> Option<()> {
    ctx.store(off, new, 0).ok()?;
    if N == 4 {
        let o = raw32([old[0], old[1], old[2], old[3]]);
        let n = raw32([new[0], new[1], new[2], new[3]]);
        ctx.l4_csum_replace(icmp_csum, o, n, 4).ok()
    } else {
        let o = u16::from_ne_bytes([old[0], old[1]]) as u64;
        let n = u16::from_ne_bytes([new[0], new[1]]) as u64;
        ctx.l4_csum_replace(icmp_csum, o, n, 2).ok()
    }
}
