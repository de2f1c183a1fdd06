//! The socket table of the array layout (`lb_socktab_v2`), mapped into the
//! daemon's memory: the sweep and status read its slots in place, and the
//! sweep frees a slot with the same compare-and-exchange of its cookie as
//! the kernel's programs, so that exactly one of them ends each record.
//!
//! A socket's slots are `cookie & mask` and the next
//! `SOCKET_SLOT_PROBES - 1` (see `lb_common::SocketSlot`).

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
};

use lb_common::{SOCKET_SLOT_PROBES, SocketSlot, TrackedSocket};

/// The array, mapped shared and writable (`BPF_F_MMAPABLE`).
pub struct SlotTable {
    base: NonNull<SocketSlot>,
    slots: u32,
    bytes: usize,
}

// SAFETY: the mapping is plain shared memory; every access to a slot's
// cookie is atomic, and records are copied out, never referenced.
unsafe impl Send for SlotTable {}
unsafe impl Sync for SlotTable {}

impl SlotTable {
    /// Maps the array behind `fd`, which has `slots` elements (a power of
    /// two, as the loader made it).
    pub fn map(fd: BorrowedFd<'_>, slots: u32) -> io::Result<Self> {
        if !slots.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{slots} slots, not a power of two"),
            ));
        }
        let bytes = slots as usize * size_of::<SocketSlot>();
        // SAFETY: a new shared mapping of the map's pages; the kernel
        // checks the length against the map and refuses a map that is not
        // mmapable.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(address.cast::<SocketSlot>())
            .ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self { base, slots, bytes })
    }

    /// Slots in the array.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    fn slot(&self, index: u64) -> *mut SocketSlot {
        let index = (index & u64::from(self.slots - 1)) as usize;
        // SAFETY: masked into the mapping.
        unsafe { self.base.as_ptr().add(index) }
    }

    /// The owner of a slot of this table.
    fn owner(&self, slot: *mut SocketSlot) -> &AtomicU64 {
        // SAFETY: an aligned u64 in the mapping, which lives as long as
        // `self`; the kernel's programs change it only atomically.
        unsafe { AtomicU64::from_ptr(&raw mut (*slot).cookie) }
    }

    /// Every record, by cookie. A record being written as it is read may
    /// come out torn; the sweep only ends records whose socket two dumps
    /// in a row did not find, so a torn read costs at most a pass.
    pub fn records(&self) -> Vec<(u64, TrackedSocket)> {
        let mut records = Vec::new();
        for index in 0..u64::from(self.slots) {
            let slot = self.slot(index);
            let cookie = self.owner(slot).load(Ordering::Acquire);
            if cookie != 0 {
                // SAFETY: inside the mapping; a plain copy of plain data.
                let tracked = unsafe { std::ptr::read_volatile(&raw const (*slot).tracked) };
                records.push((cookie, tracked));
            }
        }
        records
    }

    /// Slots taken, counted in place (status and metrics ask often).
    pub fn count(&self) -> u64 {
        (0..u64::from(self.slots))
            .filter(|index| self.owner(self.slot(*index)).load(Ordering::Relaxed) != 0)
            .count() as u64
    }

    /// The slot the socket with this cookie owns.
    fn owned(&self, cookie: u64) -> Option<*mut SocketSlot> {
        (0..SOCKET_SLOT_PROBES)
            .map(|probe| self.slot(cookie.wrapping_add(probe)))
            .find(|slot| self.owner(*slot).load(Ordering::Acquire) == cookie)
    }

    /// The record of the socket with this cookie.
    pub fn get(&self, cookie: u64) -> Option<TrackedSocket> {
        if cookie == 0 {
            return None;
        }
        let slot = self.owned(cookie)?;
        // SAFETY: inside the mapping; a plain copy of plain data.
        Some(unsafe { std::ptr::read_volatile(&raw const (*slot).tracked) })
    }

    /// Frees the slot of the socket with this cookie if its record still
    /// reads `read`: `Some(true)` when this call freed it (and may take its
    /// connection off the live count, by what `read` says), `Some(false)`
    /// when the slot stays, `None` when no slot holds the cookie.
    ///
    /// A record that changed since it was read belongs to a socket that
    /// connected again meanwhile, alive: it is left, and the decision on
    /// its count is never made from a stale copy. What is left unguarded is
    /// the moment between this read and the compare-and-exchange.
    pub fn forget_if(&self, cookie: u64, read: &TrackedSocket) -> Option<bool> {
        if cookie == 0 {
            return None;
        }
        let slot = self.owned(cookie)?;
        // SAFETY: inside the mapping; a plain copy of plain data.
        let now = unsafe { std::ptr::read_volatile(&raw const (*slot).tracked) };
        Some(
            now == *read
                && self
                    .owner(slot)
                    .compare_exchange(cookie, 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok(),
        )
    }
}

impl Drop for SlotTable {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table over ordinary memory, to test the probing.
    fn table(memory: &mut [SocketSlot]) -> std::mem::ManuallyDrop<SlotTable> {
        std::mem::ManuallyDrop::new(SlotTable {
            base: NonNull::new(memory.as_mut_ptr()).expect("not null"),
            slots: memory.len() as u32,
            bytes: 0,
        })
    }

    fn tracked(backend_id: u32) -> TrackedSocket {
        let mut tracked = TrackedSocket::default();
        tracked.record.backend_id = backend_id;
        tracked
    }

    #[test]
    fn a_socket_is_found_in_any_of_its_slots_and_freed_once() {
        let mut memory = vec![SocketSlot::default(); 16];
        // Cookie 14's slots are 14, 15, 0 and 1 (wrapping); 14 and 15 are
        // another socket's.
        memory[14] = SocketSlot {
            cookie: 30,
            tracked: tracked(1),
        };
        memory[15] = SocketSlot {
            cookie: 31,
            tracked: tracked(2),
        };
        memory[0] = SocketSlot {
            cookie: 14,
            tracked: tracked(3),
        };
        let table = table(&mut memory);
        assert_eq!(table.get(14).map(|t| t.record.backend_id), Some(3));
        assert_eq!(table.get(30).map(|t| t.record.backend_id), Some(1));
        assert_eq!(table.get(46), None, "46 has slots 14 to 1, none its own");
        assert_eq!(table.records().len(), 3);
        assert_eq!(table.count(), 3);
        assert_eq!(
            table.forget_if(14, &tracked(4)),
            Some(false),
            "a record that changed since it was read stays"
        );
        assert_eq!(table.forget_if(14, &tracked(3)), Some(true));
        assert_eq!(
            table.forget_if(14, &tracked(3)),
            None,
            "a second forget finds nothing"
        );
        assert_eq!(table.get(14), None);
        assert_eq!(
            table.forget_if(0, &TrackedSocket::default()),
            None,
            "cookie 0 marks a free slot"
        );
        assert_eq!(table.records().len(), 2);
    }

    #[test]
    fn only_a_power_of_two_is_mapped() {
        let fd = std::fs::File::open("/dev/null").expect("opens");
        let error = SlotTable::map(std::os::fd::AsFd::as_fd(&fd), 12)
            .err()
            .expect("12 slots are refused");
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    }
}
