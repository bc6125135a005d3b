//! Counters (`lbagent-ebpf/src/counters.rs`): packets and bytes per rule,
//! drops counted by reason. Program tests (BPF_PROG_TEST_RUN) on the shared
//! fixture (`lbagent_tests::fixture`).

use lbagent_common::*;
use lbagent_tests::{
    engine::{TC_ACT_OK, TC_ACT_SHOT},
    fixture::*,
    packet::{Ip, frame},
};

#[test]
fn rule_stats_count_packets_and_bytes_per_rule() {
    let Some(mut e) = engine() else { return };
    let q = frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"query"));
    let a = frame(&Ip::new(SERVER, SNAT), &udp(5353, 25000, b"longer answer"));
    e.run(&q).unwrap();
    e.run(&a).unwrap();
    e.run(&q).unwrap();
    let stats: std::collections::HashMap<u32, RuleStats> = e.tables.rule_stats().unwrap().into_iter().collect();
    let want = RuleStats { packets: 3, bytes: (2 * q.len() + a.len()) as u64, refused: 0 };
    assert_eq!(stats[&2], want, "DNAT rule udp/53");
    assert_eq!(stats[&10], want, "SNAT rule");
    e.tables.forget_rule_stats(&[2]).unwrap();
    assert!(e.tables.rule_stats().unwrap().iter().all(|(id, _)| *id != 2));
}

#[test]
fn port_exhaustion_drops_and_counts() {
    let Some(mut e) = engine() else { return };
    e.tables.set_snat(&snat((CLIENT, 32), SNAT, (30000, 30000), false, 11)).unwrap();
    let (rc, _) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(1111, 53, b"a"))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    let (rc, _) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(2222, 53, b"b"))).unwrap();
    assert_eq!(rc, TC_ACT_SHOT);
    assert_eq!(e.tables.counter(Counter::DropNoFreePort).unwrap(), 1);
    // Counted under the rule that had no port (status and metrics name it).
    let stats: std::collections::HashMap<u32, RuleStats> = e.tables.rule_stats().unwrap().into_iter().collect();
    assert_eq!(stats.get(&11).map(|s| (s.packets, s.refused)), Some((1, 1)), "{stats:?}");
}

/// The bench's per-packet cost (`TestZone::time`, section 1) must time the
/// path it names on every run. `BPF_PROG_TEST_RUN` with `repeat` runs the
/// program again on the packet it already rewrote: an established flow's
/// packet timed as is matched no flow after the first run, so section 1's
/// "established" column timed unmatched packets. `TestZone::looped_flow`
/// gives a packet whose every run is a translation.
#[test]
fn every_timed_run_of_an_established_flow_is_a_translation() {
    if !lbagent_tests::require_root() {
        return;
    }
    let mut e = lbagent_tests::engine::TestZone::new(ZONE).unwrap();
    let flow = e.looped_flow(ZONE, a(CLIENT), a(VIP), a(SERVER), 1, true).unwrap();
    let count = |e: &lbagent_tests::engine::TestZone, c| e.tables.counter(c).unwrap();
    let (before, unmatched, new) =
        (count(&e, Counter::TranslatedOriginal), count(&e, Counter::PassedUnmatched), count(&e, Counter::NewFlows));
    let ns = e.time(&flow, 1000).unwrap();
    assert!(ns > 0.0, "{ns}");
    assert_eq!(count(&e, Counter::TranslatedOriginal) - before, 1000, "every run translated the packet");
    assert_eq!(count(&e, Counter::PassedUnmatched), unmatched, "no run missed");
    assert_eq!(count(&e, Counter::NewFlows), new, "no run opened a flow");
}
