//! `cargo xtask soak [--minutes N] [--seed S]`: socklb under a seeded
//! schedule of overlapping faults (a Jepsen-style nemesis; a seed replays
//! its schedule, as FoundationDB's simulations do), with every promise
//! checked the whole way:
//!
//! 1. connects succeed, but within the detection bound after a fault;
//! 2. no new connection lands on a server longer than that bound after
//!    it went down, hung or moved;
//! 3. at each quiet checkpoint, each backend's live count equals the
//!    sockets really open, and status, /metrics and the pinned maps agree;
//! 4. every fault socklb can see is said once in the log and counted once;
//! 5. nothing leaks: the daemon's memory, descriptors, threads and tasks,
//!    and every map's entries, stay flat;
//! 6. socklb never panics nor exits but when the nemesis makes it.
//!
//! The setup is in `world.rs`, the faults in `catalogue.rs` (data) and
//! `nemesis.rs` (actions), the schedule in `schedule.rs`, the clients in
//! `load.rs` and `soakclient`, the judgement in `verdicts.rs` and
//! `checkpoint.rs`, the report in `report.rs`.

mod catalogue;
mod checkpoint;
mod config;
mod cpu;
mod lifecycle;
mod load;
mod nemesis;
mod observe;
mod record;
mod report;
mod rng;
mod schedule;
mod verdicts;
mod world;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::PathBuf,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Result, bail};

use self::{
    checkpoint::Checked,
    lifecycle::Lifecycle,
    load::Load,
    nemesis::{Hands, Nemesis},
    observe::{LogTail, Sample},
    record::{Applied, Invariant, Violation, now_ms},
    schedule::{Schedule, Shape},
    verdicts::{AddressBook, Bounds, Judge},
    world::World,
};

/// How to run the soak.
#[derive(Debug, Clone)]
pub struct Options {
    pub minutes: u64,
    pub seed: Option<u64>,
    /// Where SOAK.md goes (its timeline beside it).
    pub report: PathBuf,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// How often, on average, the daemon's resources and every part's CPU
/// are read.
const PROCESS_SAMPLING: Duration = Duration::from_secs(10);

/// Each wait between two readings is drawn from half to one and a half
/// [`PROCESS_SAMPLING`]: at a fixed period the readings kept nearly the
/// same phase against what the daemon does on a period of its own (its
/// heap trim every 10 s, its probes), and that phase, drifting a little
/// each time, drew a slope that was not there (SOAK-FINDINGS §8: the
/// heap's resident pages +304.9 KiB/h by the soak's 10 s readings, −196.7
/// by a reader beside it at another phase). At random moments the
/// daemon's cycles are noise in the fit, not a trend.
fn next_sampling_wait(rng: &mut rng::Rng) -> Duration {
    let mean = PROCESS_SAMPLING.as_millis() as u64;
    Duration::from_millis(rng.range(mean / 2, mean + mean / 2))
}

/// The sampling moments' own stream of `seed`: they draw nothing from the
/// schedule's, so the same seed still plans the same faults.
fn sampling_rng(seed: u64) -> rng::Rng {
    const SAMPLING_STREAM: u64 = 0x5a3d_1e07_c0ff_ee00;
    rng::Rng::new(seed ^ SAMPLING_STREAM)
}

extern "C" fn interrupted(_signal: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Ctrl-C and SIGTERM end the run at the next step, so that every guard
/// cleans up (the children of the terminal's process group get the
/// signal too: socklb exits, the clients die).
fn catch_interrupts() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, interrupted as *const () as libc::sighandler_t);
        libc::signal(
            libc::SIGTERM,
            interrupted as *const () as libc::sighandler_t,
        );
    }
}

fn is_interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

pub fn run(options: &Options) -> Result<()> {
    if !crate::is_root() {
        bail!("cargo xtask soak loads eBPF programs, makes namespaces and cgroups: run it as root");
    }
    let seed = options.seed.unwrap_or_else(rng::fresh_seed);
    let target = crate::workspace_root().join("target/debug");
    // SAFETY: set before the run starts a thread; the helpers read them.
    // A SOCKLB_BIN already set is kept: the daemon run under a profiler's
    // wrapper, say (docs/testing.md).
    unsafe {
        if std::env::var_os("SOCKLB_BIN").is_none() {
            std::env::set_var("SOCKLB_BIN", target.join("socklb"));
        }
        std::env::set_var("LBCLIENT_BIN", target.join("lbclient"));
    }
    println!(
        "soak: seed {seed} (replay: cargo xtask soak --minutes {} --seed {seed})",
        options.minutes
    );
    let schedule = schedule::plan(
        seed,
        options.minutes.max(1) * 60_000,
        Shape::for_minutes(options.minutes),
    );
    println!(
        "soak: {} faults over {} min, {} checkpoints",
        schedule.faults.len(),
        options.minutes,
        schedule.checkpoints.len()
    );
    crate::sweep_leftovers();
    world::sweep_v1_cgroups();
    catch_interrupts();
    let mut soak = Soak::start(schedule)?;
    soak.execute();
    let outcome = soak.finish();
    // An interrupted run never replaces a report of a whole one.
    let report_path = if is_interrupted() {
        crate::workspace_root().join("target/soak/SOAK-interrupted.md")
    } else {
        options.report.clone()
    };
    let written = report::write(&report_path, &outcome)?;
    println!("soak: report {}", written.display());
    if is_interrupted() {
        bail!("soak interrupted (seed {seed})");
    }
    let count = outcome.violations.len();
    if count > 0 || !outcome.harness_problems.is_empty() {
        bail!(
            "soak: {count} violations, {} harness problems (seed {seed}); see {}",
            outcome.harness_problems.len(),
            written.display()
        );
    }
    println!("soak: every invariant held (seed {seed})");
    Ok(())
}

/// What the agenda does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    // At one instant: ends first, then checkpoints, then starts.
    End(usize),
    Finish(usize),
    Checkpoint(usize),
    Next(usize),
    Start(usize),
}

/// A run in progress.
struct Soak {
    load: Option<Load>,
    world: World,
    life: Lifecycle,
    nemesis: Nemesis,
    log: LogTail,
    schedule: Schedule,
    applied: Vec<Option<Applied>>,
    checked: Vec<Checked>,
    samples: Vec<Sample>,
    violations: Vec<Violation>,
    harness_problems: Vec<String>,
    bounds: Bounds,
    /// When the run began (time 0 of the report).
    t0_ms: u64,
    /// How much later than planned the schedule runs: an action that ran
    /// late moves what follows.
    late_ms: u64,
    subnet_taken: bool,
    subnet_checked: Instant,
    cpu: cpu::CpuMeter,
    /// The daemon's resources, every few seconds.
    process_samples: Vec<Sample>,
    /// When the daemon's resources are read next, and the draws that
    /// place the readings ([`next_sampling_wait`]).
    process_due: Instant,
    sampling: rng::Rng,
    /// The commit whose binaries run (read when they were started: the
    /// tree may move on during a long run).
    commit: String,
}

/// Everything the report needs.
pub struct Outcome {
    /// The commit whose binaries ran.
    pub commit: String,
    pub schedule: Schedule,
    pub t0_ms: u64,
    pub end_ms: u64,
    pub bounds: Bounds,
    pub applied: Vec<Applied>,
    pub checked: Vec<Checked>,
    pub samples: Vec<Sample>,
    pub process_samples: Vec<Sample>,
    pub violations: Vec<Violation>,
    pub connects: verdicts::ConnectVerdict,
    pub silent: verdicts::SilentVerdict,
    pub spurious: Vec<String>,
    pub slopes: Vec<(String, Option<verdicts::Slope>)>,
    pub lives: Vec<record::Incarnation>,
    pub outages: Vec<record::Outage>,
    pub recorded: load::Recorded,
    pub harness_problems: Vec<String>,
    pub cpu: Vec<(String, f64)>,
}

impl Soak {
    fn start(schedule: Schedule) -> Result<Self> {
        let started = Instant::now();
        println!("soak: setting up five server namespaces, etcd, the test apiserver and socklb");
        let mut world = World::start()?;
        let mut life = Lifecycle::default();
        let spawned_ms = world.daemon_spawned_ms;
        if !life.started(world.daemon_mut(), spawned_ms) {
            bail!("socklb did not start:\n{}", world.daemon().log());
        }
        let expected: Vec<SocketAddr> = world
            .backends(&[])
            .into_iter()
            .map(|(_, addr)| addr)
            .collect();
        if let Err(missing) = checkpoint::settle(&world, &expected) {
            bail!(
                "socklb did not see every backend healthy: {}\n{}",
                missing.join(", "),
                world.daemon().log()
            );
        }
        let health = config::check(&std::fs::read_to_string(&world.config_path)?)?;
        let settings = &health.services[0].health;
        let bounds = Bounds::from_health(
            settings.interval,
            settings.down_interval,
            settings.timeout,
            settings.rise,
            settings.fall,
        );
        let load = Load::start(&world)?;
        let log = LogTail::new(world.daemon().log_path());
        println!(
            "soak: set up in {:.0} s; detection bound {} ms, rise {} ms, repair {} ms",
            started.elapsed().as_secs_f64(),
            bounds.detect_ms,
            bounds.rise_ms,
            bounds.repair_ms
        );
        let applied = vec![None; schedule.faults.len()];
        let sampling = sampling_rng(schedule.seed);
        let cpu = cpu::CpuMeter::start();
        Ok(Self {
            load: Some(load),
            world,
            life,
            nemesis: Nemesis::new(bounds),
            log,
            schedule,
            applied,
            checked: Vec::new(),
            samples: Vec::new(),
            violations: Vec::new(),
            harness_problems: Vec::new(),
            bounds,
            t0_ms: now_ms(),
            late_ms: 0,
            subnet_taken: false,
            subnet_checked: Instant::now(),
            cpu,
            process_samples: Vec::new(),
            process_due: Instant::now() + PROCESS_SAMPLING,
            sampling,
            commit: report::head_commit(),
        })
    }

    fn agenda(&self) -> Vec<(u64, Step)> {
        let mut agenda: Vec<(u64, Step)> = Vec::new();
        for (index, fault) in self.schedule.faults.iter().enumerate() {
            agenda.push((fault.start_ms, Step::Start(index)));
            agenda.push((fault.end_ms(), Step::End(index)));
        }
        for (index, checkpoint) in self.schedule.checkpoints.iter().enumerate() {
            agenda.push((checkpoint.at_ms, Step::Checkpoint(index)));
        }
        agenda
    }

    /// Runs the agenda to its end (or an interrupt).
    fn execute(&mut self) {
        let mut agenda = self.agenda();
        // Bounded: every step is taken once, and steps add only a bounded
        // number of follow-ups (a flap's every 450 ms).
        while !agenda.is_empty() && !is_interrupted() {
            agenda.sort();
            let (at, step) = agenda.remove(0);
            self.wait_until(self.t0_ms + self.late_ms + at);
            if is_interrupted() {
                break;
            }
            // An action that took long (a restart, a checkpoint that waited
            // for socklb to settle) delays what follows, all of it alike:
            // the faults keep the overlaps the schedule planned.
            let late = now_ms().saturating_sub(self.t0_ms + self.late_ms + at);
            if late > 200 {
                self.late_ms += late;
            }
            if let Some(next) = self.take(step) {
                let due =
                    now_ms().saturating_sub(self.t0_ms + self.late_ms) + next.as_millis() as u64;
                match step.follow_up() {
                    Step::Next(index) if due < self.schedule.faults[index].end_ms() => {
                        agenda.push((due, Step::Next(index)));
                    }
                    Step::Finish(index) => agenda.push((due, Step::Finish(index))),
                    _ => {}
                }
            }
        }
        let end = self.t0_ms + self.late_ms + self.schedule.run_ms;
        self.wait_until(end);
    }

    /// Keeps watch until `deadline_ms`: socklb's exits, the log, the
    /// clients.
    fn wait_until(&mut self, deadline_ms: u64) {
        // Bounded by the deadline; each turn is about 200 ms.
        while now_ms() < deadline_ms && !is_interrupted() {
            self.life.watch(self.world.daemon_mut());
            if Instant::now() >= self.process_due {
                self.process_due = Instant::now() + next_sampling_wait(&mut self.sampling);
                self.observe_processes();
            }
            self.log.poll();
            if let Some(load) = self.load.as_mut() {
                for exited in load.exited() {
                    if !self.harness_problems.contains(&exited) {
                        self.harness_problems.push(exited);
                    }
                }
            }
            if !self.subnet_taken && self.subnet_checked.elapsed() > Duration::from_secs(5) && {
                self.subnet_checked = Instant::now();
                self.world.subnet_taken()
            } {
                self.subnet_taken = true;
                self.harness_problems.push(format!(
                    "at +{:.0} s another test cluster took this run's subnet: from then on connections may reach its servers, and what follows says nothing of socklb",
                    self.elapsed_s()
                ));
            }
            let left = deadline_ms.saturating_sub(now_ms());
            std::thread::sleep(Duration::from_millis(left.min(200)));
        }
    }

    fn take(&mut self, step: Step) -> Option<Duration> {
        let elapsed_s = self.elapsed_s();
        let mut hands = Hands {
            world: &mut self.world,
            life: &mut self.life,
        };
        match step {
            Step::Start(index) => {
                let planned = self.schedule.faults[index].clone();
                let mut applied = Applied::new(planned, now_ms());
                println!("soak: +{elapsed_s:>5.1} s {}", applied.name());
                let next = self
                    .nemesis
                    .start(&mut hands, &mut applied)
                    .unwrap_or_else(|error| {
                        self.harness_problems
                            .push(format!("{}: starting failed: {error:#}", applied.name()));
                        None
                    });
                self.applied[index] = Some(applied);
                next
            }
            Step::Next(index) => {
                let applied = self.applied[index].as_mut()?;
                applied.action_ms = now_ms();
                self.nemesis
                    .step(&mut hands, applied)
                    .unwrap_or_else(|error| {
                        self.harness_problems
                            .push(format!("{}: a step failed: {error:#}", applied.name()));
                        None
                    })
            }
            Step::End(index) => {
                let applied = self.applied[index].as_mut()?;
                // The fault is over when its end begins (a server is back
                // as soon as it listens again).
                applied.end_ms = Some(now_ms());
                applied.action_ms = now_ms();
                self.nemesis
                    .end(&mut hands, applied)
                    .unwrap_or_else(|error| {
                        self.harness_problems
                            .push(format!("{}: ending failed: {error:#}", applied.name()));
                        None
                    })
            }
            Step::Finish(index) => {
                let applied = self.applied[index].as_mut()?;
                applied.action_ms = now_ms();
                if let Err(error) = self.nemesis.finish(&mut hands, applied) {
                    self.harness_problems.push(format!(
                        "{}: its last step failed: {error:#}",
                        applied.name()
                    ));
                }
                None
            }
            Step::Checkpoint(index) => {
                self.checkpoint(index);
                None
            }
        }
    }

    /// CPU of every part, and the daemon's resources (invariant 5).
    fn observe_processes(&mut self) {
        if self.life.is_alive() {
            let pid = self.world.daemon().pid();
            self.cpu.observe("socklb", pid);
            let mut values = BTreeMap::new();
            observe::process_sample(pid, &self.world.node.cpu, &mut values);
            observe::heap_sample(self.world.metrics, &mut values);
            let life = self.life.incarnations.len().saturating_sub(1) as u32;
            self.process_samples.push(Sample {
                t_ms: now_ms(),
                life,
                values,
            });
        }
        let local = self.world.local.iter().filter_map(|local| local.pid());
        for pid in self
            .world
            .servers
            .iter()
            .filter_map(|server| server.pid())
            .chain(local)
        {
            self.cpu.observe("servers (soakserver)", pid);
        }
        for pid in self.world.etcd.iter().filter_map(|member| member.pid()) {
            self.cpu.observe("etcd members", pid);
        }
        for pid in self.load.iter().flat_map(Load::pids) {
            self.cpu.observe("clients (soakclient)", pid);
        }
    }

    fn elapsed_s(&self) -> f64 {
        now_ms().saturating_sub(self.t0_ms) as f64 / 1000.0
    }

    fn active_names(&self, at_ms: u64) -> Vec<String> {
        self.applied
            .iter()
            .flatten()
            .filter(|fault| fault.active_at(at_ms))
            .map(Applied::name)
            .collect()
    }

    /// A quiet checkpoint: settle, pause the clients, compare, sample.
    fn checkpoint(&mut self, index: usize) {
        let at_ms = now_ms();
        let mut checked = Checked {
            at_ms,
            ..Checked::default()
        };
        let expected: Vec<SocketAddr> = self
            .world
            .backends(&self.nemesis.moved)
            .into_iter()
            .map(|(_, addr)| addr)
            .collect();
        match checkpoint::settle(&self.world, &expected) {
            Ok(took) => checked.settle_ms = took.as_millis() as u64,
            Err(missing) => {
                self.violations.push(Violation {
                    invariant: Invariant::ExactAgreement,
                    at_ms,
                    active: self.active_names(at_ms),
                    what: format!(
                        "checkpoint {index}: socklb did not settle within 45 s of the faults' end: {} (seed {})",
                        missing.join(", "),
                        self.schedule.seed
                    ),
                });
            }
        }
        let paused = self.load.as_mut().is_some_and(Load::pause);
        if !paused {
            self.harness_problems
                .push(format!("checkpoint {index}: a client did not pause"));
        }
        // Closes in flight reach both ends.
        std::thread::sleep(Duration::from_secs(1));
        checkpoint::agreement(&self.world, &expected, &mut checked);
        let life = self.life.incarnations.last().cloned();
        let problems = life
            .map(|life| checkpoint::counters(&self.world, &mut self.log, &life, &mut checked))
            .unwrap_or_default();
        self.violations.extend(checkpoint::violations(
            &checked,
            &problems,
            self.schedule.seed,
        ));
        self.sample(at_ms);
        if let Some(load) = self.load.as_mut() {
            load.resume();
        }
        println!(
            "soak: +{:>5.1} s checkpoint {index}: {} ({} readings)",
            self.elapsed_s(),
            if checked.agreed {
                "agreed"
            } else {
                "NO AGREEMENT"
            },
            checked.readings
        );
        self.checked.push(checked);
    }

    fn sample(&mut self, at_ms: u64) {
        let mut values = BTreeMap::new();
        observe::map_sample(&self.world.daemon().pin_path, &mut values);
        let life = self.life.incarnations.len().saturating_sub(1) as u32;
        self.samples.push(Sample {
            t_ms: at_ms,
            life,
            values,
        });
    }

    fn finish(mut self) -> Outcome {
        let end_ms = now_ms();
        self.observe_processes();
        let cpu = self.cpu.finish(end_ms);
        let recorded = self
            .load
            .take()
            .map(|load| std::mem::take(&mut *load.recorded.lock().expect("record")))
            .unwrap_or_default();
        self.life.finish();
        self.log.poll();
        let applied: Vec<Applied> = self.applied.iter().flatten().cloned().collect();
        self.crashes(&applied, end_ms);
        let book = self.address_book();
        let judge = Judge {
            applied: &applied,
            outages: &self.life.outages,
            bounds: self.bounds,
            book: &book,
        };
        let seed = self.schedule.seed;
        let connects = judge.connects(&recorded.connects, seed);
        self.violations.extend(connects.violations.iter().cloned());
        let silent = verdicts::expectations(&self.log.lines, &applied, &self.life.outages, seed);
        self.violations.extend(silent.violations.iter().cloned());
        let spurious = report::spurious_transitions(&self.log.lines, &applied, &book, self.bounds);
        let slopes = self.leaks(end_ms);
        self.keep_logs();
        self.violations.sort_by_key(|violation| violation.at_ms);
        Outcome {
            commit: self.commit.clone(),
            schedule: self.schedule.clone(),
            t0_ms: self.t0_ms,
            end_ms,
            bounds: self.bounds,
            applied,
            checked: std::mem::take(&mut self.checked),
            samples: std::mem::take(&mut self.samples),
            process_samples: std::mem::take(&mut self.process_samples),
            violations: std::mem::take(&mut self.violations),
            connects,
            silent,
            spurious,
            slopes,
            lives: self.life.incarnations.clone(),
            outages: self.life.outages.clone(),
            recorded,
            harness_problems: std::mem::take(&mut self.harness_problems),
            cpu,
        }
    }

    /// Invariant 6 (exits and panics), and the kernel state the nemesis
    /// found unrepaired at a fault's end (invariant 4).
    fn crashes(&mut self, applied: &[Applied], end_ms: u64) {
        let seed = self.schedule.seed;
        let active = |at_ms: u64| -> Vec<String> {
            applied
                .iter()
                .filter(|f| f.active_at(at_ms))
                .map(Applied::name)
                .collect()
        };
        for (at_ms, crash) in &self.life.crashes {
            self.violations.push(Violation {
                invariant: Invariant::NoCrash,
                at_ms: *at_ms,
                active: active(*at_ms),
                what: format!("{crash} (seed {seed})"),
            });
        }
        for panic in self.log.panics() {
            self.violations.push(Violation {
                invariant: Invariant::NoCrash,
                at_ms: end_ms,
                active: Vec::new(),
                what: format!("a panic: {panic} (seed {seed})"),
            });
        }
        for fault in applied {
            for breach in &fault.breaches {
                self.violations.push(Violation {
                    invariant: Invariant::NothingSilent,
                    at_ms: fault.end_ms.unwrap_or(end_ms),
                    active: active(fault.start_ms),
                    what: format!("not repaired: {breach} (seed {seed})"),
                });
            }
        }
    }

    /// Invariant 5: every sampled figure's slope.
    fn leaks(&mut self, end_ms: u64) -> Vec<(String, Option<verdicts::Slope>)> {
        let warm_from_ms = self.schedule.shape.warmup_ms + self.t0_ms;
        let slopes = report::slopes(
            &self.process_samples,
            &self.samples,
            &self.life,
            warm_from_ms,
        );
        for (name, slope) in &slopes {
            // Only growth is a leak: a count that falls (threads of the
            // blocking pool ending) is not.
            let Some(slope) = slope.filter(|slope| report::is_leak(name, slope)) else {
                continue;
            };
            self.violations.push(Violation {
                invariant: Invariant::NoLeak,
                at_ms: end_ms,
                active: Vec::new(),
                what: format!(
                    "{name} grows {:+.1}/h (resolution ±{:.1}/h over {} samples; seed {})",
                    slope.per_hour, slope.resolution_per_hour, slope.samples, self.schedule.seed
                ),
            });
        }
        slopes
    }

    fn address_book(&self) -> AddressBook {
        let mut book = AddressBook::default();
        for (index, addrs) in self.world.addrs.iter().enumerate() {
            for addr in [
                addrs.tls(false),
                addrs.tls(true),
                addrs.plain(),
                addrs.etcd(),
            ] {
                book.servers.insert(addr, index);
            }
        }
        book.vips = vec![
            self.world.inputs.api_vip,
            self.world.inputs.plain_vip,
            self.world.inputs.etcd_vip,
        ];
        book
    }

    /// socklb's log and the servers' go to target/soak/ before the guards
    /// remove them.
    fn keep_logs(&self) {
        let dir = crate::workspace_root().join("target/soak");
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::copy(self.world.daemon().log_path(), dir.join("socklb.log"));
        for entry in std::fs::read_dir(&self.world.dir.0)
            .into_iter()
            .flatten()
            .flatten()
        {
            if entry.path().extension().is_some_and(|ext| ext == "log") {
                let _ = std::fs::copy(entry.path(), dir.join(entry.file_name()));
            }
        }
    }
}

impl Step {
    /// The step that continues a fault with steps.
    fn follow_up(self) -> Step {
        match self {
            Step::Start(index) | Step::Next(index) => Step::Next(index),
            Step::End(index) => Step::Finish(index),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_are_drawn_around_the_mean_and_replay_from_the_seed() {
        let draw = |seed: u64| -> Vec<Duration> {
            let mut rng = sampling_rng(seed);
            (0..600).map(|_| next_sampling_wait(&mut rng)).collect()
        };
        let waits = draw(618_430_790);
        assert_eq!(waits, draw(618_430_790));
        assert_ne!(waits, draw(618_430_791));
        let (low, high) = (PROCESS_SAMPLING / 2, PROCESS_SAMPLING * 3 / 2);
        assert!(waits.iter().all(|wait| (low..high).contains(wait)));
        let mean = waits.iter().sum::<Duration>() / waits.len() as u32;
        // 600 uniform draws: the mean's standard error is 118 ms.
        assert!(
            mean.abs_diff(PROCESS_SAMPLING) < Duration::from_millis(600),
            "{mean:?}"
        );
        // Spread over the whole range, not one phase.
        let quarter = PROCESS_SAMPLING / 4;
        assert!(waits.iter().any(|wait| *wait < low + quarter));
        assert!(waits.iter().any(|wait| *wait >= high - quarter));
    }
}
