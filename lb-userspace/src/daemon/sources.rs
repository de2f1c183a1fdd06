//! Discovery's owner in the daemon: the configuration as read, what each
//! service's sources have said, the watchers that follow them, and the
//! state directory that remembers the last known sets.

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
};

use tokio::{sync::mpsc, task::JoinHandle};
use tracing::{info, warn};

use crate::{
    config::{Config, SliceSource},
    discovery::{
        self, ServiceSources, Source, SourceEvent,
        persist::{Persisted, StateDir},
    },
    errors,
    protocol::ReloadStatus,
};

/// How a discovery watcher is set up; a changed spec restarts it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum WatchSpec {
    K3s(PathBuf),
    Slices(SliceSource),
}

/// The running discovery watchers, by service and source.
#[derive(Default)]
struct Watchers {
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
    fn follow(&mut self, config: &Config, events: &mpsc::Sender<SourceEvent>) {
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
pub fn plan_sources(
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

/// Discovery's first word at start: the persisted sets and the state
/// files, which are read at once; the EndpointSlices answer later.
pub async fn first_word(config: &Config, state_dir: &StateDir) -> BTreeMap<String, ServiceSources> {
    let mut sources = plan_sources(config, &BTreeMap::new(), config);
    seed_from(state_dir, &mut sources);
    for service in &config.services {
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
    sources
}

/// The source a service's backends come from now.
pub fn source_of(by_service: &BTreeMap<String, ServiceSources>, service: &str) -> Source {
    by_service
        .get(service)
        .and_then(ServiceSources::effective)
        .map_or(Source::Static, |(source, _)| source)
}

/// Reads the persisted sets into the sources, saying what was found.
fn seed_from(state_dir: &StateDir, sources: &mut BTreeMap<String, ServiceSources>) {
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

/// The configuration as read and what discovery says of it.
pub struct Sources {
    /// The configuration as read (from the file or the flags).
    pub config: Config,
    /// The file it came from (SIGHUP reads it again).
    pub config_path: Option<PathBuf>,
    /// What each service's sources have said.
    pub by_service: BTreeMap<String, ServiceSources>,
    /// The configuration the tables follow: `config` with its backends
    /// replaced by discovery's.
    pub effective: Config,
    /// Services no source has given a backend yet.
    pub waiting: Vec<String>,
    /// The result of the last reload, for status.
    pub last_reload: Option<ReloadStatus>,
    watchers: Watchers,
    events: mpsc::Sender<SourceEvent>,
    state_dir: StateDir,
    /// What was last written to the state directory.
    persisted: Option<BTreeMap<String, Persisted>>,
}

impl Sources {
    /// Starts following the sources of `config`, whose effective
    /// configuration is in force.
    pub fn start(
        config: Config,
        config_path: Option<PathBuf>,
        by_service: BTreeMap<String, ServiceSources>,
        (effective, waiting): (Config, Vec<String>),
        state_dir: StateDir,
        events: mpsc::Sender<SourceEvent>,
    ) -> Self {
        let mut sources = Self {
            config,
            config_path,
            by_service,
            effective,
            waiting,
            last_reload: None,
            watchers: Watchers::default(),
            events,
            state_dir,
            persisted: None,
        };
        sources.watchers.follow(&sources.config, &sources.events);
        sources.persist();
        sources
    }

    /// A new configuration and its sources are in force.
    pub fn replace(&mut self, config: Config, by_service: BTreeMap<String, ServiceSources>) {
        self.config = config;
        self.by_service = by_service;
        self.watchers.follow(&self.config, &self.events);
    }

    /// Says, once per service, which ones no source has given a backend
    /// yet; their VIPs pass through untouched until one does.
    pub fn set_waiting(&mut self, waiting: Vec<String>) {
        for service in &waiting {
            if !self.waiting.contains(service) {
                warn!(
                    "{service}: no source has given a backend yet; its VIPs pass through untouched until one does"
                );
            }
        }
        self.waiting = waiting;
    }

    /// Writes the last known set of each service that follows a dynamic
    /// source, when it changed.
    pub fn persist(&mut self) {
        let sets: BTreeMap<String, Persisted> = self
            .by_service
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
        match self.state_dir.save(&sets) {
            Ok(()) => self.persisted = Some(sets),
            Err(error) => warn!("state directory: {}", errors::chain(&error)),
        }
    }
}
