//! Static checks on the built eBPF object: no BPF-to-BPF calls but to the
//! global functions we wrote on purpose (in particular no `memset`/`memcpy`
//! the compiler slipped in), and only helpers that exist in Linux 5.10, and
//! only atomics Linux 5.10 has.

use object::{Object, ObjectSection, ObjectSymbol, SectionKind};

/// The highest helper id in Linux 5.10's uapi `bpf.h` (`bpf_redirect_peer`).
const MAX_HELPER_5_10: i32 = 155;

fn object_bytes() -> &'static [u8] {
    let obj = lbagent::dataplane::OBJECT;
    assert!(!obj.is_empty(), "eBPF object not built (cargo xtask build)");
    obj
}

/// (section, instruction index, src_reg, imm) of every call instruction.
fn calls() -> Vec<(String, usize, u8, i32)> {
    let file = object::File::parse(object_bytes()).unwrap();
    let mut out = Vec::new();
    for sec in file.sections().filter(|s| s.kind() == SectionKind::Text) {
        let data = sec.data().unwrap();
        for (i, insn) in data.as_chunks::<8>().0.iter().enumerate() {
            if insn[0] == 0x85 {
                let imm = i32::from_le_bytes(insn[4..8].try_into().unwrap());
                out.push((sec.name().unwrap().to_string(), i, insn[1] >> 4, imm));
            }
        }
    }
    out
}

/// Global BPF functions the program calls on purpose: the verifier checks
/// each once on its own (Linux 5.6+), which keeps a loop from being
/// re-verified on every path that reaches it (`lbagent-ebpf/src/sched.rs`,
/// the expired-flow reclaim and the upgrade's adoption of
/// `lbagent-ebpf/src/conntrack.rs`).
const GLOBAL_FUNCTIONS: [&str; 3] = ["lbagent_sched_least", "lbagent_ct_reclaim", "lbagent_ct_adopt"];

#[test]
fn no_bpf_to_bpf_calls() {
    let file = object::File::parse(object_bytes()).unwrap();
    // The symbol each call relocation names, by (section, instruction).
    let mut targets = std::collections::HashMap::new();
    for sec in file.sections().filter(|s| s.kind() == SectionKind::Text) {
        for (offset, rel) in sec.relocations() {
            if let object::RelocationTarget::Symbol(idx) = rel.target() {
                let name = file.symbol_by_index(idx).and_then(|s| s.name().map(str::to_owned)).unwrap_or_default();
                targets.insert((sec.name().unwrap().to_string(), (offset / 8) as usize), name);
            }
        }
    }
    let pseudo: Vec<_> = calls()
        .into_iter()
        .filter(|c| c.2 != 0)
        .filter(|c| !targets.get(&(c.0.clone(), c.1)).is_some_and(|n| GLOBAL_FUNCTIONS.contains(&n.as_str())))
        .collect();
    assert!(pseudo.is_empty(), "BPF-to-BPF calls (src_reg != 0) to anything but {GLOBAL_FUNCTIONS:?}: {pseudo:?}");
    // And no call relocations against mem* builtins.
    for sec in file.sections() {
        for (_, rel) in sec.relocations() {
            if let object::RelocationTarget::Symbol(idx) = rel.target() {
                let name = file.symbol_by_index(idx).and_then(|s| s.name().map(str::to_owned)).unwrap_or_default();
                assert!(
                    !["memset", "memcpy", "memmove", "memcmp", "bcmp"].contains(&name.as_str())
                        || sec.kind() != SectionKind::Text,
                    "{} references {name}",
                    sec.name().unwrap_or("?")
                );
            }
        }
    }
}

#[test]
fn helpers_exist_in_linux_5_10() {
    let calls = calls();
    assert!(!calls.is_empty());
    // Helper calls only (src_reg 0; BPF-to-BPF calls are checked above).
    let mut ids: Vec<i32> = calls.iter().filter(|c| c.2 == 0).map(|c| c.3).collect();
    ids.sort();
    ids.dedup();
    eprintln!("helper ids used: {ids:?}");
    for id in ids {
        assert!((1..=MAX_HELPER_5_10).contains(&id), "helper {id} is newer than Linux 5.10");
    }
}

/// Atomics are the plain `lock +=` of Linux 5.10 (BPF_STX | BPF_ATOMIC with
/// imm = BPF_ADD); fetch and compare-exchange variants arrived in 5.12.
#[test]
fn atomics_exist_in_linux_5_10() {
    let file = object::File::parse(object_bytes()).unwrap();
    let mut atomics = 0;
    for sec in file.sections().filter(|s| s.kind() == SectionKind::Text) {
        for (i, insn) in sec.data().unwrap().as_chunks::<8>().0.iter().enumerate() {
            // BPF_STX (0x03) | BPF_ATOMIC (0xc0) | size W (0x00) or DW (0x18).
            if insn[0] == 0xc3 || insn[0] == 0xdb {
                atomics += 1;
                let imm = i32::from_le_bytes(insn[4..8].try_into().unwrap());
                assert_eq!(imm, 0, "atomic op {imm:#x} at {i} in {} is newer than Linux 5.10", sec.name().unwrap());
            }
        }
    }
    assert!(atomics > 0, "the QoS limiter's atomic add is missing");
}

#[test]
fn programs_are_tc_classifiers_with_btf() {
    let file = object::File::parse(object_bytes()).unwrap();
    assert!(file.section_by_name("classifier").is_some(), "sched_cls section");
    assert!(file.section_by_name(".BTF").is_some(), "BTF for typed map dumps");
    assert!(file.section_by_name(".maps").is_some(), "BTF-defined maps");
}

/// Bytes below the frame pointer (r10) that `insns` reach: loads and stores
/// relative to r10, and buffers passed as `rX = r10; rX += -N`.
fn stack_depth(insns: &[[u8; 8]]) -> i64 {
    let mut depth = 0i64;
    // Registers holding a copy of r10 (not yet offset).
    let mut frame_copy = [false; 16];
    for insn in insns {
        let (op, dst, src) = (insn[0], (insn[1] & 0x0f) as usize, (insn[1] >> 4) as usize);
        let off = i16::from_le_bytes([insn[2], insn[3]]) as i64;
        let imm = i32::from_le_bytes(insn[4..8].try_into().unwrap()) as i64;
        match op & 0x07 {
            // BPF_LDX: *(dst) = *(src + off).
            0x01 if src == 10 => depth = depth.max(-off),
            // BPF_ST / BPF_STX: *(dst + off) = ….
            0x02 | 0x03 if dst == 10 => depth = depth.max(-off),
            _ => {}
        }
        match op {
            // mov64 dst, src
            0xbf => frame_copy[dst] = src == 10,
            // add64 dst, imm
            0x07 if frame_copy[dst] => {
                depth = depth.max(-imm);
                frame_copy[dst] = false;
            }
            // Anything else that writes a register (ALU, loads) ends a copy.
            _ if matches!(op & 0x07, 0x00 | 0x01 | 0x04 | 0x07) => frame_copy[dst] = false,
            _ => {}
        }
    }
    depth
}

/// Linux 5.10 adds up the stack of every frame in a call chain, each
/// rounded up to 32 bytes, and refuses a program above 512: the new-flow
/// path calls the global functions (one at a time: none calls another, so
/// a chain is a program and its deepest global function), so the
/// programs' frames and the deepest function's together must fit. Newer kernels load a program that
/// 5.10 refuses (seen: 456 + 48 bytes, "combined stack size of 2 calls is
/// 544"), so only this check catches it before a 5.10 VM does.
#[test]
fn stack_frames_fit_linux_5_10() {
    let file = object::File::parse(object_bytes()).unwrap();
    let mut depths = std::collections::BTreeMap::new();
    for sym in file.symbols().filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 0) {
        let Some(sec) = sym.section_index().and_then(|i| file.section_by_index(i).ok()) else { continue };
        let data = sec.data().unwrap();
        let start = (sym.address() - sec.address()) as usize;
        let insns = data[start..start + sym.size() as usize].as_chunks::<8>().0;
        depths.insert(sym.name().unwrap().to_string(), stack_depth(insns));
    }
    eprintln!("stack bytes per function: {depths:?}");
    let round = |d: i64| (d.max(1) + 31) / 32 * 32;
    let global: i64 = GLOBAL_FUNCTIONS.iter().map(|g| round(depths[*g])).max().unwrap_or(0);
    // The global functions are leaves: no call from one to another.
    for (sec, i, src, _) in calls() {
        let in_global = file.symbols().any(|s| {
            GLOBAL_FUNCTIONS.contains(&s.name().unwrap_or(""))
                && s.section_index()
                    .and_then(|x| file.section_by_index(x).ok())
                    .and_then(|x| x.name().ok().map(str::to_owned))
                    == Some(sec.clone())
                && (s.address() / 8..(s.address() + s.size()) / 8).contains(&(i as u64))
        });
        assert!(!(in_global && src != 0), "a global function calls another ({sec}, instruction {i})");
    }
    for prog in ["lbagent_nat", "lbagent_nat_egress"] {
        let d = depths[prog];
        assert!(d > 0, "{prog}: no stack use found");
        assert!(
            round(d) + global <= 512,
            "{prog}: {d} bytes of stack (rounded {}) + the deepest global function's {global} exceed Linux 5.10's 512",
            round(d)
        );
    }
}
