//! The daemon's care of the kernel's socket table: the sweep of records
//! whose socket is gone, counted as repairs, and one WARN per episode of a
//! full table (and one INFO when it has room again).

use std::{os::fd::AsFd, time::Instant};

use lb_common::{names, repair};
use tracing::{info, warn};

use crate::{
    dataplane::{
        MapStore, Running,
        socket_table::{FullEvent, FullWatch, Sweeper},
        sys,
    },
    errors,
};

/// Checks of the untracked count: about once a second (every other tick).
const WATCH_EVERY_TICKS: u32 = 2;

#[derive(Debug, Default)]
pub struct SocketTableCare {
    sweeper: Sweeper,
    watch: FullWatch,
    ticks: u32,
}

impl SocketTableCare {
    /// One turn of the loop. Returns the records swept, for the repair
    /// counters.
    pub fn tend(&mut self, running: &mut Running) -> u64 {
        self.ticks = self.ticks.wrapping_add(1);
        if self.ticks.is_multiple_of(WATCH_EVERY_TICKS) {
            self.watch_untracked(running);
        }
        let now = Instant::now();
        if !self.sweeper.due(now) {
            return 0;
        }
        self.sweep(running)
    }

    /// A link was repaired: closes may have gone unseen while it was
    /// gone, so the next pass comes soon.
    pub fn sweep_soon(&mut self) {
        self.sweeper.soon(Instant::now());
    }

    fn watch_untracked(&mut self, running: &Running) {
        let Ok((capacity, untracked)) = running.maps.socket_table_untracked() else {
            return;
        };
        match self.watch.observe(capacity, untracked, Instant::now()) {
            Some(FullEvent::Began {
                capacity,
                untracked_before,
            }) => warn!(
                "the socket table is full ({capacity} sockets at most): new connects are redirected untracked (getpeername shows them their backend, least-conn does not count them); raise socket-table-size ({untracked_before} untracked before this)"
            ),
            Some(FullEvent::Ended {
                untracked_in_episode,
            }) => info!(
                "the socket table has room again; {untracked_in_episode} connects went untracked while it was full"
            ),
            None => {}
        }
    }

    fn sweep(&mut self, running: &mut Running) -> u64 {
        let host_netns = running
            .maps
            .settings()
            .map_or(0, |settings| settings.host_netns_cookie);
        let uncounter = crate::dataplane::object::program_fd(&running.ebpf, names::UNCOUNT).ok();
        let uncount = |backend_id: u32| {
            let Some(program) = uncounter.as_ref() else {
                return false;
            };
            let mut input = [0u8; 14];
            input[..4].copy_from_slice(&backend_id.to_ne_bytes());
            sys::prog_test_run(program.as_fd(), &input).is_ok_and(|verdict| verdict == 2)
        };
        let swept = tokio::task::block_in_place(|| {
            self.sweeper.pass(
                &mut running.maps,
                host_netns,
                crate::sockets::retain_gone,
                uncount,
            )
        });
        match swept {
            Ok(swept) if swept.forgotten > 0 => {
                // Per backend id, so that the line stays short however many.
                let mut by_backend: std::collections::BTreeMap<u32, usize> =
                    std::collections::BTreeMap::new();
                for id in &swept.uncounted {
                    *by_backend.entry(*id).or_default() += 1;
                }
                warn!(
                    "socket table: removed {} records of sockets that are gone (a close the kernel programs did not see; {} were counted live and were taken off their backend's count, by backend id: {:?})",
                    swept.forgotten,
                    swept.uncounted.len(),
                    by_backend
                );
                swept.forgotten
            }
            Ok(_) => 0,
            Err(error) => {
                warn!("socket table sweep: {}", errors::chain(&error));
                0
            }
        }
    }
}

/// The repair kind the sweep counts under.
pub const SWEPT: usize = repair::SOCKET_RECORDS;
