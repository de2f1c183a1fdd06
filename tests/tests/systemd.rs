//! The systemd unit run for real: a Debian root booted with systemd as
//! PID 1 under systemd-nspawn (socklb_tests::nspawn), socklb installed in
//! it with the README's own commands, deploy/systemd/socklb.service used
//! as it is, and an agent on the host dialing the VIP.
//!
//! The unit gets no drop-in: socklb inside attaches, by default, to the
//! root of the cgroup v2 hierarchy it sees, and the container's cgroup
//! namespace makes that `<child>/payload`, under a child cgroup the test
//! created, never the machine's root. The test checks this before the
//! first start: the cgroup root inside is that very cgroup.
//!
//! Needs `cargo xtask test-deploy` (the release binary, the systemd root,
//! systemd-container).

use std::{
    net::SocketAddr,
    os::unix::fs::MetadataExt,
    path::PathBuf,
    time::{Duration, Instant},
};

use socklb_tests::{
    BpffsStart, Cgroup, MountNamespace,
    cluster::{AgentRun, finish_all, served},
    free_port,
    manifest::repo,
    node::{DialingAgent, LoopbackApiserver, failures},
    nspawn::BootedRoot,
    record_figures, require_root, time_until,
};

/// The README's install steps ("On a host"), run inside the container from
/// the repository (bound read-only at /src), in this order. The one the
/// test does its own way: it writes /etc/socklb/socklb.toml in place of
/// `$EDITOR`.
const INSTALL_STEPS: [&str; 4] = [
    "install -m 0755 target/release/socklb /usr/local/bin/socklb",
    "install -m 0644 deploy/systemd/socklb.service /etc/systemd/system/",
    "install -d /etc/socklb",
    "systemctl daemon-reload && systemctl enable --now socklb",
];

/// The Debian root with systemd that `cargo xtask test-deploy` built.
fn systemd_root() -> PathBuf {
    let path = PathBuf::from(std::env::var_os("SOCKLB_SYSTEMD_ROOT").unwrap_or_else(|| {
        panic!("SOCKLB_SYSTEMD_ROOT is not set: run `cargo xtask test-deploy` (it builds the root)")
    }));
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// socklb.toml for the host: one VIP, the given apiservers.
fn config(vip: SocketAddr, servers: &[&LoopbackApiserver]) -> String {
    let backends: Vec<String> = servers
        .iter()
        .map(|server| format!("\"{}\"", server.addr))
        .collect();
    format!(
        r#"[[service]]
name = "apiserver"
vips = ["{vip}"]
backends = [{}]

[service.health]
kind = "apiserver"
interval = "500ms"
timeout = "1s"
rise = 2
fall = 3
"#,
        backends.join(", ")
    )
}

/// A unit property (`systemctl show -P`).
fn property(machine: &BootedRoot, name: &str) -> String {
    machine
        .checked(&format!("systemctl show -P {name} socklb.service"))
        .trim()
        .to_string()
}

/// `socklb status --json` inside the container.
fn status(machine: &BootedRoot) -> serde_json::Value {
    let output = machine.exec("socklb status --json");
    serde_json::from_slice(&output.stdout).unwrap_or(serde_json::Value::Null)
}

/// `count` requests through the VIP from the clients' cgroup.
fn requests(
    vip: SocketAddr,
    clients: &Cgroup,
    count: u32,
) -> std::collections::BTreeMap<String, usize> {
    let run = AgentRun {
        vip,
        cgroup: clients.path.clone(),
        path: "/readyz",
        requests: count,
        interval_ms: 0,
        timeout_ms: 2000,
        retries: 0,
    };
    served(&finish_all(run.spawn(1)))
}

fn assert_redirected(
    vip: SocketAddr,
    clients: &Cgroup,
    servers: &[&LoopbackApiserver],
    what: &str,
) {
    let served = requests(vip, clients, 10);
    let by_servers: usize = servers
        .iter()
        .map(|server| served.get(&server.name).copied().unwrap_or(0))
        .sum();
    assert_eq!(by_servers, 10, "{what}: {served:?}");
}

/// Runs `action` while an agent dials the VIP every 5 ms; every request
/// must succeed. Returns (requests, seconds dialed).
fn under_dialing(vip: SocketAddr, clients: &Cgroup, action: impl FnOnce()) -> (usize, f64) {
    let agent = DialingAgent::start(vip, &clients.path, Duration::from_millis(5));
    agent.wait_for_more(20, Duration::from_secs(20));
    action();
    agent.wait_for_more(20, Duration::from_secs(20));
    let (requests, dialed) = agent.stop();
    assert!(failures(&requests).is_empty(), "{:?}", failures(&requests));
    (requests.len(), dialed.as_secs_f64())
}

#[test]
fn the_readme_names_the_install_steps_the_test_runs() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    for step in INSTALL_STEPS {
        assert!(readme.contains(step), "README.md says `{step}`");
    }
}

#[test]
fn the_unit_runs_under_systemd_installs_reloads_restarts_and_stops() {
    require_root!();
    let started = Instant::now();
    let release = std::env::var_os("SOCKLB_RELEASE_BIN").map(PathBuf::from);
    assert!(
        release
            .as_ref()
            .is_some_and(|path| path == &repo().join("target/release/socklb") && path.exists()),
        "target/release/socklb: run `cargo xtask test-deploy` (the README's step builds it)"
    );
    let namespace = MountNamespace::new(BpffsStart::Mounted0700);
    let cgroup = Cgroup::new("nspawn");
    let repo_path = repo();
    let machine = BootedRoot::boot(
        &systemd_root(),
        &namespace,
        &cgroup,
        &[(&repo_path, "/src", true)],
    );
    let booted_in = started.elapsed();

    // Safety first: the root of the cgroup v2 hierarchy inside is the
    // payload cgroup under the test's child, not the machine's root.
    let inside: u64 = machine
        .checked("stat -f -c %T /sys/fs/cgroup && stat -c %i /sys/fs/cgroup")
        .lines()
        .collect::<Vec<_>>()
        .as_slice()
        .split_first()
        .map(|(kind, inode)| {
            assert_eq!(*kind, "cgroup2fs", "a pure cgroup v2 tree inside");
            inode[0].parse().expect("an inode")
        })
        .unwrap();
    let payload = std::fs::metadata(&machine.payload_cgroup).expect("the payload cgroup");
    assert_eq!(
        inside,
        payload.ino(),
        "the container's cgroup root is the test's child"
    );
    let clients_path = machine.payload_cgroup.join("socklb-clients");
    std::fs::create_dir(&clients_path).unwrap();
    let clients = Cgroup { path: clients_path };

    let servers = [
        LoopbackApiserver::start("server-0", "127.0.0.2"),
        LoopbackApiserver::start("server-1", "127.0.0.3"),
        LoopbackApiserver::start("server-2", "127.0.0.4"),
    ];
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));

    // Installed as the README says, then enabled and started: `systemctl`
    // returns once socklb said READY=1, and by then it redirects.
    let mut start_took = Duration::ZERO;
    for step in INSTALL_STEPS {
        if step.contains("enable --now") {
            std::fs::write(
                machine.path("/etc/socklb/socklb.toml"),
                config(vip, &[&servers[0], &servers[1]]),
            )
            .unwrap();
            let before = Instant::now();
            machine.checked(step);
            start_took = before.elapsed();
        } else {
            machine.checked(&format!("cd /src && {step}"));
        }
    }
    // systemd took the unit as started only after socklb's install: the
    // journal, read from the host, has them in that order.
    let journal = machine.journal("socklb.service");
    let installed = journal.find("installed the data plane");
    let started_line = journal.find("Started socklb.service");
    assert!(
        installed.is_some() && started_line.is_some() && installed < started_line,
        "installed, then started: {journal}"
    );
    assert_redirected(
        vip,
        &clients,
        &[&servers[0], &servers[1]],
        "right after `systemctl enable --now`",
    );
    assert_eq!(property(&machine, "Type"), "notify");
    assert_eq!(property(&machine, "ActiveState"), "active");

    // An edited file, applied by `systemctl reload` in place.
    std::fs::write(
        machine.path("/etc/socklb/socklb.toml"),
        config(vip, &[&servers[0], &servers[1], &servers[2]]),
    )
    .unwrap();
    machine.checked("systemctl reload socklb");
    let reloaded_in = time_until(
        "generation 2 with server-2 healthy",
        Duration::from_secs(30),
        || {
            let status = status(&machine);
            status["daemon_info"]["config_generation"] == 2
                && socklb_tests::backend_field(&status, &servers[2].addr.to_string(), "healthy")
                    == Some(serde_json::Value::Bool(true))
        },
    );
    time_until(
        "a request served by server-2",
        Duration::from_secs(20),
        || requests(vip, &clients, 10).contains_key("server-2"),
    );
    assert!(
        machine
            .journal("socklb.service")
            .contains("applied (generation 2)"),
        "the journal, read from the host, says the reload was applied"
    );

    let restart = under_dialing(vip, &clients, || {
        machine.checked("systemctl restart socklb");
    });
    let killed = under_dialing(vip, &clients, || sigkill_and_wait_for_restart(&machine));

    // Stopped: the data plane redirects from its last table.
    machine.checked("systemctl stop socklb");
    assert_eq!(property(&machine, "ActiveState"), "inactive");
    assert_redirected(
        vip,
        &clients,
        &servers.iter().collect::<Vec<_>>(),
        "after `systemctl stop`",
    );
    let stopped = status(&machine);
    assert_eq!(stopped["daemon"]["running"], false, "{stopped}");

    let exposure = exposure(&machine);
    // And `socklb uninstall` gives the VIP back.
    let uninstall = machine.checked("socklb uninstall");
    assert!(
        uninstall.contains("removed /sys/fs/bpf/socklb/"),
        "{uninstall}"
    );
    let served = requests(vip, &clients, 5);
    assert!(
        servers
            .iter()
            .all(|server| !served.contains_key(&server.name)),
        "no longer redirected: {served:?}"
    );
    record_figures(&format!(
        "systemd (Debian 12 under systemd-nspawn, unified cgroup tree): booted in {:.1} s; `systemctl enable --now` returned in {:.2} s, redirecting; reload applied in {:.2} s; `systemctl restart`: {} requests, each 5 ms after the last, over {:.1} s, 0 failed; SIGKILL and Restart=always: {} requests over {:.1} s, 0 failed; `systemctl stop` leaves it redirecting; `systemd-analyze security`: {exposure}; whole test {:.0} s",
        booted_in.as_secs_f64(),
        start_took.as_secs_f64(),
        reloaded_in.as_secs_f64(),
        restart.0,
        restart.1,
        killed.0,
        killed.1,
        started.elapsed().as_secs_f64()
    ));
}

/// SIGKILL to the daemon; Restart=always brings a new one, which systemd
/// counts and which adopts the pins.
fn sigkill_and_wait_for_restart(machine: &BootedRoot) {
    let killed = property(machine, "MainPID");
    let restarts: u32 = property(machine, "NRestarts").parse().unwrap();
    machine.checked("systemctl kill --signal=SIGKILL socklb");
    time_until("systemd restarts socklb", Duration::from_secs(30), || {
        let pid = property(machine, "MainPID");
        property(machine, "ActiveState") == "active"
            && pid != "0"
            && pid != killed
            && property(machine, "NRestarts").parse::<u32>().unwrap() == restarts + 1
    });
}

/// The unit's exposure as `systemd-analyze security` rates it.
fn exposure(machine: &BootedRoot) -> String {
    let report = machine.checked("systemd-analyze security --no-pager socklb.service");
    report
        .lines()
        .find_map(|line| line.split_once("Overall exposure level for socklb.service: "))
        .map(|(_, score)| score.trim().to_string())
        .unwrap_or_else(|| panic!("no overall exposure in {report}"))
}
