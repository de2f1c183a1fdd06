//! close-on-failure moves connections only to somewhere better.
//!
//! When a backend goes down, its connections are closed (so that the
//! clients reconnect through the VIP) only if another backend of its table
//! is healthy and passed its last probe. Otherwise:
//! - while another backend is still healthy but failing its probes too, the
//!   close waits: each tick looks again, and closes as soon as a healthy
//!   backend passes (a passing hiccup of the others);
//! - once no backend of the table is healthy (every server slow, say), the
//!   connections stay where they are, whatever the table does with new
//!   connects (fail open or reject): closing them would only send the whole
//!   herd to reconnect to servers no better than the one it is on. This is
//!   said once and counted, and when health comes back nothing is closed:
//!   the connections carry on where they are.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
};

use super::Owner;
use crate::{health::HealthTracker, planner::Layout};

/// What to do with the connections of a backend that went down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseVerdict {
    /// Close them: another backend is healthy and passed its last probe.
    Close,
    /// Not yet: the other healthy backends are failing their probes too.
    /// [`Owner::released_closes`] decides again on each tick.
    Wait,
    /// Keep them where they are: no backend of the table is healthy.
    /// `first`: the table has just lost its last one (say so, once).
    Keep { first: bool },
}

/// What becomes of the connections of a backend that left the
/// configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Departure {
    /// Closed: a backend of its service is healthy.
    Close,
    /// Left alone: its service does not close on failure.
    Stay,
    /// Left alone: no backend of its service is healthy to take them.
    NoneHealthy,
}

/// What the table of a backend holds besides it.
enum Others {
    /// A healthy backend that passed its last probe.
    Better,
    /// Healthy ones, all failing their probes.
    Failing,
    None,
}

impl Owner {
    /// Whether a backend can take connections now: healthy, not draining.
    fn takes_connections(&self, id: u32) -> bool {
        self.is_healthy(id) && !self.draining.contains(&id)
    }

    fn others(&self, id: u32) -> Others {
        let Some((table, _)) = self.backend(id) else {
            return Others::None;
        };
        let mut others = table
            .backends
            .iter()
            .filter(|backend| backend.id != id && self.takes_connections(backend.id));
        let mut any = false;
        for backend in others.by_ref() {
            any = true;
            let failing = self
                .trackers
                .get(&backend.id)
                .is_some_and(HealthTracker::is_failing);
            if !failing {
                return Others::Better;
            }
        }
        if any { Others::Failing } else { Others::None }
    }

    /// A backend of a close-on-failure table went down: whether its
    /// connections are closed now.
    pub fn after_down(&mut self, id: u32) -> CloseVerdict {
        match self.others(id) {
            Others::Better => CloseVerdict::Close,
            Others::Failing => {
                self.held.insert(id);
                CloseVerdict::Wait
            }
            Others::None => CloseVerdict::Keep {
                first: self.keep_table_of(id),
            },
        }
    }

    /// Marks the table of `id` as kept; forgets its held closes. Returns
    /// whether it was not kept before.
    fn keep_table_of(&mut self, id: u32) -> bool {
        let Some((table, _)) = self.backend(id) else {
            return false;
        };
        let (table_id, members): (u32, HashSet<u32>) = (
            table.table_id,
            table.backends.iter().map(|backend| backend.id).collect(),
        );
        self.held.retain(|held| !members.contains(held));
        self.kept.insert(table_id)
    }

    /// A backend became healthy: its table, if it was kept, recovers
    /// quietly (nothing is closed). Returns the table's service when it
    /// was kept.
    pub fn after_up(&mut self, id: u32) -> Option<String> {
        self.held.remove(&id);
        let (table_id, service) = self
            .backend(id)
            .map(|(table, _)| (table.table_id, table.service.clone()))?;
        self.kept.remove(&table_id).then_some(service)
    }

    /// The held closes that can happen now (a better place appeared), by
    /// backend; forgets those that are moot (the backend is back, or its
    /// table lost every healthy backend: those connections stay).
    pub fn released_closes(&mut self) -> Vec<(u32, SocketAddr)> {
        let mut released = Vec::new();
        let held: Vec<u32> = self.held.iter().copied().collect();
        for id in held {
            let Some(addr) = self.backend(id).map(|(_, backend)| backend.addr) else {
                self.held.remove(&id);
                continue;
            };
            if self.is_healthy(id) {
                self.held.remove(&id);
                continue;
            }
            match self.others(id) {
                Others::Better => {
                    self.held.remove(&id);
                    released.push((id, addr));
                }
                Others::Failing => {}
                Others::None => {
                    self.keep_table_of(id);
                }
            }
        }
        released
    }
}

/// What becomes of the connections of a backend of `service` that left,
/// given the new layout and health.
pub(super) fn departure(
    layout: &Layout,
    trackers: &HashMap<u32, HealthTracker>,
    service: &str,
    close_on_failure: bool,
) -> Departure {
    if !close_on_failure {
        return Departure::Stay;
    }
    let healthy = layout
        .backends()
        .filter(|(table, backend)| table.service == service && !backend.drain)
        .any(|(_, backend)| {
            trackers
                .get(&backend.id)
                .is_some_and(HealthTracker::is_healthy)
        });
    if healthy {
        Departure::Close
    } else {
        Departure::NoneHealthy
    }
}
