//! Configuration: the TOML file and the `run` flags, and their validation.
//!
//! Everything is validated before anything touches the kernel. Each problem
//! becomes a [`FieldError`] that names the field and says what is wrong, and
//! all problems are reported at once.

use std::{
    collections::HashSet,
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use lb_common::{MAX_BACKENDS, MAX_TABLES, MAX_VIPS, NAME_LEN, SLOTS_PER_LIST};
use serde::Deserialize;

use crate::probe::{ProbeSpec, Prober, TlsOptions};

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

/// Active health-check settings of one service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthSettings {
    /// What a probe does.
    pub probe: ProbeSpec,
    pub interval: Duration,
    /// Interval while a backend is down (HAProxy's `downinter`).
    pub down_interval: Duration,
    pub timeout: Duration,
    /// Consecutive successes that make a down backend healthy.
    pub rise: u32,
    /// Consecutive failures that make an up backend unhealthy.
    pub fall: u32,
    /// Failed connects in a row, seen by the kernel, that take a backend out
    /// at once without waiting for a probe; 0 turns this off.
    pub connect_failures: u32,
}

impl Default for HealthSettings {
    fn default() -> Self {
        Self {
            probe: ProbeSpec::Tcp,
            interval: Duration::from_secs(1),
            down_interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            rise: 2,
            fall: 3,
            connect_failures: 2,
        }
    }
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
}

/// A validated configuration: every field was checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub services: Vec<Service>,
}

// ---- The file as written -------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    service: Vec<RawService>,
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
    validate(raw.service, "service")
}

/// Validates services assembled from flags (field names are the flags').
pub fn from_flags(service: RawService) -> Result<Config, ConfigError> {
    validate(vec![service], "flags")
}

/// Checks every field of every service and returns all problems together.
pub fn validate(raw: Vec<RawService>, root: &str) -> Result<Config, ConfigError> {
    let mut errors = Vec::new();
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
            services.push(service);
        }
    }
    check_across_services(&services, root, &mut errors);
    if errors.is_empty() {
        Ok(Config { services })
    } else {
        Err(ConfigError::Invalid(errors))
    }
}

fn field_error(field: impl Into<String>, problem: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        problem: problem.into(),
    }
}

fn validate_service(
    raw: RawService,
    prefix: &str,
    index: usize,
    errors: &mut Vec<FieldError>,
) -> Option<Service> {
    let before = errors.len();
    let name = raw.name.unwrap_or_else(|| format!("service{index}"));
    check_name(&name, &format!("{prefix}name"), errors);

    let vip_field = if prefix.is_empty() {
        "--vip".to_string()
    } else {
        format!("{prefix}vips")
    };
    let vips: Vec<SocketAddr> = raw
        .vips
        .iter()
        .enumerate()
        .filter_map(|(i, text)| parse_endpoint(text, &format!("{vip_field}[{i}]"), errors))
        .collect();
    if raw.vips.is_empty() {
        errors.push(field_error(&vip_field, "at least one VIP is required"));
    }
    report_duplicates(&vips, &vip_field, "VIP", errors);

    let backend_field = if prefix.is_empty() {
        "--backend".to_string()
    } else {
        format!("{prefix}backends")
    };
    let backends: Vec<Backend> = raw
        .backends
        .iter()
        .enumerate()
        .filter_map(|(i, spec)| parse_backend(spec, &format!("{backend_field}[{i}]"), errors))
        .collect();
    if raw.backends.is_empty() {
        errors.push(field_error(
            &backend_field,
            "at least one backend is required",
        ));
    }
    let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
    report_duplicates(&addrs, &backend_field, "backend", errors);
    check_families(&vips, &addrs, &vip_field, &backend_field, errors);
    for vip in &vips {
        if addrs.contains(vip) {
            errors.push(field_error(
                &vip_field,
                format!("{vip} is also a backend; a VIP that redirects to itself loops"),
            ));
        }
    }

    let field_name = |toml: &str, flag: &str| {
        if prefix.is_empty() {
            flag.to_string()
        } else {
            format!("{prefix}{toml}")
        }
    };
    let policy = match raw.policy.as_deref() {
        None => SelectionPolicy::default(),
        Some(text) => SelectionPolicy::parse(text).unwrap_or_else(|| {
            errors.push(field_error(
                field_name("policy", "--policy"),
                format!(
                    "unknown policy {text:?}; expected \"random\", \"least-conn\" or \"prefer-local\""
                ),
            ));
            SelectionPolicy::default()
        }),
    };
    let when_none_healthy = match raw.when_none_healthy.as_deref() {
        None => NoneHealthyPolicy::default(),
        Some(text) => NoneHealthyPolicy::parse(text).unwrap_or_else(|| {
            errors.push(field_error(
                field_name("when-none-healthy", "--when-none-healthy"),
                format!("unknown policy {text:?}; expected \"fail-open\" or \"reject\""),
            ));
            NoneHealthyPolicy::default()
        }),
    };
    if policy != SelectionPolicy::PreferLocal
        && let Some(index) = backends
            .iter()
            .position(|backend| backend.role == BackendRole::Preferred)
    {
        errors.push(field_error(
            format!("{backend_field}[{index}]"),
            "preferred only applies with policy prefer-local",
        ));
    }
    if !backends.is_empty()
        && backends
            .iter()
            .all(|backend| backend.role == BackendRole::Standby)
    {
        errors.push(field_error(
            &backend_field,
            "every backend is a standby; at least one must not be",
        ));
    }
    let health = validate_health(&raw.health, prefix, errors);
    (errors.len() == before).then_some(Service {
        name,
        vips,
        backends,
        policy,
        when_none_healthy,
        all_netns: raw.all_netns,
        close_on_failure: raw.close_on_failure.unwrap_or(true),
        health,
    })
}

fn check_name(name: &str, field: &str, errors: &mut Vec<FieldError>) {
    if name.is_empty() {
        errors.push(field_error(field, "must not be empty"));
    } else if name.len() >= NAME_LEN {
        errors.push(field_error(
            field,
            format!("longer than {} bytes", NAME_LEN - 1),
        ));
    } else if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        errors.push(field_error(
            field,
            format!("{name:?} may only hold letters, digits, '-', '_' and '.'"),
        ));
    }
}

/// Parses `ADDR:PORT` (IPv6 as `[ADDR]:PORT`).
fn parse_endpoint(text: &str, field: &str, errors: &mut Vec<FieldError>) -> Option<SocketAddr> {
    let addr: SocketAddr = match text.trim().parse() {
        Ok(addr) => addr,
        Err(_) => {
            errors.push(field_error(
                field,
                format!("{text:?} is not ADDR:PORT (IPv6 as [ADDR]:PORT)"),
            ));
            return None;
        }
    };
    if addr.port() == 0 {
        errors.push(field_error(
            field,
            format!("{text:?}: port 0 is not a port"),
        ));
        return None;
    }
    if addr.ip().is_unspecified() {
        errors.push(field_error(
            field,
            format!("{text:?}: the unspecified address is not a peer"),
        ));
        return None;
    }
    if let SocketAddr::V6(v6) = addr
        && v6.ip().to_ipv4_mapped().is_some()
    {
        errors.push(field_error(
            field,
            format!("{text:?}: write IPv4-mapped addresses as plain IPv4"),
        ));
        return None;
    }
    Some(addr)
}

/// Parses the flag form `ADDR:PORT[,weight=N]` or the TOML table form.
fn parse_backend(raw: &RawBackend, field: &str, errors: &mut Vec<FieldError>) -> Option<Backend> {
    let (addr_text, weight, preferred, standby, drain) = match raw {
        RawBackend::Table(table) => (
            table.addr.as_str(),
            table.weight,
            table.preferred,
            table.standby,
            table.drain,
        ),
        RawBackend::Spec(spec) => {
            let mut parts = spec.split(',');
            let addr_text = parts.next().unwrap_or_default();
            let (mut weight, mut preferred, mut standby, mut drain) = (None, false, false, false);
            for option in parts {
                match option.trim().split_once('=') {
                    Some(("weight", value)) => match value.trim().parse::<i64>() {
                        Ok(number) => weight = Some(number),
                        Err(_) => {
                            errors.push(field_error(
                                format!("{field}.weight"),
                                format!("{value:?} is not a whole number"),
                            ));
                            return None;
                        }
                    },
                    None if option.trim() == "preferred" => preferred = true,
                    None if option.trim() == "standby" => standby = true,
                    None if option.trim() == "drain" => drain = true,
                    _ => {
                        errors.push(field_error(
                            field,
                            format!(
                                "unknown option {option:?}; expected weight=N, preferred, standby or drain"
                            ),
                        ));
                        return None;
                    }
                }
            }
            (addr_text, weight, preferred, standby, drain)
        }
    };
    let addr = parse_endpoint(addr_text, field, errors)?;
    let weight = weight.unwrap_or(1);
    if !(1..=i64::from(MAX_WEIGHT)).contains(&weight) {
        errors.push(field_error(
            format!("{field}.weight"),
            format!("{weight} is out of range 1..={MAX_WEIGHT}"),
        ));
        return None;
    }
    let role = match (preferred, standby) {
        (true, true) => {
            errors.push(field_error(
                field,
                "a backend cannot be both preferred and standby",
            ));
            return None;
        }
        (true, false) => BackendRole::Preferred,
        (false, true) => BackendRole::Standby,
        (false, false) => BackendRole::Normal,
    };
    Some(Backend {
        addr,
        weight: weight as u32,
        role,
        drain,
    })
}

fn report_duplicates(addrs: &[SocketAddr], field: &str, what: &str, errors: &mut Vec<FieldError>) {
    let mut seen = HashSet::new();
    for addr in addrs {
        if !seen.insert(addr) {
            errors.push(field_error(field, format!("{what} {addr} is listed twice")));
        }
    }
}

/// A VIP can only be served by backends of its own family (an IPv4 socket
/// cannot reach an IPv6 address), so each VIP family needs such backends.
fn check_families(
    vips: &[SocketAddr],
    backends: &[SocketAddr],
    vip_field: &str,
    backend_field: &str,
    errors: &mut Vec<FieldError>,
) {
    for (is_v4, family) in [(true, "IPv4"), (false, "IPv6")] {
        let has_vip = vips.iter().any(|vip| vip.is_ipv4() == is_v4);
        let count = backends
            .iter()
            .filter(|addr| addr.is_ipv4() == is_v4)
            .count();
        if has_vip && count == 0 {
            errors.push(field_error(
                vip_field,
                format!("an {family} VIP needs at least one {family} backend"),
            ));
        }
        if count > SLOTS_PER_LIST as usize {
            errors.push(field_error(
                backend_field,
                format!("{count} {family} backends; at most {SLOTS_PER_LIST} per family"),
            ));
        }
    }
}

fn validate_health(raw: &RawHealth, prefix: &str, errors: &mut Vec<FieldError>) -> HealthSettings {
    let flags = prefix.is_empty();
    let name = |toml: &str, flag: &str| {
        if flags {
            flag.to_string()
        } else {
            format!("{prefix}health.{toml}")
        }
    };
    let defaults = HealthSettings::default();
    let duration = |text: &Option<String>, field: String, errors: &mut Vec<FieldError>| {
        text.as_deref()
            .and_then(|text| parse_positive_duration(text, &field, errors))
    };
    let interval = duration(&raw.interval, name("interval", "--health-interval"), errors)
        .unwrap_or(defaults.interval);
    let down_interval = duration(
        &raw.down_interval,
        name("down-interval", "--health-down-interval"),
        errors,
    )
    .unwrap_or(interval);
    let timeout = duration(&raw.timeout, name("timeout", "--health-timeout"), errors)
        .unwrap_or(defaults.timeout);
    let rise = count_in_range(raw.rise, defaults.rise, &name("rise", "--rise"), errors);
    let fall = count_in_range(raw.fall, defaults.fall, &name("fall", "--fall"), errors);
    let connect_failures = match raw.connect_failures {
        None => defaults.connect_failures,
        Some(0) => 0,
        Some(_) => count_in_range(
            raw.connect_failures,
            defaults.connect_failures,
            &name("connect-failures", "--connect-failures"),
            errors,
        ),
    };
    let probe = validate_probe(raw, &name, errors).unwrap_or_default();
    HealthSettings {
        probe,
        interval,
        down_interval,
        timeout,
        rise,
        fall,
        connect_failures,
    }
}

/// Resolves the probe kind, preset and overrides into a [`ProbeSpec`], and
/// reads the certificate files so that a bad one is a config error.
fn validate_probe(
    raw: &RawHealth,
    name: &dyn Fn(&str, &str) -> String,
    errors: &mut Vec<FieldError>,
) -> Option<ProbeSpec> {
    let kind_field = name("kind", "--health");
    let kind_text = raw.kind.as_deref().unwrap_or("tcp");
    let (word, kind_path) = match kind_text.split_once(':') {
        Some((word, path)) => (word, Some(path.to_string())),
        None => (kind_text, None),
    };
    // (is http, uses tls, preset path, needs a client certificate)
    let (http, tls, preset_path, needs_client_cert) = match word {
        "tcp" => (false, false, None, false),
        "tls" => (false, true, None, false),
        "http" => (true, false, None, false),
        "https" => (true, true, None, false),
        preset => match PRESETS.iter().find(|(name, _, _)| *name == preset) {
            Some((name, path, _)) => (true, true, Some(*path), *name == "etcd"),
            None => {
                errors.push(field_error(
                    &kind_field,
                    format!(
                        "unknown probe {kind_text:?}; expected tcp, tls, http[:PATH], https[:PATH], apiserver, supervisor or etcd"
                    ),
                ));
                return None;
            }
        },
    };
    if kind_path.is_some() && !http {
        errors.push(field_error(
            &kind_field,
            format!("{word} probes take no path"),
        ));
        return None;
    }
    let before = errors.len();
    if !http {
        for (value, toml, flag) in [
            (raw.path.is_some(), "path", "--health"),
            (raw.statuses.is_some(), "statuses", "--health-status"),
            (raw.host.is_some(), "host", "--health-host"),
        ] {
            if value {
                errors.push(field_error(
                    name(toml, flag),
                    format!("only applies to http and https probes, not {word}"),
                ));
            }
        }
    }
    if !tls {
        for (value, toml, flag) in [
            (raw.ca.is_some(), "ca", "--health-ca"),
            (raw.cert.is_some(), "cert", "--health-cert"),
            (raw.key.is_some(), "key", "--health-key"),
            (
                raw.server_name.is_some(),
                "server-name",
                "--health-server-name",
            ),
        ] {
            if value {
                errors.push(field_error(
                    name(toml, flag),
                    format!("only applies to tls and https probes, not {word}"),
                ));
            }
        }
    }
    if needs_client_cert && (raw.cert.is_none() || raw.key.is_none()) {
        errors.push(field_error(
            name("cert", "--health-cert"),
            "the etcd probe needs a client certificate and key (cert and key)",
        ));
    }
    let path = raw
        .path
        .clone()
        .or(kind_path)
        .or(preset_path.map(str::to_string))
        .unwrap_or_else(|| "/".into());
    if http && !path.starts_with('/') {
        errors.push(field_error(
            name("path", "--health"),
            format!("{path:?} must start with /"),
        ));
    }
    let statuses = parse_statuses(
        raw.statuses.as_ref(),
        &name("statuses", "--health-status"),
        errors,
    );
    if errors.len() != before {
        return None;
    }
    let tls_options = tls.then(|| TlsOptions {
        ca: raw.ca.clone(),
        cert: raw.cert.clone(),
        key: raw.key.clone(),
        server_name: raw.server_name.clone(),
    });
    let spec = match (http, tls_options) {
        (false, None) => ProbeSpec::Tcp,
        (false, Some(options)) => ProbeSpec::Tls(options),
        (true, tls) => ProbeSpec::Http {
            path,
            statuses,
            host: raw.host.clone(),
            tls,
        },
    };
    if let Err(error) = Prober::new(&spec) {
        let flag = format!("--health-{}", error.field);
        errors.push(field_error(name(error.field, &flag), error.problem));
        return None;
    }
    Some(spec)
}

fn parse_statuses(
    raw: Option<&RawStatuses>,
    field: &str,
    errors: &mut Vec<FieldError>,
) -> Vec<u16> {
    let numbers: Vec<Result<i64, String>> = match raw {
        None => return vec![200],
        Some(RawStatuses::List(list)) => list.iter().map(|&number| Ok(number)).collect(),
        Some(RawStatuses::Text(text)) => text
            .split(',')
            .map(|part| {
                part.trim()
                    .parse::<i64>()
                    .map_err(|_| part.trim().to_string())
            })
            .collect(),
    };
    let mut statuses = Vec::new();
    for number in numbers {
        match number {
            Ok(code @ 100..=599) => statuses.push(code as u16),
            Ok(code) => errors.push(field_error(
                field,
                format!("{code} is not an HTTP status (100..=599)"),
            )),
            Err(text) => errors.push(field_error(field, format!("{text:?} is not a status code"))),
        }
    }
    if statuses.is_empty() && errors.iter().all(|error| error.field != field) {
        errors.push(field_error(field, "at least one status is needed"));
    }
    statuses
}

fn count_in_range(
    value: Option<i64>,
    default: u32,
    field: &str,
    errors: &mut Vec<FieldError>,
) -> u32 {
    match value {
        None => default,
        Some(number @ 1..=100) => number as u32,
        Some(number) => {
            errors.push(field_error(
                field,
                format!("{number} is out of range 1..=100"),
            ));
            default
        }
    }
}

fn parse_positive_duration(
    text: &str,
    field: &str,
    errors: &mut Vec<FieldError>,
) -> Option<Duration> {
    match parse_duration(text) {
        Some(duration)
            if duration >= Duration::from_millis(10) && duration <= Duration::from_secs(3600) =>
        {
            Some(duration)
        }
        Some(_) => {
            errors.push(field_error(
                field,
                format!("{text:?} is out of range 10ms..=1h"),
            ));
            None
        }
        None => {
            errors.push(field_error(
                field,
                format!("{text:?} is not a duration; write it as 500ms, 2s or 1m"),
            ));
            None
        }
    }
}

/// Parses `"250ms"`, `"2s"`, `"1.5s"` or `"1m"`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let (number, unit_ms) = if let Some(number) = text.strip_suffix("ms") {
        (number, 1.0)
    } else if let Some(number) = text.strip_suffix('s') {
        (number, 1000.0)
    } else if let Some(number) = text.strip_suffix('m') {
        (number, 60_000.0)
    } else {
        return None;
    };
    let value: f64 = number.trim().parse().ok()?;
    // try_from: a huge value such as 1e20s is "not a duration", not a panic.
    Duration::try_from_secs_f64(value * unit_ms / 1000.0).ok()
}

/// Limits that come from the kernel maps' sizes.
fn check_across_services(services: &[Service], root: &str, errors: &mut Vec<FieldError>) {
    let mut vip_owner = std::collections::HashMap::new();
    let mut names = HashSet::new();
    for (index, service) in services.iter().enumerate() {
        if !names.insert(service.name.as_str()) {
            errors.push(field_error(
                format!("{root}[{index}].name"),
                format!("service name {:?} is used twice", service.name),
            ));
        }
        for vip in &service.vips {
            if let Some(other) = vip_owner.insert(*vip, service.name.as_str()) {
                errors.push(field_error(
                    format!("{root}[{index}].vips"),
                    format!("VIP {vip} is also used by service {other:?}"),
                ));
            }
        }
    }
    let tables: usize = services.iter().map(table_count).sum();
    let backends: usize = services.iter().map(|service| service.backends.len()).sum();
    let vips: usize = services.iter().map(|service| service.vips.len()).sum();
    for (count, limit, what) in [
        (tables, MAX_TABLES as usize, "service address families"),
        (backends, MAX_BACKENDS as usize, "backends"),
        (vips, MAX_VIPS as usize, "VIPs"),
    ] {
        if count > limit {
            errors.push(field_error(
                root,
                format!("{count} {what} in all; at most {limit}"),
            ));
        }
    }
}

/// Each address family a service has VIPs in gets its own selection table.
pub fn table_count(service: &Service) -> usize {
    let v4 = service.vips.iter().any(SocketAddr::is_ipv4);
    let v6 = service.vips.iter().any(SocketAddr::is_ipv6);
    usize::from(v4) + usize::from(v6)
}

impl fmt::Display for Config {
    /// What `check-config` prints: the configuration as understood.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for service in &self.services {
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
            let health = &service.health;
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
                    count => format!("out after {count} failed connects in a row"),
                }
            )?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
                connect_failures: 2,
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
            "bad down interval",
            "vips=[\"127.0.0.1:1\"]\nbackends=[\"127.0.0.2:1\"]\nhealth={down-interval=\"x\"}",
            "service[0].health.down-interval",
            "not a duration",
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
        assert_eq!(parse_duration("5"), None);
        assert_eq!(parse_duration("-1s"), None);
        assert_eq!(parse_duration("1e20s"), None, "too large, and no panic");
        assert_eq!(parse_duration("NaNs"), None);
    }
}
