//! Embeds the eBPF object that `cargo xtask build-ebpf` built.
//!
//! The eBPF crate needs nightly and bpf-linker, which a plain `cargo check`
//! or `cargo clippy` must not require. So this script does not build it: it
//! copies the object when it exists and otherwise embeds an empty
//! placeholder, which the binary refuses to load with a clear message (as
//! aya-build's AYA_BUILD_SKIP does).

use std::{env, fs, path::PathBuf};

fn main() {
    let out =
        PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("socklb.bpf.o");
    let object = env::var_os("SOCKLB_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/ebpf/bpfel-unknown-none/release/lb-ebpf")
        });
    println!("cargo:rerun-if-env-changed=SOCKLB_EBPF_OBJECT");
    println!("cargo:rerun-if-changed={}", object.display());
    match fs::read(&object) {
        Ok(bytes) => fs::write(&out, bytes).expect("write the embedded eBPF object"),
        Err(_) => {
            println!(
                "cargo:warning=eBPF object {} not found; embedding an empty placeholder (run `cargo xtask build-ebpf`)",
                object.display()
            );
            fs::write(&out, []).expect("write the placeholder");
        }
    }
}
