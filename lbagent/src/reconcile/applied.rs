//! The last spec successfully applied per object, persisted in the state
//! directory (`applied.json`), so objects deleted from the document while
//! the agent was down are still found and torn down.
//!
//! Format 2 stores typed specs (`state::spec`). A file without a `format`
//! field was written by an agent before typed specs (raw state-file objects
//! plus the QoS policies of each gateway): it is converted on load; an
//! object that no longer converts is kept as partial, so it is re-created
//! when still wanted and torn down when not.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize, de::IgnoredAny};

use super::plan::{Kind, Spec};
use crate::{
    alloc::{Generation, store::JsonFile},
    state::{
        model,
        spec::{Gw, Lb},
    },
};

/// The layout `save` writes.
pub const APPLIED_FORMAT: u32 = 2;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    pub format: u32,
    #[serde(default)]
    pub lbs: BTreeMap<String, Arc<Lb>>,
    #[serde(default)]
    pub gws: BTreeMap<String, Arc<Gw>>,
    /// Objects whose ensure started but has not succeeded (a failed step or a
    /// crash mid-step may have left part of them on the host): removing them
    /// from the document must still tear that part down.
    #[serde(default)]
    pub partial_lbs: BTreeSet<String>,
    #[serde(default)]
    pub partial_gws: BTreeSet<String>,
    /// Bumped by every change through `begin`, `commit` and `forget` (not
    /// by a commit of the spec already recorded), so that whether there is
    /// anything to write is known without keeping a copy to compare with.
    #[serde(skip)]
    pub generation: Generation,
}

impl Default for Applied {
    fn default() -> Self {
        Applied {
            format: APPLIED_FORMAT,
            lbs: BTreeMap::new(),
            gws: BTreeMap::new(),
            partial_lbs: BTreeSet::new(),
            partial_gws: BTreeSet::new(),
            generation: Generation::default(),
        }
    }
}

/// `applied.json` as agents before format 2 wrote it.
#[derive(Default, Deserialize)]
struct Legacy {
    #[serde(default)]
    lbs: BTreeMap<String, model::LoadBalancer>,
    #[serde(default)]
    gws: BTreeMap<String, model::NatGateway>,
    #[serde(default)]
    partial_lbs: BTreeMap<String, IgnoredAny>,
    #[serde(default)]
    partial_gws: BTreeMap<String, IgnoredAny>,
    #[serde(default)]
    gw_qos: BTreeMap<String, Vec<model::QosPolicy>>,
}

impl Applied {
    /// Reads the file (empty when absent), converting the legacy layout.
    pub fn load(file: &JsonFile) -> Result<Applied> {
        /// The format alone (the rest skipped): the file is read once for
        /// it, then once into its own layout, never into a generic value
        /// (at 100 000 rules that was ~10 times the file's 23 MB).
        #[derive(Default, Deserialize)]
        struct Format {
            format: Option<u64>,
        }
        // Absent: nothing applied yet. Any other error (a record that
        // cannot be read) stops the agent rather than forget what runs.
        if !file.path().try_exists().with_context(|| format!("reading {}", file.path().display()))? {
            return Ok(Applied::default());
        }
        match file.load::<Format>()?.format {
            Some(f) if f == APPLIED_FORMAT as u64 => file.load(),
            Some(f) => bail!("{}: format {f} is not one this agent reads ({APPLIED_FORMAT})", file.path().display()),
            None => Ok(Self::from_legacy(file.load::<Legacy>()?)),
        }
    }

    fn from_legacy(old: Legacy) -> Applied {
        let mut a = Applied::default();
        a.partial_lbs.extend(old.partial_lbs.into_keys());
        a.partial_gws.extend(old.partial_gws.into_keys());
        // Each legacy object is converted as a document of its own (with
        // the policies its gateway used), through the one converter: an
        // object that converts is kept whatever rule added since it was
        // applied it breaks (the running document is checked by those).
        let convert = |load_balancers: Vec<model::LoadBalancer>, nat_gateways, qos_policies| {
            let doc = model::StateFile { version: 1, load_balancers, nat_gateways, qos_policies, ..Default::default() };
            let (converted, problems) = crate::state::validate::check(&doc);
            let why: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
            (converted, why.join("; "))
        };
        for (key, l) in old.lbs {
            let (mut converted, why) = convert(vec![l], vec![], vec![]);
            if let Some(spec) = converted.lbs.remove(&key) {
                a.lbs.insert(key, spec);
            } else {
                tracing::warn!("applied load balancer {key}: {why}: kept as partial (re-created if still wanted)");
                a.partial_lbs.insert(key);
            }
        }
        for (key, g) in old.gws {
            let policies = old.gw_qos.get(&key).cloned().unwrap_or_default();
            let (mut converted, why) = convert(vec![], vec![g], policies);
            if let Some(spec) = converted.gws.remove(&key) {
                a.gws.insert(key, spec);
            } else {
                tracing::warn!("applied NAT gateway {key}: {why}: kept as partial (re-created if still wanted)");
                a.partial_gws.insert(key);
            }
        }
        a
    }
}

/// The bookkeeping of an object's life, the same for every kind: an ensure
/// is recorded as partial before it touches the host (a failure or a crash
/// halfway leaves a trace that removal can follow), as applied once it
/// succeeded; a removal forgets both.
impl Applied {
    pub fn begin(&mut self, key: &str, spec: Spec) {
        let added = match spec {
            Spec::Lb(_) => self.partial_lbs.insert(key.into()),
            Spec::Gw(_) => self.partial_gws.insert(key.into()),
        };
        self.changed(added);
    }

    pub fn commit(&mut self, key: &str, spec: Spec) {
        let changed = match spec {
            Spec::Lb(l) => {
                let was_partial = self.partial_lbs.remove(key);
                was_partial | share(&mut self.lbs, key, l)
            }
            Spec::Gw(g) => {
                let was_partial = self.partial_gws.remove(key);
                was_partial | share(&mut self.gws, key, g)
            }
        };
        self.changed(changed);
    }

    pub fn forget(&mut self, kind: Kind, key: &str) {
        let removed = match kind {
            Kind::Lb => self.lbs.remove(key).is_some() | self.partial_lbs.remove(key),
            Kind::Gw => self.gws.remove(key).is_some() | self.partial_gws.remove(key),
        };
        self.changed(removed);
    }

    fn changed(&mut self, changed: bool) {
        if changed {
            self.generation.bump();
        }
    }
}

/// Records `spec` as object `key`'s, sharing the desired spec rather than
/// a copy; whether the recorded content changed. A recorded spec equal to
/// it (read from the file at start, or an earlier document's) is replaced
/// by the shared one too, without counting as a change.
fn share<T: PartialEq>(map: &mut BTreeMap<String, Arc<T>>, key: &str, spec: &Arc<T>) -> bool {
    match map.get_mut(key) {
        Some(have) if Arc::ptr_eq(have, spec) => false,
        Some(have) if **have == **spec => {
            *have = Arc::clone(spec);
            false
        }
        _ => {
            map.insert(key.into(), Arc::clone(spec));
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Format, load_str, spec::Desired};

    fn example() -> model::StateFile {
        load_str(include_str!("../../../examples/state.yaml"), Format::Yaml).unwrap()
    }

    /// What `persist` relies on to skip a write: every change counts, a
    /// step that changes nothing does not.
    #[test]
    fn the_generation_counts_changes_and_only_changes() {
        let want = Desired::from_state(&example()).unwrap();
        let (key, lb) = want.lbs.iter().next().unwrap();
        let mut a = Applied::default();
        let g = |a: &Applied| a.generation.0;
        a.begin(key, Spec::Lb(lb));
        assert_eq!(g(&a), 1, "partial");
        a.begin(key, Spec::Lb(lb));
        assert_eq!(g(&a), 1, "partial already");
        a.commit(key, Spec::Lb(lb));
        assert_eq!(g(&a), 2, "applied");
        a.begin(key, Spec::Lb(lb));
        a.commit(key, Spec::Lb(lb));
        assert_eq!(g(&a), 4, "a repair marks it partial, then applied again");
        a.commit(key, Spec::Lb(lb));
        assert_eq!(g(&a), 4, "the same spec again");
        let equal = Arc::new((**lb).clone());
        a.commit(key, Spec::Lb(&equal));
        assert_eq!(g(&a), 4, "an equal spec (shared from now on)");
        assert!(Arc::ptr_eq(&a.lbs[key], &equal), "the recorded spec is the desired one, not a copy");
        let mut other = (**lb).clone();
        other.listeners.pop();
        a.commit(key, Spec::Lb(&Arc::new(other)));
        assert_eq!(g(&a), 5, "another spec");
        a.forget(Kind::Lb, key);
        assert_eq!(g(&a), 6, "forgotten");
        a.forget(Kind::Lb, key);
        assert_eq!(g(&a), 6, "nothing left to forget");
        assert_eq!(a, Applied::default(), "the generation is not part of what was applied");
    }

    #[test]
    fn a_legacy_file_converts_to_the_same_specs_and_a_bad_object_becomes_partial() {
        let s = example();
        let want = Desired::from_state(&s).unwrap();
        let gw = &s.nat_gateways[0];
        let mut qos: Vec<model::QosPolicy> = s
            .qos_policies
            .iter()
            .filter(|p| {
                gw.qos_policy.as_ref() == Some(&p.name)
                    || gw.eips.iter().any(|e| e.qos_policy.as_ref() == Some(&p.name))
            })
            .cloned()
            .collect();
        qos.sort_by(|a, b| a.name.cmp(&b.name));
        let mut broken = s.load_balancers[0].clone();
        broken.id = "broken-lb-0000001".into();
        broken.network.ip = "not an address".into();
        // One that converts but breaks a rule added since (ids of at least
        // 13 characters): kept, not re-created.
        let mut ruled = s.load_balancers[0].clone();
        ruled.id = "short-id".into();
        let legacy = serde_json::json!({
            "lbs": { s.load_balancers[0].id.clone(): s.load_balancers[0], broken.id.clone(): broken, ruled.id.clone(): ruled },
            "gws": { gw.name.clone(): gw },
            "partial_lbs": {},
            "partial_gws": { "half-made": gw },
            "gw_qos": { gw.name.clone(): qos },
        });
        let dir = std::env::temp_dir().join(format!("lbagent-applied-{}", std::process::id()));
        let file = JsonFile::new(&dir, "applied.json");
        file.save(&legacy).unwrap();
        let mut a = Applied::load(&file).unwrap();
        let kept = a.lbs.remove("short-id").expect("a legacy object that converts is kept");
        assert_eq!(kept.listeners, want.lbs.values().next().unwrap().listeners);
        assert_eq!(a.lbs, want.lbs);
        assert_eq!(a.gws, want.gws, "QoS policies resolved from gw_qos");
        assert_eq!(a.partial_lbs, BTreeSet::from([broken.id.clone()]));
        assert_eq!(a.partial_gws, BTreeSet::from(["half-made".to_string()]));
        // Saved again in format 2, it reads back unchanged.
        file.save(&a).unwrap();
        assert_eq!(Applied::load(&file).unwrap(), a);
        file.save(&serde_json::json!({"format": 9})).unwrap();
        assert!(Applied::load(&file).unwrap_err().to_string().contains("format 9"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
