//! The keys and values of socklb's maps, and ring-buffer records.
//!
//! Every type is `#[repr(C)]`, built from fixed-width integers, with its
//! padding named. [`layout!`] asserts at compile time the size and the
//! offset of every field, and records them for the unprivileged test that
//! compares them with the BTF of the embedded object.

use core::mem::{offset_of, size_of};

use crate::{FAMILY_V4, FAMILY_V6, MAX_TABLES, NAME_LEN, PATH_LEN};

/// A shared type's layout, as the compiler laid it out (checked against the
/// literals in [`layout!`]).
pub struct Layout {
    pub name: &'static str,
    pub size: usize,
    /// (field, byte offset), in declaration order.
    pub fields: &'static [(&'static str, usize)],
}

/// Asserts a type's size and every field's offset, and records them.
macro_rules! layout {
    ($name:ident, $type:ty, size $size:expr, { $($field:ident @ $offset:expr),+ $(,)? }) => {
        const _: () = assert!(size_of::<$type>() == $size);
        $(const _: () = assert!(offset_of!($type, $field) == $offset);)+
        pub const $name: Layout = Layout {
            name: stringify!($type),
            size: $size,
            fields: &[$((stringify!($field), $offset)),+],
        };
    };
}

/// An IP address and port: the key of `SERVICES` (a VIP), the target of a
/// `BackendSlot`, a drained backend in `DRAINS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    /// IPv4: word 0 holds the address, words 1..4 are zero. IPv6: all four
    /// words. Network byte order, as in `bpf_sock_addr::user_ip4/user_ip6`.
    pub addr_be: [u32; 4],
    /// Port in network byte order.
    pub port_be: u16,
    /// `FAMILY_V4` or `FAMILY_V6`; 0 is never valid.
    pub family: u8,
    /// Always zero: an uninitialised pad in a hash key makes lookups miss.
    pub _pad: u8,
}
layout!(ENDPOINT, Endpoint, size 20, { addr_be @ 0, port_be @ 16, family @ 18, _pad @ 19 });

impl Endpoint {
    /// An IPv4 endpoint from the raw `user_ip4` word and a port in network
    /// byte order.
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
layout!(SERVICE_ENTRY, ServiceEntry, size 24, {
    table_id @ 0, bank_base @ 4, healthy_slots @ 8, all_slots @ 12, flags @ 16, generation @ 20,
});

/// Value of `SLOTS`: one entry of a selection list.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendSlot {
    /// Where the connect goes.
    pub target: Endpoint,
    /// Index in `BACKENDS`, `BACKEND_STATS` and `BACKEND_CONNS`.
    pub backend_id: u32,
}
layout!(BACKEND_SLOT, BackendSlot, size 24, { target @ 0, backend_id @ 20 });

/// Words (`u64`) of `VIP_PORTS`: one bit for each of the 65,536 ports.
pub const VIP_PORT_WORDS: u32 = 1024;

/// Where the bit of a port (`Endpoint::port_be`, network byte order) is in
/// `VIP_PORTS`: the index of its word and its mask in that word.
#[inline(always)]
pub fn vip_port_bit(port_be: u16) -> (u32, u64) {
    let port = u16::from_be(port_be);
    (u32::from(port >> 6), 1u64 << (port & 63))
}

/// `SocketRecord::flags`: the connection established and counts in
/// `BackendConns::live` (so its close takes exactly one away).
pub const SOCKET_FLAG_LIVE: u32 = 1 << 0;
/// `SocketRecord::flags`: its service accelerates (sockmap); sock_ops
/// pairs it with the backend's socket if that backend is in `ACCEL`.
pub const SOCKET_FLAG_ACCELERATE: u32 = 1 << 1;

/// Key of the `SOCKHASH` of accelerated sockets and of `ACCEL_PENDING`:
/// one end of a TCP connection as that end sees it, in its network
/// namespace. The peer's key swaps local and remote ([`SockKey::peer`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SockKey {
    /// The socket's network namespace cookie: the two ends of a pair are
    /// in one namespace, and a 4-tuple of another namespace never matches.
    pub netns: u64,
    /// This end's address, network byte order; IPv4 as `::ffff:a.b.c.d`,
    /// so that an IPv6 socket dialling a mapped address and an IPv4 one
    /// share a form.
    pub local: [u32; 4],
    /// The other end's address, in the same form.
    pub remote: [u32; 4],
    /// Host byte order.
    pub local_port: u32,
    /// Host byte order.
    pub remote_port: u32,
}
layout!(SOCK_KEY, SockKey, size 48, {
    netns @ 0, local @ 8, remote @ 24, local_port @ 40, remote_port @ 44,
});

impl SockKey {
    /// The key of the other end of this connection.
    pub const fn peer(&self) -> Self {
        Self {
            netns: self.netns,
            local: self.remote,
            remote: self.local,
            local_port: self.remote_port,
            remote_port: self.local_port,
        }
    }

    /// An address word array in the key's form from an endpoint's.
    pub const fn address(endpoint: &Endpoint) -> [u32; 4] {
        if endpoint.family == FAMILY_V4 {
            [0, 0, 0xffff_u32.to_be(), endpoint.addr_be[0]]
        } else {
            endpoint.addr_be
        }
    }

    /// The endpoint of an address and port of a key.
    pub const fn endpoint(addr: [u32; 4], port: u32) -> Endpoint {
        let port_be = (port as u16).to_be();
        if addr[0] == 0 && addr[1] == 0 && addr[2] == 0xffff_u32.to_be() {
            Endpoint::v4(addr[3], port_be)
        } else {
            Endpoint::v6(addr, port_be)
        }
    }
}

/// What getpeername shows and sock_ops counts of one redirected socket:
/// inside [`TrackedSocket`] in the socket table, and, from older layouts
/// that an upgrade reads, the value of the socket storage `SOCKETS` and of
/// the `REDIRECTS` LRU keyed by socket cookie.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SocketRecord {
    /// The VIP the application asked for.
    pub vip: Endpoint,
    /// The backend it was sent to. getpeername rewrites only while the peer
    /// still is this backend, so a socket that reconnected elsewhere is shown
    /// as it is.
    pub backend: Endpoint,
    /// The backend's id, for the connection counters of sock_ops.
    pub backend_id: u32,
    /// `SOCKET_FLAG_*` (0 in the legacy map, whose sockets predate them).
    pub flags: u32,
}
layout!(SOCKET_RECORD, SocketRecord, size 48, {
    vip @ 0, backend @ 20, backend_id @ 40, flags @ 44,
});

/// Value of `SOCKET_TABLE`, a preallocated hash keyed by socket cookie, and
/// the record of a `SocketSlot` of `SOCKET_SLOTS`: one per socket socklb
/// redirected and follows, from its connect
/// until it closes (sock_ops at the change to TCP_CLOSE, or cgroup
/// sock_release for a socket that never got that far). Its memory is
/// fixed when the map is created; a connect that finds the table full is
/// redirected all the same and counted in `SocketTableStats::untracked`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackedSocket {
    pub record: SocketRecord,
    /// Cookie of the socket's network namespace (0 when the kernel gives
    /// none): the daemon's sweep can only see sockets of its own.
    pub netns_cookie: u64,
}
layout!(TRACKED_SOCKET, TrackedSocket, size 56, { record @ 0, netns_cookie @ 48 });

/// An element of `SOCKET_SLOTS`, the socket table as an array (Linux
/// 5.12 and later): the owner's cookie, 0 while the slot is free, and its
/// record. A socket may take slot `cookie & mask` or one of the next
/// [`crate::SOCKET_SLOT_PROBES`]` - 1`; connect4/6 claim a free one with an
/// atomic compare-and-exchange of `cookie`, and whoever ends the record
/// (sock_ops, sock_release, the daemon's sweep) frees it with another, so
/// exactly one of them counts the end. 64 bytes: one cache line.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SocketSlot {
    pub cookie: u64,
    pub tracked: TrackedSocket,
}
layout!(SOCKET_SLOT, SocketSlot, size 64, { cookie @ 0, tracked @ 8 });

/// The single value of `SOCKET_TABLE_STATS` (per CPU).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SocketTableStats {
    /// Connects redirected without a record: the socket table was full (or
    /// the socket refused its callbacks). getpeername shows such a socket
    /// its backend, and live counts leave it out.
    pub untracked: u64,
}
layout!(SOCKET_TABLE_STATS, SocketTableStats, size 8, { untracked @ 0 });

/// The single value of `LIVENESS`: the daemon's heartbeat as connect4/6
/// read it, for services with `SERVICE_FLAG_HAND_BACK`. Written by the
/// daemon on every heartbeat.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Liveness {
    /// `CLOCK_BOOTTIME` of the last heartbeat, in ns (what
    /// `bpf_ktime_get_boot_ns` reads).
    pub heartbeat_ns: u64,
    /// Per table id: the heartbeat's age past which the daemon counts as
    /// gone and the table's VIPs are handed back; 0 keeps redirecting.
    pub gone_after_ns: [u64; MAX_TABLES as usize],
}
layout!(LIVENESS, Liveness, size 520, { heartbeat_ns @ 0, gone_after_ns @ 8 });

impl Default for Liveness {
    fn default() -> Self {
        Self {
            heartbeat_ns: 0,
            gone_after_ns: [0; MAX_TABLES as usize],
        }
    }
}

impl Liveness {
    /// Whether a table's VIPs are handed back at `now_ns`, its daemon
    /// having been silent for longer than the table allows.
    #[inline(always)]
    pub fn handed_back(&self, table_id: u32, now_ns: u64) -> bool {
        match self.gone_after_ns.get(table_id as usize) {
            Some(&gone_after) if gone_after != 0 => {
                now_ns.wrapping_sub(self.heartbeat_ns) as i64 > gone_after as i64
            }
            _ => false,
        }
    }
}

/// Value of `BACKEND_CONNS`, indexed by backend id: what the sock_ops
/// program sees of the connections socklb redirected. Shared by all CPUs and
/// updated with 64-bit atomic adds, because connect() reads `live` to
/// choose.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendConns {
    /// Established redirected connections open now.
    pub live: i64,
    /// Connects that failed with evidence from the server side (a reset,
    /// or a SYN retransmission timeout); see `ConnectFailure`.
    pub failed_connects: u64,
    /// Failed connects since the last one that established.
    pub consecutive_failures: u64,
}
layout!(BACKEND_CONNS, BackendConns, size 24, {
    live @ 0, failed_connects @ 8, consecutive_failures @ 16,
});

/// `ConnectFailure::evidence`: the server answered the SYN with a reset
/// (the socket received a segment, `segs_in > 0`, and never established).
pub const EVIDENCE_RESET: u32 = 1;
/// `ConnectFailure::evidence`: the SYN's retransmission timer fired (the
/// server did not answer within the initial RTO, about 1 s).
pub const EVIDENCE_SYN_TIMEOUT: u32 = 2;

/// A record of `CONNECT_FAILURES`: a connect that failed with evidence that
/// the server side failed. A connect that the local application closed
/// before it finished is never reported. The daemon reads the streak from
/// `BACKEND_CONNS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectFailure {
    pub backend_id: u32,
    /// `EVIDENCE_*`: what the kernel saw.
    pub evidence: u32,
}
layout!(CONNECT_FAILURE, ConnectFailure, size 8, { backend_id @ 0, evidence @ 4 });

/// Value of `BACKEND_STATS` (per CPU), indexed by backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Connects redirected to this backend.
    pub redirects: u64,
}
layout!(BACKEND_STATS, BackendStats, size 8, { redirects @ 0 });

/// Value of `TABLE_STATS` (per CPU), indexed by table id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Connects that found no healthy backend.
    pub none_healthy: u64,
    /// Of those, connects refused by the `reject` policy.
    pub rejected: u64,
}
layout!(TABLE_STATS, TableStats, size 16, { none_healthy @ 0, rejected @ 8 });

/// Value of `BACKENDS`, keyed by backend id. Only userspace reads it: it is
/// the record that `socklb status` shows while the daemon is down, and the
/// memory of which id each backend has.
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
layout!(BACKEND_INFO, BackendInfo, size 32, {
    target @ 0, table_id @ 20, weight @ 24, healthy @ 28, probed @ 29, role @ 30, draining @ 31,
});

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
    /// Always zero.
    pub _pad: [u8; 3],
}
layout!(TABLE_INFO, TableInfo, size 72, { name @ 0, flags @ 64, family @ 68, _pad @ 69 });

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
    /// Id (inode number) of the cgroup v2 directory the links attach to.
    pub attached_cgroup_id: u64,
}
layout!(SETTINGS, Settings, size 16, { host_netns_cookie @ 0, attached_cgroup_id @ 8 });

/// The single value of `DAEMON`: the daemon's heartbeat, kept by the
/// kernel so that `socklb status` can tell a live daemon from a dead one,
/// what it attached and repaired, and which object it runs. Only userspace
/// reads and writes it.
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
    /// SHA-256 of the eBPF object whose programs the links run.
    pub object_sha256: [u8; 32],
    /// The cgroup directory the links attach to, UTF-8, NUL padded.
    pub cgroup_path: [u8; PATH_LEN],
    /// The pin directory of this install, UTF-8, NUL padded.
    pub pin_path: [u8; PATH_LEN],
}
layout!(DAEMON_RECORD, DaemonRecord, size 712, {
    pid @ 0, flags @ 4, heartbeat_ns @ 8, started_ns @ 16, cgroup_id @ 24,
    config_generation @ 32, repairs @ 40, object_sha256 @ 168, cgroup_path @ 200,
    pin_path @ 456,
});

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
            object_sha256: [0; 32],
            cgroup_path: [0; PATH_LEN],
            pin_path: [0; PATH_LEN],
        }
    }
}

/// Every shared type's layout, for the ABI test.
pub const LAYOUTS: [Layout; 17] = [
    SOCKET_SLOT,
    TRACKED_SOCKET,
    SOCKET_TABLE_STATS,
    LIVENESS,
    ENDPOINT,
    SERVICE_ENTRY,
    BACKEND_SLOT,
    SOCKET_RECORD,
    BACKEND_CONNS,
    CONNECT_FAILURE,
    BACKEND_STATS,
    TABLE_STATS,
    BACKEND_INFO,
    TABLE_INFO,
    SETTINGS,
    DAEMON_RECORD,
    SOCK_KEY,
];

/// (map name, key size, value size) of every map with a fixed layout, for
/// the ABI test: the embedded object must define each exactly so.
pub const MAP_SIZES: [(&str, usize, usize); 20] = [
    (crate::names::VIP_PORTS, 4, 8),
    (crate::names::SERVICES, 20, 24),
    (crate::names::SLOTS, 4, 24),
    (crate::names::SOCKET_SLOTS, 4, 64),
    (crate::names::SOCKET_TABLE, 8, 56),
    (crate::names::SOCKET_TABLE_STATS, 4, 8),
    (crate::names::LIVENESS, 4, 520),
    (crate::names::SOCKETS, 4, 48),
    (crate::names::BACKEND_STATS, 4, 8),
    (crate::names::TABLE_STATS, 4, 16),
    (crate::names::BACKENDS, 4, 32),
    (crate::names::TABLES, 4, 72),
    (crate::names::SETTINGS, 4, 16),
    (crate::names::BACKEND_CONNS, 4, 24),
    (crate::names::DRAINS, 20, 4),
    (crate::names::DAEMON, 4, 712),
    (crate::names::SOCKHASH, 48, 4),
    (crate::names::ACCEL_PENDING, 48, 4),
    (crate::names::PASSED, 48, 4),
    (crate::names::ACCEL, 20, 4),
];

/// The first layout's types that an upgrade migrates from.
pub mod v0 {
    use super::*;

    /// `BACKEND_CONNS` of the first layout: a 32-bit streak and a pad.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct BackendConnsV0 {
        pub live: i64,
        pub failed_connects: u64,
        pub consecutive_failures: u32,
        pub _pad: u32,
    }
    layout!(BACKEND_CONNS_V0, BackendConnsV0, size 24, {
        live @ 0, failed_connects @ 8, consecutive_failures @ 16, _pad @ 20,
    });
}
