//! Fleet mode with a real etcd (Debian's `etcd-server`, on free loopback
//! ports): two agents on one machine (separate state dirs, bpffs dirs,
//! namespaces) follow their own keys; a refused document shows its problems
//! in the host's status and changes nothing; etcd restarted mid-run loses no
//! traffic and the agent resumes; an agent restarted while etcd is down
//! applies its cached document; a compaction during an outage forces a
//! clean re-read.

use std::{
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;

use lbagent_tests::{
    agent::{AgentDirs, AgentProcess},
    bed::{HostLock, lb_id, lb_state},
    etcd::{self, Etcd},
    hosts::TestHost,
    lbagent_bin,
    ovs::OvsBridge,
    traffic::{OpenConn, ask_tcp, line_echo_server},
    unique, wait_for,
};

/// One agent in fleet mode: its own state dir, bpffs dir and API socket
/// (`dirs`), and its process while it runs (dropped first).
struct Agent {
    host: String,
    process: Option<AgentProcess>,
    dirs: AgentDirs,
}

impl std::ops::Deref for Agent {
    type Target = AgentDirs;
    fn deref(&self) -> &AgentDirs {
        &self.dirs
    }
}

impl Agent {
    fn new(host: &str) -> Agent {
        Agent { host: host.into(), process: None, dirs: AgentDirs::new("lbaf") }
    }
    /// Against a plain-HTTP etcd (`--etcd-insecure`).
    fn start(&mut self, etcd: &str) {
        self.start_with(etcd, &["--etcd-insecure".into()]);
    }
    /// With extra flags (TLS).
    fn start_with(&mut self, etcd: &str, extra: &[String]) {
        let args: Vec<String> = ["--etcd", etcd, "--host", &self.host, "--repair-interval", "2", "--metrics", "off"]
            .into_iter()
            .map(String::from)
            .chain(extra.iter().cloned())
            .collect();
        self.process = Some(self.dirs.spawn(&lbagent_bin(), &args, "agent.log"));
    }
    fn signal(&self, sig: nix::sys::signal::Signal) {
        self.process.as_ref().expect("running").signal(sig);
    }
    fn kill(&mut self) {
        self.process = None;
    }
    fn log(&self) -> String {
        std::fs::read_to_string(self.path("agent.log")).unwrap_or_default()
    }
    fn lbs(&self) -> usize {
        self.status().and_then(|s| s["load_balancers"].as_array().map(Vec::len)).unwrap_or(usize::MAX)
    }
}

/// `lbagent fleet …` against a plain-HTTP `etcd`: (exit ok, stdout, stderr).
fn fleet(etcd: &str, args: &[&str]) -> (bool, String, String) {
    fleet_as(etcd, &["--etcd-insecure".into()], args)
}

/// `lbagent fleet …` with extra flags (TLS identity).
fn fleet_as(etcd: &str, extra: &[String], args: &[&str]) -> (bool, String, String) {
    let out = Command::new(lbagent_bin()).args(["fleet", "--etcd", etcd]).args(extra).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// The revision `fleet get` prints on stderr (beside any warning).
fn revision_line(stderr: &str) -> String {
    stderr.lines().find_map(|l| l.strip_prefix("revision ")).unwrap_or_else(|| panic!("no revision in {stderr}")).into()
}

fn host_status(etcd: &Etcd, host: &str) -> Option<Value> {
    let (ok, out, _) = fleet(&etcd.endpoint(), &["status", host, "--json"]);
    ok.then(|| serde_json::from_str::<Value>(&out).ok()?.get(host).cloned()).flatten()
}

/// A load balancer with direct TCP listeners on `ports` in front of one backend.
fn document(bridge: &str, id: &str, ports: &[u16]) -> String {
    let listeners = ports.iter().map(|p| format!("{{id: l{p}, type: tcp, port: {p}, backend_group: g}}"));
    lb_state(bridge, id, 62, listeners, "[{id: b, address: 10.62.0.21, port: 9000}]")
}

fn put(etcd: &Etcd, host: &str, dir: &std::path::Path, doc: &str, wait: bool) -> (bool, String, String) {
    let file = dir.join(format!("{}.yaml", unique("doc")));
    std::fs::write(&file, doc).unwrap();
    let mut args = vec!["put", host, file.to_str().unwrap()];
    if wait {
        args.extend(["--wait", "120"]);
    }
    fleet(&etcd.endpoint(), &args)
}

#[test]
fn hosts_follow_their_own_keys_through_etcd_outages() {
    if !lbagent_tests::require_root() || !etcd::available() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let tag = unique("lbfe");
    let mut etcd = Etcd::start(&tag).unwrap();
    let ep = etcd.endpoint();
    let bridge = OvsBridge::new(&unique("brf")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.62.0.10", 24, "").unwrap();
    let backend = TestHost::on(|p| bridge.add_port(p), "10.62.0.21", 24, "").unwrap();
    line_echo_server(&backend.ns.name, 9000, "b").unwrap();
    let host_a = format!("a-{tag}");
    let host_b = format!("b-{tag}");
    let mut a = Agent::new(&host_a);
    let mut b = Agent::new(&host_b);
    a.start(&ep);
    b.start(&ep);
    let id = lb_id();
    let vip = |port| -> std::net::SocketAddr { format!("10.62.0.5:{port}").parse().unwrap() };

    // Host A's document reaches A only; `put --wait` returns once A runs it.
    let (ok, out, err) = put(&etcd, &host_a, &a.dir, &document(&bridge.name, &id, &[9000]), true);
    assert!(ok, "put --wait: {out}{err}\n{}", a.log());
    assert!(out.contains("applied"), "{out}");
    assert_eq!(a.lbs(), 1);
    wait_for(|| b.status().is_some(), "agent B serving its API");
    assert_eq!(b.lbs(), 0, "host B got nothing");
    let open = OpenConn::open(&client.ns.name, vip(9000)).unwrap();
    assert!(open.ping("1").unwrap().starts_with("b "));
    let st = host_status(&etcd, &host_a).unwrap();
    assert_eq!((st["result"].as_str(), st["alive"].as_bool()), (Some("applied"), Some(true)), "{st}");
    let (ok, listing, _) = fleet(&ep, &["status"]);
    assert!(ok && listing.contains(&format!("{host_a}: Applied")), "{listing}");

    // A refused document: `fleet put` refuses it locally; written behind
    // its back (etcdctl), the agent refuses it, reports every problem with
    // its path, and keeps running what it had.
    let bad = document(&bridge.name, "x;rm -rf /", &[9000]);
    let (ok, _, err) = put(&etcd, &host_a, &a.dir, &bad, false);
    assert!(!ok && err.contains("load_balancers[0].id"), "{err}");
    etcd.ctl(&["put", &format!("/lbagent/v1/desired/{host_a}"), &bad]).unwrap();
    wait_for(|| host_status(&etcd, &host_a).is_some_and(|s| s["result"] == "rejected"), "the refusal reported");
    let st = host_status(&etcd, &host_a).unwrap();
    assert!(st["problems"].to_string().contains("load_balancers[0].id"), "{st}");
    assert!(st["running_revision"].as_i64() < st["seen_revision"].as_i64(), "{st}");
    assert_eq!(a.lbs(), 1);
    assert!(open.ping("2").unwrap().starts_with("b "), "nothing changed");

    // `--if-revision`: a stale revision writes nothing; the current one
    // writes. Documents over etcd's request limit are refused before sending.
    let good = document(&bridge.name, &id, &[9000]);
    let file = a.dir.join("cas.yaml");
    std::fs::write(&file, &good).unwrap();
    let (_, _, err) = fleet(&ep, &["get", &host_a]);
    let current = revision_line(&err);
    let (ok, _, err) = fleet(&ep, &["put", &host_a, file.to_str().unwrap(), "--if-revision", "1"]);
    assert!(!ok && err.contains("nothing was written"), "{err}");
    let (ok, out, err) =
        fleet(&ep, &["put", &host_a, file.to_str().unwrap(), "--if-revision", &current, "--wait", "60"]);
    assert!(ok, "{out}{err}");
    let huge = format!("{good}# {}\n", "x".repeat(2 << 20));
    std::fs::write(&file, huge).unwrap();
    let (ok, _, err) = fleet(&ep, &["put", &host_a, file.to_str().unwrap()]);
    assert!(!ok && err.contains("etcd refuses requests over"), "{err}");

    // The key deleted: nothing changes (only an empty document drains).
    etcd.ctl(&["del", &format!("/lbagent/v1/desired/{host_a}")]).unwrap();
    wait_for(|| a.log().contains("was deleted"), "the deletion noticed");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(a.lbs(), 1, "a deleted key drains nothing");
    assert!(open.ping("2b").unwrap().starts_with("b "));
    let (ok, _, err) = put(&etcd, &host_a, &a.dir, &good, true);
    assert!(ok, "{err}");

    // etcd killed mid-run: traffic keeps flowing; restarted, the agent
    // resumes its watch and applies the next document.
    etcd.stop();
    std::thread::sleep(Duration::from_secs(3));
    assert!(open.ping("3").unwrap().starts_with("b "));
    assert!(ask_tcp(&client.ns.name, vip(9000)).unwrap().starts_with("b "));
    etcd.resume().unwrap();
    let (ok, out, err) = put(&etcd, &host_a, &a.dir, &document(&bridge.name, &id, &[9000, 9001]), true);
    assert!(ok, "after the etcd restart: {out}{err}\n{}", a.log());
    assert!(ask_tcp(&client.ns.name, vip(9001)).unwrap().starts_with("b "));
    assert!(open.ping("4").unwrap().starts_with("b "));

    // A compaction while the agent cannot reach etcd: it resumes its watch
    // from a compacted revision and reads the key again.
    // (The agent is frozen through the outage, so it cannot reconnect
    // before the compaction; thawed, its old stream fails and it resumes.)
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    etcd.stop();
    etcd.resume().unwrap();
    let (ok, _, err) = put(&etcd, &host_a, &a.dir, &document(&bridge.name, &id, &[9000, 9002]), false);
    assert!(ok, "{err}");
    let rev = etcd.revision().unwrap();
    etcd.ctl(&["compact", &rev.to_string()]).unwrap();
    a.signal(nix::sys::signal::Signal::SIGCONT);
    wait_for(
        || ask_tcp(&client.ns.name, vip(9002)).is_ok_and(|a| a.starts_with("b ")),
        "the document after the compaction",
    );
    let log = a.log();
    assert!(!log.contains("watch canceled"), "the compaction never wedges the watch:\n{log}");

    // Agent killed, etcd down, agent restarted: it applies its cached
    // document (the dataplane was never touched either way).
    a.kill();
    etcd.stop();
    a.start(&ep);
    let t = Instant::now();
    wait_for(|| a.status().is_some_and(|s| s["last_apply"]["ok"] == true), "the cached document applied");
    assert!(a.log().contains("applying the cached document"), "{}", a.log());
    assert_eq!(a.lbs(), 1);
    assert!(open.ping("5").unwrap().starts_with("b "));
    assert!(ask_tcp(&client.ns.name, vip(9002)).unwrap().starts_with("b "));
    eprintln!("cached document applied {:?} after start with etcd down", t.elapsed());

    // Back online: an explicit empty document drains host A.
    etcd.resume().unwrap();
    let (ok, out, err) = fleet(&ep, &["drain", &host_a, "--wait", "120"]);
    assert!(ok, "drain: {out}{err}\n{}", a.log());
    assert_eq!(a.lbs(), 0);
    assert_eq!(b.lbs(), 0);
}

/// A 3-member cluster loses its leader, then (with the leader back) the
/// member the agent talks to: the agent follows every new document.
#[test]
fn the_agent_follows_a_three_member_cluster_through_failures() {
    if !lbagent_tests::require_root() || !etcd::available() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let tag = unique("lbfc");
    let mut etcd = Etcd::cluster(&tag, 3).unwrap();
    let eps = etcd.endpoints();
    let bridge = OvsBridge::new(&unique("brc")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.62.0.10", 24, "").unwrap();
    let backend = TestHost::on(|p| bridge.add_port(p), "10.62.0.21", 24, "").unwrap();
    line_echo_server(&backend.ns.name, 9000, "b").unwrap();
    let host = format!("c-{tag}");
    let mut a = Agent::new(&host);
    a.start(&eps);
    let id = lb_id();
    let vip = |port| -> std::net::SocketAddr { format!("10.62.0.5:{port}").parse().unwrap() };
    let put_wait = |ports: &[u16]| {
        let file = a.dir.join(format!("{}.yaml", unique("doc")));
        std::fs::write(&file, document(&bridge.name, &id, ports)).unwrap();
        fleet(&eps, &["put", &host, file.to_str().unwrap(), "--wait", "120"])
    };
    let (ok, out, err) = put_wait(&[9000]);
    assert!(ok, "{out}{err}\n{}", a.log());
    let open = OpenConn::open(&client.ns.name, vip(9000)).unwrap();
    assert!(open.ping("1").unwrap().starts_with("b "));

    // The leader goes; the remaining two elect another and serve.
    let leader = etcd.leader().unwrap();
    etcd.stop_member(leader);
    let (ok, out, err) = put_wait(&[9000, 9001]);
    assert!(ok, "after losing the leader (member {leader}): {out}{err}\n{}", a.log());
    assert!(ask_tcp(&client.ns.name, vip(9001)).unwrap().starts_with("b "));
    etcd.resume().unwrap();

    // The member the agent talks to goes (it starts with the first, and
    // moved to the next if the first was the lost leader).
    let talking = if leader == 0 { 1 } else { 0 };
    etcd.stop_member(talking);
    let (ok, out, err) = put_wait(&[9000, 9002]);
    assert!(ok, "after losing member {talking}: {out}{err}\n{}", a.log());
    assert!(ask_tcp(&client.ns.name, vip(9002)).unwrap().starts_with("b "));
    assert!(open.ping("2").unwrap().starts_with("b "), "the open connection outlived both failures");
}

/// Waits up to `secs` (times the slowdown) for `f`.
fn wait_long(mut f: impl FnMut() -> bool, secs: u64, what: &str) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(secs) * lbagent_tests::slowdown(), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// How many log lines contain `needle`.
fn count(log: &str, needle: &str) -> usize {
    log.lines().filter(|l| l.contains(needle)).count()
}

/// A TLS etcd with auth enabled: `root`, and for each of `hosts` the user
/// `lbagent-<host>` whose role is the documented one (read its desired key,
/// write its status key, read and write its alive key), unless the host is
/// in `no_role`: that user exists but may touch nothing.
fn auth_cluster(tag: &str, hosts: &[&str], no_role: &[&str]) -> Etcd {
    let etcd = Etcd::start_tls(tag).unwrap();
    let pki = etcd.pki.as_ref().unwrap();
    for h in hosts.iter().chain(no_role) {
        let user = format!("lbagent-{h}");
        pki.issue(&user, Some(etcd::CLIENT)).unwrap();
        etcd.ctl(&["user", "add", &user, "--no-password"]).unwrap();
        if no_role.contains(h) {
            continue;
        }
        etcd.ctl(&["role", "add", &user]).unwrap();
        for (perm, kind) in [("read", "desired"), ("write", "status"), ("readwrite", "alive")] {
            etcd.ctl(&["role", "grant-permission", &user, perm, &format!("/lbagent/v1/{kind}/{h}")]).unwrap();
        }
        etcd.ctl(&["user", "grant-role", &user, &user]).unwrap();
    }
    etcd.ctl(&["user", "add", "root", "--no-password"]).unwrap();
    etcd.ctl(&["user", "grant-role", "root", "root"]).unwrap();
    etcd.ctl(&["auth", "enable"]).unwrap();
    etcd
}

/// The TLS flags for files `ca`, `cert`, `key`.
fn tls_flags(ca: PathBuf, cert: PathBuf, key: PathBuf) -> Vec<String> {
    let p = |p: PathBuf| p.display().to_string();
    vec!["--etcd-ca".into(), p(ca), "--etcd-cert".into(), p(cert), "--etcd-key".into(), p(key)]
}

/// Trust is enforced: no TLS flags and no `--etcd-insecure` is refused by
/// the agent and the CLI. An agent whose certificate etcd refuses keeps
/// running, backs off, reports why in its status and stays stoppable; the
/// certificate files replaced (a rotation), it connects with the new ones
/// without a restart. Failures right after a successful connect (a user
/// with no rights) back off too, in both loops: no reconnect or lease-grant
/// storm.
#[test]
fn etcd_trust_is_enforced_and_certificates_are_read_at_each_connect() {
    if !lbagent_tests::require_root() || !etcd::available() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let tag = unique("lbfr");
    let (h1, h2) = (format!("r1-{tag}"), format!("r2-{tag}"));
    let etcd = auth_cluster(&tag, &[&h1], &[&h2]);
    let pki = etcd.pki.as_ref().unwrap();
    let ep = etcd.endpoint();

    // No trust given: refused, saying how to give it.
    let out = Command::new(lbagent_bin()).args(["fleet", "--etcd", &ep, "get", &h1]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--etcd-insecure") && err.contains("--etcd-ca"), "{err}");
    let mut plain = Agent::new(&h1);
    let args: Vec<String> = ["--etcd", &ep, "--host", &h1, "--metrics", "off"].map(String::from).to_vec();
    let mut p = plain.dirs.spawn(&lbagent_bin(), &args, "agent.log");
    wait_long(|| !p.running(), 10, "the agent without TLS refusing to start");
    assert!(p.log().contains("--etcd-insecure"), "{}", p.log());
    drop(p);
    plain.kill();

    // A certificate from a CA etcd does not trust, at the paths the agent is given.
    let foreign = etcd::Pki::new(etcd.dir.join("foreign")).unwrap();
    let user1 = format!("lbagent-{h1}");
    foreign.issue(&user1, Some(etcd::CLIENT)).unwrap();
    let mut a = Agent::new(&h1);
    let (cert, key) = (a.path("host.pem"), a.path("host-key.pem"));
    std::fs::copy(foreign.cert(&user1), &cert).unwrap();
    std::fs::copy(foreign.key(&user1), &key).unwrap();
    let bridge = OvsBridge::new(&unique("brr")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.62.0.10", 24, "").unwrap();
    let backend = TestHost::on(|p| bridge.add_port(p), "10.62.0.21", 24, "").unwrap();
    line_echo_server(&backend.ns.name, 9000, "b").unwrap();
    let file = a.dir.join("doc.yaml");
    std::fs::write(&file, document(&bridge.name, &lb_id(), &[9000])).unwrap();
    let root = tls_flags(pki.ca(), pki.cert("root"), pki.key("root"));
    let (ok, out, err) = fleet_as(&ep, &root, &["put", &h1, file.to_str().unwrap()]);
    assert!(ok, "{out}{err}");
    a.start_with(&ep, &tls_flags(pki.ca(), cert.clone(), key.clone()));
    wait_for(
        || a.status().is_some_and(|s| s["source_problem"].as_str().is_some_and(|p| p.contains("etcd unreachable"))),
        "the refused certificate reported in the status",
    );
    std::thread::sleep(Duration::from_secs(6));
    let st = a.status().unwrap();
    assert!(st["revision_running"].is_null() && a.lbs() == 0, "nothing applied without trust: {st}");
    let attempts = count(&a.log(), "desired state: etcd unreachable");
    assert!((2..=7).contains(&attempts), "{attempts} attempts in ~7 s: the backoff grows\n{}", a.log());

    // The rights-less user connects, then every request is denied: both
    // loops back off instead of retrying at once.
    let mut b = Agent::new(&h2);
    let user2 = format!("lbagent-{h2}");
    b.start_with(&ep, &tls_flags(pki.ca(), pki.cert(&user2), pki.key(&user2)));

    // The certificate rotated in place: the next connect uses it.
    std::fs::copy(pki.cert(&user1), &cert).unwrap();
    std::fs::copy(pki.key(&user1), &key).unwrap();
    wait_long(
        || a.status().is_some_and(|s| s["last_apply"]["ok"] == true && a.lbs() == 1),
        40,
        "the rotated certificate used",
    );
    assert!(a.status().unwrap()["source_problem"].is_null());
    assert!(ask_tcp(&client.ns.name, "10.62.0.5:9000".parse().unwrap()).unwrap().starts_with("b "));

    std::thread::sleep(Duration::from_secs(12));
    let log = b.log();
    let (reads, grants) = (count(&log, "desired state: "), count(&log, "status to etcd: "));
    assert!(log.contains("permission denied"), "{log}");
    assert!(reads <= 8 && grants <= 8, "{reads} reconnects and {grants} lease grants in ~20 s:\n{log}");
    assert!(b.status().unwrap()["revision_running"].is_null());
    // Stoppable while it has no document: a clean stop at once.
    let t = Instant::now();
    assert!(b.process.as_mut().unwrap().stop(), "a clean stop before any document:\n{}", b.log());
    assert!(t.elapsed() < Duration::from_secs(5), "stopped in {:?}", t.elapsed());
    let t = Instant::now();
    assert!(a.process.as_mut().unwrap().stop());
    assert!(t.elapsed() < Duration::from_secs(5), "stopped in {:?}", t.elapsed());
}

/// Only the newest document is applied, and only one agent per host name
/// applies anything:
/// - a second agent with the same `--host` is refused while the first
///   holds the alive key; the first stopping hands it over;
/// - the holder stalled while a drain, three documents near etcd's size
///   limit and a revert are written, and etcd restarted under it: thawed,
///   it applies the newest only (its connections live through it);
/// - killed and restarted, it takes its own key back at once;
/// - a cached document older than `--etcd-cache-max-age` is not applied.
#[test]
fn only_the_newest_document_is_applied_and_one_agent_holds_a_host() {
    if !lbagent_tests::require_root() || !etcd::available() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let tag = unique("lbfn");
    let mut etcd = Etcd::start(&tag).unwrap();
    let ep = etcd.endpoint();
    let bridge = OvsBridge::new(&unique("brn")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.62.0.10", 24, "").unwrap();
    let backend = TestHost::on(|p| bridge.add_port(p), "10.62.0.21", 24, "").unwrap();
    line_echo_server(&backend.ns.name, 9000, "b").unwrap();
    let host = format!("n-{tag}");
    let id = lb_id();
    let vip = |port| -> std::net::SocketAddr { format!("10.62.0.5:{port}").parse().unwrap() };
    let mut a = Agent::new(&host);
    a.start(&ep);
    let (ok, out, err) = put(&etcd, &host, &a.dir, &document(&bridge.name, &id, &[9000]), true);
    assert!(ok, "{out}{err}\n{}", a.log());
    let open = OpenConn::open(&client.ns.name, vip(9000)).unwrap();

    // A second agent for the same host: refused while A holds the key.
    let mut b = Agent::new(&host);
    b.start(&ep);
    wait_for(
        || b.status().is_some_and(|s| s["alive_problem"].as_str().is_some_and(|p| p.contains("another agent holds"))),
        "the second agent refused",
    );
    std::thread::sleep(Duration::from_secs(3));
    let st = b.status().unwrap();
    assert!(st["revision_running"].is_null() && b.lbs() == 0, "B applied nothing: {st}");

    // A stalled; meanwhile a drain, three big documents and a revert; etcd
    // restarted so A also reconnects.
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    let (ok, _, err) = fleet(&ep, &["drain", &host]);
    assert!(ok, "{err}");
    let drain_rev = etcd.revision().unwrap();
    let padding = format!("# {}\n", "x".repeat(1400 * 1024));
    for port in [9001, 9002, 9003] {
        let big = format!("{}{padding}", document(&bridge.name, &id, &[9000, port]));
        let (ok, _, err) = put(&etcd, &host, &a.dir, &big, false);
        assert!(ok, "{err}");
    }
    let (ok, _, err) = put(&etcd, &host, &a.dir, &document(&bridge.name, &id, &[9000, 9004]), false);
    assert!(ok, "{err}");
    let newest = etcd.revision().unwrap().to_string();
    etcd.stop();
    etcd.resume().unwrap();
    a.signal(nix::sys::signal::Signal::SIGCONT);
    wait_long(
        || a.status().is_some_and(|s| s["revision_running"] == newest.as_str() && s["last_apply"]["ok"] == true),
        40,
        "the newest document applied",
    );
    assert!(ask_tcp(&client.ns.name, vip(9004)).unwrap().starts_with("b "));
    assert!(open.ping("through the stall").unwrap().starts_with("b "), "the drain was never applied");
    let log = a.log();
    assert!(!log.contains(&format!("revision={drain_rev}")), "the superseded drain was never even read:\n{log}");

    // A stops cleanly (its lease revoked): B takes the host over at once.
    let (ok, _, err) = fleet(&ep, &["drain", &host, "--wait", "60"]);
    assert!(ok, "{err}");
    let (_, _, err) = fleet(&ep, &["get", &host]);
    let drained = revision_line(&err);
    assert!(a.process.as_mut().unwrap().stop());
    let t = Instant::now();
    while !b.status().is_some_and(|s| s["revision_running"] == drained) {
        assert!(t.elapsed() < Duration::from_secs(20), "B running the host:\n{}", b.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(!b.log().contains("load balancer"), "B never applied A's older documents:\n{}", b.log());
    let alive = etcd.ctl(&["get", "--print-value-only", &format!("/lbagent/v1/alive/{host}")]).unwrap();
    let b_pid = b.process.as_ref().unwrap().pid().to_string();
    assert!(alive.contains(&format!("\"pid\":{b_pid}")), "{alive}");

    // B killed and restarted: its own lease is taken over, not waited out.
    b.kill();
    let before = b.log().len();
    b.start(&ep);
    let t = Instant::now();
    wait_for(|| b.status().is_some_and(|s| s["revision_running"] == drained), "B running again");
    assert!(t.elapsed() < Duration::from_secs(10), "took its key back in {:?}", t.elapsed());
    let restarted = b.log()[before..].to_string();
    assert!(!restarted.contains("another agent holds"), "{restarted}");

    // The cache too old: not applied while etcd is down; applied from etcd
    // once it is back.
    b.kill();
    etcd.stop();
    std::thread::sleep(Duration::from_secs(2));
    b.start_with(&ep, &["--etcd-insecure".into(), "--etcd-cache-max-age".into(), "1".into()]);
    wait_for(
        || b.status().is_some_and(|s| s["source_problem"].as_str().is_some_and(|p| p.contains("--etcd-cache-max-age"))),
        "the old cache refused",
    );
    assert!(b.status().unwrap()["revision_running"].is_null());
    etcd.resume().unwrap();
    wait_long(|| b.status().is_some_and(|s| s["revision_running"] == drained), 40, "the document from etcd");
}

/// Mutual TLS with a per-host etcd user (the certificate's CN) whose role
/// reads exactly its own desired key and writes exactly its own status and
/// alive keys: the agent runs with it; the same identity is denied another
/// host's document and writing desired state at all.
#[test]
fn mutual_tls_with_a_per_host_user() {
    if !lbagent_tests::require_root() || !etcd::available() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let tag = unique("lbft");
    let etcd = Etcd::start_tls(&tag).unwrap();
    let pki = etcd.pki.as_ref().unwrap();
    let ep = etcd.endpoint();
    let (h1, h2) = (format!("t1-{tag}"), format!("t2-{tag}"));
    for h in [&h1, &h2] {
        let user = format!("lbagent-{h}");
        pki.issue(&user, Some(etcd::CLIENT)).unwrap();
        etcd.ctl(&["role", "add", &user]).unwrap();
        for (perm, kind) in [("read", "desired"), ("write", "status"), ("readwrite", "alive")] {
            etcd.ctl(&["role", "grant-permission", &user, perm, &format!("/lbagent/v1/{kind}/{h}")]).unwrap();
        }
        etcd.ctl(&["user", "add", &user, "--no-password"]).unwrap();
        etcd.ctl(&["user", "grant-role", &user, &user]).unwrap();
    }
    etcd.ctl(&["user", "add", "root", "--no-password"]).unwrap();
    etcd.ctl(&["user", "grant-role", "root", "root"]).unwrap();
    etcd.ctl(&["auth", "enable"]).unwrap();
    let tls = |cn: &str| -> Vec<String> {
        let p = |p: PathBuf| p.display().to_string();
        vec![
            "--etcd-ca".into(),
            p(pki.ca()),
            "--etcd-cert".into(),
            p(pki.cert(cn)),
            "--etcd-key".into(),
            p(pki.key(cn)),
        ]
    };
    let user1 = format!("lbagent-{h1}");

    let bridge = OvsBridge::new(&unique("brt")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.62.0.10", 24, "").unwrap();
    let backend = TestHost::on(|p| bridge.add_port(p), "10.62.0.21", 24, "").unwrap();
    line_echo_server(&backend.ns.name, 9000, "b").unwrap();
    let mut a = Agent::new(&h1);
    a.start_with(&ep, &tls(&user1));
    let file = a.dir.join("doc.yaml");
    std::fs::write(&file, document(&bridge.name, &lb_id(), &[9000])).unwrap();
    let (ok, out, err) = fleet_as(&ep, &tls("root"), &["put", &h1, file.to_str().unwrap(), "--wait", "120"]);
    assert!(ok, "the operator's put, applied by the agent over mutual TLS: {out}{err}\n{}", a.log());
    assert!(ask_tcp(&client.ns.name, "10.62.0.5:9000".parse().unwrap()).unwrap().starts_with("b "));
    let (ok, out, _) = fleet_as(&ep, &tls("root"), &["status", &h1, "--json"]);
    let st: Value = serde_json::from_str(&out).unwrap();
    assert!(ok && st[&h1]["result"] == "applied" && st[&h1]["alive"] == true, "{out}");

    // The host's identity: its own document yes, another host's no, and no
    // desired-state writes at all (its own included).
    let (ok, _, err) = fleet_as(&ep, &tls(&user1), &["get", &h1]);
    assert!(ok, "{err}");
    let (ok, _, err) = fleet_as(&ep, &tls(&user1), &["get", &h2]);
    assert!(!ok && err.contains("permission denied"), "reading another host's document: {err}");
    let (ok, _, err) = fleet_as(&ep, &tls(&user1), &["put", &h1, file.to_str().unwrap()]);
    assert!(!ok && err.contains("permission denied"), "writing its own desired state: {err}");
    let (ok, _, err) = fleet_as(&ep, &tls(&user1), &["drain", &h2]);
    assert!(!ok && err.contains("permission denied"), "draining another host: {err}");
    // Nor another host's status or alive key, nor reading its status.
    for key in [format!("/lbagent/v1/status/{h2}"), format!("/lbagent/v1/alive/{h2}")] {
        let e = etcd.ctl_as(&user1, &["put", &key, "x"]).unwrap_err();
        assert!(format!("{e:#}").contains("permission denied"), "writing {key}: {e:#}");
    }
    let e = etcd.ctl_as(&user1, &["get", &format!("/lbagent/v1/status/{h2}")]).unwrap_err();
    assert!(format!("{e:#}").contains("permission denied"), "{e:#}");
    // No client certificate: no access.
    let ca_only = tls(&user1)[..2].to_vec();
    let (ok, _, err) = fleet_as(&ep, &ca_only, &["get", &h1]);
    assert!(!ok, "without a client certificate: {err}");
}

/// The operators' command line as documented: every `lbagent fleet`
/// subcommand takes the etcd and TLS flags before or after its name, and
/// `fleet status` reads the status keys in pages and lists a host whose
/// status it cannot read as unreadable, with the reason, beside the others.
mod cli_as_documented {
    use std::{path::Path, process::Command};

    use lbagent::fleet::{HostStatus, Outcome};
    use lbagent_tests::{
        etcd::{self, Etcd},
        lbagent_bin, unique,
    };
    use serde_json::Value;

    /// Flags every command against a plain-HTTP etcd takes (beside `--etcd`).
    const PLAIN: &[&str] = &["--etcd-insecure"];

    /// `lbagent ARGS`: (exit ok, stdout, stderr).
    fn lbagent(args: &[String]) -> (bool, String, String) {
        let out = Command::new(lbagent_bin()).args(args).output().expect("running lbagent");
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
    }

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    /// `lbagent fleet <etcd flags> SUB…`
    fn flags_before(etcd: &[String], sub: &[&str]) -> Vec<String> {
        [strings(&["fleet"]), etcd.to_vec(), strings(sub)].concat()
    }

    /// `lbagent fleet SUB… <etcd flags>`, the order the usage line shows.
    fn flags_after(etcd: &[String], sub: &[&str]) -> Vec<String> {
        [strings(&["fleet"]), strings(sub), etcd.to_vec()].concat()
    }

    /// What `host`'s agent would report, written to its status key.
    fn report(etcd: &Etcd, host: &str, st: &HostStatus) {
        etcd.ctl(&["put", &format!("/lbagent/v1/status/{host}"), &serde_json::to_string(st).unwrap()]).unwrap();
    }

    fn write(dir: &Path, text: &str) -> String {
        let file = dir.join(format!("{}.yaml", unique("doc")));
        std::fs::write(&file, text).unwrap();
        file.display().to_string()
    }

    #[test]
    fn every_fleet_subcommand_takes_the_etcd_flags_before_or_after_its_name() {
        if !etcd::available() {
            return;
        }
        let tag = unique("lbfo");
        let etcd = Etcd::start(&tag).unwrap();
        let plain = [strings(&["--etcd", &etcd.endpoint()]), strings(PLAIN)].concat();
        let host = format!("o-{tag}");
        for (order, place) in
            [("before", flags_before as fn(&[String], &[&str]) -> Vec<String>), ("after", flags_after)]
        {
            let doc = format!("version: 1\n# written with the flags {order} the subcommand\n");
            let file = write(&etcd.dir, &doc);
            let (ok, out, err) = lbagent(&place(&plain, &["put", &host, &file]));
            assert!(ok && out.contains(&format!("host {host}: revision")), "put, flags {order}: {out}{err}");
            let (ok, out, err) = lbagent(&place(&plain, &["get", &host]));
            assert!(ok && out == doc, "get, flags {order}: {out}{err}");

            let st = HostStatus {
                seen_revision: Some(7),
                running_revision: Some(7),
                result: Outcome::Applied,
                ..Default::default()
            };
            report(&etcd, &host, &st);
            let (ok, out, err) = lbagent(&place(&plain, &["status", &host, "--json"]));
            assert!(ok, "status HOST, flags {order}: {err}");
            let v: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(
                (v[&host]["result"].as_str(), v[&host]["running_revision"].as_i64()),
                (Some("applied"), Some(7)),
                "{out}"
            );
            let (ok, out, err) = lbagent(&place(&plain, &["status"]));
            assert!(
                ok && out.contains(&format!("{host}: Applied, running revision 7")),
                "status, flags {order}: {out}{err}"
            );

            let (ok, out, err) = lbagent(&place(&plain, &["drain", &host]));
            assert!(ok, "drain, flags {order}: {out}{err}");
            let (ok, out, err) = lbagent(&place(&plain, &["get", &host]));
            assert!(ok && out == lbagent::cli::fleet::EMPTY, "the drained document, flags {order}: {out}{err}");
        }
        // Split between both places.
        let split = [strings(&["fleet", "--etcd", &etcd.endpoint(), "get", &host]), strings(PLAIN)].concat();
        let (ok, out, err) = lbagent(&split);
        assert!(ok && out == lbagent::cli::fleet::EMPTY, "{out}{err}");
    }

    #[test]
    fn the_tls_flags_go_before_or_after_the_subcommand() {
        if !etcd::available() {
            return;
        }
        let tag = unique("lbfs");
        let etcd = Etcd::start_tls(&tag).unwrap();
        let pki = etcd.pki.as_ref().unwrap();
        let p = |p: std::path::PathBuf| p.display().to_string();
        let ep = strings(&["--etcd", &etcd.endpoint()]);
        let ca = strings(&["--etcd-ca", &p(pki.ca())]);
        let identity = strings(&["--etcd-cert", &p(pki.cert("root")), "--etcd-key", &p(pki.key("root"))]);
        let host = format!("s-{tag}");
        let doc = "version: 1\n# over mutual TLS\n";
        let file = write(&etcd.dir, doc);

        let all = [ep.clone(), ca.clone(), identity.clone()].concat();
        let (ok, out, err) = lbagent(&flags_after(&all, &["put", &host, &file]));
        assert!(ok, "every flag after `put`: {out}{err}");
        let (ok, out, err) =
            lbagent(&[flags_before(&[ep.clone(), ca.clone()].concat(), &["get", &host]), identity.clone()].concat());
        assert!(ok && out == doc, "the identity after `get`, the rest before: {out}{err}");
        let (ok, _, err) = lbagent(&[flags_before(&identity, &["status"]), ep.clone(), ca.clone()].concat());
        assert!(!ok && err.contains("no status reported"), "the endpoint and CA after `status`: {err}");
        let (ok, out, err) = lbagent(&flags_after(&all, &["drain", &host]));
        assert!(ok, "every flag after `drain`: {out}{err}");
        // The flags after the name are the ones that make it work: without
        // the client certificate, etcd refuses the connection.
        let (ok, _, err) = lbagent(&flags_after(&[ep, ca].concat(), &["get", &host]));
        assert!(!ok, "without a client certificate: {err}");
    }

    /// Puts every (key, value) with one client (a few hundred keys in a
    /// second, where one `etcdctl` per key takes ten).
    fn put_all(endpoint: &str, kvs: &[(String, Vec<u8>)]) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let mut c = etcd_client::Client::connect([endpoint], None).await.unwrap();
            for (k, v) in kvs {
                c.put(k.as_str(), v.clone(), None).await.unwrap();
            }
        });
    }

    /// Range requests this member has served (its `etcd_mvcc_range_total`).
    fn ranges(etcd: &Etcd) -> u64 {
        let out = std::process::Command::new("curl")
            .args(["-sf", &format!("http://{}/metrics", etcd.endpoint())])
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| l.strip_prefix("etcd_mvcc_range_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no etcd_mvcc_range_total in the metrics:\n{text}")) as u64
    }

    #[test]
    fn fleet_status_pages_and_lists_an_unreadable_status_beside_the_others() {
        if !etcd::available() {
            return;
        }
        let tag = unique("lbfp");
        let etcd = Etcd::start(&tag).unwrap();
        let plain = [strings(&["--etcd", &etcd.endpoint()]), strings(PLAIN)].concat();
        let status_key = |h: &str| format!("/lbagent/v1/status/{h}");
        let host = |i: usize| format!("h{i:03}-{tag}");

        // 240 hosts report as their agents do; every tenth is alive.
        let good = 240;
        let mut kvs: Vec<(String, Vec<u8>)> = Vec::new();
        for i in 0..good {
            let st = HostStatus {
                seen_revision: Some(i as i64),
                running_revision: Some(i as i64),
                result: Outcome::Applied,
                ..Default::default()
            };
            kvs.push((status_key(&host(i)), serde_json::to_vec(&st).unwrap()));
            if i % 10 == 0 {
                kvs.push((format!("/lbagent/v1/alive/{}", host(i)), b"{}".to_vec()));
            }
        }
        // Three large but legitimate statuses (together over any one
        // response's bound), one that lists 2 of its 120 problems, and the
        // broken ones: not JSON, not a status, not UTF-8, over the bound.
        let long = |n: usize| HostStatus {
            result: Outcome::Rejected,
            problems: vec![format!("load_balancers[0].name: {}", "x".repeat(n))],
            ..Default::default()
        };
        for i in 0..3 {
            kvs.push((status_key(&format!("large{i}-{tag}")), serde_json::to_vec(&long(450_000)).unwrap()));
        }
        let mut bounded = serde_json::to_value(HostStatus {
            result: Outcome::Rejected,
            problems: vec!["p1: bad".into(), "p2: bad".into()],
            ..Default::default()
        })
        .unwrap();
        bounded["problems_total"] = 120.into();
        kvs.push((status_key(&format!("bounded-{tag}")), serde_json::to_vec(&bounded).unwrap()));
        let broken: [(&str, Vec<u8>); 4] = [
            ("malformed", b"{\"result\": \"applied\", \"problems\": [".to_vec()),
            ("wrongshape", b"{\"result\": \"exploded\"}".to_vec()),
            ("binary", vec![0xff, 0xfe, 0x00, 0x01]),
            ("oversized", serde_json::to_vec(&long(1_200_000)).unwrap()),
        ];
        for (name, value) in &broken {
            kvs.push((status_key(&format!("{name}-{tag}")), value.clone()));
        }
        put_all(&etcd.endpoint(), &kvs);

        let before = ranges(&etcd);
        let (ok, out, err) = lbagent(&flags_after(&plain, &["status"]));
        let served = ranges(&etcd) - before;
        assert!(ok, "fleet status: {err}");
        for i in 0..good {
            let alive = if i % 10 == 0 { "" } else { " (not alive: no agent holds its lease)" };
            let line = format!("{}: Applied, running revision {i}, seen {i}{alive}\n", host(i));
            assert!(out.contains(&line), "{line:?} missing");
        }
        for i in 0..3 {
            assert!(out.contains(&format!("large{i}-{tag}: Rejected")), "large{i}");
        }
        assert!(
            out.contains(&format!("bounded-{tag}: Rejected")) && out.contains("  p2: bad\n  (118 more problems)\n"),
            "the bounded status"
        );
        for (name, why) in [
            ("malformed", "EOF while parsing"),
            ("wrongshape", "unknown variant `exploded`"),
            ("binary", "expected value"),
            ("oversized", "over the"),
        ] {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("{name}-{tag}: ")))
                .unwrap_or_else(|| panic!("{name} not listed:\n{err}"));
            assert!(line.contains("UNREADABLE status") && line.contains(why), "{name}: {line}");
        }
        let listed = out.lines().filter(|l| !l.starts_with(' ')).count();
        assert_eq!(listed, good + 3 + 1 + broken.len(), "every host listed once");
        // 248 status keys at most 100 a request, and the alive keys.
        eprintln!("fleet status over {} hosts: {served} range requests", listed);
        assert!(served >= 4, "{served} range requests: not paged");

        // The same as JSON: every host, the unreadable ones with the reason.
        let (ok, out, err) = lbagent(&flags_after(&plain, &["status", "--json"]));
        assert!(ok, "{err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v.as_object().unwrap().len(), listed);
        assert_eq!((v[host(10)]["result"].as_str(), v[host(10)]["alive"].as_bool()), (Some("applied"), Some(true)));
        assert_eq!(v[format!("bounded-{tag}")]["problems_total"].as_u64(), Some(120));
        let bad = &v[format!("malformed-{tag}")];
        assert!(bad["unreadable"].as_str().is_some_and(|w| w.contains("EOF")) && bad["alive"] == false, "{bad}");
        assert!(
            v[format!("oversized-{tag}")]["unreadable"].as_str().is_some_and(|w| w.contains("over the")),
            "{out:.300}"
        );

        // One host asked by name: its unreadable status, with the reason.
        let (ok, out, err) = lbagent(&flags_after(&plain, &["status", &format!("malformed-{tag}")]));
        assert!(ok && out.contains("UNREADABLE status") && out.contains("EOF"), "{out}{err}");
    }
}

/// Every problem the agent's etcd source reports: the desired-state
/// reader's (`source_problem`) and the alive key and status writer's
/// (`alive_problem`).
fn problems(st: &Value) -> String {
    format!("{} | {}", st["source_problem"].as_str().unwrap_or(""), st["alive_problem"].as_str().unwrap_or(""))
}

/// An empty document told apart by `n` (no objects: two agents of one host
/// may both run it on this machine).
fn empty(n: u32) -> String {
    format!("version: 1\n# document {n}\n")
}

/// Puts `doc` for `host` and returns its revision.
fn put_rev(etcd: &Etcd, host: &str, dir: &std::path::Path, doc: &str) -> String {
    let (ok, out, err) = put(etcd, host, dir, doc, false);
    assert!(ok, "{out}{err}");
    let rev = out.split_once(": revision ").map(|(_, r)| r.split_whitespace().next().unwrap_or("").to_string());
    rev.unwrap_or_else(|| panic!("no revision in {out}"))
}

fn running_rev(a: &Agent) -> Option<String> {
    a.status().and_then(|s| s["revision_running"].as_str().map(String::from))
}

/// Whose pid the alive key names (`None`: nobody holds it).
fn alive_pid(etcd: &Etcd, host: &str) -> Option<i64> {
    let v = etcd.ctl(&["get", "--print-value-only", &format!("/lbagent/v1/alive/{host}")]).unwrap();
    serde_json::from_str::<Value>(v.trim()).ok()?["pid"].as_i64()
}

/// The alive key is verified, not believed: taken from the holder behind
/// its back (deleted by hand, then held on another lease), the agent stops
/// applying documents from etcd, says so, and takes the key back once it
/// is free (never while another holds it). A second agent refused for the
/// same host retries with a growing backoff, not every 2 s.
#[test]
fn a_lost_alive_key_stops_the_agent_until_it_is_free_again() {
    if !lbagent_tests::require_root() || !etcd::available() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let tag = unique("lbfk");
    let etcd = Etcd::start(&tag).unwrap();
    let ep = etcd.endpoint();
    let host = format!("k-{tag}");
    let alive = format!("/lbagent/v1/alive/{host}");
    let mut a = Agent::new(&host);
    a.start(&ep);
    let (ok, out, err) = put(&etcd, &host, &a.dir, &empty(1), true);
    assert!(ok, "{out}{err}\n{}", a.log());
    let r1 = running_rev(&a).unwrap();
    let a_pid = a.process.as_ref().unwrap().pid().as_raw() as i64;

    // A second agent for the host: refused, retrying with a growing backoff.
    let mut b = Agent::new(&host);
    b.start(&ep);
    wait_for(|| b.status().is_some_and(|s| problems(&s).contains("another agent holds")), "B refused");
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(25));
    let tries = count(&b.log(), "another agent holds");
    eprintln!("refused agent: {tries} attempts in {:?}", t.elapsed());
    // Every 2 s: 13 or more; backing off from 0.5 s: at most 8.
    assert!(tries <= 8, "{tries} attempts in 25 s: no backoff\n{}", b.log());
    b.kill();

    // The key taken behind A's back: deleted, then held on another lease.
    let granted = etcd.ctl(&["lease", "grant", "300"]).unwrap();
    let lease = granted.split_whitespace().nth(1).unwrap().to_string();
    etcd.ctl(&["del", &alive]).unwrap();
    etcd.ctl(&["put", "--lease", &lease, &alive, r#"{"pid":1,"machine":"intruder","version":"0"}"#]).unwrap();
    wait_long(
        || a.status().is_some_and(|s| problems(&s).contains("no longer held")),
        25,
        "A noticing that it lost the alive key",
    );
    let r2 = put_rev(&etcd, &host, &a.dir, &empty(2));
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(running_rev(&a).as_deref(), Some(r1.as_str()), "A applied a document without the key:\n{}", a.log());
    assert_eq!(alive_pid(&etcd, &host), Some(1), "A took the key from its holder");

    // The other holder gone: A takes the key back and applies the newest.
    etcd.ctl(&["lease", "revoke", &lease]).unwrap();
    wait_long(|| running_rev(&a).as_deref() == Some(r2.as_str()), 40, "A running again once the key is free");
    assert_eq!(alive_pid(&etcd, &host), Some(a_pid));
    wait_for(|| a.status().is_some_and(|s| s["alive_problem"].is_null()), "the problem cleared");

    // A real second agent while the key is deleted by hand: whichever
    // takes it, only that one applies the next document.
    let mut b = Agent::new(&host);
    b.start(&ep);
    wait_for(|| b.status().is_some_and(|s| problems(&s).contains("another agent holds")), "B refused");
    etcd.ctl(&["del", &alive]).unwrap();
    wait_long(|| alive_pid(&etcd, &host).is_some(), 40, "the key held again");
    std::thread::sleep(Duration::from_secs(12));
    let holder = alive_pid(&etcd, &host).unwrap();
    let (on, off) = if holder == a_pid { (&a, &b) } else { (&b, &a) };
    let r3 = put_rev(&etcd, &host, &a.dir, &empty(3));
    wait_long(|| running_rev(on).as_deref() == Some(r3.as_str()), 30, "the holder applying the next document");
    std::thread::sleep(Duration::from_secs(3));
    assert_ne!(running_rev(off).as_deref(), Some(r3.as_str()), "both agents applied it:\n{}", off.log());
    assert!(off.status().is_some_and(|s| !problems(&s).trim().eq("|")), "the other says why");
}

/// A document the mass-removal guard refuses is never cached, is evaluated
/// again on SIGHUP, and is applied once the refusal no longer holds (the
/// agent restarted with a higher `--max-removal`). Objects updated in place
/// (a backend whose group is renamed) are not removals.
#[test]
fn a_refused_document_is_not_cached_and_applies_once_allowed() {
    if !lbagent_tests::require_root() || !etcd::available() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let tag = unique("lbfg");
    let etcd = Etcd::start(&tag).unwrap();
    let ep = etcd.endpoint();
    let bridge = OvsBridge::new(&unique("brg")).unwrap();
    let client = TestHost::on(|p| bridge.add_port(p), "10.62.0.10", 24, "").unwrap();
    let backend = TestHost::on(|p| bridge.add_port(p), "10.62.0.21", 24, "").unwrap();
    line_echo_server(&backend.ns.name, 9000, "b").unwrap();
    let host = format!("g-{tag}");
    let id = lb_id();
    let vip = |port| -> std::net::SocketAddr { format!("10.62.0.5:{port}").parse().unwrap() };
    let strict = ["--etcd-insecure".to_string(), "--max-removal".into(), "10".into()];
    let mut a = Agent::new(&host);
    a.start_with(&ep, &strict);
    let (ok, out, err) = put(&etcd, &host, &a.dir, &document(&bridge.name, &id, &[9000, 9001]), true);
    assert!(ok, "{out}{err}\n{}", a.log());
    let cache = a.dir.join("sd").join("fleet-desired.json");
    let cached_rev = || -> i64 {
        let c: Value = serde_json::from_slice(&std::fs::read(&cache).unwrap()).unwrap();
        c["revision"].as_i64().unwrap()
    };

    // The backend group renamed: the backend is updated in place, not removed.
    let renamed = document(&bridge.name, &id, &[9000, 9001])
        .replace("backend_group: g}", "backend_group: g2}")
        .replace("{id: g, backends", "{id: g2, backends");
    let (ok, out, err) = put(&etcd, &host, &a.dir, &renamed, true);
    assert!(ok, "a renamed group is no removal: {out}{err}\n{}", a.log());
    let accepted = running_rev(&a).unwrap();
    assert_eq!(cached_rev().to_string(), accepted);
    assert!(ask_tcp(&client.ns.name, vip(9001)).unwrap().starts_with("b "));

    // One listener of four objects removed: refused (over 10 %), not cached.
    let smaller = renamed.replace("      - {id: l9001, type: tcp, port: 9001, backend_group: g2}\n", "");
    assert_ne!(smaller, renamed);
    let refused = put_rev(&etcd, &host, &a.dir, &smaller);
    wait_for(|| a.status().is_some_and(|s| s["revision_seen"] == refused.as_str()), "the refusal");
    let st = a.status().unwrap();
    assert!(st["rejected_state"].to_string().contains("removes 1 of the 4"), "{st}");
    assert_eq!(cached_rev().to_string(), accepted, "the refused document was cached");

    // SIGHUP evaluates it again (still refused: nothing changed).
    let before = count(&a.log(), "SIGHUP: desired state refused");
    a.signal(nix::sys::signal::Signal::SIGHUP);
    wait_for(|| count(&a.log(), "SIGHUP: desired state refused") > before, "the refused revision evaluated again");
    assert!(ask_tcp(&client.ns.name, vip(9001)).unwrap().starts_with("b "));

    // Restarted with a higher bound: the same revision is applied.
    assert!(a.process.as_mut().unwrap().stop());
    a.start_with(&ep, &["--etcd-insecure".to_string(), "--max-removal".into(), "50".into()]);
    wait_long(
        || a.status().is_some_and(|s| s["revision_running"] == refused.as_str() && s["last_apply"]["ok"] == true),
        40,
        "the refused revision applied after the restart",
    );
    assert_eq!(cached_rev().to_string(), refused);
    assert!(ask_tcp(&client.ns.name, vip(9001)).is_err(), "listener 9001 removed");
}

/// The desired-state reader and the alive key's holder each report their
/// own problem: an identity that may take its alive key but neither read
/// its document nor write its status shows both at once.
#[test]
fn the_readers_and_the_holders_problems_are_both_visible() {
    if !lbagent_tests::require_root() || !etcd::available() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    let tag = unique("lbfq");
    let h = format!("q-{tag}");
    let etcd = auth_cluster(&tag, &[], &[&h]);
    let pki = etcd.pki.as_ref().unwrap();
    let user = format!("lbagent-{h}");
    etcd.ctl(&["role", "add", &user]).unwrap();
    etcd.ctl(&["role", "grant-permission", &user, "readwrite", &format!("/lbagent/v1/alive/{h}")]).unwrap();
    etcd.ctl(&["user", "grant-role", &user, &user]).unwrap();
    let mut a = Agent::new(&h);
    a.start_with(&etcd.endpoint(), &tls_flags(pki.ca(), pki.cert(&user), pki.key(&user)));
    wait_long(
        || {
            a.status().is_some_and(|s| {
                let p = problems(&s);
                p.contains("writing the status") && p.contains("get")
            })
        },
        30,
        "both problems reported at once",
    );
    let st = a.status().unwrap();
    let text = a.cli(&["status"]);
    assert!(text.contains("writing the status") && text.contains("get:"), "{text}\n{st}");
}
