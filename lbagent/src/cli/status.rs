//! `lbagent status [--json]`.

use std::path::Path;

use anyhow::Result;
use serde_json::Value;

use crate::{daemon::api, dataplane::tables::Tables};

pub fn run(socket: &Path, bpffs: &Path, json: bool) -> Result<()> {
    let mut doc = api::request(socket, "status")?;
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
/// (`doc["rules"]` maps keys to ids). Skipped when the maps are unreadable.
fn add_rule_stats(doc: &mut Value, bpffs: &Path) {
    let Ok(stats) = Tables::open(bpffs).and_then(|t| t.rule_stats()) else { return };
    let by_id: std::collections::HashMap<u32, _> = stats.into_iter().collect();
    let mut out = serde_json::Map::new();
    for (key, id) in doc["rules"].as_object().cloned().unwrap_or_default() {
        if let Some(st) = id.as_u64().and_then(|id| by_id.get(&(id as u32))) {
            out.insert(key, serde_json::json!({"packets": st.packets, "bytes": st.bytes, "acl_drops": st.acl_drops}));
        }
    }
    doc["rule_stats"] = Value::Object(out);
}

/// Live counters of each bound QoS rule (by bucket), into its entry.
fn add_qos_stats(doc: &mut Value, bpffs: &Path) {
    let Ok(stats) = Tables::open(bpffs).and_then(|t| t.qos_stats()) else { return };
    for gw in doc["nat_gateways"].as_array_mut().into_iter().flatten() {
        for q in gw["qos"].as_array_mut().into_iter().flatten() {
            let st = q["bucket"].as_u64().and_then(|b| stats.get(&(b as u32))).copied().unwrap_or_default();
            q["stats"] = serde_json::json!({
                "passed_packets": st.passed_packets, "passed_bytes": st.passed_bytes,
                "marked_packets": st.marked_packets, "marked_bytes": st.marked_bytes,
                "dropped_packets": st.dropped_packets, "dropped_bytes": st.dropped_bytes,
            });
        }
    }
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        v => v.to_string(),
    }
}

pub fn render(doc: &Value) -> String {
    let mut out = format!("state file: {}\n", s(&doc["state_file"]));
    if !doc["revision_running"].is_null() || !doc["revision_seen"].is_null() {
        out +=
            &format!("revision: running {}, newest seen {}\n", s(&doc["revision_running"]), s(&doc["revision_seen"]));
    }
    let last = &doc["last_apply"];
    if last.is_null() {
        out += "last apply: none yet\n";
    } else {
        out += &format!(
            "last apply: {} ({} steps, {} errors) at unix time {}\n",
            if last["ok"].as_bool() == Some(true) { "ok" } else { "FAILED" },
            s(&last["steps"]),
            last["errors"].as_array().map(|a| a.len()).unwrap_or(0),
            s(&last["time"])
        );
        for e in last["errors"].as_array().into_iter().flatten() {
            out += &format!("  error {}: {}\n", s(&e["object"]), s(&e["error"]));
        }
    }
    if let Some(r) = doc["rejected_state"].as_array() {
        out += "newest state file REFUSED (still running the last good one):\n";
        for p in r {
            out += &format!("  {}\n", s(p));
        }
    }
    for lb in doc["load_balancers"].as_array().into_iter().flatten() {
        out += &format!(
            "load balancer {} ({}) zone {} netns {}\n  vip {}  inner {}  outer {}\n  links ovn {} proxy {}\n",
            s(&lb["id"]),
            s(&lb["name"]),
            s(&lb["zone"]),
            s(&lb["netns"]),
            s(&lb["vip"]),
            s(&lb["inner"]),
            s(&lb["outer"]),
            s(&lb["links"]["ovn"]),
            s(&lb["links"]["proxy"])
        );
        for l in lb["listeners"].as_array().into_iter().flatten() {
            let st = &doc["rule_stats"][crate::naming::lb_listener_key(&s(&lb["id"]), &s(&l["id"]))];
            out += &format!(
                "  listener {:<10} {}/{} {} -> {}  packets {} bytes {} acl drops {}\n",
                s(&l["id"]),
                s(&l["type"]),
                s(&l["port"]),
                s(&l["mode"]),
                s(&l["backend_group"]),
                st["packets"].as_u64().unwrap_or(0),
                st["bytes"].as_u64().unwrap_or(0),
                st["acl_drops"].as_u64().unwrap_or(0)
            );
        }
        for b in lb["backends"].as_array().into_iter().flatten() {
            out += &format!(
                "  backend {:<12} {}:{} weight {} mapped port {}\n",
                s(&b["id"]),
                s(&b["address"]),
                s(&b["port"]),
                s(&b["weight"]),
                s(&b["mapped_port"])
            );
        }
    }
    for gw in doc["nat_gateways"].as_array().into_iter().flatten() {
        out += &format!("NAT gateway {} zone {} netns {}\n", s(&gw["name"]), s(&gw["zone"]), s(&gw["netns"]));
        for e in gw["eips"].as_array().into_iter().flatten() {
            let used: Vec<String> = e["used_by"].as_array().into_iter().flatten().map(s).collect();
            out += &format!(
                "  eip {:<8} {:<15} {}\n",
                s(&e["name"]),
                s(&e["ip"]),
                if used.is_empty() { "unused".into() } else { used.join("; ") }
            );
        }
        for q in gw["qos"].as_array().into_iter().flatten() {
            let st = &q["stats"];
            let n = |k: &str| st[k].as_u64().unwrap_or(0);
            out += &format!(
                "  qos {:<12} {}/{} {} on {}: {} Mbit/s burst {} B  passed {} pkts {} B, marked {} pkts, dropped {} pkts {} B\n",
                s(&q["target"]),
                s(&q["policy"]),
                s(&q["rule"]),
                s(&q["direction"]),
                s(&q["interface"]),
                q["rate_bps"].as_u64().unwrap_or(0) as f64 / 1e6,
                s(&q["burst_bytes"]),
                n("passed_packets"),
                n("passed_bytes"),
                n("marked_packets"),
                n("dropped_packets"),
                n("dropped_bytes")
            );
        }
    }
    out
}
