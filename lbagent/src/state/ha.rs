//! `agent.ha`: checked once into [`HaSpec`], the form the pair's sync
//! (`crate::ha`) runs from.

use std::{net::SocketAddr, time::Duration};

use super::{Problem, model::HaPair};

/// This host's side of an active/standby pair.
#[derive(Clone, PartialEq, Eq)]
pub struct HaSpec {
    pub listen: SocketAddr,
    pub peer: SocketAddr,
    /// The sync link's key (HMAC-SHA256), 16 to 64 bytes.
    pub secret: Vec<u8>,
    pub bulk_every: Duration,
}

impl std::fmt::Debug for HaSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HaSpec")
            .field("listen", &self.listen)
            .field("peer", &self.peer)
            .field("secret", &"<hidden>")
            .field("bulk_every", &self.bulk_every)
            .finish()
    }
}

pub const DEFAULT_BULK_EVERY_S: u32 = 10;
pub const MAX_BULK_EVERY_S: u32 = 3600;
pub const MIN_SECRET_BYTES: usize = 16;
pub const MAX_SECRET_BYTES: usize = 64;

/// Checks `h` (at `agent.ha`).
pub fn check(h: &HaPair) -> (Option<HaSpec>, Vec<Problem>) {
    let mut problems = Vec::new();
    let mut err = |path: &str, message: String| problems.push(Problem { path: format!("agent.ha.{path}"), message });
    let mut address = |field: &str, text: &str| match text.parse::<SocketAddr>() {
        Ok(a) if a.port() == 0 => {
            err(field, format!("{text:?}: port 0"));
            None
        }
        Ok(a) if a.ip().is_multicast() || a.ip() == std::net::Ipv4Addr::BROADCAST => {
            err(field, format!("{text:?} is not a host's address"));
            None
        }
        Ok(a) => Some(a),
        Err(_) => {
            err(field, format!("{text:?} is not address:port (192.0.2.1:7946, [2001:db8::1]:7946)"));
            None
        }
    };
    let listen = address("listen", &h.listen);
    let peer = address("peer", &h.peer);
    let mut err = |path: &str, message: String| problems.push(Problem { path: format!("agent.ha.{path}"), message });
    if let Some(p) = peer
        && p.ip().is_unspecified()
    {
        err("peer", format!("{:?}: the peer needs a real address", h.peer));
    }
    if let (Some(l), Some(p)) = (listen, peer) {
        if l == p {
            err("peer", format!("{:?} is this host's own listen address", h.peer));
        }
        // Datagrams are taken only from `peer`, and answered from
        // `listen`: both need one real address of one family.
        if l.ip().is_unspecified() {
            err("listen", format!("{:?}: name this host's address on the sync link, not a wildcard", h.listen));
        } else if l.is_ipv4() != p.is_ipv4() {
            err("listen", format!("{:?} and peer {:?} are of two address families", h.listen, h.peer));
        }
    }
    let secret = hex(&h.secret);
    match &secret {
        None => err("secret", "not hex digits (0-9, a-f; two per byte)".into()),
        Some(s) if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&s.len()) => err(
            "secret",
            format!(
                "{} bytes: {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} (32 to 128 hex digits; `openssl rand -hex 32`)",
                s.len()
            ),
        ),
        Some(_) => {}
    }
    let bulk = h.bulk_every_s.unwrap_or(DEFAULT_BULK_EVERY_S);
    if !(1..=MAX_BULK_EVERY_S).contains(&bulk) {
        err("bulk_every_s", format!("{bulk} is out of range (1-{MAX_BULK_EVERY_S} seconds)"));
    }
    if !problems.is_empty() {
        return (None, problems);
    }
    let spec = HaSpec {
        listen: listen.unwrap(),
        peer: peer.unwrap(),
        secret: secret.unwrap(),
        bulk_every: Duration::from_secs(bulk.into()),
    };
    (Some(spec), problems)
}

fn hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(listen: &str, peer: &str, secret: &str) -> HaPair {
        HaPair { listen: listen.into(), peer: peer.into(), secret: secret.into(), bulk_every_s: None }
    }

    #[test]
    fn a_good_pair_and_every_bad_field_named() {
        let key = "00112233445566778899aabbccddeeff";
        let (spec, problems) = check(&pair("192.0.2.1:7946", "192.0.2.2:7946", key));
        assert!(problems.is_empty(), "{problems:?}");
        let spec = spec.unwrap();
        assert_eq!(spec.secret.len(), 16);
        assert_eq!(spec.bulk_every, Duration::from_secs(10));
        assert!(!format!("{spec:?}").contains("0011"), "the secret is never printed");
        let paths = |h: &HaPair| check(h).1.into_iter().map(|p| p.path).collect::<Vec<_>>();
        assert_eq!(paths(&pair("192.0.2.1", "192.0.2.2:7946", key)), ["agent.ha.listen"]);
        assert_eq!(paths(&pair("192.0.2.1:7946", "0.0.0.0:7946", key)), ["agent.ha.peer"]);
        assert_eq!(paths(&pair("192.0.2.1:7946", "192.0.2.1:7946", key)), ["agent.ha.peer"]);
        assert_eq!(paths(&pair("0.0.0.0:7946", "192.0.2.2:7946", key)), ["agent.ha.listen"]);
        assert_eq!(paths(&pair("[2001:db8::1]:7946", "192.0.2.2:7946", key)), ["agent.ha.listen"]);
        assert_eq!(paths(&pair("192.0.2.1:7946", "192.0.2.2:7946", "0011")), ["agent.ha.secret"]);
        assert_eq!(
            paths(&pair("192.0.2.1:7946", "192.0.2.2:7946", "zz112233445566778899aabbccddeeff")),
            ["agent.ha.secret"]
        );
        let mut slow = pair("192.0.2.1:7946", "192.0.2.2:7946", key);
        slow.bulk_every_s = Some(0);
        assert_eq!(paths(&slow), ["agent.ha.bulk_every_s"]);
    }

    #[test]
    fn a_pair_with_load_balancers_is_refused() {
        let doc = "version: 1\nagent:\n  ha: {listen: \"192.0.2.1:7946\", peer: \"192.0.2.2:7946\", secret: \"00112233445566778899aabbccddeeff\"}\nload_balancers:\n  - id: a\n    network: {ip: 10.0.0.5, prefix_len: 24, mac: \"02:00:00:00:00:05\", gateway: 10.0.0.1}\n    listeners: []\n    backend_groups: []\n";
        let problems = match crate::state::accept_str(doc, crate::state::Format::Yaml) {
            Ok(_) => vec![],
            Err(p) => p.0,
        };
        assert!(
            problems.iter().any(|p| p.path == "agent.ha" && p.message.contains("NAT gateways only")),
            "{problems:?}"
        );
    }
}
