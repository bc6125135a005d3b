//! The egress program (`lbagent-ebpf/src/egress.rs`) on crafted packets via
//! BPF_PROG_TEST_RUN: ICMP errors the namespace generates about a packet the
//! ingress program translated are translated back, byte for byte; the
//! namespace's own connections never share a tuple with a translated flow.
//! (BPF_PROG_TEST_RUN gives every packet a socket, so every packet here is
//! one the namespace sends; forwarded packets have none and pass, which the
//! real-traffic tests exercise.)

use lbagent::dataplane::attach::Direction;
use lbagent_common::*;
use lbagent_tests::{
    engine::{TC_ACT_OK, TestZone},
    fixture::*,
    packet::{self, ACK, Ip, L4, SYN, frame, verify},
};

const OTHER: [u8; 4] = [192, 0, 2, 7];
const TC_ACT_REDIRECT: u32 = 7;
/// The gateway's own address toward the client.
const GW: [u8; 4] = [198, 51, 100, 1];

fn egress(e: &mut TestZone, input: Vec<u8>) -> Vec<u8> {
    let (rc, out) = e.run_on(Direction::Egress, &input).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    out
}

/// other:24000 -> VIP:80 became other:24000 -> server:8080 at ingress.
fn dnat_flow(e: &mut TestZone) {
    expect(
        e,
        frame(&Ip::new(OTHER, VIP), &tcp(SYN, 24000, 80, b"")),
        frame(&Ip::new(OTHER, SERVER), &tcp(SYN, 24000, 8080, b"")),
    );
}

#[test]
fn frag_needed_from_the_gateway_quotes_what_the_client_sent() {
    let Some(mut e) = engine() else { return };
    dnat_flow(&mut e);
    // Forwarding the translated segment to a smaller MTU: the gateway's
    // "fragmentation needed" quotes it as translated.
    let quoted = packet::ipv4(&Ip::new(OTHER, SERVER), &tcp(SYN, 24000, 8080, b""));
    let seen = packet::ipv4(&Ip::new(OTHER, VIP), &tcp(SYN, 24000, 80, b""));
    let out = egress(&mut e, frame(&Ip::new(GW, OTHER), &L4::Error { kind: 3, code: 4, inner: quoted }));
    assert_eq!(out, frame(&Ip::new(GW, OTHER), &L4::Error { kind: 3, code: 4, inner: seen }));
    verify(&out).unwrap();
    assert_eq!(e.tables.counter(Counter::IcmpErrorsLocalTranslated).unwrap(), 1);
}

#[test]
fn time_exceeded_from_the_gateway_quotes_the_echo_the_client_sent() {
    let Some(mut e) = engine() else { return };
    let echo = |id| L4::Echo { request: true, id, seq: 1, payload: b"traceroute".to_vec() };
    expect(
        &mut e,
        frame(&Ip { ttl: 1, ..Ip::new(OTHER, VIP) }, &echo(7)),
        frame(&Ip { ttl: 1, ..Ip::new(OTHER, SERVER) }, &echo(7)),
    );
    let quoted = packet::ipv4(&Ip { ttl: 1, ..Ip::new(OTHER, SERVER) }, &echo(7));
    let seen = packet::ipv4(&Ip { ttl: 1, ..Ip::new(OTHER, VIP) }, &echo(7));
    let out = egress(&mut e, frame(&Ip::new(GW, OTHER), &L4::Error { kind: 11, code: 0, inner: quoted }));
    assert_eq!(out, frame(&Ip::new(GW, OTHER), &L4::Error { kind: 11, code: 0, inner: seen }));
}

#[test]
fn errors_about_nothing_we_translated_leave_untouched() {
    let Some(mut e) = engine() else { return };
    dnat_flow(&mut e);
    // An error about a flow we never saw, and one already translated at ingress.
    let unknown = packet::ipv4(&Ip::new(OTHER, SERVER2), &udp(1, 2, b"?"));
    let f = frame(&Ip::new(GW, OTHER), &L4::Error { kind: 3, code: 1, inner: unknown });
    assert_eq!(egress(&mut e, f.clone()), f);
    let client_view = packet::ipv4(&Ip::new(OTHER, VIP), &tcp(SYN, 24000, 80, b""));
    let f = frame(&Ip::new(VIP, OTHER), &L4::Error { kind: 3, code: 3, inner: client_view });
    assert_eq!(egress(&mut e, f.clone()), f);
    assert_eq!(e.tables.counter(Counter::IcmpErrorsLocalTranslated).unwrap(), 0);
    assert_eq!(e.tables.counter(Counter::DropUntranslatable).unwrap(), 0);
}

/// The namespace's own socket SNAT:24000 → server:8080 (a health probe from
/// the address client flows are SNAT'ed to) and the client flow that the
/// fixture SNATs to the same tuple.
fn local_syn() -> Vec<u8> {
    frame(&Ip::new(SNAT, SERVER), &tcp(SYN, 24000, 8080, b""))
}

#[test]
fn a_local_connection_reserves_its_tuple_and_a_client_flow_moves() {
    let Some(mut e) = engine() else { return };
    assert_eq!(egress(&mut e, local_syn()), local_syn(), "a free tuple is kept");
    assert_eq!(e.tables.counter(Counter::LocalFlows).unwrap(), 1);
    // The client flow that would map to SNAT:24000 gets another port.
    let port = expect_snat(&mut e, frame(&Ip::new(CLIENT, VIP), &tcp(SYN, 24000, 80, b"")), |p| {
        frame(&Ip::new(SNAT, SERVER), &tcp(SYN, p, 8080, b""))
    });
    assert_ne!(port, 24000);
    // The server's answer to the socket stays with the socket (untouched)...
    let to_socket = frame(&Ip::new(SERVER, SNAT), &tcp(SYN | ACK, 8080, 24000, b""));
    expect(&mut e, to_socket.clone(), to_socket);
    // ...and its answer to the client flow goes to the client.
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &tcp(SYN | ACK, 8080, port, b"")),
        frame(&Ip::new(VIP, CLIENT), &tcp(SYN | ACK, 80, 24000, b"")),
    );
}

#[test]
fn a_local_connection_that_clashes_with_a_flow_moves_its_port() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e); // client:24000 -> VIP:80 is SNAT:24000 -> server:8080
    let (rc, out) = e.run_on(Direction::Egress, &local_syn()).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    let port = packet::summary(&out).sport;
    assert_ne!(port, 24000, "the socket's port moved");
    assert_eq!(out, frame(&Ip::new(SNAT, SERVER), &tcp(SYN, port, 8080, b"")));
    // Answers: to the moved port, back to the socket's own port; to 24000, the client.
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &tcp(SYN | ACK, 8080, port, b"")),
        frame(&Ip::new(SERVER, SNAT), &tcp(SYN | ACK, 8080, 24000, b"")),
    );
    tcp_reply(&mut e, SYN | ACK, b"");
}

/// The gateway's error about a SNAT'ed packet is addressed to the SNAT
/// address (its own) and would loop back on `lo`: it is translated and sent
/// straight to the client through the neighbour layer (which writes the
/// MAC addresses: the program leaves them as they were).
#[test]
fn an_error_about_a_snat_packet_is_sent_out_to_the_client() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e); // client:24000 -> VIP:80 is SNAT:24000 -> server:8080
    let quoted = packet::ipv4(&Ip::new(SNAT, SERVER), &tcp(SYN, 24000, 8080, b""));
    let seen = packet::ipv4(&Ip::new(CLIENT, VIP), &tcp(SYN, 24000, 80, b""));
    // Test packets run on `lo`, ifindex 1: exactly where the looped error is.
    let (rc, out) = e
        .run_on(Direction::Egress, &frame(&Ip::new(SNAT, SNAT), &L4::Error { kind: 3, code: 4, inner: quoted }))
        .unwrap();
    assert_eq!(rc, TC_ACT_REDIRECT, "sent out, not looped back");
    let want = frame(&Ip::new(SNAT, CLIENT), &L4::Error { kind: 3, code: 4, inner: seen });
    assert_eq!(out, want);
    verify(&out).unwrap();
}
