//! socklb_uncount: takes one connection off a backend's live count, with
//! the same atomic add sock_ops uses. Never attached: the daemon's sweep
//! runs it (BPF_PROG_TEST_RUN) for a record it removed whose socket was
//! gone while still counted live, which happens only if another program
//! turned off the socket's state callbacks. Userspace cannot add to a map
//! value atomically; this program can.
//!
//! Its input is the test run's packet: the backend id, a native-endian
//! u32 at offset 0 (of at least 14 bytes, as the kernel demands of a run
//! of an XDP program).

use aya_ebpf::{macros::xdp, programs::XdpContext};

use crate::{add_i64, maps::BACKEND_CONNS};

/// What the run returns: the count was taken down, or the input was not
/// a backend id.
const UNCOUNTED: u32 = 2;
const REFUSED: u32 = 0;

#[xdp]
pub fn socklb_uncount(ctx: XdpContext) -> u32 {
    match uncount(&ctx) {
        Some(()) => UNCOUNTED,
        None => REFUSED,
    }
}

fn uncount(ctx: &XdpContext) -> Option<()> {
    let (start, end) = (ctx.data(), ctx.data_end());
    // The verifier allows a packet read only after this bounds check.
    if start + size_of::<u32>() > end {
        return None;
    }
    // SAFETY: four bytes inside the packet, checked above.
    let backend_id = unsafe { core::ptr::read_unaligned(start as *const u32) };
    let conns = BACKEND_CONNS.get_ptr_mut(backend_id)?;
    unsafe { add_i64(&raw mut (*conns).live, -1) };
    Some(())
}
