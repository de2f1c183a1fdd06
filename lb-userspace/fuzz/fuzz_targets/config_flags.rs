//! The one-service flags (`socklb run --vip … --backend …`) never panic the
//! validator, whatever their text. Certificate paths come from a small set
//! that includes special files, so the size and type guards are exercised
//! without reading the fuzzing machine's files.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use socklb::config::{RawBackend, RawHealth, RawNames, RawService, RawStatuses, from_flags};

#[derive(Debug, Arbitrary)]
struct Flags {
    name: Option<String>,
    vips: Vec<String>,
    backends: Vec<String>,
    policy: Option<String>,
    when_none_healthy: Option<String>,
    all_netns: bool,
    close_on_failure: Option<bool>,
    health: Option<String>,
    health_status: Option<String>,
    health_host: Option<String>,
    health_server_name: Option<String>,
    ca: Option<u8>,
    cert: Option<u8>,
    key: Option<u8>,
    interval: Option<String>,
    down_interval: Option<String>,
    timeout: Option<String>,
    rise: Option<i64>,
    fall: Option<i64>,
    connect_failures: Option<i64>,
    endpointslices: Option<String>,
    endpointslice_port: Option<String>,
    endpointslice_managers: Option<String>,
    max_discovered_backends: Option<i64>,
    slow_start: Option<String>,
    rebalance: Option<bool>,
    rebalance_tolerance: Option<f64>,
    rebalance_after: Option<String>,
    rebalance_rate: Option<i64>,
    accelerate: Option<String>,
    when_daemon_gone: Option<String>,
    daemon_gone_after: Option<String>,
}

const PATHS: [&str; 4] = ["/nonexistent/socklb.pem", "/dev/zero", "/tmp", "/proc/self/status"];

fn path(choice: Option<u8>) -> Option<std::path::PathBuf> {
    choice.map(|index| PATHS[usize::from(index) % PATHS.len()].into())
}

fuzz_target!(|flags: Flags| {
    let raw = RawService {
        name: flags.name,
        vips: flags.vips,
        backends: flags.backends.into_iter().map(RawBackend::Spec).collect(),
        policy: flags.policy,
        when_none_healthy: flags.when_none_healthy,
        all_netns: flags.all_netns,
        close_on_failure: flags.close_on_failure,
        health: RawHealth {
            kind: flags.health,
            path: None,
            statuses: flags.health_status.map(RawStatuses::Text),
            host: flags.health_host,
            ca: path(flags.ca),
            cert: path(flags.cert),
            key: path(flags.key),
            server_name: flags.health_server_name,
            interval: flags.interval,
            down_interval: flags.down_interval,
            timeout: flags.timeout,
            rise: flags.rise,
            fall: flags.fall,
            connect_failures: flags.connect_failures,
        },
        k3s_state: None,
        endpointslices: flags.endpointslices,
        endpointslice_port: flags.endpointslice_port,
        kubeconfig: None,
        endpointslice_managers: flags.endpointslice_managers.map(RawNames::Text),
        max_discovered_backends: flags.max_discovered_backends,
        slow_start: flags.slow_start,
        rebalance: flags.rebalance,
        rebalance_tolerance: flags.rebalance_tolerance,
        rebalance_after: flags.rebalance_after,
        rebalance_rate: flags.rebalance_rate,
        accelerate: flags.accelerate,
        when_daemon_gone: flags.when_daemon_gone,
        daemon_gone_after: flags.daemon_gone_after,
    };
    if let Ok(config) = from_flags(raw) {
        let _ = config.to_string();
    }
});
