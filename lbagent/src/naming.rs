//! Names of the kernel objects the agent creates, derived from ids (pure).

/// Network namespace of load balancer `id`.
pub fn lb_netns(id: &str) -> String {
    format!("lb-{id}")
}

fn short(id: &str) -> &str {
    &id[..id.len().min(13)]
}

/// The OVN-side veth pair: `o<id[:13]>0` (in the namespace) / `…1` (host, OVS port).
pub fn lb_ovn_veth(id: &str) -> (String, String) {
    (format!("o{}0", short(id)), format!("o{}1", short(id)))
}

/// The proxy-side veth pair: `h<id[:13]>0` (in the namespace) / `…1` (host).
pub fn lb_host_veth(id: &str) -> (String, String) {
    (format!("h{}0", short(id)), format!("h{}1", short(id)))
}

/// OVN logical port bound by `external_ids:iface-id`.
pub fn lb_iface_id(id: &str) -> String {
    format!("iface/lb/{id}")
}

/// Network namespace of NAT gateway `name`.
pub fn gw_netns(name: &str) -> String {
    format!("natgw-{name}")
}

/// 8 hex digits of FNV-1a of `s`: a short, stable tag for link names.
pub fn short_hash(s: &str) -> String {
    let h = s.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193));
    format!("{h:08x}")
}

/// Zone key of an object in the allocation store.
pub fn lb_zone_key(id: &str) -> String {
    format!("lb/{id}")
}

pub fn gw_zone_key(name: &str) -> String {
    format!("natgw/{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_seed_and_fit_ifnamsiz() {
        let id = "3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60";
        assert_eq!(lb_netns(id), "lb-3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60");
        assert_eq!(lb_ovn_veth(id), ("o3f2a9c1e-7b4d0".into(), "o3f2a9c1e-7b4d1".into()));
        assert_eq!(lb_host_veth(id).0, "h3f2a9c1e-7b4d0");
        assert!(lb_ovn_veth(id).0.len() <= 15);
        assert_eq!(lb_iface_id(id), "iface/lb/3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60");
    }
}
