//! The maps the programs share. Each map's name is the constant of the same
//! role in `lb_common::names`; the ABI test of lb-userspace checks that
//! they agree. Above each map: who writes it and who reads it.

use aya_ebpf::{
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf, SkStorage, SockHash},
    macros::btf_map,
};
use lb_common::{
    BackendConns, BackendInfo, BackendSlot, BackendStats, CONNECT_FAILURES_BYTES, ConnectFailure,
    DEFAULT_SOCKET_TABLE_SIZE, DaemonRecord, Endpoint, Liveness, MAX_ACCEL_PENDING,
    MAX_ACCEL_SOCKETS, MAX_BACKENDS, MAX_DRAINS, MAX_LEGACY_REDIRECTS, MAX_SLOTS, MAX_TABLES,
    MAX_VIPS, ServiceEntry, Settings, SockKey, SocketRecord, SocketTableStats, TableInfo,
    TableStats, TrackedSocket, VIP_PORT_WORDS,
};

/// The ports some VIP uses, one bit each (`lb_common::vip_port_bit`).
/// Written by the daemon: a port's bit is set before the first VIP on it
/// goes into `SERVICES`, and cleared after the last one leaves; the
/// loader sets the bit of every VIP in `SERVICES` before it attaches new
/// programs. Read by connect4/connect6, which look a VIP up only for a
/// connect to a port whose bit is set: an array read, inlined, instead of
/// a hash lookup for every other connect of the cgroup.
#[btf_map(name = "lb_vports_v1")]
pub static VIP_PORTS: Array<u64, { VIP_PORT_WORDS as usize }> = Array::new();

/// VIP → current selection table. Written by the daemon (one update per
/// table swap), read by connect4/connect6.
#[btf_map(name = "lb_services_v1")]
pub static SERVICES: HashMap<Endpoint, ServiceEntry, { MAX_VIPS as usize }> = HashMap::new();

/// Selection tables, two banks per table. Written by the daemon into the idle
/// bank only, read by connect4/connect6.
#[btf_map(name = "lb_slots_v1")]
pub static SLOTS: Array<BackendSlot, { MAX_SLOTS as usize }> = Array::new();

/// Socket cookie → record of each socket socklb follows. Preallocated (not
/// an LRU, which could evict a live socket's record): a connect takes a
/// free element and allocates nothing, and the memory is fixed when the
/// map is created (the loader sets the size from `socket-table-size`).
/// Written by connect4/6 (insert), sock_ops (the LIVE flag; removal at
/// TCP_CLOSE), sock_release (removal of a socket that never connected) and
/// the daemon's sweep (removal of a socket that is gone); read by
/// getpeername4/6 and sock_ops.
#[btf_map(name = "lb_socktab_v1")]
pub static SOCKET_TABLE: HashMap<u64, TrackedSocket, { DEFAULT_SOCKET_TABLE_SIZE as usize }> =
    HashMap::new();

/// The socket table of the array layout (`SocketSlot`: the owner's cookie
/// and its record), Linux 5.12 and later: a connect claims a slot with a
/// compare-and-exchange of its cookie and allocates nothing; lookups are
/// inlined array reads, with no helper call and no bucket lock. The loader
/// sizes it (half of `socket-table-size`, rounded up to a power of two) and sets
/// `SOCKLB_SLOT_MASK`. Mapped by the daemon (`BPF_F_MMAPABLE`), whose
/// sweep frees slots with the same compare-and-exchange. With this layout
/// `SOCKET_TABLE` holds the sockets whose slots were all taken, and those
/// an install of the hash layout filed there before an upgrade.
#[cfg(feature = "slots")]
#[btf_map(name = "lb_socktab_v2")]
pub static SOCKET_SLOTS: Array<
    lb_common::SocketSlot,
    { lb_common::socket_slots_for(DEFAULT_SOCKET_TABLE_SIZE) as usize },
    BPF_F_MMAPABLE,
> = Array::new();

/// `BPF_F_MMAPABLE` (uapi/linux/bpf.h): the daemon maps the array.
#[cfg(feature = "slots")]
const BPF_F_MMAPABLE: usize = 1 << 10;

/// Connects redirected without a record. Written by connect4/6, read by
/// status.
#[btf_map(name = "lb_sockstat_v1")]
pub static SOCKET_TABLE_STATS: PerCpuArray<SocketTableStats, 1> = PerCpuArray::new();

/// The daemon's heartbeat and each table's patience. Written by the daemon
/// on every heartbeat; read by connect4/6 for services with
/// `SERVICE_FLAG_HAND_BACK`.
#[btf_map(name = "lb_liveness_v1")]
pub static LIVENESS: Array<Liveness, 1> = Array::new();

/// The previous layout's per-socket records, in socket-local storage.
/// Nothing writes it now; getpeername and sock_ops read it (feature
/// `LEGACY_STORAGE`) for sockets redirected before an upgrade from it.
#[btf_map(name = "lb_sockets_v1")]
pub static LEGACY_SOCKETS: SkStorage<SocketRecord> = SkStorage::new();

/// The first layout's per-socket records, by socket cookie. Nothing writes
/// it now; getpeername and sock_ops read it (feature `LEGACY_LRU`) for
/// sockets redirected before an upgrade from it, and sock_ops empties it.
#[btf_map(name = "REDIRECTS")]
pub static LEGACY_REDIRECTS: LruHashMap<u64, SocketRecord, { MAX_LEGACY_REDIRECTS as usize }> =
    LruHashMap::new();

/// Redirect counters per backend id. Written by connect4/6 (per CPU: no
/// atomic needed, and no cache line bounces between CPUs), read by status.
#[btf_map(name = "lb_bstats_v1")]
pub static BACKEND_STATS: PerCpuArray<BackendStats, { MAX_BACKENDS as usize }> = PerCpuArray::new();

/// "None healthy" counters per table. Written by connect4/6, read by status.
#[btf_map(name = "lb_tstats_v1")]
pub static TABLE_STATS: PerCpuArray<TableStats, { MAX_TABLES as usize }> = PerCpuArray::new();

/// Backend id → address, weight, health. Written by the daemon, read by
/// status; the programs never touch it.
#[btf_map(name = "lb_backends_v1")]
pub static BACKENDS: HashMap<u32, BackendInfo, { MAX_BACKENDS as usize }> = HashMap::new();

/// Table id → service name and policy. Written by the daemon, read by status.
#[btf_map(name = "lb_tables_v1")]
pub static TABLES: HashMap<u32, TableInfo, { MAX_TABLES as usize }> = HashMap::new();

/// Backend address → 1: drains. Written by the daemon (or `socklb drain`
/// while none runs); the programs never touch it.
#[btf_map(name = "lb_drains_v1")]
pub static DRAINS: HashMap<Endpoint, u32, { MAX_DRAINS as usize }> = HashMap::new();

/// Index 0: the daemon's netns cookie. Written by the daemon at install,
/// read by connect4/connect6.
#[btf_map(name = "lb_settings_v1")]
pub static SETTINGS: Array<Settings, 1> = Array::new();

/// Connection counters per backend id. Written by sock_ops (atomic adds:
/// connect4/6 read `live` for least-conn, so it cannot be per CPU), read
/// by connect4/6 and status.
#[btf_map(name = "lb_conns_v1")]
pub static BACKEND_CONNS: Array<BackendConns, { MAX_BACKENDS as usize }> = Array::new();

/// One record per connect that failed with evidence from the server side.
/// Written by sock_ops, read by the daemon, which then probes the backend
/// at once to confirm.
#[btf_map(name = "lb_failures_v1")]
pub static CONNECT_FAILURES: RingBuf<ConnectFailure, { CONNECT_FAILURES_BYTES as usize }> =
    RingBuf::new();

/// The daemon's heartbeat and identity. Written by the daemon, read by
/// `socklb status`; the programs never touch it.
#[btf_map(name = "lb_daemon_v1")]
pub static DAEMON: Array<DaemonRecord, 1> = Array::new();

/// Accelerated sockets: both ends of each accelerated connection, each
/// under its own `SockKey`. Written by sock_ops; the sk_msg program runs
/// on every socket here. A socket leaves it when it closes.
#[btf_map(name = "lb_sockhash_v1")]
pub static SOCKHASH: SockHash<SockKey, { MAX_ACCEL_SOCKETS as usize }> = SockHash::new();

/// Client sockets put into `SOCKHASH` whose backend socket has not joined
/// yet. Written by sock_ops at the client's ACTIVE_ESTABLISHED, taken at
/// the backend's PASSIVE_ESTABLISHED: only a connection socklb redirected
/// gets its server side accelerated. A plain hash, not an LRU, which can
/// evict before it is full; a client's entry goes when it closes.
#[btf_map(name = "lb_accpend_v1")]
pub static ACCEL_PENDING: HashMap<SockKey, u32, { MAX_ACCEL_PENDING as usize }> = HashMap::new();

/// Accelerated sockets that sent a message the normal way (no peer yet,
/// or acceleration removed): they never redirect again. The peer reads
/// redirected messages before its TCP receive queue, so a redirect after a
/// message on the normal path could overtake it. Written and read by
/// sk_msg, emptied by sock_ops when the socket closes (a plain hash: an
/// eviction would let a socket redirect again).
#[btf_map(name = "lb_passed_v1")]
pub static PASSED: HashMap<SockKey, u32, { MAX_ACCEL_SOCKETS as usize }> = HashMap::new();

/// Local backends of accelerating services. Written by the daemon; read by
/// sock_ops (pair only these) and sk_msg (redirect only while here, so
/// that removing a backend sends its open connections back to the normal
/// path without taking a socket out of `SOCKHASH`).
#[btf_map(name = "lb_accel_v1")]
pub static ACCEL: HashMap<Endpoint, u32, { MAX_BACKENDS as usize }> = HashMap::new();
