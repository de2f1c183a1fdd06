//! The EndpointSlices of a Kubernetes Service (by default
//! `default/kubernetes`, port `https`: the apiservers themselves), watched
//! with kube-runtime's watcher. The watcher lists, then watches from the
//! list's resourceVersion; when a watch ends normally it resumes from the
//! last version. When anything fails (410 Gone, a refused connection, an
//! expired certificate), everything starts over after an exponential
//! backoff: a new client, a new list. Each change of the ready endpoints
//! is reported.

use std::{collections::BTreeMap, net::IpAddr, net::SocketAddr};

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::{
    Api, Client,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::watcher,
};
use tokio::sync::mpsc;
use tracing::{debug, info};

use super::{BackendSet, Found, Report, Source, SourceEvent};
use crate::config::SliceSource;

/// The label the EndpointSlice controller puts on a Service's slices.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The ready endpoints of one slice, on the named port. An endpoint whose
/// `ready` condition is absent counts as ready (the API's rule).
pub fn ready_backends(slice: &EndpointSlice, port_name: &str) -> BackendSet {
    let mut set = BackendSet::new();
    if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
        return set;
    }
    let Some(port) = slice
        .ports
        .iter()
        .flatten()
        .find(|port| port.name.as_deref() == Some(port_name))
        .and_then(|port| port.port)
        .and_then(|port| u16::try_from(port).ok())
        .filter(|port| *port != 0)
    else {
        return set;
    };
    for endpoint in &slice.endpoints {
        let ready = endpoint
            .conditions
            .as_ref()
            .and_then(|conditions| conditions.ready)
            .unwrap_or(true);
        if !ready {
            continue;
        }
        for address in &endpoint.addresses {
            if let Ok(ip) = address.parse::<IpAddr>() {
                set.insert(Found {
                    addr: SocketAddr::new(ip, port),
                    standby: false,
                });
            }
        }
    }
    set
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

/// Longest wait between two attempts after a failure.
const MAX_BACKOFF: std::time::Duration = std::time::Duration::from_secs(30);

/// Watches until `events` is closed. Any failure starts over after a
/// backoff (1 s, doubling to 30 s): a new client (a rotated client
/// certificate is read again), a new list, then the watch. So a source
/// that failed says so once, and says it recovered with its first list.
pub async fn follow(service: String, spec: SliceSource, events: mpsc::Sender<SourceEvent>) {
    let send = |report: Report| {
        let event = SourceEvent {
            service: service.clone(),
            source: Source::EndpointSlices,
            report,
        };
        let events = events.clone();
        async move { events.send(event).await.is_ok() }
    };
    let mut backoff = std::time::Duration::from_secs(1);
    let mut last: Option<Report> = None;
    loop {
        let failure = match client(&spec).await {
            Ok(client) => watch(&service, &spec, client, &mut last, &send, &mut backoff).await,
            Err(error) => Some(error),
        };
        let Some(failure) = failure else {
            return;
        };
        debug!("{service}: EndpointSlice watch: {failure}");
        let report = Report::Failed(failure);
        if last.as_ref() != Some(&report) {
            if !send(report.clone()).await {
                return;
            }
            last = Some(report);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One list and watch, until it fails (the reason) or `events` is closed
/// (None).
async fn watch<F, Fut>(
    service: &str,
    spec: &SliceSource,
    client: Client,
    last: &mut Option<Report>,
    send: &F,
    backoff: &mut std::time::Duration,
) -> Option<String>
where
    F: Fn(Report) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let api: Api<EndpointSlice> = Api::namespaced(client, &spec.namespace);
    let config =
        watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL}={}", spec.service));
    let mut stream = watcher(api, config).boxed();
    info!(
        "{service}: watching the EndpointSlices of {}/{} (port {})",
        spec.namespace, spec.service, spec.port
    );
    let mut slices: BTreeMap<String, BackendSet> = BTreeMap::new();
    let mut listing: Option<BTreeMap<String, BackendSet>> = None;
    loop {
        let report = match stream.next().await {
            None => return Some("the watch stream ended".to_string()),
            Some(Err(error)) => return Some(error.to_string()),
            Some(Ok(watcher::Event::Init)) => {
                listing = Some(BTreeMap::new());
                continue;
            }
            Some(Ok(watcher::Event::InitApply(slice))) => {
                if let Some(listing) = listing.as_mut() {
                    listing.insert(name_of(&slice), ready_backends(&slice, &spec.port));
                }
                continue;
            }
            Some(Ok(watcher::Event::InitDone)) => {
                *backoff = std::time::Duration::from_secs(1);
                slices = listing.take().unwrap_or_default();
                Report::Set(union(&slices))
            }
            Some(Ok(watcher::Event::Apply(slice))) => {
                slices.insert(name_of(&slice), ready_backends(&slice, &spec.port));
                Report::Set(union(&slices))
            }
            Some(Ok(watcher::Event::Delete(slice))) => {
                slices.remove(&name_of(&slice));
                Report::Set(union(&slices))
            }
        };
        if last.as_ref() == Some(&report) {
            continue;
        }
        if !send(report.clone()).await {
            return None;
        }
        *last = Some(report);
    }
}

fn name_of(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

fn union(slices: &BTreeMap<String, BackendSet>) -> BackendSet {
    slices.values().flatten().copied().collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};

    use super::*;

    fn endpoint(address: &str, ready: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![address.to_string()],
            conditions: Some(EndpointConditions {
                ready,
                ..EndpointConditions::default()
            }),
            ..Endpoint::default()
        }
    }

    fn slice(address_type: &str, endpoints: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            address_type: address_type.to_string(),
            endpoints,
            ports: Some(vec![
                EndpointPort {
                    name: Some("metrics".into()),
                    port: Some(9000),
                    ..EndpointPort::default()
                },
                EndpointPort {
                    name: Some("https".into()),
                    port: Some(6443),
                    ..EndpointPort::default()
                },
            ]),
            ..EndpointSlice::default()
        }
    }

    #[test]
    fn ready_endpoints_on_the_named_port() {
        let slice = slice(
            "IPv4",
            vec![
                endpoint("10.0.0.1", Some(true)),
                endpoint("10.0.0.2", None),
                endpoint("10.0.0.3", Some(false)),
            ],
        );
        let addrs: Vec<String> = ready_backends(&slice, "https")
            .iter()
            .map(|found| found.addr.to_string())
            .collect();
        assert_eq!(addrs, ["10.0.0.1:6443", "10.0.0.2:6443"]);
        assert!(ready_backends(&slice, "grpc").is_empty());
    }

    #[test]
    fn fqdn_slices_are_ignored() {
        let slice = slice("FQDN", vec![endpoint("api.example", Some(true))]);
        assert!(ready_backends(&slice, "https").is_empty());
    }
}
