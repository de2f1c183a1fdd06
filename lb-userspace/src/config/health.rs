//! Validation of the health settings and the probe they describe.

use super::{
    FieldError, HealthSettings, PRESETS, RawHealth, field_error,
    values::{count_in_range, parse_positive_duration, parse_statuses},
};
use crate::health::probe::{ProbeSpec, Prober, TlsOptions};

pub(super) fn validate_health(
    raw: &RawHealth,
    prefix: &str,
    errors: &mut Vec<FieldError>,
) -> HealthSettings {
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

/// What the probe kind (`tcp`, `https:/path`, a preset…) asks for.
struct Kind<'a> {
    word: &'a str,
    /// The path given with the kind (`http:/healthz`).
    path: Option<String>,
    http: bool,
    tls: bool,
    /// A preset's path.
    preset_path: Option<&'static str>,
    needs_client_cert: bool,
}

/// Parses the probe kind; `None` (said) when it is unknown or takes no
/// path.
fn parse_kind<'a>(
    kind_text: &'a str,
    kind_field: &str,
    errors: &mut Vec<FieldError>,
) -> Option<Kind<'a>> {
    let (word, path) = match kind_text.split_once(':') {
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
                    kind_field,
                    format!(
                        "unknown probe {kind_text:?}; expected tcp, tls, http[:PATH], https[:PATH], apiserver, supervisor or etcd"
                    ),
                ));
                return None;
            }
        },
    };
    if path.is_some() && !http {
        errors.push(field_error(
            kind_field,
            format!("{word} probes take no path"),
        ));
        return None;
    }
    Some(Kind {
        word,
        path,
        http,
        tls,
        preset_path,
        needs_client_cert,
    })
}

/// A setting: whether it was given, its TOML name and its flag.
type Setting<'a> = (bool, &'a str, &'a str);

/// The settings that only some kinds take, given to another kind.
fn check_inapplicable(
    raw: &RawHealth,
    kind: &Kind<'_>,
    name: &dyn Fn(&str, &str) -> String,
    errors: &mut Vec<FieldError>,
) {
    let http_only = [
        (raw.path.is_some(), "path", "--health"),
        (raw.statuses.is_some(), "statuses", "--health-status"),
        (raw.host.is_some(), "host", "--health-host"),
    ];
    let tls_only = [
        (raw.ca.is_some(), "ca", "--health-ca"),
        (raw.cert.is_some(), "cert", "--health-cert"),
        (raw.key.is_some(), "key", "--health-key"),
        (
            raw.server_name.is_some(),
            "server-name",
            "--health-server-name",
        ),
    ];
    let groups: [(bool, &[Setting], &str); 2] = [
        (kind.http, &http_only, "http and https"),
        (kind.tls, &tls_only, "tls and https"),
    ];
    for (applies, settings, kinds) in groups {
        if applies {
            continue;
        }
        for (given, toml, flag) in settings {
            if *given {
                errors.push(field_error(
                    name(toml, flag),
                    format!("only applies to {kinds} probes, not {}", kind.word),
                ));
            }
        }
    }
    if kind.needs_client_cert && (raw.cert.is_none() || raw.key.is_none()) {
        errors.push(field_error(
            name("cert", "--health-cert"),
            "the etcd probe needs a client certificate and key (cert and key)",
        ));
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
    let kind = parse_kind(raw.kind.as_deref().unwrap_or("tcp"), &kind_field, errors)?;
    let before = errors.len();
    check_inapplicable(raw, &kind, name, errors);
    let path = raw
        .path
        .clone()
        .or(kind.path.clone())
        .or(kind.preset_path.map(str::to_string))
        .unwrap_or_else(|| "/".into());
    if kind.http && !path.starts_with('/') {
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
    let tls_options = kind.tls.then(|| TlsOptions {
        ca: raw.ca.clone(),
        cert: raw.cert.clone(),
        key: raw.key.clone(),
        server_name: raw.server_name.clone(),
    });
    let spec = match (kind.http, tls_options) {
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
