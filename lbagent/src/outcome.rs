//! What an apply reports, typed: the changes it made on the host, line by
//! line ([`Changes`]), and the objects it could not bring to their spec
//! ([`ObjectError`]), each with the kind of step that failed, which
//! `lbagent status` shows and the metrics count by.

use serde::{Deserialize, Serialize};

/// Changes made on the host, in the order they were made, one line each
/// (logged, reported in the status and kept with the last apply).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Changes(Vec<String>);

impl Changes {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, line: String) {
        self.0.push(line);
    }

    /// Puts a heading line before the others (what the object's step was).
    pub fn prepend(&mut self, line: String) {
        self.0.insert(0, line);
    }

    /// Takes in the changes of a part, in order.
    pub fn append(&mut self, part: Changes) {
        self.0.extend(part.0);
    }

    /// Takes in the changes of an object, each line prefixed with its key.
    pub fn append_of(&mut self, object: &str, part: Changes) {
        self.0.extend(part.0.into_iter().map(|c| format!("{object}: {c}")));
    }
}

impl std::ops::Deref for Changes {
    type Target = [String];

    fn deref(&self) -> &[String] {
        &self.0
    }
}

impl Extend<String> for Changes {
    fn extend<I: IntoIterator<Item = String>>(&mut self, lines: I) {
        self.0.extend(lines);
    }
}

impl FromIterator<String> for Changes {
    fn from_iter<I: IntoIterator<Item = String>>(lines: I) -> Self {
        Changes(lines.into_iter().collect())
    }
}

impl IntoIterator for Changes {
    type Item = String;
    type IntoIter = std::vec::IntoIter<String>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a> IntoIterator for &'a Changes {
    type Item = &'a String;
    type IntoIter = std::slice::Iter<'a, String>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// The kind of step an object's apply failed in: a metric label
/// (`lbagent_last_apply_errors{kind}`) and a field of the status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Namespaces, links, addresses, routes, sysctls.
    Plumbing,
    /// Open vSwitch ports and bridges.
    Ovs,
    /// Zones, addresses, mapped ports, rule ids, QoS buckets.
    Allocation,
    /// The eBPF maps: rules, QoS, conntrack limits.
    Rules,
    /// Loading and attaching the zone's programs.
    Attach,
    /// haproxy: its configuration and process.
    Proxy,
    /// The agent's state directory (allocations, applied specs).
    StateDir,
    /// A step that did not say (or a kind this build does not know).
    #[default]
    #[serde(other)]
    Other,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 8] = [
        ErrorKind::Plumbing,
        ErrorKind::Ovs,
        ErrorKind::Allocation,
        ErrorKind::Rules,
        ErrorKind::Attach,
        ErrorKind::Proxy,
        ErrorKind::StateDir,
        ErrorKind::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Plumbing => "plumbing",
            ErrorKind::Ovs => "ovs",
            ErrorKind::Allocation => "allocation",
            ErrorKind::Rules => "rules",
            ErrorKind::Attach => "attach",
            ErrorKind::Proxy => "proxy",
            ErrorKind::StateDir => "state_dir",
            ErrorKind::Other => "other",
        }
    }

    /// The kind an error was given on its way up ([`WithKind::kind`]; the
    /// outermost when it was given more than one), else `Other`.
    pub fn of(e: &anyhow::Error) -> ErrorKind {
        e.downcast_ref::<ErrorKind>().copied().unwrap_or(ErrorKind::Other)
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Gives an error the kind of the step it arose in.
pub trait WithKind<T> {
    fn kind(self, kind: ErrorKind) -> anyhow::Result<T>;
}

impl<T, E: Into<anyhow::Error>> WithKind<T> for Result<T, E> {
    fn kind(self, kind: ErrorKind) -> anyhow::Result<T> {
        self.map_err(|e| {
            let e: anyhow::Error = e.into();
            // Kept as the message's first line: "plumbing: …".
            e.context(kind)
        })
    }
}

/// One object's failed step in an apply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectError {
    /// The object's key (`lb/<id>`, `natgw/<name>`), or `proxy`/`state-dir`.
    pub object: String,
    /// (`other` in a status document of an agent that did not say.)
    #[serde(default)]
    pub kind: ErrorKind,
    /// The error with its causes.
    pub error: String,
}

impl ObjectError {
    pub fn new(object: impl Into<String>, e: &anyhow::Error) -> Self {
        ObjectError { object: object.into(), kind: ErrorKind::of(e), error: format!("{e:#}") }
    }
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    use super::*;

    #[test]
    fn an_error_keeps_the_kind_it_arose_with_through_later_context() {
        let e = Err::<(), _>(anyhow::anyhow!("no such device")).kind(ErrorKind::Plumbing).context("lb/a").unwrap_err();
        assert_eq!(ErrorKind::of(&e), ErrorKind::Plumbing);
        assert_eq!(format!("{e:#}"), "lb/a: plumbing: no such device");
        assert_eq!(ErrorKind::of(&anyhow::anyhow!("bare")), ErrorKind::Other);
        let o = ObjectError::new("lb/a", &e);
        assert_eq!(serde_json::to_value(&o).unwrap()["kind"], "plumbing");
    }

    #[test]
    fn changes_of_an_object_are_prefixed_with_its_key() {
        let mut part = Changes::new();
        part.push("route 10.0.0.1/32".into());
        let mut all = Changes::new();
        all.append_of("lb/a", part);
        assert_eq!(&all[..], ["lb/a: route 10.0.0.1/32".to_string()]);
        assert_eq!(serde_json::to_string(&all).unwrap(), r#"["lb/a: route 10.0.0.1/32"]"#);
    }
}
