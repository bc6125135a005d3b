//! The haproxy process: a new configuration is checked with `haproxy -c`
//! before it replaces the running one; reloads are hitless (SIGUSR2 to the
//! master: old workers finish their connections).
//!
//! The master is identified by more than its pid file: the pid is opened as
//! a pidfd, and the process behind it must run the haproxy binary (also
//! once a package upgrade replaced it on disk) with this agent's
//! configuration file; when the pid file names none (a master re-executing
//! itself unlinks and rewrites it), the master is looked for among the
//! processes, so a reload under way is never mistaken for no haproxy; signals go through the pidfd, so a pid reused
//! by another process is never signalled. What is compared before a reload
//! is the hash of the configuration this agent last made haproxy load, not
//! the file on disk (an edit of the file does not count as loaded).

use std::{
    cell::Cell,
    fs,
    hash::{DefaultHasher, Hash, Hasher},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::fs::DirBuilderExt,
    },
    path::PathBuf,
    time::Duration,
    time::Instant,
};

use anyhow::{Context, Result, anyhow, bail};

use super::config::{Rendered, section_of};
use crate::{
    files::{ensure_private_dir, write_private},
    tools,
};

/// What `Haproxy::apply` did.
#[derive(Debug, Default)]
pub struct Outcome {
    /// "started haproxy" / "reloaded haproxy", or nothing when unchanged.
    pub action: Option<&'static str>,
    /// Load balancers whose section haproxy refused: (id, why, and what
    /// runs for it instead).
    pub faults: Vec<(String, String)>,
}

pub struct Haproxy {
    pub dir: PathBuf,
    /// Hash of the configuration this agent last started or reloaded with.
    loaded: Cell<Option<u64>>,
    /// A reload signalled but not yet seen through (its new worker did not
    /// serve within `RELOAD_WAIT`).
    pending: Cell<Option<Pending>>,
}

/// How long `apply` waits for a reload's new worker before returning.
const RELOAD_WAIT: Duration = Duration::from_secs(5);
/// How long a signalled reload is left to finish before it is signalled
/// again. haproxy's master re-executes itself on SIGUSR2; on a loaded host
/// that takes seconds, and a second SIGUSR2 restarts it (or, before the new
/// image has installed its handlers, terminates the master).
const RELOAD_PATIENCE: Duration = Duration::from_secs(60);

/// A reload in progress: which configuration, which master, the worker it
/// replaces, and when it was signalled.
#[derive(Clone, Copy)]
struct Pending {
    hash: u64,
    master: i32,
    old_worker: Option<u32>,
    since: Instant,
}

/// A live haproxy master of this agent, held by a pidfd.
struct Master {
    pid: i32,
    fd: OwnedFd,
}

impl Master {
    fn signal(&self, sig: i32) -> bool {
        // SAFETY: pidfd_send_signal on a pidfd we own, no siginfo.
        unsafe { libc::syscall(libc::SYS_pidfd_send_signal, self.fd.as_raw_fd(), sig, 0usize, 0u32) == 0 }
    }

    fn alive(&self) -> bool {
        self.signal(0)
    }
}

/// The parent of `pid` (`/proc/<pid>/stat`, after the command name).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

fn hash(text: &str) -> u64 {
    let mut h = DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

impl Haproxy {
    pub fn new(dir: PathBuf) -> Self {
        Haproxy { dir, loaded: Cell::new(None), pending: Cell::new(None) }
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.join("haproxy.cfg")
    }

    /// The empty directory workers chroot into.
    pub fn chroot_dir(&self) -> PathBuf {
        self.dir.join("empty")
    }

    fn ensure_dirs(&self) -> Result<()> {
        ensure_private_dir(&self.dir)?;
        let empty = self.chroot_dir();
        if !empty.is_dir() {
            fs::DirBuilder::new().mode(0o555).create(&empty)?;
        }
        Ok(())
    }

    /// The running master: the one the pid file names, or else the one
    /// found among the processes. The pid file alone is not enough: a
    /// master re-executing itself on SIGUSR2 unlinks and rewrites it, and
    /// an agent that believed it absent would start a second master.
    fn master(&self) -> Option<Master> {
        let named = fs::read_to_string(self.dir.join("haproxy.pid"))
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<i32>().ok()));
        named.and_then(|pid| self.open_master(pid)).or_else(|| self.masters().into_iter().next())
    }

    /// Every live master of this agent's configuration, by pid: haproxy
    /// processes running it whose parent does not (a parent that does is
    /// their master: they are its workers).
    fn masters(&self) -> Vec<Master> {
        let Ok(dir) = fs::read_dir("/proc") else { return Vec::new() };
        let mut pids: Vec<i32> =
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).filter(|p| *p > 1).collect();
        pids.sort_unstable();
        pids.into_iter()
            .filter(|&pid| self.runs_ours(pid) && parent_of(pid).is_none_or(|pp| !self.runs_ours(pp)))
            .filter_map(|pid| self.open_master(pid))
            .collect()
    }

    /// Whether `pid` runs the haproxy binary with this agent's configuration
    /// as `-f <config>` (a binary replaced on disk since it started still
    /// counts).
    fn runs_ours(&self, pid: i32) -> bool {
        let Ok(exe) = fs::read_link(format!("/proc/{pid}/exe")) else { return false };
        let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else { return false };
        let config = self.config_path();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        tools::is(&exe, tools::HAPROXY)
            && args.windows(2).any(|w| w[0] == b"-f" && w[1] == config.as_os_str().as_encoded_bytes())
    }

    /// Whether `pid` is a master this agent could have started: ours by
    /// `runs_ours`, in master-worker mode (`-W`), and root's (the master
    /// stays root; a look-alike an unprivileged user started is not
    /// adopted, signalled or waited for).
    fn is_master(&self, pid: i32) -> bool {
        use std::os::unix::fs::MetadataExt;
        let root = fs::metadata(format!("/proc/{pid}")).is_ok_and(|m| m.uid() == 0);
        let mode = fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == b"-W"));
        root && mode && self.runs_ours(pid)
    }

    /// `pid` held by a pidfd, if it is a live haproxy of this agent.
    fn open_master(&self, pid: i32) -> Option<Master> {
        if pid <= 1 {
            return None;
        }
        // SAFETY: pidfd_open(2) with no flags; the result is a new fd we own.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` was just returned by pidfd_open and is owned by nobody else.
        let m = Master { pid, fd: unsafe { OwnedFd::from_raw_fd(fd as i32) } };
        // Checked after the pidfd is open: if the pid was reused before, the
        // checks see the new process and fail; after, the pidfd stays dead.
        (self.is_master(pid) && m.alive()).then_some(m)
    }

    /// Whether haproxy (this agent's) is running.
    pub fn running(&self) -> bool {
        self.master().is_some()
    }

    /// Pid of the worker answering the stats socket.
    fn worker_pid(&self) -> Option<u32> {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(self.dir.join("admin.sock")).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
        s.write_all(b"show info\n").ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        out.lines().find_map(|l| l.strip_prefix("Pid: "))?.trim().parse().ok()
    }

    /// `haproxy -c` on `text`; the error is haproxy's own message.
    fn check(&self, text: &str) -> Result<(), String> {
        let candidate = self.dir.join("haproxy.cfg.check");
        write_private(&candidate, text.as_bytes(), false).map_err(|e| format!("{e:#}"))?;
        let out = tools::command(tools::HAPROXY)
            .map_err(|e| format!("{e:#}"))?
            .args(["-c", "-f"])
            .arg(&candidate)
            .output()
            .map_err(|e| format!("running haproxy -c: {e}"))?;
        let _ = fs::remove_file(&candidate);
        if out.status.success() {
            Ok(())
        } else {
            // haproxy's alerts, without its timestamps and our temp file name.
            let err = String::from_utf8_lossy(&out.stderr);
            let lines: Vec<String> = err
                .lines()
                .filter(|l| l.contains("[ALERT]"))
                .map(|l| l.split_once(" : ").map_or(l, |(_, m)| m).replace(&*candidate.to_string_lossy(), "config"))
                .take(4)
                .collect();
            Err(if lines.is_empty() { err.trim().to_string() } else { lines.join("; ") })
        }
    }

    /// The configuration to run when `cfg` as a whole is refused: every load
    /// balancer whose section passes on its own keeps its new section; one
    /// that fails keeps its section from the running file if that still
    /// passes, and has none otherwise.
    fn isolate(&self, cfg: &Rendered) -> (Rendered, Vec<(String, String)>) {
        let previous = fs::read_to_string(self.config_path()).ok();
        let mut out = Rendered { header: cfg.header.clone(), sections: Vec::new() };
        let mut faults = Vec::new();
        for (id, section) in &cfg.sections {
            let Err(e) = self.check(&cfg.with_only(section)) else {
                out.sections.push((id.clone(), section.clone()));
                continue;
            };
            let kept = previous
                .as_deref()
                .and_then(|p| section_of(p, id))
                .filter(|old| old != section && self.check(&cfg.with_only(old)).is_ok());
            let instead = if kept.is_some() {
                "its previous proxy listeners keep running"
            } else {
                "its proxy listeners are not served until this is fixed"
            };
            faults.push((id.clone(), format!("haproxy refused this load balancer's listeners ({instead}): {e}")));
            if let Some(old) = kept {
                out.sections.push((id.clone(), old));
            }
        }
        (out, faults)
    }

    /// Makes haproxy run `cfg`: checks it, swaps it in, starts or reloads.
    /// A bad configuration never replaces a good one; a load balancer whose
    /// part is bad does not hold back the others (see `Outcome::faults`).
    pub fn apply(&self, cfg: &Rendered) -> Result<Outcome> {
        self.ensure_dirs()?;
        let mut outcome = Outcome::default();
        let mut text = cfg.text();
        if let Err(whole) = self.check(&text) {
            let (kept, faults) = self.isolate(cfg);
            text = kept.text();
            if faults.is_empty() || self.check(&text).is_err() {
                bail!("haproxy rejected the new configuration (the running one stays): {whole}");
            }
            outcome.faults = faults;
        }
        let running = self.master();
        let want = hash(&text);
        if running.is_some() && self.loaded.get() == Some(want) {
            return Ok(outcome);
        }
        if let (Some(m), Some(p)) = (&running, self.pending.get())
            && p.hash == want
            && p.master == m.pid
        {
            // The same reload, still under way: see whether it finished,
            // never signal it again while it may still be starting.
            let now = self.worker_pid();
            if now.is_some() && now != p.old_worker {
                self.pending.set(None);
                self.loaded.set(Some(want));
                outcome.action = Some("reloaded haproxy");
                return Ok(outcome);
            }
            if p.since.elapsed() < RELOAD_PATIENCE {
                bail!(
                    "haproxy is still starting the worker for the new configuration (reload signalled {} s ago); \
                     the old worker serves until then",
                    p.since.elapsed().as_secs()
                );
            }
            tracing::warn!(
                master = m.pid,
                "haproxy's reload did not finish within {} s; signalling again",
                RELOAD_PATIENCE.as_secs()
            );
        }
        self.pending.set(None);
        let path = self.config_path();
        let candidate = self.dir.join("haproxy.cfg.new");
        write_private(&candidate, text.as_bytes(), false)?;
        fs::rename(&candidate, &path)?;
        outcome.action = Some(match running {
            Some(m) => {
                let old = self.worker_pid();
                if !m.signal(libc::SIGUSR2) {
                    bail!("haproxy master {} vanished before its reload", m.pid);
                }
                tracing::info!(master = m.pid, "signalled haproxy to reload");
                // Hitless: the old worker keeps its connections; we return
                // once the new worker (with the new config) serves.
                let since = Instant::now();
                let mut serving = false;
                while since.elapsed() < RELOAD_WAIT {
                    std::thread::sleep(Duration::from_millis(50));
                    let now = self.worker_pid();
                    if now.is_some() && now != old {
                        serving = true;
                        break;
                    }
                }
                if !serving {
                    self.pending.set(Some(Pending { hash: want, master: m.pid, old_worker: old, since }));
                    bail!(
                        "haproxy did not start the worker for the new configuration within {} s; the reload \
                         continues (the old worker serves) and is checked again on the next pass",
                        RELOAD_WAIT.as_secs()
                    );
                }
                "reloaded haproxy"
            }
            None => {
                let out = tools::command(tools::HAPROXY)?
                    .args(["-W", "-D", "-f"])
                    .arg(&path)
                    .output()
                    .context("starting haproxy")?;
                if !out.status.success() {
                    bail!("haproxy did not start: {}", String::from_utf8_lossy(&out.stderr).trim());
                }
                let mut up = false;
                for _ in 0..50 {
                    if self.master().is_some() {
                        up = true;
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                if !up {
                    bail!("haproxy started but wrote no pid file");
                }
                "started haproxy"
            }
        });
        self.loaded.set(Some(want));
        Ok(outcome)
    }

    /// Stops haproxy (if running) and removes its files. SIGTERM to each
    /// master of this agent's configuration (it stops its workers; a master
    /// left by an earlier fault is found among the processes too), then
    /// SIGKILL to its process group for whatever is still there after
    /// 2.5 s — only while the pidfd shows the master alive, so the group id
    /// cannot have been reused.
    pub fn stop(&self) -> Result<bool> {
        self.loaded.set(None);
        self.pending.set(None);
        let mut masters: Vec<Master> = self.master().into_iter().collect();
        for m in self.masters() {
            if masters.iter().all(|k| k.pid != m.pid) {
                masters.push(m);
            }
        }
        if masters.is_empty() {
            let _ = fs::remove_dir_all(&self.dir);
            return Ok(false);
        }
        for m in &masters {
            m.signal(libc::SIGTERM);
        }
        for _ in 0..50 {
            if masters.iter().all(|m| !m.alive()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for m in masters.iter().filter(|m| m.alive()) {
            // The group of a master the pidfd shows alive.
            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(m.pid), nix::sys::signal::Signal::SIGKILL);
        }
        fs::remove_dir_all(&self.dir).map_err(|e| anyhow!("removing {}: {e}", self.dir.display()))?;
        Ok(true)
    }
}
