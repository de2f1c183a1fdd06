//! sock_ops: counts the live connections of each backend, reports connects
//! that the server side failed (a reset, or an unanswered SYN), takes a
//! socket's record away when it closes, and pairs accelerated sockets.
//!
//! The kernel runs this program for every TCP socket of the cgroup, at
//! several points of each connection (timeout and window init, ECN,
//! connect, established), whether socklb redirected it or not. It looks at
//! the operation first and returns at once for every other socket: only a
//! redirected socket asked for state changes and retransmission timeouts,
//! and at ACTIVE_ESTABLISHED its callback flags tell it apart before any
//! lookup. Per redirected connection: one lookup when it establishes, one
//! lookup and one removal when it closes.

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_RTO_CB, BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB,
        BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB, bpf_sock_ops,
    },
    macros::sock_ops,
    programs::SockOpsContext,
};
use lb_common::{
    BackendConns, ConnectFailure, EVIDENCE_RESET, EVIDENCE_SYN_TIMEOUT, SOCKET_FLAG_ACCELERATE,
    SOCKET_FLAG_LIVE, features,
};

use crate::{
    TCP_CLOSE, TCP_SYN_SENT, add_i64, add_u64, has,
    maps::{BACKEND_CONNS, CONNECT_FAILURES, LEGACY_REDIRECTS},
    records::{self, Found, ORIGIN_SLOT, ORIGIN_STORAGE, ORIGIN_TABLE},
    sk_msg,
};

#[sock_ops]
pub fn socklb_sockops(ctx: SockOpsContext) -> u32 {
    sock_ops(&ctx);
    // sock_ops verdicts are ignored for these callbacks; 1 is "ok".
    1
}

fn sock_ops(ctx: &SockOpsContext) {
    match ctx.op() {
        BPF_SOCK_OPS_STATE_CB => {
            if ctx.arg(1) == TCP_CLOSE {
                closed(ctx);
            }
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            // A socket socklb follows asked for state changes; one that
            // did not is not ours, and needs no lookup.
            if ctx.cb_flags() & BPF_SOCK_OPS_STATE_CB_FLAG != 0 {
                established(ctx);
            }
        }
        BPF_SOCK_OPS_RTO_CB => retransmitted(ctx),
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            // Needed where connect4/6 cannot ask for the callbacks, and for
            // sockets an older layout redirected (its connect did not ask).
            if !has(features::CALLBACKS_AT_CONNECT)
                || has(features::LEGACY_STORAGE)
                || has(features::LEGACY_LRU)
            {
                connecting(ctx);
            }
        }
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => {
            if has(features::SOCKMAP) {
                sk_msg::pair_backend_side(ctx);
            }
        }
        _ => {}
    }
}

/// One field of the sock_ops context. The verifier allows 4-byte reads of
/// these fields for full sockets, which every callback used here has.
#[inline(always)]
fn sock_ops_field(ctx: &SockOpsContext, read: impl Fn(&bpf_sock_ops) -> u32) -> u32 {
    // SAFETY: the kernel hands a valid context for the program's lifetime.
    read(unsafe { &*ctx.ops })
}

/// At TCP_CONNECT_CB, where connect4/6 did not: asks for state changes of
/// a socket socklb redirected, to see how it ends, and for retransmission
/// timeouts, to see a SYN go unanswered.
#[inline(always)]
fn connecting(ctx: &SockOpsContext) {
    if records::for_sock_ops(ctx).is_none() {
        return;
    }
    let flags = ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG;
    let _ = ctx.set_cb_flags(flags as i32);
}

#[inline(always)]
fn established(ctx: &SockOpsContext) {
    let Some(found) = records::for_sock_ops(ctx) else {
        return;
    };
    let Some(conns) = BACKEND_CONNS.get_ptr_mut(found.backend_id()) else {
        return;
    };
    unsafe {
        add_i64(&raw mut (*conns).live, 1);
        core::ptr::write_volatile(&raw mut (*conns).consecutive_failures, 0);
    }
    let flags = found.flags();
    found.set_flags(flags | SOCKET_FLAG_LIVE);
    if has(features::SOCKMAP) && flags & SOCKET_FLAG_ACCELERATE != 0 {
        // SAFETY: the record lives while this socket does.
        sk_msg::pair_client_side(ctx, unsafe { &(*found.record).backend });
    }
    // An established connection's timeouts say nothing about the server's
    // health here; stop the RTO callbacks.
    let flags = (ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) & !BPF_SOCK_OPS_RTO_CB_FLAG;
    let _ = ctx.set_cb_flags(flags as i32);
}

/// A retransmission timeout: the first one of a SYN is evidence that the
/// server did not answer.
#[inline(always)]
fn retransmitted(ctx: &SockOpsContext) {
    // Only the first timeout of a SYN: arg 0 is the number of
    // retransmissions so far. Later ones would count one connect many
    // times.
    if sock_ops_field(ctx, |ops| ops.state) != TCP_SYN_SENT || ctx.arg(0) != 0 {
        return;
    }
    let Some(found) = records::for_sock_ops(ctx) else {
        return;
    };
    let backend_id = found.backend_id();
    if let Some(conns) = BACKEND_CONNS.get_ptr_mut(backend_id) {
        report_failure(conns, backend_id, EVIDENCE_SYN_TIMEOUT);
    }
}

/// The socket reached TCP_CLOSE: its record goes, its count falls if it was
/// counted, and a connect the server reset is reported.
#[inline(always)]
fn closed(ctx: &SockOpsContext) {
    let Some(found) = records::for_sock_ops(ctx) else {
        // A socket without a record that sock_ops follows is a paired
        // backend socket (see `pair_backend_side`).
        if has(features::SOCKMAP) {
            sk_msg::forget_accelerated(ctx);
        }
        return;
    };
    let (backend_id, flags) = (found.backend_id(), found.flags());
    if has(features::SOCKMAP) && flags & SOCKET_FLAG_ACCELERATE != 0 {
        sk_msg::forget_accelerated(ctx);
    }
    let old_state = ctx.arg(0);
    let Some(counted) = take_away(&found, flags, old_state) else {
        return;
    };
    let Some(conns) = BACKEND_CONNS.get_ptr_mut(backend_id) else {
        return;
    };
    if counted {
        unsafe { add_i64(&raw mut (*conns).live, -1) };
    } else if old_state == TCP_SYN_SENT {
        // A socket that never established received a segment only if the
        // server reset it. No segment and no retransmission means the local
        // application closed its own connect, which never counts against a
        // backend. A SYN that was retransmitted was reported by its RTO
        // callback already.
        let segments_in = sock_ops_field(ctx, |ops| ops.segs_in);
        let retransmits = sock_ops_field(ctx, |ops| ops.total_retrans);
        if segments_in > 0 && retransmits == 0 {
            report_failure(conns, backend_id, EVIDENCE_RESET);
        }
    }
}

/// Takes a closed socket's record away. Returns whether the socket counted
/// as live (so its end takes one away), or None when another program took
/// the record first and counted the end itself.
#[inline(always)]
fn take_away(found: &Found, flags: u32, old_state: u32) -> Option<bool> {
    match found.origin {
        ORIGIN_TABLE | ORIGIN_SLOT => {
            records::forget(found.cookie, found.origin).then_some(flags & SOCKET_FLAG_LIVE != 0)
        }
        ORIGIN_STORAGE => {
            // The storage goes with the socket; the flag keeps a second
            // close (CLOSE to CLOSE) from counting twice.
            found.set_flags(flags & !SOCKET_FLAG_LIVE);
            Some(flags & SOCKET_FLAG_LIVE != 0)
        }
        _ => {
            let _ = LEGACY_REDIRECTS.remove(found.cookie);
            // The first layout counted every record that got past SYN_SENT.
            Some(old_state != TCP_SYN_SENT)
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
