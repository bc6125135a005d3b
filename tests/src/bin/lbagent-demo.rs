//! `cargo xtask demo`: builds the client → NAT → server topology, sends real
//! TCP, UDP and ICMP through the eBPF NAT engine, prints the decoded maps and
//! removes everything it created.

use anyhow::Result;
use lbagent::{cli::maps, dataplane::attach::AttachMode};
use lbagent_common::ALL_MAPS;
use lbagent_tests::{
    require_root,
    topology::{NatTopology, VIP},
    traffic::*,
};

fn main() -> Result<()> {
    if !require_root() {
        anyhow::bail!("the demo creates namespaces and loads eBPF: run it as root");
    }
    println!("== topology: client ns → NAT ns (lbagent eBPF at ingress) → server ns");
    let t = NatTopology::new(AttachMode::Auto)?;
    println!(
        "   client {} | nat {} (attached with {}) on {} and {} | server {}",
        t.client.name, t.nat.name, t.mode, t.ifaces[0], t.ifaces[1], t.server.name
    );
    println!(
        "   rules: VIP {VIP} tcp/80 → 10.0.2.2:8080, udp/53 → :5353, icmp → 10.0.2.2; SNAT 10.0.1.0/24 → 10.0.2.1"
    );

    println!("\n== TCP: 1 MiB echoed through {VIP}:80");
    let server = tcp_echo_server(&t.server.name, 8080, 1)?;
    let (seen, peer) = tcp_echo(&t.client.name, (VIP, 80).into(), 1 << 20)?;
    server.join().expect("server thread")?;
    println!("   server saw the client as {seen}; client's socket peer is {peer}");

    println!("\n== UDP: one question to {VIP}:53");
    let server = udp_server(&t.server.name, 5353, 1)?;
    let (seen, from) = udp_ask(&t.client.name, (VIP, 53).into())?;
    server.join().expect("server thread")?;
    println!("   server saw {seen}; the answer came from {from}");

    println!("\n== UDP to {VIP}:54 (no listener): ICMP port unreachable comes back translated");
    udp_expect_refused(&t.client.name, (VIP, 54).into())?;
    println!("   connection refused, as expected");

    println!("\n== ping {VIP}");
    print!("{}", t.client.exec(&["ping", "-c", "2", "-W", "2", &VIP.to_string()])?);

    for map in ALL_MAPS {
        let (text, _) = maps::render(&t.tables, map)?;
        println!("\n== lbagent maps {map}");
        print!("{text}");
    }
    println!("\n== same data with bpftool (typed by BTF): bpftool map dump pinned {}/v1/ct", t.pins.root.display());
    drop(t);
    println!("\n== cleaned up: namespaces, veths and pins removed");
    Ok(())
}
