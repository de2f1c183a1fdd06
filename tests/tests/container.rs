//! The DaemonSet's pod run for real: the image `cargo xtask image` built,
//! under Debian's podman with runc, with exactly the container spec of
//! deploy/kubernetes/daemonset.yaml translated by code
//! (socklb_tests::podman), the ConfigMap's file, and the cleanup manifest
//! deploy/kubernetes/uninstall/uninstall.yaml.
//!
//! What the test changes, and only that:
//! - the image is `localhost/socklb:dev` (`$SOCKLB_IMAGE`), not the
//!   registry's;
//! - each hostPath is where the test keeps it: /sys/fs/bpf is the test's
//!   own bpffs (podman runs in a mount namespace of the test's own, whose
//!   mounts are shared like a systemd host's), and the cgroup volume
//!   (`/sys/fs/cgroup`, on this hybrid host the v2 root
//!   /sys/fs/cgroup/unified, as the manifest's comment says) is a child
//!   cgroup the test created, NEVER the machine's root: the container's
//!   `--cgroup=/host/sys/fs/cgroup` then names that child. The run and
//!   state directories and the k3s agent's directory are temporary ones;
//! - RuntimeDefault seccomp is the profile that containerd 1.7+ and
//!   containers-common 0.60+ (CRI-O 1.31+) ship: Debian 12's podman
//!   profile (containers-common 0.50) with their one change, bpf(2)
//!   allowed to CAP_BPF. Debian's own profile refuses bpf(2) without
//!   CAP_SYS_ADMIN, and a test shows how socklb says so;
//! - the runtime flags this machine needs (runc, rlimits; see
//!   socklb_tests::podman).
//!
//! There is no apiserver: the EndpointSlice source reports that it has no
//! credentials, and the servers come from the k3s state file, which is
//! what an agent's socklb starts from too.
//!
//! Needs `cargo xtask test-deploy` (image, podman, runc, SOCKLB_PYTHON).

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use serde_json::Value;
use socklb_tests::{
    BpffsStart, Cgroup, MountNamespace, TempDir,
    cluster::{AgentRun, served},
    manifest::{self, configmap_file, daemonset_pod_spec, strings},
    node::{DialingAgent, LoopbackApiserver, failures},
    podman::{
        Container, Image, NodePaths, Podman, Probe, RuntimeDefault, container_args, quantity_bytes,
    },
    record_figures, require_root,
};

/// The image under test.
fn image() -> String {
    let image = std::env::var("SOCKLB_IMAGE").unwrap_or_else(|_| {
        panic!("SOCKLB_IMAGE is not set: run `cargo xtask test-deploy` (it builds the image)")
    });
    assert!(
        Podman::default()
            .output(&["image", "exists", &image])
            .status
            .success(),
        "{image} is not in podman's storage: run `cargo xtask image`"
    );
    image
}

/// The first quoted string on the line of `key` in the ConfigMap's TOML
/// (its first service's).
fn configmap_setting(key: &str) -> String {
    let toml = configmap_file("socklb.toml");
    let line = toml
        .lines()
        .find(|line| line.trim_start().starts_with(key))
        .unwrap_or_else(|| panic!("the ConfigMap sets {key}"));
    line.split('"').nth(1).expect("a quoted value").to_string()
}

/// The VIP of the ConfigMap's first service.
fn configmap_vip() -> SocketAddr {
    configmap_setting("vips").parse().expect("a VIP")
}

/// The ConfigMap's k3s state file path.
fn configmap_k3s_state() -> PathBuf {
    PathBuf::from(configmap_setting("k3s-state"))
}

/// RuntimeDefault as containerd 1.7+ and containers-common 0.60+ have it:
/// Debian's profile, with bpf(2) split out of the CAP_SYS_ADMIN rules and
/// allowed to CAP_BPF.
fn runtime_default_allowing_bpf(dir: &Path) -> PathBuf {
    let debian = "/usr/share/containers/seccomp.json";
    let mut profile: Value = serde_json::from_str(
        &std::fs::read_to_string(debian).unwrap_or_else(|error| panic!("{debian}: {error}")),
    )
    .expect("a seccomp profile");
    let syscalls = profile["syscalls"].as_array_mut().expect("syscalls");
    // Debian's: bpf among the calls allowed to CAP_SYS_ADMIN and refused
    // (EPERM) to everyone else.
    let mut rules_naming_bpf = 0;
    for rule in syscalls.iter_mut() {
        let names = rule["names"].as_array_mut().expect("names");
        if names.iter().any(|name| name == "bpf") {
            names.retain(|name| name != "bpf");
            rules_naming_bpf += 1;
        }
    }
    assert_eq!(
        rules_naming_bpf, 2,
        "{debian} changed its bpf rules: look again"
    );
    syscalls.push(serde_json::json!({
        "names": ["bpf"], "action": "SCMP_ACT_ALLOW", "args": [],
        "includes": {"caps": ["CAP_SYS_ADMIN"]}, "excludes": {}
    }));
    syscalls.push(serde_json::json!({
        "names": ["bpf"], "action": "SCMP_ACT_ALLOW", "args": [],
        "includes": {"caps": ["CAP_BPF"]}, "excludes": {}
    }));
    syscalls.push(serde_json::json!({
        "names": ["bpf"], "action": "SCMP_ACT_ERRNO", "args": [], "errnoRet": 1,
        "includes": {}, "excludes": {"caps": ["CAP_SYS_ADMIN", "CAP_BPF"]}
    }));
    let path = dir.join("seccomp.json");
    std::fs::write(&path, serde_json::to_string_pretty(&profile).unwrap()).unwrap();
    path
}

/// A node for the DaemonSet's pod: the test's mount namespace, the child
/// cgroup that stands for the node's cgroup root, two apiservers named in
/// the k3s agent's state file, and the ConfigMap's file.
struct TestNode {
    namespace: MountNamespace,
    podman: Podman,
    cgroup: Cgroup,
    vip: SocketAddr,
    servers: Vec<LoopbackApiserver>,
    paths: NodePaths,
    _dirs: Vec<TempDir>,
}

impl TestNode {
    fn new(start: BpffsStart) -> Self {
        let namespace = MountNamespace::new(start);
        // As on a systemd host: the node's mounts are shared, which
        // Bidirectional and HostToContainer need.
        namespace.shell("mount --make-rshared /");
        let podman = Podman {
            enter: namespace.enter(),
        };
        let cgroup = Cgroup::new("pod");
        let servers = vec![
            LoopbackApiserver::start("server-0", "127.0.0.2"),
            LoopbackApiserver::start("server-1", "127.0.0.3"),
        ];
        let (run, state, k3s, config) = (
            TempDir::new("pod-run"),
            TempDir::new("pod-state"),
            TempDir::new("pod-k3s"),
            TempDir::new("pod-config"),
        );
        let addresses: Vec<String> = servers.iter().map(|s| s.addr.to_string()).collect();
        let state_file = configmap_k3s_state();
        std::fs::write(
            k3s.0.join(state_file.file_name().expect("a file name")),
            serde_json::json!({
                "ServerURL": format!("https://{}", addresses[0]),
                "ServerAddresses": addresses,
            })
            .to_string(),
        )
        .unwrap();
        std::fs::write(config.0.join("socklb.toml"), configmap_file("socklb.toml")).unwrap();
        let paths = NodePaths::default()
            .host_path("/sys/fs/bpf", Path::new("/sys/fs/bpf"))
            .host_path("/sys/fs/cgroup", &cgroup.path)
            .host_path("/run/socklb", &run.0)
            .host_path("/var/lib/socklb", &state.0)
            .host_path(
                state_file.parent().expect("a directory").to_str().unwrap(),
                &k3s.0,
            )
            .config_map("socklb", &config.0);
        Self {
            namespace,
            podman,
            cgroup,
            vip: configmap_vip(),
            servers,
            paths,
            _dirs: vec![run, state, k3s, config],
        }
    }

    /// `podman run` flags of a container of the pod.
    fn flags(
        &self,
        pod: &Value,
        name: &str,
        seccomp: &RuntimeDefault,
    ) -> (Vec<String>, Vec<String>) {
        container_args(pod, &manifest::container(pod, name), &self.paths, seccomp)
    }

    /// The node's pin directory, from the test.
    fn pins(&self) -> PathBuf {
        self.namespace.path(Path::new("/sys/fs/bpf/socklb"))
    }

    /// Requests through the VIP from a process in the node's cgroup.
    fn requests(&self, count: u32) -> std::collections::BTreeMap<String, usize> {
        let run = AgentRun {
            vip: self.vip,
            cgroup: self.cgroup.path.clone(),
            path: "/readyz",
            requests: count,
            interval_ms: 0,
            timeout_ms: 2000,
            retries: 0,
        };
        served(&socklb_tests::cluster::finish_all(run.spawn(1)))
    }

    /// Asserts that every request went to one of the servers.
    fn assert_redirected(&self, what: &str) {
        let served = self.requests(20);
        let by_servers: usize = self
            .servers
            .iter()
            .map(|server| served.get(&server.name).copied().unwrap_or(0))
            .sum();
        assert_eq!(by_servers, 20, "{what}: {served:?}");
    }
}

/// Runs `probe` until it exits with `code` (the kubelet probes every
/// period; the test as often as it can), at most `limit`; each run must
/// answer within the probe's timeoutSeconds. Returns the last run's time.
fn wait_probe(container: &Container, probe: &Probe, code: i32, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let result = container.probe(probe);
        assert!(
            result.took < probe.timeout,
            "{:?} took {:?}, over its timeout {:?}",
            probe.command,
            result.took,
            probe.timeout
        );
        if result.exit_code == Some(code) {
            return result.took;
        }
        assert!(
            started.elapsed() < limit,
            "{:?} did not exit {code} within {limit:?}: last {:?} {}",
            probe.command,
            result.exit_code,
            result.output
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The init container from the manifest, run as the kubelet runs it before
/// the pod's containers.
fn run_init_container(node: &TestNode, pod: &Value) {
    let flags = node.flags(pod, "mount-bpffs", &RuntimeDefault::Podman);
    let (_container, code, output) =
        Container::run_to_end(&node.podman, "mount-bpffs", &image(), &flags);
    assert_eq!(code, Some(0), "the init container: {output}");
}

#[test]
fn the_image_has_the_dockerfiles_paths_entrypoint_and_user() {
    require_root!();
    let image = image();
    let podman = Podman::default();
    let config: Value = serde_json::from_str(&podman.checked(&[
        "image",
        "inspect",
        "--format",
        "{{json .Config}}",
        &image,
    ]))
    .expect("the image config");
    let dockerfile = std::fs::read_to_string(manifest::repo().join("Dockerfile")).unwrap();
    let final_stage = dockerfile.rsplit_once("\nFROM ").expect("a final stage").1;
    let instruction = |keyword: &str| -> Option<Value> {
        final_stage
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{keyword} ")))
            .map(|value| serde_json::from_str(value).unwrap_or(Value::String(value.to_string())))
    };
    assert_eq!(config["Entrypoint"], instruction("ENTRYPOINT").unwrap());
    assert_eq!(config["Cmd"], instruction("CMD").unwrap());
    // No USER in the Dockerfile: root, as in the image the manifest runs.
    assert_eq!(instruction("USER"), None);
    assert!(config["User"].as_str().unwrap_or("").is_empty(), "{config}");
    // The binary where the Dockerfile copies it; bpftool, and the shell,
    // stat and mount of the init container's script.
    let (_container, code, output) = Container::run_to_end(
        &podman,
        "image-paths",
        &image,
        &(
            socklb_tests::podman::MACHINE_FLAGS
                .iter()
                .map(|flag| flag.to_string())
                .chain(["--entrypoint=/bin/sh".to_string()])
                .collect(),
            vec![
                "-ec".into(),
                "socklb --version; bpftool version | head -1; for tool in stat mount sleep; do command -v $tool; done".into(),
            ],
        ),
    );
    assert_eq!(code, Some(0), "{output}");
    for expected in ["socklb ", "bpftool v", "/usr/bin/stat", "/usr/bin/mount"] {
        assert!(output.contains(expected), "{expected} in {output}");
    }
    let size: u64 = podman
        .checked(&["image", "inspect", "--format", "{{.Size}}", &image])
        .trim()
        .parse()
        .unwrap();
    record_figures(&format!(
        "image {image}: {} MB (podman's size, uncompressed), entrypoint {} and cmd {} as in the Dockerfile",
        size / 1_000_000,
        config["Entrypoint"],
        config["Cmd"]
    ));
}

#[test]
fn the_init_container_leaves_an_existing_bpffs_alone() {
    require_root!();
    let node = TestNode::new(BpffsStart::Mounted0700);
    let before = node.namespace.bpffs_mounts();
    run_init_container(&node, &daemonset_pod_spec());
    assert_eq!(node.namespace.bpffs_mounts(), before);
}

#[test]
fn debians_own_runtime_default_profile_refuses_bpf_and_socklb_says_so() {
    require_root!();
    let node = TestNode::new(BpffsStart::Mounted0700);
    let pod = daemonset_pod_spec();
    let flags = node.flags(&pod, "socklb", &RuntimeDefault::Podman);
    let (_container, code, output) = Container::run_to_end(&node.podman, "pod", &image(), &flags);
    assert_ne!(code, Some(0), "{output}");
    // bpf(2) answers EPERM from the seccomp filter, before the kernel
    // looks at the capabilities.
    assert!(
        output.contains("Operation not permitted") || output.contains("EPERM"),
        "{output}"
    );
    assert!(!node.pins().exists(), "nothing pinned");
    record_figures(&format!(
        "container: Debian 12's RuntimeDefault seccomp (containers-common 0.50) refuses bpf(2) to CAP_BPF; socklb exits {}: {}",
        code.map_or("by a signal".to_string(), |code| code.to_string()),
        output.lines().last().unwrap_or_default()
    ));
}

#[test]
fn the_daemonsets_pod_redirects_survives_its_daemon_and_rolls_over() {
    require_root!();
    let started = Instant::now();
    let image = image();
    let pod = daemonset_pod_spec();
    let node = TestNode::new(BpffsStart::Unmounted);
    let profile_dir = TempDir::new("seccomp");
    let seccomp = RuntimeDefault::Profile(runtime_default_allowing_bpf(&profile_dir.0));

    // The pod starts: its init container mounts bpffs, as on a node that
    // booted without it.
    run_init_container(&node, &pod);
    let mounts = node.namespace.bpffs_mounts();
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert!(mounts[0].contains("mode=700"), "{mounts:?}");

    let socklb = manifest::container(&pod, "socklb");
    let (readiness, liveness) = (
        Probe::of(&socklb, "readinessProbe"),
        Probe::of(&socklb, "livenessProbe"),
    );
    let flags = node.flags(&pod, "socklb", &seccomp);
    let container = Container::run(&node.podman, "pod", &image, &flags);
    let ready_in = Instant::now();
    wait_probe(&container, &readiness, 0, Duration::from_secs(60));
    let ready_in = ready_in.elapsed();
    node.assert_redirected("the pod runs");
    wait_probe(&container, &liveness, 0, Duration::from_secs(5));
    let pins = std::fs::metadata(node.pins()).expect("the pin directory");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&pins.permissions()) & 0o777,
        0o700,
        "the pin directory is root's alone"
    );

    let probes = probes_follow_the_daemon(&node, &container, &readiness, &liveness);
    let rollover = rolling_update(&node, &pod, &container, &seccomp, &readiness);
    uninstall_with_the_cleanup_manifest(&node, &rollover.new_container, &seccomp);
    record_figures(&format!(
        "container (podman 4.3 + runc, the DaemonSet's spec): ready {:.1} s after `podman run`; {probes}; {}; whole test {:.0} s",
        ready_in.as_secs_f64(),
        rollover.summary,
        started.elapsed().as_secs_f64()
    ));
}

/// With the daemon frozen (SIGSTOP: its heartbeat stops) the readiness
/// probe exits 3 and the liveness probe fails, while clients are still
/// redirected; killed, the container exits and the data plane redirects;
/// started again (the kubelet's restart), it adopts the pins. An agent
/// dials every 5 ms throughout.
fn probes_follow_the_daemon(
    node: &TestNode,
    container: &Container,
    readiness: &Probe,
    liveness: &Probe,
) -> String {
    let agent = DialingAgent::start(node.vip, &node.cgroup.path, Duration::from_millis(5));
    agent.wait_for_more(20, Duration::from_secs(20));
    let pid = container.host_pid();
    // SAFETY: kill(2) on the container's main process, which the test's
    // podman started; the container runs, so the PID is socklb.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    let not_ready = Instant::now();
    wait_probe(container, readiness, 3, Duration::from_secs(20));
    let not_ready = not_ready.elapsed();
    let alive = container.probe(liveness);
    assert_eq!(alive.exit_code, Some(1), "liveness: {}", alive.output);
    node.assert_redirected("the daemon is frozen");
    // SAFETY: as above; SIGKILL ends it even while stopped.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(container.wait_exit(Duration::from_secs(10)), 137);
    node.assert_redirected("the daemon is dead");
    container.start();
    wait_probe(container, readiness, 0, Duration::from_secs(60));
    wait_probe(container, liveness, 0, Duration::from_secs(5));
    agent.wait_for_more(20, Duration::from_secs(20));
    let (requests, dialed) = agent.stop();
    assert!(failures(&requests).is_empty(), "{:?}", failures(&requests));
    format!(
        "frozen daemon: readiness exit 3 and liveness failing {:.1} s after SIGSTOP; SIGKILL and `podman start`: {} requests, each 5 ms after the last, over {:.1} s, 0 failed",
        not_ready.as_secs_f64(),
        requests.len(),
        dialed.as_secs_f64()
    )
}

struct Rollover {
    new_container: Container,
    _image: Image,
    summary: String,
}

/// The rolling update of one node: `podman stop` (SIGTERM, within the
/// grace period) leaves the data plane redirecting; a container of a
/// rebuilt image adopts the pins; an agent dials every 5 ms throughout.
fn rolling_update(
    node: &TestNode,
    pod: &Value,
    old: &Container,
    seccomp: &RuntimeDefault,
    readiness: &Probe,
) -> Rollover {
    let context = PathBuf::from(std::env::var("SOCKLB_IMAGE_CONTEXT").unwrap_or_else(|_| {
        panic!("SOCKLB_IMAGE_CONTEXT is not set: run `cargo xtask test-deploy`")
    }));
    let rebuilt = Image::build(&Podman::default(), "rebuilt", &context);
    let ids: Vec<String> = [image(), rebuilt.name.clone()]
        .iter()
        .map(|name| {
            Podman::default()
                .checked(&["image", "inspect", "--format", "{{.Id}}", name])
                .trim()
                .to_string()
        })
        .collect();
    assert_ne!(ids[0], ids[1], "the rebuilt image is another image");
    let grace = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap());

    let (peak, limit) = old.memory();
    let manifest_limit = manifest::container(pod, "socklb")["resources"]["limits"]["memory"]
        .as_str()
        .map(quantity_bytes);
    assert_eq!(
        Some(limit),
        manifest_limit,
        "the manifest's memory limit is in force"
    );
    let agent = DialingAgent::start(node.vip, &node.cgroup.path, Duration::from_millis(5));
    agent.wait_for_more(20, Duration::from_secs(20));
    let stopped_in = old.stop();
    assert!(stopped_in < grace, "podman stop took {stopped_in:?}");
    assert_eq!(old.inspect("{{.State.ExitCode}}"), "0", "exits on SIGTERM");
    node.assert_redirected("the old pod is gone");
    agent.wait_for_more(20, Duration::from_secs(20));
    let flags = node.flags(pod, "socklb", seccomp);
    let new_container = Container::run(&node.podman, "pod-rebuilt", &rebuilt.name, &flags);
    wait_probe(&new_container, readiness, 0, Duration::from_secs(60));
    agent.wait_for_more(20, Duration::from_secs(20));
    let (requests, dialed) = agent.stop();
    assert!(failures(&requests).is_empty(), "{:?}", failures(&requests));
    let log = new_container.logs();
    assert!(
        log.contains("adopted the pinned data plane"),
        "the new pod adopts the pins: {log}"
    );
    Rollover {
        new_container,
        _image: rebuilt,
        summary: format!(
            "peak memory {:.1} MiB (limit {} MiB); `podman stop` {:.1} s (grace {} s), exit 0; rolling update to a rebuilt image: {} requests, each 5 ms after the last, over {:.1} s, 0 failed",
            peak as f64 / f64::from(1 << 20),
            limit >> 20,
            stopped_in.as_secs_f64(),
            grace.as_secs(),
            requests.len(),
            dialed.as_secs_f64()
        ),
    }
}

/// The cleanup manifest's init container, run as its YAML says: refused
/// while the daemon runs, then it removes every pin and the VIP is no
/// longer redirected.
fn uninstall_with_the_cleanup_manifest(
    node: &TestNode,
    daemon: &Container,
    seccomp: &RuntimeDefault,
) {
    let cleanup = manifest::pod_spec(&manifest::object(
        &manifest::uninstall_path(),
        "DaemonSet",
        "socklb-uninstall",
    ));
    let uninstall = node.flags(&cleanup, "uninstall", seccomp);
    assert_eq!(
        uninstall.1,
        ["uninstall", "--pin-path=/sys/fs/bpf/socklb"],
        "the command the README names"
    );
    let (_refused, code, output) =
        Container::run_to_end(&node.podman, "uninstall", &image(), &uninstall);
    assert_eq!(code, Some(1), "refused while the daemon runs: {output}");
    assert!(output.contains("stop it first"), "{output}");
    assert!(node.pins().exists());
    node.assert_redirected("uninstall refused");

    // The socklb DaemonSet is deleted: its pod stops.
    daemon.stop();
    let (_done, code, output) =
        Container::run_to_end(&node.podman, "uninstall", &image(), &uninstall);
    assert_eq!(code, Some(0), "{output}");
    assert!(output.contains("removed /sys/fs/bpf/socklb/"), "{output}");
    assert!(!node.pins().exists(), "every pin is gone: {output}");
    let served = node.requests(5);
    assert!(
        node.servers
            .iter()
            .all(|server| !served.contains_key(&server.name)),
        "no longer redirected: {served:?}"
    );
    // The pod's other container only waits, holding nothing.
    let done = Container::run(
        &node.podman,
        "uninstall-done",
        &image(),
        &node.flags(&cleanup, "done", seccomp),
    );
    assert!(done.running(), "{}", done.logs());
    assert_eq!(
        strings(&manifest::container(&cleanup, "done")["command"]),
        ["sleep", "infinity"]
    );
}
