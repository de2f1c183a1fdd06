//! What the sock_ops program sees: live connections per backend (which
//! least-conn balances in the kernel) and failed connects (which hurry the
//! backend's next probe, so that a dead one leaves after `fall` failed
//! probes long before its next scheduled one; they never take a backend
//! out by themselves).

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use socklb_tests::{
    Backend, Cgroup, ClientRun, ConnClient, Daemon, backend_field, cluster::Cluster, free_port,
    require_root, service_args, spread,
};

fn live(status: &serde_json::Value, backend: &Backend) -> i64 {
    backend_field(status, &backend.addr.to_string(), "live")
        .and_then(|value| value.as_i64())
        .unwrap_or(-1)
}

#[test]
fn least_conn_balances_live_connections_and_status_counts_them() {
    require_root!();
    let cgroup = Cgroup::new("leastconn");
    let backends = [
        Backend::start_holding("b0", "127.0.0.2"),
        Backend::start_holding("b1", "127.0.0.3"),
    ];
    let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut daemon = Daemon::start(
        "leastconn",
        &service_args(&cgroup.path, &[vip], &addrs, &["--policy", "least-conn"]),
    );
    daemon.wait_health(&addrs, true, Duration::from_secs(10));

    // Load b0 with 30 live connections while b1 is drained.
    let pin = daemon.pin_path.display().to_string();
    let b1 = backends[1].addr.to_string();
    assert!(
        socklb_tests::socklb(&["drain", &b1, "--pin-path", &pin])
            .status
            .success()
    );
    daemon.wait_for("b1 draining", Duration::from_secs(3), |status| {
        backend_field(status, &b1, "draining") == Some(serde_json::json!(true))
    });
    let mut preload = ClientRun::new(vip, Some(&cgroup.path), 30);
    preload.keep_open_ms = Some(4000);
    let preload = preload.spawn();
    daemon.wait_for("30 live on b0", Duration::from_secs(5), |status| {
        live(status, &backends[0]) == 30
    });
    assert!(
        socklb_tests::socklb(&["drain", "--undo", &b1, "--pin-path", &pin])
            .status
            .success()
    );
    daemon.wait_for("b1 back", Duration::from_secs(3), |status| {
        backend_field(status, &b1, "draining") == Some(serde_json::json!(false))
    });

    // 100 more: two choices on live counts send most of them to b1 until
    // the two are even (about 65 of 100); random choice would give b1 50.
    let mut run = ClientRun::new(vip, Some(&cgroup.path), 100);
    run.keep_open_ms = Some(2000);
    let client = run.spawn();
    let took = daemon.wait_for("130 live connections", Duration::from_secs(5), |status| {
        live(status, &backends[0]) + live(status, &backends[1]) == 130
    });
    let status = daemon.status().expect("status");
    let (first, second) = (live(&status, &backends[0]), live(&status, &backends[1]));
    let attempts = client.finish();
    drop(preload);
    let counts = spread(&attempts);
    eprintln!(
        "least-conn: 30 live on b0, then 100 new went {}/{} (b0/b1); live {first}/{second} (seen after {took:?})",
        counts.get("b0").unwrap_or(&0),
        counts.get("b1").unwrap_or(&0)
    );
    assert_eq!(counts.get("error"), None, "{counts:?}");
    assert_eq!(
        (first, second),
        (30 + counts["b0"] as i64, counts["b1"] as i64),
        "live counts match who served"
    );
    assert!(
        counts["b1"] >= 60,
        "least-conn favours the less loaded backend: {counts:?}"
    );
    assert!(
        (first - second).abs() <= 8,
        "and evens them out: {first}/{second}"
    );

    // The servers close their side too: a closed client socket of a held
    // connection can otherwise wait out FIN_WAIT2 (60 s), counted live.
    drop(backends);
    daemon.wait_for("live back to 0", Duration::from_secs(5), |status| {
        addrs.iter().all(|addr| {
            backend_field(status, &addr.to_string(), "live") == Some(serde_json::json!(0))
        })
    });
}

/// A backend that really stops resets every connect; the kernel reports
/// the first reset, which hurries a probe; it is refused, and with the
/// kernel's resets behind it the next refused probes come within 50 ms,
/// so the backend leaves after `fall` (3) refused probes, long before its
/// next scheduled probe (5 s away).
#[test]
fn a_stopped_backend_leaves_through_the_passive_path() {
    require_root!();
    let cgroup = Cgroup::new("passive");
    let mut failing = Backend::start("failing", "127.0.0.2");
    let steady = Backend::start("steady", "127.0.0.3");
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let extra = [
        "--health-interval",
        "5s",
        "--health-down-interval",
        "200ms",
        "--rise",
        "2",
    ];
    let mut daemon = Daemon::start(
        "passive",
        &service_args(&cgroup.path, &[vip], &[failing.addr, steady.addr], &extra),
    );
    daemon.wait_health(&[failing.addr, steady.addr], true, Duration::from_secs(10));

    failing.stop();
    let stopped = Instant::now();
    // Connects every 5 ms for 2 s: the first failures hurry a probe.
    let mut run = ClientRun::new(vip, Some(&cgroup.path), 400);
    run.interval_ms = 5;
    let client = run.spawn();
    let out_after = daemon.wait_health(&[failing.addr], false, Duration::from_secs(3));
    let attempts = client.finish();
    let left_ms = stopped.elapsed().min(out_after).as_millis();
    let errors = attempts.iter().filter(|attempt| !attempt.ok).count();
    socklb_tests::record_figures(&format!(
        "passive: a stopped backend left the table {left_ms} ms after it stopped (3 refused probes, the first hurried by the kernel's reset, the others within 50 ms; probes every 5 s); {errors} of 400 connects (5 ms apart) failed before"
    ));
    // The first failed connect hurries a probe; two more come within
    // 50 ms each (with its jitter); the client's own connects take time
    // too.
    let bound = Duration::from_millis(2 * 60 + 600);
    assert!(
        Duration::from_millis(left_ms as u64) < bound,
        "left within {bound:?}: {left_ms} ms"
    );
    assert!(errors >= 1, "{:?}", spread(&attempts));
    assert!(
        attempts[300..]
            .iter()
            .all(|attempt| attempt.served_by.as_deref() == Some("steady")),
        "after it left every connect goes to the healthy backend: {:?}",
        spread(&attempts[300..])
    );
    assert!(
        daemon.log_shows(
            &format!(
                "{} unhealthy: connect refused, probes hurried by",
                failing.addr
            ),
            Duration::from_secs(2)
        ),
        "taken out by refused probes, hurried by the kernel:\n{}",
        daemon.log()
    );
    assert!(daemon.log().contains("reset by the server"));
    assert!(
        daemon.log().contains("(3/3)"),
        "fall probes, not one:\n{}",
        daemon.log()
    );
    let status = daemon.status().expect("status");
    let failed = backend_field(&status, &failing.addr.to_string(), "failed_connects");
    assert!(
        failed
            .and_then(|value| value.as_u64())
            .is_some_and(|count| count >= 1)
    );

    // It returns only once the probe has passed `rise` times.
    failing.resume();
    daemon.wait_health(&[failing.addr], true, Duration::from_secs(5));
    assert!(daemon.log_shows(
        &format!("{} healthy: connect ok (2/2)", failing.addr),
        Duration::from_secs(2)
    ));
}

/// A server that drops every SYN sends no reset; the kernel reports the
/// SYN's retransmission timeout (about 1 s), which hurries a probe; it
/// times out, and so do two more at the down interval: the backend leaves
/// within the RTO plus three probe timeouts, with probes scheduled only
/// every 5 s.
#[test]
fn a_blackholed_backend_leaves_through_the_syn_timeout() {
    require_root!();
    let mut cluster = Cluster::new(2);
    let cgroup = Cgroup::new("blackhole");
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let extra = [
        "--health-interval",
        "5s",
        "--health-timeout",
        "500ms",
        "--health-down-interval",
        "200ms",
    ];
    let mut daemon = Daemon::start(
        "blackhole",
        &service_args(&cgroup.path, &[vip], &cluster.addrs(), &extra),
    );
    daemon.wait_health(&cluster.addrs(), true, Duration::from_secs(10));
    let holed = cluster.servers[0].addr;
    cluster.servers[0].blackhole();
    let started = Instant::now();
    // Eight connects at once: some land on the holed server and hang in
    // SYN_SENT.
    let client = ConnClient::hold(vip, &cgroup.path, 8, Duration::from_secs(1));
    let out_after = daemon.wait_health(&[holed], false, Duration::from_secs(6));
    drop(client);
    let left = started.elapsed().min(out_after);
    socklb_tests::record_figures(&format!(
        "passive: a blackholed backend left the table {} ms after the blackhole began (SYN RTO about 1 s, then 3 probes timing out at 500 ms; probes every 5 s)",
        left.as_millis()
    ));
    assert!(
        daemon.log_shows("SYN unanswered for the initial RTO", Duration::from_secs(2)),
        "taken out through the SYN timeout:\n{}",
        daemon.log()
    );
    assert!(
        left < Duration::from_secs(5),
        "before the next scheduled probe"
    );
}

/// The reproduction of the forged signal: an unprivileged process in the
/// cgroup opens connects that sit in SYN_SENT (its TTL is dropped on the
/// way) and closes each after 50 ms, 8 per backend. Before the fix, two
/// such closes took a backend out and close-on-failure aborted every
/// connection to it. Now none counts, nothing leaves, nothing is closed.
/// The same process holding its connects past the SYN's RTO makes the
/// kernel report timeouts; the confirming probes pass, and still nothing
/// changes.
#[test]
fn a_local_user_cannot_forge_the_passive_signal() {
    require_root!();
    const TTL: u8 = 42;
    let mut cluster = Cluster::without_servers();
    for _ in 0..3 {
        let index = cluster.add_namespace();
        cluster.servers[index].hang();
        cluster.servers[index].drop_syns_with_ttl(TTL);
    }
    let cgroup = Cgroup::new("forge");
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let addrs = cluster.addrs();
    let mut daemon = Daemon::start(
        "forge",
        &service_args(&cgroup.path, &[vip], &addrs, &["--health", "tcp"]),
    );
    daemon.wait_health(&addrs, true, Duration::from_secs(10));

    let holders = ConnClient::hold(vip, &cgroup.path, 30, Duration::from_secs(12));
    daemon.wait_for("30 live connections", Duration::from_secs(5), |status| {
        addrs
            .iter()
            .map(|addr| {
                backend_field(status, &addr.to_string(), "live")
                    .and_then(|value| value.as_i64())
                    .unwrap_or(0)
            })
            .sum::<i64>()
            == 30
    });

    let quick = ConnClient::abort(vip, &cgroup.path, 24, TTL, Duration::from_millis(50));
    assert_eq!(quick["uid"], 65534, "the hostile process has no privilege");
    assert_eq!(quick["in_progress"], 24, "every connect sat in SYN_SENT");
    let status = daemon.status().expect("status");
    let counted: u64 = addrs
        .iter()
        .filter_map(|addr| backend_field(&status, &addr.to_string(), "failed_connects"))
        .filter_map(|value| value.as_u64())
        .sum();
    assert_eq!(counted, 0, "a client closing its own connect never counts");

    let slow = ConnClient::abort(vip, &cgroup.path, 6, TTL, Duration::from_millis(1500));
    assert_eq!(slow["in_progress"], 6);
    daemon.wait_for(
        "SYN timeouts reported by the kernel",
        Duration::from_secs(5),
        |status| {
            addrs
                .iter()
                .filter_map(|addr| backend_field(status, &addr.to_string(), "failed_connects"))
                .filter_map(|value| value.as_u64())
                .sum::<u64>()
                >= 1
        },
    );
    assert!(
        daemon.log_shows("a probe passed after", Duration::from_secs(3)),
        "the confirming probes ran and passed:\n{}",
        daemon.log()
    );
    let held = holders.finish();
    let status = daemon.status().expect("status");
    for addr in &addrs {
        assert_eq!(
            backend_field(&status, &addr.to_string(), "in_table"),
            Some(serde_json::json!(true)),
            "{addr} never left:\n{}",
            daemon.log()
        );
    }
    assert!(
        !daemon.log().contains("unhealthy"),
        "no transition at all:\n{}",
        daemon.log()
    );
    let ends: Vec<&str> = held
        .iter()
        .map(|line| line["end"].as_str().unwrap_or("?"))
        .collect();
    assert!(
        ends.iter().all(|end| *end == "open"),
        "no held connection was closed: {ends:?}"
    );
    socklb_tests::record_figures(
        "passive: a hostile uid 65534 made 24 connects closed in SYN_SENT and 6 held past the RTO: 0 backends out, 0 of 30 held connections closed",
    );
}

/// Probes of `addr` in the metrics: (failed, passed).
fn probes_of(metrics: SocketAddr, addr: SocketAddr) -> (f64, f64) {
    let samples = socklb_tests::scrape_metrics(metrics);
    let count = |result: &str| {
        samples
            .get(&format!(
                "socklb_probe_duration_seconds_count{{service=\"default\",backend=\"{addr}\",result=\"{result}\"}}"
            ))
            .copied()
            .unwrap_or(0.0)
    };
    (count("failed"), count("ok"))
}

/// Waits until a probe of `addr` passed after the moment of the call
/// (polling the metrics, within 10 s).
fn next_passed_probe(daemon: &Daemon, metrics: SocketAddr, addr: SocketAddr) {
    let (_, passed) = probes_of(metrics, addr);
    let deadline = Instant::now() + Duration::from_secs(10);
    while probes_of(metrics, addr).1 <= passed {
        assert!(
            Instant::now() < deadline,
            "no probe of {addr} passed:\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A quarter second after a probe passed, the server stops answering for
/// 1.5 s (SIGSTOP, then SIGCONT: the kernel still accepts its
/// connections). The checker's next probe comes 0.8 to 1.2 s after the
/// last and is answered at the end of the hiccup, within its 1 s timeout;
/// a probe hurried into the hiccup's first half second times out. Returns
/// the probes that failed, once one passed after the hiccup.
fn hiccup(daemon: &Daemon, cluster: &Cluster, metrics: SocketAddr) -> f64 {
    let server = &cluster.servers[0];
    next_passed_probe(daemon, metrics, server.addr);
    let (failed_before, _) = probes_of(metrics, server.addr);
    // The offset and length of the hiccup are the scenario itself, not
    // waits for a fact.
    std::thread::sleep(Duration::from_millis(250));
    server.pause();
    std::thread::sleep(Duration::from_millis(1500));
    server.resume();
    next_passed_probe(daemon, metrics, server.addr);
    probes_of(metrics, server.addr).0 - failed_before
}

/// Issue 17, hole 2: an unprivileged process turns one slow probe into an
/// outage. Its SYNs, sent with IP TTL 1, die on the way (the servers drop
/// them, as a distant network would), so the kernel reports unanswered
/// SYNs and socklb hurries probes. Before, a hurried (confirming) probe
/// that timed out in a 1.5 s hiccup of a server took the backend out at
/// once, and close-on-failure aborted 20 of 20 connections. Now a hurried
/// probe only comes sooner: the backend stays unless `fall` probes in a
/// row fail at the checker's own pace, with or without the attacker.
#[test]
fn a_local_user_cannot_turn_a_hiccup_into_an_outage() {
    require_root!();
    const TTL: u8 = 1;
    let mut cluster = Cluster::new(2);
    for server in &mut cluster.servers {
        server.drop_syns_with_ttl(TTL);
    }
    let cgroup = Cgroup::new("hiccup");
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let metrics_flag = metrics.to_string();
    let addrs = cluster.addrs();
    // socklb's defaults (interval 1 s, timeout 1 s, fall 3; the tests'
    // helper sets faster ones otherwise), probing the apiserver's /readyz.
    let mut flags = socklb_tests::DEFAULT_APISERVER_HEALTH.to_vec();
    flags.extend(["--metrics-addr", &metrics_flag]);
    let mut daemon = Daemon::start(
        "hiccup",
        &service_args(&cgroup.path, &[vip], &addrs, &flags),
    );
    daemon.wait_health(&addrs, true, Duration::from_secs(20));
    // 20 long-lived agents: one keep-alive TLS connection each, a request
    // every second with a 2 s timeout.
    let watchers = socklb_tests::herd::Agents::spawn(vip, &cgroup.path, 20, &[]);
    daemon.wait_for("20 live connections", Duration::from_secs(10), |status| {
        addrs
            .iter()
            .filter_map(|addr| backend_field(status, &addr.to_string(), "live"))
            .filter_map(|value| value.as_i64())
            .sum::<i64>()
            == 20
    });
    let quiet = hiccup(&daemon, &cluster, metrics);

    // Eight hostile processes, each one connect at a time held past the
    // SYN's RTO, started 140 ms apart: a report every 140 ms or so, a
    // hurried probe every 500 ms.
    let attackers: Vec<std::thread::JoinHandle<serde_json::Value>> = (0..8u64)
        .map(|index| {
            let cgroup = cgroup.path.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(140 * index));
                ConnClient::abort(vip, &cgroup, 24, TTL, Duration::from_millis(1100))
            })
        })
        .collect();
    assert!(
        daemon.log_shows("a probe passed after", Duration::from_secs(5)),
        "the attacker hurries probes:\n{}",
        daemon.log()
    );
    // A hurried probe fails only if it starts in the first 500 ms of the
    // hiccup; the attack must be seen to have made one fail (which, before,
    // took the backend out), so the hiccup comes again until one did, at
    // most three times while the attackers (about 26 s) go on.
    let mut attacked = 0.0;
    let mut hiccups = 0;
    while attacked < 1.0 && hiccups < 3 {
        attacked += hiccup(&daemon, &cluster, metrics);
        hiccups += 1;
    }
    for attacker in attackers {
        let summary = attacker.join().expect("attacker");
        assert_eq!(
            summary["uid"], 65534,
            "the hostile process has no privilege"
        );
    }
    let summary = watchers.summary();
    socklb_tests::record_figures(&format!(
        "hole 2: a 1.5 s hiccup of a server (probes every 1 s, timeout 1 s, fall 3): {quiet} probe(s) failed without the attacker, {attacked} in {hiccups} hiccup(s) with uid 65534 hurrying probes by unanswered TTL-1 SYNs; the backend stayed; of 20 watchers {} reconnected, {} requests failed ({} made)",
        summary["reconnects"], summary["failed"], summary["requests"]
    ));
    assert!(
        attacked >= 1.0,
        "a hurried probe failed in the hiccup (the attack took effect): {attacked} in {hiccups}"
    );
    assert!(
        !daemon.log().contains("unhealthy"),
        "no backend left:\n{}",
        daemon.log()
    );
    assert_eq!(summary["connects"], 20, "no connection closed: {summary}");
    assert_eq!(summary["reconnects"], 0, "no connection closed: {summary}");
    assert_eq!(summary["failed"], 0, "every request served: {summary}");
}
