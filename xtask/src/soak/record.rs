//! What a run records: the faults as they were applied, socklb's
//! outages and lives, every connect the clients made, the daemon's log,
//! and the violations found. Times are Unix milliseconds, the clock the
//! clients and socklb's log share.

use std::net::SocketAddr;

use super::schedule::Planned;

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

/// How many log lines an expectation wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    Exactly(u32),
    AtMost(u32),
    AtLeast(u32),
    /// None is wanted, but a match is an observation, not a violation
    /// (a slow server taken out under load).
    Observe,
}

impl Count {
    /// The lines allowed, or None for an observation.
    pub fn range(self) -> Option<(u32, u32)> {
        match self {
            Count::Exactly(count) => Some((count, count)),
            Count::AtMost(count) => Some((0, count)),
            Count::AtLeast(count) => Some((count, u32::MAX)),
            Count::Observe => None,
        }
    }

    pub fn words(self) -> String {
        match self {
            Count::Exactly(count) => format!("exactly {count}"),
            Count::AtMost(count) => format!("at most {count}"),
            Count::AtLeast(count) => format!("at least {count}"),
            Count::Observe => "none (an observation)".into(),
        }
    }
}

/// A log line that an action must (or must not) cause.
#[derive(Debug, Clone)]
pub struct Expectation {
    /// What the line says, for the report.
    pub what: String,
    /// Every one of these appears in a matching line.
    pub words: Vec<String>,
    pub count: Count,
    pub from_ms: u64,
    pub until_ms: u64,
}

impl Expectation {
    pub fn matches(&self, line: &str) -> bool {
        self.words.iter().all(|word| line.contains(word.as_str()))
    }
}

/// A fault as the nemesis applied it.
#[derive(Debug, Clone)]
pub struct Applied {
    pub planned: Planned,
    pub start_ms: u64,
    pub end_ms: Option<u64>,
    /// When the nemesis's latest action on it began: what socklb says
    /// about that action is looked for from then on.
    pub action_ms: u64,
    /// Addresses where connects may fail within the bound after the start
    /// and after the end, and that must get no new connection from the
    /// bound after the start until the end.
    pub fault_addrs: Vec<SocketAddr>,
    /// Addresses that stay out after the end (a server's second address,
    /// once it moved back), from the bound after the end on.
    pub stale_after_end: Vec<SocketAddr>,
    pub expectations: Vec<Expectation>,
    /// What happened that the report should say (skipped, evidence).
    pub notes: Vec<String>,
    /// Kernel state socklb had not repaired by the fault's end.
    pub breaches: Vec<String>,
}

impl Applied {
    pub fn new(planned: Planned, start_ms: u64) -> Self {
        Self {
            planned,
            start_ms,
            end_ms: None,
            action_ms: start_ms,
            fault_addrs: Vec::new(),
            stale_after_end: Vec::new(),
            expectations: Vec::new(),
            notes: Vec::new(),
            breaches: Vec::new(),
        }
    }

    pub fn name(&self) -> String {
        match self.planned.server {
            Some(server) => format!("{} s{server}", self.planned.spec().name),
            None => self.planned.spec().name.to_string(),
        }
    }

    pub fn active_at(&self, at_ms: u64) -> bool {
        self.start_ms <= at_ms && self.end_ms.is_none_or(|end| at_ms <= end)
    }
}

/// A time socklb could not act: killed, stopped, being upgraded, or
/// crashed, until its successor's first heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outage {
    pub from_ms: u64,
    pub to_ms: Option<u64>,
}

/// One socklb process.
#[derive(Debug, Clone)]
pub struct Incarnation {
    pub pid: u32,
    pub started_ms: u64,
    pub ended_ms: Option<u64>,
    /// Why it ended: the nemesis's doing, or how it died.
    pub end: Option<String>,
}

/// A new connection as a client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    pub t_ms: u64,
    pub kind: ConnectKind,
    /// Where the kernel sent it, when the client's lookup found it.
    pub dst: Option<SocketAddr>,
    pub ok: bool,
    pub ms: u32,
    /// The server that answered (`sN`).
    pub server: Option<u8>,
    /// Where and why it failed.
    pub error: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConnectKind {
    /// A short TLS connection to the api VIP.
    Tls,
    /// A short plain connection to the plain VIP.
    Plain,
    /// A keep-alive client's (re)connect.
    KeepAlive,
    /// A watcher's (re)connect.
    Watch,
    /// An etcdctl call through the etcd VIP.
    Etcd,
}

impl ConnectKind {
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "tls" => Self::Tls,
            "plain" => Self::Plain,
            "ka" => Self::KeepAlive,
            "watch" => Self::Watch,
            "etcd" => Self::Etcd,
            _ => return None,
        })
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Tls => "short TLS",
            Self::Plain => "short plain",
            Self::KeepAlive => "keep-alive",
            Self::Watch => "watch",
            Self::Etcd => "etcdctl",
        }
    }
}

/// The six promises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Invariant {
    ConnectsSucceed,
    NoStaleChoice,
    ExactAgreement,
    NothingSilent,
    NoLeak,
    NoCrash,
}

impl Invariant {
    pub const ALL: [Invariant; 6] = [
        Invariant::ConnectsSucceed,
        Invariant::NoStaleChoice,
        Invariant::ExactAgreement,
        Invariant::NothingSilent,
        Invariant::NoLeak,
        Invariant::NoCrash,
    ];

    pub fn title(self) -> &'static str {
        match self {
            Invariant::ConnectsSucceed => "1. Connects succeed",
            Invariant::NoStaleChoice => "2. No stale choice",
            Invariant::ExactAgreement => "3. Exact agreement",
            Invariant::NothingSilent => "4. Nothing silent",
            Invariant::NoLeak => "5. No leak",
            Invariant::NoCrash => "6. No crash",
        }
    }
}

/// One broken promise.
#[derive(Debug, Clone)]
pub struct Violation {
    pub invariant: Invariant,
    pub at_ms: u64,
    /// The faults active then (by name).
    pub active: Vec<String>,
    pub what: String,
}

/// One line of socklb's log.
#[derive(Debug, Clone)]
pub struct LogLine {
    pub t_ms: u64,
    /// Level, target and message, as written.
    pub text: String,
}

impl LogLine {
    /// The message: what follows the level and the target (targets hold
    /// `::` but never `: `).
    pub fn message(&self) -> &str {
        self.text
            .split_once(": ")
            .map_or(self.text.as_str(), |(_, message)| message)
    }
}

/// Unix milliseconds of a tracing timestamp (`2026-12-02T10:14:48.289551Z`).
pub fn parse_log_time(stamp: &str) -> Option<u64> {
    let (date, time) = stamp.trim_end_matches('Z').split_once('T')?;
    let mut date_parts = date.split('-').map(|part| part.parse::<i64>().ok());
    let (year, month, day) = (
        date_parts.next()??,
        date_parts.next()??,
        date_parts.next()??,
    );
    let mut time_parts = time.split(':');
    let hours: i64 = time_parts.next()?.parse().ok()?;
    let minutes: i64 = time_parts.next()?.parse().ok()?;
    let seconds: f64 = time_parts.next()?.parse().ok()?;
    // Days from the civil date (H. Hinnant's algorithm).
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    let millis = (days * 86_400 + hours * 3600 + minutes * 60) * 1000 + (seconds * 1000.0) as i64;
    u64::try_from(millis).ok()
}

/// A log line of the daemon: its time and its message (after the level
/// and target), or None for a line that is not one of tracing's.
pub fn parse_log_line(line: &str) -> Option<LogLine> {
    let (stamp, rest) = line.split_once(' ')?;
    let t_ms = parse_log_time(stamp)?;
    Some(LogLine {
        t_ms,
        text: rest.trim_start().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_times_are_unix_milliseconds() {
        assert_eq!(parse_log_time("1970-01-01T00:00:01.5Z"), Some(1500));
        assert_eq!(
            parse_log_time("2024-02-29T12:00:00.000000Z"),
            Some(1_709_208_000_000)
        );
        let line = parse_log_line(
            "2024-02-29T12:00:00.250000Z  WARN socklb::daemon: 1.2.3.4:5 unhealthy: x (2/2)",
        )
        .expect("a line");
        assert_eq!(line.t_ms, 1_709_208_000_250);
        assert!(line.text.ends_with("unhealthy: x (2/2)"));
        assert!(parse_log_line("thread 'main' panicked at src/x.rs").is_none());
    }
}
