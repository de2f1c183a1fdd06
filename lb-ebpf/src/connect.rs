//! cgroup/connect4 and cgroup/connect6: a TCP connect to a VIP goes to a
//! backend picked from the VIP's table, and the socket is filed in the
//! socket table, so that getpeername shows the VIP and sock_ops counts it.
//!
//! Per redirected connect: one bit of the VIP ports (an array read), one
//! hash lookup (the VIP), one array read (the
//! slot; two more, and two counter reads, for least-conn), one per-CPU add,
//! one insert into the preallocated socket table, and, on Linux 6.12 and
//! later, one get and one set of the socket's callback flags. A service
//! that hands back when the daemon is gone adds an array read and a clock
//! read. A connect to a port no VIP uses costs one array read; a connect
//! to another address on a VIP's port, one hash lookup more.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB_FLAG, bpf_sock_addr},
    helpers::generated::{
        bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_getsockopt,
        bpf_ktime_get_boot_ns, bpf_set_retval, bpf_setsockopt,
    },
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use aya_log_ebpf::debug;
use lb_common::{
    BackendSlot, Endpoint, FAMILY_V4, SERVICE_FLAG_ACCELERATE, SERVICE_FLAG_ALL_NETNS,
    SERVICE_FLAG_HAND_BACK, SOCKET_FLAG_ACCELERATE, ServiceEntry, SlotChoice, SocketRecord,
    TrackedSocket, choose_slot, features, port_from_user_port, second_is_less_loaded, second_slot,
    user_port_from_port, vip_port_bit,
};

use crate::{
    IPPROTO_TCP, V4_MAPPED_WORD_BE, has,
    maps::{
        BACKEND_CONNS, BACKEND_STATS, LIVENESS, SERVICES, SETTINGS, SLOTS, SOCKET_TABLE_STATS,
        TABLE_STATS, VIP_PORTS,
    },
    records,
};

const PROCEED: i32 = 1;
const REFUSE: i32 = 0;
const SOCK_STREAM: u32 = 1;
const ECONNREFUSED: i32 = 111;
const SOL_TCP: i32 = 6;
/// `bpf_setsockopt`/`bpf_getsockopt` option of a socket's sock_ops
/// callback flags (uapi/linux/bpf.h, Linux 6.12).
const TCP_BPF_SOCK_OPS_CB_FLAGS: i32 = 1008;

/// Why a connect is refused. Only the entry point turns it into a verdict.
pub enum Refusal {
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
pub fn sock_addr(ctx: &SockAddrContext) -> *mut bpf_sock_addr {
    ctx.sock_addr
}

/// The four words of `user_ip6`. The verifier allows only 4-byte loads from
/// them, so they are read word by word rather than as one array.
#[inline(always)]
pub fn user_ip6(sa: *mut bpf_sock_addr) -> [u32; 4] {
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

/// A backend chosen for one connect, and what tracking its socket needs.
struct Choice {
    slot: BackendSlot,
    /// The service's `SERVICE_FLAG_*`.
    service_flags: u32,
    /// The socket's network namespace cookie (0 without the helper).
    netns_cookie: u64,
}

fn connect4(ctx: &SockAddrContext) -> Result<(), Refusal> {
    let sa = sock_addr(ctx);
    if !is_tcp(sa) {
        return Ok(());
    }
    let vip = unsafe { Endpoint::v4((*sa).user_ip4, port_from_user_port((*sa).user_port)) };
    let Some(choice) = select_backend(ctx, &vip)? else {
        return Ok(());
    };
    // A table of an IPv4 VIP only holds IPv4 backends; check anyway so a bad
    // write can never send a v4 socket to a v6 address.
    if choice.slot.target.family != FAMILY_V4 {
        return Ok(());
    }
    unsafe {
        (*sa).user_ip4 = choice.slot.target.addr_be[0];
        (*sa).user_port = user_port_from_port(choice.slot.target.port_be);
    }
    redirected(ctx, &vip, &choice);
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
    let Some(choice) = select_backend(ctx, &vip)? else {
        return Ok(());
    };
    let target = &choice.slot.target;
    if target.family != vip.family {
        return Ok(());
    }
    unsafe {
        if mapped {
            (*sa).user_ip6[0] = 0;
            (*sa).user_ip6[1] = 0;
            (*sa).user_ip6[2] = V4_MAPPED_WORD_BE;
            (*sa).user_ip6[3] = target.addr_be[0];
        } else {
            (*sa).user_ip6[0] = target.addr_be[0];
            (*sa).user_ip6[1] = target.addr_be[1];
            (*sa).user_ip6[2] = target.addr_be[2];
            (*sa).user_ip6[3] = target.addr_be[3];
        }
        (*sa).user_port = user_port_from_port(target.port_be);
    }
    redirected(ctx, &vip, &choice);
    Ok(())
}

/// Looks the VIP up and picks a backend slot. `Ok(None)`: not ours (or
/// handed back), proceed untouched.
#[inline(always)]
fn select_backend(ctx: &SockAddrContext, vip: &Endpoint) -> Result<Option<Choice>, Refusal> {
    if !vip_port(vip.port_be) {
        return Ok(None);
    }
    // SAFETY: the entry is copied out at once; the daemon replaces entries
    // with a fresh element (hash map update), never in place.
    let Some(entry) = (unsafe { SERVICES.get(vip) }).copied() else {
        return Ok(None);
    };
    let netns_cookie = if has(features::NETNS_COOKIE) {
        unsafe { bpf_get_netns_cookie(ctx.as_ptr()) }
    } else {
        0
    };
    if !netns_allowed(&entry, netns_cookie) || handed_back(&entry) {
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
    if let Some(other_index) = second_slot(&entry, || unsafe { bpf_get_prandom_u32() })
        && let Some(other) = SLOTS.get(other_index).copied()
        && second_is_less_loaded(
            live_connections(slot.backend_id),
            live_connections(other.backend_id),
        )
    {
        slot = other;
    }
    debug!(
        ctx,
        "socklb: table {} slot {} -> backend {}", entry.table_id, index, slot.backend_id
    );
    Ok(Some(Choice {
        slot,
        service_flags: entry.flags,
        netns_cookie,
    }))
}

/// Whether some VIP uses this port (`VIP_PORTS`): no VIP lookup otherwise.
#[inline(always)]
fn vip_port(port_be: u16) -> bool {
    let (word, mask) = vip_port_bit(port_be);
    VIP_PORTS.get(word).is_some_and(|bits| bits & mask != 0)
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
fn netns_allowed(entry: &ServiceEntry, netns_cookie: u64) -> bool {
    // Without the helper (or the daemon's cookie) namespaces cannot be told
    // apart; the daemon says so when it starts.
    if entry.flags & SERVICE_FLAG_ALL_NETNS != 0 || !has(features::NETNS_COOKIE) {
        return true;
    }
    let Some(settings) = SETTINGS.get(0) else {
        return false;
    };
    netns_cookie == settings.host_netns_cookie
}

/// Whether the service hands its VIPs back now: it asks to when its daemon
/// is gone, and the heartbeat is older than the table allows. Only such
/// services pay for the read and the clock.
#[inline(always)]
fn handed_back(entry: &ServiceEntry) -> bool {
    if entry.flags & SERVICE_FLAG_HAND_BACK == 0 {
        return false;
    }
    let Some(liveness) = LIVENESS.get(0) else {
        return false;
    };
    liveness.handed_back(entry.table_id, unsafe { bpf_ktime_get_boot_ns() })
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

/// What follows a rewrite: the backend's redirect count, counted only now
/// that the connect was rewritten, and the socket's record.
#[inline(always)]
fn redirected(ctx: &SockAddrContext, vip: &Endpoint, choice: &Choice) {
    if let Some(stats) = BACKEND_STATS.get_ptr_mut(choice.slot.backend_id) {
        // Per-CPU value: no other writer, a plain add is race free.
        unsafe { (*stats).redirects += 1 };
    }
    track(ctx, vip, choice);
}

/// Files the socket in the socket table and asks for its sock_ops
/// callbacks. A full table (or a socket that refuses the callbacks) leaves
/// the socket untracked: redirected all the same, counted, and shown as
/// its backend by getpeername.
#[inline(always)]
fn track(ctx: &SockAddrContext, vip: &Endpoint, choice: &Choice) {
    let flags = if choice.service_flags & SERVICE_FLAG_ACCELERATE != 0 {
        SOCKET_FLAG_ACCELERATE
    } else {
        0
    };
    let tracked = TrackedSocket {
        record: SocketRecord {
            vip: *vip,
            backend: choice.slot.target,
            backend_id: choice.slot.backend_id,
            flags,
        },
        netns_cookie: choice.netns_cookie,
    };
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // A socket connecting again after a failed attempt has the state
    // callbacks its first attempt asked for (or another program asked for
    // them: a needless removal from the hash then). Before Linux 6.12 the
    // flags cannot be read here, and any socket may have been filed.
    let callbacks = if has(features::CALLBACKS_AT_CONNECT) {
        callback_flags(ctx)
    } else {
        None
    };
    let filed_before = callbacks.is_none_or(|flags| flags & BPF_SOCK_OPS_STATE_CB_FLAG as i32 != 0);
    let Some(origin) = records::file(cookie, &tracked, filed_before) else {
        count_untracked();
        return;
    };
    if has(features::CALLBACKS_AT_CONNECT)
        && !callbacks.is_some_and(|flags| ask_for_callbacks(ctx, flags))
    {
        let _ = records::forget(cookie, origin);
        count_untracked();
    }
}

/// The socket's sock_ops callback flags, which connect4/6 read before
/// filing the socket (Linux 6.12).
#[inline(always)]
fn callback_flags(ctx: &SockAddrContext) -> Option<i32> {
    let mut flags: i32 = 0;
    let read = unsafe {
        bpf_getsockopt(
            ctx.as_ptr(),
            SOL_TCP,
            TCP_BPF_SOCK_OPS_CB_FLAGS,
            (&raw mut flags).cast(),
            size_of::<i32>() as i32,
        )
    };
    (read == 0).then_some(flags)
}

/// Asks for the socket's state changes (to see how it ends) and
/// retransmission timeouts (to see a SYN go unanswered), keeping any flag
/// another program set (`flags`, as `callback_flags` read them). Done
/// here, so that sock_ops need not look every connecting socket of the
/// cgroup up to find the redirected ones.
#[inline(always)]
fn ask_for_callbacks(ctx: &SockAddrContext, flags: i32) -> bool {
    let mut flags = flags | (BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG) as i32;
    let size = size_of::<i32>() as i32;
    let written = unsafe {
        bpf_setsockopt(
            ctx.as_ptr(),
            SOL_TCP,
            TCP_BPF_SOCK_OPS_CB_FLAGS,
            (&raw mut flags).cast(),
            size,
        )
    };
    written == 0
}

#[inline(always)]
fn count_untracked() {
    if let Some(stats) = SOCKET_TABLE_STATS.get_ptr_mut(0) {
        // Per-CPU value: no other writer, a plain add is race free.
        unsafe { (*stats).untracked += 1 };
    }
}
