//! Reconciliation in the style of a Kubernetes controller: desired state in,
//! diff against what was applied, idempotent steps, every step safe to repeat.
//! `plan` is pure; `Reconciler` executes a plan through a `Realizer` (the part
//! that touches the host) and persists progress after every step.

pub mod applied;
pub mod host;
pub mod plan;
pub mod reconciler;

pub use plan::{Applied, Desired, Kind, Reason, Spec, Step, plan, spec};
pub use reconciler::{ApplyReport, Finish, Realizer, Reconciler, RepairPass};
