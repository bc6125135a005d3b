//! Idempotent machine setup. A second run only checks and takes seconds.
//!
//! 1. the pinned toolchain from `toolchain.toml` with `rust-src`;
//! 2. bpf-linker built against that toolchain's own libLLVM (rebuilt when the
//!    LLVM major version changes, tracked by a stamp file);
//! 3. the Debian packages the tests and the demo use.

use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{build::root, output, run};

const BPF_LINKER_VERSION: &str = "0.13.0";

/// Debian packages (binary they provide, package).
const PACKAGES: &[(&str, &str)] = &[
    ("ovs-vsctl", "openvswitch-switch"),
    ("haproxy", "haproxy"),
    ("iperf3", "iperf3"),
    ("bpftool", "bpftool"),
    ("tcpdump", "tcpdump"),
    ("socat", "socat"),
    ("conntrack", "conntrack"),
    ("ethtool", "ethtool"),
    ("iptables", "iptables"),
    ("ip", "iproute2"),
    ("nft", "nftables"),
    ("ping", "iputils-ping"),
    ("nsenter", "util-linux"),
    ("ovn-northd", "ovn-central"),
    ("ovn-controller", "ovn-host"),
    // Fleet mode: etcd for its tests, protoc for the etcd client's build.
    ("etcd", "etcd-server"),
    ("etcdctl", "etcd-client"),
    ("protoc", "protobuf-compiler"),
    // The fleet tests' certificates.
    ("openssl", "openssl"),
    // The package test boots systemd as PID 1 in a container.
    ("systemd-nspawn", "systemd-container"),
    // Flow logs: the IPFIX collector the tests decode records with, and
    // the reference exporter the bench compares with (ulogd2's NFCT input
    // and IPFIX output).
    ("nfcapd", "nfdump"),
    ("ulogd", "ulogd2"),
    // HA pairs: the arbiter of file mode (VRRP) the tests drive the agents
    // with, and the reference pair (conntrackd + keepalived) of the bench.
    ("keepalived", "keepalived"),
    ("conntrackd", "conntrackd"),
];

/// Debian packages that provide no binary (a file they install, package).
const FILE_PACKAGES: &[(&str, &str)] = &[
    // The well-known types etcd-client's protos import; only recommended by
    // protobuf-compiler, and packages install without recommends here.
    ("/usr/include/google/protobuf/descriptor.proto", "libprotobuf-dev"),
];

/// The interpreter Debian's `python3-*` packages serve (a `python3` earlier
/// on PATH, pyenv's for one, would not see them).
pub const DEBIAN_PYTHON: &str = "/usr/bin/python3";

/// Python modules `cargo xtask bench` draws its plots with (module, package).
const PYTHON_MODULES: &[(&str, &str)] = &[("matplotlib", "python3-matplotlib")];

/// Installs what is missing; returns the pinned channel every build uses.
pub fn ensure_all() -> Result<String> {
    let channel = pinned_channel()?;
    ensure_toolchain(&channel)?;
    ensure_bpf_linker(&channel)?;
    ensure_packages()?;
    Ok(channel)
}

/// Reads `channel = "…"` from toolchain.toml.
pub fn pinned_channel() -> Result<String> {
    let text = fs::read_to_string(root().join("toolchain.toml"))?;
    parse_channel(&text).context("toolchain.toml has no channel")
}

fn parse_channel(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("channel"))
        .filter_map(|rest| rest.trim().strip_prefix('='))
        .map(|v| v.trim().trim_matches('"').to_string())
        .next()
}

fn ensure_toolchain(channel: &str) -> Result<()> {
    let list = output(Command::new("rustup").args(["toolchain", "list"]))?;
    let components = output(Command::new("rustup").args(["component", "list", "--installed", "--toolchain", channel]))
        .unwrap_or_default();
    if list.lines().any(|l| l.starts_with(channel)) && components.lines().any(|l| l.starts_with("rust-src")) {
        return Ok(());
    }
    eprintln!("setup: installing toolchain {channel} with rust-src");
    run(Command::new("rustup").args([
        "toolchain",
        "install",
        channel,
        "--profile",
        "minimal",
        "-c",
        "rust-src",
        "-c",
        "clippy",
        "-c",
        "rustfmt",
    ]))
}

/// Sysroot `lib/` of the pinned toolchain and the LLVM major of its rustc.
fn toolchain_llvm(channel: &str) -> Result<(PathBuf, String)> {
    let sysroot = output(Command::new("rustc").arg(format!("+{channel}")).args(["--print", "sysroot"]))?;
    let vv = output(Command::new("rustc").arg(format!("+{channel}")).arg("-vV"))?;
    let major = llvm_major(&vv).context("rustc -vV shows no LLVM version")?;
    Ok((PathBuf::from(sysroot.trim()).join("lib"), major))
}

fn llvm_major(rustc_vv: &str) -> Option<String> {
    let ver = rustc_vv.lines().find_map(|l| l.strip_prefix("LLVM version: "))?;
    Some(ver.split('.').next()?.trim().to_string())
}

fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap_or("/root".into())).join(".cargo"))
}

fn ensure_bpf_linker(channel: &str) -> Result<()> {
    let (lib, major) = toolchain_llvm(channel)?;
    let stamp = cargo_home().join("lbagent-bpf-linker.stamp");
    let want = format!("bpf-linker {BPF_LINKER_VERSION} llvm-{major} {channel}\n");
    let have = fs::read_to_string(&stamp).unwrap_or_default();
    if have == want && cargo_home().join("bin/bpf-linker").exists() {
        return Ok(());
    }
    eprintln!("setup: building bpf-linker {BPF_LINKER_VERSION} against {channel}'s LLVM {major} (~70 s)");
    let prefix = llvm_prefix(&lib, channel)?;
    run(Command::new("cargo")
        .arg(format!("+{channel}"))
        .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION, "--force", "--no-default-features"])
        .args(["--features", &format!("llvm-{major}")])
        .env("LLVM_PREFIX", &prefix))?;
    fs::write(&stamp, want)?;
    Ok(())
}

/// A prefix whose `lib/` holds `libLLVM.so` and the SONAME file name, both
/// pointing at the toolchain's own libLLVM.
fn llvm_prefix(toolchain_lib: &Path, channel: &str) -> Result<PathBuf> {
    let prefix =
        PathBuf::from(std::env::var("HOME").unwrap_or("/root".into())).join(".cache/lbagent/llvm-prefix").join(channel);
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib)?;
    let mut found = None;
    for entry in fs::read_dir(toolchain_lib)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with("libLLVM") && name.contains(".so") {
            let target = toolchain_lib.join(&name);
            let link = lib.join(&name);
            let _ = fs::remove_file(&link);
            symlink(&target, &link)?;
            // Prefer the SONAME file (libLLVM.so.<ver>…) as the target of libLLVM.so.
            if name.starts_with("libLLVM.so.") || found.is_none() {
                found = Some(target);
            }
        }
    }
    let Some(target) = found else { bail!("no libLLVM*.so in {}", toolchain_lib.display()) };
    let plain = lib.join("libLLVM.so");
    let _ = fs::remove_file(&plain);
    symlink(target, plain)?;
    Ok(prefix)
}

fn ensure_packages() -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(bin, _)| {
            !Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {bin} >/dev/null"))
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        })
        .map(|(_, pkg)| *pkg)
        .chain(FILE_PACKAGES.iter().filter(|(file, _)| !Path::new(file).exists()).map(|(_, pkg)| *pkg))
        .chain(
            PYTHON_MODULES
                .iter()
                .filter(|(module, _)| {
                    !Command::new(DEBIAN_PYTHON)
                        .args(["-c", &format!("import {module}")])
                        .stderr(std::process::Stdio::null())
                        .status()
                        .map(|s| s.success())
                        .unwrap_or(false)
                })
                .map(|(_, pkg)| *pkg),
        )
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("setup: installing Debian packages: {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

/// What `cargo xtask vm-test` boots guests with: QEMU and busybox from
/// Debian, virtme-ng from PyPI (with the `python3` on PATH; Debian has no
/// package of it in bookworm).
pub fn ensure_vm_tools() -> Result<()> {
    let has = |bin: &str| {
        Command::new("sh").arg("-c").arg(format!("command -v {bin} >/dev/null")).status().is_ok_and(|s| s.success())
    };
    let missing: Vec<&str> = [("qemu-system-x86_64", "qemu-system-x86"), ("busybox", "busybox-static")]
        .iter()
        .filter(|(bin, _)| !has(bin))
        .map(|(_, pkg)| *pkg)
        .collect();
    if !missing.is_empty() {
        eprintln!("setup: installing Debian packages: {}", missing.join(" "));
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        run(Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    if !has("vng") {
        eprintln!("setup: installing virtme-ng (pip)");
        let plain = Command::new("python3").args(["-m", "pip", "install", "--quiet", "virtme-ng"]).status();
        if !plain.is_ok_and(|s| s.success()) {
            // A Debian-managed python3 refuses plain pip installs (PEP 668).
            run(Command::new("python3").args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--break-system-packages",
                "virtme-ng",
            ]))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_channel_and_llvm_major() {
        assert_eq!(
            parse_channel("[toolchain]\nchannel = \"nightly-2026-10-29\"\n").as_deref(),
            Some("nightly-2026-10-29")
        );
        let vv = "rustc 1.101.0-nightly\nbinary: rustc\nLLVM version: 23.1.4\n";
        assert_eq!(llvm_major(vv).as_deref(), Some("23"));
        assert_eq!(llvm_major("rustc 1.0"), None);
    }
}
