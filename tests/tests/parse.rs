//! Parsing (`lbagent-ebpf/src/parse.rs`): IP options move every offset,
//! anything not IPv4 passes untouched, truncated headers are dropped rather
//! than misread. Program tests (BPF_PROG_TEST_RUN) on the shared fixture
//! (`lbagent_tests::fixture`), every output byte compared with an
//! independently built frame; non-linear packets with real traffic.

use lbagent::dataplane::attach::AttachMode;
use lbagent_common::*;
use lbagent_tests::{
    engine::TC_ACT_SHOT,
    fixture::*,
    net::{in_ns, mac_in},
    packet::{ACK, Ip, SYN, frame},
    require_root,
    topology::{self, NatTopology, spawn_in},
    traffic::{send_split, udp_big_echo_forever},
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
    assert_eq!(e.tables.counter(Counter::PassedNonIpv4).unwrap(), 2);
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

/// Real packets: a non-linear skb (`traffic::send_split`: headers in page
/// fragments, or only the payload) is parsed and translated wherever its
/// headers lie. The server echoes each 6 000-byte datagram: it arrives
/// translated with checksums the receivers verify (rx offload off), and its
/// answer comes back translated. (The program pulls headers in only when
/// parsing reads them outside the linear area; that it skips the pull
/// otherwise is measured, not asserted: docs/benchmarks.md, *Fast path*.)
#[test]
fn non_linear_packets_are_translated_wherever_their_headers_lie() {
    if !require_root() {
        return;
    }
    let t = NatTopology::new(AttachMode::Auto).unwrap();
    // Only frames longer than a page are split by a packet socket.
    for (ns, ifname) in [
        (&t.client.name, &t.client_if),
        (&t.nat.name, &t.ifaces[0]),
        (&t.nat.name, &t.ifaces[1]),
        (&t.server.name, &t.server_if),
    ] {
        in_ns(ns, &["ip", "link", "set", ifname, "mtu", "9000"]).unwrap();
    }
    udp_big_echo_forever(&t.server.name, 5353).unwrap();
    let gateway_mac = mac_in(&t.nat.name, &t.ifaces[0]).unwrap();
    let client_mac = mac_in(&t.client.name, &t.client_if).unwrap();
    let payload: Vec<u8> = (0..6000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    for (what, linear, sport) in [
        ("only the Ethernet header linear", 14, 41000),
        ("the IPv4 header split across the linear area and a fragment", 24, 41001),
        ("the UDP header split", 38, 41002),
        ("headers linear, payload in fragments", 42, 41003),
    ] {
        let mut f = frame(&Ip::new(topology::CLIENT.octets(), topology::VIP.octets()), &udp(sport, 53, &payload));
        f[0..6].copy_from_slice(&gateway_mac);
        f[6..12].copy_from_slice(&client_mac);
        let answer = listen_udp(&t.client.name, (topology::CLIENT, sport).into());
        send_split(&t.client.name, &t.client_if, f, linear).unwrap();
        let (bytes, from) = answer.join().unwrap().unwrap_or_else(|e| panic!("{what}: {e:#}"));
        assert_eq!(from, (topology::VIP, 53).into(), "{what}: the answer comes from the VIP");
        let nl = bytes.iter().position(|b| *b == b'\n').unwrap();
        let seen = String::from_utf8_lossy(&bytes[..nl]).into_owned();
        assert!(seen.starts_with(&format!("{}:", topology::SNAT)), "{what}: the server saw {seen}");
        assert!(bytes[nl + 1..] == payload[..], "{what}: payload changed ({} bytes back)", bytes.len() - nl - 1);
    }
    assert_eq!(t.tables.counter(Counter::DropMalformed).unwrap(), 0);
    assert_eq!(t.tables.counter(Counter::DropRewriteFailed).unwrap(), 0);
}

/// Receives one datagram on `at` in `ns` (bound before this returns).
fn listen_udp(
    ns: &str,
    at: std::net::SocketAddr,
) -> std::thread::JoinHandle<anyhow::Result<(Vec<u8>, std::net::SocketAddr)>> {
    let (bound, ready) = std::sync::mpsc::channel();
    let h = spawn_in(ns, move || {
        let s = std::net::UdpSocket::bind(at)?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
        bound.send(()).ok();
        let mut buf = vec![0u8; 65536];
        let (n, from) = s.recv_from(&mut buf)?;
        buf.truncate(n);
        Ok((buf, from))
    });
    ready.recv_timeout(std::time::Duration::from_secs(5)).expect("client socket bound");
    h
}
