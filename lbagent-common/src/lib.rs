//! Types shared by the eBPF programs and the agent: every pinned map's key and
//! value, plus the constants both sides must agree on.
//!
//! Rules for every type here (they are pinned and dumped by `bpftool`):
//! - `#[repr(C)]`, explicit padding fields (scalars, never `[u8; N]`, which the
//!   compiler may zero with a `memset` call the BPF target cannot link);
//! - addresses as `[u8; 4]` in network order (dumps read as dotted quads);
//! - ports, ids and counters in host order (dumps read as plain numbers).
//!
//! Changing any layout or meaning requires bumping [`LAYOUT_VERSION`]: the pin
//! directory is versioned by it, so an old pin is never silently reused.
#![no_std]

/// Marks map key/value types as plain data for the agent (bytemuck, aya).
/// Only for `#[repr(C)]` types without implicit padding (each module
/// proves that with size assertions) whose every bit pattern is valid.
#[cfg(feature = "user")]
macro_rules! pod {
    ($($t:ty),* $(,)?) => {$(
        // SAFETY: repr(C), no implicit padding, every bit pattern valid (see above).
        unsafe impl bytemuck::Zeroable for $t {}
        // SAFETY: as above.
        unsafe impl bytemuck::Pod for $t {}
        // SAFETY: as above.
        unsafe impl aya::Pod for $t {}
    )*};
}

pub mod flow_log;
pub mod maps;
#[cfg(feature = "user")]
pub mod pinned;
pub mod qos;
pub mod sched;

pub use flow_log::*;
pub use maps::*;
#[cfg(feature = "user")]
pub use pinned::*;
pub use qos::*;
pub use sched::*;

/// Version of the pinned map layout; pins live under `<bpffs>/v<LAYOUT_VERSION>/`.
pub const LAYOUT_VERSION: u32 = 5;

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
/// Address-only protocols whose checksum covers a pseudo header with the
/// addresses (as UDP's): a translated address must update it.
pub const PROTO_DCCP: u8 = 33;
pub const PROTO_UDPLITE: u8 = 136;

pub mod csum;
