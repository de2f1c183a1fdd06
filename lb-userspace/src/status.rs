//! `socklb status`: what the kernel says, readable with or without a
//! running daemon. The daemon's liveness comes from the heartbeat it keeps
//! in a pinned map, and the data plane's state from the kernel itself
//! (links, their cgroup, the pins, the tables), never from the daemon's
//! word.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    os::fd::AsFd,
    path::{Path, PathBuf},
    time::Duration,
};

use lb_common::{
    DAEMON_FLAG_RUNNING, DaemonRecord, PATH_LEN, ROLE_PREFERRED, ROLE_STANDBY,
    SERVICE_FLAG_ACCELERATE, SERVICE_FLAG_ALL_NETNS, SERVICE_FLAG_LEAST_CONN,
    SERVICE_FLAG_PREFER_LOCAL, SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY, SLOTS_PER_LIST, ServiceEntry,
    SockKey, names, repair,
};
use serde::Serialize;

use crate::{
    daemon::boottime_ns,
    dataplane::{MapStore, PinPaths, sys, tables::table_name},
    planner::socket_addr,
};

/// A heartbeat older than this means the daemon is not running.
pub const STALE_AFTER: Duration = Duration::from_secs(3);

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct StatusReport {
    pub daemon: DaemonStatus,
    pub data_plane: DataPlaneStatus,
    pub services: Vec<ServiceStatus>,
    /// What the running daemon says of its configuration and discovery
    /// (through its control socket); absent while it does not answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub daemon_info: Option<crate::daemon::control::DaemonInfo>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct DaemonStatus {
    /// A heartbeat within the last few seconds.
    pub running: bool,
    pub pid: Option<u32>,
    pub heartbeat_age_ms: Option<u64>,
    /// The last daemon exited on SIGTERM or SIGINT (rather than dying).
    pub exited: bool,
    pub config_generation: u64,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct DataPlaneStatus {
    /// Every link is pinned and attached to the cgroup at its path.
    pub attached: bool,
    pub cgroup: Option<String>,
    /// What is wrong, one line each; empty when all is as written.
    pub problems: Vec<String>,
    /// Repairs made since install.
    pub repairs: u64,
    pub repairs_by_kind: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct ServiceStatus {
    pub name: String,
    pub vips: Vec<String>,
    /// Selection policy: "random", "least-conn" or "prefer-local".
    pub policy: String,
    /// "fail-open" or "reject".
    pub when_none_healthy: String,
    pub all_netns: bool,
    /// `accelerate = "sockmap"`.
    pub accelerate: bool,
    /// Connects that found no healthy backend.
    pub none_healthy: u64,
    /// Of those, connects refused by the reject policy.
    pub rejected: u64,
    pub backends: Vec<BackendStatus>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct BackendStatus {
    pub addr: String,
    pub healthy: bool,
    /// False while `healthy` is only assumed: no probe has answered yet.
    pub probed: bool,
    pub weight: u32,
    /// "normal", "preferred" or "standby".
    pub role: String,
    /// Takes no new connections (config `drain` or `socklb drain`).
    pub draining: bool,
    pub redirects: u64,
    /// Established connections open now (counted by sock_ops).
    pub live: i64,
    /// Connects that failed on the server side (reset, or SYN unanswered).
    pub failed_connects: u64,
    /// Whether the backend is in the table connects read now.
    pub in_table: bool,
    /// For a backend that is accelerated (local, of an accelerating
    /// service): its connections whose two ends are both in the sockhash
    /// and still redirect, so that data moves socket to socket both ways.
    /// 0 while the backend's process is outside the cgroup socklb watches.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accelerated: Option<u64>,
}

fn path_of(field: &[u8; PATH_LEN]) -> Option<PathBuf> {
    let end = field.iter().position(|&byte| byte == 0).unwrap_or(PATH_LEN);
    (end > 0).then(|| PathBuf::from(String::from_utf8_lossy(&field[..end]).into_owned()))
}

fn daemon_status(record: Option<&DaemonRecord>, now_ns: u64) -> DaemonStatus {
    let Some(record) = record.filter(|record| record.pid != 0) else {
        return DaemonStatus {
            running: false,
            pid: None,
            heartbeat_age_ms: None,
            exited: false,
            config_generation: 0,
        };
    };
    let age = Duration::from_nanos(now_ns.saturating_sub(record.heartbeat_ns));
    let flagged = record.flags & DAEMON_FLAG_RUNNING != 0;
    DaemonStatus {
        running: flagged && age < STALE_AFTER,
        pid: Some(record.pid),
        heartbeat_age_ms: Some(age.as_millis() as u64),
        exited: !flagged,
        config_generation: record.config_generation,
    }
}

/// What is wrong with the links, the cgroup and the pins, seen from the
/// kernel alone.
fn link_problems(paths: &PinPaths, cgroup_path: Option<&Path>, cgroup_id: u64) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(path) = cgroup_path {
        match crate::dataplane::CgroupTarget::current_id(path) {
            None => problems.push(format!("the cgroup {} is gone", path.display())),
            Some(id) if id != cgroup_id => problems.push(format!(
                "the cgroup {} was created again (id {cgroup_id} → {id}); the links attach to the old one",
                path.display()
            )),
            Some(_) => {}
        }
    }
    for (program, path) in paths.links() {
        let Ok(fd) = sys::open_pinned(&path) else {
            problems.push(format!(
                "the link of {program} is not pinned ({})",
                path.display()
            ));
            continue;
        };
        match sys::link_info(fd.as_fd()) {
            Ok(info) if info.cgroup_id == 0 => {
                problems.push(format!("the link of {program} is detached"))
            }
            Ok(info) if info.cgroup_id != cgroup_id => problems.push(format!(
                "the link of {program} attaches to cgroup id {}, not {cgroup_id}",
                info.cgroup_id
            )),
            Ok(_) => {}
            Err(error) => problems.push(format!("the link of {program}: {error}")),
        }
    }
    for (name, path) in paths.maps() {
        if !path.exists() {
            problems.push(format!("the map {name} is not pinned ({})", path.display()));
        }
    }
    problems
}

/// The sockhash without its sk_msg program: connections paired from then
/// on take the normal path. Says nothing where the kernel cannot tell
/// (before Linux 5.19).
fn sk_msg_problem(paths: &PinPaths) -> Option<String> {
    let map = sys::open_pinned(&paths.map(names::SOCKHASH)).ok()?;
    let attached = sys::sk_msg_programs(map.as_fd()).ok()?;
    attached.is_empty().then(|| {
        "the sk_msg program is detached from the sockhash: connections are no longer accelerated"
            .to_string()
    })
}

/// Slots whose target is not the backend they are counted for: traffic
/// would go one place while status credits another.
fn slot_problems(
    store: &dyn MapStore,
    entries: &[(lb_common::Endpoint, ServiceEntry)],
    targets: &HashMap<u32, lb_common::Endpoint>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (_, entry) in entries {
        if !seen.insert((entry.table_id, entry.bank_base)) {
            continue;
        }
        let lists = [
            (entry.bank_base, entry.healthy_slots.min(SLOTS_PER_LIST)),
            (
                entry.bank_base + SLOTS_PER_LIST,
                entry.all_slots.min(SLOTS_PER_LIST),
            ),
        ];
        for (first, count) in lists {
            let Ok(slots) = store.slots(first, count) else {
                continue;
            };
            let wrong = slots
                .iter()
                .filter(|slot| targets.get(&slot.backend_id) != Some(&slot.target))
                .count();
            if wrong > 0 {
                problems.push(format!(
                    "table {}: {wrong} slots send connects somewhere other than the backend they are counted for",
                    entry.table_id
                ));
            }
        }
    }
    problems
}

/// Reads the report from the maps and the kernel.
pub fn read(store: &dyn MapStore, paths: &PinPaths) -> StatusReport {
    let record = store.daemon().ok();
    let daemon = daemon_status(record.as_ref(), boottime_ns());
    let settings = store.settings().unwrap_or_default();
    let cgroup_path = record
        .as_ref()
        .and_then(|record| path_of(&record.cgroup_path));
    let cgroup_id = record
        .as_ref()
        .map(|record| record.cgroup_id)
        .filter(|id| *id != 0)
        .unwrap_or(settings.attached_cgroup_id);
    let mut problems = link_problems(paths, cgroup_path.as_deref(), cgroup_id);
    let attached = problems.is_empty();
    let backend_records = store.backends().unwrap_or_default();
    let entries = store.services().unwrap_or_default();
    let targets: HashMap<u32, lb_common::Endpoint> = backend_records
        .iter()
        .map(|(id, info)| (*id, info.target))
        .collect();
    problems.extend(slot_problems(store, &entries, &targets));
    // The program is attached whatever the config; it matters only where a
    // service accelerates.
    if entries
        .iter()
        .any(|(_, entry)| entry.flags & SERVICE_FLAG_ACCELERATE != 0)
    {
        problems.extend(sk_msg_problem(paths));
    }
    if !daemon.running {
        problems.push(match daemon.heartbeat_age_ms {
            Some(age) => format!(
                "the daemon is not running (last heartbeat {} ago); health verdicts are frozen",
                age_words(age)
            ),
            None => "no daemon has run this install; health verdicts are frozen".into(),
        });
    }
    let repairs = record.map(|record| record.repairs).unwrap_or([0; 16]);
    let data_plane = DataPlaneStatus {
        attached,
        cgroup: cgroup_path.map(|path| path.display().to_string()),
        problems,
        repairs: repairs.iter().sum(),
        repairs_by_kind: repair::NAMES
            .iter()
            .zip(repairs)
            .filter(|(_, count)| *count > 0)
            .map(|(name, count)| ((*name).to_string(), count))
            .collect(),
    };
    StatusReport {
        daemon,
        data_plane,
        services: services(store, &entries, backend_records),
        daemon_info: None,
    }
}

fn services(
    store: &dyn MapStore,
    entries: &[(lb_common::Endpoint, ServiceEntry)],
    backend_records: Vec<(u32, lb_common::BackendInfo)>,
) -> Vec<ServiceStatus> {
    let mut services: BTreeMap<String, ServiceStatus> = BTreeMap::new();
    let mut table_service = BTreeMap::new();
    let mut tables = store.tables().unwrap_or_default();
    tables.sort_by_key(|(id, _)| *id);
    for (table_id, info) in &tables {
        let name = table_name(info);
        let stats = store.table_stats(*table_id);
        let service = services
            .entry(name.clone())
            .or_insert_with(|| ServiceStatus {
                name: name.clone(),
                vips: Vec::new(),
                policy: policy_name(info.flags).into(),
                when_none_healthy: if info.flags & SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY != 0 {
                    "reject".into()
                } else {
                    "fail-open".into()
                },
                all_netns: info.flags & SERVICE_FLAG_ALL_NETNS != 0,
                accelerate: info.flags & SERVICE_FLAG_ACCELERATE != 0,
                none_healthy: 0,
                rejected: 0,
                backends: Vec::new(),
            });
        service.none_healthy += stats.none_healthy;
        service.rejected += stats.rejected;
        table_service.insert(*table_id, name);
    }
    let mut vips: Vec<(u32, String)> = entries
        .iter()
        .filter_map(|(vip, entry)| Some((entry.table_id, socket_addr(vip)?.to_string())))
        .collect();
    vips.sort();
    for (table_id, vip) in vips {
        if let Some(service) = table_service
            .get(&table_id)
            .and_then(|name| services.get_mut(name))
        {
            service.vips.push(vip);
        }
    }
    let mut in_table: HashMap<u32, std::collections::HashSet<u32>> = HashMap::new();
    for (_, entry) in entries {
        let ids = store
            .slots(entry.bank_base, entry.healthy_slots.min(SLOTS_PER_LIST))
            .unwrap_or_default()
            .into_iter()
            .map(|slot| slot.backend_id);
        in_table.entry(entry.table_id).or_default().extend(ids);
    }
    let accelerated_backends = store.accelerated().unwrap_or_default();
    let pairs = if accelerated_backends.is_empty() {
        HashMap::new()
    } else {
        accelerated_pairs(&store.accelerated_sockets(), &accelerated_backends)
    };
    let mut backend_records = backend_records;
    backend_records.sort_by_key(|(id, _)| *id);
    for (backend_id, info) in backend_records {
        let Some(service) = table_service
            .get(&info.table_id)
            .and_then(|name| services.get_mut(name))
        else {
            continue;
        };
        let conns = store.connections(backend_id);
        service.backends.push(BackendStatus {
            addr: socket_addr(&info.target).map_or_else(|| "?".into(), |addr| addr.to_string()),
            healthy: info.healthy != 0,
            probed: info.probed != 0,
            draining: info.draining != 0,
            role: match info.role {
                ROLE_PREFERRED => "preferred",
                ROLE_STANDBY => "standby",
                _ => "normal",
            }
            .into(),
            weight: info.weight,
            redirects: store.redirects(backend_id),
            live: conns.live,
            failed_connects: conns.failed_connects,
            in_table: in_table
                .get(&info.table_id)
                .is_some_and(|ids| ids.contains(&backend_id)),
            accelerated: accelerated_backends
                .contains(&info.target)
                .then(|| pairs.get(&info.target).copied().unwrap_or(0)),
        });
    }
    services.into_values().collect()
}

/// Connections whose two ends are both in the sockhash, by backend,
/// counted at the client end (whose remote address is the backend).
fn accelerated_pairs(
    keys: &[SockKey],
    backends: &std::collections::BTreeSet<lb_common::Endpoint>,
) -> HashMap<lb_common::Endpoint, u64> {
    let all: std::collections::HashSet<&SockKey> = keys.iter().collect();
    let mut pairs = HashMap::new();
    for key in keys {
        let backend = SockKey::endpoint(key.remote, key.remote_port);
        if backends.contains(&backend) && all.contains(&key.peer()) {
            *pairs.entry(backend).or_insert(0) += 1;
        }
    }
    pairs
}

fn policy_name(flags: u32) -> &'static str {
    if flags & SERVICE_FLAG_PREFER_LOCAL != 0 {
        "prefer-local"
    } else if flags & SERVICE_FLAG_LEAST_CONN != 0 {
        "least-conn"
    } else {
        "random"
    }
}

/// "0.4 s", "2 min", "3 h".
fn age_words(ms: u64) -> String {
    match ms {
        0..10_000 => format!("{:.1} s", ms as f64 / 1000.0),
        10_000..120_000 => format!("{} s", ms / 1000),
        120_000..7_200_000 => format!("{} min", ms / 60_000),
        _ => format!("{} h", ms / 3_600_000),
    }
}

/// Why `status --check` fails, gravest first; the exit status is that of
/// the first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckFailure {
    /// Exit 4: connects to the VIPs are not redirected (all or some).
    NotAttached,
    /// Exit 3: health verdicts are frozen.
    DaemonNotRunning,
    /// Exit 5: the service has no healthy backend.
    NoHealthyBackend(String),
}

impl CheckFailure {
    pub fn exit_status(&self) -> u8 {
        match self {
            Self::DaemonNotRunning => 3,
            Self::NotAttached => 4,
            Self::NoHealthyBackend(_) => 5,
        }
    }
}

impl fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DaemonNotRunning => write!(f, "the daemon is not running"),
            Self::NotAttached => write!(f, "the data plane is not attached"),
            Self::NoHealthyBackend(service) => {
                write!(f, "service {service} has no healthy backend")
            }
        }
    }
}

impl StatusReport {
    /// What `status --check` requires: a running daemon, an attached data
    /// plane, and a healthy backend in every service.
    pub fn check(&self) -> Vec<CheckFailure> {
        let mut failures = Vec::new();
        if !self.data_plane.attached {
            failures.push(CheckFailure::NotAttached);
        }
        if !self.daemon.running {
            failures.push(CheckFailure::DaemonNotRunning);
        }
        for service in &self.services {
            if !service
                .backends
                .iter()
                .any(|backend| backend.healthy && !backend.draining)
            {
                failures.push(CheckFailure::NoHealthyBackend(service.name.clone()));
            }
        }
        failures
    }
}

fn write_daemon_info(
    f: &mut fmt::Formatter<'_>,
    info: &crate::daemon::control::DaemonInfo,
) -> fmt::Result {
    let reload = match &info.last_reload {
        None => "no reload yet".to_string(),
        Some(reload) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::SystemTime::UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.as_secs());
            format!(
                "last reload {} ago: {}{}",
                age_words(now.saturating_sub(reload.at) * 1000),
                if reload.ok { "" } else { "FAILED: " },
                reload.message.replace('\n', "; ")
            )
        }
    };
    writeln!(f, "config: generation {}, {reload}", info.config_generation)?;
    for service in info
        .services
        .iter()
        .filter(|service| !service.sources.is_empty())
    {
        let states: Vec<String> = service
            .sources
            .iter()
            .map(|(source, state)| format!("{source}: {state}"))
            .collect();
        writeln!(
            f,
            "discovery {}: following {} ({} backends); {}",
            service.service,
            service.following.as_deref().unwrap_or("nothing yet"),
            service.backends,
            states.join("; ")
        )?;
    }
    for service in &info.fleet {
        let ramping: Vec<String> = service
            .ramping
            .iter()
            .map(|(addr, step)| format!("{addr} at {step}/10"))
            .collect();
        writeln!(
            f,
            "fleet {}: slow start: {}; rebalance moves: {}",
            service.service,
            if ramping.is_empty() {
                "none in progress".to_string()
            } else {
                ramping.join(", ")
            },
            service.rebalance_moves
        )?;
    }
    Ok(())
}

impl fmt::Display for StatusReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.daemon, self.daemon.pid) {
            (daemon, Some(pid)) if daemon.running => writeln!(
                f,
                "daemon: running (pid {pid}, heartbeat {} ago)",
                age_words(daemon.heartbeat_age_ms.unwrap_or(0))
            )?,
            (daemon, Some(_)) => writeln!(
                f,
                "daemon: NOT RUNNING — {} {} ago; health verdicts are frozen",
                if daemon.exited {
                    "exited"
                } else {
                    "last heartbeat"
                },
                age_words(daemon.heartbeat_age_ms.unwrap_or(0))
            )?,
            _ => writeln!(f, "daemon: NOT RUNNING — no daemon has run this install")?,
        }
        writeln!(
            f,
            "data plane: {}{}, {} repairs",
            if self.data_plane.attached {
                "attached"
            } else {
                "NOT ATTACHED"
            },
            self.data_plane
                .cgroup
                .as_ref()
                .map_or(String::new(), |cgroup| format!(" to {cgroup}")),
            self.data_plane.repairs
        )?;
        for problem in &self.data_plane.problems {
            writeln!(f, "  problem: {problem}")?;
        }
        if let Some(info) = &self.daemon_info {
            write_daemon_info(f, info)?;
        }
        if self.services.is_empty() {
            return writeln!(f, "no services");
        }
        for service in &self.services {
            writeln!(
                f,
                "service {}  vips {}  policy {}  when-none-healthy {}{}  none-healthy {} rejected {}",
                service.name,
                service.vips.join(","),
                service.policy,
                service.when_none_healthy,
                if service.all_netns { "  all-netns" } else { "" },
                service.none_healthy,
                service.rejected
            )?;
            writeln!(
                f,
                "  {:<44} {:<9} {:>6} {:<9} {:>10} {:>6} {:>7}",
                "BACKEND", "HEALTH", "WEIGHT", "ROLE", "REDIRECTS", "LIVE", "FAILED"
            )?;
            for backend in &service.backends {
                let health = match (backend.draining, backend.probed, backend.healthy) {
                    (true, _, _) => "draining",
                    (false, false, _) => "unknown",
                    (false, true, true) => "healthy",
                    (false, true, false) => "unhealthy",
                };
                writeln!(
                    f,
                    "  {:<44} {:<9} {:>6} {:<9} {:>10} {:>6} {:>7}",
                    backend.addr,
                    health,
                    backend.weight,
                    backend.role,
                    backend.redirects,
                    backend.live,
                    backend.failed_connects
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_or_cleared_heartbeat_is_not_running() {
        let record = |flags, heartbeat_ns| DaemonRecord {
            pid: 42,
            flags,
            heartbeat_ns,
            ..DaemonRecord::default()
        };
        let now = 100_000_000_000;
        let cases = [
            (
                "fresh",
                record(DAEMON_FLAG_RUNNING, now - 400_000_000),
                true,
            ),
            (
                "stale",
                record(DAEMON_FLAG_RUNNING, now - 4_000_000_000),
                false,
            ),
            ("exited", record(0, now - 100_000_000), false),
        ];
        for (what, record, running) in cases {
            assert_eq!(daemon_status(Some(&record), now).running, running, "{what}");
        }
        assert!(!daemon_status(None, now).running);
    }

    #[test]
    fn a_slot_sent_elsewhere_than_the_backend_it_counts_for_is_a_problem() {
        use lb_common::{BackendInfo, BackendSlot, ServiceEntry, bank_base};

        use crate::{dataplane::MemoryMaps, planner::endpoint};
        let backend = endpoint(&"127.0.0.2:80".parse().unwrap());
        let elsewhere = endpoint(&"127.0.0.9:80".parse().unwrap());
        let mut maps = MemoryMaps::default();
        maps.backends.insert(
            0,
            BackendInfo {
                target: backend,
                ..BackendInfo::default()
            },
        );
        maps.services.insert(
            endpoint(&"127.0.0.1:6444".parse().unwrap()),
            ServiceEntry {
                bank_base: bank_base(0, 0),
                healthy_slots: 1,
                all_slots: 1,
                ..ServiceEntry::default()
            },
        );
        let slot = |target| BackendSlot {
            target,
            backend_id: 0,
        };
        maps.slots.insert(0, slot(backend));
        maps.slots.insert(SLOTS_PER_LIST, slot(backend));
        let paths = PinPaths::new("/nonexistent/socklb");
        let clean = read(&maps, &paths).data_plane.problems;
        assert!(!clean.iter().any(|problem| problem.contains("slots send")));
        maps.slots.insert(0, slot(elsewhere));
        let problems = read(&maps, &paths).data_plane.problems;
        assert!(
            problems
                .iter()
                .any(|problem| problem == "table 0: 1 slots send connects somewhere other than the backend they are counted for"),
            "{problems:?}"
        );
    }

    #[test]
    fn ages_read_naturally() {
        assert_eq!(age_words(400), "0.4 s");
        assert_eq!(age_words(65_000), "65 s");
        assert_eq!(age_words(150_000), "2 min");
    }
}
