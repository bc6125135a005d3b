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

/// Rule id → the rule's table (an inner `Array<Backend, SCHED_TABLE_LEN>`).
pub const MAP_SCHED_TABLES: &str = "sched_tables";
/// Per CPU: rule id → the next position of a round-robin rule.
pub const MAP_SCHED_TURNS: &str = "sched_turns";

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
pub const DNAT_F_SCHED_MASK: u32 = DNAT_F_SCHED_SOURCE | DNAT_F_SCHED_TUPLE | DNAT_F_SCHED_TURN;
