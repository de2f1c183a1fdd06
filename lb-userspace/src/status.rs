//! `socklb status`: what the kernel says, readable with or without a
//! running daemon. The daemon's liveness comes from the heartbeat it keeps
//! in a pinned map, and the data plane's state from the kernel itself
//! (links, their cgroup, the pins, the tables), never from the daemon's
//! word.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    os::fd::AsFd,
    path::Path,
    time::Duration,
};

use lb_common::{
    DAEMON_FLAG_RUNNING, DaemonRecord, ROLE_PREFERRED, ROLE_STANDBY, SERVICE_FLAG_ACCELERATE,
    SERVICE_FLAG_ALL_NETNS, SERVICE_FLAG_HAND_BACK, SERVICE_FLAG_HAND_BACK_AUTO,
    SERVICE_FLAG_LEAST_CONN, SERVICE_FLAG_PREFER_LOCAL, SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY,
    SLOTS_PER_LIST, ServiceEntry, SockKey, names, repair,
};
use serde::Serialize;

use crate::{
    clock::{self, boottime_ns},
    config::WhenDaemonGone,
    convert::{path_of, socket_addr},
    dataplane::{
        LinkProblem, MapStore, PinPaths,
        links::{LinkSource, check_links},
        sys,
        tables::table_name,
    },
    hand_back::{self, HandBackChoice},
    protocol::DaemonInfo,
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
    pub daemon_info: Option<DaemonInfo>,
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
    /// The kernel's table of the sockets socklb follows (absent in an
    /// install of an older socklb).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_table: Option<SocketTableStatus>,
}

/// The kernel's table of redirected sockets: fixed in size and memory.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct SocketTableStatus {
    /// The most sockets it can hold: `socket-table-size` in the hash, plus
    /// the array's slots on Linux 5.12 and later.
    pub capacity: u32,
    /// Sockets it holds now: redirected and not yet closed.
    pub tracked: u64,
    /// The array's slots (0 before Linux 5.12: the hash alone).
    pub slots: u32,
    /// No room for a socket whose slots are taken: the hash is full.
    pub full: bool,
    /// Kernel memory it takes, all of it allocated when it was made.
    pub memory_bytes: u64,
    /// Connects redirected without a record since install, the table being
    /// full: getpeername shows them their backend, least-conn does not
    /// count them.
    pub untracked: u64,
}

impl From<crate::dataplane::SocketTableUse> for SocketTableStatus {
    fn from(table: crate::dataplane::SocketTableUse) -> Self {
        Self {
            capacity: table.capacity,
            tracked: table.tracked,
            slots: table.slots,
            full: table.full,
            memory_bytes: table.memory_bytes,
            untracked: table.untracked,
        }
    }
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
    /// What the VIPs do once the daemon is gone, and whether they are
    /// handed back now.
    pub when_daemon_gone: HandBackStatus,
    pub backends: Vec<BackendStatus>,
}

/// A service's `when-daemon-gone`, as the kernel holds it: what is
/// configured and what applies (the table's flags), why, and whether the
/// kernel hands the VIPs back now (the heartbeat it reads is older than
/// `daemon-gone-after`).
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct HandBackStatus {
    /// "auto", "keep" or "hand-back".
    pub configured: String,
    /// "keep" or "hand-back".
    pub effective: String,
    /// Why it applies: "127.0.0.1:6444 has a listener", "configured", …
    /// With auto, from the listeners on the VIPs now; it says so where
    /// they differ from what the last start or reload found.
    pub reason: String,
    /// How old the heartbeat may get before the VIPs are handed back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub daemon_gone_after_ms: Option<u64>,
    /// The kernel leaves the VIPs' connects alone now: they reach
    /// whatever listens there.
    pub handed_back: bool,
    /// Since when (UTC), while handed back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handed_back_since: Option<String>,
    /// For how long, while handed back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handed_back_for_ms: Option<u64>,
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
/// kernel alone (the check the daemon's verification makes too).
fn link_problems(paths: &PinPaths, cgroup_path: Option<&Path>, cgroup_id: u64) -> Vec<String> {
    let mut problems: Vec<String> = check_links(paths, cgroup_path, cgroup_id, LinkSource::Pins)
        .into_iter()
        .map(|problem| link_problem_text(&problem, paths, cgroup_path, cgroup_id))
        .collect();
    for (name, path) in paths.maps() {
        if !path.exists() {
            problems.push(format!("the map {name} is not pinned ({})", path.display()));
        }
    }
    problems
}

/// A link problem as status says it: the state found, not the event.
fn link_problem_text(
    problem: &LinkProblem,
    paths: &PinPaths,
    cgroup_path: Option<&Path>,
    cgroup_id: u64,
) -> String {
    let cgroup = cgroup_path.map_or_else(String::new, |path| path.display().to_string());
    match problem {
        LinkProblem::CgroupGone => format!("the cgroup {cgroup} is gone"),
        LinkProblem::CgroupRecreated { new_id } => format!(
            "the cgroup {cgroup} was created again (id {cgroup_id} → {new_id}); the links attach to the old one"
        ),
        LinkProblem::Detached { program } => format!("the link of {program} is detached"),
        LinkProblem::AttachedElsewhere {
            program,
            cgroup_id: elsewhere,
        } => format!("the link of {program} attaches to cgroup id {elsewhere}, not {cgroup_id}"),
        LinkProblem::PinMissing { program } => format!(
            "the link of {program} is not pinned ({})",
            paths.link(program).display()
        ),
        LinkProblem::NotListed { .. } | LinkProblem::PinReplaced { .. } => problem.to_string(),
    }
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
    let socket_table = store.socket_table().ok().map(SocketTableStatus::from);
    if let Some(table) = socket_table.as_ref().filter(|table| table.full) {
        problems.push(format!(
            "the socket table is full ({} sockets at most): further connects are redirected untracked; raise socket-table-size",
            table.capacity
        ));
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
        socket_table,
    };
    let mut services = services(store, &entries, backend_records);
    let own_pid = record
        .as_ref()
        .filter(|_| daemon.running)
        .map(|record| record.pid);
    hand_back_status(store, &mut services, own_pid);
    StatusReport {
        daemon,
        data_plane,
        services,
        daemon_info: None,
    }
}

/// Fills each service's `when_daemon_gone` from its tables' flags, the
/// heartbeat the connect programs read, and, for auto, the listeners on
/// its VIPs now (other than the running daemon's own sockets).
fn hand_back_status(store: &dyn MapStore, services: &mut [ServiceStatus], own_pid: Option<u32>) {
    let liveness = store.liveness().unwrap_or_default();
    let now_ns = boottime_ns();
    let mut tables = store.tables().unwrap_or_default();
    tables.sort_by_key(|(id, _)| *id);
    for service in services.iter_mut() {
        let mine: Vec<(u32, u32)> = tables
            .iter()
            .filter(|(_, info)| table_name(info) == service.name)
            .map(|(id, info)| (*id, info.flags))
            .collect();
        let flags = mine.first().map_or(0, |(_, flags)| *flags);
        let status = &mut service.when_daemon_gone;
        status.configured = configured_mode(flags).as_str().into();
        status.effective = if flags & SERVICE_FLAG_HAND_BACK != 0 {
            "hand-back"
        } else {
            "keep"
        }
        .into();
        status.reason = reason(flags, &service.vips, own_pid);
        let Some(&(table_id, _)) = mine
            .iter()
            .find(|(_, flags)| flags & SERVICE_FLAG_HAND_BACK != 0)
        else {
            continue;
        };
        let gone_after = liveness
            .gone_after_ns
            .get(table_id as usize)
            .copied()
            .unwrap_or(0);
        status.daemon_gone_after_ms = (gone_after != 0).then_some(gone_after / 1_000_000);
        if liveness.handed_back(table_id, now_ns) {
            let since_ns = liveness.heartbeat_ns.saturating_add(gone_after);
            status.handed_back = true;
            status.handed_back_since = Some(clock::rfc3339(clock::wall_time_of(since_ns)));
            status.handed_back_for_ms = Some(now_ns.saturating_sub(since_ns) / 1_000_000);
        }
    }
}

/// The `when-daemon-gone` a table was planned with, from its flags.
fn configured_mode(flags: u32) -> WhenDaemonGone {
    if flags & SERVICE_FLAG_HAND_BACK_AUTO != 0 {
        WhenDaemonGone::Auto
    } else if flags & SERVICE_FLAG_HAND_BACK != 0 {
        WhenDaemonGone::HandBack
    } else {
        WhenDaemonGone::Keep
    }
}

/// Why a service's choice applies. For auto, auto's rule applied to the
/// listeners on the VIPs now; where that differs from the choice in
/// force, both are said, as the next reload would change it.
fn reason(flags: u32, vips: &[String], own_pid: Option<u32>) -> String {
    if flags & SERVICE_FLAG_HAND_BACK_AUTO == 0 {
        return "configured".into();
    }
    let vips: Vec<std::net::SocketAddr> = vips.iter().filter_map(|vip| vip.parse().ok()).collect();
    let listeners = match hand_back::listeners(&vips, own_pid) {
        Ok(listeners) => listeners,
        Err(error) => return format!("the listeners on the VIPs could not be read: {error}"),
    };
    let now = HandBackChoice::decide(WhenDaemonGone::Auto, &vips, &listeners);
    let in_force = flags & SERVICE_FLAG_HAND_BACK != 0;
    match (in_force, now.hand_back) {
        (true, false) => format!(
            "a VIP had a listener at the last start or reload; now {} (the next reload keeps redirecting)",
            now.reason()
        ),
        (false, true) => format!(
            "no VIP had a listener at the last start or reload; now {} (the next reload hands back)",
            now.reason()
        ),
        _ => now.reason(),
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
            .or_insert_with(|| service_of(name.clone(), info.flags));
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
    let backends = Backends::read(store, entries);
    let mut backend_records = backend_records;
    backend_records.sort_by_key(|(id, _)| *id);
    for (backend_id, info) in backend_records {
        if let Some(service) = table_service
            .get(&info.table_id)
            .and_then(|name| services.get_mut(name))
        {
            service
                .backends
                .push(backends.status(store, backend_id, &info));
        }
    }
    services.into_values().collect()
}

/// A service's entry, before its VIPs, counts and backends.
fn service_of(name: String, flags: u32) -> ServiceStatus {
    ServiceStatus {
        name,
        vips: Vec::new(),
        policy: policy_name(flags).into(),
        when_none_healthy: if flags & SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY != 0 {
            "reject".into()
        } else {
            "fail-open".into()
        },
        all_netns: flags & SERVICE_FLAG_ALL_NETNS != 0,
        accelerate: flags & SERVICE_FLAG_ACCELERATE != 0,
        none_healthy: 0,
        rejected: 0,
        when_daemon_gone: HandBackStatus::default(),
        backends: Vec::new(),
    }
}

/// What the backends' statuses are read against: which backends the
/// tables connects read now list, and the accelerated ones.
struct Backends {
    in_table: HashMap<u32, std::collections::HashSet<u32>>,
    accelerated: std::collections::BTreeSet<lb_common::Endpoint>,
    pairs: HashMap<lb_common::Endpoint, u64>,
}

impl Backends {
    fn read(store: &dyn MapStore, entries: &[(lb_common::Endpoint, ServiceEntry)]) -> Self {
        let mut in_table: HashMap<u32, std::collections::HashSet<u32>> = HashMap::new();
        for (_, entry) in entries {
            let ids = store
                .slots(entry.bank_base, entry.healthy_slots.min(SLOTS_PER_LIST))
                .unwrap_or_default()
                .into_iter()
                .map(|slot| slot.backend_id);
            in_table.entry(entry.table_id).or_default().extend(ids);
        }
        let accelerated = store.accelerated().unwrap_or_default();
        let pairs = if accelerated.is_empty() {
            HashMap::new()
        } else {
            accelerated_pairs(&store.accelerated_sockets(), &accelerated)
        };
        Self {
            in_table,
            accelerated,
            pairs,
        }
    }

    fn status(
        &self,
        store: &dyn MapStore,
        backend_id: u32,
        info: &lb_common::BackendInfo,
    ) -> BackendStatus {
        let conns = store.connections(backend_id).unwrap_or_default();
        BackendStatus {
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
            in_table: self
                .in_table
                .get(&info.table_id)
                .is_some_and(|ids| ids.contains(&backend_id)),
            accelerated: self
                .accelerated
                .contains(&info.target)
                .then(|| self.pairs.get(&info.target).copied().unwrap_or(0)),
        }
    }
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
    /// Exit 6: the kernel hands the service's VIPs back (the daemon is
    /// gone): since when.
    HandedBack { service: String, since: String },
}

impl CheckFailure {
    pub fn exit_status(&self) -> u8 {
        match self {
            Self::DaemonNotRunning => 3,
            Self::NotAttached => 4,
            Self::NoHealthyBackend(_) => 5,
            Self::HandedBack { .. } => 6,
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
            Self::HandedBack { service, since } => write!(
                f,
                "service {service} is handed back since {since}: its connects reach whatever listens on its VIPs, not socklb's backends"
            ),
        }
    }
}

impl StatusReport {
    /// What `status --check` requires: a running daemon, an attached data
    /// plane, no service handed back, and a healthy backend in every
    /// service.
    pub fn check(&self) -> Vec<CheckFailure> {
        let mut failures = Vec::new();
        if !self.data_plane.attached {
            failures.push(CheckFailure::NotAttached);
        }
        if !self.daemon.running {
            failures.push(CheckFailure::DaemonNotRunning);
        }
        for service in &self.services {
            if let Some(since) = &service.when_daemon_gone.handed_back_since {
                failures.push(CheckFailure::HandedBack {
                    service: service.name.clone(),
                    since: since.clone(),
                });
            }
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

fn write_daemon_info(f: &mut fmt::Formatter<'_>, info: &DaemonInfo) -> fmt::Result {
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
        if let Some(table) = &self.data_plane.socket_table {
            let layout = if table.slots > 0 {
                format!(" (an array of {} slots, then the hash)", table.slots)
            } else {
                String::new()
            };
            writeln!(
                f,
                "socket table: {} of {} sockets tracked{layout}, {:.1} MiB of kernel memory (fixed), {} connects untracked",
                table.tracked,
                table.capacity,
                table.memory_bytes as f64 / (1024.0 * 1024.0),
                table.untracked
            )?;
        }
        if let Some(info) = &self.daemon_info {
            write_daemon_info(f, info)?;
        }
        if self.services.is_empty() {
            return writeln!(f, "no services");
        }
        for service in &self.services {
            write_service(f, service)?;
        }
        Ok(())
    }
}

/// "when the daemon is gone: auto: hand-back (127.0.0.1:6444 has a
/// listener), after 10 s without a heartbeat", and, while the kernel hands
/// the VIPs back, since when.
fn write_hand_back(f: &mut fmt::Formatter<'_>, status: &HandBackStatus) -> fmt::Result {
    let auto = if status.configured == "auto" {
        "auto: "
    } else {
        ""
    };
    let after = status.daemon_gone_after_ms.map_or(String::new(), |ms| {
        format!(", after {} without a heartbeat", age_words(ms))
    });
    writeln!(
        f,
        "  when the daemon is gone: {auto}{} ({}){after}",
        status.effective, status.reason
    )?;
    if let Some(since) = &status.handed_back_since {
        writeln!(
            f,
            "  HANDED BACK since {since} ({} ago): the daemon's heartbeat is older than daemon-gone-after; connects to the VIPs reach whatever listens there",
            age_words(status.handed_back_for_ms.unwrap_or(0))
        )?;
    }
    Ok(())
}

/// One service and its backends, as `status` prints them.
fn write_service(f: &mut fmt::Formatter<'_>, service: &ServiceStatus) -> fmt::Result {
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
    write_hand_back(f, &service.when_daemon_gone)?;
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
    Ok(())
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

        use crate::{convert::endpoint, dataplane::MemoryMaps};
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
