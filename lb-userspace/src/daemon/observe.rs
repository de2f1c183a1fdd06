//! Observability's owner in the daemon: the metrics, the counters only the
//! daemon keeps, and what `socklb status` learns from the daemon itself.

use std::{collections::BTreeMap, net::SocketAddr};

use super::{metrics::Metrics, sources::Sources, state::Owner};
use crate::protocol::{DaemonInfo, FleetInfo, ServiceSourcesInfo};

pub struct Observer {
    pub metrics: Metrics,
    /// Connections closed to rebalance, by service.
    rebalance_moves: BTreeMap<String, u64>,
}

impl Observer {
    pub fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            rebalance_moves: BTreeMap::new(),
        }
    }

    /// Connections closed on `backend` to rebalance `service`.
    pub fn rebalanced(&mut self, service: &str, backend: SocketAddr, count: usize) {
        *self.rebalance_moves.entry(service.to_string()).or_default() += count as u64;
        self.metrics.rebalanced(service, backend, count);
    }

    /// What the daemon tells `socklb status` of itself.
    pub fn info(&self, owner: &Owner, sources: &Sources, generation: u64) -> DaemonInfo {
        DaemonInfo {
            fleet: self.fleet(owner),
            config_generation: generation,
            last_reload: sources.last_reload.clone(),
            services: sources
                .by_service
                .iter()
                .map(|(name, sources)| {
                    let effective = sources.effective();
                    ServiceSourcesInfo {
                        service: name.clone(),
                        following: effective.map(|(source, _)| source.as_str().to_string()),
                        backends: effective.map_or(0, |(_, set)| set.len()),
                        sources: sources
                            .states()
                            .into_iter()
                            .map(|(source, state)| (source.as_str().to_string(), state))
                            .collect(),
                    }
                })
                .collect(),
        }
    }

    /// Slow starts and rebalancing moves, per service that has either.
    fn fleet(&self, owner: &Owner) -> Vec<FleetInfo> {
        let mut fleet: BTreeMap<String, FleetInfo> = BTreeMap::new();
        for (table, backend) in owner.layout().backends() {
            if table.slow_start.is_none() && table.rebalance.is_none() {
                continue;
            }
            let entry = fleet
                .entry(table.service.clone())
                .or_insert_with(|| FleetInfo {
                    service: table.service.clone(),
                    ramping: Vec::new(),
                    rebalance_moves: self
                        .rebalance_moves
                        .get(&table.service)
                        .copied()
                        .unwrap_or(0),
                });
            if let Some(step) = owner.ramp_step(backend.id) {
                entry.ramping.push((backend.addr.to_string(), step));
            }
        }
        fleet.into_values().collect()
    }
}
