//! Validation of one service and of what services share.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
};

use crate::planner::weight_divisor;
use lb_common::{MAX_BACKENDS, MAX_TABLES, MAX_VIPS, NAME_LEN, SLOTS_PER_LIST};

use super::{
    Backend, BackendRole, FieldError, NoneHealthyPolicy, RawService, Rebalance, SelectionPolicy,
    Service,
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
    let discovery = validate_discovery(&raw, prefix, errors);
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
    let backends: Vec<Backend> = indexed.into_iter().map(|(_, backend)| backend).collect();
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
    let slow_start = raw.slow_start.as_deref().and_then(|text| {
        parse_positive_duration(text, &field_name("slow-start", "--slow-start"), errors)
    });
    let rebalance = validate_rebalance(&raw, &field_name, errors);
    let accelerate = match raw.accelerate.as_deref() {
        None | Some("none") => false,
        Some("sockmap") => true,
        Some(text) => {
            errors.push(field_error(
                field_name("accelerate", "--accelerate"),
                format!("unknown acceleration {text:?}; expected \"sockmap\" or \"none\""),
            ));
            false
        }
    };
    (errors.len() == before).then_some(Service {
        name,
        vips,
        backends,
        policy,
        when_none_healthy,
        all_netns: raw.all_netns,
        close_on_failure: raw.close_on_failure.unwrap_or(true),
        health,
        discovery,
        slow_start,
        rebalance,
        accelerate,
    })
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
