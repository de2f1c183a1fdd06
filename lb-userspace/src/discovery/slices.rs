//! The EndpointSlices of a Kubernetes Service (by default
//! `default/kubernetes`, port `https`: the apiservers themselves), watched
//! with kube-runtime's watcher. The watcher lists, then watches from the
//! list's resourceVersion; when a watch ends it resumes, and when the
//! server answers 410 Gone (or anything fails) it lists again, after an
//! exponential backoff. Each change of the ready endpoints is reported.

use std::{collections::BTreeMap, net::IpAddr, net::SocketAddr};

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::{
    Api, Client,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt, watcher},
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

/// Watches until `events` is closed.
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
    let client = loop {
        match client(&spec).await {
            Ok(client) => break client,
            Err(error) => {
                if !send(Report::Failed(error)).await {
                    return;
                }
                // A kubeconfig that appears later (the kubelet writes it
                // after bootstrap) is picked up.
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            }
        }
    };
    let api: Api<EndpointSlice> = Api::namespaced(client, &spec.namespace);
    let config =
        watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL}={}", spec.service));
    let mut stream = watcher(api, config).default_backoff().boxed();
    info!(
        "{service}: watching the EndpointSlices of {}/{} (port {})",
        spec.namespace, spec.service, spec.port
    );
    let mut slices: BTreeMap<String, BackendSet> = BTreeMap::new();
    let mut listing: Option<BTreeMap<String, BackendSet>> = None;
    let mut last: Option<Report> = None;
    while let Some(item) = stream.next().await {
        let report = match item {
            Ok(watcher::Event::Init) => {
                listing = Some(BTreeMap::new());
                continue;
            }
            Ok(watcher::Event::InitApply(slice)) => {
                if let Some(listing) = listing.as_mut() {
                    listing.insert(name_of(&slice), ready_backends(&slice, &spec.port));
                }
                continue;
            }
            Ok(watcher::Event::InitDone) => {
                slices = listing.take().unwrap_or_default();
                Report::Set(union(&slices))
            }
            Ok(watcher::Event::Apply(slice)) => {
                slices.insert(name_of(&slice), ready_backends(&slice, &spec.port));
                Report::Set(union(&slices))
            }
            Ok(watcher::Event::Delete(slice)) => {
                slices.remove(&name_of(&slice));
                Report::Set(union(&slices))
            }
            Err(error) => {
                debug!("{service}: EndpointSlice watch: {error}");
                Report::Failed(error.to_string())
            }
        };
        if last.as_ref() == Some(&report) {
            continue;
        }
        if !send(report.clone()).await {
            return;
        }
        last = Some(report);
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
