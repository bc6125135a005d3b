//! A load balancer under real OVN (single chassis, br-int on the netdev
//! datapath): its `o…1` port binds to the logical switch port
//! `iface/lb/<id>` by iface-id, and a client on the same logical switch
//! reaches the VIP through OVN.

use std::{cell::RefCell, net::SocketAddr, time::Duration};

use lbagent::naming;
use lbagent_tests::{
    bed::{Bed, HostLock, lb_id},
    hosts::TestHost,
    net::sh,
    ovn::{self, LogicalSwitch},
    ovs::OvsPort,
    require_root,
    traffic::*,
    unique,
};

#[test]
fn lb_port_binds_by_iface_id_and_serves_through_ovn() {
    if !require_root() {
        return;
    }
    let _lock = HostLock::take().unwrap();
    ovn::ensure_running().unwrap();
    let id = lb_id();
    let ls = LogicalSwitch::new(&unique("ls")).unwrap();
    let lb_port = naming::lb_iface_id(&id);
    ls.add_port(&lb_port, "02:00:0a:28:00:05", "10.40.0.5").unwrap();
    let (client_lsp, backend_lsp) = (unique("lspc"), unique("lspb"));
    ls.add_port(&client_lsp, "02:00:0a:28:00:0a", "10.40.0.10").unwrap();
    ls.add_port(&backend_lsp, "02:00:0a:28:00:15", "10.40.0.21").unwrap();

    // Client and backend plug into br-int with their logical port's iface-id.
    let ports = RefCell::new(Vec::new());
    let plug = |lsp: String| {
        let ports = &ports;
        move |p: &str| {
            ports.borrow_mut().push(OvsPort(p.to_string()));
            let ext = format!("external_ids:iface-id={lsp}");
            sh(&["ovs-vsctl", "--timeout=10", "add-port", "br-int", p, "--", "set", "Interface", p, &ext]).map(|_| ())
        }
    };
    let client = TestHost::on(plug(client_lsp.clone()), "10.40.0.10", 24, "").unwrap();
    client.set_mac("02:00:0a:28:00:0a").unwrap();
    let backend = TestHost::on(plug(backend_lsp.clone()), "10.40.0.21", 24, "").unwrap();
    backend.set_mac("02:00:0a:28:00:15").unwrap();
    line_echo_server(&backend.ns.name, 9000, "b").unwrap();
    http_server(&backend.ns.name, 8080, "b").unwrap();

    let mut bed = Bed::new().unwrap();
    bed.apply(&format!(
        "version: 1
agent: {{integration_bridge: br-int}}
load_balancers:
  - id: {id}
    network: {{ip: 10.40.0.5, mac: \"02:00:0a:28:00:05\", prefix_len: 24, gateway: 10.40.0.1}}
    listeners:
      - {{id: raw, type: tcp, port: 9000, backend_group: g}}
      - {{id: web, type: http, port: 80, backend_group: h}}
    backend_groups:
      - {{id: g, backends: [{{id: b, address: 10.40.0.21, port: 9000}}]}}
      - {{id: h, backends: [{{id: bh, address: 10.40.0.21, port: 8080}}]}}
"
    ));

    lbagent_tests::net::dataplane_offloads_all(&naming::lb_netns(&id)).unwrap();

    // ovn-controller binds the agent's port to this chassis.
    let mut bound = String::new();
    for _ in 0..100 {
        bound = LogicalSwitch::binding(&lb_port);
        if !bound.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!bound.is_empty(), "{lb_port} not bound");
    for lsp in [&client_lsp, &backend_lsp] {
        assert!(!LogicalSwitch::binding(lsp).is_empty(), "{lsp} not bound");
    }

    // Through OVN: client → VIP (direct and proxy paths) → backend, which sees the VIP.
    let to = |port| SocketAddr::from(([10, 40, 0, 5], port));
    let answer = ask_tcp(&client.ns.name, to(9000)).unwrap();
    assert!(answer.starts_with("b 10.40.0.5:"), "{answer}");
    let body = http_get(&client.ns.name, to(80)).unwrap();
    assert!(body.starts_with("b 10.40.0.5:"), "{body}");
    drop(bed);
    assert!(
        LogicalSwitch::binding(&lb_port).is_empty()
            || !sh(&["ovs-vsctl", "--timeout=10", "show"]).unwrap().contains(&naming::lb_ovn_veth(&id).1)
    );
}
