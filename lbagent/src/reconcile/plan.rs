//! The plan: which objects to remove, create, update or re-ensure.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::state::{
    StateFile,
    model::{AgentConfig, LoadBalancer, NatGateway, QosPolicy},
};

/// What the state file asks for (disabled load balancers are absent: they
/// are torn down like removed ones).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Desired {
    pub agent: AgentConfig,
    pub lbs: BTreeMap<String, LoadBalancer>,
    pub gws: BTreeMap<String, NatGateway>,
    /// The QoS policies each gateway uses (its own and its EIPs'), by name:
    /// part of the gateway's spec, so a rate change re-applies it.
    pub gw_qos: BTreeMap<String, Vec<QosPolicy>>,
}

impl Desired {
    pub fn from_state(s: &StateFile) -> Self {
        let gw_qos = s
            .nat_gateways
            .iter()
            .map(|g| {
                let used: std::collections::BTreeSet<&str> = g
                    .qos_policy
                    .iter()
                    .chain(g.eips.iter().filter_map(|e| e.qos_policy.as_ref()))
                    .map(String::as_str)
                    .collect();
                let mut ps: Vec<QosPolicy> =
                    s.qos_policies.iter().filter(|p| used.contains(p.name.as_str())).cloned().collect();
                ps.sort_by(|a, b| a.name.cmp(&b.name));
                (g.name.clone(), ps)
            })
            .collect();
        Desired {
            agent: s.agent.clone(),
            lbs: s.load_balancers.iter().filter(|l| l.enabled).map(|l| (l.id.clone(), l.clone())).collect(),
            gws: s.nat_gateways.iter().map(|g| (g.name.clone(), g.clone())).collect(),
            gw_qos,
        }
    }

    /// The QoS policies gateway `name` uses.
    pub fn qos_of(&self, name: &str) -> &[QosPolicy] {
        self.gw_qos.get(name).map(Vec::as_slice).unwrap_or_default()
    }
}

/// The last spec successfully applied per object (persisted in the state dir,
/// so objects deleted from the file while the agent was down are still found).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    #[serde(default)]
    pub lbs: BTreeMap<String, LoadBalancer>,
    #[serde(default)]
    pub gws: BTreeMap<String, NatGateway>,
    /// Objects whose ensure started but has not succeeded (a failed step or a
    /// crash mid-step may have left part of them on the host): removing them
    /// from the state file must still tear that part down.
    #[serde(default)]
    pub partial_lbs: BTreeMap<String, LoadBalancer>,
    #[serde(default)]
    pub partial_gws: BTreeMap<String, NatGateway>,
    /// The QoS policies each applied gateway was applied with.
    #[serde(default)]
    pub gw_qos: BTreeMap<String, Vec<QosPolicy>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
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
    Lb(&'a LoadBalancer),
    /// A gateway with the QoS policies it uses.
    Gw(&'a NatGateway, &'a [QosPolicy]),
}

impl Desired {
    /// The spec of object `key` of `kind` (planned ensures name desired objects).
    pub fn spec(&self, kind: Kind, key: &str) -> Option<Spec<'_>> {
        match kind {
            Kind::Lb => self.lbs.get(key).map(Spec::Lb),
            Kind::Gw => self.gws.get(key).map(|g| Spec::Gw(g, self.qos_of(key))),
        }
    }
}

/// The bookkeeping of an object's life, the same for every kind: an ensure
/// is recorded as partial before it touches the host (a failure or a crash
/// halfway leaves a trace that removal can follow), as applied once it
/// succeeded; a removal forgets both.
impl Applied {
    pub fn begin(&mut self, key: &str, spec: Spec) {
        match spec {
            Spec::Lb(l) => {
                self.partial_lbs.insert(key.into(), l.clone());
            }
            Spec::Gw(g, _) => {
                self.partial_gws.insert(key.into(), g.clone());
            }
        }
    }

    pub fn commit(&mut self, key: &str, spec: Spec) {
        match spec {
            Spec::Lb(l) => {
                self.partial_lbs.remove(key);
                self.lbs.insert(key.into(), l.clone());
            }
            Spec::Gw(g, qos) => {
                self.partial_gws.remove(key);
                self.gws.insert(key.into(), g.clone());
                self.gw_qos.insert(key.into(), qos.to_vec());
            }
        }
    }

    pub fn forget(&mut self, kind: Kind, key: &str) {
        match kind {
            Kind::Lb => {
                self.lbs.remove(key);
                self.partial_lbs.remove(key);
            }
            Kind::Gw => {
                self.gws.remove(key);
                self.partial_gws.remove(key);
                self.gw_qos.remove(key);
            }
        }
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

/// Removals first (they free addresses and ports), then ensures in key order.
/// With `repair`, unchanged objects are re-ensured too.
pub fn plan(desired: &Desired, applied: &Applied, repair: bool) -> Vec<Step> {
    let mut steps = Vec::new();
    // A gateway's spec is its entry and the QoS policies it uses.
    let with_qos = |gws: &BTreeMap<String, NatGateway>, qos: &BTreeMap<String, Vec<QosPolicy>>| {
        gws.iter().map(|(k, g)| (k.clone(), (g.clone(), qos.get(k).cloned().unwrap_or_default()))).collect()
    };
    let want: BTreeMap<_, _> = with_qos(&desired.gws, &desired.gw_qos);
    let have: BTreeMap<_, _> = with_qos(&applied.gws, &applied.gw_qos);
    let partial: BTreeMap<_, _> = with_qos(&applied.partial_gws, &BTreeMap::new());
    diff(Kind::Gw, &want, &have, &partial, repair, &mut steps);
    diff(Kind::Lb, &desired.lbs, &applied.lbs, &applied.partial_lbs, repair, &mut steps);
    steps.sort_by_key(|s| !matches!(s, Step::Remove { .. }));
    steps
}

fn diff<T: PartialEq>(
    kind: Kind,
    want: &BTreeMap<String, T>,
    have: &BTreeMap<String, T>,
    partial: &BTreeMap<String, T>,
    repair: bool,
    out: &mut Vec<Step>,
) {
    let gone: std::collections::BTreeSet<&String> =
        have.keys().chain(partial.keys()).filter(|k| !want.contains_key(*k)).collect();
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
    use crate::state::{Format, load_str};

    fn example() -> StateFile {
        load_str(include_str!("../../../examples/state.yaml"), Format::Yaml).unwrap()
    }

    fn applied_from(d: &Desired) -> Applied {
        Applied { lbs: d.lbs.clone(), gws: d.gws.clone(), gw_qos: d.gw_qos.clone(), ..Default::default() }
    }

    #[test]
    fn partially_created_objects_are_removed_too() {
        let s = example();
        let d = Desired::from_state(&s);
        let applied = Applied { partial_lbs: d.lbs.clone(), ..Default::default() };
        let p = plan(&Desired::default(), &applied, false);
        assert_eq!(p, vec![Step::Remove { kind: Kind::Lb, key: s.load_balancers[0].id.clone() }]);
        // Still wanted: retried as a create.
        let p = plan(&d, &applied, false);
        assert!(p.iter().any(|x| matches!(x, Step::Ensure { kind: Kind::Lb, reason: Reason::Create, .. })));
    }

    #[test]
    fn first_apply_creates_everything() {
        let d = Desired::from_state(&example());
        let p = plan(&d, &Applied::default(), false);
        assert_eq!(p.len(), 2);
        assert!(p.iter().all(|s| matches!(s, Step::Ensure { reason: Reason::Create, .. })));
    }

    #[test]
    fn nothing_to_do_when_applied_matches_unless_repairing() {
        let d = Desired::from_state(&example());
        assert!(plan(&d, &applied_from(&d), false).is_empty());
        let repair = plan(&d, &applied_from(&d), true);
        assert_eq!(repair.len(), 2);
        assert!(repair.iter().all(|s| matches!(s, Step::Ensure { reason: Reason::Repair, .. })));
    }

    #[test]
    fn changed_removed_and_disabled_objects() {
        let s = example();
        let applied = applied_from(&Desired::from_state(&s));
        let mut changed = s.clone();
        changed.load_balancers[0].backend_groups[0].backends.pop();
        changed.nat_gateways.clear();
        let p = plan(&Desired::from_state(&changed), &applied, false);
        assert_eq!(p[0], Step::Remove { kind: Kind::Gw, key: "gw1".into() }, "removals first");
        assert!(matches!(&p[1], Step::Ensure { kind: Kind::Lb, reason: Reason::Update, .. }));
        let mut disabled = s.clone();
        disabled.load_balancers[0].enabled = false;
        let p = plan(&Desired::from_state(&disabled), &applied, false);
        assert_eq!(p, vec![Step::Remove { kind: Kind::Lb, key: s.load_balancers[0].id.clone() }]);
    }
}
