//! Fleet mode: each host's desired state lives in etcd v3, one key holding
//! the whole document (`naming::fleet_desired_key`), and each agent writes
//! its status and a liveness key back (`../shared/DESIGN.md` §9,
//! `docs/operations.md`).
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
    /// Every problem of a refused document, with its path.
    pub problems: Vec<String>,
    /// Objects whose last apply failed: `<object>: <error>`.
    pub errors: Vec<String>,
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
        let errors: Vec<String> = doc
            .last_apply
            .as_ref()
            .map(|a| a.errors.iter().map(|e| format!("{}: {}", e.object, e.error)).collect())
            .unwrap_or_default();
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
            problems: doc.rejected_state.clone().unwrap_or_default(),
            errors,
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
            errors: vec![ObjectError { object: "lb/x".into(), error: "boom".into() }],
            ..Default::default()
        });
        assert_eq!(HostStatus::of(&d).errors, vec!["lb/x: boom".to_string()]);
        assert_eq!(HostStatus::of(&d).result, Outcome::ApplyErrors);
        d.rejected_state = Some(vec!["load_balancers[0].id: bad".into()]);
        assert_eq!(HostStatus::of(&d).result, Outcome::Rejected);
    }
}
