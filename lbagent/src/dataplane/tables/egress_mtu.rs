//! The fast path's MTUs (`egress_mtu`, read by `route.rs` of the program):
//! per interface of each zone, the largest IPv4 packet the fast path may
//! send out of it. Written from the namespace's links and routes at every
//! pass (`zone::attach`); an interface without an entry gets nothing from
//! the fast path (the stack forwards its packets).

use std::collections::BTreeMap;

use anyhow::Result;
use lbagent_common::*;

use super::Tables;

impl Tables {
    /// Writes zone `zone`'s entries from `mtus` (interface index → MTU),
    /// only those that differ (a pass with nothing to do writes nothing):
    /// one lookup per interface, never a scan of the map (every zone does
    /// this every pass). Entries of interfaces that went stay until the zone
    /// is cleared ([`Tables::clear_egress_mtu`]): the FIB never names an
    /// interface the namespace does not have, and one that reuses the index
    /// is written here. Returns whether anything changed. Pins of a build
    /// without the map: nothing to write (its programs have no MTU check).
    pub fn sync_egress_mtu(&self, zone: u16, mtus: &BTreeMap<u32, u32>) -> Result<bool> {
        if !self.pinned(MAP_EGRESS_MTU) {
            return Ok(false);
        }
        let mut map = self.hash(MAP_EGRESS_MTU)?;
        let mut changed = false;
        for (&ifindex, &mtu) in mtus {
            let key = MtuKey { zone, _pad: 0, ifindex };
            if map.get(&key, 0).ok() != Some(mtu) {
                map.insert(&key, &mtu, 0)?;
                changed = true;
            }
        }
        Ok(changed)
    }

    /// Removes every entry of zone `zone` (the zone is gone; its id may be
    /// reused). Returns how many.
    pub fn clear_egress_mtu(&self, zone: u16) -> Result<usize> {
        if !self.pinned(MAP_EGRESS_MTU) {
            return Ok(0);
        }
        let mut map = self.hash(MAP_EGRESS_MTU)?;
        let keys: Vec<MtuKey> = map.keys().filter_map(|k| k.ok()).filter(|k| k.zone == zone).collect();
        for k in &keys {
            map.remove(k)?;
        }
        Ok(keys.len())
    }

    /// Every entry, by zone and interface.
    pub fn egress_mtus(&self) -> Result<Vec<(MtuKey, u32)>> {
        if !self.pinned(MAP_EGRESS_MTU) {
            return Ok(vec![]);
        }
        let mut out: Vec<_> = self.hash(MAP_EGRESS_MTU)?.iter().filter_map(|e| e.ok()).collect();
        out.sort();
        Ok(out)
    }
}
