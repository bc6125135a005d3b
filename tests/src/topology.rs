//! The first real-traffic topology, shared by the tests and the demo:
//!
//! ```text
//!  client ns      nat ns (engine at ingress and egress of both)     server ns
//!  c0 10.0.1.2 ──veth── n0 10.0.1.1        n1 10.0.2.1 ──veth── s0 10.0.2.2
//!  default via .1                                                default via .1
//! ```
//! The client talks to VIP 198.51.100.10 (tcp/80 → 8080, udp/53 → 5353,
//! udp/54 → 5454 with no listener, icmp); everything from 10.0.1.0/24 that
//! enters on n0 is SNAT'ed to 10.0.2.1. Mixed offloads (`net.rs`).

use std::{fs::File, net::Ipv4Addr, thread::JoinHandle};

use anyhow::{Context, Result};
use lbagent::dataplane::{
    attach::{self, AttachMode, Hook},
    loader::{CtSizes, ZoneProgram},
    tables::{DnatSpec, SnatSpec, Tables},
};
use lbagent_common::{PROTO_ICMP, PROTO_TCP, PROTO_UDP};

use crate::{
    engine::TestPins,
    net::{Netns, dataplane_offloads, sender_offloads, veth},
    unique,
};

pub const VIP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 2);
pub const SERVER: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
pub const SNAT: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 1);
pub const ZONE: u16 = 1;

pub struct NatTopology {
    // Field order is drop order: namespaces (and their links) go first, then pins.
    pub client: Netns,
    pub nat: Netns,
    pub server: Netns,
    pub prog: ZoneProgram,
    pub tables: Tables,
    pub mode: AttachMode,
    pub ifaces: [String; 2],
    /// The client's interface (toward the NAT namespace).
    pub client_if: String,
    /// The server's interface (toward the NAT namespace).
    pub server_if: String,
    pub pins: TestPins,
}

impl NatTopology {
    pub fn new(mode: AttachMode) -> Result<Self> {
        Self::build(Some(mode), CtSizes::default())
    }

    /// [`NatTopology::new`] with conntrack tables of these sizes.
    pub fn sized(mode: AttachMode, sizes: CtSizes) -> Result<Self> {
        Self::build(Some(mode), sizes)
    }

    /// The same namespaces and addresses with nothing attached (baselines:
    /// plain routing, iptables). The program is loaded but not attached.
    pub fn plain() -> Result<Self> {
        Self::build(None, CtSizes::default())
    }

    fn build(mode: Option<AttachMode>, sizes: CtSizes) -> Result<Self> {
        let client = Netns::new(&unique("lbc"))?;
        let nat = Netns::new(&unique("lbn"))?;
        let server = Netns::new(&unique("lbs"))?;
        let (c0, n0, n1, s0) = (unique("c"), unique("n"), unique("n"), unique("s"));
        veth(&client, &c0, "10.0.1.2/24", &nat, &n0, "10.0.1.1/24")?;
        veth(&nat, &n1, "10.0.2.1/24", &server, &s0, "10.0.2.2/24")?;
        client.exec(&["ip", "route", "add", "default", "via", "10.0.1.1"])?;
        server.exec(&["ip", "route", "add", "default", "via", "10.0.2.1"])?;
        nat.sysctl("net.ipv4.ip_forward", "1")?;
        for ifn in [&n0, &n1] {
            // SNAT happens at ingress, before routing: the new source is one of
            // this namespace's own addresses, which the kernel must accept.
            nat.sysctl(&format!("net.ipv4.conf.{ifn}.accept_local"), "1")?;
            nat.sysctl(&format!("net.ipv4.conf.{ifn}.rp_filter"), "0")?;
            dataplane_offloads(&nat, ifn)?;
        }
        nat.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
        sender_offloads(&client, &c0)?;
        sender_offloads(&server, &s0)?;

        let pins = TestPins::new();
        let mut prog = ZoneProgram::load_sized(&pins.root, ZONE, sizes)?;
        let mut used = mode.unwrap_or_default();
        // Both programs on both interfaces, as the agent attaches them
        // (`TestZone::attach`): forwarded packets also pass the egress one.
        for ifn in [&n0, &n1] {
            if let Some(mode) = mode {
                for direction in attach::Direction::BOTH {
                    let hook = Hook { netns: Some(&nat.name), ifname: ifn, direction };
                    used = attach::attach(prog.program_for(direction), &pins.root, &hook, mode)?;
                }
            }
        }
        let tables = Tables::open(&pins.root)?;
        // As the agent configures it (the fast path on) unless the run
        // asks for the stack.
        let flags = if crate::slow_path() { 0 } else { lbagent_common::NAT_CFG_FAST_PATH };
        tables.set_config(lbagent_common::NatConfig { flags, ..Default::default() })?;
        // The fast path's MTUs, as the agent writes them at each pass.
        let mtus = lbagent::netns::run_in(Some(&nat.name), || lbagent::plumbing::nl::Nl::new()?.egress_mtus())?;
        tables.sync_egress_mtu(ZONE, &mtus)?;
        // SNAT is keyed on the interface flows leave by: n1, toward the server.
        let n1_index = lbagent::netns::run_in(Some(&nat.name), || lbagent::netns::ifindex(&n1))?;
        let rule = |proto, port, id, to: u16| DnatSpec {
            zone: ZONE,
            addr: VIP,
            proto,
            port,
            rule_id: id,
            backends: vec![(SERVER, to)],
            snat: None,
            acl: None,
            sched: None,
        };
        tables.set_dnat(&rule(PROTO_TCP, 80, 1, 8080))?;
        tables.set_dnat(&rule(PROTO_UDP, 53, 2, 5353))?;
        tables.set_dnat(&rule(PROTO_UDP, 54, 3, 5454))?;
        tables.set_dnat(&rule(PROTO_ICMP, 0, 4, 0))?;
        tables.set_snat(&SnatSpec {
            zone: ZONE,
            ifindex: n1_index,
            cidr: (Ipv4Addr::new(10, 0, 1, 0), 24),
            to: SNAT,
            ports: (20000, 29999),
            random: true,
            port_class: false,
            rule_id: 10,
        })?;
        Ok(NatTopology {
            client,
            nat,
            server,
            prog,
            tables,
            mode: used,
            ifaces: [n0, n1],
            client_if: c0,
            server_if: s0,
            pins,
        })
    }
}

/// Runs `f` on a new thread inside namespace `ns` (network namespace only).
pub fn spawn_in<T: Send + 'static>(ns: &str, f: impl FnOnce() -> Result<T> + Send + 'static) -> JoinHandle<Result<T>> {
    let path = lbagent::netns::path(ns);
    std::thread::spawn(move || {
        let file = File::open(&path).with_context(|| format!("{}", path.display()))?;
        nix_setns(&file)?;
        f()
    })
}

fn nix_setns(file: &File) -> Result<()> {
    nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")
}
