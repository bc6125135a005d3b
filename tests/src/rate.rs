//! Rates through the dataplane with iperf3 (QoS tests and benchmarks).
//!
//! A rate is measured as layer-2 bytes received on the receiver's interface
//! (`/proc/net/dev` inside its namespace) over a window that starts after
//! the limiter's initial burst has drained (docs/qos.md): iperf3's own
//! goodput is at most 1448/1514 of the layer-2 rate and hides the burst.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::net::in_ns;

/// An iperf3 server in a namespace, killed on drop.
pub struct IperfServer(Child);

impl IperfServer {
    pub fn start(ns: &str, port: u16) -> Result<Self> {
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{ns}"))
            .args(["--", "iperf3", "-s", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3 (is it installed?)")?;
        std::thread::sleep(Duration::from_millis(300));
        Ok(IperfServer(child))
    }
}

impl Drop for IperfServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running iperf3 client (JSON output), killed on drop.
pub struct IperfClient(Child);

impl IperfClient {
    /// `iperf3 -c to -p port -t secs` from `ns` with `extra` arguments
    /// (`-u -b 20M`, `-R` …).
    pub fn start(ns: &str, to: &str, port: u16, secs: u32, extra: &[&str]) -> Result<Self> {
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{ns}"))
            .args(["--", "iperf3", "-J", "-c", to, "-p", &port.to_string(), "-t", &secs.to_string()])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3 client")?;
        Ok(IperfClient(child))
    }

    /// Waits for the client to finish; an error if it failed.
    pub fn finish(self) -> Result<()> {
        self.goodput().map(|_| ())
    }

    /// Waits for the client; the goodput iperf3 reports at the receiver
    /// (bit/s over the whole run, the initial burst included).
    pub fn goodput(mut self) -> Result<f64> {
        let mut out = String::new();
        if let Some(mut o) = self.0.stdout.take() {
            use std::io::Read;
            o.read_to_string(&mut out)?;
        }
        let st = self.0.wait()?;
        if !st.success() {
            bail!("iperf3 client failed: {st}");
        }
        let v: serde_json::Value = serde_json::from_str(&out).context("iperf3 JSON")?;
        if let Some(e) = v["error"].as_str() {
            bail!("iperf3 client: {e}");
        }
        let end = &v["end"];
        if let Some(r) = end["sum_received"]["bits_per_second"].as_f64() {
            return Ok(r);
        }
        // UDP: what was sent, less what the receiver reports lost.
        let sent = end["sum"]["bits_per_second"].as_f64().unwrap_or(0.0);
        Ok(sent * (1.0 - end["sum"]["lost_percent"].as_f64().unwrap_or(0.0) / 100.0))
    }
}

impl Drop for IperfClient {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Bytes received so far on `ifname` in namespace `ns`.
pub fn rx_bytes(ns: &str, ifname: &str) -> Result<u64> {
    let dev = in_ns(ns, &["cat", "/proc/net/dev"])?;
    for line in dev.lines() {
        if let Some((name, rest)) = line.split_once(':')
            && name.trim() == ifname
        {
            return rest.split_whitespace().next().context("rx bytes")?.parse().context("rx bytes");
        }
    }
    bail!("no interface {ifname} in {ns}")
}

/// The layer-2 receive rate (bit/s) on `ifname` in `ns` over `window`.
pub fn rx_rate(ns: &str, ifname: &str, window: Duration) -> Result<f64> {
    let (b0, t0) = (rx_bytes(ns, ifname)?, Instant::now());
    std::thread::sleep(window);
    let (b1, t1) = (rx_bytes(ns, ifname)?, Instant::now());
    Ok((b1 - b0) as f64 * 8.0 / (t1 - t0).as_secs_f64())
}
