//! Developer verbs: `cargo xtask build-ebpf | build | check | test |
//! test-deploy | image | demo | bench | fuzz | soak | old-versions`.
//!
//! Each verb finds or installs what it needs and says what it did.

mod background;
mod bench;
mod check;
mod demo;
mod deploy;
mod fuzz;
mod image;
mod readme;
mod soak;
mod suites;
mod toolchain;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    command: Verb,
}

#[derive(Debug, Subcommand)]
enum Verb {
    /// Install the eBPF toolchain pieces that are missing (nightly, rust-src,
    /// bpf-linker), then build the eBPF object with BTF (through
    /// lb-userspace's build script).
    BuildEbpf,
    /// build-ebpf, then the socklb binary and the test helpers.
    Build,
    /// The fast tier, without root: rustfmt, clippy (warnings are errors)
    /// and every unit test. Works before the eBPF toolchain exists.
    Check,
    /// Install the test dependencies (Debian packages, and target/pyenv with
    /// the Python Kubernetes client) and run every test (needs root).
    Test {
        /// Also build the release socklb that `test-deploy` ships, in the
        /// background while the tests run (idle class, one job), in the CPU the
        /// suites leave idle. Not in CI, where test-deploy builds it.
        /// (Beside it, hardening.rs's crash test once saw socklb exit 1:
        /// a link that another BPF user freed during socklb's search for
        /// other installs, since fixed; discovery.rs's drain test also
        /// failed once: a race in the test, fixed.)
        #[arg(long)]
        release_in_background: bool,
        /// How many test binaries run at once (each runs its tests one at a
        /// time). The suites mostly wait on timers: on 2 cores two lanes
        /// take about half the time of one. Three take about 40 %, but
        /// then a starved daemon can miss a suite's promised times.
        #[arg(long, default_value_t = 2)]
        jobs: usize,
        /// Arguments as `cargo test` reads them: options select what is
        /// built (`--test redirect`), a test name filters the tests, and
        /// what follows a second `--` goes to each binary (`--nocapture`).
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
    /// Build the container image without a registry (mmdebstrap and
    /// podman, as root): `localhost/socklb:dev` in podman's storage and
    /// target/image/socklb-dev.oci.tar; prints the image name last.
    Image,
    /// Run what ships the way it ships (needs root): the image under
    /// podman with the DaemonSet's container spec, and the systemd unit
    /// under systemd in a systemd-nspawn container.
    TestDeploy {
        /// Extra arguments for `cargo test`, after `--`.
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
    /// Run socklb on three demo backends in a child cgroup, show the spread,
    /// take one backend down and up again, and clean up (needs root).
    Demo,
    /// Measure socklb against a direct connection, HAProxy and nginx on
    /// loopback, and write bench/results/REPORT.md with charts (needs root).
    Bench {
        /// Instead, run the herd of 1,000 agents (a hung server, a rolling
        /// restart, a recovery herd) and write bench/results/FLEET.md.
        #[arg(long, conflicts_with = "kernel_cost")]
        fleet: bool,
        /// Only what socklb's programs cost per connection and the
        /// new-connection rates against direct, printed; no report.
        #[arg(long)]
        kernel_cost: bool,
        /// With --kernel-cost: measure this socklb binary (another
        /// version) instead of this tree's.
        #[arg(long, value_name = "PATH", requires = "kernel_cost")]
        socklb: Option<PathBuf>,
        /// With --kernel-cost: run socklb with this `socket-table-size`
        /// (the array layout takes half as many slots, rounded up to a
        /// power of two), to measure what the table's size costs.
        #[arg(long, value_name = "SOCKETS", requires = "kernel_cost")]
        socket_table_size: Option<u32>,
    },
    /// Run socklb for N minutes under a seeded schedule of overlapping
    /// faults, check every invariant, and write bench/results/SOAK.md
    /// (needs root).
    Soak {
        #[arg(long, default_value_t = 30)]
        minutes: u64,
        /// Replays the schedule of an earlier run.
        #[arg(long)]
        seed: Option<u64>,
        /// Where the report goes.
        #[arg(long, default_value = "bench/results/SOAK.md")]
        report: PathBuf,
    },
    /// Build the older socklb versions that tests/tests/upgrade.rs
    /// upgrades from, once each: target/old-<commit>/socklb. `cargo xtask
    /// test` runs it in the background.
    OldVersions,
    /// Fuzz the config parser (TOML and flags) with cargo-fuzz, each target
    /// for a bounded time.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u32,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Verb::BuildEbpf => toolchain::build_ebpf(),
        Verb::Build => build_all(),
        Verb::Check => check::run(),
        Verb::Test {
            release_in_background,
            jobs,
            cargo_args,
        } => test(release_in_background, jobs, &cargo_args),
        Verb::Image => {
            let image = image::build()?;
            println!("{image}");
            Ok(())
        }
        Verb::TestDeploy { cargo_args } => deploy::test(&cargo_args),
        Verb::Demo => {
            build_all()?;
            demo::run(&workspace_root())
        }
        Verb::Bench {
            kernel_cost: true,
            socklb,
            socket_table_size,
            ..
        } => bench::run_kernel_cost(&workspace_root(), socklb, socket_table_size),
        Verb::Bench { fleet: true, .. } => bench::fleet::run(&workspace_root()),
        Verb::Bench { .. } => bench::run(&workspace_root()),
        Verb::Fuzz { seconds } => fuzz::run(seconds),
        Verb::OldVersions => old_versions(),
        Verb::Soak {
            minutes,
            seed,
            report,
        } => {
            if is_root() {
                toolchain::install_debian_packages(TEST_PACKAGES)?;
            }
            build_all()?;
            // The daemon as it ships, a release build: its memory is judged
            // over the run, and a debug build's frames and allocations are
            // not what a node runs. A SOCKLB_BIN already set is kept.
            if std::env::var_os("SOCKLB_BIN").is_none() {
                bench::build_release(&workspace_root(), &[])?;
            }
            soak::run(&soak::Options {
                minutes,
                seed,
                report: workspace_root().join(report),
            })
        }
    }
}

/// The workspace root (the parent of xtask/).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Runs a command, failing with its name when it fails.
pub fn run_checked(command: &mut Command) -> Result<()> {
    let shown = format!("{command:?}");
    let status = command
        .status()
        .with_context(|| format!("starting {shown}"))?;
    if !status.success() {
        bail!("{shown} failed with {status}");
    }
    Ok(())
}

/// The last `count` lines of `text`, in order: the end of a tool's log.
pub fn last_lines(text: &str, count: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(count)..].join("\n")
}

/// The stable cargo, without the variables that `cargo run` set for the
/// xtask itself: some build scripts (ring's) watch them, so a cargo started
/// here with them would rebuild half the tree that a plain `cargo` command
/// built, and the other way round.
pub fn cargo() -> Command {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command.current_dir(workspace_root());
    socklb_tests::without_cargo_run_variables(&mut command);
    command
}

pub fn build_all() -> Result<()> {
    toolchain::build_ebpf()?;
    println!("xtask: building socklb and the test helpers");
    run_checked(cargo().args([
        "build",
        "--bins",
        "--package",
        "lb-userspace",
        "--package",
        "socklb-tests",
    ]))
}

/// Debian packages the tests use, with a command that shows each is there.
const TEST_PACKAGES: &[(&str, &str)] = &[
    ("bpftool", "bpftool"),
    ("iproute2", "ip"),
    ("iptables", "iptables"),
    ("etcd-server", "etcd"),
    ("etcd-client", "etcdctl"),
    // deploy.rs: setpriv runs socklb with exactly the DaemonSet's
    // capabilities; systemd-analyze verifies the unit file.
    ("util-linux", "setpriv"),
    ("systemd", "systemd-analyze"),
    // accel.rs: nginx with sendfile fetched by curl, TLS with openssl.
    ("nginx", "nginx"),
    ("curl", "curl"),
    ("openssl", "openssl"),
];

fn test(release_in_background: bool, jobs: usize, cargo_args: &[String]) -> Result<()> {
    if !is_root() {
        bail!("cargo xtask test loads eBPF programs and creates cgroups: run it as root");
    }
    toolchain::install_debian_packages(TEST_PACKAGES)?;
    // The soak's seed is checked before anything is built.
    let soak_seed = soak_seed_in_test(std::env::var("SOCKLB_SOAK_SEED").ok().as_deref())?;
    let (build_args, binary_args) = suites::split_args(cargo_args);
    // The fuzz pass starts now, in the background: it takes the CPU that
    // the builds, and then the suites, leave. The toolchains first, in the
    // foreground: two rustup installs of nightly at once are not safe.
    toolchain::ensure_ebpf_toolchain()?;
    let fuzz = start_fuzz()?;
    // The Python environment (packages from the network) while socklb
    // builds.
    let python = std::thread::scope(|scope| {
        let python = scope.spawn(toolchain::ensure_python_env);
        let built = build_all();
        let python = python.join().expect("the Python environment's thread");
        built.and(python)
    })?;
    println!("xtask: building the tests");
    let suites = suites::build(&build_args)?;
    if !suites::selects_targets(&build_args) {
        // Doc tests have no binary of their own to run; they are quick.
        run_checked(cargo().args(["test", "--workspace", "--exclude", "lb-ebpf", "--doc"]))?;
    }
    // Now that the workspace's dependencies are built, and nothing else
    // builds in its target directory, which the old versions share.
    let old_versions = std::sync::Mutex::new(
        suites::wants_old_versions(&suites, &binary_args)
            .then(start_old_versions)
            .transpose()?,
    );
    // upgrade.rs starts once they are built (and fails with their log if
    // they could not be): built in a tree of its own, they would take it
    // minutes more.
    let old_versions_built = || {
        let building = old_versions.lock().expect("old versions").take();
        building.map_or(Ok(()), background::Background::finish)
    };
    let release = release_in_background
        .then(image::start_release_build)
        .transpose()?;
    sweep_leftovers();
    let target = workspace_root().join("target/debug");
    // The scenario suites append their figures here; printed at the end.
    let figures = workspace_root().join("target/scenario-figures.txt");
    let _ = std::fs::remove_file(&figures);
    let environment = |command: &mut Command| {
        command
            .env("SOCKLB_BIN", target.join("socklb"))
            .env("LBCLIENT_BIN", target.join("lbclient"))
            .env("SOCKLB_PYTHON", &python)
            .env("SOCKLB_FIGURES", &figures)
            // Every test runs for real: a missing privilege or prerequisite
            // fails it instead of skipping it.
            .env(socklb_tests::NO_SKIP_ENV, "1");
    };
    let ready = |suite: &suites::Suite| {
        if suite.source == suites::UPGRADE {
            old_versions_built()
        } else {
            Ok(())
        }
    };
    let hooks = suites::Hooks {
        environment: &environment,
        ready: &ready,
    };
    suites::run(suites, &binary_args, jobs, &hooks)?;
    if let Ok(text) = std::fs::read_to_string(&figures) {
        println!("xtask: scenario figures\n{text}");
    }
    old_versions_built()?;
    // The soak runs alone: its bounds come from 500 ms probes, and beside
    // other work (the fuzz pass, a build, a suite) servers that had no
    // fault missed probes (4f91edd's CI run: 2 violations). Only
    // `--release-in-background`'s build, in the idle class, may still run.
    fuzz.finish()?;
    // The invariants under overlapping faults, on every change. One fixed
    // schedule, so that a red run means the change broke a promise, not
    // that a new draw found an old problem: new draws are `cargo xtask
    // soak`'s job. SOCKLB_SOAK_SEED replays another seed, or draws a new
    // one with "random".
    soak::run(&soak::Options {
        minutes: SOAK_MINUTES_IN_TEST,
        seed: soak_seed,
        report: workspace_root().join("target/soak/SOAK.md"),
    })?;
    release.map_or(Ok(()), background::Background::finish)
}

/// Builds the old versions that upgrade.rs upgrades from, in the
/// background: minutes of building on a fresh machine, which upgrade.rs,
/// started last, waits for if it must. Nothing else may build in the
/// workspace's debug directory meanwhile (cargo would wait for the
/// build's lock).
fn start_old_versions() -> Result<background::Background> {
    let mut command = Command::new(std::env::current_exe()?);
    command.arg("old-versions");
    background::Background::start(
        "building upgrade.rs's old versions",
        command,
        workspace_root().join("target/old-versions.log"),
    )
}

/// A short bounded fuzz pass, in the background; `cargo xtask fuzz
/// --seconds N` runs longer.
fn start_fuzz() -> Result<background::Background> {
    let mut command = Command::new(std::env::current_exe()?);
    command.args(["fuzz", "--seconds", &FUZZ_SECONDS_IN_TEST.to_string()]);
    background::Background::start(
        "the fuzz pass",
        command,
        workspace_root().join("target/fuzz.log"),
    )
}

/// `cargo xtask old-versions`: each older socklb that upgrade.rs upgrades
/// from, built once into target/old-<commit>/socklb, in this workspace's
/// target directory so that it reuses the dependencies built there.
fn old_versions() -> Result<()> {
    toolchain::ensure_ebpf_toolchain()?;
    let target = workspace_root().join("target");
    for commit in socklb_tests::OLD_COMMITS {
        let binary =
            socklb_tests::old_socklb_bin_in(&target, commit, socklb_tests::BuildTree::Workspace);
        println!("{}", binary.display());
    }
    Ok(())
}

/// `cargo test` arguments that run one test at a time, unless the caller
/// gave its own after `--`: the suites measure detection times on a 2-core
/// machine, and parallel daemons and herds would measure each other.
pub fn one_test_at_a_time(cargo_args: &[String]) -> Vec<String> {
    let mut test_args: Vec<String> = cargo_args.to_vec();
    if !test_args.iter().any(|arg| arg == "--") {
        test_args.extend(["--".to_string(), "--test-threads=1".to_string()]);
    }
    test_args
}

/// Minutes of the soak in `cargo xtask test` (`cargo xtask soak` runs 30).
const SOAK_MINUTES_IN_TEST: u64 = 2;

/// The schedule of the soak in `cargo xtask test`: 15 faults of 14 kinds
/// in 2 minutes: servers killed, restarted, blackholed and flapping; the
/// daemon killed, stopped and upgraded; a valid and an invalid reload; a
/// link detached and a pin removed; a 410 Gone and an emptied slice; the
/// daemon's CPU starved.
const SOAK_SEED_IN_TEST: u64 = 2731;

/// The seed `cargo xtask test` soaks with: its own, SOCKLB_SOAK_SEED's,
/// or none (a new draw) for "random".
fn soak_seed_in_test(env: Option<&str>) -> Result<Option<u64>> {
    match env {
        None | Some("") => Ok(Some(SOAK_SEED_IN_TEST)),
        Some("random") => Ok(None),
        Some(seed) => seed
            .parse()
            .map(Some)
            .with_context(|| format!("SOCKLB_SOAK_SEED={seed}: a number, or \"random\"")),
    }
}

/// Seconds per fuzz target in `cargo xtask test`.
const FUZZ_SECONDS_IN_TEST: u32 = 20;

/// Removes what a test run that was killed (SIGKILL, Ctrl-C) left behind:
/// pin directories and cgroups named socklb-test-*, and the namespaces of
/// test clusters. Only those names are touched, and only those of a test
/// process that is gone: a run of another checkout on this machine keeps
/// its own. A cgroup that still holds a process is left alone with a
/// warning.
pub fn sweep_leftovers() {
    if let Ok(entries) = std::fs::read_dir("/sys/fs/bpf") {
        for entry in entries.flatten() {
            if is_leftover(&entry.file_name().to_string_lossy()) {
                println!("xtask: removing leftover pins {}", entry.path().display());
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    // Lock files and control sockets of test installs: their names are the
    // pin paths, escaped (`-` as `\x2d`).
    if let Ok(entries) = std::fs::read_dir(socklb::dataplane::lock::RUN_DIR) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().replace("\\x2d", "-");
            if let Some(start) = name.find("socklb-test-") {
                let stem = name[start..]
                    .rsplit_once('.')
                    .map_or(&name[start..], |(stem, _)| stem);
                if is_leftover(stem) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }
    // The v2 hierarchy, and the v1 memory controller (hostile_sources.rs
    // runs a daemon under a memory limit there).
    let roots = [
        socklb::cgroup::v2_root().ok(),
        Some(PathBuf::from("/sys/fs/cgroup/memory")),
    ];
    for root in roots.into_iter().flatten() {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for entry in entries.flatten() {
            if is_leftover(&entry.file_name().to_string_lossy())
                && remove_cgroup_tree(&entry.path()).is_err()
            {
                println!(
                    "xtask: warning: leftover cgroup {} still has processes",
                    entry.path().display()
                );
            }
        }
    }
    let namespaces = Command::new("ip").args(["netns", "list"]).output();
    for line in namespaces.iter().flat_map(|output| {
        String::from_utf8_lossy(&output.stdout)
            .into_owned()
            .lines()
            .map(str::to_string)
            .collect::<Vec<_>>()
    }) {
        let name = line.split_whitespace().next().unwrap_or_default();
        // Test clusters name them socklb-<pid>x<n>-sw and socklb-<pid>x<n>-s<i>
        // (the PID modulo 100,000). The switch never holds a process, so
        // an empty namespace is a leftover only once its test is gone.
        let owner = name
            .strip_prefix("socklb-")
            .and_then(|rest| rest.split_once('x'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok());
        let cluster = owner.is_some() && (name.ends_with("-sw") || name.contains("-s"));
        if cluster && owner.is_some_and(|pid| !cluster_owner_alive(pid)) && namespace_is_empty(name)
        {
            println!("xtask: removing leftover namespace {name}");
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

/// Whether a name made by the tests' `unique_name`
/// (`socklb-test-<label>-<pid>-<n>`) belongs to a process that is gone.
pub fn is_leftover(name: &str) -> bool {
    if !name.starts_with("socklb-test-") {
        return false;
    }
    let mut parts = name.rsplit('-');
    let _serial = parts.next();
    match parts.next().and_then(|pid| pid.parse::<u32>().ok()) {
        Some(pid) => !Path::new(&format!("/proc/{pid}")).exists(),
        None => true,
    }
}

/// Whether a process whose PID modulo 100,000 is `tag` still runs (a test
/// cluster's tag).
fn cluster_owner_alive(tag: u32) -> bool {
    std::fs::read_dir("/proc").is_ok_and(|entries| {
        entries.flatten().any(|entry| {
            entry
                .file_name()
                .to_str()
                .and_then(|name| name.parse::<u32>().ok())
                .is_some_and(|pid| pid % 100_000 == tag)
        })
    })
}

/// Whether no process runs in a named network namespace.
fn namespace_is_empty(name: &str) -> bool {
    Command::new("ip")
        .args(["netns", "pids", name])
        .output()
        .is_ok_and(|output| output.status.success() && output.stdout.trim_ascii().is_empty())
}

/// Removes a cgroup directory and its children, deepest first.
pub fn remove_cgroup_tree(path: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(path)?.flatten() {
        if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            remove_cgroup_tree(&entry.path())?;
        }
    }
    println!("xtask: removing leftover cgroup {}", path.display());
    std::fs::remove_dir(path)
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| String::from_utf8_lossy(&output.stdout).trim() == "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tests_soak_has_its_own_seed_unless_told() {
        assert_eq!(soak_seed_in_test(None).unwrap(), Some(SOAK_SEED_IN_TEST));
        assert_eq!(
            soak_seed_in_test(Some("")).unwrap(),
            Some(SOAK_SEED_IN_TEST)
        );
        assert_eq!(soak_seed_in_test(Some("57")).unwrap(), Some(57));
        assert_eq!(soak_seed_in_test(Some("random")).unwrap(), None);
        let error = soak_seed_in_test(Some("x")).unwrap_err().to_string();
        assert!(error.contains("SOCKLB_SOAK_SEED=x"), "{error}");
    }
}
