//! Section 17 of `cargo xtask bench`: up to a million flows. For each size N
//! the established table is sized for N flows (`--conntrack-max 2N`
//! halves; `ct_new` its default quarter) and filled with N TCP flows
//! through the program (`BPF_PROG_TEST_RUN`: SYN, SYN-ACK, ACK each), half
//! DNAT'ed (client → VIP:80 → server:8080) and half SNAT'ed (10.x → the
//! internet:443, source port picked by the program). Reported per size:
//! the kernel-accounted memory of both tables (`memlock` in the map's
//! fdinfo) per flow, and the release agent's commands, as installed: `gc`
//! with nothing idle and with every flow idle, `list` with a filter (wall,
//! CPU, the process's peak RSS). Beside it, Linux conntrack filled with
//! the same mix (half DNAT, half SNAT, real packets from a raw socket into
//! an iptables NAT namespace): the kernel's slab memory it took per flow,
//! and its hash table. At the largest size, a whole-table read in batches
//! against entry by entry (in the bench's debug build: compare the two).

use std::{
    fmt::Write as _,
    io::Read as _,
    net::Ipv4Addr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use aya::maps::MapData;
use lbagent::dataplane::pins;
use lbagent_common::{MAP_CT, MAP_CT_NEW, NatConfig, PROTO_TCP};
use lbagent_tests::{
    engine::{TC_ACT_OK, TestZone},
    fixture::{self, ZONE},
    lbagent_release_bin,
    packet::{ACK, Ip, L4, SYN, frame, summary},
    topology::{NatTopology, spawn_in},
};
use nix::sys::resource::{UsageWho, getrusage};

/// Flows per size (the established table holds exactly this many).
const SIZES: [u32; 4] = [131_072, 262_144, 524_288, 1_048_576];
const QUICK_SIZES: [u32; 2] = [131_072, 262_144];

/// Kernel memory charged for a pinned map (`memlock` in its fdinfo).
fn memlock(path: &Path) -> Result<u64> {
    use std::os::fd::{AsFd, AsRawFd};
    let map = MapData::from_pin(path)?;
    let fd = map.fd().as_fd().as_raw_fd();
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
    info.lines()
        .find_map(|l| l.strip_prefix("memlock:").map(|v| v.trim().parse::<u64>()))
        .context("no memlock in the map's fdinfo")?
        .context("memlock")
}

/// CPU seconds (user + system) this process, or its waited-for children, used.
fn cpu_of(who: UsageWho) -> f64 {
    getrusage(who)
        .map(|u| {
            let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
            t(u.user_time()) + t(u.system_time())
        })
        .unwrap_or(0.0)
}

/// One run of a command: its output, wall and CPU seconds, peak RSS (MB).
struct Run {
    stdout: String,
    wall: f64,
    cpu: f64,
    rss_mb: f64,
}

impl Run {
    fn cells(&self) -> String {
        format!("{:.2} s / {:.2} s / {:.0} MB", self.wall, self.cpu, self.rss_mb)
    }
}

/// Runs the release agent's `args`: its output, wall and CPU time (its
/// own, from the children's usage), and its peak RSS, sampled from
/// `VmHWM` while it runs (`wait4`'s `ru_maxrss` would count this large
/// process's RSS, which the child's spawn inherits until its exec).
fn agent(args: &[&str], root: &Path) -> Result<Run> {
    let (t, c) = (Instant::now(), cpu_of(UsageWho::RUSAGE_CHILDREN));
    let mut child = std::process::Command::new(lbagent_release_bin())
        .args(args)
        .arg("--bpffs")
        .arg(root)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut pipes = (child.stdout.take().context("stdout")?, child.stderr.take().context("stderr")?);
    let reader = std::thread::spawn(move || {
        let (mut o, mut e) = (String::new(), String::new());
        let _ = pipes.0.read_to_string(&mut o);
        let _ = pipes.1.read_to_string(&mut e);
        (o, e)
    });
    let pid = child.id() as i32;
    let mut peak: f64 = 0.0;
    let status = loop {
        peak = peak.max(rss(pid).1);
        if let Some(s) = child.try_wait()? {
            break s;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let wall = t.elapsed().as_secs_f64();
    let (stdout, stderr) = reader.join().map_err(|_| anyhow::anyhow!("reader panicked"))?;
    if !status.success() {
        bail!("lbagent {args:?} failed: {stderr}");
    }
    Ok(Run { stdout, wall, cpu: cpu_of(UsageWho::RUSAGE_CHILDREN) - c, rss_mb: peak })
}

/// A zone with the fixture's TCP DNAT rule (VIP:80 → server:8080) and a
/// SNAT rule for 10.0.0.0/8 leaving by `v1` (the whole port range), its
/// tables sized for `flows` established flows.
fn zone(flows: u32) -> Result<TestZone> {
    let e = TestZone::with_ct_max(ZONE, Some(2 * flows))?;
    e.tables.set_dnat(&fixture::dnat(PROTO_TCP, 80, 1, &[(fixture::SERVER, 8080)]))?;
    e.tables.set_snat(&fixture::snat(([10, 0, 0, 0], 8), fixture::SNAT, (1024, 65535), false, 10))?;
    Ok(e)
}

fn tcp(flags: u8, sport: u16, dport: u16) -> L4 {
    fixture::tcp(flags, sport, dport, b"")
}

/// Opens `flows` TCP flows through the program, each by its three
/// handshake packets (so each is established, in `ct`), flow `i` being
/// [`same_mix`]`(i)` (the program picks the SNAT'ed flows' source port). Returns the
/// flows the program answered every packet of.
fn open_flows(e: &mut TestZone, flows: u32) -> Result<u32> {
    let mut opened = 0;
    for i in 0..flows {
        let (c, dst, dport) = same_mix(i);
        let ok = if i % 2 == 0 {
            let (rc1, _) = e.run(&frame(&Ip::new(c, dst), &tcp(SYN, 40000, dport)))?;
            let (rc2, _) = e.run(&frame(&Ip::new(fixture::SERVER, c), &tcp(SYN | ACK, 8080, 40000)))?;
            let (rc3, _) = e.run(&frame(&Ip::new(c, dst), &tcp(ACK, 40000, dport)))?;
            [rc1, rc2, rc3] == [TC_ACT_OK; 3]
        } else {
            let (rc1, out) = e.run(&frame(&Ip::new(c, dst), &tcp(SYN, 40000, dport)))?;
            let port = summary(&out).sport;
            let (rc2, _) = e.run(&frame(&Ip::new(dst, fixture::SNAT), &tcp(SYN | ACK, dport, port)))?;
            let (rc3, _) = e.run(&frame(&Ip::new(c, dst), &tcp(ACK, 40000, dport)))?;
            [rc1, rc2, rc3] == [TC_ACT_OK; 3]
        };
        opened += u32::from(ok);
        if i % 65_536 == 0 {
            eprint!(".");
        }
    }
    Ok(opened)
}

/// One size's eBPF figures.
struct Ebpf {
    flows: u32,
    established: usize,
    ct: u64,
    ct_new: u64,
    fill_s: f64,
    gc_kept: Run,
    list: Run,
    gc_freed: Run,
}

fn ebpf(flows: u32) -> Result<Ebpf> {
    let mut e = zone(flows)?;
    let dir = pins::versioned_dir(&e.pins.root);
    let t = Instant::now();
    let opened = open_flows(&mut e, flows)?;
    let fill_s = t.elapsed().as_secs_f64();
    let established = e.tables.conntrack_table(MAP_CT)?.len() / 2;
    if opened < flows * 99 / 100 {
        bail!("only {opened} of {flows} flows opened through the program");
    }
    let (ct, ct_new) = (memlock(&dir.join(MAP_CT.name))?, memlock(&dir.join(MAP_CT_NEW.name))?);
    let gc_kept = agent(&["conntrack", "gc"], &e.pins.root)?;
    let list = agent(&["conntrack", "list", "--addr", "100.64.0.3"], &e.pins.root)?;
    e.tables.set_config(NatConfig { tcp_established_s: 1, ..Default::default() })?;
    std::thread::sleep(Duration::from_millis(2100));
    let gc_freed = agent(&["conntrack", "gc"], &e.pins.root)?;
    eprint!(".");
    Ok(Ebpf { flows, established, ct, ct_new, fill_s, gc_kept, list, gc_freed })
}

/// `SUnreclaim` of `/proc/meminfo`, bytes: the kernel's unreclaimable slab
/// memory, where conntrack objects and their extensions live.
fn slab_unreclaimable() -> Result<u64> {
    lbagent::dataplane::loader::meminfo("SUnreclaim")
}

/// A global conntrack setting, restored when dropped.
pub struct Restore(&'static str, String);

impl Restore {
    pub fn set(path: &'static str, value: &str) -> Result<Self> {
        let was = std::fs::read_to_string(path).with_context(|| path.to_string())?.trim().to_string();
        std::fs::write(path, value).with_context(|| format!("{path} = {value}"))?;
        Ok(Restore(path, was))
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0, &self.1);
    }
}

/// One size's Linux conntrack figures.
struct Linux {
    flows: u64,
    slab: u64,
    hash: u64,
    fill_s: f64,
}

/// Linux conntrack with the same mix: a NAT namespace with iptables DNAT
/// (VIP:80 → server:8080) and SNAT (to 198.18.0.0/16, the whole port
/// range); `flows` first packets (TCP SYNs, from the same clients to the
/// same destinations as the program's flows) sent from a raw socket in the
/// client namespace. Each creates one conntrack entry with its NAT
/// extension; the memory is the growth of the kernel's unreclaimable slab
/// over the fill, divided by the entries the namespace counts.
fn linux(flows: u32) -> Result<Linux> {
    let t = NatTopology::plain()?;
    let ns = |args: &[&str]| t.nat.exec(args);
    super::iptables_restore(
        &t.nat.name,
        &format!(
            "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
             -A PREROUTING -d {vip} -p tcp --dport 80 -j DNAT --to-destination {server}:8080\n\
             -A POSTROUTING -o {out} -d 198.18.0.0/16 -p tcp -j SNAT --to-source {snat}:1024-65535\nCOMMIT\n",
            vip = Ipv4Addr::from(fixture::VIP),
            server = lbagent_tests::topology::SERVER,
            snat = lbagent_tests::topology::SNAT,
            out = t.ifaces[1],
        ),
    )?;
    ns(&["ip", "route", "add", "198.18.0.0/16", "via", "10.0.2.2"])?;
    // The server namespace drops what reaches it (no RSTs back).
    super::iptables_restore(&t.server.name, "*filter\n:INPUT DROP [0:0]\nCOMMIT\n")?;
    t.nat.sysctl("net.netfilter.nf_conntrack_tcp_timeout_syn_sent", "600")?;
    let _max = Restore::set("/proc/sys/net/netfilter/nf_conntrack_max", &(flows + flows / 4).to_string())?;
    let _buckets = Restore::set("/sys/module/nf_conntrack/parameters/hashsize", &flows.to_string())?;
    let buckets: u64 = std::fs::read_to_string("/sys/module/nf_conntrack/parameters/hashsize")?.trim().parse()?;
    let before = slab_unreclaimable()?;
    let start = Instant::now();
    spawn_in(&t.client.name, move || send_syns(flows, same_mix))
        .join()
        .map_err(|_| anyhow::anyhow!("sender panicked"))??;
    let fill_s = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(500));
    let after = slab_unreclaimable()?;
    let count: u64 = ns(&["cat", "/proc/sys/net/netfilter/nf_conntrack_count"])?.trim().parse()?;
    eprint!(".");
    Ok(Linux { flows: count, slab: after.saturating_sub(before), hash: buckets * 8, fill_s })
}

/// Flow `i` of the mix, as (source, destination, destination port): even
/// ones from 100.64.0.0/10 clients, DNAT'ed at the VIP; odd ones from
/// 10.1.0.0/16…, SNAT'ed toward one of 256 destinations in 198.18.0.0/16.
fn same_mix(i: u32) -> ([u8; 4], [u8; 4], u16) {
    let n = i / 2;
    let b = |shift: u32| (n >> shift) as u8;
    if i % 2 == 0 {
        ([100, 64 + b(16), b(8), b(0)], fixture::VIP, 80)
    } else {
        ([10, 1 + b(16), b(8), b(0)], [198, 18, b(0), 1], 443)
    }
}

/// `flows` TCP SYNs from a raw socket, flow `i` from port 40000 with the
/// addresses and destination port `tuple(i)` gives (the kernel fills in the
/// IPv4 header's checksum and length; TCP's checksum is computed here).
pub fn send_syns(flows: u32, tuple: impl Fn(u32) -> ([u8; 4], [u8; 4], u16)) -> Result<()> {
    // SAFETY: plain socket creation; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `fd` is a fresh descriptor this function owns.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    use std::os::fd::AsRawFd;
    for i in 0..flows {
        let (src, dst, dport) = tuple(i);
        let f = frame(&Ip::new(src, dst), &tcp(SYN, 40000, dport));
        let packet = &f[14..];
        let to = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(dst) },
            sin_zero: [0; 8],
        };
        // SAFETY: the buffer and the address are live for the call; sizes match.
        let rc = unsafe {
            libc::sendto(
                sock.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&to as *const libc::sockaddr_in).cast(),
                size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
    }
    Ok(())
}

pub fn flows(quick: bool, out: &mut String) -> Result<()> {
    eprintln!("bench: up to a million flows");
    let sizes: &[u32] = if quick { &QUICK_SIZES } else { &SIZES };
    let (mut ebpfs, mut linuxes) = (vec![], vec![]);
    for &n in sizes {
        ebpfs.push(ebpf(n)?);
        linuxes.push(linux(n)?);
    }

    // Whole-table reads at the largest size, batches against keys.
    let largest = *sizes.last().expect("sizes");
    let (batch, by_key) = {
        let mut e = zone(largest)?;
        open_flows(&mut e, largest)?;
        let timed = |f: &dyn Fn() -> Result<usize>| -> Result<(usize, f64)> {
            let c = cpu_of(UsageWho::RUSAGE_SELF);
            let n = f()?;
            Ok((n, cpu_of(UsageWho::RUSAGE_SELF) - c))
        };
        (
            timed(&|| Ok(e.tables.conntrack_table(MAP_CT)?.len()))?,
            timed(&|| Ok(e.tables.conntrack_table_by_key(MAP_CT)?.len()))?,
        )
    };
    writeln!(
        out,
        "\n## 17. Up to a million flows\n\n\
         For each size, `ct` holds exactly that many flows (`--conntrack-max` 2 × flows halves), `ct_new` \
         its default quarter; the flows are TCP, opened through the program (`BPF_PROG_TEST_RUN`, three \
         handshake packets each), half DNAT'ed and half SNAT'ed. Memory is the kernel's charge for each map \
         (`memlock`): hash maps preallocate, so a table costs the same empty and full. The commands are the \
         release agent's (wall / CPU / the process's peak RSS).\n\n\
         | flows | established | `ct` B/flow | with `ct_new` | fill (through the program) | `gc`, nothing idle | \
         `list --addr` | `gc`, every flow idle (freed) |\n|---:|---:|---:|---:|---:|---|---|---|"
    )?;
    for r in &ebpfs {
        writeln!(
            out,
            "| {} | {} | {:.1} | {:.1} | {:.0} flows/s | {} | {} | {} ({}) |",
            r.flows,
            r.established,
            r.ct as f64 / r.flows as f64,
            (r.ct + r.ct_new) as f64 / r.flows as f64,
            r.flows as f64 / r.fill_s,
            r.gc_kept.cells(),
            r.list.cells(),
            r.gc_freed.cells(),
            r.gc_freed.stdout.trim(),
        )?;
        if !r.gc_kept.stdout.contains("collected 0 ") {
            bail!("a GC pass with nothing idle freed flows: {}", r.gc_kept.stdout);
        }
    }
    writeln!(
        out,
        "\nLinux conntrack, the same mix (half DNAT, half SNAT, iptables-legacy; one TCP SYN per flow from a raw \
         socket): the growth of the kernel's unreclaimable slab (`SUnreclaim`) over the fill per entry, and \
         its hash table (`hashsize` set to the flows, 8 B per bucket).\n\n\
         | flows | entries | slab B/entry | + hash table B/entry | fill |\n|---:|---:|---:|---:|---:|"
    )?;
    for (n, l) in sizes.iter().zip(&linuxes) {
        let per = l.slab as f64 / l.flows.max(1) as f64;
        writeln!(
            out,
            "| {n} | {} | {per:.1} | {:.1} | {:.0} flows/s |",
            l.flows,
            per + l.hash as f64 / l.flows.max(1) as f64,
            l.flows as f64 / l.fill_s
        )?;
    }
    writeln!(
        out,
        "\nReading `ct` whole at {largest} flows ({} entries), in the bench's debug build: in batches {:.2} s \
         CPU, entry by entry {:.2} s CPU ({} entries).",
        batch.0, batch.1, by_key.1, by_key.0
    )?;
    Ok(())
}

/// `gws` NAT gateways, each with `rules` DNAT rules (an EIP port each, to
/// hosts of its LAN, port 80; the first gateway's first one to port `port`)
/// and `rules` SNAT rules (a host each): 2 × gws × rules rules in all.
fn gateways_document(lan: &str, ext: &str, gws: usize, rules: usize, port: u16, conntrack: &str) -> String {
    assert!(gws <= 1000 && rules <= 250, "each gateway has a /24 of its own, one host per rule");
    let mut s =
        format!("version: 1\nagent: {{integration_bridge: {lan}, conntrack: {{{conntrack}}}}}\nnat_gateways:\n");
    for g in 0..gws {
        // Gateway g: LAN 10.<1 + g / 250>.<g % 250>.0/24, EIP
        // 100.64.<1 + g / 250>.<2 + g % 250>.
        let (hi, lo) = (1 + g / 250, g % 250);
        let _ = write!(
            s,
            "  - name: g{g}\n    lan: {{ip: 10.{hi}.{lo}.254, prefix_len: 24, mac: \"02:00:0a:{hi:02x}:{lo:02x}:fe\", gateway: 10.{hi}.{lo}.1}}\n    \
             external: {{bridge: {ext}, prefix_len: 16, gateway: 100.64.0.1}}\n    eips: [{{name: e, ip: 100.64.{hi}.{}}}]\n    dnats:\n",
            2 + lo
        );
        let host = |j: usize| format!("10.{hi}.{lo}.{}", j + 2);
        for j in 0..rules {
            let p = if g == 0 && j == 0 { port } else { 80 };
            let _ = writeln!(
                s,
                "      - {{eip: e, protocol: tcp, external_port: {}, internal_ip: {}, internal_port: {p}}}",
                10_000 + j,
                host(j)
            );
        }
        s.push_str("    snats:\n");
        for j in 0..rules {
            let _ = writeln!(s, "      - {{eip: e, internal_cidr: {}/32}}", host(j));
        }
    }
    s
}

/// `n` established TCP flows SNAT'ed by the SNAT rules of
/// [`gateways_document`] (ids and zones from the agent's status `st`),
/// crafted into `ct`, last seen at `last_seen`: the flows of gateway `g`
/// go from its hosts in turn to one destination, each on a port of its EIP
/// of its own.
fn fill_snat_flows(
    tables: &lbagent::dataplane::tables::Tables,
    st: &serde_json::Value,
    gws: usize,
    rules: usize,
    n: u32,
    last_seen: u64,
) -> Result<()> {
    use lbagent_common::{CT_ESTABLISHED, CT_F_REPLY, CT_F_SNAT, CtEntry, MAP_CT, PROTO_TCP, Tuple};
    let mut ct = tables.hash(MAP_CT)?;
    let mut zones = vec![0u16; gws];
    for x in st["nat_gateways"].as_array().context("the gateways in the status")? {
        let g: usize =
            x["name"].as_str().and_then(|n| n.strip_prefix('g')?.parse().ok()).context("a gateway's name")?;
        zones[g] = x["zone"].as_u64().context("a gateway's zone")? as u16;
    }
    let mut ids = vec![0u32; gws * rules];
    for (g, per_gw) in ids.chunks_mut(rules).enumerate() {
        for (j, id) in per_gw.iter_mut().enumerate() {
            let key = format!("natgw/g{g}/snat/10.{}.{}.{}/32", 1 + g / 250, g % 250, j + 2);
            *id = st["rules"][&key].as_u64().with_context(|| format!("{key} in the status"))? as u32;
        }
    }
    for i in 0..n as usize {
        let (g, k) = (i % gws, i / gws);
        let (hi, lo, j) = (1 + g / 250, g % 250, k % rules);
        let (id, zone) = (ids[g * rules + j], zones[g]);
        anyhow::ensure!(k < 64_512, "{n} flows over {gws} gateways: more than a range of ports each");
        let orig = Tuple {
            saddr: [10, hi as u8, lo as u8, j as u8 + 2],
            daddr: [198, 51, 100, 1],
            sport: 10_000 + (k / rules) as u16,
            dport: 443,
            proto: PROTO_TCP,
            _pad0: 0,
            zone,
        };
        let xlate = Tuple { saddr: [100, 64, hi as u8, 2 + lo as u8], sport: 1024 + k as u16, ..orig };
        let half = CtEntry {
            xlate,
            last_seen_ns: last_seen,
            created_ms: lbagent_common::ct_clock_ms(last_seen),
            snat_rule: id,
            flags: CT_F_SNAT,
            state: CT_ESTABLISHED,
            ..Default::default()
        };
        ct.insert(&orig, &half, 0)?;
        ct.insert(&xlate.reversed(), &CtEntry { xlate: orig.reversed(), flags: CT_F_SNAT | CT_F_REPLY, ..half }, 0)?;
    }
    Ok(())
}

/// Seconds since 00:00 UTC now (the clock of the agent's log timestamps).
fn wall_of_day() -> f64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    (now.as_secs() % 86_400) as f64 + f64::from(now.subsec_micros()) / 1e6
}

/// Seconds since 00:00 UTC of the `nth` line of the agent's log holding
/// `what` (its timestamp, `2026-12-06T13:45:59.332684Z …`).
fn logged_at(log: &Path, what: &str, nth: usize) -> Option<f64> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text.lines().filter(|l| l.contains(what)).nth(nth)?;
    let time = line.split_once('T')?.1.split('Z').next()?;
    let mut parts = time.split(':');
    let (h, m, s) = (parts.next()?.parse::<f64>().ok()?, parts.next()?.parse::<f64>().ok()?, parts.next()?);
    Some(h * 3600.0 + m * 60.0 + s.parse::<f64>().ok()?)
}

/// `VmRSS` and `VmHWM` (peak) of process `pid`, MB.
fn rss(pid: i32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (kb("VmRSS:") / 1024.0, kb("VmHWM:") / 1024.0)
}

/// The peak RSS (`VmHWM`, MB) of process `pid` since the last call, which
/// then starts its next step's peak at the current RSS (`clear_refs` "5",
/// Linux 4.0 and later).
fn step_peak(pid: i32) -> f64 {
    let peak = rss(pid).1;
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
    peak
}

/// One metrics scrape (HTTP/1.0 GET): seconds, bytes.
fn scrape(addr: std::net::SocketAddr) -> Result<(f64, usize)> {
    use std::io::Write as _;
    let t = Instant::now();
    let mut s = std::net::TcpStream::connect(addr)?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n")?;
    let mut body = Vec::new();
    s.read_to_end(&mut body)?;
    if !body.starts_with(b"HTTP/1.0 200") && !body.starts_with(b"HTTP/1.1 200") {
        bail!("metrics: {}", String::from_utf8_lossy(&body[..body.len().min(200)]));
    }
    Ok((t.elapsed().as_secs_f64(), body.len()))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The agent (the release build, as installed) at scale: NAT gateways with
/// 100 000 rules, then a million flows in its tables (crafted entries,
/// idle past the document's TCP timeout, so its next GC pass frees them
/// all): its RSS at each step, the status and metrics scrapes, and a
/// change written while that GC pass runs (its apply must not wait for it).
pub fn daemon_at_scale(quick: bool, out: &mut String) -> Result<()> {
    use lbagent_tests::{
        agent::AgentDirs,
        ovs::{LinuxBridge, OvsBridge},
        unique,
    };
    let (gws, rules) = if quick { (50, 100) } else { (500, 100) };
    let flows: u32 = if quick { 262_144 } else { 1_000_000 };
    eprintln!("bench: the agent with {gws} gateways, {} rules, {flows} flows", 2 * gws * rules);
    let lan = OvsBridge::new(&unique("brf"))?;
    let ext = LinuxBridge::new(&unique("bre"))?;
    let dirs = AgentDirs::new("lbfl");
    let state = dirs.path("state.yaml");
    let idle_after = "tcp_established_s: 60";
    let doc = |port| gateways_document(&lan.name, &ext.name, gws, rules, port, idle_after);
    std::fs::write(&state, doc(80))?;
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], 19_477));
    let args: Vec<String> = [
        "--state",
        state.to_str().unwrap(),
        "--repair-interval",
        "5",
        "--conntrack-max",
        "2097152",
        "--metrics",
        &metrics.to_string(),
    ]
    .into_iter()
    .map(String::from)
    .collect();
    let t = Instant::now();
    let mut agent = dirs.spawn(&lbagent_release_bin(), &args, "agent.log");
    let pid = agent.pid().as_raw();
    let first = super::restart::wait_apply(&dirs, &agent, None, Duration::from_secs(1800))?;
    let create = t.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(6));
    let (applied_rss, applied_hwm) = rss(pid);
    let mut peaks = vec![("create every zone, first apply", step_peak(pid))];
    eprint!(".");
    let status_times = |n: usize| -> Result<f64> {
        let mut v = vec![];
        for _ in 0..n {
            let t = Instant::now();
            dirs.status_by(&lbagent_release_bin()).context("status")?;
            v.push(t.elapsed().as_secs_f64());
        }
        Ok(median(v))
    };
    let scrape_times = |n: usize| -> Result<(f64, usize)> {
        let mut v = vec![];
        let mut bytes = 0;
        for _ in 0..n {
            let (s, b) = scrape(metrics)?;
            v.push(s);
            bytes = b;
        }
        Ok((median(v), bytes))
    };
    let status_empty = status_times(5)?;
    peaks.push(("status ×5, empty tables", step_peak(pid)));
    let (metrics_empty, metrics_bytes) = scrape_times(5)?;
    peaks.push(("metrics ×5, empty tables", step_peak(pid)));
    // The flows, last seen 30 s ago: past the document's 60 s timeout 30 s
    // after the fill began, so that no pass frees part of them while they
    // are written and scraped, and the first pass after that frees them all.
    // Half the flows DNAT'ed, half SNAT'ed through the gateways' SNAT rules
    // (each pass's port census counts those).
    let tables = lbagent::dataplane::tables::Tables::open(&dirs.bpffs)?;
    let filled = Instant::now();
    let last_seen = lbagent::dataplane::tables::monotonic_ns().saturating_sub(30_000_000_000);
    super::fill_dnat_flows(&tables, flows / 2, last_seen)?;
    fill_snat_flows(&tables, &first, gws, rules, flows - flows / 2, last_seen)?;
    eprint!(".");
    peaks.push(("the fill", step_peak(pid)));
    // Scrapes with the full table, before the flows expire.
    let status_full = status_times(3)?;
    peaks.push(("status ×3, full tables", step_peak(pid)));
    let (metrics_full, _) = scrape_times(3)?;
    peaks.push(("metrics ×3, full tables", step_peak(pid)));
    // A whole pass over the full tables, with its port census: the status
    // shows every SNAT'ed flow counted (a pass runs every 5 s, and takes
    // seconds over a million flows).
    let snat_flows = u64::from(flows - flows / 2);
    let census_counted = |census: &serde_json::Value| -> u64 {
        census["snat_ports"]["rules"]
            .as_array()
            .map(|r| r.iter().map(|r| r["flows"]["tcp"].as_u64().unwrap_or(0)).sum())
            .unwrap_or(0)
    };
    let census = loop {
        let census = dirs.status_by(&lbagent_release_bin()).context("status")?;
        if census_counted(&census) >= snat_flows {
            break census;
        }
        anyhow::ensure!(
            filled.elapsed() < Duration::from_secs(26),
            "no GC pass counted the {snat_flows} SNAT'ed flows within 26 s of the fill: {}",
            census_counted(&census)
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    peaks.push(("GC passes with the port census over the full tables", step_peak(pid)));
    let counted = census_counted(&census);
    let (census_rules, census_eips) = (
        census["snat_ports"]["rules"].as_array().map_or(0, Vec::len),
        census["snat_ports"]["eips"].as_array().map_or(0, Vec::len),
    );
    anyhow::ensure!(
        filled.elapsed() < Duration::from_secs(29),
        "the fill and the scrapes took {:?}: a GC pass may have run over a partial table",
        filled.elapsed()
    );
    // The pass that frees them is seen starting when flows of a sample
    // spread over the table start to go (a few lookups, not a table read).
    let log = dirs.path("agent.log");
    let ct = tables.hash(MAP_CT)?;
    let sample: Vec<lbagent_common::Tuple> =
        (0..flows / 2).step_by((flows / 1024).max(1) as usize).map(super::dnat_flow_key).collect();
    let t = Instant::now();
    while sample.iter().all(|k| ct.get(k, 0).is_ok()) {
        if t.elapsed() > Duration::from_secs(60) {
            bail!("no GC pass started within 60 s:\n{}", agent.log());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Timed by the agent's own log (its UTC timestamps against the wall
    // clock at the write): when the change's apply ended, when the pass
    // ended. Polling the status would add the CLI's own time.
    let gc_seen = wall_of_day();
    std::fs::write(&state, doc(81))?;
    let changed = super::restart::wait_apply(&dirs, &agent, Some(&first), Duration::from_secs(120))?;
    anyhow::ensure!(changed["last_apply"]["ok"] == true, "the change's apply failed: {changed}");
    let t = Instant::now();
    let gc_end = loop {
        if let Some(at) = logged_at(&log, &format!("{flows} idle flows collected"), 0) {
            break at;
        }
        if t.elapsed() > Duration::from_secs(120) {
            bail!("the GC pass did not finish within 120 s:\n{}", agent.log());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let change_end =
        logged_at(&log, "updated NAT gateway object=natgw/g0", 0).context("the change's apply in the log")?;
    let after_rss = rss(pid).0;
    peaks.push(("the GC pass and a change during it", step_peak(pid)));
    // The same change with no pass running: what an apply takes here.
    std::thread::sleep(Duration::from_secs(1));
    let quiet_start = wall_of_day();
    std::fs::write(&state, doc(82))?;
    let quiet = super::restart::wait_apply(&dirs, &agent, Some(&changed), Duration::from_secs(120))?;
    anyhow::ensure!(quiet["last_apply"]["ok"] == true, "the second change's apply failed: {quiet}");
    let quiet_end =
        logged_at(&log, "updated NAT gateway object=natgw/g0", 1).context("the second change's apply in the log")?;
    peaks.push(("a change, no GC pass", step_peak(pid)));
    let run_peak = peaks.iter().map(|p| p.1).fold(0.0, f64::max);
    let (change_s, gc_s, quiet_s) = (change_end - gc_seen, gc_end - gc_seen, quiet_end - quiet_start);
    let kept = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench/agent-scale.log");
    let _ = std::fs::create_dir_all(kept.parent().unwrap());
    let _ = std::fs::copy(&log, &kept);
    agent.stop();
    eprint!(".");
    writeln!(
        out,
        "\n## 18. The agent at scale\n\n\
         The release agent (`lbagent run`, as installed) with {gws} NAT gateways of {rules} DNAT and {rules} SNAT \
         rules each ({} rules, {} zones), `--conntrack-max 2097152`; then {flows} flows written into its `ct` \
         (crafted entries, which expire under the document's 60 s TCP timeout, so that a GC pass, on its own \
         thread, frees them all; they are written last seen 30 s ago, so no pass frees part of them, and the passes before count them: the port census). A change to one gateway's rule is written once that pass has started (the \
         table shrinks); its apply is timed from the write to its end in the agent's log (the file source \
         waits for the file to stay unchanged for a second, then parses and checks the whole document). Status: `lbagent status \
         --json` through the API socket (a process each time); metrics: one HTTP scrape ({metrics_bytes} bytes). \
         Medians of 5 (3 at full table).\n\n\
         | what | value |\n|---|---:|\n\
         | create every zone, first apply | {create:.1} s |\n\
         | RSS after the apply (peak so far) | {applied_rss:.1} MB ({applied_hwm:.1} MB) |\n\
         | status / metrics scrape, empty tables | {:.1} ms / {:.1} ms |\n\
         | status / metrics scrape, {flows} flows | {:.1} ms / {:.1} ms |\n\
         | change written during the GC pass → applied (the agent's log) | {change_s:.2} s |\n\
         | the same change, no GC pass running | {quiet_s:.2} s |\n\
         | GC pass freeing {flows} flows, from its start seen to its end (the agent's log) | {gc_s:.1} s |\n\
         | RSS after the GC pass (peak over the whole run) | {after_rss:.1} MB ({run_peak:.1} MB) |",
        2 * gws * rules,
        gws,
        status_empty * 1e3,
        metrics_empty * 1e3,
        status_full * 1e3,
        metrics_full * 1e3,
    )?;
    writeln!(
        out,
        "\nThe flows are half DNAT'ed, half SNAT'ed by the gateways' SNAT rules; the port census of the pass \
         before the full-table scrapes counted {counted} SNAT'ed flows under {census_rules} rules and {census_eips} EIPs."
    )?;
    writeln!(out, "\nPeak RSS (`VmHWM`) by step, each step's peak counted from the RSS it started at:\n")?;
    writeln!(out, "| step | peak |\n|---|---:|")?;
    for (step, peak) in &peaks {
        writeln!(out, "| {step} | {peak:.1} MB |")?;
    }
    Ok(())
}
