//! The data plane's lifetime: it outlives the daemon, is adopted without a
//! gap, is removed completely by uninstall (and only ours), survives table
//! churn without a half-written table, and a bad config never touches it.

use std::{
    net::SocketAddr,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use lb_common::names;
use socklb::{
    config::parse_toml,
    dataplane::{BackendHealth, BpfMaps, Desired, MapStore, PinPaths, Writer},
    planner::{Layout, plan},
};
use socklb_tests::{
    Backend, Cgroup, ClientRun, Daemon, free_port, pace_bound, require_root, service_args, socklb,
    spread,
};

fn three_backends() -> Vec<Backend> {
    ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        .iter()
        .enumerate()
        .map(|(i, ip)| Backend::start(&format!("b{i}"), ip))
        .collect()
}

fn addrs(backends: &[Backend]) -> Vec<SocketAddr> {
    backends.iter().map(|backend| backend.addr).collect()
}

fn vip() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

fn bpftool(args: &[&str]) -> std::process::Output {
    Command::new("bpftool")
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("running bpftool (Debian package bpftool): {error}"))
}

fn bpftool_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["-j"];
    all.extend_from_slice(args);
    let output = bpftool(&all);
    assert!(
        output.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("bpftool JSON")
}

/// (link id, program id) of each pinned link of a daemon.
fn pinned_links(pin_path: &Path) -> Vec<(u64, u64)> {
    lb_common::names::PROGRAMS
        .iter()
        .map(|program| {
            let path = PinPaths::new(pin_path).link(program);
            let link = bpftool_json(&["link", "show", "pinned", &path.display().to_string()]);
            (
                link["id"].as_u64().expect("link id"),
                link["prog_id"].as_u64().expect("prog id"),
            )
        })
        .collect()
}

/// `bpftool map dump` of the small maps, which a bad config must not change.
fn dump_small_maps(pin_path: &Path) -> String {
    [
        names::SERVICES,
        names::BACKENDS,
        names::TABLES,
        names::SETTINGS,
    ]
    .iter()
    .map(|map| {
        let output = bpftool(&[
            "map",
            "dump",
            "pinned",
            &pin_path.join(map).display().to_string(),
        ]);
        assert!(output.status.success(), "dump {map}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    })
    .collect()
}

/// `socklb run` for one VIP and these backends in `cgroup`, once every
/// backend has been probed healthy.
fn healthy_daemon(
    label: &str,
    cgroup: &Cgroup,
    vip: SocketAddr,
    backends: &[SocketAddr],
    extra: &[&str],
) -> Daemon {
    let mut daemon = Daemon::start(label, &service_args(&cgroup.path, &[vip], backends, extra));
    daemon.wait_health(backends, true, Duration::from_secs(10));
    daemon
}

/// A daemon for one VIP and one backend ("b0" on 127.0.0.2), healthy.
struct OneBackend {
    cgroup: Cgroup,
    backend: Backend,
    vip: SocketAddr,
    daemon: Daemon,
}

fn one_backend(label: &str, extra: &[&str]) -> OneBackend {
    require_root();
    let cgroup = Cgroup::new(label);
    let backend = Backend::start("b0", "127.0.0.2");
    let vip = vip();
    let daemon = healthy_daemon(label, &cgroup, vip, &[backend.addr], extra);
    OneBackend {
        cgroup,
        backend,
        vip,
        daemon,
    }
}

#[test]
fn sigkill_and_restart_while_a_client_connects_fails_no_connect() {
    require_root!();
    let cgroup = Cgroup::new("restart");
    let backends = three_backends();
    let vip = vip();
    let mut daemon = healthy_daemon("restart", &cgroup, vip, &addrs(&backends), &[]);

    let mut run = ClientRun::new(vip, Some(&cgroup.path), 600);
    run.interval_ms = 5;
    let interval = Duration::from_millis(run.interval_ms);
    let client = run.spawn();
    // The client connects through the VIP before the kill, and the pinned
    // data plane goes on redirecting it while no daemon runs.
    let before_kill = daemon.wait_redirects(0, 50, pace_bound(50, interval));
    daemon.kill();
    daemon.wait_redirects(before_kill, 50, pace_bound(50, interval));
    daemon.restart();
    daemon.wait_health(&addrs(&backends), true, Duration::from_secs(10));
    let attempts = client.finish();

    assert_eq!(attempts.len(), 600);
    let counts = spread(&attempts);
    assert_eq!(
        counts.get("error"),
        None,
        "no connect may fail across kill and restart: {counts:?}"
    );
    assert!(
        daemon.log_shows("adopted the pinned data plane", Duration::from_secs(3)),
        "{}",
        daemon.log()
    );
}

#[test]
fn sigterm_leaves_the_data_plane_and_cleanup_on_exit_removes_it() {
    require_root!();
    let OneBackend {
        cgroup,
        backend,
        vip,
        mut daemon,
    } = one_backend("sigterm", &[]);
    daemon.signal(libc::SIGTERM);
    let status = daemon
        .wait_exit(Duration::from_secs(5))
        .expect("exits on SIGTERM");
    assert!(status.success(), "{status}");
    let attempts = ClientRun::new(vip, Some(&cgroup.path), 3).run();
    assert!(
        attempts
            .iter()
            .all(|a| a.served_by.as_deref() == Some("b0")),
        "still redirecting: {attempts:?}"
    );
    let report = daemon.status().expect("status works without a daemon");
    assert_eq!(
        report["services"][0]["backends"][0]["redirects"],
        serde_json::json!(3)
    );

    let cleanup_cgroup = Cgroup::new("cleanup");
    let mut cleaning = Daemon::start(
        "cleanup",
        &service_args(
            &cleanup_cgroup.path,
            &[vip],
            &[backend.addr],
            &["--cleanup-on-exit"],
        ),
    );
    cleaning.wait_health(&[backend.addr], true, Duration::from_secs(10));
    cleaning.signal(libc::SIGINT);
    assert!(
        cleaning
            .wait_exit(Duration::from_secs(5))
            .expect("exits on SIGINT")
            .success()
    );
    assert!(
        !cleaning.pin_path.exists(),
        "--cleanup-on-exit removes the pins"
    );
    let attempts = ClientRun::new(vip, Some(&cleanup_cgroup.path), 2).run();
    assert!(
        attempts.iter().all(|a| !a.ok),
        "no longer redirected: {attempts:?}"
    );
}

#[test]
fn uninstall_removes_our_pins_links_and_programs_and_nothing_else() {
    require_root!();
    let cgroup = Cgroup::new("uninstall");
    let backend = Backend::start("b0", "127.0.0.2");
    let other_backend = Backend::start("other", "127.0.0.3");
    let (ours_vip, other_vip) = (vip(), vip());
    let mut ours = Daemon::start(
        "uninstall",
        &service_args(&cgroup.path, &[ours_vip], &[backend.addr], &[]),
    );
    // A second, independent socklb on the same cgroup stands in for another
    // program on the same hooks (Cilium, Calico): it must survive.
    let mut other = Daemon::start(
        "neighbour",
        &service_args(&cgroup.path, &[other_vip], &[other_backend.addr], &[]),
    );
    ours.wait_health(&[backend.addr], true, Duration::from_secs(10));
    other.wait_health(&[other_backend.addr], true, Duration::from_secs(10));
    let links = pinned_links(&ours.pin_path);
    ours.kill();

    let output = socklb(&[
        "uninstall",
        "--pin-path",
        &ours.pin_path.display().to_string(),
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!ours.pin_path.exists(), "pin directory removed");
    // Programs are freed after an RCU grace period: poll briefly.
    let deadline = Instant::now() + Duration::from_secs(5);
    for (link_id, program_id) in &links {
        loop {
            let link_gone = !bpftool(&["link", "show", "id", &link_id.to_string()])
                .status
                .success();
            let program_gone = !bpftool(&["prog", "show", "id", &program_id.to_string()])
                .status
                .success();
            if link_gone && program_gone {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "link {link_id} or program {program_id} still exists"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let attempts = ClientRun::new(ours_vip, Some(&cgroup.path), 2).run();
    assert!(
        attempts.iter().all(|a| !a.ok),
        "our VIP no longer redirects: {attempts:?}"
    );
    let attempts = ClientRun::new(other_vip, Some(&cgroup.path), 3).run();
    assert!(
        attempts
            .iter()
            .all(|a| a.served_by.as_deref() == Some("other")),
        "the neighbour on the same cgroup still redirects: {attempts:?}"
    );
    assert_eq!(
        pinned_links(&other.pin_path).len(),
        lb_common::names::PROGRAMS.len()
    );

    let again = socklb(&[
        "uninstall",
        "--pin-path",
        &ours.pin_path.display().to_string(),
    ]);
    assert!(
        again.status.success(),
        "a second uninstall has nothing to do, and succeeds"
    );
    assert!(String::from_utf8_lossy(&again.stdout).contains("nothing of socklb is pinned"));
}

#[test]
fn bpftool_map_dump_prints_named_fields() {
    require_root!();
    let setup = one_backend("btf", &[]);
    let daemon = &setup.daemon;
    let dump = dump_small_maps(&daemon.pin_path);
    for field in [
        "addr_be",
        "port_be",
        "healthy_slots",
        "bank_base",
        "weight",
        "probed",
        "host_netns_cookie",
    ] {
        assert!(
            dump.contains(&format!("\"{field}\"")),
            "bpftool shows {field}:\n{dump}"
        );
    }
}

#[test]
fn a_bad_config_leaves_the_kernel_untouched() {
    require_root!();
    let OneBackend {
        cgroup,
        backend: _backend,
        vip,
        mut daemon,
    } = one_backend("badconfig", &[]);
    daemon.kill();
    let pin = daemon.pin_path.display().to_string();
    let before = dump_small_maps(&daemon.pin_path);
    let links_before = pinned_links(&daemon.pin_path);

    let file = std::env::temp_dir().join(format!("{}.toml", socklb_tests::unique_name("bad")));
    std::fs::write(
        &file,
        format!("[[service]]\nname = \"x\"\nvips = [\"{vip}\"]\nbackends = [\"127.0.0.3:0\"]\n"),
    )
    .expect("write config");
    let cgroup_arg = cgroup.path.display().to_string();
    let file_arg = file.display().to_string();
    let cases: [(&str, Vec<&str>, &str); 6] = [
        (
            "bad file",
            vec!["--config", &file_arg],
            "service[0].backends[0]",
        ),
        (
            "bad flag",
            vec!["--vip", "127.0.0.1", "--backend", "127.0.0.3:1"],
            "--vip[0]",
        ),
        (
            "bad weight",
            vec!["--vip", "127.0.0.1:9", "--backend", "127.0.0.3:1,weight=-1"],
            "--backend[0].weight",
        ),
        (
            "IPv6 zone id",
            vec!["--vip", "[::1%1]:9", "--backend", "[::1]:1"],
            "--vip[0]: \"[::1%1]:9\": IPv6 zone ids (%ZONE) are not supported",
        ),
        (
            "a backend of a family without a VIP",
            vec![
                "--vip",
                "127.0.0.1:9",
                "--backend",
                "127.0.0.3:1",
                "--backend",
                "[::1]:1",
            ],
            "--backend[1]: [::1]:1 is IPv6 but the service has no IPv6 VIP",
        ),
        (
            "an interval past the range",
            vec![
                "--vip",
                "127.0.0.1:9",
                "--backend",
                "127.0.0.3:1",
                "--health-interval",
                "2h",
            ],
            "--health-interval: \"2h\" is out of range 10ms..=1h",
        ),
    ];
    for (what, args, field) in cases {
        let mut all = vec!["run", "--cgroup", &cgroup_arg, "--pin-path", &pin];
        all.extend(args);
        let output = socklb(&all);
        assert_eq!(output.status.code(), Some(2), "{what}: exit status 2");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(field),
            "{what}: the error names {field}: {stderr}"
        );
    }
    let bad_cgroup = socklb(&[
        "run",
        "--cgroup",
        "/tmp",
        "--pin-path",
        &pin,
        "--vip",
        "127.0.0.1:9",
        "--backend",
        "127.0.0.3:1",
    ]);
    assert_eq!(bad_cgroup.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_cgroup.stderr).contains("--cgroup /tmp"));
    std::fs::remove_file(&file).expect("remove config");

    assert_eq!(dump_small_maps(&daemon.pin_path), before, "maps unchanged");
    assert_eq!(
        pinned_links(&daemon.pin_path),
        links_before,
        "links unchanged"
    );
    let attempts = ClientRun::new(vip, Some(&cgroup.path), 3).run();
    assert!(
        attempts
            .iter()
            .all(|a| a.served_by.as_deref() == Some("b0")),
        "{attempts:?}"
    );

    // On a fresh pin path, a bad config creates nothing at all.
    let fresh = std::path::PathBuf::from("/sys/fs/bpf").join(socklb_tests::unique_name("fresh"));
    let fresh_arg = fresh.display().to_string();
    let output = socklb(&[
        "run",
        "--cgroup",
        &cgroup_arg,
        "--pin-path",
        &fresh_arg,
        "--vip",
        "127.0.0.1:9",
    ]);
    assert_eq!(output.status.code(), Some(2));
    assert!(!fresh.exists(), "nothing pinned for a bad config");

    let check = socklb(&[
        "check-config",
        &format!("{}", Path::new("/nonexistent/socklb.toml").display()),
    ]);
    assert_eq!(check.status.code(), Some(2));
    // Each cause is said once.
    let check = socklb(&["check-config", "/tmp"]);
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert_eq!(check.status.code(), Some(2));
    assert_eq!(stderr.matches("Is a directory").count(), 1, "{stderr}");
    let check = socklb(&["check-config", "/dev/null"]);
    assert_eq!(check.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&check.stderr).contains("no service is configured"));
}

#[test]
fn table_swaps_under_churn_never_show_a_half_written_table() {
    require_root!();
    let cgroup = Cgroup::new("churn");
    let backends = three_backends();
    let vip = vip();
    let mut daemon = healthy_daemon("churn", &cgroup, vip, &addrs(&backends), &[]);
    // Stop the daemon (the data plane stays) so that only this test writes.
    daemon.signal(libc::SIGTERM);
    daemon
        .wait_exit(Duration::from_secs(5))
        .expect("daemon exits");

    let text = format!(
        "[[service]]\nname = \"default\"\nvips = [\"{vip}\"]\nbackends = [{}]\n",
        addrs(&backends)
            .iter()
            .map(|addr| format!("\"{addr}\""))
            .collect::<Vec<_>>()
            .join(",")
    );
    let layout = Layout::from_config(&parse_toml(&text).expect("config"), |_| false);
    let mut maps = BpfMaps::open_pinned(&PinPaths::new(&daemon.pin_path)).expect("open pins");
    let mut writer = Writer::adopt(&maps).expect("read the maps");
    let settings = maps.settings().expect("settings");
    let healthy = |_| BackendHealth {
        healthy: true,
        probed: true,
        draining: false,
    };
    // Three tables of different sizes and members, cycled while the banks
    // alternate, so each bank is rewritten with contents unlike its last.
    let tables: Vec<Desired> = [
        plan(&layout, |id| id == 0),
        plan(&layout, |id| id != 0),
        plan(&layout, |id| id != 1),
    ]
    .iter()
    .map(|contents| Desired::build(&layout, contents, healthy, settings, Default::default()))
    .collect();

    let mut run = ClientRun::new(vip, Some(&cgroup.path), 1500);
    run.interval_ms = 1;
    let client = run.spawn();
    let mut banks = Vec::new();
    let started = Instant::now();
    let mut swaps = 0;
    // Swap for as long as the client runs (about 2 s), bounded in count.
    while swaps < 100_000 && started.elapsed() < Duration::from_secs(3) {
        let desired = &tables[swaps % tables.len()];
        writer.write(&mut maps, desired).expect("swap");
        let entry = maps.services().expect("entries")[0].1;
        banks.push(entry.bank_base);
        swaps += 1;
        std::thread::sleep(Duration::from_micros(100));
    }
    let attempts = client.finish();
    eprintln!("{swaps} table swaps while {} connects ran", attempts.len());
    assert!(swaps >= 500, "only {swaps} swaps");
    assert!(
        banks.windows(2).all(|pair| pair[0] != pair[1]),
        "every swap flips to the idle bank"
    );
    let counts = spread(&attempts);
    assert_eq!(
        counts.get("error"),
        None,
        "no connect saw a broken table: {counts:?}"
    );
    assert!(counts.len() == 3, "connects saw both tables: {counts:?}");
}

/// Kernel logs are off by default; a restart with `--bpf-log debug` on the
/// same pins applies it (the links switch to the new programs), and the
/// connect program's records reach the daemon's log.
#[test]
fn kernel_logs_are_forwarded_when_asked_for() {
    require_root!();
    let OneBackend {
        cgroup,
        backend,
        vip,
        mut daemon,
    } = one_backend("bpflog", &[]);
    let record = "socklb: table 0 slot";
    let attempts = ClientRun::new(vip, Some(&cgroup.path), 3).run();
    assert!(attempts.iter().all(|a| a.ok), "{attempts:?}");
    daemon.restart_with(&service_args(
        &cgroup.path,
        &[vip],
        &[backend.addr],
        &["--bpf-log", "debug"],
    ));
    daemon.wait_health(&[backend.addr], true, Duration::from_secs(10));
    assert!(
        !daemon.log().contains(record),
        "no kernel record while logging was off:\n{}",
        daemon.log()
    );
    let attempts = ClientRun::new(vip, Some(&cgroup.path), 3).run();
    assert!(attempts.iter().all(|a| a.ok), "{attempts:?}");
    assert!(
        daemon.log_shows(record, Duration::from_secs(3)),
        "the connect program's debug record reaches the daemon's log:\n{}",
        daemon.log()
    );
}

#[test]
fn a_tampered_service_entry_is_restored_with_a_warning() {
    require_root!();
    let OneBackend {
        cgroup,
        backend: _backend,
        vip,
        daemon,
    } = one_backend("tamper", &[]);
    // Another agent deletes our VIP entry behind our back.
    let services = daemon.pin_path.join(names::SERVICES).display().to_string();
    let entries = bpftool_json(&["map", "dump", "pinned", &services]);
    let key: Vec<String> = entries[0]["key"]
        .as_array()
        .map(|bytes| {
            bytes
                .iter()
                .filter_map(|byte| byte.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(key.len(), 20, "raw key bytes from bpftool: {entries}");
    let mut delete = vec!["map", "delete", "pinned", services.as_str(), "key", "hex"];
    let hex: Vec<String> = key
        .iter()
        .map(|byte| byte.trim_start_matches("0x").to_string())
        .collect();
    delete.extend(hex.iter().map(String::as_str));
    let output = bpftool(&delete);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        daemon.log_shows(
            "was removed by someone else; restoring it",
            Duration::from_secs(8)
        ),
        "{}",
        daemon.log()
    );
    let attempts = ClientRun::new(vip, Some(&cgroup.path), 3).run();
    assert!(
        attempts
            .iter()
            .all(|a| a.served_by.as_deref() == Some("b0")),
        "restored: {attempts:?}"
    );
}
