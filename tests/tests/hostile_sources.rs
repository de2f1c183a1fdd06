//! What an identity that can write EndpointSlices, or the k3s state file,
//! cannot do (issue 17, holes 3, 4, 5 and 7): redirect the node's
//! apiserver traffic with a slice of another manager; make every node
//! probe a thousand addresses of its choice; freeze discovery with one
//! huge or invalid slice; get the daemon OOM-killed with a watch line or a
//! list that never ends; make it relist every second; or plant a state
//! file. Each test replays the attack as the issue measured it, and
//! records what socklb does now.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use socklb_tests::{
    Backend, Cgroup, Daemon, TempDir, backend_field, following, free_port,
    kube::{
        ENDPOINTSLICE_CONTROLLER, Faults, KubeApi, ListFault, SliceSpec, WatchFault, ready_slice,
    },
    listed, record_figures, require_root, scrape_metrics, served, service_args, unique_name,
};

/// How long the daemon may take to notice anything in these tests; the
/// figures record how long it took.
const LIMIT: Duration = Duration::from_secs(20);

fn vip() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// A daemon in `cgroup` that follows `default/kubernetes` through `api`
/// with metrics on; its VIP and metrics address.
fn start_following(
    label: &str,
    cgroup: &Cgroup,
    api: &KubeApi,
    extra: &[&str],
) -> (Daemon, SocketAddr, SocketAddr) {
    let vip = vip();
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let metrics_flag = metrics.to_string();
    let mut flags = vec!["--metrics-addr", &metrics_flag];
    flags.extend_from_slice(extra);
    let daemon = Daemon::start(label, &api.follow_args(&cgroup.path, vip, &flags));
    (daemon, vip, metrics)
}

/// `count` backends on one port (a slice has one port for all its
/// endpoints), at 127.0.0.{base..}, named `{prefix}{index}`.
fn backends(prefix: &str, base: u8, count: u8, port: u16) -> Vec<Backend> {
    (0..count)
        .map(|index| {
            let addr = SocketAddr::from(([127, 0, 0, base + index], port));
            Backend::start_at(&format!("{prefix}{index}"), addr)
        })
        .collect()
}

fn ips(backends: &[Backend]) -> Vec<IpAddr> {
    backends.iter().map(|backend| backend.addr.ip()).collect()
}

/// One sample of the daemon's metrics, 0 when it is not there yet.
fn problems(metrics: SocketAddr, reason: &str) -> f64 {
    let key = format!(
        r#"socklb_discovery_problems_total{{service="default",source="endpointslices",reason="{reason}"}}"#
    );
    scrape_metrics(metrics).get(&key).copied().unwrap_or(0.0)
}

/// The backends the daemon has probed, from its probe histogram.
fn probed_backends(metrics: SocketAddr) -> Vec<String> {
    let mut probed: Vec<String> = scrape_metrics(metrics)
        .keys()
        .filter(|key| key.starts_with("socklb_probe_duration_seconds_count{"))
        .filter_map(|key| key.split("backend=\"").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_string)
        .collect();
    probed.sort();
    probed.dedup();
    probed
}

/// A slice with `count` ready addresses from 198.18.0.0/15 (never
/// connected to: the test network), `per_endpoint` to an endpoint.
fn slice_of_addresses(port: u16, count: usize, per_endpoint: usize) -> SliceSpec {
    let mut spec = SliceSpec::new("kubernetes", "IPv4").with_port("https", port);
    let addresses: Vec<String> = (0..count)
        .map(|index| Ipv4Addr::from(0xC612_0000u32 + 1 + index as u32).to_string())
        .collect();
    for chunk in addresses.chunks(per_endpoint) {
        spec = spec.with_endpoint(&chunk[0], true);
        let last = spec.endpoints.len() - 1;
        spec.endpoints[last].addresses = chunk.to_vec();
    }
    spec
}

#[test]
fn a_foreign_endpointslice_cannot_redirect_the_apiserver_traffic() {
    require_root!();
    let cgroup = Cgroup::new("hostile-manager");
    let port = free_port();
    let good = backends("good", 61, 2, port);
    let evil = backends("evil", 64, 3, port);
    let api = KubeApi::start_on(161);
    // The apiserver's own slice, and three forgeries: another manager, no
    // manager under another name, and the EndpointSlice controller's label
    // (not the manager of default/kubernetes).
    api.put_slice(
        "default",
        "kubernetes",
        &ready_slice(port, &ips(&good[..1])),
    );
    let foreign = ready_slice(port, &ips(&evil)).managed_by("evil-controller");
    api.put_slice("default", "evil", &foreign);
    api.put_slice(
        "default",
        "kubernetes-forged",
        &ready_slice(port, &ips(&evil[..1])),
    );
    let controller = ready_slice(port, &ips(&evil[1..])).managed_by(ENDPOINTSLICE_CONTROLLER);
    api.put_slice("default", "kubernetes-abcde", &controller);
    let (mut daemon, vip, metrics) = start_following("hostile-manager", &cgroup, &api, &[]);
    daemon.wait_health(&[good[0].addr], true, LIMIT);
    let refused = r#"EndpointSlice default/evil is managed by "evil-controller""#;
    assert!(daemon.log_shows(refused, LIMIT), "{}", daemon.log());
    assert!(daemon.log_shows("EndpointSlice default/kubernetes-forged has no", LIMIT));
    assert!(daemon.log_shows(
        r#"EndpointSlice default/kubernetes-abcde is managed by "endpointslice-controller.k8s.io""#,
        LIMIT
    ));

    let spread = served(vip, &cgroup.path, 200);
    assert_eq!(spread.get("good0"), Some(&200), "{spread:?}");
    let status = daemon.status().expect("status");
    for backend in &evil {
        assert!(!listed(&status, backend.addr), "{status}");
    }

    // A change of a forgery, and a relist, say nothing again; the real
    // slice goes on applying. Events come in order: once good1 is listed,
    // the change of `evil` before it was seen.
    let mut bigger = foreign.clone();
    bigger.endpoints.truncate(2);
    api.put_slice("default", "evil", &bigger);
    api.close_watches();
    api.compact();
    api.put_slice("default", "kubernetes", &ready_slice(port, &ips(&good)));
    daemon.wait_for("good1 listed", LIMIT, |status| listed(status, good[1].addr));
    assert_eq!(daemon.log_count(refused), 1, "said once: {}", daemon.log());
    assert_eq!(problems(metrics, "foreign-manager"), 3.0);
    record_figures(&format!(
        "hostile sources: foreign EndpointSlices of default/kubernetes: 0 of 200 connects reached their {} endpoints (143 of 200 before); 3 slices refused, each said and counted once",
        evil.len()
    ));
}

#[test]
fn a_slice_of_1001_endpoints_is_refused_and_none_of_its_addresses_is_probed() {
    require_root!();
    let cgroup = Cgroup::new("hostile-cap");
    let port = free_port();
    let good = backends("good", 71, 1, port);
    let api = KubeApi::start_on(171);
    api.put_slice("default", "kubernetes", &ready_slice(port, &ips(&good)));
    let (mut daemon, vip, metrics) = start_following("hostile-cap", &cgroup, &api, &[]);
    daemon.wait_health(&[good[0].addr], true, LIMIT);

    // The apiserver's slice itself becomes 1,001 attacker-chosen addresses
    // (1,000 endpoints, one of them with two): far past the cap of 64.
    let mut huge = slice_of_addresses(port, 1000, 1);
    huge.endpoints[0]
        .addresses
        .push(good[0].addr.ip().to_string());
    let put = Instant::now();
    api.put_slice("default", "kubernetes", &huge);
    let refusal = "gives 1001 backends, more than max-discovered-backends (64)";
    assert!(daemon.log_shows(refusal, LIMIT), "{}", daemon.log());
    let said = put.elapsed();
    // Several probes of the good backend later, nothing else was probed,
    // and the last known set serves.
    let probes_of_good = |metrics: SocketAddr| {
        scrape_metrics(metrics)
            .iter()
            .filter(|(key, _)| {
                key.starts_with("socklb_probe_duration_seconds_count{")
                    && key.contains(&good[0].addr.to_string())
            })
            .map(|(_, count)| *count)
            .sum::<f64>()
    };
    let before = probes_of_good(metrics);
    let deadline = Instant::now() + LIMIT;
    while probes_of_good(metrics) < before + 10.0 {
        assert!(Instant::now() < deadline, "the good backend is probed");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(probed_backends(metrics), [good[0].addr.to_string()]);
    let status = daemon.status().expect("status");
    let backends = status["services"][0]["backends"]
        .as_array()
        .map_or(0, Vec::len);
    assert_eq!(backends, 1, "{status}");
    assert_eq!(served(vip, &cgroup.path, 20).get("good0"), Some(&20));
    assert_eq!(problems(metrics, "oversized"), 1.0);
    record_figures(&format!(
        "hostile sources: a slice of 1,001 endpoints was refused in {} ms; addresses probed in the next 10 probes of the good backend: 1 (the good one; about 1,000 a second before)",
        said.as_millis()
    ));
}

#[test]
fn one_huge_or_invalid_slice_is_refused_alone_and_later_changes_apply() {
    require_root!();
    let cgroup = Cgroup::new("hostile-huge");
    let port = free_port();
    let mut servers = backends("server", 81, 2, port);
    let api = KubeApi::start_on(181);
    api.put_slice(
        "default",
        "kubernetes",
        &ready_slice(port, &ips(&servers[..1])),
    );
    // Slices the daemon takes (it also follows the EndpointSlice
    // controller here): one of 10,000 addresses, one with an address no
    // connect can go to.
    let huge = slice_of_addresses(port, 10_000, 10).managed_by(ENDPOINTSLICE_CONTROLLER);
    api.put_slice("default", "kubernetes-huge", &huge);
    let invalid =
        ready_slice(port, &[IpAddr::from([0, 0, 0, 0])]).managed_by(ENDPOINTSLICE_CONTROLLER);
    api.put_slice("default", "kubernetes-invalid", &invalid);
    let managers = format!("@apiserver,{ENDPOINTSLICE_CONTROLLER}");
    let (mut daemon, vip, metrics) = start_following(
        "hostile-huge",
        &cgroup,
        &api,
        &["--endpointslice-managers", &managers],
    );
    daemon.wait_health(&[servers[0].addr], true, LIMIT);
    assert!(daemon.log_shows(
        "EndpointSlice default/kubernetes-huge gives 10000 backends, more than max-discovered-backends (64); refused, the other slices apply",
        LIMIT
    ), "{}", daemon.log());
    assert!(daemon.log_shows(
        r#"EndpointSlice default/kubernetes-invalid lists "0.0.0.0", not a usable IPv4 address"#,
        LIMIT
    ));
    assert_eq!(served(vip, &cgroup.path, 20).get("server0"), Some(&20));

    // The apiserver moves: server0 stops, server1 takes its place. socklb
    // follows (it froze before, and 20 of 20 connects failed).
    servers[0].stop();
    let moved = Instant::now();
    api.put_slice(
        "default",
        "kubernetes",
        &ready_slice(port, &ips(&servers[1..])),
    );
    daemon.wait_health(&[servers[1].addr], true, LIMIT);
    daemon.wait_for("server0 gone", LIMIT, |status| {
        !listed(status, servers[0].addr)
    });
    let followed = moved.elapsed();
    assert_eq!(served(vip, &cgroup.path, 20).get("server1"), Some(&20));
    assert_eq!(problems(metrics, "oversized"), 1.0);
    assert_eq!(problems(metrics, "invalid"), 1.0);
    assert!(
        !daemon.log().contains("cannot be applied"),
        "{}",
        daemon.log()
    );
    record_figures(&format!(
        "hostile sources: a 10,000-address slice and an invalid one refused alone; the apiserver's move followed in {} ms, 20 of 20 connects served (0 of 20 before)",
        followed.as_millis()
    ));
}

const MIB: u64 = 1 << 20;

#[test]
fn a_watch_line_or_a_list_that_never_ends_costs_a_bounded_read_not_the_daemon() {
    require_root!();
    let cgroup = Cgroup::new("hostile-endless");
    let memory = socklb_tests::MemoryCgroup::new("endless", 128 * MIB);
    let port = free_port();
    let servers = backends("server", 91, 2, port);
    let api = KubeApi::start_on(191);
    api.put_slice(
        "default",
        "kubernetes",
        &ready_slice(port, &ips(&servers[..1])),
    );
    let vip = vip();
    let pin_path = PathBuf::from("/sys/fs/bpf").join(unique_name("hostile-endless"));
    let mut daemon = Daemon::start_launched(
        "hostile-endless",
        &api.follow_args(&cgroup.path, vip, &[]),
        pin_path,
        &memory.launcher(),
        &[],
    );
    daemon.wait_health(&[servers[0].addr], true, LIMIT);
    // A watch that has run a while (its first bookmark comes after 1 s),
    // so that its end below is a resume, not a watch that ended at once.
    api.wait_stats("a bookmark", LIMIT, |stats| stats.bookmarks_sent >= 1);
    let settled = memory.read_u64("memory.usage_in_bytes");
    memory.write("memory.max_usage_in_bytes", "0");

    // Every watch now streams a line that never ends; the open one ends,
    // so the daemon watches again into it, and again after each backoff.
    api.set_faults(&Faults {
        watch: WatchFault::EndlessLine,
        list: ListFault::None,
    });
    let attack = Instant::now();
    api.close_watches();
    api.wait_stats("three endless watches", Duration::from_secs(60), |stats| {
        stats.endless_answers >= 3
    });
    let bound = "a watch event is longer than 2097152 bytes; refused";
    assert!(daemon.log_shows(bound, LIMIT), "{}", daemon.log());
    // A list that never ends, then.
    api.set_faults(&Faults {
        watch: WatchFault::None,
        list: ListFault::Endless,
    });
    api.wait_stats("two endless lists", Duration::from_secs(60), |stats| {
        stats.endless_answers >= 5
    });
    let offered = api.stats().endless_bytes_sent;
    let under_attack = attack.elapsed();
    // The daemon lives, was never killed, said it once, and the last known
    // set serves.
    daemon.wait_for("the daemon's heartbeat", LIMIT, |status| {
        status["daemon"]["running"] == true
    });
    assert_eq!(memory.oom_kills(), 0);
    let peak = memory.read_u64("memory.max_usage_in_bytes");
    assert!(peak < 128 * MIB, "peak {peak}");
    assert_eq!(daemon.log_count(bound), 1, "{}", daemon.log());
    assert_eq!(served(vip, &cgroup.path, 20).get("server0"), Some(&20));

    // The API behaves again: the next session follows a change.
    api.set_faults(&Faults::default());
    api.put_slice("default", "kubernetes", &ready_slice(port, &ips(&servers)));
    let recovered = daemon.wait_for("server1 listed", Duration::from_secs(60), |status| {
        listed(status, servers[1].addr)
    });
    record_figures(&format!(
        "hostile sources: {} endless watch lines and lists ({} MiB offered in {:.1} s) under a 128 MiB limit: 0 OOM kills, peak {} MiB (settled at {} MiB), the bound said once; a change after the API recovered applied in {} ms",
        api.stats().endless_answers,
        offered / MIB,
        under_attack.as_secs_f64(),
        peak / MIB,
        settled / MIB,
        recovered.as_millis()
    ));
}

#[test]
fn a_watch_that_fails_at_once_is_retried_with_a_backoff_that_lists_do_not_reset() {
    require_root!();
    let cgroup = Cgroup::new("hostile-backoff");
    let port = free_port();
    let servers = backends("server", 101, 1, port);
    let api = KubeApi::start_on(201);
    api.put_slice("default", "kubernetes", &ready_slice(port, &ips(&servers)));
    let vip = vip();
    let mut daemon = Daemon::start("hostile-backoff", &api.follow_args(&cgroup.path, vip, &[]));
    daemon.wait_health(&[servers[0].addr], true, LIMIT);
    api.wait_stats("a watch", LIMIT, |stats| stats.watches_open == 1);

    // Every watch now ends at once; each list succeeds.
    api.set_faults(&Faults {
        watch: WatchFault::Close,
        list: ListFault::None,
    });
    let first = api.stats().lists;
    api.close_watches();
    let start = Instant::now();
    let mut seen_at = Vec::new();
    let mut last = first;
    while seen_at.len() < 4 {
        let lists = api.stats().lists;
        if lists > last {
            seen_at.extend((last..lists).map(|_| start.elapsed()));
            last = lists;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "lists at {seen_at:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let gaps: Vec<Duration> = seen_at.windows(2).map(|pair| pair[1] - pair[0]).collect();
    // Nominal pauses 1, 2, 4, 8 s, each ±20 %: each gap is at least 1.3
    // times the one before (2 × 0.8 / 1.2).
    for pair in gaps.windows(2) {
        assert!(
            pair[1].as_secs_f64() >= pair[0].as_secs_f64() * 1.3,
            "the pause grows: lists at {seen_at:?}"
        );
    }
    // The fourth list comes after pauses of 1 + 2 + 4 + 8 s, less 20 %.
    assert!(
        seen_at[3] >= Duration::from_secs_f64(0.8 * 15.0),
        "lists at {seen_at:?}"
    );
    assert!(daemon.log_shows("the watch ended within 1s of its start", LIMIT));
    assert_eq!(served(vip, &cgroup.path, 20).get("server0"), Some(&20));
    let rendered: Vec<String> = seen_at
        .iter()
        .map(|at| format!("{:.1}", at.as_secs_f64()))
        .collect();
    record_figures(&format!(
        "hostile sources: watches that end at once: lists at {} s (the backoff doubles across list and watch; about one list a second before)",
        rendered.join(", ")
    ));
}

/// Sets the owner of `path` itself (a link, not its target).
fn lchown(path: &Path, uid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid))
        .unwrap_or_else(|error| panic!("lchown {}: {error}", path.display()));
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|error| panic!("chmod {}: {error}", path.display()));
}

/// A k3s state file naming `server`.
fn state_text(server: SocketAddr) -> String {
    format!(r#"{{"ServerURL":"","ServerAddresses":["{server}"],"Listener":null}}"#)
}

/// Replaces whatever is at `path` with a symbolic link to `target`.
fn link(target: &Path, path: &Path) {
    let _ = std::fs::remove_file(path);
    std::os::unix::fs::symlink(target, path)
        .unwrap_or_else(|error| panic!("symlink {}: {error}", path.display()));
}

#[test]
fn a_k3s_state_file_that_others_can_write_is_refused_saying_why() {
    require_root!();
    let cgroup = Cgroup::new("hostile-k3s");
    let port = free_port();
    let seed = Backend::start_at("seed", SocketAddr::from(([127, 0, 0, 111], port)));
    let attacker = Backend::start_at("attacker", SocketAddr::from(([127, 0, 0, 112], port)));
    let server = Backend::start_at("server", SocketAddr::from(([127, 0, 0, 113], port)));
    let dir = TempDir::new("hostile-k3s");
    chmod(&dir.0, 0o755);
    let path = dir.0.join("k3s-agent-load-balancer.json");
    let path_flag = path.display().to_string();
    let vip = vip();
    let args = service_args(
        &cgroup.path,
        &[vip],
        &[seed.addr],
        &["--k3s-state", &path_flag],
    );

    // (the file's setup, the words the refusal must hold)
    type Setup<'a> = Box<dyn Fn() + 'a>;
    let root_file = dir.0.join("root.json");
    let open_dir = dir.0.join("open");
    let cases: Vec<(&str, Setup, String)> = vec![
        (
            "a file of uid 65534, mode 0666",
            Box::new(|| {
                std::fs::write(&path, state_text(attacker.addr)).unwrap();
                lchown(&path, 65534);
                chmod(&path, 0o666);
            }),
            "is owned by uid 65534, neither root nor this process (uid 0)".into(),
        ),
        (
            "a root file others can write",
            Box::new(|| {
                lchown(&path, 0);
                chmod(&path, 0o666);
            }),
            "mode 666 lets group or others write it".into(),
        ),
        (
            "a root file through a link of uid 65534",
            Box::new(|| {
                std::fs::write(&root_file, state_text(attacker.addr)).unwrap();
                chmod(&root_file, 0o644);
                link(&root_file, &path);
                lchown(&path, 65534);
            }),
            format!("{} is a symbolic link owned by uid 65534", path.display()),
        ),
        (
            "a root file in a directory others can write",
            Box::new(|| {
                std::fs::create_dir(&open_dir).unwrap();
                chmod(&open_dir, 0o777);
                let inside = open_dir.join("state.json");
                std::fs::write(&inside, state_text(attacker.addr)).unwrap();
                chmod(&inside, 0o644);
                link(&inside, &path);
            }),
            format!(
                "{} mode 777 lets others replace what is in it",
                open_dir.display()
            ),
        ),
    ];
    let mut daemon: Option<Daemon> = None;
    for (what, setup, words) in &cases {
        setup();
        match daemon.as_mut() {
            None => daemon = Some(Daemon::start("hostile-k3s", &args)),
            Some(daemon) => daemon.restart(),
        }
        let daemon = daemon.as_mut().expect("started");
        daemon.wait_health(&[seed.addr], true, LIMIT);
        let refusal = format!("k3s-state failed: {}: refused: ", path.display());
        assert!(
            daemon.log_shows(words, LIMIT) && daemon.log_shows(&refusal, LIMIT),
            "{what}: {}",
            daemon.log()
        );
        let spread = served(vip, &cgroup.path, 20);
        assert_eq!(spread.get("seed"), Some(&20), "{what}: {spread:?}");
        let status = daemon.status().expect("status");
        assert!(!listed(&status, attacker.addr), "{what}: {status}");
    }

    // A root file through a root link, in root's directories: followed.
    let good_dir = dir.0.join("good");
    std::fs::create_dir(&good_dir).unwrap();
    chmod(&good_dir, 0o755);
    let good_file = good_dir.join("state.json");
    std::fs::write(&good_file, state_text(server.addr)).unwrap();
    chmod(&good_file, 0o600);
    link(&good_file, &path);
    let daemon = daemon.as_mut().expect("started");
    daemon.restart();
    daemon.wait_for("the state file followed", LIMIT, |status| {
        following(status) == "k3s-state" && listed(status, server.addr)
    });
    daemon.wait_health(&[server.addr], true, LIMIT);
    assert_eq!(served(vip, &cgroup.path, 20).get("server"), Some(&20));
    let status = daemon.status().expect("status");
    assert!(backend_field(&status, &seed.addr.to_string(), "addr").is_none());
    record_figures(&format!(
        "hostile sources: k3s state file: {} untrusted setups refused with their reason, 0 of 20 connects each to the attacker (20 of 20 before); a root file through a root link followed",
        cases.len()
    ));
}
