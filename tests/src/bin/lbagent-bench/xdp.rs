//! Section 11: would XDP beat the TC fast path? (The probes are
//! `lbagent-ebpf/src/xdp.rs`.)
//!
//! Four paths side by side, same client and server namespaces:
//! - the TC fast path (NAT to the VIP, redirect from the program), as the
//!   agent runs it;
//! - the same with `lbagent_xdp_pass` attached natively to the NAT
//!   namespace's client-side veth: what XDP's presence costs there,
//!   GSO/TSO traffic included;
//! - `lbagent_xdp_forward` on that veth, forwarding to the server's veth
//!   without any NAT (`lbagent_xdp_pass` on the server's end, which a veth
//!   needs to receive redirected frames): an upper bound for an XDP NAT;
//! - plain routing.

use std::fmt::Write as _;

use anyhow::Result;
use lbagent_tests::{
    engine::TestPins,
    topology::{NatTopology, SERVER, VIP},
    xdp::{NextHop, PASS, attach, forward_to_server, probes},
};

pub fn xdp(reps: usize, out: &mut String) -> Result<()> {
    writeln!(out, "\n## 11. XDP against the TC fast path (iperf3, 2 s runs, median of {reps})\n")?;
    let fast = crate::throughput_engine(true)?;
    let with_pass = crate::throughput_engine(true)?;
    let pass_pins = TestPins::new();
    let mut pass_probes = probes(&pass_pins, NextHop::default())?;
    attach(&mut pass_probes, PASS, &with_pass.nat.name, &with_pass.ifaces[0])?;

    let xdp_fwd = NatTopology::plain()?;
    let fwd_pins = TestPins::new();
    let fwd_probes = forward_to_server(&xdp_fwd, &fwd_pins)?;

    let route = NatTopology::plain()?;
    let paths = [
        ("TC fast path (NAT; the agent's default)", &fast, VIP),
        ("TC fast path + XDP_PASS on the client-side veth", &with_pass, VIP),
        ("XDP forwarding, no NAT (upper bound for an XDP NAT)", &xdp_fwd, SERVER),
        ("plain routing, no NAT", &route, SERVER),
    ];
    let m = crate::measure_paths(&paths, reps)?.medians();
    crate::write_paths(out, &paths, &m)?;
    let r = |a: usize, b: usize, k: usize| m[a][k] / m[b][k];
    writeln!(
        out,
        "\nXDP_PASS present ÷ TC fast path: TSO on {:.2}, TSO off {:.2}, UDP {:.2}, connections {:.2}. \
         XDP forwarding without NAT ÷ TC fast path with NAT: {:.2}, {:.2}, {:.2}, {:.2}.",
        r(1, 0, 0),
        r(1, 0, 1),
        r(1, 0, 2),
        r(1, 0, 3),
        r(2, 0, 0),
        r(2, 0, 1),
        r(2, 0, 2),
        r(2, 0, 3)
    )?;
    drop((pass_probes, fwd_probes));
    Ok(())
}
