//! lbagent: userspace side of the eBPF dataplane.
//!
//! - [`dataplane`]: the eBPF object, bpffs pins, loading, attaching, and typed
//!   access to the pinned maps (the kernel-facing layer, kept thin);
//! - [`netns`]: running kernel-facing work inside a network namespace;
//! - [`cli`]: the `lbagent` commands.

pub mod cli;
pub mod dataplane;
pub mod netns;
pub mod state;
