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
    let want = RuleStats { packets: 3, bytes: (2 * q.len() + a.len()) as u64, acl_drops: 0 };
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
    assert_eq!(e.tables.counter(Counter::DropNoPort).unwrap(), 1);
}
