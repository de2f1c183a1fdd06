//! What socklb's programs cost the kernel per connection, from the
//! kernel's BPF statistics (`kernel.bpf_stats_enabled`: run time and run
//! count of every program): for each program its ns per call and calls
//! per connection, and the total, for a connection socklb redirects and
//! for an ordinary connection from inside its cgroup (which every other
//! process of a node makes).
//!
//! The statistics cost something themselves: a clock read before and after
//! each run. What they add to each run is measured on socklb's own
//! never-attached program (`socklb_uncount`, run with BPF_PROG_TEST_RUN a
//! million times with the statistics off and on); the floor, what they
//! attribute to a run that does almost nothing, is that program's run time
//! per call. The totals are given as read and less that floor per call.

use std::{collections::BTreeMap, path::Path, time::Duration};

use anyhow::{Context, Result, bail};
use lb_common::names;

use super::{
    Bench, REPETITIONS, RUN_SECONDS, Route, Summary,
    measures::{self, BpfStats, HookPrograms, WrkLoad},
    process::{check_interrupted, in_cgroup, run_bounded},
    setup::RouteSetup,
};

/// One program's cost on one kind of connection.
#[derive(Debug, Clone)]
pub struct ProgramCost {
    pub program: String,
    pub ns_per_call: Summary,
    pub calls_per_connection: Summary,
}

/// Every program's cost on one kind of connection, and the total.
#[derive(Debug, Clone)]
pub struct PathCost {
    pub programs: Vec<ProgramCost>,
    /// BPF run time of all programs per connection, as read.
    pub total_ns: Summary,
    /// The same, less the statistics' floor for each call.
    pub net_total_ns: Summary,
    /// Calls of all programs per connection.
    pub calls: Summary,
}

/// What the statistics themselves cost.
#[derive(Debug, Clone)]
pub struct StatsOverhead {
    /// Time the statistics add to each run (on less off, BPF_PROG_TEST_RUN).
    pub added_ns: Summary,
    /// Run time the statistics report for a run of a program that does
    /// almost nothing: their own clock read, mostly.
    pub floor_ns: Summary,
}

/// The kernel cost of socklb's programs per connection.
#[derive(Debug, Clone)]
pub struct KernelCost {
    /// A connection to a VIP (wrk, `Connection: close`, 64 at a time).
    pub redirected: PathCost,
    /// A connection from inside the cgroup to another address.
    pub ordinary: PathCost,
    /// getpeername4 per call, from a client that asks it after each
    /// connect (as Go's net package does); wrk never asks.
    pub getpeername_ns: Summary,
    pub stats: Option<StatsOverhead>,
    /// socklb's daemon CPU per 10k redirected connections (it only probes).
    pub daemon_cpu_per_10k: Summary,
}

impl KernelCost {
    /// The redirected total with one getpeername per connection.
    pub fn redirected_with_getpeername(&self) -> f64 {
        self.redirected.total_ns.median + self.getpeername_ns.median
    }
}

/// Run time and run count of each program over one run.
type Counts = BTreeMap<String, (u64, u64)>;

/// What one run of the statistics saw.
struct Sample {
    counts: Counts,
    /// Connects made (runs of the connect programs).
    connections: u64,
}

/// Counts over `run`, with the statistics on only around it.
fn sample(programs: &HookPrograms, run: impl FnOnce() -> Result<()>) -> Result<Sample> {
    let stats = BpfStats::enable()?;
    let before = programs.read_each()?;
    run()?;
    let after = programs.read_each()?;
    drop(stats);
    let counts: Counts = after
        .into_iter()
        .map(|(name, (ns, runs))| {
            let (ns0, runs0) = before.get(&name).copied().unwrap_or((0, 0));
            (name, (ns.saturating_sub(ns0), runs.saturating_sub(runs0)))
        })
        .collect();
    let connections = [names::CONNECT4, names::CONNECT6]
        .iter()
        .filter_map(|name| counts.get(*name))
        .map(|(_, runs)| runs)
        .sum();
    if connections == 0 {
        bail!("socklb's connect programs did not run: is the client in its cgroup?");
    }
    Ok(Sample {
        counts,
        connections,
    })
}

/// Per program, and in all, over the rounds.
fn path_cost(samples: &[Sample], floor_ns: f64) -> PathCost {
    let names: Vec<&String> = samples
        .first()
        .map(|sample| sample.counts.keys().collect())
        .unwrap_or_default();
    let programs = names
        .into_iter()
        .map(|name| {
            let each = |value: &dyn Fn(u64, u64, u64) -> f64| -> Summary {
                Summary::of(
                    &samples
                        .iter()
                        .filter_map(|sample| {
                            let (ns, runs) = sample.counts.get(name)?;
                            Some(value(*ns, *runs, sample.connections))
                        })
                        .collect::<Vec<_>>(),
                )
            };
            ProgramCost {
                program: name.clone(),
                ns_per_call: each(&|ns, runs, _| {
                    if runs == 0 {
                        f64::NAN
                    } else {
                        ns as f64 / runs as f64
                    }
                }),
                calls_per_connection: each(&|_, runs, connections| {
                    runs as f64 / connections as f64
                }),
            }
        })
        .collect();
    let per_connection = |sample: &Sample, with_floor: bool| {
        let (ns, runs) = sample
            .counts
            .values()
            .fold((0u64, 0u64), |(ns, runs), (n, r)| (ns + n, runs + r));
        let floor = if with_floor {
            floor_ns * runs as f64
        } else {
            0.0
        };
        (ns as f64 - floor) / sample.connections as f64
    };
    PathCost {
        programs,
        total_ns: Summary::of(
            &samples
                .iter()
                .map(|s| per_connection(s, false))
                .collect::<Vec<_>>(),
        ),
        net_total_ns: Summary::of(
            &samples
                .iter()
                .map(|s| per_connection(s, true))
                .collect::<Vec<_>>(),
        ),
        calls: Summary::of(
            &samples
                .iter()
                .map(|sample| {
                    let runs: u64 = sample.counts.values().map(|(_, runs)| runs).sum();
                    runs as f64 / sample.connections as f64
                })
                .collect::<Vec<_>>(),
        ),
    }
}

/// The ordinary connection: from socklb's cgroup straight to a backend.
fn ordinary_route(bench: &Bench<'_>) -> RouteSetup {
    RouteSetup {
        route: Route::Direct,
        targets: bench.lab.route(Route::Direct).targets,
        cgroup: bench.lab.route(Route::Socklb).cgroup.clone(),
    }
}

/// Connects to a VIP that each ask getpeername once, from the cgroup.
const GETPEERNAME_CONNECTS: u32 = 20_000;

fn getpeername_run(route: &RouteSetup, scratch: &Path) -> Result<()> {
    let args: Vec<String> = [
        "connect",
        "--addr",
        &route.targets.http.to_string(),
        "--mode",
        "getpeername",
        "--count",
        &GETPEERNAME_CONNECTS.to_string(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    let program = socklb_tests::cluster::helper_bin("sockends");
    let mut command = in_cgroup(&route.cgroup, None, &program.display().to_string(), &args);
    let finished = run_bounded(&mut command, Duration::from_secs(120), scratch)?;
    if !finished.status.success() {
        bail!(
            "sockends getpeername failed ({}): {}",
            finished.status,
            finished.stderr
        );
    }
    Ok(())
}

/// Measures the kernel cost, REPETITIONS rounds, the kinds of connection
/// taking turns within each round.
pub fn measure(bench: &mut Bench<'_>) -> Result<KernelCost> {
    let load = WrkLoad {
        threads: 2,
        connections: 64,
        seconds: RUN_SECONDS,
        close: true,
        cpu: None,
    };
    let programs = HookPrograms::of(&bench.lab.daemon)?;
    let ordinary = ordinary_route(bench);
    let (mut redirected, mut plain, mut peer, mut daemon_cpu) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    println!(
        "bench: kernel cost per connection ({REPETITIONS} rounds: redirected, ordinary, getpeername)"
    );
    for _ in 0..REPETITIONS {
        check_interrupted()?;
        let daemon_pid = bench.lab.daemon.pid();
        let daemon_before = super::process::cpu_seconds(daemon_pid);
        let mut requests = 0;
        redirected.push(sample(&programs, || {
            requests = bench.wrk(Route::Socklb, load)?.requests;
            Ok(())
        })?);
        let used = super::process::cpu_seconds(daemon_pid) - daemon_before;
        daemon_cpu.push(used / requests.max(1) as f64 * 1e4);
        plain.push(sample(&programs, || {
            measures::wrk(&ordinary, load, bench.scratch).map(drop)
        })?);
        let counts = sample(&programs, || {
            getpeername_run(bench.lab.route(Route::Socklb), bench.scratch)
        })?
        .counts;
        if let Some((ns, runs)) = counts
            .get(names::GETPEERNAME4)
            .filter(|(_, runs)| *runs > 0)
        {
            peer.push(*ns as f64 / *runs as f64);
        }
        bench.lab.ensure_running()?;
    }
    let stats = stats_overhead(&programs, bench.scratch)
        .map_err(|error| eprintln!("bench: the statistics' own cost not measured: {error:#}"))
        .ok();
    let floor = stats.as_ref().map_or(0.0, |stats| stats.floor_ns.median);
    let cost = KernelCost {
        redirected: path_cost(&redirected, floor),
        ordinary: path_cost(&plain, floor),
        getpeername_ns: Summary::of(&peer),
        stats,
        daemon_cpu_per_10k: Summary::of(&daemon_cpu),
    };
    println!(
        "bench:   BPF per redirected connection {} ns ({} calls), per ordinary connection {} ns ({} calls); getpeername {} ns per call",
        super::report::number(cost.redirected.total_ns.median),
        super::report::number(cost.redirected.calls.median),
        super::report::number(cost.ordinary.total_ns.median),
        super::report::number(cost.ordinary.calls.median),
        super::report::number(cost.getpeername_ns.median),
    );
    Ok(cost)
}

/// Runs of each test run of `socklb_uncount`.
const TEST_RUN_REPEAT: u32 = 1_000_000;

/// The statistics' own cost, on `socklb_uncount` given a backend id past
/// the end (it reads the input, looks the counter up, finds none, and
/// returns): its average duration with the statistics off and on, and
/// their reading of its run time.
fn stats_overhead(programs: &HookPrograms, scratch: &Path) -> Result<StatsOverhead> {
    let id = programs
        .uncount
        .context("this socklb has no socklb_uncount program")?;
    let input = scratch.join("uncount-input");
    let mut bytes = [0u8; 14];
    bytes[..4].copy_from_slice(&u32::MAX.to_ne_bytes());
    std::fs::write(&input, bytes).context("writing the test run's input")?;
    let run = || -> Result<f64> {
        let shown = measures::bpftool(&[
            "prog",
            "run",
            "id",
            &id.to_string(),
            "data_in",
            &input.display().to_string(),
            "repeat",
            &TEST_RUN_REPEAT.to_string(),
        ])?;
        shown["duration"]
            .as_f64()
            .context("no duration in bpftool prog run's answer")
    };
    let (mut added, mut floor) = (Vec::new(), Vec::new());
    for _ in 0..REPETITIONS {
        check_interrupted()?;
        let off = run()?;
        let stats = BpfStats::enable()?;
        let before = programs.read_id(id)?;
        let on = run()?;
        let after = programs.read_id(id)?;
        drop(stats);
        let runs = after.1.saturating_sub(before.1);
        if runs == 0 {
            bail!("the statistics counted no run of socklb_uncount");
        }
        added.push(on - off);
        floor.push(after.0.saturating_sub(before.0) as f64 / runs as f64);
    }
    Ok(StatsOverhead {
        added_ns: Summary::of(&added),
        floor_ns: Summary::of(&floor),
    })
}
