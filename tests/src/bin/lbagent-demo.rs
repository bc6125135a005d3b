//! `cargo xtask demo`: the agent end to end. Builds a small VPC (an OVS
//! integration bridge with a client, two backends and a host), an external
//! bridge with an "internet" host, runs `lbagent run` on a state file with one
//! load balancer and one NAT gateway, sends real traffic through both, shows
//! `lbagent status` and the decoded maps, then stops and tears everything down.

use std::{
    net::SocketAddr,
    process::{Child, Command},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use lbagent_tests::{
    hosts::TestHost,
    lbagent_bin,
    net::sh,
    ovs::{LinuxBridge, OvsBridge},
    require_root,
    traffic::*,
    unique,
};

fn at(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

struct Agent {
    child: Child,
    common: Vec<String>,
}

impl Agent {
    fn cli(&self, args: &[&str]) -> Result<String> {
        let out = Command::new(lbagent_bin()).args(args).args(&self.common).output()?;
        if !out.status.success() {
            bail!("lbagent {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
        match self.cli(&["teardown"]) {
            Ok(out) => print!("\n== lbagent teardown\n{out}"),
            Err(e) => eprintln!("teardown: {e:#}"),
        }
    }
}

fn main() -> Result<()> {
    if !require_root() {
        bail!("the demo creates namespaces, bridges and eBPF programs: run it as root");
    }
    println!(
        "== topology: VPC 10.50.0.0/24 on OVS bridge (userspace datapath), internet 198.51.100.0/24 on a Linux bridge"
    );
    let vpc = OvsBridge::new(&unique("brdemo"))?;
    let ext = LinuxBridge::new(&unique("brext"))?;
    let client = TestHost::on(|p| vpc.add_port(p), "10.50.0.10", 24, "10.50.0.254")?;
    let b1 = TestHost::on(|p| vpc.add_port(p), "10.50.0.21", 24, "10.50.0.254")?;
    let b2 = TestHost::on(|p| vpc.add_port(p), "10.50.0.22", 24, "10.50.0.254")?;
    let internet =
        TestHost::on(|p| sh(&["ip", "link", "set", p, "master", &ext.name]).map(|_| ()), "198.51.100.1", 24, "")?;
    for (h, tag) in [(&b1, "backend-21"), (&b2, "backend-22")] {
        http_server(&h.ns.name, 8080, tag)?;
        line_echo_server(&h.ns.name, 9000, tag)?;
    }
    line_echo_server(&internet.ns.name, 9000, "internet")?;

    let dir = std::env::temp_dir().join(unique("lbdemo"));
    std::fs::create_dir_all(&dir)?;
    let lb_id = format!("{:0>13}-demo", unique(""));
    let state = format!(
        "version: 1
agent: {{integration_bridge: {vpc}}}
load_balancers:
  - id: {lb_id}
    name: web
    network: {{ip: 10.50.0.5, mac: \"02:00:0a:32:00:05\", prefix_len: 24, gateway: 10.50.0.254}}
    listeners:
      - {{id: http, type: http, port: 80, backend_group: web}}
      - {{id: raw, type: tcp, port: 9000, backend_group: raw}}
    backend_groups:
      - id: web
        backends: [{{id: b1, address: 10.50.0.21, port: 8080}}, {{id: b2, address: 10.50.0.22, port: 8080}}]
      - id: raw
        backends: [{{id: r1, address: 10.50.0.21, port: 9000}}, {{id: r2, address: 10.50.0.22, port: 9000}}]
nat_gateways:
  - name: {gw}
    lan: {{ip: 10.50.0.254, prefix_len: 24, mac: \"02:00:0a:32:00:fe\", gateway: 10.50.0.1}}
    external: {{bridge: {ext}, prefix_len: 24, gateway: 198.51.100.1}}
    eips: [{{name: fip, ip: 198.51.100.10}}, {{name: out, ip: 198.51.100.11}}]
    fips: [{{eip: fip, internal_ip: 10.50.0.21}}]
    snats: [{{eip: out, internal_cidr: 10.50.0.0/24}}]
",
        vpc = vpc.name,
        ext = ext.name,
        gw = unique("demo"),
    );
    let state_file = dir.join("state.yaml");
    std::fs::write(&state_file, &state)?;
    println!("\n== state file {}\n{state}", state_file.display());

    let bpffs = format!("/sys/fs/bpf/{}", unique("lbdemo"));
    let common = vec![
        "--bpffs".to_string(),
        bpffs.clone(),
        "--state-dir".into(),
        dir.join("state").display().to_string(),
        "--api-socket".into(),
        dir.join("api.sock").display().to_string(),
    ];
    let child = Command::new(lbagent_bin())
        .args(["run", "--state", state_file.to_str().unwrap(), "--metrics", "127.0.0.1:0"])
        .args(&common)
        .spawn()
        .context("starting lbagent run")?;
    let agent = Agent { child, common };
    let t = Instant::now();
    while !agent.cli(&["status", "--json"]).is_ok_and(|s| s.contains("\"ok\":true") || s.contains("\"ok\": true")) {
        if t.elapsed() > Duration::from_secs(30) {
            bail!("the agent did not apply the state: {}", agent.cli(&["status"]).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("\n== lbagent status\n{}", agent.cli(&["status"])?);

    println!("== load balancer: HTTP to the VIP (haproxy) — each backend answers with the source it sees");
    for _ in 0..4 {
        println!("   {}", http_get(&client.ns.name, at("10.50.0.5:80"))?);
    }
    println!("== load balancer: TCP to the VIP, direct mode (eBPF only)");
    for _ in 0..2 {
        println!("   {}", ask_tcp(&client.ns.name, at("10.50.0.5:9000"))?);
    }
    println!("== NAT gateway: internet → floating IP 198.51.100.10 → 10.50.0.21 (sees the real client)");
    println!("   {}", ask_tcp(&internet.ns.name, at("198.51.100.10:9000"))?);
    println!("== NAT gateway: VPC host 10.50.0.22 → internet, SNAT'ed to 198.51.100.11");
    println!("   {}", ask_tcp(&b2.ns.name, at("198.51.100.1:9000"))?);
    println!("== ping the floating IP from the internet");
    print!("{}", internet.ns.exec(&["ping", "-c", "2", "-W", "2", "198.51.100.10"])?);

    for map in ["dnat_rules", "snat_rules", "ct", "counters"] {
        println!("\n== lbagent maps {map}");
        print!("{}", agent.cli(&["maps", map])?);
    }
    println!(
        "\n== the same maps with bpftool, typed by BTF: bpftool map dump pinned {}/v{}/ct",
        bpffs,
        lbagent_common::LAYOUT_VERSION
    );
    drop(agent);
    drop((client, b1, b2, internet));
    let _ = std::fs::remove_dir_all(&dir);
    println!("== cleaned up: agent stopped, dataplane torn down, namespaces and bridges removed");
    Ok(())
}
