//! The Debian package (`cargo xtask package`; `cargo xtask test` builds it
//! from the debug binary and names it in `LBAGENT_DEB`).
//!
//! - On this machine, whose PID 1 is not systemd: it installs, its
//!   maintainer scripts say how to start the agent without systemd, the
//!   unit passes `systemd-analyze verify` without a warning, its exposure
//!   (`systemd-analyze security`) stays at or under the level it was
//!   hardened to, and purging removes every file.
//! - Under systemd as PID 1: a container (`systemd-nspawn --boot`) of this
//!   machine's own root, copy-on-write over a tmpfs, sharing the host's
//!   network namespace, Open vSwitch and a bpffs directory of its own. Its
//!   dpkg and systemd run the package for real, the agent inside the unit's
//!   sandbox (capability bounding set, syscall filter): install in fleet
//!   mode with no document yet (dpkg returns, the unit is active and
//!   waiting), reload and stop while waiting, upgrades that leave a stopped
//!   or disabled unit stopped and restart a running one, a document from
//!   etcd, the state file with `systemctl reload`, a stop that keeps the
//!   dataplane forwarding, remove (dataplane kept, a teardown binary kept)
//!   and purge (dataplane torn down). ~60 s.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use lbagent_tests::{
    bed::HostLock,
    etcd::{self, Etcd},
    hosts::TestHost,
    lbagent_bin,
    ovs::OvsBridge,
    traffic::{OpenConn, ask_tcp, http_get, http_server, line_echo_server},
    unique, wait_for,
};

fn deb() -> Option<PathBuf> {
    lbagent_tests::built_artifact("LBAGENT_DEB", "`cargo xtask test` builds the package; `cargo xtask package --debug`")
}

fn sh(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The exposure `systemd-analyze security` gives the shipped unit (0 best,
/// 10 worst); it was 7.1 before the unit dropped `CAP_SYS_PTRACE` and the
/// capabilities the agent never uses and got its syscall filter.
const EXPOSURE_AT_MOST: f64 = 5.0;

/// Purges the package (and what the test put in /etc) even when the test fails.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = Command::new("dpkg").args(["--purge", "lbagent"]).output();
    }
}

#[test]
fn the_package_installs_verifies_and_purges_without_systemd() {
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
    if !Path::new("/run/systemd/system").exists() {
        assert!(out.contains("systemd is not running"), "postinst explains how to start without systemd: {out}");
    }
    let (ok, out) = sh(Command::new("systemd-analyze").args(["verify", "/lib/systemd/system/lbagent.service"]));
    assert!(ok && out.trim().is_empty(), "systemd-analyze verify, not a warning: {out}");
    let (_, out) = sh(Command::new("systemd-analyze").args([
        "security",
        "--offline=true",
        "--no-pager",
        "/lib/systemd/system/lbagent.service",
    ]));
    let exposure: f64 = out
        .lines()
        .find_map(|l| l.split_once("Overall exposure level for lbagent.service:"))
        .and_then(|(_, v)| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in: {out}"));
    eprintln!("systemd-analyze security: exposure {exposure}");
    assert!(exposure <= EXPOSURE_AT_MOST, "exposure {exposure} > {EXPOSURE_AT_MOST}:\n{out}");
    let (ok, out) =
        sh(Command::new("/usr/bin/lbagent").args(["validate", "/usr/share/doc/lbagent/examples/state.yaml"]));
    assert!(ok, "the shipped example is valid: {out}");

    let (ok, out) = sh(Command::new("dpkg").args(["--purge", "lbagent"]));
    assert!(ok, "dpkg --purge: {out}");
    for f in
        ["/usr/bin/lbagent", "/lib/systemd/system/lbagent.service", "/etc/default/lbagent", "/usr/share/doc/lbagent"]
    {
        assert!(!Path::new(f).exists(), "{f} removed by the purge");
    }
}

/// Units of this machine that must not start in the container: they would
/// take the ports, the Open vSwitch database or the interfaces of the host
/// whose network namespace the container shares.
const MASKED: &[&str] = &[
    "openvswitch-switch.service",
    "ovs-vswitchd.service",
    "ovsdb-server.service",
    "ovs-record-hostname.service",
    "ovn-central.service",
    "ovn-host.service",
    "ovn-northd.service",
    "ovn-controller.service",
    "ovn-nb-ovsdb.service",
    "ovn-sb-ovsdb.service",
    "etcd.service",
    "etcd2.service",
    "haproxy.service",
    "postgresql.service",
    "networking.service",
    "systemd-networkd.service",
];

/// `systemd-nspawn` on PATH, or a failure under CI (a skip elsewhere).
fn nspawn_available() -> bool {
    let ok = Command::new("systemd-nspawn").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none_or(|v| v != "true"),
            "systemd-nspawn missing under CI (setup installs systemd-container)"
        );
        eprintln!("skipped: systemd-nspawn not installed (`cargo xtask setup`)");
    }
    ok
}

/// A container booting systemd as its PID 1 on a copy-on-write view of
/// this machine's root (`/` as an overlay's lower layer, a tmpfs upper):
/// what dpkg and systemd do inside it never reaches the host's files. It
/// shares the host's network namespace (the dataplane it builds is the
/// host's kernel's) and `/run/openvswitch`; its `/sys/fs/bpf` is a
/// directory of the host's bpffs. Stopped and removed on drop, after a
/// best-effort teardown of the agent's dataplane.
struct Container {
    name: String,
    dir: PathBuf,
    root: PathBuf,
    bpffs: PathBuf,
    nspawn: Child,
    leader: i32,
}

impl Container {
    fn boot(name: &str) -> Container {
        let dir = std::env::temp_dir().join(name);
        let fs = dir.join("fs");
        std::fs::create_dir_all(&fs).unwrap();
        let run = |args: &[&str]| {
            let (ok, out) = sh(Command::new(args[0]).args(&args[1..]));
            assert!(ok, "{args:?}: {out}");
        };
        run(&["mount", "-t", "tmpfs", "tmpfs", fs.to_str().unwrap()]);
        for d in ["upper", "work", "root"] {
            std::fs::create_dir(fs.join(d)).unwrap();
        }
        let root = fs.join("root");
        let opts = format!("lowerdir=/,upperdir={},workdir={}", fs.join("upper").display(), fs.join("work").display());
        run(&["mount", "-t", "overlay", "overlay", "-o", &opts, root.to_str().unwrap()]);
        // This machine's image forbids maintainer scripts to start services
        // (a container build's policy-rc.d); a host it is installed on has none.
        let _ = std::fs::remove_file(root.join("usr/sbin/policy-rc.d"));
        for unit in MASKED {
            let link = root.join("etc/systemd/system").join(unit);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink("/dev/null", link).unwrap();
        }
        if !sh(Command::new("mountpoint").args(["-q", "/sys/fs/bpf"])).0 {
            run(&["mount", "-t", "bpf", "bpffs", "/sys/fs/bpf"]);
        }
        let bpffs = Path::new("/sys/fs/bpf").join(name);
        std::fs::create_dir_all(&bpffs).unwrap();
        let log = std::fs::File::create(dir.join("console.log")).unwrap();
        let nspawn = Command::new("systemd-nspawn")
            .arg("--directory")
            .arg(&root)
            .args(["--boot", "--register=no", "--keep-unit", "--capability=all", "--console=pipe"])
            .args(["--machine", name])
            .arg(format!("--bind={}:/sys/fs/bpf", bpffs.display()))
            .arg("--bind=/run/openvswitch")
            // The unit's own seccomp filter is what runs the agent; nspawn's
            // (a container policy) would refuse bpf() first.
            .env("SYSTEMD_SECCOMP", "0")
            // /proc/sys/net writable, as on a host: the agent sets the
            // forwarding sysctls of the namespaces it makes.
            .env("SYSTEMD_NSPAWN_API_VFS_WRITABLE", "network")
            .args(["--", "systemd.unit=basic.target"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("systemd-nspawn");
        let mut c = Container { name: name.into(), dir, root, bpffs, nspawn, leader: 0 };
        let started = Instant::now();
        while c.leader == 0 {
            assert!(started.elapsed() < Duration::from_secs(20), "no systemd in the container: {}", c.console());
            c.leader = children(c.nspawn.id() as i32)
                .into_iter()
                .find(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|s| s.trim() == "systemd"))
                .unwrap_or(0);
            std::thread::sleep(Duration::from_millis(50));
        }
        // Until its bus socket exists, systemctl cannot reach it at all.
        let mut state = String::new();
        let booted = within(Duration::from_secs(30), || {
            state = c.sh("timeout 30 systemctl is-system-running --wait").1;
            matches!(state.trim(), "running" | "degraded")
        });
        assert!(booted, "the container's systemd did not finish booting ({state}): {}", c.console());
        assert_eq!(c.sh("cat /proc/1/comm").1.trim(), "systemd", "systemd is PID 1 in the container");
        eprintln!("container {name}: systemd booted in {:.1?}", started.elapsed());
        c
    }

    fn console(&self) -> String {
        std::fs::read_to_string(self.dir.join("console.log")).unwrap_or_default()
    }

    /// A host path for `path` inside the container.
    fn path(&self, path: &str) -> PathBuf {
        self.root.join(path.trim_start_matches('/'))
    }

    fn write(&self, path: &str, text: &str) {
        let p = self.path(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    /// `sh -c script` inside the container: (exit ok, stdout + stderr).
    fn sh(&self, script: &str) -> (bool, String) {
        sh(Command::new("nsenter")
            .args(["-t", &self.leader.to_string(), "-m", "-u", "-i", "-p", "-r", "-w", "--", "sh", "-c", script])
            .env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .env("SYSTEMD_PAGER", ""))
    }

    /// Like `sh`, failing the test (with the agent's journal) unless it succeeds.
    fn ok(&self, script: &str) -> String {
        let (ok, out) = self.sh(script);
        assert!(ok, "{script}: {out}\n--- journal:\n{}", self.journal());
        out
    }

    fn journal(&self) -> String {
        self.sh("journalctl -u lbagent --no-pager -o cat | tail -n 60").1
    }

    /// A property of the unit (`systemctl show -p`).
    fn prop(&self, p: &str) -> String {
        self.sh(&format!("systemctl show lbagent.service -p {p} --value")).1.trim().to_string()
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if self.leader != 0 {
            let _ = self.sh("timeout 30 systemctl stop lbagent.service; \
                 for b in /usr/bin/lbagent /var/lib/lbagent/lbagent; do \
                 [ -x $b ] && timeout 60 $b teardown && break; done");
        }
        let pid = nix::unistd::Pid::from_raw(self.nspawn.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let t = Instant::now();
        while self.nspawn.try_wait().ok().flatten().is_none() && t.elapsed() < Duration::from_secs(15) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.nspawn.kill();
        let _ = self.nspawn.wait();
        let fs = self.dir.join("fs");
        let _ = Command::new("umount").arg("-l").arg(&self.root).status();
        let _ = Command::new("umount").arg("-l").arg(&fs).status();
        let _ = std::fs::remove_dir(&fs);
        let _ = Command::new("rm").arg("-rf").arg(&self.bpffs).status();
        eprintln!("container {} stopped; its console log is in {}", self.name, self.dir.display());
    }
}

/// Every descendant of `pid`.
fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        for task in std::fs::read_dir(format!("/proc/{p}/task")).into_iter().flatten().flatten() {
            let kids = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for k in kids.split_whitespace().filter_map(|k| k.parse().ok()) {
                out.push(k);
                todo.push(k);
            }
        }
    }
    out
}

/// `deb` with its version changed to `version`, in `dir`.
fn repack(deb: &Path, version: &str, dir: &Path) -> PathBuf {
    let tree = dir.join(format!("tree-{version}"));
    let out = dir.join(format!("lbagent_{version}_amd64.deb"));
    let (ok, o) = sh(Command::new("dpkg-deb").arg("-R").arg(deb).arg(&tree));
    assert!(ok, "dpkg-deb -R: {o}");
    let control = tree.join("DEBIAN/control");
    let text = std::fs::read_to_string(&control).unwrap();
    let text: String = text
        .lines()
        .map(|l| if l.starts_with("Version: ") { format!("Version: {version}\n") } else { format!("{l}\n") })
        .collect();
    std::fs::write(&control, text).unwrap();
    let (ok, o) =
        sh(Command::new("dpkg-deb").args(["-Zgzip", "-z1", "--build", "--root-owner-group"]).arg(&tree).arg(&out));
    assert!(ok, "dpkg-deb --build: {o}");
    std::fs::remove_dir_all(&tree).unwrap();
    out
}

/// The load balancer: direct TCP 9000 to the line echo server, HTTP 80
/// through haproxy to the web server; `extra` adds TCP 9001 and HTTP 81
/// (haproxy reloads: its root master signals workers of another user).
fn document(bridge: &str, id: &str, extra: bool) -> String {
    let more = if extra {
        "      - {id: e, type: tcp, port: 9001, backend_group: g}\n      - {id: web2, type: http, port: 81, backend_group: w}\n"
    } else {
        ""
    };
    format!(
        "version: 1
agent: {{integration_bridge: {bridge}}}
load_balancers:
  - id: {id}
    network: {{ip: 10.63.0.5, mac: \"02:00:0a:3f:00:05\", prefix_len: 24, gateway: 10.63.0.1}}
    listeners:
      - {{id: d, type: tcp, port: 9000, backend_group: g}}
      - {{id: web, type: http, port: 80, backend_group: w}}
{more}    backend_groups:
      - {{id: g, backends: [{{id: b, address: 10.63.0.21, port: 9000}}]}}
      - {{id: w, backends: [{{id: web, address: 10.63.0.21, port: 8080}}]}}
"
    )
}

/// Waits until `f` holds, polling every 100 ms for at most `limit`.
fn within(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while !f() {
        if t.elapsed() > limit * lbagent_tests::slowdown() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    true
}

#[test]
fn the_unit_under_systemd_starts_reloads_stops_upgrades_and_purges() {
    if !lbagent_tests::require_root() {
        return;
    }
    let Some(deb) = deb() else { return };
    if !nspawn_available() || !etcd::available() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let test_started = Instant::now();
    let name = unique("lbct");
    let bridge = OvsBridge::new(&unique("brp")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.63.0.10", 24, "").unwrap();
    let backend = TestHost::on(|p| bridge.add_port(p), "10.63.0.21", 24, "").unwrap();
    line_echo_server(&backend.ns.name, 9000, "b").unwrap();
    http_server(&backend.ns.name, 8080, "w").unwrap();
    let id = lbagent_tests::bed::lb_id();
    let vip = |port: u16| std::net::SocketAddr::from(([10, 63, 0, 5], port));
    let host = format!("{name}-host");

    // etcd with mutual TLS; the host's certificate and the CA go where an
    // operator's configuration management puts them.
    let etcd = Etcd::start_tls(&name).unwrap();
    let pki = etcd.pki.as_ref().unwrap();
    pki.issue(&host, Some(etcd::CLIENT)).unwrap();
    let fleet_flags = [
        "--etcd".to_string(),
        etcd.endpoint(),
        "--etcd-ca".into(),
        pki.ca().display().to_string(),
        "--etcd-cert".into(),
        pki.cert("root").display().to_string(),
        "--etcd-key".into(),
        pki.key("root").display().to_string(),
    ];
    let scratch = std::env::temp_dir().join(format!("{name}-debs"));
    std::fs::create_dir_all(&scratch).unwrap();
    let v2 = repack(&deb, "0.1.0+2", &scratch);
    let v3 = repack(&deb, "0.1.0+3", &scratch);

    let ct = Container::boot(&name);
    std::fs::copy(&deb, ct.path("/root/lbagent_1.deb")).unwrap();
    std::fs::copy(&v2, ct.path("/root/lbagent_2.deb")).unwrap();
    std::fs::copy(&v3, ct.path("/root/lbagent_3.deb")).unwrap();
    let _ = std::fs::remove_dir_all(&scratch);
    for (from, to) in [
        (pki.ca(), "/etc/lbagent/etcd-ca.pem"),
        (pki.cert(&host), "/etc/lbagent/host.pem"),
        (pki.key(&host), "/etc/lbagent/host-key.pem"),
    ] {
        ct.write(to, &std::fs::read_to_string(from).unwrap());
    }
    let fleet_args = format!(
        "LBAGENT_ARGS=\"--etcd {} --host {host} --etcd-ca /etc/lbagent/etcd-ca.pem \
         --etcd-cert /etc/lbagent/host.pem --etcd-key /etc/lbagent/host-key.pem --metrics off --repair-interval 2\"\n",
        etcd.endpoint()
    );
    ct.write("/etc/default/lbagent", &fleet_args);

    // Installed in fleet mode before the host's first `fleet put`: dpkg
    // returns (the unit is ready without a document and says so).
    let t = Instant::now();
    let (ok, out) = ct.sh("timeout 40 dpkg --force-confold -i /root/lbagent_1.deb");
    assert!(ok, "dpkg -i in fleet mode with no document returns (in {:.1?}): {out}\n{}", t.elapsed(), ct.journal());
    eprintln!("dpkg -i in fleet mode, no document: {:.1?}", t.elapsed());
    assert_eq!(ct.prop("ActiveState"), "active", "{}", ct.journal());
    let status = ct.prop("StatusText");
    assert!(status.contains("waiting for the first desired-state document"), "{status}");
    assert_eq!(ct.sh("systemctl is-enabled lbagent").1.trim(), "enabled");

    // The sandbox is the one the unit asks for, on the running process.
    let pid = ct.prop("MainPID");
    let proc_status = ct.ok(&format!("cat /proc/{pid}/status"));
    let field = |k: &str| proc_status.lines().find_map(|l| l.strip_prefix(k)).unwrap_or_default().trim().to_string();
    assert_eq!(field("NoNewPrivs:"), "1");
    assert_eq!(field("Seccomp:"), "2", "a syscall filter is installed");
    let bounding = u64::from_str_radix(&field("CapBnd:"), 16).unwrap();
    const CAP_SYS_PTRACE: u64 = 19;
    const CAP_SYS_MODULE: u64 = 16;
    const CAP_DAC_OVERRIDE: u64 = 1;
    for cap in [CAP_SYS_PTRACE, CAP_SYS_MODULE, CAP_DAC_OVERRIDE] {
        assert_eq!(bounding & (1 << cap), 0, "capability {cap} is outside the bounding set {bounding:x}");
    }
    assert_ne!(ct.prop("MemoryMax"), "infinity");

    // Reload and stop while waiting: the agent stays (same process), then
    // stops at once on SIGTERM, not after the stop timeout.
    ct.ok("systemctl reload lbagent");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(ct.prop("MainPID"), pid, "a reload is not a restart\n{}", ct.journal());
    assert_eq!(ct.prop("ActiveState"), "active");
    let t = Instant::now();
    ct.ok("timeout 40 systemctl stop lbagent");
    let stop_took = t.elapsed();
    assert!(stop_took < Duration::from_secs(10), "stopped in {stop_took:.1?}\n{}", ct.journal());
    assert_eq!(ct.prop("Result"), "success", "a clean stop, not a timeout\n{}", ct.journal());

    // The operator stopped it: an upgrade leaves it stopped. Disabled: a
    // reinstall leaves it disabled and stopped.
    ct.ok("timeout 40 dpkg -i /root/lbagent_2.deb");
    assert_eq!(ct.prop("ActiveState"), "inactive", "an upgrade does not start a stopped agent");
    ct.ok("systemctl disable lbagent");
    ct.ok("timeout 40 dpkg -i /root/lbagent_2.deb");
    assert_eq!(ct.sh("systemctl is-enabled lbagent").1.trim(), "disabled", "a reinstall does not re-enable");
    assert_eq!(ct.prop("ActiveState"), "inactive");
    ct.ok("systemctl enable lbagent");

    // Started without a document: ready within the wait; the document put
    // afterwards is applied and the status says so.
    let t = Instant::now();
    ct.ok("timeout 40 systemctl start lbagent");
    eprintln!("systemctl start in fleet mode, no document: {:.1?}", t.elapsed());
    let doc_path = ct.dir.join("doc.yaml");
    std::fs::write(&doc_path, document(&bridge.name, &id, false)).unwrap();
    let (ok, out) = sh(Command::new(lbagent_bin())
        .arg("fleet")
        .args(&fleet_flags)
        .args(["put", &host])
        .arg(&doc_path)
        .args(["--wait", "60"]));
    assert!(ok, "fleet put: {out}\n{}", ct.journal());
    assert!(within(Duration::from_secs(10), || ct.prop("StatusText") == "applied"), "{}", ct.prop("StatusText"));
    assert!(ask_tcp(&client.ns.name, vip(9000)).unwrap().starts_with("b "));
    assert!(http_get(&client.ns.name, vip(80)).unwrap().starts_with("w "), "haproxy runs in the sandbox");

    // File mode, the same load balancer: a start returns once applied (the
    // listeners answer at once); a reload reads the changed file at once.
    ct.write("/etc/lbagent/state.yaml", &document(&bridge.name, &id, false));
    ct.write(
        "/etc/default/lbagent",
        "LBAGENT_ARGS=\"--state /etc/lbagent/state.yaml --metrics off --repair-interval 2 --ebpf-log info\"\n",
    );
    ct.ok("timeout 60 systemctl restart lbagent");
    assert_eq!(ct.prop("StatusText"), "applied", "{}", ct.journal());
    let open = OpenConn::open(&client.ns.name, vip(9000)).unwrap();
    assert!(open.ping("1").unwrap().starts_with("b "));
    let pid = ct.prop("MainPID");
    ct.write("/etc/lbagent/state.yaml", &document(&bridge.name, &id, true));
    ct.ok("systemctl reload lbagent");
    wait_for(
        || ask_tcp(&client.ns.name, vip(9001)).is_ok_and(|a| a.starts_with("b ")),
        "the listener added by a reload",
    );
    wait_for(|| http_get(&client.ns.name, vip(81)).is_ok_and(|a| a.starts_with("w ")), "haproxy reloaded");
    // The old workers (haproxy's user) are told to go by the root master:
    // one generation of workers is left (without CAP_KILL every one stays).
    let workers = || ct.sh("ps -o user= -C haproxy").1.lines().filter(|u| u.trim() != "root").count();
    assert!(
        within(Duration::from_secs(10), || workers() == 1),
        "one generation of haproxy workers after the reload: {}",
        ct.sh("ps -o pid,ppid,user,args -C haproxy").1
    );
    assert!(ct.journal().contains("SIGHUP: desired state valid"), "read on SIGHUP: {}", ct.journal());
    assert_eq!(ct.prop("MainPID"), pid);

    // A stop keeps the dataplane: the open connection and new ones go on.
    ct.ok("timeout 40 systemctl stop lbagent");
    assert_eq!(ct.prop("ActiveState"), "inactive");
    assert!(open.ping("2").unwrap().starts_with("b "), "the dataplane outlives the stopped agent");
    assert!(ask_tcp(&client.ns.name, vip(9000)).unwrap().starts_with("b "));
    assert!(http_get(&client.ns.name, vip(80)).unwrap().starts_with("w "), "haproxy outlives the stopped agent");

    // An upgrade of a running agent restarts it (the new one takes over
    // the dataplane: the connection stays).
    ct.ok("timeout 60 systemctl start lbagent");
    let pid = ct.prop("MainPID");
    let t = Instant::now();
    ct.ok("timeout 60 dpkg -i /root/lbagent_3.deb");
    eprintln!("upgrade of a running agent: {:.1?}", t.elapsed());
    assert_eq!(ct.prop("ActiveState"), "active");
    assert_ne!(ct.prop("MainPID"), pid, "the upgrade restarted the agent");
    assert_eq!(ct.prop("StatusText"), "applied");
    assert!(open.ping("3").unwrap().starts_with("b "), "the connection survives the upgrade");
    let netns = lbagent::naming::lb_netns(&id);
    assert!(ct.sh(&format!("test -e /run/netns/{netns}")).0);

    // Nothing the sandbox refused (the filter answers EPERM), nothing failed.
    let journal = ct.sh("journalctl -u lbagent --no-pager -o cat").1;
    for bad in ["Operation not permitted", "os error 1)", "Permission denied", "step failed"] {
        assert!(!journal.contains(bad), "{bad:?} in the agent's journal:\n{journal}");
    }

    // Remove: the agent stops, the dataplane stays, and a binary to tear it
    // down stays with the state until purge.
    let (ok, out) = ct.sh("timeout 60 dpkg -r lbagent");
    assert!(ok, "dpkg -r: {out}");
    assert!(out.contains("/var/lib/lbagent/lbagent teardown"), "remove says how to tear the dataplane down: {out}");
    assert!(!ct.path("/usr/bin/lbagent").exists());
    assert!(ct.sh("test -x /var/lib/lbagent/lbagent").0);
    assert_ne!(ct.prop("ActiveState"), "active");
    assert!(open.ping("4").unwrap().starts_with("b "), "remove keeps the dataplane");

    // Purge tears the dataplane down and removes what the package made.
    let (ok, out) = ct.sh("timeout 60 dpkg --purge lbagent");
    assert!(ok, "dpkg --purge: {out}");
    assert!(open.ping("5").is_err(), "the dataplane is gone after purge");
    assert!(ask_tcp(&client.ns.name, vip(9000)).is_err());
    assert!(!ct.sh(&format!("test -e /run/netns/{netns}")).0, "the load balancer's namespace is gone");
    assert!(!ct.sh("pgrep -x haproxy").0, "haproxy is gone");
    let (_, pins) = sh(Command::new("find").arg(&ct.bpffs).args(["-mindepth", "1", "-not", "-type", "d"]));
    assert!(pins.trim().is_empty(), "no pins left: {pins}");
    for f in [
        "/var/lib/lbagent",
        "/etc/default/lbagent",
        "/lib/systemd/system/lbagent.service",
        "/etc/systemd/system/multi-user.target.wants/lbagent.service",
        "/usr/share/doc/lbagent",
    ] {
        assert!(!ct.sh(&format!("test -e {f} || test -L {f}")).0, "{f} removed by the purge");
    }
    assert!(ct.path("/etc/lbagent/state.yaml").exists(), "the operator's state file stays");
    drop(open);
    drop(ct);
    eprintln!("systemd lifecycle test: {:.0?}", test_started.elapsed());
}
