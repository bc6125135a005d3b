//! `cargo xtask bench`: measurements side by side in one run. Results are printed as Markdown and written to
//! `target/bench/results.md`.
//!
//! 1. Per-packet program cost (BPF_PROG_TEST_RUN, the kernel's own timer)
//!    for an established flow and for a packet that misses every rule, with
//!    N = 10 … 100 000 DNAT rules in the map.
//! 2. New TCP connections per second through the NAT namespace: the eBPF
//!    engine vs the reference dataplanes' iptables DNAT/SNAT (iptables-legacy, the matching
//!    rule after N-1 others) vs plain routing without NAT; interleaved,
//!    repeated, medians.
//! 3. Time to install N rules, and to change one rule among N.
//! 4. TCP throughput (TSO on and off), small-packet UDP rate (iperf3) and new
//!    connections/s: fast path, slow path, iptables, plain routing; the
//!    engine as a NAT gateway and as a direct-mode LB listener, both
//!    programs attached as the agent attaches them. Five rounds; the ratios
//!    to plain routing are medians of each round's own ratio.
//! 5. Disruption: connections lost across agent restarts and a config change.
//! 6. New UDP flows/s to one resolver through one SNAT address (a busy EIP):
//!    eBPF vs iptables (random-fully) vs plain routing, with a short UDP
//!    timeout so the port range turns over within the run.
//! 7. Scale: a repair pass over 500 zones × 25 rules (maps read once per pass,
//!    against reading them per zone as before), and conntrack GC over a full
//!    table.
//!
//! 8. QoS fidelity: achieved ÷ configured rate for the eBPF limiter and
//!    kube-ovn's tc HTB scheme at 10 and 100 Mbit/s, and the per-packet cost
//!    of a matching rule (`qos.rs`).
//!
//! 9. Direct-mode schedulers (`sched.rs`); 10. fleet mode on etcd (`fleet.rs`);
//! 11. XDP against the TC fast path (`xdp.rs`); 13. CPU per packet at equal
//!     offered load (`load.rs`); 14. an established flow's cost with its
//!     conntrack entries cold (50 000 flows, each timed once per sweep);
//!     15. a restart over 10, 100 and 500 load balancers (`restart.rs`).
//!     16. the new-flow table's LRU, common or per CPU, under a flood (`lru.rs`);
//!     17. up to a million flows: memory per flow, GC and listings, beside
//!     Linux conntrack filled with the same mix; 18. the agent at 100 000
//!     rules and a million flows: RSS, scrapes, a change during a GC pass
//!     (`flows.rs`). 20. flow logs: a new flow's cost with logging on and
//!     off, and the new flows/s logged without loss beside iptables with
//!     ulogd2 (`flow_log.rs`). 21. HA pairs: failovers with held flows and
//!     the sync's capacity and lag, beside iptables + conntrackd +
//!     keepalived (`ha.rs`).
//!
//! `LBAGENT_BENCH_QUICK=1` runs a smaller set (N up to 10 000, one repeat);
//! `LBAGENT_BENCH_SECTIONS=cost,connections,apply,throughput,disruption,udp,scale,qos,qos-cost,sched,fleet,xdp,load,cold,restart,lru,flows,full-table,agent-scale,flow-log,ha`
//! picks sections; `profile` (only when named) records where the time of a
//! TCP stream without TSO, 64-byte UDP and new connections goes (`profile.rs`).

mod fleet;
mod flow_log;
mod flows;
mod full_table;
mod ha;
mod load;
mod lru;
mod profile;
mod qos;
mod restart;
mod sched;
mod xdp;

use std::{
    fmt::Write as _,
    io::Write as _,
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use lbagent::dataplane::{
    attach::AttachMode,
    loader::CtSizes,
    tables::{DnatSpec, SnatSpec, Tables},
};
use lbagent_common::{PROTO_TCP, PROTO_UDP};
use lbagent_tests::{
    agent::{AgentDirs, AgentProcess},
    engine::TestZone,
    packet::{Ip, L4, frame},
    require_root,
    topology::{NatTopology, SERVER, SNAT, VIP, ZONE, spawn_in},
};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// N DNAT rules on other addresses than the VIP (never matched).
fn filler(zone: u16, n: usize) -> impl Iterator<Item = DnatSpec> {
    (0..n).map(move |i| DnatSpec {
        zone,
        addr: Ipv4Addr::new(203, 0, (i >> 8) as u8 % 128, i as u8),
        proto: PROTO_TCP,
        port: 1000 + (i / 32768) as u16,
        rule_id: 1000 + i as u32,
        backends: vec![(Ipv4Addr::new(10, 9, 0, 1), 80)],
        snat: None,
        acl: None,
        sched: None,
    })
}

fn program_cost(counts: &[usize], reps: usize, out: &mut String) -> Result<()> {
    writeln!(out, "\n## 1. Per-packet program cost (BPF_PROG_TEST_RUN, ns/packet, median of {reps})\n")?;
    writeln!(out, "| DNAT rules | established flow | unanswered flow | unmatched packet |\n|---:|---:|---:|---:|")?;
    for &n in counts {
        let mut e = timed_engine(n)?;
        // Repeated runs rewrite their own packet: each flow is a pair of
        // flows translating into each other (`TestZone::looped_flow`), so
        // every run is a conntrack hit; the unmatched packet is left as is.
        let flow = e.looped_flow(ZONE, Ipv4Addr::new(10, 0, 1, 2), VIP, SERVER, 1, true)?;
        let oneway = e.looped_flow(ZONE, Ipv4Addr::new(10, 0, 1, 3), VIP, SERVER, 1, false)?;
        let miss = frame(
            &Ip::new([10, 0, 1, 2], VIP.octets()),
            &L4::Udp { sport: 4000, dport: 54, payload: vec![0; 64], zero_csum: false },
        );
        let hit: Vec<f64> = (0..reps).map(|_| e.time(&flow, 200_000)).collect::<Result<_>>()?;
        let new: Vec<f64> = (0..reps).map(|_| e.time(&oneway, 200_000)).collect::<Result<_>>()?;
        let miss: Vec<f64> = (0..reps).map(|_| e.time(&miss, 200_000)).collect::<Result<_>>()?;
        writeln!(out, "| {n} | {:.1} | {:.1} | {:.1} |", median(hit), median(new), median(miss))?;
        eprint!(".");
    }
    Ok(())
}

/// The program of one zone with `n` DNAT rules as the agent runs it: the
/// fast path on and the next hops resolved (so the FIB lookup answers in
/// full).
fn timed_engine(n: usize) -> Result<TestZone> {
    let e = TestZone::new(ZONE)?;
    for spec in filler(ZONE, n) {
        e.tables.set_dnat(&spec)?;
    }
    for (ip, mac) in [("10.0.2.2", "02:00:00:00:00:22"), ("10.0.2.254", "02:00:00:00:00:fe")] {
        lbagent_tests::net::sh(&["ip", "neigh", "replace", ip, "lladdr", mac, "dev", "v1", "nud", "permanent"])?;
    }
    e.tables
        .set_config(lbagent_common::NatConfig { flags: lbagent_common::NAT_CFG_FAST_PATH, ..Default::default() })?;
    e.sync_egress_mtu(ZONE)?;
    Ok(e)
}

/// Established flows in the conntrack table for [`cold_cost`].
const COLD_FLOWS: u16 = 50_000;

/// An established flow's packet when its entries are not in the CPU's
/// caches, as on a busy gateway where the rest of the stack runs between
/// two packets of a flow: [`COLD_FLOWS`] established flows, each timed
/// once per sweep (`repeat` 1, so every run starts from the original
/// packet), against one flow timed 200 000 times in a row (hot).
fn cold_cost(reps: usize, out: &mut String) -> Result<()> {
    let mut e = timed_engine(10)?;
    let hot = e.looped_flow(ZONE, Ipv4Addr::new(10, 0, 1, 2), VIP, SERVER, 1, true)?;
    let udp = |sport, dport| L4::Udp { sport, dport, payload: vec![0; 64], zero_csum: false };
    let client = [10, 0, 1, 9];
    let first = |port: u16| frame(&Ip::new(client, VIP.octets()), &udp(port, 53));
    let answer = |port: u16| frame(&Ip::new(SERVER.octets(), client), &udp(5353, port));
    // Answered, then seen again 2 s later: established, in `ct`. In
    // batches, so that `ct_new` (a quarter of `ct`) never evicts one.
    let ports: Vec<u16> = (1..=COLD_FLOWS).collect();
    for batch in ports.chunks(10_000) {
        for &p in batch {
            e.run(&first(p))?;
            e.run(&answer(p))?;
        }
        std::thread::sleep(Duration::from_millis(2100));
        for &p in batch {
            e.run(&first(p))?;
        }
    }
    let frames: Vec<Vec<u8>> = ports.iter().map(|&p| first(p)).collect();
    let promoted = e.tables.counter(lbagent_common::Counter::ConntrackPromoted)?;
    if promoted < u64::from(COLD_FLOWS) {
        bail!("only {promoted} of {COLD_FLOWS} flows were established");
    }
    let (mut hots, mut hot_ones, mut colds) = (vec![], vec![], vec![]);
    for _ in 0..reps {
        hots.push(e.time(&hot, 200_000)?);
        // The same flow timed one run per call, as the cold sweep is: what
        // timing a single run adds.
        let mut sum = 0.0;
        for _ in &frames {
            sum += e.time(&frames[0], 1)?;
        }
        hot_ones.push(sum / frames.len() as f64);
        let mut sum = 0.0;
        for f in &frames {
            sum += e.time(f, 1)?;
        }
        colds.push(sum / frames.len() as f64);
    }
    writeln!(
        out,
        "\n## 14. An established flow with its conntrack entries in the CPU's caches and without (BPF_PROG_TEST_RUN, ns/packet, {COLD_FLOWS} established flows, 10 rules, median of {reps})\n"
    )?;
    writeln!(out, "| established flow | ns |\n|---|---:|")?;
    writeln!(
        out,
        "| hot (200 000 runs in one call) | {:.1} |\n| hot, one run per call | {:.1} |\n| cold, one run per call | {:.1} |",
        median(hots),
        median(hot_ones),
        median(colds)
    )?;
    eprint!(".");
    Ok(())
}

/// Sequential connect/close (RST) from the client for `dur`. Returns
/// (connections/s, stalls): a connect slower than 500 ms is a SYN
/// retransmit stall (seen on every path, including plain routing); its time
/// is left out of the rate and the stall is counted instead.
fn conn_rate(client_ns: &str, to: SocketAddr, dur: Duration) -> Result<(f64, u32)> {
    spawn_in(client_ns, move || {
        let start = Instant::now();
        let (mut n, mut stalls, mut stalled) = (0u64, 0u32, Duration::ZERO);
        while start.elapsed() < dur {
            let t = Instant::now();
            let s =
                TcpStream::connect_timeout(&to, Duration::from_secs(3)).with_context(|| format!("connection {n}"))?;
            let took = t.elapsed();
            if took > Duration::from_millis(500) {
                stalls += 1;
                stalled += took;
            }
            set_linger_zero(&s); // RST: no TIME_WAIT anywhere
            drop(s);
            n += 1;
        }
        Ok((n as f64 / (start.elapsed() - stalled).as_secs_f64(), stalls))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client panicked"))?
}

fn set_linger_zero(s: &TcpStream) {
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    let _ = nix::sys::socket::setsockopt(s, nix::sys::socket::sockopt::Linger, &l);
}

fn accept_forever(server_ns: &str) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    spawn_in(server_ns, move || {
        let l = TcpListener::bind(("0.0.0.0", 8080))?;
        tx.send(()).ok();
        // Wait for each client's RST: a server that closes first keeps
        // TIME_WAIT sockets that stall reused client ports.
        for mut s in l.incoming().flatten() {
            let _ = std::io::Read::read(&mut s, &mut [0u8; 16]);
        }
        Ok(())
    });
    rx.recv_timeout(Duration::from_secs(5)).context("server did not start")?;
    Ok(())
}

/// Replaces the topology's SNAT (10 000 ports) with one range as wide as
/// the iptables baseline's (`SNAT --to-source SNAT:1024-65535`), so the
/// connection rates compare paths, not pools: every connection the bench
/// closes (by RST) holds its port for the closing timeout. SNAT is keyed
/// on the egress interface (toward the server).
fn wide_snat(t: &NatTopology) -> Result<()> {
    let n1 = lbagent::netns::run_in(Some(&t.nat.name), || lbagent::netns::ifindex(&t.ifaces[1]))?;
    t.tables.set_snat(&SnatSpec {
        zone: ZONE,
        ifindex: n1,
        cidr: (Ipv4Addr::new(10, 0, 1, 0), 24),
        to: SNAT,
        ports: (1024, 65535),
        random: true,
        port_class: true,
        rule_id: 10,
    })
}

/// The reference dataplanes' iptables: DNAT for the VIP after `n - 1` non-matching rules, SNAT out.
fn iptables_rules(n1: &str, n: usize) -> String {
    let mut r = String::from(
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n",
    );
    for spec in filler(ZONE, n.saturating_sub(1)) {
        let _ = writeln!(
            r,
            "-A PREROUTING -d {}/32 -p tcp --dport {} -j DNAT --to-destination 10.9.0.1:80",
            spec.addr, spec.port
        );
    }
    let _ = writeln!(r, "-A PREROUTING -d {VIP}/32 -p tcp --dport 80 -j DNAT --to-destination {SERVER}:8080");
    let _ = writeln!(r, "-A POSTROUTING -o {n1} -p tcp -j SNAT --to-source {SNAT}:1024-65535\nCOMMIT");
    r
}

fn conn_rates(counts: &[usize], reps: usize, dur: Duration, out: &mut String) -> Result<()> {
    writeln!(
        out,
        "\n## 2. New TCP connections per second through the NAT namespace (median of {reps}, {} ms each)\n",
        dur.as_millis()
    )?;
    writeln!(
        out,
        "| rules | eBPF engine | iptables (reference rules) | plain routing, no NAT | eBPF / iptables | stalls (eBPF/iptables/plain) |\n|---:|---:|---:|---:|---:|:---:|"
    )?;
    for &n in counts {
        let ebpf = NatTopology::new(AttachMode::Auto)?;
        for spec in filler(ZONE, n.saturating_sub(1)) {
            ebpf.tables.set_dnat(&spec)?;
        }
        wide_snat(&ebpf)?;
        let ipt = NatTopology::plain()?;
        iptables_restore(&ipt.nat.name, &iptables_rules(&ipt.ifaces[1], n))?;
        let route = NatTopology::plain()?;
        for t in [&ebpf, &ipt, &route] {
            accept_forever(&t.server.name)?;
        }
        let (mut e, mut i, mut r) = (vec![], vec![], vec![]);
        let mut stalls = [0u32; 3];
        for _ in 0..reps {
            for (k, (t, to, v)) in
                [(&ebpf, (VIP, 80), &mut e), (&ipt, (VIP, 80), &mut i), (&route, (SERVER, 8080), &mut r)]
                    .into_iter()
                    .enumerate()
            {
                let (rate, st) = conn_rate(&t.client.name, to.into(), dur)?;
                v.push(rate);
                stalls[k] += st;
            }
        }
        let (e, i, r) = (median(e), median(i), median(r));
        writeln!(out, "| {n} | {e:.0} | {i:.0} | {r:.0} | {:.2} | {}/{}/{} |", e / i, stalls[0], stalls[1], stalls[2])?;
        eprint!(".");
    }
    Ok(())
}

/// One iperf3 run from `ns` to `to`; returns the parsed JSON.
fn iperf(ns: &str, to: Ipv4Addr, extra: &[&str]) -> Result<serde_json::Value> {
    let out = lbagent_tests::net::in_ns(
        ns,
        &[&["iperf3", "-c", &to.to_string(), "-p", "5201", "-t", "2", "-J"][..], extra].concat(),
    )?;
    Ok(serde_json::from_str(&out)?)
}

/// TCP/UDP iperf3 rules (port 5201) for the VIP, as the throughput paths
/// need them, after 8 non-matching rules, with the iptables baseline's SNAT
/// range; the fast path on or off.
fn throughput_engine(fast: bool) -> Result<NatTopology> {
    let t = NatTopology::new(AttachMode::Auto)?;
    for (i, proto) in [PROTO_TCP, PROTO_UDP].into_iter().enumerate() {
        t.tables.set_dnat(&DnatSpec {
            zone: ZONE,
            addr: VIP,
            proto,
            port: 5201,
            rule_id: 50 + i as u32,
            backends: vec![(SERVER, 5201)],
            snat: None,
            acl: None,
            sched: None,
        })?;
    }
    for spec in filler(ZONE, 8) {
        t.tables.set_dnat(&spec)?;
    }
    wide_snat(&t)?;
    let flags = if fast { lbagent_common::NAT_CFG_FAST_PATH } else { 0 };
    t.tables.set_config(lbagent_common::NatConfig { flags, ..Default::default() })?;
    Ok(t)
}

/// The same namespaces programmed as a direct-mode load balancer listener
/// (as `lb::rules` writes one): the VIP's ports (5201 TCP/UDP for iperf3,
/// 80 for new connections) DNAT to the backend picked from a consistent
/// scheduler table (`lb::sched`, five backends of which only the server is
/// up), with the rule's SNAT to the namespace's address on the backend side;
/// the fast path on or off.
fn lb_engine(fast: bool) -> Result<NatTopology> {
    use lbagent::{
        dataplane::tables::{RuleSnat, SchedKind, SchedSpec},
        lb::sched::{Member, consistent},
    };
    let t = throughput_engine(fast)?;
    let n1 = lbagent::netns::run_in(Some(&t.nat.name), || lbagent::netns::ifindex(&t.ifaces[1]))?;
    let ids = ["b0", "b1", "b2", "b3", "b4"];
    for (i, (proto, port, to)) in
        [(PROTO_TCP, 5201, 5201), (PROTO_UDP, 5201, 5201), (PROTO_TCP, 80, 8080)].into_iter().enumerate()
    {
        // Only the first backend is up (weight 0: down, as a failed health
        // check leaves it), so every flow reaches the server.
        let members: Vec<Member> = ids
            .iter()
            .enumerate()
            .map(|(k, id)| Member { id, target: (Ipv4Addr::new(10, 0, 2, 2 + k as u8), to), weight: u32::from(k == 0) })
            .collect();
        t.tables.set_dnat(&DnatSpec {
            zone: ZONE,
            addr: VIP,
            proto,
            port,
            rule_id: 60 + i as u32,
            backends: vec![(SERVER, to)],
            snat: Some(RuleSnat { ifindex: n1, to: Some(SNAT), random: false }),
            acl: None,
            sched: Some(SchedSpec {
                kind: SchedKind::Tuple,
                table: std::sync::Arc::new(consistent(&members)),
                weights: vec![],
            }),
        })?;
    }
    Ok(t)
}

/// One path of a throughput table: its name, topology, and the address the
/// client sends to (the VIP through a NAT, the server when routed).
type Path<'a> = (&'a str, &'a NatTopology, Ipv4Addr);

/// A `TcpExt` counter of namespace `ns` (`/proc/net/netstat`).
pub fn tcp_ext(ns: &str, key: &str) -> Result<u64> {
    let t = lbagent_tests::net::in_ns(ns, &["cat", "/proc/net/netstat"])?;
    let lines: Vec<&str> = t.lines().collect();
    for pair in lines.chunks(2) {
        if let [names, values] = pair
            && names.starts_with("TcpExt:")
            && let Some(i) = names.split_whitespace().position(|k| k == key)
        {
            return values.split_whitespace().nth(i).context(key.to_string())?.parse().context(key.to_string());
        }
    }
    anyhow::bail!("no TcpExt {key} in {ns}")
}

/// `reps` rounds (paths interleaved within a round) of, per path: TCP
/// Gbit/s with TSO on and off at the client, UDP 64-byte kpps received,
/// new TCP connections/s (port 80 through a NAT, 8080 when routed), the
/// TCP sender's retransmissions in the TSO-on run, and how many of those
/// were losses: a retransmitted segment the receiver reports back as a
/// duplicate (DSACK) had arrived, late (reordering), not been lost.
fn measure_paths(paths: &[Path], reps: usize) -> Result<Rounds> {
    let _servers: Vec<lbagent_tests::rate::IperfServer> = paths
        .iter()
        .map(|(_, t, _)| lbagent_tests::rate::IperfServer::start(&t.server.name, 5201))
        .collect::<Result<_>>()?;
    for (_, t, _) in paths {
        accept_forever(&t.server.name)?;
    }
    let mut rows = vec![[vec![], vec![], vec![], vec![], vec![], vec![]]; paths.len()];
    for _ in 0..reps {
        for (k, (_, t, to)) in paths.iter().enumerate() {
            let c0 = t.client_if.clone();
            let bps = |v: &serde_json::Value| v["end"]["sum_received"]["bits_per_second"].as_f64().unwrap_or(0.0) / 1e9;
            let _ = t.client.exec(&["ethtool", "-K", &c0, "tso", "on", "gso", "on"]);
            let dsack = || tcp_ext(&t.client.name, "TCPDSACKRecvSegs");
            let before = dsack()?;
            let on = iperf(&t.client.name, *to, &[])?;
            let spurious = dsack()?.saturating_sub(before) as f64;
            rows[k][0].push(bps(&on));
            let retrans = on["end"]["sum_sent"]["retransmits"].as_f64().unwrap_or(0.0);
            rows[k][4].push(retrans);
            rows[k][5].push((retrans - spurious).max(0.0));
            let _ = t.client.exec(&["ethtool", "-K", &c0, "tso", "off", "gso", "off"]);
            rows[k][1].push(bps(&iperf(&t.client.name, *to, &[])?));
            let _ = t.client.exec(&["ethtool", "-K", &c0, "tso", "on", "gso", "on"]);
            let u = iperf(&t.client.name, *to, &["-u", "-b", "0", "-l", "64"])?;
            let sum = &u["end"]["sum"];
            let got = sum["packets"].as_f64().unwrap_or(0.0) - sum["lost_packets"].as_f64().unwrap_or(0.0);
            rows[k][2].push(got / sum["seconds"].as_f64().unwrap_or(2.0) / 1e3);
            let port = if *to == VIP { 80 } else { 8080 };
            rows[k][3].push(conn_rate(&t.client.name, (*to, port).into(), Duration::from_secs(1))?.0);
            eprint!(".");
        }
    }
    Ok(Rounds(rows))
}

/// Every round's six figures (`measure_paths`) of every path.
pub struct Rounds(Vec<[Vec<f64>; 6]>);

impl Rounds {
    /// Each path's medians over the rounds.
    pub fn medians(&self) -> Vec<[f64; 6]> {
        self.0.iter().map(|r| r.clone().map(median)).collect()
    }

    /// The median over rounds of path `a`'s first four figures ÷ path
    /// `b`'s, each pair measured in the same round (drift between rounds,
    /// which on these machines is larger than most differences, cancels).
    /// Also the lowest and highest of the rounds' ratios: the spread.
    fn paired(&self, a: usize, b: usize) -> [(f64, f64, f64); 4] {
        std::array::from_fn(|k| spread(self.0[a][k].iter().zip(&self.0[b][k]).map(|(x, y)| x / y).collect()))
    }
}

/// The median, lowest and highest of per-round ratios.
pub fn spread(r: Vec<f64>) -> (f64, f64, f64) {
    let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = r.iter().copied().fold(0.0, f64::max);
    (median(r), lo, hi)
}

/// Writes the table of `measure_paths` results, one row per path.
fn write_paths(out: &mut String, paths: &[Path], medians: &[[f64; 6]]) -> Result<()> {
    writeln!(
        out,
        "| path | TCP, TSO on (Gbit/s) | TCP, TSO off (Gbit/s) | UDP 64 B (kpps received) | new TCP connections/s | TCP retransmissions, TSO on | of them lost |\n|---|---:|---:|---:|---:|---:|---:|"
    )?;
    for ((name, _, _), [tso, notso, udp, conns, retrans, lost]) in paths.iter().zip(medians) {
        writeln!(out, "| {name} | {tso:.2} | {notso:.2} | {udp:.0} | {conns:.0} | {retrans:.0} | {lost:.0} |")?;
    }
    Ok(())
}

/// The NAT namespace programmed with the reference dataplanes' iptables rules for the
/// throughput paths (the iperf3 DNAT after 8 others, SNAT by interface).
fn iptables_path() -> Result<NatTopology> {
    let ipt = NatTopology::plain()?;
    let rules = iptables_rules(&ipt.ifaces[1], 8).replace(
        "COMMIT",
        &format!(
            "-I PREROUTING -d {VIP}/32 -p tcp --dport 5201 -j DNAT --to-destination {SERVER}:5201\n-I PREROUTING -d {VIP}/32 -p udp --dport 5201 -j DNAT --to-destination {SERVER}:5201\n-A POSTROUTING -o {} -p udp -j SNAT --to-source {SNAT}:1024-65535\nCOMMIT",
            ipt.ifaces[1]
        ),
    );
    iptables_restore(&ipt.nat.name, &rules)?;
    Ok(ipt)
}

fn throughput(reps: usize, out: &mut String) -> Result<()> {
    writeln!(out, "\n## 4. Throughput and small-packet rate (iperf3, 2 s runs, median of {reps}, 10 rules)\n")?;
    let ebpf = throughput_engine(true)?;
    let slow = throughput_engine(false)?;
    let ipt = iptables_path()?;
    let route = NatTopology::plain()?;
    let lb = lb_engine(true)?;
    let lb_slow = lb_engine(false)?;
    let paths = [
        ("eBPF engine (fast path: redirect)", &ebpf, VIP),
        ("eBPF engine, slow path (the namespace's stack forwards)", &slow, VIP),
        ("iptables (reference rules)", &ipt, VIP),
        ("plain routing, no NAT", &route, SERVER),
        ("direct-mode LB listener (scheduler table, rule SNAT), fast path", &lb, VIP),
        ("direct-mode LB listener, slow path", &lb_slow, VIP),
    ];
    let rounds = measure_paths(&paths, reps)?;
    let medians = rounds.medians();
    writeln!(out, "NAT gateway (DNAT to the server, SNAT by source CIDR):\n")?;
    write_paths(out, &paths[..4], &medians[..4])?;
    writeln!(
        out,
        "\nDirect-mode load balancer listener, measured in the same rounds (iptables' DNAT + SNAT and plain routing are the rows above):\n"
    )?;
    write_paths(out, &paths[4..], &medians[4..])?;
    for (what, path) in [("NAT fast path", 0), ("LB fast path", 4)] {
        let [tso, notso, udp, conns] = rounds.paired(path, 3).map(|(m, lo, hi)| format!("{m:.2} ({lo:.2}–{hi:.2})"));
        writeln!(
            out,
            "\n{what} ÷ plain routing, median (lowest–highest) of the {reps} rounds' ratios: TCP TSO on {tso}, TSO off {notso}, UDP 64 B {udp}, new connections {conns}."
        )?;
    }
    Ok(())
}

/// `lbagent run` for the disruption measurement on `dirs`, restarted with
/// the same arguments; killed on drop (the directories are torn down when
/// `dirs` goes).
struct Agent<'a> {
    dirs: &'a AgentDirs,
    args: Vec<String>,
    process: AgentProcess,
}

impl<'a> Agent<'a> {
    fn start(dirs: &'a AgentDirs, args: Vec<String>) -> Result<Agent<'a>> {
        let process = dirs.spawn(&lbagent_tests::lbagent_bin(), &args, "agent.log");
        let a = Agent { dirs, args, process };
        a.wait_applied()?;
        Ok(a)
    }

    fn wait_applied(&self) -> Result<()> {
        let t = Instant::now();
        while !self.dirs.status().is_some_and(|s| lbagent_tests::agent::applied(&s)) {
            if t.elapsed() > Duration::from_secs(30) {
                bail!("agent did not apply:\n{}", self.process.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn restart(&mut self, sig: nix::sys::signal::Signal) -> Result<()> {
        self.process.end_with(sig);
        self.process = self.dirs.spawn(&lbagent_tests::lbagent_bin(), &self.args, "agent.log");
        self.wait_applied()
    }
}

/// Connections lost across agent restarts and a config change: 40 open
/// connections (20 direct, 20 through haproxy) must keep answering, and a
/// client opening new connections during the event counts failures.
fn disruption(out: &mut String) -> Result<()> {
    use lbagent_tests::{bed::lb_id, hosts::TestHost, ovs::OvsBridge, traffic::*, unique};
    writeln!(out, "\n## 5. Disruption (load balancer, 20 direct + 20 proxied open connections)\n")?;
    writeln!(
        out,
        "| event | open connections lost | new connections failed / tried during the event |\n|---|---:|---:|"
    )?;
    let _lock = lbagent_tests::bed::HostLock::take()?;
    let bridge = OvsBridge::new(&unique("brbd"))?;
    let client = TestHost::on(|p| bridge.add_port(p), "10.80.0.10", 24, "")?;
    let backend = TestHost::on(|p| bridge.add_port(p), "10.80.0.21", 24, "")?;
    line_echo_server(&backend.ns.name, 9000, "b")?;
    let dirs = AgentDirs::new("lbbench");
    let dir = dirs.dir.clone();
    let id = lb_id();
    let state = |weight: u32| {
        lbagent_tests::bed::lb_state(
            &bridge.name,
            &id,
            80,
            [
                "{id: d, type: tcp, port: 9000, backend_group: g}",
                "{id: p, type: tcp, port: 7000, backend_group: g, mode: proxy}",
            ],
            &format!("[{{id: b, address: 10.80.0.21, port: 9000, weight: {weight}}}]"),
        )
    };
    let write = |w: u32| std::fs::write(dir.join("state.yaml"), state(w));
    write(1)?;
    let args: Vec<String> = ["--state", &dir.join("state.yaml").display().to_string(), "--metrics", "127.0.0.1:0"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut agent = Agent::start(&dirs, args)?;
    let vip = |port: u16| SocketAddr::from(([10, 80, 0, 5], port));
    let conns: Vec<OpenConn> = (0..40)
        .map(|i| OpenConn::open(&client.ns.name, vip(if i % 2 == 0 { 9000 } else { 7000 })))
        .collect::<Result<_>>()?;
    for event in [
        "agent killed (-9) and restarted",
        "agent stopped (SIGTERM) and restarted",
        "config change (backend weight) applied",
    ] {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let prober = {
            let (stop, ns) = (stop.clone(), client.ns.name.clone());
            std::thread::spawn(move || {
                let (mut tried, mut failed) = (0u32, 0u32);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    tried += 1;
                    if ask_tcp(&ns, vip(if tried % 2 == 0 { 9000 } else { 7000 })).is_err() {
                        failed += 1;
                    }
                }
                (failed, tried)
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        match event {
            e if e.contains("-9") => agent.restart(nix::sys::signal::Signal::SIGKILL)?,
            e if e.contains("SIGTERM") => agent.restart(nix::sys::signal::Signal::SIGTERM)?,
            _ => {
                write(2)?;
                std::thread::sleep(Duration::from_millis(1500));
                agent.wait_applied()?;
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (failed, tried) = prober.join().map_err(|_| anyhow::anyhow!("prober panicked"))?;
        let lost = conns.iter().filter(|c| c.ping("x").is_err()).count();
        writeln!(out, "| {event} | {lost} of {} | {failed} / {tried} |", conns.len())?;
        eprint!(".");
    }
    drop(conns);
    drop(agent);
    Ok(())
}

fn iptables_restore(ns: &str, rules: &str) -> Result<()> {
    let mut child = std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{ns}"))
        .args(["--", "iptables-legacy-restore"])
        .stdin(std::process::Stdio::piped())
        .spawn()?;
    child.stdin.take().unwrap().write_all(rules.as_bytes())?;
    if !child.wait()?.success() {
        bail!("iptables-legacy-restore failed");
    }
    Ok(())
}

fn apply_times(counts: &[usize], out: &mut String) -> Result<()> {
    writeln!(out, "\n## 3. Installing rules (agent → maps)\n")?;
    writeln!(out, "| rules | install all | per rule | change one rule among them |\n|---:|---:|---:|---:|")?;
    for &n in counts {
        let e = TestZone::new(ZONE)?;
        let t: &Tables = &e.tables;
        let specs: Vec<DnatSpec> = filler(ZONE, n).collect();
        let start = Instant::now();
        for s in &specs {
            t.set_dnat(s)?;
        }
        let all = start.elapsed();
        let mut changed = specs[n / 2].clone();
        changed.backends = vec![(Ipv4Addr::new(10, 9, 0, 2), 81)];
        let start = Instant::now();
        t.set_dnat(&changed)?;
        let one = start.elapsed();
        writeln!(
            out,
            "| {n} | {:.1} ms | {:.1} µs | {:.1} µs |",
            all.as_secs_f64() * 1e3,
            all.as_secs_f64() * 1e6 / n as f64,
            one.as_secs_f64() * 1e6
        )?;
        eprint!(".");
    }
    Ok(())
}

/// Client addresses the UDP flow benchmark sends from (8 × 64 512 source
/// tuples, so no client tuple repeats within a run).
const UDP_CLIENTS: u8 = 8;
/// UDP idle timeout for both engines in that benchmark (s).
const UDP_BENCH_TIMEOUT_S: u32 = 5;

/// Where the next [`udp_flow_rate`] run starts in the client tuples
/// (`UDP_CLIENTS` addresses × 64 512 ports): each run goes on from the
/// last, so a tuple comes back only after the other 516 095 (20 s or more
/// at these rates), when its flow is long past the benchmarks' 5 s UDP
/// timeout: every query is a new flow, not a hit on an earlier run's.
static UDP_TUPLE_CURSOR: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// One-shot UDP queries to `to`, each from a fresh (address, port), each
/// waiting up to 100 ms for its answer, for `dur`: (answered/s, lost).
fn udp_flow_rate(client_ns: &str, to: SocketAddr, dur: Duration) -> Result<(f64, u32)> {
    use std::sync::atomic::Ordering::Relaxed;
    let first = UDP_TUPLE_CURSOR.load(Relaxed);
    spawn_in(client_ns, move || {
        let start = Instant::now();
        let (mut ok, mut lost, mut i) = (0u32, 0u32, first);
        let mut buf = [0u8; 512];
        while start.elapsed() < dur {
            let addr = Ipv4Addr::new(10, 0, 1, 2 + (i % UDP_CLIENTS as u32) as u8);
            let port = 1024 + ((i / UDP_CLIENTS as u32) % 64_512) as u16;
            i += 1;
            let Ok(s) = std::net::UdpSocket::bind((addr, port)) else { continue };
            s.set_read_timeout(Some(Duration::from_millis(100)))?;
            s.send_to(b"query", to)?;
            match s.recv_from(&mut buf) {
                Ok(_) => ok += 1,
                Err(_) => lost += 1,
            }
        }
        UDP_TUPLE_CURSOR.store(i % (UDP_CLIENTS as u32 * 64_512), Relaxed);
        Ok((ok as f64 / start.elapsed().as_secs_f64(), lost))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// 6. New UDP flows/s to one resolver through one SNAT address.
fn udp_flow_rates(reps: usize, dur: Duration, out: &mut String) -> Result<()> {
    let resolver = SocketAddr::from((SERVER, 53));
    // As many flows in `ct_new` (two halves each) as Linux conntrack holds:
    // every query flow lives there for its timeout, and a smaller LRU
    // would evict flows whose answers are still on their way.
    let linux_max: u32 = std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_max")?.trim().parse()?;
    let ebpf = NatTopology::sized(AttachMode::Auto, CtSizes::new(None, Some(2 * linux_max)))?;
    wide_snat(&ebpf)?;
    // The timeout changed, the rest as the topology set it (the fast path on).
    let cfg = ebpf.tables.config()?;
    ebpf.tables.set_config(lbagent_common::NatConfig { udp_s: UDP_BENCH_TIMEOUT_S, ..cfg })?;
    let ipt = NatTopology::plain()?;
    iptables_restore(
        &ipt.nat.name,
        &format!(
            "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -o {} -p udp -j SNAT --to-source {SNAT}:1024-65535 --random-fully\nCOMMIT\n",
            ipt.ifaces[1]
        ),
    )?;
    ipt.nat.sysctl("net.netfilter.nf_conntrack_udp_timeout", &UDP_BENCH_TIMEOUT_S.to_string())?;
    let route = NatTopology::plain()?;
    for t in [&ebpf, &ipt, &route] {
        for k in 1..UDP_CLIENTS {
            t.client.exec(&["ip", "addr", "add", &format!("10.0.1.{}/24", 2 + k), "dev", &t.client_if])?;
        }
        lbagent_tests::traffic::udp_echo_forever(&t.server.name, 53)?;
    }
    writeln!(
        out,
        "\n## 6. New UDP flows per second to one resolver through one SNAT address ({} s runs, median of {reps}, UDP timeout {UDP_BENCH_TIMEOUT_S} s)\n",
        dur.as_secs()
    )?;
    writeln!(out, "| path | answered flows/s | lost queries |\n|---|---:|---:|")?;
    let mut rows: Vec<(&str, Vec<f64>, u32)> =
        vec![("eBPF engine", vec![], 0), ("iptables (random-fully)", vec![], 0), ("plain routing, no NAT", vec![], 0)];
    for _ in 0..reps {
        for (row, t) in rows.iter_mut().zip([&ebpf, &ipt, &route]) {
            let (rate, lost) = udp_flow_rate(&t.client.name, resolver, dur)?;
            row.1.push(rate);
            row.2 += lost;
            eprint!(".");
        }
    }
    for (name, rates, lost) in rows {
        writeln!(out, "| {name} | {:.0} | {lost} |", median(rates))?;
    }
    let (no_port, _) = (ebpf.tables.counter(lbagent_common::Counter::DropNoFreePort)?, ());
    writeln!(
        out,
        "\nThe port range (64 512 ports) over the timeout caps a sustained rate at about {} flows/s; eBPF `drop_no_free_port`: {no_port}.",
        64_512 / UDP_BENCH_TIMEOUT_S
    )?;
    Ok(())
}

/// Writes `flows` established DNAT'ed flows (client 10.x.y.z:1000 → the
/// VIP:80, to the server) into `ct` from userspace, both halves, last seen
/// at `now`: crafted entries, not packets.
pub fn fill_dnat_flows(tables: &Tables, flows: u32, now: u64) -> Result<()> {
    use lbagent_common::{CT_ESTABLISHED, CT_F_DNAT, CT_F_REPLY, CtEntry, MAP_CT, Tuple};
    let mut ct = tables.hash(MAP_CT)?;
    for i in 0..flows {
        let orig = dnat_flow_key(i);
        let x = Tuple { daddr: SERVER.octets(), ..orig };
        let entry = CtEntry {
            xlate: x,
            last_seen_ns: now,
            created_ms: lbagent_common::ct_clock_ms(now),
            flags: CT_F_DNAT,
            state: CT_ESTABLISHED,
            ..Default::default()
        };
        ct.insert(&orig, &entry, 0)?;
        ct.insert(&x.reversed(), &CtEntry { xlate: orig.reversed(), flags: CT_F_DNAT | CT_F_REPLY, ..entry }, 0)?;
    }
    Ok(())
}

/// The original tuple of [`fill_dnat_flows`]' flow `i`.
pub fn dnat_flow_key(i: u32) -> lbagent_common::Tuple {
    let c = [10, (i >> 16) as u8, (i >> 8) as u8, i as u8];
    lbagent_common::Tuple {
        saddr: c,
        daddr: VIP.octets(),
        sport: 1000,
        dport: 80,
        proto: PROTO_TCP,
        _pad0: 0,
        zone: ZONE,
    }
}

/// 7. A repair pass at 500 zones × 25 rules and GC over a full conntrack table.
fn scale(out: &mut String) -> Result<()> {
    use lbagent::dataplane::{engine::Engine as AgentEngine, tables::monotonic_ns};
    use lbagent_common::{CT_MAX, NatConfig};
    const ZONES: u16 = 500;
    const RULES: usize = 25;
    let e = TestZone::new(ZONE)?;
    let mut agent = AgentEngine::new(e.pins.root.clone(), AttachMode::Netlink);
    let want: Vec<Vec<DnatSpec>> = (1..=ZONES).map(|z| filler(z, RULES).collect()).collect();
    let pass = |agent: &mut AgentEngine| -> Result<f64> {
        let t = Instant::now();
        agent.begin_pass();
        for (i, w) in want.iter().enumerate() {
            agent.sync_zone(i as u16 + 1, w, Some(&[]), &mut lbagent::outcome::Changes::new())?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    let apply = pass(&mut agent)?;
    let repair = median((0..3).map(|_| pass(&mut agent)).collect::<Result<_>>()?);
    // Before: every zone's sync read every zone's rules.
    let per_zone = {
        let t = Instant::now();
        for z in 1..=ZONES {
            let n = e.tables.dnat_rules()?.into_iter().filter(|(k, _, _)| k.zone == z).count()
                + e.tables.snat_rules()?.into_iter().filter(|(_, k, _)| k.zone == z).count();
            assert_eq!(n, RULES);
        }
        t.elapsed().as_secs_f64() * 1e3
    };
    eprint!(".");
    // A full established table: CT_MAX entries, both halves of CT_MAX / 2 flows.
    fill_dnat_flows(&e.tables, CT_MAX / 2, monotonic_ns())?;
    let t = Instant::now();
    let kept = lbagent::dataplane::ct_gc::collect(&e.pins.root)?;
    let gc_idle = t.elapsed().as_secs_f64() * 1e3;
    e.tables.set_config(NatConfig { tcp_established_s: 1, ..Default::default() })?;
    std::thread::sleep(Duration::from_millis(2100));
    let t = Instant::now();
    let freed = lbagent::dataplane::ct_gc::collect(&e.pins.root)?;
    let gc_full = t.elapsed().as_secs_f64() * 1e3;
    eprint!(".");
    writeln!(out, "\n## 7. Scale: {ZONES} zones × {RULES} rules, a full conntrack table ({CT_MAX} entries)\n")?;
    writeln!(out, "| what | ms |\n|---|---:|")?;
    writeln!(out, "| first apply (every rule written) | {apply:.1} |")?;
    writeln!(out, "| repair pass, nothing changed (maps read once per pass; median of 3) | {repair:.1} |")?;
    writeln!(out, "| the same reads done per zone, as before | {per_zone:.1} |")?;
    writeln!(out, "| GC of the full table, nothing idle ({kept} flows freed) | {gc_idle:.1} |")?;
    writeln!(out, "| GC of the full table, every flow idle ({freed} flows freed) | {gc_full:.1} |")?;
    Ok(())
}

fn main() -> Result<()> {
    if !require_root() {
        bail!("benchmarks load eBPF and create namespaces: run them as root");
    }
    let quick = std::env::var_os("LBAGENT_BENCH_QUICK").is_some();
    let counts: &[usize] = if quick { &[10, 1_000, 10_000] } else { &[10, 1_000, 10_000, 100_000] };
    let reps = if quick { 1 } else { 3 };
    // Section 4's ratios to plain routing are the fast path's measure:
    // more rounds than the other sections.
    let throughput_reps = if quick { 1 } else { 5 };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?.trim().to_string();
    let mut out = format!(
        "# lbagent benchmarks\n\nReproduce: `cargo xtask bench` (as root). Kernel {kernel}, {} CPUs. These machines are noisy: compare the columns of one row, measured side by side in one run, not absolute numbers across runs.\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    let only = std::env::var("LBAGENT_BENCH_SECTIONS").unwrap_or_default();
    let want = |name: &str| only.is_empty() || only.split(',').any(|s| s == name);
    if want("cost") {
        program_cost(counts, 5, &mut out)?;
    }
    if want("cold") {
        cold_cost(reps, &mut out)?;
    }
    if want("connections") {
        conn_rates(counts, reps, Duration::from_millis(1000), &mut out)?;
    }
    if want("apply") {
        apply_times(counts, &mut out)?;
    }
    if want("throughput") {
        throughput(throughput_reps, &mut out)?;
    }
    if want("disruption") {
        disruption(&mut out)?;
    }
    if want("udp") {
        udp_flow_rates(if quick { 1 } else { 2 }, Duration::from_secs(10), &mut out)?;
    }
    if want("scale") {
        scale(&mut out)?;
    }
    if want("qos") {
        qos::qos(if quick { 1 } else { 2 }, &mut out)?;
    } else if want("qos-cost") {
        qos::cost(&mut out)?;
    }
    if want("load") {
        load::load(throughput_reps, &mut out)?;
    }
    if want("xdp") {
        xdp::xdp(reps, &mut out)?;
    }
    if want("sched") {
        sched::sched(quick, &mut out)?;
    }
    if want("fleet") {
        fleet::fleet(quick, &mut out)?;
    }
    if want("restart") {
        restart::restart(quick, &mut out)?;
    }
    if want("lru") {
        lru::lru(&mut out)?;
    }
    if want("flows") {
        flows::flows(quick, &mut out)?;
    }
    if want("full-table") {
        full_table::full_table(quick, &mut out)?;
    }
    if want("agent-scale") {
        flows::daemon_at_scale(quick, &mut out)?;
    }
    if want("flow-log") {
        flow_log::flow_log(quick, &mut out)?;
    }
    if want("ha") {
        ha::ha(quick, &mut out)?;
    }
    // Opt-in only: it needs `perf` and prints profiles, not figures.
    if only.split(',').any(|s| s == "profile") {
        profile::profile(&mut out)?;
    }
    eprintln!();
    println!("{out}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("results.md"), &out)?;
    Ok(())
}
