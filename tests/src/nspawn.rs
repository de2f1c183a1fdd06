//! A Debian root filesystem booted with systemd as PID 1 under
//! systemd-nspawn, for tests/tests/systemd.rs: [`BootedRoot`] boots it and
//! tears it down on drop (poweroff, then by PID), also when a test panics.
//!
//! The arrangement, and why:
//! - nspawn runs in the test's own mount namespace ([`MountNamespace`]),
//!   so the /sys/fs/bpf it binds into the container is a bpffs instance of
//!   the test's own, gone with it.
//! - nspawn starts in a child cgroup the test made (`--keep-unit`: this
//!   machine runs no systemd to ask for a scope), and with
//!   `SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1` the container gets a pure cgroup
//!   v2 tree in its own cgroup namespace, rooted at `<child>/payload`. On
//!   this hybrid host systemd inside would otherwise see cgroup v1. So the
//!   root of the v2 hierarchy that socklb attaches to by default, inside,
//!   is that child cgroup, never the machine's root.
//! - The container shares the host's network namespace (no
//!   `--private-network`), as a host service does, and gets CAP_BPF and
//!   CAP_NET_ADMIN on top of nspawn's default set, which has neither, and
//!   bpf(2), which nspawn's seccomp allow-list leaves out.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use crate::{Cgroup, MountNamespace, TempDir, unique_name};

/// The named cgroup v1 hierarchy that nspawn and systemd keep on a hybrid
/// host besides the unified one.
const SYSTEMD_V1_HIERARCHY: &str = "/sys/fs/cgroup/systemd";

/// A booted container (see the module documentation).
pub struct BootedRoot {
    pub machine: String,
    /// The root filesystem, a fresh copy of the cached one.
    pub root: TempDir,
    /// `<child>/payload`: the container's cgroup v2 root, as the host sees it.
    pub payload_cgroup: PathBuf,
    cgroup: PathBuf,
    cgroup_v1: Option<PathBuf>,
    nspawn: Child,
    leader: u32,
    console: PathBuf,
}

impl BootedRoot {
    /// Extracts `root_tar` and boots it under `cgroup` in `namespace`,
    /// with `binds` (host path, path inside, read-only) besides
    /// /sys/fs/bpf. Returns once `systemctl is-system-running --wait` has
    /// answered.
    pub fn boot(
        root_tar: &Path,
        namespace: &MountNamespace,
        cgroup: &Cgroup,
        binds: &[(&Path, &str, bool)],
    ) -> Self {
        let machine = unique_name("nspawn");
        let root = TempDir::new("nspawn-root");
        let untar = Command::new("tar")
            .arg("-C")
            .arg(&root.0)
            .arg("-xf")
            .arg(root_tar)
            .output()
            .expect("tar");
        assert!(
            untar.status.success(),
            "extracting {}: {}",
            root_tar.display(),
            String::from_utf8_lossy(&untar.stderr)
        );
        // nspawn keeps the named hierarchy in step with the unified one:
        // the same path under both.
        let cgroup_v1 = Path::new(SYSTEMD_V1_HIERARCHY).is_dir().then(|| {
            Path::new(SYSTEMD_V1_HIERARCHY).join(cgroup.path.file_name().expect("a child cgroup"))
        });
        if let Some(v1) = &cgroup_v1 {
            std::fs::create_dir(v1).unwrap_or_else(|error| panic!("{}: {error}", v1.display()));
        }
        let console = root.0.with_extension("console");
        let nspawn = spawn_nspawn(
            &machine,
            &root.0,
            namespace,
            &cgroup.path,
            cgroup_v1.as_deref(),
            binds,
            &console,
        );
        let mut booted = Self {
            machine,
            root,
            payload_cgroup: cgroup.path.join("payload"),
            cgroup: cgroup.path.clone(),
            cgroup_v1,
            nspawn,
            leader: 0,
            console,
        };
        booted.leader = booted.wait_for_leader();
        booted.wait_for_manager();
        let output = booted.exec("timeout 120 systemctl is-system-running --wait");
        let state = String::from_utf8_lossy(&output.stdout).trim().to_string();
        assert!(
            state == "running" || state == "degraded",
            "systemd in the container: {state} {}\n{}",
            String::from_utf8_lossy(&output.stderr),
            booted.console()
        );
        booted
    }

    /// The container's PID 1 (systemd), as the host sees it.
    fn wait_for_leader(&mut self) -> u32 {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.nspawn.try_wait() {
                panic!("systemd-nspawn exited ({status}):\n{}", self.console());
            }
            if let Some(pid) = systemd_child(self.nspawn.id()) {
                return pid;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "no systemd under systemd-nspawn within 30 s:\n{}",
                self.console()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until systemd inside listens on its private socket, which
    /// systemctl talks to (`is-system-running --wait` needs it to exist).
    fn wait_for_manager(&self) {
        let socket = PathBuf::from(format!("/proc/{}/root/run/systemd/private", self.leader));
        let started = Instant::now();
        while !socket.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "systemd in the container made no {} within 60 s:\n{}",
                socket.display(),
                self.console()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What nspawn and the container wrote to the console.
    pub fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    /// Runs a `sh -c` script inside the container, in all its namespaces,
    /// as root.
    pub fn exec(&self, script: &str) -> Output {
        Command::new("nsenter")
            .args(["--target", &self.leader.to_string(), "--all", "--"])
            .args(["/bin/sh", "-c", script])
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|error| panic!("nsenter (util-linux): {error}"))
    }

    /// Like `exec`, panicking with the output unless the script succeeds;
    /// its stdout.
    pub fn checked(&self, script: &str) -> String {
        let output = self.exec(script);
        assert!(
            output.status.success(),
            "{script} in the container ({}): {}{}\njournal:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            self.journal("socklb.service")
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// A path inside the container, from the host.
    pub fn path(&self, inside: &str) -> PathBuf {
        self.root.0.join(inside.trim_start_matches('/'))
    }

    /// The journal of `unit`, read from the host: `journalctl -D
    /// ROOT/var/log/journal -u UNIT`.
    pub fn journal(&self, unit: &str) -> String {
        let output = Command::new("journalctl")
            .arg("-D")
            .arg(self.path("/var/log/journal"))
            .args(["-u", unit, "--no-pager", "-o", "short-monotonic"])
            .output();
        output.map_or_else(
            |error| format!("journalctl: {error}"),
            |output| {
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                )
            },
        )
    }
}

/// Starts systemd-nspawn in `namespace`, from inside `cgroup` (and its
/// twin in the named v1 hierarchy), its console into `console`.
fn spawn_nspawn(
    machine: &str,
    root: &Path,
    namespace: &MountNamespace,
    cgroup: &Path,
    cgroup_v1: Option<&Path>,
    binds: &[(&Path, &str, bool)],
    console: &Path,
) -> Child {
    let mut join = format!("echo $$ > '{}/cgroup.procs'", cgroup.display());
    if let Some(v1) = cgroup_v1 {
        join.push_str(&format!(" && echo $$ > '{}/cgroup.procs'", v1.display()));
    }
    let mut nspawn: Vec<String> = vec![
        "systemd-nspawn".into(),
        "--quiet".into(),
        format!("--directory={}", root.display()),
        format!("--machine={machine}"),
        "--boot".into(),
        "--register=no".into(),
        "--keep-unit".into(),
        "--console=pipe".into(),
        "--capability=CAP_BPF,CAP_NET_ADMIN".into(),
        // nspawn's seccomp allow-list leaves bpf(2) out on purpose (bpffs
        // is not namespaced); without this every bpf(2) answers EPERM.
        "--system-call-filter=bpf".into(),
        "--bind=/sys/fs/bpf".into(),
    ];
    for (host, inside, read_only) in binds {
        let flag = if *read_only { "--bind-ro" } else { "--bind" };
        nspawn.push(format!("{flag}={}:{inside}", host.display()));
    }
    let script = format!("{join} && exec \"$@\"");
    let log = std::fs::File::create(console).expect("the console log");
    let enter = namespace.enter();
    Command::new(&enter[0])
        .args(&enter[1..])
        .args(["/bin/sh", "-c", &script, "nspawn"])
        .args(&nspawn)
        .env("SYSTEMD_NSPAWN_UNIFIED_HIERARCHY", "1")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("the console log"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|error| panic!("systemd-nspawn (systemd-container): {error}"))
}

/// The child of `parent` that runs systemd.
fn systemd_child(parent: u32) -> Option<u32> {
    let children =
        std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    children
        .split_whitespace()
        .filter_map(|pid| pid.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim() == "systemd")
        })
}

impl Drop for BootedRoot {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "container {} console:\n{}\nsocklb's journal:\n{}",
                self.machine,
                self.console(),
                self.journal("socklb.service")
            );
        }
        // SIGTERM asks systemd inside to power off; the PID is nspawn's,
        // which we started (nsenter and sh exec'd into it).
        // SAFETY: kill(2) on a child we own and have not reaped.
        unsafe { libc::kill(self.nspawn.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.nspawn.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.nspawn.kill();
        let _ = self.nspawn.wait();
        for tree in [Some(self.cgroup.clone()), self.cgroup_v1.clone()]
            .into_iter()
            .flatten()
        {
            remove_children(&tree);
        }
        if let Some(v1) = &self.cgroup_v1 {
            remove_cgroup(v1);
        }
        let _ = std::fs::remove_file(&self.console);
        let _ = std::fs::remove_dir(format!("/run/systemd/nspawn/propagate/{}", self.machine));
    }
}

/// Removes the cgroups under `tree`, deepest first (the container's
/// processes are gone by now; a v1 cgroup may stay busy a moment longer).
fn remove_children(tree: &Path) {
    let Ok(entries) = std::fs::read_dir(tree) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            remove_children(&entry.path());
            remove_cgroup(&entry.path());
        }
    }
}

fn remove_cgroup(path: &Path) {
    for _ in 0..100 {
        if std::fs::remove_dir(path).is_ok() || !path.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("warning: could not remove cgroup {}", path.display());
}
