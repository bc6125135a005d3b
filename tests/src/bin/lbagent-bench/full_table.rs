//! Section 19 of `cargo xtask bench`: new flows with a full conntrack
//! table, beside iptables with a table as full. Section 2's namespaces
//! (client, NAT, server; real sockets): for each rule count, new TCP
//! connections per second to the VIP (DNAT and SNAT) and new UDP flows per
//! second to one resolver through the SNAT address (section 6's clients),
//! first with empty tables, then with full ones. The eBPF engine's `ct` is
//! sized for `FULL` flows and filled to the brim, and so is `ct_new` (crafted
//! entries written from userspace: new flows then live in `ct_new`, each
//! taking an element the LRU evicts from another flow, as on a gateway
//! whose tables are full). Linux conntrack is sized the same
//! (`nf_conntrack_max`, `hashsize`) and filled by real packets: TCP SYNs
//! from a raw socket in the client namespace, SNAT'ed, to ports the server
//! drops, so each stays an entry (unassured: a new flow at the full table
//! evicts one, as Linux does).

use std::{fmt::Write as _, time::Duration};

use anyhow::{Result, ensure};
use lbagent::dataplane::{attach::AttachMode, loader::CtSizes, tables::monotonic_ns};
use lbagent_common::NatConfig;
use lbagent_tests::topology::{NatTopology, SERVER, SNAT, spawn_in};

use super::flows::{Restore, send_syns};

/// Flows in a full table (`ct` holds two halves per flow).
const FULL: u32 = 1_048_576;

/// The server ports the filling SYNs go to (dropped there).
const DROPPED_PORTS: (u16, u16) = (9, 1008);

/// Section 2's iptables with `n` rules, and section 6's UDP SNAT.
fn iptables(t: &NatTopology, n: usize) -> Result<()> {
    let udp = format!(
        "-A POSTROUTING -o {} -p udp -j SNAT --to-source {SNAT}:1024-65535 --random-fully\nCOMMIT",
        t.ifaces[1]
    );
    super::iptables_restore(&t.nat.name, &super::iptables_rules(&t.ifaces[1], n).replace("COMMIT", &udp))
}

/// One topology's medians: TCP connections/s, UDP flows/s, and the UDP
/// queries lost (unanswered within 100 ms) over every run.
#[derive(Clone, Copy)]
struct Rates {
    tcp: f64,
    udp: f64,
    lost: u32,
}

/// [`Rates`] from each topology's client, medians of `reps`, the
/// topologies taking turns (A B A B) so drift hits both.
fn rates(ts: [&NatTopology; 2], reps: usize) -> Result<[Rates; 2]> {
    let mut runs = [(vec![], vec![], 0), (vec![], vec![], 0)];
    for _ in 0..reps {
        for (t, (tcp, udp, lost)) in ts.iter().zip(runs.iter_mut()) {
            tcp.push(super::conn_rate(&t.client.name, (super::VIP, 80).into(), Duration::from_secs(1))?.0);
            let (rate, l) = super::udp_flow_rate(&t.client.name, (SERVER, 53).into(), Duration::from_secs(2))?;
            udp.push(rate);
            *lost += l;
        }
    }
    Ok(runs.map(|(tcp, udp, lost)| Rates { tcp: super::median(tcp), udp: super::median(udp), lost }))
}

/// Fills `ct_new` to its capacity (`halves`) with crafted unanswered TCP
/// flows (both halves, no translation, `CT_NEW`: 60 s before they expire),
/// as the SYNs fill Linux's table: a new flow then takes an LRU element
/// that the kernel evicts from another flow.
fn fill_new_flows(t: &NatTopology, halves: u32, now: u64) -> Result<()> {
    use lbagent_common::{CT_F_REPLY, CT_NEW, CtEntry, MAP_CT_NEW, PROTO_TCP, Tuple};
    let mut ct_new = t.tables.hash(MAP_CT_NEW)?;
    let (lo, hi) = DROPPED_PORTS;
    let ports = u32::from(hi - lo + 1);
    for i in 0..halves / 2 {
        let c = i / ports;
        let orig = Tuple {
            saddr: [172, 16 + (c >> 16) as u8, (c >> 8) as u8, c as u8],
            daddr: SERVER.octets(),
            sport: 40000,
            dport: lo + (i % ports) as u16,
            proto: PROTO_TCP,
            _pad0: 0,
            zone: super::ZONE,
        };
        let half = CtEntry {
            xlate: orig,
            last_seen_ns: now,
            created_ms: lbagent_common::ct_clock_ms(now),
            state: CT_NEW,
            ..Default::default()
        };
        ct_new.insert(&orig, &half, 0)?;
        let reply = CtEntry { xlate: orig.reversed(), flags: CT_F_REPLY, ..half };
        ct_new.insert(&orig.reversed(), &reply, 0)?;
    }
    Ok(())
}

/// Fills Linux conntrack in `t`'s NAT namespace to `max` entries (with its
/// one-rule iptables: the SYNs would take minutes through 100 000 rules;
/// the entries are the same). Returns the entries it holds.
fn fill_linux(t: &NatTopology, max: u32) -> Result<u64> {
    iptables(t, 1)?;
    let (lo, hi) = DROPPED_PORTS;
    let ports = u32::from(hi - lo + 1);
    // A few more SYNs than entries: the table is full, not nearly.
    let syns = max + max / 64;
    spawn_in(&t.client.name, move || {
        send_syns(syns, move |i| {
            let c = i / ports;
            ([100, 64 + (c >> 16) as u8, (c >> 8) as u8, c as u8], SERVER.octets(), lo + (i % ports) as u16)
        })
    })
    .join()
    .map_err(|_| anyhow::anyhow!("SYN sender panicked"))??;
    std::thread::sleep(Duration::from_millis(500));
    Ok(t.nat.exec(&["cat", "/proc/sys/net/netfilter/nf_conntrack_count"])?.trim().parse()?)
}

pub fn full_table(quick: bool, out: &mut String) -> Result<()> {
    eprintln!("bench: new flows with a full conntrack table");
    let counts: &[usize] = if quick { &[10, 1_000] } else { &[10, 100_000, 1_000_000] };
    let reps = if quick { 1 } else { 5 };
    let full = if quick { FULL / 4 } else { FULL };
    writeln!(
        out,
        "\n## 19. New flows with a full conntrack table (median of {reps}; TCP 1 s runs, UDP 2 s runs)\n\n\
         Empty tables, then full ones: the eBPF engine's `ct` sized for {full} flows and holding as many, \
         and its `ct_new` full too (crafted entries; new flows go to `ct_new`, evicting others), Linux conntrack sized the same (`nf_conntrack_max`, \
         `hashsize`) and filled to its maximum by real SNAT'ed SYNs (unassured entries: each new flow evicts one). \
         TCP: new connections/s to the VIP (DNAT and SNAT, section 2); UDP: new flows/s to one resolver through \
         the SNAT address (section 6, UDP timeout {} s on both).\n\n\
         | rules | tables | eBPF TCP conn/s | iptables TCP conn/s | eBPF / iptables | eBPF UDP flows/s | iptables UDP flows/s | eBPF / iptables | UDP lost (eBPF/iptables) |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|:---:|",
        super::UDP_BENCH_TIMEOUT_S
    )?;
    let mut kept_new = vec![];
    for &n in counts {
        let sizes = CtSizes::new(Some(2 * full), None);
        let ebpf = NatTopology::sized(AttachMode::Auto, sizes)?;
        for spec in super::filler(super::ZONE, n.saturating_sub(1)) {
            ebpf.tables.set_dnat(&spec)?;
        }
        super::wide_snat(&ebpf)?;
        let cfg = ebpf.tables.config()?;
        ebpf.tables.set_config(NatConfig { udp_s: super::UDP_BENCH_TIMEOUT_S, ..cfg })?;
        let ipt = NatTopology::plain()?;
        iptables(&ipt, n)?;
        ipt.nat.sysctl("net.netfilter.nf_conntrack_udp_timeout", &super::UDP_BENCH_TIMEOUT_S.to_string())?;
        for t in [&ebpf, &ipt] {
            for k in 1..super::UDP_CLIENTS {
                t.client.exec(&["ip", "addr", "add", &format!("10.0.1.{}/24", 2 + k), "dev", &t.client_if])?;
            }
            super::accept_forever(&t.server.name)?;
            lbagent_tests::traffic::udp_echo_forever(&t.server.name, 53)?;
        }
        let row = |tables: &str, e: Rates, i: Rates| {
            format!(
                "| {n} | {tables} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {:.2} | {}/{} |",
                e.tcp,
                i.tcp,
                e.tcp / i.tcp,
                e.udp,
                i.udp,
                e.udp / i.udp,
                e.lost,
                i.lost
            )
        };
        let [e, i] = rates([&ebpf, &ipt], reps)?;
        writeln!(out, "{}", row("empty", e, i))?;
        eprint!(".");

        // The empty runs' flows first: the tables hold exactly the filling flows.
        ebpf.tables.flush_conntrack(|_, _| true)?;
        super::fill_dnat_flows(&ebpf.tables, full, monotonic_ns())?;
        fill_new_flows(&ebpf, sizes.new, monotonic_ns())?;
        let _max = Restore::set("/proc/sys/net/netfilter/nf_conntrack_max", &full.to_string())?;
        let _buckets = Restore::set("/sys/module/nf_conntrack/parameters/hashsize", &full.to_string())?;
        ipt.nat.sysctl("net.netfilter.nf_conntrack_tcp_timeout_syn_sent", "600")?;
        let (lo, hi) = DROPPED_PORTS;
        super::iptables_restore(
            &ipt.server.name,
            &format!("*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -p tcp --dport {lo}:{hi} -j DROP\nCOMMIT\n"),
        )?;
        let held = fill_linux(&ipt, full)?;
        ensure!(held >= u64::from(full) * 99 / 100, "Linux conntrack holds only {held} of {full} flows");
        iptables(&ipt, n)?;
        let [e, i] = rates([&ebpf, &ipt], reps)?;
        let counter = |c| ebpf.tables.counter(c);
        use lbagent_common::Counter::{ConntrackEstablishedFull, DropNoFreePort};
        kept_new.push((n, counter(ConntrackEstablishedFull)?, counter(DropNoFreePort)?));
        writeln!(out, "{}", row(&format!("full ({held} flows in Linux's, {full} in `ct`)"), e, i))?;
        eprint!(".");
    }
    let kept: Vec<String> =
        kept_new.iter().map(|(n, full, no_port)| format!("{full} and {no_port} at {n} rules")).collect();
    writeln!(
        out,
        "\neBPF counters (`conntrack_established_full`: established flows the full `ct` kept in `ct_new`; \
         `drop_no_free_port`): {}.",
        kept.join(", ")
    )?;
    Ok(())
}
