//! The realizer for this host: load balancers and NAT gateways (plumbing,
//! engine rules, allocations) and the shared haproxy for proxy listeners.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use anyhow::Result;

use super::{Applied, Finish, Realizer, Spec};
use crate::outcome::{Changes, ErrorKind, ObjectError};
use crate::{
    alloc::Allocations,
    dataplane::{attach::AttachMode, engine::Engine},
    lb::{self, haproxy::Haproxy, health::Health},
    natgw,
    state::spec::{AgentConfig, Gw, Lb, ListenerMode},
};

pub struct Host {
    pub engine: Engine,
    /// The OVS integration bridge (from the state file's `agent` section).
    pub bridge: String,
    pub haproxy: Haproxy,
    /// Direct-mode health, written by the daemon's prober.
    pub health: Arc<Mutex<Health>>,
}

impl Host {
    /// `state_dir` holds haproxy's files (`<state_dir>/haproxy/`).
    pub fn new(bpffs: PathBuf, mode: AttachMode, state_dir: &Path) -> Self {
        Host {
            engine: Engine::new(bpffs, mode),
            bridge: AgentConfig::default().integration_bridge,
            haproxy: Haproxy::new(state_dir.join("haproxy")),
            health: Arc::default(),
        }
    }
}

impl Realizer for Host {
    fn allocate(&mut self, spec: Spec, alloc: &mut Allocations) -> Result<Changes> {
        match spec {
            Spec::Lb(l) => lb::allocate(l, alloc),
            Spec::Gw(g) => natgw::allocate(g, alloc),
        }
    }

    fn ensure_lb(&mut self, l: &Lb, alloc: &mut Allocations) -> Result<Changes> {
        let health = self.health.lock().unwrap();
        lb::ensure(&mut self.engine, &self.bridge, l, &health, alloc)
    }

    fn remove_lb(&mut self, id: &str, alloc: &mut Allocations) -> Result<Changes> {
        lb::remove(&mut self.engine, id, alloc)
    }

    /// haproxy serves the proxy-mode listeners of every applied load balancer.
    fn finish(&mut self, applied: &Applied, alloc: &Allocations) -> Result<Finish> {
        let lbs: Vec<_> = applied.lbs.values().filter_map(|l| Some((&**l, alloc.lbs.get(&l.id)?))).collect();
        let any_proxy = lbs.iter().any(|(l, _)| l.listeners.iter().any(|x| x.mode == ListenerMode::Proxy));
        if !any_proxy {
            let stopped = self.haproxy.stop()?;
            return Ok(Finish {
                changes: if stopped {
                    ["stopped haproxy (no proxy listeners)".to_string()].into_iter().collect()
                } else {
                    Changes::new()
                },
                errors: vec![],
            });
        }
        let config = lb::haproxy::render(&self.haproxy.dir, &self.haproxy.chroot_dir(), &lbs);
        let outcome = self.haproxy.apply(&config)?;
        Ok(Finish {
            changes: outcome.action.map(str::to_string).into_iter().collect(),
            errors: outcome
                .faults
                .into_iter()
                .map(|(id, e)| ObjectError {
                    object: crate::naming::lb_zone_key(&id),
                    kind: ErrorKind::Proxy,
                    error: e,
                })
                .collect(),
        })
    }

    fn begin_pass(&mut self) {
        self.engine.begin_pass();
        crate::plumbing::ovs::begin_pass();
    }

    fn configure(&mut self, agent: &AgentConfig) {
        self.bridge = agent.integration_bridge.clone();
        self.engine.ct_limits = agent.conntrack_limits;
        match self.engine.repair_pins() {
            Ok(maps) if !maps.is_empty() => {
                tracing::warn!(
                    object = "agent",
                    "pin directory was deleted; re-pinned maps from the running programs: {}",
                    maps.join(", ")
                );
            }
            Ok(_) => {}
            Err(e) => tracing::error!(object = "agent", "repairing the pin directory: {e:#}"),
        }
        let want = agent.nat_config();
        let pinned =
            crate::dataplane::pins::versioned_dir(&self.engine.bpffs).join(lbagent_common::MAP_CT.name).exists();
        if !pinned && want == AgentConfig::default().nat_config() {
            // Nothing loaded yet and nothing to change (teardown must not load the maps).
            return;
        }
        let result = self.engine.tables().and_then(|t| {
            if t.config()? != want {
                t.set_config(want)?;
                tracing::info!(object = "agent", "conntrack timeouts set: {want:?}");
            }
            Ok(())
        });
        if let Err(e) = result {
            tracing::error!(object = "agent", "writing conntrack timeouts: {e:#}");
        }
    }

    fn ensure_gw(&mut self, gw: &Gw, prev: Option<&Gw>, alloc: &mut Allocations) -> Result<Changes> {
        natgw::ensure(&mut self.engine, &self.bridge, gw, prev, alloc)
    }

    fn remove_gw(&mut self, name: &str, alloc: &mut Allocations) -> Result<Changes> {
        natgw::remove(&mut self.engine, name, alloc)
    }
}
