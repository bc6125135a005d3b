//! Conntrack as a whole flow: paired halves that are repaired, never shared
//! and never split; established flows kept apart from new ones; the TCP and
//! UDP lifecycles; ports freed by expired flows; source-port choice and
//! collisions, eviction when full, garbage collection, zones kept apart,
//! flush by selector (`lbagent-ebpf/src/conntrack.rs`). Program tests
//! (BPF_PROG_TEST_RUN) on the shared fixture.

use std::collections::HashSet;

use lbagent_common::*;
use lbagent_tests::{
    engine::{TC_ACT_OK, TestZone},
    fixture::*,
    packet::{self, ACK, FIN, Ip, L4, RST, SYN, frame, verify},
    require_root,
};

/// A flow written from outside the program (`FlowWriter`, as an upgrade
/// copies the previous layout's flows) is the flow the program finds: its
/// halves, written back into their table, translate the flow's next packets
/// both ways as before, and a half either table holds is left as it is.
#[test]
fn a_flow_written_from_outside_is_the_one_the_program_finds() {
    use lbagent::dataplane::tables::HalfWritten;
    let Some(mut e) = engine() else { return };
    let ends = |out: &[u8]| {
        let s = packet::summary(out);
        (s.src, s.dst, s.sport, s.dport)
    };
    let q = frame(&Ip::new(CLIENT, VIP), &udp(26001, 53, b"q"));
    let (rc, first) = e.run(&q).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    let halves = e.tables.conntrack_table(MAP_CT_NEW).unwrap();
    assert_eq!(halves.len(), 2, "{halves:?}");
    for (k, _) in &halves {
        assert!(e.tables.remove_conntrack_entry(k).unwrap());
    }
    let mut w = e.tables.flow_writer().unwrap();
    for (k, v) in &halves {
        assert_eq!(w.insert_half(k, v, false), HalfWritten::Inserted);
    }
    for (k, v) in &halves {
        assert_eq!(w.insert_half(k, v, true), HalfWritten::Present, "written over a half ct_new holds");
    }
    assert!(e.tables.conntrack_table(MAP_CT).unwrap().is_empty(), "a half went into ct");
    let (rc, again) = e.run(&q).unwrap();
    assert_eq!((rc, ends(&again)), (TC_ACT_OK, ends(&first)));
    let (sport, dport) = (packet::summary(&first).sport, packet::summary(&first).dport);
    let (rc, answer) = e.run(&frame(&Ip::new(SERVER, SNAT), &udp(dport, sport, b"a"))).unwrap();
    assert_eq!((rc, ends(&answer)), (TC_ACT_OK, (VIP, CLIENT, 53, 26001)));
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 1, "the flow was opened again");
}

/// A peer's copy of a flow (`FlowWriter::put_flow`, what an HA standby
/// writes from its original half alone) is the flow the program finds: the
/// reply half is derived as the program derives it, and the copy
/// translates the flow's next packets both ways without opening it again.
/// Written again as established, the same flow moves into `ct` (both
/// halves) with its state; a copy of a later flow of the tuple (created
/// 10 s after, another translation) replaces the earlier flow and its pair.
#[test]
fn a_peers_copy_of_a_flow_is_the_one_the_program_finds() {
    use lbagent::dataplane::tables::FlowPut;
    let Some(mut e) = engine() else { return };
    let ends = |out: &[u8]| {
        let s = packet::summary(out);
        (s.src, s.dst, s.sport, s.dport)
    };
    let q = frame(&Ip::new(CLIENT, VIP), &udp(26101, 53, b"q"));
    let (rc, first) = e.run(&q).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    let orig = udp_key(26101);
    let made = entry(&e, &orig).expect("the flow's original half");
    for (k, _) in e.tables.conntrack().unwrap() {
        assert!(e.tables.remove_conntrack_entry(&k).unwrap());
    }
    // What a record carries: the translation, state, times, rules, and
    // the translation flags (no sequence tracking).
    let copy =
        CtEntry { seq_end: 0, max_win: 0, wscale: CT_WSCALE_NONE, flags: made.flags & (CT_F_SNAT | CT_F_DNAT), ..made };
    let mut w = e.tables.flow_writer().unwrap();
    assert_eq!(w.put_flow(&orig, &copy, false), FlowPut::Inserted);
    let halves = e.tables.conntrack_table(MAP_CT_NEW).unwrap();
    assert_eq!(halves.len(), 2, "{halves:?}");
    let reply = entry(&e, &copy.xlate.reversed()).expect("the derived reply half");
    assert_eq!(reply.xlate, orig.reversed());
    assert_eq!(reply.flags, copy.flags | CT_F_REPLY);
    let (rc, again) = e.run(&q).unwrap();
    assert_eq!((rc, ends(&again)), (TC_ACT_OK, ends(&first)));
    let (sport, dport) = (packet::summary(&first).sport, packet::summary(&first).dport);
    let (rc, answer) = e.run(&frame(&Ip::new(SERVER, SNAT), &udp(dport, sport, b"a"))).unwrap();
    assert_eq!((rc, ends(&answer)), (TC_ACT_OK, (VIP, CLIENT, 53, 26101)));
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 1, "the flow was opened again");

    // The same flow, established on the peer: both halves move into ct.
    let established = CtEntry { state: CT_ESTABLISHED, ..copy };
    assert_eq!(w.put_flow(&orig, &established, true), FlowPut::Refreshed);
    let ct = e.tables.conntrack_table(MAP_CT).unwrap();
    assert_eq!(ct.len(), 2, "{ct:?}");
    assert!(ct.iter().all(|(_, v)| v.state == CT_ESTABLISHED), "{ct:?}");
    assert!(e.tables.conntrack_table(MAP_CT_NEW).unwrap().is_empty());

    // A later flow of the tuple with another translation replaces it.
    let later = CtEntry {
        created_ms: copy.created_ms.wrapping_add(10_000),
        xlate: Tuple { sport: copy.xlate.sport.wrapping_add(1), ..copy.xlate },
        ..copy
    };
    assert_eq!(w.put_flow(&orig, &later, false), FlowPut::Replaced);
    let all = e.tables.conntrack().unwrap();
    assert_eq!(all.len(), 2, "the earlier flow's halves are gone: {all:?}");
    assert_eq!(entry(&e, &orig).unwrap().xlate, later.xlate);
    assert!(entry(&e, &copy.xlate.reversed()).is_none(), "the earlier reply half is gone");
    assert_eq!(entry(&e, &later.xlate.reversed()).unwrap().xlate, orig.reversed());
}

/// The previous layout's entry of a half (what its programs wrote).
fn previous(e: &CtEntry) -> CtEntryPrev {
    CtEntryPrev {
        xlate: e.xlate,
        last_seen_ns: e.last_seen_ns,
        created_ns: u64::from(e.created_ms) * 1_000_000 + 123_456,
        dnat_rule: e.dnat_rule,
        snat_rule: e.snat_rule,
        seq_end: e.seq_end,
        max_win: e.max_win,
        flags: e.flags,
        state: e.state,
        wscale: e.wscale,
        ..Default::default()
    }
}

/// During an upgrade the programs adopt the previous layout's flows
/// (`ct_prev`, `ct_new_prev`, flagged in `ct_adopt`): a flow found only
/// there keeps its translation both ways and comes back converted into
/// the same table, marked adopted there, so a flow closed or freed since is
/// not adopted again; a half whose pair leads elsewhere is stale and is
/// not adopted; a translated tuple held there is taken for a new flow; a
/// flush reaches them. Without the flag the previous tables are not read.
#[test]
fn an_upgrade_adopts_the_previous_layouts_flows() {
    let Some(mut e) = engine() else { return };
    let ends = |out: &[u8]| {
        let s = packet::summary(out);
        (s.src, s.dst, s.sport, s.dport)
    };
    let move_to_previous = |e: &TestZone| {
        let halves = e.tables.conntrack_table(MAP_CT_NEW).unwrap();
        let mut prev = e.tables.hash(MAP_CT_NEW_PREV).unwrap();
        for (k, v) in &halves {
            assert!(e.tables.remove_conntrack_entry(k).unwrap());
            prev.insert(k, &previous(v), 0).unwrap();
        }
        halves
    };
    // A UDP flow, moved into the previous layout's `ct_new`.
    let q = frame(&Ip::new(CLIENT, VIP), &udp(26002, 53, b"q"));
    let (rc, first) = e.run(&q).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    let halves = move_to_previous(&e);
    assert_eq!(halves.len(), 2, "{halves:?}");
    e.tables.set_adopting(true).unwrap();
    assert!(e.tables.adopting().unwrap());
    let (rc, again) = e.run(&q).unwrap();
    assert_eq!((rc, ends(&again)), (TC_ACT_OK, ends(&first)), "the adopted flow keeps its translation");
    let (sport, dport) = (packet::summary(&first).sport, packet::summary(&first).dport);
    let (rc, answer) = e.run(&frame(&Ip::new(SERVER, SNAT), &udp(dport, sport, b"a"))).unwrap();
    assert_eq!((rc, ends(&answer)), (TC_ACT_OK, (VIP, CLIENT, 53, 26002)));
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 1, "the flow was opened again");
    let now = e.tables.conntrack_table(MAP_CT_NEW).unwrap();
    for (k, v) in &halves {
        let (_, adopted) = now.iter().find(|(n, _)| n == k).unwrap_or_else(|| panic!("{k:?} not adopted: {now:?}"));
        assert_eq!((adopted.xlate, adopted.created_ms, adopted.flags), (v.xlate, v.created_ms, v.flags), "{k:?}");
    }
    assert_pairs_consistent(&e);
    let marked = e.tables.hash(MAP_CT_NEW_PREV).unwrap();
    for (k, _) in &halves {
        assert_eq!(marked.get(k, 0).unwrap().adopted, 1, "{k:?} marked adopted");
    }
    // Freed in this layout (as a GC pass or a close does): the marked
    // halves are not adopted again, q opens a new flow.
    for (k, _) in &halves {
        assert!(e.tables.remove_conntrack_entry(k).unwrap());
    }
    assert_eq!(e.run(&q).unwrap().0, TC_ACT_OK);
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 2, "q's flow, freed, came back");
    for (k, _) in &halves {
        assert!(e.tables.remove_conntrack_entry(k).unwrap());
        let mut prev = e.tables.hash(MAP_CT_NEW_PREV).unwrap();
        prev.remove(k).unwrap();
    }

    // A stale half: its pair leads to another flow. Not adopted; the
    // packet opens a flow of its own, on another translation.
    let stale = Tuple { saddr: CLIENT, daddr: VIP, sport: 26004, dport: 53, proto: PROTO_UDP, _pad0: 0, zone: ZONE };
    let taken = Tuple { saddr: SERVER, daddr: SNAT, sport: 5353, dport: 40000, proto: PROTO_UDP, _pad0: 0, zone: ZONE };
    let other = Tuple { saddr: CLIENT2, sport: 26004, ..stale };
    let half = CtEntry { xlate: taken.reversed(), created_ms: 7, flags: CT_F_DNAT | CT_F_SNAT, ..Default::default() };
    let pair = CtEntry { xlate: other.reversed(), flags: half.flags | CT_F_REPLY, ..half };
    let mut prev = e.tables.hash(MAP_CT_NEW_PREV).unwrap();
    prev.insert(&stale, &previous(&half), 0).unwrap();
    prev.insert(&taken, &previous(&pair), 0).unwrap();
    let (rc, out) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(26004, 53, b"q"))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    assert_ne!(packet::summary(&out).sport, 40000, "the stale half's translation was adopted");
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 3);
    assert_eq!(prev.get(&stale, 0).unwrap().adopted, 0, "the stale half is left as it is");
    for k in [stale, taken] {
        prev.remove(&k).unwrap();
    }
    for (k, _) in e.tables.conntrack_table(MAP_CT_NEW).unwrap() {
        e.tables.remove_conntrack_entry(&k).unwrap();
    }

    // A TCP flow of the previous layout holds SNAT:24000 toward the server:
    // a new flow that would take the same tuple takes another port.
    let held = Tuple { saddr: CLIENT2, daddr: VIP, sport: 24000, dport: 80, proto: PROTO_TCP, _pad0: 0, zone: ZONE };
    let x = Tuple { saddr: SNAT, daddr: SERVER, sport: 24000, dport: 8080, ..held };
    let orig = CtEntry {
        xlate: x,
        last_seen_ns: lbagent::dataplane::tables::monotonic_ns(),
        created_ms: 1,
        flags: CT_F_DNAT | CT_F_SNAT,
        state: CT_ESTABLISHED,
        ..Default::default()
    };
    let reply = CtEntry { xlate: held.reversed(), flags: orig.flags | CT_F_REPLY, ..orig };
    let mut ct_prev = e.tables.hash(MAP_CT_PREV).unwrap();
    ct_prev.insert(&held, &previous(&orig), 0).unwrap();
    ct_prev.insert(&x.reversed(), &previous(&reply), 0).unwrap();
    let port = expect_snat(&mut e, frame(&Ip::new(CLIENT, VIP), &tcp(SYN, 24000, 80, b"")), |p| {
        frame(&Ip::new(SNAT, SERVER), &tcp(SYN, p, 8080, b""))
    });
    assert_ne!(port, 24000, "a tuple the previous layout's flow holds was taken");
    let established = e.tables.conntrack_table(MAP_CT).unwrap();
    assert!(established.iter().any(|(k, _)| *k == held), "the holder adopted into ct: {established:?}");
    assert_pairs_consistent(&e);

    // A flush reaches flows never adopted.
    let q2 = frame(&Ip::new(CLIENT2, VIP), &udp(26003, 53, b"q"));
    assert_eq!(e.run(&q2).unwrap().0, TC_ACT_OK);
    assert_eq!(e.run(&q).unwrap().0, TC_ACT_OK);
    let moved = move_to_previous(&e);
    assert_eq!(moved.len(), 6, "q's, the new TCP flow's and q2's halves: {moved:?}");
    let flushed = e.tables.flush_conntrack(|k, _| k.sport == 26003 || k.dport == 26003).unwrap();
    assert_eq!(flushed, 1);
    assert_eq!(e.tables.previous_conntrack(MAP_CT_NEW_PREV).unwrap().len(), 4, "q2's halves are gone");

    // Without the flag the previous tables are not read: q, moved back
    // there, opens a new flow.
    e.tables.set_adopting(false).unwrap();
    assert_eq!(e.run(&q).unwrap().0, TC_ACT_OK);
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 7, "a new flow for q");
}

/// An entry another CPU stamped a moment after this CPU read the clock
/// (its `last_seen_ns` ahead of this run's `now`, as when two CPUs take a
/// flow's packets in the same microsecond) is alive: the flow keeps its
/// translation and its state. A wrapped difference made it look idle for
/// centuries, and the flow was torn down and opened again (another backend
/// or SNAT port) or made a UDP stream at once.
#[test]
fn an_entry_stamped_ahead_of_this_cpus_clock_is_alive() {
    let Some(mut e) = engine() else { return };
    let ahead = || lbagent::dataplane::tables::monotonic_ns() + 1_000_000_000;
    open_tcp(&mut e);
    assert_eq!(e.edit_entries(MAP_CT_NEW, |v| v.last_seen_ns = ahead()).unwrap(), 2);
    tcp_reply(&mut e, SYN | ACK, b"");
    tcp_orig(&mut e, ACK, b"");
    // A UDP query answered, created "later" than this CPU's clock: it stays
    // a query/answer flow (not a stream before its 2 s).
    let q = frame(&Ip::new(CLIENT, VIP), &udp(26000, 53, b"q"));
    assert_eq!(e.run(&q).unwrap().0, TC_ACT_OK);
    let a = frame(&Ip::new(SERVER, SNAT), &udp(5353, 26000, b"a"));
    assert_eq!(e.run(&a).unwrap().0, TC_ACT_OK);
    e.edit_entries(MAP_CT_NEW, |v| {
        v.created_ms = lbagent_common::ct_clock_ms(ahead());
        v.last_seen_ns = ahead();
    })
    .unwrap();
    assert_eq!(e.run(&q).unwrap().0, TC_ACT_OK);
    assert_eq!(ct_state(&e, udp_key(26000)), CT_REPLIED, "a UDP query made a stream");
    assert_eq!(e.tables.counter(Counter::ExpiredFlows).unwrap(), 0, "a live flow taken for expired");
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 2, "flows opened again");
}

/// Two CPUs that take the packet completing a flow's handshake at once
/// both translate it by the flow, and the flow moves to `ct` once: both
/// halves there, none left in `ct_new`, no promotion taken for a full
/// table (the other CPU's halves already in `ct` are the flow's own), and
/// the zone's counts exact. Program test runs of each flow's ACK on both
/// CPUs at once.
#[test]
fn a_handshake_completed_on_two_cpus_at_once_promotes_the_flow_once() {
    let Some(mut e) = engine() else { return };
    const FLOWS: u16 = 5000;
    // Ports inside the SNAT range: kept, so each reply is known.
    for i in 0..FLOWS {
        let (rc, _) = e.run(&frame(&Ip::new(CLIENT, VIP), &tcp(SYN, 20000 + i, 80, b""))).unwrap();
        assert_eq!(rc, TC_ACT_OK);
        let (rc, out) = e.run(&frame(&Ip::new(SERVER, SNAT), &tcp(SYN | ACK, 8080, 20000 + i, b""))).unwrap();
        assert_eq!((rc, packet::summary(&out).dst), (TC_ACT_OK, CLIENT), "SYN-ACK {i}");
    }
    let ack = |i: usize| frame(&Ip::new(CLIENT, VIP), &tcp(ACK, 20000 + i as u16, 80, b""));
    let Some(runs) = e.race(ZONE, FLOWS as usize, ack).unwrap() else {
        assert!(std::env::var("CI").is_err(), "needs two CPUs");
        return;
    };
    for (i, step) in runs.iter().enumerate() {
        for (rc, out) in step {
            let s = packet::summary(out);
            assert_eq!((*rc, s.src, s.dst, s.sport, s.dport), (TC_ACT_OK, SNAT, SERVER, 20000 + i as u16, 8080));
        }
    }
    let ct = e.tables.conntrack_table(MAP_CT).unwrap();
    assert_eq!(ct.len(), 2 * FLOWS as usize, "both halves of every flow established");
    assert!(ct.iter().all(|(_, v)| v.state == CT_ESTABLISHED));
    assert_eq!(e.tables.conntrack_table(MAP_CT_NEW).unwrap().len(), 0, "halves left behind in ct_new");
    assert_eq!(e.tables.counter(Counter::ConntrackEstablishedFull).unwrap(), 0, "a promotion taken for a full table");
    assert_eq!(e.tables.counter(Counter::ConntrackPromoted).unwrap(), u64::from(FLOWS), "promotions");
    assert_eq!(e.tables.recount_zone_flows().unwrap(), 0, "the zone's flow counts off");
    assert_pairs_consistent(&e);
}

fn udp_key(sport: u16) -> Tuple {
    Tuple { saddr: CLIENT, daddr: VIP, sport, dport: 53, proto: PROTO_UDP, _pad0: 0, zone: ZONE }
}

fn entry(e: &TestZone, key: &Tuple) -> Option<CtEntry> {
    e.tables.conntrack().unwrap().into_iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// Every original entry's translated tuple is held by exactly one flow, and
/// every reply entry points back at its original.
fn assert_pairs_consistent(e: &TestZone) {
    let all = e.tables.conntrack().unwrap();
    let by_key: std::collections::HashMap<_, _> = all.iter().copied().collect();
    let mut xlates = HashSet::new();
    for (k, v) in &all {
        if v.flags & CT_F_REPLY == 0 {
            assert!(xlates.insert(v.xlate), "translated tuple {:?} shared", v.xlate);
            let reply = by_key.get(&v.xlate.reversed()).unwrap_or_else(|| panic!("{k:?} has no reply half"));
            assert_eq!(reply.xlate, k.reversed(), "reply half of {k:?} points elsewhere");
        }
    }
}

fn tcp_seq(flags: u8, sport: u16, dport: u16, seq: u32) -> L4 {
    L4::Tcp { sport, dport, seq, ack: 0, flags, payload: vec![] }
}

/// SYN, SYN-ACK, ACK on the fixture's TCP flow.
fn establish(e: &mut TestZone) {
    open_tcp(e);
    tcp_reply(e, SYN | ACK, b"");
    tcp_orig(e, ACK, b"");
}

#[test]
fn lost_reply_half_is_recreated_and_the_flow_keeps_its_tuple() {
    let Some(mut e) = engine() else { return };
    let q = |p: &[u8]| frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, p));
    expect(&mut e, q(b"one"), frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"one")));
    let xlate = entry(&e, &udp_key(25000)).unwrap().xlate;
    assert!(e.tables.remove_conntrack_entry(&xlate.reversed()).unwrap(), "reply half removed by hand");
    expect(&mut e, q(b"two"), frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"two")));
    assert_eq!(e.tables.counter(Counter::ConntrackPairRepaired).unwrap(), 1);
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &udp(5353, 25000, b"answer")),
        frame(&Ip::new(VIP, CLIENT), &udp(53, 25000, b"answer")),
    );
    assert_pairs_consistent(&e);
}

#[test]
fn lost_original_half_is_recreated_from_the_reply_not_reallocated() {
    let Some(mut e) = engine() else { return };
    e.tables.set_snat(&snat((CLIENT, 32), SNAT, (40000, 40999), true, 11)).unwrap();
    let port = {
        let (_, out) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q"))).unwrap();
        packet::summary(&out).sport
    };
    assert!(e.tables.remove_conntrack_entry(&udp_key(25000)).unwrap(), "original half removed by hand");
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &udp(5353, port, b"a")),
        frame(&Ip::new(VIP, CLIENT), &udp(53, 25000, b"a")),
    );
    // The next packet of the flow keeps its (random) port: repaired, not re-allocated.
    expect(
        &mut e,
        frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q2")),
        frame(&Ip::new(SNAT, SERVER), &udp(port, 5353, b"q2")),
    );
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 1);
    assert_pairs_consistent(&e);
}

#[test]
fn a_lost_half_never_lets_two_flows_share_a_tuple() {
    let Some(mut e) = engine() else { return };
    establish(&mut e);
    // Flow A (client:24000 -> snat:24000) loses its reply half...
    let a = entry(&e, &orig_key()).unwrap();
    e.tables.remove_conntrack_entry(&a.xlate.reversed()).unwrap();
    // ...and flow B, whose natural port is the same, takes the free tuple.
    expect(
        &mut e,
        frame(&Ip::new(CLIENT2, VIP), &tcp(SYN, 24000, 80, b"")),
        frame(&Ip::new(SNAT, SERVER), &tcp(SYN, 24000, 8080, b"")),
    );
    // A's next packet finds its tuple owned by B: A moves, B keeps it.
    let (rc, out) = e.run(&frame(&Ip::new(CLIENT, VIP), &tcp(ACK, 24000, 80, b"more"))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    assert_ne!(packet::summary(&out).sport, 24000, "A was moved off B's tuple");
    assert_eq!(e.tables.counter(Counter::ConntrackPairConflict).unwrap(), 1);
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &tcp(SYN | ACK, 8080, 24000, b"")),
        frame(&Ip::new(VIP, CLIENT2), &tcp(SYN | ACK, 80, 24000, b"")),
    );
    assert_pairs_consistent(&e);
}

#[test]
fn established_flows_survive_a_flood_of_new_flows() {
    if !require_root() {
        return;
    }
    let mut e = TestZone::with_ct_max(ZONE, Some(1024)).unwrap();
    e.tables.set_dnat(&dnat(PROTO_TCP, 80, 1, &[(SERVER, 8080)])).unwrap();
    let clients: Vec<[u8; 4]> = (0..10).map(|i| [192, 0, 2, 10 + i]).collect();
    for c in &clients {
        e.run(&frame(&Ip::new(*c, VIP), &tcp(SYN, 40000, 80, b""))).unwrap();
        e.run(&frame(&Ip::new(SERVER, *c), &tcp(SYN | ACK, 8080, 40000, b""))).unwrap();
        e.run(&frame(&Ip::new(*c, VIP), &tcp(ACK, 40000, 80, b""))).unwrap();
    }
    assert_eq!(e.tables.counter(Counter::ConntrackPromoted).unwrap(), 10);
    // A SYN flood: 4 000 half-open flows, 16 times what ct_new holds.
    for i in 0..4000u32 {
        let src = [203, 0, 113, (i % 200) as u8 + 1];
        e.run(&frame(&Ip::new(src, VIP), &tcp(SYN, 1024 + (i / 200) as u16, 80, b""))).unwrap();
    }
    assert!(e.tables.conntrack_table(MAP_CT_NEW).unwrap().len() <= ct_new_max(1024) as usize);
    for c in &clients {
        expect(
            &mut e,
            frame(&Ip::new(SERVER, *c), &tcp(ACK, 8080, 40000, b"still here")),
            frame(&Ip::new(VIP, *c), &tcp(ACK, 80, 40000, b"still here")),
        );
    }
    assert_eq!(e.tables.conntrack_table(MAP_CT).unwrap().len(), 20, "both halves of all 10 flows");
}

#[test]
fn one_way_stream_keeps_its_port_through_table_churn() {
    if !require_root() {
        return;
    }
    // ct_new holds 256 entries: 128 flows; 3 000 one-shot flows churn it.
    let mut e = TestZone::with_ct_max(ZONE, Some(64)).unwrap();
    e.tables.set_dnat(&dnat(PROTO_UDP, 53, 2, &[(SERVER, 5353)])).unwrap();
    e.tables.set_snat(&snat(([10, 0, 0, 0], 8), SNAT, (20000, 29999), true, 10)).unwrap();
    let stream = frame(&Ip::new(CLIENT, VIP), &udp(5000, 53, b"stream"));
    let (_, out) = e.run(&stream).unwrap();
    let port = packet::summary(&out).sport;
    for i in 0..3000u32 {
        let src = [10, 1, (i / 250) as u8, (i % 250) as u8 + 1];
        let (rc, _) = e.run(&frame(&Ip::new(src, VIP), &udp(6000, 53, b"x"))).unwrap();
        assert_eq!(rc, TC_ACT_OK);
        if i % 10 == 0 {
            let (_, out) = e.run(&stream).unwrap();
            assert_eq!(packet::summary(&out).sport, port, "the stream moved after {i} other flows");
        }
    }
    // The LRU evicts halves of idle one-shot flows on its own; what must hold
    // is that no two whole flows hold one tuple and the stream is whole.
    assert_whole_flows_unique(&e);
    let key = Tuple { saddr: CLIENT, daddr: VIP, sport: 5000, dport: 53, proto: PROTO_UDP, _pad0: 0, zone: ZONE };
    let stream = entry(&e, &key).expect("stream's original half");
    assert_eq!(entry(&e, &stream.xlate.reversed()).expect("stream's reply half").xlate, key.reversed());
}

/// Among flows whose halves point at each other, no translated tuple repeats.
fn assert_whole_flows_unique(e: &TestZone) {
    let all = e.tables.conntrack().unwrap();
    let by_key: std::collections::HashMap<_, _> = all.iter().copied().collect();
    let mut xlates = HashSet::new();
    for (k, v) in &all {
        let whole = by_key.get(&v.xlate.reversed()).is_some_and(|p| p.xlate == k.reversed());
        if v.flags & CT_F_REPLY == 0 && whole {
            assert!(xlates.insert(v.xlate), "translated tuple {:?} held by two whole flows", v.xlate);
        }
    }
}

#[test]
fn syn_on_a_closed_flow_starts_a_new_flow() {
    let Some(mut e) = engine() else { return };
    establish(&mut e);
    tcp_reply(&mut e, RST | ACK, b"");
    assert_eq!(ct_state(&e, orig_key()), CT_CLOSING);
    open_tcp(&mut e);
    assert_eq!(ct_state(&e, orig_key()), CT_NEW);
    assert_eq!(e.tables.counter(Counter::FlowsReopened).unwrap(), 1);
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 2);
}

#[test]
fn rst_outside_the_window_does_not_close_the_flow() {
    let Some(mut e) = engine() else { return };
    establish(&mut e);
    // The server's side has sent up to seq 1001; a RST 10 MB away is spoofed.
    let spoofed = tcp_seq(RST, 8080, 24000, 1000 + 10_000_000);
    let (rc, out) = e.run(&frame(&Ip::new(SERVER, SNAT), &spoofed)).unwrap();
    assert_eq!(rc, TC_ACT_OK, "still translated: the endpoint judges it");
    assert_eq!(out, frame(&Ip::new(VIP, CLIENT), &tcp_seq(RST, 80, 24000, 1000 + 10_000_000)));
    assert_eq!(ct_state(&e, orig_key()), CT_ESTABLISHED);
    assert_eq!(e.tables.counter(Counter::TcpRstOutOfWindow).unwrap(), 1);
    // An in-window RST closes it.
    e.run(&frame(&Ip::new(SERVER, SNAT), &tcp_seq(RST, 8080, 24000, 1001))).unwrap();
    assert_eq!(ct_state(&e, orig_key()), CT_CLOSING);
}

#[test]
fn icmp_errors_neither_refresh_nor_advance_a_flow() {
    let Some(mut e) = engine() else { return };
    expect(
        &mut e,
        frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q")),
        frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")),
    );
    let before = entry(&e, &udp_key(25000)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let sent = packet::ipv4(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q"));
    let (rc, _) = e.run(&frame(&Ip::new(SERVER, SNAT), &L4::Error { kind: 3, code: 3, inner: sent })).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    assert_eq!(e.tables.counter(Counter::IcmpErrorsTranslated).unwrap(), 1);
    let after = entry(&e, &udp_key(25000)).unwrap();
    assert_eq!((after.state, after.last_seen_ns), (before.state, before.last_seen_ns));
    let reply = entry(&e, &before.xlate.reversed()).unwrap();
    assert_eq!(reply.state, CT_NEW, "an error from the server is not an answer");
}

#[test]
fn udp_query_answer_stays_short_a_stream_becomes_established() {
    let Some(mut e) = engine() else { return };
    let q = frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q"));
    let a = frame(&Ip::new(SERVER, SNAT), &udp(5353, 25000, b"a"));
    e.run(&q).unwrap();
    e.run(&a).unwrap();
    assert_eq!(ct_state(&e, udp_key(25000)), CT_REPLIED, "a query/answer keeps the 30 s timeout");
    let cfg = e.tables.config().unwrap();
    assert_eq!(cfg.timeout_s(PROTO_UDP, CT_REPLIED), 30);
    std::thread::sleep(std::time::Duration::from_millis(2100));
    e.run(&q).unwrap();
    assert_eq!(ct_state(&e, udp_key(25000)), CT_ESTABLISHED, "still active after 2 s: a stream");
    assert_eq!(cfg.timeout_s(PROTO_UDP, CT_ESTABLISHED), 120);
    assert_eq!(e.tables.conntrack_table(MAP_CT).unwrap().len(), 2, "promoted to the established table");
    assert!(e.tables.conntrack_table(MAP_CT_NEW).unwrap().is_empty());
    expect(&mut e, a, frame(&Ip::new(VIP, CLIENT), &udp(53, 25000, b"a")));
}

#[test]
fn an_expired_flow_frees_its_port_for_a_new_one() {
    let Some(mut e) = engine() else { return };
    e.tables.set_config(NatConfig { udp_s: 1, ..Default::default() }).unwrap();
    e.tables.set_snat(&snat((CLIENT, 32), SNAT, (30000, 30000), false, 11)).unwrap();
    let (rc, _) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(1111, 53, b"a"))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    std::thread::sleep(std::time::Duration::from_millis(2200));
    // Nothing looked the old flow up or collected it: allocation reclaims it.
    let (rc, out) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(2222, 53, b"b"))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    assert_eq!(packet::summary(&out).sport, 30000);
    assert_eq!(e.tables.counter(Counter::DropNoFreePort).unwrap(), 0);
    assert_eq!(e.tables.counter(Counter::ExpiredFlows).unwrap(), 1);
}

#[test]
fn a_busy_range_is_used_to_its_last_port() {
    let Some(mut e) = engine() else { return };
    e.tables.set_snat(&snat((CLIENT, 32), SNAT, (31000, 31031), true, 11)).unwrap();
    let mut ports = HashSet::new();
    for sport in 0..32u16 {
        let (rc, out) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(2000 + sport, 53, b"x"))).unwrap();
        assert_eq!(rc, TC_ACT_OK, "flow {sport} found a port");
        assert!(ports.insert(packet::summary(&out).sport));
    }
    assert_eq!(ports.len(), 32);
    let (rc, _) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(3000, 53, b"x"))).unwrap();
    assert_eq!(rc, lbagent_tests::engine::TC_ACT_SHOT, "the 33rd finds none");
}

/// A new flow takes the port of a flow that expired wherever its search
/// meets it. With one destination and many short flows (DNS through one
/// EIP) most of a busy range is held by flows that expired since the last
/// GC pass; when only the first port of each search round could be
/// reclaimed, a range of live flows and one expired flow refused new flows
/// seven times in eight (and cost every query that found a port 128 probes).
#[test]
fn a_new_flow_takes_an_expired_flows_port_wherever_the_search_meets_it() {
    let Some(mut e) = engine() else { return };
    e.tables.set_snat(&snat((CLIENT, 32), SNAT, (31000, 31031), true, 11)).unwrap();
    let query = |sport: u16| frame(&Ip::new(CLIENT, VIP), &udp(sport, 53, b"x"));
    // Client port -> SNAT port, the whole range taken.
    let mut port_of = std::collections::HashMap::new();
    for sport in 2000..2032u16 {
        let (rc, out) = e.run(&query(sport)).unwrap();
        assert_eq!(rc, TC_ACT_OK);
        port_of.insert(sport, packet::summary(&out).sport);
    }
    // Idle past the UDP timeout (30 s) means a clock more than 30 s after
    // boot: a VM just booted waits for it.
    let idle_since = || lbagent::dataplane::tables::monotonic_ns().checked_sub(31_000_000_000);
    while idle_since().is_none() {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    for round in 0..8u16 {
        // One flow expires (both halves idle for 31 s); the others are live.
        let victim = 2000 + round * 3;
        let port = port_of.remove(&victim).unwrap();
        let seen = idle_since().unwrap();
        e.edit_entries(MAP_CT_NEW, |v| {
            if v.xlate.sport == port || v.xlate.dport == victim {
                v.last_seen_ns = seen;
            }
        })
        .unwrap();
        let newcomer = 3000 + round;
        let (rc, out) = e.run(&query(newcomer)).unwrap();
        assert_eq!(rc, TC_ACT_OK, "round {round}: the expired flow's port {port} is free");
        assert_eq!(packet::summary(&out).sport, port, "round {round}");
        port_of.insert(newcomer, port);
    }
    assert_eq!(e.tables.counter(Counter::ExpiredFlows).unwrap(), 8);
    // Every live flow kept its port.
    for (sport, port) in port_of {
        let (rc, out) = e.run(&query(sport)).unwrap();
        assert_eq!((rc, packet::summary(&out).sport), (TC_ACT_OK, port), "flow from port {sport}");
    }
}

#[test]
fn flush_and_gc_never_delete_a_half_that_belongs_to_another_flow() {
    let Some(mut e) = engine() else { return };
    establish(&mut e);
    let a = entry(&e, &orig_key()).unwrap();
    e.tables.remove_conntrack_entry(&a.xlate.reversed()).unwrap();
    // B takes A's tuple; flushing A (by its key) must leave B whole.
    e.run(&frame(&Ip::new(CLIENT2, VIP), &tcp(SYN, 24000, 80, b""))).unwrap();
    let n = e.tables.flush_conntrack(|k, _| *k == orig_key()).unwrap();
    assert_eq!(n, 1);
    assert_pairs_consistent(&e);
    assert_eq!(e.tables.conntrack().unwrap().len(), 2, "B's two halves");
}

#[test]
fn tcp_fin_both_directions_closes_flow() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    tcp_reply(&mut e, SYN | ACK, b"");
    tcp_orig(&mut e, FIN | ACK, b"");
    assert_eq!(ct_state(&e, orig_key()), CT_ESTABLISHED, "half closed");
    tcp_reply(&mut e, FIN | ACK, b"");
    assert_eq!(ct_state(&e, orig_key()), CT_CLOSING);
}

#[test]
fn tcp_rst_closes_flow() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    tcp_reply(&mut e, RST | ACK, b"");
    assert_eq!(ct_state(&e, orig_key()), CT_CLOSING);
}

#[test]
fn port_collision_picks_another_snat_port() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    // A second client with the same source port would map to SNAT:24000 too.
    let port = expect_snat(&mut e, frame(&Ip::new(CLIENT2, VIP), &tcp(SYN, 24000, 80, b"")), |p| {
        frame(&Ip::new(SNAT, SERVER), &tcp(SYN, p, 8080, b""))
    });
    assert_ne!(port, 24000);
    expect(
        &mut e,
        frame(&Ip::new(SERVER, SNAT), &tcp(SYN | ACK, 8080, port, b"")),
        frame(&Ip::new(VIP, CLIENT2), &tcp(SYN | ACK, 80, 24000, b"")),
    );
    tcp_reply(&mut e, SYN | ACK, b"");
}

#[test]
fn many_flows_never_share_a_translated_tuple() {
    let Some(mut e) = engine() else { return };
    let mut seen = std::collections::HashSet::new();
    for i in 0..200u16 {
        let src = [10, 0, 1, 2 + (i % 4) as u8];
        let (rc, out) = e.run(&frame(&Ip::new(src, VIP), &udp(30000 + i / 4, 53, b"x"))).unwrap();
        assert_eq!(rc, TC_ACT_OK);
        let s = packet::summary(&out);
        assert_eq!((s.src, s.dst, s.dport), (SNAT, SERVER, 5353));
        assert!((20000..=29999).contains(&s.sport));
        assert!(seen.insert(s.sport), "port {} handed out twice", s.sport);
    }
}

#[test]
fn random_snat_stays_in_range() {
    let Some(mut e) = engine() else { return };
    e.tables.set_snat(&snat((CLIENT, 32), SNAT, (24000, 40099), true, 12)).unwrap();
    for sport in 1..20u16 {
        let (_, out) = e.run(&frame(&Ip::new(CLIENT, VIP), &udp(sport, 53, b"r"))).unwrap();
        verify(&out).unwrap();
        assert!((24000..=40099).contains(&packet::summary(&out).sport));
    }
}

#[test]
fn expired_flow_is_recreated() {
    let Some(mut e) = engine() else { return };
    e.tables.set_config(NatConfig { udp_s: 1, udp_stream_s: 1, ..Default::default() }).unwrap();
    let f = frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q"));
    expect(&mut e, f.clone(), frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")));
    std::thread::sleep(std::time::Duration::from_millis(2200));
    expect(&mut e, f, frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")));
    assert_eq!(e.tables.counter(Counter::ExpiredFlows).unwrap(), 1);
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 2);
}

#[test]
fn garbage_collection_frees_idle_flows_only() {
    let Some(mut e) = engine() else { return };
    e.tables.set_config(NatConfig { udp_s: 1, udp_stream_s: 1, ..Default::default() }).unwrap();
    expect(
        &mut e,
        frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q")),
        frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")),
    );
    open_tcp(&mut e);
    std::thread::sleep(std::time::Duration::from_millis(2200));
    let new_flows = |e: &TestZone| e.tables.zone_ct().unwrap().get(&ZONE).map(|z| z.flows.new);
    assert_eq!(new_flows(&e), Some(2));
    let mut gc = lbagent::dataplane::ct_gc::Collector::load(&e.pins.root).unwrap();
    // The program decides again, whatever the agent read: handed a live
    // flow's key (the TCP flow, 60 s), or a key no flow holds, it frees
    // nothing.
    let absent = Tuple { sport: 1, ..orig_key() };
    assert_eq!(gc.free_if_idle(&[orig_key(), absent]).unwrap(), 0);
    assert_eq!(e.tables.conntrack().unwrap().len(), 4);
    assert_eq!(gc.collect(&e.tables).unwrap(), 1, "the idle UDP flow goes; the TCP flow (60 s) stays");
    let left = e.tables.conntrack().unwrap();
    assert_eq!(left.len(), 2);
    assert!(left.iter().all(|(k, _)| k.proto == PROTO_TCP));
    assert_eq!(new_flows(&e), Some(1), "the zone's count of flows in ct_new follows");
    // A removed zone's counts are not brought back by the flows that end
    // after (the agent deletes them first, then flushes).
    e.tables.clear_zone_ct(ZONE).unwrap();
    e.tables.set_config(NatConfig { tcp_new_s: 1, ..Default::default() }).unwrap();
    assert_eq!(gc.collect(&e.tables).unwrap(), 1, "the TCP flow, idle past 1 s");
    assert_eq!(new_flows(&e), None);
}

#[test]
fn full_conntrack_evicts_the_oldest_and_keeps_translating() {
    if !require_root() {
        return;
    }
    // ct holds 64 entries, ct_new 256 (128 flows): 400 new flows must all still be translated.
    let mut e = TestZone::with_ct_max(ZONE, Some(64)).unwrap();
    e.tables.set_dnat(&dnat(PROTO_UDP, 53, 2, &[(SERVER, 5353)])).unwrap();
    let mut last = 0;
    for sport in 30000..30400u16 {
        let (rc, out) = e.run(&frame(&Ip::new([192, 0, 2, 9], VIP), &udp(sport, 53, b"x"))).unwrap();
        assert_eq!(rc, TC_ACT_OK);
        assert_eq!(packet::summary(&out).dst, SERVER);
        last = sport;
    }
    assert!(e.tables.conntrack_table(MAP_CT).unwrap().len() <= 64);
    assert!(e.tables.conntrack_table(MAP_CT_NEW).unwrap().len() <= ct_new_max(64) as usize);
    for c in [Counter::DropNoFreePort, Counter::DropConntrackInsert, Counter::DropRewriteFailed] {
        assert_eq!(e.tables.counter(c).unwrap(), 0, "{c:?}");
    }
    // The newest flow survived eviction: its reply is translated.
    expect(
        &mut e,
        frame(&Ip::new(SERVER, [192, 0, 2, 9]), &udp(5353, last, b"r")),
        frame(&Ip::new(VIP, [192, 0, 2, 9]), &udp(53, last, b"r")),
    );
}

#[test]
fn zones_are_isolated() {
    let Some(mut e) = engine() else { return };
    // Same rule key in another zone does not apply to this zone's program.
    let mut other = dnat(PROTO_TCP, 81, 50, &[(SERVER2, 81)]);
    other.zone = ZONE + 1;
    e.tables.set_dnat(&other).unwrap();
    expect_untouched(&mut e, frame(&Ip::new([192, 0, 2, 1], VIP), &tcp(SYN, 1, 81, b"")));
}

#[test]
fn conntrack_flush_by_selector() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    expect(
        &mut e,
        frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, b"q")),
        frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, b"q")),
    );
    assert_eq!(e.tables.conntrack().unwrap().len(), 4);
    let n = e.tables.flush_conntrack(|k, en| k.proto == PROTO_UDP && en.flags & CT_F_REPLY == 0).unwrap();
    assert_eq!(n, 1);
    // Selecting both entries of a flow still counts (and removes) one flow.
    open_tcp(&mut e);
    assert_eq!(e.tables.flush_conntrack(|k, _| k.proto == PROTO_TCP).unwrap(), 1);
    assert!(e.tables.conntrack().unwrap().is_empty());
    open_tcp(&mut e);
    let left = e.tables.conntrack().unwrap();
    assert_eq!(left.len(), 2);
    assert!(left.iter().all(|(k, _)| k.proto == PROTO_TCP));
}

/// A promotion that finds a half of its flow in `ct` already (another CPU
/// promoting the same flow inserts it first) completes the move instead of
/// reporting a full table, and counts the promotion once.
#[test]
fn a_promotion_that_finds_its_pair_promoted_is_not_a_full_table() {
    let Some(mut e) = engine() else { return };
    open_tcp(&mut e);
    tcp_reply(&mut e, SYN | ACK, b"");
    // The other CPU's first step: the reply half, copied into `ct`.
    let x = entry(&e, &orig_key()).unwrap().xlate;
    let reply = entry(&e, &x.reversed()).unwrap();
    let mut ct = e.tables.hash(MAP_CT).unwrap();
    ct.insert(&x.reversed(), &reply, 0).unwrap();
    tcp_orig(&mut e, ACK, b"");
    assert_eq!(e.tables.counter(Counter::ConntrackEstablishedFull).unwrap(), 0, "not a full table");
    assert_eq!(e.tables.counter(Counter::ConntrackPromoted).unwrap(), 1);
    assert_eq!(e.tables.conntrack_table(MAP_CT).unwrap().len(), 2, "both halves in ct");
    assert!(e.tables.conntrack_table(MAP_CT_NEW).unwrap().is_empty(), "none left in ct_new");
    tcp_reply(&mut e, ACK, b"data");
    assert_pairs_consistent(&e);
}

/// Garbage collection and flush delete the flows they dumped, never a flow
/// the program created since under the same key (a flow that went and a new
/// one on the same tuple).
#[test]
fn gc_and_flush_never_delete_a_flow_created_after_their_dump() {
    let Some(mut e) = engine() else { return };
    let q = |p: &[u8]| frame(&Ip::new(CLIENT, VIP), &udp(25000, 53, p));
    let out = |p: &[u8]| frame(&Ip::new(SNAT, SERVER), &udp(25000, 5353, p));
    expect(&mut e, q(b"one"), out(b"one"));
    let dump = e.tables.conntrack().unwrap();
    assert_eq!(dump.len(), 2);
    // The flow goes (as an expiry removes it) and the client opens a new
    // one on the same tuple.
    for (k, _) in &dump {
        e.tables.remove_conntrack_entry(k).unwrap();
    }
    expect(&mut e, q(b"two"), out(b"two"));
    let fresh = entry(&e, &udp_key(25000)).unwrap();
    // A flush over the old dump (every flow it holds selected) keeps it.
    assert_eq!(e.tables.flush_entries(&dump, |_, _| true).unwrap(), 0, "nothing it read is left to delete");
    assert_eq!(entry(&e, &udp_key(25000)), Some(fresh), "the new flow stays");
    assert_eq!(e.tables.conntrack().unwrap().len(), 2, "both of its halves");
    expect(&mut e, q(b"three"), out(b"three"));
    assert_pairs_consistent(&e);
}

/// After FIN both ways the flow is kept `tcp_closing_s` (10 s by default,
/// not Linux's 120 s TIME_WAIT: the gateway is not an endpoint, and 120 s
/// per closed connection would fill `ct` at a few thousand connections a
/// second): a peer's retransmitted FIN or final ACK in that time still
/// takes the flow's translation; after it the flow has expired.
#[test]
fn a_closed_flow_still_translates_late_segments_for_its_closing_timeout() {
    let Some(mut e) = engine() else { return };
    assert_eq!(NatConfig::default().timeout_s(PROTO_TCP, CT_CLOSING), DEFAULT_TCP_CLOSING_S);
    assert_eq!(DEFAULT_TCP_CLOSING_S, 10, "the documented default (docs/state-file.md)");
    e.tables.set_config(NatConfig { tcp_closing_s: 2, ..Default::default() }).unwrap();
    establish(&mut e);
    tcp_orig(&mut e, FIN | ACK, b"");
    tcp_reply(&mut e, FIN | ACK, b"");
    assert_eq!(ct_state(&e, orig_key()), CT_CLOSING);
    std::thread::sleep(std::time::Duration::from_millis(1200));
    // The server's FIN again (its last ACK was lost), and the client's ACK.
    tcp_reply(&mut e, FIN | ACK, b"");
    tcp_orig(&mut e, ACK, b"");
    assert_eq!(e.tables.counter(Counter::NewFlows).unwrap(), 1, "the late segments took the closed flow");
    // Past the timeout the flow is gone: a late ACK finds it expired.
    std::thread::sleep(std::time::Duration::from_millis(2100));
    let expired = e.tables.counter(Counter::ExpiredFlows).unwrap();
    e.run(&frame(&Ip::new(CLIENT, VIP), &tcp(ACK, 24000, 80, b""))).unwrap();
    assert_eq!(e.tables.counter(Counter::ExpiredFlows).unwrap(), expired + 1, "expired after its closing timeout");
}

/// The conntrack tables are read in batches (`BPF_MAP_LOOKUP_BATCH`): a
/// dump of tables larger than one batch, with flows in both tables, is
/// the dump read entry by entry, entry for entry; and garbage collection
/// and flushes, which work a batch at a time (a half and its pair may be
/// in different batches), still free whole flows and count each once.
#[test]
fn the_tables_read_in_batches_are_the_tables_read_by_key() {
    let Some(e) = engine() else { return };
    const FLOWS: u32 = 9_000;
    let now = lbagent::dataplane::tables::monotonic_ns();
    let mut ct = e.tables.hash(MAP_CT).unwrap();
    let mut ct_new = e.tables.hash(MAP_CT_NEW).unwrap();
    for i in 0..FLOWS {
        let c = [10, 9, (i >> 8) as u8, i as u8];
        let orig = Tuple { saddr: c, daddr: VIP, sport: 1000, dport: 80, proto: PROTO_TCP, _pad0: 0, zone: ZONE };
        let x = Tuple { daddr: SERVER, ..orig };
        let entry = CtEntry {
            xlate: x,
            last_seen_ns: now,
            created_ms: lbagent_common::ct_clock_ms(now) + i,
            flags: CT_F_DNAT,
            state: CT_ESTABLISHED,
            ..Default::default()
        };
        let reply = CtEntry { xlate: orig.reversed(), flags: CT_F_DNAT | CT_F_REPLY, ..entry };
        // One flow in ten has not completed its handshake; one in ten is
        // being promoted (its reply half in `ct` already, the other still
        // in `ct_new`).
        match i % 10 {
            1 => {
                ct_new.insert(&orig, &entry, 0).unwrap();
                ct_new.insert(&x.reversed(), &reply, 0).unwrap();
            }
            3 => {
                ct_new.insert(&orig, &entry, 0).unwrap();
                ct.insert(&x.reversed(), &reply, 0).unwrap();
            }
            _ => {
                ct.insert(&orig, &entry, 0).unwrap();
                ct.insert(&x.reversed(), &reply, 0).unwrap();
            }
        }
    }
    for table in [MAP_CT, MAP_CT_NEW] {
        // This kernel reads them in batches (no fallback to reads by key).
        let pin = lbagent::dataplane::pins::versioned_dir(&e.pins.root).join(table.name);
        let data = aya::maps::MapData::from_pin(pin).unwrap();
        let direct = lbagent::dataplane::tables::batch::dump::<Tuple, CtEntry>(&data).expect("batches");
        let mut batched = e.tables.conntrack_table(table).unwrap();
        assert_eq!(direct.len(), batched.len());
        let mut by_key = e.tables.conntrack_table_by_key(table).unwrap();
        let key = |(k, _): &(Tuple, CtEntry)| (k.saddr, k.daddr, k.sport, k.dport);
        batched.sort_by_key(key);
        by_key.sort_by_key(key);
        let tenth = FLOWS / 10;
        let want = if table.name == MAP_CT.name { 2 * (FLOWS - 2 * tenth) + tenth } else { 3 * tenth };
        assert_eq!(batched.len() as u32, want, "{}", table.name);
        assert!(batched == by_key, "{}: the batched dump differs from the dump by key", table.name);
    }
    // A flush that picks only reply halves (the client as destination), of
    // half the flows (i mod 4 = 0 or 1: some of every kind), across every
    // batch: each flow counted once, both of its halves gone, whichever
    // batch and table held each half.
    let picked = |client: [u8; 4]| client[3] % 4 < 2;
    let flushed = e.tables.flush_conntrack(|k, v| v.flags & CT_F_REPLY != 0 && picked(k.daddr)).unwrap();
    let half = (0..FLOWS).filter(|i| i % 4 < 2).count();
    assert_eq!(flushed, half, "flows flushed");
    let left = e.tables.conntrack().unwrap();
    assert_eq!(left.len(), 2 * (FLOWS as usize - half), "both halves of each flushed flow went");
    assert!(left.iter().all(|(k, v)| !picked(if v.flags & CT_F_REPLY != 0 { k.daddr } else { k.saddr })));
    let flow = |c: [u8; 4]| u32::from(c[2]) << 8 | u32::from(c[3]);
    let split = left.iter().filter(|(k, v)| v.flags & CT_F_REPLY == 0 && flow(k.saddr) % 10 == 3).count();
    assert!(
        split > 100 && e.tables.conntrack_table(MAP_CT_NEW).unwrap().len() > 100,
        "flows of ct_new and flows split over both tables are left for GC"
    );
    // One flow whose reply direction is still active: GC keeps it whole.
    let busy =
        Tuple { saddr: SERVER, daddr: [10, 9, 0, 2], sport: 80, dport: 1000, proto: PROTO_TCP, _pad0: 0, zone: ZONE };
    let mut reply = ct.get(&busy, 0).unwrap();
    reply.last_seen_ns = now + 10_000_000_000;
    ct.insert(&busy, &reply, 0).unwrap();
    // Every other flow idle: collected whole, both halves, from both tables.
    e.tables.set_config(NatConfig { tcp_established_s: 1, tcp_new_s: 1, ..Default::default() }).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2100));
    assert_eq!(lbagent::dataplane::ct_gc::collect(&e.pins.root).unwrap(), FLOWS as usize - half - 1);
    let left = e.tables.conntrack().unwrap();
    assert_eq!(left.len(), 2, "the busy flow's two halves: {left:?}");
    assert!(left.iter().any(|(k, _)| *k == busy));
}
