//! An HA pair of agents on this machine, for the tests and the bench:
//! two agents (instance tags `a` and `b`: two sets of namespaces, each
//! with its own state dir, bpffs dir and API socket) run the same NAT
//! gateway on the same OVS integration bridge and external bridge, with a
//! sync link between them on loopback; a VPC host and an internet host
//! with servers; the flows a failover must keep.
//!
//! ```text
//!  vpc 10.10.0.22 ── OVS brv ─┬─ eth0 [a-natgw-<gw>] net1 ─┬─ Linux bre ── internet 198.51.100.1
//!                             └─ eth0 [b-natgw-<gw>] net1 ─┘
//!                      sync link: 127.0.0.1:<pa> ⇄ 127.0.0.1:<pb>
//! ```

use std::{net::SocketAddr, time::Duration};

use serde_json::Value;

use crate::{
    agent::{AgentDirs, AgentProcess},
    gateway::{INTERNET_IP, LAN_GW_IP},
    hosts::TestHost,
    lbagent_bin,
    net::sh,
    ovs::{LinuxBridge, OvsBridge},
    traffic::*,
    unique, wait_for,
};

pub const SECRET: &str = "4c62616765 6e742068612070616972 2074657374 206b6579";

pub fn at(ip: &str, port: u16) -> SocketAddr {
    format!("{ip}:{port}").parse().unwrap()
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub struct Side {
    pub dirs: AgentDirs,
    pub tag: &'static str,
    pub listen: u16,
}

impl Side {
    pub fn new(tag: &'static str) -> Side {
        let mut dirs = AgentDirs::new(&format!("lbha{tag}"));
        dirs.instance = Some(tag.to_string());
        Side { dirs, tag, listen: free_udp_port() }
    }

    pub fn api(&self) -> String {
        self.dirs.path("api.sock").display().to_string()
    }

    /// `lbagent ha ARGS` on this side's agent: (ok, stdout or stderr).
    pub fn ha(&self, args: &[&str]) -> (bool, String) {
        let out = std::process::Command::new(lbagent_bin())
            .arg("ha")
            .args(args)
            .args(["--api-socket", &self.api()])
            .output()
            .unwrap();
        let text = if out.status.success() { out.stdout } else { out.stderr };
        (out.status.success(), String::from_utf8_lossy(&text).into_owned())
    }

    pub fn status(&self) -> Value {
        let (ok, text) = self.ha(&["status", "--json"]);
        assert!(ok, "ha status on {}: {text}", self.tag);
        serde_json::from_str(&text).unwrap()
    }

    pub fn start(&self, bin: &std::path::Path, state: &str) -> AgentProcess {
        let file = self.dirs.path("state.yaml");
        std::fs::write(&file, state).unwrap();
        let args = ["--state", file.to_str().unwrap(), "--repair-interval", "3", "--metrics", "off"];
        self.dirs.spawn(bin, &args.map(String::from), "daemon.log")
    }

    pub fn host_links(&self, gw: &str) -> [String; 2] {
        let (l, x) = lbagent::naming::gw_host_veths_of(self.tag, gw);
        [l, x]
    }
}

pub fn state(gw: &str, lan: &str, ext: &str, me: &Side, peer: &Side) -> String {
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
pub struct Flows {
    pub out: Vec<OpenConn>,
    pub inbound: Vec<OpenConn>,
    pub udp: Vec<UdpFlow>,
    /// The external address and port each UDP flow was seen from.
    pub udp_seen: Vec<String>,
}

impl Flows {
    /// Pings every flow once; panics naming what broke or moved.
    pub fn check(&self, when: &str) {
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

/// The two agents' world: bridges, the internet host and a VPC host with
/// their servers, the gateway's name, and both sides.
pub struct Bed {
    pub lan: OvsBridge,
    pub ext: LinuxBridge,
    pub internet: TestHost,
    pub vpc: TestHost,
    pub gw: String,
    pub a: Side,
    pub b: Side,
    /// The agents' binary (the bench runs the release build).
    pub bin: std::path::PathBuf,
}

impl Default for Bed {
    fn default() -> Bed {
        Bed::with_bin(lbagent_bin())
    }
}

impl Bed {
    /// The bed with this build's agent.
    pub fn new() -> Bed {
        Bed::default()
    }

    pub fn with_bin(bin: std::path::PathBuf) -> Bed {
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
        Bed { lan, ext, internet, vpc, gw: unique("gw"), a: Side::new("a"), b: Side::new("b"), bin }
    }

    pub fn state(&self, me: &Side, peer: &Side) -> String {
        state(&self.gw, &self.lan.name, &self.ext.name, me, peer)
    }

    pub fn start(&self, side: &Side) -> AgentProcess {
        let peer = if side.tag == "a" { &self.b } else { &self.a };
        side.start(&self.bin, &self.state(side, peer))
    }

    pub fn wait_applied(&self) {
        for side in [&self.a, &self.b] {
            wait_for(|| side.ha(&["status", "--json"]).0, &format!("{} up", side.tag));
            wait_for(
                || side.dirs.status().is_some_and(|s| s["last_apply"]["ok"] == true),
                &format!("{} applied", side.tag),
            );
        }
    }

    /// 20 outbound and 10 inbound (DNAT) TCP connections, 20 UDP flows.
    pub fn flows(&self) -> Flows {
        self.flows_of(20, 10, 20)
    }

    /// `out` outbound and `inbound` inbound (DNAT) TCP connections, `udp`
    /// UDP flows through SNAT.
    pub fn flows_of(&self, out: usize, inbound: usize, udp: usize) -> Flows {
        let (vns, ins) = (self.vpc.ns.name.clone(), self.internet.ns.name.clone());
        let mut flows = Flows {
            out: (0..out).map(|_| OpenConn::open(&vns, at(INTERNET_IP, 9000)).unwrap()).collect(),
            inbound: (0..inbound).map(|_| OpenConn::open(&ins, at("198.51.100.12", 80)).unwrap()).collect(),
            udp: (0..udp).map(|_| UdpFlow::open(&vns, 0, at(INTERNET_IP, 9001)).unwrap()).collect(),
            udp_seen: Vec::new(),
        };
        flows.udp_seen = flows.udp.iter().map(|f| f.ask("hi").unwrap()).collect();
        assert!(flows.udp_seen.iter().all(|s| s.starts_with("198.51.100.11:")), "{:?}", flows.udp_seen);
        flows
    }

    pub fn probe(&self) -> UdpProbe {
        let p = UdpProbe::start(&self.vpc.ns.name, at(INTERNET_IP, 9001), Duration::from_millis(2)).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        p
    }

    /// A host's death: its agent killed, its gateway's links down.
    pub fn kill(&self, side: &Side, agent: &mut AgentProcess) {
        agent.end_with(nix::sys::signal::Signal::SIGKILL);
        for l in side.host_links(&self.gw) {
            sh(&["ip", "link", "set", &l, "down"]).unwrap();
        }
    }
}

/// Waits until `side` is ready with at least `at_least` flows written from its peer.
pub fn wait_synced(side: &Side, at_least: u64) {
    wait_for(
        || {
            let s = side.status();
            s["ready"] == true && s["synced_in"].as_u64().unwrap_or(0) >= at_least
        },
        &format!("{} ready with {at_least} flows synced in", side.tag),
    );
}
