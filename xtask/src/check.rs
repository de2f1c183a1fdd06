//! `cargo xtask check`: the fast tier, without root. The README's limits
//! (its length, its links: see `readme.rs`), rustfmt, clippy with warnings
//! as errors, the fuzz targets compiled, and every unit test (the
//! libraries' and the binaries' own; the privileged integration tests are
//! `cargo xtask test`'s). Under a minute on a warm tree; `.ci/run` runs it
//! first.
//!
//! It works before the eBPF toolchain exists: then the build embeds the
//! empty placeholder object (`AYA_BUILD_SKIP=1`, as aya-build does) and
//! the ABI test says that it was skipped and why. With the toolchain there
//! it builds the real object, so that a later `cargo build` finds it built.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use anyhow::Result;

use crate::{cargo, readme, run_checked, toolchain, workspace_root};

pub fn run() -> Result<()> {
    let started = Instant::now();
    let skip_ebpf = toolchain::ebpf_toolchain_missing();
    if let Some(missing) = &skip_ebpf {
        println!(
            "xtask: {missing}: checking with the placeholder eBPF object (`cargo xtask build-ebpf` installs the toolchain)"
        );
    }
    let with_object = |command: &mut Command| {
        if skip_ebpf.is_some() {
            command.env("AYA_BUILD_SKIP", "1");
        }
    };
    let mut steps: Vec<(&str, Duration)> = Vec::new();
    println!("xtask: README and docs/ links");
    let docs_started = Instant::now();
    readme::check(&workspace_root())?;
    steps.push(("docs", docs_started.elapsed()));
    let mut step = |name: &'static str, command: &mut Command| -> Result<()> {
        println!("xtask: {name}");
        let step_started = Instant::now();
        run_checked(command)?;
        steps.push((name, step_started.elapsed()));
        Ok(())
    };
    step(
        "rustfmt --check",
        cargo().args(["fmt", "--all", "--", "--check"]),
    )?;
    let mut clippy = cargo();
    clippy.args(["clippy", "--quiet", "--all-targets", "--", "-D", "warnings"]);
    with_object(&mut clippy);
    step("clippy --all-targets -D warnings", &mut clippy)?;
    // The fuzz targets live outside the workspace (cargo fuzz builds them
    // with nightly and libFuzzer), so clippy never sees them: compile them
    // here, so that a changed config type breaks this tier, not the fuzzing.
    let mut fuzz = cargo();
    fuzz.args(["check", "--quiet", "--bins", "--no-default-features"])
        .arg("--manifest-path")
        .arg(workspace_root().join("lb-userspace/fuzz/Cargo.toml"))
        .env("CARGO_TARGET_DIR", workspace_root().join("target"));
    with_object(&mut fuzz);
    step("fuzz targets compile", &mut fuzz)?;
    let mut unit = cargo();
    unit.args(["test", "--quiet", "--lib", "--bins"]);
    with_object(&mut unit);
    step("unit tests", &mut unit)?;
    let figures: Vec<String> = steps
        .iter()
        .map(|(name, took)| format!("{name} {:.1} s", took.as_secs_f64()))
        .collect();
    println!(
        "xtask: check passed in {:.1} s ({})",
        started.elapsed().as_secs_f64(),
        figures.join(", ")
    );
    Ok(())
}
