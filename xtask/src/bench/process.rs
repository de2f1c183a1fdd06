//! Processes the benchmark starts, under guard. Each one is stopped by the
//! PID we started, and its children by theirs, when its guard drops, also
//! on an error or a panic. Every run of a client is bounded in time.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

/// How long a server gets to exit on SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(3);

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_interrupt(_signal: libc::c_int) {
    // An atomic store is all a signal handler may safely do here.
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Turns Ctrl-C and SIGTERM into an error at the next check, so that the
/// guards run instead of the process dying with its servers and cgroups
/// left behind.
pub fn install_interrupt_handler() {
    let handler = note_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// Fails once the user has asked the benchmark to stop.
pub fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted; stopping every process and removing what the benchmark created");
    }
    Ok(())
}

/// A scratch directory, removed with its contents on drop.
pub struct ScratchDir {
    pub path: PathBuf,
}

impl ScratchDir {
    pub fn new() -> Result<Self> {
        let path = std::env::temp_dir().join(format!("socklb-bench-{}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        // nginx workers run as nobody and must read the served file.
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
        Ok(Self { path })
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// A process and the moment it started, so that a recycled PID is never
/// mistaken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcessId {
    pid: i32,
    start_ticks: u64,
}

impl ProcessId {
    fn is_alive(self) -> bool {
        proc_stat(self.pid).is_some_and(|stat| stat.start_ticks == self.start_ticks)
    }
}

/// The fields of /proc/PID/stat the benchmark reads.
#[derive(Debug, Clone, Copy)]
struct ProcStat {
    parent: i32,
    cpu_ticks: u64,
    start_ticks: u64,
}

fn proc_stat(pid: i32) -> Option<ProcStat> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces; the numeric
    // fields follow the last ')', starting with field 3 (state).
    let (_, rest) = text.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |number: usize| -> Option<u64> { fields.get(number - 3)?.parse().ok() };
    Some(ProcStat {
        parent: i32::try_from(field(4)?).ok()?,
        cpu_ticks: field(14)? + field(15)?,
        start_ticks: field(22)?,
    })
}

/// User plus system CPU time of a process (all its threads), in seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    let ticks = proc_stat(pid as i32).map_or(0, |stat| stat.cpu_ticks);
    ticks as f64 / clock_ticks_per_second()
}

pub fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as f64 } else { 100.0 }
}

/// Threads moved onto one CPU; their previous CPU sets are restored on
/// drop.
pub struct PinnedToCpu {
    saved: Vec<(i32, libc::cpu_set_t)>,
}

impl PinnedToCpu {
    pub fn pin(threads: &[i32], cpu: usize) -> Result<Self> {
        let mut pinned = Self { saved: Vec::new() };
        // SAFETY: cpu_set_t is plain data; CPU_ZERO and CPU_SET write
        // within it.
        let mut one_cpu: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        unsafe {
            libc::CPU_ZERO(&mut one_cpu);
            libc::CPU_SET(cpu, &mut one_cpu);
        }
        let size = std::mem::size_of::<libc::cpu_set_t>();
        for &thread in threads {
            // SAFETY: as above.
            let mut previous: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: both sets are valid for `size` bytes; a thread that
            // exited in between makes the call fail, which is skipped.
            if unsafe { libc::sched_getaffinity(thread, size, &mut previous) } != 0 {
                continue;
            }
            if unsafe { libc::sched_setaffinity(thread, size, &one_cpu) } != 0 {
                let error = std::io::Error::last_os_error();
                if error.raw_os_error() == Some(libc::ESRCH) {
                    continue;
                }
                bail!("pinning thread {thread} to CPU {cpu}: {error}");
            }
            pinned.saved.push((thread, previous));
        }
        Ok(pinned)
    }
}

impl Drop for PinnedToCpu {
    fn drop(&mut self) {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        for (thread, previous) in &self.saved {
            // SAFETY: a valid set of `size` bytes; failure (the thread is
            // gone) leaves nothing to restore.
            unsafe { libc::sched_setaffinity(*thread, size, previous) };
        }
    }
}

/// A field of /proc/PID/status in KiB, such as VmRSS.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
}

/// Every process whose parent is `pid`, and theirs, recursively.
fn descendants_of(pid: i32) -> Vec<ProcessId> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let table: Vec<(i32, ProcStat)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, proc_stat(pid)?)))
        .collect();
    let mut found = Vec::new();
    let mut parents = vec![pid];
    while let Some(parent) = parents.pop() {
        for (child, stat) in &table {
            if stat.parent == parent && found.len() < 1024 {
                found.push(ProcessId {
                    pid: *child,
                    start_ticks: stat.start_ticks,
                });
                parents.push(*child);
            }
        }
    }
    found
}

/// A long-running server (nginx, HAProxy, sockperf, iperf3), stopped on drop.
pub struct Supervised {
    pub name: String,
    child: Child,
    log: PathBuf,
    /// Children seen while it ran (nginx's workers), killed if they outlive
    /// their parent.
    known_children: Vec<ProcessId>,
}

impl Supervised {
    /// Starts `command` with its output in `log`.
    pub fn spawn(name: &str, command: &mut Command, log: &Path) -> Result<Self> {
        let file = fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {name}: {command:?}"))?;
        Ok(Self {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
            known_children: Vec::new(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails with the end of its log if the process has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!(
                "{} exited ({status}); its log {} ends with:\n{}",
                self.name,
                self.log.display(),
                log_tail(&self.log)
            );
        }
        Ok(())
    }

    /// Remembers the children it has now, so that they are stopped too.
    pub fn note_children(&mut self) {
        for child in descendants_of(self.pid() as i32) {
            if !self.known_children.contains(&child) {
                self.known_children.push(child);
            }
        }
    }

    /// CPU seconds of the process and of all its children (nginx's workers).
    pub fn cpu_seconds_with_children(&self) -> f64 {
        let own = cpu_seconds(self.pid());
        let children: f64 = descendants_of(self.pid() as i32)
            .iter()
            .map(|child| cpu_seconds(child.pid as u32))
            .sum();
        own + children
    }

    /// Every thread of the process and of its children.
    pub fn threads(&self) -> Vec<i32> {
        let mut pids = vec![self.pid() as i32];
        pids.extend(
            descendants_of(self.pid() as i32)
                .iter()
                .map(|child| child.pid),
        );
        pids.iter()
            .flat_map(|pid| {
                fs::read_dir(format!("/proc/{pid}/task"))
                    .into_iter()
                    .flatten()
                    .filter_map(Result::ok)
                    .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
            })
            .collect()
    }

    fn stop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.note_children();
            // SAFETY: kill on the PID of a child we own and have not reaped.
            unsafe { libc::kill(self.pid() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + STOP_GRACE;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        for child in &self.known_children {
            if child.is_alive() {
                // SAFETY: the PID still names the process we saw (same start
                // time), a child of a server we started.
                unsafe { libc::kill(child.pid, libc::SIGKILL) };
            }
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The last lines of a log file.
pub fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// What a bounded run printed.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

static RUN_NUMBER: AtomicU64 = AtomicU64::new(0);

/// Runs a client to completion, killing it (by its PID) after `limit`.
/// Its output goes through files in `scratch`, so that a chatty client can
/// never block on a full pipe.
pub fn run_bounded(command: &mut Command, limit: Duration, scratch: &Path) -> Result<Finished> {
    let number = RUN_NUMBER.fetch_add(1, Ordering::Relaxed);
    let stdout_path = scratch.join(format!("run-{number}.out"));
    let stderr_path = scratch.join(format!("run-{number}.err"));
    let shown = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(fs::File::create(&stdout_path)?)
        .stderr(fs::File::create(&stderr_path)?)
        .spawn()
        .with_context(|| format!("starting {shown}"))?;
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline || check_interrupted().is_err() {
            let _ = child.kill();
            let _ = child.wait();
            check_interrupted()?;
            bail!("{shown} did not finish within {limit:?}; killed it");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let finished = Finished {
        status,
        stdout: fs::read_to_string(&stdout_path).unwrap_or_default(),
        stderr: fs::read_to_string(&stderr_path).unwrap_or_default(),
    };
    let _ = fs::remove_file(&stdout_path);
    let _ = fs::remove_file(&stderr_path);
    Ok(finished)
}

/// `program args…` started inside `cgroup` (and on one CPU if `cpu` says
/// so): a shell moves itself into the cgroup, then execs the client, so that
/// the client's own PID is in the cgroup from its first instruction and is
/// the PID we wait for.
pub fn in_cgroup(cgroup: &Path, cpu: Option<usize>, program: &str, args: &[String]) -> Command {
    let mut command = Command::new("sh");
    command
        .arg("-c")
        // $0 is the cgroup.procs file, "$@" the client and its arguments.
        .arg(r#"echo $$ > "$0" && exec "$@""#)
        .arg(cgroup.join("cgroup.procs"));
    if let Some(cpu) = cpu {
        command.args(["taskset", "-c", &cpu.to_string()]);
    }
    command.arg(program).args(args);
    command
}
