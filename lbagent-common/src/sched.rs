//! Scheduler tables of direct-mode listeners (`lbagent-ebpf/src/sched.rs`
//! reads them, `lbagent/src/lb/sched.rs` builds them). The map table is in
//! `docs/architecture.md`, *Maps*.
//!
//! A DNAT rule whose flags carry a `DNAT_F_SCHED_*` bit picks a new flow's
//! backend from its table in `sched_tables` (hash of maps: rule id → an
//! array of `SCHED_TABLE_SIZE` backends, plus one digest slot), instead of
//! `hash % backend_count` over `dnat_backends`. The agent builds a whole
//! new table and swaps it in with one map update, so a packet sees either
//! the old table or the new one, never a mix.

/// Slots of a table: a prime (Maglev needs every skip coprime with it),
/// about 160 slots per backend at 100 backends.
pub const SCHED_TABLE_SIZE: u32 = 16_381;
/// The slot after the table holds the agent's digest of it (`Backend`
/// bytes reinterpreted: `addr` = low 32 bits, `port` and `_pad0` = the next
/// 32); the program never indexes it.
pub const SCHED_DIGEST_SLOT: u32 = SCHED_TABLE_SIZE;
/// Entries of an inner table array.
pub const SCHED_TABLE_LEN: u32 = SCHED_TABLE_SIZE + 1;
/// Rules with a table at once (each table is 131 KB, allocated when used).
pub const SCHED_TABLES_MAX: u32 = 4_096;

/// `DnatRule::flags`: Maglev by source address (`sch`).
pub const DNAT_F_SCHED_SOURCE: u32 = 16;
/// Maglev by the 5-tuple (`tch`).
pub const DNAT_F_SCHED_TUPLE: u32 = 32;
/// In turn, the table walked by a per-CPU position (`rr`, `wrr`).
pub const DNAT_F_SCHED_TURN: u32 = 64;

/// `DnatRule::flags`: the backend with the fewest active flows per weight
/// (`wlc`), among the first `SCHED_LEAST_MAX` of `dnat_backends`.
pub const DNAT_F_SCHED_LEAST: u32 = 128;
/// Backends a least-connection rule compares (a bounded loop in the program).
pub const SCHED_LEAST_MAX: u32 = 16;
/// Entries of `sched_active` (backends of all least-connection rules).
pub const SCHED_ACTIVE_MAX: u32 = 65_536;

/// `sched_active` key: a least-connection rule's backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActiveKey {
    pub rule_id: u32,
    pub addr: [u8; 4],
    pub port: u16,
    pub _pad0: u16,
}

/// `sched_active` value. The program adds 1 to `active` when it opens a
/// flow to the backend and subtracts 1 when the flow starts closing (FIN
/// both ways or RST), with atomic adds (no fetch: Linux 5.10). Flows that
/// end otherwise (timeouts, evictions) are corrected by the agent, which
/// recounts from conntrack on every repair pass and writes the whole value
/// (a concurrent add in that instant is lost until the next recount).
/// `active` may dip below 0 when a flow opened before counting began
/// closes; the program reads it as 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Active {
    pub active: i64,
    pub weight: u32,
    pub _pad0: u32,
}

const _: () = {
    assert!(core::mem::size_of::<ActiveKey>() == 12);
    assert!(core::mem::size_of::<Active>() == 16);
};

#[cfg(feature = "user")]
pod!(ActiveKey, Active);

/// Every scheduler bit of `DnatRule::flags`.
pub const DNAT_F_SCHED_MASK: u32 = DNAT_F_SCHED_SOURCE | DNAT_F_SCHED_TUPLE | DNAT_F_SCHED_TURN | DNAT_F_SCHED_LEAST;
