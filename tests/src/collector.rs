//! A real IPFIX collector: nfdump's `nfcapd` on a loopback port, its files
//! in a directory of its own, read back with `nfdump -o json`. Killed and
//! removed on drop (also when a test fails).

use std::{
    net::{SocketAddr, UdpSocket},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use serde_json::Value;

pub struct Nfcapd {
    pub addr: SocketAddr,
    dir: PathBuf,
    child: Option<Child>,
}

/// Whether nfdump's tools are installed; under `CI=true` a missing one
/// fails the test (`cargo xtask setup` installs them).
pub fn available() -> bool {
    let have = Command::new("nfcapd").arg("-V").output().is_ok() && Command::new("nfdump").arg("-V").output().is_ok();
    if !have {
        assert!(std::env::var_os("CI").is_none_or(|v| v != "true"), "nfdump (nfcapd) is missing under CI");
        eprintln!("skipped: nfdump (nfcapd) is not installed (cargo xtask setup installs it)");
    }
    have
}

impl Nfcapd {
    /// Starts a collector on a free loopback UDP port.
    pub fn start() -> Result<Nfcapd> {
        Self::start_in(None)
    }

    /// Starts a collector on a loopback UDP port of network namespace `ns`
    /// (`None`: this process's).
    pub fn start_in(ns: Option<&str>) -> Result<Nfcapd> {
        let port = UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir = std::env::temp_dir().join(crate::unique("nfcapd"));
        std::fs::create_dir_all(&dir)?;
        let in_ns = |cmd: &str| {
            let mut c = Command::new(if ns.is_some() { "ip" } else { cmd });
            if let Some(ns) = ns {
                c.args(["netns", "exec", ns, cmd]);
            }
            c
        };
        let child = in_ns("nfcapd")
            .args(["-b", "127.0.0.1", "-p", &port.to_string(), "-t", "3600", "-B", "8388608", "-w"])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nfcapd")?;
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let c = Nfcapd { addr, dir, child: Some(child) };
        crate::wait_for(
            || {
                let out = in_ns("ss").args(["-Hlun", &format!("sport = :{port}")]).output();
                out.is_ok_and(|o| !o.stdout.is_empty())
            },
            "nfcapd listening",
        );
        Ok(c)
    }

    /// Stops the collector (it writes what it holds) and decodes every
    /// record it received.
    pub fn records(mut self) -> Result<Vec<Value>> {
        if let Some(mut child) = self.child.take() {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM)?;
            let started = std::time::Instant::now();
            while child.try_wait()?.is_none() {
                ensure!(started.elapsed() < Duration::from_secs(10), "nfcapd did not stop");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let out = Command::new("nfdump").arg("-R").arg(&self.dir).args(["-o", "json"]).output()?;
        ensure!(out.status.success(), "nfdump: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        if text.trim().is_empty() {
            return Ok(vec![]);
        }
        let v: Value = serde_json::from_str(&text).with_context(|| format!("nfdump's JSON: {text}"))?;
        Ok(v.as_array().cloned().unwrap_or_default())
    }
}

impl Drop for Nfcapd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
