//! Map definitions. Layouts and the who-writes/who-reads table live in
//! `lbagent_common::maps`; every map is pinned by name.

use aya_ebpf::{
    btf_maps::{Array, HashMap, HashOfMaps, LpmTrie, LruHashMap, LruPerCpuHashMap, PerCpuArray, RingBuf},
    macros::btf_map,
};
use lbagent_common::*;

// The flag the map definitions (and `lbagent_common::MapDef`) use is the
// kernel's.
const _: () = assert!(MAP_F_NO_PREALLOC == aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize);

/// Conntrack of established flows (both halves). A plain hash: the kernel
/// never evicts from it, so a flood of new flows cannot push an established
/// flow out; entries leave by timeout (program on lookup, agent GC) or flush.
#[btf_map(name = "ct", pin_by_name)]
pub static CT: HashMap<Tuple, CtEntry, { CT_MAX as usize }> = HashMap::new();

/// Conntrack of flows that have not completed their handshake (both halves).
/// LRU: under a flood the oldest unconfirmed flows make room.
#[btf_map(name = "ct_new", pin_by_name)]
pub static CT_NEW_TABLE: LruHashMap<Tuple, CtEntry, { ct_new_max(CT_MAX) as usize }> = LruHashMap::new();

/// The previous layout's conntrack tables while an upgrade adopts their
/// flows (`conntrack.rs`, *Upgrades*); small and empty otherwise.
#[btf_map(name = "ct_prev", pin_by_name)]
pub static CT_PREV: HashMap<Tuple, CtEntryPrev, { CT_PREV_IDLE_MAX as usize }> = HashMap::new();

#[btf_map(name = "ct_new_prev", pin_by_name)]
pub static CT_NEW_PREV: LruHashMap<Tuple, CtEntryPrev, { CT_PREV_IDLE_MAX as usize }> = LruHashMap::new();

/// 1 while `ct_prev`/`ct_new_prev` may hold flows to adopt; written by the
/// agent's migration.
#[btf_map(name = "ct_adopt", pin_by_name)]
pub static CT_ADOPT: Array<u32, 1> = Array::new();

/// Per CPU: where the adoption converts a flow's halves (never written by
/// the agent, so no write of its can tear a conversion under way).
#[btf_map(name = "ct_adopt_scratch", pin_by_name)]
pub static CT_ADOPT_SCRATCH: PerCpuArray<CtAdoptScratch, 1> = PerCpuArray::new();

/// First fragments seen: the ports later fragments of the datagram need.
#[btf_map(name = "frags", pin_by_name)]
pub static FRAGS: LruHashMap<FragKey, FragEntry, { FRAGS_MAX as usize }> = LruHashMap::new();

/// DNAT rules by (zone, address, protocol, port). Not preallocated: the
/// agent's updates allocate (see `DNAT_RULES_MAX`).
#[btf_map(name = "dnat_rules", pin_by_name)]
pub static DNAT_RULES: HashMap<DnatKey, DnatRule, { DNAT_RULES_MAX as usize }, MAP_F_NO_PREALLOC> = HashMap::new();

/// Backends of each DNAT rule, by (rule id, index). Not preallocated.
#[btf_map(name = "dnat_backends", pin_by_name)]
pub static DNAT_BACKENDS: HashMap<BackendKey, Backend, { DNAT_BACKENDS_MAX as usize }, MAP_F_NO_PREALLOC> =
    HashMap::new();

/// SNAT rules by (zone, egress interface, source prefix).
#[btf_map(name = "snat_rules", pin_by_name)]
pub static SNAT_RULES: LpmTrie<SnatKey, SnatRule, { SNAT_RULES_MAX as usize }> = LpmTrie::new();

/// Listener ACLs: source prefixes by (DNAT rule id, address).
#[btf_map(name = "acl_rules", pin_by_name)]
pub static ACL_RULES: LpmTrie<AclKey, u32, { ACL_RULES_MAX as usize }> = LpmTrie::new();

/// Engine settings (timeouts).
#[btf_map(name = "nat_config", pin_by_name)]
pub static NAT_CONFIG: Array<NatConfig, 1> = Array::new();

/// Per-CPU packet counters, indexed by `Counter`.
#[btf_map(name = "counters", pin_by_name)]
pub static COUNTERS: PerCpuArray<u64, { COUNTER_COUNT as usize }> = PerCpuArray::new();

/// Per-rule packets and bytes.
#[btf_map(name = "rule_stats", pin_by_name)]
pub static RULE_STATS: LruPerCpuHashMap<u32, RuleStats, { RULE_STATS_MAX as usize }> = LruPerCpuHashMap::new();

/// Whose sockets may open connections through a load balancer's `h…1`
/// (`proxy_guard.rs`); written by the agent.
#[btf_map(name = "proxy_guard", pin_by_name)]
pub static PROXY_GUARD: Array<ProxyGuard, 1> = Array::new();

/// Packets the proxy guard dropped (per CPU).
#[btf_map(name = "proxy_guard_drops", pin_by_name)]
pub static PROXY_GUARD_DROPS: PerCpuArray<u64, 1> = PerCpuArray::new();

/// Layout version of the pins (checked by the agent, unused by the program).
#[btf_map(name = "meta", pin_by_name)]
pub static META: Array<Meta, 1> = Array::new();

/// QoS: each zone's rules at a glance (index = zone; all zero = none):
/// where EIP rules act and whether any hook has gateway rules.
#[btf_map(name = "qos_zones", pin_by_name)]
pub static QOS_ZONES: Array<QosZoneInfo, { QOS_ZONES_MAX as usize }> = Array::new();

/// QoS: each hook's ladder of gateway rules.
#[btf_map(name = "qos_hooks", pin_by_name)]
pub static QOS_HOOKS: HashMap<QosHookKey, QosHook, { QOS_HOOKS_MAX as usize }> = HashMap::new();

/// QoS: EIP rules by (zone, direction, EIP).
#[btf_map(name = "qos_eips", pin_by_name)]
pub static QOS_EIPS: HashMap<QosEipKey, QosEip, { QOS_EIPS_MAX as usize }> = HashMap::new();

/// QoS: each bucket's rate and thresholds (replaced whole by the agent;
/// rate 0 = unused).
#[btf_map(name = "qos_config", pin_by_name)]
pub static QOS_CONFIG: Array<QosConfig, { QOS_BUCKETS_MAX as usize }> = Array::new();

/// QoS: each bucket's virtual clock (zeroed by the agent when the bucket is
/// created or freed, never otherwise: a rate change keeps it).
#[btf_map(name = "qos_state", pin_by_name)]
pub static QOS_STATE: Array<QosBucket, { QOS_BUCKETS_MAX as usize }> = Array::new();

/// QoS: per TCP flow, the latest segment its bucket dropped (LRU).
#[btf_map(name = "qos_drops", pin_by_name)]
pub static QOS_DROPS: LruHashMap<QosDropKey, QosDrop, { QOS_DROPS_MAX as usize }> = LruHashMap::new();

/// QoS: per bucket and CPU, packets and bytes passed, marked and dropped.
#[btf_map(name = "qos_stats", pin_by_name)]
pub static QOS_STATS: PerCpuArray<QosStats, { QOS_BUCKETS_MAX as usize }> = PerCpuArray::new();

/// Scheduler tables: rule id → its table (`lbagent_common::sched`). Each
/// slot holds a [`Backend`]'s 8 bytes, declared as a `u64`: the agent
/// creates the inner arrays without BTF, and Linux 6.1 refuses an inner map
/// whose value does not match what it derives from the template's value
/// BTF (with a struct value every insert failed with EINVAL; 5.10 and 6.18
/// accepted it; a scalar is accepted by all three).
#[btf_map(name = "sched_tables", pin_by_name)]
pub static SCHED_TABLES: HashOfMaps<u32, Array<u64, { SCHED_TABLE_LEN as usize }>, { SCHED_TABLES_MAX as usize }> =
    HashOfMaps::new();

/// Round-robin positions, per CPU, by rule id (LRU: a deleted rule's
/// position ages out).
#[btf_map(name = "sched_turns", pin_by_name)]
pub static SCHED_TURNS: LruPerCpuHashMap<u32, u32, { SCHED_TABLES_MAX as usize }> = LruPerCpuHashMap::new();

/// Least-connection rules: weight and active flows per backend
/// (`lbagent_common::sched::Active`).
#[btf_map(name = "sched_active", pin_by_name)]
pub static SCHED_ACTIVE: HashMap<ActiveKey, Active, { SCHED_ACTIVE_MAX as usize }> = HashMap::new();

/// The fast path's MTU per interface of each zone (`MtuKey`; written by
/// the agent, read by `route::next_hop`).
#[btf_map(name = "egress_mtu", pin_by_name)]
pub static EGRESS_MTU: HashMap<MtuKey, u32, { EGRESS_MTU_MAX as usize }> = HashMap::new();

/// Each zone's conntrack limits (`lbagent_common::ZoneCtLimits`; agent).
#[btf_map(name = "zone_ct_limits", pin_by_name)]
pub static ZONE_CT_LIMITS: HashMap<u32, ZoneCtLimits, { ZONE_CT_MAX as usize }> = HashMap::new();

/// Each zone's flows in `ct` and `ct_new` (program adds, agent recounts).
#[btf_map(name = "zone_ct_flows", pin_by_name)]
pub static ZONE_CT_FLOWS: HashMap<u32, ZoneCtFlows, { ZONE_CT_MAX as usize }> = HashMap::new();

/// What each zone's limits refused (program adds).
#[btf_map(name = "zone_ct_refused", pin_by_name)]
pub static ZONE_CT_REFUSED: HashMap<u32, ZoneCtRefused, { ZONE_CT_MAX as usize }> = HashMap::new();

/// Which zones log their flows, and how (`flow_log.rs`; agent).
#[btf_map(name = "flow_log_zones", pin_by_name)]
pub static FLOW_LOG_ZONES: Array<FlowLogZone, { FLOW_LOG_ZONES_MAX as usize }> = Array::new();

/// Each logged flow's packets and bytes (program adds, agent removes).
#[btf_map(name = "flow_acct", pin_by_name)]
pub static FLOW_ACCT: HashMap<FlowAcctKey, FlowAcct, { CT_MAX as usize }, MAP_F_NO_PREALLOC> = HashMap::new();

/// Flow start and end records for the agent (`FlowEvent`).
#[btf_map(name = "flow_events", pin_by_name)]
pub static FLOW_EVENTS: RingBuf<FlowEvent, { FLOW_EVENTS_BYTES as usize }> = RingBuf::new();

/// Per CPU: where a new logged flow's counts are built before their insert
/// (the new-flow path's stack has no room). Written by the programs only.
#[btf_map(name = "flow_log_scratch", pin_by_name)]
pub static FLOW_LOG_SCRATCH: PerCpuArray<FlowLogScratch, 1> = PerCpuArray::new();
