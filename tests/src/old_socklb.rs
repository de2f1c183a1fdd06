//! The socklb of an older commit, for the upgrade test: built from this
//! repository's history once, and cached under target/ by its commit.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

/// The commit before the kernel ABI was versioned: the version an upgrade
/// test starts from.
pub const FIRST_LAYOUT_COMMIT: &str = "2ea9fbd";

/// The last commit whose socklb kept per-socket records in socket storage
/// (`lb_sockets_v1`), before the socket table: an upgrade test starts from
/// it too.
pub const SOCKET_STORAGE_COMMIT: &str = "d9a0ca9";

/// Every commit an upgrade test starts from.
pub const OLD_COMMITS: [&str; 2] = [FIRST_LAYOUT_COMMIT, SOCKET_STORAGE_COMMIT];

/// The `socklb` binary of [`FIRST_LAYOUT_COMMIT`]; see [`old_socklb_bin_at`].
pub fn old_socklb_bin() -> PathBuf {
    old_socklb_bin_at(FIRST_LAYOUT_COMMIT)
}

/// The `socklb` binary of `commit`: target/old-<commit>/socklb,
/// built the first time it is asked for and reused by every later run.
/// Panics with the step that failed.
///
/// The build takes what that commit needs and nothing more: its eBPF
/// object (nightly, as its `cargo xtask build-ebpf` did, without building
/// its xtask) and its `socklb` binary alone. Every old commit builds in
/// one tree, target/old-build, so the second reuses the dependencies the
/// first compiled (the 178 packages of the first layout's lock are all in
/// the later one's, at the same versions). With sccache on PATH it shares
/// the compile cache of this workspace's build too; without it, it leaves
/// out debug info, which the test has no use for.
pub fn old_socklb_bin_at(commit: &str) -> PathBuf {
    let target = crate::socklb_bin()
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/socklb")
        .to_path_buf();
    old_socklb_bin_in(&target, commit)
}

/// The `socklb` binary of `commit` cached under `target` (the workspace's
/// target/ directory), built there if it is not yet; see
/// [`old_socklb_bin_at`]. `cargo xtask old-versions` builds them this way.
pub fn old_socklb_bin_in(target: &Path, commit: &str) -> PathBuf {
    let base = target.join(format!("old-{commit}"));
    let binary = base.join("socklb");
    if binary.exists() {
        return binary;
    }
    // One build at a time in the shared tree: each copies its binary out
    // of target/old-build/debug before the next can overwrite it.
    let build = target.join("old-build");
    std::fs::create_dir_all(&build).expect("the old builds' directory");
    let lock = std::fs::File::create(build.join("build.lock")).expect("the old builds' lock");
    lock.lock().expect("locking the old builds' directory");
    if binary.exists() {
        return binary;
    }
    // Straight to the standard error, past the harness's capture: the
    // first build takes minutes, and says why.
    let _ = writeln!(
        std::io::stderr(),
        "upgrade: building socklb {commit} once (cached as {})",
        binary.display()
    );
    let started = Instant::now();
    let _ = std::fs::remove_dir_all(&base);
    let source = base.join("src");
    std::fs::create_dir_all(&source).expect("old source directory");
    extract(commit, &source);
    // A commit whose build.rs takes a prebuilt object (SOCKLB_EBPF_OBJECT)
    // gets one; a later one builds its object itself (aya-build).
    let takes_object = std::fs::read_to_string(source.join("lb-userspace/build.rs"))
        .is_ok_and(|text| text.contains("SOCKLB_EBPF_OBJECT"));
    let object = takes_object.then(|| build_ebpf_object(&source, &build));
    let built = build_socklb(&source, &build, object.as_deref());
    let partial = base.join("socklb.partial");
    std::fs::copy(&built, &partial).expect("copying the old socklb");
    std::fs::rename(&partial, &binary).expect("caching the old socklb");
    let _ = std::fs::remove_dir_all(&source);
    let _ = writeln!(
        std::io::stderr(),
        "upgrade: built socklb {commit} in {} s",
        started.elapsed().as_secs()
    );
    binary
}

/// Runs a command to completion at nice 19; panics with its output if it
/// fails. `cargo xtask test` runs other suites beside this one, and
/// building the old versions takes both cores for minutes: it should take
/// only the CPU that their timers leave.
fn run(what: &str, command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setpriority is async-signal-safe, and the closure touches
    // nothing else between fork and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::setpriority(libc::PRIO_PROCESS, 0, 19) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = command
        .output()
        .unwrap_or_else(|error| panic!("{what}: {error}"));
    assert!(
        output.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The commit's tree, from this repository's history.
fn extract(commit: &str, source: &Path) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root");
    run(
        &format!("extracting {commit} from the repository's history"),
        Command::new("sh").arg("-c").arg(format!(
            "git -C '{}' archive --format=tar {commit} | tar -x -C '{}'",
            repo.display(),
            source.display()
        )),
    );
}

/// The commit's eBPF object, built as its `cargo xtask build-ebpf` did
/// (lb-ebpf's own .cargo/config.toml picks the target and build-std).
fn build_ebpf_object(source: &Path, build: &Path) -> PathBuf {
    let mut command = Command::new("rustup");
    command
        .args(["run", "nightly", "cargo", "build", "--quiet", "--release"])
        .arg("--target-dir")
        .arg(build.join("ebpf"))
        .current_dir(source.join("lb-ebpf"));
    // The outer cargo's variables are for this workspace's host build.
    for variable in [
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTUP_TOOLCHAIN",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO",
        "CARGO_MANIFEST_DIR",
    ] {
        command.env_remove(variable);
    }
    run(
        "building the old eBPF object (nightly, bpf-linker)",
        &mut command,
    );
    let object = build.join("ebpf/bpfel-unknown-none/release/lb-ebpf");
    assert!(
        object.exists(),
        "the old eBPF build made no {}",
        object.display()
    );
    object
}

/// The commit's `socklb` binary alone, embedding `object` if given.
fn build_socklb(source: &Path, build: &Path, object: Option<&Path>) -> PathBuf {
    let mut command = Command::new("cargo");
    command
        .args([
            "build",
            "--quiet",
            "--package",
            "lb-userspace",
            "--bin",
            "socklb",
        ])
        .env("CARGO_TARGET_DIR", build)
        .current_dir(source);
    if let Some(object) = object {
        command.env("SOCKLB_EBPF_OBJECT", object);
    }
    for variable in ["CARGO", "CARGO_MANIFEST_DIR", "RUSTFLAGS", "RUSTC"] {
        command.env_remove(variable);
    }
    // Built once and never rebuilt: incremental state would be work for
    // nothing.
    command.env("CARGO_INCREMENTAL", "0");
    if std::env::var_os("RUSTC_WRAPPER").is_none() {
        if has_sccache() {
            command.env("RUSTC_WRAPPER", "sccache");
        } else {
            command.env("CARGO_PROFILE_DEV_DEBUG", "0");
        }
    }
    run("building the old socklb", &mut command);
    build.join("debug/socklb")
}

fn has_sccache() -> bool {
    Command::new("sccache")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success())
}
