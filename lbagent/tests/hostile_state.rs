//! Hostile state files (issue 9 item 8): injection strings, derived-name
//! collisions, address classes and places, routes, torn prefixes and alias
//! bombs — each rejected with the path of the field at fault — and the
//! legitimate edge cases next to them that must still be accepted.
//!
//! Each case edits the valid example (`examples/state.yaml`) with one or
//! more (find, replace) pairs, or replaces the whole text.

use lbagent::state::{Format, load_str};

const BASE: &str = include_str!("../../examples/state.yaml");

/// The l-acl listener's health check, where an HTTP path can be set.
const HC: &str = "health_check: {type: tcp, interval: 5";

fn http_path(path: &str) -> String {
    format!("health_check: {{type: http, path: {path}, interval: 5")
}

/// A second gateway (appended after gw1) with the given name, LAN and EIP.
fn second_gw(name: &str, eip: &str, dnat_target: Option<&str>) -> String {
    let dnat = dnat_target
        .map(|t| {
            format!("\n    dnats: [{{eip: e, protocol: tcp, external_port: 80, internal_ip: {t}, internal_port: 80}}]")
        })
        .unwrap_or_default();
    format!(
        "  - name: {name}\n    lan: {{ip: 10.11.0.254, prefix_len: 24, mac: \"02:00:0a:0b:00:fe\", \
         gateway: 10.11.0.1}}\n    external: {{bridge: br-ext, prefix_len: 24, gateway: 198.51.100.1}}\n    \
         eips: [{{name: e, ip: {eip}}}]{dnat}\n"
    )
}

/// A second load balancer (prepended before the example's) with this id.
fn second_lb(id: &str) -> String {
    format!(
        "load_balancers:\n  - id: {id}\n    network: {{ip: 10.12.0.5, mac: \"02:00:0a:0c:00:05\", prefix_len: 24, \
         gateway: 10.12.0.1}}\n    listeners: [{{id: l, type: http, port: 80, backend_group: g}}]\n    \
         backend_groups: [{{id: g, backends: [{{id: b, address: 10.12.0.9, port: 80}}]}}]\n"
    )
}

/// "Billion laughs": 9 levels of 9 aliases (387 million nodes expanded).
fn alias_bomb() -> String {
    let mut doc = String::from("version: 1\nqos_policies:\n  - name: x\n    binding: eip\n    shared: [&a [x, x, x]");
    for (prev, name) in ["a", "b", "c", "d", "e", "f", "g", "h"].iter().zip(["b", "c", "d", "e", "f", "g", "h", "i"]) {
        doc += &format!(", &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]");
    }
    doc + "]\n"
}

/// The example cut right after `marker` (a torn write's valid prefix).
fn torn_after(marker: &str) -> String {
    let at = BASE.find(marker).unwrap_or_else(|| panic!("{marker:?} not in the example")) + marker.len();
    BASE[..at].to_string()
}

enum Edit {
    /// (find, replace) pairs applied to the example in order.
    Replace(Vec<(String, String)>),
    /// The whole file.
    Text(String),
}

struct Case {
    name: &'static str,
    edit: Edit,
    /// Fragments the error must contain (path first); empty = accepted.
    expect: Vec<&'static str>,
}

fn case(name: &'static str, pairs: &[(&str, &str)], expect: &[&'static str]) -> Case {
    Case {
        name,
        edit: Edit::Replace(pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()),
        expect: expect.to_vec(),
    }
}

fn owned(name: &'static str, pairs: Vec<(&str, String)>, expect: &[&'static str]) -> Case {
    Case {
        name,
        edit: Edit::Replace(pairs.into_iter().map(|(a, b)| (a.to_string(), b)).collect()),
        expect: expect.to_vec(),
    }
}

fn text(name: &'static str, text: String, expect: &[&'static str]) -> Case {
    Case { name, edit: Edit::Text(text), expect: expect.to_vec() }
}

const PATH: &str = "load_balancers[0].listeners[3].health_check.path";

fn hostile() -> Vec<Case> {
    let long_path = format!("/{}", "a".repeat(300));
    vec![
        // haproxy.cfg injection through the health-check path.
        owned("path with a comment", vec![(HC, http_path("\"/x#y\""))], &[PATH, "'#' is not allowed"]),
        owned("path with ${VAR}", vec![(HC, http_path("\"/${HOME}\""))], &[PATH, "'$' is not allowed"]),
        owned("path with a backslash", vec![(HC, http_path("'/a\\x'"))], &[PATH, "'\\\\' is not allowed"]),
        owned("path with a double quote", vec![(HC, http_path("'/a\"b'"))], &[PATH, "'\"' is not allowed"]),
        owned("path with a single quote", vec![(HC, http_path("\"/a'b\""))], &[PATH, "'\\'' is not allowed"]),
        owned("path with a space", vec![(HC, http_path("\"/a b\""))], &[PATH, "' ' is not allowed"]),
        owned(
            "path with a new config line",
            vec![(HC, http_path("\"/a\\n  server evil 192.0.2.66:80\""))],
            &[PATH, "'\\n' is not allowed"],
        ),
        owned("path with a tab", vec![(HC, http_path("\"/a\\tb\""))], &[PATH, "'\\t' is not allowed"]),
        owned("path with an encoding", vec![(HC, http_path("/a%20b"))], &[PATH, "'%' is not allowed"]),
        owned("path too long", vec![(HC, http_path(&long_path))], &[PATH, "at most 256 characters"]),
        owned("relative path", vec![(HC, http_path("healthz"))], &[PATH, "not an absolute URL path"]),
        // Names and ids that reach haproxy, the kernel, OVS or the filesystem.
        case("lb name with a control character", &[("name: web", "name: \"web\\u0007\"")], &["load_balancers[0].name"]),
        case(
            "listener id with a newline",
            &[("id: l-web,", "id: \"l-web\\n  bind :22\",")],
            &["load_balancers[0].listeners[0].id", "only letters"],
        ),
        case("listener id with a comment", &[("id: l-web,", "id: \"l#web\",")], &["load_balancers[0].listeners[0].id"]),
        case(
            "backend id with a keyword",
            &[("{id: b1,", "{id: \"b1 backup\",")],
            &["load_balancers[0].backend_groups[0].backends[0].id"],
        ),
        case("gateway name with a path", &[("name: gw1", "name: ../../etc")], &["nat_gateways[0].name"]),
        case(
            "lb id with a path",
            &[("id: 3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60", "id: ../../../run/netns/x")],
            &["load_balancers[0].id"],
        ),
        case("qos rule name with ${VAR}", &[("{name: in,", "{name: \"${X}\",")], &["qos_policies[0].rules[0].name"]),
        case("bridge name with a slash", &[("bridge: br-ext", "bridge: br/ext")], &["nat_gateways[0].external.bridge"]),
        // Derived names.
        owned(
            "two lb ids with the same first 13 characters",
            vec![("load_balancers:\n", second_lb("3f2a9c1e-7b4d-ffff-0000-000000000000"))],
            &["load_balancers[1].id", "links o3f2a9c1e-7b4d0", "load_balancers[0]"],
        ),
        owned(
            "two lb ids with the same haproxy name hash",
            vec![
                ("load_balancers:\n", second_lb("lb-collide-0671139")),
                ("id: 3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60", "id: lb-collide-1520906".into()),
            ],
            &["load_balancers[1].id", "haproxy names lb495b8414_", "hash collision"],
        ),
        owned(
            "two gateway names with the same link hash",
            vec![
                ("name: gw1", "name: gw-032789".into()),
                ("qos_policies:\n", second_gw("gw-629192", "198.51.100.20", None) + "qos_policies:\n"),
            ],
            &["nat_gateways[1].name", "host links ngw", "hash collision"],
        ),
        owned(
            "one EIP on two gateways",
            vec![("qos_policies:\n", second_gw("gw2", "198.51.100.10", None) + "qos_policies:\n")],
            &["nat_gateways[1].eips[0].ip", "already on another gateway (nat_gateways[0].eips[0].ip)"],
        ),
        owned(
            "DNAT to another gateway's EIP",
            vec![("qos_policies:\n", second_gw("gw2", "198.51.100.20", Some("198.51.100.11")) + "qos_policies:\n")],
            &["nat_gateways[1].dnats[0].internal_ip", "is an EIP (nat_gateways[0].eips[1].ip)"],
        ),
        // Address classes and places: load balancers.
        case(
            "VIP is the network address",
            &[("ip: 10.10.0.5,", "ip: 10.10.0.0,")],
            &["load_balancers[0].network.ip", "network address"],
        ),
        case(
            "VIP is the broadcast address",
            &[("ip: 10.10.0.5,", "ip: 10.10.0.255,")],
            &["load_balancers[0].network.ip", "broadcast address of 10.10.0.0/24"],
        ),
        case(
            "VIP is loopback",
            &[(
                "ip: 10.10.0.5, mac: \"02:00:0a:0a:00:05\", prefix_len: 24, gateway: 10.10.0.1",
                "ip: 127.0.0.5, mac: \"02:00:0a:0a:00:05\", prefix_len: 24, gateway: 127.0.0.1",
            )],
            &["load_balancers[0].network.ip", "loopback"],
        ),
        case(
            "VIP is multicast",
            &[(
                "ip: 10.10.0.5, mac: \"02:00:0a:0a:00:05\", prefix_len: 24, gateway: 10.10.0.1",
                "ip: 224.0.0.5, mac: \"02:00:0a:0a:00:05\", prefix_len: 24, gateway: 224.0.0.1",
            )],
            &["load_balancers[0].network.ip", "multicast"],
        ),
        case(
            "lb gateway is the broadcast address",
            &[(
                "prefix_len: 24, gateway: 10.10.0.1}\n    listeners",
                "prefix_len: 24, gateway: 10.10.0.255}\n    listeners",
            )],
            &["load_balancers[0].network.gateway", "broadcast"],
        ),
        case(
            "backend on loopback",
            &[("address: 10.10.0.11", "address: 127.0.0.1")],
            &["backends[0].address", "loopback"],
        ),
        case(
            "backend on the agent's link-local plumbing",
            &[("address: 10.10.0.11", "address: 169.254.0.100")],
            &["load_balancers[0].backend_groups[0].backends[0].address", "link-local"],
        ),
        case(
            "backend is the VIP",
            &[("address: 10.10.0.11", "address: 10.10.0.5")],
            &["backends[0].address", "own VIP"],
        ),
        case(
            "backend is 0.0.0.0",
            &[("address: 10.10.0.11", "address: 0.0.0.0")],
            &["backends[0].address", "0.0.0.0/8"],
        ),
        case(
            "backend is broadcast",
            &[("address: 10.10.0.11", "address: 255.255.255.255")],
            &["backends[0].address", "the broadcast address"],
        ),
        case(
            "backend is reserved",
            &[("address: 10.10.0.11", "address: 240.0.0.1")],
            &["backends[0].address", "reserved"],
        ),
        case(
            "backend is multicast",
            &[("address: 10.10.0.13", "address: 239.1.1.1")],
            &["backend_groups[1].backends[0].address", "multicast"],
        ),
        // Gateways: EIPs, LAN, targets.
        case(
            "EIP outside the external prefix",
            &[("ip: 198.51.100.10", "ip: 203.0.113.10")],
            &["nat_gateways[0].eips[0].ip", "not in the external prefix 198.51.100.1/24"],
        ),
        case(
            "EIP is the external gateway",
            &[("ip: 198.51.100.10", "ip: 198.51.100.1")],
            &["nat_gateways[0].eips[0].ip", "is the external gateway"],
        ),
        case(
            "EIP is the network address",
            &[("ip: 198.51.100.10", "ip: 198.51.100.0")],
            &["nat_gateways[0].eips[0].ip", "network address"],
        ),
        case(
            "EIP is the broadcast address",
            &[("ip: 198.51.100.10", "ip: 198.51.100.255")],
            &["nat_gateways[0].eips[0].ip", "broadcast"],
        ),
        case(
            "external gateway is loopback",
            &[("gateway: 198.51.100.1}", "gateway: 127.0.0.1}")],
            &["nat_gateways[0].external.gateway", "loopback"],
        ),
        case(
            "LAN IP is the LAN gateway",
            &[("lan: {ip: 10.10.0.254", "lan: {ip: 10.10.0.1")],
            &["nat_gateways[0].lan.ip", "LAN gateway"],
        ),
        case(
            "LAN IP is the network address",
            &[("lan: {ip: 10.10.0.254", "lan: {ip: 10.10.0.0")],
            &["nat_gateways[0].lan.ip", "network address"],
        ),
        case(
            "FIP to the gateway's LAN address",
            &[("internal_ip: 10.10.0.21", "internal_ip: 10.10.0.254")],
            &["nat_gateways[0].fips[0].internal_ip", "gateway's own addresses"],
        ),
        case(
            "FIP to an EIP",
            &[("internal_ip: 10.10.0.21", "internal_ip: 198.51.100.11")],
            &["nat_gateways[0].fips[0].internal_ip", "is an EIP"],
        ),
        case(
            "DNAT to loopback",
            &[("internal_ip: 10.10.0.22", "internal_ip: 127.0.0.1")],
            &["nat_gateways[0].dnats[0].internal_ip", "loopback"],
        ),
        case(
            "DNAT to the external gateway",
            &[("internal_ip: 10.10.0.22", "internal_ip: 198.51.100.1")],
            &["nat_gateways[0].dnats[0].internal_ip", "gateway's own addresses"],
        ),
        case(
            "DNAT to a link-local address",
            &[("internal_ip: 10.10.0.22", "internal_ip: 169.254.169.254")],
            &["nat_gateways[0].dnats[0].internal_ip", "link-local"],
        ),
        case(
            "SNAT of loopback",
            &[("internal_cidr: 10.10.0.0/24", "internal_cidr: 127.0.0.0/8")],
            &["nat_gateways[0].snats[0].internal_cidr", "loopback"],
        ),
        case(
            "SNAT of multicast",
            &[("internal_cidr: 10.10.0.0/24", "internal_cidr: 224.0.0.0/4")],
            &["nat_gateways[0].snats[0].internal_cidr", "multicast"],
        ),
        // Routes.
        case(
            "default route",
            &[("cidr: 10.20.0.0/16", "cidr: 0.0.0.0/0")],
            &["nat_gateways[0].routes[0].cidr", "default route"],
        ),
        case(
            "route via off the LAN",
            &[("via: 10.10.0.1}", "via: 10.99.0.1}")],
            &["nat_gateways[0].routes[0].via", "not on the LAN subnet"],
        ),
        case(
            "route via the gateway itself",
            &[("via: 10.10.0.1}", "via: 10.10.0.254}")],
            &["nat_gateways[0].routes[0].via", "own LAN address"],
        ),
        case(
            "route via the LAN broadcast",
            &[("via: 10.10.0.1}", "via: 10.10.0.255}")],
            &["nat_gateways[0].routes[0].via", "broadcast"],
        ),
        case(
            "route over the LAN prefix",
            &[("cidr: 10.20.0.0/16", "cidr: 10.10.0.0/16")],
            &["nat_gateways[0].routes[0].cidr", "connected LAN prefix"],
        ),
        case(
            "route into the external prefix",
            &[("cidr: 10.20.0.0/16", "cidr: 198.51.100.128/25")],
            &["nat_gateways[0].routes[0].cidr", "connected external prefix"],
        ),
        case(
            "route to loopback",
            &[("cidr: 10.20.0.0/16", "cidr: 127.0.0.0/8")],
            &["nat_gateways[0].routes[0].cidr", "loopback"],
        ),
        case(
            "duplicate route",
            &[(
                "routes: [{cidr: 10.20.0.0/16, via: 10.10.0.1}]",
                "routes: [{cidr: 10.20.0.0/16, via: 10.10.0.1}, {cidr: 10.20.0.0/16, via: 10.10.0.2}]",
            )],
            &["nat_gateways[0].routes[1].cidr", "duplicate route 10.20.0.0/16"],
        ),
        // Torn writes: the prefix an editor's truncate-and-rewrite exposes.
        text(
            "torn inside a flow mapping",
            torn_after("      - {id: l-tcp, type: tcp, port: 5000"),
            &["load_balancers[0].listeners[1]"],
        ),
        text(
            "torn after a load balancer's first lines",
            torn_after("    name: web\n"),
            &["load_balancers[0]", "missing field `network`"],
        ),
        text("torn inside a gateway", torn_after("gateway: 10.10.0.1}\n    external:"), &["nat_gateways[0].external"]),
        text("torn before the version", String::new(), &["missing field `version`"]),
        text("torn mid-key", torn_after("vers"), &["vers"]),
        // Alias expansion.
        text("alias bomb", alias_bomb(), &["qos_policies[0].shared"]),
    ]
}

fn legitimate() -> Vec<Case> {
    vec![
        case("the example", &[], &[]),
        case(
            "a /31 network uses both addresses",
            &[(
                "ip: 10.10.0.5, mac: \"02:00:0a:0a:00:05\", prefix_len: 24, gateway: 10.10.0.1",
                "ip: 10.10.0.4, mac: \"02:00:0a:0a:00:05\", prefix_len: 31, gateway: 10.10.0.5",
            )],
            &[],
        ),
        case("an EIP at the last host address", &[("ip: 198.51.100.10", "ip: 198.51.100.254")], &[]),
        owned("a health path with a query", vec![(HC, http_path("\"/healthz?full=1&probe=lb:1\""))], &[]),
        case("a host route", &[("cidr: 10.20.0.0/16", "cidr: 10.20.0.7/32")], &[]),
        case("a route via another LAN router", &[("via: 10.10.0.1}", "via: 10.10.0.2}")], &[]),
        case("SNAT of everything", &[("internal_cidr: 10.10.0.0/24", "internal_cidr: 0.0.0.0/0")], &[]),
        case("an ACL open to all", &[("cidrs: [10.10.0.0/24, 192.0.2.7]", "cidrs: [0.0.0.0/0]")], &[]),
        case("a backend in a routed subnet", &[("address: 10.10.0.11", "address: 10.20.0.9")], &[]),
        owned(
            "two lb ids that differ at the 13th character",
            vec![("load_balancers:\n", second_lb("3f2a9c1e-7b4e-4c55-9a77-1b2c3d4e5f60"))],
            &[],
        ),
        owned(
            "two gateways with distinct EIPs",
            vec![("qos_policies:\n", second_gw("gw2", "198.51.100.20", Some("10.11.0.9")) + "qos_policies:\n")],
            &[],
        ),
        case("a lb name with spaces and accents", &[("name: web", "name: \"web tier — prod\"")], &[]),
    ]
}

fn run(cases: Vec<Case>) -> Vec<String> {
    let mut failures = Vec::new();
    for c in cases {
        let text = match c.edit {
            Edit::Text(t) => t,
            Edit::Replace(pairs) => pairs.iter().fold(BASE.to_string(), |t, (find, replace)| {
                assert!(t.contains(find.as_str()), "case {}: {find:?} not in the text", c.name);
                t.replacen(find.as_str(), replace, 1)
            }),
        };
        match load_str(&text, Format::Yaml) {
            Ok(_) if c.expect.is_empty() => {}
            Ok(_) => failures.push(format!("{}: accepted, expected {:?}", c.name, c.expect)),
            Err(e) if c.expect.is_empty() => failures.push(format!("{}: rejected: {e}", c.name)),
            Err(e) => {
                let msg = e.to_string();
                for frag in &c.expect {
                    if !msg.contains(frag) {
                        failures.push(format!("{}: error {msg:?} lacks {frag:?}", c.name));
                    }
                }
            }
        }
    }
    failures
}

#[test]
fn hostile_state_files_are_rejected_with_their_path() {
    let cases = hostile();
    assert!(cases.len() >= 40, "only {} hostile cases", cases.len());
    let failures = run(cases);
    assert!(failures.is_empty(), "{} failing cases:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn legitimate_edge_cases_are_accepted() {
    let failures = run(legitimate());
    assert!(failures.is_empty(), "{} failing cases:\n{}", failures.len(), failures.join("\n"));
}
