//! `socklb run`: bring the data plane up, probe the backends, keep the
//! tables in step with their health, and verify twice a second that the
//! kernel still holds what socklb wrote.
//!
//! [`state::Owner`] owns all state. Probe tasks, the kernel's ring buffer,
//! the control socket and the signals only report to the event loop here,
//! which feeds the owner and acts on what it returns.

pub mod control;
pub mod passive;
pub mod state;
mod verify;

use std::{
    collections::HashMap,
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
    errors,
    health::{ProbeReport, Transition, probe::Prober, probe_loop},
    planner::{Layout, endpoint},
    sockets,
};
use passive::{Confirmer, evidence_words, parse_connect_failure};
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
}

/// What the loop keeps per probed backend.
struct ProbedBackend {
    addr: SocketAddr,
    prober: Prober,
    timeout: Duration,
    /// How a passing probe is described in a transition message.
    success_words: String,
    /// Set by the loop while the backend is down; read by its probe loop.
    down: watch::Sender<bool>,
    close_on_failure: bool,
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
    options: RunOptions,
    paths: PinPaths,
    owner: Owner,
    running: Running,
    probed: HashMap<u32, ProbedBackend>,
    reports_tx: mpsc::Sender<ProbeReport>,
    confirmer: Confirmer,
    record: DaemonRecord,
    verifier: verify::Verifier,
    features: Features,
    _lock: InstallLock,
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
    let layout = Layout::from_config(&options.config, is_local_address);
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
        let layout = Layout::keeping(&options.config, is_local_address, &known);
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
        services = options.config.services.len(),
        "{}",
        match (running.upgraded, running.adopted) {
            (true, _) => "upgraded the pinned data plane in place",
            (false, true) => "adopted the pinned data plane",
            (false, false) => "installed the data plane",
        }
    );
    let (reports_tx, reports) = mpsc::channel::<ProbeReport>(1024);
    let mut daemon = Daemon {
        record: DaemonRecord::default(),
        paths,
        owner,
        running,
        probed: HashMap::new(),
        reports_tx,
        confirmer: Confirmer::default(),
        verifier: verify::Verifier::default(),
        features,
        options,
        _lock: install_lock,
    };
    daemon.start_record();
    daemon.start_probes()?;
    let result = daemon.serve(reports, &mut signals).await;
    daemon.stop();
    result
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
    let others = shadow::overlapping(paths, cgroup, &vips).map_err(|source| DaemonError::Io {
        what: "looking for other socklb installs (needs CAP_SYS_ADMIN)",
        source,
    })?;
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

    fn start_probes(&mut self) -> Result<(), DaemonError> {
        for table in &self.owner.layout().tables {
            let prober = Prober::new(&table.health.probe).map_err(DaemonError::Probe)?;
            for backend in &table.backends {
                let (down, down_receiver) = watch::channel(!self.owner.is_healthy(backend.id));
                tokio::spawn(probe_loop(
                    backend.id,
                    backend.addr,
                    prober.clone(),
                    table.health.clone(),
                    down_receiver,
                    self.reports_tx.clone(),
                ));
                self.probed.insert(
                    backend.id,
                    ProbedBackend {
                        addr: backend.addr,
                        success_words: prober.success_words(),
                        prober: prober.clone(),
                        timeout: table.health.timeout,
                        down,
                        close_on_failure: table.close_on_failure,
                        connect_failures: table.health.connect_failures,
                    },
                );
            }
        }
        Ok(())
    }

    async fn serve(
        &mut self,
        mut reports: mpsc::Receiver<ProbeReport>,
        signals: &mut Signals,
    ) -> Result<(), DaemonError> {
        let mut connect_failures = readable(
            dataplane::install::open_connect_failures(&self.paths)
                .map_err(|error| error.to_string()),
            "failed connects seen by the kernel will not be acted on",
        );
        let logging_program = self
            .running
            .ebpf
            .program(names::CONNECT4)
            .and_then(|program| program.info().ok())
            .map(|info| info.id());
        let mut kernel_logs = readable(
            logging_program
                .ok_or_else(|| "no program id".to_string())
                .and_then(|id| aya_log::EbpfLogger::init_from_id(id).map_err(|e| e.to_string())),
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
                Some(report) = reports.recv() => self.on_probe(report),
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
                    self.verify_and_repair();
                }
                _ = signals.terminate.recv() => { info!("SIGTERM"); break; }
                _ = signals.interrupt.recv() => { info!("SIGINT"); break; }
                _ = signals.hangup.recv() => self.on_hangup(),
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

    /// Logs a backend's transition once, writes the tables, and closes the
    /// connections to a backend that went down. `wake`: let the backend's
    /// probe loop know at once (a verdict that did not come from it).
    fn apply(&mut self, backend_id: u32, transition: Option<Transition>, wake: bool) {
        let Some(backend) = self.probed.get(&backend_id) else {
            return;
        };
        if let Some(transition) = &transition {
            let message = transition.message(backend.addr);
            if transition.healthy {
                info!("{message}");
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
        if went_down && backend.close_on_failure && self.features.sock_destroy {
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
        let reports = self.reports_tx.clone();
        let backend_id = record.backend_id;
        tokio::spawn(async move {
            let outcome = prober.probe(addr, timeout).await;
            let _ = reports
                .send(ProbeReport {
                    backend_id,
                    outcome,
                    confirming: true,
                })
                .await;
        });
    }

    fn on_request(&mut self, request: control::Request) -> control::Reply {
        let control::Request::Drain { backend, undo } = request;
        let addr: SocketAddr = match backend.parse() {
            Ok(addr) => addr,
            Err(_) => {
                return control::Reply {
                    ok: false,
                    message: format!("BACKEND: {backend:?} is not ADDR:PORT (IPv6 as [ADDR]:PORT)"),
                };
            }
        };
        let outcome = match self.owner.request_drain(addr, !undo) {
            Ok(outcome) => outcome,
            Err(error) => {
                return control::Reply {
                    ok: false,
                    message: format!("BACKEND: {error}"),
                };
            }
        };
        let message = match outcome {
            DrainOutcome::Unchanged(text) => {
                return control::Reply {
                    ok: true,
                    message: text,
                };
            }
            DrainOutcome::Draining => {
                format!("{addr}: draining; no new connections, existing ones stay")
            }
            DrainOutcome::Resumed => format!("{addr}: no longer draining"),
        };
        if self.owner.write(&mut self.running.maps) {
            control::Reply { ok: true, message }
        } else {
            control::Reply {
                ok: true,
                message: format!("{message} (the write failed and is retried within a second)"),
            }
        }
    }

    /// SIGHUP: read the configuration again. Until live reload exists, a
    /// change is reported and the running configuration stays.
    fn on_hangup(&mut self) {
        let Some(path) = self.options.config_path.clone() else {
            info!("SIGHUP: the configuration came from flags; nothing to read again");
            return;
        };
        match config::load_file(&path) {
            Err(error) => warn!(
                "SIGHUP: {} is not valid; the running configuration stays: {}",
                path.display(),
                errors::chain(&error)
            ),
            Ok(config) if config == self.options.config => {
                info!("SIGHUP: {} is unchanged", path.display())
            }
            Ok(_) => warn!(
                "SIGHUP: {} changed, but live reload is not supported yet; restart socklb to apply it (the running configuration stays)",
                path.display()
            ),
        }
    }

    fn verify_and_repair(&mut self) {
        let repairs = self
            .verifier
            .pass(&self.paths, &mut self.running, &mut self.owner);
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
            let removed = dataplane::remove_pins(&self.paths);
            info!("removed the data plane ({} pins)", removed.len());
        } else {
            info!("exiting; the data plane stays in place and keeps redirecting");
        }
    }
}
