//! The test Kubernetes apiserver (the `kubeapi` helper) held to the
//! official Python client, and its watch semantics on the wire: resuming,
//! 410 after a compaction, bookmarks, closed streams, client certificates.

use std::{
    process::{Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use serde_json::{Value, json};
use socklb_tests::{
    kube::{
        KubeApi, KubeApiOptions, SERVICE_NAME_LABEL, SliceEndpoint, SliceSpec, missing_python,
        python,
    },
    require,
};

/// Lists the slices of one service with the official client, then watches
/// from the list's version until a DELETED event, and prints what the
/// client decoded as one JSON object. Every raw object also goes through
/// kubernetes-validate's strict schema of the API.
const PYTHON_CLIENT: &str = r#"
import datetime, json, sys
from kubernetes import client, config, watch
import kubernetes_validate

kubeconfig, namespace, selector = sys.argv[1:4]
config.load_kube_config(config_file=kubeconfig)
api = client.DiscoveryV1Api()

def validate(raw):
    typed = dict(raw, apiVersion="discovery.k8s.io/v1", kind="EndpointSlice")
    kubernetes_validate.validate(typed, "1.31", strict=True)

def summary(item):
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "name": item.metadata.name,
        "namespace": item.metadata.namespace,
        "resource_version": item.metadata.resource_version,
        "generation": item.metadata.generation,
        "labels": item.metadata.labels,
        "uid_length": len(item.metadata.uid),
        "age_seconds": (now - item.metadata.creation_timestamp).total_seconds(),
        "address_type": item.address_type,
        "endpoints": [
            {
                "addresses": endpoint.addresses,
                "ready": endpoint.conditions.ready,
                "serving": endpoint.conditions.serving,
                "terminating": endpoint.conditions.terminating,
            }
            for endpoint in item.endpoints
        ],
        "ports": [
            {"name": port.name, "port": port.port, "protocol": port.protocol}
            for port in item.ports or []
        ],
    }

listed = api.list_namespaced_endpoint_slice(namespace, label_selector=selector)
raw = api.list_namespaced_endpoint_slice(
    namespace, label_selector=selector, _preload_content=False
)
for item in json.loads(raw.data)["items"]:
    validate(item)

events = []
stream = watch.Watch()
for event in stream.stream(
    api.list_namespaced_endpoint_slice,
    namespace,
    label_selector=selector,
    resource_version=listed.metadata.resource_version,
    timeout_seconds=60,
):
    validate(event["raw_object"])
    events.append(dict(summary(event["object"]), type=event["type"]))
    if event["type"] == "DELETED":
        stream.stop()

print(json.dumps({
    "kind": listed.kind,
    "api_version": listed.api_version,
    "resource_version": listed.metadata.resource_version,
    "items": [summary(item) for item in listed.items],
    "events": events,
}))
"#;

/// Longest the Python client may run (its watch ends after 60 s anyway).
const PYTHON_LIMIT: Duration = Duration::from_secs(120);

fn endpoint(address: &str, ready: bool, serving: bool, terminating: bool) -> SliceEndpoint {
    SliceEndpoint {
        addresses: vec![address.to_string()],
        ready,
        serving: Some(serving),
        terminating,
        node_name: None,
    }
}

/// Labels every slice of service `kubernetes` carries: as on the
/// apiserver's own slice, the service name and no managed-by label.
fn kubernetes_labels() -> Value {
    json!({
        SERVICE_NAME_LABEL: "kubernetes",
    })
}

/// Checks and removes what varies between runs (the uid, the age).
fn strip_volatile(summary: &mut Value) {
    let object = summary.as_object_mut().expect("a summary object");
    assert_eq!(object.remove("uid_length"), Some(json!(36)), "a UUID");
    let age = object
        .remove("age_seconds")
        .and_then(|age| age.as_f64())
        .expect("the client parsed creationTimestamp");
    assert!(
        (-5.0..600.0).contains(&age),
        "creationTimestamp is {age} s old"
    );
}

#[test]
fn the_official_python_client_lists_and_watches_endpoint_slices() {
    require!(missing_python());
    let python = python();
    let api = KubeApi::start();
    let kubernetes = SliceSpec::new("kubernetes", "IPv4")
        .with_port("https", 6443)
        .with_endpoint("198.18.0.2", true)
        .with_endpoint("198.18.0.3", true)
        .with_endpoint("198.18.0.4", false);
    let ipv6 = SliceSpec::new("kubernetes", "IPv6")
        .with_port("https", 6443)
        .with_endpoint("fd00::2", true);
    let other = SliceSpec::new("other", "IPv4")
        .with_port("", 80)
        .with_endpoint("198.18.0.9", true);
    let created = api.put_slice("default", "kubernetes", &kubernetes);
    let ipv6_created = api.put_slice("default", "kubernetes-v6", &ipv6);
    // The selector leaves out another service, and another namespace.
    api.put_slice("default", "other", &other);
    let listed_version = api
        .put_slice("kube-system", "kubernetes", &kubernetes)
        .resource_version;
    assert_eq!(created.event, "ADDED");

    let kubeconfig = api.kubeconfig();
    let child = Command::new(&python)
        .arg("-c")
        .arg(PYTHON_CLIENT)
        .arg(&kubeconfig)
        .args(["default", &format!("{SERVICE_NAME_LABEL}=kubernetes")])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("running {}: {error}", python.display()));
    let pid = child.id();
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });

    // Change the slices only once the client watches.
    api.wait_stats("the Python client's watch", PYTHON_LIMIT, |stats| {
        stats.watches_open == 1
    });
    let mut changed = kubernetes.clone();
    changed.endpoints = vec![
        endpoint("198.18.0.2", false, true, true),
        endpoint("198.18.0.3", true, true, false),
        endpoint("198.18.0.4", true, true, false),
    ];
    changed.ports[0].port = 6444;
    let modified = api.put_slice("default", "kubernetes", &changed);
    let unseen = api.put_slice(
        "default",
        "other",
        &other.clone().with_endpoint("198.18.0.10", true),
    );
    let deleted = api.delete_slice("default", "kubernetes-v6");
    assert_eq!(
        (
            modified.event.as_str(),
            unseen.event.as_str(),
            deleted.event.as_str()
        ),
        ("MODIFIED", "MODIFIED", "DELETED")
    );

    let output = match finished.recv_timeout(PYTHON_LIMIT) {
        Ok(output) => output.expect("the Python client's output"),
        Err(_) => {
            // SAFETY: kill on the PID of a child we started and that the
            // waiting thread has not reaped (it is still running).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("the Python client did not finish within {PYTHON_LIMIT:?}");
        }
    };
    assert!(
        output.status.success(),
        "the Python client failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let mut decoded: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "the Python client's output ({error}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    });
    for list in ["items", "events"] {
        for summary in decoded[list].as_array_mut().into_iter().flatten() {
            strip_volatile(summary);
        }
    }

    let https = |port: u16| json!([{"name": "https", "port": port, "protocol": "TCP"}]);
    let condition = |address: &str, ready: bool, serving: bool, terminating: bool| json!({"addresses": [address], "ready": ready, "serving": serving, "terminating": terminating});
    let expected = json!({
        "kind": "EndpointSliceList",
        "api_version": "discovery.k8s.io/v1",
        "resource_version": listed_version.to_string(),
        "items": [
            {
                "name": "kubernetes",
                "namespace": "default",
                "resource_version": created.resource_version.to_string(),
                "generation": 1,
                "labels": kubernetes_labels(),
                "address_type": "IPv4",
                "endpoints": [
                    condition("198.18.0.2", true, true, false),
                    condition("198.18.0.3", true, true, false),
                    condition("198.18.0.4", false, false, false),
                ],
                "ports": https(6443),
            },
            {
                "name": "kubernetes-v6",
                "namespace": "default",
                "resource_version": ipv6_created.resource_version.to_string(),
                "generation": 1,
                "labels": kubernetes_labels(),
                "address_type": "IPv6",
                "endpoints": [condition("fd00::2", true, true, false)],
                "ports": https(6443),
            },
        ],
        "events": [
            {
                "type": "MODIFIED",
                "name": "kubernetes",
                "namespace": "default",
                "resource_version": modified.resource_version.to_string(),
                "generation": 2,
                "labels": kubernetes_labels(),
                "address_type": "IPv4",
                "endpoints": [
                    condition("198.18.0.2", false, true, true),
                    condition("198.18.0.3", true, true, false),
                    condition("198.18.0.4", true, true, false),
                ],
                "ports": https(6444),
            },
            {
                "type": "DELETED",
                "name": "kubernetes-v6",
                "namespace": "default",
                "resource_version": deleted.resource_version.to_string(),
                "generation": 1,
                "labels": kubernetes_labels(),
                "address_type": "IPv6",
                "endpoints": [condition("fd00::2", true, true, false)],
                "ports": https(6443),
            },
        ],
    });
    assert_eq!(
        decoded,
        expected,
        "what the Python client decoded:\n{}",
        serde_json::to_string_pretty(&decoded).unwrap_or_default()
    );
    // Each version is one change, in order: the list's version, then ours.
    assert_eq!(
        [
            modified.resource_version,
            unseen.resource_version,
            deleted.resource_version
        ],
        [listed_version + 1, listed_version + 2, listed_version + 3]
    );

    let stats = api.wait_stats(
        "the Python client's watch to close",
        PYTHON_LIMIT,
        |stats| stats.watches_open == 0,
    );
    assert_eq!(
        (
            stats.lists,
            stats.watches,
            stats.events_sent,
            stats.gone_sent,
            stats.handshake_failures
        ),
        (2, 1, 2, 0, 0),
        "two lists, one watch that saw two events: {stats:?}"
    );
}

/// A watch of service `kubernetes` in `default` from `version`.
fn watch_path(version: u64, extra: &str) -> String {
    format!(
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices?watch=true\
         &labelSelector=kubernetes.io%2Fservice-name%3Dkubernetes\
         &resourceVersion={version}&timeoutSeconds=1{extra}"
    )
}

fn one_endpoint(address: &str) -> SliceSpec {
    SliceSpec::new("kubernetes", "IPv4")
        .with_port("https", 6443)
        .with_endpoint(address, true)
}

fn types_and_versions(events: &[Value]) -> Vec<(String, String)> {
    events
        .iter()
        .map(|event| {
            (
                event["type"].as_str().unwrap_or_default().to_string(),
                event["object"]["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

#[test]
fn a_watch_from_before_a_compaction_gets_410_expired() {
    let api = KubeApi::start();
    let first = api
        .put_slice("default", "kubernetes", &one_endpoint("198.18.0.2"))
        .resource_version;
    let second = api
        .put_slice("default", "kubernetes", &one_endpoint("198.18.0.3"))
        .resource_version;

    // While the history holds it, a watch resumes after `first`.
    let replay = api.get(&watch_path(first, "")).expect("a watch");
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(replay.header("transfer-encoding"), Some("chunked"));
    assert_eq!(
        types_and_versions(&replay.json_lines()),
        [("MODIFIED".to_string(), second.to_string())]
    );

    assert_eq!(api.compact(), second, "the oldest version kept");
    let expired = api.get(&watch_path(first, "")).expect("a watch");
    // As the apiserver does: HTTP 200, one ERROR event, the end.
    assert_eq!(expired.status, 200);
    assert_eq!(
        expired.json_lines(),
        [json!({
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": format!("too old resource version: {first} ({second})"),
                "reason": "Expired",
                "code": 410,
            },
        })]
    );
    assert_eq!(api.stats().gone_sent, 1);

    // From the compaction's version on, watches resume again.
    let third = api
        .put_slice("default", "kubernetes", &one_endpoint("198.18.0.4"))
        .resource_version;
    let resumed = api.get(&watch_path(second, "")).expect("a watch");
    assert_eq!(
        types_and_versions(&resumed.json_lines()),
        [("MODIFIED".to_string(), third.to_string())]
    );
    let stats = api.stats();
    assert_eq!(
        (stats.gone_sent, stats.watches, stats.watches_open),
        (1, 3, 0),
        "{stats:?}"
    );
}

#[test]
fn bookmarks_carry_the_current_version_and_close_watches_ends_every_stream() {
    let api = KubeApi::start_with(&KubeApiOptions {
        bookmark_interval: Some(Duration::from_millis(50)),
        ..KubeApiOptions::default()
    });
    let version = api
        .put_slice("default", "kubernetes", &one_endpoint("198.18.0.2"))
        .resource_version;
    let path = watch_path(version, "&allowWatchBookmarks=true")
        .replace("timeoutSeconds=1", "timeoutSeconds=60");
    let (done, finished) = mpsc::channel();
    std::thread::scope(|scope| {
        for _ in 0..2 {
            let done = done.clone();
            let (api, path) = (&api, &path);
            scope.spawn(move || {
                let _ = done.send(api.get(path));
            });
        }
        api.wait_stats(
            "two watches with bookmarks",
            Duration::from_secs(30),
            |stats| stats.watches_open == 2 && stats.bookmarks_sent >= 4,
        );
        assert_eq!(api.close_watches(), 2);
    });
    let mut received = 0;
    for _ in 0..2 {
        let stream = finished
            .recv_timeout(Duration::from_secs(30))
            .expect("the watch ended")
            .expect("a watch");
        let events = stream.json_lines();
        assert!(!events.is_empty(), "no bookmark");
        received += events.len() as u64;
        for event in &events {
            assert_eq!(
                event,
                &json!({
                    "type": "BOOKMARK",
                    "object": {
                        "apiVersion": "discovery.k8s.io/v1",
                        "kind": "EndpointSlice",
                        "metadata": {"resourceVersion": version.to_string()},
                    },
                })
            );
        }
    }
    let stats = api.wait_stats("no open watch", Duration::from_secs(10), |stats| {
        stats.watches_open == 0
    });
    assert_eq!(
        stats.bookmarks_sent, received,
        "every bookmark the server counted reached a client"
    );
}

#[test]
fn a_client_without_a_certificate_never_gets_past_tls() {
    let api = KubeApi::start();
    let refused = api.get_with(api.client_config(false), "/version");
    assert!(
        refused.is_err(),
        "answered without a client certificate: {refused:?}"
    );
    api.wait_stats("the failed handshake", Duration::from_secs(10), |stats| {
        stats.handshake_failures == 1
    });
    let version = api.get("/version").expect("with the certificate");
    assert_eq!(version.status, 200);
    assert_eq!(version.json()["gitVersion"], "v1.31.0-socklb-test");
}
