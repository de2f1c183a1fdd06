//! Where each service's backends come from while the daemon runs.
//!
//! A service combines up to four sources:
//! - its static `backends`, from the configuration;
//! - a k3s/rke2 agent load-balancer state file ([`k3s`]), followed;
//! - the EndpointSlices of a Kubernetes Service ([`slices`]), watched;
//! - the set it last used, persisted in the state directory ([`persist`]).
//!
//! The watchers only report what they see. [`ServiceSources`] keeps the
//! last non-empty set of each, and decides which one the table follows:
//! EndpointSlices when they have answered, else the state file, else the
//! persisted set (only for a service with a dynamic source), else the
//! static list. A source that fails, or answers with nothing, never empties
//! a table: its last known set stays, and the problem is said once.

pub mod k3s;
pub mod persist;
pub mod slices;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::SocketAddr,
};

use serde::{Deserialize, Serialize};

use crate::config::{Backend, BackendRole, Config, Service};

/// A source of backends, from most to least authoritative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    EndpointSlices,
    K3sState,
    Persisted,
    Static,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::EndpointSlices => "endpointslices",
            Self::K3sState => "k3s-state",
            Self::Persisted => "persisted",
            Self::Static => "static",
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One backend as a source reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Found {
    pub addr: SocketAddr,
    /// Used only while no other backend is healthy (the k3s agent's
    /// default server when it is not listed).
    #[serde(default)]
    pub standby: bool,
}

pub type BackendSet = BTreeSet<Found>;

/// What a watcher saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// The backends it lists now (possibly none).
    Set(BackendSet),
    /// It could not be read; why.
    Failed(String),
}

/// A report of one source of one service, sent to the daemon's loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceEvent {
    pub service: String,
    pub source: Source,
    pub report: Report,
}

/// What a report changed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Outcome {
    /// A problem to log once: the source failed or listed nothing, and the
    /// last known set stays.
    pub problem: Option<String>,
    /// The problem of an earlier report is over.
    pub recovered: Option<String>,
}

/// The sources of one service and their last known sets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceSources {
    /// The dynamic sources configured, most authoritative first.
    dynamic: Vec<Source>,
    static_set: BackendSet,
    persisted: Option<BackendSet>,
    /// The last non-empty set each dynamic source reported.
    known: BTreeMap<Source, BackendSet>,
    /// Sources whose last report was a failure or an empty set (said once).
    troubled: BTreeSet<Source>,
}

impl ServiceSources {
    pub fn new(service: &Service) -> Self {
        let mut dynamic = Vec::new();
        if service.discovery.endpoint_slices.is_some() {
            dynamic.push(Source::EndpointSlices);
        }
        if service.discovery.k3s_state.is_some() {
            dynamic.push(Source::K3sState);
        }
        Self {
            dynamic,
            static_set: service
                .backends
                .iter()
                .map(|backend| Found {
                    addr: backend.addr,
                    standby: backend.role == BackendRole::Standby,
                })
                .collect(),
            ..Self::default()
        }
    }

    /// Keeps what `previous` learnt from the sources both configure
    /// alike (`same_source` says which), for a reloaded configuration.
    pub fn carry_over(&mut self, previous: &Self, same_source: impl Fn(Source) -> bool) {
        for source in &self.dynamic {
            if same_source(*source)
                && let Some(set) = previous.known.get(source)
            {
                self.known.insert(*source, set.clone());
            }
        }
        self.persisted.clone_from(&previous.persisted);
    }

    /// The set a previous daemon used, read from the state directory.
    pub fn seed_persisted(&mut self, set: BackendSet) {
        if !set.is_empty() {
            self.persisted = Some(set);
        }
    }

    pub fn is_dynamic(&self) -> bool {
        !self.dynamic.is_empty()
    }

    /// Feeds one report of a dynamic source.
    pub fn report(&mut self, source: Source, report: Report) -> Outcome {
        let mut outcome = Outcome::default();
        if !self.dynamic.contains(&source) {
            return outcome;
        }
        let keeping = |known: Option<&BackendSet>| match known {
            Some(set) => format!("keeping its last known {} backends", set.len()),
            None => "nothing known from it yet".to_string(),
        };
        match report {
            Report::Set(set) if !set.is_empty() => {
                if self.troubled.remove(&source) {
                    outcome.recovered =
                        Some(format!("{source} lists {} backends again", set.len()));
                }
                self.known.insert(source, set);
            }
            Report::Set(_) => {
                if self.troubled.insert(source) {
                    outcome.problem = Some(format!(
                        "{source} lists no backend; {}",
                        keeping(self.known.get(&source))
                    ));
                }
            }
            Report::Failed(why) => {
                if self.troubled.insert(source) {
                    outcome.problem = Some(format!(
                        "{source} failed: {why}; {}",
                        keeping(self.known.get(&source))
                    ));
                }
            }
        }
        outcome
    }

    /// The set the table follows now, and where it comes from. None: no
    /// source has given any backend yet.
    pub fn effective(&self) -> Option<(Source, &BackendSet)> {
        for source in &self.dynamic {
            if let Some(set) = self.known.get(source) {
                return Some((*source, set));
            }
        }
        if self.is_dynamic()
            && let Some(set) = &self.persisted
        {
            return Some((Source::Persisted, set));
        }
        (!self.static_set.is_empty()).then_some((Source::Static, &self.static_set))
    }

    /// Each dynamic source and what it last said, in words.
    pub fn states(&self) -> Vec<(Source, String)> {
        self.dynamic
            .iter()
            .map(|source| {
                let known = self.known.get(source).map(BTreeSet::len);
                let state = match (self.troubled.contains(source), known) {
                    (false, Some(count)) => format!("ok, {count} backends"),
                    (true, Some(count)) => {
                        format!("failing or empty; keeping its last {count} backends")
                    }
                    (true, None) => "failing; nothing known from it yet".to_string(),
                    (false, None) => "no answer yet".to_string(),
                };
                (*source, state)
            })
            .collect()
    }
}

/// The configuration the tables follow: each service's backends replaced
/// by its effective set. A backend listed statically keeps its weight,
/// role and drain; one found only by discovery has weight 1. Backends of an
/// address family the service has no VIP for are left out. A service no
/// source has given a backend of a VIP family yet is left out, so its VIPs
/// pass through untouched until one does (returned in the second list).
pub fn effective_config(
    base: &Config,
    sources: &BTreeMap<String, ServiceSources>,
) -> (Config, Vec<String>) {
    let mut services = Vec::new();
    let mut waiting = Vec::new();
    // A discovered address that is a VIP would be redirected again.
    let vips: BTreeSet<SocketAddr> = base
        .services
        .iter()
        .flat_map(|service| service.vips.iter().copied())
        .collect();
    for service in &base.services {
        let Some((_, set)) = sources
            .get(&service.name)
            .and_then(ServiceSources::effective)
        else {
            waiting.push(service.name.clone());
            continue;
        };
        let mut backends: Vec<Backend> = set
            .iter()
            .filter(|found| {
                let is_vip = vips.contains(&found.addr);
                if is_vip {
                    tracing::warn!(
                        "{}: discovery lists {}, a VIP of socklb; left out (it would loop)",
                        service.name,
                        found.addr
                    );
                }
                !is_vip
            })
            .filter(|found| {
                service
                    .vips
                    .iter()
                    .any(|vip| vip.is_ipv4() == found.addr.is_ipv4())
            })
            .map(|found| {
                service
                    .backends
                    .iter()
                    .find(|backend| backend.addr == found.addr)
                    .cloned()
                    .unwrap_or(Backend {
                        addr: found.addr,
                        weight: 1,
                        role: if found.standby {
                            BackendRole::Standby
                        } else {
                            BackendRole::Normal
                        },
                        drain: false,
                    })
            })
            .collect();
        // A set of standbys only (a state file that lists no server but
        // its default one) still has to serve.
        if backends
            .iter()
            .all(|backend| backend.role == BackendRole::Standby)
        {
            for backend in &mut backends {
                backend.role = BackendRole::Normal;
            }
        }
        let every_family_served = service.vips.iter().all(|vip| {
            backends
                .iter()
                .any(|backend| backend.addr.is_ipv4() == vip.is_ipv4())
        });
        if !every_family_served {
            waiting.push(service.name.clone());
            continue;
        }
        services.push(Service {
            backends,
            ..service.clone()
        });
    }
    (Config { services }, waiting)
}

/// Whether a file event can change what the file says: not a read (our
/// own reads report IN_OPEN and IN_ACCESS) and not a change of metadata.
pub fn is_content_change(event: &notify::Event) -> bool {
    use notify::event::{EventKind, ModifyKind};
    match event.kind {
        EventKind::Access(_) | EventKind::Modify(ModifyKind::Metadata(_)) => false,
        EventKind::Any
        | EventKind::Create(_)
        | EventKind::Modify(_)
        | EventKind::Remove(_)
        | EventKind::Other => true,
    }
}

/// "+10.0.0.14:6443, -10.0.0.12:6443": what changed between two sets of
/// backends, or None.
pub fn describe_change(before: &[Backend], after: &[Backend]) -> Option<String> {
    let old: BTreeSet<SocketAddr> = before.iter().map(|backend| backend.addr).collect();
    let new: BTreeSet<SocketAddr> = after.iter().map(|backend| backend.addr).collect();
    let mut words: Vec<String> = new
        .difference(&old)
        .map(|addr| format!("+{addr}"))
        .collect();
    words.extend(old.difference(&new).map(|addr| format!("-{addr}")));
    (!words.is_empty()).then(|| words.join(", "))
}

#[cfg(test)]
mod tests;
