//! Where the time of one TCP stream without TSO goes (section 12, opt-in:
//! `LBAGENT_BENCH_SECTIONS=profile`): `perf record -a` during an iperf3 run
//! through the eBPF fast path and through plain routing, the top symbols of
//! each side by side. Needs `perf`.

use std::{fmt::Write, process::Command};

use anyhow::{Context, Result};
use lbagent_tests::topology::{NatTopology, SERVER, VIP};

use super::{iperf, throughput_engine};

/// Symbols below this share of the samples are left out.
const PERCENT_LIMIT: &str = "0.7";

pub fn profile(out: &mut String) -> Result<()> {
    writeln!(out, "\n## 12. Profile: one TCP stream, TSO and GSO off at the client (`perf record -a`, 3 s)\n")?;
    let fast = throughput_engine(true)?;
    let route = NatTopology::plain()?;
    for (name, t, to) in [("eBPF fast path", &fast, VIP), ("plain routing", &route, SERVER)] {
        let _server = lbagent_tests::rate::IperfServer::start(&t.server.name, 5201)?;
        let c0 = t.client_if.clone();
        let _ = t.client.exec(&["ethtool", "-K", &c0, "tso", "off", "gso", "off"]);
        let data = std::env::temp_dir().join(format!("lbagent-profile-{}.data", std::process::id()));
        let perf = Command::new("perf")
            .args(["record", "-a", "-q", "-o"])
            .arg(&data)
            .args(["--", "sleep", "3"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("perf record")?;
        let run = std::thread::spawn({
            let ns = t.client.name.clone();
            move || iperf(&ns, to, &["-t", "4"])
        });
        let perf = perf.wait_with_output()?;
        let result = run.join().map_err(|_| anyhow::anyhow!("iperf3 thread"))??;
        let gbps = result["end"]["sum_received"]["bits_per_second"].as_f64().unwrap_or(0.0) / 1e9;
        let report = Command::new("perf")
            .args(["report", "--stdio", "--no-children", "--sort", "symbol", "--percent-limit", PERCENT_LIMIT, "-i"])
            .arg(&data)
            .output()
            .context("perf report")?;
        let _ = std::fs::remove_file(&data);
        writeln!(out, "### {name}: {gbps:.2} Gbit/s (perf exit {})\n\n```", perf.status)?;
        for line in
            String::from_utf8_lossy(&report.stdout).lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        {
            writeln!(out, "{line}")?;
        }
        writeln!(out, "```")?;
        let _ = t.client.exec(&["ethtool", "-K", &c0, "tso", "on", "gso", "on"]);
    }
    Ok(())
}
