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

    assert!(t.tables.counter(Counter::IcmpErrorXlated).unwrap() >= 1);
    assert!(t.tables.counter(Counter::NewFlows).unwrap() >= 5);
    assert_eq!(t.tables.counter(Counter::DropRewrite).unwrap(), 0);
}

#[test]
fn traffic_through_netlink_attach() {
    scenario(AttachMode::Netlink);
}

#[test]
fn traffic_through_tcx_attach() {
    scenario(AttachMode::Tcx);
}
