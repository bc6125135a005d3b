//! Header rewriting (`lbagent-ebpf/src/rewrite.rs`): addresses, ports and
//! ICMP ids translated both ways with checksums fixed incrementally (odd
//! lengths, UDP zero and 0xffff checksums). Program tests
//! (BPF_PROG_TEST_RUN) on the shared fixture (`lbagent_tests::fixture`),
//! every output byte compared with an independently built frame.

use lbagent::dataplane::tables::DnatSpec;
use lbagent_common::*;
use lbagent_tests::{
    engine::TC_ACT_OK,
    fixture::*,
    packet::{ACK, Ip, L4, PSH, SYN, frame, verify},
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
        sched: None,
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
