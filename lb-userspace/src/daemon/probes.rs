//! The probes' owner in the daemon: one probe loop per backend of the
//! layout, and the kernel's passive signal, which only hurries a loop's
//! next probe (see `passive.rs`).

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use lb_common::{ConnectFailure, EVIDENCE_RESET};
use tokio::sync::{Notify, mpsc, watch};
use tracing::{debug, warn};

use super::{
    passive::{Confirmer, Reports, evidence_words},
    state::Owner,
};
use crate::{
    errors,
    health::{LoopControl, ProbeLoop, ProbeReport, probe::Prober},
};

/// What the daemon keeps per probed backend.
struct ProbedBackend {
    addr: SocketAddr,
    service: String,
    /// Which loop probes it now; reports of a stopped loop are ignored.
    loop_id: u64,
    /// How a passing probe is described in a transition message.
    success_words: String,
    /// Set while the backend is down; read by its probe loop. Dropping it
    /// ends the loop.
    down: watch::Sender<bool>,
    /// Asks the loop to probe now.
    hurry: Arc<Notify>,
    /// Tells the loop the kernel saw the backend reset connects.
    resets_seen: Arc<AtomicBool>,
    /// Failed connects in a row that hurry a probe (0: never).
    connect_failures: u32,
    /// The kernel's reports behind the failure streak under way, when a
    /// hurried probe started it: said with the transition it ends in.
    suspicion: Option<Reports>,
}

/// A probe report of a loop that runs, with what the daemon knows of it.
pub struct Accepted {
    pub report: ProbeReport,
    pub addr: SocketAddr,
    pub service: String,
    pub success_words: String,
    /// For a hurried probe: the kernel's reports that hurried it.
    pub hurried_by: Option<Reports>,
    /// For a failed probe: the kernel's reports behind its streak, when a
    /// hurried probe started it.
    pub suspicion: Option<Reports>,
}

pub struct Probes {
    probed: HashMap<u32, ProbedBackend>,
    next_loop_id: u64,
    reports: mpsc::Sender<ProbeReport>,
    confirmer: Confirmer,
}

impl Probes {
    pub fn new(reports: mpsc::Sender<ProbeReport>) -> Self {
        Self {
            probed: HashMap::new(),
            next_loop_id: 0,
            reports,
            confirmer: Confirmer::default(),
        }
    }

    /// Starts probing every backend of the owner's layout.
    pub fn start_all(&mut self, owner: &Owner) {
        let ids: Vec<u32> = owner
            .layout()
            .backends()
            .map(|(_, backend)| backend.id)
            .collect();
        for id in ids {
            self.start(owner, id);
        }
    }

    /// Starts probing a backend of the layout (again, if it was probed).
    pub fn start(&mut self, owner: &Owner, id: u32) {
        self.stop(id);
        let Some((table, backend)) = owner.backend(id) else {
            return;
        };
        // The configuration was validated: its CA and certificate files
        // were read then; one that has gone since is said here.
        let prober = match Prober::new(&table.health.probe) {
            Ok(prober) => prober,
            Err(error) => {
                warn!(
                    "{}: cannot probe it: {}; it keeps its last state",
                    backend.addr,
                    errors::chain(&error)
                );
                return;
            }
        };
        self.next_loop_id += 1;
        let (down, down_receiver) = watch::channel(!owner.is_healthy(id));
        let hurry = Arc::new(Notify::new());
        let resets_seen = Arc::new(AtomicBool::new(false));
        let probe_loop = ProbeLoop {
            backend_id: id,
            loop_id: self.next_loop_id,
            addr: backend.addr,
            prober: prober.clone(),
            settings: table.health.clone(),
        };
        let control = LoopControl {
            down: down_receiver,
            hurry: Arc::clone(&hurry),
            resets_seen: Arc::clone(&resets_seen),
        };
        tokio::spawn(probe_loop.run(control, self.reports.clone()));
        self.probed.insert(
            id,
            ProbedBackend {
                addr: backend.addr,
                service: table.service.clone(),
                loop_id: self.next_loop_id,
                success_words: prober.success_words(),
                down,
                hurry,
                resets_seen,
                connect_failures: table.health.connect_failures,
                suspicion: None,
            },
        );
    }

    /// Stops a backend's probe loop (dropping its `down` sender ends it).
    pub fn stop(&mut self, id: u32) {
        self.probed.remove(&id);
        self.confirmer.forget(id);
    }

    /// A report of a loop that still runs, with its backend; `None` for one
    /// of a stopped loop.
    pub fn accept(&mut self, report: ProbeReport) -> Option<Accepted> {
        let backend = self
            .probed
            .get_mut(&report.backend_id)
            .filter(|backend| backend.loop_id == report.loop_id)?;
        let hurried_by = report
            .hurried
            .then(|| self.confirmer.answered(report.backend_id));
        // A streak that a hurried probe started keeps its reports; a pass
        // ends it.
        backend.suspicion = match (&report.outcome, backend.suspicion, hurried_by) {
            (Ok(()), _, _) => None,
            (Err(_), Some(earlier), Some(now)) => Some(Reports {
                count: earlier.count + now.count,
                evidence: now.evidence,
            }),
            (Err(_), earlier, now) => earlier.or(now),
        };
        Some(Accepted {
            addr: backend.addr,
            service: backend.service.clone(),
            success_words: backend.success_words.clone(),
            hurried_by,
            suspicion: backend.suspicion,
            report,
        })
    }

    pub fn addr(&self, id: u32) -> Option<SocketAddr> {
        self.probed.get(&id).map(|backend| backend.addr)
    }

    /// Tells a backend's loop whether the backend is down (it probes at
    /// the down interval then). Every verdict comes from the loop's own
    /// probe, so the loop reads it after that probe: waking it would only
    /// add a probe.
    pub fn mark(&self, id: u32, healthy: bool) {
        if let Some(backend) = self.probed.get(&id) {
            backend.down.send_if_modified(|down| {
                *down = !healthy;
                false
            });
        }
    }

    /// A connect that the kernel saw fail on the server side: hurries the
    /// backend's next probe (rate-limited), never more. `consecutive` is
    /// the kernel's streak of failed connects.
    pub fn on_failed_connect(&mut self, owner: &Owner, record: ConnectFailure, consecutive: u64) {
        let Some(backend) = self.probed.get(&record.backend_id) else {
            return;
        };
        debug!(
            backend = %backend.addr,
            consecutive,
            "failed connect reported by the kernel: {}", evidence_words(record.evidence)
        );
        if record.evidence == EVIDENCE_RESET {
            backend.resets_seen.store(true, Ordering::Relaxed);
        }
        let threshold = u64::from(backend.connect_failures);
        if threshold == 0 || consecutive < threshold || !owner.is_healthy(record.backend_id) {
            return;
        }
        if self
            .confirmer
            .report(record.backend_id, record.evidence, Instant::now())
        {
            backend.hurry.notify_one();
        }
    }
}
