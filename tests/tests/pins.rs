//! Pins: typed BTF dumps through bpftool, refusal of incompatible pins, and
//! reuse of conntrack across a program reload (agent restart).

use lbagent::dataplane::{
    loader::{CtSizes, SizeOrigin, ZoneProgram},
    pins,
};
use lbagent_common::*;
use lbagent_tests::{
    engine::{TC_ACT_OK, TestPins, TestZone},
    net::sh,
    packet::{self, Ip, L4, frame},
    require_root,
};

fn udp(sport: u16, dport: u16) -> L4 {
    L4::Udp { sport, dport, payload: b"pin".to_vec(), zero_csum: false }
}

fn engine_with_flow() -> TestZone {
    TestZone::with_dns_rule(3, 1).unwrap()
}

#[test]
fn bpftool_dumps_named_fields() {
    if !require_root() {
        return;
    }
    let mut e = engine_with_flow();
    let (rc, _) = e.run(&frame(&Ip::new([10, 0, 1, 2], [198, 51, 100, 10]), &udp(1234, 53))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    let dir = pins::versioned_dir(&e.pins.root);
    // A new flow is in ct_new (it moves to ct once established).
    let ct = sh(&["bpftool", "map", "dump", "pinned", dir.join(MAP_CT_NEW.name).to_str().unwrap()]).unwrap();
    for field in ["\"saddr\"", "\"dport\"", "\"xlate\"", "\"last_seen_ns\"", "\"zone\": 3", "\"state\""] {
        assert!(ct.contains(field), "ct dump lacks {field}:\n{ct}");
    }
    let rules = sh(&["bpftool", "map", "dump", "pinned", dir.join(MAP_DNAT_RULES.name).to_str().unwrap()]).unwrap();
    assert!(rules.contains("\"backend_count\": 1") && rules.contains("\"addr\": [198,51,100,10"), "{rules}");
}

/// Pins a map `name` that bpftool creates with `spec` (`type … key …
/// value … entries …`, optionally `flags …`) where this build's would go:
/// loading the programs must refuse it, naming `--bpffs`, and leave it.
fn foreign_pin_is_refused(name: &str, spec: &[&str]) {
    let p = TestPins::new();
    pins::ensure_bpffs(&p.root).unwrap();
    let path = pins::ensure_versioned_dir(&p.root).unwrap().join(name);
    let mut args = vec!["bpftool", "map", "create", path.to_str().unwrap()];
    args.extend_from_slice(spec);
    args.extend_from_slice(&["name", name]);
    sh(&args).unwrap();
    let err = ZoneProgram::load(&p.root, 1).err().expect("must refuse").to_string();
    assert!(err.contains("incompatible") && err.contains("--bpffs"), "{err}");
    assert!(path.exists(), "the foreign pin is left alone");
}

#[test]
fn incompatible_pins_are_refused_with_a_clear_message() {
    if !require_root() {
        return;
    }
    // A map named `ct` of the right size, but another type and value size,
    // sits where ours would go.
    let entries = CT_MAX.to_string();
    foreign_pin_is_refused(MAP_CT.name, &["type", "lru_hash", "key", "16", "value", "8", "entries", &entries]);
}

/// A rule table pinned with other flags (preallocated, as a layout before
/// 4 made it, under this layout's directory) is refused, not reused: the
/// flags are part of what a pin must match.
#[test]
fn a_pinned_rule_table_with_other_flags_is_refused() {
    if !require_root() {
        return;
    }
    let info = MAP_DNAT_RULES.info();
    assert_eq!(info.flags, lbagent_common::MAP_F_NO_PREALLOC as u32, "the table is declared unpreallocated");
    let (key, value, entries) = (info.key_size.to_string(), info.value_size.to_string(), info.max_entries.to_string());
    let spec = ["type", "hash", "key", &key, "value", &value, "entries", &entries, "flags", "0"];
    foreign_pin_is_refused(info.name, &spec);
}

/// Each conntrack table gets the size asked for, and pins of other sizes
/// are refused with an error naming the table, both sizes and the flag:
/// nothing is loaded, nothing pinned changes.
#[test]
fn conntrack_sizes_are_kept_and_other_sizes_refused_naming_the_flag() {
    if !require_root() {
        return;
    }
    let p = TestPins::new();
    let sizes = CtSizes::new(Some(4096), Some(2048));
    ZoneProgram::load_sized(&p.root, 1, sizes).unwrap();
    let dir = pins::versioned_dir(&p.root);
    let size = |name: &str| {
        let out = sh(&["bpftool", "map", "show", "pinned", dir.join(name).to_str().unwrap()]).unwrap();
        out.split_whitespace().skip_while(|w| *w != "max_entries").nth(1).unwrap().to_string()
    };
    assert_eq!((size(MAP_CT.name), size(MAP_CT_NEW.name)), ("4096".to_string(), "2048".to_string()));
    // The same sizes: the pins are reused.
    ZoneProgram::load_sized(&p.root, 2, sizes).unwrap();
    // Without --conntrack-new-max, the new-flow table's default (a quarter).
    let err = format!("{:#}", ZoneProgram::load_sized(&p.root, 1, CtSizes::new(Some(4096), None)).err().unwrap());
    assert!(err.contains("`ct_new`") && err.contains("2048") && err.contains("1024"), "{err}");
    assert!(err.contains("--conntrack-new-max 2048") && err.contains("lbagent teardown"), "{err}");
    let err = format!("{:#}", ZoneProgram::load_sized(&p.root, 1, CtSizes::default()).err().unwrap());
    assert!(err.contains("`ct`") && err.contains("--conntrack-max 4096"), "{err}");
    assert_eq!((size(MAP_CT.name), size(MAP_CT_NEW.name)), ("4096".to_string(), "2048".to_string()));
    assert_eq!(CtSizes::new(Some(64), None).new, 256, "the new-flow table's floor");
    // What a start that asks for no size uses: the pinned tables' sizes,
    // whatever the host's memory would give a new dataplane; and the
    // pinned new-flow size when only the established one is asked for.
    let (resolved, origin) = CtSizes::resolve(&p.root, None, None).unwrap();
    assert_eq!((resolved, origin), (sizes, SizeOrigin::Pinned(dir.clone())));
    let (resolved, origin) = CtSizes::resolve(&p.root, Some(4096), None).unwrap();
    assert_eq!((resolved, origin), (sizes, SizeOrigin::Asked));
    ZoneProgram::load_sized(&p.root, 3, resolved).unwrap();
    // Another size asked for is taken as asked (and refused by the pins);
    // a `ct` resized without --conntrack-new-max gets a quarter of it.
    let (resolved, _) = CtSizes::resolve(&p.root, Some(8192), Some(512)).unwrap();
    assert_eq!(resolved, CtSizes::new(Some(8192), Some(512)));
    let (resolved, _) = CtSizes::resolve(&p.root, Some(16384), None).unwrap();
    assert_eq!(resolved, CtSizes { established: 16384, new: 4096 });
    // A fresh dataplane: a share of the host's memory.
    let fresh = TestPins::new();
    let (resolved, origin) = CtSizes::resolve(&fresh.root, None, None).unwrap();
    let SizeOrigin::Memory(memory) = origin else { panic!("{origin:?}") };
    assert_eq!(resolved, CtSizes::new(Some(CtSizes::for_memory(memory)), None));
}

#[test]
fn pins_of_another_layout_version_are_refused() {
    if !require_root() {
        return;
    }
    let e = TestZone::new(1).unwrap();
    set_meta(&pins::versioned_dir(&e.pins.root).join(MAP_META.name), 99);
    let err = ZoneProgram::load(&e.pins.root, 1).err().expect("must refuse").to_string();
    assert!(err.contains("layout version 99"), "{err}");
}

#[test]
fn reload_keeps_conntrack_and_rules() {
    if !require_root() {
        return;
    }
    let mut e = engine_with_flow();
    let (_, out) = e.run(&frame(&Ip::new([10, 0, 1, 2], [198, 51, 100, 10]), &udp(1234, 53))).unwrap();
    assert_eq!(packet::summary(&out).dst, [10, 0, 2, 2]);
    // "Restart": a new program instance over the same pins.
    e.prog = ZoneProgram::load(&e.pins.root, 3).unwrap();
    assert_eq!(e.tables.conntrack().unwrap().len(), 2);
    let (rc, out) = e.run(&frame(&Ip::new([10, 0, 2, 2], [10, 0, 1, 2]), &udp(5353, 1234))).unwrap();
    assert_eq!(rc, TC_ACT_OK);
    let s = packet::summary(&out);
    assert_eq!((s.src, s.sport), ([198, 51, 100, 10], 53), "reply translated by the reloaded program");
    assert_eq!(e.tables.counter(Counter::TranslatedReply).unwrap(), 1);
}

/// Pins a `meta` map (array[1] of `Meta`) recording `recorded` in
/// `<root>/v<dir_version>/`, as an agent of that layout would.
fn pin_meta(root: &std::path::Path, dir_version: u32, recorded: u8) {
    let dir = pins::version_dir(root, dir_version);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(MAP_META.name);
    let p = path.to_str().unwrap();
    sh(&["bpftool", "map", "create", p, "type", "array", "key", "4", "value", "8", "entries", "1", "name", "meta"])
        .unwrap();
    set_meta(&path, recorded);
}

/// Writes `recorded` as the layout version in the pinned `meta` map at `path`.
fn set_meta(path: &std::path::Path, recorded: u8) {
    let v = recorded.to_string();
    let mut args = vec!["bpftool", "map", "update", "pinned", path.to_str().unwrap(), "key", "0", "0", "0", "0"];
    args.extend(["value", &v, "0", "0", "0", "0", "0", "0", "0"]);
    sh(&args).unwrap();
}

#[test]
fn a_newer_layout_is_refused_as_a_downgrade() {
    if !require_root() {
        return;
    }
    let e = TestZone::new(1).unwrap();
    pin_meta(&e.pins.root, LAYOUT_VERSION + 1, (LAYOUT_VERSION + 1) as u8);
    let err = format!("{:#}", ZoneProgram::load(&e.pins.root, 1).err().expect("must refuse"));
    assert!(err.contains(&format!("layout version {} (a newer lbagent)", LAYOUT_VERSION + 1)), "{err}");
    assert!(err.contains("downgrade refused"), "{err}");
}

/// The agent itself, started on a dataplane of a newer layout, refuses
/// before it creates anything: no directory of its own layout appears (a
/// later newer agent would otherwise find this layout's directory).
#[test]
fn a_refused_downgrade_creates_nothing() {
    if !require_root() {
        return;
    }
    let p = TestPins::new();
    pins::ensure_bpffs(&p.root).unwrap();
    pin_meta(&p.root, LAYOUT_VERSION + 1, (LAYOUT_VERSION + 1) as u8);
    let dir = std::env::temp_dir().join(lbagent_tests::unique("lbadg"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("state.yaml"), "version: 1\n").unwrap();
    let arg = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let out = std::process::Command::new(lbagent_tests::lbagent_bin())
        .args(["run", "--state", &arg(&dir.join("state.yaml")), "--metrics", "off"])
        .args(["--state-dir", &arg(&dir.join("sd")), "--bpffs", &arg(&p.root)])
        .args(["--api-socket", &arg(&dir.join("api.sock"))])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("downgrade refused"), "{err}");
    assert!(!pins::versioned_dir(&p.root).exists(), "{} was created", pins::versioned_dir(&p.root).display());
}

#[test]
fn only_the_previous_layout_is_migrated() {
    use lbagent::dataplane::migrate::{FROM_VERSION, Migration};
    if !require_root() {
        return;
    }
    // A marker of a finished migration: nothing to do.
    let p = TestPins::new();
    pins::ensure_bpffs(&p.root).unwrap();
    pin_meta(&p.root, FROM_VERSION, LAYOUT_VERSION as u8);
    assert!(Migration::begin(&p.root, CtSizes::default()).unwrap().is_none());
    assert!(pins::is_marker(&p.root, FROM_VERSION));
    // A live dataplane older than the previous layout: refused, untouched.
    let p = TestPins::new();
    pins::ensure_bpffs(&p.root).unwrap();
    pin_meta(&p.root, FROM_VERSION - 1, (FROM_VERSION - 1) as u8);
    let err = format!("{:#}", Migration::begin(&p.root, CtSizes::default()).expect_err("must refuse"));
    assert!(err.contains(&format!("layout version {}", FROM_VERSION - 1)), "{err}");
    assert!(err.contains(&format!("migrates only layout {FROM_VERSION}")), "{err}");
    assert!(!pins::versioned_dir(&p.root).join(MAP_CT.name).exists(), "nothing created");
}
