//! A CPU-throttled cgroup: slows a real process (and every child it forks)
//! down to a fraction of one CPU, the way a loaded production host does.
//! Works with the cgroup v1 `cpu` controller (`cpu.cfs_quota_us`) and with
//! cgroup v2 (`cpu.max`). Processes are moved back and the group removed on
//! drop, also when the test fails.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

pub struct CpuThrottle {
    dir: PathBuf,
    /// Where the processes go back to on drop.
    parent: PathBuf,
}

impl CpuThrottle {
    /// A new group named `name` allowed `permille` ‰ of one CPU (at
    /// least 1 ms per 1 s period).
    pub fn new(name: &str, permille: u32) -> Result<CpuThrottle> {
        let period = 1_000_000u32;
        let quota = (period / 1000 * permille).max(1000);
        let v1 = Path::new("/sys/fs/cgroup/cpu");
        if v1.join("cpu.cfs_quota_us").exists() {
            let dir = v1.join(name);
            fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let g = CpuThrottle { dir, parent: v1.to_path_buf() };
            fs::write(g.dir.join("cpu.cfs_period_us"), period.to_string())?;
            fs::write(g.dir.join("cpu.cfs_quota_us"), quota.to_string())?;
            return Ok(g);
        }
        for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
            let root = Path::new(root);
            let controllers = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            if !controllers.split_whitespace().any(|c| c == "cpu") {
                continue;
            }
            fs::write(root.join("cgroup.subtree_control"), "+cpu").context("enabling the cpu controller")?;
            let dir = root.join(name);
            fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let g = CpuThrottle { dir, parent: root.to_path_buf() };
            fs::write(g.dir.join("cpu.max"), format!("{quota} {period}"))?;
            return Ok(g);
        }
        bail!("no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 cpu.max) on this host")
    }

    /// Moves process `pid` into the group; what it forks from now on
    /// starts there too.
    pub fn add(&self, pid: u32) -> Result<()> {
        fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving {pid} into {}", self.dir.display()))
    }
}

impl Drop for CpuThrottle {
    fn drop(&mut self) {
        let procs = fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines() {
            let _ = fs::write(self.parent.join("cgroup.procs"), pid);
        }
        let _ = fs::remove_dir(&self.dir);
    }
}
