//! Conntrack garbage collection: frees the flows idle past their timeout in
//! both directions (the program also expires them on lookup; this frees
//! entries nobody looks up).
//!
//! One pass reads both tables a batch at a time (`ct_new` first) and hands
//! the keys of the halves it read idle to the program `lbagent_ct_gc`
//! (`BPF_PROG_TEST_RUN`, [`CT_GC_BATCH`] keys a run), which reads each half
//! and its pair again at the kernel's clock and frees the flow, both
//! halves, when both are still idle (or the pair is gone): the decision the
//! NAT program takes when a new flow meets an expired one, in the kernel, a
//! few instructions before the delete. A flow that came back to life since
//! the read, or a key that now holds another flow, is kept. Reading in
//! user space and deciding there cost four system calls per freed flow
//! (the pair's lookup, the half's check, two deletes): 8 s of CPU for a
//! million flows.

use std::path::Path;

use anyhow::{Context, Result};
use aya::programs::{ProgramError, TestRun, TestRunOptions};
use lbagent_common::*;

use super::{
    loader::GcProgram,
    tables::{Tables, monotonic_ns},
};

/// Runs of the program that a signal interrupted are run again this many
/// times (a key freed by the first run is then simply absent).
const INTERRUPTED_RETRIES: usize = 3;

/// The garbage collector loaded on one dataplane's tables; the daemon keeps
/// it from pass to pass (a load runs the verifier).
pub struct Collector {
    program: GcProgram,
}

impl Collector {
    /// Loads the program on the tables pinned under `root` (every map of
    /// this build must be pinned there; nothing is created or written).
    pub fn load(root: &Path) -> Result<Self> {
        Ok(Collector { program: GcProgram::load(root).context("loading the garbage collector")? })
    }

    /// Whether it still works on the tables pinned under `root`.
    pub fn current(&self, root: &Path) -> bool {
        self.program.current(root)
    }

    /// One pass over `tables` (the ones it was loaded on): frees every
    /// flow whose halves are both idle. Returns the flows freed.
    pub fn collect(&mut self, tables: &Tables) -> Result<usize> {
        let cfg = tables.config()?;
        // The read's clock: what the program decides with is its own.
        let now_ns = monotonic_ns();
        let idle = |k: &Tuple, e: &CtEntry| {
            now_ns.saturating_sub(e.last_seen_ns) > u64::from(cfg.timeout_s(k.proto, e.state)) * 1_000_000_000
        };
        let mut batch = Vec::with_capacity(CT_GC_BATCH);
        let (mut freed, mut failed) = (0, None);
        let mut run = |batch: &mut Vec<Tuple>, program: &mut GcProgram| {
            match free_if_idle(program, batch) {
                Ok(n) => freed += n,
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
            batch.clear();
        };
        for table in [MAP_CT_NEW, MAP_CT] {
            tables.each_conntrack(table, |keys, entries| {
                for (k, _) in keys.iter().zip(entries).filter(|(k, e)| idle(k, e)) {
                    batch.push(*k);
                    if batch.len() == CT_GC_BATCH {
                        run(&mut batch, &mut self.program);
                    }
                }
            })?;
        }
        run(&mut batch, &mut self.program);
        match failed {
            Some(e) => Err(e),
            None => Ok(freed),
        }
    }

    /// Runs the program on `keys` (at most [`CT_GC_BATCH`]): frees each
    /// one's flow if it is idle now. Returns the flows freed.
    pub fn free_if_idle(&mut self, keys: &[Tuple]) -> Result<usize> {
        free_if_idle(&mut self.program, keys)
    }
}

/// One pass with a collector loaded for it (`lbagent conntrack gc`).
pub fn collect(root: &Path) -> Result<usize> {
    Collector::load(root)?.collect(&Tables::open(root)?)
}

/// The program's run on `keys`, its input (the keys as they are in the
/// maps, one after the other).
fn free_if_idle(program: &mut GcProgram, keys: &[Tuple]) -> Result<usize> {
    anyhow::ensure!(keys.len() <= CT_GC_BATCH, "{} keys for one run of the garbage collector", keys.len());
    if keys.is_empty() {
        return Ok(0);
    }
    // SAFETY: `Tuple` is `repr(C)` plain integers without padding (its size
    // is asserted in lbagent-common): the keys' bytes are initialised.
    let input = unsafe { std::slice::from_raw_parts(keys.as_ptr().cast::<u8>(), std::mem::size_of_val(keys)) };
    let mut tries = 0;
    loop {
        match program.program().test_run(TestRunOptions { data_in: Some(input), ..Default::default() }) {
            Ok(res) => return Ok(res.return_value as usize),
            // A signal pending after the run (the deletes are done): again.
            Err(ProgramError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::EINTR) && tries < INTERRUPTED_RETRIES =>
            {
                tries += 1
            }
            Err(e) => return Err(anyhow::Error::new(e).context("running the garbage collector")),
        }
    }
}
