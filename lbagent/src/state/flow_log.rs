//! `agent.flow_logs`: checked once into [`FlowLogSpec`], the form the flow
//! logger (`crate::flow_log`) runs from.

use std::{collections::BTreeSet, net::SocketAddr, time::Duration};

use super::{Problem, model::FlowLogs};

/// What is logged and where it goes (the default logs nothing).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowLogSpec {
    pub start: bool,
    pub end: bool,
    /// Object keys (`lb/<id>`, `natgw/<name>`); empty: every object.
    pub objects: BTreeSet<String>,
    /// Rule kinds; empty: every kind.
    pub kinds: BTreeSet<RuleKind>,
    /// One new flow in `sample` is logged (1: every flow).
    pub sample: u32,
    pub ipfix: Vec<IpfixSpec>,
    pub jsonl: Option<JsonlSpec>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpfixSpec {
    pub collector: SocketAddr,
    pub template_refresh: Duration,
    pub observation_domain: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JsonlSpec {
    Stdout,
    /// `name`: a plain file name, in the agent's flow-log directory (the
    /// state file never names a path: it could name any file root may
    /// write).
    File {
        name: String,
        max_bytes: u64,
        keep: u32,
    },
}

/// The kind of rule a flow was made by, as its rule key names it
/// (`natgw/<gw>/<kind>/…`, `lb/<id>/<kind>/…`; a FIP's SNAT rule is `fip`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RuleKind {
    Snat,
    Dnat,
    Fip,
    Listener,
    Backend,
}

impl RuleKind {
    pub const ALL: [RuleKind; 5] =
        [RuleKind::Snat, RuleKind::Dnat, RuleKind::Fip, RuleKind::Listener, RuleKind::Backend];

    pub fn name(self) -> &'static str {
        match self {
            RuleKind::Snat => "snat",
            RuleKind::Dnat => "dnat",
            RuleKind::Fip => "fip",
            RuleKind::Listener => "listener",
            RuleKind::Backend => "backend",
        }
    }

    /// The kind of the rule `key` names.
    pub fn of_key(key: &str) -> Option<RuleKind> {
        match key.split('/').nth(2)? {
            "snat" => Some(RuleKind::Snat),
            "dnat" => Some(RuleKind::Dnat),
            "fip" | "fip-snat" => Some(RuleKind::Fip),
            "listener" => Some(RuleKind::Listener),
            "backend" => Some(RuleKind::Backend),
            _ => None,
        }
    }
}

pub const DEFAULT_TEMPLATE_REFRESH_S: u32 = 60;
pub const MAX_TEMPLATE_REFRESH_S: u32 = 86_400;
pub const DEFAULT_MAX_BYTES: u64 = 100 << 20;
pub const MIN_MAX_BYTES: u64 = 4096;
pub const DEFAULT_KEEP: u32 = 5;
pub const MAX_KEEP: u32 = 1000;
pub const MAX_SAMPLE: u32 = 1_000_000;
pub const MAX_COLLECTORS: usize = 8;
/// Longest JSON Lines file name (the rotation adds `.<n>` to it).
const MAX_FILE_NAME: usize = 200;

/// Checks `f` (at `agent.flow_logs`) against the document's `objects`.
pub fn check(f: &FlowLogs, objects: &BTreeSet<String>) -> (Option<FlowLogSpec>, Vec<Problem>) {
    let mut problems = Vec::new();
    let mut err = |path: String, message: String| problems.push(Problem { path, message });
    let p = "agent.flow_logs";
    let (start, end) = match f.events.as_deref() {
        None | Some("both") => (true, true),
        Some("start") => (true, false),
        Some("end") => (false, true),
        Some(other) => {
            err(format!("{p}.events"), format!("{other:?} is not start, end or both"));
            (true, true)
        }
    };
    let mut kinds = BTreeSet::new();
    for (i, k) in f.kinds.iter().enumerate() {
        match RuleKind::ALL.iter().find(|r| r.name() == k) {
            Some(r) => {
                kinds.insert(*r);
            }
            None => {
                err(format!("{p}.kinds[{i}]"), format!("{k:?} is not a rule kind (snat, dnat, fip, listener, backend)"))
            }
        }
    }
    for (i, o) in f.objects.iter().enumerate() {
        if !objects.contains(o) {
            err(
                format!("{p}.objects[{i}]"),
                format!("{o:?} names no load balancer (lb/<id>) or NAT gateway (natgw/<name>) of this document"),
            );
        }
    }
    let sample = f.sample.unwrap_or(1);
    if !(1..=MAX_SAMPLE).contains(&sample) {
        err(format!("{p}.sample"), format!("{sample} is out of range (1-{MAX_SAMPLE}: one flow in N)"));
    }
    if f.ipfix.len() > MAX_COLLECTORS {
        err(format!("{p}.ipfix"), format!("{} collectors (at most {MAX_COLLECTORS})", f.ipfix.len()));
    }
    let mut ipfix = Vec::new();
    for (i, c) in f.ipfix.iter().enumerate() {
        let collector = match c.address.parse::<SocketAddr>() {
            Ok(a) if a.port() == 0 => {
                err(format!("{p}.ipfix[{i}].address"), format!("{:?}: port 0", c.address));
                continue;
            }
            Ok(a) if a.ip().is_unspecified() || a.ip().is_multicast() || a.ip() == std::net::Ipv4Addr::BROADCAST => {
                err(format!("{p}.ipfix[{i}].address"), format!("{:?} is not a collector's address", c.address));
                continue;
            }
            Ok(a) => a,
            Err(_) => {
                err(
                    format!("{p}.ipfix[{i}].address"),
                    format!("{:?} is not address:port (203.0.113.5:4739, [2001:db8::5]:4739)", c.address),
                );
                continue;
            }
        };
        let refresh = c.template_refresh_s.unwrap_or(DEFAULT_TEMPLATE_REFRESH_S);
        if !(1..=MAX_TEMPLATE_REFRESH_S).contains(&refresh) {
            err(
                format!("{p}.ipfix[{i}].template_refresh_s"),
                format!("{refresh} is out of range (1-{MAX_TEMPLATE_REFRESH_S} seconds)"),
            );
        }
        ipfix.push(IpfixSpec {
            collector,
            template_refresh: Duration::from_secs(refresh.into()),
            observation_domain: c.observation_domain.unwrap_or(0),
        });
    }
    let jsonl = f.jsonl.as_ref().map(|j| {
        if j.file == "-" {
            return JsonlSpec::Stdout;
        }
        let bad = if j.file.is_empty() || j.file == "." || j.file == ".." {
            Some("is not a file name")
        } else if j.file.contains('/') {
            Some("is a path: give a file name (it is written in the agent's --flow-log-dir)")
        } else if j.file.contains('\0') || j.file.len() > MAX_FILE_NAME || j.file.chars().any(char::is_control) {
            Some("is not a usable file name")
        } else {
            None
        };
        if let Some(why) = bad {
            err(format!("{p}.jsonl.file"), format!("{:?} {why}", j.file));
        }
        let max_bytes = j.max_bytes.unwrap_or(DEFAULT_MAX_BYTES);
        if max_bytes < MIN_MAX_BYTES {
            err(format!("{p}.jsonl.max_bytes"), format!("{max_bytes} is below {MIN_MAX_BYTES} bytes"));
        }
        let keep = j.keep.unwrap_or(DEFAULT_KEEP);
        if !(1..=MAX_KEEP).contains(&keep) {
            err(format!("{p}.jsonl.keep"), format!("{keep} is out of range (1-{MAX_KEEP} files)"));
        }
        JsonlSpec::File { name: j.file.clone(), max_bytes, keep }
    });
    if ipfix.is_empty() && jsonl.is_none() && f.ipfix.is_empty() {
        err(p.to_string(), "no destination: set ipfix collectors, a jsonl file, or both".into());
    }
    let spec = FlowLogSpec { start, end, objects: f.objects.iter().cloned().collect(), kinds, sample, ipfix, jsonl };
    (Some(spec), problems)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::model::{IpfixCollector, JsonlSink};

    fn objects() -> BTreeSet<String> {
        ["natgw/gw1".to_string(), "lb/lb1".to_string()].into_iter().collect()
    }

    #[test]
    fn a_full_config_becomes_its_spec() {
        let f = FlowLogs {
            events: Some("end".into()),
            objects: vec!["natgw/gw1".into()],
            kinds: vec!["snat".into(), "fip".into()],
            sample: Some(10),
            ipfix: vec![IpfixCollector { address: "192.0.2.1:4739".into(), ..Default::default() }],
            jsonl: Some(JsonlSink { file: "flows.jsonl".into(), max_bytes: None, keep: Some(3) }),
        };
        let (spec, problems) = check(&f, &objects());
        assert!(problems.is_empty(), "{problems:?}");
        let spec = spec.unwrap();
        assert!(!spec.start && spec.end);
        assert_eq!(spec.kinds, [RuleKind::Snat, RuleKind::Fip].into_iter().collect());
        assert_eq!(spec.ipfix[0].template_refresh, Duration::from_secs(60));
        assert_eq!(
            spec.jsonl,
            Some(JsonlSpec::File { name: "flows.jsonl".into(), max_bytes: DEFAULT_MAX_BYTES, keep: 3 })
        );
    }

    #[test]
    fn every_bad_field_is_named() {
        let f = FlowLogs {
            events: Some("sometimes".into()),
            objects: vec!["natgw/nope".into()],
            kinds: vec!["qos".into()],
            sample: Some(0),
            ipfix: vec![
                IpfixCollector { address: "collector:4739".into(), ..Default::default() },
                IpfixCollector { address: "192.0.2.1:0".into(), ..Default::default() },
                IpfixCollector { address: "192.0.2.1:4739".into(), template_refresh_s: Some(0), ..Default::default() },
            ],
            jsonl: Some(JsonlSink { file: "../../etc/shadow".into(), max_bytes: Some(10), keep: Some(0) }),
        };
        let (_, problems) = check(&f, &objects());
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "agent.flow_logs.events",
                "agent.flow_logs.kinds[0]",
                "agent.flow_logs.objects[0]",
                "agent.flow_logs.sample",
                "agent.flow_logs.ipfix[0].address",
                "agent.flow_logs.ipfix[1].address",
                "agent.flow_logs.ipfix[2].template_refresh_s",
                "agent.flow_logs.jsonl.file",
                "agent.flow_logs.jsonl.max_bytes",
                "agent.flow_logs.jsonl.keep",
            ]
        );
        for (file, bad) in [("/etc/shadow", "is a path"), ("..", "not a file name"), ("a\nb", "not a usable")] {
            let f =
                FlowLogs { jsonl: Some(JsonlSink { file: file.into(), ..Default::default() }), ..Default::default() };
            let (_, problems) = check(&f, &objects());
            assert!(problems[0].message.contains(bad), "{file}: {problems:?}");
        }
        let (_, problems) = check(&FlowLogs::default(), &objects());
        assert!(problems[0].message.contains("no destination"), "{problems:?}");
    }
}
