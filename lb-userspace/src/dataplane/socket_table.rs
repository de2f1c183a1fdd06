//! The socket table seen from userspace: its size and kernel memory, the
//! sweep that drops the records of sockets that are gone, and the watch
//! that says once per episode that it is full.
//!
//! The kernel's programs take a record away when its socket reaches
//! TCP_CLOSE (sock_ops) or is released without getting there
//! (sock_release). The sweep is the net under those two: a record whose
//! socket no longer exists would otherwise hold its slot until the table
//! is full. A socket counts as gone when two dumps of this network
//! namespace's TCP sockets, one sweep interval apart, both lack it. Records
//! of sockets in other namespaces (services with `all-netns`) are left to
//! the kernel: the dump cannot see them.

use std::{
    collections::HashSet,
    io,
    net::SocketAddr,
    os::fd::{AsRawFd, BorrowedFd},
    time::{Duration, Instant},
};

use lb_common::{SOCKET_FLAG_LIVE, TrackedSocket};

use super::{MapStore, StoreError};

/// How often the daemon sweeps the socket table.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// A pass comes this soon (or at the interval, if that is shorter) after
/// a start, after a repaired link, and to confirm what a pass suspected:
/// closes the programs missed (a detached sock_ops link, a daemon that was
/// away) are off the counts within seconds, not a minute of two passes.
pub const SWEEP_SOON: Duration = Duration::from_secs(2);

/// Test-only: the sweep interval in milliseconds, so that a test sees two
/// passes in seconds. Never set in production.
pub const SWEEP_INTERVAL_FOR_TEST: &str = "SOCKLB_TEST_SWEEP_INTERVAL_MS";

/// A map's size and memory, as the kernel reports them in the fdinfo of a
/// descriptor of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapFdInfo {
    pub max_entries: u32,
    /// Bytes of kernel memory the map takes (`memlock`: since Linux 6.4
    /// what the map's own accounting says it uses).
    pub memlock: u64,
}

/// Reads `/proc/self/fdinfo/<fd>` of a map descriptor.
pub fn map_fdinfo(fd: BorrowedFd<'_>) -> io::Result<MapFdInfo> {
    let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))?;
    parse_fdinfo(&text).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "no max_entries or memlock in the map's fdinfo",
        )
    })
}

fn parse_fdinfo(text: &str) -> Option<MapFdInfo> {
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|value| value.trim().parse::<u64>().ok())
    };
    Some(MapFdInfo {
        max_entries: u32::try_from(field("max_entries")?).ok()?,
        memlock: field("memlock")?,
    })
}

/// What one pass of the sweep decided, from the table's records and the
/// sockets gone now.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SweepPlan {
    /// Records whose socket was missing from this dump and the previous
    /// one: to remove.
    pub forget: Vec<(u64, TrackedSocket)>,
    /// Records whose socket was missing from this dump only: to check
    /// again next pass.
    pub suspects: HashSet<u64>,
}

/// The cookies of the records a dump of this namespace can check: records
/// of sockets in other namespaces are left alone (and without a namespace
/// cookie, on an old kernel, none can be told to be of this one).
pub fn checkable(records: &[(u64, TrackedSocket)], host_netns_cookie: u64) -> HashSet<u64> {
    records
        .iter()
        .filter(|(_, tracked)| host_netns_cookie != 0 && tracked.netns_cookie == host_netns_cookie)
        .map(|(cookie, _)| *cookie)
        .collect()
}

/// Where the checkable records' sockets are connected, each address once,
/// so that the dump asks the kernel only for sockets to those (a local
/// user's thousands of other sockets cost the sweep nothing). None when
/// there are more than a filter should hold, or a record's backend is not
/// an address: the dump then takes every socket.
pub fn backends_of(
    records: &[(u64, TrackedSocket)],
    checkable: &HashSet<u64>,
) -> Option<Vec<SocketAddr>> {
    let mut backends: Vec<SocketAddr> = Vec::new();
    for (_, tracked) in records
        .iter()
        .filter(|(cookie, _)| checkable.contains(cookie))
    {
        let backend = crate::convert::socket_addr(&tracked.record.backend)?;
        if !backends.contains(&backend) {
            if backends.len() == MAX_FILTERED_BACKENDS {
                return None;
            }
            backends.push(backend);
        }
    }
    Some(backends)
}

/// The most backends the sweep's dump filters on: one condition each, 32
/// bytes at most, well inside a netlink attribute.
const MAX_FILTERED_BACKENDS: usize = 256;

/// Decides one pass (pure). `gone` holds the checkable cookies that the
/// dump, made after `records` were read, did not see: a socket that
/// connects in between is missing from the dump at worst once, and becomes
/// a suspect that the next pass clears.
pub fn plan_sweep(
    records: &[(u64, TrackedSocket)],
    gone: &HashSet<u64>,
    suspects: &HashSet<u64>,
) -> SweepPlan {
    let mut plan = SweepPlan::default();
    for (cookie, tracked) in records.iter().filter(|(cookie, _)| gone.contains(cookie)) {
        if suspects.contains(cookie) {
            plan.forget.push((*cookie, *tracked));
        } else {
            plan.suspects.insert(*cookie);
        }
    }
    plan
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    /// Records removed: their socket was gone.
    pub forgotten: u64,
    /// Of those, the backend ids of records still counted live, whose
    /// count was taken down.
    pub uncounted: Vec<u32>,
    /// Records of other namespaces, not checked.
    pub unchecked: usize,
}

/// Why a pass did not complete.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("dumping this namespace's TCP sockets (sock_diag)")]
    Dump(#[source] io::Error),
}

/// The sweep's memory between passes.
#[derive(Debug)]
pub struct Sweeper {
    interval: Duration,
    next: Instant,
    suspects: HashSet<u64>,
    /// The last pass came soon to confirm suspects: the next one waits the
    /// interval, whatever it suspects (churn always leaves a few).
    confirmed: bool,
}

impl Default for Sweeper {
    fn default() -> Self {
        Self::new()
    }
}

impl Sweeper {
    pub fn new() -> Self {
        let interval = std::env::var(SWEEP_INTERVAL_FOR_TEST)
            .ok()
            .and_then(|text| text.parse::<u64>().ok())
            .map_or(SWEEP_INTERVAL, Duration::from_millis);
        Self {
            interval,
            next: Instant::now() + interval.min(SWEEP_SOON),
            suspects: HashSet::new(),
            confirmed: false,
        }
    }

    /// Whether a pass is due.
    pub fn due(&self, now: Instant) -> bool {
        now >= self.next
    }

    /// Brings the next pass forward: a link was repaired, so the programs
    /// may have missed closes while it was gone.
    pub fn soon(&mut self, now: Instant) {
        self.next = self.next.min(now + self.interval.min(SWEEP_SOON));
    }

    /// One pass: reads the records, then lets `retain_gone` keep, of the
    /// checkable cookies, those of no live socket (a dump of this
    /// namespace), and removes the records of sockets missing from two
    /// dumps in a row. A removed record still counted live has its count
    /// taken down by `uncount(backend_id)`.
    pub fn pass(
        &mut self,
        maps: &mut dyn MapStore,
        host_netns_cookie: u64,
        retain_gone: impl FnOnce(&mut HashSet<u64>, Option<&[SocketAddr]>) -> io::Result<()>,
        mut uncount: impl FnMut(u32) -> bool,
    ) -> Result<Swept, SweepError> {
        let started = Instant::now();
        self.next = started + self.interval;
        let records = maps.tracked_sockets()?;
        let mut gone = checkable(&records, host_netns_cookie);
        let unchecked = records.len() - gone.len();
        if !gone.is_empty() {
            let backends = backends_of(&records, &gone);
            retain_gone(&mut gone, backends.as_deref()).map_err(SweepError::Dump)?;
        }
        let plan = plan_sweep(&records, &gone, &self.suspects);
        self.suspects = plan.suspects;
        self.confirmed = !self.suspects.is_empty() && !self.confirmed;
        if self.confirmed {
            self.next = started + self.interval.min(SWEEP_SOON);
        }
        let mut swept = Swept {
            unchecked,
            ..Swept::default()
        };
        for (cookie, tracked) in plan.forget {
            // Only the remover counts: a kernel program may have taken the
            // record in the meantime, and counted its end itself. A record
            // that changed since the pass read it (its socket connected
            // again, and may be live now) stays: the count is decided on
            // the record removed, never on a stale copy.
            if !maps.forget_socket(cookie, &tracked)? {
                continue;
            }
            swept.forgotten += 1;
            if tracked.record.flags & SOCKET_FLAG_LIVE != 0 && uncount(tracked.record.backend_id) {
                swept.uncounted.push(tracked.record.backend_id);
            }
        }
        Ok(swept)
    }
}

/// How long connects must go on being tracked (the untracked count still)
/// before a full-table episode counts as over.
pub const FULL_EPISODE_QUIET: Duration = Duration::from_secs(10);

/// A change the watch reports, once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FullEvent {
    /// Connects began to go untracked: the table is full.
    Began {
        capacity: u32,
        untracked_before: u64,
    },
    /// None has gone untracked for `FULL_EPISODE_QUIET`.
    Ended { untracked_in_episode: u64 },
}

/// Follows the untracked count, to say once per episode that the socket
/// table is full, and once that it has room again.
#[derive(Debug, Default)]
pub struct FullWatch {
    last: Option<u64>,
    /// The untracked count when the episode began, and when it last grew.
    episode: Option<(u64, Instant)>,
}

impl FullWatch {
    /// Takes one reading of the table's capacity and untracked count.
    pub fn observe(&mut self, capacity: u32, untracked: u64, now: Instant) -> Option<FullEvent> {
        let previous = self.last.replace(untracked)?;
        let grew = untracked > previous;
        match self.episode {
            None if grew => {
                self.episode = Some((previous, now));
                Some(FullEvent::Began {
                    capacity,
                    untracked_before: previous,
                })
            }
            Some((began, _)) if grew => {
                self.episode = Some((began, now));
                None
            }
            Some((began, last_grew)) if now.duration_since(last_grew) >= FULL_EPISODE_QUIET => {
                self.episode = None;
                Some(FullEvent::Ended {
                    untracked_in_episode: untracked - began,
                })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use lb_common::SocketRecord;

    use super::*;

    const HOST: u64 = 4096;

    fn tracked(netns_cookie: u64, flags: u32) -> TrackedSocket {
        TrackedSocket {
            record: SocketRecord {
                backend_id: 7,
                flags,
                ..SocketRecord::default()
            },
            netns_cookie,
        }
    }

    #[test]
    fn fdinfo_gives_size_and_memory() {
        let text = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\nmap_type:\t1\nkey_size:\t8\nvalue_size:\t56\nmax_entries:\t65536\nmap_flags:\t0x0\nmap_extra:\t0x0\nmemlock:\t8394048\nmap_id:\t42\n";
        assert_eq!(
            parse_fdinfo(text),
            Some(MapFdInfo {
                max_entries: 65536,
                memlock: 8_394_048
            })
        );
        assert_eq!(parse_fdinfo("pos:\t0\n"), None);
    }

    /// One plan from records and the cookies a dump saw alive.
    fn plan(
        records: &[(u64, TrackedSocket)],
        alive: &[u64],
        host: u64,
        suspects: &HashSet<u64>,
    ) -> (SweepPlan, usize) {
        let mut gone = checkable(records, host);
        let unchecked = records.len() - gone.len();
        gone.retain(|cookie| !alive.contains(cookie));
        (plan_sweep(records, &gone, suspects), unchecked)
    }

    #[test]
    fn a_record_goes_after_two_dumps_without_its_socket() {
        let records = [
            (1, tracked(HOST, 0)),
            (2, tracked(HOST, SOCKET_FLAG_LIVE)),
            (3, tracked(HOST, 0)),
            (4, tracked(HOST + 1, 0)),
        ];
        let (first, unchecked) = plan(&records, &[3], HOST, &HashSet::new());
        assert!(first.forget.is_empty(), "one missing dump only suspects");
        assert_eq!(first.suspects, [1, 2].into());
        assert_eq!(unchecked, 1, "another namespace is not checked");
        // Socket 1 shows up in the next dump (it was connecting): cleared.
        let (second, _) = plan(&records, &[1, 3], HOST, &first.suspects);
        let forgotten: Vec<u64> = second.forget.iter().map(|(cookie, _)| *cookie).collect();
        assert_eq!(forgotten, [2]);
        assert!(second.suspects.is_empty());
    }

    #[test]
    fn without_a_namespace_cookie_nothing_is_swept() {
        let records = [(1, tracked(0, 0))];
        let (plan, unchecked) = plan(&records, &[], 0, &[1].into());
        assert!(plan.forget.is_empty());
        assert_eq!(unchecked, 1);
    }

    #[test]
    fn the_dump_asks_only_for_the_records_backends() {
        let to = |backend: &str| TrackedSocket {
            record: SocketRecord {
                backend: crate::convert::endpoint(&backend.parse().unwrap()),
                ..SocketRecord::default()
            },
            netns_cookie: HOST,
        };
        let records = [
            (1, to("198.18.0.1:6443")),
            (2, to("198.18.0.2:6443")),
            (3, to("198.18.0.1:6443")),
            (4, to("[fd00::1]:6443")),
        ];
        let backends = |checkable: &[u64]| {
            backends_of(&records, &checkable.iter().copied().collect())
                .map(|backends| backends.iter().map(ToString::to_string).collect::<Vec<_>>())
        };
        assert_eq!(
            backends(&[1, 2, 3, 4]).unwrap(),
            ["198.18.0.1:6443", "198.18.0.2:6443", "[fd00::1]:6443"],
            "each address once"
        );
        assert_eq!(
            backends(&[3]).unwrap(),
            ["198.18.0.1:6443"],
            "only the checkable"
        );
        let odd = [(1, to("198.18.0.1:6443")), (2, tracked(HOST, 0))];
        assert_eq!(
            backends_of(&odd, &[1, 2].into()),
            None,
            "a record without an address: every socket"
        );
        let many: Vec<(u64, TrackedSocket)> = (0..=MAX_FILTERED_BACKENDS as u64)
            .map(|index| (index, to(&format!("198.18.1.1:{}", 1000 + index))))
            .collect();
        let all: HashSet<u64> = many.iter().map(|(cookie, _)| *cookie).collect();
        assert_eq!(backends_of(&many, &all), None, "too many for a filter");
        assert_eq!(
            backends_of(&many[1..], &all).map(|backends| backends.len()),
            Some(MAX_FILTERED_BACKENDS)
        );
    }

    #[test]
    fn a_pass_removes_and_uncounts_what_it_removed() {
        let mut maps = crate::dataplane::MemoryMaps::default();
        maps.tracked.insert(1, tracked(HOST, SOCKET_FLAG_LIVE));
        maps.tracked.insert(2, tracked(HOST, 0));
        maps.tracked.insert(3, tracked(HOST, 0));
        let mut sweeper = Sweeper::new();
        let mut uncounted = Vec::new();
        let retain_gone = |cookies: &mut HashSet<u64>, _: Option<&[SocketAddr]>| {
            cookies.remove(&3);
            Ok(())
        };
        let first = sweeper
            .pass(&mut maps, HOST, retain_gone, |id| {
                uncounted.push(id);
                true
            })
            .unwrap();
        assert_eq!(first.forgotten, 0);
        let second = sweeper
            .pass(&mut maps, HOST, retain_gone, |id| {
                uncounted.push(id);
                true
            })
            .unwrap();
        assert_eq!(second.forgotten, 2);
        assert_eq!(second.uncounted, [7], "the live one is taken off its count");
        assert_eq!(uncounted, [7]);
        assert_eq!(maps.tracked.keys().copied().collect::<Vec<_>>(), [3]);
    }

    #[test]
    fn passes_come_soon_after_a_start_to_confirm_and_after_a_repair() {
        let mut maps = crate::dataplane::MemoryMaps::default();
        maps.tracked.insert(1, tracked(HOST, 0));
        let started = Instant::now();
        let mut sweeper = Sweeper::new();
        assert!(sweeper.next <= started + SWEEP_SOON + Duration::from_millis(100));
        // `retain_gone` keeps the cookies of sockets the dump did not see.
        let none_gone = |cookies: &mut HashSet<u64>, _: Option<&[SocketAddr]>| -> io::Result<()> {
            cookies.clear();
            Ok(())
        };
        let all_gone =
            |_: &mut HashSet<u64>, _: Option<&[SocketAddr]>| -> io::Result<()> { Ok(()) };
        let soon = |sweeper: &Sweeper| sweeper.next <= Instant::now() + SWEEP_SOON;
        // Socket 1 is missing: the confirming pass comes soon, once.
        sweeper.pass(&mut maps, HOST, all_gone, |_| true).unwrap();
        assert!(soon(&sweeper), "confirmed soon");
        maps.tracked.insert(2, tracked(HOST, 0));
        let swept = sweeper.pass(&mut maps, HOST, all_gone, |_| true).unwrap();
        assert_eq!(swept.forgotten, 1);
        assert!(
            !soon(&sweeper),
            "socket 2, suspected now, waits the interval"
        );
        sweeper.soon(Instant::now());
        assert!(soon(&sweeper), "a repaired link brings it forward");
        let swept = sweeper.pass(&mut maps, HOST, none_gone, |_| true).unwrap();
        assert_eq!(swept.forgotten, 0, "socket 2 is there after all");
        assert!(!soon(&sweeper));
    }

    #[test]
    fn a_full_table_is_said_once_per_episode() {
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let mut watch = FullWatch::default();
        let cases = [
            (0, 5, None),
            (1, 5, None),
            (
                2,
                9,
                Some(FullEvent::Began {
                    capacity: 1024,
                    untracked_before: 5,
                }),
            ),
            (3, 20, None),
            (5, 20, None),
            (12, 20, None),
            (
                13,
                20,
                Some(FullEvent::Ended {
                    untracked_in_episode: 15,
                }),
            ),
            (14, 20, None),
            (
                15,
                21,
                Some(FullEvent::Began {
                    capacity: 1024,
                    untracked_before: 20,
                }),
            ),
        ];
        for (second, untracked, want) in cases {
            assert_eq!(
                watch.observe(1024, untracked, at(second)),
                want,
                "at {second} s with {untracked} untracked"
            );
        }
    }
}
