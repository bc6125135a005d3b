//! Rule sync (`dataplane::sync` through the agent's `Engine`) against the
//! real maps and program: rule changes never open a window (a rule id moved
//! to another key keeps its backends), UDP flows leave a backend that left
//! its rule while TCP flows drain, and a pass repairs what changed behind
//! the agent's back.

use lbagent::{
    dataplane::{attach::AttachMode, engine, tables::DnatSpec},
    outcome::Changes,
};
use lbagent_common::*;
use lbagent_tests::{
    engine::TestZone,
    fixture::*,
    packet::{self, Ip, SYN, frame},
};

/// One sync of the fixture's zone, as a pass of the agent does it.
fn sync_dnat(e: &TestZone, want: &[DnatSpec]) -> Changes {
    let mut agent = engine::Engine::new(e.pins.root.clone(), AttachMode::Netlink);
    let mut out = Changes::new();
    agent.sync_zone(ZONE, want, None, &mut out).unwrap();
    out
}

#[test]
fn a_rule_id_moved_to_another_port_keeps_its_backends() {
    let Some(mut e) = engine() else { return };
    // A listener's port changes from 5000 to 5001; its rule id stays.
    sync_dnat(&e, &[dnat(PROTO_TCP, 5000, 40, &[(SERVER, 8080)])]);
    sync_dnat(&e, &[dnat(PROTO_TCP, 5001, 40, &[(SERVER, 8080)])]);
    let rules = e.tables.dnat_rules().unwrap();
    let (_, _, backends) = rules.iter().find(|(k, _, _)| k.port == 5001 && k.zone == ZONE).unwrap();
    assert_eq!(backends.len(), 1, "the moved rule kept its backend");
    expect(
        &mut e,
        frame(&Ip::new([192, 0, 2, 7], VIP), &tcp(SYN, 33000, 5001, b"")),
        frame(&Ip::new([192, 0, 2, 7], SERVER), &tcp(SYN, 33000, 8080, b"")),
    );
}

#[test]
fn udp_flows_leave_a_removed_backend_and_tcp_flows_drain() {
    let Some(mut e) = engine() else { return };
    let both = [(SERVER, 5353), (SERVER2, 5353)];
    sync_dnat(&e, &[dnat(PROTO_UDP, 53, 2, &both), dnat(PROTO_TCP, 80, 1, &[(SERVER, 8080), (SERVER2, 8080)])]);
    let client = [192, 0, 2, 9];
    let mut on_server2 = Vec::new();
    for sport in 1000..1032u16 {
        let (_, out) = e.run(&frame(&Ip::new(client, VIP), &udp(sport, 53, b"q"))).unwrap();
        if packet::summary(&out).dst == SERVER2 {
            on_server2.push(sport);
        }
    }
    let (_, out) = e.run(&frame(&Ip::new(client, VIP), &tcp(SYN, 2000, 80, b""))).unwrap();
    let tcp_backend = packet::summary(&out).dst;
    assert!(!on_server2.is_empty(), "some UDP flows on the backend we remove");
    // SERVER2 leaves both rules (removed, or down in its health check).
    let changes =
        sync_dnat(&e, &[dnat(PROTO_UDP, 53, 2, &[(SERVER, 5353)]), dnat(PROTO_TCP, 80, 1, &[(SERVER, 8080)])]);
    assert!(
        changes.iter().any(|c| c == &format!("flushed {} UDP flows of backends that left", on_server2.len())),
        "{changes:?}"
    );
    for sport in &on_server2 {
        let (_, out) = e.run(&frame(&Ip::new(client, VIP), &udp(*sport, 53, b"q"))).unwrap();
        assert_eq!(packet::summary(&out).dst, SERVER, "UDP flow {sport} moved to the remaining backend");
    }
    let (_, out) = e.run(&frame(&Ip::new(client, VIP), &tcp(SYN, 2000, 80, b""))).unwrap();
    assert_eq!(packet::summary(&out).dst, tcp_backend, "the TCP flow keeps its backend (drains)");
}

#[test]
fn a_pass_reads_the_maps_once_and_repairs_what_changed_behind_its_back() {
    let Some(e) = engine() else { return };
    let mut agent = engine::Engine::new(e.pins.root.clone(), AttachMode::Netlink);
    let rule = dnat(PROTO_TCP, 443, 41, &[(SERVER, 8443)]);
    let mut out = Changes::new();
    agent.sync_zone(ZONE, std::slice::from_ref(&rule), None, &mut out).unwrap();
    assert!(out.iter().any(|c| c.contains("port 443")), "{out:?}");
    // Someone deletes the rule by hand; within a pass the agent trusts what it wrote...
    e.tables.remove_dnat(&rule.key()).unwrap();
    out = Changes::new();
    agent.sync_zone(ZONE, std::slice::from_ref(&rule), None, &mut out).unwrap();
    assert!(out.is_empty(), "{out:?}");
    // ...and the next pass reads the maps again and puts it back.
    agent.begin_pass();
    agent.sync_zone(ZONE, std::slice::from_ref(&rule), None, &mut out).unwrap();
    assert_eq!(&out[..], ["dnat 198.51.100.10 proto 6 port 443 -> [(10.0.2.2, 8443)]"]);
    assert!(e.tables.dnat_rules().unwrap().iter().any(|(k, _, _)| *k == rule.key()));
}

#[test]
fn a_changed_acl_flushes_the_flows_it_now_refuses() {
    let Some(mut e) = engine() else { return };
    let acl = |cidr: ([u8; 4], u8)| {
        let mut d = dnat(PROTO_TCP, 80, 1, &[(SERVER, 8080)]);
        d.acl = Some(lbagent::dataplane::tables::AclSpec { allow: true, cidrs: vec![(a(cidr.0), cidr.1)] });
        d
    };
    sync_dnat(&e, &[acl((CLIENT, 32))]);
    open_tcp(&mut e);
    assert_eq!(e.tables.conntrack().unwrap().len(), 2);
    let changes = sync_dnat(&e, &[acl((CLIENT2, 32))]);
    assert!(changes.iter().any(|c| c == "ACL changed: flushed 1 flows"), "{changes:?}");
    assert!(e.tables.conntrack().unwrap().is_empty());
    let (rc, _) = e.run(&frame(&Ip::new(CLIENT, VIP), &tcp(SYN, 24000, 80, b""))).unwrap();
    assert_eq!(rc, lbagent_tests::engine::TC_ACT_SHOT, "refused now");
}

/// A narrowed ACL flushes only the flows it now refuses: an allowed
/// client's open flow stays (and keeps flowing), a refused one's goes; a
/// deny list and a removed ACL likewise flush only what they refuse.
#[test]
fn a_changed_acl_keeps_the_flows_it_still_accepts() {
    let Some(mut e) = engine() else { return };
    let acl = |allow: bool, cidrs: &[([u8; 4], u8)]| {
        let mut d = dnat(PROTO_TCP, 80, 1, &[(SERVER, 8080)]);
        let cidrs = cidrs.iter().map(|(x, l)| (a(*x), *l)).collect();
        d.acl = Some(lbagent::dataplane::tables::AclSpec { allow, cidrs });
        d
    };
    let open = |e: &mut TestZone, client: [u8; 4]| {
        let (rc, _) = e.run(&frame(&Ip::new(client, VIP), &tcp(SYN, 24000, 80, b""))).unwrap();
        assert_eq!(rc, lbagent_tests::engine::TC_ACT_OK);
    };
    let clients = |e: &TestZone| -> Vec<[u8; 4]> {
        let mut c: Vec<_> = e
            .tables
            .conntrack()
            .unwrap()
            .into_iter()
            .filter(|(_, x)| x.flags & CT_F_REPLY == 0)
            .map(|(k, _)| k.saddr)
            .collect();
        c.sort();
        c
    };
    sync_dnat(&e, &[acl(true, &[(CLIENT, 32), (CLIENT2, 32)])]);
    open(&mut e, CLIENT);
    open(&mut e, CLIENT2);
    assert_eq!(clients(&e), vec![CLIENT, CLIENT2]);
    // Allow list narrowed to CLIENT: CLIENT2's flow goes, CLIENT's stays.
    let changes = sync_dnat(&e, &[acl(true, &[(CLIENT, 32)])]);
    assert!(changes.iter().any(|c| c == "ACL changed: flushed 1 flows"), "{changes:?}");
    assert_eq!(clients(&e), vec![CLIENT]);
    expect(
        &mut e,
        frame(&Ip::new(CLIENT, VIP), &tcp(packet::ACK, 24000, 80, b"still")),
        frame(&Ip::new(SNAT, SERVER), &tcp(packet::ACK, 24000, 8080, b"still")),
    );
    // A deny list that does not list CLIENT: nothing to flush.
    let changes = sync_dnat(&e, &[acl(false, &[(CLIENT2, 32)])]);
    assert!(changes.iter().any(|c| c == "ACL changed: flushed 0 flows"), "{changes:?}");
    assert_eq!(clients(&e), vec![CLIENT]);
    // ACL removed: everyone is accepted, nothing flushed.
    sync_dnat(&e, &[dnat(PROTO_TCP, 80, 1, &[(SERVER, 8080)])]);
    assert_eq!(clients(&e), vec![CLIENT]);
    // A deny list of CLIENT's /24: flushed.
    sync_dnat(&e, &[acl(false, &[([10, 0, 1, 0], 24)])]);
    assert!(clients(&e).is_empty());
}

/// Two listeners that swap ports in one change keep their backends after
/// that one pass (the rule ids move with them; neither write may delete the
/// other's backends).
#[test]
fn listeners_that_swap_ports_keep_their_backends() {
    let Some(mut e) = engine() else { return };
    let rules =
        |p1: u16, p2: u16| [dnat(PROTO_TCP, p1, 41, &[(SERVER, 8080)]), dnat(PROTO_TCP, p2, 42, &[(SERVER2, 8081)])];
    sync_dnat(&e, &rules(5000, 5001));
    sync_dnat(&e, &rules(5001, 5000));
    let stored = e.tables.dnat_rules().unwrap();
    for (port, id) in [(5001, 41), (5000, 42)] {
        let (_, r, backends) = stored.iter().find(|(k, _, _)| k.port == port && k.zone == ZONE).unwrap();
        assert_eq!((r.rule_id, backends.len()), (id, 1), "port {port}: {stored:?}");
    }
    let client = [192, 0, 2, 7];
    expect(
        &mut e,
        frame(&Ip::new(client, VIP), &tcp(SYN, 33000, 5001, b"")),
        frame(&Ip::new(client, SERVER), &tcp(SYN, 33000, 8080, b"")),
    );
    expect(
        &mut e,
        frame(&Ip::new(client, VIP), &tcp(SYN, 33001, 5000, b"")),
        frame(&Ip::new(client, SERVER2), &tcp(SYN, 33001, 8081, b"")),
    );
}
