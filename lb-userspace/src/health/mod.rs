//! Active health checks: probes and the rise/fall state machine.
//!
//! A probe answers one question about one backend, once. [`HealthTracker`]
//! turns a stream of answers into "healthy" or "unhealthy", changing only
//! after `rise` successes or `fall` failures in a row, and reports each
//! change exactly once. Probe kinds live in [`probe`].

use std::{net::SocketAddr, time::Duration};

use rand::Rng;
use tokio::{
    sync::{mpsc, watch},
    time,
};

pub mod probe;

use crate::config::HealthSettings;
pub use probe::ProbeFailure;
use probe::Prober;

/// Share of the interval by which each wait is randomly moved, so that the
/// probes of many nodes do not beat in step against one server.
pub const JITTER: f64 = 0.2;

/// A change of a backend's state, with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub healthy: bool,
    /// The last probe's outcome, e.g. "connect refused".
    pub reason: String,
    /// Consecutive outcomes that caused it, and how many were needed.
    pub streak: u32,
    pub needed: u32,
}

impl Transition {
    /// "127.0.0.3:8443 unhealthy: connect refused (3/3)".
    pub fn message(&self, addr: SocketAddr) -> String {
        let state = if self.healthy { "healthy" } else { "unhealthy" };
        format!(
            "{addr} {state}: {} ({}/{})",
            self.reason, self.streak, self.needed
        )
    }
}

/// The rise/fall state machine of one backend. Pure: no clock, no I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthTracker {
    rise: u32,
    fall: u32,
    healthy: bool,
    /// False until the first probe has answered: the assumed state is then
    /// corrected by one outcome, not by `rise` or `fall` of them.
    settled: bool,
    streak: u32,
}

impl HealthTracker {
    /// A backend nothing is known about. It is assumed healthy, so that a
    /// fresh start does not refuse traffic, and the first probe settles it.
    pub fn unknown(settings: &HealthSettings) -> Self {
        Self {
            rise: settings.rise,
            fall: settings.fall,
            healthy: true,
            settled: false,
            streak: 0,
        }
    }

    /// A backend added to a running service: it takes no connections until
    /// its first probe passes.
    pub fn pending(settings: &HealthSettings) -> Self {
        Self {
            healthy: false,
            ..Self::unknown(settings)
        }
    }

    /// The same state under new rise/fall settings (a reloaded
    /// configuration); a streak under way starts again.
    pub fn with_settings(&self, settings: &HealthSettings) -> Self {
        Self {
            rise: settings.rise,
            fall: settings.fall,
            streak: 0,
            ..self.clone()
        }
    }

    /// A backend whose state is known, for example from the pinned maps of
    /// a previous daemon. Normal rise/fall applies from the start.
    pub fn known(settings: &HealthSettings, healthy: bool) -> Self {
        Self {
            settled: true,
            healthy,
            ..Self::unknown(settings)
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy
    }

    /// False until a probe has answered (or the state was known).
    pub fn is_settled(&self) -> bool {
        self.settled
    }

    /// Takes a healthy backend out at once, for a reason seen outside the
    /// probes (the kernel's failed connects). It comes back only after
    /// `rise` passed probes. Returns the transition, if it was healthy.
    pub fn mark_down(&mut self, reason: String, count: u32) -> Option<Transition> {
        if !self.healthy {
            return None;
        }
        self.healthy = false;
        self.settled = true;
        self.streak = 0;
        Some(Transition {
            healthy: false,
            reason,
            streak: count,
            needed: count,
        })
    }

    /// Feeds one probe outcome; returns the transition if the state changed.
    pub fn record(
        &mut self,
        outcome: &Result<(), ProbeFailure>,
        success_words: &str,
    ) -> Option<Transition> {
        let passed = outcome.is_ok();
        let reason = match outcome {
            Ok(()) => success_words.to_string(),
            Err(failure) => failure.to_string(),
        };
        if !self.settled {
            self.settled = true;
            self.streak = 0;
            if passed == self.healthy {
                return None;
            }
            self.healthy = passed;
            return Some(Transition {
                healthy: passed,
                reason: format!("{reason}, first probe"),
                streak: 1,
                needed: 1,
            });
        }
        if passed == self.healthy {
            // The state holds; a streak toward the other state is broken.
            self.streak = 0;
            return None;
        }
        self.streak += 1;
        let needed = if passed { self.rise } else { self.fall };
        if self.streak < needed {
            return None;
        }
        self.healthy = passed;
        let streak = self.streak;
        self.streak = 0;
        Some(Transition {
            healthy: passed,
            reason,
            streak,
            needed,
        })
    }
}

/// `base` moved by up to ±`JITTER` of itself.
pub fn jittered(base: Duration, rng: &mut impl Rng) -> Duration {
    let factor = 1.0 + rng.random_range(-JITTER..=JITTER);
    base.mul_f64(factor)
}

/// One probe's result, sent to the single owner of health state.
#[derive(Debug)]
pub struct ProbeReport {
    pub backend_id: u32,
    /// The probe loop that sent it: a report of a loop that was stopped
    /// (its backend removed or reconfigured) is ignored.
    pub loop_id: u64,
    pub outcome: Result<(), ProbeFailure>,
    /// How long the probe took.
    pub took: Duration,
    /// Run to confirm failed connects the kernel saw, not on the schedule.
    pub confirming: bool,
}

/// Probes one backend until the receiver is gone, reporting each outcome.
/// The first probe runs after a short random delay. While the owner marks
/// the backend down (`down`), probes run every `down_interval` instead
/// (HAProxy's `downinter`). The owner updates `down` without waking the
/// loop, which reads it after each probe; a notified change ends the
/// current wait.
pub async fn probe_loop(
    backend_id: u32,
    loop_id: u64,
    addr: SocketAddr,
    prober: Prober,
    settings: HealthSettings,
    mut down: watch::Receiver<bool>,
    reports: mpsc::Sender<ProbeReport>,
) {
    let first_delay = settings
        .interval
        .mul_f64(rand::rng().random_range(0.0..JITTER));
    time::sleep(first_delay).await;
    loop {
        // Probes start every interval, however long each takes (the next
        // starts at once when one took longer), so that a backend that
        // times out is judged within fall × max(interval, timeout) after
        // its first failing probe starts.
        let started = time::Instant::now();
        let outcome = prober.probe(addr, settings.timeout).await;
        if reports
            .send(ProbeReport {
                backend_id,
                loop_id,
                outcome,
                took: started.elapsed(),
                confirming: false,
            })
            .await
            .is_err()
        {
            return;
        }
        let base = if *down.borrow_and_update() {
            settings.down_interval
        } else {
            settings.interval
        };
        let wait = jittered(base, &mut rand::rng()).saturating_sub(started.elapsed());
        tokio::select! {
            () = time::sleep(wait) => {}
            changed = down.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(rise: u32, fall: u32) -> HealthSettings {
        HealthSettings {
            rise,
            fall,
            ..HealthSettings::default()
        }
    }

    const OK: Result<(), ProbeFailure> = Ok(());
    const REFUSED: Result<(), ProbeFailure> = Err(ProbeFailure::Refused);

    /// Feeds outcomes; returns (healthy after each, transitions seen).
    fn run(tracker: &mut HealthTracker, outcomes: &[bool]) -> (Vec<bool>, Vec<Transition>) {
        let mut states = Vec::new();
        let mut transitions = Vec::new();
        for &passed in outcomes {
            let outcome = if passed { OK } else { REFUSED };
            transitions.extend(tracker.record(&outcome, "connect ok"));
            states.push(tracker.is_healthy());
        }
        (states, transitions)
    }

    #[test]
    fn fall_then_rise() {
        let mut tracker = HealthTracker::known(&settings(2, 3), true);
        let (states, transitions) = run(
            &mut tracker,
            &[false, false, true, false, false, false, true, true],
        );
        assert_eq!(states, [true, true, true, true, true, false, false, true]);
        assert_eq!(transitions.len(), 2);
        assert_eq!(
            transitions[0].message("127.0.0.3:8443".parse().unwrap()),
            "127.0.0.3:8443 unhealthy: connect refused (3/3)"
        );
        assert_eq!(
            transitions[1].message("127.0.0.3:8443".parse().unwrap()),
            "127.0.0.3:8443 healthy: connect ok (2/2)"
        );
    }

    #[test]
    fn no_repeat_while_state_holds() {
        let mut tracker = HealthTracker::known(&settings(2, 1), true);
        let (_, transitions) = run(&mut tracker, &[false, false, false, false]);
        assert_eq!(transitions.len(), 1);
    }

    #[test]
    fn first_probe_settles_unknown() {
        let mut down = HealthTracker::unknown(&settings(2, 3));
        let (states, transitions) = run(&mut down, &[false, true, true]);
        assert_eq!(states, [false, false, true]);
        assert_eq!(transitions.len(), 2);
        let mut up = HealthTracker::unknown(&settings(2, 3));
        let (states, transitions) = run(&mut up, &[true, false]);
        assert_eq!(states, [true, true]);
        assert!(transitions.is_empty());
    }

    #[test]
    fn marked_down_comes_back_after_rise_passes() {
        let mut tracker = HealthTracker::known(&settings(2, 3), true);
        let transition = tracker
            .mark_down("2 failed connects in a row".into(), 2)
            .unwrap();
        assert_eq!(
            transition.message("127.0.0.3:8443".parse().unwrap()),
            "127.0.0.3:8443 unhealthy: 2 failed connects in a row (2/2)"
        );
        assert!(
            tracker.mark_down("again".into(), 2).is_none(),
            "logged once"
        );
        let (states, transitions) = run(&mut tracker, &[true, true]);
        assert_eq!(states, [false, true]);
        assert_eq!(transitions.len(), 1);
    }

    #[test]
    fn jitter_stays_in_bounds() {
        let mut rng = rand::rng();
        let base = Duration::from_secs(1);
        for _ in 0..1000 {
            let wait = jittered(base, &mut rng);
            assert!(
                wait >= Duration::from_millis(800) && wait <= Duration::from_millis(1200),
                "{wait:?}"
            );
        }
    }
}
