//! Parsing of single values: addresses, backends, statuses, counts and
//! durations.

use std::{net::SocketAddr, time::Duration};

use super::{Backend, BackendRole, FieldError, MAX_WEIGHT, RawBackend, RawStatuses, field_error};

/// Parses `ADDR:PORT` (IPv6 as `[ADDR]:PORT`).
pub(super) fn parse_endpoint(
    text: &str,
    field: &str,
    errors: &mut Vec<FieldError>,
) -> Option<SocketAddr> {
    // The kernel's sock_addr context carries no zone, so a zone would be
    // dropped on the way in and two VIPs could collide; refuse it.
    if text.contains('%') {
        errors.push(field_error(
            field,
            format!("{text:?}: IPv6 zone ids (%ZONE) are not supported; write [ADDR]:PORT"),
        ));
        return None;
    }
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
        && v6.scope_id() != 0
    {
        errors.push(field_error(
            field,
            format!("{text:?}: IPv6 zone ids are not supported; write [ADDR]:PORT"),
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
pub(super) fn parse_backend(
    raw: &RawBackend,
    field: &str,
    errors: &mut Vec<FieldError>,
) -> Option<Backend> {
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

pub(super) fn parse_statuses(
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

pub(super) fn count_in_range(
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

pub(super) fn parse_positive_duration(
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
                format!("{text:?} is not a duration; write it as 500ms, 2s, 1m or 1h"),
            ));
            None
        }
    }
}

/// Parses `"250ms"`, `"2s"`, `"1.5s"`, `"1m"` or `"1h"`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let (number, unit_ms) = if let Some(number) = text.strip_suffix("ms") {
        (number, 1.0)
    } else if let Some(number) = text.strip_suffix('s') {
        (number, 1000.0)
    } else if let Some(number) = text.strip_suffix('m') {
        (number, 60_000.0)
    } else if let Some(number) = text.strip_suffix('h') {
        (number, 3_600_000.0)
    } else {
        return None;
    };
    let value: f64 = number.trim().parse().ok()?;
    // try_from: a huge value such as 1e20s is "not a duration", not a panic.
    Duration::try_from_secs_f64(value * unit_ms / 1000.0).ok()
}
