//! Rule lookup (`lbagent-ebpf/src/rules.rs`): longest-prefix SNAT, SNAT by
//! egress interface, backend choice per flow, hairpin, unmatched traffic
//! untouched. Program tests (BPF_PROG_TEST_RUN) on the shared fixture
//! (`lbagent_tests::fixture`).

use lbagent_common::*;
use lbagent_tests::{
    engine::TC_ACT_OK,
    fixture::*,
    packet::{self, ACK, Ip, L4, SYN, frame, verify},
};

#[test]
fn longest_prefix_snat_wins() {
    let Some(mut e) = engine() else { return };
    e.tables.set_snat(&snat(([10, 0, 0, 0], 16), [10, 0, 2, 16], (1024, 65535), false, 20)).unwrap();
    e.tables.set_snat(&snat(([10, 0, 1, 0], 25), [10, 0, 2, 25], (1024, 65535), false, 21)).unwrap();
    let (_, out) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(3000, 53, b"x"))).unwrap();
    assert_eq!(packet::summary(&out).src, [10, 0, 2, 25]);
    let (_, out) = e.run(&frame(&Ip::new([10, 0, 1, 200], VIP), &udp(3000, 53, b"x"))).unwrap();
    assert_eq!(packet::summary(&out).src, SNAT, "/24 beats /16");
    let (_, out) = e.run(&frame(&Ip::new([10, 0, 9, 9], VIP), &udp(3000, 53, b"x"))).unwrap();
    assert_eq!(packet::summary(&out).src, [10, 0, 2, 16]);
}

/// SNAT rules are keyed on the interface a flow leaves by: a SNAT client
/// reaching the namespace's own address, or a host routed back out the
/// client side, is not SNAT'ed (and opens no flow).
#[test]
fn snat_applies_only_to_flows_leaving_by_its_interface() {
    let Some(mut e) = engine() else { return };
    // The namespace's own address (v1's 10.0.2.1): local delivery.
    expect_untouched(&mut e, frame(&Ip::new(CLIENT, SNAT), &tcp(SYN, 24000, 22, b"")));
    // Routed back out v0 (10.0.1.0/24): a VPC route through the gateway.
    expect_untouched(&mut e, frame(&Ip::new(CLIENT, [10, 0, 1, 77]), &udp(5000, 53, b"vpc")));
    assert!(e.tables.conntrack().unwrap().is_empty());
    // Out by v1: SNAT'ed.
    let (_, out) = e.run(&frame(&Ip::new(CLIENT, [203, 0, 113, 9]), &udp(5000, 53, b"out"))).unwrap();
    assert_eq!(packet::summary(&out).src, SNAT);
}

#[test]
fn backends_spread_by_flow_and_stick_per_flow() {
    let Some(mut e) = engine() else { return };
    e.tables.set_dnat(&dnat(PROTO_TCP, 443, 40, &[(SERVER, 8443), (SERVER2, 8443)])).unwrap();
    let other = [192, 0, 2, 9];
    let mut hits = std::collections::HashMap::new();
    for sport in 1000..1064u16 {
        let f = frame(&Ip::new(other, VIP), &tcp(SYN, sport, 443, b""));
        let (_, out) = e.run(&f).unwrap();
        let first = packet::summary(&out).dst;
        let (_, again) = e.run(&f).unwrap();
        assert_eq!(packet::summary(&again).dst, first, "a flow sticks to its backend");
        *hits.entry(first).or_insert(0) += 1;
    }
    assert_eq!(hits.len(), 2, "both backends used: {hits:?}");
    assert!(hits.values().all(|n| *n >= 16), "{hits:?}");
}

#[test]
fn hairpin_snats_to_the_dnat_address_when_no_snat_rule_matches() {
    let Some(mut e) = engine() else { return };
    let mut spec = dnat(PROTO_TCP, 8443, 60, &[(SERVER, 443)]);
    spec.snat = Some(lbagent::dataplane::tables::RuleSnat::hairpin(LO));
    e.tables.set_dnat(&spec).unwrap();
    // A VPC host outside every SNAT rule reaches the VIP of its own gateway.
    let host = [10, 0, 2, 77];
    let (rc, out) = e.run(&frame(&Ip::new(host, VIP), &tcp(SYN, 33000, 8443, b""))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    verify(&out).unwrap();
    let s = packet::summary(&out);
    assert_eq!((s.src, s.dst, s.dport), (VIP, SERVER, 443), "DNAT'ed and SNAT'ed to the VIP");
    expect(
        &mut e,
        frame(&Ip::new(SERVER, VIP), &tcp(SYN | ACK, 443, s.sport, b"")),
        frame(&Ip::new(VIP, host), &tcp(SYN | ACK, 8443, 33000, b"")),
    );
    // A client covered by a SNAT rule uses that rule instead (CIDR SNAT before hairpin).
    let (_, out) = e.run(&frame(&Ip::new(CLIENT, VIP), &tcp(SYN, 24001, 8443, b""))).unwrap();
    assert_eq!(packet::summary(&out).src, SNAT);
}

#[test]
fn unmatched_traffic_is_untouched() {
    let Some(mut e) = engine() else { return };
    expect_untouched(&mut e, frame(&Ip::new([192, 0, 2, 1], [192, 0, 2, 2]), &tcp(SYN, 1, 2, b"")));
    expect_untouched(&mut e, frame(&Ip::new([192, 0, 2, 1], VIP), &udp(1, 54, b"other port")));
    expect_untouched(
        &mut e,
        frame(&Ip::new(SERVER, CLIENT), &L4::Echo { request: false, id: 1, seq: 1, payload: vec![] }),
    );
    assert!(e.tables.counter(Counter::PassedUnmatched).unwrap() >= 3);
    assert!(e.tables.conntrack().unwrap().is_empty());
}

/// A SNAT rule without a port range asked for (the gateway's CIDR SNAT, as
/// the reference's `-j SNAT --to-source <eip>`) keeps a privileged source
/// port in its class, as Linux NAT does: below 512 in 1–511, 512–1023 in
/// 600–1023 (NFS servers accept only reserved ports); other ports take the
/// rule's range. A rule with a range asked for uses it for every port.
#[test]
fn snat_without_a_range_keeps_privileged_ports_in_their_class() {
    let Some(mut e) = engine() else { return };
    let mut rule = snat(([10, 0, 1, 0], 24), SNAT, (1024, 65535), true, 20);
    rule.port_class = true;
    e.tables.set_snat(&rule).unwrap();
    // Traffic to a host with no DNAT rule: SNAT alone.
    let to = [10, 0, 2, 9];
    let sport_of = |e: &mut lbagent_tests::engine::TestZone, sport: u16| {
        let (rc, out) = e.run(&frame(&Ip::new(CLIENT, to), &udp(sport, 2049, b"x"))).unwrap();
        assert_eq!(rc, TC_ACT_OK);
        verify(&out).unwrap();
        let s = packet::summary(&out);
        assert_eq!(s.src, SNAT);
        s.sport
    };
    for sport in [111, 300, 511, 512, 700, 1023, 1024, 40000] {
        let got = sport_of(&mut e, sport);
        let class = match sport {
            0..512 => 1..=511,
            512..1024 => 600..=1023,
            _ => 1024..=65535,
        };
        assert!(class.contains(&got), "source port {sport} became {got}, outside {class:?}");
    }
    // With a range asked for, a privileged port takes the range.
    rule.port_class = false;
    e.tables.set_snat(&rule).unwrap();
    let got = sport_of(&mut e, 222);
    assert!(got >= 1024, "a range asked for applies to every port: 222 became {got}");
}
