//! `lbagent run`: load the state file, reconcile, then keep reconciling on
//! file change (polled every second), on SIGHUP and every repair interval.
//! A refused (invalid) file changes nothing that runs. SIGTERM/SIGINT stop
//! the daemon and leave the dataplane running: it belongs to the kernel.

pub mod api;
pub mod metrics;
pub mod status;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use tokio::signal::unix::{SignalKind, signal};
use tracing::{error, info, warn};

use crate::{
    dataplane::{attach::AttachMode, loader::ZoneProgram},
    reconcile::{Desired, Realizer, Reconciler, host::Host},
    state::{self, StateFile},
};
use status::Status;

#[derive(Clone, Debug)]
pub struct Options {
    pub state: PathBuf,
    pub state_dir: PathBuf,
    pub bpffs: PathBuf,
    pub attach: AttachMode,
    pub metrics: Option<SocketAddr>,
    pub api_socket: PathBuf,
    pub repair_interval: Duration,
}

/// Content fingerprint of the state file (`None` when unreadable).
fn fingerprint(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok()
}

struct Daemon<R: Realizer> {
    opts: Options,
    reconciler: Reconciler<R>,
    status: Arc<Mutex<Status>>,
    last_good: Option<StateFile>,
}

impl<R: Realizer> Daemon<R> {
    /// Loads the file; applies it when valid, otherwise logs every problem
    /// and keeps what runs.
    fn reload(&mut self, why: &str) {
        match state::load_file(&self.opts.state) {
            Ok(s) => {
                info!("{why}: state file valid, applying");
                self.status.lock().unwrap().rejected = None;
                self.last_good = Some(s);
                self.apply(false);
            }
            Err(problems) => {
                error!("{why}: state file refused ({} problems); keeping the running state", problems.0.len());
                for p in &problems.0 {
                    error!("  {p}");
                }
                let mut st = self.status.lock().unwrap();
                st.rejected = Some(problems);
                st.refresh(&self.reconciler.applied, &self.reconciler.alloc);
            }
        }
    }

    /// Frees conntrack entries idle past their timeout.
    fn collect_garbage(&self) {
        let gc = crate::dataplane::tables::Tables::open(&self.opts.bpffs)
            .and_then(|t| t.gc(crate::cli::format::monotonic_ns()));
        match gc {
            Ok(0) => {}
            Ok(n) => info!("conntrack: {n} idle flows collected"),
            Err(e) => warn!("conntrack garbage collection: {e:#}"),
        }
    }

    fn apply(&mut self, repair: bool) {
        let Some(good) = &self.last_good else { return };
        let report = self.reconciler.apply(&Desired::from_state(good), repair);
        if !report.ok() {
            warn!("{} of {} steps failed; they are retried by the next repair pass", report.errors.len(), report.steps);
        }
        let mut st = self.status.lock().unwrap();
        st.applies += 1;
        st.last_apply = Some(report);
        st.refresh(&self.reconciler.applied, &self.reconciler.alloc);
    }
}

pub async fn run(opts: Options) -> Result<()> {
    std::fs::create_dir_all(&opts.state_dir).with_context(|| format!("creating {}", opts.state_dir.display()))?;
    // Load the object once up front: it creates or reuses (after checking)
    // the pinned maps, and fails fast on a verifier or pin problem.
    ZoneProgram::load(&opts.bpffs, 0).context("preparing the dataplane")?;
    for old in crate::dataplane::pins::stale_versions(&opts.bpffs) {
        warn!("pins of another layout version remain in {} (an older lbagent's dataplane); remove them once it is drained", old.display());
    }
    let reconciler = Reconciler::open(Host::new(opts.bpffs.clone(), opts.attach, &opts.state_dir), &opts.state_dir)?;
    let status = Arc::new(Mutex::new(Status { state_file: opts.state.display().to_string(), ..Default::default() }));
    status.lock().unwrap().refresh(&reconciler.applied, &reconciler.alloc);

    let api = api::bind(&opts.api_socket)?;
    tokio::spawn(api::serve(api, status.clone()));
    if let Some(addr) = opts.metrics {
        let l = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding metrics on {addr}"))?;
        info!("metrics on http://{}/metrics", l.local_addr()?);
        tokio::spawn(metrics::serve(l, opts.bpffs.clone(), status.clone()));
    }

    let mut d = Daemon { opts: opts.clone(), reconciler, status, last_good: None };
    let mut seen = fingerprint(&opts.state);
    d.reload("start");
    d.apply(true);

    let mut hup = signal(SignalKind::hangup())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut poll = tokio::time::interval(Duration::from_secs(1));
    let mut repair = tokio::time::interval(opts.repair_interval);
    repair.tick().await;
    info!(api = %opts.api_socket.display(), "running");
    loop {
        tokio::select! {
            _ = poll.tick() => {
                let now = fingerprint(&opts.state);
                if now != seen {
                    seen = now;
                    tokio::task::block_in_place(|| d.reload("state file changed"));
                }
            }
            _ = hup.recv() => {
                seen = fingerprint(&opts.state);
                tokio::task::block_in_place(|| d.reload("SIGHUP"));
            }
            _ = repair.tick() => tokio::task::block_in_place(|| {
                d.apply(true);
                d.collect_garbage();
            }),
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    let _ = std::fs::remove_file(&opts.api_socket);
    info!("stopped; the dataplane keeps running (`lbagent teardown` removes it)");
    Ok(())
}

/// `lbagent teardown`: removes every object the agent created, the pins and
/// the persisted allocations. Refused while a daemon serves `api_socket`.
pub fn teardown(state_dir: &Path, bpffs: &Path, api_socket: &Path) -> Result<()> {
    let bpffs_buf = bpffs.to_path_buf();
    if std::os::unix::net::UnixStream::connect(api_socket).is_ok() {
        anyhow::bail!("a daemon is running on {}; stop it first", api_socket.display());
    }
    let mut r = Reconciler::open(Host::new(bpffs_buf, AttachMode::Auto, state_dir), state_dir)?;
    let report = r.teardown();
    for c in &report.changes {
        println!("{c}");
    }
    if !report.ok() {
        for (o, e) in &report.errors {
            eprintln!("{o}: {e}");
        }
        anyhow::bail!("teardown incomplete; fix the errors above and run it again");
    }
    crate::dataplane::pins::remove_all(bpffs)?;
    println!("removed pins under {}", bpffs.display());
    Ok(())
}
