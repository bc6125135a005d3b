//! Upgrading across a map-layout change with real traffic: the previous
//! release (the last build of the previous layout, built from git history
//! by `cargo xtask test`) runs a load balancer (direct and proxy) and a NAT
//! gateway (FIP, DNAT, SNAT, an EIP's and a gateway's QoS rules) with 20
//! open TCP connections, UDP flows through SNAT and the load balancer, and
//! flows through a round-robin listener; it is stopped and this build
//! started on the same pins and state dir. The netlink variant runs 48 more
//! load balancers (50 zones), each changed by the upgrade and ordered
//! before the traffic's zones: the zones switch to the new programs one by
//! one over a window of tens of seconds, and flows open all through it. No open connection may be lost,
//! no UDP flow may move to another port, no QoS bucket may lose its counts,
//! new connections must work; then the previous release must refuse to
//! start (a downgrade) and change nothing.
//!
//! ```text
//!  vpc0 .21 (FIP)  vpc1 .22 (DNAT, LB backend)  vpc2 .23 (SNAT)  vpc3 .200 (LB client)
//!        └───────────────── OVS lan ── lb 10.10.0.5 ─────────┘
//!                             └── eth0 [gateway .254] net1 ── Linux br ── internet 198.51.100.1
//! ```

use std::{
    net::SocketAddr,
    path::Path,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use lbagent::dataplane::migrate::FROM_VERSION;
use lbagent_common::LAYOUT_VERSION;
use lbagent_tests::{
    agent::{AgentDirs, AgentProcess, applied},
    bed::{HostLock, lb_id},
    hosts::TestHost,
    lbagent_bin,
    net::sh,
    ovs::{LinuxBridge, OvsBridge},
    previous_lbagent_bin, require_root,
    traffic::{OpenConn, UdpFlow, ask_tcp, line_echo_server, udp_echo_forever, udp_tag_forever},
    unique,
};
use serde_json::Value;

const LAN_GW: &str = "10.10.0.254";
const INTERNET: &str = "198.51.100.1";
/// The first LAN host number of the extra load balancers' addresses.
const EXTRA_HOST: usize = 100;

fn at(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// One agent process (either build) on the test's pins and state dir.
struct Agent(AgentProcess);

impl Agent {
    fn start(bin: &Path, env: &Env, log: &str) -> Agent {
        let a = Agent(env.spawn(bin, &env.run_args(), log));
        let t = Instant::now();
        while !a.applied(env) {
            assert!(t.elapsed() < env.patience(), "{} did not apply; its log:\n{}", bin.display(), a.0.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        a
    }

    /// The status, asked with the agent's own build.
    fn status(&self, env: &Env) -> Option<Value> {
        env.status_by(&self.0.bin)
    }

    fn applied(&self, env: &Env) -> bool {
        self.status(env).is_some_and(|s| applied(&s))
    }

    /// SIGTERM (the dataplane stays) and wait for the exit.
    fn stop(mut self) {
        assert!(self.0.stop(), "{} did not stop cleanly", self.0.bin.display());
    }
}

/// The test's directories and pins (torn down by this build on drop) and
/// the attach mode both builds use.
struct Env {
    dirs: AgentDirs,
    attach: &'static str,
    /// Zones in the state (each loads its programs in an apply).
    zones: usize,
}

impl std::ops::Deref for Env {
    type Target = AgentDirs;
    fn deref(&self) -> &AgentDirs {
        &self.dirs
    }
}

impl Env {
    fn new(attach: &'static str, zones: usize) -> Env {
        Env { dirs: AgentDirs::new("lbup"), attach, zones }
    }

    /// How long an apply over every zone may take: a minute, and two
    /// seconds per zone (a program pair's load is about one).
    fn patience(&self) -> Duration {
        Duration::from_secs(60 + 2 * self.zones as u64) * lbagent_tests::slowdown()
    }

    fn run_args(&self) -> Vec<String> {
        let state = self.path("state.yaml").display().to_string();
        ["--state", &state, "--metrics", "127.0.0.1:0", "--attach", self.attach, "--repair-interval", "3"]
            .map(String::from)
            .to_vec()
    }
}

/// Hosts, bridges and servers (declared before `Env` in the test so the
/// teardown runs first, then the hosts and bridges go).
struct Topology {
    _lock: HostLock,
    lan: OvsBridge,
    ext: LinuxBridge,
    internet: TestHost,
    vpc: Vec<TestHost>,
}

impl Topology {
    fn new() -> Topology {
        let lock = HostLock::take().unwrap();
        let lan = OvsBridge::new(&unique("bru")).unwrap();
        let ext = LinuxBridge::new(&unique("bre")).unwrap();
        let ext_name = ext.name.clone();
        let internet =
            TestHost::on(|p| sh(&["ip", "link", "set", p, "master", &ext_name]).map(|_| ()), INTERNET, 24, "").unwrap();
        let vpc: Vec<TestHost> = ["10.10.0.21", "10.10.0.22", "10.10.0.23", "10.10.0.200"]
            .iter()
            .map(|ip| TestHost::on(|p| lan.add_port(p), ip, 24, LAN_GW).unwrap())
            .collect();
        line_echo_server(&vpc[0].ns.name, 7000, "vpc0").unwrap();
        line_echo_server(&vpc[1].ns.name, 8022, "vpc1").unwrap();
        line_echo_server(&vpc[1].ns.name, 9000, "lb").unwrap();
        udp_tag_forever(&vpc[1].ns.name, 9001, "lbu").unwrap();
        // The round-robin listener's two backends.
        udp_tag_forever(&vpc[0].ns.name, 9002, "rr0").unwrap();
        udp_tag_forever(&vpc[1].ns.name, 9002, "rr1").unwrap();
        line_echo_server(&internet.ns.name, 9000, "inet").unwrap();
        udp_echo_forever(&internet.ns.name, 9001).unwrap();
        Topology { _lock: lock, lan, ext, internet, vpc }
    }

    /// The state: the traffic's load balancer `lb` and gateway `gw`, and
    /// one more load balancer per id in `extra`, each on its own address of
    /// the LAN with one listener on `extra_port` (the upgrade changes it).
    /// The proxied listener's idle timeouts are longer than the upgrade:
    /// its connections wait through it without a byte, and on a loaded
    /// machine the new agent took over 60 s (haproxy's client timeout here)
    /// to finish, so haproxy closed them as idle, as configured.
    fn state(&self, lb: &str, gw: &str, extra: &[String], extra_port: u16) -> String {
        let extra: String = extra
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let host = EXTRA_HOST + i;
                format!(
                    "  - id: {id}
    network: {{ip: 10.10.0.{host}, mac: \"02:00:0a:0a:00:{host:02x}\", prefix_len: 24, gateway: 10.10.0.1}}
    listeners: [{{id: l, type: tcp, port: {extra_port}, backend_group: g}}]
    backend_groups: [{{id: g, backends: [{{id: b, address: 10.10.0.22, port: 9000}}]}}]
"
                )
            })
            .collect();
        format!(
            "version: 1
agent: {{integration_bridge: {lan}}}
load_balancers:
  - id: {lb}
    network: {{ip: 10.10.0.5, mac: \"02:00:0a:0a:00:05\", prefix_len: 24, gateway: 10.10.0.1}}
    listeners:
      - {{id: direct, type: tcp, port: 9000, backend_group: g}}
      - {{id: proxied, type: tcp, port: 7000, backend_group: g, mode: proxy, timeouts: {{client: 600, server: 600}}}}
      - {{id: dgram, type: udp, port: 9001, backend_group: u}}
      - {{id: turns, type: udp, port: 9002, backend_group: r, scheduler: rr}}
    backend_groups:
      - {{id: g, backends: [{{id: b, address: 10.10.0.22, port: 9000}}]}}
      - {{id: u, backends: [{{id: bu, address: 10.10.0.22, port: 9001}}]}}
      - {{id: r, backends: [{{id: r0, address: 10.10.0.21, port: 9002}}, {{id: r1, address: 10.10.0.22, port: 9002}}]}}
{extra}nat_gateways:
  - name: {gw}
    lan: {{ip: {LAN_GW}, prefix_len: 24, mac: \"02:00:0a:0a:00:fe\", gateway: 10.10.0.1}}
    external: {{bridge: {ext}, prefix_len: 24, gateway: {INTERNET}}}
    qos_policy: wide
    eips:
      - {{name: eip1, ip: 198.51.100.10, qos_policy: fast}}
      - {{name: eip2, ip: 198.51.100.11}}
    fips: [{{eip: eip1, internal_ip: 10.10.0.21}}]
    dnats:
      - {{eip: eip2, protocol: tcp, external_port: 2222, internal_ip: 10.10.0.22, internal_port: 8022}}
    snats: [{{eip: eip2, internal_cidr: 10.10.0.0/25}}]
qos_policies:
  - name: fast
    binding: eip
    rules:
      - {{name: in, direction: ingress, rate_mbps: 1000, burst_mb: 0, priority: 1}}
      - {{name: out, direction: egress, rate_mbps: 1000, burst_mb: 0, priority: 1}}
  - name: wide
    binding: natgw
    shared: true
    rules:
      - {{name: lan, direction: ingress, rate_mbps: 1000, burst_mb: 0, priority: 2, match: \"src 10.10.0.0/24\"}}
",
            lan = self.lan.name,
            ext = self.ext.name,
        )
    }
}

/// A TCP path through the dataplane: (client namespace, address, the
/// answer's tag and the peer address the server must see).
struct Route {
    name: &'static str,
    from: String,
    to: SocketAddr,
    tag: &'static str,
    seen_as: &'static str,
}

fn paths(t: &Topology) -> Vec<Route> {
    let (inet, vpc) = (t.internet.ns.name.clone(), |i: usize| t.vpc[i].ns.name.clone());
    vec![
        Route { name: "lb direct", from: vpc(3), to: at("10.10.0.5:9000"), tag: "lb", seen_as: "10.10.0.5" },
        Route { name: "lb proxy", from: vpc(3), to: at("10.10.0.5:7000"), tag: "lb", seen_as: "" },
        Route { name: "fip", from: inet.clone(), to: at("198.51.100.10:7000"), tag: "vpc0", seen_as: INTERNET },
        Route { name: "dnat", from: inet, to: at("198.51.100.11:2222"), tag: "vpc1", seen_as: INTERNET },
        Route { name: "snat", from: vpc(2), to: at("198.51.100.1:9000"), tag: "inet", seen_as: "198.51.100.11" },
    ]
}

/// The backend tag of a round-robin listener's answer (`rr0 <peer>`).
fn backend(answer: &str) -> String {
    answer.split_whitespace().next().unwrap_or_default().to_string()
}

/// `<tag> <ip>:<port>` checked against the path.
fn check(p: &Route, answer: &str) {
    let (tag, peer) = answer.split_once(' ').unwrap_or_else(|| panic!("{}: odd answer {answer:?}", p.name));
    assert_eq!(tag, p.tag, "{}: answered by the wrong host: {answer}", p.name);
    if !p.seen_as.is_empty() {
        assert_eq!(peer.rsplit_once(':').unwrap().0, p.seen_as, "{}: server saw {peer}", p.name);
    }
}

/// Each bound QoS rule's bucket and passed packets, by rule key, from
/// `lbagent status --json`.
fn qos_counts(status: &Value) -> std::collections::BTreeMap<String, (u64, u64)> {
    let gws = status["nat_gateways"].as_array().cloned().unwrap_or_default();
    gws.iter()
        .flat_map(|g| g["qos"].as_array().cloned().unwrap_or_default())
        .map(|q| {
            let key = q["key"].as_str().unwrap_or_default().to_string();
            (key, (q["bucket"].as_u64().unwrap_or(0), q["stats"]["passed_packets"].as_u64().unwrap_or(0)))
        })
        .collect()
}

/// A status section without its live QoS counters (traffic moves them).
fn without_counts(v: &Value) -> Value {
    let mut v = v.clone();
    for g in v.as_array_mut().into_iter().flatten() {
        for q in g["qos"].as_array_mut().into_iter().flatten() {
            q.as_object_mut().map(|o| o.remove("stats"));
        }
    }
    v
}

/// What the prober saw while the agents were swapped.
#[derive(Default)]
struct Seen {
    udp_answers: Vec<Vec<String>>,
    udp_lost: usize,
    new_tried: usize,
    new_failed: usize,
    /// UDP flows opened through SNAT all through the swap, each from its
    /// own source port, with the translated address its first answer saw.
    opened: Vec<(UdpFlow, String)>,
    /// UDP flows opened through the round-robin listener all through the
    /// swap, with the backend that answered first.
    opened_rr: Vec<(UdpFlow, String)>,
    /// Answers to the flows above, asked again while the swap went on,
    /// that differed from their first.
    moved_during: Vec<String>,
    /// Connections the tightened ACL refuses, opened during the swap
    /// while the old programs (and the old ACL) still ran their zone.
    refused_opened: Vec<OpenConn>,
    /// The new ACL refused a connection: no more tries.
    refused_now: bool,
    /// Round-robin flows opened before the swap, with their backend.
    rr_before: Vec<(UdpFlow, String)>,
    /// The flows above to ask again, least recently asked first, each
    /// with the time it was last asked.
    queue: std::collections::VecDeque<(Opened, usize, Instant)>,
    refreshed: usize,
}

/// Which list of [`Seen`] a flow is in.
#[derive(Clone, Copy)]
enum Opened {
    Snat,
    Rr,
    RrBefore,
}

impl Seen {
    /// Keeps the flows opened so far alive: asks up to 16 of them again,
    /// the least recently asked first, if that was over 5 s ago. A window
    /// longer than the UDP timeout (30 s) would otherwise expire the early
    /// ones, and a flow that expired is rightly given a new translation.
    fn refresh(&mut self) {
        for _ in 0..16 {
            let Some(&(list, i, at)) = self.queue.front() else { return };
            if at.elapsed() < Duration::from_secs(5) {
                return;
            }
            self.queue.pop_front();
            let (f, first) = match list {
                Opened::Snat => &self.opened[i],
                Opened::Rr => &self.opened_rr[i],
                Opened::RrBefore => &self.rr_before[i],
            };
            if let Ok(a) = f.ask("again") {
                self.refreshed += 1;
                let a = if matches!(list, Opened::Snat) { a } else { backend(&a) };
                if a != *first {
                    self.moved_during.push(format!("{first} -> {a}"));
                }
            }
            self.queue.push_back((list, i, Instant::now()));
        }
    }
}

/// The same state with the direct listener's ACL tightened: the SNAT host
/// (10.10.0.23) is refused.
fn with_tightened_acl(state: &str) -> String {
    let open = "{id: direct, type: tcp, port: 9000, backend_group: g}";
    assert!(state.contains(open));
    state.replace(
        open,
        "{id: direct, type: tcp, port: 9000, backend_group: g, acl: {action: deny, cidrs: [10.10.0.23/32]}}",
    )
}

/// The upgrade with `extra` load balancers beside the traffic's two zones.
fn upgrade(attach: &'static str, extra: usize) {
    if !require_root() {
        return;
    }
    let Some(previous) = previous_lbagent_bin() else { return };
    let topo = Topology::new();
    let env = Env::new(attach, extra + 2);
    // Made first, the extra ids sort before the traffic's load balancer:
    // their changes are applied (and their zones switched) before it, and
    // the gateway, unchanged, switches last, in the repair pass.
    let extra: Vec<String> = (0..extra).map(|_| lb_id()).collect();
    let (lb, gw) = (lb_id(), unique("gwu"));
    assert!(extra.iter().all(|e| *e < lb), "extra ids sort first: {extra:?} {lb}");
    std::fs::write(env.dir.join("state.yaml"), topo.state(&lb, &gw, &extra, 9100)).unwrap();

    let old = Agent::start(&previous, &env, "previous.log");
    for ns in [lbagent::naming::gw_netns(&gw), lbagent::naming::lb_netns(&lb)] {
        lbagent_tests::net::dataplane_offloads_all(&ns).unwrap();
    }
    let paths = paths(&topo);
    // Four connections per path. Through SNAT, two hosts use the same
    // source ports, so half of those flows were given a port other than
    // their own: a mapping only the carried conntrack knows.
    let conns: Vec<(usize, OpenConn)> = (0..20)
        .map(|i| {
            let (p, r) = (i % paths.len(), &paths[i % paths.len()]);
            let conn = if r.name == "snat" {
                let host = [1, 2][(i / paths.len()) % 2];
                let from = SocketAddr::new(topo.vpc[host].ip.parse().unwrap(), 41000 + (i / paths.len() / 2) as u16);
                OpenConn::open_from(&topo.vpc[host].ns.name, from, r.to)
            } else {
                OpenConn::open(&r.from, r.to)
            };
            (p, conn.unwrap_or_else(|e| panic!("{}: {e:#}", r.name)))
        })
        .collect();
    for (p, c) in &conns {
        check(&paths[*p], &c.ping("before").unwrap());
    }
    let counted_before = qos_counts(&old.status(&env).unwrap());
    assert!(
        counted_before.len() == 3 && counted_before.values().all(|(_, passed)| *passed > 0),
        "every QoS rule counts traffic before the upgrade: {counted_before:?}"
    );
    // UDP: the same collision through SNAT, and one flow through the load balancer.
    let udp = [
        UdpFlow::open(&topo.vpc[1].ns.name, 42000, at("198.51.100.1:9001")).unwrap(),
        UdpFlow::open(&topo.vpc[2].ns.name, 42000, at("198.51.100.1:9001")).unwrap(),
        UdpFlow::open(&topo.vpc[3].ns.name, 0, at("10.10.0.5:9001")).unwrap(),
    ];
    let first: Vec<String> = udp.iter().map(|f| f.ask("before").unwrap()).collect();
    assert!(first[0].starts_with("198.51.100.11:") && first[1].starts_with("198.51.100.11:"), "{first:?}");
    assert_ne!(first[0], first[1], "two flows share a translated port");
    assert!(first[2].starts_with("lbu 10.10.0.5:"), "load-balanced UDP: {}", first[2]);
    // Round-robin flows before the swap: both backends take turns.
    let rr_before: Vec<(UdpFlow, String)> = (0..4)
        .map(|_| {
            let f = UdpFlow::open(&topo.vpc[3].ns.name, 0, at("10.10.0.5:9002")).unwrap();
            let b = backend(&f.ask("before").unwrap());
            (f, b)
        })
        .collect();
    let turns: std::collections::BTreeSet<&String> = rr_before.iter().map(|(_, b)| b).collect();
    assert_eq!(turns.len(), 2, "round robin before the upgrade: {turns:?}");
    // A client the upgraded state's ACL refuses, connected before.
    let refused = OpenConn::open(&topo.vpc[2].ns.name, at("10.10.0.5:9000")).unwrap();
    assert!(refused.ping("before").unwrap().starts_with("lb "));

    // Upgrade while a prober keeps the UDP flows busy and opens new
    // connections on every path.
    let stop = Arc::new(AtomicBool::new(false));
    let prober = {
        let stop = stop.clone();
        let targets: Vec<(String, SocketAddr)> = paths.iter().map(|p| (p.from.clone(), p.to)).collect();
        let snat_host = topo.vpc[2].ns.name.clone();
        let rr_client = topo.vpc[3].ns.name.clone();
        std::thread::spawn(move || {
            let queue = (0..rr_before.len()).map(|i| (Opened::RrBefore, i, Instant::now())).collect();
            let mut seen = Seen { udp_answers: vec![vec![]; 3], rr_before, queue, ..Default::default() };
            while !stop.load(Ordering::Relaxed) {
                // A new UDP flow through SNAT, from a source port of its own
                // (up to 900 of them, and as many round-robin flows).
                let port = 43000 + seen.opened.len() as u16;
                if seen.opened.len() < 900
                    && let Ok(f) = UdpFlow::open(&snat_host, port, at("198.51.100.1:9001"))
                    && let Ok(a) = f.ask("opened")
                {
                    seen.queue.push_back((Opened::Snat, seen.opened.len(), Instant::now()));
                    seen.opened.push((f, a));
                }
                // And one through the round-robin listener: its backend is
                // the scheduler's turn, which a lost flow would not get again.
                let port = 44000 + seen.opened_rr.len() as u16;
                if seen.opened_rr.len() < 900
                    && let Ok(f) = UdpFlow::open(&rr_client, port, at("10.10.0.5:9002"))
                    && let Ok(a) = f.ask("opened")
                {
                    seen.queue.push_back((Opened::Rr, seen.opened_rr.len(), Instant::now()));
                    seen.opened_rr.push((f, backend(&a)));
                }
                seen.refresh();
                for (i, f) in udp.iter().enumerate() {
                    match f.ask("during") {
                        Ok(a) => seen.udp_answers[i].push(a),
                        Err(_) => seen.udp_lost += 1,
                    }
                }
                // A connection from the client the new ACL refuses: the old
                // programs accept it until the zone switches (the first
                // refusal ends the tries: each would wait out a timeout).
                if !seen.refused_now {
                    match OpenConn::open(&snat_host, at("10.10.0.5:9000")) {
                        Ok(c) if c.ping("opened").is_ok() => seen.refused_opened.push(c),
                        _ => seen.refused_now = true,
                    }
                }
                let (from, to) = &targets[seen.new_tried % targets.len()];
                seen.new_tried += 1;
                if ask_tcp(from, *to).is_err() {
                    seen.new_failed += 1;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            (seen, udp)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    old.stop();
    // The new agent applies a state whose ACL refuses one client.
    std::fs::write(env.dir.join("state.yaml"), with_tightened_acl(&topo.state(&lb, &gw, &extra, 9101))).unwrap();
    let started = Instant::now();
    let new = Agent::start(&lbagent_bin(), &env, "current.log");
    let took = started.elapsed();
    // The prober runs on until the migration has finished, which is after
    // the repair pass that follows the first apply has re-ensured every
    // zone (each then runs this build's programs; the unchanged gateway is
    // the last to switch).
    let done = format!("migration from layout {FROM_VERSION} done");
    let t = Instant::now();
    while !std::fs::read_to_string(env.dir.join("current.log")).unwrap().contains(&done) {
        assert!(t.elapsed() < env.patience(), "no {done:?} within {:?}:\n{}", env.patience(), new.0.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let migrated = started.elapsed();
    std::thread::sleep(Duration::from_millis(1000));
    stop.store(true, Ordering::Relaxed);
    let (seen, udp) = prober.join().unwrap();

    // Nothing lost, nothing moved.
    let lost: Vec<&str> = conns.iter().filter(|(_, c)| c.ping("after").is_err()).map(|(p, _)| paths[*p].name).collect();
    assert!(lost.is_empty(), "connections lost across the upgrade: {lost:?}; the new agent's log:\n{}", new.0.log());
    for (p, c) in &conns {
        check(&paths[*p], &c.ping("after").unwrap());
    }
    for (i, f) in udp.iter().enumerate() {
        let after = f.ask("after").unwrap();
        let moved: Vec<&String> = seen.udp_answers[i].iter().chain([&after]).filter(|a| **a != first[i]).collect();
        assert!(moved.is_empty(), "UDP flow {i} moved from {} to {moved:?}", first[i]);
    }
    // Every UDP flow opened during the swap (by the old programs or the
    // new ones, before or after its zone switched) kept its translation.
    let moved: Vec<String> = seen
        .opened
        .iter()
        .filter_map(|(f, a)| f.ask("after").ok().filter(|b| b != a).map(|b| format!("{a} -> {b}")))
        .collect();
    assert!(seen.opened.len() >= 10, "flows opened during the swap: {}", seen.opened.len());
    assert!(seen.moved_during.is_empty(), "flows opened during the swap moved during it: {:?}", seen.moved_during);
    assert!(moved.is_empty(), "UDP flows opened during the swap moved: {moved:?}");
    // The round-robin listener's flows, opened before and during the swap,
    // each keep the backend its turn gave it; both backends had turns.
    let moved: Vec<String> = seen
        .rr_before
        .iter()
        .chain(&seen.opened_rr)
        .filter_map(|(f, b)| f.ask("after").ok().map(|a| backend(&a)).filter(|a| a != b).map(|a| format!("{b} -> {a}")))
        .collect();
    let turns: std::collections::BTreeSet<&String> = seen.opened_rr.iter().map(|(_, b)| b).collect();
    assert!(seen.opened_rr.len() >= 10 && turns.len() == 2, "round-robin flows opened during the swap: {turns:?}");
    assert!(moved.is_empty(), "round-robin flows moved to another backend: {moved:?}");
    // The tightened ACL holds: its flows were flushed and stay flushed (no
    // copy of the old tables brings them back), new ones are refused.
    assert!(refused.ping("after").is_err(), "a connection the new ACL refuses survived the upgrade");
    // And so were those opened during the swap, up to the zone's switch.
    assert!(
        seen.refused_opened.len() >= 10,
        "only {} connections the new ACL refuses opened during the swap",
        seen.refused_opened.len()
    );
    let survived = OpenConn::ping_all(&seen.refused_opened, "after").iter().filter(|r| r.is_ok()).count();
    assert_eq!(survived, 0, "of {} connections the new ACL refuses, opened during the swap", seen.refused_opened.len());
    assert!(ask_tcp(&topo.vpc[2].ns.name, at("10.10.0.5:9000")).is_err(), "the new ACL refuses new connections");
    for p in &paths {
        check(p, &ask_tcp(&p.from, p.to).unwrap_or_else(|e| panic!("new connection via {}: {e:#}", p.name)));
    }
    let log = std::fs::read_to_string(env.dir.join("current.log")).unwrap();
    // Every extra load balancer serves its changed listener.
    for (i, _) in extra.iter().enumerate() {
        let vip = SocketAddr::new(format!("10.10.0.{}", EXTRA_HOST + i).parse().unwrap(), 9101);
        let a = ask_tcp(&topo.vpc[3].ns.name, vip).unwrap_or_else(|e| panic!("extra load balancer {vip}: {e:#}"));
        assert!(a.starts_with("lb "), "{vip}: {a}");
    }
    eprintln!(
        "upgrade ({attach}, {} zones): new agent applied in {took:?}, migrated in {migrated:?}; 0 of {} open connections lost; UDP datagrams lost \
         during the swap: {}; new connections failed during the swap: {} of {}; {} UDP flows opened during the \
         swap, none moved; {} round-robin flows opened during the swap, none moved; {} asks of those flows \
         during the swap, all answered as first; {} connections the new ACL refuses opened during the swap, \
         none left open",
        env.zones,
        conns.len(),
        seen.udp_lost,
        seen.new_failed,
        seen.new_tried,
        seen.opened.len(),
        seen.opened_rr.len(),
        seen.refreshed,
        seen.refused_opened.len()
    );
    assert!(log.contains(&format!("migrating it to layout {LAYOUT_VERSION}")), "{log}");
    assert!(log.contains("conntrack tables of the running programs kept as ct_prev and ct_new_prev"), "{log}");
    assert!(log.contains("flows the previous programs opened before the switch"), "{log}");
    assert!(log.contains(&format!("migration from layout {FROM_VERSION} done")), "{log}");
    // Each QoS rule kept its bucket and its counts (they only grew).
    let counted_after = qos_counts(&new.status(&env).unwrap());
    for (rule, (bucket, passed)) in &counted_before {
        let (b, p) = counted_after.get(rule).unwrap_or_else(|| panic!("QoS rule {rule} gone: {counted_after:?}"));
        assert!(b == bucket && p >= passed, "QoS rule {rule}: bucket {bucket} passed {passed} before, {b} {p} after");
    }

    // What is left of the previous layout is the marker: its meta, nothing else.
    let marker: Vec<String> = std::fs::read_dir(env.bpffs.join(format!("v{FROM_VERSION}")))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(marker, ["meta"], "the previous layout's pins after the migration");
    // Adoption is over: the flag is down, the previous tables pinned now are
    // small and empty (the flows not adopted were copied).
    let adopt: Value = serde_json::from_str(&env.cli(&["maps", "ct_adopt", "--json"])).unwrap();
    assert_eq!(adopt["ct_adopt"]["adopting"], false, "{adopt}");
    for prev in ["ct_prev", "ct_new_prev"] {
        let rows: Value = serde_json::from_str(&env.cli(&["maps", prev, "--json"])).unwrap();
        assert_eq!(rows[prev].as_array().map(Vec::len), Some(0), "{prev}: {rows}");
        let info = aya::maps::MapData::from_pin(env.bpffs.join(format!("v{LAYOUT_VERSION}/{prev}"))).unwrap();
        assert_eq!(info.info().unwrap().max_entries(), lbagent_common::CT_PREV_IDLE_MAX, "{prev}");
    }
    // The open connections' flows are in the new tables, rules kept their ids.
    let ct: Value = serde_json::from_str(&env.cli(&["conntrack", "list", "--json", "--port", "2222"])).unwrap();
    assert!(!ct.as_array().unwrap().is_empty(), "DNAT flows in the new conntrack");

    // Downgrade: with this build stopped (its dataplane stays), the
    // previous release refuses to start, and nothing changes. (While an
    // agent runs, its lock on the state dir refuses any second agent first.)
    let before = new.status(&env).unwrap();
    new.stop();
    let out = Command::new(&previous).arg("run").args(env.run_args()).args(env.flags()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the previous release started on an upgraded dataplane: {err}");
    assert!(err.contains(&format!("layout version {LAYOUT_VERSION}")), "{err}");
    eprintln!("downgrade refused ({attach}): {}", err.trim());
    for (p, c) in &conns {
        check(&paths[*p], &c.ping("after the downgrade attempt").unwrap());
    }
    for p in &paths {
        check(p, &ask_tcp(&p.from, p.to).unwrap_or_else(|e| panic!("new connection via {}: {e:#}", p.name)));
    }
    let new = Agent::start(&lbagent_bin(), &env, "restarted.log");
    let after = new.status(&env).unwrap();
    assert_eq!(after["last_apply"]["ok"], true);
    assert_eq!(before["load_balancers"], after["load_balancers"]);
    assert_eq!(without_counts(&before["nat_gateways"]), without_counts(&after["nat_gateways"]));
    for (p, c) in &conns {
        check(&paths[*p], &c.ping("after the restart").unwrap());
    }
    drop(new);
    // Teardown removes the new pins and the marker: nothing is left.
    env.cli(&["teardown"]);
    assert!(!env.bpffs.exists(), "pins left after teardown: {:?}", std::fs::read_dir(&env.bpffs).map(|d| d.count()));
    drop(env);
}

/// tcx links (pinned) are moved into the new layout and updated in place.
#[test]
fn upgrade_from_the_previous_layout_tcx() {
    if lbagent::dataplane::attach::AttachMode::Auto.resolve() != lbagent::dataplane::attach::AttachMode::Tcx {
        eprintln!("skipped: tcx needs Linux 6.6+ (the netlink variant runs)");
        return;
    }
    upgrade("tcx", 0);
}

/// Netlink filters (Linux 5.x) are replaced in place by priority and handle,
/// at 50 zones.
#[test]
fn upgrade_from_the_previous_layout_netlink() {
    upgrade("netlink", 48);
}
