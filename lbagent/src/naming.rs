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

/// Host-side ends of a gateway's `eth0` and `net1`: `ngw<hash>l` /
/// `ngw<hash>x`, where `<hash>` is `short_hash(name)` (names fit IFNAMSIZ
/// and depend on nothing but the name, so any agent can find them).
pub fn gw_host_veths(name: &str) -> (String, String) {
    let h = short_hash(name);
    (format!("ngw{h}l"), format!("ngw{h}x"))
}

/// `external_ids:iface-id` of a gateway's LAN port on the integration bridge.
pub fn gw_lan_iface_id(name: &str) -> String {
    format!("natgw/{name}")
}

/// `external_ids:iface-id` of a gateway's port on an OVS external bridge.
pub fn gw_ext_iface_id(name: &str) -> String {
    format!("natgw/{name}/external")
}

/// Temporary peer names used while a gateway's `eth0`/`net1` are created in
/// the host (those names may exist there): `ngw<hash>lp` / `ngw<hash>xp`.
pub fn gw_tmp_peers(name: &str) -> (String, String) {
    let h = short_hash(name);
    (format!("ngw{h}lp"), format!("ngw{h}xp"))
}

/// haproxy frontend/backend name of a proxy-mode listener:
/// `lb<short_hash(lb id)>_<listener id>`.
pub fn haproxy_proxy(lb_id: &str, listener_id: &str) -> String {
    format!("lb{}_{listener_id}", short_hash(lb_id))
}

/// Alias (IFLA_IFALIAS) the agent writes on every host-side link it creates:
/// the proof of ownership checked before it deletes a link of that name.
pub fn link_owner_alias(zone_key: &str) -> String {
    format!("lbagent {zone_key}")
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
