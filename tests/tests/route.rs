//! The fast path (`lbagent-ebpf/src/route.rs`, `next_hop`): a
//! translated packet the namespace would forward leaves the program
//! redirected to its egress interface, as a router sends it. Program tests
//! (BPF_PROG_TEST_RUN) on the shared fixture, with the fast path switched
//! on; real traffic in `traffic.rs`.

use lbagent_common::*;
use lbagent_tests::{
    engine::{CLIENT_MAC, TC_ACT_OK, mac_of},
    fixture::*,
    packet::{Ip, frame, summary, verify},
};

/// `TC_ACT_REDIRECT`.
const TC_ACT_REDIRECT: u32 = 7;

/// udp/5353 on the VIP → the client (its neighbour entry is resolved in
/// the test net, `v0`), from a sender arriving on `lo`.
fn fast_engine() -> Option<lbagent_tests::engine::Engine> {
    let e = engine()?;
    e.tables.set_dnat(&dnat(PROTO_UDP, 5353, 9, &[(CLIENT, 53)])).unwrap();
    e.tables.set_config(NatConfig { flags: NAT_CFG_FAST_PATH, ..Default::default() }).unwrap();
    Some(e)
}

fn query(ttl: u8) -> Vec<u8> {
    frame(&Ip { ttl, ..Ip::new([10, 0, 2, 7], VIP) }, &udp(4000, 5353, b"query"))
}

#[test]
fn a_forwarded_packet_is_redirected_with_ttl_checksum_and_next_hop_macs() {
    let Some(mut e) = fast_engine() else { return };
    // The header checksum stays right after the TTL decrement, also for
    // TTLs whose decrement borrows across bits, and at the extremes.
    for ttl in [2u8, 64, 128, 255] {
        let (rc, out) = e.run(&query(ttl)).unwrap();
        assert_eq!(rc, TC_ACT_REDIRECT, "sent to the egress interface by the program");
        verify(&out).unwrap_or_else(|err| panic!("TTL {ttl}: {err}: {out:02x?}"));
        assert_eq!(out[14 + 8], ttl - 1, "TTL decremented as a router does");
    }
    let (_, out) = e.run(&query(64)).unwrap();
    let s = summary(&out);
    assert_eq!((s.dst, s.dport), (CLIENT, 53), "translated");
    let client_mac = lbagent::state::names::parse_mac(CLIENT_MAC).unwrap();
    assert_eq!(&out[0..6], client_mac, "destination: the next hop's MAC");
    assert_eq!(out[6..12], mac_of("v0"), "source: the egress interface's MAC");
}

#[test]
fn what_the_stack_must_handle_takes_the_stack() {
    let Some(mut e) = fast_engine() else { return };
    // TTL 1: the stack sends time-exceeded.
    let (rc, out) = e.run(&query(1)).unwrap();
    assert_eq!((rc, out[14 + 8]), (TC_ACT_OK, 1));
    // To the servers: the route's gateway (10.0.2.254) has no neighbour
    // entry in the test net; the stack resolves it.
    e.tables.set_dnat(&dnat(PROTO_UDP, 5354, 10, &[(SERVER, 53)])).unwrap();
    let (rc, _) = e.run(&frame(&Ip::new([10, 0, 2, 7], VIP), &udp(4001, 5354, b"q"))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    // Switched off (the default): everything climbs the stack, TTL untouched.
    e.tables.set_config(NatConfig::default()).unwrap();
    let (rc, out) = e.run(&query(64)).unwrap();
    assert_eq!((rc, out[14 + 8]), (TC_ACT_OK, 64));
}

/// The rewrite writes the hop with the tuple in one store for TCP and UDP
/// behind a plain IPv4 header, and field by field for every other shape
/// (`rewrite.rs`): both must leave the same router-like packet.
#[test]
fn every_shape_leaves_with_the_hop_written() {
    let Some(mut e) = fast_engine() else { return };
    e.tables.set_dnat(&dnat(PROTO_TCP, 5353, 11, &[(CLIENT, 53)])).unwrap();
    let opts = vec![0x94, 0x04, 0x00, 0x00]; // router alert
    let with_options = Ip { options: opts, ..Ip::new([10, 0, 2, 7], VIP) };
    let client_mac = lbagent::state::names::parse_mac(CLIENT_MAC).unwrap();
    for (what, packet, l3_len) in [
        ("udp", frame(&Ip::new([10, 0, 2, 8], VIP), &udp(4002, 5353, b"one store")), 20),
        ("tcp", frame(&Ip::new([10, 0, 2, 8], VIP), &tcp(lbagent_tests::packet::SYN, 4003, 5353, b"")), 20),
        ("udp with IP options", frame(&with_options, &udp(4004, 5353, b"field by field")), 24),
    ] {
        let (rc, out) = e.run(&packet).unwrap();
        assert_eq!(rc, TC_ACT_REDIRECT, "{what}");
        verify(&out).unwrap_or_else(|err| panic!("{what}: {err}: {out:02x?}"));
        assert_eq!(out[14 + 8], 63, "{what}: TTL decremented");
        let s = summary(&out);
        assert_eq!((s.dst, s.dport), (CLIENT, 53), "{what}: translated");
        assert_eq!(&out[0..6], client_mac, "{what}: next hop's MAC");
        assert_eq!(out[6..12], mac_of("v0"), "{what}: egress interface's MAC");
        assert_eq!(out[14] & 0x0f, (l3_len / 4) as u8, "{what}: header length kept");
        assert_eq!(out.len(), packet.len(), "{what}: nothing added or cut");
    }
}
