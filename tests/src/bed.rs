//! What every reconciler-driven testbed shares: its own pins and state dir,
//! an in-process reconciler over the real host, teardown on drop, and a
//! host-wide lock for tests that allocate host addresses.

use std::{fs::File, path::PathBuf};

use anyhow::Result;
use lbagent::{
    dataplane::attach::AttachMode,
    reconcile::{Reconciler, host::Host},
    state::{Format, accept_str},
};

use crate::{engine::TestPins, unique};

pub struct Bed {
    pub reconciler: Reconciler<Host>,
    pub pins: TestPins,
    pub state_dir: PathBuf,
}

impl Bed {
    pub fn new() -> Result<Self> {
        Self::with_attach(AttachMode::Auto)
    }

    /// A bed whose programs attach with `mode` (tcx here on 6.6+; netlink
    /// is what Linux 5.x hosts use).
    pub fn with_attach(mode: AttachMode) -> Result<Self> {
        let pins = TestPins::new();
        let state_dir = std::env::temp_dir().join(unique("lbsd"));
        let reconciler = Reconciler::open(Host::new(pins.root.clone(), mode, &state_dir), &state_dir)?;
        Ok(Bed { reconciler, pins, state_dir })
    }

    /// Validates and applies a state; panics with every error on failure.
    pub fn apply(&mut self, yaml: &str) {
        let mut s = accept_str(yaml, Format::Yaml).unwrap_or_else(|e| panic!("invalid test state: {e}\n{yaml}"));
        if crate::slow_path() {
            s.desired.agent.fast_path = false;
        }
        let mut report = self.reconciler.apply(&s.desired, false);
        // Emulated guests (vm-test under TCG): haproxy's reload can outlast
        // the agent's 5 s wait; repair passes see it through, as the
        // daemon's do.
        let mut passes = 0;
        while !report.ok() && crate::slowdown() > 1 && passes < 30 {
            std::thread::sleep(std::time::Duration::from_secs(2));
            report = self.reconciler.apply(&s.desired, true);
            passes += 1;
        }
        assert!(report.ok(), "apply failed: {:?}", report.errors);
    }

    /// One repair pass over a state (as the daemon's timer runs it: every
    /// object ensured again); panics with every error on failure.
    pub fn repair(&mut self, yaml: &str) {
        let mut s = accept_str(yaml, Format::Yaml).unwrap_or_else(|e| panic!("invalid test state: {e}\n{yaml}"));
        if crate::slow_path() {
            s.desired.agent.fast_path = false;
        }
        let report = self.reconciler.apply(&s.desired, true);
        assert!(report.ok(), "repair failed: {:?}", report.errors);
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        let report = self.reconciler.teardown();
        if !report.ok() {
            eprintln!("teardown: {:?}", report.errors);
        }
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

/// Serialises tests that put link-local addresses in the host namespace
/// (two agents would otherwise allocate the same outer address).
pub struct HostLock {
    _file: nix::fcntl::Flock<File>,
}

impl HostLock {
    pub fn take() -> Result<Self> {
        let f = File::create("/run/lbagent-tests-host.lock")?;
        let f = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| e)?;
        Ok(HostLock { _file: f })
    }
}

/// A load balancer id unique to this test run (its first 13 characters,
/// which name the links, too).
pub fn lb_id() -> String {
    format!("{:0>13}-test", unique(""))
}

/// A desired-state document with one load balancer `id` on a /24 of its
/// own, `10.<net>.0.0/24` (VIP `.5` with MAC `02:00:0a:<net>:00:05`,
/// gateway `.1`), plugged into `bridge`: each of `listeners` is one YAML
/// flow mapping, `backends` the flow list of backend group `g`.
pub fn lb_state<S: AsRef<str>>(
    bridge: &str,
    id: &str,
    net: u8,
    listeners: impl IntoIterator<Item = S>,
    backends: &str,
) -> String {
    let listeners: String = listeners.into_iter().map(|l| format!("      - {}\n", l.as_ref())).collect();
    format!(
        "version: 1
agent: {{integration_bridge: {bridge}}}
load_balancers:
  - id: {id}
    network: {{ip: 10.{net}.0.5, mac: \"02:00:0a:{net:02x}:00:05\", prefix_len: 24, gateway: 10.{net}.0.1}}
    listeners:
{listeners}    backend_groups: [{{id: g, backends: {backends}}}]
"
    )
}
