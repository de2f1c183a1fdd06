//! socklb's kernel side: cgroup connect hooks that send a VIP's connects to a
//! backend picked from a table the daemon keeps, and getpeername hooks that
//! show the application the VIP it asked for. A sock_ops program counts the
//! connections of each backend and reports connects that the server side
//! failed (a reset, or an unanswered SYN), never one the client abandoned.
//!
//! sockmap acceleration (services with `accelerate = "sockmap"`): sock_ops
//! puts both ends of a redirected connection to a local backend into a
//! SOCKHASH, the client's when it establishes and the backend's accepted
//! socket when it does; the sk_msg program then moves each message
//! straight into the peer's receive queue. A message that cannot be
//! redirected takes the normal path; none is ever dropped.
//!
//! Every entry point is a thin wrapper: it calls a worker and maps the result
//! to "proceed" (1) or "refuse" (0). Anything that is not a TCP connect to a
//! configured VIP proceeds untouched.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// The bpf target has no atomic types with read-modify-write methods; the
// intrinsic lowers to BPF's atomic add. It is used in one place (`add`).
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_F_INGRESS, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_RTO_CB, BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB,
        BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB, bpf_sock_addr, bpf_sock_ops,
    },
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf, SkStorage, SockHash},
    helpers::generated::{
        bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_set_retval,
        bpf_sk_storage_get,
    },
    macros::{btf_map, cgroup_sock_addr, sk_msg, sock_ops},
    programs::{SkMsgContext, SockAddrContext, SockOpsContext},
};
use aya_log_ebpf::debug;
use lb_common::{
    BackendConns, BackendInfo, BackendSlot, BackendStats, CONNECT_FAILURES_BYTES, ConnectFailure,
    DaemonRecord, EVIDENCE_RESET, EVIDENCE_SYN_TIMEOUT, Endpoint, FAMILY_V4, MAX_ACCEL_PENDING,
    MAX_ACCEL_SOCKETS, MAX_BACKENDS, MAX_DRAINS, MAX_LEGACY_REDIRECTS, MAX_SLOTS, MAX_TABLES,
    MAX_VIPS, SERVICE_FLAG_ACCELERATE, SERVICE_FLAG_ALL_NETNS, SOCKET_FLAG_ACCELERATE,
    SOCKET_FLAG_LIVE, ServiceEntry, Settings, SlotChoice, SockKey, SocketRecord, TableInfo,
    TableStats, choose_slot, features, port_from_user_port, second_is_less_loaded, second_slot,
    user_port_from_port,
};

// Each map's name is the constant of the same role in `lb_common::names`;
// the ABI test of lb-userspace checks that they agree.

/// VIP → current selection table. Written by the daemon (one update per
/// table swap), read by connect4/connect6.
#[btf_map(name = "lb_services_v1")]
static SERVICES: HashMap<Endpoint, ServiceEntry, { MAX_VIPS as usize }> = HashMap::new();

/// Selection tables, two banks per table. Written by the daemon into the idle
/// bank only, read by connect4/connect6.
#[btf_map(name = "lb_slots_v1")]
static SLOTS: Array<BackendSlot, { MAX_SLOTS as usize }> = Array::new();

/// Per-socket facts of each redirected socket, freed with the socket.
/// Written by connect4/6, read by getpeername4/6 and sock_ops.
#[btf_map(name = "lb_sockets_v1")]
static SOCKETS: SkStorage<SocketRecord> = SkStorage::new();

/// The first layout's per-socket records, by socket cookie. Written by
/// connect4/6 only on a kernel without socket storage in sock_addr; read
/// (and emptied) by getpeername and sock_ops for sockets without storage,
/// such as those redirected before an upgrade.
#[btf_map(name = "REDIRECTS")]
static LEGACY_REDIRECTS: LruHashMap<u64, SocketRecord, { MAX_LEGACY_REDIRECTS as usize }> =
    LruHashMap::new();

/// Redirect counters per backend id. Written by connect4/6, read by status.
#[btf_map(name = "lb_bstats_v1")]
static BACKEND_STATS: PerCpuArray<BackendStats, { MAX_BACKENDS as usize }> = PerCpuArray::new();

/// "None healthy" counters per table. Written by connect4/6, read by status.
#[btf_map(name = "lb_tstats_v1")]
static TABLE_STATS: PerCpuArray<TableStats, { MAX_TABLES as usize }> = PerCpuArray::new();

/// Backend id → address, weight, health. Written by the daemon, read by
/// status; the programs never touch it.
#[btf_map(name = "lb_backends_v1")]
static BACKENDS: HashMap<u32, BackendInfo, { MAX_BACKENDS as usize }> = HashMap::new();

/// Table id → service name and policy. Written by the daemon, read by status.
#[btf_map(name = "lb_tables_v1")]
static TABLES: HashMap<u32, TableInfo, { MAX_TABLES as usize }> = HashMap::new();

/// Backend address → 1: drains. Written by the daemon (or `socklb drain`
/// while none runs); the programs never touch it.
#[btf_map(name = "lb_drains_v1")]
static DRAINS: HashMap<Endpoint, u32, { MAX_DRAINS as usize }> = HashMap::new();

/// Index 0: the daemon's netns cookie. Written by the daemon at install,
/// read by connect4/connect6.
#[btf_map(name = "lb_settings_v1")]
static SETTINGS: Array<Settings, 1> = Array::new();

/// Connection counters per backend id. Written by sock_ops (atomic adds),
/// read by connect4/6 for least-conn and by status.
#[btf_map(name = "lb_conns_v1")]
static BACKEND_CONNS: Array<BackendConns, { MAX_BACKENDS as usize }> = Array::new();

/// One record per connect that failed with evidence from the server side.
/// Written by sock_ops, read by the daemon, which then probes the backend
/// at once to confirm.
#[btf_map(name = "lb_failures_v1")]
static CONNECT_FAILURES: RingBuf<ConnectFailure, { CONNECT_FAILURES_BYTES as usize }> =
    RingBuf::new();

/// The daemon's heartbeat and identity. Written by the daemon, read by
/// `socklb status`; the programs never touch it.
#[btf_map(name = "lb_daemon_v1")]
static DAEMON: Array<DaemonRecord, 1> = Array::new();

/// Accelerated sockets: both ends of each accelerated connection, each
/// under its own `SockKey`. Written by sock_ops; the sk_msg program runs
/// on every socket here. A socket leaves it when it closes.
#[btf_map(name = "lb_sockhash_v1")]
static SOCKHASH: SockHash<SockKey, { MAX_ACCEL_SOCKETS as usize }> = SockHash::new();

/// Client sockets put into `SOCKHASH` whose backend socket has not joined
/// yet. Written by sock_ops at the client's ACTIVE_ESTABLISHED, taken at
/// the backend's PASSIVE_ESTABLISHED: only a connection socklb redirected
/// gets its server side accelerated. A plain hash, not an LRU, which can
/// evict before it is full; a client's entry goes when it closes.
#[btf_map(name = "lb_accpend_v1")]
static ACCEL_PENDING: HashMap<SockKey, u32, { MAX_ACCEL_PENDING as usize }> = HashMap::new();

/// Accelerated sockets that sent a message the normal way (no peer yet,
/// or acceleration removed): they never redirect again. The peer reads
/// redirected messages before its TCP receive queue, so a redirect after a
/// message on the normal path could overtake it. Written and read by
/// sk_msg, emptied by sock_ops when the socket closes (a plain hash: an
/// eviction would let a socket redirect again).
#[btf_map(name = "lb_passed_v1")]
static PASSED: HashMap<SockKey, u32, { MAX_ACCEL_SOCKETS as usize }> = HashMap::new();

/// Local backends of accelerating services. Written by the daemon; read by
/// sock_ops (pair only these) and sk_msg (redirect only while here, so
/// that removing a backend sends its open connections back to the normal
/// path without taking a socket out of `SOCKHASH`).
#[btf_map(name = "lb_accel_v1")]
static ACCEL: HashMap<Endpoint, u32, { MAX_BACKENDS as usize }> = HashMap::new();

/// `lb_common::features` bits the kernel offers, set by the loader (the
/// name is `lb_common::names::globals::FEATURES`). Read-only data: the
/// verifier removes the branches of features that are off, helper calls
/// included.
#[unsafe(no_mangle)]
static SOCKLB_FEATURES: u32 = features::ALL;

#[inline(always)]
fn has(feature: u32) -> bool {
    // A volatile read, so the compiler keeps the load the loader patches.
    unsafe { core::ptr::read_volatile(&raw const SOCKLB_FEATURES) & feature != 0 }
}

const PROCEED: i32 = 1;
const REFUSE: i32 = 0;
const SOCK_STREAM: u32 = 1;
const IPPROTO_TCP: u32 = 6;
const ECONNREFUSED: i32 = 111;
/// `::ffff:0:0/96` in network byte order, word 2 of an IPv4-mapped address.
const V4_MAPPED_WORD_BE: u32 = 0xffff_u32.to_be();

/// Why a connect is refused. Only the entry point turns it into a verdict.
enum Refusal {
    NoHealthyBackend,
}

#[cgroup_sock_addr(connect4)]
pub fn socklb_connect4(ctx: SockAddrContext) -> i32 {
    verdict(&ctx, connect4(&ctx))
}

#[cgroup_sock_addr(connect6)]
pub fn socklb_connect6(ctx: SockAddrContext) -> i32 {
    verdict(&ctx, connect6(&ctx))
}

#[cgroup_sock_addr(getpeername4)]
pub fn socklb_getpeername4(ctx: SockAddrContext) -> i32 {
    getpeername4(&ctx);
    PROCEED
}

#[cgroup_sock_addr(getpeername6)]
pub fn socklb_getpeername6(ctx: SockAddrContext) -> i32 {
    getpeername6(&ctx);
    PROCEED
}

#[inline(always)]
fn verdict(ctx: &SockAddrContext, result: Result<(), Refusal>) -> i32 {
    match result {
        Ok(()) => PROCEED,
        Err(Refusal::NoHealthyBackend) => {
            // Without this the caller would see EPERM, which reads like a
            // permissions problem; ECONNREFUSED says "nobody is there".
            if has(features::SET_RETVAL) {
                unsafe { bpf_set_retval(-ECONNREFUSED) };
            }
            debug!(ctx, "socklb: refused, no healthy backend");
            REFUSE
        }
    }
}

/// The context, which this program exists to rewrite. A raw pointer, not a
/// `&mut` made from a shared reference: each invocation has its own, and
/// every access below is one field read or write through it.
#[inline(always)]
fn sock_addr(ctx: &SockAddrContext) -> *mut bpf_sock_addr {
    ctx.sock_addr
}

/// The four words of `user_ip6`. The verifier allows only 4-byte loads from
/// them, so they are read word by word rather than as one array.
#[inline(always)]
fn user_ip6(sa: *mut bpf_sock_addr) -> [u32; 4] {
    unsafe {
        [
            (*sa).user_ip6[0],
            (*sa).user_ip6[1],
            (*sa).user_ip6[2],
            (*sa).user_ip6[3],
        ]
    }
}

#[inline(always)]
fn is_tcp(sa: *mut bpf_sock_addr) -> bool {
    // TCP only: MPTCP and SCTP stream sockets never reach sock_ops.
    unsafe { (*sa).type_ == SOCK_STREAM && (*sa).protocol == IPPROTO_TCP }
}

fn connect4(ctx: &SockAddrContext) -> Result<(), Refusal> {
    let sa = sock_addr(ctx);
    if !is_tcp(sa) {
        return Ok(());
    }
    let vip = unsafe { Endpoint::v4((*sa).user_ip4, port_from_user_port((*sa).user_port)) };
    let Some((slot, service_flags)) = select_backend(ctx, &vip)? else {
        return Ok(());
    };
    // A table of an IPv4 VIP only holds IPv4 backends; check anyway so a bad
    // write can never send a v4 socket to a v6 address.
    if slot.target.family != FAMILY_V4 {
        return Ok(());
    }
    unsafe {
        (*sa).user_ip4 = slot.target.addr_be[0];
        (*sa).user_port = user_port_from_port(slot.target.port_be);
    }
    remember(ctx, &vip, &slot, service_flags);
    Ok(())
}

fn connect6(ctx: &SockAddrContext) -> Result<(), Refusal> {
    let sa = sock_addr(ctx);
    if !is_tcp(sa) {
        return Ok(());
    }
    let words = user_ip6(sa);
    let port_be = unsafe { port_from_user_port((*sa).user_port) };
    let mapped = words[0] == 0 && words[1] == 0 && words[2] == V4_MAPPED_WORD_BE;
    let vip = if mapped {
        // An IPv6 socket dialling ::ffff:a.b.c.d reaches the IPv4 VIP.
        Endpoint::v4(words[3], port_be)
    } else {
        Endpoint::v6(words, port_be)
    };
    let Some((slot, service_flags)) = select_backend(ctx, &vip)? else {
        return Ok(());
    };
    if slot.target.family != vip.family {
        return Ok(());
    }
    unsafe {
        if mapped {
            (*sa).user_ip6[0] = 0;
            (*sa).user_ip6[1] = 0;
            (*sa).user_ip6[2] = V4_MAPPED_WORD_BE;
            (*sa).user_ip6[3] = slot.target.addr_be[0];
        } else {
            (*sa).user_ip6[0] = slot.target.addr_be[0];
            (*sa).user_ip6[1] = slot.target.addr_be[1];
            (*sa).user_ip6[2] = slot.target.addr_be[2];
            (*sa).user_ip6[3] = slot.target.addr_be[3];
        }
        (*sa).user_port = user_port_from_port(slot.target.port_be);
    }
    remember(ctx, &vip, &slot, service_flags);
    Ok(())
}

/// Looks the VIP up and picks a backend slot; with the service's flags.
/// `Ok(None)`: not ours, proceed.
#[inline(always)]
fn select_backend(
    ctx: &SockAddrContext,
    vip: &Endpoint,
) -> Result<Option<(BackendSlot, u32)>, Refusal> {
    // SAFETY: the entry is copied out at once; the daemon replaces entries
    // with a fresh element (hash map update), never in place.
    let Some(entry) = (unsafe { SERVICES.get(vip) }).copied() else {
        return Ok(None);
    };
    if !netns_allowed(ctx, &entry) {
        return Ok(None);
    }
    let random = unsafe { bpf_get_prandom_u32() };
    let index = match choose_slot(&entry, random) {
        SlotChoice::Healthy(index) => index,
        SlotChoice::FailOpen(index) => {
            count_none_healthy(entry.table_id, false);
            index
        }
        SlotChoice::Reject => {
            count_none_healthy(entry.table_id, true);
            return Err(Refusal::NoHealthyBackend);
        }
        SlotChoice::Empty => return Ok(None),
    };
    // Array lookups are bounds-checked by the kernel: an index past the end
    // yields None, never a stray read.
    let Some(mut slot) = SLOTS.get(index).copied() else {
        return Ok(None);
    };
    // Power of two choices: a second random healthy slot, and the less
    // loaded of the two wins. Two reads, no loop.
    if let Some(other_index) = second_slot(&entry, unsafe { bpf_get_prandom_u32() })
        && let Some(other) = SLOTS.get(other_index).copied()
        && second_is_less_loaded(
            live_connections(slot.backend_id),
            live_connections(other.backend_id),
        )
    {
        slot = other;
    }
    if let Some(stats) = BACKEND_STATS.get_ptr_mut(slot.backend_id) {
        // Per-CPU value: no other writer, a plain add is race free.
        unsafe { (*stats).redirects += 1 };
    }
    debug!(
        ctx,
        "socklb: table {} slot {} -> backend {}", entry.table_id, index, slot.backend_id
    );
    Ok(Some((slot, entry.flags)))
}

#[inline(always)]
fn live_connections(backend_id: u32) -> i64 {
    match BACKEND_CONNS.get_ptr(backend_id) {
        // SAFETY: an aligned 8-byte load from a map value is atomic on BPF,
        // and matches the atomic adds of sock_ops.
        Some(conns) => unsafe { core::ptr::read_volatile(&raw const (*conns).live) },
        None => 0,
    }
}

#[inline(always)]
fn netns_allowed(ctx: &SockAddrContext, entry: &ServiceEntry) -> bool {
    // Without the helper (or the daemon's cookie) namespaces cannot be told
    // apart; the daemon says so when it starts.
    if entry.flags & SERVICE_FLAG_ALL_NETNS != 0 || !has(features::NETNS_COOKIE) {
        return true;
    }
    let Some(settings) = SETTINGS.get(0) else {
        return false;
    };
    let cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    cookie == settings.host_netns_cookie
}

#[inline(always)]
fn count_none_healthy(table_id: u32, rejected: bool) {
    if let Some(stats) = TABLE_STATS.get_ptr_mut(table_id) {
        unsafe {
            (*stats).none_healthy += 1;
            if rejected {
                (*stats).rejected += 1;
            }
        }
    }
}

/// Keeps the socket's facts: in its own storage, which lives and dies with
/// it, or on a kernel without that, in the legacy LRU by cookie.
#[inline(always)]
fn remember(ctx: &SockAddrContext, vip: &Endpoint, slot: &BackendSlot, service_flags: u32) {
    let flags = if service_flags & SERVICE_FLAG_ACCELERATE != 0 {
        SOCKET_FLAG_ACCELERATE
    } else {
        0
    };
    let mut record = SocketRecord {
        vip: *vip,
        backend: slot.target,
        backend_id: slot.backend_id,
        flags,
    };
    if has(features::SK_STORAGE) {
        // A socket that connects again (after a failed attempt) gets its
        // record replaced.
        let stored = unsafe { SOCKETS.get_or_insert_ptr_mut(ctx, Some(&mut record)) };
        if !stored.is_null() {
            unsafe { store_record(stored, &record) };
        }
        return;
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // Best effort: if the insert fails, getpeername shows the backend.
    let _ = LEGACY_REDIRECTS.insert(cookie, record, 0);
}

/// Copies a record into map memory word by word. A plain assignment
/// through the helper's pointer compiles to a call of a byte-by-byte
/// `memmove` (about 400 instructions for 48 bytes); twelve 4-byte stores
/// (the record's alignment) are all it takes.
#[inline(always)]
unsafe fn store_record(stored: *mut SocketRecord, record: &SocketRecord) {
    const WORDS: usize = size_of::<SocketRecord>() / 4;
    let src = core::ptr::from_ref(record).cast::<u32>();
    let dst = stored.cast::<u32>();
    let mut i = 0;
    while i < WORDS {
        // Volatile, so that the compiler does not merge the stores back
        // into a memmove call.
        unsafe { core::ptr::write_volatile(dst.add(i), src.add(i).read()) };
        i += 1;
    }
}

/// The socket's record, if socklb redirected it.
#[inline(always)]
fn redirected_record(ctx: &SockAddrContext) -> Option<SocketRecord> {
    if has(features::SK_STORAGE) {
        let stored = unsafe { SOCKETS.get_ptr_mut(ctx) };
        if !stored.is_null() {
            return Some(unsafe { *stored });
        }
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    unsafe { LEGACY_REDIRECTS.get(cookie) }.copied()
}

/// The VIP to show for this socket, if it was redirected and its peer is
/// still the backend it was sent to.
#[inline(always)]
fn redirected_vip(ctx: &SockAddrContext, peer: &Endpoint) -> Option<Endpoint> {
    let record = redirected_record(ctx)?;
    (record.backend == *peer).then_some(record.vip)
}

fn getpeername4(ctx: &SockAddrContext) {
    let sa = sock_addr(ctx);
    let peer = unsafe { Endpoint::v4((*sa).user_ip4, port_from_user_port((*sa).user_port)) };
    if let Some(vip) = redirected_vip(ctx, &peer) {
        unsafe {
            (*sa).user_ip4 = vip.addr_be[0];
            (*sa).user_port = user_port_from_port(vip.port_be);
        }
    }
}

fn getpeername6(ctx: &SockAddrContext) {
    let sa = sock_addr(ctx);
    let words = user_ip6(sa);
    let port_be = unsafe { port_from_user_port((*sa).user_port) };
    let mapped = words[0] == 0 && words[1] == 0 && words[2] == V4_MAPPED_WORD_BE;
    let peer = if mapped {
        Endpoint::v4(words[3], port_be)
    } else {
        Endpoint::v6(words, port_be)
    };
    let Some(vip) = redirected_vip(ctx, &peer) else {
        return;
    };
    unsafe {
        if mapped {
            (*sa).user_ip6[3] = vip.addr_be[0];
        } else {
            (*sa).user_ip6[0] = vip.addr_be[0];
            (*sa).user_ip6[1] = vip.addr_be[1];
            (*sa).user_ip6[2] = vip.addr_be[2];
            (*sa).user_ip6[3] = vip.addr_be[3];
        }
        (*sa).user_port = user_port_from_port(vip.port_be);
    }
}

#[sock_ops]
pub fn socklb_sockops(ctx: SockOpsContext) -> u32 {
    let op = ctx.op();
    if op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB {
        if has(features::SOCKMAP) {
            pair_backend_side(&ctx);
        }
        return 1;
    }
    count_connection(&ctx);
    // sock_ops verdicts are ignored for these callbacks; 1 is "ok".
    1
}

#[sk_msg]
pub fn socklb_skmsg(ctx: SkMsgContext) -> u32 {
    if has(features::SOCKMAP) {
        redirect_to_peer(&ctx);
    }
    // With a redirect set up this sends the message to the peer; without
    // one (no peer, acceleration removed) it takes the normal path. Never
    // SK_DROP: a message is never lost here.
    SK_PASS
}

const SK_PASS: u32 = 1;
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;
const BPF_ANY: u64 = 0;

/// An IPv4 address word in the `SockKey` form (`::ffff:a.b.c.d`).
#[inline(always)]
fn mapped(addr_be: u32) -> [u32; 4] {
    [0, 0, V4_MAPPED_WORD_BE, addr_be]
}

/// A remote port as sock_ops and sk_msg contexts give it (network byte
/// order, in the upper half of the word on little-endian kernels), in host
/// byte order.
#[inline(always)]
fn remote_port_host(raw: u32) -> u32 {
    let port_be = if raw & 0xffff == 0 {
        raw >> 16
    } else {
        raw & 0xffff
    };
    u32::from(u16::from_be(port_be as u16))
}

/// One 4-byte field of a context, read with its own load at a constant
/// offset: the verifier refuses a context pointer with a computed offset,
/// which the compiler may otherwise make of two reads on two branches.
macro_rules! context_field {
    ($context:expr, $($field:tt)+) => {
        // SAFETY: a valid context the kernel handed over; an aligned
        // 4-byte read of one of its fields.
        unsafe { core::ptr::read_volatile(&raw const (*$context).$($field)+) }
    };
}

/// A `SockKey` from the fields that sock_ops and sk_msg contexts share.
/// Every field is read first, unconditionally: a read on one branch only
/// may be merged with another's into one load at a computed offset.
macro_rules! context_key {
    ($context:expr, $cookie:expr) => {{
        let context = $context;
        let family = context_field!(context, family);
        let (local4, remote4) = (
            context_field!(context, local_ip4),
            context_field!(context, remote_ip4),
        );
        let local6 = [
            context_field!(context, local_ip6[0]),
            context_field!(context, local_ip6[1]),
            context_field!(context, local_ip6[2]),
            context_field!(context, local_ip6[3]),
        ];
        let remote6 = [
            context_field!(context, remote_ip6[0]),
            context_field!(context, remote_ip6[1]),
            context_field!(context, remote_ip6[2]),
            context_field!(context, remote_ip6[3]),
        ];
        let (local_port, remote_port) = (
            context_field!(context, local_port),
            context_field!(context, remote_port),
        );
        let (local, remote) = match family {
            AF_INET => (mapped(local4), mapped(remote4)),
            AF_INET6 => (local6, remote6),
            _ => return None,
        };
        Some(SockKey {
            netns: $cookie,
            local,
            remote,
            local_port,
            remote_port: remote_port_host(remote_port),
        })
    }};
}

/// This socket's key, from the sock_ops context.
#[inline(always)]
fn sock_ops_key(ctx: &SockOpsContext) -> Option<SockKey> {
    context_key!(ctx.ops, unsafe { bpf_get_netns_cookie(ctx.as_ptr()) })
}

/// The sending socket's key, from the sk_msg context.
#[inline(always)]
fn sk_msg_key(ctx: &SkMsgContext) -> Option<SockKey> {
    context_key!(ctx.msg, unsafe { bpf_get_netns_cookie(ctx.as_ptr()) })
}

/// The client side of an accelerated connection, at ACTIVE_ESTABLISHED:
/// into `SOCKHASH`, and into `ACCEL_PENDING` for its backend's socket to
/// find. Only a socket socklb sent to a local backend of an accelerating
/// service gets here.
#[inline(always)]
fn pair_client_side(ctx: &SockOpsContext, backend: &Endpoint) {
    if unsafe { ACCEL.get(backend) }.is_none() {
        return;
    }
    let Some(mut key) = sock_ops_key(ctx) else {
        return;
    };
    // SAFETY: the context of this callback, which the helper takes.
    if SOCKHASH
        .update(&mut key, unsafe { &mut *ctx.ops }, BPF_ANY)
        .is_ok()
    {
        let _ = ACCEL_PENDING.insert(key, 1, 0);
    }
}

/// The backend side, at PASSIVE_ESTABLISHED of an accepted socket: joins
/// `SOCKHASH` only if its peer is a pending client socket (a connection
/// socklb redirected and sock_ops paired), never for other traffic.
#[inline(always)]
fn pair_backend_side(ctx: &SockOpsContext) {
    let Some(mut key) = sock_ops_key(ctx) else {
        return;
    };
    let peer = key.peer();
    if unsafe { ACCEL_PENDING.get(peer) }.is_none() {
        return;
    }
    // Join first, then clear the pending mark: a client message that
    // finds no mark finds this socket (see `redirect_to_peer`).
    // SAFETY: as above.
    if SOCKHASH
        .update(&mut key, unsafe { &mut *ctx.ops }, BPF_ANY)
        .is_ok()
    {
        // Its close clears what sk_msg records of it (`forget_accelerated`).
        let flags = ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG;
        let _ = ctx.set_cb_flags(flags as i32);
    }
    let _ = ACCEL_PENDING.remove(peer);
}

/// A socket that closes leaves `ACCEL_PENDING` and `PASSED` (it leaves
/// `SOCKHASH` by itself). Runs only for accelerated sockets: clients of an
/// accelerating service, and paired backend sockets.
#[inline(always)]
fn forget_accelerated(ctx: &SockOpsContext) {
    let Some(key) = sock_ops_key(ctx) else {
        return;
    };
    let _ = ACCEL_PENDING.remove(key);
    let _ = PASSED.remove(key);
}

/// Sets the message's redirect to the peer's receive queue, while the
/// connection's backend (the client's remote end, or the backend's own
/// local end) still accelerates and the peer is paired. Otherwise the
/// message goes the normal way, and so does every later one of this socket
/// (`PASSED`): bytes of one direction take one path from the first
/// message that was not redirected on.
#[inline(always)]
fn redirect_to_peer(ctx: &SkMsgContext) {
    let Some(key) = sk_msg_key(ctx) else {
        return;
    };
    if unsafe { PASSED.get(key) }.is_some() {
        return;
    }
    // The backend is a client's remote end, or a backend socket's own end.
    let remote = SockKey::endpoint(key.remote, key.remote_port);
    let local = SockKey::endpoint(key.local, key.local_port);
    let accelerated =
        unsafe { ACCEL.get(remote) }.is_some() || unsafe { ACCEL.get(local) }.is_some();
    // A client whose backend socket has not joined yet (its pending mark
    // is still there) sends this message the normal way.
    let pending = unsafe { ACCEL_PENDING.get(key) }.is_some();
    let mut peer = key.peer();
    // The helper returns SK_DROP when the peer is not in the map: no
    // redirect is set then.
    if !accelerated
        || pending
        || SOCKHASH.redirect_msg(ctx, &mut peer, u64::from(BPF_F_INGRESS)) != SK_PASS_LONG
    {
        let _ = PASSED.insert(key, 1, 0);
    }
}

const SK_PASS_LONG: i64 = 1;

/// TCP states, as in include/net/tcp_states.h.
const TCP_SYN_SENT: u32 = 2;
const TCP_CLOSE: u32 = 7;

/// One field of the sock_ops context. The verifier allows 4-byte reads of
/// these fields for full sockets, which every callback used here has.
#[inline(always)]
fn sock_ops_field(ctx: &SockOpsContext, read: impl Fn(&bpf_sock_ops) -> u32) -> u32 {
    // SAFETY: the kernel hands a valid context for the program's lifetime.
    read(unsafe { &*ctx.ops })
}

/// A socket's record as sock_ops finds it: a copy of its facts, and where
/// it lives. Every field is written on both paths: the verifier refuses a
/// program that reads stack it never wrote unless it runs with
/// CAP_PERFMON, which the DaemonSet does not grant, and the compiler may
/// read both variants of an enum before choosing one.
struct Record {
    facts: SocketRecord,
    place: Place,
}

enum Place {
    /// In the socket's storage (the record can be updated in place).
    Stored(*mut SocketRecord),
    /// In the legacy LRU, by cookie (a socket redirected before an upgrade,
    /// or on a kernel without socket storage in sock_addr).
    Legacy(u64),
}

#[inline(always)]
fn sock_ops_record(ctx: &SockOpsContext) -> Option<Record> {
    // SAFETY: `sk` of a full socket (null otherwise, which the helper takes).
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if !sk.is_null() {
        let map = core::ptr::from_ref(&SOCKETS).cast_mut().cast();
        let stored = unsafe { bpf_sk_storage_get(map, sk.cast(), core::ptr::null_mut(), 0) }
            .cast::<SocketRecord>();
        if !stored.is_null() {
            let facts = unsafe { *stored };
            return Some(Record {
                facts,
                place: Place::Stored(stored),
            });
        }
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let facts = unsafe { LEGACY_REDIRECTS.get(cookie) }.copied()?;
    Some(Record {
        facts,
        place: Place::Legacy(cookie),
    })
}

fn count_connection(ctx: &SockOpsContext) {
    let op = ctx.op();
    if op != BPF_SOCK_OPS_TCP_CONNECT_CB
        && op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB
        && op != BPF_SOCK_OPS_STATE_CB
        && op != BPF_SOCK_OPS_RTO_CB
    {
        return;
    }
    let Some(record) = sock_ops_record(ctx) else {
        // A socket without a record that sock_ops follows is a paired
        // backend socket (see `pair_backend_side`).
        if op == BPF_SOCK_OPS_STATE_CB && ctx.arg(1) == TCP_CLOSE && has(features::SOCKMAP) {
            forget_accelerated(ctx);
        }
        return;
    };
    let backend_id = record.facts.backend_id;
    let Some(conns) = BACKEND_CONNS.get_ptr_mut(backend_id) else {
        return;
    };
    match op {
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            // Ask for state changes of this socket, to see how it ends, and
            // for retransmission timeouts, to see a SYN go unanswered.
            let flags = ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG;
            let _ = ctx.set_cb_flags(flags as i32);
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            unsafe {
                add_i64(&raw mut (*conns).live, 1);
                core::ptr::write_volatile(&raw mut (*conns).consecutive_failures, 0);
            }
            if let Place::Stored(stored) = record.place {
                unsafe { (*stored).flags |= SOCKET_FLAG_LIVE };
            }
            let facts = record.facts;
            if has(features::SOCKMAP) && facts.flags & SOCKET_FLAG_ACCELERATE != 0 {
                pair_client_side(ctx, &facts.backend);
            }
            // An established connection's timeouts say nothing about the
            // server's health here; stop the RTO callbacks. Ask for state
            // changes again: the connect callback may have run under another
            // program (the first layout's, during an upgrade, which did not
            // know this socket), and a count whose close is never seen
            // stays up for good.
            let flags = (ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) & !BPF_SOCK_OPS_RTO_CB_FLAG;
            let _ = ctx.set_cb_flags(flags as i32);
        }
        BPF_SOCK_OPS_RTO_CB => {
            // Only the first timeout of a SYN: arg 0 is the number of
            // retransmissions so far. Later ones would count one connect
            // many times.
            if sock_ops_field(ctx, |ops| ops.state) == TCP_SYN_SENT && ctx.arg(0) == 0 {
                report_failure(conns, backend_id, EVIDENCE_SYN_TIMEOUT);
            }
        }
        _ => {
            let (old_state, new_state) = (ctx.arg(0), ctx.arg(1));
            if new_state != TCP_CLOSE {
                return;
            }
            if has(features::SOCKMAP) && record.facts.flags & SOCKET_FLAG_ACCELERATE != 0 {
                forget_accelerated(ctx);
            }
            let counted = match record.place {
                Place::Stored(stored) => unsafe { (*stored).flags & SOCKET_FLAG_LIVE != 0 },
                // The first layout counted every record that got past
                // SYN_SENT.
                Place::Legacy(_) => old_state != TCP_SYN_SENT,
            };
            if counted {
                unsafe { add_i64(&raw mut (*conns).live, -1) };
                if let Place::Stored(stored) = record.place {
                    unsafe { (*stored).flags &= !SOCKET_FLAG_LIVE };
                }
            } else if old_state == TCP_SYN_SENT {
                // A socket that never established received a segment only
                // if the server reset it. No segment and no retransmission
                // means the local application closed its own connect,
                // which never counts against a backend. A SYN that was
                // retransmitted was reported by its RTO callback already.
                let segments_in = sock_ops_field(ctx, |ops| ops.segs_in);
                let retransmits = sock_ops_field(ctx, |ops| ops.total_retrans);
                if segments_in > 0 && retransmits == 0 {
                    report_failure(conns, backend_id, EVIDENCE_RESET);
                }
            }
            // The socket storage goes with the socket; a legacy record must
            // be removed.
            if let Place::Legacy(cookie) = record.place {
                let _ = LEGACY_REDIRECTS.remove(cookie);
            }
        }
    }
}

/// Counts a failed connect with server-side evidence and tells the daemon,
/// which reads the streak from the counters.
#[inline(always)]
fn report_failure(conns: *mut BackendConns, backend_id: u32, evidence: u32) {
    unsafe {
        add_u64(&raw mut (*conns).failed_connects, 1);
        add_u64(&raw mut (*conns).consecutive_failures, 1);
    }
    let failure = ConnectFailure {
        backend_id,
        evidence,
    };
    // If the ring is full the daemon is behind; the counters above still
    // hold the truth.
    let _ = CONNECT_FAILURES.output(failure, 0);
}

/// An atomic add on a 64-bit counter shared by all CPUs (BPF_ATOMIC ADD).
/// Its fetched value is never used: nothing here depends on it.
#[inline(always)]
unsafe fn add_i64(counter: *mut i64, delta: i64) {
    #[cfg(target_arch = "bpf")]
    unsafe {
        core::intrinsics::atomic_xadd::<i64, i64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            counter, delta,
        );
    }
    #[cfg(not(target_arch = "bpf"))]
    unsafe {
        *counter += delta;
    }
}

#[inline(always)]
unsafe fn add_u64(counter: *mut u64, delta: u64) {
    unsafe { add_i64(counter.cast::<i64>(), delta as i64) };
}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// On the host the crate only type-checks (`cargo check --workspace`).
#[cfg(not(target_arch = "bpf"))]
fn main() {}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
