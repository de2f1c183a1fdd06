//! The start of `socklb run`: the cgroup and the pin directory, the lock,
//! the kernel's features, discovery's first word, the data plane brought up
//! (or adopted) with the first tables, and the daemon's owners made.

use std::collections::BTreeMap;

use lb_common::{Settings, names};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{
    Daemon, DaemonError, Inputs, RunOptions, Signals,
    apply::{self, Checked, Checks},
    metrics::{self, Metrics},
    observe::Observer,
    plane::DataPlane,
    probes::Probes,
    rebalance::Rebalancer,
    reload,
    sources::{self, Sources},
    state::Owner,
};
use crate::{
    cgroup,
    config::Config,
    dataplane::{
        self, CgroupTarget, PinPaths, Running, StoreError,
        features::Features,
        lock::{self, InstallLock},
        pins,
    },
    discovery::{ServiceSources, persist::StateDir},
    errors,
};

/// Where this daemon installs, locked.
struct Place {
    cgroup: CgroupTarget,
    paths: PinPaths,
    lock: InstallLock,
}

/// The cgroup (checked), the pin directory (bpffs mounted, safe) and the
/// install lock.
fn claim_place(options: &RunOptions) -> Result<Place, DaemonError> {
    let path = match &options.cgroup {
        Some(dir) => dir.clone(),
        None => cgroup::v2_root()?,
    };
    let id = cgroup::check_v2_dir(&path)?;
    let paths = PinPaths::new(&options.pin_path);
    if pins::ensure_bpffs(&paths)? {
        info!("mounted bpffs on /sys/fs/bpf (mode 0700)");
    }
    pins::prepare_pin_dir(&paths)?;
    let lock = lock::lock(&paths)?;
    Ok(Place {
        cgroup: CgroupTarget { path, id },
        paths,
        lock,
    })
}

/// The kernel's features, each missing one said once, and the cookie of
/// this network namespace (0 without the feature).
fn probe_kernel() -> Result<(Features, u64), DaemonError> {
    let features = Features::probe();
    for degradation in features.degradations() {
        warn!("{degradation}");
    }
    let netns_cookie = if features.netns_cookie {
        dataplane::current_netns_cookie().map_err(|source| DaemonError::Io {
            what: "reading this network namespace's cookie (SO_NETNS_COOKIE)",
            source,
        })?
    } else {
        0
    };
    Ok((features, netns_cookie))
}

/// Step 1 of the apply path at start. A persisted or discovered set that
/// does not fit must not keep the daemon from starting: it then starts from
/// the configuration alone, and the sources answer again shortly.
fn check_first(
    config: &Config,
    sources: &mut BTreeMap<String, ServiceSources>,
    checks: &Checks<'_>,
) -> Result<Checked, DaemonError> {
    let first = apply::check(config, sources, None, checks);
    let checked = match first {
        Ok((checked, _)) => checked,
        Err(apply::ApplyError::Invalid(error)) => {
            warn!(
                "the persisted and discovered backends do not fit, starting from the configuration alone: {}",
                errors::chain(&error)
            );
            *sources = sources::plan_sources(config, &BTreeMap::new(), config);
            apply::check(config, sources, None, checks)?.0
        }
        Err(other) => return Err(other.into()),
    };
    for name in &checked.waiting {
        warn!(
            "{name}: no source has given a backend yet; its VIPs pass through untouched until one does"
        );
    }
    Ok(checked)
}

/// Brings the data plane up with the first tables: step 2 of the apply
/// path once the maps are open, the owner adopting what a previous daemon
/// left. Returns the owner and the backends the previous daemon served
/// that this configuration drops.
fn bring_up(
    place: &Place,
    options: &RunOptions,
    features: &Features,
    checked: &Checked,
    settings: Settings,
) -> Result<(Running, Owner, Vec<std::net::SocketAddr>), DaemonError> {
    let mut removed = Vec::new();
    let mut adopted = None;
    let load = dataplane::object::LoadOptions {
        log_level: options.bpf_log,
        features,
        socket_table_size: checked.effective.socket_table_size,
    };
    let running = dataplane::bring_up(&place.paths, place.cgroup.clone(), load, |maps| {
        let layout = apply::lay_out(checked, maps)?;
        apply::announce_hand_back(None, &layout);
        let mut owner = Owner::new(layout, settings);
        removed = owner.adopt(maps)?;
        if !owner.write(maps) {
            return Err(StoreError::new(
                names::SERVICES,
                "the first write of the tables failed",
            ));
        }
        adopted = Some(owner);
        Ok(())
    })?;
    let owner =
        adopted.ok_or_else(|| StoreError::new(names::SERVICES, "the maps were not prepared"))?;
    Ok((running, owner, removed))
}

/// Says how the data plane came up.
fn announce(running: &Running, paths: &PinPaths, services: usize) {
    for note in &running.notes {
        warn!("{note}");
    }
    info!(
        cgroup = %running.attachment.cgroup().path.display(),
        pin_path = %paths.dir.display(),
        services,
        "{}",
        match (running.upgraded, running.adopted) {
            (true, _) => "upgraded the pinned data plane in place",
            (false, true) => "adopted the pinned data plane",
            (false, false) => "installed the data plane",
        }
    );
    if dataplane::install::sk_msg_attached(running).is_none() {
        info!(
            "this kernel cannot list the sk_msg program on the sockhash (BPF_PROG_QUERY of a sockhash needs Linux 5.19): the verification pass does not check it"
        );
    }
}

/// The metrics endpoint and the file watch, with the channels they feed.
async fn listen(
    options: &RunOptions,
    metrics: &Metrics,
) -> Result<
    (
        mpsc::Receiver<metrics::Refresh>,
        Option<mpsc::UnboundedReceiver<()>>,
        Option<notify::RecommendedWatcher>,
    ),
    DaemonError,
> {
    let (refresh_tx, refresh) = mpsc::channel::<metrics::Refresh>(16);
    if let Some(addr) = options.metrics_addr {
        metrics::serve(addr, metrics.clone(), refresh_tx)
            .await
            .map_err(|source| DaemonError::Io {
                what: "listening for metrics (--metrics-addr)",
                source,
            })?;
    }
    let (changes, watch) = match (&options.config_path, options.watch_config) {
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
    Ok((refresh, changes, watch))
}

/// Starts the daemon: everything up to the event loop.
pub async fn start(options: RunOptions) -> Result<(Daemon, Inputs, Signals), DaemonError> {
    let place = claim_place(&options)?;
    // Before anything is installed: a SIGTERM during start-up must reach
    // the loop (and --cleanup-on-exit), not end the process half-way.
    let signals = Signals::install()?;
    let (features, host_netns_cookie) = probe_kernel()?;
    let state_dir = StateDir::new(&options.state_dir);
    let mut by_service = sources::first_word(&options.config, &state_dir).await;
    let checks = Checks {
        paths: &place.paths,
        cgroup: &place.cgroup,
        allow_overlap: options.allow_overlap,
    };
    let checked = check_first(&options.config, &mut by_service, &checks)?;
    let settings = Settings {
        host_netns_cookie,
        attached_cgroup_id: place.cgroup.id,
    };
    let (running, owner, removed) = bring_up(&place, &options, &features, &checked, settings)?;
    announce(&running, &place.paths, checked.effective.services.len());
    let (sweeps_tx, sweeps) = mpsc::channel(64);
    let mut plane = DataPlane::new(
        place.paths,
        running,
        features,
        place.lock,
        sweeps_tx,
        options.cleanup_on_exit,
    );
    plane.hold_handed_back(owner.layout());
    // Backends that a previous daemon served and this configuration drops
    // are gone from the tables now; close what socklb had sent to them.
    for addr in removed {
        info!("{addr} removed from the configuration");
        plane.close_failed(addr);
    }
    // Loading parsed the kernel's BTF and the object (megabytes, now
    // freed): give that memory back to the system.
    super::heap::trim();
    // Under systemd (Type=notify), the units ordered after socklb start
    // now: the hook is attached and redirects.
    super::notify_ready();
    let metrics = Metrics::new();
    let (refresh, config_changes, config_watch) = listen(&options, &metrics).await?;
    let (reports_tx, reports) = mpsc::channel(1024);
    let (discovery_tx, discovery) = mpsc::channel(256);
    let mut probes = Probes::new(reports_tx);
    probes.start_all(&owner);
    let sources = Sources::start(
        options.config.clone(),
        options.config_path.clone(),
        by_service,
        (checked.effective, checked.waiting),
        state_dir,
        discovery_tx,
    );
    let daemon = Daemon {
        sources,
        probes,
        owner,
        plane,
        observer: Observer::new(metrics),
        rebalancer: Rebalancer::default(),
        allow_overlap: options.allow_overlap,
    };
    let inputs = Inputs {
        reports,
        discovery,
        config_changes,
        _config_watch: config_watch,
        refresh,
        sweeps,
        reload_at: None,
    };
    Ok((daemon, inputs, signals))
}
