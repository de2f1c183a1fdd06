//! `socklb run`: bring the data plane up, probe the backends, keep the
//! tables in step with their health, and verify twice a second that the
//! kernel still holds what socklb wrote.
//!
//! The daemon is a few owners, each of one concern, joined by one event
//! loop ([`Daemon::serve`]) that only routes events between them
//! (`routes.rs`):
//! - [`sources::Sources`]: the configuration as read and what discovery
//!   says of each service's backends;
//! - [`probes::Probes`]: the probe loops, and the kernel's passive signal,
//!   which only hurries them;
//! - [`state::Owner`]: health verdicts, drains, slow starts and steering:
//!   what the tables should hold, and whose connections to close;
//! - [`plane::DataPlane`]: the kernel: maps, links, the heartbeat, the
//!   verification pass, and the sweeps that close connections off the loop;
//! - [`observe::Observer`]: metrics, and what `status` learns of the daemon;
//! - [`rebalance::Rebalancer`]: the rebalancing decisions, a pure step.
//!
//! Start and every change apply an effective configuration the same way
//! (`apply.rs`).

mod accept;
mod apply;
pub mod control;
pub mod heap;
pub mod metrics;
mod observe;
pub mod passive;
mod plane;
mod probes;
pub mod rebalance;
mod reload;
mod rings;
mod routes;
mod socket_table;
mod sources;
mod startup;
pub mod state;
mod sweep;
mod takeover;
mod verify;

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use tokio::{
    signal::unix::{Signal, SignalKind, signal},
    sync::mpsc,
    time::Instant,
};
use tracing::{info, warn};

pub use crate::protocol::ReloadStatus;
use crate::{
    cgroup::CgroupError,
    config::Config,
    dataplane::{BpfLogLevel, KernelError, StoreError, lock::RunPaths},
    discovery::SourceEvent,
    health::ProbeReport,
};
pub use apply::ApplyError;
use observe::Observer;
use plane::DataPlane;
use probes::Probes;
use rebalance::Rebalancer;
use rings::Rings;
use sources::Sources;
use state::Owner;
use sweep::SweepDone;

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
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error("{what}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
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

/// The running daemon: its owners (see the module documentation).
struct Daemon {
    sources: Sources,
    probes: Probes,
    owner: Owner,
    plane: DataPlane,
    observer: Observer,
    rebalancer: Rebalancer,
    /// `--allow-overlap`: another install is never looked for.
    allow_overlap: bool,
}

/// Where the loop's events come from, besides the kernel and signals.
struct Inputs {
    reports: mpsc::Receiver<ProbeReport>,
    discovery: mpsc::Receiver<SourceEvent>,
    config_changes: Option<mpsc::UnboundedReceiver<()>>,
    /// Keeps the file watch alive.
    _config_watch: Option<notify::RecommendedWatcher>,
    refresh: mpsc::Receiver<metrics::Refresh>,
    sweeps: mpsc::Receiver<SweepDone>,
    /// When a changed file is read: the events of one change come in a
    /// burst (truncate, write, rename), and the loop goes on meanwhile.
    reload_at: Option<Instant>,
}

/// The next change of the configuration file; pending forever without
/// --watch-config.
async fn next_change(changes: &mut Option<mpsc::UnboundedReceiver<()>>) -> Option<()> {
    match changes.as_mut() {
        Some(changes) => changes.recv().await,
        None => std::future::pending().await,
    }
}

/// Until `at`; pending forever without it.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(options: RunOptions) -> Result<(), DaemonError> {
    let (mut daemon, inputs, mut signals) = startup::start(options).await?;
    let result = daemon.serve(inputs, &mut signals).await;
    daemon.plane.stop();
    result
}

impl Daemon {
    /// The event loop: each event goes to the owner it concerns.
    async fn serve(
        &mut self,
        mut inputs: Inputs,
        signals: &mut Signals,
    ) -> Result<(), DaemonError> {
        let mut rings = Rings::open(&self.plane.paths, &self.plane.running);
        let (control_tx, mut control) = mpsc::channel(16);
        let control_path = RunPaths::of(&self.plane.paths).control;
        if let Err(error) = control::serve(&control_path, control_tx) {
            warn!(
                "control socket {}: {error}; `socklb drain` cannot reach this daemon",
                control_path.display()
            );
        }
        self.plane.start_record();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut trim =
            tokio::time::interval_at(Instant::now() + heap::TRIM_EVERY, heap::TRIM_EVERY);
        trim.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                Some(report) = inputs.reports.recv() => self.on_probe(report),
                Some(event) = inputs.discovery.recv() => self.on_discovery(event),
                Some(()) = next_change(&mut inputs.config_changes) => {
                    inputs.reload_at.get_or_insert(Instant::now() + reload::SETTLE);
                }
                () = until(inputs.reload_at) => {
                    inputs.reload_at = None;
                    if let Some(changes) = inputs.config_changes.as_mut() {
                        while changes.try_recv().is_ok() {}
                    }
                    self.reload("config file changed");
                }
                Some(done) = inputs.refresh.recv() => {
                    self.observer.metrics.set_snapshot(self.plane.status());
                    let _ = done.send(());
                }
                records = rings.failed_connects() => {
                    for record in records {
                        self.on_failed_connect(record);
                    }
                }
                Some(done) = inputs.sweeps.recv() => self.on_sweep(done),
                Some(incoming) = control.recv() => {
                    let reply = self.on_request(incoming.request);
                    let _ = incoming.reply.send(reply);
                }
                _ = tick.tick() => self.on_tick(),
                _ = trim.tick() => heap::trim(),
                _ = signals.terminate.recv() => { info!("SIGTERM"); break; }
                _ = signals.interrupt.recv() => { info!("SIGINT"); break; }
                _ = signals.hangup.recv() => self.reload("SIGHUP"),
            }
        }
        let _ = std::fs::remove_file(&control_path);
        Ok(())
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
