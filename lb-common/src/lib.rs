//! Types shared by the eBPF programs and the socklb daemon: the names of the
//! maps and programs, the layout of every map key and value, and the choice
//! a connect makes.
//!
//! Every map key and value is `#[repr(C)]`, built from fixed-width integers,
//! with its padding named, and its size and field offsets checked at compile
//! time. Addresses and ports stay in network byte order, exactly as
//! `bpf_sock_addr` holds them; the fields that carry them end in `_be`. The
//! conversion to host order is done once, in userspace.
//!
//! A changed layout gets a new map name (`…_v2`); a pinned map is never
//! silently reinterpreted.
#![no_std]

mod maps;
pub mod names;
mod select;

pub use maps::*;
pub use select::*;

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
/// Entries of the legacy `REDIRECTS` LRU of the first layout.
pub const MAX_LEGACY_REDIRECTS: u32 = 65536;
/// Sockets the socket table holds unless `socket-table-size` says
/// otherwise (the loader sets the real size).
pub const DEFAULT_SOCKET_TABLE_SIZE: u32 = 65536;
/// How many slots of `SOCKET_SLOTS` a socket may take: `cookie & mask` and
/// the next ones. A socket whose slots are all taken goes to the hash.
pub const SOCKET_SLOT_PROBES: u64 = 4;
/// Slots of `SOCKET_SLOTS` for a `socket-table-size`: half as many,
/// rounded up to a power of two (2 MiB at the default: the daemon's whole
/// memory, maps included, must fit 48 MiB). The hash beside it holds
/// `socket-table-size` records, so that many sockets are always tracked,
/// wherever their cookies fall.
pub const fn socket_slots_for(size: u32) -> u32 {
    (size / 2).next_power_of_two()
}
/// The smallest and largest `socket-table-size` accepted.
pub const MIN_SOCKET_TABLE_SIZE: u32 = 1024;
pub const MAX_SOCKET_TABLE_SIZE: u32 = 1 << 22;
/// Backends that `socklb drain` may mark at once (`DRAINS`).
pub const MAX_DRAINS: u32 = 1024;
/// Accelerated sockets (two per connection).
pub const MAX_ACCEL_SOCKETS: u32 = 65536;
/// Client sockets waiting for their backend's socket to be paired.
pub const MAX_ACCEL_PENDING: u32 = 16384;
/// Bytes of a service name kept in `TABLES` (NUL padded).
pub const NAME_LEN: usize = 64;
/// Bytes of a path kept in `DaemonRecord`, NUL included.
pub const PATH_LEN: usize = 256;
/// Bytes of the `CONNECT_FAILURES` ring buffer.
pub const CONNECT_FAILURES_BYTES: u32 = 64 * 1024;

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
/// The service's connections to backends in `ACCEL` are accelerated.
pub const SERVICE_FLAG_ACCELERATE: u32 = 1 << 4;
/// `ServiceEntry::flags`: once the daemon's heartbeat (`LIVENESS`) is
/// older than the table's `Liveness::gone_after_ns`, connects to the VIP
/// proceed untouched, to whatever listens there (the balancer socklb sits
/// in front of).
pub const SERVICE_FLAG_HAND_BACK: u32 = 1 << 5;
/// `ServiceEntry::flags`: `SERVICE_FLAG_HAND_BACK` (set or not) was
/// decided by `when-daemon-gone = "auto"`. Informational, for `status`
/// while the daemon is gone; the kernel does not read it.
pub const SERVICE_FLAG_HAND_BACK_AUTO: u32 = 1 << 6;

/// `BackendInfo::role`: an ordinary backend.
pub const ROLE_NORMAL: u8 = 0;
/// `BackendInfo::role`: on this host or marked preferred (prefer-local).
pub const ROLE_PREFERRED: u8 = 1;
/// `BackendInfo::role`: used only when no other backend is healthy.
pub const ROLE_STANDBY: u8 = 2;

/// `DaemonRecord::flags`: a daemon runs (cleared when it exits cleanly).
pub const DAEMON_FLAG_RUNNING: u32 = 1 << 0;

/// Kernel features the programs may use, as bits of the `SOCKLB_FEATURES`
/// global that the loader sets from what it probed. A branch behind a bit
/// that is off is removed by the verifier, helper call included, so the
/// same object loads on a kernel without the helper.
pub mod features {
    /// `bpf_set_retval` in cgroup sock_addr programs (5.18): a refused
    /// connect fails with ECONNREFUSED instead of EPERM.
    pub const SET_RETVAL: u32 = 1 << 0;
    /// `bpf_get_netns_cookie` in sock_addr programs (5.7), and a cookie for
    /// the daemon's namespace: without both, every namespace is redirected.
    pub const NETNS_COOKIE: u32 = 1 << 1;
    /// Read the per-socket records that an install of the previous layout
    /// keeps in socket storage (`lb_sockets_v1`): set while an upgrade
    /// from it left sockets it redirected. Nothing writes there any more.
    pub const LEGACY_STORAGE: u32 = 1 << 2;
    /// sockmap acceleration: `bpf_get_netns_cookie` in sock_ops and sk_msg
    /// programs (5.15). Without it nothing is accelerated.
    pub const SOCKMAP: u32 = 1 << 3;
    /// Read the first layout's per-socket LRU (`REDIRECTS`): set while an
    /// upgrade from it left sockets it redirected.
    pub const LEGACY_LRU: u32 = 1 << 4;
    /// connect4/6 ask for a redirected socket's sock_ops callbacks
    /// themselves (`bpf_setsockopt(TCP_BPF_SOCK_OPS_CB_FLAGS)`, Linux
    /// 6.12), so that sock_ops looks nothing up for other sockets at
    /// TCP_CONNECT_CB. Without it sock_ops does, for every socket.
    pub const CALLBACKS_AT_CONNECT: u32 = 1 << 5;
    /// Everything; what the object assumes until the loader says otherwise.
    pub const ALL: u32 =
        SET_RETVAL | NETNS_COOKIE | LEGACY_STORAGE | SOCKMAP | LEGACY_LRU | CALLBACKS_AT_CONNECT;
}

/// Kinds of repair counted in `DaemonRecord::repairs`.
pub mod repair {
    /// A link pin was removed and is pinned again from the daemon's link.
    pub const LINK_PIN: usize = 0;
    /// A link was detached or defunct, and a new one was attached; or the
    /// sk_msg program was detached from the sockhash and attached again.
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
    /// A record of the socket table whose socket was gone (the sweep).
    pub const SOCKET_RECORDS: usize = 10;
    /// Number of kinds; `DaemonRecord::repairs` has room for more.
    pub const KINDS: usize = 11;
    /// Name of each kind, for logs, status and metrics.
    pub const NAMES: [&str; KINDS] = [
        "link-pin",
        "link",
        "cgroup",
        "map-pin",
        "services",
        "slots",
        "tables",
        "backends",
        "settings",
        "drains",
        "socket-records",
    ];
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: every type is repr(C), built only of integers, with explicit
    // padding, so any bit pattern is valid and none has uninitialised bytes.
    unsafe impl aya::Pod for Endpoint {}
    unsafe impl aya::Pod for ServiceEntry {}
    unsafe impl aya::Pod for BackendSlot {}
    unsafe impl aya::Pod for SocketRecord {}
    unsafe impl aya::Pod for TrackedSocket {}
    unsafe impl aya::Pod for SocketTableStats {}
    unsafe impl aya::Pod for Liveness {}
    unsafe impl aya::Pod for BackendStats {}
    unsafe impl aya::Pod for TableStats {}
    unsafe impl aya::Pod for BackendInfo {}
    unsafe impl aya::Pod for TableInfo {}
    unsafe impl aya::Pod for Settings {}
    unsafe impl aya::Pod for BackendConns {}
    unsafe impl aya::Pod for ConnectFailure {}
    unsafe impl aya::Pod for DaemonRecord {}
    unsafe impl aya::Pod for SockKey {}
    unsafe impl aya::Pod for v0::BackendConnsV0 {}
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
    fn the_second_pick_of_least_conn() {
        let least = entry(4, 4, SERVICE_FLAG_LEAST_CONN);
        let base = bank_base(3, 1);
        let cases = [
            ("least-conn, four slots", least, 6, Some(base + 2)),
            (
                "least-conn, one slot",
                entry(1, 4, SERVICE_FLAG_LEAST_CONN),
                6,
                None,
            ),
            ("random policy", entry(4, 4, 0), 6, None),
            (
                "tampered bank",
                ServiceEntry {
                    bank_base: bank_base(4, 0),
                    ..least
                },
                6,
                None,
            ),
        ];
        for (what, entry, random, want) in cases {
            let mut drawn = false;
            let second = second_slot(&entry, || {
                drawn = true;
                random
            });
            assert_eq!(second, want, "{what}");
            assert_eq!(
                drawn,
                want.is_some(),
                "{what}: a random number drawn only when used"
            );
        }
    }

    #[test]
    fn every_port_has_its_own_bit_of_the_vip_ports() {
        let cases = [(0u16, 0u32, 1u64), (80, 1, 1 << 16), (6443, 100, 1 << 43)];
        for (port, word, mask) in cases {
            assert_eq!(vip_port_bit(port.to_be()), (word, mask), "port {port}");
        }
        let (last_word, last_mask) = vip_port_bit(u16::MAX.to_be());
        assert_eq!((last_word, last_mask), (VIP_PORT_WORDS - 1, 1 << 63));
        // One bit per port, and the port can be read back from it: no two
        // ports share a bit.
        for port in 0..=u16::MAX {
            let (word, mask) = vip_port_bit(port.to_be());
            assert_eq!(mask.count_ones(), 1, "port {port}");
            assert_eq!(word * 64 + mask.trailing_zeros(), u32::from(port));
        }
    }

    #[test]
    fn ports_convert_on_either_byte_order() {
        // 6443 in network byte order, whatever the host's order is.
        let port_be = 6443u16.to_be();
        assert_eq!(port_from_user_port(user_port_from_port(port_be)), port_be);
        assert_eq!(u16::from_be(port_from_user_port(u32::from(port_be))), 6443);
        assert_eq!(
            port_from_user_port(0xdead_0000 | u32::from(port_be)),
            port_be
        );
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
