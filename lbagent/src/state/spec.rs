//! The typed desired state: what validation turns the raw file model into,
//! and the only form reconcile, plumbing, rules, haproxy, health checks and
//! status see. Addresses are `Ipv4Addr`, MACs bytes, ports `u16`; every
//! listener carries its resolved backend group, effective mode and health
//! defaults; every gateway its EIP addresses resolved where rules name an
//! EIP and the QoS policies it uses inline. Nothing downstream parses a
//! string again or has a value to skip.
//!
//! The raw model (`model.rs`) stays the contract for field names and error
//! paths; `validate.rs` checks each object and builds its spec in one pass.
//! Specs are persisted as the applied state (`reconcile::applied`).

use std::{collections::BTreeMap, net::Ipv4Addr, sync::Arc};

use serde::{Deserialize, Serialize};

pub use super::model::{
    AgentConfig, ConntrackLimits, Direction, DnatMode, HealthCheckType, ListenerMode, ListenerTimeouts, ListenerType,
    Protocol, Scheduler,
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
/// they are torn down like removed ones). Each object's spec is shared, not
/// copied, with the applied record once it runs (`reconcile::Applied`): at
/// 100 000 rules one copy of the specs is ~10 MB.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Desired {
    pub agent: AgentConfig,
    pub lbs: BTreeMap<String, Arc<Lb>>,
    pub gws: BTreeMap<String, Arc<Gw>>,
    /// `agent.flow_logs`, checked; `None`: no flow logs.
    pub flow_log: Option<super::flow_log::FlowLogSpec>,
    /// `agent.ha`, checked; `None`: no pair.
    pub ha: Option<super::ha::HaSpec>,
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
