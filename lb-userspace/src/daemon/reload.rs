//! Changes of the configuration while the daemon runs: a reloaded file
//! (SIGHUP, `--watch-config`) and the backend sets discovery reports. Both
//! go through the apply path (`apply.rs`), then move the tables, the probes
//! and the state directory to the new effective configuration in place.

use std::{collections::BTreeMap, path::Path, time::Duration};

use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{
    Daemon,
    apply::{self, ApplyError, Checks},
    sources::{plan_sources, source_of},
    state::Departure,
};
use crate::{
    config::{self, Config},
    discovery::{self, ServiceSources, SourceEvent},
    errors,
    protocol::ReloadStatus,
};

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

/// Events of a file change come in bursts (truncate, write, rename): the
/// file is read this long after the first.
pub(super) const SETTLE: Duration = Duration::from_millis(200);

impl Daemon {
    /// SIGHUP or a changed file: read the configuration again and apply
    /// the difference. An invalid file changes nothing.
    pub(super) fn reload(&mut self, cause: &str) {
        let Some(path) = self.sources.config_path.clone() else {
            info!("{cause}: the configuration came from flags; nothing to read again");
            self.reconsider_hand_back(cause);
            return;
        };
        let (ok, message) = match config::load_file(&path) {
            Err(error) => {
                let message = errors::chain(&error);
                warn!(
                    "{cause}: {} is not valid; the running configuration stays: {message}",
                    path.display()
                );
                (false, message)
            }
            Ok(config) if config == self.sources.config => {
                info!("{cause}: {} is unchanged", path.display());
                self.observer.metrics.reload("unchanged");
                self.sources.last_reload = Some(ReloadStatus::now(true, "unchanged".into()));
                self.reconsider_hand_back(cause);
                return;
            }
            Ok(config) => self.apply_file(config, &path, cause),
        };
        self.observer
            .metrics
            .reload(if ok { "ok" } else { "error" });
        self.sources.last_reload = Some(ReloadStatus::now(ok, message));
    }

    /// A reload decides `when-daemon-gone = "auto"` again even when the
    /// configuration is unchanged: the agent's balancer may have come or
    /// gone since.
    fn reconsider_hand_back(&mut self, cause: &str) {
        let config = self.sources.config.clone();
        let by_service = self.sources.by_service.clone();
        if let Err(error) = self.apply_effective(&config, &by_service, cause) {
            warn!(
                "{cause}: deciding when-daemon-gone again failed; the running choice stays: {}",
                errors::chain(&error)
            );
        }
    }

    /// Applies a reloaded file; returns whether it applied, and what to say.
    fn apply_file(&mut self, config: Config, path: &Path, cause: &str) -> (bool, String) {
        let by_service = plan_sources(&config, &self.sources.by_service, &self.sources.config);
        match self.apply_effective(&config, &by_service, cause) {
            Ok(()) => {
                self.sources.replace(config, by_service);
                self.sources.persist();
                let message = format!("applied (generation {})", self.plane.generation());
                info!("{cause}: {} {message}", path.display());
                (true, message)
            }
            Err(error) => {
                let message = errors::chain(&error);
                warn!(
                    "{cause}: {} cannot be applied; the running configuration stays: {message}",
                    path.display()
                );
                (false, message)
            }
        }
    }

    /// One report of a discovery watcher.
    pub(super) fn on_discovery(&mut self, event: SourceEvent) {
        let Some(sources) = self.sources.by_service.get_mut(&event.service) else {
            return;
        };
        let before = sources.clone();
        let outcome = sources.report(event.source, event.report);
        if let Some(problem) = outcome.problem {
            warn!("discovery: {}: {}", event.service, problem.text);
            self.observer.metrics.discovery_problem(
                &event.service,
                event.source.as_str(),
                problem.kind.as_str(),
            );
        }
        if let Some(recovered) = outcome.recovered {
            info!("discovery: {}: {recovered}", event.service);
        }
        let by_service = self.sources.by_service.clone();
        let config = self.sources.config.clone();
        match self.apply_effective(&config, &by_service, "discovery") {
            Ok(()) => self.sources.persist(),
            Err(error) => {
                warn!(
                    "discovery: {}: the new set cannot be applied; the tables stay as they are: {}",
                    event.service,
                    errors::chain(&error)
                );
                // Back to what is in force, so that the next event of any
                // service does not fail on this one again.
                self.sources
                    .by_service
                    .insert(event.service.clone(), before);
            }
        }
    }

    /// Moves everything to the effective configuration of `config` and
    /// `by_service`, if it differs from the one in force: the apply path,
    /// then the owner, the probes and the record. Nothing changes when it
    /// cannot be applied.
    fn apply_effective(
        &mut self,
        config: &Config,
        by_service: &BTreeMap<String, ServiceSources>,
        cause: &str,
    ) -> Result<(), ApplyError> {
        let checks = Checks {
            paths: &self.plane.paths,
            cgroup: self.plane.running.attachment.cgroup(),
            allow_overlap: self.allow_overlap,
        };
        let (checked, changed) =
            apply::check(config, by_service, Some(&self.sources.effective), &checks)?;
        self.sources.set_waiting(checked.waiting.clone());
        // Even an unchanged configuration decides `when-daemon-gone =
        // "auto"` again: the agent's balancer may have come or gone.
        let layout =
            apply::lay_out(&checked, &self.plane.running.maps).map_err(ApplyError::PinnedIds)?;
        let hand_back_changed = apply::announce_hand_back(Some(self.owner.layout()), &layout);
        if !changed && !hand_back_changed {
            return Ok(());
        }
        self.announce_changes(&checked.effective, by_service, cause);
        let changes = self.owner.reconfigure(layout);
        for id in &changes.unprobe {
            self.probes.stop(*id);
        }
        for id in &changes.probe {
            self.probes.start(&self.owner, *id);
        }
        for addr in &changes.added {
            info!("{addr} added; it takes connections once a probe passes");
        }
        // Label sets follow the backends: a cluster whose server addresses
        // change keeps only its current ones.
        for (service, addr) in &changes.dropped {
            self.observer.metrics.forget_backend(service, *addr);
        }
        self.sources.effective = checked.effective;
        let written = self.plane.write(&mut self.owner);
        for (addr, departure) in changes.removed {
            info!("{addr} removed from the configuration");
            match departure {
                Departure::Close => self.plane.close_after_write(addr, written),
                Departure::Stay => {}
                Departure::NoneHealthy => info!(
                    "{addr}: its connections stay: no backend of its service is healthy to take them"
                ),
            }
        }
        self.plane.next_generation();
        Ok(())
    }

    /// Says what changed in each service's backends, and which services
    /// went.
    fn announce_changes(
        &self,
        effective: &Config,
        by_service: &BTreeMap<String, ServiceSources>,
        cause: &str,
    ) {
        let in_force = &self.sources.effective;
        for service in &effective.services {
            let before = in_force
                .services
                .iter()
                .find(|old| old.name == service.name)
                .map_or(&[][..], |old| old.backends.as_slice());
            let Some(change) = discovery::describe_change(before, &service.backends) else {
                continue;
            };
            let source = source_of(by_service, &service.name);
            let prefix = if source == discovery::Source::Static {
                "config"
            } else {
                "discovery"
            };
            info!("{prefix}: {}: {change} ({source})", service.name);
            self.observer
                .metrics
                .discovery_update(&service.name, source.as_str());
        }
        for old in &in_force.services {
            if !effective.services.iter().any(|new| new.name == old.name) {
                info!("{}: service removed ({cause})", old.name);
            }
        }
    }
}
