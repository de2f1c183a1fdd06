//! One run of each client (wrk, sockperf, iperf3), read back into numbers,
//! and the counters that say what a run cost: a proxy's CPU time from
//! /proc, socklb's hook time from the kernel's BPF run-time statistics.

use std::{
    collections::BTreeMap, fmt::Write as _, fs, path::Path, process::Command, time::Duration,
};

use anyhow::{Context, Result, bail};
use lb_common::names as socklb_names;
use serde_json::Value;
use socklb_tests::{Cgroup, Daemon};

use super::{
    Summary,
    process::{self, check_interrupted, in_cgroup, run_bounded},
    setup::{RouteSetup, SMALL_FILE},
};

/// Slack on top of a client's own duration before it is killed.
const CLIENT_SLACK: Duration = Duration::from_secs(20);

/// How wrk loads the server.
#[derive(Debug, Clone, Copy)]
pub struct WrkLoad {
    pub threads: u32,
    pub connections: u32,
    pub seconds: u32,
    /// Sends `Connection: close`: one new TCP connection per request.
    pub close: bool,
    /// The CPU wrk runs on, if pinned.
    pub cpu: Option<usize>,
}

/// What one wrk run reports.
#[derive(Debug, Clone, Copy)]
pub struct WrkRun {
    pub requests: u64,
    pub per_second: f64,
    pub socket_errors: u64,
    pub non_2xx: u64,
}

pub fn wrk(setup: &RouteSetup, load: WrkLoad, scratch: &Path) -> Result<WrkRun> {
    let mut args = vec![
        format!("-t{}", load.threads),
        format!("-c{}", load.connections),
        format!("-d{}s", load.seconds),
    ];
    if load.close {
        args.extend(["-H".to_string(), "Connection: close".to_string()]);
    }
    args.push(format!("http://{}/{SMALL_FILE}", setup.targets.http));
    let mut command = in_cgroup(&setup.cgroup, load.cpu, "wrk", &args);
    let limit = Duration::from_secs(load.seconds.into()) + CLIENT_SLACK;
    let finished = run_bounded(&mut command, limit, scratch)?;
    if !finished.status.success() {
        bail!(
            "wrk {args:?} failed ({}): {}{}",
            finished.status,
            finished.stdout,
            finished.stderr
        );
    }
    let run = parse_wrk(&finished.stdout)
        .with_context(|| format!("reading wrk's output:\n{}", finished.stdout))?;
    if run.requests == 0 {
        bail!(
            "wrk completed no request via {:?}:\n{}",
            setup.route,
            finished.stdout
        );
    }
    Ok(run)
}

fn parse_wrk(text: &str) -> Option<WrkRun> {
    let mut requests = None;
    let mut per_second = None;
    let mut socket_errors = 0;
    let mut non_2xx = 0;
    for line in text.lines().map(str::trim) {
        if let Some(rate) = line.strip_prefix("Requests/sec:") {
            per_second = rate.trim().parse().ok();
        } else if let Some((count, _)) = line.split_once(" requests in ") {
            requests = count.trim().parse().ok();
        } else if let Some(errors) = line.strip_prefix("Socket errors:") {
            // "connect 0, read 3, write 0, timeout 0"
            socket_errors = errors
                .split(',')
                .filter_map(|part| part.split_whitespace().last()?.parse::<u64>().ok())
                .sum();
        } else if let Some(count) = line.strip_prefix("Non-2xx or 3xx responses:") {
            non_2xx = count.trim().parse().unwrap_or(0);
        }
    }
    Some(WrkRun {
        requests: requests?,
        per_second: per_second?,
        socket_errors,
        non_2xx,
    })
}

/// Round-trip percentiles of one sockperf ping-pong run, in microseconds.
#[derive(Debug, Clone, Copy)]
pub struct PingPong {
    pub p50_us: f64,
    pub p99_us: f64,
}

pub fn sockperf(
    setup: &RouteSetup,
    seconds: u32,
    cpu: Option<usize>,
    scratch: &Path,
) -> Result<PingPong> {
    let target = setup.targets.sockperf;
    let args: Vec<String> = [
        "ping-pong",
        "--tcp",
        "--full-rtt",
        "-i",
        &target.ip().to_string(),
        "-p",
        &target.port().to_string(),
        "-t",
        &seconds.to_string(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    let mut command = in_cgroup(&setup.cgroup, cpu, "sockperf", &args);
    let limit = Duration::from_secs(seconds.into()) + CLIENT_SLACK;
    let finished = run_bounded(&mut command, limit, scratch)?;
    let text = format!("{}\n{}", finished.stdout, finished.stderr);
    let percentile = |which: &str| -> Option<f64> {
        text.lines()
            .find_map(|line| line.split_once(&format!("percentile {which} =")))
            .and_then(|(_, value)| value.trim().parse().ok())
    };
    match (
        finished.status.success(),
        percentile("50.000"),
        percentile("99.000"),
    ) {
        (true, Some(p50_us), Some(p99_us)) => Ok(PingPong { p50_us, p99_us }),
        _ => bail!(
            "sockperf via {:?} gave no percentiles ({}):\n{text}",
            setup.route,
            finished.status
        ),
    }
}

/// Received bits per second of one iperf3 run with `streams` parallel streams.
pub fn iperf(setup: &RouteSetup, streams: u32, seconds: u32, scratch: &Path) -> Result<f64> {
    let target = setup.targets.iperf;
    let args: Vec<String> = vec![
        "-c".into(),
        target.ip().to_string(),
        "-p".into(),
        target.port().to_string(),
        "-t".into(),
        seconds.to_string(),
        "-P".into(),
        streams.to_string(),
        "-J".into(),
    ];
    // The iperf3 server runs one test at a time and answers "busy" while it
    // is still finishing the previous one, or reading a health check (HAProxy
    // and socklb both probe it every second). Try again a few times.
    let mut last_error = String::new();
    for _attempt in 0..5 {
        check_interrupted()?;
        let mut command = in_cgroup(&setup.cgroup, None, "iperf3", &args);
        let limit = Duration::from_secs(seconds.into()) + CLIENT_SLACK;
        let finished = run_bounded(&mut command, limit, scratch)?;
        let report: Value = serde_json::from_str(&finished.stdout).unwrap_or(Value::Null);
        if let Some(bits) = report["end"]["sum_received"]["bits_per_second"].as_f64()
            && finished.status.success()
        {
            return Ok(bits);
        }
        last_error = report["error"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("{}{}", finished.stdout, finished.stderr));
        std::thread::sleep(Duration::from_millis(500));
    }
    bail!("iperf3 via {:?} failed 5 times: {last_error}", setup.route)
}

/// Turns on the kernel's BPF run-time statistics and restores the old
/// setting on drop: they cost a clock read on every program run, so they
/// stay off outside the runs that need them.
pub struct BpfStats {
    previous: String,
}

const BPF_STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    pub fn enable() -> Result<Self> {
        let previous = fs::read_to_string(BPF_STATS_SYSCTL)
            .with_context(|| format!("reading {BPF_STATS_SYSCTL}"))?
            .trim()
            .to_string();
        fs::write(BPF_STATS_SYSCTL, "1").with_context(|| format!("writing {BPF_STATS_SYSCTL}"))?;
        Ok(Self { previous })
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        if let Err(error) = fs::write(BPF_STATS_SYSCTL, &self.previous) {
            eprintln!(
                "warning: could not restore {BPF_STATS_SYSCTL} to {}: {error}",
                self.previous
            );
        }
    }
}

/// Run time of the programs of one socklb daemon.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HookCounters {
    /// Every program of ours.
    pub all_run_ns: u64,
}

impl HookCounters {
    pub fn since(self, before: Self) -> Self {
        Self {
            all_run_ns: self.all_run_ns.saturating_sub(before.all_run_ns),
        }
    }
}

/// The programs of one daemon, found through its pinned links, so that
/// other socklb instances on the machine do not count.
pub struct HookPrograms {
    ids: Vec<u64>,
    /// Its never-attached `socklb_uncount`, if this socklb has one.
    pub uncount: Option<u64>,
}

/// The ids of the programs named `name` that use the map pinned at `pin`:
/// this daemon's, among every socklb's on the machine.
fn programs_using(name: &str, pin: &std::path::Path) -> Result<Vec<u64>> {
    let map = bpftool(&["map", "show", "pinned", &pin.display().to_string()])?;
    let Some(map_id) = map["id"].as_u64() else {
        return Ok(Vec::new());
    };
    let programs = bpftool(&["prog", "show"])?;
    Ok(programs
        .as_array()
        .into_iter()
        .flatten()
        .filter(|program| {
            program["name"].as_str() == Some(name)
                && program["map_ids"]
                    .as_array()
                    .is_some_and(|maps| maps.iter().any(|id| id.as_u64() == Some(map_id)))
        })
        .filter_map(|program| program["id"].as_u64())
        .collect())
}

impl HookPrograms {
    pub fn of(daemon: &Daemon) -> Result<Self> {
        let pins = socklb::dataplane::PinPaths::new(&daemon.pin_path);
        let mut ids = Vec::new();
        for (_, link) in pins.links() {
            if !link.exists() {
                continue;
            }
            let shown = bpftool(&["link", "show", "pinned", &link.display().to_string()])?;
            let id = shown["prog_id"]
                .as_u64()
                .with_context(|| format!("no prog_id for the link {}", link.display()))?;
            ids.push(id);
        }
        if ids.is_empty() {
            bail!(
                "no pinned link under {}: cannot tell socklb's programs apart",
                daemon.pin_path.display()
            );
        }
        // The sk_msg program has no link: it is the one attached to this
        // daemon's sockhash, the only socklb_skmsg that uses that map.
        ids.extend(programs_using(
            socklb_names::SKMSG,
            &pins.map(socklb_names::SOCKHASH),
        )?);
        // The daemon holds its uncount program (never attached, never
        // run on the data path): the one that uses its counters.
        let uncount = programs_using(
            socklb_names::UNCOUNT,
            &pins.map(socklb_names::BACKEND_CONNS),
        )?
        .into_iter()
        .max();
        Ok(Self { ids, uncount })
    }

    /// Run time and run count of each program, by name.
    pub fn read_each(&self) -> Result<BTreeMap<String, (u64, u64)>> {
        let programs = bpftool(&["prog", "show"])?;
        let mut counts = BTreeMap::new();
        for program in programs.as_array().into_iter().flatten() {
            let (Some(id), Some(name)) = (program["id"].as_u64(), program["name"].as_str()) else {
                continue;
            };
            if self.ids.contains(&id) {
                // bpftool leaves both fields out while they are zero.
                let entry = counts.entry(name.to_string()).or_insert((0, 0));
                entry.0 += program["run_time_ns"].as_u64().unwrap_or(0);
                entry.1 += program["run_cnt"].as_u64().unwrap_or(0);
            }
        }
        Ok(counts)
    }

    /// Run time and run count of one program by id.
    pub fn read_id(&self, id: u64) -> Result<(u64, u64)> {
        let program = bpftool(&["prog", "show", "id", &id.to_string()])?;
        Ok((
            program["run_time_ns"].as_u64().unwrap_or(0),
            program["run_cnt"].as_u64().unwrap_or(0),
        ))
    }

    pub fn read(&self) -> Result<HookCounters> {
        Ok(HookCounters {
            all_run_ns: self.read_each()?.values().map(|(ns, _)| ns).sum(),
        })
    }
}

/// Busy CPU seconds of the whole machine since boot: every state of
/// /proc/stat's first line but idle and iowait.
pub fn machine_busy_seconds() -> Result<f64> {
    let text = fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let ticks: Vec<f64> = text
        .lines()
        .next()
        .context("/proc/stat is empty")?
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|field| field.parse().unwrap_or(0.0))
        .collect();
    let idle = ticks.get(3).copied().unwrap_or(0.0) + ticks.get(4).copied().unwrap_or(0.0);
    Ok((ticks.iter().sum::<f64>() - idle) / super::process::clock_ticks_per_second())
}

/// The kernel's slab memory now, in bytes (/proc/meminfo `Slab`).
fn slab_bytes() -> Result<f64> {
    let text = fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    text.lines()
        .find_map(|line| line.strip_prefix("Slab:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map(|kib| kib * 1024.0)
        .context("no Slab line in /proc/meminfo")
}

/// Connections held open for the memory measure, per run.
pub const MEMORY_CONNECTIONS: u32 = 2000;

/// Slab bytes that `MEMORY_CONNECTIONS` idle connections through a route
/// add while they are open (connclient holds them; socklb's status says
/// when they all are, and for sockmap when they all are accelerated).
fn slab_while_holding(lab: &mut super::setup::Lab, route: super::Route) -> Result<f64> {
    let setup = lab.route(route);
    let backend = lab.backend_of(route).http.to_string();
    let before = slab_bytes()?;
    let mut holder = std::process::Command::new(socklb_tests::cluster::helper_bin("connclient"))
        .args([
            "--hold",
            "--addr",
            &setup.targets.http.to_string(),
            "--cgroup",
        ])
        .arg(&setup.cgroup)
        .args([
            "--count",
            &MEMORY_CONNECTIONS.to_string(),
            "--hold-ms",
            "120000",
        ])
        .arg("--until-stdin-closes")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting connclient")?;
    let wanted = i64::from(MEMORY_CONNECTIONS);
    let count = |lab: &super::setup::Lab, field: &str| -> i64 {
        lab.daemon
            .status()
            .and_then(|status| socklb_tests::backend_field(&status, &backend, field))
            .and_then(|value| value.as_i64())
            .unwrap_or(-1)
    };
    // All open (and for sockmap, all but a hundredth at most paired).
    let opened =
        socklb_tests::holds_within(Duration::from_secs(60), Duration::from_millis(200), || {
            count(lab, "live") == wanted
                && (route != super::Route::Sockmap
                    || count(lab, "accelerated") * 100 >= wanted * 99)
        });
    let during = slab_bytes()?;
    let paired = count(lab, "accelerated");
    drop(holder.stdin.take());
    let _ = holder.wait();
    let closed =
        socklb_tests::holds_within(Duration::from_secs(60), Duration::from_millis(200), || {
            count(lab, "live") == 0
        });
    if !opened || !closed {
        bail!(
            "{MEMORY_CONNECTIONS} connections via {}: opened {opened} (paired {paired}), closed {closed}",
            route.name()
        );
    }
    Ok(during - before)
}

/// Kernel memory per accelerated connection: the slab bytes that idle
/// connections add through socklb with sockmap, less those through socklb
/// without it, per connection; three runs.
pub fn accelerated_connection_memory(lab: &mut super::setup::Lab) -> Result<super::Summary> {
    let mut extra = Vec::new();
    for _ in 0..3 {
        check_interrupted()?;
        let plain = slab_while_holding(lab, super::Route::Socklb)?;
        let accelerated = slab_while_holding(lab, super::Route::Sockmap)?;
        extra.push((accelerated - plain) / f64::from(MEMORY_CONNECTIONS));
    }
    Ok(super::Summary::of(&extra))
}

pub fn bpftool(args: &[&str]) -> Result<Value> {
    let output = Command::new("bpftool")
        .arg("-j")
        .args(args)
        .output()
        .context("running bpftool")?;
    if !output.status.success() {
        bail!(
            "bpftool {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    serde_json::from_slice(&output.stdout).with_context(|| format!("bpftool {args:?} output"))
}

/// The daemon's footprint with many backends probed every second.
#[derive(Debug, Clone)]
pub struct Footprint {
    pub services: usize,
    pub backends_per_service: usize,
    pub window_seconds: u64,
    pub rss_mib: Summary,
    pub peak_rss_mib: f64,
    pub cpu_percent: Summary,
}

/// Services × backends for the footprint run; backends on 127.0.x.y where
/// nothing listens, so that every probe is a refused connect.
const FOOTPRINT_SERVICES: usize = 3;
const FOOTPRINT_BACKENDS: usize = 100;
/// Seconds per CPU window, and windows (the repetitions).
const FOOTPRINT_WINDOW: u64 = 4;
const FOOTPRINT_WINDOWS: usize = 5;

pub fn daemon_footprint(
    scratch: &Path,
    vip_ports: [u16; FOOTPRINT_SERVICES],
    backend_port: u16,
) -> Result<Footprint> {
    let mut config = String::new();
    for (service, vip_port) in vip_ports.iter().enumerate() {
        let backends: Vec<String> = (0..FOOTPRINT_BACKENDS)
            .map(|index| format!("\"127.0.{}.{}:{backend_port}\"", service + 1, index + 1))
            .collect();
        let _ = write!(
            config,
            "[[service]]\nname = \"footprint-{service}\"\nvips = [\"127.0.0.1:{vip_port}\"]\n\
             backends = [{}]\n[service.health]\ninterval = \"1s\"\n\n",
            backends.join(", ")
        );
    }
    let path = scratch.join("footprint.toml");
    fs::write(&path, &config)?;
    let cgroup = Cgroup::new("bench-footprint");
    let args = vec![
        "--config".to_string(),
        path.display().to_string(),
        "--cgroup".to_string(),
        cgroup.path.display().to_string(),
    ];
    let mut daemon = Daemon::start("bench-footprint", &args);
    let total = FOOTPRINT_SERVICES * FOOTPRINT_BACKENDS;
    daemon.wait_for(
        &format!("{total} backends probed"),
        Duration::from_secs(20),
        |status| {
            let backends: Vec<&Value> = status["services"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|service| service["backends"].as_array().into_iter().flatten())
                .collect();
            backends.len() == total && backends.iter().all(|backend| backend["probed"] == true)
        },
    );
    println!(
        "bench: socklb (pid {}) probing {total} refused backends every second; sampling {}s",
        daemon.pid(),
        FOOTPRINT_WINDOW * FOOTPRINT_WINDOWS as u64
    );
    // Let the first probe round and its table writes settle.
    std::thread::sleep(Duration::from_secs(2));
    let pid = daemon.pid();
    let mut rss = Vec::new();
    let mut cpu_percent = Vec::new();
    for _ in 0..FOOTPRINT_WINDOWS {
        let before = process::cpu_seconds(pid);
        for _ in 0..FOOTPRINT_WINDOW {
            check_interrupted()?;
            std::thread::sleep(Duration::from_secs(1));
            let kib = process::status_kib(pid, "VmRSS").context("socklb's VmRSS")?;
            rss.push(kib as f64 / 1024.0);
        }
        let used = process::cpu_seconds(pid) - before;
        cpu_percent.push(100.0 * used / FOOTPRINT_WINDOW as f64);
    }
    let peak_rss_mib = process::status_kib(pid, "VmHWM").unwrap_or(0) as f64 / 1024.0;
    drop(daemon);
    drop(cgroup);
    Ok(Footprint {
        services: FOOTPRINT_SERVICES,
        backends_per_service: FOOTPRINT_BACKENDS,
        window_seconds: FOOTPRINT_WINDOW * FOOTPRINT_WINDOWS as u64,
        rss_mib: Summary::of(&rss),
        peak_rss_mib,
        cpu_percent: Summary::of(&cpu_percent),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wrk_output() {
        let text = "Running 3s test @ http://127.0.0.2:1/small.txt\n  2 threads and 64 connections\n\
                    \x20 30123 requests in 3.00s, 10.1MB read\n\
                    \x20 Socket errors: connect 0, read 12, write 1, timeout 0\n\
                    \x20 Non-2xx or 3xx responses: 2\nRequests/sec:  10041.00\nTransfer/sec:      3.36MB\n";
        let run = parse_wrk(text).unwrap();
        assert_eq!(run.requests, 30123);
        assert_eq!(run.per_second, 10041.0);
        assert_eq!(run.socket_errors, 13);
        assert_eq!(run.non_2xx, 2);
    }
}
