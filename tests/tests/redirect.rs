//! What the kernel programs redirect, and what they leave alone. Each test
//! makes its own child cgroup, backends on loopback and a socklb daemon with
//! its own pin directory, and runs its clients (lbclient) in the cgroup.

use std::{
    net::{SocketAddr, TcpListener},
    time::{Duration, Instant},
};

use socklb_tests::{
    Backend, Cgroup, ClientRun, Daemon, backend_field, free_port, live_connections, pace_bound,
    require_root, service_args, spread, time_until,
};

const ECONNREFUSED: i32 = 111;

/// A running service: cgroup, backends named b0, b1, … and its daemon.
/// Fields drop in order: the daemon first, then the backends, then the
/// cgroup.
struct Setup {
    daemon: Daemon,
    backends: Vec<Backend>,
    cgroup: Cgroup,
    vip: SocketAddr,
}

impl Setup {
    fn new(label: &str, ips: &[&str], extra: &[&str]) -> Self {
        require_root();
        let cgroup = Cgroup::new(label);
        let backends: Vec<Backend> = ips
            .iter()
            .enumerate()
            .map(|(i, ip)| Backend::start(&format!("b{i}"), ip))
            .collect();
        let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let daemon = Daemon::start(
            label,
            &service_args(&cgroup.path, &[vip], &addrs(&backends), extra),
        );
        let mut setup = Self {
            cgroup,
            backends,
            daemon,
            vip,
        };
        let all = addrs(&setup.backends);
        setup
            .daemon
            .wait_health(&all, true, Duration::from_secs(10));
        setup
    }

    fn connect(&self, count: u32) -> Vec<socklb_tests::Attempt> {
        ClientRun::new(self.vip, Some(&self.cgroup.path), count).run()
    }
}

fn addrs(backends: &[Backend]) -> Vec<SocketAddr> {
    backends.iter().map(|backend| backend.addr).collect()
}

/// A listener that answers with `name`, to show where unredirected
/// connects go.
fn named_listener(name: &str, addr: SocketAddr) -> Backend {
    Backend::start_at(name, addr)
}

#[test]
fn redirect_happens_and_getpeername_shows_the_vip() {
    require_root!();
    let setup = Setup::new("redirect", &["127.0.0.2"], &[]);
    let attempts = setup.connect(5);
    for attempt in &attempts {
        assert!(attempt.ok, "{attempt:?}");
        assert_eq!(attempt.served_by.as_deref(), Some("b0"));
        assert_eq!(
            attempt.peer.as_deref(),
            Some(setup.vip.to_string().as_str()),
            "getpeername shows the VIP"
        );
    }
    let status = setup.daemon.status().expect("status");
    let redirects = backend_field(&status, &setup.backends[0].addr.to_string(), "redirects");
    assert_eq!(
        redirects,
        Some(serde_json::json!(5)),
        "per-backend redirect counter"
    );
}

#[test]
fn three_hundred_connects_spread_over_three_backends() {
    require_root!();
    let setup = Setup::new("spread", &["127.0.0.2", "127.0.0.3", "127.0.0.4"], &[]);
    let attempts = setup.connect(300);
    let counts = spread(&attempts);
    // Uniform choice: mean 100, standard deviation ~8.2; 60..=140 is ±4.9σ.
    for name in ["b0", "b1", "b2"] {
        let count = counts.get(name).copied().unwrap_or(0);
        assert!(
            (60..=140).contains(&count),
            "{name} served {count}: {counts:?}"
        );
    }
    assert_eq!(counts.get("error"), None, "{counts:?}");
    let status = setup.daemon.status().expect("status");
    for (name, backend) in ["b0", "b1", "b2"].iter().zip(&setup.backends) {
        let redirects = backend_field(&status, &backend.addr.to_string(), "redirects");
        assert_eq!(
            redirects,
            Some(serde_json::json!(counts[*name])),
            "{name}'s counter matches"
        );
    }
}

#[test]
fn a_process_outside_the_cgroup_is_not_redirected() {
    require_root!();
    let setup = Setup::new("outside", &["127.0.0.2"], &[]);
    let _vip_listener = named_listener("vip-listener", setup.vip);
    let outside = ClientRun::new(setup.vip, None, 3).run();
    assert!(
        outside
            .iter()
            .all(|a| a.served_by.as_deref() == Some("vip-listener")),
        "{outside:?}"
    );
    let inside = setup.connect(3);
    assert!(
        inside.iter().all(|a| a.served_by.as_deref() == Some("b0")),
        "{inside:?}"
    );
}

#[test]
fn other_addresses_and_ports_inside_the_cgroup_are_untouched() {
    require_root!();
    let setup = Setup::new("nonvip", &["127.0.0.2"], &[]);
    let other_port = named_listener(
        "other-port",
        SocketAddr::from(([127, 0, 0, 1], free_port())),
    );
    let other_addr = named_listener(
        "other-addr",
        SocketAddr::from(([127, 0, 0, 5], setup.vip.port())),
    );
    for (listener, want) in [(&other_port, "other-port"), (&other_addr, "other-addr")] {
        let attempts = ClientRun::new(listener.addr, Some(&setup.cgroup.path), 3).run();
        assert!(
            attempts
                .iter()
                .all(|a| a.served_by.as_deref() == Some(want)),
            "{want}: {attempts:?}"
        );
        assert!(
            attempts
                .iter()
                .all(|a| a.peer == Some(listener.addr.to_string()))
        );
    }
}

#[test]
fn a_nested_child_cgroup_is_redirected() {
    require_root!();
    let setup = Setup::new("nested", &["127.0.0.2"], &[]);
    let child = setup.cgroup.child("inner");
    let attempts = ClientRun::new(setup.vip, Some(&child.path), 3).run();
    assert!(
        attempts
            .iter()
            .all(|a| a.served_by.as_deref() == Some("b0")),
        "{attempts:?}"
    );
    drop(child);
}

#[test]
fn ipv6_vip_and_ipv4_vip_from_a_mapped_socket() {
    require_root!();
    let cgroup = Cgroup::new("ipv6");
    let v4_backend = Backend::start("v4-backend", "127.0.0.2");
    let v6_backend = Backend::start("v6-backend", "::1");
    let port = free_port();
    let vip4 = SocketAddr::from(([127, 0, 0, 1], port));
    let vip6: SocketAddr = format!("[::1]:{port}").parse().expect("literal");
    let mut daemon = Daemon::start(
        "ipv6",
        &service_args(
            &cgroup.path,
            &[vip4, vip6],
            &[v4_backend.addr, v6_backend.addr],
            &[],
        ),
    );
    daemon.wait_health(
        &[v4_backend.addr, v6_backend.addr],
        true,
        Duration::from_secs(10),
    );

    let native = ClientRun::new(vip6, Some(&cgroup.path), 5).run();
    for attempt in &native {
        assert_eq!(
            attempt.served_by.as_deref(),
            Some("v6-backend"),
            "{attempt:?}"
        );
        assert_eq!(attempt.peer.as_deref(), Some(vip6.to_string().as_str()));
    }
    let mapped: SocketAddr = format!("[::ffff:127.0.0.1]:{port}")
        .parse()
        .expect("literal");
    let from_v6_socket = ClientRun::new(mapped, Some(&cgroup.path), 5).run();
    for attempt in &from_v6_socket {
        assert_eq!(
            attempt.served_by.as_deref(),
            Some("v4-backend"),
            "{attempt:?}"
        );
        assert_eq!(
            attempt.peer.as_deref(),
            Some(mapped.to_string().as_str()),
            "getpeername6 shows the mapped VIP"
        );
    }
}

#[test]
fn a_process_in_another_netns_is_left_alone_unless_allowed() {
    require_root!();
    let setup = Setup::new("netns", &["127.0.0.2"], &[]);
    let mut run = ClientRun::new(setup.vip, Some(&setup.cgroup.path), 3);
    run.new_netns = true;
    let attempts = run.run();
    assert!(
        attempts
            .iter()
            .all(|a| a.served_by.as_deref() == Some("own-netns")),
        "{attempts:?}"
    );

    // With --all-netns the same client is redirected (to 127.0.0.2 of its
    // own namespace, where nothing listens).
    let open = Setup::new("allnetns", &["127.0.0.2"], &["--all-netns"]);
    let mut run = ClientRun::new(open.vip, Some(&open.cgroup.path), 3);
    run.new_netns = true;
    let attempts = run.run();
    assert!(
        attempts
            .iter()
            .all(|a| !a.ok && a.errno == Some(ECONNREFUSED)),
        "{attempts:?}"
    );
}

#[test]
fn a_stopped_backend_leaves_the_table_in_time_and_gets_no_new_connects() {
    require_root!();
    let (interval_ms, timeout_ms, fall) = (300u64, 300u64, 3u64);
    let interval = format!("{interval_ms}ms");
    let timeout = format!("{timeout_ms}ms");
    let mut setup = Setup::new(
        "stopped",
        &["127.0.0.2", "127.0.0.3", "127.0.0.4"],
        &[
            "--health-interval",
            &interval,
            "--health-timeout",
            &timeout,
            "--fall",
            "3",
        ],
    );
    let stopped_addr = setup.backends[1].addr;
    setup.backends[1].stop();
    let stopped_at = Instant::now();
    setup
        .daemon
        .wait_health(&[stopped_addr], false, Duration::from_secs(10));
    let took = stopped_at.elapsed();
    let bound = Duration::from_millis(interval_ms * fall + timeout_ms);
    eprintln!("stopped backend left the table after {took:?} (bound {bound:?})");
    // Status is polled every 20 ms by a separate process: allow 250 ms for
    // observing the change, not for making it.
    assert!(
        took <= bound + Duration::from_millis(250),
        "took {took:?} to leave the table; bound interval × fall + timeout = {bound:?}"
    );
    let attempts = setup.connect(100);
    let counts = spread(&attempts);
    assert_eq!(counts.get("b1"), None, "{counts:?}");
    assert_eq!(counts.get("error"), None, "{counts:?}");
    assert_eq!(counts.values().sum::<usize>(), 100);
    assert!(
        setup.daemon.log_shows(
            &format!("{stopped_addr} unhealthy: connect refused (3/3)"),
            Duration::from_secs(3)
        ),
        "{}",
        setup.daemon.log()
    );
}

/// Both backends go down; b0 comes back but is not yet healthy again (rise
/// 10 at 500 ms). Connects made now show the policy.
fn all_down_then_b0_listens(policy: &str) -> (Setup, Vec<socklb_tests::Attempt>) {
    let mut setup = Setup::new(
        &format!("alldown-{policy}"),
        &["127.0.0.2", "127.0.0.3"],
        &[
            "--when-none-healthy",
            policy,
            "--health-interval",
            "500ms",
            "--rise",
            "10",
            "--fall",
            "2",
        ],
    );
    for backend in &mut setup.backends {
        backend.stop();
    }
    let all = addrs(&setup.backends);
    setup
        .daemon
        .wait_health(&all, false, Duration::from_secs(10));
    setup.backends[0].resume();
    let attempts = setup.connect(40);
    let status = setup.daemon.status().expect("status");
    assert_eq!(
        backend_field(&status, &all[0].to_string(), "healthy"),
        Some(serde_json::json!(false)),
        "b0 must still count as unhealthy while the connects ran"
    );
    (setup, attempts)
}

#[test]
fn all_backends_down_fail_open_uses_every_backend() {
    require_root!();
    let (setup, attempts) = all_down_then_b0_listens("fail-open");
    let counts = spread(&attempts);
    assert!(
        counts.get("b0").copied().unwrap_or(0) >= 5,
        "fail-open reached the listening backend: {counts:?}"
    );
    for attempt in attempts.iter().filter(|a| !a.ok) {
        assert_eq!(
            attempt.errno,
            Some(ECONNREFUSED),
            "the down backend refuses: {attempt:?}"
        );
    }
    let status = setup.daemon.status().expect("status");
    assert_eq!(status["services"][0]["none_healthy"], serde_json::json!(40));
    assert_eq!(status["services"][0]["rejected"], serde_json::json!(0));
}

#[test]
fn all_backends_down_reject_refuses_with_econnrefused() {
    require_root!();
    let (setup, attempts) = all_down_then_b0_listens("reject");
    for attempt in &attempts {
        assert!(
            !attempt.ok,
            "reject must refuse even though b0 listens: {attempt:?}"
        );
        assert_eq!(attempt.errno, Some(ECONNREFUSED), "{attempt:?}");
    }
    let status = setup.daemon.status().expect("status");
    assert_eq!(status["services"][0]["rejected"], serde_json::json!(40));
    assert_eq!(
        backend_field(&status, &setup.backends[0].addr.to_string(), "redirects"),
        Some(serde_json::json!(0))
    );
}

#[test]
fn a_vip_port_without_a_service_listener_elsewhere_stays_refused() {
    require_root!();
    // Guard against a program that redirects every port of the VIP address.
    let setup = Setup::new("vipport", &["127.0.0.2"], &[]);
    let unused = SocketAddr::from(([127, 0, 0, 1], free_port()));
    assert!(TcpListener::bind(unused).is_ok(), "port is free");
    let attempts = ClientRun::new(unused, Some(&setup.cgroup.path), 2).run();
    assert!(
        attempts.iter().all(|a| a.errno == Some(ECONNREFUSED)),
        "{attempts:?}"
    );
}

#[test]
fn a_standby_backend_serves_only_while_no_other_is_healthy() {
    require_root!();
    let cgroup = Cgroup::new("standby");
    let mut primary = Backend::start("primary", "127.0.0.2");
    let standby = Backend::start("standby", "127.0.0.3");
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut args = service_args(&cgroup.path, &[vip], &[primary.addr], &[]);
    args.extend(["--backend".to_string(), format!("{},standby", standby.addr)]);
    let mut daemon = Daemon::start("standby", &args);
    daemon.wait_health(&[primary.addr, standby.addr], true, Duration::from_secs(10));

    let attempts = ClientRun::new(vip, Some(&cgroup.path), 50).run();
    assert_eq!(
        spread(&attempts).get("primary"),
        Some(&50),
        "the standby waits while the primary is healthy"
    );

    primary.stop();
    daemon.wait_health(&[primary.addr], false, Duration::from_secs(10));
    let attempts = ClientRun::new(vip, Some(&cgroup.path), 50).run();
    assert_eq!(
        spread(&attempts).get("standby"),
        Some(&50),
        "the standby takes over"
    );
    let status = daemon.status().expect("status");
    assert_eq!(
        backend_field(&status, &standby.addr.to_string(), "role"),
        Some(serde_json::json!("standby"))
    );
}

const ECONNABORTED: i32 = 103;

/// Clients hold connections through the VIP to `primary`; its listener dies
/// (the connections stay up, as when a server hangs or is removed) and
/// `standby` takes over. Returns how the held connections ended, and the
/// daemon.
fn held_connections_when_the_backend_fails(
    close_on_failure: &str,
) -> (Vec<socklb_tests::Attempt>, Daemon, bool) {
    require_root();
    let cgroup = Cgroup::new(&format!("close-{close_on_failure}"));
    let mut primary = Backend::start_holding("primary", "127.0.0.2");
    let standby = Backend::start_holding("standby", "127.0.0.3");
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut args = service_args(
        &cgroup.path,
        &[vip],
        &[primary.addr],
        &["--close-on-failure", close_on_failure],
    );
    args.extend(["--backend".to_string(), format!("{},standby", standby.addr)]);
    let mut daemon = Daemon::start(&format!("close-{close_on_failure}"), &args);
    daemon.wait_health(&[primary.addr, standby.addr], true, Duration::from_secs(10));

    let clients: Vec<_> = (0..4)
        .map(|_| {
            let mut run = ClientRun::new(vip, Some(&cgroup.path), 1);
            run.hold_ms = Some(4000);
            run.spawn()
        })
        .collect();
    // A process outside the cgroup that dialled the backend directly.
    let mut direct = std::net::TcpStream::connect(primary.addr).expect("direct connect");
    // Every client holds its connection (counted live by the kernel) and
    // the primary has accepted all five.
    daemon.wait_for(
        "the 4 held connections live on the primary",
        pace_bound(4, Duration::ZERO),
        |status| live_connections(status, primary.addr) == 4,
    );
    time_until(
        "the primary accepted the held and the direct connections",
        pace_bound(5, Duration::ZERO),
        || primary.accepted() >= 5,
    );
    primary.stop();
    daemon.wait_health(&[primary.addr], false, Duration::from_secs(10));
    let attempts: Vec<_> = clients
        .into_iter()
        .flat_map(|client| client.finish())
        .collect();

    direct.set_nonblocking(true).expect("nonblocking");
    let mut buffer = [0u8; 64];
    let direct_alive = match std::io::Read::read(&mut direct, &mut buffer) {
        Ok(0) => false,
        Ok(_) => std::io::Read::read(&mut direct, &mut buffer)
            .is_err_and(|error| error.kind() == std::io::ErrorKind::WouldBlock),
        Err(error) => error.kind() == std::io::ErrorKind::WouldBlock,
    };
    (attempts, daemon, direct_alive)
}

#[test]
fn connections_to_a_failed_backend_are_closed_and_others_are_not() {
    require_root!();
    let (attempts, daemon, direct_alive) = held_connections_when_the_backend_fails("true");
    assert_eq!(attempts.len(), 4);
    for attempt in &attempts {
        assert_eq!(attempt.served_by.as_deref(), Some("primary"), "{attempt:?}");
        assert_eq!(
            attempt.hold_end.as_deref(),
            Some("error"),
            "closed by socklb: {attempt:?}"
        );
        assert_eq!(attempt.errno, Some(ECONNABORTED), "{attempt:?}");
        assert!(
            attempt.held_ms.is_some_and(|held| held < 3500),
            "closed before the hold ran out: {attempt:?}"
        );
    }
    assert!(
        daemon.log_shows("closed 4 of 4 connections", Duration::from_secs(3)),
        "{}",
        daemon.log()
    );
    assert!(
        direct_alive,
        "a connection socklb did not redirect stays open"
    );
}

#[test]
fn close_on_failure_false_leaves_connections_alone() {
    require_root!();
    let (attempts, _daemon, _) = held_connections_when_the_backend_fails("false");
    for attempt in &attempts {
        assert_eq!(attempt.hold_end.as_deref(), Some("timeout"), "{attempt:?}");
    }
}

#[test]
fn drain_stops_new_connections_and_keeps_existing_ones() {
    require_root!();
    let cgroup = Cgroup::new("drain");
    let drained = Backend::start_holding("drained", "127.0.0.2");
    let other = Backend::start_holding("other", "127.0.0.3");
    let config_drained = Backend::start("config-drained", "127.0.0.4");
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut args = service_args(&cgroup.path, &[vip], &[drained.addr, other.addr], &[]);
    args.extend([
        "--backend".to_string(),
        format!("{},drain", config_drained.addr),
    ]);
    let mut daemon = Daemon::start("drain", &args);
    daemon.wait_health(
        &[drained.addr, other.addr, config_drained.addr],
        true,
        Duration::from_secs(10),
    );
    let pin = daemon.pin_path.display().to_string();

    let before = spread(&ClientRun::new(vip, Some(&cgroup.path), 60).run());
    assert_eq!(
        before.get("config-drained"),
        None,
        "drain in the config: {before:?}"
    );
    assert!(
        before.get("drained").is_some_and(|count| *count > 5),
        "{before:?}"
    );

    // A connection that is open when the drain starts stays open.
    let mut run = ClientRun::new(vip, Some(&cgroup.path), 1);
    run.hold_ms = Some(2500);
    let held: Vec<_> = (0..12).map(|_| run.spawn()).collect();
    daemon.wait_for(
        "the 12 held connections live",
        pace_bound(12, Duration::ZERO),
        |status| {
            live_connections(status, drained.addr) + live_connections(status, other.addr) == 12
        },
    );
    let output = socklb_tests::socklb(&["drain", &drained.addr.to_string(), "--pin-path", &pin]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    daemon.wait_for("draining in status", Duration::from_secs(3), |status| {
        backend_field(status, &drained.addr.to_string(), "draining")
            == Some(serde_json::json!(true))
    });
    let during = spread(&ClientRun::new(vip, Some(&cgroup.path), 60).run());
    assert_eq!(
        during.get("drained"),
        None,
        "no new connection while draining: {during:?}"
    );
    let held: Vec<_> = held
        .into_iter()
        .flat_map(|client| client.finish())
        .collect();
    assert!(
        held.iter()
            .any(|attempt| attempt.served_by.as_deref() == Some("drained")),
        "some held connection is on the drained backend: {held:?}"
    );
    for attempt in held {
        assert_eq!(
            attempt.hold_end.as_deref(),
            Some("timeout"),
            "existing connection left alone: {attempt:?}"
        );
    }

    let output = socklb_tests::socklb(&[
        "drain",
        "--undo",
        &drained.addr.to_string(),
        "--pin-path",
        &pin,
    ]);
    assert!(output.status.success());
    daemon.wait_for("drain undone", Duration::from_secs(3), |status| {
        backend_field(status, &drained.addr.to_string(), "draining")
            == Some(serde_json::json!(false))
    });
    let after = spread(&ClientRun::new(vip, Some(&cgroup.path), 60).run());
    assert!(
        after.get("drained").is_some_and(|count| *count > 5),
        "{after:?}"
    );

    let unknown = socklb_tests::socklb(&["drain", "127.0.0.9:1", "--pin-path", &pin]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("not a backend of any service"));
}
