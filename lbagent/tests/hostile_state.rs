//! Hostile state files: injection strings, derived-name collisions,
//! address classes and places, routes, torn prefixes, alias bombs, names
//! that read as options, numbers not written in decimal, health checks that
//! do not fit their listener, invisible characters, targets nowhere the
//! gateway reaches — each rejected with the path of the field at fault —
//! and the legitimate edge cases next to them that must still be accepted.
//!
//! Each case edits the valid example (`examples/state.yaml`) with one or
//! more (find, replace) pairs, or replaces the whole text.

use lbagent::state::{Format, accept_str, load_file, load_str};

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
            // The parser finds the unclosed mapping while the list asks for
            // its next entry: the list is named, the line is quoted.
            &["load_balancers[0].listeners", "unclosed", "{id: l-tcp, type: tcp, port: 5000"],
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

/// The example's gateway with a fourth EIP (`eip4`, free of rules).
const EIP4: (&str, &str) =
    ("{name: eip3, ip: 198.51.100.12}", "{name: eip3, ip: 198.51.100.12}\n      - {name: eip4, ip: 198.51.100.13}");

/// The example's FIP list.
const FIPS: &str = "fips: [{eip: eip1, internal_ip: 10.10.0.21}]";

/// The example's external side, and one on `10.10.1.0/24` (next to the LAN)
/// with its EIPs moved there.
const EXTERNAL: &str = "external: {bridge: br-ext, prefix_len: 24, gateway: 198.51.100.1}";

fn external_near_lan(prefix_len: u8) -> Vec<(&'static str, String)> {
    vec![
        (EXTERNAL, format!("external: {{bridge: br-ext, prefix_len: {prefix_len}, gateway: 10.10.1.1}}")),
        ("ip: 198.51.100.10", "ip: 10.10.1.10".into()),
        ("ip: 198.51.100.11", "ip: 10.10.1.11".into()),
        ("ip: 198.51.100.12", "ip: 10.10.1.12".into()),
    ]
}

const L_WEB: &str = "{id: l-web, type: http, port: 80, backend_group: g-web}";
const L_DNS: &str = "{id: l-dns, type: udp, port: 53, backend_group: g-dns, scheduler: sch}";
const L_TCP: &str = "{id: l-tcp, type: tcp, port: 5000, backend_group: g-web, scheduler: wrr}";

/// `listener` (one of `L_*`) with `health_check: {check}`.
fn checked(listener: &str, check: &str) -> (&'static str, String) {
    let l: &'static str = [L_WEB, L_DNS, L_TCP].into_iter().find(|l| *l == listener).unwrap();
    (l, format!("{}, health_check: {{{check}}}}}", &l[..l.len() - 1]))
}

/// The classes validation closes beyond injection and address classes:
/// each refused with its path.
fn remaining_classes() -> Vec<Case> {
    const LB_NAME: &str = "load_balancers[0].name";
    const MAC: &str = "\"02:00:0a:0a:00:05\"";
    vec![
        // One internal address, two FIPs: its SNAT could leave from only one EIP.
        case(
            "two FIPs to one internal address",
            &[EIP4, (FIPS, "fips: [{eip: eip1, internal_ip: 10.10.0.21}, {eip: eip4, internal_ip: 10.10.0.21}]")],
            &["nat_gateways[0].fips[1].internal_ip", "already has a floating IP (nat_gateways[0].fips[0])"],
        ),
        case(
            "the external bridge is the integration bridge",
            &[("bridge: br-ext", "bridge: brvpc")],
            &["nat_gateways[0].external.bridge", "is the integration bridge"],
        ),
        owned(
            "an external prefix over the LAN",
            external_near_lan(16),
            &["nat_gateways[0].external.gateway", "external prefix 10.10.0.0/16 overlaps the LAN prefix 10.10.0.0/24"],
        ),
        // Names that a command line would read as an option.
        case(
            "an integration bridge like an option",
            &[("integration_bridge: brvpc", "integration_bridge: \"-brvpc\"")],
            &["agent.integration_bridge", "starts with '-'"],
        ),
        case(
            "an external bridge like an option",
            &[("bridge: br-ext", "bridge: \"--help\"")],
            &["nat_gateways[0].external.bridge", "starts with '-'"],
        ),
        case(
            "a gateway name like an option",
            &[("name: gw1", "name: \"-gw1\"")],
            &["nat_gateways[0].name", "starts with '-'"],
        ),
        case(
            "a load balancer id like an option",
            &[("id: 3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60", "id: \"-3f2a9c1e-7b4d-4c55\"")],
            &["load_balancers[0].id", "starts with '-'"],
        ),
        case(
            "a listener id like an option",
            &[("id: l-web,", "id: \"-l-web\",")],
            &["load_balancers[0].listeners[0].id", "starts with '-'"],
        ),
        case(
            "a backend id like an option",
            &[("{id: b1,", "{id: \"-b1\",")],
            &["load_balancers[0].backend_groups[0].backends[0].id", "starts with '-'"],
        ),
        case(
            "a group id like an option",
            &[("- id: g-dns", "- id: \"-g-dns\""), ("backend_group: g-dns", "backend_group: \"-g-dns\"")],
            &["load_balancers[0].backend_groups[1].id", "starts with '-'"],
        ),
        case(
            "an EIP name like an option",
            &[EIP4, ("{name: eip4,", "{name: \"-eip4\",")],
            &["nat_gateways[0].eips[3].name", "starts with '-'"],
        ),
        case(
            "a QoS policy name like an option",
            &[("- name: gw-qos", "- name: \"-gw-qos\""), ("qos_policy: gw-qos", "qos_policy: \"-gw-qos\"")],
            &["qos_policies[1].name", "starts with '-'"],
        ),
        case(
            "a QoS rule name like an option",
            &[("{name: in,", "{name: \"-in\",")],
            &["qos_policies[0].rules[0].name", "starts with '-'"],
        ),
        // Numbers the docs promise in decimal, in YAML's other spellings.
        case(
            "a port with a sign",
            &[("port: 5000", "port: +5000")],
            &["load_balancers[0].listeners[1].port", "not a plain decimal integer"],
        ),
        case(
            "a port in hex",
            &[("port: 5000", "port: 0x1388")],
            &["load_balancers[0].listeners[1].port", "not a plain decimal integer"],
        ),
        case(
            "a port in octal",
            &[("port: 5000", "port: 0o11610")],
            &["load_balancers[0].listeners[1].port", "not a plain decimal integer"],
        ),
        case(
            "a port in binary",
            &[("port: 5000", "port: 0b1001110001000")],
            &["load_balancers[0].listeners[1].port", "not a plain decimal integer"],
        ),
        case("a port with an exponent", &[("port: 5000", "port: 5e3")], &["load_balancers[0].listeners[1].port"]),
        case(
            "a port with a leading zero",
            &[("port: 5000", "port: 05000")],
            &["load_balancers[0].listeners[1].port", "not a plain decimal integer"],
        ),
        case(
            "a port with a separator",
            &[("port: 5000", "port: 5_000")],
            &["load_balancers[0].listeners[1].port", "not a plain decimal integer"],
        ),
        case(
            "a backend port in hex",
            &[("port: 8080, weight: 1}", "port: 0x1f90, weight: 1}")],
            &["load_balancers[0].backend_groups[0].backends[0].port", "not a plain decimal integer"],
        ),
        case(
            "a DNAT port with a sign",
            &[("external_port: 2222", "external_port: +2222")],
            &["nat_gateways[0].dnats[0].external_port", "not a plain decimal integer"],
        ),
        case(
            "a DNAT internal port in octal",
            &[("internal_port: 22,", "internal_port: 0o26,")],
            &["nat_gateways[0].dnats[0].internal_port", "not a plain decimal integer"],
        ),
        case(
            "a weight with a sign",
            &[("weight: 2}", "weight: +2}")],
            &["load_balancers[0].backend_groups[0].backends[1].weight", "not a plain decimal integer"],
        ),
        case(
            "a prefix length in hex",
            &[(
                "prefix_len: 24, gateway: 10.10.0.1}\n    listeners",
                "prefix_len: 0x18, gateway: 10.10.0.1}\n    listeners",
            )],
            &["load_balancers[0].network.prefix_len", "not a plain decimal integer"],
        ),
        case(
            "a health-check interval in hex",
            &[("interval: 5", "interval: 0x5")],
            &["load_balancers[0].listeners[3].health_check.interval", "not a plain decimal integer"],
        ),
        case(
            "a conntrack timeout in octal",
            &[("udp_s: 30", "udp_s: 0o36")],
            &["agent.conntrack.udp_s", "not a plain decimal integer"],
        ),
        case(
            "a proxy timeout with a sign",
            &[("client: 30", "client: +30")],
            &["load_balancers[0].listeners[3].timeouts.client", "not a plain decimal integer"],
        ),
        case(
            "a QoS priority with a sign",
            &[("burst_mb: 1, priority: 1}", "burst_mb: 1, priority: +1}")],
            &["qos_policies[0].rules[0].priority", "not a plain decimal integer"],
        ),
        case("the version in hex", &[("version: 1", "version: 0x1")], &["version", "not a plain decimal integer"]),
        case(
            "a rate in hex",
            &[("rate_mbps: 10,", "rate_mbps: 0xa,")],
            &["qos_policies[0].rules[0].rate_mbps", "not a non-negative decimal"],
        ),
        case(
            "a rate with a sign",
            &[("rate_mbps: 10,", "rate_mbps: +10,")],
            &["qos_policies[0].rules[0].rate_mbps", "not a non-negative decimal"],
        ),
        case(
            "a rate with an exponent",
            &[("rate_mbps: 10,", "rate_mbps: 1e1,")],
            &["qos_policies[0].rules[0].rate_mbps", "not a non-negative decimal"],
        ),
        case(
            "a rate with a leading zero",
            &[("rate_mbps: 10,", "rate_mbps: 010,")],
            &["qos_policies[0].rules[0].rate_mbps", "not a non-negative decimal"],
        ),
        case(
            "a burst in octal",
            &[("burst_mb: 1,", "burst_mb: 0o1,")],
            &["qos_policies[0].rules[0].burst_mb", "not a non-negative decimal"],
        ),
        case(
            "a MAC octet with a sign",
            &[(MAC, "\"02:00:0a:0a:00:+5\"")],
            &["load_balancers[0].network.mac", "is not a MAC address"],
        ),
        case(
            "a LAN MAC octet with a sign",
            &[("mac: \"02:00:0a:0a:00:fe\"", "mac: \"02:00:0a:0a:+0:fe\"")],
            &["nat_gateways[0].lan.mac", "is not a MAC address"],
        ),
        // Health checks that do not fit their type or their listener.
        case(
            "an expected status on a tcp check",
            &[("timeout: 2}", "timeout: 2, expect_status: 200}")],
            &["load_balancers[0].listeners[3].health_check.expect_status", "only http health checks"],
        ),
        owned(
            "an http check on a udp listener",
            vec![checked(L_DNS, "type: http")],
            &["load_balancers[0].listeners[2].health_check.type", "udp listener"],
        ),
        owned(
            "a tcp check on a udp listener",
            vec![checked(L_DNS, "type: tcp")],
            &["load_balancers[0].listeners[2].health_check.type", "udp listener"],
        ),
        owned(
            "a udp check on a tcp listener",
            vec![checked(L_TCP, "type: udp")],
            &["load_balancers[0].listeners[1].health_check.type", "a udp check cannot probe a tcp listener"],
        ),
        case(
            "a udp check on a proxy listener",
            &[("health_check: {type: tcp,", "health_check: {type: udp,")],
            &["load_balancers[0].listeners[3].health_check.type", "a udp check cannot probe"],
        ),
        owned(
            "an http check on an https listener",
            vec![(
                L_WEB,
                "{id: l-web, type: https, port: 80, backend_group: g-web, health_check: {type: http}}".into(),
            )],
            &["load_balancers[0].listeners[0].health_check.type", "speak TLS"],
        ),
        case(
            "a timeout longer than the interval",
            &[("interval: 5, rise: 2, fall: 3, timeout: 2", "interval: 5, rise: 2, fall: 3, timeout: 6")],
            &["load_balancers[0].listeners[3].health_check.timeout", "6 s is longer than the interval (5 s)"],
        ),
        case(
            "an interval shorter than the default timeout",
            &[("interval: 5, rise: 2, fall: 3, timeout: 2", "interval: 1, rise: 2, fall: 3")],
            &["load_balancers[0].listeners[3].health_check.interval", "shorter than the default timeout (2 s)"],
        ),
        // Invisible and reordering characters in free text.
        case(
            "a name with a right-to-left override",
            &[("name: web", "name: \"web\\u202Eexe.txt\"")],
            &[LB_NAME, "U+202E"],
        ),
        case("a name with a bidi isolate", &[("name: web", "name: \"web\\u2066x\\u2069\"")], &[LB_NAME, "U+2066"]),
        case("a name with a zero-width space", &[("name: web", "name: \"w\\u200Beb\"")], &[LB_NAME, "U+200B"]),
        case("a name with a zero-width joiner", &[("name: web", "name: \"w\\u200Deb\"")], &[LB_NAME, "U+200D"]),
        case("a name with a byte order mark", &[("name: web", "name: \"\\uFEFFweb\"")], &[LB_NAME, "U+FEFF"]),
        case("a name with a soft hyphen", &[("name: web", "name: \"we\\u00ADb\"")], &[LB_NAME, "U+00AD"]),
        case("a name with a tag character", &[("name: web", "name: \"web\\U000E0041\"")], &[LB_NAME, "U+E0041"]),
        case("a name with a line separator", &[("name: web", "name: \"web\\u2028x\"")], &[LB_NAME, "U+2028"]),
        // FIP and DNAT targets the gateway does not reach.
        case(
            "a FIP to an address off the LAN and every route",
            &[("internal_ip: 10.10.0.21", "internal_ip: 10.30.0.21")],
            &[
                "nat_gateways[0].fips[0].internal_ip",
                "neither on the LAN 10.10.0.0/24 nor behind one of the gateway's routes",
            ],
        ),
        case(
            "a DNAT to an external address",
            &[("internal_ip: 10.10.0.22", "internal_ip: 203.0.113.22")],
            &["nat_gateways[0].dnats[0].internal_ip", "neither on the LAN"],
        ),
        case(
            "a DNAT to the LAN broadcast address",
            &[("internal_ip: 10.10.0.22", "internal_ip: 10.10.0.255")],
            &["nat_gateways[0].dnats[0].internal_ip", "broadcast address of 10.10.0.0/24"],
        ),
        case(
            "a DNAT to the LAN network address",
            &[("internal_ip: 10.10.0.22", "internal_ip: 10.10.0.0")],
            &["nat_gateways[0].dnats[0].internal_ip", "network address of 10.10.0.0/24"],
        ),
    ]
}

/// The legitimate neighbour of each class above: accepted.
fn remaining_neighbours() -> Vec<Case> {
    vec![
        case(
            "two FIPs to two internal addresses",
            &[EIP4, (FIPS, "fips: [{eip: eip1, internal_ip: 10.10.0.21}, {eip: eip4, internal_ip: 10.10.0.25}]")],
            &[],
        ),
        case(
            "a FIP and a DNAT to one internal address",
            &[("internal_ip: 10.10.0.22", "internal_ip: 10.10.0.21")],
            &[],
        ),
        case("an external bridge named like the integration bridge", &[("bridge: br-ext", "bridge: brvpc-ext")], &[]),
        owned("an external prefix next to the LAN", external_near_lan(24), &[]),
        case(
            "names with inner and trailing dashes",
            &[("name: gw1", "name: gw-1-"), ("bridge: br-ext", "bridge: br-ext-"), ("{id: b1,", "{id: b-1-,")],
            &[],
        ),
        case(
            "a name with a leading underscore",
            &[("name: gw1", "name: _gw1"), ("integration_bridge: brvpc", "integration_bridge: _brvpc")],
            &[],
        ),
        case("a quoted decimal port", &[("port: 5000", "port: \"5000\"")], &[]),
        case("a zero weight", &[("weight: 2}", "weight: 0}")], &[]),
        case("a rate with decimals", &[("rate_mbps: 10,", "rate_mbps: 10.50,")], &[]),
        case("a rate below one", &[("rate_mbps: 10,", "rate_mbps: 0.25,")], &[]),
        case("a quoted integer rate", &[("rate_mbps: 10,", "rate_mbps: \"10\",")], &[]),
        case("a MAC in capitals", &[("\"02:00:0a:0a:00:05\"", "\"02:00:0A:0A:00:05\"")], &[]),
        case(
            "an expected status on an http check",
            &[(
                "health_check: {type: tcp, interval: 5",
                "health_check: {type: http, expect_status: 204, path: /healthz, interval: 5",
            )],
            &[],
        ),
        owned("a udp check on a udp listener", vec![checked(L_DNS, "type: udp, interval: 2, timeout: 1")], &[]),
        owned("an http check on a direct tcp listener", vec![checked(L_TCP, "type: http, path: /ready")], &[]),
        owned(
            "a tcp check on an https listener",
            vec![(
                L_WEB,
                "{id: l-web, type: https, port: 443, backend_group: g-web, health_check: {type: tcp}}".into(),
            )],
            &[],
        ),
        case(
            "a timeout equal to the interval",
            &[("interval: 5, rise: 2, fall: 3, timeout: 2", "interval: 5, rise: 2, fall: 3, timeout: 5")],
            &[],
        ),
        case(
            "a one-second check",
            &[("interval: 5, rise: 2, fall: 3, timeout: 2", "interval: 1, rise: 1, fall: 1, timeout: 1")],
            &[],
        ),
        case("a name in another script", &[("name: web", "name: \"網站 — ウェブ\"")], &[]),
        case("a name with an emoji", &[("name: web", "name: \"web 🚀\"")], &[]),
        case("a name with right-to-left letters", &[("name: web", "name: \"שרת web\"")], &[]),
        case("a FIP behind a route", &[("internal_ip: 10.10.0.21", "internal_ip: 10.20.0.21")], &[]),
        case("a DNAT behind a route", &[("internal_ip: 10.10.0.22", "internal_ip: 10.20.5.22")], &[]),
        case("a DNAT to the last LAN host", &[("internal_ip: 10.10.0.22", "internal_ip: 10.10.0.253")], &[]),
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
        let from_text = load_str(&text, Format::Yaml);
        // The agent streams a file through the parser instead: the same
        // document gets the same answer.
        static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let file = std::env::temp_dir().join(format!("lbagent-hostile-{}-{n}.yaml", std::process::id()));
        std::fs::write(&file, &text).unwrap();
        let from_file = load_file(&file);
        let _ = std::fs::remove_file(&file);
        match (&from_text, &from_file) {
            (Ok(a), Ok(b)) if a == b => {}
            (Err(a), Err(b)) if a.to_string() == b.to_string() => {}
            _ => failures.push(format!("{}: as text {from_text:?}, as a file {from_file:?}", c.name)),
        }
        match from_text {
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

#[test]
fn remaining_classes_are_refused_with_their_path() {
    let failures = run(remaining_classes());
    assert!(failures.is_empty(), "{} failing cases:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn their_neighbours_are_accepted() {
    let failures = run(remaining_neighbours());
    assert!(failures.is_empty(), "{} failing cases:\n{}", failures.len(), failures.join("\n"));
}

/// A few KB whose aliases stand for 1 000 load balancers of 100 listeners
/// with 100 ACL prefixes each: ten million prefixes, several GB as a
/// `StateFile`, if expanded.
fn typed_alias_bomb() -> String {
    let cidrs = vec!["10.0.0.0/8"; 100].join(", ");
    let listeners = vec!["*l"; 99].join(", ");
    let lbs = vec!["*lb"; 999].join(", ");
    format!(
        "version: 1\nload_balancers: [&lb {{id: abcdefghijklmn, network: {{ip: 10.0.0.5, mac: \"02:00:00:00:00:05\", \
         prefix_len: 24, gateway: 10.0.0.1}}, listeners: [&l {{id: l, type: tcp, port: 80, backend_group: g, acl: \
         {{action: allow, cidrs: [{cidrs}]}}}}, {listeners}], backend_groups: [{{id: g, backends: [{{id: b, \
         address: 10.0.0.9, port: 80}}]}}]}}, {lbs}]\n"
    )
}

/// The process's peak resident memory in KiB (`VmHWM`).
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM in /proc/self/status");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn an_alias_bomb_on_typed_fields_is_refused_quickly_in_bounded_memory() {
    let doc = typed_alias_bomb();
    assert!(doc.len() < 8 * 1024, "{} bytes", doc.len());
    // Start the peak at the current resident size ("5": reset VmHWM).
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting the peak RSS (Linux 4.0 and later)");
    let before = peak_rss_kib();
    let started = std::time::Instant::now();
    let err = load_str(&doc, Format::Yaml).unwrap_err().to_string();
    let took = started.elapsed();
    let grew_mib = peak_rss_kib().saturating_sub(before) / 1024;
    assert!(err.contains("load_balancers["), "{err}");
    assert!(err.contains("through YAML aliases"), "{err}");
    assert!(took < std::time::Duration::from_secs(2), "took {took:?}");
    assert!(grew_mib < 64, "peak RSS grew by {grew_mib} MiB");
}

#[test]
fn a_health_check_shared_through_an_alias_is_accepted() {
    let text = BASE
        .replacen(
            L_TCP,
            "{id: l-tcp, type: tcp, port: 5000, backend_group: g-web, scheduler: wrr, health_check: &check {type: \
             tcp, interval: 4, timeout: 1}}",
            1,
        )
        .replacen("health_check: {type: tcp, interval: 5, rise: 2, fall: 3, timeout: 2}", "health_check: *check", 1);
    let a = accept_str(&text, Format::Yaml).unwrap_or_else(|e| panic!("{e}"));
    let lb = a.desired.lbs.values().next().unwrap();
    let acl = lb.listeners.iter().find(|l| l.id == "l-acl").unwrap();
    assert_eq!(acl.health.as_ref().map(|h| (h.interval_s, h.timeout_s)), Some((4, 1)));
}
