//! `socklb status`: what the pinned maps say, readable with or without a
//! running daemon.

use std::{collections::BTreeMap, fmt};

use lb_common::{
    ROLE_PREFERRED, ROLE_STANDBY, SERVICE_FLAG_ALL_NETNS, SERVICE_FLAG_LEAST_CONN,
    SERVICE_FLAG_PREFER_LOCAL, SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY,
};
use serde::Serialize;

use crate::{
    kernel::{Dataplane, table_name},
    planner::socket_addr,
};

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct StatusReport {
    pub services: Vec<ServiceStatus>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct ServiceStatus {
    pub name: String,
    pub vips: Vec<String>,
    /// Selection policy: "random" or "prefer-local".
    pub policy: String,
    /// "fail-open" or "reject".
    pub when_none_healthy: String,
    pub all_netns: bool,
    /// Connects that found no healthy backend.
    pub none_healthy: u64,
    /// Of those, connects refused by the reject policy.
    pub rejected: u64,
    pub backends: Vec<BackendStatus>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct BackendStatus {
    pub addr: String,
    pub healthy: bool,
    /// False while `healthy` is only assumed: no probe has answered yet.
    pub probed: bool,
    pub weight: u32,
    /// "normal", "preferred" or "standby".
    pub role: String,
    /// Takes no new connections (config `drain` or `socklb drain`).
    pub draining: bool,
    pub redirects: u64,
    /// Established connections open now (counted by sock_ops).
    pub live: i64,
    /// Connects that never established.
    pub failed_connects: u64,
    /// Whether the backend is in the table connects read now.
    pub in_table: bool,
}

/// Reads the report from the maps.
pub fn read(dataplane: &Dataplane) -> StatusReport {
    let mut services: BTreeMap<String, ServiceStatus> = BTreeMap::new();
    let mut table_service = BTreeMap::new();
    let mut tables = dataplane.table_records();
    tables.sort_by_key(|(id, _)| *id);
    for (table_id, info) in &tables {
        let name = table_name(info);
        let stats = dataplane.table_stats(*table_id);
        let service = services
            .entry(name.clone())
            .or_insert_with(|| ServiceStatus {
                name: name.clone(),
                vips: Vec::new(),
                policy: if info.flags & SERVICE_FLAG_PREFER_LOCAL != 0 {
                    "prefer-local".into()
                } else if info.flags & SERVICE_FLAG_LEAST_CONN != 0 {
                    "least-conn".into()
                } else {
                    "random".into()
                },
                when_none_healthy: if info.flags & SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY != 0 {
                    "reject".into()
                } else {
                    "fail-open".into()
                },
                all_netns: info.flags & SERVICE_FLAG_ALL_NETNS != 0,
                none_healthy: 0,
                rejected: 0,
                backends: Vec::new(),
            });
        service.none_healthy += stats.none_healthy;
        service.rejected += stats.rejected;
        table_service.insert(*table_id, name);
    }
    let entries = dataplane.service_entries();
    let mut vips: Vec<(u32, String)> = entries
        .iter()
        .filter_map(|(vip, entry)| Some((entry.table_id, socket_addr(vip)?.to_string())))
        .collect();
    vips.sort();
    for (table_id, vip) in vips {
        if let Some(service) = table_service
            .get(&table_id)
            .and_then(|name| services.get_mut(name))
        {
            service.vips.push(vip);
        }
    }
    let mut backends = dataplane.backend_records();
    backends.sort_by_key(|(id, _)| *id);
    for (backend_id, info) in backends {
        let Some(service) = table_service
            .get(&info.table_id)
            .and_then(|name| services.get_mut(name))
        else {
            continue;
        };
        let conns = dataplane.connections(backend_id);
        // What connects read now: the slots of the healthy list.
        let in_table = entries
            .iter()
            .find(|(_, entry)| entry.table_id == info.table_id)
            .is_some_and(|(_, entry)| dataplane.healthy_backend_ids(entry).contains(&backend_id));
        service.backends.push(BackendStatus {
            addr: socket_addr(&info.target).map_or_else(|| "?".into(), |addr| addr.to_string()),
            healthy: info.healthy != 0,
            probed: info.probed != 0,
            draining: info.draining != 0,
            role: match info.role {
                ROLE_PREFERRED => "preferred",
                ROLE_STANDBY => "standby",
                _ => "normal",
            }
            .into(),
            weight: info.weight,
            redirects: dataplane.redirects(backend_id),
            live: conns.live,
            failed_connects: conns.failed_connects,
            in_table,
        });
    }
    StatusReport {
        services: services.into_values().collect(),
    }
}

impl fmt::Display for StatusReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.services.is_empty() {
            return writeln!(f, "no services");
        }
        for service in &self.services {
            writeln!(
                f,
                "service {}  vips {}  policy {}  when-none-healthy {}{}  none-healthy {} rejected {}",
                service.name,
                service.vips.join(","),
                service.policy,
                service.when_none_healthy,
                if service.all_netns { "  all-netns" } else { "" },
                service.none_healthy,
                service.rejected
            )?;
            writeln!(
                f,
                "  {:<44} {:<9} {:>6} {:<9} {:>10} {:>6} {:>7}",
                "BACKEND", "HEALTH", "WEIGHT", "ROLE", "REDIRECTS", "LIVE", "FAILED"
            )?;
            for backend in &service.backends {
                let health = match (backend.draining, backend.probed, backend.healthy) {
                    (true, _, _) => "draining",
                    (false, false, _) => "unknown",
                    (false, true, true) => "healthy",
                    (false, true, false) => "unhealthy",
                };
                writeln!(
                    f,
                    "  {:<44} {:<9} {:>6} {:<9} {:>10} {:>6} {:>7}",
                    backend.addr,
                    health,
                    backend.weight,
                    backend.role,
                    backend.redirects,
                    backend.live,
                    backend.failed_connects
                )?;
            }
        }
        Ok(())
    }
}
