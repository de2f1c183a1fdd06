//! Taking the VIPs back after a hand-back. A daemon that starts and finds
//! some of its VIPs handed back (its predecessor's heartbeat older than
//! `daemon-gone-after`) adopts health verdicts that froze while no daemon
//! ran: a backend that died meanwhile is still listed as healthy, and the
//! connects sent to it would fail, where the balancer on the VIP now
//! serves them. So the heartbeat the connect programs read stays as found
//! until this daemon's own probes agree with every adopted verdict of
//! those services (a pass for a healthy backend, the fall for one that
//! died), or for a bounded time. Until then the VIPs stay handed back: no
//! connect fails in between.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use lb_common::Liveness;

use crate::planner::Layout;

/// The longest a takeover waits for the probes.
const MAX_WAIT: Duration = Duration::from_secs(60);

/// A takeover in progress: the backends whose verdicts the probes have not
/// confirmed yet.
#[derive(Debug)]
pub struct Takeover {
    waiting: BTreeSet<u32>,
    deadline: Instant,
    /// The services handed back when the daemon started.
    pub services: Vec<String>,
}

impl Takeover {
    /// At start: a takeover when a table of `layout` that hands back is
    /// handed back by the `pinned` heartbeat at `now_ns`; None otherwise
    /// (a first start, or a restart within `daemon-gone-after`).
    pub fn at_start(layout: &Layout, pinned: &Liveness, now_ns: u64, now: Instant) -> Option<Self> {
        let handed_back: Vec<_> = layout
            .tables
            .iter()
            .filter(|table| table.hand_back_after.is_some())
            .filter(|table| pinned.handed_back(table.table_id, now_ns))
            .collect();
        if handed_back.is_empty() {
            return None;
        }
        let wait = handed_back
            .iter()
            .map(|table| {
                let health = &table.health;
                let probe = health.interval.max(health.down_interval) + health.timeout;
                probe * (health.rise.max(health.fall) + 1)
            })
            .max()
            .unwrap_or_default()
            .min(MAX_WAIT);
        let mut services: Vec<String> = handed_back
            .iter()
            .map(|table| table.service.clone())
            .collect();
        services.dedup();
        Some(Self {
            waiting: handed_back
                .iter()
                .flat_map(|table| table.backends.iter().map(|backend| backend.id))
                .collect(),
            deadline: now + wait,
            services,
        })
    }

    /// A probe of `backend_id` answered as its verdict in the tables says.
    pub fn confirmed(&mut self, backend_id: u32) {
        self.waiting.remove(&backend_id);
    }

    /// Whether the heartbeat must still be held at `now`.
    pub fn holds(&self, now: Instant) -> bool {
        !self.waiting.is_empty() && now < self.deadline
    }

    /// Whether every verdict was confirmed (rather than the wait ending).
    pub fn all_confirmed(&self) -> bool {
        self.waiting.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_toml;

    const CONFIG: &str = r#"
        [[service]]
        name = "api"
        vips = ["127.0.0.1:6444"]
        backends = ["127.0.0.2:1", "127.0.0.3:1"]
        when-daemon-gone = "hand-back"
        daemon-gone-after = "2s"
        [[service]]
        name = "etcd"
        vips = ["127.0.0.1:2379"]
        backends = ["127.0.0.4:1"]
        when-daemon-gone = "keep"
    "#;

    fn layout() -> Layout {
        Layout::from_config(&parse_toml(CONFIG).unwrap(), |_| false)
    }

    fn pinned(heartbeat_ns: u64) -> Liveness {
        crate::dataplane::tables::liveness(&layout(), heartbeat_ns)
    }

    #[test]
    fn a_start_within_daemon_gone_after_takes_over_at_once() {
        let now = Instant::now();
        let fresh = 10_000_000_000 - 1_000_000_000;
        assert!(Takeover::at_start(&layout(), &pinned(fresh), 10_000_000_000, now).is_none());
        assert!(Takeover::at_start(&layout(), &Liveness::default(), 10_000_000_000, now).is_none());
    }

    #[test]
    fn a_start_that_finds_the_vips_handed_back_waits_for_every_verdict() {
        let now = Instant::now();
        let mut takeover =
            Takeover::at_start(&layout(), &pinned(1_000_000_000), 10_000_000_000, now)
                .expect("handed back: a takeover");
        assert_eq!(takeover.services, ["api"]);
        assert!(takeover.holds(now));
        takeover.confirmed(0);
        // etcd keeps redirecting: its backend is not waited for.
        takeover.confirmed(2);
        assert!(takeover.holds(now), "127.0.0.3 is not confirmed yet");
        takeover.confirmed(1);
        assert!(!takeover.holds(now) && takeover.all_confirmed());
    }

    #[test]
    fn a_takeover_ends_after_its_bound_without_an_answer() {
        let now = Instant::now();
        let takeover = Takeover::at_start(&layout(), &pinned(1_000_000_000), 10_000_000_000, now)
            .expect("a takeover");
        assert!(takeover.holds(now + Duration::from_secs(1)));
        assert!(!takeover.holds(now + MAX_WAIT));
        assert!(!takeover.all_confirmed());
    }
}
