//! The proxy guard: a load balancer's inner address (where the engine DNATs
//! mapped ports to the tenant's VPC backends) is reachable from the host
//! only for haproxy's workers and root, never for another process on the
//! host. Real haproxy, a real unprivileged process (`setpriv`), a backend
//! that records everything it receives.

use std::{
    io::{BufRead, BufReader, Write},
    net::{TcpListener, UdpSocket},
    process::Command,
    sync::{Arc, Mutex},
    time::Duration,
};

use lbagent::naming;
use lbagent_tests::{
    bed::{Bed, HostLock, lb_id, lb_state},
    hosts::TestHost,
    ovs::OvsBridge,
    require_root,
    traffic::ask_tcp,
    unique, wait_for,
};

/// A uid no account of the host has: an unprivileged process.
const STRANGER: &str = "4242";

/// Everything the backend at `port` receives (TCP lines, UDP datagrams);
/// each is answered with `b <what>`.
fn recording_backend(ns: &str, port: u16) -> Arc<Mutex<Vec<String>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (tcp, udp) = lbagent::netns::run_in(Some(ns), || {
        Ok((TcpListener::bind(("0.0.0.0", port))?, UdpSocket::bind(("0.0.0.0", port))?))
    })
    .unwrap();
    let s = seen.clone();
    std::thread::spawn(move || {
        for c in tcp.incoming().flatten() {
            let s = s.clone();
            std::thread::spawn(move || {
                let mut w = c.try_clone().unwrap();
                for line in BufReader::new(c).lines().map_while(Result::ok) {
                    s.lock().unwrap().push(format!("tcp {line}"));
                    let _ = w.write_all(format!("b {line}\n").as_bytes());
                }
            });
        }
    });
    let s = seen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((n, peer)) = udp.recv_from(&mut buf) {
            let text = String::from_utf8_lossy(&buf[..n]).trim().to_string();
            s.lock().unwrap().push(format!("udp {text}"));
            let _ = udp.send_to(format!("b {text}\n").as_bytes(), peer);
        }
    });
    seen
}

/// `bash -c script` in the host namespace, as `uid` (`None` = root); its
/// stdout, or `None` when it failed.
fn host_sh(uid: Option<&str>, script: &str) -> Option<String> {
    let mut c = match uid {
        Some(uid) => {
            let mut c = Command::new("setpriv");
            c.args([&format!("--reuid={uid}"), &format!("--regid={uid}"), "--clear-groups", "--"]);
            c.arg("bash");
            c
        }
        None => Command::new("bash"),
    };
    let out = c.args(["-c", &format!("timeout 4 bash -c '{script}'")]).output().expect("running bash");
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn only_haproxy_reaches_the_inner_address() {
    only_haproxy_reaches(Bed::new);
}

/// The same with netlink clsact filters (kernels before 6.6).
#[test]
fn only_haproxy_reaches_the_inner_address_netlink() {
    only_haproxy_reaches(|| Bed::with_attach(lbagent::dataplane::attach::AttachMode::Netlink));
}

fn only_haproxy_reaches(bed: impl FnOnce() -> anyhow::Result<Bed>) {
    if !require_root() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let bridge = OvsBridge::new(&unique("brg")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.63.0.10", 24, "").unwrap();
    let backend = TestHost::on(|p| bridge.add_port(p), "10.63.0.21", 24, "").unwrap();
    let seen = recording_backend(&backend.ns.name, 7070);
    let mut bed = bed().unwrap();
    let id = lb_id();
    bed.apply(&lb_state(
        &bridge.name,
        &id,
        63,
        ["{id: p, type: tcp, port: 7000, backend_group: g, mode: proxy}"],
        "[{id: b, address: 10.63.0.21, port: 7070}]",
    ));
    lbagent_tests::net::dataplane_offloads_all(&naming::lb_netns(&id)).unwrap();

    // haproxy serves the client through the VIP.
    let vip = "10.63.0.5:7000".parse().unwrap();
    wait_for(|| ask_tcp(&client.ns.name, vip).is_ok_and(|a| a == "b hello"), "the proxy listener serves");
    for _ in 0..4 {
        assert_eq!(ask_tcp(&client.ns.name, vip).unwrap(), "b hello");
    }
    let tables = bed.reconciler.realizer.engine.tables().unwrap();
    // (The map is there once the guard is: the last assertion needs it.)
    assert_eq!(tables.proxy_guard_drops().unwrap_or(0), 0, "nothing of haproxy's (or the kernel's) was dropped");

    let a = &bed.reconciler.alloc.lbs[&id];
    let (inner, port) = (a.inner, a.ports["b"]);
    let tcp =
        |word: &str| format!("exec 3<>/dev/tcp/{inner}/{port} && echo {word} >&3 && read -t 2 l <&3 && echo \"$l\"");
    let udp = |word: &str| format!("for i in 1 2 3; do echo {word} > /dev/udp/{inner}/{port}; done");

    // Another uid on the host: no TCP connection, no UDP datagram.
    assert_eq!(host_sh(Some(STRANGER), &tcp("pivot-tcp")), None, "an unprivileged process connected");
    host_sh(Some(STRANGER), &udp("pivot-udp"));
    // Root is trusted (it can enter the namespace anyway): the path is real.
    assert_eq!(host_sh(None, &tcp("root-tcp")).as_deref(), Some("b root-tcp"));
    host_sh(None, &udp("root-udp"));
    wait_for(|| seen.lock().unwrap().iter().any(|s| s == "udp root-udp"), "root's datagram at the backend");
    std::thread::sleep(Duration::from_millis(500));
    let seen = seen.lock().unwrap().clone();
    assert!(seen.iter().all(|s| !s.contains("pivot")), "the backend got the unprivileged process's traffic: {seen:?}");
    assert!(tables.proxy_guard_drops().unwrap() > 0, "the guard counted its drops");
    // And haproxy still serves.
    assert_eq!(ask_tcp(&client.ns.name, vip).unwrap(), "b hello");

    // The guard goes with the load balancer (a tcx link's pin too).
    let (_, h1) = naming::lb_host_veth(&id);
    let links = lbagent::dataplane::pins::links_dir(&bed.reconciler.realizer.engine.bpffs);
    let pinned = || {
        std::fs::read_dir(&links)
            .map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().contains(&h1)))
            .unwrap_or(false)
    };
    if bed.reconciler.realizer.engine.mode.resolve() == lbagent::dataplane::attach::AttachMode::Tcx {
        assert!(pinned(), "the guard's link is pinned under {}", links.display());
    }
    bed.apply(&format!("version: 1\nagent: {{integration_bridge: {}}}\n", bridge.name));
    assert!(!pinned(), "the guard's link outlived its load balancer");
}

/// An agent of a build without the guard (the previous release) runs a
/// proxy-mode listener; this build's first apply after the upgrade attaches
/// the guard (the repair interval is too long to do it instead).
#[test]
fn the_first_apply_after_an_upgrade_attaches_the_guard() {
    use lbagent_tests::agent::{AgentDirs, applied};
    if !require_root() {
        return;
    }
    let Some(previous) = lbagent_tests::previous_lbagent_bin() else { return };
    let _lock = HostLock::take().unwrap();
    let bridge = OvsBridge::new(&unique("brg")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.64.0.10", 24, "").unwrap();
    let backend = TestHost::on(|p| bridge.add_port(p), "10.64.0.21", 24, "").unwrap();
    let seen = recording_backend(&backend.ns.name, 7070);
    let dirs = AgentDirs::new("lbag");
    let id = lb_id();
    let state = dirs.path("state.yaml");
    std::fs::write(
        &state,
        lb_state(
            &bridge.name,
            &id,
            64,
            ["{id: p, type: tcp, port: 7000, backend_group: g, mode: proxy}"],
            "[{id: b, address: 10.64.0.21, port: 7070}]",
        ),
    )
    .unwrap();
    let args: Vec<String> =
        ["--state", state.to_str().unwrap(), "--repair-interval", "600"].into_iter().map(String::from).collect();
    let vip = "10.64.0.5:7000".parse().unwrap();
    let mut old = dirs.spawn(&previous, &args, "previous.log");
    let t = std::time::Instant::now();
    while !dirs.status_by(&previous).is_some_and(|s| applied(&s)) {
        assert!(t.elapsed() < Duration::from_secs(30), "the previous agent never applied:\n{}", old.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    wait_for(|| ask_tcp(&client.ns.name, vip).is_ok_and(|a| a == "b hello"), "the proxy listener serves");
    let status = dirs.status_by(&previous).unwrap();
    let lb = &status["load_balancers"][0];
    let inner = lb["inner"].as_str().unwrap().to_string();
    let port = lb["backends"][0]["mapped_port"].as_u64().unwrap();
    assert!(old.stop(), "the previous agent stopped cleanly:\n{}", old.log());

    let new = dirs.spawn(&lbagent_tests::lbagent_bin(), &args, "current.log");
    wait_for(|| dirs.status().is_some_and(|s| applied(&s)), "this build applied");
    assert!(dirs.cli(&["maps", "proxy_guard"]).contains("opens allowed for root and uid"), "{}", new.log());
    assert_eq!(ask_tcp(&client.ns.name, vip).unwrap(), "b hello", "haproxy serves through the guard");
    let script = format!("exec 3<>/dev/tcp/{inner}/{port} && echo pivot-tcp >&3 && read -t 2 l <&3 && echo \"$l\"");
    assert_eq!(host_sh(Some(STRANGER), &script), None, "an unprivileged process connected after the upgrade");
    assert!(seen.lock().unwrap().iter().all(|s| !s.contains("pivot")));
    drop(new);
}
