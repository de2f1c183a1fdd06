//! The choice a connect makes, written once for both sides: the eBPF
//! program calls these functions, and unit tests run them on the host.

use crate::{
    MAX_TABLES, SERVICE_FLAG_LEAST_CONN, SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY, SLOTS_PER_BANK,
    SLOTS_PER_LIST, SLOTS_PER_TABLE, ServiceEntry,
};

/// What a connect to a VIP does, decided from its service entry and one
/// random number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotChoice {
    /// Use the slot at this index of `SLOTS`, from the healthy list.
    Healthy(u32),
    /// No backend is healthy; fail open to this slot of the all list.
    FailOpen(u32),
    /// No backend is healthy and the policy refuses the connect.
    Reject,
    /// The service has no backend at all; leave the connect alone.
    Empty,
}

/// Whether the entry's bank and counts lie inside its own table. A
/// corrupted or tampered entry is treated as empty, so it can never reach
/// another table's slots.
#[inline(always)]
fn is_sound(entry: &ServiceEntry) -> bool {
    let own_bank = entry.bank_base == bank_base(entry.table_id, 0)
        || entry.bank_base == bank_base(entry.table_id, 1);
    own_bank
        && entry.table_id < MAX_TABLES
        && entry.healthy_slots <= SLOTS_PER_LIST
        && entry.all_slots <= SLOTS_PER_LIST
}

/// Picks a slot for one connect. O(1), no loop, and a zero count is checked
/// before every modulo, which both the verifier and sanity require.
#[inline(always)]
pub fn choose_slot(entry: &ServiceEntry, random: u32) -> SlotChoice {
    if !is_sound(entry) {
        return SlotChoice::Empty;
    }
    if entry.healthy_slots != 0 {
        return SlotChoice::Healthy(entry.bank_base + random % entry.healthy_slots);
    }
    if entry.flags & SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY != 0 {
        return SlotChoice::Reject;
    }
    if entry.all_slots != 0 {
        return SlotChoice::FailOpen(entry.bank_base + SLOTS_PER_LIST + random % entry.all_slots);
    }
    SlotChoice::Empty
}

/// The second candidate of least-conn (power of two choices): another
/// random slot of the healthy list, when the policy asks for one and the
/// list has more than one slot. `random` is called only then: the other
/// policies pay for no second random number.
#[inline(always)]
pub fn second_slot(entry: &ServiceEntry, random: impl FnOnce() -> u32) -> Option<u32> {
    let wanted = entry.flags & SERVICE_FLAG_LEAST_CONN != 0 && entry.healthy_slots > 1;
    (wanted && is_sound(entry)).then(|| entry.bank_base + random() % entry.healthy_slots)
}

/// Power of two choices: whether the second of two candidates should win,
/// given their live connection counts (negative counts as zero). Ties go to
/// the first, which is itself a random pick.
#[inline(always)]
pub fn second_is_less_loaded(first_live: i64, second_live: i64) -> bool {
    let clamp = |live: i64| if live < 0 { 0 } else { live };
    clamp(second_live) < clamp(first_live)
}

/// The first `SLOTS` index of a bank (0 or 1) of a table.
pub const fn bank_base(table_id: u32, bank: u32) -> u32 {
    table_id * SLOTS_PER_TABLE + bank * SLOTS_PER_BANK
}

/// The port of a `bpf_sock_addr::user_port` word. The kernel fills the word
/// with the 16-bit `sin_port` zero-extended, so the port in network byte
/// order is the low 16 bits of the word's value on either byte order.
#[inline(always)]
pub const fn port_from_user_port(user_port: u32) -> u16 {
    (user_port & 0xffff) as u16
}

/// The `user_port` word for a port in network byte order (the inverse).
#[inline(always)]
pub const fn user_port_from_port(port_be: u16) -> u32 {
    port_be as u32
}
