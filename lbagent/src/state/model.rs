//! The state file (docs/state-file.md): field names are the contract. Unknown fields
//! are errors. Values are kept as written (strings for addresses and CIDRs) so
//! validation can report every problem with its path instead of stopping at
//! the first parse failure. Validation turns it into `spec.rs`, the form
//! everything downstream uses.

use serde::{Deserialize, Serialize};

use super::decimal::{Decimal, integer, optional_integer};

/// A list written as an empty value (`listeners:` and nothing after it, or
/// `null`) is an empty list, as a missing one is.
fn null_is_empty<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    Option::<Vec<T>>::deserialize(d).map(Option::unwrap_or_default)
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateFile {
    #[serde(deserialize_with = "integer")]
    pub version: u32,
    #[serde(default)]
    pub agent: AgentConfig,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub load_balancers: Vec<LoadBalancer>,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub nat_gateways: Vec<NatGateway>,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub qos_policies: Vec<QosPolicy>,
    /// This document may remove more than the daemon's `--max-removal`
    /// share of the running objects at once (a drain, a deliberate
    /// cleanup); without it such a document is refused as likely torn.
    #[serde(default)]
    pub allow_mass_removal: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// OVS bridge for VPC ports.
    #[serde(default = "default_bridge")]
    pub integration_bridge: String,
    /// Conntrack idle timeouts (seconds); absent fields keep the defaults.
    #[serde(default)]
    pub conntrack: ConntrackTimeouts,
    /// Translated packets go straight to their egress interface from the
    /// program (default); `false` sends them through the namespace's IP
    /// stack, for debugging.
    #[serde(default = "yes")]
    pub fast_path: bool,
    /// Each object's share of the conntrack tables unless it sets its own
    /// (`conntrack_limits` on a load balancer or gateway); absent fields:
    /// half of `ct` for established flows, no limit on new ones.
    #[serde(default)]
    pub conntrack_limits: ConntrackLimits,
    /// Flow logs: a record when a flow starts and when it ends, exported
    /// as IPFIX and/or JSON Lines (docs/flow-logs.md). Absent: none.
    #[serde(default)]
    pub flow_logs: Option<FlowLogs>,
    /// This host is one of an active/standby pair (docs/ha.md). Absent: it
    /// runs alone, always active.
    #[serde(default)]
    pub ha: Option<HaPair>,
}

/// `agent.ha` as written (validated into `ha::HaSpec`).
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HaPair {
    /// `address:port` this host's sync link listens on (UDP).
    pub listen: String,
    /// `address:port` of the peer's sync link.
    pub peer: String,
    /// The shared secret that authenticates the sync link: 32 to 128 hex
    /// digits (16 to 64 bytes), the same on both hosts.
    pub secret: String,
    /// Seconds between the active's bulk passes over every flow (which
    /// repair what a lost datagram or a full ring left out); default 10.
    #[serde(default, deserialize_with = "optional_integer")]
    pub bulk_every_s: Option<u32>,
}

impl std::fmt::Debug for HaPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HaPair")
            .field("listen", &self.listen)
            .field("peer", &self.peer)
            .field("secret", &"<hidden>")
            .field("bulk_every_s", &self.bulk_every_s)
            .finish()
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            integration_bridge: default_bridge(),
            conntrack: ConntrackTimeouts::default(),
            fast_path: true,
            conntrack_limits: ConntrackLimits::default(),
            flow_logs: None,
            ha: None,
        }
    }
}

/// `agent.flow_logs` as written (validated into `spec::FlowLogSpec`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowLogs {
    /// `start`, `end` or `both` (the default).
    #[serde(default)]
    pub events: Option<String>,
    /// Objects whose flows are logged (`lb/<id>`, `natgw/<name>`); empty or
    /// absent: every object.
    #[serde(default, deserialize_with = "null_is_empty")]
    pub objects: Vec<String>,
    /// Rule kinds whose flows are logged (`snat`, `dnat`, `fip`,
    /// `listener`, `backend`); empty or absent: every kind.
    #[serde(default, deserialize_with = "null_is_empty")]
    pub kinds: Vec<String>,
    /// Log one new flow in `sample` of each object (drawn at random; its
    /// start and its end); absent or 1: every flow.
    #[serde(default, deserialize_with = "optional_integer")]
    pub sample: Option<u32>,
    /// IPFIX collectors (UDP).
    #[serde(default, deserialize_with = "null_is_empty")]
    pub ipfix: Vec<IpfixCollector>,
    /// A JSON Lines file (or `-`: standard output, for journald).
    #[serde(default)]
    pub jsonl: Option<JsonlSink>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IpfixCollector {
    /// `address:port` (`[v6]:port` for IPv6).
    pub address: String,
    /// Seconds between resends of the templates (RFC 7011 over UDP); default 60.
    #[serde(default, deserialize_with = "optional_integer")]
    pub template_refresh_s: Option<u32>,
    /// The observation domain id in every message; default 0.
    #[serde(default, deserialize_with = "optional_integer")]
    pub observation_domain: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonlSink {
    /// A file name in the agent's flow-log directory (`--flow-log-dir`),
    /// or `-` for standard output.
    pub file: String,
    /// Rotate when the file reaches this size (bytes); default 100 MiB.
    #[serde(default, deserialize_with = "optional_integer")]
    pub max_bytes: Option<u64>,
    /// Rotated files kept (`<file>.1` newest … `<file>.<keep>`); default 5.
    #[serde(default, deserialize_with = "optional_integer")]
    pub keep: Option<u32>,
}

/// `conntrack_limits`: the most flows one object (one zone) may hold in
/// each conntrack table. `established`: flows past their handshake (`ct`);
/// `new`: flows before it, and established ones beyond the `established`
/// limit (`ct_new`). 0: no limit. Absent: the host's
/// `agent.conntrack_limits`, then half of `ct` for `established` and no
/// limit for `new`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConntrackLimits {
    #[serde(default, deserialize_with = "optional_integer")]
    pub established: Option<u32>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub new: Option<u32>,
}

/// Largest per-object conntrack limit the state file may set (flows; 0 is
/// no limit).
pub const MAX_CONNTRACK_LIMIT: u32 = 16_777_216;

impl ConntrackLimits {
    /// Every field with its name, for validation.
    pub fn fields(&self) -> [(&'static str, Option<u32>); 2] {
        [("established", self.established), ("new", self.new)]
    }

    /// This object's limits over the host's (`host`), then `fallback`'s.
    pub fn resolve(
        &self,
        host: &ConntrackLimits,
        fallback: lbagent_common::ZoneCtLimits,
    ) -> lbagent_common::ZoneCtLimits {
        lbagent_common::ZoneCtLimits {
            established: self.established.or(host.established).unwrap_or(fallback.established),
            new: self.new.or(host.new).unwrap_or(fallback.new),
        }
    }
}

impl AgentConfig {
    /// The engine's `nat_config` value: timeouts and the fast-path switch.
    pub fn nat_config(&self) -> lbagent_common::NatConfig {
        let mut c = self.conntrack.nat_config();
        if self.fast_path {
            c.flags |= lbagent_common::NAT_CFG_FAST_PATH;
        }
        c
    }
}

/// `agent.conntrack`: idle timeouts in seconds (defaults in
/// `lbagent_common::DEFAULT_*`, documented in docs/state-file.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConntrackTimeouts {
    #[serde(default, deserialize_with = "optional_integer")]
    pub tcp_new_s: Option<u32>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub tcp_established_s: Option<u32>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub tcp_closing_s: Option<u32>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub udp_s: Option<u32>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub udp_stream_s: Option<u32>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub icmp_s: Option<u32>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub other_s: Option<u32>,
}

/// Longest idle timeout the state file may set (30 days).
pub const MAX_CONNTRACK_TIMEOUT_S: u32 = 2_592_000;

impl ConntrackTimeouts {
    /// Every field with its name, for validation and the engine config.
    pub fn fields(&self) -> [(&'static str, Option<u32>); 7] {
        [
            ("tcp_new_s", self.tcp_new_s),
            ("tcp_established_s", self.tcp_established_s),
            ("tcp_closing_s", self.tcp_closing_s),
            ("udp_s", self.udp_s),
            ("udp_stream_s", self.udp_stream_s),
            ("icmp_s", self.icmp_s),
            ("other_s", self.other_s),
        ]
    }

    /// The engine's `nat_config` value (0 = the program's default).
    pub fn nat_config(&self) -> lbagent_common::NatConfig {
        let v = |o: Option<u32>| o.unwrap_or(0);
        lbagent_common::NatConfig {
            tcp_new_s: v(self.tcp_new_s),
            tcp_established_s: v(self.tcp_established_s),
            tcp_closing_s: v(self.tcp_closing_s),
            udp_s: v(self.udp_s),
            udp_stream_s: v(self.udp_stream_s),
            icmp_s: v(self.icmp_s),
            other_s: v(self.other_s),
            flags: 0,
        }
    }
}

fn default_bridge() -> String {
    "brvpc".into()
}

fn yes() -> bool {
    true
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadBalancer {
    pub id: String,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default = "yes")]
    pub enabled: bool,
    pub network: LbNetwork,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub listeners: Vec<Listener>,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub backend_groups: Vec<BackendGroup>,
    /// This load balancer's share of the conntrack tables.
    #[serde(default)]
    pub conntrack_limits: Option<ConntrackLimits>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LbNetwork {
    pub ip: String,
    pub mac: String,
    #[serde(deserialize_with = "integer")]
    pub prefix_len: u8,
    pub gateway: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ListenerType {
    Http,
    Https,
    Tcp,
    Udp,
}

impl ListenerType {
    /// The L4 protocol the listener binds.
    pub fn protocol(self) -> Protocol {
        if self == ListenerType::Udp { Protocol::Udp } else { Protocol::Tcp }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ListenerMode {
    /// eBPF balances L4 itself.
    Direct,
    /// Through haproxy.
    Proxy,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheduler {
    Rr,
    Wrr,
    Wlc,
    Sch,
    Tch,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Listener {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: ListenerType,
    #[serde(deserialize_with = "integer")]
    pub port: u32,
    pub backend_group: String,
    #[serde(default)]
    pub mode: Option<ListenerMode>,
    #[serde(default)]
    pub scheduler: Option<Scheduler>,
    #[serde(default)]
    pub acl: Option<Acl>,
    #[serde(default)]
    pub health_check: Option<HealthCheck>,
    /// Proxy-mode timeouts (seconds); haproxy's defaults when absent.
    #[serde(default)]
    pub timeouts: Option<ListenerTimeouts>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTimeouts {
    #[serde(default, deserialize_with = "optional_integer")]
    pub connect: Option<u32>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub client: Option<u32>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub server: Option<u32>,
}

impl Listener {
    /// tcp/udp default to direct, http/https to proxy.
    pub fn effective_mode(&self) -> ListenerMode {
        self.mode.unwrap_or(match self.kind {
            ListenerType::Tcp | ListenerType::Udp => ListenerMode::Direct,
            _ => ListenerMode::Proxy,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AclAction {
    Allow,
    Deny,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Acl {
    pub action: AclAction,
    pub cidrs: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthCheckType {
    Tcp,
    Udp,
    Http,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheck {
    #[serde(rename = "type")]
    pub kind: HealthCheckType,
    /// Seconds between checks (default 5).
    #[serde(default, deserialize_with = "optional_integer")]
    pub interval: Option<u32>,
    /// Successes to mark up (default 2) / failures to mark down (default 3).
    #[serde(default, deserialize_with = "optional_integer")]
    pub rise: Option<u32>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub fall: Option<u32>,
    /// Seconds to wait for an answer (default 2).
    #[serde(default, deserialize_with = "optional_integer")]
    pub timeout: Option<u32>,
    /// HTTP checks: path and expected status.
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default, deserialize_with = "optional_integer")]
    pub expect_status: Option<u16>,
}

impl HealthCheck {
    /// What an absent field means (seconds where timed).
    pub const DEFAULT_INTERVAL_S: u32 = 5;
    pub const DEFAULT_RISE: u32 = 2;
    pub const DEFAULT_FALL: u32 = 3;
    pub const DEFAULT_TIMEOUT_S: u32 = 2;
    pub const DEFAULT_PATH: &'static str = "/";
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendGroup {
    pub id: String,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub backends: Vec<Backend>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Backend {
    pub id: String,
    pub address: String,
    #[serde(deserialize_with = "integer")]
    pub port: u32,
    #[serde(default = "one", deserialize_with = "integer")]
    pub weight: u32,
}

fn one() -> u32 {
    1
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatGateway {
    pub name: String,
    pub lan: GwLan,
    pub external: GwExternal,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub routes: Vec<Route>,
    #[serde(default)]
    pub qos_policy: Option<String>,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub eips: Vec<Eip>,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub fips: Vec<Fip>,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub dnats: Vec<Dnat>,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub snats: Vec<Snat>,
    /// This gateway's share of the conntrack tables.
    #[serde(default)]
    pub conntrack_limits: Option<ConntrackLimits>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GwLan {
    pub ip: String,
    #[serde(deserialize_with = "integer")]
    pub prefix_len: u8,
    pub mac: String,
    pub gateway: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GwExternal {
    pub bridge: String,
    #[serde(deserialize_with = "integer")]
    pub prefix_len: u8,
    pub gateway: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    pub cidr: String,
    pub via: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Eip {
    pub name: String,
    pub ip: String,
    #[serde(default)]
    pub qos_policy: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fip {
    pub eip: String,
    pub internal_ip: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DnatMode {
    #[default]
    Exclusive,
    Share,
}

pub use crate::proto::Protocol;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dnat {
    pub eip: String,
    pub protocol: Protocol,
    #[serde(deserialize_with = "integer")]
    pub external_port: u32,
    pub internal_ip: String,
    #[serde(deserialize_with = "integer")]
    pub internal_port: u32,
    #[serde(default)]
    pub mode: DnatMode,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snat {
    pub eip: String,
    pub internal_cidr: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QosBinding {
    Eip,
    Natgw,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QosPolicy {
    pub name: String,
    pub binding: QosBinding,
    #[serde(default)]
    pub shared: bool,
    #[serde(default, deserialize_with = "null_is_empty")]
    pub rules: Vec<QosRule>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Ingress,
    Egress,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QosRule {
    pub name: String,
    pub direction: Direction,
    /// Mbit/s, SI (× 10⁶ bit/s).
    pub rate_mbps: Decimal,
    /// MB, binary (× 2²⁰ bytes).
    pub burst_mb: Decimal,
    #[serde(deserialize_with = "integer")]
    pub priority: u32,
    /// `src <CIDR>` or `dst <CIDR>`; all traffic when absent.
    #[serde(rename = "match", default)]
    pub matches: Option<String>,
    #[serde(default)]
    pub interface: Option<String>,
}
