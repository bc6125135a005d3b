//! Real etcd servers for the fleet tests: Debian's `etcd-server`, each
//! member on free loopback ports with a temporary data dir (never 2379 or
//! the default dir), heartbeat 100 ms / election 1 s (no spurious elections
//! on two busy cores). Members can be stopped and started again on the same
//! data; everything is killed and removed on drop.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

pub struct Etcd {
    pub dir: PathBuf,
    pub client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `etcd` on PATH, or a failure under CI (a skip elsewhere).
pub fn available() -> bool {
    let ok = Command::new("etcd").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none_or(|v| v != "true"),
            "etcd missing under CI (setup installs etcd-server)"
        );
        eprintln!("skipped: etcd not installed (`cargo xtask setup`)");
    }
    ok
}

impl Etcd {
    /// A one-member cluster, started and answering.
    pub fn start(tag: &str) -> Result<Etcd> {
        let dir = std::env::temp_dir().join(format!("{tag}-etcd"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let mut e = Etcd { dir, client_port: free_port(), peer_port: free_port(), child: None };
        e.resume()?;
        Ok(e)
    }

    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Starts (again, on the same data) and waits until it serves.
    pub fn resume(&mut self) -> Result<()> {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let client = format!("http://{}", self.endpoint());
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("etcd.log"))?;
        let child = Command::new("etcd")
            .args(["--name", "m0", "--data-dir"])
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("m0={peer}"), "--initial-cluster-state", "new"])
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting etcd")?;
        self.child = Some(child);
        let t = Instant::now();
        while self.ctl(&["endpoint", "health"]).is_err() {
            if t.elapsed() > Duration::from_secs(20) * crate::slowdown() {
                bail!("etcd did not become healthy; see {}", self.dir.join("etcd.log").display());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Kills the member (its data stays).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `etcdctl` against this member; its stdout.
    pub fn ctl(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoint(), "--command-timeout=3s", "--dial-timeout=1s"])
            .args(args)
            .output()
            .context("etcdctl")?;
        if !out.status.success() {
            bail!("etcdctl {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// The store's current revision.
    pub fn revision(&self) -> Result<i64> {
        let out = self.ctl(&["endpoint", "status", "-w", "json"])?;
        let v: serde_json::Value = serde_json::from_str(&out)?;
        v[0]["Status"]["header"]["revision"].as_i64().context("no revision in endpoint status")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
