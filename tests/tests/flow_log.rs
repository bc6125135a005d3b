//! Flow logs with real traffic through a NAT gateway: the programs' start
//! and end records, the agent's end records for flows that end otherwise,
//! exported to a real IPFIX collector (nfdump's nfcapd, decoded by
//! `nfdump`) and to JSON Lines; both must equal the flows the test made.

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use lbagent::{
    flow_log::{FlowLogStatus, FlowLogger},
    state::flow_log::{FlowLogSpec, IpfixSpec, JsonlSpec, RuleKind},
};
use lbagent_common::*;
use lbagent_tests::{
    collector::{self, Nfcapd},
    engine::TestZone,
    fixture::{CLIENT, VIP, ZONE, engine, tcp},
    gateway::{GwBed, INTERNET_IP as INTERNET},
    packet::{ACK, FIN, Ip, RST, SYN, frame},
    require_root,
    traffic::*,
    unique, wait_for,
};
use serde_json::Value;

fn at(ip: &str, port: u16) -> SocketAddr {
    format!("{ip}:{port}").parse().unwrap()
}

const STATE: &str = "    eips:
      - {name: eip1, ip: 198.51.100.10}
      - {name: eip2, ip: 198.51.100.11}
    fips: [{eip: eip1, internal_ip: 10.10.0.21}]
    snats: [{eip: eip2, internal_cidr: 10.10.0.0/25}]
";

fn bed() -> Option<GwBed> {
    if !require_root() || !collector::available() {
        return None;
    }
    let mut b = GwBed::new(&["10.10.0.21", "10.10.0.22"]).unwrap();
    for (i, tag) in ["vpc0", "vpc1"].iter().enumerate() {
        line_echo_server(&b.vpc[i].ns.name, 7000, tag).unwrap();
    }
    line_echo_server(&b.internet.ns.name, 9000, "inet").unwrap();
    udp_echo_forever(&b.internet.ns.name, 9001).unwrap();
    let state = b.state(STATE);
    b.apply(&state);
    Some(b)
}

fn spec(ipfix: Vec<IpfixSpec>, jsonl: bool) -> FlowLogSpec {
    FlowLogSpec {
        start: true,
        end: true,
        objects: BTreeSet::new(),
        kinds: BTreeSet::new(),
        sample: 1,
        ipfix,
        jsonl: jsonl.then(|| JsonlSpec::File { name: "flows.jsonl".into(), max_bytes: 1 << 20, keep: 2 }),
    }
}

/// The flow-log directory of a test, its JSON Lines file `flows.jsonl`;
/// removed on drop.
struct LogFile(PathBuf);

impl LogFile {
    fn new() -> LogFile {
        LogFile(std::env::temp_dir().join(unique("flowlog")))
    }

    fn dir(&self) -> PathBuf {
        self.0.clone()
    }

    /// Every whole line (one being written is left for the next read).
    fn lines(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(self.0.join("flows.jsonl")).unwrap_or_default();
        let whole = text.rfind('\n').map_or("", |end| &text[..end]);
        whole.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
    }
}

impl Drop for LogFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The records of the flow from `src` port `sport`.
fn of(lines: &[Value], sport: u16) -> Vec<Value> {
    lines.iter().filter(|l| l["sport"] == sport).cloned().collect()
}

/// Waits until each flow of `ports` has its start and end records.
fn wait_records(log: &LogFile, ports: &[u16], what: &str) {
    let started = std::time::Instant::now();
    while !ports.iter().all(|p| of(&log.lines(), *p).len() == 2) {
        let limit = Duration::from_secs(15) * lbagent_tests::slowdown();
        assert!(started.elapsed() < limit, "timed out waiting for {what}: {:#?}", log.lines());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `<tag> <ip>:<port>` → port.
fn port_of(answer: &str) -> u16 {
    answer.rsplit_once(':').unwrap().1.trim().parse().unwrap()
}

#[test]
fn nat_flows_are_logged_as_ipfix_and_json_lines_with_every_end_reason() {
    let Some(b) = bed() else { return };
    let bpffs = b.bed.reconciler.realizer.engine.bpffs.clone();
    let t = b.bed.reconciler.realizer.engine.tables().unwrap();
    let nfcapd = Nfcapd::start().unwrap();
    let log = LogFile::new();
    let collector =
        IpfixSpec { collector: nfcapd.addr, template_refresh: Duration::from_secs(1), observation_domain: 7 };
    let status = Arc::new(Mutex::new(FlowLogStatus::default()));
    let seen = status.clone();
    let mut logger = FlowLogger::new(bpffs.clone(), log.dir(), move |s| *seen.lock().unwrap() = s.clone());
    logger.sync(Some(&spec(vec![collector], true)), &b.bed.reconciler.alloc, None).unwrap();
    let zone = b.zone();
    assert_eq!(t.flow_log_zones().unwrap().get(&zone), Some(&FlowLogZone { flags: 3, sample: 1 }));
    let (vpc1, inet) = (b.vpc[1].ns.name.clone(), b.internet.ns.name.clone());

    // TCP through SNAT, closed with FIN both ways.
    let conn = OpenConn::open_from(&vpc1, at("10.10.0.22", 41001), at(INTERNET, 9000)).unwrap();
    let tcp_port = port_of(&conn.ping("a").unwrap());
    conn.ping("b").unwrap();
    drop(conn);
    // UDP through SNAT, ended by its timeout (1 s) and collected.
    let udp = UdpFlow::open(&vpc1, 41002, at(INTERNET, 9001)).unwrap();
    let udp_port = port_of(&udp.ask("q").unwrap());
    drop(udp);
    // TCP refused by the server: RST.
    assert!(OpenConn::open_from(&vpc1, at("10.10.0.22", 41003), at(INTERNET, 9999)).is_err());
    // Into the FIP, held open, then flushed by the operator (kept open
    // until the end: its next packet would open a flow again, picked up
    // mid-stream).
    let held = OpenConn::open_from(&inet, at(INTERNET, 41004), at("198.51.100.10", 7000)).unwrap();
    assert!(held.ping("x").unwrap().starts_with("vpc0 198.51.100.1:41004"));
    wait_records(&log, &[41001], "start and FIN end records of the TCP flow");
    let flushed = t.flush_conntrack_for(FLOW_END_FLUSH, |k, _| k.sport == 41004 || k.dport == 41004).unwrap();
    assert_eq!(flushed, 1);
    t.set_config(NatConfig { udp_s: 1, ..t.config().unwrap() }).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(lbagent::dataplane::ct_gc::collect(&bpffs).unwrap() >= 1);
    wait_records(&log, &[41002, 41003, 41004], "the UDP, RST and flushed flows' records");
    // The JSON lines: each flow's start and end, named and counted.
    let lines = log.lines();
    let snat_rule = format!("natgw/{}/snat/10.10.0.0/25", b.gw);
    let object = format!("natgw/{}", b.gw);
    for (sport, proto, xport, reason) in
        [(41001, "tcp", tcp_port, "fin"), (41002, "udp", udp_port, "timeout"), (41003, "tcp", 0, "rst")]
    {
        let flow = of(&lines, sport);
        assert_eq!(flow.len(), 2, "{flow:?}");
        let (start, end) = (&flow[0], &flow[1]);
        assert_eq!((start["event"].as_str(), end["event"].as_str()), (Some("start"), Some("end")), "{flow:?}");
        assert_eq!(end["reason"], reason, "{end}");
        for r in &flow {
            assert_eq!(
                (r["src"].as_str(), r["dst"].as_str(), r["proto"].as_str()),
                (Some("10.10.0.22"), Some(INTERNET), Some(proto))
            );
            assert_eq!(r["xlate_src"], "198.51.100.11", "{r}");
            if xport != 0 {
                assert_eq!(r["xlate_sport"], xport, "{r}");
            }
            assert_eq!(r["snat_rule"], snat_rule.as_str(), "{r}");
            assert_eq!(r["object"], object.as_str(), "{r}");
        }
        assert!(end["packets"][0].as_u64().unwrap() >= 1 && end["bytes"][0].as_u64().unwrap() > 0, "{end}");
        if reason == "fin" {
            // SYN, two lines, FIN (and ACKs) each way.
            assert!(end["packets"][0].as_u64().unwrap() >= 4 && end["packets"][1].as_u64().unwrap() >= 4, "{end}");
        }
    }
    let fip = of(&lines, 41004);
    assert_eq!(fip[1]["reason"], "flush", "{fip:?}");
    assert_eq!((fip[0]["src"].as_str(), fip[0]["dst"].as_str()), (Some(INTERNET), Some("198.51.100.10")));
    assert_eq!((fip[0]["xlate_dst"].as_str(), fip[0]["xlate_dport"].as_u64()), (Some("10.10.0.21"), Some(7000)));
    assert_eq!(fip[0]["dnat_rule"], format!("natgw/{}/fip/198.51.100.10", b.gw).as_str());
    // Every record the logger wrote, the collector decoded the same.
    std::thread::sleep(Duration::from_secs(1));
    logger.stop();
    drop(held);
    let decoded = nfcapd.records().unwrap();
    let st = status.lock().unwrap().clone();
    assert_eq!(st.ipfix_sent, st.jsonl_written, "{st:?}");
    assert_eq!(st.dropped, Default::default(), "{st:?}");
    for l in lines.iter().filter(|l| [41001, 41002, 41003, 41004].contains(&l["sport"].as_u64().unwrap())) {
        // RFC 8158's NAT44 session create and delete.
        let event = if l["event"] == "start" { "4" } else { "5" };
        let found = decoded.iter().find(|d| {
            d["src_port"].as_u64() == l["sport"].as_u64()
                && d["src4_addr"] == l["src"]
                && d["dst4_addr"] == l["dst"]
                && d["dst_port"].as_u64() == l["dport"].as_u64()
                && d["src4_xlt_ip"] == l["xlate_src"]
                && d["dst4_xlt_ip"] == l["xlate_dst"]
                && d["src_xlt_port"].as_str().map(|p| p.parse::<u64>().unwrap()) == l["xlate_sport"].as_u64()
                && d["nat_event_id"] == event
        });
        let d = found.unwrap_or_else(|| panic!("{l} not among the collector's records:\n{decoded:#?}"));
        if l["event"] == "end" {
            assert_eq!(d["in_packets"].as_u64(), l["packets"][0].as_u64(), "{d} vs {l}");
            assert_eq!(d["in_bytes"].as_u64(), l["bytes"][0].as_u64(), "{d} vs {l}");
            assert_eq!(d["out_bytes"].as_u64(), l["bytes"][1].as_u64(), "{d} vs {l}");
        }
        assert_eq!(d["ingress_vrf"], zone.to_string().as_str(), "{d}");
    }
    // Counts are left only for flows still in the tables (closed ones
    // wait out their closing timeout there).
    let mut left = Vec::new();
    t.each_flow_acct(|k, v| left.extend(k.iter().zip(v).map(|(k, v)| (*k, v.xlate)))).unwrap();
    let alive = t.alive_checker().unwrap();
    for (k, xlate) in &left {
        assert!(alive.alive(k, xlate), "counts of a flow gone are left: {k:?}");
    }
    assert!(left.iter().all(|(k, _)| k.orig.sport != 41002), "the UDP flow's counts went with its end record");
}

#[test]
fn filters_sampling_and_turning_off() {
    let Some(b) = bed() else { return };
    let bpffs = b.bed.reconciler.realizer.engine.bpffs.clone();
    let t = b.bed.reconciler.realizer.engine.tables().unwrap();
    let log = LogFile::new();
    let mut logger = FlowLogger::new(bpffs.clone(), log.dir(), |_| {});
    let vpc1 = b.vpc[1].ns.name.clone();
    let inet = b.internet.ns.name.clone();
    // Only FIP flows, only their end: SNAT flows are left out.
    let mut only_fip = spec(vec![], true);
    only_fip.kinds = [RuleKind::Fip].into_iter().collect();
    only_fip.start = false;
    logger.sync(Some(&only_fip), &b.bed.reconciler.alloc, None).unwrap();
    assert_eq!(t.flow_log_zones().unwrap().get(&b.zone()), Some(&FlowLogZone { flags: FLOW_LOG_END, sample: 1 }));
    drop(OpenConn::open_from(&vpc1, at("10.10.0.22", 42001), at(INTERNET, 9000)).unwrap());
    let c = OpenConn::open_from(&inet, at(INTERNET, 42002), at("198.51.100.10", 7000)).unwrap();
    c.ping("x").unwrap();
    drop(c);
    wait_for(|| !of(&log.lines(), 42002).is_empty(), "the FIP flow's end record");
    std::thread::sleep(Duration::from_millis(500));
    let lines = log.lines();
    assert!(of(&lines, 42001).is_empty(), "a SNAT flow passed the fip filter: {lines:?}");
    assert_eq!(of(&lines, 42002).len(), 1, "end only: {lines:?}");
    // Another object only: this gateway's zone logs nothing.
    let mut other = spec(vec![], true);
    other.objects = ["natgw/another".to_string()].into_iter().collect();
    logger.sync(Some(&other), &b.bed.reconciler.alloc, None).unwrap();
    assert_eq!(t.flow_log_zones().unwrap().get(&b.zone()), None);
    // One flow in 1 000 000: of 20 new flows, none logged (sampled out).
    let mut sampled = spec(vec![], true);
    sampled.sample = 1_000_000;
    logger.sync(Some(&sampled), &b.bed.reconciler.alloc, None).unwrap();
    for p in 43000..43020 {
        drop(OpenConn::open_from(&vpc1, at("10.10.0.22", p), at(INTERNET, 9000)).unwrap());
    }
    // Off: the zone is cleared and the logger stops.
    logger.sync(None, &b.bed.reconciler.alloc, None).unwrap();
    assert!(t.flow_log_zones().unwrap().is_empty());
    let lines = log.lines();
    assert!(lines.iter().all(|l| !(43000..43020).contains(&l["sport"].as_u64().unwrap())), "sampled: {lines:?}");
    let sampled_in = t
        .conntrack()
        .unwrap()
        .into_iter()
        .filter(|(k, e)| (43000..43020).contains(&k.sport) && e.flags & CT_F_LOGGED != 0);
    assert_eq!(sampled_in.count(), 0, "flows of one in a million marked logged");
}

/// Every record the ring holds now.
fn drain(ring: &mut aya::maps::RingBuf<aya::maps::MapData>) -> Vec<FlowEvent> {
    let mut out = Vec::new();
    while let Some(item) = ring.next() {
        assert_eq!(item.len(), std::mem::size_of::<FlowEvent>());
        // SAFETY: the program writes whole `FlowEvent`s (plain integers).
        out.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<FlowEvent>()) });
    }
    out
}

/// Runs `l4` from `src` to `dst`; the bytes its IP packet counts.
fn send(e: &mut TestZone, src: [u8; 4], dst: [u8; 4], l4: lbagent_tests::packet::L4) -> u64 {
    let f = frame(&Ip::new(src, dst), &l4);
    e.run(&f).unwrap();
    f.len() as u64 - 14
}

/// The program's own records on crafted packets (no collector; this test
/// runs on Linux 5.10 in the VM tier): nothing while the zone does not log;
/// a start record with the translation; counts per direction in IP bytes;
/// an end record at FIN both ways and at an RST, with the counts; a sampled
/// zone that logs nothing.
#[test]
fn the_program_writes_start_and_close_records_with_counts_both_ways() {
    let Some(mut e) = engine() else { return };
    let mut ring = e.tables.flow_events().unwrap();
    send(&mut e, CLIENT, VIP, tcp(SYN, 40000, 80, b""));
    assert!(drain(&mut ring).is_empty(), "a zone that does not log writes nothing");
    e.tables.set_flow_log_zone(ZONE, FlowLogZone { flags: FLOW_LOG_START | FLOW_LOG_END, sample: 1 }).unwrap();

    let mut sent = [0u64; 2];
    let mut packets = [0u64; 2];
    sent[0] += send(&mut e, CLIENT, VIP, tcp(SYN, 40001, 80, b""));
    packets[0] += 1;
    let start = drain(&mut ring);
    assert_eq!(start.len(), 1, "{start:?}");
    let s = start[0];
    assert_eq!((s.kind, s.family, s.proto, s.zone), (FLOW_EVENT_START, 4, PROTO_TCP, ZONE));
    assert_eq!((v4_of(&s.orig_saddr), s.orig_sport, v4_of(&s.orig_daddr), s.orig_dport), (CLIENT, 40001, VIP, 80));
    assert_eq!((v4_of(&s.xlate_daddr), s.xlate_dport, s.dnat_rule), (lbagent_tests::fixture::SERVER, 8080, 1));
    assert_eq!(s.orig_saddr[..12], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff], "IPv4-mapped");
    assert_ne!(s.flags & CT_F_LOGGED, 0);
    // The reply goes to the translated source (the engine may SNAT too).
    let (xs, xp) = (v4_of(&s.xlate_saddr), s.xlate_sport);
    let server = v4_of(&s.xlate_daddr);
    sent[1] += send(&mut e, server, xs, tcp(SYN | ACK, 8080, xp, b""));
    sent[0] += send(&mut e, CLIENT, VIP, tcp(ACK, 40001, 80, b""));
    sent[0] += send(&mut e, CLIENT, VIP, tcp(ACK, 40001, 80, b"hello, flow logs"));
    sent[1] += send(&mut e, server, xs, tcp(ACK, 8080, xp, b"hi"));
    sent[0] += send(&mut e, CLIENT, VIP, tcp(FIN | ACK, 40001, 80, b""));
    packets = [packets[0] + 3, 2];
    assert!(drain(&mut ring).is_empty(), "no record before the close");
    sent[1] += send(&mut e, server, xs, tcp(FIN | ACK, 8080, xp, b""));
    packets[1] += 1;
    let end = drain(&mut ring);
    assert_eq!(end.len(), 1, "{end:?}");
    let end = end[0];
    assert_eq!((end.kind, end.reason, end.created_ms), (FLOW_EVENT_END, FLOW_END_FIN, s.created_ms));
    assert_eq!((end.packets, end.bytes), (packets, sent), "counts both ways, in IP bytes");
    assert_eq!((end.start_ns, v4_of(&end.xlate_saddr), end.xlate_sport), (s.time_ns, xs, xp));
    assert!(end.time_ns >= s.time_ns);
    // A late ACK of the closed flow writes nothing more.
    send(&mut e, CLIENT, VIP, tcp(ACK, 40001, 80, b""));
    assert!(drain(&mut ring).is_empty());

    // An RST ends a flow too.
    send(&mut e, CLIENT, VIP, tcp(SYN, 40002, 80, b""));
    let s = drain(&mut ring)[0];
    send(&mut e, v4_of(&s.xlate_daddr), v4_of(&s.xlate_saddr), tcp(RST | ACK, 8080, s.xlate_sport, b""));
    let end = drain(&mut ring);
    assert_eq!((end.len(), end[0].reason, end[0].packets), (1, FLOW_END_RST, [1, 1]), "{end:?}");
    let mut ended = Vec::new();
    e.tables.each_flow_acct(|k, v| ended.extend(k.iter().zip(v).map(|(k, v)| (k.orig.sport, v.ended)))).unwrap();
    ended.sort();
    assert_eq!(ended, [(40001, FLOW_END_FIN), (40002, FLOW_END_RST)], "counts kept until the entries go");

    // One flow in a million: 50 new flows, none logged.
    e.tables.set_flow_log_zone(ZONE, FlowLogZone { flags: FLOW_LOG_START | FLOW_LOG_END, sample: 1_000_000 }).unwrap();
    for p in 0..50 {
        send(&mut e, CLIENT, VIP, tcp(SYN, 41000 + p, 80, b""));
    }
    assert!(drain(&mut ring).is_empty());
}
