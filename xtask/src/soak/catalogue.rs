//! The nemesis's fault catalogue, as data: what each fault does to which
//! target, how long it lasts, what it holds while it lasts (so that two
//! faults never fight over one thing), and what the invariants make of it.
//! A new fault is a new row here and its two actions in `nemesis.rs`.

/// Every fault the nemesis can draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    ServerKill,
    ServerRestart,
    ServerHang,
    ServerBlackhole,
    ServerSlow,
    ServerFlap,
    ServerReaddress,
    DaemonKill,
    DaemonStop,
    DaemonUpgrade,
    SighupValid,
    SighupInvalid,
    ConfigEdit,
    StateFileRewrite,
    ApiserverRestart,
    ApiGone,
    SliceEmptied,
    LinkDetach,
    SlotsRewrite,
    PinRemove,
    CpuStarve,
    MemoryPressure,
}

impl FaultKind {
    /// The fault ends the daemon's process (a new one takes over).
    pub fn ends_daemon_life(self) -> bool {
        matches!(self, FaultKind::DaemonKill | FaultKind::DaemonUpgrade)
    }
}

/// What a fault does to the server it targets, as the connect and
/// stale-choice invariants see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerEffect {
    /// Not a server fault.
    None,
    /// Refuses connects (killed, or killed and started again).
    Down,
    /// Accepts and never answers.
    Hung,
    /// Its SYNs are dropped.
    Unreachable,
    /// Answers, but slowly (within the probe timeout).
    Slow,
    /// Down and up every few hundred milliseconds: socklb may follow or
    /// not, so connects to it may fail throughout.
    Flapping,
    /// Moved to another address through discovery: its old address must
    /// get no new connection after the bound.
    Moved,
}

/// Things a fault holds for its whole duration: two faults that hold the
/// same thing never overlap (a fault on a server holds that server).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    Daemon,
    ConfigFile,
    Api,
    StateFile,
    Kernel,
    CpuCgroup,
    MemoryCgroup,
}

/// The lanes of the timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    Server,
    Daemon,
    Discovery,
    Kernel,
    Node,
}

impl Group {
    pub const fn label(self) -> &'static str {
        match self {
            Group::Server => "server",
            Group::Daemon => "daemon",
            Group::Discovery => "discovery",
            Group::Kernel => "kernel state",
            Group::Node => "node",
        }
    }
}

/// One row of the catalogue.
#[derive(Debug, Clone, Copy)]
pub struct FaultSpec {
    pub kind: FaultKind,
    pub name: &'static str,
    /// What the nemesis does, for the report.
    pub what: &'static str,
    pub group: Group,
    /// Relative chance of being drawn.
    pub weight: u32,
    /// Range of durations, in milliseconds.
    pub duration_ms: (u64, u64),
    /// The fault targets one server (drawn among the free ones).
    pub on_server: bool,
    pub effect: ServerEffect,
    pub holds: &'static [Resource],
    /// Connects may pass unredirected (to the VIP itself) until socklb
    /// repairs the kernel state.
    pub unredirected: bool,
    /// How many variants the fault has (which link, which pin, which
    /// edit); the schedule draws one.
    pub variants: u32,
}

const fn server(
    kind: FaultKind,
    name: &'static str,
    what: &'static str,
    weight: u32,
    duration_ms: (u64, u64),
    effect: ServerEffect,
) -> FaultSpec {
    FaultSpec {
        kind,
        name,
        what,
        group: Group::Server,
        weight,
        duration_ms,
        on_server: true,
        effect,
        holds: &[],
        unredirected: false,
        variants: 1,
    }
}

const fn other(
    kind: FaultKind,
    name: &'static str,
    what: &'static str,
    group: Group,
    weight: u32,
    duration_ms: (u64, u64),
    holds: &'static [Resource],
) -> FaultSpec {
    FaultSpec {
        kind,
        name,
        what,
        group,
        weight,
        duration_ms,
        on_server: false,
        effect: ServerEffect::None,
        holds,
        unredirected: false,
        variants: 1,
    }
}

/// Kernel-state faults hold the daemon too: the promise is a repair
/// within a second by a running daemon (one that is down repairs at its
/// next start).
const KERNEL: &[Resource] = &[Resource::Kernel, Resource::Daemon];

/// The catalogue. Weights favour the faults of the field (servers dying
/// and hanging); every row is drawn in a 30-minute run.
pub const CATALOGUE: &[FaultSpec] = &[
    server(
        FaultKind::ServerKill,
        "server-kill",
        "SIGKILL the server; start it again at the end",
        6,
        (6_000, 20_000),
        ServerEffect::Down,
    ),
    server(
        FaultKind::ServerRestart,
        "server-restart",
        "SIGKILL the server and start it again at once",
        3,
        (1_000, 2_000),
        ServerEffect::Down,
    ),
    server(
        FaultKind::ServerHang,
        "server-hang",
        "the server accepts and never answers (in place); restarted at the end",
        5,
        (6_000, 20_000),
        ServerEffect::Hung,
    ),
    server(
        FaultKind::ServerBlackhole,
        "server-blackhole",
        "iptables drops the SYNs to the server's ports",
        4,
        (6_000, 15_000),
        ServerEffect::Unreachable,
    ),
    server(
        FaultKind::ServerSlow,
        "server-slow",
        "every answer waits 0.8 × the probe timeout",
        3,
        (6_000, 15_000),
        ServerEffect::Slow,
    ),
    server(
        FaultKind::ServerFlap,
        "server-flap",
        "SIGKILL and start every 450 ms",
        2,
        (4_000, 8_000),
        ServerEffect::Flapping,
    ),
    FaultSpec {
        holds: &[Resource::Api, Resource::StateFile],
        ..server(
            FaultKind::ServerReaddress,
            "server-readdress",
            "the server moves to a second address, through the EndpointSlice and the k3s state file; back at the end",
            3,
            (8_000, 20_000),
            ServerEffect::Moved,
        )
    },
    other(
        FaultKind::DaemonKill,
        "daemon-kill",
        "SIGKILL socklb; start it again at the end",
        Group::Daemon,
        3,
        (500, 3_000),
        &[Resource::Daemon],
    ),
    other(
        FaultKind::DaemonStop,
        "daemon-stop",
        "SIGSTOP socklb for 5 s, then SIGCONT",
        Group::Daemon,
        3,
        (5_000, 5_001),
        &[Resource::Daemon],
    ),
    other(
        FaultKind::DaemonUpgrade,
        "daemon-upgrade",
        "in-place upgrade to the same build: SIGTERM, then the new daemon on the same pins",
        Group::Daemon,
        2,
        (100, 200),
        &[Resource::Daemon],
    ),
    other(
        FaultKind::SighupValid,
        "sighup-valid",
        "SIGHUP with the valid configuration in place",
        Group::Daemon,
        2,
        (100, 200),
        &[Resource::ConfigFile],
    ),
    other(
        FaultKind::SighupInvalid,
        "sighup-invalid",
        "an invalid configuration written (the watch sees it), then SIGHUP; the valid one back at the end",
        Group::Daemon,
        2,
        (3_000, 6_000),
        // The daemon too: a socklb started while the invalid file is in
        // place refuses it and exits 2, as it must (seed 707661646: a
        // daemon-kill's restart inside this fault was counted as a crash).
        &[Resource::ConfigFile, Resource::Daemon],
    ),
    FaultSpec {
        variants: 3,
        ..other(
            FaultKind::ConfigEdit,
            "config-edit",
            "the watched configuration edited (a weight, sockmap acceleration, the rebalance tolerance); reverted at the end",
            Group::Daemon,
            3,
            (8_000, 30_000),
            &[Resource::ConfigFile],
        )
    },
    other(
        FaultKind::StateFileRewrite,
        "state-file-rewrite",
        "the k3s state file rewritten (servers reordered, one left out); restored at the end",
        Group::Discovery,
        2,
        (3_000, 8_000),
        &[Resource::StateFile],
    ),
    other(
        FaultKind::ApiserverRestart,
        "apiserver-restart",
        "the test apiserver killed; started again at the end (its watch history gone)",
        Group::Discovery,
        2,
        (2_000, 8_000),
        &[Resource::Api],
    ),
    other(
        FaultKind::ApiGone,
        "api-410",
        "socklb stopped for a moment while its watch is closed, the slice changed (a label) and the history compacted: the resumed watch gets 410 Gone",
        Group::Discovery,
        2,
        (500, 1_000),
        &[Resource::Api, Resource::Daemon],
    ),
    other(
        FaultKind::SliceEmptied,
        "slice-emptied",
        "every endpoint of the EndpointSlice not ready; ready again at the end",
        Group::Discovery,
        2,
        (3_000, 8_000),
        &[Resource::Api],
    ),
    FaultSpec {
        unredirected: true,
        variants: 5,
        ..other(
            FaultKind::LinkDetach,
            "link-detach",
            "bpftool link detach of one of socklb's links",
            Group::Kernel,
            2,
            (2_500, 3_500),
            KERNEL,
        )
    },
    FaultSpec {
        on_server: true,
        ..other(
            FaultKind::SlotsRewrite,
            "slots-rewrite",
            "every slot of the plain service's active table pointed at one server (another agent's write)",
            Group::Kernel,
            2,
            (2_500, 3_500),
            KERNEL,
        )
    },
    FaultSpec {
        variants: 3,
        ..other(
            FaultKind::PinRemove,
            "pin-remove",
            "a pin removed: a map's, a link's, or the whole directory",
            Group::Kernel,
            2,
            (2_500, 3_500),
            KERNEL,
        )
    },
    other(
        FaultKind::CpuStarve,
        "cpu-starve",
        "socklb's cgroup (v1 cpu) limited to 10% of one CPU",
        Group::Node,
        2,
        (8_000, 20_000),
        &[Resource::CpuCgroup],
    ),
    other(
        FaultKind::MemoryPressure,
        "memory-pressure",
        "socklb's cgroup (v1 memory) limited to its usage plus 16 MiB, its OOM killer off (a task at the limit waits, as under memory.high it is throttled)",
        Group::Node,
        2,
        (8_000, 20_000),
        // A daemon started under the limit would wait on it until the
        // fault ends, and the fault's end waits on the daemon's start.
        &[Resource::MemoryCgroup, Resource::Daemon],
    ),
];

pub fn spec(kind: FaultKind) -> &'static FaultSpec {
    CATALOGUE
        .iter()
        .find(|spec| spec.kind == kind)
        .expect("every kind has a row")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_is_sound() {
        for spec in CATALOGUE {
            assert!(spec.duration_ms.0 < spec.duration_ms.1, "{}", spec.name);
            assert!(spec.weight > 0 && spec.variants > 0, "{}", spec.name);
            assert_eq!(
                spec.effect != ServerEffect::None,
                spec.group == Group::Server,
                "{}",
                spec.name
            );
            assert!(
                CATALOGUE
                    .iter()
                    .filter(|other| other.kind == spec.kind)
                    .count()
                    == 1,
                "{} appears once",
                spec.name
            );
        }
    }
}
