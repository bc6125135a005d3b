//! lbagent: the userspace side of the eBPF dataplane. From the top layer
//! down (a module uses only those below it; docs/architecture.md has every
//! file and a table of where to change what):
//!
//! - [`cli`]: the `lbagent` commands; `run` starts the [`daemon`];
//! - [`fleet`]: desired state from etcd, status and liveness written back;
//! - [`daemon`]: the run loop over a desired-state source, the API, metrics;
//! - [`flow_log`]: the dataplane's flow records, named and exported (IPFIX,
//!   JSON Lines);
//! - [`reconcile`]: plan (pure diff of typed specs) and the one dispatcher
//!   that applies it through a realizer, persisting progress;
//! - [`lb`], [`natgw`]: the two products, each plumbing + rules + (LB) the
//!   proxy and health checks, on the skeleton they share, [`zone`];
//! - [`dataplane`]: the eBPF object, pins, loading, attaching, the engine
//!   and typed access to the pinned maps (the kernel-facing layer);
//! - [`state`]: the state file: model, validation, the typed specs;
//!   [`naming`]: every derived name and key;
//! - [`plumbing`] (rtnetlink, veths, OVS, sysctls, ARP), [`alloc`] (zones,
//!   addresses, ports, rule ids), [`proto`], [`netns`], [`files`],
//!   [`tools`], [`crash`]: the ground floor.

pub mod alloc;
pub mod cli;
pub mod crash;
pub mod daemon;
pub mod dataplane;
pub mod files;
pub mod fleet;
pub mod flow_log;
pub mod ha;
pub mod lb;
pub mod naming;
pub mod natgw;
pub mod netns;
pub mod outcome;
pub mod plumbing;
pub mod proto;
pub mod reconcile;
pub mod state;
pub mod tools;
pub mod zone;
