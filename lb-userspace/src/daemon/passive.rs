//! The kernel's passive signal, and the probes it hurries.
//!
//! The sock_ops program reports a connect only when the server side failed
//! it: a reset received while the socket never established (`segs_in > 0`
//! in SYN_SENT), or the SYN's retransmission timer firing (the RTO
//! callback). A connect that the application itself closed is never
//! reported, so a local process cannot forge the signal by aborting its
//! own connects. It can still make a SYN go unanswered (a tiny TTL, for
//! one), so the signal is never evidence against a backend: it only makes
//! the backend's next probe come at once, and only while its last probe
//! passed. Taking a backend out needs what the active checker needs, `fall`
//! failed probes in a row, at the pace the checker keeps during a streak
//! (the down interval, when shorter than the interval): a hurried probe
//! can start a streak sooner, never end one sooner. The one exception is
//! unforgeable: once the kernel saw the server reset connects, a refused
//! probe is followed by the next within 50 ms, so a dead server leaves
//! after `fall` refusals in a fraction of a second.
//!
//! Hurried probes are rate-limited per backend: at most one requested per
//! [`CONFIRM_GAP`]. A flood of reports costs the backend a few probes a
//! second, never its place in the table.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use lb_common::{ConnectFailure, EVIDENCE_RESET, EVIDENCE_SYN_TIMEOUT};

/// Least time between two probes of one backend hurried by the kernel's
/// reports.
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

/// What the kernel reported of one backend since its last hurried probe
/// was asked for.
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

/// Per backend: when its last hurried probe was asked for, and the reports
/// since.
#[derive(Debug, Default)]
pub struct Confirmer {
    last_hurried: HashMap<u32, Instant>,
    reports: HashMap<u32, Reports>,
}

impl Confirmer {
    /// Notes a report; returns whether to hurry the backend's probe now.
    pub fn report(&mut self, backend_id: u32, evidence: u32, now: Instant) -> bool {
        let reports = self.reports.entry(backend_id).or_default();
        reports.count += 1;
        reports.evidence = evidence;
        let recent = self
            .last_hurried
            .get(&backend_id)
            .is_some_and(|hurried| now.saturating_duration_since(*hurried) < CONFIRM_GAP);
        if recent {
            return false;
        }
        self.last_hurried.insert(backend_id, now);
        true
    }

    /// A hurried probe answered; returns the reports that hurried it.
    pub fn answered(&mut self, backend_id: u32) -> Reports {
        self.reports.remove(&backend_id).unwrap_or_default()
    }

    /// The backend is no longer probed: forget it.
    pub fn forget(&mut self, backend_id: u32) {
        self.last_hurried.remove(&backend_id);
        self.reports.remove(&backend_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_one_hurried_probe_per_gap() {
        let mut confirmer = Confirmer::default();
        let start = Instant::now();
        // (what, backend, time after start, hurry now?)
        let steps = [
            ("first report hurries", 1, 0, true),
            ("within the gap, no other", 1, 10, false),
            ("another backend is independent", 2, 10, true),
            ("still within the gap", 1, 499, false),
            ("a gap later, again", 1, 500, true),
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
        let answered = confirmer.answered(1);
        assert_eq!(answered.count, 4, "every report of backend 1 so far");
        assert_eq!(
            answered.describe(),
            "4 failed connects seen by the kernel (reset by the server)"
        );
        assert_eq!(confirmer.answered(1).count, 0, "taken once");
        confirmer.forget(2);
        assert!(confirmer.report(2, EVIDENCE_SYN_TIMEOUT, start + Duration::from_millis(20)));
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
