//! The VPC load balancer host with real traffic: client and backends on an
//! OVS integration bridge (userspace datapath); proxy-mode listeners through
//! the agent's haproxy, direct-mode listeners through the engine alone.

use std::{collections::HashSet, net::SocketAddr};

use lbagent::{daemon::status::Status, naming};
use lbagent_tests::{
    bed::{Bed, HostLock, lb_id},
    hosts::TestHost,
    net::sh,
    ovs::OvsBridge,
    require_root,
    traffic::*,
    unique,
};

fn at(ip: &str, port: u16) -> SocketAddr {
    format!("{ip}:{port}").parse().unwrap()
}

fn tag_and_ip(answer: &str) -> (String, String) {
    let (tag, peer) = answer.split_once(' ').unwrap();
    (tag.to_string(), peer.rsplit_once(':').unwrap().0.to_string())
}

struct LbBed {
    bed: Bed,
    client: TestHost,
    backends: Vec<TestHost>,
    bridge: OvsBridge,
    ids: [String; 2],
    _lock: HostLock,
}

/// `.21`, `.22`, `.23` serve HTTP on 8080 (tags h21…) and lines on 9000;
/// `.23` also answers UDP on 5353.
fn lb_bed() -> Option<LbBed> {
    if !require_root() {
        return None;
    }
    let lock = HostLock::take().unwrap();
    let bridge = OvsBridge::new(&unique("brl")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.30.0.10", 24, "").unwrap();
    let mut backends = Vec::new();
    for last in [21, 22, 23] {
        let h = TestHost::on(|p| bridge.add_port(p), &format!("10.30.0.{last}"), 24, "").unwrap();
        http_server(&h.ns.name, 8080, &format!("h{last}")).unwrap();
        line_echo_server(&h.ns.name, 9000, &format!("h{last}")).unwrap();
        backends.push(h);
    }
    udp_echo_forever(&backends[2].ns.name, 5353).unwrap();
    Some(LbBed { bed: Bed::new().unwrap(), client, backends, bridge, ids: [lb_id(), lb_id()], _lock: lock })
}

impl LbBed {
    /// Applies a state, then sets every load balancer namespace's veths to
    /// the dataplane side of the mixed-offload setting.
    fn apply(&mut self, yaml: &str) {
        self.bed.apply(yaml);
        for id in &self.ids {
            let ns = naming::lb_netns(id);
            if lbagent::netns::exists(&ns) {
                lbagent_tests::net::dataplane_offloads_all(&ns).unwrap();
            }
        }
    }

    /// LB1 (VIP .5): http/80 (proxy) and tcp/9000 (direct) over `g1`, udp/53
    /// (direct) to `.23:5353`. LB2 (VIP .6): http/80 to `.23` only.
    fn state(&self, g1: &str, with_lb1: bool) -> String {
        self.state3(g1, G3, with_lb1)
    }

    /// Like `state`, with the direct tcp/9000 listener's backends given too.
    fn state3(&self, g1: &str, g3: &str, with_lb1: bool) -> String {
        let lb1 = format!(
            "  - id: {}
    network: {{ip: 10.30.0.5, mac: \"02:00:0a:1e:00:05\", prefix_len: 24, gateway: 10.30.0.1}}
    listeners:
      - {{id: web, type: http, port: 80, backend_group: g1}}
      - {{id: raw, type: tcp, port: 9000, backend_group: g3}}
      - {{id: dns, type: udp, port: 53, backend_group: g2}}
    backend_groups:
      - id: g1
        backends:
{g1}      - id: g2
        backends: [{{id: d1, address: 10.30.0.23, port: 5353}}]
      - id: g3
        backends:
{g3}",
            self.ids[0]
        );
        let lb2 = format!(
            "  - id: {}
    network: {{ip: 10.30.0.6, mac: \"02:00:0a:1e:00:06\", prefix_len: 24, gateway: 10.30.0.1}}
    listeners: [{{id: web, type: http, port: 80, backend_group: g}}]
    backend_groups: [{{id: g, backends: [{{id: x, address: 10.30.0.23, port: 8080}}]}}]
",
            self.ids[1]
        );
        format!(
            "version: 1\nagent: {{integration_bridge: {}}}\nload_balancers:\n{}{lb2}",
            self.bridge.name,
            if with_lb1 { lb1 } else { String::new() }
        )
    }
}

const G1: &str = "          - {id: b1, address: 10.30.0.21, port: 8080}
          - {id: b2, address: 10.30.0.22, port: 8080}
";

const G3: &str = "          - {id: r1, address: 10.30.0.21, port: 9000}
          - {id: r2, address: 10.30.0.22, port: 9000}
";

#[test]
fn load_balancer_seed_parity_and_lifecycle() {
    let Some(mut b) = lb_bed() else { return };
    b.apply(&b.state(G1, true));
    let client = b.client.ns.name.clone();

    // HTTP (proxy mode, haproxy) reaches every backend; each sees the VIP.
    let mut tags = HashSet::new();
    for _ in 0..8 {
        let (tag, ip) = tag_and_ip(&http_get(&client, at("10.30.0.5", 80)).unwrap());
        assert_eq!(ip, "10.30.0.5", "the backend sees the VIP as source");
        tags.insert(tag);
    }
    assert_eq!(tags, HashSet::from(["h21".to_string(), "h22".to_string()]));

    // UDP direct: the backend sees the VIP; the answer comes from the VIP.
    let (seen, from) = udp_ask(&client, at("10.30.0.5", 53)).unwrap();
    assert!(seen.starts_with("10.30.0.5:"), "{seen}");
    assert_eq!(from, at("10.30.0.5", 53));

    // Second load balancer, side by side and isolated.
    for _ in 0..4 {
        assert_eq!(tag_and_ip(&http_get(&client, at("10.30.0.6", 80)).unwrap()), ("h23".into(), "10.30.0.6".into()));
    }

    // Status shows what a proxy config generator needs.
    let mut st = Status::default();
    st.refresh(&b.bed.reconciler.applied, &b.bed.reconciler.alloc);
    let doc = serde_json::to_value(&st.document).unwrap();
    let lbs = doc["load_balancers"].as_array().unwrap().clone();
    let lb1 = lbs.iter().find(|l| l["id"] == b.ids[0].as_str()).unwrap();
    assert_eq!(lb1["netns"], naming::lb_netns(&b.ids[0]));
    assert!(lb1["inner"].as_str().unwrap().starts_with("169.254."));
    assert!(lb1["backends"].as_array().unwrap().iter().all(|x| x["mapped_port"].as_u64().unwrap() >= 1025));

    // Adding a backend takes effect without breaking existing flows; the
    // direct listener's open connection and the proxy path both survive.
    let conn_direct = OpenConn::open(&client, at("10.30.0.5", 9000)).unwrap();
    let first = tag_and_ip(&conn_direct.ping("1").unwrap());
    assert_eq!(first.1, "10.30.0.5");
    let g1_3 = format!("{G1}          - {{id: b3, address: 10.30.0.23, port: 8080}}\n");
    let g3_3 = format!("{G3}          - {{id: r3, address: 10.30.0.23, port: 9000}}\n");
    b.apply(&b.state3(&g1_3, &g3_3, true));
    assert_eq!(tag_and_ip(&conn_direct.ping("2").unwrap()), first, "flow kept across the change");
    let tags: HashSet<String> =
        (0..12).map(|_| tag_and_ip(&http_get(&client, at("10.30.0.5", 80)).unwrap()).0).collect();
    assert!(tags.contains("h23"), "the new backend serves: {tags:?}");

    // Removing a backend: it gets no new requests; other flows continue.
    let g1_minus = g1_3.replace("          - {id: b2, address: 10.30.0.22, port: 8080}\n", "");
    let g3_minus = g3_3.replace(
        &format!(
            "          - {{id: r{}, address: 10.30.0.{}, port: 9000}}\n",
            3 - (first.0 == "h22") as u8,
            if first.0 == "h22" { 21 } else { 22 }
        ),
        "",
    );
    b.apply(&b.state3(&g1_minus, &g3_minus, true));
    assert_eq!(tag_and_ip(&conn_direct.ping("3").unwrap()), first);
    for _ in 0..8 {
        assert_ne!(tag_and_ip(&http_get(&client, at("10.30.0.5", 80)).unwrap()).0, "h22");
    }
    drop(conn_direct);

    // Deleting LB1 leaves no trace; LB2 keeps working.
    let zone1 = b.bed.reconciler.alloc.zones[&naming::lb_zone_key(&b.ids[0])];
    b.apply(&b.state(&g1_minus, false));
    let (o0, o1) = naming::lb_ovn_veth(&b.ids[0]);
    let (_, h1) = naming::lb_host_veth(&b.ids[0]);
    assert!(!sh(&["ip", "netns", "list"]).unwrap().contains(&naming::lb_netns(&b.ids[0])));
    let links = sh(&["ip", "-br", "link"]).unwrap();
    assert!(!links.contains(&o1) && !links.contains(&h1) && !links.contains(&o0), "{links}");
    assert!(!sh(&["ovs-vsctl", "--timeout=10", "show"]).unwrap().contains(&o1));
    let t = b.bed.reconciler.realizer.engine.tables().unwrap();
    assert!(t.dnat_rules().unwrap().iter().all(|(k, _, _)| k.zone != zone1));
    assert!(t.conntrack().unwrap().iter().all(|(k, _)| k.zone != zone1));
    assert!(!b.bed.reconciler.alloc.lbs.contains_key(&b.ids[0]));
    assert!(
        !std::fs::read_to_string(b.bed.reconciler.realizer.haproxy.config_path())
            .unwrap()
            .contains(&naming::short_hash(&b.ids[0]))
    );
    assert_eq!(tag_and_ip(&http_get(&client, at("10.30.0.6", 80)).unwrap()).0, "h23");
    let _ = &b.backends;
}

/// A connection the load balancer's namespace opens itself from the VIP (as
/// a health probe does) and a client flow that would be SNAT'ed to the same
/// VIP:port → backend tuple never collide: the client flow moves (the
/// egress program tracks the namespace's own connections).
#[test]
fn own_connections_never_collide_with_client_flows() {
    let Some(mut b) = lb_bed() else { return };
    let only_r1 = "          - {id: r1, address: 10.30.0.21, port: 9000}\n";
    b.apply(&b.state3(G1, only_r1, true));
    let ns = naming::lb_netns(&b.ids[0]);
    let local = OpenConn::open_from(&ns, at("10.30.0.5", 45000), at("10.30.0.21", 9000)).unwrap();
    assert_eq!(local.ping("probe").unwrap(), "h21 10.30.0.5:45000");
    let client = OpenConn::open_from(&b.client.ns.name, at("10.30.0.10", 45000), at("10.30.0.5", 9000)).unwrap();
    let (tag, seen) =
        client.ping("client").unwrap().split_once(' ').map(|(t, p)| (t.to_string(), p.to_string())).unwrap();
    assert_eq!(tag, "h21");
    assert!(seen.starts_with("10.30.0.5:") && seen != "10.30.0.5:45000", "the client flow moved: {seen}");
    // Both keep working.
    assert_eq!(local.ping("probe again").unwrap(), "h21 10.30.0.5:45000");
    assert_eq!(client.ping("again").unwrap(), format!("h21 {seen}"));
}

/// Listener ACLs with two clients: an allow list (direct TCP, direct UDP)
/// admits only its sources, a deny list (proxy HTTP) refuses its sources;
/// refused flows are dropped before NAT and counted per listener.
#[test]
fn listener_acls_admit_and_refuse_two_clients() {
    let Some(mut b) = lb_bed() else { return };
    let second = TestHost::on(|p| b.bridge.add_port(p), "10.30.0.11", 24, "").unwrap();
    let state = b
        .state(G1, true)
        .replace(
            "{id: web, type: http, port: 80, backend_group: g1}",
            "{id: web, type: http, port: 80, backend_group: g1, acl: {action: deny, cidrs: [10.30.0.10/32]}}",
        )
        .replace(
            "{id: raw, type: tcp, port: 9000, backend_group: g3}",
            "{id: raw, type: tcp, port: 9000, backend_group: g3, acl: {action: allow, cidrs: [10.30.0.10/32]}}",
        )
        .replace(
            "{id: dns, type: udp, port: 53, backend_group: g2}",
            "{id: dns, type: udp, port: 53, backend_group: g2, acl: {action: allow, cidrs: [10.30.0.8/29]}}",
        );
    assert_eq!(state.matches("acl:").count(), 3);
    b.apply(&state);
    let (one, two) = (b.client.ns.name.clone(), second.ns.name.clone());
    // Direct TCP, allow list: .10 only.
    assert!(ask_tcp(&one, at("10.30.0.5", 9000)).is_ok());
    assert!(ask_tcp(&two, at("10.30.0.5", 9000)).is_err());
    // Proxy HTTP, deny list: everyone but .10.
    assert!(http_get(&one, at("10.30.0.5", 80)).is_err());
    assert!(http_get(&two, at("10.30.0.5", 80)).is_ok());
    // Direct UDP, allow list 10.30.0.8/29: both (.10, .11) are in it...
    assert!(udp_ask(&one, at("10.30.0.5", 53)).is_ok());
    assert!(udp_ask(&two, at("10.30.0.5", 53)).is_ok());
    // ...until it narrows to .11: .10's open flow is flushed, and refused.
    b.apply(&state.replace("cidrs: [10.30.0.8/29]", "cidrs: [10.30.0.11/32]"));
    assert!(udp_ask(&one, at("10.30.0.5", 53)).is_err());
    assert!(udp_ask(&two, at("10.30.0.5", 53)).is_ok());
    // Drops per listener.
    let t = b.bed.reconciler.realizer.engine.tables().unwrap();
    let stats: std::collections::HashMap<u32, lbagent_common::RuleStats> =
        t.rule_stats().unwrap().into_iter().collect();
    for listener in ["raw", "web", "dns"] {
        let id = b.bed.reconciler.alloc.rule_ids[format!("lb/{}/listener/{listener}", b.ids[0]).as_str()];
        assert!(stats.get(&id).is_some_and(|s| s.refused >= 1), "{listener}: {:?}", stats.get(&id));
    }
}

#[test]
fn broken_links_are_repaired() {
    let Some(mut b) = lb_bed() else { return };
    b.apply(&b.state(G1, false));
    // Someone deletes h…0 inside the namespace (its peer h…1 goes too) and
    // adds a stray link: the repair pass restores the namespace's links.
    let id = &b.ids[1].clone();
    let ns = naming::lb_netns(id);
    let (h0, _) = naming::lb_host_veth(id);
    sh(&["ip", "-n", &ns, "link", "del", &h0]).unwrap();
    sh(&["ip", "-n", &ns, "link", "add", "stray0", "type", "veth", "peer", "name", "stray1"]).unwrap();
    assert!(http_get(&b.client.ns.name, at("10.30.0.6", 80)).is_err());
    let s = lbagent::state::load_str(&b.state(G1, false), lbagent::state::Format::Yaml).unwrap();
    let report = b.bed.reconciler.apply(&lbagent::reconcile::Desired::from_state(&s).unwrap(), true);
    assert!(report.ok(), "{:?}", report.errors);
    assert!(report.changes.iter().any(|c| c.contains("removed stray link stray")), "{:?}", report.changes);
    assert_eq!(tag_and_ip(&http_get(&b.client.ns.name, at("10.30.0.6", 80)).unwrap()).0, "h23");
    // OVS: the load balancer's port taken off the bridge, then its
    // iface-id changed, each after a pass read every port at once: the
    // next pass reads them again and puts the port back.
    let desired = lbagent::reconcile::Desired::from_state(&s).unwrap();
    assert!(b.bed.reconciler.apply(&desired, true).changes.is_empty());
    let (_, o1) = naming::lb_ovn_veth(id);
    let restored = |b: &mut LbBed| {
        let report = b.bed.reconciler.apply(&desired, true);
        assert!(report.ok(), "{:?}", report.errors);
        assert!(report.changes.iter().any(|c| c.contains(&format!("{o1} on OVS bridge"))), "{:?}", report.changes);
        let id_now = sh(&["ovs-vsctl", "--timeout=10", "get", "Interface", &o1, "external_ids:iface-id"]).unwrap();
        assert_eq!(id_now.trim().trim_matches('"'), naming::lb_iface_id(id));
    };
    sh(&["ovs-vsctl", "--timeout=10", "del-port", &o1]).unwrap();
    restored(&mut b);
    sh(&["ovs-vsctl", "--timeout=10", "set", "Interface", &o1, "external_ids:iface-id=someone-else"]).unwrap();
    restored(&mut b);
    assert!(b.bed.reconciler.apply(&desired, true).changes.is_empty(), "a third pass has nothing to do");
    assert_eq!(tag_and_ip(&http_get(&b.client.ns.name, at("10.30.0.6", 80)).unwrap()).0, "h23");
}

#[test]
fn a_failed_create_is_cleaned_up_when_the_load_balancer_goes() {
    if !require_root() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    // OVS runs, and only the bridge is missing: with no ovsdb at all the
    // agent would find it unavailable and fail every OVS step in this
    // process for its back-off, also those of the tests after this one.
    lbagent_tests::ovs::ensure_running().unwrap();
    let mut bed = Bed::new().unwrap();
    let id = lb_id();
    let bridge = unique("nobr");
    let state = |with: bool| {
        let lb = format!(
            "  - id: {id}\n    network: {{ip: 10.31.0.5, mac: \"02:00:0a:1f:00:05\", prefix_len: 24, gateway: 10.31.0.1}}\n"
        );
        format!(
            "version: 1\nagent: {{integration_bridge: {bridge}}}\nload_balancers:\n{}",
            if with { lb } else { String::new() }
        )
    };
    // The bridge does not exist: plumbing fails after the namespace is made.
    let s = lbagent::state::load_str(&state(true), lbagent::state::Format::Yaml).unwrap();
    let report = bed.reconciler.apply(&lbagent::reconcile::Desired::from_state(&s).unwrap(), false);
    assert!(
        !report.errors.is_empty() && report.errors.iter().all(|e| e.error.contains(&bridge)),
        "{:?}",
        report.errors
    );
    assert!(lbagent::netns::exists(&naming::lb_netns(&id)), "partial state on the host");
    assert!(bed.reconciler.applied.partial_lbs.contains(&id));
    // Removing it from the state tears the partial object down.
    bed.apply(&state(false));
    assert!(!lbagent::netns::exists(&naming::lb_netns(&id)));
    let links = sh(&["ip", "-br", "link"]).unwrap();
    assert!(!links.contains(&naming::lb_ovn_veth(&id).1) && !links.contains(&naming::lb_host_veth(&id).1), "{links}");
    assert!(bed.reconciler.applied.partial_lbs.is_empty());
    assert!(!bed.reconciler.alloc.lbs.contains_key(&id));
}

#[test]
fn a_link_the_agent_did_not_make_is_never_deleted() {
    if !require_root() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let mut bed = Bed::new().unwrap();
    let bridge = OvsBridge::new(&unique("brf")).unwrap();
    let id = lb_id();
    let (_, o1) = naming::lb_ovn_veth(&id);
    let state = |with: bool| {
        let lb = format!(
            "  - id: {id}\n    network: {{ip: 10.32.0.5, mac: \"02:00:0a:20:00:05\", prefix_len: 24, gateway: 10.32.0.1}}\n"
        );
        format!(
            "version: 1\nagent: {{integration_bridge: {}}}\nload_balancers:\n{}",
            bridge.name,
            if with { lb } else { String::new() }
        )
    };
    let apply = |bed: &mut Bed, with: bool| {
        let s = lbagent::state::load_str(&state(with), lbagent::state::Format::Yaml).unwrap();
        bed.reconciler.apply(&lbagent::reconcile::Desired::from_state(&s).unwrap(), false)
    };
    // Someone else's link has the name the load balancer's OVN end needs.
    struct Foreign(String);
    impl Drop for Foreign {
        fn drop(&mut self) {
            let _ = sh(&["ip", "link", "del", &self.0]);
        }
    }
    let peer = unique("fp");
    sh(&["ip", "link", "add", &o1, "type", "veth", "peer", "name", &peer]).unwrap();
    let foreign = Foreign(o1.clone());
    let report = apply(&mut bed, true);
    assert!(!report.ok(), "{:?}", report.changes);
    assert!(
        report.errors.iter().any(|e| e.error.contains(&o1) && e.error.contains("refusing to delete it")),
        "{:?}",
        report.errors
    );
    assert!(sh(&["ip", "-d", "link", "show", &o1]).unwrap().contains(&peer), "the foreign link was deleted");
    // Removing the load balancer leaves the foreign link alone too.
    let report = apply(&mut bed, false);
    assert!(report.changes.iter().any(|c| c.contains(&format!("left {o1} alone"))), "{:?}", report.changes);
    assert!(sh(&["ip", "-d", "link", "show", &o1]).unwrap().contains(&peer), "the foreign link was deleted");
    // Once the name is free the agent's own links carry its alias, and go
    // with the load balancer.
    drop(foreign);
    let report = apply(&mut bed, true);
    assert!(report.ok(), "{:?}", report.errors);
    let alias = naming::link_owner_alias(&naming::lb_zone_key(&id));
    for link in [o1.clone(), naming::lb_host_veth(&id).1] {
        assert!(sh(&["ip", "link", "show", &link]).unwrap().contains(&format!("alias {alias}")), "{link}");
    }
    assert!(apply(&mut bed, false).ok());
    assert!(sh(&["ip", "link", "show", &o1]).is_err(), "the agent's own link stayed");
}

/// The running haproxy: workers unprivileged in a chroot; a section haproxy
/// refuses holds back no other load balancer; a refused whole config never
/// replaces the running one; what was loaded (not the file on disk) is
/// compared; a pid file naming another process never gets it signalled, nor hides the real master.
#[test]
fn haproxy_is_confined_isolated_and_identified() {
    use lbagent::lb::haproxy::{Rendered, config::section_of};
    let Some(mut b) = lb_bed() else { return };
    b.apply(&b.state(G1, true));
    let client = b.client.ns.name.clone();
    let hp = &b.bed.reconciler.realizer.haproxy;
    let master: i32 = std::fs::read_to_string(hp.dir.join("haproxy.pid")).unwrap().trim().parse().unwrap();

    // Workers run as an unprivileged user inside the empty chroot.
    let workers = sh(&["pgrep", "-P", &master.to_string()]).unwrap();
    let worker = workers.lines().next().expect("a worker");
    let status = std::fs::read_to_string(format!("/proc/{worker}/status")).unwrap();
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap().split_whitespace().next().unwrap();
    assert_ne!(uid, "0", "haproxy worker runs as root");
    assert_eq!(std::fs::read_link(format!("/proc/{worker}/root")).unwrap(), hp.chroot_dir());

    // The running configuration, split as the agent renders it.
    let text = std::fs::read_to_string(hp.config_path()).unwrap();
    let header = text[..text.find("# lbagent: begin").unwrap()].to_string();
    let s1 = section_of(&text, &b.ids[0]).unwrap();
    let s2 = section_of(&text, &b.ids[1]).unwrap();
    assert!(s1.contains("maxconn 4096") && s2.contains("maxconn 4096"), "per-frontend maxconn");
    let orig = Rendered {
        header: header.clone(),
        sections: vec![(b.ids[0].clone(), s1.clone()), (b.ids[1].clone(), s2.clone())],
    };

    // LB1's new section is refused; LB2's update still goes through and
    // LB1 keeps serving with its previous section.
    let bad1 = s1.replacen("  mode http\n", "  mode http\n  bind 10.30.0.5:notaport\n", 1);
    let new2 = s2.replacen(
        "  balance roundrobin\n",
        "  balance roundrobin\n  http-request return status 200 content-type text/plain string lb2-updated\n",
        1,
    );
    let mixed = Rendered { header: header.clone(), sections: vec![(b.ids[0].clone(), bad1), (b.ids[1].clone(), new2)] };
    let outcome = hp.apply(&mixed).unwrap();
    assert_eq!(outcome.action, Some("reloaded haproxy"));
    assert_eq!(outcome.faults.len(), 1, "{:?}", outcome.faults);
    assert_eq!(outcome.faults[0].0, b.ids[0]);
    assert!(outcome.faults[0].1.contains("previous proxy listeners keep running"), "{:?}", outcome.faults);
    assert!(outcome.faults[0].1.contains("notaport"), "haproxy's own message: {:?}", outcome.faults);
    assert_eq!(http_get(&client, at("10.30.0.6", 80)).unwrap(), "lb2-updated");
    assert!(["h21", "h22"].contains(&tag_and_ip(&http_get(&client, at("10.30.0.5", 80)).unwrap()).0.as_str()));

    // A configuration refused as a whole changes nothing.
    let before = std::fs::read_to_string(hp.config_path()).unwrap();
    let broken = Rendered { header: header.replacen("global\n", "global\n  no-such-keyword\n", 1), sections: vec![] };
    let err = hp.apply(&broken).unwrap_err().to_string();
    assert!(err.contains("rejected") && err.contains("no-such-keyword"), "{err}");
    assert_eq!(std::fs::read_to_string(hp.config_path()).unwrap(), before);

    // The file on disk is not what runs: writing the original back without
    // a reload does not fool the agent into skipping the reload.
    std::fs::write(hp.config_path(), orig.text()).unwrap();
    assert_eq!(hp.apply(&orig).unwrap().action, Some("reloaded haproxy"));
    assert_eq!(tag_and_ip(&http_get(&client, at("10.30.0.6", 80)).unwrap()).0, "h23");
    assert_eq!(hp.apply(&orig).unwrap().action, None, "unchanged: no reload");

    // A pid file naming another process: that one is never signalled; the
    // real master is still found among the processes, and stop ends it.
    let mut other = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    std::fs::write(hp.dir.join("haproxy.pid"), format!("{}\n", other.id())).unwrap();
    let config = hp.config_path();
    assert_eq!(lbagent_tests::agent::haproxy_masters(&config), vec![master]);
    assert!(hp.running(), "the real master is found without the pid file");
    assert!(hp.stop().unwrap());
    assert!(other.try_wait().unwrap().is_none(), "the other process was signalled");
    let _ = other.kill();
    let _ = other.wait();
    lbagent_tests::wait_for(|| lbagent_tests::agent::haproxy_masters(&config).is_empty(), "the master gone");
}

/// ovsdb frozen (SIGSTOP, as a hung or overloaded ovsdb-server): a pass
/// still updates the rules — a removed backend gets no new flows — within
/// one ovs-vsctl timeout, reports the OVS failure, and recovers after.
#[test]
fn an_ovsdb_outage_does_not_freeze_rule_updates() {
    let Some(mut b) = lb_bed() else { return };
    b.apply(&b.state3(G1, G3, true));
    let client = b.client.ns.name.clone();
    let vip = at("10.30.0.5", 9000);
    let tags =
        |n: usize| -> HashSet<String> { (0..n).map(|_| tag_and_ip(&ask_tcp(&client, vip).unwrap()).0).collect() };
    assert_eq!(tags(16), HashSet::from(["h21".to_string(), "h22".to_string()]));

    struct Frozen(i32);
    impl Drop for Frozen {
        fn drop(&mut self) {
            // SAFETY: resumes the ovsdb-server this test stopped.
            unsafe { libc::kill(self.0, libc::SIGCONT) };
        }
    }
    let pid: i32 = std::fs::read_to_string("/var/run/openvswitch/ovsdb-server.pid").unwrap().trim().parse().unwrap();
    // SAFETY: stops ovsdb-server; `Frozen` resumes it even if the test fails.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let frozen = Frozen(pid);

    let only_r1 = "          - {id: r1, address: 10.30.0.21, port: 9000}\n";
    let s = lbagent::state::load_str(&b.state3(G1, only_r1, true), lbagent::state::Format::Yaml).unwrap();
    let t = std::time::Instant::now();
    let report = b.bed.reconciler.apply(&lbagent::reconcile::Desired::from_state(&s).unwrap(), true);
    let took = t.elapsed();
    assert!(took < std::time::Duration::from_secs(15), "the pass took {took:?}");
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.kind == lbagent::outcome::ErrorKind::Ovs && e.error.contains("ovsdb unavailable")),
        "{:?}",
        report.errors
    );
    assert_eq!(tags(16), HashSet::from(["h21".to_string()]), "the removed backend still gets new flows");

    drop(frozen);
    std::thread::sleep(lbagent::plumbing::ovs::OUTAGE_BACKOFF);
    let report = b.bed.reconciler.apply(&lbagent::reconcile::Desired::from_state(&s).unwrap(), true);
    assert!(report.ok(), "{:?}", report.errors);
    assert_eq!(tags(8), HashSet::from(["h21".to_string()]));
}

/// Someone deletes the whole pin directory under the running agent: the
/// next pass re-pins the maps the running programs hold (flows and rules
/// kept, no second set of maps), re-attaches, and an established direct
/// connection carries on with its backend.
#[test]
fn a_deleted_pin_directory_is_repaired_without_splitting_maps() {
    let Some(mut b) = lb_bed() else { return };
    let state = b.state3(G1, G3, true);
    b.apply(&state);
    let client = b.client.ns.name.clone();
    let conn = OpenConn::open(&client, at("10.30.0.5", 9000)).unwrap();
    let first = tag_and_ip(&conn.ping("1").unwrap());
    let flows = b.bed.reconciler.realizer.engine.tables().unwrap().conntrack().unwrap().len();
    assert!(flows >= 2, "{flows}");

    let root = b.bed.reconciler.realizer.engine.bpffs.clone();
    let dir = lbagent::dataplane::pins::versioned_dir(&root);
    let ct_id = |p: &std::path::Path| aya::maps::MapData::from_pin(p).unwrap().info().unwrap().id();
    let ct_before = ct_id(&dir.join(lbagent_common::MAP_CT.name));
    let ids_before = lbagent::dataplane::pins::pinned_map_ids(&root).expect("every map pinned");
    sh(&["rm", "-rf", dir.to_str().unwrap()]).unwrap();

    let s = lbagent::state::load_str(&state, lbagent::state::Format::Yaml).unwrap();
    let report = b.bed.reconciler.apply(&lbagent::reconcile::Desired::from_state(&s).unwrap(), true);
    assert!(report.ok(), "{:?}", report.errors);
    assert_eq!(
        ct_id(&dir.join(lbagent_common::MAP_CT.name)),
        ct_before,
        "a new conntrack map replaced the running one"
    );
    // Every map, also those whose kernel name is cut short (the guard's
    // `proxy_guard_drops`): a new map in its place would split it.
    let ids_after = lbagent::dataplane::pins::pinned_map_ids(&root).expect("every map pinned again");
    // (`meta`, which no program uses, is written anew.)
    let split: Vec<_> = ids_before
        .iter()
        .filter(|(name, id)| **name != lbagent_common::MAP_META.name && ids_after.get(*name) != Some(id))
        .collect();
    assert!(split.is_empty(), "maps replaced instead of re-pinned: {split:?}");
    assert!(b.bed.reconciler.realizer.engine.tables().unwrap().conntrack().unwrap().len() >= flows);
    assert_eq!(tag_and_ip(&conn.ping("2").unwrap()), first, "the established flow lost its backend");
    // Rule changes reach the running programs: the removed backend gets no new flows.
    let only_r1 = "          - {id: r1, address: 10.30.0.21, port: 9000}\n";
    b.apply(&b.state3(G1, only_r1, true));
    for _ in 0..8 {
        assert_eq!(tag_and_ip(&ask_tcp(&client, at("10.30.0.5", 9000)).unwrap()).0, "h21");
    }
}
