//! `socklb run`: install or adopt the data plane, probe the backends, and
//! keep the tables in step with their health.
//!
//! One task owns all state. Probe tasks only report outcomes to it; it feeds
//! the trackers, logs each transition once, asks the planner for the new
//! tables and writes the ones that changed.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    path::PathBuf,
    time::Duration,
};

use lb_common::{BackendInfo, ConnectFailure, Endpoint, Settings, bank_base};
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{SignalKind, signal},
    sync::{mpsc, watch},
};
use tracing::{debug, info, warn};

use crate::{
    cgroup::{self, CgroupError},
    config::Config,
    health::{HealthTracker, ProbeReport, Transition, probe_loop},
    kernel::{self, BackendHealth, BpfLogLevel, Dataplane, KernelError, PinPaths},
    planner::{Layout, TableContents, endpoint, plan, socket_addr},
    probe::{ProbeSetupError, Prober},
    sockets,
};

/// How often the daemon checks that the maps still hold what it wrote.
const RECONCILE_INTERVAL: Duration = Duration::from_secs(5);
/// How often the daemon looks for `socklb drain` requests.
const DRAIN_CHECK_INTERVAL: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("health probe: {0}")]
    Probe(ProbeSetupError),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
}

/// Everything `socklb run` needs, validated.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub config: Config,
    /// None: the root of the cgroup v2 hierarchy.
    pub cgroup: Option<PathBuf>,
    pub pin_path: PathBuf,
    pub cleanup_on_exit: bool,
    pub bpf_log: BpfLogLevel,
}

/// What the owner keeps per probed backend.
struct ProbedBackend {
    id: u32,
    addr: SocketAddr,
    /// How a passing probe is described in a transition message.
    success_words: String,
    /// Set by the owner while the backend is down; read by its probe loop.
    down: watch::Sender<bool>,
    close_on_failure: bool,
    /// Failed connects in a row that take it out (0: never).
    connect_failures: u32,
}

/// One record of the `CONNECT_FAILURES` ring buffer.
fn parse_connect_failure(bytes: &[u8]) -> Option<ConnectFailure> {
    if bytes.len() < std::mem::size_of::<ConnectFailure>() {
        return None;
    }
    // SAFETY: the length is checked; ConnectFailure is plain integers.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<ConnectFailure>()) })
}

/// Closes the connections socklb sent to a backend that just failed, after
/// its table no longer lists it, so the clients reconnect elsewhere.
fn close_connections(dataplane: &Dataplane, addr: SocketAddr) {
    let target = endpoint(&addr);
    let result = tokio::task::block_in_place(|| {
        sockets::destroy_redirected(addr, |cookie| dataplane.redirected_to(cookie, &target))
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

/// The single owner of health state and of what was written.
struct State {
    layout: Layout,
    trackers: HashMap<u32, HealthTracker>,
    /// Backends that take no new connections: from the config, or asked
    /// for with `socklb drain` (read from `DRAINS`).
    draining: HashSet<u32>,
    written: Vec<TableContents>,
    /// A write failed; the next check tries again.
    dirty: bool,
    /// Link pins found missing (reported once each).
    missing_links: HashSet<&'static str>,
    /// Per backend, the kernel's consecutive-failure count when it last
    /// became healthy: only failures after that count against it.
    failure_baseline: HashMap<u32, u32>,
}

impl State {
    fn is_healthy(&self, backend_id: u32) -> bool {
        self.trackers
            .get(&backend_id)
            .is_some_and(HealthTracker::is_healthy)
    }

    fn health(&self, backend_id: u32) -> BackendHealth {
        self.trackers
            .get(&backend_id)
            .map_or_else(BackendHealth::default, |tracker| BackendHealth {
                healthy: tracker.is_healthy(),
                probed: tracker.is_settled(),
                draining: self.draining.contains(&backend_id),
            })
    }

    /// A draining backend is planned like an unhealthy one: out of the
    /// healthy list, still in the fail-open list.
    fn plan(&self) -> Vec<TableContents> {
        plan(&self.layout, |id| {
            self.is_healthy(id) && !self.draining.contains(&id)
        })
    }

    /// Recomputes the draining set from the config and the drain requests;
    /// logs each change once and returns whether anything changed.
    fn update_draining(&mut self, requests: &HashSet<Endpoint>) -> bool {
        let draining: HashSet<u32> = self
            .layout
            .backends()
            .filter(|(_, backend)| backend.drain || requests.contains(&endpoint(&backend.addr)))
            .map(|(_, backend)| backend.id)
            .collect();
        if draining == self.draining {
            return false;
        }
        for (_, backend) in self.layout.backends() {
            match (
                self.draining.contains(&backend.id),
                draining.contains(&backend.id),
            ) {
                (false, true) => info!(
                    "{} draining: no new connections, existing ones stay",
                    backend.addr
                ),
                (true, false) => info!("{} no longer draining", backend.addr),
                _ => {}
            }
        }
        self.draining = draining;
        true
    }

    /// Seeds each tracker from the pinned record of a previous daemon for
    /// the same service and address (ids may have moved with a changed
    /// config), so a restart neither re-admits a dead backend nor drops a
    /// live one. A record whose health was only assumed seeds nothing.
    fn seed(&mut self, known: &HashMap<(String, Endpoint), BackendInfo>) {
        for (table, backend) in self.layout.backends() {
            let key = (table.service.clone(), endpoint(&backend.addr));
            let tracker = match known.get(&key) {
                Some(info) if info.probed != 0 => {
                    HealthTracker::known(&table.health, info.healthy != 0)
                }
                _ => HealthTracker::unknown(&table.health),
            };
            self.trackers.insert(backend.id, tracker);
        }
    }

    /// Logs a backend's transition once, writes the tables, and closes the
    /// connections to a backend that went down.
    /// `wake_probe`: probe the backend again now (after a verdict that did
    /// not come from its own probes) rather than at its next interval.
    fn apply(
        &mut self,
        dataplane: &mut Dataplane,
        backend: &ProbedBackend,
        transition: Option<Transition>,
        wake_probe: bool,
    ) {
        let healthy = transition.as_ref().map(|transition| transition.healthy);
        if let Some(transition) = &transition {
            let message = transition.message(backend.addr);
            if transition.healthy {
                info!("{message}");
            } else {
                warn!("{message}");
            }
        }
        if let Some(healthy) = healthy {
            let down_now = !healthy;
            backend.down.send_if_modified(|down| {
                let changed = *down != down_now;
                *down = down_now;
                changed && wake_probe
            });
            if healthy {
                let failures = dataplane.connections(backend.id).consecutive_failures;
                self.failure_baseline.insert(backend.id, failures);
            }
        }
        if !self.write_or_retry_later(dataplane) {
            // The table may still list the backend: closing its connections
            // now would only send the clients back to it.
            return;
        }
        if healthy == Some(false) && backend.close_on_failure {
            close_connections(dataplane, backend.addr);
        }
    }

    /// Writes the changed tables; on failure, marks the state dirty so the
    /// next check tries again. Returns whether the kernel is up to date.
    fn write_or_retry_later(&mut self, dataplane: &mut Dataplane) -> bool {
        match self.write_changes(dataplane) {
            Ok(()) => {
                self.dirty = false;
                true
            }
            Err(error) => {
                warn!("writing the new tables failed, will retry on the next check: {error}");
                self.dirty = true;
                false
            }
        }
    }

    /// Failed connects in a row since the backend last became healthy.
    fn failures_since_healthy(&self, backend_id: u32, consecutive: u32) -> u32 {
        consecutive.saturating_sub(self.failure_baseline.get(&backend_id).copied().unwrap_or(0))
    }

    /// Writes every table whose contents changed, and the records.
    fn write_changes(&mut self, dataplane: &mut Dataplane) -> Result<(), KernelError> {
        let planned = self.plan();
        dataplane.write_records(&self.layout, |id| self.health(id))?;
        for ((table, new), old) in self.layout.tables.iter().zip(&planned).zip(&self.written) {
            if new != old {
                dataplane.write_table(table, new)?;
                info!(
                    service = %table.service,
                    healthy_slots = new.healthy.len(),
                    "table {} replaced", table.table_id
                );
            }
        }
        self.written = planned;
        Ok(())
    }

    /// Restores what someone else changed in our maps, and says loudly what
    /// changed: a VIP entry that differs from what was written (or is gone),
    /// and a VIP entry we never wrote, which would redirect an address that
    /// is no VIP of ours. Also retries a write that failed. A removed link
    /// pin cannot be restored without reloading the programs; it is reported
    /// once.
    fn reconcile(
        &mut self,
        dataplane: &mut Dataplane,
        paths: &PinPaths,
    ) -> Result<(), KernelError> {
        for program in kernel::PROGRAMS {
            let link = paths.link(program);
            if !link.exists() && self.missing_links.insert(program) {
                warn!(
                    "{} was removed by someone else: {program} is detached; restart socklb after `socklb uninstall` to restore it",
                    link.display()
                );
            }
        }
        if self.dirty {
            self.write_or_retry_later(dataplane);
        }
        let entries: HashMap<_, _> = dataplane.service_entries().into_iter().collect();
        let ours: HashSet<Endpoint> = self
            .layout
            .tables
            .iter()
            .flat_map(|table| table.vips.iter().map(endpoint))
            .collect();
        if let Some(stranger) = entries.keys().find(|vip| !ours.contains(vip)) {
            warn!(
                "someone else added a SERVICES entry for {}; removing it",
                socket_addr(stranger)
                    .map_or_else(|| format!("{stranger:?}"), |addr| addr.to_string())
            );
            dataplane.remove_stale(&self.layout)?;
        }
        for (table, contents) in self.layout.tables.iter().zip(&self.written) {
            let tampered = table.vips.iter().find(|vip| {
                entries.get(&endpoint(vip)).is_none_or(|entry| {
                    entry.table_id != table.table_id
                        || entry.flags != table.flags
                        || (entry.bank_base != bank_base(table.table_id, 0)
                            && entry.bank_base != bank_base(table.table_id, 1))
                        || entry.healthy_slots as usize != contents.healthy.len()
                        || entry.all_slots as usize != contents.all.len()
                })
            });
            if let Some(vip) = tampered {
                warn!(
                    "the SERVICES entry of VIP {vip} (service {}) was changed or removed by someone else; restoring it",
                    table.service
                );
                dataplane.write_table(table, contents)?;
            }
        }
        Ok(())
    }
}

/// Whether an address belongs to this host: only a local address can be
/// bound. (All of 127.0.0.0/8 counts, as the kernel routes it locally.)
fn is_local_address(ip: std::net::IpAddr) -> bool {
    std::net::UdpSocket::bind((ip, 0)).is_ok()
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

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(options: RunOptions) -> Result<(), DaemonError> {
    let cgroup_dir = match &options.cgroup {
        Some(dir) => dir.clone(),
        None => cgroup::v2_root()?,
    };
    let cgroup_id = cgroup::check_v2_dir(&cgroup_dir)?;
    let paths = PinPaths::new(&options.pin_path);
    if kernel::ensure_bpffs(&paths)? {
        info!("mounted bpffs on /sys/fs/bpf");
    }
    let _lock = kernel::lock_pin_dir(&paths)?;
    // Before anything is installed: a SIGTERM during start-up must reach
    // the loop (and --cleanup-on-exit), not end the process half-way.
    let signal_error = |source| DaemonError::Io {
        what: "installing signal handlers",
        source,
    };
    let mut sigterm = signal(SignalKind::terminate()).map_err(signal_error)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(signal_error)?;
    let host_netns_cookie = kernel::current_netns_cookie().map_err(|source| DaemonError::Io {
        what: "reading this network namespace's cookie (SO_NETNS_COOKIE)",
        source,
    })?;

    let mut state = State {
        layout: Layout::from_config(&options.config, is_local_address),
        trackers: HashMap::new(),
        draining: HashSet::new(),
        written: Vec::new(),
        dirty: false,
        missing_links: HashSet::new(),
        failure_baseline: HashMap::new(),
    };
    let mut removed: Vec<SocketAddr> = Vec::new();
    let installed = kernel::install_or_adopt(
        &paths,
        &cgroup_dir,
        cgroup_id,
        options.bpf_log,
        |dataplane| {
            let previous: HashMap<u32, BackendInfo> =
                dataplane.backend_records().into_iter().collect();
            let kept: HashSet<Endpoint> = state
                .layout
                .backends()
                .map(|(_, backend)| endpoint(&backend.addr))
                .collect();
            removed = previous
                .values()
                .filter(|info| !kept.contains(&info.target))
                .filter_map(|info| socket_addr(&info.target))
                .collect();
            let service_of: HashMap<u32, String> = dataplane
                .table_records()
                .into_iter()
                .map(|(id, info)| (id, kernel::table_name(&info)))
                .collect();
            let known: HashMap<(String, Endpoint), BackendInfo> = previous
                .values()
                .filter_map(|info| {
                    Some((
                        (service_of.get(&info.table_id)?.clone(), info.target),
                        *info,
                    ))
                })
                .collect();
            state.seed(&known);
            state.update_draining(&dataplane.drain_requests());
            dataplane.write_settings(Settings {
                host_netns_cookie,
                attached_cgroup_id: cgroup_id,
            })?;
            state.written = state.plan();
            dataplane.write_all(&state.layout, &state.written, |id| state.health(id))
        },
    )?;
    let mut dataplane = installed.dataplane;
    // Backends that a previous daemon served and this configuration drops
    // are gone from the tables now; close what socklb had sent to them.
    for addr in removed {
        info!("{addr} removed from the configuration");
        close_connections(&dataplane, addr);
    }
    info!(
        cgroup = %cgroup_dir.display(),
        pin_path = %paths.dir.display(),
        services = options.config.services.len(),
        "{}",
        if installed.adopted { "adopted the pinned data plane" } else { "installed the data plane" }
    );

    let mut kernel_logs = readable(
        aya_log::EbpfLogger::init_from_id(installed.logging_program_id)
            .map_err(|error| error.to_string()),
        "kernel program logs will not be forwarded",
    );

    let (reports_tx, mut reports) = mpsc::channel::<ProbeReport>(1024);
    let mut probed: HashMap<u32, ProbedBackend> = HashMap::new();
    for table in &state.layout.tables {
        let prober = Prober::new(&table.health.probe).map_err(DaemonError::Probe)?;
        for backend in &table.backends {
            let (down, down_receiver) = watch::channel(!state.is_healthy(backend.id));
            tokio::spawn(probe_loop(
                backend.id,
                backend.addr,
                prober.clone(),
                table.health.clone(),
                down_receiver,
                reports_tx.clone(),
            ));
            let success_words = prober.success_words();
            probed.insert(
                backend.id,
                ProbedBackend {
                    id: backend.id,
                    addr: backend.addr,
                    success_words,
                    down,
                    close_on_failure: table.close_on_failure,
                    connect_failures: table.health.connect_failures,
                },
            );
        }
    }
    drop(reports_tx);
    let mut connect_failures = readable(
        kernel::open_connect_failures(&paths).map_err(|error| error.to_string()),
        "failed connects seen by the kernel will not be acted on",
    );

    let mut reconcile = tokio::time::interval(RECONCILE_INTERVAL);
    reconcile.tick().await;
    let mut drain_check = tokio::time::interval(DRAIN_CHECK_INTERVAL);
    drain_check.tick().await;

    loop {
        tokio::select! {
            Some(report) = reports.recv() => {
                let Some(tracker) = state.trackers.get_mut(&report.backend_id) else { continue };
                let was_settled = tracker.is_settled();
                let backend = &probed[&report.backend_id];
                let transition = tracker.record(&report.outcome, &backend.success_words);
                // A first answer that confirms the assumed state changes no
                // table, but status must stop calling the backend unknown.
                let newly_settled = !was_settled && tracker.is_settled();
                if transition.is_some() || newly_settled {
                    state.apply(&mut dataplane, backend, transition, false);
                }
            }
            Some(mut guard) = async {
                match connect_failures.as_mut() {
                    Some(ring) => ring.readable_mut().await.ok(),
                    None => std::future::pending().await,
                }
            } => {
                let mut failures = Vec::new();
                while let Some(record) = guard.get_inner_mut().next() {
                    failures.extend(parse_connect_failure(&record));
                }
                guard.clear_ready();
                for failure in failures {
                    debug!(
                        backend_id = failure.backend_id,
                        consecutive = failure.consecutive_failures,
                        "failed connect reported by the kernel"
                    );
                    let count = state.failures_since_healthy(failure.backend_id, failure.consecutive_failures);
                    let backend = match probed.get(&failure.backend_id) {
                        Some(backend) if backend.connect_failures > 0 && count >= backend.connect_failures => backend,
                        _ => continue,
                    };
                    let Some(tracker) = state.trackers.get_mut(&failure.backend_id) else { continue };
                    let transition = tracker.mark_down(format!("{count} failed connects in a row"), count);
                    if transition.is_some() {
                        state.apply(&mut dataplane, backend, transition, true);
                    }
                }
            }
            _ = sigterm.recv() => { info!("SIGTERM"); break; }
            _ = sigint.recv() => { info!("SIGINT"); break; }
            _ = drain_check.tick() => {
                if state.update_draining(&dataplane.drain_requests()) || state.dirty {
                    state.write_or_retry_later(&mut dataplane);
                }
            }
            _ = reconcile.tick() => {
                if let Err(error) = state.reconcile(&mut dataplane, &paths) {
                    warn!("reconcile failed: {error}");
                }
            }
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

    if options.cleanup_on_exit {
        drop(dataplane);
        let removed = kernel::remove_pins(&paths);
        info!("removed the data plane ({} pins)", removed.len());
    } else {
        info!("exiting; the data plane stays in place and keeps redirecting");
    }
    Ok(())
}
