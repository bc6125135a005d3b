//! QoS maps: bandwidth limits by the priority ladder (`docs/qos.md`).
//!
//! The QoS maps (`qos_zones`, `qos_hooks`, `qos_eips`, `qos_config`,
//! `qos_state`, `qos_drops`, `qos_stats`) are in the map table of
//! `docs/architecture.md`, *Maps*; the algorithm is `docs/qos.md`.
//!
//! A bucket is one rule instance (a policy rule bound to one EIP, or a
//! gateway policy rule on one gateway); its index comes from the agent's
//! bucket allocator under a stable key, so a rate change keeps the bucket
//! (and its state). Arrays, not hashes: a packet's three bucket lookups are
//! array accesses the verifier inlines.

pub const QOS_ZONES_MAX: u32 = 65_536;
pub const QOS_HOOKS_MAX: u32 = 16_384;
pub const QOS_EIPS_MAX: u32 = 65_536;
/// Buckets (index 0 is never used: it means "no limit").
pub const QOS_BUCKETS_MAX: u32 = 16_384;

/// Gateway rules one hook (interface and direction) can hold.
pub const QOS_HOOK_RULES: usize = 8;

/// `QosHookKey::dir` / `QosEipKey::dir`, and the index of
/// `QosZoneInfo::eip_ifindex`.
pub const QOS_INGRESS: u8 = 0;
pub const QOS_EGRESS: u8 = 1;

/// A zone's QoS at a glance (`qos_zones[zone]`), the first thing the
/// program reads: a zone whose entry is all zero has no rules.
///
/// EIP rules act on one interface per direction (the gateway's external
/// interface): a packet there is looked up in `qos_eips` by its destination
/// (ingress) or source (egress) before anything else.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QosZoneInfo {
    /// Per direction (`QOS_INGRESS`, `QOS_EGRESS`): the interface whose
    /// packets are looked up in `qos_eips`; 0 when no EIP has a rule in
    /// that direction.
    pub eip_ifindex: [u32; 2],
    /// Hooks of the zone with gateway rules (`qos_hooks` entries): 0 means
    /// the program never looks there.
    pub hooks: u32,
    pub _pad0: u32,
}

impl QosZoneInfo {
    /// Whether the zone has any rule.
    pub fn any(&self) -> bool {
        self.hooks != 0 || self.eip_ifindex != [0, 0]
    }
}

/// `QosMatch::kind`.
pub const QOS_MATCH_ALL: u8 = 0;
pub const QOS_MATCH_SRC: u8 = 1;
pub const QOS_MATCH_DST: u8 = 2;

/// One hook of a zone: interface (in the zone's namespace) and direction.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QosHookKey {
    pub ifindex: u32,
    pub zone: u16,
    pub dir: u8,
    pub _pad0: u8,
}

/// A gateway rule on a hook: which packets, which bucket, at what priority.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QosMatch {
    pub bucket: u32,
    pub priority: u32,
    /// Prefix (network order) for `QOS_MATCH_SRC`/`QOS_MATCH_DST`.
    pub addr: [u8; 4],
    pub kind: u8,
    pub prefix_len: u8,
    pub _pad0: u16,
}

/// A hook's gateway rules: up to `QOS_HOOK_RULES`, sorted by priority
/// (lower first). The program takes the first that matches with a priority
/// below the packet's EIP rule (if any), else the EIP rule (ties go to the
/// EIP).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QosHook {
    pub count: u32,
    pub rules: [QosMatch; QOS_HOOK_RULES],
}

/// An EIP's rule for one direction.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QosEipKey {
    pub addr: [u8; 4],
    pub zone: u16,
    pub dir: u8,
    pub _pad0: u8,
}

/// `QosEip::flags`: no gateway rule of the EIP's hook can come before
/// this rule (none there, or none with a lower priority number): the
/// program takes the EIP's bucket without reading the hook.
pub const QOS_EIP_F_FIRST: u32 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QosEip {
    pub bucket: u32,
    pub priority: u32,
    pub flags: u32,
    pub _pad0: u32,
}

/// A bucket's rate and thresholds, all precomputed by the agent. Times are
/// in the bucket's virtual clock: a packet of `len` bytes costs
/// `len * 8e9 / rate_bps` ns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QosConfig {
    /// Rate in bit/s (SI: `rate_mbps` × 10⁶).
    pub rate_bps: u64,
    /// The burst as time at the rate: how far the virtual clock may run
    /// ahead of real time before packets are dropped.
    pub burst_ns: u64,
    /// Past this backlog (half the burst) the bucket signals congestion: a
    /// CE mark on an ECN-capable packet, an early drop of other TCP.
    pub mark_ns: u64,
    /// Extra room for small packets (ACKs, SYNs) beyond `burst_ns`.
    pub headroom_ns: u64,
    /// At most one signal (mark or early drop) per this interval (a quarter
    /// of the burst).
    pub early_gap_ns: u64,
}

/// The bucket's running state: a virtual clock (ns, `bpf_ktime_get_ns`
/// base). When it is behind real time the bucket is full; how far it runs
/// ahead of real time is the backlog. `last_early_ns`: the last congestion
/// signal (a CE mark or an early drop).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QosBucket {
    pub clock_ns: u64,
    pub last_early_ns: u64,
}

/// Flows whose latest drop `qos_drops` remembers (LRU: the oldest make room).
pub const QOS_DROPS_MAX: u32 = 65_536;

/// A TCP flow in a bucket (`qos_drops` key): addresses and ports as on the
/// wire.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QosDropKey {
    pub bucket: u32,
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
}

/// The latest TCP segment of a flow its bucket dropped, so that the flow
/// can recover from that loss without a second one (a lost retransmission,
/// or the loss of the last segment in flight, costs the sender a
/// retransmission timeout, ≥ 200 ms of silence): where the dropped data
/// ends (sequence number + payload), when it was dropped
/// (`bpf_ktime_get_ns`), and when the flow last met the bucket's tail
/// (`seen_us`: the clock >> 10, about µs, wrapping every ~73 minutes; every
/// segment of the flow that arrives past the tail updates it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QosDrop {
    pub end_seq: u32,
    pub seen_us: u32,
    pub at_ns: u64,
}

/// `QosDrop::seen_us` of a clock reading.
pub const fn qos_seen_us(now_ns: u64) -> u32 {
    (now_ns >> 10) as u32
}

/// A flow not seen at the tail for this long is probing (a tail loss probe
/// or a timeout's retransmission follows ≥ 10 ms of silence on Linux), or
/// its backlog fell below the tail in between: its next segment passes
/// like a resend.
pub const QOS_PROBE_GAP_NS: u64 = 1_000_000;

/// After a flow loses a segment, its further segments arriving past the
/// tail within this time pass (charged, within the resend allowance): TCP
/// halves its window once per round trip whatever the number of losses in
/// it, so a second loss in the round is no further signal, only a risk that
/// the last segment in flight is lost and the sender waits for a timeout.
/// Measured against longer spacings (an open loss held until its resend,
/// up to 100 ms; four frame times at the rate): those let a flow that does
/// not slow down run into the allowance's hard edge, where losses come in
/// runs (docs/qos.md, *TCP*).
pub const QOS_DROP_SPACING_NS: u64 = 1_000_000;

/// A byte's time on the wire at 1 bit/s, in ns: a packet of `len` bytes
/// costs `len * QOS_BYTE_NS_AT_1BPS / rate_bps` ns of a bucket's clock.
pub const QOS_BYTE_NS_AT_1BPS: u64 = 8_000_000_000;

/// A full-size Ethernet frame: the largest segment spared after a loss.
pub const QOS_FULL_FRAME: u64 = 1514;

/// Spacing applies from this rate up (12.1 Mbit/s): where a full frame
/// drains within `QOS_DROP_SPACING_NS`. Below it one loss/repair cycle
/// passes more than the bucket drains, so segments spared for spacing pin
/// the backlog at the allowance's edge and the resends behind them are
/// lost (a timeout each); there only resends and probes are spared.
/// Measured at 10 Mbit/s, one CUBIC flow: 99.9–100.1 % of the rate with
/// 0–4 timeouts a run, against 93–104 % with 1–8 with spacing
/// (docs/benchmarks.md, section 8).
pub const QOS_SPACING_MIN_BPS: u64 = QOS_FULL_FRAME * QOS_BYTE_NS_AT_1BPS / QOS_DROP_SPACING_NS;

/// Per bucket and CPU (`qos_stats` is a per-CPU array: no atomic adds, no
/// cache line shared by the CPUs of one busy bucket): packets and layer-2
/// bytes by outcome. Readers add the CPUs up.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct QosStats {
    pub passed_packets: u64,
    pub passed_bytes: u64,
    pub marked_packets: u64,
    pub marked_bytes: u64,
    pub dropped_packets: u64,
    pub dropped_bytes: u64,
}

impl QosStats {
    /// Adds another CPU's counts.
    pub fn add(&mut self, o: &QosStats) {
        self.passed_packets += o.passed_packets;
        self.passed_bytes += o.passed_bytes;
        self.marked_packets += o.marked_packets;
        self.marked_bytes += o.marked_bytes;
        self.dropped_packets += o.dropped_packets;
        self.dropped_bytes += o.dropped_bytes;
    }
}

/// Packets up to this many layer-2 bytes are "small" (ACKs, SYNs): they get
/// `headroom_ns` beyond the burst and are never dropped early.
pub const QOS_SMALL_PACKET: u32 = 128;

/// Smallest burst (bytes): two full-size GSO packets (64 KiB each) with
/// their headers. A smaller configured burst is raised to this (validate warns).
pub const QOS_BURST_FLOOR: u64 = 2 * (65_536 + 14 + 60 + 60);

/// The burst a rule with `burst_mb: 0` gets: 100 ms at its rate, at least
/// the floor.
pub fn qos_default_burst(rate_bps: u64) -> u64 {
    (rate_bps / 8 / 10).max(QOS_BURST_FLOOR)
}

/// The bucket config for a rate (bit/s) and burst (bytes, 0 = default).
pub fn qos_config(rate_bps: u64, burst_bytes: u64) -> QosConfig {
    let burst = if burst_bytes == 0 { qos_default_burst(rate_bps) } else { burst_bytes.max(QOS_BURST_FLOOR) };
    let ns = |bytes: u64| ((bytes as u128 * QOS_BYTE_NS_AT_1BPS as u128) / rate_bps.max(1) as u128) as u64;
    let burst_ns = ns(burst);
    QosConfig {
        rate_bps,
        burst_ns,
        mark_ns: burst_ns / 2,
        headroom_ns: ns(16 * QOS_SMALL_PACKET as u64).max(burst_ns / 16),
        early_gap_ns: burst_ns / 4,
    }
}

#[cfg(feature = "user")]
mod user {
    use super::*;

    pod!(
        QosZoneInfo,
        QosHookKey,
        QosMatch,
        QosHook,
        QosEipKey,
        QosEip,
        QosConfig,
        QosBucket,
        QosDropKey,
        QosDrop,
        QosStats
    );
}

/// No implicit padding: each size is the sum of its fields.
const _: () = {
    assert!(core::mem::size_of::<QosZoneInfo>() == 16);
    assert!(core::mem::size_of::<QosHookKey>() == 8);
    assert!(core::mem::size_of::<QosMatch>() == 4 + 4 + 4 + 1 + 1 + 2);
    assert!(core::mem::size_of::<QosHook>() == 4 + 16 * QOS_HOOK_RULES);
    assert!(core::mem::size_of::<QosEipKey>() == 8);
    assert!(core::mem::size_of::<QosEip>() == 16);
    assert!(core::mem::size_of::<QosConfig>() == 40);
    assert!(core::mem::size_of::<QosBucket>() == 16);
    assert!(core::mem::size_of::<QosDropKey>() == 16);
    assert!(core::mem::size_of::<QosDrop>() == 16);
    assert!(core::mem::size_of::<QosStats>() == 48);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_uses_si_bits_and_floors_the_burst() {
        // 10 Mbit/s, 1 MiB burst: 1 048 576 B × 8 / 10⁷ b/s = 0.8388608 s.
        let c = qos_config(10_000_000, 1 << 20);
        assert_eq!(c.burst_ns, 838_860_800);
        assert_eq!(c.mark_ns, c.burst_ns / 2);
        // A 1 000-byte burst is raised to the floor.
        assert_eq!(qos_config(10_000_000, 1000).burst_ns, qos_config(10_000_000, QOS_BURST_FLOOR).burst_ns);
        // burst 0: 100 ms at 100 Mbit/s = 1 250 000 bytes.
        assert_eq!(qos_config(100_000_000, 0).burst_ns, 100_000_000);
    }
}
