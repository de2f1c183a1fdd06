//! bench/results/REPORT.md, and the summary printed at the end of a run.

use std::{fmt::Write as _, fs, path::Path};

use anyhow::{Context, Result};

use super::{Measure, REPETITIONS, RUN_SECONDS, Results, Route, Series, Summary};

/// A number with about four significant digits, "n/a" when there is none.
pub fn number(value: f64) -> String {
    if !value.is_finite() {
        return "n/a".into();
    }
    let magnitude = value.abs();
    let decimals = if magnitude >= 1000.0 || magnitude == 0.0 {
        0
    } else {
        (3 - magnitude.log10().floor() as i32).max(0) as usize
    };
    format!("{value:.decimals$}")
}

/// One of the issue's targets, checked against this run.
pub struct TargetCheck {
    pub target: String,
    pub figure: String,
    /// None when a figure is missing.
    pub met: Option<bool>,
}

impl TargetCheck {
    fn verdict(&self) -> &'static str {
        match self.met {
            Some(true) => "met",
            Some(false) => "missed",
            None => "not measured",
        }
    }
}

fn series(results: &Results, measure: Measure) -> Option<&Series> {
    results
        .series
        .iter()
        .find(|series| series.measure == measure)
}

fn median(results: &Results, measure: Measure, route: Route) -> Option<f64> {
    Some(series(results, measure)?.summary(route)?.median)
}

pub fn target_checks(results: &Results) -> Vec<TargetCheck> {
    let mut checks = socklb_checks(results);
    checks.extend(sockmap_checks(results));
    checks
}

/// The targets of socklb without acceleration.
fn socklb_checks(results: &Results) -> Vec<TargetCheck> {
    let mut checks = Vec::new();
    let kernel = &results.kernel;
    for (target, figure, limit) in [
        (
            "BPF run time per redirected connection ≤ 600 ns (all programs)",
            kernel.redirected.total_ns.median,
            600.0,
        ),
        (
            "BPF run time per ordinary connection from the cgroup ≤ 100 ns (all programs)",
            kernel.ordinary.total_ns.median,
            100.0,
        ),
    ] {
        checks.push(TargetCheck {
            target: target.into(),
            figure: format!("{} ns", number(figure)),
            met: figure.is_finite().then_some(figure <= limit),
        });
    }
    for (measure, what) in [
        (
            Measure::NewConnections1,
            "new-connection rate, 1 connection",
        ),
        (
            Measure::NewConnections64,
            "new-connection rate, 64 connections",
        ),
    ] {
        let ratio = series(results, measure).and_then(|series| series.ratio(Route::Socklb));
        checks.push(TargetCheck {
            target: format!("socklb ≥ 0.97 × direct, {what}"),
            figure: ratio.map_or("n/a".into(), |ratio| format!("{ratio:.3} ×")),
            met: ratio.map(|ratio| ratio >= 0.97),
        });
    }
    for (measure, what) in [
        (Measure::Throughput1, "throughput, 1 stream"),
        (Measure::Throughput4, "throughput, 4 streams"),
    ] {
        let ratio = series(results, measure).and_then(|series| series.ratio(Route::Socklb));
        checks.push(TargetCheck {
            target: format!("socklb ≥ 0.99 × direct, {what}"),
            figure: ratio.map_or("n/a".into(), |ratio| format!("{ratio:.3} ×")),
            met: ratio.map(|ratio| ratio >= 0.99),
        });
    }
    let delta = median(results, Measure::LatencyP50, Route::Socklb)
        .zip(median(results, Measure::LatencyP50, Route::Direct))
        .map(|(socklb, direct)| socklb - direct);
    checks.push(TargetCheck {
        target: "socklb p50 round trip ≤ direct + 1 µs".into(),
        figure: delta.map_or("n/a".into(), |delta| format!("{delta:+.3} µs")),
        met: delta.map(|delta| delta <= 1.0),
    });
    checks
}

/// The targets of acceleration.
fn sockmap_checks(results: &Results) -> Vec<TargetCheck> {
    let mut checks = Vec::new();
    for (measure, what) in [
        (Measure::NewConnections1, "1 connection"),
        (Measure::NewConnections64, "64 connections"),
    ] {
        let share = (|| {
            let socklb = median(results, measure, Route::Socklb)?;
            let direct = median(results, measure, Route::Direct)?;
            let haproxy = median(results, measure, Route::Haproxy)?;
            Some((socklb - haproxy) / (direct - haproxy))
        })();
        checks.push(TargetCheck {
            target: format!(
                "(socklb − HAProxy) / (direct − HAProxy) ≥ 0.95, new-connection rate, {what}"
            ),
            figure: share.map_or("n/a".into(), |share| format!("{share:.3}")),
            met: share.map(|share| share >= 0.95),
        });
    }
    for (measure, what) in [
        (Measure::LatencyP50, "one CPU"),
        (Measure::LatencyP50Split, "two CPUs"),
    ] {
        let ratio = series(results, measure).and_then(|series| series.ratio(Route::Sockmap));
        checks.push(TargetCheck {
            target: format!("socklb+sockmap round trip p50 ≤ 0.85 × direct, {what}"),
            figure: ratio.map_or("n/a".into(), |ratio| format!("{ratio:.3} ×")),
            met: ratio.map(|ratio| ratio <= 0.85),
        });
    }
    for (measure, what) in [
        (Measure::Throughput1, "1 stream"),
        (Measure::Throughput4, "4 streams"),
    ] {
        let ratio = series(results, measure).and_then(|series| series.ratio(Route::Sockmap));
        checks.push(TargetCheck {
            target: format!("socklb+sockmap throughput ≥ 1.2 × direct, {what}"),
            figure: ratio.map_or("n/a".into(), |ratio| format!("{ratio:.3} ×")),
            met: ratio.map(|ratio| ratio >= 1.2),
        });
    }
    checks
}

/// The acceleration at a glance: the sockmap route against direct and
/// socklb without it, on every measure, and its memory.
fn render_acceleration(text: &mut String, results: &Results) {
    text.push_str(
        "## Acceleration (sockmap) at a glance\n\n\
         Medians of this run, each as a ratio to direct (for latency and CPU, lower is better; \
         for rates and throughput, higher is better).\n\n\
         | Measure | direct | socklb | socklb+sockmap | HAProxy |\n|---|---:|---:|---:|---:|\n",
    );
    for measured in &results.series {
        let cell = |route: Route| {
            measured
                .ratio(route)
                .map_or("n/a".into(), |ratio| format!("{ratio:.3} ×"))
        };
        let direct = measured
            .summary(Route::Direct)
            .map_or("n/a".into(), |summary| {
                format!("{} {}", number(summary.median), measured.measure.unit())
            });
        let _ = writeln!(
            text,
            "| {} | {direct} | {} | {} | {} |",
            measured.measure.title(),
            cell(Route::Socklb),
            cell(Route::Sockmap),
            cell(Route::Haproxy),
        );
    }
    let memory = &results.accelerated_memory;
    let _ = writeln!(
        text,
        "\nKernel memory per accelerated connection (both of its sockets), beyond a socklb \
         connection without acceleration: {} bytes (min {}, max {}; slab bytes of {} idle \
         connections held open through each route, three runs).\n",
        number(memory.median),
        number(memory.min),
        number(memory.max),
        super::measures::MEMORY_CONNECTIONS,
    );
}

pub fn write(out: &Path, results: &Results) -> Result<()> {
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let path = out.join("REPORT.md");
    fs::write(&path, render(results)).with_context(|| format!("writing {}", path.display()))?;
    println!("bench: wrote {}", path.display());
    Ok(())
}

/// The routes, as the report describes them.
const ROUTES: &str = "Four routes lead to the same three backends on 127.0.0.2: one nginx serving a \
         100-byte file, one `sockperf server --tcp`, one `iperf3 -s`. The fifth, \
         socklb+sockmap, leads to the same three servers started a second time on 127.0.0.3 \
         inside socklb's cgroup, through services with `accelerate = \"sockmap\"`: its \
         sock_ops program must see the servers' sockets to pair them.\n\n\
         - **direct**: the client connects to the backend itself.\n\
         - **socklb**: the client connects to a VIP on 127.0.0.1; socklb's cgroup connect4 hook \
         rewrites the destination to the backend. socklb is attached to a child cgroup, and the \
         clients of this route run inside it. socklb (a release build) probes each backend with a \
         TCP connect every second, as HAProxy does.\n\
         - **socklb+sockmap**: as socklb, and every message moves from the sending socket \
         straight into the peer's receive queue (sk_msg, `bpf_msg_redirect_hash` with \
         `BPF_F_INGRESS`).\n\
         - **HAProxy**: `mode tcp`, `balance leastconn`, TCP health checks every second, shaped \
         like kubespray's node-local `haproxy.cfg.j2`; it listens on 127.0.0.1.\n\
         - **nginx**: a separate nginx (not the backend's) with a `stream` proxy, `least_conn`, \
         `proxy_timeout 10m`, `proxy_connect_timeout 1s`, shaped like kubespray's \
         `nginx.conf.j2`; it listens on 127.0.0.1.\n\n\
         Clients of direct, HAProxy and nginx run in a sibling child cgroup with nothing \
         attached, so only the socklb route passes through the hook. The configurations are at \
         the end of this report.\n\n";

/// How each figure is measured.
const METHOD: &str = "\n## Method\n\n\
         - New-connection rate: `wrk -t1 -c1` and `wrk -t2 -c64` with `Connection: close`, so \
         each request opens a TCP connection (and, on the socklb route, runs the connect hook \
         once). Keep-alive rate: `wrk -t2 -c64`; the backend allows a million requests per \
         connection, so nothing reconnects. One 1 s warm-up run per route precedes each wrk \
         measure.\n\
         - Latency: `sockperf ping-pong --tcp --full-rtt`: one connection, one message in flight, \
         round trip percentiles as sockperf prints them.\n\
         - Single-flow measures (wrk at 1 connection, sockperf) run every participant on CPU 0: \
         the client (`taskset -c 0`), the backends and the proxies (their threads are moved there \
         for these measures and moved back after). With one request in flight, the scheduler \
         otherwise decides the result: client and server on the same CPU wake each other in a few \
         µs, on different CPUs in tens of µs on a VM like this one, and that placement changes \
         from run to run, so unpinned runs of the same data path differ by up to ten times. Pinned, a proxy's extra hops cost CPU time on the same CPU, which is \
         what these figures compare. The 64-connection and bulk measures are not pinned.\n\
         - The same sockperf runs again with the servers on CPU 0 and the client on CPU 1 \
         (\"two CPUs\"), where a wake-up crosses CPUs.\n\
         - Throughput: `iperf3 -J` with 1 and 4 streams, received bits per second.\n\
         - Machine CPU per 10k keep-alive requests: busy time of all CPUs from /proc/stat (all \
         but idle and iowait) over a `wrk -t2 -c64` keep-alive run, for every route: the \
         client, the servers, any proxy and the kernel's TCP work together.\n\
         - Kernel memory per accelerated connection: `Slab` of /proc/meminfo while 2,000 idle \
         connections are held open through socklb+sockmap (all paired, as status shows), less \
         the same through socklb without acceleration, per connection.\n\
         - CPU per 10k requests: separate `wrk -t2 -c64` `Connection: close` runs. HAProxy and \
         nginx: user + system time of the proxy's processes (nginx: master and workers) from \
         /proc/PID/stat before and after. socklb: `kernel.bpf_stats_enabled` is set to 1 only \
         around socklb's runs and restored after; the run time of socklb's programs (found \
         through its pinned links, read with `bpftool prog show -j`) over the run. The rate \
         runs above ran with the statistics off.\n\
         - Kernel cost per connection: the same statistics, per program, over separate runs \
         (redirected, ordinary, and 20,000 connects that each ask getpeername), taking turns in \
         each round; the statistics' own cost from `bpftool prog run` of socklb's never-attached \
         `socklb_uncount` (`repeat 1000000`) with them off and on.\n\
         - Everything runs on one machine: wrk, the proxy and the backend share its CPUs, so a \
         proxy's CPU use also slows its clients and backend. That is the situation of a \
         node-local balancer too.\n\
         - Traffic stays on 127.0.0.0/8. Every process the benchmark starts is stopped by its \
         PID at the end; the cgroups, pins and scratch files are removed.\n\n";

fn render(results: &Results) -> String {
    let mut text = String::new();
    let date = results
        .machine
        .iter()
        .find(|(what, _)| what == "Date")
        .map_or("", |(_, date)| date.as_str());
    let _ = writeln!(
        text,
        "# socklb benchmark report\n\n\
         Written by `cargo xtask bench` on {date}; the whole run took {:.1} minutes. \
         Each figure is the median of {REPETITIONS} runs of {RUN_SECONDS} s, with the \
         minimum and maximum of those runs; the routes took turns within each round, and \
         every ratio compares medians of this same run. This machine is small and shared, \
         so absolute figures are noisy; the ratios are what to read.\n",
        results.elapsed.as_secs_f64() / 60.0
    );

    render_targets(&mut text, results);
    render_noise_floor(&mut text, results);
    render_acceleration(&mut text, results);

    text.push_str("## Routes\n\n");
    text.push_str(ROUTES);

    text.push_str("## Results\n\n");
    for measured in &results.series {
        render_series(&mut text, measured);
    }
    render_kernel_cost(&mut text, results);
    render_footprint(&mut text, results);
    render_micro(&mut text, results);
    render_errors(&mut text, results);

    render_machine(&mut text, results);
    text.push_str(METHOD);

    render_configs(&mut text, results);
    text
}

fn render_targets(text: &mut String, results: &Results) {
    text.push_str("## The issue's targets\n\n| Target | This run | Verdict |\n|---|---|---|\n");
    for check in target_checks(results) {
        let _ = writeln!(
            text,
            "| {} | {} | {} |",
            check.target,
            check.figure,
            check.verdict()
        );
    }
    text.push_str(
        "\nThe targets are reported, not enforced: nothing in the benchmark was tuned to meet them.\n",
    );
}

fn render_machine(text: &mut String, results: &Results) {
    text.push_str("## Machine and tools\n\n| | |\n|---|---|\n");
    for (what, value) in results.machine.iter().chain(&results.tools) {
        let _ = writeln!(text, "| {what} | `{}` |", value.replace('|', "\\|"));
    }
}

fn render_configs(text: &mut String, results: &Results) {
    text.push_str("## Configurations\n\n");
    for (name, config) in &results.configs {
        let _ = writeln!(
            text,
            "<details><summary>{name}</summary>\n\n```\n{}\n```\n\n</details>\n",
            config.trim_end()
        );
    }
}

/// After connect() a socklb connection is a direct one: on keep-alive and
/// bulk measures socklb runs none of its code, so how far its ratio lands
/// from 1 there is this run's noise.
fn render_noise_floor(text: &mut String, results: &Results) {
    let ratios: Vec<(Measure, f64)> = [
        Measure::KeepAlive64,
        Measure::Throughput1,
        Measure::Throughput4,
    ]
    .iter()
    .filter_map(|measure| Some((*measure, series(results, *measure)?.ratio(Route::Socklb)?)))
    .collect();
    if ratios.is_empty() {
        text.push('\n');
        return;
    }
    let shown: Vec<String> = ratios
        .iter()
        .map(|(measure, ratio)| format!("{} {ratio:.3}", measure.key()))
        .collect();
    let _ = writeln!(
        text,
        "\nHow much of a ratio is noise: after connect() a socklb connection is a plain \
         direct connection, so on the keep-alive and bulk measures socklb runs no code of its own \
         and should equal direct. Its ratios there in this run ({}) show how far noise alone \
         moves a ratio on this machine; the min-max ranges below show the same.\n",
        shown.join(", ")
    );
}

fn render_series(text: &mut String, measured: &Series) {
    let measure = measured.measure;
    let _ = writeln!(
        text,
        "### {}\n\n![{}]({}.svg)\n\n| Route | Median | Min | Max | × direct |\n|---|---:|---:|---:|---:|",
        measure.title(),
        measure.key(),
        measure.key()
    );
    for route in Route::ALL {
        let Some(summary) = measured.summary(route) else {
            if route == Route::Direct && measure == Measure::CpuPer10k {
                text.push_str("| direct | no proxy | | | |\n");
            }
            continue;
        };
        let ratio = measured
            .ratio(route)
            .map_or("n/a".to_string(), |ratio| format!("{ratio:.3}"));
        let _ = writeln!(
            text,
            "| {} | {} {} | {} | {} | {} |",
            route.name(),
            number(summary.median),
            measure.unit(),
            number(summary.min),
            number(summary.max),
            ratio
        );
    }
    text.push('\n');
}

/// The kernel cost and the new-connection rates alone (`bench
/// --kernel-cost`), as markdown.
pub fn render_kernel_cost_alone(
    kernel: &super::kernel_cost::KernelCost,
    rates: &[Series],
) -> String {
    let mut text = String::new();
    render_kernel_cost_of(&mut text, kernel);
    text.push_str("| Measure | direct | socklb | × direct |\n|---|---:|---:|---:|\n");
    for measured in rates {
        let median = |route| {
            measured
                .summary(route)
                .map_or(f64::NAN, |summary| summary.median)
        };
        let _ = writeln!(
            text,
            "| {} | {} | {} | {} |",
            measured.measure.title(),
            number(median(Route::Direct)),
            number(median(Route::Socklb)),
            measured
                .ratio(Route::Socklb)
                .map_or("n/a".into(), |ratio| format!("{ratio:.3}"))
        );
    }
    text
}

fn render_kernel_cost(text: &mut String, results: &Results) {
    render_kernel_cost_of(text, &results.kernel);
}

fn render_kernel_cost_of(text: &mut String, kernel: &super::kernel_cost::KernelCost) {
    text.push_str(
        "### What socklb's programs cost per connection (BPF statistics)\n\n\
         Medians of the rounds of `wrk -t2 -c64` with `Connection: close`: **redirected**, \
         to a VIP from socklb's cgroup; **ordinary**, from the same cgroup straight to the \
         backend (what every other process of a node pays). A connection is one run of a \
         connect program.\n\n\
         | Program | redirected: ns per call | calls per connection | ordinary: ns per call | calls per connection |\n\
         |---|---:|---:|---:|---:|\n",
    );
    let find = |programs: &[super::kernel_cost::ProgramCost], name: &str| {
        programs.iter().find(|cost| cost.program == name).map_or(
            ("n/a".to_string(), "0".to_string()),
            |cost| {
                (
                    number(cost.ns_per_call.median),
                    format!("{:.2}", cost.calls_per_connection.median),
                )
            },
        )
    };
    let mut names: Vec<&str> = kernel
        .redirected
        .programs
        .iter()
        .chain(&kernel.ordinary.programs)
        .map(|cost| cost.program.as_str())
        .collect();
    names.sort_unstable();
    names.dedup();
    for name in names {
        let (redirected, redirected_calls) = find(&kernel.redirected.programs, name);
        let (ordinary, ordinary_calls) = find(&kernel.ordinary.programs, name);
        let _ = writeln!(
            text,
            "| {name} | {redirected} | {redirected_calls} | {ordinary} | {ordinary_calls} |"
        );
    }
    render_kernel_totals(text, kernel);
}

/// The totals per connection, getpeername, the statistics' own cost and
/// the daemon's CPU, under the table of programs.
fn render_kernel_totals(text: &mut String, kernel: &super::kernel_cost::KernelCost) {
    let total = |path: &super::kernel_cost::PathCost| {
        format!(
            "{} ns (min {}, max {}); less the statistics' floor per call: {} ns",
            number(path.total_ns.median),
            number(path.total_ns.min),
            number(path.total_ns.max),
            number(path.net_total_ns.median)
        )
    };
    let _ = writeln!(
        text,
        "\n- **Per redirected connection**: {} in {:.1} calls.\n\
         - **Per ordinary connection from the cgroup**: {} in {:.1} calls.\n\
         - **getpeername4**: {} ns per call, from a client that asks it once after each connect \
         (as Go's net package does; wrk never asks): a redirected connection of such a client \
         costs {} ns.",
        total(&kernel.redirected),
        kernel.redirected.calls.median,
        total(&kernel.ordinary),
        kernel.ordinary.calls.median,
        number(kernel.getpeername_ns.median),
        number(kernel.redirected_with_getpeername()),
    );
    match &kernel.stats {
        Some(stats) => {
            let _ = writeln!(
                text,
                "- **The statistics' own cost**, on `socklb_uncount` run a million times with \
                 BPF_PROG_TEST_RUN: they add {} ns to each run (on less off; min {}, max {}), and \
                 report {} ns for a run that does almost nothing (their clock read, mostly): the \
                 floor subtracted above.",
                number(stats.added_ns.median),
                number(stats.added_ns.min),
                number(stats.added_ns.max),
                number(stats.floor_ns.median),
            );
        }
        None => text.push_str("- The statistics' own cost was not measured in this run.\n"),
    }
    let _ = writeln!(
        text,
        "- socklb's daemon over the redirected runs (health probes only; not on the data path): \
         {} CPU-s per 10k connections (whole ticks of /proc, 10 ms).\n\n\
         `HOOK-PROFILE.md` shows where the time goes, before and after the socket table.\n",
        number(kernel.daemon_cpu_per_10k.median),
    );
}

fn render_footprint(text: &mut String, results: &Results) {
    let footprint = &results.footprint;
    let rss: &Summary = &footprint.rss_mib;
    let cpu = &footprint.cpu_percent;
    let _ = writeln!(
        text,
        "### socklb daemon with {} services × {} backends\n\n\
         socklb (release build) attached to an empty child cgroup, every backend on a loopback \
         address where nothing listens (each probe is a refused TCP connect), probed every \
         second (±20 % jitter). Sampled once a second for {} s after the first probe round; \
         CPU is over {REPETITIONS} windows.\n\n\
         | | Median | Min | Max |\n|---|---:|---:|---:|\n\
         | RSS (VmRSS) | {} MiB | {} | {} |\n\
         | CPU (user + system, % of one CPU) | {} % | {} | {} |\n\n\
         Peak RSS (VmHWM): {} MiB.\n",
        footprint.services,
        footprint.backends_per_service,
        footprint.window_seconds,
        number(rss.median),
        number(rss.min),
        number(rss.max),
        number(cpu.median),
        number(cpu.min),
        number(cpu.max),
        number(footprint.peak_rss_mib),
    );
}

fn render_micro(text: &mut String, results: &Results) {
    text.push_str(
        "### Microbenchmarks (criterion, lb-userspace/benches/planner.rs)\n\n\
         Run with a short measurement time (0.5 s warm-up, 1 s measurement); \
         `cargo bench -p lb-userspace --bench planner` runs them at criterion's defaults. \
         `layout_and_plan`: the selection table from the configuration (Layout::from_config \
         and plan, nine backends in ten healthy). `plan`: the table alone, as on a health \
         change. `expand_weights`: weights 1-3 into 1024 slots. `record_round`: one probe \
         outcome recorded for every backend (HealthTracker::record). 10,000 backends is past \
         the configuration's limit of 1024 per family and shows how the cost grows.\n\n\
         | Benchmark | Median | 95 % interval |\n|---|---:|---:|\n",
    );
    let figures = match &results.micro {
        Ok(figures) if figures.is_empty() => {
            text.push_str("| (no criterion figures were found) | | |\n");
            &[][..]
        }
        Ok(figures) => figures.as_slice(),
        Err(error) => {
            let _ = writeln!(
                text,
                "| (the benchmarks failed: {}) | | |",
                error.replace('\n', " ")
            );
            &[][..]
        }
    };
    for figure in figures {
        let _ = writeln!(
            text,
            "| {} | {} | {} – {} |",
            figure.id,
            duration(figure.median_ns),
            duration(figure.lower_ns),
            duration(figure.upper_ns)
        );
    }
    text.push('\n');
}

fn duration(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{} ms", number(ns / 1e6))
    } else if ns >= 1e3 {
        format!("{} µs", number(ns / 1e3))
    } else {
        format!("{} ns", number(ns))
    }
}

fn render_errors(text: &mut String, results: &Results) {
    text.push_str(
        "### wrk errors over all runs\n\n| Route | Socket errors | Non-2xx responses |\n|---|---:|---:|\n",
    );
    for (route, socket_errors, non_2xx) in &results.wrk_errors {
        let _ = writeln!(text, "| {} | {socket_errors} | {non_2xx} |", route.name());
    }
    text.push('\n');
}

/// The short version, for the terminal.
pub fn print_summary(results: &Results, out: &Path) {
    println!(
        "\nbench summary ({:.1} min; medians of {REPETITIONS} runs; ratio = route / direct)",
        results.elapsed.as_secs_f64() / 60.0
    );
    for measured in &results.series {
        let shown: Vec<String> = Route::ALL
            .iter()
            .filter_map(|route| {
                let summary = measured.summary(*route)?;
                let ratio = measured
                    .ratio(*route)
                    .map_or(String::new(), |ratio| format!(" ({ratio:.3})"));
                Some(format!(
                    "{} {}{ratio}",
                    route.name(),
                    number(summary.median)
                ))
            })
            .collect();
        println!(
            "  {:<22} [{}] {}",
            measured.measure.key(),
            measured.measure.unit(),
            shown.join(", ")
        );
    }
    println!(
        "  socklb's programs: {} ns per redirected connection, {} ns per ordinary one; daemon at {}x{} backends: RSS {} MiB, CPU {} %",
        number(results.kernel.redirected.total_ns.median),
        number(results.kernel.ordinary.total_ns.median),
        results.footprint.services,
        results.footprint.backends_per_service,
        number(results.footprint.rss_mib.median),
        number(results.footprint.cpu_percent.median),
    );
    println!("targets (issues 4 and 19):");
    for check in target_checks(results) {
        println!(
            "  {:<7} {} — {}",
            check.verdict(),
            check.target,
            check.figure
        );
    }
    println!("report: {}", out.join("REPORT.md").display());
}
