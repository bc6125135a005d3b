//! The one atomic operation Linux 5.10 gives a program on shared map
//! values: an add whose result is not used (`lock *(u64 *)(p) += v`).
//! Fetching adds, exchanges and compare-and-swap came in 5.12.

/// Adds `v` (wrapping; a negative delta as its two's complement) to `*p`.
///
/// # Safety
/// `p` points into a map value that stays valid for the program run and is
/// 8-byte aligned.
#[inline(always)]
pub unsafe fn add(p: *mut u64, v: u64) {
    // SAFETY: the caller's guarantees; the unused result makes this a plain
    // `lock +=`.
    unsafe { core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, v) };
}
