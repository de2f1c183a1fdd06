//! Scenario suites: the field failures, replayed on a test cluster of three
//! server namespaces (198.18.0.0/15) running test apiservers, with agent
//! processes in a child cgroup making HTTPS requests through the VIP.
//!
//! Each scenario prints its figures (time to detect, requests failed, how
//! requests were spread) and appends them to `$SOCKLB_FIGURES` if set.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use socklb_tests::{
    Cgroup, Daemon,
    cluster::{AgentRequest, AgentRun, Cluster, finish_all, served},
    free_port, pace_bound, record_figures, redirects, require_root, service_args, total_redirects,
};

const INTERVAL_MS: u64 = 200;
const TIMEOUT_MS: u64 = 300;
const FALL: u64 = 2;
const RISE: u64 = 2;
/// Agents making steady traffic in scenarios 1 to 7.
const AGENTS: usize = 3;
/// How often each agent of the steady traffic makes a request.
const TRAFFIC_INTERVAL_MS: u64 = 20;
/// Connects of the steady traffic a scenario waits for before it breaks
/// something: five per agent.
const TRAFFIC_BEFORE: u64 = AGENTS as u64 * 5;

/// The detection bound of the issue, interval × fall + timeout, with the
/// ±20% jitter of the waits and 250 ms for a status poll to see it.
fn detect_bound() -> Duration {
    Duration::from_millis(INTERVAL_MS * FALL * 12 / 10 + TIMEOUT_MS + 250)
}

/// Scenarios load the machine (a herd of 300, CPU-costly requests); they
/// run one at a time so that their figures mean something.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Fields drop in order: the daemon, the cgroup, the servers, and last the
/// turn, so the next scenario starts on a clean machine.
struct Scenario {
    daemon: Daemon,
    cgroup: Cgroup,
    cluster: Cluster,
    vip: SocketAddr,
    _turn: std::sync::MutexGuard<'static, ()>,
}

fn daemon_args(cgroup: &Cgroup, vip: SocketAddr, backends: &[SocketAddr]) -> Vec<String> {
    let interval = format!("{INTERVAL_MS}ms");
    let timeout = format!("{TIMEOUT_MS}ms");
    let (fall, rise) = (FALL.to_string(), RISE.to_string());
    service_args(
        &cgroup.path,
        &[vip],
        backends,
        &[
            "--health",
            "apiserver",
            "--health-interval",
            &interval,
            "--health-timeout",
            &timeout,
            "--fall",
            &fall,
            "--rise",
            &rise,
        ],
    )
}

impl Scenario {
    fn new(label: &str) -> Self {
        Self::with_policy(label, "random")
    }

    fn with_policy(label: &str, policy: &str) -> Self {
        let turn = ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let cluster = Cluster::new(3);
        let cgroup = Cgroup::new(label);
        let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut args = daemon_args(&cgroup, vip, &cluster.addrs());
        args.extend(["--policy".to_string(), policy.to_string()]);
        let mut daemon = Daemon::start(label, &args);
        daemon.wait_health(&cluster.addrs(), true, Duration::from_secs(10));
        Self {
            _turn: turn,
            cluster,
            cgroup,
            daemon,
            vip,
        }
    }

    fn agents(&self, path: &'static str, requests: u32, interval_ms: u64) -> AgentRun {
        AgentRun {
            vip: self.vip,
            cgroup: self.cgroup.path.clone(),
            path,
            requests,
            interval_ms,
            timeout_ms: 2000,
            retries: 1,
        }
    }

    /// Steady traffic: AGENTS agents, a request every 20 ms each, for about
    /// `seconds`.
    fn steady_traffic(&self, seconds: u64) -> Vec<socklb_tests::cluster::Agent> {
        self.agents("/readyz", (seconds * 1000 / 25) as u32, TRAFFIC_INTERVAL_MS)
            .spawn(AGENTS)
    }

    /// Waits until the kernel has redirected `count` more of the agents'
    /// connects than `since` (every request is a new connection); returns
    /// the new total.
    fn wait_traffic(&mut self, since: u64, count: u64) -> u64 {
        let interval = Duration::from_millis(TRAFFIC_INTERVAL_MS);
        let limit = pace_bound(count as u32, interval);
        self.daemon.wait_redirects(since, count, limit)
    }

    fn wait(&mut self, server: usize, healthy: bool) -> Duration {
        let addr = self.cluster.servers[server].addr;
        self.daemon
            .wait_health(&[addr], healthy, Duration::from_secs(15))
    }
}

fn report(scenario: &str, detect: &[(&str, Duration)], requests: &[AgentRequest]) {
    let failed = requests.iter().filter(|request| !request.ok).count();
    let retried = requests
        .iter()
        .filter(|request| request.attempts > 1)
        .count();
    let detect: Vec<String> = detect
        .iter()
        .map(|(what, took)| format!("{what} {} ms", took.as_millis()))
        .collect();
    let line = format!(
        "{scenario}: detect [{}]; requests {}, failed {failed}, retried {retried}; spread {:?}",
        detect.join(", "),
        requests.len(),
        served(requests)
    );
    record_figures(&line);
}

/// The longest time any failed attempt took, in ms.
fn longest_failed_attempt(requests: &[AgentRequest]) -> u64 {
    requests
        .iter()
        .flat_map(|request| request.failed_ms.iter())
        .max()
        .copied()
        .unwrap_or(0)
}

fn failed(requests: &[AgentRequest]) -> usize {
    requests.iter().filter(|request| !request.ok).count()
}

#[test]
fn scenario_1_restart_all_servers() {
    require_root!();
    let mut scenario = Scenario::new("sc1");
    let agents = scenario.steady_traffic(8);
    let mut detect = Vec::new();
    for server in 0..3 {
        scenario.cluster.servers[server].kill();
        detect.push(("down", scenario.wait(server, false)));
        scenario.cluster.servers[server].start();
        detect.push(("up", scenario.wait(server, true)));
    }
    let requests = finish_all(agents);
    report("scenario 1 (restart all servers)", &detect, &requests);
    assert!(
        failed(&requests) <= AGENTS * 3,
        "at most the requests open at each kill fail"
    );
}

#[test]
fn scenario_2_stop_one_server_and_start_it_again() {
    require_root!();
    let mut scenario = Scenario::new("sc2");
    let agents = scenario.steady_traffic(4);
    scenario.wait_traffic(0, TRAFFIC_BEFORE);
    scenario.cluster.servers[1].kill();
    let down = scenario.wait(1, false);
    // Requests go on while s1 is out.
    let at_down = total_redirects(&scenario.daemon.status().expect("status"));
    scenario.wait_traffic(at_down, TRAFFIC_BEFORE);
    scenario.cluster.servers[1].start();
    let up = scenario.wait(1, true);
    let requests = finish_all(agents);
    report(
        "scenario 2 (stop one, start again)",
        &[("down", down), ("up", up)],
        &requests,
    );
    assert!(down <= detect_bound(), "took {down:?}");
    assert!(failed(&requests) <= AGENTS, "{:?}", served(&requests));
    assert!(
        served(&requests).get("s1").is_some_and(|count| *count > 0),
        "s1 serves again"
    );
}

#[test]
fn scenario_3_restart_servers_in_reverse_order() {
    require_root!();
    let mut scenario = Scenario::new("sc3");
    let agents = scenario.steady_traffic(8);
    let mut detect = Vec::new();
    for server in (0..3).rev() {
        scenario.cluster.servers[server].kill();
        scenario.cluster.servers[server].start();
        // A quick restart may be over before a probe notices; wait for the
        // server to be (still or again) healthy before the next one.
        detect.push(("healthy again", scenario.wait(server, true)));
    }
    let requests = finish_all(agents);
    report("scenario 3 (restart in reverse order)", &detect, &requests);
    assert!(failed(&requests) <= AGENTS * 3);
}

#[test]
fn scenario_4_stop_two_servers() {
    require_root!();
    let mut scenario = Scenario::new("sc4");
    let agents = scenario.steady_traffic(4);
    scenario.wait_traffic(0, TRAFFIC_BEFORE);
    scenario.cluster.servers[0].kill();
    scenario.cluster.servers[2].kill();
    let first = scenario.wait(0, false);
    let second = scenario.wait(2, false);
    let stopped_at = Instant::now();
    let requests = finish_all(agents);
    report(
        "scenario 4 (stop two servers)",
        &[("s0 down", first), ("s2 down", second)],
        &requests,
    );
    let detected = first.max(second);
    assert!(detected <= detect_bound());
    // A request fails only if both its attempts meet a stopped server that
    // the tables still list: only while detection runs (two of three
    // servers are out, so a retry meets one two times in three). Each
    // agent makes one request per interval, so at most that many per
    // agent, plus the one in flight. Detection needs `fall` probes (a
    // local process cannot speed it up: issue 17), so the count follows
    // the measured detection time, not a fixed number.
    let while_detecting =
        AGENTS * (detected.as_millis() as usize / TRAFFIC_INTERVAL_MS as usize + 1);
    assert!(
        failed(&requests) <= while_detecting,
        "{} failed, more than the {while_detecting} requests made while detection ran: {:?}",
        failed(&requests),
        served(&requests)
    );
    let after = finish_all(scenario.agents("/readyz", 20, 10).spawn(1));
    assert!(
        after
            .iter()
            .all(|request| request.server.as_deref() == Some("s1")),
        "{:?}",
        served(&after)
    );
    assert!(stopped_at.elapsed() < Duration::from_secs(30));
}

#[test]
fn scenario_5_delete_a_server_and_add_a_new_one() {
    require_root!();
    let mut scenario = Scenario::new("sc5");
    let agents = scenario.steady_traffic(5);
    scenario.wait_traffic(0, TRAFFIC_BEFORE);
    let added = scenario.cluster.add_server();
    let addrs = scenario.cluster.addrs();
    let new_set = [addrs[0], addrs[1], addrs[added]];
    let started = Instant::now();
    let args = daemon_args(&scenario.cgroup, scenario.vip, &new_set);
    scenario.daemon.restart_with(&args);
    scenario
        .daemon
        .wait_health(&new_set, true, Duration::from_secs(10));
    let took = started.elapsed();
    let mark = Instant::now();
    let requests = finish_all(agents);
    let after = finish_all(scenario.agents("/readyz", 30, 5).spawn(1));
    report(
        "scenario 5 (delete s2, add s3, daemon restarted with the new set)",
        &[("new set live", took)],
        &requests,
    );
    assert_eq!(
        failed(&requests),
        0,
        "no request fails: {:?}",
        served(&requests)
    );
    let spread = served(&after);
    assert_eq!(
        spread.get("s2"),
        None,
        "the deleted server gets nothing: {spread:?}"
    );
    assert!(
        spread.get("s3").is_some_and(|count| *count > 0),
        "the new server serves: {spread:?}"
    );
    assert!(mark.elapsed() < Duration::from_secs(30));
}

#[test]
fn scenario_6_a_server_that_accepts_and_hangs() {
    require_root!();
    let mut scenario = Scenario::new("sc6");
    // Requests every 20 ms, some of them on connections to s1 when it hangs.
    let agents = scenario
        .agents("/readyz", 200, TRAFFIC_INTERVAL_MS)
        .spawn(AGENTS);
    let s1 = scenario.cluster.servers[1].addr;
    let limit = pace_bound(
        TRAFFIC_BEFORE as u32 * 3,
        Duration::from_millis(TRAFFIC_INTERVAL_MS),
    );
    scenario
        .daemon
        .wait_for("agents' connects to s1", limit, |status| {
            redirects(status, s1) >= AGENTS as u64
        });
    scenario.cluster.servers[1].hang_in_place();
    let hung_at = Instant::now();
    let out = scenario.wait(1, false);
    let requests = finish_all(agents);
    report(
        "scenario 6 (s1 accepts TCP and hangs)",
        &[("out", out)],
        &requests,
    );
    assert!(out <= detect_bound(), "took {out:?}");
    assert_eq!(
        failed(&requests),
        0,
        "every request succeeds, on retry if need be"
    );
    // An attempt stuck on the hung server ends when socklb closes it, not
    // at the agent's own 2 s timeout.
    let longest = longest_failed_attempt(&requests);
    assert!(
        Duration::from_millis(longest) <= detect_bound() + Duration::from_millis(300),
        "an attempt waited {longest} ms on the hung server"
    );
    assert!(
        scenario.daemon.log().contains("close-on-failure"),
        "{}",
        scenario.daemon.log()
    );
    assert!(hung_at.elapsed() < Duration::from_secs(30));
}

#[test]
fn scenario_7_a_blackholed_server() {
    require_root!();
    let mut scenario = Scenario::new("sc7");
    let agents = scenario.steady_traffic(4);
    scenario.wait_traffic(0, TRAFFIC_BEFORE);
    scenario.cluster.servers[2].blackhole();
    let out = scenario.wait(2, false);
    let requests = finish_all(agents);
    scenario.cluster.servers[2].unblackhole();
    report("scenario 7 (s2 drops SYNs)", &[("out", out)], &requests);
    assert!(out <= detect_bound(), "took {out:?}");
    assert!(failed(&requests) <= AGENTS, "{:?}", served(&requests));
}

#[test]
fn scenario_8_a_herd_of_300_while_one_server_hangs() {
    require_root!();
    // least-conn: 300 concurrent clients are its case. With random choice
    // the two healthy servers' shares of 300 differ by more than 1.3x in
    // about 2% of runs; two choices on live counts keep them even.
    let mut scenario = Scenario::with_policy("sc8", "least-conn");
    scenario.cluster.servers[0].hang();
    let herd = AgentRun {
        timeout_ms: 10_000,
        ..scenario.agents("/cpu", 1, 0)
    };
    let started = Instant::now();
    let requests = finish_all(herd.spawn(300));
    let took = started.elapsed();
    let out = scenario.wait(0, false);
    report(
        &format!(
            "scenario 8 (herd of 300 on /cpu, s0 hangs; all done in {} ms)",
            took.as_millis()
        ),
        &[("s0 out (status)", out)],
        &requests,
    );
    assert_eq!(requests.len(), 300);
    assert_eq!(
        failed(&requests),
        0,
        "every client finishes: {:?}",
        served(&requests)
    );
    let longest = longest_failed_attempt(&requests);
    assert!(
        Duration::from_millis(longest) <= detect_bound() + Duration::from_millis(500),
        "no client waits on the hung server longer than the detection time: {longest} ms"
    );
    let spread = served(&requests);
    let (s1, s2) = (
        spread.get("s1").copied().unwrap_or(0),
        spread.get("s2").copied().unwrap_or(0),
    );
    let ratio = s1.max(s2) as f64 / s1.min(s2).max(1) as f64;
    assert!(
        ratio <= 1.3,
        "healthy servers within 1.3× of each other: {spread:?}"
    );
}

#[test]
fn scenario_9_a_flapping_server() {
    require_root!();
    let mut scenario = Scenario::new("sc9");
    let addr = scenario.cluster.servers[1].addr;
    let started = Instant::now();
    // Down and up for 450 ms each: long enough for fall or rise probes to
    // agree sometimes, short enough to tempt a balancer into following
    // every blip.
    for _ in 0..6 {
        scenario.cluster.servers[1].kill();
        std::thread::sleep(Duration::from_millis(450));
        scenario.cluster.servers[1].start();
        std::thread::sleep(Duration::from_millis(450));
    }
    let log = scenario.daemon.log();
    let transitions: Vec<f64> = log
        .lines()
        .filter(|line| {
            line.contains(&format!("{addr} unhealthy")) || line.contains(&format!("{addr} healthy"))
        })
        .filter_map(|line| line.split_whitespace().next().and_then(parse_log_seconds))
        .collect();
    let gaps: Vec<u64> = transitions
        .windows(2)
        .map(|pair| ((pair[1] - pair[0]) * 1000.0) as u64)
        .collect();
    report(
        &format!(
            "scenario 9 (s1 flaps every 450 ms for {} ms): {} transitions, gaps {gaps:?} ms",
            started.elapsed().as_millis(),
            transitions.len()
        ),
        &[],
        &[],
    );
    // Two transitions need at least min(rise, fall) probes between them,
    // and probes start at least 0.8 × interval apart.
    let min_gap = RISE.min(FALL) * INTERVAL_MS * 8 / 10 - 50;
    assert!(
        transitions.len() >= 2,
        "the flapping was seen at all: {transitions:?}"
    );
    assert!(
        gaps.iter().all(|gap| *gap >= min_gap),
        "gaps {gaps:?} below {min_gap} ms"
    );
}

/// Seconds of the day from a log timestamp like 2026-12-02T10:14:48.289551Z.
fn parse_log_seconds(stamp: &str) -> Option<f64> {
    let time = stamp.split('T').nth(1)?.trim_end_matches('Z');
    let mut parts = time.split(':');
    let hours: f64 = parts.next()?.parse().ok()?;
    let minutes: f64 = parts.next()?.parse().ok()?;
    let seconds: f64 = parts.next()?.parse().ok()?;
    Some(hours * 3600.0 + minutes * 60.0 + seconds)
}
