//! What the sock_ops program sees: live connections per backend (which
//! least-conn balances in the kernel) and failed connects (which take a
//! backend out before the next probe).

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use socklb_tests::{
    Backend, Cgroup, ClientRun, Daemon, backend_field, free_port, require_root, service_args,
    spread,
};

fn live(status: &serde_json::Value, backend: &Backend) -> i64 {
    backend_field(status, &backend.addr.to_string(), "live")
        .and_then(|value| value.as_i64())
        .unwrap_or(-1)
}

#[test]
fn least_conn_balances_live_connections_and_status_counts_them() {
    require_root();
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

    daemon.wait_for("live back to 0", Duration::from_secs(5), |status| {
        live(status, &backends[0]) == 0 && live(status, &backends[1]) == 0
    });
}

#[test]
fn failed_connects_take_a_backend_out_before_the_next_probe() {
    require_root();
    let cgroup = Cgroup::new("passive");
    let mut failing = Backend::start("failing", "127.0.0.2");
    let steady = Backend::start("steady", "127.0.0.3");
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    // Probes every 5 s: far too slow to explain a reaction within the test.
    let extra = [
        "--health-interval",
        "5s",
        "--health-down-interval",
        "200ms",
        "--rise",
        "2",
        "--connect-failures",
        "2",
    ];
    let mut daemon = Daemon::start(
        "passive",
        &service_args(&cgroup.path, &[vip], &[failing.addr, steady.addr], &extra),
    );
    daemon.wait_health(&[failing.addr, steady.addr], true, Duration::from_secs(10));

    failing.stop();
    let stopped = Instant::now();
    let mut run = ClientRun::new(vip, Some(&cgroup.path), 60);
    run.interval_ms = 5;
    let attempts = run.run();
    daemon.wait_health(&[failing.addr], false, Duration::from_secs(1));
    let errors = attempts.iter().filter(|attempt| !attempt.ok).count();
    eprintln!(
        "passive: {errors} of 60 connects (5 ms apart) failed before the backend left the table"
    );
    assert!(
        (2..=8).contains(&errors),
        "{errors} connects failed: {:?}",
        spread(&attempts)
    );
    assert!(
        attempts[30..]
            .iter()
            .all(|attempt| attempt.served_by.as_deref() == Some("steady")),
        "after the failures every connect goes to the healthy backend: {:?}",
        spread(&attempts[30..])
    );
    assert!(
        stopped.elapsed() < Duration::from_secs(3),
        "well before the next probe"
    );
    assert!(daemon.log_shows(
        &format!(
            "{} unhealthy: 2 failed connects in a row (2/2)",
            failing.addr
        ),
        Duration::from_secs(2)
    ));
    let status = daemon.status().expect("status");
    let failed = backend_field(&status, &failing.addr.to_string(), "failed_connects");
    assert!(
        failed
            .and_then(|value| value.as_u64())
            .is_some_and(|count| count >= 2)
    );

    // It returns only once the probe has passed `rise` times.
    failing.resume();
    daemon.wait_health(&[failing.addr], true, Duration::from_secs(5));
    assert!(daemon.log_shows(
        &format!("{} healthy: connect ok (2/2)", failing.addr),
        Duration::from_secs(2)
    ));
}
