//! The daemon's heap: how glibc's malloc is set up, when freed memory goes
//! back to the system, and what /metrics says of it.
//!
//! The soak (SOAK-FINDINGS §8) found the daemon's anonymous memory creeping
//! by a few hundred KiB an hour: first blocks kept in malloc's per-thread
//! caches (now off), then the heap's resident pages, with what the daemon
//! holds flat. These settings keep that small, and `socklb_heap_bytes`
//! lets an operator tell a leak from the allocator's pages.

use std::time::Duration;

/// How often freed heap memory goes back to the system. glibc returns
/// only the free top of each heap by itself; blocks freed below live ones
/// (a probe's handshake, a reload's or a discovery burst's buffers) stay
/// resident until `malloc_trim` releases their pages. Every 10 s costs
/// well under a millisecond (the heap is a few MB). What it saves over a
/// trim a minute was not told apart from noise: over the soak's long
/// life, the heap's resident pages moved over 168–232 KiB between
/// readings at 10 s, the anonymous memory over 264 KiB at a minute
/// (SOAK-FINDINGS §8).
pub const TRIM_EVERY: Duration = Duration::from_secs(10);

/// Blocks from this size up get their own mapping, returned whole when
/// freed, instead of a place in the heap: a TLS probe's record buffers
/// and certificates, an HTTP connection's 8 KiB read buffer (each /metrics
/// scrape, the API watch), a sweep's socket dump, a status or /metrics
/// text. In the heap, each such buffer leaves a hole that the small
/// blocks allocated meanwhile (timers, tasks, map entries) then pin page
/// by page. One page: a smaller block would take a whole page of its own.
/// (Its effect alone was not measured.)
const OWN_MAPPING_FROM: i32 = 4096;

/// Keeps the daemon's resident memory near what it uses: by default
/// glibc's malloc keeps freed memory at the top of each heap (its trim
/// threshold grows with the largest block freed, to 32 MiB) and makes an
/// arena for every thread that allocates. One arena for every thread: the
/// daemon allocates little and from one event loop at a time, and a
/// second arena, fed by the runtime's worker threads, held its own free
/// pages beside the main heap's (the soak, SOAK-FINDINGS §8: anonymous
/// memory 2.0–2.4 MB with one arena, 2.1–2.6 MB with two). Called before
/// the runtime's threads start.
pub fn limit() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets allocator parameters; called before other
    // threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 * 1024);
        libc::mallopt(libc::M_MMAP_THRESHOLD, OWN_MAPPING_FROM);
    }
}

/// The glibc tunable that turns off malloc's per-thread caches.
const NO_THREAD_CACHE: &str = "glibc.malloc.tcache_count=0";

/// `GLIBC_TUNABLES` with the per-thread caches off, added to what the
/// environment sets; None when it already says how many to keep (an
/// operator's own choice stands).
fn tunables_without_thread_cache(current: Option<&str>) -> Option<String> {
    match current {
        Some(tunables) if tunables.contains("glibc.malloc.tcache_count") => None,
        Some(tunables) if !tunables.is_empty() => Some(format!("{tunables}:{NO_THREAD_CACHE}")),
        _ => Some(NO_THREAD_CACHE.to_string()),
    }
}

/// Starts the daemon again, in the same process, with malloc's per-thread
/// caches off; returns only if that is not needed or not possible.
///
/// Each thread keeps up to seven freed blocks of every size for itself,
/// and the runtime frees on one worker what another allocated: over a
/// long life more and more sizes fill a cache that malloc never trims,
/// and the daemon's memory crept by about 0.7 MB an hour (the soak,
/// SOAK-FINDINGS §8). glibc reads its tunables only when a program
/// starts, hence the exec; the daemon allocates too little for the
/// caches' speed to matter. Called before any thread exists.
pub fn without_thread_caches() {
    #[cfg(target_env = "gnu")]
    {
        use std::os::unix::process::CommandExt;
        let current = std::env::var("GLIBC_TUNABLES").ok();
        let Some(tunables) = tunables_without_thread_cache(current.as_deref()) else {
            return;
        };
        // The binary by its path, not /proc/self/exe: the process is named
        // after what it executes, and `pgrep socklb` must still find it.
        let binary = match std::env::current_exe() {
            Ok(binary) => binary,
            Err(error) => {
                tracing::warn!(
                    "finding socklb's own binary: {error}; running with malloc's per-thread caches"
                );
                return;
            }
        };
        let mut args = std::env::args_os();
        let mut command = std::process::Command::new(binary);
        if let Some(name) = args.next() {
            command.arg0(name);
        }
        let error = command.args(args).env("GLIBC_TUNABLES", &tunables).exec();
        tracing::warn!(
            "starting again with malloc's per-thread caches off ({tunables}): {error}; running with them"
        );
    }
}

/// Returns freed heap memory to the system.
pub fn trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// What malloc holds, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Handed out and not freed: what the daemon holds (heap blocks and
    /// blocks in their own mappings).
    pub in_use: u64,
    /// Freed and kept by malloc in its heap, resident or not.
    pub free: u64,
}

/// malloc's own count (`mallinfo2`); None where the C library is not
/// glibc.
pub fn usage() -> Option<Usage> {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallinfo2 only reads malloc's statistics.
        let info = unsafe { libc::mallinfo2() };
        Some(Usage {
            in_use: (info.uordblks + info.hblkhd) as u64,
            free: info.fordblks as u64,
        })
    }
    #[cfg(not(target_env = "gnu"))]
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_cache_tunable_is_added_once_and_an_operators_own_stands() {
        assert_eq!(
            tunables_without_thread_cache(None).as_deref(),
            Some("glibc.malloc.tcache_count=0")
        );
        assert_eq!(
            tunables_without_thread_cache(Some("")).as_deref(),
            Some("glibc.malloc.tcache_count=0")
        );
        assert_eq!(
            tunables_without_thread_cache(Some("glibc.malloc.check=3")).as_deref(),
            Some("glibc.malloc.check=3:glibc.malloc.tcache_count=0")
        );
        assert_eq!(
            tunables_without_thread_cache(Some("glibc.malloc.tcache_count=2")),
            None
        );
    }

    #[test]
    #[cfg(target_env = "gnu")]
    fn a_block_held_counts_in_use_until_freed() {
        // 64 MiB: far more than the other unit tests, running beside this
        // one, allocate or free meanwhile.
        const BLOCK: u64 = 64 << 20;
        let before = usage().expect("glibc").in_use;
        let held = std::hint::black_box(vec![7u8; BLOCK as usize]);
        let during = usage().expect("glibc").in_use;
        drop(held);
        let after = usage().expect("glibc").in_use;
        assert!(during >= before + BLOCK / 2, "{before} → {during}");
        assert!(after + BLOCK / 2 <= during, "{during} → {after}");
    }
}
