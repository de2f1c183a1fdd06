//! `cargo xtask fuzz`: the config parser under cargo-fuzz (libFuzzer), one
//! bounded run per target. `cargo xtask test` runs a short pass; a longer
//! one is `cargo xtask fuzz --seconds 900`.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{run_checked, toolchain, workspace_root};

/// The targets in lb-userspace/fuzz/fuzz_targets.
const TARGETS: [&str; 2] = ["config_toml", "config_flags"];

fn ensure_cargo_fuzz() -> Result<()> {
    toolchain::ensure_nightly()?;
    if toolchain::has_command("cargo-fuzz") {
        return Ok(());
    }
    println!("xtask: installing cargo-fuzz (crates.io)");
    let mut command = Command::new("rustup");
    command.args([
        "run",
        "stable",
        "cargo",
        "install",
        "cargo-fuzz",
        "--locked",
    ]);
    for variable in ["RUSTC", "RUSTUP_TOOLCHAIN", "CARGO_TARGET_DIR", "CARGO"] {
        command.env_remove(variable);
    }
    run_checked(&mut command).context("cargo-fuzz could not be installed")?;
    println!("xtask: installed cargo-fuzz");
    Ok(())
}

/// Runs every target for `seconds` each, from the corpus of earlier runs.
/// A crash fails the run and leaves its input under fuzz/artifacts. Short
/// runs use the dev profile, which builds in a fraction of the time of an
/// optimised one; long runs are optimised. No sanitizer: the config parser
/// is safe Rust (no `unsafe` under lb-userspace/src/config), where
/// AddressSanitizer has nothing to find. Without it, CI's first target
/// took 140 s with its build instead of 228 s, and ran 152,276 inputs in
/// its 20 s instead of 20,127.
pub fn run(seconds: u32) -> Result<()> {
    let profile = if seconds <= 60 { "--dev" } else { "-O" };
    ensure_cargo_fuzz()?;
    let dir = workspace_root().join("lb-userspace/fuzz");
    for target in TARGETS {
        println!("xtask: fuzzing {target} for {seconds} s");
        let mut command = Command::new("rustup");
        command
            .args([
                "run",
                "nightly",
                "cargo",
                "fuzz",
                "run",
                profile,
                "--sanitizer",
                "none",
                target,
                "--",
            ])
            .arg(format!("-max_total_time={seconds}"))
            .arg("-rss_limit_mb=2048")
            .arg("-print_final_stats=1")
            .current_dir(&dir);
        for variable in [
            "RUSTC",
            "RUSTC_WRAPPER",
            "RUSTUP_TOOLCHAIN",
            "RUSTFLAGS",
            "CARGO_TARGET_DIR",
            "CARGO",
        ] {
            command.env_remove(variable);
        }
        // The config parser needs no eBPF object.
        command.env("AYA_BUILD_SKIP", "1");
        let output = command
            .output()
            .with_context(|| format!("running cargo fuzz for {target}"))?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        let runs = stderr
            .lines()
            .find_map(|line| line.strip_prefix("stat::number_of_executed_units:"))
            .map_or("?".to_string(), |count| count.trim().to_string());
        if !output.status.success() {
            bail!(
                "fuzzing {target} found a failure:\n{}",
                crate::last_lines(&stderr, 40)
            );
        }
        println!("xtask: {target}: {runs} inputs, no failure");
    }
    Ok(())
}
