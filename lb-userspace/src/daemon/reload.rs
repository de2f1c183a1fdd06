//! Changes of the configuration while the daemon runs: a reloaded file
//! (SIGHUP, `--watch-config`) and the backend sets discovery reports. Both
//! end in [`Daemon::install_effective`], which moves the tables, the probes
//! and the state directory to the new effective configuration in place.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use serde::{Deserialize, Serialize};
use tokio::{sync::mpsc, task::JoinHandle};
use tracing::{info, warn};

use super::{Daemon, close_connections, is_local_address, refuse_overlap};
use crate::{
    config::{self, Config, SliceSource},
    discovery::{
        self, ServiceSources, Source, SourceEvent, effective_config,
        persist::{Persisted, StateDir},
    },
    errors,
    planner::Layout,
};

/// How a discovery watcher is set up; a changed spec restarts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum WatchSpec {
    K3s(PathBuf),
    Slices(SliceSource),
}

/// The running discovery watchers, by service and source.
#[derive(Default)]
pub(super) struct Watchers {
    tasks: HashMap<(String, Source), (WatchSpec, JoinHandle<()>)>,
}

impl Drop for Watchers {
    fn drop(&mut self) {
        for (_, task) in self.tasks.values() {
            task.abort();
        }
    }
}

/// The watchers a configuration asks for.
fn wanted(config: &Config) -> Vec<((String, Source), WatchSpec)> {
    let mut specs = Vec::new();
    for service in &config.services {
        if let Some(path) = &service.discovery.k3s_state {
            specs.push((
                (service.name.clone(), Source::K3sState),
                WatchSpec::K3s(path.clone()),
            ));
        }
        if let Some(slices) = &service.discovery.endpoint_slices {
            specs.push((
                (service.name.clone(), Source::EndpointSlices),
                WatchSpec::Slices(slices.clone()),
            ));
        }
    }
    specs
}

impl Watchers {
    /// Starts, keeps or stops watchers so that they match `config`.
    pub(super) fn follow(&mut self, config: &Config, events: &mpsc::Sender<SourceEvent>) {
        let wanted = wanted(config);
        self.tasks.retain(|key, (spec, task)| {
            let keep = wanted
                .iter()
                .any(|(wanted_key, wanted_spec)| wanted_key == key && wanted_spec == spec);
            if !keep {
                task.abort();
            }
            keep
        });
        for (key, spec) in wanted {
            if self.tasks.contains_key(&key) {
                continue;
            }
            let events = events.clone();
            let service = key.0.clone();
            let task = match &spec {
                WatchSpec::K3s(path) => {
                    tokio::spawn(discovery::k3s::follow(service, path.clone(), events))
                }
                WatchSpec::Slices(slices) => {
                    tokio::spawn(discovery::slices::follow(service, slices.clone(), events))
                }
            };
            self.tasks.insert(key, (spec, task));
        }
    }
}

/// The sources of each service of `config`, carrying over what `previous`
/// learnt from every source configured the same way in both.
pub(super) fn plan_sources(
    config: &Config,
    previous: &BTreeMap<String, ServiceSources>,
    previous_config: &Config,
) -> BTreeMap<String, ServiceSources> {
    let old_specs: HashMap<(String, Source), WatchSpec> =
        wanted(previous_config).into_iter().collect();
    let new_specs: HashMap<(String, Source), WatchSpec> = wanted(config).into_iter().collect();
    config
        .services
        .iter()
        .map(|service| {
            let mut sources = ServiceSources::new(service);
            if let Some(old) = previous.get(&service.name) {
                sources.carry_over(old, |source| {
                    let key = (service.name.clone(), source);
                    old_specs
                        .get(&key)
                        .is_some_and(|old| new_specs.get(&key) == Some(old))
                });
            }
            (service.name.clone(), sources)
        })
        .collect()
}

/// The result of the last reload, for `socklb status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadStatus {
    pub ok: bool,
    /// Seconds since the epoch.
    pub at: u64,
    /// "applied (generation 3)", "unchanged", or the errors.
    pub message: String,
}

impl ReloadStatus {
    fn now(ok: bool, message: String) -> Self {
        let at = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs());
        Self { ok, at, message }
    }
}

/// Watches the configuration file's directory (editors and config
/// management replace the file) and sends a unit on each change of it.
pub(super) fn watch_file(
    path: &Path,
    changed: mpsc::UnboundedSender<()>,
) -> notify::Result<notify::RecommendedWatcher> {
    use notify::Watcher;
    let name = path.file_name().map(ToOwned::to_owned);
    let directory = path
        .parent()
        .filter(|parent| !parent.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // The file itself, or `..data`: a Kubernetes ConfigMap volume
        // swaps that symlink to publish a new version, and the file (a
        // symlink into it) never changes itself.
        // An event without paths (the kernel's queue overflowed, a
        // rescan) may hide a change: read the file again.
        let ours = event.as_ref().map_or(true, |event| {
            event.paths.is_empty()
                || event.need_rescan()
                || (discovery::is_content_change(event)
                    && event.paths.iter().any(|path| {
                        let file = path.file_name();
                        file == name.as_deref() || file.is_some_and(|file| file == "..data")
                    }))
        });
        if ours {
            let _ = changed.send(());
        }
    })?;
    watcher.watch(&directory, notify::RecursiveMode::NonRecursive)?;
    Ok(watcher)
}

/// Events of a file change come in bursts (truncate, write, rename).
pub(super) const SETTLE: Duration = Duration::from_millis(200);

impl Daemon {
    /// SIGHUP or a changed file: read the configuration again and apply
    /// the difference. An invalid file changes nothing.
    pub(super) fn reload(&mut self, cause: &str) {
        let Some(path) = self.options.config_path.clone() else {
            info!("{cause}: the configuration came from flags; nothing to read again");
            return;
        };
        let config = match config::load_file(&path) {
            Ok(config) => config,
            Err(error) => {
                let message = errors::chain(&error);
                warn!(
                    "{cause}: {} is not valid; the running configuration stays: {message}",
                    path.display()
                );
                self.metrics.reload("error");
                self.last_reload = Some(ReloadStatus::now(false, message));
                return;
            }
        };
        if config == self.options.config {
            info!("{cause}: {} is unchanged", path.display());
            self.metrics.reload("unchanged");
            self.last_reload = Some(ReloadStatus::now(true, "unchanged".into()));
            return;
        }
        let sources = plan_sources(&config, &self.sources, &self.options.config);
        match self.install_effective(&config, &sources, cause) {
            Ok(()) => {
                self.options.config = config;
                self.sources = sources;
                self.watchers
                    .follow(&self.options.config, &self.discovery_tx);
                let message = format!("applied (generation {})", self.record.config_generation);
                info!("{cause}: {} {message}", path.display());
                self.metrics.reload("ok");
                self.last_reload = Some(ReloadStatus::now(true, message));
            }
            Err(message) => {
                warn!(
                    "{cause}: {} cannot be applied; the running configuration stays: {message}",
                    path.display()
                );
                self.metrics.reload("error");
                self.last_reload = Some(ReloadStatus::now(false, message));
            }
        }
    }

    /// One report of a discovery watcher.
    pub(super) fn on_discovery(&mut self, event: SourceEvent) {
        let Some(sources) = self.sources.get_mut(&event.service) else {
            return;
        };
        let before = sources.clone();
        let outcome = sources.report(event.source, event.report);
        if let Some(problem) = outcome.problem {
            warn!("discovery: {}: {}", event.service, problem.text);
            self.metrics.discovery_problem(
                &event.service,
                event.source.as_str(),
                problem.kind.as_str(),
            );
        }
        if let Some(recovered) = outcome.recovered {
            info!("discovery: {}: {recovered}", event.service);
        }
        let sources = self.sources.clone();
        let config = self.options.config.clone();
        if let Err(message) = self.install_effective(&config, &sources, "discovery") {
            warn!(
                "discovery: {}: the new set cannot be applied; the tables stay as they are: {message}",
                event.service
            );
            // Back to what is in force, so that the next event of any
            // service does not fail on this one again.
            self.sources.insert(event.service.clone(), before);
        }
    }

    /// Moves everything to the effective configuration of `config` and
    /// `sources`, if it differs from the one in force. Nothing changes when
    /// it cannot be applied (the reason is returned).
    pub(super) fn install_effective(
        &mut self,
        config: &Config,
        sources: &BTreeMap<String, ServiceSources>,
        cause: &str,
    ) -> Result<(), String> {
        let (effective, waiting) = effective_config(config, sources);
        for service in &waiting {
            if !self.waiting.contains(service) {
                warn!(
                    "{service}: no source has given a backend yet; its VIPs pass through untouched until one does"
                );
            }
        }
        self.waiting = waiting;
        if effective == self.effective {
            return Ok(());
        }
        config::check_effective(&effective).map_err(|error| errors::chain(&error))?;
        let layout = Layout::from_config(&effective, is_local_address);
        // Another install is looked for again only when the VIPs change,
        // and not at all under --allow-overlap.
        let vips = |config: &Config| -> std::collections::BTreeSet<std::net::SocketAddr> {
            config
                .services
                .iter()
                .flat_map(|service| service.vips.iter().copied())
                .collect()
        };
        if !self.options.allow_overlap && vips(&effective) != vips(&self.effective) {
            refuse_overlap(&self.paths, self.running.attachment.cgroup(), &layout)
                .map_err(|error| errors::chain(&error))?;
        }
        let known = super::state::known_ids(&self.running.maps)
            .map_err(|error| format!("reading the pinned ids: {}", errors::chain(&error)))?;
        let layout = Layout::keeping(&effective, is_local_address, &known);

        for service in &effective.services {
            let before = self
                .effective
                .services
                .iter()
                .find(|old| old.name == service.name)
                .map_or(&[][..], |old| old.backends.as_slice());
            if let Some(change) = discovery::describe_change(before, &service.backends) {
                let source = sources
                    .get(&service.name)
                    .and_then(ServiceSources::effective)
                    .map_or(Source::Static, |(source, _)| source);
                let prefix = if source == Source::Static {
                    "config"
                } else {
                    "discovery"
                };
                info!("{prefix}: {}: {change} ({source})", service.name);
                self.metrics
                    .discovery_update(&service.name, source.as_str());
            }
        }
        for old in &self.effective.services {
            if !effective.services.iter().any(|new| new.name == old.name) {
                info!("{}: service removed ({cause})", old.name);
            }
        }

        let changes = self.owner.reconfigure(layout);
        for id in &changes.unprobe {
            self.stop_probe(*id);
        }
        for id in &changes.probe {
            self.start_probe(*id);
        }
        for addr in &changes.added {
            info!("{addr} added; it takes connections once a probe passes");
        }
        self.effective = effective;
        self.record.config_generation += 1;
        let written = self.owner.write(&mut self.running.maps);
        for (addr, close) in changes.removed {
            info!("{addr} removed from the configuration");
            if close && self.features.sock_destroy {
                if written {
                    close_connections(&self.running.maps, addr);
                } else {
                    // The table may still list it; closed once the retried
                    // write succeeds.
                    self.pending_closes.push(addr);
                }
            }
        }
        self.beat();
        self.persist(sources);
        Ok(())
    }

    /// Writes the last known set of each service that follows a dynamic
    /// source, when it changed.
    pub(super) fn persist(&mut self, sources: &BTreeMap<String, ServiceSources>) {
        let Some(state_dir) = &self.state_dir else {
            return;
        };
        let sets: BTreeMap<String, Persisted> = sources
            .iter()
            .filter_map(|(name, sources)| {
                let (source, set) = sources.effective()?;
                // A service still on its persisted set keeps it in the file.
                matches!(
                    source,
                    Source::EndpointSlices | Source::K3sState | Source::Persisted
                )
                .then(|| {
                    (
                        name.clone(),
                        Persisted {
                            source,
                            backends: set.clone(),
                        },
                    )
                })
            })
            .collect();
        if sets.is_empty() || self.persisted.as_ref() == Some(&sets) {
            return;
        }
        match state_dir.save(&sets) {
            Ok(()) => self.persisted = Some(sets),
            Err(error) => warn!("state directory: {}", errors::chain(&error)),
        }
    }
}

/// Reads the persisted sets into the sources, saying what was found.
pub(super) fn seed_from(state_dir: &StateDir, sources: &mut BTreeMap<String, ServiceSources>) {
    match state_dir.load() {
        Ok(persisted) => {
            for (name, entry) in persisted {
                if let Some(service) = sources.get_mut(&name)
                    && service.is_dynamic()
                {
                    service.seed_persisted(entry.backends);
                }
            }
        }
        Err(error) => warn!("{}", errors::chain(&error)),
    }
}
