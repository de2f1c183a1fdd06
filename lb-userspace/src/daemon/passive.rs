//! The kernel's passive signal, and the confirming probes it triggers.
//!
//! The sock_ops program reports a connect only when the server side failed
//! it: a reset received while the socket never established (`segs_in > 0`
//! in SYN_SENT), or the SYN's retransmission timer firing (the RTO
//! callback). A connect that the application itself closed is never
//! reported, so a local process cannot forge the signal by aborting its
//! own connects. It can still make a SYN go unanswered (a tiny TTL, for
//! one), so the signal never takes a backend out by itself: it starts a
//! probe at once, and the probe decides. A dead server still leaves within
//! a millisecond or so, because its reset fails the probe too.
//!
//! Confirming probes are rate-limited per backend: at most one in flight,
//! and at most one started per [`CONFIRM_GAP`]. A flood of reports costs
//! the backend a few probes a second, never its place in the table.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use lb_common::{ConnectFailure, EVIDENCE_RESET, EVIDENCE_SYN_TIMEOUT};

/// Least time between two confirming probes of one backend.
pub const CONFIRM_GAP: Duration = Duration::from_millis(500);

/// Says what the kernel saw, for log lines.
pub fn evidence_words(evidence: u32) -> &'static str {
    match evidence {
        EVIDENCE_RESET => "reset by the server",
        EVIDENCE_SYN_TIMEOUT => "SYN unanswered for the initial RTO",
        _ => "failed",
    }
}

/// One record of the `CONNECT_FAILURES` ring buffer.
pub fn parse_connect_failure(bytes: &[u8]) -> Option<ConnectFailure> {
    let word = |index: usize| -> Option<u32> {
        let start = index * 4;
        let chunk = bytes.get(start..start + 4)?;
        Some(u32::from_ne_bytes(chunk.try_into().ok()?))
    };
    Some(ConnectFailure {
        backend_id: word(0)?,
        evidence: word(1)?,
    })
}

/// What the kernel reported of one backend since its last confirming
/// probe began.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reports {
    pub count: u32,
    /// `EVIDENCE_*` of the latest report.
    pub evidence: u32,
}

impl Reports {
    /// "2 failed connects seen by the kernel (reset by the server)".
    pub fn describe(&self) -> String {
        format!(
            "{} failed connect{} seen by the kernel ({})",
            self.count,
            if self.count == 1 { "" } else { "s" },
            evidence_words(self.evidence)
        )
    }
}

/// Per backend: whether a confirming probe runs, when the last began, and
/// the reports it answers.
#[derive(Debug, Default)]
pub struct Confirmer {
    last_started: HashMap<u32, Instant>,
    in_flight: HashSet<u32>,
    reports: HashMap<u32, Reports>,
}

impl Confirmer {
    /// Notes a report; returns whether to start a confirming probe now.
    pub fn report(&mut self, backend_id: u32, evidence: u32, now: Instant) -> bool {
        let reports = self.reports.entry(backend_id).or_default();
        reports.count += 1;
        reports.evidence = evidence;
        if self.in_flight.contains(&backend_id) {
            return false;
        }
        let recent = self
            .last_started
            .get(&backend_id)
            .is_some_and(|started| now.saturating_duration_since(*started) < CONFIRM_GAP);
        if recent {
            return false;
        }
        self.last_started.insert(backend_id, now);
        self.in_flight.insert(backend_id);
        true
    }

    /// The confirming probe ended; returns the reports it answered.
    pub fn finished(&mut self, backend_id: u32) -> Reports {
        self.in_flight.remove(&backend_id);
        self.reports.remove(&backend_id).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_probe_at_a_time_and_at_most_one_per_gap() {
        let mut confirmer = Confirmer::default();
        let start = Instant::now();
        // (what, backend, time after start, probe now?)
        let steps = [
            ("first report probes", 1, 0, true),
            ("while it runs, no other", 1, 10, false),
            ("another backend is independent", 2, 10, true),
            ("still in flight", 1, 600, false),
            ("other backend still in flight", 2, 20, false),
            ("third backend", 3, 0, true),
        ];
        for (what, backend, after_ms, expected) in steps {
            let now = start + Duration::from_millis(after_ms);
            assert_eq!(
                confirmer.report(backend, EVIDENCE_RESET, now),
                expected,
                "{what}"
            );
        }
        let answered = confirmer.finished(1);
        assert_eq!(
            answered.count, 3,
            "the probe answers every report of backend 1"
        );
        assert_eq!(
            answered.describe(),
            "3 failed connects seen by the kernel (reset by the server)"
        );
        assert!(
            !confirmer.report(1, EVIDENCE_SYN_TIMEOUT, start + Duration::from_millis(100)),
            "within the gap after the last start"
        );
        assert!(confirmer.report(1, EVIDENCE_SYN_TIMEOUT, start + CONFIRM_GAP));
        assert_eq!(confirmer.finished(1).count, 2);
    }

    #[test]
    fn records_parse() {
        let mut bytes = Vec::new();
        for word in [7u32, EVIDENCE_RESET] {
            bytes.extend(word.to_ne_bytes());
        }
        let parsed = parse_connect_failure(&bytes).unwrap();
        assert_eq!((parsed.backend_id, parsed.evidence), (7, EVIDENCE_RESET));
        assert!(parse_connect_failure(&bytes[..4]).is_none());
    }
}
