//! `lbagent conntrack list|flush [filters]`.

use std::net::Ipv4Addr;

use anyhow::{Result, anyhow};
use clap::{Args, Subcommand};
use lbagent_common::{CtEntry, FLOW_END_FLUSH, Tuple};

use super::{Common, format as fmt};
use crate::dataplane::tables::Tables;

#[derive(Subcommand, Clone, Debug)]
pub enum Action {
    /// Print tracked flows (both entries of each flow).
    List {
        #[command(flatten)]
        filter: Filter,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Delete tracked flows matching the filters (all flows without filters).
    Flush {
        #[command(flatten)]
        filter: Filter,
        #[command(flatten)]
        common: Common,
    },
    /// Delete flows idle past their timeout (the daemon does this every repair pass).
    Gc {
        #[command(flatten)]
        common: Common,
    },
}

/// Selects flows by any field of either direction's tuple.
#[derive(Args, Clone, Debug, Default)]
pub struct Filter {
    #[arg(long)]
    pub zone: Option<u16>,
    /// tcp, udp, icmp or a number.
    #[arg(long, value_parser = parse_proto)]
    pub proto: Option<u8>,
    /// Matches source or destination address.
    #[arg(long)]
    pub addr: Option<Ipv4Addr>,
    /// Matches source or destination port.
    #[arg(long)]
    pub port: Option<u16>,
}

fn parse_proto(s: &str) -> Result<u8> {
    fmt::proto_number(s).ok_or_else(|| anyhow!("protocol {s:?}: expected tcp, udp, icmp or a number"))
}

impl Filter {
    pub fn matches(&self, k: &Tuple, _e: &CtEntry) -> bool {
        self.zone.is_none_or(|z| k.zone == z)
            && self.proto.is_none_or(|p| k.proto == p)
            && self.addr.is_none_or(|a| k.saddr == a.octets() || k.daddr == a.octets())
            && self.port.is_none_or(|p| k.sport == p || k.dport == p)
    }
}

pub fn run(action: Action) -> Result<()> {
    let bpffs = match &action {
        Action::List { common, .. } | Action::Flush { common, .. } | Action::Gc { common } => common.bpffs.clone(),
    };
    let tables = Tables::open(&bpffs)?;
    match action {
        Action::List { filter, json, .. } => {
            let now = fmt::monotonic_ns();
            let entries = tables.conntrack_matching(|k, e| filter.matches(k, e))?;
            if json {
                let v: Vec<_> = entries.iter().map(|(k, e)| fmt::CtRow::new(k, e, now)).collect();
                // Through a `Value`: keys sorted, as `lbagent maps --json`.
                let v = serde_json::to_value(&v)?;
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for (k, e) in &entries {
                    println!("{}", fmt::CtRow::new(k, e, now));
                }
                eprintln!("{} entries", entries.len());
            }
        }
        Action::Gc { .. } => {
            println!("collected {} idle flows", crate::dataplane::ct_gc::collect(&bpffs)?)
        }
        Action::Flush { filter, .. } => {
            let n = tables.flush_conntrack_for(FLOW_END_FLUSH, |k, e| filter.matches(k, e))?;
            println!("flushed {n} flows");
        }
    }
    Ok(())
}
