//! Embeds the eBPF object built by `cargo xtask build-ebpf`.
//!
//! A plain `cargo build` without the object still succeeds (an empty object is
//! embedded) so unit tests run anywhere; loading then fails with a message
//! that says how to build it.

use std::{env, fs, path::PathBuf};

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let target_dir =
        env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| manifest.parent().unwrap().join("target"));
    let obj = target_dir.join("bpfel-unknown-none/release/lbagent-ebpf");
    println!("cargo:rerun-if-changed={}", obj.display());
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("lbagent-ebpf.o");
    match fs::read(&obj) {
        Ok(bytes) => fs::write(&out, bytes).unwrap(),
        Err(_) => {
            println!("cargo:warning=eBPF object {} missing; run `cargo xtask build`", obj.display());
            fs::write(&out, []).unwrap();
        }
    }
}
