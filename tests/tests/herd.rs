//! A herd of 1,000 long-lived agents (`fleetagent`: one keep-alive TLS
//! connection each, a request every second, one retry) on three server
//! namespaces behind socklb with least-conn and close-on-failure:
//! - one server hangs (accepts, never answers) as the herd starts a fixed
//!   amount of work: when is every agent served, against the ideal time
//!   (the total work over the healthy servers' capacity), and how long did
//!   any agent sit on the hung server;
//! - a rolling restart of all three servers, with rebalancing off (the
//!   baseline) and on: the live connections per server each second, the
//!   max/min ratio 60 s after the last restart, the moves against the
//!   minimum needed and the failed requests;
//! - a recovery herd: 300 agents join as a server comes back, with and
//!   without slow start: the recovered server's share of them in its
//!   first 5 s.
//!
//! Each writes its section, and the rolling restart an SVG chart, to
//! target/fleet/; FLEET.md there joins the sections
//! (bench/results/FLEET.md is a committed copy of such a run).

use std::{
    fmt::Write as _,
    io::{Read as _, Write as _},
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use socklb_tests::{
    Cgroup, Daemon, backend_field, cluster::Cluster, cluster::helper_bin, free_port,
    record_figures, require_root, service_args, socklb,
};

const AGENTS: u32 = 1000;
/// How long the herd runs on after the last server is back.
const SETTLE: Duration = Duration::from_secs(60);
/// How long the rolling restart waits after a server is back before it
/// kills the next: longer than an agent's longest retry delay (1 s), so
/// that no request meets two kills, one per attempt.
const BETWEEN_RESTARTS: Duration = Duration::from_secs(2);
/// Health checks of every run: a hung or dead server is out after two
/// failed probes, every 200 ms.
const HEALTH: [&str; 6] = [
    "--health",
    "apiserver",
    "--health-interval",
    "200ms",
    "--fall",
    "2",
];
/// The probe timeout of every run. While 1,000 agents open their TLS
/// connections at once, or start their work at once, a TLS probe to a
/// healthy server can take over 300 ms on two cores: seen in CI with
/// 300 ms, a healthy server taken out twice in a row, and close-on-failure
/// then sent its few hundred agents to reconnect (socklb's default is 1 s).
/// A killed server is found by its refused connects, whatever the timeout.
const PROBE_TIMEOUT_MS: u64 = 600;

/// The longest an agent can wait on a hung server with the health checks
/// above and this timeout. The first probe to time out starts up to one
/// interval (with its +20 % jitter) after the hang; a probe that times out
/// is followed at once by the next, so the fall-th failure comes
/// fall × max(interval, timeout) later. Then 250 ms for close-on-failure to
/// end the connections on the server and the agent to see its end.
fn detect_bound(timeout_ms: u64) -> Duration {
    let (interval_ms, fall) = (200, 2);
    Duration::from_millis(interval_ms * 12 / 10 + fall * timeout_ms.max(interval_ms) + 250)
}

/// Three server namespaces, a child cgroup and a daemon with least-conn,
/// close-on-failure, the health checks above and `flags`; every server
/// healthy.
/// Fields drop in order: the daemon, the cgroup, the servers.
struct Setup {
    daemon: Daemon,
    cgroup: Cgroup,
    cluster: Cluster,
    vip: SocketAddr,
    addrs: Vec<SocketAddr>,
}

/// A running `fleetagent`, killed (by its PID) on drop if still running.
struct Agents(Option<Child>);

impl Agents {
    /// Starts the work phase of `--work-requests`.
    fn start_work(&mut self) {
        let stdin = self.0.as_mut().and_then(|child| child.stdin.as_mut());
        writeln!(stdin.expect("fleetagent's stdin"), "work").expect("the work line");
    }

    /// Waits until it ends by itself (every agent did its work), with
    /// stdin still open, and returns its summary.
    fn finish_work(mut self) -> serde_json::Value {
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
    fn summary(mut self) -> serde_json::Value {
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
    fn new(label: &str, flags: &[&str]) -> Self {
        require_root();
        let cluster = Cluster::new(3);
        let cgroup = Cgroup::new(label);
        let addrs = cluster.addrs();
        let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let timeout = format!("{PROBE_TIMEOUT_MS}ms");
        let mut all = HEALTH.to_vec();
        all.extend([
            "--health-timeout",
            &timeout,
            "--rise",
            "2",
            "--policy",
            "least-conn",
            "--close-on-failure",
            "true",
        ]);
        all.extend_from_slice(flags);
        let mut daemon = Daemon::start(label, &service_args(&cgroup.path, &[vip], &addrs, &all));
        daemon.wait_health(&addrs, true, Duration::from_secs(20));
        Self {
            cluster,
            cgroup,
            daemon,
            vip,
            addrs,
        }
    }

    /// `count` agents in one `fleetagent` process (stdin and stdout piped).
    fn agents(&self, count: u32, extra: &[&str]) -> Agents {
        let child = Command::new(helper_bin("fleetagent"))
            .args(["--addr", &self.vip.to_string(), "--cgroup"])
            .arg(&self.cgroup.path)
            .args(["--agents", &count.to_string(), "--max-seconds", "400"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("fleetagent");
        Agents(Some(child))
    }

    /// Waits until the live connections of the servers add up to `total`
    /// and `ready` holds for them.
    fn wait_live(&mut self, what: &str, total: i64, ready: impl Fn(&[i64; 3]) -> bool) {
        let addrs = self.addrs.clone();
        self.daemon
            .wait_for(what, Duration::from_secs(60), |status| {
                let live = live_of(status, &addrs);
                live.iter().sum::<i64>() == total && ready(&live)
            });
    }

    fn live(&self) -> [i64; 3] {
        live_of(&self.daemon.status().expect("status"), &self.addrs)
    }
}

/// One run's record.
struct Run {
    label: &'static str,
    /// (seconds since the herd connected, live per server)
    series: Vec<(f64, [i64; 3])>,
    /// Seconds at which each server was back and healthy.
    restarts: Vec<f64>,
    end: [i64; 3],
    at_last_restart: [i64; 3],
    moves: u64,
    summary: serde_json::Value,
}

impl Run {
    fn ratio(&self) -> f64 {
        let max = *self.end.iter().max().unwrap_or(&0) as f64;
        let min = *self.end.iter().min().unwrap_or(&0) as f64;
        if min == 0.0 { f64::INFINITY } else { max / min }
    }

    /// The least moves that balance the live counts of the moment the
    /// last server came back.
    fn minimum_moves(&self) -> i64 {
        let total: i64 = self.at_last_restart.iter().sum();
        let fair = (total + 2) / 3;
        self.at_last_restart
            .iter()
            .map(|live| (live - fair).max(0))
            .sum()
    }

    /// Seconds from the last server's return until max/min ≤ 1.2 held in
    /// the samples, if it did.
    fn balanced_after(&self) -> Option<f64> {
        let back = *self.restarts.last()?;
        self.series
            .iter()
            .filter(|(t, _)| *t >= back)
            .find(|(_, live)| {
                let max = *live.iter().max().unwrap_or(&0);
                let min = *live.iter().min().unwrap_or(&0);
                min > 0 && max * 10 <= min * 12
            })
            .map(|(t, _)| t - back)
    }

    fn failed(&self) -> u64 {
        self.summary["failed"].as_u64().unwrap_or(u64::MAX)
    }
}

fn live_of(status: &serde_json::Value, addrs: &[SocketAddr]) -> [i64; 3] {
    let mut live = [0; 3];
    for (slot, addr) in live.iter_mut().zip(addrs) {
        *slot = backend_field(status, &addr.to_string(), "live")
            .and_then(|value| value.as_i64())
            .unwrap_or(0);
    }
    live
}

fn herd(label: &'static str, rebalance: bool) -> Run {
    // A tolerance of 0.05 on max/mean: the issue's goal is max/min at
    // most 1.2.
    let flags: &[&str] = if rebalance {
        &[
            "--rebalance",
            "--rebalance-tolerance",
            "0.05",
            "--rebalance-after",
            "5s",
            "--rebalance-rate",
            "25",
        ]
    } else {
        &[]
    };
    let mut setup = Setup::new(label, flags);
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

    // Live connections per server, each second, from status.
    let started = Instant::now();
    let series = Arc::new(Mutex::new(Vec::new()));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (series, sampling) = (Arc::clone(&series), Arc::clone(&sampling));
        let pin = daemon.pin_path.display().to_string();
        let addrs = addrs.clone();
        std::thread::spawn(move || {
            // Bounded by the run (at most ~10 minutes).
            for _ in 0..600 {
                if !sampling.load(Ordering::SeqCst) {
                    break;
                }
                let output = socklb(&["status", "--json", "--pin-path", &pin]);
                if let Ok(status) = serde_json::from_slice::<serde_json::Value>(&output.stdout)
                    && let Ok(mut series) = series.lock()
                {
                    series.push((started.elapsed().as_secs_f64(), live_of(&status, &addrs)));
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };

    // The rolling restart: each server killed, started again, healthy
    // again before the next.
    let mut restarts = Vec::new();
    for (server, addr) in addrs.iter().enumerate() {
        cluster.servers[server].kill();
        daemon.wait_health(&[*addr], false, Duration::from_secs(20));
        cluster.servers[server].start();
        daemon.wait_health(&[*addr], true, Duration::from_secs(20));
        restarts.push(started.elapsed().as_secs_f64());
        if server + 1 < addrs.len() {
            std::thread::sleep(BETWEEN_RESTARTS);
        }
    }
    let at_last_restart = live_of(&daemon.status().unwrap(), &addrs);
    let last = Instant::now();
    while last.elapsed() < SETTLE {
        std::thread::sleep(Duration::from_millis(500));
    }
    let status = daemon.status().unwrap();
    let end = live_of(&status, &addrs);
    let moves = status["daemon_info"]["fleet"][0]["rebalance_moves"]
        .as_u64()
        .unwrap_or(0);
    sampling.store(false, Ordering::SeqCst);
    let _ = sampler.join();
    let summary = agents.summary();
    let series = std::mem::take(&mut *series.lock().unwrap());
    Run {
        label,
        series,
        restarts,
        end,
        at_last_restart,
        moves,
        summary,
    }
}

/// An SVG line chart of the live connections per server over time.
fn chart(run: &Run, width: f64, height: f64) -> String {
    let last_t = run.series.last().map_or(1.0, |(t, _)| *t).max(1.0);
    let max_live = run
        .series
        .iter()
        .flat_map(|(_, live)| live.iter().copied())
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let (left, right, top, bottom) = (50.0, 10.0, 30.0, 30.0);
    let x = |t: f64| left + t / last_t * (width - left - right);
    let y = |live: f64| top + (1.0 - live / max_live) * (height - top - bottom);
    let colors = ["#1f77b4", "#ff7f0e", "#2ca02c"];
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = write!(
        svg,
        r#"<text x="{left}" y="16" font-size="13">{}: live connections per server (1,000 agents)</text>"#,
        run.label
    );
    let _ = write!(
        svg,
        r#"<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="black"/>"#,
        height - bottom,
        width - right,
        height - bottom,
        height - bottom
    );
    let _ = write!(
        svg,
        r#"<text x="4" y="{}">{}</text><text x="4" y="{}">0</text><text x="{}" y="{}">{:.0} s</text>"#,
        top + 4.0,
        max_live as i64,
        height - bottom,
        width - right - 30.0,
        height - 12.0,
        last_t
    );
    for (index, restart) in run.restarts.iter().enumerate() {
        let _ = write!(
            svg,
            r##"<line x1="{0}" y1="{top}" x2="{0}" y2="{1}" stroke="#999" stroke-dasharray="3,3"/><text x="{0}" y="{2}" fill="#666">s{index} back</text>"##,
            x(*restart),
            height - bottom,
            height - 16.0
        );
    }
    for (server, color) in colors.iter().enumerate() {
        let points: Vec<String> = run
            .series
            .iter()
            .map(|(t, live)| format!("{:.1},{:.1}", x(*t), y(live[server] as f64)))
            .collect();
        let _ = write!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/><text x="{}" y="{}" fill="{color}">s{server}</text>"#,
            points.join(" "),
            width - right - 60.0 + 20.0 * server as f64,
            top - 4.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn write_report(runs: &[&Run]) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/fleet");
    std::fs::create_dir_all(&dir).expect("target/fleet");
    let mut svg =
        String::from(r#"<svg xmlns="http://www.w3.org/2000/svg" width="760" height="560">"#);
    for (index, run) in runs.iter().enumerate() {
        let _ = write!(
            svg,
            r#"<g transform="translate(0,{})">{}</g>"#,
            280 * index,
            chart(run, 760.0, 270.0)
        );
    }
    svg.push_str("</svg>\n");
    std::fs::write(dir.join("rolling-restart.svg"), svg).expect("the chart");
    let mut text = format!(
        "## Rolling restart\n\n\
         Each server in turn is killed, started again and waited for until \
         healthy; the next is killed {} s later (longer than an agent's \
         longest retry delay, so that no request meets two kills, one per \
         attempt: with no pause, the retries of requests cut by one kill \
         landed on the next server as it was killed, and 5 to 12 requests \
         in 65,000 failed). The herd runs on for 60 s after the last one.\n\n\
         | | rebalancing off | rebalancing on |\n| --- | --- | --- |\n",
        BETWEEN_RESTARTS.as_secs()
    );
    let cell = |f: &dyn Fn(&Run) -> String| -> String {
        runs.iter()
            .map(|run| f(run))
            .collect::<Vec<_>>()
            .join(" | ")
    };
    let _ = writeln!(
        text,
        "| live per server when the last server was back | {} |",
        cell(&|run| format!("{:?}", run.at_last_restart))
    );
    let _ = writeln!(
        text,
        "| live per server 60 s later | {} |",
        cell(&|run| format!("{:?}", run.end))
    );
    let _ = writeln!(
        text,
        "| max/min 60 s later | {} |",
        cell(&|run| format!("{:.2}", run.ratio()))
    );
    let _ = writeln!(
        text,
        "| max/min ≤ 1.2 reached after the last return | {} |",
        cell(&|run| run
            .balanced_after()
            .map_or("never".to_string(), |seconds| format!("{seconds:.0} s")))
    );
    let _ = writeln!(
        text,
        "| connections moved (minimum needed) | {} |",
        cell(&|run| format!("{} ({})", run.moves, run.minimum_moves()))
    );
    let _ = writeln!(
        text,
        "| requests, failed, retried; reconnects | {} |",
        cell(&|run| format!(
            "{}, {}, {}; {}",
            run.summary["requests"],
            run.summary["failed"],
            run.summary["retried"],
            run.summary["reconnects"]
        ))
    );
    text.push_str(
        "\n![live connections per server](rolling-restart.svg)\n\n\
         ### Live connections per server, each second\n\n",
    );
    for run in runs {
        let _ = writeln!(
            text,
            "#### {}\n\n| s | s0 | s1 | s2 |\n| --- | --- | --- | --- |",
            run.label
        );
        for (t, live) in &run.series {
            let _ = writeln!(text, "| {t:.0} | {} | {} | {} |", live[0], live[1], live[2]);
        }
        text.push('\n');
    }
    write_section("2-rolling-restart.md", &text);
}

/// Writes one scenario's section to target/fleet/ and joins the sections
/// there into FLEET.md.
fn write_section(name: &str, text: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/fleet");
    std::fs::create_dir_all(&dir).expect("target/fleet");
    std::fs::write(dir.join(name), text).expect("the section");
    let mut sections: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("target/fleet")
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.as_bytes()[0].is_ascii_digit() && name.ends_with(".md"))
        })
        .collect();
    sections.sort();
    let mut report = format!(
        "# A herd of 1,000 agents\n\n\
         Written by `tests/tests/herd.rs` (part of `cargo xtask test`): 1,000 \
         `fleetagent` agents, each with one keep-alive TLS connection to the VIP \
         and a request every second (one retry after 250 ms plus up to 750 ms \
         of jitter), on three server namespaces running test apiservers, \
         behind socklb with least-conn, close-on-failure and health checks \
         every 200 ms (timeout {PROBE_TIMEOUT_MS} ms; fall 2, \
         rise 2).\n\n",
    );
    for section in sections {
        report.push_str(&std::fs::read_to_string(section).expect("a section"));
        report.push('\n');
    }
    std::fs::write(dir.join("FLEET.md"), report).expect("the report");
}

#[test]
fn a_herd_of_1000_through_a_rolling_restart_with_and_without_rebalancing() {
    require_root();
    let off = herd("rebalancing off", false);
    let on = herd("rebalancing on", true);
    for run in [&off, &on] {
        let line = format!(
            "herd of 1000, rolling restart, {}: live {:?} when the last server was back, {:?} 60 s later (max/min {:.2}); {} moves for a minimum of {}; {} requests, {} failed, {} retried, {} reconnects; errors {}",
            run.label,
            run.at_last_restart,
            run.end,
            run.ratio(),
            run.moves,
            run.minimum_moves(),
            run.summary["requests"],
            run.summary["failed"],
            run.summary["retried"],
            run.summary["reconnects"],
            run.summary["errors"]
        );
        println!("{line}");
        record_figures(&line);
    }
    write_report(&[&off, &on]);
    let _ = std::io::stdout().flush();
    // Without rebalancing the server restarted last stays nearly empty.
    assert!(
        off.ratio() > 2.0,
        "the baseline shows the imbalance: {:?}",
        off.end
    );
    // With it: balanced within 60 s, with few more moves than needed.
    assert!(on.ratio() <= 1.2, "balanced: {:?}", on.end);
    assert!(
        on.moves as f64 <= 1.2 * on.minimum_moves() as f64 + 3.0,
        "{} moves for a minimum of {}",
        on.moves,
        on.minimum_moves()
    );
    // The goal is 0 failed requests, met with rebalancing on in all four
    // runs here since the pause between restarts; but a retry that lands
    // on a killed server before it is seen down still fails (one run of
    // four with rebalancing off: 8 of 71,219), so the bound is one in a
    // thousand and the figure is reported.
    let requests = on.summary["requests"].as_u64().unwrap_or(0);
    assert!(
        on.failed() * 1000 <= requests,
        "failed requests: {}",
        on.summary
    );
}

/// The work of the hung-server run: each agent's `/work` requests.
const WORK_REQUESTS: u32 = 12;

#[test]
fn a_herd_of_1000_while_one_server_hangs() {
    let mut setup = Setup::new("herd-hung", &[]);
    let bound = detect_bound(PROBE_TIMEOUT_MS);
    let mut agents = setup.agents(AGENTS, &["--work-requests", &WORK_REQUESTS.to_string()]);
    setup.wait_live("the herd connected", i64::from(AGENTS), |_| true);
    let before = setup.live();
    // s0 hangs in place (accepts, never answers) as the work starts.
    setup.cluster.servers[0].hang_in_place();
    agents.start_work();
    let out = setup
        .daemon
        .wait_health(&[setup.addrs[0]], false, Duration::from_secs(20));
    let summary = agents.finish_work();
    let work = &summary["work"];
    let finish: Vec<u64> = work["finish_ms"]
        .as_array()
        .map(|all| all.iter().filter_map(|ms| ms.as_u64()).collect())
        .unwrap_or_default();
    let last = finish.last().copied().unwrap_or(u64::MAX);
    let median = finish.get(finish.len() / 2).copied().unwrap_or(u64::MAX);
    // The ideal: the total work over the capacity of the two healthy
    // servers.
    let ideal_ms = u64::from(AGENTS * WORK_REQUESTS) * 1000
        / u64::from(2 * socklb_tests::cluster::WORK_PER_SECOND);
    let longest = work["longest_failed_attempt_ms"]
        .as_u64()
        .unwrap_or(u64::MAX);
    let served = &summary["servers"];
    let line = format!(
        "herd of 1000, one server hangs: {} of {AGENTS} agents did their {WORK_REQUESTS} requests; \
         last served after {last} ms, median {median} ms, ideal {ideal_ms} ms ({:.2}× ideal); \
         s0 out after {} ms; longest wait on the hung server {longest} ms \
         (probe timeout {PROBE_TIMEOUT_MS} ms, detection bound {} ms); {} work requests failed; \
         live before {before:?}; requests served {served}",
        work["agents_done"],
        last as f64 / ideal_ms as f64,
        out.as_millis(),
        bound.as_millis(),
        work["failed"],
    );
    println!("{line}");
    record_figures(&line);
    write_section(
        "1-hung-server.md",
        &format!(
            "## One hung server\n\n\
             The herd is connected ({before:?} live per server) when s0 hangs in \
             place: it keeps accepting TCP and answers nothing. At that moment \
             every agent starts {WORK_REQUESTS} `/work` requests back to back; a \
             server serves {} of them per second, so the ideal time, the total \
             work over the two healthy servers' capacity, is {ideal_ms} ms.\n\n\
             | | |\n| --- | --- |\n\
             | agents that did all their work | {} of {AGENTS} |\n\
             | last agent served after | {last} ms ({:.2}× ideal) |\n\
             | median agent served after | {median} ms |\n\
             | s0 out of the table after | {} ms |\n\
             | longest wait of any agent on s0 | {longest} ms |\n\
             | work requests failed | {} |\n\n\
             A server that accepts and never answers can only be found by a \
             probe that times out, so no balancer can release an agent sooner \
             than one probe timeout after its first probe to the hung server. \
             This run probes every 200 ms with a timeout of {PROBE_TIMEOUT_MS} ms \
             (300 ms takes a healthy server out too while 1,000 agents start \
             at once on two cores). The bound asserted, {} ms, is the worst \
             case of detection: the first probe to time out starts up to one \
             jittered interval after the hang, the next starts as it times \
             out, so the second failure comes 2 × {PROBE_TIMEOUT_MS} ms later; \
             then 250 ms for close-on-failure to end every connection on s0 \
             and the agent to see it. The agents' retry goes to a healthy \
             server.\n",
            socklb_tests::cluster::WORK_PER_SECOND,
            work["agents_done"],
            last as f64 / ideal_ms as f64,
            out.as_millis(),
            work["failed"],
            bound.as_millis(),
        ),
    );
    assert_eq!(
        work["agents_done"], AGENTS,
        "every agent finished: {summary}"
    );
    assert_eq!(work["failed"], 0, "no work request failed: {summary}");
    assert!(
        last * 10 <= ideal_ms * 12,
        "every agent served within 1.2× the ideal {ideal_ms} ms: the last after {last} ms"
    );
    assert!(
        Duration::from_millis(longest) <= bound,
        "no agent waits on the hung server longer than the detection bound {} ms: {longest} ms",
        bound.as_millis()
    );
}

/// The recovered server's share of the connections opened in its first
/// 5 s.
struct Recovery {
    label: &'static str,
    /// Live per server when s2 was back, and 5 s later.
    at_return: [i64; 3],
    after: [i64; 3],
}

impl Recovery {
    fn joined(&self) -> i64 {
        self.after.iter().sum::<i64>() - self.at_return.iter().sum::<i64>()
    }

    /// s2's share of the new connections.
    fn share(&self) -> f64 {
        (self.after[2] - self.at_return[2]) as f64 / self.joined().max(1) as f64
    }
}

/// 700 agents settled on s0 and s1 while s2 is down; s2 comes back and 300
/// agents join at once.
fn recovery(label: &'static str, flags: &[&str]) -> Recovery {
    const SETTLED: u32 = 700;
    let mut setup = Setup::new(label, flags);
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
    // The window the issue measures: the recovered server's first 5 s.
    std::thread::sleep(Duration::from_secs(5).saturating_sub(back.elapsed()));
    let after = setup.live();
    let _ = (joining.summary(), settled.summary());
    Recovery {
        label,
        at_return,
        after,
    }
}

#[test]
fn a_recovery_herd_with_and_without_slow_start() {
    let without = recovery("without slow start", &[]);
    let with = recovery("with slow start 30 s", &["--slow-start", "30s"]);
    let fair = 1.0 / 3.0;
    let mut text = String::from(
        "## Recovery herd\n\n\
         700 agents are settled on s0 and s1 while s2 is down; s2 comes back \
         and is healthy, and 300 more agents connect at once (spread over one \
         second). The share of those new connections that s2 takes in its \
         first 5 s, against its fair share of a third (three equal weights; \
         goal with slow start: at most 1.5× fair):\n\n\
         | | live when s2 was back | 5 s later | new connections | s2's share | × fair |\n\
         | --- | --- | --- | --- | --- | --- |\n",
    );
    for run in [&without, &with] {
        let line = format!(
            "recovery herd, {}: live {:?} when s2 was back, {:?} 5 s later; s2 took {} of {} new connections ({:.2}, {:.2}× fair)",
            run.label,
            run.at_return,
            run.after,
            run.after[2] - run.at_return[2],
            run.joined(),
            run.share(),
            run.share() / fair
        );
        println!("{line}");
        record_figures(&line);
        let _ = writeln!(
            text,
            "| {} | {:?} | {:?} | {} | {} ({:.2}) | {:.2} |",
            run.label,
            run.at_return,
            run.after,
            run.joined(),
            run.after[2] - run.at_return[2],
            run.share(),
            run.share() / fair
        );
    }
    text.push_str(
        "\nWithout slow start the recovered server, with no live connection, \
         wins every least-conn draw it is in; with it, its slots ramp from \
         about 0 to its full weight over 30 s.\n",
    );
    write_section("3-recovery-herd.md", &text);
    for run in [&without, &with] {
        assert_eq!(
            run.joined(),
            300,
            "every joining agent connected: {:?}",
            run.after
        );
    }
    assert!(
        with.share() <= 1.5 * fair,
        "with slow start s2 takes at most 1.5× its fair share: {:.2}",
        with.share()
    );
    assert!(
        without.share() > with.share(),
        "slow start lowers the share: {:.2} without, {:.2} with",
        without.share(),
        with.share()
    );
}
