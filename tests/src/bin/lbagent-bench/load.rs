//! Section 13: CPU per packet at equal offered load.
//!
//! Section 4 saturates the machine and compares rates, which on these
//! 2-CPU virtual machines swing by ±30 % from one 2-second run to the next
//! (steal time, the scheduler's placement of sender, receiver and
//! softirqs). At saturation a path's rate is the inverse of what one packet
//! costs, so this section measures that cost directly: the same paths carry
//! the same fixed load, well below saturation, and the CPU time the whole
//! machine spent (wall time × CPUs, less idle, I/O wait and steal from
//! `/proc/stat`) is divided by the packets delivered. The sender's cost
//! is in it too, the same on every path. Two loads:
//! - 64-byte UDP at [`UDP_PPS`] datagrams/s, counted and dropped on arrival
//!   at the server (no receiving socket to wake: [`udp_load`]);
//! - one TCP stream at [`TCP_RATE`] with TSO and GSO off at the client
//!   (every segment a packet), cost per 1 000 full segments received.

use std::{fmt::Write as _, net::Ipv4Addr};

use anyhow::{Context, Result};
use lbagent_tests::{
    net::in_ns,
    topology::{NatTopology, spawn_in},
};

use crate::{Path, iperf, median, spread};

/// UDP load: datagrams per second (64-byte payloads).
const UDP_PPS: u64 = 50_000;
/// TCP load, iperf3's `-b`.
const TCP_RATE: &str = "2G";
/// Payload of a full segment at MTU 1500 with timestamps.
const SEGMENT: f64 = 1448.0;
/// The UDP load's port (the VIP's UDP rule, to the server's port 5201,
/// where the server's raw table drops it; iperf3 runs only TCP here).
const PORT: u16 = 5201;
/// Seconds per measured run.
const SECS: &str = "3";

/// The machine's CPU time so far not spent on work, in seconds: idle,
/// I/O wait and steal (`/proc/stat`). These three are measured precisely
/// (idle from the tickless idle clock, steal from the hypervisor's clock);
/// the busy fields are sampled at the tick, which misses softirq work that
/// starts and ends between two ticks (the first version of this section,
/// built on them, reported a 1 Gbit/s TCP stream as 20 ms of CPU in 3 s).
fn not_busy_s() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("empty /proc/stat")?;
    // cpu user nice system idle iowait irq softirq steal …
    let v: Vec<u64> = line.split_whitespace().skip(1).map(|x| x.parse().unwrap_or(0)).collect();
    let ticks = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0) + v.get(7).copied().unwrap_or(0);
    Ok(ticks as f64 / ticks_per_s())
}

/// Ticks per second of `/proc/stat` (USER_HZ).
fn ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { nix::libc::sysconf(nix::libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// CPU seconds the whole machine was busy while `f` ran.
fn busy_during<T>(f: impl FnOnce() -> T) -> Result<(T, f64)> {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
    let (before, start) = (not_busy_s()?, std::time::Instant::now());
    let r = f();
    let wall = start.elapsed().as_secs_f64();
    Ok((r, (wall * cpus - (not_busy_s()? - before)).max(0.0)))
}

/// Sends [`UDP_PPS`] 64-byte datagrams a second for [`SECS`] from `t`'s
/// client to `to`:5201, in bursts of one millisecond's worth that sleep in
/// between (iperf3's own pacing spins on the clock between datagrams, which
/// would fill the CPU time this section measures); returns how many reached
/// the server. They are counted and dropped by a `raw` table rule in the
/// server's namespace ([`drop_udp_at_server`]), not received by a socket:
/// waking a receiving thread (an inter-processor interrupt, expensive in a
/// virtual machine) happens per datagram or per batch depending on how the
/// datagrams' arrival lines up with the receiver's sleep, and a profile
/// showed it at 4 % of the CPU on one path and 11 % on the other in the same
/// run: more than the forwarding this section compares.
fn udp_load(t: &NatTopology, to: Ipv4Addr) -> Result<u64> {
    use std::{
        net::UdpSocket,
        time::{Duration, Instant},
    };
    let ns = &t.server.name;
    in_ns(ns, &["iptables-legacy", "-t", "raw", "-Z", "PREROUTING"])?;
    let secs: u64 = SECS.parse()?;
    let sender = spawn_in(&t.client.name, move || {
        let s = UdpSocket::bind(("0.0.0.0", 0))?;
        s.connect((to, PORT))?;
        let (start, per_ms, payload) = (Instant::now(), UDP_PPS / 1000, [0x5au8; 64]);
        for ms in 0..secs * 1000 {
            for _ in 0..per_ms {
                // A full socket buffer drops the datagram here: it is not
                // sent, so it is not counted as received either.
                let _ = s.send(&payload);
            }
            let next = start + Duration::from_millis(ms + 1);
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
        }
        Ok(())
    });
    sender.join().map_err(|_| anyhow::anyhow!("UDP sender panicked"))??;
    std::thread::sleep(Duration::from_millis(100));
    let listing = in_ns(ns, &["iptables-legacy", "-t", "raw", "-L", "PREROUTING", "-v", "-x", "-n"])?;
    listing
        .lines()
        .find(|l| l.contains("DROP") && l.contains(&format!("dpt:{PORT}")))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("no UDP drop counter in the server's raw table:\n{listing}"))
}

/// Counts and drops the UDP load where it arrives (see [`udp_load`]).
fn drop_udp_at_server(t: &NatTopology) -> Result<()> {
    let port = PORT.to_string();
    in_ns(
        &t.server.name,
        &["iptables-legacy", "-t", "raw", "-A", "PREROUTING", "-p", "udp", "--dport", &port, "-j", "DROP"],
    )?;
    Ok(())
}

/// CPU µs per received 64-byte datagram at `UDP_PPS`, and per 1 000 TCP
/// segments at `TCP_RATE`, through `t` to `to`.
fn costs(t: &NatTopology, to: Ipv4Addr) -> Result<[f64; 2]> {
    let (got, busy) = busy_during(|| udp_load(t, to))?;
    let udp = busy * 1e6 / got?.max(1) as f64;

    let c0 = t.client_if.clone();
    let _ = t.client.exec(&["ethtool", "-K", &c0, "tso", "off", "gso", "off"]);
    let (r, busy) = busy_during(|| iperf(&t.client.name, to, &["-t", SECS, "-b", TCP_RATE]))?;
    let _ = t.client.exec(&["ethtool", "-K", &c0, "tso", "on", "gso", "on"]);
    let bytes = r?["end"]["sum_received"]["bytes"].as_f64().unwrap_or(0.0);
    let tcp = busy * 1e6 / (bytes / SEGMENT / 1e3).max(1.0);
    Ok([udp, tcp])
}

pub fn load(reps: usize, out: &mut String) -> Result<()> {
    writeln!(
        out,
        "\n## 13. CPU per packet at equal offered load (64-byte UDP at {} kpps, one TCP stream at {TCP_RATE}bit/s without TSO; {SECS} s runs, median of {reps})\n",
        UDP_PPS / 1000
    )?;
    let ebpf = crate::throughput_engine(true)?;
    let slow = crate::throughput_engine(false)?;
    let ipt = crate::iptables_path()?;
    let route = NatTopology::plain()?;
    let lb = crate::lb_engine(true)?;
    let paths: [Path; 5] = [
        ("NAT gateway, fast path", &ebpf, crate::VIP),
        ("NAT gateway, slow path", &slow, crate::VIP),
        ("iptables (reference rules)", &ipt, crate::VIP),
        ("plain routing, no NAT", &route, crate::SERVER),
        ("direct-mode LB listener, fast path", &lb, crate::VIP),
    ];
    for (_, t, _) in &paths {
        drop_udp_at_server(t)?;
    }
    let _servers: Vec<lbagent_tests::rate::IperfServer> = paths
        .iter()
        .map(|(_, t, _)| lbagent_tests::rate::IperfServer::start(&t.server.name, 5201))
        .collect::<Result<_>>()?;
    let mut rounds = vec![[vec![], vec![]]; paths.len()];
    for _ in 0..reps {
        for (k, (_, t, to)) in paths.iter().enumerate() {
            let [udp, tcp] = costs(t, *to)?;
            rounds[k][0].push(udp);
            rounds[k][1].push(tcp);
            eprint!(".");
        }
    }
    writeln!(
        out,
        "| path | UDP: CPU µs per datagram | TCP: CPU µs per 1 000 segments | UDP: routing's cost ÷ this path's | TCP: routing's cost ÷ this path's |\n|---|---:|---:|---:|---:|"
    )?;
    const ROUTE: usize = 3;
    for (k, (name, _, _)) in paths.iter().enumerate() {
        // Ratios within each round (drift between rounds cancels), then
        // their median and spread: above 1.0 the path costs less per packet
        // than routing, so it would carry more at saturation.
        let ratio = |m: usize| {
            let (m, lo, hi) = spread(rounds[ROUTE][m].iter().zip(&rounds[k][m]).map(|(r, x)| r / x).collect());
            format!("{m:.2} ({lo:.2}–{hi:.2})")
        };
        writeln!(
            out,
            "| {name} | {:.2} | {:.0} | {} | {} |",
            median(rounds[k][0].clone()),
            median(rounds[k][1].clone()),
            ratio(0),
            ratio(1)
        )?;
    }
    Ok(())
}
