use std::time::Duration;

use lb_common::SLOTS_PER_LIST;

use super::*;
use crate::health::probe::{ProbeSpec, TlsOptions};

const GOOD: &str = r#"
    [[service]]
    name = "apiserver"
    vips = ["127.0.0.1:6444", "[::1]:6444"]
    when-none-healthy = "reject"
    backends = ["10.0.0.1:6443,weight=2", { addr = "[fd00::1]:6443", weight = 3 }]
    [service.health]
    interval = "500ms"
    timeout = "2s"
    rise = 1
    fall = 5
"#;

#[test]
fn parses_a_full_service() {
    let config = parse_toml(GOOD).unwrap();
    let service = &config.services[0];
    assert_eq!(service.name, "apiserver");
    assert_eq!(service.vips.len(), 2);
    assert_eq!(service.when_none_healthy, NoneHealthyPolicy::Reject);
    assert_eq!(service.policy, SelectionPolicy::Random);
    assert_eq!(
        service.backends,
        vec![
            Backend {
                addr: "10.0.0.1:6443".parse().unwrap(),
                weight: 2,
                role: BackendRole::Normal,
                drain: false,
            },
            Backend {
                addr: "[fd00::1]:6443".parse().unwrap(),
                weight: 3,
                role: BackendRole::Normal,
                drain: false,
            },
        ]
    );
    assert_eq!(
        service.health,
        HealthSettings {
            probe: ProbeSpec::Tcp,
            interval: Duration::from_millis(500),
            down_interval: Duration::from_millis(500),
            timeout: Duration::from_secs(2),
            rise: 1,
            fall: 5,
            connect_failures: 1,
        }
    );
}

#[test]
fn defaults_apply() {
    let config =
        parse_toml("[[service]]\nvips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:2\"]").unwrap();
    let service = &config.services[0];
    assert_eq!(service.name, "service0");
    assert_eq!(service.when_none_healthy, NoneHealthyPolicy::FailOpen);
    assert_eq!(service.policy, SelectionPolicy::Random);
    assert!(!service.all_netns);
    assert_eq!(service.health, HealthSettings::default());
    assert_eq!(service.backends[0].weight, 1);
}

#[test]
fn acceleration_is_off_by_default_and_check_config_lists_its_known_failures() {
    let plain = parse_toml("[[service]]\nvips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:2\"]");
    let plain = plain.unwrap();
    assert!(!plain.services[0].accelerate);
    assert!(!plain.to_string().contains("known failure"));
    let accelerated = parse_toml(&service_toml(
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:2\"]\naccelerate=\"sockmap\"",
    ))
    .unwrap();
    let printed = accelerated.to_string();
    for failure in super::SOCKMAP_KNOWN_FAILURES {
        assert!(
            printed.contains(&format!("known failure: {failure}")),
            "{printed}"
        );
    }
    assert!(printed.contains("EAGAIN (tcp_bpf_recvmsg)"), "{printed}");
}

fn service_toml(body: &str) -> String {
    format!("[[service]]\nname = \"s\"\n{body}")
}

/// (what, toml, field that must be named, words the problem must hold)
const INVALID: &[(&str, &str, &str, &str)] = &[
    ("no service", "", "service", "no service"),
    (
        "no vip",
        "backends=[\"127.0.0.2:1\"]",
        "service[0].vips",
        "at least one VIP",
    ),
    (
        "no backend",
        "vips=[\"127.0.0.1:1\"]",
        "service[0].backends",
        "at least one backend",
    ),
    (
        "vip not addr",
        "vips=[\"localhost:1\"]\nbackends=[\"127.0.0.2:1\"]",
        "service[0].vips[0]",
        "not ADDR:PORT",
    ),
    (
        "vip port 0",
        "vips=[\"127.0.0.1:0\"]\nbackends=[\"127.0.0.2:1\"]",
        "service[0].vips[0]",
        "port 0",
    ),
    (
        "vip unspecified",
        "vips=[\"0.0.0.0:1\"]\nbackends=[\"127.0.0.2:1\"]",
        "service[0].vips[0]",
        "unspecified",
    ),
    (
        "vip mapped",
        "vips=[\"[::ffff:127.0.0.1]:1\"]\nbackends=[\"127.0.0.2:1\"]",
        "service[0].vips[0]",
        "plain IPv4",
    ),
    (
        "backend no port",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2\"]",
        "service[0].backends[0]",
        "not ADDR:PORT",
    ),
    (
        "weight zero",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1,weight=0\"]",
        "service[0].backends[0].weight",
        "out of range",
    ),
    (
        "weight large",
        "vips=[\"127.0.0.1:1\"]\nbackends=[{addr=\"127.0.0.2:1\",weight=101}]",
        "service[0].backends[0].weight",
        "out of range",
    ),
    (
        "weight text",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1,weight=x\"]",
        "service[0].backends[0].weight",
        "whole number",
    ),
    (
        "unknown backend option",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1,fast\"]",
        "service[0].backends[0]",
        "unknown option",
    ),
    (
        "duplicate backend",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\",\"127.0.0.2:1\"]",
        "service[0].backends",
        "listed twice",
    ),
    (
        "duplicate vip",
        "vips=[\"127.0.0.1:1\",\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]",
        "service[0].vips",
        "listed twice",
    ),
    (
        "v6 vip without v6 backend",
        "vips=[\"[::1]:1\"]\nbackends=[\"127.0.0.2:1\"]",
        "service[0].vips",
        "IPv6 backend",
    ),
    (
        "v4 vip without v4 backend",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"[::1]:2\"]",
        "service[0].vips",
        "IPv4 backend",
    ),
    (
        "vip is backend",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.1:1\"]",
        "service[0].vips",
        "loops",
    ),
    (
        "bad policy",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\npolicy=\"open\"",
        "service[0].policy",
        "unknown policy",
    ),
    (
        "bad interval",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={interval=\"fast\"}",
        "service[0].health.interval",
        "not a duration",
    ),
    (
        "tiny timeout",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={timeout=\"1ms\"}",
        "service[0].health.timeout",
        "out of range",
    ),
    (
        "rise zero",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={rise=0}",
        "service[0].health.rise",
        "out of range",
    ),
    (
        "fall huge",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={fall=1000}",
        "service[0].health.fall",
        "out of range",
    ),
    (
        "bad name",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nname=\"a b\"",
        "service[0].name",
        "may only hold",
    ),
    (
        "bad none-healthy policy",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nwhen-none-healthy=\"open\"",
        "service[0].when-none-healthy",
        "unknown policy",
    ),
    (
        "preferred without prefer-local",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1,preferred\",\"127.0.0.3:1\"]",
        "service[0].backends[0]",
        "prefer-local",
    ),
    (
        "preferred and standby",
        "vips=[\"127.0.0.1:1\"]\nbackends=[{addr=\"127.0.0.2:1\",preferred=true,standby=true},\"127.0.0.3:1\"]\npolicy=\"prefer-local\"",
        "service[0].backends[0]",
        "both",
    ),
    (
        "only standbys",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1,standby\"]",
        "service[0].backends",
        "every backend is a standby",
    ),
    (
        "unknown probe",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={kind=\"icmp\"}",
        "service[0].health.kind",
        "unknown probe",
    ),
    (
        "path on tcp",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={kind=\"tcp:/x\"}",
        "service[0].health.kind",
        "take no path",
    ),
    (
        "statuses on tls",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={kind=\"tls\",statuses=[200]}",
        "service[0].health.statuses",
        "only applies to http",
    ),
    (
        "ca on http",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={kind=\"http\",ca=\"/x\"}",
        "service[0].health.ca",
        "only applies to tls",
    ),
    (
        "etcd without cert",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={kind=\"etcd\"}",
        "service[0].health.cert",
        "client certificate",
    ),
    (
        "bad status",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={kind=\"https\",statuses=[700]}",
        "service[0].health.statuses",
        "not an HTTP status",
    ),
    (
        "bad status text",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={kind=\"https\",statuses=\"200,ok\"}",
        "service[0].health.statuses",
        "not a status code",
    ),
    (
        "relative path",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={kind=\"http\",path=\"readyz\"}",
        "service[0].health.path",
        "must start with /",
    ),
    (
        "missing ca file",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={kind=\"apiserver\",ca=\"/nonexistent/ca.pem\"}",
        "service[0].health.ca",
        "/nonexistent/ca.pem",
    ),
    (
        "vip zone id",
        "vips=[\"[::1%1]:6444\"]\nbackends=[\"[::1]:1\"]",
        "service[0].vips[0]",
        "zone ids",
    ),
    (
        "backend zone name",
        "vips=[\"[::1]:6444\"]\nbackends=[\"[fe80::1%lo]:1\"]",
        "service[0].backends[0]",
        "zone ids",
    ),
    (
        "backend of a family without a VIP",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\", \"[::1]:2\"]",
        "service[0].backends[1]",
        "no IPv6 VIP",
    ),
    (
        "interval too long",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={interval=\"2h\"}",
        "service[0].health.interval",
        "out of range 10ms..=1h",
    ),
    (
        "slow start not a duration",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nslow-start=\"soon\"",
        "service[0].slow-start",
        "not a duration",
    ),
    (
        "unknown when-daemon-gone",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nwhen-daemon-gone=\"later\"",
        "service[0].when-daemon-gone",
        "unknown behaviour \"later\"; expected \"auto\", \"keep\" or \"hand-back\"",
    ),
    (
        "daemon-gone-after shorter than two heartbeats",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\ndaemon-gone-after=\"1s\"",
        "service[0].daemon-gone-after",
        "shorter than 2s",
    ),
    (
        "daemon-gone-after not a duration",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\ndaemon-gone-after=\"soon\"",
        "service[0].daemon-gone-after",
        "not a duration",
    ),
    (
        "daemon-gone-after too long",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\ndaemon-gone-after=\"2h\"",
        "service[0].daemon-gone-after",
        "out of range",
    ),
    (
        "bad down interval",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={down-interval=\"x\"}",
        "service[0].health.down-interval",
        "not a duration",
    ),
    (
        "manager not a label value",
        "vips=[\"127.0.0.1:1\"]\nendpointslices=\"default/kubernetes\"\nendpointslice-managers=[\"@apiserver\", \"evil controller\"]",
        "service[0].endpointslice-managers[1]",
        "neither @apiserver nor a label value",
    ),
    (
        "no manager",
        "vips=[\"127.0.0.1:1\"]\nendpointslices=\"default/kubernetes\"\nendpointslice-managers=[]",
        "service[0].endpointslice-managers",
        "names no manager",
    ),
    (
        "manager twice",
        "vips=[\"127.0.0.1:1\"]\nendpointslices=\"default/kubernetes\"\nendpointslice-managers=[\"a\", \"a\"]",
        "service[0].endpointslice-managers[1]",
        "listed twice",
    ),
    (
        "managers without endpointslices",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nendpointslice-managers=[\"@apiserver\"]",
        "service[0].endpointslice-managers",
        "only applies with endpointslices",
    ),
    (
        "max discovered backends 0",
        "vips=[\"127.0.0.1:1\"]\nk3s-state=\"/state.json\"\nmax-discovered-backends=0",
        "service[0].max-discovered-backends",
        "out of range 1..=1024",
    ),
    (
        "max discovered backends without discovery",
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nmax-discovered-backends=8",
        "service[0].max-discovered-backends",
        "only applies with a discovery source",
    ),
];

#[test]
fn every_validation_error_names_its_field() {
    for (what, body, field, words) in INVALID {
        let text = if body.is_empty() {
            String::new()
        } else {
            service_toml(body)
        };
        // A duplicate `name` key is a TOML error; the bad-name case sets its own.
        let text = if what == &"bad name" {
            format!("[[service]]\n{body}")
        } else {
            text
        };
        let Err(ConfigError::Invalid(errors)) = parse_toml(&text) else {
            panic!("{what}: expected a validation error");
        };
        assert!(
            errors
                .iter()
                .any(|error| error.field == *field && error.problem.contains(words)),
            "{what}: wanted {field}: …{words}…, got {errors:?}"
        );
    }
}

#[test]
fn hand_back_and_the_socket_table_are_read_with_their_defaults() {
    let config = parse_toml(&format!(
        "socket-table-size = 70000\n{}",
        service_toml(
            "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nwhen-daemon-gone=\"hand-back\"\ndaemon-gone-after=\"2s\""
        )
    ))
    .unwrap();
    assert_eq!(config.socket_table_size, 70000);
    assert_eq!(
        config.services[0].when_daemon_gone,
        WhenDaemonGone::HandBack
    );
    assert_eq!(config.services[0].daemon_gone_after, Duration::from_secs(2));
    let defaults =
        parse_toml("[[service]]\nvips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]").unwrap();
    assert_eq!(
        defaults.socket_table_size,
        lb_common::DEFAULT_SOCKET_TABLE_SIZE
    );
    assert_eq!(defaults.services[0].when_daemon_gone, WhenDaemonGone::Auto);
    assert_eq!(
        defaults.services[0].daemon_gone_after,
        DEFAULT_DAEMON_GONE_AFTER
    );
}

#[test]
fn a_socket_table_size_out_of_range_names_its_field() {
    let service = "[[service]]\nvips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]";
    for size in ["0", "1023", "4194305", "-1"] {
        let Err(ConfigError::Invalid(errors)) =
            parse_toml(&format!("socket-table-size = {size}\n{service}"))
        else {
            panic!("{size}: expected a validation error");
        };
        assert!(
            errors.iter().any(|error| error.field == "socket-table-size"
                && error.problem.contains("out of range 1024..=4194304")),
            "{size}: {errors:?}"
        );
    }
    let raw = RawService {
        vips: vec!["127.0.0.1:1".into()],
        backends: vec![RawBackend::Spec("127.0.0.2:1".into())],
        when_daemon_gone: Some("never".into()),
        daemon_gone_after: Some("500ms".into()),
        ..RawService::default()
    };
    let Err(ConfigError::Invalid(errors)) = validate_with(vec![raw], "flags", Some(12)) else {
        panic!("expected errors");
    };
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "--socket-table-size",
            "--when-daemon-gone",
            "--daemon-gone-after"
        ]
    );
}

#[test]
fn errors_across_services() {
    let text = r#"
        [[service]]
        name = "a"
        vips = ["127.0.0.1:1"]
        backends = ["127.0.0.2:1"]
        [[service]]
        name = "a"
        vips = ["127.0.0.1:1"]
        backends = ["127.0.0.3:1"]
    "#;
    let Err(ConfigError::Invalid(errors)) = parse_toml(text) else {
        panic!("expected errors");
    };
    assert!(
        errors
            .iter()
            .any(|e| e.field == "service[1].name" && e.problem.contains("twice"))
    );
    assert!(
        errors
            .iter()
            .any(|e| e.field == "service[1].vips" && e.problem.contains("also used"))
    );
}

#[test]
fn unknown_field_and_syntax_are_errors() {
    let Err(ConfigError::Syntax { message, .. }) =
        parse_toml("[[service]]\nvips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\ncolour=1")
    else {
        panic!("expected a syntax error");
    };
    assert!(message.contains("colour"), "{message}");
    assert!(matches!(
        parse_toml("[[service]\n"),
        Err(ConfigError::Syntax { .. })
    ));
}

#[test]
fn flag_errors_name_the_flag() {
    let raw = RawService {
        vips: vec!["127.0.0.1:x".into()],
        backends: vec![RawBackend::Spec("127.0.0.2:1,weight=0".into())],
        health: RawHealth {
            rise: Some(0),
            ..RawHealth::default()
        },
        ..RawService::default()
    };
    let Err(ConfigError::Invalid(errors)) = from_flags(raw) else {
        panic!("expected errors");
    };
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert!(fields.contains(&"--vip[0]"), "{fields:?}");
    assert!(fields.contains(&"--backend[0].weight"), "{fields:?}");
    assert!(fields.contains(&"--rise"), "{fields:?}");
}

#[test]
fn too_many_backends_per_family() {
    let backends: Vec<String> = (0..=SLOTS_PER_LIST)
        .map(|i| format!("\"10.1.{}.{}:1\"", i / 250, i % 250 + 1))
        .collect();
    let text = service_toml(&format!(
        "vips=[\"127.0.0.1:1\"]\nbackends=[{}]",
        backends.join(",")
    ));
    let Err(ConfigError::Invalid(errors)) = parse_toml(&text) else {
        panic!("expected errors");
    };
    assert!(
        errors.iter().any(|e| e.problem.contains("per family")),
        "{errors:?}"
    );
}

#[test]
fn probe_presets_and_overrides() {
    let probe = |health: &str| {
        let text = service_toml(&format!(
            "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={{{health}}}"
        ));
        parse_toml(&text).unwrap().services[0].health.probe.clone()
    };
    let https = |path: &str, statuses: &[u16]| ProbeSpec::Http {
        path: path.into(),
        statuses: statuses.to_vec(),
        host: None,
        tls: Some(TlsOptions::default()),
    };
    assert_eq!(probe(""), ProbeSpec::Tcp);
    assert_eq!(probe("kind=\"tls\""), ProbeSpec::Tls(TlsOptions::default()));
    assert_eq!(probe("kind=\"apiserver\""), https("/readyz", &[200]));
    assert_eq!(probe("kind=\"supervisor\""), https("/ping", &[200]));
    assert_eq!(
        probe("kind=\"apiserver\",statuses=[200,401,403]"),
        https("/readyz", &[200, 401, 403]),
        "a preset is overridden field by field"
    );
    assert_eq!(
        probe("kind=\"https:/livez\",statuses=\"200, 401\""),
        https("/livez", &[200, 401])
    );
    assert_eq!(
        probe("kind=\"http\",host=\"api.local\""),
        ProbeSpec::Http {
            path: "/".into(),
            statuses: vec![200],
            host: Some("api.local".into()),
            tls: None
        }
    );
    let config = parse_toml(&service_toml(
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={interval=\"2s\"}",
    ))
    .unwrap();
    assert_eq!(
        config.services[0].health.down_interval,
        Duration::from_secs(2),
        "the down interval follows the interval"
    );
}

#[test]
fn probe_flags_are_named_as_flags() {
    let raw = RawService {
        vips: vec!["127.0.0.1:1".into()],
        backends: vec![RawBackend::Spec("127.0.0.2:1".into())],
        health: RawHealth {
            kind: Some("tcp".into()),
            statuses: Some(RawStatuses::Text("200".into())),
            ca: Some("/x".into()),
            ..RawHealth::default()
        },
        ..RawService::default()
    };
    let Err(ConfigError::Invalid(errors)) = from_flags(raw) else {
        panic!("expected errors");
    };
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert!(fields.contains(&"--health-status"), "{fields:?}");
    assert!(fields.contains(&"--health-ca"), "{fields:?}");
}

#[test]
fn backend_options() {
    let text = service_toml(
        "vips=[\"127.0.0.1:1\"]\npolicy=\"prefer-local\"\nbackends=[\"127.0.0.2:1,weight=3,drain\", \"127.0.0.3:1,preferred\", {addr=\"127.0.0.4:1\",standby=true,drain=true}]",
    );
    let backends = &parse_toml(&text).unwrap().services[0].backends;
    let summary: Vec<(u32, BackendRole, bool)> = backends
        .iter()
        .map(|b| (b.weight, b.role, b.drain))
        .collect();
    assert_eq!(
        summary,
        [
            (3, BackendRole::Normal, true),
            (1, BackendRole::Preferred, false),
            (1, BackendRole::Standby, true)
        ]
    );
}

#[test]
fn durations() {
    assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
    assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
    assert_eq!(parse_duration("1m"), Some(Duration::from_secs(60)));
    assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
    assert_eq!(parse_duration("5"), None);
    assert_eq!(parse_duration("-1s"), None);
    assert_eq!(parse_duration("1e20s"), None, "too large, and no panic");
    assert_eq!(parse_duration("NaNs"), None);
}

#[test]
fn the_largest_duration_the_range_names_is_accepted() {
    let config = parse_toml(&service_toml(
        "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={down-interval=\"1h\"}",
    ))
    .unwrap();
    assert_eq!(
        config.services[0].health.down_interval,
        Duration::from_secs(3600)
    );
}

#[test]
fn a_backend_that_is_another_services_vip_is_refused() {
    let text = r#"
        [[service]]
        name = "a"
        vips = ["127.0.0.1:6444"]
        backends = ["127.0.0.1:7444"]
        [[service]]
        name = "b"
        vips = ["127.0.0.1:7444"]
        backends = ["127.0.0.2:1", "127.0.0.1:6444"]
    "#;
    let Err(ConfigError::Invalid(errors)) = parse_toml(text) else {
        panic!("expected errors");
    };
    let named: Vec<&str> = errors.iter().map(|error| error.field.as_str()).collect();
    assert!(named.contains(&"service[0].backends[0]"), "{errors:?}");
    assert!(named.contains(&"service[1].backends[1]"), "{errors:?}");
    assert!(
        errors
            .iter()
            .all(|error| error.problem.contains("is a VIP of service")),
        "{errors:?}"
    );
}

#[test]
fn weights_that_do_not_fit_a_table_are_refused_not_flattened() {
    let mut backends: Vec<String> = (0..999)
        .map(|i| format!("\"10.1.{}.{}:1\"", i / 250, i % 250 + 1))
        .collect();
    backends.push("\"10.2.0.1:1,weight=100\"".into());
    let text = service_toml(&format!(
        "vips=[\"127.0.0.1:1\"]\nbackends=[{}]",
        backends.join(",")
    ));
    let Err(ConfigError::Invalid(errors)) = parse_toml(&text) else {
        panic!("expected errors");
    };
    assert!(
        errors
            .iter()
            .any(|error| error.field == "service[0].backends"
                && error.problem.contains("1099 table slots")
                && error.problem.contains(&SLOTS_PER_LIST.to_string())),
        "{errors:?}"
    );
    // The same backends with weights that share a divisor fit.
    assert_eq!(slots_needed(&[100, 200, 300]), 6);
}

#[test]
fn an_error_in_an_earlier_service_keeps_later_fields_named_right() {
    let text = r#"
        [[service]]
        name = "a"
        vips = ["127.0.0.1:1"]
        [[service]]
        name = "b"
        vips = ["127.0.0.1:1"]
        backends = ["127.0.0.2:1"]
        [[service]]
        name = "b"
        vips = ["127.0.0.1:2"]
        backends = ["127.0.0.2:1"]
    "#;
    let Err(ConfigError::Invalid(errors)) = parse_toml(text) else {
        panic!("expected errors");
    };
    assert!(
        errors.iter().any(|error| error.field == "service[2].name"),
        "{errors:?}"
    );
}

#[test]
fn slice_managers_default_per_service_and_may_be_set() {
    let slices = |body: &str| {
        let config = parse_toml(&service_toml(&format!("vips=[\"127.0.0.1:1\"]\n{body}"))).unwrap();
        config.services[0].discovery.clone()
    };
    let apiserver = slices("endpointslices=\"default/kubernetes\"");
    let source = apiserver.endpoint_slices.unwrap();
    assert_eq!(source.managers, [SliceManager::Apiserver]);
    assert_eq!(source.max_backends, DEFAULT_MAX_DISCOVERED_BACKENDS);
    let etcd = slices("endpointslices=\"kube-system/etcd\"\nmax-discovered-backends=5");
    assert_eq!(etcd.max_backends, 5);
    let source = etcd.endpoint_slices.unwrap();
    assert_eq!(
        source.managers,
        [SliceManager::Label(ENDPOINTSLICE_CONTROLLER.into())]
    );
    assert_eq!(source.max_backends, 5);
    let both = slices(&format!(
        "endpointslices=\"default/kubernetes\"\nendpointslice-managers=[\"@apiserver\", \"{ENDPOINTSLICE_MIRRORING_CONTROLLER}\"]"
    ));
    assert_eq!(
        both.endpoint_slices.unwrap().managers,
        [
            SliceManager::Apiserver,
            SliceManager::Label(ENDPOINTSLICE_MIRRORING_CONTROLLER.into())
        ]
    );
    let flags = from_flags(RawService {
        vips: vec!["127.0.0.1:1".into()],
        endpointslices: Some("default/kubernetes".into()),
        endpointslice_managers: Some(RawNames::Text("@apiserver, x.example".into())),
        ..RawService::default()
    })
    .unwrap();
    let managers = &flags.services[0]
        .discovery
        .endpoint_slices
        .as_ref()
        .unwrap()
        .managers;
    assert_eq!(
        managers,
        &[
            SliceManager::Apiserver,
            SliceManager::Label("x.example".into())
        ]
    );
}

#[test]
fn discovered_backends_of_all_services_must_fit_the_backend_table() {
    let service = |index: usize| {
        format!(
            "[[service]]\nname=\"s{index}\"\nvips=[\"127.0.0.1:{}\"]\nk3s-state=\"/s{index}.json\"\nmax-discovered-backends=1024\n",
            index + 1
        )
    };
    let fits: String = (0..4).map(service).collect();
    assert!(parse_toml(&fits).is_ok());
    let too_many: String = (0..5).map(service).collect();
    let Err(ConfigError::Invalid(errors)) = parse_toml(&too_many) else {
        panic!("expected a budget error");
    };
    assert!(
        errors
            .iter()
            .any(|error| error.field == "service" && error.problem.contains("5120 backends")),
        "{errors:?}"
    );
}
