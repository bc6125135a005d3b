//! One owner for every derived name (pure): the kernel objects the agent
//! creates (namespaces, links, OVS iface-ids, aliases) and the keys that
//! name objects and rules in the allocation store, reports, status,
//! metrics and logs.

use std::{net::Ipv4Addr, sync::OnceLock};

use crate::proto::Protocol;

static INSTANCE: OnceLock<String> = OnceLock::new();

/// The agent's instance tag (`lbagent run --instance`), set once at start:
/// two agents on one host (the two halves of an HA pair on one test
/// machine) name their namespaces and links apart with it. Empty (the
/// default): the names below. Object and rule keys never carry it: both
/// halves of a pair name the same objects the same.
pub fn set_instance(tag: &str) -> Result<(), String> {
    if tag.len() > MAX_INSTANCE || !tag.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) {
        return Err(format!("instance {tag:?}: at most {MAX_INSTANCE} characters a-z, 0-9"));
    }
    INSTANCE.set(tag.to_string()).map_err(|_| "the instance tag is already set".to_string())
}

/// Longest instance tag.
pub const MAX_INSTANCE: usize = 8;

fn instance() -> &'static str {
    INSTANCE.get().map(String::as_str).unwrap_or("")
}

/// `name`, tagged with `instance` for the hashed link names.
fn tagged(instance: &str, name: &str) -> String {
    if instance.is_empty() { name.to_string() } else { format!("{instance}/{name}") }
}

/// Network namespace of load balancer `id`.
pub fn lb_netns(id: &str) -> String {
    lb_netns_of(instance(), id)
}

/// [`lb_netns`] of the agent with instance tag `instance`.
pub fn lb_netns_of(instance: &str, id: &str) -> String {
    if instance.is_empty() { format!("lb-{id}") } else { format!("{instance}-lb-{id}") }
}

/// `id[:13]`, or with an instance tag the hash of both (link names fit
/// IFNAMSIZ).
fn short(id: &str) -> String {
    match instance() {
        "" => id[..id.len().min(13)].to_string(),
        i => short_hash(&tagged(i, id)),
    }
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
    gw_netns_of(instance(), name)
}

/// [`gw_netns`] of the agent with instance tag `instance`.
pub fn gw_netns_of(instance: &str, name: &str) -> String {
    if instance.is_empty() { format!("natgw-{name}") } else { format!("{instance}-natgw-{name}") }
}

/// A gateway's interface toward the VPC, inside its namespace (the name
/// kube-ovn's gateway pod gives it; state files name it in QoS rules).
pub const GW_LAN_IF: &str = "eth0";

/// A gateway's interface toward the external network, inside its namespace.
pub const GW_EXT_IF: &str = "net1";

/// Host-side ends of a gateway's `eth0` and `net1`: `ngw<hash>l` /
/// `ngw<hash>x`, where `<hash>` is `short_hash(name)` (names fit IFNAMSIZ
/// and depend on nothing but the name, so any agent can find them).
pub fn gw_host_veths(name: &str) -> (String, String) {
    gw_host_veths_of(instance(), name)
}

/// [`gw_host_veths`] of the agent with instance tag `instance`.
pub fn gw_host_veths_of(instance: &str, name: &str) -> (String, String) {
    let h = short_hash(&tagged(instance, name));
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
    let h = short_hash(&tagged(instance(), name));
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
    match instance() {
        "" => format!("lbagent {zone_key}"),
        i => format!("lbagent[{i}] {zone_key}"),
    }
}

/// 8 hex digits of FNV-1a of `s`: a short, stable tag for link names.
pub fn short_hash(s: &str) -> String {
    let h = s.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193));
    format!("{h:08x}")
}

// Object and rule keys: how the allocation store, the apply report, status,
// metrics and logs name an object and each of its rules. Every key of an
// object starts with its zone key and a `/`.

/// Zone key of a load balancer (`lb/<id>`).
pub fn lb_zone_key(id: &str) -> String {
    format!("lb/{id}")
}

/// Zone key of a NAT gateway (`natgw/<name>`).
pub fn gw_zone_key(name: &str) -> String {
    format!("natgw/{name}")
}

/// The object prefix of a rule key (or of a prefix within one object):
/// up to and including its second `/` (`lb/<id>/`, `natgw/<name>/`); the
/// whole key if it has fewer.
pub fn rule_object(key: &str) -> &str {
    match key.match_indices('/').nth(1) {
        Some((i, _)) => &key[..=i],
        None => key,
    }
}

/// Prefix of every rule key of a load balancer.
pub fn lb_rule_prefix(id: &str) -> String {
    format!("{}/", lb_zone_key(id))
}

/// A listener's rule: `lb/<id>/listener/<listener>`.
pub fn lb_listener_key(id: &str, listener: &str) -> String {
    format!("{}listener/{listener}", lb_rule_prefix(id))
}

/// A backend of a load balancer, whatever its group: `lb/<id>/backend/<backend>`.
pub fn lb_backend(id: &str, backend: &str) -> String {
    format!("{}backend/{backend}", lb_rule_prefix(id))
}

/// A backend's mapped-port rule for one protocol: `lb/<id>/backend/<backend>/<tcp|udp>`.
pub fn lb_backend_key(id: &str, backend: &str, proto: Protocol) -> String {
    format!("{}/{proto}", lb_backend(id, backend))
}

/// Prefix of every rule key of a gateway.
pub fn gw_rule_prefix(gw: &str) -> String {
    format!("{}/", gw_zone_key(gw))
}

/// A FIP's DNAT rule: `natgw/<gw>/fip/<eip>`.
pub fn gw_fip_key(gw: &str, eip: Ipv4Addr) -> String {
    format!("{}fip/{eip}", gw_rule_prefix(gw))
}

/// A FIP's SNAT rule: `natgw/<gw>/fip-snat/<internal ip>`.
pub fn gw_fip_snat_key(gw: &str, internal: Ipv4Addr) -> String {
    format!("{}fip-snat/{internal}", gw_rule_prefix(gw))
}

/// A DNAT identity: `natgw/<gw>/dnat/<eip>/<tcp|udp>/<port>`.
pub fn gw_dnat_key(gw: &str, eip: Ipv4Addr, proto: Protocol, port: u16) -> String {
    format!("{}dnat/{eip}/{proto}/{port}", gw_rule_prefix(gw))
}

/// A CIDR SNAT: `natgw/<gw>/snat/<net>/<len>`.
pub fn gw_snat_key(gw: &str, cidr: (Ipv4Addr, u8)) -> String {
    format!("{}snat/{}/{}", gw_rule_prefix(gw), cidr.0, cidr.1)
}

/// What kind of gateway rule `key` names: `fip`, `fip-snat`, `dnat`, `snat`,
/// `qos` (the segment after `natgw/<gw>/`); `None` for any other key.
pub fn gw_rule_kind(key: &str) -> Option<&str> {
    key.strip_prefix("natgw/")?.split('/').nth(1)
}

/// Whether `key` names a CIDR SNAT rule ([`gw_snat_key`]): the rules whose
/// flows share their EIP's port range.
pub fn is_gw_snat_key(key: &str) -> bool {
    gw_rule_kind(key) == Some("snat")
}

/// Whether `key` names a rule of a gateway that translates sources only
/// (CIDR SNAT, a FIP's SNAT): its `refused` are new flows it had no free
/// port for, not an ACL's.
pub fn is_gw_source_rule(key: &str) -> bool {
    matches!(gw_rule_kind(key), Some("snat" | "fip-snat"))
}

/// An EIP as metrics and status name it: `natgw/<gw>/eip/<name>`.
pub fn gw_eip_key(gw: &str, eip: &str) -> String {
    format!("{}eip/{eip}", gw_rule_prefix(gw))
}

/// Prefix of a gateway's QoS bucket keys.
pub fn gw_qos_prefix(gw: &str) -> String {
    format!("{}qos/", gw_rule_prefix(gw))
}

/// A QoS rule instance (bucket): `natgw/<gw>/qos/<eip/<name>|gateway>/<policy>/<rule>`.
pub fn gw_qos_key(gw: &str, target: QosTarget, policy: &str, rule: &str) -> String {
    match target {
        QosTarget::Eip(eip) => format!("{}eip/{eip}/{policy}/{rule}", gw_qos_prefix(gw)),
        QosTarget::Gateway => format!("{}gateway/{policy}/{rule}", gw_qos_prefix(gw)),
    }
}

/// Prefix of every fleet key in etcd (docs/operations.md, *Fleet mode*).
pub const FLEET_PREFIX: &str = "/lbagent/v1/";

/// A host's desired state (the whole document): `/lbagent/v1/desired/<host>`.
pub fn fleet_desired_key(host: &str) -> String {
    format!("{FLEET_PREFIX}desired/{host}")
}

/// A host's status (JSON, written by its agent): `/lbagent/v1/status/<host>`.
pub fn fleet_status_key(host: &str) -> String {
    format!("{FLEET_PREFIX}status/{host}")
}

/// A host's liveness key, bound to its agent's lease: `/lbagent/v1/alive/<host>`.
pub fn fleet_alive_key(host: &str) -> String {
    format!("{FLEET_PREFIX}alive/{host}")
}

/// The etcd user of a host's agent (its client certificate's CN): `lbagent-<host>`.
pub fn fleet_user(host: &str) -> String {
    format!("lbagent-{host}")
}

/// What a QoS rule instance limits.
#[derive(Clone, Copy, Debug)]
pub enum QosTarget<'a> {
    /// One EIP, by name.
    Eip(&'a str),
    /// The whole gateway.
    Gateway,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule_kinds_are_read_back_from_the_keys_this_module_makes() {
        let ip = Ipv4Addr::new(10, 0, 0, 1);
        assert_eq!(gw_rule_kind(&gw_snat_key("g-1", (ip, 24))), Some("snat"));
        assert_eq!(gw_rule_kind(&gw_fip_snat_key("g-1", ip)), Some("fip-snat"));
        assert_eq!(gw_rule_kind(&gw_fip_key("g-1", ip)), Some("fip"));
        assert!(is_gw_snat_key(&gw_snat_key("g", (ip, 32))));
        assert!(!is_gw_snat_key(&gw_fip_snat_key("g", ip)));
        assert!(is_gw_source_rule(&gw_fip_snat_key("g", ip)) && is_gw_source_rule(&gw_snat_key("g", (ip, 8))));
        assert!(!is_gw_source_rule(&gw_fip_key("g", ip)));
        assert_eq!(gw_rule_kind(&lb_rule_prefix("3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60")), None);
        assert!(gw_eip_key("g", "e1").starts_with(&gw_rule_prefix("g")));
    }

    #[test]
    fn names_follow_the_seed_and_fit_ifnamsiz() {
        let id = "3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60";
        assert_eq!(lb_netns(id), "lb-3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60");
        assert_eq!(lb_ovn_veth(id), ("o3f2a9c1e-7b4d0".into(), "o3f2a9c1e-7b4d1".into()));
        assert_eq!(lb_host_veth(id).0, "h3f2a9c1e-7b4d0");
        assert!(lb_ovn_veth(id).0.len() <= 15);
        assert_eq!(lb_iface_id(id), "iface/lb/3f2a9c1e-7b4d-4c55-9a77-1b2c3d4e5f60");
    }

    #[test]
    fn keys_start_with_their_zone_key() {
        let eip = Ipv4Addr::new(198, 51, 100, 10);
        assert_eq!(lb_listener_key("a", "l-web"), "lb/a/listener/l-web");
        assert_eq!(lb_backend_key("a", "b1", Protocol::Udp), "lb/a/backend/b1/udp");
        assert_eq!(gw_fip_key("g", eip), "natgw/g/fip/198.51.100.10");
        assert_eq!(gw_fip_snat_key("g", eip), "natgw/g/fip-snat/198.51.100.10");
        assert_eq!(gw_dnat_key("g", eip, Protocol::Tcp, 2222), "natgw/g/dnat/198.51.100.10/tcp/2222");
        assert_eq!(gw_snat_key("g", (Ipv4Addr::new(10, 0, 0, 0), 24)), "natgw/g/snat/10.0.0.0/24");
        assert_eq!(gw_qos_key("g", QosTarget::Eip("e1"), "p", "in"), "natgw/g/qos/eip/e1/p/in");
        assert_eq!(gw_qos_key("g", QosTarget::Gateway, "p", "in"), "natgw/g/qos/gateway/p/in");
        for k in [lb_listener_key("a", "l"), lb_backend_key("a", "b", Protocol::Tcp)] {
            assert!(k.starts_with(&lb_rule_prefix("a")) && k.starts_with(&lb_zone_key("a")));
        }
        for k in [gw_fip_key("g", eip), gw_qos_key("g", QosTarget::Gateway, "p", "r")] {
            assert!(k.starts_with(&gw_rule_prefix("g")) && k.starts_with(&gw_zone_key("g")));
        }
        assert!(gw_qos_key("g", QosTarget::Gateway, "p", "r").starts_with(&gw_qos_prefix("g")));
    }
}
