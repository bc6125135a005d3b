//! Conntrack: two tables, paired entries, the state machine, and creation of
//! a flow's two entries with collision-free source port allocation.
//!
//! Tables. A flow lives in `ct_new` (LRU) until it is established, then both
//! halves move to `ct` (a plain hash the kernel never evicts from). A flood
//! of new flows only churns `ct_new`; established flows of every zone stay.
//! Lookups try `ct` first. If `ct` is full, a flow stays in `ct_new`
//! (counted `conntrack_established_full`) and keeps working.
//!
//! Pairing. Each entry's `xlate.reversed()` is its pair's key, and the pair's
//! `xlate.reversed()` must lead back. Every hit checks its pair: a missing
//! pair (evicted or deleted by hand) is re-created from this half; a pair
//! that leads elsewhere belongs to another flow, so this half is stale and is
//! removed (the packet then starts a new flow). No translated tuple is ever
//! shared by two flows.
//!
//! Races between CPUs. Allocation claims a translated tuple by inserting its
//! reply key into `ct_new` with `BPF_NOEXIST` and *then* checks `ct`;
//! promotion inserts into `ct` *before* deleting from `ct_new`. So whichever
//! order two CPUs run in, a tuple held in either table is never claimed twice.
//! A tuple held by an expired flow is freed for the claim by deleting that
//! flow, and Linux 5.10's BPF has no compare-and-delete: two CPUs that read
//! the same expired entry could each delete it and insert their own, the
//! second deleting the first's new entry. The reclaim reads the entry again
//! right before each delete (same creation time) and the claimer reads its
//! reply entry back after its insert, which leaves one window: a CPU
//! interrupted between that second read and its delete, while another CPU
//! deletes, inserts and reads back.
//! A lookup that misses `ct` and then `ct_new` may have run while another
//! CPU promoted the flow (into `ct` after the first lookup, out of `ct_new`
//! before the second): it looks in `ct` once more, where the flow then is.
//! Without that, the packet that completes a handshake, taken by two CPUs
//! at once, opened the flow a second time on another SNAT port. Only a
//! packet of no flow pays the third lookup. A pair is looked up in its
//! half's table first, then in the other one, which finds it in either
//! order for the same reason.
//! Entry fields are written without locks: two CPUs updating one flow can
//! lose a timestamp or a sequence update, which only delays expiry or widens
//! the RST window by one packet; the state only moves forward.
//!
//! Upgrades. An agent of the next layout starts its programs on tables of
//! its own while the previous layout's programs still run on theirs, which
//! it pins as `ct_prev` and `ct_new_prev` (entries of the previous layout,
//! `CtEntryPrev`) and flags in `ct_adopt`. While flagged, a key found in
//! neither table is looked up there, and a live flow found is adopted: both
//! its halves converted into the same table of this layout (insert without
//! replacing: a CPU that adopted or created it first wins), then marked
//! adopted there, so that a flow this layout closes or frees later is not
//! adopted again. A half whose pair leads elsewhere is stale and is left.
//! A translated tuple that a previous-layout flow holds is busy for the
//! port allocation in the same way (taken, even when there is no room to
//! adopt its flow). So a flow keeps its translation whichever layout's
//! program sees its next packet, and one opened by the previous programs
//! before its zone switched is found by the new ones. The converse is not
//! covered: while one zone's hooks are replaced one after the other (a few
//! milliseconds), its old programs do not see the flows its new ones
//! opened. The agent copies what was never adopted (idle flows) when every
//! zone runs the new programs, then clears the flag (`migrate`).
//!
//! Tenants. Each zone may hold at most its share of each table
//! (`zone_ct.rs`): a zone that filled its share of `ct` keeps its further
//! flows in `ct_new` within its share there, so one tenant's load or SYN
//! flood cannot take the tables from the others.
//!
//! State machine (mirrored in both entries; see `lbagent_common::CT_*`):
//! `NEW` --reply--> `REPLIED` --TCP: originator's ACK; UDP/other: active 2 s
//! after creation--> `ESTABLISHED` (promoted to `ct`); FIN both ways or an
//! in-window RST --> `CLOSING`. A SYN on a `CLOSING` flow replaces it.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
};
use lbagent_common::*;

use crate::{
    counters::count,
    hdr::tcp::{ACK as TCP_ACK, FIN as TCP_FIN, RST as TCP_RST, SYN as TCP_SYN},
    maps::{CT, CT_ADOPT, CT_ADOPT_SCRATCH, CT_NEW_PREV, CT_NEW_TABLE, CT_PREV, NAT_CONFIG},
    parse::{Kind, Packet},
};

const NS: u64 = 1_000_000_000;
/// Source port search: rounds, each from a fresh random offset, of this many
/// consecutive ports (as Linux's `nf_nat_l4proto_unique_tuple`).
const PORT_ROUNDS: u32 = 4;
const PORT_TRIES_PER_ROUND: u32 = 32;

#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
fn random() -> u32 {
    // SAFETY: bpf_get_prandom_u32 has no preconditions.
    unsafe { bpf_get_prandom_u32() }
}

/// Which conntrack table an entry is in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Table {
    Established,
    New,
}

#[inline(always)]
fn get(t: Table, key: &Tuple) -> Option<*mut CtEntry> {
    match t {
        Table::Established => CT.get_ptr_mut(key),
        Table::New => CT_NEW_TABLE.get_ptr_mut(key),
    }
}

#[inline(always)]
fn insert(t: Table, key: &Tuple, e: &CtEntry, flags: u64) -> bool {
    match t {
        Table::Established => CT.insert(key, e, flags).is_ok(),
        Table::New => CT_NEW_TABLE.insert(key, e, flags).is_ok(),
    }
}

/// Deletes `key` from table `t`; whether this call deleted it (another CPU
/// may have been first).
#[inline(always)]
fn remove(t: Table, key: &Tuple) -> bool {
    match t {
        Table::Established => CT.remove(key).is_ok(),
        Table::New => CT_NEW_TABLE.remove(key).is_ok(),
    }
}

/// The entry for `key` in either table (`ct` first, and `ct` again after a
/// miss in both: see the module docs on races), or adopted from the
/// previous layout's during an upgrade.
#[inline(always)]
fn find(key: &Tuple) -> Option<(Table, *mut CtEntry)> {
    match find_here(key) {
        Some(found) => Some(found),
        None => adopt(key),
    }
}

/// [`find`] in this layout's tables only: for the reclaim, a global
/// function whose frame leaves no room for the adoption's (the port
/// search's claim adopts a busy tuple before it reclaims it).
#[inline(always)]
fn find_here(key: &Tuple) -> Option<(Table, *mut CtEntry)> {
    if let Some(p) = get(Table::Established, key) {
        return Some((Table::Established, p));
    }
    if let Some(p) = get(Table::New, key) {
        return Some((Table::New, p));
    }
    get(Table::Established, key).map(|p| (Table::Established, p))
}

/// During an upgrade (`ct_adopt`), the flow of `key` in the previous
/// layout's tables, adopted into this layout's (module docs, *Upgrades*).
#[inline(always)]
fn adopt(key: &Tuple) -> Option<(Table, *mut CtEntry)> {
    match adopt_status(key) {
        CT_ADOPT_ESTABLISHED => get(Table::Established, key).map(|p| (Table::Established, p)),
        CT_ADOPT_NEW => get(Table::New, key).map(|p| (Table::New, p)),
        _ => None,
    }
}

/// [`lbagent_ct_adopt`] on `key` while the flag is set, else
/// `CT_ADOPT_ABSENT`.
#[inline(always)]
fn adopt_status(key: &Tuple) -> u32 {
    if CT_ADOPT.get(0).is_none_or(|on| *on == 0) {
        return CT_ADOPT_ABSENT;
    }
    let k = tuple_words(key);
    lbagent_ct_adopt(k[0], k[1])
}

/// The previous layout's half under `key` (`ct_prev`, `ct_new_prev`, and
/// `ct_prev` again: an old program may promote it between the first two
/// lookups) and whether it is established.
#[inline(always)]
fn previous_half(key: &Tuple) -> Option<(Table, *mut CtEntryPrev)> {
    if let Some(p) = CT_PREV.get_ptr_mut(key) {
        return Some((Table::Established, p));
    }
    if let Some(p) = CT_NEW_PREV.get_ptr_mut(key) {
        return Some((Table::New, p));
    }
    CT_PREV.get_ptr_mut(key).map(|p| (Table::Established, p))
}

/// Inserts a half unless its key is there already (another CPU adopted it
/// first); whether the key holds a half now.
#[inline(always)]
fn place(t: Table, key: &Tuple, e: &CtEntry) -> bool {
    insert(t, key, e, BPF_NOEXIST as u64) || get(t, key).is_some()
}

/// Adopts the previous layout's flow of a key (as two words): both halves
/// converted into the same table of this layout (`ct_new` when `ct` has no
/// room), never over an entry there, then marked adopted in the previous
/// tables (`CtEntryPrev::adopted`). A half whose pair leads elsewhere is
/// stale (its translated tuple is another flow's now) and is not adopted,
/// as this layout's lookup would drop it. A global function, verified once
/// (it runs inside the port search). Returns `CT_ADOPT_*`.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn lbagent_ct_adopt(key0: u64, key1: u64) -> u32 {
    // SAFETY: any 16 bytes are a valid `Tuple` (plain integers).
    let key: Tuple = unsafe { core::mem::transmute::<[u64; 2], Tuple>([key0, key1]) };
    let Some((mut table, ptr)) = previous_half(&key) else { return CT_ADOPT_ABSENT };
    // Converted in this CPU's room, not on the stack: this function's
    // frame adds to the calling program's (512 bytes for both). The half
    // is read once, into the room: an old program may free its element
    // (an LRU eviction) and another flow take it meanwhile.
    let Some(room) = CT_ADOPT_SCRATCH.get_ptr_mut(0) else { return CT_ADOPT_HELD };
    // SAFETY: map value pointers stay valid for the program run; the
    // per-CPU room is this CPU's alone while this program runs, and no one
    // else writes it.
    let room = unsafe { &mut *room };
    // SAFETY: as above.
    if unsafe { (*ptr).adopted } != 0 {
        return CT_ADOPT_ABSENT;
    }
    // SAFETY: as above.
    unsafe { (*ptr).adopt_into(&mut room.half) };
    let pair_key = room.half.xlate.reversed();
    let pair = match previous_half(&pair_key) {
        Some((_, pp)) => {
            // SAFETY: as above.
            unsafe { (*pp).adopt_into(&mut room.pair) };
            if room.pair.xlate != key.reversed() {
                return CT_ADOPT_ABSENT;
            }
            Some(pp)
        }
        // A lost pair: re-created by the lookup that follows, as in this
        // layout.
        None => None,
    };
    let mut placed = place(table, &key, &room.half);
    if !placed && table == Table::Established {
        table = Table::New;
        placed = place(table, &key, &room.half);
    }
    if !placed {
        return CT_ADOPT_HELD;
    }
    if let Some(pp) = pair {
        place(table, &pair_key, &room.pair);
        // SAFETY: as above.
        unsafe { (*pp).adopted = 1 };
    }
    // SAFETY: as above.
    unsafe { (*ptr).adopted = 1 };
    if table == Table::Established { CT_ADOPT_ESTABLISHED } else { CT_ADOPT_NEW }
}

#[inline(always)]
pub fn config() -> NatConfig {
    NAT_CONFIG.get(0).copied().unwrap_or_default()
}

#[inline(always)]
fn fresh(cfg: &NatConfig, e: &CtEntry, proto: u8, now: u64) -> bool {
    since(now, e.last_seen_ns) <= cfg.timeout_s(proto, e.state) as u64 * NS
}

/// Nanoseconds from `then` to `now`, 0 when `then` is later: another CPU
/// may stamp an entry after this CPU read the clock (two CPUs taking one
/// flow's packets in the same microsecond, a first fragment and a later
/// one), and a wrapped difference would make that entry centuries old.
#[inline(always)]
pub fn since(now: u64, then: u64) -> u64 {
    now.saturating_sub(then)
}

/// `a` is after `b` in sequence space.
#[inline(always)]
fn after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

pub enum Lookup {
    /// A live entry: rewrite to this tuple.
    Hit(CtEntry),
    /// No entry, or an expired/stale/replaced one (already removed).
    Miss { expired: bool },
}

/// Finds the entry for `p`, checks and repairs its pair, advances the flow
/// state and refreshes its timer.
#[inline(always)]
pub fn lookup(p: &Packet, now: u64) -> Lookup {
    let Some((table, ptr)) = find(&p.tuple) else { return Lookup::Miss { expired: false } };
    // SAFETY: a map value pointer stays valid for the program run; fields are
    // plain integers, and concurrent writers are tolerated (module docs).
    let e = unsafe { &mut *ptr };
    let cfg = config();
    let proto = p.tuple.proto;
    let flags = p.tcp.flags;
    let refresh = since(now, e.last_seen_ns) > NS;
    let pair_key = e.xlate.reversed();
    // The pair is normally in the same table (the other one during a promotion).
    let other = if table == Table::New { Table::Established } else { Table::New };
    let mut pair_ptr = match get(table, &pair_key) {
        Some(pp) => Some((table, pp)),
        None => get(other, &pair_key).map(|pp| (other, pp)),
    };
    if let Some((_, pp)) = pair_ptr {
        // SAFETY: as above.
        if unsafe { (*pp).xlate } != p.tuple.reversed() {
            // Our translated tuple belongs to another flow: this half is stale.
            remove(table, &p.tuple);
            count(Counter::ConntrackPairConflict);
            return Lookup::Miss { expired: false };
        }
    }
    // SAFETY: as above.
    let pair_fresh = pair_ptr.is_some_and(|(_, pp)| fresh(&cfg, unsafe { &*pp }, proto, now));
    if !fresh(&cfg, e, proto, now) && !pair_fresh {
        // Idle in both directions (a one-way stream keeps one half warm).
        if let Some((pt, _)) = pair_ptr {
            remove(pt, &pair_key);
        }
        if remove(table, &p.tuple) {
            crate::zone_ct::ended(p.tuple.zone, table == Table::Established);
        }
        return Lookup::Miss { expired: true };
    }
    let reply_dir = e.flags & CT_F_REPLY != 0;
    if proto == PROTO_TCP && flags & TCP_SYN != 0 && flags & TCP_ACK == 0 && !reply_dir && e.state == CT_CLOSING {
        // A new connection reusing the tuple of a closed one.
        if let Some((pt, _)) = pair_ptr {
            remove(pt, &pair_key);
        }
        if remove(table, &p.tuple) {
            crate::zone_ct::ended(p.tuple.zone, table == Table::Established);
        }
        count(Counter::FlowsReopened);
        return Lookup::Miss { expired: false };
    }
    if pair_ptr.is_none() {
        // Lost half (LRU eviction, or deleted by hand): re-create it here,
        // without this direction's TCP sequence state.
        let pair = CtEntry {
            xlate: p.tuple.reversed(),
            flags: (e.flags ^ CT_F_REPLY) & !(CT_F_FIN | CT_F_SEQ),
            seq_end: 0,
            max_win: 0,
            wscale: CT_WSCALE_NONE,
            ..*e
        };
        if insert(table, &pair_key, &pair, BPF_NOEXIST as u64) {
            count(Counter::ConntrackPairRepaired);
        }
        pair_ptr = get(table, &pair_key).map(|pp| (table, pp));
    }
    // SAFETY: as above.
    let pair = pair_ptr.map(|(_, pp)| unsafe { &mut *pp });

    let mut state = e.state;
    if proto == PROTO_TCP {
        state = track_tcp(p, e, pair.as_deref(), state);
    } else if state == CT_REPLIED
        && proto != PROTO_ICMP
        && ct_ms_since(ct_clock_ms(now), e.created_ms) > UDP_STREAM_AFTER_MS
    {
        // Still active after the answer: a stream (ICMP echo never is).
        state = CT_ESTABLISHED;
    }
    if state == CT_NEW && reply_dir {
        state = CT_REPLIED;
    }
    let changed = state != e.state;
    if changed && state == CT_CLOSING {
        crate::sched::flow_closing(e, &p.tuple);
    }
    if changed || refresh {
        e.state = state;
        e.last_seen_ns = now;
    }
    // Copied before a promotion deletes the entry: a deleted element of the
    // LRU table is free for any CPU's next insert (another flow's entry).
    let hit = *e;
    if let Some(pair) = pair {
        if changed {
            pair.state = state;
            pair.last_seen_ns = now;
        }
        if table == Table::New && state == CT_ESTABLISHED {
            // The pair moves with the state this CPU found: another CPU
            // that took the same packet first may have written its own
            // half's state but not yet the pair's, and this CPU, finding
            // nothing changed, would write neither; the pair would enter
            // `ct` short of established, and stay so. (Set in place: a
            // copy on the stack is more than the verifier allows.)
            pair.state = state;
            promote(&p.tuple, &hit, &pair_key, pair);
        }
    }
    Lookup::Hit(hit)
}

/// TCP: records the sequence space and window this direction uses, and
/// returns the flow's next state.
#[inline(always)]
fn track_tcp(p: &Packet, e: &mut CtEntry, pair: Option<&CtEntry>, state: u8) -> u8 {
    let t = &p.tcp;
    let end = t.seq.wrapping_add(t.seq_len);
    if t.flags & TCP_SYN != 0 {
        e.wscale = match t.wscale {
            Some(s) => s,
            None => CT_WSCALE_NONE,
        };
    }
    if t.flags & TCP_RST != 0 {
        // RFC 793 / nf_conntrack: an RST counts only inside the window the
        // receiver offered around what this side has sent. Unknown sequence
        // state (a flow picked up mid-stream, a refused SYN) accepts it.
        if let Some(pair) = pair
            && e.flags & CT_F_SEQ != 0
            && pair.flags & CT_F_SEQ != 0
        {
            let win = pair.max_win;
            let lo = e.seq_end.wrapping_sub(win).wrapping_sub(1);
            let hi = e.seq_end.wrapping_add(win).wrapping_add(1);
            if !(after(t.seq, lo) && after(hi, t.seq)) {
                count(Counter::TcpRstOutOfWindow);
                return state;
            }
        }
        return CT_CLOSING;
    }
    // Window scaling applies only when both SYNs offered it (RFC 7323).
    let shift = match pair {
        Some(pair) if t.flags & TCP_SYN == 0 && e.wscale != CT_WSCALE_NONE && pair.wscale != CT_WSCALE_NONE => e.wscale,
        _ => 0,
    };
    let win = (t.window as u32) << (shift & 15);
    if win > e.max_win {
        e.max_win = win;
    }
    if e.flags & CT_F_SEQ == 0 || after(end, e.seq_end) {
        e.seq_end = end;
        e.flags |= CT_F_SEQ;
    }
    if t.flags & TCP_FIN != 0 {
        e.flags |= CT_F_FIN;
        if pair.is_some_and(|pair| pair.flags & CT_F_FIN != 0) {
            return CT_CLOSING;
        }
    }
    let reply_dir = e.flags & CT_F_REPLY != 0;
    if state == CT_REPLIED && !reply_dir && t.flags & TCP_ACK != 0 && t.flags & TCP_SYN == 0 {
        // The originator acknowledged the answer: the handshake is complete.
        return CT_ESTABLISHED;
    }
    state
}

/// Moves an established flow from `ct_new` to `ct` (insert first, then
/// delete: see the module docs). When `ct` is full, or the zone holds its
/// share of it (`zone_ct`), the flow stays. A half already in `ct` is this
/// flow's (a translated tuple is never shared): another CPU promoting the
/// same flow put it there, which is not a full table; whichever CPU
/// deletes the `ct_new` entry counts the promotion.
#[inline(always)]
fn promote(key: &Tuple, e: &CtEntry, pair_key: &Tuple, pair: &CtEntry) {
    if !crate::zone_ct::may_promote(key.zone) {
        count(Counter::ConntrackEstablishedFull);
        return;
    }
    let inserted_pair = insert(Table::Established, pair_key, pair, BPF_NOEXIST as u64);
    if !inserted_pair && get(Table::Established, pair_key).is_none() {
        count(Counter::ConntrackEstablishedFull);
        return;
    }
    if !insert(Table::Established, key, e, BPF_NOEXIST as u64) && get(Table::Established, key).is_none() {
        if inserted_pair {
            let _ = CT.remove(pair_key);
        }
        count(Counter::ConntrackEstablishedFull);
        return;
    }
    remove(Table::New, pair_key);
    if remove(Table::New, key) {
        crate::zone_ct::promoted(key.zone);
        count(Counter::ConntrackPromoted);
    }
}

/// The live entry for `key` without touching its state or timer (ICMP errors
/// and later fragments must not keep a flow alive or move it forward).
#[inline(always)]
pub fn peek(key: &Tuple, now: u64) -> Option<CtEntry> {
    let (_, ptr) = find(key)?;
    // SAFETY: a map value pointer stays valid for the program run.
    let e = unsafe { *ptr };
    let cfg = config();
    if fresh(&cfg, &e, key.proto, now) {
        return Some(e);
    }
    let (_, pp) = find(&e.xlate.reversed())?;
    // SAFETY: as above.
    let pair = unsafe { *pp };
    if pair.xlate == key.reversed() && fresh(&cfg, &pair, key.proto, now) { Some(e) } else { None }
}

/// What a new flow should become.
pub struct NewFlow {
    pub xlate: Tuple,
    pub flags: u8,
    pub dnat_rule: u32,
    pub snat_rule: u32,
    /// Source port range to allocate from, and whether to start at random.
    pub port_min: u16,
    pub port_max: u16,
    pub random: bool,
    /// The rule schedules by fewest active flows: the backend's count goes
    /// up when this CPU creates the flow (never when another CPU did).
    pub least: bool,
}

/// Frees `key` if it holds an expired flow (both halves idle): an expired
/// flow must not keep its port from a new one. Whether the tuple is free
/// now.
#[inline(always)]
fn reclaim_expired(key: &Tuple, now: u64) -> bool {
    match reclaim(key, now) {
        CT_RECLAIM_FREED => {
            count(Counter::ExpiredFlows);
            true
        }
        CT_RECLAIM_ABSENT => true,
        _ => false,
    }
}

/// [`lbagent_ct_reclaim`] on a tuple: `CT_RECLAIM_*`.
#[inline(always)]
pub fn reclaim(key: &Tuple, now: u64) -> u32 {
    let k = tuple_words(key);
    lbagent_ct_reclaim(k[0], k[1], now)
}

/// A tuple as the two words a global function takes it in.
#[inline(always)]
fn tuple_words(t: &Tuple) -> [u64; 2] {
    // SAFETY: `Tuple` is 16 bytes of plain integers (repr(C), no padding
    // bytes: asserted in lbagent-common), as are two u64s.
    unsafe { core::mem::transmute::<Tuple, [u64; 2]>(*t) }
}

/// `reclaim_expired` as a global BPF function: the verifier checks it once,
/// on its own, instead of once for every port the allocation's loop may
/// probe (inlined in each probe, the program exceeded the verifier's
/// million instructions), and garbage collection (`ct_gc.rs`) runs it on
/// each idle half the agent hands it. Scalars in (the tuple as two words,
/// the clock), `CT_RECLAIM_*` out: the tuple is held by a live flow, was
/// held by an expired one (both halves deleted now, the zone's count taken
/// down), or is free.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn lbagent_ct_reclaim(key0: u64, key1: u64, now: u64) -> u32 {
    // SAFETY: any 16 bytes are a valid `Tuple` (plain integers).
    let key: Tuple = unsafe { core::mem::transmute::<[u64; 2], Tuple>([key0, key1]) };
    // Entries are read through their map pointers, not copied: the
    // program's own frame leaves this function less than 100 bytes of the
    // 512-byte stack.
    let Some(cfg) = NAT_CONFIG.get(0) else { return CT_RECLAIM_LIVE };
    let Some((table, ptr)) = find_here(&key) else { return CT_RECLAIM_ABSENT };
    // SAFETY: a map value pointer stays valid for the program run.
    let e = unsafe { &*ptr };
    if fresh(cfg, e, key.proto, now) {
        return CT_RECLAIM_LIVE;
    }
    let created = e.created_ms;
    let pair_key = e.xlate.reversed();
    if let Some((pt, pp)) = find_here(&pair_key) {
        // SAFETY: as above.
        let pair = unsafe { &*pp };
        if pair.xlate == key.reversed() {
            if fresh(cfg, pair, key.proto, now) {
                return CT_RECLAIM_LIVE;
            }
            remove_same(pt, &pair_key, pair.created_ms);
        }
    }
    if !remove_same(table, &key, created) {
        // Another CPU took the tuple (or the flow came back) meanwhile.
        return CT_RECLAIM_LIVE;
    }
    crate::zone_ct::ended(key.zone, table == Table::Established);
    CT_RECLAIM_FREED
}

/// Deletes `key` from `table` while it holds the entry created at
/// `created_ms` (read a moment ago). BPF on Linux 5.10 has no
/// compare-and-delete: the entry is read again right before the delete,
/// which leaves another CPU only the few instructions in between to
/// replace it (see the module docs on races).
#[inline(always)]
fn remove_same(table: Table, key: &Tuple, created_ms: u32) -> bool {
    match get(table, key) {
        // SAFETY: a map value pointer stays valid for the program run.
        Some(p) if unsafe { (*p).created_ms } == created_ms => remove(table, key),
        _ => false,
    }
}

/// Claims translated tuple `x` for a new flow: its reply key goes into
/// `ct_new`, and must not be held in `ct` (see the module docs on races).
/// A tuple held by an expired flow is reclaimed (as Linux takes an expired
/// entry's tuple): with one destination and many short flows (DNS through
/// one EIP) most of the port range is held by flows that expired since the
/// last GC pass.
///
/// A busy tuple is looked up in both tables before the insert is tried:
/// the kernel takes a free element for an LRU insert before it finds the
/// key present (and gives it back), which costs more than a lookup and,
/// when the CPU's free list is empty in a full `ct_new`, evicts entries to
/// refill it. After the insert the reply entry is read back: a CPU that
/// reclaimed the tuple on a stale read could have replaced it.
#[inline(always)]
fn claim(x: &Tuple, reply: &CtEntry, now: u64) -> bool {
    let rkey = x.reversed();
    let mut busy = get(Table::New, &rkey).is_some() || get(Table::Established, &rkey).is_some();
    if !busy {
        // A flow of the previous layout holds it (adopted now, so the
        // reclaim below sees it), or holds it without room to adopt it.
        match adopt_status(&rkey) {
            CT_ADOPT_ABSENT => {}
            CT_ADOPT_HELD => return false,
            _ => busy = true,
        }
    }
    if busy && !reclaim_expired(&rkey, now) {
        return false;
    }
    // Another CPU may claim it between the lookup and the insert.
    if !insert(Table::New, &rkey, reply, BPF_NOEXIST as u64) {
        return false;
    }
    // A promotion into `ct` since the lookup: the tuple is that flow's.
    if get(Table::Established, &rkey).is_some() {
        remove(Table::New, &rkey);
        return false;
    }
    match get(Table::New, &rkey) {
        // SAFETY: a map value pointer stays valid for the program run.
        Some(p) => unsafe { (*p).created_ms == reply.created_ms && (*p).xlate == reply.xlate },
        None => false,
    }
}

/// A flow [`create`] found or made.
pub struct Created {
    /// Its translated tuple.
    pub xlate: Tuple,
    /// This call created it (another CPU may have created the same flow
    /// from a packet it took at the same time: then this call uses that
    /// flow's translation).
    pub here: bool,
}

/// Creates both entries of a new flow; returns the final translated tuple.
#[inline(always)]
pub fn create(p: &Packet, f: &NewFlow, now: u64) -> Result<Created, Counter> {
    let orig = p.tuple;
    // The namespace's own connections (health probes) are never refused:
    // a tenant's flood must not mark its backends down.
    if f.flags & CT_F_LOCAL == 0 && !crate::zone_ct::may_open(orig.zone) {
        // The zone holds its share of `ct_new`: no room for this flow.
        return Err(Counter::DropConntrackInsert);
    }
    let mut x = f.xlate;
    // Read opaquely: with both ids constant 0 (the egress program's local
    // flows) LLVM would merge them with the zero fields that follow into a
    // `memset` call, which the BPF target cannot link.
    // SAFETY: reads of two plain fields of a live reference.
    let (dnat_rule, snat_rule) =
        unsafe { (core::ptr::read_volatile(&f.dnat_rule), core::ptr::read_volatile(&f.snat_rule)) };
    let mut reply = CtEntry {
        xlate: orig.reversed(),
        last_seen_ns: now,
        created_ms: ct_clock_ms(now),
        dnat_rule,
        snat_rule,
        seq_end: 0,
        max_win: 0,
        flags: f.flags | CT_F_REPLY,
        state: CT_NEW,
        wscale: CT_WSCALE_NONE,
        _pad0: 0,
    };
    // Which identifier a collision may move: the source port, or the echo id.
    let movable = p.kind == Kind::Ports || p.kind == Kind::EchoRequest;
    let in_range = x.sport >= f.port_min && x.sport <= f.port_max;
    let keep_first = !movable || (!f.random && (f.flags & CT_F_SNAT == 0 || in_range));
    let mut claimed = keep_first && claim(&x, &reply, now);
    if !claimed && movable {
        let span = (f.port_max as u32).saturating_sub(f.port_min as u32) + 1;
        // Random-fully draws the start; otherwise a per-flow hash spreads
        // flows over the range (a plain sport start would cluster). Each
        // round starts afresh at random.
        let mut start = if f.random { random() } else { crate::hash::flow_hash(&orig) };
        'rounds: for _ in 0..PORT_ROUNDS {
            for i in 0..PORT_TRIES_PER_ROUND {
                x.sport = f.port_min + ((start.wrapping_add(i)) % span) as u16;
                if claim(&x, &reply, now) {
                    claimed = true;
                    break 'rounds;
                }
            }
            start = random();
        }
    }
    if !claimed {
        return Err(if movable { Counter::DropNoFreePort } else { Counter::DropUntranslatable });
    }
    reply.flags = f.flags;
    reply.xlate = x;
    if !insert(Table::New, &orig, &reply, BPF_NOEXIST as u64) {
        // Another CPU created this flow first: use its translation.
        remove(Table::New, &x.reversed());
        return match find(&orig) {
            // SAFETY: a map value pointer stays valid for the program run.
            Some((_, e)) => Ok(Created { xlate: unsafe { (*e).xlate }, here: false }),
            None => Err(Counter::DropConntrackInsert),
        };
    }
    crate::zone_ct::opened(orig.zone);
    if f.least {
        crate::sched::flow_opened(dnat_rule, x.daddr, x.dport);
    }
    Ok(Created { xlate: x, here: true })
}
