//! What the running daemon tells its clients over the control socket
//! (`daemon::control`), and `socklb status` shows: what only the daemon
//! knows, beside what the kernel says.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// What `socklb status` shows from the running daemon itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonInfo {
    pub config_generation: u64,
    /// The last reload (SIGHUP or a changed file), if any.
    pub last_reload: Option<ReloadStatus>,
    /// Where each service's backends come from.
    pub services: Vec<ServiceSourcesInfo>,
    /// Slow starts and rebalancing, per service that has either.
    #[serde(default)]
    pub fleet: Vec<FleetInfo>,
}

/// A service's slow starts in progress and rebalancing moves so far.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetInfo {
    pub service: String,
    /// Backends in slow start, with their step (of 10).
    pub ramping: Vec<(String, u32)>,
    /// Connections closed to rebalance, since the daemon started.
    pub rebalance_moves: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceSourcesInfo {
    pub service: String,
    /// The source the table follows ("endpointslices", "k3s-state",
    /// "persisted", "static"), or none yet.
    pub following: Option<String>,
    pub backends: usize,
    /// Each dynamic source and what it last said.
    pub sources: Vec<(String, String)>,
}

/// The result of the last reload, for `socklb status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadStatus {
    pub ok: bool,
    /// Seconds since the epoch.
    pub at: u64,
    /// "applied (generation 3)", "unchanged", or the errors.
    pub message: String,
}

impl ReloadStatus {
    pub fn now(ok: bool, message: String) -> Self {
        let at = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs());
        Self { ok, at, message }
    }
}
