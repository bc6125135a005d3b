//! lbagent: userspace side of the eBPF dataplane.
//!
//! - [`dataplane`]: the eBPF object, bpffs pins, loading, attaching, and typed
//!   access to the pinned maps (the kernel-facing layer, kept thin);
//! - [`netns`]: running kernel-facing work inside a network namespace;
//! - [`cli`]: the `lbagent` commands.

pub mod alloc;
pub mod cli;
pub mod crash;
pub mod daemon;
pub mod dataplane;
pub mod files;
pub mod fleet;
pub mod lb;
pub mod naming;
pub mod natgw;
pub mod netns;
pub mod plumbing;
pub mod proto;
pub mod reconcile;
pub mod state;
pub mod tools;
pub mod zone;
