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
    let mut unreadable = None;
    loop {
        match read_status(&mut s.c, host).await {
            // An unreadable status is the agent's to rewrite: waited for
            // like one that has not caught up yet, and named at the end.
            Ok(Some(Read::Unreadable(why))) => unreadable = Some(why),
            Ok(Some(Read::Status(st))) if st.seen_revision.is_some_and(|r| r >= revision) => match st.result {
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
            let why = unreadable.map(|w| format!(" (its status is unreadable: {w})")).unwrap_or_default();
            bail!("host {host} did not report revision {revision} applied within {wait} s{why}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Status keys `fleet status` reads per request (it continues after the last).
const PAGE: i64 = 100;

/// The largest status `fleet status` reads: a host's agent bounds its own
/// far below (its first problems and a count); a larger value is shown as
/// unreadable, and no page of the listing holds more than one at this size.
pub const MAX_STATUS_BYTES: usize = 1 << 20;

/// The most one response of the listing may carry: one status at the bound,
/// its key and the response's header.
const MAX_RESPONSE_BYTES: usize = MAX_STATUS_BYTES + 64 * 1024;

/// One host's status key, read.
enum Read {
    Status(Box<HostStatus>),
    /// Why it cannot be shown (too large, not JSON, not a status).
    Unreadable(String),
}

fn oversized(bytes: Option<usize>) -> String {
    match bytes {
        Some(n) => format!("{n} bytes, over the {MAX_STATUS_BYTES}-byte bound of a status"),
        None => format!("over the {MAX_STATUS_BYTES}-byte bound of a status (too large to read)"),
    }
}

/// A status value as its agent writes it (`HostStatus` JSON), or why not.
fn parse_status(value: &[u8]) -> Read {
    if value.len() > MAX_STATUS_BYTES {
        return Read::Unreadable(oversized(Some(value.len())));
    }
    match serde_json::from_slice::<HostStatus>(value) {
        Ok(st) => Read::Status(Box::new(st)),
        Err(e) => Read::Unreadable(e.to_string()),
    }
}

/// Whether a request failed because its response was over the client's
/// decode limit (tonic's "decoded message length too large").
fn too_large(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("message length too large"))
}

/// The end of the key range holding every key that starts with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    // The prefixes end in '/': the next byte up closes the range.
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// Every key under `prefix` (with its value unless `keys_only`), in key
/// order, at most [`PAGE`] per request, each response bounded by
/// [`MAX_RESPONSE_BYTES`]: a page over the bound is asked again in halves,
/// and a key whose value alone is over it is given without its value
/// (`None`). Every page reads the revision of the first, so the listing is
/// one snapshot. `each` sees the entries page by page.
async fn list(c: &Client, prefix: &str, keys_only: bool, mut each: impl FnMut(&[u8], Option<&[u8]>)) -> Result<()> {
    let mut kv = c.kv_client().max_decoding_message_size(MAX_RESPONSE_BYTES);
    let end = prefix_end(prefix);
    let mut from = prefix.as_bytes().to_vec();
    let (mut limit, mut revision) = (PAGE, 0);
    loop {
        let mut opts = GetOptions::new().with_range(end.clone()).with_limit(limit).with_revision(revision);
        if keys_only {
            opts = opts.with_keys_only();
        }
        match kv.get(from.clone(), Some(opts)).await {
            Ok(resp) => {
                if revision == 0 {
                    revision = resp.header().map_or(0, |h| h.revision());
                }
                for e in resp.kvs() {
                    each(e.key(), Some(e.value()));
                }
                match resp.kvs().last() {
                    Some(last) if resp.more() => from = [last.key(), &[0]].concat(),
                    _ => return Ok(()),
                }
                limit = (limit * 2).min(PAGE);
            }
            Err(e) if too_large(&e) && limit > 1 => limit /= 2,
            Err(e) if too_large(&e) => {
                let opts = GetOptions::new().with_range(end.clone()).with_limit(1).with_revision(revision);
                let resp = kv.get(from.clone(), Some(opts.with_keys_only())).await?;
                let Some(big) = resp.kvs().first() else { return Ok(()) };
                each(big.key(), None);
                from = [big.key(), &[0]].concat();
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// HOST's status (`None`: no status key).
async fn read_status(c: &mut Client, host: &str) -> Result<Option<Read>> {
    let mut kv = c.kv_client().max_decoding_message_size(MAX_RESPONSE_BYTES);
    match kv.get(naming::fleet_status_key(host), None).await {
        Ok(resp) => Ok(resp.kvs().first().map(|e| parse_status(e.value()))),
        Err(e) if too_large(&e) => Ok(Some(Read::Unreadable(oversized(None)))),
        Err(e) => Err(e.into()),
    }
}

/// One listed host: its name (from the key) and its status.
fn host_entry(key: &[u8], prefix: &str, value: Option<&[u8]>) -> (String, Read) {
    let name = String::from_utf8_lossy(key.strip_prefix(prefix.as_bytes()).unwrap_or(key)).into_owned();
    let read = match check_host(&name) {
        Err(e) => Read::Unreadable(format!("not a host's status key: {e}")),
        Ok(()) => value.map_or_else(|| Read::Unreadable(oversized(None)), parse_status),
    };
    (name, read)
}

/// Prints one host: text lines, or a `"host": {...}` member of the JSON
/// object (`first`: no comma before it).
fn show(host: &str, read: &Read, alive: bool, json: bool, first: bool) -> Result<()> {
    if json {
        let mut v = match read {
            Read::Status(st) => {
                let mut v = serde_json::to_value(st)?;
                v["problems_total"] = st.problems_total.max(st.problems.len()).into();
                v["errors_total"] = st.errors_total.max(st.errors.len()).into();
                v
            }
            Read::Unreadable(why) => serde_json::json!({ "unreadable": why }),
        };
        v["alive"] = alive.into();
        let member = serde_json::to_string_pretty(&serde_json::json!({ host: v }))?;
        // The member without its object's braces, indented as one.
        let inner = member.trim().trim_start_matches('{').trim_end_matches('}').trim_matches('\n');
        print!("{}\n{inner}", if first { "" } else { "," });
        return Ok(());
    }
    let not_alive = if alive { "" } else { " (not alive: no agent holds its lease)" };
    match read {
        Read::Unreadable(why) => println!("{host}: UNREADABLE status: {why}{not_alive}"),
        Read::Status(st) => {
            let rev = |r: Option<i64>| r.map_or("-".into(), |r| r.to_string());
            println!(
                "{host}: {:?}, running revision {}, seen {}{not_alive}",
                st.result,
                rev(st.running_revision),
                rev(st.seen_revision)
            );
            for (lines, total, what) in
                [(&st.problems, st.problems_total, "problems"), (&st.errors, st.errors_total, "errors")]
            {
                for l in lines {
                    println!("  {l}");
                }
                if total > lines.len() {
                    println!("  ({} more {what})", total - lines.len());
                }
            }
        }
    }
    Ok(())
}

async fn status(c: &mut Client, host: Option<&str>, json: bool) -> Result<()> {
    if json {
        print!("{{");
    }
    let mut shown = 0usize;
    match host {
        Some(h) => {
            check_host(h).map_err(|e| anyhow!(e))?;
            if let Some(read) = read_status(c, h).await? {
                let alive =
                    c.get(naming::fleet_alive_key(h), Some(GetOptions::new().with_count_only())).await?.count() > 0;
                show(h, &read, alive, json, true)?;
                shown = 1;
            }
        }
        None => {
            // Every host's key, less the host: the prefix of them all.
            let alive_prefix = naming::fleet_alive_key("");
            let mut alive = std::collections::HashSet::new();
            list(c, &alive_prefix, true, |k, _| {
                alive.insert(k.strip_prefix(alive_prefix.as_bytes()).unwrap_or(k).to_vec());
            })
            .await?;
            let status_prefix = naming::fleet_status_key("");
            let mut failed = None;
            list(c, &status_prefix, false, |k, v| {
                if failed.is_some() {
                    return;
                }
                let (name, read) = host_entry(k, &status_prefix, v);
                let is_alive = alive.contains(name.as_bytes());
                match show(&name, &read, is_alive, json, shown == 0) {
                    Ok(()) => shown += 1,
                    Err(e) => failed = Some(e),
                }
            })
            .await?;
            if let Some(e) = failed {
                return Err(e);
            }
        }
    }
    if json {
        println!("{}}}", if shown == 0 { "" } else { "\n" });
        return Ok(());
    }
    if shown == 0 {
        bail!("no status reported{}", host.map(|h| format!(" by host {h}")).unwrap_or_default());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_range_ends_after_its_prefix() {
        let prefix = naming::fleet_status_key("");
        let end = prefix_end(&prefix);
        let key = naming::fleet_status_key("zzz.99");
        assert!(key.as_bytes() >= prefix.as_bytes() && key.as_bytes() < &end[..]);
        let alive = naming::fleet_alive_key("a");
        assert!(!(alive.as_bytes() >= prefix.as_bytes() && alive.as_bytes() < &end[..]), "{alive} in the range");
    }

    #[test]
    fn statuses_are_read_or_said_unreadable() {
        let ok = serde_json::to_vec(&HostStatus { result: Outcome::Applied, ..Default::default() }).unwrap();
        assert!(
            matches!(parse_status(&ok), Read::Status(st) if st.result == Outcome::Applied && st.problems_total == 0)
        );
        let counted = br#"{"result":"rejected","problems":["a"],"errors":[],"seen_revision":null,
                           "running_revision":null,"problems_total":9}"#;
        assert!(matches!(parse_status(counted), Read::Status(st) if st.problems_total == 9));
        for (bad, why) in
            [(&b"{"[..], "EOF"), (br#"{"result":"x"}"#, "unknown variant"), (&[0xff][..], "expected value")]
        {
            assert!(matches!(parse_status(bad), Read::Unreadable(w) if w.contains(why)), "{bad:?}");
        }
        let big = vec![b' '; MAX_STATUS_BYTES + 1];
        assert!(matches!(parse_status(&big), Read::Unreadable(w) if w.contains("over the")));
        let key = naming::fleet_status_key("a/b");
        let (name, read) = host_entry(key.as_bytes(), &naming::fleet_status_key(""), Some(&ok));
        assert!(name == "a/b" && matches!(read, Read::Unreadable(w) if w.contains("not a host's status key")));
    }
}
