//! Support for socklb's privileged integration tests and its demo.
//!
//! Everything here cleans up after itself in `Drop`, also when a test
//! panics: child cgroups, daemons (killed by the PID we started), pins.
//! Traffic goes to loopback, or to the namespaces of a [`cluster`].

pub mod cli;
pub mod cluster;
pub mod herd;
pub mod kube;
pub mod manifest;
mod memory_cgroup;
pub mod node;
pub mod nspawn;
mod old_socklb;
pub mod pki;
pub mod podman;
pub mod sockdiag;

pub use cli::join_cgroup;
pub use memory_cgroup::MemoryCgroup;
pub use old_socklb::{
    BuildTree, FIRST_LAYOUT_COMMIT, OLD_COMMITS, SOCKET_STORAGE_COMMIT, old_socklb_bin,
    old_socklb_bin_at, old_socklb_bin_in, without_cargo_run_variables,
};

use std::{
    collections::BTreeMap,
    io::Write,
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use std::os::unix::{ffi::OsStringExt, process::CommandExt};

use serde::Deserialize;

/// Raises the soft open-files limit to the hard one (helpers that hold
/// thousands of connections).
pub fn raise_open_files() {
    // SAFETY: getrlimit/setrlimit on a struct we own.
    unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// Drops to uid and gid 65534 with no supplementary groups and no
/// capabilities: a hostile local user. Call it while single-threaded.
pub fn become_nobody() -> Result<(), String> {
    // SAFETY: plain credential syscalls on a single-threaded process.
    let dropped = unsafe {
        libc::setgroups(0, std::ptr::null()) == 0
            && libc::setgid(65534) == 0
            && libc::setuid(65534) == 0
    };
    // SAFETY: geteuid has no preconditions.
    if !dropped || unsafe { libc::geteuid() } != 65534 {
        return Err(format!(
            "dropping to uid 65534: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// A directory of the test's own, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(label: &str) -> Self {
        let dir = std::env::temp_dir().join(unique_name(label));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Root of the cgroup v2 hierarchy of this machine.
pub fn cgroup_v2_root() -> PathBuf {
    socklb::cgroup::v2_root().unwrap_or_else(|error| panic!("socklb tests need cgroup v2: {error}"))
}

/// Set by `cargo xtask test`: every test runs for real there, so a missing
/// privilege or prerequisite fails the test instead of skipping it.
pub const NO_SKIP_ENV: &str = "SOCKLB_TESTS_NO_SKIP";

/// Why this process cannot run a privileged test, or `None` as root.
pub fn missing_root() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    (uid != 0).then(|| {
        format!(
            "needs root (running as uid {uid}): it loads eBPF programs and creates cgroups; \
             `cargo xtask test` runs it as root"
        )
    })
}

/// Fails with a clear message unless this runs as root. A test calls the
/// macro [`require_root!`] first instead, so that a plain `cargo test`
/// without root skips it; helpers call this function.
pub fn require_root() {
    if let Some(missing) = missing_root() {
        panic!(
            "{missing} (a test that starts with `require_root!();` is skipped without root instead)"
        );
    }
}

/// Whether the test named `test` must return now, because `missing` says
/// what it lacks: then one line on the standard error says so. Under
/// [`NO_SKIP_ENV`] nothing may be skipped, and this panics instead. With
/// nothing missing the test runs, whoever runs it. Used by [`require!`].
#[doc(hidden)]
pub fn skip_for(test: &str, missing: Option<String>) -> bool {
    let Some(missing) = missing else {
        return false;
    };
    if std::env::var_os(NO_SKIP_ENV).is_some() {
        panic!("{test} {missing} ({NO_SKIP_ENV} is set: no test may be skipped)");
    }
    // Straight to the standard error, past the test harness's capture, so
    // that a plain `cargo test` shows the line.
    let _ = writeln!(std::io::stderr(), "skipped {test}: {missing}");
    true
}

/// The name of the test function from the type name of an item declared
/// in it (`redirect::drain_works::here` → `redirect::drain_works`).
#[doc(hidden)]
pub fn test_name(item_type_name: &str) -> &str {
    item_type_name
        .rsplit_once("::")
        .map_or(item_type_name, |(test, _)| test)
}

/// Returns from the calling test when `$missing` (an `Option<String>`)
/// says what it lacks, after one line `skipped <test>: <what>` on the
/// standard error; under [`NO_SKIP_ENV`] (`cargo xtask test`) the test
/// fails instead. Like the nix crate's `skip_if_not_root!`.
///
/// ```no_run
/// #[test]
/// fn needs_python() {
///     socklb_tests::require!(socklb_tests::kube::missing_python());
///     // ... runs only with the Python environment.
/// }
/// ```
#[macro_export]
macro_rules! require {
    ($missing:expr) => {{
        fn here() {}
        if $crate::skip_for(
            $crate::test_name(::std::any::type_name_of_val(&here)),
            $missing,
        ) {
            return;
        }
    }};
}

/// The first line of every privileged test: without root, a plain `cargo
/// test` skips it with one line saying so; as root it always runs, and
/// under `cargo xtask test` a missing privilege is a failure (see
/// [`require!`]).
#[macro_export]
macro_rules! require_root {
    () => {
        $crate::require!($crate::missing_root())
    };
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// A name no other test of this or another process uses at the same time.
pub fn unique_name(label: &str) -> String {
    format!(
        "socklb-test-{label}-{}-{}",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::Relaxed)
    )
}

/// A child cgroup v2 directory, removed on drop.
pub struct Cgroup {
    pub path: PathBuf,
}

impl Cgroup {
    /// A fresh child of the v2 root. Never the root itself.
    pub fn new(label: &str) -> Self {
        let path = cgroup_v2_root().join(unique_name(label));
        std::fs::create_dir(&path)
            .unwrap_or_else(|error| panic!("creating cgroup {}: {error}", path.display()));
        Self { path }
    }

    /// A child of this cgroup, removed on drop (before its parent).
    pub fn child(&self, name: &str) -> Cgroup {
        let path = self.path.join(name);
        std::fs::create_dir(&path)
            .unwrap_or_else(|error| panic!("creating cgroup {}: {error}", path.display()));
        Cgroup { path }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Clients are short-lived processes; give a straggler a moment.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("warning: could not remove cgroup {}", self.path.display());
    }
}

/// A loopback server that answers each connection with its name and a
/// newline, then closes it. It can be stopped and started on the same port.
pub struct Backend {
    pub name: String,
    pub addr: SocketAddr,
    running: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
    /// Accepted connections kept open (see `start_holding`); they outlive
    /// `stop`, like established connections to a server whose listener died.
    held: Option<Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>>,
    /// Also answers HTTP requests (see `start_http`).
    http: bool,
    /// HTTP requests answered.
    http_requests: Arc<std::sync::atomic::AtomicUsize>,
    /// Connections accepted (and sent the name), over every start.
    accepted: Arc<std::sync::atomic::AtomicUsize>,
}

impl Backend {
    /// Listens on `ip` and a free port.
    pub fn start(name: &str, ip: &str) -> Self {
        Self::bind(name, ip, false, false)
    }

    /// Like `start`, but keeps every accepted connection open after sending
    /// the name, until the backend is dropped.
    pub fn start_holding(name: &str, ip: &str) -> Self {
        Self::bind(name, ip, true, false)
    }

    /// Like `start`, but a client that sends an HTTP request first (a
    /// health probe of kind http) gets `200 OK` with the name as the body;
    /// one that sends nothing for 30 ms gets the name, as from `start`.
    pub fn start_http(name: &str, ip: &str) -> Self {
        Self::bind(name, ip, false, true)
    }

    fn bind(name: &str, ip: &str, hold: bool, http: bool) -> Self {
        let listener = TcpListener::bind((ip, 0))
            .unwrap_or_else(|error| panic!("backend {name} binding {ip}: {error}"));
        let addr = listener.local_addr().expect("bound address");
        let mut backend = Self {
            name: name.to_string(),
            addr,
            running: None,
            held: hold.then(Arc::default),
            http,
            http_requests: Arc::default(),
            accepted: Arc::default(),
        };
        backend.serve(listener);
        backend
    }

    /// Listens on a given address (used by the demo, and to restart).
    pub fn start_at(name: &str, addr: SocketAddr) -> Self {
        Self::start_at_with(name, addr, false)
    }

    /// Like `start_at`, keeping every accepted connection open (see
    /// `start_holding`).
    pub fn start_holding_at(name: &str, addr: SocketAddr) -> Self {
        Self::start_at_with(name, addr, true)
    }

    fn start_at_with(name: &str, addr: SocketAddr, hold: bool) -> Self {
        let mut backend = Self {
            name: name.to_string(),
            addr,
            running: None,
            held: hold.then(Arc::default),
            http: false,
            http_requests: Arc::default(),
            accepted: Arc::default(),
        };
        backend.resume();
        backend
    }

    fn serve(&mut self, listener: TcpListener) {
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let stop = Arc::new(AtomicBool::new(false));
        let name = self.name.clone();
        let flag = Arc::clone(&stop);
        let held = self.held.clone();
        let http = self.http;
        let http_requests = Arc::clone(&self.http_requests);
        let accepted = Arc::clone(&self.accepted);
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut stream, _)) => {
                        let _ = stream.set_nonblocking(false);
                        accepted.fetch_add(1, Ordering::Relaxed);
                        if http {
                            // Each in its own thread: the wait for a
                            // request must not hold up the next accept.
                            let name = name.clone();
                            let http_requests = Arc::clone(&http_requests);
                            std::thread::spawn(move || {
                                if answer_http(&mut stream, &name) {
                                    http_requests.fetch_add(1, Ordering::Relaxed);
                                } else {
                                    let _ = writeln!(stream, "{name}");
                                }
                            });
                            continue;
                        }
                        let _ = writeln!(stream, "{name}");
                        if let Some(held) = &held {
                            held.lock().expect("held connections").push(stream);
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        });
        self.running = Some((stop, thread));
    }

    /// HTTP requests answered (by a backend from `start_http`).
    pub fn http_requests(&self) -> usize {
        self.http_requests.load(Ordering::Relaxed)
    }

    /// Connections accepted so far, over every start of this backend.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Closes the listening socket: new connects are refused.
    pub fn stop(&mut self) {
        if let Some((stop, thread)) = self.running.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = thread.join();
        }
    }

    /// Listens again on the same address.
    pub fn resume(&mut self) {
        if self.running.is_some() {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match TcpListener::bind(self.addr) {
                Ok(listener) => break listener,
                Err(error) if Instant::now() > deadline => {
                    panic!("backend {} rebinding {}: {error}", self.name, self.addr)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        self.serve(listener);
    }
}

/// Answers an HTTP request with `200 OK` and the name, if the client sends
/// one within 30 ms; returns whether it did.
fn answer_http(stream: &mut std::net::TcpStream, name: &str) -> bool {
    use std::io::Read;
    let _ = stream.set_read_timeout(Some(Duration::from_millis(30)));
    let mut request = [0u8; 1024];
    let Ok(read) = stream.read(&mut request) else {
        return false;
    };
    if !request[..read].starts_with(b"GET ") && !request[..read].starts_with(b"HEAD ") {
        return false;
    }
    let body = format!("{name}\n");
    let _ = write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    true
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Prints one line of test figures and appends it to `$SOCKLB_FIGURES`
/// (cargo xtask test collects them there).
pub fn record_figures(line: &str) {
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("SOCKLB_FIGURES")
        && let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    {
        // One write: suites run side by side append to the same file, and
        // an O_APPEND write of a whole line cannot interleave with theirs.
        let _ = file.write_all(format!("{line}\n").as_bytes());
    }
}

/// A port on 127.0.0.1 that nothing listens on right now.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// The socklb binary: `SOCKLB_BIN`, or target/<profile>/socklb beside the
/// running test executable.
pub fn socklb_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("SOCKLB_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("current executable");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let candidate = profile_dir.join("socklb");
    assert!(
        candidate.exists(),
        "{} is missing: build it with `cargo build -p lb-userspace` after `cargo xtask build-ebpf`, or run `cargo xtask test`",
        candidate.display()
    );
    candidate
}

/// The lbclient helper binary, next to socklb.
pub fn lbclient_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("LBCLIENT_BIN") {
        return PathBuf::from(path);
    }
    socklb_bin().with_file_name("lbclient")
}

/// Runs `socklb ARGS` to completion.
pub fn socklb(args: &[&str]) -> std::process::Output {
    Command::new(socklb_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|error| panic!("running socklb {args:?}: {error}"))
}

/// One connect attempt as lbclient reports it.
#[derive(Debug, Clone, Deserialize)]
pub struct Attempt {
    pub ok: bool,
    pub served_by: Option<String>,
    pub peer: Option<String>,
    pub errno: Option<i32>,
    pub error: Option<String>,
    pub hold_end: Option<String>,
    pub held_ms: Option<u64>,
    /// When the attempt began, in ms since the client started.
    #[serde(default)]
    pub at_ms: u64,
}

/// How to run lbclient.
#[derive(Debug, Clone)]
pub struct ClientRun<'a> {
    pub addr: SocketAddr,
    pub cgroup: Option<&'a Path>,
    pub count: u32,
    pub interval_ms: u64,
    pub new_netns: bool,
    /// Keep each connection open up to this long after reading the name.
    pub hold_ms: Option<u64>,
    /// Keep all connections open until this long after the last.
    pub keep_open_ms: Option<u64>,
}

impl<'a> ClientRun<'a> {
    pub fn new(addr: SocketAddr, cgroup: Option<&'a Path>, count: u32) -> Self {
        Self {
            addr,
            cgroup,
            count,
            interval_ms: 0,
            new_netns: false,
            hold_ms: None,
            keep_open_ms: None,
        }
    }

    fn command(&self) -> Command {
        let mut command = Command::new(lbclient_bin());
        command
            .arg("--addr")
            .arg(self.addr.to_string())
            .arg("--count")
            .arg(self.count.to_string())
            .arg("--interval-ms")
            .arg(self.interval_ms.to_string());
        if let Some(cgroup) = self.cgroup {
            command.arg("--cgroup").arg(cgroup);
        }
        if self.new_netns {
            command.arg("--new-netns");
        }
        if let Some(hold) = self.hold_ms {
            command.arg("--hold-ms").arg(hold.to_string());
        }
        if let Some(keep_open) = self.keep_open_ms {
            command.arg("--keep-open-ms").arg(keep_open.to_string());
        }
        command.stdin(Stdio::null());
        command
    }

    /// Runs to completion and returns every attempt.
    pub fn run(&self) -> Vec<Attempt> {
        let output = self
            .command()
            .output()
            .unwrap_or_else(|error| panic!("running lbclient: {error}"));
        assert!(
            output.status.success(),
            "lbclient failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        parse_attempts(&output.stdout)
    }

    /// Starts in the background; `ClientProcess::finish` collects it.
    pub fn spawn(&self) -> ClientProcess {
        let child = self
            .command()
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("starting lbclient: {error}"));
        ClientProcess { child: Some(child) }
    }
}

fn parse_attempts(stdout: &[u8]) -> Vec<Attempt> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|error| panic!("lbclient line {line:?}: {error}"))
        })
        .collect()
}

/// A running lbclient, killed on drop if not finished.
pub struct ClientProcess {
    child: Option<Child>,
}

impl ClientProcess {
    pub fn finish(mut self) -> Vec<Attempt> {
        let child = self.child.take().expect("not yet finished");
        let output = child.wait_with_output().expect("waiting for lbclient");
        assert!(
            output.status.success(),
            "lbclient failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        parse_attempts(&output.stdout)
    }
}

impl Drop for ClientProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// How many attempts each backend served; failures count under "error".
pub fn spread(attempts: &[Attempt]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for attempt in attempts {
        let key = match (&attempt.ok, &attempt.served_by) {
            (true, Some(name)) => name.clone(),
            _ => "error".to_string(),
        };
        *counts.entry(key).or_default() += 1;
    }
    counts
}

/// How many of a `ConnClient::finish` report's connections socklb closed
/// (they ended with ECONNABORTED).
pub fn aborted(ends: &[serde_json::Value]) -> usize {
    ends.iter()
        .filter(|end| end["end"] == "error" && end["errno"] == libc::ECONNABORTED)
        .count()
}

/// `GET /metrics` of a daemon's `--metrics-addr`: every sample, keyed by
/// its name and labels as written.
pub fn scrape_metrics(addr: SocketAddr) -> BTreeMap<String, f64> {
    try_scrape_metrics(addr, Duration::from_secs(10)).unwrap_or_else(|error| panic!("{error}"))
}

/// Like `scrape_metrics`, with a timeout, returning what went wrong (the
/// soak scrapes a daemon that may be stopped or gone).
pub fn try_scrape_metrics(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<BTreeMap<String, f64>, String> {
    let mut stream = std::net::TcpStream::connect_timeout(&addr, timeout)
        .map_err(|error| format!("metrics endpoint {addr}: {error}"))?;
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|error| format!("metrics request: {error}"))?;
    let mut response = String::new();
    std::io::Read::read_to_string(&mut stream, &mut response)
        .map_err(|error| format!("metrics answer: {error}"))?;
    if !response.starts_with("HTTP/1.1 200") {
        return Err(format!("metrics answer: {response}"));
    }
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    // Chunked or not: sample lines are the ones that parse.
    let mut samples = BTreeMap::new();
    for line in body.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((key, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if let Ok(value) = value.parse::<f64>() {
            samples.insert(key.to_string(), value);
        }
    }
    Ok(samples)
}

/// Connects through `vip` (10 at a time, from `cgroup`) until one lands
/// on the backend called `name`: the time it took. Panics after `limit`.
pub fn until_served_by(vip: SocketAddr, cgroup: &Path, name: &str, limit: Duration) -> Duration {
    let start = Instant::now();
    while start.elapsed() < limit {
        let attempts = ClientRun::new(vip, Some(cgroup), 10).run();
        if spread(&attempts).contains_key(name) {
            return start.elapsed();
        }
    }
    panic!("no connect reached {name} within {limit:?}");
}

/// The state directory of a test daemon: one per pin path, so that a
/// restart on the same pins finds what the last run persisted, and no
/// test reads another's (or the machine's /var/lib/socklb).
pub fn state_dir_of(pin_path: &Path) -> PathBuf {
    let name = pin_path.file_name().map_or_else(
        || "socklb".into(),
        |name| name.to_string_lossy().into_owned(),
    );
    std::env::temp_dir().join(format!("{name}-state"))
}

/// `run ARGS --pin-path PIN [--state-dir DIR]`.
fn run_args(args: &[String], pin_path: &Path) -> Vec<String> {
    let mut all_args = vec!["run".to_string()];
    all_args.extend(args.iter().cloned());
    all_args.push("--pin-path".into());
    all_args.push(pin_path.display().to_string());
    if !args.iter().any(|arg| arg == "--state-dir") {
        all_args.push("--state-dir".into());
        all_args.push(state_dir_of(pin_path).display().to_string());
    }
    all_args
}

/// A `socklb run` process under guard: on drop it is killed (by its PID)
/// and its pins are removed.
pub struct Daemon {
    pub pin_path: PathBuf,
    pub args: Vec<String>,
    /// Extra environment of the daemon (test switches).
    pub env: Vec<(String, String)>,
    child: Option<Child>,
    log_path: PathBuf,
    /// A cgroup the daemon process itself runs in (see `start_inside`).
    inside: Option<PathBuf>,
    /// A command that runs socklb (see `start_launched`).
    launcher: Vec<String>,
}

impl Daemon {
    /// Like `start_with`, with socklb run by a launcher command (for
    /// example `setpriv` with a user and capabilities), on a given pin path.
    pub fn start_launched(
        label: &str,
        args: &[String],
        pin_path: PathBuf,
        launcher: &[String],
        env: &[(&str, &str)],
    ) -> Self {
        let mut daemon = Self::prepare(label, args, pin_path, env);
        daemon.launcher = launcher.to_vec();
        daemon.spawn();
        daemon
    }

    /// Like `start`, with the daemon process itself in `cgroup` from its
    /// first instruction, so that its own connects to a VIP go through
    /// the hook it installs (a node whose apiserver is reachable only
    /// through socklb).
    pub fn start_inside(label: &str, args: &[String], cgroup: &Path) -> Self {
        let pin_path = PathBuf::from("/sys/fs/bpf").join(unique_name(label));
        let mut daemon = Self::prepare(label, args, pin_path, &[]);
        daemon.inside = Some(cgroup.to_path_buf());
        daemon.spawn();
        daemon
    }

    /// Starts `socklb run ARGS --pin-path <unique>`. `args` must hold
    /// `--cgroup` with a test's child cgroup.
    pub fn start(label: &str, args: &[String]) -> Self {
        let pin_path = PathBuf::from("/sys/fs/bpf").join(unique_name(label));
        Self::start_at(label, args, pin_path)
    }

    /// Like `start`, on a given pin path (for example one that a crashed
    /// daemon left half installed).
    pub fn start_at(label: &str, args: &[String], pin_path: PathBuf) -> Self {
        Self::start_with(label, args, pin_path, &[])
    }

    /// Like `start_at`, with extra environment (a test switch).
    pub fn start_with(
        label: &str,
        args: &[String],
        pin_path: PathBuf,
        env: &[(&str, &str)],
    ) -> Self {
        let mut daemon = Self::prepare(label, args, pin_path, env);
        daemon.spawn();
        daemon
    }

    fn prepare(label: &str, args: &[String], pin_path: PathBuf, env: &[(&str, &str)]) -> Self {
        assert!(
            args.iter().any(|arg| arg == "--cgroup"),
            "a test daemon must attach to a child cgroup"
        );
        let all_args = run_args(args, &pin_path);
        let log_path = std::env::temp_dir().join(format!("{}.log", unique_name(label)));
        Self {
            pin_path,
            args: all_args,
            env: env
                .iter()
                .map(|(key, value)| ((*key).to_string(), (*value).to_string()))
                .collect(),
            child: None,
            log_path,
            inside: None,
            launcher: Vec::new(),
        }
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .expect("daemon log file");
        let mut command = match self.launcher.split_first() {
            Some((program, launcher_args)) => {
                let mut command = Command::new(program);
                command.args(launcher_args).arg(socklb_bin());
                command
            }
            None => Command::new(socklb_bin()),
        };
        if let Some(cgroup) = &self.inside {
            let procs =
                std::ffi::CString::new(cgroup.join("cgroup.procs").into_os_string().into_vec())
                    .expect("a cgroup path without NUL");
            // SAFETY: between fork and exec the closure calls only
            // async-signal-safe functions (open, write, close) on memory
            // prepared before the fork.
            unsafe {
                command.pre_exec(move || {
                    let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // "0" moves the writing process: the child, before exec.
                    let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                    let error = std::io::Error::last_os_error();
                    libc::close(fd);
                    if written == 1 { Ok(()) } else { Err(error) }
                });
            }
        }
        let child = command
            .args(&self.args)
            .envs(self.env.iter().map(|(key, value)| (key, value)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| panic!("starting socklb: {error}"));
        self.child = Some(child);
    }

    /// The file the daemon's output goes to (every start appends).
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The daemon's output so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// How many lines of the log so far contain `text`.
    pub fn log_count(&self, text: &str) -> usize {
        self.log()
            .lines()
            .filter(|line| line.contains(text))
            .count()
    }

    /// Whether the log shows `text` within `limit` (the daemon may still be
    /// writing the line about what the test just saw happen).
    pub fn log_shows(&self, text: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.log().contains(text) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Sends a signal to the daemon we started.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill on the PID of a child we own and have not reaped.
        unsafe { libc::kill(self.pid() as i32, signal) };
    }

    /// Stops the daemon (SIGSTOP) and returns once every one of its threads
    /// is stopped: kill(2) returns before they are, and a thread that runs
    /// on meanwhile can still act (reopen a watch, repair something).
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
        let tasks = PathBuf::from(format!("/proc/{}/task", self.pid()));
        let started = Instant::now();
        loop {
            let stopped = std::fs::read_dir(&tasks).is_ok_and(|entries| {
                entries
                    .flatten()
                    .all(|task| thread_state(&task.path().join("stat")) == Some('T'))
            });
            if stopped {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the daemon {} did not stop on SIGSTOP",
                self.pid()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Lets a paused daemon run on (SIGCONT).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits for the daemon to exit by itself, at most `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        let child = self.child.as_mut()?;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Starts the same command again (after a kill).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Stops the daemon with SIGTERM (the data plane stays) and starts it
    /// again with other `run` flags on the same pins.
    pub fn restart_with(&mut self, args: &[String]) {
        assert!(
            args.iter().any(|arg| arg == "--cgroup"),
            "a test daemon must attach to a child cgroup"
        );
        if self.child.is_some() {
            self.signal(libc::SIGTERM);
            self.wait_exit(Duration::from_secs(5))
                .expect("daemon exits on SIGTERM");
        }
        self.args = run_args(args, &self.pin_path);
        self.spawn();
    }

    /// `socklb status --json` of this daemon's pins.
    pub fn status(&self) -> Option<serde_json::Value> {
        let pin = self.pin_path.display().to_string();
        let output = socklb(&["status", "--json", "--pin-path", &pin]);
        if !output.status.success() {
            return None;
        }
        serde_json::from_slice(&output.stdout).ok()
    }

    /// Polls status until `ready` holds, at most `limit`; panics with the
    /// daemon's log otherwise. Returns the time it took.
    pub fn wait_for(
        &mut self,
        what: &str,
        limit: Duration,
        ready: impl Fn(&serde_json::Value) -> bool,
    ) -> Duration {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "socklb exited ({status}) while waiting for {what}:\n{}",
                    self.log()
                );
            }
            if self.status().as_ref().is_some_and(&ready) {
                return start.elapsed();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "timed out after {limit:?} waiting for {what}; status {:?}\nlog:\n{}",
            self.status(),
            self.log()
        );
    }

    /// Waits until the daemon's event loop has beaten `beats` more times
    /// (each tick writes the heartbeat, and verifies, rebalances and moves
    /// slow starts on): a fact to wait on before asserting that nothing
    /// more happens.
    pub fn wait_beats(&mut self, beats: u32, limit: Duration) {
        let last_age = std::cell::Cell::new(u64::MAX);
        let seen = std::cell::Cell::new(0u32);
        self.wait_for(&format!("{beats} heartbeats"), limit, |status| {
            let Some(age) = status["daemon"]["heartbeat_age_ms"].as_u64() else {
                return false;
            };
            // The age falls back only when a new beat is written.
            if age < last_age.get() && last_age.get() != u64::MAX {
                seen.set(seen.get() + 1);
            }
            last_age.set(age);
            seen.get() >= beats
        });
    }

    /// The value of `--flag VALUE` in this daemon's arguments, if given.
    fn flag(&self, flag: &str) -> Option<&str> {
        self.args
            .iter()
            .position(|arg| arg == flag)
            .and_then(|at| self.args.get(at + 1))
            .map(String::as_str)
    }

    /// The limit of a wait for `probes` probe rounds of this daemon (see
    /// [`probe_bound`]), from its own `--health-interval` and
    /// `--health-timeout`, or socklb's defaults where it has none.
    pub fn probe_bound(&self, probes: u32) -> Duration {
        let defaults = socklb::config::HealthSettings::default();
        let duration = |flag: &str, default: Duration| {
            self.flag(flag).map_or(default, |text| {
                socklb::config::parse_duration(text)
                    .unwrap_or_else(|| panic!("{flag} {text} is not a duration"))
            })
        };
        probe_bound(
            duration("--health-interval", defaults.interval),
            duration("--health-timeout", defaults.timeout),
            probes,
        )
    }

    /// The limit of a wait for this daemon to take a failed backend out:
    /// `--fall` probe rounds (see [`Daemon::probe_bound`]).
    pub fn fall_bound(&self) -> Duration {
        let fall = self
            .flag("--fall")
            .map_or(socklb::config::HealthSettings::default().fall, |text| {
                text.parse().expect("--fall is a number")
            });
        self.probe_bound(fall)
    }

    /// Waits until the kernel has redirected at least `count` connects
    /// more than `since` (a [`total_redirects`] figure), at most `limit`:
    /// traffic flows through the VIP. Works while the daemon is down (the
    /// counts are in the pinned maps). Returns the new total.
    pub fn wait_redirects(&mut self, since: u64, count: u64, limit: Duration) -> u64 {
        self.wait_for(
            &format!("{count} connects redirected after the first {since}"),
            limit,
            |status| total_redirects(status) >= since + count,
        );
        total_redirects(&self.status().expect("status"))
    }

    /// Waits until this daemon runs (its own heartbeat, not a previous
    /// daemon's records) and a probe has given every listed backend the
    /// given health.
    pub fn wait_health(
        &mut self,
        backends: &[SocketAddr],
        healthy: bool,
        limit: Duration,
    ) -> Duration {
        let wanted: Vec<String> = backends.iter().map(ToString::to_string).collect();
        let pid = self.pid();
        self.wait_for(&format!("{wanted:?} healthy={healthy}"), limit, |status| {
            status["daemon"]["pid"] == pid
                && status["daemon"]["running"] == true
                && wanted.iter().all(|addr| {
                    backend_field(status, addr, "probed") == Some(serde_json::Value::Bool(true))
                        && backend_field(status, addr, "healthy")
                            == Some(serde_json::Value::Bool(healthy))
                })
        })
    }
}

/// The live connections of each backend, in the order of `addrs` (0 for
/// one status does not list).
pub fn live_counts(status: &serde_json::Value, addrs: &[SocketAddr]) -> Vec<i64> {
    addrs
        .iter()
        .map(|addr| live_connections(status, *addr))
        .collect()
}

/// The established connections open now to the backend at `addr`, as a
/// status report counts them (sock_ops); 0 for a backend it does not list.
pub fn live_connections(status: &serde_json::Value, addr: SocketAddr) -> i64 {
    backend_field(status, &addr.to_string(), "live")
        .and_then(|live| live.as_i64())
        .unwrap_or(0)
}

/// The connects that the kernel redirected to the backend at `addr`, as a
/// status report counts them; 0 for a backend it does not list.
pub fn redirects(status: &serde_json::Value, addr: SocketAddr) -> u64 {
    backend_field(status, &addr.to_string(), "redirects")
        .and_then(|redirects| redirects.as_u64())
        .unwrap_or(0)
}

/// The connects that the kernel redirected, to any backend of any service.
pub fn total_redirects(status: &serde_json::Value) -> u64 {
    status["services"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|service| service["backends"].as_array().into_iter().flatten())
        .filter_map(|backend| backend["redirects"].as_u64())
        .sum()
}

/// Polls `fact` every 5 ms until it holds; returns how long that took, or
/// panics after `limit` naming `what`.
pub fn time_until(what: &str, limit: Duration, fact: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    if holds_within(limit, Duration::from_millis(5), fact) {
        return start.elapsed();
    }
    panic!("{what}: not within {limit:?}");
}

/// Polls `fact` every `every` for at most `limit`; whether it came to hold
/// (checked once more at the end).
pub fn holds_within(limit: Duration, every: Duration, mut fact: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if fact() {
            return true;
        }
        std::thread::sleep(every);
    }
    fact()
}

/// The limit of a wait for `count` things that a client does every
/// `interval` (connects, requests): ten times their nominal time, plus 5 s
/// for processes to start on a loaded 2-core machine. A wait returns as
/// soon as its fact holds; the limit only bounds a failure.
pub fn pace_bound(count: u32, interval: Duration) -> Duration {
    interval * count.saturating_mul(10) + Duration::from_secs(5)
}

/// The limit of a wait for `probes` probe rounds of a daemon that probes
/// every `interval` with `timeout`: each round waits up to 1.2 × the
/// interval (its jitter) and then up to the timeout. Three times that,
/// plus 2 s, for a loaded 2-core machine; a wait returns as soon as its
/// fact holds.
pub fn probe_bound(interval: Duration, timeout: Duration, probes: u32) -> Duration {
    (interval * 6 / 5 + timeout) * probes.saturating_mul(3) + Duration::from_secs(2)
}

/// Whether a status report lists the backend `addr`.
pub fn listed(status: &serde_json::Value, addr: SocketAddr) -> bool {
    backend_field(status, &addr.to_string(), "addr").is_some()
}

/// The source the first service's table follows ("endpointslices",
/// "k3s-state", "persisted", "static"), or "none".
pub fn following(status: &serde_json::Value) -> String {
    status["daemon_info"]["services"][0]["following"]
        .as_str()
        .unwrap_or("none")
        .to_string()
}

/// `count` connects through the VIP from `cgroup`: how many each backend
/// served. Panics if one fails.
pub fn served(vip: SocketAddr, cgroup: &Path, count: u32) -> BTreeMap<String, usize> {
    let attempts = ClientRun::new(vip, Some(cgroup), count).run();
    let served = spread(&attempts);
    assert!(
        !served.contains_key("error"),
        "every connect served: {served:?}"
    );
    served
}

/// A field of the backend with this address in a status report.
pub fn backend_field(
    status: &serde_json::Value,
    addr: &str,
    field: &str,
) -> Option<serde_json::Value> {
    status["services"]
        .as_array()?
        .iter()
        .flat_map(|service| service["backends"].as_array().into_iter().flatten())
        .find(|backend| backend["addr"] == addr)
        .map(|backend| backend[field].clone())
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
        let pins = socklb::dataplane::PinPaths::new(&self.pin_path);
        let _ = socklb::dataplane::remove_pins(&pins);
        let _ = std::fs::remove_file(socklb::dataplane::lock::RunPaths::of(&pins).lock);
        let _ = std::fs::remove_dir_all(state_dir_of(&self.pin_path));
        if std::thread::panicking() {
            eprintln!("socklb log ({}):\n{}", self.log_path.display(), self.log());
        }
        let _ = std::fs::remove_file(&self.log_path);
    }
}

/// The apiserver probe (`/readyz`) at socklb's own default interval and
/// timeout (1 s each), for `service_args`, which sets faster ones
/// otherwise.
pub const DEFAULT_APISERVER_HEALTH: [&str; 6] = [
    "--health",
    "apiserver",
    "--health-interval",
    "1s",
    "--health-timeout",
    "1s",
];

/// Flags for a one-service daemon in `cgroup` with fast health checks.
pub fn service_args(
    cgroup: &Path,
    vips: &[SocketAddr],
    backends: &[SocketAddr],
    extra: &[&str],
) -> Vec<String> {
    let mut args = vec!["--cgroup".to_string(), cgroup.display().to_string()];
    for vip in vips {
        args.push("--vip".into());
        args.push(vip.to_string());
    }
    for backend in backends {
        args.push("--backend".into());
        args.push(backend.to_string());
    }
    // Fast health checks, unless the test sets its own.
    for (flag, value) in [
        ("--health-interval", "200ms"),
        ("--health-timeout", "200ms"),
        ("--rise", "2"),
        ("--fall", "3"),
    ] {
        if !extra.contains(&flag) {
            args.push(flag.into());
            args.push(value.into());
        }
    }
    args.extend(extra.iter().map(ToString::to_string));
    args
}

/// The `connclient` helper (see its documentation): a hostile client that
/// aborts its own connects, or one that holds connections open.
pub struct ConnClient {
    child: Option<Child>,
}

impl ConnClient {
    fn command(mode: &str, vip: SocketAddr, cgroup: &Path, count: u32) -> Command {
        let mut command = Self::command_outside(mode, vip, count);
        command.arg("--cgroup").arg(cgroup);
        command
    }

    fn command_outside(mode: &str, addr: SocketAddr, count: u32) -> Command {
        let mut command = Command::new(lbclient_bin().with_file_name("connclient"));
        command
            .arg(mode)
            .args(["--addr", &addr.to_string(), "--count", &count.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    }

    /// A hostile local user (uid 65534, no cgroup) with `count`
    /// connections to `addr` that send `send` (if anything) and then
    /// nothing, each opened again as soon as the server closes it, until
    /// `release` (at most `limit`).
    pub fn hold_as_nobody(
        addr: SocketAddr,
        count: u32,
        send: Option<&str>,
        limit: Duration,
    ) -> Self {
        let mut command = Self::command_outside("--hold", addr, count);
        command
            .args(["--hold-ms", &limit.as_millis().to_string()])
            .args(["--until-stdin-closes", "--reconnect", "--nobody"])
            .stdin(Stdio::piped());
        if let Some(text) = send {
            command.args(["--send", text]);
        }
        let child = command
            .spawn()
            .unwrap_or_else(|error| panic!("starting connclient: {error}"));
        Self { child: Some(child) }
    }

    /// Runs the hostile client to completion (as uid 65534): `count`
    /// connects with this TTL, each closed after `abort_after`. Returns its
    /// summary line.
    pub fn abort(
        vip: SocketAddr,
        cgroup: &Path,
        count: u32,
        ttl: u8,
        abort_after: Duration,
    ) -> serde_json::Value {
        let output = Self::command("--abort", vip, cgroup, count)
            .args(["--ttl", &ttl.to_string()])
            .args(["--abort-ms", &abort_after.as_millis().to_string()])
            .output()
            .unwrap_or_else(|error| panic!("running connclient: {error}"));
        assert!(
            output.status.success(),
            "connclient --abort: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice(&output.stdout).expect("connclient summary")
    }

    /// Starts holding `count` connections for `hold`.
    pub fn hold(vip: SocketAddr, cgroup: &Path, count: u32, hold: Duration) -> Self {
        let child = Self::command("--hold", vip, cgroup, count)
            .args(["--hold-ms", &hold.as_millis().to_string()])
            .spawn()
            .unwrap_or_else(|error| panic!("starting connclient: {error}"));
        Self { child: Some(child) }
    }

    /// Starts holding `count` connections until `release` (at most `limit`).
    pub fn hold_until_released(
        vip: SocketAddr,
        cgroup: &Path,
        count: u32,
        limit: Duration,
    ) -> Self {
        let child = Self::command("--hold", vip, cgroup, count)
            .args(["--hold-ms", &limit.as_millis().to_string()])
            .arg("--until-stdin-closes")
            .stdin(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("starting connclient: {error}"));
        Self { child: Some(child) }
    }

    /// Like `hold_until_released`, with clients that open a connection
    /// again at once when it ends (each line then counts `reconnects`).
    pub fn hold_reconnecting(vip: SocketAddr, cgroup: &Path, count: u32, limit: Duration) -> Self {
        let child = Self::command("--hold", vip, cgroup, count)
            .args(["--hold-ms", &limit.as_millis().to_string()])
            .args(["--until-stdin-closes", "--reconnect"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("starting connclient: {error}"));
        Self { child: Some(child) }
    }

    /// Ends a hold started by `hold_until_released`: every connection closes.
    pub fn release(&mut self) {
        if let Some(child) = self.child.as_mut() {
            drop(child.stdin.take());
        }
    }

    /// Waits for the end of the hold; one JSON value per connection.
    pub fn finish(mut self) -> Vec<serde_json::Value> {
        let output = self
            .child
            .take()
            .expect("running")
            .wait_with_output()
            .expect("connclient");
        assert!(
            output.status.success(),
            "connclient --hold: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|line| serde_json::from_str(line).expect("connclient line"))
            .collect()
    }
}

impl Drop for ConnClient {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The records in the socket table's hash of the install pinned at
/// `pin_path`, read through its pin: in the array layout, the sockets that
/// found their slots taken, and those an install of the hash layout filed.
pub fn records_in_hash(pin_path: &Path) -> usize {
    let name = lb_common::names::SOCKET_TABLE;
    let map = aya::maps::MapData::from_pin(pin_path.join(name)).expect("the hash");
    let hash: aya::maps::HashMap<_, u64, lb_common::TrackedSocket> =
        aya::maps::Map::HashMap(map).try_into().expect("a hash map");
    hash.keys().count()
}

/// A `holdserver` process: a backend that accepts and keeps thousands of
/// connections. Killed (by its PID) on drop.
pub struct HoldServer {
    pub addr: SocketAddr,
    child: Child,
}

impl HoldServer {
    /// Listens on `ip` and a free port.
    pub fn start(ip: &str) -> Self {
        let mut child = Command::new(lbclient_bin().with_file_name("holdserver"))
            .args(["--listen", &format!("{ip}:0"), "--max-seconds", "600"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|error| panic!("starting holdserver: {error}"));
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().expect("stdout")),
            &mut line,
        )
        .expect("holdserver prints its address");
        let addr = line.trim().parse().expect("holdserver address");
        Self { addr, child }
    }
}

impl Drop for HoldServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The state letter of a thread from its /proc stat file (the field after
/// the command name, which may itself hold spaces and parentheses).
fn thread_state(stat: &Path) -> Option<char> {
    let text = std::fs::read_to_string(stat).ok()?;
    text.rsplit_once(')')?.1.trim_start().chars().next()
}

/// A private mount namespace of the test's own, held open by a `sleep`
/// process it started: what a test does to /sys/fs/bpf there never
/// reaches the machine, and it all goes when the holder is killed on drop
/// (bpffs mounted inside is a new instance; its pins go with it).
pub struct MountNamespace {
    holder: Child,
}

/// What /sys/fs/bpf holds when a [`MountNamespace`] starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BpffsStart {
    /// Nothing: a node that booted without bpffs.
    Unmounted,
    /// A fresh bpffs, mode 0700, as socklb and systemd mount it.
    Mounted0700,
}

impl MountNamespace {
    pub fn new(start: BpffsStart) -> Self {
        let holder = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sleep", "600"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("unshare (util-linux): {error}"));
        let namespace = Self { holder };
        namespace.wait_entered();
        // However many bpffs mounts the machine stacked there, none stays.
        namespace.shell(
            "while [ \"$(stat -f -c %T /sys/fs/bpf)\" = bpf_fs ]; do umount -l /sys/fs/bpf; done",
        );
        if start == BpffsStart::Mounted0700 {
            namespace.shell("mount -t bpf -o mode=0700 bpf /sys/fs/bpf");
        }
        assert_eq!(
            namespace.bpffs_mounts().len(),
            usize::from(start == BpffsStart::Mounted0700),
            "bpffs mounts in the test's namespace"
        );
        namespace
    }

    /// Returns once the holder runs in its own namespace (unshare has
    /// exec'd sleep).
    fn wait_entered(&self) {
        let own = std::fs::read_link("/proc/self/ns/mnt").expect("this mount namespace");
        let theirs = PathBuf::from(format!("/proc/{}/ns/mnt", self.holder.id()));
        let started = Instant::now();
        while std::fs::read_link(&theirs).ok().as_ref() == Some(&own)
            || std::fs::read_link(&theirs).is_err()
        {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "unshare --mount did not make a namespace"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The command prefix that runs a program in this namespace.
    pub fn enter(&self) -> Vec<String> {
        vec![
            "nsenter".into(),
            "--target".into(),
            self.holder.id().to_string(),
            "--mount".into(),
            "--".into(),
        ]
    }

    /// Runs a `sh -ec` script in this namespace as full root; panics if it
    /// fails.
    pub fn shell(&self, script: &str) {
        let enter = self.enter();
        let output = Command::new(&enter[0])
            .args(&enter[1..])
            .args(["/bin/sh", "-ec", script])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|error| panic!("nsenter (util-linux): {error}"));
        assert!(
            output.status.success(),
            "{script} in the test's mount namespace: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// A path as the namespace sees it, from the test's own namespace.
    pub fn path(&self, path: &Path) -> PathBuf {
        let inside = path.strip_prefix("/").unwrap_or(path);
        PathBuf::from(format!("/proc/{}/root", self.holder.id())).join(inside)
    }

    /// The super options (`rw,mode=700`) of each bpffs mounted on
    /// /sys/fs/bpf in this namespace.
    pub fn bpffs_mounts(&self) -> Vec<String> {
        let mountinfo = std::fs::read_to_string(format!("/proc/{}/mountinfo", self.holder.id()))
            .expect("the namespace's mountinfo");
        mountinfo
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let separator = fields.iter().position(|field| *field == "-")?;
                (fields.get(4) == Some(&"/sys/fs/bpf") && fields.get(separator + 1) == Some(&"bpf"))
                    .then(|| fields.get(separator + 3).unwrap_or(&"").to_string())
            })
            .collect()
    }
}

impl Drop for MountNamespace {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}
