//! Fleet mode: each host's desired state lives in etcd v3, one key holding
//! the whole document (`naming::fleet_desired_key`), and each agent writes
//! its status and a liveness key back (`docs/operations.md`, *Fleet mode*).
//!
//! - `conn.rs`: endpoints and TLS from the command line, one connection at a
//!   time with failover across endpoints and jittered backoff (the client
//!   library does neither).
//! - `source.rs`: the daemon's etcd [`Source`](crate::daemon::source::Source):
//!   get, then watch from revision + 1; the last accepted document cached on
//!   disk; status and liveness written back.
//! - `HostStatus`: the status document, shared by the agent that writes it
//!   and `lbagent fleet status` / `put --wait` that read it.

pub mod conn;
pub mod source;

use serde::{Deserialize, Serialize};

/// The last accepted document, in the state dir (applied at start when
/// etcd is unreachable).
pub const CACHE_FILE: &str = "fleet-desired.json";

/// The lease this state dir's agent holds the alive key with: a restarted
/// agent (after a crash) takes the key over from it at once.
pub const LEASE_FILE: &str = "fleet-lease";

/// etcd's default request size limit (1.5 MiB): a larger document is
/// refused by `fleet put` before it reaches the server.
pub const MAX_DOCUMENT_BYTES: usize = 1536 * 1024;

/// A host name as used in fleet keys: 1–63 of `a-z 0-9 - .`, starting and
/// ending with a letter or digit (so no key can reach another host's).
pub fn check_host(s: &str) -> Result<(), String> {
    let ok_edge = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if s.is_empty() || s.len() > 63 {
        return Err(format!("host {s:?}: must have 1 to 63 characters"));
    }
    if !s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.') {
        return Err(format!("host {s:?}: only lowercase letters, digits, '-' and '.' are allowed"));
    }
    if !ok_edge(s.as_bytes().first()) || !ok_edge(s.as_bytes().last()) {
        return Err(format!("host {s:?}: must start and end with a letter or digit"));
    }
    Ok(())
}

/// What a host's agent reports at `/lbagent/v1/status/<host>` (JSON; written
/// only when it changes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostStatus {
    /// etcd revision of the newest document the agent saw (accepted or not).
    pub seen_revision: Option<i64>,
    /// etcd revision of the document running (the last accepted one).
    pub running_revision: Option<i64>,
    pub result: Outcome,
    /// The first [`STATUS_LISTED`] problems of a refused document, each
    /// with its path (at most [`STATUS_LINE_BYTES`] bytes each).
    pub problems: Vec<String>,
    /// How many problems there were in all.
    #[serde(default)]
    pub problems_total: usize,
    /// The first [`STATUS_LISTED`] objects whose last apply failed:
    /// `<object>: <error>`.
    pub errors: Vec<String>,
    /// How many objects failed in all.
    #[serde(default)]
    pub errors_total: usize,
}

/// Problems and errors listed in a status document (the rest are counted):
/// a document with ten thousand problems must not make a status too large
/// for etcd or for `fleet status` to read.
pub const STATUS_LISTED: usize = 50;
/// The longest problem or error line kept in a status document.
pub const STATUS_LINE_BYTES: usize = 512;

/// The first [`STATUS_LISTED`] lines, each cut to [`STATUS_LINE_BYTES`].
fn bounded(lines: impl Iterator<Item = String>) -> Vec<String> {
    lines
        .take(STATUS_LISTED)
        .map(|mut l| {
            if l.len() > STATUS_LINE_BYTES {
                let mut end = STATUS_LINE_BYTES - 3;
                while !l.is_char_boundary(end) {
                    end -= 1;
                }
                l.truncate(end);
                l.push_str("...");
            }
            l
        })
        .collect()
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Nothing applied yet.
    #[default]
    Pending,
    Applied,
    /// The newest document was refused; the previous one keeps running.
    Rejected,
    /// The document was accepted; some objects failed (retried every pass).
    ApplyErrors,
}

impl HostStatus {
    /// The fleet view of the daemon's status document.
    pub fn of(doc: &crate::daemon::status::StatusDoc) -> HostStatus {
        let rev = |r: &Option<String>| r.as_deref().and_then(|r| r.parse().ok());
        let failed = doc.last_apply.as_ref().map(|a| a.errors.as_slice()).unwrap_or_default();
        let errors = bounded(failed.iter().map(|e| format!("{}: {}", e.object, e.error)));
        let problems = doc.rejected_state.as_deref().unwrap_or_default();
        let result = if doc.rejected_state.is_some() {
            Outcome::Rejected
        } else {
            match &doc.last_apply {
                None => Outcome::Pending,
                Some(a) if a.ok => Outcome::Applied,
                Some(_) => Outcome::ApplyErrors,
            }
        };
        HostStatus {
            seen_revision: rev(&doc.revision_seen),
            running_revision: rev(&doc.revision_running),
            result,
            problems: bounded(problems.iter().cloned()),
            problems_total: problems.len(),
            errors,
            errors_total: failed.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_cannot_reach_other_keys() {
        for ok in ["h1", "node-7.dc1", "a"] {
            assert!(check_host(ok).is_ok(), "{ok}");
        }
        for bad in ["", "H1", "a/b", "../x", "-a", "a-", "a b", &"x".repeat(64), "h1\n"] {
            assert!(check_host(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn status_follows_the_daemon() {
        use crate::daemon::status::{LastApply, ObjectError, StatusDoc};
        let mut d =
            StatusDoc { revision_seen: Some("7".into()), revision_running: Some("5".into()), ..Default::default() };
        assert_eq!(HostStatus::of(&d).result, Outcome::Pending);
        d.last_apply = Some(LastApply { ok: true, ..Default::default() });
        let s = HostStatus::of(&d);
        assert_eq!((s.seen_revision, s.running_revision, s.result), (Some(7), Some(5), Outcome::Applied));
        d.last_apply = Some(LastApply {
            ok: false,
            errors: vec![ObjectError {
                object: "lb/x".into(),
                kind: crate::outcome::ErrorKind::Rules,
                error: "boom".into(),
            }],
            ..Default::default()
        });
        assert_eq!(HostStatus::of(&d).errors, vec!["lb/x: boom".to_string()]);
        assert_eq!(HostStatus::of(&d).result, Outcome::ApplyErrors);
        d.rejected_state = Some(vec!["load_balancers[0].id: bad".into()]);
        assert_eq!(HostStatus::of(&d).result, Outcome::Rejected);
    }

    #[test]
    fn a_status_stays_small_however_many_problems() {
        use crate::daemon::status::StatusDoc;
        let many: Vec<String> = (0..10_000).map(|i| format!("nat_gateways[{i}].name: {}", "é".repeat(400))).collect();
        let d = StatusDoc { rejected_state: Some(many), ..Default::default() };
        let s = HostStatus::of(&d);
        assert_eq!((s.problems.len(), s.problems_total), (STATUS_LISTED, 10_000));
        assert!(s.problems.iter().all(|p| p.len() <= STATUS_LINE_BYTES && p.ends_with("...")));
        assert!(serde_json::to_string(&s).unwrap().len() < 32 * 1024);
    }
}
