//! Where each event of the loop goes: which owner decides, and which owner
//! acts on the decision. Nothing is decided here.

use std::{net::SocketAddr, time::Instant};

use lb_common::ConnectFailure;
use tracing::{debug, info, warn};

use super::{
    Daemon, control,
    rebalance::Action,
    state::{CloseVerdict, DrainOutcome},
    sweep::SweepDone,
};
use crate::{
    errors,
    health::{ProbeReport, Transition},
    planner,
};

impl Daemon {
    pub(super) fn on_probe(&mut self, report: ProbeReport) {
        let Some(accepted) = self.probes.accept(report) else {
            return;
        };
        let report = &accepted.report;
        self.observer.metrics.probe(
            &accepted.service,
            accepted.addr,
            report.outcome.is_ok(),
            report.took,
        );
        let (transition, newly_settled) =
            self.owner
                .record_probe(report.backend_id, &report.outcome, &accepted.success_words);
        if report.outcome.is_ok() == self.owner.is_healthy(report.backend_id) {
            self.plane.verdict_confirmed(report.backend_id);
        }
        let transition = match (transition, accepted.suspicion) {
            (Some(mut transition), Some(reports)) if !transition.healthy => {
                transition.reason = format!(
                    "{}, probes hurried by {}",
                    transition.reason,
                    reports.describe()
                );
                Some(transition)
            }
            (transition, _) => transition,
        };
        if let (Some(reports), Ok(())) = (accepted.hurried_by, &report.outcome) {
            info!(
                "{}: a probe passed after {}; it stays (a client that aborts its own connects, or a passing fault)",
                accepted.addr,
                reports.describe()
            );
        }
        if transition.is_some() || newly_settled {
            self.apply_transition(report.backend_id, transition);
        }
    }

    /// Logs a backend's transition once, writes the tables, and decides
    /// what becomes of the connections of a backend that went down.
    fn apply_transition(&mut self, backend_id: u32, transition: Option<Transition>) {
        let Some(addr) = self.probes.addr(backend_id) else {
            return;
        };
        if let Some(transition) = &transition {
            self.say_transition(backend_id, addr, transition);
            self.probes.mark(backend_id, transition.healthy);
        }
        if !self.plane.write(&mut self.owner) {
            // The table may still list the backend: closing its connections
            // now would only send the clients back to it.
            return;
        }
        let went_down = transition.is_some_and(|transition| !transition.healthy);
        // From the layout in force (a reload may have changed it since the
        // probe loop started).
        let close_on_failure = self
            .owner
            .backend(backend_id)
            .is_some_and(|(table, _)| table.close_on_failure);
        if went_down && close_on_failure {
            self.close_or_hold(backend_id, addr);
        }
    }

    fn say_transition(&mut self, backend_id: u32, addr: SocketAddr, transition: &Transition) {
        let service = self
            .owner
            .backend(backend_id)
            .map(|(table, _)| table.service.clone())
            .unwrap_or_default();
        self.observer
            .metrics
            .transition(&service, addr, transition.healthy);
        let message = transition.message(addr);
        if !transition.healthy {
            warn!("{message}");
            return;
        }
        info!("{message}");
        if let Some(service) = self.owner.after_up(backend_id) {
            info!(
                "{service}: {addr} is healthy again; the connections kept while none was healthy stay where they are"
            );
        }
        if self.owner.ramp_step(backend_id).is_some() {
            let duration = self
                .owner
                .backend(backend_id)
                .and_then(|(table, _)| table.slow_start)
                .unwrap_or_default();
            info!(
                "{addr}: slow start from 1/{} of its weight to all of it over {duration:?}",
                planner::RAMP_STEPS
            );
        }
    }

    /// close-on-failure, only toward somewhere better (see
    /// `state/closes.rs`).
    fn close_or_hold(&mut self, backend_id: u32, addr: SocketAddr) {
        let service = self
            .owner
            .backend(backend_id)
            .map(|(table, _)| table.service.clone())
            .unwrap_or_default();
        match self.owner.after_down(backend_id) {
            CloseVerdict::Close => self.plane.close_failed(addr),
            CloseVerdict::Wait => info!(
                "{service}: {addr} is down, but every other healthy backend is failing its probes too: its connections stay until one passes"
            ),
            CloseVerdict::Keep { first: true } => {
                warn!(
                    "{service}: no backend is healthy: connections stay where they are (close-on-failure closes nothing while none would take them); new connects follow the table's policy"
                );
                self.observer.metrics.connections_kept(&service);
            }
            CloseVerdict::Keep { first: false } => {}
        }
    }

    /// A connect that the kernel saw fail on the server side: it hurries
    /// the backend's next probe, never more.
    pub(super) fn on_failed_connect(&mut self, record: ConnectFailure) {
        // The streak is the kernel's: reset by every connect that
        // establishes. One that cannot be read hurries nothing.
        let consecutive = match self.plane.connections(record.backend_id) {
            Ok(conns) => conns.consecutive_failures,
            Err(error) => {
                debug!(
                    "reading a backend's failed connects: {}",
                    errors::chain(&error)
                );
                return;
            }
        };
        self.probes
            .on_failed_connect(&self.owner, record, consecutive);
    }

    pub(super) fn on_tick(&mut self) {
        self.plane.beat();
        self.plane.beat_liveness(self.owner.layout());
        self.advance_ramps();
        self.rebalance();
        for (_, addr) in self.owner.released_closes() {
            info!(
                "{addr}: a healthy backend passes its probes again; closing the connections that waited (close-on-failure)"
            );
            self.plane.close_failed(addr);
        }
        self.plane.verify_and_repair(&mut self.owner);
        self.plane.tend_socket_table();
    }

    /// Moves the slow starts on; writes the tables when a step changed.
    fn advance_ramps(&mut self) {
        let changed = self.owner.advance_ramps(Instant::now());
        if changed.is_empty() {
            return;
        }
        for (backend_id, step) in &changed {
            let Some(addr) = self.probes.addr(*backend_id) else {
                continue;
            };
            match step {
                Some(step) => debug!(
                    "{addr}: slow start at {step}/{} of its weight",
                    planner::RAMP_STEPS
                ),
                None => info!("{addr}: slow start over; it has its full weight"),
            }
        }
        self.plane.write(&mut self.owner);
    }

    /// One look of the rebalancer; the owner steers, the data plane closes.
    fn rebalance(&mut self) {
        let plane = &self.plane;
        let live = |id| {
            plane
                .connections(id)
                .map(|conns| u64::try_from(conns.live).unwrap_or(0))
        };
        let actions = self.rebalancer.look(&self.owner, live, Instant::now());
        let mut steered = false;
        for action in actions {
            match action {
                Action::Steer { ids, on } => steered |= self.owner.steer(&ids, on),
                Action::Close(plan) => {
                    let table_id = plan.table_id;
                    if !self.plane.close_for_balance(plan) {
                        self.rebalancer.moved(table_id, 0);
                    }
                }
            }
        }
        if steered {
            self.plane.write(&mut self.owner);
        }
    }

    pub(super) fn on_sweep(&mut self, done: SweepDone) {
        match done {
            SweepDone::Failed { addr, result } => match result {
                Ok(report) if report.matched == 0 => {}
                Ok(report) => info!(
                    "{addr}: closed {} of {} connections socklb had sent to it (close-on-failure)",
                    report.destroyed, report.matched
                ),
                Err(error) => warn!("{addr}: closing its connections failed: {error}"),
            },
            SweepDone::Rebalanced { plan, result } => {
                let rebalanced = result.unwrap_or_else(|error| {
                    warn!(
                        "rebalance: {}: closing connections failed: {error}",
                        plan.service
                    );
                    Default::default()
                });
                self.rebalancer.moved(plan.table_id, rebalanced.total());
                for (backend_id, count) in &rebalanced.closed {
                    let Some((_, addr)) = plan.members.iter().find(|(id, _)| id == backend_id)
                    else {
                        continue;
                    };
                    self.observer.rebalanced(&plan.service, *addr, *count);
                    let owners: Vec<String> = rebalanced
                        .by_owner
                        .iter()
                        .map(|(owner, count)| format!("{count} of {owner}"))
                        .collect();
                    info!(
                        "rebalance: {}: closed {count} connections to {addr} ({})",
                        plan.service,
                        owners.join(", ")
                    );
                }
            }
        }
    }

    pub(super) fn on_request(&mut self, request: control::Request) -> control::Reply {
        use control::Reply;
        let (backend, undo) = match request {
            control::Request::Drain { backend, undo } => (backend, undo),
            control::Request::Info => {
                let info = self
                    .observer
                    .info(&self.owner, &self.sources, self.plane.generation());
                return Reply {
                    info: Some(info),
                    ..Reply::text(true, "")
                };
            }
        };
        let Ok(addr) = backend.parse::<SocketAddr>() else {
            return Reply::text(
                false,
                format!("BACKEND: {backend:?} is not ADDR:PORT (IPv6 as [ADDR]:PORT)"),
            );
        };
        let outcome = match self.owner.request_drain(addr, !undo) {
            Ok(outcome) => outcome,
            Err(error) => return Reply::text(false, format!("BACKEND: {error}")),
        };
        let message = match outcome {
            DrainOutcome::Unchanged(text) => return Reply::text(true, text),
            DrainOutcome::Draining => {
                format!("{addr}: draining; no new connections, existing ones stay")
            }
            DrainOutcome::Resumed => format!("{addr}: no longer draining"),
        };
        if self.plane.write(&mut self.owner) {
            Reply::text(true, message)
        } else {
            Reply::text(
                true,
                format!("{message} (the write failed and is retried within a second)"),
            )
        }
    }
}
