//! Namespaces and veth pairs for tests, removed on drop. Uses `ip` (tests may;
//! the agent itself uses rtnetlink).

use std::process::Command;

use anyhow::{Context, Result, bail};

/// Runs a command; error with its output when it fails.
pub fn sh(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("spawning {args:?}"))?;
    if !out.status.success() {
        bail!("{args:?} failed: {}{}", String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs a command inside a namespace (network namespace only: `nsenter --net`,
/// so /sys and bpffs stay the host's).
pub fn in_ns(ns: &str, args: &[&str]) -> Result<String> {
    let netns = format!("--net=/run/netns/{ns}");
    let mut v = vec!["nsenter", netns.as_str(), "--"];
    v.extend_from_slice(args);
    sh(&v)
}

/// A named network namespace, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(name: &str) -> Result<Self> {
        sh(&["ip", "netns", "add", name])?;
        let ns = Netns { name: name.to_string() };
        ns.exec(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn exec(&self, args: &[&str]) -> Result<String> {
        in_ns(&self.name, args)
    }

    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.exec(&["sysctl", "-qw", &format!("{key}={value}")]).map(|_| ())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.name]);
    }
}

/// Connects `a` (interface `a_if` with `a_addr`) and `b` with a veth pair.
pub fn veth(a: &Netns, a_if: &str, a_addr: &str, b: &Netns, b_if: &str, b_addr: &str) -> Result<()> {
    sh(&["ip", "link", "add", a_if, "netns", &a.name, "type", "veth", "peer", "name", b_if, "netns", &b.name])?;
    for (ns, ifn, addr) in [(a, a_if, a_addr), (b, b_if, b_addr)] {
        ns.exec(&["ip", "addr", "add", addr, "dev", ifn])?;
        ns.exec(&["ip", "link", "set", ifn, "up"])?;
    }
    Ok(())
}

/// The MAC address in `ip -br link show` output (its third column).
pub fn mac(brief: &str) -> Result<[u8; 6]> {
    let column = brief.split_whitespace().nth(2).context("no MAC column")?;
    lbagent::state::names::parse_mac(column).map_err(anyhow::Error::msg)
}

/// The MAC address of `ifname` in namespace `ns`.
pub fn mac_in(ns: &str, ifname: &str) -> Result<[u8; 6]> {
    mac(&in_ns(ns, &["ip", "-br", "link", "show", ifname])?)
}

/// The mixed-offload setting every traffic test uses: senders transmit with checksum
/// offload (CHECKSUM_PARTIAL packets reach the dataplane) but do not trust
/// received checksums; the dataplane's veths have tx offload off.
pub fn sender_offloads(ns: &Netns, ifname: &str) -> Result<()> {
    ns.exec(&["ethtool", "-K", ifname, "tx", "on", "rx", "off"]).map(|_| ())
}

pub fn dataplane_offloads(ns: &Netns, ifname: &str) -> Result<()> {
    ns.exec(&["ethtool", "-K", ifname, "tx", "off"]).map(|_| ())
}

/// Turns tx checksum offload off on every interface (but `lo`) of `ns`: the
/// dataplane side of the mixed-offload setting.
pub fn dataplane_offloads_all(ns: &str) -> Result<()> {
    let links = in_ns(ns, &["ip", "-o", "link", "show"])?;
    for line in links.lines() {
        let Some(name) = line.split(": ").nth(1).map(|n| n.split('@').next().unwrap_or(n)) else { continue };
        if name != "lo" {
            in_ns(ns, &["ethtool", "-K", name, "tx", "off"])?;
        }
    }
    Ok(())
}

/// The id of every lbagent program attached in namespace `ns`, by
/// (interface, direction): from each hook's pinned tcx link under the
/// agent's pin root `bpffs` when it has one, else from the netlink filter
/// (`tc filter show`). Two reads that agree mean no program was replaced.
pub fn attached_programs(ns: &str, bpffs: &std::path::Path) -> Result<Vec<(String, &'static str, u32)>> {
    use lbagent::dataplane::{
        attach::{Direction, Hook},
        pins,
    };
    let links: serde_json::Value = serde_json::from_str(&in_ns(ns, &["ip", "-j", "link", "show"])?)?;
    let mut out = Vec::new();
    for ifname in links.as_array().into_iter().flatten().filter_map(|l| l["ifname"].as_str()) {
        for (direction, side) in [(Direction::Ingress, "ingress"), (Direction::Egress, "egress")] {
            let hook = Hook { netns: Some(ns), ifname, direction };
            let pin = pins::links_dir(bpffs).join(hook.link_pin_name());
            let id = if pin.exists() {
                let link: serde_json::Value =
                    serde_json::from_str(&sh(&["bpftool", "-j", "link", "show", "pinned", pin.to_str().unwrap()])?)?;
                link["prog_id"].as_u64()
            } else {
                let filters = in_ns(ns, &["tc", "filter", "show", "dev", ifname, side])?;
                filters
                    .split_whitespace()
                    .skip_while(|w| *w != "lbagent_nat" && !w.starts_with("lbagent_nat_"))
                    .skip_while(|w| *w != "id")
                    .nth(1)
                    .and_then(|id| id.parse().ok())
            };
            if let Some(id) = id {
                out.push((ifname.to_string(), side, id as u32));
            }
        }
    }
    Ok(out)
}
