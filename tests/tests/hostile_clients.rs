//! What a local user cannot do to the daemon's own endpoints (issue 17,
//! hole 6; issue 20's accept loops): blind Prometheus with idle or slow
//! connections to the metrics port, delay the heartbeat, or make an accept
//! loop spin a core when the daemon runs out of descriptors.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    os::unix::net::UnixStream,
    time::{Duration, Instant},
};

use socklb::dataplane::{MapStore, PinPaths, install, lock::RunPaths};
use socklb_tests::{
    Backend, Cgroup, ConnClient, Daemon, free_port, record_figures, require_root, service_args,
};

const LIMIT: Duration = Duration::from_secs(20);
/// The daemon's heartbeat period (daemon::TICK).
const TICK: Duration = Duration::from_millis(500);

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Connections of uid 65534 to `port` on loopback that are established
/// now (their client side, from /proc/net/tcp).
fn nobody_connections_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // remote address, state (01 = ESTABLISHED), uid
            fields.len() > 7
                && fields[2].ends_with(&format!(":{port:04X}"))
                && fields[3] == "01"
                && fields[7] == "65534"
        })
        .count()
}

/// One scrape with a deadline of `limit`: its status line and how long it
/// took, or why it failed.
fn timed_scrape(addr: SocketAddr, limit: Duration) -> Result<Duration, String> {
    let start = Instant::now();
    let mut stream = TcpStream::connect_timeout(&addr, limit).map_err(|error| error.to_string())?;
    stream
        .set_read_timeout(Some(limit))
        .map_err(|error| error.to_string())?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|error| error.to_string())?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|error| format!("after {:?}: {error}", start.elapsed()))?;
    if !response.starts_with("HTTP/1.1 200") || !response.contains("socklb_build_info") {
        return Err(format!("not a scrape: {response:.200}"));
    }
    Ok(start.elapsed())
}

fn heartbeat_age(daemon: &Daemon) -> Duration {
    let status = daemon.status().expect("status");
    assert_eq!(status["daemon"]["running"], true, "{status}");
    Duration::from_millis(status["daemon"]["heartbeat_age_ms"].as_u64().expect("age"))
}

#[test]
fn idle_and_slow_local_clients_delay_neither_a_scrape_nor_the_heartbeat() {
    require_root!();
    let cgroup = Cgroup::new("hostile-metrics");
    let backend = Backend::start("b0", "127.0.0.121");
    let vip = local(free_port());
    let metrics = local(free_port());
    let metrics_flag = metrics.to_string();
    let mut daemon = Daemon::start(
        "hostile-metrics",
        &service_args(
            &cgroup.path,
            &[vip],
            &[backend.addr],
            &["--metrics-addr", &metrics_flag],
        ),
    );
    daemon.wait_health(&[backend.addr], true, LIMIT);
    timed_scrape(metrics, LIMIT).expect("a scrape before the attack");

    // 64 connections that never send a byte and 16 that start a request
    // and never finish it, all from uid 65534, each opened again as soon
    // as the daemon closes it.
    let limit = Duration::from_secs(120);
    let mut idle = ConnClient::hold_as_nobody(metrics, 64, None, limit);
    let mut slow = ConnClient::hold_as_nobody(
        metrics,
        16,
        Some("GET /metrics HTTP/1.1\r\nHost: x\r\n"),
        limit,
    );
    let start = Instant::now();
    while nobody_connections_to(metrics.port()) < 64 {
        assert!(start.elapsed() < LIMIT, "the attackers connect");
        std::thread::sleep(Duration::from_millis(20));
    }

    let mut took = Vec::new();
    let mut max_age = Duration::ZERO;
    for _ in 0..20 {
        let scrape = timed_scrape(metrics, Duration::from_secs(10));
        let scrape = scrape.unwrap_or_else(|error| panic!("a scrape under attack: {error}"));
        took.push(scrape);
        max_age = max_age.max(heartbeat_age(&daemon));
    }
    let attackers = nobody_connections_to(metrics.port());
    idle.release();
    slow.release();
    let idle_ends = idle.finish();
    let reconnects: u32 = idle_ends
        .iter()
        .filter_map(|end| end["reconnects"].as_u64())
        .map(|count| count as u32)
        .sum();
    let slowest = took.iter().max().copied().unwrap_or_default();
    assert!(
        slowest <= Duration::from_secs(1),
        "each scrape within 1 s: {took:?}"
    );
    assert!(
        max_age <= 4 * TICK,
        "the heartbeat beats on (oldest seen {max_age:?})"
    );
    drop(slow.finish());
    record_figures(&format!(
        "hostile clients: 80 idle or slow connections of uid 65534 to the metrics port ({attackers} open at the end, {reconnects} reopened): 20 of 20 scrapes served, the slowest in {} ms (5 of 5 timed out before); oldest heartbeat seen {} ms",
        slowest.as_millis(),
        max_age.as_millis()
    ));
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // The fields after the command (which may hold spaces), from state on.
    let rest = stat.rsplit_once(')').expect("stat fields").1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

/// The lowest descriptor number a process does not use: with its soft
/// limit there, the next descriptor it opens fails with EMFILE.
fn lowest_free_fd(pid: u32) -> u64 {
    let used: std::collections::BTreeSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd directory")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    (0..)
        .find(|fd| !used.contains(fd))
        .expect("a free descriptor")
}

/// Sets the soft limit of open files of `pid`; returns the old limits.
fn set_soft_nofile(pid: u32, soft: u64) -> libc::rlimit {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit reads `None` and writes `old`, both owned here.
    let read =
        unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(read, 0, "prlimit: {}", std::io::Error::last_os_error());
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max,
    };
    // SAFETY: as above; the new limit is a plain struct.
    let set = unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
    assert_eq!(set, 0, "prlimit: {}", std::io::Error::last_os_error());
    old
}

#[test]
fn accept_loops_pause_on_emfile_instead_of_spinning() {
    require_root!();
    let cgroup = Cgroup::new("hostile-emfile");
    let backend = Backend::start("b0", "127.0.0.122");
    let vip = local(free_port());
    let metrics = local(free_port());
    let metrics_flag = metrics.to_string();
    // Slow probes: each opens a socket, which fails while out of descriptors.
    let mut daemon = Daemon::start(
        "hostile-emfile",
        &service_args(
            &cgroup.path,
            &[vip],
            &[backend.addr],
            &["--metrics-addr", &metrics_flag, "--health-interval", "10s"],
        ),
    );
    daemon.wait_health(&[backend.addr], true, LIMIT);
    let control = RunPaths::of(&PinPaths::new(&daemon.pin_path)).control;
    let pid = daemon.pid();

    // Out of descriptors: the connections wait in the backlogs, and every
    // accept() fails with EMFILE.
    let old = set_soft_nofile(pid, lowest_free_fd(pid));
    let waiting: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(metrics).expect("connect to the backlog"))
        .collect();
    let control_waiting = UnixStream::connect(&control).expect("connect to the control socket");
    let said = "accept failed: Too many open files";
    assert!(
        daemon.log_shows(&format!("metrics: {said}"), LIMIT),
        "{}",
        daemon.log()
    );
    assert!(daemon.log_shows(&format!("control socket: {said}"), LIMIT));
    // The window: six heartbeats, read from the pinned map (`socklb
    // status` would ask the control socket, which accepts nothing now).
    let ticks_before = cpu_ticks(pid);
    let start = Instant::now();
    let pins = PinPaths::new(&daemon.pin_path);
    let mut beats = std::collections::BTreeSet::new();
    while beats.len() < 7 {
        assert!(start.elapsed() < LIMIT, "heartbeats: {beats:?}");
        let maps = install::open_pinned(&pins).expect("the pinned maps");
        beats.insert(maps.daemon().expect("the daemon record").heartbeat_ns);
        std::thread::sleep(Duration::from_millis(20));
    }
    let window = start.elapsed();
    // SAFETY: sysconf has no preconditions.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu = (cpu_ticks(pid) - ticks_before) as f64 / ticks_per_second / window.as_secs_f64();
    assert!(
        cpu < 0.25,
        "the accept loops wait instead of spinning: {:.0} % of a core over {window:?}",
        cpu * 100.0
    );

    // The verification pass of each heartbeat could not open the pins: it
    // says so once and leaves them, rather than taking them for removed
    // and pinning over them (which left readers a moment with no pin).
    assert!(
        daemon.log_shows("could not check socklb's pins", LIMIT),
        "{}",
        daemon.log()
    );
    assert_eq!(daemon.log_count("could not check socklb's pins"), 1);
    for false_repair in ["was removed or replaced", "link was removed"] {
        assert_eq!(daemon.log_count(false_repair), 0, "{}", daemon.log());
    }

    // Descriptors again: the waiting connections are served.
    set_soft_nofile(pid, old.rlim_cur);
    assert!(daemon.log_shows("metrics: accepting connections again", LIMIT));
    assert!(daemon.log_shows("socklb's pins can be checked again", LIMIT));
    let scrape = timed_scrape(metrics, LIMIT);
    assert!(scrape.is_ok(), "{scrape:?}");
    assert_eq!(
        daemon.log_count(&format!("metrics: {said}")),
        1,
        "said once"
    );
    assert_eq!(daemon.log_count(&format!("control socket: {said}")), 1);
    drop(waiting);
    drop(control_waiting);
    record_figures(&format!(
        "hostile clients: out of descriptors with connections waiting on both accept loops: {:.1} % of a core over {} ms (a spinning loop takes a whole core); each said once, served again once descriptors freed",
        cpu * 100.0,
        window.as_millis()
    ));
}
