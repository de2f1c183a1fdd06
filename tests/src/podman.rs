//! Containers of a pod spec run under Debian's podman, the way a kubelet
//! would run them: [`container_args`] translates a container of the
//! manifest (args, env, security context, volume mounts, resources) into
//! `podman run` flags, and [`Container`] runs one under guard.
//!
//! Every field of the spec is either translated or named here as one the
//! runtime does not see (scheduling, the API identity); a field this does
//! not know fails the test, so the manifest cannot grow a setting that the
//! test silently leaves out.
//!
//! Two flags come from this machine, not from the spec: the runtime is
//! Debian's runc (crun refuses hybrid cgroup hosts), and the open-files and
//! process limits are given (root here lacks CAP_SYS_RESOURCE, so podman's
//! default limits cannot be set).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{manifest::strings, unique_name};

/// The OCI runtime of the tests.
pub const RUNTIME: &str = "/usr/sbin/runc";

/// The flags this machine needs whatever the spec says (see the module
/// documentation).
pub const MACHINE_FLAGS: [&str; 6] = [
    "--runtime",
    RUNTIME,
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
];

/// Pod fields that decide where a pod runs or who it is to the API, not
/// how its containers run: the test has one node and no apiserver.
const NOT_FOR_THE_RUNTIME: [&str; 5] = [
    "serviceAccountName",
    "affinity",
    "tolerations",
    "priorityClassName",
    "dnsPolicy",
];

/// Where the test keeps what a pod mounts from the node: each hostPath of
/// the manifest, and each ConfigMap's files.
#[derive(Debug, Default, Clone)]
pub struct NodePaths {
    host_paths: BTreeMap<String, PathBuf>,
    config_maps: BTreeMap<String, PathBuf>,
}

impl NodePaths {
    /// The manifest's `hostPath` `path` is `at` in the test.
    pub fn host_path(mut self, path: &str, at: &Path) -> Self {
        self.host_paths.insert(path.to_string(), at.to_path_buf());
        self
    }

    /// The ConfigMap `name` is the directory `dir` (its keys as files).
    pub fn config_map(mut self, name: &str, dir: &Path) -> Self {
        self.config_maps.insert(name.to_string(), dir.to_path_buf());
        self
    }
}

/// How the test sets the seccomp profile of `RuntimeDefault`.
#[derive(Debug, Clone)]
pub enum RuntimeDefault {
    /// podman's own default: Debian's containers-common profile.
    Podman,
    /// This profile file (see tests/tests/container.rs).
    Profile(PathBuf),
}

/// `podman run` flags for `container` of `pod` from `image`: everything but
/// `--name`, `--detach` and the image itself, which come first and last.
pub fn container_args(
    pod: &Value,
    container: &Value,
    node: &NodePaths,
    seccomp: &RuntimeDefault,
) -> (Vec<String>, Vec<String>) {
    check_known(
        pod,
        &[
            "hostNetwork",
            "terminationGracePeriodSeconds",
            "volumes",
            "initContainers",
            "containers",
        ],
        &NOT_FOR_THE_RUNTIME,
        "the pod spec",
    );
    check_known(
        container,
        &[
            "name",
            "image",
            "command",
            "args",
            "env",
            "securityContext",
            "volumeMounts",
            "resources",
        ],
        // Probes are run by the test with `podman exec` (`Probe`).
        &["readinessProbe", "livenessProbe"],
        "the container",
    );
    let mut flags: Vec<String> = MACHINE_FLAGS.map(String::from).to_vec();
    flags.push("--pull=never".into());
    if pod["hostNetwork"] == true {
        // The kubelet gives a host-network pod the node's UTS namespace too.
        flags.extend(["--network=host".into(), "--uts=host".into()]);
    }
    if let Some(seconds) = pod["terminationGracePeriodSeconds"].as_u64() {
        flags.push(format!("--stop-timeout={seconds}"));
    }
    for variable in container["env"].as_array().into_iter().flatten() {
        let value = variable["value"]
            .as_str()
            .unwrap_or_else(|| panic!("env {variable}: only values are translated"));
        flags.push(format!(
            "--env={}={value}",
            variable["name"].as_str().unwrap()
        ));
    }
    flags.extend(security_flags(&container["securityContext"], seccomp));
    flags.extend(resource_flags(&container["resources"]));
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        flags.push(volume_flag(pod, mount, node));
    }
    // `command` replaces the image's ENTRYPOINT (and podman then drops its
    // CMD, as Kubernetes does); `args` replace the CMD.
    let command = strings(&container["command"]);
    if !command.is_empty() {
        flags.push(format!(
            "--entrypoint={}",
            serde_json::to_string(&command).unwrap()
        ));
    }
    (flags, strings(&container["args"]))
}

/// Fails on a field that is neither translated nor known to be none of the
/// runtime's business.
fn check_known(object: &Value, translated: &[&str], not_runtime: &[&str], what: &str) {
    for key in object.as_object().into_iter().flatten().map(|(key, _)| key) {
        assert!(
            translated.contains(&key.as_str()) || not_runtime.contains(&key.as_str()),
            "{what} sets {key}, which tests/src/podman.rs does not translate: translate it"
        );
    }
}

/// The security context's flags.
fn security_flags(context: &Value, seccomp: &RuntimeDefault) -> Vec<String> {
    check_known(
        context,
        &[
            "runAsUser",
            "runAsGroup",
            "privileged",
            "allowPrivilegeEscalation",
            "readOnlyRootFilesystem",
            "capabilities",
            "seccompProfile",
            "appArmorProfile",
        ],
        &[],
        "securityContext",
    );
    let mut flags = Vec::new();
    if let Some(user) = context["runAsUser"].as_u64() {
        let group = context["runAsGroup"].as_u64().unwrap_or(user);
        flags.push(format!("--user={user}:{group}"));
    }
    if context["privileged"] == true {
        flags.push("--privileged".into());
    }
    if context["allowPrivilegeEscalation"] == false {
        flags.push("--security-opt=no-new-privileges".into());
    }
    if context["readOnlyRootFilesystem"] == true {
        // Kubernetes mounts no tmpfs of its own on /run or /tmp.
        flags.extend(["--read-only".into(), "--read-only-tmpfs=false".into()]);
    }
    for cap in strings(&context["capabilities"]["drop"]) {
        flags.push(format!("--cap-drop={}", capability(&cap)));
    }
    for cap in strings(&context["capabilities"]["add"]) {
        flags.push(format!("--cap-add={}", capability(&cap)));
    }
    match context["seccompProfile"]["type"].as_str() {
        Some("RuntimeDefault") => {
            if let RuntimeDefault::Profile(path) = seccomp {
                flags.push(format!("--security-opt=seccomp={}", path.display()));
            }
        }
        Some("Unconfined") => flags.push("--security-opt=seccomp=unconfined".into()),
        None => {}
        Some(other) => panic!("seccompProfile {other} is not translated"),
    }
    match context["appArmorProfile"]["type"].as_str() {
        Some("Unconfined") => flags.push("--security-opt=apparmor=unconfined".into()),
        Some("RuntimeDefault") | None => {}
        Some(other) => panic!("appArmorProfile {other} is not translated"),
    }
    flags
}

/// `BPF` → `CAP_BPF`; `ALL` stays.
fn capability(name: &str) -> String {
    if name == "ALL" {
        name.to_string()
    } else {
        format!("CAP_{name}")
    }
}

/// Requests and limits as the kubelet sets them: CPU requests become
/// shares (1024 a core), memory limits the cgroup's limit.
fn resource_flags(resources: &Value) -> Vec<String> {
    let mut flags = Vec::new();
    if let Some(cpu) = resources["requests"]["cpu"].as_str() {
        let millicores: u64 = cpu
            .strip_suffix('m')
            .map_or_else(|| cpu.parse::<u64>().map(|cores| cores * 1000), str::parse)
            .unwrap_or_else(|error| panic!("cpu request {cpu}: {error}"));
        flags.push(format!(
            "--cpu-shares={}",
            (millicores * 1024 / 1000).max(2)
        ));
    }
    if let Some(cpu) = resources["limits"]["cpu"].as_str() {
        panic!("limits.cpu {cpu} is not translated");
    }
    if let Some(memory) = resources["limits"]["memory"].as_str() {
        flags.push(format!("--memory={}", quantity_bytes(memory)));
    }
    // requests.memory only guides scheduling and eviction.
    flags
}

/// A Kubernetes quantity of bytes (`24Mi`, `1Gi`, `512`).
pub fn quantity_bytes(quantity: &str) -> u64 {
    let (number, unit) = quantity
        .find(|c: char| !c.is_ascii_digit())
        .map_or((quantity, ""), |at| quantity.split_at(at));
    let number: u64 = number
        .parse()
        .unwrap_or_else(|error| panic!("quantity {quantity}: {error}"));
    number
        * match unit {
            "" => 1,
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            other => panic!("quantity unit {other} is not translated"),
        }
}

/// `--volume=SOURCE:TARGET:OPTIONS` for a volume mount.
fn volume_flag(pod: &Value, mount: &Value, node: &NodePaths) -> String {
    let name = mount["name"].as_str().expect("a volume name");
    let volume = pod["volumes"]
        .as_array()
        .and_then(|volumes| volumes.iter().find(|volume| volume["name"] == name))
        .unwrap_or_else(|| panic!("no volume {name}"));
    let source = if let Some(path) = volume["hostPath"]["path"].as_str() {
        let at = node
            .host_paths
            .get(path)
            .unwrap_or_else(|| panic!("the test does not say where hostPath {path} is"));
        if volume["hostPath"]["type"] == "DirectoryOrCreate" {
            std::fs::create_dir_all(at).expect("a DirectoryOrCreate hostPath");
        }
        assert!(at.is_dir(), "hostPath {path} at {}", at.display());
        at.clone()
    } else if let Some(map) = volume["configMap"]["name"].as_str() {
        node.config_maps
            .get(map)
            .unwrap_or_else(|| panic!("the test does not hold ConfigMap {map}"))
            .clone()
    } else {
        panic!("volume {name}: only hostPath and configMap are translated")
    };
    // None (the default) is private; HostToContainer receives the node's
    // later mounts; Bidirectional also sends the container's back.
    let propagation = match mount["mountPropagation"].as_str() {
        None | Some("None") => "rprivate",
        Some("HostToContainer") => "rslave",
        Some("Bidirectional") => "rshared",
        Some(other) => panic!("mountPropagation {other}"),
    };
    let access = if mount["readOnly"] == true {
        "ro"
    } else {
        "rw"
    };
    format!(
        "--volume={}:{}:{access},{propagation}",
        source.display(),
        mount["mountPath"].as_str().expect("a mountPath")
    )
}

/// A probe's exec command and its timeout.
#[derive(Debug, Clone)]
pub struct Probe {
    pub command: Vec<String>,
    pub timeout: Duration,
}

impl Probe {
    /// `readinessProbe` or `livenessProbe` of a container.
    pub fn of(container: &Value, which: &str) -> Self {
        let probe = &container[which];
        let command = strings(&probe["exec"]["command"]);
        assert!(!command.is_empty(), "{which} is an exec probe");
        Self {
            command,
            // Kubernetes' default is 1 s.
            timeout: Duration::from_secs(probe["timeoutSeconds"].as_u64().unwrap_or(1)),
        }
    }
}

/// The outcome of one probe run.
#[derive(Debug)]
pub struct ProbeResult {
    pub exit_code: Option<i32>,
    pub took: Duration,
    pub output: String,
}

/// podman, run in a mount namespace given by its `nsenter` prefix (or in
/// the test's own when it is empty).
#[derive(Debug, Clone, Default)]
pub struct Podman {
    pub enter: Vec<String>,
}

impl Podman {
    pub fn command(&self) -> Command {
        let mut command = match self.enter.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg("podman");
                command
            }
            None => Command::new("podman"),
        };
        command.stdin(Stdio::null());
        command
    }

    /// Runs podman to completion.
    pub fn output(&self, args: &[&str]) -> Output {
        self.command()
            .args(args)
            .output()
            .unwrap_or_else(|error| panic!("podman (cargo xtask test-deploy installs it): {error}"))
    }

    /// Runs podman; panics with its output unless it succeeds.
    pub fn checked(&self, args: &[&str]) -> String {
        let output = self.output(args);
        assert!(
            output.status.success(),
            "podman {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }
}

/// A container the test made, removed (`podman rm --force`) on drop.
pub struct Container {
    pub name: String,
    pub podman: Podman,
}

impl Container {
    /// Starts `podman run --detach` of `container` of `pod`, from `image`.
    pub fn run(
        podman: &Podman,
        label: &str,
        image: &str,
        (flags, args): &(Vec<String>, Vec<String>),
    ) -> Self {
        let container = Self {
            name: unique_name(label),
            podman: podman.clone(),
        };
        let mut run: Vec<&str> = vec!["run", "--detach", "--name", &container.name];
        run.extend(flags.iter().map(String::as_str));
        run.push(image);
        run.extend(args.iter().map(String::as_str));
        container.podman.checked(&run);
        container
    }

    /// Runs to completion (`podman run` in the foreground): exit code and
    /// output. The container stays until drop, for its logs.
    pub fn run_to_end(
        podman: &Podman,
        label: &str,
        image: &str,
        (flags, args): &(Vec<String>, Vec<String>),
    ) -> (Self, Option<i32>, String) {
        let container = Self {
            name: unique_name(label),
            podman: podman.clone(),
        };
        let mut run: Vec<&str> = vec!["run", "--name", &container.name];
        run.extend(flags.iter().map(String::as_str));
        run.push(image);
        run.extend(args.iter().map(String::as_str));
        let output = container.podman.output(&run);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (container, output.status.code(), text)
    }

    /// `podman inspect --format TEMPLATE`.
    pub fn inspect(&self, template: &str) -> String {
        self.podman
            .checked(&["inspect", "--format", template, &self.name])
            .trim()
            .to_string()
    }

    /// The container's main process, as the host sees it (0 when stopped).
    pub fn host_pid(&self) -> u32 {
        self.inspect("{{.State.Pid}}").parse().expect("a PID")
    }

    /// The container's memory: (peak use, limit) in bytes, from its memory
    /// cgroup (v1 here, v2 on a unified host).
    pub fn memory(&self) -> (u64, u64) {
        let pid = self.host_pid();
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("its cgroups");
        let read = |path: PathBuf| -> u64 {
            std::fs::read_to_string(&path)
                .unwrap_or_else(|error| panic!("{}: {error}", path.display()))
                .trim()
                .parse()
                .unwrap_or(u64::MAX)
        };
        // Lines of /proc/PID/cgroup: ID:CONTROLLERS:PATH.
        let memory_v1 = cgroups.lines().find_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_id, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            (controllers == "memory").then_some(path)
        });
        if let Some(path) = memory_v1 {
            let dir = Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
            return (
                read(dir.join("memory.max_usage_in_bytes")),
                read(dir.join("memory.limit_in_bytes")),
            );
        }
        let path = cgroups
            .lines()
            .find_map(|line| line.strip_prefix("0::"))
            .expect("a cgroup v2 path");
        let dir = crate::cgroup_v2_root().join(path.trim_start_matches('/'));
        (read(dir.join("memory.peak")), read(dir.join("memory.max")))
    }

    /// Whether the container runs.
    pub fn running(&self) -> bool {
        self.inspect("{{.State.Running}}") == "true"
    }

    /// The container's output so far.
    pub fn logs(&self) -> String {
        let output = self.podman.output(&["logs", &self.name]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    }

    /// Runs a probe inside the container (`podman exec`), as the kubelet
    /// does.
    pub fn probe(&self, probe: &Probe) -> ProbeResult {
        let started = Instant::now();
        let mut exec: Vec<&str> = vec!["exec", &self.name];
        exec.extend(probe.command.iter().map(String::as_str));
        let output = self.podman.output(&exec);
        ProbeResult {
            exit_code: output.status.code(),
            took: started.elapsed(),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        }
    }

    /// `podman stop`: SIGTERM, then SIGKILL after the grace period the
    /// container was started with. Returns how long it took.
    pub fn stop(&self) -> Duration {
        let started = Instant::now();
        self.podman.checked(&["stop", &self.name]);
        started.elapsed()
    }

    /// `podman start` again (a kubelet's restart of the container).
    pub fn start(&self) {
        self.podman.checked(&["start", &self.name]);
    }

    /// Waits until the container has exited; its exit code.
    pub fn wait_exit(&self, limit: Duration) -> i32 {
        let started = Instant::now();
        while self.running() {
            assert!(
                started.elapsed() < limit,
                "{} still runs after {limit:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.inspect("{{.State.ExitCode}}")
            .parse()
            .expect("an exit code")
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("container {} log:\n{}", self.name, self.logs());
        }
        let _ = self
            .podman
            .output(&["rm", "--force", "--time", "0", &self.name]);
    }
}

/// An image the test built, removed on drop.
pub struct Image {
    pub name: String,
    podman: Podman,
}

impl Image {
    /// `podman build --no-cache` of a build context into a new image.
    pub fn build(podman: &Podman, label: &str, context: &Path) -> Self {
        let image = Self {
            name: format!("localhost/{}:latest", unique_name(label)),
            podman: podman.clone(),
        };
        let context = context.display().to_string();
        image.podman.checked(&[
            "build",
            "--quiet",
            "--pull=never",
            "--no-cache",
            "--tag",
            &image.name,
            &context,
        ]);
        image
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = self.podman.output(&["rmi", "--force", &self.name]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_and_shares_are_the_kubelets() {
        assert_eq!(quantity_bytes("128Mi"), 128 << 20);
        assert_eq!(quantity_bytes("1Gi"), 1 << 30);
        assert_eq!(quantity_bytes("512"), 512);
        let resources =
            serde_json::json!({"requests": {"cpu": "20m"}, "limits": {"memory": "32Mi"}});
        assert_eq!(
            resource_flags(&resources),
            ["--cpu-shares=20", &format!("--memory={}", 32 << 20)]
        );
        let tiny = serde_json::json!({"requests": {"cpu": "1m"}});
        assert_eq!(resource_flags(&tiny), ["--cpu-shares=2"]);
    }

    #[test]
    #[should_panic(expected = "does not translate")]
    fn an_unknown_security_setting_fails() {
        security_flags(
            &serde_json::json!({"procMount": "Unmasked"}),
            &RuntimeDefault::Podman,
        );
    }
}
