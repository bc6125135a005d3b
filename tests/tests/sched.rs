//! Direct-mode schedulers with real traffic on the OVS topology: Maglev by
//! source (`sch`) and by 5-tuple (`tch`), round robin (`rr`, `wrr`), over
//! TCP and UDP (`lbagent-ebpf/src/sched.rs`, `lbagent/src/lb/sched.rs`).

use std::{
    collections::{BTreeMap, HashMap},
    net::{Ipv4Addr, SocketAddr},
};

use lbagent::naming;
use lbagent_tests::{
    bed::{Bed, HostLock, lb_id},
    hosts::TestHost,
    ovs::OvsBridge,
    require_root,
    traffic::*,
    unique,
};

const VIP: &str = "10.31.0.5";
/// Client source addresses: 10.31.0.100 … 10.31.0.139.
const CLIENTS: u8 = 40;

fn vip(port: u16) -> SocketAddr {
    format!("{VIP}:{port}").parse().unwrap()
}

fn client_addr(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 31, 0, 100 + i)
}

/// The backend tag (`h21` …) of an answer `<tag> <peer>`.
fn tag(answer: &str) -> String {
    answer.split_once(' ').map(|(t, _)| t.to_string()).unwrap_or_default()
}

struct SchedBed {
    bed: Bed,
    client: TestHost,
    _backends: Vec<TestHost>,
    bridge: OvsBridge,
    id: String,
    _lock: HostLock,
}

/// Four backends `.21`–`.24`, each answering TCP lines on 9000 and UDP on
/// 5353 with its tag `h21` …; one client namespace with 40 addresses.
fn sched_bed() -> Option<SchedBed> {
    if !require_root() {
        return None;
    }
    let lock = HostLock::take().unwrap();
    let bridge = OvsBridge::new(&unique("brs")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.31.0.10", 24, "").unwrap();
    for i in 0..CLIENTS {
        client.ns.exec(&["ip", "addr", "add", &format!("{}/24", client_addr(i)), "dev", "eth0"]).unwrap();
    }
    let mut backends = Vec::new();
    for last in [21, 22, 23, 24] {
        let h = TestHost::on(|p| bridge.add_port(p), &format!("10.31.0.{last}"), 24, "").unwrap();
        line_echo_server(&h.ns.name, 9000, &format!("h{last}")).unwrap();
        udp_tag_forever(&h.ns.name, 5353, &format!("h{last}")).unwrap();
        backends.push(h);
    }
    Some(SchedBed { bed: Bed::new().unwrap(), client, _backends: backends, bridge, id: lb_id(), _lock: lock })
}

impl SchedBed {
    /// Listeners (tcp and udp on each port): 7001 `sch`, 7002 `tch`, 7003
    /// `rr`, 7004 `wrr` (weights 1, 2, 3 on `.21`–`.23`), 7005 `wlc`. `members`: the
    /// backends of the equal-weight group.
    fn apply(&mut self, members: &[u8]) {
        let group: String =
            members.iter().map(|m| format!("          - {{id: e{m}, address: 10.31.0.{m}, port: 9000}}\n")).collect();
        let udp_group: String =
            members.iter().map(|m| format!("          - {{id: u{m}, address: 10.31.0.{m}, port: 5353}}\n")).collect();
        let mut listeners = String::new();
        for (port, s) in [(7001, "sch"), (7002, "tch"), (7003, "rr")] {
            listeners += &format!(
                "      - {{id: t{port}, type: tcp, port: {port}, backend_group: eq, scheduler: {s}}}\n      - {{id: u{port}, \
                 type: udp, port: {port}, backend_group: equdp, scheduler: {s}}}\n"
            );
        }
        listeners += "      - {id: t7005, type: tcp, port: 7005, backend_group: eq, scheduler: wlc}\n";
        listeners += "      - {id: u7005, type: udp, port: 7005, backend_group: equdp, scheduler: wlc}\n";
        listeners += "      - {id: t7004, type: tcp, port: 7004, backend_group: weighted, scheduler: wrr}\n";
        listeners += "      - {id: u7004, type: udp, port: 7004, backend_group: wudp, scheduler: wrr}\n";
        let weighted = |port: u16, p: &str| -> String {
            (1..=3)
                .map(|w| {
                    format!("          - {{id: {p}{w}, address: 10.31.0.{}, port: {port}, weight: {w}}}\n", 20 + w)
                })
                .collect()
        };
        let yaml = format!(
            "version: 1\nagent: {{integration_bridge: {}}}\nload_balancers:\n  - id: {}
    network: {{ip: {VIP}, mac: \"02:00:0a:1f:00:05\", prefix_len: 24, gateway: 10.31.0.1}}
    listeners:
{listeners}    backend_groups:
      - id: eq
        backends:
{group}      - id: equdp
        backends:
{udp_group}      - id: weighted
        backends:
{}      - id: wudp
        backends:
{}",
            self.bridge.name,
            self.id,
            weighted(9000, "w"),
            weighted(5353, "v"),
        );
        self.bed.apply(&yaml);
        lbagent_tests::net::dataplane_offloads_all(&naming::lb_netns(&self.id)).unwrap();
    }

    /// Backend tag for a new TCP connection from client address `i`.
    fn tcp_from(&self, i: u8, port: u16) -> String {
        let from = SocketAddr::from((client_addr(i), 0));
        tag(&OpenConn::open_from(&self.client.ns.name, from, vip(port)).unwrap().ping("hi").unwrap())
    }

    fn udp_from(&self, i: u8, port: u16) -> String {
        tag(&udp_ask_from(&self.client.ns.name, client_addr(i), vip(port)).unwrap())
    }

    /// How many of `n` new connections (TCP and UDP each) each backend took.
    fn counts(&self, port: u16, n: usize) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
        let (mut tcp, mut udp) = (BTreeMap::new(), BTreeMap::new());
        for k in 0..n {
            *tcp.entry(self.tcp_from((k % CLIENTS as usize) as u8, port)).or_default() += 1;
            *udp.entry(self.udp_from((k % CLIENTS as usize) as u8, port)).or_default() += 1;
        }
        (tcp, udp)
    }
}

/// Each backend's share of `counts` is its weight's share within 5 points.
fn assert_shares(what: &str, counts: &BTreeMap<String, usize>, weights: &[(&str, usize)]) {
    eprintln!("{what}: {counts:?}");
    let total: usize = counts.values().sum();
    let wsum: usize = weights.iter().map(|(_, w)| w).sum();
    for (t, w) in weights {
        let got = counts.get(*t).copied().unwrap_or(0) as f64 / total as f64;
        let want = *w as f64 / wsum as f64;
        assert!((got - want).abs() <= 0.05, "{what}: {t} took {got:.3} of {total}, weight share {want:.3}: {counts:?}");
    }
    assert_eq!(counts.len(), weights.len(), "{what}: only the listed backends: {counts:?}");
}

#[test]
fn round_robin_and_weighted_round_robin_take_turns() {
    let Some(mut b) = sched_bed() else { return };
    b.apply(&[21, 22, 23]);
    // 300 new connections from one client address: in turn, not by hash.
    let mut rr = BTreeMap::new();
    for _ in 0..300 {
        *rr.entry(b.tcp_from(0, 7003)).or_default() += 1;
    }
    assert_shares("rr tcp", &rr, &[("h21", 1), ("h22", 1), ("h23", 1)]);
    let mut wrr = BTreeMap::new();
    let mut wrr_udp = BTreeMap::new();
    for _ in 0..300 {
        *wrr.entry(b.tcp_from(0, 7004)).or_default() += 1;
        *wrr_udp.entry(b.udp_from(0, 7004)).or_default() += 1;
    }
    assert_shares("wrr tcp", &wrr, &[("h21", 1), ("h22", 2), ("h23", 3)]);
    assert_shares("wrr udp", &wrr_udp, &[("h21", 1), ("h22", 2), ("h23", 3)]);
    let (_, rr_udp) = b.counts(7003, 150);
    assert_shares("rr udp", &rr_udp, &[("h21", 1), ("h22", 1), ("h23", 1)]);
}

#[test]
fn source_hashing_keeps_each_client_and_moves_a_quarter_when_a_fourth_backend_joins() {
    let Some(mut b) = sched_bed() else { return };
    b.apply(&[21, 22, 23]);
    // One client, one backend: every new connection from one address lands
    // on the same backend, TCP and UDP alike.
    let mut before = HashMap::new();
    for i in 0..CLIENTS {
        let first = b.tcp_from(i, 7001);
        for _ in 0..2 {
            assert_eq!(b.tcp_from(i, 7001), first, "client {} stays on its backend", client_addr(i));
        }
        let u = b.udp_from(i, 7001);
        assert_eq!(b.udp_from(i, 7001), u, "udp client {} stays", client_addr(i));
        before.insert(i, first);
    }
    let spread: std::collections::BTreeSet<&String> = before.values().collect();
    assert_eq!(spread.len(), 3, "40 clients spread over the three backends: {before:?}");
    let held = OpenConn::open_from(&b.client.ns.name, SocketAddr::from((client_addr(0), 0)), vip(7001)).unwrap();
    let held_tag = tag(&held.ping("1").unwrap());

    b.apply(&[21, 22, 23, 24]);
    let mut moved = 0;
    for i in 0..CLIENTS {
        let now = b.tcp_from(i, 7001);
        if now != before[&i] {
            moved += 1;
            assert_eq!(now, "h24", "a client only ever moves to the backend that joined");
        }
    }
    eprintln!("sch: {moved} of {CLIENTS} clients moved to the joining backend");
    // Ideal: a quarter of the keys move (10 of 40); the table moves exactly
    // the slots the new backend wins.
    assert!((1..=14).contains(&moved), "{moved} of {CLIENTS} clients moved when a 4th backend joined");
    assert_eq!(tag(&held.ping("2").unwrap()), held_tag, "an established flow keeps its backend");

    // Removing it again brings every client back where it was.
    b.apply(&[21, 22, 23]);
    for i in 0..CLIENTS {
        assert_eq!(b.tcp_from(i, 7001), before[&i], "client {} back on its backend", client_addr(i));
    }
}

#[test]
fn tuple_hashing_spreads_one_clients_connections() {
    let Some(mut b) = sched_bed() else { return };
    b.apply(&[21, 22, 23]);
    let (tcp, udp) = b.counts(7002, 90);
    // 90 flows, each its own 5-tuple: every backend takes some.
    eprintln!("tch: tcp {tcp:?} udp {udp:?}");
    for (what, c) in [("tcp", &tcp), ("udp", &udp)] {
        assert_eq!(c.len(), 3, "tch {what}: {c:?}");
        assert!(c.values().all(|n| *n >= 10), "tch {what}: roughly even: {c:?}");
    }
    // The table is in the map with every slot filled by a live backend.
    let t = lbagent::dataplane::tables::Tables::open(&b.bed.pins.root).unwrap();
    let rules = t.sched_rules().unwrap();
    assert_eq!(rules.len(), 8, "one table per scheduled listener (4 tcp + 4 udp): {rules:?}");
    for r in rules {
        let table = t.sched_table(r).unwrap().unwrap();
        assert_eq!(table.len(), lbagent_common::SCHED_TABLE_SIZE as usize);
        assert!(table.iter().all(|(a, _)| (21..=23).contains(&a.octets()[3])));
    }
    // `lbagent maps` shows each table as slots per backend, and the
    // round-robin positions.
    for map in ["sched_tables", "sched_turns"] {
        let out = std::process::Command::new(lbagent_tests::lbagent_bin())
            .args(["maps", map, "--bpffs"])
            .arg(&b.bed.pins.root)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{map}: {}", String::from_utf8_lossy(&out.stderr));
        if map == "sched_tables" {
            assert_eq!(text.matches("16381 slots").count(), 8, "{text}");
            assert!(text.contains("10.31.0.21:9000 ") && text.contains("10.31.0.23:5353 "), "{text}");
        }
    }
}

/// `(backend last octet, active)` of every least-connection entry on `port`.
fn active(t: &lbagent::dataplane::tables::Tables, port: u16) -> BTreeMap<u8, i64> {
    t.least_entries().unwrap().into_iter().filter(|(k, _)| k.port == port).map(|(k, v)| (k.addr[3], v.active)).collect()
}

#[test]
fn least_connections_sends_new_flows_to_the_least_busy_backends() {
    let Some(mut b) = sched_bed() else { return };
    let root = b.bed.pins.root.clone();
    let client = b.client.ns.name.clone();
    let t = || lbagent::dataplane::tables::Tables::open(&root).unwrap();
    b.apply(&[21]);
    // 20 long connections, all on h21 (the only backend).
    let open = |i: u8| OpenConn::open_from(&client, SocketAddr::from((client_addr(i), 0)), vip(7005)).unwrap();
    let held: Vec<OpenConn> = (0..20).map(open).collect();
    for c in &held {
        assert_eq!(tag(&c.ping("x").unwrap()), "h21");
    }
    // Two more backends join: new flows go to them, not to h21 (20 active).
    b.apply(&[21, 22, 23]);
    assert_eq!(active(&t(), 9000), BTreeMap::from([(21, 20), (22, 0), (23, 0)]), "counts kept across the change");
    let fresh: Vec<OpenConn> = (20..40).map(open).collect();
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for c in &fresh {
        *counts.entry(tag(&c.ping("x").unwrap())).or_default() += 1;
    }
    eprintln!("wlc: 20 new connections went to {counts:?}");
    assert!(!counts.contains_key("h21"), "h21 holds 20 flows: no new one for it: {counts:?}");
    assert!(counts.get("h22").is_some_and(|n| *n >= 8) && counts.get("h23").is_some_and(|n| *n >= 8), "{counts:?}");
    assert_eq!(active(&t(), 9000)[&21], 20);

    // h21's connections close (FIN both ways): its count drops, and it gets
    // the next new flows.
    drop(held);
    lbagent_tests::wait_for(|| active(&t(), 9000)[&21] == 0, "h21's flows counted closed");
    let next: Vec<String> = (0..6).map(|i| tag(&open(i).ping("x").unwrap())).collect();
    assert!(next.iter().all(|x| x == "h21"), "the idle backend takes the new flows: {next:?}");
    drop(fresh);

    // UDP flows never close: 30 new ones spread evenly, and once conntrack
    // forgets them (here: flushed) the agent's recount zeroes the counts.
    for i in 0..30 {
        b.udp_from(i, 7005);
    }
    let udp = active(&t(), 5353);
    eprintln!("wlc udp: {udp:?}");
    assert!(udp.values().all(|n| *n == 10), "30 UDP flows, 10 per backend: {udp:?}");
    let tables = t();
    tables.flush_conntrack(|k, _| k.proto == lbagent_common::PROTO_UDP).unwrap();
    assert_eq!(tables.recount_active().unwrap(), 3, "three drifted counts corrected");
    assert!(active(&t(), 5353).values().all(|n| *n == 0));
}

/// Round robin's positions are per CPU; each CPU starts its turn at a
/// random slot, so the first flows on two CPUs do not all go to the same
/// backends (a burst spread over the CPUs would otherwise hit the table's
/// first slots, one backend, on every CPU). Program test on crafted SYNs,
/// the test thread pinned to each CPU in turn.
#[test]
fn round_robin_cpus_start_at_different_positions() {
    use lbagent::dataplane::tables::{DnatSpec, SchedKind, SchedSpec};
    use lbagent_common::{PROTO_TCP, SCHED_TABLE_SIZE};
    use lbagent_tests::{
        fixture::{SERVER, VIP as FIXTURE_VIP, ZONE, tcp},
        packet::{Ip, SYN, frame, summary},
    };
    if !require_root() {
        return;
    }
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if cpus < 2 {
        assert!(std::env::var("CI").is_err(), "needs two CPUs");
        return;
    }
    let mut e = lbagent_tests::engine::TestZone::new(ZONE).unwrap();
    // Five backends in turn: the table's slot i is backend i % 5.
    let table: Vec<(Ipv4Addr, u16)> =
        (0..SCHED_TABLE_SIZE).map(|i| (Ipv4Addr::new(10, 0, 2, 10 + (i % 5) as u8), 80)).collect();
    let table = std::sync::Arc::new(table);
    const RULES: u16 = 8;
    for r in 0..RULES {
        e.tables
            .set_dnat(&DnatSpec {
                zone: ZONE,
                addr: Ipv4Addr::from(FIXTURE_VIP),
                proto: PROTO_TCP,
                port: 1000 + r,
                rule_id: 100 + u32::from(r),
                backends: vec![(Ipv4Addr::from(SERVER), 80)],
                snat: None,
                acl: None,
                sched: Some(SchedSpec { kind: SchedKind::Turn, table: table.clone(), weights: vec![] }),
            })
            .unwrap();
    }
    let mut first_picks = |cpu: usize| -> Vec<[u8; 4]> {
        let mut set = nix::sched::CpuSet::new();
        set.set(cpu).unwrap();
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).unwrap();
        (0..RULES)
            .map(|r| {
                let syn = frame(&Ip::new([192, 0, 2, 1], FIXTURE_VIP), &tcp(SYN, 30000 + cpu as u16, 1000 + r, b""));
                summary(&e.run(&syn).unwrap().1).dst
            })
            .collect()
    };
    let (on0, on1) = (first_picks(0), first_picks(1));
    let mut all = nix::sched::CpuSet::new();
    for c in 0..cpus {
        all.set(c).unwrap();
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &all).unwrap();
    eprintln!("first backends, CPU 0: {on0:?}; CPU 1: {on1:?}");
    // By chance, all 8 first picks of a CPU on backend 0 (slot 0 and its
    // like), or equal on both CPUs: (1/5)^8 each, once in 390 625 runs.
    let slot0 = [10, 0, 2, 10];
    for (cpu, picks) in [(0, &on0), (1, &on1)] {
        assert!(picks.iter().any(|p| *p != slot0), "CPU {cpu} started every rule's turn at slot 0: {picks:?}");
    }
    assert_ne!(on0, on1, "both CPUs started every rule's turn at the same slot");
}

/// Two CPUs that open the same least-connection flow at once (a SYN and its
/// retransmission, or a flow's first packets spread over queues) count it
/// once: only the CPU whose insert wins adds to the backend's active flows
/// and to the zone's flow count, and the other sends its packet to the
/// winner's backend. Program test runs of each SYN on both CPUs at once;
/// the agent's recounts from conntrack then find nothing to correct.
#[test]
fn a_flow_opened_on_two_cpus_at_once_is_counted_once() {
    use lbagent::dataplane::tables::{DnatSpec, SchedKind, SchedSpec};
    use lbagent_common::PROTO_TCP;
    use lbagent_tests::{
        engine::{TC_ACT_SHOT, TestZone},
        fixture::{VIP as FIXTURE_VIP, ZONE, tcp},
        packet::{Ip, SYN, frame, summary},
    };
    if !require_root() {
        return;
    }
    let e = TestZone::new(ZONE).unwrap();
    let backends: Vec<(Ipv4Addr, u16)> = (0..4).map(|i| (Ipv4Addr::new(10, 0, 2, 10 + i), 80)).collect();
    let least = SchedSpec { kind: SchedKind::Least, table: Default::default(), weights: vec![1; backends.len()] };
    e.tables
        .set_dnat(&DnatSpec {
            zone: ZONE,
            addr: Ipv4Addr::from(FIXTURE_VIP),
            proto: PROTO_TCP,
            port: 1000,
            rule_id: 300,
            backends,
            snat: None,
            acl: None,
            sched: Some(least),
        })
        .unwrap();
    const FLOWS: usize = 4000;
    let syn = |i: usize| frame(&Ip::new([192, 0, 2, 1], FIXTURE_VIP), &tcp(SYN, 10000 + i as u16, 1000, b""));
    let Some(runs) = e.race(ZONE, FLOWS, syn).unwrap() else {
        assert!(std::env::var("CI").is_err(), "needs two CPUs");
        return;
    };
    let dropped = runs.iter().flatten().filter(|(rc, _)| *rc == TC_ACT_SHOT).count();
    let split = runs.iter().filter(|[a, b]| summary(&a.1).dst != summary(&b.1).dst).count();
    assert_eq!((dropped, split), (0, 0), "SYNs dropped, flows sent to two backends");
    // A step where both CPUs found no flow and created it counts two new
    // flows (the loser takes the winner's translation); otherwise one CPU
    // saw the other's flow and translated by it.
    let raced = e.tables.counter(lbagent_common::Counter::NewFlows).unwrap() as usize - FLOWS;
    eprintln!("{raced} of {FLOWS} flows created on both CPUs at once");
    assert!(raced > 0, "no flow was created on both CPUs at once: the race was not exercised");
    let active: i64 = e.tables.least_entries().unwrap().iter().map(|(_, v)| v.active).sum();
    assert_eq!(active, FLOWS as i64, "each flow counted once by the backends");
    assert_eq!(e.tables.conntrack().unwrap().len(), 2 * FLOWS, "each flow tracked once, both halves");
    assert_eq!(e.tables.recount_active().unwrap(), 0, "least-connection counts off");
    assert_eq!(e.tables.recount_zone_flows().unwrap(), 0, "the zone's flow counts off");
}
