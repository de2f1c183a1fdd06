//! The admin API (plain HTTP on loopback) that tests drive the server
//! with: put and delete slices, compact the history, close every watch,
//! read the counters.

use std::{
    convert::Infallible,
    net::IpAddr,
    sync::{Arc, MutexGuard, atomic::Ordering},
};

use http_body_util::{BodyExt, Limited};
use hyper::{Method, Request, Response, StatusCode, body::Incoming};
use serde_json::json;
use socklb_tests::kube::{Faults, SliceSpec};

use crate::{
    Server,
    api::{Body, json_response, slice_json},
    store::{Event, Store},
};

/// Largest admin request body.
const MAX_ADMIN_BODY: usize = 1 << 20;

pub async fn admin(
    server: Arc<Server>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let body = match Limited::new(request.into_body(), MAX_ADMIN_BODY)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            let response = admin_error(
                StatusCode::BAD_REQUEST,
                &format!("reading the body: {error}"),
            );
            eprintln!("kubeapi admin: {method} {path} 400");
            return Ok(response);
        }
    };
    let response = route_admin(&server, &method, &path, &body);
    eprintln!(
        "kubeapi admin: {method} {path} {}",
        response.status().as_u16()
    );
    Ok(response)
}

pub fn admin_error(code: StatusCode, message: &str) -> Response<Body> {
    json_response(code, &json!({"error": message}))
}

pub fn route_admin(server: &Server, method: &Method, path: &str, body: &[u8]) -> Response<Body> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, segments.as_slice()) {
        (&Method::PUT, ["slices", namespace, name]) => put_slice(server, namespace, name, body),
        (&Method::DELETE, ["slices", namespace, name]) => {
            let mut store = server.store();
            match store.delete(namespace, name) {
                Some(event) => change_response(server, store, &event),
                None => admin_error(
                    StatusCode::NOT_FOUND,
                    &format!("no slice {namespace}/{name}"),
                ),
            }
        }
        (&Method::POST, ["compact"]) => {
            let mut store = server.store();
            store.compact();
            json_response(
                StatusCode::OK,
                &json!({"resource_version": store.resource_version}),
            )
        }
        (&Method::POST, ["close-watches"]) => {
            let open = server.stats.watches_open.load(Ordering::Relaxed);
            server
                .close_watches
                .send_modify(|generation| *generation += 1);
            json_response(StatusCode::OK, &json!({"closed": open}))
        }
        (&Method::PUT, ["faults"]) => match serde_json::from_slice::<Faults>(body) {
            Ok(faults) => {
                *server
                    .faults
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = faults;
                json_response(StatusCode::OK, &json!({"faults": faults}))
            }
            Err(error) => admin_error(StatusCode::BAD_REQUEST, &format!("the faults: {error}")),
        },
        (&Method::GET, ["stats"]) => json_response(
            StatusCode::OK,
            &serde_json::to_value(server.stats()).expect("stats"),
        ),
        _ => admin_error(
            StatusCode::NOT_FOUND,
            &format!(
                "no {method} {path}: PUT|DELETE /slices/NS/NAME, POST /compact, POST /close-watches, PUT /faults, GET /stats"
            ),
        ),
    }
}

pub fn put_slice(server: &Server, namespace: &str, name: &str, body: &[u8]) -> Response<Body> {
    let spec: SliceSpec = match serde_json::from_slice(body) {
        Ok(spec) => spec,
        Err(error) => return admin_error(StatusCode::BAD_REQUEST, &format!("the slice: {error}")),
    };
    if let Err(message) = validate(namespace, name, &spec) {
        return admin_error(StatusCode::BAD_REQUEST, &message);
    }
    let mut store = server.store();
    let key = (namespace.to_string(), name.to_string());
    if let Some(old) = store.slices.get(&key)
        && old.spec.address_type != spec.address_type
    {
        return admin_error(
            StatusCode::BAD_REQUEST,
            &format!(
                "address_type: {:?} is immutable (delete the slice first)",
                old.spec.address_type
            ),
        );
    }
    match store.put(namespace, name, spec) {
        Some(event) => change_response(server, store, &event),
        None => {
            let current = &store.slices[&key];
            json_response(
                StatusCode::OK,
                &json!({
                    "event": "UNCHANGED",
                    "resource_version": current.resource_version,
                    "object": slice_json(current, true),
                }),
            )
        }
    }
}

/// Persists the store, wakes the watches and answers what changed. A
/// failure to persist is an error of the answer, but the watches still see
/// the change, which is in memory.
pub fn change_response(
    server: &Server,
    store: MutexGuard<'_, Store>,
    event: &Event,
) -> Response<Body> {
    let persisted = store.persist();
    drop(store);
    server.version_changed.send_replace(event.resource_version);
    if let Err(error) = persisted {
        return admin_error(StatusCode::INTERNAL_SERVER_ERROR, &format!("{error:#}"));
    }
    json_response(
        StatusCode::OK,
        &json!({
            "event": event.kind.name(),
            "resource_version": event.resource_version,
            "object": slice_json(&event.object, true),
        }),
    )
}

/// What the apiserver's validation would refuse, named by field.
pub fn validate(namespace: &str, name: &str, spec: &SliceSpec) -> Result<(), String> {
    let dns_label = |text: &str| {
        !text.is_empty()
            && text.len() <= 63
            && text
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !text.starts_with('-')
            && !text.ends_with('-')
    };
    if !dns_label(namespace) {
        return Err(format!("namespace {namespace:?}: not a DNS label"));
    }
    if name.len() > 253 || !name.split('.').all(dns_label) {
        return Err(format!("name {name:?}: not a DNS subdomain"));
    }
    let label_value = |text: &str| {
        text.len() <= 63
            && text
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    if spec.service.is_empty() || !label_value(&spec.service) {
        return Err(format!("service {:?}: not a label value", spec.service));
    }
    for (key, value) in &spec.labels {
        if key.is_empty() || key.contains(char::is_whitespace) || !label_value(value) {
            return Err(format!("labels: {key:?}={value:?} is not a label"));
        }
    }
    if spec.endpoints.len() > 1000 {
        return Err("endpoints: at most 1000".to_string());
    }
    if spec.ports.len() > 100 {
        return Err("ports: at most 100".to_string());
    }
    for port in &spec.ports {
        if port.port == 0 || !matches!(port.protocol.as_str(), "TCP" | "UDP" | "SCTP") {
            return Err(format!("ports: {port:?}"));
        }
    }
    for endpoint in &spec.endpoints {
        if endpoint.addresses.is_empty() || endpoint.addresses.len() > 100 {
            return Err("endpoints: each has 1 to 100 addresses".to_string());
        }
        for address in &endpoint.addresses {
            let fits = match (spec.address_type.as_str(), address.parse::<IpAddr>()) {
                ("IPv4", Ok(IpAddr::V4(_))) | ("IPv6", Ok(IpAddr::V6(_))) => true,
                ("FQDN", _) => address.split('.').all(dns_label),
                _ => false,
            };
            if !fits {
                return Err(format!(
                    "endpoints: {address:?} is not an address of type {:?} (IPv4, IPv6 or FQDN)",
                    spec.address_type
                ));
            }
        }
    }
    Ok(())
}
