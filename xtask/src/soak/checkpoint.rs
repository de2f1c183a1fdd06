//! Quiet checkpoints: with no fault active and the clients paused, each
//! backend's live count must equal the sockets really open (sock_diag),
//! and status, /metrics and the pinned maps must agree; every counter of
//! a transition, reload, discovery report, rebalance move or repair must
//! equal the log lines that said it (invariants 3 and 4).

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use super::{
    observe::{self, LogTail, Numbers, label},
    record::{Incarnation, Invariant, LogLine, Violation},
    world::{World, wait_until},
};

/// How long socklb may take to settle (every backend probed healthy).
const SETTLE: Duration = Duration::from_secs(45);
/// Readings taken until two agree.
const ATTEMPTS: u32 = 8;

/// One backend at a checkpoint, from every source.
#[derive(Debug, Clone)]
pub struct Row {
    pub addr: SocketAddr,
    pub sockets: i64,
    pub status: Numbers,
    pub metrics: Numbers,
    pub maps: Numbers,
}

impl Row {
    fn agrees(&self) -> bool {
        self.status.live == self.sockets && self.status == self.metrics && self.status == self.maps
    }
}

/// What one checkpoint found.
#[derive(Debug, Clone, Default)]
pub struct Checked {
    pub at_ms: u64,
    pub rows: Vec<Row>,
    pub agreed: bool,
    pub readings: u32,
    pub settle_ms: u64,
    pub problems: Vec<String>,
    /// Counter families compared with the log: (family, compared, equal).
    pub counters: Vec<(String, usize, bool)>,
}

/// Waits until socklb runs and every backend it should have is probed
/// healthy; returns the missing ones if it does not happen in time.
pub fn settle(world: &World, expected: &[SocketAddr]) -> Result<Duration, Vec<String>> {
    let started = std::time::Instant::now();
    let mut missing = Vec::new();
    let settled = wait_until(SETTLE, || {
        let Some(status) = world.daemon().status() else {
            missing = vec!["socklb status failed".into()];
            return false;
        };
        if status["daemon"]["running"] != true {
            missing = vec!["the daemon is not running".into()];
            return false;
        }
        let numbers = observe::status_numbers(&status);
        missing = expected
            .iter()
            .filter(|addr| !numbers.get(addr).is_some_and(|(_, healthy)| *healthy))
            .map(|addr| format!("{addr} not healthy"))
            .collect();
        missing.is_empty()
    });
    if settled {
        Ok(started.elapsed())
    } else {
        Err(missing)
    }
}

/// One reading of every source.
fn read(world: &World, expected: &[SocketAddr]) -> Result<Vec<Row>, String> {
    let sockets =
        observe::open_sockets(&world.cgroup.path).map_err(|e| format!("sock_diag: {e}"))?;
    let status = world.daemon().status().ok_or("socklb status failed")?;
    let metrics = observe::scrape(world.metrics).map_err(|e| e.to_string())?;
    let maps = observe::map_numbers(&world.daemon().pin_path).map_err(|e| e.to_string())?;
    let again = observe::open_sockets(&world.cgroup.path).map_err(|e| format!("sock_diag: {e}"))?;
    if again != sockets {
        return Err("the sockets changed while they were read".into());
    }
    let status = observe::status_numbers(&status);
    let metrics = observe::metrics_numbers(&metrics);
    let mut addrs: Vec<SocketAddr> = status.keys().copied().collect();
    addrs.extend(expected);
    // Sockets to an address socklb does not list are counted nowhere.
    addrs.extend(sockets.keys().filter(|addr| {
        world
            .addrs
            .iter()
            .any(|a| a.base == addr.ip() || a.alt == addr.ip())
    }));
    addrs.sort();
    addrs.dedup();
    Ok(addrs
        .into_iter()
        .map(|addr| Row {
            addr,
            sockets: sockets.get(&addr).copied().unwrap_or(0),
            status: status
                .get(&addr)
                .map(|(numbers, _)| *numbers)
                .unwrap_or_default(),
            metrics: metrics.get(&addr).copied().unwrap_or_default(),
            maps: maps.get(&addr).copied().unwrap_or_default(),
        })
        .collect())
}

/// How long the clients' sockets may take to stop changing once the
/// clients are paused (socklb may still be rebalancing, at 5 a second).
const QUIET: Duration = Duration::from_secs(30);

/// Waits until the clients' live sockets stay the same for a second.
fn quiet(world: &World) -> bool {
    let mut last = None;
    wait_until(QUIET, || {
        let now = observe::open_sockets(&world.cgroup.path).ok();
        let same = now.is_some() && now == last;
        last = now;
        if !same {
            std::thread::sleep(Duration::from_millis(950));
        }
        same
    })
}

/// Invariant 3 at a quiet moment: readings until one agrees throughout
/// (and its sockets did not move while it was read).
pub fn agreement(world: &World, expected: &[SocketAddr], checked: &mut Checked) {
    if !quiet(world) {
        checked.problems.push(format!(
            "the clients' sockets still changed after {QUIET:?} with the clients paused"
        ));
    }
    for attempt in 1..=ATTEMPTS {
        checked.readings = attempt;
        match read(world, expected) {
            Ok(rows) => {
                let agreed = rows.iter().all(Row::agrees);
                checked.rows = rows;
                if agreed {
                    checked.agreed = true;
                    return;
                }
            }
            Err(problem) => checked.problems.push(problem),
        }
        // /metrics reads the kernel at most once a second.
        std::thread::sleep(Duration::from_millis(700));
    }
    for row in checked.rows.iter().filter(|row| !row.agrees()) {
        let sockets = observe::sockets_to(row.addr, &world.cgroup.path);
        checked.problems.push(format!(
            "sockets to {} now: {}",
            row.addr,
            if sockets.is_empty() {
                "none".to_string()
            } else {
                sockets.join(", ")
            }
        ));
    }
}

/// Log lines of socklb's life that began at `started_ms`: `started_ms` is
/// taken after the previous process was gone and before this one was
/// spawned, on the clock the log's stamps use, so a line before it is the
/// previous life's (counted in that life's metrics, not this one's).
fn lines_of(lines: &[LogLine], started_ms: u64) -> impl Iterator<Item = &LogLine> {
    lines.iter().filter(move |line| line.t_ms >= started_ms)
}

/// The service and the source of a discovery line (`discovery: SVC: …`).
fn discovery_words(message: &str) -> Option<(&str, &str)> {
    let rest = message
        .strip_prefix("discovery: ")
        .or_else(|| message.strip_prefix("config: "))?;
    rest.split_once(": ")
}

/// The backends a discovery or config line says left its service (the
/// words after `discovery: SVC: `, as in `+A, -B (source)`).
fn departed(rest: &str) -> impl Iterator<Item = SocketAddr> + '_ {
    let words = rest.rsplit_once(" (").map_or(rest, |(words, _)| words);
    words
        .split(", ")
        .filter_map(|word| word.strip_prefix('-')?.parse().ok())
}

/// Drops the counts of a backend's label sets, as the daemon does when it
/// leaves its service.
fn forget(counts: &mut BTreeMap<(String, String), f64>, service: &str, addr: SocketAddr) {
    for to in ["healthy", "unhealthy"] {
        counts.remove(&(
            "socklb_backend_transitions_total".to_string(),
            format!("{addr} {to}"),
        ));
    }
    counts.remove(&(
        "socklb_rebalance_moves_total".to_string(),
        format!("{service} {addr}"),
    ));
}

/// The result label of a reload line (`SIGHUP: …`, `config file changed:
/// …`), as socklb_config_reloads_total counts it.
fn reload_result(message: &str) -> Option<&'static str> {
    if !(message.starts_with("SIGHUP: ") || message.starts_with("config file changed: ")) {
        return None;
    }
    if message.contains(" is unchanged") {
        Some("unchanged")
    } else if message.contains(" applied (generation") {
        Some("ok")
    } else if message.contains(" is not valid;") || message.contains(" cannot be applied;") {
        Some("error")
    } else {
        None
    }
}

/// Counts per label set, from the log lines of one life. A backend that
/// leaves its service takes its label sets with it (the daemon's
/// `forget_backend`, right after the line that says so): one that comes
/// back counts from zero.
fn from_log(lines: &[LogLine], started_ms: u64) -> BTreeMap<(String, String), f64> {
    let mut counts: BTreeMap<(String, String), f64> = BTreeMap::new();
    fn add(counts: &mut BTreeMap<(String, String), f64>, family: &str, key: String, by: f64) {
        *counts.entry((family.to_string(), key)).or_default() += by
    }
    for line in lines_of(lines, started_ms) {
        let message = line.message();
        if let Some((addr, rest)) = message.split_once(' ')
            && addr.parse::<SocketAddr>().is_ok()
        {
            if rest.starts_with("healthy:") {
                add(
                    &mut counts,
                    "socklb_backend_transitions_total",
                    format!("{addr} healthy"),
                    1.0,
                );
            } else if rest.starts_with("unhealthy:") {
                add(
                    &mut counts,
                    "socklb_backend_transitions_total",
                    format!("{addr} unhealthy"),
                    1.0,
                );
            }
        }
        if let Some(result) = reload_result(message) {
            add(
                &mut counts,
                "socklb_config_reloads_total",
                result.into(),
                1.0,
            );
        }
        if let Some((service, rest)) = discovery_words(message) {
            if rest.starts_with('+') || rest.starts_with('-') {
                for addr in departed(rest) {
                    forget(&mut counts, service, addr);
                }
                if let Some(source) = rest
                    .rsplit_once(" (")
                    .map(|(_, source)| source.trim_end_matches(')'))
                {
                    add(
                        &mut counts,
                        "socklb_discovery_updates_total",
                        format!("{service} {source}"),
                        1.0,
                    );
                }
            } else if message.starts_with("discovery: ")
                && (rest.contains(" lists no backend; ") || rest.contains(" failed: "))
                && let Some(source) = rest.split_whitespace().next()
            {
                add(
                    &mut counts,
                    "socklb_discovery_problems_total",
                    format!("{service} {source}"),
                    1.0,
                );
            }
        }
        // "rebalance: SERVICE: closed N connections to BACKEND (N of uid U
        // in cgroup C, …)", the closes of one step on one backend.
        if let Some(rest) = message.strip_prefix("rebalance: ")
            && let Some((service, rest)) = rest.split_once(": closed ")
            && let Some((count, rest)) = rest.split_once(" connections to ")
            && let (Ok(count), Some(backend)) =
                (count.parse::<f64>(), rest.split_whitespace().next())
        {
            add(
                &mut counts,
                "socklb_rebalance_moves_total",
                format!("{service} {backend}"),
                count,
            );
        }
    }
    counts
}

/// The same counts from /metrics.
fn from_metrics(samples: &BTreeMap<String, f64>) -> BTreeMap<(String, String), f64> {
    let mut counts = BTreeMap::new();
    for (key, value) in samples {
        let family = key.split('{').next().unwrap_or_default();
        let label_of = |name: &str| label(key, name).unwrap_or_default().to_string();
        let label_key = match family {
            "socklb_backend_transitions_total" => {
                format!("{} {}", label_of("backend"), label_of("to"))
            }
            "socklb_config_reloads_total" => label_of("result"),
            "socklb_discovery_updates_total" | "socklb_discovery_problems_total" => {
                format!("{} {}", label_of("service"), label_of("source"))
            }
            "socklb_rebalance_moves_total" => {
                format!("{} {}", label_of("service"), label_of("backend"))
            }
            _ => continue,
        };
        // Summed over the labels the key leaves out (a discovery
        // problem's reason, for one).
        if *value != 0.0 {
            *counts.entry((family.to_string(), label_key)).or_default() += *value;
        }
    }
    counts
}

/// The repairs the log says, over every life (the count is kept in the
/// pinned daemon record, across restarts): one per repair line, and N for
/// a sweep of the socket table that says it removed N records (each is a
/// repair, said in one line).
pub fn repair_lines(lines: &[LogLine]) -> u64 {
    lines
        .iter()
        .map(|line| {
            let message = line.message();
            if let Some(swept) = swept_records(message) {
                return swept;
            }
            let repair = message.contains("pinned the map again")
                || message.contains("by someone else; restoring it")
                || (message.starts_with("data plane: ")
                    && !message.contains("could not be repaired")
                    && !message.contains("failed"));
            u64::from(repair)
        })
        .sum()
}

/// N of "socket table: removed N records …", the sweep's line.
fn swept_records(message: &str) -> Option<u64> {
    message
        .strip_prefix("socket table: removed ")?
        .split_once(" records")?
        .0
        .parse()
        .ok()
}

/// Invariant 4's bookkeeping half: the current life's counters equal its
/// log lines, family by family, and the repairs of all lives equal theirs.
/// /metrics, read twice with the log read between: the counters and the
/// lines that said them belong to one moment (socklb may still be
/// rebalancing at a checkpoint).
fn settled_counters(world: &World, log: &mut LogTail) -> Option<BTreeMap<String, f64>> {
    for _ in 0..5 {
        let before = from_metrics(&observe::scrape(world.metrics).ok()?);
        // Whatever the counters count was written to the log by now.
        std::thread::sleep(Duration::from_millis(100));
        log.poll();
        let samples = observe::scrape(world.metrics).ok()?;
        if from_metrics(&samples) == before {
            return Some(samples);
        }
        std::thread::sleep(Duration::from_millis(1100));
    }
    None
}

pub fn counters(
    world: &World,
    log: &mut LogTail,
    life: &Incarnation,
    checked: &mut Checked,
) -> Vec<String> {
    let mut problems = Vec::new();
    let Some(samples) = settled_counters(world, log) else {
        problems.push("/metrics did not answer, or its counters kept moving".to_string());
        return problems;
    };
    let lines = &log.lines;
    let logged = from_log(lines, life.started_ms);
    let counted = from_metrics(&samples);
    let families: std::collections::BTreeSet<&String> = logged
        .keys()
        .chain(counted.keys())
        .map(|(family, _)| family)
        .collect();
    for family in families {
        let mut equal = true;
        let keys: std::collections::BTreeSet<&String> = logged
            .keys()
            .chain(counted.keys())
            .filter(|(f, _)| f == family)
            .map(|(_, key)| key)
            .collect();
        for key in &keys {
            let pair = (family.clone(), (*key).clone());
            let (said, count) = (
                logged.get(&pair).copied().unwrap_or(0.0),
                counted.get(&pair).copied().unwrap_or(0.0),
            );
            if said != count {
                equal = false;
                problems.push(format!(
                    "{family}{{{key}}}: {count} counted, {said} said in the log"
                ));
            }
        }
        checked.counters.push((family.clone(), keys.len(), equal));
    }
    if let Some(status) = world.daemon().status() {
        let repairs = status["data_plane"]["repairs"].as_u64().unwrap_or(0);
        let said = repair_lines(lines);
        checked
            .counters
            .push(("repairs (status)".into(), 1, repairs == said));
        if repairs != said {
            problems.push(format!(
                "{repairs} repairs counted since install, {said} said in the log"
            ));
        }
    }
    problems
}

/// The violations of one checkpoint.
pub fn violations(checked: &Checked, counter_problems: &[String], seed: u64) -> Vec<Violation> {
    let mut found = Vec::new();
    if !checked.agreed {
        let differing: Vec<String> = checked
            .rows
            .iter()
            .filter(|row| !row.agrees())
            .map(|row| {
                format!(
                    "{}: sockets {}, status {:?}, metrics {:?}, maps {:?}",
                    row.addr, row.sockets, row.status, row.metrics, row.maps
                )
            })
            .collect();
        found.push(Violation {
            invariant: Invariant::ExactAgreement,
            at_ms: checked.at_ms,
            active: Vec::new(),
            what: format!(
                "no agreement after {} readings: {}{} (seed {seed})",
                checked.readings,
                differing.join("; "),
                if checked.problems.is_empty() {
                    String::new()
                } else {
                    format!("; {}", checked.problems.join("; "))
                }
            ),
        });
    }
    for problem in counter_problems {
        found.push(Violation {
            invariant: Invariant::NothingSilent,
            at_ms: checked.at_ms,
            active: Vec::new(),
            what: format!("{problem} (seed {seed})"),
        });
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(text: &str) -> LogLine {
        LogLine {
            t_ms: 1000,
            text: text.to_string(),
        }
    }

    #[test]
    fn log_lines_count_as_the_counters_they_should_move() {
        let lines = [
            line("WARN socklb::daemon: 198.18.0.2:6443 unhealthy: no answer within 500ms (2/2)"),
            line("INFO socklb::daemon: 198.18.0.2:6443 healthy: GET /readyz ok (2/2)"),
            line("INFO socklb::daemon: 198.18.0.2:6443: slow start over; it has its full weight"),
            line("INFO socklb::daemon::reload: SIGHUP: /x/socklb.toml is unchanged"),
            line(
                "WARN socklb::daemon::reload: config file changed: /x/socklb.toml is not valid; the running configuration stays: bad",
            ),
            line(
                "INFO socklb::daemon::reload: config file changed: /x/socklb.toml applied (generation 2)",
            ),
            line(
                "INFO socklb::daemon::reload: discovery: api: +198.18.0.22:6443, -198.18.0.4:6443 (endpointslices)",
            ),
            line(
                "WARN socklb::daemon::reload: discovery: api: endpointslices lists no backend; keeping its last known 5 backends",
            ),
            line(
                "INFO socklb::daemon::reload: discovery: api: endpointslices lists 5 backends again",
            ),
            line(
                "INFO socklb::daemon::routes: rebalance: api: closed 3 connections to 198.18.0.3:6443 (3 of uid 0 in cgroup 7)",
            ),
            line(
                "INFO socklb::daemon::routes: rebalance: api: closed 2 connections to 198.18.0.3:6443 (1 of uid 0 in cgroup 7, 1 of uid 65534 in cgroup 9)",
            ),
        ];
        let counts = from_log(&lines, 0);
        let get =
            |family: &str, key: &str| counts.get(&(family.to_string(), key.to_string())).copied();
        assert_eq!(
            get(
                "socklb_backend_transitions_total",
                "198.18.0.2:6443 unhealthy"
            ),
            Some(1.0)
        );
        assert_eq!(
            get(
                "socklb_backend_transitions_total",
                "198.18.0.2:6443 healthy"
            ),
            Some(1.0)
        );
        assert_eq!(get("socklb_config_reloads_total", "unchanged"), Some(1.0));
        assert_eq!(get("socklb_config_reloads_total", "error"), Some(1.0));
        assert_eq!(get("socklb_config_reloads_total", "ok"), Some(1.0));
        assert_eq!(
            get("socklb_discovery_updates_total", "api endpointslices"),
            Some(1.0)
        );
        assert_eq!(
            get("socklb_discovery_problems_total", "api endpointslices"),
            Some(1.0)
        );
        assert_eq!(
            get("socklb_rebalance_moves_total", "api 198.18.0.3:6443"),
            Some(5.0)
        );
        assert_eq!(counts.len(), 8, "{counts:?}");
    }

    #[test]
    fn a_backend_that_leaves_its_service_counts_from_zero_when_it_returns() {
        let lines = [
            line("WARN socklb::daemon: 198.18.0.2:6443 unhealthy: no answer within 500ms (2/2)"),
            line("INFO socklb::daemon: 198.18.0.2:6443 healthy: GET /readyz ok (2/2)"),
            line(
                "INFO socklb::daemon::routes: rebalance: api: closed 3 connections to 198.18.0.2:6443 (3 of uid 0 in cgroup 7)",
            ),
            line(
                "INFO socklb::daemon::routes: rebalance: api: closed 2 connections to 198.18.0.3:6443 (2 of uid 0 in cgroup 7)",
            ),
            line(
                "INFO socklb::daemon::reload: discovery: api: +198.18.0.22:6443, -198.18.0.2:6443 (endpointslices)",
            ),
            line(
                "INFO socklb::daemon::reload: discovery: api: +198.18.0.2:6443, -198.18.0.22:6443 (endpointslices)",
            ),
            line("INFO socklb::daemon: 198.18.0.2:6443 healthy: GET /readyz ok (2/2)"),
        ];
        let counts = from_log(&lines, 0);
        let get =
            |family: &str, key: &str| counts.get(&(family.to_string(), key.to_string())).copied();
        assert_eq!(
            get(
                "socklb_backend_transitions_total",
                "198.18.0.2:6443 healthy"
            ),
            Some(1.0),
            "only the transition after it came back"
        );
        assert_eq!(
            get(
                "socklb_backend_transitions_total",
                "198.18.0.2:6443 unhealthy"
            ),
            None
        );
        assert_eq!(
            get("socklb_rebalance_moves_total", "api 198.18.0.2:6443"),
            None
        );
        assert_eq!(
            get("socklb_rebalance_moves_total", "api 198.18.0.3:6443"),
            Some(2.0),
            "a backend that stayed keeps its counts"
        );
        assert_eq!(
            get("socklb_discovery_updates_total", "api endpointslices"),
            Some(2.0)
        );
    }

    #[test]
    fn metrics_count_by_the_same_keys() {
        let samples: BTreeMap<String, f64> = [
            (r#"socklb_backend_transitions_total{service="api",backend="198.18.0.2:6443",to="unhealthy"}"#, 1.0),
            (r#"socklb_config_reloads_total{result="ok"}"#, 2.0),
            (r#"socklb_discovery_problems_total{service="api",source="endpointslices",reason="failed"}"#, 1.0),
            (r#"socklb_discovery_problems_total{service="api",source="endpointslices",reason="empty"}"#, 1.0),
            (r#"socklb_rebalance_moves_total{service="api",backend="198.18.0.3:6443"}"#, 5.0),
            (r#"socklb_backend_redirects_total{service="api",backend="198.18.0.3:6443"}"#, 9.0),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_string(), value))
        .collect();
        let counts = from_metrics(&samples);
        assert_eq!(
            counts.len(),
            4,
            "redirects are not a said thing: {counts:?}"
        );
        assert_eq!(
            counts.get(&(
                "socklb_backend_transitions_total".into(),
                "198.18.0.2:6443 unhealthy".into()
            )),
            Some(&1.0)
        );
        assert_eq!(
            counts.get(&(
                "socklb_discovery_problems_total".into(),
                "api endpointslices".into()
            )),
            Some(&2.0),
            "summed over the reasons"
        );
    }
}
