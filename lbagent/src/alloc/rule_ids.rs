//! Rule ids by rule key, kept in one map per object (`lb/<id>/`,
//! `natgw/<name>/`: [`naming::rule_object`]) and shared with the status
//! document.
//!
//! The status document holds a copy of this map between applies (status
//! and metrics name rules with it). A copy is cheap: the object maps are
//! shared (`Arc`), one pointer each. A change copies only the map of the
//! object it changes: ~80 KB for a gateway of 2 000 rules, where one map
//! for every object was copied whole by the first change after the status
//! took it (heaptrack: 3.99 MB at 100 000 rules, at the peak of an apply).
//!
//! Every key of an object starts with the object's prefix, and no prefix
//! is a prefix of another (each ends at the key's second `/`): iterating
//! the objects in order, each one's keys in order, yields every key in
//! order.

use std::{
    collections::BTreeMap,
    ops::{Bound, Index},
    sync::Arc,
};

use serde::{Deserialize, Deserializer, Serialize, Serializer, ser::SerializeMap};

use crate::naming;

type Object = BTreeMap<Arc<str>, u32>;

/// Rule key → rule id, one shared map per object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleIds {
    objects: BTreeMap<Arc<str>, Arc<Object>>,
}

impl RuleIds {
    pub fn get(&self, key: &str) -> Option<u32> {
        self.objects.get(naming::rule_object(key))?.get(key).copied()
    }

    pub fn len(&self) -> usize {
        self.objects.values().map(|o| o.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// Every (key, id), in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&Arc<str>, u32)> {
        self.objects.values().flat_map(|o| o.iter().map(|(k, v)| (k, *v)))
    }

    pub fn values(&self) -> impl Iterator<Item = u32> + '_ {
        self.iter().map(|(_, v)| v)
    }

    /// The (key, id) pairs whose key starts with `prefix`, a prefix within
    /// one object (its rule prefix or longer).
    pub fn under<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = (&'a Arc<str>, u32)> + 'a {
        debug_assert!(naming::rule_object(prefix).ends_with('/'), "{prefix:?} is not within one object");
        self.objects
            .get(naming::rule_object(prefix))
            .into_iter()
            .flat_map(move |o| o.range::<str, _>((Bound::Included(prefix), Bound::Unbounded)))
            .take_while(move |(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k, *v))
    }

    /// Sets `key`'s id; copies the key's object map if it is shared.
    pub fn insert(&mut self, key: Arc<str>, id: u32) -> Option<u32> {
        let prefix = naming::rule_object(&key);
        let object = match self.objects.get_mut(prefix) {
            Some(o) => o,
            None => self.objects.entry(Arc::from(prefix)).or_default(),
        };
        Arc::make_mut(object).insert(key, id)
    }

    /// Removes `key`; copies the key's object map if it is shared, drops
    /// the map when it empties.
    pub fn remove(&mut self, key: &str) -> Option<u32> {
        let prefix = naming::rule_object(key);
        let object = self.objects.get_mut(prefix)?;
        if !object.contains_key(key) {
            return None;
        }
        let map = Arc::make_mut(object);
        let old = map.remove(key);
        if map.is_empty() {
            self.objects.remove(prefix);
        }
        old
    }

    /// Whether `other` shares `key`'s object map with this one (no copy was
    /// made since one was cloned from the other).
    #[cfg(test)]
    pub fn shares_object_with(&self, other: &RuleIds, key: &str) -> bool {
        let prefix = naming::rule_object(key);
        match (self.objects.get(prefix), other.objects.get(prefix)) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Index<&str> for RuleIds {
    type Output = u32;

    fn index(&self, key: &str) -> &u32 {
        self.objects
            .get(naming::rule_object(key))
            .and_then(|o| o.get(key))
            .unwrap_or_else(|| panic!("no rule id for {key:?}"))
    }
}

impl FromIterator<(Arc<str>, u32)> for RuleIds {
    fn from_iter<I: IntoIterator<Item = (Arc<str>, u32)>>(iter: I) -> Self {
        let mut ids = RuleIds::default();
        for (k, v) in iter {
            ids.insert(k, v);
        }
        ids
    }
}

/// One flat map, `{key: id}`, as the allocation file and the status have it.
impl Serialize for RuleIds {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.len()))?;
        for (k, v) in self.iter() {
            m.serialize_entry(&**k, &v)?;
        }
        m.end()
    }
}

/// Read flat, then each object's keys (one run of the sorted map) built
/// into its map at once: compact nodes, where inserting the keys one by
/// one left the maps ~1.5 MB larger at 100 000 rules.
impl<'de> Deserialize<'de> for RuleIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut flat = BTreeMap::<Arc<str>, u32>::deserialize(d)?.into_iter().peekable();
        let mut ids = RuleIds::default();
        while let Some((key, id)) = flat.next() {
            let object: Arc<str> = Arc::from(naming::rule_object(&key));
            let mut run = vec![(key, id)];
            while let Some((k, _)) = flat.peek()
                && naming::rule_object(k) == &*object
            {
                run.extend(flat.next());
            }
            match ids.objects.entry(object) {
                // Not one run (sorted keys make one; kept correct anyway).
                std::collections::btree_map::Entry::Occupied(mut o) => Arc::make_mut(o.get_mut()).extend(run),
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(Arc::new(run.into_iter().collect()));
                }
            }
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(keys: &[&str]) -> RuleIds {
        keys.iter().enumerate().map(|(i, k)| (Arc::from(*k), i as u32 + 1)).collect()
    }

    #[test]
    fn keys_iterate_in_order_across_objects_whose_names_sort_apart() {
        // `lb/a-b/` sorts before `lb/a/` while `lb/a-b` sorts after `lb/a`.
        let keys = ["lb/a/listener/x", "lb/a-b/listener/y", "lb/a/backend/z", "natgw/g/fip/1", "lb/a-b/backend/w"];
        let ids = ids(&keys);
        let mut sorted = keys.to_vec();
        sorted.sort();
        assert_eq!(ids.iter().map(|(k, _)| &**k).collect::<Vec<_>>(), sorted);
        assert_eq!(ids.len(), 5);
        assert_eq!(ids.get("lb/a-b/listener/y"), Some(2));
        assert_eq!(ids["natgw/g/fip/1"], 4);
        assert_eq!(ids.under("lb/a/").map(|(_, v)| v).collect::<Vec<_>>(), [3, 1]);
        assert_eq!(ids.under("lb/a/listener/").count(), 1);
        let json = serde_json::to_string(&ids).unwrap();
        assert!(json.starts_with(r#"{"lb/a-b/backend/w":5,"#), "{json}");
        assert_eq!(serde_json::from_str::<RuleIds>(&json).unwrap(), ids);
    }

    #[test]
    fn a_change_copies_only_its_objects_map() {
        let mut a = ids(&["natgw/g/fip/1", "natgw/h/fip/1"]);
        let status = a.clone();
        a.insert("natgw/g/fip/2".into(), 3);
        assert!(!a.shares_object_with(&status, "natgw/g/"));
        assert!(a.shares_object_with(&status, "natgw/h/"));
        assert_eq!((status.len(), a.len()), (2, 3));
        assert_eq!(a.remove("natgw/h/fip/1"), Some(2));
        assert_eq!(a.remove("natgw/h/fip/1"), None);
        assert_eq!(status.get("natgw/h/fip/1"), Some(2), "the holder of the copy still sees it");
        assert_eq!(a.len(), 2);
    }
}
