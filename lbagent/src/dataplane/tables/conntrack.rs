//! Conntrack maps: both halves of every flow (established and new tables),
//! first fragments, flush by selector (garbage collection by timeout is
//! the program's: `dataplane::ct_gc`).

use anyhow::Result;
use aya::maps::{HashMap, MapData, MapError};
use lbagent_common::*;

use super::{NOEXIST, Tables};

/// What writing one half of a flow did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfWritten {
    Inserted,
    /// Either table already holds a half under this key: left as it is.
    Present,
    /// The table had no room (or refused it otherwise).
    Full,
}

/// Writes halves of flows from outside the program (an upgrade's copy of
/// the previous layout's flows, a peer's flows): the one place besides the
/// program that creates conntrack entries, with both tables open once.
pub struct FlowWriter {
    established: HashMap<MapData, Tuple, CtEntry>,
    new: HashMap<MapData, Tuple, CtEntry>,
}

impl FlowWriter {
    /// Writes one half into `ct` (`established`) or `ct_new`, never over a
    /// half either table holds under the same key (the program may have
    /// created it meanwhile: its entry is the current one). The caller
    /// writes both halves of a flow into the same table; a half whose pair
    /// is missing is repaired by the program on the flow's next packet.
    pub fn insert_half(&mut self, key: &Tuple, entry: &CtEntry, established: bool) -> HalfWritten {
        if self.established.get(key, 0).is_ok() || self.new.get(key, 0).is_ok() {
            return HalfWritten::Present;
        }
        let table = if established { &mut self.established } else { &mut self.new };
        match table.insert(key, entry, NOEXIST) {
            Ok(()) => HalfWritten::Inserted,
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => HalfWritten::Present,
            Err(_) => HalfWritten::Full,
        }
    }
}

/// What writing a whole flow did ([`FlowWriter::put_flow`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowPut {
    Inserted,
    /// Both halves were there: their state and last packet time moved
    /// forward (and the flow moved to `ct` once established).
    Refreshed,
    /// A half under one of its keys belonged to another flow: that flow's
    /// halves were replaced.
    Replaced,
    Full,
}

/// Two creation times this far apart (ms) are two flows of one tuple (a
/// copy's creation time is the peer's, converted: a few ms off).
const SAME_FLOW_MS: u32 = 2000;

impl FlowWriter {
    /// The half under `key`: (in `ct`, entry).
    pub fn get(&self, key: &Tuple) -> Option<(bool, CtEntry)> {
        if let Ok(e) = self.established.get(key, 0) {
            return Some((true, e));
        }
        self.new.get(key, 0).ok().map(|e| (false, e))
    }

    fn table(&mut self, established: bool) -> &mut HashMap<MapData, Tuple, CtEntry> {
        if established { &mut self.established } else { &mut self.new }
    }

    /// Removes the half under `k` from table `t`, and its pair if the pair
    /// points back.
    fn remove_with_pair(&mut self, t: bool, k: &Tuple, x: &CtEntry) {
        let _ = self.table(t).remove(k);
        let pk = x.xlate.reversed();
        if let Some((pt, px)) = self.get(&pk)
            && px.xlate.reversed() == *k
        {
            let _ = self.table(pt).remove(&pk);
        }
    }

    /// Writes a whole flow, both halves, from its original half (`key`,
    /// `e`; the reply half is derived as the program derives it): a peer's
    /// copy of a flow, which is the truth for its keys. The same flow here
    /// (same translation, created within [`SAME_FLOW_MS`]) keeps its
    /// entries and what the program learnt of its sequence numbers; its
    /// state and last packet time only move forward, and it moves to `ct`
    /// once `established`. Halves under either key that belong to another
    /// flow (another translation, or an earlier flow of the tuple) are
    /// removed first, with their pairs. An established flow `ct` has no
    /// room for goes to `ct_new`, as the program keeps it. A write that
    /// fails half-way removes only what it inserted. Writes race with this
    /// host's programs only while both hosts are active (a switchover's
    /// moment); the program's pair check repairs a half either side tore.
    pub fn put_flow(&mut self, key: &Tuple, e: &CtEntry, established: bool) -> FlowPut {
        let rkey = e.xlate.reversed();
        let mut r = CtEntry {
            xlate: key.reversed(),
            flags: (e.flags & (CT_F_SNAT | CT_F_DNAT | CT_F_LOCAL)) | CT_F_REPLY,
            ..*e
        };
        let here = (self.get(key), self.get(&rkey));
        let same = |h: &Option<(bool, CtEntry)>, want: &Tuple| {
            h.as_ref().is_some_and(|(_, x)| {
                x.xlate == *want
                    && ct_ms_since(x.created_ms, e.created_ms).max(ct_ms_since(e.created_ms, x.created_ms))
                        < SAME_FLOW_MS
            })
        };
        if same(&here.0, &e.xlate) && same(&here.1, &r.xlate) {
            let ((t0, mut o), (t1, mut p)) = (here.0.unwrap(), here.1.unwrap());
            for x in [&mut o, &mut p] {
                x.state = x.state.max(e.state);
                x.last_seen_ns = x.last_seen_ns.max(e.last_seen_ns);
            }
            let to = t0 || established;
            // Into the target table first (updated in place when there),
            // then out of the other: never in neither.
            if self.table(to).insert(key, &o, 0).is_err() || self.table(to).insert(&rkey, &p, 0).is_err() {
                if to != t0 {
                    // `ct` is full: both stay in `ct_new`, refreshed.
                    let _ = self.table(to).remove(key);
                    let _ = self.table(t0).insert(key, &o, 0);
                    let _ = self.table(t1).insert(&rkey, &p, 0);
                    return FlowPut::Refreshed;
                }
                return FlowPut::Full;
            }
            for (was, k) in [(t0, key), (t1, &rkey)] {
                if was != to {
                    let _ = self.table(was).remove(k);
                }
            }
            return FlowPut::Refreshed;
        }
        let mut replaced = false;
        for (k, h) in [(*key, here.0), (rkey, here.1)] {
            if let Some((t, x)) = h {
                self.remove_with_pair(t, &k, &x);
                replaced = true;
            }
        }
        r.seq_end = 0;
        r.max_win = 0;
        for table in if established { [true, false] } else { [false, false] } {
            let t = self.table(table);
            match t.insert(key, e, NOEXIST) {
                Ok(()) => {}
                // The program made the flow meanwhile: its entry stays.
                Err(MapError::SyscallError(x)) if x.io_error.raw_os_error() == Some(libc::EEXIST) => {
                    return FlowPut::Refreshed;
                }
                Err(_) => continue,
            }
            match t.insert(&rkey, &r, NOEXIST) {
                Ok(()) => return if replaced { FlowPut::Replaced } else { FlowPut::Inserted },
                Err(_) => {
                    // Only what this call inserted goes.
                    let _ = t.remove(key);
                }
            }
        }
        FlowPut::Full
    }

    /// Removes a flow's halves (from its original half), if they are still
    /// this flow's.
    pub fn remove_flow(&mut self, key: &Tuple, e: &CtEntry) {
        for (k, want) in [(*key, e.xlate), (e.xlate.reversed(), key.reversed())] {
            if let Some((t, x)) = self.get(&k)
                && x.xlate == want
            {
                let _ = self.table(t).remove(&k);
            }
        }
    }
}

impl Tables {
    /// A writer of flow halves into both conntrack tables.
    pub fn flow_writer(&self) -> Result<FlowWriter> {
        Ok(FlowWriter { established: self.hash(MAP_CT)?, new: self.hash(MAP_CT_NEW)? })
    }

    /// Every conntrack entry of both tables (`ct` and `ct_new`), sorted.
    pub fn conntrack(&self) -> Result<Vec<(Tuple, CtEntry)>> {
        self.conntrack_matching(|_, _| true)
    }

    /// The conntrack entries of both tables that `select` picks, sorted;
    /// the tables are read a batch at a time, so a filtered listing holds
    /// what it lists, not the tables.
    pub fn conntrack_matching(&self, select: impl Fn(&Tuple, &CtEntry) -> bool) -> Result<Vec<(Tuple, CtEntry)>> {
        let mut out = Vec::new();
        for table in [MAP_CT, MAP_CT_NEW] {
            self.each_conntrack(table, |keys, entries| {
                out.extend(keys.iter().zip(entries).filter(|(k, e)| select(k, e)).map(|(k, e)| (*k, *e)))
            })?;
        }
        out.sort_by_key(|(k, e)| (k.zone, e.flags & CT_F_REPLY, k.saddr, k.sport, k.daddr, k.dport));
        Ok(out)
    }

    /// The entries of one conntrack table (`MAP_CT` or `MAP_CT_NEW`),
    /// unsorted: read in batches, or entry by entry where the kernel refuses
    /// batches.
    pub fn conntrack_table(&self, table: MapDef<Tuple, CtEntry>) -> Result<Vec<(Tuple, CtEntry)>> {
        let mut out = Vec::new();
        self.each_conntrack(table, |keys, entries| out.extend(keys.iter().copied().zip(entries.iter().copied())))?;
        Ok(out)
    }

    /// Hands every entry of one conntrack table to `visit` a batch at a
    /// time (keys and their entries), in no order: what garbage collection,
    /// flushes and recounts read, so that a pass over a million flows holds
    /// a few thousand entries, not the table. `visit` may delete entries
    /// (see `batch::each_chunk`). Where the kernel refuses batches, the
    /// table is read entry by entry first and visited as one batch.
    pub fn each_conntrack(
        &self,
        table: MapDef<Tuple, CtEntry>,
        mut visit: impl FnMut(&[Tuple], &[CtEntry]),
    ) -> Result<()> {
        match super::batch::each_chunk(&self.data(table.name)?, &mut visit) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let (keys, entries): (Vec<_>, Vec<_>) = self.conntrack_table_by_key(table)?.into_iter().unzip();
                visit(&keys, &entries);
                Ok(())
            }
            Err(e) => Err(anyhow::Error::new(e).context(format!("reading {} in batches", table.name))),
        }
    }

    /// The entries of one conntrack table read entry by entry (the next key,
    /// then its value): the fallback, and the reference the benchmark
    /// compares batches with.
    pub fn conntrack_table_by_key(&self, table: MapDef<Tuple, CtEntry>) -> Result<Vec<(Tuple, CtEntry)>> {
        Ok(self.hash(table)?.iter().collect::<Result<_, _>>()?)
    }

    /// The entries of one of the previous layout's tables (`ct_prev`,
    /// `ct_new_prev`), converted: empty but during an upgrade.
    pub fn previous_conntrack(&self, table: MapDef<Tuple, CtEntryPrev>) -> Result<Vec<(Tuple, CtEntry)>> {
        let map = self.hash(table)?;
        map.iter().map(|item| Ok(item.map(|(k, e)| (k, e.adopted()))?)).collect()
    }

    /// Whether the programs adopt flows from the previous layout's tables
    /// (`ct_adopt`: an upgrade is switching zones over).
    pub fn adopting(&self) -> Result<bool> {
        Ok(self.array(MAP_CT_ADOPT)?.get(&0, 0)? != 0)
    }

    /// Sets whether the programs adopt flows from the previous layout's
    /// tables (the migration's flag).
    pub fn set_adopting(&self, adopting: bool) -> Result<()> {
        self.array(MAP_CT_ADOPT)?.set(0, &u32::from(adopting), 0)?;
        Ok(())
    }

    /// Deletes one conntrack entry by key from whichever table holds it
    /// (operators' and tests' surgery; normal removal goes by flow).
    pub fn remove_conntrack_entry(&self, key: &Tuple) -> Result<bool> {
        let mut found = false;
        for table in [MAP_CT, MAP_CT_NEW] {
            found |= self.hash(table)?.remove(key).is_ok();
        }
        Ok(found)
    }

    /// First fragments on record: (key, entry).
    pub fn fragments(&self) -> Result<Vec<(FragKey, FragEntry)>> {
        Ok(self.hash(MAP_FRAGS)?.iter().collect::<Result<_, _>>()?)
    }

    /// Deletes the conntrack entries of every flow that `select` picks
    /// (either direction's entry may match; both go), reading the tables a
    /// batch at a time. Returns the number of flows deleted.
    /// During an upgrade (`ct_adopt`) the previous layout's tables are
    /// swept too: a flow left there would be adopted again by its next
    /// packet.
    /// Logged flows end with reason `rule_removed` (the agent flushes
    /// what its rules no longer admit).
    pub fn flush_conntrack(&self, select: impl Fn(&Tuple, &CtEntry) -> bool) -> Result<usize> {
        self.flush_conntrack_for(FLOW_END_RULE_REMOVED, select)
    }

    /// [`Tables::flush_conntrack`], the logged flows ending with `reason`
    /// (`FLOW_END_*`).
    pub fn flush_conntrack_for(&self, reason: u8, select: impl Fn(&Tuple, &CtEntry) -> bool) -> Result<usize> {
        // The previous tables first: a flow deleted from this layout's
        // tables and still there would be adopted back by its next packet.
        let previous = if self.adopting()? { self.sweep_previous(&select)? } else { 0 };
        Ok(previous + self.sweep(reason, |k, e| select(k, e))?)
    }

    /// Deletes from `ct_prev` and `ct_new_prev` every flow not adopted yet
    /// that `select` picks (by its converted entries), both halves (a pair
    /// only while it leads back). Each table is read in batches, then its
    /// picked flows deleted: a flow adopted in between is this layout's,
    /// and the sweep of this layout's tables that follows finds it.
    fn sweep_previous(&self, select: &impl Fn(&Tuple, &CtEntry) -> bool) -> Result<usize> {
        let mut tables = [self.hash(MAP_CT_PREV)?, self.hash(MAP_CT_NEW_PREV)?];
        let mut flows = 0;
        for (t, def) in [MAP_CT_PREV, MAP_CT_NEW_PREV].into_iter().enumerate() {
            let mut picked = Vec::new();
            let mut pick = |keys: &[Tuple], halves: &[CtEntryPrev]| {
                for (key, half) in keys.iter().zip(halves) {
                    if half.adopted == 0 && select(key, &half.adopted()) {
                        picked.push((*key, half.xlate.reversed()));
                    }
                }
            };
            match super::batch::each_chunk(&self.data(def.name)?, &mut pick) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    let (keys, halves): (Vec<_>, Vec<_>) = tables[t].iter().filter_map(Result::ok).unzip();
                    pick(&keys, &halves);
                }
                Err(e) => return Err(anyhow::Error::new(e).context(format!("reading {} in batches", def.name))),
            }
            for (key, pair) in picked {
                for table in &mut tables {
                    if table.get(&pair, 0).is_ok_and(|p| p.xlate == key.reversed()) {
                        let _ = table.remove(&pair);
                    }
                }
                if tables[t].remove(&key).is_ok() {
                    flows += 1;
                }
            }
        }
        Ok(flows)
    }

    /// `flush_conntrack` over entries already dumped (`entries`, a caller's
    /// earlier read). Returns the number of flows deleted.
    pub fn flush_entries(
        &self,
        entries: &[(Tuple, CtEntry)],
        select: impl Fn(&Tuple, &CtEntry) -> bool,
    ) -> Result<usize> {
        let (keys, entries): (Vec<_>, Vec<_>) = entries.iter().copied().unzip();
        let mut sweeper = Sweeper::new(self, FLOW_END_RULE_REMOVED)?;
        // Read from either table: looked for in both (`ct_new` first).
        Ok(sweeper.sweep(Table::New, &keys, &entries, |k, e| select(k, e)))
    }

    /// One pass over both tables (`ct_new` first), a batch at a time: each
    /// half that `pick` selects is deleted with its pair. Returns the flows
    /// deleted.
    fn sweep(&self, reason: u8, pick: impl Fn(&Tuple, &CtEntry) -> bool) -> Result<usize> {
        let mut sweeper = Sweeper::new(self, reason)?;
        let mut flows = 0;
        for (def, from) in [(MAP_CT_NEW, Table::New), (MAP_CT, Table::Established)] {
            self.each_conntrack(def, |keys, entries| flows += sweeper.sweep(from, keys, entries, &pick))?;
        }
        Ok(flows)
    }
}

/// Which conntrack table a half was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Table {
    /// `ct_new`: the half may have been promoted to `ct` since.
    New,
    /// `ct`: entries never move back to `ct_new` (a half under the same
    /// key there is another flow's).
    Established,
}

/// Deletes flows from both conntrack tables, both halves at once. A half's
/// pair is deleted only if it points back at the half and belongs to the
/// same flow (see `CtEntry`): a pair key that now belongs to another flow
/// is left alone. An entry is deleted only while it is still the one read
/// (same creation time and translation): a flow the program re-created
/// under the same key since the read (a new connection on the tuple, a
/// flow that expired and came back) is another flow, and stays. Each
/// lookup starts in the table the half was read from, so a flow of `ct`
/// costs four syscalls: the pair's lookup, the half's check, two deletes.
/// A logged flow is marked with the sweep's end reason first
/// (`flow_log::EndMarker`).
struct Sweeper {
    new: HashMap<MapData, Tuple, CtEntry>,
    established: HashMap<MapData, Tuple, CtEntry>,
    ending: super::flow_log::EndMarker,
}

impl Sweeper {
    fn new(t: &Tables, reason: u8) -> Result<Self> {
        Ok(Sweeper {
            new: t.hash(MAP_CT_NEW)?,
            established: t.hash(MAP_CT)?,
            ending: super::flow_log::EndMarker::new(t, reason)?,
        })
    }

    fn map(&self, table: Table) -> &HashMap<MapData, Tuple, CtEntry> {
        match table {
            Table::New => &self.new,
            Table::Established => &self.established,
        }
    }

    /// The entry under `key`, looked up first in `first`, then in the other
    /// table, with the table it was found in.
    fn find(&self, key: &Tuple, first: Table) -> Option<(Table, CtEntry)> {
        let other = if first == Table::New { Table::Established } else { Table::New };
        [first, other].into_iter().find_map(|t| self.map(t).get(key, 0).ok().map(|e| (t, e)))
    }

    /// The live pair of half `key` (`entry` as read from `from`): the entry
    /// under its translation reversed, if it points back at `key` and
    /// belongs to the same flow (both halves of a flow carry its creation
    /// time; a flow re-created on the same tuples since the read is
    /// another one).
    fn pair(&self, key: &Tuple, entry: &CtEntry, from: Table) -> Option<(Tuple, Table, CtEntry)> {
        let pk = entry.xlate.reversed();
        self.find(&pk, from)
            .filter(|(_, p)| p.xlate == key.reversed() && p.created_ms == entry.created_ms)
            .map(|(t, p)| (pk, t, p))
    }

    /// Deletes `key` while it is the entry `read`, found in table `at` (as
    /// just looked up). A half of `ct_new` is also looked for in `ct`: a
    /// promotion between the lookup and the delete moves it there.
    fn remove_checked(&mut self, key: &Tuple, read: &CtEntry, at: Table) -> bool {
        let mut removed = match at {
            Table::New => self.new.remove(key).is_ok(),
            Table::Established => self.established.remove(key).is_ok(),
        };
        if at == Table::New {
            let same = |now: CtEntry| now.created_ms == read.created_ms && now.xlate == read.xlate;
            if self.established.get(key, 0).is_ok_and(same) {
                removed |= self.established.remove(key).is_ok();
            }
        }
        removed
    }

    /// Deletes half `key` (`read` from table `from`) while it is still the
    /// entry read. Whether it deleted it.
    fn remove_if_same(&mut self, key: &Tuple, read: &CtEntry, from: Table) -> bool {
        let tables: &[Table] =
            if from == Table::New { &[Table::New, Table::Established] } else { &[Table::Established] };
        let at = tables.iter().copied().find(|t| {
            self.map(*t).get(key, 0).is_ok_and(|now| now.created_ms == read.created_ms && now.xlate == read.xlate)
        });
        at.is_some_and(|t| self.remove_checked(key, read, t))
    }

    /// One batch: each half `pick` selects goes with its pair. A flow is
    /// counted by the deletion that removes its first half, so a flow both
    /// of whose halves are selected (in this batch or across batches)
    /// counts once.
    fn sweep(
        &mut self,
        from: Table,
        keys: &[Tuple],
        entries: &[CtEntry],
        pick: impl Fn(&Tuple, &CtEntry) -> bool,
    ) -> usize {
        let mut flows = 0;
        for (k, e) in keys.iter().zip(entries) {
            if !pick(k, e) {
                continue;
            }
            self.ending.ending(k, e);
            let pair = self.pair(k, e, from);
            let mut removed = self.remove_if_same(k, e, from);
            // The pair was looked up just now: deleted where it was found.
            if let Some((pk, at, p)) = pair {
                removed |= self.remove_checked(&pk, &p, at);
            }
            flows += usize::from(removed);
        }
        flows
    }
}
