//! Section 20, flow logs: what logging adds to a new flow's packet in the
//! program, and the new flows per second logged without loss through a NAT
//! namespace, beside iptables with ulogd2 (conntrack events from NFCT,
//! exported as IPFIX), the logging operators run with iptables today. Both
//! export to a real collector (nfdump's nfcapd) whose decoded records are
//! counted.

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::SocketAddr,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use lbagent::{
    alloc::Allocations,
    dataplane::{attach::AttachMode, loader::CtSizes},
    flow_log::{FlowLogStatus, FlowLogger},
    state::flow_log::{FlowLogSpec, IpfixSpec, JsonlSpec},
};
use lbagent_common::{Counter, FlowLogZone, NatConfig};
use lbagent_tests::{
    collector::Nfcapd,
    engine::TestZone,
    packet::{Ip, L4, frame},
    topology::{NatTopology, SERVER, SNAT, ZONE},
};

use super::{UDP_BENCH_TIMEOUT_S, UDP_CLIENTS, iptables_restore, median, udp_flow_rate, wide_snat};

pub fn flow_log(quick: bool, out: &mut String) -> Result<()> {
    cost(if quick { 1 } else { 5 }, out)?;
    rates(if quick { 1 } else { 2 }, Duration::from_secs(if quick { 5 } else { 10 }), out)
}

/// The program's time for a new flow's first packet (a UDP query through
/// a DNAT rule), each flow timed once, with the zone logging start and end
/// records (the start record written, the counts created) and without.
fn cost(reps: usize, out: &mut String) -> Result<()> {
    const FLOWS: u32 = 4000;
    let mut e = TestZone::with_dns_rule(ZONE, 7)?;
    let mut ring = e.tables.flow_events()?;
    let mut off = Vec::new();
    let mut on = Vec::new();
    for round in 0..reps as u32 {
        for logging in [false, true] {
            let z = if logging { FlowLogZone { flags: 3, sample: 1 } } else { FlowLogZone::default() };
            e.tables.set_flow_log_zone(ZONE, z)?;
            let mut total = 0.0;
            for i in 0..FLOWS {
                let src = [10, 1 + (round * 2 + logging as u32) as u8, (i >> 8) as u8, i as u8];
                let f = frame(
                    &Ip::new(src, [198, 51, 100, 10]),
                    &L4::Udp { sport: 3000, dport: 53, payload: vec![0; 64], zero_csum: false },
                );
                total += e.time(&f, 1)?;
            }
            (if logging { &mut on } else { &mut off }).push(total / FLOWS as f64);
            // The next round starts from empty tables and an empty ring.
            while ring.next().is_some() {}
            e.tables.flush_conntrack(|_, _| true)?;
            let mut keys = Vec::new();
            e.tables.each_flow_acct(|k, _| keys.extend_from_slice(k))?;
            e.tables.remove_flow_acct(&keys)?;
        }
        eprint!(".");
    }
    let (off, on) = (median(off), median(on));
    let capacity = capacity(&mut e)?;
    writeln!(
        out,
        "\n## 20. Flow logs\n\nA new flow's first packet in the program (BPF_PROG_TEST_RUN, each of {FLOWS} new UDP flows through a DNAT rule timed once; median of {reps} rounds):\n"
    )?;
    writeln!(out, "| flow logs | ns per new flow |\n|---|---:|")?;
    writeln!(out, "| off | {off:.0} |\n| start and end (start record, counts created) | {on:.0} |")?;
    writeln!(out, "\nLogging adds {:.0} ns to a new flow.", on - off)?;
    let (offered, logged, lost) = capacity;
    writeln!(
        out,
        "\nThe logger's capacity: new flows made as fast as one core runs the program (BPF_PROG_TEST_RUN, {CAPACITY_SECS} s), their start records consumed by the agent's logger on the other core and written as JSON Lines: {offered:.0} new flows/s offered, {logged:.0} records/s logged, {lost} lost (`flow_log_ring_full`).",
    )?;
    Ok(())
}

const CAPACITY_SECS: u64 = 3;

/// New flows through `e`'s DNAT rule, as fast as this thread runs the
/// program, for [`CAPACITY_SECS`], with a logger consuming their start
/// records (JSON Lines in a temporary directory): (flows/s offered,
/// records/s logged, records lost to a full ring).
fn capacity(e: &mut TestZone) -> Result<(f64, f64, u64)> {
    let dir = std::env::temp_dir().join(lbagent_tests::unique("flowcap"));
    let mut alloc = Allocations::default();
    alloc.zones.insert("natgw/bench".into(), ZONE);
    let status = Arc::new(Mutex::new(FlowLogStatus::default()));
    let seen = status.clone();
    let mut logger = FlowLogger::new(e.pins.root.clone(), dir.clone(), move |s| *seen.lock().unwrap() = s.clone());
    let spec = FlowLogSpec {
        start: true,
        end: false,
        objects: BTreeSet::new(),
        kinds: BTreeSet::new(),
        sample: 1,
        ipfix: vec![],
        jsonl: Some(JsonlSpec::File { name: "flows.jsonl".into(), max_bytes: 1 << 32, keep: 1 }),
    };
    logger.sync(Some(&spec), &alloc, None)?;
    let lost_before = e.tables.counter(Counter::FlowLogRingFull)?;
    let started = Instant::now();
    let mut flows = 0u32;
    while started.elapsed() < Duration::from_secs(CAPACITY_SECS) {
        let src = [10, 100 + (flows >> 24) as u8 % 100, (flows >> 16) as u8, (flows >> 8) as u8];
        let f = frame(
            &Ip::new(src, [198, 51, 100, 10]),
            &L4::Udp { sport: 1024 + (flows as u16 & 0xff), dport: 53, payload: vec![0; 64], zero_csum: false },
        );
        e.time(&f, 1)?;
        flows += 1;
        if flows % 50_000 == 0 {
            // Keep `ct_new` from filling (its LRU would evict, not refuse).
            e.tables.flush_conntrack(|_, _| true)?;
        }
    }
    let took = started.elapsed().as_secs_f64();
    let lost = e.tables.counter(Counter::FlowLogRingFull)? - lost_before;
    let limit = Instant::now() + Duration::from_secs(30);
    while status.lock().unwrap().jsonl_written + lost < u64::from(flows) && Instant::now() < limit {
        std::thread::sleep(Duration::from_millis(200));
    }
    let logged = status.lock().unwrap().jsonl_written;
    logger.sync(None, &alloc, None)?;
    e.tables.flush_conntrack(|_, _| true)?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok((f64::from(flows) / took, logged as f64 / took, lost))
}

/// ulogd2 in `ns`: conntrack new and destroy events (NFCT) exported as
/// IPFIX to `collector` over UDP. Killed on drop.
struct Ulogd {
    child: Child,
    dir: std::path::PathBuf,
}

impl Ulogd {
    fn start(ns: &str, collector: SocketAddr) -> Result<Ulogd> {
        let dir = std::env::temp_dir().join(lbagent_tests::unique("ulogd"));
        std::fs::create_dir_all(&dir)?;
        let conf = dir.join("ulogd.conf");
        let lib = "/usr/lib/x86_64-linux-gnu/ulogd";
        std::fs::write(
            &conf,
            format!(
                "[global]\nlogfile=\"{}\"\nloglevel=5\nplugin=\"{lib}/ulogd_inpflow_NFCT.so\"\nplugin=\"{lib}/ulogd_output_IPFIX.so\"\nstack=ct1:NFCT,ipfix1:IPFIX\n\n[ct1]\nevent_mask=0x00000005\nhash_enable=0\nnetlink_socket_buffer_size=8388608\nnetlink_socket_buffer_maxsize=8388608\n\n[ipfix1]\noid=1\nhost=\"{}\"\nport={}\nproto=\"udp\"\nsend_template=\"always\"\n",
                dir.join("ulogd.log").display(),
                collector.ip(),
                collector.port()
            ),
        )?;
        let child = Command::new("ip")
            .args(["netns", "exec", ns, "ulogd", "-c"])
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting ulogd")?;
        std::thread::sleep(Duration::from_millis(500));
        Ok(Ulogd { child, dir })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("ulogd.log")).unwrap_or_default()
    }
}

impl Drop for Ulogd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Records an nfcapd decoded.
fn decoded(c: Nfcapd) -> Result<usize> {
    Ok(c.records()?.len())
}

/// New UDP flows/s to one resolver through one SNAT address (section 6's
/// load), each flow logged at its start and its end, against the same
/// without logs; iptables likewise with and without ulogd2.
fn rates(reps: usize, dur: Duration, out: &mut String) -> Result<()> {
    let resolver = SocketAddr::from((SERVER, 53));
    let linux_max: u32 = std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_max")?.trim().parse()?;
    let ebpf = NatTopology::sized(AttachMode::Auto, CtSizes::new(None, Some(2 * linux_max)))?;
    wide_snat(&ebpf)?;
    let cfg = ebpf.tables.config()?;
    ebpf.tables.set_config(NatConfig { udp_s: UDP_BENCH_TIMEOUT_S, ..cfg })?;
    let ipt = NatTopology::plain()?;
    iptables_restore(
        &ipt.nat.name,
        &format!(
            "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -o {} -p udp -j SNAT --to-source {SNAT}:1024-65535 --random-fully\nCOMMIT\n",
            ipt.ifaces[1]
        ),
    )?;
    ipt.nat.sysctl("net.netfilter.nf_conntrack_udp_timeout", &UDP_BENCH_TIMEOUT_S.to_string())?;
    ipt.nat.sysctl("net.netfilter.nf_conntrack_acct", "1")?;
    for t in [&ebpf, &ipt] {
        for k in 1..UDP_CLIENTS {
            t.client.exec(&["ip", "addr", "add", &format!("10.0.1.{}/24", 2 + k), "dev", &t.client_if])?;
        }
        lbagent_tests::traffic::udp_echo_forever(&t.server.name, 53)?;
    }
    let mut alloc = Allocations::default();
    alloc.zones.insert("natgw/bench".into(), ZONE);
    let log_dir = std::env::temp_dir().join(lbagent_tests::unique("flowlogs"));
    // Rows: (name, flows/s, expected records, exported records, lost records).
    let mut rows: Vec<(&str, Vec<f64>, u64, u64, u64)> = vec![
        ("eBPF engine, no flow logs", vec![], 0, 0, 0),
        ("eBPF engine, flow logs (start and end, IPFIX to nfcapd and JSON Lines)", vec![], 0, 0, 0),
        ("iptables, no logs", vec![], 0, 0, 0),
        ("iptables + ulogd2 (NFCT new and destroy events, IPFIX to nfcapd)", vec![], 0, 0, 0),
    ];
    for _ in 0..reps {
        // eBPF without, then with logs (a logger of its own each round:
        // its counts start at zero).
        rows[0].1.push(udp_flow_rate(&ebpf.client.name, resolver, dur)?.0);
        let status = Arc::new(Mutex::new(FlowLogStatus::default()));
        let seen = status.clone();
        let mut logger =
            FlowLogger::new(ebpf.pins.root.clone(), log_dir.clone(), move |s| *seen.lock().unwrap() = s.clone());
        let collector = Nfcapd::start()?;
        let spec = FlowLogSpec {
            start: true,
            end: true,
            objects: BTreeSet::new(),
            kinds: BTreeSet::new(),
            sample: 1,
            ipfix: vec![IpfixSpec {
                collector: collector.addr,
                template_refresh: Duration::from_secs(10),
                observation_domain: 1,
            }],
            jsonl: Some(JsonlSpec::File { name: "flows.jsonl".into(), max_bytes: 1 << 30, keep: 1 }),
        };
        let new_before = ebpf.tables.counter(Counter::NewFlows)?;
        logger.sync(Some(&spec), &alloc, None)?;
        rows[1].1.push(udp_flow_rate(&ebpf.client.name, resolver, dur)?.0);
        let flows = ebpf.tables.counter(Counter::NewFlows)? - new_before;
        // Every flow's end: its timeout, then a scan of the counts.
        let limit = Instant::now() + Duration::from_secs(u64::from(UDP_BENCH_TIMEOUT_S) + 30);
        while status.lock().unwrap().end_records < flows && Instant::now() < limit {
            lbagent::dataplane::ct_gc::collect(&ebpf.pins.root)?;
            std::thread::sleep(Duration::from_millis(500));
        }
        std::thread::sleep(Duration::from_millis(1500));
        let st = status.lock().unwrap().clone();
        logger.sync(None, &alloc, None)?;
        let got = decoded(collector)? as u64;
        rows[1].2 += 2 * flows;
        rows[1].3 += got;
        rows[1].4 += (2 * flows).saturating_sub(got);
        eprintln!("flow logs: {flows} flows, {} end records, {got} decoded, dropped {:?}", st.end_records, st.dropped);
        let _ = std::fs::remove_dir_all(&log_dir);
        // iptables without, then with ulogd2 (from an empty table: the
        // first run's flows would end during the second and be logged).
        rows[2].1.push(udp_flow_rate(&ipt.client.name, resolver, dur)?.0);
        ipt.nat.exec(&["conntrack", "-F"])?;
        let collector = Nfcapd::start_in(Some(&ipt.nat.name))?;
        let ulogd = Ulogd::start(&ipt.nat.name, collector.addr)?;
        let started = Instant::now();
        let (rate, lost) = udp_flow_rate(&ipt.client.name, resolver, dur)?;
        rows[3].1.push(rate);
        let flows = (rate * started.elapsed().as_secs_f64()) as u64 + u64::from(lost);
        // The destroy events: the flows' timeout, then the kernel's GC,
        // until the table is empty.
        std::thread::sleep(Duration::from_secs(u64::from(UDP_BENCH_TIMEOUT_S)));
        let limit = Instant::now() + Duration::from_secs(90);
        while Instant::now() < limit && ipt.nat.exec(&["conntrack", "-C"])?.trim() != "0" {
            std::thread::sleep(Duration::from_millis(500));
        }
        std::thread::sleep(Duration::from_secs(2));
        let log = ulogd.log();
        drop(ulogd);
        let got = decoded(collector)? as u64;
        rows[3].2 += 2 * flows;
        rows[3].3 += got;
        rows[3].4 += (2 * flows).saturating_sub(got);
        let lost_events = log.lines().filter(|l| l.contains("lost") || l.contains("ENOBUFS")).count();
        eprintln!("ulogd2: ~{flows} flows, {got} decoded, {lost_events} lines about lost events");
        eprint!(".");
    }
    writeln!(
        out,
        "\nNew UDP flows per second to one resolver through one SNAT address (section 6's load, one client thread; {} s runs, median of {reps}, UDP timeout {UDP_BENCH_TIMEOUT_S} s). Records: each flow's start and end, as the collector (nfcapd) decoded them, summed over the runs; lost = expected − decoded.\n",
        dur.as_secs()
    )?;
    writeln!(
        out,
        "| path | answered flows/s | records expected | records decoded | records lost |\n|---|---:|---:|---:|---:|"
    )?;
    for (name, rates, expected, got, lost) in rows {
        if expected == 0 {
            writeln!(out, "| {name} | {:.0} | – | – | – |", median(rates))?;
        } else {
            writeln!(out, "| {name} | {:.0} | {expected} | {got} | {lost} |", median(rates))?;
        }
    }
    Ok(())
}
