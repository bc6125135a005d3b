//! Runtime facts the agent owns (never in the state file): zone ids, each
//! load balancer's link-local inner/outer addresses and each backend's mapped
//! port. Pure allocation logic here; persistence in `store`.
//!
//! An object's allocations are made in one pass before any host change
//! (`lb::allocate`, `natgw::allocate`) and persisted by the reconciler;
//! the ensure that follows only looks them up ([`Allocated`]). A crash in
//! the middle of an ensure therefore never leaves a host change whose ids
//! or addresses are unknown to the next run, which must clean it up.
//!
//! Fixes over the original: allocations survive restarts (persisted), host
//! addresses are only treated as taken when they are in 169.254.0.0/16, and
//! 169.254.169.254 (the metadata address) is never handed out.

pub mod rule_ids;
pub mod store;

use std::{
    borrow::Borrow,
    collections::{BTreeMap, BTreeSet, HashSet},
    net::Ipv4Addr,
    sync::Arc,
};

pub use rule_ids::RuleIds;
use serde::{Deserialize, Serialize};

/// First link-local index (169.254.0.100), as in the original.
pub const LINKLOCAL_FIRST: u16 = 100;
pub const MAPPED_PORT_FIRST: u16 = 1025;
pub const METADATA_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

/// What the agent allocated. Read its fields anywhere; change it only
/// through its methods: they count the changes in `generation`, which tells
/// the reconciler whether there is anything to write (a copy kept to
/// compare with was ~8 MB at 100 000 rules, and comparing it cost ~10 ms
/// per step of a pass).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocations {
    /// Zone id per object key (`lb/<id>`, `natgw/<name>`); ids start at 1.
    #[serde(default)]
    pub zones: BTreeMap<String, u16>,
    #[serde(default)]
    pub lbs: BTreeMap<String, LbAlloc>,
    /// Dataplane rule id per rule key (`natgw/<name>/dnat/...`); ids start at 1
    /// and are unique across zones (they key backends and conntrack entries).
    /// Shared with the status document (100 000 rules: ~9 MB with its
    /// keys); a change copies only its object's map ([`RuleIds`]).
    #[serde(default)]
    pub rule_ids: RuleIds,
    /// Rule ids are never reused: flows of a deleted rule may still drain
    /// under its id, and its statistics must not be mistaken for a new rule's.
    #[serde(default)]
    pub next_rule_id: u32,
    /// QoS bucket (index into the QoS arrays) per rule-instance key
    /// (`natgw/<gw>/qos/...`); 1 … `QOS_BUCKETS_MAX` − 1, lowest free first.
    #[serde(default)]
    pub qos_buckets: BTreeMap<String, u32>,
    /// Whether every rule id in use is below `next_rule_id` (learnt on the
    /// first allocation, kept by each one): then the next id is free
    /// without looking at the others, which a document of 100 000 rules
    /// would otherwise do 100 000 times.
    #[serde(skip)]
    ids_below_next: IdsBelowNext,
    /// Bumped by every method call that changes the allocations.
    #[serde(skip)]
    pub generation: Generation,
}

/// A count of changes, not part of what it counts the changes of: equal
/// whatever its value (two records of the same facts are equal).
#[derive(Clone, Copy, Debug, Default)]
pub struct Generation(pub u64);

impl PartialEq for Generation {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Generation {}

impl Generation {
    pub fn bump(&mut self) {
        self.0 += 1;
    }
}

/// A fact derived from the allocations, not part of them: equal whatever
/// its state (two allocations that hold the same ids are equal).
#[derive(Clone, Copy, Debug, Default)]
struct IdsBelowNext(Option<bool>);

impl PartialEq for IdsBelowNext {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for IdsBelowNext {}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LbAlloc {
    /// On `h…0` in the namespace (/16): the source the proxy sees.
    pub inner: Ipv4Addr,
    /// On `h…1` in the host (/16 noprefixroute): where the proxy binds.
    pub outer: Ipv4Addr,
    /// Backend id → mapped port on `inner`.
    #[serde(default)]
    pub ports: BTreeMap<String, u16>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllocError {
    ZonesExhausted,
    AddressesExhausted,
    PortsExhausted(String),
    QosBucketsExhausted,
    /// An ensure looked up an id that its allocate pass did not make (a
    /// bug: the two passes disagree about the object's keys).
    NotAllocated(String),
}

impl std::fmt::Display for AllocError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllocError::ZonesExhausted => write!(f, "no free zone id (65535 in use)"),
            AllocError::AddressesExhausted => write!(f, "no free link-local address in 169.254.0.0/16"),
            AllocError::PortsExhausted(lb) => write!(f, "load balancer {lb}: no free mapped port in 1025-65535"),
            AllocError::QosBucketsExhausted => {
                write!(f, "no free QoS bucket ({} rule instances in use)", lbagent_common::QOS_BUCKETS_MAX - 1)
            }
            AllocError::NotAllocated(key) => write!(f, "{key}: used before it was allocated"),
        }
    }
}

impl std::error::Error for AllocError {}

/// Ids already allocated, looked up by key for the builders that take an
/// id function (rules, QoS). A key without an id yields 0 and is kept:
/// [`Allocated::check`] turns it into an error before anything uses the
/// result.
pub struct Allocated<'a, T> {
    ids: &'a dyn Ids<T>,
    missing: Option<String>,
}

/// A map of allocated ids by key.
pub trait Ids<T> {
    fn id(&self, key: &str) -> Option<T>;
}

impl<K: Borrow<str> + Ord, T: Copy> Ids<T> for BTreeMap<K, T> {
    fn id(&self, key: &str) -> Option<T> {
        self.get(key).copied()
    }
}

impl Ids<u32> for RuleIds {
    fn id(&self, key: &str) -> Option<u32> {
        self.get(key)
    }
}

impl<'a, T: Copy + Default> Allocated<'a, T> {
    pub fn new(ids: &'a dyn Ids<T>) -> Self {
        Allocated { ids, missing: None }
    }

    pub fn get(&mut self, key: &str) -> T {
        match self.ids.id(key) {
            Some(id) => id,
            None => {
                self.missing.get_or_insert_with(|| key.to_string());
                T::default()
            }
        }
    }

    /// Err when any key looked up had no id.
    pub fn check(self) -> Result<(), AllocError> {
        self.missing.map_or(Ok(()), |k| Err(AllocError::NotAllocated(k)))
    }
}

/// `169.254.(i >> 8).(i & 255)`.
pub fn linklocal(i: u16) -> Ipv4Addr {
    Ipv4Addr::new(169, 254, (i >> 8) as u8, i as u8)
}

/// Whether a link-local index may be handed out at all.
fn usable(i: u16) -> bool {
    let a = linklocal(i);
    let last = a.octets()[3];
    a != METADATA_ADDR && last != 0 && last != 255
}

impl Allocations {
    /// The zone of `key`, allocating the lowest free id.
    pub fn zone(&mut self, key: &str) -> Result<u16, AllocError> {
        if let Some(z) = self.zones.get(key) {
            return Ok(*z);
        }
        let used: BTreeSet<u16> = self.zones.values().copied().collect();
        let z = (1..=u16::MAX).find(|z| !used.contains(z)).ok_or(AllocError::ZonesExhausted)?;
        self.zones.insert(key.to_string(), z);
        self.generation.bump();
        Ok(z)
    }

    pub fn release_zone(&mut self, key: &str) -> Option<u16> {
        let z = self.zones.remove(key);
        if z.is_some() {
            self.generation.bump();
        }
        z
    }

    /// Inner/outer addresses of load balancer `id`, allocating two free
    /// link-local addresses if needed. `host` holds addresses configured on the
    /// host (only 169.254/16 ones matter).
    pub fn lb_addresses(&mut self, id: &str, host: &HashSet<Ipv4Addr>) -> Result<(Ipv4Addr, Ipv4Addr), AllocError> {
        if let Some(a) = self.lbs.get(id) {
            return Ok((a.inner, a.outer));
        }
        let mut taken: HashSet<Ipv4Addr> = host.iter().copied().filter(|a| a.octets()[..2] == [169, 254]).collect();
        for a in self.lbs.values() {
            taken.insert(a.inner);
            taken.insert(a.outer);
        }
        let mut free =
            (LINKLOCAL_FIRST..=u16::MAX).filter(|i| usable(*i)).map(linklocal).filter(|a| !taken.contains(a));
        let inner = free.next().ok_or(AllocError::AddressesExhausted)?;
        let outer = free.next().ok_or(AllocError::AddressesExhausted)?;
        self.lbs.insert(id.to_string(), LbAlloc { inner, outer, ports: BTreeMap::new() });
        self.generation.bump();
        Ok((inner, outer))
    }

    /// Makes the mapped ports of `id` exactly one per backend in `backends`:
    /// existing ones stay, new backends get the lowest free port, ports of
    /// removed backends are released. Returns (added, released) backend ids.
    pub fn lb_ports(&mut self, id: &str, backends: &[&str]) -> Result<(Vec<String>, Vec<String>), AllocError> {
        let Some(a) = self.lbs.get_mut(id) else { return Ok((vec![], vec![])) };
        let want: BTreeSet<&str> = backends.iter().copied().collect();
        let released: Vec<String> = a.ports.keys().filter(|b| !want.contains(b.as_str())).cloned().collect();
        for b in &released {
            a.ports.remove(b);
        }
        if !released.is_empty() {
            self.generation.bump();
        }
        let mut added = Vec::new();
        let mut used: BTreeSet<u16> = a.ports.values().copied().collect();
        for b in want {
            if a.ports.contains_key(b) {
                continue;
            }
            let p = (MAPPED_PORT_FIRST..=u16::MAX)
                .find(|p| !used.contains(p))
                .ok_or_else(|| AllocError::PortsExhausted(id.into()))?;
            used.insert(p);
            a.ports.insert(b.to_string(), p);
            added.push(b.to_string());
            self.generation.bump();
        }
        Ok((added, released))
    }

    /// The rule id of `key`, allocating a fresh one (never a released one,
    /// until the 32-bit space wraps).
    pub fn rule_id(&mut self, key: &str) -> u32 {
        if let Some(id) = self.rule_ids.get(key) {
            return id;
        }
        let next = self.next_rule_id;
        // Ids are handed out upward and never reused, so until the 32-bit
        // space wraps every id in use is below `next_rule_id` (a file from
        // before it was kept may say otherwise: checked once).
        let below = *self.ids_below_next.0.get_or_insert_with(|| self.rule_ids.values().all(|v| v < next));
        let mut id = next.max(1);
        if !below {
            let used: BTreeSet<u32> = self.rule_ids.values().collect();
            while used.contains(&id) || id == 0 {
                id = id.wrapping_add(1);
            }
        }
        self.next_rule_id = id.wrapping_add(1);
        // Past the top of the space, ids below `next_rule_id` are in use.
        self.ids_below_next.0 = Some(below && self.next_rule_id != 0);
        self.rule_ids.insert(Arc::from(key), id);
        self.generation.bump();
        id
    }

    /// The QoS bucket of `key`, allocating the lowest free one.
    pub fn qos_bucket(&mut self, key: &str) -> Result<u32, AllocError> {
        if let Some(b) = self.qos_buckets.get(key) {
            return Ok(*b);
        }
        let used: BTreeSet<u32> = self.qos_buckets.values().copied().collect();
        let b =
            (1..lbagent_common::QOS_BUCKETS_MAX).find(|b| !used.contains(b)).ok_or(AllocError::QosBucketsExhausted)?;
        self.qos_buckets.insert(key.to_string(), b);
        self.generation.bump();
        Ok(b)
    }

    /// Releases QoS buckets whose key starts with `prefix` and is not in
    /// `keep`; returns them.
    pub fn release_qos(&mut self, prefix: &str, keep: &BTreeSet<String>) -> Vec<u32> {
        let mut released = Vec::new();
        self.qos_buckets.retain(|k, b| {
            let stays = !k.starts_with(prefix) || keep.contains(k);
            if !stays {
                released.push(*b);
            }
            stays
        });
        if !released.is_empty() {
            self.generation.bump();
        }
        released
    }

    /// Releases rule ids whose key starts with `prefix` and is not in `keep`;
    /// returns the released ids.
    pub fn release_rules(&mut self, prefix: &str, keep: &BTreeSet<String>) -> Vec<u32> {
        // The keys with `prefix` are one run of their object's map: only
        // they are looked at, and that map is copied only when one goes.
        let gone: Vec<(Arc<str>, u32)> = self
            .rule_ids
            .under(prefix)
            .filter(|(k, _)| !keep.contains(&***k))
            .map(|(k, id)| (Arc::clone(k), id))
            .collect();
        if gone.is_empty() {
            return Vec::new();
        }
        for (k, _) in &gone {
            self.rule_ids.remove(k);
        }
        self.generation.bump();
        gone.into_iter().map(|(_, id)| id).collect()
    }

    pub fn release_lb(&mut self, id: &str) -> Option<LbAlloc> {
        let a = self.lbs.remove(id);
        if a.is_some() {
            self.generation.bump();
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each call that changes the allocations bumps the generation once;
    /// one that finds what it asks for changes nothing and bumps nothing.
    #[test]
    fn the_generation_counts_changes_and_only_changes() {
        let mut a = Allocations::default();
        let mut seen = 0;
        let mut changed = |a: &Allocations, yes: bool, what: &str| {
            assert_eq!(a.generation.0 > seen, yes, "{what}");
            seen = a.generation.0;
        };
        a.zone("lb/x").unwrap();
        changed(&a, true, "a new zone");
        a.zone("lb/x").unwrap();
        changed(&a, false, "the same zone");
        a.lb_addresses("x", &HashSet::new()).unwrap();
        changed(&a, true, "new addresses");
        a.lb_addresses("x", &HashSet::new()).unwrap();
        changed(&a, false, "the same addresses");
        a.lb_ports("x", &["b1", "b2"]).unwrap();
        changed(&a, true, "new ports");
        a.lb_ports("x", &["b1", "b2"]).unwrap();
        changed(&a, false, "the same ports");
        a.lb_ports("x", &["b1"]).unwrap();
        changed(&a, true, "a port released");
        a.rule_id("lb/x/r");
        changed(&a, true, "a new rule id");
        a.rule_id("lb/x/r");
        changed(&a, false, "the same rule id");
        a.qos_bucket("natgw/g/qos/q").unwrap();
        changed(&a, true, "a new bucket");
        a.qos_bucket("natgw/g/qos/q").unwrap();
        changed(&a, false, "the same bucket");
        assert!(a.release_qos("natgw/h/", &BTreeSet::new()).is_empty());
        changed(&a, false, "no bucket released");
        assert_eq!(a.release_qos("natgw/g/", &BTreeSet::new()).len(), 1);
        changed(&a, true, "a bucket released");
        assert!(a.release_rules("lb/x/", &BTreeSet::from(["lb/x/r".to_string()])).is_empty());
        changed(&a, false, "no rule released");
        assert_eq!(a.release_rules("lb/x/", &BTreeSet::new()).len(), 1);
        changed(&a, true, "a rule released");
        assert!(a.release_lb("x").is_some());
        changed(&a, true, "a load balancer released");
        assert!(a.release_lb("x").is_none());
        changed(&a, false, "nothing to release");
        assert!(a.release_zone("lb/x").is_some());
        changed(&a, true, "a zone released");
        assert!(a.release_zone("lb/x").is_none());
        changed(&a, false, "no zone to release");
        // Rule ids are never reused: the next one stays.
        let fresh = Allocations { next_rule_id: a.next_rule_id, ..Default::default() };
        assert_eq!(a, fresh, "the generation is not part of what was allocated");
    }

    #[test]
    fn linklocal_pairs_skip_host_and_metadata() {
        let mut a = Allocations::default();
        let host: HashSet<_> = [Ipv4Addr::new(169, 254, 0, 100), Ipv4Addr::new(10, 0, 0, 101)].into();
        let (i, o) = a.lb_addresses("lb1", &host).unwrap();
        assert_eq!((i, o), (Ipv4Addr::new(169, 254, 0, 101), Ipv4Addr::new(169, 254, 0, 102)));
        // Stable on repeat.
        assert_eq!(a.lb_addresses("lb1", &HashSet::new()).unwrap(), (i, o));
        let (i2, _) = a.lb_addresses("lb2", &host).unwrap();
        assert_eq!(i2, Ipv4Addr::new(169, 254, 0, 103));
    }

    #[test]
    fn metadata_address_and_edges_are_never_handed_out() {
        let all: Vec<Ipv4Addr> = (LINKLOCAL_FIRST..=u16::MAX).filter(|i| usable(*i)).map(linklocal).collect();
        assert!(!all.contains(&METADATA_ADDR));
        assert!(all.iter().all(|a| a.octets()[3] != 0 && a.octets()[3] != 255));
        assert_eq!(all[0], Ipv4Addr::new(169, 254, 0, 100));
    }

    #[test]
    fn exhaustion_is_an_error_not_a_wrap() {
        let mut a = Allocations::default();
        let host: HashSet<Ipv4Addr> = (LINKLOCAL_FIRST..=u16::MAX).map(linklocal).skip(1).collect();
        assert_eq!(a.lb_addresses("x", &host), Err(AllocError::AddressesExhausted));
    }

    #[test]
    fn mapped_ports_are_stable_and_released() {
        let mut a = Allocations::default();
        a.lb_addresses("lb", &HashSet::new()).unwrap();
        let (added, _) = a.lb_ports("lb", &["b1", "b2", "b3"]).unwrap();
        assert_eq!(added.len(), 3);
        let before = a.lbs["lb"].ports.clone();
        assert_eq!(before.values().copied().collect::<Vec<_>>(), vec![1025, 1026, 1027]);
        let (added, released) = a.lb_ports("lb", &["b1", "b3", "b4"]).unwrap();
        assert_eq!((added, released), (vec!["b4".to_string()], vec!["b2".to_string()]));
        let after = &a.lbs["lb"].ports;
        assert_eq!(after["b1"], before["b1"]);
        assert_eq!(after["b3"], before["b3"]);
        assert_eq!(after["b4"], 1026, "the released port is reused");
    }

    #[test]
    fn rule_ids_are_stable_and_never_reused() {
        let mut a = Allocations::default();
        assert_eq!(a.rule_id("natgw/g/fip/1"), 1);
        assert_eq!(a.rule_id("natgw/g/snat/2"), 2);
        assert_eq!(a.rule_id("natgw/g/fip/1"), 1);
        assert_eq!(a.release_rules("natgw/g/", &BTreeSet::from(["natgw/g/snat/2".to_string()])), vec![1]);
        assert_eq!(a.rule_id("natgw/g/fip/3"), 3, "1 is not handed out again");
    }

    #[test]
    fn released_rules_are_those_under_the_prefix_and_a_shared_map_is_copied_only_on_a_change() {
        let mut a = Allocations::default();
        for k in ["natgw/g/dnat/1", "natgw/g/snat/1", "natgw/g2/dnat/1", "natgw/h/fip/1", "lb/x/listener/l"] {
            a.rule_id(k);
        }
        let shared = a.rule_ids.clone();
        // Nothing under the prefix goes: the map stays shared.
        let keep = BTreeSet::from(["natgw/g/dnat/1".to_string(), "natgw/g/snat/1".to_string()]);
        assert!(a.release_rules("natgw/g/", &keep).is_empty());
        assert!(a.rule_ids.shares_object_with(&shared, "natgw/g/"));
        // `natgw/g2/` sorts among `natgw/g/`'s neighbours but is not under it.
        assert_eq!(a.release_rules("natgw/g/", &BTreeSet::new()), vec![1, 2]);
        assert_eq!(
            a.rule_ids.iter().map(|(k, _)| &**k).collect::<Vec<_>>(),
            ["lb/x/listener/l", "natgw/g2/dnat/1", "natgw/h/fip/1"]
        );
        // The holder of the shared map (the status) still sees it whole.
        assert_eq!(shared.len(), 5);
        a.rule_id("natgw/g/dnat/9");
        assert_eq!(shared.len(), 5);
        assert!(a.rule_ids.shares_object_with(&shared, "natgw/h/"), "other objects' maps stay shared");
    }

    #[test]
    fn rule_ids_skip_ids_in_use_after_an_old_file_and_after_the_space_wraps() {
        // A file from before `next_rule_id` was kept: ids 1–3 in use.
        let mut a: Allocations =
            serde_json::from_str(r#"{"rule_ids": {"natgw/g/fip/1": 1, "natgw/g/fip/2": 2, "natgw/g/fip/3": 3}}"#)
                .unwrap();
        assert_eq!(a.rule_id("natgw/g/fip/4"), 4);
        assert_eq!(a.rule_id("natgw/g/fip/5"), 5);
        // The top of the space: u32::MAX, then 0 is skipped and so are the
        // ids still in use from the first round.
        let mut a = Allocations { next_rule_id: u32::MAX - 1, ..Default::default() };
        a.rule_ids.insert("natgw/g/old/1".into(), 1);
        a.rule_ids.insert("natgw/g/old/2".into(), 2);
        assert_eq!(a.rule_id("natgw/g/fip/a"), u32::MAX - 1);
        assert_eq!(a.rule_id("natgw/g/fip/b"), u32::MAX);
        assert_eq!(a.rule_id("natgw/g/fip/c"), 3, "0, 1 and 2 are not handed out");
        assert_eq!(a.rule_id("natgw/g/fip/d"), 4);
        // Allocations holding the same ids are equal, however they were made.
        let copy: Allocations = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        assert_eq!(copy, a);
    }

    #[test]
    fn lookups_never_allocate_and_report_the_first_missing_key() {
        let mut a = Allocations::default();
        a.rule_id("natgw/g/fip/1");
        let mut ids = Allocated::new(&a.rule_ids);
        assert_eq!(ids.get("natgw/g/fip/1"), 1);
        assert_eq!(ids.get("natgw/g/fip/2"), 0);
        assert_eq!(ids.get("natgw/g/fip/3"), 0);
        assert_eq!(ids.check(), Err(AllocError::NotAllocated("natgw/g/fip/2".into())));
        assert_eq!(a.rule_ids.len(), 1);
        assert!(Allocated::new(&a.rule_ids).check().is_ok());
    }

    #[test]
    fn zones_are_stable_and_reused_after_release() {
        let mut a = Allocations::default();
        assert_eq!(a.zone("lb/a").unwrap(), 1);
        assert_eq!(a.zone("natgw/g").unwrap(), 2);
        assert_eq!(a.zone("lb/a").unwrap(), 1);
        a.release_zone("lb/a");
        assert_eq!(a.zone("lb/b").unwrap(), 1);
    }
}
