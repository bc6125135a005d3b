//! The pinned maps' names and layouts. The map table (type, size, key,
//! value, who writes and who reads every map) is in one place:
//! `docs/architecture.md`, *Maps*.
//!
//! Every key carries a *zone*: one zone per network namespace the engine runs
//! in (one per load balancer, one per NAT gateway). Interface indexes and VPC
//! addresses repeat across namespaces; the zone keeps them apart in the shared
//! maps. A program instance is loaded per zone with the zone as a constant.

/// The kernel keeps this many characters of a map's name (`BPF_OBJ_NAME_LEN`
/// less the terminating NUL); pins keep the whole name.
pub const KERNEL_NAME_LEN: usize = 15;

/// Default sizes (`max_entries`). `ct` holds established flows, `ct_new`
/// flows that have not completed their handshake (see [`ct_new_max`]).
pub const CT_MAX: u32 = 262_144;
/// In-flight first fragments (datagrams being fragmented at once).
pub const FRAGS_MAX: u32 = 8_192;
/// Rule tables: a million DNAT and a million SNAT rules per host (one
/// document's share is smaller: `state::limits`). The DNAT tables are
/// hashes the kernel does not preallocate (`BPF_F_NO_PREALLOC`: only the
/// agent writes them, so an element is allocated by its update): a host
/// pays for their bucket arrays (16 B a slot: 48 MiB for both) and for the
/// rules it has, not for every element; the SNAT table is an LPM trie,
/// never preallocated.
pub const DNAT_RULES_MAX: u32 = 1_048_576;
/// Two backends per DNAT rule on average (a NAT gateway's DNAT rule has one).
pub const DNAT_BACKENDS_MAX: u32 = 2_097_152;
pub const SNAT_RULES_MAX: u32 = 1_048_576;
/// `BPF_F_NO_PREALLOC`: elements allocated by each update.
pub const MAP_F_NO_PREALLOC: usize = 1;
pub const ACL_RULES_MAX: u32 = 65_536;
pub const RULE_STATS_MAX: u32 = 65_536;

/// A connection 5-tuple as seen on the wire, in one zone.
///
/// For ICMP echo the identifier plays the port: a request has
/// `sport = id, dport = 0`, a reply `sport = 0, dport = id`, so the reversed
/// tuple of a request is exactly its reply's tuple.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Tuple {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad0: u8,
    pub zone: u16,
}

impl Tuple {
    /// The tuple of a packet travelling the other way.
    #[inline(always)]
    pub fn reversed(&self) -> Tuple {
        Tuple {
            saddr: self.daddr,
            daddr: self.saddr,
            sport: self.dport,
            dport: self.sport,
            proto: self.proto,
            _pad0: 0,
            zone: self.zone,
        }
    }
}

/// Size of `ct_new` for a `ct` of `ct_max` entries: a quarter, at least 256.
pub const fn ct_new_max(ct_max: u32) -> u32 {
    let q = ct_max / 4;
    if q < 256 { 256 } else { q }
}

/// Conntrack entry flags.
pub const CT_F_REPLY: u8 = 1; // entry for the reply direction
pub const CT_F_SNAT: u8 = 2; // the flow's source was translated
pub const CT_F_DNAT: u8 = 4; // the flow's destination was translated
pub const CT_F_FIN: u8 = 8; // a FIN was seen in this entry's direction
pub const CT_F_SEQ: u8 = 16; // TCP: `seq_end`/`max_win` of this direction are known
pub const CT_F_LOCAL: u8 = 32; // a connection of the namespace's own (seen at egress)
pub const CT_F_LOGGED: u8 = 64; // the flow is logged: `flow_acct` counts it (`flow_log`)

/// Conntrack state, the same in both entries of a flow; it only moves
/// forward (a new SYN on a closing flow replaces the flow).
pub const CT_NEW: u8 = 0; // only the originator has spoken
pub const CT_REPLIED: u8 = 1; // the reply direction has answered (SYN-ACK, UDP answer)
pub const CT_ESTABLISHED: u8 = 2; // TCP handshake completed / UDP still active 2 s after a reply
pub const CT_CLOSING: u8 = 3; // FIN in both directions, or an in-window RST

/// `CtEntry::wscale` when the direction sent no window-scale option.
pub const CT_WSCALE_NONE: u8 = 0xff;

/// One direction of a tracked flow: packets matching the key are rewritten to
/// `xlate`. Each flow has two entries: the original tuple and the reply tuple
/// (`xlate.reversed()` of the original entry). Each entry's `xlate.reversed()`
/// is the key of its pair, and the pair's `xlate.reversed()` must be this
/// entry's key: that back-pointer is checked before either half touches the
/// other (a pair that does not point back belongs to another flow).
///
/// 48 bytes: with its 16-byte key, the kernel's element header and a bucket,
/// 128 bytes of kernel memory per half, 256 per flow.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntry {
    /// The tuple the packet carries after translation.
    pub xlate: Tuple,
    /// `bpf_ktime_get_ns()` of the last packet (updated at most once a second).
    pub last_seen_ns: u64,
    /// When the flow was created: `bpf_ktime_get_ns()` in milliseconds,
    /// modulo 2^32 ([`ct_clock_ms`]; it wraps every 49.7 days). With the
    /// translation it tells one flow of a tuple from a later one.
    pub created_ms: u32,
    /// Id of the DNAT rule (or 0) and of the SNAT rule (or 0) that made the flow.
    pub dnat_rule: u32,
    pub snat_rule: u32,
    /// TCP: sequence number after the last byte this direction sent (as seen).
    pub seq_end: u32,
    /// TCP: largest receive window this direction advertised, scaled.
    pub max_win: u32,
    /// `CT_F_*` bits.
    pub flags: u8,
    /// `CT_NEW`, `CT_REPLIED`, `CT_ESTABLISHED` or `CT_CLOSING`.
    pub state: u8,
    /// TCP: window-scale shift this direction offered in its SYN, or `CT_WSCALE_NONE`.
    pub wscale: u8,
    pub _pad0: u8,
}

/// [`CtEntry::created_ms`] of a flow created at `now_ns` (`bpf_ktime_get_ns()`).
#[inline(always)]
pub const fn ct_clock_ms(now_ns: u64) -> u32 {
    (now_ns / 1_000_000) as u32
}

/// Milliseconds from `then` to `now` on the wrapping [`ct_clock_ms`] clock;
/// 0 when `then` is later (another CPU stamped it after this one read the
/// clock).
#[inline(always)]
pub const fn ct_ms_since(now: u32, then: u32) -> u32 {
    let d = now.wrapping_sub(then);
    if (d as i32) < 0 { 0 } else { d }
}

/// The conntrack entry of the previous layout (4): [`CtEntry`] with the
/// creation time in nanoseconds and four bytes of padding. Read only while
/// an upgrade adopts the flows of the running programs' tables (`ct_prev`,
/// `ct_new_prev`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntryPrev {
    pub xlate: Tuple,
    pub last_seen_ns: u64,
    pub created_ns: u64,
    pub dnat_rule: u32,
    pub snat_rule: u32,
    pub seq_end: u32,
    pub max_win: u32,
    pub flags: u8,
    pub state: u8,
    pub wscale: u8,
    pub _pad0: u8,
    /// Padding in layout 4, which never reads it: set to 1 by the program
    /// of this layout that adopted the half (the half is this layout's
    /// from then on, even once it is gone from its tables: never adopted
    /// or copied again). The previous programs carry it with the half
    /// (their copies, promotion and repair copy whole entries).
    pub adopted: u32,
}

impl CtEntryPrev {
    /// The same half in this layout.
    #[inline(always)]
    pub fn adopted(&self) -> CtEntry {
        let mut e = CtEntry::default();
        self.adopt_into(&mut e);
        e
    }

    /// Writes the same half in this layout into `e`, field by field (the
    /// programs convert into map memory: their stack has no room).
    #[inline(always)]
    pub fn adopt_into(&self, e: &mut CtEntry) {
        // Field by field: a whole-tuple copy between two pointers becomes a
        // `memmove` call, which a BPF global function may not make.
        let x = &self.xlate;
        e.xlate.saddr = x.saddr;
        e.xlate.daddr = x.daddr;
        e.xlate.sport = x.sport;
        e.xlate.dport = x.dport;
        e.xlate.proto = x.proto;
        e.xlate._pad0 = 0;
        e.xlate.zone = x.zone;
        e.last_seen_ns = self.last_seen_ns;
        e.created_ms = ct_clock_ms(self.created_ns);
        e.dnat_rule = self.dnat_rule;
        e.snat_rule = self.snat_rule;
        e.seq_end = self.seq_end;
        e.max_win = self.max_win;
        e.flags = self.flags;
        e.state = self.state;
        e.wscale = self.wscale;
        e._pad0 = 0;
    }
}

/// `ct_adopt_scratch`, per CPU: the room a program converts a flow's two
/// halves in while it adopts them (its stack has none to spare). Written
/// by the programs only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtAdoptScratch {
    pub half: CtEntry,
    pub pair: CtEntry,
}

/// What `lbagent_ct_adopt` did with a key: the previous tables do not hold
/// a live half under it (or the half is this layout's already) …
pub const CT_ADOPT_ABSENT: u32 = 0;
/// … the flow is in `ct` now …
pub const CT_ADOPT_ESTABLISHED: u32 = 1;
/// … in `ct_new` now …
pub const CT_ADOPT_NEW: u32 = 2;
/// … or a live flow holds it there but this layout's tables had no room:
/// its tuple stays taken.
pub const CT_ADOPT_HELD: u32 = 3;

/// Size of the previous layout's tables (`ct_prev`, `ct_new_prev`) in a
/// dataplane that is not being upgraded: they stay empty.
pub const CT_PREV_IDLE_MAX: u32 = 64;

/// Garbage collection runs in the kernel: the agent hands the program
/// `lbagent_ct_gc` (through `BPF_PROG_TEST_RUN`, never attached) the keys of
/// halves it read idle, and the program frees each flow still idle now
/// (its own clock), with both halves, as a new flow reclaims an expired
/// one's tuple. Its input: up to `CT_GC_BATCH` keys, one after the other
/// (16 bytes each; at least one: the kernel wants 14 bytes). Its return
/// value is the flows it freed. Keys per run: the input stays within the
/// page `BPF_PROG_TEST_RUN` copies it into (with its headroom and the
/// shared info at its end).
pub const CT_GC_BATCH: usize = 128;
/// What the reclaim of one tuple found: a live flow holds it (kept).
pub const CT_RECLAIM_LIVE: u32 = 0;
/// An expired flow held it: both its halves were deleted.
pub const CT_RECLAIM_FREED: u32 = 1;
/// No flow held it.
pub const CT_RECLAIM_ABSENT: u32 = 2;

/// Key of a fragmented datagram: what every fragment of it carries.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    /// IPv4 identification (host order).
    pub id: u16,
    pub proto: u8,
    pub _pad0: u8,
    pub zone: u16,
    pub _pad1: u16,
}

/// The ports the first fragment carried (before translation): later
/// fragments look their flow up with them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragEntry {
    pub sport: u16,
    pub dport: u16,
    pub _pad0: u32,
    /// `bpf_ktime_get_ns()` of the first fragment; entries older than
    /// `FRAG_TIMEOUT_S` are ignored (the IP id may have wrapped).
    pub seen_ns: u64,
}

/// How long a first fragment's entry serves later fragments (Linux's ipfrag_time).
pub const FRAG_TIMEOUT_S: u64 = 30;

/// Exact-match DNAT key. Looked up first with the packet's port and protocol,
/// then with `port = 0, proto = 0` (an address-wide rule, e.g. a floating IP).
/// ICMP echo uses `port = 0`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DnatKey {
    pub addr: [u8; 4],
    pub port: u16,
    pub proto: u8,
    pub _pad0: u8,
    pub zone: u16,
    pub _pad1: u16,
}

/// DNAT rule: which backend set new flows go to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DnatRule {
    /// Agent-assigned id, unique across zones; keys the backends.
    pub rule_id: u32,
    /// Backends `0..backend_count` in `dnat_backends`; a flow picks one by
    /// hash, or from the rule's scheduler table (`DNAT_F_SCHED_*`, `sched.rs`).
    pub backend_count: u32,
    /// With `DNAT_F_SNAT`: new flows of this rule that arrive on
    /// `snat_ifindex` (0 = any interface) and match no SNAT rule get their
    /// source rewritten to `snat_addr` (0.0.0.0 = the rule's own address:
    /// the NAT gateway's hairpin). The load balancer uses it to SNAT to its
    /// inner address or its VIP, as the reference dataplane's `-o … -j SNAT` rules do.
    pub snat_ifindex: u32,
    pub snat_addr: [u8; 4],
    /// `DNAT_F_*` bits.
    pub flags: u32,
    /// With `DNAT_F_ACL_*`: a digest of the rule's ACL entries (the agent
    /// compares rules by value; the program ignores it).
    pub acl_digest: u32,
}

/// New flows of this rule are accepted only from sources in `acl_rules`.
pub const DNAT_F_ACL_ALLOW: u32 = 4;
/// New flows of this rule from sources in `acl_rules` are dropped.
pub const DNAT_F_ACL_DENY: u32 = 8;

/// An ACL entry: a source prefix for rule `rule_id` (the listener's DNAT
/// rule). LPM: `prefix_len = ACL_KEY_FIXED_BITS + CIDR length`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AclKey {
    pub rule_id: u32,
    pub addr: [u8; 4],
}

/// Bits of `AclKey` before the address.
pub const ACL_KEY_FIXED_BITS: u32 = 32;

/// SNAT this rule's new flows (see `DnatRule::snat_ifindex`).
pub const DNAT_F_SNAT: u32 = 1;
/// ... starting the source port search at random.
pub const DNAT_F_SNAT_RANDOM: u32 = 2;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BackendKey {
    pub rule_id: u32,
    pub index: u32,
}

/// A DNAT target. `port = 0` keeps the original destination port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backend {
    pub addr: [u8; 4],
    pub port: u16,
    pub _pad0: u16,
}

/// Data part of the SNAT LPM key: zone and egress interface must match fully
/// (64 bits), then the source address by prefix: `prefix_len = 64 + cidr_len`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SnatKey {
    pub zone: u16,
    pub _pad0: u16,
    /// Interface the flow leaves by (in the zone's namespace; the program
    /// asks the FIB, `bpf_fib_lookup`), like iptables' `-o`.
    pub ifindex: u32,
    pub addr: [u8; 4],
}

/// Bits of `SnatKey` before the address.
pub const SNAT_KEY_FIXED_BITS: u32 = 64;

/// SNAT rule: new source address and the port range to allocate from.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnatRule {
    pub addr: [u8; 4],
    pub port_min: u16,
    pub port_max: u16,
    pub rule_id: u32,
    /// `SNAT_F_*` bits.
    pub flags: u32,
}

/// Start port search at a random point of the range ("random-fully"), instead
/// of trying to keep the original source port first.
pub const SNAT_F_RANDOM: u32 = 1;

/// No port range was asked for (iptables' `-j SNAT --to-source addr`): a
/// privileged source port stays in its class, as Linux NAT keeps it (below
/// 512: 1–511; 512–1023: 600–1023; services such as NFS accept only
/// reserved ports); other ports take the rule's range.
pub const SNAT_F_PORT_CLASS: u32 = 2;

/// Timeouts in seconds; 0 means "use the default" (`DEFAULT_*`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatConfig {
    /// TCP before the handshake completes (SYN sent, SYN-ACK seen).
    pub tcp_new_s: u32,
    pub tcp_established_s: u32,
    /// TCP after FIN both ways or an RST.
    pub tcp_closing_s: u32,
    /// UDP unanswered, or answered but not active 2 s later (a query/answer).
    pub udp_s: u32,
    /// UDP still active 2 s after the answer (a stream).
    pub udp_stream_s: u32,
    /// ICMP echo.
    pub icmp_s: u32,
    /// Every other IP protocol (GRE, ESP, SCTP, ...; address-only).
    pub other_s: u32,
    /// `NAT_CFG_*` bits (0: the defaults). Was padding before the fast
    /// path: pins written then hold 0, which keeps its meaning.
    pub flags: u32,
}

/// `NatConfig::flags`: translated packets the namespace would forward are
/// redirected to their egress interface from the program (the fast path,
/// `lbagent-ebpf/src/route.rs`) instead of climbing the namespace's stack.
/// The agent sets it unless `agent.fast_path: false`; pins written before
/// the fast path hold 0 (the stack), their old behaviour.
pub const NAT_CFG_FAST_PATH: u32 = 1;

impl NatConfig {
    /// Idle timeout (seconds) of a conntrack entry; shared by the program
    /// (expiry on lookup) and the agent (garbage collection).
    #[inline(always)]
    pub fn timeout_s(&self, proto: u8, state: u8) -> u32 {
        let or = |v: u32, d: u32| if v == 0 { d } else { v };
        match (proto, state) {
            (crate::PROTO_TCP, CT_ESTABLISHED) => or(self.tcp_established_s, DEFAULT_TCP_ESTABLISHED_S),
            (crate::PROTO_TCP, CT_CLOSING) => or(self.tcp_closing_s, DEFAULT_TCP_CLOSING_S),
            (crate::PROTO_TCP, _) => or(self.tcp_new_s, DEFAULT_TCP_NEW_S),
            (crate::PROTO_UDP, CT_ESTABLISHED) => or(self.udp_stream_s, DEFAULT_UDP_STREAM_S),
            (crate::PROTO_UDP, _) => or(self.udp_s, DEFAULT_UDP_S),
            (crate::PROTO_ICMP, _) => or(self.icmp_s, DEFAULT_ICMP_S),
            _ => or(self.other_s, DEFAULT_OTHER_S),
        }
    }
}

/// Defaults follow Linux nf_conntrack where it has an equivalent
/// (established 5 days, UDP 30 s / stream 120 s, generic 600 s).
pub const DEFAULT_TCP_NEW_S: u32 = 60;
pub const DEFAULT_TCP_ESTABLISHED_S: u32 = 432_000;
pub const DEFAULT_TCP_CLOSING_S: u32 = 10;
pub const DEFAULT_UDP_S: u32 = 30;
pub const DEFAULT_UDP_STREAM_S: u32 = 120;
pub const DEFAULT_ICMP_S: u32 = 30;
pub const DEFAULT_OTHER_S: u32 = 600;
/// A UDP flow answered and still active this long after creation is a stream.
pub const UDP_STREAM_AFTER_MS: u32 = 2_000;

/// Written by the agent when it creates the pins; checked on every reuse.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    pub layout_version: u32,
    pub _pad0: u32,
}

/// Traffic translated by one rule (per CPU; summed by the agent). A flow
/// counts under its DNAT rule and, if different, its SNAT rule. `refused`:
/// new flows the rule refused: a DNAT rule's or listener's ACL refused the
/// client, or a SNAT rule had no free port (or ICMP echo id) left for it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct RuleStats {
    pub packets: u64,
    pub bytes: u64,
    pub refused: u64,
}

/// Declares the per-CPU counters from one table: each line is a variant,
/// its metric name (the variant's name in snake case; a test checks) and
/// whether the packet counted there is dropped or passed. The order is the
/// index into `counters`: new counters go last.
macro_rules! counters {
    ($($(#[$doc:meta])* $variant:ident = $name:literal, $verdict:ident;)*) => {
        /// Per-CPU counters (index into `counters`).
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Counter {
            $($(#[$doc])* $variant,)*
        }

        pub const COUNTER_COUNT: u32 = Counter::ALL.len() as u32;

        impl Counter {
            pub const ALL: [Counter; [$(Counter::$variant),*].len()] = [$(Counter::$variant),*];

            /// Whether the packet counted here is dropped (every other
            /// counter passes it).
            pub const fn is_drop(self) -> bool {
                match self {
                    $(Counter::$variant => counters!(@drop $verdict),)*
                }
            }

            /// The counter's name in `lbagent maps`, status and metrics.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)*
                }
            }
        }
    };
    (@drop drop) => { true };
    (@drop pass) => { false };
}

counters! {
    /// Every packet the ingress program sees.
    Packets = "packets", pass;
    NewFlows = "new_flows", pass;
    /// A packet translated by its flow, in the direction that opened it.
    TranslatedOriginal = "translated_original", pass;
    TranslatedReply = "translated_reply", pass;
    IcmpErrorsTranslated = "icmp_errors_translated", pass;
    PassedNonIpv4 = "passed_non_ipv4", pass;
    PassedFragment = "passed_fragment", pass;
    PassedUnmatched = "passed_unmatched", pass;
    ExpiredFlows = "expired_flows", pass;
    DropNoFreePort = "drop_no_free_port", drop;
    DropConntrackInsert = "drop_conntrack_insert", drop;
    DropRewriteFailed = "drop_rewrite_failed", drop;
    DropMalformed = "drop_malformed", drop;
    FragmentsTranslated = "fragments_translated", pass;
    DropFragmentUntracked = "drop_fragment_untracked", drop;
    DropUntranslatable = "drop_untranslatable", drop;
    ConntrackPairRepaired = "conntrack_pair_repaired", pass;
    ConntrackPairConflict = "conntrack_pair_conflict", pass;
    ConntrackPromoted = "conntrack_promoted", pass;
    /// A promotion refused: the flow stays in `ct_new`.
    ConntrackEstablishedFull = "conntrack_established_full", pass;
    TcpRstOutOfWindow = "tcp_rst_out_of_window", pass;
    FlowsReopened = "flows_reopened", pass;
    IcmpErrorsLocalTranslated = "icmp_errors_local_translated", pass;
    LocalFlows = "local_flows", pass;
    DropAcl = "drop_acl", drop;
    /// A flow-log record the program could not write: `flow_events` was
    /// full (the agent reads it too slowly). The packet passes.
    FlowLogRingFull = "flow_log_ring_full", pass;
    /// A logged flow without room in `flow_acct`: it gets a start record
    /// but no counts and no end record.
    FlowLogAcctFull = "flow_log_acct_full", pass;
}

#[cfg(feature = "user")]
mod user {
    use super::*;

    pod!(
        Tuple,
        CtEntry,
        CtEntryPrev,
        CtAdoptScratch,
        FragKey,
        FragEntry,
        AclKey,
        DnatKey,
        DnatRule,
        BackendKey,
        Backend,
        SnatKey,
        SnatRule,
        NatConfig,
        Meta,
        RuleStats,
        ProxyGuard,
        MtuKey,
        ZoneCtLimits,
        ZoneCtFlows,
        ZoneCtRefused
    );
}

/// Compile-time proof that no type has implicit padding: the size equals the
/// sum of the field sizes.
const _: () = {
    assert!(core::mem::size_of::<Tuple>() == 16);
    assert!(core::mem::size_of::<CtEntry>() == 16 + 8 + 4 + 4 + 4 + 4 + 4 + 1 + 1 + 1 + 1);
    assert!(core::mem::size_of::<CtEntryPrev>() == 16 + 8 + 8 + 4 + 4 + 4 + 4 + 1 + 1 + 1 + 1 + 4);
    assert!(core::mem::size_of::<FragKey>() == 16);
    assert!(core::mem::size_of::<FragEntry>() == 16);
    assert!(core::mem::size_of::<DnatKey>() == 4 + 2 + 1 + 1 + 2 + 2);
    assert!(core::mem::size_of::<DnatRule>() == 24);
    assert!(core::mem::size_of::<AclKey>() == 8);
    assert!(core::mem::size_of::<BackendKey>() == 8);
    assert!(core::mem::size_of::<Backend>() == 8);
    assert!(core::mem::size_of::<SnatKey>() == 12);
    assert!(core::mem::size_of::<SnatRule>() == 16);
    assert!(core::mem::size_of::<NatConfig>() == 32);
    assert!(core::mem::size_of::<Meta>() == 8);
    assert!(core::mem::size_of::<RuleStats>() == 24);
    assert!(core::mem::size_of::<ProxyGuard>() == 8);
    assert!(core::mem::size_of::<MtuKey>() == 8);
    assert!(core::mem::size_of::<ZoneCtLimits>() == 8);
    assert!(core::mem::size_of::<ZoneCtFlows>() == 16);
    assert!(core::mem::size_of::<ZoneCtRefused>() == 16);
};

/// `proxy_guard[0]`: whose sockets may open connections through a load
/// balancer's host-side link `h…1` (toward its inner address, where the
/// engine DNATs mapped ports to the VPC backends). Root's are always
/// allowed (root on the host is trusted); `uid` is haproxy's workers'.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyGuard {
    pub uid: u32,
    /// `PROXY_GUARD_F_UID`: `uid` is set (until then only root may open).
    pub flags: u32,
}

pub const PROXY_GUARD_F_UID: u32 = 1;

/// `egress_mtu` key: an interface of a zone's namespace (interface indexes
/// repeat across namespaces). The value (`u32`) is the largest IPv4 packet
/// that leaves by that interface unfragmented as `ip_forward` sees it: the
/// smaller of the link's MTU and every route MTU through it. The agent
/// writes every interface of a zone at each pass; the fast path
/// (`lbagent-ebpf/src/route.rs`) forwards only packets whose every segment
/// fits, and leaves the rest (and interfaces without an entry) to the stack.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MtuKey {
    pub zone: u16,
    pub _pad: u16,
    pub ifindex: u32,
}

/// `egress_mtu` size: interfaces of every zone (a load balancer or gateway
/// has a few).
pub const EGRESS_MTU_MAX: u32 = 16_384;

/// Per-zone conntrack shares, all keyed by zone (`u32`), sized for every
/// zone id. One tenant (a load balancer or gateway) cannot take the tables
/// from the others: a zone at its `new` limit has its new flows dropped
/// (counted `drop_conntrack_insert`), one at its `established` limit keeps
/// its further flows in `ct_new` (counted `conntrack_established_full`),
/// where they work but stay within its `new` share.
pub const ZONE_CT_MAX: u32 = 65_536;

/// `zone_ct_limits` value (written by the agent): the most flows (not
/// halves) the zone may hold in each table; 0 = no limit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct ZoneCtLimits {
    pub established: u32,
    pub new: u32,
}

/// `zone_ct_flows` value: the flows the zone holds in `ct` and `ct_new`.
/// The program adds with atomic adds when it creates, promotes and expires
/// flows; the agent sets the true counts from a dump at every collection
/// pass (entries the kernel evicts from `ct_new`, and the agent's own
/// deletions, are seen only there). A count may run a few flows off
/// between passes (adds made while the agent counted are overwritten), so a
/// limit holds to within that.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct ZoneCtFlows {
    pub established: u64,
    pub new: u64,
}

/// `zone_ct_refused` value (the program's atomic adds; the agent only
/// reads, and removes a zone's entry with the zone): packets refused a
/// promotion to `ct` by the zone's `established` limit, and packets that
/// would have opened a flow refused by its `new` limit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct ZoneCtRefused {
    pub established: u64,
    pub new: u64,
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{format, string::String};

    use super::*;

    /// The variant's name in snake case.
    fn snake(variant: &str) -> String {
        let mut out = String::new();
        for (i, ch) in variant.chars().enumerate() {
            if ch.is_ascii_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(ch.to_ascii_lowercase());
        }
        out
    }

    #[test]
    fn every_counter_is_named_like_its_variant_and_indexed_in_order() {
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(c.name(), snake(&format!("{c:?}")), "{c:?}");
            assert_eq!(*c as usize, i, "{c:?}");
        }
        assert_eq!(COUNTER_COUNT as usize, Counter::ALL.len());
    }
}
