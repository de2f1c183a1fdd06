//! Discovery from the Kubernetes API: socklb follows the EndpointSlices of
//! `default/kubernetes` served by the test apiserver (`kubeapi`, over TLS
//! with a client certificate, as a kubelet's kubeconfig gives), through
//! additions, removals, a relist after 410 Gone, an API that goes away, a
//! restart while it is away, slices with no ready endpoint, and an
//! apiserver that is reachable only through socklb's own VIP.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use socklb_tests::{
    Backend, Cgroup, ConnClient, Daemon, backend_field, following, free_port,
    kube::{KubeApi, KubeApiOptions, SliceSpec, kubernetes_slice, ready_slice},
    listed, record_figures, require_root, scrape_metrics, served, until_served_by,
};

/// How long the daemon may take to notice anything in these tests; the
/// figures record how long it actually took.
const LIMIT: Duration = Duration::from_secs(20);

fn vip() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

fn ready(port: u16, backends: &[&Backend]) -> SliceSpec {
    let ips: Vec<IpAddr> = backends.iter().map(|backend| backend.addr.ip()).collect();
    ready_slice(port, &ips)
}

/// Three backends on one port (an EndpointSlice has one port for all its
/// endpoints), at 127.0.0.{base+0..2}.
fn backends_on_one_port(base: u8, holding: bool) -> (u16, Vec<Backend>) {
    let port = free_port();
    let backends = (0..3u8)
        .map(|index| {
            let addr = SocketAddr::from(([127, 0, 0, base + index], port));
            let name = format!("b{index}");
            if holding {
                Backend::start_holding_at(&name, addr)
            } else {
                Backend::start_at(&name, addr)
            }
        })
        .collect();
    (port, backends)
}

#[test]
fn a_server_added_through_the_api_serves_within_1s_and_a_relist_after_410_follows() {
    require_root!();
    let cgroup = Cgroup::new("disc-add");
    let (port, backends) = backends_on_one_port(41, false);
    let [b0, b1, b2] = [&backends[0], &backends[1], &backends[2]];
    let api = KubeApi::start_on(141);
    api.put_slice("default", "kubernetes", &ready(port, &[b0, b1]));
    let vip = vip();
    let mut daemon = Daemon::start("disc-add", &api.follow_args(&cgroup.path, vip, &[]));
    daemon.wait_health(&[b0.addr, b1.addr], true, LIMIT);
    assert_eq!(following(&daemon.status().unwrap()), "endpointslices");

    // A server added through the API serves within 1 s.
    let put = Instant::now();
    api.put_slice("default", "kubernetes", &ready(port, &[b0, b1, b2]));
    until_served_by(vip, &cgroup.path, "b2", LIMIT);
    let added = put.elapsed();
    assert!(added <= Duration::from_secs(1), "b2 served after {added:?}");
    assert!(daemon.log_shows(
        &format!("discovery: default: +{} (endpointslices)", b2.addr),
        LIMIT
    ));

    // A watch that resumes from a version the server no longer keeps gets
    // 410 Gone, and the daemon lists again. While the daemon is stopped,
    // its watch is closed, b0 leaves, and the history is compacted: its
    // next watch starts from before the compaction.
    let before = api.stats();
    daemon.pause();
    api.close_watches();
    api.put_slice("default", "kubernetes", &ready(port, &[b1, b2]));
    api.compact();
    let resumed = Instant::now();
    daemon.resume();
    daemon.wait_for("b0 gone after the relist", LIMIT, |status| {
        !listed(status, b0.addr) && listed(status, b1.addr) && listed(status, b2.addr)
    });
    let relisted = resumed.elapsed();
    let after = api.stats();
    assert_eq!(after.gone_sent, before.gone_sent + 1, "one 410: {after:?}");
    assert!(
        after.lists > before.lists,
        "a new list after the 410: {after:?}"
    );
    let spread = served(vip, &cgroup.path, 40);
    assert!(!spread.contains_key("b0"), "{spread:?}");
    record_figures(&format!(
        "discovery: server added through the API served after {} ms; relist after 410 Gone applied {} ms after the daemon resumed",
        added.as_millis(),
        relisted.as_millis()
    ));
}

#[test]
fn a_server_removed_through_the_api_is_drained() {
    require_root!();
    let cgroup = Cgroup::new("disc-drain");
    let (port, backends) = backends_on_one_port(44, true);
    let [b0, b1] = [&backends[0], &backends[1]];
    let api = KubeApi::start_on(144);
    api.put_slice("default", "kubernetes", &ready(port, &[b0, b1]));
    let vip = vip();
    let mut daemon = Daemon::start(
        "disc-drain",
        &api.follow_args(&cgroup.path, vip, &["--close-on-failure", "true"]),
    );
    daemon.wait_health(&[b0.addr, b1.addr], true, LIMIT);

    let mut held = ConnClient::hold_until_released(vip, &cgroup.path, 20, Duration::from_secs(60));
    let live = |status: &serde_json::Value, addr: SocketAddr| {
        backend_field(status, &addr.to_string(), "live")
            .and_then(|value| value.as_i64())
            .unwrap_or(0)
    };
    daemon.wait_for("20 held connections counted", LIMIT, |status| {
        live(status, b0.addr) + live(status, b1.addr) == 20
    });
    let status = daemon.status().unwrap();
    let on_b0 = live(&status, b0.addr);
    let on_b1 = live(&status, b1.addr);
    assert!(on_b0 > 0 && on_b1 > 0, "both serve: {on_b0} and {on_b1}");

    let removed = Instant::now();
    api.put_slice("default", "kubernetes", &ready(port, &[b1]));
    daemon.wait_for("b0 gone", LIMIT, |status| !listed(status, b0.addr));
    let gone = removed.elapsed();
    assert!(daemon.log_shows(&format!("discovery: default: -{}", b0.addr), LIMIT));
    // New connects go to b1 only.
    let spread = served(vip, &cgroup.path, 20);
    assert_eq!(spread.get("b1"), Some(&20), "{spread:?}");
    // The daemon closes the removed server's connections off its loop, and
    // says so when it is done; release the clients only after that.
    let closed = format!(
        "{}: closed {on_b0} of {on_b0} connections socklb had sent to it",
        b0.addr
    );
    assert!(daemon.log_shows(&closed, LIMIT), "{}", daemon.log());

    held.release();
    let ends = held.finish();
    let aborted = socklb_tests::aborted(&ends);
    assert_eq!(
        aborted as i64, on_b0,
        "exactly the connections to the removed server were closed: {ends:?}"
    );
    record_figures(&format!(
        "discovery: server removed through the API left the table after {} ms; {aborted} of {on_b0} connections to it closed, {on_b1} to the other kept",
        gone.as_millis()
    ));
}

#[test]
fn the_api_unreachable_keeps_the_last_known_set() {
    require_root!();
    let cgroup = Cgroup::new("disc-down");
    let (port, backends) = backends_on_one_port(47, false);
    let [b0, b1, b2] = [&backends[0], &backends[1], &backends[2]];
    let mut api = KubeApi::start_on(147);
    api.put_slice("default", "kubernetes", &ready(port, &[b0, b1]));
    let vip = vip();
    let mut daemon = Daemon::start("disc-down", &api.follow_args(&cgroup.path, vip, &[]));
    daemon.wait_health(&[b0.addr, b1.addr], true, LIMIT);

    // The API goes away: the watch fails, and keeps failing on every retry.
    api.stop();
    let warning = "discovery: default: endpointslices failed";
    assert!(daemon.log_shows(warning, LIMIT), "a warning");
    // Several retries later (kube-runtime's backoff starts at 0.8 s)...
    let retries = Instant::now();
    while retries.elapsed() < Duration::from_secs(3) {
        let spread = served(vip, &cgroup.path, 20);
        assert!(
            spread.keys().all(|name| name == "b0" || name == "b1"),
            "{spread:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // ...the set is the last known one, and the warning was said once.
    let status = daemon.status().unwrap();
    assert!(
        listed(&status, b0.addr) && listed(&status, b1.addr),
        "{status}"
    );
    assert_eq!(following(&status), "endpointslices", "{status}");
    assert_eq!(daemon.log_count(warning), 1, "{}", daemon.log());

    // The API comes back with a change: followed, and the recovery said.
    api.resume();
    api.put_slice("default", "kubernetes", &ready(port, &[b1, b2]));
    let back = Instant::now();
    daemon.wait_for(
        "the changed set after the API returned",
        Duration::from_secs(60),
        |status| !listed(status, b0.addr) && listed(status, b2.addr),
    );
    assert!(daemon.log_shows("endpointslices lists 2 backends again", LIMIT));
    record_figures(&format!(
        "discovery: API unreachable for 3 s: the last known set served every connect, 1 warning; change after the API returned applied after {} ms (watch backoff)",
        back.elapsed().as_millis()
    ));
}

#[test]
fn a_restart_while_the_api_is_down_uses_the_persisted_set() {
    require_root!();
    let cgroup = Cgroup::new("disc-restart");
    let (port, backends) = backends_on_one_port(50, false);
    let [b0, b1, b2] = [&backends[0], &backends[1], &backends[2]];
    let mut api = KubeApi::start_on(150);
    api.put_slice("default", "kubernetes", &ready(port, &[b0, b1]));
    let vip = vip();
    // A static backend seeds the service; the API overrides it.
    let mut args = api.follow_args(&cgroup.path, vip, &[]);
    args.extend(["--backend".to_string(), b2.addr.to_string()]);
    let mut daemon = Daemon::start("disc-restart", &args);
    daemon.wait_for("the API's set", LIMIT, |status| {
        following(status) == "endpointslices" && !listed(status, b2.addr)
    });
    daemon.wait_health(&[b0.addr, b1.addr], true, LIMIT);

    api.stop();
    daemon.restart();
    assert!(daemon.log_shows("using the last known set", LIMIT));
    daemon.wait_health(&[b0.addr, b1.addr], true, LIMIT);
    // The heartbeat comes before the control socket that status asks for
    // the sources: wait for the new daemon's answer.
    daemon.wait_for(
        "the new daemon to follow the persisted set",
        LIMIT,
        |status| following(status) == "persisted",
    );
    let status = daemon.status().unwrap();
    assert!(!listed(&status, b2.addr), "not the static seed: {status}");
    let spread = served(vip, &cgroup.path, 40);
    assert!(!spread.contains_key("b2"), "{spread:?}");

    // The API returns: it is the authority again.
    api.resume();
    api.put_slice("default", "kubernetes", &ready(port, &[b2]));
    daemon.wait_for("the API's set again", Duration::from_secs(60), |status| {
        following(status) == "endpointslices" && listed(status, b2.addr) && !listed(status, b0.addr)
    });
    daemon.wait_health(&[b2.addr], true, LIMIT);
}

#[test]
fn a_slice_with_no_ready_endpoint_keeps_the_last_known_set_and_warns() {
    require_root!();
    let cgroup = Cgroup::new("disc-unready");
    let (port, backends) = backends_on_one_port(53, false);
    let [b0, b1] = [&backends[0], &backends[1]];
    let api = KubeApi::start_on(153);
    api.put_slice("default", "kubernetes", &ready(port, &[b0, b1]));
    let vip = vip();
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let metrics_flag = metrics.to_string();
    let mut daemon = Daemon::start(
        "disc-unready",
        &api.follow_args(&cgroup.path, vip, &["--metrics-addr", &metrics_flag]),
    );
    daemon.wait_health(&[b0.addr, b1.addr], true, LIMIT);
    let problems = r#"socklb_discovery_problems_total{service="default",source="endpointslices",reason="empty"}"#;

    // Every endpoint not ready (all apiservers restarting at once), then
    // the slice deleted: neither empties the table.
    let unready = kubernetes_slice(port, &[(b0.addr.ip(), false), (b1.addr.ip(), false)]);
    api.put_slice("default", "kubernetes", &unready);
    assert!(daemon.log_shows("endpointslices lists no backend", LIMIT));
    api.delete_slice("default", "kubernetes");
    // The warning is said once, and counted once.
    let deadline = Instant::now() + LIMIT;
    while scrape_metrics(metrics).get(problems).copied() != Some(1.0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        scrape_metrics(metrics).get(problems).copied(),
        Some(1.0),
        "counted once"
    );
    let spread = served(vip, &cgroup.path, 40);
    assert_eq!(
        spread.values().sum::<usize>(),
        40,
        "the last known set serves: {spread:?}"
    );
    let status = daemon.status().unwrap();
    assert!(
        listed(&status, b0.addr) && listed(&status, b1.addr),
        "{status}"
    );
    assert_eq!(daemon.log_count("endpointslices lists no backend"), 1);

    // Ready again: followed, with the recovery said.
    api.put_slice("default", "kubernetes", &ready(port, &[b1]));
    daemon.wait_for("b1 alone", LIMIT, |status| {
        !listed(status, b0.addr) && listed(status, b1.addr)
    });
    assert!(daemon.log_shows("endpointslices lists 1 backends again", LIMIT));
}

#[test]
fn the_apiserver_is_reachable_only_through_socklbs_own_vip() {
    require_root!();
    let cgroup = Cgroup::new("disc-vip");
    let vip = vip();
    // The apiserver listens on 127.0.0.56; its kubeconfig names the VIP,
    // where nothing listens. Only socklb's own redirect reaches it.
    let api = KubeApi::start_with(&KubeApiOptions {
        ip: Some(IpAddr::from([127, 0, 0, 56])),
        kubeconfig_server: Some(format!("https://{vip}")),
        ..KubeApiOptions::default()
    });
    let other = Backend::start_at(
        "other",
        SocketAddr::new([127, 0, 0, 57].into(), api.addr.port()),
    );
    api.put_slice(
        "default",
        "kubernetes",
        &kubernetes_slice(api.addr.port(), &[(api.addr.ip(), true)]),
    );
    // The static backend seeds the table; the daemon runs in the cgroup,
    // so its own connects to the VIP are redirected by its own hook.
    let mut args = api.follow_args(&cgroup.path, vip, &[]);
    args.extend(["--backend".to_string(), api.addr.to_string()]);
    let mut daemon = Daemon::start_inside("disc-vip", &args, &cgroup.path);
    daemon.wait_for("the list through the VIP", LIMIT, |status| {
        following(status) == "endpointslices"
    });
    let status = daemon.status().unwrap();
    assert!(listed(&status, api.addr), "{status}");
    // (The daemon's TCP probes of the apiserver close without a TLS
    // handshake, so the server's handshake failures are not a signal.)
    api.wait_stats("a watch through the VIP", LIMIT, |stats| {
        stats.watches_open == 1
    });

    // The watch ends; the daemon watches again, through the VIP, from its
    // table, and follows the next change.
    api.close_watches();
    api.wait_stats("a second watch", LIMIT, |stats| {
        stats.watches >= 2 && stats.watches_open == 1
    });
    api.put_slice(
        "default",
        "kubernetes",
        &kubernetes_slice(
            api.addr.port(),
            &[(api.addr.ip(), true), (other.addr.ip(), true)],
        ),
    );
    daemon.wait_for("the change seen through the VIP", LIMIT, |status| {
        listed(status, other.addr)
    });
}
