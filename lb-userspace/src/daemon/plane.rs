//! The data plane's owner in the daemon: the programs, maps and links of
//! this install, the daemon's record (its heartbeat) in the maps, the
//! verification pass, and the sweeps that close connections.

use std::net::SocketAddr;

use lb_common::{BackendConns, DAEMON_FLAG_RUNNING, DaemonRecord, repair};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{
    rebalance::ClosePlan,
    socket_table::SocketTableCare,
    state::Owner,
    sweep::{self, SweepAccess, SweepDone},
    takeover::Takeover,
    verify::Verifier,
};
use crate::{
    clock::boottime_ns,
    convert::path_field,
    dataplane::{
        self, MapStore, PinPaths, Running, StoreError, features::Features, lock::InstallLock,
    },
    errors,
    planner::Layout,
    status::StatusReport,
};

pub struct DataPlane {
    pub paths: PinPaths,
    pub running: Running,
    pub features: Features,
    record: DaemonRecord,
    verifier: Verifier,
    /// Backends removed while a table write failed: their connections are
    /// closed once a write lands (the table may still list them).
    pending_closes: Vec<SocketAddr>,
    sweeps: mpsc::Sender<SweepDone>,
    /// The sweep and the full-table watch of the kernel's socket table.
    socket_table: SocketTableCare,
    /// VIPs found handed back at start, taken back once the probes
    /// confirm the adopted verdicts (see `takeover.rs`).
    takeover: Option<Takeover>,
    cleanup_on_exit: bool,
    _lock: InstallLock,
}

impl DataPlane {
    pub fn new(
        paths: PinPaths,
        running: Running,
        features: Features,
        lock: InstallLock,
        sweeps: mpsc::Sender<SweepDone>,
        cleanup_on_exit: bool,
    ) -> Self {
        Self {
            paths,
            running,
            features,
            record: DaemonRecord::default(),
            verifier: Verifier::default(),
            pending_closes: Vec::new(),
            sweeps,
            socket_table: SocketTableCare::default(),
            takeover: None,
            cleanup_on_exit,
            _lock: lock,
        }
    }

    /// The daemon's record: who runs, attached where, with the repairs of
    /// earlier daemons carried over. Its first heartbeat says the daemon
    /// runs: written once it answers on its control socket.
    pub fn start_record(&mut self) {
        let previous = self.running.maps.daemon().unwrap_or_default();
        let now = boottime_ns();
        let cgroup = self.running.attachment.cgroup();
        self.record = DaemonRecord {
            pid: std::process::id(),
            flags: DAEMON_FLAG_RUNNING,
            heartbeat_ns: now,
            started_ns: now,
            cgroup_id: cgroup.id,
            config_generation: 1,
            repairs: previous.repairs,
            object_sha256: dataplane::object::object_sha256(self.features.socket_slots),
            cgroup_path: path_field(&cgroup.path),
            pin_path: path_field(&self.paths.dir),
        };
        self.beat();
    }

    /// Writes the heartbeat (and everything else the record holds).
    pub fn beat(&mut self) {
        self.record.heartbeat_ns = boottime_ns();
        if let Err(error) = self.running.maps.put_daemon(&self.record) {
            warn!("writing the heartbeat failed: {}", errors::chain(&error));
        }
    }

    /// Before the first heartbeat for hand-back: VIPs that the pinned
    /// heartbeat hands back stay handed back until the probes confirm the
    /// adopted verdicts of their services.
    pub fn hold_handed_back(&mut self, layout: &Layout) {
        let Ok(pinned) = self.running.maps.liveness() else {
            return;
        };
        self.takeover =
            Takeover::at_start(layout, &pinned, boottime_ns(), std::time::Instant::now());
        if let Some(takeover) = &self.takeover {
            info!(
                "{}: found handed back (no heartbeat for longer than daemon-gone-after); taken back once the probes confirm the health verdicts of before",
                takeover.services.join(", ")
            );
        }
    }

    /// A probe of `backend_id` answered as its verdict says: one fewer for
    /// a takeover to wait for.
    pub fn verdict_confirmed(&mut self, backend_id: u32) {
        if let Some(takeover) = &mut self.takeover {
            takeover.confirmed(backend_id);
        }
    }

    /// Writes the heartbeat the connect programs read for hand-back, with
    /// each table's patience from `layout`; held while a takeover waits.
    pub fn beat_liveness(&mut self, layout: &Layout) {
        if let Some(takeover) = &self.takeover {
            if takeover.holds(std::time::Instant::now()) {
                return;
            }
            let services = takeover.services.join(", ");
            if takeover.all_confirmed() {
                info!("{services}: the probes confirmed every verdict; taking the VIPs back");
            } else {
                warn!(
                    "{services}: taking the VIPs back before the probes confirmed every verdict (the wait is bounded)"
                );
            }
            self.takeover = None;
        }
        let liveness = dataplane::tables::liveness(layout, boottime_ns());
        if let Err(error) = self.running.maps.put_liveness(&liveness) {
            warn!(
                "writing the heartbeat for hand-back failed: {}",
                errors::chain(&error)
            );
        }
    }

    /// The socket table's sweep and full-table watch; records swept count
    /// as repairs, in the record at once.
    pub fn tend_socket_table(&mut self) {
        let swept = self.socket_table.tend(&mut self.running);
        if swept > 0 {
            self.record.repairs[super::socket_table::SWEPT] += swept;
            self.beat();
        }
    }

    pub fn generation(&self) -> u64 {
        self.record.config_generation
    }

    /// A new configuration is in force: the record says so at once.
    pub fn next_generation(&mut self) {
        self.record.config_generation += 1;
        self.beat();
    }

    /// Writes the tables the owner wants; false when the write failed (it
    /// is retried by the verification pass).
    pub fn write(&mut self, owner: &mut Owner) -> bool {
        owner.write(&mut self.running.maps)
    }

    /// What sock_ops counted for a backend.
    pub fn connections(&self, id: u32) -> Result<BackendConns, StoreError> {
        self.running.maps.connections(id)
    }

    /// What `socklb status` would print now.
    pub fn status(&self) -> StatusReport {
        crate::status::read(&self.running.maps, &self.paths)
    }

    /// One verification pass (see `verify.rs`); closes what waited for a
    /// write to land; beats when something was repaired.
    pub fn verify_and_repair(&mut self, owner: &mut Owner) {
        let repairs = self.verifier.pass(&self.paths, &mut self.running, owner);
        if !owner.is_dirty() {
            for addr in std::mem::take(&mut self.pending_closes) {
                self.close_failed(addr);
            }
        }
        if repairs.is_empty() {
            return;
        }
        if repairs
            .iter()
            .any(|kind| matches!(*kind, repair::LINK | repair::CGROUP))
        {
            self.socket_table.sweep_soon();
        }
        for kind in repairs {
            self.record.repairs[kind] += 1;
        }
        self.record.cgroup_id = self.running.attachment.cgroup().id;
        self.beat();
    }

    /// Closes, off the loop, the connections socklb sent to `addr` (once it
    /// is out of the tables). Nothing without SOCK_DESTROY.
    pub fn close_failed(&self, addr: SocketAddr) {
        if !self.features.sock_destroy {
            return;
        }
        match SweepAccess::of(&self.running.maps) {
            Some(access) => sweep::close_failed(access, addr, self.sweeps.clone()),
            None => {
                warn!("{addr}: cannot close its connections: the socket storage map is not open")
            }
        }
    }

    /// Closes `addr`'s connections now if the tables are written, or once
    /// they are.
    pub fn close_after_write(&mut self, addr: SocketAddr, written: bool) {
        if written {
            self.close_failed(addr);
        } else if self.features.sock_destroy && !self.pending_closes.contains(&addr) {
            // Once per address, however many writes fail meanwhile.
            self.pending_closes.push(addr);
        }
    }

    /// Carries out a rebalancing step's closes, off the loop. Returns false
    /// when it cannot start (the step then counts no move).
    pub fn close_for_balance(&self, plan: ClosePlan) -> bool {
        if !self.features.sock_destroy {
            return false;
        }
        match SweepAccess::of(&self.running.maps) {
            Some(access) => {
                sweep::close_for_balance(access, plan, self.sweeps.clone());
                true
            }
            None => false,
        }
    }

    /// The daemon stops: the record says so, and with --cleanup-on-exit
    /// the data plane goes.
    pub fn stop(&mut self) {
        self.record.flags &= !DAEMON_FLAG_RUNNING;
        self.beat();
        if !self.cleanup_on_exit {
            info!("exiting; the data plane stays in place and keeps redirecting");
            return;
        }
        let removal = dataplane::remove_pins(&self.paths);
        info!("removed the data plane ({} pins)", removal.removed.len());
        if removal.accelerated_open > 0 {
            info!(
                "kept the sockhash pinned: {} accelerated sockets are still open and carry on over the normal path; `socklb uninstall` removes it once they closed",
                removal.accelerated_open
            );
        }
    }
}
