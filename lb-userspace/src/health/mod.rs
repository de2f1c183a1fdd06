//! Active health checks: probes and the rise/fall state machine.
//!
//! A probe answers one question about one backend, once. [`HealthTracker`]
//! turns a stream of answers into "healthy" or "unhealthy", changing only
//! after `rise` successes or `fall` failures in a row, and reports each
//! change exactly once. Probe kinds live in [`probe`].

use std::{
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use rand::Rng;
use tokio::{
    sync::{Notify, mpsc, watch},
    time,
};

pub mod probe;

pub use probe::ProbeFailure;
use probe::{ProbeSpec, Prober};

/// Share of the interval by which each wait is randomly moved, so that the
/// probes of many nodes do not beat in step against one server.
pub const JITTER: f64 = 0.2;

/// Active health-check settings of one service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthSettings {
    /// What a probe does.
    pub probe: ProbeSpec,
    pub interval: Duration,
    /// Interval while a backend is down (HAProxy's `downinter`), and while
    /// a healthy one fails its probes, if shorter than `interval`.
    pub down_interval: Duration,
    pub timeout: Duration,
    /// Consecutive successes that make a down backend healthy.
    pub rise: u32,
    /// Consecutive failures that make an up backend unhealthy.
    pub fall: u32,
    /// Failed connects in a row, seen by the kernel with evidence from the
    /// server side, that start a confirming probe at once (which decides);
    /// 0 turns the passive signal off.
    pub connect_failures: u32,
}

impl Default for HealthSettings {
    fn default() -> Self {
        Self {
            probe: ProbeSpec::Tcp,
            interval: Duration::from_secs(1),
            down_interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            rise: 2,
            fall: 3,
            connect_failures: 1,
        }
    }
}

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

    /// Healthy, with a failure streak under way: its last probe failed.
    /// Not a better place for connections than a failed backend.
    pub fn is_failing(&self) -> bool {
        self.healthy && self.settled && self.streak > 0
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
    /// Run before its time because the kernel reported failed connects.
    /// It counts like any other probe: only `fall` failures in a row take
    /// the backend out.
    pub hurried: bool,
}

/// One backend's probe loop: what it probes, and how.
pub struct ProbeLoop {
    pub backend_id: u32,
    /// Which loop this is (see [`ProbeReport::loop_id`]).
    pub loop_id: u64,
    pub addr: SocketAddr,
    pub prober: Prober,
    pub settings: HealthSettings,
}

/// What the owner tells a probe loop, without waiting for it.
pub struct LoopControl {
    /// The owner marks the backend down: probes come every
    /// `down_interval` instead (HAProxy's `downinter`). The owner updates
    /// it without waking the loop, which reads it after each probe; a
    /// notified change ends the current wait. The loop ends when the
    /// sender is dropped.
    pub down: watch::Receiver<bool>,
    /// Probe now rather than at the next interval, unless the last probe
    /// failed: a streak toward `fall` keeps its pace. The owner rate-limits
    /// it; one request that comes during a probe starts the next probe as
    /// soon as that one ends.
    pub hurry: Arc<Notify>,
    /// The kernel saw the backend reset connects: set by the owner,
    /// cleared by the loop when a probe passes. A reset comes from the
    /// server side and no local process can forge it; with it, a refused
    /// probe is followed by the next within [`AFTER_REFUSED`].
    pub resets_seen: Arc<std::sync::atomic::AtomicBool>,
}

impl ProbeLoop {
    /// Probes the backend until the owner drops it, reporting each
    /// outcome. The first probe runs after a short random delay.
    pub async fn run(self, mut control: LoopControl, reports: mpsc::Sender<ProbeReport>) {
        let first_delay = self
            .settings
            .interval
            .mul_f64(rand::rng().random_range(0.0..JITTER));
        let Some(mut hurried) = wait(first_delay, &mut control, true).await else {
            return;
        };
        loop {
            // Probes start every interval, however long each takes (the
            // next starts at once when one took longer), so that a backend
            // that times out is judged within fall × max(interval, timeout)
            // after its first failing probe starts.
            let started = time::Instant::now();
            let outcome = self.prober.probe(self.addr, self.settings.timeout).await;
            let report = ProbeReport {
                backend_id: self.backend_id,
                loop_id: self.loop_id,
                outcome,
                took: started.elapsed(),
                hurried,
            };
            let failed = report.outcome.is_err();
            let resets_seen = if failed {
                control.resets_seen.load(Ordering::Relaxed)
            } else {
                control.resets_seen.store(false, Ordering::Relaxed);
                false
            };
            let down = *control.down.borrow_and_update();
            let base = self.next_interval(down, &report.outcome, resets_seen);
            if reports.send(report).await.is_err() {
                return;
            }
            let left = jittered(base, &mut rand::rng()).saturating_sub(started.elapsed());
            // A streak of failures runs at its own pace: a hurried probe may
            // start one sooner, never make one reach `fall` sooner.
            match wait(left, &mut control, !failed).await {
                Some(next_hurried) => hurried = next_hurried,
                None => return,
            }
        }
    }
}

/// How soon a refused probe is followed by the next while the backend is
/// still in, once the kernel saw the server reset connects: both say
/// nothing listens, and neither can a local process forge, so a dead
/// server leaves after `fall` refusals in a fraction of a second. A server
/// that is only slow (timeouts), or whose refusals only the checker saw,
/// keeps the checker's pace.
pub const AFTER_REFUSED: Duration = Duration::from_millis(50);

impl ProbeLoop {
    /// The wait before the next probe: the down interval while the backend
    /// is down (HAProxy's `downinter`), and also while a healthy backend
    /// fails its probes if it is shorter (its streak toward `fall` then
    /// ends sooner, one way or the other, as with HAProxy's `fastinter`),
    /// at most [`AFTER_REFUSED`] after a refusal the kernel's resets
    /// confirm; the interval otherwise.
    fn next_interval(
        &self,
        down: bool,
        last: &Result<(), ProbeFailure>,
        resets_seen: bool,
    ) -> Duration {
        let settings = &self.settings;
        let streak = settings.down_interval.min(settings.interval);
        match (down, last) {
            (true, _) => settings.down_interval,
            (false, Err(ProbeFailure::Refused)) if resets_seen => streak.min(AFTER_REFUSED),
            (false, Err(_)) => streak,
            (false, Ok(())) => settings.interval,
        }
    }
}

/// Waits `duration`, or less if the owner asks (and `hurry` lets it):
/// `Some(true)` when asked to hurry, `None` when the owner is gone.
async fn wait(duration: Duration, control: &mut LoopControl, hurry: bool) -> Option<bool> {
    tokio::select! {
        () = time::sleep(duration) => Some(false),
        () = control.hurry.notified(), if hurry => Some(true),
        changed = control.down.changed() => changed.ok().map(|()| false),
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
    fn a_failure_streak_makes_a_healthy_backend_failing() {
        let mut tracker = HealthTracker::known(&settings(2, 3), true);
        assert!(!tracker.is_failing());
        run(&mut tracker, &[false]);
        assert!(tracker.is_healthy() && tracker.is_failing());
        run(&mut tracker, &[true]);
        assert!(!tracker.is_failing(), "a pass ends the streak");
        run(&mut tracker, &[false, false, false]);
        assert!(!tracker.is_healthy() && !tracker.is_failing());
    }

    #[test]
    fn a_failure_streak_keeps_the_checkers_pace_and_a_refusal_is_followed_soon() {
        let probe_loop = |interval_ms: u64, down_ms: u64| ProbeLoop {
            backend_id: 0,
            loop_id: 0,
            addr: "127.0.0.1:1".parse().unwrap(),
            prober: Prober::new(&ProbeSpec::Tcp).unwrap(),
            settings: HealthSettings {
                interval: Duration::from_millis(interval_ms),
                down_interval: Duration::from_millis(down_ms),
                ..HealthSettings::default()
            },
        };
        let timed_out: Result<(), ProbeFailure> = Err(ProbeFailure::TimedOut(Duration::ZERO));
        // (what, interval and down interval in ms, down, last outcome,
        // resets seen by the kernel, wait in ms)
        type Case = (
            &'static str,
            (u64, u64),
            bool,
            Result<(), ProbeFailure>,
            bool,
            u64,
        );
        let cases: [Case; 6] = [
            ("passing", (1000, 200), false, OK, false, 1000),
            (
                "a timeout: the down interval",
                (1000, 200),
                false,
                timed_out.clone(),
                true,
                200,
            ),
            (
                "a timeout, down interval longer",
                (200, 1000),
                false,
                timed_out,
                false,
                200,
            ),
            (
                "refused, resets seen: soon",
                (1000, 1000),
                false,
                REFUSED,
                true,
                50,
            ),
            (
                "refused alone: the checker's pace",
                (1000, 1000),
                false,
                REFUSED,
                false,
                1000,
            ),
            (
                "down: the down interval",
                (1000, 200),
                true,
                REFUSED,
                true,
                200,
            ),
        ];
        for (what, (interval, down_interval), down, last, resets, wait) in cases {
            assert_eq!(
                probe_loop(interval, down_interval).next_interval(down, &last, resets),
                Duration::from_millis(wait),
                "{what}"
            );
        }
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
