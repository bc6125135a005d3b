//! Real keepalived (VRRP) as an HA pair's arbiter. [`Keepalived::agent_pair`]:
//! two network namespaces joined by a veth pair (the pair's management
//! link), one keepalived in each, unicast adverts every `advert` seconds,
//! each one's priority adjusted by its agent's `ha-priority` file
//! (`track_file`), its notify scripts running `lbagent ha promote|demote`
//! on its agent. [`Keepalived::start`] runs any configuration in any
//! namespace (the bench's iptables + conntrackd reference). Killed and
//! removed on drop.

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

/// One keepalived process.
pub struct Keepalived {
    /// Its management namespace, when [`Keepalived::agent_pair`] made one.
    pub ns: Option<Netns>,
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
    /// keepalived with configuration `conf` in namespace `ns`.
    pub fn start(ns: &str, conf: &str) -> Result<Keepalived> {
        let dir = std::env::temp_dir().join(crate::unique("keepalived"));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("keepalived.conf"), conf)?;
        let log = std::fs::File::create(dir.join("log"))?;
        let child = Command::new("ip")
            .args(["netns", "exec", ns, "keepalived", "-n", "-l", "-D", "--vrrp", "-f"])
            .arg(dir.join("keepalived.conf"))
            .arg("-p")
            .arg(dir.join("keepalived.pid"))
            .arg("-r")
            .arg(dir.join("vrrp.pid"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting keepalived")?;
        Ok(Keepalived { ns: None, dir, child: Some(child) })
    }

    /// Two management namespaces linked by a veth pair (10.254.<vrid>.1
    /// and .2/24), each with its keepalived driving `drives[i]`, adverts
    /// every `advert` seconds.
    pub fn agent_pair(vrid: u8, advert: f64, drives: [Drives; 2]) -> Result<[Keepalived; 2]> {
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
            let d = &drives[i];
            let run =
                |what: &str| format!("\"{} ha {what} --api-socket {}\"", d.lbagent.display(), d.api_socket.display());
            let conf = format!(
                "global_defs {{\n  router_id lbha{i}\n  script_user root\n  enable_script_security\n  vrrp_version 3\n  max_auto_priority -1\n}}\n\
                 track_file lbagent_role {{\n  file {}\n  weight 1\n}}\n\
                 vrrp_instance lbha {{\n  state BACKUP\n  interface {link}\n  virtual_router_id {vrid}\n  priority 100\n  advert_int {advert}\n\
                 \x20 unicast_src_ip {}\n  unicast_peer {{\n    {}\n  }}\n  virtual_ipaddress {{\n    10.254.{vrid}.100/32\n  }}\n\
                 \x20 track_file {{\n    lbagent_role\n  }}\n  notify_master {}\n  notify_backup {}\n  notify_fault {}\n}}\n",
                d.priority_file.display(),
                ips[i],
                ips[1 - i],
                run("promote"),
                run("demote"),
                run("demote"),
            );
            let mut k = Keepalived::start(&ns.name, &conf)?;
            k.ns = Some(ns);
            out.push(k);
        }
        let [a, b]: [Keepalived; 2] = out.try_into().map_err(|_| anyhow::anyhow!("two"))?;
        Ok([a, b])
    }

    /// Kills it with `signal` (`-9`: a host's death, no advert says it is
    /// leaving; `-TERM`: a clean stop, its last advert gives the role
    /// away).
    pub fn stop_with(&mut self, signal: &str) {
        if let Some(mut c) = self.child.take() {
            // The VRRP child first (its pid file), then the parent.
            if let Ok(pid) = std::fs::read_to_string(self.dir.join("vrrp.pid")) {
                let _ = sh(&["kill", signal, pid.trim()]);
            }
            if let Ok(pid) = std::fs::read_to_string(self.dir.join("keepalived.pid")) {
                let _ = sh(&["kill", signal, pid.trim()]);
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        self.stop_with("-9");
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
