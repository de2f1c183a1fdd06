//! socklb's lives: each process the harness started, how it ended, and
//! the times it could not act (the outages the detection bounds allow
//! for). Every exit the nemesis did not cause is a crash.

use std::time::Duration;

use socklb_tests::Daemon;

use super::{
    record::{Incarnation, Outage, now_ms},
    world::wait_until,
};

/// How long a new daemon may take to beat its first heartbeat.
const START_LIMIT: Duration = Duration::from_secs(30);
/// How long SIGTERM may take.
const EXIT_LIMIT: Duration = Duration::from_secs(15);

#[derive(Debug, Default)]
pub struct Lifecycle {
    pub incarnations: Vec<Incarnation>,
    pub outages: Vec<Outage>,
    /// Exits nobody asked for, and panics: (time, what).
    pub crashes: Vec<(u64, String)>,
    alive: bool,
}

impl Lifecycle {
    fn begin_outage(&mut self, at_ms: u64) {
        if self
            .outages
            .last()
            .is_none_or(|outage| outage.to_ms.is_some())
        {
            self.outages.push(Outage {
                from_ms: at_ms,
                to_ms: None,
            });
        }
    }

    fn end_outage(&mut self, at_ms: u64) {
        if let Some(outage) = self.outages.last_mut()
            && outage.to_ms.is_none()
        {
            outage.to_ms = Some(at_ms);
        }
    }

    fn ended(&mut self, why: String) {
        self.alive = false;
        if let Some(life) = self.incarnations.last_mut()
            && life.ended_ms.is_none()
        {
            life.ended_ms = Some(now_ms());
            life.end = Some(why);
        }
    }

    /// Waits for the daemon spawned at `started_ms` to run (its own
    /// heartbeat), and records its life; the outage before it ends then.
    /// `started_ms` is taken after the previous process was gone and
    /// before this one was spawned: the log lines of each life fall on
    /// their side of it.
    pub fn started(&mut self, daemon: &mut Daemon, started_ms: u64) -> bool {
        let Some(pid) = pid_of(daemon) else {
            return false;
        };
        let running = wait_until(START_LIMIT, || {
            daemon.status().is_some_and(|status| {
                status["daemon"]["pid"] == pid && status["daemon"]["running"] == true
            })
        });
        self.incarnations.push(Incarnation {
            pid,
            started_ms,
            ended_ms: None,
            end: None,
        });
        self.alive = true;
        if running {
            self.end_outage(now_ms());
        }
        running
    }

    pub fn is_alive(&self) -> bool {
        self.alive
    }

    /// Notices a daemon that exited by itself (a crash), records it, and
    /// starts a new one so that the run goes on.
    pub fn watch(&mut self, daemon: &mut Daemon) {
        if !self.alive {
            return;
        }
        if let Some(status) = daemon.wait_exit(Duration::from_millis(1)) {
            let at = now_ms();
            self.crashes
                .push((at, format!("socklb exited by itself: {status}")));
            self.ended(format!("exited by itself: {status}"));
            self.begin_outage(at);
            self.restart(daemon);
        }
    }

    pub fn kill(&mut self, daemon: &mut Daemon) {
        self.begin_outage(now_ms());
        daemon.kill();
        self.ended("SIGKILL (nemesis)".into());
    }

    /// Starts the same command again after a kill.
    pub fn restart(&mut self, daemon: &mut Daemon) -> bool {
        // restart() kills (a no-op for a process already gone) before it
        // spawns.
        daemon.kill();
        let started_ms = now_ms();
        daemon.restart();
        self.started(daemon, started_ms)
    }

    pub fn stop(&mut self, daemon: &Daemon) {
        self.begin_outage(now_ms());
        daemon.pause();
    }

    pub fn cont(&mut self, daemon: &Daemon) {
        daemon.resume();
        self.end_outage(now_ms());
    }

    /// An upgrade in place to the same build: SIGTERM (the data plane
    /// stays), then a new process on the same pins. Returns what went
    /// wrong, if anything.
    pub fn upgrade(&mut self, daemon: &mut Daemon) -> Option<String> {
        self.begin_outage(now_ms());
        daemon.signal(libc::SIGTERM);
        let problem = match daemon.wait_exit(EXIT_LIMIT) {
            Some(status) if status.success() => None,
            Some(status) => Some(format!("socklb exited with {status} on SIGTERM")),
            None => Some(format!(
                "socklb did not exit within {EXIT_LIMIT:?} of SIGTERM"
            )),
        };
        self.ended("SIGTERM (nemesis: upgrade)".into());
        if problem.is_some() {
            self.crashes
                .push((now_ms(), problem.clone().unwrap_or_default()));
        }
        if !self.restart(daemon) {
            return Some("the upgraded socklb did not run within 30 s".into());
        }
        problem
    }

    /// Closes the record at the end of the run.
    pub fn finish(&mut self) {
        self.ended("end of the run".into());
    }
}

fn pid_of(daemon: &mut Daemon) -> Option<u32> {
    // A daemon that exited at once has no PID to wait on.
    if daemon.wait_exit(Duration::from_millis(1)).is_some() {
        return None;
    }
    Some(daemon.pid())
}
