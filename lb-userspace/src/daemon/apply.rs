//! Applying an effective configuration: one path for the start and for
//! every change (a reloaded file, a new backend set from discovery).
//!
//! 1. [`check`]: the effective configuration (the configuration with each
//!    service's backends replaced by discovery's) is checked as a whole,
//!    laid out, and refused if another socklb on a related cgroup serves
//!    one of its VIPs;
//! 2. [`lay_out`]: the ids of the pinned records are kept (so that counters
//!    stay true across restarts and edits), busy ids are never given to
//!    another backend, and `when-daemon-gone = "auto"` is decided by what
//!    listens on the VIPs then (so at start, at each reload, and at each
//!    change of backends).
//!
//! At start the first step runs before anything is installed and the
//! second once the maps are open; on a change both run against the maps in
//! force, and nothing changes when either refuses.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
};

use tracing::{info, warn};

use crate::{
    config::{self, Config, ConfigError, WhenDaemonGone},
    convert::endpoint,
    dataplane::{CgroupTarget, MapStore, PinPaths, StoreError, shadow},
    discovery::{self, ServiceSources},
    hand_back,
    planner::Layout,
    sockets::Listening,
};

/// Why an effective configuration cannot be applied. Nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("the configuration does not fit")]
    Invalid(#[source] ConfigError),
    #[error("{}; whichever attached first would take every connect to it. Use another VIP, or --allow-overlap", list(.0))]
    Overlap(Vec<shadow::OtherInstall>),
    #[error("looking for other socklb installs")]
    Search(#[source] std::io::Error),
    #[error("reading the pinned ids")]
    PinnedIds(#[source] StoreError),
}

fn list(others: &[shadow::OtherInstall]) -> String {
    others
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Where this install attaches, for the search for overlapping installs.
pub struct Checks<'a> {
    pub paths: &'a PinPaths,
    pub cgroup: &'a CgroupTarget,
    /// Skip the search (`--allow-overlap`).
    pub allow_overlap: bool,
}

/// An effective configuration that passed [`check`].
#[derive(Debug)]
pub struct Checked {
    pub effective: Config,
    /// Services no source has given a backend yet.
    pub waiting: Vec<String>,
}

/// Step 1: the effective configuration of `config` and `sources`, checked,
/// and whether it differs from the one `in_force` (an unchanged one is not
/// checked again). Another install is looked for at start, and again only
/// when the VIPs change.
pub fn check(
    config: &Config,
    sources: &BTreeMap<String, ServiceSources>,
    in_force: Option<&Config>,
    checks: &Checks<'_>,
) -> Result<(Checked, bool), ApplyError> {
    let (effective, waiting) = discovery::effective_config(config, sources);
    let changed = in_force != Some(&effective);
    if changed {
        config::check_effective(&effective).map_err(ApplyError::Invalid)?;
        let vips_changed = in_force.is_none_or(|in_force| vips(in_force) != vips(&effective));
        if !checks.allow_overlap && vips_changed {
            let layout = Layout::from_config(&effective, is_local_address);
            refuse_overlap(checks, &layout)?;
        }
    }
    Ok((Checked { effective, waiting }, changed))
}

/// Step 2: the layout of a checked configuration, keeping the pinned ids,
/// with `when-daemon-gone = "auto"` decided by what listens on the VIPs
/// now.
pub fn lay_out(checked: &Checked, store: &dyn MapStore) -> Result<Layout, StoreError> {
    let known = super::state::known_ids(store)?;
    Ok(Layout::keeping(
        &checked.effective,
        is_local_address,
        &known,
        &listeners_on_auto_vips(&checked.effective),
    ))
}

/// The sockets other than the daemon's own that listen on the VIPs of the
/// services with `when-daemon-gone = "auto"`. One that cannot be looked
/// for counts as none (keep: socklb goes on redirecting), said in the log.
fn listeners_on_auto_vips(config: &Config) -> Vec<Listening> {
    let vips: Vec<SocketAddr> = config
        .services
        .iter()
        .filter(|service| service.when_daemon_gone == WhenDaemonGone::Auto)
        .flat_map(|service| service.vips.iter().copied())
        .collect();
    hand_back::listeners(&vips, Some(std::process::id())).unwrap_or_else(|error| {
        warn!(
            "looking for listeners on the VIPs (when-daemon-gone = auto) failed; deciding as if none: {error}"
        );
        Vec::new()
    })
}

/// Says, once per service, what its VIPs do when the daemon is gone, where
/// that differs from `before` (every service at start). Returns whether
/// any differs.
pub fn announce_hand_back(before: Option<&Layout>, after: &Layout) -> bool {
    let mut changed = false;
    let mut said = BTreeSet::new();
    for table in &after.tables {
        if !said.insert(table.service.as_str()) {
            continue;
        }
        let was = before.and_then(|before| {
            before
                .tables
                .iter()
                .find(|old| old.service == table.service)
                .map(|old| &old.hand_back)
        });
        if was == Some(&table.hand_back) {
            continue;
        }
        changed = true;
        info!(
            "{}: when the daemon is gone: {}{}",
            table.service,
            table.hand_back,
            was.map_or(String::new(), |was| format!(" (was {was})"))
        );
    }
    changed
}

fn vips(config: &Config) -> BTreeSet<SocketAddr> {
    config
        .services
        .iter()
        .flat_map(|service| service.vips.iter().copied())
        .collect()
}

/// Whether an address belongs to this host: only a local address can be
/// bound. (All of 127.0.0.0/8 counts, as the kernel routes it locally.)
pub fn is_local_address(ip: std::net::IpAddr) -> bool {
    std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// Refuses to install when another socklb on this cgroup, an ancestor or a
/// descendant serves one of our VIPs: whichever attached first would take
/// every connect, and the other would show healthy backends with no
/// redirects.
fn refuse_overlap(checks: &Checks<'_>, layout: &Layout) -> Result<(), ApplyError> {
    let vips: Vec<lb_common::Endpoint> = layout
        .tables
        .iter()
        .flat_map(|table| table.vips.iter().map(endpoint))
        .collect();
    let (others, search) =
        shadow::overlapping(checks.paths, checks.cgroup, &vips).map_err(ApplyError::Search)?;
    if search == shadow::Search::PinnedLinks {
        info!(
            "without CAP_SYS_ADMIN, other socklb installs are looked for through their pins under /sys/fs/bpf only"
        );
    }
    if others.is_empty() {
        Ok(())
    } else {
        Err(ApplyError::Overlap(others))
    }
}
