//! A herd of 1,000 long-lived agents (`fleetagent`: one keep-alive TLS
//! connection each, a request every second, one retry) on three server
//! namespaces, through a rolling restart of all three servers, with
//! rebalancing off (the baseline) and on. Prints the live connections per
//! server each second, the max/min ratio 60 s after the last restart, the
//! moves against the minimum needed and the failed requests, and writes
//! them with an SVG chart to target/fleet/ (bench/results/FLEET.md is a
//! committed copy of such a run).

use std::{
    fmt::Write as _,
    io::Write as _,
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
    require_root();
    let mut cluster = Cluster::new(3);
    let cgroup = Cgroup::new(label);
    let addrs = cluster.addrs();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut flags = vec![
        "--health",
        "apiserver",
        "--health-interval",
        "200ms",
        "--health-timeout",
        "300ms",
        "--fall",
        "2",
        "--rise",
        "2",
        "--policy",
        "least-conn",
        "--close-on-failure",
        "true",
    ];
    if rebalance {
        // A tolerance of 0.05 on max/mean: the issue's goal is max/min
        // at most 1.2.
        flags.extend([
            "--rebalance",
            "--rebalance-tolerance",
            "0.05",
            "--rebalance-after",
            "5s",
            "--rebalance-rate",
            "25",
        ]);
    }
    let mut daemon = Daemon::start(label, &service_args(&cgroup.path, &[vip], &addrs, &flags));
    daemon.wait_health(&addrs, true, Duration::from_secs(20));

    let mut agents: Child = Command::new(helper_bin("fleetagent"))
        .args(["--addr", &vip.to_string(), "--cgroup"])
        .arg(&cgroup.path)
        .args(["--agents", &AGENTS.to_string(), "--max-seconds", "400"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("fleetagent");
    daemon.wait_for("the herd connected", Duration::from_secs(60), |status| {
        live_of(status, &addrs).iter().sum::<i64>() == i64::from(AGENTS)
    });

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
    drop(agents.stdin.take());
    let output = agents.wait_with_output().expect("fleetagent's summary");
    let summary: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("fleetagent's summary JSON");
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
    let mut text = String::from(
        "# A herd of 1,000 agents through a rolling restart\n\n\
         Written by `tests/tests/herd.rs` (part of `cargo xtask test`): 1,000 \
         `fleetagent` agents, each with one keep-alive TLS connection to the VIP \
         and a request every second (one retry after 250 ms plus up to 750 ms of jitter), on three server \
         namespaces behind socklb with least-conn and close-on-failure. Each \
         server in turn is killed, started again and waited for until healthy; \
         the herd runs on for 60 s after the last one.\n\n\
         | | rebalancing off | rebalancing on |\n| --- | --- | --- |\n",
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
         ## Live connections per server, each second\n\n",
    );
    for run in runs {
        let _ = writeln!(
            text,
            "### {}\n\n| s | s0 | s1 | s2 |\n| --- | --- | --- | --- |",
            run.label
        );
        for (t, live) in &run.series {
            let _ = writeln!(text, "| {t:.0} | {} | {} | {} |", live[0], live[1], live[2]);
        }
        text.push('\n');
    }
    std::fs::write(dir.join("FLEET.md"), text).expect("the report");
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
    // The goal is 0 failed requests; a request whose retry also lands
    // in the half second before a killed server is seen down can still
    // fail, so the bound is one in a thousand and the figure is reported.
    let requests = on.summary["requests"].as_u64().unwrap_or(0);
    assert!(
        on.failed() * 1000 <= requests,
        "failed requests: {}",
        on.summary
    );
}
