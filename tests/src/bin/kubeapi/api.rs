//! The Kubernetes API: discovery documents, and get, list and watch of
//! EndpointSlices, in the JSON the apiserver writes.

use std::{
    collections::{BTreeMap, HashMap},
    convert::Infallible,
    sync::Arc,
};

use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Bytes, Incoming},
    header,
};
use serde_json::{Value, json};
use socklb_tests::kube::{SERVICE_NAME_LABEL, SliceSpec};

use crate::{
    Server, bump, fault,
    selector::{Selector, parse_bool, parse_query},
    store::StoredSlice,
    watch::start_watch,
};

pub const GROUP: &str = "discovery.k8s.io";
pub const GROUP_VERSION: &str = "discovery.k8s.io/v1";
pub const KIND: &str = "EndpointSlice";
const GIT_VERSION: &str = "v1.31.0-socklb-test";

pub type Body = BoxBody<Bytes, Infallible>;

pub fn slice_labels(spec: &SliceSpec) -> BTreeMap<String, String> {
    let mut labels = spec.labels.clone();
    labels.insert(SERVICE_NAME_LABEL.to_string(), spec.service.clone());
    labels
}

/// An EndpointSlice as the API serves it. Items of a list carry no
/// apiVersion and kind; a get or a watch event does.
pub fn slice_json(slice: &StoredSlice, with_type: bool) -> Value {
    let endpoints: Vec<Value> = slice
        .spec
        .endpoints
        .iter()
        .map(|endpoint| {
            let mut value = json!({
                "addresses": endpoint.addresses,
                "conditions": {
                    "ready": endpoint.ready,
                    "serving": endpoint.serving.unwrap_or(endpoint.ready),
                    "terminating": endpoint.terminating,
                },
            });
            if let Some(node) = &endpoint.node_name {
                value["nodeName"] = json!(node);
            }
            value
        })
        .collect();
    let mut object = json!({
        "metadata": {
            "name": slice.name,
            "namespace": slice.namespace,
            "uid": slice.uid,
            "resourceVersion": slice.resource_version.to_string(),
            "generation": slice.generation,
            "creationTimestamp": slice.creation_timestamp,
            "labels": slice_labels(&slice.spec),
        },
        "addressType": slice.spec.address_type,
        "endpoints": endpoints,
    });
    if !slice.spec.ports.is_empty() {
        object["ports"] = slice
            .spec
            .ports
            .iter()
            .map(|port| json!({"name": port.name, "port": port.port, "protocol": port.protocol}))
            .collect();
    }
    if with_type {
        object["apiVersion"] = json!(GROUP_VERSION);
        object["kind"] = json!(KIND);
    }
    object
}

/// A `Status` object, the body of every API error.
pub fn status_json(code: StatusCode, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    })
}

pub fn group_version_json() -> Value {
    json!({"groupVersion": GROUP_VERSION, "version": "v1"})
}

pub fn group_json() -> Value {
    json!({
        "name": GROUP,
        "versions": [group_version_json()],
        "preferredVersion": group_version_json(),
    })
}

pub fn version_json() -> Value {
    json!({
        "major": "1",
        "minor": "31",
        "gitVersion": GIT_VERSION,
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2024-08-13T07:28:49Z",
        "goVersion": "go1.22.5",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

pub fn resource_list_json() -> Value {
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": [{
            "name": "endpointslices",
            "singularName": "endpointslice",
            "namespaced": true,
            "kind": KIND,
            "verbs": ["get", "list", "watch"],
        }],
    })
}

pub fn json_response(code: StatusCode, value: &Value) -> Response<Body> {
    let mut bytes = serde_json::to_vec(value).expect("JSON");
    bytes.push(b'\n');
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(bytes)).boxed())
        .expect("a response")
}

pub fn error_response(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(code, &status_json(code, reason, message))
}

pub fn bad_request(message: &str) -> Response<Body> {
    error_response(StatusCode::BAD_REQUEST, "BadRequest", message)
}

pub async fn api(
    server: Arc<Server>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let method = request.method().clone();
    let target = request
        .uri()
        .path_and_query()
        .map_or_else(|| request.uri().path().to_string(), ToString::to_string);
    let (response, note) = route_api(&server, &method, request.uri());
    eprintln!(
        "kubeapi: {method} {target} {}{note}",
        response.status().as_u16()
    );
    Ok(response)
}

pub fn route_api(
    server: &Arc<Server>,
    method: &Method,
    uri: &hyper::Uri,
) -> (Response<Body>, String) {
    let no_note = String::new();
    if method != Method::GET {
        return (
            error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                &format!("the server does not allow {method} here: it serves get, list and watch"),
            ),
            no_note,
        );
    }
    let query = parse_query(uri.query());
    let path = uri.path();
    let document = match path.trim_end_matches('/') {
        "/version" => Some(version_json()),
        "/api" => Some(json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [],
        })),
        "/apis" => Some(json!({
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [group_json()],
        })),
        "/apis/discovery.k8s.io" => {
            let mut group = group_json();
            group["kind"] = json!("APIGroup");
            group["apiVersion"] = json!("v1");
            Some(group)
        }
        "/apis/discovery.k8s.io/v1" => Some(resource_list_json()),
        _ => None,
    };
    if let Some(document) = document {
        return (json_response(StatusCode::OK, &document), no_note);
    }
    if matches!(path, "/healthz" | "/livez" | "/readyz") {
        let response = Response::builder()
            .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(Full::new(Bytes::from_static(b"ok")).boxed())
            .expect("a response");
        return (response, no_note);
    }
    let segments: Vec<&str> = path
        .strip_prefix("/apis/discovery.k8s.io/v1/")
        .map(|rest| rest.split('/').collect())
        .unwrap_or_default();
    match segments.as_slice() {
        ["endpointslices"] => collection(server, None, &query),
        ["namespaces", namespace, "endpointslices"] => collection(server, Some(*namespace), &query),
        ["namespaces", namespace, "endpointslices", name] => {
            (get_slice(server, namespace, name), no_note)
        }
        _ => (
            error_response(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("the server could not find the requested resource ({path})"),
            ),
            no_note,
        ),
    }
}

pub fn get_slice(server: &Server, namespace: &str, name: &str) -> Response<Body> {
    let store = server.store();
    match store.slices.get(&(namespace.to_string(), name.to_string())) {
        Some(slice) => json_response(StatusCode::OK, &slice_json(slice, true)),
        None => json_response(
            StatusCode::NOT_FOUND,
            &json!({
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": format!("endpointslices.{GROUP} \"{name}\" not found"),
                "reason": "NotFound",
                "details": {"name": name, "group": GROUP, "kind": "endpointslices"},
                "code": 404,
            }),
        ),
    }
}

/// A list, or a watch when `watch` is true. `limit` and `continue` are
/// served by answering everything at once, with no continue token.
pub fn collection(
    server: &Arc<Server>,
    namespace: Option<&str>,
    query: &HashMap<String, String>,
) -> (Response<Body>, String) {
    let selector = match Selector::parse(namespace, query) {
        Ok(selector) => selector,
        Err(message) => return (bad_request(&message), String::new()),
    };
    let watching = match parse_bool("watch", query.get("watch")) {
        Ok(watching) => watching,
        Err(message) => return (bad_request(&message), String::new()),
    };
    if watching {
        if let Some(answer) = fault::watch_fault(server) {
            return answer;
        }
        return start_watch(server, selector, query);
    }
    bump(&server.stats.lists);
    if let Some(answer) = fault::list_fault(server) {
        return answer;
    }
    let store = server.store();
    let items: Vec<Value> = store
        .slices
        .values()
        .filter(|slice| selector.matches(slice))
        .map(|slice| slice_json(slice, false))
        .collect();
    let count = items.len();
    let list = json!({
        "apiVersion": GROUP_VERSION,
        "kind": "EndpointSliceList",
        "metadata": {"resourceVersion": store.resource_version.to_string()},
        "items": items,
    });
    (
        json_response(StatusCode::OK, &list),
        format!(" ({count} items)"),
    )
}
