//! Each zone's share of the conntrack tables (`lbagent-ebpf/src/zone_ct.rs`):
//! one tenant filling its share of `ct`, another's SYN flood at its share of
//! `ct_new`, and a third that keeps its established flows and still opens
//! new ones. Program tests (BPF_PROG_TEST_RUN): three zones' programs over
//! one set of maps, tables small enough to fill.

use lbagent::dataplane::loader::ZoneProgram;
use lbagent_common::*;
use lbagent_tests::{
    engine::{TC_ACT_OK, TC_ACT_SHOT, TestZone, run_program},
    fixture::*,
    packet::{ACK, Ip, SYN, frame, summary},
    require_root,
};

/// 512 flows fit in `ct`, 128 in `ct_new`.
const CT_MAX: u32 = 1024;
const A: u16 = ZONE;
const B: u16 = ZONE + 1;
const C: u16 = ZONE + 2;

/// Zone `zone`'s client number `i` (outside every SNAT rule).
fn client(zone: u16, i: u32) -> [u8; 4] {
    [192, zone as u8, (i / 250) as u8, (i % 250) as u8 + 1]
}

/// SYN, SYN-ACK, ACK of client `i` of zone `zone` to its VIP:80; the
/// verdict of the SYN.
fn handshake(prog: &mut ZoneProgram, zone: u16, i: u32) -> u32 {
    let c = client(zone, i);
    let (rc, _) = run_program(prog, &frame(&Ip::new(c, VIP), &tcp(SYN, 40000, 80, b""))).unwrap();
    run_program(prog, &frame(&Ip::new(SERVER, c), &tcp(SYN | ACK, 8080, 40000, b""))).unwrap();
    run_program(prog, &frame(&Ip::new(c, VIP), &tcp(ACK, 40000, 80, b""))).unwrap();
    rc
}

/// Whether client `i` of zone `zone` still reaches its backend (a data
/// segment of its flow is translated).
fn alive(prog: &mut ZoneProgram, zone: u16, i: u32) -> bool {
    let c = client(zone, i);
    let (rc, out) = run_program(prog, &frame(&Ip::new(c, VIP), &tcp(ACK, 40000, 80, b"data"))).unwrap();
    rc == TC_ACT_OK && summary(&out).dst == SERVER
}

#[test]
fn a_tenant_cannot_take_another_tenants_conntrack() {
    if !require_root() {
        return;
    }
    let e = TestZone::with_ct_max(A, Some(CT_MAX)).unwrap();
    let mut a = e.zone_program(A).unwrap();
    let mut b = e.zone_program(B).unwrap();
    let mut c = e.zone_program(C).unwrap();
    for (zone, id) in [(A, 1), (B, 2), (C, 3)] {
        let mut rule = dnat(PROTO_TCP, 80, id, &[(SERVER, 8080)]);
        rule.zone = zone;
        e.tables.set_dnat(&rule).unwrap();
    }
    // Shares that add up to at most each table: A 100 + 20, B and C 200 + 40.
    e.tables.set_zone_ct_limits(A, ZoneCtLimits { established: 100, new: 20 }).unwrap();
    for zone in [B, C] {
        e.tables.set_zone_ct_limits(zone, ZoneCtLimits { established: 200, new: 40 }).unwrap();
    }

    // A tries to hold more flows than the whole of `ct`: it gets its share
    // there, then its share of `ct_new`, then its SYNs are dropped.
    let dropped = (0..600).filter(|&i| handshake(&mut a, A, i) == TC_ACT_SHOT).count();
    let zones = e.tables.zone_ct().unwrap();
    assert_eq!(zones[&A].flows, ZoneCtFlows { established: 100, new: 20 }, "A at its shares");
    assert_eq!(dropped, 480, "A's flows beyond both shares are refused");
    // Each refused handshake: its SYN and its ACK (a packet that could open
    // a flow mid-stream) are refused.
    assert_eq!(zones[&A].refused.new, 2 * 480);
    assert!(zones[&A].refused.established >= 20, "promotions refused: {:?}", zones[&A].refused);
    assert!((0..100).all(|i| alive(&mut a, A, i)), "A's flows within its share work");

    // B's flows are established (promoted to `ct`: A left room).
    for i in 0..10 {
        assert_eq!(handshake(&mut b, B, i), TC_ACT_OK);
    }
    assert_eq!(e.tables.zone_ct().unwrap()[&B].flows, ZoneCtFlows { established: 10, new: 0 });

    // C floods SYNs: 2 000 half-open flows, 16 times what `ct_new` holds;
    // B opens a new flow after every 200 of them.
    let mut refused = 0;
    for i in 0..2000u32 {
        let src = client(C, i);
        let (rc, _) = run_program(&mut c, &frame(&Ip::new(src, VIP), &tcp(SYN, 1024, 80, b""))).unwrap();
        refused += usize::from(rc == TC_ACT_SHOT);
        if i % 200 == 199 {
            let n = 10 + i / 200;
            assert_eq!(handshake(&mut b, B, n), TC_ACT_OK, "B opens a new flow during the flood");
        }
    }
    let zones = e.tables.zone_ct().unwrap();
    assert_eq!(zones[&C].flows.new, 40, "C holds its share of ct_new");
    assert_eq!((refused as u64, zones[&C].refused.new), (1960, 1960), "every refusal counted");

    // B: its established flows survived, and it still opens new ones.
    assert!((0..10).all(|i| alive(&mut b, B, i)), "B's established flows survive C's flood");
    assert!((10..20).all(|i| alive(&mut b, B, i)), "B's flows opened during the flood work");
    assert_eq!(e.tables.zone_ct().unwrap()[&B].flows.established, 20);
    // Both tables hold what the shares allow and no more.
    assert_eq!(e.tables.conntrack_table(MAP_CT).unwrap().len(), 2 * (100 + 20));

    // The agent's recount agrees with the program's counts.
    assert_eq!(e.tables.recount_zone_flows().unwrap(), 0, "nothing to correct");
    // A zone removed: its entries go (its id may be reused).
    e.tables.clear_zone_ct(C).unwrap();
    assert!(!e.tables.zone_ct().unwrap().contains_key(&C));
}

/// A flow's count is taken down once when it expires, and a count that ran
/// below zero (flows counted before the maps existed) never makes a limit
/// refuse: it reads as zero until the agent's recount.
#[test]
fn counts_follow_expiry_and_never_wrap_into_a_refusal() {
    if !require_root() {
        return;
    }
    let e = TestZone::with_ct_max(A, Some(CT_MAX)).unwrap();
    let mut a = e.zone_program(A).unwrap();
    e.tables.set_dnat(&dnat(PROTO_TCP, 80, 1, &[(SERVER, 8080)])).unwrap();
    e.tables.set_zone_ct_limits(A, ZoneCtLimits { established: 5, new: 5 }).unwrap();
    // Five half-open flows, then a timeout of 1 s for them.
    for i in 0..5 {
        let (rc, _) = run_program(&mut a, &frame(&Ip::new(client(A, i), VIP), &tcp(SYN, 40000, 80, b""))).unwrap();
        assert_eq!(rc, TC_ACT_OK);
    }
    let (rc, _) = run_program(&mut a, &frame(&Ip::new(client(A, 5), VIP), &tcp(SYN, 40000, 80, b""))).unwrap();
    assert_eq!(rc, TC_ACT_SHOT, "the sixth is over the share");
    e.tables.set_config(NatConfig { tcp_new_s: 1, ..Default::default() }).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2100));
    // Each expired flow, met again (by its late answer, which opens
    // nothing), is taken down exactly once: the share is free again.
    for i in 0..5 {
        run_program(&mut a, &frame(&Ip::new(SERVER, client(A, i)), &tcp(SYN | ACK, 8080, 40000, b""))).unwrap();
        run_program(&mut a, &frame(&Ip::new(SERVER, client(A, i)), &tcp(SYN | ACK, 8080, 40000, b""))).unwrap();
    }
    assert_eq!(e.tables.zone_ct().unwrap()[&A].flows.new, 0, "five flows expired, five taken down");
    e.tables.set_config(NatConfig::default()).unwrap();
    for i in 10..15 {
        let (rc, _) = run_program(&mut a, &frame(&Ip::new(client(A, i), VIP), &tcp(SYN, 40000, 80, b""))).unwrap();
        assert_eq!(rc, TC_ACT_OK, "the freed share opens flows again");
    }
    // Counts that ran below zero (as after an upgrade) read as zero.
    e.tables.recount_zone_flows().unwrap();
    e.tables.set_zone_ct_limits(A, ZoneCtLimits { established: 5, new: 1 }).unwrap();
    let mut map = e.tables.hash(MAP_ZONE_CT_FLOWS).unwrap();
    map.insert(&u32::from(A), &ZoneCtFlows { established: 0, new: u64::MAX - 3 }, 0).unwrap();
    let (rc, _) = run_program(&mut a, &frame(&Ip::new(client(A, 9), VIP), &tcp(SYN, 40001, 80, b""))).unwrap();
    assert_eq!(rc, TC_ACT_OK, "a wrapped count does not refuse");
}
