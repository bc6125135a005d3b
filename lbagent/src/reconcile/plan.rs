//! The plan: which objects to remove, create, update or re-ensure.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use serde::Serialize;

pub use super::applied::Applied;
pub use crate::state::spec::Desired;
use crate::state::spec::{Gw, Lb};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Lb,
    Gw,
}

impl Kind {
    /// How reports and logs call an object of this kind.
    pub fn noun(self) -> &'static str {
        match self {
            Kind::Lb => "load balancer",
            Kind::Gw => "NAT gateway",
        }
    }
}

/// One object's whole spec, whatever its kind (what an ensure step applies).
#[derive(Clone, Copy, Debug)]
pub enum Spec<'a> {
    Lb(&'a Arc<Lb>),
    /// A gateway, with the QoS policies it uses.
    Gw(&'a Arc<Gw>),
}

/// The spec of object `key` of `kind` (planned ensures name desired objects).
pub fn spec<'a>(desired: &'a Desired, kind: Kind, key: &str) -> Option<Spec<'a>> {
    match kind {
        Kind::Lb => desired.lbs.get(key).map(Spec::Lb),
        Kind::Gw => desired.gws.get(key).map(Spec::Gw),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    Create,
    Update,
    /// Unchanged spec, re-ensured by the periodic repair pass.
    Repair,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Step {
    Remove { kind: Kind, key: String },
    Ensure { kind: Kind, key: String, reason: Reason },
}

/// Removals first (they free addresses and ports), then creates and
/// updates, in key order. With `repair`, unchanged objects are re-ensured
/// too, after every change (a change never waits behind a repair).
pub fn plan(desired: &Desired, applied: &Applied, repair: bool) -> Vec<Step> {
    let mut steps = Vec::new();
    diff(Kind::Gw, &desired.gws, &applied.gws, &applied.partial_gws, repair, &mut steps);
    diff(Kind::Lb, &desired.lbs, &applied.lbs, &applied.partial_lbs, repair, &mut steps);
    steps.sort_by_key(|s| match s {
        Step::Remove { .. } => 0,
        Step::Ensure { reason: Reason::Create | Reason::Update, .. } => 1,
        Step::Ensure { reason: Reason::Repair, .. } => 2,
    });
    steps
}

fn diff<T: PartialEq>(
    kind: Kind,
    want: &BTreeMap<String, T>,
    have: &BTreeMap<String, T>,
    partial: &BTreeSet<String>,
    repair: bool,
    out: &mut Vec<Step>,
) {
    let gone: BTreeSet<&String> = have.keys().chain(partial.iter()).filter(|k| !want.contains_key(*k)).collect();
    for key in gone {
        out.push(Step::Remove { kind, key: key.clone() });
    }
    for (key, spec) in want {
        let reason = match have.get(key) {
            None => Reason::Create,
            Some(old) if old != spec => Reason::Update,
            Some(_) if repair => Reason::Repair,
            Some(_) => continue,
        };
        out.push(Step::Ensure { kind, key: key.clone(), reason });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Format, StateFile, load_str};

    fn example() -> StateFile {
        load_str(include_str!("../../../examples/state.yaml"), Format::Yaml).unwrap()
    }

    fn desired(s: &StateFile) -> Desired {
        Desired::from_state(s).unwrap()
    }

    fn applied_from(d: &Desired) -> Applied {
        Applied { lbs: d.lbs.clone(), gws: d.gws.clone(), ..Default::default() }
    }

    #[test]
    fn partially_created_objects_are_removed_too() {
        let s = example();
        let d = desired(&s);
        let applied = Applied { partial_lbs: d.lbs.keys().cloned().collect(), ..Default::default() };
        let p = plan(&Desired::default(), &applied, false);
        assert_eq!(p, vec![Step::Remove { kind: Kind::Lb, key: s.load_balancers[0].id.clone() }]);
        // Still wanted: retried as a create.
        let p = plan(&d, &applied, false);
        assert!(p.iter().any(|x| matches!(x, Step::Ensure { kind: Kind::Lb, reason: Reason::Create, .. })));
    }

    #[test]
    fn first_apply_creates_everything() {
        let d = desired(&example());
        let p = plan(&d, &Applied::default(), false);
        assert_eq!(p.len(), 2);
        assert!(p.iter().all(|s| matches!(s, Step::Ensure { reason: Reason::Create, .. })));
    }

    #[test]
    fn nothing_to_do_when_applied_matches_unless_repairing() {
        let d = desired(&example());
        assert!(plan(&d, &applied_from(&d), false).is_empty());
        let repair = plan(&d, &applied_from(&d), true);
        assert_eq!(repair.len(), 2);
        assert!(repair.iter().all(|s| matches!(s, Step::Ensure { reason: Reason::Repair, .. })));
    }

    #[test]
    fn changed_removed_and_disabled_objects() {
        let s = example();
        let applied = applied_from(&desired(&s));
        let mut changed = s.clone();
        changed.load_balancers[0].backend_groups[0].backends.pop();
        changed.nat_gateways.clear();
        let p = plan(&desired(&changed), &applied, false);
        assert_eq!(p[0], Step::Remove { kind: Kind::Gw, key: "gw1".into() }, "removals first");
        assert!(matches!(&p[1], Step::Ensure { kind: Kind::Lb, reason: Reason::Update, .. }));
        let mut disabled = s.clone();
        disabled.load_balancers[0].enabled = false;
        let p = plan(&desired(&disabled), &applied, false);
        assert_eq!(p, vec![Step::Remove { kind: Kind::Lb, key: s.load_balancers[0].id.clone() }]);
    }
}
