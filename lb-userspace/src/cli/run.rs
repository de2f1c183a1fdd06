use std::path::PathBuf;

use anyhow::Context;
use clap::builder::TypedValueParser as _;
use socklb::{
    config::{self, RawBackend, RawHealth, RawNames, RawService, RawStatuses},
    daemon::{self, RunOptions},
    dataplane::BpfLogLevel,
    discovery::persist::DEFAULT_STATE_DIR,
    privileges,
};

/// Install (or adopt) the data plane and keep it in step with backend health.
///
/// Example: socklb run --vip 127.0.0.1:6444 --backend 10.0.0.1:6443 --backend 10.0.0.2:6443,weight=2
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// TOML file with one or more services (conflicts with the service flags).
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "vip", "backend", "name", "policy", "when_none_healthy", "all_netns", "close_on_failure", "health", "health_status", "health_host",
        "health_ca", "health_cert", "health_key", "health_server_name", "health_interval",
        "health_down_interval", "health_timeout", "rise", "fall", "connect_failures",
        "k3s_state", "endpointslices", "endpointslice_port", "kubeconfig",
        "endpointslice_managers", "max_discovered_backends", "slow_start",
        "rebalance", "rebalance_tolerance", "rebalance_after", "rebalance_rate", "accelerate",
        "when_daemon_gone", "daemon_gone_after", "socket_table_size",
    ])]
    config: Option<PathBuf>,
    /// VIP that clients connect to (repeatable; IPv4 and IPv6 may share a service).
    #[arg(long, value_name = "ADDR:PORT")]
    vip: Vec<String>,
    /// Backend server, optionally weighted, preferred (with --policy
    /// prefer-local), standby (used only when no other is healthy) or
    /// drain (no new connections). Repeatable.
    #[arg(
        long,
        value_name = "ADDR:PORT[,weight=N][,preferred][,standby][,drain]"
    )]
    backend: Vec<String>,
    /// Name of the service given by flags.
    #[arg(long, default_value = "default")]
    name: String,
    /// How to choose among healthy backends: random (weighted), least-conn
    /// (power of two choices on live connections, in the kernel), or
    /// prefer-local (backends on this host or marked preferred first).
    #[arg(long, value_name = "random|least-conn|prefer-local")]
    policy: Option<String>,
    /// When no backend is healthy: use all of them (fail-open) or refuse the
    /// connect with ECONNREFUSED (reject).
    #[arg(long, value_name = "fail-open|reject")]
    when_none_healthy: Option<String>,
    /// Close the redirected connections to a backend when it becomes
    /// unhealthy, so long-lived watches reconnect elsewhere [default: true].
    #[arg(long, value_name = "true|false", action = clap::ArgAction::Set)]
    close_on_failure: Option<bool>,
    /// Redirect sockets in every network namespace, not only the daemon's own.
    #[arg(long)]
    all_netns: bool,
    /// Ramp a backend that becomes healthy (or is added) from about a
    /// tenth of its weight to all of it over DURATION, in the kernel's
    /// tables [default: off].
    #[arg(long, value_name = "DURATION")]
    slow_start: Option<String>,
    /// `sockmap`: connections to a backend on this host move their data
    /// socket to socket in the kernel (sk_msg), skipping TCP/IP on
    /// loopback; only where socklb's cgroup also holds the backend
    /// [default: off].
    #[arg(long, value_name = "sockmap|none")]
    accelerate: Option<String>,
    /// What the VIPs do once the daemon is gone (its heartbeat older than
    /// --daemon-gone-after): keep redirecting from the last tables,
    /// hand-back (connects reach whatever listens on the VIP, such as the
    /// balancer socklb sits in front of), or auto: hand-back when another
    /// socket listens on a VIP at start and at each reload, else keep
    /// [default: auto].
    #[arg(long, value_name = "auto|keep|hand-back")]
    when_daemon_gone: Option<String>,
    /// How long without a heartbeat before the daemon counts as gone
    /// [default: 10s].
    #[arg(long, value_name = "DURATION")]
    daemon_gone_after: Option<String>,
    /// Sockets the kernel's socket table holds (its memory is taken whole
    /// at install; a connect past it is redirected untracked). Applied
    /// when the table is made [default: 65536].
    #[arg(long, value_name = "N")]
    socket_table_size: Option<i64>,
    /// Close connections on the backends above their fair share while the
    /// live counts stay out of balance (those of the owners above their
    /// own share, idlest first), so that clients reconnect to the others
    /// [default: off].
    #[arg(long)]
    rebalance: bool,
    /// Out of balance when max/mean of live connections > 1 + this, or
    /// min/mean < 1 − this [default: 0.2].
    #[arg(long, value_name = "RATIO")]
    rebalance_tolerance: Option<f64>,
    /// How long the imbalance must last before acting [default: 10s].
    #[arg(long, value_name = "DURATION")]
    rebalance_after: Option<String>,
    /// Connections closed per second at most [default: 5].
    #[arg(long, value_name = "N")]
    rebalance_rate: Option<i64>,
    /// Health probe: tcp, tls, http[:PATH], https[:PATH], or a preset
    /// (apiserver = https /readyz, supervisor = https /ping, etcd = https
    /// /health with a client certificate) [default: tcp].
    #[arg(long, value_name = "KIND")]
    health: Option<String>,
    /// HTTP statuses that count as healthy [default: 200].
    #[arg(long, value_name = "CODES")]
    health_status: Option<String>,
    /// Host header of http/https probes [default: the backend address].
    #[arg(long, value_name = "HOST")]
    health_host: Option<String>,
    /// CA bundle (PEM) that the server certificate must chain to; without
    /// it tls/https probes do not verify the certificate.
    #[arg(long, value_name = "FILE")]
    health_ca: Option<PathBuf>,
    /// Client certificate (PEM) for tls/https probes.
    #[arg(long, value_name = "FILE")]
    health_cert: Option<PathBuf>,
    /// Client key (PEM) for tls/https probes.
    #[arg(long, value_name = "FILE")]
    health_key: Option<PathBuf>,
    /// Name to verify the server certificate against [default: the backend IP].
    #[arg(long, value_name = "NAME")]
    health_server_name: Option<String>,
    /// Time between health probes of a backend (±20% jitter).
    #[arg(long, value_name = "DURATION")]
    health_interval: Option<String>,
    /// Time between probes of a backend that is down [default: the interval].
    #[arg(long, value_name = "DURATION")]
    health_down_interval: Option<String>,
    /// Time a probe may take.
    #[arg(long, value_name = "DURATION")]
    health_timeout: Option<String>,
    /// Consecutive passed probes that make a backend healthy.
    #[arg(long)]
    rise: Option<i64>,
    /// Consecutive failed probes that make a backend unhealthy.
    #[arg(long)]
    fall: Option<i64>,
    /// Failed connects in a row that the kernel saw fail on the server side
    /// (a reset, or a SYN unanswered for the initial RTO) before socklb
    /// probes the backend at once; the probe decides. 0 turns this off
    /// [default: 1].
    #[arg(long, value_name = "N")]
    connect_failures: Option<i64>,
    /// Follow a k3s/rke2 agent load-balancer state file (for example
    /// /var/lib/rancher/k3s/agent/etc/k3s-agent-load-balancer.json):
    /// its servers become backends, its default server a standby when it is
    /// not listed.
    #[arg(long, value_name = "FILE")]
    k3s_state: Option<PathBuf>,
    /// Follow the EndpointSlices of a Kubernetes Service, for example
    /// default/kubernetes (the apiservers). They rule over the state file
    /// and the static backends, which then only seed the table.
    #[arg(long, value_name = "NAMESPACE/SERVICE")]
    endpointslices: Option<String>,
    /// The EndpointSlice port name to use [default: https].
    #[arg(long, value_name = "NAME")]
    endpointslice_port: Option<String>,
    /// Kubeconfig for --endpointslices (for example the kubelet's)
    /// [default: $KUBECONFIG, ~/.kube/config, then in-cluster].
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// Whose EndpointSlices count, comma-separated: values of their
    /// endpointslice.kubernetes.io/managed-by label, or @apiserver (the
    /// apiserver's own slice: no such label, named as the Service); every
    /// other slice is ignored [default: @apiserver for default/kubernetes,
    /// else endpointslice-controller.k8s.io].
    #[arg(long, value_name = "MANAGER[,MANAGER]")]
    endpointslice_managers: Option<String>,
    /// Most backends discovery (--endpointslices, --k3s-state) may give the
    /// service; a larger set is refused and the last known one stays
    /// [default: 64].
    #[arg(long, value_name = "N")]
    max_discovered_backends: Option<i64>,
    /// Where the last known backend set of each service is kept, for a
    /// start while every source is unreachable.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics (off unless given).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Apply a changed --config file in place as soon as it is written (as
    /// SIGHUP does).
    #[arg(long, requires = "config")]
    watch_config: bool,
    /// cgroup v2 directory to attach to [default: the root of the v2 hierarchy].
    #[arg(long, value_name = "DIR")]
    cgroup: Option<PathBuf>,
    #[command(flatten)]
    pin: super::PinPathArg,
    /// Remove the data plane on exit instead of leaving it redirecting.
    #[arg(long)]
    cleanup_on_exit: bool,
    /// Log level of the kernel programs, forwarded to this log. Applied at
    /// each start; `off` keeps logging out of connect().
    #[arg(
        long,
        default_value = "off",
        value_parser = clap::builder::PossibleValuesParser::new(BpfLogLevel::ALL.map(|(name, _)| name))
            .try_map(|name| name.parse::<BpfLogLevel>())
    )]
    bpf_log: BpfLogLevel,
    /// Install even if another socklb serves one of these VIPs on this
    /// cgroup, an ancestor or a descendant (whichever attached first then
    /// takes every connect to it).
    #[arg(long)]
    allow_overlap: bool,
}

pub fn run(args: RunArgs) -> super::Outcome {
    // First of all: what comes before the exec would be done twice.
    socklb::daemon::heap::without_thread_caches();
    let config = match &args.config {
        Some(path) => config::load_file(path)?,
        None => config::validate_with(vec![flag_service(&args)], "flags", args.socket_table_size)?,
    };
    // After the config: a bad file is reported the same with or without
    // privileges, and nothing is touched either way.
    privileges::require("run", &privileges::ALL)?;
    let options = RunOptions {
        config,
        config_path: args.config.clone(),
        cgroup: args.cgroup,
        pin_path: args.pin.pin_path,
        cleanup_on_exit: args.cleanup_on_exit,
        bpf_log: args.bpf_log,
        allow_overlap: args.allow_overlap,
        state_dir: args.state_dir,
        metrics_addr: args.metrics_addr,
        watch_config: args.watch_config,
    };
    socklb::daemon::heap::limit();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(daemon::run(options))?;
    Ok(0)
}

/// The service the flags describe, as written.
fn flag_service(args: &RunArgs) -> RawService {
    RawService {
        name: Some(args.name.clone()),
        vips: args.vip.clone(),
        backends: args.backend.iter().cloned().map(RawBackend::Spec).collect(),
        policy: args.policy.clone(),
        when_none_healthy: args.when_none_healthy.clone(),
        all_netns: args.all_netns,
        close_on_failure: args.close_on_failure,
        health: RawHealth {
            kind: args.health.clone(),
            path: None,
            statuses: args.health_status.clone().map(RawStatuses::Text),
            host: args.health_host.clone(),
            ca: args.health_ca.clone(),
            cert: args.health_cert.clone(),
            key: args.health_key.clone(),
            server_name: args.health_server_name.clone(),
            interval: args.health_interval.clone(),
            down_interval: args.health_down_interval.clone(),
            timeout: args.health_timeout.clone(),
            rise: args.rise,
            fall: args.fall,
            connect_failures: args.connect_failures,
        },
        k3s_state: args.k3s_state.clone(),
        endpointslices: args.endpointslices.clone(),
        endpointslice_port: args.endpointslice_port.clone(),
        kubeconfig: args.kubeconfig.clone(),
        endpointslice_managers: args.endpointslice_managers.clone().map(RawNames::Text),
        max_discovered_backends: args.max_discovered_backends,
        slow_start: args.slow_start.clone(),
        rebalance: args.rebalance.then_some(true),
        rebalance_tolerance: args.rebalance_tolerance,
        rebalance_after: args.rebalance_after.clone(),
        rebalance_rate: args.rebalance_rate,
        accelerate: args.accelerate.clone(),
        when_daemon_gone: args.when_daemon_gone.clone(),
        daemon_gone_after: args.daemon_gone_after.clone(),
    }
}
