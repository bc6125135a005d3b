//! Conntrack maps: both halves of every flow (established and new tables),
//! first fragments, flush by selector, garbage collection by timeout.

use anyhow::Result;
use aya::maps::{HashMap, MapData, MapError};
use lbagent_common::*;

use super::Tables;

/// `BPF_NOEXIST`: insert only when the key is absent.
const NOEXIST: u64 = 1;

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

impl Tables {
    /// A writer of flow halves into both conntrack tables.
    pub fn flow_writer(&self) -> Result<FlowWriter> {
        Ok(FlowWriter { established: self.hash(MAP_CT)?, new: self.hash(MAP_CT_NEW)? })
    }

    /// Every conntrack entry of both tables (`ct` and `ct_new`), sorted.
    pub fn conntrack(&self) -> Result<Vec<(Tuple, CtEntry)>> {
        let mut out = self.conntrack_unsorted()?;
        out.sort_by_key(|(k, e)| (k.zone, e.flags & CT_F_REPLY, k.saddr, k.sport, k.daddr, k.dport));
        Ok(out)
    }

    /// Every conntrack entry of both tables, in no order (what garbage
    /// collection and flushes read: a million flows need no sorting).
    fn conntrack_unsorted(&self) -> Result<Vec<(Tuple, CtEntry)>> {
        let mut out = self.conntrack_table(MAP_CT)?;
        out.extend(self.conntrack_table(MAP_CT_NEW)?);
        Ok(out)
    }

    /// The entries of one conntrack table (`MAP_CT` or `MAP_CT_NEW`),
    /// unsorted: read in batches, or entry by entry where the kernel refuses
    /// batches.
    pub fn conntrack_table(&self, table: MapDef<Tuple, CtEntry>) -> Result<Vec<(Tuple, CtEntry)>> {
        match super::batch::dump(&self.data(table.name)?) {
            Ok(entries) => Ok(entries),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => self.conntrack_table_by_key(table),
            Err(e) => Err(anyhow::Error::new(e).context(format!("reading {} in batches", table.name))),
        }
    }

    /// The entries of one conntrack table read entry by entry (the next key,
    /// then its value): the fallback, and the reference the benchmark
    /// compares batches with.
    pub fn conntrack_table_by_key(&self, table: MapDef<Tuple, CtEntry>) -> Result<Vec<(Tuple, CtEntry)>> {
        Ok(self.hash(table)?.iter().collect::<Result<_, _>>()?)
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

    /// Deletes the conntrack entries of every flow that `select` picks (either
    /// direction's entry may match; both go). Returns the number of flows.
    pub fn flush_conntrack(&self, select: impl Fn(&Tuple, &CtEntry) -> bool) -> Result<usize> {
        let entries = self.conntrack_unsorted()?;
        self.flush_entries(&entries, select)
    }

    /// `flush_conntrack` over entries already dumped (`entries`). A half's
    /// pair is deleted only if it points back at the half (see `CtEntry`):
    /// a pair key that now belongs to another flow is left alone. An entry
    /// is deleted only while it is still the one dumped (same creation time
    /// and translation): a flow the program re-created under the same key
    /// since the dump (a new connection on the tuple, a flow that expired
    /// and came back) is another flow, and stays.
    pub fn flush_entries(
        &self,
        entries: &[(Tuple, CtEntry)],
        select: impl Fn(&Tuple, &CtEntry) -> bool,
    ) -> Result<usize> {
        self.flush_indexed(&DumpIndex::new(entries), select)
    }

    fn flush_indexed(&self, dump: &DumpIndex, select: impl Fn(&Tuple, &CtEntry) -> bool) -> Result<usize> {
        // `ct_new` first: a promotion between the two deletions moves an
        // entry into `ct`, where the second one still finds it.
        let mut maps = [self.hash(MAP_CT_NEW)?, self.hash(MAP_CT)?];
        let mut doomed: std::collections::HashSet<Tuple, foldhash::fast::RandomState> = Default::default();
        let mut flows = 0;
        for (k, e) in dump.entries {
            if doomed.contains(k) || !select(k, e) {
                continue;
            }
            flows += 1;
            doomed.insert(*k);
            let pair = e.xlate.reversed();
            if dump.get(&pair).is_some_and(|p| p.xlate == k.reversed()) {
                doomed.insert(pair);
            }
        }
        for key in &doomed {
            let Some(dumped) = dump.get(key) else { continue };
            for map in maps.iter_mut() {
                let same =
                    map.get(key, 0).is_ok_and(|now| now.created_ns == dumped.created_ns && now.xlate == dumped.xlate);
                if same {
                    let _ = map.remove(key);
                }
            }
        }
        Ok(flows)
    }

    /// Deletes flows idle past their timeout in both directions (the program
    /// also expires them on lookup; this frees entries nobody looks up).
    /// One dump of the tables. `now_ns` is CLOCK_MONOTONIC, the clock of
    /// `bpf_ktime_get_ns`. Returns the number of flows deleted.
    pub fn gc(&self, now_ns: u64) -> Result<usize> {
        let cfg = self.config()?;
        let entries = self.conntrack_unsorted()?;
        let dump = DumpIndex::new(&entries);
        let idle = |e: &CtEntry, proto: u8| {
            now_ns.saturating_sub(e.last_seen_ns) > cfg.timeout_s(proto, e.state) as u64 * 1_000_000_000
        };
        self.flush_indexed(&dump, |k, e| {
            let pair = || dump.get(&e.xlate.reversed()).filter(|p| p.xlate == k.reversed());
            idle(e, k.proto) && pair().is_none_or(|p| idle(p, k.proto))
        })
    }
}

/// A dump of the conntrack tables with each key's position, built once per
/// flush or GC pass (a million flows: two million keys). The hasher is
/// foldhash's, seeded per process: keys come from packets, and a fixed
/// hash would let a sender aim its flows at one bucket.
struct DumpIndex<'a> {
    entries: &'a [(Tuple, CtEntry)],
    at: std::collections::HashMap<Tuple, u32, foldhash::fast::RandomState>,
}

impl<'a> DumpIndex<'a> {
    /// A key dumped twice (a flow promoted from `ct_new` to `ct` during the
    /// dump) is found at its last position.
    fn new(entries: &'a [(Tuple, CtEntry)]) -> Self {
        let mut at = std::collections::HashMap::with_capacity_and_hasher(entries.len(), Default::default());
        for (i, (k, _)) in entries.iter().enumerate() {
            at.insert(*k, i as u32);
        }
        DumpIndex { entries, at }
    }

    fn get(&self, key: &Tuple) -> Option<&CtEntry> {
        self.at.get(key).map(|&i| &self.entries[i as usize].1)
    }
}
