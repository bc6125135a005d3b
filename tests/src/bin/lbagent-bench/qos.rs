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
    engine::Engine,
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

/// (layer-2 ratio, goodput ratio) of one run.
fn run(b: &GwBed, mbps: f64, extra: &[&str]) -> Result<(f64, f64)> {
    let (inet, vpc) = (b.internet.ns.name.clone(), b.vpc[0].ns.name.clone());
    // The bucket's fill can differ by up to a burst between the window's
    // ends: a window long against the burst keeps that error small.
    let burst_s = BURST_MB * 8.388608 / mbps;
    let skip = burst_s + 1.5;
    let window = 3.0 + 4.0 * burst_s;
    let c = IperfClient::start(&inet, FIP, PORT, (skip + window + 1.0).ceil() as u32, extra)?;
    std::thread::sleep(Duration::from_secs_f64(skip));
    let r = rx_rate(&vpc, "eth0", Duration::from_secs_f64(window))?;
    let g = c.goodput()?;
    Ok((r / (mbps * 1e6), g / (mbps * 1e6)))
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
        "| rate | traffic | eBPF layer 2 | tc HTB layer 2 | eBPF goodput | tc HTB goodput |\n|---:|---|---:|---:|---:|---:|"
    )?;
    let mut b = GwBed::new(&["10.10.0.21"])?;
    let _server = IperfServer::start(&b.vpc[0].ns.name.clone(), PORT)?;
    for mbps in [10.0, 100.0] {
        let offered = format!("{}M", 2.0 * mbps);
        let rows: [(&str, Vec<&str>, &str); 4] = [
            ("UDP at 2× the rate", vec!["-u", "-b", offered.as_str(), "-l", "1400"], "0"),
            ("1 TCP flow, ECN", vec![], "1"),
            ("1 TCP flow, no ECN", vec![], "0"),
            ("8 TCP flows", vec!["-P", "8"], "0"),
        ];
        for (what, extra, ecn) in rows {
            b.internet.ns.sysctl("net.ipv4.tcp_ecn", ecn)?;
            let mut res = [(vec![], vec![]), (vec![], vec![])];
            for _ in 0..reps {
                // Interleaved: eBPF, tc, eBPF, tc …
                for (i, l) in [Limiter::Ebpf, Limiter::Htb].into_iter().enumerate() {
                    set_limiter(&mut b, l, mbps)?;
                    let (l2, good) = run(&b, mbps, &extra)?;
                    res[i].0.push(l2);
                    res[i].1.push(good);
                    eprint!(".");
                }
            }
            let m = |v: &Vec<f64>| crate::median(v.clone()) * 100.0;
            writeln!(
                out,
                "| {mbps} Mbit/s | {what} | {:.1} % | {:.1} % | {:.1} % | {:.1} % |",
                m(&res[0].0),
                m(&res[1].0),
                m(&res[0].1),
                m(&res[1].1)
            )?;
        }
    }
    let ns = b.netns();
    let _ = in_ns(&ns, &["tc", "qdisc", "del", "dev", "eth0", "root"]);
    drop(b);
    cost(out)
}

/// ns/packet of a 1 400-byte UDP packet to an EIP: no QoS in the zone, and
/// a matching EIP rule (at a rate it never reaches).
pub fn cost(out: &mut String) -> Result<()> {
    let zone = 7;
    let mut e = Engine::new(zone)?;
    let f = frame(
        &Ip::new([203, 0, 113, 7], [198, 51, 100, 10]),
        &L4::Udp { sport: 4000, dport: 5000, payload: vec![0; 1400], zero_csum: false },
    );
    let reps = 5;
    let none: Vec<f64> = (0..reps).map(|_| e.time(&f, 200_000)).collect::<Result<_>>()?;
    let mut z = lbagent::dataplane::qos::QosZone::default();
    z.hooks.insert((1, QOS_INGRESS), QosHook { eip_side: QOS_EIP_DADDR, count: 0, ..Default::default() });
    z.eips.insert(([198, 51, 100, 10], QOS_INGRESS), QosEip { bucket: 77, priority: 1 });
    z.buckets.insert(77, qos_config(100_000_000_000, 0));
    e.tables.sync_qos(zone, &z)?;
    let hit: Vec<f64> = (0..reps).map(|_| e.time(&f, 200_000)).collect::<Result<_>>()?;
    let (a, b) = (crate::median(none), crate::median(hit));
    writeln!(
        out,
        "\nPer-packet cost (BPF_PROG_TEST_RUN, median of {reps}): no QoS in the zone {a:.1} ns, a matching EIP rule {b:.1} ns: the rule costs {:.1} ns/packet.",
        b - a
    )?;
    Ok(())
}
