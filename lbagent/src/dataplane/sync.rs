//! Make one zone's rule entries equal a desired list, touching only entries
//! that differ (config changes never reload programs or disturb other rules).
//! What the zone has is given by the caller (`engine::Engine` reads the maps
//! once per pass for every zone), so a pass costs O(all rules), not
//! zones × all rules.

use std::{
    collections::{HashMap, HashSet},
    net::Ipv4Addr,
};

use anyhow::Result;
use lbagent_common::{Backend, CT_F_REPLY, DnatKey, DnatRule, PROTO_UDP, SNAT_KEY_FIXED_BITS, SnatKey, SnatRule};

use super::tables::{AclSpec, DnatSpec, SnatSpec, Tables};
use crate::outcome::Changes;

/// Keeps change logs readable for big configs: past `LIMIT` lines of one
/// kind, the rest is summarised as a count.
const LIMIT: usize = 20;

fn summarise(kind: &str, lines: Changes, changes: &mut Changes) {
    let n = lines.len();
    changes.extend(lines.into_iter().take(LIMIT));
    if n > LIMIT {
        changes.push(format!("… and {} more {kind} changes ({n} in all)", n - LIMIT));
    }
}

/// Upserts changed DNAT rules of `zone`, removes the ones not wanted, and
/// flushes the UDP flows of backends that left a rule.
///
/// Upserts run first, then removals, and neither touches the backends,
/// table or ACL of a rule id still wanted under another key: a rule id that
/// moved (a listener's port, type or VIP changed, two listeners swapped
/// ports) keeps what it has through the pass.
pub fn dnat(t: &Tables, have: &[DnatEntry], want: &[DnatSpec], out: &mut Changes) -> Result<()> {
    let mut changes = Changes::new();
    let wanted: HashSet<DnatKey> = want.iter().map(|d| d.key()).collect();
    let in_use: HashSet<u32> = want.iter().map(|d| d.rule_id).collect();
    // Looked up by key and by rule id, not searched: a gateway of 60 000
    // rules would otherwise compare every wanted rule with every one it has.
    let by_key: HashMap<DnatKey, &DnatEntry> = have.iter().rev().map(|e| (e.0, e)).collect();
    let by_rule: HashMap<u32, &DnatRule> = have.iter().rev().map(|(_, r, _)| (r.rule_id, r)).collect();
    for d in want {
        let same = by_key.get(&d.key()).is_some_and(|(_, r, bs)| {
            *r == d.rule() && bs.iter().map(|b| (Ipv4Addr::from(b.addr), b.port)).collect::<Vec<_>>() == d.backends
        });
        // A scheduler table can change while the rule and its backends do
        // not (a weight): its digest says.
        let same = same
            && match &d.sched {
                None => true,
                Some(s) if s.kind == super::tables::SchedKind::Least => {
                    t.least_weights(d.rule_id, &d.backends)? == s.weights
                }
                Some(s) => t.sched_digest(d.rule_id)? == Some(super::tables::table_digest(&s.table)),
            };
        if !same {
            t.set_dnat_keeping(d, &in_use)?;
            changes.push(format!("dnat {} proto {} port {} -> {:?}", d.addr, d.proto, d.port, d.backends));
        }
    }
    for (k, _, _) in have {
        if !wanted.contains(k) {
            t.remove_dnat_keeping(k, &in_use)?;
            changes.push(format!("removed dnat {} proto {} port {}", Ipv4Addr::from(k.addr), k.proto, k.port));
        }
    }
    // A changed ACL applies to flows already open, too (fail closed): the
    // flows whose client the new ACL refuses are flushed (they would not
    // reopen); the clients it still accepts keep theirs (an ACL removed
    // refuses nobody). When the maps hold none of the zone's rules (the
    // first apply after an upgrade writes them all afresh, over the flows
    // the previous layout's programs opened), a rule with an ACL counts as
    // changed (and `Engine::flush_refused_after_attach` flushes again once
    // the zone's new programs are attached: until then the previous
    // programs, with the old ACL, still open flows, which the new ones
    // adopt).
    // A new listener among existing ones has a fresh rule id: no flow can
    // carry it.
    let acl_changed = rule_acls(want.iter().filter(|d| match by_rule.get(&d.rule_id) {
        Some(r) => r.acl_digest != d.rule().acl_digest,
        None => have.is_empty() && d.acl.is_some(),
    }));
    if !acl_changed.is_empty() {
        // Not empty: `want` has the rules.
        let n = flush_refused(t, want[0].zone, &acl_changed)?;
        changes.push(format!("ACL changed: flushed {n} flows"));
    }
    let gone = udp_backends_gone(have, want);
    if !gone.is_empty() {
        let n = t.flush_conntrack(|k, e| {
            let (id, addr) = (e.dnat_rule, e.xlate.daddr);
            e.flags & CT_F_REPLY == 0
                && k.proto == PROTO_UDP
                && (gone.contains(&(id, addr, e.xlate.dport)) || gone.contains(&(id, addr, 0)))
        })?;
        if n > 0 {
            changes.push(format!("flushed {n} UDP flows of backends that left"));
        }
    }
    summarise("dnat", changes, out);
    Ok(())
}

/// ACLs by DNAT rule id.
pub type RuleAcls = std::collections::HashMap<u32, AclSpec>;

/// The ACLs of these rules, by rule id.
pub fn rule_acls<'a>(rules: impl IntoIterator<Item = &'a DnatSpec>) -> RuleAcls {
    rules.into_iter().filter_map(|d| Some((d.rule_id, d.acl.clone()?))).collect()
}

/// Flushes the flows of `zone` into a rule of `acls` whose client that
/// rule's ACL refuses; returns how many.
pub fn flush_refused(t: &Tables, zone: u16, acls: &RuleAcls) -> Result<usize> {
    t.flush_conntrack(|k, e| {
        k.zone == zone
            && e.flags & CT_F_REPLY == 0
            && acls.get(&e.dnat_rule).is_some_and(|a| !a.accepts(Ipv4Addr::from(k.saddr)))
    })
}

/// (rule id, backend address, port) of UDP backends in `have` that no
/// wanted rule with that id keeps. UDP has no end of connection: without a
/// flush, a client that keeps sending stays on a removed or failed backend
/// (kube-proxy flushes for the same reason). TCP flows drain instead.
fn udp_backends_gone(have: &[DnatEntry], want: &[DnatSpec]) -> HashSet<(u32, [u8; 4], u16)> {
    let kept: HashSet<(u32, [u8; 4], u16)> =
        want.iter().flat_map(|d| d.backends.iter().map(|(a, p)| (d.rule_id, a.octets(), *p))).collect();
    have.iter()
        .filter(|(k, _, _)| k.proto == PROTO_UDP)
        .flat_map(|(_, r, bs)| bs.iter().map(|b| (r.rule_id, b.addr, b.port)))
        .filter(|g| !kept.contains(g))
        .collect()
}

/// Upserts changed SNAT rules of a zone (`have`: its entries), removes the
/// ones not wanted.
pub fn snat(t: &Tables, have: &[SnatEntry], want: &[SnatSpec], out: &mut Changes) -> Result<()> {
    let mut changes = Changes::new();
    let by_key: HashMap<(u32, SnatKey), &SnatRule> = have.iter().rev().map(|(len, k, r)| ((*len, *k), r)).collect();
    let wanted: HashSet<(u32, SnatKey)> = want.iter().map(|s| (s.key().prefix_len(), s.key().data())).collect();
    for s in want {
        let key = s.key();
        let same = by_key.get(&(key.prefix_len(), key.data())).is_some_and(|r| **r == s.rule());
        if !same {
            t.set_snat(s)?;
            changes.push(format!("snat {}/{} -> {}", s.cidr.0, s.cidr.1, s.to));
        }
    }
    for (len, k, _) in have {
        if !wanted.contains(&(*len, *k)) {
            t.remove_snat_key(*len, *k)?;
            changes.push(format!("removed snat {}/{}", Ipv4Addr::from(k.addr), len - SNAT_KEY_FIXED_BITS));
        }
    }
    summarise("snat", changes, out);
    Ok(())
}

/// A DNAT rule as stored: key, rule, backends.
pub type DnatEntry = (DnatKey, DnatRule, Vec<Backend>);
/// A SNAT rule as stored: LPM prefix length, key, rule.
pub type SnatEntry = (u32, SnatKey, SnatRule);

/// The stored form of a wanted DNAT rule (what `dnat` leaves in the maps).
pub fn dnat_entry(d: &DnatSpec) -> DnatEntry {
    let backends = d.backends.iter().map(|(a, p)| Backend { addr: a.octets(), port: *p, _pad0: 0 }).collect();
    (d.key(), d.rule(), backends)
}

/// The stored form of a wanted SNAT rule.
pub fn snat_entry(s: &SnatSpec) -> SnatEntry {
    let key = s.key();
    (key.prefix_len(), key.data(), s.rule())
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_change_lists_are_summarised() {
        let mut out = crate::outcome::Changes::new();
        super::summarise("dnat", (0..25).map(|i| i.to_string()).collect(), &mut out);
        assert_eq!(out.len(), 21);
        assert_eq!(out[20], "… and 5 more dnat changes (25 in all)");
    }
}
