//! Parsing (`lbagent-ebpf/src/parse.rs`): IP options move every offset,
//! anything not IPv4 passes untouched, truncated headers are dropped rather
//! than misread. Program tests (BPF_PROG_TEST_RUN) on the shared fixture
//! (`lbagent_tests::fixture`), every output byte compared with an
//! independently built frame.

use lbagent_common::*;
use lbagent_tests::{
    engine::TC_ACT_SHOT,
    fixture::*,
    packet::{ACK, Ip, SYN, frame},
};

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
