//! `lbagent status [--json]`.

use std::path::Path;

use anyhow::Result;
use serde_json::Value;

use crate::daemon::api;

pub fn run(socket: &Path, json: bool) -> Result<()> {
    let doc = api::request(socket, "status")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    print!("{}", render(&doc));
    Ok(())
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
    }
    out
}
