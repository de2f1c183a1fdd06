//! The names of socklb's maps and programs in the eBPF object, the one
//! source both sides use. A pin has the name of what it pins
//! (`link_<program>` for a link).
//!
//! Map names carry a version: a map whose layout changes gets a new name
//! (`…_v2`), and an upgrade migrates the old map's state into it; a pinned
//! map is never reinterpreted. The kernel keeps 15 bytes of an object name;
//! every name here fits, so `bpftool map show` prints them whole.

/// VIP → current selection table.
pub const SERVICES: &str = "lb_services_v1";
/// The ports some VIP uses, one bit each: connect4/6 look a VIP up only
/// for a connect to such a port.
pub const VIP_PORTS: &str = "lb_vports_v1";
/// Selection tables, two banks per table.
pub const SLOTS: &str = "lb_slots_v1";
/// Per-socket records of the sockets socklb follows, by socket cookie (a
/// preallocated hash; its size is `socket-table-size`). The whole socket
/// table on kernels before 5.12 (the hash layout); on later ones (the
/// array layout) it holds the sockets that found their slots of
/// `SOCKET_SLOTS` taken, and those an install of the hash layout filed
/// before an upgrade.
pub const SOCKET_TABLE: &str = "lb_socktab_v1";
/// The array layout's socket table (Linux 5.12 and later, for
/// BPF_CMPXCHG): slots claimed by socket cookie (`SocketSlot`), half of
/// `socket-table-size` rounded up to a power of two. Pinned beside
/// `SOCKET_TABLE`, not in `MAPS`: a kernel before 5.12 has none.
pub const SOCKET_SLOTS: &str = "lb_socktab_v2";
/// Connects redirected without a record, the table being full (per CPU).
pub const SOCKET_TABLE_STATS: &str = "lb_sockstat_v1";
/// The daemon's heartbeat as the connect programs read it, and how long
/// each table waits before handing its VIPs back.
pub const LIVENESS: &str = "lb_liveness_v1";
/// The previous layout's per-socket records (socket-local storage). Kept
/// pinned only while sockets it redirected before an upgrade live:
/// getpeername and sock_ops read it for them, and nothing writes it.
pub const SOCKETS: &str = "lb_sockets_v1";
/// Redirect counters per backend (per CPU).
pub const BACKEND_STATS: &str = "lb_bstats_v1";
/// "None healthy" counters per table (per CPU).
pub const TABLE_STATS: &str = "lb_tstats_v1";
/// Backend records for status.
pub const BACKENDS: &str = "lb_backends_v1";
/// Table records for status.
pub const TABLES: &str = "lb_tables_v1";
/// The daemon's network namespace cookie and cgroup id.
pub const SETTINGS: &str = "lb_settings_v1";
/// Live connections and failed connects per backend.
pub const BACKEND_CONNS: &str = "lb_conns_v1";
/// Ring buffer of failed connects.
pub const CONNECT_FAILURES: &str = "lb_failures_v1";
/// Backends asked to drain.
pub const DRAINS: &str = "lb_drains_v1";
/// The daemon's heartbeat, identity and repair counters.
pub const DAEMON: &str = "lb_daemon_v1";
/// Accelerated sockets by [`crate::SockKey`] (a SOCKHASH); the sk_msg
/// program runs on every socket in it.
pub const SOCKHASH: &str = "lb_sockhash_v1";
/// Client sockets paired into `SOCKHASH`, until their backend's socket
/// joins them (an LRU hash by `SockKey`).
pub const ACCEL_PENDING: &str = "lb_accpend_v1";
/// Accelerated sockets that sent a message the normal way and never
/// redirect again (an LRU hash by `SockKey`).
pub const PASSED: &str = "lb_passed_v1";
/// Local backends of accelerating services (`Endpoint` → 1): sock_ops
/// pairs connections to them, sk_msg redirects only while they are here.
pub const ACCEL: &str = "lb_accel_v1";
/// aya-log's ring buffer (aya-log names it). Pinned too, so that every
/// load of the programs logs to the one the daemon reads.
pub const AYA_LOGS: &str = "AYA_LOGS";
/// The per-socket records of the first layout (an LRU hash by socket
/// cookie). Kept only while sockets redirected before an upgrade live:
/// getpeername and sock_ops fall back to it for a socket without storage.
pub const LEGACY_REDIRECTS: &str = "REDIRECTS";

/// Every map socklb pins, in the order a fresh install creates them, but
/// the array layout's `SOCKET_SLOTS`.
pub const MAPS: [&str; 20] = [
    SERVICES,
    VIP_PORTS,
    SLOTS,
    SOCKET_TABLE,
    SOCKET_TABLE_STATS,
    LIVENESS,
    BACKEND_STATS,
    TABLE_STATS,
    BACKENDS,
    TABLES,
    SETTINGS,
    BACKEND_CONNS,
    CONNECT_FAILURES,
    DRAINS,
    DAEMON,
    SOCKHASH,
    ACCEL_PENDING,
    PASSED,
    ACCEL,
    AYA_LOGS,
];

pub const CONNECT4: &str = "socklb_connect4";
pub const CONNECT6: &str = "socklb_connect6";
pub const GETPEERNAME4: &str = "socklb_getpeername4";
pub const GETPEERNAME6: &str = "socklb_getpeername6";
pub const SOCKOPS: &str = "socklb_sockops";
pub const RELEASE: &str = "socklb_release";

/// Every program socklb attaches to the cgroup, each with one pinned link,
/// in the order they are attached (or switched in place by an upgrade):
/// the programs that follow a socket to its end first, so that every
/// socket the new connect programs redirect is followed by programs that
/// know their records.
pub const PROGRAMS: [&str; 6] = [
    SOCKOPS,
    RELEASE,
    CONNECT4,
    CONNECT6,
    GETPEERNAME4,
    GETPEERNAME6,
];
/// The sk_msg program, attached to `SOCKHASH` (the map holds it; no link).
pub const SKMSG: &str = "socklb_skmsg";
/// Never attached: the daemon's sweep runs it to take a connection off a
/// live count atomically.
pub const UNCOUNT: &str = "socklb_uncount";
/// Every program of the object that is not attached to the cgroup.
pub const UNATTACHED: [&str; 2] = [SKMSG, UNCOUNT];

/// Globals in the object's read-only data that the loader sets.
pub mod globals {
    /// `u32`, `FEATURE_*` bits: what the kernel offers (see `features`).
    pub const FEATURES: &str = "SOCKLB_FEATURES";
    /// `u32`, the array layout's slot count less one (a power of two less
    /// one): a socket's first slot is `cookie & mask`.
    pub const SLOT_MASK: &str = "SOCKLB_SLOT_MASK";
}

/// The names of the first layout (socklb up to the commit that versioned
/// them), which an upgrade migrates from.
pub mod v0 {
    pub const SERVICES: &str = "SERVICES";
    pub const SLOTS: &str = "SLOTS";
    pub const REDIRECTS: &str = "REDIRECTS";
    pub const BACKEND_STATS: &str = "BACKEND_STATS";
    pub const TABLE_STATS: &str = "TABLE_STATS";
    pub const BACKENDS: &str = "BACKENDS";
    pub const TABLES: &str = "TABLES";
    pub const SETTINGS: &str = "SETTINGS";
    pub const BACKEND_CONNS: &str = "BACKEND_CONNS";
    pub const CONNECT_FAILURES: &str = "CONNECT_FAILURES";
    pub const DRAINS: &str = "DRAINS";
    /// Every map of the first layout.
    pub const MAPS: [&str; 11] = [
        SERVICES,
        SLOTS,
        REDIRECTS,
        BACKEND_STATS,
        TABLE_STATS,
        BACKENDS,
        TABLES,
        SETTINGS,
        BACKEND_CONNS,
        CONNECT_FAILURES,
        DRAINS,
    ];
}
