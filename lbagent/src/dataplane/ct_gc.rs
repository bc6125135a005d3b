//! Conntrack garbage collection: frees the flows idle past their timeout in
//! both directions (the program also expires them on lookup; this frees
//! entries nobody looks up).
//!
//! One pass reads both tables a batch at a time (`ct_new` first) and hands
//! the keys of the halves it read idle to the program `lbagent_ct_gc`
//! (`BPF_PROG_TEST_RUN`, [`CT_GC_BATCH`] keys a run), which reads each half
//! and its pair again at the pass's clock and frees the flow, both halves,
//! when both are still idle (or the pair is gone): the decision the NAT
//! program takes when a new flow meets an expired one, in the kernel, a
//! few instructions before the delete. A flow that came back to life since
//! the read, or a key that now holds another flow, is kept. Reading in
//! user space and deciding there cost four system calls per freed flow
//! (the pair's lookup, the half's check, two deletes): 8 s of CPU for a
//! million flows.

use std::path::Path;

use anyhow::{Context, Result};
use aya::programs::{TestRun, TestRunOptions};
use lbagent_common::*;

use super::{loader::GcProgram, tables::Tables};

/// Frees every flow of the dataplane pinned under `root` whose halves are
/// both idle at `now_ns` (CLOCK_MONOTONIC, the clock of
/// `bpf_ktime_get_ns`). Returns the flows freed.
pub fn collect(root: &Path, now_ns: u64) -> Result<usize> {
    let tables = Tables::open(root)?;
    let mut program = GcProgram::load(root).context("loading the garbage collector")?;
    let cfg = tables.config()?;
    let idle = |k: &Tuple, e: &CtEntry| {
        now_ns.saturating_sub(e.last_seen_ns) > u64::from(cfg.timeout_s(k.proto, e.state)) * 1_000_000_000
    };
    let mut batch = Batch::new(now_ns);
    let (mut freed, mut failed) = (0, None);
    let mut run = |batch: &mut Batch| match batch.run(&mut program) {
        Ok(n) => freed += n,
        Err(e) => {
            failed.get_or_insert(e);
        }
    };
    for table in [MAP_CT_NEW, MAP_CT] {
        tables.each_conntrack(table, |keys, entries| {
            for (k, _) in keys.iter().zip(entries).filter(|(k, e)| idle(k, e)) {
                if batch.push(k) {
                    run(&mut batch);
                }
            }
        })?;
    }
    run(&mut batch);
    match failed {
        Some(e) => Err(e),
        None => Ok(freed),
    }
}

/// The program's input: the clock, then up to [`CT_GC_BATCH`] keys.
struct Batch {
    input: Vec<u8>,
}

impl Batch {
    fn new(now_ns: u64) -> Self {
        let mut input = Vec::with_capacity(CT_GC_KEYS + CT_GC_BATCH * size_of::<Tuple>());
        input.extend_from_slice(&now_ns.to_ne_bytes());
        input.resize(CT_GC_KEYS, 0);
        Batch { input }
    }

    fn len(&self) -> usize {
        (self.input.len() - CT_GC_KEYS) / size_of::<Tuple>()
    }

    /// Adds a key; whether the batch is full now.
    fn push(&mut self, key: &Tuple) -> bool {
        // SAFETY: `Tuple` is `repr(C)` plain integers without padding
        // (asserted in lbagent-common): its 16 bytes are initialised.
        let bytes = unsafe { std::slice::from_raw_parts((key as *const Tuple).cast::<u8>(), size_of::<Tuple>()) };
        self.input.extend_from_slice(bytes);
        self.len() == CT_GC_BATCH
    }

    /// Runs the program on the keys (if any) and empties the batch; the
    /// flows it freed.
    fn run(&mut self, program: &mut GcProgram) -> Result<usize> {
        if self.len() == 0 {
            return Ok(0);
        }
        let res = program.program().test_run(TestRunOptions { data_in: Some(&self.input), ..Default::default() });
        self.input.truncate(CT_GC_KEYS);
        Ok(res.context("running the garbage collector")?.return_value as usize)
    }
}
