//! `lbagent maps [NAME] [--json]`: decode the pinned maps.

use std::path::Path;

use anyhow::{Result, bail};
use lbagent_common::*;
use serde_json::{Map as JsonMap, Value, json};

use super::format::{self as fmt, ip, proto_name};
use crate::dataplane::{migrate::FROM_VERSION, pins, tables::Tables};

pub fn run(bpffs: &Path, name: Option<&str>, as_json: bool) -> Result<()> {
    if let Some(n) = name
        && !ALL_MAPS.contains(&n)
    {
        bail!("unknown map {n:?}; maps are: {}", ALL_MAPS.join(", "));
    }
    // `meta` alone needs no compatible pins: it says which layout they are.
    let tables = if name == Some(MAP_META) { None } else { Some(Tables::open(bpffs)?) };
    let mut out = JsonMap::new();
    for map in ALL_MAPS.iter().filter(|m| name.is_none_or(|n| n == **m)) {
        let (text, value) = match &tables {
            _ if *map == MAP_META => meta(bpffs),
            Some(tables) => render(tables, map)?,
            None => unreachable!("the tables are open for every map but meta"),
        };
        if as_json {
            out.insert(map.to_string(), value);
        } else {
            println!("== {map} ==");
            print!("{text}");
        }
    }
    if as_json {
        println!("{}", serde_json::to_string_pretty(&Value::Object(out))?);
    }
    Ok(())
}

/// One map as text lines and as JSON.
pub fn render(t: &Tables, map: &str) -> Result<(String, Value)> {
    let mut text = String::new();
    let value = match map {
        MAP_CT | MAP_CT_NEW => {
            let now = fmt::monotonic_ns();
            let mut entries = t.conntrack_table(map)?;
            entries.sort_by_key(|(k, e)| (k.zone, e.flags & CT_F_REPLY, k.saddr, k.sport, k.daddr, k.dport));
            for (k, e) in &entries {
                text += &format!("{}\n", fmt::ct_line(k, e, now));
            }
            Value::Array(entries.iter().map(|(k, e)| fmt::ct_json(k, e, now)).collect())
        }
        MAP_FRAGS => {
            let now = fmt::monotonic_ns();
            let mut arr = Vec::new();
            for (k, v) in t.fragments()? {
                let age = now.saturating_sub(v.seen_ns) / 1_000_000_000;
                text += &format!(
                    "zone {:<3} {} {} -> {} id {} ports {}/{} age {age}s\n",
                    k.zone,
                    proto_name(k.proto),
                    ip(k.saddr),
                    ip(k.daddr),
                    k.id,
                    v.sport,
                    v.dport
                );
                arr.push(json!({"zone": k.zone, "proto": proto_name(k.proto), "src": ip(k.saddr).to_string(),
                                "dst": ip(k.daddr).to_string(), "id": k.id, "sport": v.sport, "dport": v.dport,
                                "age_s": age}));
            }
            Value::Array(arr)
        }
        MAP_ACL_RULES => {
            let mut arr = Vec::new();
            for (len, k) in t.acl_entries()? {
                let cidr = format!("{}/{}", ip(k.addr), len - ACL_KEY_FIXED_BITS);
                text += &format!("rule {:<6} {cidr}\n", k.rule_id);
                arr.push(json!({"rule_id": k.rule_id, "cidr": cidr}));
            }
            Value::Array(arr)
        }
        MAP_DNAT_BACKENDS => {
            let mut arr = Vec::new();
            for (k, b) in t.backends()? {
                text += &format!("rule {:<6} #{:<3} {}:{}\n", k.rule_id, k.index, ip(b.addr), b.port);
                arr.push(
                    json!({"rule_id": k.rule_id, "index": k.index, "addr": ip(b.addr).to_string(), "port": b.port}),
                );
            }
            Value::Array(arr)
        }
        MAP_DNAT_RULES => {
            let rules = t.dnat_rules()?;
            let mut arr = Vec::new();
            for (k, r, bs) in &rules {
                let backends: Vec<String> = bs
                    .iter()
                    .map(|b| format!("{}:{}", ip(b.addr), if b.port == 0 { "*".into() } else { b.port.to_string() }))
                    .collect();
                let port = if k.port == 0 { "*".to_string() } else { k.port.to_string() };
                text += &format!(
                    "zone {:<3} {} {}:{} rule {} -> [{}]\n",
                    k.zone,
                    proto_name(k.proto),
                    ip(k.addr),
                    port,
                    r.rule_id,
                    backends.join(", ")
                );
                arr.push(json!({"zone": k.zone, "proto": proto_name(k.proto), "addr": ip(k.addr).to_string(),
                                "port": k.port, "rule_id": r.rule_id, "backends": backends}));
            }
            Value::Array(arr)
        }
        MAP_SNAT_RULES => {
            let mut arr = Vec::new();
            for (len, k, r) in t.snat_rules()? {
                let cidr = format!("{}/{}", ip(k.addr), len - SNAT_KEY_FIXED_BITS);
                let mut mode = if r.flags & SNAT_F_RANDOM != 0 { "random" } else { "keep-port" }.to_string();
                if r.flags & SNAT_F_PORT_CLASS != 0 {
                    mode += ",port-class";
                }
                text += &format!(
                    "zone {:<3} if {:<4} src {:<18} -> {} ports {}-{} {} rule {}\n",
                    k.zone,
                    k.ifindex,
                    cidr,
                    ip(r.addr),
                    r.port_min,
                    r.port_max,
                    mode,
                    r.rule_id
                );
                arr.push(json!({"zone": k.zone, "ifindex": k.ifindex, "src": cidr, "to": ip(r.addr).to_string(),
                                "port_min": r.port_min, "port_max": r.port_max, "mode": mode, "rule_id": r.rule_id}));
            }
            Value::Array(arr)
        }
        MAP_NAT_CONFIG => {
            let c = t.config()?;
            text += &format!("{c:?}\n");
            json!({"tcp_new_s": c.tcp_new_s, "tcp_established_s": c.tcp_established_s, "tcp_closing_s": c.tcp_closing_s,
                   "udp_s": c.udp_s, "udp_stream_s": c.udp_stream_s, "icmp_s": c.icmp_s, "other_s": c.other_s})
        }
        MAP_COUNTERS => {
            let mut obj = JsonMap::new();
            for (c, v) in t.counters()? {
                text += &format!("{:<24} {v}\n", c.name());
                obj.insert(c.name().into(), v.into());
            }
            Value::Object(obj)
        }
        MAP_RULE_STATS => {
            let mut arr = Vec::new();
            for (id, st) in t.rule_stats()? {
                text += &format!(
                    "rule {id:<6} packets {:<10} bytes {:<12} acl drops {}\n",
                    st.packets, st.bytes, st.acl_drops
                );
                arr.push(json!({"rule_id": id, "packets": st.packets, "bytes": st.bytes, "acl_drops": st.acl_drops}));
            }
            Value::Array(arr)
        }
        MAP_QOS_ZONES => {
            let d = t.qos_dump()?;
            let mut arr = Vec::new();
            for (z, info) in &d.zones {
                let [ingress, egress] = info.eip_ifindex;
                text += &format!(
                    "zone {z:<4} EIP rules: ingress ifindex {ingress}, egress ifindex {egress}; hooks with gateway rules {}\n",
                    info.hooks
                );
                arr.push(json!({"zone": z, "eip_ingress_ifindex": ingress, "eip_egress_ifindex": egress, "hooks": info.hooks}));
            }
            Value::Array(arr)
        }
        MAP_QOS_HOOKS => {
            let d = t.qos_dump()?;
            let mut arr = Vec::new();
            for (k, h) in &d.hooks {
                let dir = if k.dir == QOS_INGRESS { "ingress" } else { "egress" };
                text += &format!("zone {:<4} ifindex {:<3} {dir:<7}\n", k.zone, k.ifindex);
                let mut rules = Vec::new();
                for r in h.rules.iter().take((h.count as usize).min(QOS_HOOK_RULES)) {
                    let what = match r.kind {
                        QOS_MATCH_SRC => format!("src {}/{}", ip(r.addr), r.prefix_len),
                        QOS_MATCH_DST => format!("dst {}/{}", ip(r.addr), r.prefix_len),
                        _ => "all".to_string(),
                    };
                    text += &format!("  priority {:<5} {what:<22} bucket {}\n", r.priority, r.bucket);
                    rules.push(json!({"priority": r.priority, "match": what, "bucket": r.bucket}));
                }
                arr.push(json!({"zone": k.zone, "ifindex": k.ifindex, "direction": dir, "rules": rules}));
            }
            Value::Array(arr)
        }
        MAP_QOS_EIPS => {
            let d = t.qos_dump()?;
            let mut arr = Vec::new();
            for (k, e) in &d.eips {
                let dir = if k.dir == QOS_INGRESS { "ingress" } else { "egress" };
                let first = e.flags & QOS_EIP_F_FIRST != 0;
                text += &format!(
                    "zone {:<4} {dir:<7} {:<15} priority {:<5} bucket {}{}\n",
                    k.zone,
                    ip(k.addr),
                    e.priority,
                    e.bucket,
                    if first { " (before every gateway rule)" } else { "" }
                );
                arr.push(
                    json!({"zone": k.zone, "direction": dir, "eip": ip(k.addr).to_string(), "priority": e.priority,
                                "bucket": e.bucket, "before_gateway_rules": first}),
                );
            }
            Value::Array(arr)
        }
        MAP_QOS_CONFIG => {
            let d = t.qos_dump()?;
            let mut arr = Vec::new();
            for (id, c) in &d.config {
                text += &format!(
                    "bucket {id:<6} rate {} bit/s burst {} ns mark {} ns headroom {} ns early gap {} ns\n",
                    c.rate_bps, c.burst_ns, c.mark_ns, c.headroom_ns, c.early_gap_ns
                );
                arr.push(json!({"bucket": id, "rate_bps": c.rate_bps, "burst_ns": c.burst_ns, "mark_ns": c.mark_ns,
                                "headroom_ns": c.headroom_ns, "early_gap_ns": c.early_gap_ns}));
            }
            Value::Array(arr)
        }
        MAP_QOS_STATE => {
            let d = t.qos_dump()?;
            let now = fmt::monotonic_ns();
            let mut arr = Vec::new();
            for (id, b) in &d.state {
                let backlog = b.clock_ns.saturating_sub(now);
                text += &format!("bucket {id:<6} backlog {backlog} ns\n");
                arr.push(json!({"bucket": id, "clock_ns": b.clock_ns, "backlog_ns": backlog, "last_early_ns": b.last_early_ns}));
            }
            Value::Array(arr)
        }
        MAP_QOS_DROPS => {
            let d = t.qos_dump()?;
            let now = fmt::monotonic_ns();
            let mut arr = Vec::new();
            for (k, v) in &d.drops {
                let (sport, dport) = (u16::from_be_bytes(k.sport), u16::from_be_bytes(k.dport));
                let ago = now.saturating_sub(v.at_ns);
                text += &format!(
                    "bucket {:<6} {}:{sport} -> {}:{dport} dropped up to seq {} {ago} ns ago\n",
                    k.bucket,
                    ip(k.saddr),
                    ip(k.daddr),
                    v.end_seq
                );
                arr.push(
                    json!({"bucket": k.bucket, "saddr": ip(k.saddr).to_string(), "daddr": ip(k.daddr).to_string(),
                                "sport": sport, "dport": dport, "end_seq": v.end_seq, "ago_ns": ago}),
                );
            }
            Value::Array(arr)
        }
        MAP_QOS_STATS => {
            let mut arr = Vec::new();
            for (id, s) in t.qos_stats()? {
                text += &format!(
                    "bucket {id:<6} passed {} pkts {} B  marked {} pkts {} B  dropped {} pkts {} B\n",
                    s.passed_packets,
                    s.passed_bytes,
                    s.marked_packets,
                    s.marked_bytes,
                    s.dropped_packets,
                    s.dropped_bytes
                );
                arr.push(json!({"bucket": id, "passed_packets": s.passed_packets, "passed_bytes": s.passed_bytes,
                                "marked_packets": s.marked_packets, "marked_bytes": s.marked_bytes,
                                "dropped_packets": s.dropped_packets, "dropped_bytes": s.dropped_bytes}));
            }
            Value::Array(arr)
        }
        MAP_SCHED_TABLES => {
            // Each table summarised: how many of its slots each backend has.
            let mut arr = Vec::new();
            for rule in t.sched_rules()? {
                let table = t.sched_table(rule)?.unwrap_or_default();
                let mut slots: std::collections::BTreeMap<(std::net::Ipv4Addr, u16), u32> = Default::default();
                for target in &table {
                    *slots.entry(*target).or_default() += 1;
                }
                let list: Vec<String> = slots.iter().map(|((a, p), n)| format!("{a}:{p} {n}")).collect();
                text += &format!("rule {rule:<6} {} slots: {}\n", table.len(), list.join(", "));
                let backends: Vec<Value> =
                    slots.iter().map(|((a, p), n)| json!({"addr": a.to_string(), "port": p, "slots": n})).collect();
                arr.push(json!({"rule_id": rule, "size": table.len(), "backends": backends}));
            }
            Value::Array(arr)
        }
        MAP_SCHED_TURNS => {
            let mut arr = Vec::new();
            for (rule, per_cpu) in t.sched_turns()? {
                // Stored as the next position plus one; 0: not started.
                let next: Vec<Option<u32>> = per_cpu.iter().map(|&v| v.checked_sub(1)).collect();
                let shown: Vec<String> = next.iter().map(|n| n.map_or("-".to_string(), |n| n.to_string())).collect();
                text += &format!("rule {rule:<6} next position per CPU [{}]\n", shown.join(", "));
                arr.push(json!({"rule_id": rule, "per_cpu": next}));
            }
            Value::Array(arr)
        }
        MAP_SCHED_ACTIVE => {
            let mut arr = Vec::new();
            for (k, v) in t.least_entries()? {
                text += &format!(
                    "rule {:<6} {}:{} weight {} active {}\n",
                    k.rule_id,
                    ip(k.addr),
                    k.port,
                    v.weight,
                    v.active
                );
                arr.push(json!({"rule_id": k.rule_id, "addr": ip(k.addr).to_string(), "port": k.port,
                                "weight": v.weight, "active": v.active}));
            }
            Value::Array(arr)
        }
        MAP_PROXY_GUARD => {
            let g = t.proxy_guard()?;
            let uid = g.filter(|g| g.flags & PROXY_GUARD_F_UID != 0).map(|g| g.uid);
            text += &match (g, uid) {
                (None, _) => "not loaded (no load balancer yet)\n".to_string(),
                (_, Some(uid)) => format!("opens allowed for root and uid {uid}\n"),
                (_, None) => "opens allowed for root only\n".to_string(),
            };
            json!({"loaded": g.is_some(), "uid": uid})
        }
        MAP_PROXY_GUARD_DROPS => {
            let n = t.proxy_guard_drops()?;
            text += &format!("dropped {n}\n");
            json!({"dropped": n})
        }
        MAP_EGRESS_MTU => {
            let mut arr = Vec::new();
            for (k, mtu) in t.egress_mtus()? {
                text += &format!("zone {:<3} ifindex {:<5} mtu {mtu}\n", k.zone, k.ifindex);
                arr.push(json!({"zone": k.zone, "ifindex": k.ifindex, "mtu": mtu}));
            }
            Value::Array(arr)
        }
        MAP_ZONE_CT_LIMITS | MAP_ZONE_CT_FLOWS | MAP_ZONE_CT_REFUSED => {
            let mut arr = Vec::new();
            for (zone, z) in t.zone_ct()? {
                let (est, new) = match map {
                    MAP_ZONE_CT_LIMITS => (u64::from(z.limits.established), u64::from(z.limits.new)),
                    MAP_ZONE_CT_FLOWS => (z.flows.established, z.flows.new),
                    _ => (z.refused.established, z.refused.new),
                };
                if map != MAP_ZONE_CT_FLOWS && est == 0 && new == 0 {
                    continue;
                }
                text += &format!("zone {zone:<5} established {est:<9} new {new}\n");
                arr.push(json!({"zone": zone, "established": est, "new": new}));
            }
            Value::Array(arr)
        }
        MAP_META => bail!("`{MAP_META}` describes the pin directory, not the tables: see `maps::meta`"),
        other => bail!("unknown map {other}"),
    };
    Ok((text, value))
}

/// `maps meta`: the layout each version directory's pinned `meta` map
/// records, the newest of them (the pinned layout) and whether it is this
/// build's ([`LAYOUT_VERSION`]), with what this build does with it.
pub fn meta(bpffs: &Path) -> (String, Value) {
    let mut dirs = pins::version_dirs(bpffs);
    dirs.sort();
    let mut text = String::new();
    let mut listed = Vec::new();
    let mut pinned: Option<u32> = None;
    for (v, dir) in &dirs {
        let (recorded, state, what) = match pins::meta_version(bpffs, *v) {
            Ok(None) => (None, "no meta", "no meta map".to_string()),
            Err(e) => (None, "unreadable", format!("meta unreadable: {e:#}")),
            Ok(Some(0)) => (Some(0), "unrecorded", "layout not recorded yet".to_string()),
            Ok(Some(r)) if r == *v => (Some(r), "live", format!("records layout {r}: live")),
            Ok(Some(r)) if r > *v => {
                (Some(r), "marker", format!("records layout {r}: a marker (its maps were migrated to layout {r})"))
            }
            Ok(Some(r)) => (Some(r), "inconsistent", format!("records layout {r}, older than its directory")),
        };
        if let Some(r) = recorded.filter(|r| *r != 0) {
            pinned = pinned.max(Some(r));
        }
        text += &format!("{}: {what}\n", dir.display());
        listed.push(json!({"version": v, "path": dir.display().to_string(), "recorded": recorded, "state": state}));
    }
    let here = LAYOUT_VERSION;
    text += &match pinned {
        None => format!("nothing pinned under {} (this lbagent: layout {here})\n", bpffs.display()),
        Some(p) if p == here => format!("pinned layout {p}, the same as this lbagent's\n"),
        Some(p) => {
            let consequence = if p > here {
                "this lbagent refuses to start on these pins (a downgrade)".to_string()
            } else if p == FROM_VERSION {
                "this lbagent migrates them when it starts".to_string()
            } else {
                format!("this lbagent refuses them (it migrates only layout {FROM_VERSION})")
            };
            format!("pinned layout {p}, NOT this lbagent's layout {here}: {consequence}\n")
        }
    };
    let value = json!({"layout_version": pinned, "binary_layout_version": here, "same": pinned == Some(here),
                       "directories": listed});
    (text, value)
}
