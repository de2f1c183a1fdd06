//! sk_msg, and the pairing of accelerated sockets that sock_ops does for
//! it (services with `accelerate = "sockmap"`).
//!
//! sock_ops puts both ends of a redirected connection to a local backend
//! into the SOCKHASH: the client's when it establishes, the backend's
//! accepted socket when it does. The sk_msg program then moves each
//! message straight into the peer's receive queue. A message that cannot
//! be redirected takes the normal path; none is ever dropped.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_INGRESS, BPF_SOCK_OPS_STATE_CB_FLAG},
    helpers::generated::bpf_get_netns_cookie,
    macros::sk_msg,
    programs::{SkMsgContext, SockOpsContext},
};
use lb_common::{Endpoint, SockKey, features};

use crate::{
    V4_MAPPED_WORD_BE, has,
    maps::{ACCEL, ACCEL_PENDING, PASSED, SOCKHASH},
};

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
pub fn pair_client_side(ctx: &SockOpsContext, backend: &Endpoint) {
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
pub fn pair_backend_side(ctx: &SockOpsContext) {
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
pub fn forget_accelerated(ctx: &SockOpsContext) {
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
