//! What the loader gives a TC program instance and what it answers the
//! kernel: the zone it serves and its verdicts.

/// The zone (namespace) this program instance serves; set by the loader.
#[unsafe(no_mangle)]
static ZONE: u16 = 0;

#[inline(always)]
pub fn zone() -> u16 {
    // SAFETY: a read of a static the loader sets before the program runs
    // (volatile, so the compiler does not fold the default 0 in).
    unsafe { core::ptr::read_volatile(&ZONE) }
}

/// Let the packet go on (`TC_ACT_OK`).
pub const TC_ACT_OK: i32 = 0;
/// Drop the packet (`TC_ACT_SHOT`).
pub const TC_ACT_SHOT: i32 = 2;
