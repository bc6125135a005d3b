//! Executes plans. Every step is idempotent. An ensure of a new or changed
//! object records it as begun and makes its allocations, and both are
//! persisted before the host changes (a repaired object is applied already:
//! only new allocations are); after each step both are persisted again. A
//! crash at any point therefore leaves nothing on the host that the next
//! run cannot find: an object removed while the agent was down is cleaned
//! up with the ids and addresses it had.

use std::{collections::BTreeSet, path::Path, time::SystemTime};

use anyhow::Result;
use serde::Serialize;
use tracing::{error, info};

use super::plan::{Applied, Desired, Kind, Reason, Spec, Step, plan, spec};
use crate::outcome::{Changes, ErrorKind, ObjectError, WithKind};
use crate::{
    alloc::{Allocations, store::JsonFile},
    state::spec::{AgentConfig, Gw, Lb},
};

/// The part that makes the host match a spec. Each method must be safe to
/// repeat and returns human-readable lines for what it changed.
/// What `Realizer::finish` did: changes, and errors of single objects (a
/// load balancer whose proxy listeners haproxy refused) that did not stop
/// the others.
#[derive(Debug, Default)]
pub struct Finish {
    pub changes: Changes,
    /// Objects named as in the report (`lb/<id>`).
    pub errors: Vec<ObjectError>,
}

pub trait Realizer {
    /// Agent-wide settings of the state file, before each apply.
    fn configure(&mut self, _agent: &AgentConfig) {}
    /// Before an apply, or the first slice of a repair pass: what the
    /// realizer cached of the host is read again (a resumed slice keeps it).
    fn begin_pass(&mut self) {}
    /// After every apply: host-wide pieces derived from all applied objects
    /// (the proxy configuration).
    fn finish(&mut self, _applied: &Applied, _alloc: &Allocations) -> Result<Finish> {
        Ok(Finish::default())
    }
    /// Makes every allocation the object needs and nothing else (no host
    /// change): the reconciler persists them before `ensure_*` runs, which
    /// only looks them up (and releases what the object stopped using).
    fn allocate(&mut self, spec: Spec, alloc: &mut Allocations) -> Result<Changes>;
    fn ensure_lb(&mut self, lb: &Lb, alloc: &mut Allocations) -> Result<Changes>;
    fn remove_lb(&mut self, id: &str, alloc: &mut Allocations) -> Result<Changes>;
    /// `prev`: the spec applied before (for deciding which flows to flush).
    fn ensure_gw(&mut self, gw: &Gw, prev: Option<&Gw>, alloc: &mut Allocations) -> Result<Changes>;
    fn remove_gw(&mut self, name: &str, alloc: &mut Allocations) -> Result<Changes>;
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ApplyReport {
    pub started: Option<SystemTime>,
    pub steps: usize,
    pub changes: Changes,
    /// Each failed step's object, kind and error.
    pub errors: Vec<ObjectError>,
    /// The objects whose step succeeded (named as in `errors`).
    pub succeeded: Vec<String>,
    /// A repair slice that yielded: the objects its pass has still to
    /// re-ensure (0: the pass is complete, or this was no repair).
    pub deferred: usize,
}

/// A repair pass that runs in slices (`Reconciler::repair`): the objects
/// it has re-ensured so far, which a resumed slice skips.
#[derive(Debug, Default)]
pub struct RepairPass {
    done: BTreeSet<(Kind, String)>,
}

impl RepairPass {
    /// Objects handled by this pass so far (re-ensured, changed, removed).
    pub fn done(&self) -> usize {
        self.done.len()
    }
}

impl ApplyReport {
    pub fn ok(&self) -> bool {
        self.errors.is_empty()
    }
}

pub struct Reconciler<R> {
    pub realizer: R,
    pub alloc: Allocations,
    pub applied: Applied,
    alloc_file: JsonFile,
    applied_file: JsonFile,
    /// What the files hold as this reconciler last wrote them.
    saved: Saved,
}

/// The generations of the allocations and of the applied record as last
/// written to their files (`None`: not written yet, or to be checked).
#[derive(Default)]
struct Saved {
    alloc: Option<u64>,
    applied: Option<u64>,
}

pub const ALLOC_FILE: &str = "allocations.json";
pub const APPLIED_FILE: &str = "applied.json";

impl<R: Realizer> Reconciler<R> {
    /// Opens the persisted allocations and applied specs in `state_dir`.
    pub fn open(realizer: R, state_dir: &Path) -> Result<Self> {
        let alloc_file = JsonFile::new(state_dir, ALLOC_FILE);
        let applied_file = JsonFile::new(state_dir, APPLIED_FILE);
        let applied = Applied::load(&applied_file)?;
        Ok(Reconciler {
            realizer,
            alloc: alloc_file.load()?,
            applied,
            alloc_file,
            applied_file,
            saved: Saved::default(),
        })
    }

    /// Brings the host to `desired`. Failed steps are reported and retried
    /// by the next pass; other steps still run. With `repair`, unchanged
    /// objects are re-ensured too, all in this call.
    pub fn apply(&mut self, desired: &Desired, repair: bool) -> ApplyReport {
        if repair {
            self.repair(desired, &mut RepairPass::default(), &|| false)
        } else {
            let steps = plan(desired, &self.applied, false);
            self.execute(desired, steps, None)
        }
    }

    /// One slice of a repair pass: the objects the pass has not handled
    /// yet, changed ones (a failed change is retried) first, then the
    /// unchanged ones, in key order; each object once per pass, whatever
    /// its outcome. After the slice's first step, `yield_now` is asked
    /// before each; when it answers `true` the slice stops there and
    /// `report.deferred` counts the objects left, which the next call with
    /// the same `pass` resumes with. A pass over hundreds of objects thus
    /// never holds back a change or a signal for longer than one object's
    /// ensure. The host-wide finish (the proxy) runs in a slice that
    /// changed something and in the pass's last slice.
    pub fn repair(&mut self, desired: &Desired, pass: &mut RepairPass, yield_now: &dyn Fn() -> bool) -> ApplyReport {
        let mut steps = plan(desired, &self.applied, true);
        steps.retain(|s| !pass.done.contains(&step_key(s)));
        if pass.done.is_empty() {
            // Each pass checks the state files once (deleted or replaced
            // under the running agent: written again).
            self.saved = Saved::default();
        }
        self.execute(desired, steps, Some((pass, yield_now)))
    }

    /// Re-ensures the objects of `kind` named in `keys` (those still
    /// wanted), as a repair pass would: what they hold depends on more than
    /// their spec (a load balancer's tables on its backends' health).
    pub fn reensure(&mut self, desired: &Desired, kind: Kind, keys: &BTreeSet<String>) -> ApplyReport {
        let mut steps = plan(desired, &self.applied, true);
        steps.retain(|s| matches!(s, Step::Ensure { kind: k, key, .. } if *k == kind && keys.contains(key)));
        self.execute(desired, steps, None)
    }

    fn execute(
        &mut self,
        desired: &Desired,
        steps: Vec<Step>,
        mut pass: Option<(&mut RepairPass, &dyn Fn() -> bool)>,
    ) -> ApplyReport {
        self.realizer.configure(&desired.agent);
        if pass.as_ref().is_none_or(|(p, _)| p.done.is_empty()) {
            self.realizer.begin_pass();
        }
        let mut report = ApplyReport { started: Some(SystemTime::now()), steps: steps.len(), ..Default::default() };
        let total = steps.len();
        for (i, step) in steps.into_iter().enumerate() {
            if let Some((p, yield_now)) = &mut pass {
                if i > 0 && yield_now() {
                    report.deferred = total - i;
                    report.steps = i;
                    break;
                }
                if matches!(step, Step::Ensure { reason: Reason::Repair, .. }) {
                    crate::crash::pause("repair-step");
                }
                p.done.insert(step_key(&step));
            }
            let name = describe(&step);
            match self.run(&step, desired) {
                Ok(changes) => {
                    for c in &changes {
                        info!(object = %name, "{c}");
                    }
                    report.changes.append_of(&name, changes);
                    report.succeeded.push(name);
                }
                Err(e) => {
                    error!(object = %name, "step failed: {e:#}");
                    report.errors.push(ObjectError::new(name, &e));
                }
            }
            if let Err(e) = self.persist() {
                error!("persisting state: {e:#}");
                report.errors.push(ObjectError::new("state-dir", &e.context(ErrorKind::StateDir)));
            }
        }
        // The proxy is checked once per pass, and after any change: not in
        // every slice (`haproxy -c` of a large configuration is not free).
        if pass.is_some() && report.deferred > 0 && report.changes.is_empty() {
            return report;
        }
        match self.realizer.finish(&self.applied, &self.alloc) {
            Ok(f) => {
                for c in &f.changes {
                    info!(object = "proxy", "{c}");
                }
                report.changes.append_of("proxy", f.changes);
                report.succeeded.push("proxy".into());
                for e in f.errors {
                    error!(object = %e.object, "{}", e.error);
                    report.errors.push(e);
                }
            }
            Err(e) => {
                error!(object = "proxy", "{e:#}");
                report.errors.push(ObjectError::new("proxy", &e.context(ErrorKind::Proxy)));
            }
        }
        report
    }

    /// The one dispatcher: every kind goes through the same bookkeeping;
    /// only the realizer's call differs.
    fn run(&mut self, step: &Step, desired: &Desired) -> Result<Changes> {
        match step {
            Step::Ensure { kind, key, reason } => {
                let spec = spec(desired, *kind, key).expect("planned ensures come from desired");
                let prev = self.applied.gws.get(key).cloned();
                // A repaired object is applied with this very spec: a crash
                // mid-step leaves it known (removing it later tears it
                // down), so it is not marked begun, and an unchanged
                // object's repair writes nothing to the state dir.
                if *reason != Reason::Repair {
                    self.applied.begin(key, spec);
                }
                let allocated = self.realizer.allocate(spec, &mut self.alloc);
                self.persist().kind(ErrorKind::StateDir)?;
                let mut changes = allocated.kind(ErrorKind::Allocation)?;
                changes.extend(match spec {
                    Spec::Lb(lb) => self.realizer.ensure_lb(lb, &mut self.alloc)?,
                    Spec::Gw(gw) => self.realizer.ensure_gw(gw, prev.as_deref(), &mut self.alloc)?,
                });
                if *reason != Reason::Repair {
                    changes.prepend(format!("{} {}", verb(*reason), kind.noun()));
                }
                self.applied.commit(key, spec);
                Ok(changes)
            }
            Step::Remove { kind, key } => {
                let mut changes = match kind {
                    Kind::Lb => self.realizer.remove_lb(key, &mut self.alloc)?,
                    Kind::Gw => self.realizer.remove_gw(key, &mut self.alloc)?,
                };
                changes.prepend(format!("removed {}", kind.noun()));
                self.applied.forget(*kind, key);
                Ok(changes)
            }
        }
    }

    /// Writes the allocations, then the applied specs, each when it
    /// changed since it was last written (known by its generation:
    /// serializing hundreds of objects after every step of a repair pass
    /// was most of its cost, and the applied record is ~23 MB of JSON at
    /// 100 000 rules).
    fn persist(&mut self) -> Result<()> {
        let g = self.alloc.generation.0;
        if self.saved.alloc != Some(g) {
            self.saved.alloc = None;
            self.alloc_file.save(&self.alloc)?;
            self.saved.alloc = Some(g);
        }
        let g = self.applied.generation.0;
        if self.saved.applied != Some(g) {
            self.saved.applied = None;
            self.applied_file.save(&self.applied)?;
            self.saved.applied = Some(g);
        }
        Ok(())
    }

    /// Tears down everything ever applied and forgets it.
    pub fn teardown(&mut self) -> ApplyReport {
        let report = self.apply(&Desired::default(), false);
        if report.ok() {
            self.saved = Saved::default();
            let _ = self.alloc_file.remove();
            let _ = self.applied_file.remove();
        }
        report
    }
}

fn verb(r: Reason) -> &'static str {
    match r {
        Reason::Create => "created",
        Reason::Update => "updated",
        Reason::Repair => "repaired",
    }
}

/// The object a step is about.
fn step_key(step: &Step) -> (Kind, String) {
    match step {
        Step::Remove { kind, key } | Step::Ensure { kind, key, .. } => (*kind, key.clone()),
    }
}

fn describe(step: &Step) -> String {
    let (kind, key) = match step {
        Step::Remove { kind, key } | Step::Ensure { kind, key, .. } => (kind, key),
    };
    match kind {
        Kind::Lb => crate::naming::lb_zone_key(key),
        Kind::Gw => crate::naming::gw_zone_key(key),
    }
}
