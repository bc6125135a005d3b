//! `lbagent status [--json]`: the daemon's typed status document
//! ([`StatusDoc`]) with live counters from the maps.

use std::path::Path;

use anyhow::{Context, Result};

use crate::{
    daemon::{api, status::StatusDoc},
    dataplane::tables::Tables,
    naming,
};

pub fn run(socket: &Path, bpffs: &Path, json: bool) -> Result<()> {
    let mut doc: StatusDoc =
        serde_json::from_value(api::request(socket, "status")?).context("the daemon's status document")?;
    add_rule_stats(&mut doc, bpffs);
    add_qos_stats(&mut doc, bpffs);
    if json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    print!("{}", render(&doc));
    Ok(())
}

/// Live per-rule packets/bytes from the pinned maps, keyed by rule key
/// (`doc.rules` maps keys to ids). Skipped when the maps are unreadable.
fn add_rule_stats(doc: &mut StatusDoc, bpffs: &Path) {
    let Ok(stats) = Tables::open(bpffs).and_then(|t| t.rule_stats()) else { return };
    let by_id: std::collections::HashMap<u32, _> = stats.into_iter().collect();
    let out = doc
        .rules
        .iter()
        .filter_map(|(key, id)| {
            let st = by_id.get(id)?;
            Some((key.clone(), *st))
        })
        .collect();
    doc.rule_stats = Some(out);
}

/// Live counters of each bound QoS rule (by bucket), into its entry.
fn add_qos_stats(doc: &mut StatusDoc, bpffs: &Path) {
    let Ok(stats) = Tables::open(bpffs).and_then(|t| t.qos_stats()) else { return };
    for q in doc.nat_gateways.iter_mut().flat_map(|gw| gw.qos.iter_mut()) {
        q.stats = Some(stats.get(&q.rule.bucket).copied().unwrap_or_default());
    }
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
                out += &format!("  error {}: {}\n", e.object, e.error);
            }
        }
    }
    if let Some(p) = &doc.source_problem {
        out += &format!("desired-state source: {p}\n");
    }
    if let Some(r) = &doc.rejected_state {
        out += "newest state file REFUSED (still running the last good one):\n";
        for p in r {
            out += &format!("  {p}\n");
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
                st.acl_drops
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
    for gw in &doc.nat_gateways {
        out += &format!("NAT gateway {} zone {} netns {}\n", gw.name, or_dash(&gw.zone), gw.netns);
        for e in &gw.eips {
            out += &format!(
                "  eip {:<8} {:<15} {}\n",
                e.name,
                e.ip,
                if e.used_by.is_empty() { "unused".into() } else { e.used_by.join("; ") }
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
