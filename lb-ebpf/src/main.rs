//! socklb's kernel side: cgroup connect hooks that send a VIP's connects to a
//! backend picked from a table the daemon keeps, and getpeername hooks that
//! show the application the VIP it asked for. A sock_ops program counts the
//! connections of each backend and reports connects that the server side
//! failed (a reset, or an unanswered SYN), never one the client abandoned.
//!
//! Every entry point is a thin wrapper: it calls a worker and maps the result
//! to "proceed" (1) or "refuse" (0). Anything that is not a TCP connect to a
//! configured VIP proceeds untouched.
#![no_std]
#![no_main]
// The bpf target has no atomic types with read-modify-write methods; the
// intrinsics lower to BPF's atomic add instructions.
#![feature(core_intrinsics)]
#![allow(internal_features)]

use core::intrinsics::{AtomicOrdering::Relaxed, atomic_xadd};

use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_ANY, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_RTO_CB,
        BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_SOCK_OPS_TCP_CONNECT_CB, bpf_sock_addr, bpf_sock_ops,
    },
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    helpers::generated::{
        bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_set_retval,
    },
    macros::{btf_map, cgroup_sock_addr, sock_ops},
    programs::{SockAddrContext, SockOpsContext},
};
use aya_log_ebpf::debug;
use lb_common::{
    BackendConns, BackendInfo, BackendSlot, BackendStats, CONNECT_FAILURES_BYTES, ConnectFailure,
    DaemonRecord, EVIDENCE_RESET, EVIDENCE_SYN_TIMEOUT, Endpoint, FAMILY_V4, MAX_BACKENDS, MAX_DRAINS, MAX_REDIRECTED_SOCKETS, MAX_SLOTS, MAX_TABLES,
    MAX_VIPS, RedirectedSocket, SERVICE_FLAG_ALL_NETNS, SERVICE_FLAG_LEAST_CONN, ServiceEntry,
    Settings, SlotChoice, TableInfo, TableStats, choose_slot, second_is_less_loaded,
};

/// VIP → current selection table. Written by the daemon (one update per
/// table swap), read by connect4/connect6.
#[btf_map]
static SERVICES: HashMap<Endpoint, ServiceEntry, { MAX_VIPS as usize }> = HashMap::new();

/// Selection tables, two banks per table. Written by the daemon into the idle
/// bank only, read by connect4/connect6.
#[btf_map]
static SLOTS: Array<BackendSlot, { MAX_SLOTS as usize }> = Array::new();

/// Socket cookie → (VIP, backend). Written by connect4/connect6, read by
/// getpeername4/getpeername6. LRU, so closed sockets age out.
#[btf_map]
static REDIRECTS: LruHashMap<u64, RedirectedSocket, { MAX_REDIRECTED_SOCKETS as usize }> =
    LruHashMap::new();

/// Redirect counters per backend id. Written by connect4/6, read by status.
#[btf_map]
static BACKEND_STATS: PerCpuArray<BackendStats, { MAX_BACKENDS as usize }> = PerCpuArray::new();

/// "None healthy" counters per table. Written by connect4/6, read by status.
#[btf_map]
static TABLE_STATS: PerCpuArray<TableStats, { MAX_TABLES as usize }> = PerCpuArray::new();

/// Backend id → address, weight, health. Written by the daemon, read by
/// status; the programs never touch it.
#[btf_map]
static BACKENDS: HashMap<u32, BackendInfo, { MAX_BACKENDS as usize }> = HashMap::new();

/// Table id → service name and policy. Written by the daemon, read by status.
#[btf_map]
static TABLES: HashMap<u32, TableInfo, { MAX_TABLES as usize }> = HashMap::new();

/// Backend address → 1: drains asked for by `socklb drain`. Written by that
/// command, read by the daemon; the programs never touch it.
#[btf_map]
static DRAINS: HashMap<Endpoint, u32, { MAX_DRAINS as usize }> = HashMap::new();

/// Index 0: the daemon's netns cookie. Written by the daemon at install,
/// read by connect4/connect6.
#[btf_map]
static SETTINGS: Array<Settings, 1> = Array::new();

/// Connection counters per backend id. Written by sock_ops (atomic adds),
/// read by connect4/6 for least-conn and by status.
#[btf_map]
static BACKEND_CONNS: Array<BackendConns, { MAX_BACKENDS as usize }> = Array::new();

/// The daemon's heartbeat and identity. Written by the daemon, read by
/// `socklb status`; the programs never touch it.
#[btf_map]
static DAEMON: Array<DaemonRecord, 1> = Array::new();

/// One record per connect that failed with evidence from the server side.
/// Written by sock_ops, read by the daemon, which then probes the backend
/// at once to confirm.
#[btf_map]
static CONNECT_FAILURES: RingBuf<ConnectFailure, { CONNECT_FAILURES_BYTES as usize }> =
    RingBuf::new();

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
            unsafe { bpf_set_retval(-ECONNREFUSED) };
            debug!(ctx, "socklb: refused, no healthy backend");
            REFUSE
        }
    }
}

#[inline(always)]
// The context is kernel memory that the program exists to rewrite; the
// kernel hands each invocation its own, so no other reference can alias it.
#[allow(clippy::mut_from_ref)]
fn sock_addr(ctx: &SockAddrContext) -> &mut bpf_sock_addr {
    // SAFETY: the kernel hands a valid context for the program's lifetime.
    unsafe { &mut *ctx.sock_addr }
}

fn connect4(ctx: &SockAddrContext) -> Result<(), Refusal> {
    let sa = sock_addr(ctx);
    // TCP only: MPTCP and SCTP stream sockets never reach sock_ops.
    if sa.type_ != SOCK_STREAM || sa.protocol != IPPROTO_TCP {
        return Ok(());
    }
    let vip = Endpoint::v4(sa.user_ip4, sa.user_port as u16);
    let Some(slot) = select_backend(ctx, &vip)? else {
        return Ok(());
    };
    // A table of an IPv4 VIP only holds IPv4 backends; check anyway so a bad
    // write can never send a v4 socket to a v6 address.
    if slot.target.family != FAMILY_V4 {
        return Ok(());
    }
    sa.user_ip4 = slot.target.addr_be[0];
    sa.user_port = slot.target.port_be as u32;
    remember(ctx, &vip, &slot);
    Ok(())
}

fn connect6(ctx: &SockAddrContext) -> Result<(), Refusal> {
    let sa = sock_addr(ctx);
    // TCP only: MPTCP and SCTP stream sockets never reach sock_ops.
    if sa.type_ != SOCK_STREAM || sa.protocol != IPPROTO_TCP {
        return Ok(());
    }
    // The verifier only allows 4-byte loads from user_ip6, so read it word
    // by word rather than as one 16-byte array.
    let words = [
        sa.user_ip6[0],
        sa.user_ip6[1],
        sa.user_ip6[2],
        sa.user_ip6[3],
    ];
    let port_be = sa.user_port as u16;
    let mapped = words[0] == 0 && words[1] == 0 && words[2] == V4_MAPPED_WORD_BE;
    let vip = if mapped {
        // An IPv6 socket dialling ::ffff:a.b.c.d reaches the IPv4 VIP.
        Endpoint::v4(words[3], port_be)
    } else {
        Endpoint::v6(words, port_be)
    };
    let Some(slot) = select_backend(ctx, &vip)? else {
        return Ok(());
    };
    if slot.target.family != vip.family {
        return Ok(());
    }
    if mapped {
        sa.user_ip6[0] = 0;
        sa.user_ip6[1] = 0;
        sa.user_ip6[2] = V4_MAPPED_WORD_BE;
        sa.user_ip6[3] = slot.target.addr_be[0];
    } else {
        sa.user_ip6[0] = slot.target.addr_be[0];
        sa.user_ip6[1] = slot.target.addr_be[1];
        sa.user_ip6[2] = slot.target.addr_be[2];
        sa.user_ip6[3] = slot.target.addr_be[3];
    }
    sa.user_port = slot.target.port_be as u32;
    remember(ctx, &vip, &slot);
    Ok(())
}

/// Looks the VIP up and picks a backend slot. `Ok(None)`: not ours, proceed.
#[inline(always)]
fn select_backend(ctx: &SockAddrContext, vip: &Endpoint) -> Result<Option<BackendSlot>, Refusal> {
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
    if entry.flags & SERVICE_FLAG_LEAST_CONN != 0 && entry.healthy_slots > 1 {
        // Power of two choices: a second random healthy slot, and the less
        // loaded of the two wins. Two reads, no loop.
        let other_index = entry.bank_base + unsafe { bpf_get_prandom_u32() } % entry.healthy_slots;
        if let Some(other) = SLOTS.get(other_index).copied()
            && second_is_less_loaded(
                live_connections(slot.backend_id),
                live_connections(other.backend_id),
            )
        {
            slot = other;
        }
    }
    if let Some(stats) = BACKEND_STATS.get_ptr_mut(slot.backend_id) {
        // Per-CPU value: no other writer, a plain add is race free.
        unsafe { (*stats).redirects += 1 };
    }
    debug!(
        ctx,
        "socklb: table {} slot {} -> backend {}", entry.table_id, index, slot.backend_id
    );
    Ok(Some(slot))
}

#[inline(always)]
fn live_connections(backend_id: u32) -> i64 {
    match BACKEND_CONNS.get_ptr(backend_id) {
        // SAFETY: the pointer is into the map's value; the atomic view
        // matches the atomic adds of sock_ops.
        // SAFETY: an aligned 8-byte load from a map value is atomic on BPF.
        Some(conns) => unsafe { core::ptr::read_volatile(&raw const (*conns).live) },
        None => 0,
    }
}

#[inline(always)]
fn netns_allowed(ctx: &SockAddrContext, entry: &ServiceEntry) -> bool {
    if entry.flags & SERVICE_FLAG_ALL_NETNS != 0 {
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

#[inline(always)]
fn remember(ctx: &SockAddrContext, vip: &Endpoint, slot: &BackendSlot) {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let record = RedirectedSocket {
        vip: *vip,
        backend: slot.target,
        backend_id: slot.backend_id,
        _pad: 0,
    };
    // Best effort: if the insert fails, getpeername shows the backend.
    let _ = REDIRECTS.insert(cookie, record, BPF_ANY as u64);
}

/// The VIP to show for this socket, if it was redirected and its peer is
/// still the backend it was sent to.
#[inline(always)]
fn redirected_vip(ctx: &SockAddrContext, peer: &Endpoint) -> Option<Endpoint> {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let record = unsafe { REDIRECTS.get(cookie) }.copied()?;
    (record.backend == *peer).then_some(record.vip)
}

fn getpeername4(ctx: &SockAddrContext) {
    let sa = sock_addr(ctx);
    let peer = Endpoint::v4(sa.user_ip4, sa.user_port as u16);
    if let Some(vip) = redirected_vip(ctx, &peer) {
        sa.user_ip4 = vip.addr_be[0];
        sa.user_port = vip.port_be as u32;
    }
}

fn getpeername6(ctx: &SockAddrContext) {
    let sa = sock_addr(ctx);
    let words = [
        sa.user_ip6[0],
        sa.user_ip6[1],
        sa.user_ip6[2],
        sa.user_ip6[3],
    ];
    let port_be = sa.user_port as u16;
    let mapped = words[0] == 0 && words[1] == 0 && words[2] == V4_MAPPED_WORD_BE;
    let peer = if mapped {
        Endpoint::v4(words[3], port_be)
    } else {
        Endpoint::v6(words, port_be)
    };
    let Some(vip) = redirected_vip(ctx, &peer) else {
        return;
    };
    if mapped {
        sa.user_ip6[3] = vip.addr_be[0];
    } else {
        sa.user_ip6[0] = vip.addr_be[0];
        sa.user_ip6[1] = vip.addr_be[1];
        sa.user_ip6[2] = vip.addr_be[2];
        sa.user_ip6[3] = vip.addr_be[3];
    }
    sa.user_port = vip.port_be as u32;
}

#[sock_ops]
pub fn socklb_sockops(ctx: SockOpsContext) -> u32 {
    count_connection(&ctx);
    // sock_ops verdicts are ignored for these callbacks; 1 is "ok".
    1
}

/// TCP states, as in include/net/tcp_states.h.
const TCP_SYN_SENT: u32 = 2;
const TCP_CLOSE: u32 = 7;

/// The backend id of a socket socklb redirected, and its cookie.
#[inline(always)]
fn redirected_backend(ctx: &SockOpsContext) -> Option<(u64, u32)> {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let record = unsafe { REDIRECTS.get(cookie) }?;
    Some((cookie, record.backend_id))
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
    let Some((cookie, backend_id)) = redirected_backend(ctx) else {
        return;
    };
    let Some(conns) = BACKEND_CONNS.get_ptr_mut(backend_id) else {
        return;
    };
    // SAFETY (all accesses below): `conns` points into a map value that
    // lives as long as the map; every CPU updates it with atomic adds or
    // aligned single stores only.
    let live = unsafe { &raw mut (*conns).live };
    let consecutive = unsafe { &raw mut (*conns).consecutive_failures };
    match op {
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            // Ask for state changes of this socket, to see how it ends, and
            // for retransmission timeouts, to see a SYN go unanswered.
            let flags = ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG;
            let _ = ctx.set_cb_flags(flags as i32);
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            unsafe {
                atomic_xadd::<i64, i64, { Relaxed }>(live, 1);
                core::ptr::write_volatile(consecutive, 0);
            }
            // An established connection's timeouts say nothing about the
            // server's health here; stop the RTO callbacks.
            let flags = ctx.cb_flags() & !BPF_SOCK_OPS_RTO_CB_FLAG;
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
            if old_state == TCP_SYN_SENT {
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
            } else {
                unsafe { atomic_xadd::<i64, i64, { Relaxed }>(live, -1) };
            }
            // The socket is gone; its getpeername record is no longer needed.
            let _ = REDIRECTS.remove(cookie);
        }
    }
}

/// One field of the sock_ops context. The verifier allows 4-byte reads of
/// these fields for full sockets, which every callback used here has.
#[inline(always)]
fn sock_ops_field(ctx: &SockOpsContext, read: impl Fn(&bpf_sock_ops) -> u32) -> u32 {
    // SAFETY: the kernel hands a valid context for the program's lifetime.
    read(unsafe { &*ctx.ops })
}

/// Counts a failed connect with server-side evidence and tells the daemon.
#[inline(always)]
fn report_failure(conns: *mut BackendConns, backend_id: u32, evidence: u32) {
    // The fetch-add's returned value is not reliable on this LLVM's BPF
    // backend (it yields the operand), so read the counter back; a
    // concurrent failure can only make it larger.
    let consecutive_failures = unsafe {
        atomic_xadd::<u64, u64, { Relaxed }>(&raw mut (*conns).failed_connects, 1);
        let consecutive = &raw mut (*conns).consecutive_failures;
        atomic_xadd::<u32, u32, { Relaxed }>(consecutive, 1);
        core::ptr::read_volatile(consecutive)
    };
    let failure = ConnectFailure {
        backend_id,
        consecutive_failures,
        evidence,
        _pad: 0,
    };
    // If the ring is full the daemon is behind; the counters above still
    // hold the truth.
    let _ = CONNECT_FAILURES.output(failure, 0);
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
