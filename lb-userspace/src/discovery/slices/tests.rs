use std::collections::BTreeMap;

use k8s_openapi::{
    api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::*;
use crate::config::ENDPOINTSLICE_CONTROLLER;

fn spec(managers: Vec<SliceManager>, max_backends: usize) -> SliceSource {
    SliceSource {
        namespace: "default".into(),
        service: "kubernetes".into(),
        port: "https".into(),
        kubeconfig: None,
        managers,
        max_backends,
    }
}

fn apiserver_spec() -> SliceSource {
    spec(vec![SliceManager::Apiserver], 64)
}

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

/// A slice named `name`, with a managed-by label when `manager` is given,
/// created `age` seconds after some epoch.
fn slice(
    name: &str,
    manager: Option<&str>,
    address_type: &str,
    endpoints: Vec<Endpoint>,
) -> EndpointSlice {
    let mut labels = BTreeMap::from([(SERVICE_NAME_LABEL.to_string(), "kubernetes".to_string())]);
    if let Some(manager) = manager {
        labels.insert(MANAGED_BY_LABEL.to_string(), manager.to_string());
    }
    EndpointSlice {
        address_type: address_type.to_string(),
        endpoints,
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
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
    }
}

fn ready_slice(name: &str, manager: Option<&str>, first: u16, count: u16) -> EndpointSlice {
    let endpoints = (first..first + count)
        .map(|index| endpoint(&format!("10.0.{}.{}", index / 256, index % 256), Some(true)))
        .collect();
    slice(name, manager, "IPv4", endpoints)
}

fn created_at(mut slice: EndpointSlice, seconds: i64) -> EndpointSlice {
    slice.metadata.creation_timestamp = Some(Time(
        k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + seconds).unwrap(),
    ));
    slice
}

fn addrs(set: &BackendSet) -> Vec<String> {
    set.iter().map(|found| found.addr.to_string()).collect()
}

#[test]
fn ready_endpoints_on_the_named_port() {
    let slice = slice(
        "kubernetes",
        None,
        "IPv4",
        vec![
            endpoint("10.0.0.1", Some(true)),
            endpoint("10.0.0.2", None),
            endpoint("10.0.0.3", Some(false)),
        ],
    );
    let set = ready_backends(&slice, &apiserver_spec()).unwrap();
    assert_eq!(addrs(&set), ["10.0.0.1:6443", "10.0.0.2:6443"]);
    let other_port = SliceSource {
        port: "grpc".into(),
        ..apiserver_spec()
    };
    assert!(ready_backends(&slice, &other_port).unwrap().is_empty());
}

/// (what, address type, address, kind of refusal, words)
const INVALID: &[(&str, &str, &str, ProblemKind, &str)] = &[
    (
        "FQDN",
        "FQDN",
        "api.example",
        ProblemKind::Invalid,
        "addressType \"FQDN\"",
    ),
    (
        "not an IP",
        "IPv4",
        "ten.zero",
        ProblemKind::Invalid,
        "lists \"ten.zero\"",
    ),
    (
        "IPv6 in IPv4",
        "IPv4",
        "fd00::1",
        ProblemKind::Invalid,
        "not a usable IPv4",
    ),
    (
        "unspecified",
        "IPv4",
        "0.0.0.0",
        ProblemKind::Invalid,
        "not a usable IPv4",
    ),
    (
        "multicast",
        "IPv6",
        "ff02::1",
        ProblemKind::Invalid,
        "not a usable IPv6",
    ),
    (
        "broadcast",
        "IPv4",
        "255.255.255.255",
        ProblemKind::Invalid,
        "not a usable",
    ),
    (
        "mapped",
        "IPv6",
        "::ffff:10.0.0.1",
        ProblemKind::Invalid,
        "not a usable IPv6",
    ),
    (
        "control characters",
        "IPv4",
        "1\n2",
        ProblemKind::Invalid,
        r#"lists "1\n2""#,
    ),
];

#[test]
fn a_slice_no_api_server_would_serve_is_refused_saying_why() {
    for (what, address_type, address, kind, words) in INVALID {
        let slice = slice(
            "kubernetes",
            None,
            address_type,
            vec![endpoint(address, Some(true))],
        );
        let refusal = ready_backends(&slice, &apiserver_spec()).unwrap_err();
        assert_eq!(refusal.kind, *kind, "{what}");
        assert!(refusal.why.contains(words), "{what}: {}", refusal.why);
        assert!(
            refusal.why.starts_with("EndpointSlice default/kubernetes "),
            "{what}: {}",
            refusal.why
        );
    }
    let mut crowded = endpoint("10.0.0.1", Some(true));
    crowded.addresses = (0..101).map(|index| format!("10.1.0.{index}")).collect();
    let refusal = ready_backends(
        &slice("kubernetes", None, "IPv4", vec![crowded]),
        &apiserver_spec(),
    )
    .unwrap_err();
    assert_eq!(refusal.kind, ProblemKind::Oversized);
    let thousand_and_one = ready_slice("kubernetes", None, 0, 1001);
    let refusal = ready_backends(&thousand_and_one, &apiserver_spec()).unwrap_err();
    assert!(
        refusal.why.contains("1001 endpoints; the API allows 1000"),
        "{}",
        refusal.why
    );
    let sixty_five = ready_slice("kubernetes", None, 0, 65);
    let refusal = ready_backends(&sixty_five, &apiserver_spec()).unwrap_err();
    assert_eq!(refusal.kind, ProblemKind::Oversized);
    assert!(
        refusal
            .why
            .contains("gives 65 backends, more than max-discovered-backends (64)"),
        "{}",
        refusal.why
    );
    assert!(ready_backends(&ready_slice("kubernetes", None, 0, 64), &apiserver_spec()).is_ok());
}

#[test]
fn only_the_services_managers_count() {
    let apiserver = apiserver_spec();
    let controller = spec(
        vec![SliceManager::Label(ENDPOINTSLICE_CONTROLLER.into())],
        64,
    );
    let both = spec(
        vec![
            SliceManager::Apiserver,
            SliceManager::Label(ENDPOINTSLICE_CONTROLLER.into()),
        ],
        64,
    );
    // (slice name, managed-by, spec, counts)
    let cases: [(&str, Option<&str>, &SliceSource, bool); 9] = [
        ("kubernetes", None, &apiserver, true),
        ("kubernetes", Some("evil-controller"), &apiserver, false),
        (
            "kubernetes",
            Some(ENDPOINTSLICE_CONTROLLER),
            &apiserver,
            false,
        ),
        // The apiserver's slice has the Service's name; a labelless forgery
        // under another name is not it.
        ("kubernetes-evil", None, &apiserver, false),
        (
            "kubernetes-abcde",
            Some(ENDPOINTSLICE_CONTROLLER),
            &controller,
            true,
        ),
        (
            "kubernetes-abcde",
            Some("endpointslice-controller.k8s.io.evil"),
            &controller,
            false,
        ),
        ("kubernetes", None, &controller, false),
        ("kubernetes", None, &both, true),
        (
            "kubernetes-abcde",
            Some(ENDPOINTSLICE_CONTROLLER),
            &both,
            true,
        ),
    ];
    for (name, manager, spec, counts) in cases {
        let slice = ready_slice(name, manager, 1, 1);
        assert_eq!(
            check_manager(&slice, spec).is_ok(),
            counts,
            "{name} managed by {manager:?} under {:?}",
            spec.managers
        );
    }
    let refusal = check_manager(
        &ready_slice("evil", Some("evil-controller"), 1, 3),
        &apiserver,
    )
    .unwrap_err();
    assert_eq!(refusal.kind, ProblemKind::ForeignManager);
    assert_eq!(
        refusal.why,
        "EndpointSlice default/evil is managed by \"evil-controller\"; only slices written by \
         @apiserver (no endpointslice.kubernetes.io/managed-by label, named \"kubernetes\") count \
         (endpointslice-managers): ignored"
    );
}

#[test]
fn a_refused_slice_is_said_once_and_leaves_the_others_applied() {
    let mut slices = SliceSet::new(apiserver_spec());
    assert_eq!(slices.apply(&ready_slice("kubernetes", None, 1, 2)), None);
    let evil = ready_slice("evil", Some("evil-controller"), 100, 3);
    let first = slices.apply(&evil).expect("said");
    assert_eq!(first.kind, ProblemKind::ForeignManager);
    // Changed, or seen again in a relist: not said again.
    assert_eq!(
        slices.apply(&ready_slice("evil", Some("evil-controller"), 100, 5)),
        None
    );
    slices.start_list();
    assert_eq!(slices.apply(&ready_slice("kubernetes", None, 1, 2)), None);
    assert_eq!(slices.apply(&evil), None);
    let (set, refusals) = slices.settle();
    assert_eq!(addrs(&set), ["10.0.0.1:6443", "10.0.0.2:6443"]);
    assert!(refusals.is_empty());
    // Another reason is said; so is the same one after a delete.
    let oversized = ready_slice("evil", None, 100, 65);
    assert_eq!(
        slices.apply(&oversized).unwrap().kind,
        ProblemKind::ForeignManager
    );
    slices.remove("evil");
    assert!(slices.apply(&evil).is_some());
    // An oversized slice of the right manager is refused alone; a later
    // change of the good one applies.
    let mut oversized = ready_slice("kubernetes", None, 1, 1000);
    oversized.endpoints[0].addresses.push("10.9.9.9".into());
    assert_eq!(
        slices.apply(&oversized).unwrap().kind,
        ProblemKind::Oversized
    );
    let (set, _) = slices.settle();
    assert!(
        set.is_empty(),
        "the oversized one replaced the good slice, which is gone"
    );
    assert_eq!(slices.apply(&ready_slice("kubernetes", None, 7, 1)), None);
    assert_eq!(addrs(&slices.settle().0), ["10.0.0.7:6443"]);
}

#[test]
fn the_cap_keeps_the_older_slices_and_leaves_the_newest_out() {
    let controller = spec(
        vec![SliceManager::Label(ENDPOINTSLICE_CONTROLLER.into())],
        10,
    );
    let mut slices = SliceSet::new(controller);
    let manager = Some(ENDPOINTSLICE_CONTROLLER);
    slices.apply(&created_at(ready_slice("zz-old", manager, 0, 6), 0));
    // Newer, and first by name: still the one left out.
    slices.apply(&created_at(ready_slice("aa-new", manager, 100, 6), 60));
    // Overlapping addresses take no room.
    slices.apply(&created_at(ready_slice("mm-overlap", manager, 2, 4), 30));
    let (set, refusals) = slices.settle();
    assert_eq!(set.len(), 6);
    assert!(
        set.iter()
            .all(|found| found.addr.ip().to_string().starts_with("10.0.0."))
    );
    assert_eq!(refusals.len(), 1);
    assert_eq!(refusals[0].kind, ProblemKind::OverCap);
    assert!(
        refusals[0].why.contains("default/aa-new"),
        "{}",
        refusals[0].why
    );
    assert!(slices.settle().1.is_empty(), "said once");
    // The old one goes: the new one fits, and is said again if it is ever
    // left out again.
    slices.remove("zz-old");
    let (set, refusals) = slices.settle();
    assert_eq!(set.len(), 10);
    assert!(refusals.is_empty());
}

#[test]
fn slices_beyond_the_most_followed_are_refused() {
    let mut slices = SliceSet::new(spec(vec![SliceManager::Label("m".into())], 1024));
    for index in 0..MAX_SLICES {
        assert_eq!(
            slices.apply(&ready_slice(&format!("s{index}"), Some("m"), 0, 0)),
            None
        );
    }
    let refusal = slices
        .apply(&ready_slice("one-more", Some("m"), 0, 1))
        .unwrap();
    assert_eq!(refusal.kind, ProblemKind::TooManySlices);
    // A slice already followed may still change.
    assert_eq!(slices.apply(&ready_slice("s0", Some("m"), 0, 1)), None);
}

#[test]
fn the_backoff_holds_across_list_and_watch_and_resets_after_a_healthy_session() {
    let mut backoff = Backoff::new();
    let quick = Duration::from_millis(20);
    let pauses: Vec<Duration> = (0..7).map(|_| backoff.pause(quick, false)).collect();
    let nominal = [1, 2, 4, 8, 16, 30, 30];
    for (pause, seconds) in pauses.iter().zip(nominal) {
        let nominal = Duration::from_secs(seconds);
        assert!(
            *pause >= nominal.mul_f64(0.8) && *pause <= nominal.mul_f64(1.2),
            "{pauses:?}"
        );
    }
    // A 410 after a failing session waits too; after a healthy one, not.
    assert!(backoff.pause(quick, true) >= Duration::from_secs(24));
    assert_eq!(backoff.pause(HEALTHY_AFTER, true), Duration::ZERO);
    assert!(backoff.pause(quick, false) <= Duration::from_millis(1200));
}

#[tokio::test]
async fn a_list_between_two_failing_watches_is_no_recovery() {
    let (events, mut received) = mpsc::channel(16);
    let mut reporter = Reporter {
        service: "api".into(),
        events,
        last_set: None,
        failing: None,
    };
    let set: BackendSet = [Found {
        addr: "10.0.0.1:6443".parse().unwrap(),
        standby: false,
    }]
    .into();
    let failure = "the watch ended within 1s of its start".to_string();
    assert!(reporter.send_all(Vec::new(), set.clone(), false).await);
    assert!(reporter.failed(failure.clone()).await);
    // The next session lists the same set, and its watch fails the same.
    assert!(reporter.send_all(Vec::new(), set.clone(), false).await);
    assert!(reporter.failed(failure.clone()).await);
    // A watch that delivers something: the recovery is said.
    assert!(reporter.send_all(Vec::new(), set.clone(), true).await);
    assert!(reporter.send_all(Vec::new(), set.clone(), true).await);
    drop(reporter);
    let mut reports = Vec::new();
    while let Some(event) = received.recv().await {
        reports.push(event.report);
    }
    assert_eq!(
        reports,
        [
            Report::Set(set.clone()),
            Report::Failed(failure),
            Report::Set(set)
        ]
    );
}
