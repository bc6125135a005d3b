//! Section 21, HA pairs: what a planned switchover, a failback and the
//! active's death cost held flows, through the agent pair (keepalived as
//! its arbiter, `ha_pair`) and through the reference operators run today:
//! two gateway namespaces with iptables SNAT/DNAT, conntrackd (FTFW) and
//! keepalived moving the EIPs and the LAN address, its notify scripts
//! doing what conntrack-tools' `primary-backup.sh` does. The same
//! topology, traffic and detection intervals for both; then how many new
//! flows per second each pair keeps in sync, and the agent's sync lag.

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use lbagent_tests::{
    gateway::{INTERNET_IP, LAN_GW_IP},
    ha_pair::{Bed, Flows, Side, at, wait_synced},
    hosts::TestHost,
    keepalived::{Drives, Keepalived},
    lbagent_release_bin,
    net::{Netns, sh},
    ovs::{LinuxBridge, OvsBridge},
    topology::spawn_in,
    traffic::*,
    unique, wait_for,
};

/// Flows held through every event: outbound TCP (SNAT), inbound TCP
/// (DNAT), UDP through SNAT; each pinged every 100 ms.
const HELD: (usize, usize, usize) = (50, 10, 20);

pub fn ha(quick: bool, out: &mut String) -> Result<()> {
    let adverts: &[f64] = if quick { &[0.1] } else { &[1.0, 0.1, 0.01] };
    writeln!(
        out,
        "\n## 21. HA pairs: failovers with held flows, beside iptables + conntrackd (FTFW) + keepalived\n\n\
         {} outbound and {} inbound (DNAT) TCP connections and {} UDP flows through SNAT, each pinged every 100 ms; a UDP \
         probe every 1 ms gives the longest gap between two answers. *broken*: connections that failed a ping; *moved*: \
         UDP flows answered from another external port; *lost probes*: of those sent during the event's 4 s.\n",
        HELD.0, HELD.1, HELD.2
    )?;
    writeln!(
        out,
        "| pair | advert | event | broken | moved | longest gap | lost probes |\n|---|---:|---|---:|---:|---:|---:|"
    )?;
    for &advert in adverts {
        for row in ours(advert)? {
            writeln!(out, "| agent pair | {advert} s | {row} |")?;
        }
        eprint!(".");
        for row in reference(advert)? {
            writeln!(out, "| iptables + conntrackd + keepalived | {advert} s | {row} |")?;
        }
        eprint!(".");
    }
    capacity(quick, out)
}

/// The held flows, pinged every 100 ms on a thread of their own (the
/// traffic a failover must carry). A connection is *broken* when, after
/// the event, it still fails its ping four times in a row (a ping times
/// out after 3 s, and its late answer is read by the next one: a
/// connection that only waited out a retransmission answers again; one
/// that was reset or lost its translation does not).
struct Held {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(Flows, usize, usize, usize)>,
}

impl Held {
    fn start(flows: Flows) -> Held {
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let thread = std::thread::spawn(move || {
            // Connections that fail the first round broke before (an
            // earlier event): not this event's.
            let first: Vec<bool> = ping(&conns(&flows)).into_iter().map(|r| r.is_ok()).collect();
            let mut moved = BTreeSet::new();
            while !halt.load(Ordering::Relaxed) {
                let began = Instant::now();
                let _ = ping(&conns(&flows));
                for (i, f) in flows.udp.iter().enumerate() {
                    if let Ok(seen) = f.ask("x")
                        && seen != flows.udp_seen[i]
                    {
                        moved.insert(i);
                    }
                }
                std::thread::sleep(Duration::from_millis(100).saturating_sub(began.elapsed()));
            }
            let all = conns(&flows);
            let mut failing: Vec<usize> = (0..all.len()).filter(|&i| first[i]).collect();
            for _ in 0..4 {
                let tried: Vec<&OpenConn> = failing.iter().map(|&i| all[i]).collect();
                let results = ping(&tried);
                failing = failing.into_iter().zip(results).filter(|(_, r)| r.is_err()).map(|(i, _)| i).collect();
                if failing.is_empty() {
                    break;
                }
            }
            let alive = first.iter().filter(|ok| **ok).count();
            (flows, failing.len(), alive, moved.len())
        });
        Held { stop, thread }
    }

    /// The flows, and of the connections alive when it started, how many
    /// broke; how many UDP flows moved.
    fn finish(self) -> (Flows, usize, usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the held flows' thread")
    }
}

/// Every held TCP connection, outbound then inbound.
fn conns(f: &Flows) -> Vec<&OpenConn> {
    f.out.iter().chain(&f.inbound).collect()
}

/// Pings every connection at once.
fn ping(conns: &[&OpenConn]) -> Vec<Result<String>> {
    conns
        .iter()
        .map(|c| c.send("x"))
        .collect::<Vec<_>>()
        .into_iter()
        .zip(conns)
        .map(|(sent, c)| sent.and_then(|()| c.answer()))
        .collect()
}

/// Runs `event` with the held flows pinged and a 1 ms probe; the row.
fn measure(name: &str, client_ns: &str, flows: Flows, event: impl FnOnce() -> Result<()>) -> Result<(Flows, String)> {
    let held = Held::start(flows);
    let probe = UdpProbe::start(client_ns, at(INTERNET_IP, 9001), Duration::from_millis(1))?;
    std::thread::sleep(Duration::from_millis(1000));
    let done = event();
    std::thread::sleep(Duration::from_millis(3000));
    let p = probe.finish();
    let (flows, broken, alive, moved) = held.finish();
    done.with_context(|| name.to_string())?;
    let row = format!(
        "{name} | {broken} of {alive} | {moved} of {} | {:.1} ms | {} of {}",
        flows.udp.len(),
        p.longest_gap.as_secs_f64() * 1000.0,
        p.lost,
        p.sent
    );
    Ok((flows, row))
}

fn active_of(bed: &Bed) -> Result<(&Side, &Side)> {
    let a_active = bed.a.status()["role"] == "active";
    let b_active = bed.b.status()["role"] == "active";
    match (a_active, b_active) {
        (true, false) => Ok((&bed.a, &bed.b)),
        (false, true) => Ok((&bed.b, &bed.a)),
        other => bail!("roles: a active {}, b active {}", other.0, other.1),
    }
}

/// The agent pair with keepalived at `advert`: a planned switchover, the
/// failback, the active's death.
fn ours(advert: f64) -> Result<Vec<String>> {
    let bed = Bed::with_bin(lbagent_release_bin());
    let mut agents = [bed.start(&bed.a), bed.start(&bed.b)];
    bed.wait_applied();
    let bin = lbagent_release_bin();
    let (api_a, api_b) = (bed.a.dirs.path("api.sock"), bed.b.dirs.path("api.sock"));
    let (prio_a, prio_b) = (bed.a.dirs.path("sd/ha-priority"), bed.b.dirs.path("sd/ha-priority"));
    let vrid = 1 + (std::process::id() % 200) as u8 + (advert * 10.0) as u8 % 50;
    let mut ks = Keepalived::agent_pair(
        vrid,
        advert,
        [
            Drives { lbagent: &bin, api_socket: &api_a, priority_file: &prio_a },
            Drives { lbagent: &bin, api_socket: &api_b, priority_file: &prio_b },
        ],
    )?;
    wait_for(|| active_of(&bed).is_ok(), "one agent active");
    let (act, stb) = active_of(&bed)?;
    wait_synced(stb, 0);
    let flows = bed.flows_of(HELD.0, HELD.1, HELD.2);
    wait_synced(stb, (HELD.0 + HELD.1 + HELD.2) as u64);
    std::thread::sleep(Duration::from_millis(1500));
    let vns = bed.vpc.ns.name.clone();
    let mut rows = Vec::new();
    let switch = |from: &Side| {
        let (ok, msg) = from.ha(&["switchover"]);
        if ok { Ok(()) } else { bail!("switchover: {msg}") }
    };
    let (flows, row) = measure("planned switchover", &vns, flows, || switch(act))?;
    rows.push(row);
    wait_synced(act, 1);
    let (flows, row) = measure("failback", &vns, flows, || switch(stb))?;
    rows.push(row);
    wait_synced(stb, 1);
    let i = if act.tag == "a" { 0 } else { 1 };
    let (_, row) = measure("the active dies", &vns, flows, || {
        ks[i].kill();
        bed.kill(act, &mut agents[i]);
        wait_for(|| stb.status()["role"] == "active", "the standby promoted");
        Ok(())
    })?;
    rows.push(row);
    Ok(rows)
}

/// One reference gateway host: a namespace with `eth0` on the LAN bridge,
/// `net1` on the external bridge, `sync0` to its peer; iptables rules,
/// conntrackd, keepalived.
struct RefHost {
    ns: Netns,
    dir: PathBuf,
    conntrackd: Option<Child>,
    keepalived: Option<Keepalived>,
    host_links: [String; 2],
    keepalived_conf: String,
}

impl RefHost {
    fn conntrackd(&self, args: &[&str]) -> Result<String> {
        let conf = self.dir.join("conntrackd.conf");
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns.name, "conntrackd", "-C"])
            .arg(&conf)
            .args(args)
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn start_keepalived(&mut self) -> Result<()> {
        self.keepalived = Some(Keepalived::start(&self.ns.name, &self.keepalived_conf)?);
        Ok(())
    }

    fn is_master(&self) -> bool {
        self.ns.exec(&["ip", "-o", "addr", "show", "dev", "net1"]).is_ok_and(|o| o.contains("198.51.100.11/"))
    }

    fn die(&mut self) {
        if let Some(mut k) = self.keepalived.take() {
            k.kill();
        }
        if let Some(mut c) = self.conntrackd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for l in &self.host_links {
            let _ = sh(&["ip", "link", "set", l, "down"]);
        }
    }
}

impl Drop for RefHost {
    fn drop(&mut self) {
        self.die();
        for l in &self.host_links {
            let _ = sh(&["ip", "link", "del", l]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The reference pair and its surroundings.
struct RefBed {
    hosts: [RefHost; 2],
    vpc: TestHost,
    _internet: TestHost,
    _lan: OvsBridge,
    _ext: LinuxBridge,
}

impl RefBed {
    fn new(advert: f64) -> Result<RefBed> {
        let lan = OvsBridge::new(&unique("brr"))?;
        let ext = LinuxBridge::new(&unique("brx"))?;
        let ext_name = ext.name.clone();
        let internet =
            TestHost::on(|p| sh(&["ip", "link", "set", p, "master", &ext_name]).map(|_| ()), INTERNET_IP, 24, "")?;
        let vpc = TestHost::on(|p| lan.add_port(p), "10.10.0.22", 24, LAN_GW_IP)?;
        line_echo_server(&internet.ns.name, 9000, "inet")?;
        udp_echo_forever(&internet.ns.name, 9001)?;
        line_echo_server(&vpc.ns.name, 8080, "vpc")?;
        let (sa, sb) = (unique("rsa"), unique("rsb"));
        sh(&["ip", "link", "add", &sa, "type", "veth", "peer", "name", &sb])?;
        let mut hosts = Vec::new();
        for i in 0..2usize {
            let ns = Netns::new(&unique(if i == 0 { "lbra" } else { "lbrb" }))?;
            let dir = std::env::temp_dir().join(unique("refha"));
            std::fs::create_dir_all(&dir)?;
            let (lan_host, ext_host) = (unique("rl"), unique("rx"));
            for (host, inner) in [(&lan_host, "eth0"), (&ext_host, "net1")] {
                sh(&["ip", "link", "add", host, "type", "veth", "peer", "name", inner, "netns", &ns.name])?;
                sh(&["ip", "link", "set", host, "up"])?;
            }
            lan.add_port(&lan_host)?;
            sh(&["ip", "link", "set", &ext_host, "master", &ext_name])?;
            let sync = if i == 0 { &sa } else { &sb };
            sh(&["ip", "link", "set", sync, "netns", &ns.name])?;
            ns.exec(&["ip", "link", "set", sync, "name", "sync0"])?;
            let me = i + 1;
            for (ifname, addr) in [
                ("eth0", format!("10.10.0.{}/24", 250 + i)),
                ("net1", format!("198.51.100.{}/24", 250 + i)),
                ("sync0", format!("10.253.0.{me}/24")),
            ] {
                ns.exec(&["ip", "addr", "add", &addr, "dev", ifname])?;
                ns.exec(&["ip", "link", "set", ifname, "up"])?;
            }
            ns.exec(&["ip", "route", "replace", "default", "via", INTERNET_IP, "dev", "net1"])?;
            ns.sysctl("net.ipv4.ip_forward", "1")?;
            super::iptables_restore(
                &ns.name,
                "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
                 -A PREROUTING -i net1 -d 198.51.100.12 -p tcp --dport 80 -j DNAT --to-destination 10.10.0.22:8080\n\
                 -A POSTROUTING -o net1 -s 10.10.0.0/24 -j SNAT --to-source 198.51.100.11 --random-fully\nCOMMIT\n",
            )?;
            let peer = 3 - me;
            let ctl = dir.join("conntrackd.ctl");
            let conntrackd_conf = format!(
                "Sync {{\n  Mode FTFW {{\n    DisableExternalCache Off\n    CommitTimeout 1800\n    PurgeTimeout 5\n  }}\n\
                 \x20 UDP {{\n    IPv4_address 10.253.0.{me}\n    IPv4_Destination_Address 10.253.0.{peer}\n    Port 3780\n    Interface sync0\n\
                 \x20   SndSocketBuffer 1249280\n    RcvSocketBuffer 1249280\n    Checksum on\n  }}\n}}\n\
                 General {{\n  HashSize 32768\n  HashLimit 131072\n  LogFile {}\n  LockFile {}\n  UNIX {{\n    Path {}\n  }}\n\
                 \x20 NetlinkBufferSize 2097152\n  NetlinkBufferSizeMaxGrowth 8388608\n\
                 \x20 Filter From Userspace {{\n    Protocol Accept {{\n      TCP\n      UDP\n      ICMP\n    }}\n\
                 \x20   Address Ignore {{\n      IPv4_address 127.0.0.1\n      IPv4_address 10.253.0.0/24\n    }}\n  }}\n}}\n",
                dir.join("conntrackd.log").display(),
                dir.join("conntrackd.lock").display(),
                ctl.display()
            );
            std::fs::write(dir.join("conntrackd.conf"), conntrackd_conf)?;
            let conf = dir.join("conntrackd.conf").display().to_string();
            // conntrack-tools' primary-backup.sh, for this configuration.
            let script = format!(
                "#!/bin/sh\ncase \"$1\" in\n primary)\n  conntrackd -C {conf} -c\n  conntrackd -C {conf} -f\n  \
                 conntrackd -C {conf} -R\n  conntrackd -C {conf} -B\n  ;;\n backup)\n  conntrackd -C {conf} -n\n  ;;\n \
                 fault)\n  conntrackd -C {conf} -t\n  ;;\nesac\n"
            );
            std::fs::write(dir.join("notify.sh"), script)?;
            let run = |what: &str| format!("\"/bin/sh {} {what}\"", dir.join("notify.sh").display());
            let keepalived_conf = format!(
                "global_defs {{\n  router_id refha{me}\n  script_user root\n  vrrp_version 3\n  max_auto_priority -1\n}}\n\
                 vrrp_instance refha {{\n  state BACKUP\n  interface sync0\n  virtual_router_id 61\n  priority 100\n  advert_int {advert}\n\
                 \x20 unicast_src_ip 10.253.0.{me}\n  unicast_peer {{\n    10.253.0.{peer}\n  }}\n  virtual_ipaddress {{\n\
                 \x20   {LAN_GW_IP}/24 dev eth0\n    198.51.100.11/24 dev net1\n    198.51.100.12/24 dev net1\n  }}\n\
                 \x20 notify_master {}\n  notify_backup {}\n  notify_fault {}\n}}\n",
                run("primary"),
                run("backup"),
                run("fault")
            );
            let conntrackd = Command::new("ip")
                .args(["netns", "exec", &ns.name, "conntrackd", "-C", &conf])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting conntrackd")?;
            wait_for(|| ctl.exists(), "conntrackd's control socket");
            hosts.push(RefHost {
                ns,
                dir,
                conntrackd: Some(conntrackd),
                keepalived: None,
                host_links: [lan_host, ext_host],
                keepalived_conf,
            });
        }
        let [mut a, mut b]: [RefHost; 2] = hosts.try_into().map_err(|_| anyhow::anyhow!("two hosts"))?;
        a.start_keepalived()?;
        b.start_keepalived()?;
        Ok(RefBed { hosts: [a, b], vpc, _internet: internet, _lan: lan, _ext: ext })
    }

    fn master(&self) -> Option<usize> {
        let m: Vec<usize> = (0..2).filter(|&i| self.hosts[i].is_master()).collect();
        (m.len() == 1).then(|| m[0])
    }

    fn flows(&self) -> Result<Flows> {
        let (vns, ins) = (self.vpc.ns.name.clone(), self._internet.ns.name.clone());
        let mut flows = Flows {
            out: (0..HELD.0).map(|_| OpenConn::open(&vns, at(INTERNET_IP, 9000))).collect::<Result<_>>()?,
            inbound: (0..HELD.1).map(|_| OpenConn::open(&ins, at("198.51.100.12", 80))).collect::<Result<_>>()?,
            udp: (0..HELD.2).map(|_| UdpFlow::open(&vns, 0, at(INTERNET_IP, 9001))).collect::<Result<_>>()?,
            udp_seen: Vec::new(),
        };
        flows.udp_seen = flows.udp.iter().map(|f| f.ask("hi")).collect::<Result<_>>()?;
        Ok(flows)
    }
}

/// The reference pair at `advert`: a planned switchover (keepalived
/// stopped on the master: its last advert gives the role away, as an
/// operator hands over), the failback the same way, the master's death.
fn reference(advert: f64) -> Result<Vec<String>> {
    let mut bed = RefBed::new(advert)?;
    wait_for(|| bed.master().is_some(), "a VRRP master");
    // The backup's external cache fills as flows are made.
    std::thread::sleep(Duration::from_millis(500));
    let flows = bed.flows()?;
    std::thread::sleep(Duration::from_millis(2000));
    let vns = bed.vpc.ns.name.clone();
    let mut rows = Vec::new();
    let mut flows = Some(flows);
    for name in ["planned switchover", "failback"] {
        let m = bed.master().context("no single master")?;
        let hosts = &mut bed.hosts;
        let (f, row) = measure(name, &vns, flows.take().unwrap(), || {
            if let Some(mut k) = hosts[m].keepalived.take() {
                k.stop_with("-TERM");
            }
            wait_for(|| hosts[1 - m].is_master(), "the backup took over");
            hosts[m].start_keepalived()
        })?;
        flows = Some(f);
        rows.push(row);
        std::thread::sleep(Duration::from_millis(2000));
    }
    let m = bed.master().context("no single master")?;
    let hosts = &mut bed.hosts;
    let (_, row) = measure("the active dies", &vns, flows.take().unwrap(), || {
        hosts[m].die();
        wait_for(|| hosts[1 - m].is_master(), "the backup took over");
        Ok(())
    })?;
    rows.push(row);
    Ok(rows)
}

/// New UDP flows (each one datagram from a fresh source port) from the VPC
/// host at `rate` for `dur`; how many were sent.
fn burst(ns: &str, to: SocketAddr, rate: u32, dur: Duration, first_port: u16) -> Result<u32> {
    spawn_in(ns, move || {
        let began = Instant::now();
        let mut sent = 0u32;
        while began.elapsed() < dur {
            let due = (began.elapsed().as_secs_f64() * rate as f64) as u32;
            while sent < due.min(60_000) {
                let port = first_port.wrapping_add(sent as u16).max(1024);
                if let Ok(s) = std::net::UdpSocket::bind(("0.0.0.0", port)) {
                    let _ = s.send_to(b"n", to);
                }
                sent += 1;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(sent)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the sender panicked"))?
}

/// How many new flows per second each pair keeps in sync: bursts of new
/// UDP flows through the active, counted on the standby (the agent's
/// flows written from its peer; conntrackd's external cache).
fn capacity(quick: bool, out: &mut String) -> Result<()> {
    let rates: &[u32] = if quick { &[2000] } else { &[2000, 5000, 10000] };
    let dur = Duration::from_secs(3);
    writeln!(
        out,
        "\nSync capacity: new UDP flows (one datagram each, a fresh source port) through the active for {} s at each rate; \
         *created*: new flows in the active's tables; *synced*: of those, the ones the standby holds 1.5 s after the \
         burst (the agent: its conntrack tables; conntrackd: its external cache). Sync lag: from a new flow's start record in the ring to the peer's \
         acknowledgement that it wrote it.\n",
        dur.as_secs()
    )?;
    writeln!(
        out,
        "| pair | offered flows/s | created | synced | lag p50 | lag p99 | drops (active; standby) |\n|---|---:|---:|---:|---:|---:|---|"
    )?;
    // The agent pair (no arbiter needed: promoted by hand).
    let bed = Bed::with_bin(lbagent_release_bin());
    let _agents = [bed.start(&bed.a), bed.start(&bed.b)];
    bed.wait_applied();
    let (ok, msg) = bed.a.ha(&["promote"]);
    if !ok {
        bail!("promote: {msg}");
    }
    wait_synced(&bed.b, 0);
    // UDP flows to the echo server in a side's conntrack tables.
    let flows_in = |side: &Side| -> Result<u64> {
        let t = lbagent::dataplane::tables::Tables::open(&side.dirs.bpffs)?;
        let server = INTERNET_IP.parse::<std::net::Ipv4Addr>()?.octets();
        let n = t.conntrack_matching(|k, e| {
            e.flags & lbagent_common::CT_F_REPLY == 0
                && k.proto == lbagent_common::PROTO_UDP
                && k.daddr == server
                && (k.dport == 9001 || k.dport == 9001u16.to_be())
        })?;
        Ok(n.len() as u64)
    };
    let mut port = 10_000u16;
    for &rate in rates {
        let (a0, b0) = (flows_in(&bed.a)?, flows_in(&bed.b)?);
        let sent = burst(&bed.vpc.ns.name, at(INTERNET_IP, 9001), rate, dur, port)?;
        port = port.wrapping_add(sent as u16);
        std::thread::sleep(Duration::from_millis(1500));
        let a = bed.a.status();
        let b = bed.b.status();
        let created = flows_in(&bed.a)?.saturating_sub(a0);
        let synced = flows_in(&bed.b)?.saturating_sub(b0);
        let drops = |v: &serde_json::Value| {
            let d = v["dropped"].as_object().cloned().unwrap_or_default();
            let nonzero: Vec<String> =
                d.iter().filter(|(_, n)| n.as_u64().unwrap_or(0) > 0).map(|(k, n)| format!("{k} {n}")).collect();
            if nonzero.is_empty() { "none".to_string() } else { nonzero.join(", ") }
        };
        writeln!(
            out,
            "| agent pair | {rate} | {created} | {} | {:.2} ms | {:.2} ms | {}; {} |",
            synced.min(created),
            a["lag_ms_p50"].as_f64().unwrap_or(f64::NAN),
            a["lag_ms_p99"].as_f64().unwrap_or(f64::NAN),
            drops(&a),
            drops(&b)
        )?;
        eprint!(".");
    }
    drop(_agents);
    drop(bed);
    let bed = RefBed::new(0.1)?;
    wait_for(|| bed.master().is_some(), "a VRRP master");
    std::thread::sleep(Duration::from_millis(1000));
    let m = bed.master().context("no single master")?;
    let count =
        |h: &RefHost| -> u64 { h.ns.exec(&["conntrack", "-C"]).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0) };
    let external = |h: &RefHost| -> u64 {
        let s = h.conntrackd(&["-s", "cache"]).unwrap_or_default();
        // "cache:external\tactive objects:\t N"
        s.split("cache:external")
            .nth(1)
            .and_then(|t| t.split("active objects:").nth(1)?.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let mut port = 10_000u16;
    for &rate in rates {
        let (c0, e0) = (count(&bed.hosts[m]), external(&bed.hosts[1 - m]));
        let sent = burst(&bed.vpc.ns.name, at(INTERNET_IP, 9001), rate, dur, port)?;
        port = port.wrapping_add(sent as u16);
        std::thread::sleep(Duration::from_millis(1500));
        let created = count(&bed.hosts[m]).saturating_sub(c0);
        let synced = external(&bed.hosts[1 - m]).saturating_sub(e0);
        writeln!(out, "| iptables + conntrackd | {rate} | {created} | {} | | | |", synced.min(created))?;
        eprint!(".");
    }
    Ok(())
}
