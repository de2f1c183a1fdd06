//! The nemesis's schedule: a pure function of the seed and the run's
//! length (and the catalogue), so that a seed replays the same faults, in
//! the same order, on the same targets, for the same durations.
//!
//! The run is a warm-up, then epochs of a minute: faults for the first
//! part, then quiet while the checkpoint settles and compares. Within an
//! epoch, faults start every few seconds; at most two are active at once,
//! and two faults never hold the same server or resource.

use super::{
    catalogue::{CATALOGUE, FaultKind, FaultSpec, Resource},
    rng::Rng,
};

/// How the run is divided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub servers: usize,
    pub max_overlap: usize,
    pub warmup_ms: u64,
    pub epoch_ms: u64,
    /// Quiet time at the end of each epoch (settle and checkpoint).
    pub quiet_ms: u64,
    /// Time between two fault starts.
    pub gap_ms: (u64, u64),
    /// A server, or a thing a fault holds, rests this long between two
    /// faults on it: socklb has seen the server healthy again (more than
    /// the rise bound), and what each fault makes socklb say is told
    /// apart from the next one's.
    pub rest_ms: u64,
    /// The end of the run that draws no fault ending the daemon's life
    /// (a kill, an upgrade): one life long enough for its memory to be
    /// judged (a life of a few minutes is mostly its warm-up). 0: none.
    pub steady_daemon_ms: u64,
}

impl Shape {
    /// The shape of a run of `minutes`.
    pub fn for_minutes(minutes: u64) -> Self {
        Self {
            servers: 5,
            max_overlap: 2,
            // A tenth of the run, between 15 s and a minute.
            warmup_ms: (minutes * 6_000).clamp(15_000, 60_000),
            epoch_ms: 60_000,
            quiet_ms: 15_000,
            gap_ms: (1_500, 6_000),
            rest_ms: 5_000,
            // Runs of 20 minutes and more: the last third, at least 10
            // minutes.
            steady_daemon_ms: if minutes >= 20 {
                (minutes * 20_000).max(600_000)
            } else {
                0
            },
        }
    }
}

/// One fault of the schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub kind: FaultKind,
    /// The server it targets (for server faults, and the server the SLOTS
    /// rewrite points at).
    pub server: Option<usize>,
    pub variant: u32,
    /// From the start of the run (after setup).
    pub start_ms: u64,
    pub duration_ms: u64,
}

impl Planned {
    pub fn end_ms(&self) -> u64 {
        self.start_ms + self.duration_ms
    }

    pub fn spec(&self) -> &'static FaultSpec {
        super::catalogue::spec(self.kind)
    }

    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start_ms < end && start < self.end_ms()
    }
}

/// Quiet checkpoints: faults are over, the clients settle, everything is
/// compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checkpoint {
    pub at_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub seed: u64,
    pub shape: Shape,
    pub run_ms: u64,
    pub faults: Vec<Planned>,
    pub checkpoints: Vec<Checkpoint>,
}

/// The schedule of a run of `run_ms` from `seed`.
pub fn plan(seed: u64, run_ms: u64, shape: Shape) -> Schedule {
    let mut rng = Rng::new(seed);
    let mut faults = Vec::new();
    // The warm-up ends with the baseline checkpoint.
    let mut checkpoints = vec![Checkpoint {
        at_ms: shape.warmup_ms,
    }];
    let mut epoch_start = shape.warmup_ms;
    while epoch_start + shape.quiet_ms < run_ms {
        let epoch_end = (epoch_start + shape.epoch_ms).min(run_ms);
        let faults_end = epoch_end.saturating_sub(shape.quiet_ms);
        plan_epoch(
            &mut rng,
            &shape,
            (epoch_start, faults_end),
            run_ms,
            &mut faults,
        );
        checkpoints.push(Checkpoint { at_ms: faults_end });
        epoch_start = epoch_end;
    }
    Schedule {
        seed,
        shape,
        run_ms,
        faults,
        checkpoints,
    }
}

/// Faults from `start` until `end` (each over by then) of a run of
/// `run_ms`.
fn plan_epoch(
    rng: &mut Rng,
    shape: &Shape,
    (start, end): (u64, u64),
    run_ms: u64,
    faults: &mut Vec<Planned>,
) {
    let weights: Vec<u32> = CATALOGUE.iter().map(|spec| spec.weight).collect();
    let steady_from = if shape.steady_daemon_ms == 0 {
        u64::MAX
    } else {
        run_ms.saturating_sub(shape.steady_daemon_ms)
    };
    let mut at = start + rng.range(shape.gap_ms.0, shape.gap_ms.1);
    // Each turn places one fault or moves on; bounded however the draws go.
    for _ in 0..1000 {
        if at >= end {
            return;
        }
        let spec = &CATALOGUE[rng.weighted(&weights)];
        let duration = rng.range(spec.duration_ms.0, spec.duration_ms.1);
        let variant = rng.range(0, u64::from(spec.variants)) as u32;
        let server_draw = rng.next_u64();
        let ends_life_late = spec.kind.ends_daemon_life() && at + duration > steady_from;
        if at + duration <= end
            && !ends_life_late
            && let Some(fault) = place(spec, at, duration, variant, server_draw, shape, faults)
        {
            faults.push(fault);
            at += rng.range(shape.gap_ms.0, shape.gap_ms.1);
        } else {
            // Busy or too long here: try again a little later.
            at += 500;
        }
    }
}

/// The fault, if it fits at `at` beside those already placed.
fn place(
    spec: &FaultSpec,
    at: u64,
    duration: u64,
    variant: u32,
    server_draw: u64,
    shape: &Shape,
    faults: &[Planned],
) -> Option<Planned> {
    let end = at + duration;
    let overlapping: Vec<&Planned> = faults.iter().filter(|f| f.overlaps(at, end)).collect();
    // At most `max_overlap` active at any instant, this one included.
    if max_active(&overlapping, at, end) + 1 > shape.max_overlap {
        return None;
    }
    // Within its rest before or after this one.
    let near: Vec<&Planned> = faults
        .iter()
        .filter(|f| f.start_ms < end + shape.rest_ms && at < f.end_ms() + shape.rest_ms)
        .collect();
    let held = |resource: &Resource| near.iter().any(|f| f.spec().holds.contains(resource));
    if spec.holds.iter().any(held) {
        return None;
    }
    let server = if spec.on_server {
        let busy: Vec<usize> = near.iter().filter_map(|f| f.server).collect();
        let free: Vec<usize> = (0..shape.servers).filter(|s| !busy.contains(s)).collect();
        if free.is_empty() {
            return None;
        }
        Some(free[(server_draw % free.len() as u64) as usize])
    } else {
        None
    };
    Some(Planned {
        kind: spec.kind,
        server,
        variant,
        start_ms: at,
        duration_ms: duration,
    })
}

/// The most faults of `faults` active at one instant within `start..end`.
fn max_active(faults: &[&Planned], start: u64, end: u64) -> usize {
    let mut instants: Vec<u64> = faults
        .iter()
        .map(|fault| fault.start_ms.max(start))
        .collect();
    instants.push(start);
    instants
        .iter()
        .filter(|&&instant| instant < end)
        .map(|&instant| {
            faults
                .iter()
                .filter(|fault| fault.start_ms <= instant && instant < fault.end_ms())
                .count()
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thirty_minutes(seed: u64) -> Schedule {
        plan(seed, 30 * 60_000, Shape::for_minutes(30))
    }

    #[test]
    fn a_seed_replays_the_same_schedule() {
        assert_eq!(thirty_minutes(42), thirty_minutes(42));
        assert_ne!(thirty_minutes(42).faults, thirty_minutes(43).faults);
    }

    #[test]
    fn never_more_than_two_faults_at_once_nor_two_on_one_thing() {
        for seed in 0..50 {
            let schedule = thirty_minutes(seed);
            for fault in &schedule.faults {
                let others: Vec<&Planned> = schedule
                    .faults
                    .iter()
                    .filter(|other| {
                        *other != fault && other.overlaps(fault.start_ms, fault.end_ms())
                    })
                    .collect();
                let active = max_active(&others, fault.start_ms, fault.end_ms()) + 1;
                assert!(
                    active <= 2,
                    "seed {seed}: {active} at once around {fault:?}"
                );
                let rest = schedule.shape.rest_ms;
                for other in schedule.faults.iter().filter(|other| *other != fault) {
                    let close = other.overlaps(fault.start_ms, fault.end_ms() + rest);
                    let shared = fault
                        .spec()
                        .holds
                        .iter()
                        .any(|r| other.spec().holds.contains(r));
                    assert!(
                        !close
                            || (fault.server.is_none() || fault.server != other.server) && !shared,
                        "seed {seed}: one server or resource twice, or without its rest: {fault:?} {other:?}"
                    );
                }
                for other in others {
                    assert!(
                        !fault
                            .spec()
                            .holds
                            .iter()
                            .any(|r| other.spec().holds.contains(r)),
                        "seed {seed}: one resource twice: {fault:?} {other:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_last_third_of_a_long_run_keeps_one_daemon_life() {
        for seed in 0..20 {
            let schedule = thirty_minutes(seed);
            let steady_from = schedule.run_ms - schedule.shape.steady_daemon_ms;
            assert_eq!(steady_from, 20 * 60_000);
            assert!(
                schedule
                    .faults
                    .iter()
                    .all(|fault| !fault.kind.ends_daemon_life() || fault.end_ms() <= steady_from),
                "seed {seed}: the daemon's life ended in the last third"
            );
            assert!(
                schedule
                    .faults
                    .iter()
                    .any(|fault| fault.kind.ends_daemon_life()),
                "seed {seed}: before it, the daemon is killed and upgraded as ever"
            );
        }
        let short = plan(7, 2 * 60_000, Shape::for_minutes(2));
        assert_eq!(short.shape.steady_daemon_ms, 0);
    }

    #[test]
    fn faults_stay_out_of_the_warmup_and_the_quiet_checkpoints() {
        for seed in 0..20 {
            let schedule = thirty_minutes(seed);
            let shape = schedule.shape;
            for fault in &schedule.faults {
                assert!(fault.start_ms >= shape.warmup_ms);
                let epoch = (fault.start_ms - shape.warmup_ms) / shape.epoch_ms;
                let quiet = shape.warmup_ms + (epoch + 1) * shape.epoch_ms - shape.quiet_ms;
                assert!(
                    fault.end_ms() <= quiet,
                    "seed {seed}: {fault:?} runs into the checkpoint"
                );
            }
        }
    }

    #[test]
    fn a_thirty_minute_run_draws_every_fault_of_the_catalogue() {
        let schedule = thirty_minutes(1);
        for spec in CATALOGUE {
            assert!(
                schedule.faults.iter().any(|fault| fault.kind == spec.kind),
                "{} never drawn",
                spec.name
            );
        }
        assert_eq!(schedule.checkpoints.len(), 30, "warm-up plus one per epoch");
    }

    #[test]
    fn a_two_minute_run_has_faults_and_a_checkpoint_each_epoch() {
        let schedule = plan(9, 2 * 60_000, Shape::for_minutes(2));
        assert!(schedule.faults.len() >= 8, "{}", schedule.faults.len());
        assert_eq!(schedule.checkpoints.len(), 3);
    }
}
