//! Section 8 of `cargo xtask bench`: QoS fidelity, the eBPF limiter against
//! kube-ovn's tc scheme (HTB), side by side on the same gateway, plus the
//! per-packet cost of a matching rule.
//!
//! Traffic goes internet → EIP → FIP → VPC host (the EIP's ingress). The
//! eBPF limiter runs on `net1` ingress, before DNAT. The tc baseline is an
//! HTB class at the same rate and burst on the gateway's `eth0` egress (the
//! same flow after DNAT: kube-ovn's IFB redirect would skip the engine's
//! ingress hook, and for one EIP's flows the two places shape the same
//! packets).

use std::{fmt::Write as _, time::Duration};

use anyhow::Result;
use lbagent_common::*;
use lbagent_tests::{
    engine::TestZone,
    gateway::GwBed,
    net::in_ns,
    packet::{Ip, L4, frame},
    rate::{IperfClient, IperfServer, rx_rate},
};

const FIP: &str = "198.51.100.10";
const PORT: u16 = 5201;
const BURST_MB: f64 = 1.0;

#[derive(Clone, Copy, PartialEq)]
enum Limiter {
    Ebpf,
    Htb,
}

fn state(b: &GwBed, mbps: f64, bound: bool) -> String {
    let bind = if bound { ", qos_policy: p" } else { "" };
    b.state(&format!(
        "    eips:\n      - {{name: eip1, ip: {FIP}{bind}}}\n    fips: [{{eip: eip1, internal_ip: 10.10.0.21}}]\nqos_policies:\n  - name: p\n    binding: eip\n    rules:\n      - {{name: in, direction: ingress, rate_mbps: \"{mbps}\", burst_mb: \"{BURST_MB}\", priority: 1}}\n"
    ))
}

fn set_limiter(b: &mut GwBed, l: Limiter, mbps: f64) -> Result<()> {
    let ns = b.netns();
    let _ = in_ns(&ns, &["tc", "qdisc", "del", "dev", "eth0", "root"]);
    let st = state(b, mbps, l == Limiter::Ebpf);
    b.apply(&st);
    if l == Limiter::Htb {
        let burst = format!("{}", (BURST_MB * 1048576.0) as u64);
        in_ns(&ns, &["tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1"])?;
        in_ns(
            &ns,
            &[
                "tc",
                "class",
                "add",
                "dev",
                "eth0",
                "parent",
                "1:",
                "classid",
                "1:1",
                "htb",
                "rate",
                &format!("{mbps}mbit"),
                "burst",
                &burst,
            ],
        )?;
    }
    Ok(())
}

/// (layer-2 ratio, goodput ratio) of one run; again after a pause when the
/// server is still busy with the previous client (seen after `-P 8`).
fn run(b: &GwBed, mbps: f64, extra: &[&str]) -> Result<(f64, f64)> {
    for _ in 0..3 {
        match run_once(b, mbps, extra) {
            Err(e) if e.to_string().contains("busy") => std::thread::sleep(Duration::from_secs(3)),
            r => return r,
        }
    }
    run_once(b, mbps, extra)
}

fn run_once(b: &GwBed, mbps: f64, extra: &[&str]) -> Result<(f64, f64)> {
    let (inet, vpc) = (b.internet.ns.name.clone(), b.vpc[0].ns.name.clone());
    // The bucket's fill can differ by up to a burst between the window's
    // ends: a window long against the burst keeps that error small.
    let burst_s = BURST_MB * 8.388608 / mbps;
    let skip = burst_s + 1.5;
    let window = 3.0 + 4.0 * burst_s;
    let caps = capture(b)?;
    let c = IperfClient::start(&inet, FIP, PORT, (skip + window + 1.0).ceil() as u32, extra)?;
    std::thread::sleep(Duration::from_secs_f64(skip));
    let r = rx_rate(&vpc, "eth0", Duration::from_secs_f64(window))?;
    let g = c.goodput()?;
    drop(caps);
    Ok((r / (mbps * 1e6), g / (mbps * 1e6)))
}

/// Development aid (`LBAGENT_BENCH_QOS_PCAP=<dir>`): the gateway's `net1`
/// (every packet offered, before the limiter) and `eth0` (what passed,
/// translated), TCP headers only, one pair of files per run; the captures
/// stop when the result is dropped (also when the run fails).
fn capture(b: &GwBed) -> Result<Captures> {
    let Ok(dir) = std::env::var("LBAGENT_BENCH_QOS_PCAP") else { return Ok(Captures(vec![])) };
    static RUN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let ns = b.netns();
    let mut caps = Captures(Vec::new());
    for dev in ["net1", "eth0"] {
        let f = format!("{dir}/run{n}-{dev}.pcap");
        caps.0.push(
            std::process::Command::new("ip")
                .args(["netns", "exec", &ns, "tcpdump", "-Q", if dev == "net1" { "inout" } else { "out" }])
                .args(["-i", dev, "-s", "80", "-B", "65536", "-w", &f, "tcp"])
                .stderr(std::process::Stdio::null())
                .spawn()?,
        );
    }
    std::thread::sleep(Duration::from_millis(500));
    Ok(caps)
}

/// Running `tcpdump`s, stopped on drop.
struct Captures(Vec<std::process::Child>);

impl Drop for Captures {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn qos(reps: usize, out: &mut String) -> Result<()> {
    writeln!(
        out,
        "\n## 8. QoS fidelity (achieved ÷ configured rate, median of {reps})\n\n\
         Internet → EIP → FIP → VPC host, burst {BURST_MB} MB. Layer 2: bytes received on the VPC host's \
         interface over 3 s + 4 × (burst ÷ rate) after the burst has drained (burst ÷ rate + 1.5 s). Goodput: iperf3's own figure \
         for the whole run (burst included; TCP payload is at most 1448/1514 of layer 2). eBPF: the limiter on \
         `net1` ingress. tc: an HTB class at the same rate and burst (kube-ovn's scheme) on the gateway's `eth0` \
         egress.\n"
    )?;
    writeln!(
        out,
        "| rate | traffic | eBPF layer 2 | tc HTB layer 2 | eBPF goodput | tc HTB goodput | eBPF sender timeouts | tc HTB sender timeouts |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|"
    )?;
    let mut b = GwBed::new(&["10.10.0.21"])?;
    let _server = IperfServer::start(&b.vpc[0].ns.name.clone(), PORT)?;
    // Development aids: only some rates or rows.
    let rates: Vec<f64> = std::env::var("LBAGENT_BENCH_QOS_RATES")
        .map(|v| v.split(',').filter_map(|r| r.parse().ok()).collect())
        .unwrap_or(vec![10.0, 100.0]);
    let row_filter = std::env::var("LBAGENT_BENCH_QOS_ROWS").unwrap_or_default();
    for mbps in rates {
        let offered = format!("{}M", 2.0 * mbps);
        // (row, iperf3 arguments, the sender's net.ipv4.tcp_ecn)
        let rows: [(&str, Vec<&str>, &str); 6] = [
            ("UDP at 2× the rate", vec!["-u", "-b", offered.as_str(), "-l", "1400"], "0"),
            ("1 TCP flow, CUBIC, ECN", vec!["-C", "cubic"], "1"),
            ("1 TCP flow, CUBIC, no ECN", vec!["-C", "cubic"], "0"),
            ("1 TCP flow, BBR", vec!["-C", "bbr"], "0"),
            ("8 TCP flows, CUBIC", vec!["-P", "8", "-C", "cubic"], "0"),
            // They share the bucket's one signal per quarter burst.
            ("8 TCP flows, CUBIC, ECN", vec!["-P", "8", "-C", "cubic"], "1"),
        ];
        for (what, extra, ecn) in rows {
            if !row_filter.is_empty() && !what.contains(row_filter.as_str()) {
                continue;
            }
            b.internet.ns.sysctl("net.ipv4.tcp_ecn", ecn)?;
            let mut res = [[vec![], vec![], vec![]], [vec![], vec![], vec![]]];
            for _ in 0..reps {
                // Interleaved: eBPF, tc, eBPF, tc …
                for (i, l) in [Limiter::Ebpf, Limiter::Htb].into_iter().enumerate() {
                    set_limiter(&mut b, l, mbps)?;
                    let rto0 = timeouts(&b.internet.ns.name)?;
                    let (l2, good) = run(&b, mbps, &extra)?;
                    res[i][0].push(l2);
                    res[i][1].push(good);
                    res[i][2].push((timeouts(&b.internet.ns.name)? - rto0) as f64);
                    eprint!(".");
                }
            }
            let m = |v: &Vec<f64>| crate::median(v.clone()) * 100.0;
            let n = |v: &Vec<f64>| crate::median(v.clone());
            writeln!(
                out,
                "| {mbps} Mbit/s | {what} | {:.1} % | {:.1} % | {:.1} % | {:.1} % | {} | {} |",
                m(&res[0][0]),
                m(&res[1][0]),
                m(&res[0][1]),
                m(&res[1][1]),
                n(&res[0][2]),
                n(&res[1][2]),
            )?;
        }
    }
    let ns = b.netns();
    let _ = in_ns(&ns, &["tc", "qdisc", "del", "dev", "eth0", "root"]);
    drop(b);
    cost(out)
}

/// ns/packet of a 1 400-byte UDP packet to an EIP: no QoS in the zone, and
/// a matching EIP rule (at a rate it never reaches). The two are measured
/// alternately (the rule added and removed between runs) so that the
/// machine's drift falls on both alike; the cost is the median of the
/// paired differences.
pub fn cost(out: &mut String) -> Result<()> {
    let zone = 7;
    let mut e = TestZone::new(zone)?;
    let f = frame(
        &Ip::new([203, 0, 113, 7], [198, 51, 100, 10]),
        &L4::Udp { sport: 4000, dport: 5000, payload: vec![0; 1400], zero_csum: false },
    );
    let mut hit = lbagent::dataplane::qos::QosZone::default();
    hit.eips.insert(([198, 51, 100, 10], QOS_INGRESS), QosEip { bucket: 77, priority: 1, flags: 0, _pad0: 0 });
    hit.buckets.insert(77, qos_config(100_000_000_000, 0));
    hit.finish(1);
    let none = lbagent::dataplane::qos::QosZone::default();
    let pairs = 15;
    let (mut a, mut b, mut d) = (vec![], vec![], vec![]);
    for _ in 0..pairs {
        e.tables.sync_qos(zone, &none)?;
        let t0 = e.time(&f, 100_000)?;
        e.tables.sync_qos(zone, &hit)?;
        let t1 = e.time(&f, 100_000)?;
        a.push(t0);
        b.push(t1);
        d.push(t1 - t0);
    }
    e.tables.sync_qos(zone, &none)?;
    let (na, nb) = (crate::median(a.clone()), crate::median(b.clone()));
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    writeln!(
        out,
        "\nPer-packet cost (BPF_PROG_TEST_RUN, {pairs} alternating pairs of 100 000 runs): no QoS in the zone {na:.1} ns, \
         a matching EIP rule {nb:.1} ns (medians); the rule costs {:.1} ns/packet (median of the paired differences; \
         {:.1} ns between the fastest runs of each).",
        crate::median(d),
        min(&b) - min(&a)
    )?;
    Ok(())
}

/// The sender's retransmission timeouts so far (`TcpExt: TCPTimeouts` in
/// its namespace): each is ≥ 200 ms of silence, what a policer must avoid.
fn timeouts(ns: &str) -> Result<u64> {
    crate::tcp_ext(ns, "TCPTimeouts")
}
