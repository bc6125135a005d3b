//! IPv4 fragments through the NAT program (BPF_PROG_TEST_RUN): every
//! fragment of a datagram gets its flow's translation, byte for byte the
//! fragments of the translated datagram; fragments that cannot be matched
//! never leave with a private address.

use lbagent_common::*;
use lbagent_tests::{
    engine::{TC_ACT_OK, TC_ACT_SHOT, TestZone},
    fixture::*,
    packet::{self, Ip, L4, fragments, frame},
};

const OTHER: [u8; 4] = [203, 0, 113, 5];

/// Runs every fragment; each must pass and equal the expected fragment.
fn expect_all(e: &mut TestZone, input: &[Vec<u8>], expected: &[Vec<u8>]) {
    assert_eq!(input.len(), expected.len());
    for (i, (f, want)) in input.iter().zip(expected).enumerate() {
        let (rc, out) = e.run(f).unwrap();
        assert_eq!(rc, TC_ACT_OK, "fragment {i} verdict");
        assert_eq!(packet::checksum(&out[14..34]), 0, "fragment {i} IP checksum");
        assert_eq!(&out, want, "fragment {i}: every byte");
    }
}

fn payload(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + 3) as u8).collect()
}

#[test]
fn udp_datagram_through_dnat_and_snat_both_directions() {
    let Some(mut e) = engine() else { return };
    let data = payload(4000);
    let q = fragments(&Ip::new(CLIENT, VIP), &udp(25000, 53, &data), 1480);
    assert_eq!(q.len(), 3);
    // 25000 is inside the SNAT range: kept.
    expect_all(&mut e, &q, &fragments(&Ip::new(SNAT, SERVER), &udp(25000, 5353, &data), 1480));
    let a = fragments(&Ip::new(SERVER, SNAT), &udp(5353, 25000, &data), 1480);
    expect_all(&mut e, &a, &fragments(&Ip::new(VIP, CLIENT), &udp(53, 25000, &data), 1480));
    assert_eq!(e.tables.counter(Counter::FragmentsTranslated).unwrap(), 4);
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 1);
}

/// A later fragment taken by a CPU whose clock read precedes its first
/// fragment's stamp (two CPUs, one microsecond) still follows its first
/// fragment: the entry is fresh, not 584 years old.
#[test]
fn a_first_fragment_stamped_ahead_of_this_cpus_clock_is_followed() {
    let Some(mut e) = engine() else { return };
    let data = payload(4000);
    let q = fragments(&Ip::new(CLIENT, VIP), &udp(25001, 53, &data), 1480);
    let want = fragments(&Ip::new(SNAT, SERVER), &udp(25001, 5353, &data), 1480);
    expect_all(&mut e, &q[..1], &want[..1]);
    let ahead = lbagent::dataplane::tables::monotonic_ns() + 1_000_000_000;
    assert_eq!(e.edit_entries(MAP_FRAGS, |v| v.seen_ns = ahead).unwrap(), 1);
    expect_all(&mut e, &q[1..], &want[1..]);
}

#[test]
fn udp_datagram_through_snat_with_a_moved_port() {
    let Some(mut e) = engine() else { return };
    e.tables.set_snat(&snat((CLIENT, 32), SNAT, (40000, 40999), true, 11)).unwrap();
    let data = payload(4000);
    let q = fragments(&Ip::new(CLIENT, OTHER), &udp(5000, 9999, &data), 1480);
    let (rc, first) = e.run(&q[0]).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    let port = packet::summary(&first).sport;
    let want = fragments(&Ip::new(SNAT, OTHER), &udp(port, 9999, &data), 1480);
    assert_eq!(first, want[0]);
    expect_all(&mut e, &q[1..], &want[1..]);
    let a = fragments(&Ip::new(OTHER, SNAT), &udp(9999, port, &data), 1480);
    expect_all(&mut e, &a, &fragments(&Ip::new(OTHER, CLIENT), &udp(9999, 5000, &data), 1480));
}

#[test]
fn udp_datagram_through_a_floating_ip_both_directions() {
    let Some(mut e) = engine() else { return };
    fip(&e);
    let data = payload(4000);
    let q = fragments(&Ip::new(OTHER, FIP), &udp(7777, 9999, &data), 1480);
    expect_all(&mut e, &q, &fragments(&Ip::new(OTHER, SERVER2), &udp(7777, 9999, &data), 1480));
    let a = fragments(&Ip::new(SERVER2, OTHER), &udp(9999, 7777, &data), 1480);
    expect_all(&mut e, &a, &fragments(&Ip::new(FIP, OTHER), &udp(9999, 7777, &data), 1480));
}

#[test]
fn gre_fragments_through_a_floating_ip() {
    let Some(mut e) = engine() else { return };
    fip(&e);
    let gre = |p: &[u8]| L4::Raw { proto: 47, payload: p.to_vec() };
    let data = payload(3000);
    let out = fragments(&Ip::new(SERVER2, OTHER), &gre(&data), 1480);
    expect_all(&mut e, &out, &fragments(&Ip::new(FIP, OTHER), &gre(&data), 1480));
    let back = fragments(&Ip::new(OTHER, FIP), &gre(&data), 1480);
    expect_all(&mut e, &back, &fragments(&Ip::new(OTHER, SERVER2), &gre(&data), 1480));
}

#[test]
fn a_later_fragment_without_its_first_never_leaks_a_private_source() {
    let Some(mut e) = engine() else { return };
    let data = payload(4000);
    // The first fragment was lost: the rest come from a SNAT'ed client.
    let q = fragments(&Ip { id: 0x7777, ..Ip::new(CLIENT, [192, 0, 2, 50]) }, &udp(5000, 9999, &data), 1480);
    for f in &q[1..] {
        let (rc, _) = e.run(f).unwrap();
        assert_eq!(rc, TC_ACT_SHOT);
    }
    assert_eq!(e.tables.counter(Counter::DropFragmentUntracked).unwrap(), 2);
    // Fragments of traffic the gateway does not translate pass untouched.
    let other = fragments(&Ip::new([192, 0, 2, 1], [192, 0, 2, 2]), &udp(1, 2, &data), 1480);
    for f in &other {
        let (rc, out) = e.run(f).unwrap();
        assert_eq!((rc, &out), (TC_ACT_OK, f));
    }
    assert_eq!(e.tables.counter(Counter::PassedFragment).unwrap(), 2);
    assert!(e.tables.conntrack().unwrap().is_empty());
}

/// When the first fragment is dropped (its client refused by an ACL, or no
/// free SNAT port), the later fragments of its datagram are dropped too:
/// they never leave untranslated, with a private source.
#[test]
fn later_fragments_follow_a_dropped_first_fragment() {
    let Some(mut e) = engine() else { return };
    let data = payload(4000);
    let dropped_all = |e: &mut TestZone, q: &[Vec<u8>]| {
        for (i, f) in q.iter().enumerate() {
            let (rc, _) = e.run(f).unwrap();
            assert_eq!(rc, TC_ACT_SHOT, "fragment {i}");
        }
    };
    // An ACL that refuses CLIENT on the UDP listener.
    let mut refused = dnat(PROTO_UDP, 53, 2, &[(SERVER, 5353)]);
    refused.acl = Some(lbagent::dataplane::tables::AclSpec { allow: true, cidrs: vec![(a(CLIENT2), 32)] });
    e.tables.set_dnat(&refused).unwrap();
    let q = fragments(&Ip { id: 0x1111, ..Ip::new(CLIENT, VIP) }, &udp(25000, 53, &data), 1480);
    dropped_all(&mut e, &q);
    assert_eq!(e.tables.counter(Counter::DropAcl).unwrap(), 1);
    // No free SNAT port: one port, taken by an open flow.
    e.tables.set_snat(&snat((CLIENT, 32), SNAT, (40000, 40000), false, 11)).unwrap();
    let (rc, _) = e.run(&frame(&Ip::new(CLIENT, OTHER), &udp(5000, 9999, b"takes the port"))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    let q = fragments(&Ip { id: 0x2222, ..Ip::new(CLIENT, OTHER) }, &udp(5001, 9999, &data), 1480);
    dropped_all(&mut e, &q);
    assert_eq!(e.tables.counter(Counter::DropFragmentUntracked).unwrap(), 4, "the later fragments of both");
    assert_eq!(e.tables.counter(Counter::PassedFragment).unwrap(), 0);
}
