//! The herd scenarios: 1,000 long-lived agents (`fleetagent`: one
//! keep-alive TLS connection each, a request every second, one retry) on
//! three server namespaces behind socklb with least-conn and
//! close-on-failure. Each scenario runs and returns what happened; the
//! tests (tests/herd.rs) assert the invariants, and `cargo xtask bench
//! --fleet` turns the same runs into figures (bench/results/FLEET.md).
//!
//! - one server hangs (accepts, never answers) as the herd starts a fixed
//!   amount of work;
//! - a rolling restart of the three servers, with rebalancing off or on;
//! - a recovery herd: 300 agents join as a server comes back, with and
//!   without slow start.

use std::{
    io::{Read as _, Write as _},
    net::SocketAddr,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use crate::{
    Cgroup, Daemon,
    cluster::{Cluster, WORK_PER_SECOND, helper_bin},
    free_port, require_root, service_args, socklb,
};

pub const AGENTS: u32 = 1000;
/// How long the herd runs on after the last server is back.
pub const SETTLE: Duration = Duration::from_secs(60);
/// How long the rolling restart waits after a server is back before it
/// kills the next: longer than an agent's longest retry delay (1 s), so
/// that no request meets two kills, one per attempt.
pub const BETWEEN_RESTARTS: Duration = Duration::from_secs(2);
/// Probe interval and fall of every run: a hung or dead server is out
/// after two failed probes, every 200 ms.
pub const INTERVAL_MS: u64 = 200;
pub const FALL: u64 = 2;
/// The probe timeout of every run. While 1,000 agents open their TLS
/// connections at once, or start their work at once, a TLS probe to a
/// healthy server can take over 300 ms on two cores: seen in CI with
/// 300 ms, a healthy server taken out twice in a row, and close-on-failure
/// then sent its few hundred agents to reconnect (socklb's default is 1 s).
/// A killed server is found by its refused connects, whatever the timeout.
pub const PROBE_TIMEOUT_MS: u64 = 600;
/// The work of the hung-server run: each agent's `/work` requests.
pub const WORK_REQUESTS: u32 = 12;

/// The longest an agent can wait on a hung server with the health checks
/// above. The first probe to time out starts up to one interval (with its
/// +20 % jitter) after the hang; a probe that times out is followed at
/// once by the next, so the fall-th failure comes fall × max(interval,
/// timeout) later. Then 250 ms for close-on-failure to end the connections
/// on the server and the agent to see its end.
pub fn detect_bound() -> Duration {
    Duration::from_millis(INTERVAL_MS * 12 / 10 + FALL * PROBE_TIMEOUT_MS.max(INTERVAL_MS) + 250)
}

/// The daemon flags every run shares, before its own.
fn flags() -> Vec<String> {
    [
        "--health",
        "apiserver",
        "--health-interval",
        &format!("{INTERVAL_MS}ms"),
        "--fall",
        &FALL.to_string(),
        "--health-timeout",
        &format!("{PROBE_TIMEOUT_MS}ms"),
        "--rise",
        "2",
        "--policy",
        "least-conn",
        "--close-on-failure",
        "true",
    ]
    .iter()
    .map(ToString::to_string)
    .collect()
}

/// Three server namespaces, a child cgroup and a daemon with the flags
/// above and `extra`; every server healthy. Fields drop in order: the
/// daemon, the cgroup, the servers.
pub struct Setup {
    pub daemon: Daemon,
    pub cgroup: Cgroup,
    pub cluster: Cluster,
    pub vip: SocketAddr,
    pub addrs: Vec<SocketAddr>,
}

/// A running `fleetagent`, killed (by its PID) on drop if still running.
pub struct Agents(Option<Child>);

impl Agents {
    /// `count` agents in one `fleetagent` process through `vip`, from
    /// `cgroup` (stdin and stdout piped).
    pub fn spawn(vip: SocketAddr, cgroup: &std::path::Path, count: u32, extra: &[&str]) -> Self {
        let child = Command::new(helper_bin("fleetagent"))
            .args(["--addr", &vip.to_string(), "--cgroup"])
            .arg(cgroup)
            .args(["--agents", &count.to_string(), "--max-seconds", "400"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("fleetagent");
        Agents(Some(child))
    }

    /// Starts the work phase of `--work-requests`.
    pub fn start_work(&mut self) {
        let stdin = self.0.as_mut().and_then(|child| child.stdin.as_mut());
        writeln!(stdin.expect("fleetagent's stdin"), "work").expect("the work line");
    }

    /// Waits until it ends by itself (every agent did its work), with
    /// stdin still open, and returns its summary.
    pub fn finish_work(mut self) -> serde_json::Value {
        let mut child = self.0.take().expect("running");
        let _stdin = child.stdin.take();
        let mut output = String::new();
        child
            .stdout
            .take()
            .expect("fleetagent's stdout")
            .read_to_string(&mut output)
            .expect("fleetagent's summary");
        let _ = child.wait();
        serde_json::from_str(&output).expect("fleetagent's summary JSON")
    }

    /// Closes its stdin and returns its summary.
    pub fn summary(mut self) -> serde_json::Value {
        let mut child = self.0.take().expect("running");
        drop(child.stdin.take());
        let output = child.wait_with_output().expect("fleetagent's summary");
        serde_json::from_slice(&output.stdout).expect("fleetagent's summary JSON")
    }
}

impl Drop for Agents {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Setup {
    pub fn new(label: &str, extra: &[&str]) -> Self {
        require_root();
        let cluster = Cluster::new(3);
        let cgroup = Cgroup::new(label);
        let addrs = cluster.addrs();
        let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut all = flags();
        all.extend(extra.iter().map(ToString::to_string));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let mut daemon = Daemon::start(label, &service_args(&cgroup.path, &[vip], &addrs, &all));
        daemon.wait_health(&addrs, true, Duration::from_secs(20));
        Self {
            daemon,
            cgroup,
            cluster,
            vip,
            addrs,
        }
    }

    /// `count` agents in one `fleetagent` process (stdin and stdout piped).
    pub fn agents(&self, count: u32, extra: &[&str]) -> Agents {
        Agents::spawn(self.vip, &self.cgroup.path, count, extra)
    }

    /// Waits until the live connections of the servers add up to `total`
    /// and `ready` holds for them.
    pub fn wait_live(&mut self, what: &str, total: i64, ready: impl Fn(&[i64; 3]) -> bool) {
        let addrs = self.addrs.clone();
        self.daemon
            .wait_for(what, Duration::from_secs(60), |status| {
                let live = live_of(status, &addrs);
                live.iter().sum::<i64>() == total && ready(&live)
            });
    }

    pub fn live(&self) -> [i64; 3] {
        live_of(&self.daemon.status().expect("status"), &self.addrs)
    }
}

pub fn live_of(status: &serde_json::Value, addrs: &[SocketAddr]) -> [i64; 3] {
    let mut live = [0; 3];
    for (slot, count) in live.iter_mut().zip(crate::live_counts(status, addrs)) {
        *slot = count;
    }
    live
}

/// max/min of live counts (infinite when one is empty).
pub fn max_over_min(live: &[i64; 3]) -> f64 {
    let max = *live.iter().max().unwrap_or(&0) as f64;
    let min = *live.iter().min().unwrap_or(&0) as f64;
    if min == 0.0 { f64::INFINITY } else { max / min }
}

/// Live connections per server at a moment: (seconds since the herd
/// connected, live per server).
pub type Sample = (f64, [i64; 3]);

/// One rolling restart's record.
pub struct RollingRestart {
    pub label: &'static str,
    pub series: Vec<Sample>,
    /// Seconds at which each server was back and healthy.
    pub restarts: Vec<f64>,
    pub end: [i64; 3],
    pub at_last_restart: [i64; 3],
    pub moves: u64,
    pub summary: serde_json::Value,
}

impl RollingRestart {
    pub fn ratio(&self) -> f64 {
        max_over_min(&self.end)
    }

    /// The least moves that balance the live counts of the moment the
    /// last server came back.
    pub fn minimum_moves(&self) -> i64 {
        let total: i64 = self.at_last_restart.iter().sum();
        let fair = (total + 2) / 3;
        self.at_last_restart
            .iter()
            .map(|live| (live - fair).max(0))
            .sum()
    }

    /// Seconds from the last server's return until max/min ≤ 1.3 held in
    /// the samples, if it did.
    pub fn balanced_after(&self) -> Option<f64> {
        let back = *self.restarts.last()?;
        self.series
            .iter()
            .filter(|(t, _)| *t >= back)
            .find(|(_, live)| max_over_min(live) <= 1.3)
            .map(|(t, _)| t - back)
    }

    pub fn failed(&self) -> u64 {
        self.summary["failed"].as_u64().unwrap_or(u64::MAX)
    }

    pub fn requests(&self) -> u64 {
        self.summary["requests"].as_u64().unwrap_or(0)
    }
}

/// Samples the live connections per server each second, from status, in
/// a thread of its own until stopped.
struct Sampler {
    series: Arc<Mutex<Vec<Sample>>>,
    sampling: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Sampler {
    fn start(daemon: &Daemon, addrs: &[SocketAddr], started: Instant) -> Self {
        let series = Arc::new(Mutex::new(Vec::new()));
        let sampling = Arc::new(AtomicBool::new(true));
        let (shared, running) = (Arc::clone(&series), Arc::clone(&sampling));
        let pin = daemon.pin_path.display().to_string();
        let addrs = addrs.to_vec();
        let thread = std::thread::spawn(move || {
            // Bounded by the run (at most ~10 minutes).
            for _ in 0..600 {
                if !running.load(Ordering::SeqCst) {
                    break;
                }
                let output = socklb(&["status", "--json", "--pin-path", &pin]);
                if let Ok(status) = serde_json::from_slice::<serde_json::Value>(&output.stdout)
                    && let Ok(mut series) = shared.lock()
                {
                    series.push((started.elapsed().as_secs_f64(), live_of(&status, &addrs)));
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        });
        Self {
            series,
            sampling,
            thread,
        }
    }

    fn stop(self) -> Vec<Sample> {
        self.sampling.store(false, Ordering::SeqCst);
        let _ = self.thread.join();
        std::mem::take(&mut *self.series.lock().expect("series"))
    }
}

/// The rolling restart: each server killed, started again, healthy again
/// before the next; then `settle` (or, with `until_balanced`, until
/// max/min ≤ 1.3 and at most `settle`).
pub fn rolling_restart(
    label: &'static str,
    extra: &[&str],
    settle: Duration,
    until_balanced: bool,
) -> RollingRestart {
    let mut setup = Setup::new(label, extra);
    let agents = setup.agents(AGENTS, &[]);
    setup.wait_live("the herd connected", i64::from(AGENTS), |_| true);
    let Setup {
        cluster,
        daemon,
        addrs,
        ..
    } = &mut setup;
    let addrs = addrs.clone();
    // Every server in the table before the first is killed.
    daemon.wait_health(&addrs, true, Duration::from_secs(20));
    let started = Instant::now();
    let sampler = Sampler::start(daemon, &addrs, started);
    let mut restarts = Vec::new();
    for (server, addr) in addrs.iter().enumerate() {
        cluster.servers[server].kill();
        daemon.wait_health(&[*addr], false, Duration::from_secs(20));
        cluster.servers[server].start();
        daemon.wait_health(&[*addr], true, Duration::from_secs(20));
        restarts.push(started.elapsed().as_secs_f64());
        if server + 1 < addrs.len() {
            // The pause between restarts is the scenario, not a wait.
            std::thread::sleep(BETWEEN_RESTARTS);
        }
    }
    let at_last_restart = live_of(&daemon.status().expect("status"), &addrs);
    let last = Instant::now();
    while last.elapsed() < settle {
        if until_balanced
            && max_over_min(&live_of(&daemon.status().expect("status"), &addrs)) <= 1.3
        {
            break;
        }
        daemon.wait_beats(1, Duration::from_secs(5));
    }
    let status = daemon.status().expect("status");
    let end = live_of(&status, &addrs);
    let moves = status["daemon_info"]["fleet"][0]["rebalance_moves"]
        .as_u64()
        .unwrap_or(0);
    let series = sampler.stop();
    RollingRestart {
        label,
        series,
        restarts,
        end,
        at_last_restart,
        moves,
        summary: agents.summary(),
    }
}

/// The hung-server run's record.
pub struct HungServer {
    pub before: [i64; 3],
    pub summary: serde_json::Value,
    /// When s0 was out of the table, from the hang.
    pub out_after: Duration,
    /// The daemon's log, for a failure's message.
    pub log: String,
}

impl HungServer {
    /// When each agent finished its work, ms from the start, sorted.
    pub fn finish_ms(&self) -> Vec<u64> {
        self.summary["work"]["finish_ms"]
            .as_array()
            .map(|all| all.iter().filter_map(|ms| ms.as_u64()).collect())
            .unwrap_or_default()
    }

    /// The longest any agent waited on the hung server.
    pub fn longest_wait(&self) -> Duration {
        Duration::from_millis(
            self.summary["work"]["longest_failed_attempt_ms"]
                .as_u64()
                .unwrap_or(u64::MAX),
        )
    }

    /// The total work over the two healthy servers' capacity.
    pub fn ideal_ms(&self) -> u64 {
        u64::from(AGENTS * WORK_REQUESTS) * 1000 / u64::from(2 * WORK_PER_SECOND)
    }
}

/// The herd connected, s0 hangs in place (accepts, never answers) as every
/// agent starts `WORK_REQUESTS` `/work` requests back to back.
pub fn hung_server() -> HungServer {
    let mut setup = Setup::new("herd-hung", &[]);
    let mut agents = setup.agents(AGENTS, &["--work-requests", &WORK_REQUESTS.to_string()]);
    setup.wait_live("the herd connected", i64::from(AGENTS), |_| true);
    let before = setup.live();
    setup.cluster.servers[0].hang_in_place();
    agents.start_work();
    let out_after = setup
        .daemon
        .wait_health(&[setup.addrs[0]], false, Duration::from_secs(20));
    let summary = agents.finish_work();
    HungServer {
        before,
        summary,
        out_after,
        log: setup.daemon.log(),
    }
}

/// The recovered server's share of the connections opened in its first
/// 5 s.
pub struct Recovery {
    pub label: &'static str,
    /// Live per server when s2 was back, and 5 s later.
    pub at_return: [i64; 3],
    pub after: [i64; 3],
}

impl Recovery {
    pub fn joined(&self) -> i64 {
        self.after.iter().sum::<i64>() - self.at_return.iter().sum::<i64>()
    }

    /// s2's share of the new connections.
    pub fn share(&self) -> f64 {
        (self.after[2] - self.at_return[2]) as f64 / self.joined().max(1) as f64
    }
}

/// 700 agents settled on s0 and s1 while s2 is down; s2 comes back and 300
/// agents join at once.
pub fn recovery(label: &'static str, extra: &[&str]) -> Recovery {
    const SETTLED: u32 = 700;
    let mut setup = Setup::new(label, extra);
    let settled = setup.agents(SETTLED, &[]);
    setup.wait_live("the settled agents connected", i64::from(SETTLED), |_| true);
    setup.cluster.servers[2].kill();
    let s2 = setup.addrs[2];
    setup
        .daemon
        .wait_health(&[s2], false, Duration::from_secs(20));
    setup.wait_live("s2's agents moved", i64::from(SETTLED), |live| live[2] == 0);
    setup.cluster.servers[2].start();
    setup
        .daemon
        .wait_health(&[s2], true, Duration::from_secs(20));
    let back = Instant::now();
    let at_return = setup.live();
    let joining = setup.agents(AGENTS - SETTLED, &[]);
    setup.wait_live("the joining agents connected", i64::from(AGENTS), |_| true);
    // The window measured: the recovered server's first 5 s.
    std::thread::sleep(Duration::from_secs(5).saturating_sub(back.elapsed()));
    let after = setup.live();
    let _ = (joining.summary(), settled.summary());
    Recovery {
        label,
        at_return,
        after,
    }
}
