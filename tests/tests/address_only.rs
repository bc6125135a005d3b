//! Protocols without ports (GRE, ESP, SCTP, ICMP types other than echo and
//! errors) through the NAT program: a floating IP translates them
//! address-only in both directions; SNAT never lets one leave with a private
//! source. Program tests (BPF_PROG_TEST_RUN) on the shared fixture.

use lbagent_common::*;
use lbagent_tests::{
    engine::{TC_ACT_OK, TC_ACT_SHOT},
    fixture::*,
    packet::{self, Ip, L4, frame},
};

const OTHER: [u8; 4] = [203, 0, 113, 5];

fn raw(proto: u8, payload: &[u8]) -> L4 {
    L4::Raw { proto, payload: payload.to_vec() }
}

/// GRE, ESP, SCTP (its CRC does not cover addresses) and an ICMP timestamp request.
fn samples() -> Vec<L4> {
    vec![
        raw(47, &[0, 0, 0x08, 0, 0x45, 0, 0, 20, 1, 2, 3, 4]),
        raw(50, &[0, 0, 0x10, 1, 0, 0, 0, 1, 0xde, 0xad, 0xbe, 0xef]),
        raw(132, &[0x13, 0x88, 0x13, 0x89, 0, 0, 0, 1, 0xaa, 0xbb, 0xcc, 0xdd]),
        timestamp_request(),
    ]
}

/// ICMP timestamp request (type 13) with its checksum.
fn timestamp_request() -> L4 {
    let mut b = vec![13, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0];
    let c = packet::checksum(&b);
    b[2..4].copy_from_slice(&c.to_be_bytes());
    raw(1, &b)
}

#[test]
fn a_floating_ip_translates_every_protocol_both_directions() {
    let Some(mut e) = engine() else { return };
    fip(&e);
    for l4 in samples() {
        // Outbound first (the internal host starts), then the answer.
        expect(&mut e, frame(&Ip::new(SERVER2, OTHER), &l4), frame(&Ip::new(FIP, OTHER), &l4));
        expect(&mut e, frame(&Ip::new(OTHER, FIP), &l4), frame(&Ip::new(OTHER, SERVER2), &l4));
    }
    for l4 in samples() {
        // Inbound first from another peer.
        let peer = [203, 0, 113, 6];
        expect(&mut e, frame(&Ip::new(peer, FIP), &l4), frame(&Ip::new(peer, SERVER2), &l4));
        expect(&mut e, frame(&Ip::new(SERVER2, peer), &l4), frame(&Ip::new(FIP, peer), &l4));
    }
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 8);
}

#[test]
fn snat_of_a_portless_protocol_never_shares_or_leaks() {
    let Some(mut e) = engine() else { return };
    let gre = raw(47, &[0, 0, 0x08, 0, 1, 2, 3, 4]);
    expect(&mut e, frame(&Ip::new(CLIENT, OTHER), &gre), frame(&Ip::new(SNAT, OTHER), &gre));
    // A second host of the SNAT CIDR to the same peer: the tuple is taken
    // and GRE has no port to move, so it is dropped, not sent as 10.0.1.3.
    let (rc, _) = e.run(&frame(&Ip::new(CLIENT2, OTHER), &gre)).unwrap();
    assert_eq!(rc, TC_ACT_SHOT);
    assert_eq!(e.tables.counter(Counter::DropUntranslatable).unwrap(), 1);
    expect(&mut e, frame(&Ip::new(OTHER, SNAT), &gre), frame(&Ip::new(OTHER, CLIENT), &gre));
}

#[test]
fn unmatched_packets_from_a_snat_source_are_dropped_not_leaked() {
    let Some(mut e) = engine() else { return };
    // An echo reply nobody asked for, and an ICMP error about a flow we never saw.
    let reply = L4::Echo { request: false, id: 9, seq: 1, payload: vec![] };
    let inner = packet::ipv4(&Ip::new(OTHER, CLIENT), &udp(53, 4444, b"?"));
    let error = L4::Error { kind: 3, code: 3, inner };
    for l4 in [reply.clone(), error.clone()] {
        let (rc, _) = e.run(&frame(&Ip::new(CLIENT, OTHER), &l4)).unwrap();
        assert_eq!(rc, TC_ACT_SHOT);
    }
    assert_eq!(e.tables.counter(Counter::DropUntranslatable).unwrap(), 2);
    // The same packets from an address no SNAT rule covers pass untouched.
    for l4 in [reply, error] {
        let f = frame(&Ip::new([192, 0, 2, 1], OTHER), &l4);
        let (rc, out) = e.run(&f).unwrap();
        assert_eq!((rc, out), (TC_ACT_OK, f));
    }
}

#[test]
fn echo_request_with_identifier_zero_is_translated() {
    let Some(mut e) = engine() else { return };
    let echo = |request, id| L4::Echo { request, id, seq: 1, payload: b"zero".to_vec() };
    let id = expect_snat(&mut e, frame(&Ip::new(CLIENT, OTHER), &echo(true, 0)), |id| {
        frame(&Ip::new(SNAT, OTHER), &echo(true, id))
    });
    expect(&mut e, frame(&Ip::new(OTHER, SNAT), &echo(false, id)), frame(&Ip::new(OTHER, CLIENT), &echo(false, 0)));
}

/// UDP-Lite and DCCP have no ports the engine translates, but their
/// checksums cover a pseudo header with the addresses (as UDP's): through a
/// floating IP both ways, the checksum follows the translated addresses,
/// byte for byte, on the whole body and on a partial coverage.
#[test]
fn udp_lite_and_dccp_checksums_follow_the_translated_addresses() {
    let Some(mut e) = engine() else { return };
    fip(&e);
    let udplite = |cov: u8| {
        let mut b = vec![0x13, 0x88, 0x17, 0x70, 0, cov, 0, 0];
        b.extend_from_slice(b"lightweight payload");
        b
    };
    // Data offset 4 words (16 bytes, extended sequence numbers), CsCov
    // `cov`, a Request, then payload.
    let dccp = |cov: u8| {
        let mut b = vec![0x13, 0x88, 0x17, 0x70, 4, cov, 0, 0, 0x01, 0, 0, 0, 0, 0, 0, 7];
        b.extend_from_slice(b"datagram congestion control");
        b
    };
    for (proto, body) in [
        (packet::PROTO_UDPLITE, udplite(0)),
        (packet::PROTO_UDPLITE, udplite(8)),
        (packet::PROTO_DCCP, dccp(0)),
        (packet::PROTO_DCCP, dccp(1)),
    ] {
        let l4 = |src, dst| raw(proto, &packet::pseudo_checksummed(proto, src, dst, body.clone()));
        let input = frame(&Ip::new(SERVER2, OTHER), &l4(SERVER2, OTHER));
        packet::verify(&input).unwrap();
        let (rc, out) = e.run(&input).unwrap();
        assert_eq!(rc, TC_ACT_OK);
        packet::verify(&out).unwrap_or_else(|err| panic!("protocol {proto} out: {err}"));
        assert_eq!(out, frame(&Ip::new(FIP, OTHER), &l4(FIP, OTHER)), "protocol {proto} out, byte for byte");
        let (rc, back) = e.run(&frame(&Ip::new(OTHER, FIP), &l4(OTHER, FIP))).unwrap();
        assert_eq!(rc, TC_ACT_OK);
        assert_eq!(back, frame(&Ip::new(OTHER, SERVER2), &l4(OTHER, SERVER2)), "protocol {proto} back");
    }
}
