//! The invariants over a run's record: pure functions of what was
//! recorded, tested on made-up histories.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use super::{
    catalogue::ServerEffect,
    record::{Applied, Connect, ConnectKind, Invariant, LogLine, Outage, Violation},
};

/// Time for what no interval or timeout covers: the event loop's turn,
/// writing the tables, close-on-failure's sweep of the sockets, and two
/// shared cores that also run the servers and a few hundred clients.
pub const SLACK: Duration = Duration::from_millis(750);

/// The daemon's verification pass runs every tick (500 ms); DESIGN.md
/// promises a repair within a second.
pub const REPAIR: Duration = Duration::from_secs(1);

/// The bounds the invariants allow, from the configured health settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// From a fault to the server being out of the tables (and its
    /// connections closed).
    pub detect_ms: u64,
    /// From a server being back to it being healthy again.
    pub rise_ms: u64,
    /// From a change to socklb's kernel state to its repair.
    pub repair_ms: u64,
}

impl Bounds {
    /// A probe starts at most `interval` (plus its 20% jitter) after the
    /// fault; each of the `fall` failing probes starts
    /// max(jittered interval, timeout) after the one before and takes at
    /// most `timeout`. Rising back is the same with `rise` passed probes,
    /// at the down interval.
    pub fn from_health(
        interval: Duration,
        down_interval: Duration,
        timeout: Duration,
        rise: u32,
        fall: u32,
    ) -> Self {
        let ms = |duration: Duration| duration.as_millis() as u64;
        let cycle = |interval: Duration, count: u32| {
            let jittered = ms(interval) * 12 / 10;
            jittered
                + u64::from(count.saturating_sub(1)) * jittered.max(ms(timeout))
                + ms(timeout)
                + ms(SLACK)
        };
        Self {
            detect_ms: cycle(interval, fall),
            rise_ms: cycle(down_interval, rise),
            repair_ms: ms(REPAIR) + ms(SLACK),
        }
    }
}

/// `start + bound`, with the bound counting only time socklb could act:
/// every outage it overlaps lengthens it. None while an outage that
/// started in it has not ended.
pub fn deadline(start_ms: u64, bound_ms: u64, outages: &[Outage]) -> Option<u64> {
    let mut deadline = start_ms + bound_ms;
    // Each turn takes in the outages the longer deadline reaches.
    for _ in 0..=outages.len() {
        let mut lost = 0;
        for outage in outages {
            if outage.from_ms > deadline {
                continue;
            }
            let to = outage.to_ms?;
            if to > start_ms {
                lost += to - outage.from_ms.max(start_ms);
            }
        }
        let next = start_ms + bound_ms + lost;
        if next == deadline {
            break;
        }
        deadline = next;
    }
    Some(deadline)
}

/// Which backend an address is, for the report.
#[derive(Debug, Clone, Default)]
pub struct AddressBook {
    /// Address → server index.
    pub servers: BTreeMap<SocketAddr, usize>,
    /// The VIPs: a connect that arrives there passed unredirected.
    pub vips: Vec<SocketAddr>,
}

/// What the connects say about invariants 1 and 2.
#[derive(Debug, Clone, Default)]
pub struct ConnectVerdict {
    pub by_kind: BTreeMap<ConnectKind, (u64, u64)>,
    /// Failures within a bound after a fault.
    pub allowed: u64,
    pub unknown_destination: u64,
    /// Answers from a server other than the one the lookup found.
    pub mismatched: u64,
    pub violations: Vec<Violation>,
}

/// The fault windows one connect is judged against.
pub struct Judge<'a> {
    pub applied: &'a [Applied],
    pub outages: &'a [Outage],
    pub bounds: Bounds,
    pub book: &'a AddressBook,
}

/// A little early, for clocks read a moment apart.
const EARLY_MS: u64 = 200;

impl Judge<'_> {
    fn active(&self, at_ms: u64) -> Vec<String> {
        self.applied
            .iter()
            .filter(|fault| fault.active_at(at_ms))
            .map(Applied::name)
            .collect()
    }

    fn within(&self, at_ms: u64, start_ms: u64, bound_ms: u64) -> bool {
        at_ms + EARLY_MS >= start_ms
            && deadline(start_ms, bound_ms, self.outages).is_none_or(|deadline| at_ms <= deadline)
    }

    /// Whether a failed connect to `dst` (None: unknown) at `at_ms` falls
    /// within a bound after a fault that explains it.
    fn excused(&self, at_ms: u64, dst: Option<SocketAddr>) -> bool {
        let bound = self.bounds.detect_ms;
        self.applied.iter().any(|fault| {
            let spec = fault.planned.spec();
            let unredirected =
                spec.unredirected && self.within(at_ms, fault.start_ms, self.bounds.repair_ms);
            let to_vip = dst.is_none_or(|dst| self.book.vips.contains(&dst));
            if unredirected && to_vip {
                return true;
            }
            let on_it = dst.is_none_or(|dst| {
                fault.fault_addrs.contains(&dst) || fault.stale_after_end.contains(&dst)
            });
            if !on_it || spec.effect == ServerEffect::None || spec.effect == ServerEffect::Slow {
                return false;
            }
            let after_start = self.within(at_ms, fault.start_ms, bound);
            let after_end = fault
                .end_ms
                .is_some_and(|end| self.within(at_ms, end, bound));
            let throughout = spec.effect == ServerEffect::Flapping && fault.active_at(at_ms);
            after_start || after_end || throughout
        })
    }

    /// A new connection to an address that should have been out of the
    /// tables for longer than the bound.
    fn stale(&self, at_ms: u64, dst: SocketAddr) -> Option<&Applied> {
        let bound = self.bounds.detect_ms;
        self.applied.iter().find(|fault| {
            let effect = fault.planned.spec().effect;
            let out = matches!(
                effect,
                ServerEffect::Down
                    | ServerEffect::Hung
                    | ServerEffect::Unreachable
                    | ServerEffect::Moved
            );
            let during = out
                && fault.fault_addrs.contains(&dst)
                && deadline(fault.start_ms, bound, self.outages)
                    .is_some_and(|deadline| at_ms > deadline)
                && fault.end_ms.is_none_or(|end| at_ms < end);
            // Until the server moves there again.
            let moved_again = self
                .applied
                .iter()
                .filter(|other| {
                    other.planned.server == fault.planned.server
                        && other.planned.kind == fault.planned.kind
                        && other.start_ms > fault.start_ms
                })
                .map(|other| other.start_ms)
                .min();
            let after = fault.stale_after_end.contains(&dst)
                && moved_again.is_none_or(|again| at_ms < again)
                && fault
                    .end_ms
                    .and_then(|end| deadline(end, bound, self.outages))
                    .is_some_and(|deadline| at_ms > deadline);
            // A restart is over before the bound: nothing to be stale on.
            (during && fault.planned.kind != super::catalogue::FaultKind::ServerRestart) || after
        })
    }

    /// Invariants 1 and 2 over every connect.
    pub fn connects(&self, connects: &[Connect], seed: u64) -> ConnectVerdict {
        let mut verdict = ConnectVerdict::default();
        for connect in connects {
            let entry = verdict.by_kind.entry(connect.kind).or_default();
            entry.0 += 1;
            if connect.dst.is_none() && connect.kind != ConnectKind::Etcd {
                verdict.unknown_destination += 1;
            }
            if let (Some(dst), Some(server)) = (connect.dst, connect.server)
                && self
                    .book
                    .servers
                    .get(&dst)
                    .is_some_and(|index| *index != usize::from(server))
            {
                verdict.mismatched += 1;
            }
            if let Some(dst) = connect.dst
                && let Some(fault) = self.stale(connect.t_ms, dst)
            {
                verdict.violations.push(Violation {
                    invariant: Invariant::NoStaleChoice,
                    at_ms: connect.t_ms,
                    active: self.active(connect.t_ms),
                    what: format!(
                        "a new {} connection went to {dst}, {} ms after {} began (bound {} ms; seed {seed})",
                        connect.kind.label(),
                        connect.t_ms.saturating_sub(fault.start_ms),
                        fault.name(),
                        self.bounds.detect_ms
                    ),
                });
            }
            if connect.ok {
                continue;
            }
            entry.1 += 1;
            if self.excused(connect.t_ms, connect.dst) {
                verdict.allowed += 1;
                continue;
            }
            let to = connect.dst.map_or_else(
                || "an unknown destination".to_string(),
                |dst| dst.to_string(),
            );
            verdict.violations.push(Violation {
                invariant: Invariant::ConnectsSucceed,
                at_ms: connect.t_ms,
                active: self.active(connect.t_ms),
                what: format!(
                    "a new {} connection to {to} failed outside every bound: {} (seed {seed})",
                    connect.kind.label(),
                    connect.error.as_deref().unwrap_or("no error text")
                ),
            });
        }
        verdict
    }
}

/// What the log says about the faults' expectations (invariant 4).
#[derive(Debug, Clone, Default)]
pub struct SilentVerdict {
    pub checked: u64,
    /// Expectations not judged: an outage of socklb overlapped them.
    pub unjudged: u64,
    pub observations: Vec<String>,
    pub violations: Vec<Violation>,
}

/// Counts the lines each expectation wants within its window.
pub fn expectations(
    lines: &[LogLine],
    applied: &[Applied],
    outages: &[Outage],
    seed: u64,
) -> SilentVerdict {
    let mut verdict = SilentVerdict::default();
    for fault in applied {
        let until = next_conflicting(applied, fault);
        for expectation in &fault.expectations {
            let until_ms =
                until.map_or(expectation.until_ms, |next| expectation.until_ms.min(next));
            let seen = lines
                .iter()
                .filter(|line| line.t_ms + EARLY_MS >= expectation.from_ms && line.t_ms <= until_ms)
                .filter(|line| expectation.matches(&line.text))
                .count() as u32;
            let Some((low, high)) = expectation.count.range() else {
                if seen > 0 {
                    let what = &expectation.what;
                    verdict
                        .observations
                        .push(format!("{}: {seen} × {what}", fault.name()));
                }
                continue;
            };
            let overlapped = outages.iter().any(|outage| {
                outage.from_ms <= expectation.until_ms
                    && outage.to_ms.is_none_or(|to| to >= expectation.from_ms)
            });
            if overlapped && seen <= high.max(1).saturating_mul(2) {
                // Two processes may each say it once, or neither have seen it.
                verdict.unjudged += 1;
                continue;
            }
            verdict.checked += 1;
            if seen < low || seen > high {
                verdict.violations.push(Violation {
                    invariant: Invariant::NothingSilent,
                    at_ms: expectation.from_ms,
                    active: applied
                        .iter()
                        .filter(|f| f.active_at(expectation.from_ms))
                        .map(Applied::name)
                        .collect(),
                    what: format!(
                        "{}: {seen} line(s) saying {} within {} ms, wanted {} (seed {seed})",
                        fault.name(),
                        expectation.what,
                        until_ms.saturating_sub(expectation.from_ms),
                        expectation.count.words()
                    ),
                });
            }
        }
    }
    verdict
}

/// When the next fault on the same server, or holding the same thing
/// (the configuration file, the API), starts: what it makes socklb say is
/// its own.
fn next_conflicting(applied: &[Applied], fault: &Applied) -> Option<u64> {
    let shares = |other: &Applied| {
        let (mine, theirs) = (fault.planned.spec(), other.planned.spec());
        (fault.planned.server.is_some() && other.planned.server == fault.planned.server)
            || mine
                .holds
                .iter()
                .any(|resource| theirs.holds.contains(resource))
    };
    applied
        .iter()
        .filter(|other| other.start_ms > fault.start_ms && shares(other))
        .map(|other| other.start_ms)
        .min()
}

/// A leak slope: least squares over samples, each life of the daemon
/// fitted around its own mean (a restart resets its memory).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slope {
    pub per_hour: f64,
    /// The smallest slope the run could tell from flat: twice the
    /// slope's standard error, and at least one unit over the span.
    pub resolution_per_hour: f64,
    pub samples: usize,
}

impl Slope {
    pub fn flat(&self) -> bool {
        self.per_hour.abs() <= self.resolution_per_hour
    }

    /// Grows by more than the run can resolve.
    pub fn grows(&self) -> bool {
        self.per_hour > self.resolution_per_hour
    }

    /// "grows", "flat" or "falls", as the report says it.
    pub fn trend(&self) -> &'static str {
        if self.grows() {
            "grows"
        } else if self.flat() {
            "flat"
        } else {
            "falls"
        }
    }
}

/// (time in ms, value, life) → slope per hour. `unit` is the value's
/// quantum (1 for counts, the page size for memory).
pub fn slope(samples: &[(u64, f64, u32)], unit: f64) -> Option<Slope> {
    let mut lives: BTreeMap<u32, Vec<(f64, f64)>> = BTreeMap::new();
    for &(t_ms, value, life) in samples {
        lives
            .entry(life)
            .or_default()
            .push((t_ms as f64 / 3_600_000.0, value));
    }
    let (mut sxy, mut sxx, mut n, mut groups) = (0.0, 0.0, 0usize, 0usize);
    let mut centred = Vec::new();
    let mut span: f64 = 0.0;
    for points in lives.values().filter(|points| points.len() >= 2) {
        let mean_t = points.iter().map(|p| p.0).sum::<f64>() / points.len() as f64;
        let mean_v = points.iter().map(|p| p.1).sum::<f64>() / points.len() as f64;
        let first = points.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
        let last = points.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
        span += last - first;
        for &(t, v) in points {
            sxy += (t - mean_t) * (v - mean_v);
            sxx += (t - mean_t) * (t - mean_t);
            centred.push((t - mean_t, v - mean_v));
        }
        n += points.len();
        groups += 1;
    }
    // Noise needs a sample more than the lines fitted to be measured.
    if sxx <= 0.0 || span <= 0.0 || n < groups + 2 {
        return None;
    }
    let per_hour = sxy / sxx;
    let residual: f64 = centred
        .iter()
        .map(|(t, v)| (v - per_hour * t).powi(2))
        .sum();
    let freedom = n.saturating_sub(groups + 1).max(1) as f64;
    let standard_error = (residual / freedom / sxx).sqrt();
    Some(Slope {
        per_hour,
        resolution_per_hour: (2.0 * standard_error).max(unit / span),
        samples: n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soak::{
        catalogue::FaultKind,
        record::{Count, Expectation},
        schedule::Planned,
    };

    fn bounds() -> Bounds {
        Bounds::from_health(
            Duration::from_millis(500),
            Duration::from_millis(500),
            Duration::from_millis(500),
            2,
            2,
        )
    }

    #[test]
    fn the_detection_bound_follows_the_health_settings() {
        // 600 (a jittered interval) + 600 (the second probe) + 500 (its
        // timeout) + the slack.
        assert_eq!(bounds().detect_ms, 1700 + SLACK.as_millis() as u64);
        let slower = Bounds::from_health(
            Duration::from_secs(1),
            Duration::from_secs(1),
            Duration::from_secs(2),
            2,
            3,
        );
        assert_eq!(
            slower.detect_ms,
            1200 + 2 * 2000 + 2000 + SLACK.as_millis() as u64
        );
    }

    #[test]
    fn outages_lengthen_a_deadline() {
        assert_eq!(deadline(1000, 500, &[]), Some(1500));
        let stop = Outage {
            from_ms: 1200,
            to_ms: Some(6200),
        };
        assert_eq!(deadline(1000, 500, &[stop]), Some(6500));
        let before = Outage {
            from_ms: 0,
            to_ms: Some(900),
        };
        assert_eq!(deadline(1000, 500, &[before]), Some(1500));
        let open = Outage {
            from_ms: 1200,
            to_ms: None,
        };
        assert_eq!(deadline(1000, 500, &[open]), None);
    }

    fn kill_of(server: SocketAddr, start_ms: u64, end_ms: u64) -> Applied {
        let mut applied = Applied::new(
            Planned {
                kind: FaultKind::ServerKill,
                server: Some(1),
                variant: 0,
                start_ms: 0,
                duration_ms: end_ms - start_ms,
            },
            start_ms,
        );
        applied.end_ms = Some(end_ms);
        applied.fault_addrs = vec![server];
        applied
    }

    fn connect(t_ms: u64, dst: &str, ok: bool) -> Connect {
        Connect {
            t_ms,
            kind: ConnectKind::Plain,
            dst: Some(dst.parse().unwrap()),
            ok,
            ms: 1,
            server: None,
            error: (!ok).then(|| "connect: refused".to_string()),
        }
    }

    #[test]
    fn failures_within_the_bound_are_allowed_and_later_ones_are_not() {
        let dead: SocketAddr = "198.18.0.3:7000".parse().unwrap();
        let applied = [kill_of(dead, 10_000, 30_000)];
        let book = AddressBook::default();
        let judge = Judge {
            applied: &applied,
            outages: &[],
            bounds: bounds(),
            book: &book,
        };
        let bound = bounds().detect_ms;
        let verdict = judge.connects(
            &[
                connect(10_100, "198.18.0.3:7000", false),
                connect(10_000 + bound - 10, "198.18.0.3:7000", false),
                connect(10_000 + bound + 100, "198.18.0.3:7000", false),
                connect(12_000, "198.18.0.4:7000", false),
                connect(15_000, "198.18.0.4:7000", true),
            ],
            7,
        );
        assert_eq!(verdict.allowed, 2);
        let kinds: Vec<Invariant> = verdict.violations.iter().map(|v| v.invariant).collect();
        assert_eq!(
            kinds,
            [
                Invariant::NoStaleChoice,
                Invariant::ConnectsSucceed,
                Invariant::ConnectsSucceed
            ],
            "{:?}",
            verdict.violations
        );
        assert!(verdict.violations[1].what.contains("seed 7"));
    }

    #[test]
    fn a_daemon_outage_moves_the_bound() {
        let dead: SocketAddr = "198.18.0.3:7000".parse().unwrap();
        let applied = [kill_of(dead, 10_000, 30_000)];
        let outages = [Outage {
            from_ms: 9_000,
            to_ms: Some(15_000),
        }];
        let book = AddressBook::default();
        let judge = Judge {
            applied: &applied,
            outages: &outages,
            bounds: bounds(),
            book: &book,
        };
        let verdict = judge.connects(&[connect(14_500, "198.18.0.3:7000", false)], 1);
        assert_eq!(verdict.allowed, 1, "{:?}", verdict.violations);
        assert!(verdict.violations.is_empty());
    }

    #[test]
    fn an_expected_line_is_counted_in_its_window() {
        let mut applied = kill_of("198.18.0.3:7000".parse().unwrap(), 10_000, 30_000);
        applied.expectations.push(Expectation {
            what: "unhealthy".into(),
            words: vec!["198.18.0.3:7000 unhealthy:".into()],
            count: Count::Exactly(1),
            from_ms: 10_000,
            until_ms: 13_000,
        });
        let line = |t_ms: u64, text: &str| LogLine {
            t_ms,
            text: text.into(),
        };
        let once = [line(
            11_000,
            "WARN x: 198.18.0.3:7000 unhealthy: refused (2/2)",
        )];
        assert!(
            expectations(&once, std::slice::from_ref(&applied), &[], 1)
                .violations
                .is_empty()
        );
        let twice = [
            once[0].clone(),
            line(12_000, "WARN x: 198.18.0.3:7000 unhealthy: refused (2/2)"),
        ];
        assert_eq!(
            expectations(&twice, std::slice::from_ref(&applied), &[], 1)
                .violations
                .len(),
            1
        );
        assert_eq!(
            expectations(&[], std::slice::from_ref(&applied), &[], 1)
                .violations
                .len(),
            1
        );
    }

    #[test]
    fn a_flat_series_is_flat_and_a_leak_is_not() {
        let flat: Vec<(u64, f64, u32)> = (0..30)
            .map(|minute| (minute * 60_000, 100.0 + (minute % 2) as f64, 0))
            .collect();
        let slope_flat = slope(&flat, 1.0).expect("a slope");
        assert!(slope_flat.flat(), "{slope_flat:?}");
        let leak: Vec<(u64, f64, u32)> = (0..30)
            .map(|minute| (minute * 60_000, 100.0 + minute as f64, 0))
            .collect();
        let slope_leak = slope(&leak, 1.0).expect("a slope");
        assert!(
            (slope_leak.per_hour - 60.0).abs() < 1e-6 && slope_leak.grows(),
            "{slope_leak:?}"
        );
        assert!(!slope_flat.grows());
        // A count that falls is not flat, and is no leak either.
        let falling: Vec<(u64, f64, u32)> = (0..30)
            .map(|minute| (minute * 60_000, 100.0 - minute as f64, 0))
            .collect();
        let slope_falling = slope(&falling, 1.0).expect("a slope");
        assert!(!slope_falling.flat() && !slope_falling.grows());
        // Each life around its own mean: a restart's reset is no slope.
        let lives: Vec<(u64, f64, u32)> = (0..30)
            .map(|minute| {
                (
                    minute * 60_000,
                    if minute < 15 { 500.0 } else { 100.0 },
                    u32::from(minute >= 15),
                )
            })
            .collect();
        assert!(slope(&lives, 1.0).expect("a slope").per_hour.abs() < 1e-9);
    }
}
