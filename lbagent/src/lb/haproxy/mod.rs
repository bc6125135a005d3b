//! haproxy for proxy-mode listeners (the reference path): one haproxy in the
//! host namespace, master-worker mode, frontends on each load balancer's
//! outer address, servers at `inner:mapped_port`.
//!
//! - `config`: the configuration, one section per load balancer, every
//!   string in it validated (state/validate.rs) or generated.
//! - `process`: checking, starting, reloading and stopping haproxy; a load
//!   balancer whose section haproxy refuses keeps its previous section and
//!   never blocks the others.

pub mod config;
pub mod process;

pub use config::{Rendered, render};
pub use process::{Haproxy, Outcome};
