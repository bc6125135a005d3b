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
    /// Makes zone `zone`'s entries equal `mtus` (interface index → MTU),
    /// writing only what differs (a pass with nothing to do writes
    /// nothing); returns whether anything changed. Pins of a build without
    /// the map: nothing to write (its programs have no fast-path MTU check).
    pub fn sync_egress_mtu(&self, zone: u16, mtus: &BTreeMap<u32, u32>) -> Result<bool> {
        if !self.dir.join(MAP_EGRESS_MTU).exists() {
            return Ok(false);
        }
        let mut map = self.hash::<MtuKey, u32>(MAP_EGRESS_MTU)?;
        let have: BTreeMap<u32, u32> =
            map.iter().filter_map(|e| e.ok()).filter(|(k, _)| k.zone == zone).map(|(k, v)| (k.ifindex, v)).collect();
        let key = |ifindex| MtuKey { zone, _pad: 0, ifindex };
        let mut changed = false;
        for (&ifindex, &mtu) in mtus {
            if have.get(&ifindex) != Some(&mtu) {
                map.insert(&key(ifindex), &mtu, 0)?;
                changed = true;
            }
        }
        for ifindex in have.keys().filter(|i| !mtus.contains_key(i)) {
            map.remove(&key(*ifindex))?;
            changed = true;
        }
        Ok(changed)
    }

    /// Every entry, by zone and interface.
    pub fn egress_mtus(&self) -> Result<Vec<(MtuKey, u32)>> {
        if !self.dir.join(MAP_EGRESS_MTU).exists() {
            return Ok(vec![]);
        }
        let mut out: Vec<_> = self.hash::<MtuKey, u32>(MAP_EGRESS_MTU)?.iter().filter_map(|e| e.ok()).collect();
        out.sort();
        Ok(out)
    }
}
