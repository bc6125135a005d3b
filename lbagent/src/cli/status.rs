//! `lbagent status [--json]`: the daemon's typed status document
//! ([`StatusDoc`]) with live counters from the maps: those under `--bpffs`
//! when it is given, else under the daemon's own `--bpffs`, read from the
//! command line of the process serving the API socket. Counters that
//! cannot be read are left out, and the output says so and why.

use std::{
    ffi::OsStr,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, anyhow, bail};

use crate::{daemon::status::StatusDoc, dataplane::tables::Tables, naming};

pub fn run(socket: &Path, bpffs: Option<&Path>, json: bool) -> Result<()> {
    let (answer, pid) = ask(socket)?;
    let mut doc: StatusDoc = serde_json::from_value(answer).context("the daemon's status document")?;
    let pins = match bpffs {
        Some(given) => Ok(match daemon_bpffs(pid) {
            Ok(its) if its != given => (given.to_path_buf(), format!("--bpffs; the daemon's is {}", its.display())),
            _ => (given.to_path_buf(), "--bpffs".to_string()),
        }),
        None => daemon_bpffs(pid).map(|its| (its, "the daemon's --bpffs".to_string())),
    };
    let counters = pins.and_then(|(dir, whence)| {
        add_counters(&mut doc, &dir)?;
        Ok(format!("from the pins under {} ({whence})", dir.display()))
    });
    if json {
        if let Err(e) = &counters {
            eprintln!("lbagent status: counters left out: {e:#}");
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    print!("{}", render(&doc));
    match counters {
        Ok(from) => println!("counters: {from}"),
        Err(e) => println!("counters: left out: {e:#}"),
    }
    Ok(())
}

/// One `status` request to the daemon's API, and the pid that answers.
fn ask(socket: &Path) -> Result<(serde_json::Value, Option<i32>)> {
    crate::daemon::api::request_with_peer(socket, "status")
}

/// The `--bpffs` of `lbagent run` as process `pid` was started (parsed by
/// this command line's own parser; relative to its working directory).
fn daemon_bpffs(pid: Option<i32>) -> Result<PathBuf> {
    let pid = pid.context("the API socket gives no peer pid, so the daemon's pins are unknown (give --bpffs)")?;
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
        .with_context(|| format!("the daemon's (pid {pid}) command line"))?;
    let mut args: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
    if args.last().is_some_and(|a| a.is_empty()) {
        args.pop();
    }
    let cli = <super::Cli as clap::Parser>::try_parse_from(args.into_iter().map(OsStr::from_bytes)).map_err(|e| {
        let why = e.to_string();
        anyhow!(
            "the daemon's (pid {pid}) command line is not one this lbagent reads ({}); give --bpffs",
            why.lines().next().unwrap_or_default().trim_start_matches("error: ")
        )
    })?;
    let super::Command::Run { common, .. } = cli.cmd else {
        bail!("the process serving the API socket (pid {pid}) is not `lbagent run`; give --bpffs");
    };
    if common.bpffs.is_absolute() {
        return Ok(common.bpffs);
    }
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"))
        .with_context(|| format!("the daemon's (pid {pid}) directory"))?;
    Ok(cwd.join(common.bpffs))
}

/// Live counters from the pinned maps under `bpffs`: packets and bytes by
/// rule key (`doc.rules` maps keys to ids), and each bound QoS rule's (by
/// bucket) into its entry.
fn add_counters(doc: &mut StatusDoc, bpffs: &Path) -> Result<()> {
    let tables = Tables::open(bpffs)?;
    let by_id: std::collections::HashMap<u32, _> = tables.rule_stats()?.into_iter().collect();
    let qos = tables.qos_stats()?;
    doc.rule_stats = Some(doc.rules.iter().filter_map(|(key, id)| Some((key.to_string(), *by_id.get(&id)?))).collect());
    for q in doc.nat_gateways.iter_mut().flat_map(|gw| gw.qos.iter_mut()) {
        q.stats = Some(qos.get(&q.rule.bucket).copied().unwrap_or_default());
    }
    Ok(())
}

fn or_dash<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map(T::to_string).unwrap_or_else(|| "-".into())
}

pub fn render(doc: &StatusDoc) -> String {
    let mut out = format!("state file: {}\n", doc.state_file);
    if doc.revision_running.is_some() || doc.revision_seen.is_some() {
        out += &format!(
            "revision: running {}, newest seen {}\n",
            or_dash(&doc.revision_running),
            or_dash(&doc.revision_seen)
        );
    }
    match &doc.last_apply {
        None => out += "last apply: none yet\n",
        Some(last) => {
            out += &format!(
                "last apply: {} ({} steps, {} errors) at unix time {}\n",
                if last.ok { "ok" } else { "FAILED" },
                last.steps,
                last.errors.len(),
                or_dash(&last.time)
            );
            for e in &last.errors {
                // The error names its kind first when the step gave one.
                out += &format!("  error {}: {}\n", e.object, e.error);
            }
        }
    }
    if let Some(r) = &doc.repair_pass {
        out += &format!(
            "repair pass: {} of {} objects re-ensured, started at unix time {}\n",
            r.objects_done,
            r.objects,
            or_dash(&r.started)
        );
    }
    if let Some(p) = &doc.source_problem {
        out += &format!("desired-state source: {p}\n");
    }
    if let Some(p) = &doc.alive_problem {
        out += &format!("alive key and status: {p}\n");
    }
    if let Some(r) = &doc.rejected_state {
        out += "newest state file REFUSED (still running the last good one):\n";
        for p in r {
            out += &format!("  {p}\n");
        }
    }

    if let Some(f) = &doc.flow_logs {
        let dropped: Vec<String> =
            f.dropped.by_name().iter().filter(|(_, n)| *n > 0).map(|(k, n)| format!("{k} {n}")).collect();
        out += &format!(
            "flow logs: {}; records: start {} end {}, filtered {}; exported: ipfix {} jsonl {}; dropped: {}; logged flows {}\n",
            if f.running {
                "running".to_string()
            } else {
                format!("NOT running ({})", f.problem.as_deref().unwrap_or("stopped"))
            },
            f.start_records,
            f.end_records,
            f.filtered,
            f.ipfix_sent,
            f.jsonl_written,
            if dropped.is_empty() { "none".to_string() } else { dropped.join(", ") },
            f.logged_flows
        );
    }

    if let Some(h) = &doc.ha {
        for l in ha_lines(h) {
            out += &l;
            out.push('\n');
        }
    }

    let no_stats = Default::default();
    let rule_stats = doc.rule_stats.as_ref().unwrap_or(&no_stats);
    for lb in &doc.load_balancers {
        out += &format!(
            "load balancer {} ({}) zone {} netns {}\n  vip {}  inner {}  outer {}\n  links ovn {} proxy {}\n",
            lb.id,
            or_dash(&lb.name),
            or_dash(&lb.zone),
            lb.netns,
            lb.vip,
            or_dash(&lb.inner),
            or_dash(&lb.outer),
            serde_json::to_string(&lb.links.ovn).unwrap_or_default(),
            serde_json::to_string(&lb.links.proxy).unwrap_or_default()
        );
        for l in &lb.listeners {
            let st = rule_stats.get(&naming::lb_listener_key(&lb.id, &l.id)).copied().unwrap_or_default();
            out += &format!(
                "  listener {:<10} {}/{} {} -> {}  packets {} bytes {} acl drops {}\n",
                l.id,
                serde_name(&l.kind),
                l.port,
                serde_name(&l.mode),
                l.backend_group,
                st.packets,
                st.bytes,
                st.refused
            );
        }
        for b in &lb.backends {
            out += &format!(
                "  backend {:<12} {}:{} weight {} mapped port {}\n",
                b.id,
                b.address,
                b.port,
                b.weight,
                or_dash(&b.mapped_port)
            );
        }
    }
    let ports = doc.snat_ports.as_ref();
    for gw in &doc.nat_gateways {
        out += &format!("NAT gateway {} zone {} netns {}\n", gw.name, or_dash(&gw.zone), gw.netns);
        for e in &gw.eips {
            out += &format!("  eip {:<8} {:<15} {}\n", e.name, e.ip, {
                let lines: Vec<String> = e.used_by.lines().collect();
                if lines.is_empty() { "unused".into() } else { lines.join("; ") }
            });
            let key = naming::gw_eip_key(&gw.name, &e.name);
            if let Some(u) = ports.and_then(|p| p.eips.iter().find(|u| u.eip == key)) {
                out += &format!(
                    "    SNAT ports in use: tcp {}, udp {}, icmp {} ({} % of the range)\n",
                    u.ports.tcp, u.ports.udp, u.ports.icmp, u.share_pct
                );
            }
        }
        let prefix = naming::gw_rule_prefix(&gw.name);
        for r in ports.iter().flat_map(|p| &p.rules).filter(|r| r.rule.starts_with(&prefix)) {
            out += &format!(
                "  {}: flows tcp {}, udp {}, icmp {}; ports tcp {}, udp {}, icmp {} ({} % of the range); no free port {}\n",
                &r.rule[prefix.len()..],
                r.flows.tcp,
                r.flows.udp,
                r.flows.icmp,
                r.ports.tcp,
                r.ports.udp,
                r.ports.icmp,
                r.share_pct,
                r.no_free_port
            );
        }
        for q in &gw.qos {
            let st = q.stats.unwrap_or_default();
            out += &format!(
                "  qos {:<12} {}/{} {} on {}: {} Mbit/s burst {} B  passed {} pkts {} B, marked {} pkts, dropped {} pkts {} B\n",
                q.rule.target,
                q.rule.policy,
                q.rule.rule,
                serde_name(&q.rule.direction),
                q.rule.interface,
                q.rule.rate_bps as f64 / 1e6,
                q.rule.burst_bytes,
                st.passed_packets,
                st.passed_bytes,
                st.marked_packets,
                st.dropped_packets,
                st.dropped_bytes
            );
        }
    }
    out
}

/// An enum's name as the state file spells it (its serde name).
fn serde_name<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        _ => "-".into(),
    }
}

/// The HA pair's lines (`lbagent status`, `lbagent ha status`).
pub fn ha_lines(h: &crate::ha::HaStatus) -> Vec<String> {
    let ms = |v: Option<f64>| v.map(|v| format!("{v:.1} ms")).unwrap_or_else(|| "-".into());
    let peer = match h.peer.last_heard_ms {
        Some(ms) => format!(
            "{} {}{}, heard {ms} ms ago",
            h.peer.address,
            if h.peer.active { "active" } else { "standby" },
            if h.peer.ready { " (ready)" } else { "" }
        ),
        None => format!("{} never heard", h.peer.address),
    };
    let d = &h.dropped;
    let mut lines = vec![
        format!(
            "ha: {}{} on {}; peer {peer}",
            h.role,
            if h.ready { " (ready)" } else { " (NOT ready: no complete bulk pass)" },
            h.listen
        ),
        format!(
            "  synced out {} in {}; bulk passes sent {} received {} (last {}, swept {}); lag p50 {} p99 {}",
            h.synced_out,
            h.synced_in,
            h.bulk_passes_sent,
            h.bulk_passes_received,
            h.last_bulk_received.map(|t| format!("unix {t}")).unwrap_or_else(|| "never".into()),
            h.swept,
            ms(h.lag_ms_p50),
            ms(h.lag_ms_p99)
        ),
        format!(
            "  dropped: ring_full {} feed_full {} send_failed {} refused {} unknown {} table_full {}",
            d.ring_full, d.feed_full, d.send_failed, d.refused, d.unknown, d.table_full
        ),
    ];
    if let Some(p) = &h.problem {
        lines.push(format!("  problem: {p}"));
    }
    lines
}
