//! The HA pair with real traffic: two agents on this machine (instance
//! tags `a` and `b`: two sets of namespaces, each with its own state dir,
//! bpffs dir and API socket) run the same NAT gateway on the same OVS
//! integration bridge and external bridge, with a sync link between them
//! on loopback. Held TCP connections (SNAT out, DNAT in) and UDP flows
//! through SNAT cross a planned switchover and a hard failure of the
//! active (SIGKILL of its agent, its links set down, the standby promoted
//! as the arbiter would), and keep their external ports.
//!
//! ```text
//!  vpc 10.10.0.x ── OVS brv ─┬─ eth0 [a-natgw-<gw>] net1 ─┬─ Linux bre ── internet 198.51.100.1
//!                            └─ eth0 [b-natgw-<gw>] net1 ─┘
//!                      sync link: 127.0.0.1:<pa> ⇄ 127.0.0.1:<pb>
//! ```

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use lbagent_tests::{
    agent::{AgentDirs, AgentProcess},
    gateway::{INTERNET_IP, LAN_GW_IP},
    hosts::TestHost,
    keepalived::{Drives, Keepalived},
    lbagent_bin,
    net::sh,
    ovs::{LinuxBridge, OvsBridge},
    require_root,
    traffic::*,
    unique, wait_for,
};
use serde_json::Value;

const SECRET: &str = "4c62616765 6e742068612070616972 2074657374 206b6579";

fn at(ip: &str, port: u16) -> SocketAddr {
    format!("{ip}:{port}").parse().unwrap()
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Side {
    dirs: AgentDirs,
    tag: &'static str,
    listen: u16,
}

impl Side {
    fn new(tag: &'static str) -> Side {
        let mut dirs = AgentDirs::new(&format!("lbha{tag}"));
        dirs.instance = Some(tag.to_string());
        Side { dirs, tag, listen: free_udp_port() }
    }

    fn api(&self) -> String {
        self.dirs.path("api.sock").display().to_string()
    }

    /// `lbagent ha ARGS` on this side's agent: (ok, stdout or stderr).
    fn ha(&self, args: &[&str]) -> (bool, String) {
        let out = std::process::Command::new(lbagent_bin())
            .arg("ha")
            .args(args)
            .args(["--api-socket", &self.api()])
            .output()
            .unwrap();
        let text = if out.status.success() { out.stdout } else { out.stderr };
        (out.status.success(), String::from_utf8_lossy(&text).into_owned())
    }

    fn status(&self) -> Value {
        let (ok, text) = self.ha(&["status", "--json"]);
        assert!(ok, "ha status on {}: {text}", self.tag);
        serde_json::from_str(&text).unwrap()
    }

    fn start(&self, state: &str) -> AgentProcess {
        let file = self.dirs.path("state.yaml");
        std::fs::write(&file, state).unwrap();
        let args = ["--state", file.to_str().unwrap(), "--repair-interval", "3", "--metrics", "off"];
        self.dirs.spawn(&lbagent_bin(), &args.map(String::from), "daemon.log")
    }

    fn host_links(&self, gw: &str) -> [String; 2] {
        let (l, x) = lbagent::naming::gw_host_veths_of(self.tag, gw);
        [l, x]
    }
}

fn state(gw: &str, lan: &str, ext: &str, me: &Side, peer: &Side) -> String {
    let secret: String = SECRET.split_whitespace().collect();
    format!(
        "version: 1
agent:
  integration_bridge: {lan}
  ha: {{listen: \"127.0.0.1:{}\", peer: \"127.0.0.1:{}\", secret: \"{secret}\", bulk_every_s: 5}}
nat_gateways:
  - name: {gw}
    lan: {{ip: {LAN_GW_IP}, prefix_len: 24, mac: \"02:00:0a:0a:00:fe\", gateway: 10.10.0.1}}
    external: {{bridge: {ext}, prefix_len: 24, gateway: {INTERNET_IP}}}
    eips:
      - {{name: eip1, ip: 198.51.100.11}}
      - {{name: eip2, ip: 198.51.100.12}}
    dnats:
      - {{eip: eip2, protocol: tcp, external_port: 80, internal_ip: 10.10.0.22, internal_port: 8080}}
    snats: [{{eip: eip1, internal_cidr: 10.10.0.0/24}}]
",
        me.listen, peer.listen
    )
}

/// Every flow the test holds, and what the far end saw of each.
struct Flows {
    out: Vec<OpenConn>,
    inbound: Vec<OpenConn>,
    udp: Vec<UdpFlow>,
    /// The external address and port each UDP flow was seen from.
    udp_seen: Vec<String>,
}

impl Flows {
    /// Pings every flow once; panics naming what broke or moved.
    fn check(&self, when: &str) {
        for (i, r) in OpenConn::ping_all(&self.out, "x").into_iter().enumerate() {
            let answer = r.unwrap_or_else(|e| panic!("{when}: outbound TCP connection {i} broke: {e:#}"));
            assert!(answer.starts_with("inet 198.51.100.11:"), "{when}: outbound {i}: {answer}");
        }
        for (i, r) in OpenConn::ping_all(&self.inbound, "x").into_iter().enumerate() {
            let answer = r.unwrap_or_else(|e| panic!("{when}: inbound (DNAT) connection {i} broke: {e:#}"));
            assert!(answer.starts_with("vpc "), "{when}: inbound {i}: {answer}");
        }
        for (i, f) in self.udp.iter().enumerate() {
            let seen = f.ask("x").unwrap_or_else(|e| panic!("{when}: UDP flow {i} got no answer: {e:#}"));
            assert_eq!(seen, self.udp_seen[i], "{when}: UDP flow {i} moved to another external port");
        }
    }
}

/// A probe's report for `what`: the flow kept its external port.
fn probed(what: &str, p: UdpProbe) {
    let r = p.finish();
    eprintln!(
        "{what}: longest gap between answers {:.1} ms, {} of {} probes (every 2 ms) unanswered",
        r.longest_gap.as_secs_f64() * 1000.0,
        r.lost,
        r.sent
    );
    assert_eq!(r.seen.len(), 1, "{what}: the probe's flow kept one external address and port: {:?}", r.seen);
}

fn wait_synced(side: &Side, at_least: u64) {
    wait_for(
        || {
            let s = side.status();
            s["ready"] == true && s["synced_in"].as_u64().unwrap_or(0) >= at_least
        },
        &format!("{} ready with {at_least} flows synced in", side.tag),
    );
}

/// The two agents' world: bridges, the internet host and a VPC host with
/// their servers, the gateway's name, and both sides.
struct Bed {
    lan: OvsBridge,
    ext: LinuxBridge,
    internet: TestHost,
    vpc: TestHost,
    gw: String,
    a: Side,
    b: Side,
}

impl Bed {
    fn new() -> Bed {
        let lan = OvsBridge::new(&unique("brv")).unwrap();
        let ext = LinuxBridge::new(&unique("bre")).unwrap();
        let ext_name = ext.name.clone();
        let internet =
            TestHost::on(|p| sh(&["ip", "link", "set", p, "master", &ext_name]).map(|_| ()), INTERNET_IP, 24, "")
                .unwrap();
        let vpc = TestHost::on(|p| lan.add_port(p), "10.10.0.22", 24, LAN_GW_IP).unwrap();
        line_echo_server(&internet.ns.name, 9000, "inet").unwrap();
        udp_echo_forever(&internet.ns.name, 9001).unwrap();
        line_echo_server(&vpc.ns.name, 8080, "vpc").unwrap();
        Bed { lan, ext, internet, vpc, gw: unique("gw"), a: Side::new("a"), b: Side::new("b") }
    }

    fn state(&self, me: &Side, peer: &Side) -> String {
        state(&self.gw, &self.lan.name, &self.ext.name, me, peer)
    }

    fn start(&self, side: &Side) -> AgentProcess {
        let peer = if side.tag == "a" { &self.b } else { &self.a };
        side.start(&self.state(side, peer))
    }

    fn wait_applied(&self) {
        for side in [&self.a, &self.b] {
            wait_for(|| side.ha(&["status", "--json"]).0, &format!("{} up", side.tag));
            wait_for(
                || side.dirs.status().is_some_and(|s| s["last_apply"]["ok"] == true),
                &format!("{} applied", side.tag),
            );
        }
    }

    /// 20 outbound and 10 inbound (DNAT) TCP connections, 20 UDP flows.
    fn flows(&self) -> Flows {
        let (vns, ins) = (self.vpc.ns.name.clone(), self.internet.ns.name.clone());
        let mut flows = Flows {
            out: (0..20).map(|_| OpenConn::open(&vns, at(INTERNET_IP, 9000)).unwrap()).collect(),
            inbound: (0..10).map(|_| OpenConn::open(&ins, at("198.51.100.12", 80)).unwrap()).collect(),
            udp: (0..20).map(|_| UdpFlow::open(&vns, 0, at(INTERNET_IP, 9001)).unwrap()).collect(),
            udp_seen: Vec::new(),
        };
        flows.udp_seen = flows.udp.iter().map(|f| f.ask("hi").unwrap()).collect();
        assert!(flows.udp_seen.iter().all(|s| s.starts_with("198.51.100.11:")), "{:?}", flows.udp_seen);
        flows
    }

    fn probe(&self) -> UdpProbe {
        let p = UdpProbe::start(&self.vpc.ns.name, at(INTERNET_IP, 9001), Duration::from_millis(2)).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        p
    }

    /// A host's death: its agent killed, its gateway's links down.
    fn kill(&self, side: &Side, agent: &mut AgentProcess) {
        agent.end_with(nix::sys::signal::Signal::SIGKILL);
        for l in side.host_links(&self.gw) {
            sh(&["ip", "link", "set", &l, "down"]).unwrap();
        }
    }
}

#[test]
fn flows_keep_their_translation_through_a_switchover_and_a_hard_failure() {
    if !require_root() {
        return;
    }
    let bed = Bed::new();
    let (a, b, gw) = (&bed.a, &bed.b, &bed.gw);
    let mut agent_a = bed.start(a);
    let mut agent_b = bed.start(b);
    // New hosts start as standby: nothing announced, links down.
    bed.wait_applied();
    assert_eq!(a.status()["role"], "standby");
    assert_eq!(b.status()["role"], "standby");
    for l in b.host_links(gw) {
        let flags = sh(&["ip", "-o", "link", "show", &l]).unwrap();
        assert!(!flags.contains(",UP"), "the standby's {l} is down: {flags}");
    }
    let (ok, msg) = a.ha(&["promote"]);
    assert!(ok, "promote a: {msg}");
    // The standby refuses a switchover it cannot take; the active is ready.
    let (ok, msg) = b.ha(&["switchover"]);
    assert!(!ok && msg.contains("standby"), "{msg}");

    let vns = bed.vpc.ns.name.clone();
    let mut flows = bed.flows();
    flows.check("on a");
    wait_synced(b, 50);

    // Planned switchover, asked on the active.
    let probe = bed.probe();
    let (ok, msg) = a.ha(&["switchover"]);
    assert!(ok, "switchover: {msg}");
    std::thread::sleep(Duration::from_millis(500));
    probed("planned switchover a -> b", probe);
    assert_eq!(a.status()["role"], "standby");
    assert_eq!(b.status()["role"], "active");
    for l in a.host_links(gw) {
        let flags = sh(&["ip", "-o", "link", "show", &l]).unwrap();
        assert!(!flags.contains(",UP"), "the new standby's {l} is down: {flags}");
    }
    flows.check("after the switchover to b");

    // Flows opened on b reach a too.
    let later: Vec<UdpFlow> = (0..5).map(|_| UdpFlow::open(&vns, 0, at(INTERNET_IP, 9001)).unwrap()).collect();
    for f in later {
        flows.udp_seen.push(f.ask("hi").unwrap());
        flows.udp.push(f);
    }
    flows.out.push(OpenConn::open(&vns, at(INTERNET_IP, 9000)).unwrap());
    wait_synced(a, 1);
    let before = a.status()["synced_in"].as_u64().unwrap();
    wait_for(|| a.status()["synced_in"].as_u64().unwrap() > before + 5, "b's new flows synced to a");
    std::thread::sleep(Duration::from_millis(1500));

    // Hard failure of b: its agent killed, its links down; a promoted by
    // the arbiter (here: the test).
    let probe = bed.probe();
    bed.kill(b, &mut agent_b);
    let (ok, msg) = a.ha(&["promote"]);
    assert!(ok, "promote a: {msg}");
    std::thread::sleep(Duration::from_millis(500));
    probed("hard failure of b, a promoted at once", probe);
    flows.check("after the hard failure of b");

    // A forged datagram from the dead peer's address changes nothing.
    let refused = a.status()["dropped"]["refused"].as_u64().unwrap();
    let forged = std::net::UdpSocket::bind(("127.0.0.1", b.listen)).unwrap();
    let mut d = vec![0u8; 200];
    d[..4].copy_from_slice(b"LBHA");
    d[4] = 1;
    d[5] = 5; // a takeover
    forged.send_to(&d, ("127.0.0.1", a.listen)).unwrap();
    wait_for(|| a.status()["dropped"]["refused"].as_u64().unwrap() > refused, "the forged datagram refused");
    assert_eq!(a.status()["role"], "active");
    flows.check("after a forged datagram");

    // b comes back (its agent restarted): the role it kept is active, but
    // its links are down, so it starts as standby, gets a bulk pass, and
    // takes the role back in a switchover.
    drop(forged);
    let mut agent_b = bed.start(b);
    wait_for(|| b.ha(&["status", "--json"]).0, "b up again");
    let kept: BTreeMap<String, Value> = serde_json::from_value(b.status()).unwrap();
    assert_eq!(kept["role"], "standby", "b's links were down: it comes back as standby");
    wait_synced(b, 1);
    let probe = bed.probe();
    let (ok, msg) = a.ha(&["switchover"]);
    assert!(ok, "failback: {msg}");
    std::thread::sleep(Duration::from_millis(500));
    probed("failback a -> b", probe);
    flows.check("after the failback to b");
    assert!(agent_a.running() && agent_b.running());
    for (side, p) in [(a, &mut agent_a), (b, &mut agent_b)] {
        assert!(p.stop(), "{} stopped cleanly", side.tag);
    }
}

/// keepalived (VRRP, adverts every 100 ms) as the arbiter: its notify
/// scripts promote and demote the agents, its priority follows each
/// agent's role (`ha-priority`), so a switchover asked of the agents moves
/// the VRRP master too; a dead active (agent and keepalived killed, links
/// down) is replaced within a second, its flows kept; cutting the sync
/// link alone moves nothing.
#[test]
fn keepalived_arbitrates_and_replaces_a_dead_active() {
    if !require_root() || !lbagent_tests::keepalived::available() {
        return;
    }
    let bed = Bed::new();
    let (a, b) = (&bed.a, &bed.b);
    let mut agent_a = bed.start(a);
    let mut agent_b = bed.start(b);
    bed.wait_applied();
    let bin = lbagent_bin();
    let (api_a, api_b) = (a.dirs.path("api.sock"), b.dirs.path("api.sock"));
    let (prio_a, prio_b) = (a.dirs.path("sd/ha-priority"), b.dirs.path("sd/ha-priority"));
    let vrid = 1 + (std::process::id() % 250) as u8;
    let [mut ka, mut kb] = Keepalived::pair(
        vrid,
        [
            Drives { lbagent: &bin, api_socket: &api_a, priority_file: &prio_a },
            Drives { lbagent: &bin, api_socket: &api_b, priority_file: &prio_b },
        ],
    )
    .unwrap();
    // VRRP elects one master; its agent is promoted, the other stays standby.
    wait_for(|| (a.status()["role"] == "active") != (b.status()["role"] == "active"), "one agent active");
    let a_active = a.status()["role"] == "active";
    let (act, stb) = if a_active { (a, b) } else { (b, a) };
    wait_synced(stb, 0);
    let flows = bed.flows();
    flows.check("on the elected active");
    wait_synced(stb, 50);

    // A switchover asked of the agents moves keepalived's master too (the
    // priority files), and back.
    for (from, to, k) in [(act, stb, if a_active { &kb } else { &ka }), (stb, act, if a_active { &ka } else { &kb })] {
        let (ok, msg) = from.ha(&["switchover"]);
        assert!(ok, "switchover {} -> {}: {msg}", from.tag, to.tag);
        wait_for(|| k.log().matches("Entering MASTER STATE").count() >= 1, "keepalived follows the switchover");
        std::thread::sleep(Duration::from_millis(1000));
        assert_eq!(to.status()["role"], "active", "keepalived kept {} active", to.tag);
        assert_eq!(from.status()["role"], "standby");
        flows.check(&format!("after the switchover {} -> {}", from.tag, to.tag));
        wait_synced(from, 1);
    }

    // The sync link cut while both hosts are up: keepalived still hears
    // the active, so nothing moves.
    let block = |add: bool| {
        let port = stb.listen.to_string();
        sh(&[
            "iptables",
            if add { "-I" } else { "-D" },
            "INPUT",
            "-i",
            "lo",
            "-p",
            "udp",
            "--dport",
            &port,
            "-j",
            "DROP",
        ])
        .unwrap()
    };
    block(true);
    std::thread::sleep(Duration::from_millis(1500));
    let roles = (act.status()["role"].clone(), stb.status()["role"].clone());
    block(false);
    assert_eq!(roles, ("active".into(), "standby".into()), "a cut sync link moves no role");

    // The active dies: its agent, its keepalived, its links.
    let probe = bed.probe();
    let (agent, k) = if a_active { (&mut agent_a, &mut ka) } else { (&mut agent_b, &mut kb) };
    k.kill();
    bed.kill(act, agent);
    wait_for(|| stb.status()["role"] == "active", "keepalived promoted the standby");
    std::thread::sleep(Duration::from_millis(500));
    probed("the active died; keepalived promoted the standby", probe);
    flows.check("after the active died");
}
