//! The Debian package (`cargo xtask package`; `cargo xtask test` builds it
//! from the debug binary and names it in `LBAGENT_DEB`): it installs on
//! this machine, its unit passes `systemd-analyze verify`, and the agent
//! starts the way systemd starts it — the unit's `ExecStart` with the
//! arguments from `/etc/default/lbagent`, `NOTIFY_SOCKET` set — reports
//! `READY=1` once its first apply is done, and on SIGTERM (the unit's
//! `KillMode=process` stop) leaves the dataplane forwarding. Purging removes
//! every file. (This machine's PID 1 is not systemd, so `systemctl` itself
//! cannot run here; the maintainer scripts say so and skip it.)

use std::{
    os::unix::net::UnixDatagram,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use lbagent_tests::{
    bed::{HostLock, lb_id, lb_state},
    hosts::TestHost,
    ovs::OvsBridge,
    traffic::{OpenConn, ask_tcp, line_echo_server},
    unique,
};

fn deb() -> Option<PathBuf> {
    lbagent_tests::built_artifact("LBAGENT_DEB", "`cargo xtask test` builds the package; `cargo xtask package --debug`")
}

fn sh(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Purges the package (and what the test put in /etc) even when the test fails.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = Command::new("dpkg").args(["--purge", "lbagent"]).output();
        let _ = std::fs::remove_file("/etc/lbagent/state.yaml");
        let _ = std::fs::remove_dir("/etc/lbagent");
    }
}

/// The value of `key=` in the unit's [Service] section.
fn unit_value(unit: &str, key: &str) -> String {
    unit.lines().find_map(|l| l.strip_prefix(&format!("{key}="))).unwrap_or_else(|| panic!("{key} in the unit")).into()
}

#[test]
fn the_package_installs_and_the_agent_starts_as_systemd_would() {
    if !lbagent_tests::require_root() {
        return;
    }
    let Some(deb) = deb() else { return };
    let _lock = HostLock::take().unwrap();
    let (installed_before, _) = sh(Command::new("dpkg").args(["-s", "lbagent"]));
    assert!(!installed_before, "lbagent is installed on this machine; this test installs and purges it");
    let _guard = Installed;
    let (ok, out) = sh(Command::new("dpkg").arg("-i").arg(&deb));
    assert!(ok, "dpkg -i: {out}");
    for f in [
        "/usr/bin/lbagent",
        "/lib/systemd/system/lbagent.service",
        "/etc/default/lbagent",
        "/usr/share/doc/lbagent/operations.md",
        "/usr/share/doc/lbagent/examples/state.yaml",
    ] {
        assert!(Path::new(f).exists(), "{f} installed");
    }
    assert!(
        out.contains("systemd is not running") || Path::new("/run/systemd/system").exists(),
        "postinst explains how to start without systemd: {out}"
    );
    let (ok, out) = sh(Command::new("systemd-analyze").args(["verify", "/lib/systemd/system/lbagent.service"]));
    assert!(ok, "systemd-analyze verify: {out}");
    let (ok, out) =
        sh(Command::new("/usr/bin/lbagent").args(["validate", "/usr/share/doc/lbagent/examples/state.yaml"]));
    assert!(ok, "the shipped example is valid: {out}");

    // A load balancer to run, and the arguments an operator would put in
    // /etc/default/lbagent (own dirs: nothing else on this machine is touched).
    let bridge = OvsBridge::new(&unique("brp")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.63.0.10", 24, "").unwrap();
    let backend = TestHost::on(|p| bridge.add_port(p), "10.63.0.21", 24, "").unwrap();
    line_echo_server(&backend.ns.name, 9000, "b").unwrap();
    let tag = unique("lbap");
    let dir = std::env::temp_dir().join(&tag);
    std::fs::create_dir_all(&dir).unwrap();
    let bpffs = PathBuf::from("/sys/fs/bpf").join(&tag);
    std::fs::create_dir_all("/etc/lbagent").unwrap();
    std::fs::write(
        "/etc/lbagent/state.yaml",
        lb_state(
            &bridge.name,
            &lb_id(),
            63,
            ["{id: d, type: tcp, port: 9000, backend_group: g}"],
            "[{id: b, address: 10.63.0.21, port: 9000}]",
        ),
    )
    .unwrap();
    let common = format!(
        "--state-dir {} --bpffs {} --api-socket {}",
        dir.join("sd").display(),
        bpffs.display(),
        dir.join("api.sock").display()
    );
    std::fs::write(
        "/etc/default/lbagent",
        format!("LBAGENT_ARGS=\"--state /etc/lbagent/state.yaml --metrics off --repair-interval 2 {common}\"\n"),
    )
    .unwrap();

    // Start as systemd does for Type=notify: ExecStart with the
    // EnvironmentFile's variables, NOTIFY_SOCKET set.
    let unit = std::fs::read_to_string("/lib/systemd/system/lbagent.service").unwrap();
    assert_eq!(unit_value(&unit, "Type"), "notify");
    assert_eq!(unit_value(&unit, "KillMode"), "process");
    assert_eq!(unit_value(&unit, "Restart"), "always");
    let exec = unit_value(&unit, "ExecStart");
    let defaults = std::fs::read_to_string("/etc/default/lbagent").unwrap();
    let args = defaults.lines().find_map(|l| l.strip_prefix("LBAGENT_ARGS=")).unwrap().trim_matches('"');
    let exec = exec.replace("$LBAGENT_ARGS", args);
    let mut words = exec.split_whitespace();
    let notify_path = dir.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(60) * lbagent_tests::slowdown())).unwrap();
    let mut agent = Command::new(words.next().unwrap())
        .args(words)
        .env("NOTIFY_SOCKET", &notify_path)
        .stderr(std::fs::File::create(dir.join("agent.log")).unwrap())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 256];
    let n = notify.recv(&mut buf).expect("READY=1 from the agent");
    let msg = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(msg.starts_with("READY=1") && msg.contains("STATUS=applied"), "{msg}");
    // Ready means applied: the listener serves at once.
    let vip: std::net::SocketAddr = "10.63.0.5:9000".parse().unwrap();
    assert!(ask_tcp(&client.ns.name, vip).unwrap().starts_with("b "));
    let open = OpenConn::open(&client.ns.name, vip).unwrap();
    assert!(open.ping("1").unwrap().starts_with("b "));

    // systemctl stop (KillMode=process): SIGTERM to the agent only.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(agent.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let n = notify.recv(&mut buf).expect("STOPPING=1 from the agent");
    assert_eq!(&buf[..n], b"STOPPING=1");
    assert!(agent.wait().unwrap().success(), "a clean stop");
    assert!(open.ping("2").unwrap().starts_with("b "), "the dataplane outlives the stopped agent");
    assert!(ask_tcp(&client.ns.name, vip).unwrap().starts_with("b "));

    // Teardown, then purge: nothing left.
    let (ok, out) = sh(Command::new("/usr/bin/lbagent").arg("teardown").args(common.split_whitespace()));
    assert!(ok, "teardown: {out}");
    let (ok, out) = sh(Command::new("dpkg").args(["--purge", "lbagent"]));
    assert!(ok, "dpkg --purge: {out}");
    for f in
        ["/usr/bin/lbagent", "/lib/systemd/system/lbagent.service", "/etc/default/lbagent", "/usr/share/doc/lbagent"]
    {
        assert!(!Path::new(f).exists(), "{f} removed by the purge");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
