//! The NAT program loaded for one zone with its own pin directory, run on
//! crafted packets with `BPF_PROG_TEST_RUN` inside a network namespace of
//! the test's own (the program consults the FIB). Pins and the namespace
//! are removed on drop.

use std::path::PathBuf;

use anyhow::Result;
use aya::programs::{TestRun, TestRunOptions};
use lbagent::dataplane::{
    attach::Direction,
    loader::{CtSizes, ZoneProgram},
    pins,
    tables::Tables,
};

use crate::{net::Netns, unique};

/// The test's own network namespace, entered by the calling thread:
/// `BPF_PROG_TEST_RUN` runs packets in the caller's namespace, so this is
/// the FIB the program's route lookups see. `lo` (ifindex 1) is where test
/// packets arrive; a veth pair gives `v0` 10.0.1.1/24 (clients) and `v1`
/// 10.0.2.1/24 with the default route (servers, everything else).
pub struct TestNet {
    home: std::fs::File,
    ns: Netns,
}

impl TestNet {
    pub fn enter() -> Result<Self> {
        let ns = Netns::new(&unique("lbat"))?;
        for cmd in [
            &["ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"][..],
            &["ip", "addr", "add", "10.0.1.1/24", "dev", "v0"],
            &["ip", "addr", "add", "10.0.2.1/24", "dev", "v1"],
            &["ip", "link", "set", "v0", "up"],
            &["ip", "link", "set", "v1", "up"],
            &["ip", "route", "add", "default", "via", "10.0.2.254", "dev", "v1", "onlink"],
            &["ip", "neigh", "add", CLIENT_IP, "lladdr", CLIENT_MAC, "dev", "v0", "nud", "permanent"],
            &["sysctl", "-qw", "net.ipv4.ip_forward=1"],
        ] {
            ns.exec(cmd)?;
        }
        let home = std::fs::File::open("/proc/thread-self/ns/net")?;
        let target = lbagent::netns::open(&ns.name)?;
        nix::sched::setns(target, nix::sched::CloneFlags::CLONE_NEWNET)?;
        Ok(TestNet { home, ns })
    }
}

impl TestNet {
    /// Moves the calling thread (another test thread) into this namespace.
    pub fn join(&self) -> Result<()> {
        nix::sched::setns(lbagent::netns::open(&self.ns.name)?, nix::sched::CloneFlags::CLONE_NEWNET)?;
        Ok(())
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        let _ = nix::sched::setns(&self.home, nix::sched::CloneFlags::CLONE_NEWNET);
    }
}

/// A client on `v0` whose neighbour entry the test net has (redirects to it
/// resolve).
pub const CLIENT_IP: &str = "10.0.1.2";
pub const CLIENT_MAC: &str = "02:00:00:00:00:99";

/// MAC address of interface `ifname` in the calling thread's namespace.
pub fn mac_of(ifname: &str) -> [u8; 6] {
    crate::net::mac(&crate::net::sh(&["ip", "-br", "link", "show", ifname]).expect("interface")).expect("mac")
}

/// Ifindex of `v1` in the calling thread's namespace: where the test net
/// routes servers and the internet (SNAT rules are keyed on it).
pub fn out_ifindex() -> u32 {
    lbagent::netns::ifindex("v1").expect("inside a TestNet")
}

/// Unique bpffs directory for one test; removed (with all pins) on drop.
pub struct TestPins {
    pub root: PathBuf,
}

impl TestPins {
    pub fn new() -> Self {
        TestPins { root: PathBuf::from("/sys/fs/bpf").join(unique("lbatest")) }
    }
}

impl Default for TestPins {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestPins {
    fn drop(&mut self) {
        let _ = pins::remove_all(&self.root);
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// One zone's programs over pins and a namespace of the test's own (not
/// the agent's `dataplane::engine::Engine`, which serves every zone).
pub struct TestZone {
    pub prog: ZoneProgram,
    pub tables: Tables,
    pub pins: TestPins,
    /// The conntrack tables' sizes (every program over these pins uses them).
    pub sizes: CtSizes,
    // Last: the thread leaves the namespace after everything else is gone.
    pub net: TestNet,
}

pub const TC_ACT_OK: u32 = 0;
/// `struct __sk_buff` as `BPF_PROG_TEST_RUN` takes it for a context: its
/// size, and the offsets of `gso_segs` and `gso_size` (uapi `bpf.h`).
const SK_BUFF_LEN: usize = 192;
const SK_BUFF_GSO_SEGS: usize = 164;
const SK_BUFF_GSO_SIZE: usize = 176;
pub const TC_ACT_SHOT: u32 = 2;

impl TestZone {
    pub fn new(zone: u16) -> Result<Self> {
        Self::with_ct_max(zone, None)
    }

    /// An engine whose established conntrack table holds `ct_max` entries
    /// (the new-flow table its default share of them).
    pub fn with_ct_max(zone: u16, ct_max: Option<u32>) -> Result<Self> {
        let net = TestNet::enter()?;
        let pins = TestPins::new();
        let sizes = CtSizes::new(ct_max, None);
        let prog = ZoneProgram::load_sized(&pins.root, zone, sizes)?;
        let tables = Tables::open(&pins.root)?;
        Ok(TestZone { prog, tables, pins, net, sizes })
    }

    /// An engine for `zone` with one rule: udp 198.51.100.10:53 → 10.0.2.2:5353.
    pub fn with_dns_rule(zone: u16, rule_id: u32) -> Result<Self> {
        let e = Self::new(zone)?;
        e.tables.set_dnat(&lbagent::dataplane::tables::DnatSpec {
            zone,
            addr: std::net::Ipv4Addr::new(198, 51, 100, 10),
            proto: lbagent_common::PROTO_UDP,
            port: 53,
            rule_id,
            backends: vec![(std::net::Ipv4Addr::new(10, 0, 2, 2), 5353)],
            snat: None,
            acl: None,
            sched: None,
        })?;
        Ok(e)
    }

    /// Writes `egress_mtu` from the test net's links and routes (the
    /// calling thread is in it) with the agent's own reader and writer, as
    /// the agent does at each pass: the fast path forwards only through
    /// interfaces it has an MTU for.
    pub fn sync_egress_mtu(&self, zone: u16) -> Result<()> {
        self.tables.sync_egress_mtu(zone, &lbagent::plumbing::nl::Nl::new()?.egress_mtus()?)?;
        Ok(())
    }

    /// Zone `zone`'s NAT program over this engine's pins (the same maps).
    pub fn zone_program(&self, zone: u16) -> Result<ZoneProgram> {
        ZoneProgram::load_sized(&self.pins.root, zone, self.sizes)
    }

    /// Runs `frame(i)` for each step `i < steps` on CPUs 0 and 1 at once,
    /// each CPU with its own instance of zone `zone`'s program over these
    /// pins: the two runs of a step start together (each CPU waits for the
    /// other to finish the step before), so they race in the program as
    /// two CPUs taking the same flow's packets do. Returns each step's
    /// verdicts and outputs, CPU 0's first. `None`: fewer than two CPUs.
    #[allow(clippy::type_complexity)]
    pub fn race(
        &self,
        zone: u16,
        steps: usize,
        frame: impl Fn(usize) -> Vec<u8> + Sync,
    ) -> Result<Option<Vec<[(u32, Vec<u8>); 2]>>> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        if std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) < 2 {
            return Ok(None);
        }
        let done = [AtomicUsize::new(0), AtomicUsize::new(0)];
        let runs: Vec<Result<Vec<(u32, Vec<u8>)>>> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..2)
                .map(|cpu| {
                    let (done, frame) = (&done, &frame);
                    s.spawn(move || {
                        let runs = (|| -> Result<Vec<(u32, Vec<u8>)>> {
                            let mut set = nix::sched::CpuSet::new();
                            set.set(cpu)?;
                            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)?;
                            self.net.join()?;
                            let mut prog = ZoneProgram::load_sized(&self.pins.root, zone, self.sizes)?;
                            let mut out = Vec::with_capacity(steps);
                            for i in 0..steps {
                                let f = frame(i);
                                while done[1 - cpu].load(Ordering::Acquire) < i {
                                    std::hint::spin_loop();
                                }
                                out.push(run_program(&mut prog, &f)?);
                                done[cpu].store(i + 1, Ordering::Release);
                            }
                            Ok(out)
                        })();
                        if runs.is_err() {
                            // The other CPU goes on alone rather than wait.
                            done[cpu].store(usize::MAX, Ordering::Release);
                        }
                        runs
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().expect("a racing thread panicked")).collect()
        });
        let mut runs = runs.into_iter();
        let (a, b) = (runs.next().unwrap()?, runs.next().unwrap()?);
        Ok(Some(a.into_iter().zip(b).map(|(a, b)| [a, b]).collect()))
    }

    /// Rewrites every entry of pinned hash map `def` (`ct`, `ct_new`,
    /// `frags`) with `edit`: as another CPU's write would leave it, for
    /// outcomes a test cannot time.
    pub fn edit_entries<K: aya::Pod + Eq, V: aya::Pod>(
        &self,
        def: lbagent_common::MapDef<K, V>,
        edit: impl Fn(&mut V),
    ) -> Result<usize> {
        use aya::maps::{HashMap, MapData};
        let data = MapData::from_pin(pins::versioned_dir(&self.pins.root).join(def.name))?;
        let mut map: HashMap<MapData, K, V> = HashMap::try_from(lbagent::dataplane::pins::map_of(def, data))?;
        let entries: Vec<(K, V)> = map.iter().collect::<Result<_, _>>()?;
        for (k, mut v) in entries.iter().copied() {
            edit(&mut v);
            map.insert(&k, &v, 0)?;
        }
        Ok(entries.len())
    }

    /// Runs the program once; returns its verdict and the output frame.
    pub fn run(&mut self, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        self.run_on(Direction::Ingress, frame)
    }

    /// Runs the program of one side (ingress: the NAT engine; egress: what
    /// the namespace sends) once; returns its verdict and the output frame.
    pub fn run_on(&mut self, dir: Direction, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        run_program_on(&mut self.prog, dir, frame)
    }

    /// Runs the NAT program once on `frame` as a GSO packet whose segments
    /// carry `gso_size` bytes of payload each (the context's `gso_size`,
    /// as a TSO sender's packet arrives), `gso_segs` of them (0: not yet
    /// counted, as a VM's packets arrive through a tap); returns verdict
    /// and output.
    pub fn run_gso(&mut self, frame: &[u8], gso_size: u32, gso_segs: u32) -> Result<(u32, Vec<u8>)> {
        let mut ctx = [0u8; SK_BUFF_LEN];
        ctx[SK_BUFF_GSO_SEGS..SK_BUFF_GSO_SEGS + 4].copy_from_slice(&gso_segs.to_ne_bytes());
        ctx[SK_BUFF_GSO_SIZE..SK_BUFF_GSO_SIZE + 4].copy_from_slice(&gso_size.to_ne_bytes());
        let mut out = vec![0u8; frame.len() + 256];
        let res = self.prog.program().test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            ..TestRunOptions::default()
        })?;
        out.truncate(res.data_size_out as usize);
        Ok((res.return_value, out))
    }

    /// Average ns per run over `repeat` runs (the kernel's own timer).
    ///
    /// `BPF_PROG_TEST_RUN` runs the program `repeat` times on one packet,
    /// each run on what the run before left: time a packet the program
    /// leaves unchanged, or one from [`TestZone::looped_flow`]. A flow's
    /// packet timed as is would be translated once and then match nothing.
    pub fn time(&mut self, frame: &[u8], repeat: u32) -> Result<f64> {
        let mut out = vec![0u8; frame.len() + 256];
        let res = self.prog.program().test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat,
            ..TestRunOptions::default()
        })?;
        Ok(res.duration.as_nanos() as f64)
    }

    /// A UDP packet whose every repeated run is a conntrack hit, for
    /// [`TestZone::time`]: two DNAT rules of `zone` that undo each other
    /// (`vip:53 → server:5353` with rule `rule_id`, `server:5353 → vip:53`
    /// with `rule_id + 1`) make two flows from `client:4000`, each one's
    /// translation the other one's next packet. `answered`: both flows are
    /// answered and seen again 2 s later (established, in `ct`); otherwise
    /// neither is answered (both in `ct_new`).
    pub fn looped_flow(
        &mut self,
        zone: u16,
        client: std::net::Ipv4Addr,
        vip: std::net::Ipv4Addr,
        server: std::net::Ipv4Addr,
        rule_id: u32,
        answered: bool,
    ) -> Result<Vec<u8>> {
        use lbagent::dataplane::tables::DnatSpec;
        use lbagent_common::PROTO_UDP;

        use crate::packet::{Ip, L4, frame};
        for (i, (addr, port, to, to_port)) in [(vip, 53, server, 5353), (server, 5353, vip, 53)].into_iter().enumerate()
        {
            self.tables.set_dnat(&DnatSpec {
                zone,
                addr,
                proto: PROTO_UDP,
                port,
                rule_id: rule_id + i as u32,
                backends: vec![(to, to_port)],
                snat: None,
                acl: None,
                sched: None,
            })?;
        }
        let udp = |sport, dport| L4::Udp { sport, dport, payload: vec![0; 64], zero_csum: false };
        let c = client.octets();
        let first = frame(&Ip::new(c, vip.octets()), &udp(4000, 53));
        let second = frame(&Ip::new(c, server.octets()), &udp(4000, 5353));
        let answers =
            [frame(&Ip::new(server.octets(), c), &udp(5353, 4000)), frame(&Ip::new(vip.octets(), c), &udp(53, 4000))];
        self.run(&first)?;
        self.run(&second)?;
        if answered {
            for a in &answers {
                self.run(a)?;
            }
            std::thread::sleep(std::time::Duration::from_millis(2100));
            self.run(&first)?;
            self.run(&second)?;
        }
        Ok(first)
    }
}

/// Runs `prog`'s NAT program (ingress) once on `frame` in the calling
/// thread's namespace; returns its verdict and the output frame.
pub fn run_program(prog: &mut ZoneProgram, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
    run_program_on(prog, Direction::Ingress, frame)
}

/// [`run_program`] on the program of direction `dir`.
pub fn run_program_on(prog: &mut ZoneProgram, dir: Direction, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
    let mut out = vec![0u8; frame.len() + 256];
    let res = prog.program_for(dir).test_run(TestRunOptions {
        data_in: Some(frame),
        data_out: Some(&mut out),
        ..TestRunOptions::default()
    })?;
    out.truncate(res.data_size_out as usize);
    Ok((res.return_value, out))
}
