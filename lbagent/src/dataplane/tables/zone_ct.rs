//! Each zone's share of the conntrack tables (`zone_ct.rs` of the program):
//! its limits (written at every apply), its flow counts (set from a dump at
//! every collection pass) and what its limits refused.

use std::collections::BTreeMap;

use anyhow::Result;
use lbagent_common::*;

use super::Tables;

/// One zone's share as the maps hold it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ZoneCt {
    pub limits: ZoneCtLimits,
    pub flows: ZoneCtFlows,
    pub refused: ZoneCtRefused,
}

impl Tables {
    /// Pins of a build without the per-zone maps: nothing to read or write.
    fn has_zone_ct(&self) -> bool {
        self.pinned(MAP_ZONE_CT_LIMITS) && self.pinned(MAP_ZONE_CT_FLOWS) && self.pinned(MAP_ZONE_CT_REFUSED)
    }

    /// Sets zone `zone`'s limits (written only when they differ); returns
    /// whether they changed.
    pub fn set_zone_ct_limits(&self, zone: u16, limits: ZoneCtLimits) -> Result<bool> {
        if !self.has_zone_ct() {
            return Ok(false);
        }
        let mut map = self.hash(MAP_ZONE_CT_LIMITS)?;
        if map.get(&(zone as u32), 0).ok() == Some(limits) {
            return Ok(false);
        }
        map.insert(&(zone as u32), &limits, 0)?;
        Ok(true)
    }

    /// Removes every per-zone entry of `zone` (the zone is gone; its id may
    /// be reused).
    pub fn clear_zone_ct(&self, zone: u16) -> Result<()> {
        if !self.has_zone_ct() {
            return Ok(());
        }
        let _ = self.hash(MAP_ZONE_CT_LIMITS)?.remove(&(zone as u32));
        let _ = self.hash(MAP_ZONE_CT_FLOWS)?.remove(&(zone as u32));
        let _ = self.hash(MAP_ZONE_CT_REFUSED)?.remove(&(zone as u32));
        Ok(())
    }

    /// Every zone with a limit, a count or a refusal.
    pub fn zone_ct(&self) -> Result<BTreeMap<u16, ZoneCt>> {
        let mut out: BTreeMap<u16, ZoneCt> = BTreeMap::new();
        if !self.has_zone_ct() {
            return Ok(out);
        }
        for (z, v) in self.hash(MAP_ZONE_CT_LIMITS)?.iter().filter_map(|e| e.ok()) {
            out.entry(z as u16).or_default().limits = v;
        }
        for (z, v) in self.hash(MAP_ZONE_CT_FLOWS)?.iter().filter_map(|e| e.ok()) {
            out.entry(z as u16).or_default().flows = v;
        }
        for (z, v) in self.hash(MAP_ZONE_CT_REFUSED)?.iter().filter_map(|e| e.ok()) {
            out.entry(z as u16).or_default().refused = v;
        }
        Ok(out)
    }

    /// Sets every zone's flow counts from one dump of both tables (a flow
    /// is its original-direction half), so that what the kernel evicted
    /// from `ct_new` and what the agent deleted stop counting. Returns the
    /// zones whose counts were corrected.
    pub fn recount_zone_flows(&self) -> Result<usize> {
        self.recount_zone_flows_and(|_, _| {})
    }

    /// [`Tables::recount_zone_flows`], handing every entry of the dump to
    /// `also` as well (the SNAT port census reads the same dump).
    pub fn recount_zone_flows_and(&self, mut also: impl FnMut(&Tuple, &CtEntry)) -> Result<usize> {
        let mut want: BTreeMap<u32, ZoneCtFlows> = BTreeMap::new();
        for (established, table) in [(true, MAP_CT), (false, MAP_CT_NEW)] {
            self.each_conntrack(table, |keys, entries| {
                for (k, e) in keys.iter().zip(entries) {
                    also(k, e);
                    if e.flags & CT_F_REPLY != 0 {
                        continue;
                    }
                    let f = want.entry(k.zone as u32).or_default();
                    if established {
                        f.established += 1;
                    } else {
                        f.new += 1;
                    }
                }
            })?;
        }
        if !self.has_zone_ct() {
            return Ok(0);
        }
        let mut map = self.hash(MAP_ZONE_CT_FLOWS)?;
        let have: BTreeMap<u32, ZoneCtFlows> = map.iter().filter_map(|e| e.ok()).collect();
        let mut corrected = 0;
        for zone in have.keys().chain(want.keys()).copied().collect::<std::collections::BTreeSet<_>>() {
            let w = want.get(&zone).copied().unwrap_or_default();
            // Counts that exist are corrected only while they do (a zone
            // removed after the read stays removed). Counts missing for a
            // zone with flows are created unless the program did meanwhile:
            // an upgrade from a layout without per-zone counts leaves every
            // zone without them, and the flows it carried must count (the
            // upgrade test loses proxied connections without this). A zone
            // removed during the scan may get counts back this way; the next
            // recount zeroes them once its flows are gone.
            let (had, flag) = match have.get(&zone) {
                Some(h) => (*h, super::EXIST),
                None => (ZoneCtFlows::default(), super::NOEXIST),
            };
            if had != w && map.insert(&zone, &w, flag).is_ok() {
                corrected += 1;
            }
        }
        Ok(corrected)
    }
}
