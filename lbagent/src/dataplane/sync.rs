//! Make one zone's rule entries equal a desired list, touching only entries
//! that differ (config changes never reload programs or disturb other rules).

use std::{collections::HashSet, net::Ipv4Addr};

use anyhow::Result;
use lbagent_common::{DnatKey, SNAT_KEY_FIXED_BITS};

use super::tables::{DnatSpec, SnatSpec, Tables};

/// Upserts changed DNAT rules of `zone`, removes the ones not wanted.
pub fn dnat(t: &Tables, zone: u16, want: &[DnatSpec], changes: &mut Vec<String>) -> Result<()> {
    let have: Vec<_> = t.dnat_rules()?.into_iter().filter(|(k, _, _)| k.zone == zone).collect();
    for d in want {
        let same = have.iter().find(|(k, _, _)| *k == d.key()).is_some_and(|(_, r, bs)| {
            *r == d.rule() && bs.iter().map(|b| (Ipv4Addr::from(b.addr), b.port)).collect::<Vec<_>>() == d.backends
        });
        if !same {
            t.set_dnat(d)?;
            changes.push(format!("dnat {} proto {} port {} -> {:?}", d.addr, d.proto, d.port, d.backends));
        }
    }
    let wanted: HashSet<DnatKey> = want.iter().map(|d| d.key()).collect();
    for (k, _, _) in &have {
        if !wanted.contains(k) {
            t.remove_dnat(k)?;
            changes.push(format!("removed dnat {} proto {} port {}", Ipv4Addr::from(k.addr), k.proto, k.port));
        }
    }
    Ok(())
}

/// Upserts changed SNAT rules of `zone`, removes the ones not wanted.
pub fn snat(t: &Tables, zone: u16, want: &[SnatSpec], changes: &mut Vec<String>) -> Result<()> {
    let have: Vec<_> = t.snat_rules()?.into_iter().filter(|(_, k, _)| k.zone == zone).collect();
    for s in want {
        let key = s.key();
        let same =
            have.iter().find(|(len, k, _)| *len == key.prefix_len() && *k == key.data()).is_some_and(|(_, _, r)| {
                r.addr == s.to.octets() && r.rule_id == s.rule_id && (r.port_min, r.port_max) == s.ports
            });
        if !same {
            t.set_snat(s)?;
            changes.push(format!("snat {}/{} -> {}", s.cidr.0, s.cidr.1, s.to));
        }
    }
    for (len, k, _) in &have {
        if !want.iter().any(|s| s.key().prefix_len() == *len && s.key().data() == *k) {
            t.remove_snat_key(*len, *k)?;
            changes.push(format!("removed snat {}/{}", Ipv4Addr::from(k.addr), len - SNAT_KEY_FIXED_BITS));
        }
    }
    Ok(())
}

/// Removes every rule of `zone` and flushes its flows; returns the flow count.
pub fn clear_zone(t: &Tables, zone: u16) -> Result<usize> {
    dnat(t, zone, &[], &mut Vec::new())?;
    snat(t, zone, &[], &mut Vec::new())?;
    t.flush_conntrack(|k, _| k.zone == zone)
}
