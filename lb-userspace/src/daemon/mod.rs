//! `socklb run`: bring the data plane up, probe the backends, keep the
//! tables in step with their health, and verify twice a second that the
//! kernel still holds what socklb wrote.
//!
//! [`state::Owner`] owns all state. Probe tasks, the kernel's ring buffer,
//! the control socket and the signals only report to the event loop here,
//! which feeds the owner and acts on what it returns.

mod accept;
pub mod control;
pub mod metrics;
pub mod passive;
pub mod rebalance;
mod reload;
pub mod state;
mod verify;

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use lb_common::{DAEMON_FLAG_RUNNING, DaemonRecord, PATH_LEN, Settings, names};
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{Signal, SignalKind, signal},
    sync::{mpsc, watch},
};
use tracing::{debug, info, warn};

use crate::dataplane::features::Features;
use crate::{
    cgroup::{self, CgroupError},
    config::{self, Config},
    dataplane::{
        self, BpfLogLevel, CgroupTarget, KernelError, MapStore, PinPaths, Running, StoreError,
        lock::{self, InstallLock, RunPaths},
        pins, shadow,
    },
    discovery::{
        self, ServiceSources, Source, SourceEvent,
        persist::{Persisted, StateDir},
    },
    errors,
    health::{ProbeReport, Transition, probe::Prober, probe_loop},
    planner::{self, Layout, endpoint},
    sockets,
};
use metrics::Metrics;
use passive::{Confirmer, evidence_words, parse_connect_failure};
pub use reload::ReloadStatus;
use state::{DrainOutcome, Owner};

/// How often the daemon beats its heartbeat and verifies the data plane.
const TICK: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("health probe")]
    Probe(#[source] crate::health::probe::ProbeSetupError),
    #[error("{what}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Overlap(String),
}

/// Everything `socklb run` needs, validated.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub config: Config,
    /// The file the configuration came from (SIGHUP reads it again).
    pub config_path: Option<PathBuf>,
    /// None: the root of the cgroup v2 hierarchy.
    pub cgroup: Option<PathBuf>,
    pub pin_path: PathBuf,
    pub cleanup_on_exit: bool,
    pub bpf_log: BpfLogLevel,
    /// Install even when another socklb serves an overlapping VIP on a
    /// related cgroup.
    pub allow_overlap: bool,
    /// Where the last known backend sets are kept.
    pub state_dir: PathBuf,
    /// Serve Prometheus metrics here.
    pub metrics_addr: Option<SocketAddr>,
    /// Reload when the config file changes.
    pub watch_config: bool,
}

/// What the loop keeps per probed backend.
struct ProbedBackend {
    addr: SocketAddr,
    service: String,
    /// Which loop probes it now; reports of a stopped loop are ignored.
    loop_id: u64,
    prober: Prober,
    timeout: Duration,
    /// How a passing probe is described in a transition message.
    success_words: String,
    /// Set by the loop while the backend is down; read by its probe loop.
    down: watch::Sender<bool>,
    /// Failed connects in a row that start a confirming probe (0: never).
    connect_failures: u32,
}

/// Nanoseconds of CLOCK_BOOTTIME: a clock every process reads alike, that
/// goes on while the machine sleeps.
pub fn boottime_ns() -> u64 {
    // SAFETY: clock_gettime writes into the timespec we own.
    let mut now: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// A path in a fixed, NUL-padded field (cut if longer).
pub fn path_field(path: &std::path::Path) -> [u8; PATH_LEN] {
    let mut field = [0u8; PATH_LEN];
    let bytes = path.as_os_str().as_encoded_bytes();
    let length = bytes.len().min(PATH_LEN - 1);
    field[..length].copy_from_slice(&bytes[..length]);
    field
}

/// Registers a ring buffer (or its reader) for readiness; a failure only
/// costs the feature, which is said once.
fn readable<T: std::os::fd::AsRawFd>(
    source: Result<T, String>,
    without: &str,
) -> Option<AsyncFd<T>> {
    let registered = source.and_then(|inner| {
        // SAFETY: `inner` owns its descriptor and keeps it open and unchanged
        // until the AsyncFd drops it.
        unsafe { AsyncFd::register_with_interest(inner, Interest::READABLE) }
            .map_err(|error| error.to_string())
    });
    registered.map_err(|error| warn!("{without}: {error}")).ok()
}

/// Whether an address belongs to this host: only a local address can be
/// bound. (All of 127.0.0.0/8 counts, as the kernel routes it locally.)
fn is_local_address(ip: std::net::IpAddr) -> bool {
    std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// Closes the connections socklb sent to a backend that failed (or left
/// the configuration), after its table no longer lists it, so the clients
/// reconnect elsewhere.
fn close_connections(maps: &dataplane::BpfMaps, addr: SocketAddr) {
    let target = endpoint(&addr);
    let Some(storage) = maps.fd(names::SOCKETS) else {
        warn!("{addr}: cannot close its connections: the socket storage map is not open");
        return;
    };
    let result = tokio::task::block_in_place(|| {
        sockets::destroy_redirected(addr, storage, |cookie| {
            maps.legacy_redirected_to(cookie, &target)
        })
    });
    match result {
        Ok(report) if report.matched == 0 => {}
        Ok(report) => info!(
            "{addr}: closed {} of {} connections socklb had sent to it (close-on-failure)",
            report.destroyed, report.matched
        ),
        Err(error) => warn!("{addr}: closing its connections failed: {error}"),
    }
}

/// Closes up to `count` of the connections socklb sent to `addr`, idlest
/// first. Returns how many it closed.
fn close_idlest(maps: &dataplane::BpfMaps, addr: SocketAddr, count: usize) -> usize {
    let target = endpoint(&addr);
    let Some(storage) = maps.fd(names::SOCKETS) else {
        warn!("{addr}: cannot rebalance its connections: the socket storage map is not open");
        return 0;
    };
    let result = tokio::task::block_in_place(|| {
        sockets::destroy_idlest(addr, storage, count, |cookie| {
            maps.legacy_redirected_to(cookie, &target)
        })
    });
    match result {
        Ok(report) => report.destroyed,
        Err(error) => {
            warn!("{addr}: closing connections to rebalance failed: {error}");
            0
        }
    }
}

struct Signals {
    terminate: Signal,
    interrupt: Signal,
    hangup: Signal,
}

impl Signals {
    fn install() -> Result<Self, DaemonError> {
        let error = |source| DaemonError::Io {
            what: "installing signal handlers",
            source,
        };
        Ok(Self {
            terminate: signal(SignalKind::terminate()).map_err(error)?,
            interrupt: signal(SignalKind::interrupt()).map_err(error)?,
            hangup: signal(SignalKind::hangup()).map_err(error)?,
        })
    }
}

/// The running daemon: the owner of state and everything it acts through.
struct Daemon {
    /// `options.config` is the configuration as read; `effective` is what
    /// the tables follow (its backends replaced by discovery's).
    options: RunOptions,
    effective: config::Config,
    /// What each service's sources have said.
    sources: BTreeMap<String, ServiceSources>,
    /// Services no source has given a backend yet.
    waiting: Vec<String>,
    watchers: reload::Watchers,
    discovery_tx: mpsc::Sender<SourceEvent>,
    state_dir: Option<StateDir>,
    /// What was last written to the state directory.
    persisted: Option<BTreeMap<String, Persisted>>,
    last_reload: Option<ReloadStatus>,
    paths: PinPaths,
    owner: Owner,
    running: Running,
    probed: HashMap<u32, ProbedBackend>,
    next_loop_id: u64,
    reports_tx: mpsc::Sender<ProbeReport>,
    confirmer: Confirmer,
    rebalancer: rebalance::Rebalancer,
    /// Connections closed to rebalance, by service.
    rebalance_moves: BTreeMap<String, u64>,
    record: DaemonRecord,
    verifier: verify::Verifier,
    features: Features,
    metrics: Metrics,
    /// Backends removed while a table write failed: their connections are
    /// closed once the write succeeds.
    pending_closes: Vec<SocketAddr>,
    _lock: InstallLock,
}

/// Where the loop's events come from.
struct Inputs {
    reports: mpsc::Receiver<ProbeReport>,
    discovery: mpsc::Receiver<SourceEvent>,
    config_changes: Option<mpsc::UnboundedReceiver<()>>,
    /// Keeps the file watch alive.
    _config_watch: Option<notify::RecommendedWatcher>,
    refresh: mpsc::Receiver<metrics::Refresh>,
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(options: RunOptions) -> Result<(), DaemonError> {
    let cgroup_path = match &options.cgroup {
        Some(dir) => dir.clone(),
        None => cgroup::v2_root()?,
    };
    let cgroup_id = cgroup::check_v2_dir(&cgroup_path)?;
    let paths = PinPaths::new(&options.pin_path);
    if pins::ensure_bpffs(&paths)? {
        info!("mounted bpffs on /sys/fs/bpf (mode 0700)");
    }
    pins::prepare_pin_dir(&paths)?;
    let install_lock = lock::lock(&paths)?;
    // Before anything is installed: a SIGTERM during start-up must reach
    // the loop (and --cleanup-on-exit), not end the process half-way.
    let mut signals = Signals::install()?;
    let features = Features::probe();
    for degradation in features.degradations() {
        warn!("{degradation}");
    }
    let host_netns_cookie = if features.netns_cookie {
        dataplane::current_netns_cookie().map_err(|source| DaemonError::Io {
            what: "reading this network namespace's cookie (SO_NETNS_COOKIE)",
            source,
        })?
    } else {
        0
    };
    let cgroup = CgroupTarget {
        path: cgroup_path,
        id: cgroup_id,
    };
    // Discovery's first word: the persisted sets and the state files,
    // which are read at once; the EndpointSlices answer later.
    let state_dir = StateDir::new(&options.state_dir);
    let mut sources = reload::plan_sources(&options.config, &BTreeMap::new(), &options.config);
    reload::seed_from(&state_dir, &mut sources);
    for service in &options.config.services {
        if let (Some(path), Some(service_sources)) =
            (&service.discovery.k3s_state, sources.get_mut(&service.name))
        {
            let outcome =
                service_sources.report(Source::K3sState, discovery::k3s::read(path).await);
            if let Some(problem) = outcome.problem {
                warn!("discovery: {}: {}", service.name, problem.text);
            }
        }
    }
    for (name, service_sources) in &sources {
        if let Some((Source::Persisted, set)) = service_sources.effective() {
            info!(
                "{name}: no discovery source has answered yet; using the last known set ({} backends) from {}",
                set.len(),
                state_dir.file().display()
            );
        }
    }
    let (mut effective, mut waiting) = discovery::effective_config(&options.config, &sources);
    if let Err(error) = config::check_effective(&effective) {
        // A persisted or discovered set that does not fit must not keep
        // the daemon from starting: start from the configuration alone;
        // the sources answer again shortly.
        warn!(
            "the persisted and discovered backends do not fit, starting from the configuration alone: {}",
            errors::chain(&error)
        );
        sources = reload::plan_sources(&options.config, &BTreeMap::new(), &options.config);
        (effective, waiting) = discovery::effective_config(&options.config, &sources);
        config::check_effective(&effective).map_err(|error| {
            DaemonError::Overlap(format!(
                "the configuration does not fit: {}",
                errors::chain(&error)
            ))
        })?;
    }
    for name in &waiting {
        warn!(
            "{name}: no source has given a backend yet; its VIPs pass through untouched until one does"
        );
    }
    let layout = Layout::from_config(&effective, is_local_address);
    if !options.allow_overlap {
        refuse_overlap(&paths, &cgroup, &layout)?;
    }
    let settings = Settings {
        host_netns_cookie,
        attached_cgroup_id: cgroup_id,
    };
    let mut removed = Vec::new();
    let mut adopted_owner = None;
    let running = dataplane::bring_up(&paths, cgroup, options.bpf_log, &features, |maps| {
        // Ids come from the pinned records, so that counters stay true
        // across restarts, upgrades and config edits.
        let known = state::known_ids(maps)?;
        let layout = Layout::keeping(&effective, is_local_address, &known);
        let mut owner = Owner::new(layout, settings);
        removed = owner.adopt(maps)?;
        if !owner.write(maps) {
            return Err(StoreError::new(
                names::SERVICES,
                "the first write of the tables failed",
            ));
        }
        adopted_owner = Some(owner);
        Ok(())
    })?;
    let Some(owner) = adopted_owner else {
        return Err(DaemonError::Store(StoreError::new(
            names::SERVICES,
            "the maps were not prepared",
        )));
    };
    for note in &running.notes {
        warn!("{note}");
    }
    // Backends that a previous daemon served and this configuration drops
    // are gone from the tables now; close what socklb had sent to them.
    for addr in removed {
        info!("{addr} removed from the configuration");
        if features.sock_destroy {
            close_connections(&running.maps, addr);
        }
    }
    info!(
        cgroup = %running.attachment.cgroup().path.display(),
        pin_path = %paths.dir.display(),
        services = effective.services.len(),
        "{}",
        match (running.upgraded, running.adopted) {
            (true, _) => "upgraded the pinned data plane in place",
            (false, true) => "adopted the pinned data plane",
            (false, false) => "installed the data plane",
        }
    );
    if crate::dataplane::install::sk_msg_attached(&running).is_none() {
        info!(
            "this kernel cannot list the sk_msg program on the sockhash (BPF_PROG_QUERY of a sockhash needs Linux 5.19): the verification pass does not check it"
        );
    }
    // Loading parsed the kernel's BTF and the object (megabytes, now
    // freed): give that memory back to the system.
    trim_heap();
    // Under systemd (Type=notify), the units ordered after socklb start
    // now: the hook is attached and redirects.
    notify_ready();
    let (reports_tx, reports) = mpsc::channel::<ProbeReport>(1024);
    let (discovery_tx, discovery_rx) = mpsc::channel::<SourceEvent>(256);
    let (refresh_tx, refresh) = mpsc::channel::<metrics::Refresh>(16);
    let metrics = Metrics::new();
    if let Some(addr) = options.metrics_addr {
        metrics::serve(addr, metrics.clone(), refresh_tx)
            .await
            .map_err(|source| DaemonError::Io {
                what: "listening for metrics (--metrics-addr)",
                source,
            })?;
    }
    let (config_changes, config_watch) = match (&options.config_path, options.watch_config) {
        (Some(path), true) => {
            let (changed_tx, changed) = mpsc::unbounded_channel();
            let watch = reload::watch_file(path, changed_tx).map_err(|error| DaemonError::Io {
                what: "watching the configuration file (--watch-config)",
                source: std::io::Error::other(error.to_string()),
            })?;
            (Some(changed), Some(watch))
        }
        _ => (None, None),
    };
    let mut daemon = Daemon {
        record: DaemonRecord::default(),
        effective,
        sources,
        waiting,
        watchers: reload::Watchers::default(),
        discovery_tx,
        state_dir: Some(state_dir),
        persisted: None,
        last_reload: None,
        paths,
        owner,
        running,
        probed: HashMap::new(),
        next_loop_id: 0,
        reports_tx,
        confirmer: Confirmer::default(),
        rebalancer: rebalance::Rebalancer::default(),
        rebalance_moves: BTreeMap::new(),
        verifier: verify::Verifier::default(),
        features,
        metrics,
        pending_closes: Vec::new(),
        options,
        _lock: install_lock,
    };
    daemon.start_record();
    daemon.start_probes();
    daemon
        .watchers
        .follow(&daemon.options.config, &daemon.discovery_tx);
    let sources = daemon.sources.clone();
    daemon.persist(&sources);
    let inputs = Inputs {
        reports,
        discovery: discovery_rx,
        config_changes,
        _config_watch: config_watch,
        refresh,
    };
    let result = daemon.serve(inputs, &mut signals).await;
    daemon.stop();
    result
}

/// Keeps the daemon's resident memory near what it uses: by default
/// glibc's malloc keeps freed memory at the top of each heap (its trim
/// threshold grows with the largest block freed, to 32 MiB) and makes an
/// arena for every thread that allocates. Called before the runtime's
/// threads start.
pub fn limit_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets allocator parameters; called before other
    // threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 * 1024);
    }
}

/// Tells systemd the daemon is ready (`READY=1` to `$NOTIFY_SOCKET`), if
/// it asked. A failure is logged; the daemon runs on.
fn notify_ready() {
    use std::os::linux::net::SocketAddrExt;
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = (|| {
        let socket = std::os::unix::net::UnixDatagram::unbound()?;
        let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
        let addr = match bytes.strip_prefix(b"@") {
            Some(name) => std::os::unix::net::SocketAddr::from_abstract_name(name)?,
            None => std::os::unix::net::SocketAddr::from_pathname(&path)?,
        };
        socket.send_to_addr(b"READY=1", &addr)
    })();
    if let Err(error) = sent {
        warn!("telling systemd the daemon is ready: {error}");
    }
}

/// Returns freed heap memory to the system.
fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Refuses to install when another socklb on this cgroup, an ancestor or a
/// descendant serves one of our VIPs: whichever attached first would take
/// every connect, and the other would show healthy backends with no
/// redirects.
fn refuse_overlap(
    paths: &PinPaths,
    cgroup: &CgroupTarget,
    layout: &Layout,
) -> Result<(), DaemonError> {
    let vips: Vec<lb_common::Endpoint> = layout
        .tables
        .iter()
        .flat_map(|table| table.vips.iter().map(endpoint))
        .collect();
    let (others, search) =
        shadow::overlapping(paths, cgroup, &vips).map_err(|source| DaemonError::Io {
            what: "looking for other socklb installs",
            source,
        })?;
    if search == shadow::Search::PinnedLinks {
        info!(
            "without CAP_SYS_ADMIN, other socklb installs are looked for through their pins under /sys/fs/bpf only"
        );
    }
    if others.is_empty() {
        return Ok(());
    }
    let lines: Vec<String> = others.iter().map(ToString::to_string).collect();
    Err(DaemonError::Overlap(format!(
        "{}; whichever attached first would take every connect to it. Use another VIP, or --allow-overlap",
        lines.join("; ")
    )))
}

impl Daemon {
    /// The daemon's record: who runs, attached where, with the repairs of
    /// earlier daemons carried over.
    fn start_record(&mut self) {
        let previous = self.running.maps.daemon().unwrap_or_default();
        let now = boottime_ns();
        self.record = DaemonRecord {
            pid: std::process::id(),
            flags: DAEMON_FLAG_RUNNING,
            heartbeat_ns: now,
            started_ns: now,
            cgroup_id: self.running.attachment.cgroup().id,
            config_generation: 1,
            repairs: previous.repairs,
            object_sha256: dataplane::object::object_sha256(),
            cgroup_path: path_field(&self.running.attachment.cgroup().path),
            pin_path: path_field(&self.paths.dir),
        };
        self.beat();
    }

    /// Writes the heartbeat (and everything else the record holds).
    fn beat(&mut self) {
        self.record.heartbeat_ns = boottime_ns();
        if let Err(error) = self.running.maps.put_daemon(&self.record) {
            warn!("writing the heartbeat failed: {}", errors::chain(&error));
        }
    }

    fn start_probes(&mut self) {
        let ids: Vec<u32> = self
            .owner
            .layout()
            .backends()
            .map(|(_, backend)| backend.id)
            .collect();
        for id in ids {
            self.start_probe(id);
        }
    }

    /// Starts probing a backend of the layout (again, if it was probed).
    fn start_probe(&mut self, id: u32) {
        self.stop_probe(id);
        let Some((table, backend)) = self.owner.backend(id) else {
            return;
        };
        // The configuration was validated: its CA and certificate files
        // were read then; one that has gone since is said here.
        let prober = match Prober::new(&table.health.probe) {
            Ok(prober) => prober,
            Err(error) => {
                warn!(
                    "{}: cannot probe it: {}; it keeps its last state",
                    backend.addr,
                    errors::chain(&error)
                );
                return;
            }
        };
        self.next_loop_id += 1;
        let loop_id = self.next_loop_id;
        let (down, down_receiver) = watch::channel(!self.owner.is_healthy(id));
        tokio::spawn(probe_loop(
            id,
            loop_id,
            backend.addr,
            prober.clone(),
            table.health.clone(),
            down_receiver,
            self.reports_tx.clone(),
        ));
        self.probed.insert(
            id,
            ProbedBackend {
                addr: backend.addr,
                service: table.service.clone(),
                loop_id,
                success_words: prober.success_words(),
                prober,
                timeout: table.health.timeout,
                down,
                connect_failures: table.health.connect_failures,
            },
        );
    }

    /// Stops a backend's probe loop (dropping its `down` sender ends it).
    fn stop_probe(&mut self, id: u32) {
        self.probed.remove(&id);
        self.confirmer.finished(id);
    }

    async fn serve(
        &mut self,
        mut inputs: Inputs,
        signals: &mut Signals,
    ) -> Result<(), DaemonError> {
        let mut connect_failures = readable(
            dataplane::install::open_connect_failures(&self.paths)
                .map_err(|error| error.to_string()),
            "failed connects seen by the kernel will not be acted on",
        );
        // aya-log finds the log map through the program's id, which needs
        // CAP_SYS_ADMIN; without it the kernel's (debug) logs stay unread.
        let logging_program = self
            .running
            .ebpf
            .program(names::CONNECT4)
            .and_then(|program| program.info().ok())
            .map(|info| info.id());
        let mut kernel_logs = readable(
            logging_program
                .ok_or_else(|| "no program id".to_string())
                .and_then(|id| {
                    aya_log::EbpfLogger::init_from_id(id).map_err(|error| match error {
                        aya_log::Error::ProgramNotFound => {
                            "the log map is found by program id, which needs CAP_SYS_ADMIN"
                                .to_string()
                        }
                        other => other.to_string(),
                    })
                }),
            "kernel program logs will not be forwarded",
        );
        let (control_tx, mut control) = mpsc::channel(16);
        let control_path = RunPaths::of(&self.paths).control;
        if let Err(error) = control::serve(&control_path, control_tx) {
            warn!(
                "control socket {}: {error}; `socklb drain` cannot reach this daemon",
                control_path.display()
            );
        }
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                Some(report) = inputs.reports.recv() => self.on_probe(report),
                Some(event) = inputs.discovery.recv() => self.on_discovery(event),
                Some(()) = async {
                    match inputs.config_changes.as_mut() {
                        Some(changes) => changes.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    // Let a burst of events (truncate, write, rename) end.
                    tokio::time::sleep(reload::SETTLE).await;
                    if let Some(changes) = inputs.config_changes.as_mut() {
                        while changes.try_recv().is_ok() {}
                    }
                    self.reload("config file changed");
                }
                Some(done) = inputs.refresh.recv() => {
                    self.metrics.set_snapshot(crate::status::read(&self.running.maps, &self.paths));
                    let _ = done.send(());
                }
                Some(mut guard) = async {
                    match connect_failures.as_mut() {
                        Some(ring) => ring.readable_mut().await.ok(),
                        None => std::future::pending().await,
                    }
                } => {
                    let mut records = Vec::new();
                    while let Some(record) = guard.get_inner_mut().next() {
                        records.extend(parse_connect_failure(&record));
                    }
                    guard.clear_ready();
                    for record in records {
                        self.on_failed_connect(record);
                    }
                }
                Some(incoming) = control.recv() => {
                    let reply = self.on_request(incoming.request);
                    let _ = incoming.reply.send(reply);
                }
                _ = tick.tick() => {
                    self.beat();
                    self.advance_ramps();
                    self.rebalance();
                    self.verify_and_repair();
                }
                _ = signals.terminate.recv() => { info!("SIGTERM"); break; }
                _ = signals.interrupt.recv() => { info!("SIGINT"); break; }
                _ = signals.hangup.recv() => self.reload("SIGHUP"),
                Some(mut guard) = async {
                    match kernel_logs.as_mut() {
                        Some(logs) => logs.readable_mut().await.ok(),
                        None => std::future::pending().await,
                    }
                } => {
                    guard.get_inner_mut().flush();
                    guard.clear_ready();
                }
            }
        }
        let _ = std::fs::remove_file(&control_path);
        Ok(())
    }

    fn on_probe(&mut self, report: ProbeReport) {
        let Some(backend) = self.probed.get(&report.backend_id) else {
            return;
        };
        if backend.loop_id != report.loop_id {
            return;
        }
        self.metrics.probe(
            &backend.service,
            backend.addr,
            report.outcome.is_ok(),
            report.took,
        );
        if report.confirming {
            let answered = self.confirmer.finished(report.backend_id).describe();
            if let Err(failure) = &report.outcome {
                let reason = format!("{failure}, confirming {answered}");
                let transition = self.owner.confirm_down(report.backend_id, reason);
                // Its probe loop may be in a long wait; waking it makes it
                // probe at the down interval from now on.
                self.apply(report.backend_id, transition, true);
                return;
            }
            info!(
                "{}: a probe passed after {answered}; it stays (a client that aborts its own connects, or a passing fault)",
                backend.addr
            );
        }
        let words = backend.success_words.clone();
        let (transition, newly_settled) =
            self.owner
                .record_probe(report.backend_id, &report.outcome, &words);
        if transition.is_some() || newly_settled {
            self.apply(report.backend_id, transition, false);
        }
    }

    /// One look at each table that rebalances (see `rebalance.rs`).
    fn rebalance(&mut self) {
        let now = Instant::now();
        let tables: Vec<_> = self
            .owner
            .layout()
            .tables
            .iter()
            .filter_map(|table| Some((table.clone(), table.rebalance?)))
            .collect();
        for (table, settings) in tables {
            // The backends that share the load: the best tier that is not
            // standby.
            let tier = table
                .backends
                .iter()
                .map(|backend| backend.tier)
                .filter(|tier| *tier != planner::Tier::Standby)
                .min();
            let members: Vec<_> = table
                .backends
                .iter()
                .filter(|backend| Some(backend.tier) == tier)
                .collect();
            let whole = members.iter().all(|backend| {
                let health = self.owner.health(backend.id);
                health.healthy && !health.draining && self.owner.ramp_step(backend.id).is_none()
            });
            let ids: Vec<u32> = members.iter().map(|backend| backend.id).collect();
            if !whole {
                self.rebalancer.pause(table.table_id);
                if self.owner.steer(&ids, false) {
                    self.owner.write(&mut self.running.maps);
                }
                continue;
            }
            let live: Vec<rebalance::Member> = members
                .iter()
                .map(|backend| rebalance::Member {
                    id: backend.id,
                    live: u64::try_from(self.running.maps.connections(backend.id).live)
                        .unwrap_or(0),
                })
                .collect();
            let counts = || {
                live.iter()
                    .map(|member| member.live.to_string())
                    .collect::<Vec<_>>()
                    .join("/")
            };
            match self.rebalancer.step(table.table_id, settings, &live, now) {
                rebalance::Step::Nothing => {}
                rebalance::Step::Start { ratio, needed } => {
                    info!(
                        "rebalance: {}: live {} (max/mean {ratio:.2} > {:.2} for {:?}): moving {needed} connections, at most {}/s, idlest first",
                        table.service,
                        counts(),
                        1.0 + f64::from(settings.tolerance_permille) / 1000.0,
                        settings.after,
                        settings.rate
                    );
                    // New connects (the closed ones reconnecting) go to
                    // the others while the episode lasts.
                    let over: Vec<u32> =
                        rebalance::excess(&live).iter().map(|&(id, _)| id).collect();
                    if self.owner.steer(&over, true) {
                        self.owner.write(&mut self.running.maps);
                    }
                }
                rebalance::Step::Balanced { moved, needed } => {
                    info!(
                        "rebalance: {}: in balance again (live {}) after {moved} moves ({needed} needed)",
                        table.service,
                        counts()
                    );
                    if self.owner.steer(&ids, false) {
                        self.owner.write(&mut self.running.maps);
                    }
                }
                rebalance::Step::Close(closes) => {
                    for (backend_id, count) in closes {
                        let Some(backend) = table.backends.iter().find(|b| b.id == backend_id)
                        else {
                            continue;
                        };
                        let destroyed = close_idlest(&self.running.maps, backend.addr, count);
                        self.rebalancer.moved(table.table_id, destroyed);
                        if destroyed > 0 {
                            *self
                                .rebalance_moves
                                .entry(table.service.clone())
                                .or_default() += destroyed as u64;
                            self.metrics
                                .rebalanced(&table.service, backend.addr, destroyed);
                            info!(
                                "rebalance: {}: closed {destroyed} idle connections to {} (live {})",
                                table.service,
                                backend.addr,
                                counts()
                            );
                        }
                    }
                }
            }
        }
    }

    /// Moves the slow starts on; writes the tables when a step changed.
    fn advance_ramps(&mut self) {
        let changed = self.owner.advance_ramps(Instant::now());
        if changed.is_empty() {
            return;
        }
        for (backend_id, step) in &changed {
            let Some(backend) = self.probed.get(backend_id) else {
                continue;
            };
            match step {
                Some(step) => debug!(
                    "{}: slow start at {step}/{} of its weight",
                    backend.addr,
                    planner::RAMP_STEPS
                ),
                None => info!("{}: slow start over; it has its full weight", backend.addr),
            }
        }
        self.owner.write(&mut self.running.maps);
    }

    /// Logs a backend's transition once, writes the tables, and closes the
    /// connections to a backend that went down. `wake`: let the backend's
    /// probe loop know at once (a verdict that did not come from it).
    fn apply(&mut self, backend_id: u32, transition: Option<Transition>, wake: bool) {
        let Some(backend) = self.probed.get(&backend_id) else {
            return;
        };
        if let Some(transition) = &transition {
            self.metrics
                .transition(&backend.service, backend.addr, transition.healthy);
            let message = transition.message(backend.addr);
            if transition.healthy {
                info!("{message}");
                if self.owner.ramp_step(backend_id).is_some() {
                    let duration = self
                        .owner
                        .backend(backend_id)
                        .and_then(|(table, _)| table.slow_start)
                        .unwrap_or_default();
                    info!(
                        "{}: slow start from 1/{} of its weight to all of it over {duration:?}",
                        backend.addr,
                        planner::RAMP_STEPS
                    );
                }
            } else {
                warn!("{message}");
            }
            // Otherwise the probe loop reads this after its next probe;
            // waking it for its own verdict would only add a probe.
            backend.down.send_if_modified(|down| {
                let changed = *down == transition.healthy;
                *down = !transition.healthy;
                changed && wake
            });
        }
        if !self.owner.write(&mut self.running.maps) {
            // The table may still list the backend: closing its connections
            // now would only send the clients back to it.
            return;
        }
        let went_down = transition.is_some_and(|transition| !transition.healthy);
        // From the layout in force (a reload may have changed it since the
        // probe loop started).
        let close_on_failure = self
            .owner
            .backend(backend_id)
            .is_some_and(|(table, _)| table.close_on_failure);
        if went_down && close_on_failure && self.features.sock_destroy {
            close_connections(&self.running.maps, backend.addr);
        }
    }

    /// A connect that the kernel saw fail on the server side: start a
    /// confirming probe (rate-limited), never take the backend out here.
    fn on_failed_connect(&mut self, record: lb_common::ConnectFailure) {
        let Some(backend) = self.probed.get(&record.backend_id) else {
            return;
        };
        // The streak is the kernel's: reset by every connect that
        // establishes.
        let consecutive = self
            .running
            .maps
            .connections(record.backend_id)
            .consecutive_failures;
        debug!(
            backend = %backend.addr,
            consecutive,
            "failed connect reported by the kernel: {}", evidence_words(record.evidence)
        );
        let threshold = u64::from(backend.connect_failures);
        if threshold == 0 || consecutive < threshold || !self.owner.is_healthy(record.backend_id) {
            return;
        }
        if !self
            .confirmer
            .report(record.backend_id, record.evidence, Instant::now())
        {
            return;
        }
        let (prober, addr, timeout) = (backend.prober.clone(), backend.addr, backend.timeout);
        let loop_id = backend.loop_id;
        let reports = self.reports_tx.clone();
        let backend_id = record.backend_id;
        tokio::spawn(async move {
            let started = Instant::now();
            let outcome = prober.probe(addr, timeout).await;
            let _ = reports
                .send(ProbeReport {
                    backend_id,
                    loop_id,
                    outcome,
                    took: started.elapsed(),
                    confirming: true,
                })
                .await;
        });
    }

    fn on_request(&mut self, request: control::Request) -> control::Reply {
        use control::Reply;
        let (backend, undo) = match request {
            control::Request::Drain { backend, undo } => (backend, undo),
            control::Request::Info => {
                return Reply {
                    info: Some(self.info()),
                    ..Reply::text(true, "")
                };
            }
        };
        let addr: SocketAddr = match backend.parse() {
            Ok(addr) => addr,
            Err(_) => {
                return Reply::text(
                    false,
                    format!("BACKEND: {backend:?} is not ADDR:PORT (IPv6 as [ADDR]:PORT)"),
                );
            }
        };
        let outcome = match self.owner.request_drain(addr, !undo) {
            Ok(outcome) => outcome,
            Err(error) => return Reply::text(false, format!("BACKEND: {error}")),
        };
        let message = match outcome {
            DrainOutcome::Unchanged(text) => return Reply::text(true, text),
            DrainOutcome::Draining => {
                format!("{addr}: draining; no new connections, existing ones stay")
            }
            DrainOutcome::Resumed => format!("{addr}: no longer draining"),
        };
        if self.owner.write(&mut self.running.maps) {
            Reply::text(true, message)
        } else {
            Reply::text(
                true,
                format!("{message} (the write failed and is retried within a second)"),
            )
        }
    }

    fn info(&self) -> control::DaemonInfo {
        let mut fleet: BTreeMap<String, control::FleetInfo> = BTreeMap::new();
        for (table, backend) in self.owner.layout().backends() {
            if table.slow_start.is_none() && table.rebalance.is_none() {
                continue;
            }
            let entry = fleet
                .entry(table.service.clone())
                .or_insert_with(|| control::FleetInfo {
                    service: table.service.clone(),
                    ramping: Vec::new(),
                    rebalance_moves: self
                        .rebalance_moves
                        .get(&table.service)
                        .copied()
                        .unwrap_or(0),
                });
            if let Some(step) = self.owner.ramp_step(backend.id) {
                entry.ramping.push((backend.addr.to_string(), step));
            }
        }
        control::DaemonInfo {
            fleet: fleet.into_values().collect(),
            config_generation: self.record.config_generation,
            last_reload: self.last_reload.clone(),
            services: self
                .sources
                .iter()
                .map(|(name, sources)| {
                    let effective = sources.effective();
                    control::ServiceSourcesInfo {
                        service: name.clone(),
                        following: effective.map(|(source, _)| source.as_str().to_string()),
                        backends: effective.map_or(0, |(_, set)| set.len()),
                        sources: sources
                            .states()
                            .into_iter()
                            .map(|(source, state)| (source.as_str().to_string(), state))
                            .collect(),
                    }
                })
                .collect(),
        }
    }

    fn verify_and_repair(&mut self) {
        let repairs = self
            .verifier
            .pass(&self.paths, &mut self.running, &mut self.owner);
        if !self.owner.is_dirty() && !self.pending_closes.is_empty() {
            for addr in std::mem::take(&mut self.pending_closes) {
                close_connections(&self.running.maps, addr);
            }
        }
        if repairs.is_empty() {
            return;
        }
        for kind in repairs {
            self.record.repairs[kind] += 1;
        }
        self.record.cgroup_id = self.running.attachment.cgroup().id;
        self.beat();
    }

    fn stop(&mut self) {
        self.record.flags &= !DAEMON_FLAG_RUNNING;
        self.beat();
        if self.options.cleanup_on_exit {
            let removal = dataplane::remove_pins(&self.paths);
            info!("removed the data plane ({} pins)", removal.removed.len());
            if removal.accelerated_open > 0 {
                info!(
                    "kept the sockhash pinned: {} accelerated sockets are still open and carry on over the normal path; `socklb uninstall` removes it once they closed",
                    removal.accelerated_open
                );
            }
        } else {
            info!("exiting; the data plane stays in place and keeps redirecting");
        }
    }
}
