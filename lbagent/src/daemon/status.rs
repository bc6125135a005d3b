//! The document `lbagent status` shows, built from what was applied and
//! what was allocated.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::{
    alloc::Allocations,
    naming,
    reconcile::{Applied, ApplyReport},
    state::Problems,
};

#[derive(Clone, Default)]
pub struct Status {
    pub state_file: String,
    /// Revision label of the newest document the source gave (accepted or not).
    pub revision_seen: Option<String>,
    /// Revision label of the document running (the last accepted one).
    pub revision_running: Option<String>,
    /// Applies done since start.
    pub applies: u64,
    pub last_apply: Option<ApplyReport>,
    /// Problems of the newest state file when it was refused.
    pub rejected: Option<Problems>,
    pub document: Value,
    /// Rule id → rule key (`natgw/<gw>/fip/<eip>`, `lb/<id>/listener/<l>` …), for metrics.
    pub rule_names: std::collections::BTreeMap<u32, String>,
    /// QoS bucket → rule-instance key (`natgw/<gw>/qos/...`), for metrics.
    pub qos_names: std::collections::BTreeMap<u32, String>,
}

fn secs(t: Option<SystemTime>) -> Value {
    t.and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map(|d| json!(d.as_secs())).unwrap_or(Value::Null)
}

impl Status {
    /// Recomputes the document after an apply or a refused reload.
    pub fn refresh(&mut self, applied: &Applied, alloc: &Allocations) {
        self.rule_names = alloc.rule_ids.iter().map(|(k, id)| (*id, k.clone())).collect();
        self.qos_names = alloc.qos_buckets.iter().map(|(k, b)| (*b, k.clone())).collect();
        let lbs: Vec<Value> = applied
            .lbs
            .values()
            .map(|lb| {
                let a = alloc.lbs.get(&lb.id);
                let backends: Vec<Value> = lb
                    .backend_groups
                    .iter()
                    .flat_map(|g| g.backends.iter().map(move |b| (g, b)))
                    .map(|(g, b)| {
                        json!({"id": b.id, "group": g.id, "address": b.address, "port": b.port, "weight": b.weight,
                               "mapped_port": a.and_then(|a| a.ports.get(&b.id))})
                    })
                    .collect();
                let (o0, o1) = naming::lb_ovn_veth(&lb.id);
                let (h0, h1) = naming::lb_host_veth(&lb.id);
                json!({
                    "id": lb.id, "name": lb.name, "zone": alloc.zones.get(&naming::lb_zone_key(&lb.id)),
                    "netns": naming::lb_netns(&lb.id), "vip": lb.network.ip,
                    "links": {"ovn": [o0, o1], "proxy": [h0, h1]},
                    "iface_id": naming::lb_iface_id(&lb.id),
                    "inner": a.map(|a| a.inner.to_string()), "outer": a.map(|a| a.outer.to_string()),
                    "listeners": lb.listeners.iter().map(|l| json!({"id": l.id, "type": l.kind, "port": l.port,
                        "mode": l.effective_mode(), "backend_group": l.backend_group})).collect::<Vec<_>>(),
                    "backends": backends,
                })
            })
            .collect();
        let gws: Vec<Value> = applied
            .gws
            .values()
            .map(|g| {
                let eips: Vec<Value> = g
                    .eips
                    .iter()
                    .map(|e| {
                        let mut used_by = Vec::new();
                        used_by.extend(
                            g.fips.iter().filter(|f| f.eip == e.name).map(|f| format!("fip -> {}", f.internal_ip)),
                        );
                        used_by.extend(g.dnats.iter().filter(|d| d.eip == e.name).map(|d| {
                            format!("dnat {} {} -> {}:{}", d.protocol, d.external_port, d.internal_ip, d.internal_port)
                        }));
                        used_by.extend(
                            g.snats.iter().filter(|s| s.eip == e.name).map(|s| format!("snat {}", s.internal_cidr)),
                        );
                        json!({"name": e.name, "ip": e.ip, "qos_policy": e.qos_policy, "used_by": used_by})
                    })
                    .collect();
                let policies = applied.gw_qos.get(&g.name).map(Vec::as_slice).unwrap_or_default();
                let qos: Vec<Value> = crate::natgw::qos::bound(g, policies, alloc)
                    .iter()
                    .map(|b| {
                        json!({"key": b.key, "bucket": b.bucket, "target": b.target, "policy": b.policy,
                               "rule": b.rule, "direction": b.direction, "interface": b.interface,
                               "rate_bps": b.rate_bps, "burst_bytes": b.burst_bytes})
                    })
                    .collect();
                json!({"name": g.name, "zone": alloc.zones.get(&naming::gw_zone_key(&g.name)),
                       "netns": naming::gw_netns(&g.name), "lan_ip": g.lan.ip, "eips": eips, "qos": qos})
            })
            .collect();
        let last = self.last_apply.as_ref().map(|r| {
            json!({"time": secs(r.started), "ok": r.ok(), "steps": r.steps, "changes": r.changes,
                   "errors": r.errors.iter().map(|(o, e)| json!({"object": o, "error": e})).collect::<Vec<_>>()})
        });
        self.document = json!({
            "state_file": self.state_file,
            "revision_seen": self.revision_seen,
            "revision_running": self.revision_running,
            "applies": self.applies,
            "last_apply": last,
            "rejected_state": self.rejected.as_ref().map(|p| p.0.iter().map(|x| x.to_string()).collect::<Vec<_>>()),
            "load_balancers": lbs,
            "nat_gateways": gws,
            "rules": alloc.rule_ids,
        });
    }
}
