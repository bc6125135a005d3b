//! The kernel-facing layer: eBPF object, pins, load, attach, maps.
//!
//! One program instance is loaded per *zone* (network namespace) with the zone
//! as a constant; all instances share the pinned maps under
//! `<bpffs>/v<LAYOUT_VERSION>/`.

pub mod attach;
pub mod engine;
pub mod loader;
pub mod logs;
pub mod migrate;
pub mod pins;
pub mod qos;
pub mod sync;
pub mod tables;

/// The eBPF object, embedded at build time.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lbagent-ebpf.o"));

/// Name of the TC program in the object (clsact ingress).
pub const PROGRAM: &str = "lbagent_nat";
/// Name of its companion at clsact egress (ICMP errors the namespace generates).
pub const PROGRAM_EGRESS: &str = "lbagent_nat_egress";
/// The proxy guard, at clsact egress of a load balancer's host-side link.
pub const PROGRAM_PROXY_GUARD: &str = "lbagent_proxy_guard";

/// Default bpffs directory for lbagent's pins.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/lbagent";
