//! The single owner of the daemon's state: health of every backend, the
//! drains, and what was written to the maps. Every change goes through
//! here; the event loop only feeds it and acts on what it returns. It does
//! no I/O of its own besides the map store it is handed, so its decisions
//! are tested against [`crate::dataplane::MemoryMaps`].

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    net::SocketAddr,
    time::{Duration, Instant},
};

use lb_common::{BackendInfo, Endpoint, Settings};
use tracing::{info, warn};

use crate::{
    convert::{endpoint, socket_addr},
    dataplane::{BackendHealth, Desired, Drift, MapStore, StoreError, Writer, tables::table_name},
    errors,
    health::{HealthTracker, ProbeFailure, Transition},
    planner::{BackendLayout, KnownIds, Layout, RAMP_STEPS, TableLayout, plan_ramped},
};

/// The ids the pinned records give: what `Layout::keeping` keeps.
pub fn known_ids(store: &dyn MapStore) -> Result<KnownIds, StoreError> {
    let tables = store.tables()?;
    let service_of: HashMap<u32, String> = tables
        .iter()
        .map(|(id, info)| (*id, table_name(info)))
        .collect();
    let mut known = KnownIds {
        tables: tables
            .iter()
            .map(|(id, info)| ((table_name(info), info.family), *id))
            .collect(),
        ..KnownIds::default()
    };
    for (id, info) in store.backends()? {
        if let (Some(service), Some(addr)) =
            (service_of.get(&info.table_id), socket_addr(&info.target))
        {
            known.backends.insert((service.clone(), addr), id);
        }
        if store.connections(id)?.live > 0 {
            known.busy.insert(id);
        }
    }
    Ok(known)
}

/// What a drain request did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DrainOutcome {
    /// The backend takes no new connections from now on.
    Draining,
    /// The backend takes new connections again.
    Resumed,
    /// Nothing to do; the text says why.
    Unchanged(String),
}

/// What a new layout changed, for the event loop to act on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reconfigured {
    /// Probe loops to stop: backends gone, or whose id or health settings
    /// changed.
    pub unprobe: Vec<u32>,
    /// Probe loops to start: backends added, or whose id or health
    /// settings changed.
    pub probe: Vec<u32>,
    /// Addresses no service lists any more, and what becomes of their
    /// connections.
    pub removed: Vec<(SocketAddr, Departure)>,
    /// Backends added to a service that already ran (they wait for a
    /// passed probe).
    pub added: Vec<SocketAddr>,
    /// (service, address) pairs the new layout lacks: what is kept per
    /// backend for them (metric label sets) is forgotten.
    pub dropped: Vec<(String, SocketAddr)>,
}

/// A drain request that cannot be done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{addr} is not a backend of any service (backends: {known})")]
pub struct UnknownBackend {
    pub addr: SocketAddr,
    pub known: String,
}

/// A backend in slow start: since when (set by the first
/// [`Owner::advance_ramps`] after it became healthy) and at which step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ramp {
    started: Option<Instant>,
    step: u32,
}

pub struct Owner {
    layout: Layout,
    /// Backends in slow start, by id.
    ramps: HashMap<u32, Ramp>,
    /// Overloaded backends of a table being rebalanced: planned at the
    /// first slow-start step, so that the clients whose connections were
    /// closed reconnect to the others.
    steered: HashSet<u32>,
    trackers: HashMap<u32, HealthTracker>,
    /// Backends `socklb drain` asked to drain, by address.
    requested_drains: BTreeSet<Endpoint>,
    /// Backends that take no new connections: drained by the config or
    /// asked for.
    draining: HashSet<u32>,
    settings: Settings,
    writer: Writer,
    /// A write failed; the next pass tries again.
    dirty: bool,
    /// Backends that went down while every other healthy backend of their
    /// table failed its last probe too: their connections wait for a
    /// better place (see `closes.rs`).
    held: BTreeSet<u32>,
    /// Tables that lost their last healthy backend with connections kept
    /// where they were; they stay there when health comes back.
    kept: HashSet<u32>,
}

impl Owner {
    /// A fresh start: every backend is assumed healthy until its first
    /// probe answers, so that starting socklb never refuses traffic.
    pub fn new(layout: Layout, settings: Settings) -> Self {
        let trackers = layout
            .backends()
            .map(|(table, backend)| (backend.id, HealthTracker::unknown(&table.health)))
            .collect();
        let mut owner = Self {
            layout,
            ramps: HashMap::new(),
            steered: HashSet::new(),
            trackers,
            requested_drains: BTreeSet::new(),
            draining: HashSet::new(),
            settings,
            writer: Writer::default(),
            dirty: false,
            held: BTreeSet::new(),
            kept: HashSet::new(),
        };
        owner.update_draining();
        owner
    }

    /// Continues from what a previous daemon left in the maps: its drains,
    /// and its health verdicts, matched by service and address (ids may
    /// have moved with a changed config), so a restart neither re-admits a
    /// dead backend nor drops a live one. A record whose health was only
    /// assumed seeds nothing. Returns the backends the previous daemon
    /// served that this configuration drops.
    pub fn adopt(&mut self, store: &dyn MapStore) -> Result<Vec<SocketAddr>, StoreError> {
        self.writer = Writer::adopt(store)?;
        let written = self.writer.written();
        let service_of: HashMap<u32, String> = written
            .table_records
            .iter()
            .map(|(id, info)| (*id, table_name(info)))
            .collect();
        let known: HashMap<(String, Endpoint), BackendInfo> = written
            .backends
            .values()
            .filter_map(|info| {
                Some((
                    (service_of.get(&info.table_id)?.clone(), info.target),
                    *info,
                ))
            })
            .collect();
        for (table, backend) in self.layout.backends() {
            let key = (table.service.clone(), endpoint(&backend.addr));
            if let Some(info) = known.get(&key).filter(|info| info.probed != 0) {
                self.trackers.insert(
                    backend.id,
                    HealthTracker::known(&table.health, info.healthy != 0),
                );
            }
        }
        let kept: HashSet<Endpoint> = self
            .layout
            .backends()
            .map(|(_, backend)| endpoint(&backend.addr))
            .collect();
        let removed = written
            .backends
            .values()
            .filter(|info| !kept.contains(&info.target))
            .filter_map(|info| socket_addr(&info.target))
            .collect();
        self.requested_drains = written.drains.clone();
        self.update_draining();
        Ok(removed)
    }

    /// Follows a new layout (a reloaded configuration, or a changed set of
    /// discovered backends). A backend that stays, by service and address,
    /// keeps its health (under the new rise and fall). One added to a
    /// service that already ran waits for its first passed probe; the
    /// backends of a new service are assumed healthy until probed, as at
    /// start, so that no service starts by refusing traffic.
    pub fn reconfigure(&mut self, layout: Layout) -> Reconfigured {
        let old = std::mem::replace(&mut self.layout, layout);
        let old_backends: HashMap<(&str, SocketAddr), (&TableLayout, &BackendLayout)> = old
            .backends()
            .map(|(table, backend)| ((table.service.as_str(), backend.addr), (table, backend)))
            .collect();
        let old_services: HashSet<&str> = old
            .tables
            .iter()
            .map(|table| table.service.as_str())
            .collect();
        let mut changes = Reconfigured::default();
        let mut trackers = HashMap::new();
        for (table, backend) in self.layout.backends() {
            match old_backends.get(&(table.service.as_str(), backend.addr)) {
                Some((old_table, old_backend)) => {
                    let tracker = self.trackers.get(&old_backend.id).map_or_else(
                        || HealthTracker::unknown(&table.health),
                        |tracker| tracker.with_settings(&table.health),
                    );
                    trackers.insert(backend.id, tracker);
                    if old_backend.id != backend.id || old_table.health != table.health {
                        changes.unprobe.push(old_backend.id);
                        changes.probe.push(backend.id);
                    }
                }
                None if old_services.contains(table.service.as_str()) => {
                    trackers.insert(backend.id, HealthTracker::pending(&table.health));
                    changes.probe.push(backend.id);
                    changes.added.push(backend.addr);
                }
                None => {
                    trackers.insert(backend.id, HealthTracker::unknown(&table.health));
                    changes.probe.push(backend.id);
                }
            }
        }
        self.departed(&old_backends, &trackers, &mut changes);
        changes.removed.sort();
        changes.dropped.sort();
        // Connections held or kept under the old layout stay where they
        // are.
        self.held.clear();
        self.kept.clear();
        // Rebalancing starts over with the new layout.
        self.steered.clear();
        self.carry_ramps(&old_backends);
        self.trackers = trackers;
        self.update_draining();
        changes
    }

    /// The backends of the old layout that the new one lacks: their loops
    /// stop, and an address no service lists any more departs.
    fn departed(
        &self,
        old_backends: &HashMap<(&str, SocketAddr), (&TableLayout, &BackendLayout)>,
        trackers: &HashMap<u32, HealthTracker>,
        changes: &mut Reconfigured,
    ) {
        let kept: HashSet<(&str, SocketAddr)> = self
            .layout
            .backends()
            .map(|(table, backend)| (table.service.as_str(), backend.addr))
            .collect();
        let still_listed: HashSet<SocketAddr> = self
            .layout
            .backends()
            .map(|(_, backend)| backend.addr)
            .collect();
        for ((service, addr), (table, backend)) in old_backends {
            if kept.contains(&(*service, *addr)) {
                continue;
            }
            changes.unprobe.push(backend.id);
            changes.dropped.push((service.to_string(), *addr));
            if !still_listed.contains(addr) && !changes.removed.iter().any(|(a, _)| a == addr) {
                let departure =
                    closes::departure(&self.layout, trackers, service, table.close_on_failure);
                changes.removed.push((*addr, departure));
            }
        }
    }

    /// A ramp follows its backend to a new id; a service whose slow start
    /// is now off ends its ramps.
    fn carry_ramps(
        &mut self,
        old_backends: &HashMap<(&str, SocketAddr), (&TableLayout, &BackendLayout)>,
    ) {
        let ramps = std::mem::take(&mut self.ramps);
        for (table, backend) in self.layout.backends() {
            let ramp = old_backends
                .get(&(table.service.as_str(), backend.addr))
                .and_then(|(_, old_backend)| ramps.get(&old_backend.id));
            if let Some(ramp) = ramp
                && table.slow_start.is_some()
            {
                self.ramps.insert(backend.id, *ramp);
            }
        }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// The links now attach to a cgroup with this id (one re-created at the
    /// same path); the settings record it.
    pub fn set_attached_cgroup(&mut self, cgroup_id: u64) {
        self.settings.attached_cgroup_id = cgroup_id;
    }

    /// A backend and its table, by id.
    pub fn backend(&self, id: u32) -> Option<(&TableLayout, &BackendLayout)> {
        self.layout.backends().find(|(_, backend)| backend.id == id)
    }

    pub fn is_healthy(&self, id: u32) -> bool {
        self.trackers
            .get(&id)
            .is_some_and(HealthTracker::is_healthy)
    }

    pub fn health(&self, id: u32) -> BackendHealth {
        self.trackers
            .get(&id)
            .map_or_else(BackendHealth::default, |tracker| BackendHealth {
                healthy: tracker.is_healthy(),
                probed: tracker.is_settled(),
                draining: self.draining.contains(&id),
            })
    }

    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// What the maps should hold now. A draining backend is planned like an
    /// unhealthy one: out of the healthy list, still in the fail-open list.
    pub fn desired(&self) -> Desired {
        let contents = plan_ramped(
            &self.layout,
            |id| self.is_healthy(id) && !self.draining.contains(&id),
            |id| {
                let ramp = self.ramps.get(&id).map(|ramp| ramp.step);
                let steer = self.steered.contains(&id).then_some(1);
                ramp.into_iter().chain(steer).min()
            },
        );
        Desired::build(
            &self.layout,
            &contents,
            |id| self.health(id),
            self.settings,
            self.requested_drains.clone(),
        )
    }

    /// Writes what changed. On failure the state is marked dirty and the
    /// next pass tries again; returns whether the maps are up to date.
    pub fn write(&mut self, store: &mut dyn MapStore) -> bool {
        let desired = self.desired();
        match self.writer.write(store, &desired) {
            Ok(report) => {
                for (table_id, healthy_slots) in report.replaced {
                    let service = self
                        .layout
                        .tables
                        .iter()
                        .find(|table| table.table_id == table_id)
                        .map_or("", |table| table.service.as_str());
                    info!(service, healthy_slots, "table {table_id} replaced");
                }
                self.dirty = false;
                true
            }
            Err(error) => {
                warn!(
                    "writing the new tables failed, will retry on the next check: {}",
                    errors::chain(&error)
                );
                self.dirty = true;
                false
            }
        }
    }

    /// Feeds one probe outcome. Returns the transition, if any, and whether
    /// the backend's record must be written even without one (its first
    /// answer confirmed the assumed state: status must stop calling it
    /// unknown).
    pub fn record_probe(
        &mut self,
        id: u32,
        outcome: &Result<(), ProbeFailure>,
        success_words: &str,
    ) -> (Option<Transition>, bool) {
        let Some(tracker) = self.trackers.get_mut(&id) else {
            return (None, false);
        };
        let was_settled = tracker.is_settled();
        let transition = tracker.record(outcome, success_words);
        let newly_settled = !was_settled && tracker.is_settled();
        match &transition {
            Some(transition) if transition.healthy => self.start_ramp(id),
            Some(_) => {
                self.ramps.remove(&id);
            }
            None => {}
        }
        (transition, newly_settled)
    }

    /// A backend that became healthy starts its slow start, if its service
    /// has one: step 1 at once, the clock from the next `advance_ramps`.
    fn start_ramp(&mut self, id: u32) {
        let has_slow_start = self
            .backend(id)
            .is_some_and(|(table, _)| table.slow_start.is_some());
        if has_slow_start {
            self.ramps.insert(
                id,
                Ramp {
                    started: None,
                    step: 1,
                },
            );
        }
    }

    /// Steers new connections away from `ids` (on), or stops (off).
    /// Returns whether anything changed: the tables must be written.
    pub fn steer(&mut self, ids: &[u32], on: bool) -> bool {
        let mut changed = false;
        for id in ids {
            changed |= if on {
                self.steered.insert(*id)
            } else {
                self.steered.remove(id)
            };
        }
        changed
    }

    /// The slow start step of a backend (1..RAMP_STEPS), if it ramps.
    pub fn ramp_step(&self, id: u32) -> Option<u32> {
        self.ramps.get(&id).map(|ramp| ramp.step)
    }

    /// Moves every slow start to the step its elapsed time gives (the
    /// share grows by a tenth of the weight each tenth of the duration),
    /// and ends those whose time is up. Returns the backends whose step
    /// changed (with the new step, None when it ended): the tables must be
    /// written again.
    pub fn advance_ramps(&mut self, now: Instant) -> Vec<(u32, Option<u32>)> {
        let mut changed = Vec::new();
        let durations: HashMap<u32, Duration> = self
            .layout
            .backends()
            .filter_map(|(table, backend)| Some((backend.id, table.slow_start?)))
            .collect();
        self.ramps.retain(|id, ramp| {
            let Some(duration) = durations.get(id) else {
                changed.push((*id, None));
                return false;
            };
            let started = *ramp.started.get_or_insert(now);
            let elapsed = now.saturating_duration_since(started);
            if elapsed >= *duration {
                changed.push((*id, None));
                return false;
            }
            let step =
                1 + (elapsed.as_secs_f64() / duration.as_secs_f64() * f64::from(RAMP_STEPS)) as u32;
            let step = step.clamp(1, RAMP_STEPS);
            if step != ramp.step {
                ramp.step = step;
                changed.push((*id, Some(step)));
            }
            true
        });
        changed.sort_unstable();
        changed
    }

    /// Drains a backend (or ends its drain), as `socklb drain` asks.
    pub fn request_drain(
        &mut self,
        addr: SocketAddr,
        drain: bool,
    ) -> Result<DrainOutcome, UnknownBackend> {
        let target = endpoint(&addr);
        let configured: Vec<&BackendLayout> = self
            .layout
            .backends()
            .map(|(_, backend)| backend)
            .filter(|backend| backend.addr == addr)
            .collect();
        if configured.is_empty() && drain {
            let known: Vec<String> = self
                .layout
                .backends()
                .map(|(_, backend)| backend.addr.to_string())
                .collect();
            return Err(UnknownBackend {
                addr,
                known: known.join(", "),
            });
        }
        let requested = self.requested_drains.contains(&target);
        let by_config = configured.iter().any(|backend| backend.drain);
        let outcome = match (drain, requested) {
            (true, true) => DrainOutcome::Unchanged(format!("{addr} is already draining")),
            (false, false) if by_config => DrainOutcome::Unchanged(format!(
                "{addr} is drained by the configuration; remove `drain` there to take it back"
            )),
            (false, false) => {
                DrainOutcome::Unchanged(format!("{addr} is not draining; nothing to do"))
            }
            (true, false) => {
                self.requested_drains.insert(target);
                DrainOutcome::Draining
            }
            (false, true) => {
                self.requested_drains.remove(&target);
                DrainOutcome::Resumed
            }
        };
        self.update_draining();
        Ok(outcome)
    }

    /// Recomputes the draining set from the config and the requests; logs
    /// each change once.
    fn update_draining(&mut self) {
        let draining: HashSet<u32> = self
            .layout
            .backends()
            .filter(|(_, backend)| {
                backend.drain || self.requested_drains.contains(&endpoint(&backend.addr))
            })
            .map(|(_, backend)| backend.id)
            .collect();
        for (_, backend) in self.layout.backends() {
            match (
                self.draining.contains(&backend.id),
                draining.contains(&backend.id),
            ) {
                (false, true) => info!(
                    "{} draining: no new connections, existing ones stay",
                    backend.addr
                ),
                (true, false) => info!("{} no longer draining", backend.addr),
                _ => {}
            }
        }
        self.draining = draining;
    }

    /// Compares the maps with what was written.
    pub fn verify(&self, store: &dyn MapStore) -> Result<Vec<Drift>, StoreError> {
        self.writer.verify(store)
    }

    /// Puts back what `verify` found changed.
    pub fn repair(&mut self, store: &mut dyn MapStore, drifts: &[Drift]) -> Result<(), StoreError> {
        self.writer.repair(store, drifts)
    }
}

mod closes;
#[cfg(test)]
mod tests;

pub use closes::{CloseVerdict, Departure};
