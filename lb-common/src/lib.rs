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

/// `BackendInfo::role`: an ordinary backend.
pub const ROLE_NORMAL: u8 = 0;
/// `BackendInfo::role`: on this host or marked preferred (prefer-local).
pub const ROLE_PREFERRED: u8 = 1;
/// `BackendInfo::role`: used only when no other backend is healthy.
pub const ROLE_STANDBY: u8 = 2;

/// An IP address and port, the key of `SERVICES` (a VIP) and the target of a
/// `BackendSlot`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
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
    /// Connects that went from SYN_SENT to CLOSE without establishing.
    pub failed_connects: u64,
    /// Failed connects since the last one that established.
    pub consecutive_failures: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<BackendConns>() == 24);
const _: () = assert!(offset_of!(BackendConns, consecutive_failures) == 16);

/// A record of `CONNECT_FAILURES`: one failed connect, for the daemon.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectFailure {
    pub backend_id: u32,
    /// `BackendConns::consecutive_failures` after this failure.
    pub consecutive_failures: u32,
}
const _: () = assert!(size_of::<ConnectFailure>() == 8);

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
