//! cgroup/sock_release: takes away the record of a socket that is released
//! without ever reaching TCP_CLOSE under sock_ops' eyes: a connect that
//! failed before its SYN left (no route, no local port), where sock_ops
//! never saw a state change. Every other socket is followed to TCP_CLOSE
//! by sock_ops, which removes its record there.
//!
//! The hook runs for every socket of the cgroup that is released, TCP or
//! not; it returns after two reads of the socket unless it is a TCP socket
//! already in TCP_CLOSE. It runs before the protocol's close, without the
//! socket's lock: a socket whose state is TCP_CLOSE here has had its last
//! state callback (the kernel stores the state after that callback).

use aya_ebpf::{
    EbpfContext, helpers::generated::bpf_get_socket_cookie, macros::cgroup_sock,
    programs::SockContext,
};
use lb_common::SOCKET_FLAG_LIVE;

use crate::{IPPROTO_TCP, TCP_CLOSE, add_i64, maps::BACKEND_CONNS, records};

const PROCEED: i32 = 1;

#[cgroup_sock(sock_release)]
pub fn socklb_release(ctx: SockContext) -> i32 {
    released(&ctx);
    PROCEED
}

fn released(ctx: &SockContext) {
    // SAFETY: the context the kernel hands; 4-byte reads of its fields.
    let (protocol, state) = unsafe { ((*ctx.sock).protocol, (*ctx.sock).state) };
    if protocol != IPPROTO_TCP || state != TCP_CLOSE {
        return;
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let Some((tracked, origin)) = records::in_table(cookie) else {
        return;
    };
    // SAFETY: read before the removal below gives the element back.
    let (backend_id, flags) = unsafe { ((*tracked).record.backend_id, (*tracked).record.flags) };
    if !records::forget(cookie, origin) || flags & SOCKET_FLAG_LIVE == 0 {
        return;
    }
    // A live socket whose close no state callback reported (another
    // program cleared its flags): its end is counted here.
    if let Some(conns) = BACKEND_CONNS.get_ptr_mut(backend_id) {
        unsafe { add_i64(&raw mut (*conns).live, -1) };
    }
}
