//! `cargo xtask package`: the Debian package an operator installs —
//! `/usr/bin/lbagent`, the systemd unit (`packaging/lbagent.service`),
//! `/etc/default/lbagent` (its arguments; a conffile), the docs and the
//! example state file under `/usr/share/doc/lbagent/`, and maintainer
//! scripts (`packaging/debian/`): enable on the first install and start once
//! there is something to run, restart on upgrade only an agent that runs,
//! never re-enable or start what the operator disabled or stopped; remove
//! keeps the dataplane and a binary to tear it down, purge tears it down.
//! Built with `dpkg-deb` into `target/package/`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::{build, output, run};

/// Builds the package from the release binary (`debug`: the debug one, for
/// the test suite); returns the `.deb`'s path.
pub fn build(channel: &str, debug: bool) -> Result<PathBuf> {
    let root = build::root();
    let bin = if debug { root.join("target/debug/lbagent") } else { build::release(channel)? };
    let version = output(std::process::Command::new(&bin).arg("--version"))?
        .split_whitespace()
        .nth(1)
        .context("lbagent --version")?
        .to_string();
    let stage = root.join("target/package/root");
    let _ = std::fs::remove_dir_all(&stage);
    let put = |from: &Path, to: &str, mode: u32| -> Result<()> {
        let dest = stage.join(to);
        std::fs::create_dir_all(dest.parent().unwrap())?;
        std::fs::copy(from, &dest).with_context(|| format!("{} → {to}", from.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(mode))?;
        Ok(())
    };
    let pk = root.join("packaging");
    put(&bin, "usr/bin/lbagent", 0o755)?;
    put(&pk.join("lbagent.service"), "lib/systemd/system/lbagent.service", 0o644)?;
    put(&pk.join("lbagent.default"), "etc/default/lbagent", 0o644)?;
    put(&root.join("examples/state.yaml"), "usr/share/doc/lbagent/examples/state.yaml", 0o644)?;
    put(&root.join("README.md"), "usr/share/doc/lbagent/README.md", 0o644)?;
    for doc in std::fs::read_dir(root.join("docs"))?.flatten().map(|e| e.path()) {
        if doc.extension().is_some_and(|e| e == "md") {
            let name = doc.file_name().unwrap().to_string_lossy().to_string();
            put(&doc, &format!("usr/share/doc/lbagent/{name}"), 0o644)?;
        }
    }
    for script in ["postinst", "prerm", "postrm"] {
        put(&pk.join("debian").join(script), &format!("DEBIAN/{script}"), 0o755)?;
    }
    std::fs::write(stage.join("DEBIAN/conffiles"), "/etc/default/lbagent\n")?;
    let size_kb = output(std::process::Command::new("du").args(["-sk", "--exclude=DEBIAN"]).arg(&stage))?
        .split_whitespace()
        .next()
        .unwrap_or("0")
        .to_string();
    std::fs::write(
        stage.join("DEBIAN/control"),
        format!(
            "Package: lbagent\nVersion: {version}\nArchitecture: amd64\nMaintainer: lbagent developers <lbagent@localhost>\n\
             Installed-Size: {size_kb}\nDepends: libc6, iproute2, openvswitch-switch, haproxy, init-system-helpers (>= 1.54~)\nRecommends: bpftool\n\
             Section: net\nPriority: optional\n\
             Description: eBPF dataplane agent for VPC load balancers and NAT gateways\n \
             Runs VPC load balancer hosts and VPC NAT gateways with TC-attached eBPF programs\n \
             whose listener, backend, NAT and rate-limit tables live in BPF maps.\n"
        ),
    )?;
    let deb = root.join(format!("target/package/lbagent_{version}_amd64.deb"));
    run(std::process::Command::new("dpkg-deb").args(["--build", "--root-owner-group"]).arg(&stage).arg(&deb))?;
    eprintln!("xtask: built {}", deb.display());
    Ok(deb)
}
