//! `lbagent fleet put|get|status|drain`: operators' side of fleet mode.
//! Documents are validated here exactly as the agent will (a refused one
//! never reaches etcd); `--wait` follows the host's status key until its
//! agent runs the new revision.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result, anyhow, bail};
use clap::Subcommand;
use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp};

use crate::{
    fleet::{
        HostStatus, MAX_DOCUMENT_BYTES, Outcome, check_host,
        conn::{Etcd, EtcdArgs},
        source::format_of,
    },
    naming, state,
};

#[derive(Subcommand)]
pub enum Action {
    /// Validate FILE and store it as HOST's desired state.
    Put {
        host: String,
        file: PathBuf,
        /// Only if the key is still at this revision (0: only if absent).
        #[arg(long)]
        if_revision: Option<i64>,
        /// Wait until HOST's agent reports this revision applied (seconds; 0 = do not wait).
        #[arg(long, default_value_t = 0)]
        wait: u64,
    },
    /// Print HOST's desired state (its revision on stderr).
    Get { host: String },
    /// HOST's status as its agent reports it (every host without HOST).
    Status {
        host: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Store an empty document for HOST (with `allow_mass_removal: true`):
    /// its agent removes every object.
    Drain {
        host: String,
        #[arg(long, default_value_t = 0)]
        wait: u64,
    },
}

/// An empty document that says so: drains a host (the mass-removal guard
/// lets it through).
pub const EMPTY: &str = "version: 1\nallow_mass_removal: true\n";

pub fn run(action: Action, args: &EtcdArgs) -> Result<()> {
    let etcd = Etcd::new(args)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        let mut s = Session::open(etcd).await?;
        match action {
            Action::Put { host, file, if_revision, wait } => {
                check_host(&host).map_err(|e| anyhow!(e))?;
                let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
                put(&mut s, &host, &text, if_revision, wait).await
            }
            Action::Drain { host, wait } => {
                check_host(&host).map_err(|e| anyhow!(e))?;
                put(&mut s, &host, EMPTY, None, wait).await
            }
            Action::Get { host } => {
                check_host(&host).map_err(|e| anyhow!(e))?;
                let resp = s.c.get(naming::fleet_desired_key(&host), None).await?;
                let kv = resp.kvs().first().with_context(|| format!("no desired state for host {host}"))?;
                eprintln!("revision {}", kv.mod_revision());
                print!("{}", kv.value_str()?);
                Ok(())
            }
            Action::Status { host, json } => status(&mut s.c, host.as_deref(), json).await,
        }
    })
}

/// One connection, moved to the next endpoint when a request fails (a
/// member going away, an election in progress).
struct Session {
    etcd: Etcd,
    next: usize,
    c: Client,
}

impl Session {
    async fn open(etcd: Etcd) -> Result<Session> {
        let mut next = 0;
        let (c, _) = etcd.connect_any(&mut next).await.context("etcd unreachable")?;
        Ok(Session { etcd, next, c })
    }

    async fn failover(&mut self, e: &anyhow::Error) -> Result<()> {
        eprintln!("etcd request failed ({e:#}); trying the next endpoint");
        tokio::time::sleep(Duration::from_millis(500)).await;
        self.next += 1;
        self.c = self.etcd.connect_any(&mut self.next).await.context("etcd unreachable")?.0;
        Ok(())
    }
}

/// Writes the document (the same bytes on a retry, so a write that landed
/// before its answer was lost is harmless); its revision.
async fn write(s: &mut Session, host: &str, text: &str, if_revision: Option<i64>) -> Result<i64> {
    let key = naming::fleet_desired_key(host);
    match if_revision {
        None => Ok(s.c.put(key, text, None).await?.header().map_or(0, |h| h.revision())),
        Some(want) => {
            let txn = Txn::new()
                .when([Compare::mod_revision(key.clone(), CompareOp::Equal, want)])
                .and_then([TxnOp::put(key.clone(), text, None)]);
            let resp = s.c.txn(txn).await?;
            if !resp.succeeded() {
                let now = s.c.get(key, None).await?.kvs().first().map_or(0, |kv| kv.mod_revision());
                return Err(Refused(format!(
                    "host {host}'s document is at revision {now}, not {want}: nothing was written"
                ))
                .into());
            }
            Ok(resp.header().map_or(0, |h| h.revision()))
        }
    }
}

/// A refusal that no retry changes.
#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

async fn put(s: &mut Session, host: &str, text: &str, if_revision: Option<i64>, wait: u64) -> Result<()> {
    if text.len() > MAX_DOCUMENT_BYTES {
        bail!("the document has {} bytes; etcd refuses requests over {MAX_DOCUMENT_BYTES}", text.len());
    }
    if let Err(problems) = state::accept_str(text, format_of(text)) {
        for p in &problems.0 {
            eprintln!("{p}");
        }
        bail!("refused: {} problems (nothing was written)", problems.0.len());
    }
    let mut attempts = 0;
    let revision = loop {
        match write(s, host, text, if_revision).await {
            Ok(r) => break r,
            Err(e) if e.is::<Refused>() || attempts >= 3 => return Err(e),
            Err(e) => {
                attempts += 1;
                s.failover(&e).await?;
            }
        }
    };
    println!("host {host}: revision {revision}");
    if wait == 0 {
        return Ok(());
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait);
    loop {
        match read_status(&mut s.c, host).await {
            Ok(Some(st)) if st.seen_revision.is_some_and(|r| r >= revision) => match st.result {
                Outcome::Applied if st.running_revision.is_some_and(|r| r >= revision) => {
                    println!("host {host}: applied");
                    return Ok(());
                }
                Outcome::Rejected => bail!("host {host} refused revision {revision}:\n{}", st.problems.join("\n")),
                Outcome::ApplyErrors => {
                    bail!("host {host} applied revision {revision} with errors:\n{}", st.errors.join("\n"))
                }
                _ => {}
            },
            Ok(_) => {}
            Err(e) => {
                if tokio::time::Instant::now() > deadline {
                    return Err(e);
                }
                s.failover(&e).await?;
            }
        }
        if tokio::time::Instant::now() > deadline {
            bail!("host {host} did not report revision {revision} applied within {wait} s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn read_status(c: &mut Client, host: &str) -> Result<Option<HostStatus>> {
    let resp = c.get(naming::fleet_status_key(host), None).await?;
    resp.kvs().first().map(|kv| serde_json::from_slice(kv.value()).context("host status")).transpose()
}

async fn status(c: &mut Client, host: Option<&str>, json: bool) -> Result<()> {
    let prefix = |kind: &str| format!("{}{kind}/", naming::FLEET_PREFIX);
    let (status_key, alive_key, opts) = match host {
        Some(h) => {
            check_host(h).map_err(|e| anyhow!(e))?;
            (naming::fleet_status_key(h), naming::fleet_alive_key(h), None)
        }
        None => (prefix("status"), prefix("alive"), Some(GetOptions::new().with_prefix())),
    };
    let statuses = c.get(status_key, opts.clone()).await?;
    let alive = c.get(alive_key, opts).await?;
    let alive: Vec<String> =
        alive.kvs().iter().filter_map(|kv| kv.key_str().ok()?.rsplit('/').next().map(str::to_string)).collect();
    let mut all = serde_json::Map::new();
    for kv in statuses.kvs() {
        let h = kv.key_str()?.rsplit('/').next().unwrap_or_default().to_string();
        let st: HostStatus = serde_json::from_slice(kv.value()).with_context(|| format!("status of {h}"))?;
        let mut v = serde_json::to_value(&st)?;
        v["alive"] = serde_json::Value::Bool(alive.contains(&h));
        all.insert(h, v);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    if all.is_empty() {
        bail!("no status reported{}", host.map(|h| format!(" by host {h}")).unwrap_or_default());
    }
    for (h, v) in &all {
        let st: HostStatus = serde_json::from_value(v.clone())?;
        let rev = |r: Option<i64>| r.map_or("-".into(), |r| r.to_string());
        println!(
            "{h}: {:?}, running revision {}, seen {}{}",
            st.result,
            rev(st.running_revision),
            rev(st.seen_revision),
            if v["alive"] == true { "" } else { " (not alive: no agent holds its lease)" }
        );
        for p in st.problems.iter().chain(&st.errors) {
            println!("  {p}");
        }
    }
    Ok(())
}
