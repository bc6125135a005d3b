//! The document `lbagent status` shows, built from what was applied and
//! what was allocated.

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};

pub use crate::outcome::ObjectError;
use crate::{
    alloc::{Allocations, RuleIds},
    dataplane::tables::{PerProto, PortCensus},
    naming,
    outcome::Changes,
    reconcile::{Applied, ApplyReport},
    state::{
        Problems,
        spec::{Gw, ListenerMode, ListenerType, cidr_text},
    },
};

/// The status document: built by the daemon, served by the API, read by
/// `lbagent status` and the metrics endpoint. Field names are the JSON
/// contract (`lbagent status --json`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusDoc {
    pub state_file: String,
    /// Revision label of the newest document the source gave (accepted or not).
    pub revision_seen: Option<String>,
    /// Revision label of the document running (the last accepted one).
    pub revision_running: Option<String>,
    /// Applies done since start.
    pub applies: u64,
    pub last_apply: Option<LastApply>,
    /// The repair pass under way (a pass over many objects runs in slices
    /// between the daemon's other work).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repair_pass: Option<RepairProgress>,
    /// Problems of the newest document when it was refused.
    pub rejected_state: Option<Vec<String>>,
    /// Why the desired-state source gives no new documents right now (etcd
    /// unreachable or refusing this agent's credentials, a cached document
    /// too old to apply); the running state stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_problem: Option<String>,
    /// Fleet mode: why this agent does not hold its alive key or cannot
    /// write its status (held by another agent, lost, etcd refusing the
    /// lease or the status write). Reported beside `source_problem`, never
    /// in its place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alive_problem: Option<String>,
    pub load_balancers: Vec<LbStatus>,
    pub nat_gateways: Vec<GwStatus>,
    /// Rule key → rule id: the allocations' own maps, shared (a change
    /// copies the map of the object it changes).
    pub rules: RuleIds,
    /// Backends failing their health checks: `<lb>/<listener>/<backend>`.
    #[serde(default)]
    pub backends_down: Vec<String>,
    /// Live counters by rule key (added by `lbagent status` from the maps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule_stats: Option<BTreeMap<String, lbagent_common::RuleStats>>,
    /// The direct-mode health prober: running, or why not; its counters.
    #[serde(default)]
    pub health_prober: crate::lb::health::ProberReport,
    /// SNAT port usage, as the last conntrack pass found it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snat_ports: Option<Arc<SnatPorts>>,
    /// The flow logger (`agent.flow_logs`): its records and what it lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_logs: Option<crate::flow_log::FlowLogStatus>,
    /// This host's side of an HA pair (`agent.ha`): role, peer, sync.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ha: Option<crate::ha::HaStatus>,
}

/// SNAT port usage: what each EIP's SNAT'ed flows hold, what each SNAT rule
/// carries and refused. Only EIPs and rules with flows or refusals are
/// listed; labelled by object and rule, never by client.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SnatPorts {
    /// Unix time (s) of the conntrack pass that counted them.
    pub as_of: u64,
    /// Ports in a SNAT rule's range (`1024-65535`).
    pub range: u64,
    pub eips: Vec<EipPorts>,
    pub rules: Vec<SnatRulePorts>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EipPorts {
    /// `natgw/<gw>/eip/<name>`.
    pub eip: String,
    pub ip: Ipv4Addr,
    /// Distinct source ports (ICMP: echo ids) its SNAT'ed flows hold.
    pub ports: crate::dataplane::tables::PerProto,
    /// The busiest protocol's ports, in % of the range.
    pub share_pct: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnatRulePorts {
    /// The rule's key (`natgw/<gw>/snat/<net>/<len>`), shared with the
    /// rule map.
    pub rule: Arc<str>,
    /// Its live flows (each holds a port toward its destination).
    pub flows: crate::dataplane::tables::PerProto,
    /// Distinct source ports (ICMP: echo ids) its flows hold.
    pub ports: crate::dataplane::tables::PerProto,
    /// The busiest protocol's ports, in % of the range.
    pub share_pct: f64,
    /// New flows it dropped for want of a free port, since the rule began.
    pub no_free_port: u64,
}

/// What the port census needs of the running objects, copied from the
/// status under its lock and read outside it (`SnatPorts::of`).
pub struct SnatNames {
    /// The CIDR SNAT rules: id → key.
    pub rules: BTreeMap<u32, Arc<str>>,
    /// Each EIP: its key and address.
    pub eips: Vec<(String, Ipv4Addr)>,
}

impl SnatNames {
    /// From the status document's rule map and gateways.
    pub fn of(rules: &RuleIds, gws: &[GwStatus]) -> SnatNames {
        SnatNames {
            rules: rules.iter().filter(|(k, _)| naming::is_gw_snat_key(k)).map(|(k, id)| (id, k.clone())).collect(),
            eips: gws
                .iter()
                .flat_map(|g| g.eips.iter().map(move |e| (naming::gw_eip_key(&g.name, &e.name), e.ip)))
                .collect(),
        }
    }
}

impl SnatPorts {
    /// A conntrack pass's census (of the rules in `names`) and the SNAT
    /// rules' refusals (`refused`, by rule id) at Unix time `as_of`, named.
    pub fn of(census: &PortCensus, refused: &BTreeMap<u32, u64>, names: &SnatNames, as_of: u64) -> SnatPorts {
        let range = u64::from(crate::natgw::rules::SNAT_PORTS.1 - crate::natgw::rules::SNAT_PORTS.0) + 1;
        let share = |p: &PerProto| (p.max() as f64 * 1000.0 / range as f64).round() / 10.0;
        let listed = |(id, key): (&u32, &Arc<str>)| {
            let count = census.rule(*id).copied().unwrap_or_default();
            let no_free_port = refused.get(id).copied().unwrap_or(0);
            (count.flows != PerProto::default() || no_free_port > 0).then(|| SnatRulePorts {
                rule: key.clone(),
                flows: count.flows,
                ports: count.ports,
                share_pct: share(&count.ports),
                no_free_port,
            })
        };
        // Sized once: at 50 000 busy rules a doubling vector held 1.6 MB
        // of spare room as long as the status kept it.
        let mut rules = Vec::with_capacity(names.rules.iter().filter_map(listed).count());
        rules.extend(names.rules.iter().filter_map(listed));
        let eips = names
            .eips
            .iter()
            .filter_map(|(eip, ip)| {
                let ports = census.eip(*ip)?;
                Some(EipPorts { eip: eip.clone(), ip: *ip, ports, share_pct: share(&ports) })
            })
            .collect();
        SnatPorts { as_of, range, eips, rules }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LastApply {
    /// Unix time (s) the apply started.
    pub time: Option<u64>,
    pub ok: bool,
    pub steps: usize,
    pub changes: Changes,
    pub errors: Vec<ObjectError>,
}

/// How far the repair pass under way has got.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RepairProgress {
    /// Unix time (s) the pass started.
    pub started: Option<u64>,
    /// Objects re-ensured so far, of `objects`.
    pub objects_done: usize,
    pub objects: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LbStatus {
    pub id: String,
    pub name: Option<String>,
    pub zone: Option<u16>,
    pub netns: String,
    pub vip: Ipv4Addr,
    pub links: LbLinks,
    pub iface_id: String,
    pub inner: Option<Ipv4Addr>,
    pub outer: Option<Ipv4Addr>,
    pub listeners: Vec<ListenerStatus>,
    pub backends: Vec<BackendStatus>,
}

/// Veth pairs: `[inside the namespace, host side]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LbLinks {
    pub ovn: [String; 2],
    pub proxy: [String; 2],
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ListenerStatus {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: ListenerType,
    pub port: u16,
    pub mode: ListenerMode,
    pub backend_group: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BackendStatus {
    pub id: String,
    pub group: String,
    pub address: Ipv4Addr,
    pub port: u16,
    pub weight: u32,
    pub mapped_port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GwStatus {
    pub name: String,
    pub zone: Option<u16>,
    pub netns: String,
    pub lan_ip: Ipv4Addr,
    pub eips: Vec<EipStatus>,
    pub qos: Vec<QosRuleStatus>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EipStatus {
    pub name: String,
    pub ip: Ipv4Addr,
    pub qos_policy: Option<String>,
    /// `fip -> <ip>`, `dnat tcp 2222 -> <ip>:<port>`, `snat <cidr>`.
    pub used_by: UsedBy,
}

/// What uses an EIP, one line per rule. The daemon keeps the gateway's
/// applied spec (shared, not a copy) and writes the lines only when the
/// document is serialized: at 100 000 rules the lines, kept between
/// applies, were ~11 MB of the agent's memory. A reader of the document
/// gets the lines.
#[derive(Clone)]
pub enum UsedBy {
    /// The rules of `gw` that name its EIP `gw.eips[eip]`.
    Spec { gw: Arc<Gw>, eip: usize },
    /// As read back from a document.
    Lines(Vec<String>),
}

impl UsedBy {
    /// One line per rule using the EIP: FIPs, then DNAT rules, then SNAT
    /// rules, each in the document's order.
    pub fn lines(&self) -> Box<dyn Iterator<Item = String> + '_> {
        match self {
            UsedBy::Lines(lines) => Box::new(lines.iter().cloned()),
            UsedBy::Spec { gw, eip } => {
                let name = gw.eips.get(*eip).map_or("", |e| e.name.as_str());
                let fips =
                    gw.fips.iter().filter(move |f| f.eip.name == name).map(|f| format!("fip -> {}", f.internal_ip));
                let dnats = gw.dnats.iter().filter(move |d| d.eip.name == name).map(|d| {
                    format!("dnat {} {} -> {}:{}", d.protocol, d.external_port, d.internal_ip, d.internal_port)
                });
                let snats = gw
                    .snats
                    .iter()
                    .filter(move |s| s.eip.name == name)
                    .map(|s| format!("snat {}", cidr_text(&s.internal_cidr)));
                Box::new(fips.chain(dnats).chain(snats))
            }
        }
    }
}

impl Serialize for UsedBy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.lines())
    }
}

impl<'de> Deserialize<'de> for UsedBy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::deserialize(d).map(UsedBy::Lines)
    }
}

impl PartialEq for UsedBy {
    fn eq(&self, other: &Self) -> bool {
        self.lines().eq(other.lines())
    }
}

impl std::fmt::Debug for UsedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.lines()).finish()
    }
}

/// A bound QoS rule instance (one bucket).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QosRuleStatus {
    #[serde(flatten)]
    pub rule: crate::natgw::qos::Bound,
    /// Live counters (added by `lbagent status` from the maps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats: Option<lbagent_common::QosStats>,
}

/// The daemon's status: the document (whose source, revision, apply and
/// refusal fields the daemon writes as they happen) and the reverse maps
/// metrics need (rule names come from the document's `rules`).
#[derive(Clone, Default)]
pub struct Status {
    pub document: StatusDoc,
    /// QoS bucket → rule-instance key (`natgw/<gw>/qos/...`), for metrics.
    pub qos_names: BTreeMap<u32, String>,
    /// Zone → object key (`lb/<id>`, `natgw/<name>`), for metrics.
    pub zone_names: BTreeMap<u16, String>,
}

pub fn secs(t: Option<SystemTime>) -> Option<u64> {
    t.and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map(|d| d.as_secs())
}

impl LastApply {
    pub fn of(r: &ApplyReport) -> Self {
        LastApply {
            time: secs(r.started),
            ok: r.ok(),
            steps: r.steps,
            changes: r.changes.clone(),
            errors: r.errors.clone(),
        }
    }
}

impl Status {
    /// Records a refused document's problems (`None`: the newest was accepted).
    pub fn set_rejected(&mut self, problems: Option<&Problems>) {
        self.document.rejected_state = problems.map(|p| p.0.iter().map(|x| x.to_string()).collect());
    }

    /// Recomputes what derives from the applied objects and the allocations
    /// (after an apply or a refused reload).
    pub fn refresh(&mut self, applied: &Applied, alloc: &Allocations) {
        self.qos_names = alloc.qos_buckets.iter().map(|(k, b)| (*b, k.clone())).collect();
        self.zone_names = alloc.zones.iter().map(|(k, z)| (*z, k.clone())).collect();
        let lbs = applied
            .lbs
            .values()
            .map(|lb| {
                let a = alloc.lbs.get(&lb.id);
                let backends = lb
                    .backends()
                    .map(|(g, b)| BackendStatus {
                        id: b.id.clone(),
                        group: g.id.clone(),
                        address: b.addr,
                        port: b.port,
                        weight: b.weight,
                        mapped_port: a.and_then(|a| a.ports.get(&b.id)).copied(),
                    })
                    .collect();
                let (o0, o1) = naming::lb_ovn_veth(&lb.id);
                let (h0, h1) = naming::lb_host_veth(&lb.id);
                LbStatus {
                    id: lb.id.clone(),
                    name: lb.name.clone(),
                    zone: alloc.zones.get(&naming::lb_zone_key(&lb.id)).copied(),
                    netns: naming::lb_netns(&lb.id),
                    vip: lb.network.ip,
                    links: LbLinks { ovn: [o0, o1], proxy: [h0, h1] },
                    iface_id: naming::lb_iface_id(&lb.id),
                    inner: a.map(|a| a.inner),
                    outer: a.map(|a| a.outer),
                    listeners: lb
                        .listeners
                        .iter()
                        .map(|l| ListenerStatus {
                            id: l.id.clone(),
                            kind: l.kind,
                            port: l.port,
                            mode: l.mode,
                            backend_group: l.group.id.clone(),
                        })
                        .collect(),
                    backends,
                }
            })
            .collect();
        let gws = applied
            .gws
            .values()
            .map(|g| {
                let eips = g
                    .eips
                    .iter()
                    .enumerate()
                    .map(|(i, e)| EipStatus {
                        name: e.name.clone(),
                        ip: e.ip,
                        qos_policy: e.policy.as_ref().map(|p| p.name.clone()),
                        used_by: UsedBy::Spec { gw: Arc::clone(g), eip: i },
                    })
                    .collect();
                let qos = crate::natgw::qos::bound(g, alloc)
                    .into_iter()
                    .map(|rule| QosRuleStatus { rule, stats: None })
                    .collect();
                GwStatus {
                    name: g.name.clone(),
                    zone: alloc.zones.get(&naming::gw_zone_key(&g.name)).copied(),
                    netns: naming::gw_netns(&g.name),
                    lan_ip: g.lan.ip,
                    eips,
                    qos,
                }
            })
            .collect();
        let d = &mut self.document;
        d.load_balancers = lbs;
        d.nat_gateways = gws;
        d.rules = alloc.rule_ids.clone();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eips_users_are_written_from_the_spec_and_read_back_as_lines() {
        let doc =
            crate::state::load_str(include_str!("../../../examples/state.yaml"), crate::state::Format::Yaml).unwrap();
        let desired = crate::state::Desired::from_state(&doc).unwrap();
        let gw = desired.gws.values().next().expect("the example has a NAT gateway").clone();
        let used: Vec<UsedBy> = (0..gw.eips.len()).map(|eip| UsedBy::Spec { gw: gw.clone(), eip }).collect();
        let lines: Vec<Vec<String>> = used.iter().map(|u| u.lines().collect()).collect();
        // Every rule of the gateway is a line of its EIP's, FIPs first.
        let rules = gw.fips.len() + gw.dnats.len() + gw.snats.len();
        assert_eq!(lines.iter().map(Vec::len).sum::<usize>(), rules);
        assert!(lines.iter().flatten().any(|l| l.starts_with("fip -> ")), "{lines:?}");
        assert!(lines.iter().flatten().any(|l| l.starts_with("dnat tcp ")), "{lines:?}");
        assert!(lines.iter().flatten().any(|l| l.starts_with("snat ")), "{lines:?}");
        // Serialized, they are a list of strings; read back, the same lines.
        for (u, l) in used.iter().zip(&lines) {
            let json = serde_json::to_string(u).unwrap();
            assert_eq!(json, serde_json::to_string(l).unwrap());
            let back: UsedBy = serde_json::from_str(&json).unwrap();
            assert!(matches!(back, UsedBy::Lines(_)));
            assert_eq!(&back, u);
        }
    }
}
