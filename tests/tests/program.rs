//! Program tests: the NAT program on crafted packets via BPF_PROG_TEST_RUN.
//! Every output is compared byte for byte with a frame built independently
//! (checksums computed by the test's own code), and re-verified. The rules
//! and shorthands are in `lbagent_tests::fixture`.

use lbagent::dataplane::tables::DnatSpec;
use lbagent_common::*;
use lbagent_tests::{
    engine::{Engine, TC_ACT_OK, TC_ACT_SHOT},
    fixture::*,
    packet::{self, ACK, FIN, Ip, L4, PSH, RST, SYN, frame, verify},
    require_root,
};

#[test]
fn tcp_syn_original_direction() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 1);
    assert_eq!(ct_state(&e, orig_key()), CT_NEW);
}

#[test]
fn tcp_synack_reply_direction() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    tcp_reply(&mut e, SYN | ACK, b"");
    assert_eq!(ct_state(&e, orig_key()), CT_REPLIED, "answered, handshake not complete");
    tcp_orig(&mut e, ACK, b"");
    assert_eq!(ct_state(&e, orig_key()), CT_ESTABLISHED, "the originator's ACK completes it");
}

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
fn tcp_data_both_directions() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    let req = b"GET / HTTP/1.1\r\nHost: vip\r\n\r\n";
    tcp_orig(&mut e, ACK | PSH, req);
    let resp = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
    tcp_reply(&mut e, ACK | PSH, resp);
}

#[test]
fn tcp_odd_length_payload() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    tcp_orig(&mut e, ACK, b"odd");
}

#[test]
fn tcp_fin_both_directions_closes_flow() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    tcp_reply(&mut e, SYN | ACK, b"");
    tcp_orig(&mut e, FIN | ACK, b"");
    assert_eq!(ct_state(&e, orig_key()), CT_ESTABLISHED, "half closed");
    tcp_reply(&mut e, FIN | ACK, b"");
    assert_eq!(ct_state(&e, orig_key()), CT_CLOSING);
}

#[test]
fn tcp_rst_closes_flow() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    tcp_reply(&mut e, RST | ACK, b"");
    assert_eq!(ct_state(&e, orig_key()), CT_CLOSING);
}

#[test]
fn udp_both_directions() {
    let Some(mut e) = engine() else { return };
    let port = expect_snat(&mut e, frame(&Ip::new(CLIENT, VIP), &udp(5000, 53, b"query")), |p| {
        frame(&Ip::new(SNAT, SERVER), &udp(p, 5353, b"query"))
    });
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &udp(5353, port, b"answer")),
        frame(&Ip::new(VIP, CLIENT), &udp(53, 5000, b"answer")),
    );
}

#[test]
fn udp_reply_direction() {
    let Some(mut e) = engine() else { return };
    expect(
        &mut e,
        frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q")),
        frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")),
    );
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &udp(5353, 25000, b"answer")),
        frame(&Ip::new(VIP, CLIENT), &udp(53, 25000, b"answer")),
    );
}

#[test]
fn udp_zero_checksum_stays_zero() {
    let Some(mut e) = engine() else { return };
    let z = |sport, dport, p: &[u8]| L4::Udp { sport, dport, payload: p.to_vec(), zero_csum: true };
    let (rc, out) = e.run(&frame(&Ip::new(CLIENT, VIP), &z(25001, 53, b"nocsum"))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    assert_eq!(out, frame(&Ip::new(SNAT, SERVER), &z(25001, 5353, b"nocsum")));
    assert_eq!(&out[14 + 20 + 6..14 + 20 + 8], &[0, 0]);
    verify(&out).unwrap();
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &z(5353, 25001, b"r")),
        frame(&Ip::new(VIP, CLIENT), &z(53, 25001, b"r")),
    );
}

#[test]
fn udp_checksum_that_becomes_zero_is_sent_as_ffff() {
    // Search a payload word that makes the translated checksum 0 (the builder
    // then writes 0xffff, as RFC 768 requires), and expect exactly that.
    let Some(mut e) = engine() else { return };
    let mut found = false;
    for w in 0..=u16::MAX {
        let p = w.to_be_bytes();
        let out = frame(&Ip::new(SNAT, SERVER), &udp(21000, 5353, &p));
        if out[14 + 20 + 6..14 + 20 + 8] == [0xff, 0xff] {
            expect(&mut e, frame(&Ip::new(CLIENT, VIP), &udp(21000, 53, &p)), out);
            found = true;
            break;
        }
    }
    assert!(found);
}

#[test]
fn icmp_echo_request_and_reply() {
    let Some(mut e) = engine() else { return };
    let echo = |request, id| L4::Echo { request, id, seq: 1, payload: b"ping-payload".to_vec() };
    let id = expect_snat(&mut e, frame(&Ip::new(CLIENT, VIP), &echo(true, 0x4242)), |id| {
        frame(&Ip::new(SNAT, SERVER), &echo(true, id))
    });
    expect(&mut e, frame(&Ip::new(SERVER, SNAT), &echo(false, id)), frame(&Ip::new(VIP, CLIENT), &echo(false, 0x4242)));
}

#[test]
fn icmp_echo_id_in_range_is_kept() {
    let Some(mut e) = engine() else { return };
    let echo = |request, id| L4::Echo { request, id, seq: 9, payload: vec![] };
    expect(&mut e, frame(&Ip::new(CLIENT, VIP), &echo(true, 22222)), frame(&Ip::new(SNAT, SERVER), &echo(true, 22222)));
}

/// The server answers our translated UDP datagram with port unreachable.
#[test]
fn icmp_port_unreachable_for_udp_is_translated() {
    let Some(mut e) = engine() else { return };
    expect(
        &mut e,
        frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"query")),
        frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"query")),
    );
    let sent = packet::ipv4(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"query"));
    let seen = packet::ipv4(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"query"));
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &L4::Error { kind: 3, code: 3, inner: sent }),
        frame(&Ip::new(VIP, CLIENT), &L4::Error { kind: 3, code: 3, inner: seen }),
    );
    assert_eq!(e.tables.counter(Counter::IcmpErrorXlated).unwrap(), 1);
}

#[test]
fn icmp_error_for_tcp_with_full_inner_header() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    let sent = packet::ipv4(&Ip::new(SNAT, SERVER), &tcp(SYN, 24000, 8080, b""));
    let seen = packet::ipv4(&Ip::new(CLIENT, VIP), &tcp(SYN, 24000, 80, b""));
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &L4::Error { kind: 3, code: 3, inner: sent }),
        frame(&Ip::new(VIP, CLIENT), &L4::Error { kind: 3, code: 3, inner: seen }),
    );
}

#[test]
fn icmp_error_with_truncated_inner_tcp() {
    // Only the first 8 bytes of the TCP header are quoted: no inner checksum.
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    let mut sent = packet::ipv4(&Ip::new(SNAT, SERVER), &tcp(SYN, 24000, 8080, b""));
    let mut seen = packet::ipv4(&Ip::new(CLIENT, VIP), &tcp(SYN, 24000, 80, b""));
    sent.truncate(28);
    seen.truncate(28);
    let err = |inner| L4::Error { kind: 3, code: 1, inner };
    let (rc, out) = e.run(&frame(&Ip::new(SERVER, SNAT), &err(sent))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    let want = frame(&Ip::new(VIP, CLIENT), &err(seen));
    assert_eq!(out, want);
    // Outer and embedded IP header checksums verify (the embedded TCP is partial).
    assert_eq!(packet::checksum(&out[14..34]), 0);
    assert_eq!(packet::checksum(&out[34..]), 0);
    assert_eq!(packet::checksum(&out[42..62]), 0);
}

/// A router between the NAT and the server reports TTL exceeded: the outer
/// source (the router) stays, the destination and embedded header translate.
#[test]
fn icmp_time_exceeded_from_router() {
    let Some(mut e) = engine() else { return };
    expect(
        &mut e,
        frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q")),
        frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")),
    );
    let sent = packet::ipv4(&Ip { ttl: 1, ..Ip::new(SNAT, SERVER) }, &udp(25000, 5353, b"q"));
    let seen = packet::ipv4(&Ip { ttl: 1, ..Ip::new(CLIENT, VIP) }, &udp(25000, 53, b"q"));
    expect(
        &mut e,
        frame(&Ip::new(ROUTER, SNAT), &L4::Error { kind: 11, code: 0, inner: sent }),
        frame(&Ip::new(ROUTER, CLIENT), &L4::Error { kind: 11, code: 0, inner: seen }),
    );
}

#[test]
fn icmp_error_quoting_an_echo_request() {
    let Some(mut e) = engine() else { return };
    let echo = |id| L4::Echo { request: true, id, seq: 3, payload: vec![] };
    expect(&mut e, frame(&Ip::new(CLIENT, VIP), &echo(22000)), frame(&Ip::new(SNAT, SERVER), &echo(22000)));
    let sent = packet::ipv4(&Ip::new(SNAT, SERVER), &echo(22000));
    let seen = packet::ipv4(&Ip::new(CLIENT, VIP), &echo(22000));
    expect(
        &mut e,
        frame(&Ip::new(ROUTER, SNAT), &L4::Error { kind: 3, code: 1, inner: sent }),
        frame(&Ip::new(ROUTER, CLIENT), &L4::Error { kind: 3, code: 1, inner: seen }),
    );
}

#[test]
fn icmp_error_for_unknown_flow_is_untouched() {
    let Some(mut e) = engine() else { return };
    let inner = packet::ipv4(&Ip::new(SNAT, SERVER), &udp(29999, 5353, b"q"));
    expect_untouched(&mut e, frame(&Ip::new(SERVER, SNAT), &L4::Error { kind: 3, code: 3, inner }));
}

#[test]
fn ip_options_are_kept_and_offsets_respected() {
    let Some(mut e) = engine() else { return };
    let opts = vec![0x94, 0x04, 0x00, 0x00, 0x01, 0x01, 0x01, 0x00]; // router alert + NOPs
    let ip = |s, d| Ip { options: opts.clone(), ..Ip::new(s, d) };
    expect(
        &mut e,
        frame(&ip(CLIENT, VIP), &tcp(SYN, 24000, 80, b"")),
        frame(&ip(SNAT, SERVER), &tcp(SYN, 24000, 8080, b"")),
    );
    expect(
        &mut e,
        frame(&ip(SERVER, SNAT), &tcp(SYN | ACK, 8080, 24000, b"x")),
        frame(&ip(VIP, CLIENT), &tcp(SYN | ACK, 80, 24000, b"x")),
    );
    expect(
        &mut e,
        frame(&ip(CLIENT, VIP), &udp(25000, 53, b"opt")),
        frame(&ip(SNAT, SERVER), &udp(25000, 5353, b"opt")),
    );
}

#[test]
fn port_collision_picks_another_snat_port() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    // A second client with the same source port would map to SNAT:24000 too.
    let port = expect_snat(&mut e, frame(&Ip::new(CLIENT2, VIP), &tcp(SYN, 24000, 80, b"")), |p| {
        frame(&Ip::new(SNAT, SERVER), &tcp(SYN, p, 8080, b""))
    });
    assert_ne!(port, 24000);
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &tcp(SYN | ACK, 8080, port, b"")),
        frame(&Ip::new(VIP, CLIENT2), &tcp(SYN | ACK, 80, 24000, b"")),
    );
    tcp_reply(&mut e, SYN | ACK, b"");
}

#[test]
fn many_flows_never_share_a_translated_tuple() {
    let Some(mut e) = engine() else { return };
    let mut seen = std::collections::HashSet::new();
    for i in 0..200u16 {
        let src = [10, 0, 1, 2 + (i % 4) as u8];
        let (rc, out) = e.run(&frame(&Ip::new(src, VIP), &udp(30000 + i / 4, 53, b"x"))).unwrap();
        assert_eq!(rc, TC_ACT_OK);
        let s = packet::summary(&out);
        assert_eq!((s.src, s.dst, s.dport), (SNAT, SERVER, 5353));
        assert!((20000..=29999).contains(&s.sport));
        assert!(seen.insert(s.sport), "port {} handed out twice", s.sport);
    }
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

#[test]
fn random_snat_stays_in_range() {
    let Some(mut e) = engine() else { return };
    e.tables.set_snat(&snat((CLIENT, 32), SNAT, (24000, 40099), true, 12)).unwrap();
    for sport in 1..20u16 {
        let (_, out) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(sport, 53, b"r"))).unwrap();
        verify(&out).unwrap();
        assert!((24000..=40099).contains(&packet::summary(&out).sport));
    }
}

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
fn dnat_only_keeps_source() {
    let Some(mut e) = engine() else { return };
    let other = [192, 0, 2, 7];
    expect(
        &mut e,
        frame(&Ip::new(other, VIP), &tcp(SYN, 24000, 80, b"")),
        frame(&Ip::new(other, SERVER), &tcp(SYN, 24000, 8080, b"")),
    );
    expect(
        &mut e,
        frame(&Ip::new(SERVER, other), &tcp(SYN | ACK, 8080, 24000, b"")),
        frame(&Ip::new(VIP, other), &tcp(SYN | ACK, 80, 24000, b"")),
    );
}

#[test]
fn address_wide_dnat_keeps_ports() {
    let Some(mut e) = engine() else { return };
    let fip = DnatSpec {
        zone: ZONE,
        addr: a([198, 51, 100, 20]),
        proto: 0,
        port: 0,
        rule_id: 30,
        backends: vec![(a(SERVER2), 0)],
        snat: None,
        acl: None,
    };
    e.tables.set_dnat(&fip).unwrap();
    let other = [203, 0, 113, 5];
    expect(
        &mut e,
        frame(&Ip::new(other, [198, 51, 100, 20]), &udp(7777, 9999, b"f")),
        frame(&Ip::new(other, SERVER2), &udp(7777, 9999, b"f")),
    );
    let echo = L4::Echo { request: true, id: 5, seq: 1, payload: vec![] };
    expect(&mut e, frame(&Ip::new(other, [198, 51, 100, 20]), &echo), frame(&Ip::new(other, SERVER2), &echo));
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
fn unmatched_traffic_is_untouched() {
    let Some(mut e) = engine() else { return };
    expect_untouched(&mut e, frame(&Ip::new([192, 0, 2, 1], [192, 0, 2, 2]), &tcp(SYN, 1, 2, b"")));
    expect_untouched(&mut e, frame(&Ip::new([192, 0, 2, 1], VIP), &udp(1, 54, b"other port")));
    expect_untouched(
        &mut e,
        frame(&Ip::new(SERVER, CLIENT), &L4::Echo { request: false, id: 1, seq: 1, payload: vec![] }),
    );
    assert!(e.tables.counter(Counter::PassUnmatched).unwrap() >= 3);
    assert!(e.tables.conntrack().unwrap().is_empty());
}

#[test]
fn non_ipv4_passes() {
    let Some(mut e) = engine() else { return };
    let mut arp = frame(&Ip::new(CLIENT, VIP), &udp(1, 53, b""));
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    expect_untouched(&mut e, arp);
    // An IPv6 frame (valid header) carrying UDP to port 53.
    let mut v6 = frame(&Ip::new(CLIENT, VIP), &udp(1, 53, b""))[..14].to_vec();
    v6[12..14].copy_from_slice(&[0x86, 0xdd]);
    v6.extend_from_slice(&[0x60, 0, 0, 0, 0, 8, 17, 64]);
    v6.extend_from_slice(&[0xfd; 32]);
    v6.extend_from_slice(&[0, 1, 0, 53, 0, 8, 0, 0]);
    expect_untouched(&mut e, v6);
    assert_eq!(e.tables.counter(Counter::PassNonIpv4).unwrap(), 2);
}

#[test]
fn truncated_headers_are_dropped_not_misread() {
    let Some(mut e) = engine() else { return };
    let mut f = frame(&Ip::new(CLIENT, VIP), &tcp(SYN, 24000, 80, b""));
    f.truncate(14 + 20 + 10);
    let (rc, _) = e.run(&f).unwrap();
    assert_eq!(rc, TC_ACT_SHOT, "a truncated TCP header is dropped (the kernel would too)");
    assert_eq!(e.tables.counter(Counter::DropMalformed).unwrap(), 1);
    assert!(e.tables.conntrack().unwrap().is_empty());
}

#[test]
fn expired_flow_is_recreated() {
    let Some(mut e) = engine() else { return };
    e.tables.set_config(NatConfig { udp_s: 1, udp_stream_s: 1, ..Default::default() }).unwrap();
    let f = frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q"));
    expect(&mut e, f.clone(), frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")));
    std::thread::sleep(std::time::Duration::from_millis(2200));
    expect(&mut e, f, frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")));
    assert_eq!(e.tables.counter(Counter::ExpiredFlows).unwrap(), 1);
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 2);
}

#[test]
fn garbage_collection_frees_idle_flows_only() {
    let Some(mut e) = engine() else { return };
    e.tables.set_config(NatConfig { udp_s: 1, udp_stream_s: 1, ..Default::default() }).unwrap();
    expect(
        &mut e,
        frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q")),
        frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")),
    );
    open_tcp(&mut e);
    std::thread::sleep(std::time::Duration::from_millis(2200));
    let now = lbagent::dataplane::tables::monotonic_ns();
    assert_eq!(e.tables.gc(now).unwrap(), 1, "the idle UDP flow goes; the TCP flow (60 s) stays");
    let left = e.tables.conntrack().unwrap();
    assert_eq!(left.len(), 2);
    assert!(left.iter().all(|(k, _)| k.proto == PROTO_TCP));
}

#[test]
fn full_conntrack_evicts_the_oldest_and_keeps_translating() {
    if !require_root() {
        return;
    }
    // ct holds 64 entries, ct_new 256 (128 flows): 400 new flows must all still be translated.
    let mut e = Engine::with_ct_max(ZONE, Some(64)).unwrap();
    e.tables.set_dnat(&dnat(PROTO_UDP, 53, 2, &[(SERVER, 5353)])).unwrap();
    let mut last = 0;
    for sport in 30000..30400u16 {
        let (rc, out) = e.run(&frame(&Ip::new([192, 0, 2, 9], VIP), &udp(sport, 53, b"x"))).unwrap();
        assert_eq!(rc, TC_ACT_OK);
        assert_eq!(packet::summary(&out).dst, SERVER);
        last = sport;
    }
    assert!(e.tables.conntrack_table(MAP_CT).unwrap().len() <= 64);
    assert!(e.tables.conntrack_table(MAP_CT_NEW).unwrap().len() <= ct_new_max(64) as usize);
    for c in [Counter::DropNoPort, Counter::DropCtInsert, Counter::DropRewrite] {
        assert_eq!(e.tables.counter(c).unwrap(), 0, "{c:?}");
    }
    // The newest flow survived eviction: its reply is translated.
    expect(
        &mut e,
        frame(&Ip::new(SERVER, [192, 0, 2, 9]), &udp(5353, last, b"r")),
        frame(&Ip::new(VIP, [192, 0, 2, 9]), &udp(53, last, b"r")),
    );
}

#[test]
fn zones_are_isolated() {
    let Some(mut e) = engine() else { return };
    // Same rule key in another zone does not apply to this zone's program.
    let mut other = dnat(PROTO_TCP, 81, 50, &[(SERVER2, 81)]);
    other.zone = ZONE + 1;
    e.tables.set_dnat(&other).unwrap();
    expect_untouched(&mut e, frame(&Ip::new([192, 0, 2, 1], VIP), &tcp(SYN, 1, 81, b"")));
}

#[test]
fn conntrack_flush_by_selector() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    expect(
        &mut e,
        frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q")),
        frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")),
    );
    assert_eq!(e.tables.conntrack().unwrap().len(), 4);
    let n = e.tables.flush_conntrack(|k, en| k.proto == PROTO_UDP && en.flags & CT_F_REPLY == 0).unwrap();
    assert_eq!(n, 1);
    // Selecting both entries of a flow still counts (and removes) one flow.
    open_tcp(&mut e);
    assert_eq!(e.tables.flush_conntrack(|k, _| k.proto == PROTO_TCP).unwrap(), 1);
    assert!(e.tables.conntrack().unwrap().is_empty());
    open_tcp(&mut e);
    let left = e.tables.conntrack().unwrap();
    assert_eq!(left.len(), 2);
    assert!(left.iter().all(|(k, _)| k.proto == PROTO_TCP));
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
