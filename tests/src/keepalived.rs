//! Real keepalived (VRRP) as an HA pair's arbiter: two network namespaces
//! joined by a veth pair (the pair's management link), one keepalived in
//! each, unicast adverts every 100 ms, each one's priority adjusted by its
//! agent's `ha-priority` file (`track_file`), its notify scripts running
//! `lbagent ha promote|demote` on its agent. Killed and removed on drop.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use anyhow::{Context, Result};

use crate::net::{Netns, sh};

/// Whether keepalived is installed; under `CI=true` a missing one fails the
/// test (`cargo xtask setup` installs it).
pub fn available() -> bool {
    let have = Command::new("keepalived").arg("--version").output().is_ok();
    if !have {
        assert!(std::env::var_os("CI").is_none_or(|v| v != "true"), "keepalived is missing under CI");
        eprintln!("skipped: keepalived is not installed (cargo xtask setup installs it)");
    }
    have
}

/// One host's keepalived, in its management namespace.
pub struct Keepalived {
    pub ns: Netns,
    pub ip: String,
    dir: PathBuf,
    child: Option<Child>,
}

/// What one keepalived drives: its agent (`lbagent` binary, API socket)
/// and the file its agent keeps its priority adjustment in.
pub struct Drives<'a> {
    pub lbagent: &'a Path,
    pub api_socket: &'a Path,
    pub priority_file: &'a Path,
}

impl Keepalived {
    /// Two management namespaces linked by a veth pair (10.254.<n>.1 and
    /// .2/24), each with its keepalived driving `drives[i]`.
    pub fn pair(vrid: u8, drives: [Drives; 2]) -> Result<[Keepalived; 2]> {
        let names = [crate::unique("lbka"), crate::unique("lbkb")];
        let (va, vb) = (crate::unique("kva"), crate::unique("kvb"));
        let nss = [Netns::new(&names[0])?, Netns::new(&names[1])?];
        sh(&["ip", "link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        let ips = [format!("10.254.{vrid}.1"), format!("10.254.{vrid}.2")];
        let mut out = Vec::new();
        for (i, (ns, link)) in nss.into_iter().zip([&va, &vb]).enumerate() {
            sh(&["ip", "link", "set", link, "netns", &ns.name])?;
            ns.exec(&["ip", "addr", "add", &format!("{}/24", ips[i]), "dev", link])?;
            ns.exec(&["ip", "link", "set", link, "up"])?;
            let dir = std::env::temp_dir().join(crate::unique("keepalived"));
            std::fs::create_dir_all(&dir)?;
            let d = &drives[i];
            let run =
                |what: &str| format!("\"{} ha {what} --api-socket {}\"", d.lbagent.display(), d.api_socket.display());
            let conf = format!(
                "global_defs {{\n  router_id lbha{i}\n  script_user root\n  enable_script_security\n  vrrp_version 3\n  max_auto_priority -1\n}}\n\
                 track_file lbagent_role {{\n  file {}\n  weight 1\n}}\n\
                 vrrp_instance lbha {{\n  state BACKUP\n  interface {link}\n  virtual_router_id {vrid}\n  priority 100\n  advert_int 0.1\n\
                 \x20 unicast_src_ip {}\n  unicast_peer {{\n    {}\n  }}\n  virtual_ipaddress {{\n    10.254.{vrid}.100/32\n  }}\n\
                 \x20 track_file {{\n    lbagent_role\n  }}\n  notify_master {}\n  notify_backup {}\n  notify_fault {}\n}}\n",
                d.priority_file.display(),
                ips[i],
                ips[1 - i],
                run("promote"),
                run("demote"),
                run("demote"),
            );
            std::fs::write(dir.join("keepalived.conf"), conf)?;
            let log = std::fs::File::create(dir.join("log"))?;
            let child = Command::new("ip")
                .args(["netns", "exec", &ns.name, "keepalived", "-n", "-l", "-D", "--vrrp", "-f"])
                .arg(dir.join("keepalived.conf"))
                .arg("-p")
                .arg(dir.join("keepalived.pid"))
                .arg("-r")
                .arg(dir.join("vrrp.pid"))
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .context("starting keepalived")?;
            out.push(Keepalived { ns, ip: ips[i].clone(), dir, child: Some(child) });
        }
        let [a, b]: [Keepalived; 2] = out.try_into().map_err(|_| anyhow::anyhow!("two"))?;
        Ok([a, b])
    }

    /// Kills it (SIGKILL: a host's death; no advert says it is leaving).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // `ip netns exec` execs keepalived: the child is keepalived's
            // parent process; its VRRP child goes with it on SIGKILL of
            // the process group's leader only if told, so kill by pid file.
            if let Ok(pid) = std::fs::read_to_string(self.dir.join("vrrp.pid")) {
                let _ = sh(&["kill", "-9", pid.trim()]);
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Its log (states entered, scripts run).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }
}

impl Drop for Keepalived {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
