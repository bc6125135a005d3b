//! ICMP errors (`lbagent-ebpf/src/icmp_error.rs`): the outer and the quoted
//! inner header translated together, truncated quotes, errors from routers
//! on the path, errors for unknown flows left alone. Program tests
//! (BPF_PROG_TEST_RUN) on the shared fixture (`lbagent_tests::fixture`).

use lbagent_common::*;
use lbagent_tests::{
    engine::TC_ACT_OK,
    fixture::*,
    packet::{self, Ip, L4, SYN, frame},
};

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
    assert_eq!(e.tables.counter(Counter::IcmpErrorsTranslated).unwrap(), 1);
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
