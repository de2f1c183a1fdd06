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

mod api;
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
    /// One part of it (an EndpointSlice) was refused; the rest applies.
    /// Sent once per part and reason.
    Refused(Refusal),
}

/// A part of a source that socklb refused, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub kind: ProblemKind,
    /// What was refused and why, in words ("EndpointSlice default/evil is
    /// managed by \"evil-controller\", …").
    pub why: String,
}

/// The kinds of discovery problems, as the `reason` label of
/// `socklb_discovery_problems_total` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProblemKind {
    /// The source could not be read.
    Failed,
    /// It listed no backend.
    Empty,
    /// It listed more backends than `max-discovered-backends`.
    TooManyBackends,
    /// An EndpointSlice not written by the Service's manager.
    ForeignManager,
    /// An EndpointSlice larger than the cap (or than the API allows).
    Oversized,
    /// An EndpointSlice that would take the service past its cap with the
    /// others.
    OverCap,
    /// An EndpointSlice that no API server would serve (a bad address).
    Invalid,
    /// More EndpointSlices than socklb follows for one Service.
    TooManySlices,
}

impl ProblemKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Failed => "failed",
            Self::Empty => "empty",
            Self::TooManyBackends => "too-many-backends",
            Self::ForeignManager => "foreign-manager",
            Self::Oversized => "oversized",
            Self::OverCap => "over-cap",
            Self::Invalid => "invalid",
            Self::TooManySlices => "too-many-slices",
        }
    }
}

/// A problem to say once and count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub kind: ProblemKind,
    pub text: String,
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
    /// A problem to log once and count: the source failed, listed nothing
    /// or too much (the last known set stays), or a part was refused.
    pub problem: Option<Problem>,
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
    /// Most backends a dynamic source may give (`max-discovered-backends`).
    max_backends: usize,
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
            max_backends: service.discovery.max_backends,
            ..Self::default()
        }
    }

    /// Keeps what `previous` learnt from the sources both configure
    /// alike (`same_source` says which), for a reloaded configuration.
    pub fn carry_over(&mut self, previous: &Self, same_source: impl Fn(Source) -> bool) {
        for source in &self.dynamic {
            if !same_source(*source) {
                continue;
            }
            if let Some(set) = previous.known.get(source) {
                self.known.insert(*source, set.clone());
            }
            // Its watcher is kept, and so is the episode it is in: a
            // failure said before the reload is not said again after it.
            if previous.troubled.contains(source) {
                self.troubled.insert(*source);
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
        if !self.dynamic.contains(&source) {
            return Outcome::default();
        }
        let keeping = match self.known.get(&source) {
            Some(set) => format!("keeping its last known {} backends", set.len()),
            None => "nothing known from it yet".to_string(),
        };
        let trouble = match report {
            Report::Refused(refusal) => {
                return Outcome {
                    problem: Some(Problem {
                        kind: refusal.kind,
                        text: format!("{source}: {}", refusal.why),
                    }),
                    recovered: None,
                };
            }
            Report::Set(set) if set.len() > self.max_backends => Problem {
                kind: ProblemKind::TooManyBackends,
                text: format!(
                    "{source} lists {} backends, more than max-discovered-backends ({}); {keeping}",
                    set.len(),
                    self.max_backends
                ),
            },
            Report::Set(set) if !set.is_empty() => {
                let recovered = self
                    .troubled
                    .remove(&source)
                    .then(|| format!("{source} lists {} backends again", set.len()));
                self.known.insert(source, set);
                return Outcome {
                    problem: None,
                    recovered,
                };
            }
            Report::Set(_) => Problem {
                kind: ProblemKind::Empty,
                text: format!("{source} lists no backend; {keeping}"),
            },
            Report::Failed(why) => Problem {
                kind: ProblemKind::Failed,
                text: format!("{source} failed: {why}; {keeping}"),
            },
        };
        Outcome {
            problem: self.troubled.insert(source).then_some(trouble),
            recovered: None,
        }
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
        let mut backends = discovered_backends(service, set, &vips);
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
    (
        Config {
            services,
            socket_table_size: base.socket_table_size,
        },
        waiting,
    )
}

/// The backends of `service` for a discovered `set`: those of an address
/// family it has a VIP for, and not a VIP (they would be redirected
/// again). A backend listed statically keeps its weight, role and drain;
/// one found only by discovery has weight 1.
fn discovered_backends(
    service: &Service,
    set: &BackendSet,
    vips: &BTreeSet<SocketAddr>,
) -> Vec<Backend> {
    set.iter()
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
        .collect()
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
