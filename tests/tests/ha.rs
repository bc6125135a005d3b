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

use std::{collections::BTreeMap, time::Duration};

use lbagent_tests::{
    gateway::INTERNET_IP,
    ha_pair::{Bed, at, wait_synced},
    keepalived::{Drives, Keepalived},
    lbagent_bin,
    net::sh,
    require_root,
    traffic::*,
    wait_for,
};
use serde_json::Value;

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
    let [mut ka, mut kb] = Keepalived::agent_pair(
        vrid,
        0.1,
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
        let probe = bed.probe();
        let (ok, msg) = from.ha(&["switchover"]);
        assert!(ok, "switchover {} -> {}: {msg}", from.tag, to.tag);
        wait_for(|| k.log().matches("Entering MASTER STATE").count() >= 1, "keepalived follows the switchover");
        std::thread::sleep(Duration::from_millis(1000));
        probed(&format!("switchover {} -> {} under keepalived", from.tag, to.tag), probe);
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
