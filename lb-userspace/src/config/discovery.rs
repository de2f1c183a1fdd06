//! The discovery fields of a service: where its backends come from besides
//! its static list, who may write them, and how many it may take.
//!
//! `endpointslices` follows the EndpointSlices labelled
//! `kubernetes.io/service-name=SERVICE` in NAMESPACE. Anyone who may write
//! EndpointSlices there can label a slice so; only the slices of the
//! Service's own manager count (`endpointslice-managers`). The values are
//! those Kubernetes writes into `endpointslice.kubernetes.io/managed-by`
//! (`discovery.LabelManagedBy`, staging/src/k8s.io/api/discovery/v1/
//! well_known_labels.go):
//! - `default/kubernetes` is written by the apiserver's own endpoint
//!   reconciler (pkg/controlplane/reconcilers/endpointsadapter.go,
//!   `endpointSliceFromEndpoints`): one slice named after the Service,
//!   whose labels are exactly `kubernetes.io/service-name: kubernetes`, with
//!   no managed-by label at all. [`SliceManager::Apiserver`] (`@apiserver`)
//!   stands for that: no managed-by label, and the Service's name.
//! - A Service with a selector gets its slices from the EndpointSlice
//!   controller, `endpointslice-controller.k8s.io`
//!   (pkg/controller/endpointslice/endpointslice_controller.go,
//!   `controllerQualifiedName`; staging/src/k8s.io/endpointslice builds
//!   them with that label).
//! - A Service without a selector whose Endpoints are written by hand gets
//!   slices mirrored by `endpointslicemirroring-controller.k8s.io`
//!   (pkg/controller/endpointslicemirroring, `controllerName`); name it in
//!   `endpointslice-managers` for such a Service.
//!
//! A label proves nothing by itself: it is text any writer sets. What a
//! manager's label buys is that the manager reconciles the slices that
//! carry it, so a forgery with its label is short-lived, and one with
//! another label (or none, under another name) is ignored by socklb.

use std::path::PathBuf;

use lb_common::{MAX_BACKENDS, SLOTS_PER_LIST};

use super::{FieldError, RawService, Service, field_error, raw::RawNames};

/// `managed-by` of the slices that the EndpointSlice controller writes.
pub const ENDPOINTSLICE_CONTROLLER: &str = "endpointslice-controller.k8s.io";
/// `managed-by` of the slices that the EndpointSliceMirroring controller
/// writes for a Service without a selector.
pub const ENDPOINTSLICE_MIRRORING_CONTROLLER: &str = "endpointslicemirroring-controller.k8s.io";
/// Discovered backends a service takes at most, unless told otherwise.
pub const DEFAULT_MAX_DISCOVERED_BACKENDS: usize = 64;

/// Where a service learns its backends besides its static list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovery {
    /// A k3s/rke2 agent load-balancer state file (JSON), followed.
    pub k3s_state: Option<PathBuf>,
    /// The EndpointSlices of a Kubernetes Service, watched.
    pub endpoint_slices: Option<SliceSource>,
    /// Most backends a dynamic source may give the service: a larger set
    /// is refused, and the last known one stays.
    pub max_backends: usize,
}

impl Default for Discovery {
    fn default() -> Self {
        Self {
            k3s_state: None,
            endpoint_slices: None,
            max_backends: DEFAULT_MAX_DISCOVERED_BACKENDS,
        }
    }
}

impl Discovery {
    pub fn is_dynamic(&self) -> bool {
        self.k3s_state.is_some() || self.endpoint_slices.is_some()
    }
}

/// Who writes the EndpointSlices that count.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum SliceManager {
    /// The apiserver's own endpoint reconciler: a slice with no
    /// `managed-by` label whose name is the Service's (`@apiserver`).
    Apiserver,
    /// Slices whose `managed-by` label has this value.
    Label(String),
}

impl SliceManager {
    /// How [`SliceManager::Apiserver`] is written: not a label value (a
    /// label value has no `@`), so it never stands for one.
    pub const APISERVER: &'static str = "@apiserver";

    fn parse(text: &str) -> Option<Self> {
        if text == Self::APISERVER {
            return Some(Self::Apiserver);
        }
        is_label_value(text).then(|| Self::Label(text.to_string()))
    }

    /// The managers of a Service's slices when none are configured.
    pub fn defaults_for(namespace: &str, service: &str) -> Vec<Self> {
        if (namespace, service) == ("default", "kubernetes") {
            vec![Self::Apiserver]
        } else {
            vec![Self::Label(ENDPOINTSLICE_CONTROLLER.to_string())]
        }
    }
}

impl std::fmt::Display for SliceManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Apiserver => f.write_str(Self::APISERVER),
            Self::Label(value) => f.write_str(value),
        }
    }
}

/// The EndpointSlices to watch: those labelled
/// `kubernetes.io/service-name=SERVICE` in NAMESPACE, port PORT, written by
/// one of `managers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceSource {
    pub namespace: String,
    pub service: String,
    /// The port's name in the slices (`https` for `default/kubernetes`).
    pub port: String,
    /// None: inferred as kubectl does ($KUBECONFIG, ~/.kube/config,
    /// in-cluster).
    pub kubeconfig: Option<PathBuf>,
    /// The managers whose slices count; any other slice is refused.
    pub managers: Vec<SliceManager>,
    /// Most backends the slices together may give (`max-discovered-backends`).
    pub max_backends: usize,
}

/// A Kubernetes DNS label: lowercase letters, digits and '-', not at
/// either end, at most `max` long.
pub(super) fn is_dns_label(text: &str, max: usize) -> bool {
    !text.is_empty()
        && text.len() <= max
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !text.starts_with('-')
        && !text.ends_with('-')
}

/// A Kubernetes label value that is not empty: at most 63 letters, digits,
/// '-', '_' and '.', beginning and ending with a letter or digit.
fn is_label_value(text: &str) -> bool {
    let alphanumeric_ends = text.starts_with(|c: char| c.is_ascii_alphanumeric())
        && text.ends_with(|c: char| c.is_ascii_alphanumeric());
    text.len() <= 63
        && alphanumeric_ends
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The name of a field: `--FLAG` for a service given by flags, else
/// `service[N].TOML`.
fn field_of(prefix: &str, toml: &str) -> String {
    if prefix.is_empty() {
        format!("--{toml}")
    } else {
        format!("{prefix}{toml}")
    }
}

/// `k3s-state`, `endpointslices`, `endpointslice-port`, `kubeconfig`,
/// `endpointslice-managers` and `max-discovered-backends`.
pub(super) fn validate_discovery(
    raw: &RawService,
    prefix: &str,
    errors: &mut Vec<FieldError>,
) -> Discovery {
    let field = |toml: &str| field_of(prefix, toml);
    let k3s_state = raw.k3s_state.clone().filter(|path| {
        let ok = path.is_absolute();
        if !ok {
            errors.push(field_error(
                field("k3s-state"),
                format!("{} is not an absolute path", path.display()),
            ));
        }
        ok
    });
    let max_backends = validate_max_backends(raw, prefix, errors);
    let endpoint_slices = validate_slices(raw, prefix, max_backends, errors);
    let discovery = Discovery {
        k3s_state,
        endpoint_slices,
        max_backends,
    };
    if raw.max_discovered_backends.is_some() && !discovery.is_dynamic() {
        errors.push(field_error(
            field("max-discovered-backends"),
            "only applies with a discovery source (k3s-state, endpointslices)",
        ));
    }
    discovery
}

fn validate_max_backends(raw: &RawService, prefix: &str, errors: &mut Vec<FieldError>) -> usize {
    let Some(count) = raw.max_discovered_backends else {
        return DEFAULT_MAX_DISCOVERED_BACKENDS;
    };
    match usize::try_from(count) {
        Ok(count) if (1..=SLOTS_PER_LIST as usize).contains(&count) => count,
        _ => {
            errors.push(field_error(
                field_of(prefix, "max-discovered-backends"),
                format!(
                    "{count} is out of range 1..={SLOTS_PER_LIST} (the slots of one selection list)"
                ),
            ));
            DEFAULT_MAX_DISCOVERED_BACKENDS
        }
    }
}

/// `endpointslices` and the fields that only apply with it.
fn validate_slices(
    raw: &RawService,
    prefix: &str,
    max_backends: usize,
    errors: &mut Vec<FieldError>,
) -> Option<SliceSource> {
    let field = |toml: &str| field_of(prefix, toml);
    let port = raw.endpointslice_port.clone();
    if let Some(port) = &port
        && !is_dns_label(port, 15)
    {
        errors.push(field_error(
            field("endpointslice-port"),
            format!("{port:?} is not a port name (lowercase letters, digits and '-', at most 15)"),
        ));
    }
    let Some(text) = &raw.endpointslices else {
        for (given, name) in [
            (port.is_some(), "endpointslice-port"),
            (raw.kubeconfig.is_some(), "kubeconfig"),
            (
                raw.endpointslice_managers.is_some(),
                "endpointslice-managers",
            ),
        ] {
            if given {
                errors.push(field_error(field(name), "only applies with endpointslices"));
            }
        }
        return None;
    };
    let Some((namespace, service)) = text
        .split_once('/')
        .filter(|(namespace, service)| is_dns_label(namespace, 63) && is_dns_label(service, 63))
    else {
        errors.push(field_error(
            field("endpointslices"),
            format!(
                "{text:?} is not NAMESPACE/SERVICE (for example \"default/kubernetes\"; lowercase letters, digits and '-')"
            ),
        ));
        return None;
    };
    let managers = match &raw.endpointslice_managers {
        None => SliceManager::defaults_for(namespace, service),
        Some(names) => validate_managers(names, &field("endpointslice-managers"), errors),
    };
    Some(SliceSource {
        namespace: namespace.to_string(),
        service: service.to_string(),
        port: port.unwrap_or_else(|| "https".to_string()),
        kubeconfig: raw.kubeconfig.clone(),
        managers,
        max_backends,
    })
}

fn validate_managers(
    names: &RawNames,
    field: &str,
    errors: &mut Vec<FieldError>,
) -> Vec<SliceManager> {
    let names: Vec<String> = match names {
        RawNames::List(list) => list.clone(),
        RawNames::Text(text) => text
            .split(',')
            .map(|name| name.trim().to_string())
            .collect(),
    };
    if names.is_empty() || names.iter().all(String::is_empty) {
        errors.push(field_error(
            field,
            format!(
                "names no manager; give {} and/or endpointslice.kubernetes.io/managed-by values",
                SliceManager::APISERVER
            ),
        ));
        return Vec::new();
    }
    let mut managers = Vec::new();
    for (index, name) in names.iter().enumerate() {
        match SliceManager::parse(name) {
            Some(manager) if !managers.contains(&manager) => managers.push(manager),
            Some(_) => errors.push(field_error(
                format!("{field}[{index}]"),
                format!("{name:?} is listed twice"),
            )),
            None => errors.push(field_error(
                format!("{field}[{index}]"),
                format!(
                    "{name:?} is neither {} nor a label value (at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter or digit)",
                    SliceManager::APISERVER
                ),
            )),
        }
    }
    managers
}

/// The most backends all services together can be given must fit the
/// kernel's backend table, so that no discovered set can be refused for
/// it: a dynamic service counts its `max-discovered-backends`, a static
/// one its list.
pub(super) fn check_backend_budget(
    services: &[(usize, Service)],
    root: &str,
    errors: &mut Vec<FieldError>,
) {
    let budget: usize = services
        .iter()
        .map(|(_, service)| {
            if service.discovery.is_dynamic() {
                service.discovery.max_backends.max(service.backends.len())
            } else {
                service.backends.len()
            }
        })
        .sum();
    if budget > MAX_BACKENDS as usize {
        errors.push(field_error(
            root,
            format!(
                "the services may be given {budget} backends in all (max-discovered-backends of each service with discovery, the static lists of the others); at most {MAX_BACKENDS}"
            ),
        ));
    }
}
