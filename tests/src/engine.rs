//! The NAT program loaded for one zone with its own pin directory, run on
//! crafted packets with `BPF_PROG_TEST_RUN`. Pins are removed on drop.

use std::path::PathBuf;

use anyhow::Result;
use aya::programs::{TestRun, TestRunOptions};
use lbagent::dataplane::{attach::Direction, loader::ZoneProgram, pins, tables::Tables};

use crate::unique;

/// Unique bpffs directory for one test; removed (with all pins) on drop.
pub struct TestPins {
    pub root: PathBuf,
}

impl TestPins {
    pub fn new() -> Self {
        TestPins { root: PathBuf::from("/sys/fs/bpf").join(unique("lbatest")) }
    }
}

impl Default for TestPins {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestPins {
    fn drop(&mut self) {
        let _ = pins::remove_all(&self.root);
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

pub struct Engine {
    pub prog: ZoneProgram,
    pub tables: Tables,
    pub pins: TestPins,
}

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;

impl Engine {
    pub fn new(zone: u16) -> Result<Self> {
        Self::with_ct_max(zone, None)
    }

    /// An engine whose conntrack table holds `ct_max` entries.
    pub fn with_ct_max(zone: u16, ct_max: Option<u32>) -> Result<Self> {
        let pins = TestPins::new();
        let prog = ZoneProgram::load_sized(&pins.root, zone, ct_max)?;
        let tables = Tables::open(&pins.root)?;
        Ok(Engine { prog, tables, pins })
    }

    /// An engine for `zone` with one rule: udp 198.51.100.10:53 → 10.0.2.2:5353.
    pub fn with_dns_rule(zone: u16, rule_id: u32) -> Result<Self> {
        let e = Self::new(zone)?;
        e.tables.set_dnat(&lbagent::dataplane::tables::DnatSpec {
            zone,
            addr: std::net::Ipv4Addr::new(198, 51, 100, 10),
            proto: lbagent_common::PROTO_UDP,
            port: 53,
            rule_id,
            backends: vec![(std::net::Ipv4Addr::new(10, 0, 2, 2), 5353)],
            snat: None,
        })?;
        Ok(e)
    }

    /// Runs the program once; returns its verdict and the output frame.
    pub fn run(&mut self, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        self.run_on(Direction::Ingress, frame)
    }

    /// Runs the program of one side (ingress: the NAT engine; egress: what
    /// the namespace sends) once; returns its verdict and the output frame.
    pub fn run_on(&mut self, dir: Direction, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        let mut out = vec![0u8; frame.len() + 256];
        let res = self.prog.program_for(dir).test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ..TestRunOptions::default()
        })?;
        out.truncate(res.data_size_out as usize);
        Ok((res.return_value, out))
    }

    /// Average ns per run over `repeat` runs (the kernel's own timer).
    pub fn time(&mut self, frame: &[u8], repeat: u32) -> Result<f64> {
        let mut out = vec![0u8; frame.len() + 256];
        let res = self.prog.program().test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat,
            ..TestRunOptions::default()
        })?;
        Ok(res.duration.as_nanos() as f64)
    }
}
