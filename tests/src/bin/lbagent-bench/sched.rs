//! Section 9 of `cargo xtask bench`: direct-mode schedulers
//! (`docs/schedulers.md`): the program's cost for a new flow per scheduler,
//! table build and install times, and how many keys move when a backend
//! joins or leaves.

use std::{fmt::Write as _, net::Ipv4Addr, sync::Arc, time::Instant};

use anyhow::Result;
use lbagent::{
    dataplane::tables::{DnatSpec, SchedKind, SchedSpec},
    lb::sched::{self, Member},
};
use lbagent_common::PROTO_UDP;
use lbagent_tests::{
    engine::TestZone,
    packet::{Ip, L4, frame},
    topology::{VIP, ZONE},
};

fn members(ids: &[String]) -> Vec<Member<'_>> {
    ids.iter()
        .enumerate()
        .map(|(i, id)| Member {
            id,
            target: (Ipv4Addr::new(10, 8, (i / 250) as u8, (i % 250) as u8 + 1), 80),
            weight: 1 + (i % 3) as u32,
        })
        .collect()
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("backend-{i}")).collect()
}

fn moved(a: &[(Ipv4Addr, u16)], b: &[(Ipv4Addr, u16)]) -> f64 {
    a.iter().zip(b).filter(|(x, y)| x != y).count() as f64 / a.len() as f64
}

/// New flows per scheduler: `n` first packets, each its own 5-tuple, through
/// one rule with 10 backends; ns per packet including the test-run syscall
/// (compare the rows: the syscall is the same in each).
fn new_flow_cost(n: u32, out: &mut String) -> Result<()> {
    writeln!(out, "\n### New-flow cost (BPF_PROG_TEST_RUN, {n} first packets each, 10 backends)\n")?;
    writeln!(out, "| scheduler | ns per new flow (incl. syscall) |\n|---|---:|")?;
    let id_list = ids(10);
    let m = members(&id_list);
    let kinds: [(&str, Option<SchedKind>); 5] = [
        ("hash (none)", None),
        ("wlc (fewest active flows, 10 compared)", Some(SchedKind::Least)),
        ("sch (table, source)", Some(SchedKind::Source)),
        ("tch (table, 5-tuple)", Some(SchedKind::Tuple)),
        ("rr / wrr (in turn)", Some(SchedKind::Turn)),
    ];
    for (round, (name, kind)) in kinds.iter().enumerate() {
        let mut e = TestZone::new(ZONE)?;
        let table = match kind {
            Some(SchedKind::Turn) => sched::round_robin(&m),
            Some(SchedKind::Least) | None => Vec::new(),
            Some(_) => sched::consistent(&m),
        };
        e.tables.set_dnat(&DnatSpec {
            zone: ZONE,
            addr: VIP,
            proto: PROTO_UDP,
            port: 53,
            rule_id: 1,
            backends: m.iter().map(|b| b.target).collect(),
            snat: None,
            acl: None,
            sched: kind.map(|kind| SchedSpec {
                kind,
                table: Arc::new(table),
                weights: if kind == SchedKind::Least { m.iter().map(|b| b.weight).collect() } else { vec![] },
            }),
        })?;
        let frames: Vec<Vec<u8>> = (0..n)
            .map(|i| {
                let src = [10, 1 + round as u8, (i >> 8) as u8, i as u8];
                let l4 =
                    L4::Udp { sport: 1024 + (i % 60_000) as u16, dport: 53, payload: vec![0; 64], zero_csum: false };
                frame(&Ip::new(src, VIP.octets()), &l4)
            })
            .collect();
        let t = Instant::now();
        for f in &frames {
            e.run(f)?;
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        writeln!(out, "| {name} | {ns:.0} |")?;
        eprint!(".");
    }
    Ok(())
}

pub fn sched(quick: bool, out: &mut String) -> Result<()> {
    writeln!(out, "\n## 9. Direct-mode schedulers (`docs/schedulers.md`)\n")?;
    writeln!(
        out,
        "Tables of {} slots. Build: the pure builders (weights 1-3); install: a fresh inner map written and \
         swapped in. Keys moved (equal weights): the share of slots whose backend changes when one backend joins \
         (ideal 1/(N+1)) or one in the middle leaves; `sch`/`tch` use the consistent (rendezvous-filled) table, \
         Maglev's permutation fill is shown for comparison.\n",
        lbagent_common::SCHED_TABLE_SIZE
    )?;
    writeln!(
        out,
        "| backends | consistent build ms | Maglev build ms | round-robin build ms | install ms | moved on join: consistent / Maglev (ideal) | moved on leave: consistent / Maglev |\n|---:|---:|---:|---:|---:|---:|---:|"
    )?;
    let e = TestZone::new(ZONE)?;
    for n in [1usize, 100, 1000] {
        let all = ids(n + 1);
        let m = members(&all[..n]);
        let time = |f: &dyn Fn() -> Vec<(Ipv4Addr, u16)>| {
            let t = Instant::now();
            let table = f();
            (table, t.elapsed().as_secs_f64() * 1e3)
        };
        let (table, consistent_ms) = time(&|| sched::consistent(&m));
        let (_, maglev_ms) = time(&|| sched::maglev(&m));
        let (_, rr_ms) = time(&|| sched::round_robin(&m));
        let t = Instant::now();
        e.tables.set_sched_table(7, &table)?;
        let install_ms = t.elapsed().as_secs_f64() * 1e3;
        // Equal weights for the moved columns (the ideal is then 1/(N+1)).
        let equal =
            |k: usize| -> Vec<Member> { members(&all[..k]).into_iter().map(|b| Member { weight: 1, ..b }).collect() };
        let (small, big) = (equal(n), equal(n + 1));
        let mut fewer = big.clone();
        fewer.remove(n / 2);
        let mv = |f: fn(&[Member]) -> Vec<(Ipv4Addr, u16)>| {
            let b = f(&big);
            (moved(&f(&small), &b), moved(&b, &f(&fewer)))
        };
        let (cj, cl) = mv(sched::consistent);
        let (mj, ml) = mv(sched::maglev);
        writeln!(
            out,
            "| {n} | {consistent_ms:.1} | {maglev_ms:.1} | {rr_ms:.1} | {install_ms:.1} | {cj:.4} / {mj:.4} ({:.4}) | {cl:.4} / {ml:.4} |",
            1.0 / (n + 1) as f64,
        )?;
        eprint!(".");
    }
    e.tables.remove_sched_table(7)?;
    drop(e);
    new_flow_cost(if quick { 5_000 } else { 20_000 }, out)
}
