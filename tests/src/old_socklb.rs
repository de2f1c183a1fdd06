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

/// Where an old version's `socklb` is compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildTree {
    /// target/old-build, a tree of the old versions' own, shared by every
    /// old commit. The only choice inside `cargo test`, which holds the
    /// workspace's build directory lock while its tests run: a build there
    /// would wait for it forever.
    Own,
    /// The workspace's own target directory. The old version then reuses
    /// every dependency this workspace built at the same version, with the
    /// same features: the first layout's 178 packages are all at this
    /// workspace's versions, and it compiles 23 of them instead of all.
    /// The old tree's own packages get a version of their own and its
    /// binary the name `socklb-old-<commit>`, so that no artifact of it
    /// ever takes the name of one of this workspace's. Never from inside
    /// `cargo test` (see `Own`): `cargo xtask old-versions` builds this way.
    Workspace,
}

impl BuildTree {
    fn label(self) -> &'static str {
        match self {
            BuildTree::Own => "own",
            BuildTree::Workspace => "workspace",
        }
    }
}

/// The `socklb` binary of `commit`: target/old-<commit>/socklb,
/// built the first time it is asked for and reused by every later run.
/// Panics with the step that failed.
///
/// The build takes what that commit needs and nothing more: its eBPF
/// object (nightly, as its `cargo xtask build-ebpf` did, without building
/// its xtask) and its `socklb` binary alone, in [`BuildTree::Own`] (with
/// sccache on PATH it shares the compile cache of this workspace's build;
/// without it, it leaves out debug info, which the test has no use for).
pub fn old_socklb_bin_at(commit: &str) -> PathBuf {
    let target = crate::socklb_bin()
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/socklb")
        .to_path_buf();
    old_socklb_bin_in(&target, commit, BuildTree::Own)
}

/// The `socklb` binary of `commit` cached under `target` (the workspace's
/// target/ directory), built in `tree` if it is not there yet; see
/// [`old_socklb_bin_at`]. Each tree has a lock and a source directory of
/// its own, so that a `cargo test` run beside `cargo xtask old-versions`
/// never waits for a lock the other holds while it waits for cargo's; the
/// binary goes into the cache with a rename, whole.
pub fn old_socklb_bin_in(target: &Path, commit: &str, tree: BuildTree) -> PathBuf {
    let base = target.join(format!("old-{commit}"));
    let binary = base.join("socklb");
    if binary.exists() {
        return binary;
    }
    // One build at a time in a tree: each copies its binary out before
    // the next can overwrite it.
    let build = target.join("old-build");
    std::fs::create_dir_all(&build).expect("the old builds' directory");
    let label = tree.label();
    let lock =
        std::fs::File::create(build.join(format!("{label}.lock"))).expect("the old builds' lock");
    lock.lock().expect("locking the old builds' tree");
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
    let source = build.join(format!("src-{commit}-{label}"));
    let _ = std::fs::remove_dir_all(&source);
    std::fs::create_dir_all(&source).expect("old source directory");
    extract(commit, &source);
    // A commit whose build.rs takes a prebuilt object (SOCKLB_EBPF_OBJECT)
    // gets one; a later one builds its object itself (aya-build).
    let takes_object = std::fs::read_to_string(source.join("lb-userspace/build.rs"))
        .is_ok_and(|text| text.contains("SOCKLB_EBPF_OBJECT"));
    let object = takes_object.then(|| build_ebpf_object(&source, &build));
    let built = match tree {
        BuildTree::Own => build_socklb(&source, &build, object.as_deref(), "socklb", true),
        BuildTree::Workspace => {
            let name = format!("socklb-old-{commit}");
            keep_apart(&source, commit, &name);
            build_socklb(&source, target, object.as_deref(), &name, false)
        }
    };
    std::fs::create_dir_all(&base).expect("the old version's cache directory");
    let partial = base.join(format!("socklb.partial-{label}"));
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

/// Keeps the old tree's artifacts apart from the workspace's in one
/// target directory. Its own packages (lb-common, lb-userspace, lb-ebpf)
/// have the workspace's names, version and paths from the root, so cargo
/// would give them the same artifact names and one build would overwrite
/// the other's: their version becomes `<version>-old-<commit>` (the old
/// code reads it only for a metrics label). Its `socklb` binary, which
/// cargo copies to target/debug under its bare name, becomes `name` (its
/// library, also named socklb, is only ever a dependency, never copied).
fn keep_apart(source: &Path, commit: &str, name: &str) {
    replace_once(
        &source.join("Cargo.toml"),
        "[workspace.package]",
        "version = \"0.1.0\"\n",
        &format!("version = \"0.1.0-old-{commit}\"\n"),
    );
    replace_once(
        &source.join("lb-userspace/Cargo.toml"),
        "[[bin]]",
        "[[bin]]\nname = \"socklb\"\n",
        &format!("[[bin]]\nname = \"{name}\"\n"),
    );
}

/// Replaces the first `from` after `section` in a manifest; panics if
/// there is none.
fn replace_once(manifest: &Path, section: &str, from: &str, to: &str) {
    let text = std::fs::read_to_string(manifest)
        .unwrap_or_else(|error| panic!("reading {}: {error}", manifest.display()));
    let at = text
        .find(section)
        .and_then(|start| text[start..].find(from).map(|offset| start + offset))
        .unwrap_or_else(|| panic!("{} has no {from:?} in {section}", manifest.display()));
    let changed = format!("{}{to}{}", &text[..at], &text[at + from.len()..]);
    std::fs::write(manifest, changed)
        .unwrap_or_else(|error| panic!("writing {}: {error}", manifest.display()));
}

/// Removes from `command`'s environment what `cargo run` (`cargo xtask`)
/// sets for its own program. Some build scripts watch those variables
/// (ring's), so a cargo started with them would rebuild what a plain
/// `cargo` built, over it, and the other way round.
pub fn without_cargo_run_variables(command: &mut Command) {
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_by_cargo_run = name.starts_with("CARGO_PKG_")
            || matches!(
                name.as_ref(),
                "CARGO"
                    | "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
            );
        if set_by_cargo_run {
            command.env_remove(name.as_ref());
        }
    }
}

/// Runs a command to completion at nice 19; panics with its output if it
/// fails. A test run may run other suites beside the one that builds: the
/// build should take only the CPU that their timers leave.
fn run(what: &str, command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setpriority and prctl are async-signal-safe, and the closure
    // touches nothing else between fork and exec. The death signal stops
    // the build if the process that started it dies (an interrupted run).
    unsafe {
        command.pre_exec(|| {
            if libc::setpriority(libc::PRIO_PROCESS, 0, 19) != 0
                || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
            {
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
    without_cargo_run_variables(&mut command);
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

/// The commit's `socklb` binary alone (the target `name`), built in
/// `build` and embedding `object` if given. `own_tree`: in a tree of the
/// old versions' own, which leaves out debug info, which the test has no
/// use for; in the workspace's, the workspace's profile stays, or no
/// dependency would be shared.
fn build_socklb(
    source: &Path,
    build: &Path,
    object: Option<&Path>,
    name: &str,
    own_tree: bool,
) -> PathBuf {
    let mut command = Command::new("cargo");
    command
        .args([
            "build",
            "--quiet",
            "--package",
            "lb-userspace",
            "--bin",
            name,
        ])
        .env("CARGO_TARGET_DIR", build)
        .current_dir(source);
    if let Some(object) = object {
        command.env("SOCKLB_EBPF_OBJECT", object);
    }
    without_cargo_run_variables(&mut command);
    for variable in ["RUSTFLAGS", "RUSTC"] {
        command.env_remove(variable);
    }
    // Built once and never rebuilt: incremental state would be work for
    // nothing (crates.io dependencies are never built incrementally, so
    // this keeps them shared).
    command.env("CARGO_INCREMENTAL", "0");
    if own_tree && std::env::var_os("RUSTC_WRAPPER").is_none() {
        if has_sccache() {
            command.env("RUSTC_WRAPPER", "sccache");
        } else {
            command.env("CARGO_PROFILE_DEV_DEBUG", "0");
        }
    }
    run("building the old socklb", &mut command);
    build.join("debug").join(name)
}

fn has_sccache() -> bool {
    Command::new("sccache")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success())
}
