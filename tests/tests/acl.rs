//! Listener ACLs in the program (`rules::acl_accepts`) on crafted packets via
//! BPF_PROG_TEST_RUN: an allow list admits only its sources, a deny list
//! refuses its sources; refused new flows are dropped before any NAT and
//! counted per rule; the ACL's entries follow the rule.

use lbagent::dataplane::tables::{AclSpec, DnatSpec};
use lbagent_common::*;
use lbagent_tests::{
    engine::{TC_ACT_SHOT, TestZone},
    fixture::*,
    packet::{Ip, SYN, frame},
};

fn with_acl(mut d: DnatSpec, allow: bool, cidrs: &[([u8; 4], u8)]) -> DnatSpec {
    d.acl = Some(AclSpec { allow, cidrs: cidrs.iter().map(|(x, l)| (a(*x), *l)).collect() });
    d
}

fn refused(e: &mut TestZone, f: Vec<u8>) {
    let (rc, _) = e.run(&f).unwrap();
    assert_eq!(rc, TC_ACT_SHOT);
}

fn acl_drops(e: &TestZone, rule: u32) -> u64 {
    e.tables.rule_stats().unwrap().into_iter().find(|(id, _)| *id == rule).map(|(_, s)| s.refused).unwrap_or(0)
}

#[test]
fn an_allow_list_admits_only_its_sources() {
    let Some(mut e) = engine() else { return };
    e.tables.set_dnat(&with_acl(dnat(PROTO_TCP, 80, 1, &[(SERVER, 8080)]), true, &[(CLIENT, 32)])).unwrap();
    open_tcp(&mut e);
    refused(&mut e, frame(&Ip::new(CLIENT2, VIP), &tcp(SYN, 24000, 80, b"")));
    assert_eq!(e.tables.counter(Counter::DropAcl).unwrap(), 1);
    assert_eq!(acl_drops(&e, 1), 1);
    assert_eq!(e.tables.conntrack().unwrap().len(), 2, "only the admitted flow");
}

#[test]
fn a_deny_list_refuses_its_sources_udp() {
    let Some(mut e) = engine() else { return };
    e.tables.set_dnat(&with_acl(dnat(PROTO_UDP, 53, 2, &[(SERVER, 5353)]), false, &[([10, 0, 1, 0], 24)])).unwrap();
    refused(&mut e, frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q")));
    let other = [192, 0, 2, 9];
    expect(
        &mut e,
        frame(&Ip::new(other, VIP), &udp(25000, 53, b"q")),
        frame(&Ip::new(other, SERVER), &udp(25000, 5353, b"q")),
    );
    assert_eq!(acl_drops(&e, 2), 1);
}

#[test]
fn acl_entries_follow_their_rule() {
    let Some(e) = engine() else { return };
    let rule = dnat(PROTO_TCP, 80, 1, &[(SERVER, 8080)]);
    e.tables.set_dnat(&with_acl(rule.clone(), true, &[(CLIENT, 32), ([10, 0, 9, 0], 24)])).unwrap();
    assert_eq!(e.tables.acl_entries().unwrap().len(), 2);
    // Narrowed: the dropped prefix goes.
    e.tables.set_dnat(&with_acl(rule.clone(), true, &[(CLIENT, 32)])).unwrap();
    let entries = e.tables.acl_entries().unwrap();
    assert_eq!(entries, vec![(ACL_KEY_FIXED_BITS + 32, AclKey { rule_id: 1, addr: CLIENT })]);
    // No ACL any more, then the rule removed: nothing left.
    e.tables.set_dnat(&rule).unwrap();
    assert!(e.tables.acl_entries().unwrap().is_empty());
    e.tables.set_dnat(&with_acl(rule.clone(), false, &[(CLIENT, 32)])).unwrap();
    e.tables.remove_dnat(&rule.key()).unwrap();
    assert!(e.tables.acl_entries().unwrap().is_empty());
}
