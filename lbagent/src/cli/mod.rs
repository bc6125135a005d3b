//! The `lbagent` command line.

pub mod conntrack;
pub mod format;
pub mod maps;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::dataplane::DEFAULT_BPFFS;

#[derive(Parser)]
#[command(name = "lbagent", version, about = "eBPF dataplane agent for VPC load balancers and NAT gateways")]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Command,
}

/// Flags every client command shares with `run`.
#[derive(Args, Clone, Debug)]
pub struct Common {
    /// bpffs directory holding lbagent's pins.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
}

#[derive(Subcommand)]
pub enum Command {
    /// Decode the pinned maps (works without the daemon).
    Maps {
        /// Only this map (ct, dnat_rules, dnat_backends, snat_rules, nat_config, counters, meta).
        name: Option<String>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        common: Common,
    },
    /// List or flush tracked connections.
    Conntrack {
        #[command(subcommand)]
        action: conntrack::Action,
        #[command(flatten)]
        common: Common,
    },
}

pub fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("LBAGENT_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Command::Maps { name, json, common } => maps::run(&common.bpffs, name.as_deref(), json),
        Command::Conntrack { action, common } => conntrack::run(&common.bpffs, action),
    }
}
