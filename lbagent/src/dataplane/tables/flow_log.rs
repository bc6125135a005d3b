//! The flow-log maps (`flow_log.rs` of the program): which zones log, each
//! logged flow's counts, and the ring of records.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use lbagent_common::*;

use super::Tables;

/// The key of a flow's counts from either of its halves (`key`, `e`).
pub fn acct_key(key: &Tuple, e: &CtEntry) -> FlowAcctKey {
    let orig = if e.flags & CT_F_REPLY != 0 { e.xlate.reversed() } else { *key };
    FlowAcctKey { orig, created_ms: e.created_ms, _pad0: 0 }
}

impl Tables {
    /// Pins of a build without flow logs: nothing to read or write.
    pub fn has_flow_log(&self) -> bool {
        self.pinned(MAP_FLOW_LOG_ZONES) && self.pinned(MAP_FLOW_ACCT) && self.pinned(MAP_FLOW_EVENTS)
    }

    /// Every zone that logs, with what it logs.
    pub fn flow_log_zones(&self) -> Result<BTreeMap<u16, FlowLogZone>> {
        if !self.has_flow_log() {
            return Ok(BTreeMap::new());
        }
        let map = self.array(MAP_FLOW_LOG_ZONES)?;
        let mut out = BTreeMap::new();
        for (zone, z) in map.iter().enumerate() {
            let z = z?;
            if z != FlowLogZone::default() {
                out.insert(zone as u16, z);
            }
        }
        Ok(out)
    }

    /// Sets what zone `zone` logs.
    pub fn set_flow_log_zone(&self, zone: u16, z: FlowLogZone) -> Result<()> {
        if !self.has_flow_log() {
            return Ok(());
        }
        self.array(MAP_FLOW_LOG_ZONES)?.set(zone as u32, &z, 0)?;
        Ok(())
    }

    /// The ring of records, to consume (one consumer at a time: the ring's
    /// read position is the map's).
    pub fn flow_events(&self) -> Result<RingBuf<MapData>> {
        RingBuf::try_from(self.map(MAP_FLOW_EVENTS)?).context("opening flow_events")
    }

    /// Every logged flow's counts, a batch at a time.
    pub fn each_flow_acct(&self, mut visit: impl FnMut(&[FlowAcctKey], &[FlowAcct])) -> Result<()> {
        match super::batch::each_chunk(&self.data(MAP_FLOW_ACCT.name)?, &mut visit) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let (keys, values): (Vec<_>, Vec<_>) =
                    self.hash(MAP_FLOW_ACCT)?.iter().collect::<Result<Vec<_>, _>>()?.into_iter().unzip();
                visit(&keys, &values);
                Ok(())
            }
            Err(e) => Err(anyhow::Error::new(e).context("reading flow_acct in batches")),
        }
    }

    /// Removes logged flows' counts (their end records are written).
    pub fn remove_flow_acct(&self, keys: &[FlowAcctKey]) -> Result<()> {
        let mut map = self.hash(MAP_FLOW_ACCT)?;
        for k in keys {
            let _ = map.remove(k);
        }
        Ok(())
    }

    /// The conntrack tables, opened once for many [`Alive::alive`] checks.
    pub fn alive_checker(&self) -> Result<Alive> {
        Ok(Alive { ct: self.hash(MAP_CT)?, new: self.hash(MAP_CT_NEW)? })
    }
}

/// Looks logged flows up in `ct` and `ct_new`.
pub struct Alive {
    ct: aya::maps::HashMap<MapData, Tuple, CtEntry>,
    new: aya::maps::HashMap<MapData, Tuple, CtEntry>,
}

impl Alive {
    /// Whether the flow of `key` (translated to `xlate`) still has a half:
    /// its original one, or its reply one (a lost half is re-created from
    /// its pair by the next packet). Each is looked for in `ct`, `ct_new`,
    /// and `ct` again (a promotion between the first two lookups moves it).
    pub fn alive(&self, key: &FlowAcctKey, xlate: &Tuple) -> bool {
        let same = |e: CtEntry| e.created_ms == key.created_ms;
        [key.orig, xlate.reversed()].iter().any(|k| {
            self.ct.get(k, 0).is_ok_and(same) || self.new.get(k, 0).is_ok_and(same) || self.ct.get(k, 0).is_ok_and(same)
        })
    }
}

/// Marks the logged flows an agent's flush deletes with the reason, before
/// their entries go: their end records then carry it.
pub struct EndMarker {
    acct: Option<aya::maps::HashMap<MapData, FlowAcctKey, FlowAcct>>,
    reason: u8,
}

impl EndMarker {
    pub fn new(t: &Tables, reason: u8) -> Result<Self> {
        let acct = if t.has_flow_log() { Some(t.hash(MAP_FLOW_ACCT)?) } else { None };
        Ok(EndMarker { acct, reason })
    }

    /// Half `key` (`e`) is about to be deleted. A count the program adds
    /// between the read and the write here is lost (a packet or two of a
    /// flow being flushed).
    pub fn ending(&mut self, key: &Tuple, e: &CtEntry) {
        let Some(acct) = self.acct.as_mut() else { return };
        if e.flags & CT_F_LOGGED == 0 {
            return;
        }
        let k = acct_key(key, e);
        if let Ok(mut a) = acct.get(&k, 0)
            && a.ended == 0
        {
            a.ended = self.reason;
            let _ = acct.insert(&k, &a, super::EXIST);
        }
    }
}
