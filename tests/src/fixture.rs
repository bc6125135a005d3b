//! The program tests' shared fixture: one zone's engine with a small rule
//! set, packet shorthands, and assertions that compare every output byte
//! with an independently built frame.
//!
//! Topology the rules describe (zone 7, test runs arrive on `lo`, ifindex 1):
//! client 10.0.1.2 → VIP 198.51.100.10 → server 10.0.2.2, SNAT to 10.0.2.1.

use std::net::Ipv4Addr;

use lbagent::dataplane::tables::{DnatSpec, SnatSpec};
use lbagent_common::*;

use crate::{
    engine::{TC_ACT_OK, TestZone, out_ifindex},
    packet::{self, ACK, Ip, L4, SYN, frame, verify},
    require_root,
};

pub const ZONE: u16 = 7;
pub const LO: u32 = 1;
pub const CLIENT: [u8; 4] = [10, 0, 1, 2];
pub const CLIENT2: [u8; 4] = [10, 0, 1, 3];
pub const VIP: [u8; 4] = [198, 51, 100, 10];
pub const SERVER: [u8; 4] = [10, 0, 2, 2];
pub const SERVER2: [u8; 4] = [10, 0, 2, 3];
pub const SNAT: [u8; 4] = [10, 0, 2, 1];
pub const ROUTER: [u8; 4] = [10, 0, 2, 254];

pub fn a(x: [u8; 4]) -> Ipv4Addr {
    Ipv4Addr::from(x)
}

pub fn dnat(proto: u8, port: u16, rule_id: u32, backends: &[([u8; 4], u16)]) -> DnatSpec {
    DnatSpec {
        zone: ZONE,
        addr: a(VIP),
        proto,
        port,
        rule_id,
        backends: backends.iter().map(|(x, p)| (a(*x), *p)).collect(),
        snat: None,
        acl: None,
        sched: None,
    }
}

/// A SNAT rule for flows leaving by the test net's `v1` (every destination
/// but 10.0.1.0/24 and the namespace's own addresses).
pub fn snat(cidr: ([u8; 4], u8), to: [u8; 4], ports: (u16, u16), random: bool, rule_id: u32) -> SnatSpec {
    SnatSpec {
        zone: ZONE,
        ifindex: out_ifindex(),
        cidr: (a(cidr.0), cidr.1),
        to: a(to),
        ports,
        random,
        port_class: false,
        rule_id,
    }
}

/// TestZone with: tcp/80 → server:8080, udp/53 → server:5353, icmp → server,
/// SNAT 10.0.1.0/24 → 10.0.2.1 ports 20000-29999 (keep-port order).
pub fn engine() -> Option<TestZone> {
    if !require_root() {
        return None;
    }
    let e = TestZone::new(ZONE).unwrap();
    e.tables.set_dnat(&dnat(PROTO_TCP, 80, 1, &[(SERVER, 8080)])).unwrap();
    e.tables.set_dnat(&dnat(PROTO_UDP, 53, 2, &[(SERVER, 5353)])).unwrap();
    e.tables.set_dnat(&dnat(PROTO_ICMP, 0, 3, &[(SERVER, 0)])).unwrap();
    e.tables.set_snat(&snat((CLIENT, 24), SNAT, (20000, 29999), false, 10)).unwrap();
    Some(e)
}

pub fn tcp(flags: u8, sport: u16, dport: u16, payload: &[u8]) -> L4 {
    L4::Tcp { sport, dport, seq: 1000, ack: if flags & ACK != 0 { 2000 } else { 0 }, flags, payload: payload.to_vec() }
}

pub fn udp(sport: u16, dport: u16, payload: &[u8]) -> L4 {
    L4::Udp { sport, dport, payload: payload.to_vec(), zero_csum: false }
}

/// Runs `input` and asserts the output is exactly `expected` (and verifies).
pub fn expect(e: &mut TestZone, input: Vec<u8>, expected: Vec<u8>) {
    let (rc, out) = e.run(&input).unwrap();
    assert_eq!(rc, TC_ACT_OK, "verdict");
    verify(&out).unwrap_or_else(|err| panic!("{err}: {out:02x?}"));
    assert_eq!(packet::summary(&out), packet::summary(&expected), "headers");
    assert_eq!(out, expected, "every byte");
}

/// Like `expect`, for a new SNAT flow whose port the engine picks: the
/// expected frame is built from the port found in the output, which must be
/// in the SNAT range.
pub fn expect_snat(e: &mut TestZone, input: Vec<u8>, expected: impl Fn(u16) -> Vec<u8>) -> u16 {
    let (rc, out) = e.run(&input).unwrap();
    assert_eq!(rc, TC_ACT_OK, "verdict");
    let port = packet::summary(&out).sport;
    assert!((20000..=29999).contains(&port), "port {port} outside the SNAT range");
    assert_eq!(out, expected(port), "every byte");
    verify(&out).unwrap();
    port
}

pub fn expect_untouched(e: &mut TestZone, input: Vec<u8>) {
    let (rc, out) = e.run(&input).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    assert_eq!(out, input);
}

/// client:24000 → VIP:80 becomes SNAT:24000 → server:8080 (the port is in range: kept).
pub fn open_tcp(e: &mut TestZone) {
    expect(
        e,
        frame(&Ip::new(CLIENT, VIP), &tcp(SYN, 24000, 80, b"")),
        frame(&Ip::new(SNAT, SERVER), &tcp(SYN, 24000, 8080, b"")),
    );
}

/// client:24000 → VIP:80 with `flags`/`payload` on the established test flow.
pub fn tcp_orig(e: &mut TestZone, flags: u8, payload: &[u8]) {
    expect(
        e,
        frame(&Ip::new(CLIENT, VIP), &tcp(flags, 24000, 80, payload)),
        frame(&Ip::new(SNAT, SERVER), &tcp(flags, 24000, 8080, payload)),
    );
}

/// The server's answer on the established test flow.
pub fn tcp_reply(e: &mut TestZone, flags: u8, payload: &[u8]) {
    expect(
        e,
        frame(&Ip::new(SERVER, SNAT), &tcp(flags, 8080, 24000, payload)),
        frame(&Ip::new(VIP, CLIENT), &tcp(flags, 80, 24000, payload)),
    );
}

pub fn ct_state(e: &TestZone, key: Tuple) -> u8 {
    e.tables.conntrack().unwrap().into_iter().find(|(k, _)| *k == key).map(|(_, v)| v.state).expect("entry")
}

pub fn orig_key() -> Tuple {
    Tuple { saddr: CLIENT, daddr: VIP, sport: 24000, dport: 80, proto: PROTO_TCP, _pad0: 0, zone: ZONE }
}

/// The floating IP 198.51.100.20 ↔ server2: an address-wide DNAT rule and
/// the /32 SNAT rule back, as the NAT gateway programs a FIP.
pub const FIP: [u8; 4] = [198, 51, 100, 20];

pub fn fip(e: &TestZone) {
    e.tables
        .set_dnat(&DnatSpec {
            zone: ZONE,
            addr: a(FIP),
            proto: 0,
            port: 0,
            rule_id: 30,
            backends: vec![(a(SERVER2), 0)],
            snat: None,
            acl: None,
            sched: None,
        })
        .unwrap();
    e.tables.set_snat(&snat((SERVER2, 32), FIP, (1024, 65535), false, 31)).unwrap();
}
