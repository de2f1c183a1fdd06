//! Configuration: the TOML file and the `run` flags, and their validation.
//!
//! Everything is validated before anything touches the kernel. Each problem
//! becomes a [`FieldError`] that names the field and says what is wrong, and
//! all problems are reported at once.

mod discovery;
mod health;
mod raw;
mod service;
mod values;

use std::{fmt, net::SocketAddr, path::Path, time::Duration};

pub use discovery::{
    DEFAULT_MAX_DISCOVERED_BACKENDS, Discovery, ENDPOINTSLICE_CONTROLLER,
    ENDPOINTSLICE_MIRRORING_CONTROLLER, SliceManager, SliceSource,
};
use raw::RawFile;
pub use raw::{RawBackend, RawBackendTable, RawHealth, RawNames, RawService, RawStatuses};
pub use service::{slots_needed, table_count, weight_divisor};
pub use values::parse_duration;

use service::{check_across_services, validate_service};

pub use crate::health::HealthSettings;

/// Highest weight a backend may have. Weights expand into table slots, so a
/// ceiling keeps the ratio between two backends representable.
pub const MAX_WEIGHT: u32 = 100;

/// One invalid field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the field, for example `service[0].backends[1]`.
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.problem)
    }
}

/// A configuration that cannot be used, with every problem found.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Syntax { path: String, message: String },
    #[error("invalid configuration:\n{}", list(.0))]
    Invalid(Vec<FieldError>),
}

fn list(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(|error| format!("  {error}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// What happens when no backend of a service is healthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NoneHealthyPolicy {
    /// Use all backends, healthy or not (Envoy's panic mode).
    #[default]
    FailOpen,
    /// Refuse the connect with ECONNREFUSED.
    Reject,
}

impl NoneHealthyPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FailOpen => "fail-open",
            Self::Reject => "reject",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "fail-open" => Some(Self::FailOpen),
            "reject" => Some(Self::Reject),
            _ => None,
        }
    }
}

/// What a service's VIPs do once the daemon is gone (its heartbeat older
/// than `daemon-gone-after`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WhenDaemonGone {
    /// `hand-back` when, at start and at each reload, a socket other than
    /// socklb's listens on a VIP (the agent's own balancer, as k3s's on
    /// 127.0.0.1:6444), `keep` otherwise (k3s with
    /// `--disable-apiserver-lb`): see `hand_back::HandBackChoice`.
    #[default]
    Auto,
    /// Go on redirecting from the last tables written.
    Keep,
    /// Leave connects untouched, so that they reach whatever listens on
    /// the VIP (the balancer socklb sits in front of).
    HandBack,
}

impl WhenDaemonGone {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Keep => "keep",
            Self::HandBack => "hand-back",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "auto" => Some(Self::Auto),
            "keep" => Some(Self::Keep),
            "hand-back" => Some(Self::HandBack),
            _ => None,
        }
    }
}

/// `daemon-gone-after` unless set.
pub const DEFAULT_DAEMON_GONE_AFTER: Duration = Duration::from_secs(10);
/// The shortest `daemon-gone-after`: the heartbeat beats twice a second,
/// and a daemon busy for a moment must not hand its VIPs back.
pub const MIN_DAEMON_GONE_AFTER: Duration = Duration::from_secs(2);

/// How a backend is chosen among the healthy ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SelectionPolicy {
    /// Weighted random over all healthy backends.
    #[default]
    Random,
    /// Power of two random choices on live connection counts, decided in
    /// the kernel at connect().
    LeastConn,
    /// Weighted random over the healthy backends on this host or marked
    /// `preferred`; the others only while none of those is healthy.
    PreferLocal,
}

impl SelectionPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::LeastConn => "least-conn",
            Self::PreferLocal => "prefer-local",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "random" => Some(Self::Random),
            "least-conn" => Some(Self::LeastConn),
            "prefer-local" => Some(Self::PreferLocal),
            _ => None,
        }
    }
}

/// A backend's place in the priority tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendRole {
    #[default]
    Normal,
    /// Preferred by `prefer-local`, like a backend on this host.
    Preferred,
    /// Used only when no other backend is healthy (k3s's default server).
    Standby,
}

/// The built-in probe presets: (name, path, what it is for).
pub const PRESETS: [(&str, &str, &str); 3] = [
    ("apiserver", "/readyz", "kube-apiserver readiness, https"),
    ("supervisor", "/ping", "k3s/rke2 supervisor, https"),
    (
        "etcd",
        "/health",
        "etcd client port, https with a client certificate",
    ),
];

/// One backend of a service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backend {
    pub addr: SocketAddr,
    pub weight: u32,
    pub role: BackendRole,
    /// Takes no new connections; existing ones are left alone.
    pub drain: bool,
}

/// One validated service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub name: String,
    pub vips: Vec<SocketAddr>,
    pub backends: Vec<Backend>,
    pub policy: SelectionPolicy,
    pub when_none_healthy: NoneHealthyPolicy,
    /// Redirect sockets of every network namespace, not only the daemon's.
    pub all_netns: bool,
    /// Close the redirected connections to a backend that becomes unhealthy.
    pub close_on_failure: bool,
    pub health: HealthSettings,
    /// Dynamic sources of backends; `backends` then only seeds the table.
    pub discovery: Discovery,
    /// A backend that becomes healthy (or is added) ramps its share of new
    /// connections from about a tenth of its weight to all of it over this
    /// long. None: off.
    pub slow_start: Option<Duration>,
    /// Rebalancing of long-lived connections (None: off).
    pub rebalance: Option<Rebalance>,
    /// sockmap acceleration of connections to backends on this host.
    pub accelerate: bool,
    /// What the VIPs do once the daemon is gone.
    pub when_daemon_gone: WhenDaemonGone,
    /// How old the heartbeat must be for the daemon to count as gone.
    pub daemon_gone_after: Duration,
}

/// When and how fast a service's connections are rebalanced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rebalance {
    /// Out of balance when max/mean of the live counts exceeds 1 + this,
    /// or min/mean falls below 1 − this, in thousandths (200: 0.2).
    pub tolerance_permille: u32,
    /// How long the imbalance must last before connections are closed.
    pub after: Duration,
    /// Connections closed per second at most.
    pub rate: u32,
}

impl Default for Rebalance {
    fn default() -> Self {
        Self {
            tolerance_permille: 200,
            after: Duration::from_secs(10),
            rate: 5,
        }
    }
}

/// A validated configuration: every field was checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub services: Vec<Service>,
    /// Sockets the kernel's socket table holds (`socket-table-size`): its
    /// memory is taken whole when it is made, and connects past it are
    /// redirected untracked. Applied when the table is made (install).
    pub socket_table_size: u32,
}

/// Reads and validates a config file.
pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_toml(&text).map_err(|error| match error {
        ConfigError::Syntax { message, .. } => ConfigError::Syntax {
            path: path.display().to_string(),
            message,
        },
        other => other,
    })
}

/// Parses and validates TOML text.
pub fn parse_toml(text: &str) -> Result<Config, ConfigError> {
    let raw: RawFile = toml::from_str(text).map_err(|error| ConfigError::Syntax {
        path: "config".into(),
        message: error.to_string().trim_end().to_string(),
    })?;
    validate_with(raw.service, "service", raw.socket_table_size)
}

/// Validates services assembled from flags (field names are the flags').
pub fn from_flags(service: RawService) -> Result<Config, ConfigError> {
    validate(vec![service], "flags")
}

/// Checks every field of every service and returns all problems together.
pub fn validate(raw: Vec<RawService>, root: &str) -> Result<Config, ConfigError> {
    validate_with(raw, root, None)
}

/// `validate`, with the file's `socket-table-size` (or the flag's).
pub fn validate_with(
    raw: Vec<RawService>,
    root: &str,
    socket_table_size: Option<i64>,
) -> Result<Config, ConfigError> {
    let mut errors = Vec::new();
    let field = if root == "flags" {
        "--socket-table-size"
    } else {
        "socket-table-size"
    };
    let socket_table_size = check_socket_table_size(socket_table_size, field, &mut errors);
    if raw.is_empty() {
        errors.push(field_error(root, "no service is configured"));
    }
    let mut services = Vec::new();
    for (index, raw_service) in raw.into_iter().enumerate() {
        let prefix = if root == "flags" {
            String::new()
        } else {
            format!("{root}[{index}].")
        };
        if let Some(service) = validate_service(raw_service, &prefix, index, &mut errors) {
            services.push((index, service));
        }
    }
    check_across_services(&services, root, &mut errors);
    discovery::check_backend_budget(&services, root, &mut errors);
    if errors.is_empty() {
        Ok(Config {
            services: services.into_iter().map(|(_, service)| service).collect(),
            socket_table_size,
        })
    } else {
        Err(ConfigError::Invalid(errors))
    }
}

/// `socket-table-size`: the default when unset, an error naming the field
/// when out of range.
pub fn check_socket_table_size(
    value: Option<i64>,
    field: &str,
    errors: &mut Vec<FieldError>,
) -> u32 {
    use lb_common::{DEFAULT_SOCKET_TABLE_SIZE, MAX_SOCKET_TABLE_SIZE, MIN_SOCKET_TABLE_SIZE};
    let Some(value) = value else {
        return DEFAULT_SOCKET_TABLE_SIZE;
    };
    match u32::try_from(value) {
        Ok(size) if (MIN_SOCKET_TABLE_SIZE..=MAX_SOCKET_TABLE_SIZE).contains(&size) => size,
        _ => {
            errors.push(field_error(
                field,
                format!(
                    "{value} is out of range {MIN_SOCKET_TABLE_SIZE}..={MAX_SOCKET_TABLE_SIZE} (sockets the kernel's table holds)"
                ),
            ));
            DEFAULT_SOCKET_TABLE_SIZE
        }
    }
}

/// Checks a configuration whose backends discovery replaced, against the
/// rules a file obeys: address families, table sizes, VIPs that are
/// backends, and the kernel maps' limits.
pub fn check_effective(config: &Config) -> Result<(), ConfigError> {
    let mut errors = Vec::new();
    let services: Vec<(usize, Service)> = config.services.iter().cloned().enumerate().collect();
    for (index, service) in &services {
        service::check_discovered(*index, service, &mut errors);
    }
    check_across_services(&services, "service", &mut errors);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid(errors))
    }
}

pub(crate) fn field_error(field: impl Into<String>, problem: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        problem: problem.into(),
    }
}

impl fmt::Display for Config {
    /// What `check-config` prints: the configuration as understood.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "socket table: {} sockets", self.socket_table_size)?;
        for service in &self.services {
            write_service(f, service)?;
            write_health(f, &service.health)?;
            write_discovery(f, &service.discovery)?;
            for backend in &service.backends {
                let role = match backend.role {
                    BackendRole::Normal => "",
                    BackendRole::Preferred => " preferred",
                    BackendRole::Standby => " standby",
                };
                writeln!(
                    f,
                    "  backend {} weight {}{role}{}",
                    backend.addr,
                    backend.weight,
                    if backend.drain { " draining" } else { "" }
                )?;
            }
        }
        Ok(())
    }
}

/// What breaks with `accelerate = "sockmap"` on the kernels tested
/// (`tests/tests/accel.rs`; docs/acceleration.md), as `check-config`
/// lists it under an accelerating service: why the default is off.
pub const SOCKMAP_KNOWN_FAILURES: &[&str] = &[
    "a plain blocking read can return EAGAIN (tcp_bpf_recvmsg), e.g. a client \
     that half-closes, then reads the answer to EOF",
    "SO_RCVLOWAT is not honoured",
    "a reader that splice(2)s from the socket sees none of the redirected data",
    "a sender that outruns its reader for long loses bytes under TCP memory pressure",
];

/// A service's VIPs and policies, as `check-config` prints them.
fn write_service(f: &mut fmt::Formatter<'_>, service: &Service) -> fmt::Result {
    writeln!(f, "service {}", service.name)?;
    let vips: Vec<String> = service.vips.iter().map(ToString::to_string).collect();
    writeln!(f, "  vips: {}", vips.join(", "))?;
    writeln!(
        f,
        "  policy: {}, when none is healthy: {}{}",
        service.policy.as_str(),
        service.when_none_healthy.as_str(),
        if service.all_netns {
            ", all network namespaces"
        } else {
            ", host network namespace only"
        }
    )?;
    writeln!(f, "  close-on-failure: {}", service.close_on_failure)?;
    if let Some(slow_start) = service.slow_start {
        writeln!(f, "  slow-start: {slow_start:?}")?;
    }
    if service.accelerate {
        writeln!(f, "  accelerate: sockmap (backends on this host)")?;
        for failure in SOCKMAP_KNOWN_FAILURES {
            writeln!(f, "    known failure: {failure}")?;
        }
    }
    match service.when_daemon_gone {
        WhenDaemonGone::Keep => writeln!(f, "  when the daemon is gone: keep redirecting")?,
        WhenDaemonGone::HandBack => writeln!(
            f,
            "  when the daemon is gone: hand the VIPs back after {:?} without a heartbeat",
            service.daemon_gone_after
        )?,
        WhenDaemonGone::Auto => writeln!(
            f,
            "  when the daemon is gone: auto (hand the VIPs back after {:?} without a heartbeat if another socket listens on one, else keep redirecting)",
            service.daemon_gone_after
        )?,
    }
    if let Some(rebalance) = service.rebalance {
        let tolerance = f64::from(rebalance.tolerance_permille) / 1000.0;
        writeln!(
            f,
            "  rebalance: when max/mean > {:.3} or min/mean < {:.3} for {:?}, at most {}/s",
            1.0 + tolerance,
            1.0 - tolerance,
            rebalance.after,
            rebalance.rate
        )?;
    }
    Ok(())
}

fn write_health(f: &mut fmt::Formatter<'_>, health: &HealthSettings) -> fmt::Result {
    writeln!(
        f,
        "  health: {} every {:?} (±20%; {:?} while down), timeout {:?}, rise {}, fall {}",
        health.probe.describe(),
        health.interval,
        health.down_interval,
        health.timeout,
        health.rise,
        health.fall
    )?;
    writeln!(
        f,
        "  passive: {}",
        match health.connect_failures {
            0 => "off".to_string(),
            count => format!(
                "the next probe comes at once after {count} failed connect{} in a row (reset, or SYN unanswered)",
                if count == 1 { "" } else { "s" }
            ),
        }
    )
}

/// The discovery lines of `check-config`.
fn write_discovery(f: &mut fmt::Formatter<'_>, discovery: &Discovery) -> fmt::Result {
    if let Some(path) = &discovery.k3s_state {
        writeln!(f, "  discovery: k3s state file {}", path.display())?;
    }
    if let Some(slices) = &discovery.endpoint_slices {
        let managers: Vec<String> = slices.managers.iter().map(ToString::to_string).collect();
        writeln!(
            f,
            "  discovery: EndpointSlices of {}/{}, port {}, written by {}, kubeconfig {}",
            slices.namespace,
            slices.service,
            slices.port,
            managers.join(" or "),
            slices
                .kubeconfig
                .as_ref()
                .map_or("inferred".to_string(), |path| path.display().to_string())
        )?;
    }
    if discovery.is_dynamic() {
        writeln!(
            f,
            "  discovery: at most {} backends",
            discovery.max_backends
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
