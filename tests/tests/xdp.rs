//! The XDP probes (`lbagent-ebpf/src/xdp.rs`) the benchmark's XDP section
//! measures with: they must do what they claim, or the numbers that decide
//! against (or for) an XDP dataplane mean nothing. Program runs
//! (BPF_PROG_TEST_RUN) and real traffic forwarded by XDP alone.

use std::{net::UdpSocket, time::Duration};

use lbagent_tests::{
    engine::TestPins,
    net::in_ns,
    packet::{Ip, L4, frame, verify},
    require_root,
    topology::{NatTopology, SERVER, spawn_in},
    xdp::{FORWARD, NextHop, PASS, forward_to_server, probe, probes},
};

/// `enum xdp_action`.
const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;

const HOP: NextHop = NextHop { ifindex: 7, dst_mac: [2, 0, 0, 0, 0, 0xd5], src_mac: [2, 0, 0, 0, 0, 0x5c] };

fn run(ebpf: &mut aya::Ebpf, name: &str, input: &[u8]) -> (u32, Vec<u8>) {
    use aya::programs::{TestRun, TestRunOptions};
    let mut out = vec![0u8; input.len() + 256];
    let res = probe(ebpf, name)
        .unwrap()
        .test_run(TestRunOptions { data_in: Some(input), data_out: Some(&mut out), ..TestRunOptions::default() })
        .unwrap();
    out.truncate(res.data_size_out as usize);
    (res.return_value, out)
}

fn datagram(ttl: u8) -> Vec<u8> {
    frame(
        &Ip { ttl, ..Ip::new([10, 0, 1, 2], [10, 0, 2, 2]) },
        &L4::Udp { sport: 4000, dport: 5000, payload: b"probe".to_vec(), zero_csum: false },
    )
}

#[test]
fn the_forward_probe_routes_like_a_router_and_passes_the_rest() {
    if !require_root() {
        return;
    }
    let pins = TestPins::new();
    let mut ebpf = probes(&pins, HOP).unwrap();
    for ttl in [64, 2, 255] {
        let (rc, out) = run(&mut ebpf, FORWARD, &datagram(ttl));
        assert_eq!(rc, XDP_REDIRECT, "TTL {ttl}: redirected");
        assert_eq!(out[14 + 8], ttl - 1, "TTL decremented");
        verify(&out).unwrap_or_else(|e| panic!("TTL {ttl}: {e}: {out:02x?}"));
        assert_eq!(out[0..6], HOP.dst_mac, "next hop's MAC");
        assert_eq!(out[6..12], HOP.src_mac, "egress interface's MAC");
        assert_eq!(out[14..14 + 8], datagram(ttl)[14..14 + 8], "nothing else in the header changed");
    }
    // TTL 1 is the stack's (time exceeded); non-IPv4 (ARP) and runts pass.
    let last_hop = datagram(1);
    assert_eq!(run(&mut ebpf, FORWARD, &last_hop), (XDP_PASS, last_hop.clone()));
    let mut arp = datagram(64);
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    assert_eq!(run(&mut ebpf, FORWARD, &arp), (XDP_PASS, arp.clone()));
    let runt = datagram(64)[..30].to_vec();
    assert_eq!(run(&mut ebpf, FORWARD, &runt).0, XDP_PASS);
    assert_eq!(run(&mut ebpf, PASS, &datagram(64)), (XDP_PASS, datagram(64)));
}

/// IPv4 datagrams the namespace's own stack forwarded (`Ip: ForwDatagrams`).
fn forwarded(ns: &str) -> u64 {
    let snmp = in_ns(ns, &["cat", "/proc/net/snmp"]).unwrap();
    let mut lines = snmp.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (lines.next().unwrap(), lines.next().unwrap());
    let i = names.split_whitespace().position(|n| n == "ForwDatagrams").unwrap();
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

#[test]
fn the_forward_probe_carries_real_traffic_past_the_stack() {
    if !require_root() {
        return;
    }
    let t = NatTopology::plain().unwrap();
    let pins = TestPins::new();
    let _probes = forward_to_server(&t, &pins).unwrap();
    let server = spawn_in(&t.server.name, || {
        let s = UdpSocket::bind(("0.0.0.0", 5000))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut got = 0;
        let mut buf = [0u8; 64];
        while got < 200 {
            match s.recv(&mut buf) {
                Ok(_) => got += 1,
                Err(_) => break,
            }
        }
        Ok(got)
    });
    std::thread::sleep(Duration::from_millis(300));
    let before = forwarded(&t.nat.name);
    spawn_in(&t.client.name, || {
        let s = UdpSocket::bind(("0.0.0.0", 0))?;
        for i in 0..200u32 {
            s.send_to(&i.to_be_bytes(), (SERVER, 5000))?;
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    })
    .join()
    .unwrap()
    .unwrap();
    let got = server.join().unwrap().unwrap();
    let by_stack = forwarded(&t.nat.name) - before;
    assert_eq!(got, 200, "every datagram reached the server");
    assert!(by_stack < 5, "{by_stack} datagrams took the stack: XDP forwarded the rest");
    // Both ways, with the stack forwarding the answers: ping.
    in_ns(&t.client.name, &["ping", "-c", "3", "-i", "0.2", "-W", "2", &SERVER.to_string()]).unwrap();
}
