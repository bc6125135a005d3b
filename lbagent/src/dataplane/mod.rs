//! The kernel-facing layer: eBPF object, pins, load, attach, maps.
//!
//! One program instance is loaded per *zone* (network namespace) with the zone
//! as a constant; all instances share the pinned maps under
//! `<bpffs>/v<LAYOUT_VERSION>/`.

pub mod attach;
pub mod ct_gc;
pub mod engine;
pub mod loader;
pub mod logs;
pub mod migrate;
pub mod pins;
pub mod qos;
pub mod sync;
pub mod tables;

/// The eBPF object, embedded at build time.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lbagent-ebpf.o"));

/// Name of the TC program in the object (clsact ingress).
pub const PROGRAM: &str = "lbagent_nat";
/// Name of its companion at clsact egress (ICMP errors the namespace generates).
pub const PROGRAM_EGRESS: &str = "lbagent_nat_egress";
/// The proxy guard, at clsact egress of a load balancer's host-side link.
pub const PROGRAM_PROXY_GUARD: &str = "lbagent_proxy_guard";

/// Conntrack garbage collection, run by the agent on batches of keys
/// (never attached).
pub const PROGRAM_CT_GC: &str = "lbagent_ct_gc";

/// Default bpffs directory for lbagent's pins.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/lbagent";

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use aya_obj::{Object, maps::PinningType};
    use lbagent_common::{ALL_MAPS, MapInfo};

    /// The static check of the map definitions: every map the compiled
    /// object pins by name is one of `ALL_MAPS`, with the same kind, key
    /// and value sizes, declared size and flags (`BPF_F_NO_PREALLOC`: a
    /// table that lost it would preallocate millions of elements); and
    /// every definition is in the object.
    #[test]
    fn the_object_declares_exactly_these_maps() {
        let obj = Object::parse(super::OBJECT).expect("the embedded object parses");
        let pinned: BTreeMap<&str, MapInfo> = obj
            .maps
            .iter()
            .filter(|(_, m)| m.pinning() == PinningType::ByName)
            .map(|(name, m)| {
                let def = ALL_MAPS.iter().find(|d| d.name == name.as_str());
                let def = def.unwrap_or_else(|| panic!("the object pins {name}, which has no definition"));
                let seen = MapInfo {
                    name: def.name,
                    kind: def.kind,
                    key_size: m.key_size(),
                    value_size: m.value_size(),
                    max_entries: m.max_entries(),
                    flags: m.map_flags(),
                };
                assert_eq!(m.map_type(), def.kind.map_type(), "{name}: kind {:?}", def.kind);
                assert_eq!(seen, *def, "{name}: the object's sizes differ from its definition");
                (def.name, seen)
            })
            .collect();
        let missing: Vec<&str> = ALL_MAPS.iter().map(|d| d.name).filter(|n| !pinned.contains_key(n)).collect();
        assert!(missing.is_empty(), "defined but not in the object: {missing:?}");
    }
}
