//! Every pinned map, declared once: its pin name, its kind, its key and its
//! value. The agent opens a map through its definition (`MapDef<K, V>`),
//! so a name is never paired with its types by hand, and [`ALL_MAPS`] is
//! derived from the same declarations. The eBPF side declares the same maps
//! in `lbagent-ebpf/src/maps.rs`; a test of the agent (`dataplane`'s
//! `the_object_declares_exactly_these_maps`) reads the compiled object and
//! compares every map's name, kind, key and value sizes and declared size
//! with these.

use core::marker::PhantomData;

use crate::*;

/// The kinds of map the object declares (the BPF map types, by name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapKind {
    Hash,
    LruHash,
    Array,
    PerCpuArray,
    LruPerCpuHash,
    LpmTrie,
    HashOfMaps,
    RingBuf,
}

impl MapKind {
    /// The kernel's `bpf_map_type` number.
    pub const fn map_type(self) -> u32 {
        match self {
            MapKind::Hash => 1,
            MapKind::Array => 2,
            MapKind::PerCpuArray => 6,
            MapKind::LruHash => 9,
            MapKind::LruPerCpuHash => 10,
            MapKind::LpmTrie => 11,
            MapKind::HashOfMaps => 13,
            MapKind::RingBuf => 27,
        }
    }
}

/// One pinned map: its pin name and kind, typed by its key and value. An
/// LPM trie's `K` is the key's data (the kernel's key is it behind a
/// 32-bit prefix length); a hash of maps' `V` is the inner map's id.
pub struct MapDef<K, V> {
    pub name: &'static str,
    pub kind: MapKind,
    /// The size the object declares (the conntrack tables are resized at
    /// load: `--conntrack-max`, `--conntrack-new-max`).
    pub max_entries: u32,
    /// `map_flags` the object declares (an LPM trie's `BPF_F_NO_PREALLOC`,
    /// which the kernel requires, is implied).
    pub flags: u32,
    types: PhantomData<fn() -> (K, V)>,
}

// Copy and Clone by hand: derived ones would require `K: Copy, V: Copy`.
impl<K, V> Clone for MapDef<K, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K, V> Copy for MapDef<K, V> {}

impl<K, V> MapDef<K, V> {
    const fn new(name: &'static str, kind: MapKind, max_entries: u32, flags: u32) -> Self {
        let flags = if matches!(kind, MapKind::LpmTrie) { flags | MAP_F_NO_PREALLOC as u32 } else { flags };
        MapDef { name, kind, max_entries, flags, types: PhantomData }
    }

    /// The untyped description of the map.
    pub const fn info(&self) -> MapInfo {
        let key = core::mem::size_of::<K>() as u32;
        MapInfo {
            name: self.name,
            kind: self.kind,
            key_size: if matches!(self.kind, MapKind::LpmTrie) { key + 4 } else { key },
            value_size: core::mem::size_of::<V>() as u32,
            max_entries: self.max_entries,
            flags: self.flags,
        }
    }
}

/// A map's name, kind and sizes as the kernel sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapInfo {
    pub name: &'static str,
    pub kind: MapKind,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
}

macro_rules! pinned_maps {
    ($($(#[$doc:meta])* $id:ident: $kind:ident<$k:ty, $v:ty>[$max:expr $(; $flags:expr)?] = $name:literal;)*) => {
        $($(#[$doc])* pub const $id: MapDef<$k, $v> =
            MapDef::new($name, MapKind::$kind, $max as u32, 0 $(| $flags as u32)?);)*

        /// Every pinned map, in the order `lbagent maps` shows them.
        pub const ALL_MAPS: [MapInfo; [$($name),*].len()] = [$($id.info()),*];
    };
}

pinned_maps! {
    /// Established flows, both directions.
    MAP_CT: Hash<Tuple, CtEntry>[CT_MAX] = "ct";
    /// Flows that have not completed their handshake.
    MAP_CT_NEW: LruHash<Tuple, CtEntry>[ct_new_max(CT_MAX)] = "ct_new";
    /// During an upgrade from the previous layout: its running programs'
    /// `ct` and `ct_new` (pinned under these names by the migration),
    /// whose flows the new programs adopt on their first packet; otherwise
    /// empty and small.
    MAP_CT_PREV: Hash<Tuple, CtEntryPrev>[CT_PREV_IDLE_MAX] = "ct_prev";
    MAP_CT_NEW_PREV: LruHash<Tuple, CtEntryPrev>[CT_PREV_IDLE_MAX] = "ct_new_prev";
    /// 1 while `ct_prev` and `ct_new_prev` may hold flows not adopted yet
    /// (one entry; the programs look there only then).
    MAP_CT_ADOPT: Array<u32, u32>[1] = "ct_adopt";
    /// Per CPU: where a program converts the halves it adopts.
    MAP_CT_ADOPT_SCRATCH: PerCpuArray<u32, CtAdoptScratch>[1] = "ct_adopt_scratch";
    /// First fragments' ports, for the fragments that follow.
    MAP_FRAGS: LruHash<FragKey, FragEntry>[FRAGS_MAX] = "frags";
    /// Not preallocated (the agent's updates allocate).
    MAP_DNAT_RULES: Hash<DnatKey, DnatRule>[DNAT_RULES_MAX; MAP_F_NO_PREALLOC] = "dnat_rules";
    /// Not preallocated.
    MAP_DNAT_BACKENDS: Hash<BackendKey, Backend>[DNAT_BACKENDS_MAX; MAP_F_NO_PREALLOC] = "dnat_backends";
    MAP_SNAT_RULES: LpmTrie<SnatKey, SnatRule>[SNAT_RULES_MAX] = "snat_rules";
    /// Listener ACL prefixes → the rule they belong to.
    MAP_ACL_RULES: LpmTrie<AclKey, u32>[ACL_RULES_MAX] = "acl_rules";
    MAP_NAT_CONFIG: Array<u32, NatConfig>[1] = "nat_config";
    /// Indexed by `Counter`.
    MAP_COUNTERS: PerCpuArray<u32, u64>[COUNTER_COUNT] = "counters";
    /// Rule id → its packets, bytes and ACL drops.
    MAP_RULE_STATS: LruPerCpuHash<u32, RuleStats>[RULE_STATS_MAX] = "rule_stats";
    /// The layout the pin directory holds (one entry).
    MAP_META: Array<u32, Meta>[1] = "meta";
    MAP_QOS_ZONES: Array<u32, QosZoneInfo>[QOS_ZONES_MAX] = "qos_zones";
    MAP_QOS_HOOKS: Hash<QosHookKey, QosHook>[QOS_HOOKS_MAX] = "qos_hooks";
    MAP_QOS_EIPS: Hash<QosEipKey, QosEip>[QOS_EIPS_MAX] = "qos_eips";
    /// Bucket → its rate and burst.
    MAP_QOS_CONFIG: Array<u32, QosConfig>[QOS_BUCKETS_MAX] = "qos_config";
    /// Bucket → its clock.
    MAP_QOS_STATE: Array<u32, QosBucket>[QOS_BUCKETS_MAX] = "qos_state";
    MAP_QOS_DROPS: LruHash<QosDropKey, QosDrop>[QOS_DROPS_MAX] = "qos_drops";
    MAP_QOS_STATS: PerCpuArray<u32, QosStats>[QOS_BUCKETS_MAX] = "qos_stats";
    /// Rule id → the rule's table (an inner `Array<Backend, SCHED_TABLE_LEN>`).
    MAP_SCHED_TABLES: HashOfMaps<u32, u32>[SCHED_TABLES_MAX] = "sched_tables";
    /// Per CPU: rule id → the next position of a round-robin rule.
    MAP_SCHED_TURNS: LruPerCpuHash<u32, u32>[SCHED_TABLES_MAX] = "sched_turns";
    /// Rule id and backend → that backend's weight and active flows, for
    /// least-connection rules (`wlc`).
    MAP_SCHED_ACTIVE: Hash<ActiveKey, Active>[SCHED_ACTIVE_MAX] = "sched_active";
    MAP_PROXY_GUARD: Array<u32, ProxyGuard>[1] = "proxy_guard";
    MAP_PROXY_GUARD_DROPS: PerCpuArray<u32, u64>[1] = "proxy_guard_drops";
    /// Zone and interface → the MTU the fast path forwards within.
    MAP_EGRESS_MTU: Hash<MtuKey, u32>[EGRESS_MTU_MAX] = "egress_mtu";
    MAP_ZONE_CT_LIMITS: Hash<u32, ZoneCtLimits>[ZONE_CT_MAX] = "zone_ct_limits";
    MAP_ZONE_CT_FLOWS: Hash<u32, ZoneCtFlows>[ZONE_CT_MAX] = "zone_ct_flows";
    MAP_ZONE_CT_REFUSED: Hash<u32, ZoneCtRefused>[ZONE_CT_MAX] = "zone_ct_refused";
    /// Zone → what its programs log (`FlowLogZone`).
    MAP_FLOW_LOG_ZONES: Array<u32, FlowLogZone>[FLOW_LOG_ZONES_MAX] = "flow_log_zones";
    /// Each logged flow's counts, by original tuple and creation time. Not
    /// preallocated: it costs only while flows are logged.
    MAP_FLOW_ACCT: Hash<FlowAcctKey, FlowAcct>[CT_MAX; MAP_F_NO_PREALLOC] = "flow_acct";
    /// Per CPU: where a program builds a new logged flow's counts.
    MAP_FLOW_LOG_SCRATCH: PerCpuArray<u32, FlowLogScratch>[1] = "flow_log_scratch";
    /// Flow start and end records (`FlowEvent`), a ring of bytes.
    MAP_FLOW_EVENTS: RingBuf<(), FlowEvent>[FLOW_EVENTS_BYTES] = "flow_events";
}

/// The definition of the map called `name`.
pub fn map_info(name: &str) -> Option<MapInfo> {
    ALL_MAPS.iter().copied().find(|m| m.name == name)
}

/// The pin name (one of [`ALL_MAPS`]) of the map the kernel calls `kernel_name`.
pub fn pin_name_of(kernel_name: &str) -> Option<&'static str> {
    ALL_MAPS.iter().map(|m| m.name).find(|m| m[..m.len().min(KERNEL_NAME_LEN)] == *kernel_name)
}
