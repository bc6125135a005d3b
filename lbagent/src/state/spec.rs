//! The typed desired state: what validation turns the raw file model into,
//! and the only form reconcile, plumbing, rules, haproxy, health checks and
//! status see. Addresses are `Ipv4Addr`, MACs bytes, ports `u16`; every
//! listener carries its resolved backend group, effective mode and health
//! defaults; every gateway its EIP addresses resolved where rules name an
//! EIP and the QoS policies it uses inline. Nothing downstream parses a
//! string again or has a value to skip.
//!
//! The raw model (`model.rs`) stays the contract for field names and error
//! paths; conversion reports a problem with its path rather than panicking,
//! though validation has already refused anything it could trip on.
//! Specs are persisted as the applied state (`reconcile::applied`).

use std::{collections::BTreeMap, net::Ipv4Addr};

use serde::{Deserialize, Serialize};

use crate::naming;

pub use super::model::{
    AgentConfig, ConntrackLimits, Direction, DnatMode, HealthCheckType, ListenerMode, ListenerTimeouts, ListenerType,
    Protocol, Scheduler,
};
use super::{
    model::{self, StateFile},
    names::{parse_cidr, parse_ip, parse_mac},
    problem::{Problem, Problems},
};

/// `(network address, prefix length)`, host bits zero.
pub type Cidr = (Ipv4Addr, u8);

/// A MAC address.
pub type Mac = [u8; 6];

/// `02:00:0a:0a:00:05`.
pub fn mac_text(m: &Mac) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// `10.0.0.0/24`.
pub fn cidr_text((addr, len): &Cidr) -> String {
    format!("{addr}/{len}")
}

/// Everything the agent should run (disabled load balancers are absent:
/// they are torn down like removed ones).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Desired {
    pub agent: AgentConfig,
    pub lbs: BTreeMap<String, Lb>,
    pub gws: BTreeMap<String, Gw>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Lb {
    pub id: String,
    pub name: Option<String>,
    pub network: LbNetwork,
    pub listeners: Vec<Listener>,
    /// Every group, used by a listener or not (each backend gets a mapped
    /// port on the proxy side either way).
    pub groups: Vec<Group>,
    /// Its own share of the conntrack tables (absent fields: the host's).
    #[serde(default)]
    pub conntrack_limits: ConntrackLimits,
}

impl Lb {
    /// Every backend with its group.
    pub fn backends(&self) -> impl Iterator<Item = (&Group, &Backend)> {
        self.groups.iter().flat_map(|g| g.backends.iter().map(move |b| (g, b)))
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LbNetwork {
    pub ip: Ipv4Addr,
    pub mac: Mac,
    pub prefix_len: u8,
    pub gateway: Ipv4Addr,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Group {
    pub id: String,
    pub backends: Vec<Backend>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Backend {
    pub id: String,
    pub addr: Ipv4Addr,
    pub port: u16,
    pub weight: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Listener {
    pub id: String,
    pub kind: ListenerType,
    pub port: u16,
    /// The effective mode (tcp/udp default to direct, http/https to proxy).
    pub mode: ListenerMode,
    pub scheduler: Option<Scheduler>,
    pub acl: Option<Acl>,
    pub health: Option<HealthCheck>,
    pub timeouts: ListenerTimeouts,
    /// The listener's backend group, resolved.
    pub group: Group,
}

impl Listener {
    /// The L4 protocol the listener binds.
    pub fn protocol(&self) -> Protocol {
        self.kind.protocol()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Acl {
    /// `allow`: only `cidrs` may connect; otherwise `cidrs` may not.
    pub allow: bool,
    pub cidrs: Vec<Cidr>,
}

/// A health check with every default applied.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HealthCheck {
    pub kind: HealthCheckType,
    pub interval_s: u32,
    pub rise: u32,
    pub fall: u32,
    pub timeout_s: u32,
    /// HTTP checks: the path (default `/`) and the expected status.
    pub path: String,
    pub expect_status: Option<u16>,
}

impl HealthCheck {
    pub const DEFAULT_INTERVAL_S: u32 = super::model::HealthCheck::DEFAULT_INTERVAL_S;
    pub const DEFAULT_RISE: u32 = super::model::HealthCheck::DEFAULT_RISE;
    pub const DEFAULT_FALL: u32 = super::model::HealthCheck::DEFAULT_FALL;
    pub const DEFAULT_TIMEOUT_S: u32 = super::model::HealthCheck::DEFAULT_TIMEOUT_S;
    pub const DEFAULT_PATH: &'static str = super::model::HealthCheck::DEFAULT_PATH;

    fn of(h: &model::HealthCheck) -> Self {
        HealthCheck {
            kind: h.kind,
            interval_s: h.interval.unwrap_or(Self::DEFAULT_INTERVAL_S),
            rise: h.rise.unwrap_or(Self::DEFAULT_RISE),
            fall: h.fall.unwrap_or(Self::DEFAULT_FALL),
            timeout_s: h.timeout.unwrap_or(Self::DEFAULT_TIMEOUT_S),
            path: h.path.clone().unwrap_or_else(|| Self::DEFAULT_PATH.into()),
            expect_status: h.expect_status,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gw {
    pub name: String,
    pub lan: GwLan,
    pub external: GwExternal,
    pub routes: Vec<Route>,
    /// The gateway's own policy (limits the gateway), resolved.
    pub policy: Option<QosPolicy>,
    pub eips: Vec<Eip>,
    pub fips: Vec<Fip>,
    pub dnats: Vec<Dnat>,
    pub snats: Vec<Snat>,
    /// Its own share of the conntrack tables (absent fields: the host's).
    #[serde(default)]
    pub conntrack_limits: ConntrackLimits,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GwLan {
    pub ip: Ipv4Addr,
    pub prefix_len: u8,
    pub mac: Mac,
    pub gateway: Ipv4Addr,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GwExternal {
    /// An OVS or Linux bridge on the host (a validated interface name).
    pub bridge: String,
    pub prefix_len: u8,
    pub gateway: Ipv4Addr,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Route {
    pub cidr: Cidr,
    pub via: Ipv4Addr,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Eip {
    pub name: String,
    pub ip: Ipv4Addr,
    /// The EIP's policy (limits that EIP), resolved.
    pub policy: Option<QosPolicy>,
}

/// An EIP as a rule names it: its name and its address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EipRef {
    pub name: String,
    pub ip: Ipv4Addr,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fip {
    pub eip: EipRef,
    pub internal_ip: Ipv4Addr,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dnat {
    pub eip: EipRef,
    pub protocol: Protocol,
    pub external_port: u16,
    pub internal_ip: Ipv4Addr,
    pub internal_port: u16,
    pub mode: DnatMode,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snat {
    pub eip: EipRef,
    pub internal_cidr: Cidr,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QosPolicy {
    pub name: String,
    pub rules: Vec<QosRule>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QosRule {
    pub name: String,
    pub direction: Direction,
    pub rate_bps: u64,
    pub burst_bytes: u64,
    pub priority: u32,
    pub matches: QosMatch,
    /// Where a gateway rule acts (EIP rules always act on the external side).
    pub side: GwSide,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QosMatch {
    All,
    Src(Cidr),
    Dst(Cidr),
}

/// A gateway's two interfaces: toward the VPC and toward the external network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GwSide {
    Lan,
    External,
}

// ---- conversion ----

fn field(path: &str, name: &str, r: Result<Ipv4Addr, String>) -> Result<Ipv4Addr, Problem> {
    r.map_err(|message| Problem { path: format!("{path}.{name}"), message })
}

fn ip(path: &str, name: &str, s: &str) -> Result<Ipv4Addr, Problem> {
    field(path, name, parse_ip(s))
}

fn cidr(path: String, s: &str) -> Result<Cidr, Problem> {
    parse_cidr(s).map_err(|message| Problem { path, message })
}

fn mac(path: &str, name: &str, s: &str) -> Result<Mac, Problem> {
    parse_mac(s).map_err(|message| Problem { path: format!("{path}.{name}"), message })
}

fn port(path: &str, name: &str, v: u32) -> Result<u16, Problem> {
    u16::try_from(v)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| Problem { path: format!("{path}.{name}"), message: format!("{v} is not a port (1-65535)") })
}

impl Desired {
    /// Validates a raw document and converts it: every problem with its
    /// path, or the typed desired state.
    pub fn from_state(s: &StateFile) -> Result<Desired, Problems> {
        let problems = super::validate::validate(s);
        if !problems.is_empty() {
            return Err(Problems(problems));
        }
        Self::convert(s).map_err(|p| Problems(vec![p]))
    }

    /// Converts a document `validate` accepted.
    pub(super) fn convert(s: &StateFile) -> Result<Desired, Problem> {
        let mut lbs = BTreeMap::new();
        for (i, l) in s.load_balancers.iter().enumerate().filter(|(_, l)| l.enabled) {
            lbs.insert(l.id.clone(), Lb::from_model(&format!("load_balancers[{i}]"), l)?);
        }
        let policies: BTreeMap<&str, (usize, &model::QosPolicy)> =
            s.qos_policies.iter().enumerate().map(|(i, p)| (p.name.as_str(), (i, p))).collect();
        let resolve = |path: String, name: &Option<String>| -> Result<Option<QosPolicy>, Problem> {
            let Some(name) = name else { return Ok(None) };
            let (i, p) = policies
                .get(name.as_str())
                .ok_or_else(|| Problem { path, message: format!("no QoS policy {name:?}") })?;
            QosPolicy::from_model(&format!("qos_policies[{i}]"), p).map(Some)
        };
        let mut gws = BTreeMap::new();
        for (i, g) in s.nat_gateways.iter().enumerate() {
            gws.insert(g.name.clone(), Gw::from_model(&format!("nat_gateways[{i}]"), g, &resolve)?);
        }
        Ok(Desired { agent: s.agent.clone(), lbs, gws })
    }
}

impl Lb {
    /// `path`: where the load balancer sits in its document (for problems).
    pub fn from_model(path: &str, lb: &model::LoadBalancer) -> Result<Lb, Problem> {
        let n = &lb.network;
        let np = format!("{path}.network");
        let network = LbNetwork {
            ip: ip(&np, "ip", &n.ip)?,
            mac: mac(&np, "mac", &n.mac)?,
            prefix_len: n.prefix_len,
            gateway: ip(&np, "gateway", &n.gateway)?,
        };
        let mut groups = Vec::new();
        for (j, g) in lb.backend_groups.iter().enumerate() {
            let gp = format!("{path}.backend_groups[{j}]");
            let mut backends = Vec::new();
            for (k, b) in g.backends.iter().enumerate() {
                let bp = format!("{gp}.backends[{k}]");
                backends.push(Backend {
                    id: b.id.clone(),
                    addr: ip(&bp, "address", &b.address)?,
                    port: port(&bp, "port", b.port)?,
                    weight: b.weight,
                });
            }
            groups.push(Group { id: g.id.clone(), backends });
        }
        let mut listeners = Vec::new();
        for (j, l) in lb.listeners.iter().enumerate() {
            let lp = format!("{path}.listeners[{j}]");
            let group = groups.iter().find(|g| g.id == l.backend_group).cloned().ok_or_else(|| Problem {
                path: format!("{lp}.backend_group"),
                message: format!("no backend group {:?} in this load balancer", l.backend_group),
            })?;
            let acl = match &l.acl {
                None => None,
                Some(a) => Some(Acl {
                    allow: a.action == model::AclAction::Allow,
                    cidrs: a
                        .cidrs
                        .iter()
                        .enumerate()
                        .map(|(k, c)| cidr(format!("{lp}.acl.cidrs[{k}]"), c))
                        .collect::<Result<_, _>>()?,
                }),
            };
            listeners.push(Listener {
                id: l.id.clone(),
                kind: l.kind,
                port: port(&lp, "port", l.port)?,
                mode: l.effective_mode(),
                scheduler: l.scheduler,
                acl,
                health: l.health_check.as_ref().map(HealthCheck::of),
                timeouts: l.timeouts.clone().unwrap_or_default(),
                group,
            });
        }
        Ok(Lb {
            id: lb.id.clone(),
            name: lb.name.clone(),
            network,
            listeners,
            groups,
            conntrack_limits: lb.conntrack_limits.unwrap_or_default(),
        })
    }
}

/// Resolves the QoS policy a gateway or an EIP names (`path`: of the name).
pub type PolicyResolver<'a> = dyn Fn(String, &Option<String>) -> Result<Option<QosPolicy>, Problem> + 'a;

impl Gw {
    pub fn from_model(path: &str, g: &model::NatGateway, policy: &PolicyResolver) -> Result<Gw, Problem> {
        let lp = format!("{path}.lan");
        let lan = GwLan {
            ip: ip(&lp, "ip", &g.lan.ip)?,
            prefix_len: g.lan.prefix_len,
            mac: mac(&lp, "mac", &g.lan.mac)?,
            gateway: ip(&lp, "gateway", &g.lan.gateway)?,
        };
        let external = GwExternal {
            bridge: g.external.bridge.clone(),
            prefix_len: g.external.prefix_len,
            gateway: ip(&format!("{path}.external"), "gateway", &g.external.gateway)?,
        };
        let mut routes = Vec::new();
        for (j, r) in g.routes.iter().enumerate() {
            let rp = format!("{path}.routes[{j}]");
            routes.push(Route { cidr: cidr(format!("{rp}.cidr"), &r.cidr)?, via: ip(&rp, "via", &r.via)? });
        }
        let mut eips = Vec::new();
        for (j, e) in g.eips.iter().enumerate() {
            let ep = format!("{path}.eips[{j}]");
            eips.push(Eip {
                name: e.name.clone(),
                ip: ip(&ep, "ip", &e.ip)?,
                policy: policy(format!("{ep}.qos_policy"), &e.qos_policy)?,
            });
        }
        let eip = |p: String, name: &str| -> Result<EipRef, Problem> {
            eips.iter()
                .find(|e| e.name == name)
                .map(|e| EipRef { name: e.name.clone(), ip: e.ip })
                .ok_or_else(|| Problem { path: p, message: format!("no EIP {name:?} on this gateway") })
        };
        let mut fips = Vec::new();
        for (j, f) in g.fips.iter().enumerate() {
            let fp = format!("{path}.fips[{j}]");
            fips.push(Fip {
                eip: eip(format!("{fp}.eip"), &f.eip)?,
                internal_ip: ip(&fp, "internal_ip", &f.internal_ip)?,
            });
        }
        let mut dnats = Vec::new();
        for (j, d) in g.dnats.iter().enumerate() {
            let dp = format!("{path}.dnats[{j}]");
            dnats.push(Dnat {
                eip: eip(format!("{dp}.eip"), &d.eip)?,
                protocol: d.protocol,
                external_port: port(&dp, "external_port", d.external_port)?,
                internal_ip: ip(&dp, "internal_ip", &d.internal_ip)?,
                internal_port: port(&dp, "internal_port", d.internal_port)?,
                mode: d.mode,
            });
        }
        let mut snats = Vec::new();
        for (j, s) in g.snats.iter().enumerate() {
            let sp = format!("{path}.snats[{j}]");
            snats.push(Snat {
                eip: eip(format!("{sp}.eip"), &s.eip)?,
                internal_cidr: cidr(format!("{sp}.internal_cidr"), &s.internal_cidr)?,
            });
        }
        Ok(Gw {
            name: g.name.clone(),
            lan,
            external,
            routes,
            policy: policy(format!("{path}.qos_policy"), &g.qos_policy)?,
            eips,
            fips,
            dnats,
            snats,
            conntrack_limits: g.conntrack_limits.unwrap_or_default(),
        })
    }
}

impl QosPolicy {
    pub fn from_model(path: &str, p: &model::QosPolicy) -> Result<QosPolicy, Problem> {
        let mut rules = Vec::new();
        for (j, r) in p.rules.iter().enumerate() {
            let rp = format!("{path}.rules[{j}]");
            let matches = match r.matches.as_deref().map(|m| m.split_once(' ')) {
                None => QosMatch::All,
                Some(Some(("src", c))) => QosMatch::Src(cidr(format!("{rp}.match"), c)?),
                Some(Some(("dst", c))) => QosMatch::Dst(cidr(format!("{rp}.match"), c)?),
                Some(_) => {
                    return Err(Problem {
                        path: format!("{rp}.match"),
                        message: "expected \"src <CIDR>\" or \"dst <CIDR>\"".into(),
                    });
                }
            };
            let side = match (r.interface.as_deref(), r.direction) {
                (Some(naming::GW_LAN_IF), _) | (None, Direction::Ingress) => GwSide::Lan,
                (Some(naming::GW_EXT_IF), _) | (None, Direction::Egress) => GwSide::External,
                (Some(i), _) => {
                    return Err(Problem {
                        path: format!("{rp}.interface"),
                        message: format!(
                            "{i:?}: a gateway's interfaces are {} and {}",
                            naming::GW_LAN_IF,
                            naming::GW_EXT_IF
                        ),
                    });
                }
            };
            rules.push(QosRule {
                name: r.name.clone(),
                direction: r.direction,
                rate_bps: r.rate_mbps.micros(),
                burst_bytes: r.burst_mb.mb_to_bytes(),
                priority: r.priority,
                matches,
                side,
            });
        }
        Ok(QosPolicy { name: p.name.clone(), rules })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Format, load::parse};

    fn example() -> StateFile {
        parse(include_str!("../../../examples/state.yaml"), Format::Yaml).unwrap()
    }

    #[test]
    fn the_example_converts_with_defaults_and_groups_resolved() {
        let d = Desired::from_state(&example()).unwrap();
        let lb = d.lbs.values().next().unwrap();
        assert_eq!(lb.network.ip, Ipv4Addr::new(10, 10, 0, 5));
        for l in &lb.listeners {
            assert!(lb.groups.contains(&l.group), "listener {} has its group", l.id);
            if let Some(h) = &l.health {
                assert!(h.interval_s > 0 && h.rise > 0 && h.fall > 0 && h.timeout_s > 0 && h.path.starts_with('/'));
            }
        }
        let gw = &d.gws["gw1"];
        assert!(gw.dnats.iter().all(|x| gw.eips.iter().any(|e| e.ip == x.eip.ip && e.name == x.eip.name)));
    }

    #[test]
    fn an_invalid_document_converts_to_its_problems_not_a_partial_spec() {
        let mut s = example();
        s.load_balancers[0].listeners[0].port = 70_000;
        s.nat_gateways[0].dnats[0].eip = "nope".into();
        let err = Desired::from_state(&s).unwrap_err();
        let paths: Vec<&str> = err.0.iter().map(|p| p.path.as_str()).collect();
        assert!(paths.contains(&"load_balancers[0].listeners[0].port"), "{paths:?}");
        assert!(paths.contains(&"nat_gateways[0].dnats[0].eip"), "{paths:?}");
    }

    #[test]
    fn conversion_itself_refuses_what_it_cannot_type() {
        // Validation runs first; conversion still never truncates or skips.
        let mut s = example();
        s.load_balancers[0].backend_groups[0].backends[0].port = 65_536;
        let e = Lb::from_model("load_balancers[0]", &s.load_balancers[0]).unwrap_err();
        assert_eq!(e.path, "load_balancers[0].backend_groups[0].backends[0].port");
        s.nat_gateways[0].routes.push(model::Route { cidr: "10.0.0.1/8".into(), via: "10.10.0.1".into() });
        let e = Gw::from_model("g", &s.nat_gateways[0], &|_, _| Ok(None)).unwrap_err();
        assert!(e.path.starts_with("g.routes["), "{e}");
    }
}
