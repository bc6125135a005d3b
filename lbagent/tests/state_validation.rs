//! Table-driven validation cases: each mutates the valid example and
//! expects either success or specific `path: message` errors.

use lbagent::state::{Format, accept_str, load_str};

const BASE: &str = include_str!("../../examples/state.yaml");

/// (case, find, replace, expected error fragments; empty = valid)
const CASES: &[(&str, &str, &str, &[&str])] = &[
    ("example is valid", "", "", &[]),
    ("version 2", "version: 1", "version: 2", &["version: unsupported version 2"]),
    ("unknown top-level field", "version: 1", "version: 1\nextra: 1", &["unknown field `extra`"]),
    ("conntrack timeouts", "tcp_established_s: 432000", "tcp_established_s: 86400", &[]),
    (
        "conntrack timeout zero",
        "udp_s: 30",
        "udp_s: 0",
        &["agent.conntrack.udp_s: 0 is out of range (1-2592000 seconds)"],
    ),
    ("conntrack timeout too long", "udp_s: 30", "udp_s: 2592001", &["agent.conntrack.udp_s: 2592001 is out of range"]),
    ("conntrack limit zero is none", "{established: 65536, new: 16384}", "{established: 0, new: 16384}", &[]),
    (
        "conntrack limit negative",
        "{established: 65536, new: 16384}",
        "{established: -1, new: 16384}",
        &["agent.conntrack_limits"],
    ),
    (
        "object conntrack limit too large",
        "conntrack_limits: {new: 32768}",
        "conntrack_limits: {new: 16777217}",
        &["nat_gateways[0].conntrack_limits.new: 16777217 is out of range"],
    ),
    (
        "conntrack limit as a string",
        "conntrack_limits: {new: 32768}",
        "conntrack_limits: {new: \"1e9\"}",
        &["nat_gateways[0].conntrack_limits.new"],
    ),
    (
        "unknown conntrack limit",
        "conntrack_limits: {new: 32768}",
        "conntrack_limits: {new: 32768, syn: 5}",
        &["unknown field `syn`"],
    ),
    ("conntrack unknown timeout", "udp_s: 30", "udp_s: 30, sctp_s: 5", &["agent.conntrack", "unknown field `sctp_s`"]),
    (
        "unknown listener field",
        "scheduler: wrr}",
        "scheduler: wrr, colour: red}",
        &["load_balancers[0].listeners[1]", "unknown field `colour`"],
    ),
    (
        "short lb id",
        "3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60",
        "short-id",
        &["load_balancers[0].id: \"short-id\": must have 13 to 64 characters"],
    ),
    (
        "hostile lb id",
        "3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60",
        "abcdefghijklm;rm -rf /",
        &["load_balancers[0].id", "only letters"],
    ),
    (
        "command substitution in id",
        "3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60",
        "$(reboot)abcdefghijkl",
        &["load_balancers[0].id"],
    ),
    ("duplicate tcp port", "port: 5000", "port: 80", &["load_balancers[0].listeners[1].port: duplicate tcp port 80"]),
    ("same port other protocol ok", "type: udp, port: 53", "type: udp, port: 80", &[]),
    ("port 0", "port: 5000", "port: 0", &["load_balancers[0].listeners[1].port: 0 is not a port"]),
    ("port 65536", "port: 5000", "port: 65536", &["listeners[1].port: 65536 is not a port"]),
    (
        "port as hostile string",
        "port: 5000",
        "port: \"100;rm -rf /\"",
        &["load_balancers[0].listeners[1].port", "invalid type"],
    ),
    ("port as hex string", "port: 5000", "port: \"0x64\"", &["load_balancers[0].listeners[1].port"]),
    ("negative port", "port: 5000", "port: -1", &["load_balancers[0].listeners[1].port"]),
    (
        "unknown backend group",
        "backend_group: g-dns",
        "backend_group: g-nope",
        &["listeners[2].backend_group: no backend group \"g-nope\""],
    ),
    ("unknown listener type", "type: http", "type: ftp", &["listeners[0].type", "unknown variant `ftp`"]),
    (
        "udp in proxy mode",
        "type: udp, port: 53, backend_group: g-dns, scheduler: sch",
        "type: udp, port: 53, backend_group: g-dns, mode: proxy",
        &["listeners[2].mode: udp listeners cannot use proxy mode"],
    ),
    (
        "http in direct mode",
        "type: http, port: 80, backend_group: g-web}",
        "type: http, port: 80, backend_group: g-web, mode: direct}",
        &["listeners[0].mode"],
    ),
    ("unknown scheduler", "scheduler: wrr", "scheduler: fastest", &["listeners[1].scheduler", "unknown variant"]),
    (
        "bad acl cidr",
        "cidrs: [10.10.0.0/24, 192.0.2.7]",
        "cidrs: [10.10.0.0/33]",
        &["listeners[3].acl.cidrs[0]: \"10.10.0.0/33\": prefix length"],
    ),
    (
        "acl cidr with host bits",
        "cidrs: [10.10.0.0/24, 192.0.2.7]",
        "cidrs: [10.10.0.1/24]",
        &["acl.cidrs[0]", "host bits"],
    ),
    ("health check zero interval", "interval: 5", "interval: 0", &["health_check.interval: 0 is out of range"]),
    (
        "path on tcp check",
        "timeout: 2}",
        "timeout: 2, path: /health}",
        &["health_check.path: only http health checks have a path"],
    ),
    ("timeout zero", "client: 30", "client: 0", &["listeners[3].timeouts.client: 0 is out of range"]),
    (
        "timeouts on a direct listener",
        "scheduler: wrr}",
        "scheduler: wrr, timeouts: {client: 5}}",
        &["listeners[1].timeouts: timeouts apply to proxy-mode listeners"],
    ),
    ("bad mac", "\"02:00:0a:0a:00:05\"", "\"02:00:0a:0a:00\"", &["load_balancers[0].network.mac"]),
    ("multicast mac", "\"02:00:0a:0a:00:05\"", "\"01:00:5e:00:00:05\"", &["network.mac", "multicast"]),
    (
        "bad ip",
        "ip: 10.10.0.5,",
        "ip: 10.10.0.256,",
        &["load_balancers[0].network.ip: \"10.10.0.256\" is not an IPv4 address"],
    ),
    (
        "gateway outside subnet",
        "gateway: 10.10.0.1}\n    listeners",
        "gateway: 10.11.0.1}\n    listeners",
        &["network.gateway: 10.11.0.1 is not in 10.10.0.5/24"],
    ),
    (
        "prefix 33",
        "prefix_len: 24, gateway: 10.10.0.1}\n    listeners",
        "prefix_len: 33, gateway: 10.10.0.1}\n    listeners",
        &["network.prefix_len: 33 is not a prefix length"],
    ),
    (
        "duplicate backend id",
        "{id: b2,",
        "{id: b1,",
        &["backend_groups[0].backends[1].id: duplicate backend id \"b1\""],
    ),
    ("backend bad address", "address: 10.10.0.12", "address: backend.local", &["backends[1].address"]),
    ("weight too large", "weight: 2}", "weight: 1000}", &["backends[1].weight: 1000 is above"]),
    (
        "two fips on one eip",
        "fips: [{eip: eip1, internal_ip: 10.10.0.21}]",
        "fips: [{eip: eip1, internal_ip: 10.10.0.21}, {eip: eip1, internal_ip: 10.10.0.25}]",
        &["nat_gateways[0].fips[1].eip: duplicate floating IP on EIP \"eip1\""],
    ),
    (
        "fip and dnat share eip",
        "{eip: eip2, protocol: tcp, external_port: 2222",
        "{eip: eip1, protocol: tcp, external_port: 2222",
        &["nat_gateways[0].dnats[0].eip: EIP \"eip1\" carries a floating IP"],
    ),
    (
        "exclusive dnat duplicate",
        "internal_ip: 10.10.0.24, internal_port: 80, mode: share",
        "internal_ip: 10.10.0.24, internal_port: 80, mode: exclusive",
        &["nat_gateways[0].dnats[2].external_port: duplicate DNAT"],
    ),
    (
        "share dnat without mode",
        "internal_ip: 10.10.0.24, internal_port: 80, mode: share}",
        "internal_ip: 10.10.0.24, internal_port: 80}",
        &["dnats[2].external_port: duplicate DNAT"],
    ),
    (
        "dnat to unknown eip",
        "{eip: eip2, protocol: tcp",
        "{eip: eip9, protocol: tcp",
        &["dnats[0].eip: no EIP \"eip9\" on this gateway"],
    ),
    (
        "dnat bad protocol",
        "protocol: tcp, external_port: 2222",
        "protocol: sctp, external_port: 2222",
        &["dnats[0].protocol", "unknown variant `sctp`"],
    ),
    ("snat bare ip is /32", "internal_cidr: 10.10.0.0/24", "internal_cidr: 10.10.0.7", &[]),
    ("snat bad cidr", "internal_cidr: 10.10.0.0/24", "internal_cidr: 10.10.0.0/99", &["snats[0].internal_cidr"]),
    (
        "snat hostile cidr",
        "internal_cidr: 10.10.0.0/24",
        "internal_cidr: \"$(curl evil)\"",
        &["snats[0].internal_cidr", "is not an IPv4 CIDR"],
    ),
    (
        "duplicate eip name",
        "{name: eip3, ip: 198.51.100.12}",
        "{name: eip2, ip: 198.51.100.12}",
        &["eips[2].name: duplicate EIP name \"eip2\""],
    ),
    (
        "duplicate eip address",
        "{name: eip3, ip: 198.51.100.12}",
        "{name: eip3, ip: 198.51.100.11}",
        &["eips[2].ip: duplicate EIP address 198.51.100.11"],
    ),
    (
        "unknown qos policy",
        "qos_policy: eip1-qos}",
        "qos_policy: nope}",
        &["eips[0].qos_policy: no QoS policy \"nope\""],
    ),
    ("natgw policy on eip", "qos_policy: eip1-qos}", "qos_policy: gw-qos}", &["eips[0].qos_policy", "binding natgw"]),
    (
        "eip policy on gateway",
        "qos_policy: gw-qos\n",
        "qos_policy: eip1-qos\n",
        &["nat_gateways[0].qos_policy", "binding eip"],
    ),
    (
        "unshared policy on two eips",
        "{name: eip2, ip: 198.51.100.11}",
        "{name: eip2, ip: 198.51.100.11, qos_policy: eip1-qos}",
        &["qos_policies[0].shared: policy \"eip1-qos\" is not shared but bound to 2 EIPs"],
    ),
    (
        "natgw policy not shared",
        "binding: natgw\n    shared: true",
        "binding: natgw\n    shared: false",
        &["qos_policies[1].shared: natgw policies must be shared"],
    ),
    (
        "rate with unit",
        "rate_mbps: 10,",
        "rate_mbps: 100Mbit,",
        &["qos_policies[0].rules[0].rate_mbps", "not a non-negative decimal"],
    ),
    ("negative rate", "rate_mbps: 10,", "rate_mbps: -1,", &["qos_policies[0].rules[0].rate_mbps", "negative"]),
    ("bare fraction string", "rate_mbps: \"2.5\"", "rate_mbps: \".5\"", &["qos_policies[0].rules[1].rate_mbps"]),
    ("hex rate string", "rate_mbps: \"2.5\"", "rate_mbps: \"0x64\"", &["qos_policies[0].rules[1].rate_mbps"]),
    ("decimal string ok", "rate_mbps: \"2.5\"", "rate_mbps: \"0.5\"", &[]),
    (
        "duplicate rule name",
        "{name: out, direction: egress",
        "{name: in, direction: egress",
        &["qos_policies[0].rules[1].name: duplicate rule name \"in\""],
    ),
    (
        "bad direction",
        "direction: ingress, rate_mbps: 10",
        "direction: inbound, rate_mbps: 10",
        &["rules[0].direction", "unknown variant `inbound`"],
    ),
    (
        "interface too long",
        "interface: eth0}",
        "interface: averyveryverylongname}",
        &["qos_policies[1].rules[1].interface", "1 to 15 characters"],
    ),
    ("interface hostile", "interface: eth0}", "interface: \"eth0;reboot\"}", &["qos_policies[1].rules[1].interface"]),
    (
        "bad match",
        "match: \"src 10.10.0.0/24\"",
        "match: \"from 10.10.0.0/24\"",
        &["qos_policies[1].rules[0].match", "expected \"src <CIDR>\""],
    ),
    (
        "match on eip policy",
        "burst_mb: 1, priority: 1}",
        "burst_mb: 1, priority: 1, match: \"src 10.0.0.0/8\"}",
        &["qos_policies[0].rules[0].match"],
    ),
    (
        "qos rate zero",
        "{name: in,  direction: ingress, rate_mbps: 10",
        "{name: in,  direction: ingress, rate_mbps: 0",
        &["qos_policies[0].rules[0].rate_mbps: a rate of 0 would drop everything; remove the rule to stop limiting"],
    ),
    (
        "qos rate too high",
        "{name: in,  direction: ingress, rate_mbps: 10",
        "{name: in,  direction: ingress, rate_mbps: 100001",
        &["qos_policies[0].rules[0].rate_mbps", "above 100000 Mbit/s"],
    ),
    (
        "natgw qos on another interface",
        "interface: eth0}",
        "interface: eth1}",
        &["qos_policies[1].rules[1].interface", "eth0 and net1"],
    ),
    (
        "bridge name hostile",
        "integration_bridge: brvpc",
        "integration_bridge: \"br$(id)\"",
        &["agent.integration_bridge"],
    ),
    (
        "duplicate lb",
        "load_balancers:\n",
        "load_balancers:\n  - {id: 3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60, network: {ip: 10.10.0.6, mac: \"02:00:0a:0a:00:06\", prefix_len: 24, gateway: 10.10.0.1}}\n",
        &["load_balancers[1].id: duplicate load balancer id"],
    ),
];

#[test]
fn validation_table() {
    assert!(CASES.len() >= 40);
    let mut failures = Vec::new();
    for (name, find, replace, expected) in CASES {
        let text = if find.is_empty() {
            BASE.to_string()
        } else {
            assert!(BASE.contains(find), "case {name}: {find:?} not in the example");
            BASE.replacen(find, replace, 1)
        };
        match (load_str(&text, Format::Yaml), expected.is_empty()) {
            (Ok(_), true) => {}
            (Ok(_), false) => failures.push(format!("{name}: accepted, expected {expected:?}")),
            (Err(e), true) => failures.push(format!("{name}: rejected: {e}")),
            (Err(e), false) => {
                let text = e.to_string();
                for frag in *expected {
                    if !text.contains(frag) {
                        failures.push(format!("{name}: error {text:?} lacks {frag:?}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failing cases:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn every_problem_is_reported() {
    let text = BASE
        .replacen("port: 5000", "port: 80", 1)
        .replacen("backend_group: g-dns", "backend_group: nope", 1)
        .replacen("weight: 2}", "weight: 999}", 1)
        .replacen("internal_cidr: 10.10.0.0/24", "internal_cidr: 10.10.0.0/40", 1);
    let e = load_str(&text, Format::Yaml).unwrap_err();
    assert_eq!(e.0.len(), 4, "{e}");
}

#[test]
fn json_is_accepted_and_checked() {
    let v: serde_json::Value = serde_yaml::from_str(BASE).unwrap();
    let json = serde_json::to_string(&v).unwrap();
    load_str(&json, Format::Json).unwrap();
    let bad = json.replacen("\"version\":1", "\"version\":1,\"bogus\":true", 1);
    assert!(load_str(&bad, Format::Json).unwrap_err().to_string().contains("unknown field `bogus`"));
}

#[test]
fn the_example_has_no_problem_and_no_warning() {
    let a = accept_str(BASE, Format::Yaml).unwrap_or_else(|e| panic!("examples/state.yaml: {e}"));
    assert!(a.warnings.is_empty(), "examples/state.yaml warns: {:?}", a.warnings);
    let json = serde_json::to_string(&serde_yaml::from_str::<serde_json::Value>(BASE).unwrap()).unwrap();
    let a = accept_str(&json, Format::Json).unwrap_or_else(|e| panic!("examples/state.yaml as JSON: {e}"));
    assert!(a.warnings.is_empty(), "examples/state.yaml as JSON warns: {:?}", a.warnings);
}

#[test]
fn a_burst_below_the_floor_is_a_warning_not_an_error() {
    // 0.1 MB = 104 857 bytes, below two GSO packets.
    let text = BASE.replacen("burst_mb: \"0.2\"", "burst_mb: \"0.1\"", 1);
    let a = accept_str(&text, Format::Yaml).unwrap();
    let w = &a.warnings;
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!(w[0].path, "qos_policies[1].rules[1].burst_mb");
    assert!(w[0].message.contains("raised to the floor"), "{}", w[0].message);
}

/// (case, find, replace, the warning's path; empty = no warning).
const WARNINGS: &[(&str, &str, &str, &str)] = &[
    (
        "an established timeout of seconds",
        "tcp_established_s: 432000",
        "tcp_established_s: 30",
        "agent.conntrack.tcp_established_s",
    ),
    ("an established timeout of a minute", "tcp_established_s: 432000", "tcp_established_s: 60", ""),
    ("a UDP timeout of 3 s", "udp_s: 30", "udp_s: 3", "agent.conntrack.udp_s"),
    ("a UDP timeout of 5 s", "udp_s: 30", "udp_s: 5", ""),
    ("a handshake timeout of 2 s", "udp_s: 30", "udp_s: 30, tcp_new_s: 2", "agent.conntrack.tcp_new_s"),
    ("a UDP stream timeout of 5 s", "udp_s: 30", "udp_s: 30, udp_stream_s: 5", "agent.conntrack.udp_stream_s"),
    ("an ICMP timeout of 1 s", "udp_s: 30", "udp_s: 30, icmp_s: 1", "agent.conntrack.icmp_s"),
    ("a tunnel timeout of 10 s", "udp_s: 30", "udp_s: 30, other_s: 10", "agent.conntrack.other_s"),
    ("a closing timeout of 1 s", "udp_s: 30", "udp_s: 30, tcp_closing_s: 1", ""),
    ("a proxy client timeout of 2 s", "client: 30", "client: 2", "load_balancers[0].listeners[3].timeouts.client"),
    ("a proxy server timeout of 1 s", "server: 45", "server: 1", "load_balancers[0].listeners[3].timeouts.server"),
    ("a proxy client timeout of 5 s", "client: 30", "client: 5", ""),
    ("a proxy connect timeout of 1 s", "connect: 3", "connect: 1", ""),
];

#[test]
fn timeouts_too_short_to_be_meant_are_warned_about_with_their_path() {
    let mut failures = Vec::new();
    for (name, find, replace, path) in WARNINGS {
        assert!(BASE.contains(find), "case {name}: {find:?} not in the example");
        let a = match accept_str(&BASE.replacen(find, replace, 1), Format::Yaml) {
            Ok(a) => a,
            Err(e) => {
                failures.push(format!("{name}: refused: {e}"));
                continue;
            }
        };
        let paths: Vec<&str> = a.warnings.iter().map(|w| w.path.as_str()).collect();
        let want: Vec<&str> = if path.is_empty() { vec![] } else { vec![*path] };
        if paths != want {
            failures.push(format!("{name}: warnings {:?}, expected at {want:?}", a.warnings));
        }
    }
    assert!(failures.is_empty(), "{} failing cases:\n{}", failures.len(), failures.join("\n"));
}

/// A load balancer numbered `i` (its own id, subnet and MAC) with these
/// listener and group lists.
fn lb(i: usize, listeners: &str, groups: &str) -> String {
    let (a, b) = (100 + i / 250, i % 250);
    format!(
        "  - id: {i:06}-limits-lb\n    network: {{ip: 10.{a}.{b}.5, mac: \"02:00:00:{a:02x}:{b:02x}:05\", prefix_len: 24, \
         gateway: 10.{a}.{b}.1}}\n    listeners: [{listeners}]\n    backend_groups: [{groups}]\n"
    )
}

/// `n` backends `b<k>` (addresses outside every test subnet).
fn backends(n: usize, weight: u32) -> String {
    (0..n)
        .map(|k| format!("{{id: b{k}, address: 10.99.{}.{}, port: 80, weight: {weight}}}", k / 250, k % 250 + 2))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `n` direct tcp listeners on ports 1… over group `g`.
fn listeners(n: usize, extra: &str) -> String {
    (0..n)
        .map(|k| format!("{{id: l{k}, type: tcp, port: {}, backend_group: g{extra}}}", k + 1))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A gateway numbered `i` with `n` EIPs (`e<k>`, on `100.<64+i>.0.0/16`) and these rule lists.
fn gw(i: usize, n: usize, qos: &str, rules: &str) -> String {
    let eips: Vec<String> =
        (0..n).map(|k| format!("{{name: e{k}, ip: 100.{}.{}.{}{qos}}}", 64 + i, k / 250, k % 250 + 2)).collect();
    format!(
        "  - name: g{i}\n    lan: {{ip: 10.{i}.0.254, prefix_len: 24, mac: \"02:00:00:00:{i:02x}:fe\", gateway: 10.{i}.0.1}}\n    \
         external: {{bridge: br-ext, prefix_len: 16, gateway: 100.{}.0.1}}\n    eips: [{}]\n{rules}",
        64 + i,
        eips.join(", ")
    )
}

/// A document of these lists (each a block sequence's lines, or empty).
fn doc(lbs: &str, gws: &str, policies: &str) -> String {
    let section = |name: &str, items: &str| {
        if items.is_empty() { format!("{name}: []\n") } else { format!("{name}:\n{items}") }
    };
    format!(
        "version: 1\n{}{}{}",
        section("load_balancers", lbs),
        section("nat_gateways", gws),
        section("qos_policies", policies)
    )
}

fn list(n: usize, item: impl Fn(usize) -> String) -> String {
    (0..n).map(item).collect::<Vec<_>>().join(", ")
}

const ONE_GROUP: &str = "{id: g, backends: [{id: b, address: 10.99.0.2, port: 80}]}";

#[test]
fn per_object_limits_are_refused_at_their_list_and_the_limit_itself_accepted() {
    use lbagent::state::limits::*;
    type Doc = Box<dyn Fn(usize) -> String>;
    let cases: Vec<(&str, usize, &str, Doc)> = vec![
        (
            "listeners",
            MAX_LISTENERS_PER_LB,
            "load_balancers[0].listeners",
            Box::new(|n| doc(&lb(0, &listeners(n, ""), ONE_GROUP), "", "")),
        ),
        (
            "groups",
            MAX_GROUPS_PER_LB,
            "load_balancers[0].backend_groups",
            Box::new(|n| doc(&lb(0, "", &list(n, |k| format!("{{id: g{k}}}"))), "", "")),
        ),
        (
            "backends of a group",
            MAX_BACKENDS_PER_GROUP,
            "load_balancers[0].backend_groups[0].backends",
            Box::new(|n| doc(&lb(0, "", &format!("{{id: g, backends: [{}]}}", backends(n, 1))), "", "")),
        ),
        (
            "backends of a load balancer",
            MAX_BACKENDS_PER_LB,
            "load_balancers[0].backend_groups",
            Box::new(|n| {
                let per = MAX_BACKENDS_PER_GROUP;
                let groups = list(n.div_ceil(per), |g| {
                    let k = per.min(n - g * per);
                    let bs =
                        list(k, |j| format!("{{id: b{g}x{j}, address: 10.99.{}.{}, port: 80}}", j / 250, j % 250 + 2));
                    format!("{{id: g{g}, backends: [{bs}]}}")
                });
                doc(&lb(0, "", &groups), "", "")
            }),
        ),
        (
            "ACL prefixes",
            MAX_ACL_CIDRS_PER_LISTENER,
            "load_balancers[0].listeners[0].acl.cidrs",
            Box::new(|n| {
                let cidrs = list(n, |k| format!("10.{}.{}.0/24", k / 256, k % 256));
                let l = format!(
                    "{{id: l, type: tcp, port: 80, backend_group: g, acl: {{action: deny, cidrs: [{cidrs}]}}}}"
                );
                doc(&lb(0, &l, ONE_GROUP), "", "")
            }),
        ),
        (
            "routes",
            MAX_ROUTES_PER_GW,
            "nat_gateways[0].routes",
            Box::new(|n| {
                let routes = list(n, |k| format!("{{cidr: 10.{}.{}.0/24, via: 10.0.0.1}}", 100 + k / 256, k % 256));
                doc("", &gw(0, 1, "", &format!("    routes: [{routes}]\n")), "")
            }),
        ),
        ("EIPs", MAX_EIPS_PER_GW, "nat_gateways[0].eips", Box::new(|n| doc("", &gw(0, n, "", ""), ""))),
        (
            "DNAT entries",
            MAX_DNATS_PER_GW,
            "nat_gateways[0].dnats",
            Box::new(|n| {
                let dnats = list(n, |k| {
                    format!(
                        "{{eip: e0, protocol: tcp, external_port: {}, internal_ip: 10.0.0.9, internal_port: 80}}",
                        k + 1
                    )
                });
                doc("", &gw(0, 1, "", &format!("    dnats: [{dnats}]\n")), "")
            }),
        ),
        (
            "SNAT entries",
            MAX_SNATS_PER_GW,
            "nat_gateways[0].snats",
            Box::new(|n| {
                let snats = list(n, |k| format!("{{eip: e0, internal_cidr: 10.{}.{}.0/24}}", k / 256, k % 256));
                doc("", &gw(0, 1, "", &format!("    snats: [{snats}]\n")), "")
            }),
        ),
        (
            "QoS rules",
            MAX_RULES_PER_QOS_POLICY,
            "qos_policies[0].rules",
            Box::new(|n| {
                let rules = list(n, |k| {
                    format!("{{name: r{k}, direction: ingress, rate_mbps: 1, burst_mb: 1, priority: {k}}}")
                });
                doc("", "", &format!("  - {{name: p, binding: eip, rules: [{rules}]}}\n"))
            }),
        ),
    ];
    let mut failures = Vec::new();
    for (name, max, path, make) in &cases {
        if let Err(e) = load_str(&make(*max), Format::Yaml) {
            failures.push(format!("{name}: {max} refused: {e}"));
        }
        match load_str(&make(max + 1), Format::Yaml) {
            Ok(_) => failures.push(format!("{name}: {} accepted", max + 1)),
            Err(e) => {
                let want = format!("{path}: {} ", max + 1);
                if !e
                    .0
                    .iter()
                    .any(|p| p.to_string().starts_with(&want) && p.message.contains(&format!("more than the {max}")))
                {
                    failures.push(format!("{name}: {e} lacks {want:?}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failing cases:\n{}", failures.len(), failures.join("\n"));
}

/// Problems whose path is `path` and whose message names `map`.
fn over_budget(text: &str, path: &str, map: &str) -> Result<(), String> {
    match load_str(text, Format::Yaml) {
        Ok(_) => Err("accepted".into()),
        Err(e) if e.0.len() == 1 && e.0[0].path == path && e.0[0].message.contains(&format!(" {map} entries")) => {
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn the_host_budget_of_scheduler_tables_is_refused_at_the_load_balancer_that_goes_over() {
    let lbs = |n: usize, disable_last: bool| -> String {
        (0..n)
            .map(|i| {
                let l = lb(i, &listeners(lbagent::state::limits::MAX_LISTENERS_PER_LB, ", scheduler: sch"), ONE_GROUP);
                if disable_last && i == n - 1 {
                    l.replacen("    network:", "    enabled: false\n    network:", 1)
                } else {
                    l
                }
            })
            .collect()
    };
    // 2 048 tables (half of sched_tables' 4 096): 8 load balancers of 256 sch listeners.
    load_str(&doc(&lbs(8, false), "", ""), Format::Yaml).unwrap_or_else(|e| panic!("8 load balancers: {e}"));
    over_budget(&doc(&lbs(9, false), "", ""), "load_balancers[8]", "sched_tables").unwrap();
    // A disabled load balancer runs nothing.
    load_str(&doc(&lbs(9, true), "", ""), Format::Yaml).unwrap_or_else(|e| panic!("9th disabled: {e}"));
}

#[test]
fn the_host_budget_of_qos_buckets_is_refused_at_the_gateway_that_goes_over() {
    let policy = "  - name: p\n    binding: eip\n    shared: true\n    rules:\n      - {name: in, direction: ingress, rate_mbps: 1, burst_mb: 1, priority: 1}\n      - {name: out, direction: egress, rate_mbps: 1, burst_mb: 1, priority: 1}\n";
    // Two buckets per EIP; 8 191 buckets: 4 × 1 024 EIPs is one too many.
    let gws = |last: usize| -> String {
        (0..4).map(|i| gw(i, if i == 3 { last } else { 1024 }, ", qos_policy: p", "")).collect()
    };
    load_str(&doc("", &gws(1023), policy), Format::Yaml).unwrap_or_else(|e| panic!("8 190 buckets: {e}"));
    over_budget(&doc("", &gws(1024), policy), "nat_gateways[3]", "qos_config").unwrap();
}

#[test]
fn one_load_balancer_alone_can_go_over_the_budget_of_backend_slots() {
    // Without a scheduler a backend takes a slot per unit of weight (at
    // most 16): 1 024 backends of weight 16 are 16 384 slots a listener,
    // plus two mapped-port entries per backend; the budget is 131 072 (the
    // table holds 2 097 152, but the agent's memory is sized for this many).
    let make =
        |n: usize| doc(&lb(0, &listeners(n, ""), &format!("{{id: g, backends: [{}]}}", backends(1024, 16))), "", "");
    load_str(&make(7), Format::Yaml).unwrap_or_else(|e| panic!("7 listeners: {e}"));
    over_budget(&make(8), "load_balancers[0]", "dnat_backends").unwrap();
    let e = load_str(&make(8), Format::Yaml).unwrap_err().to_string();
    assert!(e.contains("131072 one host's document may use") && e.contains("agent's memory"), "{e}");
}

#[test]
fn more_rules_on_one_hook_than_the_program_holds_are_refused() {
    let rules: String = (0..9)
        .map(|i| format!("      - {{name: r{i}, direction: egress, rate_mbps: 1, burst_mb: 1, priority: {i}}}\n"))
        .collect();
    let text = BASE.replacen(
        "      - {name: lan-out, direction: egress",
        &format!("{rules}      - {{name: lan-out2, direction: ingress, rate_mbps: 1, burst_mb: 1, priority: 99}}\n      - {{name: lan-out, direction: egress"),
        1,
    );
    let e = load_str(&text, Format::Yaml).unwrap_err().to_string();
    assert!(e.contains("qos_policies[1].rules[8]: more than 8 rules on net1"), "{e}");
}

#[test]
fn wlc_over_more_backends_than_the_program_compares_is_refused() {
    let backends = |n: usize| -> String {
        (0..n).map(|i| format!("{{id: b{i}, address: 10.0.0.{}, port: 80}}", i + 10)).collect::<Vec<_>>().join(", ")
    };
    let doc = |n: usize| {
        format!(
            "version: 1\nload_balancers:\n  - id: abcdefghijklmn\n    network: {{ip: 10.0.0.5, mac: \"02:00:00:00:00:05\", prefix_len: 24, gateway: 10.0.0.1}}\n    listeners: [{{id: l, type: tcp, port: 80, backend_group: g, scheduler: wlc}}]\n    backend_groups: [{{id: g, backends: [{}]}}]\n",
            backends(n)
        )
    };
    let max = lbagent_common::SCHED_LEAST_MAX as usize;
    assert!(load_str(&doc(max), Format::Yaml).is_ok());
    let e = load_str(&doc(max + 1), Format::Yaml).unwrap_err().to_string();
    assert!(e.contains("load_balancers[0].listeners[0].scheduler: wlc compares at most 16 backends"), "{e}");
}
