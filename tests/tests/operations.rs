//! Operating socklb on a node: a configuration reloaded in place (SIGHUP
//! and --watch-config) with a client connecting throughout, the k3s state
//! file followed, the state directory used when every source is gone, and
//! metrics that say what `socklb status` says.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use socklb_tests::{
    Backend, Cgroup, ClientRun, ConnClient, Daemon, TempDir, backend_field, free_port, listed,
    record_figures, require_root, scrape_metrics, service_args, spread, state_dir_of,
    until_served_by,
};

fn vip() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// Replaces a file the way an agent or config management does: a
/// temporary file, then a rename over the old one.
fn replace_file(path: &Path, text: &str) {
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, text).expect("writing the temporary file");
    std::fs::rename(&temporary, path).expect("renaming over the file");
}

/// One service: VIP, backends with weights, and a probe kind.
fn service_toml(vip: SocketAddr, backends: &[(SocketAddr, u32)], kind: &str) -> String {
    let list: Vec<String> = backends
        .iter()
        .map(|(addr, weight)| format!("\"{addr},weight={weight}\""))
        .collect();
    format!(
        r#"[[service]]
name = "api"
vips = ["{vip}"]
backends = [{}]
close-on-failure = true

[service.health]
kind = "{kind}"
interval = "200ms"
timeout = "200ms"
rise = 2
fall = 3
"#,
        list.join(", ")
    )
}

fn generation(status: &serde_json::Value) -> u64 {
    status["daemon_info"]["config_generation"]
        .as_u64()
        .unwrap_or(0)
}

/// `--config FILE --cgroup DIR`, then `extra`.
fn config_args(config: &Path, cgroup: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "--config".to_string(),
        config.display().to_string(),
        "--cgroup".to_string(),
        cgroup.display().to_string(),
    ];
    args.extend(extra.iter().map(ToString::to_string));
    args
}

#[test]
fn live_reload_keeps_every_connect() {
    require_root!();
    let cgroup = Cgroup::new("reload");
    // b0 holds its connections open (to see them closed when it leaves);
    // b1 and b2 also answer the http probe of step 4.
    let b0 = Backend::start_holding("b0", "127.0.0.2");
    let b1 = Backend::start_http("b1", "127.0.0.3");
    let b2 = Backend::start_http("b2", "127.0.0.4");
    let vip = vip();
    let dir = TempDir::new("reload");
    let config = dir.0.join("socklb.toml");
    std::fs::write(
        &config,
        service_toml(vip, &[(b0.addr, 1), (b1.addr, 1)], "tcp"),
    )
    .unwrap();
    let args = config_args(&config, &cgroup.path, &["--watch-config"]);
    let mut daemon = Daemon::start("reload", &args);
    daemon.wait_health(&[b0.addr, b1.addr], true, Duration::from_secs(10));
    let first = generation(&daemon.status().unwrap());

    // A client connects every 10 ms through the whole sequence.
    let mut client = ClientRun::new(vip, Some(&cgroup.path), 1200);
    client.interval_ms = 10;
    let client = client.spawn();

    // 1. Add a backend (SIGHUP): it serves within 2 s.
    std::fs::write(
        &config,
        service_toml(vip, &[(b0.addr, 1), (b1.addr, 1), (b2.addr, 1)], "tcp"),
    )
    .unwrap();
    daemon.signal(libc::SIGHUP);
    let added = until_served_by(vip, &cgroup.path, "b2", Duration::from_secs(10));
    assert!(added <= Duration::from_secs(2), "b2 served after {added:?}");

    // 2. Remove b0 (SIGHUP) while connections to it are open: close-on-
    //    failure closes exactly those.
    let mut held = ConnClient::hold_until_released(vip, &cgroup.path, 30, Duration::from_secs(30));
    let on_b0 = daemon.wait_for(
        "held connections counted",
        Duration::from_secs(10),
        |status| {
            let live = |addr: SocketAddr| {
                backend_field(status, &addr.to_string(), "live")
                    .and_then(|value| value.as_i64())
                    .unwrap_or(0)
            };
            live(b0.addr) > 0
        },
    );
    let _ = on_b0;
    // Let every held connect finish (the ones to b1 and b2 get their name
    // and EOF; the ones to b0 stay open).
    let open_on_b0 = {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut last = -1;
        loop {
            let live = backend_field(&daemon.status().unwrap(), &b0.addr.to_string(), "live")
                .and_then(|value| value.as_i64())
                .unwrap_or(0);
            if live == last || Instant::now() > deadline {
                break live;
            }
            last = live;
            std::thread::sleep(Duration::from_millis(300));
        }
    };
    std::fs::write(
        &config,
        service_toml(vip, &[(b1.addr, 1), (b2.addr, 1)], "tcp"),
    )
    .unwrap();
    daemon.signal(libc::SIGHUP);
    daemon.wait_for("b0 gone", Duration::from_secs(10), |status| {
        !listed(status, b0.addr)
    });
    assert!(
        daemon.log_shows("closed", Duration::from_secs(5)),
        "close-on-failure for the removed backend"
    );
    held.release();
    let ends = held.finish();
    let aborted = socklb_tests::aborted(&ends);
    assert!(open_on_b0 > 0, "some held connections went to b0");
    assert_eq!(
        aborted as i64, open_on_b0,
        "exactly the connections to the removed backend were closed: {ends:?}"
    );

    // 3. Change a weight, written only to the file (--watch-config).
    let written = Instant::now();
    replace_file(
        &config,
        &service_toml(vip, &[(b1.addr, 3), (b2.addr, 1)], "tcp"),
    );
    daemon.wait_for(
        "weight 3 from the watched file",
        Duration::from_secs(10),
        |status| {
            backend_field(status, &b1.addr.to_string(), "weight") == Some(serde_json::json!(3))
        },
    );
    let watched = written.elapsed();

    // 4. Change the probe kind to http (SIGHUP): the backends now get
    //    HTTP requests, and stay healthy.
    let before = b1.http_requests() + b2.http_requests();
    std::fs::write(
        &config,
        service_toml(vip, &[(b1.addr, 3), (b2.addr, 1)], "http"),
    )
    .unwrap();
    daemon.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(10);
    while b1.http_requests() + b2.http_requests() < before + 4 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        b1.http_requests() + b2.http_requests() >= before + 4,
        "http probes after the reload"
    );
    let status = daemon.status().unwrap();
    for addr in [b1.addr, b2.addr] {
        assert_eq!(
            backend_field(&status, &addr.to_string(), "healthy"),
            Some(serde_json::Value::Bool(true))
        );
    }
    let good = generation(&status);

    // 5. A broken file: reported, nothing changes, the daemon runs on.
    std::fs::write(
        &config,
        "[[service]]\nname = \"api\"\nvips = [\"127.0.0.1:99999\"]\nbackends = [\"127.0.0.3:1\"]\n",
    )
    .unwrap();
    daemon.signal(libc::SIGHUP);
    let status = daemon.wait_for(
        "the failed reload shown",
        Duration::from_secs(10),
        |status| status["daemon_info"]["last_reload"]["ok"] == false,
    );
    let _ = status;
    let status = daemon.status().unwrap();
    assert_eq!(generation(&status), good, "a broken file changes nothing");
    assert_eq!(status["daemon"]["running"], true);
    assert!(listed(&status, b1.addr) && listed(&status, b2.addr));
    let message = status["daemon_info"]["last_reload"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        message.contains("service[0].vips[0]"),
        "names the field: {message}"
    );

    let attempts = client.finish();
    let failed = attempts.iter().filter(|attempt| !attempt.ok).count();
    assert_eq!(
        failed,
        0,
        "not one connect fails through the reloads: {:?}",
        spread(&attempts)
    );
    record_figures(&format!(
        "reload: {} connects every 10 ms through add, remove, weight, probe kind and a broken file: {failed} failed; \
         added backend served after {} ms, watched-file change applied after {} ms, {aborted} of {open_on_b0} connections to the removed backend closed; generations {first} → {good}",
        attempts.len(),
        added.as_millis(),
        watched.as_millis()
    ));
}

fn k3s_state(server_url: SocketAddr, addresses: &[SocketAddr]) -> String {
    let list: Vec<String> = addresses.iter().map(|addr| format!("\"{addr}\"")).collect();
    format!(
        r#"{{"ServerURL":"https://{server_url}","ServerAddresses":[{}],"Listener":null}}"#,
        list.join(",")
    )
}

fn role(status: &serde_json::Value, addr: SocketAddr) -> Option<String> {
    backend_field(status, &addr.to_string(), "role")
        .and_then(|role| role.as_str().map(String::from))
}

#[test]
fn k3s_state_file_followed_and_persisted() {
    require_root!();
    let cgroup = Cgroup::new("k3s");
    let backends: Vec<Backend> = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        .iter()
        .enumerate()
        .map(|(i, ip)| Backend::start(&format!("b{i}"), ip))
        .collect();
    let [b0, b1, b2] = [backends[0].addr, backends[1].addr, backends[2].addr];
    let vip = vip();
    let dir = TempDir::new("k3s");
    let state = dir.0.join("k3s-api-server-agent-load-balancer.json");
    replace_file(&state, &k3s_state(b0, &[b0, b1]));
    let mut args = service_args(&cgroup.path, &[vip], &[], &[]);
    args.extend(["--k3s-state".to_string(), state.display().to_string()]);
    let mut daemon = Daemon::start("k3s", &args);
    daemon.wait_health(&[b0, b1], true, Duration::from_secs(10));

    // The agent rewrites the file: b2 joins, b0 is no longer listed (it
    // stays as the agent's default server, a standby).
    let written = Instant::now();
    replace_file(&state, &k3s_state(b0, &[b1, b2]));
    daemon.wait_for(
        "the rewritten state file",
        Duration::from_secs(10),
        |status| listed(status, b2) && role(status, b0).as_deref() == Some("standby"),
    );
    let applied = written.elapsed();
    assert!(
        applied <= Duration::from_secs(1),
        "state file applied after {applied:?}"
    );
    assert!(daemon.log_shows(
        &format!("discovery: default: +{b2} (k3s-state)"),
        Duration::from_secs(2)
    ));
    daemon.wait_health(&[b1, b2], true, Duration::from_secs(10));
    let attempts = ClientRun::new(vip, Some(&cgroup.path), 60).run();
    let served = spread(&attempts);
    assert!(!served.contains_key("error"), "{served:?}");
    assert!(
        !served.contains_key("b0"),
        "the standby takes nothing while others are healthy: {served:?}"
    );

    // The state directory holds the set, mode 0600.
    let persisted = state_dir_of(&daemon.pin_path).join("backends.json");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !std::fs::read_to_string(&persisted).is_ok_and(|text| text.contains(&b2.to_string()))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = std::fs::read_to_string(&persisted).expect("backends.json written");
    assert!(
        text.contains(&b2.to_string()) && text.contains("k3s-state"),
        "{text}"
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&persisted).unwrap().permissions(),
    ) & 0o777;
    assert_eq!(mode, 0o600);

    // Every source gone: the state file removed, the daemon restarted. It
    // uses the persisted set and says so.
    std::fs::remove_file(&state).unwrap();
    daemon.restart();
    daemon.wait_health(&[b1, b2], true, Duration::from_secs(10));
    assert!(daemon.log_shows("using the last known set", Duration::from_secs(5)));
    let status = daemon.status().unwrap();
    assert_eq!(role(&status, b0).as_deref(), Some("standby"));
    assert_eq!(
        status["daemon_info"]["services"][0]["following"], "persisted",
        "{status}"
    );

    // A corrupt state file is reported and ignored: with no source left,
    // the service waits (its VIP passes through untouched).
    std::fs::write(&persisted, "{ not json").unwrap();
    daemon.restart();
    assert!(daemon.log_shows("not a socklb state file", Duration::from_secs(10)));
    assert!(daemon.log_shows("no source has given a backend yet", Duration::from_secs(10)));
    let status = daemon.wait_for("no services", Duration::from_secs(10), |status| {
        status["daemon"]["running"] == true
            && status["services"].as_array().is_some_and(Vec::is_empty)
    });
    let _ = status;

    // The file comes back: the service with it.
    replace_file(&state, &k3s_state(b1, &[b1, b2]));
    daemon.wait_health(&[b1, b2], true, Duration::from_secs(10));
    record_figures(&format!(
        "discovery: k3s state file rewritten by hand applied after {} ms; restart with every source gone used the persisted set",
        applied.as_millis()
    ));
}

fn sample(samples: &BTreeMap<String, f64>, key: &str) -> f64 {
    *samples
        .get(key)
        .unwrap_or_else(|| panic!("no sample {key}; samples: {samples:#?}"))
}

#[test]
fn metrics_agree_with_status() {
    require_root!();
    let cgroup = Cgroup::new("metrics");
    let b0 = Backend::start("b0", "127.0.0.2");
    let mut b1 = Backend::start("b1", "127.0.0.3");
    let vip = vip();
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let dir = TempDir::new("metrics");
    let config = dir.0.join("socklb.toml");
    std::fs::write(
        &config,
        service_toml(vip, &[(b0.addr, 1), (b1.addr, 1)], "tcp"),
    )
    .unwrap();
    let metrics_flag = metrics.to_string();
    let args = config_args(&config, &cgroup.path, &["--metrics-addr", &metrics_flag]);
    let mut daemon = Daemon::start("metrics", &args);
    daemon.wait_health(&[b0.addr, b1.addr], true, Duration::from_secs(10));
    let attempts = ClientRun::new(vip, Some(&cgroup.path), 40).run();
    assert!(attempts.iter().all(|attempt| attempt.ok));
    b1.stop();
    daemon.wait_health(&[b1.addr], false, Duration::from_secs(10));
    daemon.signal(libc::SIGHUP);
    assert!(daemon.log_shows("is unchanged", Duration::from_secs(5)));
    // Someone else changes a setting: the repair is counted by kind.
    {
        use socklb::dataplane::{BpfMaps, MapStore, PinPaths};
        let mut store =
            BpfMaps::open_pinned(&PinPaths::new(&daemon.pin_path)).expect("the pinned maps");
        let settings = store.settings().expect("settings");
        store
            .put_settings(&lb_common::Settings {
                host_netns_cookie: 1,
                ..settings
            })
            .expect("tamper");
    }
    daemon.wait_for("the settings repaired", Duration::from_secs(10), |status| {
        status["data_plane"]["repairs_by_kind"]["settings"].as_u64() == Some(1)
    });

    // Nothing moves now: no traffic, b1 stays down.
    let status = daemon.status().unwrap();
    let samples = scrape_metrics(metrics);
    let service = &status["services"][0];
    for backend in service["backends"].as_array().unwrap() {
        let labels = format!(
            "{{service=\"api\",backend=\"{}\"}}",
            backend["addr"].as_str().unwrap()
        );
        let number = |field: &str| {
            backend[field].as_f64().unwrap_or_else(|| {
                if backend[field].as_bool() == Some(true) {
                    1.0
                } else {
                    0.0
                }
            })
        };
        assert_eq!(
            sample(&samples, &format!("socklb_backend_healthy{labels}")),
            number("healthy")
        );
        assert_eq!(
            sample(
                &samples,
                &format!("socklb_backend_live_connections{labels}")
            ),
            number("live")
        );
        assert_eq!(
            sample(&samples, &format!("socklb_backend_redirects_total{labels}")),
            number("redirects")
        );
        assert_eq!(
            sample(
                &samples,
                &format!("socklb_backend_failed_connects_total{labels}")
            ),
            number("failed_connects")
        );
    }
    let redirects: f64 = service["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|backend| backend["redirects"].as_f64().unwrap())
        .sum();
    assert_eq!(redirects, 40.0);
    assert_eq!(
        sample(
            &samples,
            "socklb_service_none_healthy_total{service=\"api\"}"
        ),
        service["none_healthy"].as_f64().unwrap()
    );
    assert_eq!(
        sample(&samples, "socklb_service_rejected_total{service=\"api\"}"),
        service["rejected"].as_f64().unwrap()
    );
    let repairs = status["data_plane"]["repairs_by_kind"].as_object().unwrap();
    assert!(!repairs.is_empty(), "the settings repair: {repairs:?}");
    for (kind, count) in repairs {
        assert_eq!(
            sample(
                &samples,
                &format!("socklb_dataplane_repairs_total{{kind=\"{kind}\"}}")
            ),
            count.as_f64().unwrap()
        );
    }
    let down = format!(
        "socklb_backend_transitions_total{{service=\"api\",backend=\"{}\",to=\"unhealthy\"}}",
        b1.addr
    );
    assert_eq!(sample(&samples, &down), 1.0);
    let failed_probes = format!(
        "socklb_probe_duration_seconds_count{{service=\"api\",backend=\"{}\",result=\"failed\"}}",
        b1.addr
    );
    assert!(sample(&samples, &failed_probes) >= 3.0, "fall = 3");
    assert_eq!(
        sample(
            &samples,
            "socklb_config_reloads_total{result=\"unchanged\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &samples,
            &format!(
                "socklb_build_info{{version=\"{}\"}}",
                env!("CARGO_PKG_VERSION")
            )
        ),
        1.0
    );
    record_figures(&format!(
        "metrics: {} samples; per-backend healthy, live, redirects and failed connects equal status",
        samples.len()
    ));
}

/// Publishes a version of `socklb.toml` in `dir` as the kubelet does for a
/// ConfigMap volume: a new hidden directory, the `..data` symlink swapped
/// to it by a rename, and `socklb.toml` a symlink through `..data` that
/// itself never changes.
fn publish_configmap(dir: &Path, version: u32, text: &str) {
    let data = format!("..v{version}");
    std::fs::create_dir(dir.join(&data)).expect("the version's directory");
    std::fs::write(dir.join(&data).join("socklb.toml"), text).expect("the version's file");
    let temporary = dir.join("..data_tmp");
    std::os::unix::fs::symlink(&data, &temporary).expect("..data_tmp");
    std::fs::rename(&temporary, dir.join("..data")).expect("the swap of ..data");
    let file = dir.join("socklb.toml");
    if std::fs::symlink_metadata(&file).is_err() {
        std::os::unix::fs::symlink("..data/socklb.toml", &file).expect("socklb.toml");
    }
    if version > 1 {
        let _ = std::fs::remove_dir_all(dir.join(format!("..v{}", version - 1)));
    }
}

#[test]
fn a_configmap_volume_update_is_applied() {
    require_root!();
    let cgroup = Cgroup::new("configmap");
    let b0 = Backend::start("b0", "127.0.0.2");
    let b1 = Backend::start("b1", "127.0.0.3");
    let vip = vip();
    let dir = TempDir::new("configmap");
    publish_configmap(&dir.0, 1, &service_toml(vip, &[(b0.addr, 1)], "tcp"));
    let args = config_args(
        &dir.0.join("socklb.toml"),
        &cgroup.path,
        &["--watch-config"],
    );
    let mut daemon = Daemon::start("configmap", &args);
    daemon.wait_health(&[b0.addr], true, Duration::from_secs(10));

    let written = Instant::now();
    publish_configmap(
        &dir.0,
        2,
        &service_toml(vip, &[(b0.addr, 1), (b1.addr, 1)], "tcp"),
    );
    daemon.wait_for(
        "b1 from the new ConfigMap version",
        Duration::from_secs(10),
        |status| listed(status, b1.addr),
    );
    let applied = written.elapsed();
    daemon.wait_health(&[b0.addr, b1.addr], true, Duration::from_secs(10));
    let served = spread(&ClientRun::new(vip, Some(&cgroup.path), 40).run());
    assert!(!served.contains_key("error"), "{served:?}");
    assert_eq!(
        daemon.status().unwrap()["daemon_info"]["last_reload"]["ok"],
        true
    );
    record_figures(&format!(
        "reload: a ConfigMap volume update (the ..data swap) applied after {} ms",
        applied.as_millis()
    ));
}
