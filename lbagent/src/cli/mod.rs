//! The `lbagent` command line.

pub mod conntrack;
pub mod fleet;
pub mod format;
mod map_rows;
pub mod maps;
pub mod status;

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use crate::{
    daemon,
    dataplane::{DEFAULT_BPFFS, attach::AttachMode},
};

pub const DEFAULT_STATE: &str = "/etc/lbagent/state.yaml";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/lbagent";
pub const DEFAULT_API_SOCKET: &str = "/run/lbagent/lbagent.sock";

#[derive(Parser)]
#[command(name = "lbagent", version, about = "eBPF dataplane agent for VPC load balancers and NAT gateways")]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Command,
}

/// `--metrics`: an address, or `off`.
#[derive(Clone, Copy, Debug)]
pub struct MetricsAddr(pub Option<SocketAddr>);

fn parse_metrics(s: &str) -> Result<MetricsAddr, String> {
    if s == "off" {
        return Ok(MetricsAddr(None));
    }
    s.parse().map(|a| MetricsAddr(Some(a))).map_err(|_| format!("{s:?}: expected ADDR:PORT or off"))
}

/// Flags every command shares with `run`, so several agents can run side by side.
#[derive(Args, Clone, Debug)]
pub struct Common {
    /// bpffs directory holding lbagent's pins.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// Directory for agent-owned state (allocations, applied specs).
    #[arg(long, default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Unix socket of the daemon's API.
    #[arg(long, default_value = DEFAULT_API_SOCKET)]
    pub api_socket: PathBuf,
    /// A tag in the names of the namespaces and links this agent creates
    /// (at most 8 characters a-z, 0-9), for two agents on one host: the
    /// two halves of an HA pair on one test machine. Object and rule keys
    /// do not carry it.
    #[arg(long, default_value = "")]
    pub instance: String,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the agent: reconcile the state file, reload on change and SIGHUP.
    Run {
        /// The state file (YAML or JSON by extension).
        #[arg(long, default_value = DEFAULT_STATE, conflicts_with = "endpoints")]
        state: PathBuf,
        /// Fleet mode: take the desired state from etcd (`--etcd`) at
        /// `/lbagent/v1/desired/<host>` and report to `/lbagent/v1/status/<host>`.
        #[arg(long, requires = "endpoints")]
        host: Option<String>,
        #[command(flatten)]
        etcd: crate::fleet::conn::EtcdArgs,
        /// Fleet mode: the oldest cached document (seconds since etcd last
        /// confirmed it current) applied at start when etcd is unreachable;
        /// 0 never applies the cache.
        #[arg(long, default_value_t = crate::fleet::source::DEFAULT_CACHE_MAX_AGE.as_secs(), requires = "host")]
        etcd_cache_max_age: u64,
        /// auto (tcx on Linux >= 6.6, netlink below), netlink or tcx.
        #[arg(long, default_value = "auto")]
        attach: AttachMode,
        /// Prometheus metrics address, or `off` for no metrics endpoint.
        #[arg(long, default_value = "127.0.0.1:9477", value_parser = parse_metrics)]
        metrics: MetricsAddr,
        /// Seconds between repair passes that re-ensure every object.
        #[arg(long, default_value_t = 11)]
        repair_interval: u64,
        /// The directory flow logs' JSON Lines files are written in
        /// (`agent.flow_logs.jsonl.file` names a file there; created 0750).
        #[arg(long, default_value = crate::flow_log::DEFAULT_DIR)]
        flow_log_dir: PathBuf,
        /// eBPF-side logs (off, error, warn, info, debug, trace), shown under
        /// the `lbagent_ebpf` target; `off` costs nothing per packet.
        #[arg(long, default_value = "off")]
        ebpf_log: crate::dataplane::logs::EbpfLogLevel,
        /// Established-flow table size in entries (two per flow). Default: the
        /// pinned table's size; for a new dataplane, 1/64 of the host's memory
        /// (a power of two, 262144 to 4194304; 2097152 on a 24 GiB host).
        /// Fixed for the life of the pins: a different size is refused until teardown.
        #[arg(long, value_parser = clap::value_parser!(u32).range(2..))]
        conntrack_max: Option<u32>,
        /// New-flow table size in entries (two per flow; default the pinned
        /// table's size, or a quarter of the established table's for a new
        /// dataplane or a --conntrack-max that resizes it, at least 256): flows not established yet, UDP
        /// query/answer flows for their whole life. Size it by concurrency:
        /// new flows per second × how long they stay new (TCP handshake, up to
        /// 60 s unanswered; UDP queries 30 s), times two. An LRU: when full,
        /// the oldest new flow is evicted. Fixed for the life of the pins.
        #[arg(long, value_parser = clap::value_parser!(u32).range(256..))]
        conntrack_new_max: Option<u32>,
        /// The largest share (percent) of the running objects one document
        /// may remove without `allow_mass_removal: true` in it (a shorter,
        /// torn document is refused); 100 turns the guard off.
        #[arg(long, default_value_t = daemon::guard::DEFAULT_MAX_REMOVAL_PERCENT,
              value_parser = clap::value_parser!(u8).range(0..=100))]
        max_removal: u8,
        #[command(flatten)]
        common: Common,
    },
    /// Check a state file: exit 0 when valid, else print every problem with its path.
    Validate { file: PathBuf },
    /// Ask the running daemon for its load balancers, gateways, allocations and last apply.
    Status {
        #[arg(long)]
        json: bool,
        /// bpffs directory holding the daemon's pins, for the rule and QoS
        /// counters (default: the daemon's own `--bpffs`, read from its
        /// command line).
        #[arg(long)]
        bpffs: Option<PathBuf>,
        /// Unix socket of the daemon's API.
        #[arg(long, default_value = DEFAULT_API_SOCKET)]
        api_socket: PathBuf,
        /// Accepted like every command's; `status` does not use them.
        #[arg(long, hide = true)]
        state_dir: Option<PathBuf>,
        #[arg(long, hide = true)]
        instance: Option<String>,
    },
    /// Decode the pinned maps (works without the daemon).
    Maps {
        /// Only this map: any pinned map's name (docs/architecture.md, *Maps*; an unknown name is
        /// answered with the list).
        name: Option<String>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        common: Common,
    },
    /// List, flush or garbage-collect tracked connections.
    Conntrack {
        #[command(subcommand)]
        action: conntrack::Action,
    },
    /// Fleet mode: put, read and drain hosts' desired state in etcd; read their status.
    ///
    /// The etcd and TLS flags go before or after the subcommand's name.
    // Every flag of `EtcdArgs` (a new one too) is global to the subcommands.
    #[command(mut_args = |a: clap::Arg| a.global(true))]
    Fleet {
        #[command(subcommand)]
        action: fleet::Action,
        #[command(flatten)]
        etcd: crate::fleet::conn::EtcdArgs,
    },
    /// The HA pair's role (`agent.ha`, docs/ha.md): status, promote,
    /// demote, switchover.
    Ha {
        #[command(subcommand)]
        action: HaAction,
        /// Unix socket of the daemon's API.
        #[arg(long, default_value = DEFAULT_API_SOCKET, global = true)]
        api_socket: PathBuf,
    },
    /// Remove everything the agent created (stop the daemon first).
    Teardown {
        #[command(flatten)]
        common: Common,
    },
}

#[derive(Subcommand, Clone, Copy, Debug)]
pub enum HaAction {
    /// The role, the peer, the sync (lag, flows synced, dropped, bulk passes).
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Take the active role: bring every gateway's links up and announce
    /// its addresses (what keepalived's notify script runs on MASTER).
    Promote,
    /// Give up the active role: every gateway's links down (BACKUP, FAULT).
    Demote,
    /// On the active: hand the role to the ready peer over the sync link,
    /// then step down once the peer announces.
    Switchover,
}

fn ha(action: HaAction, api_socket: &std::path::Path) -> Result<()> {
    let req = match action {
        HaAction::Status { .. } => "ha status",
        HaAction::Promote => "ha promote",
        HaAction::Demote => "ha demote",
        HaAction::Switchover => "ha switchover",
    };
    let v = daemon::api::request(api_socket, req)?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        anyhow::bail!("{e}");
    }
    match action {
        HaAction::Status { json: true } => println!("{}", serde_json::to_string_pretty(&v)?),
        HaAction::Status { json: false } => {
            let st: crate::ha::HaStatus = serde_json::from_value(v)?;
            print!("{}", status::ha_lines(&st).join("\n") + "\n");
        }
        _ => println!("{}", v.get("ok").and_then(|m| m.as_str()).unwrap_or("done")),
    }
    Ok(())
}

fn set_instance(common: &Common) -> Result<()> {
    crate::naming::set_instance(&common.instance).map_err(|e| anyhow::anyhow!("--instance: {e}"))
}

pub fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("LBAGENT_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: logs in files and journals stay plain.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Cli::parse().cmd {
        Command::Run {
            state,
            host,
            etcd,
            etcd_cache_max_age,
            attach,
            metrics,
            repair_interval,
            flow_log_dir,
            conntrack_max,
            conntrack_new_max,
            max_removal,
            ebpf_log,
            common,
        } => {
            crate::dataplane::logs::set_level(ebpf_log);
            set_instance(&common)?;
            let source: Box<dyn daemon::source::Source> = match host {
                None if etcd.endpoints.is_empty() => Box::new(daemon::source::FileSource::new(state)),
                None => anyhow::bail!("--etcd needs --host NAME (whose desired state to follow)"),
                Some(host) => {
                    crate::fleet::check_host(&host).map_err(|e| anyhow::anyhow!("--host: {e}"))?;
                    Box::new(crate::fleet::source::EtcdSource {
                        etcd: crate::fleet::conn::Etcd::new(&etcd)?,
                        host,
                        cache: common.state_dir.join(crate::fleet::CACHE_FILE),
                        lease_file: common.state_dir.join(crate::fleet::LEASE_FILE),
                        cache_max_age: std::time::Duration::from_secs(etcd_cache_max_age),
                        earlier: Default::default(),
                    })
                }
            };
            let opts = daemon::Options {
                state_dir: common.state_dir,
                bpffs: common.bpffs,
                attach,
                metrics: metrics.0,
                api_socket: common.api_socket,
                repair_interval: Duration::from_secs(repair_interval.max(1)),
                conntrack_max,
                conntrack_new_max,
                max_removal_percent: max_removal,
                flow_log_dir,
            };
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(daemon::run(opts, source))
        }
        Command::Validate { file } => match crate::state::accept_file(&file) {
            Ok(crate::state::Accepted { state: s, warnings, .. }) => {
                println!(
                    "{}: valid ({} load balancers, {} NAT gateways, {} QoS policies)",
                    file.display(),
                    s.load_balancers.len(),
                    s.nat_gateways.len(),
                    s.qos_policies.len()
                );
                for w in warnings {
                    println!("warning: {w}");
                }
                Ok(())
            }
            Err(problems) => {
                for p in &problems.0 {
                    println!("{p}");
                }
                std::process::exit(2);
            }
        },
        Command::Status { json, bpffs, api_socket, .. } => status::run(&api_socket, bpffs.as_deref(), json),
        Command::Maps { name, json, common } => maps::run(&common.bpffs, name.as_deref(), json),
        Command::Conntrack { action } => conntrack::run(action),
        Command::Fleet { action, etcd } => fleet::run(action, &etcd),
        Command::Ha { action, api_socket } => ha(action, &api_socket),
        Command::Teardown { common } => {
            set_instance(&common)?;
            daemon::teardown(&common.state_dir, &common.bpffs, &common.api_socket)
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    /// Every flag of `EtcdArgs` (with a made-up value), as a command line.
    fn every_etcd_flag() -> Vec<String> {
        let cmd = crate::fleet::conn::EtcdArgs::augment_args(clap::Command::new("etcd"));
        let mut out = Vec::new();
        for a in cmd.get_arguments() {
            out.push(format!("--{}", a.get_long().expect("etcd flags are long flags")));
            if a.get_action().takes_values() {
                out.push(format!("v-{}", a.get_id()));
            }
        }
        out
    }

    fn fleet_etcd(args: &[String]) -> String {
        match Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}")).cmd {
            Command::Fleet { etcd, .. } => format!("{etcd:?}"),
            _ => unreachable!(),
        }
    }

    #[test]
    fn every_etcd_flag_goes_before_or_after_each_fleet_subcommand() {
        let flags = every_etcd_flag();
        assert!(flags.len() >= 4, "{flags:?}");
        let s = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        for sub in [&["put", "h", "f"][..], &["get", "h"], &["status"], &["status", "h"], &["drain", "h"]] {
            let before = fleet_etcd(&[s(&["lbagent", "fleet"]), flags.clone(), s(sub)].concat());
            let after = fleet_etcd(&[s(&["lbagent", "fleet"]), s(sub), flags.clone()].concat());
            assert_eq!(before, after, "{sub:?}");
            assert!(before.contains("v-endpoints"), "{before}");
        }
        Cli::command().debug_assert();
    }
}
