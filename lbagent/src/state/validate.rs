//! Validation: every problem, each with its path. Enforces the reference
//! systems' rules (DESIGN §2, §3) on top of what parsing already checked.

use std::collections::{HashMap, HashSet};

use super::{
    load::Problem,
    model::*,
    names::{check_id, check_ifname, in_subnet, parse_cidr, parse_ip, parse_mac},
};

/// Minimum load balancer id length (names use its first 13 characters).
pub const LB_ID_MIN: usize = 13;

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

    fn port(&mut self, path: &str, port: u32) {
        if !(1..=65535).contains(&port) {
            self.err(path, format!("{port} is not a port (1-65535)"));
        }
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

pub fn validate(s: &StateFile) -> Vec<Problem> {
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
    let mut lb_ids = HashSet::new();
    for (i, lb) in s.load_balancers.iter().enumerate() {
        let p = format!("load_balancers[{i}]");
        c.unique(&mut lb_ids, lb.id.clone(), &format!("{p}.id"), || format!("load balancer id {:?}", lb.id));
        load_balancer(&mut c, &p, lb);
    }
    let policies = qos_policies(&mut c, &s.qos_policies);
    let mut gw_names = HashSet::new();
    let mut unshared_uses: HashMap<&str, usize> = HashMap::new();
    for (i, gw) in s.nat_gateways.iter().enumerate() {
        let p = format!("nat_gateways[{i}]");
        c.unique(&mut gw_names, gw.name.clone(), &format!("{p}.name"), || format!("NAT gateway name {:?}", gw.name));
        nat_gateway(&mut c, &p, gw, &policies, &mut unshared_uses);
    }
    for (name, n) in unshared_uses {
        if n > 1 {
            let i = s.qos_policies.iter().position(|q| q.name == name).unwrap_or(0);
            c.err(format!("qos_policies[{i}].shared"), format!("policy {name:?} is not shared but bound to {n} EIPs"));
        }
    }
    c.problems
}

fn load_balancer(c: &mut Check, p: &str, lb: &LoadBalancer) {
    c.ok(&format!("{p}.id"), check_id(&lb.id, LB_ID_MIN, 64));
    let n = &lb.network;
    let ip = c.ok(&format!("{p}.network.ip"), parse_ip(&n.ip));
    c.ok(&format!("{p}.network.mac"), parse_mac(&n.mac));
    c.prefix(&format!("{p}.network.prefix_len"), n.prefix_len);
    let gw = c.ok(&format!("{p}.network.gateway"), parse_ip(&n.gateway));
    if let (Some(ip), Some(gw)) = (ip, gw) {
        if !in_subnet(gw, ip, n.prefix_len) {
            c.err(format!("{p}.network.gateway"), format!("{gw} is not in {ip}/{}", n.prefix_len));
        }
        if ip == gw {
            c.err(format!("{p}.network.gateway"), "the gateway is the load balancer's own address");
        }
    }
    let mut groups = HashSet::new();
    let mut backend_ids = HashSet::new();
    for (j, g) in lb.backend_groups.iter().enumerate() {
        let gp = format!("{p}.backend_groups[{j}]");
        c.unique(&mut groups, g.id.clone(), &format!("{gp}.id"), || format!("backend group id {:?}", g.id));
        c.ok(&format!("{gp}.id"), check_id(&g.id, 1, 64));
        for (k, b) in g.backends.iter().enumerate() {
            let bp = format!("{gp}.backends[{k}]");
            c.ok(&format!("{bp}.id"), check_id(&b.id, 1, 64));
            c.unique(&mut backend_ids, b.id.clone(), &format!("{bp}.id"), || {
                format!("backend id {:?} in this load balancer", b.id)
            });
            c.ok(&format!("{bp}.address"), parse_ip(&b.address));
            c.port(&format!("{bp}.port"), b.port);
            if b.weight > 256 {
                c.err(format!("{bp}.weight"), format!("{} is above the maximum weight 256", b.weight));
            }
        }
    }
    let mut ids = HashSet::new();
    let mut ports = HashSet::new();
    for (j, l) in lb.listeners.iter().enumerate() {
        let lp = format!("{p}.listeners[{j}]");
        c.ok(&format!("{lp}.id"), check_id(&l.id, 1, 64));
        c.unique(&mut ids, l.id.clone(), &format!("{lp}.id"), || format!("listener id {:?}", l.id));
        c.port(&format!("{lp}.port"), l.port);
        c.unique(&mut ports, (l.kind.l4(), l.port), &format!("{lp}.port"), || {
            format!("{} port {}", l.kind.l4(), l.port)
        });
        if !groups.contains(&l.backend_group) {
            c.err(
                format!("{lp}.backend_group"),
                format!("no backend group {:?} in this load balancer", l.backend_group),
            );
        }
        match (l.kind, l.effective_mode()) {
            (ListenerType::Udp, ListenerMode::Proxy) => {
                c.err(format!("{lp}.mode"), "udp listeners cannot use proxy mode")
            }
            (ListenerType::Http | ListenerType::Https, ListenerMode::Direct) => {
                c.err(format!("{lp}.mode"), "http/https listeners are served in proxy mode")
            }
            _ => {}
        }
        if let Some(acl) = &l.acl {
            for (k, cidr) in acl.cidrs.iter().enumerate() {
                c.ok(&format!("{lp}.acl.cidrs[{k}]"), parse_cidr(cidr));
            }
        }
        if let Some(h) = &l.health_check {
            health_check(c, &format!("{lp}.health_check"), h);
        }
        if let Some(t) = &l.timeouts {
            if l.effective_mode() != ListenerMode::Proxy {
                c.err(format!("{lp}.timeouts"), "timeouts apply to proxy-mode listeners");
            }
            for (name, v) in [("connect", t.connect), ("client", t.client), ("server", t.server)] {
                if let Some(v) = v.filter(|v| *v == 0 || *v > 86_400) {
                    c.err(format!("{lp}.timeouts.{name}"), format!("{v} is out of range (1-86400 seconds)"));
                }
            }
        }
    }
}

fn health_check(c: &mut Check, p: &str, h: &HealthCheck) {
    for (name, v, max) in
        [("interval", h.interval, 3600), ("rise", h.rise, 100), ("fall", h.fall, 100), ("timeout", h.timeout, 3600)]
    {
        if let Some(v) = v
            && (v == 0 || v > max)
        {
            c.err(format!("{p}.{name}"), format!("{v} is out of range (1-{max})"));
        }
    }
    if let Some(path) = &h.path {
        if h.kind != HealthCheckType::Http {
            c.err(format!("{p}.path"), "only http health checks have a path");
        } else if !path.starts_with('/') || path.bytes().any(|b| b.is_ascii_control() || b == b' ') {
            c.err(format!("{p}.path"), format!("{path:?} is not an absolute URL path"));
        }
    }
    if let Some(s) = h.expect_status
        && !(100..=599).contains(&s)
    {
        c.err(format!("{p}.expect_status"), format!("{s} is not an HTTP status"));
    }
}

fn qos_policies<'a>(c: &mut Check, qs: &'a [QosPolicy]) -> HashMap<&'a str, &'a QosPolicy> {
    let mut out = HashMap::new();
    for (i, q) in qs.iter().enumerate() {
        let p = format!("qos_policies[{i}]");
        c.ok(&format!("{p}.name"), check_id(&q.name, 1, 64));
        if out.insert(q.name.as_str(), q).is_some() {
            c.err(format!("{p}.name"), format!("duplicate QoS policy name {:?}", q.name));
        }
        if q.binding == QosBinding::Natgw && !q.shared {
            c.err(format!("{p}.shared"), "natgw policies must be shared");
        }
        let mut rules = HashSet::new();
        for (j, r) in q.rules.iter().enumerate() {
            let rp = format!("{p}.rules[{j}]");
            c.ok(&format!("{rp}.name"), check_id(&r.name, 1, 64));
            c.unique(&mut rules, r.name.clone(), &format!("{rp}.name"), || format!("rule name {:?}", r.name));
            if let Some(ifn) = &r.interface {
                c.ok(&format!("{rp}.interface"), check_ifname(ifn));
            }
            if let Some(m) = &r.matches {
                match m.split_once(' ') {
                    Some(("src" | "dst", cidr)) => {
                        c.ok(&format!("{rp}.match"), parse_cidr(cidr));
                    }
                    _ => c.err(format!("{rp}.match"), format!("{m:?}: expected \"src <CIDR>\" or \"dst <CIDR>\"")),
                }
            }
            if q.binding == QosBinding::Eip {
                if r.matches.is_some() {
                    c.err(
                        format!("{rp}.match"),
                        "eip policies apply to the EIP's traffic; match is for natgw policies",
                    );
                }
                if r.interface.is_some() {
                    c.err(format!("{rp}.interface"), "eip policies always act on the external interface");
                }
            }
        }
    }
    out
}

fn nat_gateway<'a>(
    c: &mut Check,
    p: &str,
    gw: &'a NatGateway,
    policies: &HashMap<&str, &'a QosPolicy>,
    unshared_uses: &mut HashMap<&'a str, usize>,
) {
    c.ok(&format!("{p}.name"), check_id(&gw.name, 1, 32));
    let lan_ip = c.ok(&format!("{p}.lan.ip"), parse_ip(&gw.lan.ip));
    c.prefix(&format!("{p}.lan.prefix_len"), gw.lan.prefix_len);
    c.ok(&format!("{p}.lan.mac"), parse_mac(&gw.lan.mac));
    let lan_gw = c.ok(&format!("{p}.lan.gateway"), parse_ip(&gw.lan.gateway));
    if let (Some(ip), Some(g)) = (lan_ip, lan_gw)
        && !in_subnet(g, ip, gw.lan.prefix_len)
    {
        c.err(format!("{p}.lan.gateway"), format!("{g} is not in {ip}/{}", gw.lan.prefix_len));
    }
    c.ok(&format!("{p}.external.bridge"), check_ifname(&gw.external.bridge));
    c.prefix(&format!("{p}.external.prefix_len"), gw.external.prefix_len);
    c.ok(&format!("{p}.external.gateway"), parse_ip(&gw.external.gateway));
    for (i, r) in gw.routes.iter().enumerate() {
        c.ok(&format!("{p}.routes[{i}].cidr"), parse_cidr(&r.cidr));
        c.ok(&format!("{p}.routes[{i}].via"), parse_ip(&r.via));
    }
    if let Some(q) = &gw.qos_policy {
        match policies.get(q.as_str()) {
            None => c.err(format!("{p}.qos_policy"), format!("no QoS policy {q:?}")),
            Some(pol) if pol.binding != QosBinding::Natgw => c.err(
                format!("{p}.qos_policy"),
                format!("policy {q:?} has binding eip; a gateway needs a natgw policy"),
            ),
            _ => {}
        }
    }
    let mut eips = HashMap::new();
    let mut eip_ips = HashSet::new();
    for (i, e) in gw.eips.iter().enumerate() {
        let ep = format!("{p}.eips[{i}]");
        c.ok(&format!("{ep}.name"), check_id(&e.name, 1, 64));
        if eips.insert(e.name.as_str(), i).is_some() {
            c.err(format!("{ep}.name"), format!("duplicate EIP name {:?}", e.name));
        }
        if let Some(ip) = c.ok(&format!("{ep}.ip"), parse_ip(&e.ip)) {
            c.unique(&mut eip_ips, ip, &format!("{ep}.ip"), || format!("EIP address {ip}"));
        }
        if let Some(q) = &e.qos_policy {
            match policies.get(q.as_str()) {
                None => c.err(format!("{ep}.qos_policy"), format!("no QoS policy {q:?}")),
                Some(pol) if pol.binding != QosBinding::Eip => c.err(
                    format!("{ep}.qos_policy"),
                    format!("policy {q:?} has binding natgw; an EIP needs an eip policy"),
                ),
                Some(pol) => {
                    if !pol.shared {
                        *unshared_uses.entry(pol.name.as_str()).or_default() += 1;
                    }
                }
            }
        }
    }
    let resolve = |c: &mut Check, path: String, eip: &str| {
        if !eips.contains_key(eip) {
            c.err(path, format!("no EIP {eip:?} on this gateway"));
        }
    };
    let mut fip_eips = HashSet::new();
    for (i, f) in gw.fips.iter().enumerate() {
        let fp = format!("{p}.fips[{i}]");
        resolve(c, format!("{fp}.eip"), &f.eip);
        c.unique(&mut fip_eips, f.eip.as_str(), &format!("{fp}.eip"), || {
            format!("floating IP on EIP {:?} (one per EIP)", f.eip)
        });
        c.ok(&format!("{fp}.internal_ip"), parse_ip(&f.internal_ip));
    }
    let mut identities: HashMap<(&str, Protocol, u32), Vec<DnatMode>> = HashMap::new();
    for (i, d) in gw.dnats.iter().enumerate() {
        let dp = format!("{p}.dnats[{i}]");
        resolve(c, format!("{dp}.eip"), &d.eip);
        if fip_eips.contains(d.eip.as_str()) {
            c.err(
                format!("{dp}.eip"),
                format!("EIP {:?} carries a floating IP; a FIP and a DNAT never share an EIP", d.eip),
            );
        }
        c.port(&format!("{dp}.external_port"), d.external_port);
        c.port(&format!("{dp}.internal_port"), d.internal_port);
        c.ok(&format!("{dp}.internal_ip"), parse_ip(&d.internal_ip));
        let modes = identities.entry((d.eip.as_str(), d.protocol, d.external_port)).or_default();
        modes.push(d.mode);
        if modes.len() > 1 && modes.contains(&DnatMode::Exclusive) {
            c.err(
                format!("{dp}.external_port"),
                format!(
                    "duplicate DNAT {:?} {} {} (several backends need mode: share on every entry)",
                    d.eip,
                    if d.protocol == Protocol::Tcp { "tcp" } else { "udp" },
                    d.external_port
                ),
            );
        }
    }
    let mut cidrs = HashSet::new();
    for (i, s) in gw.snats.iter().enumerate() {
        let sp = format!("{p}.snats[{i}]");
        resolve(c, format!("{sp}.eip"), &s.eip);
        if let Some(cidr) = c.ok(&format!("{sp}.internal_cidr"), parse_cidr(&s.internal_cidr)) {
            c.unique(&mut cidrs, cidr, &format!("{sp}.internal_cidr"), || format!("SNAT source {}/{}", cidr.0, cidr.1));
        }
    }
}
