//! An agent under test as operators run it: `lbagent run` in a process of
//! its own (this build or another), with private directories (state dir,
//! bpffs pins, API socket), read back through `lbagent status --json`.
//! Shared by the daemon, fleet and upgrade tests and the benchmark; the
//! process is killed and the dataplane torn down on drop.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
};

use serde_json::Value;

use crate::{lbagent_bin, unique};

/// An agent's private directories: its state dir (`<dir>/sd`), pins
/// (`/sys/fs/bpf/<tag>`), API socket and logs (`<dir>`). On drop, whatever
/// the agent built is torn down (`lbagent teardown`) and both go.
pub struct AgentDirs {
    pub dir: PathBuf,
    pub bpffs: PathBuf,
    /// Environment of every command run on these directories (the agent,
    /// the CLI, the teardown).
    pub envs: Vec<(String, String)>,
    /// The release build ran the agent here: it tears down too (a debug
    /// build took ~20 min to tear 500 zones down).
    release_ran: std::sync::atomic::AtomicBool,
    /// `--instance` of the agent (two agents on one host: an HA pair).
    pub instance: Option<String>,
}

impl AgentDirs {
    /// Fresh directories named after `prefix` (made unique).
    pub fn new(prefix: &str) -> AgentDirs {
        let tag = unique(prefix);
        let dir = std::env::temp_dir().join(&tag);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        AgentDirs {
            dir,
            bpffs: PathBuf::from("/sys/fs/bpf").join(tag),
            envs: Vec::new(),
            release_ran: Default::default(),
            instance: None,
        }
    }

    /// `--state-dir`, `--bpffs` and `--api-socket`: every command of this
    /// agent takes them.
    pub fn flags(&self) -> Vec<String> {
        let p = |p: PathBuf| p.display().to_string();
        vec![
            "--state-dir".into(),
            p(self.dir.join("sd")),
            "--bpffs".into(),
            p(self.bpffs.clone()),
            "--api-socket".into(),
            p(self.dir.join("api.sock")),
        ]
        .into_iter()
        .chain(self.instance.iter().flat_map(|i| ["--instance".to_string(), i.clone()]))
        .collect()
    }

    /// A file of the test in the agent's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The running agent's status, asked with `bin` (`None` when no agent
    /// answers).
    pub fn status_by(&self, bin: &Path) -> Option<Value> {
        let out =
            Command::new(bin).args(["status", "--json"]).args(self.flags()).envs(self.envs.clone()).output().ok()?;
        out.status.success().then(|| serde_json::from_slice(&out.stdout).ok()).flatten()
    }

    /// The running agent's status, asked with this build.
    pub fn status(&self) -> Option<Value> {
        self.status_by(&lbagent_bin())
    }

    /// `lbagent ARGS` with these directories; its stdout. Panics with the
    /// command's stderr when it fails.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(lbagent_bin())
            .args(args)
            .args(self.flags())
            .envs(self.envs.clone())
            .output()
            .expect("running lbagent");
        assert!(out.status.success(), "lbagent {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("UTF-8 output")
    }

    /// Starts `bin run ARGS` on these directories, its stderr appended to
    /// `log` in them.
    pub fn spawn(&self, bin: &Path, args: &[String], log: &str) -> AgentProcess {
        self.spawn_env(bin, args, log, &[])
    }

    /// [`AgentDirs::spawn`] with extra environment variables.
    pub fn spawn_env(&self, bin: &Path, args: &[String], log: &str, env: &[(&str, &str)]) -> AgentProcess {
        if bin == crate::lbagent_release_bin() {
            self.release_ran.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let log = self.path(log);
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&log).expect("the agent's log");
        let child = Command::new(bin)
            .arg("run")
            .args(args)
            .args(self.flags())
            .envs(env.iter().copied())
            .envs(self.envs.clone())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        AgentProcess { child, bin: bin.to_path_buf(), log }
    }
}

impl Drop for AgentDirs {
    fn drop(&mut self) {
        let release = crate::lbagent_release_bin();
        let bin = if *self.release_ran.get_mut() { release } else { lbagent_bin() };
        let _ = Command::new(bin).arg("teardown").args(self.flags()).envs(self.envs.clone()).output();
        let _ = std::fs::remove_dir_all(&self.bpffs);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A running `lbagent run`; killed on drop if it still runs (a failed test
/// must not leave it behind). Declare it after its [`AgentDirs`], so that
/// it goes first and the teardown finds no agent running.
pub struct AgentProcess {
    child: Child,
    /// The build that runs.
    pub bin: PathBuf,
    log: PathBuf,
}

impl AgentProcess {
    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id() as i32)
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(self.pid(), sig);
    }

    /// SIGTERM and wait: true when it exited cleanly (its dataplane stays).
    pub fn stop(&mut self) -> bool {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        self.child.wait().map(|s| s.success()).unwrap_or(false)
    }

    /// Sends `sig` and waits for the exit.
    pub fn end_with(&mut self, sig: nix::sys::signal::Signal) {
        self.signal(sig);
        let _ = self.child.wait();
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    /// Everything it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Whether a status says the last apply succeeded.
pub fn applied(status: &Value) -> bool {
    status["last_apply"]["ok"] == true
}

/// Pids of the haproxy masters running `config`: processes with it on
/// their command line whose parent has not (the others are workers).
pub fn haproxy_masters(config: &Path) -> Vec<i32> {
    let runs = |pid: i32| {
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == config.as_os_str().as_encoded_bytes()))
    };
    let parent = |pid: i32| -> Option<i32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
    };
    let mut pids: Vec<i32> = std::fs::read_dir("/proc")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    pids.retain(|&p| runs(p) && parent(p).is_none_or(|pp| !runs(pp)));
    pids.sort_unstable();
    pids
}
