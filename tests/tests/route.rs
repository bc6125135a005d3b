//! The fast path (`lbagent-ebpf/src/route.rs`, `next_hop`): a
//! translated packet the namespace would forward leaves the program
//! redirected to its egress interface through the neighbour layer, as a
//! router sends it, when it fits the interface's MTU (`egress_mtu`).
//! Program tests (BPF_PROG_TEST_RUN) on the shared fixture, with the fast
//! path switched on; real traffic in `traffic.rs` and `natgw.rs`.

use lbagent_common::*;
use lbagent_tests::{
    engine::{TC_ACT_OK, TestZone},
    fixture::*,
    net::sh,
    packet::{Ip, frame, summary, verify},
};

/// `TC_ACT_REDIRECT`.
const TC_ACT_REDIRECT: u32 = 7;

/// udp/5353 on the VIP → the client (its neighbour entry is resolved in
/// the test net, `v0`), from a sender arriving on `lo`; the test net's
/// MTUs written as the agent writes them.
fn fast_engine() -> Option<TestZone> {
    let e = engine()?;
    e.tables.set_dnat(&dnat(PROTO_UDP, 5353, 9, &[(CLIENT, 53)])).unwrap();
    e.tables.set_config(NatConfig { flags: NAT_CFG_FAST_PATH, ..Default::default() }).unwrap();
    sync_mtus(&e);
    Some(e)
}

fn sync_mtus(e: &TestZone) {
    e.sync_egress_mtu(ZONE).unwrap();
}

/// A UDP datagram to the fast path's client rule whose IP packet is
/// `ip_len` bytes long.
fn sized(ip_len: usize) -> Vec<u8> {
    frame(&Ip::new([10, 0, 2, 7], VIP), &udp(4000, 5353, &vec![7u8; ip_len - 28]))
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
    let input = query(64);
    let (_, out) = e.run(&input).unwrap();
    let s = summary(&out);
    assert_eq!((s.dst, s.dport), (CLIENT, 53), "translated");
    assert_eq!(out[0..12], input[0..12], "MAC addresses are the neighbour layer's to write, not the program's");
}

#[test]
fn what_the_stack_must_handle_takes_the_stack() {
    let Some(mut e) = fast_engine() else { return };
    // TTL 1: the stack sends time-exceeded.
    let (rc, out) = e.run(&query(1)).unwrap();
    assert_eq!((rc, out[14 + 8]), (TC_ACT_OK, 1));
    // An interface without an `egress_mtu` entry: the stack.
    e.tables.clear_egress_mtu(ZONE).unwrap();
    let (rc, out) = e.run(&query(64)).unwrap();
    assert_eq!((rc, out[14 + 8]), (TC_ACT_OK, 64), "no MTU known: the stack");
    sync_mtus(&e);
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
        assert_eq!(out[0..12], packet[0..12], "{what}: MAC addresses left to the neighbour layer");
        assert_eq!(out[14] & 0x0f, (l3_len / 4) as u8, "{what}: header length kept");
        assert_eq!(out.len(), packet.len(), "{what}: nothing added or cut");
    }
}

/// A next hop without a valid neighbour entry (the server, on `v1`'s
/// subnet in the test net) is the stack's: it queues the packet
/// while it resolves the entry, and answers host-unreachable when that
/// fails. A stale entry is the fast path's, through the neighbour layer,
/// which probes it; the FIB's MAC answer is never written into the frame
/// (it would be the stale entry's for ever: nothing that bypasses the
/// neighbour layer probes it). An IPv4 route via an IPv6 next hop: the
/// stack.
#[test]
fn unresolved_and_ipv6_next_hops_take_the_stack_and_stale_ones_the_neighbour_layer() {
    let Some(mut e) = fast_engine() else { return };
    e.tables.set_dnat(&dnat(PROTO_UDP, 5354, 10, &[(SERVER, 53)])).unwrap();
    let input = frame(&Ip::new([10, 0, 2, 7], VIP), &udp(4001, 5354, b"q"));
    let (rc, out) = e.run(&input).unwrap();
    assert_eq!((rc, out[14 + 8]), (TC_ACT_OK, 64), "unresolved: the stack resolves it");
    // A stale entry whose MAC is wrong: the neighbour layer probes it; the
    // program never writes its MAC.
    sh(&["ip", "neigh", "replace", "10.0.2.2", "lladdr", "02:00:00:00:00:77", "dev", "v1", "nud", "stale"]).unwrap();
    let input = frame(&Ip::new([10, 0, 2, 7], VIP), &udp(4002, 5354, b"q"));
    let (rc, out) = e.run(&input).unwrap();
    assert_eq!(rc, TC_ACT_REDIRECT);
    verify(&out).unwrap();
    assert_eq!(summary(&out).dst, SERVER);
    assert_eq!(out[0..12], input[0..12], "the stale MAC is not copied into the frame");
    // The client's route via an IPv6 next hop with a resolved entry: the
    // FIB answers success for family AF_INET6.
    sh(&["ip", "-6", "neigh", "replace", "fe80::99", "lladdr", "02:00:00:00:00:66", "dev", "v0", "nud", "permanent"])
        .unwrap();
    sh(&["ip", "route", "add", "10.0.1.2/32", "via", "inet6", "fe80::99", "dev", "v0"]).unwrap();
    let (rc, out) = e.run(&query(64)).unwrap();
    assert_eq!((rc, out[14 + 8]), (TC_ACT_OK, 64), "an IPv6 next hop: the stack");
}

/// The MTU check is exact: a packet of the egress MTU leaves by the fast
/// path, one byte more takes the stack (which sends frag-needed for DF or
/// fragments), for the link MTU and for a smaller route MTU alike.
#[test]
fn a_packet_over_the_egress_mtu_takes_the_stack_without_slack() {
    let Some(mut e) = fast_engine() else { return };
    sh(&["ip", "link", "set", "v0", "mtu", "1000"]).unwrap();
    // Until the agent writes the new MTU (each pass), the FIB's own device
    // check still refuses what exceeds it by more than its 4-byte slack.
    let (rc, _) = e.run(&sized(1100)).unwrap();
    assert_eq!(rc, TC_ACT_OK, "the FIB's check");
    sync_mtus(&e);
    for (len, want) in [(1000, TC_ACT_REDIRECT), (1001, TC_ACT_OK), (1004, TC_ACT_OK)] {
        let (rc, out) = e.run(&sized(len)).unwrap();
        assert_eq!(rc, want, "IP length {len} over a link MTU of 1000");
        verify(&out).unwrap();
    }
    // A route MTU below the link's.
    sh(&["ip", "route", "add", "10.0.1.2/32", "dev", "v0", "mtu", "900"]).unwrap();
    sync_mtus(&e);
    for (len, want) in [(900, TC_ACT_REDIRECT), (901, TC_ACT_OK)] {
        let (rc, _) = e.run(&sized(len)).unwrap();
        assert_eq!(rc, want, "IP length {len} over a route MTU of 900");
    }
}

/// A GSO packet (a TSO sender's) fits when each segment it becomes does:
/// `gso_size` of payload behind the IP and TCP headers (options counted).
/// The FIB's own check passes every GSO packet whatever its segments.
#[test]
fn a_gso_packet_is_checked_by_its_segments() {
    let Some(mut e) = fast_engine() else { return };
    e.tables.set_dnat(&dnat(PROTO_TCP, 5353, 11, &[(CLIENT, 53)])).unwrap();
    sh(&["ip", "link", "set", "v0", "mtu", "1400"]).unwrap();
    sync_mtus(&e);
    let payload = vec![1u8; 2800];
    let segment = |flags| frame(&Ip::new([10, 0, 2, 8], VIP), &tcp(flags, 4003, 5353, &payload));
    let syn = frame(&Ip::new([10, 0, 2, 8], VIP), &tcp(lbagent_tests::packet::SYN, 4003, 5353, b""));
    assert_eq!(e.run(&syn).unwrap().0, TC_ACT_REDIRECT, "the flow's first packet");
    // Segments of 1360 + 20 + 20 = 1400 bytes fit; of 1361, one byte too many.
    let (rc, out) = e.run_gso(&segment(lbagent_tests::packet::ACK), 1360, 3).unwrap();
    assert_eq!(rc, TC_ACT_REDIRECT, "segments of exactly the MTU");
    verify(&out).unwrap();
    let (rc, out) = e.run_gso(&segment(lbagent_tests::packet::ACK), 1361, 3).unwrap();
    assert_eq!((rc, out[14 + 8]), (TC_ACT_OK, 64), "segments over the MTU: the stack, TTL untouched");
    // The same payload as one packet over the MTU: the stack too.
    let (rc, _) = e.run(&segment(lbagent_tests::packet::ACK)).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    // UDP GSO may be a tunnel's (its segments carry inner headers the
    // program cannot see): the stack, however small its segments.
    let (rc, _) = e.run_gso(&frame(&Ip::new([10, 0, 2, 8], VIP), &udp(4005, 5353, &payload)), 500, 6).unwrap();
    assert_eq!(rc, TC_ACT_OK, "UDP GSO: the stack");
}
