//! Types shared by the eBPF programs and the socklb daemon.
//!
//! Every map key and value is `#[repr(C)]`, built from fixed-width integers,
//! with its padding named and its size checked at compile time. Addresses and
//! ports stay in network byte order, exactly as `bpf_sock_addr` holds them;
//! the fields that carry them end in `_be`. The conversion to host order is
//! done once, in userspace.
//!
//! A changed layout gets a new map name (for example `SERVICES_V2`); a pinned
//! map is never silently reinterpreted.
#![no_std]

use core::mem::{offset_of, size_of};

/// `Endpoint::family` for IPv4. Not `AF_INET`: the value is ours, so that a
/// zeroed endpoint is never a valid one.
pub const FAMILY_V4: u8 = 4;
/// `Endpoint::family` for IPv6.
pub const FAMILY_V6: u8 = 6;

/// Selection tables: one per (service, address family).
pub const MAX_TABLES: u32 = 64;
/// Slots in one list of a table. A list holds a weighted expansion of its
/// backends, so this also bounds the backends of one family in one service.
pub const SLOTS_PER_LIST: u32 = 1024;
/// A bank holds the healthy list followed by the all-backends list.
pub const SLOTS_PER_BANK: u32 = 2 * SLOTS_PER_LIST;
/// Each table has two banks: the daemon fills the idle one, then flips the
/// service entry to it in one map update, so a `connect()` reads either the
/// old table or the new one and never half of each.
pub const SLOTS_PER_TABLE: u32 = 2 * SLOTS_PER_BANK;
/// Length of the `SLOTS` array.
pub const MAX_SLOTS: u32 = MAX_TABLES * SLOTS_PER_TABLE;
/// Backends over all tables; also the length of `BACKEND_STATS`.
pub const MAX_BACKENDS: u32 = 4096;
/// VIP entries in `SERVICES`.
pub const MAX_VIPS: u32 = 256;
/// Redirected sockets remembered for getpeername (LRU).
pub const MAX_REDIRECTED_SOCKETS: u32 = 65536;
/// Backends that `socklb drain` may mark at once (`DRAINS`).
pub const MAX_DRAINS: u32 = 1024;
/// Bytes of a service name kept in `TABLES` (NUL padded).
pub const NAME_LEN: usize = 64;

/// `ServiceEntry::flags`: refuse the connect with ECONNREFUSED when no
/// backend is healthy, instead of failing open to all backends.
pub const SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY: u32 = 1 << 0;
/// `ServiceEntry::flags`: redirect sockets of every network namespace, not
/// only those of the namespace the daemon runs in.
pub const SERVICE_FLAG_ALL_NETNS: u32 = 1 << 1;
/// `ServiceEntry::flags`: the table was planned with the prefer-local
/// policy. Informational; the kernel's choice is the same.
pub const SERVICE_FLAG_PREFER_LOCAL: u32 = 1 << 2;
/// `ServiceEntry::flags`: pick the less loaded of two random healthy slots
/// (power of two choices on `BackendConns::live`).
pub const SERVICE_FLAG_LEAST_CONN: u32 = 1 << 3;

/// Bytes of the `CONNECT_FAILURES` ring buffer.
pub const CONNECT_FAILURES_BYTES: u32 = 64 * 1024;

/// The names of socklb's maps and programs in the eBPF object. A pin has
/// the name of what it pins (`link_<program>` for a link). The kernel keeps
/// 15 bytes of an object name, and every name here fits.
pub mod names {
    /// VIP → current selection table.
    pub const SERVICES: &str = "SERVICES";
    /// Selection tables, two banks per table.
    pub const SLOTS: &str = "SLOTS";
    /// Socket cookie → (VIP, backend) of redirected sockets.
    pub const REDIRECTS: &str = "REDIRECTS";
    /// Redirect counters per backend (per CPU).
    pub const BACKEND_STATS: &str = "BACKEND_STATS";
    /// "None healthy" counters per table (per CPU).
    pub const TABLE_STATS: &str = "TABLE_STATS";
    /// Backend records for status.
    pub const BACKENDS: &str = "BACKENDS";
    /// Table records for status.
    pub const TABLES: &str = "TABLES";
    /// The daemon's network namespace cookie and cgroup id.
    pub const SETTINGS: &str = "SETTINGS";
    /// Live connections and failed connects per backend.
    pub const BACKEND_CONNS: &str = "BACKEND_CONNS";
    /// Ring buffer of failed connects.
    pub const CONNECT_FAILURES: &str = "CONNECT_FAILURES";
    /// Backends asked to drain.
    pub const DRAINS: &str = "DRAINS";
    /// The daemon's heartbeat, identity and repair counters.
    pub const DAEMON: &str = "DAEMON";
    /// aya-log's ring buffer. Pinned too, so that every load of the
    /// programs logs to the one the daemon reads.
    pub const AYA_LOGS: &str = "AYA_LOGS";

    /// Every map socklb pins, in the order a fresh install creates them.
    pub const MAPS: [&str; 13] = [
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
        DAEMON,
        AYA_LOGS,
    ];

    pub const CONNECT4: &str = "socklb_connect4";
    pub const CONNECT6: &str = "socklb_connect6";
    pub const GETPEERNAME4: &str = "socklb_getpeername4";
    pub const GETPEERNAME6: &str = "socklb_getpeername6";
    pub const SOCKOPS: &str = "socklb_sockops";

    /// Every program socklb attaches, each with one pinned link.
    pub const PROGRAMS: [&str; 5] = [CONNECT4, CONNECT6, GETPEERNAME4, GETPEERNAME6, SOCKOPS];
}

/// `BackendInfo::role`: an ordinary backend.
pub const ROLE_NORMAL: u8 = 0;
/// `BackendInfo::role`: on this host or marked preferred (prefer-local).
pub const ROLE_PREFERRED: u8 = 1;
/// `BackendInfo::role`: used only when no other backend is healthy.
pub const ROLE_STANDBY: u8 = 2;

/// An IP address and port, the key of `SERVICES` (a VIP) and the target of a
/// `BackendSlot`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    /// IPv4: word 0 holds the address, words 1..4 are zero. IPv6: all four
    /// words. Network byte order, as in `bpf_sock_addr::user_ip4/user_ip6`.
    pub addr_be: [u32; 4],
    /// Port in network byte order.
    pub port_be: u16,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Always zero: an uninitialised pad in a hash key makes lookups miss.
    pub _pad: u8,
}
const _: () = assert!(size_of::<Endpoint>() == 20);
const _: () = assert!(offset_of!(Endpoint, port_be) == 16);
const _: () = assert!(offset_of!(Endpoint, family) == 18);

impl Endpoint {
    /// An IPv4 endpoint from the raw `user_ip4` and `user_port` words.
    pub const fn v4(addr_be: u32, port_be: u16) -> Self {
        Self {
            addr_be: [addr_be, 0, 0, 0],
            port_be,
            family: FAMILY_V4,
            _pad: 0,
        }
    }

    /// An IPv6 endpoint from the raw `user_ip6` words.
    pub const fn v6(addr_be: [u32; 4], port_be: u16) -> Self {
        Self {
            addr_be,
            port_be,
            family: FAMILY_V6,
            _pad: 0,
        }
    }
}

/// Value of `SERVICES`: where the current selection table of a VIP lives.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceEntry {
    /// Index of the table in `TABLES`, `TABLE_STATS` and `SLOTS`.
    pub table_id: u32,
    /// Index in `SLOTS` of the first slot of the active bank.
    pub bank_base: u32,
    /// Slots of the healthy list, at `bank_base..bank_base + healthy_slots`.
    pub healthy_slots: u32,
    /// Slots of the all-backends list, used only when none is healthy, at
    /// `bank_base + SLOTS_PER_LIST ..`.
    pub all_slots: u32,
    /// `SERVICE_FLAG_*`.
    pub flags: u32,
    /// Bumped on every table swap; lets tests and status see churn.
    pub generation: u32,
}
const _: () = assert!(size_of::<ServiceEntry>() == 24);
const _: () = assert!(offset_of!(ServiceEntry, healthy_slots) == 8);
const _: () = assert!(offset_of!(ServiceEntry, flags) == 16);

/// Value of `SLOTS`: one entry of a selection list.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendSlot {
    /// Where the connect goes.
    pub target: Endpoint,
    /// Index in `BACKENDS` and `BACKEND_STATS`.
    pub backend_id: u32,
}
const _: () = assert!(size_of::<BackendSlot>() == 24);
const _: () = assert!(offset_of!(BackendSlot, backend_id) == 20);

/// Value of `REDIRECTS`, keyed by socket cookie: what getpeername shows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RedirectedSocket {
    /// The VIP the application asked for.
    pub vip: Endpoint,
    /// The backend it was sent to. getpeername rewrites only while the peer
    /// still is this backend, so a socket that reconnected elsewhere is shown
    /// as it is.
    pub backend: Endpoint,
    /// The backend's id, for the connection counters of sock_ops.
    pub backend_id: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<RedirectedSocket>() == 48);
const _: () = assert!(offset_of!(RedirectedSocket, backend_id) == 40);

/// Value of `BACKEND_CONNS`, indexed by backend id: what the sock_ops
/// program sees of the connections socklb redirected. Shared by all CPUs and
/// updated with atomic adds, because connect() reads `live` to choose.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendConns {
    /// Established connections now open. Signed: a connection established
    /// before the program was attached may close after, and the sum is then
    /// briefly below zero; readers clamp at zero.
    pub live: i64,
    /// Connects that failed with evidence from the server side (a reset,
    /// or a SYN retransmission timeout); see `ConnectFailure`.
    pub failed_connects: u64,
    /// Failed connects since the last one that established.
    pub consecutive_failures: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<BackendConns>() == 24);
const _: () = assert!(offset_of!(BackendConns, consecutive_failures) == 16);

/// `ConnectFailure::evidence`: the server answered the SYN with a reset
/// (the socket received a segment, `segs_in > 0`, and never established).
pub const EVIDENCE_RESET: u32 = 1;
/// `ConnectFailure::evidence`: the SYN's retransmission timer fired (the
/// server did not answer within the initial RTO, about 1 s).
pub const EVIDENCE_SYN_TIMEOUT: u32 = 2;

/// A record of `CONNECT_FAILURES`: a connect that failed with evidence that
/// the server side failed. A connect that the local application closed
/// before it finished is never reported.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectFailure {
    pub backend_id: u32,
    /// `BackendConns::consecutive_failures` after this failure.
    pub consecutive_failures: u32,
    /// `EVIDENCE_*`: what the kernel saw.
    pub evidence: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<ConnectFailure>() == 16);
const _: () = assert!(offset_of!(ConnectFailure, evidence) == 8);

/// Value of `BACKEND_STATS` (per CPU), indexed by backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Connects redirected to this backend.
    pub redirects: u64,
}
const _: () = assert!(size_of::<BackendStats>() == 8);

/// Value of `TABLE_STATS` (per CPU), indexed by table id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Connects that found no healthy backend.
    pub none_healthy: u64,
    /// Of those, connects refused by the `reject` policy.
    pub rejected: u64,
}
const _: () = assert!(size_of::<TableStats>() == 16);

/// Value of `BACKENDS`, keyed by backend id. Only userspace reads it: it is
/// the record that `socklb status` shows while the daemon is down.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendInfo {
    /// The backend's address.
    pub target: Endpoint,
    /// The table it belongs to.
    pub table_id: u32,
    /// Its configured weight.
    pub weight: u32,
    /// 1 while the daemon considers it healthy.
    pub healthy: u8,
    /// 1 once a probe has answered (or a previous daemon's verdict was
    /// adopted); 0 while `healthy` is only the assumption of a fresh start.
    pub probed: u8,
    /// `ROLE_*`: the backend's priority tier.
    pub role: u8,
    /// 1 while draining: no new connections, existing ones left alone.
    pub draining: u8,
}
const _: () = assert!(size_of::<BackendInfo>() == 32);
const _: () = assert!(offset_of!(BackendInfo, healthy) == 28);
const _: () = assert!(offset_of!(BackendInfo, probed) == 29);
const _: () = assert!(offset_of!(BackendInfo, role) == 30);

/// Value of `TABLES`, keyed by table id: the service a table serves.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableInfo {
    /// Service name, UTF-8, NUL padded.
    pub name: [u8; NAME_LEN],
    /// `SERVICE_FLAG_*`, as in the service entries.
    pub flags: u32,
    /// Family of the table's VIPs and backends.
    pub family: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<TableInfo>() == 72);
const _: () = assert!(offset_of!(TableInfo, flags) == 64);

impl Default for TableInfo {
    fn default() -> Self {
        Self {
            name: [0; NAME_LEN],
            flags: 0,
            family: 0,
            _pad: [0; 3],
        }
    }
}

/// The single value of `SETTINGS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// Cookie of the network namespace the daemon runs in. Sockets of other
    /// namespaces are left alone unless a service allows all namespaces.
    pub host_netns_cookie: u64,
    /// Id (inode number) of the cgroup v2 directory the links attach to,
    /// so that a restarted daemon can tell it adopts the right ones.
    pub attached_cgroup_id: u64,
}
const _: () = assert!(size_of::<Settings>() == 16);
const _: () = assert!(offset_of!(Settings, attached_cgroup_id) == 8);

/// Bytes of a path kept in `DaemonRecord`, NUL included.
pub const PATH_LEN: usize = 256;

/// Kinds of repair counted in `DaemonRecord::repairs`.
pub mod repair {
    /// A link pin was removed and is pinned again from the daemon's link.
    pub const LINK_PIN: usize = 0;
    /// A link was detached or defunct, and a new one was attached.
    pub const LINK: usize = 1;
    /// The cgroup was removed and recreated at its path; links re-attached.
    pub const CGROUP: usize = 2;
    /// A map pin was removed and is pinned again from the daemon's map.
    pub const MAP_PIN: usize = 3;
    pub const SERVICES: usize = 4;
    pub const SLOTS: usize = 5;
    pub const TABLES: usize = 6;
    pub const BACKENDS: usize = 7;
    pub const SETTINGS: usize = 8;
    pub const DRAINS: usize = 9;
    /// Number of kinds; `DaemonRecord::repairs` has room for more.
    pub const KINDS: usize = 10;
    /// Name of each kind, for logs, status and metrics.
    pub const NAMES: [&str; KINDS] = [
        "link-pin", "link", "cgroup", "map-pin", "services", "slots", "tables", "backends",
        "settings", "drains",
    ];
}

/// `DaemonRecord::flags`: a daemon runs (cleared when it exits cleanly).
pub const DAEMON_FLAG_RUNNING: u32 = 1 << 0;

/// The single value of `DAEMON`: the daemon's heartbeat, kept by the
/// kernel so that `socklb status` can tell a live daemon from a dead one,
/// and what it attached and repaired. Only userspace reads and writes it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DaemonRecord {
    /// Process id of the daemon, in its own pid namespace.
    pub pid: u32,
    /// `DAEMON_FLAG_*`.
    pub flags: u32,
    /// `CLOCK_BOOTTIME` of the last heartbeat, in ns.
    pub heartbeat_ns: u64,
    /// `CLOCK_BOOTTIME` when the daemon started, in ns.
    pub started_ns: u64,
    /// Id (inode number) of the cgroup the links attach to.
    pub cgroup_id: u64,
    /// Generation of the configuration in force (1 for the first).
    pub config_generation: u64,
    /// Repairs made since install, indexed by `repair::*`.
    pub repairs: [u64; 16],
    /// The cgroup directory the links attach to, UTF-8, NUL padded.
    pub cgroup_path: [u8; PATH_LEN],
    /// The pin directory of this install, UTF-8, NUL padded.
    pub pin_path: [u8; PATH_LEN],
}
const _: () = assert!(size_of::<DaemonRecord>() == 40 + 128 + 2 * PATH_LEN);
const _: () = assert!(offset_of!(DaemonRecord, heartbeat_ns) == 8);
const _: () = assert!(offset_of!(DaemonRecord, repairs) == 40);
const _: () = assert!(offset_of!(DaemonRecord, cgroup_path) == 168);
const _: () = assert!(offset_of!(DaemonRecord, pin_path) == 168 + PATH_LEN);

impl Default for DaemonRecord {
    fn default() -> Self {
        Self {
            pid: 0,
            flags: 0,
            heartbeat_ns: 0,
            started_ns: 0,
            cgroup_id: 0,
            config_generation: 0,
            repairs: [0; 16],
            cgroup_path: [0; PATH_LEN],
            pin_path: [0; PATH_LEN],
        }
    }
}

/// What a connect to a VIP does, decided from its service entry and one
/// random number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotChoice {
    /// Use the slot at this index of `SLOTS`, from the healthy list.
    Healthy(u32),
    /// No backend is healthy; fail open to this slot of the all list.
    FailOpen(u32),
    /// No backend is healthy and the policy refuses the connect.
    Reject,
    /// The service has no backend at all; leave the connect alone.
    Empty,
}

/// Picks a slot for one connect. O(1), no loop, and a zero count is checked
/// before every modulo, which both the verifier and sanity require. An entry
/// whose bank or counts lie outside its own table (a corrupted or tampered
/// entry) is treated as empty, so it can never reach another table's slots.
#[inline(always)]
pub fn choose_slot(entry: &ServiceEntry, random: u32) -> SlotChoice {
    let own_bank = entry.bank_base == bank_base(entry.table_id, 0)
        || entry.bank_base == bank_base(entry.table_id, 1);
    if !own_bank
        || entry.table_id >= MAX_TABLES
        || entry.healthy_slots > SLOTS_PER_LIST
        || entry.all_slots > SLOTS_PER_LIST
    {
        return SlotChoice::Empty;
    }
    if entry.healthy_slots != 0 {
        return SlotChoice::Healthy(entry.bank_base + random % entry.healthy_slots);
    }
    if entry.flags & SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY != 0 {
        return SlotChoice::Reject;
    }
    if entry.all_slots != 0 {
        return SlotChoice::FailOpen(entry.bank_base + SLOTS_PER_LIST + random % entry.all_slots);
    }
    SlotChoice::Empty
}

/// Power of two choices: whether the second of two candidates should win,
/// given their live connection counts (negative counts as zero). Ties go to
/// the first, which is itself a random pick.
#[inline(always)]
pub fn second_is_less_loaded(first_live: i64, second_live: i64) -> bool {
    let clamp = |live: i64| if live < 0 { 0 } else { live };
    clamp(second_live) < clamp(first_live)
}

/// The first `SLOTS` index of a bank (0 or 1) of a table.
pub const fn bank_base(table_id: u32, bank: u32) -> u32 {
    table_id * SLOTS_PER_TABLE + bank * SLOTS_PER_BANK
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: every type is repr(C), built only of integers, with explicit
    // padding, so any bit pattern is valid and none has uninitialised bytes.
    unsafe impl aya::Pod for Endpoint {}
    unsafe impl aya::Pod for ServiceEntry {}
    unsafe impl aya::Pod for BackendSlot {}
    unsafe impl aya::Pod for RedirectedSocket {}
    unsafe impl aya::Pod for BackendStats {}
    unsafe impl aya::Pod for TableStats {}
    unsafe impl aya::Pod for BackendInfo {}
    unsafe impl aya::Pod for TableInfo {}
    unsafe impl aya::Pod for Settings {}
    unsafe impl aya::Pod for BackendConns {}
    unsafe impl aya::Pod for ConnectFailure {}
    unsafe impl aya::Pod for DaemonRecord {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(healthy: u32, all: u32, flags: u32) -> ServiceEntry {
        ServiceEntry {
            table_id: 3,
            bank_base: bank_base(3, 1),
            healthy_slots: healthy,
            all_slots: all,
            flags,
            generation: 0,
        }
    }

    #[test]
    fn choose_slot_cases() {
        let base = bank_base(3, 1);
        let cases = [
            (
                "healthy list used",
                entry(3, 5, 0),
                7,
                SlotChoice::Healthy(base + 1),
            ),
            (
                "healthy list wins over reject",
                entry(1, 5, SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY),
                9,
                SlotChoice::Healthy(base),
            ),
            (
                "fail open",
                entry(0, 5, 0),
                7,
                SlotChoice::FailOpen(base + SLOTS_PER_LIST + 2),
            ),
            (
                "reject",
                entry(0, 5, SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY),
                7,
                SlotChoice::Reject,
            ),
            ("empty service", entry(0, 0, 0), 7, SlotChoice::Empty),
            (
                "max random",
                entry(4, 4, 0),
                u32::MAX,
                SlotChoice::Healthy(base + 3),
            ),
            (
                "count past its list",
                entry(SLOTS_PER_LIST + 1, 1, 0),
                7,
                SlotChoice::Empty,
            ),
            (
                "bank of another table",
                ServiceEntry {
                    bank_base: bank_base(4, 0),
                    ..entry(3, 3, 0)
                },
                7,
                SlotChoice::Empty,
            ),
        ];
        for (what, entry, random, want) in cases {
            assert_eq!(choose_slot(&entry, random), want, "{what}");
        }
    }

    #[test]
    fn least_loaded_of_two() {
        assert!(second_is_less_loaded(5, 2));
        assert!(!second_is_less_loaded(2, 5));
        assert!(!second_is_less_loaded(3, 3), "ties keep the first");
        assert!(!second_is_less_loaded(-4, 0), "negative counts as zero");
        assert!(second_is_less_loaded(1, -2));
    }

    #[test]
    fn banks_do_not_overlap() {
        assert_eq!(bank_base(0, 1), SLOTS_PER_BANK);
        assert_eq!(bank_base(1, 0), SLOTS_PER_TABLE);
        assert_eq!(bank_base(MAX_TABLES - 1, 1) + SLOTS_PER_BANK, MAX_SLOTS);
    }
}
