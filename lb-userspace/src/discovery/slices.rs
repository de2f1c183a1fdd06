//! The EndpointSlices of a Kubernetes Service (by default
//! `default/kubernetes`, port `https`: the apiservers themselves), listed
//! and watched through [`super::api`], which bounds every byte read.
//!
//! Only the slices of the Service's own manager count
//! (`endpointslice-managers`, see [`crate::config::SliceManager`]); each
//! other slice, and each slice no API server would serve (a bad address,
//! more endpoints than the API allows, more backends than
//! `max-discovered-backends`), is refused on its own: said once, counted,
//! and the rest applies. The slices that count give at most
//! `max-discovered-backends` backends together; one that would take them
//! past it is left out, the newest first, so that slices that were there
//! keep their place.
//!
//! A session lists, then watches from the list's resource version,
//! resuming each watch the server ends. Anything else (410 Gone, a refused
//! connection, an expired certificate, a bound exceeded) ends the session,
//! and the next one (a new client, a new list) starts after a backoff that
//! only a session that stayed up [`HEALTHY_AFTER`] resets: a list that
//! succeeds before a watch that fails at once does not.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use k8s_openapi::{
    api::discovery::v1::{Endpoint, EndpointSlice},
    apimachinery::pkg::apis::meta::v1::Time,
};
use kube::{
    Client,
    config::{KubeConfigOptions, Kubeconfig},
    core::WatchEvent,
};
use tokio::{sync::mpsc, time::Instant};
use tracing::{debug, info};

use super::{
    BackendSet, Found, ProblemKind, Refusal, Report, Source, SourceEvent,
    api::{ApiError, SliceApi, printable},
};
use crate::config::{SliceManager, SliceSource};

/// The label that ties an EndpointSlice to its Service
/// (`discovery.LabelServiceName`).
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The label that names the slice's manager (`discovery.LabelManagedBy`,
/// staging/src/k8s.io/api/discovery/v1/well_known_labels.go).
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// Endpoints one slice may hold, and addresses one endpoint may hold: the
/// API's own validation refuses more (`maxEndpoints`, `maxAddresses` of
/// pkg/apis/discovery/validation).
const MAX_ENDPOINTS: usize = 1000;
const MAX_ADDRESSES: usize = 100;
/// Slices of one Service that count, at most.
pub const MAX_SLICES: usize = 256;
/// Refused slices remembered so that each is said once.
const MAX_REMEMBERED: usize = 1024;

/// First and longest pause before a new session after one that failed.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A session that stayed up this long was healthy: the backoff starts over.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);
/// A watch that the server ends sooner than this ended at once. It is a
/// failure, not a resume, when it delivered nothing, or when the watch
/// before it ended at once too: a server that ends every watch at once
/// gets the backoff, not a loop of requests.
const QUICK_END: Duration = Duration::from_secs(1);

/// The ready endpoints of one slice, on the named port. An endpoint whose
/// `ready` condition is absent counts as ready (the API's rule). A slice
/// no API server would serve is refused, saying why.
pub fn ready_backends(slice: &EndpointSlice, spec: &SliceSource) -> Result<BackendSet, Refusal> {
    let refuse = |(kind, why): (ProblemKind, String)| Refusal {
        kind,
        why: format!(
            "EndpointSlice {} {why}; refused, the other slices apply",
            slice_ref(slice, spec)
        ),
    };
    let v4 = match slice.address_type.as_str() {
        "IPv4" => true,
        "IPv6" => false,
        other => {
            return Err(refuse((
                ProblemKind::Invalid,
                format!(
                    "has addressType \"{}\"; socklb takes IPv4 and IPv6",
                    printable(other)
                ),
            )));
        }
    };
    if slice.endpoints.len() > MAX_ENDPOINTS {
        return Err(refuse((
            ProblemKind::Oversized,
            format!(
                "has {} endpoints; the API allows {MAX_ENDPOINTS}",
                slice.endpoints.len()
            ),
        )));
    }
    let port = named_port(slice, &spec.port);
    let mut set = BackendSet::new();
    for endpoint in &slice.endpoints {
        set.extend(endpoint_backends(endpoint, v4, port).map_err(refuse)?);
    }
    if set.len() > spec.max_backends {
        return Err(refuse((
            ProblemKind::Oversized,
            format!(
                "gives {} backends, more than max-discovered-backends ({})",
                set.len(),
                spec.max_backends
            ),
        )));
    }
    Ok(set)
}

/// The number of the slice's port called `name`, if it has one.
fn named_port(slice: &EndpointSlice, name: &str) -> Option<u16> {
    slice
        .ports
        .iter()
        .flatten()
        .find(|port| port.name.as_deref() == Some(name))
        .and_then(|port| port.port)
        .and_then(|port| u16::try_from(port).ok())
        .filter(|port| *port != 0)
}

/// The backends one endpoint gives (none when it is not ready or the
/// slice lacks the port), or what is wrong with it.
fn endpoint_backends(
    endpoint: &Endpoint,
    v4: bool,
    port: Option<u16>,
) -> Result<Vec<Found>, (ProblemKind, String)> {
    if endpoint.addresses.len() > MAX_ADDRESSES {
        return Err((
            ProblemKind::Oversized,
            format!(
                "has an endpoint of {} addresses; the API allows {MAX_ADDRESSES}",
                endpoint.addresses.len()
            ),
        ));
    }
    let ready = endpoint
        .conditions
        .as_ref()
        .and_then(|conditions| conditions.ready)
        .unwrap_or(true);
    let mut found = Vec::new();
    for address in &endpoint.addresses {
        let ip = usable_ip(address, v4).ok_or_else(|| {
            (
                ProblemKind::Invalid,
                format!(
                    "lists \"{}\", not a usable {} address",
                    printable(address),
                    if v4 { "IPv4" } else { "IPv6" }
                ),
            )
        })?;
        if let (true, Some(port)) = (ready, port) {
            found.push(Found {
                addr: SocketAddr::new(ip, port),
                standby: false,
            });
        }
    }
    Ok(found)
}

/// An address of the slice's family that a connect can go to: not
/// unspecified, multicast or broadcast.
fn usable_ip(text: &str, v4: bool) -> Option<IpAddr> {
    let ip: IpAddr = text.parse().ok()?;
    let usable = match ip {
        IpAddr::V4(ip) => v4 && !ip.is_unspecified() && !ip.is_multicast() && !ip.is_broadcast(),
        IpAddr::V6(ip) => {
            !v4 && !ip.is_unspecified() && !ip.is_multicast() && ip.to_ipv4_mapped().is_none()
        }
    };
    usable.then_some(ip)
}

/// `namespace/name` of a slice, for a log line.
fn slice_ref(slice: &EndpointSlice, spec: &SliceSource) -> String {
    format!("{}/{}", spec.namespace, printable(&name_of(slice)))
}

fn name_of(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

/// Whether one of the Service's managers wrote the slice; else why not.
pub fn check_manager(slice: &EndpointSlice, spec: &SliceSource) -> Result<(), Refusal> {
    let label = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(MANAGED_BY_LABEL));
    let name = name_of(slice);
    let written_by = |manager: &SliceManager| match manager {
        SliceManager::Apiserver => label.is_none() && name == spec.service,
        SliceManager::Label(value) => label == Some(value),
    };
    if spec.managers.iter().any(written_by) {
        return Ok(());
    }
    let writer = match label {
        Some(value) => format!("is managed by \"{}\"", printable(value)),
        None => format!("has no {MANAGED_BY_LABEL} label"),
    };
    let accepted: Vec<String> = spec
        .managers
        .iter()
        .map(|manager| match manager {
            SliceManager::Apiserver => format!(
                "{} (no {MANAGED_BY_LABEL} label, named \"{}\")",
                SliceManager::APISERVER,
                spec.service
            ),
            SliceManager::Label(value) => format!("\"{value}\""),
        })
        .collect();
    Err(Refusal {
        kind: ProblemKind::ForeignManager,
        why: format!(
            "EndpointSlice {} {writer}; only slices written by {} count (endpointslice-managers): ignored",
            slice_ref(slice, spec),
            accepted.join(" or ")
        ),
    })
}

/// A slice that counts: when it was created (older slices keep their
/// place under the cap) and its ready backends.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Admitted {
    created: Option<Time>,
    backends: BackendSet,
}

/// The slices of one Service that count, and what was said about the
/// others. Pure: fed by the watch, unit-tested.
#[derive(Debug, Clone)]
pub struct SliceSet {
    spec: SliceSource,
    admitted: BTreeMap<String, Admitted>,
    /// The refusal said about each refused slice, so that each is said once.
    said: BTreeMap<String, Refusal>,
}

impl SliceSet {
    pub fn new(spec: SliceSource) -> Self {
        Self {
            spec,
            admitted: BTreeMap::new(),
            said: BTreeMap::new(),
        }
    }

    /// Forgets the slices before a new list (what was said is kept).
    pub fn start_list(&mut self) {
        self.admitted.clear();
    }

    /// A slice added or changed; the refusal to say, if it is refused now
    /// and was not for this reason before.
    pub fn apply(&mut self, slice: &EndpointSlice) -> Option<Refusal> {
        let name = name_of(slice);
        let admitted = check_manager(slice, &self.spec)
            .and_then(|()| ready_backends(slice, &self.spec))
            .and_then(|backends| {
                let room = self.admitted.contains_key(&name) || self.admitted.len() < MAX_SLICES;
                room.then_some(backends).ok_or_else(|| Refusal {
                    kind: ProblemKind::TooManySlices,
                    why: format!(
                        "EndpointSlice {} is one more than the {MAX_SLICES} slices socklb follows for {}/{}; refused",
                        slice_ref(slice, &self.spec),
                        self.spec.namespace,
                        self.spec.service
                    ),
                })
            });
        match admitted {
            Ok(backends) => {
                let created = slice.metadata.creation_timestamp.clone();
                self.admitted.insert(name, Admitted { created, backends });
                None
            }
            Err(refusal) => {
                self.admitted.remove(&name);
                self.say(name, refusal)
            }
        }
    }

    /// A slice deleted.
    pub fn remove(&mut self, name: &str) {
        self.admitted.remove(name);
        self.said.remove(name);
    }

    /// The backends of the slices that count, within the cap, and the
    /// refusals to say about slices left out for it. The oldest slices
    /// come first.
    pub fn settle(&mut self) -> (BackendSet, Vec<Refusal>) {
        let mut order: Vec<(&String, &Admitted)> = self.admitted.iter().collect();
        order.sort_by(|(a_name, a), (b_name, b)| {
            (a.created.is_none(), &a.created, a_name).cmp(&(
                b.created.is_none(),
                &b.created,
                b_name,
            ))
        });
        let mut union = BackendSet::new();
        let mut left_out = Vec::new();
        for (name, slice) in order {
            let new = slice.backends.difference(&union).count();
            if union.len() + new > self.spec.max_backends {
                left_out.push(name.clone());
            } else {
                union.extend(slice.backends.iter().copied());
            }
        }
        // A slice that counts is said again if it is ever refused again.
        let admitted = &self.admitted;
        self.said
            .retain(|name, _| !admitted.contains_key(name) || left_out.contains(name));
        let mut refusals = Vec::new();
        for name in left_out {
            let refusal = Refusal {
                kind: ProblemKind::OverCap,
                why: format!(
                    "EndpointSlice {}/{} would take the backends of {} past max-discovered-backends ({}) with the older slices; left out, they apply",
                    self.spec.namespace,
                    printable(&name),
                    self.spec.service,
                    self.spec.max_backends
                ),
            };
            refusals.extend(self.say(name, refusal));
        }
        (union, refusals)
    }

    /// `refusal` if it was not said about `name` already.
    fn say(&mut self, name: String, refusal: Refusal) -> Option<Refusal> {
        if self.said.get(&name) == Some(&refusal) {
            return None;
        }
        if self.said.len() < MAX_REMEMBERED || self.said.contains_key(&name) {
            self.said.insert(name, refusal.clone());
        }
        Some(refusal)
    }
}

async fn client(spec: &SliceSource) -> Result<Client, String> {
    let config = match &spec.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .map_err(|error| format!("kubeconfig {}: {error}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|error| format!("kubeconfig {}: {error}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|error| format!("no kubeconfig found: {error}"))?,
    };
    Client::try_from(config).map_err(|error| format!("Kubernetes client: {error}"))
}

/// The pause before the next session: exponential (1 s doubling to 30 s,
/// ±20 %) over sessions that fail, and reset only by one that stayed up
/// [`HEALTHY_AFTER`].
#[derive(Debug)]
struct Backoff {
    next: Duration,
}

impl Backoff {
    fn new() -> Self {
        Self {
            next: FIRST_BACKOFF,
        }
    }

    /// After a session that ran `ran_for`: none when it was healthy and
    /// only needs a new list (410 Gone).
    fn pause(&mut self, ran_for: Duration, relist_only: bool) -> Duration {
        if ran_for >= HEALTHY_AFTER {
            self.next = FIRST_BACKOFF;
            if relist_only {
                return Duration::ZERO;
            }
        }
        let pause = crate::health::jittered(self.next, &mut rand::rng());
        self.next = (self.next * 2).min(MAX_BACKOFF);
        pause
    }
}

/// Sends one watcher's reports. A failure is sent when it differs from
/// the one said last; a set when it changed, or, while a failure stands,
/// once the source proves healthy (a watch delivered something): a list
/// that succeeds between two watches that fail is no recovery.
struct Reporter {
    service: String,
    events: mpsc::Sender<SourceEvent>,
    last_set: Option<BackendSet>,
    /// The failure said, until a recovery is.
    failing: Option<String>,
}

impl Reporter {
    /// False when the daemon is gone.
    async fn send(&mut self, report: Report) -> bool {
        let event = SourceEvent {
            service: self.service.clone(),
            source: Source::EndpointSlices,
            report,
        };
        self.events.send(event).await.is_ok()
    }

    async fn failed(&mut self, why: String) -> bool {
        if self.failing.as_ref() == Some(&why) {
            return true;
        }
        self.failing = Some(why.clone());
        self.send(Report::Failed(why)).await
    }

    /// The refusals, then the set (see the type's rules; `healthy`: a
    /// watch delivered an event).
    async fn send_all(&mut self, refusals: Vec<Refusal>, set: BackendSet, healthy: bool) -> bool {
        for refusal in refusals {
            if !self.send(Report::Refused(refusal)).await {
                return false;
            }
        }
        let changed = self.last_set.as_ref() != Some(&set);
        if !changed && (self.failing.is_none() || !healthy) {
            return true;
        }
        self.failing = None;
        self.last_set = Some(set.clone());
        self.send(Report::Set(set)).await
    }
}

/// How a session ended.
enum SessionEnd {
    /// The daemon is gone.
    Stopped,
    /// The watch's version is gone: list again.
    Expired,
    Failed(String),
}

impl From<ApiError> for SessionEnd {
    fn from(error: ApiError) -> Self {
        match error {
            ApiError::Expired => Self::Expired,
            error => Self::Failed(error.to_string()),
        }
    }
}

/// Follows the slices until `events` is closed.
pub async fn follow(service: String, spec: SliceSource, events: mpsc::Sender<SourceEvent>) {
    info!(
        "{service}: watching the EndpointSlices of {}/{} (port {}; written by {})",
        spec.namespace,
        spec.service,
        spec.port,
        spec.managers
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" or ")
    );
    let mut reporter = Reporter {
        service: service.clone(),
        events,
        last_set: None,
        failing: None,
    };
    let mut slices = SliceSet::new(spec.clone());
    let mut backoff = Backoff::new();
    // Bounded by the daemon: it closes `events` (or aborts this task) when
    // it stops or the source is reconfigured.
    loop {
        let started = Instant::now();
        let relist_only = match session(&spec, &mut slices, &mut reporter).await {
            SessionEnd::Stopped => return,
            SessionEnd::Expired => true,
            SessionEnd::Failed(why) => {
                debug!("{service}: EndpointSlices: {why}");
                if !reporter.failed(why).await {
                    return;
                }
                false
            }
        };
        tokio::time::sleep(backoff.pause(started.elapsed(), relist_only)).await;
        if reporter.events.is_closed() {
            return;
        }
    }
}

/// One list, then watches until one fails (or the daemon is gone).
async fn session(spec: &SliceSource, slices: &mut SliceSet, reporter: &mut Reporter) -> SessionEnd {
    let client = match client(spec).await {
        Ok(client) => client,
        Err(why) => return SessionEnd::Failed(why),
    };
    let selector = format!("{SERVICE_NAME_LABEL}={}", spec.service);
    let api = SliceApi::new(client, &spec.namespace, selector);
    slices.start_list();
    let mut refusals = Vec::new();
    let mut version = match api
        .list(|slice| refusals.extend(slices.apply(&slice)))
        .await
    {
        Ok(version) => version,
        Err(error) => return error.into(),
    };
    let (set, left_out) = slices.settle();
    refusals.extend(left_out);
    if !reporter.send_all(refusals, set, false).await {
        return SessionEnd::Stopped;
    }
    // Each round is one watch; the server ends each after timeoutSeconds,
    // and watches that end at once end the session (see QUICK_END).
    let mut ended_at_once = false;
    loop {
        let mut watch = match api.watch(&version).await {
            Ok(watch) => watch,
            Err(error) => return error.into(),
        };
        let started = Instant::now();
        let mut received = false;
        loop {
            let event = match watch.next().await {
                Ok(Some(event)) => event,
                Ok(None) => break,
                Err(error) => return error.into(),
            };
            received = true;
            let refusal = match event {
                WatchEvent::Added(slice) | WatchEvent::Modified(slice) => {
                    version = slice.metadata.resource_version.clone().unwrap_or(version);
                    slices.apply(&slice)
                }
                WatchEvent::Deleted(slice) => {
                    version = slice.metadata.resource_version.clone().unwrap_or(version);
                    slices.remove(&name_of(&slice));
                    None
                }
                WatchEvent::Bookmark(bookmark) => {
                    version = bookmark.metadata.resource_version;
                    None
                }
                // Turned into an error by the decoder.
                WatchEvent::Error(_) => None,
            };
            let (set, mut refusals) = slices.settle();
            refusals.splice(0..0, refusal);
            if !reporter.send_all(refusals, set, true).await {
                return SessionEnd::Stopped;
            }
        }
        let at_once = started.elapsed() < QUICK_END;
        if at_once && (!received || ended_at_once) {
            return SessionEnd::Failed(format!(
                "the watch ended within {QUICK_END:?} of its start"
            ));
        }
        ended_at_once = at_once;
    }
}

#[cfg(test)]
mod tests;
