//! Live connection counts stay exact: past the 65,536 entries the first
//! layout's LRU could hold (socket storage has no limit and no eviction),
//! and across a restart with a reordered configuration (backend ids are
//! kept by address).

use std::{net::SocketAddr, time::Duration};

use socklb_tests::{
    Cgroup, ConnClient, Daemon, HoldServer, backend_field, free_port, record_figures, require_root,
    service_args,
};

fn live(status: &serde_json::Value, addr: &SocketAddr) -> i64 {
    backend_field(status, &addr.to_string(), "live")
        .and_then(|value| value.as_i64())
        .unwrap_or(-1)
}

fn total_live(daemon: &Daemon, addrs: &[SocketAddr]) -> i64 {
    let status = daemon.status().expect("status");
    addrs.iter().map(|addr| live(&status, addr)).sum()
}

#[test]
fn seventy_thousand_connections_all_count_and_all_uncount() {
    require_root!();
    const CLIENTS: u32 = 5;
    const PER_CLIENT: u32 = 14_000;
    let total = i64::from(CLIENTS * PER_CLIENT);
    let cgroup = Cgroup::new("70k");
    // Five backends, so that none holds more than the open-files limit of
    // one process (about 14,000 each).
    let servers: Vec<HoldServer> = [
        "127.0.0.2",
        "127.0.0.3",
        "127.0.0.4",
        "127.0.0.5",
        "127.0.0.6",
    ]
    .iter()
    .map(|ip| HoldServer::start(ip))
    .collect();
    let addrs: Vec<SocketAddr> = servers.iter().map(|server| server.addr).collect();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    // A socket table that holds them all (the default holds 65,536): every
    // connection is tracked, so every count is exact.
    let mut daemon = Daemon::start(
        "70k",
        &service_args(
            &cgroup.path,
            &[vip],
            &addrs,
            &["--policy", "least-conn", "--socket-table-size", "131072"],
        ),
    );
    daemon.wait_health(&addrs, true, Duration::from_secs(10));

    let started = std::time::Instant::now();
    let mut clients: Vec<ConnClient> = (0..CLIENTS)
        .map(|_| {
            ConnClient::hold_until_released(vip, &cgroup.path, PER_CLIENT, Duration::from_secs(300))
        })
        .collect();
    daemon.wait_for(
        &format!("{total} live connections"),
        Duration::from_secs(180),
        |status| addrs.iter().map(|addr| live(status, addr)).sum::<i64>() == total,
    );
    let opened = started.elapsed();
    let status = daemon.status().expect("status");
    let per_backend: Vec<i64> = addrs.iter().map(|addr| live(&status, addr)).collect();
    for client in &mut clients {
        client.release();
    }
    let held: Vec<serde_json::Value> = clients.into_iter().flat_map(ConnClient::finish).collect();
    assert_eq!(held.len() as i64, total);
    assert!(
        held.iter().all(|line| line["end"] == "open"),
        "every connection opened and stayed open"
    );
    // The servers close their ends too, so that no client socket waits out
    // FIN_WAIT2 (the count falls when a socket is gone, not when its
    // process closed it).
    drop(servers);
    let closed = daemon.wait_for(
        "every count back to 0",
        Duration::from_secs(120),
        |status| addrs.iter().all(|addr| live(status, addr) == 0),
    );
    // Settled: nothing drifts after the last close (two more loop turns).
    daemon.wait_beats(2, Duration::from_secs(10));
    assert_eq!(total_live(&daemon, &addrs), 0, "still exactly 0");
    record_figures(&format!(
        "counts: {total} concurrent connections through the VIP, all counted after {} ms (live per backend {per_backend:?}); all closed, every live count back to exactly 0 after {} ms",
        opened.as_millis(),
        closed.as_millis()
    ));
    // least-conn keeps every backend within 1% of its share (in practice
    // within a connection or two), so none nears its server's open-files
    // limit.
    let share = total / addrs.len() as i64;
    assert!(
        per_backend
            .iter()
            .all(|live| live.abs_diff(share) <= share as u64 / 100),
        "least-conn spreads the connections evenly: {per_backend:?}"
    );
}

#[test]
fn a_reordered_config_keeps_every_count_exact() {
    require_root!();
    let cgroup = Cgroup::new("reorder");
    let servers: Vec<HoldServer> = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        .iter()
        .map(|ip| HoldServer::start(ip))
        .collect();
    let addrs: Vec<SocketAddr> = servers.iter().map(|server| server.addr).collect();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut daemon = Daemon::start("reorder", &service_args(&cgroup.path, &[vip], &addrs, &[]));
    daemon.wait_health(&addrs, true, Duration::from_secs(10));

    let mut client =
        ConnClient::hold_until_released(vip, &cgroup.path, 3000, Duration::from_secs(120));
    daemon.wait_for("3000 live connections", Duration::from_secs(60), |status| {
        addrs.iter().map(|addr| live(status, addr)).sum::<i64>() == 3000
    });
    let status = daemon.status().expect("status");
    let before: Vec<i64> = addrs.iter().map(|addr| live(&status, addr)).collect();

    // The same backends in another order, and a fourth one first: in the
    // first layout every id would move and the counts would be reset.
    let extra = HoldServer::start("127.0.0.5");
    let mut reordered = vec![extra.addr, addrs[2], addrs[0], addrs[1]];
    let args = service_args(&cgroup.path, &[vip], &reordered, &[]);
    daemon.restart_with(&args);
    reordered.sort();
    daemon.wait_health(&reordered, true, Duration::from_secs(10));
    let status = daemon.status().expect("status");
    let after: Vec<i64> = addrs.iter().map(|addr| live(&status, addr)).collect();
    assert_eq!(
        after, before,
        "each backend keeps its count across the reorder"
    );
    assert_eq!(live(&status, &extra.addr), 0, "the new backend starts at 0");

    client.release();
    let held = client.finish();
    assert!(held.iter().all(|line| line["end"] == "open"));
    drop(servers);
    drop(extra);
    daemon.wait_for("every count back to 0", Duration::from_secs(60), |status| {
        reordered.iter().all(|addr| live(status, addr) == 0)
    });
    record_figures(&format!(
        "counts: a reorder (and a new first backend) with 3000 connections open kept live {before:?} per backend; all back to 0 after closing"
    ));
}
