//! A real peer: a 3-member etcd cluster (Debian's etcd-server), one member
//! per server namespace, behind socklb's VIP, with Debian's etcdctl as the
//! client in the agent cgroup.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use socklb_tests::{
    Cgroup, Daemon, cluster::Cluster, free_port, record_figures, require_root, service_args,
    unique_name,
};

const CLIENT_PORT: u16 = 2379;
const PEER_PORT: u16 = 2380;

fn start_member(cluster: &mut Cluster, index: usize, initial: &str, data: &Path) {
    let server = &mut cluster.servers[index];
    let ip = server.ip();
    let name = format!("m{index}");
    let args: Vec<String> = [
        "--name",
        &name,
        "--data-dir",
        &data.join(&name).display().to_string(),
        "--listen-client-urls",
        &format!("http://{ip}:{CLIENT_PORT}"),
        "--advertise-client-urls",
        &format!("http://{ip}:{CLIENT_PORT}"),
        "--listen-peer-urls",
        &format!("http://{ip}:{PEER_PORT}"),
        "--initial-advertise-peer-urls",
        &format!("http://{ip}:{PEER_PORT}"),
        "--initial-cluster",
        initial,
        "--initial-cluster-state",
        "new",
        "--initial-cluster-token",
        &format!("socklb-{}", std::process::id()),
        "--heartbeat-interval",
        "100",
        "--election-timeout",
        "1000",
        "--log-level",
        "warn",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    server.spawn_program("etcd", &args, &data.join(format!("{name}.log")));
}

/// etcdctl with bounded timeouts, run inside `cgroup` when given.
fn etcdctl(endpoints: &str, cgroup: Option<&Path>, args: &[&str]) -> Output {
    let mut command = Command::new("sh");
    let script = match cgroup {
        Some(_) => r#"echo $$ > "$1/cgroup.procs" && shift && exec "$@""#,
        None => r#"shift && exec "$@""#,
    };
    command
        .args(["-c", script, "sh"])
        .arg(cgroup.map_or_else(PathBuf::new, Path::to_path_buf))
        .args([
            "etcdctl",
            "--endpoints",
            endpoints,
            "--dial-timeout",
            "2s",
            "--command-timeout",
            "6s",
        ])
        .args(args)
        .env("ETCDCTL_API", "3")
        .stdin(Stdio::null());
    command
        .output()
        .unwrap_or_else(|error| panic!("running etcdctl (Debian etcd-client): {error}"))
}

/// Index of the current leader, asked of the members directly.
fn leader(cluster: &Cluster) -> Option<usize> {
    let endpoints: Vec<String> = cluster
        .servers
        .iter()
        .map(|server| format!("http://{}:{CLIENT_PORT}", server.ip()))
        .collect();
    let output = etcdctl(
        &endpoints.join(","),
        None,
        &["endpoint", "status", "-w", "json"],
    );
    let statuses: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
    statuses.as_array()?.iter().find_map(|status| {
        let member = status["Status"]["header"]["member_id"].as_u64()?;
        let leader = status["Status"]["leader"].as_u64()?;
        let endpoint = status["Endpoint"].as_str()?;
        (member == leader).then(|| endpoints.iter().position(|candidate| candidate == endpoint))?
    })
}

/// Tries a command up to `tries` times; returns the attempts it took and
/// the last output.
fn attempts(tries: u32, mut command: impl FnMut() -> Output) -> (u32, Output) {
    let mut last = command();
    let mut count = 1;
    while !last.status.success() && count < tries {
        last = command();
        count += 1;
    }
    (count, last)
}

#[test]
fn etcd_behind_the_vip_keeps_serving_when_the_leader_dies() {
    require_root!();
    // Declared first, so it is removed last, after the members are killed.
    let data_dir = DataDir(std::env::temp_dir().join(unique_name("etcd")));
    std::fs::create_dir_all(&data_dir.0).expect("data dir");
    let data = &data_dir.0;
    let mut cluster = Cluster::without_servers();
    for _ in 0..3 {
        cluster.add_namespace();
    }
    let initial: Vec<String> = cluster
        .servers
        .iter()
        .enumerate()
        .map(|(index, server)| format!("m{index}=http://{}:{PEER_PORT}", server.ip()))
        .collect();
    let initial = initial.join(",");
    for index in 0..3 {
        start_member(&mut cluster, index, &initial, data);
    }
    let members: Vec<SocketAddr> = cluster
        .servers
        .iter()
        .map(|server| SocketAddr::new(server.ip(), CLIENT_PORT))
        .collect();

    let cgroup = Cgroup::new("etcd");
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let args = service_args(
        &cgroup.path,
        &[vip],
        &members,
        // The default timing (every 1 s, timeout 1 s, fall 3): etcd's
        // /health stalls for the second or so an election takes, and the
        // survivors must not be taken out (and their connections closed) for
        // that. The dead member goes at once: its connects are refused.
        &[
            "--health",
            "http:/health",
            "--health-interval",
            "1s",
            "--health-timeout",
            "1s",
            "--fall",
            "3",
            "--rise",
            "2",
        ],
    );
    let mut daemon = Daemon::start("etcd", &args);
    daemon.wait_health(&members, true, Duration::from_secs(30));
    let endpoint = format!("http://{vip}");
    let put = |key: &str, value: &str| etcdctl(&endpoint, Some(&cgroup.path), &["put", key, value]);
    let get = |key: &str| {
        etcdctl(
            &endpoint,
            Some(&cgroup.path),
            &["get", key, "--print-value-only"],
        )
    };
    let text = |output: &Output| String::from_utf8_lossy(&output.stdout).trim().to_string();

    let first = put("before", "1");
    assert!(
        first.status.success(),
        "put through the VIP: {}",
        String::from_utf8_lossy(&first.stderr)
    );

    let leader = leader(&cluster).expect("a leader");
    cluster.servers[leader].kill();
    let killed = Instant::now();
    let (put_tries, put_output) = attempts(2, || put("after", "2"));
    let put_took = killed.elapsed();
    assert!(
        put_output.status.success(),
        "put after the leader died, in at most two attempts: {}",
        String::from_utf8_lossy(&put_output.stderr)
    );
    let (get_tries, get_output) = attempts(2, || get("after"));
    assert_eq!(text(&get_output), "2", "get after the leader died");
    let out = daemon.wait_health(&[members[leader]], false, Duration::from_secs(10));
    record_figures(&format!(
        "etcd: leader m{leader} killed; put ok after {put_tries} attempt(s), {} ms; get ok after {get_tries} attempt(s); socklb showed it out {} ms after the put",
        put_took.as_millis(),
        out.as_millis()
    ));

    start_member(&mut cluster, leader, &initial, data);
    daemon.wait_health(&members, true, Duration::from_secs(30));
    assert_eq!(text(&get("before")), "1", "the restarted member rejoined");

    // Two members down: no quorum. Record what happens; nothing can succeed
    // for writes, and the test only checks that it ends in bounded time.
    let survivor = (leader + 1) % 3;
    let killed: Vec<SocketAddr> = (0..3)
        .filter(|index| *index != survivor)
        .map(|index| members[index])
        .collect();
    for index in (0..3).filter(|index| *index != survivor) {
        cluster.servers[index].kill();
    }
    let started = Instant::now();
    let (tries, lost) = attempts(2, || put("quorum", "lost"));
    let write_took = started.elapsed();
    // socklb has seen both members go (their connects are refused).
    let fall_bound = daemon.fall_bound();
    daemon.wait_health(&killed, false, fall_bound);
    let status = daemon.status().expect("status");
    let healthy = status["services"][0]["backends"]
        .as_array()
        .map(|backends| {
            backends
                .iter()
                .filter(|backend| backend["healthy"] == true)
                .count()
        })
        .unwrap_or(0);
    let serializable = etcdctl(
        &endpoint,
        Some(&cgroup.path),
        &["get", "before", "--print-value-only", "--consistency=s"],
    );
    record_figures(&format!(
        "etcd: two members killed (m{survivor} left); put {} after {tries} attempt(s) in {} ms ({}); socklb then saw {healthy} healthy backend(s) and failed open; a serializable get through the VIP {}",
        if lost.status.success() {
            "succeeded"
        } else {
            "failed"
        },
        write_took.as_millis(),
        String::from_utf8_lossy(&lost.stderr)
            .lines()
            .last()
            .unwrap_or("")
            .trim(),
        if serializable.status.success() {
            format!("returned {:?}", text(&serializable))
        } else {
            "failed".to_string()
        },
    ));
    assert!(
        !lost.status.success(),
        "a write without quorum cannot succeed"
    );
    assert!(
        write_took < Duration::from_secs(20),
        "bounded by etcdctl's timeouts"
    );
}

/// The members' data, removed at the end even when the test fails.
struct DataDir(PathBuf);

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
