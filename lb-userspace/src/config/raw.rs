//! The configuration as written: TOML tables or assembled from flags,
//! before any field is checked.

use std::path::PathBuf;

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(rename_all = "kebab-case")]
pub(super) struct RawFile {
    /// Sockets the kernel's socket table holds.
    pub(super) socket_table_size: Option<i64>,
    #[serde(default)]
    pub(super) service: Vec<RawService>,
}

/// One service as written in TOML or assembled from flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawService {
    pub name: Option<String>,
    #[serde(default)]
    pub vips: Vec<String>,
    #[serde(default)]
    pub backends: Vec<RawBackend>,
    /// `random` or `prefer-local`.
    pub policy: Option<String>,
    /// `fail-open` or `reject`.
    pub when_none_healthy: Option<String>,
    #[serde(default)]
    pub all_netns: bool,
    /// Default true.
    pub close_on_failure: Option<bool>,
    #[serde(default)]
    pub health: RawHealth,
    /// A k3s/rke2 agent load-balancer state file to follow.
    pub k3s_state: Option<PathBuf>,
    /// `NAMESPACE/SERVICE` whose EndpointSlices to follow.
    pub endpointslices: Option<String>,
    /// The EndpointSlice port name (default `https`).
    pub endpointslice_port: Option<String>,
    /// Kubeconfig for the EndpointSlice watch (default: inferred, as
    /// kubectl does: $KUBECONFIG, ~/.kube/config, then in-cluster).
    pub kubeconfig: Option<PathBuf>,
    /// Whose slices count: `endpointslice.kubernetes.io/managed-by` values,
    /// or `@apiserver` (default: `@apiserver` for default/kubernetes, else
    /// `endpointslice-controller.k8s.io`).
    pub endpointslice_managers: Option<RawNames>,
    /// Most backends a discovery source may give (default 64).
    pub max_discovered_backends: Option<i64>,
    /// A backend that becomes healthy ramps its share over this long
    /// (default off).
    pub slow_start: Option<String>,
    /// Close connections on overloaded backends when the live counts stay
    /// out of balance (default false).
    pub rebalance: Option<bool>,
    /// max/mean above 1 + this, or min/mean below 1 − this, is out of
    /// balance (default 0.2).
    pub rebalance_tolerance: Option<f64>,
    /// For this long before acting (default 10s).
    pub rebalance_after: Option<String>,
    /// Connections closed per second at most (default 5).
    pub rebalance_rate: Option<i64>,
    /// `sockmap`: same-host connections move data socket to socket
    /// (default off).
    pub accelerate: Option<String>,
    /// `auto`, `keep` or `hand-back` (default auto).
    pub when_daemon_gone: Option<String>,
    /// How old the heartbeat must be for the daemon to count as gone
    /// (default 10s).
    pub daemon_gone_after: Option<String>,
}

/// A backend: `"ADDR:PORT[,weight=N][,preferred][,standby]"` or
/// `{ addr = "…", weight = N, preferred = true, standby = true }`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawBackend {
    Spec(String),
    Table(RawBackendTable),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBackendTable {
    pub addr: String,
    pub weight: Option<i64>,
    #[serde(default)]
    pub preferred: bool,
    #[serde(default)]
    pub standby: bool,
    #[serde(default)]
    pub drain: bool,
}

/// Health settings as written; durations are strings such as `"500ms"`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawHealth {
    /// `tcp`, `tls`, `http`, `https`, `http:PATH`, `https:PATH`, or a preset
    /// (`apiserver`, `supervisor`, `etcd`).
    pub kind: Option<String>,
    pub path: Option<String>,
    /// Accepted HTTP statuses: `[200, 401]` or `"200,401"`.
    pub statuses: Option<RawStatuses>,
    pub host: Option<String>,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub server_name: Option<String>,
    pub interval: Option<String>,
    pub down_interval: Option<String>,
    pub timeout: Option<String>,
    pub rise: Option<i64>,
    pub fall: Option<i64>,
    pub connect_failures: Option<i64>,
}

/// Status codes as a TOML list or as the flag's comma-separated text.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawStatuses {
    List(Vec<i64>),
    Text(String),
}

/// Names as a TOML list or as the flag's comma-separated text.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawNames {
    List(Vec<String>),
    Text(String),
}
