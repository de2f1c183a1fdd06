//! Validation of one service and of what services share.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    time::Duration,
};

use lb_common::{MAX_BACKENDS, MAX_TABLES, MAX_VIPS, NAME_LEN, SLOTS_PER_LIST};

use super::{
    Backend, BackendRole, DEFAULT_DAEMON_GONE_AFTER, Discovery, FieldError, MIN_DAEMON_GONE_AFTER,
    NoneHealthyPolicy, RawService, Rebalance, SelectionPolicy, Service, WhenDaemonGone,
    discovery::validate_discovery,
    field_error,
    health::validate_health,
    values::{parse_backend, parse_endpoint, parse_positive_duration},
};

pub(super) fn validate_service(
    raw: RawService,
    prefix: &str,
    index: usize,
    errors: &mut Vec<FieldError>,
) -> Option<Service> {
    let before = errors.len();
    let name = raw
        .name
        .clone()
        .unwrap_or_else(|| format!("service{index}"));
    check_name(&name, &format!("{prefix}name"), errors);
    let addresses = validate_addresses(&raw, prefix, errors);
    let field_name = |toml: &str, flag: &str| {
        if prefix.is_empty() {
            flag.to_string()
        } else {
            format!("{prefix}{toml}")
        }
    };
    let (policy, when_none_healthy) = validate_policies(&raw, &field_name, errors);
    check_roles(policy, &addresses, errors);
    let health = validate_health(&raw.health, prefix, errors);
    let slow_start = raw.slow_start.as_deref().and_then(|text| {
        parse_positive_duration(text, &field_name("slow-start", "--slow-start"), errors)
    });
    let rebalance = validate_rebalance(&raw, &field_name, errors);
    let accelerate = validate_accelerate(&raw, &field_name, errors);
    let (when_daemon_gone, daemon_gone_after) = validate_daemon_gone(&raw, &field_name, errors);
    (errors.len() == before).then_some(Service {
        name,
        vips: addresses.vips,
        backends: addresses.backends,
        policy,
        when_none_healthy,
        all_netns: raw.all_netns,
        close_on_failure: raw.close_on_failure.unwrap_or(true),
        health,
        discovery: addresses.discovery,
        slow_start,
        rebalance,
        accelerate,
        when_daemon_gone,
        daemon_gone_after,
    })
}

/// A service's VIPs, backends and discovery sources, checked together,
/// with the names of their fields.
struct Addresses {
    vips: Vec<SocketAddr>,
    backends: Vec<Backend>,
    discovery: Discovery,
    backend_field: String,
}

/// `vips`, `backends` and the discovery fields: parsed, no duplicates, a
/// backend for each VIP's family, and no VIP that is also a backend.
fn validate_addresses(raw: &RawService, prefix: &str, errors: &mut Vec<FieldError>) -> Addresses {
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
    let indexed: Vec<(usize, Backend)> = raw
        .backends
        .iter()
        .enumerate()
        .filter_map(|(i, spec)| {
            parse_backend(spec, &format!("{backend_field}[{i}]"), errors)
                .map(|backend| (i, backend))
        })
        .collect();
    let discovery = validate_discovery(raw, prefix, errors);
    if raw.backends.is_empty() && !discovery.is_dynamic() {
        errors.push(field_error(
            &backend_field,
            "at least one backend is required (or a discovery source: k3s-state, endpointslices)",
        ));
    }
    let addrs: Vec<SocketAddr> = indexed.iter().map(|(_, backend)| backend.addr).collect();
    report_duplicates(&addrs, &backend_field, "backend", errors);
    let fields = FamilyFields {
        vip: &vip_field,
        backend: &backend_field,
        discovered: discovery.is_dynamic(),
    };
    check_families(&vips, &indexed, &fields, errors);
    for vip in &vips {
        if addrs.contains(vip) {
            errors.push(field_error(
                &vip_field,
                format!("{vip} is also a backend; a VIP that redirects to itself loops"),
            ));
        }
    }
    Addresses {
        vips,
        backends: indexed.into_iter().map(|(_, backend)| backend).collect(),
        discovery,
        backend_field,
    }
}

/// `policy` and `when-none-healthy`.
fn validate_policies(
    raw: &RawService,
    field_name: &dyn Fn(&str, &str) -> String,
    errors: &mut Vec<FieldError>,
) -> (SelectionPolicy, NoneHealthyPolicy) {
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
    (policy, when_none_healthy)
}

/// The backends' roles: `preferred` only with prefer-local, and not every
/// backend a standby.
fn check_roles(policy: SelectionPolicy, addresses: &Addresses, errors: &mut Vec<FieldError>) {
    let (backends, backend_field) = (&addresses.backends, &addresses.backend_field);
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
            backend_field,
            "every backend is a standby; at least one must not be",
        ));
    }
}

/// `accelerate`: "sockmap" or "none".
fn validate_accelerate(
    raw: &RawService,
    field_name: &dyn Fn(&str, &str) -> String,
    errors: &mut Vec<FieldError>,
) -> bool {
    match raw.accelerate.as_deref() {
        None | Some("none") => false,
        Some("sockmap") => true,
        Some(text) => {
            errors.push(field_error(
                field_name("accelerate", "--accelerate"),
                format!("unknown acceleration {text:?}; expected \"sockmap\" or \"none\""),
            ));
            false
        }
    }
}

/// `when-daemon-gone` and `daemon-gone-after`.
fn validate_daemon_gone(
    raw: &RawService,
    field_name: &dyn Fn(&str, &str) -> String,
    errors: &mut Vec<FieldError>,
) -> (WhenDaemonGone, Duration) {
    let when = match raw.when_daemon_gone.as_deref() {
        None => WhenDaemonGone::default(),
        Some(text) => WhenDaemonGone::parse(text).unwrap_or_else(|| {
            errors.push(field_error(
                field_name("when-daemon-gone", "--when-daemon-gone"),
                format!("unknown behaviour {text:?}; expected \"auto\", \"keep\" or \"hand-back\""),
            ));
            WhenDaemonGone::default()
        }),
    };
    let field = field_name("daemon-gone-after", "--daemon-gone-after");
    let after = match raw.daemon_gone_after.as_deref() {
        None => DEFAULT_DAEMON_GONE_AFTER,
        Some(text) => match parse_positive_duration(text, &field, errors) {
            Some(after) if after < MIN_DAEMON_GONE_AFTER => {
                errors.push(field_error(
                    &field,
                    format!(
                        "{text:?} is shorter than {MIN_DAEMON_GONE_AFTER:?}: the heartbeat beats twice a second, and a daemon busy for a moment must not hand its VIPs back"
                    ),
                ));
                DEFAULT_DAEMON_GONE_AFTER
            }
            Some(after) => after,
            None => DEFAULT_DAEMON_GONE_AFTER,
        },
    };
    (when, after)
}

/// The rebalance fields: settings only with `rebalance = true`.
fn validate_rebalance(
    raw: &RawService,
    field_name: &dyn Fn(&str, &str) -> String,
    errors: &mut Vec<FieldError>,
) -> Option<Rebalance> {
    let mut settings = Rebalance::default();
    if let Some(tolerance) = raw.rebalance_tolerance {
        let field = field_name("rebalance-tolerance", "--rebalance-tolerance");
        if (0.01..=10.0).contains(&tolerance) {
            settings.tolerance_permille = (tolerance * 1000.0).round() as u32;
        } else {
            errors.push(field_error(
                field,
                format!("{tolerance} is out of range 0.01..=10"),
            ));
        }
    }
    if let Some(text) = &raw.rebalance_after {
        let field = field_name("rebalance-after", "--rebalance-after");
        if let Some(after) = parse_positive_duration(text, &field, errors) {
            settings.after = after;
        }
    }
    if let Some(rate) = raw.rebalance_rate {
        let field = field_name("rebalance-rate", "--rebalance-rate");
        match u32::try_from(rate) {
            Ok(rate) if (1..=1000).contains(&rate) => settings.rate = rate,
            _ => errors.push(field_error(
                field,
                format!("{rate} is out of range 1..=1000"),
            )),
        }
    }
    if raw.rebalance == Some(true) {
        return Some(settings);
    }
    let given = [
        (
            "rebalance-tolerance",
            "--rebalance-tolerance",
            raw.rebalance_tolerance.is_some(),
        ),
        (
            "rebalance-after",
            "--rebalance-after",
            raw.rebalance_after.is_some(),
        ),
        (
            "rebalance-rate",
            "--rebalance-rate",
            raw.rebalance_rate.is_some(),
        ),
    ];
    for (toml, flag, set) in given {
        if set {
            errors.push(field_error(
                field_name(toml, flag),
                "only applies with rebalance = true (--rebalance)",
            ));
        }
    }
    None
}

/// The rules of a file's backends, for a service whose backends discovery
/// gave: address families, table sizes, and no VIP as a backend.
pub(super) fn check_discovered(index: usize, service: &Service, errors: &mut Vec<FieldError>) {
    let vip_field = format!("service[{index}].vips");
    let backend_field = format!("service[{index}].backends (as discovered)");
    let indexed: Vec<(usize, Backend)> = service.backends.iter().cloned().enumerate().collect();
    let addrs: Vec<SocketAddr> = service
        .backends
        .iter()
        .map(|backend| backend.addr)
        .collect();
    report_duplicates(&addrs, &backend_field, "backend", errors);
    let fields = FamilyFields {
        vip: &vip_field,
        backend: &backend_field,
        discovered: false,
    };
    check_families(&service.vips, &indexed, &fields, errors);
    for vip in &service.vips {
        if addrs.contains(vip) {
            errors.push(field_error(
                &backend_field,
                format!("{vip} is also a VIP of the service; it would loop"),
            ));
        }
    }
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

fn report_duplicates(addrs: &[SocketAddr], field: &str, what: &str, errors: &mut Vec<FieldError>) {
    let mut seen = HashSet::new();
    for addr in addrs {
        if !seen.insert(addr) {
            errors.push(field_error(field, format!("{what} {addr} is listed twice")));
        }
    }
}

/// A VIP can only be served by backends of its own family (an IPv4 socket
/// cannot reach an IPv6 address), so each VIP family needs such backends,
/// and a backend of a family without a VIP would never be used. Each
/// family's weights must fit one selection list.
struct FamilyFields<'a> {
    vip: &'a str,
    backend: &'a str,
    /// Backends also come from discovery: a family may have none listed.
    discovered: bool,
}

fn check_families(
    vips: &[SocketAddr],
    backends: &[(usize, Backend)],
    fields: &FamilyFields,
    errors: &mut Vec<FieldError>,
) {
    let (vip_field, backend_field) = (fields.vip, fields.backend);
    for (is_v4, family) in [(true, "IPv4"), (false, "IPv6")] {
        let has_vip = vips.iter().any(|vip| vip.is_ipv4() == is_v4);
        let members: Vec<&(usize, Backend)> = backends
            .iter()
            .filter(|(_, backend)| backend.addr.is_ipv4() == is_v4)
            .collect();
        if has_vip && members.is_empty() && !fields.discovered {
            errors.push(field_error(
                vip_field,
                format!("an {family} VIP needs at least one {family} backend"),
            ));
        }
        if !has_vip && !vips.is_empty() {
            for (index, backend) in &members {
                errors.push(field_error(
                    format!("{backend_field}[{index}]"),
                    format!(
                        "{} is {family} but the service has no {family} VIP, so it would never be used",
                        backend.addr
                    ),
                ));
            }
            continue;
        }
        if members.len() > SLOTS_PER_LIST as usize {
            errors.push(field_error(
                backend_field,
                format!(
                    "{} {family} backends; at most {SLOTS_PER_LIST} per family",
                    members.len()
                ),
            ));
            continue;
        }
        let weights: Vec<u32> = members.iter().map(|(_, backend)| backend.weight).collect();
        let slots = slots_needed(&weights);
        if slots > SLOTS_PER_LIST as usize {
            errors.push(field_error(
                backend_field,
                format!(
                    "the {family} weights need {slots} table slots (each weight divided by their greatest common divisor); a table holds {SLOTS_PER_LIST}: lower the weights or use fewer backends"
                ),
            ));
        }
    }
}

/// The greatest common divisor of the weights (at least 1): dividing by it
/// keeps the ratios and uses the fewest slots.
pub fn weight_divisor(weights: &[u32]) -> u32 {
    weights
        .iter()
        .fold(0, |acc, &weight| gcd(acc, weight))
        .max(1)
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Slots a list of weights takes in a selection list: each weight divided
/// by the greatest common divisor of all (the planner's expansion).
pub fn slots_needed(weights: &[u32]) -> usize {
    let divisor = weight_divisor(weights);
    weights
        .iter()
        .map(|&weight| (weight / divisor) as usize)
        .sum()
}

/// What services share: names, VIPs, and the kernel maps' sizes. A backend
/// that is some service's VIP would redirect again (a → b → a). `services`
/// holds each valid service with its index in the file.
pub(super) fn check_across_services(
    services: &[(usize, Service)],
    root: &str,
    errors: &mut Vec<FieldError>,
) {
    let prefix = |index: usize| {
        if root == "flags" {
            String::new()
        } else {
            format!("{root}[{index}].")
        }
    };
    let mut vip_owner = HashMap::new();
    let mut names = HashSet::new();
    for (index, service) in services {
        if !names.insert(service.name.as_str()) {
            errors.push(field_error(
                format!("{}name", prefix(*index)),
                format!("service name {:?} is used twice", service.name),
            ));
        }
        for vip in &service.vips {
            if let Some(other) = vip_owner.insert(*vip, service.name.as_str()) {
                errors.push(field_error(
                    format!("{}vips", prefix(*index)),
                    format!("VIP {vip} is also used by service {other:?}"),
                ));
            }
        }
    }
    for (index, service) in services {
        for (backend_index, backend) in service.backends.iter().enumerate() {
            match vip_owner.get(&backend.addr) {
                Some(owner) if *owner != service.name => errors.push(field_error(
                    format!("{}backends[{backend_index}]", prefix(*index)),
                    format!(
                        "{} is a VIP of service {owner:?}; a backend that is a VIP would be redirected again",
                        backend.addr
                    ),
                )),
                _ => {}
            }
        }
    }
    let tables: usize = services
        .iter()
        .map(|(_, service)| table_count(service))
        .sum();
    let backends: usize = services
        .iter()
        .map(|(_, service)| service.backends.len())
        .sum();
    let vips: usize = services.iter().map(|(_, service)| service.vips.len()).sum();
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
