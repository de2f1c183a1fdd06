//! Builds the eBPF object (lb-ebpf) with aya-build, as aya-template does:
//! nightly with `-Z build-std=core` and bpf-linker, into OUT_DIR, whenever
//! lb-ebpf or lb-common change. `cargo xtask build-ebpf` installs the
//! toolchain pieces it needs.
//!
//! `AYA_BUILD_SKIP=1` skips it (for `cargo check` or `clippy` without the
//! eBPF toolchain) and embeds an empty placeholder instead, which the
//! binary refuses to install with a clear message. So does a build without
//! the `ebpf` feature (the xtask's own build: it installs the toolchain
//! first, then builds socklb with the feature).

use std::{env, fs, path::PathBuf};

use anyhow::{Context, anyhow};

fn main() -> anyhow::Result<()> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("cargo sets OUT_DIR")?);
    // Two objects of the same programs: the array layout of the socket
    // table (`lb-ebpf`, Linux 5.12 and later) and the hash layout
    // (`lb-ebpf-hash`, for older kernels).
    let object = out_dir.join("lb-ebpf");
    let hash_object = out_dir.join("lb-ebpf-hash");
    let placeholders = || -> anyhow::Result<()> {
        fs::write(&object, []).context("writing the placeholder")?;
        fs::write(&hash_object, []).context("writing the placeholder")
    };
    if env::var_os("CARGO_FEATURE_EBPF").is_none() {
        return placeholders();
    }
    let skip = env::var_os("AYA_BUILD_SKIP")
        .is_some_and(|value| value == "1" || value.eq_ignore_ascii_case("true"));
    if skip {
        println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
        println!(
            "cargo:warning=AYA_BUILD_SKIP is set: embedding an empty placeholder for the eBPF object; this socklb cannot install"
        );
        return placeholders();
    }
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("cargo sets it")?);
    let ebpf_dir = manifest_dir.join("../lb-ebpf");
    let common_dir = manifest_dir.join("../lb-common");
    // aya-build watches lb-ebpf; the shared types live in lb-common.
    println!("cargo:rerun-if-changed={}", common_dir.display());
    let root_dir = ebpf_dir
        .to_str()
        .ok_or_else(|| anyhow!("the path of lb-ebpf is not UTF-8"))?;
    // aya-build passes every line the inner cargo writes on stderr on as a
    // `cargo:warning`, so each build would print dozens of "Compiling …"
    // lines. A quiet inner cargo writes only its warnings and errors; a
    // failure still shows them all, and fails this script with its status.
    // SAFETY: this build script is single-threaded until aya-build spawns
    // the inner cargo, which inherits the variable.
    unsafe { env::set_var("CARGO_TERM_QUIET", "true") };
    // aya-build copies the package's binary to OUT_DIR/lb-ebpf: the hash
    // layout first, renamed, then the array layout.
    for (features, built_as) in [(&[][..], &hash_object), (&["slots"][..], &object)] {
        aya_build::build_ebpf(
            [aya_build::Package {
                name: "lb-ebpf",
                root_dir,
                features,
                ..Default::default()
            }],
            aya_build::Toolchain::default(),
        )
        .context("building the eBPF object (run `cargo xtask build-ebpf` to install nightly, rust-src and bpf-linker; AYA_BUILD_SKIP=1 skips it)")?;
        if built_as != &object {
            fs::rename(&object, built_as).context("naming the hash layout's object")?;
        }
    }
    Ok(())
}
