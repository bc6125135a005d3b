//! QoS: bandwidth limits by the priority ladder (`docs/qos.md`).
//!
//! Run first on every IPv4 packet, before any translation: at ingress a
//! gateway sees an EIP as the destination (before DNAT), at egress as the
//! source (after SNAT, done at the LAN side's ingress). It reads the few
//! header fields it needs itself, before the engine parses the packet, and
//! leaves nothing behind but its verdict: the verifier then checks the
//! engine once, not once per way through QoS (that tripled the load time of
//! a zone's programs).
//!
//! Classification: `qos_zones[zone]` says whether the zone has any rules (an
//! array lookup: traffic of zones without QoS pays that only) and on which
//! interface EIP rules act; there the packet's EIP is looked up first
//! (`qos_eips`, exact address), and its rule says whether a gateway rule
//! could come before it. `qos_hooks` holds a hook's gateway rules sorted by
//! priority: the first that matches with a lower priority number than the
//! EIP's rule wins, else the EIP's.
//!
//! Bytes are counted as tc counts them: layer-2 length, a GSO packet whole
//! with the headers of each of its segments.
//!
//! The limiter is a virtual clock per bucket (the arithmetic of tc's
//! `act_police` turned around): a packet of `len` layer-2 bytes costs
//! `len × 8e9 / rate` ns; the clock runs ahead of real time by the backlog;
//! a packet that would push the backlog past the burst is dropped and not
//! charged. Past half the burst the bucket gives one congestion signal per
//! quarter burst, a CE mark for an ECN-capable packet and an early drop for
//! other TCP, so TCP backs off before a tail-drop burst; small packets
//! (ACKs, SYNs) get extra headroom and are never dropped early.
//!
//! Counters are per CPU (`qos_stats`): plain adds. Concurrency of the
//! bucket itself (both CPUs on one bucket): kernel 5.10 has atomic add but no
//! fetch-add or compare-exchange, and aya-ebpf has no spin lock, so the
//! charge is an atomic add (never lost) and the decision reads the clock
//! without a lock. Two CPUs may both admit a packet against the same
//! backlog: the burst is exceeded by at most one packet per CPU, and the
//! clock still counts both. Restarting an idle bucket (clock behind real
//! time) is a plain store: a charge racing with it can be lost, at most one
//! packet per CPU per idle-to-busy transition. The timestamp of the last
//! signal is a plain store too: CPUs racing on it may each give a signal
//! within one gap (one extra per CPU at most), or space them differently.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, programs::TcContext};
use lbagent_common::*;

use crate::{
    hdr::{eth, ipv4, tcp, udp},
    maps::{QOS_CONFIG, QOS_DROPS, QOS_EIPS, QOS_HOOKS, QOS_STATE, QOS_STATS, QOS_ZONES},
};

/// Ethernet header and the fixed IPv4 header.
const HEAD_LEN: usize = eth::LEN + ipv4::MIN_LEN;

/// The few header fields QoS needs, read on its own (`ctx.load`, which
/// copes with non-linear packets) before the engine parses the packet: the
/// engine's verification then does not depend on which way QoS went.
#[derive(Clone, Copy)]
struct Head {
    saddr: [u8; 4],
    daddr: [u8; 4],
    proto: u8,
    /// A fragment other than the first (no L4 header).
    later_fragment: bool,
    /// Offset of the L4 header.
    l4: usize,
}

/// The Ethernet and fixed IPv4 header, copied by a helper (`ctx.load`
/// copes with a non-linear packet; reading in place would add a second way
/// through for the verifier to follow, for no measurable gain per packet).
#[inline(always)]
fn header(ctx: &TcContext) -> Option<[u8; HEAD_LEN]> {
    ctx.load::<[u8; HEAD_LEN]>(0).ok()
}

/// Whether the packet is dropped by its bucket (counted in `qos_stats`).
/// `clock` gives the packet's time (`bpf_ktime_get_ns`): the ingress
/// program reads it once per packet for QoS and conntrack alike; it is
/// called only for a packet a rule limits.
#[inline(always)]
pub fn police(ctx: &TcContext, zone: u16, dir: u8, clock: impl Fn() -> u64) -> bool {
    let Some(z) = QOS_ZONES.get(zone as u32) else { return false };
    let eip_if = if dir == QOS_INGRESS { z.eip_ifindex[0] } else { z.eip_ifindex[1] };
    if eip_if == 0 && z.hooks == 0 {
        return false;
    }
    let Some(head) = header(ctx) else { return false };
    if !eth::is_ipv4(&head) {
        return false;
    }
    let ip = ipv4::Head::in_frame(&head);
    // SAFETY: the context pointer of a TC program is a valid __sk_buff.
    let ifindex = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ifindex };
    let h = Head {
        saddr: ip.saddr(),
        daddr: ip.daddr(),
        proto: ip.proto(),
        later_fragment: ip.is_later_fragment(),
        l4: eth::LEN + ip.header_len(),
    };
    let bucket = classify(&h, ifindex, eip_if, z.hooks, zone, dir);
    bucket != 0 && limit(ctx, &h, bucket, clock())
}

#[inline(always)]
fn mask(len: u8) -> u32 {
    if len == 0 { 0 } else { u32::MAX << (32 - len.min(32) as u32) }
}

/// The bucket of the first matching rule on the ladder (0 = unlimited).
///
/// On the EIP interface the EIP's rule comes first (one hash lookup); when
/// no gateway rule of the hook can come before it (`QOS_EIP_F_FIRST`, the
/// common case) that is all. Otherwise the hook's gateway rules are walked
/// up to the EIP rule's priority.
#[inline(always)]
fn classify(p: &Head, ifindex: u32, eip_if: u32, hooks: u32, zone: u16, dir: u8) -> u32 {
    let mut eip = QosEip { bucket: 0, priority: u32::MAX, flags: 0, _pad0: 0 };
    if ifindex == eip_if {
        let addr = if dir == QOS_INGRESS { p.daddr } else { p.saddr };
        let key = QosEipKey { addr, zone, dir, _pad0: 0 };
        // SAFETY: a hash map value, copied out at once.
        if let Some(e) = unsafe { QOS_EIPS.get(&key) } {
            eip = *e;
            if eip.flags & QOS_EIP_F_FIRST != 0 {
                return eip.bucket;
            }
        }
    }
    if hooks == 0 {
        return eip.bucket;
    }
    let key = QosHookKey { ifindex, zone, dir, _pad0: 0 };
    // SAFETY: a hash map value, read-only, valid for this program run.
    let Some(hook) = (unsafe { QOS_HOOKS.get(&key) }) else { return eip.bucket };
    let (saddr, daddr) = (u32::from_be_bytes(p.saddr), u32::from_be_bytes(p.daddr));
    let count = hook.count;
    for (i, r) in hook.rules.iter().enumerate() {
        if i as u32 >= count {
            break;
        }
        if r.priority >= eip.priority {
            break;
        }
        let net = u32::from_be_bytes(r.addr);
        let hit = match r.kind {
            QOS_MATCH_SRC => saddr & mask(r.prefix_len) == net,
            QOS_MATCH_DST => daddr & mask(r.prefix_len) == net,
            _ => true,
        };
        if hit {
            return r.bucket;
        }
    }
    eip.bucket
}

/// What happened to a packet in its bucket.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Passed,
    Marked,
    Dropped,
}

#[inline(always)]
fn limit(ctx: &TcContext, p: &Head, bucket: u32, now: u64) -> bool {
    let Some(c) = QOS_CONFIG.get(bucket) else { return false };
    let Some(st) = QOS_STATE.get_ptr_mut(bucket) else { return false };
    if c.rate_bps == 0 {
        return false;
    }
    let len = wire_len(ctx, p);
    let cost = len * QOS_BYTE_NS_AT_1BPS / c.rate_bps;
    // SAFETY: `st` points at this bucket's map value for the program run;
    // other CPUs update it concurrently (see the module notes).
    let mut clock = unsafe { core::ptr::read_volatile(&(*st).clock_ns) };
    let mut backlog = clock.saturating_sub(now);
    if backlog > 3 * c.burst_ns + c.headroom_ns {
        // Only after a rate increase (the backlog was charged at the old,
        // slower rate; admitted packets, resends included, overshoot two
        // bursts by at most one packet per CPU, and the burst floor is two
        // full-size GSO packets): the
        // bucket is full at the new rate's scale and drains at the new rate
        // from now on.
        backlog = c.burst_ns;
        clock = now + backlog;
        // SAFETY: as above.
        unsafe { core::ptr::write_volatile(&mut (*st).clock_ns, clock) };
    }
    let small = len <= QOS_SMALL_PACKET as u64;
    let room = if small { c.burst_ns + c.headroom_ns } else { c.burst_ns };
    let mut outcome = if backlog > room {
        Outcome::Dropped
    } else if backlog > c.mark_ns && !small {
        signal(ctx, p, st, now, c.early_gap_ns)
    } else {
        Outcome::Passed
    };
    if outcome == Outcome::Dropped
        && p.proto == PROTO_TCP
        && !p.later_fragment
        && spared(ctx, p, bucket, len, cost, c.rate_bps, now)
    {
        // A resend, a loss probe, or a small segment right after the flow's
        // latest loss (`spared`): dropping it would risk a retransmission
        // timeout. It passes, charged, while the backlog is within one more
        // burst beyond the tail: what is spared cannot carry a flow past its
        // rate.
        if backlog <= room + c.burst_ns {
            outcome = Outcome::Passed;
        }
    }
    if outcome != Outcome::Dropped {
        if clock < now {
            // SAFETY: as above.
            unsafe { core::ptr::write_volatile(&mut (*st).clock_ns, now + cost) };
        } else {
            // SAFETY: as above. The plain atomic add of kernel 5.10 (not a
            // fetch-add, 5.12+); the static check of the object guards that.
            unsafe { crate::atomic::add(&raw mut (*st).clock_ns, cost) };
        }
    }
    count(bucket, outcome, len);
    outcome == Outcome::Dropped
}

/// Past half the burst: one congestion signal per `gap` (a quarter burst)
/// for the bucket's TCP, a CE mark if the packet is ECN-capable, else an
/// early drop (also when the mark cannot be written). TCP answers one
/// signal per round trip however many packets carry it, and a mark on
/// every packet past half the burst cut a flow whose round trip is shorter
/// than the gap once per round: on a loaded machine (longer round trips,
/// larger windows) one CUBIC flow with ECN fell to 65–72 % of the rate
/// while the same flow without ECN, signalled at this spacing, held 95 %.
/// Other ECN-capable traffic (QUIC) is marked on every packet and takes no
/// turn (it would use up TCP's), other protocols pass to the tail, and a
/// packet already CE-marked upstream carries its signal already: it passes
/// (counted as marked) without taking the turn.
#[inline(always)]
fn signal(ctx: &TcContext, p: &Head, st: *mut QosBucket, now: u64, gap: u64) -> Outcome {
    let ect = ecn_word(ctx);
    if let Some(word) = ect
        && word[ipv4::TOS] & ipv4::ECN_MASK == ipv4::ECN_CE
    {
        return Outcome::Marked;
    }
    if p.proto != PROTO_TCP {
        return match ect {
            Some(word) if mark_ce(ctx, word) => Outcome::Marked,
            _ => Outcome::Passed,
        };
    }
    // SAFETY: `st` points at this bucket's map value for the program run;
    // other CPUs update it concurrently (see the module notes).
    let last = unsafe { core::ptr::read_volatile(&(*st).last_early_ns) };
    if now.saturating_sub(last) < gap {
        return Outcome::Passed;
    }
    // SAFETY: as above.
    unsafe { core::ptr::write_volatile(&mut (*st).last_early_ns, now) };
    match ect {
        Some(word) if mark_ce(ctx, word) => Outcome::Marked,
        _ => Outcome::Dropped,
    }
}

/// TCP header bytes `spared` reads: ports, sequence number, acknowledgment
/// number and the data offset.
const TCP_HEAD: usize = tcp::DOFF + 1;

/// Whether a TCP segment about to be dropped passes instead (charged; the
/// caller bounds how far past the tail): `qos_drops` keeps, per bucket and
/// TCP flow, the latest drop (where its data ends, when) and when the flow
/// last met the tail. A segment passes when it
/// - resends data the bucket dropped (starts before the recorded end; a
///   resend may cut the data differently: one GSO packet dropped, resent as
///   several);
/// - comes within `QOS_DROP_SPACING_NS` of the flow's latest drop, is no
///   larger than `QOS_FULL_FRAME` (a few GSO packets would use up the
///   allowance the resends need) and the rate drains a full frame within
///   the spacing (`QOS_SPACING_MIN_BPS`): one loss per round trip is all the
///   signal TCP takes, a second risks losing the last segment in flight and
///   a retransmission timeout;
/// - comes after the flow was not seen at the tail for `QOS_PROBE_GAP_NS`
///   (a loss probe after a silence, or the backlog fell below the tail in
///   between) and, if larger than a full frame, for at least its own cost
///   at the rate: Linux's loss probe may send new data as one GSO packet,
///   but a GSO packet that follows the flow's last one sooner than the rate
///   drains it is paced new data (BBR sends 64 KB packets 2–5 ms apart;
///   spared as probes they carried it to the allowance's edge, where its
///   resends were lost).
///
/// Otherwise it is recorded as the flow's latest drop. Only packets about
/// to be dropped come here: while a flow stays past the tail all its
/// segments do, so `seen_us` sees the silences that matter. Two CPUs
/// updating one flow's entry: the last write wins, which at worst forgets
/// one drop.
#[inline(always)]
fn spared(ctx: &TcContext, p: &Head, bucket: u32, len: u64, cost: u64, rate_bps: u64, now: u64) -> bool {
    let Ok(t) = ctx.load::<[u8; TCP_HEAD]>(p.l4) else { return false };
    let (sp, dp, sq) = (tcp::SPORT, tcp::DPORT, tcp::SEQ);
    let key =
        QosDropKey { bucket, saddr: p.saddr, daddr: p.daddr, sport: [t[sp], t[sp + 1]], dport: [t[dp], t[dp + 1]] };
    let seq = u32::from_be_bytes([t[sq], t[sq + 1], t[sq + 2], t[sq + 3]]);
    let seen_us = qos_seen_us(now);
    // SAFETY: a hash map value, copied out at once.
    if let Some(last) = unsafe { QOS_DROPS.get(&key) }.copied() {
        let resend = (seq.wrapping_sub(last.end_seq) as i32) < 0;
        let spaced = rate_bps >= QOS_SPACING_MIN_BPS && now.saturating_sub(last.at_ns) < QOS_DROP_SPACING_NS;
        let silent_us = seen_us.wrapping_sub(last.seen_us) as u64;
        let probe =
            silent_us >= qos_seen_us(QOS_PROBE_GAP_NS) as u64 && (len <= QOS_FULL_FRAME || silent_us << 10 >= cost);
        let passes = resend || probe || (len <= QOS_FULL_FRAME && spaced);
        if passes {
            let _ = QOS_DROPS.insert(&key, &QosDrop { seen_us, ..last }, 0);
            return true;
        }
    }
    let payload = (ctx.len() as usize).saturating_sub(p.l4 + ((t[tcp::DOFF] >> 4) as usize) * 4);
    let end_seq = seq.wrapping_add(payload as u32);
    let _ = QOS_DROPS.insert(&key, &QosDrop { end_seq, seen_us, at_ns: now }, 0);
    false
}

/// The packet's layer-2 length as tc counts it (`qdisc_pkt_len`): a GSO
/// packet is charged whole, with the headers each of its segments will
/// carry on the wire. Its segments are counted from `gso_size`, as the
/// kernel does for a packet it cannot trust: a VM's GSO packets arrive
/// through a tap with `gso_segs` still 0 (charged as one segment, their
/// headers would go uncounted).
#[inline(always)]
fn wire_len(ctx: &TcContext, p: &Head) -> u64 {
    let len = ctx.len() as u64;
    // SAFETY: the context pointer of a TC program is a valid __sk_buff.
    let gso_size = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).gso_size } as u64;
    if gso_size == 0 {
        return len;
    }
    let l4 = match p.proto {
        PROTO_TCP => match ctx.load::<u8>(p.l4 + tcp::DOFF) {
            Ok(b) => ((b >> 4) as u64) * 4,
            Err(_) => tcp::MIN_LEN as u64,
        },
        _ => udp::LEN as u64,
    };
    let headers = p.l4 as u64 + l4;
    let payload = len.saturating_sub(headers);
    let segs = payload.div_ceil(gso_size);
    len + segs.saturating_sub(1) * headers
}

/// The 16-bit word of the IPv4 header holding the TOS (the unit the
/// checksum covers) if the packet is ECN-capable (ECT(0), ECT(1) or
/// already CE).
#[inline(always)]
fn ecn_word(ctx: &TcContext) -> Option<[u8; 2]> {
    let word = ctx.load::<[u8; 2]>(eth::LEN + ipv4::VER_IHL).ok()?;
    (word[ipv4::TOS] & ipv4::ECN_MASK != 0).then_some(word)
}

/// CE-marks an ECN-capable packet whose TOS word is `word` (fixing the IP
/// checksum); true for a packet already marked.
#[inline(always)]
fn mark_ce(ctx: &TcContext, word: [u8; 2]) -> bool {
    let tos = word[ipv4::TOS];
    if tos & ipv4::ECN_MASK == ipv4::ECN_CE {
        return true;
    }
    let new = [word[0], tos | ipv4::ECN_CE];
    if ctx.store(eth::LEN + ipv4::TOS, &new[ipv4::TOS], 0).is_err() {
        return false;
    }
    let csum = eth::LEN + ipv4::CSUM;
    ctx.l3_csum_replace(csum, u16::from_ne_bytes(word) as u64, u16::from_ne_bytes(new) as u64, 2).is_ok()
}

/// Counts the packet in the bucket's stats: this CPU's slot of a per-CPU
/// array, so plain adds (no other CPU writes it).
#[inline(always)]
fn count(bucket: u32, outcome: Outcome, bytes: u64) {
    let Some(s) = QOS_STATS.get_ptr_mut(bucket) else { return };
    // SAFETY: this CPU's value of a per-CPU array entry, valid for the
    // program run; no other CPU touches it.
    unsafe {
        match outcome {
            Outcome::Dropped => {
                (*s).dropped_packets += 1;
                (*s).dropped_bytes += bytes;
            }
            Outcome::Marked => {
                (*s).marked_packets += 1;
                (*s).marked_bytes += bytes;
                (*s).passed_packets += 1;
                (*s).passed_bytes += bytes;
            }
            Outcome::Passed => {
                (*s).passed_packets += 1;
                (*s).passed_bytes += bytes;
            }
        }
    }
}
