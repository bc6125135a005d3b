//! The VPC NAT gateway with real traffic: an "internet" host on the external
//! bridge, VPC hosts on the OVS integration bridge (userspace datapath), the
//! gateway plumbed and programmed by the reconciler.

use std::{collections::HashSet, net::SocketAddr};

use lbagent::daemon::status::{SnatNames, SnatPorts, Status};
use lbagent_common::PROTO_ICMP;
use lbagent_tests::{
    gateway::{GwBed, INTERNET_IP as INTERNET},
    require_root,
    traffic::*,
};

fn at(ip: &str, port: u16) -> SocketAddr {
    format!("{ip}:{port}").parse().unwrap()
}

/// `<tag> <ip>:<port>` → (tag, ip).
fn who(answer: &str) -> (String, String) {
    let (tag, peer) = answer.split_once(' ').unwrap();
    (tag.to_string(), peer.rsplit_once(':').unwrap().0.to_string())
}

const EIPS: &str = "    eips:
      - {name: eip1, ip: 198.51.100.10}
      - {name: eip2, ip: 198.51.100.11}
      - {name: eip3, ip: 198.51.100.12}
";

const RULES: &str = "    fips: [{eip: eip1, internal_ip: 10.10.0.21}]
    dnats:
      - {eip: eip2, protocol: tcp, external_port: 2222, internal_ip: 10.10.0.22, internal_port: 8022}
      - {eip: eip3, protocol: tcp, external_port: 80, internal_ip: 10.10.0.22, internal_port: 8080, mode: share}
      - {eip: eip3, protocol: tcp, external_port: 80, internal_ip: 10.10.0.23, internal_port: 8080, mode: share}
    snats: [{eip: eip2, internal_cidr: 10.10.0.0/25}]
";

/// Bed with four VPC hosts (.21 FIP, .22 and .23 DNAT backends, .200
/// outside the SNAT range), servers everywhere, gateway applied.
fn bed() -> Option<GwBed> {
    if !require_root() {
        return None;
    }
    let mut b = GwBed::new(&["10.10.0.21", "10.10.0.22", "10.10.0.23", "10.10.0.200"]).unwrap();
    for (i, tag) in ["vpc0", "vpc1", "vpc2", "vpc3"].iter().enumerate() {
        for port in [7000, 8022, 8080] {
            line_echo_server(&b.vpc[i].ns.name, port, tag).unwrap();
        }
    }
    line_echo_server(&b.internet.ns.name, 9000, "inet").unwrap();
    udp_echo_forever(&b.internet.ns.name, 9001).unwrap();
    let state = b.state(&format!("{EIPS}{RULES}"));
    b.apply(&state);
    Some(b)
}

#[test]
fn fip_dnat_snat_hairpin_and_icmp() {
    let Some(b) = bed() else { return };
    let inet = &b.internet.ns.name;
    let vpc = |i: usize| b.vpc[i].ns.name.clone();

    // FIP inbound: the internal host sees the real client.
    assert_eq!(who(&ask_tcp(inet, at("198.51.100.10", 7000)).unwrap()), ("vpc0".into(), "198.51.100.1".into()));
    // FIP outbound: the internet sees the EIP.
    assert_eq!(who(&ask_tcp(&vpc(0), at("198.51.100.1", 9000)).unwrap()), ("inet".into(), "198.51.100.10".into()));
    // DNAT exclusive.
    assert_eq!(who(&ask_tcp(inet, at("198.51.100.11", 2222)).unwrap()), ("vpc1".into(), "198.51.100.1".into()));
    // DNAT share: both backends serve.
    let tags: HashSet<String> = (0..24).map(|_| who(&ask_tcp(inet, at("198.51.100.12", 80)).unwrap()).0).collect();
    assert_eq!(tags, HashSet::from(["vpc1".to_string(), "vpc2".to_string()]));
    // SNAT.
    assert_eq!(who(&ask_tcp(&vpc(1), at("198.51.100.1", 9000)).unwrap()), ("inet".into(), "198.51.100.11".into()));

    // 200 concurrent UDP flows from two hosts that use the same source ports:
    // every reply comes back and no two flows share a translated port.
    let mut seen = HashSet::new();
    for i in [1, 2] {
        for answer in udp_many(&vpc(i), at("198.51.100.1", 9001), 40000..40100).unwrap() {
            let (ip, port) = answer.rsplit_once(':').unwrap();
            assert_eq!(ip, "198.51.100.11");
            assert!(seen.insert(port.to_string()), "port {port} used twice");
        }
    }
    assert_eq!(seen.len(), 200);
    // The port census (a conntrack pass's): eip2 holds those 200 UDP ports,
    // counted under its SNAT rule, in the status and the metrics.
    let t = b.bed.reconciler.realizer.engine.tables().unwrap();
    let mut st = Status::default();
    st.refresh(&b.bed.reconciler.applied, &b.bed.reconciler.alloc);
    let names = SnatNames::of(&st.document.rules, &st.document.nat_gateways);
    let census = t.port_census(names.rules.keys().copied(), names.eips.iter().map(|(_, ip)| *ip)).unwrap();
    st.document.snat_ports = Some(std::sync::Arc::new(SnatPorts::of(&census, &Default::default(), &names, 1)));
    let ports = st.document.snat_ports.clone().unwrap();
    let eip2 = format!("natgw/{}/eip/eip2", b.gw);
    let used = ports.eips.iter().find(|e| e.eip == eip2).unwrap_or_else(|| panic!("{eip2} in {ports:?}"));
    assert_eq!((used.ports.udp, used.ports.tcp >= 1), (200, true), "{used:?}");
    assert_eq!(used.share_pct, 0.3, "200 of 64 512 ports");
    let rule = format!("natgw/{}/snat/10.10.0.0/25", b.gw);
    let by_rule = ports.rules.iter().find(|r| *r.rule == *rule).unwrap_or_else(|| panic!("{rule} in {ports:?}"));
    assert_eq!((by_rule.flows.udp, by_rule.ports.udp, by_rule.no_free_port), (200, 200, 0), "{by_rule:?}");
    assert_eq!(&*by_rule.rule, rule.as_str());
    // eip3 serves DNAT only; eip1's FIP (1:1, the client's ports kept) is no port allocation.
    for none in ["eip1", "eip3"] {
        assert!(ports.eips.iter().all(|e| e.eip != format!("natgw/{}/eip/{none}", b.gw)), "{none}: {ports:?}");
    }
    assert_eq!(ports.rules.len(), 1, "only the CIDR SNAT rule: {ports:?}");
    let metrics = lbagent::daemon::metrics::render(&b.bed.reconciler.realizer.engine.bpffs, &st).unwrap();
    let series = format!("lbagent_eip_ports_in_use{{eip=\"{eip2}\",protocol=\"udp\"}} 200");
    assert!(metrics.contains(&series), "{series} in\n{metrics}");
    assert!(!metrics.contains("lbagent_snat_flows"), "no series per rule and protocol");

    // Hairpin: a VPC host reaching an EIP of its own gateway is SNAT'ed to
    // the EIP it asked for, inside a SNAT CIDR or not (SNAT is keyed on the
    // egress interface, like `-o net1`: a hairpin leaves by eth0).
    assert_eq!(who(&ask_tcp(&vpc(3), at("198.51.100.10", 7000)).unwrap()), ("vpc0".into(), "198.51.100.10".into()));
    assert_eq!(who(&ask_tcp(&vpc(1), at("198.51.100.10", 7000)).unwrap()), ("vpc0".into(), "198.51.100.10".into()));
    // A host in a SNAT CIDR reaches the gateway's own LAN address: ping
    // answers and a closed port refuses at once (not SNAT'ed, no timeout).
    let out = b.vpc[1].ns.exec(&["ping", "-c", "1", "-W", "2", lbagent_tests::gateway::LAN_GW_IP]).unwrap();
    assert!(out.contains("1 received"), "{out}");
    let started = std::time::Instant::now();
    let err = ask_tcp(&vpc(1), at(lbagent_tests::gateway::LAN_GW_IP, 9)).unwrap_err();
    assert!(format!("{err:#}").contains("refused"), "{err:#}");
    assert!(started.elapsed() < std::time::Duration::from_secs(2));

    // ICMP: ping through the FIP reaches the internal host; errors translate both ways.
    let out = b.internet.ns.exec(&["ping", "-c", "2", "-W", "2", "198.51.100.10"]).unwrap();
    assert!(out.contains("from 198.51.100.10"), "{out}");
    let zone = b.zone();
    assert!(
        t.conntrack()
            .unwrap()
            .iter()
            .any(|(k, e)| k.zone == zone && k.proto == PROTO_ICMP && e.xlate.daddr == [10, 10, 0, 21]),
        "echo went to the FIP's internal host"
    );
    // Per-rule statistics: the FIP's DNAT rule counted its traffic.
    let fip_id = b.bed.reconciler.alloc.rule_ids[format!("natgw/{}/fip/198.51.100.10", b.gw).as_str()];
    let stats = t.rule_stats().unwrap();
    assert!(stats.iter().any(|(id, s)| *id == fip_id && s.packets >= 4 && s.bytes > 0), "{stats:?}");
    udp_expect_refused(inet, at("198.51.100.10", 9999)).unwrap();
    udp_expect_refused(&vpc(0), at("198.51.100.1", 9999)).unwrap();

    // Status: each EIP and what uses it.
    let mut st = Status::default();
    st.refresh(&b.bed.reconciler.applied, &b.bed.reconciler.alloc);
    let doc = serde_json::to_value(&st.document).unwrap();
    let eips = &doc["nat_gateways"][0]["eips"];
    assert_eq!(eips[0]["used_by"][0], "fip -> 10.10.0.21");
    assert_eq!(eips[1]["used_by"][0], "dnat tcp 2222 -> 10.10.0.22:8022");
    assert_eq!(eips[1]["used_by"][1], "snat 10.10.0.0/25");
}

/// 4 000-byte UDP datagrams (three fragments each way on 1 500-byte links)
/// through SNAT, a port DNAT and a FIP: each side sees only public
/// addresses and every byte comes back.
#[test]
fn large_udp_datagrams_are_translated_fragment_by_fragment() {
    if !require_root() {
        return;
    }
    let mut b = GwBed::new(&["10.10.0.21", "10.10.0.22"]).unwrap();
    let inet = b.internet.ns.name.clone();
    let (fip_host, snat_host) = (b.vpc[0].ns.name.clone(), b.vpc[1].ns.name.clone());
    udp_big_echo_forever(&inet, 9002).unwrap();
    udp_big_echo_forever(&fip_host, 9003).unwrap();
    udp_big_echo_forever(&snat_host, 9004).unwrap();
    let rules = "    fips: [{eip: eip1, internal_ip: 10.10.0.21}]
    dnats: [{eip: eip2, protocol: udp, external_port: 5353, internal_ip: 10.10.0.22, internal_port: 9004}]
    snats: [{eip: eip2, internal_cidr: 10.10.0.0/25}]
";
    b.apply(&b.state(&format!("{EIPS}{rules}")));
    let seen = |answer: (String, SocketAddr)| (answer.0.rsplit_once(':').unwrap().0.to_string(), answer.1);
    // SNAT: the internet host sees the EIP; the answer comes back whole.
    let (view, _) = seen(udp_big_ask(&snat_host, at("198.51.100.1", 9002), 4000).unwrap());
    assert_eq!(view, "198.51.100.11");
    // FIP outbound and inbound.
    let (view, _) = seen(udp_big_ask(&fip_host, at("198.51.100.1", 9002), 4000).unwrap());
    assert_eq!(view, "198.51.100.10");
    let (view, from) = seen(udp_big_ask(&inet, at("198.51.100.10", 9003), 4000).unwrap());
    assert_eq!((view.as_str(), from), ("198.51.100.1", at("198.51.100.10", 9003)));
    // Port DNAT: the answer's source is the EIP and its external port.
    let (view, from) = seen(udp_big_ask(&inet, at("198.51.100.11", 5353), 4000).unwrap());
    assert_eq!((view.as_str(), from), ("198.51.100.1", at("198.51.100.11", 5353)));
    let t = b.bed.reconciler.realizer.engine.tables().unwrap();
    assert!(t.counter(lbagent_common::Counter::FragmentsTranslated).unwrap() >= 8);
    assert_eq!(t.counter(lbagent_common::Counter::DropFragmentUntracked).unwrap(), 0);
}

/// Protocols without ports (GRE, ESP, SCTP) through a FIP, both ways and
/// whoever starts: the internal host sees the real peer, the peer sees the EIP.
#[test]
fn a_floating_ip_carries_every_ip_protocol() {
    let Some(b) = bed() else { return };
    let (inet, fip_host) = (&b.internet.ns.name, &b.vpc[0].ns.name);
    let (eip, peer) = (std::net::Ipv4Addr::new(198, 51, 100, 10), std::net::Ipv4Addr::new(198, 51, 100, 1));
    for proto in [47u8, 50, 132] {
        raw_ip_echo_forever(fip_host, proto).unwrap();
        raw_ip_echo_forever(inet, proto).unwrap();
        // The peer starts: DNAT to the internal host, the answer SNAT'ed back.
        let (seen, from) = raw_ip_ask(inet, proto, eip).unwrap();
        assert_eq!((seen.as_str(), from), ("198.51.100.1", eip), "protocol {proto} inbound");
        // The internal host starts.
        let (seen, from) = raw_ip_ask(fip_host, proto, peer).unwrap();
        assert_eq!((seen.as_str(), from), ("198.51.100.10", peer), "protocol {proto} outbound");
    }
}

/// ICMP errors the gateway itself sends about a translated packet quote
/// what the sender sent (the egress program): path MTU discovery and
/// traceroute work through a FIP.
#[test]
fn gateway_icmp_errors_quote_what_the_sender_sent() {
    let Some(b) = bed() else { return };
    let gw_ns = b.netns();
    lbagent_tests::net::in_ns(&gw_ns, &["ip", "link", "set", "eth0", "mtu", "1200"]).unwrap();
    // ping exits 1 without an echo reply; its output is in the error.
    let ping = |args: &[&str]| {
        let mut v = vec!["ping", "-n", "-c", "1", "-W", "2"];
        v.extend_from_slice(args);
        match b.internet.ns.exec(&v) {
            Ok(out) => out,
            Err(e) => format!("{e:#}"),
        }
    };
    let out = ping(&["-M", "do", "-s", "1300", "198.51.100.10"]);
    assert!(out.contains("Frag needed") && out.contains("mtu = 1200"), "{out}");
    let out = ping(&["-t", "1", "198.51.100.10"]);
    assert!(out.contains("Time to live exceeded"), "{out}");
    let t = b.bed.reconciler.realizer.engine.tables().unwrap();
    assert!(t.counter(lbagent_common::Counter::IcmpErrorsLocalTranslated).unwrap() >= 2);
    // The right size still goes through.
    let out = ping(&["-M", "do", "-s", "1100", "198.51.100.10"]);
    assert!(out.contains("1 received"), "{out}");

    // The other way: a SNAT'ed VPC host to the internet with a smaller MTU
    // on net1. The gateway addresses its errors to the EIP (its own); the
    // egress program on `lo` sends them on to the host.
    lbagent_tests::net::in_ns(&gw_ns, &["ip", "link", "set", "eth0", "mtu", "1500"]).unwrap();
    lbagent_tests::net::in_ns(&gw_ns, &["ip", "link", "set", "net1", "mtu", "1200"]).unwrap();
    let from_vpc = |args: &[&str]| {
        let mut v = vec!["ping", "-n", "-c", "1", "-W", "2"];
        v.extend_from_slice(args);
        match b.vpc[1].ns.exec(&v) {
            Ok(out) => out,
            Err(e) => format!("{e:#}"),
        }
    };
    let out = from_vpc(&["-M", "do", "-s", "1300", "198.51.100.1"]);
    assert!(out.contains("Frag needed") && out.contains("mtu = 1200"), "{out}");
    let out = from_vpc(&["-t", "1", "198.51.100.1"]);
    assert!(out.contains("Time to live exceeded"), "{out}");
    let out = from_vpc(&["-M", "do", "-s", "1100", "198.51.100.1"]);
    assert!(out.contains("1 received"), "{out}");
}

#[test]
fn updates_flushes_and_draining() {
    let Some(mut b) = bed() else { return };
    let inet = b.internet.ns.name.clone();

    // A long-lived flow through the FIP, then the FIP is deleted: its flows
    // are flushed and forwarding stops.
    let conn = OpenConn::open(&inet, at("198.51.100.10", 7000)).unwrap();
    assert!(conn.ping("a").unwrap().starts_with("vpc0"));
    let no_fip = b.state(&format!("{EIPS}{}", RULES.replace("    fips: [{eip: eip1, internal_ip: 10.10.0.21}]\n", "")));
    b.apply(&no_fip);
    let zone = b.zone();
    let t = b.bed.reconciler.realizer.engine.tables().unwrap();
    assert!(
        !t.conntrack()
            .unwrap()
            .iter()
            .any(|(k, e)| k.zone == zone && (e.xlate.daddr == [10, 10, 0, 21] || k.daddr == [10, 10, 0, 21]))
    );
    assert!(conn.ping("b").is_err(), "the flushed flow no longer reaches the old FIP target");
    assert!(ask_tcp(&inet, at("198.51.100.10", 7000)).is_err(), "no forwarding without the FIP");

    // Spec updates take effect: FIP to another host, DNAT to another port.
    let updated = RULES.replace("internal_ip: 10.10.0.21}]", "internal_ip: 10.10.0.23}]").replace(
        "external_port: 2222, internal_ip: 10.10.0.22, internal_port: 8022",
        "external_port: 2223, internal_ip: 10.10.0.22, internal_port: 7000",
    );
    b.apply(&b.state(&format!("{EIPS}{updated}")));
    assert!(ask_tcp(&inet, at("198.51.100.10", 7000)).unwrap().starts_with("vpc2"));
    assert_eq!(who(&ask_tcp(&inet, at("198.51.100.11", 2223)).unwrap()).0, "vpc1");
    assert!(ask_tcp(&inet, at("198.51.100.11", 2222)).is_err());

    // Removing one share backend keeps existing flows (they drain), new
    // flows go to the remaining backend.
    let conns: Vec<(OpenConn, String)> = (0..12)
        .map(|_| {
            let c = OpenConn::open(&inet, at("198.51.100.12", 80)).unwrap();
            let tag = who(&c.ping("x").unwrap()).0;
            (c, tag)
        })
        .collect();
    assert!(conns.iter().any(|(_, t)| t == "vpc2"), "some flows on the backend we remove");
    let one_backend = updated.replace("      - {eip: eip3, protocol: tcp, external_port: 80, internal_ip: 10.10.0.23, internal_port: 8080, mode: share}\n", "");
    b.apply(&b.state(&format!("{EIPS}{one_backend}")));
    for (c, tag) in &conns {
        assert_eq!(&who(&c.ping("still there").unwrap()).0, tag, "existing flow kept its backend");
    }
    for _ in 0..6 {
        assert_eq!(who(&ask_tcp(&inet, at("198.51.100.12", 80)).unwrap()).0, "vpc1");
    }

    // Adding an EIP announces it with a gratuitous ARP on the external network.
    let arp = capture_arp(&inet, std::time::Duration::from_secs(3));
    std::thread::sleep(std::time::Duration::from_millis(200));
    let more_eips = format!("{EIPS}      - {{name: eip4, ip: 198.51.100.13}}\n");
    b.apply(&b.state(&format!("{more_eips}{one_backend}")));
    let frames = arp.join().unwrap().unwrap();
    assert!(
        frames.iter().any(|f| f.len() >= 42 && f[28..32] == [198, 51, 100, 13] && f[38..42] == [198, 51, 100, 13]),
        "no gratuitous ARP for 198.51.100.13 among {} ARP frames",
        frames.len()
    );

    // Moving a DNAT to another EIP: the new address serves, the old one stops.
    let moved = one_backend
        .replace("{eip: eip2, protocol: tcp, external_port: 2223", "{eip: eip4, protocol: tcp, external_port: 2223");
    assert_ne!(moved, one_backend);
    b.apply(&b.state(&format!("{more_eips}{moved}")));
    assert_eq!(who(&ask_tcp(&inet, at("198.51.100.13", 2223)).unwrap()).0, "vpc1");
    assert!(ask_tcp(&inet, at("198.51.100.11", 2223)).is_err());

    // Deleting an EIP that rules still use is refused by validation.
    let err = lbagent::state::load_str(
        &b.state(&format!("    eips: [{{name: eip1, ip: 198.51.100.10}}]\n{one_backend}")),
        lbagent::state::Format::Yaml,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("no EIP \"eip2\""), "{err}");
}

#[test]
fn snat_longest_prefix_in_any_order() {
    if !require_root() {
        return;
    }
    let mut b = GwBed::new(&["10.10.0.21"]).unwrap();
    line_echo_server(&b.internet.ns.name, 9000, "inet").unwrap();
    let eips = "    eips:
      - {name: a, ip: 198.51.100.20}
      - {name: b, ip: 198.51.100.21}
      - {name: c, ip: 198.51.100.22}
      - {name: d, ip: 198.51.100.23}
";
    let host = b.vpc[0].ns.name.clone();
    let seen_as = |_: &GwBed| who(&ask_tcp(&host, at("198.51.100.1", 9000)).unwrap()).1;
    // Worst order: broadest first, one apply each (kube-ovn's ordering case).
    let mut snats = String::from("    snats:\n");
    for (eip, cidr, expect) in [
        ("a", "10.10.0.0/16", "198.51.100.20"),
        ("b", "10.10.0.0/20", "198.51.100.21"),
        ("c", "10.10.0.0/24", "198.51.100.22"),
    ] {
        snats += &format!("      - {{eip: {eip}, internal_cidr: {cidr}}}\n");
        b.apply(&b.state(&format!("{eips}{snats}")));
        assert_eq!(seen_as(&b), expect, "after adding {cidr}");
    }
    // Removing the /20 keeps the order.
    let without_20 = snats.replace("      - {eip: b, internal_cidr: 10.10.0.0/20}\n", "");
    b.apply(&b.state(&format!("{eips}{without_20}")));
    assert_eq!(seen_as(&b), "198.51.100.22");
    // A bare IP is a /32 and wins.
    let with_ip = format!("{without_20}      - {{eip: d, internal_cidr: 10.10.0.21}}\n");
    b.apply(&b.state(&format!("{eips}{with_ip}")));
    assert_eq!(seen_as(&b), "198.51.100.23");
}

/// The gateway state of `bed` with the fast path on or off.
fn with_fast_path(b: &GwBed, fast: bool) -> String {
    let state = b.state(&format!("{EIPS}{RULES}"));
    state.replace("agent: {", &format!("agent: {{fast_path: {fast}, "))
}

/// A TCP connection from `ns` to `to` (a `line_echo_server`): each
/// `echo` sends a line and waits up to `wait` for the answer.
struct Stream {
    s: std::net::TcpStream,
    r: std::io::BufReader<std::net::TcpStream>,
}

impl Stream {
    fn open(ns: &str, to: SocketAddr) -> Stream {
        let (s, r) = lbagent_tests::topology::spawn_in(ns, move || {
            let s = std::net::TcpStream::connect_timeout(&to, std::time::Duration::from_secs(5))?;
            let r = std::io::BufReader::new(s.try_clone()?);
            Ok((s, r))
        })
        .join()
        .unwrap()
        .unwrap();
        Stream { s, r }
    }

    fn echo(&mut self, line: &str, wait: std::time::Duration) -> Result<std::time::Duration, String> {
        use std::io::{BufRead, Write};
        let start = std::time::Instant::now();
        self.s.set_read_timeout(Some(wait)).unwrap();
        self.s.write_all(format!("{line}\n").as_bytes()).map_err(|e| e.to_string())?;
        let mut back = String::new();
        self.r.read_line(&mut back).map_err(|e| format!("no echo of {line:?} within {wait:?}: {e}"))?;
        if back.is_empty() {
            return Err(format!("connection closed instead of answering {line:?}"));
        }
        Ok(start.elapsed())
    }
}

/// The next hop's MAC address changes under a running TCP stream, with no
/// gratuitous ARP (Linux sends none by default): the gateway must learn
/// the new one the way the stack does (its entry goes stale, is probed,
/// fails, is resolved again) with the fast path on as with it off. A fast
/// path that copies the FIB's MAC into the frame keeps sending to the old
/// address for ever: nothing that bypasses the neighbour layer probes a
/// stale entry.
#[test]
fn a_next_hop_whose_mac_changes_is_learnt_again_with_and_without_the_fast_path() {
    let Some(mut b) = bed() else { return };
    let gw_ns = b.netns();
    // Short neighbour timers in the gateway, so a stale entry is probed
    // within seconds (defaults: reachable 15–45 s, first probe after 5 s).
    for (param, value) in
        [("base_reachable_time_ms", "1000"), ("delay_first_probe_time", "1"), ("retrans_time_ms", "200")]
    {
        lbagent_tests::net::in_ns(&gw_ns, &["sysctl", "-qw", &format!("net.ipv4.neigh.net1.{param}={value}")]).unwrap();
    }
    for (round, (fast, mac)) in [(true, "02:00:00:00:aa:01"), (false, "02:00:00:00:aa:02")].into_iter().enumerate() {
        let state = with_fast_path(&b, fast);
        b.apply(&state);
        // .22 is SNAT'ed to eip2; the internet host is the next hop.
        let mut s = Stream::open(&b.vpc[1].ns.name, at(INTERNET, 9000));
        s.echo(&format!("before-{round}"), std::time::Duration::from_secs(5)).unwrap();
        // Idle past the reachable time: the entry is stale when the MAC
        // changes (a fast path that copies the FIB's MAC leaves it stale
        // for ever; the neighbour layer moves it on to a probe).
        std::thread::sleep(std::time::Duration::from_secs(3));
        b.internet.set_mac(mac).unwrap();
        let took = s
            .echo(&format!("after-{round}"), std::time::Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("fast path {fast}: the stream stalled after the MAC change: {e}"));
        eprintln!("fast path {fast}: the stream resumed {took:?} after the MAC change");
        let neigh = lbagent_tests::net::in_ns(&gw_ns, &["ip", "neigh", "show", "dev", "net1", INTERNET]).unwrap();
        assert!(neigh.contains(mac), "fast path {fast}: the gateway learnt {mac}: {neigh}");
    }
}

/// TCP from a TSO sender crosses a link with a smaller MTU (the gateway's
/// `eth0` at 1400, the VPC host's at 1500, so the sender's MSS does not
/// fit): the gateway must answer frag-needed as `ip_forward` does and no
/// frame longer than 1400 may leave `eth0`, with the fast path on and off.
/// The sender's GSO packets reach the gateway whole; a fast path that
/// redirects them unchecked sends 1500-byte segments out of `eth0`.
#[test]
fn tso_tcp_over_a_smaller_mtu_gets_frag_needed_with_and_without_the_fast_path() {
    let Some(mut b) = bed() else { return };
    let gw_ns = b.netns();
    let vpc = b.vpc[0].ns.name.clone();
    // Frames over 1400 bytes of IP that reach the FIP's host, counted
    // before anything else sees them.
    for cmd in [
        "add table ip big",
        "add chain ip big pre { type filter hook prerouting priority -400; }",
        "add rule ip big pre ip length > 1400 counter",
    ] {
        let mut args = vec!["nft"];
        args.extend(cmd.split(' '));
        b.vpc[0].ns.exec(&args).unwrap();
    }
    let big = || -> u64 {
        let out = lbagent_tests::net::in_ns(&vpc, &["nft", "list", "chain", "ip", "big", "pre"]).unwrap();
        out.split("packets ").nth(1).and_then(|r| r.split(' ').next()?.parse().ok()).unwrap_or(u64::MAX)
    };
    tcp_bulk_server(&vpc, 7100).unwrap();
    for (round, fast) in [true, false].into_iter().enumerate() {
        let state = with_fast_path(&b, fast);
        b.apply(&state);
        lbagent_tests::net::in_ns(&gw_ns, &["ip", "link", "set", "eth0", "mtu", "1400"]).unwrap();
        // The agent takes the new MTU up at its next pass.
        b.bed.repair(&state);
        // Every round starts with a fresh path MTU at the sender.
        b.internet.ns.exec(&["ip", "route", "flush", "cache"]).unwrap();
        let before = big();
        let sent = tcp_bulk_send(&b.internet.ns.name, at("198.51.100.10", 7100), 4 << 20)
            .unwrap_or_else(|e| panic!("fast path {fast}: the transfer failed: {e:#}"));
        assert_eq!(sent, 4 << 20, "fast path {fast}: every byte acknowledged");
        // The sender learnt the path MTU from the gateway's frag-needed.
        let route = b.internet.ns.exec(&["ip", "route", "get", "198.51.100.10"]).unwrap();
        assert!(route.contains("mtu 1400"), "fast path {fast}: no frag-needed reached the sender: {route}");
        let over = big() - before;
        eprintln!("round {round}, fast path {fast}: {over} frames over 1400 bytes reached the host");
        assert_eq!(over, 0, "fast path {fast}: frames longer than eth0's MTU left the gateway");
        lbagent_tests::net::in_ns(&gw_ns, &["ip", "link", "set", "eth0", "mtu", "1500"]).unwrap();
    }
}
