//! `lbagent maps`: each map's entries as rows. A row type per map derives
//! its JSON (serde) and writes its text line (`Display`); [`VIEWS`] pairs
//! each map's definition with the function that reads its rows, so
//! `maps::render` is one lookup.

use std::{
    collections::BTreeMap,
    fmt::{self, Display, Formatter},
    net::Ipv4Addr,
};

use anyhow::Result;
use lbagent_common::*;
use serde::Serialize;
use serde_json::Value;

use super::format::{CtRow, ip, proto_name};
use crate::dataplane::tables::Tables;

/// A map as shown: its text lines and its JSON.
pub struct Shown {
    pub text: String,
    pub json: Value,
}

/// Rows shown as one line each and as a JSON array.
fn rows<R: Serialize + Display>(rows: impl IntoIterator<Item = R>) -> Result<Shown> {
    let mut text = String::new();
    let mut json = Vec::new();
    for r in rows {
        text += &format!("{r}\n");
        json.push(serde_json::to_value(&r)?);
    }
    Ok(Shown { text, json: Value::Array(json) })
}

/// A map with one value, shown as one line and a JSON object.
fn single<R: Serialize + Display>(r: R) -> Result<Shown> {
    Ok(Shown { text: format!("{r}\n"), json: serde_json::to_value(&r)? })
}

/// Reads a map's rows from the tables, at `now` (monotonic ns).
type View = fn(&Tables, u64) -> Result<Shown>;

/// Every map `lbagent maps` decodes from the tables (`meta` describes the
/// pin directory instead: `maps::meta`).
pub const VIEWS: [(&str, View); 34] = [
    (MAP_CT.name, |t, now| rows(sorted_ct(t.conntrack_table(MAP_CT)?).iter().map(|(k, e)| CtRow::new(k, e, now)))),
    (MAP_CT_NEW.name, |t, now| {
        rows(sorted_ct(t.conntrack_table(MAP_CT_NEW)?).iter().map(|(k, e)| CtRow::new(k, e, now)))
    }),
    (MAP_CT_PREV.name, |t, now| {
        rows(sorted_ct(t.previous_conntrack(MAP_CT_PREV)?).iter().map(|(k, e)| CtRow::new(k, e, now)))
    }),
    (MAP_CT_NEW_PREV.name, |t, now| {
        rows(sorted_ct(t.previous_conntrack(MAP_CT_NEW_PREV)?).iter().map(|(k, e)| CtRow::new(k, e, now)))
    }),
    (MAP_CT_ADOPT.name, |t, _| single(AdoptRow { adopting: t.adopting()? })),
    // The programs' own room: nothing to show but that it is there.
    (MAP_CT_ADOPT_SCRATCH.name, |t, _| {
        t.per_cpu_array(MAP_CT_ADOPT_SCRATCH)?;
        single(ScratchRow { cpus: crate::dataplane::tables::possible_cpus()? })
    }),
    (MAP_FRAGS.name, |t, now| rows(t.fragments()?.iter().map(|(k, v)| FragRow::new(k, v, now)))),
    (MAP_DNAT_RULES.name, |t, _| rows(t.dnat_rules()?.iter().map(|(k, r, bs)| DnatRuleRow::new(k, r, bs)))),
    (MAP_DNAT_BACKENDS.name, |t, _| rows(t.backends()?.iter().map(|(k, b)| BackendRow::new(k, b)))),
    (MAP_SNAT_RULES.name, |t, _| rows(t.snat_rules()?.iter().map(|(len, k, r)| SnatRow::new(*len, k, r)))),
    (MAP_ACL_RULES.name, |t, _| rows(t.acl_entries()?.iter().map(|(len, k)| AclRow::new(*len, k)))),
    (MAP_NAT_CONFIG.name, |t, _| single(NatConfigRow::new(t.config()?))),
    (MAP_COUNTERS.name, |t, _| counters(t)),
    (MAP_RULE_STATS.name, |t, _| rows(t.rule_stats()?.iter().map(|(id, s)| RuleStatsRow::new(*id, s)))),
    (MAP_QOS_ZONES.name, |t, _| rows(t.qos_dump()?.zones.iter().map(|(z, i)| QosZoneRow::new(*z, i)))),
    (MAP_QOS_HOOKS.name, |t, _| rows(t.qos_dump()?.hooks.iter().map(|(k, h)| QosHookRow::new(k, h)))),
    (MAP_QOS_EIPS.name, |t, _| rows(t.qos_dump()?.eips.iter().map(|(k, e)| QosEipRow::new(k, e)))),
    (MAP_QOS_CONFIG.name, |t, _| rows(t.qos_dump()?.config.iter().map(|(b, c)| QosConfigRow::new(*b, c)))),
    (MAP_QOS_STATE.name, |t, now| rows(t.qos_dump()?.state.iter().map(|(b, s)| QosStateRow::new(*b, s, now)))),
    (MAP_QOS_DROPS.name, |t, now| rows(t.qos_dump()?.drops.iter().map(|(k, d)| QosDropRow::new(k, d, now)))),
    (MAP_QOS_STATS.name, |t, _| rows(t.qos_stats()?.iter().map(|(b, s)| QosStatsRow::new(*b, s)))),
    (MAP_SCHED_TABLES.name, |t, _| {
        let tables: Vec<_> = t.sched_rules()?.into_iter().map(|r| Ok((r, t.sched_table(r)?))).collect::<Result<_>>()?;
        rows(tables.into_iter().map(|(r, table)| SchedTableRow::new(r, &table.unwrap_or_default())))
    }),
    (MAP_SCHED_TURNS.name, |t, _| rows(t.sched_turns()?.iter().map(|(r, per_cpu)| SchedTurnRow::new(*r, per_cpu)))),
    (MAP_SCHED_ACTIVE.name, |t, _| rows(t.least_entries()?.iter().map(|(k, v)| ActiveRow::new(k, v)))),
    (MAP_PROXY_GUARD.name, |t, _| single(ProxyGuardRow::new(t.proxy_guard()?))),
    (MAP_PROXY_GUARD_DROPS.name, |t, _| single(ProxyGuardDropsRow { dropped: t.proxy_guard_drops()? })),
    (MAP_EGRESS_MTU.name, |t, _| rows(t.egress_mtus()?.iter().map(|(k, mtu)| MtuRow::new(k, *mtu)))),
    (MAP_ZONE_CT_LIMITS.name, |t, _| {
        let zones = t.zone_ct()?;
        rows(
            zones
                .iter()
                .map(|(z, c)| ZoneCtRow::new(*z, c.limits.established.into(), c.limits.new.into()))
                .filter(ZoneCtRow::set),
        )
    }),
    (MAP_ZONE_CT_FLOWS.name, |t, _| {
        rows(t.zone_ct()?.iter().map(|(z, c)| ZoneCtRow::new(*z, c.flows.established, c.flows.new)))
    }),
    (MAP_ZONE_CT_REFUSED.name, |t, _| {
        let zones = t.zone_ct()?;
        rows(zones.iter().map(|(z, c)| ZoneCtRow::new(*z, c.refused.established, c.refused.new)).filter(ZoneCtRow::set))
    }),
    (MAP_FLOW_LOG_ZONES.name, |t, _| rows(t.flow_log_zones()?.iter().map(|(z, v)| FlowLogZoneRow::new(*z, v)))),
    (MAP_FLOW_ACCT.name, |t, now| {
        let mut out = Vec::new();
        t.each_flow_acct(|keys, values| {
            out.extend(keys.iter().zip(values).map(|(k, a)| FlowAcctRow::new(k, a, now)));
        })?;
        out.sort_by(|a, b| a.line.cmp(&b.line));
        rows(out)
    }),
    (MAP_FLOW_LOG_SCRATCH.name, |t, _| {
        t.per_cpu_array(MAP_FLOW_LOG_SCRATCH)?;
        single(ScratchRow { cpus: crate::dataplane::tables::possible_cpus()? })
    }),
    // A ring the logger consumes: records are not kept to be listed.
    (MAP_FLOW_EVENTS.name, |_, _| single(RingRow { bytes: FLOW_EVENTS_BYTES })),
];

fn sorted_ct(mut entries: Vec<(Tuple, CtEntry)>) -> Vec<(Tuple, CtEntry)> {
    entries.sort_by_key(|(k, e)| (k.zone, e.flags & CT_F_REPLY, k.saddr, k.sport, k.daddr, k.dport));
    entries
}

/// Counters: a line each, one JSON object by name.
fn counters(t: &Tables) -> Result<Shown> {
    let mut text = String::new();
    let mut json = serde_json::Map::new();
    for (c, v) in t.counters()? {
        text += &format!("{:<24} {v}\n", c.name());
        json.insert(c.name().into(), v.into());
    }
    Ok(Shown { text, json: Value::Object(json) })
}

/// `*` for 0 (any port), else the port.
fn port_or_any(p: u16) -> String {
    if p == 0 { "*".into() } else { p.to_string() }
}

fn direction(dir: u8) -> &'static str {
    if dir == QOS_INGRESS { "ingress" } else { "egress" }
}

/// `ct_adopt`: whether an upgrade's programs adopt the previous layout's flows.
#[derive(Serialize)]
struct AdoptRow {
    adopting: bool,
}

impl Display for AdoptRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        if self.adopting {
            write!(f, "adopting the flows of ct_prev and ct_new_prev (an upgrade is switching zones over)")
        } else {
            write!(f, "not adopting (no upgrade under way)")
        }
    }
}

/// `ct_adopt_scratch`, `flow_log_scratch`: per-CPU room the programs
/// build values in.
#[derive(Serialize)]
struct ScratchRow {
    cpus: usize,
}

impl Display for ScratchRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "the programs' room to build entries in, one per CPU ({} CPUs)", self.cpus)
    }
}

#[derive(Serialize)]
struct FragRow {
    zone: u16,
    proto: String,
    src: String,
    dst: String,
    id: u16,
    sport: u16,
    dport: u16,
    age_s: u64,
}

impl FragRow {
    fn new(k: &FragKey, v: &FragEntry, now: u64) -> Self {
        FragRow {
            zone: k.zone,
            proto: proto_name(k.proto),
            src: ip(k.saddr).to_string(),
            dst: ip(k.daddr).to_string(),
            id: k.id,
            sport: v.sport,
            dport: v.dport,
            age_s: now.saturating_sub(v.seen_ns) / 1_000_000_000,
        }
    }
}

impl Display for FragRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let FragRow { zone, proto, src, dst, id, sport, dport, age_s } = self;
        write!(f, "zone {zone:<3} {proto} {src} -> {dst} id {id} ports {sport}/{dport} age {age_s}s")
    }
}

#[derive(Serialize)]
struct AclRow {
    rule_id: u32,
    cidr: String,
}

impl AclRow {
    fn new(len: u32, k: &AclKey) -> Self {
        AclRow { rule_id: k.rule_id, cidr: format!("{}/{}", ip(k.addr), len - ACL_KEY_FIXED_BITS) }
    }
}

impl Display for AclRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "rule {:<6} {}", self.rule_id, self.cidr)
    }
}

#[derive(Serialize)]
struct BackendRow {
    rule_id: u32,
    index: u32,
    addr: String,
    port: u16,
}

impl BackendRow {
    fn new(k: &BackendKey, b: &Backend) -> Self {
        BackendRow { rule_id: k.rule_id, index: k.index, addr: ip(b.addr).to_string(), port: b.port }
    }
}

impl Display for BackendRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "rule {:<6} #{:<3} {}:{}", self.rule_id, self.index, self.addr, self.port)
    }
}

#[derive(Serialize)]
struct DnatRuleRow {
    zone: u16,
    proto: String,
    addr: String,
    port: u16,
    rule_id: u32,
    backends: Vec<String>,
}

impl DnatRuleRow {
    fn new(k: &DnatKey, r: &DnatRule, bs: &[Backend]) -> Self {
        DnatRuleRow {
            zone: k.zone,
            proto: proto_name(k.proto),
            addr: ip(k.addr).to_string(),
            port: k.port,
            rule_id: r.rule_id,
            backends: bs.iter().map(|b| format!("{}:{}", ip(b.addr), port_or_any(b.port))).collect(),
        }
    }
}

impl Display for DnatRuleRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let DnatRuleRow { zone, proto, addr, port, rule_id, backends } = self;
        write!(f, "zone {zone:<3} {proto} {addr}:{} rule {rule_id} -> [{}]", port_or_any(*port), backends.join(", "))
    }
}

#[derive(Serialize)]
struct SnatRow {
    zone: u16,
    ifindex: u32,
    src: String,
    to: String,
    port_min: u16,
    port_max: u16,
    mode: String,
    rule_id: u32,
}

impl SnatRow {
    fn new(len: u32, k: &SnatKey, r: &SnatRule) -> Self {
        let mut mode = if r.flags & SNAT_F_RANDOM != 0 { "random" } else { "keep-port" }.to_string();
        if r.flags & SNAT_F_PORT_CLASS != 0 {
            mode += ",port-class";
        }
        SnatRow {
            zone: k.zone,
            ifindex: k.ifindex,
            src: format!("{}/{}", ip(k.addr), len - SNAT_KEY_FIXED_BITS),
            to: ip(r.addr).to_string(),
            port_min: r.port_min,
            port_max: r.port_max,
            mode,
            rule_id: r.rule_id,
        }
    }
}

impl Display for SnatRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let SnatRow { zone, ifindex, src, to, port_min, port_max, mode, rule_id } = self;
        write!(
            f,
            "zone {zone:<3} if {ifindex:<4} src {src:<18} -> {to} ports {port_min}-{port_max} {mode} rule {rule_id}"
        )
    }
}

#[derive(Serialize)]
struct NatConfigRow {
    #[serde(skip)]
    raw: NatConfig,
    tcp_new_s: u32,
    tcp_established_s: u32,
    tcp_closing_s: u32,
    udp_s: u32,
    udp_stream_s: u32,
    icmp_s: u32,
    other_s: u32,
}

impl NatConfigRow {
    fn new(c: NatConfig) -> Self {
        NatConfigRow {
            raw: c,
            tcp_new_s: c.tcp_new_s,
            tcp_established_s: c.tcp_established_s,
            tcp_closing_s: c.tcp_closing_s,
            udp_s: c.udp_s,
            udp_stream_s: c.udp_stream_s,
            icmp_s: c.icmp_s,
            other_s: c.other_s,
        }
    }
}

impl Display for NatConfigRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.raw)
    }
}

#[derive(Serialize)]
struct RuleStatsRow {
    rule_id: u32,
    packets: u64,
    bytes: u64,
    refused: u64,
}

impl RuleStatsRow {
    fn new(rule_id: u32, s: &RuleStats) -> Self {
        RuleStatsRow { rule_id, packets: s.packets, bytes: s.bytes, refused: s.refused }
    }
}

impl Display for RuleStatsRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let RuleStatsRow { rule_id, packets, bytes, refused } = self;
        write!(f, "rule {rule_id:<6} packets {packets:<10} bytes {bytes:<12} refused {refused}")
    }
}

#[derive(Serialize)]
struct QosZoneRow {
    zone: u32,
    eip_ingress_ifindex: u32,
    eip_egress_ifindex: u32,
    hooks: u32,
}

impl QosZoneRow {
    fn new(zone: u32, i: &QosZoneInfo) -> Self {
        let [eip_ingress_ifindex, eip_egress_ifindex] = i.eip_ifindex;
        QosZoneRow { zone, eip_ingress_ifindex, eip_egress_ifindex, hooks: i.hooks }
    }
}

impl Display for QosZoneRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let QosZoneRow { zone, eip_ingress_ifindex, eip_egress_ifindex, hooks } = self;
        write!(
            f,
            "zone {zone:<4} EIP rules: ingress ifindex {eip_ingress_ifindex}, egress ifindex {eip_egress_ifindex}; \
             hooks with gateway rules {hooks}"
        )
    }
}

/// A hook and its rules: a line for the hook, an indented line per rule.
#[derive(Serialize)]
struct QosHookRow {
    zone: u16,
    ifindex: u32,
    direction: &'static str,
    rules: Vec<QosHookRule>,
}

#[derive(Serialize)]
struct QosHookRule {
    priority: u32,
    #[serde(rename = "match")]
    matches: String,
    bucket: u32,
}

impl QosHookRow {
    fn new(k: &QosHookKey, h: &QosHook) -> Self {
        let rules = h
            .rules
            .iter()
            .take((h.count as usize).min(QOS_HOOK_RULES))
            .map(|r| QosHookRule {
                priority: r.priority,
                matches: match r.kind {
                    QOS_MATCH_SRC => format!("src {}/{}", ip(r.addr), r.prefix_len),
                    QOS_MATCH_DST => format!("dst {}/{}", ip(r.addr), r.prefix_len),
                    _ => "all".to_string(),
                },
                bucket: r.bucket,
            })
            .collect();
        QosHookRow { zone: k.zone, ifindex: k.ifindex, direction: direction(k.dir), rules }
    }
}

impl Display for QosHookRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "zone {:<4} ifindex {:<3} {:<7}", self.zone, self.ifindex, self.direction)?;
        for r in &self.rules {
            write!(f, "\n  priority {:<5} {:<22} bucket {}", r.priority, r.matches, r.bucket)?;
        }
        Ok(())
    }
}

#[derive(Serialize)]
struct QosEipRow {
    zone: u16,
    direction: &'static str,
    eip: String,
    priority: u32,
    bucket: u32,
    before_gateway_rules: bool,
}

impl QosEipRow {
    fn new(k: &QosEipKey, e: &QosEip) -> Self {
        QosEipRow {
            zone: k.zone,
            direction: direction(k.dir),
            eip: ip(k.addr).to_string(),
            priority: e.priority,
            bucket: e.bucket,
            before_gateway_rules: e.flags & QOS_EIP_F_FIRST != 0,
        }
    }
}

impl Display for QosEipRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let QosEipRow { zone, direction, eip, priority, bucket, before_gateway_rules } = self;
        let first = if *before_gateway_rules { " (before every gateway rule)" } else { "" };
        write!(f, "zone {zone:<4} {direction:<7} {eip:<15} priority {priority:<5} bucket {bucket}{first}")
    }
}

#[derive(Serialize)]
struct QosConfigRow {
    bucket: u32,
    rate_bps: u64,
    burst_ns: u64,
    mark_ns: u64,
    headroom_ns: u64,
    early_gap_ns: u64,
}

impl QosConfigRow {
    fn new(bucket: u32, c: &QosConfig) -> Self {
        QosConfigRow {
            bucket,
            rate_bps: c.rate_bps,
            burst_ns: c.burst_ns,
            mark_ns: c.mark_ns,
            headroom_ns: c.headroom_ns,
            early_gap_ns: c.early_gap_ns,
        }
    }
}

impl Display for QosConfigRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let QosConfigRow { bucket, rate_bps, burst_ns, mark_ns, headroom_ns, early_gap_ns } = self;
        write!(
            f,
            "bucket {bucket:<6} rate {rate_bps} bit/s burst {burst_ns} ns mark {mark_ns} ns headroom {headroom_ns} ns \
             early gap {early_gap_ns} ns"
        )
    }
}

#[derive(Serialize)]
struct QosStateRow {
    bucket: u32,
    clock_ns: u64,
    backlog_ns: u64,
    last_early_ns: u64,
}

impl QosStateRow {
    fn new(bucket: u32, b: &QosBucket, now: u64) -> Self {
        QosStateRow {
            bucket,
            clock_ns: b.clock_ns,
            backlog_ns: b.clock_ns.saturating_sub(now),
            last_early_ns: b.last_early_ns,
        }
    }
}

impl Display for QosStateRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "bucket {:<6} backlog {} ns", self.bucket, self.backlog_ns)
    }
}

#[derive(Serialize)]
struct QosDropRow {
    bucket: u32,
    saddr: String,
    daddr: String,
    sport: u16,
    dport: u16,
    end_seq: u32,
    ago_ns: u64,
}

impl QosDropRow {
    fn new(k: &QosDropKey, v: &QosDrop, now: u64) -> Self {
        QosDropRow {
            bucket: k.bucket,
            saddr: ip(k.saddr).to_string(),
            daddr: ip(k.daddr).to_string(),
            sport: u16::from_be_bytes(k.sport),
            dport: u16::from_be_bytes(k.dport),
            end_seq: v.end_seq,
            ago_ns: now.saturating_sub(v.at_ns),
        }
    }
}

impl Display for QosDropRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let QosDropRow { bucket, saddr, daddr, sport, dport, end_seq, ago_ns } = self;
        write!(f, "bucket {bucket:<6} {saddr}:{sport} -> {daddr}:{dport} dropped up to seq {end_seq} {ago_ns} ns ago")
    }
}

#[derive(Serialize)]
struct QosStatsRow {
    bucket: u32,
    passed_packets: u64,
    passed_bytes: u64,
    marked_packets: u64,
    marked_bytes: u64,
    dropped_packets: u64,
    dropped_bytes: u64,
}

impl QosStatsRow {
    fn new(bucket: u32, s: &QosStats) -> Self {
        QosStatsRow {
            bucket,
            passed_packets: s.passed_packets,
            passed_bytes: s.passed_bytes,
            marked_packets: s.marked_packets,
            marked_bytes: s.marked_bytes,
            dropped_packets: s.dropped_packets,
            dropped_bytes: s.dropped_bytes,
        }
    }
}

impl Display for QosStatsRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let s = self;
        write!(
            f,
            "bucket {:<6} passed {} pkts {} B  marked {} pkts {} B  dropped {} pkts {} B",
            s.bucket,
            s.passed_packets,
            s.passed_bytes,
            s.marked_packets,
            s.marked_bytes,
            s.dropped_packets,
            s.dropped_bytes
        )
    }
}

/// A scheduler table summarised: how many of its slots each backend has.
#[derive(Serialize)]
struct SchedTableRow {
    rule_id: u32,
    size: usize,
    backends: Vec<SchedSlots>,
}

#[derive(Serialize)]
struct SchedSlots {
    addr: String,
    port: u16,
    slots: u32,
}

impl SchedTableRow {
    fn new(rule_id: u32, table: &[(Ipv4Addr, u16)]) -> Self {
        let mut slots: BTreeMap<(Ipv4Addr, u16), u32> = BTreeMap::new();
        for target in table {
            *slots.entry(*target).or_default() += 1;
        }
        let backends = slots.into_iter().map(|((a, port), slots)| SchedSlots { addr: a.to_string(), port, slots });
        SchedTableRow { rule_id, size: table.len(), backends: backends.collect() }
    }
}

impl Display for SchedTableRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let list: Vec<String> = self.backends.iter().map(|b| format!("{}:{} {}", b.addr, b.port, b.slots)).collect();
        write!(f, "rule {:<6} {} slots: {}", self.rule_id, self.size, list.join(", "))
    }
}

#[derive(Serialize)]
struct SchedTurnRow {
    rule_id: u32,
    /// The next position on each CPU (`None`: not started).
    per_cpu: Vec<Option<u32>>,
}

impl SchedTurnRow {
    fn new(rule_id: u32, per_cpu: &[u32]) -> Self {
        // Stored as the next position plus one; 0: not started.
        SchedTurnRow { rule_id, per_cpu: per_cpu.iter().map(|&v| v.checked_sub(1)).collect() }
    }
}

impl Display for SchedTurnRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let shown: Vec<String> = self.per_cpu.iter().map(|n| n.map_or("-".to_string(), |n| n.to_string())).collect();
        write!(f, "rule {:<6} next position per CPU [{}]", self.rule_id, shown.join(", "))
    }
}

#[derive(Serialize)]
struct ActiveRow {
    rule_id: u32,
    addr: String,
    port: u16,
    weight: u32,
    active: i64,
}

impl ActiveRow {
    fn new(k: &ActiveKey, v: &Active) -> Self {
        ActiveRow { rule_id: k.rule_id, addr: ip(k.addr).to_string(), port: k.port, weight: v.weight, active: v.active }
    }
}

impl Display for ActiveRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let ActiveRow { rule_id, addr, port, weight, active } = self;
        write!(f, "rule {rule_id:<6} {addr}:{port} weight {weight} active {active}")
    }
}

#[derive(Serialize)]
struct ProxyGuardRow {
    loaded: bool,
    uid: Option<u32>,
}

impl ProxyGuardRow {
    fn new(g: Option<ProxyGuard>) -> Self {
        ProxyGuardRow { loaded: g.is_some(), uid: g.filter(|g| g.flags & PROXY_GUARD_F_UID != 0).map(|g| g.uid) }
    }
}

impl Display for ProxyGuardRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match (self.loaded, self.uid) {
            (false, _) => write!(f, "not loaded (no load balancer yet)"),
            (_, Some(uid)) => write!(f, "opens allowed for root and uid {uid}"),
            (_, None) => write!(f, "opens allowed for root only"),
        }
    }
}

#[derive(Serialize)]
struct ProxyGuardDropsRow {
    dropped: u64,
}

impl Display for ProxyGuardDropsRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "dropped {}", self.dropped)
    }
}

#[derive(Serialize)]
struct MtuRow {
    zone: u16,
    ifindex: u32,
    mtu: u32,
}

impl MtuRow {
    fn new(k: &MtuKey, mtu: u32) -> Self {
        MtuRow { zone: k.zone, ifindex: k.ifindex, mtu }
    }
}

impl Display for MtuRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "zone {:<3} ifindex {:<5} mtu {}", self.zone, self.ifindex, self.mtu)
    }
}

/// One zone's share (limits), flows or refusals, by table.
#[derive(Serialize)]
struct ZoneCtRow {
    zone: u16,
    established: u64,
    new: u64,
}

impl ZoneCtRow {
    fn new(zone: u16, established: u64, new: u64) -> Self {
        ZoneCtRow { zone, established, new }
    }

    /// Limits and refusals are shown only where set (every zone has flows).
    fn set(&self) -> bool {
        self.established != 0 || self.new != 0
    }
}

impl Display for ZoneCtRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "zone {:<5} established {:<9} new {}", self.zone, self.established, self.new)
    }
}

/// `flow_log_zones`: what a zone logs.
#[derive(Serialize)]
struct FlowLogZoneRow {
    zone: u16,
    start: bool,
    end: bool,
    /// One new flow in `sample`.
    sample: u32,
}

impl FlowLogZoneRow {
    fn new(zone: u16, z: &FlowLogZone) -> Self {
        FlowLogZoneRow {
            zone,
            start: z.flags & FLOW_LOG_START != 0,
            end: z.flags & FLOW_LOG_END != 0,
            sample: z.sample.max(1),
        }
    }
}

impl Display for FlowLogZoneRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let what = match (self.start, self.end) {
            (true, true) => "start and end",
            (true, false) => "start",
            (false, true) => "end",
            (false, false) => "nothing",
        };
        write!(f, "zone {:<5} logs {what} records of 1 flow in {}", self.zone, self.sample)
    }
}

/// `flow_acct`: a logged flow's counts.
#[derive(Serialize)]
struct FlowAcctRow {
    flow: super::format::TupleJson,
    xlate: super::format::TupleJson,
    packets: [u64; 2],
    bytes: [u64; 2],
    idle_s: u64,
    /// The end record already written (`fin`, `rst`) or due (`flush`, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    ended: Option<&'static str>,
    #[serde(skip)]
    line: String,
}

impl FlowAcctRow {
    fn new(k: &FlowAcctKey, a: &FlowAcct, now_ns: u64) -> Self {
        FlowAcctRow {
            flow: super::format::TupleJson::new(&k.orig),
            xlate: super::format::TupleJson::new(&a.xlate),
            packets: a.packets,
            bytes: a.bytes,
            idle_s: now_ns.saturating_sub(a.last_ns) / 1_000_000_000,
            ended: (a.ended != 0).then(|| flow_end_name(a.ended)),
            line: format!(
                "zone {:<5} {} => {}",
                k.orig.zone,
                super::format::tuple(&k.orig),
                super::format::tuple(&a.xlate)
            ),
        }
    }
}

impl Display for FlowAcctRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}  packets {}/{} bytes {}/{} idle {}s",
            self.line, self.packets[0], self.packets[1], self.bytes[0], self.bytes[1], self.idle_s
        )?;
        if let Some(e) = self.ended {
            write!(f, " ended {e}")?;
        }
        Ok(())
    }
}

/// `flow_events`: the ring's size.
#[derive(Serialize)]
struct RingRow {
    bytes: u32,
}

impl Display for RingRow {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "a ring of {} bytes of flow records, consumed by the agent's flow logger", self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_map_but_meta_has_one_view() {
        let mut names: Vec<&str> = VIEWS.iter().map(|(n, _)| *n).collect();
        names.push(MAP_META.name);
        names.sort();
        let mut all: Vec<&str> = ALL_MAPS.iter().map(|m| m.name).collect();
        all.sort();
        assert_eq!(names, all);
    }
}
