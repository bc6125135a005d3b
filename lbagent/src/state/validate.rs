//! Validation by conversion: each object of a document is checked and
//! turned into its typed spec (`spec.rs`) in one pass. Every problem is
//! recorded with its path and the pass goes on, so one run reports them
//! all. An object's function returns its spec when the object *converts*
//! (every value parses, every name it uses resolves), whatever rule it
//! breaks; a document with any problem yields no `Desired` ([`desired`]),
//! and [`check`] hands out what converted beside the problems (the legacy
//! applied file). A new state field touches the model and the one function
//! here that checks and converts its object.
//!
//! Enforces the reference systems' rules (docs/state-file.md) on top of
//! what parsing already checked.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::Ipv4Addr,
};

use super::{
    limits,
    model::{self, *},
    names::{
        check_free_text, check_host_class, check_host_in, check_id, check_ifname, check_net_class, in_subnet, mask,
        overlaps, parse_cidr, parse_ip, parse_mac,
    },
    problem::{Problem, Problems},
    spec::{self, Cidr, Desired, EipRef, GwSide, QosMatch},
};
use crate::naming;

/// Highest QoS rate (100 Gbit/s).
pub const MAX_RATE_MBPS: u64 = 100_000;

/// Longest HTTP health-check path.
pub const HEALTH_PATH_MAX: usize = 256;

/// Minimum load balancer id length (names use its first 13 characters).
pub const LB_ID_MIN: usize = 13;

/// The problem accumulator: every check records here and goes on.
#[derive(Default)]
struct Check {
    problems: Vec<Problem>,
}

impl Check {
    fn err(&mut self, path: impl Into<String>, msg: impl Into<String>) {
        self.problems.push(Problem { path: path.into(), message: msg.into() });
    }

    fn ok<T>(&mut self, path: &str, r: Result<T, String>) -> Option<T> {
        r.map_err(|e| self.err(path, e)).ok()
    }

    fn port(&mut self, path: &str, port: u32) -> Option<u16> {
        let p = u16::try_from(port).ok().filter(|p| *p != 0);
        if p.is_none() {
            self.err(path, format!("{port} is not a port (1-65535)"));
        }
        p
    }

    fn prefix(&mut self, path: &str, len: u8) {
        if !(1..=32).contains(&len) {
            self.err(path, format!("{len} is not a prefix length (1-32)"));
        }
    }

    /// Records `key` for uniqueness; reports a duplicate.
    fn unique<K: std::hash::Hash + Eq>(
        &mut self,
        seen: &mut HashSet<K>,
        key: K,
        path: &str,
        what: impl FnOnce() -> String,
    ) {
        if !seen.insert(key) {
            self.err(path, format!("duplicate {}", what()));
        }
    }
}

impl Desired {
    /// Validates a raw document and converts it: every problem with its
    /// path, or the typed desired state ([`desired`]).
    pub fn from_state(s: &StateFile) -> Result<Desired, Problems> {
        desired(s)
    }
}

/// Checks a document and converts it: the typed desired state, or every
/// problem with its path (in document order). Disabled load balancers are
/// checked but absent from the result (they are torn down like removed
/// ones).
pub fn desired(s: &StateFile) -> Result<Desired, Problems> {
    desired_after(s, None)
}

/// [`desired`], where each object equal to its spec in `earlier` (the
/// source's last accepted document) shares that spec: a new spec lives
/// only while it is compared, so a document that changes one object of
/// thousands costs the memory of that object, not of a second copy of
/// every spec (13 MB at 100 000 rules).
pub fn desired_after(s: &StateFile, earlier: Option<&Desired>) -> Result<Desired, Problems> {
    let (desired, problems) = check_after(s, earlier);
    if problems.is_empty() { Ok(desired) } else { Err(Problems(problems)) }
}

/// Checks and converts a document: every object that converts, and every
/// problem with its path. Only a document without problems is to be run
/// ([`desired`]).
pub fn check(s: &StateFile) -> (Desired, Vec<Problem>) {
    check_after(s, None)
}

/// `spec`, or the equal spec of `earlier` (shared).
fn same_or_new<T: PartialEq>(earlier: Option<&std::sync::Arc<T>>, spec: T) -> std::sync::Arc<T> {
    match earlier {
        Some(e) if **e == spec => e.clone(),
        _ => std::sync::Arc::new(spec),
    }
}

/// [`check`], sharing the specs of `earlier` that did not change
/// ([`desired_after`]).
pub fn check_after(s: &StateFile, earlier: Option<&Desired>) -> (Desired, Vec<Problem>) {
    let mut c = Check::default();
    if s.version != 1 {
        c.err("version", format!("unsupported version {} (this agent reads version 1)", s.version));
    }
    c.ok("agent.integration_bridge", check_ifname(&s.agent.integration_bridge));
    for (name, v) in s.agent.conntrack.fields() {
        if let Some(v) = v
            && !(1..=MAX_CONNTRACK_TIMEOUT_S).contains(&v)
        {
            c.err(
                format!("agent.conntrack.{name}"),
                format!("{v} is out of range (1-{MAX_CONNTRACK_TIMEOUT_S} seconds)"),
            );
        }
    }
    conntrack_limits(&mut c, "agent.conntrack_limits", Some(&s.agent.conntrack_limits));
    for (i, lb) in s.load_balancers.iter().enumerate() {
        conntrack_limits(&mut c, &format!("load_balancers[{i}].conntrack_limits"), lb.conntrack_limits.as_ref());
    }
    for (i, gw) in s.nat_gateways.iter().enumerate() {
        conntrack_limits(&mut c, &format!("nat_gateways[{i}].conntrack_limits"), gw.conntrack_limits.as_ref());
    }
    let mut lbs = BTreeMap::new();
    let mut lb_ids = HashSet::new();
    for (i, lb) in s.load_balancers.iter().enumerate() {
        let p = format!("load_balancers[{i}]");
        c.unique(&mut lb_ids, lb.id.clone(), &format!("{p}.id"), || format!("load balancer id {:?}", lb.id));
        if let Some(spec) = load_balancer(&mut c, &p, lb)
            && lb.enabled
        {
            lbs.insert(lb.id.clone(), same_or_new(earlier.and_then(|e| e.lbs.get(&lb.id)), spec));
        }
    }
    derived_names(&mut c, s);
    // Every EIP address of every gateway: one EIP lives on one gateway, and
    // no FIP/DNAT target may be an EIP.
    let mut all_eips: HashMap<Ipv4Addr, String> = HashMap::new();
    for (i, gw) in s.nat_gateways.iter().enumerate() {
        for (j, e) in gw.eips.iter().enumerate() {
            let Ok(ip) = parse_ip(&e.ip) else { continue };
            let path = format!("nat_gateways[{i}].eips[{j}].ip");
            if let Some(first) = all_eips.get(&ip) {
                if !first.starts_with(&format!("nat_gateways[{i}].")) {
                    c.err(path, format!("EIP {ip} is already on another gateway ({first})"));
                }
            } else {
                all_eips.insert(ip, path);
            }
        }
    }
    let policies = qos_policies(&mut c, &s.qos_policies);
    let mut gws = BTreeMap::new();
    let mut gw_names = HashSet::new();
    let mut unshared_uses: HashMap<&str, usize> = HashMap::new();
    for (i, gw) in s.nat_gateways.iter().enumerate() {
        let p = format!("nat_gateways[{i}]");
        c.unique(&mut gw_names, gw.name.clone(), &format!("{p}.name"), || format!("NAT gateway name {:?}", gw.name));
        let around =
            GwAround { integration_bridge: &s.agent.integration_bridge, policies: &policies, all_eips: &all_eips };
        if let Some(spec) = nat_gateway(&mut c, &p, gw, &around, &mut unshared_uses) {
            gws.insert(gw.name.clone(), same_or_new(earlier.and_then(|e| e.gws.get(&gw.name)), spec));
        }
    }
    for (name, n) in unshared_uses {
        if n > 1 {
            let i = s.qos_policies.iter().position(|q| q.name == name).unwrap_or(0);
            c.err(format!("qos_policies[{i}].shared"), format!("policy {name:?} is not shared but bound to {n} EIPs"));
        }
    }
    let flow_log = s.agent.flow_logs.as_ref().and_then(|f| {
        let objects = s.load_balancers.iter().map(|l| crate::naming::lb_zone_key(&l.id));
        let objects = objects.chain(s.nat_gateways.iter().map(|g| crate::naming::gw_zone_key(&g.name))).collect();
        let (spec, problems) = super::flow_log::check(f, &objects);
        c.problems.extend(problems);
        spec
    });
    let ha = s.agent.ha.as_ref().and_then(|h| {
        let (spec, problems) = super::ha::check(h);
        c.problems.extend(problems);
        if !s.load_balancers.is_empty() {
            // The standby would announce their VIPs too: refused, not
            // half-paired.
            c.err(
                "agent.ha",
                format!(
                    "{} load balancers: HA pairs carry NAT gateways only (a load balancer's VIP is not held back on the standby)",
                    s.load_balancers.len()
                ),
            );
        }
        spec
    });
    c.problems.extend(limits::object_limits(s));
    c.problems.extend(limits::host_budget(s));
    (Desired { agent: s.agent.clone(), lbs, gws, flow_log, ha }, c.problems)
}

/// A `conntrack_limits` section at `path`: each limit in flows, 0 for none.
fn conntrack_limits(c: &mut Check, path: &str, limits: Option<&ConntrackLimits>) {
    for (name, v) in limits.map(|l| l.fields()).into_iter().flatten() {
        if let Some(v) = v
            && v > MAX_CONNTRACK_LIMIT
        {
            c.err(format!("{path}.{name}"), format!("{v} is out of range (0-{MAX_CONNTRACK_LIMIT} flows; 0: none)"));
        }
    }
}

/// Two objects whose kernel, OVS or haproxy names would be equal: the
/// second would take over (or tear down) the first one's links.
fn derived_names(c: &mut Check, s: &StateFile) {
    let mut links: HashMap<String, usize> = HashMap::new();
    let mut proxies: HashMap<String, usize> = HashMap::new();
    for (i, lb) in s.load_balancers.iter().enumerate() {
        let (o0, _) = naming::lb_ovn_veth(&lb.id);
        match links.get(&o0) {
            Some(&j) if s.load_balancers[j].id != lb.id => c.err(
                format!("load_balancers[{i}].id"),
                format!(
                    "links {o0}/h…0 of {:?} would be those of load_balancers[{j}] {:?} (link names use the id's \
                     first 13 characters; make them differ)",
                    lb.id, s.load_balancers[j].id
                ),
            ),
            _ => {
                links.insert(o0, i);
            }
        }
        let tag = naming::haproxy_proxy(&lb.id, "");
        match proxies.get(&tag) {
            Some(&j) if s.load_balancers[j].id != lb.id => c.err(
                format!("load_balancers[{i}].id"),
                format!(
                    "haproxy names {tag}… of {:?} would be those of load_balancers[{j}] {:?} (32-bit hash \
                     collision; change one id)",
                    lb.id, s.load_balancers[j].id
                ),
            ),
            _ => {
                proxies.insert(tag, i);
            }
        }
    }
    let mut gw_links: HashMap<String, usize> = HashMap::new();
    for (i, gw) in s.nat_gateways.iter().enumerate() {
        let (lan, _) = naming::gw_host_veths(&gw.name);
        match gw_links.get(&lan) {
            Some(&j) if s.nat_gateways[j].name != gw.name => c.err(
                format!("nat_gateways[{i}].name"),
                format!(
                    "host links {lan}/…x of {:?} would be those of nat_gateways[{j}] {:?} (32-bit hash \
                     collision; change one name)",
                    gw.name, s.nat_gateways[j].name
                ),
            ),
            _ => {
                gw_links.insert(lan, i);
            }
        }
    }
}

/// A load balancer, checked and converted (`None` when it does not
/// convert).
fn load_balancer(c: &mut Check, p: &str, lb: &LoadBalancer) -> Option<spec::Lb> {
    c.ok(&format!("{p}.id"), check_id(&lb.id, LB_ID_MIN, 64));
    let n = &lb.network;
    if let Some(name) = &lb.name {
        c.ok(&format!("{p}.name"), check_free_text(name, 64));
    }
    let ip = c.ok(&format!("{p}.network.ip"), parse_ip(&n.ip));
    let mac = c.ok(&format!("{p}.network.mac"), parse_mac(&n.mac));
    c.prefix(&format!("{p}.network.prefix_len"), n.prefix_len);
    let gw = c.ok(&format!("{p}.network.gateway"), parse_ip(&n.gateway));
    if let Some(ip) = ip {
        c.ok(&format!("{p}.network.ip"), check_host_in(ip, ip, n.prefix_len));
    }
    if let (Some(ip), Some(gw)) = (ip, gw) {
        if !in_subnet(gw, ip, n.prefix_len) {
            c.err(format!("{p}.network.gateway"), format!("{gw} is not in {ip}/{}", n.prefix_len));
        } else {
            c.ok(&format!("{p}.network.gateway"), check_host_in(gw, ip, n.prefix_len));
        }
        if ip == gw {
            c.err(format!("{p}.network.gateway"), "the gateway is the load balancer's own address");
        }
    }
    let mut group_ids = HashSet::new();
    let mut backend_ids = HashSet::new();
    let mut groups = Vec::new();
    for (j, g) in lb.backend_groups.iter().enumerate() {
        let gp = format!("{p}.backend_groups[{j}]");
        c.unique(&mut group_ids, g.id.clone(), &format!("{gp}.id"), || format!("backend group id {:?}", g.id));
        c.ok(&format!("{gp}.id"), check_id(&g.id, 1, 64));
        let mut backends = Vec::new();
        for (k, b) in g.backends.iter().enumerate() {
            let bp = format!("{gp}.backends[{k}]");
            c.ok(&format!("{bp}.id"), check_id(&b.id, 1, 64));
            c.unique(&mut backend_ids, b.id.clone(), &format!("{bp}.id"), || {
                format!("backend id {:?} in this load balancer", b.id)
            });
            let addr = c.ok(&format!("{bp}.address"), parse_ip(&b.address));
            if let Some(a) = addr {
                c.ok(&format!("{bp}.address"), check_host_class(a));
                if Some(a) == ip {
                    c.err(format!("{bp}.address"), format!("{a} is the load balancer's own VIP"));
                }
            }
            let port = c.port(&format!("{bp}.port"), b.port);
            if b.weight > 256 {
                c.err(format!("{bp}.weight"), format!("{} is above the maximum weight 256", b.weight));
            }
            if let (Some(addr), Some(port)) = (addr, port) {
                backends.push(spec::Backend { id: b.id.clone(), addr, port, weight: b.weight });
            }
        }
        groups.push(spec::Group { id: g.id.clone(), backends });
    }
    let mut ids = HashSet::new();
    let mut ports = HashSet::new();
    let mut listeners = Vec::new();
    for (j, l) in lb.listeners.iter().enumerate() {
        let lp = format!("{p}.listeners[{j}]");
        c.ok(&format!("{lp}.id"), check_id(&l.id, 1, 64));
        c.unique(&mut ids, l.id.clone(), &format!("{lp}.id"), || format!("listener id {:?}", l.id));
        let port = c.port(&format!("{lp}.port"), l.port);
        c.unique(&mut ports, (l.kind.protocol(), l.port), &format!("{lp}.port"), || {
            format!("{} port {}", l.kind.protocol(), l.port)
        });
        let group = groups.iter().find(|g| g.id == l.backend_group);
        if group.is_none() {
            c.err(
                format!("{lp}.backend_group"),
                format!("no backend group {:?} in this load balancer", l.backend_group),
            );
        }
        let mode = l.effective_mode();
        match (l.kind, mode) {
            (ListenerType::Udp, ListenerMode::Proxy) => {
                c.err(format!("{lp}.mode"), "udp listeners cannot use proxy mode")
            }
            (ListenerType::Http | ListenerType::Https, ListenerMode::Direct) => {
                c.err(format!("{lp}.mode"), "http/https listeners are served in proxy mode")
            }
            _ => {}
        }
        if l.scheduler == Some(Scheduler::Wlc) && mode == ListenerMode::Direct {
            let n = lb.backend_groups.iter().find(|g| g.id == l.backend_group).map_or(0, |g| g.backends.len());
            if n > lbagent_common::SCHED_LEAST_MAX as usize {
                c.err(
                    format!("{lp}.scheduler"),
                    format!(
                        "wlc compares at most {} backends in direct mode; group {:?} has {n} (use sch, tch or wrr)",
                        lbagent_common::SCHED_LEAST_MAX,
                        l.backend_group
                    ),
                );
            }
        }
        let acl = l.acl.as_ref().map(|acl| spec::Acl {
            allow: acl.action == AclAction::Allow,
            cidrs: acl
                .cidrs
                .iter()
                .enumerate()
                .filter_map(|(k, cidr)| c.ok(&format!("{lp}.acl.cidrs[{k}]"), parse_cidr(cidr)))
                .collect(),
        });
        let acl_whole = acl.as_ref().zip(l.acl.as_ref()).is_none_or(|(a, m)| a.cidrs.len() == m.cidrs.len());
        let health = l.health_check.as_ref().map(|h| health_check(c, &format!("{lp}.health_check"), h, l.kind));
        if let Some(t) = &l.timeouts {
            if mode != ListenerMode::Proxy {
                c.err(format!("{lp}.timeouts"), "timeouts apply to proxy-mode listeners");
            }
            for (name, v) in [("connect", t.connect), ("client", t.client), ("server", t.server)] {
                if let Some(v) = v.filter(|v| *v == 0 || *v > 86_400) {
                    c.err(format!("{lp}.timeouts.{name}"), format!("{v} is out of range (1-86400 seconds)"));
                }
            }
        }
        if let (Some(port), Some(group), true) = (port, group, acl_whole) {
            listeners.push(spec::Listener {
                id: l.id.clone(),
                kind: l.kind,
                port,
                mode,
                scheduler: l.scheduler,
                acl,
                health,
                timeouts: l.timeouts.clone().unwrap_or_default(),
                group: group.clone(),
            });
        }
    }
    let whole = listeners.len() == lb.listeners.len()
        && groups.iter().zip(&lb.backend_groups).all(|(g, m)| g.backends.len() == m.backends.len());
    if !whole {
        return None;
    }
    Some(spec::Lb {
        id: lb.id.clone(),
        name: lb.name.clone(),
        network: spec::LbNetwork { ip: ip?, mac: mac?, prefix_len: n.prefix_len, gateway: gw? },
        listeners,
        groups,
        conntrack_limits: lb.conntrack_limits.unwrap_or_default(),
    })
}

/// A listener's health check: its numbers, the fields of its type, and a
/// type that probes what the listener serves; converted with every
/// default applied.
fn health_check(c: &mut Check, p: &str, h: &model::HealthCheck, listener: ListenerType) -> spec::HealthCheck {
    let mut in_range = true;
    for (name, v, max) in
        [("interval", h.interval, 3600), ("rise", h.rise, 100), ("fall", h.fall, 100), ("timeout", h.timeout, 3600)]
    {
        if let Some(v) = v
            && (v == 0 || v > max)
        {
            c.err(format!("{p}.{name}"), format!("{v} is out of range (1-{max})"));
            in_range = false;
        }
    }
    let spec = spec::HealthCheck {
        kind: h.kind,
        interval_s: h.interval.unwrap_or(spec::HealthCheck::DEFAULT_INTERVAL_S),
        rise: h.rise.unwrap_or(spec::HealthCheck::DEFAULT_RISE),
        fall: h.fall.unwrap_or(spec::HealthCheck::DEFAULT_FALL),
        timeout_s: h.timeout.unwrap_or(spec::HealthCheck::DEFAULT_TIMEOUT_S),
        path: h.path.clone().unwrap_or_else(|| spec::HealthCheck::DEFAULT_PATH.into()),
        expect_status: h.expect_status,
    };
    // A probe that may outlast its interval would overlap the next one.
    let (interval, timeout) = (spec.interval_s, spec.timeout_s);
    if in_range && timeout > interval {
        match h.timeout {
            Some(_) => c.err(format!("{p}.timeout"), format!("{timeout} s is longer than the interval ({interval} s)")),
            None => c.err(
                format!("{p}.interval"),
                format!("{interval} s is shorter than the default timeout ({timeout} s); set a timeout of at most {interval}"),
            ),
        }
    }
    if let Some(path) = &h.path {
        if h.kind != HealthCheckType::Http {
            c.err(format!("{p}.path"), "only http health checks have a path");
        } else {
            c.ok(&format!("{p}.path"), check_health_path(path));
        }
    }
    if let Some(s) = h.expect_status {
        if h.kind != HealthCheckType::Http {
            c.err(format!("{p}.expect_status"), "only http health checks expect a status");
        } else if !(100..=599).contains(&s) {
            c.err(format!("{p}.expect_status"), format!("{s} is not an HTTP status"));
        }
    }
    let misfit = match (listener, h.kind) {
        (ListenerType::Udp, HealthCheckType::Udp) => None,
        (ListenerType::Udp, k) => Some(format!(
            "{} check probes TCP; a udp listener's backends are checked with type: udp",
            if k == HealthCheckType::Http { "an http" } else { "a tcp" }
        )),
        (_, HealthCheckType::Udp) => {
            Some(format!("a udp check cannot probe a {} listener's backends (use tcp or http)", kind_name(listener)))
        }
        (ListenerType::Https, HealthCheckType::Http) => {
            Some("an http check sends plain HTTP; an https listener's backends speak TLS (use tcp)".into())
        }
        _ => None,
    };
    if let Some(m) = misfit {
        c.err(format!("{p}.type"), m);
    }
    spec
}

fn kind_name(k: ListenerType) -> &'static str {
    match k {
        ListenerType::Http => "http",
        ListenerType::Https => "https",
        ListenerType::Tcp => "tcp",
        ListenerType::Udp => "udp",
    }
}

/// An HTTP health-check path goes into `haproxy.cfg` unquoted, so it may use
/// only characters that mean nothing to haproxy's parser: RFC 3986 path and
/// query characters without `#` (comment), `$` (`${VAR}`), `\\`, quotes,
/// spaces, `%` (encodings are refused too: they are not needed for a probe).
pub fn check_health_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') || path.len() > HEALTH_PATH_MAX {
        return Err(format!("{path:?} is not an absolute URL path of at most {HEALTH_PATH_MAX} characters"));
    }
    if let Some(bad) = path.chars().find(|ch| !(ch.is_ascii_alphanumeric() || "/-._~?=&+,;:@!*()".contains(*ch))) {
        return Err(format!(
            "{path:?}: {bad:?} is not allowed in a health-check path (letters, digits and /-._~?=&+,;:@!*() only)"
        ));
    }
    Ok(())
}

/// Conntrack idle timeouts (seconds) below which a value reads as a typo
/// (seconds written for minutes): accepted, with a warning.
pub const CONNTRACK_TYPO_FLOORS: [(&str, u32); 6] = [
    // A client that retries its SYN after 1 s and 3 s keeps its flow.
    ("tcp_new_s", 5),
    // An idle SSH session or pooled database connection is not cut.
    ("tcp_established_s", 60),
    // A DNS answer that takes a few seconds still finds its flow.
    ("udp_s", 5),
    ("udp_stream_s", 10),
    ("icmp_s", 5),
    // A tunnel (GRE, ESP) with a keepalive every 10-30 s keeps its flow.
    ("other_s", 30),
];

/// Proxy-mode client and server timeouts (seconds) below which a value
/// reads as a typo: accepted, with a warning.
pub const PROXY_IDLE_TYPO_FLOOR: u32 = 5;

/// What is accepted but changed or likely unintended: a QoS burst below
/// the floor (raised to it); a timeout too short to be meant (below
/// `CONNTRACK_TYPO_FLOORS`, `PROXY_IDLE_TYPO_FLOOR`). Reported by
/// `lbagent validate` and the daemon.
pub fn warnings(s: &StateFile) -> Vec<Problem> {
    let mut c = Check::default();
    for (name, v) in s.agent.conntrack.fields() {
        let floor = CONNTRACK_TYPO_FLOORS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f);
        if let (Some(v), Some(floor)) = (v, floor)
            && v < floor
        {
            c.err(
                format!("agent.conntrack.{name}"),
                format!("{v} s is shorter than {floor} s: idle flows are cut after {v} s (the value is seconds)"),
            );
        }
    }
    for (i, lb) in s.load_balancers.iter().enumerate() {
        for (j, l) in lb.listeners.iter().enumerate() {
            let Some(t) = &l.timeouts else { continue };
            for (name, v) in [("client", t.client), ("server", t.server)] {
                if let Some(v) = v.filter(|v| (1..PROXY_IDLE_TYPO_FLOOR).contains(v)) {
                    c.err(
                        format!("load_balancers[{i}].listeners[{j}].timeouts.{name}"),
                        format!(
                            "{v} s is shorter than {PROXY_IDLE_TYPO_FLOOR} s: a {name} that pauses longer is cut \
                             (the value is seconds)"
                        ),
                    );
                }
            }
        }
    }
    for (i, q) in s.qos_policies.iter().enumerate() {
        for (j, r) in q.rules.iter().enumerate() {
            let b = r.burst_mb.mb_to_bytes();
            if b != 0 && b < lbagent_common::QOS_BURST_FLOOR {
                c.err(
                    format!("qos_policies[{i}].rules[{j}].burst_mb"),
                    format!(
                        "{} MB ({b} bytes) cannot pass a full-size GSO packet; raised to the floor of {} bytes",
                        r.burst_mb,
                        lbagent_common::QOS_BURST_FLOOR
                    ),
                );
            }
        }
    }
    c.problems
}

/// A policy as gateways and EIPs find it by name: as written (binding,
/// sharing) and converted (`None` when it has a problem).
struct Policy<'a> {
    model: &'a QosPolicy,
    spec: Option<spec::QosPolicy>,
}

fn qos_policies<'a>(c: &mut Check, qs: &'a [QosPolicy]) -> HashMap<&'a str, Policy<'a>> {
    let mut out = HashMap::new();
    for (i, q) in qs.iter().enumerate() {
        let p = format!("qos_policies[{i}]");
        c.ok(&format!("{p}.name"), check_id(&q.name, 1, 64));
        if out.contains_key(q.name.as_str()) {
            c.err(format!("{p}.name"), format!("duplicate QoS policy name {:?}", q.name));
        }
        let spec = qos_policy(c, &p, q);
        out.insert(q.name.as_str(), Policy { model: q, spec });
    }
    out
}

/// A QoS policy's rules, checked and converted (`None` when one does not
/// convert); its name is checked by `qos_policies`.
fn qos_policy(c: &mut Check, p: &str, q: &QosPolicy) -> Option<spec::QosPolicy> {
    if q.binding == QosBinding::Natgw && !q.shared {
        c.err(format!("{p}.shared"), "natgw policies must be shared");
    }
    let mut names = HashSet::new();
    let mut per_hook: HashMap<(&str, Direction), usize> = HashMap::new();
    let mut rules = Vec::new();
    for (j, r) in q.rules.iter().enumerate() {
        let rp = format!("{p}.rules[{j}]");
        if r.rate_mbps.is_zero() {
            c.err(format!("{rp}.rate_mbps"), "a rate of 0 would drop everything; remove the rule to stop limiting");
        } else if r.rate_mbps.micros() > MAX_RATE_MBPS * 1_000_000 {
            c.err(format!("{rp}.rate_mbps"), format!("{} is above {MAX_RATE_MBPS} Mbit/s", r.rate_mbps));
        }
        let ifname = match (r.interface.as_deref(), r.direction) {
            (Some(i), _) => i,
            (None, Direction::Egress) => naming::GW_EXT_IF,
            (None, Direction::Ingress) => naming::GW_LAN_IF,
        };
        let side = match ifname {
            naming::GW_LAN_IF => Some(GwSide::Lan),
            naming::GW_EXT_IF => Some(GwSide::External),
            _ => None,
        };
        if q.binding == QosBinding::Natgw {
            if side.is_none() {
                c.err(
                    format!("{rp}.interface"),
                    format!("{ifname:?}: a gateway's interfaces are {} and {}", naming::GW_LAN_IF, naming::GW_EXT_IF),
                );
            }
            let n = per_hook.entry((ifname, r.direction)).or_default();
            *n += 1;
            if *n == lbagent_common::QOS_HOOK_RULES + 1 {
                c.err(
                    rp.clone(),
                    format!(
                        "more than {} rules on {ifname} {:?} in one policy",
                        lbagent_common::QOS_HOOK_RULES,
                        r.direction
                    ),
                );
            }
        }
        c.ok(&format!("{rp}.name"), check_id(&r.name, 1, 64));
        c.unique(&mut names, r.name.clone(), &format!("{rp}.name"), || format!("rule name {:?}", r.name));
        if let Some(ifn) = &r.interface {
            c.ok(&format!("{rp}.interface"), check_ifname(ifn));
        }
        let matches = match r.matches.as_deref().map(|m| (m, m.split_once(' '))) {
            None => Some(QosMatch::All),
            Some((_, Some(("src", cidr)))) => c.ok(&format!("{rp}.match"), parse_cidr(cidr)).map(QosMatch::Src),
            Some((_, Some(("dst", cidr)))) => c.ok(&format!("{rp}.match"), parse_cidr(cidr)).map(QosMatch::Dst),
            Some((m, _)) => {
                c.err(format!("{rp}.match"), format!("{m:?}: expected \"src <CIDR>\" or \"dst <CIDR>\""));
                None
            }
        };
        if q.binding == QosBinding::Eip {
            if r.matches.is_some() {
                c.err(format!("{rp}.match"), "eip policies apply to the EIP's traffic; match is for natgw policies");
            }
            if r.interface.is_some() {
                c.err(format!("{rp}.interface"), "eip policies always act on the external interface");
            }
        }
        if let (Some(matches), Some(side)) = (matches, side) {
            rules.push(spec::QosRule {
                name: r.name.clone(),
                direction: r.direction,
                rate_bps: r.rate_mbps.micros(),
                burst_bytes: r.burst_mb.mb_to_bytes(),
                priority: r.priority,
                matches,
                side,
            });
        }
    }
    (rules.len() == q.rules.len()).then(|| spec::QosPolicy { name: q.name.clone(), rules })
}

/// What a gateway's check needs from the rest of the document.
struct GwAround<'s, 'a> {
    integration_bridge: &'s str,
    policies: &'s HashMap<&'a str, Policy<'a>>,
    /// Every EIP address of every gateway, with the path of its first use.
    all_eips: &'s HashMap<Ipv4Addr, String>,
}

/// A NAT gateway, checked and converted (`None` when it does not convert).
fn nat_gateway<'a>(
    c: &mut Check,
    p: &str,
    gw: &NatGateway,
    around: &GwAround<'_, 'a>,
    unshared_uses: &mut HashMap<&'a str, usize>,
) -> Option<spec::Gw> {
    c.ok(&format!("{p}.name"), check_id(&gw.name, 1, 32));
    let lan_len = gw.lan.prefix_len;
    let lan_ip = c.ok(&format!("{p}.lan.ip"), parse_ip(&gw.lan.ip));
    c.prefix(&format!("{p}.lan.prefix_len"), lan_len);
    let lan_mac = c.ok(&format!("{p}.lan.mac"), parse_mac(&gw.lan.mac));
    let lan_gw = c.ok(&format!("{p}.lan.gateway"), parse_ip(&gw.lan.gateway));
    if let Some(ip) = lan_ip {
        c.ok(&format!("{p}.lan.ip"), check_host_in(ip, ip, lan_len));
    }
    if let (Some(ip), Some(g)) = (lan_ip, lan_gw) {
        if !in_subnet(g, ip, lan_len) {
            c.err(format!("{p}.lan.gateway"), format!("{g} is not in {ip}/{lan_len}"));
        } else {
            c.ok(&format!("{p}.lan.gateway"), check_host_in(g, ip, lan_len));
        }
        if g == ip {
            c.err(format!("{p}.lan.ip"), format!("{ip} is the LAN gateway's address"));
        }
    }
    c.ok(&format!("{p}.external.bridge"), check_ifname(&gw.external.bridge));
    if gw.external.bridge == around.integration_bridge {
        c.err(
            format!("{p}.external.bridge"),
            format!(
                "{:?} is the integration bridge (agent.integration_bridge): the external side would be bridged \
                 into the VPC",
                gw.external.bridge
            ),
        );
    }
    let ext_len = gw.external.prefix_len;
    c.prefix(&format!("{p}.external.prefix_len"), ext_len);
    let ext_gw = c.ok(&format!("{p}.external.gateway"), parse_ip(&gw.external.gateway));
    if let Some(g) = ext_gw {
        c.ok(&format!("{p}.external.gateway"), check_host_in(g, g, ext_len));
    }
    if let (Some(g), Some(ip)) = (ext_gw, lan_ip)
        && (1..=32).contains(&ext_len)
        && (1..=32).contains(&lan_len)
        && overlaps((g, ext_len), (ip, lan_len))
    {
        let net = |a: Ipv4Addr, len: u8| Ipv4Addr::from(u32::from(a) & mask(len));
        c.err(
            format!("{p}.external.gateway"),
            format!(
                "the external prefix {}/{ext_len} overlaps the LAN prefix {}/{lan_len} (EIPs and VPC hosts would \
                 share addresses)",
                net(g, ext_len),
                net(ip, lan_len)
            ),
        );
    }
    let lan_net = lan_ip.map(|ip| (ip, lan_len));
    let ext_net = ext_gw.map(|g| (g, ext_len));
    let mut route_cidrs = HashSet::new();
    let mut routed: Vec<Cidr> = Vec::new();
    let mut routes = Vec::new();
    for (i, r) in gw.routes.iter().enumerate() {
        let rp = format!("{p}.routes[{i}]");
        let cidr = c.ok(&format!("{rp}.cidr"), parse_cidr(&r.cidr));
        if let Some(cidr) = cidr {
            if cidr.1 == 0 {
                c.err(format!("{rp}.cidr"), "the default route is the agent's (via external.gateway)");
            } else {
                c.ok(&format!("{rp}.cidr"), check_net_class(cidr));
            }
            for (what, net) in [("LAN", lan_net), ("external", ext_net)] {
                if let Some(net) = net.filter(|n| cidr.1 > 0 && overlaps(cidr, *n)) {
                    c.err(
                        format!("{rp}.cidr"),
                        format!("{}/{} overlaps the connected {what} prefix {}/{}", cidr.0, cidr.1, net.0, net.1),
                    );
                }
            }
            c.unique(&mut route_cidrs, cidr, &format!("{rp}.cidr"), || format!("route {}/{}", cidr.0, cidr.1));
            if cidr.1 > 0 {
                routed.push(cidr);
            }
        }
        let via = c.ok(&format!("{rp}.via"), parse_ip(&r.via));
        if let (Some(via), Some(ip)) = (via, lan_ip) {
            if !in_subnet(via, ip, lan_len) {
                c.err(format!("{rp}.via"), format!("{via} is not on the LAN subnet {ip}/{lan_len}"));
            } else if via == ip {
                c.err(format!("{rp}.via"), format!("{via} is the gateway's own LAN address"));
            } else {
                c.ok(&format!("{rp}.via"), check_host_in(via, ip, lan_len));
            }
        }
        if let (Some(cidr), Some(via)) = (cidr, via) {
            routes.push(spec::Route { cidr, via });
        }
    }
    // Addresses a FIP/DNAT target may not be: the gateway's own and EIPs;
    // and where it must be: a host of the LAN, or behind one of the
    // gateway's routes (anything else would leave by the default route,
    // to the external side).
    let own_target = |c: &mut Check, path: String, t: Ipv4Addr| {
        if let Err(e) = check_host_class(t) {
            c.err(path, e);
        } else if Some(t) == lan_ip || Some(t) == ext_gw {
            c.err(path, format!("{t} is one of the gateway's own addresses"));
        } else if let Some(e) = around.all_eips.get(&t) {
            c.err(path, format!("{t} is an EIP ({e})"));
        } else if let Some(ip) = lan_ip.filter(|_| (1..=32).contains(&lan_len)) {
            if in_subnet(t, ip, lan_len) {
                c.ok(&path, check_host_in(t, ip, lan_len));
            } else if !routed.iter().any(|(net, len)| in_subnet(t, *net, *len)) {
                c.err(
                    path,
                    format!(
                        "{t} is neither on the LAN {}/{lan_len} nor behind one of the gateway's routes",
                        Ipv4Addr::from(u32::from(ip) & mask(lan_len))
                    ),
                );
            }
        }
    };
    // The policy a name resolves to, of the binding it must have.
    let policy = |c: &mut Check, path: String, name: &Option<String>, want: QosBinding| -> Option<&Policy<'a>> {
        let name = name.as_ref()?;
        match around.policies.get(name.as_str()) {
            None => c.err(path, format!("no QoS policy {name:?}")),
            Some(pol) if pol.model.binding != want => c.err(
                path,
                match want {
                    QosBinding::Natgw => format!("policy {name:?} has binding eip; a gateway needs a natgw policy"),
                    QosBinding::Eip => format!("policy {name:?} has binding natgw; an EIP needs an eip policy"),
                },
            ),
            Some(pol) => return Some(pol),
        }
        None
    };
    let gw_policy = policy(c, format!("{p}.qos_policy"), &gw.qos_policy, QosBinding::Natgw);
    let mut eip_names = HashSet::new();
    let mut eip_ips = HashSet::new();
    let mut eips = Vec::new();
    for (i, e) in gw.eips.iter().enumerate() {
        let ep = format!("{p}.eips[{i}]");
        c.ok(&format!("{ep}.name"), check_id(&e.name, 1, 64));
        if !eip_names.insert(e.name.as_str()) {
            c.err(format!("{ep}.name"), format!("duplicate EIP name {:?}", e.name));
        }
        let ip = c.ok(&format!("{ep}.ip"), parse_ip(&e.ip));
        if let Some(ip) = ip {
            c.unique(&mut eip_ips, ip, &format!("{ep}.ip"), || format!("EIP address {ip}"));
            if let Some(g) = ext_gw {
                if !in_subnet(ip, g, ext_len) {
                    c.err(format!("{ep}.ip"), format!("{ip} is not in the external prefix {g}/{ext_len}"));
                } else if ip == g {
                    c.err(format!("{ep}.ip"), format!("{ip} is the external gateway"));
                } else {
                    c.ok(&format!("{ep}.ip"), check_host_in(ip, g, ext_len));
                }
            }
        }
        let pol = policy(c, format!("{ep}.qos_policy"), &e.qos_policy, QosBinding::Eip);
        if let Some(pol) = pol
            && !pol.model.shared
        {
            *unshared_uses.entry(pol.model.name.as_str()).or_default() += 1;
        }
        if let Some(ip) = ip {
            eips.push(spec::Eip { name: e.name.clone(), ip, policy: pol.and_then(|p| p.spec.clone()) });
        }
    }
    let eip = |c: &mut Check, path: String, name: &str| -> Option<EipRef> {
        if !eip_names.contains(name) {
            c.err(path, format!("no EIP {name:?} on this gateway"));
        }
        eips.iter().find(|e| e.name == name).map(|e| EipRef { name: e.name.clone(), ip: e.ip })
    };
    let mut fip_eips = HashSet::new();
    let mut fip_targets: HashMap<Ipv4Addr, usize> = HashMap::new();
    let mut fips = Vec::with_capacity(gw.fips.len());
    for (i, f) in gw.fips.iter().enumerate() {
        let fp = format!("{p}.fips[{i}]");
        let e = eip(c, format!("{fp}.eip"), &f.eip);
        c.unique(&mut fip_eips, f.eip.as_str(), &format!("{fp}.eip"), || {
            format!("floating IP on EIP {:?} (one per EIP)", f.eip)
        });
        let t = c.ok(&format!("{fp}.internal_ip"), parse_ip(&f.internal_ip));
        if let Some(t) = t {
            own_target(c, format!("{fp}.internal_ip"), t);
            if let Some(first) = fip_targets.get(&t) {
                c.err(
                    format!("{fp}.internal_ip"),
                    format!(
                        "{t} already has a floating IP ({p}.fips[{first}]): an internal address has one FIP (its \
                         traffic leaves from one EIP)"
                    ),
                );
            } else {
                fip_targets.insert(t, i);
            }
        }
        if let (Some(eip), Some(internal_ip)) = (e, t) {
            fips.push(spec::Fip { eip, internal_ip });
        }
    }
    let mut identities: HashMap<(&str, Protocol, u32), Vec<DnatMode>> = HashMap::new();
    let mut dnats = Vec::with_capacity(gw.dnats.len());
    for (i, d) in gw.dnats.iter().enumerate() {
        let dp = format!("{p}.dnats[{i}]");
        let e = eip(c, format!("{dp}.eip"), &d.eip);
        if fip_eips.contains(d.eip.as_str()) {
            c.err(
                format!("{dp}.eip"),
                format!("EIP {:?} carries a floating IP; a FIP and a DNAT never share an EIP", d.eip),
            );
        }
        let external_port = c.port(&format!("{dp}.external_port"), d.external_port);
        let internal_port = c.port(&format!("{dp}.internal_port"), d.internal_port);
        let t = c.ok(&format!("{dp}.internal_ip"), parse_ip(&d.internal_ip));
        if let Some(t) = t {
            own_target(c, format!("{dp}.internal_ip"), t);
        }
        let modes = identities.entry((d.eip.as_str(), d.protocol, d.external_port)).or_default();
        modes.push(d.mode);
        if modes.len() > 1 && modes.contains(&DnatMode::Exclusive) {
            c.err(
                format!("{dp}.external_port"),
                format!(
                    "duplicate DNAT {:?} {} {} (several backends need mode: share on every entry)",
                    d.eip, d.protocol, d.external_port
                ),
            );
        }
        if let (Some(eip), Some(external_port), Some(internal_ip), Some(internal_port)) =
            (e, external_port, t, internal_port)
        {
            dnats.push(spec::Dnat {
                eip,
                protocol: d.protocol,
                external_port,
                internal_ip,
                internal_port,
                mode: d.mode,
            });
        }
    }
    let mut cidrs = HashSet::new();
    let mut snats = Vec::with_capacity(gw.snats.len());
    for (i, s) in gw.snats.iter().enumerate() {
        let sp = format!("{p}.snats[{i}]");
        let e = eip(c, format!("{sp}.eip"), &s.eip);
        let cidr = c.ok(&format!("{sp}.internal_cidr"), parse_cidr(&s.internal_cidr));
        if let Some(cidr) = cidr {
            c.ok(&format!("{sp}.internal_cidr"), check_net_class(cidr));
            c.unique(&mut cidrs, cidr, &format!("{sp}.internal_cidr"), || format!("SNAT source {}/{}", cidr.0, cidr.1));
        }
        if let (Some(eip), Some(internal_cidr)) = (e, cidr) {
            snats.push(spec::Snat { eip, internal_cidr });
        }
    }
    let whole = routes.len() == gw.routes.len()
        && eips.len() == gw.eips.len()
        && fips.len() == gw.fips.len()
        && dnats.len() == gw.dnats.len()
        && snats.len() == gw.snats.len()
        // Every policy named resolves, to one that converts.
        && gw.eips.iter().zip(&eips).all(|(e, s)| e.qos_policy.is_none() || s.policy.is_some());
    if !whole {
        return None;
    }
    let policy = match (&gw.qos_policy, gw_policy) {
        (None, _) => None,
        (Some(_), pol) => Some(pol?.spec.clone()?),
    };
    Some(spec::Gw {
        name: gw.name.clone(),
        lan: spec::GwLan { ip: lan_ip?, prefix_len: lan_len, mac: lan_mac?, gateway: lan_gw? },
        external: spec::GwExternal { bridge: gw.external.bridge.clone(), prefix_len: ext_len, gateway: ext_gw? },
        routes,
        policy,
        eips,
        fips,
        dnats,
        snats,
        conntrack_limits: gw.conntrack_limits.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::spec::Desired;
    use crate::state::{Format, load::parse, model};

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
    fn a_value_that_does_not_fit_its_type_is_a_problem_with_its_path() {
        let mut s = example();
        s.load_balancers[0].backend_groups[0].backends[0].port = 65_536;
        s.nat_gateways[0].routes.push(model::Route { cidr: "10.0.0.1/8".into(), via: "10.10.0.1".into() });
        let err = Desired::from_state(&s).unwrap_err();
        let paths: Vec<&str> = err.0.iter().map(|p| p.path.as_str()).collect();
        assert!(paths.contains(&"load_balancers[0].backend_groups[0].backends[0].port"), "{paths:?}");
        assert!(paths.iter().any(|p| p.starts_with("nat_gateways[0].routes[")), "{paths:?}");
    }
}
