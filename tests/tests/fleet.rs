//! Fleet behaviour: a server that comes back (or is added) does not take
//! the whole herd's reconnects. With least-conn it has no live connections
//! and would win every draw it is in; slow start gives it a tenth of its
//! weight's share in the kernel's tables first, then more each tenth of the
//! duration.

use std::{net::SocketAddr, time::Duration};

use socklb_tests::{
    Backend, Cgroup, ConnClient, Daemon, backend_field, free_port, record_figures, require_root,
    service_args,
};

const LIMIT: Duration = Duration::from_secs(20);

fn live(status: &serde_json::Value, addr: SocketAddr) -> i64 {
    backend_field(status, &addr.to_string(), "live")
        .and_then(|value| value.as_i64())
        .unwrap_or(0)
}

fn healthy(status: &serde_json::Value, addr: SocketAddr) -> bool {
    backend_field(status, &addr.to_string(), "healthy") == Some(serde_json::Value::Bool(true))
}

/// Three servers with 20 long-lived connections each; the third fails
/// (its connections are closed) and comes back; then a herd of 60 new
/// connections arrives. Returns how many of them the returning server got.
fn returning_server_share(label: &str, base: u8, extra: &[&str]) -> i64 {
    let cgroup = Cgroup::new(label);
    let mut backends: Vec<Backend> = (0..3u8)
        .map(|index| {
            Backend::start_holding(&format!("b{index}"), &format!("127.0.0.{}", base + index))
        })
        .collect();
    let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut flags = vec!["--policy", "least-conn", "--close-on-failure", "true"];
    flags.extend_from_slice(extra);
    let mut daemon = Daemon::start(label, &service_args(&cgroup.path, &[vip], &addrs, &flags));
    daemon.wait_health(&addrs, true, LIMIT);

    let mut settled =
        ConnClient::hold_until_released(vip, &cgroup.path, 60, Duration::from_secs(120));
    daemon.wait_for("60 settled connections", LIMIT, |status| {
        addrs.iter().map(|addr| live(status, *addr)).sum::<i64>() == 60
    });

    // The third server fails: its connections are closed, it leaves.
    backends[2].stop();
    daemon.wait_for("b2 down and empty", LIMIT, |status| {
        !healthy(status, addrs[2]) && live(status, addrs[2]) == 0
    });
    let before: i64 = {
        let status = daemon.status().unwrap();
        live(&status, addrs[0]) + live(&status, addrs[1])
    };

    // It comes back; at once a herd of 60 connects.
    backends[2].resume();
    daemon.wait_for("b2 healthy again", LIMIT, |status| {
        healthy(status, addrs[2])
    });
    let mut herd = ConnClient::hold_until_released(vip, &cgroup.path, 60, Duration::from_secs(120));
    daemon.wait_for("the herd connected", LIMIT, |status| {
        addrs.iter().map(|addr| live(status, *addr)).sum::<i64>() == before + 60
    });
    let status = daemon.status().unwrap();
    let share = live(&status, addrs[2]);
    if extra.contains(&"--slow-start") {
        // status says the ramp is on, at an early step.
        let ramping = &status["daemon_info"]["fleet"][0]["ramping"];
        let step = ramping
            .as_array()
            .and_then(|ramps| ramps.iter().find(|ramp| ramp[0] == addrs[2].to_string()))
            .and_then(|ramp| ramp[1].as_u64());
        assert!(step.is_some_and(|step| step <= 3), "{status}");
    }
    herd.release();
    settled.release();
    let _ = herd.finish();
    let _ = settled.finish();
    share
}

#[test]
fn slow_start_keeps_a_returning_server_from_taking_the_herd() {
    require_root!();
    let without = returning_server_share("herd-base", 81, &[]);
    let with = returning_server_share("herd-slow", 85, &["--slow-start", "30s"]);
    record_figures(&format!(
        "slow start: of 60 new connections right after a server came back (least-conn, the others at ~20 live each), it took {without} without slow start, {with} with --slow-start 30s"
    ));
    assert!(
        without >= 20,
        "least-conn without slow start sends the herd to the empty server: {without} of 60"
    );
    assert!(
        with * 2 <= without,
        "slow start at least halves its share: {with} against {without} of 60"
    );
}

/// `socklb_rebalance_moves_total` summed over backends, from the log's
/// last "after N moves (M needed)".
fn episode_moves(log: &str) -> Option<(u64, u64)> {
    let line = log
        .lines()
        .rev()
        .find(|line| line.contains("in balance again"))?;
    let after = line.split("after ").nth(1)?;
    let moved = after.split(' ').next()?.parse().ok()?;
    let needed = after.split('(').nth(1)?.split(' ').next()?.parse().ok()?;
    Some((moved, needed))
}

#[test]
fn rebalancing_evens_out_long_lived_connections_after_a_server_returns() {
    require_root!();
    let cgroup = Cgroup::new("rebalance");
    let mut backends: Vec<Backend> = (0..3u8)
        .map(|index| {
            Backend::start_holding(&format!("b{index}"), &format!("127.0.0.{}", 91 + index))
        })
        .collect();
    let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let flags = [
        "--policy",
        "least-conn",
        "--rebalance",
        "--rebalance-after",
        "1s",
        "--rebalance-rate",
        "20",
    ];
    let mut daemon = Daemon::start(
        "rebalance",
        &service_args(&cgroup.path, &[vip], &addrs, &flags),
    );
    daemon.wait_health(&addrs, true, LIMIT);

    // b2 is down while 60 long-lived clients connect: they all land on b0
    // and b1, as after a rolling restart that ended with b2.
    backends[2].stop();
    daemon.wait_for("b2 down", LIMIT, |status| !healthy(status, addrs[2]));
    let mut clients =
        ConnClient::hold_reconnecting(vip, &cgroup.path, 60, Duration::from_secs(120));
    daemon.wait_for("60 clients on b0 and b1", LIMIT, |status| {
        live(status, addrs[0]) + live(status, addrs[1]) == 60
    });
    backends[2].resume();
    daemon.wait_for("b2 back", LIMIT, |status| healthy(status, addrs[2]));

    // Rebalancing moves about a third of them to b2, and stops.
    let took = daemon.wait_for("in balance", Duration::from_secs(60), |status| {
        let counts: Vec<i64> = addrs.iter().map(|addr| live(status, *addr)).collect();
        let total: i64 = counts.iter().sum();
        let max = counts.iter().copied().max().unwrap_or(0);
        total == 60 && max * 10 <= 24 * 10 && counts.iter().all(|count| *count >= 16)
    });
    assert!(
        daemon.log_shows("in balance again", LIMIT),
        "{}",
        daemon.log()
    );
    let (moved, needed) = episode_moves(&daemon.log()).expect("the episode's line");
    let status = daemon.status().unwrap();
    let counts: Vec<i64> = addrs.iter().map(|addr| live(&status, *addr)).collect();
    assert_eq!(
        status["daemon_info"]["fleet"][0]["rebalance_moves"].as_u64(),
        Some(moved),
        "status counts the moves: {status}"
    );
    clients.release();
    let ends = clients.finish();
    let reconnects: u64 = ends
        .iter()
        .map(|end| end["reconnects"].as_u64().unwrap_or(0))
        .sum();
    let lost = ends.iter().filter(|end| end["end"] != "open").count();
    record_figures(&format!(
        "rebalance: 60 long-lived clients on 2 of 3 servers after the third returned: balanced to {counts:?} in {} ms with {moved} moves ({needed} needed, ratio {:.2}), {reconnects} reconnects, {lost} clients lost",
        took.as_millis(),
        moved as f64 / needed.max(1) as f64
    ));
    assert_eq!(lost, 0, "every client reconnected: {ends:?}");
    assert_eq!(needed, 20, "10 from each of b0 and b1");
    assert!(
        moved * 10 <= needed * 12,
        "moves ≤ 1.2 × the minimum: {moved} for {needed}"
    );
    assert_eq!(reconnects, moved, "each move is one reconnect");

    // In balance, nothing more moves.
    let before = daemon.log().matches("rebalance: default: closed").count();
    daemon.wait_beats(3, LIMIT);
    assert_eq!(
        daemon.log().matches("rebalance: default: closed").count(),
        before,
        "no move in balance"
    );
}

fn closes_in(log: &str) -> usize {
    log.lines()
        .filter(|line| line.contains("(close-on-failure)") && line.contains(": closed "))
        .count()
}

/// Issue 18: when every server is slow (all answer /readyz in 1.5 s
/// against socklb's default 1 s timeout), every backend goes down within
/// a few seconds. close-on-failure used to abort every connection on the
/// node, and the herd reconnected at once to servers no better. Now no
/// connection is closed while none is healthy (nor while the others fail
/// their probes too), the table fails open, the agents' connections stay
/// up, and when health comes back nothing is closed either.
#[test]
fn when_every_server_is_slow_no_connection_is_closed() {
    require_root!();
    let cluster = socklb_tests::cluster::Cluster::new(3);
    let cgroup = Cgroup::new("allslow");
    let addrs = cluster.addrs();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let metrics_flag = metrics.to_string();
    // socklb's defaults: probes every 1 s, timeout 1 s, fall 3, rise 2,
    // close-on-failure on, fail-open.
    let mut flags = socklb_tests::DEFAULT_APISERVER_HEALTH.to_vec();
    flags.extend(["--metrics-addr", &metrics_flag]);
    let mut daemon = Daemon::start(
        "allslow",
        &service_args(&cgroup.path, &[vip], &addrs, &flags),
    );
    daemon.wait_health(&addrs, true, LIMIT);
    // 30 long-lived agents: one keep-alive TLS connection each, a /readyz
    // request every second with a 2 s timeout.
    let agents = socklb_tests::herd::Agents::spawn(vip, &cgroup.path, 30, &[]);
    daemon.wait_for("30 agents connected", LIMIT, |status| {
        addrs.iter().map(|addr| live(status, *addr)).sum::<i64>() == 30
    });

    for server in &cluster.servers {
        server.toggle_slow();
    }
    let all_down = daemon.wait_for("every backend down", LIMIT, |status| {
        addrs.iter().all(|addr| !healthy(status, *addr))
    });
    let status = daemon.status().expect("status");
    let live_when_none: i64 = addrs.iter().map(|addr| live(&status, *addr)).sum();
    assert!(
        daemon.log_shows("no backend is healthy: connections stay", LIMIT),
        "said once:\n{}",
        daemon.log()
    );
    let kept = socklb_tests::scrape_metrics(metrics)
        .get("socklb_close_on_failure_kept_total{service=\"default\"}")
        .copied();
    let closed_while_down = closes_in(&daemon.log());

    for server in &cluster.servers {
        server.toggle_slow();
    }
    daemon.wait_health(&addrs, true, LIMIT);
    // A few ticks after the recovery: the held and kept closes would have
    // been made by now.
    daemon.wait_beats(4, LIMIT);
    let closed_at_all = closes_in(&daemon.log());
    let summary = agents.summary();
    socklb_tests::record_figures(&format!(
        "every server slow (/readyz in 1.5 s, timeout 1 s, socklb's defaults): all 3 down after {} ms; {closed_while_down} closes while none was healthy, {closed_at_all} in all; {live_when_none} of 30 connections live with none healthy; the agents made {} requests, {} failed, {} reconnects",
        all_down.as_millis(),
        summary["requests"],
        summary["failed"],
        summary["reconnects"]
    ));
    assert_eq!(closed_while_down, 0, "{}", daemon.log());
    assert_eq!(
        closed_at_all,
        0,
        "no herd of closes on recovery:\n{}",
        daemon.log()
    );
    assert_eq!(live_when_none, 30, "the connections stay where they are");
    assert_eq!(kept, Some(1.0), "counted once");
    assert_eq!(
        daemon.log().matches("no backend is healthy").count(),
        1,
        "said once"
    );
    assert_eq!(summary["reconnects"], 0, "{summary}");
    assert_eq!(summary["connects"], 30, "{summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
}

/// Issue 18: a rebalancing rule that reaches balance at its defaults. 300
/// long-lived reconnecting clients over three servers with least-conn and
/// `--rebalance` at its defaults (tolerance 0.2, after 10 s, 5/s); one
/// server fails (close-on-failure moves its clients to the other two) and
/// comes back. The rule judges the least loaded as well as the most, and
/// an episode runs to the fair share: max/min at most 1.3 within 75 s of
/// the recovery, with at most 1.5× the least moves.
#[test]
fn rebalancing_reaches_balance_at_its_defaults() {
    require_root!();
    let cgroup = Cgroup::new("rebal-defaults");
    let mut backends: Vec<Backend> = (0..3u8)
        .map(|index| {
            Backend::start_holding(&format!("b{index}"), &format!("127.0.0.{}", 111 + index))
        })
        .collect();
    let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let flags = ["--policy", "least-conn", "--rebalance"];
    let mut daemon = Daemon::start(
        "rebal-defaults",
        &service_args(&cgroup.path, &[vip], &addrs, &flags),
    );
    daemon.wait_health(&addrs, true, LIMIT);
    let mut clients =
        ConnClient::hold_reconnecting(vip, &cgroup.path, 300, Duration::from_secs(240));
    daemon.wait_for("300 clients connected", LIMIT, |status| {
        addrs.iter().map(|addr| live(status, *addr)).sum::<i64>() == 300
    });

    // b2 fails: close-on-failure sends its clients to b0 and b1.
    backends[2].stop();
    daemon.wait_for("b2 down and empty, its clients back", LIMIT, |status| {
        !healthy(status, addrs[2])
            && live(status, addrs[2]) == 0
            && addrs.iter().map(|addr| live(status, *addr)).sum::<i64>() == 300
    });
    backends[2].resume();
    daemon.wait_for("b2 back", LIMIT, |status| healthy(status, addrs[2]));
    let at_recovery: Vec<i64> = {
        let status = daemon.status().unwrap();
        addrs.iter().map(|addr| live(&status, *addr)).collect()
    };
    let total: i64 = at_recovery.iter().sum();
    let fair = (total + 2) / 3;
    let least: i64 = at_recovery.iter().map(|live| (live - fair).max(0)).sum();

    let balanced = |status: &serde_json::Value| {
        let counts: Vec<i64> = addrs.iter().map(|addr| live(status, *addr)).collect();
        let max = *counts.iter().max().unwrap_or(&0);
        let min = *counts.iter().min().unwrap_or(&0);
        min > 0 && max * 10 <= min * 13
    };
    let took = daemon.wait_for("max/min ≤ 1.3", Duration::from_secs(75), balanced);
    assert!(
        daemon.log_shows("in balance again", Duration::from_secs(30)),
        "the episode ends:\n{}",
        daemon.log()
    );
    let status = daemon.status().unwrap();
    let end: Vec<i64> = addrs.iter().map(|addr| live(&status, *addr)).collect();
    let moves = status["daemon_info"]["fleet"][0]["rebalance_moves"]
        .as_u64()
        .unwrap_or(u64::MAX);
    clients.release();
    let ends = clients.finish();
    let lost = ends.iter().filter(|end| end["end"] != "open").count();
    record_figures(&format!(
        "rebalancing at its defaults (tolerance 0.2, after 10 s, 5/s), 300 reconnecting clients, least-conn: live {at_recovery:?} when the failed server was back, max/min ≤ 1.3 after {} ms, {end:?} when the episode ended; {moves} moves for a minimum of {least} ({:.2}×); {lost} clients lost",
        took.as_millis(),
        moves as f64 / least.max(1) as f64
    ));
    assert!(balanced(&status), "still in balance: {end:?}");
    assert!(
        moves as f64 <= 1.5 * least as f64,
        "{moves} moves for a minimum of {least}"
    );
    assert_eq!(lost, 0, "every client reconnected");
}
