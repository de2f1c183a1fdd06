//! socklb's kernel side: cgroup connect hooks that send a VIP's connects to a
//! backend picked from a table the daemon keeps, and getpeername hooks that
//! show the application the VIP it asked for. A sock_ops program counts the
//! connections of each backend and reports connects that the server side
//! failed (a reset, or an unanswered SYN), never one the client abandoned.
//!
//! Each redirected socket has a record in the socket table: on Linux 5.12
//! and later an array of slots claimed by socket cookie with a
//! compare-and-exchange (`lb_socktab_v2`), with a preallocated hash keyed
//! by cookie (`lb_socktab_v1`) for the sockets whose few slots are taken;
//! on older kernels the hash alone (this crate built without the `slots`
//! feature; the loader picks the object). Nothing is allocated on connect,
//! and no local user can grow the memory behind it. connect4/6 file the
//! record and ask for the socket's sock_ops callbacks; sock_ops takes the
//! record away when the socket reaches TCP_CLOSE, and cgroup/sock_release
//! takes it away for a socket that never got that far (a connect that
//! failed before its SYN). A connect to a port no VIP uses costs connect4/6 one array
//! read (`lb_vports_v1`); every other socket of the cgroup costs sock_ops
//! one look at the operation, and sock_release one at the socket's state.
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
//!
//! One module per program, plus the maps they share and the socket
//! records they read.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// The bpf target has no atomic types with read-modify-write methods; the
// intrinsics lower to BPF's atomic add (`add_i64`) and, in the array
// layout, its compare-and-exchange (`records::slots::swap_owner`).
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

mod connect;
mod getpeername;
mod maps;
mod records;
mod release;
mod sk_msg;
mod sock_ops;
mod uncount;

use lb_common::features;

/// `lb_common::features` bits the kernel offers and the install needs, set
/// by the loader (the name is `lb_common::names::globals::FEATURES`).
/// Read-only data: the verifier removes the branches of features that are
/// off, helper calls included.
#[unsafe(no_mangle)]
static SOCKLB_FEATURES: u32 = features::ALL;

/// The array layout's slot count less one, set by the loader (the name is
/// `lb_common::names::globals::SLOT_MASK`).
#[cfg(feature = "slots")]
#[unsafe(no_mangle)]
static SOCKLB_SLOT_MASK: u32 =
    lb_common::socket_slots_for(lb_common::DEFAULT_SOCKET_TABLE_SIZE) - 1;

#[cfg(feature = "slots")]
#[inline(always)]
fn slot_mask() -> u32 {
    unsafe { core::ptr::read_volatile(&raw const SOCKLB_SLOT_MASK) }
}

#[inline(always)]
fn has(feature: u32) -> bool {
    // A volatile read, so the compiler keeps the load the loader patches.
    unsafe { core::ptr::read_volatile(&raw const SOCKLB_FEATURES) & feature != 0 }
}

/// TCP states, as in include/net/tcp_states.h.
const TCP_SYN_SENT: u32 = 2;
const TCP_CLOSE: u32 = 7;
const IPPROTO_TCP: u32 = 6;
/// `::ffff:0:0/96` in network byte order, word 2 of an IPv4-mapped address.
const V4_MAPPED_WORD_BE: u32 = 0xffff_u32.to_be();

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
