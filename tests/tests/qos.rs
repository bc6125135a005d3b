//! QoS: the limiter in the program (`lbagent-ebpf/src/qos.rs`),
//! its maps (`lbagent_common::qos`) and their writer (`dataplane/qos.rs`).
//!
//! Program tests run the classifier on crafted frames (`BPF_PROG_TEST_RUN`
//! delivers them on `lo`, ifindex 1): a burst passes then drops at the tail,
//! ECN-capable TCP is CE-marked past half the burst with a correct
//! checksum, other TCP sees one isolated early drop, small packets get
//! headroom, a segment dropped once passes when it is resent (and a loss
//! probe after a silence), the priority ladder picks the right bucket, and a rate change
//! keeps the bucket's clock.

use lbagent::dataplane::{attach::Direction, qos::QosZone};
use lbagent_common::*;
use lbagent_tests::{
    engine::{TC_ACT_OK, TC_ACT_SHOT, TestZone},
    fixture::{LO, ZONE, engine, tcp, udp},
    packet::{ACK, Ip, L4, checksum, frame, verify},
};

const EIP: [u8; 4] = [198, 51, 100, 10];
const PEER: [u8; 4] = [203, 0, 113, 7];
const VPC: [u8; 4] = [10, 0, 1, 2];
const BUCKET_EIP: u32 = 900;
const BUCKET_GW: u32 = 901;
const BUCKET_ALL: u32 = 902;
/// The tests of this file run one at a time: the rate measurements must not
/// share the two CPUs with another test's packet loops.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The EIP rule's rate: slow (a 1 442-byte packet costs 115 ms), so the time
/// the test runs take (slow on a loaded CI machine) barely drains the bucket.
const RATE: u64 = 100_000;

/// 1 400-byte UDP to the EIP (1 442 bytes on the wire).
fn big_udp(src: [u8; 4]) -> Vec<u8> {
    frame(&Ip::new(src, EIP), &udp(4000, 5000, &[7u8; 1400]))
}

/// A frame with its TOS byte set (IP checksum recomputed).
fn with_tos(mut f: Vec<u8>, tos: u8) -> Vec<u8> {
    f[15] = tos;
    f[24] = 0;
    f[25] = 0;
    let ihl = ((f[14] & 0x0f) as usize) * 4;
    let c = checksum(&f[14..14 + ihl]);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    f
}

fn eip_rule(priority: u32) -> QosZone {
    eip_rule_at(priority, RATE)
}

/// The EIP rule at `rate` bit/s.
fn eip_rule_at(priority: u32, rate: u64) -> QosZone {
    let mut z = QosZone::default();
    z.eips.insert((EIP, QOS_INGRESS), QosEip { bucket: BUCKET_EIP, priority, flags: 0, _pad0: 0 });
    z.buckets.insert(BUCKET_EIP, qos_config(rate, 0));
    z.finish(LO);
    z
}

/// A rate so slow (a 1 454-byte frame costs 11.6 s) that the bucket does
/// not drain while a test sends a burst's worth of frames, even under TCG
/// (at `RATE`, 116 ms a frame, a VM's program runs drained it as fast as
/// they filled it).
const CRAWL: u64 = 1_000;

fn stats(e: &TestZone, bucket: u32) -> QosStats {
    e.tables.qos_stats().unwrap().get(&bucket).copied().unwrap_or_default()
}

/// Sends `f` `n` times; returns how many passed.
fn passed(e: &mut TestZone, f: &[u8], n: usize) -> usize {
    (0..n).filter(|_| e.run_on(Direction::Ingress, f).unwrap().0 == TC_ACT_OK).count()
}

#[test]
fn a_burst_passes_then_the_tail_drops_uncharged() {
    let _serial = serial();
    let Some(mut e) = engine() else { return };
    e.tables.sync_qos(ZONE, &eip_rule(1)).unwrap();
    let f = big_udp(PEER);
    let wire = f.len() as u64;
    // The default burst (the floor): floor / wire bytes pass.
    let fit = (QOS_BURST_FLOOR / wire) as usize;
    let n = passed(&mut e, &f, fit + 20);
    assert!((fit..=fit + 1).contains(&n), "{n} passed, expected {fit} (+1 for time passing)");
    let st = stats(&e, BUCKET_EIP);
    assert_eq!(st.passed_packets as usize, n);
    assert_eq!(st.passed_bytes, n as u64 * wire, "layer-2 bytes");
    assert_eq!(st.dropped_packets as usize, fit + 20 - n);
    // Dropped packets were not charged: the backlog is what passed.
    let backlog = e.tables.qos_dump().unwrap().state[0].1.clock_ns - lbagent::dataplane::tables::monotonic_ns();
    let cost = wire * 8_000_000_000 / RATE;
    // (Real time has passed since: the test runs, a second or two at most.)
    assert!(backlog <= n as u64 * cost && backlog + 2_000_000_000 >= n as u64 * cost, "backlog {backlog} ns");
    // Unlimited traffic (not to the EIP) passes and is not counted.
    let other = frame(&Ip::new(PEER, VPC), &udp(4000, 5000, &[7u8; 1400]));
    assert_eq!(passed(&mut e, &other, 50), 50);
    assert_eq!(stats(&e, BUCKET_EIP).passed_packets as usize, n);
}

/// A GSO packet is charged with the headers of every segment it becomes,
/// whether its `gso_segs` is set (a local sender's) or still 0 (a VM's,
/// through a tap): segments are counted from `gso_size`.
#[test]
fn a_gso_packet_is_charged_per_segment_even_without_gso_segs() {
    let _serial = serial();
    let Some(mut e) = engine() else { return };
    e.tables.sync_qos(ZONE, &eip_rule(1)).unwrap();
    // 2 800 bytes of UDP payload in segments of 1 400: two datagrams, each
    // with its own Ethernet, IP and UDP headers (42 bytes) on the wire.
    let f = frame(&Ip::new(PEER, EIP), &udp(4000, 5000, &[7u8; 2800]));
    let one = f.len() as u64 + 42;
    for (segs, what) in [(2, "gso_segs set"), (0, "gso_segs 0")] {
        let before = stats(&e, BUCKET_EIP).passed_bytes;
        let (rc, _) = e.run_gso(&f, 1400, segs).unwrap();
        assert_eq!(rc, TC_ACT_OK, "{what}");
        assert_eq!(stats(&e, BUCKET_EIP).passed_bytes - before, one, "{what}: charged per segment");
    }
}

#[test]
fn past_half_the_burst_tcp_gets_one_signal_a_quarter_burst_and_acks_pass() {
    let _serial = serial();
    let Some(mut e) = engine() else { return };
    e.tables.sync_qos(ZONE, &eip_rule_at(1, CRAWL)).unwrap();
    let data = frame(&Ip::new(PEER, EIP), &tcp(ACK, 4000, 80, &[1u8; 1400]));
    let ect = with_tos(data.clone(), 0x02);
    verify(&ect).unwrap();
    let fit = (QOS_BURST_FLOOR / data.len() as u64) as usize;
    // ECN-capable: passes to the tail; one packet is marked CE past half
    // the burst, and no other within a quarter burst (one signal a round is
    // all TCP answers).
    let mut marked = Vec::new();
    for i in 0..fit {
        let (v, out) = e.run_on(Direction::Ingress, &ect).unwrap();
        assert_eq!(v, TC_ACT_OK);
        verify(&out).unwrap();
        if out[15] & 3 == 3 {
            marked.push(i);
            assert_eq!(out[15], 0x03, "only the ECN bits change");
        }
    }
    let half = fit / 2;
    assert_eq!(marked.len(), 1, "one mark a quarter burst: {marked:?} of {fit}");
    assert!((half - 1..=half + 2).contains(&marked[0]), "marked at {marked:?} of {fit}");
    assert_eq!(stats(&e, BUCKET_EIP).marked_packets, 1);
    // Full-size segments pass to the tail (within a quarter burst of the
    // mark: no early drop): the one more that fits, then the tail …
    let tail: Vec<u32> = (0..2).map(|_| e.run_on(Direction::Ingress, &data).unwrap().0).collect();
    assert_eq!(tail, [TC_ACT_OK, TC_ACT_SHOT], "the last segment in the burst, then the tail");
    // … where a small ACK of another flow (no drop of its own to be spared
    // as a resend of) still passes: the headroom.
    let ack = frame(&Ip::new(PEER, EIP), &tcp(ACK, 4001, 80, &[]));
    assert_eq!(e.run_on(Direction::Ingress, &ack).unwrap().0, TC_ACT_OK);

    // Not ECN-capable, on a fresh bucket: one isolated early drop past half
    // the burst (not a run of drops), then packets pass again to the tail.
    let mut z = eip_rule_at(1, CRAWL);
    z.eips.clear();
    z.buckets.clear();
    e.tables.sync_qos(ZONE, &z).unwrap();
    e.tables.sync_qos(ZONE, &eip_rule_at(1, CRAWL)).unwrap();
    let verdicts: Vec<u32> = (0..fit + 5).map(|_| e.run_on(Direction::Ingress, &data).unwrap().0).collect();
    let first_drop = verdicts.iter().position(|v| *v == TC_ACT_SHOT).unwrap();
    assert!((half - 1..=half + 2).contains(&first_drop), "first drop at {first_drop} of {fit}");
    assert_eq!(verdicts[first_drop + 1], TC_ACT_OK, "early drops are isolated: {verdicts:?}");
}

/// A full-size TCP segment from the peer to the EIP at sequence number `seq`.
fn segment(seq: u32) -> Vec<u8> {
    segment_of(seq, 1400)
}

/// A TCP segment from the peer to the EIP with `len` bytes of payload.
fn segment_of(seq: u32, len: usize) -> Vec<u8> {
    frame(&Ip::new(PEER, EIP), &L4::Tcp { sport: 4000, dport: 80, seq, ack: 2000, flags: ACK, payload: vec![1u8; len] })
}

#[test]
fn a_flow_loses_one_segment_per_round_and_never_a_resend_or_a_probe() {
    let _serial = serial();
    let Some(mut e) = engine() else { return };
    e.tables.sync_qos(ZONE, &eip_rule(1)).unwrap();
    // Fill the bucket to its tail with UDP.
    let fit = (QOS_BURST_FLOOR / big_udp(PEER).len() as u64) as usize;
    passed(&mut e, &big_udp(PEER), fit + 2);
    let verdict = |e: &mut TestZone, seq: u32| e.run_on(Direction::Ingress, &segment(seq)).unwrap().0;
    let s = 1_000_000u32;
    assert_eq!(verdict(&mut e, s), TC_ACT_SHOT, "new data at the tail is dropped");
    // Segments that pass beyond the tail (all charged).
    let mut beyond = 2;
    assert_eq!(verdict(&mut e, s), TC_ACT_OK, "its resend passes: a second loss would cost a timeout");
    assert_eq!(verdict(&mut e, s + 700), TC_ACT_OK, "a resend cut differently starts inside dropped data");
    // At this rate a full frame takes longer than the drop spacing to
    // drain: new data right after a drop is not spared (it would pin the
    // backlog at the allowance's edge, where resends are lost).
    const { assert!(RATE < QOS_SPACING_MIN_BPS) };
    assert_eq!(verdict(&mut e, s + 1400), TC_ACT_SHOT, "below the spacing rate new data is dropped");
    assert_eq!(verdict(&mut e, s + 2000), TC_ACT_OK, "the resend of the second drop passes too");
    beyond += 1;
    // A GSO packet after a silence shorter than its own cost at the rate
    // is paced new data (BBR sends 64 KB packets milliseconds apart), not a
    // probe.
    std::thread::sleep(std::time::Duration::from_nanos(2 * QOS_PROBE_GAP_NS));
    assert_eq!(
        e.run_on(Direction::Ingress, &segment_of(s + 6200, 2000)).unwrap().0,
        TC_ACT_SHOT,
        "a packet over a full frame after a silence shorter than its cost is no loss probe"
    );
    // A flow not seen at the tail for the probe gap is probing (tail loss
    // probe): its first segment passes.
    std::thread::sleep(std::time::Duration::from_nanos(2 * QOS_PROBE_GAP_NS));
    assert_eq!(verdict(&mut e, s + 8200), TC_ACT_OK, "the first segment after a silence passes");
    beyond += 1;
    // What passes beyond the tail is charged and bounded: one more burst.
    let extra = (0..2 * fit).filter(|_| verdict(&mut e, s) == TC_ACT_OK).count();
    assert!(
        (fit - 2..=fit + 2).contains(&(beyond + extra)),
        "{beyond} + {extra} segments passed beyond the tail, expected about {fit}"
    );
    // `lbagent maps qos_drops` shows the flow's latest drop.
    let (drops, _) = lbagent::cli::maps::render(&e.tables, MAP_QOS_DROPS.name).unwrap();
    assert!(
        drops.contains(&format!(
            "bucket {BUCKET_EIP}    203.0.113.7:4000 -> 198.51.100.10:80 dropped up to seq {}",
            s + 8200
        )),
        "{drops}"
    );
    // Another flow's drop does not vouch for this flow's data.
    let other = frame(
        &Ip::new([203, 0, 113, 8], EIP),
        &L4::Tcp { sport: 4000, dport: 80, seq: s, ack: 2000, flags: ACK, payload: vec![1u8; 1400] },
    );
    assert_eq!(e.run_on(Direction::Ingress, &other).unwrap().0, TC_ACT_SHOT);
}

/// At a rate where a full frame drains within `QOS_DROP_SPACING_NS`, a
/// flow loses one segment per round: new data right after its drop passes
/// (up to a full frame), and once the drop is older than the spacing the
/// next new data is dropped again. The bucket is large and filled into its
/// small-packet headroom, so that it stays past the tail (for ≥ 100 ms at
/// this rate) while the test sleeps.
#[test]
fn above_the_spacing_rate_new_data_right_after_a_drop_passes() {
    let _serial = serial();
    let Some(mut e) = engine() else { return };
    let rate = 2 * QOS_SPACING_MIN_BPS;
    let mut z = eip_rule(1);
    z.buckets.insert(BUCKET_EIP, qos_config(rate, 8 << 20));
    e.tables.sync_qos(ZONE, &z).unwrap();
    let small = frame(&Ip::new(PEER, EIP), &udp(4000, 5000, &[7u8; 40]));
    for f in [big_udp(PEER), small] {
        let mut n = 0;
        while passed(&mut e, &f, 1) == 1 {
            n += 1;
            assert!(n < 100_000, "the bucket does not fill");
        }
    }
    let verdict = |e: &mut TestZone, seq: u32| e.run_on(Direction::Ingress, &segment(seq)).unwrap().0;
    let s = 1_000_000u32;
    assert_eq!(verdict(&mut e, s), TC_ACT_SHOT, "new data at the tail is dropped");
    let dropped = std::time::Instant::now();
    assert_eq!(
        verdict(&mut e, s + 1400),
        TC_ACT_OK,
        "new data right after a drop passes: one loss per round trip is all TCP reacts to"
    );
    // Only up to a full frame: a (GSO) packet larger than that is not
    // spared (a few would crowd the resends out of the allowance).
    let big = segment_of(s + 2800, 2000);
    assert_eq!(e.run_on(Direction::Ingress, &big).unwrap().0, TC_ACT_SHOT, "a packet over a full frame is not spared");
    // The flow keeps arriving at the tail (resends, each within the probe
    // gap of the last): once the drop is older than the spacing, new data
    // is dropped again.
    while dropped.elapsed() < std::time::Duration::from_nanos(QOS_DROP_SPACING_NS + 300_000) {
        std::thread::sleep(std::time::Duration::from_micros(200));
        assert_eq!(verdict(&mut e, s), TC_ACT_OK, "resends always pass");
    }
    assert_eq!(verdict(&mut e, s + 4800), TC_ACT_SHOT, "a later round loses a segment again");
    // After a silence longer than its own cost at the rate, a GSO packet is
    // a loss probe too (Linux's probe may send new data as one packet).
    std::thread::sleep(std::time::Duration::from_nanos(2 * QOS_PROBE_GAP_NS));
    assert_eq!(
        e.run_on(Direction::Ingress, &segment_of(s + 6200, 2000)).unwrap().0,
        TC_ACT_OK,
        "a packet over a full frame after a silence longer than its cost is a probe"
    );
}

#[test]
fn the_priority_ladder_picks_the_first_matching_rule() {
    let _serial = serial();
    let Some(mut e) = engine() else { return };
    let rule = |bucket, priority, kind, addr: [u8; 4], prefix_len| QosMatch {
        bucket,
        priority,
        addr,
        kind,
        prefix_len,
        _pad0: 0,
    };
    let ladder = |eip_priority: u32| {
        let mut z = eip_rule(eip_priority);
        let h = z.hooks.entry((LO, QOS_INGRESS)).or_default();
        h.count = 2;
        h.rules[0] = rule(BUCKET_GW, 2, QOS_MATCH_SRC, [203, 0, 113, 0], 24);
        h.rules[1] = rule(BUCKET_ALL, 3, QOS_MATCH_ALL, [0; 4], 0);
        z.buckets.insert(BUCKET_GW, qos_config(10_000_000, 0));
        z.buckets.insert(BUCKET_ALL, qos_config(50_000_000, 0));
        z.finish(LO);
        z
    };
    // Whether the program takes the EIP's rule without reading the hook.
    let first = |z: &QosZone| z.eips[&(EIP, QOS_INGRESS)].flags & QOS_EIP_F_FIRST != 0;
    assert!(first(&ladder(1)) && first(&ladder(2)) && !first(&ladder(5)));
    let counted = |e: &TestZone| [BUCKET_EIP, BUCKET_GW, BUCKET_ALL].map(|b| stats(e, b).passed_packets);
    // EIP rule priority 1 beats the gateway's src rule (2) and catch-all (3).
    e.tables.sync_qos(ZONE, &ladder(1)).unwrap();
    passed(&mut e, &big_udp(PEER), 1);
    assert_eq!(counted(&e), [1, 0, 0]);
    // A tie goes to the EIP rule.
    e.tables.sync_qos(ZONE, &ladder(2)).unwrap();
    passed(&mut e, &big_udp(PEER), 1);
    assert_eq!(counted(&e), [2, 0, 0]);
    // EIP rule at priority 5: the src rule matches first.
    e.tables.sync_qos(ZONE, &ladder(5)).unwrap();
    passed(&mut e, &big_udp(PEER), 1);
    assert_eq!(counted(&e), [2, 1, 0]);
    // A source outside the src rule falls to the catch-all (3 < 5).
    passed(&mut e, &big_udp([192, 0, 2, 1]), 1);
    assert_eq!(counted(&e), [2, 1, 1]);
    // Not to the EIP: only gateway rules apply.
    passed(&mut e, &frame(&Ip::new(PEER, VPC), &udp(1, 2, &[0u8; 100])), 1);
    assert_eq!(counted(&e), [2, 2, 1]);
    // Unbinding the EIP's policy removes its bucket, config, state and stats.
    let mut z = ladder(5);
    z.eips.clear();
    z.buckets.remove(&BUCKET_EIP);
    z.finish(LO);
    assert_eq!(z.info, QosZoneInfo { eip_ifindex: [0, 0], hooks: 1, _pad0: 0 });
    e.tables.sync_qos(ZONE, &z).unwrap();
    let d = e.tables.qos_dump().unwrap();
    assert!(d.config.iter().all(|(b, _)| *b != BUCKET_EIP) && d.state.iter().all(|(b, _)| *b != BUCKET_EIP));
    assert_eq!(e.tables.qos_zone(ZONE).unwrap(), z);
    // Clearing the zone removes everything and traffic is unlimited.
    e.tables.sync_qos(ZONE, &QosZone::default()).unwrap();
    let d = e.tables.qos_dump().unwrap();
    assert!(d.zones.is_empty() && d.hooks.is_empty() && d.eips.is_empty() && d.config.is_empty());
    assert_eq!(passed(&mut e, &big_udp(PEER), 200), 200);
}

#[test]
fn a_rate_change_keeps_the_bucket_and_applies_at_once() {
    let _serial = serial();
    let Some(mut e) = engine() else { return };
    e.tables.sync_qos(ZONE, &eip_rule(1)).unwrap();
    let f = big_udp(PEER);
    let fit = (QOS_BURST_FLOOR / f.len() as u64) as usize;
    passed(&mut e, &f, fit / 2);
    let clock = |e: &TestZone| e.tables.qos_dump().unwrap().state[0].1.clock_ns;
    let before = clock(&e);
    // 0.1 → 100 Mbit/s: same bucket, same clock, the new cost at once.
    let mut z = eip_rule(1);
    z.buckets.insert(BUCKET_EIP, qos_config(100_000_000, 0));
    let changes = e.tables.sync_qos(ZONE, &z).unwrap();
    assert!(changes.iter().any(|c| c.contains("100000000 bit/s")), "{changes:?}");
    assert_eq!(clock(&e), before, "the rate change reset the bucket");
    // The backlog charged at 0.1 Mbit/s (~5 s) is held to the new burst
    // (100 ms at 100 Mbit/s): after that long, full-size packets pass again,
    // where the old rate would still drop them for seconds.
    let burst_ns = qos_config(100_000_000, 0).burst_ns;
    assert!(clock(&e) - lbagent::dataplane::tables::monotonic_ns() > burst_ns, "precondition: a long backlog");
    let _ = e.run_on(Direction::Ingress, &f).unwrap();
    std::thread::sleep(std::time::Duration::from_nanos(burst_ns + 20_000_000));
    assert_eq!(passed(&mut e, &f, 20), 20, "the new rate did not apply at once");
}

#[test]
fn zones_without_rules_pay_one_lookup_and_are_never_limited() {
    let _serial = serial();
    let Some(mut e) = engine() else { return };
    let f = big_udp(PEER);
    assert_eq!(passed(&mut e, &f, 300), 300);
    assert!(e.tables.qos_stats().unwrap().is_empty());
    // Another zone's rules do not apply here.
    let z = eip_rule(1);
    e.tables.sync_qos(ZONE + 1, &z).unwrap();
    assert_eq!(passed(&mut e, &f, 300), 300);
    e.tables.sync_qos(ZONE + 1, &QosZone::default()).unwrap();
}

// ---- Real traffic through a NAT gateway (iperf3, mixed offloads) ----

mod traffic {
    use std::time::Duration;

    use super::serial;
    use lbagent_common::{MAP_QOS_EIPS, MAP_QOS_HOOKS, MAP_QOS_STATS, MAP_QOS_ZONES};
    use lbagent_tests::{
        gateway::{GwBed, INTERNET_IP},
        rate::{IperfClient, IperfServer, rx_rate},
        require_root,
    };

    const FIP1: &str = "198.51.100.10";
    const FIP2: &str = "198.51.100.11";
    const PORT: u16 = 5201;

    /// Two VPC hosts with FIPs eip1 → .21 and eip2 → .22.
    fn bed() -> Option<GwBed> {
        if !require_root() {
            return None;
        }
        Some(GwBed::new(&["10.10.0.21", "10.10.0.22"]).unwrap())
    }

    /// The gateway with both FIPs; `eip1`/`eip2`/`gw` name the policies
    /// bound (empty = none); `policies` is the `qos_policies` list.
    fn state(b: &GwBed, eip1: &str, eip2: &str, gw: &str, policies: &str) -> String {
        let bind = |p: &str| if p.is_empty() { String::new() } else { format!(", qos_policy: {p}") };
        let gw_policy = if gw.is_empty() { String::new() } else { format!("    qos_policy: {gw}\n") };
        b.state(&format!(
            "{gw_policy}    eips:\n      - {{name: eip1, ip: {FIP1}{}}}\n      - {{name: eip2, ip: {FIP2}{}}}\n    \
             fips: [{{eip: eip1, internal_ip: 10.10.0.21}}, {{eip: eip2, internal_ip: 10.10.0.22}}]\nqos_policies:\n{policies}",
            bind(eip1),
            bind(eip2)
        ))
    }

    /// An unshared EIP policy limiting both directions to `mbps`.
    fn eip_policy(name: &str, mbps: &str) -> String {
        format!(
            "  - name: {name}\n    binding: eip\n    rules:\n      - {{name: in, direction: ingress, rate_mbps: \"{mbps}\", burst_mb: \"0.2\", priority: 1}}\n      - {{name: out, direction: egress, rate_mbps: \"{mbps}\", burst_mb: \"0.2\", priority: 1}}\n"
        )
    }

    fn check(what: &str, got_bps: f64, mbps: f64, low: f64, high: f64) {
        let ratio = got_bps / (mbps * 1e6);
        eprintln!("{what}: {:.2} Mbit/s at layer 2 = {:.1} % of {mbps} Mbit/s", got_bps / 1e6, ratio * 100.0);
        assert!((low..=high).contains(&ratio), "{what}: {:.1} % of the limit, expected {low}–{high}", ratio * 100.0);
    }

    /// A flow (UDP offered at twice the limit, or one TCP flow): the rate it
    /// gets must be within `low`–`high` of the limit. Above is a failure at
    /// once; below can be the sender starved of CPU on a loaded 2-core
    /// machine (CI runs measured UDP at 83 % and TCP at 69.9 % while every
    /// other flow held its rate), so a low result is measured again, twice
    /// at most, and every try is printed.
    fn check_retrying(what: &str, mbps: f64, low: f64, high: f64, mut measure_once: impl FnMut() -> f64) {
        for attempt in 1..=3 {
            let got = measure_once();
            let ratio = got / (mbps * 1e6);
            if ratio >= low || attempt == 3 {
                return check(what, got, mbps, low, high);
            }
            eprintln!(
                "{what}: {:.1} % of the limit on try {attempt} (sender starved?); measuring again",
                ratio * 100.0
            );
        }
    }

    /// Layer-2 rate at `rx_ns` of an iperf3 flow `from` → `to` (extra args),
    /// measured after `skip` for `window`.
    fn measure(from: &str, to: &str, rx_ns: &str, extra: &[&str], skip: f64, window: f64) -> f64 {
        let secs = (skip + window + 1.0).ceil() as u32;
        let client = IperfClient::start(from, to, PORT, secs, extra).unwrap();
        std::thread::sleep(Duration::from_secs_f64(skip));
        let r = rx_rate(rx_ns, "eth0", Duration::from_secs_f64(window)).unwrap();
        client.finish().unwrap();
        r
    }

    /// The sender's congestion control for TCP flows (the machine's default
    /// may be BBR, which ignores ECN: docs/qos.md, *TCP*).
    const TCP: [&str; 2] = ["-C", "cubic"];
    /// TCP is measured over a longer window: one remaining retransmission
    /// timeout (≥ 200 ms) costs a 3 s window ~7 % of the rate.
    const TCP_WINDOW: f64 = 5.0;

    /// UDP and one TCP flow (ECN on) are held to the rate both ways, at 10
    /// and 100 Mbit/s.
    #[test]
    fn eip_limits_hold_their_rate_both_ways() {
        let _serial = serial();
        let Some(mut b) = bed() else { return };
        let (inet, vpc) = (b.internet.ns.name.clone(), b.vpc[0].ns.name.clone());
        b.internet.ns.sysctl("net.ipv4.tcp_ecn", "1").unwrap();
        b.vpc[0].ns.sysctl("net.ipv4.tcp_ecn", "1").unwrap();
        let _s_vpc = IperfServer::start(&vpc, PORT).unwrap();
        let _s_inet = IperfServer::start(&inet, PORT).unwrap();
        for mbps in [10.0, 100.0] {
            let st = state(&b, "p1", "", "", &eip_policy("p1", &format!("{mbps}")));
            b.apply(&st);
            let offered = format!("{}M", 2.0 * mbps);
            let udp = ["-u", "-b", offered.as_str(), "-l", "1400"];
            // Ingress (to the EIP, before DNAT): internet → .21.
            check_retrying(&format!("ingress UDP at {mbps}"), mbps, 0.90, 1.05, || {
                measure(&inet, FIP1, &vpc, &udp, 1.5, 3.0)
            });
            // One TCP flow (CUBIC, Linux's default; ECN on) gets close to its
            // rate: its resends are never dropped twice, so it seldom stalls
            // in a retransmission timeout (it got 44–89 % at 100 Mbit/s while
            // they were). Bounds are generous (one CI run measured 79.8 %);
            // the precise figures are the benchmark's.
            check_retrying(&format!("ingress TCP (ECN) at {mbps}"), mbps, 0.70, 1.05, || {
                measure(&inet, FIP1, &vpc, &TCP, 1.5, TCP_WINDOW)
            });
            // Without ECN only drops slow the sender: the case that stalled
            // (about 50 % at 100 Mbit/s before resends were protected).
            b.internet.ns.sysctl("net.ipv4.tcp_ecn", "0").unwrap();
            check_retrying(&format!("ingress TCP (no ECN) at {mbps}"), mbps, 0.65, 1.05, || {
                measure(&inet, FIP1, &vpc, &TCP, 1.5, TCP_WINDOW)
            });
            b.internet.ns.sysctl("net.ipv4.tcp_ecn", "1").unwrap();
            // Egress (from the EIP, after SNAT): .21 → internet.
            check_retrying(&format!("egress UDP at {mbps}"), mbps, 0.90, 1.05, || {
                measure(&vpc, INTERNET_IP, &inet, &udp, 1.5, 3.0)
            });
            check_retrying(&format!("egress TCP (ECN) at {mbps}"), mbps, 0.70, 1.05, || {
                measure(&vpc, INTERNET_IP, &inet, &TCP, 1.5, TCP_WINDOW)
            });
        }
        // The limit's counters: passed, marked and dropped on both buckets.
        let t = b.bed.reconciler.realizer.engine.tables().unwrap();
        let stats = t.qos_stats().unwrap();
        assert_eq!(stats.len(), 2, "{stats:?}");
        assert!(stats.values().all(|s| s.passed_bytes > 0 && s.dropped_packets > 0), "{stats:?}");
        assert!(stats.values().any(|s| s.marked_packets > 0), "ECN-capable TCP was never marked: {stats:?}");
    }

    /// 10 → 50 → 10 Mbit/s on a running UDP flow, applied through the
    /// reconciler; an open TCP connection through the same EIP carries on.
    #[test]
    fn a_rate_change_applies_live_to_a_running_flow() {
        let _serial = serial();
        let Some(mut b) = bed() else { return };
        let (inet, vpc) = (b.internet.ns.name.clone(), b.vpc[0].ns.name.clone());
        let _server = IperfServer::start(&vpc, PORT).unwrap();
        lbagent_tests::traffic::line_echo_server(&vpc, 7000, "vpc0").unwrap();
        let at = |b: &GwBed, mbps: &str| state(b, "p1", "", "", &eip_policy("p1", mbps));
        let st = at(&b, "10");
        b.apply(&st);
        let conn = lbagent_tests::traffic::OpenConn::open(&inet, format!("{FIP1}:7000").parse().unwrap()).unwrap();
        let client = IperfClient::start(&inet, FIP1, PORT, 13, &["-u", "-b", "100M", "-l", "1400"]).unwrap();
        let window = Duration::from_secs(2);
        std::thread::sleep(Duration::from_millis(1500));
        check("UDP at 10", rx_rate(&vpc, "eth0", window).unwrap(), 10.0, 0.90, 1.05);
        let st = at(&b, "50");
        b.apply(&st);
        std::thread::sleep(Duration::from_millis(500));
        check("same flow at 50", rx_rate(&vpc, "eth0", window).unwrap(), 50.0, 0.90, 1.05);
        let st = at(&b, "10");
        b.apply(&st);
        // Back down: the backlog charged at 50 drains within the burst.
        std::thread::sleep(Duration::from_millis(1000));
        check("same flow back at 10", rx_rate(&vpc, "eth0", window).unwrap(), 10.0, 0.90, 1.05);
        client.finish().expect("the flow ran through every change");
        assert!(conn.ping("still here").unwrap().starts_with("vpc0"), "the TCP connection was reset");
    }

    #[test]
    fn two_eips_are_limited_independently() {
        let _serial = serial();
        let Some(mut b) = bed() else { return };
        let inet = b.internet.ns.name.clone();
        let (v0, v1) = (b.vpc[0].ns.name.clone(), b.vpc[1].ns.name.clone());
        let _s0 = IperfServer::start(&v0, PORT).unwrap();
        let _s1 = IperfServer::start(&v1, PORT).unwrap();
        let policies = format!("{}{}", eip_policy("fast", "2.5"), eip_policy("slow", "0.5"));
        let st = state(&b, "fast", "slow", "", &policies);
        b.apply(&st);
        let c0 = IperfClient::start(&inet, FIP1, PORT, 8, &["-u", "-b", "5M", "-l", "1400"]).unwrap();
        let c1 = IperfClient::start(&inet, FIP2, PORT, 8, &["-u", "-b", "5M", "-l", "1400"]).unwrap();
        // The 0.5 Mbit/s bucket's floor burst takes ~2.1 s to drain.
        std::thread::sleep(Duration::from_secs(3));
        let w = Duration::from_secs(4);
        let r1 = std::thread::spawn({
            let v1 = v1.clone();
            move || rx_rate(&v1, "eth0", w).unwrap()
        });
        let r0 = rx_rate(&v0, "eth0", w).unwrap();
        let r1 = r1.join().unwrap();
        check("eip1 (2.5)", r0, 2.5, 0.90, 1.05);
        check("eip2 (0.5)", r1, 0.5, 0.90, 1.05);
        c0.finish().unwrap();
        c1.finish().unwrap();
    }

    #[test]
    fn the_priority_ladder_holds_with_real_traffic() {
        let _serial = serial();
        let Some(mut b) = bed() else { return };
        let (inet, vpc) = (b.internet.ns.name.clone(), b.vpc[0].ns.name.clone());
        let _server = IperfServer::start(&vpc, PORT).unwrap();
        let gw = "  - name: gw\n    binding: natgw\n    shared: true\n    rules:\n      - {name: from-inet, direction: ingress, interface: net1, match: \"src 198.51.100.0/24\", rate_mbps: 10, burst_mb: \"0.2\", priority: 2}\n      - {name: all, direction: ingress, interface: net1, rate_mbps: 50, burst_mb: \"0.2\", priority: 3}\n";
        let eip = "  - name: e\n    binding: eip\n    rules:\n      - {name: in, direction: ingress, rate_mbps: 2, burst_mb: \"0.2\", priority: 1}\n";
        let udp = ["-u", "-b", "30M", "-l", "1400"];
        let st = state(&b, "e", "", "gw", &format!("{gw}{eip}"));
        b.apply(&st);
        check("EIP rule (priority 1)", measure(&inet, FIP1, &vpc, &udp, 1.5, 3.0), 2.0, 0.90, 1.05);
        // Status, metrics and `lbagent maps` show the bound rules and their counters.
        let mut status = lbagent::daemon::status::Status::default();
        status.refresh(&b.bed.reconciler.applied, &b.bed.reconciler.alloc);
        let doc = serde_json::to_value(&status.document).unwrap();
        let qos = doc["nat_gateways"][0]["qos"].as_array().unwrap().clone();
        assert_eq!(qos.len(), 3, "{qos:?}");
        let eip_rule = qos.iter().find(|q| q["target"] == "eip/eip1").unwrap();
        assert_eq!(eip_rule["rate_bps"], 2_000_000);
        assert_eq!(eip_rule["direction"], "ingress");
        assert!(
            qos.iter().any(|q| q["rule"] == "from-inet" && q["interface"] == "net1" && q["rate_bps"] == 10_000_000)
        );
        let metrics = lbagent::daemon::metrics::render(&b.bed.reconciler.realizer.engine.bpffs, &status).unwrap();
        let key = format!("natgw/{}/qos/eip/eip1/e/in", b.gw);
        let dropped = metrics
            .lines()
            .find(|l| l.starts_with(&format!("lbagent_qos_packets_total{{rule=\"{key}\",outcome=\"dropped\"}}")))
            .unwrap_or_else(|| panic!("no QoS metric for {key}:\n{metrics}"));
        assert!(dropped.rsplit(' ').next().unwrap().parse::<u64>().unwrap() > 0, "{dropped}");
        let t = b.bed.reconciler.realizer.engine.tables().unwrap();
        let (hooks, _) = lbagent::cli::maps::render(&t, MAP_QOS_HOOKS.name).unwrap();
        assert!(hooks.contains("src 198.51.100.0/24"), "{hooks}");
        let (zones, _) = lbagent::cli::maps::render(&t, MAP_QOS_ZONES.name).unwrap();
        assert!(zones.contains("EIP rules: ingress ifindex") && zones.contains("gateway rules 1"), "{zones}");
        let (eips, _) = lbagent::cli::maps::render(&t, MAP_QOS_EIPS.name).unwrap();
        assert!(eips.contains(FIP1) && eips.contains("(before every gateway rule)"), "{eips}");
        let (stats, _) = lbagent::cli::maps::render(&t, MAP_QOS_STATS.name).unwrap();
        assert!(stats.contains("dropped"), "{stats}");
        // Unbinding the EIP's policy: the gateway's src rule (priority 2).
        let st = state(&b, "", "", "gw", &format!("{gw}{eip}"));
        b.apply(&st);
        check("gateway src rule (priority 2)", measure(&inet, FIP1, &vpc, &udp, 1.5, 3.0), 10.0, 0.90, 1.05);
        // Unbinding the gateway's policy: unlimited (well above 10).
        let st = state(&b, "", "", "", &format!("{gw}{eip}"));
        b.apply(&st);
        let r = measure(&inet, FIP1, &vpc, &udp, 1.0, 2.0);
        assert!(r > 25e6, "no limit left, yet {:.1} Mbit/s", r / 1e6);
        let t = b.bed.reconciler.realizer.engine.tables().unwrap();
        assert!(t.qos_zone(b.zone()).unwrap() == Default::default(), "the gateway's QoS entries are gone");
    }
}
