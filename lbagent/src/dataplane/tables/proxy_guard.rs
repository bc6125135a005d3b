//! The proxy guard (`proxy_guard.rs` of the program): whose sockets may
//! open connections through a load balancer's host-side link, and what it
//! dropped.

use anyhow::Result;
use lbagent_common::*;

use super::Tables;

impl Tables {
    /// Lets haproxy's workers (`uid`; `None` = root only) open connections
    /// toward the load balancers' inner addresses.
    pub fn set_proxy_guard(&self, uid: Option<u32>) -> Result<()> {
        let want = match uid {
            Some(uid) => ProxyGuard { uid, flags: PROXY_GUARD_F_UID },
            None => ProxyGuard::default(),
        };
        let mut map = self.array(MAP_PROXY_GUARD)?;
        if map.get(&0, 0)? != want {
            map.set(0, &want, 0)?;
        }
        Ok(())
    }

    /// The guard's setting; `None` on pins made by a build without the
    /// guard (any load of this build's object pins its maps, unset until a
    /// load balancer's ensure writes the uid).
    pub fn proxy_guard(&self) -> Result<Option<ProxyGuard>> {
        if !self.pinned(MAP_PROXY_GUARD) {
            return Ok(None);
        }
        Ok(Some(self.array(MAP_PROXY_GUARD)?.get(&0, 0)?))
    }

    /// Packets the guard dropped, summed over CPUs (0 before it was loaded).
    pub fn proxy_guard_drops(&self) -> Result<u64> {
        if !self.pinned(MAP_PROXY_GUARD_DROPS) {
            return Ok(0);
        }
        Ok(self.per_cpu_array(MAP_PROXY_GUARD_DROPS)?.get(&0, 0)?.iter().sum())
    }
}
