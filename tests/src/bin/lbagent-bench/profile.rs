//! Where the time goes (section 12, opt-in: `LBAGENT_BENCH_SECTIONS=profile`):
//! `perf record -a` during a workload through the eBPF fast path and through
//! plain routing (the topology of section 4), the top symbols of each. Three
//! workloads: one TCP stream without TSO (every segment a packet), 64-byte
//! UDP, and sequential new TCP connections. Needs `perf`.

use std::{fmt::Write, net::Ipv4Addr, process::Command, time::Duration};

use anyhow::{Context, Result};
use lbagent_tests::topology::{NatTopology, SERVER, VIP};

use super::{accept_forever, conn_rate, iperf, throughput_engine};

/// Symbols below this share of the samples are left out.
const PERCENT_LIMIT: &str = "0.7";
/// How long perf records; the workload runs a second longer.
const RECORD_SECS: u64 = 3;

#[derive(Clone, Copy)]
enum Workload {
    /// One iperf3 TCP stream, TSO and GSO off at the client.
    TcpNoTso,
    /// iperf3 UDP, 64-byte datagrams, unlimited rate.
    Udp64,
    /// Sequential connect/close (RST) to port 80 (8080 when routed).
    NewConnections,
}

impl Workload {
    fn title(self) -> &'static str {
        match self {
            Workload::TcpNoTso => "one TCP stream, TSO and GSO off at the client",
            Workload::Udp64 => "64-byte UDP",
            Workload::NewConnections => "new TCP connections, one at a time",
        }
    }

    /// Runs the workload from `t`'s client to `to`; returns its rate as text.
    fn run(self, t: &NatTopology, to: Ipv4Addr) -> Result<String> {
        let secs = (RECORD_SECS + 1).to_string();
        match self {
            Workload::TcpNoTso => {
                let r = iperf(&t.client.name, to, &["-t", &secs])?;
                let gbps = r["end"]["sum_received"]["bits_per_second"].as_f64().unwrap_or(0.0) / 1e9;
                Ok(format!("{gbps:.2} Gbit/s"))
            }
            Workload::Udp64 => {
                let r = iperf(&t.client.name, to, &["-t", &secs, "-u", "-b", "0", "-l", "64"])?;
                let sum = &r["end"]["sum"];
                let (sent, lost) =
                    (sum["packets"].as_f64().unwrap_or(0.0), sum["lost_packets"].as_f64().unwrap_or(0.0));
                let s = sum["seconds"].as_f64().unwrap_or(RECORD_SECS as f64 + 1.0);
                Ok(format!("{:.0} kpps received of {:.0} kpps sent", (sent - lost) / s / 1e3, sent / s / 1e3))
            }
            Workload::NewConnections => {
                let port = if to == VIP { 80 } else { 8080 };
                let (rate, _) = conn_rate(&t.client.name, (to, port).into(), Duration::from_secs(RECORD_SECS + 1))?;
                Ok(format!("{rate:.0} connections/s"))
            }
        }
    }
}

pub fn profile(out: &mut String) -> Result<()> {
    writeln!(out, "\n## 12. Profile (`perf record -a`, {RECORD_SECS} s)\n")?;
    let fast = throughput_engine(true)?;
    let route = NatTopology::plain()?;
    let _servers = [&fast, &route]
        .iter()
        .map(|t| lbagent_tests::rate::IperfServer::start(&t.server.name, 5201))
        .collect::<Result<Vec<_>>>()?;
    for t in [&fast, &route] {
        accept_forever(&t.server.name)?;
    }
    for w in [Workload::TcpNoTso, Workload::Udp64, Workload::NewConnections] {
        writeln!(out, "\n### {}\n", w.title())?;
        for (name, t, to) in [("eBPF fast path", &fast, VIP), ("plain routing", &route, SERVER)] {
            profile_one(out, name, t, to, w)?;
        }
    }
    Ok(())
}

/// One `perf record -a` while `w` runs from `t`'s client to `to`.
fn profile_one(out: &mut String, name: &str, t: &NatTopology, to: Ipv4Addr, w: Workload) -> Result<()> {
    let c0 = t.client_if.clone();
    let tso = if matches!(w, Workload::TcpNoTso) { "off" } else { "on" };
    let _ = t.client.exec(&["ethtool", "-K", &c0, "tso", tso, "gso", tso]);
    let data = std::env::temp_dir().join(format!("lbagent-profile-{}.data", std::process::id()));
    let perf = Command::new("perf")
        .args(["record", "-a", "-q", "-o"])
        .arg(&data)
        .args(["--", "sleep", &RECORD_SECS.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("perf record")?;
    let rate = w.run(t, to);
    let perf = perf.wait_with_output()?;
    let _ = t.client.exec(&["ethtool", "-K", &c0, "tso", "on", "gso", "on"]);
    let rate = rate?;
    let report = Command::new("perf")
        .args(["report", "--stdio", "--no-children", "--sort", "symbol", "--percent-limit", PERCENT_LIMIT, "-i"])
        .arg(&data)
        .output()
        .context("perf report")?;
    let _ = std::fs::remove_file(&data);
    writeln!(out, "#### {name}: {rate} (perf exit {})\n\n```", perf.status)?;
    for line in String::from_utf8_lossy(&report.stdout).lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        writeln!(out, "{line}")?;
    }
    writeln!(out, "```")?;
    Ok(())
}
