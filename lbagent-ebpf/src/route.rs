//! Where a new flow leaves the namespace, from the kernel's FIB
//! (`bpf_fib_lookup`, Linux 4.18): SNAT rules are keyed on the *egress*
//! interface, like iptables' `-o net1`, so traffic routed back into the VPC
//! is not SNAT'ed, and nothing addressed to the namespace itself is.

use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_NOT_FWDED, BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibParams,
    },
    helpers::bpf_fib_lookup,
    programs::TcContext,
};
use lbagent_common::Tuple;

const AF_INET: u8 = 2;
/// `struct bpf_fib_lookup` is 64 bytes: eight words.
const FIB_WORDS: usize = 8;

pub enum Route {
    /// Delivered to the namespace itself.
    Local,
    /// Forwarded out of this interface.
    Out(u32),
    /// No route (the kernel will drop it) or a lookup the FIB refused.
    Unknown,
}

impl Route {
    /// The interface SNAT rules are looked up with: the egress one, or the
    /// ingress one when the FIB cannot tell; `None` for local delivery.
    #[inline(always)]
    pub fn snat_ifindex(&self, ingress: u32) -> Option<u32> {
        match self {
            Route::Local => None,
            Route::Out(i) => Some(*i),
            Route::Unknown => Some(ingress),
        }
    }
}

/// The route of a packet with tuple `t` that arrived on `ingress`.
#[inline(always)]
pub fn route(ctx: &TcContext, t: &Tuple, ingress: u32) -> Route {
    let mut words = core::mem::MaybeUninit::<[u64; FIB_WORDS]>::uninit();
    let base = words.as_mut_ptr() as *mut u64;
    for i in 0..FIB_WORDS {
        // SAFETY: `i` < FIB_WORDS, inside `words`. Volatile word stores: a
        // plain zeroing would become a `memset` call the BPF target lacks.
        unsafe { core::ptr::write_volatile(base.add(i), 0) };
    }
    let params = base as *mut FibParams;
    // SAFETY: `params` points at 64 initialised bytes, the size and
    // alignment of `struct bpf_fib_lookup`; the helper reads and writes only
    // inside them.
    let rc = unsafe {
        (*params).family = AF_INET;
        (*params).l4_protocol = t.proto;
        (*params).ifindex = ingress;
        (*params).__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(t.saddr);
        (*params).__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(t.daddr);
        bpf_fib_lookup(ctx.as_ptr(), params, core::mem::size_of::<FibParams>() as i32, 0)
    };
    match rc as u32 {
        BPF_FIB_LKUP_RET_SUCCESS | BPF_FIB_LKUP_RET_NO_NEIGH => {
            // SAFETY: as above; the helper wrote the egress ifindex.
            Route::Out(unsafe { (*params).ifindex })
        }
        BPF_FIB_LKUP_RET_NOT_FWDED => Route::Local,
        _ => Route::Unknown,
    }
}
