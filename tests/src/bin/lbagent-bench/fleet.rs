//! Section 10 of `cargo xtask bench`: fleet mode on a 3-member etcd on this
//! machine (`docs/operations.md`). (1) The time from a `put` of a host's
//! document to its agent reporting it applied (a real agent with a load
//! balancer; each put changes a backend). (2) How many hosts one such
//! cluster serves: N simulated agents (watch-only clients, one connection
//! each, spread over the members) each watching its own key, then a
//! fleet-wide change that writes every host's 100-load-balancer document
//! once; how long until every watcher has its new document, and etcd's
//! memory.

use std::{
    fmt::Write as _,
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use etcd_client::{Client, EventType, WatchOptions};
use lbagent_tests::{etcd::Etcd, lbagent_bin, ovs::OvsBridge, unique};

/// A document with `n` load balancers (2 listeners, 2 backends each).
pub fn document(bridge: &str, host: usize, n: usize, port: u16) -> String {
    let mut s = format!("version: 1\nagent: {{integration_bridge: {bridge}}}\nload_balancers:\n");
    for i in 0..n {
        let (a, b) = (i / 200, i % 200 + 2);
        let _ = write!(
            s,
            "  - id: {host:08x}-{i:04x}-4c55-9a77-1b2c3d4e5f60
    network: {{ip: 10.{}.{a}.{b}, mac: \"02:00:0a:{:02x}:{a:02x}:{b:02x}\", prefix_len: 16, gateway: 10.{}.255.1}}
    listeners:
      - {{id: web, type: tcp, port: 80, backend_group: g}}
      - {{id: dns, type: udp, port: 53, backend_group: g}}
    backend_groups: [{{id: g, backends: [{{id: b1, address: 10.{}.250.1, port: {port}}}, {{id: b2, address: 10.{}.250.2, port: {port}}}]}}]
",
            64 + i % 2,
            64 + i % 2,
            64 + i % 2,
            64 + i % 2,
            64 + i % 2
        );
    }
    s
}

fn stats(mut v: Vec<Duration>) -> (Duration, Duration, Duration, Duration) {
    v.sort();
    let p = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (v[0], p(0.5), p(0.99), v[v.len() - 1])
}

fn rss_mib(pids: &[u32]) -> f64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|s| s.lines().find_map(|l| l.strip_prefix("VmRSS:")).map(|v| v.trim().to_string()))
        .filter_map(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .sum::<f64>()
        / 1024.0
}

pub fn fleet(quick: bool, out: &mut String) -> Result<()> {
    eprintln!("bench: fleet mode on a 3-member etcd");
    let tag = unique("lbbf");
    let etcd = Etcd::cluster(&tag, 3)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let _ = writeln!(
        out,
        "\n## 10. Fleet mode on etcd (`docs/operations.md`)\n\n\
         A 3-member etcd 3.4 (Debian) on this machine, heartbeat 100 ms, election 1 s.\n"
    );
    put_to_applied(&etcd, &rt, if quick { 5 } else { 15 }, out)?;
    let sizes: &[usize] = if quick { &[100, 300] } else { &[100, 300, 1000] };
    capacity(&etcd, &rt, sizes, out)?;
    Ok(())
}

/// A real agent; each put changes one backend's port; time from the put
/// to the agent's status saying that revision is applied (watched).
fn put_to_applied(etcd: &Etcd, rt: &tokio::runtime::Runtime, reps: usize, out: &mut String) -> Result<()> {
    let bridge = OvsBridge::new(&unique("brb"))?;
    let host = unique("bench");
    let dir: PathBuf = std::env::temp_dir().join(&host);
    std::fs::create_dir_all(&dir)?;
    let bpffs = PathBuf::from("/sys/fs/bpf").join(&host);
    let common = |c: &mut Command| {
        c.arg("--state-dir")
            .arg(dir.join("sd"))
            .arg("--bpffs")
            .arg(&bpffs)
            .arg("--api-socket")
            .arg(dir.join("api.sock"));
    };
    let mut run = Command::new(lbagent_bin());
    run.args(["run", "--etcd", &etcd.endpoints(), "--etcd-insecure", "--host", &host, "--metrics", "off"]);
    common(&mut run);
    let mut agent = run.stderr(std::fs::File::create(dir.join("agent.log"))?).spawn()?;
    let result = rt.block_on(async {
        let mut c = Client::connect(etcd.endpoints().split(',').collect::<Vec<_>>(), None).await?;
        let key = lbagent::naming::fleet_desired_key(&host);
        let status = lbagent::naming::fleet_status_key(&host);
        let mut times = Vec::new();
        for i in 0..=reps {
            let doc = document(&bridge.name, 1, 1, 9000 + i as u16);
            let t = Instant::now();
            let rev = c.put(key.clone(), doc, None).await?.header().map_or(0, |h| h.revision());
            let mut watch = c.watch(status.clone(), Some(WatchOptions::new().with_start_revision(rev))).await?;
            loop {
                let resp = tokio::time::timeout(Duration::from_secs(120), watch.message())
                    .await
                    .context("no status within 120 s")??
                    .context("watch ended")?;
                let done = resp.events().iter().filter(|e| e.event_type() == EventType::Put).any(|e| {
                    e.kv()
                        .and_then(|kv| serde_json::from_slice::<lbagent::fleet::HostStatus>(kv.value()).ok())
                        .is_some_and(|s| {
                            s.running_revision.is_some_and(|r| r >= rev) && s.result == lbagent::fleet::Outcome::Applied
                        })
                });
                if done {
                    break;
                }
            }
            // The first put creates the load balancer (namespace, veths,
            // programs): reported apart.
            if i == 0 {
                let _ =
                    writeln!(out, "First document (creates one load balancer): applied after {:.0?}.\n", t.elapsed());
            } else {
                times.push(t.elapsed());
            }
        }
        anyhow::Ok(times)
    });
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(agent.id() as i32), nix::sys::signal::Signal::SIGTERM);
    let _ = agent.wait();
    let mut td = Command::new(lbagent_bin());
    td.arg("teardown");
    common(&mut td);
    let _ = td.output();
    let _ = std::fs::remove_dir_all(&dir);
    let times = result?;
    let (min, med, p99, max) = stats(times.clone());
    let _ = writeln!(
        out,
        "`fleet put` → host reports applied (a backend changed on a running load balancer), {} puts: \
         min {min:.0?}, median {med:.0?}, max {max:.0?} (p99 {p99:.0?}).\n",
        times.len()
    );
    Ok(())
}

/// N watch-only clients; every host's document rewritten once.
fn capacity(etcd: &Etcd, rt: &tokio::runtime::Runtime, sizes: &[usize], out: &mut String) -> Result<()> {
    let eps: Vec<String> = etcd.endpoints().split(',').map(str::to_string).collect();
    let doc0 = document("brvpc", 0, 100, 8080);
    if let Err(p) = lbagent::state::accept_str(&doc0, lbagent::state::Format::Yaml) {
        bail!("the benchmark's document is invalid: {p}");
    }
    let _ = writeln!(
        out,
        "Simulated hosts: each a watch-only client with its own connection (spread over the 3 members), \
         watching its own key; then one fleet-wide change writes every host's document ({} KiB: 100 load \
         balancers, 2 listeners and 2 backends each) once, from one writer. *delivered* = from the first put \
         to the last watcher having its document; latency = put sent → that host's watcher has it.\n\n\
         | hosts | writes took | all delivered after | latency median | p99 | max | etcd RSS (3 members) |\n|---:|---:|---:|---:|---:|---:|---:|",
        doc0.len() / 1024
    );
    for &n in sizes {
        eprintln!("bench: fleet capacity, {n} simulated hosts");
        let row = rt.block_on(async {
            let tag = unique("sim");
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Instant)>();
            let mut ready = Vec::new();
            for i in 0..n {
                let ep = eps[i % eps.len()].clone();
                let key = lbagent::naming::fleet_desired_key(&format!("{tag}-{i}"));
                let tx = tx.clone();
                let (rtx, rrx) = tokio::sync::oneshot::channel();
                ready.push(rrx);
                tokio::spawn(async move {
                    let mut c = Client::connect([ep], None).await?;
                    let mut w = c.watch(key, None).await?;
                    let _ = rtx.send(());
                    while let Some(resp) = w.message().await? {
                        if resp.events().iter().any(|e| e.event_type() == EventType::Put) {
                            let _ = tx.send((i, Instant::now()));
                            break;
                        }
                    }
                    anyhow::Ok(())
                });
            }
            for r in ready {
                r.await.context("a simulated host could not watch")?;
            }
            let mut writer = Client::connect(eps.clone(), None).await?;
            let docs: Vec<String> = (0..n).map(|i| document("brvpc", i, 100, 8080)).collect();
            let mut sent = vec![Instant::now(); n];
            let start = Instant::now();
            for (i, d) in docs.into_iter().enumerate() {
                sent[i] = Instant::now();
                writer.put(lbagent::naming::fleet_desired_key(&format!("{tag}-{i}")), d, None).await?;
            }
            let wrote = start.elapsed();
            let mut lat = Vec::new();
            let mut last = start;
            while lat.len() < n {
                let (i, at) = tokio::time::timeout(Duration::from_secs(300), rx.recv())
                    .await
                    .context("watchers still waiting after 300 s")?
                    .context("watchers gone")?;
                lat.push(at - sent[i]);
                last = last.max(at);
            }
            // Clean the keys for the next size.
            writer
                .delete(
                    format!("{}desired/{tag}-", lbagent::naming::FLEET_PREFIX),
                    Some(etcd_client::DeleteOptions::new().with_prefix()),
                )
                .await?;
            anyhow::Ok((wrote, last - start, lat))
        })?;
        let (wrote, all, lat) = row;
        let (_, med, p99, max) = stats(lat);
        let _ = writeln!(
            out,
            "| {n} | {wrote:.1?} | {all:.1?} | {med:.0?} | {p99:.0?} | {max:.0?} | {:.0} MiB |",
            rss_mib(&etcd.pids())
        );
    }
    let _ = writeln!(out);
    Ok(())
}
