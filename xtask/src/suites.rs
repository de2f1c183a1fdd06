//! The test binaries of `cargo xtask test`: built once with `cargo test
//! --no-run`, then run here, each with one test at a time, and up to
//! `--jobs` binaries (two by default) at once.
//!
//! Why not `cargo test`: it runs one binary after the other, and the
//! privileged suites mostly wait on the daemon's timers (probe intervals,
//! detection bounds, drains), not on the CPU. On the 2-core machine, two
//! lanes ran every suite in 440 s against 815 s for one, and each suite
//! took about as long as alone (herd 93 s against 95, scenarios 48 against
//! 47). Three lanes took 332 s, but in a clean-clone CI run on a slow
//! day operations.rs then saw an added backend serve after 2.47 s against
//! its promised 2 s, so two is the default (`--jobs 3` is there to try).
//! Four lanes took 195 s with the old versions already built, and showed
//! an exact count in upgrade.rs that assumed too much (fixed). Inside a
//! binary the tests still run one at a time: many of them share a
//! fixture, and the test harness would run them on threads of one
//! process.

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{cargo, workspace_root};

/// One test binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suite {
    /// Its source, from the workspace root: `tests/tests/upgrade.rs`.
    pub source: String,
    pub executable: PathBuf,
    /// Where `cargo test` would run it: its package's directory.
    pub package_dir: PathBuf,
}

/// The upgrade suite, which needs the old versions built.
pub const UPGRADE: &str = "tests/tests/upgrade.rs";

/// Whether this run needs the old versions upgrade.rs upgrades from: it
/// runs upgrade.rs, and no test name narrows what each binary runs.
pub fn wants_old_versions(suites: &[Suite], binary_args: &[String]) -> bool {
    suites.iter().any(|suite| suite.source == UPGRADE) && !names_tests(binary_args)
}

/// The test harness's options that take a value in the next argument.
const HARNESS_OPTIONS_WITH_A_VALUE: &[&str] = &[
    "--skip",
    "--logfile",
    "--format",
    "--color",
    "-Z",
    "--test-threads",
    "--shuffle-seed",
];

/// Whether the binaries' arguments name tests (`cargo test vip`), so that
/// each binary runs only some of its tests.
fn names_tests(binary_args: &[String]) -> bool {
    binary_args.iter().enumerate().any(|(at, arg)| {
        let is_a_value =
            at > 0 && HARNESS_OPTIONS_WITH_A_VALUE.contains(&binary_args[at - 1].as_str());
        !arg.starts_with('-') && !is_a_value
    })
}

/// How long each of the longest suites took in a clean-clone CI run (one
/// lane, 036c23c). Only the order matters: the longest start first, so
/// that no long suite starts last and runs alone. Unlisted suites are
/// short and go after them, and [`STARTS_LAST`] after every other.
const SECONDS_IN_CI: &[(&str, u32)] = &[
    ("tests/tests/herd.rs", 95),
    ("tests/tests/hardening.rs", 92),
    ("tests/tests/socket_table.rs", 60),
    ("tests/tests/operations.rs", 56),
    ("tests/tests/passive.rs", 53),
    ("tests/tests/hostile_sources.rs", 51),
    ("tests/tests/fleet.rs", 50),
    ("tests/tests/accel.rs", 47),
    ("tests/tests/scenarios.rs", 47),
    ("tests/tests/hand_back.rs", 40),
    ("tests/tests/etcd.rs", 24),
    ("tests/tests/redirect.rs", 14),
    ("tests/tests/lifecycle.rs", 11),
    ("tests/tests/discovery.rs", 8),
    ("tests/tests/counts.rs", 6),
    ("tests/tests/hostile_clients.rs", 5),
    ("tests/tests/degraded.rs", 4),
    ("tests/tests/kubeapi.rs", 3),
    ("tests/tests/deploy.rs", 2),
];

/// The suites that start after every other: upgrade.rs, whose two tests
/// take 20 s once the old versions it upgrades from are built, and those
/// take minutes on a fresh machine. They build in the background while the
/// other suites run (`cargo xtask old-versions`, in the idle scheduling
/// class), and upgrade.rs waits for them (`Hooks::ready`). Run first, as
/// before, it held a lane for 432 s, 413 of them building (e3433e8's
/// clean-clone CI run).
const STARTS_LAST: &[&str] = &[UPGRADE];

/// `cargo test`'s options that take a value, so that the word after one
/// is not taken for a test name.
const OPTIONS_WITH_A_VALUE: &[&str] = &[
    "-p",
    "--package",
    "--exclude",
    "--test",
    "--bin",
    "--example",
    "--bench",
    "-F",
    "--features",
    "-j",
    "--jobs",
    "--target",
    "--target-dir",
    "--profile",
    "--manifest-path",
    "--message-format",
    "--color",
    "--config",
    "-Z",
];

/// Splits `cargo xtask test -- ARGS`, read as `cargo test` reads them,
/// into the arguments of the build (`--test redirect`, `--package …`) and
/// those of each binary: a test name (`cargo test vip`), and whatever
/// follows a second `--`. Each binary runs one test at a time unless told
/// otherwise.
pub fn split_args(cargo_args: &[String]) -> (Vec<String>, Vec<String>) {
    let (options, after) = match cargo_args.iter().position(|arg| arg == "--") {
        Some(at) => (&cargo_args[..at], &cargo_args[at + 1..]),
        None => (cargo_args, &[][..]),
    };
    let mut build = Vec::new();
    let mut binary = Vec::new();
    for (at, arg) in options.iter().enumerate() {
        let is_a_value = at > 0 && OPTIONS_WITH_A_VALUE.contains(&options[at - 1].as_str());
        if arg.starts_with('-') || is_a_value {
            build.push(arg.clone());
        } else {
            binary.push(arg.clone());
        }
    }
    binary.extend_from_slice(after);
    if !binary.iter().any(|arg| arg.starts_with("--test-threads")) {
        binary.push("--test-threads=1".to_string());
    }
    (build, binary)
}

/// Whether `build_args` pick some targets (then cargo refuses `--doc`
/// beside them, and the doc tests are not asked for).
pub fn selects_targets(build_args: &[String]) -> bool {
    build_args.iter().any(|arg| {
        [
            "--test",
            "--tests",
            "--lib",
            "--bin",
            "--bins",
            "--example",
            "--bench",
        ]
        .contains(&arg.as_str())
    })
}

/// Builds every test binary of the workspace (but lb-ebpf), or those that
/// `build_args` select, and lists them.
pub fn build(build_args: &[String]) -> Result<Vec<Suite>> {
    let output = cargo()
        .args(["test", "--workspace", "--exclude", "lb-ebpf", "--no-run"])
        .arg("--message-format=json-render-diagnostics")
        .args(build_args)
        .stderr(Stdio::inherit())
        .output()
        .context("starting cargo test --no-run")?;
    if !output.status.success() {
        bail!("building the tests failed ({})", output.status);
    }
    let text = String::from_utf8(output.stdout).context("cargo's messages are not UTF-8")?;
    suites_in(&text, &workspace_root())
}

/// The test binaries among cargo's JSON messages.
fn suites_in(messages: &str, root: &Path) -> Result<Vec<Suite>> {
    let mut suites = Vec::new();
    for line in messages.lines().filter(|line| line.starts_with('{')) {
        let message: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("cargo's message {line}"))?;
        if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
            continue;
        }
        let Some(executable) = message["executable"].as_str() else {
            continue;
        };
        let field = |value: &serde_json::Value, name: &str| {
            value
                .as_str()
                .map(PathBuf::from)
                .with_context(|| format!("cargo's message has no {name}: {line}"))
        };
        let source = field(&message["target"]["src_path"], "target.src_path")?;
        let manifest = field(&message["manifest_path"], "manifest_path")?;
        suites.push(Suite {
            source: source
                .strip_prefix(root)
                .unwrap_or(&source)
                .display()
                .to_string(),
            executable: PathBuf::from(executable),
            package_dir: manifest
                .parent()
                .context("a manifest path has a directory")?
                .to_path_buf(),
        });
    }
    Ok(suites)
}

/// Longest first, by [`SECONDS_IN_CI`]; the rest after, in cargo's order;
/// then [`STARTS_LAST`].
fn in_starting_order(suites: &mut [Suite]) {
    let seconds = |suite: &Suite| {
        SECONDS_IN_CI
            .iter()
            .find(|(source, _)| *source == suite.source)
            .map_or(0, |(_, seconds)| *seconds)
    };
    let last = |suite: &Suite| {
        STARTS_LAST
            .iter()
            .position(|source| *source == suite.source)
    };
    suites.sort_by_key(|suite| (last(suite), std::cmp::Reverse(seconds(suite))));
}

/// How often the runner says which suites are still running.
const STILL_RUNNING_EVERY: Duration = Duration::from_secs(120);

/// How one suite went.
struct Outcome {
    source: String,
    passed: bool,
    took: Duration,
    log: PathBuf,
}

/// What the runner asks of its caller for each suite.
pub struct Hooks<'a> {
    /// Sets a suite's environment.
    pub environment: &'a (dyn Fn(&mut Command) + Sync),
    /// Runs before a suite starts, and may wait; an error fails the suite
    /// with it, unstarted (upgrade.rs waits here for its old versions).
    pub ready: &'a (dyn Fn(&Suite) -> Result<()> + Sync),
}

/// Runs `suites` in `jobs` lanes, longest first and [`STARTS_LAST`] last,
/// each binary with `binary_args`, once `hooks.ready` lets it, with the
/// environment `hooks.environment` sets. Each suite's output goes to
/// target/test-logs and is printed whole when it ends, so that two suites
/// never interleave. Every suite runs even when one fails; the run then
/// fails naming them.
pub fn run(
    mut suites: Vec<Suite>,
    binary_args: &[String],
    jobs: usize,
    hooks: &Hooks<'_>,
) -> Result<()> {
    let logs = workspace_root().join("target/test-logs");
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    in_starting_order(&mut suites);
    let count = suites.len();
    let jobs = jobs.clamp(1, count.max(1));
    println!(
        "xtask: running {count} test binaries, {jobs} at a time (logs in {})",
        logs.display()
    );
    let waiting = Mutex::new(VecDeque::from(suites));
    let running: Mutex<Vec<(String, Instant)>> = Mutex::new(Vec::new());
    let outcomes = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|scope| {
        let lanes: Vec<_> = (0..jobs)
            .map(|_| {
                scope.spawn(|| {
                    loop {
                        let next = waiting.lock().expect("queue").pop_front();
                        let Some(suite) = next else { break };
                        running
                            .lock()
                            .expect("running")
                            .push((suite.source.clone(), Instant::now()));
                        let outcome = run_one(&suite, binary_args, &logs, hooks);
                        running
                            .lock()
                            .expect("running")
                            .retain(|(source, _)| *source != suite.source);
                        outcomes.lock().expect("outcomes").push(outcome);
                    }
                })
            })
            .collect();
        // A suite's output shows only when it ends: say now and then what
        // runs, so that a hung test shows where it hangs.
        let mut last_said = Instant::now();
        while !lanes.iter().all(std::thread::ScopedJoinHandle::is_finished) {
            std::thread::sleep(Duration::from_millis(200));
            if last_said.elapsed() >= STILL_RUNNING_EVERY {
                last_said = Instant::now();
                let now: Vec<String> = running
                    .lock()
                    .expect("running")
                    .iter()
                    .map(|(source, since)| format!("{source} ({} s)", since.elapsed().as_secs()))
                    .collect();
                println!("xtask: still running: {}", now.join(", "));
            }
        }
    });
    let outcomes = outcomes.into_inner().expect("outcomes");
    summarise(&outcomes, started.elapsed())
}

/// Runs one suite to its end and prints its log.
fn run_one(suite: &Suite, binary_args: &[String], logs: &Path, hooks: &Hooks<'_>) -> Outcome {
    let log = logs.join(format!("{}.log", suite.source.replace('/', "_")));
    let started = Instant::now();
    if let Err(error) = (hooks.ready)(suite) {
        println!(
            "xtask: {}: FAILED before its start: {error:#}",
            suite.source
        );
        let _ = std::fs::write(&log, format!("not started: {error:#}\n"));
        return Outcome {
            source: suite.source.clone(),
            passed: false,
            took: started.elapsed(),
            log,
        };
    }
    println!("xtask: {}: started", suite.source);
    let started = Instant::now();
    let status = std::fs::File::create(&log).and_then(|file| {
        let mut command = Command::new(&suite.executable);
        command
            .args(binary_args)
            .current_dir(&suite.package_dir)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        (hooks.environment)(&mut command);
        command.status()
    });
    let took = started.elapsed();
    let (passed, verdict) = match &status {
        Ok(status) if status.success() => (true, "ok".to_string()),
        Ok(status) => (false, format!("FAILED ({status})")),
        Err(error) => {
            let _ = std::fs::write(
                &log,
                format!("could not run {}: {error}\n", suite.executable.display()),
            );
            (false, "FAILED (not started)".to_string())
        }
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    // One print, so that lanes never interleave within a suite's log.
    println!(
        "xtask: ── {} ({}) ──\n{text}xtask: {}: {verdict} in {:.1} s",
        suite.source,
        suite.executable.display(),
        suite.source,
        took.as_secs_f64()
    );
    Outcome {
        source: suite.source.clone(),
        passed,
        took,
        log,
    }
}

/// Prints each suite's time, longest first, and fails naming the suites
/// that failed.
fn summarise(outcomes: &[Outcome], wall: Duration) -> Result<()> {
    let mut by_time: Vec<&Outcome> = outcomes.iter().collect();
    by_time.sort_by_key(|outcome| std::cmp::Reverse(outcome.took));
    let sum: Duration = outcomes.iter().map(|outcome| outcome.took).sum();
    println!(
        "xtask: {} test binaries in {:.0} s ({:.0} s one after the other):",
        outcomes.len(),
        wall.as_secs_f64(),
        sum.as_secs_f64()
    );
    for outcome in &by_time {
        let verdict = if outcome.passed { "ok" } else { "FAILED" };
        println!(
            "  {:>6.1} s  {verdict:<6}  {}",
            outcome.took.as_secs_f64(),
            outcome.source
        );
    }
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|outcome| !outcome.passed)
        .map(|outcome| format!("{} (log: {})", outcome.source, outcome.log.display()))
        .collect();
    if !failed.is_empty() {
        bail!(
            "{} test binaries failed:\n  {}",
            failed.len(),
            failed.join("\n  ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_binary_runs_one_test_at_a_time_unless_told() {
        let args = |list: &[&str]| list.iter().map(ToString::to_string).collect::<Vec<_>>();
        assert_eq!(
            split_args(&args(&["--test", "redirect"])),
            (args(&["--test", "redirect"]), args(&["--test-threads=1"]))
        );
        assert_eq!(
            split_args(&args(&["--test", "redirect", "--", "--nocapture", "vip"])),
            (
                args(&["--test", "redirect"]),
                args(&["--nocapture", "vip", "--test-threads=1"])
            )
        );
        assert_eq!(
            split_args(&args(&["--", "--test-threads=4"])),
            (args(&[]), args(&["--test-threads=4"]))
        );
        // A test name, as `cargo test vip` takes it; an option's value is
        // no name.
        assert_eq!(
            split_args(&args(&["-p", "socklb-tests", "vip", "--", "--nocapture"])),
            (
                args(&["-p", "socklb-tests"]),
                args(&["vip", "--nocapture", "--test-threads=1"])
            )
        );
        assert!(selects_targets(&args(&["--test", "redirect"])));
        assert!(!selects_targets(&args(&[
            "--no-fail-fast",
            "-p",
            "socklb-tests"
        ])));
    }

    #[test]
    fn test_binaries_are_found_among_cargos_messages_longest_first() {
        let artifact = |kind: &str, source: &str, test: bool, executable: Option<&str>| {
            serde_json::json!({
                "reason": "compiler-artifact",
                "manifest_path": "/w/tests/Cargo.toml",
                "target": { "kind": [kind], "name": "x", "src_path": source },
                "profile": { "test": test },
                "executable": executable,
            })
            .to_string()
        };
        let messages = [
            artifact(
                "lib",
                "/w/tests/src/lib.rs",
                true,
                Some("/w/target/debug/deps/lib-1"),
            ),
            // A library built for the tests, not a test: no executable.
            artifact("lib", "/w/lb-common/src/lib.rs", false, None),
            // A helper binary that the tests run, not a test.
            artifact(
                "bin",
                "/w/tests/src/bin/lbclient.rs",
                false,
                Some("/w/target/debug/lbclient"),
            ),
            artifact(
                "test",
                "/w/tests/tests/redirect.rs",
                true,
                Some("/w/target/debug/deps/redirect-2"),
            ),
            artifact(
                "test",
                "/w/tests/tests/upgrade.rs",
                true,
                Some("/w/target/debug/deps/upgrade-3"),
            ),
            r#"{"reason":"build-finished","success":true}"#.to_string(),
        ]
        .join("\n");
        let mut suites = suites_in(&messages, Path::new("/w")).expect("cargo's messages");
        in_starting_order(&mut suites);
        let sources: Vec<&str> = suites.iter().map(|suite| suite.source.as_str()).collect();
        // upgrade.rs waits for its old versions: it goes last.
        assert_eq!(
            sources,
            [
                "tests/tests/redirect.rs",
                "tests/src/lib.rs",
                "tests/tests/upgrade.rs",
            ]
        );
        let upgrade = &suites[2];
        assert_eq!(
            upgrade.executable,
            Path::new("/w/target/debug/deps/upgrade-3")
        );
        assert_eq!(upgrade.package_dir, Path::new("/w/tests"));
    }

    #[test]
    fn the_old_versions_are_built_only_for_a_run_of_every_upgrade_test() {
        let args = |list: &[&str]| list.iter().map(ToString::to_string).collect::<Vec<_>>();
        let suite = |source: &str| Suite {
            source: source.to_string(),
            executable: PathBuf::from("/x"),
            package_dir: PathBuf::from("/w"),
        };
        let both = [suite("tests/tests/redirect.rs"), suite(UPGRADE)];
        let threads = args(&["--test-threads=1"]);
        assert!(wants_old_versions(&both, &threads));
        assert!(wants_old_versions(
            &both,
            &args(&["--skip", "vip", "--test-threads", "1", "--nocapture"])
        ));
        assert!(!wants_old_versions(&both[..1], &threads));
        assert!(!wants_old_versions(
            &both,
            &args(&["vip", "--test-threads=1"])
        ));
        assert!(wants_old_versions(&both, &args(&["--shuffle-seed", "7"])));
    }

    #[test]
    fn a_message_without_its_source_is_an_error_that_names_the_field() {
        let message = r#"{"reason":"compiler-artifact","profile":{"test":true},"executable":"/x","manifest_path":"/w/Cargo.toml","target":{}}"#;
        let error = suites_in(message, Path::new("/w")).expect_err("no src_path");
        assert!(
            format!("{error:#}").contains("target.src_path"),
            "{error:#}"
        );
    }
}
