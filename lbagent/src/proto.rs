//! The L4 protocols rules name: one type with its number (what the maps
//! hold) and its name (what the state file, keys and status say).

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub const ALL: [Protocol; 2] = [Protocol::Tcp, Protocol::Udp];

    /// The IP protocol number (what the maps hold).
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => lbagent_common::PROTO_TCP,
            Protocol::Udp => lbagent_common::PROTO_UDP,
        }
    }

    /// The name, as in the state file and in keys.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }

    pub fn from_number(n: u8) -> Option<Protocol> {
        Protocol::ALL.into_iter().find(|p| p.number() == n)
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Any IP protocol number as shown: `tcp`, `udp`, `icmp`, `any` for 0,
/// else the number.
pub fn proto_name(p: u8) -> String {
    match (p, Protocol::from_number(p)) {
        (_, Some(known)) => known.name().into(),
        (0, _) => "any".into(),
        (lbagent_common::PROTO_ICMP, _) => "icmp".into(),
        (n, _) => n.to_string(),
    }
}
