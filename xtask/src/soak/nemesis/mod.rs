//! The nemesis's hands: how each fault of the catalogue starts and ends,
//! and what socklb must say about it (the log lines of invariant 4,
//! within their bounds). One module per group of the catalogue.

mod daemon;
mod discovery;
mod kernel;
mod node;
mod servers;

use std::time::Duration;

use anyhow::Result;

use super::{
    catalogue::Group,
    lifecycle::Lifecycle,
    record::{Applied, Count, Expectation},
    verdicts::Bounds,
    world::World,
};

use discovery::DISCOVERY_SAID;
pub use node::{MEMORY_HEADROOM, STARVED_PERCENT};

/// What the nemesis changes and must undo.
pub struct Nemesis {
    pub bounds: Bounds,
    /// Servers at their second address.
    pub moved: Vec<usize>,
    /// Flapping servers that are down now.
    flapping_down: Vec<usize>,
    /// `api.stats().gone_sent` before a 410 fault.
    gone_before: u64,
    /// memory.oom_control's kills and memory.failcnt before the pressure.
    oom_before: u64,
    failures_before: u64,
}

/// What the nemesis needs of the run.
pub struct Hands<'a> {
    pub world: &'a mut World,
    pub life: &'a mut Lifecycle,
}

/// Words of a log line, owned.
fn said(words: &[&str]) -> Vec<String> {
    words.iter().map(ToString::to_string).collect()
}

/// socklb must say it `count` times within `within` of the action that
/// caused it (`Applied::action_ms`).
fn expect(applied: &mut Applied, what: &str, words: Vec<String>, count: Count, within: Duration) {
    let from_ms = applied.action_ms;
    applied.expectations.push(Expectation {
        what: what.to_string(),
        words,
        count,
        from_ms,
        until_ms: from_ms + within.as_millis() as u64,
    });
}

impl Nemesis {
    pub fn new(bounds: Bounds) -> Self {
        Self {
            bounds,
            moved: Vec::new(),
            flapping_down: Vec::new(),
            gone_before: 0,
            oom_before: 0,
            failures_before: 0,
        }
    }

    /// Time for a transition to be said after a fault on a server.
    fn detect(&self) -> Duration {
        Duration::from_millis(self.bounds.detect_ms + 1000)
    }

    /// Time for a server back to be said healthy.
    fn rise(&self) -> Duration {
        Duration::from_millis(self.bounds.rise_ms + 2000)
    }

    /// Time for a repair to be said.
    fn repair(&self) -> Duration {
        Duration::from_millis(self.bounds.repair_ms + 1000)
    }

    /// Starts a fault; returns when its next step is due, if it has one.
    pub fn start(&mut self, hands: &mut Hands, applied: &mut Applied) -> Result<Option<Duration>> {
        match applied.planned.spec().group {
            Group::Server => self.start_server(hands.world, applied),
            Group::Daemon => self.start_daemon(hands, applied),
            Group::Discovery => self.start_discovery(hands, applied),
            Group::Kernel => self.start_kernel(hands.world, applied),
            Group::Node => self.start_node(hands.world, applied),
        }
    }

    /// The next step of a fault that has steps.
    pub fn step(&mut self, hands: &mut Hands, applied: &mut Applied) -> Result<Option<Duration>> {
        match applied.planned.spec().group {
            Group::Server => self.step_server(hands.world, applied),
            Group::Daemon => self.step_daemon(hands, applied),
            _ => Ok(None),
        }
    }

    /// Ends a fault: everything as it was. Returns when a last step is
    /// due (`finish`), if the fault has one.
    pub fn end(&mut self, hands: &mut Hands, applied: &mut Applied) -> Result<Option<Duration>> {
        match applied.planned.spec().group {
            Group::Server => self.end_server(hands.world, applied),
            Group::Daemon => self.end_daemon(hands, applied).map(|()| None),
            Group::Discovery => self.end_discovery(hands.world, applied).map(|()| None),
            Group::Kernel => self.end_kernel(hands.world, applied).map(|()| None),
            Group::Node => self.end_node(hands.world, applied).map(|()| None),
        }
    }

    /// The last step of a fault, after its end.
    pub fn finish(&mut self, hands: &mut Hands, applied: &mut Applied) -> Result<()> {
        match applied.planned.spec().group {
            Group::Server => self.finish_server(hands.world, applied),
            _ => Ok(()),
        }
    }
}
