//! The packaging: the Kubernetes manifests validated offline against the
//! API's schemas, the systemd unit verified by systemd, and least privilege
//! proven: socklb runs as the DaemonSet's container runs it, uid 0 holding
//! exactly the capabilities the manifest adds (and the unit's bounding set
//! holds), on a node whose bpffs is mounted 0700 and on one without bpffs
//! (where the init container's script mounts it). It redirects, restarts
//! onto its pins, answers the readiness probe and uninstalls; without any
//! one of the capabilities it refuses to start and names what is missing.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use socklb_tests::{
    Backend, BpffsStart, Cgroup, ClientRun, Daemon, MountNamespace, TempDir, free_port,
    kube::{missing_python, python},
    manifest::{
        container, daemonset_container, daemonset_path, daemonset_pod_spec, object, pod_spec, repo,
        strings, uninstall_path, unit_path, unit_setting,
    },
    record_figures, require, require_root, service_args, socklb_bin, spread, unique_name,
};

/// The manifests `kubectl apply -f deploy/kubernetes/` applies, and the
/// cleanup manifest beside them.
fn manifests() -> Vec<PathBuf> {
    let dir = repo().join("deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|error| panic!("{}: {error}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    files.push(uninstall_path());
    files
}

/// `kubernetes-validate --strict` against Kubernetes 1.31 (the oldest
/// release the manifests support): its output, and whether it passed.
fn validate(files: &[PathBuf]) -> (bool, String) {
    let validator = python().with_file_name("kubernetes-validate");
    let output = Command::new(&validator)
        .args(["-k", "1.31", "--strict"])
        .args(files)
        .output()
        .unwrap_or_else(|error| panic!("{}: {error}", validator.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[test]
fn the_manifests_validate_against_the_kubernetes_schemas() {
    require!(missing_python());
    let files = manifests();
    let (passed, text) = validate(&files);
    assert!(passed, "{text}");
    // Every object was checked: the DaemonSet, the ConfigMap, and the
    // ServiceAccount with its ClusterRole and binding.
    for object in [
        "daemonset/socklb",
        "configmap/socklb",
        "serviceaccount/socklb",
        "clusterrole/socklb",
        "clusterrolebinding/socklb",
        "daemonset/socklb-uninstall",
    ] {
        assert!(
            text.contains(&format!("passed for resource {object}")),
            "{object} validated: {text}"
        );
    }

    // The validator does refuse a broken manifest (a misspelt field).
    let dir = std::env::temp_dir().join(unique_name("manifest"));
    std::fs::create_dir(&dir).unwrap();
    let daemonset = std::fs::read_to_string(daemonset_path())
        .unwrap()
        .replace("tolerations:", "toleration:");
    let broken = dir.join("daemonset.yaml");
    std::fs::write(&broken, daemonset).unwrap();
    let (passed, text) = validate(&[broken]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!passed && text.contains("toleration"), "{text}");
}

/// The host path behind each of a container's mount paths.
fn host_paths_by_mount(
    pod: &serde_json::Value,
    container: &serde_json::Value,
) -> Vec<(String, String)> {
    let mut paths: Vec<(String, String)> = container["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .map(|mount| {
            let volume = pod["volumes"]
                .as_array()
                .and_then(|volumes| {
                    volumes
                        .iter()
                        .find(|volume| volume["name"] == mount["name"])
                })
                .expect("the mount's volume");
            (
                mount["mountPath"].as_str().unwrap().to_string(),
                volume["hostPath"]["path"]
                    .as_str()
                    .unwrap_or("(not a hostPath)")
                    .to_string(),
            )
        })
        .collect();
    paths.sort();
    paths
}

#[test]
fn the_cleanup_manifest_uninstalls_with_the_daemons_privileges_and_paths() {
    let cleanup = pod_spec(&object(&uninstall_path(), "DaemonSet", "socklb-uninstall"));
    let uninstall = container(&cleanup, "uninstall");
    let daemonset = daemonset_pod_spec();
    let daemon = container(&daemonset, "socklb");
    assert_eq!(uninstall["securityContext"], daemon["securityContext"]);
    let pin_path = strings(&daemon["args"])
        .into_iter()
        .find(|arg| arg.starts_with("--pin-path="))
        .expect("the daemon's pin path");
    assert_eq!(
        strings(&uninstall["args"]),
        ["uninstall".to_string(), pin_path]
    );
    // The same lock directory, through the same variable.
    let run_dir = |container: &serde_json::Value| {
        container["env"]
            .as_array()
            .and_then(|env| {
                env.iter()
                    .find(|variable| variable["name"] == "SOCKLB_RUN_DIR")
            })
            .map(|variable| variable["value"].clone())
    };
    assert_eq!(run_dir(&uninstall), run_dir(&daemon));
    // Each of its mounts is the daemon's: same path, same node directory.
    let daemon_paths = host_paths_by_mount(&daemonset, &daemon);
    for mount in host_paths_by_mount(&cleanup, &uninstall) {
        assert!(
            daemon_paths.contains(&mount),
            "{mount:?} in {daemon_paths:?}"
        );
    }
    // The same nodes: agents, whatever their taints.
    assert_eq!(cleanup["affinity"], daemonset["affinity"]);
    assert_eq!(cleanup["tolerations"], daemonset["tolerations"]);
}

/// The capabilities the DaemonSet adds, in setpriv's spelling (`bpf`).
fn daemonset_capabilities() -> Vec<String> {
    let container = daemonset_container();
    let capabilities = &container["securityContext"]["capabilities"];
    assert_eq!(capabilities["drop"], serde_json::json!(["ALL"]));
    assert_eq!(container["securityContext"]["privileged"], false);
    assert_eq!(
        container["securityContext"]["allowPrivilegeEscalation"],
        false
    );
    capabilities["add"]
        .as_array()
        .expect("capabilities.add")
        .iter()
        .map(|cap| cap.as_str().expect("a name").to_ascii_lowercase())
        .collect()
}

#[test]
fn the_systemd_unit_verifies_and_bounds_the_same_capabilities() {
    require!(missing_python());
    let unit = std::fs::read_to_string(unit_path()).unwrap();
    let mut bounding: Vec<String> = unit_setting(&unit, "CapabilityBoundingSet")
        .split_whitespace()
        .map(|cap| cap.trim_start_matches("CAP_").to_ascii_lowercase())
        .collect();
    let mut listed = daemonset_capabilities();
    bounding.sort();
    listed.sort();
    assert_eq!(bounding, listed, "the unit and the DaemonSet agree");
    assert_eq!(unit_setting(&unit, "ExecReload"), "/bin/kill -HUP $MAINPID");
    assert_eq!(unit_setting(&unit, "Restart"), "always");
    assert_eq!(unit_setting(&unit, "ProtectSystem"), "strict");
    assert_eq!(unit_setting(&unit, "NoNewPrivileges"), "yes");

    // systemd's own check, with the binary where this build has it.
    let dir = std::env::temp_dir().join(unique_name("unit"));
    std::fs::create_dir(&dir).unwrap();
    let copy = dir.join("socklb.service");
    std::fs::write(
        &copy,
        unit.replace("/usr/local/bin/socklb", &socklb_bin().display().to_string()),
    )
    .unwrap();
    let output = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .expect("systemd-analyze (cargo xtask test installs systemd)");
    let _ = std::fs::remove_dir_all(&dir);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{text}");
    assert!(
        !text.contains("socklb.service"),
        "systemd-analyze has nothing to say about the unit: {text}"
    );
}

/// The launcher that runs a command as the DaemonSet's container runs
/// socklb, in `namespace`'s mounts: uid 0 with the capability bounding and
/// inheritable sets cut to `caps` (setpriv's names) and no_new_privs
/// (`allowPrivilegeEscalation: false`), so that root holds nothing else.
fn as_container_with(namespace: &MountNamespace, caps: &[String]) -> Vec<String> {
    let list: String = caps.iter().map(|cap| format!(",+{cap}")).collect();
    let mut launcher = namespace.enter();
    launcher.extend([
        "setpriv".into(),
        "--reuid=0".into(),
        "--regid=0".into(),
        "--clear-groups".into(),
        format!("--inh-caps=-all{list}"),
        format!("--bounding-set=-all{list}"),
        "--no-new-privs".into(),
    ]);
    launcher
}

/// The bit of a capability (setpriv's name) in /proc/PID/status.
fn capability_bit(name: &str) -> u32 {
    match name {
        "net_admin" => 12,
        "net_raw" => 13,
        "sys_admin" => 21,
        "sys_resource" => 24,
        "perfmon" => 38,
        "bpf" => 39,
        other => panic!("capability_bit: add {other}"),
    }
}

/// The effective capability set a process started by `launcher` holds.
fn effective_capabilities(launcher: &[String]) -> u64 {
    let output = Command::new(&launcher[0])
        .args(&launcher[1..])
        .args(["cat", "/proc/self/status"])
        .output()
        .expect("the launcher runs cat");
    let status = String::from_utf8_lossy(&output.stdout);
    let hex = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .unwrap_or_else(|| panic!("CapEff in {status}"));
    u64::from_str_radix(hex.trim(), 16).expect("CapEff is hex")
}

/// Waits until `status --json`, run by the same launcher, shows every
/// backend healthy.
fn wait_healthy(launcher: &[String], run_dir: &Path, pin: &str, addrs: &[SocketAddr]) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut last = serde_json::Value::Null;
    while std::time::Instant::now() < deadline {
        let output = run_as(launcher, run_dir, &["status", "--json", "--pin-path", pin]);
        if let Ok(status) = serde_json::from_slice::<serde_json::Value>(&output.stdout) {
            let healthy = addrs.iter().all(|addr| {
                status["services"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|service| service["backends"].as_array().into_iter().flatten())
                    .any(|backend| {
                        backend["addr"] == addr.to_string() && backend["healthy"] == true
                    })
            });
            if healthy && status["daemon"]["running"] == true {
                return;
            }
            last = status;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("not healthy within 20 s: {last}");
}

fn run_as(launcher: &[String], run_dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(&launcher[0])
        .args(&launcher[1..])
        .arg(socklb_bin())
        .args(args)
        .env("SOCKLB_RUN_DIR", run_dir)
        .stdin(Stdio::null())
        .output()
        .expect("nsenter and setpriv (cargo xtask test installs util-linux)")
}

/// The init container's command from deploy/kubernetes/daemonset.yaml:
/// `/bin/sh -ec SCRIPT`.
fn init_container_command() -> Vec<String> {
    strings(&container(&daemonset_pod_spec(), "mount-bpffs")["command"])
}

/// socklb as the DaemonSet runs it: uid 0 holding exactly the capabilities
/// the manifest adds, on a node whose /sys/fs/bpf starts as `start` (in a
/// mount namespace of the test's own). It installs, redirects, answers the
/// readiness probe, restarts onto its pins and uninstalls; without any one
/// of the capabilities it refuses to start, naming the one that is missing.
fn least_privilege(start: BpffsStart) {
    require_root();
    let caps = daemonset_capabilities();
    let namespace = MountNamespace::new(start);
    let launcher = as_container_with(&namespace, &caps);
    let wanted: u64 = caps.iter().map(|cap| 1u64 << capability_bit(cap)).sum();
    assert_eq!(
        effective_capabilities(&launcher),
        wanted,
        "root in the container holds exactly {caps:?}"
    );
    let cgroup = Cgroup::new("leastpriv");
    let backends = [
        Backend::start("b0", "127.0.0.2"),
        Backend::start("b1", "127.0.0.3"),
    ];
    let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let run_dir = TempDir::new("leastpriv-run");
    let state_dir = TempDir::new("leastpriv-state");
    let pin_path = PathBuf::from("/sys/fs/bpf").join(unique_name("leastpriv"));
    let pin = pin_path.display().to_string();
    let mut args = service_args(
        &cgroup.path,
        &[vip],
        &addrs,
        &["--close-on-failure", "true"],
    );
    args.extend(["--state-dir".to_string(), state_dir.0.display().to_string()]);
    let run_dir_env = run_dir.0.display().to_string();
    let env = [("SOCKLB_RUN_DIR", run_dir_env.as_str())];
    let mut run_args = vec!["run", "--pin-path", &pin];
    run_args.extend(args.iter().map(String::as_str));

    match start {
        BpffsStart::Unmounted => {
            // Without CAP_SYS_ADMIN the daemon cannot mount bpffs itself:
            // it says so, and mounts nothing.
            let output = run_as(&launcher, &run_dir.0, &run_args);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_ne!(output.status.code(), Some(0), "runs without bpffs");
            assert!(
                stderr.contains("mounting bpffs on /sys/fs/bpf"),
                "names the missing mount: {stderr}"
            );
            assert!(namespace.bpffs_mounts().is_empty(), "nothing mounted");
            // The privileged init container mounts it, mode 0700; run
            // again, it leaves that mount alone.
            let command = init_container_command();
            let script = command.last().expect("the script");
            assert_eq!(command[..command.len() - 1], ["/bin/sh", "-ec"]);
            namespace.shell(script);
            let mounts = namespace.bpffs_mounts();
            assert_eq!(mounts.len(), 1, "{mounts:?}");
            assert!(mounts[0].contains("mode=700"), "{mounts:?}");
            namespace.shell(script);
            assert_eq!(namespace.bpffs_mounts(), mounts, "an existing mount stays");
        }
        BpffsStart::Mounted0700 => {
            // Without each capability in turn: refused before anything is
            // made, naming the one that is missing.
            for missing in &caps {
                let fewer: Vec<String> =
                    caps.iter().filter(|cap| *cap != missing).cloned().collect();
                let output = run_as(
                    &as_container_with(&namespace, &fewer),
                    &run_dir.0,
                    &run_args,
                );
                let stderr = String::from_utf8_lossy(&output.stderr);
                let name = format!("CAP_{}", missing.to_ascii_uppercase());
                assert_ne!(output.status.code(), Some(0), "without {name}");
                assert!(
                    stderr.contains(&format!("this process lacks {name})")),
                    "names {name}: {stderr}"
                );
                assert!(
                    !namespace.path(&pin_path).exists(),
                    "nothing pinned without {name}"
                );
            }
        }
    }

    // With exactly them: it installs, redirects, and the readiness probe of
    // the DaemonSet passes.
    let mut daemon = Daemon::start_launched("leastpriv", &args, pin_path.clone(), &launcher, &env);
    wait_healthy(&launcher, &run_dir.0, &pin, &addrs);
    let served = spread(&ClientRun::new(vip, Some(&cgroup.path), 40).run());
    assert!(!served.contains_key("error"), "{served:?}");
    assert!(
        served.contains_key("b0") && served.contains_key("b1"),
        "{served:?}"
    );
    let pins = std::fs::metadata(namespace.path(&pin_path)).expect("the pin directory");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&pins), 0);
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&pins.permissions()) & 0o777,
        0o700,
        "the pin directory is root's alone"
    );
    let readiness = run_as(
        &launcher,
        &run_dir.0,
        &["status", "--check", "--pin-path", &pin],
    );
    assert_eq!(
        readiness.status.code(),
        Some(0),
        "the readiness probe: {}",
        String::from_utf8_lossy(&readiness.stdout)
    );
    let status = run_as(
        &launcher,
        &run_dir.0,
        &["status", "--json", "--pin-path", &pin],
    );
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    assert_eq!(status["daemon_info"]["config_generation"], 1, "{status}");
    assert!(daemon.log_shows(
        "other socklb installs are looked for through their pins",
        Duration::from_secs(5)
    ));

    // A restart adopts the pins in place, still with only these.
    daemon.restart();
    wait_healthy(&launcher, &run_dir.0, &pin, &addrs);
    let served = spread(&ClientRun::new(vip, Some(&cgroup.path), 40).run());
    assert!(!served.contains_key("error"), "{served:?}");

    // And it uninstalls.
    let uninstall = run_as(
        &launcher,
        &run_dir.0,
        &["uninstall", "--force", "--pin-path", &pin],
    );
    assert!(
        uninstall.status.success(),
        "{}",
        String::from_utf8_lossy(&uninstall.stderr)
    );
    assert!(!namespace.path(&pin_path).exists(), "uninstalled");
    daemon.wait_exit(Duration::from_secs(10));
    record_figures(&format!(
        "least privilege ({start:?} bpffs at start): socklb run/status/uninstall as uid 0 holding exactly {} (the DaemonSet's and the unit's set); without each, refused naming it",
        caps.iter()
            .map(|cap| format!("CAP_{}", cap.to_ascii_uppercase()))
            .collect::<Vec<_>>()
            .join(" + ")
    ));
}

#[test]
fn socklb_runs_with_exactly_the_daemonsets_capabilities_on_a_0700_bpffs() {
    require_root!();
    least_privilege(BpffsStart::Mounted0700);
}

#[test]
fn without_bpffs_the_init_container_mounts_it_and_socklb_runs_with_exactly_its_capabilities() {
    require_root!();
    least_privilege(BpffsStart::Unmounted);
}

#[test]
fn the_daemon_tells_systemd_when_it_redirects() {
    require_root!();
    // The unit is Type=notify: a socket like systemd's NOTIFY_SOCKET.
    let dir = TempDir::new("notify");
    let socket_path = dir.0.join("notify");
    let socket = std::os::unix::net::UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let cgroup = Cgroup::new("notify");
    let backend = Backend::start("b0", "127.0.0.2");
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let args = service_args(&cgroup.path, &[vip], &[backend.addr], &[]);
    let pin_path = PathBuf::from("/sys/fs/bpf").join(unique_name("notify"));
    let notify = socket_path.display().to_string();
    let _daemon = Daemon::start_with("notify", &args, pin_path, &[("NOTIFY_SOCKET", &notify)]);
    let mut message = [0u8; 64];
    let size = socket.recv(&mut message).expect("READY=1 within 20 s");
    assert_eq!(&message[..size], b"READY=1");
    // Ready means redirecting.
    let served = spread(&ClientRun::new(vip, Some(&cgroup.path), 5).run());
    assert_eq!(served.get("b0"), Some(&5), "{served:?}");
}
