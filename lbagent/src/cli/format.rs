//! Human and JSON renderings of map entries.

use std::{fmt, net::Ipv4Addr};

use lbagent_common::*;

use crate::proto::Protocol;

pub use crate::dataplane::tables::monotonic_ns;
use serde::Serialize;

/// A protocol number as shown: tcp/udp by [`Protocol`]'s names, icmp, `any`
/// (0), or the number.
pub use crate::proto::proto_name;

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

/// A tuple in JSON.
#[derive(Serialize)]
pub struct TupleJson {
    zone: u16,
    proto: String,
    src: String,
    sport: u16,
    dst: String,
    dport: u16,
}

impl TupleJson {
    pub fn new(t: &Tuple) -> Self {
        TupleJson {
            zone: t.zone,
            proto: proto_name(t.proto),
            src: ip(t.saddr).to_string(),
            sport: t.sport,
            dst: ip(t.daddr).to_string(),
            dport: t.dport,
        }
    }
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
    if f & CT_F_LOGGED != 0 {
        v.push("logged");
    }
    if f & CT_F_LOCAL != 0 {
        v.push("local");
    }
    v.join(",")
}

/// One conntrack entry (a flow's half): `lbagent conntrack list` and
/// `lbagent maps ct`.
#[derive(Serialize)]
pub struct CtRow {
    key: TupleJson,
    xlate: TupleJson,
    state: &'static str,
    flags: String,
    dnat_rule: u32,
    snat_rule: u32,
    idle_s: u64,
    #[serde(skip)]
    line: (String, String),
}

impl CtRow {
    pub fn new(k: &Tuple, e: &CtEntry, now_ns: u64) -> Self {
        CtRow {
            key: TupleJson::new(k),
            xlate: TupleJson::new(&e.xlate),
            state: state_name(e.state),
            flags: ct_flags(e.flags),
            dnat_rule: e.dnat_rule,
            snat_rule: e.snat_rule,
            idle_s: now_ns.saturating_sub(e.last_seen_ns) / 1_000_000_000,
            line: (tuple(k), tuple(&e.xlate)),
        }
    }
}

impl fmt::Display for CtRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "zone {:<3} {:<52} => {:<46} {:<11} {:<17} idle {}s",
            self.key.zone, self.line.0, self.line.1, self.state, self.flags, self.idle_s
        )
    }
}
