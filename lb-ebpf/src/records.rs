//! Where the programs find what socklb knows of a socket: its record in
//! the socket table, by cookie; or, for a socket redirected before an
//! upgrade, the record an older layout kept (socket storage, or the first
//! layout's LRU). The older places are read only while the loader says an
//! upgrade left sockets there: otherwise the verifier removes those
//! branches.

use aya_ebpf::{
    EbpfContext,
    helpers::generated::{bpf_get_socket_cookie, bpf_sk_storage_get},
    programs::{SockAddrContext, SockOpsContext},
};
use lb_common::{Endpoint, SocketRecord, TrackedSocket, features};

use crate::{
    has,
    maps::{LEGACY_REDIRECTS, LEGACY_SOCKETS, SOCKET_TABLE},
};

/// `Found::origin`: the socket table's hash.
pub const ORIGIN_TABLE: u32 = 0;
/// `Found::origin`: a slot of the socket table's array.
pub const ORIGIN_SLOT: u32 = 3;
/// `Found::origin`: the previous layout's socket storage.
pub const ORIGIN_STORAGE: u32 = 1;
/// `Found::origin`: the first layout's LRU.
pub const ORIGIN_LRU: u32 = 2;

/// A socket's record as sock_ops finds it, in map memory, and where it
/// lives. Plain fields, each written on every path: the verifier refuses
/// a program that reads stack it never wrote unless it runs with
/// CAP_PERFMON, which the DaemonSet does not grant, and the compiler may
/// read both variants of an enum before choosing one.
pub struct Found {
    /// The record, read in place: valid while the socket lives (only its
    /// own callbacks and its release take a table record away), and never
    /// read after this program takes it away.
    pub record: *mut SocketRecord,
    /// `ORIGIN_*`. An LRU record is never updated in place.
    pub origin: u32,
    /// The socket's cookie (the key of the table and of the LRU).
    pub cookie: u64,
}

impl Found {
    #[inline(always)]
    pub fn backend_id(&self) -> u32 {
        unsafe { core::ptr::read_volatile(&raw const (*self.record).backend_id) }
    }

    #[inline(always)]
    pub fn flags(&self) -> u32 {
        unsafe { core::ptr::read_volatile(&raw const (*self.record).flags) }
    }

    /// Sets (or clears) flags of a table or storage record.
    #[inline(always)]
    pub fn set_flags(&self, flags: u32) {
        if self.origin != ORIGIN_LRU {
            unsafe { core::ptr::write_volatile(&raw mut (*self.record).flags, flags) };
        }
    }
}

/// The socket table's record of a socket, and where it is
/// (`ORIGIN_SLOT` or `ORIGIN_TABLE`): in the array layout its slot, or
/// else the hash's record (a socket that found its slots taken, or one an
/// install of the hash layout filed before an upgrade).
#[inline(always)]
pub fn in_table(cookie: u64) -> Option<(*mut TrackedSocket, u32)> {
    #[cfg(feature = "slots")]
    if let Some(slot) = slots::owned(cookie) {
        return Some((unsafe { &raw mut (*slot).tracked }, ORIGIN_SLOT));
    }
    SOCKET_TABLE
        .get_ptr_mut(cookie)
        .map(|tracked| (tracked, ORIGIN_TABLE))
}

/// The socket table's record of a socket.
#[inline(always)]
pub fn tracked(cookie: u64) -> Option<*mut TrackedSocket> {
    in_table(cookie).map(|(tracked, _)| tracked)
}

/// Takes a socket's record out of the place `in_table` found it
/// (`origin`). True for the one caller that removed it: sock_ops,
/// sock_release and the daemon's sweep may all try, and only the one that
/// removed the record it read may take its connection off the live count.
#[inline(always)]
pub fn forget(cookie: u64, origin: u32) -> bool {
    #[cfg(feature = "slots")]
    if origin == ORIGIN_SLOT {
        return slots::owned(cookie).is_some_and(|slot| slots::swap_owner(slot, cookie, 0));
    }
    let _ = origin;
    SOCKET_TABLE.remove(cookie).is_ok()
}

/// Files a socket's record, and says where (`ORIGIN_SLOT` or
/// `ORIGIN_TABLE`); None when the table has no room for it: the hash is
/// full (and, in the array layout, the socket's slots are taken). A
/// socket that connects again after a failed attempt gets its record
/// replaced; `filed_before` says it may have one in the hash (where a
/// fresh slot would leave it behind).
#[inline(always)]
pub fn file(cookie: u64, tracked: &TrackedSocket, filed_before: bool) -> Option<u32> {
    #[cfg(feature = "slots")]
    if slots::file(cookie, tracked, filed_before) {
        if filed_before {
            let _ = SOCKET_TABLE.remove(cookie);
        }
        return Some(ORIGIN_SLOT);
    }
    let _ = filed_before;
    // BPF_ANY: replaces the record of a socket connecting again.
    const BPF_ANY: u64 = 0;
    SOCKET_TABLE
        .insert(cookie, *tracked, BPF_ANY)
        .is_ok()
        .then_some(ORIGIN_TABLE)
}

/// The array layout: a socket's slots are `cookie & mask` and the next
/// `SOCKET_SLOT_PROBES - 1`; the first whose cookie is 0 is claimed by an
/// atomic compare-and-exchange. Cookies are handed out in order, so the
/// sockets a CPU opens one after another take neighbouring slots, and a
/// socket finds its slots taken only when the cookies have gone once
/// round the array and met sockets still open (a run of long-lived ones):
/// it then takes the hash's slower path.
#[cfg(feature = "slots")]
mod slots {
    use lb_common::{SOCKET_SLOT_PROBES, SocketSlot, TrackedSocket};

    use crate::{maps::SOCKET_SLOTS, slot_mask};

    #[inline(always)]
    fn slot(cookie: u64, probe: u64) -> Option<*mut SocketSlot> {
        let index = (cookie.wrapping_add(probe) & u64::from(slot_mask())) as u32;
        SOCKET_SLOTS.get_ptr_mut(index)
    }

    #[inline(always)]
    fn owner(slot: *mut SocketSlot) -> u64 {
        unsafe { core::ptr::read_volatile(&raw const (*slot).cookie) }
    }

    /// Compare-and-exchange of a slot's owner (BPF_CMPXCHG, Linux 5.12).
    #[inline(always)]
    pub fn swap_owner(slot: *mut SocketSlot, from: u64, to: u64) -> bool {
        #[cfg(target_arch = "bpf")]
        unsafe {
            core::intrinsics::atomic_cxchg::<
                u64,
                { core::intrinsics::AtomicOrdering::SeqCst },
                { core::intrinsics::AtomicOrdering::SeqCst },
            >(&raw mut (*slot).cookie, from, to)
            .1
        }
        #[cfg(not(target_arch = "bpf"))]
        unsafe {
            let matches = (*slot).cookie == from;
            if matches {
                (*slot).cookie = to;
            }
            matches
        }
    }

    /// The slot a socket owns.
    #[inline(always)]
    pub fn owned(cookie: u64) -> Option<*mut SocketSlot> {
        for probe in 0..SOCKET_SLOT_PROBES {
            let slot = slot(cookie, probe)?;
            if owner(slot) == cookie {
                return Some(slot);
            }
        }
        None
    }

    /// Claims a free slot for the socket and writes the record into it.
    /// A socket connecting again (`filed_before`) gives its old slot back
    /// first: a record is only ever written into a slot this call claimed,
    /// never into one the daemon's sweep may have freed meanwhile. A
    /// socket never filed owns no slot, and skips the look.
    #[inline(always)]
    pub fn file(cookie: u64, tracked: &TrackedSocket, filed_before: bool) -> bool {
        if filed_before && let Some(old) = owned(cookie) {
            let _ = swap_owner(old, cookie, 0);
        }
        let mut claimed = None;
        for probe in 0..SOCKET_SLOT_PROBES {
            let Some(slot) = slot(cookie, probe) else {
                return false;
            };
            if owner(slot) == 0 && swap_owner(slot, 0, cookie) {
                claimed = Some(slot);
                break;
            }
        }
        let Some(slot) = claimed else {
            return false;
        };
        // Word by word: a struct assignment becomes a byte-by-byte memmove.
        let from = core::ptr::from_ref(tracked).cast::<u32>();
        let to = unsafe { (&raw mut (*slot).tracked).cast::<u32>() };
        for word in 0..size_of::<TrackedSocket>() / 4 {
            unsafe { core::ptr::write_volatile(to.add(word), core::ptr::read(from.add(word))) };
        }
        true
    }
}

/// The record of the socket of a sock_ops callback.
#[inline(always)]
pub fn for_sock_ops(ctx: &SockOpsContext) -> Option<Found> {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some((tracked, origin)) = in_table(cookie) {
        return Some(Found {
            record: unsafe { &raw mut (*tracked).record },
            origin,
            cookie,
        });
    }
    if has(features::LEGACY_STORAGE)
        && let Some(stored) = stored_for_sock_ops(ctx)
    {
        return Some(Found {
            record: stored,
            origin: ORIGIN_STORAGE,
            cookie,
        });
    }
    if has(features::LEGACY_LRU) {
        let record = LEGACY_REDIRECTS.get_ptr_mut(cookie)?;
        return Some(Found {
            record,
            origin: ORIGIN_LRU,
            cookie,
        });
    }
    None
}

/// The previous layout's socket-storage record of a sock_ops socket.
#[inline(always)]
fn stored_for_sock_ops(ctx: &SockOpsContext) -> Option<*mut SocketRecord> {
    // SAFETY: `sk` of a full socket (null otherwise, which the helper takes).
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        return None;
    }
    let map = core::ptr::from_ref(&LEGACY_SOCKETS).cast_mut().cast();
    let stored = unsafe { bpf_sk_storage_get(map, sk.cast(), core::ptr::null_mut(), 0) }
        .cast::<SocketRecord>();
    (!stored.is_null()).then_some(stored)
}

/// The VIP that a getpeername of this socket shows, if socklb redirected
/// it and its peer is still the backend it was sent to (a socket that
/// reconnected elsewhere is shown as it is). Compared and read in place.
#[inline(always)]
pub fn vip_for_peer(ctx: &SockAddrContext, peer: &Endpoint) -> Option<Endpoint> {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some(tracked) = tracked(cookie) {
        // SAFETY: a value of the table, alive while this socket is.
        let record = unsafe { &(*tracked).record };
        return (record.backend == *peer).then_some(record.vip);
    }
    if has(features::LEGACY_STORAGE) {
        let stored = unsafe { LEGACY_SOCKETS.get_ptr_mut(ctx) };
        if !stored.is_null() {
            let record = unsafe { &*stored };
            return (record.backend == *peer).then_some(record.vip);
        }
    }
    if has(features::LEGACY_LRU) {
        let record = unsafe { LEGACY_REDIRECTS.get(cookie) }?;
        return (record.backend == *peer).then_some(record.vip);
    }
    None
}
