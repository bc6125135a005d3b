//! Human and JSON renderings of map entries.

use std::net::Ipv4Addr;

use lbagent_common::*;

use crate::proto::Protocol;

pub use crate::dataplane::tables::monotonic_ns;
use serde_json::{Value, json};

/// A protocol number as shown: tcp/udp by [`Protocol`]'s names, icmp, `any`
/// (0), or the number.
pub fn proto_name(p: u8) -> String {
    match (p, Protocol::from_number(p)) {
        (_, Some(known)) => known.name().into(),
        (0, _) => "any".into(),
        (PROTO_ICMP, _) => "icmp".into(),
        (n, _) => n.to_string(),
    }
}

pub fn proto_number(s: &str) -> Option<u8> {
    if let Some(p) = Protocol::ALL.into_iter().find(|p| p.name() == s) {
        return Some(p.number());
    }
    match s {
        "icmp" => Some(PROTO_ICMP),
        "any" => Some(0),
        n => n.parse().ok(),
    }
}

pub fn ip(a: [u8; 4]) -> Ipv4Addr {
    Ipv4Addr::from(a)
}

/// `tcp 10.0.0.1:1234 -> 10.0.0.2:80`
pub fn tuple(t: &Tuple) -> String {
    format!("{} {}:{} -> {}:{}", proto_name(t.proto), ip(t.saddr), t.sport, ip(t.daddr), t.dport)
}

pub fn tuple_json(t: &Tuple) -> Value {
    json!({"zone": t.zone, "proto": proto_name(t.proto), "src": ip(t.saddr).to_string(), "sport": t.sport,
           "dst": ip(t.daddr).to_string(), "dport": t.dport})
}

pub fn state_name(s: u8) -> &'static str {
    match s {
        CT_NEW => "new",
        CT_REPLIED => "replied",
        CT_ESTABLISHED => "established",
        CT_CLOSING => "closing",
        _ => "?",
    }
}

pub fn ct_flags(f: u8) -> String {
    let mut v = vec![if f & CT_F_REPLY != 0 { "reply" } else { "original" }];
    if f & CT_F_SNAT != 0 {
        v.push("snat");
    }
    if f & CT_F_DNAT != 0 {
        v.push("dnat");
    }
    if f & CT_F_FIN != 0 {
        v.push("fin");
    }
    if f & CT_F_SEQ != 0 {
        v.push("seq");
    }
    if f & CT_F_LOCAL != 0 {
        v.push("local");
    }
    v.join(",")
}

pub fn ct_line(k: &Tuple, e: &CtEntry, now_ns: u64) -> String {
    format!(
        "zone {:<3} {:<52} => {:<46} {:<11} {:<17} idle {}s",
        k.zone,
        tuple(k),
        tuple(&e.xlate),
        state_name(e.state),
        ct_flags(e.flags),
        now_ns.saturating_sub(e.last_seen_ns) / 1_000_000_000
    )
}

pub fn ct_json(k: &Tuple, e: &CtEntry, now_ns: u64) -> Value {
    json!({"key": tuple_json(k), "xlate": tuple_json(&e.xlate), "state": state_name(e.state),
           "flags": ct_flags(e.flags), "dnat_rule": e.dnat_rule, "snat_rule": e.snat_rule,
           "idle_s": now_ns.saturating_sub(e.last_seen_ns) / 1_000_000_000})
}
