//! The eBPF toolchain: nightly with rust-src, and bpf-linker built against
//! the nightly's own LLVM. Installed when missing, reported when installed.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{run_checked, workspace_root};

const NIGHTLY: &str = "nightly";

/// Installs what building the eBPF object needs (nightly, rust-src,
/// bpf-linker), then builds it: lb-userspace's build script does that with
/// aya-build, so this is a `cargo build` of lb-userspace.
pub fn build_ebpf() -> Result<()> {
    ensure_ebpf_toolchain()?;
    println!("xtask: building the eBPF object (lb-userspace's build script, aya-build)");
    run_checked(crate::cargo().args(["build", "--package", "lb-userspace"]))?;
    println!("xtask: eBPF object built and embedded in socklb");
    Ok(())
}

/// What the eBPF build lacks, without installing anything: `None` when
/// nightly, its rust-src and bpf-linker are all there.
pub fn ebpf_toolchain_missing() -> Option<&'static str> {
    if !has_nightly() {
        return Some("no nightly toolchain");
    }
    if !has_rust_src() {
        return Some("no rust-src for nightly");
    }
    (!has_bpf_linker()).then_some("no bpf-linker")
}

/// The build runs `rustup run nightly`, so the undated channel must be
/// there; a dated nightly alone does not do.
fn has_nightly() -> bool {
    output_of(Command::new("rustup").args(["run", NIGHTLY, "rustc", "--version"])).is_some()
}

fn has_rust_src() -> bool {
    output_of(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        NIGHTLY,
    ]))
    .is_some_and(|installed| installed.lines().any(|line| line.starts_with("rust-src")))
}

fn has_bpf_linker() -> bool {
    output_of(Command::new("bpf-linker").arg("--version")).is_some()
}

/// Installs what building the eBPF object needs, if missing: nightly,
/// rust-src and bpf-linker.
pub fn ensure_ebpf_toolchain() -> Result<()> {
    ensure_nightly()?;
    ensure_rust_src()?;
    ensure_bpf_linker()
}

fn output_of(command: &mut Command) -> Option<String> {
    let output = command.output().ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

pub fn ensure_nightly() -> Result<()> {
    let toolchains = output_of(Command::new("rustup").args(["toolchain", "list"])).context(
        "rustup is needed to build the eBPF crate; install it from your distribution or rustup.rs",
    )?;
    if !toolchains.is_empty() && has_nightly() {
        return Ok(());
    }
    println!("xtask: installing the nightly toolchain (the eBPF crate needs -Z build-std)");
    run_checked(Command::new("rustup").args(["toolchain", "install", NIGHTLY, "--profile", "minimal"]))
        .context("the nightly Rust toolchain is missing and could not be installed: run `rustup toolchain install nightly`")
}

fn ensure_rust_src() -> Result<()> {
    if has_rust_src() {
        return Ok(());
    }
    println!("xtask: installing rust-src for nightly (needed by -Z build-std=core)");
    run_checked(Command::new("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        NIGHTLY,
    ]))
    .context(
        "rust-src could not be installed: run `rustup component add rust-src --toolchain nightly`",
    )?;
    println!("xtask: installed rust-src");
    Ok(())
}

/// The nightly's own libLLVM shared library, and its major version.
fn nightly_llvm() -> Result<(PathBuf, String)> {
    let sysroot =
        output_of(Command::new("rustup").args(["run", NIGHTLY, "rustc", "--print", "sysroot"]))
            .context("cannot ask nightly rustc for its sysroot")?;
    let lib = Path::new(sysroot.trim()).join("lib");
    let library = std::fs::read_dir(&lib)
        .with_context(|| format!("reading {}", lib.display()))?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("libLLVM.so.") && name.contains("-rust-"))
        })
        .with_context(|| {
            format!(
                "no libLLVM.so.*-rust-* in {}: the nightly has no shared LLVM",
                lib.display()
            )
        })?;
    let name = library
        .file_name()
        .and_then(|name| name.to_str())
        .unwrap_or_default();
    let major = name
        .trim_start_matches("libLLVM.so.")
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string();
    if major.is_empty() || !major.chars().all(|c| c.is_ascii_digit()) {
        bail!("cannot read the LLVM version from {name}");
    }
    Ok((library, major))
}

fn ensure_bpf_linker() -> Result<()> {
    if has_bpf_linker() {
        return Ok(());
    }
    let (library, major) = nightly_llvm()?;
    // bpf-linker links the LLVM found under $LLVM_PREFIX/lib; point it at the
    // nightly's own, so the linker and rustc agree on the bitcode format.
    let prefix = workspace_root().join("target/llvm-prefix");
    let lib = prefix.join("lib");
    std::fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    let file_name = library.file_name().expect("a file");
    for link in [lib.join("libLLVM.so"), lib.join(file_name)] {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&library, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    println!(
        "xtask: installing bpf-linker against the nightly's LLVM {major} ({})",
        library.display()
    );
    let mut command = Command::new("rustup");
    command
        .args([
            "run",
            "stable",
            "cargo",
            "install",
            "bpf-linker",
            "--no-default-features",
            "--features",
        ])
        .arg(format!("llvm-{major}"))
        .env("LLVM_PREFIX", &prefix);
    for variable in ["RUSTC", "RUSTUP_TOOLCHAIN", "CARGO_TARGET_DIR", "CARGO"] {
        command.env_remove(variable);
    }
    run_checked(&mut command).context(
        "bpf-linker could not be built: it needs crates.io and the nightly's libLLVM; \
         try `LLVM_PREFIX=<dir with lib/libLLVM.so> cargo install bpf-linker --no-default-features --features llvm-<N>`",
    )?;
    println!("xtask: installed bpf-linker");
    Ok(())
}

/// Installs the Debian packages whose command is missing.
pub fn install_debian_packages(packages: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .filter(|(_, command)| !has_command(command))
        .map(|(package, _)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    apt_install(&missing)
}

fn apt_install(packages: &[&str]) -> Result<()> {
    println!("xtask: installing Debian packages: {}", packages.join(" "));
    run_checked(Command::new("apt-get").args(["update", "-q"]))
        .context("apt-get update failed; install the packages by hand")?;
    run_checked(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(packages)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .with_context(|| format!("installing {} failed", packages.join(" ")))?;
    println!("xtask: installed {}", packages.join(" "));
    Ok(())
}

/// Python packages the tests use, pinned: the official Kubernetes client
/// (it holds the test apiserver to the real API) and a validator of
/// Kubernetes objects against the API's schemas. Each with its module.
const PYTHON_PACKAGES: &[(&str, &str, &str)] = &[
    ("kubernetes", "37.0.2", "kubernetes"),
    ("kubernetes-validate", "1.37.0", "kubernetes_validate"),
];

/// The Python environment of the tests, target/pyenv (`python3 -m venv`),
/// with `PYTHON_PACKAGES` installed by pip unless they already import at
/// their pinned versions. Returns its interpreter, which the tests get as
/// `SOCKLB_PYTHON`. Fails, never skips, when pip cannot install them.
pub fn ensure_python_env() -> Result<PathBuf> {
    let root = workspace_root().join("target/pyenv");
    let python = root.join("bin/python");
    if python_has_packages(&python) {
        return Ok(python);
    }
    install_debian_packages(&[("python3", "python3")])?;
    let has_pip = || {
        Command::new(&python)
            .args(["-m", "pip", "--version"])
            .output()
            .is_ok_and(|output| output.status.success())
    };
    if !has_pip() {
        // Debian's python3 makes a venv only with python3-venv (ensurepip).
        let can_make_venv = Command::new("python3")
            .args(["-c", "import ensurepip, venv"])
            .output()
            .is_ok_and(|output| output.status.success());
        if !can_make_venv {
            apt_install(&["python3-venv"])?;
        }
        let _ = std::fs::remove_dir_all(&root);
        println!(
            "xtask: creating the tests' Python environment {}",
            root.display()
        );
        run_checked(Command::new("python3").args(["-m", "venv"]).arg(&root))
            .with_context(|| format!("python3 -m venv {} failed", root.display()))?;
    }
    let requirements: Vec<String> = PYTHON_PACKAGES
        .iter()
        .map(|(name, version, _)| format!("{name}=={version}"))
        .collect();
    println!(
        "xtask: installing Python packages: {}",
        requirements.join(" ")
    );
    run_checked(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-input",
                "-q",
            ])
            .args(&requirements),
    )
    .with_context(|| {
        format!(
            "pip could not install {} into {}: the tests of the Kubernetes API need them \
             (PyPI must be reachable)",
            requirements.join(" "),
            root.display()
        )
    })?;
    if !python_has_packages(&python) {
        bail!(
            "{} still cannot import {} at the pinned versions after pip installed them",
            python.display(),
            requirements.join(" ")
        );
    }
    println!("xtask: installed {}", requirements.join(" "));
    Ok(python)
}

/// Whether `python` imports every package of `PYTHON_PACKAGES` at its
/// pinned version.
fn python_has_packages(python: &Path) -> bool {
    let checks: String = PYTHON_PACKAGES
        .iter()
        .map(|(name, version, module)| {
            format!("import {module}\nassert metadata.version('{name}') == '{version}'\n")
        })
        .collect();
    Command::new(python)
        .arg("-c")
        .arg(format!("from importlib import metadata\n{checks}"))
        .output()
        .is_ok_and(|output| output.status.success())
}

pub fn has_command(name: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {name} >/dev/null 2>&1")])
        .status()
        .is_ok_and(|status| status.success())
}
