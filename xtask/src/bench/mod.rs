//! `cargo xtask bench`: socklb against a direct connection, HAProxy and an
//! nginx stream proxy, on the same loopback backends in one run.
//!
//! Each figure is the median of [`REPETITIONS`] runs, with their min and
//! max. The routes take turns within each repetition, so that a slow moment
//! of this shared machine falls on all of them alike, and every ratio
//! compares figures of the same run. A benchmark is never a timed test: the
//! issue's targets are reported as met or missed, and nothing fails on them.

mod charts;
pub mod fleet;
mod kernel_cost;
mod measures;
mod micro;
mod process;
mod report;
mod setup;
mod tools;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Result, bail};

use self::{
    measures::{HookCounters, HookPrograms, WrkLoad},
    process::{ScratchDir, check_interrupted},
    setup::Lab,
};

/// Runs of each measure on each route.
pub const REPETITIONS: usize = 5;
/// Seconds of each wrk, sockperf and iperf3 run.
const RUN_SECONDS: u32 = 3;
/// The CPU that the single-flow measures (one connection) run on: client,
/// backends and proxies alike.
const SINGLE_FLOW_CPU: usize = 0;
/// The client's CPU in the measures of client and server on different
/// CPUs.
const OTHER_CPU: usize = 1;

/// One way from a client to the backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Route {
    /// The client connects to the backend itself.
    Direct,
    /// The client connects to a VIP; socklb's connect() hook rewrites it.
    Socklb,
    /// As socklb, to a service with `accelerate = "sockmap"` whose
    /// backends run in socklb's cgroup: data moves socket to socket.
    Sockmap,
    Haproxy,
    Nginx,
}

impl Route {
    pub const ALL: [Route; 5] = [
        Route::Direct,
        Route::Socklb,
        Route::Sockmap,
        Route::Haproxy,
        Route::Nginx,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Socklb => "socklb",
            Self::Sockmap => "socklb+sockmap",
            Self::Haproxy => "HAProxy",
            Self::Nginx => "nginx",
        }
    }
}

/// What is measured, with its unit and direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    NewConnections1,
    NewConnections64,
    KeepAlive64,
    LatencyP50,
    LatencyP99,
    /// Client on one CPU, servers on the other.
    LatencyP50Split,
    LatencyP99Split,
    Throughput1,
    Throughput4,
    CpuPer10k,
    /// Busy CPU time of the whole machine (/proc/stat) per 10k keep-alive
    /// requests: client, servers, proxies and the kernel's TCP work.
    MachineCpuPer10k,
}

impl Measure {
    /// File name of its chart.
    pub fn key(self) -> &'static str {
        match self {
            Self::NewConnections1 => "new_connections_c1",
            Self::NewConnections64 => "new_connections_c64",
            Self::KeepAlive64 => "keepalive_c64",
            Self::LatencyP50 => "latency_p50",
            Self::LatencyP99 => "latency_p99",
            Self::LatencyP50Split => "latency_p50_two_cpus",
            Self::LatencyP99Split => "latency_p99_two_cpus",
            Self::Throughput1 => "throughput_p1",
            Self::Throughput4 => "throughput_p4",
            Self::CpuPer10k => "cpu_per_10k_requests",
            Self::MachineCpuPer10k => "machine_cpu_per_10k_keepalive",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Self::NewConnections1 => {
                "New-connection request rate, 1 connection (wrk, Connection: close)"
            }
            Self::NewConnections64 => {
                "New-connection request rate, 64 connections (wrk, Connection: close)"
            }
            Self::KeepAlive64 => "Keep-alive request rate, 64 connections (wrk)",
            Self::LatencyP50 => "Request/response round trip p50 (sockperf ping-pong, TCP)",
            Self::LatencyP99 => "Request/response round trip p99 (sockperf ping-pong, TCP)",
            Self::LatencyP50Split => {
                "Round trip p50, client and server on different CPUs (sockperf ping-pong)"
            }
            Self::LatencyP99Split => {
                "Round trip p99, client and server on different CPUs (sockperf ping-pong)"
            }
            Self::Throughput1 => "Bulk throughput, 1 stream (iperf3)",
            Self::Throughput4 => "Bulk throughput, 4 streams (iperf3 -P 4)",
            Self::CpuPer10k => {
                "CPU seconds per 10,000 new-connection requests, in the proxy or socklb's programs"
            }
            Self::MachineCpuPer10k => {
                "Machine CPU seconds per 10,000 keep-alive requests (wrk, 64 connections, /proc/stat)"
            }
        }
    }

    pub fn unit(self) -> &'static str {
        match self {
            Self::NewConnections1 | Self::NewConnections64 | Self::KeepAlive64 => "requests/s",
            Self::LatencyP50 | Self::LatencyP99 | Self::LatencyP50Split | Self::LatencyP99Split => {
                "µs"
            }
            Self::Throughput1 | Self::Throughput4 => "Gbit/s",
            Self::CpuPer10k | Self::MachineCpuPer10k => "CPU-s / 10k requests",
        }
    }

    pub fn higher_is_better(self) -> bool {
        !matches!(
            self,
            Self::LatencyP50
                | Self::LatencyP99
                | Self::LatencyP50Split
                | Self::LatencyP99Split
                | Self::CpuPer10k
                | Self::MachineCpuPer10k
        )
    }
}

/// Median, min and max of some runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub runs: usize,
}

impl Summary {
    pub fn of(values: &[f64]) -> Self {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let runs = sorted.len();
        let median = match runs {
            0 => f64::NAN,
            _ if runs % 2 == 1 => sorted[runs / 2],
            _ => (sorted[runs / 2 - 1] + sorted[runs / 2]) / 2.0,
        };
        Self {
            median,
            min: sorted.first().copied().unwrap_or(f64::NAN),
            max: sorted.last().copied().unwrap_or(f64::NAN),
            runs,
        }
    }
}

/// Every route's runs of one measure.
#[derive(Debug, Clone)]
pub struct Series {
    pub measure: Measure,
    pub samples: Vec<(Route, Vec<f64>)>,
}

impl Series {
    pub fn summary(&self, route: Route) -> Option<Summary> {
        self.samples
            .iter()
            .find(|(candidate, values)| *candidate == route && !values.is_empty())
            .map(|(_, values)| Summary::of(values))
    }

    /// The route's median over direct's.
    pub fn ratio(&self, route: Route) -> Option<f64> {
        Some(self.summary(route)?.median / self.summary(Route::Direct)?.median)
    }
}

/// Everything the report shows.
pub struct Results {
    pub series: Vec<Series>,
    pub kernel: kernel_cost::KernelCost,
    /// Slab bytes per accelerated connection, beyond a socklb connection
    /// without acceleration.
    pub accelerated_memory: Summary,
    pub wrk_errors: Vec<(Route, u64, u64)>,
    pub footprint: measures::Footprint,
    /// The criterion figures, or why there are none.
    pub micro: Result<Vec<micro::MicroFigure>, String>,
    pub configs: Vec<(String, String)>,
    pub tools: Vec<(String, String)>,
    pub machine: Vec<(String, String)>,
    pub elapsed: Duration,
}

pub fn run(root: &Path) -> Result<()> {
    if !crate::is_root() {
        bail!(
            "cargo xtask bench loads eBPF programs, creates cgroups and sets a sysctl: run it as root"
        );
    }
    let started = Instant::now();
    process::install_interrupt_handler();
    tools::install()?;
    build_release(root, &["connclient", "sockends"])?;
    // Before the lab starts: the compiler and criterion would otherwise
    // share the CPUs with the measurements. A failure here is reported, and
    // does not cost the rest of the run.
    let micro = micro::run(&target_dir(root)).map_err(|error| format!("{error:#}"));
    if let Err(error) = &micro {
        eprintln!("bench: the criterion microbenchmarks failed: {error}");
    }
    let tools = tools::versions();
    let machine = tools::machine();

    let scratch = ScratchDir::new()?;
    let (series, kernel, wrk_errors, configs, accelerated_memory) = {
        let mut lab = Lab::start(&scratch, None)?;
        let mut bench = Bench {
            lab: &mut lab,
            scratch: &scratch.path,
            wrk_errors: Route::ALL.iter().map(|route| (*route, 0, 0)).collect(),
        };
        let (series, kernel) = bench.measure_all()?;
        let wrk_errors = bench.wrk_errors.clone();
        println!(
            "bench: kernel memory per accelerated connection ({} idle connections, 3 runs)",
            measures::MEMORY_CONNECTIONS
        );
        // A failure here costs this figure only, not the run.
        let accelerated_memory =
            measures::accelerated_connection_memory(&mut lab).unwrap_or_else(|error| {
                eprintln!(
                    "bench: kernel memory per accelerated connection not measured: {error:#}"
                );
                Summary::of(&[])
            });
        let configs = lab.configs.clone();
        println!("bench: stopping socklb, the proxies and the backends");
        (series, kernel, wrk_errors, configs, accelerated_memory)
    };
    check_interrupted()?;
    let vip_ports = [
        socklb_tests::free_port(),
        socklb_tests::free_port(),
        socklb_tests::free_port(),
    ];
    let footprint =
        measures::daemon_footprint(&scratch.path, vip_ports, socklb_tests::free_port())?;

    let results = Results {
        series,
        kernel,
        accelerated_memory,
        wrk_errors,
        footprint,
        micro,
        configs,
        tools,
        machine,
        elapsed: started.elapsed(),
    };
    let out = root.join("bench/results");
    report::write(&out, &results)?;
    charts::draw_all(&out, &results.series)?;
    report::print_summary(&results, &out);
    Ok(())
}

/// `cargo xtask bench --kernel-cost`: only what socklb's programs cost per
/// connection, and the new-connection rates against direct, printed (no
/// report written). `socklb`: measure that binary instead of this tree's,
/// for a figure of another version (the object's programs are that
/// version's; the bench is this one). `socket_table_size`: socklb's
/// `socket-table-size`, when not the default.
pub fn run_kernel_cost(
    root: &Path,
    socklb: Option<PathBuf>,
    socket_table_size: Option<u32>,
) -> Result<()> {
    if !crate::is_root() {
        bail!("cargo xtask bench loads eBPF programs and creates cgroups: run it as root");
    }
    process::install_interrupt_handler();
    tools::install()?;
    build_release(root, &["connclient", "sockends"])?;
    if let Some(binary) = &socklb {
        // SAFETY: set before any thread starts; socklb_tests reads it.
        unsafe { std::env::set_var("SOCKLB_BIN", binary) };
    }
    let scratch = ScratchDir::new()?;
    let mut lab = Lab::start(&scratch, socket_table_size)?;
    let mut bench = Bench {
        lab: &mut lab,
        scratch: &scratch.path,
        wrk_errors: Route::ALL.iter().map(|route| (*route, 0, 0)).collect(),
    };
    let rates = bench.wrk_measures(
        &[Route::Direct, Route::Socklb],
        &[Measure::NewConnections1, Measure::NewConnections64],
    )?;
    let kernel = kernel_cost::measure(&mut bench)?;
    println!("{}", report::render_kernel_cost_alone(&kernel, &rates));
    Ok(())
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// The eBPF object, then socklb in release (its daemon's CPU and memory
/// are measured; the connect() path is in the kernel either way) with
/// the test helpers a run needs; socklb_tests finds them through
/// SOCKLB_BIN and LBCLIENT_BIN.
pub fn build_release(root: &Path, helpers: &[&str]) -> Result<()> {
    crate::toolchain::build_ebpf()?;
    if helpers.is_empty() {
        println!("xtask: building socklb (release)");
    } else {
        println!(
            "xtask: building socklb and {} (release)",
            helpers.join(", ")
        );
    }
    let mut command = crate::cargo();
    command.args([
        "build",
        "--release",
        "--package",
        "lb-userspace",
        "--bin",
        "socklb",
        "--package",
        "socklb-tests",
    ]);
    for helper in helpers {
        command.args(["--bin", helper]);
    }
    crate::run_checked(&mut command)?;
    let release = target_dir(root).join("release");
    // SAFETY: set before any thread starts; socklb_tests reads them.
    unsafe {
        std::env::set_var("SOCKLB_BIN", release.join("socklb"));
        std::env::set_var("LBCLIENT_BIN", release.join("lbclient"));
    }
    Ok(())
}

struct Bench<'a> {
    lab: &'a mut Lab,
    scratch: &'a Path,
    /// (route, socket errors, non-2xx responses) summed over all wrk runs.
    wrk_errors: Vec<(Route, u64, u64)>,
}

impl Bench<'_> {
    fn measure_all(&mut self) -> Result<(Vec<Series>, kernel_cost::KernelCost)> {
        let mut series = self.wrk_measures(
            &Route::ALL,
            &[
                Measure::NewConnections1,
                Measure::NewConnections64,
                Measure::KeepAlive64,
            ],
        )?;
        series.extend(self.measure_latency()?);
        series.extend(self.measure_throughput_and_cpu()?);
        series.push(self.cpu_cost()?);
        let kernel = kernel_cost::measure(self)?;
        Ok((series, kernel))
    }

    /// Round trips (sockperf), with everything on one CPU, then with the
    /// client on the other.
    fn measure_latency(&mut self) -> Result<Vec<Series>> {
        let mut series = Vec::new();
        for (cpu, measures) in [
            (SINGLE_FLOW_CPU, [Measure::LatencyP50, Measure::LatencyP99]),
            (
                OTHER_CPU,
                [Measure::LatencyP50Split, Measure::LatencyP99Split],
            ),
        ] {
            // Servers on SINGLE_FLOW_CPU; the client on `cpu`.
            let _pinned = self.pin_servers()?;
            series.extend(self.take_turns(&Route::ALL, &measures, |bench, route| {
                let result = measures::sockperf(
                    bench.lab.route(route),
                    RUN_SECONDS,
                    Some(cpu),
                    bench.scratch,
                )?;
                Ok(vec![result.p50_us, result.p99_us])
            })?);
        }
        Ok(series)
    }

    /// Throughput (iperf3) and the machine's CPU per keep-alive request.
    fn measure_throughput_and_cpu(&mut self) -> Result<Vec<Series>> {
        let mut series = Vec::new();
        for (measure, streams) in [(Measure::Throughput1, 1), (Measure::Throughput4, 4)] {
            series.extend(self.take_turns(&Route::ALL, &[measure], |bench, route| {
                let bits =
                    measures::iperf(bench.lab.route(route), streams, RUN_SECONDS, bench.scratch)?;
                Ok(vec![bits / 1e9])
            })?);
        }
        let keep_alive = WrkLoad {
            threads: 2,
            connections: 64,
            seconds: RUN_SECONDS,
            close: false,
            cpu: None,
        };
        series.extend(self.take_turns(
            &Route::ALL,
            &[Measure::MachineCpuPer10k],
            |bench, route| {
                let before = measures::machine_busy_seconds()?;
                let run = bench.wrk(route, keep_alive)?;
                let used = measures::machine_busy_seconds()? - before;
                Ok(vec![used / run.requests.max(1) as f64 * 1e4])
            },
        )?);
        Ok(series)
    }

    /// The wrk measures (new-connection rates, keep-alive rate), the
    /// routes taking turns.
    fn wrk_measures(&mut self, routes: &[Route], measures: &[Measure]) -> Result<Vec<Series>> {
        let mut series = Vec::new();
        for measure in measures {
            let (threads, connections, close) = match measure {
                Measure::NewConnections1 => (1, 1, true),
                Measure::NewConnections64 => (2, 64, true),
                Measure::KeepAlive64 => (2, 64, false),
                other => bail!("{other:?} is not a wrk measure"),
            };
            // One connection is one flow of work: pinned, like the latency.
            let single_flow = connections == 1;
            let _pinned = single_flow.then(|| self.pin_servers()).transpose()?;
            let load = WrkLoad {
                threads,
                connections,
                seconds: RUN_SECONDS,
                close,
                cpu: single_flow.then_some(SINGLE_FLOW_CPU),
            };
            self.warm_up(routes, load)?;
            series.extend(self.take_turns(routes, &[*measure], |bench, route| {
                Ok(vec![bench.wrk(route, load)?.per_second])
            })?);
        }
        Ok(series)
    }

    /// Moves every backend and proxy thread onto SINGLE_FLOW_CPU until the
    /// guard drops. With one request in flight, whether the scheduler puts
    /// client and server on the same CPU (a wake-up of a few µs) or on
    /// different ones (tens of µs on this VM) otherwise decides the result,
    /// and it decides differently from run to run.
    fn pin_servers(&self) -> Result<process::PinnedToCpu> {
        let lab = &*self.lab;
        let threads: Vec<i32> = lab
            .backends
            .iter()
            .chain(&lab.accelerated_backends)
            .chain([&lab.haproxy, &lab.nginx_proxy])
            .flat_map(process::Supervised::threads)
            .collect();
        process::PinnedToCpu::pin(&threads, SINGLE_FLOW_CPU)
    }

    /// One short run per route, so that the first measured run does not pay
    /// for cold caches and a fresh accept queue.
    fn warm_up(&mut self, routes: &[Route], load: WrkLoad) -> Result<()> {
        for &route in routes {
            self.wrk(route, WrkLoad { seconds: 1, ..load })?;
        }
        Ok(())
    }

    fn wrk(&mut self, route: Route, load: WrkLoad) -> Result<measures::WrkRun> {
        let run = measures::wrk(self.lab.route(route), load, self.scratch)?;
        if let Some(entry) = self.wrk_errors.iter_mut().find(|entry| entry.0 == route) {
            entry.1 += run.socket_errors;
            entry.2 += run.non_2xx;
        }
        Ok(run)
    }

    /// Runs `one` REPETITIONS times on each route, the routes taking turns.
    /// `one` returns one value per measure in `measures`.
    fn take_turns(
        &mut self,
        routes: &[Route],
        measures: &[Measure],
        mut one: impl FnMut(&mut Self, Route) -> Result<Vec<f64>>,
    ) -> Result<Vec<Series>> {
        let mut series: Vec<Series> = measures
            .iter()
            .map(|measure| Series {
                measure: *measure,
                samples: routes.iter().map(|route| (*route, Vec::new())).collect(),
            })
            .collect();
        let label: Vec<&str> = measures.iter().map(|measure| measure.key()).collect();
        println!(
            "bench: {} ({REPETITIONS} rounds of {})",
            label.join(" + "),
            routes
                .iter()
                .map(|route| route.name())
                .collect::<Vec<_>>()
                .join(", ")
        );
        for _ in 0..REPETITIONS {
            for (index, route) in routes.iter().enumerate() {
                check_interrupted()?;
                let values = one(self, *route)?;
                self.lab.ensure_running()?;
                for (measured, value) in series.iter_mut().zip(values) {
                    measured.samples[index].1.push(value);
                }
            }
        }
        for measured in &series {
            let shown: Vec<String> = measured
                .samples
                .iter()
                .map(|(route, values)| {
                    format!(
                        "{} {}",
                        route.name(),
                        report::number(Summary::of(values).median)
                    )
                })
                .collect();
            println!(
                "bench:   {} median ({}): {}",
                measured.measure.key(),
                measured.measure.unit(),
                shown.join(", ")
            );
        }
        Ok(series)
    }

    /// CPU per 10k new-connection requests (wrk at 64 connections):
    /// HAProxy's and nginx's from /proc, socklb's programs' from the BPF
    /// statistics, which are on only around socklb's runs. These runs are
    /// separate from the rate runs, which ran with the statistics off.
    fn cpu_cost(&mut self) -> Result<Series> {
        let load = WrkLoad {
            threads: 2,
            connections: 64,
            seconds: RUN_SECONDS,
            close: true,
            cpu: None,
        };
        let programs = HookPrograms::of(&self.lab.daemon)?;
        let routes = [Route::Socklb, Route::Sockmap, Route::Haproxy, Route::Nginx];
        let mut series = self.take_turns(&routes, &[Measure::CpuPer10k], |bench, route| {
            let per_10k = |cpu_seconds: f64, requests: u64| cpu_seconds / requests as f64 * 1e4;
            match route {
                Route::Socklb | Route::Sockmap => {
                    // Every program of socklb, the sk_msg one included.
                    let stats = measures::BpfStats::enable()?;
                    let before = programs.read()?;
                    let run = bench.wrk(route, load)?;
                    let used: HookCounters = programs.read()?.since(before);
                    drop(stats);
                    Ok(vec![per_10k(used.all_run_ns as f64 / 1e9, run.requests)])
                }
                Route::Haproxy | Route::Nginx => {
                    let before = bench.proxy(route).cpu_seconds_with_children();
                    let run = bench.wrk(route, load)?;
                    let used = bench.proxy(route).cpu_seconds_with_children() - before;
                    Ok(vec![per_10k(used, run.requests)])
                }
                Route::Direct => bail!("direct has no proxy to measure"),
            }
        })?;
        Ok(series.remove(0))
    }

    fn proxy(&self, route: Route) -> &process::Supervised {
        if route == Route::Haproxy {
            &self.lab.haproxy
        } else {
            &self.lab.nginx_proxy
        }
    }
}
