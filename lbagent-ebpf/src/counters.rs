//! Per-CPU counters.

use lbagent_common::Counter;

use crate::maps::COUNTERS;

#[inline(always)]
pub fn count(c: Counter) {
    if let Some(p) = COUNTERS.get_ptr_mut(c as u32) {
        unsafe { *p += 1 };
    }
}
