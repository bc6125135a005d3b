//! First real traffic: client → NAT namespace running the engine → server,
//! with mixed offloads, through both attach paths.

use lbagent::dataplane::attach::AttachMode;
use lbagent_common::Counter;
use lbagent_tests::{
    require_root,
    topology::{NatTopology, SNAT, VIP},
    traffic::*,
};

fn scenario(mode: AttachMode) {
    if !require_root() {
        return;
    }
    let t = NatTopology::new(mode).unwrap();
    assert_eq!(t.mode, mode);

    // TCP: small and large (multi-segment, offloaded) transfers.
    let server = tcp_echo_server(&t.server.name, 8080, 2).unwrap();
    for len in [32, 2 << 20] {
        let (seen_by_server, peer) = tcp_echo(&t.client.name, (VIP, 80).into(), len).unwrap();
        assert!(seen_by_server.starts_with(&format!("{SNAT}:")), "server saw {seen_by_server}");
        let port: u16 = seen_by_server.rsplit(':').next().unwrap().parse().unwrap();
        assert!((20000..=29999).contains(&port));
        assert_eq!(peer, (VIP, 80).into(), "client sees only the VIP");
    }
    let peers = server.join().unwrap().unwrap();
    assert!(peers.iter().all(|p| p.ip() == SNAT));

    // UDP.
    let server = udp_server(&t.server.name, 5353, 1).unwrap();
    let (seen, from) = udp_ask(&t.client.name, (VIP, 53).into()).unwrap();
    assert!(seen.starts_with(&format!("{SNAT}:")), "server saw {seen}");
    assert_eq!(from, (VIP, 53).into());
    server.join().unwrap().unwrap();

    // ICMP port unreachable from the server comes back translated.
    udp_expect_refused(&t.client.name, (VIP, 54).into()).unwrap();

    // Ping.
    let out = t.client.exec(&["ping", "-c", "2", "-W", "2", &VIP.to_string()]).unwrap();
    assert!(out.contains(&format!("from {VIP}")), "{out}");

    assert!(t.tables.counter(Counter::IcmpErrorsTranslated).unwrap() >= 1);
    assert!(t.tables.counter(Counter::NewFlows).unwrap() >= 5);
    assert_eq!(t.tables.counter(Counter::DropRewriteFailed).unwrap(), 0);
}

#[test]
fn traffic_through_netlink_attach() {
    scenario(AttachMode::Netlink);
}

#[test]
fn traffic_through_tcx_attach() {
    scenario(AttachMode::Tcx);
}

/// Packets the namespace's FORWARD chain saw toward the server.
fn forwarded(t: &NatTopology) -> u64 {
    let out = t.nat.exec(&["iptables", "-w", "-nvx", "-L", "FORWARD"]).unwrap();
    out.lines().find(|l| l.contains("10.0.2.2")).and_then(|l| l.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

/// The TTL of one UDP datagram to 5353 as the server's interface saw it.
fn ttl_at_server(t: &NatTopology) -> String {
    let dump = std::thread::spawn({
        let ns = t.server.name.clone();
        move || {
            lbagent_tests::net::in_ns(
                &ns,
                &["timeout", "5", "tcpdump", "-l", "-n", "-v", "-c", "1", "-i", "any", "udp", "dst", "port", "5353"],
            )
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(700));
    let server = udp_server(&t.server.name, 5353, 1).unwrap();
    udp_ask(&t.client.name, (VIP, 53).into()).unwrap();
    server.join().unwrap().unwrap();
    let out = dump.join().unwrap().unwrap_or_default();
    out.split("ttl ").nth(1).and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next()).unwrap_or("?").to_string()
}

/// The fast path hands translated packets to the egress interface from the
/// program: the namespace's FORWARD chain sees (almost) none of them, the
/// server sees TTL − 1 as from a router; with the fast path off (the
/// default) the stack forwards every one, with the same TTL.
#[test]
fn the_fast_path_bypasses_the_stack_and_forwards_like_a_router() {
    if !require_root() {
        return;
    }
    let t = NatTopology::new(AttachMode::Netlink).unwrap();
    let fast = lbagent_common::NAT_CFG_FAST_PATH;
    t.tables.set_config(lbagent_common::NatConfig { flags: fast, ..Default::default() }).unwrap();
    t.nat.exec(&["iptables", "-w", "-I", "FORWARD", "-d", "10.0.2.2", "-j", "ACCEPT"]).unwrap();
    let transfer = || {
        let server = tcp_echo_server(&t.server.name, 8080, 1).unwrap();
        tcp_echo(&t.client.name, (VIP, 80).into(), 1 << 20).unwrap();
        server.join().unwrap().unwrap();
    };
    transfer();
    let fast = forwarded(&t);
    assert_eq!(ttl_at_server(&t), "63", "one hop: TTL 64 - 1");
    // Off: the same transfer through the namespace's stack.
    t.tables.set_config(lbagent_common::NatConfig::default()).unwrap();
    let before = forwarded(&t);
    transfer();
    let slow = forwarded(&t) - before;
    assert_eq!(ttl_at_server(&t), "63", "the stack decrements it the same way");
    eprintln!("FORWARD chain: {fast} packets with the fast path, {slow} without");
    assert!(fast <= 5, "the fast path leaves only the first packets (neighbour resolution) to the stack: {fast}");
    assert!(slow >= 20, "without it the stack forwards every packet: {slow}");
}
